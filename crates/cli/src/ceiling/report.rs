//! What a sweep found: each configuration's figure ([`ConfigResult`]), the
//! best of a drive and how far the others were from it ([`choose`]), and the
//! report of every drive and of all drives at once ([`CeilingReport`]).

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use super::config::ReadConfig;
use crate::error::{Error, Result};

/// One configuration's figure on one drive. GB are 10^9 bytes. A failed or
/// skipped configuration has `gbps` 0 and says why.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ConfigResult {
    pub config: ReadConfig,
    pub label: String,
    pub bytes: u64,
    pub seconds: f64,
    pub gbps: f64,
    /// Process CPU seconds over the timed region (getrusage; io-wq workers
    /// included).
    pub cpu_s: f64,
    pub cpu_s_per_gb: f64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub skipped: Option<String>,
}

impl ConfigResult {
    pub(super) fn measured(config: ReadConfig, bytes: u64, seconds: f64, cpu_s: f64) -> Self {
        let gb = bytes as f64 / 1e9;
        ConfigResult {
            config,
            label: config.label(),
            bytes,
            seconds,
            gbps: gb / seconds.max(1e-9),
            cpu_s,
            cpu_s_per_gb: if gb > 0.0 { cpu_s / gb } else { 0.0 },
            error: None,
            skipped: None,
        }
    }

    pub(super) fn not_measured(config: ReadConfig, error: Option<String>, skipped: Option<String>) -> Self {
        ConfigResult {
            config,
            label: config.label(),
            bytes: 0,
            seconds: 0.0,
            gbps: 0.0,
            cpu_s: 0.0,
            cpu_s_per_gb: 0.0,
            error,
            skipped,
        }
    }

    /// Why this figure cannot be the best (`None`: it can).
    pub fn unusable(&self) -> Option<String> {
        if let Some(e) = &self.error {
            return Some(format!("failed: {e}"));
        }
        if let Some(s) = &self.skipped {
            return Some(format!("skipped: {s}"));
        }
        if !self.gbps.is_finite() {
            return Some(format!("measured a rate that is not a number ({})", self.gbps));
        }
        if self.gbps <= 0.0 {
            return Some(format!("measured {} GB/s", self.gbps));
        }
        None
    }
}

/// The spread of the usable figures of one drive's sweep.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Spread {
    pub min_gbps: f64,
    pub max_gbps: f64,
    /// `min_gbps / max_gbps`: how far the weakest configuration is from the
    /// best (1 = configuration does not matter on this drive).
    pub weakest_ratio: f64,
    /// Configurations with a usable figure.
    pub measured: usize,
    pub failed: usize,
    pub skipped: usize,
}

/// What [`choose`] picked.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Choice {
    /// Index of the best configuration in the list given.
    pub best: usize,
    pub spread: Spread,
}

/// The best of one drive's measured configurations: the highest GB/s; on an
/// exact tie the lower CPU per GB (a figure that is not a number counts as
/// the most CPU), then the earlier. Failed, skipped, zero, negative and
/// non-finite figures are never chosen; if nothing is left the error names
/// the drive and every configuration with its cause.
pub fn choose(device: &str, results: &[ConfigResult]) -> Result<Choice> {
    let cpu_key = |r: &ConfigResult| {
        if r.cpu_s_per_gb.is_finite() && r.cpu_s_per_gb >= 0.0 {
            r.cpu_s_per_gb
        } else {
            f64::INFINITY
        }
    };
    let mut best: Option<usize> = None;
    let (mut min, mut max, mut measured, mut failed, mut skipped) = (f64::INFINITY, 0.0f64, 0, 0, 0);
    for (i, r) in results.iter().enumerate() {
        if r.skipped.is_some() && r.error.is_none() {
            skipped += 1;
        }
        if r.unusable().is_some() {
            if r.skipped.is_none() || r.error.is_some() {
                failed += 1;
            }
            continue;
        }
        measured += 1;
        min = min.min(r.gbps);
        max = max.max(r.gbps);
        best = match best {
            Some(b) => {
                let rb = &results[b];
                if r.gbps > rb.gbps || (r.gbps == rb.gbps && cpu_key(r) < cpu_key(rb)) {
                    Some(i)
                } else {
                    Some(b)
                }
            }
            None => Some(i),
        };
    }
    let Some(best) = best else {
        let causes: Vec<String> = results
            .iter()
            .map(|r| format!("{}: {}", r.label, r.unusable().unwrap_or_default()))
            .collect();
        return Err(Error::Config(format!(
            "ceiling of drive {device}: no configuration measured a rate ({} tried){}{}",
            results.len(),
            if causes.is_empty() { "" } else { ": " },
            causes.join("; ")
        )));
    };
    Ok(Choice {
        best,
        spread: Spread {
            min_gbps: min,
            max_gbps: max,
            weakest_ratio: min / max,
            measured,
            failed,
            skipped,
        },
    })
}

/// One drive: its best figure alone, the configuration that reached it, and
/// every configuration tried. GB are 10^9 bytes.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct DriveCeiling {
    pub device: String,
    pub files: Vec<PathBuf>,
    /// The best configuration's bytes, seconds, GB/s and CPU seconds, this
    /// drive read alone.
    pub bytes: u64,
    pub seconds: f64,
    pub gbps: f64,
    pub cpu_s: f64,
    pub best: ReadConfig,
    pub best_label: String,
    pub spread: Spread,
    pub configs: Vec<ConfigResult>,
    /// With several drives: this drive's GB/s while all were read at once,
    /// each with its best configuration.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub together_gbps: Option<f64>,
}

/// The whole measurement. GB are 10^9 bytes.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct CeilingReport {
    pub drives: Vec<DriveCeiling>,
    /// All drives read at once, each with its best configuration (one
    /// drive: its best figure alone).
    pub bytes: u64,
    pub seconds: f64,
    pub gbps: f64,
    /// CPU seconds (user + system) of the whole process over the timed
    /// region of the figure above (io-wq workers included).
    pub cpu_seconds: f64,
    /// `full`, `quick`, `custom`, or `single` (one configuration).
    pub sweep: String,
    /// Wall-clock seconds of the whole measurement (every configuration,
    /// set-up included).
    pub elapsed_s: f64,
    /// The readers' buffers: `huge pages (MADV_HUGEPAGE, THP <mode>)` or
    /// `4 KiB pages`.
    pub pages: String,
}

impl CeilingReport {
    /// `drive: best config` for each drive, `; `-separated.
    pub fn best_labels(&self) -> String {
        self.drives
            .iter()
            .map(|d| format!("{}: {}", d.device, d.best_label))
            .collect::<Vec<_>>()
            .join("; ")
    }
}
