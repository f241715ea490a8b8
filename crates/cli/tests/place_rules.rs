//! Every refusal of `weightstream place` (issue 13, the field's folder
//! rules): each names the entry and the way out, and nothing is written.
//!
//! Roots: missing, control characters, relative, a link, not a directory,
//! on the source's volume, two on one volume, listed twice, overlapping
//! the source, none. Folders: a link, not a directory, writable by group,
//! owned by another user (uid 65534, root only), one that cannot be made
//! private (immutable, root on ext4 only), one in use by another run.
//! Space: a root too small (a tiny loop filesystem, root only). Readers: a
//! marker without an index, a parked index, another root's folder, layout
//! flags given with a placed model, a crafted index naming a path outside
//! its folder.

mod common;
mod place_support;

use std::ffi::OsStr;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

use place_support::{layered_spec, Bed};
use weightstream::__internal::place::{self as layout, folder_name};
use weightstream::place::{self, LayoutKind, PlaceConfig};
use weightstream::{Model, ModelConfig};

fn os(s: &str) -> &OsStr {
    OsStr::new(s)
}

/// The folder a placement of `bed.source` makes on `root`.
fn folder(bed: &Bed, root: &Path) -> PathBuf {
    root.join(folder_name(&std::fs::canonicalize(&bed.source).unwrap()))
}

fn model_bed() -> Option<Bed> {
    let bed = Bed::new()?;
    common::synth_model(&bed.source, &layered_spec(1));
    Some(bed)
}

/// Runs `place` with `roots` (library, no source-volume allowance), expects
/// a refusal containing every one of `want`, and checks that no root got
/// anything.
fn refused(bed: &Bed, roots: Vec<PathBuf>, want: &[&str]) -> String {
    let before: Vec<Vec<String>> = roots.iter().map(|r| place_support::names(r)).collect();
    let e = place::place(&PlaceConfig::new(&bed.source, roots.clone(), LayoutKind::Mirror))
        .expect_err("refused")
        .to_string();
    for w in want {
        assert!(e.contains(w), "refusal {e:?} lacks {w:?}");
    }
    let after: Vec<Vec<String>> = roots.iter().map(|r| place_support::names(r)).collect();
    assert_eq!(before, after, "a refused run wrote nothing: {e}");
    e
}

#[test]
fn roots_are_refused_naming_the_entry_and_the_way_out() {
    let Some(bed) = model_bed() else { return };
    let shm = bed.shm_root("ok");
    let disk = bed.disk_root("disk");
    refused(
        &bed,
        vec![PathBuf::from("/nonexistent/ws-root")],
        &[
            "root \"/nonexistent/ws-root\"",
            "does not exist: reconnect the drive, or remove this entry",
        ],
    );
    refused(
        &bed,
        vec![bed.shm.path().join("a\nb")],
        &["a\\nb\"", "contains control characters; retype the path"],
    );
    // A relative root is taken against the working directory.
    refused(
        &bed,
        vec![PathBuf::from("relative/root")],
        &[&format!(
            "root \"relative/root\" ({}): does not exist",
            std::env::current_dir().unwrap().join("relative/root").display()
        )],
    );
    let link = bed.shm.path().join("link");
    std::os::unix::fs::symlink(&shm, &link).unwrap();
    refused(
        &bed,
        vec![link.clone()],
        &["link\"", "is a symbolic link; give the directory it points to"],
    );
    let file = bed.shm.path().join("plain-file");
    std::fs::write(&file, b"x").unwrap();
    refused(&bed, vec![file], &["is not a directory"]);
    refused(
        &bed,
        vec![disk.clone()],
        &[
            "is on the same volume",
            "as the source",
            "give a root on another drive, or allow it (--allow-source-volume)",
        ],
    );
    let shm2 = bed.shm_root("other");
    refused(
        &bed,
        vec![shm.clone(), shm2],
        &["two roots on one drive read no faster than one; give one root per drive"],
    );
    refused(&bed, vec![shm.clone(), shm.clone()], &["is listed twice"]);
    refused(&bed, vec![bed.source.join("sub")], &["does not exist"]);
    std::fs::create_dir_all(bed.source.join("sub")).unwrap();
    refused(&bed, vec![bed.source.join("sub")], &["overlaps the source directory"]);
    refused(&bed, vec![], &["no root given"]);
    // The CLI says the same, exit status 1.
    let out = common::run(&[
        os("place"),
        bed.source.as_os_str(),
        os("--to"),
        os("/nonexistent/ws-root"),
        os("--layout"),
        os("mirror"),
    ]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("does not exist: reconnect the drive"), "{stderr}");
    let out = common::run(&[
        os("place"),
        bed.source.as_os_str(),
        os("--to"),
        shm.as_os_str(),
        os("--layout"),
        os("raid0"),
    ]);
    // A typed value (clap): a usage error, exit status 2, naming the values.
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("possible values: mirror, split, layers"), "{stderr}");
    // The library's parser says the same words for a configuration string.
    let e = "raid0".parse::<LayoutKind>().unwrap_err().to_string();
    assert!(e.contains("expected mirror, split or layers"), "{e}");
}

