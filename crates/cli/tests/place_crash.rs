//! The layout index is the commit point (issue 13): a placement
//! interrupted at any step leaves the previous model readable, or a miss
//! that says why; never a model that opens with a mix of old and new
//! bytes; and the next run repairs it.
//!
//! - A content re-shard (the source rewritten with other bytes) stopped at
//!   every step of the protocol by the library's test hook, as a crash
//!   would (nothing cleaned up): folders marked, after the 1st and 3rd
//!   temporary file, the old index parked, after the 1st rename, after
//!   every rename, the new index written but not renamed, committed,
//!   cleaned. Before the park the old model reads back whole; from the
//!   park to the commit the model does not open ("did not finish"); from
//!   the commit on the new one reads back whole.
//! - A first placement stopped before its commit: a miss ("never
//!   committed").
//! - The same with a real `kill -9` of the `weightstream place` process
//!   (`WEIGHTSTREAM_PLACE_FAULT`), at a temporary file, the park, a rename,
//!   the index write and the commit.
//! - ENOSPC in the middle of a copy on a 64 MiB loop filesystem (root
//!   only): the previous index stays valid (the old model reads back
//!   whole), the temporary files are removed, the next run (with space)
//!   succeeds.

mod common;
mod place_support;

use std::collections::BTreeMap;
use std::ffi::OsStr;
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};

use place_support::{digest, layered_spec, source_sums, temps, Bed};
use weightstream::__internal::place::{self as layout, Placed, Step};
use weightstream::place::{self, LayoutKind};
use weightstream::{Model, ModelConfig};

fn os(s: &str) -> &OsStr {
    OsStr::new(s)
}

/// What a reader of the primary sees now.
#[derive(Debug, PartialEq)]
enum Seen {
    Old,
    New,
    /// The model does not open; the error says why.
    Miss(String),
}

fn seen(primary: &Path, old: &BTreeMap<String, String>, new: &BTreeMap<String, String>) -> Seen {
    match Model::open(ModelConfig::new(primary)) {
        Err(e) => {
            let e = e.to_string();
            assert!(
                e.contains("did not finish") || e.contains("never committed"),
                "a miss must say why: {e}"
            );
            // And every file an index still names is there.
            Seen::Miss(e)
        }
        Ok(_) => {
            let got = digest(primary, "sync");
            if &got == old {
                Seen::Old
            } else if &got == new {
                Seen::New
            } else {
                let mixed: Vec<&String> = got.keys().filter(|k| got.get(*k) != new.get(*k)).take(5).collect();
                panic!("a STALE HIT: the model opened with neither the old nor the new bytes (e.g. {mixed:?})");
            }
        }
    }
}

/// After the repairing run: the new model, no temporary file, no orphan,
/// verify clean.
fn repaired(r: &place::PlaceReport, new: &BTreeMap<String, String>) {
    assert_eq!(&digest(&r.primary, "sync"), new);
    for root in &r.roots {
        assert!(temps(&root.folder).is_empty(), "{:?}", temps(&root.folder));
        assert!(!root.folder.join(layout::PARKED_FILE).exists());
    }
    assert!(r.orphans.is_empty(), "{:?}", r.orphans);
    let out = common::run(&[os("verify"), r.primary.as_os_str(), os("--digest")]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stdout));
}

/// A bed with a placed model (seed 1, layers over two roots), then its
/// source rewritten with seed 2: (bed, roots, primary, old sums, new sums).
type Resharded = (
    Bed,
    Vec<PathBuf>,
    PathBuf,
    BTreeMap<String, String>,
    BTreeMap<String, String>,
);

fn placed_then_changed() -> Option<Resharded> {
    let bed = Bed::new()?;
    common::synth_model(&bed.source, &layered_spec(1));
    let old = source_sums(&bed.source);
    let roots = bed.roots();
    let r = place::place(&bed.config(&roots, LayoutKind::Layers)).unwrap();
    std::fs::remove_dir_all(&bed.source).unwrap();
    common::synth_model(&bed.source, &layered_spec(2));
    let new = source_sums(&bed.source);
    assert_ne!(old, new);
    Some((bed, roots, r.primary, old, new))
}

