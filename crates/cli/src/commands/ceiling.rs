//! `weightstream ceiling`: the device ceiling sweep, printed.

use std::path::PathBuf;

use crate::ceiling::{self, SweepConfig};
use crate::commands::CliResult;

pub(crate) fn ceiling_cmd(paths: Vec<PathBuf>, cfg: &SweepConfig, json: bool) -> CliResult {
    let r = ceiling::sweep(&paths, cfg)?;
    if json {
        println!("{}", serde_json::to_string_pretty(&r)?);
        return Ok(());
    }
    for d in &r.drives {
        let s = &d.spread;
        println!(
            "drive {}: {} file(s); best {:.3} GB/s with {} (CPU {:.3} s/GB); {} configuration(s): {:.3}-{:.3} GB/s \
             (the weakest {:.2} of the best), {} failed, {} skipped",
            d.device,
            d.files.len(),
            d.gbps,
            d.best_label,
            d.cpu_s / (d.bytes as f64 / 1e9).max(1e-12),
            d.configs.len(),
            s.min_gbps,
            s.max_gbps,
            s.weakest_ratio,
            s.failed,
            s.skipped
        );
        for c in &d.configs {
            let mark = if c.config == d.best { "  <- best" } else { "" };
            match (&c.error, &c.skipped) {
                (Some(e), _) => println!("  {:<52} failed: {e}", c.label),
                (None, Some(why)) => println!("  {:<52} skipped: {why}", c.label),
                _ => println!(
                    "  {:<52} {:>7.3} GB/s  {:.3} GB in {:.2}s  CPU {:.3} s/GB{mark}",
                    c.label,
                    c.gbps,
                    c.bytes as f64 / 1e9,
                    c.seconds,
                    c.cpu_s_per_gb
                ),
            }
        }
    }
    let together = if r.drives.len() > 1 {
        "all drives at once, each with its best"
    } else {
        "one drive: its best"
    };
    println!(
        "total ({together}): {:.3} GB in {:.2}s = {:.3} GB/s, CPU {:.3} s/GB (getrusage: io-wq workers included); \
         {} sweep took {:.1}s; buffers on {}",
        r.bytes as f64 / 1e9,
        r.seconds,
        r.gbps,
        r.cpu_seconds / (r.bytes as f64 / 1e9).max(1e-12),
        r.sweep,
        r.elapsed_s,
        r.pages
    );
    Ok(())
}
