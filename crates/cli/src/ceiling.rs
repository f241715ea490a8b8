//! The device ceiling: the most the drives deliver, measured over a short
//! sweep of read configurations, so every weightstream figure can be stated
//! as a ratio to what the drives did in the same run.
//!
//! One configuration is not a ceiling: on a fast drive that completes reads
//! inline in the submitter (zram), fio's plain `--rw=read --iodepth=16` job
//! reaches 0.4 of what the same drive does with reads punted to io-wq
//! workers and registered buffers. [`sweep`] therefore reads each drive
//! alone with every [`ReadConfig`] of a [`SweepConfig`] (block size, reads
//! in flight per reader, readers, inline or async submission, plain or
//! registered buffers), keeps every configuration's figure, reports the best
//! and the configuration that reached it ([`choose`]), then reads all drives
//! at once, each with its best configuration, for the total.
//!
//! Each reader is a thread with its own io_uring (`fio --numjobs`). Its
//! reads are sequential blocks over its own part of the drive's files (the
//! files taken one after the other; reader k of n starts k/n of the way
//! in). Sequential and not random: the engine reads whole tensors (multi-MiB
//! contiguous extents), O_DIRECT takes the page cache and its read-ahead out
//! of the picture, and fio's `randread` and `read` reach the same figure on
//! the drives measured here (docs/architecture.md). Each configuration is
//! bounded twice: a byte cap and a time cap ([`SweepConfig::bytes`],
//! [`SweepConfig::seconds`]); files smaller than the byte cap are read round
//! again (every pass is a device read: O_DIRECT), and each configuration
//! starts where the one before it stopped, so consecutive configurations do
//! not re-read the same blocks. A configuration whose bytes in flight are
//! more than twice what the drive read within the time cap at the best rate
//! so far is skipped (said, with the reason): it could not be measured
//! within the bound, and it keeps a slow drive's sweep short.
//!
//! CPU seconds are `getrusage(RUSAGE_SELF)` deltas over the timed region:
//! every thread of the process, io_uring's io-wq workers (`iou-wrk-*`) and
//! SQPOLL threads (`iou-sqp-*`) included; checked against
//! `/proc/self/task/*/stat` (the `rusage_counts_io_wq_workers` test and
//! docs/architecture.md).

use std::fs::File;
use std::mem::ManuallyDrop;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

use io_uring::{opcode, squeue, types, IoUring};
use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use weightstream::open_direct;

const MIB: usize = 1 << 20;

/// How a reader submits its reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
pub enum Submit {
    /// As the kernel chooses: a device that completes in the submitter's
    /// context (zram, brd, pmem) does the work inside `io_uring_enter`.
    Inline,
    /// `IOSQE_ASYNC` on every SQE: each read goes to io-wq workers (fio
    /// `--force_async=1`).
    Async,
}

/// Which buffers a reader reads into.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
pub enum Buffers {
    /// `IORING_OP_READ` into plain memory.
    Plain,
    /// `IORING_OP_READ_FIXED` into registered (pinned) buffers (fio
    /// `--fixedbufs=1`).
    #[value(alias = "registered")]
    Fixed,
}

impl Submit {
    pub fn name(self) -> &'static str {
        match self {
            Submit::Inline => "inline",
            Submit::Async => "async",
        }
    }
}

impl Buffers {
    pub fn name(self) -> &'static str {
        match self {
            Buffers::Plain => "plain",
            Buffers::Fixed => "fixed",
        }
    }
}

/// One way of reading a drive: one point of the sweep.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct ReadConfig {
    /// Bytes per read (a multiple of 4096).
    pub bs: usize,
    /// Reads in flight per reader.
    pub qd: usize,
    /// Reader threads per drive, each with its own ring.
    pub readers: usize,
    pub submit: Submit,
    pub buffers: Buffers,
}

impl ReadConfig {
    /// fio's default job: 1 MiB blocks, 16 in flight, one reader, inline,
    /// plain buffers (what `ceiling` measured before the sweep).
    #[cfg(test)]
    pub const BASELINE: ReadConfig = ReadConfig {
        bs: MIB,
        qd: 16,
        readers: 1,
        submit: Submit::Inline,
        buffers: Buffers::Plain,
    };

    /// Bytes in flight over all readers.
    pub fn window(&self) -> u64 {
        self.bs as u64 * self.qd as u64 * self.readers as u64
    }

    /// `bs=1MiB qd=16 readers=1 submit=inline buffers=plain`.
    pub fn label(&self) -> String {
        format!(
            "bs={} qd={} readers={} submit={} buffers={}",
            size_label(self.bs as u64),
            self.qd,
            self.readers,
            self.submit.name(),
            self.buffers.name()
        )
    }

    /// Refuses what cannot be run: a block size that is not a non-zero
    /// multiple of 4096 (or above 1 GiB), a zero or huge depth or reader
    /// count.
    pub fn validate(&self) -> Result<()> {
        if self.bs == 0 || !self.bs.is_multiple_of(4096) || self.bs > 1 << 30 {
            return Err(Error::Config(format!(
                "block size {} must be a non-zero multiple of 4096, at most 1 GiB",
                self.bs
            )));
        }
        if self.qd == 0 || self.qd > 4096 {
            return Err(Error::Config(format!(
                "queue depth {} must be between 1 and 4096",
                self.qd
            )));
        }
        if self.readers == 0 || self.readers > 64 {
            return Err(Error::Config(format!(
                "readers {} must be between 1 and 64",
                self.readers
            )));
        }
        Ok(())
    }
}

impl std::fmt::Display for ReadConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.label())
    }
}

/// `4MiB`, `64KiB`, `1000B`; sizes that are not whole units with one
/// decimal (`17.3GiB`).
pub fn size_label(b: u64) -> String {
    for (shift, unit) in [(30, "GiB"), (20, "MiB"), (10, "KiB")] {
        if b >= 1 << shift {
            return if b.is_multiple_of(1 << shift) {
                format!("{}{unit}", b >> shift)
            } else {
                format!("{:.1}{unit}", b as f64 / (1u64 << shift) as f64)
            };
        }
    }
    format!("{b}B")
}

/// What [`sweep`] tries, and its bounds per configuration.
#[derive(Debug, Clone)]
pub struct SweepConfig {
    /// Tried in this order on each drive (smaller windows first, so the skip
    /// rule has a rate to go by).
    pub configs: Vec<ReadConfig>,
    /// Byte cap per configuration and drive (the files are read round again
    /// if they hold fewer bytes).
    pub bytes: u64,
    /// Time cap per configuration: no read is issued after it (the reads in
    /// flight then complete and count).
    pub seconds: f64,
    /// `full`, `quick`, or `custom`, for the report.
    pub name: String,
    /// Read into buffers on transparent huge pages (`MADV_HUGEPAGE`, 2 MiB
    /// aligned). Default: a device whose requests are capped in segments
    /// (virtio) takes 4 MiB of physically contiguous memory in one request
    /// instead of 1 MiB of 4 KiB pages; nothing reads slower for it. False:
    /// 4 KiB pages, as fio's default buffers (`--mem=malloc`).
    pub huge_pages: bool,
}

