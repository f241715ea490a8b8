//! `weightstream demo`: write a synthetic model, read and verify every expert, a one-run bench headline.

use std::path::PathBuf;
use std::time::Instant;

use weightstream::{Arena, Model, ModelConfig};
use weightstream_synth::{self as synth, SynthSpec};

use crate::bench::{self, Arm, BenchConfig};
use crate::commands::{gen, CliResult};

pub(crate) fn demo(dir: Option<PathBuf>, size: u64, keep: bool) -> CliResult {
    // Checked before a directory is made: the volume and memory it needs.
    let flags = gen::Flags {
        command: "demo",
        experts_hint: "lower --size",
        smaller_hint: "",
    };
    let at = dir.clone().unwrap_or_else(std::env::temp_dir);
    let spec = gen::plan(&at, size, 4, None, 1_700_000, 2, SynthSpec::default().seed, &flags)?.spec;
    let (tmp, dir) = match dir {
        Some(d) => (None, d),
        None => {
            let t = tempfile::Builder::new()
                .prefix("weightstream-demo-")
                .tempdir_in(std::env::temp_dir())?;
            let d = t.path().to_path_buf();
            (Some(t), d)
        }
    };
    let t0 = Instant::now();
    synth::write_model(&dir, &spec)?;
    println!(
        "wrote a synthetic MoE model to {}: {} layers x {} experts x 3 projections, {} shards, {:.1} MB in {:.1}s",
        dir.display(),
        spec.layers,
        spec.experts,
        spec.shards,
        spec.total_bytes() as f64 / 1e6,
        t0.elapsed().as_secs_f64()
    );
    let model = Model::open(ModelConfig::new(&dir))?;
    let _said = crate::warnings::Watch(|| model.warnings());
    let experts: Vec<_> = model
        .catalog()
        .tensors()
        .iter()
        .filter(|t| t.name.contains(".experts."))
        .collect();
    let arena = Arena::new(model.slot_spec_for_largest(".experts.")?, 1)?;
    let (mut bytes, mut bad) = (0u64, 0usize);
    for t in &experts {
        let slot = arena.take().expect("one slot, returned after each read");
        let loaded = model.read_sync(t, slot)?;
        bytes += loaded.len() as u64;
        if !synth::verify(spec.seed, &t.name, &loaded) {
            bad += 1;
            eprintln!("MISMATCH: {}", t.name);
        }
    }
    let st = model.stats();
    println!(
        "read {} expert tensors ({:.1} MB) in place with the synchronous reference path, every byte verified: {} \
         (speed: see the headline below, measured against the device ceiling)",
        experts.len(),
        bytes as f64 / 1e9 * 1e3,
        if bad == 0 {
            "ok".to_string()
        } else {
            format!("{bad} MISMATCHED")
        }
    );
    for d in &st.drives {
        println!(
            "drive {} ({}): {} reads direct, {} buffered; {} bytes direct, {} buffered (sub-block tails); fallbacks {:?}",
            d.device, d.fs_type, d.reads_direct, d.reads_buffered, d.bytes_direct, d.bytes_buffered, d.fallbacks
        );
    }
    // The point in one line: a short interleaved bench on the same files.
    let cfg = BenchConfig {
        arms: vec![Arm::Ceiling, Arm::Engine, Arm::Buffered],
        runs: 1,
        ..BenchConfig::default()
    };
    let r = bench::run(&model, &cfg, &mut |_, _, _| {})?;
    if let (Some(e), Some(b)) = (r.arm("engine"), r.arm("buffered")) {
        println!(
            "headline (concurrency {}, cold cache, 1 run): engine {:.2} GB/s = {:.2} x the device ceiling ({:.2} GB/s, measured now), \
             {:.2} x buffered pread+copy ({:.2} GB/s); CPU {:.3} vs {:.3} s/GB; page cache grew {:.0} MB vs {:.0} MB",
            r.concurrency,
            e.gbps,
            e.ratio,
            r.ceiling_gbps,
            e.gbps / b.gbps.max(1e-12),
            b.gbps,
            e.cpu_s_per_gb,
            b.cpu_s_per_gb,
            e.cache_growth_bytes as f64 / 1e6,
            b.cache_growth_bytes as f64 / 1e6
        );
    }
    if keep {
        if let Some(t) = tmp {
            let _ = t.keep();
        }
        println!("kept {}", dir.display());
    } else if let Some(t) = tmp {
        t.close()?;
        println!("removed {}", dir.display());
    }
    if bad > 0 {
        return Err(format!("{bad} tensor(s) did not match").into());
    }
    Ok(())
}
