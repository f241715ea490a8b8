//! A crafted or hand-edited layout index (or marker) never makes `place`
//! delete, chmod or read outside the folders it can prove it made for this
//! model, and readers never follow one elsewhere (issue 17).
//!
//! The proof is a folder's marker bound to it: it names the model's
//! source, the root, the folder's name and the folder's inode, and is read
//! from a descriptor reached without following a link. The attacks: an
//! index whose roots and folder name any directory (a system-file
//! stand-in, `etc/passwd`, among them); the right folder name in someone
//! else's directory (no marker, a copied marker, empty); a marker whose
//! `primary` points elsewhere; a root swapped for a path through a
//! symbolic link; an index with no file. Last, a property: for any index
//! written into the primary folder, a re-run changes nothing outside this
//! model's proven folders.

mod common;
mod place_support;

use std::collections::BTreeMap;
use std::ffi::OsString;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};

use place_support::{layered_spec, Bed};
use serde_json::{json, Value};
use weightstream::__internal::place::{folder_name, INDEX_FILE, MARKER_FILE};
use weightstream::place::{self, LayoutKind, PlaceReport};
use weightstream::{Model, ModelConfig};

/// A model placed as a mirror on two roots (r0 on /dev/shm, r1 on the
/// disk), and what the tests need to know of it.
struct Placed {
    bed: Bed,
    roots: Vec<PathBuf>,
    fname: OsString,
    report: PlaceReport,
}

impl Placed {
    fn new(layout: LayoutKind) -> Option<Self> {
        let bed = Bed::new()?;
        common::synth_model(&bed.source, &layered_spec(1));
        let roots = bed.roots();
        Self::on(bed, roots, layout)
    }

    fn on(bed: Bed, roots: Vec<PathBuf>, layout: LayoutKind) -> Option<Self> {
        let report = place::place(&bed.config(&roots, layout)).expect("first placement");
        let fname = folder_name(&std::fs::canonicalize(&bed.source).unwrap());
        Some(Placed {
            bed,
            roots,
            fname,
            report,
        })
    }

    fn folder(&self, k: usize) -> PathBuf {
        self.report.roots[k].folder.clone()
    }

    fn index_path(&self) -> PathBuf {
        self.report.primary.join(INDEX_FILE)
    }

    fn index(&self) -> Value {
        serde_json::from_slice(&std::fs::read(self.index_path()).unwrap()).unwrap()
    }

    fn write_index(&self, v: &Value) {
        std::fs::write(self.index_path(), serde_json::to_vec_pretty(v).unwrap()).unwrap();
    }

    /// A directory on /dev/shm (mode 0755) holding a folder of this
    /// model's name (mode 0700, as weightstream makes its own) with `files`.
    fn lookalike(&self, name: &str, files: &[(&str, &[u8])]) -> (PathBuf, PathBuf) {
        let root = self.bed.shm.path().join(name);
        std::fs::create_dir_all(&root).unwrap();
        std::fs::set_permissions(&root, std::fs::Permissions::from_mode(0o755)).unwrap();
        let folder = root.join(&self.fname);
        std::fs::create_dir(&folder).unwrap();
        std::fs::set_permissions(&folder, std::fs::Permissions::from_mode(0o700)).unwrap();
        for (n, b) in files {
            std::fs::write(folder.join(n), b).unwrap();
        }
        (std::fs::canonicalize(&root).unwrap(), folder)
    }

    /// Places again on `roots`.
    fn rerun(&self, roots: &[PathBuf]) -> weightstream::Result<PlaceReport> {
        place::place(&self.bed.config(roots, LayoutKind::Mirror))
    }

    /// Everything under the test's two temporary trees, except inside
    /// `ours`.
    fn snapshot(&self, ours: &[PathBuf]) -> BTreeMap<PathBuf, String> {
        let mut m = BTreeMap::new();
        for top in [self.bed.tmp.path(), self.bed.shm.path()] {
            walk(top, ours, &mut m);
        }
        m
    }
}

