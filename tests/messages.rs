//! What a user reads when a name or a filter is wrong (issue 19, part 4):
//!
//! - a tensor name that is not in the model suggests the nearest names
//!   (one `.`-separated part away, or a missing / extra `model.` prefix),
//!   at most [`weightstream::SUGGESTIONS`], nearest first, the rest counted;
//! - a filter that matches nothing (`Model::slot_spec_for_largest`, a part
//!   of `LoadOptions::names_containing`) is an error naming the filter;
//! - a tensor reference of another model is its own error, the name quoted
//!   alone and the explanation after it.

mod common;

use weightstream::{Engine, EngineConfig, Error, LoadOptions, Model, ModelConfig, SUGGESTIONS};
use weightstream_synth::SynthSpec;

fn synth(dir: &std::path::Path, layers: usize, experts: usize, seed: u64) -> Model {
    let spec = SynthSpec {
        layers,
        experts,
        expert_bytes: 4096,
        shards: 2,
        seed,
        ..SynthSpec::default()
    };
    common::synth_model(dir, &spec);
    Model::open(ModelConfig::new(dir)).unwrap()
}

/// The suggestions and the count of the rest for `name`.
fn near(model: &Model, name: &str) -> (Vec<String>, usize, String) {
    let err = model.tensor(name).unwrap_err();
    let msg = err.to_string();
    match err {
        Error::NoSuchTensor {
            name: n,
            suggestions,
            more,
        } => {
            assert_eq!(n, name);
            (suggestions, more, msg)
        }
        e => panic!("{name}: not NoSuchTensor: {e:?}"),
    }
}

#[test]
fn a_missing_tensor_suggests_the_nearest_names() {
    let tmp = common::tempdir();
    let model = synth(tmp.path(), 4, 8, 1);
    let x = |l: usize, e: usize, p: &str| format!("model.layers.{l}.mlp.experts.{e}.{p}.weight");

    // An expert number past the last: the nearest numbers, the rest counted.
    let (s, more, msg) = near(&model, &x(1, 99, "up_proj"));
    assert_eq!(
        s,
        [
            x(1, 7, "up_proj"),
            x(1, 6, "up_proj"),
            x(1, 5, "up_proj"),
            x(1, 4, "up_proj")
        ]
    );
    assert_eq!((s.len(), more), (SUGGESTIONS, 4));
    assert_eq!(
        msg,
        format!(
            "no tensor named {:?} in the model; did you mean {:?}, {:?}, {:?} or {:?}? (4 more names differ from it in one part)",
            x(1, 99, "up_proj"),
            s[0],
            s[1],
            s[2],
            s[3]
        )
    );
    // A layer number past the last.
    let (s, _, _) = near(&model, &x(9, 2, "down_proj"));
    assert_eq!(s[0], x(3, 2, "down_proj"));
    // A misspelt projection, and a Mixtral name for a Qwen model's.
    assert_eq!(near(&model, &x(0, 3, "gate_prj")).0[0], x(0, 3, "gate_proj"));
    assert_eq!(near(&model, &x(0, 3, "upproj")).0[0], x(0, 3, "up_proj"));
    // A missing `model.` prefix, and an extra one: the name itself first.
    let (s, _, msg) = near(&model, "layers.2.mlp.experts.5.up_proj.weight");
    assert_eq!(s[0], x(2, 5, "up_proj"));
    assert!(msg.contains(&format!("did you mean {:?}", x(2, 5, "up_proj"))), "{msg}");
    assert_eq!(
        near(&model, "model.model.embed_tokens.weight").0[0],
        "model.embed_tokens.weight"
    );
    // Both at once: no prefix and a number off.
    assert_eq!(
        near(&model, "layers.2.mlp.experts.8.up_proj.weight").0[0],
        x(2, 7, "up_proj")
    );
    // Nothing near: the plain message.
    let (s, more, msg) = near(&model, "vision_tower.patch_embed.proj");
    assert_eq!((s.len(), more), (0, 0));
    assert_eq!(msg, "no tensor named \"vision_tower.patch_embed.proj\" in the model");
    // The same answer every time.
    assert_eq!(
        near(&model, &x(1, 99, "up_proj")).0,
        near(&model, &x(1, 99, "up_proj")).0
    );
    // `get` asks without suggestions.
    assert!(model.get(&x(1, 99, "up_proj")).is_none());
    assert_eq!(
        model.get(&x(1, 7, "up_proj")),
        Some(model.tensor(&x(1, 7, "up_proj")).unwrap())
    );
}

#[test]
fn a_filter_that_matches_nothing_is_an_error_naming_it() {
    let tmp = common::tempdir();
    let model = synth(tmp.path(), 2, 2, 2);
    let dir = tmp.path().display().to_string();

    let msg = model.slot_spec_for_largest("expertz").unwrap_err().to_string();
    assert!(
        msg.contains("slot_spec_for_largest(\"expertz\"): no tensor name contains \"expertz\"") && msg.contains(&dir),
        "{msg}"
    );
    let largest = model.catalog().largest(".experts.").unwrap() as usize;
    let spec = model.slot_spec_for_largest(".experts.").unwrap();
    assert!(spec.slot_len().unwrap() >= largest);

    // One part of several that matches nothing is named; the load does not
    // run with the others alone.
    let engine = Engine::new(&model, EngineConfig::default()).unwrap();
    let msg = engine
        .load_all(&LoadOptions::new().names_containing(["layers.1.", "lm_haed"]))
        .unwrap_err()
        .to_string();
    assert!(
        msg.contains("for \"lm_haed\": no tensor name contains it") && msg.contains(&dir),
        "{msg}"
    );
    assert!(engine
        .load_all(&LoadOptions::new().names_containing(["layers.1.", "embed"]))
        .is_ok());
}

#[test]
fn a_tensor_of_another_model_is_its_own_error_with_the_name_quoted_alone() {
    let tmp = common::tempdir();
    let (a_dir, b_dir) = (tmp.path().join("a"), tmp.path().join("b"));
    std::fs::create_dir_all(&a_dir).unwrap();
    std::fs::create_dir_all(&b_dir).unwrap();
    let a = synth(&a_dir, 2, 2, 3);
    let b = synth(&b_dir, 2, 3, 4);
    let foreign = b
        .catalog()
        .tensors()
        .iter()
        .find(|t| a.get(&t.name).is_some_and(|mine| mine != *t))
        .expect("a tensor named alike in both, placed differently");
    let arena = weightstream::Arena::new(weightstream::SlotSpec::new(foreign.len as usize + 8192), 1).unwrap();
    let err = a.read_sync(foreign, arena.take().unwrap()).unwrap_err();
    let msg = err.to_string();
    match &err {
        Error::ForeignTensor { name, model } => {
            assert_eq!(name, &foreign.name);
            assert_eq!(model, &a_dir);
        }
        e => panic!("not ForeignTensor: {e:?}"),
    }
    assert!(
        msg.starts_with(&format!(
            "tensor {:?}: this reference belongs to another model than the one opened from {}",
            foreign.name,
            a_dir.display()
        )),
        "{msg}"
    );
}
