//! `ModelConfig::from_env` (FIELD-NOTES "Split directories", "Mirrors"):
//! `WEIGHTSTREAM_MODEL` is required (unset or blank is an error naming it);
//! `WEIGHTSTREAM_MODEL_DIRS` and `WEIGHTSTREAM_MIRROR` are `;`- or
//! `,`-separated, trimmed, empty entries dropped; `WEIGHTSTREAM_DISK_WEIGHTS`
//! takes `1,1`-style lists, `probe` or `equal`, and refuses non-positive or
//! unparsable weights; `WEIGHTSTREAM_ROUTE` takes hash, stripe or adaptive
//! (any case, trimmed); `WEIGHTSTREAM_DIRECT` auto, on or off; blank
//! variables mean unset. A config from the environment opens a model with
//! its mirrors, weights and route. And the test helpers' hermetic
//! environment really strips every one of these variables from the binary.
//!
//! The environment is process-global, so every case runs in one test
//! function, in order.

mod common;

use std::ffi::OsStr;
use std::path::PathBuf;

use weightstream::{DirectMode, Error, Model, ModelConfig, RoutePolicy, Weights};

use weightstream::env;

/// The variables `ModelConfig::from_env` reads (names from the library's table).
const VARS: [&str; 6] = [
    env::MODEL,
    env::MODEL_DIRS,
    env::MIRROR,
    env::DISK_WEIGHTS,
    env::ROUTE,
    env::DIRECT,
];

fn clear() {
    for k in VARS {
        std::env::remove_var(k);
    }
}

fn with(vars: &[(&str, &str)]) -> Result<ModelConfig, Error> {
    clear();
    for (k, v) in vars {
        std::env::set_var(k, v);
    }
    ModelConfig::from_env()
}

fn ok(vars: &[(&str, &str)]) -> ModelConfig {
    with(vars).unwrap_or_else(|e| panic!("{vars:?}: {e}"))
}

fn err(vars: &[(&str, &str)], needles: &[&str]) {
    match with(vars) {
        Ok(c) => panic!("{vars:?} accepted: {c:?}"),
        Err(e) => {
            assert!(matches!(e, Error::Config(_)), "{vars:?}: {e:?}");
            let msg = e.to_string();
            for n in needles {
                assert!(msg.contains(n), "{vars:?}: {n:?} not in {msg:?}");
            }
        }
    }
}

fn paths(v: &[&str]) -> Vec<PathBuf> {
    v.iter().map(PathBuf::from).collect()
}

const M: (&str, &str) = ("WEIGHTSTREAM_MODEL", "/models/m");

