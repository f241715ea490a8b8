//! Drives `Window::plan`, the pure alignment / EOF-clamp arithmetic of the
//! in-place read, with arbitrary offsets, lengths, file sizes and
//! alignments, and checks every invariant the read path relies on.
//! Arithmetic in the checks is done in u128 so the checker cannot overflow
//! where the planner must not. Every chunk `chunk::split` makes of a planned
//! window (and of its buffered fallback) must lie inside the window's slot
//! extent, and the extent inside the slot of any accepted spec whose
//! capacity holds the payload.

#![no_main]

use arbitrary::Arbitrary;
use libfuzzer_sys::fuzz_target;
use weightstream::__internal::{chunk_count, chunk_split};
use weightstream::__internal::{Window, WindowError};
use weightstream::SlotSpec;

#[derive(Debug, Arbitrary)]
struct Input {
    off: u64,
    len: u64,
    size: u64,
    /// align = 1 << (k % 17) (1 B .. 64 KiB) unless `odd_align` is set.
    k: u8,
    /// Sometimes an alignment that is not a power of two (or 0).
    odd_align: Option<u64>,
    tail_room: bool,
    /// Fold `off` and `len` into the file so most inputs take the Ok path.
    fit: bool,
    /// Shrink the file to a few blocks so boundaries are hit often.
    small: bool,
    /// Chunk size in blocks of `align` (1 + this), for the split check.
    chunk_blocks: u16,
    /// Slot capacity beyond the payload length.
    extra_cap: u32,
}

/// Windows with more chunks than this are checked on their first chunks only.
const MAX_CHECKED_CHUNKS: usize = 4096;

fn round_up(x: u128, a: u128) -> u128 {
    x.div_ceil(a) * a
}

fn round_down(x: u128, a: u128) -> u128 {
    x / a * a
}

