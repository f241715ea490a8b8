//! Replicas are proven before they are trusted, and directories are
//! validated before anything is opened (DESIGN contracts 5 and 8,
//! FIELD-NOTES "Mirrors", "Split directories"):
//!
//! - a mirror copy of another size, one whose header differs in one byte,
//!   one whose header length prefix differs: each refused with the reason
//!   (`inspect --json` lists it under `refused_copies`; a warning names the
//!   file), and the primary keeps serving that shard (the refused copies'
//!   payloads are corrupted too, so a read from one would change a digest);
//! - a mirror directory with no usable shard is reported
//!   "no usable shard; ignored" and adds no drive; a partial mirror's
//!   missing files are skipped silently;
//! - `inspect --json` shows every shard's copies with their drives;
//! - mirror files are opened read-only (`/proc/self/fdinfo` flags) and never
//!   written (contents and mtimes unchanged after every backend and route);
//!   a refused copy is not even kept open;
//! - a basename in two split directories: the first listed wins, the other
//!   is reported, no error;
//! - a missing directory, a relative path, a symlink, a path with a control
//!   character (shown escaped), a regular file, the primary itself (however
//!   spelled), a directory inside or around the primary, one listed twice:
//!   each refused with an error naming the entry as typed, exit status 1,
//!   no panic, for split directories and mirrors alike;
//! - a mirror on the primary's filesystem is accepted with a warning that it
//!   adds no bandwidth.
//!
//! The second drive is `/dev/shm`; without it the tests print SKIP and pass.

mod common;

use std::collections::BTreeMap;
use std::ffi::{OsStr, OsString};
use std::path::{Path, PathBuf};
use std::time::SystemTime;

use serde_json::Value;
use weightstream::{BackendChoice, Engine, EngineConfig, Model, ModelConfig, RoutePolicy};

fn os(s: &str) -> &OsStr {
    OsStr::new(s)
}

/// A model in a primary directory on the first drive, and a directory on
/// the second drive for copies.
struct Fixture {
    tmp: tempfile::TempDir,
    shm: tempfile::TempDir,
    primary: PathBuf,
    want: Option<BTreeMap<String, String>>,
    sync: BTreeMap<String, String>,
    /// Shard basenames, largest first.
    shards: Vec<String>,
}

impl Fixture {
    fn new() -> Option<Self> {
        let shm = common::second_drive_tempdir()?;
        let tmp = common::tempdir();
        let primary = tmp.path().join("primary");
        let want = common::reference_or_synth(&primary);
        let out = common::run(&[os("digest"), primary.as_os_str(), os("--backend"), os("sync")]);
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        let sync = common::parse_sums(&String::from_utf8(out.stdout).unwrap());
        if let Some(w) = &want {
            assert_eq!(&sync, w, "sync path differs from the reference");
        }
        let mut shards = common::shard_names(&primary);
        shards.sort_by_key(|n| std::cmp::Reverse(std::fs::metadata(primary.join(n)).unwrap().len()));
        assert!(shards.len() >= 4, "{shards:?}");
        Some(Fixture {
            tmp,
            shm,
            primary,
            want,
            sync,
            shards,
        })
    }

    fn names(&self) -> Vec<&str> {
        self.shards.iter().map(String::as_str).collect()
    }

    /// Runs the binary; returns (success, stdout, stderr), after checking
    /// that nothing panicked.
    fn run(&self, args: &[&OsStr]) -> (bool, String, String) {
        let out = common::run(args);
        let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
        assert!(!stderr.contains("panicked"), "{args:?} panicked:\n{stderr}");
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            stderr,
        )
    }

    fn inspect(&self, layout: &[&OsStr]) -> (Value, String) {
        let mut args = vec![os("inspect"), self.primary.as_os_str(), os("--json")];
        args.extend_from_slice(layout);
        let (ok, out, err) = self.run(&args);
        assert!(ok, "inspect {layout:?} failed:\n{err}");
        (serde_json::from_str(&out).expect("inspect --json"), err)
    }

    /// `digest --json` with `layout` and `extra`; the sums must equal the
    /// sync path's and the reference's. Returns the stats.
    fn digest(&self, layout: &[&OsStr], extra: &[&str]) -> Value {
        let mut args = vec![os("digest"), self.primary.as_os_str(), os("--json")];
        args.extend_from_slice(layout);
        args.extend(extra.iter().map(|s| os(s)));
        let (ok, out, err) = self.run(&args);
        assert!(ok, "digest {args:?} failed:\n{err}");
        let v: Value = serde_json::from_str(&out).unwrap();
        let got = common::json_sums(&v);
        assert_eq!(got, self.sync, "digest {args:?} differs from the sync path");
        if let Some(w) = &self.want {
            assert_eq!(&got, w, "digest {args:?} differs from the reference");
        }
        v["stats"].clone()
    }
}

