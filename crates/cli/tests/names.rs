//! File names that are not UTF-8 (issue 9, item 6): names stay `OsString`
//! / `Path` end to end and are shown escaped (`\xff`), never lossily.
//!
//! - two shards whose names differ only in invalid bytes are both found (in
//!   one directory, and across the primary and a split directory);
//! - a mirror copy with a non-UTF-8 name is found and proven; a refused one
//!   is reported under its escaped name;
//! - `weightstream inspect` (text and `--json`) and `digest` do not panic
//!   on such names or on a model directory whose own name is not UTF-8.

mod common;

use std::ffi::{OsStr, OsString};
use std::os::unix::ffi::{OsStrExt, OsStringExt};
use std::path::{Path, PathBuf};

use common::{container_bytes, header_json, Entry};
use weightstream::{Arena, Model, ModelConfig, SlotSpec};

/// `prefix` + the raw byte `b` + `.safetensors`.
fn raw_name(prefix: &str, b: u8) -> OsString {
    let mut v = prefix.as_bytes().to_vec();
    v.push(b);
    v.extend_from_slice(b".safetensors");
    OsString::from_vec(v)
}

fn shard(path: &Path, name: &str, len: usize, seed: u64) -> Vec<u8> {
    let header = header_json(&[Entry::u8(name, 0, len as u64)]);
    let data = common::content(seed, len);
    std::fs::write(path, container_bytes(header.as_bytes(), &data)).unwrap();
    data
}

fn read(model: &Model, name: &str) -> Vec<u8> {
    let t = model.tensor(name).unwrap_or_else(|e| panic!("{e}"));
    let arena = Arena::new(SlotSpec::new(t.len.max(1) as usize), 1).unwrap();
    model.read_sync(t, arena.take().unwrap()).unwrap().to_vec()
}

#[test]
fn shards_differing_only_in_invalid_bytes_are_both_found() {
    let tmp = common::tempdir();
    let dir = tmp.path();
    let one = shard(&dir.join(raw_name("a", 0xff)), "t1", 300, 1);
    let two = shard(&dir.join(raw_name("a", 0xfe)), "t2", 200, 2);
    let model = Model::open(ModelConfig::new(dir)).unwrap();
    assert_eq!(model.catalog().shards().len(), 2);
    assert_eq!(read(&model, "t1"), one);
    assert_eq!(read(&model, "t2"), two);
}

#[test]
fn split_directory_shard_differing_only_in_invalid_bytes_is_found() {
    let tmp = common::tempdir();
    let primary = tmp.path().join("primary");
    let split = tmp.path().join("split");
    std::fs::create_dir_all(&primary).unwrap();
    std::fs::create_dir_all(&split).unwrap();
    let one = shard(&primary.join(raw_name("a", 0xff)), "t1", 300, 1);
    let two = shard(&split.join(raw_name("a", 0xfe)), "t2", 200, 2);
    let model = Model::open(ModelConfig::new(&primary).dirs([&split])).unwrap();
    assert_eq!(model.catalog().shards().len(), 2, "one shard was taken for a duplicate");
    assert_eq!(read(&model, "t1"), one);
    assert_eq!(read(&model, "t2"), two);
}

#[test]
fn mirror_copy_with_a_non_utf8_name_is_found() {
    let tmp = common::tempdir();
    let primary = tmp.path().join("primary");
    let mirror = tmp.path().join("mirror");
    std::fs::create_dir_all(&primary).unwrap();
    std::fs::create_dir_all(&mirror).unwrap();
    let name = raw_name("m", 0xff);
    let data = shard(&primary.join(&name), "t", 5000, 3);
    std::fs::copy(primary.join(&name), mirror.join(&name)).unwrap();
    // A second shard whose mirror copy is refused (another size).
    let bad = raw_name("n", 0x80);
    shard(&primary.join(&bad), "u", 100, 4);
    shard(&mirror.join(&bad), "u", 101, 4);
    let model = Model::open(ModelConfig::new(&primary).mirrors([&mirror])).unwrap();
    let si = model
        .catalog()
        .shards()
        .iter()
        .position(|s| s.path.file_name() == Some(name.as_os_str()))
        .expect("the shard");
    assert_eq!(model.copies(si).len(), 2, "the mirror copy was not found");
    assert_eq!(read(&model, "t"), data);
    let refused: Vec<_> = model.copy_report().iter().filter(|c| !c.accepted).collect();
    assert_eq!(refused.len(), 1, "{:?}", model.copy_report());
    assert_eq!(refused[0].path, mirror.join(&bad));

    // The JSON report shows both names escaped.
    let (v, _) = common::run_json(&[
        OsStr::new("inspect"),
        primary.as_os_str(),
        OsStr::new("--mirror"),
        mirror.as_os_str(),
        OsStr::new("--json"),
    ]);
    let r = &v["refused_copies"][0];
    assert_eq!(r["shard"], "n\\x80.safetensors", "{v}");
    assert!(
        r["path"].as_str().unwrap().ends_with("/mirror/n\\x80.safetensors"),
        "{v}"
    );
    let shards = v["shards"].as_array().unwrap();
    let m = shards
        .iter()
        .find(|s| s["name"] == "m\\xff.safetensors")
        .expect("escaped name");
    assert_eq!(m["copies"].as_array().unwrap().len(), 2, "{m}");
}