fuzz_target!(|inp: Input| {
    let align = match inp.odd_align {
        Some(a) => a,
        None => 1u64 << (inp.k % 17),
    };
    let mut size = inp.size;
    if inp.small {
        size %= 1 << 20;
    }
    let (mut off, mut len) = (inp.off, inp.len);
    if inp.fit {
        off %= size.saturating_add(1).max(1);
        if off > size {
            off = size;
        }
        len %= (size - off).saturating_add(1).max(1);
    }

    let plan = Window::plan(off, len, size, align, inp.tail_room);

    let align_ok = align != 0 && align.is_power_of_two();
    let end = off as u128 + len as u128;
    let in_file = end <= size as u128;

    let w = match plan {
        Err(WindowError::BadAlign(a)) => {
            assert!(!align_ok, "BadAlign for a valid alignment {align}");
            assert_eq!(a, align);
            return;
        }
        Err(WindowError::OutOfFile { start, end: e, size: s }) => {
            assert!(align_ok, "alignment {align} must be refused before the range");
            assert!(!in_file, "OutOfFile for [{off}, {end}) inside a file of {size}");
            assert_eq!((start, e, s), (off, off.saturating_add(len), size));
            return;
        }
        Err(WindowError::TooLarge { start, end: e }) => {
            // Only where usize is narrower than u64.
            assert!(align_ok && in_file);
            assert!(
                e as u128 - start as u128 > usize::MAX as u128,
                "TooLarge [{start}, {e})"
            );
            return;
        }
        Ok(w) => w,
    };
    assert!(align_ok, "accepted alignment {align}");
    assert!(in_file, "accepted [{off}, {end}) outside a file of {size}");

    let a = align as u128;
    let (start, pad, direct, tail, wlen) = (
        w.start as u128,
        w.pad as u128,
        w.direct as u128,
        w.tail as u128,
        w.len as u128,
    );
    // Placement: the aligned window starts at the slot base.
    assert_eq!(start % a, 0, "{w:?}");
    assert!(pad < a, "{w:?}");
    assert_eq!(start + pad, off as u128, "{w:?}");
    assert_eq!(w.payload_offset(), off);
    assert_eq!(wlen, len as u128);
    // The direct part is whole blocks and never runs past EOF (the clamp).
    assert_eq!(direct % a, 0, "{w:?}");
    assert!(start + direct <= size as u128, "direct past EOF: {w:?} size {size}");
    // Nothing past the payload unless the slot reserved tail room.
    let limit = if inp.tail_room {
        round_up(pad + wlen, a)
    } else {
        pad + wlen
    };
    assert!(direct <= limit, "direct {direct} > {limit}: {w:?}");
    // The slot extent fits a slot of capacity `len` with `align` scratch.
    let extent = w.slot_extent().expect("a planned window has a slot extent");
    let body = if inp.tail_room { round_up(wlen, a) } else { wlen };
    assert!((extent as u128) <= a + body, "{w:?}");
    assert_eq!(extent as u128, direct.max(pad + wlen));
    // ... and the slot of every accepted spec whose capacity holds the payload.
    if let Some(cap) = usize::try_from(len)
        .ok()
        .and_then(|l| l.checked_add(inp.extra_cap as usize))
    {
        let spec = SlotSpec::new(cap)
            .with_align(align as usize)
            .with_tail_room(inp.tail_room);
        if let Ok(slot_len) = spec.slot_len() {
            assert!(
                extent <= slot_len,
                "extent {extent} past the {slot_len}-byte slot of {spec:?}: {w:?}"
            );
        }
    }
    // Every chunk of the window and of its fallback lies inside the extent
    // (and its file range inside the file).
    let chunk = (inp.chunk_blocks as usize + 1).saturating_mul(align as usize);
    for v in [w, w.buffered()] {
        let n = chunk_count(&v, chunk);
        let mut seen = 0;
        for c in chunk_split(&v, 0, chunk).take(MAX_CHECKED_CHUNKS) {
            seen += 1;
            assert!(c.len > 0, "{c:?}");
            assert!(
                c.slot_off as u128 + c.len as u128 <= extent as u128,
                "{c:?} past the extent {extent}: {v:?}"
            );
            assert!(
                c.file_off as u128 + c.len as u128 <= size as u128,
                "{c:?} past EOF {size}: {v:?}"
            );
            assert_eq!(c.file_off as u128 - start, c.slot_off as u128, "{c:?}");
        }
        assert_eq!(seen, n.min(MAX_CHECKED_CHUNKS), "{v:?}");
    }
    // Direct + tail cover the payload exactly: no gap, no overlap.
    assert!(tail <= wlen, "{w:?}");
    assert_eq!(w.tail_file_offset() as u128 + tail, end, "{w:?}");
    assert_eq!(w.tail_slot_offset() as u128, pad + wlen - tail, "{w:?}");
    let direct_end = start + direct;
    assert_eq!(
        w.tail_file_offset() as u128,
        direct_end.clamp(off as u128, end),
        "tail must start where the direct part ends: {w:?}"
    );
    // A 0-byte read is a no-op, whatever room the slot reserves.
    if len == 0 {
        assert_eq!((w.direct, w.tail, w.slot_extent()), (0, 0, Some(w.pad)), "{w:?}");
    }
    // Otherwise the direct part is as large as allowed (no needless
    // buffered bytes).
    let want = if len == 0 {
        0
    } else if inp.tail_room {
        round_up(pad + wlen, a)
    } else {
        round_down(pad + wlen, a)
    };
    let eof_limit = round_down(size as u128 - start, a);
    assert_eq!(
        direct,
        want.min(eof_limit),
        "direct part not maximal: {w:?} size {size}"
    );

    // The buffered fallback reads exactly the payload, into its place.
    let b = w.buffered();
    assert_eq!(
        (b.start, b.pad, b.len, b.direct, b.tail),
        (w.start, w.pad, w.len, 0, w.len)
    );
    assert_eq!(b.tail_file_offset(), off);
    assert_eq!(b.tail_slot_offset(), w.pad);
    assert_eq!(b.slot_extent(), Some(w.pad + w.len));
});
