//! `weightstream ceiling` (a sweep of read configurations per drive: the best
//! and the configuration that reached it, every configuration's figure) and
//! the bench's `fio` arm (fio's best on the same files, in the same run).

mod common;

use std::ffi::OsStr;
use std::path::{Path, PathBuf};
use std::time::Instant;

/// The shards of a small synthetic model in `dir` (about 4 x 1.5 MB).
fn small_model(dir: &Path) -> Vec<PathBuf> {
    let spec = weightstream_synth::SynthSpec {
        layers: 4,
        experts: 4,
        expert_bytes: 128 << 10,
        shards: 4,
        ..weightstream_synth::SynthSpec::default()
    };
    common::synth_model(dir, &spec);
    let mut v: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
        .collect();
    v.sort();
    v
}

/// Whether this machine can run the ceiling here (io_uring, O_DIRECT).
fn can_measure(dir: &Path) -> bool {
    if !common::uring_available() {
        eprintln!("SKIP: io_uring is not available");
        return false;
    }
    if !common::fs_reads_o_direct(dir) {
        eprintln!("SKIP: {} does not read O_DIRECT", dir.display());
        return false;
    }
    true
}

fn args<'a>(head: &'a [&'a str], files: &'a [PathBuf]) -> Vec<&'a OsStr> {
    head.iter()
        .map(OsStr::new)
        .chain(files.iter().map(|p| p.as_os_str()))
        .collect()
}

/// Checks one drive's record: the best and its configuration, a spread, and
/// every configuration with a figure or the reason it has none.
fn check_drive(d: &serde_json::Value, configs: usize) {
    let gbps = d["gbps"].as_f64().unwrap();
    assert!(gbps > 0.0 && gbps.is_finite(), "{d:#}");
    for k in ["bs", "qd", "readers", "submit", "buffers"] {
        assert!(!d["best"][k].is_null(), "best.{k} missing: {d:#}");
    }
    assert!(d["best_label"].as_str().unwrap().starts_with("bs="), "{d:#}");
    let all = d["configs"].as_array().unwrap();
    assert_eq!(all.len(), configs, "every configuration is listed: {d:#}");
    let mut max = 0.0f64;
    for c in all {
        let g = c["gbps"].as_f64().unwrap();
        assert!(
            g > 0.0 || c.get("error").is_some() || c.get("skipped").is_some(),
            "a configuration without a figure says why: {c:#}"
        );
        assert!(c["label"].as_str().is_some() && c["config"]["bs"].as_u64().is_some());
        max = max.max(g);
    }
    assert_eq!(gbps, max, "the best is the highest figure: {d:#}");
    let best: Vec<_> = all.iter().filter(|c| c["config"] == d["best"]).collect();
    assert_eq!(best.len(), 1, "the best configuration is one of those listed");
    assert_eq!(best[0]["gbps"].as_f64().unwrap(), gbps);
    let s = &d["spread"];
    assert!(
        s["min_gbps"].as_f64().unwrap() <= s["max_gbps"].as_f64().unwrap(),
        "{s:#}"
    );
    assert!(s["weakest_ratio"].as_f64().unwrap() <= 1.0, "{s:#}");
}

#[test]
fn quick_ceiling_json_has_each_drives_best_its_configuration_and_every_configuration() {
    let tmp = common::tempdir();
    if !can_measure(tmp.path()) {
        return;
    }
    let files = small_model(&tmp.path().join("m"));
    let t0 = Instant::now();
    let (v, _) = common::run_json(&args(&["ceiling", "--quick", "--json"], &files));
    let took = t0.elapsed();
    let drives = v["drives"].as_array().unwrap();
    assert_eq!(drives.len(), 1, "one drive: {v:#}");
    check_drive(&drives[0], 8);
    assert_eq!(drives[0]["files"].as_array().unwrap().len(), files.len());
    assert_eq!(v["sweep"], "quick");
    assert!(v["gbps"].as_f64().unwrap() > 0.0);
    assert_eq!(v["gbps"], drives[0]["gbps"], "one drive: the total is its best");
    assert!(v["cpu_seconds"].as_f64().unwrap() >= 0.0);
    // 8 configurations of at most 0.25 s each, plus set-up: the count is
    // checked above (check_drive), the time printed, not bounded.
    eprintln!("quick sweep took {took:?}");
}