/// Every entry under `dir` (not following links): kind, mode, owner, size
/// and content hash (or link target), except inside the folders `skip`.
fn walk(dir: &Path, skip: &[PathBuf], out: &mut BTreeMap<PathBuf, String>) {
    let Ok(rd) = std::fs::read_dir(dir) else { return };
    for ent in rd.flatten() {
        let p = ent.path();
        if skip.iter().any(|s| p.starts_with(s)) {
            continue;
        }
        let Ok(m) = std::fs::symlink_metadata(&p) else { continue };
        let what = if m.file_type().is_symlink() {
            format!("link -> {:?}", std::fs::read_link(&p).unwrap())
        } else if m.is_dir() {
            walk(&p, skip, out);
            "dir".to_string()
        } else {
            format!("file {} {}", m.len(), place_support::file_sha(&p))
        };
        out.insert(p, format!("{what} mode {:o} uid {}", m.mode() & 0o7777, m.uid()));
    }
}

/// A tiny safetensors file (one u8 tensor), and the sha256 of its header
/// bytes (length prefix included), as an index records it.
fn tiny_safetensors(fill: u8) -> (Vec<u8>, String) {
    let header = br#"{"t":{"dtype":"U8","shape":[16],"data_offsets":[0,16]}}"#;
    let mut v = (header.len() as u64).to_le_bytes().to_vec();
    v.extend_from_slice(header);
    let sha = common::sha256_hex(&v);
    v.extend_from_slice(&[fill; 16]);
    (v, sha)
}

fn root_entry(root: &Path, fname: &OsString) -> Value {
    json!({"path": root.to_str().unwrap(), "folder": root.join(fname).to_str().unwrap()})
}

fn file_entry(name: &str, root: usize, bytes: &[u8], header_sha: &str) -> Value {
    json!({"name": name, "root": root, "size": bytes.len(), "header_sha256": header_sha, "kind": "shard"})
}

fn extra_entry(name: &str, bytes: &[u8]) -> Value {
    json!({"name": name, "size": bytes.len(), "sha256": common::sha256_hex(bytes)})
}

fn joined(r: &PlaceReport) -> String {
    r.warnings.join("\n")
}

#[test]
fn an_index_naming_any_folder_is_refused_and_a_system_file_stand_in_is_not_touched() {
    let Some(p) = Placed::new(LayoutKind::Mirror) else {
        return;
    };
    // A stand-in for `/` with `etc/passwd` (never the real one).
    let fake_root = p.bed.tmp.path().join("fake-root");
    let etc = fake_root.join("etc");
    std::fs::create_dir_all(&etc).unwrap();
    std::fs::set_permissions(&etc, std::fs::Permissions::from_mode(0o755)).unwrap();
    std::fs::write(etc.join("passwd"), b"root:x:0:0:root:/root:/bin/bash\n").unwrap();
    std::fs::write(etc.join("hosts.safetensors"), tiny_safetensors(1).0).unwrap();
    let (hosts, hosts_sha) = tiny_safetensors(1);
    let before = p.snapshot(&[]);
    let mut idx = p.index();
    idx["folder"] = json!("etc");
    idx["roots"] = json!([
        {"path": p.report.roots[0].root.to_str().unwrap(), "folder": p.report.roots[0].root.join("etc").to_str().unwrap()},
        {"path": fake_root.to_str().unwrap(), "folder": etc.to_str().unwrap()},
    ]);
    idx["files"] = json!([file_entry("hosts.safetensors", 1, &hosts, &hosts_sha)]);
    idx["extras"] = json!([extra_entry("passwd", b"root:x:0:0:root:/root:/bin/bash\n")]);
    let before = {
        let mut b = before;
        // The edited index itself is the one change the test makes.
        let i = p.index_path();
        p.write_index(&idx);
        b.insert(i.clone(), walk_one(&i));
        b
    };
    let e = p.rerun(&p.roots[..1]).unwrap_err().to_string();
    assert!(
        e.contains(INDEX_FILE) && e.contains("refused layout index") && e.contains("the one weightstream derives"),
        "{e}"
    );
    assert_eq!(p.snapshot(&[]), before, "a refused index changes nothing anywhere");
    assert_eq!(std::fs::metadata(&etc).unwrap().mode() & 0o7777, 0o755, "no chmod");
    let e = Model::open(ModelConfig::new(&p.report.primary))
        .unwrap_err()
        .to_string();
    assert!(e.contains("refused layout index"), "{e}");
}