fn header_len(bytes: &[u8]) -> usize {
    u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize
}

/// Flips one byte of the data section (the last byte of the file).
fn corrupt_payload(bytes: &mut [u8]) {
    let n = bytes.len();
    bytes[n - 1] ^= 0x5a;
}

/// Every shard's copies from `inspect --json`: name -> [(path, drive)].
fn copies_of(v: &Value) -> BTreeMap<String, Vec<(String, String)>> {
    v["shards"]
        .as_array()
        .expect("shards")
        .iter()
        .map(|s| {
            let copies = s["copies"]
                .as_array()
                .expect("copies")
                .iter()
                .map(|c| {
                    (
                        c["path"].as_str().unwrap().to_string(),
                        c["drive"].as_str().unwrap().to_string(),
                    )
                })
                .collect();
            (s["name"].as_str().unwrap().to_string(), copies)
        })
        .collect()
}

/// The drive (device name) `inspect --json` reports for the volume mounted
/// at or above `dir`: the one whose mount is the longest prefix of it.
fn drive_of(v: &Value, dir: &Path) -> String {
    let dir = std::fs::canonicalize(dir).unwrap();
    v["drives"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|d| dir.starts_with(d["mount"].as_str().unwrap()))
        .max_by_key(|d| d["mount"].as_str().unwrap().len())
        .unwrap_or_else(|| panic!("no drive for {}: {v:#}", dir.display()))["device"]
        .as_str()
        .unwrap()
        .to_string()
}

fn stat_drive<'a>(stats: &'a Value, device: &str) -> &'a Value {
    stats["drives"]
        .as_array()
        .unwrap()
        .iter()
        .find(|d| d["device"] == device)
        .unwrap_or_else(|| panic!("no drive {device} in {stats:#}"))
}

