//! A mixture-of-experts decode loop: each step reads the experts its router
//! picked, for every layer, with one `read_batch` into one packed arena,
//! and computes on them (here: checks their bytes) while nothing else is
//! allocated.
//!
//! cargo run --release --example decode_loop -- [MODEL_DIR] [STEPS]
//!
//! Without a directory it writes a small synthetic model (8 layers of 8
//! experts) to a temporary directory and checks every byte it reads.

use std::time::Instant;

use weightstream::{Engine, EngineConfig, Expert, ExpertLayer, Model, ModelConfig, TensorRef};
use weightstream_synth::{self as synth, SynthSpec};

/// Experts the router picks per layer and step.
const TOP_K: usize = 2;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let (dir, _tmp, spec) = match args.next() {
        Some(d) => (std::path::PathBuf::from(d), None, None),
        None => {
            let tmp = tempfile::tempdir()?;
            let spec = SynthSpec {
                layers: 8,
                experts: 8,
                expert_bytes: 1 << 20,
                shards: 2,
                seed: 11,
                ..SynthSpec::default()
            };
            synth::write_model(tmp.path(), &spec)?;
            (tmp.path().to_path_buf(), Some(tmp), Some(spec))
        }
    };
    let steps: usize = args.next().map(|s| s.parse()).transpose()?.unwrap_or(16);
    let model = Model::open(ModelConfig::new(&dir))?;
    let engine = Engine::new(&model, EngineConfig::from_env()?)?;

    // Each layer's experts and their projections, recognised from the names.
    let experts = model.experts()?;
    let layers: Vec<&ExpertLayer> = experts.layers().collect();
    let per_layer = layers.iter().map(|l| l.expert_count()).min().unwrap_or(0);

    // One registered arena for one step's reads (every size from it),
    // sized by the arena's own rule: the largest step (each layer's TOP_K
    // largest experts and its shared ones), one step out at a time (each
    // step's slots are back before the next takes its own).
    let mut largest_step: Vec<&TensorRef> = Vec::new();
    for l in &layers {
        let mut by_bytes: Vec<&Expert> = l.experts().collect();
        by_bytes.sort_by_key(|e| std::cmp::Reverse(e.bytes()));
        for e in by_bytes.into_iter().take(TOP_K).chain(l.shared().iter()) {
            largest_step.extend(e.tensors());
        }
    }
    let arena = engine.packed_arena_for(&largest_step, 1, true)?;

    let (mut rng, mut bytes, t0) = (0x9e37_79b9_7f4a_7c15u64, 0u64, Instant::now());
    for step in 0..steps {
        // The router's choice: TOP_K distinct experts per layer.
        let mut reads = Vec::new();
        for layer in &layers {
            let mut chosen = Vec::new();
            while chosen.len() < TOP_K.min(per_layer) {
                rng ^= rng << 13;
                rng ^= rng >> 7;
                rng ^= rng << 17;
                let e = (rng % per_layer as u64) as usize;
                if !chosen.contains(&e) {
                    chosen.push(e);
                }
            }
            // The chosen experts, and the shared ones (always active).
            let active = chosen
                .into_iter()
                .map(|e| layer.expert(e))
                .chain(layer.shared().iter().map(Ok));
            for expert in active {
                for t in expert?.tensors() {
                    let slot = arena.take_for(t)?; // a TakeError says why not
                    reads.push((t, slot));
                }
            }
        }
        // Every read of the step in flight at once, on every drive.
        let tickets = engine.read_batch(reads)?;
        for ticket in tickets {
            let loaded = ticket.wait()?;
            if let Some(s) = &spec {
                assert!(synth::verify(s.seed, loaded.name(), &loaded), "{}", loaded.name());
            }
            bytes += loaded.len() as u64;
            // `loaded` drops here: its slot goes back for the next step.
        }
        if step == 0 {
            println!(
                "step 0: {} experts per layer of {per_layer}, {} layers",
                TOP_K,
                layers.len()
            );
        }
    }
    let secs = t0.elapsed().as_secs_f64();
    println!(
        "{steps} steps: {:.1} MB in {secs:.2} s ({:.2} GB/s, {:.1} steps/s){}",
        bytes as f64 / 1e6,
        bytes as f64 / 1e9 / secs,
        steps as f64 / secs,
        if spec.is_some() { ", every byte verified" } else { "" }
    );
    Ok(())
}
