//! `weightstream bench`: read every expert of a model in a seeded random
//! order (decode-like), through several arms, interleaved A B C, B C A, ..., and
//! state each as a ratio to the device ceiling measured in the same run.
//!
//! Arms:
//! - `ceiling`: weightstream's ceiling sweep ([`crate::ceiling::sweep`]) on
//!   the model's shard files: what the drives can do;
//! - `fio`: fio's sweep on the same files ([`fio`]), when fio is installed
//!   (when not, the arm is dropped with a note in the report and a warning);
//! - `engine`: weightstream with io_uring;
//! - `pread`: weightstream's pread backend;
//! - `buffered`: plain buffered `pread` into a heap buffer, then a copy into
//!   the slot: what most loaders do;
//! - `mmap`: map the shards, copy each tensor into the slot: what the
//!   safetensors ecosystem does.
//!
//! Cold cache before every arm: O_DIRECT arms (ceiling, fio, engine, pread)
//! need none; buffered and mmap arms drop the files' pages first
//! (`posix_fadvise(DONTNEED)`) and check by sampling with `RWF_NOWAIT` reads
//! that the eviction took.
//!
//! Every arm's median is a ratio to the ceiling's median (`ratio`) and, when
//! the fio arm ran, to fio's (`ratio_fio`). An arm whose median beats the
//! ceiling by more than the ceiling's own spread over the runs (or 5% of it,
//! if larger) is named in `warnings`: the ceiling is not a ceiling.

pub mod fio;

use std::collections::VecDeque;
use std::io::IoSliceMut;
use std::os::unix::fs::FileExt;
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Instant;

use serde::Serialize;

use crate::ceiling::{self, process_cpu_seconds, CeilingReport, SweepConfig};
use crate::error::{Error, Result};
use weightstream::Model;
use weightstream::RoutePolicy;
use weightstream::TensorRef;
use weightstream::{Arena, SlotSpec};
use weightstream::{BackendChoice, Engine, EngineConfig};

/// One way of reading the experts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Arm {
    Ceiling,
    /// fio's sweep on the same files.
    Fio,
    /// The engine with the model's route policy.
    Engine,
    /// The engine with this route policy (to compare policies in one run).
    EngineRoute(RoutePolicy),
    Pread,
    Buffered,
    Mmap,
}

impl Arm {
    pub fn name(self) -> &'static str {
        match self {
            Arm::Ceiling => "ceiling",
            Arm::Fio => "fio",
            Arm::Engine => "engine",
            Arm::EngineRoute(RoutePolicy::Hash) => "engine-hash",
            Arm::EngineRoute(RoutePolicy::Stripe) => "engine-stripe",
            Arm::EngineRoute(RoutePolicy::Adaptive) => "engine-adaptive",
            Arm::Pread => "pread",
            Arm::Buffered => "buffered",
            Arm::Mmap => "mmap",
        }
    }
}

/// The arms by name (`--arms`); `uring` is another name of `engine`.
impl clap::ValueEnum for Arm {
    fn value_variants<'a>() -> &'a [Self] {
        &[
            Arm::Ceiling,
            Arm::Fio,
            Arm::Engine,
            Arm::EngineRoute(RoutePolicy::Hash),
            Arm::EngineRoute(RoutePolicy::Stripe),
            Arm::EngineRoute(RoutePolicy::Adaptive),
            Arm::Pread,
            Arm::Buffered,
            Arm::Mmap,
        ]
    }

    fn to_possible_value(&self) -> Option<clap::builder::PossibleValue> {
        let v = clap::builder::PossibleValue::new(self.name());
        Some(if *self == Arm::Engine { v.alias("uring") } else { v })
    }
}

/// Which figure a run of the ceiling or fio arm reports.
///
/// A sweep's largest figure is the maximum of 8 (quick) or 32 (full) runs,
/// where every other arm's figure is one run. Where runs vary (this VM's
/// memloop drive: 4.5-7.8 GB/s for one fio configuration in one minute),
/// that maximum is biased up against everything compared with it. The
/// default therefore lets the sweep choose the configuration and runs that
/// configuration once more, alone: one run, as the other arms get. With
/// several drives the ceiling's figure is already a run of its own (every
/// drive at once with its best configuration), so only fio and a
/// one-drive ceiling are rerun.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum SweepFigure {
    /// The sweep's best configuration, run again alone.
    Rerun,
    /// The sweep's largest figure.
    Max,
}