fn walk_one(p: &Path) -> String {
    let m = std::fs::symlink_metadata(p).unwrap();
    format!(
        "file {} {} mode {:o} uid {}",
        m.len(),
        place_support::file_sha(p),
        m.mode() & 0o7777,
        m.uid()
    )
}

#[test]
fn roots_of_an_edited_index_that_carry_no_proof_are_reported_and_left_alone() {
    let Some(p) = Placed::new(LayoutKind::Mirror) else {
        return;
    };
    let (st, st_sha) = tiny_safetensors(7);
    let notes = b"my notes\n".as_slice();
    // The model's folder name, in directories weightstream never made:
    // no marker; a copy of a real marker (another inode); empty.
    let (no_marker, no_marker_f) = p.lookalike("elsewhere", &[("notes.txt", notes), ("x.safetensors", &st)]);
    let marker = std::fs::read(p.folder(1).join(MARKER_FILE)).unwrap();
    let (copied, copied_f) = p.lookalike(
        "copied",
        &[(MARKER_FILE, &marker), ("notes.txt", notes), ("x.safetensors", &st)],
    );
    let (empty, empty_f) = p.lookalike("empty", &[]);
    // A user's file planted in the primary folder, named as an extra with
    // a hash that is not its own.
    std::fs::write(p.folder(0).join("mine.txt"), b"mine").unwrap();
    let mut idx = p.index();
    let mut roots = idx["roots"].as_array().unwrap().clone();
    for r in [&no_marker, &copied, &empty] {
        roots.push(root_entry(r, &p.fname));
    }
    idx["roots"] = Value::Array(roots);
    let files = idx["files"].as_array_mut().unwrap();
    for k in [2, 3] {
        files.push(file_entry("x.safetensors", k, &st, &st_sha));
    }
    files.push(file_entry("gone.safetensors", 4, &st, &st_sha));
    let extras = idx["extras"].as_array_mut().unwrap();
    extras.push(json!({"name": "mine.txt", "size": 4, "sha256": "0".repeat(64)}));
    extras.push(extra_entry("notes.txt", notes));
    p.write_index(&idx);
    let ours = [p.folder(0), p.folder(1)];
    let before = p.snapshot(&ours);

    // Root 1 is dropped: its stale copies (a proven folder) go, as before.
    let r = p.rerun(&p.roots[..1]).expect("the re-run succeeds");
    let w = joined(&r);
    assert_eq!(
        p.snapshot(&ours),
        before,
        "nothing outside this model's folders changed:\n{w}"
    );
    for d in &r.deleted {
        assert!(
            d.path.starts_with(p.folder(1)),
            "deleted {:?} outside root 1's folder",
            d.path
        );
    }
    assert!(
        !r.deleted.is_empty(),
        "the stale copies of the proven root 1 are deleted"
    );
    assert!(
        !p.folder(1).exists(),
        "root 1's folder, left with its marker alone, is removed"
    );
    assert!(
        p.folder(0).join("mine.txt").exists(),
        "an extra whose hash is not its own is kept"
    );
    for (f, why) in [
        (&no_marker_f, "holds no weightstream-marker.json"),
        (&copied_f, "its marker names another folder"),
        (&empty_f, "holds no weightstream-marker.json"),
    ] {
        let shown = format!("\"{}\"", f.display());
        assert!(
            w.contains(&shown) && w.contains(why),
            "no warning naming {shown} ({why}):\n{w}"
        );
        assert_eq!(std::fs::metadata(f).unwrap().mode() & 0o7777, 0o700);
    }
    assert!(
        w.contains("mine.txt") && w.contains("not the file weightstream wrote"),
        "{w}"
    );
    assert!(no_marker_f.join("notes.txt").exists() && copied_f.join("x.safetensors").exists());
    assert!(empty_f.is_dir(), "an empty folder is not \"the marker alone\"");
    // The model still opens from its new index.
    Model::open(ModelConfig::new(&r.primary)).expect("opens");
}

