//! A user without CAP_IPC_LOCK and a small RLIMIT_MEMLOCK (64 KiB, a common
//! distribution default) cannot register the arena as io_uring fixed
//! buffers. `weightstream digest --backend uring` must still work: plain
//! `Read`s instead of `ReadFixed`, every such chunk counted in
//! `drives[].chunks_unregistered`, `registered_buffers.enabled == false`
//! with a reason that names RLIMIT_MEMLOCK and how to raise it (`ulimit
//! -l`), said once on stderr, and the same digests as root's run (which
//! registers, and counts nothing unregistered).
//!
//! With `ulimit -l` at the figure that reason advises, the same user must
//! register the arena. And an arena dropped while its engine lives must give
//! its locked memory back (library level, in a child process).
//!
//! Runs the binary as `nobody` (uid/gid 65534) with the limit set in the
//! child; needs root to do that, otherwise it prints SKIP and passes. The
//! model and a copy of the binary live in a world-readable directory under
//! /tmp, since the build directory need not be traversable by `nobody`.

mod common;

use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::Command;

use common::json_sums;
use weightstream_synth::SynthSpec;

const NOBODY: u32 = 65534;
/// An unused uid for the library-level child (see [`NOBODY_TURN`]).
const CHILD_UID: u32 = 65533;
const LIMIT: u64 = 64 << 10;

/// Locked memory is charged per user, and a ring's charge is released
/// asynchronously after its process exits: the tests here run their
/// children under different uids (and take turns besides), so one test's
/// leftovers never count against the other's limit.
static NOBODY_TURN: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn nobody_turn() -> std::sync::MutexGuard<'static, ()> {
    NOBODY_TURN.lock().unwrap_or_else(|p| p.into_inner())
}

/// Root, and io_uring open to unprivileged users; else a SKIP line.
fn can_run() -> bool {
    if !rustix::process::geteuid().is_root() {
        eprintln!("SKIP: running a process as another user with a lowered RLIMIT_MEMLOCK needs root");
        return false;
    }
    match std::fs::read_to_string("/proc/sys/kernel/io_uring_disabled").map(|v| v.trim().to_string()) {
        Ok(v) if v != "0" => {
            eprintln!("SKIP: kernel.io_uring_disabled = {v}: io_uring is closed to unprivileged users");
            false
        }
        _ => true,
    }
}

/// A world-readable directory under /tmp (the build directory need not be
/// traversable by `nobody`) holding a synthetic model in `model/`.
fn shared_model(spec: &SynthSpec) -> (tempfile::TempDir, std::path::PathBuf) {
    let tmp = tempfile::Builder::new()
        .prefix("ws-memlock-")
        .tempdir_in("/tmp")
        .expect("temp dir under /tmp");
    chmod(tmp.path(), 0o755);
    let dir = tmp.path().join("model");
    common::synth_model(&dir, spec);
    chmod(&dir, 0o755);
    for e in std::fs::read_dir(&dir).unwrap() {
        chmod(&e.unwrap().path(), 0o644);
    }
    (tmp, dir)
}

/// Copies `exe` into `dir`, executable by everyone.
fn copy_exe(exe: &Path, dir: &Path) -> std::path::PathBuf {
    let to = dir.join(exe.file_name().unwrap());
    std::fs::copy(exe, &to).expect("copy the executable");
    chmod(&to, 0o755);
    to
}

fn chmod(p: &Path, mode: u32) {
    std::fs::set_permissions(p, std::fs::Permissions::from_mode(mode))
        .unwrap_or_else(|e| panic!("chmod {:o} {}: {e}", mode, p.display()));
}

fn parse(out: &std::process::Output, who: &str) -> serde_json::Value {
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{who}: digest failed:\n{stderr}");
    assert!(!stderr.contains("panicked"), "{who}:\n{stderr}");
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| panic!("{who}: not JSON ({e}):\n{stderr}"))
}

fn sum(v: &serde_json::Value, key: &str) -> u64 {
    v["stats"]["drives"]
        .as_array()
        .expect("stats.drives")
        .iter()
        .map(|d| d[key].as_u64().expect("a counter"))
        .sum()
}

