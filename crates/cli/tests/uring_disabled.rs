//! With io_uring refused by the kernel (`kernel.io_uring_disabled = 2`),
//! `--backend auto` falls back to the pread backend, says why exactly once
//! on stderr and in `stats.backend_reason`, and reads the same bytes as the
//! sync reference path; `--backend uring` fails with a clear error (no
//! panic).
//!
//! Needs root and a kernel with the sysctl; otherwise it prints SKIP and
//! passes. The sysctl is global: it is set only around the two runs that
//! need it and restored by a drop guard (also on panic). This is the only
//! test in this file, and cargo runs test binaries one after another.

mod common;

use std::ffi::OsStr;
use std::path::Path;

use common::{json_sums, run_json};
use weightstream_synth::SynthSpec;

const SYSCTL: &str = "/proc/sys/kernel/io_uring_disabled";

/// Puts the saved value back when dropped.
struct Restore(String);

impl Drop for Restore {
    fn drop(&mut self) {
        if let Err(e) = std::fs::write(SYSCTL, &self.0) {
            eprintln!("FAILED to restore {SYSCTL} to {:?}: {e}", self.0.trim());
        }
    }
}

fn digest(dir: &Path, extra: &[&str]) -> std::process::Output {
    let mut args: Vec<&OsStr> = vec![OsStr::new("digest"), dir.as_os_str()];
    args.extend(extra.iter().map(OsStr::new));
    common::run(&args)
}

#[test]
fn auto_falls_back_to_pread_when_io_uring_is_disabled() {
    if !rustix::process::geteuid().is_root() {
        eprintln!("SKIP: setting {SYSCTL} needs root");
        return;
    }
    let saved = match std::fs::read_to_string(SYSCTL) {
        Ok(v) => v,
        Err(e) => {
            eprintln!("SKIP: {SYSCTL}: {e} (kernel without the sysctl)");
            return;
        }
    };
    let tmp = common::tempdir();
    let dir = tmp.path().join("model");
    let spec = SynthSpec {
        layers: 2,
        experts: 2,
        expert_bytes: 300 << 10,
        shards: 2,
        ..SynthSpec::default()
    };
    common::synth_model(&dir, &spec);
    let d = dir.as_os_str();
    let s = OsStr::new;
    // Everything that does not need the sysctl first: the window where it is
    // set stays as short as two runs of the binary.
    let (sync, _) = run_json(&[s("digest"), d, s("--json"), s("--backend"), s("sync")]);
    let (before, _) = run_json(&[s("digest"), d, s("--json"), s("--backend"), s("auto")]);
    if saved.trim() == "0" {
        assert_eq!(
            before["stats"]["backend"], "uring",
            "io_uring is enabled: auto must pick it"
        );
    }

    let (auto, uring) = {
        let guard = Restore(saved.clone());
        std::fs::write(SYSCTL, "2").expect("set kernel.io_uring_disabled = 2");
        let auto = digest(&dir, &["--json", "--backend", "auto"]);
        let uring = digest(&dir, &["--backend", "uring"]);
        drop(guard);
        (auto, uring)
    };
    assert_eq!(std::fs::read_to_string(SYSCTL).unwrap(), saved, "sysctl restored");

    let stderr = String::from_utf8_lossy(&auto.stderr);
    assert!(
        auto.status.success(),
        "--backend auto under io_uring_disabled=2 failed:\n{stderr}"
    );
    let v: serde_json::Value = serde_json::from_slice(&auto.stdout).expect("--json output");
    let st = &v["stats"];
    assert_eq!(st["backend"], "pread", "{st:#}");
    let reason = st["backend_reason"]
        .as_str()
        .unwrap_or_else(|| panic!("no backend_reason: {st:#}"));
    assert!(reason.contains("io_uring_disabled"), "backend_reason: {reason}");
    assert_eq!(
        json_sums(&v),
        json_sums(&sync),
        "pread fallback bytes differ from the sync path"
    );
    assert_eq!(st["bytes"], sync["stats"]["bytes"]);
    // Said once as it happened (a log line), and once in the run's
    // `warning:` lines at the end; both naming the cause.
    let (summary, warned): (Vec<&str>, Vec<&str>) = stderr
        .lines()
        .filter(|l| l.contains("io_uring"))
        .partition(|l| l.starts_with("warning: "));
    assert_eq!(warned.len(), 1, "the fallback must be logged exactly once:\n{stderr}");
    assert!(
        warned[0].contains("io_uring_disabled") && warned[0].contains("pread"),
        "{}",
        warned[0]
    );
    assert_eq!(
        summary.len(),
        1,
        "the fallback must be summed up exactly once:\n{stderr}"
    );
    assert!(
        summary[0].starts_with("warning: engine: io_uring unavailable") && summary[0].contains("io_uring_disabled"),
        "{}",
        summary[0]
    );
    assert!(!stderr.contains("panicked"), "{stderr}");

    let stderr = String::from_utf8_lossy(&uring.stderr);
    assert!(
        !uring.status.success(),
        "--backend uring succeeded with io_uring disabled"
    );
    assert_eq!(uring.status.code(), Some(1), "a plain failure, not a crash:\n{stderr}");
    assert!(uring.stdout.is_empty(), "no digests on failure");
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert!(
        stderr.contains("io_uring"),
        "the error must say io_uring failed:\n{stderr}"
    );
    assert!(
        stderr.contains("Operation not permitted") || stderr.contains("EPERM") || stderr.contains("disabled"),
        "the error must give the cause:\n{stderr}"
    );
}