/// How to bench.
#[derive(Debug, Clone)]
pub struct BenchConfig {
    pub arms: Vec<Arm>,
    pub runs: usize,
    /// Reads kept in flight (1 = one expert at a time, decode-like).
    pub concurrency: usize,
    pub seed: u64,
    /// Tensors whose name contains this are read (default: experts).
    pub filter: String,
    pub engine: EngineConfig,
    /// The ceiling arm's sweep (default: quick).
    pub ceiling: SweepConfig,
    /// The fio arm's sweep (default: like the ceiling's).
    pub fio: fio::FioSweep,
    /// Read the whole order this many times per run (long runs for timelines).
    pub passes: usize,
    /// Sample per-drive bytes this often during engine arms (ms).
    pub timeline_ms: Option<u64>,
    /// The ceiling's and fio's figure per run (default: rerun).
    pub sweep_figure: SweepFigure,
}

impl Default for BenchConfig {
    fn default() -> Self {
        BenchConfig {
            arms: vec![Arm::Ceiling, Arm::Engine, Arm::Pread, Arm::Buffered, Arm::Mmap],
            runs: 3,
            concurrency: 8,
            seed: 1,
            filter: ".experts.".into(),
            engine: EngineConfig::default(),
            ceiling: SweepConfig::quick(),
            fio: fio::FioSweep::like(&SweepConfig::quick()),
            passes: 1,
            timeline_ms: None,
            sweep_figure: SweepFigure::Rerun,
        }
    }
}

/// One run of one arm. GB are 10^9 bytes.
#[derive(Debug, Clone, Default, Serialize)]
pub struct RunResult {
    pub bytes: u64,
    pub seconds: f64,
    pub gbps: f64,
    pub cpu_s: f64,
    pub cpu_s_per_gb: f64,
    pub p50_ms: Option<f64>,
    pub p99_ms: Option<f64>,
    /// Growth of `Cached` in /proc/meminfo during the run.
    pub cache_growth_bytes: i64,
    /// For arms that need a cold cache: whether the eviction before the run
    /// took (sampled pages no longer resident).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cold: Option<bool>,
    /// Engine arms with a timeline: (seconds since start, payload bytes per
    /// drive so far), one sample per interval.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub timeline: Option<Vec<(f64, Vec<u64>)>>,
    /// Wall-clock time (seconds since the Unix epoch) of the timeline's zero,
    /// to line it up with events outside the process (a drive throttled).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub timeline_start_unix: Option<f64>,
    /// Engine arms: per drive (device, bytes, share of bytes).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub drives: Option<Vec<(String, u64, f64)>>,
    /// Ceiling and fio arms: the sweep's largest figure, when the run's
    /// figure is its best configuration run again ([`SweepFigure::Rerun`]).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub sweep_max_gbps: Option<f64>,
    /// Ceiling and fio arms: the configuration that reached this run's
    /// figure (per drive for the ceiling).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub config: Option<String>,
    /// Ceiling arm: the whole sweep, every configuration's figure.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ceiling: Option<CeilingReport>,
    /// fio arm: the whole sweep, every invocation's figure.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub fio: Option<fio::FioReport>,
}

/// Medians over the runs of one arm.
#[derive(Debug, Clone, Default, Serialize)]
pub struct ArmResult {
    pub gbps: f64,
    pub gbps_min: f64,
    pub gbps_max: f64,
    /// `gbps / ceiling_gbps`.
    pub ratio: f64,
    /// `gbps / fio_gbps`, when the fio arm ran.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ratio_fio: Option<f64>,
    pub cpu_s_per_gb: f64,
    pub p50_ms: Option<f64>,
    pub p99_ms: Option<f64>,
    pub cache_growth_bytes: i64,
    pub runs: Vec<RunResult>,
}

/// The whole bench.
#[derive(Debug, Clone, Serialize)]
pub struct BenchReport {
    /// Median over the runs of weightstream's ceiling (its sweep's best).
    pub ceiling_gbps: f64,
    /// The configuration that reached the ceiling in the median run (per
    /// drive).
    pub ceiling_config: String,
    /// Median over the runs of fio's best on the same files, when the fio
    /// arm ran.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub fio_gbps: Option<f64>,
    /// Median over the runs of the ceiling's and of fio's largest sweep
    /// figures, where the figures above are reruns ([`SweepFigure`]).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ceiling_sweep_max_gbps: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub fio_sweep_max_gbps: Option<f64>,
    pub sweep_figure: SweepFigure,
    /// fio's configuration in its median run.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub fio_config: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub fio_version: Option<String>,
    /// "The ceiling is not a ceiling": arms whose median beats the ceiling
    /// by more than its spread ([`ceiling_warnings`]).
    pub warnings: Vec<String>,
    /// What the run left out and why (e.g. the fio arm without fio).
    pub notes: Vec<String>,
    pub concurrency: usize,
    pub runs: usize,
    pub tensors: usize,
    pub bytes_per_run: u64,
    /// Arms in the order they ran.
    #[serde(serialize_with = "ordered_map")]
    pub arms: Vec<(String, ArmResult)>,
}

