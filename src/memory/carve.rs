//! Carving one mapping into slots of any size: next fit over the free
//! extents (kept sorted and merged; the search starts where the last
//! extent taken ended and wraps once), every extent a multiple of the page,
//! no slot straddling a `piece` boundary (each piece is registered with the
//! rings as one fixed buffer, so a slot inside one piece always has a
//! buffer index). Pure bookkeeping on offsets: no memory is touched here,
//! so it is unit-tested and run under Miri like the window arithmetic.
//!
//! Why next fit: a decode loop takes a batch of slots, then returns the
//! oldest batch (a few batches in flight). First fit puts each new slot in
//! the lowest hole, between slots still out, and the holes left when the
//! oldest batch goes are too small for the next large slot: the arena
//! fragments. Next fit takes from where the last slot ended, so slots
//! returned oldest first free the space ahead of the roving start and the
//! arena is used as a ring.

use std::collections::BTreeMap;

use crate::error::TakeError;

/// The free and used extents of one mapping, as byte offsets.
#[derive(Debug)]
pub(crate) struct Extents {
    len: usize,
    unit: usize,
    piece: usize,
    /// start -> length of each free extent; adjacent free extents merged.
    free: BTreeMap<usize, usize>,
    /// start -> length of each extent handed out.
    used: BTreeMap<usize, usize>,
    /// Where the next search starts: the end of the last extent [`take`]
    /// handed out (0 at the end of the mapping).
    ///
    /// [`take`]: Extents::take
    rove: usize,
    /// Next fit (the policy); false only in the tests that show what first
    /// fit does (the search then always starts at 0).
    roving: bool,
}

impl Extents {
    /// `len` bytes, every extent a multiple of `unit` (a power of two), none
    /// crossing a multiple of `piece` (itself a multiple of `unit`).
    pub(crate) fn new(len: usize, unit: usize, piece: usize) -> Self {
        debug_assert!(unit.is_power_of_two() && piece.is_multiple_of(unit));
        let mut free = BTreeMap::new();
        if len > 0 {
            free.insert(0, len);
        }
        Extents {
            len,
            unit,
            piece,
            free,
            used: BTreeMap::new(),
            rove: 0,
            roving: true,
        }
    }

    /// The same extents carved first fit (every search from offset 0): the
    /// old policy, kept to show the fragmentation next fit avoids.
    #[cfg(test)]
    pub(crate) fn first_fit(mut self) -> Self {
        self.roving = false;
        self
    }

    /// `want` bytes rounded up to the unit; `None` when that overflows.
    fn rounded(&self, want: usize) -> Option<usize> {
        want.max(1).checked_add(self.unit - 1).map(|w| w & !(self.unit - 1))
    }

    /// The first start on the unit in `[lo, hi)` from which `n` bytes (a
    /// multiple of the unit) stay inside `[lo, hi)` and within one piece:
    /// `lo` rounded up, or the next piece boundary. An extent larger than a
    /// piece cannot stay inside one: it only has to fit.
    fn fit(&self, lo: usize, hi: usize, n: usize) -> Option<usize> {
        let mut at = lo.checked_add(self.unit - 1)? & !(self.unit - 1);
        if n <= self.piece && at / self.piece != (at + n - 1) / self.piece {
            at = (at / self.piece + 1) * self.piece;
        }
        (at.checked_add(n)? <= hi).then_some(at)
    }

