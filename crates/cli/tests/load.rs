//! `weightstream load`: every method ends with the reference reader's bytes
//! (the reference writer's shards: odd sizes, unaligned offsets), on both
//! engine backends and with a chosen alignment; `--json` reports what the
//! load cost; `--name` filters; the sync backend is refused with a reason.

mod common;

use std::ffi::OsStr;
use std::path::Path;

fn load_json(dir: &Path, extra: &[&str]) -> serde_json::Value {
    let mut args: Vec<&OsStr> = vec![OsStr::new("load"), dir.as_os_str(), OsStr::new("--json")];
    args.extend(extra.iter().map(OsStr::new));
    common::run_json(&args).0
}

fn sums(v: &serde_json::Value) -> std::collections::BTreeMap<String, String> {
    v["tensors_sha256"]
        .as_object()
        .expect("--digest puts tensors_sha256 in the JSON")
        .iter()
        .map(|(k, h)| (k.clone(), h.as_str().unwrap().to_string()))
        .collect()
}

#[test]
fn every_method_loads_the_reference_bytes() {
    let tmp = common::tempdir();
    let dir = tmp.path().join("m");
    let want = match common::reference_or_synth(&dir) {
        Some(w) => w,
        // Without the reference: the sync path's digests.
        None => common::json_sums(
            &common::run_json(&[
                OsStr::new("digest"),
                dir.as_os_str(),
                OsStr::new("--json"),
                OsStr::new("--backend"),
                OsStr::new("sync"),
            ])
            .0,
        ),
    };
    let mut arms: Vec<Vec<&str>> = vec![
        vec!["--method", "safetensors-mmap"],
        vec!["--method", "fs-read"],
        vec!["--method", "mmap"],
        vec!["--backend", "pread"],
        vec!["--backend", "pread", "--align", "4096", "--order", "size"],
    ];
    if common::uring_available() {
        arms.push(vec!["--backend", "uring"]);
        arms.push(vec!["--backend", "uring", "--align", "64", "--populate", "--register"]);
        // Into memory a previous load wrote (Engine::load_all_into).
        arms.push(vec!["--backend", "uring", "--memory", "reused"]);
        // Into memory faulted in, never read into.
        arms.push(vec!["--backend", "uring", "--memory", "faulted"]);
    }
    arms.push(vec!["--backend", "pread", "--memory", "reused", "--align", "64"]);
    arms.push(vec!["--backend", "pread", "--memory", "faulted"]);
    let total: u64 = want.len() as u64;
    for extra in arms {
        let mut a = extra.clone();
        a.push("--digest");
        let v = load_json(&dir, &a);
        assert_eq!(sums(&v), want, "{extra:?}");
        assert_eq!(v["tensors"].as_u64(), Some(total), "{extra:?}");
        assert!(v["seconds"].as_f64().unwrap() > 0.0 && v["peak_rss_bytes"].as_u64().unwrap() > 0);
        // The machine's busy CPU over the timed region holds its steal.
        let (busy, steal) = (
            v["busy_cpu_seconds"].as_f64().unwrap(),
            v["steal_seconds"].as_f64().unwrap(),
        );
        assert!(busy >= 0.0 && (0.0..=busy).contains(&steal), "{v}");
        if !extra.contains(&"--method") {
            assert_eq!(v["method"], "weightstream");
            let r = &v["report"];
            let (in_place, placed) = (r["in_place"].as_u64().unwrap(), r["placed"].as_u64().unwrap());
            assert!(in_place + placed > 0 && in_place + placed <= total, "{r}");
            if !extra.contains(&"4096") {
                assert!(in_place > 0, "{extra:?}: {r}");
            }
            assert_eq!(
                v["stats"]["backend"].as_str().unwrap(),
                extra[1],
                "the backend asked for ran"
            );
            let memory = if extra.contains(&"reused") {
                "reused"
            } else if extra.contains(&"faulted") {
                "faulted"
            } else {
                "fresh"
            };
            assert_eq!(v["memory"], memory, "{extra:?}");
            assert_eq!(r["given_memory"].as_bool(), Some(memory != "fresh"), "{r}");
            // Only reused memory had a first load.
            assert_eq!(v["first_load_seconds"].is_f64(), memory == "reused", "{v}");
        }
    }
}

#[test]
fn names_filter_and_text_output() {
    let tmp = common::tempdir();
    let dir = tmp.path().join("m");
    common::synth_model(&dir, &common::small_synth_spec());
    let v = load_json(&dir, &["--name", "layers.0.", "--digest"]);
    let s = sums(&v);
    assert!(!s.is_empty() && s.keys().all(|k| k.contains("layers.0.")), "{s:?}");
    let out = common::run(&[OsStr::new("load"), dir.as_os_str()]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(
        text.contains("GB/s") && text.contains("peak RSS") && text.contains("in place"),
        "{text}"
    );

    let out = common::run(&[
        OsStr::new("load"),
        dir.as_os_str(),
        OsStr::new("--backend"),
        OsStr::new("sync"),
    ]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("sync backend"));
    let out = common::run(&[
        OsStr::new("load"),
        dir.as_os_str(),
        OsStr::new("--align"),
        OsStr::new("3"),
    ]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("power of two"));
}