#[test]
fn divergent_copies_are_refused_with_the_reason_and_the_primary_serves() {
    let Some(fx) = Fixture::new() else { return };
    let names = fx.names();
    let m = fx.shm.path().join("mirror");
    common::copy_files(&fx.primary, &m, &names);
    let (good, size_differs, header_byte, length_prefix) = (names[0], names[1], names[2], names[3]);
    let primary_size = |n: &str| std::fs::metadata(fx.primary.join(n)).unwrap().len();

    // One byte longer (and a corrupted payload).
    let mut b = std::fs::read(m.join(size_differs)).unwrap();
    corrupt_payload(&mut b);
    b.push(0);
    std::fs::write(m.join(size_differs), &b).unwrap();
    // One byte of the JSON header changed (same size, payload corrupted).
    let mut b = std::fs::read(m.join(header_byte)).unwrap();
    let at = 8 + header_len(&b) / 2;
    b[at] ^= 0x01;
    corrupt_payload(&mut b);
    std::fs::write(m.join(header_byte), &b).unwrap();
    // The 8-byte length prefix says 0 (same size, payload corrupted).
    let mut b = std::fs::read(m.join(length_prefix)).unwrap();
    b[..8].copy_from_slice(&0u64.to_le_bytes());
    corrupt_payload(&mut b);
    std::fs::write(m.join(length_prefix), &b).unwrap();

    let mirror_arg = m.as_os_str();
    let (v, stderr) = fx.inspect(&[os("--mirror"), mirror_arg]);
    let refused: BTreeMap<String, &Value> = v["refused_copies"]
        .as_array()
        .expect("refused_copies")
        .iter()
        .map(|c| (c["shard"].as_str().unwrap().to_string(), c))
        .collect();
    assert_eq!(
        refused.keys().map(String::as_str).collect::<Vec<_>>(),
        {
            let mut k = vec![size_differs, header_byte, length_prefix];
            k.sort();
            k
        },
        "{v:#}"
    );
    let expect = [
        (
            size_differs,
            format!(
                "size differs from the primary copy ({} bytes, primary {} bytes)",
                primary_size(size_differs) + 1,
                primary_size(size_differs)
            ),
        ),
        (
            header_byte,
            format!("header differs from the primary copy (first difference at byte {at})"),
        ),
        (
            length_prefix,
            "header differs from the primary copy (first difference at byte 0)".to_string(),
        ),
    ];
    for (name, reason) in &expect {
        let c = refused[*name];
        assert_eq!(c["reason"].as_str(), Some(reason.as_str()), "{c:#}");
        assert_eq!(c["path"].as_str(), Some(m.join(name).to_str().unwrap()), "{c:#}");
        assert_eq!(c["accepted"], false, "{c:#}");
        assert_eq!(c["role"], "mirror", "{c:#}");
        assert_eq!(c["rank"], 1, "{c:#}");
        // A warning names the file and the reason.
        let line = stderr
            .lines()
            .find(|l| l.contains(m.join(name).to_str().unwrap()))
            .unwrap_or_else(|| panic!("no warning naming {name}:\n{stderr}"));
        assert!(
            line.contains(reason.as_str()) && line.contains("file skipped"),
            "{line}"
        );
    }
    // Every shard's copies with their drives: the good one on both drives,
    // the refused ones on the primary's only.
    let (first, second) = (drive_of(&v, &fx.primary), drive_of(&v, fx.shm.path()));
    assert_ne!(first, second, "{v:#}");
    let copies = copies_of(&v);
    let p = |n: &str| fx.primary.join(n).to_str().unwrap().to_string();
    assert_eq!(
        copies[good],
        [
            (p(good), first.clone()),
            (m.join(good).to_str().unwrap().to_string(), second.clone())
        ],
        "{v:#}"
    );
    for (name, _) in &expect {
        assert_eq!(copies[*name], [(p(name), first.clone())], "{v:#}");
    }

    // The primary serves the refused shards: digests unchanged on every
    // route and backend, the mirror drive serves only the good shard.
    let good_bytes: u64 = {
        let model = Model::open(ModelConfig::new(&fx.primary)).unwrap();
        let gi = model.catalog().shards().iter().position(|s| s.name == good).unwrap();
        model
            .catalog()
            .tensors()
            .iter()
            .filter(|t| t.shard == gi)
            .map(|t| t.len)
            .sum()
    };
    for backend in common::engine_backends() {
        for route in ["stripe", "adaptive", "hash"] {
            let st = fx.digest(
                &[os("--mirror"), mirror_arg],
                &["--backend", backend, "--route", route, "--chunk", "4096"],
            );
            let served = stat_drive(&st, &second)["bytes"].as_u64().unwrap();
            assert!(
                served <= good_bytes,
                "{backend} {route}: mirror served {served} > {good_bytes}"
            );
            if route == "stripe" {
                assert!(served > 0, "{backend} {route}: the good copy was not used: {st:#}");
            }
            let failovers: u64 = st["drives"]
                .as_array()
                .unwrap()
                .iter()
                .map(|d| d["failovers"].as_u64().unwrap())
                .sum();
            assert_eq!(failovers, 0, "{st:#}");
        }
    }
}

#[test]
fn a_mirror_with_no_usable_shard_is_ignored_and_a_partial_one_is_silent() {
    let Some(fx) = Fixture::new() else { return };
    let names = fx.names();
    let empty = fx.shm.path().join("empty");
    std::fs::create_dir(&empty).unwrap();
    // Only an unrelated shard, a text file and a copy of another size.
    let useless = fx.shm.path().join("useless");
    std::fs::create_dir(&useless).unwrap();
    std::fs::copy(fx.primary.join(names[0]), useless.join("unrelated.safetensors")).unwrap();
    std::fs::write(useless.join("notes.txt"), "not a shard").unwrap();
    let mut b = std::fs::read(fx.primary.join(names[1])).unwrap();
    b.truncate(b.len() - 1);
    std::fs::write(useless.join(names[1]), &b).unwrap();

    for dir in [&empty, &useless] {
        let (v, stderr) = fx.inspect(&[os("--mirror"), dir.as_os_str()]);
        let line = format!("mirror {}: no usable shard; ignored", dir.display());
        assert!(stderr.contains(&line), "expected {line:?} in:\n{stderr}");
        // No copy, no drive from it.
        for (name, c) in copies_of(&v) {
            assert_eq!(c.len(), 1, "{name}: {v:#}");
        }
        assert_eq!(v["drives"].as_array().unwrap().len(), 1, "{v:#}");
        fx.digest(
            &[os("--mirror"), dir.as_os_str()],
            &["--route", "stripe", "--chunk", "4096"],
        );
    }

    // A partial mirror: the files it lacks are skipped silently.
    let partial = fx.shm.path().join("partial");
    common::copy_files(&fx.primary, &partial, &names[..1]);
    let (v, stderr) = fx.inspect(&[os("--mirror"), partial.as_os_str()]);
    assert_eq!(stderr.trim(), "", "a partial mirror is not worth a warning");
    assert_eq!(copies_of(&v)[names[0]].len(), 2, "{v:#}");
    assert_eq!(v["refused_copies"].as_array().unwrap().len(), 0, "{v:#}");
}

