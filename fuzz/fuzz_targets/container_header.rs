//! Feeds arbitrary bytes to `ShardHeader::parse`, the pure validation of a
//! `.safetensors` header: no input may panic, and an accepted header must
//! describe tensors that tile the data section from 0 to end of file.
//!
//! The bytes are used two ways: as a whole file image (raw = the 8-byte
//! length and the header it announces, file size = the image's length),
//! and as the raw header itself against an empty and an absurd data section.

#![no_main]

use std::collections::{BTreeMap, HashSet};
use std::path::Path;

use libfuzzer_sys::fuzz_target;
use weightstream::__internal::MAX_HEADER_LEN;
use weightstream::ShardHeader;

const PATH: &str = "/fuzz/shard-00001.safetensors";

fuzz_target!(|data: &[u8]| {
    // 1. A whole file image.
    let raw = match data.get(..8) {
        Some(p) => {
            let n = u64::from_le_bytes(p.try_into().unwrap());
            match n.checked_add(8) {
                Some(end) if end <= data.len() as u64 => data[..end as usize].to_vec(),
                _ => data.to_vec(),
            }
        }
        None => data.to_vec(),
    };
    let image = check(raw.clone(), data.len() as u64);
    // The reference reader (the safetensors crate at the version of the
    // Python reference, 0.8), holding the whole file, must agree: what one
    // accepts the other accepts, with the same tensors. The one difference
    // allowed: weightstream refuses a header that does not start with `{`
    // (the reference skips leading whitespace).
    let reference = safetensors::SafeTensors::read_metadata(data);
    match (&image, &reference) {
        (Some(h), Ok((n, meta))) => {
            assert_eq!(*n as u64, h.header_len);
            // As maps: zero-length tensors sharing an offset have no order
            // in the reference (it sorts a HashMap by offsets only).
            let theirs: BTreeMap<String, (String, Vec<usize>, u64, u64)> = meta
                .tensors()
                .into_iter()
                .map(|(name, info)| {
                    (
                        name,
                        (
                            info.dtype.to_string(),
                            info.shape.clone(),
                            info.data_offsets.0 as u64,
                            info.data_offsets.1 as u64,
                        ),
                    )
                })
                .collect();
            let ours: BTreeMap<String, (String, Vec<usize>, u64, u64)> = h
                .tensors
                .iter()
                .map(|t| {
                    (
                        t.name.clone(),
                        (t.dtype.name().to_string(), t.shape.clone(), t.begin, t.end),
                    )
                })
                .collect();
            assert_eq!(ours, theirs, "accepted differently from the reference");
            assert_eq!(&h.metadata, meta.metadata());
        }
        (Some(_), Err(e)) => panic!("accepted a header the reference refuses: {e}"),
        (None, Ok(_)) if data.get(8) == Some(&b'{') => {
            let e = ShardHeader::parse(Path::new(PATH), raw.clone(), data.len() as u64).unwrap_err();
            panic!("refused a header the reference accepts: {e}");
        }
        (None, _) => {}
    }

    // 2. The bytes as the raw header of a file with no data / a huge file.
    check(data.to_vec(), data.len() as u64);
    check(data.to_vec(), u64::MAX);
});

/// Parses and checks the invariants of an accepted header; returns it.
fn check(raw: Vec<u8>, file_size: u64) -> Option<ShardHeader> {
    let h = match ShardHeader::parse(Path::new(PATH), raw.clone(), file_size) {
        Ok(h) => h,
        Err(e) => {
            let msg = e.to_string();
            assert!(msg.contains(PATH), "error does not name the file: {msg}");
            return None;
        }
    };
    let n = u64::from_le_bytes(raw[..8].try_into().unwrap());
    assert!(n >= 1 && n <= MAX_HEADER_LEN, "header length {n} accepted");
    assert_eq!(h.header_len, n);
    assert_eq!(h.data_start, 8 + n);
    assert_eq!(h.file_size, file_size);
    assert_eq!(
        h.raw, raw,
        "raw header bytes must be kept exactly (mirrors compare them)"
    );
    assert_eq!(raw[8], b'{');
    // Sorted, contiguous from 0, each range the size dtype x shape says.
    let mut at = 0u64;
    let mut names = HashSet::new();
    for t in &h.tensors {
        assert!(names.insert(t.name.as_str()), "duplicate tensor {:?}", t.name);
        assert_eq!(t.begin, at, "tensor {:?} does not start where the last ended", t.name);
        assert!(t.end >= t.begin);
        let bits = t
            .shape
            .iter()
            .try_fold(t.dtype.bits() as u128, |acc, &d| acc.checked_mul(d as u128))
            .expect("accepted shape overflows u128");
        assert_eq!(bits % 8, 0);
        assert_eq!(
            bits / 8,
            t.len() as u128,
            "tensor {:?}: dtype x shape != byte length",
            t.name
        );
        assert!(
            h.data_start + t.end <= file_size,
            "tensor {:?} past end of file",
            t.name
        );
        at = t.end;
    }
    assert_eq!(
        8 + h.header_len + at,
        file_size,
        "data section does not end at end of file"
    );
    Some(h)
}
