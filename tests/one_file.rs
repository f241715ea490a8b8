//! One `.safetensors` file opened on its own (`ModelConfig::file`,
//! `ModelConfig::only`), as Python's `safe_open(path)` does: only that
//! file's tensors, the directory's index ignored, its mirror copy used,
//! and a file that is not there named in the error.

mod common;

use weightstream::{Engine, EngineConfig, Model, ModelConfig};
use weightstream_synth::SynthSpec;

fn model(dir: &std::path::Path) {
    let spec = SynthSpec {
        layers: 3,
        experts: 2,
        expert_bytes: 8192,
        shards: 3,
        seed: 9,
        ..SynthSpec::default()
    };
    common::synth_model(dir, &spec);
}

fn shards(dir: &std::path::Path) -> Vec<std::ffi::OsString> {
    let mut v: Vec<_> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .filter(|n| n.to_string_lossy().ends_with(".safetensors"))
        .collect();
    v.sort();
    v
}

#[test]
fn one_file_has_exactly_its_own_tensors_with_the_same_bytes() {
    let tmp = common::tempdir();
    let dir = tmp.path().join("m");
    model(&dir);
    // An index naming every shard, as real checkpoints have (kept or
    // written): ignored when one file is opened on its own.
    let names = shards(&dir);
    assert_eq!(names.len(), 3);
    let whole = Model::open(ModelConfig::new(&dir)).unwrap();
    let whole_engine = Engine::new(&whole, EngineConfig::default()).unwrap();
    for (k, name) in names.iter().enumerate() {
        let one = Model::open(ModelConfig::file(dir.join(name))).unwrap();
        assert_eq!(one.catalog().shards().len(), 1);
        let want: Vec<&str> = whole
            .catalog()
            .tensors()
            .iter()
            .filter(|t| t.shard == k)
            .map(|t| t.name.as_str())
            .collect();
        let got: Vec<&str> = one.catalog().tensors().iter().map(|t| t.name.as_str()).collect();
        assert_eq!(got, want, "{name:?}");
        let engine = Engine::new(&one, EngineConfig::default()).unwrap();
        for t in one.catalog().tensors() {
            let w = whole.tensor(&t.name).unwrap();
            assert_eq!((t.offset, t.len, t.dtype), (w.offset, w.len, w.dtype), "{}", t.name);
            let a = engine.packed_arena_for(&[t], 1, false).unwrap();
            let got = engine.read(t, a.take_for(t).unwrap()).unwrap().wait().unwrap();
            let b = whole_engine.packed_arena_for(&[w], 1, false).unwrap();
            let exp = whole_engine.read(w, b.take_for(w).unwrap()).unwrap().wait().unwrap();
            assert_eq!(got.bytes(), exp.bytes(), "{}", t.name);
        }
    }
}

#[test]
fn a_file_opened_alone_uses_its_mirror_copy_and_a_missing_one_is_named() {
    let tmp = common::tempdir();
    let dir = tmp.path().join("m");
    model(&dir);
    let mirror = tmp.path().join("mirror");
    std::fs::create_dir(&mirror).unwrap();
    let names = shards(&dir);
    for n in &names {
        std::fs::copy(dir.join(n), mirror.join(n)).unwrap();
    }
    let one = Model::open(ModelConfig::file(dir.join(&names[1])).mirrors([&mirror])).unwrap();
    assert_eq!(one.catalog().shards().len(), 1);
    assert_eq!(one.copies(0).len(), 2, "the primary file and its mirror copy");

    let err = Model::open(ModelConfig::file(dir.join("model-00009-of-00009.safetensors"))).unwrap_err();
    let msg = err.to_string();
    assert!(msg.contains("model-00009-of-00009.safetensors"), "{msg}");
    assert!(msg.contains("no such"), "{msg}");
    // Several files at once: only those.
    let two = Model::open(ModelConfig::new(&dir).only([names[0].clone(), names[2].clone()])).unwrap();
    assert_eq!(two.catalog().shards().len(), 2);
}
