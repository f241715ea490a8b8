//! `Window::plan` against a naive, independently written oracle.
//!
//! The oracle knows nothing of masks or the planner's formulas: it finds the
//! window start by division, the direct length by trying every whole number
//! of blocks, and checks coverage byte by byte (which file bytes the O_DIRECT
//! part reads, which the buffered tail reads, and where each lands in the
//! slot). Sizes stay small enough (a few blocks of 64 KiB) for the byte walk;
//! a second property covers offsets near `u64::MAX` with closed forms in
//! u128, where the planner must not overflow.

use proptest::prelude::*;
use weightstream::__internal::chunk_split;
use weightstream::__internal::{round_up, Window, WindowError};
use weightstream::SlotSpec;

/// What the contract says one planned read must be.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Expected {
    start: u64,
    pad: u64,
    direct: u64,
    tail: u64,
}

/// Smallest multiple of `align` that is >= `x` (by division, in u128).
fn ceil_to(x: u128, align: u128) -> u128 {
    x.div_ceil(align) * align
}

/// The naive oracle. `None`: the range is not inside the file.
///
/// - the window starts at the largest multiple of `align` that is <= `off`;
/// - the direct part is the largest whole number of blocks `k * align` with
///   `start + k * align <= size` (EOF clamp) and, without tail room,
///   `start + k * align <= off + len`, with tail room
///   `start + k * align <= ceil_to(off + len)`;
/// - the tail is every payload byte the direct part does not cover;
/// - a zero-length payload reads nothing.
///
/// Found by counting blocks up from zero (the constraints are monotone), so
/// it shares no arithmetic with the planner.
fn oracle(off: u64, len: u64, size: u64, align: u64, tail_room: bool) -> Option<Expected> {
    let end = off as u128 + len as u128;
    if end > size as u128 {
        return None;
    }
    let a = align as u128;
    let start = off as u128 / a * a;
    if len == 0 {
        // "Reads of 0 bytes are no-ops" (FIELD-NOTES).
        return Some(Expected {
            start: start as u64,
            pad: (off as u128 - start) as u64,
            direct: 0,
            tail: 0,
        });
    }
    let limit = if tail_room { ceil_to(end, a) } else { end };
    let mut k: u128 = 0;
    while start + (k + 1) * a <= size as u128 && start + (k + 1) * a <= limit {
        k += 1;
    }
    let direct = k * a;
    let direct_end = start + direct;
    let tail = if direct_end >= end {
        0
    } else if direct_end <= off as u128 {
        len as u128
    } else {
        end - direct_end
    };
    Some(Expected {
        start: start as u64,
        pad: (off as u128 - start) as u64,
        direct: direct as u64,
        tail: tail as u64,
    })
}

/// Byte-by-byte: every payload byte is read exactly once (by the direct part
/// or by the tail), the direct part reads no byte the contract forbids, and
/// every byte lands in the slot at `file offset - window start`.
fn check_bytes(w: &Window, off: u64, len: u64, size: u64, align: u64, tail_room: bool) -> Result<(), TestCaseError> {
    let start = w.start;
    let direct_end = start + w.direct as u64;
    let tail_from = w.tail_file_offset();
    let tail_to = tail_from + w.tail as u64;
    let end = off + len;
    let room_end = if tail_room {
        ceil_to(end as u128, align as u128) as u64
    } else {
        end
    };
    for p in off..end {
        let by_direct = (start..direct_end).contains(&p) as u32;
        let by_tail = (tail_from..tail_to).contains(&p) as u32;
        prop_assert_eq!(
            by_direct + by_tail,
            1,
            "payload byte {} read {} times: {:?}",
            p,
            by_direct + by_tail,
            w
        );
    }
    // The tail reads payload bytes only.
    prop_assert!(
        w.tail == 0 || (tail_from >= off && tail_to <= end),
        "tail outside the payload: {:?}",
        w
    );
    // The direct part: the bytes before `off` are scratch (allowed); after the
    // payload only up to the reserved room; never past the end of the file.
    if w.direct > 0 {
        let last = direct_end - 1;
        prop_assert!(
            last < size,
            "direct reads byte {} of a {}-byte file: {:?}",
            last,
            size,
            w
        );
        prop_assert!(
            last < room_end,
            "direct writes byte {} past the allowed end {}: {:?}",
            last,
            room_end,
            w
        );
    }
    // Where the tail lands: file byte p goes to slot offset p - start.
    if w.tail > 0 {
        prop_assert_eq!(w.tail_slot_offset() as u64, tail_from - start);
    }
    // The slot extent bounds every byte written and stays inside the reservation.
    let written_end = direct_end.max(if w.tail > 0 { tail_to } else { 0 });
    let Some(extent) = w.slot_extent() else {
        return Err(TestCaseError::fail(format!(
            "a planned window has no slot extent: {w:?}"
        )));
    };
    prop_assert!(written_end == 0 || (written_end - start) as usize <= extent);
    prop_assert!(
        (extent as u64) <= room_end - start,
        "extent past the reservation: {:?}",
        w
    );
    Ok(())
}