fn ordered_map<S: serde::Serializer>(v: &[(String, ArmResult)], s: S) -> std::result::Result<S::Ok, S::Error> {
    use serde::ser::SerializeMap;
    let mut m = s.serialize_map(Some(v.len()))?;
    for (k, a) in v {
        m.serialize_entry(k, a)?;
    }
    m.end()
}

impl BenchReport {
    pub fn arm(&self, name: &str) -> Option<&ArmResult> {
        self.arms.iter().find(|(n, _)| n == name).map(|(_, a)| a)
    }
}

/// Progress callback: (arm, run index, fraction done of that run).
pub type Progress<'a> = &'a mut dyn FnMut(Arm, usize, f64);

/// Runs the bench on `model`.
pub fn run(model: &Model, cfg: &BenchConfig, progress: Progress) -> Result<BenchReport> {
    let mut arms = cfg.arms.clone();
    if !arms.contains(&Arm::Ceiling) {
        // Every figure is a ratio to the ceiling measured in the same run.
        arms.insert(0, Arm::Ceiling);
    }
    arms.dedup();
    let mut notes = Vec::new();
    let mut fio_version = None;
    if arms.contains(&Arm::Fio) {
        match fio::available() {
            Ok(v) => fio_version = Some(v),
            Err(why) => {
                let note = format!("fio arm skipped: {why}");
                tracing::warn!("{note}");
                notes.push(note);
                arms.retain(|a| *a != Arm::Fio);
            }
        }
    }
    if arms.contains(&Arm::Fio) && cfg.ceiling.huge_pages {
        notes.push(
            "the ceiling reads into huge pages (MADV_HUGEPAGE), fio into its default buffers (4 KiB pages): where the \
             device caps a request's segments (virtio) the ceiling can beat fio for that alone; --small-pages compares \
             like with like"
                .into(),
        );
    }
    let once = decode_order(model, &cfg.filter, cfg.seed);
    let order: Vec<&TensorRef> = (0..cfg.passes.max(1)).flat_map(|_| once.iter().copied()).collect();
    if order.is_empty() {
        return Err(Error::Config(format!("no tensor name contains {:?}", cfg.filter)));
    }
    let bytes_per_run: u64 = order.iter().map(|t| t.len).sum();
    let mut results: Vec<(Arm, Vec<RunResult>)> = arms.iter().map(|&a| (a, Vec::new())).collect();
    // Each run starts one arm later than the one before (A B C, B C A, ...):
    // the arm that runs right after fio's sweep measured about 5% slower on
    // zram whichever arm it was (engine and pread backend, the same code
    // then, 0.956 one way round and 1.06 the other over 10 and 5
    // invocations), so a fixed order would put that into the ratios.
    let n = results.len();
    for r in 0..cfg.runs.max(1) {
        for j in 0..n {
            let (arm, runs) = &mut results[(j + r) % n];
            let res = run_arm(model, cfg, *arm, &order, &mut |f| progress(*arm, r, f))?;
            runs.push(res);
        }
    }
    let median_of = |arm: Arm| {
        results
            .iter()
            .find(|(a, _)| *a == arm)
            .map(|(_, r)| median(r.iter().map(|x| x.gbps).collect()))
    };
    let ceiling_gbps = median_of(Arm::Ceiling).unwrap_or(0.0);
    let fio_gbps = median_of(Arm::Fio);
    let sweep_max_of = |arm: Arm| {
        results.iter().find(|(a, _)| *a == arm).and_then(|(_, r)| {
            let v: Vec<f64> = r.iter().filter_map(|x| x.sweep_max_gbps).collect();
            (!v.is_empty()).then(|| median(v))
        })
    };
    let (ceiling_sweep_max_gbps, fio_sweep_max_gbps) = (sweep_max_of(Arm::Ceiling), sweep_max_of(Arm::Fio));
    let config_of = |arm: Arm| {
        results
            .iter()
            .find(|(a, _)| *a == arm)
            .and_then(|(_, r)| median_run(r))
            .and_then(|r| r.config.clone())
    };
    let (ceiling_config, fio_config) = (config_of(Arm::Ceiling).unwrap_or_default(), config_of(Arm::Fio));
    let arms: Vec<(String, ArmResult)> = results
        .into_iter()
        .map(|(arm, runs)| {
            let g: Vec<f64> = runs.iter().map(|r| r.gbps).collect();
            let opt_median = |f: &dyn Fn(&RunResult) -> Option<f64>| {
                let v: Vec<f64> = runs.iter().filter_map(f).collect();
                (!v.is_empty()).then(|| median(v))
            };
            let gbps = median(g.clone());
            (
                arm.name().to_string(),
                ArmResult {
                    gbps,
                    gbps_min: g.iter().copied().fold(f64::INFINITY, f64::min),
                    gbps_max: g.iter().copied().fold(0.0, f64::max),
                    ratio: gbps / ceiling_gbps.max(1e-12),
                    ratio_fio: fio_gbps.map(|f| gbps / f.max(1e-12)),
                    cpu_s_per_gb: median(runs.iter().map(|r| r.cpu_s_per_gb).collect()),
                    p50_ms: opt_median(&|r| r.p50_ms),
                    p99_ms: opt_median(&|r| r.p99_ms),
                    cache_growth_bytes: median(runs.iter().map(|r| r.cache_growth_bytes as f64).collect()) as i64,
                    runs,
                },
            )
        })
        .collect();
    let warnings = match arms.iter().find(|(n, _)| n == Arm::Ceiling.name()) {
        Some((_, c)) => {
            let others: Vec<(&str, f64)> = arms
                .iter()
                .filter(|(n, _)| n != Arm::Ceiling.name())
                .map(|(n, a)| (n.as_str(), a.gbps))
                .collect();
            ceiling_warnings(c.gbps, c.gbps_min, c.gbps_max, c.runs.len(), &others)
        }
        None => Vec::new(),
    };
    for w in &warnings {
        tracing::warn!("{w}");
    }
    Ok(BenchReport {
        ceiling_gbps,
        ceiling_config,
        fio_gbps,
        ceiling_sweep_max_gbps,
        fio_sweep_max_gbps,
        sweep_figure: cfg.sweep_figure,
        fio_config,
        fio_version,
        warnings,
        notes,
        concurrency: cfg.concurrency,
        runs: cfg.runs.max(1),
        tensors: order.len(),
        bytes_per_run,
        arms,
    })
}

