//! Files changed after open (issue 9, item 13). `Model::open` keeps each
//! copy's identity (st_dev, st_ino, size, ctime); `Model::verify` re-checks
//! it with the whole header (and, with `digest`, every tensor's sha256), and
//! a failed engine read re-checks it cheaply and says what changed.
//!
//! - a shard rewritten in place with the same size and different payload
//!   bytes: `verify` names it (ctime changed); with `digest`, the mirror copy
//!   differs from the primary, and the primary differs from an earlier
//!   record (`compare_with`, `weightstream verify --against`);
//! - truncated, then re-extended to less than it was: `verify` names the
//!   size and ctime change, and an engine read of a tensor past the new end
//!   fails with "changed after open: size A -> B" (io_uring and pread);
//! - replaced by a rename: "replaced (inode changed ...)"; removed:
//!   "removed"; both in-process and through `verify --against`.
//!
//! ctime comes from the kernel's coarse clock (a few ms): before changing a
//! file each test waits until that clock has moved past the file's ctime
//! (`tick`), as it has for a real change after open.

mod common;

use std::ffi::OsStr;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use common::{container_bytes, header_json, Entry};
use weightstream::Change;
use weightstream::{Engine, EngineConfig, Model, ModelConfig, VerifyReport};

const SHARD: &str = "model.safetensors";

/// A shard with a small `head` tensor and a 300 kB `tail`; returns
/// (path, data start, the whole file).
fn shard(dir: &Path, seed: u64) -> (PathBuf, u64, Vec<u8>) {
    std::fs::create_dir_all(dir).unwrap();
    let path = dir.join(SHARD);
    let header = header_json(&[Entry::u8("head", 0, 4096), Entry::u8("tail", 4096, 4096 + 300_000)]);
    let data = common::content(seed, 4096 + 300_000);
    let bytes = container_bytes(header.as_bytes(), &data);
    std::fs::write(&path, &bytes).unwrap();
    (path, 8 + header.len() as u64, bytes)
}

/// ctime, (seconds, nanoseconds).
fn ctime(path: &Path) -> (i64, i64) {
    use std::os::unix::fs::MetadataExt;
    let m = std::fs::metadata(path).unwrap_or_else(|e| panic!("stat {}: {e}", path.display()));
    (m.ctime(), m.ctime_nsec())
}

/// Waits until the kernel's clock for ctime has moved past `path`'s ctime
/// (a probe file beside it is touched until its ctime is later), so that
/// the change that follows is seen as one: a fact polled for, not a sleep
/// assumed long enough; 60 s is only a watchdog.
fn tick(path: &Path) {
    let was = ctime(path);
    let probe = path.with_extension("tick");
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    loop {
        std::fs::write(&probe, b"tick").unwrap();
        if ctime(&probe) > was {
            break;
        }
        assert!(std::time::Instant::now() < deadline, "ctime never moved past {was:?}");
        std::thread::sleep(Duration::from_millis(1));
    }
    std::fs::remove_file(&probe).unwrap();
}

fn changes_of<'a>(r: &'a VerifyReport, path: &Path) -> &'a [Change] {
    let shown = path.display().to_string();
    &r.files
        .iter()
        .find(|f| f.path == shown)
        .unwrap_or_else(|| panic!("{shown} not in the report: {r:?}"))
        .changes
}

