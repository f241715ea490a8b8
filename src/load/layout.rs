//! Where each tensor of a whole-model load lands in the one mapping,
//! computed before anything is mapped or read. Pure arithmetic on offsets
//! (no memory, no I/O), so it is unit-tested on its own.
//!
//! The rule, per tensor, in the load's order:
//!
//! - Its alignment `a` is the larger of the element size of its dtype (1
//!   for sub-byte dtypes) and the load's chosen alignment.
//! - **In place** when `pad = file offset % block` is a multiple of `a`
//!   (with `a <= block`: when the file offset itself is): the slot starts
//!   on a `unit` boundary (the page, or the block when larger), the
//!   payload lands `pad` bytes in, and the slot runs to the next `unit`
//!   boundary after the payload, so the last partial block goes O_DIRECT
//!   too (tail room). The payload's address is then `pad` mod `a` = 0.
//!   A slot no larger than a registered piece never crosses a piece
//!   boundary (it moves to the next piece).
//! - **Placed** otherwise (and for an empty payload): the payload lands at
//!   the next multiple of `a`, with nothing around it; its blocks are
//!   read O_DIRECT into the engine's staging and the payload copied into
//!   place (counted in `Stats::staged`; buffered into place only where no
//!   copy of the file opens O_DIRECT).

/// One tensor to place: its absolute file offset, its payload length, and
/// the alignment its payload needs (a power of two, at most `block`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Item {
    pub(crate) offset: u64,
    pub(crate) len: u64,
    pub(crate) align: usize,
}

/// Where one tensor lands: its slot `[at, at + len)` in the mapping.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Place {
    pub(crate) at: usize,
    pub(crate) len: usize,
    /// The O_DIRECT window starts at `at` and the payload lands `offset %
    /// block` bytes in; else the payload lands at `at` exactly (buffered).
    pub(crate) in_place: bool,
}

/// The whole layout: one place per item, in the items' order, and the
/// mapping's length (a multiple of `unit`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Layout {
    pub(crate) places: Vec<Place>,
    pub(crate) bytes: usize,
}

use crate::memory::arena::{in_place_bytes, round_up};

/// Lays `items` out one after the other. `block` is the O_DIRECT alignment
/// (a power of two), `unit` the slot granularity (a power of two, a
/// multiple of `block`), `piece` the registered-buffer span (a multiple of
/// `unit`). `None` when a size overflows `usize` or `isize::MAX`.
pub(crate) fn plan(items: &[Item], block: usize, unit: usize, piece: usize) -> Option<Layout> {
    debug_assert!(block.is_power_of_two() && unit.is_power_of_two() && unit.is_multiple_of(block));
    debug_assert!(piece.is_multiple_of(unit));
    let mut cursor = 0usize;
    let mut places = Vec::with_capacity(items.len());
    for it in items {
        debug_assert!(it.align.is_power_of_two() && it.align <= block);
        let len = usize::try_from(it.len).ok()?;
        let pad = (it.offset % block as u64) as usize;
        let place = if len > 0 && pad.is_multiple_of(it.align) {
            // The slot `Arena::take_for` would carve, to the next unit.
            let slot = round_up(in_place_bytes(it.offset, it.len, block)?, unit)?;
            let mut at = round_up(cursor, unit)?;
            if slot <= piece && at / piece != at.checked_add(slot - 1)? / piece {
                at = (at / piece + 1).checked_mul(piece)?;
            }
            Place {
                at,
                len: slot,
                in_place: true,
            }
        } else {
            Place {
                at: round_up(cursor, it.align)?,
                len: len.max(1),
                in_place: false,
            }
        };
        cursor = place.at.checked_add(place.len)?;
        places.push(place);
    }
    let bytes = round_up(cursor.max(1), unit)?;
    (bytes <= isize::MAX as usize).then_some(Layout { places, bytes })
}

#[cfg(test)]
mod tests {
    use super::*;

    const B: usize = 4096;

    fn item(offset: u64, len: u64, align: usize) -> Item {
        Item { offset, len, align }
    }

    #[test]
    fn in_place_slots_hold_pad_payload_and_tail_room_on_page_boundaries() {
        let l = plan(
            &[item(2760, 10_000, 2), item(12_760, 4096, 2), item(16_856, 5760, 2)],
            B,
            B,
            1 << 30,
        )
        .unwrap();
        // 2760 + 10000 = 12760 -> 16384 (4 pages).
        assert_eq!(
            l.places[0],
            Place {
                at: 0,
                len: 4 * B,
                in_place: true
            }
        );
        // pad 12760 % 4096 = 472; 472 + 4096 -> 2 pages.
        assert_eq!(
            l.places[1],
            Place {
                at: 4 * B,
                len: 2 * B,
                in_place: true
            }
        );
        assert_eq!(l.places[2].at, 6 * B);
        assert_eq!(l.bytes, l.places[2].at + l.places[2].len);
        for (p, it) in l.places.iter().zip([2760u64, 12_760, 16_856]) {
            // The payload's address within its page is the file's, and even.
            assert_eq!((p.at + (it % B as u64) as usize) % 2, 0);
        }
    }

