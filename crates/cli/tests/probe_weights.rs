//! `--weights probe`: each copy rank is measured at open with a short
//! O_DIRECT read and the GB/s become the weights; the bytes stay the same.

mod common;

use std::ffi::OsStr;

#[test]
fn probe_measures_one_positive_weight_per_copy_rank() {
    let Some(second) = common::second_drive_tempdir() else {
        return;
    };
    let tmp = common::tempdir();
    let primary = tmp.path().join("model");
    common::synth_model(&primary, &common::small_synth_spec());
    let names = common::shard_names(&primary);
    let names: Vec<&str> = names.iter().map(String::as_str).collect();
    let mirror = second.path().join("mirror");
    common::copy_files(&primary, &mirror, &names);
    let args = [
        OsStr::new("inspect"),
        primary.as_os_str(),
        OsStr::new("--mirror"),
        mirror.as_os_str(),
        OsStr::new("--weights"),
        OsStr::new("probe"),
        OsStr::new("--json"),
    ];
    let (v, _) = common::run_json(&args);
    let w: Vec<f64> = v["weights"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_f64().unwrap())
        .collect();
    assert_eq!(w.len(), 2, "one weight per copy rank: {v:#}");
    assert!(
        w.iter().all(|&x| x > 0.0 && x.is_finite()),
        "probed GB/s must be positive: {w:?}"
    );
    assert!(w != [1.0, 1.0], "the probe measured nothing: {w:?}");
    // Same bytes with probed weights, on every route.
    let reference = common::run(&[
        OsStr::new("digest"),
        primary.as_os_str(),
        OsStr::new("--backend"),
        OsStr::new("sync"),
    ]);
    assert!(reference.status.success());
    for route in ["hash", "stripe", "adaptive"] {
        let out = common::run(&[
            OsStr::new("digest"),
            primary.as_os_str(),
            OsStr::new("--mirror"),
            mirror.as_os_str(),
            OsStr::new("--weights"),
            OsStr::new("probe"),
            OsStr::new("--route"),
            OsStr::new(route),
            OsStr::new("--chunk"),
            OsStr::new("16KiB"),
        ]);
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        assert_eq!(
            out.stdout, reference.stdout,
            "route {route}: digests differ with probed weights"
        );
    }
}