fn aligns() -> impl Strategy<Value = u64> {
    prop_oneof![Just(512u64), Just(1024), Just(4096), Just(65536)]
}

/// A file size up to five blocks: anywhere, or on a block boundary +- 1.
fn file_size(align: u64) -> impl Strategy<Value = u64> {
    prop_oneof![
        0..=5 * align,
        (0..=5u64, -1i64..=1).prop_map(move |(k, d)| (k * align).saturating_add_signed(d)),
    ]
}

/// A position in `[0, size]` biased to block boundaries and the file ends.
fn position(size: u64, align: u64) -> impl Strategy<Value = u64> {
    let blocks = size / align;
    prop_oneof![
        3 => 0..=size,
        3 => (0..=blocks, -1i64..=1).prop_map(move |(k, d)| (k * align).saturating_add_signed(d).min(size)),
        1 => Just(size),
        1 => Just(0u64),
        1 => (0..=8u64).prop_map(move |d| size.saturating_sub(d)),
    ]
}

/// (off, len, size, align, tail_room) with `[off, off + len)` inside the file.
fn in_file() -> impl Strategy<Value = (u64, u64, u64, u64, bool)> {
    (aligns(), any::<bool>())
        .prop_flat_map(|(align, room)| file_size(align).prop_map(move |size| (size, align, room)))
        .prop_flat_map(|(size, align, room)| {
            (position(size, align), position(size, align))
                .prop_map(move |(a, b)| (a.min(b), a.max(b) - a.min(b), size, align, room))
        })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 1000, ..ProptestConfig::default() })]

    /// Inside the file: the plan equals the oracle and covers every payload
    /// byte exactly once. (A zero-length payload at an unaligned offset with
    /// tail room is left to `zero_length_payload_reads_nothing`; here it is
    /// only held to the byte bounds.)
    #[test]
    fn plan_matches_naive_oracle_byte_by_byte((off, len, size, align, room) in in_file()) {
        let w = Window::plan(off, len, size, align, room)
            .map_err(|e| TestCaseError::fail(format!("refused an in-file range: {e}")))?;
        let want = oracle(off, len, size, align, room).expect("in file");
        // Shape of the window.
        prop_assert_eq!(w.start % align, 0);
        prop_assert!(w.start <= off);
        prop_assert_eq!(w.start + w.pad as u64, off);
        prop_assert_eq!(w.payload_offset(), off);
        prop_assert_eq!(w.len as u64, len);
        prop_assert_eq!(w.direct as u64 % align, 0, "direct is not whole blocks: {:?}", w);
        prop_assert!(w.start + w.direct as u64 <= size, "EOF clamp broken: {:?} size {}", w, size);
        if !room {
            prop_assert!(w.start + w.direct as u64 <= off + len, "direct past the payload without tail room: {:?}", w);
        }
        let known_zero_len_bug = len == 0 && room && off % align != 0;
        if !known_zero_len_bug {
            // Maximal direct part and exact tail, as the oracle finds them.
            prop_assert_eq!(
                (w.start, w.pad as u64, w.direct as u64, w.tail as u64),
                (want.start, want.pad, want.direct, want.tail),
                "off {} len {} size {} align {} tail_room {}", off, len, size, align, room
            );
        }
        check_bytes(&w, off, len, size, align, room)?;
        // The buffered fallback: no direct part, the whole payload read into place.
        let b = w.buffered();
        prop_assert_eq!((b.start, b.pad, b.len, b.direct, b.tail), (w.start, w.pad, w.len, 0, w.len));
        prop_assert_eq!(b.tail_file_offset(), off);
        prop_assert_eq!(b.tail_slot_offset(), w.pad);
        check_bytes(&b, off, len, size, align, false)?;
    }

    /// Ranges that end past the file (or whose end overflows u64) are errors
    /// that carry the range and the file size, never a shortened payload.
    #[test]
    fn out_of_file_ranges_are_errors(
        align in aligns(),
        size in 0u64..400_000,
        off_past in 0u64..200_000,
        len in 0u64..400_000,
        room in any::<bool>(),
        huge in any::<bool>(),
    ) {
        let (off, len) = if huge {
            (u64::MAX - off_past, len + off_past + 1) // off + len overflows
        } else {
            // off + len > size, off anywhere from 0 to past the end.
            let off = off_past.min(size + 1000);
            (off, (size - off.min(size)) + 1 + len % 5000)
        };
        prop_assume!(off as u128 + len as u128 > size as u128);
        prop_assert_eq!(oracle(off, len, size, align, room), None);
        prop_assert_eq!(
            Window::plan(off, len, size, align, room),
            Err(WindowError::OutOfFile { start: off, end: off.saturating_add(len), size })
        );
    }

    /// Non-powers of two (and 0) are refused as alignments.
    #[test]
    fn bad_alignments_are_refused(align in 0u64..200_000, off in 0u64..1000, len in 0u64..1000, room in any::<bool>()) {
        prop_assume!(!align.is_power_of_two());
        prop_assert_eq!(Window::plan(off, len, 10_000, align, room), Err(WindowError::BadAlign(align)));
    }

    /// Offsets and sizes near `u64::MAX`: no overflow, and the closed-form
    /// oracle (in u128) still holds.
    #[test]
    fn huge_offsets_do_not_overflow(
        align_shift in 9u32..=16,
        before_end in 0u64..(1 << 20),
        size_back in 0u64..(1 << 20),
        len in 1u64..(1 << 20),
        room in any::<bool>(),
    ) {
        let align = 1u64 << align_shift;
        let size = u64::MAX - size_back;
        // The payload ends `before_end` bytes before EOF.
        let off = size - before_end - len;
        let w = Window::plan(off, len, size, align, room)
            .map_err(|e| TestCaseError::fail(format!("refused an in-file range: {e}")))?;
        let a = align as u128;
        let (off128, end) = (off as u128, off as u128 + len as u128);
        let start = off128 / a * a;
        let limit = if room { ceil_to(end, a) } else { end };
        let direct = (limit.min(size as u128) - start) / a * a;
        let tail = end - (start + direct).clamp(off128, end);
        prop_assert_eq!(
            (w.start as u128, w.direct as u128, w.tail as u128),
            (start, direct, tail),
            "off {} len {} size {} align {} room {}", off, len, size, align, room
        );
        prop_assert_eq!(w.tail_file_offset() as u128 + w.tail as u128, end);
        // The slot extent exists and is what a read writes: the further of
        // the direct part and the payload.
        prop_assert_eq!(
            w.slot_extent().map(|e| e as u128),
            Some(direct.max(off128 - start + len as u128))
        );
    }

    /// A window planned for a payload that fits a slot spec's capacity fits
    /// that spec's slot: its extent, and every chunk of it and of its
    /// buffered fallback, lie inside `[0, slot_len)`.
    #[test]
    fn planned_windows_fit_the_slots_of_their_spec(
        (off, len, size, align, room) in in_file(),
        extra in prop_oneof![Just(0usize), 0usize..3 * 65536],
        chunk_blocks in 1usize..8,
    ) {
        let spec = SlotSpec::new(len as usize + extra).with_align(align as usize).with_tail_room(room);
        let slot_len = spec.slot_len().map_err(|e| TestCaseError::fail(e.to_string()))?;
        let w = Window::plan(off, len, size, align, room).unwrap();
        let extent = w.slot_extent().unwrap();
        prop_assert!(extent <= slot_len, "extent {} past a {}-byte slot of {:?}: {:?}", extent, slot_len, spec, w);
        for w in [w, w.buffered()] {
            for c in chunk_split(&w, 0, chunk_blocks * align as usize) {
                prop_assert!(c.slot_off + c.len as usize <= extent, "{:?} past the extent {} of {:?}", c, extent, w);
                prop_assert!(c.file_off + c.len as u64 <= size, "{:?} past the file: {:?}", c, w);
            }
        }
    }

    /// `SlotSpec::slot_len` against an oracle in u128: the smallest
    /// multiple of max(page, align) holding `align` scratch and the body,
    /// or an error exactly when that is past `isize::MAX` (or the alignment
    /// is refused). Never a wrapped length.
    #[test]
    fn slot_len_matches_a_u128_oracle(
        cap in prop_oneof![
            any::<usize>(),
            (0usize..1 << 16).prop_map(|k| usize::MAX - k),
            (0usize..1 << 16).prop_map(|k| (isize::MAX as usize - (1 << 15)).wrapping_add(k)),
            0usize..1 << 24,
        ],
        shift in prop_oneof![9u32..=16, 8u32..=63],
        room in any::<bool>(),
    ) {
        let align = 1usize << shift;
        let spec = SlotSpec::new(cap).with_align(align).with_tail_room(room);
        let got = spec.slot_len();
        if align < 512 {
            prop_assert!(got.is_err());
            return Ok(());
        }
        let a = align as u128;
        let unit = (rustix::param::page_size() as u128).max(a);
        let body = if room { ceil_to(cap as u128, a) } else { cap as u128 };
        let want = ceil_to(a + body.max(1), unit);
        match got {
            Ok(len) => {
                prop_assert_eq!(len as u128, want, "{:?}", spec);
                prop_assert!(want <= isize::MAX as u128);
            }
            Err(e) => {
                prop_assert!(want > isize::MAX as u128, "refused {:?} (slot {} bytes): {}", spec, want, e);
                prop_assert!(e.to_string().contains(&cap.to_string()), "{}", e);
            }
        }
    }

    /// `round_up` never wraps: `None` exactly when the result passes
    /// `usize::MAX` or the alignment is not a power of two.
    #[test]
    fn round_up_is_checked(x in prop_oneof![any::<usize>(), (0usize..1 << 20).prop_map(|k| usize::MAX - k)], align in any::<usize>(), shift in 0u32..64) {
        for align in [align, 1usize << shift] {
            let want = if align.is_power_of_two() {
                Some(ceil_to(x as u128, align as u128)).filter(|&v| v <= usize::MAX as u128)
            } else {
                None
            };
            prop_assert_eq!(round_up(x, align).map(|v| v as u128), want, "round_up({}, {})", x, align);
        }
    }
}