impl SweepConfig {
    /// Every combination of 1 and 4 MiB blocks, depth 16 and 64, 1 and 2
    /// readers, inline and async, plain and registered buffers: 32
    /// configurations, each up to 2 GiB or 0.5 s.
    pub fn full() -> Self {
        SweepConfig {
            configs: Self::product(
                &[MIB, 4 * MIB],
                &[16, 64],
                &[1, 2],
                &[Submit::Inline, Submit::Async],
                &[Buffers::Plain, Buffers::Fixed],
            ),
            bytes: 2 << 30,
            seconds: 0.5,
            name: "full".into(),
            huge_pages: true,
        }
    }

    /// Eight configurations, each up to 1 GiB or 0.25 s: the baseline, a
    /// deep queue, two readers, async punt with registered buffers, and the
    /// large windows (4 MiB x 64) that won the full sweep on the virtio disk
    /// (async + registered 4 MiB blocks won on zram; docs/architecture.md).
    pub fn quick() -> Self {
        let c = |bs: usize, qd: usize, readers: usize, submit: Submit, buffers: Buffers| ReadConfig {
            bs,
            qd,
            readers,
            submit,
            buffers,
        };
        use Buffers::{Fixed, Plain};
        use Submit::{Async, Inline};
        let mut configs = vec![
            c(MIB, 16, 1, Inline, Plain),
            c(MIB, 16, 1, Async, Fixed),
            c(MIB, 16, 2, Inline, Fixed),
            c(MIB, 64, 1, Inline, Plain),
            c(4 * MIB, 16, 1, Async, Fixed),
            c(4 * MIB, 16, 2, Async, Fixed),
            c(4 * MIB, 64, 1, Async, Fixed),
            c(4 * MIB, 64, 2, Inline, Fixed),
        ];
        configs.sort_by_key(ReadConfig::window);
        SweepConfig {
            configs,
            bytes: 1 << 30,
            seconds: 0.25,
            name: "quick".into(),
            huge_pages: true,
        }
    }

    /// Every combination of the given values, smaller windows first.
    pub fn product(
        bs: &[usize],
        qd: &[usize],
        readers: &[usize],
        submit: &[Submit],
        buffers: &[Buffers],
    ) -> Vec<ReadConfig> {
        let mut v = Vec::new();
        for &bs in bs {
            for &qd in qd {
                for &readers in readers {
                    for &submit in submit {
                        for &buffers in buffers {
                            v.push(ReadConfig {
                                bs,
                                qd,
                                readers,
                                submit,
                                buffers,
                            });
                        }
                    }
                }
            }
        }
        // Stable: equal windows keep the order above.
        v.sort_by_key(ReadConfig::window);
        v.dedup();
        v
    }

