//! Placed models read back as their source (issue 13): `mirror`, `split`
//! and `layers` placements of
//!
//! - the Python reference model (`tests/reference/ref_digest.py`: the
//!   reference writer's shards, odd and empty tensors, and a hand-made file
//!   whose header length is odd), and
//! - a synthetic MoE model with decoder layers (written by the `safetensors`
//!   crate, a layer split over two shards),
//!
//! open from the primary folder alone (no `--dirs`, `--mirror` or
//! environment), and give the reference reader's sha256 for every tensor on
//! every backend (io_uring, pread, sync); the reference reader also reads
//! every placed file itself (`tests/reference/ref_read.py`), so the layer
//! files are in its format. Copies are byte for byte; the layout is what
//! the rules say (mirror: every shard on every root; split: each once,
//! balanced; layers: layer i on root i mod N, extras on root 0); writing
//! left no page of the placed files in the page cache. Then: re-running is
//! a no-op (with `--digest` too); a payload changed in place is found by
//! `verify --digest` and by `place --digest`, which rewrites it; changed
//! roots move files and delete the stale copies; a changed primary retires
//! the old index; a layout change deletes the old files; orphans are
//! reported, never deleted, and not read; `inspect` shows the layout.
//!
//! Root 0 is a directory on `/dev/shm` (a tmpfs: another volume), root 1
//! one beside the source (`allow_source_volume`), so no root is needed;
//! without `/dev/shm` the tests print SKIP and pass.

mod common;
mod place_support;

use std::collections::BTreeMap;
use std::ffi::OsStr;
use std::path::{Path, PathBuf};

use place_support::{by_name, digest, layered_spec, ref_read, resident_pages, source_sums, Bed};
use weightstream::__internal::place::{self as layout, FileKind, Placed};
use weightstream::place::{self, LayoutKind, PlaceReport};
use weightstream::{Model, ModelConfig};

fn os(s: &str) -> &OsStr {
    OsStr::new(s)
}

fn backends() -> Vec<&'static str> {
    let mut b = common::engine_backends();
    b.push("sync");
    b
}

fn folders(r: &PlaceReport) -> Vec<PathBuf> {
    r.roots.iter().map(|x| x.folder.clone()).collect()
}