#[test]
fn unprivileged_user_with_small_memlock_reads_unregistered_and_says_why() {
    if !can_run() {
        return;
    }
    let _turn = nobody_turn();
    let spec = SynthSpec {
        layers: 2,
        experts: 2,
        expert_bytes: 512 << 10,
        shards: 2,
        ..SynthSpec::default()
    };
    let (tmp, dir) = shared_model(&spec);
    let bin = copy_exe(&common::bin(), tmp.path());

    let args = ["digest", dir.to_str().unwrap(), "--json", "--backend", "uring"];
    let root = parse(
        &common::hermetic(Command::new(&bin)).args(args).output().unwrap(),
        "root",
    );
    let st = &root["stats"];
    assert_eq!(st["backend"], "uring", "{st:#}");
    assert_eq!(st["registered_buffers"]["enabled"], true, "root registers: {st:#}");
    assert_eq!(sum(&root, "chunks_unregistered"), 0, "{st:#}");

    let out = as_nobody(&bin, &args, LIMIT);
    let nobody = parse(&out, "nobody");
    let stderr = String::from_utf8_lossy(&out.stderr);
    let st = &nobody["stats"];
    assert_eq!(
        st["backend"], "uring",
        "a small ring fits in {LIMIT} bytes of locked memory: {st:#}"
    );
    assert_eq!(
        st["registered_buffers"]["enabled"], false,
        "an arena of megabytes cannot be registered under a {LIMIT}-byte RLIMIT_MEMLOCK: {st:#}"
    );
    let reason = st["registered_buffers"]["reason"]
        .as_str()
        .unwrap_or_else(|| panic!("no reason: {st:#}"));
    assert!(
        reason.contains("RLIMIT_MEMLOCK") && reason.contains("ulimit -l"),
        "the reason must name the limit and how to raise it: {reason}"
    );
    assert!(
        reason.contains(&LIMIT.to_string()),
        "the reason must give the current limit: {reason}"
    );
    assert!(sum(&nobody, "chunks_unregistered") > 0, "{st:#}");
    assert_eq!(
        json_sums(&nobody),
        json_sums(&root),
        "unregistered reads differ from root's"
    );
    assert_eq!(st["bytes"], root["stats"]["bytes"]);
    // Said once as it happened (the log), and once in the run's summary of
    // warnings (a `warning:` line at the end, whatever the log level).
    let (summary, logged): (Vec<&str>, Vec<&str>) = stderr
        .lines()
        .filter(|l| l.contains("RLIMIT_MEMLOCK"))
        .partition(|l| l.starts_with("warning: "));
    assert_eq!(logged.len(), 1, "the refusal must be logged exactly once:\n{stderr}");
    assert_eq!(
        summary.len(),
        1,
        "the refusal must be summed up exactly once:\n{stderr}"
    );

    // The advice works: with `ulimit -l` at the figure the reason gives, the
    // same user registers the same arena.
    let kib: u64 = reason
        .split("ulimit -l ")
        .nth(1)
        .and_then(|r| r.split(|c: char| !c.is_ascii_digit()).next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no `ulimit -l N` figure in: {reason}"));
    let hard = rustix::process::getrlimit(rustix::process::Resource::Memlock).maximum;
    if hard.is_some_and(|h| kib * 1024 > h) {
        eprintln!("note: the advised `ulimit -l {kib}` is above this process's hard limit {hard:?}; not tried");
        return;
    }
    let out = as_nobody(&bin, &args, kib * 1024);
    let advised = parse(&out, "nobody with the advised limit");
    let st = &advised["stats"];
    assert_eq!(
        st["registered_buffers"]["enabled"], true,
        "`ulimit -l {kib}` (as advised) still does not let the arena register: {st:#}"
    );
    assert_eq!(sum(&advised, "chunks_unregistered"), 0, "{st:#}");
    assert_eq!(json_sums(&advised), json_sums(&root));
}

/// Runs the binary as `nobody` with RLIMIT_MEMLOCK (soft and hard) at `limit`.
fn as_nobody(bin: &Path, args: &[&str], limit: u64) -> std::process::Output {
    let mut cmd = Command::new(bin);
    cmd.args(args);
    as_user(cmd, NOBODY, limit)
}

/// Runs `cmd` as `uid` (group the same number), in its program's
/// directory, with RLIMIT_MEMLOCK (soft and hard) at `limit` and the
/// weightstream environment removed.
fn as_user(cmd: Command, uid: u32, limit: u64) -> std::process::Output {
    as_user_with(cmd, uid, limit, &[])
}

/// [`as_user`] with the variables `env` set on top of the hermetic
/// environment.
fn as_user_with(cmd: Command, uid: u32, limit: u64, env: &[(&str, &str)]) -> std::process::Output {
    let dir = Path::new(cmd.get_program())
        .parent()
        .expect("the program's directory")
        .to_path_buf();
    let mut cmd = common::hermetic(cmd);
    cmd.envs(env.iter().copied());
    cmd.uid(uid).gid(uid).current_dir(dir);
    // SAFETY: runs in the forked child before exec, after the uid/gid
    // switch (so lowering the limit needs no privilege); it makes one system
    // call (setrlimit) and allocates nothing.
    unsafe {
        cmd.pre_exec(move || {
            let lim = rustix::process::Rlimit {
                current: Some(limit),
                maximum: Some(limit),
            };
            rustix::process::setrlimit(rustix::process::Resource::Memlock, lim).map_err(std::io::Error::from)
        });
    }
    cmd.output().expect("run as nobody")
}

const CHILD: &str = "WS_MEMLOCK_TEST_CHILD";

/// An arena dropped while its engine lives must give its locked memory
/// back: with RLIMIT_MEMLOCK room for one arena, creating, dropping and
/// creating again an arena of the same size registers both times. (The
/// registered pages are pinned by the ring; if the engine never unregisters
/// a dropped arena, its pages stay pinned and charged to the user until the
/// engine goes, and the second arena is refused with ENOMEM.)
///
/// The library calls run in a child: this test binary, re-run as an
/// unprivileged user with the limit, executing this same test with `WS_MEMLOCK_TEST_CHILD`
/// set to the model directory.
#[test]
fn arena_dropped_while_the_engine_lives_gives_back_its_locked_memory() {
    if let Ok(dir) = std::env::var(CHILD) {
        return child(Path::new(&dir));
    }
    if !can_run() {
        return;
    }
    let _turn = nobody_turn();
    let spec = SynthSpec {
        layers: 1,
        experts: 2,
        expert_bytes: 512 << 10,
        shards: 1,
        ..SynthSpec::default()
    };
    let (tmp, dir) = shared_model(&spec);
    let exe = copy_exe(&std::env::current_exe().unwrap(), tmp.path());
    // Room for one arena of ARENA_SLOTS largest-tensor slots, not two.
    let model = weightstream::Model::open(weightstream::ModelConfig::new(&dir)).unwrap();
    let one = (model.slot_spec_for_largest("").unwrap().slot_len().unwrap() * ARENA_SLOTS) as u64;
    let limit = (one + one / 2).next_multiple_of(4096);
    let hard = rustix::process::getrlimit(rustix::process::Resource::Memlock).maximum;
    if hard.is_some_and(|h| limit > h) {
        eprintln!("SKIP: needs RLIMIT_MEMLOCK {limit}, above this process's hard limit {hard:?}");
        return;
    }
    let name = "arena_dropped_while_the_engine_lives_gives_back_its_locked_memory";
    let mut cmd = Command::new(&exe);
    cmd.args([name, "--exact", "--include-ignored", "--nocapture", "--test-threads=1"])
        .env(CHILD, &dir);
    let out = as_user(cmd, CHILD_UID, limit);
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        out.status.success(),
        "child (uid {CHILD_UID}, RLIMIT_MEMLOCK {limit}):\n{text}"
    );
    assert!(text.contains("1 passed"), "the child did not run the test:\n{text}");
}

