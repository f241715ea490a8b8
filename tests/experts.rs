//! `Model::experts` (issue 19, part 5): one expert of a model, read through
//! an engine, is exactly that expert's bytes: the tensors the view names
//! (unfused: every tensor of `layers.L...experts.E.`, nothing else; fused:
//! row `E` of every `[E, ...]` tensor), the engine's byte counters moved by
//! exactly their sum, and every payload equal to the file's bytes there.
//! Plus the errors an engine meets: no experts, a layer or an expert out
//! of range.

mod common;

use common::Entry;
use weightstream::{BackendChoice, Engine, EngineConfig, Error, Expert, ExpertsError, Model, ModelConfig, TensorRef};
use weightstream_synth::SynthSpec;

/// Reads every tensor of `expert` through a fresh engine on `backend`;
/// checks each payload against the file and the engine's byte counters
/// against the expert's bytes. Returns the bytes the engine counted.
fn read_expert(model: &Model, expert: &Expert, backend: BackendChoice) -> u64 {
    let engine = Engine::new(model, EngineConfig::default().backend(backend)).unwrap();
    let before = engine.stats();
    let room: usize = expert
        .tensors()
        .map(|t| (t.len as usize + 2 * 4096).next_multiple_of(4096))
        .sum();
    let arena = engine.packed_arena(room + (1 << 16), false).unwrap();
    let reads: Vec<(&TensorRef, _)> = expert
        .tensors()
        .map(|t| (t, arena.take_for(t).expect("the arena holds the expert")))
        .collect();
    assert!(!reads.is_empty());
    let tickets = engine.read_batch(reads).unwrap();
    let mut payload = 0u64;
    for (t, ticket) in expert.tensors().zip(tickets) {
        let loaded = ticket.wait().unwrap_or_else(|e| panic!("{backend:?}: {}: {e}", t.name));
        let file = std::fs::read(&model.catalog().shards()[t.shard].path).unwrap();
        let want = &file[t.offset as usize..(t.offset + t.len) as usize];
        assert!(
            &loaded[..] == want,
            "{backend:?}: {} at {}: not the file's bytes",
            t.name,
            t.offset
        );
        payload += loaded.len() as u64;
    }
    let after = engine.stats();
    let counted = after.bytes - before.bytes;
    let by_drive: u64 = after
        .drives
        .iter()
        .zip(&before.drives)
        .map(|(a, b)| (a.bytes_direct + a.bytes_buffered) - (b.bytes_direct + b.bytes_buffered))
        .sum();
    assert_eq!(payload, expert.bytes(), "{backend:?}: payload of {}", expert.describe());
    assert_eq!(
        counted,
        expert.bytes(),
        "{backend:?}: bytes counted for {}",
        expert.describe()
    );
    assert_eq!(
        by_drive,
        expert.bytes(),
        "{backend:?}: direct + buffered bytes for {}",
        expert.describe()
    );
    counted
}

#[test]
fn one_unfused_expert_reads_exactly_its_bytes() {
    let tmp = common::tempdir();
    let spec = SynthSpec {
        layers: 3,
        experts: 4,
        expert_bytes: 40_000,
        shards: 2,
        seed: 19,
        ..SynthSpec::default()
    };
    common::synth_model(tmp.path(), &spec);
    let model = Model::open(ModelConfig::new(tmp.path())).unwrap();
    let experts = model.experts().unwrap();
    assert_eq!(experts.layer_count(), 3);
    let expert = experts.layer(1).unwrap().expert(2).unwrap();
    // Exactly the tensors of `layers.1...experts.2.`, nothing else.
    let mut want: Vec<&str> = model
        .catalog()
        .tensors()
        .iter()
        .map(|t| t.name.as_str())
        .filter(|n| n.starts_with("model.layers.1.mlp.experts.2."))
        .collect();
    want.sort();
    let mut got: Vec<&str> = expert.tensors().map(|t| t.name.as_str()).collect();
    got.sort();
    assert_eq!(got, want);
    assert_eq!(
        expert.projections().map(|(k, _)| k).collect::<Vec<_>>(),
        ["down_proj", "gate_proj", "up_proj"]
    );
    // Whole tensors: the catalog's own references.
    for t in expert.tensors() {
        assert_eq!(t, model.tensor(&t.name).unwrap());
    }
    for backend in common::engine_backend_choices() {
        read_expert(&model, expert, backend);
    }
}

const E: usize = 4;
const H: usize = 60;
const I: usize = 44;