    pub fn validate(&self) -> Result<()> {
        if self.configs.is_empty() {
            return Err(Error::Config("ceiling sweep: no configuration to try".into()));
        }
        for c in &self.configs {
            c.validate()?;
        }
        if self.bytes == 0 {
            return Err(Error::Config(
                "ceiling sweep: the byte cap per configuration is 0".into(),
            ));
        }
        if !(self.seconds.is_finite() && self.seconds > 0.0 && self.seconds <= 3600.0) {
            return Err(Error::Config(format!(
                "ceiling sweep: the time cap per configuration ({} s) must be above 0 and at most 3600",
                self.seconds
            )));
        }
        Ok(())
    }
}

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
    fn measured(config: ReadConfig, bytes: u64, seconds: f64, cpu_s: f64) -> Self {
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

    fn not_measured(config: ReadConfig, error: Option<String>, skipped: Option<String>) -> Self {
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

/// CPU seconds (user, system) this process has used so far, all threads
/// (`getrusage(RUSAGE_SELF)`: io_uring's io-wq workers and SQPOLL threads
/// included, live or exited; see docs/architecture.md).
pub fn process_cpu() -> (f64, f64) {
    rusage(libc::RUSAGE_SELF)
}

/// CPU seconds (user + system) of this process's children that have been
/// waited for (`getrusage(RUSAGE_CHILDREN)`: a finished fio, all its
/// threads and io-wq workers).
pub fn children_cpu_seconds() -> f64 {
    let (u, s) = rusage(libc::RUSAGE_CHILDREN);
    u + s
}

fn rusage(who: libc::c_int) -> (f64, f64) {
    let Some(u) = getrusage(who) else {
        return (0.0, 0.0);
    };
    let t = |tv: libc::timeval| tv.tv_sec as f64 + tv.tv_usec as f64 * 1e-6;
    (t(u.ru_utime), t(u.ru_stime))
}

/// Peak resident set of this process so far, bytes (`ru_maxrss`).
pub fn peak_rss_bytes() -> u64 {
    getrusage(libc::RUSAGE_SELF).map_or(0, |u| u.ru_maxrss.max(0) as u64 * 1024)
}

fn getrusage(who: libc::c_int) -> Option<libc::rusage> {
    let mut u = std::mem::MaybeUninit::<libc::rusage>::zeroed();
    // SAFETY: getrusage writes one `rusage` into the pointer it is given; the
    // buffer is a properly sized and aligned `rusage`.
    let rc = unsafe { libc::getrusage(who, u.as_mut_ptr()) };
    // SAFETY: on success the struct is initialised (and it was zeroed
    // before: every bit pattern of it is valid anyway).
    (rc == 0).then(|| unsafe { u.assume_init() })
}

/// CPU seconds (user + system) this process has used so far, all threads.
pub fn process_cpu_seconds() -> f64 {
    let (u, s) = process_cpu();
    u + s
}

#[cfg(test)]
/// One live thread of this process and its CPU seconds, from
/// `/proc/self/task/*/stat` (clock-tick resolution).
#[derive(Debug, Clone)]
pub struct TaskCpu {
    pub tid: u32,
    /// The thread's name (`iou-wrk-<tid>` for an io-wq worker, `iou-sqp-<tid>`
    /// for an SQPOLL thread).
    pub comm: String,
    pub cpu_s: f64,
}

#[cfg(test)]
/// Every live thread of this process with its CPU seconds. Threads that
/// have exited are gone from the list (their time stays in getrusage).
pub fn task_cpu() -> Vec<TaskCpu> {
    let tck = rustix::param::clock_ticks_per_second() as f64;
    let Ok(dir) = std::fs::read_dir("/proc/self/task") else {
        return Vec::new();
    };
    dir.flatten()
        .filter_map(|e| {
            let tid = e.file_name().to_str()?.parse().ok()?;
            let stat = std::fs::read_to_string(e.path().join("stat")).ok()?;
            let (open, close) = (stat.find('(')?, stat.rfind(')')?);
            let comm = stat.get(open + 1..close)?.to_string();
            // After ") ": state ppid pgrp session tty tpgid flags minflt
            // cminflt majflt cmajflt utime stime (fields 3..=15 of stat(5)).
            let f: Vec<&str> = stat.get(close + 2..)?.split(' ').collect();
            let ticks = f.get(11)?.parse::<f64>().ok()? + f.get(12)?.parse::<f64>().ok()?;
            Some(TaskCpu {
                tid,
                comm,
                cpu_s: ticks / tck,
            })
        })
        .collect()
}

#[cfg(test)]
/// What getrusage and `/proc/self/task` say about one stretch of reads
/// punted to io-wq workers ([`cpu_accounting`]).
#[derive(Debug, Clone, Copy, Serialize)]
pub struct CpuAccounting {
    /// `getrusage(RUSAGE_SELF)` delta.
    pub rusage_s: f64,
    /// Sum of the deltas of every live thread in `/proc/self/task`.
    pub tasks_s: f64,
    /// The part of `tasks_s` used by io_uring's own threads (`iou-*`).
    pub io_workers_s: f64,
    /// io_uring threads (`iou-*`) alive at the end.
    pub io_workers: usize,
    pub gbps: f64,
}

#[cfg(test)]
/// Reads `path` for `seconds` on the calling thread with `IOSQE_ASYNC` on
/// every read (1 MiB blocks, 32 in flight), so the work runs in io-wq
/// workers, which stay alive with the calling thread to be seen in
/// `/proc/self/task`; returns both accounts of the CPU used. The check
/// behind the claim that getrusage counts io-wq workers (docs/architecture.md).
pub fn cpu_accounting(path: &Path, seconds: f64) -> Result<CpuAccounting> {
    let drives = group(&[path.to_path_buf()])?;
    let d = &drives[0];
    let c = ReadConfig {
        bs: MIB,
        qd: 32,
        readers: 1,
        submit: Submit::Async,
        buffers: Buffers::Plain,
    };
    let plan = Plan::new(d, c.bs);
    if plan.len == 0 {
        return Err(Error::Config(format!("{}: empty file", weightstream::escape(path))));
    }
    let mut reader = Reader::new(d, c, true)?;
    let snap = || -> Vec<(u32, bool, f64)> {
        task_cpu()
            .into_iter()
            .map(|t| (t.tid, t.comm.starts_with("iou-"), t.cpu_s))
            .collect()
    };
    let before = snap();
    let r0 = process_cpu_seconds();
    let t0 = Instant::now();
    let out = reader.run(
        d,
        &plan,
        Part { first: 0, count: None },
        None,
        Some(t0 + Duration::from_secs_f64(seconds.clamp(0.01, 60.0))),
    );
    let elapsed = t0.elapsed().as_secs_f64();
    let rusage_s = process_cpu_seconds() - r0;
    let after = snap();
    if let Some(e) = out.error {
        return Err(e);
    }
    let delta = |io_only: bool| -> f64 {
        after
            .iter()
            .filter(|a| !io_only || a.1)
            .map(|a| a.2 - before.iter().find(|b| b.0 == a.0).map_or(0.0, |b| b.2))
            .sum()
    };
    Ok(CpuAccounting {
        rusage_s,
        tasks_s: delta(false),
        io_workers_s: delta(true),
        io_workers: after.iter().filter(|a| a.1).count(),
        gbps: out.bytes as f64 / 1e9 / elapsed.max(1e-9),
    })
}

/// A drive: its files, opened O_DIRECT once for every reader.
struct Drive {
    device: String,
    files: Vec<PathBuf>,
    opened: Vec<(File, u64)>,
}

/// Opens `paths` O_DIRECT, flushes their dirty pages, and groups them by
/// drive (`st_dev`), in order of first appearance.
fn group(paths: &[PathBuf]) -> Result<Vec<Drive>> {
    if paths.is_empty() {
        return Err(Error::Config("ceiling: no file to read".into()));
    }
    let mut drives: Vec<(u64, Drive)> = Vec::new();
    for p in paths {
        let f = open_direct(p).map_err(|e| Error::io(p, "open(O_DIRECT)", e))?;
        let t = weightstream::FileTopology::probe(p, &f).map_err(|e| Error::io(p, "statx", e))?;
        let size = f.metadata().map_err(|e| Error::io(p, "fstat", e))?.len();
        // A file just written may still have dirty pages; the first O_DIRECT
        // read of them would write them back inside the timed region (seen:
        // 2.6 GB/s instead of 5.8 right after `weightstream gen`). Flushed
        // here, untimed; a file that cannot be synced is read as it is.
        let _ = rustix::fs::fdatasync(&f);
        let d = match drives.iter_mut().find(|g| g.0 == t.dev) {
            Some(g) => &mut g.1,
            None => {
                drives.push((
                    t.dev,
                    Drive {
                        device: t.device.clone(),
                        files: Vec::new(),
                        opened: Vec::new(),
                    },
                ));
                &mut drives.last_mut().expect("just pushed").1
            }
        };
        d.files.push(p.clone());
        d.opened.push((f, size));
    }
    let drives: Vec<Drive> = drives.into_iter().map(|(_, d)| d).collect();
    if let Some(d) = drives.iter().find(|d| d.opened.iter().all(|(_, size)| *size == 0)) {
        return Err(Error::Config(format!(
            "ceiling: drive {}: its files hold no byte to read ({})",
            d.device,
            d.files.iter().map(weightstream::escape).collect::<Vec<_>>().join(", ")
        )));
    }
    Ok(drives)
}

/// `paths` grouped by drive (`st_dev`): (device name, files), in order of
/// first appearance. Each file must open O_DIRECT.
pub fn drives_of(paths: &[PathBuf]) -> Result<Vec<(String, Vec<PathBuf>)>> {
    Ok(group(paths)?.into_iter().map(|d| (d.device, d.files)).collect())
}

/// One read: a block of one file.
#[derive(Debug, Clone, Copy)]
struct Block {
    file: u32,
    off: u64,
    len: u32,
}

/// Every block of every file of a drive, files one after the other, without
/// listing them (a 4 KiB block size over a large model would be millions).
/// The last block of a file is rounded up to 4096 (O_DIRECT returns the
/// bytes up to end of file).
struct Plan {
    bs: u64,
    sizes: Vec<u64>,
    /// Blocks before each file.
    before: Vec<usize>,
    len: usize,
}

impl Plan {
    fn new(drive: &Drive, bs: usize) -> Self {
        let bs = bs as u64;
        let sizes: Vec<u64> = drive.opened.iter().map(|(_, s)| *s).collect();
        let mut before = Vec::with_capacity(sizes.len());
        let mut len = 0usize;
        for s in &sizes {
            before.push(len);
            len = len.saturating_add(s.div_ceil(bs) as usize);
        }
        Plan { bs, sizes, before, len }
    }

    /// Block `i` (< `len`).
    fn get(&self, i: usize) -> Block {
        // The last file whose first block is at or before `i` (files with
        // no block share their `before` with the next one).
        // (`before[0]` is 0, so there is one.) In a run of files with the
        // same `before`, all but the last hold no block.
        let f = self.before.partition_point(|&b| b <= i) - 1;
        let off = (i - self.before[f]) as u64 * self.bs;
        let len = (self.sizes[f] - off).min(self.bs).div_ceil(4096) * 4096;
        Block {
            file: f as u32,
            off,
            len: len as u32,
        }
    }
}

/// Bounds on one run.
#[derive(Debug, Clone, Copy)]
struct Bound {
    /// Per drive (split evenly over its readers).
    bytes: Option<u64>,
    seconds: Option<f64>,
    /// Go round the files again when a reader reaches the end of its part
    /// (only with a cap).
    repeat: bool,
    /// Buffers on huge pages (`MADV_HUGEPAGE`).
    huge: bool,
}

/// One drive read with one configuration, starting `start` bytes in.
struct Job<'a> {
    drive: &'a Drive,
    config: ReadConfig,
    start: u64,
}

/// One job's result within a run.
struct JobOutcome {
    bytes: u64,
    /// From the run's start to this drive's last completion.
    seconds: f64,
    error: Option<Error>,
}

/// A run: several jobs (drives) read at once, one time and CPU measurement.
struct RunOutcome {
    jobs: Vec<JobOutcome>,
    seconds: f64,
    cpu_s: f64,
}

/// `MemAvailable` from /proc/meminfo, bytes.
fn mem_available() -> Option<u64> {
    let s = std::fs::read_to_string("/proc/meminfo").ok()?;
    let l = s.lines().find(|l| l.starts_with("MemAvailable:"))?;
    Some(l.split_whitespace().nth(1)?.parse::<u64>().ok()? * 1024)
}

/// Where readers meet the coordinator: each reader arrives and waits until
/// the coordinator, having seen every reader that was started arrive, opens
/// it. Unlike a `Barrier`, the count is known only once the threads are
/// started (a thread that fails to start is not waited for).
struct Rendezvous {
    state: Mutex<(usize, bool)>,
    cv: Condvar,
}

impl Rendezvous {
    fn new() -> Self {
        Rendezvous {
            state: Mutex::new((0, false)),
            cv: Condvar::new(),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, (usize, bool)> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn arrive_and_wait(&self) {
        let mut g = self.lock();
        g.0 += 1;
        self.cv.notify_all();
        while !g.1 {
            g = self.cv.wait(g).unwrap_or_else(|p| p.into_inner());
        }
    }

    fn wait_for(&self, n: usize) {
        let mut g = self.lock();
        while g.0 < n {
            g = self.cv.wait(g).unwrap_or_else(|p| p.into_inner());
        }
    }

    fn open(&self) {
        self.lock().1 = true;
        self.cv.notify_all();
    }
}

/// A reader's arrival at a [`Rendezvous`], exactly once: at `pass`, or when
/// dropped (a panic unwinding through a reader still arrives).
struct Arrival<'a> {
    at: &'a Rendezvous,
    passed: bool,
}

impl<'a> Arrival<'a> {
    fn new(at: &'a Rendezvous) -> Self {
        Arrival { at, passed: false }
    }

    fn pass(&mut self) {
        if !self.passed {
            self.passed = true;
            self.at.arrive_and_wait();
        }
    }
}

impl Drop for Arrival<'_> {
    fn drop(&mut self) {
        self.pass();
    }
}

/// Opens a [`Rendezvous`] when dropped: whatever happens to the
/// coordinator, no reader waits forever.
struct Opener<'a>(&'a Rendezvous);