/// FIELD-NOTES "Mirrors": a mirror directory that contributes no file takes
/// no replica slot, so the weights count only the copies that exist.
#[test]
fn an_ignored_mirror_takes_no_weight_slot() {
    let Some(fx) = Fixture::new() else { return };
    let empty = fx.shm.path().join("empty");
    std::fs::create_dir(&empty).unwrap();
    let good = fx.shm.path().join("good");
    common::copy_files(&fx.primary, &good, &fx.names());
    let mirrors = OsString::from(format!("{},{}", empty.display(), good.display()));
    let (v, _) = fx.inspect(&[os("--mirror"), &mirrors, os("--weights"), os("1,3")]);
    assert_eq!(v["weights"], serde_json::json!([1.0, 3.0]), "{v:#}");
}

/// A mirror's file may be a link to the copy (resolved once, then proven
/// like any other); a directory where a shard should be is refused.
#[test]
fn a_linked_mirror_copy_is_proven_through_the_link() {
    let Some(fx) = Fixture::new() else { return };
    let names = fx.names();
    let store = fx.shm.path().join("store");
    common::copy_files(&fx.primary, &store, &names[..1]);
    let m = fx.shm.path().join("mirror");
    std::fs::create_dir(&m).unwrap();
    std::os::unix::fs::symlink(store.join(names[0]), m.join(names[0])).unwrap();
    std::fs::create_dir(m.join(names[1])).unwrap();
    let (v, _) = fx.inspect(&[os("--mirror"), m.as_os_str()]);
    let copies = copies_of(&v);
    assert_eq!(copies[names[0]].len(), 2, "{v:#}");
    assert_eq!(copies[names[0]][1].0, store.join(names[0]).to_str().unwrap(), "{v:#}");
    let refused = v["refused_copies"].as_array().unwrap();
    assert_eq!(refused.len(), 1, "{v:#}");
    assert_eq!(
        refused[0]["path"].as_str(),
        Some(m.join(names[1]).to_str().unwrap()),
        "{v:#}"
    );
    fx.digest(
        &[os("--mirror"), m.as_os_str()],
        &["--route", "stripe", "--chunk", "4096"],
    );
}

/// Contract 5: a copy that cannot be proven is refused with the reason and
/// the primary serves; a dangling link is such a copy, not a fatal error.
#[test]
fn a_dangling_link_in_a_mirror_is_a_refused_copy() {
    let Some(fx) = Fixture::new() else { return };
    let names = fx.names();
    let m = fx.shm.path().join("mirror");
    common::copy_files(&fx.primary, &m, &names[..1]);
    std::os::unix::fs::symlink(fx.shm.path().join("gone"), m.join(names[1])).unwrap();
    let (v, _) = fx.inspect(&[os("--mirror"), m.as_os_str()]);
    let refused = v["refused_copies"].as_array().unwrap();
    assert_eq!(refused.len(), 1, "{v:#}");
    assert_eq!(
        refused[0]["path"].as_str(),
        Some(m.join(names[1]).to_str().unwrap()),
        "{v:#}"
    );
    assert_eq!(copies_of(&v)[names[0]].len(), 2, "{v:#}");
    fx.digest(
        &[os("--mirror"), m.as_os_str()],
        &["--route", "stripe", "--chunk", "4096"],
    );
}