#[test]
fn unsafe_folders_are_refused_and_nothing_is_written() {
    let Some(bed) = model_bed() else { return };
    // A link where the folder goes: refused, its target untouched.
    let root = bed.shm_root("linked");
    let elsewhere = bed.shm_root("elsewhere");
    std::os::unix::fs::symlink(&elsewhere, folder(&bed, &root)).unwrap();
    refused(
        &bed,
        vec![root.clone()],
        &["is a symbolic link: refused", "remove the link and run again"],
    );
    assert!(place_support::names(&elsewhere).is_empty());

    // Not a directory.
    let root = bed.shm_root("file");
    std::fs::write(folder(&bed, &root), b"not ours").unwrap();
    refused(
        &bed,
        vec![root.clone()],
        &["is a regular file, not a directory: refused", "move it away"],
    );

    // Writable by group: refused, left as it was (not chmod'ed).
    let root = bed.shm_root("group");
    let f = folder(&bed, &root);
    std::fs::create_dir(&f).unwrap();
    std::fs::set_permissions(&f, std::fs::Permissions::from_mode(0o775)).unwrap();
    refused(
        &bed,
        vec![root.clone()],
        &["is writable by group or others (mode 0775)", "chmod 700"],
    );
    assert_eq!(std::fs::metadata(&f).unwrap().permissions().mode() & 0o7777, 0o775);
    assert!(place_support::names(&f).is_empty());
    // Writable by others, too.
    std::fs::set_permissions(&f, std::fs::Permissions::from_mode(0o707)).unwrap();
    refused(&bed, vec![root.clone()], &["(mode 0707)"]);

    // Readable by others (no write bit): accepted, made 0700.
    let root = bed.shm_root("readable");
    let f = folder(&bed, &root);
    std::fs::create_dir(&f).unwrap();
    std::fs::set_permissions(&f, std::fs::Permissions::from_mode(0o755)).unwrap();
    let r = place::place(&PlaceConfig::new(&bed.source, [root.clone()], LayoutKind::Mirror)).unwrap();
    assert_eq!(r.primary, std::fs::canonicalize(&f).unwrap());
    assert_eq!(std::fs::metadata(&f).unwrap().permissions().mode() & 0o7777, 0o700);

    // A new folder is made 0700.
    let root = bed.shm_root("fresh");
    place::place(&PlaceConfig::new(&bed.source, [root.clone()], LayoutKind::Split)).unwrap();
    assert_eq!(
        std::fs::metadata(folder(&bed, &root)).unwrap().permissions().mode() & 0o7777,
        0o700
    );

    // In use by another run (its flock).
    let busy = std::fs::File::open(folder(&bed, &root)).unwrap();
    rustix::fs::flock(&busy, rustix::fs::FlockOperation::LockExclusive).unwrap();
    refused(
        &bed,
        vec![root.clone()],
        &[
            "is in use by another `weightstream place` (flock)",
            "wait for it to finish",
        ],
    );
    drop(busy);

    // A refusal on root 1 removes the folder this run made on root 0.
    let r0 = bed.shm_root("first");
    let r1 = bed.disk_root("second");
    std::fs::write(folder(&bed, &r1), b"blocks the folder").unwrap();
    let e =
        place::place(&PlaceConfig::new(&bed.source, [r0.clone(), r1], LayoutKind::Mirror).allow_source_volume(true))
            .unwrap_err()
            .to_string();
    assert!(e.contains("not a directory"), "{e}");
    assert!(place_support::names(&r0).is_empty(), "root 0's new folder removed");
}

#[test]
fn a_folder_of_another_user_is_refused() {
    let Some(bed) = model_bed() else { return };
    if !rustix::process::geteuid().is_root() {
        eprintln!("SKIP: chown to uid 65534 needs root");
        return;
    }
    let root = bed.shm_root("nobody");
    let f = folder(&bed, &root);
    std::fs::create_dir(&f).unwrap();
    std::fs::set_permissions(&f, std::fs::Permissions::from_mode(0o700)).unwrap();
    std::os::unix::fs::chown(&f, Some(65534), Some(65534)).unwrap();
    refused(
        &bed,
        vec![root],
        &[
            "is owned by uid 65534, not by this user (uid 0)",
            "remove it, or choose another root",
        ],
    );
    assert!(place_support::names(&f).is_empty());
}

