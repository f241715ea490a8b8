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
    assert!(msg.contains("No such file"), "{msg}");
    assert!(matches!(err, weightstream::Error::Io { ref source, .. } if source.kind() == std::io::ErrorKind::NotFound));
    // Several files at once: only those.
    let two = Model::open(ModelConfig::new(&dir).only([names[0].clone(), names[2].clone()])).unwrap();
    assert_eq!(two.catalog().shards().len(), 2);
}

/// A file is what it is, whatever its name: one without the `.safetensors`
/// suffix (a `NamedTemporaryFile`) opens on its own, in a folder holding
/// no shard; its folder's other entries are never looked at (a dangling
/// `*.safetensors` link beside it changes nothing). A name that is not a
/// regular file is refused naming it.
#[test]
fn a_file_opens_by_what_it_is_not_by_its_suffix() {
    let tmp = common::tempdir();
    let dir = tmp.path().join("m");
    common::synth_model(&dir, &common::small_synth_spec());
    let first = shards(&dir).remove(0);
    let plain = tmp.path().join("loose");
    std::fs::create_dir(&plain).unwrap();
    let odd = plain.join("tmpk3x9_q");
    std::fs::copy(dir.join(&first), &odd).unwrap();
    std::os::unix::fs::symlink(plain.join("gone"), plain.join("dangling.safetensors")).unwrap();
    let a = Model::open(ModelConfig::file(&odd)).unwrap();
    let b = Model::open(ModelConfig::file(dir.join(&first))).unwrap();
    let names = |m: &Model| {
        m.catalog()
            .tensors()
            .iter()
            .map(|t| (t.name.clone(), t.len))
            .collect::<Vec<_>>()
    };
    assert_eq!(names(&a), names(&b));
    assert_eq!(a.catalog().shards()[0].path, odd);
    // A folder given as a file, and a FIFO, are refused naming them.
    let sub = plain.join("sub.safetensors");
    std::fs::create_dir(&sub).unwrap();
    let e = Model::open(ModelConfig::file(&sub)).unwrap_err().to_string();
    assert!(e.contains("sub.safetensors") && e.contains("not a regular file"), "{e}");
    let fifo = plain.join("pipe");
    let c = std::ffi::CString::new(fifo.as_os_str().as_encoded_bytes()).unwrap();
    // SAFETY: a NUL-terminated path; mkfifo only creates the node.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
    let e = Model::open(ModelConfig::file(&fifo)).unwrap_err().to_string();
    assert!(e.contains("pipe") && e.contains("not a regular file"), "{e}");
}