#[test]
fn model_config_from_the_environment() {
    // The primary is required.
    err(&[], &["WEIGHTSTREAM_MODEL is not set"]);
    err(&[("WEIGHTSTREAM_MODEL", "   ")], &["WEIGHTSTREAM_MODEL is not set"]);
    err(
        &[("WEIGHTSTREAM_MIRROR", "/m1"), ("WEIGHTSTREAM_ROUTE", "hash")],
        &["WEIGHTSTREAM_MODEL"],
    );

    // Defaults; the primary trimmed.
    let c = ok(&[("WEIGHTSTREAM_MODEL", "  /models/m \t")]);
    assert_eq!(c.primary, PathBuf::from("/models/m"));
    assert!(c.dirs.is_empty() && c.mirrors.is_empty(), "{c:?}");
    assert_eq!(c.weights, Weights::Equal);
    assert_eq!(c.route, RoutePolicy::Adaptive);
    assert_eq!(c.direct, DirectMode::Auto);

    // Lists: ; or , separated, trimmed, empty entries dropped, order kept.
    let c = ok(&[
        M,
        ("WEIGHTSTREAM_MODEL_DIRS", " /a ; /b,, /c ;"),
        ("WEIGHTSTREAM_MIRROR", "/m2,/m1"),
    ]);
    assert_eq!(c.dirs, paths(&["/a", "/b", "/c"]));
    assert_eq!(c.mirrors, paths(&["/m2", "/m1"]));
    let c = ok(&[M, ("WEIGHTSTREAM_MODEL_DIRS", " ; , "), ("WEIGHTSTREAM_MIRROR", "")]);
    assert!(c.dirs.is_empty() && c.mirrors.is_empty(), "{c:?}");
    // Entries are taken as typed; validation is Model::open's (below).
    let c = ok(&[M, ("WEIGHTSTREAM_MIRROR", "relative/m ; /with space/m")]);
    assert_eq!(c.mirrors, paths(&["relative/m", "/with space/m"]));

    // Weights.
    for (v, want) in [
        ("1,1", Weights::Explicit(vec![1.0, 1.0])),
        (" 9 ; 3 ", Weights::Explicit(vec![9.0, 3.0])),
        ("1,,2.5,", Weights::Explicit(vec![1.0, 2.5])),
        ("1000,1", Weights::Explicit(vec![1000.0, 1.0])),
        ("probe", Weights::Probe),
        (" PROBE ", Weights::Probe),
        ("equal", Weights::Equal),
        ("  ", Weights::Equal),
    ] {
        assert_eq!(ok(&[M, ("WEIGHTSTREAM_DISK_WEIGHTS", v)]).weights, want, "{v:?}");
    }
    for v in ["1,0", "1,-1", "x", "1,x", "nan", "inf", "1e999", "probe,1"] {
        err(&[M, ("WEIGHTSTREAM_DISK_WEIGHTS", v)], &["is not a positive number"]);
    }

    // Routes.
    for (v, want) in [
        ("hash", RoutePolicy::Hash),
        (" Stripe ", RoutePolicy::Stripe),
        ("ADAPTIVE", RoutePolicy::Adaptive),
        ("", RoutePolicy::Adaptive),
    ] {
        assert_eq!(ok(&[M, ("WEIGHTSTREAM_ROUTE", v)]).route, want, "{v:?}");
    }
    err(
        &[M, ("WEIGHTSTREAM_ROUTE", "fastest")],
        &["fastest", "expected hash, stripe or adaptive"],
    );
    err(
        &[M, ("WEIGHTSTREAM_ROUTE", "hash,stripe")],
        &["expected hash, stripe or adaptive"],
    );

    // Direct mode.
    for (v, want) in [
        ("off", DirectMode::Off),
        ("ON", DirectMode::On),
        ("auto", DirectMode::Auto),
    ] {
        assert_eq!(ok(&[M, ("WEIGHTSTREAM_DIRECT", v)]).direct, want, "{v:?}");
    }
    err(&[M, ("WEIGHTSTREAM_DIRECT", "maybe")], &["maybe"]);

    // A config from the environment opens a model: validation happens there.
    let tmp = common::tempdir();
    let primary = tmp.path().join("primary");
    common::synth_model(&primary, &common::small_synth_spec());
    let p = primary.to_str().unwrap();
    let e = Model::open(ok(&[("WEIGHTSTREAM_MODEL", p), ("WEIGHTSTREAM_MIRROR", "relative/m")])).unwrap_err();
    assert_eq!(
        e.to_string(),
        format!(
            "mirror directory \"relative/m\" ({}): does not exist: reconnect the drive, or remove this entry",
            std::env::current_dir().unwrap().join("relative/m").display()
        )
    );
    let shm = common::second_drive_tempdir();
    if let Some(shm) = &shm {
        let m = shm.path().join("mirror");
        let names = common::shard_names(&primary);
        common::copy_files(&primary, &m, &names.iter().map(String::as_str).collect::<Vec<_>>());
        let mirror_list = format!(" ; {} ,", m.display());
        let model = Model::open(ok(&[
            ("WEIGHTSTREAM_MODEL", p),
            ("WEIGHTSTREAM_MIRROR", &mirror_list),
            ("WEIGHTSTREAM_DISK_WEIGHTS", "1;3"),
            ("WEIGHTSTREAM_ROUTE", "stripe"),
        ]))
        .unwrap();
        assert_eq!(model.route(), RoutePolicy::Stripe);
        assert_eq!(model.rank_weights(), [1.0, 3.0]);
        assert_eq!(model.drives().len(), 2);
        for i in 0..model.catalog().shards().len() {
            assert_eq!(model.copies(i).len(), 2, "shard {i}");
        }
        // One weight per copy, or the open fails.
        let e = Model::open(ok(&[
            ("WEIGHTSTREAM_MODEL", p),
            ("WEIGHTSTREAM_MIRROR", &mirror_list),
            ("WEIGHTSTREAM_DISK_WEIGHTS", "1,1,1"),
        ]))
        .unwrap_err();
        assert!(e.to_string().contains("3 weight(s) given for 2 copies"), "{e}");
    }

    // The helpers' hermetic environment strips every variable: poisoned
    // values in this process never reach the binary.
    clear();
    for k in common::env_knobs() {
        std::env::set_var(k, "/nonexistent;bogus");
    }
    for k in VARS {
        assert!(
            common::env_knobs().contains(&k),
            "{k} is not stripped by common::hermetic"
        );
    }
    let out = common::run(&[OsStr::new("inspect"), primary.as_os_str(), OsStr::new("--json")]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "a variable leaked into the binary:\n{stderr}");
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["route"], "adaptive", "{v:#}");
    assert_eq!(v["weights"], serde_json::json!([1.0]), "{v:#}");
    let out = common::run(&[OsStr::new("digest"), primary.as_os_str()]);
    assert!(
        out.status.success(),
        "a variable leaked into the binary:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    for k in common::env_knobs() {
        std::env::remove_var(k);
    }
}
