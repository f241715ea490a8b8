//! Every refusal of an arena says its cause, through the public API:
//! full, fragmented (free bytes in holes), never fits (which field), the
//! wrong kind of arena, an invalid spec; `?` makes each an `Error::Take`.
//! Facts only (errors and their numbers), no timing.

use weightstream::{Arena, Dtype, Error, SlotSpec, TakeError, TensorRef};

const ALIGN: usize = 4096;

fn tensor(name: &str, offset: u64, len: u64) -> TensorRef {
    TensorRef {
        name: name.to_string(),
        shard: 0,
        offset,
        len,
        dtype: Dtype::U8,
        shape: vec![len as usize],
        index: 0,
    }
}

/// The page (the unit slots are carved in): the bytes of the smallest
/// packed arena.
fn page() -> usize {
    Arena::packed(1, ALIGN, false).unwrap().bytes()
}

/// Every refusal names its cause and numbers: full, fragmented, never
/// fits (which field), the wrong kind of arena, an invalid spec.
#[test]
fn every_refusal_says_why() {
    let p = page();
    let packed = Arena::packed(4 * p, ALIGN, false).unwrap();
    // take() on a packed arena: the wrong method, said so.
    let e = packed.take().unwrap_err();
    assert_eq!(e, TakeError::WrongKind);
    assert!(e.to_string().contains("take_for"), "{e}");
    // Larger than the whole arena: never.
    let huge = tensor("huge", 0, (4 * p + 1) as u64);
    let e = packed.take_for(&huge).unwrap_err();
    assert_eq!(
        e,
        TakeError::NeverFits {
            field: "bytes",
            need: 5 * p,
            have: 4 * p
        }
    );
    assert!(e.to_string().contains(&(5 * p).to_string()), "{e}");
    // Full: 3 pages out, 1 free, 2 asked.
    let held = packed.take_for(&tensor("a", 0, (3 * p) as u64)).unwrap();
    let e = packed.take_sized(SlotSpec::new(p)).unwrap_err();
    assert_eq!(
        e,
        TakeError::Full {
            need: 2 * p,
            free: p,
            bytes: 4 * p
        }
    );
    drop(held);
    // Fragmented: pages 0 and 2 out, 2 pages free in holes of 1; `?`
    // makes it the crate's error, with the same message.
    let one = tensor("one", 0, p as u64);
    let (a, b, c) = (
        packed.take_for(&one).unwrap(),
        packed.take_for(&one).unwrap(),
        packed.take_for(&one).unwrap(),
    );
    drop(b);
    let e = packed.take_for(&tensor("two", 0, 2 * p as u64)).unwrap_err();
    let want = TakeError::Fragmented {
        need: 2 * p,
        free: 2 * p,
        largest: p,
        bytes: 4 * p,
    };
    assert_eq!(e, want);
    let msg = e.to_string();
    for number in [2 * p, p, 4 * p] {
        assert!(msg.contains(&number.to_string()), "{msg}");
    }
    let e: Error = e.into();
    assert!(matches!(&e, Error::Take(t) if *t == want), "{e:?}");
    assert_eq!(e.to_string(), msg);
    drop((a, c));
    // An invalid spec.
    let e = packed.take_sized(SlotSpec::new(1).with_align(1000)).unwrap_err();
    assert!(
        matches!(&e, TakeError::Invalid { reason } if reason.contains("1000")),
        "{e}"
    );

    // A fixed arena: take is right; a spec its slots do not meet is named
    // by field; all out is Full.
    let fixed = Arena::new(SlotSpec::new(10_000), 2).unwrap();
    let slot_len = fixed.slot_len();
    for (spec, field, need, have) in [
        (SlotSpec::new(10_001), "capacity", 10_001, 10_000),
        (SlotSpec::new(100).with_align(8192), "align", 8192, 4096),
        (SlotSpec::new(100).with_tail_room(true), "tail_room", 1, 0),
    ] {
        let e = fixed.take_sized(spec).unwrap_err();
        assert_eq!(e, TakeError::NeverFits { field, need, have });
        assert!(e.to_string().contains(field), "{e}");
    }
    let e = fixed.take_for(&tensor("big", 0, 10_001)).unwrap_err();
    assert!(matches!(e, TakeError::NeverFits { field: "capacity", .. }), "{e}");
    let (_a, _b) = (fixed.take().unwrap(), fixed.take_for(&tensor("t", 5, 9_000)).unwrap());
    let e = fixed.take().unwrap_err();
    assert_eq!(
        e,
        TakeError::Full {
            need: slot_len,
            free: 0,
            bytes: 2 * slot_len
        }
    );
}