impl Drop for Opener<'_> {
    fn drop(&mut self) {
        self.0.open();
    }
}

/// Reads `jobs` at once: every reader of every job sets up (ring, buffers,
/// registration), then all start together; the time and CPU are taken
/// between the start and the moment the last reader has its last
/// completion (set-up and tear-down excluded).
fn run_jobs(jobs: &[Job], bound: Bound) -> RunOutcome {
    // Buffers are faulted in up front (and pinned when registered): refuse
    // to take more than half of the memory available rather than push the
    // machine into reclaim or the OOM killer.
    let window: u64 = jobs.iter().map(|j| j.config.window()).sum();
    if let Some(avail) = mem_available() {
        if window > avail / 2 {
            return RunOutcome {
                jobs: jobs
                    .iter()
                    .map(|j| JobOutcome {
                        bytes: 0,
                        seconds: 0.0,
                        error: Some(Error::Config(format!(
                            "drive {}: {} of buffers (bs x qd x readers) is more than half of the {} available (MemAvailable)",
                            j.drive.device,
                            size_label(window),
                            size_label(avail)
                        ))),
                    })
                    .collect(),
                seconds: 0.0,
                cpu_s: 0.0,
            };
        }
    }
    let plans: Vec<Plan> = jobs.iter().map(|j| Plan::new(j.drive, j.config.bs)).collect();
    let (start, done) = (Rendezvous::new(), Rendezvous::new());
    let mut cpu_s = 0.0;
    let mut seconds = 0.0;
    let mut t0 = Instant::now();
    let results: Vec<Vec<std::result::Result<ReaderOutcome, String>>> = std::thread::scope(|s| {
        let (open_start, open_done) = (Opener(&start), Opener(&done));
        let handles: Vec<Vec<_>> = jobs
            .iter()
            .zip(&plans)
            .map(|(job, plan)| {
                let n = plan.len;
                let r = job.config.readers;
                (0..r)
                    .map(|k| {
                        let (start, done) = (&start, &done);
                        let part = if bound.repeat {
                            // Reader k starts k/r of the way in, from the cursor; goes round.
                            let first = (job.start / job.config.bs as u64) as usize % n.max(1) + k * n / r;
                            Part {
                                first: first % n.max(1),
                                count: None,
                            }
                        } else {
                            let lo = k * n / r;
                            Part {
                                first: lo,
                                count: Some((k + 1) * n / r - lo),
                            }
                        };
                        let budget = bound.bytes.map(|b| b.div_ceil(r as u64));
                        let deadline = bound.seconds.map(Duration::from_secs_f64);
                        std::thread::Builder::new().spawn_scoped(s, move || {
                            let mut g_start = Arrival::new(start);
                            let mut g_done = Arrival::new(done);
                            let reader = Reader::new(job.drive, job.config, bound.huge);
                            g_start.pass();
                            let t = Instant::now();
                            let out = match reader {
                                Ok(mut reader) => {
                                    let out = reader.run(job.drive, plan, part, budget, deadline.map(|d| t + d));
                                    g_done.pass();
                                    out
                                }
                                Err(e) => ReaderOutcome {
                                    bytes: 0,
                                    end: t,
                                    error: Some(e),
                                },
                            };
                            g_done.pass();
                            out
                        })
                    })
                    .collect()
            })
            .collect();
        let started = handles.iter().flatten().filter(|h| h.is_ok()).count();
        start.wait_for(started);
        let cpu0 = process_cpu_seconds();
        t0 = Instant::now();
        drop(open_start);
        done.wait_for(started);
        seconds = t0.elapsed().as_secs_f64();
        cpu_s = process_cpu_seconds() - cpu0;
        drop(open_done);
        handles
            .into_iter()
            .map(|hs| {
                hs.into_iter()
                    .map(|h| match h {
                        Ok(h) => h.join().map_err(|_| "panicked".to_string()),
                        Err(e) => Err(format!("could not be started: {e}")),
                    })
                    .collect()
            })
            .collect()
    });
    let jobs = jobs
        .iter()
        .zip(results)
        .map(|(job, rs)| {
            let mut o = JobOutcome {
                bytes: 0,
                seconds: 0.0,
                error: None,
            };
            for r in rs {
                match r {
                    Ok(r) => {
                        o.bytes += r.bytes;
                        o.seconds = o.seconds.max(r.end.saturating_duration_since(t0).as_secs_f64());
                        if let Some(e) = r.error {
                            o.error.get_or_insert(e);
                        }
                    }
                    Err(why) => {
                        o.error.get_or_insert(Error::Config(format!(
                            "ceiling: a reader thread of drive {} {why}",
                            job.drive.device
                        )));
                    }
                }
            }
            o
        })
        .collect();
    RunOutcome { jobs, seconds, cpu_s }
}