#[test]
fn a_marker_whose_primary_points_elsewhere_is_not_followed() {
    let Some(p) = Placed::new(LayoutKind::Mirror) else {
        return;
    };
    let (st, st_sha) = tiny_safetensors(3);
    let notes = b"keep me\n".as_slice();
    // A folder of this model's name elsewhere, holding an index that names
    // its own files (and no marker of its own).
    let (victim, victim_f) = p.lookalike("victim", &[("notes.txt", notes), ("x.safetensors", &st)]);
    let mut idx = p.index();
    idx["roots"] = json!([root_entry(&victim, &p.fname)]);
    idx["files"] = json!([file_entry("x.safetensors", 0, &st, &st_sha)]);
    idx["extras"] = json!([extra_entry("notes.txt", notes)]);
    std::fs::write(victim_f.join(INDEX_FILE), serde_json::to_vec(&idx).unwrap()).unwrap();
    // A stand-in for a system directory, named as the primary by another
    // marker.
    let etc = p.bed.shm.path().join("etc");
    std::fs::create_dir(&etc).unwrap();
    std::fs::write(etc.join("passwd"), b"x").unwrap();
    for (k, primary) in [(1, &victim_f), (0, &etc)] {
        let mpath = p.folder(k).join(MARKER_FILE);
        let mut m: Value = serde_json::from_slice(&std::fs::read(&mpath).unwrap()).unwrap();
        m["primary"] = json!(primary.to_str().unwrap());
        std::fs::write(&mpath, serde_json::to_vec(&m).unwrap()).unwrap();
    }
    let ours = [p.folder(0), p.folder(1)];
    let before = p.snapshot(&ours);
    let r = p.rerun(&p.roots).expect("the re-run succeeds");
    let w = joined(&r);
    assert_eq!(
        p.snapshot(&ours),
        before,
        "nothing outside this model's folders changed:\n{w}"
    );
    assert!(r.deleted.is_empty(), "{:?}", r.deleted);
    assert!(
        w.contains(&format!("\"{}\"", victim_f.display())) && w.contains("holds no weightstream-marker.json"),
        "{w}"
    );
    assert!(
        w.contains(&format!("\"{}\"", etc.display())) && w.contains("not a folder of this model"),
        "{w}"
    );
    // The markers are rewritten with the true primary: the model opens.
    Model::open(ModelConfig::new(&r.primary)).expect("opens");
}

#[test]
fn a_root_reached_through_a_swapped_in_link_is_neither_followed_nor_cleaned() {
    let Some(bed) = Bed::new() else { return };
    common::synth_model(&bed.source, &layered_spec(1));
    let outer = bed.tmp.path().join("outer");
    let r1 = outer.join("r1");
    std::fs::create_dir_all(&r1).unwrap();
    let roots = vec![bed.shm_root("r0"), r1.clone()];
    let Some(p) = Placed::on(bed, roots, LayoutKind::Mirror) else {
        return;
    };
    let folder1 = p.folder(1);
    // The directory on the way to root 1 is moved and a link put in its
    // place: the path the index names now goes through a link.
    let moved = p.bed.tmp.path().join("outer-moved");
    std::fs::rename(&outer, &moved).unwrap();
    std::os::unix::fs::symlink(&moved, &outer).unwrap();
    // Readers refuse it (the index names root 1 through the link now).
    let e = Model::open(ModelConfig::new(&p.report.primary))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("is a symbolic link: refused") && e.contains("not followed"),
        "{e}"
    );
    // And a re-run without root 1 neither follows nor cleans it.
    let ours = [p.folder(0)];
    let before = p.snapshot(&ours);
    let r = p.rerun(&p.roots[..1]).expect("the re-run succeeds");
    let w = joined(&r);
    assert_eq!(
        p.snapshot(&ours),
        before,
        "nothing outside the primary folder changed:\n{w}"
    );
    assert!(r.deleted.is_empty(), "{:?}", r.deleted);
    assert!(w.contains("is a symbolic link: refused"), "{w}");
    assert!(moved.join("r1").join(&p.fname).is_dir());
    let _ = folder1;
}