/// The run whose figure is the median (of an even count: the upper of the
/// middle two).
fn median_run(runs: &[RunResult]) -> Option<&RunResult> {
    let mut v: Vec<&RunResult> = runs.iter().collect();
    v.sort_by(|a, b| a.gbps.total_cmp(&b.gbps));
    v.get(v.len() / 2).copied()
}

/// "The ceiling is not a ceiling": one warning per arm whose median beats
/// the ceiling's median by more than the ceiling's own spread over the runs
/// (max - min), or 5% of the ceiling if that is larger. Non-finite figures
/// are ignored; a zero ceiling (nothing measured) warns about every arm
/// that measured something.
pub fn ceiling_warnings(
    ceiling: f64,
    ceiling_min: f64,
    ceiling_max: f64,
    runs: usize,
    arms: &[(&str, f64)],
) -> Vec<String> {
    if !ceiling.is_finite() {
        return Vec::new();
    }
    let spread = if ceiling_min.is_finite() && ceiling_max.is_finite() {
        (ceiling_max - ceiling_min).max(0.0)
    } else {
        0.0
    };
    let margin = spread.max(0.05 * ceiling);
    arms.iter()
        .filter(|(_, g)| g.is_finite() && *g > 0.0 && *g > ceiling + margin)
        .map(|(name, g)| {
            format!(
                "the ceiling is not a ceiling: arm {name} at {g:.3} GB/s beats the ceiling's {ceiling:.3} GB/s \
                 (median of {runs} run(s), {ceiling_min:.3}-{ceiling_max:.3}) by {:.1}%, more than the allowed {:.3} GB/s \
                 (the ceiling's spread, or 5% if larger): the ceiling sweep misses a faster way to read these drives",
                (g / ceiling.max(1e-12) - 1.0) * 100.0,
                margin
            )
        })
        .collect()
}

/// Median (of an even count: the mean of the middle two).
pub fn median(mut v: Vec<f64>) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v.sort_by(|a, b| a.total_cmp(b));
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