/// Which blocks a reader reads: from `first` on, `count` of them (`None`:
/// round and round until a cap).
#[derive(Debug, Clone, Copy)]
struct Part {
    first: usize,
    count: Option<usize>,
}

struct ReaderOutcome {
    bytes: u64,
    /// When its last read completed.
    end: Instant,
    error: Option<Error>,
}

/// A reader's `qd` buffers of `bs` bytes, one anonymous mapping
/// (`MADV_DONTFORK`), faulted in before the timed region. With `huge`, the
/// buffers start on a 2 MiB boundary and are advised `MADV_HUGEPAGE`:
/// physically contiguous buffers make fewer, larger device requests where
/// a request's segment count is capped (virtio: 254 segments, 1 MiB of 4 KiB
/// pages; measured: 1.4-1.5 GB/s with 4 KiB pages, 3.5-3.8 GB/s with huge
/// pages, same configuration, same files).
struct BufMap {
    /// The mapping (for munmap).
    map: std::ptr::NonNull<u8>,
    map_len: usize,
    /// The first buffer.
    base: *mut u8,
    len: usize,
    bs: usize,
}

const HUGE: usize = 2 << 20;

impl BufMap {
    fn new(bs: usize, qd: usize, huge: bool) -> Result<Self> {
        use rustix::mm::{Advice, MapFlags, ProtFlags};
        let len = bs
            .checked_mul(qd)
            .filter(|&l| l <= isize::MAX as usize - HUGE)
            .ok_or_else(|| Error::Config(format!("{qd} buffers of {bs} bytes overflow")))?;
        let map_len = if huge { len + HUGE } else { len };
        // SAFETY: a fresh anonymous private mapping at an address of the
        // kernel's choosing aliases no existing memory.
        let map = unsafe {
            rustix::mm::mmap_anonymous(
                std::ptr::null_mut(),
                map_len,
                ProtFlags::READ | ProtFlags::WRITE,
                MapFlags::PRIVATE,
            )
        }
        .map_err(|e| Error::io("<ceiling buffers>", "mmap", e))?;
        let map = std::ptr::NonNull::new(map.cast::<u8>())
            .ok_or_else(|| Error::Config("mmap returned a null address".into()))?;
        let skip = if huge {
            map.as_ptr().align_offset(HUGE).min(HUGE)
        } else {
            0
        };
        // SAFETY: `skip <= HUGE`, and the mapping is `len + HUGE` bytes when
        // `huge` (`skip` is 0 otherwise): `base..base+len` is inside it.
        let base = unsafe { map.as_ptr().add(skip) };
        let me = BufMap {
            map,
            map_len,
            base,
            len,
            bs,
        };
        if huge {
            // SAFETY: exactly the mapping just made, owned by `me`; the advice
            // changes how it is backed, never its contents or address. A
            // kernel without THP refuses it: small pages then.
            let _ = unsafe { rustix::mm::madvise(map.as_ptr().cast(), map_len, Advice::LinuxHugepage) };
        }
        // SAFETY: as above; fork() then does not copy memory the kernel may
        // be writing.
        let _ = unsafe { rustix::mm::madvise(map.as_ptr().cast(), map_len, Advice::LinuxDontFork) };
        // Fault every page in now (one write per page), outside the timing.
        for off in (0..len).step_by(4096) {
            // SAFETY: `off < len`: inside the buffers, which nothing else
            // references yet.
            unsafe { base.add(off).write_volatile(0) };
        }
        Ok(me)
    }

    /// Buffer `i` (< qd).
    fn buf(&self, i: usize) -> *mut u8 {
        debug_assert!((i + 1) * self.bs <= self.len);
        // SAFETY: `i * bs + bs <= len` (i < qd): inside the buffers.
        unsafe { self.base.add(i * self.bs) }
    }
}

impl Drop for BufMap {
    fn drop(&mut self) {
        // SAFETY: the mapping made by `new`; its owner (a `Reader`) drops it
        // only with nothing in flight and after the ring that registered it.
        let _ = unsafe { rustix::mm::munmap(self.map.as_ptr().cast(), self.map_len) };
    }
}

fn pages_label(huge: bool) -> String {
    if huge {
        format!("huge pages (MADV_HUGEPAGE, THP {})", thp_mode())
    } else {
        "4 KiB pages".into()
    }
}

/// Whether transparent huge pages can back a `MADV_HUGEPAGE` mapping, as
/// the kernel says (`always`, `madvise` or `never`, from
/// /sys/kernel/mm/transparent_hugepage/enabled).
pub fn thp_mode() -> String {
    std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/enabled")
        .ok()
        .and_then(|s| {
            let a = s.find('[')?;
            let b = s[a..].find(']')? + a;
            Some(s[a + 1..b].to_string())
        })
        .unwrap_or_else(|| "unknown".into())
}