#[test]
fn ceiling_flags_choose_the_dimensions_and_the_text_names_the_best() {
    let tmp = common::tempdir();
    if !can_measure(tmp.path()) {
        return;
    }
    let files = small_model(&tmp.path().join("m"));
    let head = [
        "ceiling",
        "--bs",
        "256KiB",
        "--qd",
        "4,8",
        "--readers",
        "1",
        "--submit",
        "inline",
        "--buffers",
        "plain,fixed",
        "--bytes",
        "16MiB",
        "--seconds",
        "0.1",
        "--json",
    ];
    let (v, _) = common::run_json(&args(&head, &files));
    check_drive(&v["drives"][0], 4);
    assert_eq!(v["sweep"], "custom");
    for c in v["drives"][0]["configs"].as_array().unwrap() {
        assert_eq!(c["config"]["bs"], 256 << 10);
        assert_eq!(c["config"]["submit"], "inline");
        // The byte cap holds (reads in flight when it hits complete: at most
        // one window more).
        if c.get("error").is_none() {
            assert!(c["bytes"].as_u64().unwrap() <= (16 << 20) + 8 * (256 << 10), "{c:#}");
        }
    }
    let out = common::run(&args(&head[..head.len() - 1], &files));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(text.contains("best") && text.contains("<- best"), "{text}");
    assert!(text.contains("sweep took"), "{text}");
}

#[test]
fn ceiling_refuses_bad_input_with_a_message_naming_it() {
    let tmp = common::tempdir();
    let files = small_model(&tmp.path().join("m"));
    let cases: Vec<(Vec<&str>, &str)> = vec![
        // Out of range and typed values: clap's usage error names the flag
        // and the range, or the value (exit status 2).
        (
            vec!["ceiling", "--bs", "1000"],
            "'--bs <BS>': 1000 bytes is outside the accepted range 4096..=",
        ),
        (vec!["ceiling", "--qd", "0"], "'--qd <QD>': 0 is not in 1..=4096"),
        (
            vec!["ceiling", "--readers", "0"],
            "'--readers <READERS>': 0 is not in 1..=64",
        ),
        (vec!["ceiling", "--submit", "sqpoll"], "'sqpoll'"),
        (vec!["ceiling", "--buffers", "huge"], "'huge'"),
        (
            vec!["ceiling", "--seconds", "0"],
            "'--seconds <SECONDS>': 0 is outside the accepted range",
        ),
        (
            vec!["ceiling", "--seconds", "nan"],
            "'--seconds <SECONDS>': NaN is outside the accepted range",
        ),
        (
            vec!["ceiling", "--bytes", "0"],
            "'--bytes <BYTES>': 0 bytes is outside the accepted range 1..=",
        ),
    ];
    for (head, want) in cases {
        let out = common::run(&args(&head, &files));
        let err = String::from_utf8_lossy(&out.stderr);
        let usage = want.starts_with('\'');
        assert_eq!(out.status.code(), Some(if usage { 2 } else { 1 }), "{head:?}: {err}");
        assert!(err.contains(want), "{head:?}: {err}");
        assert!(!err.contains("panicked"), "{head:?}: {err}");
    }
    let missing = tmp.path().join("no-such-file");
    let out = common::run(&[OsStr::new("ceiling"), OsStr::new("--quick"), missing.as_os_str()]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("no-such-file"), "{err}");
    let empty = tmp.path().join("empty.safetensors");
    std::fs::write(&empty, b"").unwrap();
    let out = common::run(&[OsStr::new("ceiling"), OsStr::new("--quick"), empty.as_os_str()]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "an empty file: {err}");
    assert!(err.contains("no byte") && err.contains("empty.safetensors"), "{err}");
    let out = common::run(&[OsStr::new("ceiling"), OsStr::new("--quick"), tmp.path().as_os_str()]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "a directory: {err}");
    assert!(!err.contains("panicked"), "{err}");
}

fn fio_installed() -> bool {
    std::process::Command::new("fio")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success())
}

/// A small model in a fresh directory, when io_uring, O_DIRECT and fio
/// are all here (else None, the reason printed as SKIP).
fn fio_model() -> Option<(tempfile::TempDir, PathBuf)> {
    let tmp = common::tempdir();
    if !can_measure(tmp.path()) {
        return None;
    }
    if !fio_installed() {
        eprintln!("SKIP: fio is not installed (ci/install-deps installs it)");
        return None;
    }
    let dir = tmp.path().join("m");
    small_model(&dir);
    Some((tmp, dir))
}