fn percentile(sorted: &[f64], p: f64) -> Option<f64> {
    if sorted.is_empty() {
        return None;
    }
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    Some(sorted[i.min(sorted.len() - 1)])
}

/// The tensors to read, in a seeded random order (Fisher-Yates, splitmix64).
pub fn decode_order<'m>(model: &'m Model, filter: &str, seed: u64) -> Vec<&'m TensorRef> {
    let mut v: Vec<&TensorRef> = model
        .catalog()
        .tensors()
        .iter()
        .filter(|t| t.name.contains(filter))
        .collect();
    let mut state = seed;
    let mut next = || {
        state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    };
    for i in (1..v.len()).rev() {
        let j = (next() % (i as u64 + 1)) as usize;
        v.swap(i, j);
    }
    v
}

/// `Cached:` from /proc/meminfo, in bytes.
pub fn page_cache_bytes() -> i64 {
    std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("Cached:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|kb| kb.parse::<i64>().ok())
        })
        .map_or(0, |kb| kb * 1024)
}

/// Drops the page cache of every shard, then samples pages with
/// `RWF_NOWAIT` reads (which fail with EAGAIN for a page not in the cache):
/// true when no sampled page is still resident.
pub fn evict(model: &Model) -> bool {
    let mut cold = true;
    for f in model.files() {
        let _ = rustix::fs::fadvise(f.buffered(), 0, None, rustix::fs::Advice::DontNeed);
        let pages = f.size / 4096;
        let mut buf = [0u8; 1];
        for k in 0..64u64 {
            let off = pages * k / 64 * 4096;
            let r = rustix::io::preadv2(
                f.buffered(),
                &mut [IoSliceMut::new(&mut buf)],
                off,
                rustix::io::ReadWriteFlags::NOWAIT,
            );
            if matches!(r, Ok(n) if n > 0) {
                cold = false;
            }
        }
    }
    cold
}

struct Timed {
    bytes: u64,
    seconds: f64,
    /// Process CPU seconds over the timed region only (setup excluded).
    cpu_s: f64,
    latencies: Vec<f64>,
    timeline: Option<Vec<(f64, Vec<u64>)>>,
    timeline_start_unix: Option<f64>,
    drives: Option<Vec<(String, u64, f64)>>,
    /// A rate the arm measured itself (fio's `bw_bytes`), instead of
    /// bytes / seconds.
    gbps: Option<f64>,
    sweep_max_gbps: Option<f64>,
    config: Option<String>,
    ceiling: Option<CeilingReport>,
    fio: Option<fio::FioReport>,
}

impl Timed {
    fn new(bytes: u64, seconds: f64, cpu_s: f64, latencies: Vec<f64>) -> Self {
        Timed {
            bytes,
            seconds,
            cpu_s,
            latencies,
            timeline: None,
            timeline_start_unix: None,
            drives: None,
            gbps: None,
            sweep_max_gbps: None,
            config: None,
            ceiling: None,
            fio: None,
        }
    }
}

