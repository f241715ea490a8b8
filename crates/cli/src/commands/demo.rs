//! `weightstream demo`: write a synthetic model, read and verify every expert, a bench headline
//! (three interleaved runs, medians; never a ratio above the ceiling).

use std::path::PathBuf;
use std::time::Instant;

use weightstream::{Arena, Model, ModelConfig};
use weightstream_synth::{self as synth, SynthSpec};

use crate::bench::{self, Arm, ArmResult, BenchConfig};
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
    // The point in one line: a short interleaved bench on the same files,
    // three runs (each starting one arm later), medians. A ceiling that an
    // arm beats was disturbed (other work on the machine during its run):
    // then no ratio is claimed, only the figures, the range and what the
    // machine was doing.
    let cfg = BenchConfig {
        arms: vec![Arm::Ceiling, Arm::Engine, Arm::Buffered],
        runs: DEMO_RUNS,
        ..BenchConfig::default()
    };
    let (cpu0, own0, kids0, t0) = (
        crate::ceiling::machine_cpu(),
        crate::ceiling::process_cpu_seconds(),
        crate::ceiling::children_cpu_seconds(),
        Instant::now(),
    );
    let r = bench::run(&model, &cfg, &mut |_, _, _| {})?;
    let wall = t0.elapsed().as_secs_f64();
    let own = crate::ceiling::process_cpu_seconds() - own0 + crate::ceiling::children_cpu_seconds() - kids0;
    let outside = match (cpu0, crate::ceiling::machine_cpu()) {
        (Some(a), Some(b)) => {
            let (busy, steal) = b.since(&a);
            let cpus = crate::ceiling::machine_cpus().max(1) as f64;
            Some((
                ((busy - own) / (wall * cpus)).clamp(0.0, 1.0),
                (steal / (wall * cpus)).clamp(0.0, 1.0),
            ))
        }
        _ => None,
    };
    if let (Some(c), Some(e), Some(b)) = (r.arm("ceiling"), r.arm("engine"), r.arm("buffered")) {
        println!("{}", headline(r.concurrency, c, e, b, outside));
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

/// Interleaved runs of the demo's bench.
const DEMO_RUNS: usize = 3;

/// The demo's last line. A ratio to the ceiling only when no run of the
/// engine beat its run's ceiling; otherwise the figures, the range of the
/// per-run ratios and the machine's other work (`outside`: the share of
/// the CPUs busy outside this process and fio, and of them the host's
/// steal), and no ratio.
fn headline(
    concurrency: usize,
    ceiling: &ArmResult,
    engine: &ArmResult,
    buffered: &ArmResult,
    outside: Option<(f64, f64)>,
) -> String {
    let ratios: Vec<f64> = engine
        .runs
        .iter()
        .zip(&ceiling.runs)
        .map(|(e, c)| e.gbps / c.gbps.max(1e-12))
        .collect();
    let (lo, hi) = ratios
        .iter()
        .fold((f64::INFINITY, 0.0f64), |(lo, hi), &x| (lo.min(x), hi.max(x)));
    let n = ratios.len();
    let above = ratios.iter().filter(|&&x| x > 1.0).count();
    let tail = format!(
        "{:.2} x buffered pread+copy ({:.2} GB/s); CPU {:.3} vs {:.3} s/GB; page cache grew {:.0} MB vs {:.0} MB",
        engine.gbps / buffered.gbps.max(1e-12),
        buffered.gbps,
        engine.cpu_s_per_gb,
        buffered.cpu_s_per_gb,
        engine.cache_growth_bytes as f64 / 1e6,
        buffered.cache_growth_bytes as f64 / 1e6
    );
    let runs = format!("concurrency {concurrency}, cold cache, medians of {n} interleaved runs");
    if above == 0 && engine.ratio <= 1.0 {
        return format!(
            "headline ({runs}): engine {:.2} GB/s = {:.2} x the device ceiling ({:.2} GB/s, measured in the same runs; \
             per run {lo:.2}-{hi:.2}), {tail}",
            engine.gbps, engine.ratio, ceiling.gbps
        );
    }
    let machine = match outside {
        Some((busy, steal)) => format!(
            "other work kept {:.0}% of the CPUs busy during the runs (the host's steal: {:.0}%)",
            busy * 100.0,
            steal * 100.0
        ),
        None => "what else the machine did is unknown (no /proc/stat)".to_string(),
    };
    format!(
        "headline ({runs}): engine {:.2} GB/s, device ceiling {:.2} GB/s: the engine beat the ceiling in {above} of {n} \
         runs, so the ceiling was disturbed ({machine}); no ratio is claimed (per-run engine / ceiling \
         {lo:.2}-{hi:.2}); rerun on a quiet machine. {tail}",
        engine.gbps, ceiling.gbps
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn arm(gbps: &[f64]) -> ArmResult {
        let runs: Vec<bench::RunResult> = gbps
            .iter()
            .map(|&g| bench::RunResult {
                gbps: g,
                ..Default::default()
            })
            .collect();
        let mut m = gbps.to_vec();
        m.sort_by(|a, b| a.partial_cmp(b).unwrap());
        ArmResult {
            gbps: m[m.len() / 2],
            runs,
            ..Default::default()
        }
    }

    #[test]
    fn a_headline_never_claims_more_than_the_ceiling() {
        let c = arm(&[2.0, 2.0, 2.0]);
        let b = arm(&[1.0, 1.0, 1.0]);
        let mut e = arm(&[1.8, 1.9, 1.7]);
        e.ratio = 0.9;
        let h = headline(8, &c, &e, &b, Some((0.0, 0.0)));
        assert!(
            h.contains("= 0.90 x the device ceiling") && h.contains("per run 0.85-0.95"),
            "{h}"
        );
        // One run above its ceiling: disturbed, no ratio, the range and the machine said.
        let mut e = arm(&[1.8, 2.9, 1.7]);
        e.ratio = 0.9;
        let h = headline(8, &c, &e, &b, Some((0.42, 0.05)));
        assert!(!h.contains("x the device ceiling"), "{h}");
        assert!(
            h.contains("beat the ceiling in 1 of 3 runs") && h.contains("42% of the CPUs busy"),
            "{h}"
        );
        assert!(h.contains("0.85-1.45"), "{h}");
    }
}