#[test]
fn the_fio_arm_reports_fios_best_beside_the_ceiling() {
    let Some((_tmp, dir)) = fio_model() else { return };
    let (v, stderr) = common::run_json(&[
        OsStr::new("bench"),
        dir.as_os_str(),
        OsStr::new("--arms"),
        OsStr::new("ceiling,fio,engine"),
        OsStr::new("--runs"),
        OsStr::new("1"),
        OsStr::new("--json"),
    ]);
    let fio = v["fio_gbps"].as_f64().unwrap_or(0.0);
    assert!(fio > 0.0 && fio.is_finite(), "fio's best: {v:#}\n{stderr}");
    assert!(v["fio_config"].as_str().unwrap().starts_with("rw="), "{v:#}");
    assert!(v["fio_version"].as_str().unwrap().starts_with("fio"), "{v:#}");
    assert!(v["ceiling_config"].as_str().unwrap().contains("bs="), "{v:#}");
    let arms = &v["arms"];
    assert_eq!(arms["fio"]["gbps"].as_f64().unwrap(), fio);
    assert_eq!(arms["fio"]["ratio_fio"].as_f64().unwrap(), 1.0);
    assert!(arms["engine"]["ratio_fio"].as_f64().unwrap() > 0.0, "{v:#}");
    assert!(arms["ceiling"]["ratio"].as_f64().unwrap() == 1.0);
    let run = &arms["fio"]["runs"][0];
    assert!(run["config"].as_str().unwrap().starts_with("rw="));
    let configs = run["fio"]["configs"].as_array().unwrap();
    assert!(configs.len() >= 8, "every fio invocation is listed: {run:#}");
    assert!(run["ceiling"].is_null() && arms["ceiling"]["runs"][0]["ceiling"]["drives"].is_array());
    // The figure is the sweep's best configuration run again (one run, as
    // the engine's), and the sweep's own largest figure stays beside it.
    assert_eq!(v["sweep_figure"], "rerun", "{v:#}");
    assert_eq!(
        run["sweep_max_gbps"].as_f64().unwrap(),
        run["fio"]["gbps"].as_f64().unwrap(),
        "{run:#}"
    );
    assert_eq!(run["config"], run["fio"]["best_label"], "{run:#}");
    assert_eq!(
        v["fio_sweep_max_gbps"].as_f64().unwrap(),
        run["fio"]["gbps"].as_f64().unwrap()
    );
    let c = &arms["ceiling"]["runs"][0];
    assert_eq!(
        c["sweep_max_gbps"].as_f64().unwrap(),
        c["ceiling"]["gbps"].as_f64().unwrap(),
        "{c:#}"
    );
    assert!(c["gbps"].as_f64().unwrap() > 0.0, "{c:#}");
    assert!(v["warnings"].is_array(), "{v:#}");
    let notes = v["notes"].as_array().unwrap();
    assert!(
        notes.iter().all(|n| n.as_str().unwrap().contains("huge pages")),
        "the only note says the ceiling's buffers differ from fio's: {v:#}"
    );
}

#[test]
fn sweep_figure_max_reports_the_sweeps_largest_figure_itself() {
    let Some((_tmp, dir)) = fio_model() else { return };
    let (v, stderr) = common::run_json(&[
        OsStr::new("bench"),
        dir.as_os_str(),
        OsStr::new("--arms"),
        OsStr::new("ceiling,fio"),
        OsStr::new("--runs"),
        OsStr::new("1"),
        OsStr::new("--sweep-figure"),
        OsStr::new("max"),
        OsStr::new("--json"),
    ]);
    assert_eq!(v["sweep_figure"], "max", "{v:#}\n{stderr}");
    for arm in ["fio", "ceiling"] {
        let run = &v["arms"][arm]["runs"][0];
        assert!(run["sweep_max_gbps"].is_null(), "{run:#}");
        assert_eq!(
            run["gbps"].as_f64().unwrap(),
            run[arm]["gbps"].as_f64().unwrap(),
            "{run:#}"
        );
    }
    assert!(
        v["fio_sweep_max_gbps"].is_null() && v["ceiling_sweep_max_gbps"].is_null(),
        "{v:#}"
    );
}

#[test]
fn without_fio_the_arm_is_skipped_with_a_note_never_silently() {
    let tmp = common::tempdir();
    if !can_measure(tmp.path()) {
        return;
    }
    let dir = tmp.path().join("m");
    small_model(&dir);
    let empty = tmp.path().join("empty-path");
    std::fs::create_dir(&empty).unwrap();
    let out = common::run_with_env(
        &[
            OsStr::new("bench"),
            dir.as_os_str(),
            OsStr::new("--arms"),
            OsStr::new("ceiling,fio"),
            OsStr::new("--runs"),
            OsStr::new("1"),
        ],
        &[("PATH", empty.as_os_str())],
    );
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert!(out.status.success(), "{stderr}");
    assert!(
        stdout.contains("note: fio arm skipped: fio is not installed"),
        "{stdout}"
    );
    assert!(stderr.contains("fio arm skipped"), "the warning: {stderr}");
    assert!(!stdout.contains("ratio_fio") || stdout.contains("-"), "{stdout}");
}