#[test]
fn a_folder_that_cannot_be_made_private_refuses_the_run() {
    let Some(bed) = model_bed() else { return };
    if !rustix::process::geteuid().is_root() {
        eprintln!("SKIP: chattr +i needs root");
        return;
    }
    let root = bed.disk_root("immutable");
    let f = folder(&bed, &root);
    std::fs::create_dir(&f).unwrap();
    std::fs::set_permissions(&f, std::fs::Permissions::from_mode(0o755)).unwrap();
    let ok = std::process::Command::new("chattr")
        .arg("+i")
        .arg(&f)
        .status()
        .map(|s| s.success());
    if !matches!(ok, Ok(true)) {
        eprintln!("SKIP: chattr +i failed here ({ok:?})");
        return;
    }
    let e = place::place(&PlaceConfig::new(&bed.source, [root.clone()], LayoutKind::Mirror).allow_source_volume(true))
        .unwrap_err()
        .to_string();
    let _ = std::process::Command::new("chattr").arg("-i").arg(&f).status();
    assert!(
        e.contains("cannot be made private (fchmod 0700") && e.contains("nothing was written"),
        "{e}"
    );
    assert!(place_support::names(&f).is_empty());
    assert_eq!(std::fs::metadata(&f).unwrap().permissions().mode() & 0o7777, 0o755);
}

#[test]
fn a_root_without_the_space_is_refused_before_anything_is_written() {
    let Some(bed) = Bed::new() else { return };
    let Some(tiny) = place_support::TinyFs::new(8) else {
        return;
    };
    // About 20 MB of tensors against an 8 MiB filesystem.
    common::synth_model(
        &bed.source,
        &weightstream_synth::SynthSpec {
            expert_bytes: 600_000,
            ..layered_spec(2)
        },
    );
    let root = tiny.mount.join("root");
    std::fs::create_dir(&root).unwrap();
    let e = place::place(&PlaceConfig::new(&bed.source, [root.clone()], LayoutKind::Mirror))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("needs") && e.contains("available (statvfs): nothing was written") && e.contains("free space"),
        "{e}"
    );
    assert!(
        place_support::names(&root).is_empty(),
        "the folder made for the run is removed"
    );
}

#[test]
fn readers_refuse_what_is_not_a_committed_placement() {
    let Some(bed) = model_bed() else { return };
    let roots = bed.roots();
    let r = place::place(&PlaceConfig::new(&bed.source, roots.clone(), LayoutKind::Split).allow_source_volume(true))
        .unwrap();
    // Another root's folder.
    let e = Model::open(ModelConfig::new(&r.roots[1].folder))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("is root 1 of 2 of a placed model: open its primary folder"),
        "{e}"
    );
    // Layout flags with a placed model.
    let e = Model::open(ModelConfig::new(&r.primary).mirrors([bed.tmp.path()]))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("is a placed model") && e.contains("do not give split or mirror directories"),
        "{e}"
    );
    let out = common::run_with_env(
        &[os("inspect"), r.primary.as_os_str()],
        &[("WEIGHTSTREAM_MIRROR", bed.tmp.path().as_os_str())],
    );
    assert!(String::from_utf8_lossy(&out.stderr).contains("WEIGHTSTREAM_MIRROR"));
    // A parked index (a re-shard that did not finish).
    let index = r.primary.join(layout::INDEX_FILE);
    let parked = r.primary.join(layout::PARKED_FILE);
    std::fs::rename(&index, &parked).unwrap();
    let e = Model::open(ModelConfig::new(&r.primary)).unwrap_err().to_string();
    assert!(
        e.contains("a re-shard of this placed model did not finish") && e.contains("run `weightstream place` again"),
        "{e}"
    );
    // A marker and no index at all (a first placement that never committed).
    std::fs::remove_file(&parked).unwrap();
    let e = Model::open(ModelConfig::new(&r.primary)).unwrap_err().to_string();
    assert!(e.contains("never committed"), "{e}");
    let out = common::run(&[os("verify"), r.primary.as_os_str()]);
    assert_eq!(out.status.code(), Some(1), "{}", String::from_utf8_lossy(&out.stdout));
    // A crafted index naming a path outside the folder is refused, not followed.
    place::place(&PlaceConfig::new(&bed.source, roots, LayoutKind::Split).allow_source_volume(true)).unwrap();
    let text = std::fs::read_to_string(&index).unwrap();
    let first = Model::open(ModelConfig::new(&r.primary)).unwrap().catalog().shards()[0]
        .name
        .clone();
    let crafted = text.replacen(
        &format!("\"{}\"", first.to_string_lossy()),
        "\"../../escape.safetensors\"",
        1,
    );
    assert_ne!(crafted, text);
    std::fs::write(&index, crafted).unwrap();
    let e = Model::open(ModelConfig::new(&r.primary)).unwrap_err().to_string();
    assert!(
        e.contains("refused layout index") && e.contains("not a plain *.safetensors name"),
        "{e}"
    );
    let e = place::place(&PlaceConfig::new(&bed.source, bed.roots(), LayoutKind::Split).allow_source_volume(true))
        .unwrap_err()
        .to_string();
    assert!(e.contains("refused layout index") && e.contains("move it away"), "{e}");
}
