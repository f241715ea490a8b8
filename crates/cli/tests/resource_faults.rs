//! Faults from the operating system, driven through the binary: a real
//! `io_uring_enter` that keeps failing (injected with strace), a
//! descriptor limit that a power-of-two fixed-file table would exceed, and
//! a thread limit that stops the I/O threads from starting. Each must end
//! in bounded time with a message that names the cause and the way out.
//! (Before: the first logged every 10 ms forever, the second turned fixed
//! files off, the third said "io_uring unavailable (EAGAIN)".)

mod common;

use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::Entry;

fn have(tool: &str) -> bool {
    Command::new(tool)
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// Runs `cmd`, killing it after `limit`: (exit status, stderr) or `None`
/// when it had to be killed.
fn run_bounded(mut cmd: Command, limit: Duration) -> Option<(i32, String)> {
    let mut child = cmd.stdout(Stdio::null()).stderr(Stdio::piped()).spawn().expect("spawn");
    let t0 = Instant::now();
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            let mut err = String::new();
            use std::io::Read;
            child.stderr.take().unwrap().read_to_string(&mut err).unwrap();
            return Some((status.code().unwrap_or(-1), err));
        }
        if t0.elapsed() > limit {
            let _ = child.kill();
            let _ = child.wait();
            return None;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn small_model(dir: &Path) {
    common::synth_model(
        dir,
        &weightstream_synth::SynthSpec {
            layers: 1,
            experts: 2,
            expert_bytes: 1 << 20,
            shards: 1,
            ..weightstream_synth::SynthSpec::default()
        },
    );
}

#[test]
fn io_uring_enter_failing_for_good_ends_the_digest_with_the_cause() {
    if !have("strace") || !common::uring_available() {
        eprintln!("SKIP: needs strace and io_uring");
        return;
    }
    let tmp = common::tempdir();
    let dir = tmp.path().join("model");
    small_model(&dir);
    // Every io_uring_enter from the third on fails with ENOMEM.
    let mut cmd = common::hermetic(Command::new("strace"));
    cmd.args([
        "-f",
        "-qq",
        "-o",
        "/dev/null",
        "-e",
        "inject=io_uring_enter:error=ENOMEM:when=3+",
    ])
    .arg(common::bin())
    .args(["digest", "--backend", "uring"])
    .arg(&dir);
    // Bounded: the 60 s watchdog fails a digest that never ends; the time
    // (the ring's failure budget plus start-up under strace) is printed.
    let t0 = Instant::now();
    let (code, err) = run_bounded(cmd, Duration::from_secs(60)).expect("digest still running after 60 s");
    eprintln!("the digest ended after {:?}", t0.elapsed());
    assert_eq!(code, 1, "{err}");
    assert!(
        err.contains("io_uring_enter kept failing") && err.contains("Cannot allocate memory"),
        "{err}"
    );
    // Said once, not every 10 ms.
    assert!(err.matches("retrying").count() <= 1, "{err}");
}

/// 500 shards are 1000 descriptors; a table rounded up to 2048 entries is
/// refused under `ulimit -n 1100`, one of exactly 1000 is not.
#[test]
fn fixed_files_fit_a_descriptor_limit_just_above_what_the_model_opens() {
    if !have("prlimit") || !common::uring_available() {
        eprintln!("SKIP: needs prlimit and io_uring");
        return;
    }
    let tmp = common::tempdir();
    let dir = tmp.path().join("many");
    std::fs::create_dir(&dir).unwrap();
    let data = common::content(5, 4096);
    for i in 0..500 {
        let name = format!("t{i:03}");
        let h = common::header_json(&[Entry::u8(&name, 0, 4096)]);
        common::write_container(&dir.join(format!("s{i:03}.safetensors")), h.as_bytes(), &data);
    }
    let mut cmd = common::hermetic(Command::new("prlimit"));
    cmd.arg("--nofile=1100:1100")
        .arg(common::bin())
        .args(["digest", "--backend", "uring", "--json"])
        .arg(&dir)
        .stderr(Stdio::piped());
    let out = cmd.output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(
        v["stats"]["fixed_files"]["enabled"], true,
        "{:#}\n{err}",
        v["stats"]["fixed_files"]
    );
    assert_eq!(v["tensors"].as_object().map(|o| o.len()), Some(500));
}

/// Without room for one more thread, the engine says RLIMIT_NPROC (the way
/// out), not that io_uring is unavailable, and does not pretend a pread
/// backend (which needs threads too) could run.
#[test]
fn a_thread_limit_is_named_as_such() {
    if !rustix::process::geteuid().is_root() {
        eprintln!("SKIP: needs root to run the binary as another user");
        return;
    }
    let tmp = common::tempdir();
    let dir = tmp.path().join("model");
    small_model(&dir);
    // Readable by nobody.
    let mut p = dir.clone();
    while p.starts_with(env!("CARGO_TARGET_TMPDIR")) || p == Path::new(env!("CARGO_TARGET_TMPDIR")) {
        let _ = std::fs::set_permissions(&p, std::os::unix::fs::PermissionsExt::from_mode(0o755));
        if !p.pop() {
            break;
        }
    }
    for e in std::fs::read_dir(&dir).unwrap() {
        let _ = std::fs::set_permissions(e.unwrap().path(), std::os::unix::fs::PermissionsExt::from_mode(0o644));
    }
    // A copy of the binary nobody can run (the build tree may not be).
    let exe = tmp.path().join("weightstream");
    std::fs::copy(common::bin(), &exe).unwrap();
    let mut cmd = common::hermetic(Command::new(&exe));
    cmd.args(["digest", "--backend", "uring"])
        .arg(&dir)
        .uid(65534)
        .gid(65534);
    // SAFETY: runs in the forked child before exec, after the uid switch:
    // one setrlimit call, no allocation. One process (this one) allowed:
    // no thread can be created.
    unsafe {
        cmd.pre_exec(|| {
            let lim = rustix::process::Rlimit {
                current: Some(1),
                maximum: Some(1),
            };
            rustix::process::setrlimit(rustix::process::Resource::Nproc, lim).map_err(std::io::Error::from)
        });
    }
    let (code, err) = run_bounded(cmd, Duration::from_secs(60)).expect("still running after 60 s");
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("RLIMIT_NPROC") && err.contains("ulimit -u"), "{err}");
    assert!(!err.contains("io_uring unavailable"), "{err}");
}

/// One EINTR from io_uring_enter (a signal) is not the end of a ceiling
/// measurement. (Before: it was fatal, and the function returned with reads
/// still in flight into buffers it then freed.)
#[test]
fn ceiling_survives_an_interrupted_io_uring_enter() {
    if !have("strace") || !common::uring_available() {
        eprintln!("SKIP: needs strace and io_uring");
        return;
    }
    let tmp = common::tempdir();
    let dir = tmp.path().join("model");
    small_model(&dir);
    let shard = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| p.extension().is_some_and(|x| x == "safetensors"))
        .unwrap();
    for when in ["2", "2+3"] {
        let mut cmd = common::hermetic(Command::new("strace"));
        cmd.args(["-f", "-qq", "-o", "/dev/null", "-e"])
            .arg(format!("inject=io_uring_enter:error=EINTR:when={when}"))
            .arg(common::bin())
            // One configuration (the sweep records a failed configuration
            // and goes on: one would hide the EINTR being fatal).
            .args([
                "ceiling",
                "--qd",
                "4",
                "--bs",
                "256KiB",
                "--readers",
                "1",
                "--submit",
                "inline",
                "--buffers",
                "plain",
            ])
            .arg(&shard);
        let (code, err) = run_bounded(cmd, Duration::from_secs(60)).expect("ceiling still running after 60 s");
        assert_eq!(code, 0, "EINTR at call(s) {when}: {err}");
        assert!(!err.contains("failed"), "EINTR at call(s) {when}: {err}");
    }
}