/// A model directory whose own name is not UTF-8, holding shards whose
/// names differ only in invalid bytes: `inspect`, `inspect --json` and
/// `digest` succeed and show every name escaped.
#[test]
fn cli_shows_non_utf8_names_escaped_and_does_not_panic() {
    let tmp = common::tempdir();
    let mut d = tmp.path().as_os_str().as_bytes().to_vec();
    d.extend_from_slice(b"/model-\xe9");
    let dir = PathBuf::from(OsString::from_vec(d));
    std::fs::create_dir(&dir).unwrap();
    shard(&dir.join(raw_name("a", 0xff)), "t1", 300, 1);
    shard(&dir.join(raw_name("a", 0xfe)), "t2", 200, 2);

    let out = common::run(&[OsStr::new("inspect"), dir.as_os_str()]);
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert!(out.status.success(), "inspect failed: {stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
    for want in ["model-\\xe9", "a\\xff.safetensors", "a\\xfe.safetensors"] {
        assert!(stdout.contains(want), "inspect does not show {want}: {stdout}");
    }
    assert!(!stdout.contains('\u{fffd}'), "a lossy name: {stdout}");

    let out = common::run(&[OsStr::new("inspect"), dir.as_os_str(), OsStr::new("--json")]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "inspect --json failed: {stderr}");
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON");
    assert!(v["dir"].as_str().unwrap().ends_with("/model-\\xe9"), "{v}");
    let mut names: Vec<&str> = v["shards"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["name"].as_str().unwrap())
        .collect();
    names.sort();
    assert_eq!(names, ["a\\xfe.safetensors", "a\\xff.safetensors"], "{v}");
    for s in v["shards"].as_array().unwrap() {
        let p = s["path"].as_str().unwrap();
        assert!(p.contains("/model-\\xe9/a\\xf"), "{p}");
    }

    let out = common::run(&[OsStr::new("digest"), dir.as_os_str()]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let sums = common::parse_sums(&String::from_utf8(out.stdout).unwrap());
    assert_eq!(sums.keys().collect::<Vec<_>>(), ["t1", "t2"]);
}

/// A tensor name that is not in the model (issue 19): `digest --tensor`
/// says which names are nearest (a projection misspelt, a number out of
/// range, a missing `model.` prefix), and names the flag.
#[test]
fn digest_of_a_misspelt_tensor_suggests_the_nearest_names() {
    let tmp = common::tempdir();
    let spec = weightstream_synth::SynthSpec {
        layers: 2,
        experts: 2,
        expert_bytes: 4096,
        shards: 1,
        ..weightstream_synth::SynthSpec::default()
    };
    common::synth_model(tmp.path(), &spec);
    for (asked, nearest) in [
        (
            "model.layers.0.mlp.experts.1.up_prj.weight",
            "model.layers.0.mlp.experts.1.up_proj.weight",
        ),
        (
            "model.layers.0.mlp.experts.5.up_proj.weight",
            "model.layers.0.mlp.experts.1.up_proj.weight",
        ),
        ("layers.1.mlp.router.weight", "model.layers.1.mlp.router.weight"),
    ] {
        let out = common::run(&[
            OsStr::new("digest"),
            tmp.path().as_os_str(),
            OsStr::new("--tensor"),
            OsStr::new(asked),
        ]);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success() && out.stdout.is_empty(), "{stderr}");
        assert!(
            stderr.contains(&format!(
                "--tensor {asked:?}: no tensor named {asked:?} in the model; did you mean {nearest:?}"
            )),
            "{stderr}"
        );
    }
}
