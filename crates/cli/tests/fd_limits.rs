//! File descriptors and RLIMIT_NOFILE (issue 9, item 10, the model side):
//! each copy is opened twice (buffered + O_DIRECT), so a model of 40 shards
//! needs about 80 descriptors. Under a soft limit of 64 with a hard limit of
//! 4096 the model must open (the soft limit is raised, said once) with
//! every O_DIRECT descriptor (no `EMFILE` taken for "O_DIRECT refused");
//! under a hard limit of 64 it must fail with a message naming `ulimit -n`
//! and the numbers.
//!
//! The limits are set on a child process with `prlimit` (util-linux); the
//! test prints SKIP when it is missing.

mod common;

use std::ffi::OsStr;
use std::path::Path;
use std::process::Command;

use common::{container_bytes, header_json, Entry};

const SHARDS: usize = 40;

fn model(dir: &Path) {
    for i in 0..SHARDS {
        let header = header_json(&[Entry::u8(&format!("t{i:02}"), 0, 700 + i as u64)]);
        let data = common::content(i as u64, 700 + i);
        std::fs::write(
            dir.join(format!("model-{:05}-of-{SHARDS:05}.safetensors", i + 1)),
            container_bytes(header.as_bytes(), &data),
        )
        .unwrap();
    }
}

fn prlimit_available() -> bool {
    Command::new("prlimit")
        .arg("--version")
        .output()
        .map(|o| o.status.success())
        .unwrap_or(false)
}

/// `weightstream ARGS` under `prlimit --nofile=SOFT:HARD`.
fn run_limited(soft: u64, hard: u64, args: &[&OsStr]) -> std::process::Output {
    let mut cmd = common::hermetic(Command::new("prlimit"));
    cmd.arg(format!("--nofile={soft}:{hard}"))
        .arg("--")
        .arg(common::bin())
        .args(args);
    cmd.output().expect("run prlimit")
}

#[test]
fn soft_limit_is_raised_toward_the_hard_limit() {
    if !prlimit_available() {
        eprintln!("SKIP: prlimit (util-linux) is not installed");
        return;
    }
    let tmp = common::tempdir();
    let dir = tmp.path();
    model(dir);
    let out = run_limited(
        64,
        4096,
        &[
            OsStr::new("-v"),
            OsStr::new("inspect"),
            dir.as_os_str(),
            OsStr::new("--json"),
        ],
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "inspect under a soft limit of 64 failed: {stderr}"
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON");
    let shards = v["shards"].as_array().unwrap();
    assert_eq!(shards.len(), SHARDS);
    if common::fs_reads_o_direct(dir) {
        for s in shards {
            assert_eq!(s["direct_opens"], true, "O_DIRECT open lost to the limit: {s}");
        }
    }
    let said: Vec<&str> = stderr.lines().filter(|l| l.contains("RLIMIT_NOFILE")).collect();
    assert_eq!(said.len(), 1, "the raise must be said exactly once: {stderr}");
    assert!(said[0].contains("64") && said[0].contains("4096"), "{}", said[0]);

    // The digest through the engine works too, every tensor read.
    let out = run_limited(64, 4096, &[OsStr::new("digest"), dir.as_os_str()]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(String::from_utf8_lossy(&out.stdout).lines().count(), SHARDS);
}

#[test]
fn hard_limit_too_low_names_ulimit_and_the_numbers() {
    if !prlimit_available() {
        eprintln!("SKIP: prlimit (util-linux) is not installed");
        return;
    }
    let tmp = common::tempdir();
    let dir = tmp.path();
    model(dir);
    let out = run_limited(
        64,
        64,
        &[
            OsStr::new("digest"),
            dir.as_os_str(),
            OsStr::new("--backend"),
            OsStr::new("sync"),
        ],
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert!(
        stderr.contains("ulimit -n"),
        "the error does not name `ulimit -n`: {stderr}"
    );
    assert!(
        stderr.contains("soft limit 64") && stderr.contains("hard limit 64"),
        "{stderr}"
    );
    assert!(
        stderr.contains(".safetensors"),
        "the error does not name the file: {stderr}"
    );
}