/// Root only: two fast drives (zram): each measured alone, then both at
/// once with their best configurations.
#[test]
fn zram_drives_are_measured_alone_then_together() {
    let Some(drives) = common::SimDrives::up(2, "zram", "0") else {
        return;
    };
    let mut files = Vec::new();
    for (i, m) in drives.mounts.iter().enumerate() {
        let p = m.join(format!("f{i}"));
        std::fs::write(&p, common::content(i as u64, 64 << 20)).unwrap();
        files.push(p);
    }
    let t0 = Instant::now();
    let (v, _) = common::run_json(&args(&["ceiling", "--quick", "--json"], &files));
    eprintln!("quick sweep on two zram drives: {:?}", t0.elapsed());
    let ds = v["drives"].as_array().unwrap();
    assert_eq!(ds.len(), 2, "{v:#}");
    for d in ds {
        check_drive(d, 8);
        assert!(d["together_gbps"].as_f64().unwrap() > 0.0, "{d:#}");
    }
    assert!(v["gbps"].as_f64().unwrap() > 0.0);
}

/// `load-ceiling`: the model's bytes over the largest of fio's read, the
/// fault-in of as much fresh memory and their busy CPU over the CPUs, each
/// part reported; the bound named is the part that set it.
#[test]
fn the_load_ceiling_is_the_slowest_of_its_three_parts() {
    let Some((_tmp, dir)) = fio_model() else { return };
    let (v, stderr) = common::run_json(&[
        OsStr::new("load-ceiling"),
        dir.as_os_str(),
        OsStr::new("--fault-rounds"),
        OsStr::new("1"),
        OsStr::new("--json"),
    ]);
    let model = weightstream::Model::open(weightstream::ModelConfig::new(&dir)).unwrap();
    let bytes = model.catalog().total_bytes();
    assert_eq!(v["bytes"].as_u64(), Some(bytes), "{v:#}\n{stderr}");
    let f = |p: &str| {
        v.pointer(p)
            .and_then(|x| x.as_f64())
            .unwrap_or_else(|| panic!("{p}: {v:#}"))
    };
    let (read, fault, cpu, seconds) = (f("/fio/seconds"), f("/fault/seconds"), f("/cpu/seconds"), f("/seconds"));
    assert!(read > 0.0 && fault > 0.0 && cpu >= 0.0, "{v:#}");
    assert_eq!(seconds, read.max(fault).max(cpu), "{v:#}");
    let bound = v["bound"].as_str().unwrap();
    let by = match bound {
        "read" => read,
        "fault" => fault,
        "cpu" => cpu,
        other => panic!("bound {other}"),
    };
    assert_eq!(by, seconds, "{v:#}");
    assert!((f("/gbps") - bytes as f64 / 1e9 / seconds).abs() < 1e-9 * f("/gbps").max(1.0));
    // The read part is fio's best over its sweep, scaled to the model.
    assert_eq!(f("/read_ceiling_gbps"), f("/fio/gbps"));
    assert!((read - bytes as f64 / 1e9 / f("/fio/gbps")).abs() < 1e-9, "{v:#}");
    assert!(v["fio"]["best_label"].as_str().unwrap().starts_with("rw="));
    // The CPU part is both parts' busy time over the CPUs.
    let busy = f("/fio/busy_cpu_seconds") + f("/fault/busy_cpu_seconds");
    assert!((f("/cpu/busy_cpu_seconds") - busy).abs() < 1e-9, "{v:#}");
    assert!((cpu - busy / v["cpu"]["cpus"].as_f64().unwrap()).abs() < 1e-9, "{v:#}");
    // Both page sizes were tried; the faster one is reported.
    let runs = v["fault"]["runs"].as_array().unwrap();
    let kinds: std::collections::BTreeSet<&str> = runs.iter().map(|r| r["pages"].as_str().unwrap()).collect();
    assert_eq!(kinds, ["4k", "thp"].into_iter().collect(), "{v:#}");
    let fastest = runs
        .iter()
        .map(|r| r["seconds"].as_f64().unwrap())
        .fold(f64::MAX, f64::min);
    assert_eq!(fault, fastest, "{v:#}");
    assert!(runs.iter().all(|r| r["bytes"].as_u64().unwrap() >= bytes), "{v:#}");
    assert_eq!(v["drives"].as_array().unwrap().len(), 1, "{v:#}");

    // The text form names the bound and the three parts.
    let out = common::run(&[
        OsStr::new("load-ceiling"),
        dir.as_os_str(),
        OsStr::new("--fault-rounds"),
        OsStr::new("1"),
    ]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    for part in [
        "load ceiling of",
        "set by the",
        "read:",
        "fault:",
        "cpu:",
        "already faulted",
    ] {
        assert!(text.contains(part), "{part} missing: {text}");
    }
}
