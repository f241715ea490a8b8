//! The engine's bytes are the reference's bytes (DESIGN contract 4): the
//! `weightstream digest` output is identical for `--backend uring`, `pread`,
//! `auto` and `sync`, with `--direct on`, `off` and `auto`, and equal to the
//! sha256 sums the Python reference reader prints for the shards the
//! reference writer made (`tests/reference/ref_digest.py`: irregular sizes,
//! odd offsets, a hand-made container with an odd header length). Also with
//! `--qd 1 --chunk 4096 --inflight 1` (hundreds of chunks per read, one at a
//! time), `--qd 64 --chunk 1MiB` and `--qd 64 --chunk 16KiB --inflight 16`
//! (many chunks of many reads in flight, completing in any order).
//!
//! `--json` stats must say which backend ran (the one asked for), that the
//! queue depth bounds the chunks in flight, and, for io_uring as root, that
//! fixed files and registered buffers are in use with no chunk issued
//! unregistered.
//!
//! Without python3 + `safetensors` + `numpy` the test prints a SKIP notice
//! and passes, unless `WEIGHTSTREAM_REQUIRE_REFERENCE=1` (CI), where it fails.

mod common;

use std::ffi::OsStr;
use std::path::Path;

use common::{json_sums, parse_sums, reference_digests, run_json};

fn digest_text(dir: &Path, extra: &[&str]) -> String {
    let mut args: Vec<&OsStr> = vec![OsStr::new("digest"), dir.as_os_str()];
    args.extend(extra.iter().map(OsStr::new));
    let out = common::run(&args);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "digest {extra:?} failed:\n{stderr}");
    assert!(!stderr.contains("panicked"), "digest {extra:?}:\n{stderr}");
    String::from_utf8(out.stdout).expect("utf-8 stdout")
}

fn digest_json(dir: &Path, extra: &[&str]) -> serde_json::Value {
    let mut args: Vec<&OsStr> = vec![OsStr::new("digest"), dir.as_os_str(), OsStr::new("--json")];
    args.extend(extra.iter().map(OsStr::new));
    run_json(&args).0
}

fn is_root() -> bool {
    rustix::process::geteuid().is_root()
}

/// Whether io_uring is open to this process (`kernel.io_uring_disabled` is
/// 0, or 1 and we are root); `auto` must then pick it.
fn uring_expected() -> bool {
    match std::fs::read_to_string("/proc/sys/kernel/io_uring_disabled") {
        Ok(v) => match v.trim() {
            "0" => true,
            "1" => is_root(),
            _ => false,
        },
        Err(_) => true,
    }
}

fn drives(v: &serde_json::Value) -> &Vec<serde_json::Value> {
    v["stats"]["drives"].as_array().expect("stats.drives")
}

fn sum(v: &serde_json::Value, key: &str) -> u64 {
    drives(v)
        .iter()
        .map(|d| d[key].as_u64().unwrap_or_else(|| panic!("drives[].{key}")))
        .sum()
}

fn max(v: &serde_json::Value, key: &str) -> u64 {
    drives(v)
        .iter()
        .map(|d| d[key].as_u64().unwrap_or_else(|| panic!("drives[].{key}")))
        .max()
        .unwrap_or(0)
}

/// Checks what `--json` stats say about the backend that ran.
fn check_backend_stats(v: &serde_json::Value, backend: &str, what: &str) {
    let st = &v["stats"];
    assert_eq!(st["backend"], backend, "{what}: stats.backend\n{st:#}");
    match backend {
        "uring" => {
            assert!(st["backend_reason"].is_null(), "{what}: {st:#}");
            // Every ring describes its setup, and as root nothing is refused.
            for d in drives(v) {
                assert!(d["ring"].is_string(), "{what}: drive without ring description: {d:#}");
            }
            if is_root() {
                assert_eq!(st["fixed_files"]["enabled"], true, "{what}: {st:#}");
                assert_eq!(st["registered_buffers"]["enabled"], true, "{what}: {st:#}");
                assert!(st["registered_buffers"]["reason"].is_null(), "{what}: {st:#}");
                assert_eq!(sum(v, "chunks_unregistered"), 0, "{what}: {st:#}");
            }
        }
        "pread" => {
            assert_eq!(st["fixed_files"]["enabled"], false, "{what}: {st:#}");
            assert_eq!(st["registered_buffers"]["enabled"], false, "{what}: {st:#}");
            assert_eq!(sum(v, "chunks_unregistered"), 0, "{what}: pread counts no ring chunks");
        }
        "sync" => {}
        other => panic!("unknown backend {other}"),
    }
}