#[test]
fn weights_must_fit_the_copies() {
    let Some(fx) = Fixture::new() else { return };
    let m = fx.shm.path().join("mirror");
    common::copy_files(&fx.primary, &m, &fx.names());
    for (w, why) in [
        ("1,1,1", "3 weight(s) given for 2 copies"),
        ("1", "1 weight(s) given for 2 copies"),
        ("0,1", "\"0\" is not a positive number"),
        ("1,x", "\"x\" is not a positive number"),
    ] {
        let (ok, _, err) = fx.run(&[
            os("inspect"),
            fx.primary.as_os_str(),
            os("--mirror"),
            m.as_os_str(),
            os("--weights"),
            os(w),
        ]);
        assert!(!ok, "--weights {w} accepted");
        assert!(err.contains(why), "--weights {w}: expected {why:?} in:\n{err}");
    }
    let (v, _) = fx.inspect(&[os("--mirror"), m.as_os_str(), os("--weights"), os("3,1")]);
    assert_eq!(v["weights"], serde_json::json!([3.0, 1.0]), "{v:#}");
}

/// (mtime, contents) of every file in `dir`.
fn snapshot(dir: &Path) -> BTreeMap<String, (SystemTime, String)> {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| {
            let e = e.unwrap();
            let meta = e.metadata().unwrap();
            let sum = common::sha256_hex(&std::fs::read(e.path()).unwrap());
            (
                e.file_name().to_string_lossy().into_owned(),
                (meta.modified().unwrap(), sum),
            )
        })
        .collect()
}

/// This process's open descriptors on files under `dir`: (path, flags).
fn fds_under(dir: &Path) -> Vec<(PathBuf, u32)> {
    let mut out = Vec::new();
    for e in std::fs::read_dir("/proc/self/fd").unwrap().flatten() {
        let Ok(target) = std::fs::read_link(e.path()) else {
            continue;
        };
        if !target.starts_with(dir) {
            continue;
        }
        let Ok(info) = std::fs::read_to_string(format!("/proc/self/fdinfo/{}", e.file_name().to_string_lossy())) else {
            continue;
        };
        let flags = info
            .lines()
            .find_map(|l| l.strip_prefix("flags:"))
            .map(|f| u32::from_str_radix(f.trim(), 8).expect("octal flags"))
            .expect("fdinfo has flags");
        out.push((target, flags));
    }
    out
}

#[test]
fn mirror_files_are_opened_read_only_and_never_written() {
    let Some(fx) = Fixture::new() else { return };
    let names = fx.names();
    let m = std::fs::canonicalize(fx.shm.path()).unwrap().join("mirror");
    common::copy_files(&fx.primary, &m, &names);
    // One refused copy: a header byte differs.
    let refused = m.join(names[1]);
    let mut b = std::fs::read(&refused).unwrap();
    b[8] ^= 0x01;
    std::fs::write(&refused, &b).unwrap();
    // Older mtimes, so a write in the same clock tick would still show.
    for n in &names {
        let f = std::fs::File::options().write(true).open(m.join(n)).unwrap();
        f.set_modified(SystemTime::UNIX_EPOCH + std::time::Duration::from_secs(1_000_000_000))
            .unwrap();
    }
    let before = snapshot(&m);

    for (backend, choice) in [("uring", BackendChoice::Uring), ("pread", BackendChoice::Pread)] {
        if !common::engine_backends().contains(&backend) {
            continue;
        }
        let model = Model::open(ModelConfig::new(&fx.primary).mirrors([&m]).route(RoutePolicy::Stripe)).unwrap();
        let engine = Engine::new(&model, EngineConfig::default().backend(choice).chunk(Some(4096))).unwrap();
        let fds = fds_under(&m);
        let accepted = names.len() - 1;
        assert!(fds.len() >= accepted, "{backend}: {fds:?}");
        for (path, flags) in &fds {
            assert_eq!(
                flags & libc::O_ACCMODE as u32,
                libc::O_RDONLY as u32,
                "{backend}: {} open with flags {flags:o}",
                path.display()
            );
            assert_ne!(path, &refused, "{backend}: the refused copy is still open");
        }
        assert!(
            fds.iter().any(|(_, f)| f & libc::O_DIRECT as u32 != 0),
            "{backend}: no O_DIRECT descriptor on the mirror: {fds:?}"
        );
        // Read everything, across both copies.
        let arena = engine.arena(model.slot_spec_for_largest("").unwrap(), 1).unwrap();
        for t in model.catalog().tensors() {
            let loaded = engine.read(t, arena.take().unwrap()).unwrap().wait().unwrap();
            let file = std::fs::read(&model.catalog().shards()[t.shard].path).unwrap();
            assert!(
                loaded[..] == file[t.offset as usize..(t.offset + t.len) as usize],
                "{backend}: {}",
                t.name
            );
            arena.give_back(loaded.into_slot());
        }
        let mirror_drive = model.drives().iter().position(|d| d.dev == common::st_dev(&m)).unwrap();
        assert!(
            engine.stats().drives[mirror_drive].bytes > 0,
            "{backend}: mirror unused"
        );
        drop(arena);
        drop(engine);
        drop(model);
        assert_eq!(fds_under(&m), [], "{backend}: mirror files still open after drop");
        assert_eq!(snapshot(&m), before, "{backend}: a mirror file changed");
    }
    // The binary, on every route: same.
    for route in ["hash", "stripe", "adaptive"] {
        fx.digest(&[os("--mirror"), m.as_os_str()], &["--route", route, "--chunk", "4096"]);
        fx.inspect(&[os("--mirror"), m.as_os_str()]);
    }
    assert_eq!(snapshot(&m), before, "the binary changed a mirror file");
}