fn cli(args: &[&OsStr]) -> (Option<i32>, String, String) {
    let out = common::run(args);
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn rewrite_in_place_with_the_same_size_is_named() {
    let tmp = common::tempdir();
    let primary = tmp.path().join("primary");
    let mirror = tmp.path().join("mirror");
    let (path, data_start, bytes) = shard(&primary, 1);
    std::fs::create_dir_all(&mirror).unwrap();
    std::fs::write(mirror.join(SHARD), &bytes).unwrap();
    let model = Model::open(ModelConfig::new(&primary).mirrors([&mirror])).unwrap();
    let before = model.verify(true).unwrap();
    assert!(before.is_clean(), "{before:?}");
    assert_eq!(before.files.len(), 2);
    assert_eq!(before.files[0].tensors.len(), 2, "{before:?}");
    let rec = tmp.path().join("record.json");
    let (code, out, err) = cli(&[
        OsStr::new("verify"),
        primary.as_os_str(),
        OsStr::new("--digest"),
        OsStr::new("--json"),
    ]);
    assert_eq!(code, Some(0), "{err}");
    std::fs::write(&rec, out).unwrap();

    tick(&path);
    // Same size, other bytes in `tail`.
    let f = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
    f.write_all_at(&[0xA5; 1000], data_start + 4096 + 5000).unwrap();
    drop(f);

    let r = model.verify(false).unwrap();
    assert_eq!(changes_of(&r, &path), [Change::Ctime], "{r:?}");
    assert!(changes_of(&r, &mirror.join(SHARD)).is_empty(), "{r:?}");
    let r = model.verify(true).unwrap();
    let m = changes_of(&r, &mirror.join(SHARD));
    assert!(
        matches!(m, [Change::Digest { against, tensors }] if against.contains("primary") && tensors == &["tail"]),
        "{m:?}"
    );
    let mut r = r;
    r.compare_with(&before);
    let p = changes_of(&r, &path);
    assert!(p.contains(&Change::Ctime), "{p:?}");
    assert!(
        p.iter().any(
            |c| matches!(c, Change::Digest { against, tensors } if against == "the record" && tensors == &["tail"])
        ),
        "{p:?}"
    );
    // The report is JSON and back.
    let back: VerifyReport = serde_json::from_str(&serde_json::to_string(&r).unwrap()).unwrap();
    assert_eq!(back.files.len(), r.files.len());

    // The CLI: fresh opens, so only a record or a mirror shows the rewrite.
    let (code, out, err) = cli(&[OsStr::new("verify"), primary.as_os_str()]);
    assert_eq!(code, Some(0), "{out}{err}");
    assert!(out.contains("nothing changed"), "{out}");
    let (code, out, err) = cli(&[
        OsStr::new("verify"),
        primary.as_os_str(),
        OsStr::new("--digest"),
        OsStr::new("--against"),
        rec.as_os_str(),
    ]);
    assert_eq!(code, Some(1), "{out}{err}");
    let line = out
        .lines()
        .find(|l| l.starts_with("CHANGED") && l.contains(&path.display().to_string()))
        .unwrap_or_else(|| panic!("the rewritten file is not named: {out}"));
    assert!(
        line.contains("ctime changed") && line.contains("payload differs from the record in 1 tensor(s): tail"),
        "{line}"
    );
    let (code, out, err) = cli(&[
        OsStr::new("verify"),
        primary.as_os_str(),
        OsStr::new("--mirror"),
        mirror.as_os_str(),
        OsStr::new("--digest"),
    ]);
    assert_eq!(code, Some(1), "{out}{err}");
    assert!(
        out.contains(&format!("CHANGED {}", mirror.join(SHARD).display()))
            && out.contains("differs from the primary copy"),
        "{out}"
    );
}

#[test]
fn truncated_then_re_extended_is_named_by_verify_and_by_the_failed_read() {
    for backend in common::engine_backends() {
        let tmp = common::tempdir();
        let dir = tmp.path();
        let (path, _, bytes) = shard(dir, 2);
        let size = bytes.len() as u64;
        let model = Model::open(ModelConfig::new(dir)).unwrap();
        let engine = Engine::new(&model, EngineConfig::default().backend(backend.parse().unwrap())).unwrap();
        tick(&path);
        let f = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
        f.set_len(size / 2).unwrap();
        f.set_len(size * 3 / 4).unwrap();
        drop(f);

        let r = model.verify(false).unwrap();
        assert_eq!(
            changes_of(&r, &path),
            [
                Change::Size {
                    was: size,
                    now: size * 3 / 4
                },
                Change::Ctime
            ],
            "{backend}"
        );
        let shown = r.files[0].changes[0].to_string();
        assert_eq!(shown, format!("size {size} -> {}", size * 3 / 4));

        let arena = engine.arena(model.slot_spec_for_largest("").unwrap(), 1).unwrap();
        let t = model.tensor("tail").unwrap();
        let err = engine
            .read(t, arena.take().unwrap())
            .unwrap()
            .wait()
            .expect_err("a read past the new end of file");
        let msg = err.to_string();
        assert!(
            msg.contains(&format!("changed after open: size {size} -> {}", size * 3 / 4))
                && msg.contains("ctime changed")
                && msg.contains(&path.display().to_string()),
            "{backend}: {msg}"
        );
    }
}

#[test]
fn replaced_by_rename_and_removed_are_named() {
    let tmp = common::tempdir();
    let dir = tmp.path().join("m");
    let (path, _, bytes) = shard(&dir, 3);
    let rec = tmp.path().join("record.json");
    let (code, out, err) = cli(&[OsStr::new("verify"), dir.as_os_str(), OsStr::new("--json")]);
    assert_eq!(code, Some(0), "{err}");
    std::fs::write(&rec, out).unwrap();
    let model = Model::open(ModelConfig::new(&dir)).unwrap();
    assert!(model.files()[0].changed_since_open().is_none());

    tick(&path);
    let new = tmp.path().join("new.safetensors");
    std::fs::write(&new, &bytes).unwrap();
    std::fs::rename(&new, &path).unwrap();
    let r = model.verify(false).unwrap();
    // The old inode lost its name, which also changes its ctime.
    let c = changes_of(&r, &path);
    let replaced = c
        .iter()
        .find(|c| matches!(c, Change::Replaced { .. }))
        .unwrap_or_else(|| panic!("{c:?}"));
    assert!(
        replaced.to_string().starts_with("replaced (inode changed: "),
        "{replaced}"
    );
    let said = model.files()[0].changed_since_open().expect("a change");
    assert!(
        said.starts_with("changed after open: ") && said.contains("replaced (inode changed"),
        "{said}"
    );

    // Another process, against the record: the inode differs.
    let (code, out, err) = cli(&[
        OsStr::new("verify"),
        dir.as_os_str(),
        OsStr::new("--against"),
        rec.as_os_str(),
    ]);
    assert_eq!(code, Some(1), "{out}{err}");
    assert!(
        out.contains(&format!(
            "CHANGED {} (copy rank 0): replaced (inode changed",
            path.display()
        )),
        "{out}"
    );

    std::fs::remove_file(&path).unwrap();
    let r = model.verify(false).unwrap();
    let c = changes_of(&r, &path);
    assert!(c.contains(&Change::Removed), "{c:?}");
    assert_eq!(Change::Removed.to_string(), "removed (the path no longer exists)");
}

/// `verify` of a model that cannot open exits 2, naming the file; a record
/// that is not one exits 2 naming it.
#[test]
fn verify_that_cannot_run_exits_2() {
    let tmp = common::tempdir();
    let dir = tmp.path();
    std::fs::write(dir.join(SHARD), b"\x05\x00\x00").unwrap();
    let (code, _, err) = cli(&[OsStr::new("verify"), dir.as_os_str()]);
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains(SHARD) && !err.contains("panicked"), "{err}");
    let good = tmp.path().join("good");
    shard(&good, 4);
    let bad = tmp.path().join("not-a-record.json");
    std::fs::write(&bad, b"[1, 2]").unwrap();
    let (code, _, err) = cli(&[
        OsStr::new("verify"),
        good.as_os_str(),
        OsStr::new("--against"),
        bad.as_os_str(),
    ]);
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains("not-a-record.json"), "{err}");
}