/// Places `bed.source` as `layout` over the default roots and checks
/// everything a placement promises; returns the report.
fn place_and_check(bed: &Bed, layout: LayoutKind, want: &BTreeMap<String, String>) -> PlaceReport {
    let roots = bed.roots();
    let r = place::place(&bed.config(&roots, layout)).unwrap_or_else(|e| panic!("{layout}: {e}"));
    assert!(!r.no_op, "{layout}: {r:?}");
    let dirs = folders(&r);
    // Written O_DIRECT: nothing of the placed files on the disk root stays
    // in the page cache (the tmpfs root is page cache by nature).
    for name in place_support::names(&dirs[1]) {
        if name.ends_with(".safetensors") {
            let p = dirs[1].join(&name);
            match resident_pages(&p) {
                Some(n) => assert_eq!(n, 0, "{layout}: {} left pages in the page cache", p.display()),
                None => eprintln!("SKIP page-cache check: no fincore"),
            }
        }
    }
    let placed = Placed::read(&r.primary).unwrap().expect("a placed model");
    let idx = &placed.index;
    assert_eq!(idx.layout, layout);
    assert_eq!(idx.roots.len(), 2);
    let src_shards = common::shard_names(&bed.source);
    let on = |k: usize| -> Vec<String> {
        idx.files
            .iter()
            .filter(|f| f.root == k)
            .map(|f| f.name.as_os_str().to_string_lossy().into_owned())
            .collect()
    };
    match layout {
        LayoutKind::Mirror => {
            assert_eq!(on(0), src_shards);
            assert_eq!(on(1), src_shards);
        }
        LayoutKind::Split => {
            let mut all = [on(0), on(1)].concat();
            all.sort();
            assert_eq!(all, src_shards);
            assert!(
                !on(0).is_empty() && !on(1).is_empty(),
                "split over both roots: {:?}",
                idx.files
            );
            // Balanced, largest first: the larger side exceeds the smaller
            // by at most the largest shard.
            let bytes = |k: usize| idx.files.iter().filter(|f| f.root == k).map(|f| f.size).sum::<u64>();
            let largest = idx.files.iter().map(|f| f.size).max().unwrap();
            assert!(bytes(0).abs_diff(bytes(1)) <= largest);
        }
        LayoutKind::Layers => {
            for f in &idx.files {
                match f.kind {
                    FileKind::Layer => {
                        let l = f.layer.unwrap();
                        assert_eq!(f.root as u64, l % 2, "{f:?}");
                        assert_eq!(f.name.as_os_str(), layout::layer_file(l));
                    }
                    FileKind::Extras => {
                        assert_eq!(f.root, 0);
                        assert_eq!(f.name.as_os_str(), layout::EXTRAS_FILE);
                    }
                    FileKind::Shard => panic!("a layers placement holds no source shard: {f:?}"),
                }
            }
            assert_eq!(idx.files.iter().filter(|f| f.kind == FileKind::Layer).count(), 4);
        }
    }
    // Copies are byte for byte.
    if layout != LayoutKind::Layers {
        for f in &idx.files {
            let placed = idx.folder_of(f.root).join(f.name.as_os_str());
            let src = bed.source.join(f.name.as_os_str());
            assert_eq!(
                place_support::file_sha(&placed),
                place_support::file_sha(&src),
                "{}",
                placed.display()
            );
        }
    }
    // The primary keeps the extras.
    assert!(dirs[0].join("config.json").is_file() || !bed.source.join("config.json").exists());
    // Opened from the primary alone.
    let model = Model::open(ModelConfig::new(&r.primary)).unwrap();
    assert_eq!(model.drives().len(), 2, "{layout}: two drives");
    match layout {
        LayoutKind::Mirror => {
            for s in 0..model.catalog().shards().len() {
                assert_eq!(model.copies(s).len(), 2, "{layout}: every shard mirrored");
            }
        }
        _ => assert_eq!(model.files().len(), idx.files.len()),
    }
    drop(model);
    // Every backend gives the reference's bytes.
    for b in backends() {
        assert_eq!(&digest(&r.primary, b), want, "{layout}, backend {b}");
    }
    // The reference reader reads every placed file.
    let dir_refs: Vec<&Path> = dirs.iter().map(PathBuf::as_path).collect();
    if let Some(lines) = ref_read(&dir_refs) {
        assert_eq!(
            &by_name(&lines),
            want,
            "{layout}: the reference reader over the placed files"
        );
        let copies = if layout == LayoutKind::Mirror { 2 } else { 1 };
        assert_eq!(lines.len(), want.len() * copies, "{layout}: tensors per copy");
    }
    // verify: clean.
    let out = common::run(&[os("verify"), r.primary.as_os_str(), os("--digest")]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{layout}: verify: {stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("as the index says"), "{stdout}");
    r
}

#[test]
fn every_layout_of_the_reference_model_reads_back_as_the_reference_on_every_backend() {
    let Some(bed) = Bed::new() else { return };
    let Some(text) = common::reference_digests(&bed.source) else {
        return;
    };
    let want = common::parse_sums(&text);
    assert_eq!(source_sums(&bed.source), want, "the source itself");
    for layout in [LayoutKind::Mirror, LayoutKind::Split] {
        place_and_check(&bed, layout, &want);
    }
    // No decoder layers: nothing to stripe, said so, nothing changed.
    let e = place::place(&bed.config(&bed.roots(), LayoutKind::Layers))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("no tensor is named *.layers.N.*") && e.contains("use --layout split or mirror"),
        "{e}"
    );
    assert_eq!(source_sums(&bed.source), want);
}

#[test]
fn every_layout_of_a_layered_model_reads_back_as_the_reference_on_every_backend() {
    let Some(bed) = Bed::new() else { return };
    common::synth_model(&bed.source, &layered_spec(7));
    let want = source_sums(&bed.source);
    if let Some(lines) = ref_read(&[&bed.source]) {
        assert_eq!(by_name(&lines), want, "the reference reader on the source");
    }
    for layout in [LayoutKind::Mirror, LayoutKind::Split, LayoutKind::Layers] {
        let r = place_and_check(&bed, layout, &want);
        // Each layout replaced the previous one: its files are deleted.
        if layout != LayoutKind::Mirror {
            assert!(
                !r.deleted.is_empty(),
                "{layout}: the previous layout's files deleted: {r:?}"
            );
        }
        assert!(r.orphans.is_empty(), "{layout}: {:?}", r.orphans);
    }
    // The layer files' headers: the reference format, our parser's view.
    let placed = Placed::read(
        &bed.shm
            .path()
            .join("r0")
            .join(layout::folder_name(&std::fs::canonicalize(&bed.source).unwrap())),
    )
    .unwrap()
    .unwrap();
    for f in &placed.index.files {
        let p = placed.index.folder_of(f.root).join(f.name.as_os_str());
        let h = weightstream::ShardHeader::read(&p, &std::fs::File::open(&p).unwrap()).unwrap();
        assert_eq!(h.data_start % 8, 0, "header padded to 8 bytes");
        let meta = h.metadata.expect("__metadata__ kept");
        assert!(meta["generator"].starts_with("weightstream synth seed=7"), "{meta:?}");
        let names: Vec<&str> = h.tensors.iter().map(|t| t.name.as_str()).collect();
        let mut sorted = names.clone();
        sorted.sort();
        assert_eq!(names, sorted, "one dtype: tensors in name order");
    }
}