#[test]
fn a_basename_in_two_split_dirs_first_listed_wins() {
    let Some(fx) = Fixture::new() else { return };
    let names = fx.names();
    let (dup, only2) = (names[0], names[1]);
    // S1 on the first drive holds `dup`; S2 on the second holds a copy of
    // `dup` with a different payload (a valid container) and `only2`. The
    // primary keeps the rest plus a copy of `names[2]` also put in S1.
    let s1 = fx.tmp.path().join("split1");
    let s2 = fx.shm.path().join("split2");
    common::move_files(&fx.primary, &s1, &[dup]);
    common::copy_files(&fx.primary, &s1, &[names[2]]);
    common::move_files(&fx.primary, &s2, &[only2]);
    let mut b = std::fs::read(s1.join(dup)).unwrap();
    corrupt_payload(&mut b);
    std::fs::write(s2.join(dup), &b).unwrap();

    let dirs = OsString::from(format!("{};{}", s1.display(), s2.display()));
    let args = [os("--dirs"), dirs.as_os_str()];
    let (v, stderr) = fx.inspect(&args);
    let copies = copies_of(&v);
    assert_eq!(copies[dup].len(), 1, "{v:#}");
    assert_eq!(copies[dup][0].0, s1.join(dup).to_str().unwrap(), "{v:#}");
    assert_eq!(copies[only2][0].0, s2.join(only2).to_str().unwrap(), "{v:#}");
    assert_eq!(
        copies[names[2]][0].0,
        fx.primary.join(names[2]).to_str().unwrap(),
        "{v:#}"
    );
    // Both duplicates reported, naming the skipped file and the winner.
    for (skipped, winner) in [(s2.join(dup), &s1), (s1.join(names[2]), &fx.primary)] {
        let line = stderr
            .lines()
            .find(|l| l.contains(skipped.to_str().unwrap()))
            .unwrap_or_else(|| panic!("{} not reported:\n{stderr}", skipped.display()));
        assert!(
            line.contains("skipped") && line.contains(winner.to_str().unwrap()) && line.contains("first"),
            "{line}"
        );
    }
    // The search path is logged at -v: new shards per directory, then the total.
    let (ok, _, info) = fx.run(&[os("-v"), os("inspect"), fx.primary.as_os_str(), args[0], args[1]]);
    assert!(ok, "{info}");
    for l in [
        format!("+{} -> 1 shard(s)", s1.display()),
        format!("+{} -> 1 shard(s)", s2.display()),
        format!(
            "model across 3 dir(s): {} shard(s) total (primary {} -> {} shard(s)), no duplication",
            names.len(),
            fx.primary.display(),
            names.len() - 2
        ),
    ] {
        assert!(info.contains(&l), "expected {l:?} in:\n{info}");
    }
    for backend in common::engine_backends() {
        fx.digest(&args, &["--backend", backend, "--chunk", "4096"]);
    }
    fx.digest(&args, &["--backend", "sync"]);

    // Listed the other way round, S2's copy wins: its payload shows.
    let rev = OsString::from(format!("{},{}", s2.display(), s1.display()));
    let (v, _) = fx.inspect(&[os("--dirs"), &rev]);
    assert_eq!(copies_of(&v)[dup][0].0, s2.join(dup).to_str().unwrap(), "{v:#}");
    let (ok, out, err) = fx.run(&[os("digest"), fx.primary.as_os_str(), os("--dirs"), &rev]);
    assert!(ok, "{err}");
    let got = common::parse_sums(&out);
    let differ: Vec<&String> = got.keys().filter(|k| got[*k] != fx.sync[*k]).collect();
    assert_eq!(
        differ.len(),
        1,
        "the corrupted copy should change exactly one tensor: {differ:?}"
    );
}