/// One reader: a ring, `qd` buffers (registered for `Buffers::Fixed`), and
/// the count of reads the kernel holds. Dropping it with reads in flight
/// reaps them first (up to 10 s); if the kernel keeps some, the ring and
/// the buffers are leaked, never freed under it.
struct Reader<'d> {
    device: &'d str,
    config: ReadConfig,
    ring: ManuallyDrop<IoUring>,
    bufs: ManuallyDrop<BufMap>,
    /// File index of the read in flight into each slot.
    file_of: Vec<u32>,
    free: Vec<usize>,
    inflight: usize,
}

impl<'d> Reader<'d> {
    fn new(drive: &'d Drive, config: ReadConfig, huge: bool) -> Result<Self> {
        let dev = Path::new(&drive.device);
        let qd = config.qd;
        let bufs = BufMap::new(config.bs, qd, huge)?;
        let ring = IoUring::new((qd as u32).next_power_of_two()).map_err(|e| Error::io(dev, "io_uring_setup", e))?;
        let me = Reader {
            device: &drive.device,
            config,
            ring: ManuallyDrop::new(ring),
            bufs: ManuallyDrop::new(bufs),
            file_of: vec![0; qd],
            free: (0..qd).rev().collect(),
            inflight: 0,
        };
        if config.buffers == Buffers::Fixed {
            let iov: Vec<libc::iovec> = (0..qd)
                .map(|i| libc::iovec {
                    iov_base: me.bufs.buf(i).cast(),
                    iov_len: config.bs,
                })
                .collect();
            // SAFETY: each iovec is one slot of `arena`, which the reader owns
            // and drops only after the ring (the registration ends with the
            // ring), or leaks with it.
            unsafe { me.ring.submitter().register_buffers(&iov) }.map_err(|e| {
                let hint = if e.raw_os_error() == Some(libc::ENOMEM) {
                    " (RLIMIT_MEMLOCK: raise `ulimit -l`)"
                } else {
                    ""
                };
                Error::Config(format!(
                    "drive {}: io_uring register_buffers of {qd} x {} (registered buffers): {e}{hint}",
                    drive.device,
                    size_label(config.bs as u64)
                ))
            })?;
        }
        Ok(me)
    }

    /// Issues the part's blocks, `qd` in flight, until the part, the byte
    /// budget or the deadline ends, and reaps every read before returning.
    fn run(
        &mut self,
        drive: &Drive,
        plan: &Plan,
        part: Part,
        budget: Option<u64>,
        deadline: Option<Instant>,
    ) -> ReaderOutcome {
        let n = plan.len;
        let (mut issued_blocks, mut issued, mut bytes) = (0usize, 0u64, 0u64);
        let mut error: Option<Error> = None;
        let mut stop = n == 0;
        loop {
            while !stop && error.is_none() {
                if part.count.is_some_and(|c| issued_blocks >= c)
                    || budget.is_some_and(|b| issued >= b)
                    || deadline.is_some_and(|d| Instant::now() >= d)
                {
                    stop = true;
                    break;
                }
                let Some(&i) = self.free.last() else { break };
                let b = plan.get((part.first + issued_blocks) % n);
                let fd = types::Fd(drive.opened[b.file as usize].0.as_raw_fd());
                let ptr = self.bufs.buf(i);
                let e = match self.config.buffers {
                    Buffers::Plain => opcode::Read::new(fd, ptr, b.len).offset(b.off).build(),
                    Buffers::Fixed => opcode::ReadFixed::new(fd, ptr, b.len, i as u16).offset(b.off).build(),
                };
                let e = match self.config.submit {
                    Submit::Inline => e,
                    Submit::Async => e.flags(squeue::Flags::ASYNC),
                }
                .user_data(i as u64);
                // SAFETY: the buffer is slot `i` (registered as buffer `i` for
                // ReadFixed), which `slots` keeps alive and hands to no other
                // read until this one's completion is reaped; a reader with
                // reads in flight is never freed (`Drop` reaps or leaks).
                if unsafe { self.ring.submission().push(&e) }.is_err() {
                    // Cannot happen (the ring holds `qd` entries and at most
                    // `qd` are out); stop rather than spin.
                    error = Some(Error::Config(format!(
                        "drive {}: io_uring submission queue full with {} reads out",
                        self.device, self.inflight
                    )));
                    break;
                }
                self.free.pop();
                self.file_of[i] = b.file;
                self.inflight += 1;
                issued_blocks += 1;
                issued += b.len as u64;
            }
            if self.inflight == 0 {
                break;
            }
            if let Err(e) = enter(&mut self.ring) {
                // Stop issuing; `Drop` reaps what the kernel holds (or leaks).
                error.get_or_insert(Error::io(Path::new(self.device), "io_uring_enter", e));
                break;
            }
            bytes += self.reap(drive, &mut error);
        }
        ReaderOutcome {
            bytes,
            end: Instant::now(),
            error,
        }
    }

    /// Reaps the completions there are: frees their slots, returns their
    /// bytes, records the first error (naming the file).
    fn reap(&mut self, drive: &Drive, error: &mut Option<Error>) -> u64 {
        let mut bytes = 0;
        for c in self.ring.completion() {
            let i = c.user_data() as usize;
            self.inflight -= 1;
            self.free.push(i);
            if c.result() < 0 {
                let e = std::io::Error::from_raw_os_error(-c.result());
                let file = &drive.files[self.file_of[i] as usize];
                let op = match self.config.buffers {
                    Buffers::Plain => "O_DIRECT read (io_uring)",
                    Buffers::Fixed => "O_DIRECT read (io_uring, registered buffer)",
                };
                error.get_or_insert(Error::io(file, op, e));
            } else {
                bytes += c.result() as u64;
            }
        }
        bytes
    }
}

impl Drop for Reader<'_> {
    fn drop(&mut self) {
        let deadline = Instant::now() + Duration::from_secs(10);
        while self.inflight > 0 && Instant::now() < deadline {
            if enter(&mut self.ring).is_err() {
                std::thread::sleep(Duration::from_millis(1));
            }
            let n = self.ring.completion().count();
            self.inflight -= n;
        }
        if self.inflight > 0 {
            tracing::error!(
                device = self.device,
                "ceiling: {} read(s) still in the kernel after 10 s; their buffers and the ring are leaked",
                self.inflight
            );
            return;
        }
        // SAFETY: nothing is in flight, and each field is dropped once, here:
        // the ring first (ending the buffer registration), then the slots,
        // then the arena that maps them.
        unsafe {
            ManuallyDrop::drop(&mut self.ring);
            ManuallyDrop::drop(&mut self.bufs);
        }
    }
}

/// One `io_uring_enter` waiting for a completion; EINTR, EAGAIN and EBUSY
/// (a signal, a full completion queue) are retried, not errors.
fn enter(ring: &mut IoUring) -> std::io::Result<usize> {
    let mut tries = 0u32;
    loop {
        match ring.submit_and_wait(1) {
            Ok(n) => return Ok(n),
            Err(e) if matches!(e.raw_os_error(), Some(libc::EINTR | libc::EAGAIN | libc::EBUSY)) && tries < 1000 => {
                tries += 1;
                if e.raw_os_error() != Some(libc::EINTR) {
                    std::thread::sleep(Duration::from_micros(100));
                }
            }
            Err(e) => return Err(e),
        }
    }
}