fn run_arm(
    model: &Model,
    cfg: &BenchConfig,
    arm: Arm,
    order: &[&TensorRef],
    progress: &mut dyn FnMut(f64),
) -> Result<RunResult> {
    let cold = match arm {
        Arm::Buffered | Arm::Mmap => {
            let c = evict(model);
            if !c {
                tracing::warn!(
                    arm = arm.name(),
                    "page-cache eviction did not take: some shard pages are still resident; this run is not cold"
                );
            }
            Some(c)
        }
        _ => None,
    };
    let cache0 = page_cache_bytes();
    let timed = match arm {
        Arm::Ceiling => {
            let paths: Vec<PathBuf> = model.files().iter().map(|f| f.path.clone()).collect();
            let r = ceiling::sweep(&paths, &cfg.ceiling)?;
            // Several drives: the figure is already a run of its own.
            let again = match (cfg.sweep_figure, r.drives.as_slice()) {
                (SweepFigure::Rerun, [d]) => Some(ceiling::sweep(&paths, &cfg.ceiling.only(d.best))?),
                _ => None,
            };
            progress(1.0);
            let fig = again.as_ref().unwrap_or(&r);
            let mut t = Timed::new(fig.bytes, fig.seconds, fig.cpu_seconds, Vec::new());
            t.gbps = Some(fig.gbps);
            t.sweep_max_gbps = again.is_some().then_some(r.gbps);
            t.config = Some(r.best_labels());
            t.ceiling = Some(r);
            t
        }
        Arm::Fio => {
            let paths: Vec<PathBuf> = model.files().iter().map(|f| f.path.clone()).collect();
            let drives: Vec<Vec<PathBuf>> = ceiling::drives_of(&paths)?.into_iter().map(|(_, f)| f).collect();
            let r = fio::sweep(&drives, &cfg.fio)?;
            let again = match cfg.sweep_figure {
                SweepFigure::Rerun => Some(fio::sweep(&drives, &cfg.fio.only(r.best))?),
                SweepFigure::Max => None,
            };
            progress(1.0);
            let fig = again.as_ref().unwrap_or(&r);
            let mut t = Timed::new(fig.bytes, fig.seconds, fig.cpu_s, Vec::new());
            t.gbps = Some(fig.gbps);
            t.sweep_max_gbps = again.is_some().then_some(r.gbps);
            t.config = Some(r.best_label.clone());
            t.fio = Some(r);
            t
        }
        Arm::Engine | Arm::EngineRoute(_) | Arm::Pread => {
            let ecfg = cfg
                .engine
                .clone()
                // The engine's own choice (`auto`: io_uring, with pread
                // workers for a drive that completes reads inline, each
                // choice in the drive's stats; a fallback for want of
                // io_uring is warned) unless --backend says otherwise.
                .backend(if arm == Arm::Pread {
                    BackendChoice::Pread
                } else {
                    cfg.engine.backend
                })
                .route(match arm {
                    Arm::EngineRoute(r) => Some(r),
                    _ => cfg.engine.route,
                });
            let engine = Engine::new(model, ecfg)?;
            let _said = crate::warnings::Watch(|| engine.warnings());
            let spec = model.slot_spec_for_largest(&cfg.filter)?;
            let arena = engine.arena(spec, cfg.concurrency.max(1))?;
            let before: Vec<u64> = engine.stats().drives.iter().map(|d| d.bytes).collect();
            let mut t = engine_reads(&engine, &arena, order, cfg.timeline_ms, progress)?;
            let after = engine.stats().drives;
            let total: u64 = after.iter().zip(&before).map(|(d, b)| d.bytes - b).sum();
            t.drives = Some(
                after
                    .iter()
                    .zip(&before)
                    .map(|(d, b)| {
                        (
                            d.device.clone(),
                            d.bytes - b,
                            (d.bytes - b) as f64 / total.max(1) as f64,
                        )
                    })
                    .collect(),
            );
            t
        }
        Arm::Buffered | Arm::Mmap => thread_reads(model, cfg, arm, order, progress)?,
    };
    let cpu_s = timed.cpu_s;
    let cache_growth_bytes = page_cache_bytes() - cache0;
    let mut lat = timed.latencies;
    lat.sort_by(|a, b| a.total_cmp(b));
    let gb = timed.bytes as f64 / 1e9;
    Ok(RunResult {
        bytes: timed.bytes,
        seconds: timed.seconds,
        gbps: timed.gbps.unwrap_or(gb / timed.seconds.max(1e-9)),
        cpu_s,
        cpu_s_per_gb: cpu_s / gb.max(1e-12),
        p50_ms: percentile(&lat, 0.50).map(|s| s * 1e3),
        p99_ms: percentile(&lat, 0.99).map(|s| s * 1e3),
        cache_growth_bytes,
        cold,
        sweep_max_gbps: timed.sweep_max_gbps,
        timeline: timed.timeline,
        timeline_start_unix: timed.timeline_start_unix,
        drives: timed.drives,
        config: timed.config,
        ceiling: timed.ceiling,
        fio: timed.fio,
    })
}

fn engine_reads(
    engine: &Engine,
    arena: &Arena,
    order: &[&TensorRef],
    timeline_ms: Option<u64>,
    progress: &mut dyn FnMut(f64),
) -> Result<Timed> {
    let done = std::sync::atomic::AtomicBool::new(false);
    std::thread::scope(|s| {
        // The sampler: per-drive bytes every interval, for timelines.
        let sampler = timeline_ms.map(|ms| {
            let done = &done;
            s.spawn(move || {
                let t0 = Instant::now();
                let unix0 = std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map_or(0.0, |d| d.as_secs_f64());
                let base: Vec<u64> = engine.stats().drives.iter().map(|d| d.bytes).collect();
                let mut points = Vec::new();
                while !done.load(Ordering::Relaxed) {
                    std::thread::sleep(std::time::Duration::from_millis(ms.max(1)));
                    let now: Vec<u64> = engine
                        .stats()
                        .drives
                        .iter()
                        .zip(&base)
                        .map(|(d, b)| d.bytes - b)
                        .collect();
                    points.push((t0.elapsed().as_secs_f64(), now));
                }
                (unix0, points)
            })
        });
        let r = engine_pipeline(engine, arena, order, progress);
        done.store(true, Ordering::Relaxed);
        let timeline = sampler.map(|h| h.join().expect("sampler panicked"));
        r.map(|mut t| {
            if let Some((unix0, points)) = timeline {
                t.timeline = Some(points);
                t.timeline_start_unix = Some(unix0);
            }
            t
        })
    })
}