/// A one-shard model of two fused MoE layers (GPT-OSS style): per layer a
/// router, `experts.gate_up_proj` `[E, 2I, H]`, its bias `[E, 2I]`,
/// `experts.down_proj` `[E, H, I]` and its bias `[E, H]`, all BF16, at
/// offsets that are not block-aligned.
fn fused_model(dir: &std::path::Path) {
    let mut entries = Vec::new();
    let mut at = 0u64;
    let mut add = |name: String, shape: Vec<usize>| {
        let len = shape.iter().product::<usize>() as u64 * 2;
        entries.push(Entry {
            name,
            dtype: "BF16".into(),
            shape,
            begin: at,
            end: at + len,
        });
        at += len;
    };
    add("model.embed_tokens.weight".into(), vec![37, H]);
    for l in 0..2 {
        let b = format!("model.layers.{l}.mlp.");
        add(format!("{b}router.weight"), vec![E, H]);
        add(format!("{b}experts.gate_up_proj"), vec![E, 2 * I, H]);
        add(format!("{b}experts.gate_up_proj_bias"), vec![E, 2 * I]);
        add(format!("{b}experts.down_proj"), vec![E, H, I]);
        add(format!("{b}experts.down_proj_bias"), vec![E, H]);
    }
    let header = common::header_json(&entries);
    common::write_container(
        &dir.join("model.safetensors"),
        header.as_bytes(),
        &common::content(0xf05e, at as usize),
    );
}

#[test]
fn one_fused_expert_reads_exactly_its_rows() {
    let tmp = common::tempdir();
    fused_model(tmp.path());
    let model = Model::open(ModelConfig::new(tmp.path())).unwrap();
    let layer = model.experts().unwrap().layer(1).unwrap();
    assert!(layer.is_fused());
    assert_eq!(layer.expert_count(), E);
    assert_eq!(
        layer.other_tensors().map(|(k, _)| k).collect::<Vec<_>>(),
        ["router.weight"]
    );
    let e = 2;
    let expert = layer.expert(e).unwrap();
    let gate_up = expert.projection("gate_up_proj").unwrap();
    assert_eq!(gate_up.parts().map(|(k, _)| k).collect::<Vec<_>>(), ["bias", "weight"]);
    assert_eq!(gate_up.companions().map(|(k, _)| k).collect::<Vec<_>>(), ["bias"]);
    // Each part is row `e` of its fused tensor: that row's bytes, no more.
    let mut rows = 0u64;
    for t in expert.tensors() {
        let whole = model.tensor(&t.name).unwrap();
        let row = whole.len / E as u64;
        assert_eq!((t.offset, t.len), (whole.offset + e as u64 * row, row), "{}", t.name);
        assert_eq!((t.shape[0], &t.shape[1..]), (1, &whole.shape[1..]), "{}", t.name);
        rows += row;
    }
    assert_eq!(rows, ((2 * I * H) + 2 * I + (H * I) + H) as u64 * 2);
    assert_eq!(expert.bytes(), rows);
    for backend in common::engine_backend_choices() {
        read_expert(&model, expert, backend);
    }
}

#[test]
fn a_model_without_experts_and_experts_out_of_range_are_errors_naming_why() {
    let dir = weightstream::__internal::doc_model("no-experts", &[("w", weightstream::Dtype::U8, 10)]).unwrap();
    let model = Model::open(ModelConfig::new(&dir)).unwrap();
    let err = model.experts().unwrap_err();
    assert!(
        matches!(&err, Error::Experts(ExpertsError::NoneRecognised { tensors: 1, .. })),
        "{err:?}"
    );
    let msg = err.to_string();
    assert!(
        msg.contains(&dir.display().to_string()) && msg.contains("no experts recognised") && msg.contains("\"w\""),
        "{msg}"
    );
    std::fs::remove_dir_all(&dir).unwrap();

    let tmp = common::tempdir();
    common::synth_model(tmp.path(), &common::small_synth_spec());
    let model = Model::open(ModelConfig::new(tmp.path())).unwrap();
    let experts = model.experts().unwrap();
    let msg = experts.layer(4).unwrap_err().to_string();
    assert!(
        msg.contains("layer 4 is out of range") && msg.contains("4 layer(s), 0 to 3"),
        "{msg}"
    );
    let msg = experts.expert(2, 3).unwrap_err().to_string();
    assert!(
        msg.contains("layer 2 has no expert 3") && msg.contains("3 routed expert(s), numbered 0 to 2"),
        "{msg}"
    );
    let msg = experts.expert(2, 0).unwrap().projection("w1").unwrap_err().to_string();
    assert!(
        msg.contains("no projection \"w1\"") && msg.contains("\"gate_proj\""),
        "{msg}"
    );
    // The view is made once and kept.
    assert!(std::ptr::eq(experts, model.experts().unwrap()));
}
