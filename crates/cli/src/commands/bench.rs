//! `weightstream bench`: the arms, interleaved, printed (or as JSON), with an optional chart.

use std::io::IsTerminal;
use std::path::PathBuf;

use weightstream::Model;

use crate::bench::{self, Arm, BenchConfig};
use crate::ceiling::SweepConfig;
use crate::cli::{EngineArgs, LayoutArgs, SweepArg};
use crate::commands::CliResult;
use crate::plot;
use crate::progress::Progress;

/// Reads in one run's order, at most (each is a reference held in memory).
const MAX_ORDER: usize = 1 << 24;

#[allow(clippy::too_many_arguments)]
pub(crate) fn bench_cmd(
    dir: PathBuf,
    arms: Vec<Arm>,
    (sweep, small_pages, sweep_figure): (SweepArg, bool, bench::SweepFigure),
    (runs, concurrency, seed, passes, timeline_ms): (usize, usize, u64, usize, Option<u64>),
    filter: String,
    eargs: &EngineArgs,
    layout: &LayoutArgs,
    plot: Option<PathBuf>,
    json: bool,
) -> CliResult {
    let model = Model::open(layout.config(&dir, None)?)?;
    let _said = crate::warnings::Watch(|| model.warnings());
    // Checked before any arm runs: a filter that matches nothing, and an
    // order (every pass of every match) too long to hold.
    let matched = model
        .catalog()
        .tensors()
        .iter()
        .filter(|t| t.name.contains(&filter))
        .count();
    if matched == 0 {
        return Err(format!(
            "bench: --filter {filter:?}: no tensor name contains it (the model in {} has {} tensor(s)){}",
            weightstream::__internal::escape(&dir),
            model.catalog().tensors().len(),
            crate::suggest::no_match_hint(&filter, model.catalog().tensors().iter().map(|t| t.name.as_str()))
        )
        .into());
    }
    if matched.saturating_mul(passes) > MAX_ORDER {
        return Err(format!(
            "bench: --passes {passes} x {matched} tensor(s) matching --filter {filter:?} is more than {MAX_ORDER} reads \
             per run: fewer --passes"
        )
        .into());
    }
    let engine = eargs
        .config()?
        .ok_or("bench: --backend sync is not an arm; use --arms")?;
    let mut ceiling = match sweep {
        SweepArg::Quick => SweepConfig::quick(),
        SweepArg::Full => SweepConfig::full(),
    };
    ceiling.huge_pages = !small_pages;
    let cfg = BenchConfig {
        arms,
        runs,
        concurrency,
        seed,
        filter,
        engine,
        fio: bench::fio::FioSweep::like(&ceiling),
        ceiling,
        passes,
        timeline_ms,
        sweep_figure,
    };
    let progress = Progress::new(!json && std::io::stderr().is_terminal(), runs);
    let mut progress = |arm: Arm, run: usize, f: f64| progress.show(arm.name(), run, f);
    let r = bench::run(&model, &cfg, &mut progress)?;
    if let Some(p) = &plot {
        let bars: Vec<(String, f64)> = r.arms.iter().map(|(n, a)| (n.clone(), a.gbps)).collect();
        let title = format!(
            "{} experts, concurrency {}, median of {} runs; ceiling {:.2} GB/s",
            r.tensors, r.concurrency, r.runs, r.ceiling_gbps
        );
        std::fs::write(p, plot::bars_svg(&title, "GB/s", &bars, Some(r.ceiling_gbps))).map_err(|e| {
            format!(
                "bench: --plot {}: write the chart: {e}",
                weightstream::__internal::escape(p)
            )
        })?;
    }
    if json {
        println!("{}", serde_json::to_string_pretty(&r)?);
        return Ok(());
    }
    println!(
        "{} tensors, {:.3} GB per run, concurrency {}, median of {} interleaved run(s)",
        r.tensors,
        r.bytes_per_run as f64 / 1e9,
        r.concurrency,
        r.runs,
    );
    let max = |m: Option<f64>| m.map_or(String::new(), |m| format!("; the sweep's largest {m:.3} GB/s"));
    println!(
        "ceiling {:.3} GB/s ({}{})",
        r.ceiling_gbps,
        r.ceiling_config,
        max(r.ceiling_sweep_max_gbps)
    );
    if let (Some(f), Some(c)) = (r.fio_gbps, &r.fio_config) {
        println!(
            "fio     {f:.3} GB/s ({c}; {}{}); ceiling / fio = {:.3}",
            r.fio_version.as_deref().unwrap_or("fio"),
            max(r.fio_sweep_max_gbps),
            r.ceiling_gbps / f.max(1e-12)
        );
    }
    if r.sweep_figure == bench::SweepFigure::Rerun {
        println!(
            "(ceiling and fio: each run's best configuration, run again alone; --sweep-figure max for the largest)"
        );
    }
    println!(
        "{:>15} {:>8} {:>15} {:>6} {:>9} {:>9} {:>8} {:>8} {:>12}",
        "arm", "GB/s", "min-max", "ratio", "ratio_fio", "CPU s/GB", "p50 ms", "p99 ms", "cache grow"
    );
    for (n, a) in &r.arms {
        let ms = |v: Option<f64>| v.map_or("-".to_string(), |v| format!("{v:.2}"));
        println!(
            "{:>15} {:>8.3} {:>15} {:>6.3} {:>9} {:>9.3} {:>8} {:>8} {:>10.1}MB",
            n,
            a.gbps,
            format!("{:.3}-{:.3}", a.gbps_min, a.gbps_max),
            a.ratio,
            a.ratio_fio.map_or("-".to_string(), |x| format!("{x:.3}")),
            a.cpu_s_per_gb,
            ms(a.p50_ms),
            ms(a.p99_ms),
            a.cache_growth_bytes as f64 / 1e6
        );
    }
    for w in &r.warnings {
        println!("warning: {w}");
    }
    for n in &r.notes {
        println!("note: {n}");
    }
    Ok(())
}