#[test]
fn a_reshard_stopped_at_each_step_is_the_old_model_or_a_miss_or_the_new_one_and_the_next_run_repairs() {
    let steps = [
        (Step::Folders, "old"),
        (Step::FileWritten(1), "old"),
        (Step::FileWritten(3), "old"),
        (Step::Parked, "miss"),
        (Step::Renamed(1), "miss"),
        (Step::AllRenamed, "miss"),
        (Step::IndexWritten, "miss"),
        (Step::Committed, "new"),
        (Step::Cleaned, "new"),
    ];
    for (step, want) in steps {
        let Some((bed, roots, primary, old, new)) = placed_then_changed() else {
            return;
        };
        let cfg = bed.config(&roots, LayoutKind::Layers).fault_hook(move |s| *s == step);
        let e = place::place(&cfg).unwrap_err().to_string();
        assert!(e.contains(&format!("stopped at step {step}")), "{step}: {e}");
        let now = seen(&primary, &old, &new);
        match (want, &now) {
            ("old", Seen::Old) | ("new", Seen::New) | ("miss", Seen::Miss(_)) => {}
            _ => panic!("stopped at {step}: a reader sees {now:?}, expected {want}"),
        }
        if let Seen::Miss(e) = &now {
            assert!(e.contains("did not finish"), "{step}: {e}");
        }
        // Whatever an index names is there.
        if primary.join(layout::INDEX_FILE).exists() {
            Placed::read(&primary).unwrap_or_else(|e| panic!("{step}: the index names a missing file: {e}"));
        }
        let r = place::place(&bed.config(&roots, LayoutKind::Layers)).unwrap();
        if matches!(
            step,
            Step::FileWritten(_) | Step::Parked | Step::Renamed(_) | Step::AllRenamed | Step::IndexWritten
        ) {
            assert!(
                !r.repaired.is_empty(),
                "{step}: the next run says what it repaired: {r:?}"
            );
        }
        if want == "miss" {
            assert!(
                r.repaired.iter().any(|m| m.contains("did not finish")),
                "{step}: {:?}",
                r.repaired
            );
        }
        repaired(&r, &new);
    }
}

#[test]
fn a_first_placement_stopped_before_its_commit_is_a_miss() {
    for step in [Step::FileWritten(1), Step::AllRenamed, Step::IndexWritten] {
        let Some(bed) = Bed::new() else { return };
        common::synth_model(&bed.source, &layered_spec(4));
        let new = source_sums(&bed.source);
        let roots = bed.roots();
        let cfg = bed.config(&roots, LayoutKind::Split).fault_hook(move |s| *s == step);
        assert!(place::place(&cfg).is_err());
        let primary = roots[0].join(layout::folder_name(&std::fs::canonicalize(&bed.source).unwrap()));
        let e = Model::open(ModelConfig::new(&primary)).unwrap_err().to_string();
        assert!(e.contains("never committed"), "{step}: {e}");
        let r = place::place(&bed.config(&roots, LayoutKind::Split)).unwrap();
        assert!(!r.repaired.is_empty(), "{step}: {r:?}");
        repaired(&r, &new);
    }
}

#[test]
fn kill_minus_9_of_the_cli_at_each_step_is_repaired_by_the_next_run() {
    for (at, want) in [
        ("file:1", "old"),
        ("parked", "miss"),
        ("renamed:1", "miss"),
        ("index-written", "miss"),
        ("committed", "new"),
    ] {
        let Some((bed, roots, primary, old, new)) = placed_then_changed() else {
            return;
        };
        let to = format!("{};{}", roots[0].display(), roots[1].display());
        let args = [
            os("place"),
            bed.source.as_os_str(),
            os("--to"),
            OsStr::new(&to),
            os("--layout"),
            os("layers"),
            os("--allow-source-volume"),
        ];
        let out = common::run_with_env(&args, &[("WEIGHTSTREAM_PLACE_FAULT", os(at))]);
        assert_eq!(
            out.status.signal(),
            Some(9),
            "{at}: killed by SIGKILL: {:?} {}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
        let now = seen(&primary, &old, &new);
        match (want, &now) {
            ("old", Seen::Old) | ("new", Seen::New) | ("miss", Seen::Miss(_)) => {}
            _ => panic!("kill -9 at {at}: a reader sees {now:?}, expected {want}"),
        }
        let out = common::run(&args);
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "{at}: {stdout}{}",
            String::from_utf8_lossy(&out.stderr)
        );
        if want != "new" {
            assert!(stdout.contains("repaired:"), "{at}: {stdout}");
        }
        let r = place::place(&bed.config(&roots, LayoutKind::Layers)).unwrap();
        assert!(r.no_op, "{at}: repaired by the CLI run: {r:?}");
        repaired(&r, &new);
    }
}

