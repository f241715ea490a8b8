//! Non-regular files never hang, grow memory or vanish silently (issue 9,
//! item 5): every shard (primary, split directory, mirror) and the index is
//! opened non-blocking, fstat'ed and refused by name unless it is a regular
//! file.
//!
//! - a mirror entry that is a symlink to a FIFO (or a FIFO): `Model::open`
//!   returns within seconds, the copy is refused and reported, the primary
//!   serves;
//! - `model.safetensors.index.json` linked to `/dev/zero` (refused, memory
//!   bounded: checked in a child process with a capped address space) or to
//!   a FIFO (refused, no hang);
//! - a directory, FIFO, link to a FIFO, socket or character device named
//!   `*.safetensors` in the primary or a split directory: an error naming it
//!   (the model does not open with fewer shards).

mod common;

use std::ffi::OsStr;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use common::{container_bytes, header_json, Entry};
use weightstream::{Arena, Model, ModelConfig, SlotSpec};

/// How long `Model::open` may take before the test calls it hung: a
/// watchdog (an open blocked on a FIFO never returns), generous for a
/// loaded machine.
const OPEN_LIMIT: Duration = Duration::from_secs(30);

/// A shard with one U8 tensor `name` of `len` bytes.
fn shard(path: &Path, name: &str, len: usize, seed: u64) -> Vec<u8> {
    let header = header_json(&[Entry::u8(name, 0, len as u64)]);
    let data = common::content(seed, len);
    std::fs::write(path, container_bytes(header.as_bytes(), &data)).unwrap();
    data
}

fn mkfifo(path: &Path) {
    rustix::fs::mknodat(
        rustix::fs::CWD,
        path,
        rustix::fs::FileType::Fifo,
        rustix::fs::Mode::from_raw_mode(0o600),
        0,
    )
    .unwrap_or_else(|e| panic!("mkfifo {}: {e}", path.display()));
}

/// Opens every FIFO in `fifos` for writing without blocking, which releases
/// a reader blocked in open(2) (only needed when the code under test hangs).
fn release(fifos: &[PathBuf]) {
    use std::os::unix::fs::OpenOptionsExt;
    for f in fifos {
        let _ = std::fs::OpenOptions::new()
            .write(true)
            .custom_flags(rustix::fs::OFlags::NONBLOCK.bits() as i32)
            .open(f);
    }
}

/// `Model::open(cfg)` on another thread; panics if it has not returned
/// within [`OPEN_LIMIT`] (after releasing `fifos`).
fn open_within_limit(cfg: ModelConfig, fifos: &[PathBuf]) -> weightstream::Result<Model> {
    let (tx, rx) = mpsc::channel();
    let what = format!("{:?}", cfg.primary);
    std::thread::spawn(move || {
        let _ = tx.send(Model::open(cfg));
    });
    match rx.recv_timeout(OPEN_LIMIT) {
        Ok(r) => r,
        Err(_) => {
            release(fifos);
            panic!("Model::open({what}) did not return within {OPEN_LIMIT:?}: it hangs on a non-regular file");
        }
    }
}

fn read(model: &Model, name: &str) -> Vec<u8> {
    let t = model.tensor(name).unwrap();
    let arena = Arena::new(SlotSpec::new(t.len.max(1) as usize), 1).unwrap();
    model.read_sync(t, arena.take().unwrap()).unwrap().to_vec()
}