const ARENA_SLOTS: usize = 4;

/// The child's half: runs unprivileged under the limit.
fn child(dir: &Path) {
    use weightstream::{BackendChoice, Engine, EngineConfig, Model, ModelConfig};
    assert_eq!(
        rustix::process::geteuid().as_raw(),
        CHILD_UID,
        "the child runs unprivileged"
    );
    let model = Model::open(ModelConfig::new(dir)).unwrap();
    let cfg = EngineConfig::default().backend(BackendChoice::Uring);
    let engine = Engine::new(&model, cfg).unwrap();
    let spec = model.slot_spec_for_largest("").unwrap();
    let t = &model.catalog().tensors()[0];
    let unregistered = |e: &Engine| e.stats().drives.iter().map(|d| d.chunks_unregistered).sum::<u64>();
    for round in 0..3 {
        let arena = engine.arena(spec, ARENA_SLOTS).unwrap();
        let rb = engine.stats().registered_buffers.unwrap();
        assert!(
            rb.enabled,
            "arena {round} (earlier ones dropped) not registered: {:?}",
            rb.reason
        );
        let before = unregistered(&engine);
        let loaded = engine.read(t, arena.take().unwrap()).unwrap().wait().unwrap();
        assert_eq!(loaded.len() as u64, t.len);
        assert_eq!(unregistered(&engine), before, "arena {round}: chunks went unregistered");
        drop(loaded);
        drop(arena);
    }
}

