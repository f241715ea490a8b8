//! Bytes are identical whatever the path (DESIGN contract 4), judged by the
//! reference implementation: `tests/reference/ref_digest.py` writes shards
//! with `safetensors.numpy.save_file` (irregular sizes, headers of different
//! lengths) plus a hand-made container with an odd header length, and prints
//! the sha256 of every tensor as `safetensors.safe_open` returns it. The
//! `weightstream digest` output must equal it byte for byte with
//! `--direct on`, `off` and `auto`, and as `--json`; the library's read into
//! slots with and without tail room, 4096- and 512-aligned, must too.
//!
//! Without python3 or its `safetensors`/`numpy` modules the test prints a
//! skip notice and passes, unless `WEIGHTSTREAM_REQUIRE_REFERENCE=1` (CI),
//! where it fails.

mod common;

use std::collections::BTreeMap;
use std::ffi::OsStr;
use std::path::Path;

use common::{parse_sums, reference_digests as reference};

use weightstream::{Arena, DirectMode, Model, ModelConfig, SlotSpec};

fn cli(args: &[&OsStr]) -> String {
    let out = common::run(args);
    assert!(
        out.status.success(),
        "weightstream {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).expect("utf-8 stdout")
}

#[test]
fn digest_matches_reference_writer_and_reader() {
    let tmp = common::tempdir();
    let dir = tmp.path();
    let Some(expected) = reference(dir) else { return };
    let want = parse_sums(&expected);

    // The fixture is what it claims: several shards with different header
    // lengths, one with an odd header length, odd payload sizes, > 1 MiB.
    let model = Model::open(ModelConfig::new(dir)).expect("open the reference model");
    let cat = model.catalog();
    assert!(cat.shards().len() >= 4, "{:?}", cat.shards().len());
    let mut lens: Vec<u64> = cat.shards().iter().map(|s| s.header.header_len).collect();
    assert!(lens.iter().any(|l| l % 2 == 1), "no odd header length: {lens:?}");
    lens.sort();
    lens.dedup();
    assert_eq!(lens.len(), cat.shards().len(), "header lengths repeat");
    assert!(
        cat.tensors().iter().any(|t| t.len > 2 << 20),
        "no tensor of several MiB"
    );
    assert!(cat.tensors().iter().any(|t| t.len % 2 == 1), "no odd byte length");
    assert!(cat.tensors().iter().any(|t| t.offset % 2 == 1), "no odd file offset");
    let names: Vec<&str> = cat.tensors().iter().map(|t| t.name.as_str()).collect();
    assert_eq!(names, want.keys().map(String::as_str).collect::<Vec<_>>());
    drop(model);

    let s = OsStr::new;
    let d = dir.as_os_str();
    let mut modes = vec!["auto", "off"];
    if common::fs_reads_o_direct(dir) {
        modes.push("on");
    } else {
        eprintln!("note: {} refuses O_DIRECT; `--direct on` not compared", dir.display());
    }
    for mode in &modes {
        let got = cli(&[s("digest"), d, s("--direct"), s(mode)]);
        assert_eq!(got, expected, "digest --direct {mode} differs from the reference");
    }
    assert_eq!(cli(&[s("digest"), d]), expected, "digest (default mode) differs");

    for mode in &modes {
        let out = cli(&[s("digest"), d, s("--json"), s("--direct"), s(mode)]);
        let v: serde_json::Value = serde_json::from_str(&out).expect("--json is JSON");
        let got: BTreeMap<String, String> = v["tensors"]
            .as_object()
            .expect("tensors object")
            .iter()
            .map(|(k, h)| (k.clone(), h.as_str().expect("hex string").to_string()))
            .collect();
        assert_eq!(got, want, "--json --direct {mode}");
        let drives = v["stats"]["drives"].as_array().expect("stats.drives");
        let sum = |k: &str| drives.iter().map(|d| d[k].as_u64().unwrap()).sum::<u64>();
        let total: u64 = cat_total(dir);
        assert_eq!(v["stats"]["bytes"].as_u64(), Some(total), "--direct {mode}");
        match *mode {
            "off" => {
                assert_eq!(sum("reads_direct"), 0, "--direct off read direct");
                assert_eq!(sum("bytes_buffered"), total);
            }
            "on" => assert!(sum("reads_direct") > 0, "--direct on never read direct: {out}"),
            _ => {}
        }
    }

    // The library path into every slot shape gives the same bytes.
    let model = Model::open(ModelConfig::new(dir).direct(DirectMode::Auto)).unwrap();
    let cap = model.catalog().largest("").unwrap().max(1) as usize;
    for align in [4096usize, 512] {
        for room in [false, true] {
            let arena = Arena::new(SlotSpec::new(cap).with_align(align).with_tail_room(room), 1).unwrap();
            for t in model.catalog().tensors() {
                let loaded = model.read_sync(t, arena.take().unwrap()).unwrap();
                assert_eq!(
                    common::sha256_hex(&loaded),
                    want[&t.name],
                    "{} align {align} tail_room {room}",
                    t.name
                );
            }
        }
    }
}

fn cat_total(dir: &Path) -> u64 {
    Model::open(ModelConfig::new(dir)).unwrap().catalog().total_bytes()
}

/// The comparison can fail: one flipped payload byte changes the digest the
/// binary prints, and the reference output no longer matches.
#[test]
fn a_flipped_byte_breaks_the_match() {
    let tmp = common::tempdir();
    let dir = tmp.path();
    let Some(expected) = reference(dir) else { return };
    let model = Model::open(ModelConfig::new(dir)).unwrap();
    let t = model.tensor("hand.c").unwrap();
    let path = model.catalog().shards()[t.shard].path.clone();
    let at = t.offset + t.len / 2;
    drop(model);
    let mut bytes = std::fs::read(&path).unwrap();
    bytes[at as usize] ^= 0x01;
    std::fs::write(&path, bytes).unwrap();
    let got = cli(&[OsStr::new("digest"), dir.as_os_str()]);
    let (g, w) = (parse_sums(&got), parse_sums(&expected));
    let differ: Vec<&String> = w.keys().filter(|k| g[*k] != w[*k]).collect();
    assert_eq!(differ, ["hand.c"]);
}