fn engine_pipeline(
    engine: &Engine,
    arena: &Arena,
    order: &[&TensorRef],
    progress: &mut dyn FnMut(f64),
) -> Result<Timed> {
    let mut pending = VecDeque::with_capacity(arena.len());
    let mut latencies = Vec::with_capacity(order.len());
    let mut bytes = 0u64;
    let cpu0 = process_cpu_seconds();
    let t0 = Instant::now();
    let mut last_report = t0;
    for (i, t) in order.iter().enumerate() {
        let slot = loop {
            if let Ok(s) = arena.take() {
                break s;
            }
            let (start, ticket): (Instant, weightstream::Ticket) =
                pending.pop_front().expect("a slot is out, so a read is pending");
            let loaded = ticket.wait()?;
            latencies.push(start.elapsed().as_secs_f64());
            bytes += loaded.len() as u64;
        };
        pending.push_back((Instant::now(), engine.read(t, slot)?));
        if last_report.elapsed().as_millis() >= 100 {
            last_report = Instant::now();
            progress(i as f64 / order.len() as f64);
        }
    }
    while let Some((start, ticket)) = pending.pop_front() {
        let loaded = ticket.wait()?;
        latencies.push(start.elapsed().as_secs_f64());
        bytes += loaded.len() as u64;
    }
    let seconds = t0.elapsed().as_secs_f64();
    let cpu_s = process_cpu_seconds() - cpu0;
    progress(1.0);
    Ok(Timed::new(bytes, seconds, cpu_s, latencies))
}