const WARN_CHILD: &str = "WS_MEMLOCK_WARNINGS_CHILD";
/// Unused uids for the warnings test's library child and command run (see
/// [`NOBODY_TURN`]: locked memory is charged per user).
const WARN_UID: u32 = 65532;
const WARN_CLI_UID: u32 = 65531;

/// Issue 19: a memlock fallback reaches a user who installed nothing. In a
/// process with no `tracing` subscriber (this test binary, re-run as an
/// unprivileged user under a 64 KiB RLIMIT_MEMLOCK), the arena's refused
/// registration is in `engine.warnings()` (kind `Memlock`, the arena's size,
/// the limit in force and the `ulimit -l` to set, its cost), and
/// `format!("{}", engine.stats())` shows it before the per-drive lines.
/// The command, with its log turned off (`WEIGHTSTREAM_LOG=off`), still
/// ends its run with one `warning: ...` line on stderr naming `ulimit -l`.
#[test]
fn a_memlock_fallback_reaches_a_user_who_installed_no_subscriber() {
    if let Ok(dir) = std::env::var(WARN_CHILD) {
        return warnings_child(Path::new(&dir));
    }
    if !can_run() {
        return;
    }
    let _turn = nobody_turn();
    let spec = SynthSpec {
        layers: 1,
        experts: 2,
        expert_bytes: 512 << 10,
        shards: 1,
        ..SynthSpec::default()
    };
    let (tmp, dir) = shared_model(&spec);

    let exe = copy_exe(&std::env::current_exe().unwrap(), tmp.path());
    let name = "a_memlock_fallback_reaches_a_user_who_installed_no_subscriber";
    let mut cmd = Command::new(&exe);
    cmd.args([name, "--exact", "--include-ignored", "--nocapture", "--test-threads=1"])
        .env(WARN_CHILD, &dir);
    let out = as_user(cmd, WARN_UID, LIMIT);
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        out.status.success(),
        "child (uid {WARN_UID}, RLIMIT_MEMLOCK {LIMIT}):\n{text}"
    );
    assert!(text.contains("1 passed"), "the child did not run the test:\n{text}");
    eprintln!("the child's report:\n{text}");

    let bin = copy_exe(&common::bin(), tmp.path());
    let mut cmd = Command::new(&bin);
    cmd.args(["digest", dir.to_str().unwrap(), "--backend", "uring"]);
    let out = as_user_with(cmd, WARN_CLI_UID, LIMIT, &[(weightstream::env::LOG, "off")]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "digest as uid {WARN_CLI_UID}:\n{stderr}");
    let tensors = weightstream::Model::open(weightstream::ModelConfig::new(&dir))
        .unwrap()
        .catalog()
        .tensors()
        .len();
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).lines().count(),
        tensors,
        "every tensor's digest:\n{stderr}"
    );
    let said: Vec<&str> = stderr.lines().filter(|l| l.contains("ulimit -l")).collect();
    assert_eq!(
        said.len(),
        1,
        "one line names `ulimit -l`, the log being off:\n{stderr}"
    );
    assert!(
        said[0].starts_with("warning: arena of ") && said[0].contains("RLIMIT_MEMLOCK"),
        "a `warning:` line naming the arena and the limit: {}",
        said[0]
    );
    assert!(
        stderr.lines().all(|l| l.starts_with("warning: ")),
        "with the log off, only the run's warnings are said:\n{stderr}"
    );
}

