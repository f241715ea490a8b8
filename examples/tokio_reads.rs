//! weightstream under tokio: `Engine::read` never blocks (it queues the
//! chunks and returns a ticket), and a `Ticket` is a `Future`, so reads are
//! awaited from async tasks without tying up an executor thread. The
//! library has no runtime dependency; tokio is only this example's.
//!
//! cargo run --release --example tokio_reads

use std::sync::Arc;

use weightstream::{Engine, EngineConfig, Model, ModelConfig};
use weightstream_synth::{self as synth, SynthSpec};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let tmp = tempfile::tempdir()?;
    let spec = SynthSpec {
        layers: 4,
        experts: 8,
        expert_bytes: 512 << 10,
        shards: 2,
        seed: 3,
        ..SynthSpec::default()
    };
    synth::write_model(tmp.path(), &spec)?;
    let model = Model::open(ModelConfig::new(tmp.path()))?;
    let engine = Arc::new(Engine::new(&model, EngineConfig::from_env()?)?);
    let arena = engine.packed_arena(64 << 20, false)?;

    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).build()?;
    let verified = rt.block_on(async {
        // One task per layer; each reads its layer's experts concurrently.
        let mut tasks = Vec::new();
        for layer in 0..spec.layers {
            let (engine, arena, model) = (Arc::clone(&engine), arena.clone(), model.clone());
            tasks.push(tokio::spawn(async move {
                let prefix = format!("model.layers.{layer}.mlp.experts.");
                let mut tickets = Vec::new();
                for t in model.catalog().tensors().iter().filter(|t| t.name.starts_with(&prefix)) {
                    let slot = arena.take_for(t).expect("the arena holds every expert");
                    tickets.push(engine.read(t, slot)?); // returns at once
                }
                let mut ok = 0usize;
                for ticket in tickets {
                    let loaded = ticket.await?; // the executor thread is free meanwhile
                    ok += usize::from(synth::verify(spec.seed, loaded.name(), &loaded));
                }
                Ok::<usize, weightstream::Error>(ok)
            }));
        }
        let mut total = 0;
        for t in tasks {
            total += t.await.expect("task")?;
        }
        Ok::<usize, weightstream::Error>(total)
    })?;
    let experts = spec.layers * spec.experts * 3;
    println!("{verified} of {experts} expert tensors read from async tasks, every byte verified");
    assert_eq!(verified, experts);
    Ok(())
}