#[test]
fn bad_directory_entries_are_refused_naming_the_entry_as_typed() {
    let Some(fx) = Fixture::new() else { return };
    let shm = fx.shm.path();
    let ok_dir = shm.join("ok");
    std::fs::create_dir(&ok_dir).unwrap();
    let target = shm.join("target");
    std::fs::create_dir(&target).unwrap();
    let link = shm.join("link");
    std::os::unix::fs::symlink(&target, &link).unwrap();
    let inside = fx.primary.join("sub");
    std::fs::create_dir(&inside).unwrap();
    let file = shm.join("a-file");
    std::fs::write(&file, "x").unwrap();
    let p = fx.primary.display().to_string();
    let s = |p: &Path| p.display().to_string();

    // (entries as typed, the refused entry as shown, the reason)
    let cases: Vec<(Vec<String>, String, &str)> = vec![
        (
            vec![s(&shm.join("missing"))],
            s(&shm.join("missing")),
            "does not exist: reconnect the drive, or remove this entry",
        ),
        (vec![s(&link)], s(&link), "is a symbolic link"),
        (
            vec![format!("{}/a\nb", s(shm))],
            format!("{}/a\\nb", s(shm)),
            "contains control characters",
        ),
        (
            vec![format!("{}/tab\there", s(shm))],
            format!("{}/tab\\there", s(shm)),
            "contains control characters",
        ),
        (vec![s(&file)], s(&file), "is not a directory"),
        (vec![p.clone()], p.clone(), "is the primary directory"),
        (vec![format!("{p}/.")], format!("{p}/."), "is the primary directory"),
        (
            vec![format!("{p}/sub/..")],
            format!("{p}/sub/.."),
            "is the primary directory",
        ),
        (vec![s(&inside)], s(&inside), "overlaps the primary directory"),
        (
            vec![s(fx.tmp.path())],
            s(fx.tmp.path()),
            "overlaps the primary directory",
        ),
        (vec![s(&ok_dir), s(&ok_dir)], s(&ok_dir), "is listed twice"),
        (
            vec![s(&ok_dir), format!("{}/", s(&ok_dir))],
            format!("{}/", s(&ok_dir)),
            "is listed twice",
        ),
    ];
    for flag in ["--dirs", "--mirror"] {
        let role = if flag == "--dirs" { "split" } else { "mirror" };
        for (entries, shown, why) in &cases {
            let list = OsString::from(entries.join(","));
            for cmd in ["inspect", "digest"] {
                let out = common::run(&[os(cmd), fx.primary.as_os_str(), os(flag), &list]);
                let stderr = String::from_utf8_lossy(&out.stderr);
                assert_eq!(
                    out.status.code(),
                    Some(1),
                    "{cmd} {flag} {entries:?} accepted:\n{stderr}"
                );
                assert!(!stderr.contains("panicked"), "{stderr}");
                let want = format!("{role} directory \"{shown}\": {why}");
                assert!(
                    stderr.contains(&want),
                    "{cmd} {flag} {entries:?}: expected {want:?} in:\n{stderr}"
                );
                assert!(out.stdout.is_empty(), "{cmd} {flag} {entries:?} printed output");
            }
        }
    }
    // Across roles: a mirror that is a split directory, or inside one.
    let out = common::run(&[
        os("inspect"),
        fx.primary.as_os_str(),
        os("--dirs"),
        ok_dir.as_os_str(),
        os("--mirror"),
        ok_dir.as_os_str(),
    ]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    let want = format!(
        "mirror directory \"{0}\": is listed twice (as \"{0}\")",
        ok_dir.display()
    );
    assert!(!out.status.success() && stderr.contains(&want), "{stderr}");
    let nested = ok_dir.join("nested");
    std::fs::create_dir(&nested).unwrap();
    let out = common::run(&[
        os("inspect"),
        fx.primary.as_os_str(),
        os("--dirs"),
        ok_dir.as_os_str(),
        os("--mirror"),
        nested.as_os_str(),
    ]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    let want = format!(
        "mirror directory \"{}\": overlaps the split directory \"{}\"",
        nested.display(),
        ok_dir.display()
    );
    assert!(!out.status.success() && stderr.contains(&want), "{stderr}");
    // A relative entry is taken against the working directory; one that
    // names nothing there is refused naming both paths, as a
    // configuration error.
    let e = Model::open(ModelConfig::new(&fx.primary).mirrors(["relative/dir"])).unwrap_err();
    assert!(matches!(e, weightstream::Error::Config(_)), "{e:?}");
    let cwd = std::env::current_dir().unwrap();
    assert_eq!(
        e.to_string(),
        format!(
            "mirror directory \"relative/dir\" ({}): does not exist: reconnect the drive, or remove this entry",
            cwd.join("relative/dir").display()
        )
    );
}

#[test]
fn relative_split_and_mirror_directories_are_taken_against_the_working_directory() {
    let Some(fx) = Fixture::new() else { return };
    // The shards split: the largest moves to a split directory; a mirror
    // of every shard on the second drive. Both given relative to the
    // working directory the command runs in, the model too.
    let split = fx.tmp.path().join("split");
    std::fs::create_dir(&split).unwrap();
    std::fs::rename(fx.primary.join(&fx.shards[0]), split.join(&fx.shards[0])).unwrap();
    let mirror = fx.shm.path().join("mirror");
    let split_names: Vec<&str> = fx.shards.iter().map(String::as_str).collect();
    common::copy_files(&fx.primary, &mirror, &split_names[1..]);
    common::copy_files(&split, &mirror, &split_names[..1]);
    // From the temporary folder: "primary", "split", and the mirror by a
    // path with "..".
    let rel_mirror = relative_to(fx.tmp.path(), &mirror);
    let out = common::hermetic(std::process::Command::new(common::bin()))
        .current_dir(fx.tmp.path())
        .args([os("digest"), os("primary"), os("--dirs"), os("split"), os("--mirror")])
        .arg(&rel_mirror)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert_eq!(
        common::parse_sums(&String::from_utf8(out.stdout).unwrap()),
        fx.sync,
        "{stderr}"
    );
    // The library too (the test's own working directory: absolute
    // primary, split and mirror given relative to it).
    let cwd = std::env::current_dir().unwrap();
    let rel = |p: &Path| relative_to(&cwd, p);
    let model = Model::open(
        ModelConfig::new(&fx.primary)
            .dirs([rel(&split)])
            .mirrors([rel(&mirror)]),
    )
    .unwrap();
    for shard in 0..fx.shards.len() {
        assert_eq!(model.copies(shard).len(), 2, "shard {shard}: {:?}", model.copy_report());
    }
}

/// `p` (absolute) as a path relative to the folder `from` (absolute): up
/// to the root with "..", then down.
fn relative_to(from: &Path, p: &Path) -> PathBuf {
    let up: PathBuf = (1..from.components().count()).map(|_| "..").collect();
    up.join(p.strip_prefix("/").unwrap())
}

#[test]
fn a_mirror_on_the_primary_filesystem_is_accepted_with_a_warning() {
    let Some(fx) = Fixture::new() else { return };
    let m = fx.tmp.path().join("same-fs-mirror");
    common::copy_files(&fx.primary, &m, &fx.names());
    let (v, stderr) = fx.inspect(&[os("--mirror"), m.as_os_str()]);
    let line = stderr
        .lines()
        .find(|l| l.contains(&format!("mirror \"{}\"", m.display())))
        .unwrap_or_else(|| panic!("no warning about the same-filesystem mirror:\n{stderr}"));
    assert!(
        line.contains("same filesystem")
            && line.contains("other copies of its shards")
            && line.contains("adds no bandwidth"),
        "{line}"
    );
    let drives = v["drives"].as_array().unwrap();
    assert_eq!(drives.len(), 1, "{v:#}");
    for (name, c) in copies_of(&v) {
        assert_eq!(c.len(), 2, "{name}: {v:#}");
        assert_eq!(c[0].1, c[1].1, "{name}: copies on one filesystem are one drive");
    }
    let st = fx.digest(
        &[os("--mirror"), m.as_os_str()],
        &["--route", "stripe", "--chunk", "4096"],
    );
    assert_eq!(st["drives"].as_array().unwrap().len(), 1, "{st:#}");
}