/// The child's half: unprivileged, under the limit, no subscriber.
fn warnings_child(dir: &Path) {
    use weightstream::{BackendChoice, Engine, EngineConfig, Model, ModelConfig, WarningKind, WarningLocation};
    assert_eq!(
        rustix::process::geteuid().as_raw(),
        WARN_UID,
        "the child runs unprivileged"
    );
    assert!(
        !tracing::dispatcher::has_been_set(),
        "no tracing subscriber in this process: the warnings must not need one"
    );
    let model = Model::open(ModelConfig::new(dir)).unwrap();
    let engine = Engine::new(&model, EngineConfig::default().backend(BackendChoice::Uring)).unwrap();
    assert_eq!(
        engine.backend_name(),
        "uring",
        "a small ring fits in {LIMIT} bytes: {:?}",
        engine.stats()
    );
    let before = engine.warnings();
    assert!(
        before.iter().all(|w| w.kind != WarningKind::Memlock),
        "no memlock warning before any arena: {before:#?}"
    );
    let arena = engine
        .arena(model.slot_spec_for_largest("").unwrap(), ARENA_SLOTS)
        .unwrap();
    let t = &model.catalog().tensors()[0];
    let loaded = engine.read(t, arena.take().unwrap()).unwrap().wait().unwrap();
    assert_eq!(loaded.len() as u64, t.len);
    drop(loaded);

    let warnings = engine.warnings();
    let memlock: Vec<_> = warnings.iter().filter(|w| w.kind == WarningKind::Memlock).collect();
    assert_eq!(memlock.len(), 1, "one memlock warning: {warnings:#?}");
    let w = memlock[0];
    assert_eq!(
        w.location,
        WarningLocation::Arena {
            bytes: arena.bytes() as u64
        },
        "{w}"
    );
    assert_eq!(w.count, 1, "one arena refused: {w}");
    assert!(
        w.message.contains("RLIMIT_MEMLOCK") && w.message.contains("ulimit -l"),
        "names the limit and how to raise it: {w}"
    );
    assert!(
        w.message.contains(&format!("{LIMIT} bytes")),
        "names the limit in force: {w}"
    );
    assert!(w.cost.contains("plain reads"), "says what it costs: {w}");
    assert_eq!(engine.stats().warnings, warnings, "stats() leads with the same list");
    let chunks: u64 = engine.stats().drives.iter().map(|d| d.chunks_unregistered).sum();
    assert!(chunks > 0, "the read went unregistered");
    assert!(
        w.message.contains(&format!("{chunks} chunk(s) read unregistered")),
        "{w}"
    );

    let shown = format!("{}", engine.stats());
    println!("engine.stats() as a user sees it:\n{shown}");
    let lines: Vec<&str> = shown.lines().collect();
    let warned = lines
        .iter()
        .position(|l| l.contains("ulimit -l"))
        .unwrap_or_else(|| panic!("no line names `ulimit -l`:\n{shown}"));
    let first_drive = lines
        .iter()
        .position(|l| l.starts_with("drive "))
        .unwrap_or_else(|| panic!("no per-drive line:\n{shown}"));
    assert!(warned < first_drive, "the warning comes before the drives:\n{shown}");
    assert!(lines[warned].trim_start().starts_with("warning: arena of "), "{shown}");
    assert_eq!(
        lines[0],
        format!("warnings ({}, worst first):", warnings.len()),
        "{shown}"
    );
    assert!(
        !tracing::dispatcher::has_been_set(),
        "nothing installed a subscriber on the way"
    );
}