/// The baselines users would write: `concurrency` threads, each reading one
/// tensor at a time (buffered `pread` into a heap buffer, or from a map)
/// and copying it into its slot.
fn thread_reads(
    model: &Model,
    cfg: &BenchConfig,
    arm: Arm,
    order: &[&TensorRef],
    progress: &mut dyn FnMut(f64),
) -> Result<Timed> {
    let threads = cfg.concurrency.max(1);
    let spec = SlotSpec::new(model.catalog().largest(&cfg.filter).unwrap_or(1).max(1) as usize);
    let arena = Arena::new(spec, threads)?;
    let maps: Vec<memmap2::Mmap> = if arm == Arm::Mmap {
        model
            .files()
            .iter()
            .map(|f| {
                // SAFETY: the shards are opened read-only and weightstream
                // never writes them; a concurrent writer outside this process
                // would make any reader see torn bytes, mmap or not.
                unsafe { memmap2::Mmap::map(f.buffered()) }.map_err(|e| Error::io(&f.path, "mmap", e))
            })
            .collect::<Result<_>>()?
    } else {
        Vec::new()
    };
    let next = AtomicUsize::new(0);
    let cpu0 = process_cpu_seconds();
    let t0 = Instant::now();
    let results: Vec<Result<(u64, Vec<f64>)>> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..threads)
            .map(|_| {
                let mut slot = arena.take().expect("one slot per thread");
                let (next, maps) = (&next, &maps);
                s.spawn(move || -> Result<(u64, Vec<f64>)> {
                    let mut heap = vec![0u8; if arm == Arm::Buffered { spec.capacity } else { 0 }];
                    let (mut bytes, mut lat) = (0u64, Vec::new());
                    loop {
                        let i = next.fetch_add(1, Ordering::Relaxed);
                        let Some(t) = order.get(i) else { break };
                        let start = Instant::now();
                        let len = t.len as usize;
                        let dst = &mut slot.as_bytes_mut()[..len];
                        if arm == Arm::Buffered {
                            let file = &model.files()[t.shard];
                            let buf = &mut heap[..len];
                            file.buffered()
                                .read_exact_at(buf, t.offset)
                                .map_err(|e| Error::io(&file.path, "buffered read", e))?;
                            dst.copy_from_slice(buf);
                        } else {
                            let m = &maps[t.shard];
                            dst.copy_from_slice(&m[t.offset as usize..t.offset as usize + len]);
                        }
                        lat.push(start.elapsed().as_secs_f64());
                        bytes += len as u64;
                    }
                    Ok((bytes, lat))
                })
            })
            .collect();
        let mut last = Instant::now();
        while hs.iter().any(|h| !h.is_finished()) {
            std::thread::sleep(std::time::Duration::from_millis(20));
            if last.elapsed().as_millis() >= 100 {
                last = Instant::now();
                progress(next.load(Ordering::Relaxed).min(order.len()) as f64 / order.len() as f64);
            }
        }
        hs.into_iter()
            .map(|h| h.join().expect("bench thread panicked"))
            .collect()
    });
    let seconds = t0.elapsed().as_secs_f64();
    let cpu_s = process_cpu_seconds() - cpu0;
    progress(1.0);
    let (mut bytes, mut latencies) = (0, Vec::new());
    for r in results {
        let (b, l) = r?;
        bytes += b;
        latencies.extend(l);
    }
    Ok(Timed::new(bytes, seconds, cpu_s, latencies))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_arm_beyond_the_ceilings_spread_is_named_with_the_figures() {
        // Ceiling 3.4 (3.3-3.5 over the runs); fio 7.5: the ceiling is not one.
        let w = ceiling_warnings(3.4, 3.3, 3.5, 3, &[("fio", 7.5), ("engine", 3.45), ("pread", 3.0)]);
        assert_eq!(w.len(), 1, "{w:?}");
        assert!(
            w[0].contains("arm fio") && w[0].contains("7.500") && w[0].contains("3.400"),
            "{w:?}"
        );
        assert!(w[0].contains("3.300-3.500") && w[0].contains("3 run(s)"), "{w:?}");
        assert!(w[0].contains("the ceiling is not a ceiling"), "{w:?}");
    }

    #[test]
    fn the_margin_is_the_spread_or_five_percent_whichever_is_larger() {
        // Spread 0 (one run): 5% of 2.0 = 0.1 is the margin.
        assert!(ceiling_warnings(2.0, 2.0, 2.0, 1, &[("engine", 2.09)]).is_empty());
        assert_eq!(ceiling_warnings(2.0, 2.0, 2.0, 1, &[("engine", 2.11)]).len(), 1);
        // A wide spread (1.5-2.5) is the margin: 2.9 is inside it.
        assert!(ceiling_warnings(2.0, 1.5, 2.5, 3, &[("engine", 2.9)]).is_empty());
        assert_eq!(ceiling_warnings(2.0, 1.5, 2.5, 3, &[("engine", 3.1)]).len(), 1);
        // Below the ceiling: never.
        assert!(ceiling_warnings(2.0, 1.9, 2.1, 3, &[("engine", 1.0)]).is_empty());
    }

    #[test]
    fn non_finite_and_empty_figures_do_not_warn_but_a_zero_ceiling_does() {
        assert!(ceiling_warnings(2.0, 2.0, 2.0, 1, &[("engine", f64::NAN), ("mmap", f64::INFINITY)]).is_empty());
        assert!(ceiling_warnings(f64::NAN, 0.0, 0.0, 1, &[("engine", 1.0)]).is_empty());
        assert!(ceiling_warnings(2.0, f64::INFINITY, 0.0, 1, &[("engine", 2.05)]).is_empty());
        assert_eq!(
            ceiling_warnings(0.0, 0.0, 0.0, 1, &[("engine", 1.0), ("pread", 0.0)]).len(),
            1
        );
        assert!(ceiling_warnings(2.0, 2.0, 2.0, 1, &[]).is_empty());
    }

    fn run_at(gbps: f64, config: &str) -> RunResult {
        RunResult {
            bytes: 1,
            seconds: 1.0,
            gbps,
            cpu_s: 0.0,
            cpu_s_per_gb: 0.0,
            p50_ms: None,
            p99_ms: None,
            cache_growth_bytes: 0,
            cold: None,
            sweep_max_gbps: None,
            timeline: None,
            timeline_start_unix: None,
            drives: None,
            config: Some(config.into()),
            ceiling: None,
            fio: None,
        }
    }

    #[test]
    fn the_reported_configuration_is_the_median_runs() {
        let runs = vec![run_at(3.0, "a"), run_at(9.0, "b"), run_at(5.0, "c")];
        assert_eq!(median_run(&runs).unwrap().config.as_deref(), Some("c"));
        assert!(median_run(&[]).is_none());
        let runs = vec![run_at(3.0, "a"), run_at(9.0, "b")];
        assert_eq!(median_run(&runs).unwrap().config.as_deref(), Some("b"));
    }
}