#[test]
fn a_rerun_is_a_no_op_and_a_changed_payload_is_found_and_rewritten() {
    let Some(bed) = Bed::new() else { return };
    common::synth_model(&bed.source, &layered_spec(11));
    let want = source_sums(&bed.source);
    let roots = bed.roots();
    let first = place::place(&bed.config(&roots, LayoutKind::Layers)).unwrap();
    let again = place::place(&bed.config(&roots, LayoutKind::Layers)).unwrap();
    assert!(again.no_op, "{again:?}");
    assert_eq!((again.files_written, again.extras_written), (0, 0));
    assert_eq!(again.files_reused, first.files_written);
    let digest_run = place::place(&bed.config(&roots, LayoutKind::Layers).digest(true)).unwrap();
    assert!(digest_run.no_op, "{digest_run:?}");
    // The CLI says so too.
    let out = common::run(&[
        os("place"),
        bed.source.as_os_str(),
        os("--to"),
        OsStr::new(&format!("{};{}", roots[0].display(), roots[1].display())),
        os("--layout"),
        os("layers"),
        os("--allow-source-volume"),
    ]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success() && stdout.contains("nothing to do"), "{stdout}");

    // One payload byte changed in place on root 1: same size, same header.
    let idx = Placed::read(&first.primary).unwrap().unwrap().index;
    let f = idx.files.iter().find(|f| f.root == 1).unwrap();
    let path = idx.folder_of(1).join(f.name.as_os_str());
    let mut bytes = std::fs::read(&path).unwrap();
    let last = bytes.len() - 1;
    bytes[last] ^= 0xff;
    std::fs::write(&path, &bytes).unwrap();
    // Size and header prove nothing about payloads: without --digest a
    // re-run keeps it (documented).
    assert!(place::place(&bed.config(&roots, LayoutKind::Layers)).unwrap().no_op);
    let out = common::run(&[os("verify"), first.primary.as_os_str(), os("--digest")]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(1), "{stdout}");
    assert!(
        stdout.contains("DIFFERS")
            && stdout.contains(&path.display().to_string())
            && stdout.contains("differ from the index's sha256"),
        "{stdout}"
    );
    let fixed = place::place(&bed.config(&roots, LayoutKind::Layers).digest(true)).unwrap();
    assert_eq!(fixed.files_written, 1, "{fixed:?}");
    assert!(
        fixed.notes.iter().any(|n| n.contains("differs from the source")),
        "{:?}",
        fixed.notes
    );
    assert_eq!(digest(&first.primary, "sync"), want);
    let out = common::run(&[os("verify"), first.primary.as_os_str(), os("--digest")]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stdout));
}