#[test]
fn enospc_in_the_middle_of_a_copy_leaves_the_previous_index_valid_and_no_temporary_file() {
    let Some(bed) = Bed::new() else { return };
    let Some(tiny) = place_support::TinyFs::new(64) else {
        return;
    };
    let spec = |seed| weightstream_synth::SynthSpec {
        expert_bytes: 600_000,
        ..layered_spec(seed)
    };
    common::synth_model(&bed.source, &spec(1));
    let old = source_sums(&bed.source);
    let root = tiny.mount.join("root");
    std::fs::create_dir(&root).unwrap();
    let cfg = |hook: bool| {
        let c = place::PlaceConfig::new(&bed.source, [root.clone()], LayoutKind::Mirror).buffer_bytes(1 << 20);
        if !hook {
            return c;
        }
        // After the first file: fill the filesystem, leaving 1 MiB.
        let mount = tiny.mount.clone();
        c.fault_hook(move |s| {
            if *s == Step::FileWritten(1) {
                let v = rustix::fs::statvfs(&mount).unwrap();
                let free = v.f_bavail * v.f_frsize;
                let f = std::fs::File::create(mount.join("filler")).unwrap();
                rustix::fs::fallocate(&f, rustix::fs::FallocateFlags::empty(), 0, free - (1 << 20)).unwrap();
            }
            false
        })
    };
    let first = place::place(&cfg(false)).unwrap();
    let index_before = std::fs::read(&first.index).unwrap();
    std::fs::remove_dir_all(&bed.source).unwrap();
    common::synth_model(&bed.source, &spec(2));
    let new = source_sums(&bed.source);
    let e = place::place(&cfg(true)).unwrap_err().to_string();
    eprintln!("the refusal: {e}");
    assert!(
        e.contains("No space left on device") && e.contains(".safetensors") && e.contains("nothing was committed"),
        "{e}"
    );
    assert!(
        e.contains("write"),
        "the failure is a write in the middle of a copy: {e}"
    );
    assert!(
        temps(&first.primary).is_empty(),
        "temporary files removed: {:?}",
        temps(&first.primary)
    );
    assert_eq!(
        std::fs::read(&first.index).unwrap(),
        index_before,
        "the index untouched"
    );
    assert_eq!(
        seen(&first.primary, &old, &new),
        Seen::Old,
        "the previous model still reads back whole"
    );
    std::fs::remove_file(tiny.mount.join("filler")).unwrap();
    let r = place::place(&cfg(false)).unwrap();
    assert_eq!(r.files_written, 3);
    repaired(&r, &new);
}

/// A progress callback that panics stops the writers and leaves no
/// temporary file; the panic reaches the caller with its own payload, and
/// the previous placement is as it was (before: every file was written
/// first, then the panic surfaced with the temporary files left behind).
#[test]
fn a_panicking_progress_callback_stops_the_writers_and_leaves_no_temporary_file() {
    let Some(bed) = Bed::new() else { return };
    common::synth_model(&bed.source, &layered_spec(4));
    let roots = bed.roots();
    let first = place::place(&bed.config(&roots, LayoutKind::Mirror)).unwrap();
    let index_before = std::fs::read(&first.index).unwrap();
    let sums = source_sums(&bed.source);
    // A content re-shard (layers): every file is to be written again.
    let cfg = bed
        .config(&roots, LayoutKind::Layers)
        .on_progress(|_| panic!("the caller's progress bar broke"));
    let caught = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| place::place(&cfg)));
    let payload = caught.expect_err("the callback's panic reaches the caller");
    assert_eq!(
        payload.downcast_ref::<&str>(),
        Some(&"the caller's progress bar broke"),
        "the callback's own payload"
    );
    for r in &first.roots {
        assert_eq!(temps(&r.folder), Vec::<String>::new(), "{}", r.folder.display());
    }
    assert_eq!(
        std::fs::read(&first.index).unwrap(),
        index_before,
        "the index is untouched"
    );
    assert_eq!(
        digest(&first.primary, "sync"),
        sums,
        "the previous placement reads as before"
    );
}