#[test]
fn every_backend_direct_mode_and_chunking_matches_the_reference() {
    let tmp = common::tempdir();
    let dir = tmp.path();
    let Some(expected) = reference_digests(dir) else { return };
    let want = parse_sums(&expected);
    assert!(want.len() >= 20, "reference fixture too small: {}", want.len());
    let total = weightstream::Model::open(weightstream::ModelConfig::new(dir))
        .unwrap()
        .catalog()
        .total_bytes();

    let mut modes = vec!["off", "auto"];
    if common::fs_reads_o_direct(dir) {
        modes.push("on");
    } else {
        eprintln!("note: {} refuses O_DIRECT; `--direct on` not compared", dir.display());
    }

    // Plain sha256sum output, byte for byte, for every backend and mode.
    for backend in ["sync", "uring", "pread", "auto"] {
        for mode in &modes {
            let got = digest_text(dir, &["--backend", backend, "--direct", mode]);
            assert_eq!(
                got, expected,
                "--backend {backend} --direct {mode} differs from the reference"
            );
        }
    }

    // --json: the same sums, and the stats say which backend did the work.
    let auto = if uring_expected() { "uring" } else { "pread" };
    for (backend, ran) in [("sync", "sync"), ("uring", "uring"), ("pread", "pread"), ("auto", auto)] {
        for mode in &modes {
            let what = format!("--json --backend {backend} --direct {mode}");
            let v = digest_json(dir, &["--backend", backend, "--direct", mode]);
            assert_eq!(json_sums(&v), want, "{what}");
            assert_eq!(v["stats"]["bytes"].as_u64(), Some(total), "{what}");
            check_backend_stats(&v, ran, &what);
            if *mode == "off" {
                assert_eq!(sum(&v, "reads_direct"), 0, "{what}");
            }
            if *mode == "on" {
                assert!(sum(&v, "bytes_direct") > 0, "{what}: nothing read direct");
            }
        }
    }

    // Chunking and depth: hundreds of 4 KiB chunks per read one at a time,
    // few big chunks, and many small chunks of many reads at once.
    let shapes: [&[&str]; 3] = [
        &["--qd", "1", "--chunk", "4096", "--inflight", "1"],
        &["--qd", "64", "--chunk", "1MiB"],
        &["--qd", "64", "--chunk", "16KiB", "--inflight", "16"],
    ];
    let mut deepest_uring = 0;
    for backend in ["uring", "pread"] {
        for shape in shapes {
            for mode in &modes {
                let mut args = vec!["--backend", backend, "--direct", mode];
                args.extend_from_slice(shape);
                let what = format!("{args:?}");
                assert_eq!(digest_text(dir, &args), expected, "{what}");
                let v = digest_json(dir, &args);
                assert_eq!(json_sums(&v), want, "{what}");
                assert_eq!(v["stats"]["bytes"].as_u64(), Some(total), "{what}");
                check_backend_stats(&v, backend, &what);
                if backend == "uring" {
                    let qd: u64 = shape[1].parse().unwrap();
                    let inflight = max(&v, "inflight_max");
                    assert!(
                        (1..=qd).contains(&inflight),
                        "{what}: inflight_max {inflight} outside 1..={qd}"
                    );
                    if shape[3] == "16KiB" {
                        deepest_uring = deepest_uring.max(inflight);
                    }
                }
            }
        }
    }
    // A 3 MB tensor is ~190 chunks of 16 KiB queued at once: with a depth of
    // 64 the ring must have had more than one in flight at some point.
    assert!(
        deepest_uring >= 2,
        "--qd 64 --chunk 16KiB never had two chunks in flight (inflight_max {deepest_uring})"
    );
}

/// The comparison is not vacuous: a payload byte flipped on disk changes the
/// engine's digest of exactly that tensor, on both backends.
#[test]
fn a_flipped_byte_changes_the_engine_digest() {
    let tmp = common::tempdir();
    let dir = tmp.path();
    let Some(expected) = reference_digests(dir) else { return };
    let model = weightstream::Model::open(weightstream::ModelConfig::new(dir)).unwrap();
    let t = model.tensor("l1.experts.0.big").unwrap();
    let path = model.catalog().shards()[t.shard].path.clone();
    // Inside a middle chunk of the O_DIRECT bulk, not the buffered tail.
    let at = t.offset + t.len / 2;
    drop(model);
    let mut bytes = std::fs::read(&path).unwrap();
    bytes[at as usize] ^= 0x80;
    std::fs::write(&path, bytes).unwrap();
    let want = parse_sums(&expected);
    for backend in ["uring", "pread"] {
        let got = parse_sums(&digest_text(dir, &["--backend", backend, "--chunk", "4096"]));
        let differ: Vec<&String> = want.keys().filter(|k| got[*k] != want[*k]).collect();
        assert_eq!(differ, ["l1.experts.0.big"], "--backend {backend}");
    }
}

/// `drives[].inflight_max` ("most chunks in flight at once on this drive")
/// describes the pread backend too: after reads of many chunks with up to
/// four workers it is at least 1 and at most the queue depth.
#[test]
fn pread_stats_report_chunks_in_flight() {
    let tmp = common::tempdir();
    let dir = tmp.path().join("model");
    let spec = weightstream_synth::SynthSpec {
        layers: 1,
        experts: 2,
        expert_bytes: 1 << 20,
        shards: 1,
        ..Default::default()
    };
    common::synth_model(&dir, &spec);
    for qd in ["1", "8"] {
        let v = digest_json(&dir, &["--backend", "pread", "--qd", qd, "--chunk", "64KiB"]);
        check_backend_stats(&v, "pread", qd);
        let m = max(&v, "inflight_max");
        let qd: u64 = qd.parse().unwrap();
        assert!((1..=qd).contains(&m), "--qd {qd}: pread inflight_max {m}");
    }
}
