//! Carving one mapping into slots of any size: first fit over the free
//! extents (kept sorted and merged), every extent a multiple of the page,
//! no slot straddling a `piece` boundary (each piece is registered with the
//! rings as one fixed buffer, so a slot inside one piece always has a
//! buffer index). Pure bookkeeping on offsets: no memory is touched here,
//! so it is unit-tested and run under Miri like the window arithmetic.

use std::collections::BTreeMap;

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
        }
    }

    /// `want` bytes rounded up to the unit; `None` when that overflows.
    fn rounded(&self, want: usize) -> Option<usize> {
        want.max(1).checked_add(self.unit - 1).map(|w| w & !(self.unit - 1))
    }

    /// The lowest free extent of `want` bytes (rounded up to the unit) that
    /// crosses no piece boundary: its start. An extent larger than a piece
    /// cannot stay inside one: it is the lowest free run on the unit of that
    /// size, wherever it starts (such a slot has no buffer index). `None`
    /// when no free extent fits.
    pub(crate) fn take(&mut self, want: usize) -> Option<(usize, usize)> {
        let n = self.rounded(want)?;
        let found = self.free.iter().find_map(|(&start, &len)| {
            // The first start on the unit inside this free extent from which
            // n bytes stay within one piece: here, or at the next piece
            // boundary. (Free extents start off the unit only after a placed
            // slot.)
            let end = start + len;
            let mut at = start.checked_add(self.unit - 1)? & !(self.unit - 1);
            if n <= self.piece && at / self.piece != (at + n - 1) / self.piece {
                at = (at / self.piece + 1) * self.piece;
            }
            (at.checked_add(n)? <= end).then_some(at)
        })?;
        self.claim(found, n);
        Some((found, n))
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

    /// The lowest free `[at, at + want)` whose address `base + at` is a
    /// multiple of `align` (a power of two): a window that must start on
    /// an aligned address of memory that may itself start anywhere (a
    /// caller's). Like [`Extents::take`] it stays inside one piece when it
    /// fits in one. Nothing is rounded to the unit.
    pub(crate) fn take_aligned(&mut self, want: usize, align: usize, base: usize) -> Option<(usize, usize)> {
        debug_assert!(align.is_power_of_two());
        let n = want.max(1);
        let found = self.free.iter().find_map(|(&start, &len)| {
            let end = start + len;
            let aligned = |x: usize| -> Option<usize> {
                let addr = base.checked_add(x)?;
                let up = addr.checked_add(align - 1)? & !(align - 1);
                Some(x + (up - addr))
            };
            let mut at = aligned(start)?;
            if n <= self.piece && at / self.piece != (at + n - 1) / self.piece {
                at = aligned((at / self.piece + 1) * self.piece)?;
            }
            (at.checked_add(n)? <= end).then_some(at)
        })?;
        self.claim(found, n);
        Some((found, n))
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
    fn first_fit_rounds_to_the_unit_and_merges_on_return() {
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
        // The hole of 2 units is reused first.
        assert_eq!(e.take(2 * U).unwrap(), (U, 2 * U));
        assert!(e.give_back(U));
        assert!(e.give_back(0));
        assert!(e.give_back(3 * U));
        assert_eq!(e.free_bytes(), 16 * U);
        assert_eq!(e.free.len(), 1, "every free extent merged back: {:?}", e.free);
        assert_eq!(e.used_count(), 0);
    }

    #[test]
    fn aligned_windows_start_on_aligned_addresses_of_any_base() {
        // Memory at address 16 (a Vec's allocation): the first aligned
        // address is offset 4080.
        let mut e = Extents::new(8 * U + 100, U, 1 << 30);
        assert_eq!(e.take_aligned(5000, U, 16), Some((U - 16, 5000)));
        // Next: the first aligned address after that window's end.
        let (at, n) = e.take_aligned(10, U, 16).unwrap();
        assert_eq!(((16 + at) % U, n), (0, 10));
        assert!(at >= U - 16 + 5000);
        // Too big for what is left: None, nothing claimed.
        let free = e.free_bytes();
        assert_eq!(e.take_aligned(7 * U, U, 16), None);
        assert_eq!(e.free_bytes(), free);
        // Head room below the first window is still free for exact slots.
        assert_eq!(e.take_at(0, U - 16), Some((0, U - 16)));
        // A window never crosses a piece when it fits in one.
        let mut e = Extents::new(8 * U, U, 4 * U);
        assert_eq!(e.take_aligned(3 * U, U, 0), Some((0, 3 * U)));
        assert_eq!(e.take_aligned(2 * U, U, 0), Some((4 * U, 2 * U)));
    }

    #[test]
    fn no_slot_straddles_a_piece() {
        let mut e = Extents::new(8 * U, U, 4 * U);
        assert_eq!(e.take(3 * U).unwrap(), (0, 3 * U));
        // 2 units would cross the boundary at 4: it starts at the next piece.
        assert_eq!(e.take(2 * U).unwrap(), (4 * U, 2 * U));
        assert_eq!(e.take(U).unwrap(), (3 * U, U));
        assert!(e.take(5 * U).is_none(), "no free run that long");
        assert!(e.take(3 * U).is_none(), "only 2 units left in the last piece");
        assert_eq!(e.take(2 * U).unwrap(), (6 * U, 2 * U));
        assert!(e.take(1).is_none());
    }

    /// An extent larger than a piece cannot stay inside one: it takes the
    /// lowest free run of its size, across piece boundaries.
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
        // Placed anywhere, any length; a first-fit slot after it starts on
        // the unit again.
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

    /// Random takes and returns against a byte map: no two live extents
    /// overlap, none crosses a piece, and everything returns.
    #[test]
    fn random_use_never_overlaps() {
        let (len, piece) = (64 * U, 16 * U);
        let mut e = Extents::new(len, U, piece);
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
                }
            } else {
                let k = (next() % live.len() as u64) as usize;
                let (at, n, _) = live.swap_remove(k);
                assert!(e.give_back(at));
                owner[at / U..(at + n) / U].fill(0);
            }
        }
        for (at, _, _) in live.drain(..) {
            assert!(e.give_back(at));
        }
        assert_eq!(e.free_bytes(), len);
        assert_eq!(e.free.len(), 1);
    }
}