#[test]
fn changed_roots_move_files_then_delete_the_stale_copies_and_a_new_primary_retires_the_old_index() {
    let Some(bed) = Bed::new() else { return };
    common::synth_model(&bed.source, &layered_spec(5));
    let want = source_sums(&bed.source);
    let a = bed.shm_root("a");
    let (b, c) = (bed.disk_root("b"), bed.disk_root("c"));
    let first = place::place(&bed.config(&[a.clone(), b.clone()], LayoutKind::Split)).unwrap();
    let old_b = first.roots[1].folder.clone();
    let on_b = place_support::names(&old_b);
    assert!(on_b.iter().any(|n| n.ends_with(".safetensors")), "{on_b:?}");

    // Root 1 moves from b to c: written there, the index replaced, then b's
    // copies deleted and its folder removed.
    let moved = place::place(&bed.config(&[a.clone(), c.clone()], LayoutKind::Split)).unwrap();
    assert_eq!(moved.roots[0].written, 0, "root 0 unchanged: kept");
    assert_eq!(moved.roots[1].written, first.roots[1].written, "{moved:?}");
    assert_eq!(moved.deleted.len(), first.roots[1].files, "{:?}", moved.deleted);
    assert!(moved.deleted.iter().all(|d| d.path.starts_with(&old_b)));
    assert!(!old_b.exists(), "the emptied folder on b is removed");
    let idx = Placed::read(&moved.primary).unwrap().unwrap().index;
    assert!(idx.folder_of(1).starts_with(&c));
    assert_eq!(digest(&moved.primary, "sync"), want);

    // The primary moves to c (a becomes root 1): a's index is retired.
    let swapped = place::place(&bed.config(&[c.clone(), a.clone()], LayoutKind::Split)).unwrap();
    assert_ne!(swapped.primary, moved.primary);
    assert!(
        !moved.primary.join(layout::INDEX_FILE).exists(),
        "the old primary's index is retired"
    );
    assert!(swapped.orphans.is_empty(), "{:?}", swapped.orphans);
    assert_eq!(digest(&swapped.primary, "sync"), want);
    let e = Model::open(ModelConfig::new(&moved.primary)).unwrap_err().to_string();
    assert!(
        e.contains("is root 1 of 2") && e.contains("open its primary folder"),
        "{e}"
    );
}

#[test]
fn orphans_are_reported_never_deleted_and_never_read() {
    let Some(bed) = Bed::new() else { return };
    common::synth_model(&bed.source, &layered_spec(3));
    let want = source_sums(&bed.source);
    let roots = bed.roots();
    let first = place::place(&bed.config(&roots, LayoutKind::Mirror)).unwrap();
    let d1 = first.roots[1].folder.clone();
    std::fs::write(d1.join("notes.txt"), b"mine").unwrap();
    // A shard-looking file no index names, holding a tensor of the model
    // with other bytes: read, it would make the model ambiguous.
    std::fs::copy(
        bed.source.join("model-00001-of-00003.safetensors"),
        d1.join("stray.safetensors"),
    )
    .unwrap();
    let r = place::place(&bed.config(&roots, LayoutKind::Layers)).unwrap();
    let orphans: Vec<String> = r.orphans.iter().map(|o| o.path.display().to_string()).collect();
    assert_eq!(r.orphans.len(), 2, "{orphans:?}");
    assert!(orphans.iter().any(|o| o.ends_with("notes.txt")));
    assert!(r.warnings.iter().any(|w| w.contains("orphan")), "{:?}", r.warnings);
    assert!(d1.join("notes.txt").exists() && d1.join("stray.safetensors").exists());
    assert_eq!(
        digest(&r.primary, "sync"),
        want,
        "the stray file is not part of the model"
    );
    let out = common::run(&[os("verify"), r.primary.as_os_str()]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success() && stdout.contains("ORPHAN"), "{stdout}");
}

#[test]
fn inspect_shows_the_layout_and_a_missing_file_is_named_not_read() {
    let Some(bed) = Bed::new() else { return };
    common::synth_model(&bed.source, &layered_spec(9));
    let r = place::place(&bed.config(&bed.roots(), LayoutKind::Layers)).unwrap();
    let out = common::run(&[os("inspect"), r.primary.as_os_str()]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(stdout.contains("placed: layers layout over 2 root(s)"), "{stdout}");
    assert!(
        stdout.contains("model-layer-00001.safetensors") && stdout.contains("layer 1"),
        "{stdout}"
    );
    let (v, _) = common::run_json(&[os("inspect"), r.primary.as_os_str(), os("--json")]);
    assert_eq!(v["placement"]["layout"], "layers");
    assert_eq!(v["placement"]["files"].as_array().unwrap().len(), 5);

    // A file the index names goes missing: a miss naming it, never a model
    // opened without it.
    let gone = r.roots[1].folder.join(layout::layer_file(3));
    std::fs::remove_file(&gone).unwrap();
    let e = Model::open(ModelConfig::new(&r.primary)).unwrap_err().to_string();
    assert!(
        e.contains(&gone.display().to_string()) && e.contains("is missing"),
        "{e}"
    );
    let out = common::run(&[os("verify"), r.primary.as_os_str()]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(1), "{stdout}");
    assert!(stdout.contains("DIFFERS") && stdout.contains("missing"), "{stdout}");
    // The next run repairs it.
    let fixed = place::place(&bed.config(&bed.roots(), LayoutKind::Layers)).unwrap();
    assert_eq!(fixed.files_written, 1, "{fixed:?}");
    assert!(Model::open(ModelConfig::new(&r.primary)).is_ok());
}
