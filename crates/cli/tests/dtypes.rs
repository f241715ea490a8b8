//! Dtypes in step with the reference (issue 9, "Also"): every file the
//! reference reader (the Python `safetensors` package) accepts is read with
//! the same bytes, and every file it refuses is refused by name.
//!
//! `tests/reference/ref_dtypes.py` asks the installed package for its
//! reader's dtype list and bit sizes, writes one file per dtype (with the
//! reference writer where it takes the dtype, by hand where only the reader
//! knows it), reads each back with the reference reader and hashes every
//! tensor; it also writes files the reference refuses (unknown or misspelt
//! dtypes, sub-byte dtypes whose bits do not fill whole bytes, dtype x
//! shape != byte length, an overflowing shape, ...).
//!
//! Checked here: `weightstream::Dtype` covers exactly the reader's list
//! with the same bit sizes; `weightstream digest` of the accepted files
//! equals the reference's sha256 of every tensor, and the catalog has the
//! same dtype and shape; every refused file is refused by `digest` (exit 1)
//! and by `Model::open`, each error naming the file.
//!
//! Without python3 or its `safetensors`/`numpy` modules the test prints a
//! skip notice and passes, unless `WEIGHTSTREAM_REQUIRE_REFERENCE=1`.

mod common;

use std::collections::BTreeMap;
use std::ffi::OsStr;
use std::path::Path;
use std::process::Command;

use weightstream::{Dtype, Model, ModelConfig};

/// The script's JSON, or `None` (with a SKIP notice) when the reference is
/// missing and not required.
fn reference(out: &Path) -> Option<serde_json::Value> {
    let script = common::lib_tests_dir().join("reference/ref_dtypes.py");
    let unavailable = |why: String| {
        if common::reference_required() {
            panic!(
                "{}=1 but the reference is unavailable: {why}",
                common::REQUIRE_REFERENCE
            );
        }
        eprintln!(
            "SKIP dtype reference comparison: {why} (install python3 with `safetensors` and `numpy`; \
             set {}=1 to make this a failure)",
            common::REQUIRE_REFERENCE
        );
        None
    };
    let o = match Command::new("python3").arg(&script).arg(out).output() {
        Ok(o) => o,
        Err(e) => return unavailable(format!("cannot run python3: {e}")),
    };
    let stderr = String::from_utf8_lossy(&o.stderr);
    match o.status.code() {
        Some(0) => {}
        Some(3) => return unavailable(stderr.trim().to_string()),
        _ => panic!("{} failed ({}):\n{stderr}", script.display(), o.status),
    }
    Some(serde_json::from_slice(&o.stdout).expect("the script prints JSON"))
}

#[test]
fn every_reference_dtype_is_read_with_the_same_bytes_and_every_refusal_names_the_file() {
    let tmp = common::tempdir();
    let Some(r) = reference(tmp.path()) else { return };
    eprintln!("reference safetensors {}", r["version"]);

    // 1. The dtype list and bit sizes are the reference reader's, exactly.
    let reader: Vec<(String, u64)> = r["reader_dtypes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| (p[0].as_str().unwrap().to_string(), p[1].as_u64().unwrap()))
        .collect();
    assert!(reader.len() >= 22, "{reader:?}");
    for (name, bits) in &reader {
        let d: Dtype = name
            .parse()
            .unwrap_or_else(|e| panic!("the reference reads {name}; weightstream does not: {e}"));
        assert_eq!(d.name(), name);
        assert_eq!(u64::from(d.bits()), *bits, "{name}: element bits");
    }
    let ours: Vec<&str> = Dtype::ALL.iter().map(|d| d.name()).collect();
    let theirs: Vec<&str> = reader.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(ours, theirs, "weightstream's dtypes differ from the reference reader's");

    // 2. Every accepted file opens, with the reference's dtypes, shapes and bytes.
    let accepted_dir = tmp.path().join("accepted");
    let mut want: BTreeMap<String, String> = BTreeMap::new();
    let mut meta: BTreeMap<String, (String, Vec<usize>)> = BTreeMap::new();
    for (_file, tensors) in r["accepted"].as_object().unwrap() {
        for (name, t) in tensors.as_object().unwrap() {
            want.insert(name.clone(), t["sha256"].as_str().unwrap().to_string());
            let shape = t["shape"]
                .as_array()
                .unwrap()
                .iter()
                .map(|d| d.as_u64().unwrap() as usize);
            meta.insert(
                name.clone(),
                (t["dtype"].as_str().unwrap().to_string(), shape.collect()),
            );
        }
    }
    assert_eq!(r["accepted"].as_object().unwrap().len(), reader.len());
    let model = Model::open(ModelConfig::new(&accepted_dir)).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(model.catalog().shards().len(), reader.len());
    for t in model.catalog().tensors() {
        let (dtype, shape) = &meta[&t.name];
        assert_eq!((t.dtype.name(), &t.shape), (dtype.as_str(), shape), "{}", t.name);
    }
    drop(model);
    for backend in ["sync", "pread"] {
        let out = common::run(&[
            OsStr::new("digest"),
            accepted_dir.as_os_str(),
            OsStr::new("--backend"),
            OsStr::new(backend),
        ]);
        assert!(
            out.status.success(),
            "digest --backend {backend}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let got = common::parse_sums(&String::from_utf8(out.stdout).unwrap());
        assert_eq!(
            got, want,
            "digest --backend {backend} differs from the reference reader"
        );
    }

    // 3. Every refused file is refused, naming the file.
    let refused = r["refused"].as_object().unwrap();
    assert!(refused.len() >= 10, "{refused:?}");
    for (case, v) in refused {
        let file = Path::new(v["file"].as_str().unwrap());
        let dir = file.parent().unwrap();
        let out = common::run(&[OsStr::new("digest"), dir.as_os_str()]);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{case}: digest did not refuse it: {stderr}");
        assert!(!stderr.contains("panicked"), "{case}: {stderr}");
        assert!(
            stderr.contains(&file.display().to_string()),
            "{case}: the error does not name the file: {stderr}"
        );
        let err = Model::open(ModelConfig::new(dir)).expect_err(case).to_string();
        assert!(err.contains(&file.display().to_string()), "{case}: {err}");
        eprintln!("{case}: {err}\n  (reference: {})", v["error"].as_str().unwrap());
    }
}