/// FIELD-NOTES, "The in-place direct read": a shard whose data section starts
/// at byte 71, 66843 bytes long, alignment 4096, no tail room. (payload offset
/// in the data section, length) -> (window start, pad, bulk, tail).
#[test]
fn field_notes_worked_examples() {
    const DATA: u64 = 71;
    const SIZE: u64 = 66843;
    let cases = [
        ((0, 1), (0, 71, 0, 1)),
        ((0, 4096), (0, 71, 4096, 71)),
        ((1000, 10000), (0, 1071, 8192, 2879)),
        ((4096, 12365), (4096, 71, 12288, 148)),
        ((33333, 20000), (32768, 636, 20480, 156)),
        ((65772, 1000), (65536, 307, 0, 1000)),
        ((62676, 4096), (61440, 1307, 4096, 1307)),
    ];
    for ((o, n), (start, pad, bulk, tail)) in cases {
        let w = Window::plan(DATA + o, n, SIZE, 4096, false).unwrap();
        assert_eq!(
            (w.start, w.pad, w.direct, w.tail),
            (start, pad, bulk, tail),
            "field example ({o}, {n})"
        );
        let want = oracle(DATA + o, n, SIZE, 4096, false).unwrap();
        assert_eq!(
            (want.start, want.pad as usize, want.direct as usize, want.tail as usize),
            (start, pad, bulk, tail),
            "the oracle disagrees with the field example ({o}, {n})"
        );
        // The tail starts right after the bulk (or at the payload when no bulk).
        assert_eq!(w.tail_file_offset(), (start + bulk as u64).max(DATA + o));
    }
    // The two that end at EOF really do.
    assert_eq!(DATA + 65772 + 1000, SIZE);
    assert_eq!(DATA + 62676 + 4096, SIZE);
}