#[test]
fn readers_follow_an_index_only_into_proven_folders() {
    let Some(p) = Placed::new(LayoutKind::Split) else {
        return;
    };
    Model::open(ModelConfig::new(&p.report.primary)).expect("the placement opens");
    // Root 1's folder replaced by a copy of itself (cp: another inode,
    // the marker along): the marker is bound to the folder it was written
    // in.
    let f1 = p.folder(1);
    let tmp_copy = f1.with_extension("copy");
    let cp = |from: &Path, to: &Path| {
        let st = std::process::Command::new("cp")
            .arg("-a")
            .arg(from)
            .arg(to)
            .status()
            .unwrap();
        assert!(st.success());
    };
    cp(&f1, &tmp_copy);
    let saved = f1.with_extension("orig");
    std::fs::rename(&f1, &saved).unwrap();
    std::fs::rename(&tmp_copy, &f1).unwrap();
    let e = Model::open(ModelConfig::new(&p.report.primary))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains(&f1.display().to_string()) && e.contains("written for another directory (inode"),
        "{e}"
    );
    std::fs::remove_dir_all(&f1).unwrap();
    std::fs::rename(&saved, &f1).unwrap();
    Model::open(ModelConfig::new(&p.report.primary)).expect("the original folder opens again");
    // Root 1's folder copied elsewhere and the index pointed at the copy.
    let copy_root = p.bed.shm.path().join("copy");
    std::fs::create_dir(&copy_root).unwrap();
    cp(&p.folder(1), &copy_root);
    let copy_root = std::fs::canonicalize(&copy_root).unwrap();
    let good = p.index();
    let mut idx = good.clone();
    idx["roots"][1] = root_entry(&copy_root, &p.fname);
    p.write_index(&idx);
    let e = Model::open(ModelConfig::new(&p.report.primary))
        .unwrap_err()
        .to_string();
    let shown = copy_root.join(&p.fname).display().to_string();
    assert!(
        e.contains(&shown) && e.contains("its marker names another folder") && e.contains("not followed"),
        "{e}"
    );
    let (v, _) = {
        let out = common::run(&["verify".as_ref(), p.report.primary.as_os_str(), "--json".as_ref()]);
        assert_eq!(out.status.code(), Some(1), "{}", String::from_utf8_lossy(&out.stderr));
        (
            serde_json::from_slice::<Value>(&out.stdout).unwrap(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let problems = v.to_string();
    assert!(
        problems.contains("not read") && problems.contains("names another folder"),
        "{problems}"
    );
    // The copy without its marker.
    std::fs::remove_file(copy_root.join(&p.fname).join(MARKER_FILE)).unwrap();
    let e = Model::open(ModelConfig::new(&p.report.primary))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains(&shown) && e.contains("holds no weightstream-marker.json"),
        "{e}"
    );
    // The true index again, but root 1's marker edited to say it is
    // another position: refused as well.
    p.write_index(&good);
    Model::open(ModelConfig::new(&p.report.primary)).expect("the true index opens again");
    let mpath = p.folder(1).join(MARKER_FILE);
    let mut m: Value = serde_json::from_slice(&std::fs::read(&mpath).unwrap()).unwrap();
    m["position"] = json!(0);
    std::fs::write(&mpath, serde_json::to_vec(&m).unwrap()).unwrap();
    let e = Model::open(ModelConfig::new(&p.report.primary))
        .unwrap_err()
        .to_string();
    assert!(e.contains("its marker says it is root 0 of 2"), "{e}");
}

#[test]
fn readers_refuse_a_folder_owned_by_another_user_whatever_its_marker_says() {
    // Another user who can write in a root (it owns it) moves this model's
    // folder aside and makes a look-alike of their own: the same name, the
    // files with one payload byte changed (size and header kept), and a
    // marker rebound to the new folder's inode. The marker is only JSON its
    // owner writes: `place` refuses such a folder (owned by another
    // user), and readers must as well.
    if rustix::process::geteuid().as_raw() != 0 {
        eprintln!("SKIP: needs root (to make a folder owned by another user)");
        return;
    }
    let Some(p) = Placed::new(LayoutKind::Split) else {
        return;
    };
    Model::open(ModelConfig::new(&p.report.primary)).expect("the placement opens");
    let f1 = p.folder(1);
    let aside = f1.with_extension("aside");
    std::fs::rename(&f1, &aside).unwrap();
    std::fs::create_dir(&f1).unwrap();
    std::fs::set_permissions(&f1, std::fs::Permissions::from_mode(0o755)).unwrap();
    let ino = std::fs::metadata(&f1).unwrap().ino();
    let mut flipped = false;
    for ent in std::fs::read_dir(&aside).unwrap().flatten() {
        let name = ent.file_name();
        let mut bytes = std::fs::read(ent.path()).unwrap();
        if name == MARKER_FILE {
            let mut m: Value = serde_json::from_slice(&bytes).unwrap();
            m["folder_ino"] = json!(ino);
            bytes = serde_json::to_vec(&m).unwrap();
        } else if !flipped && name.to_string_lossy().ends_with(".safetensors") {
            let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
            bytes[8 + n] ^= 0xff;
            flipped = true;
        }
        std::fs::write(f1.join(&name), &bytes).unwrap();
    }
    assert!(flipped, "root 1 holds a shard");
    let other = 65534;
    for ent in std::fs::read_dir(&f1).unwrap().flatten() {
        std::os::unix::fs::lchown(ent.path(), Some(other), Some(other)).unwrap();
    }
    std::os::unix::fs::lchown(&f1, Some(other), Some(other)).unwrap();
    let e = Model::open(ModelConfig::new(&p.report.primary))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains(&f1.display().to_string()) && e.contains("owned by uid 65534") && e.contains("not followed"),
        "{e}"
    );
    let out = common::run(&["verify".as_ref(), p.report.primary.as_os_str(), "--json".as_ref()]);
    assert_eq!(out.status.code(), Some(1), "{}", String::from_utf8_lossy(&out.stderr));
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    let problems = v.to_string();
    assert!(
        problems.contains("owned by uid 65534") && problems.contains("not read"),
        "{problems}"
    );
    // Its own folder back: it opens again.
    std::fs::remove_dir_all(&f1).unwrap();
    std::fs::rename(&aside, &f1).unwrap();
    Model::open(ModelConfig::new(&p.report.primary)).expect("the original folder opens again");
}