    /// A free extent of `want` bytes (rounded up to the unit) that crosses
    /// no piece boundary, next fit: the first one at or after the end of
    /// the last extent taken, else (wrapping once) the first from the
    /// start of the mapping. Returns its start and length. An extent larger
    /// than a piece cannot stay inside one: it is the first free run on the
    /// unit of that size, wherever it starts (such a slot has no buffer
    /// index). `None` when no free extent fits ([`Extents::refusal`] says
    /// why).
    pub(crate) fn take(&mut self, want: usize) -> Option<(usize, usize)> {
        let n = self.rounded(want)?;
        let from = if self.roving { self.rove } else { 0 };
        // From `from` to the end: the rest of the free extent holding it,
        // then every later one; then, wrapped, every extent that starts
        // before it (whole: its bytes before `from` too).
        let holding = self
            .free
            .range(..=from)
            .next_back()
            .map(|(&s, &l)| (from, s + l))
            .filter(|&(lo, hi)| hi > lo);
        let after = self.free.range(from.saturating_add(1)..).map(|(&s, &l)| (s, s + l));
        let wrapped = self.free.range(..from).map(|(&s, &l)| (s, s + l));
        let found = holding
            .into_iter()
            .chain(after)
            .chain(wrapped)
            .find_map(|(lo, hi)| self.fit(lo, hi, n))?;
        self.claim(found, n);
        if self.roving {
            self.rove = if found + n >= self.len { 0 } else { found + n };
        }
        Some((found, n))
    }

    /// Why [`Extents::take`] of `want` bytes found nothing: the slot is
    /// larger than the mapping (`NeverFits`), fewer bytes are free
    /// (`Full`), or the free bytes are in holes none of which holds it
    /// (`Fragmented`, with the largest hole).
    pub(crate) fn refusal(&self, want: usize) -> TakeError {
        let need = self.rounded(want).unwrap_or(want);
        let free = self.free_bytes();
        if need > self.len || self.rounded(want).is_none() {
            TakeError::NeverFits {
                field: "bytes",
                need,
                have: self.len,
            }
        } else if free < need {
            TakeError::Full {
                need,
                free,
                bytes: self.len,
            }
        } else {
            TakeError::Fragmented {
                need,
                free,
                largest: self.largest_hole(),
                bytes: self.len,
            }
        }
    }

    /// The largest hole: the longest run of whole units free in one free
    /// extent (from its first unit boundary to its last), piece boundaries
    /// aside. A take of more can only fail; one of at most this can still
    /// fail when it would cross a piece boundary.
    pub(crate) fn largest_hole(&self) -> usize {
        let mask = !(self.unit - 1);
        self.free
            .iter()
            .map(|(&s, &l)| {
                let lo = s.saturating_add(self.unit - 1) & mask;
                ((s + l) & mask).saturating_sub(lo)
            })
            .max()
            .unwrap_or(0)
    }

    /// Exactly `[at, at + want)` (at least one byte), if it is wholly free:
    /// any offset and length, as a caller places a payload. A placed slot
    /// may cross a piece boundary (it then has no buffer index).
    pub(crate) fn take_at(&mut self, at: usize, want: usize) -> Option<(usize, usize)> {
        let n = want.max(1);
        if at.checked_add(n).is_none_or(|end| end > self.len) {
            return None;
        }
        let (&start, &len) = self.free.range(..=at).next_back()?;
        if at + n > start + len {
            return None;
        }
        self.claim(at, n);
        Some((at, n))
    }

    /// Marks `[at, at + n)`, inside one free extent, used.
    fn claim(&mut self, at: usize, n: usize) {
        let (&start, &len) = self.free.range(..=at).next_back().expect("inside a free extent");
        self.free.remove(&start);
        if at > start {
            self.free.insert(start, at - start);
        }
        if start + len > at + n {
            self.free.insert(at + n, start + len - (at + n));
        }
        self.used.insert(at, n);
    }

    /// Returns the extent that starts at `at`, merging it with free
    /// neighbours. False when no extent handed out starts there.
    pub(crate) fn give_back(&mut self, at: usize) -> bool {
        let Some(n) = self.used.remove(&at) else {
            return false;
        };
        let (mut start, mut len) = (at, n);
        if let Some((&ps, &pl)) = self.free.range(..at).next_back() {
            if ps + pl == at {
                self.free.remove(&ps);
                start = ps;
                len += pl;
            }
        }
        if let Some(&nl) = self.free.get(&(at + n)) {
            self.free.remove(&(at + n));
            len += nl;
        }
        self.free.insert(start, len);
        true
    }

