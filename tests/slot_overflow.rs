//! Slot specs whose size arithmetic overflows are refused, in debug and in
//! release builds alike (issue 9, item 2).
//!
//! Before the fix, `SlotSpec::slot_len` computed `round_up(align + capacity,
//! page)` unchecked: in a release build a capacity near `usize::MAX` wrapped
//! to a 4096-byte slot that still reported the huge capacity, so a read that
//! checked only `len <= capacity` let the kernel write past the slot; in a
//! debug build the same spec panicked. Both are failures here: every case
//! must be an `Err` that names the numbers. Run this file with `cargo test
//! --release --test slot_overflow` too.

use weightstream::{Arena, SlotSpec};

const PAGE: usize = 4096;

/// Specs whose slot length cannot be computed, or exceeds `isize::MAX` (the
/// most any Rust slice or allocation may span).
fn refused_specs() -> Vec<(&'static str, SlotSpec)> {
    let imax = isize::MAX as usize;
    vec![
        ("capacity usize::MAX - 100", SlotSpec::new(usize::MAX - 100)),
        ("capacity usize::MAX", SlotSpec::new(usize::MAX)),
        // align + capacity overflows by exactly one.
        (
            "align + capacity = usize::MAX + 1",
            SlotSpec::new(usize::MAX - PAGE + 1),
        ),
        // align + capacity = usize::MAX: the page rounding overflows.
        ("page rounding overflows", SlotSpec::new(usize::MAX - PAGE)),
        // The tail-room rounding of the capacity itself overflows.
        (
            "tail-room rounding overflows",
            SlotSpec::new(usize::MAX - 10).with_tail_room(true),
        ),
        ("capacity isize::MAX", SlotSpec::new(imax)),
        ("capacity isize::MAX + 1", SlotSpec::new(imax + 1)),
        // Fits usize, but the slot (align + capacity, page-rounded) does not
        // fit isize.
        ("slot just past isize::MAX", SlotSpec::new(imax - PAGE + 2)),
        // A power-of-two alignment so large that the rounding overflows.
        ("align 2^63", SlotSpec::new(1).with_align(1 << 63)),
        ("align 2^62, capacity 2^62", SlotSpec::new(1 << 62).with_align(1 << 62)),
    ]
}

#[test]
fn arena_new_refuses_specs_whose_slot_length_overflows() {
    for (what, spec) in refused_specs() {
        let r = std::panic::catch_unwind(|| Arena::new(spec, 1));
        let r = r.unwrap_or_else(|_| panic!("{what}: Arena::new panicked on {spec:?} instead of returning an error"));
        match r {
            Ok(a) => panic!(
                "{what}: Arena::new accepted {spec:?}: slots of {} bytes that claim a capacity of {}",
                a.slot_len(),
                a.spec().capacity
            ),
            Err(e) => {
                let msg = e.to_string();
                assert!(
                    msg.contains(&spec.capacity.to_string()),
                    "{what}: the error must name the capacity {}: {msg}",
                    spec.capacity
                );
            }
        }
    }
}

#[test]
fn arena_new_refuses_a_mapping_larger_than_isize_max() {
    // Each slot is fine (2^40 + one page); 2^23 of them are 2^63 + 2^35
    // bytes: fits usize, not isize.
    let spec = SlotSpec::new(1 << 40);
    let count = 1 << 23;
    let e = Arena::new(spec, count).expect_err("a mapping past isize::MAX");
    let msg = e.to_string();
    assert!(msg.contains(&count.to_string()), "{msg}");
    assert!(msg.contains("isize::MAX"), "{msg}");
    // And one whose product overflows usize outright.
    let e = Arena::new(spec, usize::MAX / 2).expect_err("count * slot overflows");
    assert!(e.to_string().contains(&(usize::MAX / 2).to_string()), "{e}");
}