#[test]
fn verify_hashes_an_extra_the_index_names_without_reading_it_whole() {
    // A hand-edited index names a large file of the primary folder as an
    // extra (its size recorded): `verify` hashes it in bounded memory
    // (here under a 64 MiB address space, a 96 MiB file), never reads it
    // whole (it used to: "cannot be read (out of memory)", or gigabytes of
    // memory for a large file).
    use std::os::unix::process::CommandExt;
    let Some(p) = Placed::new(LayoutKind::Split) else {
        return;
    };
    let big = p.report.primary.join("big.bin");
    let size: u64 = 96 << 20;
    std::fs::File::create(&big).unwrap().set_len(size).unwrap();
    let mut idx = p.index();
    idx["extras"]
        .as_array_mut()
        .unwrap()
        .push(json!({"name": "big.bin", "size": size, "sha256": "0".repeat(64)}));
    p.write_index(&idx);
    let mut c = common::hermetic(std::process::Command::new(common::bin()));
    c.args(["verify".as_ref(), p.report.primary.as_os_str()]);
    // SAFETY: between fork and exec the closure only calls setrlimit,
    // which is async-signal-safe; it allocates nothing and takes no lock.
    unsafe {
        c.pre_exec(|| {
            let lim = libc::rlimit {
                rlim_cur: 64 << 20,
                rlim_max: 64 << 20,
            };
            if libc::setrlimit(libc::RLIMIT_AS, &lim) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let out = c.output().unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(out.status.code(), Some(1), "{text}");
    assert!(
        text.contains("big.bin") && text.contains("content differs (sha256)") && !text.contains("out of memory"),
        "{text}"
    );
}

#[test]
fn an_index_that_names_no_file_is_refused_naming_the_index() {
    let Some(p) = Placed::new(LayoutKind::Mirror) else {
        return;
    };
    let mut idx = p.index();
    idx["files"] = json!([]);
    p.write_index(&idx);
    let e = Model::open(ModelConfig::new(&p.report.primary))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains(&p.index_path().display().to_string()) && e.contains("names no safetensors file"),
        "{e}"
    );
    assert!(!e.contains("no *.safetensors shards"), "{e}");
}

/// The directories a generated index may name as roots.
#[derive(Debug, Clone, Copy)]
enum RootPick {
    /// This run's primary root (r0).
    Primary,
    /// The model's second root (r1), proven.
    Second,
    /// The model's folder name in another directory: no marker.
    NoMarker,
    /// The same with a copy of a real marker.
    CopiedMarker,
    /// The same, empty.
    Empty,
    /// A stand-in for `/` with `etc/passwd`.
    FakeRoot,
    /// A directory that does not exist.
    Missing,
    /// The no-marker directory reached through a symbolic link.
    ThroughLink,
}

#[derive(Debug, Clone)]
struct IndexSpec {
    roots: Vec<RootPick>,
    folder: usize,
    files: Vec<(usize, usize, bool)>,
    extras: Vec<(usize, bool)>,
    keep_second: bool,
    split: bool,
}

const FILE_NAMES: [&str; 4] = [
    "x.safetensors",
    "model-00001-of-00003.safetensors",
    "hosts.safetensors",
    "gone.safetensors",
];
const EXTRA_NAMES: [&str; 4] = ["notes.txt", "passwd", "config.json", "mine.txt"];

fn index_spec() -> impl proptest::strategy::Strategy<Value = IndexSpec> {
    use proptest::prelude::*;
    let pick = prop_oneof![
        Just(RootPick::Primary),
        Just(RootPick::Second),
        Just(RootPick::NoMarker),
        Just(RootPick::CopiedMarker),
        Just(RootPick::Empty),
        Just(RootPick::FakeRoot),
        Just(RootPick::Missing),
        Just(RootPick::ThroughLink),
    ];
    let first = prop_oneof![4 => Just(RootPick::Primary), 1 => pick.clone()];
    (
        first,
        proptest::collection::vec(pick, 0..5),
        prop_oneof![4 => Just(0usize), 1 => 1..3usize],
        proptest::collection::vec((0..FILE_NAMES.len(), 0..6usize, any::<bool>()), 0..7),
        proptest::collection::vec((0..EXTRA_NAMES.len(), any::<bool>()), 0..5),
        any::<bool>(),
        any::<bool>(),
    )
        .prop_map(|(first, rest, folder, files, extras, keep_second, split)| {
            let mut roots = vec![first];
            roots.extend(rest);
            IndexSpec {
                roots,
                folder,
                files,
                extras,
                keep_second,
                split,
            }
        })
}

/// Size and sha256 (of the header, or of the whole file) of `path`, as an
/// attacker who can read it would record them; `None` when it is no file.
fn truthful(path: &Path, header: bool) -> Option<(u64, String)> {
    let b = std::fs::read(path).ok()?;
    if !header {
        return Some((b.len() as u64, common::sha256_hex(&b)));
    }
    let n = u64::from_le_bytes(b.get(..8)?.try_into().ok()?) as usize;
    Some((b.len() as u64, common::sha256_hex(b.get(..8 + n)?)))
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig {
        cases: 12,
        failure_persistence: None,
        ..proptest::prelude::ProptestConfig::default()
    })]

    /// For any index written into the primary folder (parseable or not,
    /// naming any of the directories above, with true or false hashes), a
    /// re-run changes nothing outside this model's proven folders.
    #[test]
    fn for_any_index_a_rerun_changes_nothing_outside_this_models_folders(spec in index_spec()) {
        let Some(p) = Placed::new(LayoutKind::Mirror) else { return Ok(()) };
        let (st, _) = tiny_safetensors(5);
        let notes = b"notes\n".as_slice();
        let (no_marker, _) = p.lookalike("elsewhere", &[("notes.txt", notes), ("x.safetensors", &st)]);
        let marker = std::fs::read(p.folder(1).join(MARKER_FILE)).unwrap();
        let (copied, _) = p.lookalike("copied", &[(MARKER_FILE, &marker), ("hosts.safetensors", &st)]);
        let (empty, _) = p.lookalike("empty", &[]);
        let fake_root = p.bed.tmp.path().join("fake-root");
        std::fs::create_dir_all(fake_root.join("etc")).unwrap();
        std::fs::write(fake_root.join("etc").join("passwd"), b"root:x:0:0\n").unwrap();
        std::fs::create_dir_all(fake_root.join(&p.fname)).unwrap();
        std::fs::write(fake_root.join(&p.fname).join("gone.safetensors"), &st).unwrap();
        let fake_root = std::fs::canonicalize(&fake_root).unwrap();
        let link = p.bed.shm.path().join("link");
        std::os::unix::fs::symlink(&no_marker, &link).unwrap();
        std::fs::write(p.folder(0).join("mine.txt"), b"mine").unwrap();
        let folder = [p.fname.clone(), OsString::from("etc"), OsString::from("victim")][spec.folder].clone();
        let root_path = |r: RootPick| -> PathBuf {
            match r {
                RootPick::Primary => p.report.roots[0].root.clone(),
                RootPick::Second => p.report.roots[1].root.clone(),
                RootPick::NoMarker => no_marker.clone(),
                RootPick::CopiedMarker => copied.clone(),
                RootPick::Empty => empty.clone(),
                RootPick::FakeRoot => fake_root.clone(),
                RootPick::Missing => p.bed.shm.path().join("missing"),
                RootPick::ThroughLink => link.clone(),
            }
        };
        let roots: Vec<PathBuf> = spec.roots.iter().map(|&r| root_path(r)).collect();
        let mut idx = p.index();
        idx["folder"] = json!(folder.to_str().unwrap());
        idx["roots"] = Value::Array(roots.iter().map(|r| root_entry(r, &folder)).collect());
        idx["files"] = Value::Array(
            spec.files
                .iter()
                .map(|&(n, k, honest)| {
                    let k = k % roots.len();
                    let name = FILE_NAMES[n];
                    let (size, sha) = truthful(&roots[k].join(&folder).join(name), true)
                        .filter(|_| honest)
                        .unwrap_or((16, "ab".repeat(32)));
                    json!({"name": name, "root": k, "size": size, "header_sha256": sha, "kind": "shard"})
                })
                .collect(),
        );
        idx["extras"] = Value::Array(
            spec.extras
                .iter()
                .map(|&(n, honest)| {
                    let name = EXTRA_NAMES[n];
                    let (size, sha) = truthful(&roots[0].join(&folder).join(name), false)
                        .filter(|_| honest)
                        .unwrap_or((4, "cd".repeat(32)));
                    json!({"name": name, "size": size, "sha256": sha})
                })
                .collect(),
        );
        p.write_index(&idx);
        let ours = [p.folder(0), p.folder(1)];
        let before = p.snapshot(&ours);
        let rerun_roots = if spec.keep_second { &p.roots[..] } else { &p.roots[..1] };
        let layout = if spec.split { LayoutKind::Split } else { LayoutKind::Mirror };
        let outcome = place::place(&p.bed.config(rerun_roots, layout));
        let shown = match &outcome {
            Ok(r) => joined(r),
            Err(e) => e.to_string(),
        };
        proptest::prop_assert_eq!(p.snapshot(&ours), before, "changed outside this model's folders: {}", shown);
        if let Ok(r) = &outcome {
            for d in &r.deleted {
                proptest::prop_assert!(ours.iter().any(|o| d.path.starts_with(o)), "deleted {:?}", d.path);
            }
        }
    }
}