/// Why a configuration is not worth running on a drive whose best so far is
/// `best_gbps`: its bytes in flight are more than twice what the drive reads
/// in the time cap at that rate.
pub fn skip_reason(c: &ReadConfig, best_gbps: f64, seconds: f64) -> Option<String> {
    let reach = best_gbps * 1e9 * seconds;
    (best_gbps > 0.0 && c.window() as f64 > 2.0 * reach).then(|| {
        format!(
            "{} in flight is more than twice what the drive read in the {seconds} s cap at its best rate so far ({best_gbps:.3} GB/s)",
            size_label(c.window())
        )
    })
}

/// The ceiling: each drive alone through every configuration of `cfg`, the
/// best per drive, then all drives at once with their best configurations.
/// A configuration that fails is recorded with its cause (and logged); a
/// drive where every configuration failed is the error.
pub fn sweep(paths: &[PathBuf], cfg: &SweepConfig) -> Result<CeilingReport> {
    cfg.validate()?;
    let t_all = Instant::now();
    let drives = group(paths)?;
    let bound = Bound {
        bytes: Some(cfg.bytes),
        seconds: Some(cfg.seconds),
        repeat: true,
        huge: cfg.huge_pages,
    };
    let mut out = Vec::new();
    for d in &drives {
        let mut results: Vec<ConfigResult> = Vec::with_capacity(cfg.configs.len());
        let mut cursor = 0u64;
        let mut best_so_far = 0.0f64;
        for &c in &cfg.configs {
            if let Some(why) = skip_reason(&c, best_so_far, cfg.seconds) {
                tracing::info!(device = d.device, "ceiling: {c} skipped: {why}");
                results.push(ConfigResult::not_measured(c, None, Some(why)));
                continue;
            }
            let run = run_jobs(
                &[Job {
                    drive: d,
                    config: c,
                    start: cursor,
                }],
                bound,
            );
            let o = run.jobs.into_iter().next().expect("one job");
            cursor = cursor.wrapping_add(o.bytes);
            let r = match o.error {
                Some(e) => {
                    tracing::warn!(device = d.device, "ceiling: {c} failed: {e}");
                    ConfigResult::not_measured(c, Some(e.to_string()), None)
                }
                None => ConfigResult::measured(c, o.bytes, o.seconds, run.cpu_s),
            };
            if r.unusable().is_none() {
                best_so_far = best_so_far.max(r.gbps);
            }
            results.push(r);
        }
        let choice = choose(&d.device, &results)?;
        let b = &results[choice.best];
        out.push(DriveCeiling {
            device: d.device.clone(),
            files: d.files.clone(),
            bytes: b.bytes,
            seconds: b.seconds,
            gbps: b.gbps,
            cpu_s: b.cpu_s,
            best: b.config,
            best_label: b.label.clone(),
            spread: choice.spread,
            configs: results,
            together_gbps: None,
        });
    }
    let (bytes, seconds, cpu_seconds) = if out.len() == 1 {
        (out[0].bytes, out[0].seconds, out[0].cpu_s)
    } else {
        let jobs: Vec<Job> = drives
            .iter()
            .zip(&out)
            .map(|(d, c)| Job {
                drive: d,
                config: c.best,
                start: 0,
            })
            .collect();
        let run = run_jobs(&jobs, bound);
        let mut total = 0;
        for ((d, c), o) in drives.iter().zip(out.iter_mut()).zip(run.jobs) {
            if let Some(e) = o.error {
                return Err(Error::Config(format!(
                    "ceiling, all drives at once: drive {} with {}: {e}",
                    d.device, c.best_label
                )));
            }
            c.together_gbps = Some(o.bytes as f64 / 1e9 / o.seconds.max(1e-9));
            total += o.bytes;
        }
        (total, run.seconds, run.cpu_s)
    };
    Ok(CeilingReport {
        drives: out,
        bytes,
        seconds,
        gbps: bytes as f64 / 1e9 / seconds.max(1e-9),
        cpu_seconds,
        sweep: cfg.name.clone(),
        elapsed_s: t_all.elapsed().as_secs_f64(),
        pages: pages_label(cfg.huge_pages),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(bs_mib: usize, qd: usize) -> ReadConfig {
        ReadConfig {
            bs: bs_mib * MIB,
            qd,
            ..ReadConfig::BASELINE
        }
    }

    fn fake(c: ReadConfig, gbps: f64, cpu_s_per_gb: f64) -> ConfigResult {
        ConfigResult {
            gbps,
            cpu_s_per_gb,
            bytes: 1,
            seconds: 1.0,
            ..ConfigResult::not_measured(c, None, None)
        }
    }

    #[test]
    fn the_fastest_configuration_wins_and_the_spread_spans_the_usable_ones() {
        let rs = vec![
            fake(cfg(1, 16), 3.4, 0.1),
            fake(cfg(1, 64), 3.2, 0.1),
            fake(cfg(4, 16), 7.5, 0.3),
            fake(cfg(4, 64), 6.0, 0.2),
        ];
        let c = choose("zram1", &rs).unwrap();
        assert_eq!(c.best, 2);
        assert_eq!(c.spread.min_gbps, 3.2);
        assert_eq!(c.spread.max_gbps, 7.5);
        assert!((c.spread.weakest_ratio - 3.2 / 7.5).abs() < 1e-12);
        assert_eq!((c.spread.measured, c.spread.failed, c.spread.skipped), (4, 0, 0));
    }

    #[test]
    fn a_tie_goes_to_less_cpu_then_to_the_earlier() {
        let rs = vec![
            fake(cfg(1, 16), 5.0, 0.30),
            fake(cfg(1, 64), 5.0, 0.10),
            fake(cfg(4, 16), 5.0, 0.10),
            fake(cfg(4, 64), 4.0, 0.01),
        ];
        assert_eq!(choose("d", &rs).unwrap().best, 1);
        // A CPU figure that is not a number loses a tie.
        let rs = vec![fake(cfg(1, 16), 5.0, f64::NAN), fake(cfg(1, 64), 5.0, 0.5)];
        assert_eq!(choose("d", &rs).unwrap().best, 1);
        let rs = vec![fake(cfg(1, 16), 5.0, 0.5), fake(cfg(1, 64), 5.0, 0.5)];
        assert_eq!(choose("d", &rs).unwrap().best, 0);
    }

    #[test]
    fn a_single_configuration_is_its_own_best_with_no_spread() {
        let c = choose("vda", &[fake(cfg(1, 16), 1.25, 0.05)]).unwrap();
        assert_eq!(c.best, 0);
        assert_eq!(c.spread.weakest_ratio, 1.0);
        assert_eq!(c.spread.measured, 1);
    }

    #[test]
    fn failed_skipped_zero_and_nan_figures_are_never_chosen() {
        let rs = vec![
            ConfigResult::not_measured(cfg(1, 16), Some("EINVAL".into()), None),
            fake(cfg(1, 32), f64::NAN, 0.1),
            fake(cfg(1, 64), f64::INFINITY, 0.1),
            fake(cfg(2, 16), 0.0, 0.1),
            fake(cfg(2, 32), -1.0, 0.1),
            ConfigResult::not_measured(cfg(4, 64), None, Some("window".into())),
            fake(cfg(4, 16), 0.2, 0.1),
        ];
        let c = choose("loop3", &rs).unwrap();
        assert_eq!(c.best, 6);
        assert_eq!((c.spread.measured, c.spread.failed, c.spread.skipped), (1, 5, 1));
        assert_eq!(c.spread.min_gbps, 0.2);
    }

    #[test]
    fn all_failed_is_an_error_naming_the_drive_and_each_cause() {
        let rs = vec![
            ConfigResult::not_measured(cfg(1, 16), Some("io_uring_setup: ENOMEM".into()), None),
            fake(cfg(1, 64), f64::NAN, 0.0),
            fake(cfg(4, 16), 0.0, 0.0),
        ];
        let e = choose("nvme0n1", &rs).unwrap_err().to_string();
        assert!(e.contains("nvme0n1"), "{e}");
        assert!(e.contains("3 tried"), "{e}");
        assert!(e.contains("ENOMEM"), "{e}");
        assert!(e.contains("not a number"), "{e}");
        assert!(e.contains("measured 0 GB/s"), "{e}");
        assert!(e.contains("bs=1MiB qd=64"), "{e}");
        let e = choose("nvme1n1", &[]).unwrap_err().to_string();
        assert!(e.contains("nvme1n1") && e.contains("0 tried"), "{e}");
    }

    #[test]
    fn the_skip_rule_bounds_slow_drives_and_spares_fast_ones() {
        let deep = ReadConfig {
            bs: 4 * MIB,
            qd: 64,
            readers: 2,
            ..ReadConfig::BASELINE
        };
        // 512 MiB in flight; a 0.2 GB/s drive reads 0.1 GB in 0.5 s.
        assert!(skip_reason(&deep, 0.2, 0.5).is_some());
        assert!(skip_reason(&deep, 6.0, 0.5).is_none());
        // Nothing measured yet: nothing to go by.
        assert!(skip_reason(&deep, 0.0, 0.5).is_none());
        assert!(skip_reason(&ReadConfig::BASELINE, 0.2, 0.5).is_none());
    }

    #[test]
    fn sweeps_are_what_they_say() {
        let full = SweepConfig::full();
        full.validate().unwrap();
        assert_eq!(full.configs.len(), 32);
        assert!(full.configs.windows(2).all(|w| w[0].window() <= w[1].window()));
        let quick = SweepConfig::quick();
        quick.validate().unwrap();
        assert!((6..=8).contains(&quick.configs.len()));
        assert!(quick.configs.contains(&ReadConfig::BASELINE));
        assert!(quick.bytes < full.bytes && quick.seconds < full.seconds);
        for c in &quick.configs {
            assert!(full.configs.contains(c), "{c} is not in the full sweep");
        }
        let bad = SweepConfig {
            seconds: f64::NAN,
            ..SweepConfig::quick()
        };
        assert!(bad.validate().is_err());
        let bad = ReadConfig {
            bs: 1000,
            ..ReadConfig::BASELINE
        };
        assert!(bad.validate().is_err());
    }

    #[test]
    fn labels_and_parsing() {
        assert_eq!(
            ReadConfig::BASELINE.label(),
            "bs=1MiB qd=16 readers=1 submit=inline buffers=plain"
        );
        assert_eq!(
            <Submit as clap::ValueEnum>::from_str("Async", true).unwrap(),
            Submit::Async
        );
        assert_eq!(
            <Buffers as clap::ValueEnum>::from_str("registered", true).unwrap(),
            Buffers::Fixed
        );
        assert!(<Submit as clap::ValueEnum>::from_str("sqpoll", true).is_err());
        assert_eq!(size_label(4096), "4KiB");
        assert_eq!(size_label(1000), "1000B");
        assert_eq!(size_label(3 << 29), "1.5GiB");
    }

    /// getrusage(RUSAGE_SELF) counts io_uring's io-wq workers: reads with
    /// IOSQE_ASYNC run in `iou-wrk-*` threads of this process, and the
    /// process's rusage grows by at least what those threads used.
    #[test]
    fn rusage_counts_io_wq_workers() {
        // On the project's disk (as the integration tests), not a tmpfs /tmp
        // that refuses O_DIRECT.
        let base = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../target/tmp");
        std::fs::create_dir_all(&base).unwrap();
        let dir = tempfile::Builder::new()
            .prefix("ws-ceiling-")
            .tempdir_in(&base)
            .unwrap();
        let path = dir.path().join("f");
        std::fs::write(&path, vec![7u8; 16 << 20]).unwrap();
        if IoUring::new(4).is_err() {
            eprintln!("SKIP: no io_uring");
            return;
        }
        let a = match cpu_accounting(&path, 0.3) {
            Ok(a) => a,
            Err(e) => {
                eprintln!("SKIP: {e}");
                return;
            }
        };
        eprintln!("{a:?}");
        assert!(a.io_workers > 0, "no io-wq worker seen: {a:?}");
        // Clock ticks (10 ms per thread and sample) and threads that exited
        // meanwhile (in rusage, gone from /proc) only make rusage larger.
        assert!(a.rusage_s + 0.05 >= a.io_workers_s, "{a:?}");
    }

    #[test]
    fn a_plan_maps_every_block_to_its_file_and_rounds_the_last_up() {
        let d = Drive {
            device: "test".into(),
            files: Vec::new(),
            opened: Vec::new(),
        };
        let mut plan = Plan::new(&d, MIB);
        assert_eq!(plan.len, 0);
        // Sizes only (no files are read).
        plan.sizes = vec![0, 3 * MIB as u64 + 100, 0, 0, MIB as u64];
        plan.before = vec![0, 0, 4, 4, 4];
        plan.len = 5;
        let got: Vec<(u32, u64, u32)> = (0..plan.len)
            .map(|i| plan.get(i))
            .map(|b| (b.file, b.off, b.len))
            .collect();
        let m = MIB as u64;
        assert_eq!(
            got,
            vec![
                (1, 0, MIB as u32),
                (1, m, MIB as u32),
                (1, 2 * m, MIB as u32),
                (1, 3 * m, 4096),
                (4, 0, MIB as u32)
            ]
        );
    }
}