#[test]
fn mirror_entry_linked_to_a_fifo_is_refused_and_the_primary_serves() {
    let tmp = common::tempdir();
    let primary = tmp.path().join("primary");
    let mirror = tmp.path().join("mirror");
    std::fs::create_dir_all(&primary).unwrap();
    std::fs::create_dir_all(&mirror).unwrap();
    let a = shard(&primary.join("a.safetensors"), "a", 5000, 1);
    let b = shard(&primary.join("b.safetensors"), "b", 3000, 2);
    // a: the mirror's entry is a link to a FIFO elsewhere; b: a FIFO itself.
    let fifo_a = tmp.path().join("pipe-a");
    mkfifo(&fifo_a);
    std::os::unix::fs::symlink(&fifo_a, mirror.join("a.safetensors")).unwrap();
    let fifo_b = mirror.join("b.safetensors");
    mkfifo(&fifo_b);

    let t0 = Instant::now();
    let model = open_within_limit(
        ModelConfig::new(&primary).mirrors([&mirror]),
        &[fifo_a.clone(), fifo_b.clone()],
    )
    .expect("the model opens on its primary copies");
    eprintln!("Model::open took {:?}", t0.elapsed());
    for s in 0..2 {
        assert_eq!(model.copies(s).len(), 1, "a FIFO was accepted as a copy of shard {s}");
    }
    let refused: Vec<_> = model.copy_report().iter().filter(|c| !c.accepted).collect();
    assert_eq!(refused.len(), 2, "{:?}", model.copy_report());
    for c in &refused {
        let why = c.reason.as_deref().unwrap_or("");
        assert!(why.contains("FIFO") && why.contains("not a regular file"), "{c:?}");
    }
    assert_eq!(read(&model, "a"), a);
    assert_eq!(read(&model, "b"), b);

    // The CLI says so too (the refused copy is listed), and exits 0.
    let out = common::run(&[
        OsStr::new("inspect"),
        primary.as_os_str(),
        OsStr::new("--mirror"),
        mirror.as_os_str(),
    ]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(stdout.contains("refused copy") && stdout.contains("FIFO"), "{stdout}");
    assert!(stderr.contains("FIFO"), "no warning names the refused copy: {stderr}");
}

#[test]
fn index_linked_to_a_fifo_is_refused_without_hanging() {
    let tmp = common::tempdir();
    let dir = tmp.path();
    shard(&dir.join("a.safetensors"), "a", 100, 1);
    let fifo = tmp.path().join("index-pipe");
    mkfifo(&fifo);
    std::os::unix::fs::symlink(&fifo, dir.join("model.safetensors.index.json")).unwrap();
    let err = open_within_limit(ModelConfig::new(dir), std::slice::from_ref(&fifo))
        .expect_err("an index that is a FIFO must be refused");
    let msg = err.to_string();
    assert!(
        msg.contains("model.safetensors.index.json") && msg.contains("FIFO"),
        "{msg}"
    );
}

/// Runs the binary with the address space capped (so a reader that grows
/// without bound fails fast instead of taking the machine's memory) and
/// kills it after `limit`. Returns (exit status or None if killed, stderr).
fn run_capped(args: &[&OsStr], limit: Duration) -> (Option<std::process::ExitStatus>, String) {
    let mut cmd = common::hermetic(Command::new("sh"));
    // 4 GiB of address space: plenty for the binary, not for /dev/zero.
    cmd.arg("-c")
        .arg("ulimit -v 4194304 && exec \"$0\" \"$@\"")
        .arg(common::bin())
        .args(args)
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    let mut child = cmd.spawn().expect("run sh");
    let t0 = Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break Some(s);
        }
        if t0.elapsed() > limit {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let mut err = String::new();
    use std::io::Read;
    let _ = child.stderr.take().unwrap().read_to_string(&mut err);
    (status, err)
}

#[test]
fn index_linked_to_dev_zero_is_refused_with_bounded_memory() {
    let tmp = common::tempdir();
    let dir = tmp.path();
    shard(&dir.join("a.safetensors"), "a", 100, 1);
    std::os::unix::fs::symlink("/dev/zero", dir.join("model.safetensors.index.json")).unwrap();
    let (status, stderr) = run_capped(
        &[
            OsStr::new("digest"),
            dir.as_os_str(),
            OsStr::new("--backend"),
            OsStr::new("sync"),
        ],
        Duration::from_secs(30),
    );
    let status = status.unwrap_or_else(|| panic!("digest did not finish within 30 s: {stderr}"));
    assert_eq!(status.code(), Some(1), "{status:?}: {stderr}");
    assert!(
        stderr.contains("model.safetensors.index.json") && stderr.contains("character device"),
        "{stderr}"
    );
    assert!(
        !stderr.contains("panicked") && !stderr.contains("memory allocation"),
        "{stderr}"
    );

    // In-process too (safe now that the child proved the read is bounded).
    let err = Model::open(ModelConfig::new(dir)).expect_err("refused");
    assert!(err.to_string().contains("not a regular file"), "{err}");
}

/// An index that is a regular file but larger than the cap is refused
/// before it is read, naming the file and the cap.
#[test]
fn index_over_the_size_cap_is_refused() {
    let tmp = common::tempdir();
    let dir = tmp.path();
    shard(&dir.join("a.safetensors"), "a", 100, 1);
    let index = dir.join("model.safetensors.index.json");
    let f = std::fs::File::create(&index).unwrap();
    f.set_len(weightstream::__internal::MAX_INDEX_LEN + 1).unwrap(); // sparse
    let err = Model::open(ModelConfig::new(dir)).expect_err("refused");
    let msg = err.to_string();
    assert!(
        msg.contains("model.safetensors.index.json")
            && msg.contains(&weightstream::__internal::MAX_INDEX_LEN.to_string()),
        "{msg}"
    );
}

/// Each kind of non-regular `*.safetensors` entry, next to a good shard, in
/// the primary directory and in a split directory: an error naming it.
#[test]
fn non_regular_shard_entries_are_errors_naming_them() {
    type Make = fn(&Path, &Path) -> Vec<PathBuf>;
    let cases: Vec<(&str, Make, &str)> = vec![
        (
            "directory",
            |_, p| {
                std::fs::create_dir(p).unwrap();
                vec![]
            },
            "directory",
        ),
        (
            "fifo",
            |_, p| {
                mkfifo(p);
                vec![p.to_path_buf()]
            },
            "FIFO",
        ),
        (
            "link to fifo",
            |root, p| {
                let f = root.join("elsewhere-pipe");
                mkfifo(&f);
                std::os::unix::fs::symlink(&f, p).unwrap();
                vec![f]
            },
            "FIFO",
        ),
        (
            "socket",
            |_, p| {
                let l = std::os::unix::net::UnixListener::bind(p).unwrap();
                std::mem::forget(l);
                vec![]
            },
            "socket",
        ),
        (
            "link to /dev/null",
            |_, p| {
                std::os::unix::fs::symlink("/dev/null", p).unwrap();
                vec![]
            },
            "character device",
        ),
        (
            "dangling link",
            |root, p| {
                std::os::unix::fs::symlink(root.join("nowhere"), p).unwrap();
                vec![]
            },
            "",
        ),
    ];
    let mut wrong = Vec::new();
    for split in [false, true] {
        for (what, make, kind) in &cases {
            let tmp = common::tempdir();
            let primary = tmp.path().join("primary");
            let other = tmp.path().join("split");
            std::fs::create_dir_all(&primary).unwrap();
            std::fs::create_dir_all(&other).unwrap();
            shard(&primary.join("a.safetensors"), "a", 100, 1);
            let bad = if split { &other } else { &primary }.join("x.safetensors");
            let fifos = make(tmp.path(), &bad);
            let mut cfg = ModelConfig::new(&primary);
            if split {
                cfg = cfg.dirs([&other]);
            }
            let ctx = format!("{what} (split dir: {split})");
            match open_within_limit(cfg, &fifos) {
                Ok(m) => wrong.push(format!(
                    "{ctx}: the model opened with {} shard(s); the entry was skipped silently",
                    m.catalog().shards().len()
                )),
                Err(e) => {
                    let err = e.to_string();
                    if !err.contains(&bad.display().to_string()) || !err.contains(kind) {
                        wrong.push(format!("{ctx}: the error does not name the entry and {kind:?}: {err}"));
                    }
                }
            }
        }
    }
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
}

/// Refused files are never kept open, and shards are not left open with
/// O_NONBLOCK (later reads behave normally).
#[test]
fn shards_are_not_left_non_blocking() {
    let tmp = common::tempdir();
    let dir = tmp.path();
    shard(&dir.join("a.safetensors"), "a", 100, 1);
    let model = Model::open(ModelConfig::new(dir)).unwrap();
    for f in model.files() {
        let fl = rustix::fs::fcntl_getfl(f.buffered()).unwrap();
        assert!(
            !fl.contains(rustix::fs::OFlags::NONBLOCK),
            "{}: {fl:?}",
            f.path.display()
        );
        if let Some(d) = f.direct() {
            let fl = rustix::fs::fcntl_getfl(d).unwrap();
            assert!(
                !fl.contains(rustix::fs::OFlags::NONBLOCK),
                "{}: {fl:?}",
                f.path.display()
            );
        }
    }
}
