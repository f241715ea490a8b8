//! A whole model into memory, two ways: `load_all` (one mapping, every
//! payload aligned for its dtype, a map from name to typed view) and
//! `stream` (tensors yielded as they land, through a bounded staging
//! budget, the way an engine copies each one on to a GPU while the rest
//! are read).
//!
//! cargo run --release --example load_model -- [MODEL_DIR]

use weightstream::{Dtype, Engine, EngineConfig, LoadOptions, Model, ModelConfig};
use weightstream_synth::{self as synth, SynthSpec};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let (dir, _tmp, spec) = match std::env::args().nth(1) {
        Some(d) => (std::path::PathBuf::from(d), None, None),
        None => {
            let tmp = tempfile::tempdir()?;
            let spec = SynthSpec {
                layers: 4,
                experts: 4,
                expert_bytes: 1 << 20,
                shards: 2,
                seed: 5,
                ..SynthSpec::default()
            };
            synth::write_model(tmp.path(), &spec)?;
            (tmp.path().to_path_buf(), Some(tmp), Some(spec))
        }
    };
    let model = Model::open(ModelConfig::new(&dir))?;
    let engine = Engine::new(&model, EngineConfig::from_env()?)?;

    // 1. Everything, with a progress line.
    let all = engine.load_all(&LoadOptions::new().progress(|p| {
        if p.tensors == p.total_tensors {
            eprintln!("loaded {} tensors, {} bytes", p.tensors, p.bytes);
        }
    }))?;
    let r = all.report();
    println!(
        "load_all: {} tensors, {:.1} MB in {:.3} s ({:.2} GB/s; mapping {:.3} s; {} in place, {} placed)",
        r.tensors,
        r.bytes as f64 / 1e6,
        r.seconds,
        r.gbps(),
        r.arena_seconds,
        r.in_place,
        r.placed
    );
    for t in all.iter().take(3) {
        println!("  {} {} {:?}", t.name(), t.dtype(), t.shape());
    }
    // A typed view: checked dtype, length and alignment. (With the `half`
    // feature, BF16 payloads view as `half::bf16`; here as raw u16 bits.)
    if let Some(t) = all.iter().find(|t| t.dtype() == Dtype::U8) {
        println!("  {} as &[u8]: {} values", t.name(), t.as_slice::<u8>()?.len());
    }
    if let Some(s) = &spec {
        assert!(all.iter().all(|t| synth::verify(s.seed, t.name(), t.bytes())));
    }
    drop(all);

    // 2. Streamed through 8 MiB of staging: each tensor is "copied on" and
    //    dropped, and its staging memory takes the next read.
    let largest = model.catalog().tensors().iter().map(|t| t.len).max().unwrap_or(0) as usize;
    let budget = (8 << 20).max(2 * (largest + 8192));
    let mut device = Vec::new(); // stands for GPU memory
    for loaded in engine.stream(model.catalog().tensors(), budget)? {
        let loaded = loaded?;
        if let Some(s) = &spec {
            assert!(synth::verify(s.seed, loaded.name(), &loaded));
        }
        device.extend_from_slice(&loaded);
    }
    println!(
        "stream: {:.1} MB through {:.1} MB of staging{}",
        device.len() as f64 / 1e6,
        budget as f64 / 1e6,
        if spec.is_some() { ", every byte verified" } else { "" }
    );
    Ok(())
}