    #[test]
    fn payloads_whose_offset_is_not_aligned_are_placed_at_the_next_multiple() {
        // 64-byte alignment asked: offset 2760 is 8 mod 64 -> placed.
        let l = plan(
            &[item(2760, 100, 64), item(4096 * 3, 5000, 64), item(8, 3, 64)],
            B,
            B,
            1 << 30,
        )
        .unwrap();
        assert_eq!(
            l.places[0],
            Place {
                at: 0,
                len: 100,
                in_place: false
            }
        );
        // The next in-place slot starts on a page after it.
        assert_eq!(
            l.places[1],
            Place {
                at: B,
                len: 2 * B,
                in_place: true
            }
        );
        assert_eq!(
            l.places[2],
            Place {
                at: 3 * B,
                len: 3,
                in_place: false
            }
        );
        assert_eq!(l.bytes, 4 * B);
        // Every payload address is 64-aligned relative to a page-aligned base.
        for (p, off) in l.places.iter().zip([2760u64, 4096 * 3, 8]) {
            let addr = p.at + if p.in_place { (off % B as u64) as usize } else { 0 };
            assert_eq!(addr % 64, 0, "{p:?}");
        }
    }

    #[test]
    fn empty_payloads_take_one_placed_byte_each() {
        let l = plan(&[item(100, 0, 1), item(100, 0, 1), item(100, 8, 1)], B, B, 1 << 30).unwrap();
        assert_eq!(
            l.places[0],
            Place {
                at: 0,
                len: 1,
                in_place: false
            }
        );
        assert_eq!(
            l.places[1],
            Place {
                at: 1,
                len: 1,
                in_place: false
            }
        );
        assert_eq!(
            l.places[2],
            Place {
                at: B,
                len: B,
                in_place: true
            }
        );
    }

    #[test]
    fn a_slot_moves_to_the_next_piece_rather_than_cross_one_unless_it_is_larger() {
        let piece = 4 * B;
        let l = plan(
            &[
                item(0, 3 * B as u64, 1),
                item(0, 2 * B as u64, 1),
                item(0, 9 * B as u64, 1),
            ],
            B,
            B,
            piece,
        )
        .unwrap();
        assert_eq!(l.places[0].at, 0);
        assert_eq!(l.places[1].at, piece, "would cross the boundary at 4 pages");
        assert_eq!(
            l.places[2],
            Place {
                at: 6 * B,
                len: 9 * B,
                in_place: true
            },
            "larger than a piece: anywhere"
        );
        assert_eq!(l.bytes, 15 * B);
    }

    #[test]
    fn a_larger_unit_rounds_slots_to_it() {
        let l = plan(&[item(512, 1000, 1), item(0, 1, 1)], 512, 65536, 1 << 30).unwrap();
        assert_eq!(
            l.places[0],
            Place {
                at: 0,
                len: 65536,
                in_place: true
            }
        );
        assert_eq!(l.places[1].at, 65536);
    }

    #[test]
    fn overflow_is_none() {
        assert!(plan(&[item(0, u64::MAX, 1)], B, B, 1 << 30).is_none());
        assert!(plan(&[item(0, (isize::MAX as u64) - 10, 1)], B, B, 1 << 30).is_none());
    }

    /// Slots never overlap, each holds its payload where the rule says, and
    /// the mapping holds every slot: random items, checked against a walk.
    #[test]
    fn random_layouts_are_disjoint_and_aligned() {
        let mut x: u64 = 0x2545_f491_4f6c_dd1d;
        let mut next = || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        for _ in 0..200 {
            let n = (next() % 40) as usize + 1;
            let items: Vec<Item> = (0..n)
                .map(|_| item(next() % 100_000, next() % 30_000, 1 << (next() % 7)))
                .collect();
            let piece = 16 * B;
            let l = plan(&items, B, B, piece).unwrap();
            let mut spans: Vec<(usize, usize)> = l.places.iter().map(|p| (p.at, p.at + p.len)).collect();
            spans.sort();
            for w in spans.windows(2) {
                assert!(w[0].1 <= w[1].0, "overlap {w:?}");
            }
            assert!(spans.last().unwrap().1 <= l.bytes && l.bytes.is_multiple_of(B));
            for (p, it) in l.places.iter().zip(&items) {
                let pad = (it.offset % B as u64) as usize;
                if p.in_place {
                    assert!(p.at.is_multiple_of(B) && p.len.is_multiple_of(B));
                    assert!(pad + it.len as usize <= p.len);
                    assert_eq!((p.at + pad) % it.align, 0);
                    if p.len <= piece {
                        assert_eq!(p.at / piece, (p.at + p.len - 1) / piece);
                    }
                } else {
                    assert!(it.len == 0 || !pad.is_multiple_of(it.align));
                    assert_eq!(p.at % it.align, 0);
                    assert_eq!(p.len, (it.len as usize).max(1));
                }
            }
        }
    }
}