/// The same seven ranges with tail room: the last partial block goes direct
/// when it lies wholly inside the file; at EOF the clamp still applies.
#[test]
fn field_notes_examples_with_tail_room() {
    const DATA: u64 = 71;
    const SIZE: u64 = 66843;
    let cases = [
        ((0, 1), (0, 4096, 0)),
        ((0, 4096), (0, 8192, 0)),
        ((1000, 10000), (0, 12288, 0)),
        ((4096, 12365), (4096, 16384, 0)),
        ((33333, 20000), (32768, 24576, 0)),
        ((65772, 1000), (65536, 0, 1000)),
        ((62676, 4096), (61440, 4096, 1307)),
    ];
    for ((o, n), (start, direct, tail)) in cases {
        let w = Window::plan(DATA + o, n, SIZE, 4096, true).unwrap();
        assert_eq!((w.start, w.direct, w.tail), (start, direct, tail), "case ({o}, {n})");
        let want = oracle(DATA + o, n, SIZE, 4096, true).unwrap();
        assert_eq!(
            (want.start, want.direct as usize, want.tail as usize),
            (start, direct, tail)
        );
    }
}

/// FIELD-NOTES: "Reads of 0 bytes are no-ops". A zero-length payload must
/// plan no I/O at all, with or without tail room.
#[test]
fn zero_length_payload_reads_nothing() {
    for align in [512u64, 4096, 65536] {
        for off in [0u64, 1, 71, align - 1, align, align + 5, 3 * align + 100] {
            let size = 4 * align;
            for room in [false, true] {
                let w = Window::plan(off, 0, size, align, room).unwrap();
                assert_eq!(
                    (w.len, w.direct, w.tail),
                    (0, 0, 0),
                    "off {off} align {align} tail_room {room}: {w:?}"
                );
            }
        }
    }
}

