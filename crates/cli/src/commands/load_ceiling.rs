//! `weightstream load-ceiling`: the load ceiling of a model on this machine
//! (fio's read, the fault-in of as much fresh memory, their CPU over the
//! cores), printed or as JSON.

use std::path::PathBuf;

use weightstream::Model;

use crate::bench::fio::FioConfig;
use crate::ceiling::SweepConfig;
use crate::cli::{LayoutArgs, SweepArg};
use crate::commands::CliResult;
use crate::load_ceiling::{self, LoadCeilingConfig};

pub(crate) fn load_ceiling_cmd(
    dir: PathBuf,
    (sweep, only): (SweepArg, Option<FioConfig>),
    fault_rounds: usize,
    layout: &LayoutArgs,
    json: bool,
) -> CliResult {
    let model = Model::open(layout.config(&dir, None)?)?;
    let _said = crate::warnings::Watch(|| model.warnings());
    let sweep = match sweep {
        SweepArg::Quick => SweepConfig::quick(),
        SweepArg::Full => SweepConfig::full(),
    };
    let mut cfg = LoadCeilingConfig::new(sweep);
    cfg.fault_rounds = fault_rounds;
    if let Some(c) = only {
        cfg.fio.configs = vec![c];
    }
    let c = load_ceiling::measure(&dir, &model, &cfg)?;
    if json {
        println!("{}", serde_json::to_string_pretty(&c)?);
        return Ok(());
    }
    let gb = c.bytes as f64 / 1e9;
    println!(
        "load ceiling of {} ({:.3} GB of tensors): {:.3} GB/s ({:.3} s), set by the {}",
        weightstream::__internal::escape(&c.model_dir),
        gb,
        c.gbps,
        c.seconds,
        c.bound
    );
    println!(
        "  read:  {:.3} s  fio's best {:.3} GB/s ({}); busy CPU {:.3} s (the least of the sweep: {:.3} s, {})",
        c.read.seconds,
        c.read.gbps,
        c.read.best_label,
        c.read.busy_cpu_seconds,
        c.read.least_busy_cpu_seconds,
        c.read.least_busy_label
    );
    println!(
        "  fault: {:.3} s  {:.3} GB/s of fresh memory ({} pages, MADV_POPULATE_WRITE on {} threads); busy CPU {:.3} s",
        c.fault.seconds,
        c.fault.gbps,
        c.fault.pages,
        c.fault.runs.first().map_or(0, |r| r.threads),
        c.fault.busy_cpu_seconds
    );
    for r in &c.fault.runs {
        println!(
            "         {:>3} {:.3} s  {:>6.2} GB/s  busy CPU {:.3} s  huge pages faulted {} (fallbacks {})",
            r.pages, r.seconds, r.gbps, r.busy_cpu_seconds, r.thp_fault_alloc, r.thp_fault_fallback
        );
    }
    println!(
        "  cpu:   {:.3} s  ({:.3} busy CPU seconds over {} CPUs)",
        c.cpu.seconds, c.cpu.busy_cpu_seconds, c.cpu.cpus
    );
    println!(
        "  into memory already faulted (the read alone): {:.3} GB/s",
        c.read_ceiling_gbps
    );
    if c.drives.len() > 1 {
        for d in &c.drives {
            println!(
                "  drive {}: {} file(s), {:.3} GB: read {:.3} GB/s alone, load ceiling {:.3} GB/s (set by the {})",
                d.device,
                d.files.len(),
                d.file_bytes as f64 / 1e9,
                d.read_gbps,
                d.load_gbps,
                d.bound
            );
        }
    }
    Ok(())
}