    /// Bytes not handed out.
    pub(crate) fn free_bytes(&self) -> usize {
        self.free.values().sum()
    }

    /// Extents handed out.
    pub(crate) fn used_count(&self) -> usize {
        self.used.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const U: usize = 4096;

    #[test]
    fn next_fit_rounds_to_the_unit_roves_and_merges_on_return() {
        let mut e = Extents::new(16 * U, U, 16 * U);
        let a = e.take(1).unwrap();
        assert_eq!(a, (0, U));
        let b = e.take(U + 1).unwrap();
        assert_eq!(b, (U, 2 * U));
        let c = e.take(3 * U).unwrap();
        assert_eq!(c, (3 * U, 3 * U));
        assert_eq!(e.free_bytes(), 10 * U);
        assert!(e.give_back(b.0));
        assert!(!e.give_back(b.0), "returned twice");
        // Next fit: from where the last take ended, not the lowest hole.
        assert_eq!(e.take(2 * U).unwrap(), (6 * U, 2 * U));
        // To the very end: the search starts at 0 again (the wrap).
        assert_eq!(e.take(8 * U).unwrap(), (8 * U, 8 * U));
        assert_eq!(e.take(2 * U).unwrap(), (U, 2 * U), "the hole, found after the wrap");
        for at in [0, U, 3 * U, 6 * U, 8 * U] {
            assert!(e.give_back(at));
        }
        assert_eq!(e.free_bytes(), 16 * U);
        assert_eq!(e.free.len(), 1, "every free extent merged back: {:?}", e.free);
        assert_eq!(e.used_count(), 0);
    }

    #[test]
    fn first_fit_takes_the_lowest_hole() {
        let mut e = Extents::new(16 * U, U, 16 * U).first_fit();
        assert_eq!(e.take(1).unwrap(), (0, U));
        assert_eq!(e.take(U + 1).unwrap(), (U, 2 * U));
        assert_eq!(e.take(3 * U).unwrap(), (3 * U, 3 * U));
        assert!(e.give_back(U));
        assert_eq!(e.take(2 * U).unwrap(), (U, 2 * U));
    }

    #[test]
    fn no_slot_straddles_a_piece() {
        let mut e = Extents::new(8 * U, U, 4 * U);
        assert_eq!(e.take(3 * U).unwrap(), (0, 3 * U));
        // 2 units would cross the boundary at 4: it starts at the next piece.
        assert_eq!(e.take(2 * U).unwrap(), (4 * U, 2 * U));
        assert_eq!(e.take(U).unwrap(), (6 * U, U));
        assert_eq!(e.take(U).unwrap(), (7 * U, U));
        // Wrapped: the unit skipped before the boundary.
        assert_eq!(e.take(U).unwrap(), (3 * U, U));
        assert!(e.take(1).is_none());
        assert!(e.give_back(4 * U));
        assert!(e.take(5 * U).is_none(), "no free run that long");
        assert!(e.take(3 * U).is_none(), "only 2 units free");
        assert_eq!(e.take(2 * U).unwrap(), (4 * U, 2 * U));
    }

    /// An extent larger than a piece cannot stay inside one: it takes the
    /// first free run of its size, across piece boundaries.
    #[test]
    fn an_extent_larger_than_a_piece_spans_pieces() {
        let mut e = Extents::new(12 * U, U, 4 * U);
        assert_eq!(e.take(U).unwrap(), (0, U));
        assert_eq!(e.take(6 * U).unwrap(), (U, 6 * U), "crosses the boundary at 4");
        assert!(e.take(6 * U).is_none(), "5 units left");
        assert_eq!(e.take(2 * U).unwrap(), (8 * U, 2 * U), "a small one stays in a piece");
        assert!(e.give_back(U));
        assert_eq!(e.take(5 * U).unwrap(), (U, 5 * U));
    }

    #[test]
    fn placed_extents_must_be_free_aligned_and_inside() {
        let mut e = Extents::new(8 * U, U, 8 * U);
        assert_eq!(e.take_at(2 * U, U).unwrap(), (2 * U, U));
        assert!(e.take_at(2 * U, U).is_none(), "overlaps a used extent");
        assert!(e.take_at(U, 2 * U).is_none(), "runs into a used extent");
        assert!(e.take_at(7 * U, 2 * U).is_none(), "past the end");
        assert!(e.take_at(usize::MAX & !(U - 1), U).is_none(), "overflow");
        assert_eq!(e.take_at(3 * U, 5 * U).unwrap(), (3 * U, 5 * U));
        assert_eq!(e.take(U).unwrap(), (0, U));
        assert!(e.give_back(2 * U));
        assert_eq!(e.take(U).unwrap(), (U, U));
        // Placed anywhere, any length; a slot taken after it starts on the
        // unit again.
        let mut e = Extents::new(8 * U, U, 8 * U);
        assert_eq!(e.take_at(100, 1000).unwrap(), (100, 1000));
        assert!(e.take_at(1099, 1).is_none(), "the last placed byte");
        assert_eq!(e.take_at(1100, 1).unwrap(), (1100, 1));
        assert_eq!(e.take(U).unwrap(), (U, U));
        assert_eq!(e.take_at(0, 100).unwrap(), (0, 100));
        for at in [0, 100, 1100, U] {
            assert!(e.give_back(at));
        }
        assert_eq!(e.free_bytes(), 8 * U);
        assert_eq!(e.free.len(), 1);
    }

    /// The largest hole counts whole units only (a free extent after a
    /// placed slot starts off the unit), and the refusal names it.
    #[test]
    fn the_refusal_says_full_fragmented_or_never() {
        let mut e = Extents::new(8 * U, U, 8 * U);
        assert_eq!(e.largest_hole(), 8 * U);
        assert_eq!(
            e.refusal(9 * U),
            TakeError::NeverFits {
                field: "bytes",
                need: 9 * U,
                have: 8 * U
            }
        );
        assert!(matches!(e.refusal(usize::MAX), TakeError::NeverFits { .. }));
        for at in [0, 2 * U, 4 * U, 6 * U] {
            assert_eq!(e.take_at(at, U).unwrap(), (at, U));
        }
        // Holes of one unit at 1, 3, 5, 7: 4 units free, none 2 long.
        assert_eq!(e.largest_hole(), U);
        assert!(e.take(2 * U).is_none());
        assert_eq!(
            e.refusal(2 * U),
            TakeError::Fragmented {
                need: 2 * U,
                free: 4 * U,
                largest: U,
                bytes: 8 * U
            }
        );
        assert_eq!(
            e.refusal(5 * U - 1),
            TakeError::Full {
                need: 5 * U,
                free: 4 * U,
                bytes: 8 * U
            }
        );
        // A hole from byte 100 to 2U holds one whole unit.
        assert!(e.give_back(0));
        assert_eq!(e.take_at(0, 100).unwrap(), (0, 100));
        assert_eq!(e.largest_hole(), U);
        assert_eq!(e.free_bytes(), 5 * U - 100);
        // A hole that fits but crosses a piece: still Fragmented.
        let mut e = Extents::new(8 * U, U, 4 * U);
        assert_eq!(e.take_at(0, 3 * U).unwrap(), (0, 3 * U));
        assert_eq!(e.take_at(5 * U, 3 * U).unwrap(), (5 * U, 3 * U));
        assert!(e.take(2 * U).is_none(), "[3, 5) crosses the piece boundary at 4");
        assert_eq!(
            e.refusal(2 * U),
            TakeError::Fragmented {
                need: 2 * U,
                free: 2 * U,
                largest: 2 * U,
                bytes: 8 * U
            }
        );
    }

    /// Random takes and returns against a byte map: no two live extents
    /// overlap, none crosses a piece, and everything returns.
    #[test]
    fn random_use_never_overlaps() {
        for first_fit in [false, true] {
            let (len, piece) = (64 * U, 16 * U);
            let mut e = Extents::new(len, U, piece);
            if first_fit {
                e = e.first_fit();
            }
            let mut owner = vec![0u32; len / U];
            let mut live: Vec<(usize, usize, u32)> = Vec::new();
            let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
            let mut next = || {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x
            };
            for id in 1..2000u32 {
                if live.is_empty() || next() % 3 != 0 {
                    let want = (next() % (6 * U as u64)) as usize + 1;
                    if let Some((at, n)) = e.take(want) {
                        assert!(n >= want && n.is_multiple_of(U));
                        assert_eq!(at / piece, (at + n - 1) / piece, "straddles a piece");
                        for o in &mut owner[at / U..(at + n) / U] {
                            assert_eq!(*o, 0, "overlap");
                            *o = id;
                        }
                        live.push((at, n, id));
                    } else {
                        assert!(!matches!(e.refusal(want), TakeError::NeverFits { .. }));
                    }
                } else {
                    let k = (next() % live.len() as u64) as usize;
                    let (at, n, _) = live.swap_remove(k);
                    assert!(e.give_back(at));
                    owner[at / U..(at + n) / U].fill(0);
                }
                // The largest hole is a run of free units in the byte map.
                let longest = owner.split(|&o| o != 0).map(|run| run.len() * U).max().unwrap_or(0);
                assert_eq!(e.largest_hole(), longest);
            }
            for (at, _, _) in live.drain(..) {
                assert!(e.give_back(at));
            }
            assert_eq!(e.free_bytes(), len);
            assert_eq!(e.free.len(), 1);
        }
    }

    /// A decode loop in units: each step takes one batch (`sizes`, in
    /// units), then returns the oldest batch once `in_flight` are out.
    /// Returns the first refusal (step, slot, why), or None when every take
    /// succeeded. Checks no overlap and no piece straddled on the way.
    fn run_fifo(e: &mut Extents, steps: &[Vec<usize>], in_flight: usize) -> Option<(usize, usize, TakeError)> {
        let mut owner = vec![false; e.len.div_ceil(e.unit)];
        let mut out: std::collections::VecDeque<Vec<(usize, usize)>> = Default::default();
        for (i, batch) in steps.iter().enumerate() {
            let mut taken = Vec::new();
            for (j, &units) in batch.iter().enumerate() {
                let Some((at, n)) = e.take(units * e.unit) else {
                    return Some((i, j, e.refusal(units * e.unit)));
                };
                assert_eq!(n, units * e.unit);
                if n <= e.piece {
                    assert_eq!(at / e.piece, (at + n - 1) / e.piece, "straddles a piece");
                }
                for o in &mut owner[at / e.unit..(at + n) / e.unit] {
                    assert!(!*o, "overlap");
                    *o = true;
                }
                taken.push((at, n));
            }
            out.push_back(taken);
            if out.len() == in_flight {
                for (at, n) in out.pop_front().expect("a batch out") {
                    assert!(e.give_back(at));
                    owner[at / e.unit..(at + n) / e.unit].fill(false);
                }
            }
        }
        None
    }

    /// First fit fragments the pattern next fit carves as a ring: the
    /// small slots of later steps take the lowest holes, between slots
    /// still out, and when the large one comes the free bytes (15 units of
    /// the 8 it needs) are in holes of at most 6. The same steps in the
    /// same mapping under next fit: every take succeeds.
    #[test]
    fn first_fit_fragments_a_fifo_that_next_fit_does_not() {
        let steps: Vec<Vec<usize>> = vec![vec![1, 4], vec![1, 1], vec![2, 2, 4], vec![2, 4, 2], vec![8]];
        let len = 23 * U;
        assert_eq!(run_fifo(&mut Extents::new(len, U, 1 << 30), &steps, 2), None);
        let failed = run_fifo(&mut Extents::new(len, U, 1 << 30).first_fit(), &steps, 2);
        assert_eq!(
            failed,
            Some((
                4,
                0,
                TakeError::Fragmented {
                    need: 8 * U,
                    free: 15 * U,
                    largest: 6 * U,
                    bytes: len
                }
            ))
        );
    }
}