/// The zero-length plans that are already no-ops (no tail room, or an
/// aligned offset) stay no-ops; also at EOF.
#[test]
fn zero_length_without_room_or_aligned_is_a_no_op() {
    for align in [512u64, 4096, 65536] {
        let size = 4 * align + 7;
        for off in [0u64, 1, 71, align - 1, align, 3 * align + 100, size] {
            let w = Window::plan(off, 0, size, align, false).unwrap();
            assert_eq!((w.direct, w.tail), (0, 0), "off {off} align {align}");
        }
        for off in [0u64, align, 4 * align] {
            let w = Window::plan(off, 0, size, align, true).unwrap();
            assert_eq!((w.direct, w.tail), (0, 0), "off {off} align {align} with room");
        }
        // At EOF with tail room: no whole block left, nothing to read.
        let w = Window::plan(size, 0, size, align, true).unwrap();
        assert_eq!((w.direct, w.tail), (0, 0));
    }
}

/// The oracle itself can tell a wrong plan from a right one (guards against
/// a test that passes whatever the planner does).
#[test]
fn oracle_rejects_wrong_plans() {
    // Direct too short (not maximal), too long (past the payload), past EOF.
    let right = oracle(1071, 10000, 66843, 4096, false).unwrap();
    assert_eq!((right.direct, right.tail), (8192, 2879));
    let room = oracle(1071, 10000, 66843, 4096, true).unwrap();
    assert_eq!((room.direct, room.tail), (12288, 0));
    let eof = oracle(62747, 4096, 66843, 4096, true).unwrap();
    assert_eq!((eof.direct, eof.tail), (4096, 1307));
    assert_eq!(oracle(66843, 1, 66843, 4096, false), None);
    assert_eq!(oracle(u64::MAX, 2, u64::MAX, 4096, false), None);
}
