//! The load ceiling: how fast any loader could hand back a model's bytes in
//! fresh memory on this machine, and which of three limits sets it.
//!
//! fio reads into a few buffers it reuses; a whole-model load hands back
//! memory nobody has touched, and the kernel allocates and clears every
//! page of it on first touch. So a load is bounded three ways:
//!
//! 1. **read**: fio's best time for the model's bytes (its sweep over the
//!    model's own shard files, all drives at once);
//! 2. **fault**: the fastest fault-in of as much fresh anonymous memory:
//!    `MADV_POPULATE_WRITE` split over every CPU, with 4 KiB pages and
//!    with transparent huge pages, whichever is faster;
//! 3. **cpu**: where both compete for the same CPUs, their busy CPU time
//!    summed and spread over every CPU. Busy time is the whole machine's
//!    (`/proc/stat`), so the kernel threads that work for a read (a
//!    memloop drive's loop workers, block softirqs) count; fio's start-up
//!    is subtracted (an invocation that reads nothing).
//!
//! The ceiling is the model's bytes over the largest of the three times.
//! A loader faster than it means the ceiling is wrong (a sweep that missed
//! the device's best configuration, or busy time that was not the
//! loader's own), never that the loader is that fast.
//!
//! Where the destination is already faulted (memory the caller reuses),
//! the ceiling is the read alone: `read.gbps`.

use std::path::{Path, PathBuf};
use std::sync::Barrier;
use std::time::Instant;

use serde::Serialize;
use weightstream::Model;

use crate::bench::fio::{self, FioReport, FioSweep};
use crate::ceiling::{self, machine_busy_seconds, SweepConfig};
use crate::error::{Error, Result};

/// What the load ceiling measures and how often.
#[derive(Debug, Clone)]
pub struct LoadCeilingConfig {
    /// fio's sweep; its byte bound is raised to each drive's files (each
    /// invocation reads the model's files through once when it can).
    pub fio: FioSweep,
    /// Fault-in repetitions per page size (the fastest is kept, with its
    /// busy CPU).
    pub fault_rounds: usize,
}

impl LoadCeilingConfig {
    /// fio's quick sweep, up to 4 s an invocation; 3 fault-ins per page size.
    pub fn new(sweep: SweepConfig) -> Self {
        let mut fio = FioSweep::like(&sweep);
        fio.seconds = fio.seconds.max(4.0);
        LoadCeilingConfig { fio, fault_rounds: 3 }
    }
}

/// The read part: fio's best on the model's files.
#[derive(Debug, Clone, Serialize)]
pub struct ReadPart {
    /// fio's best rate, GB/s (10^9 bytes).
    pub gbps: f64,
    /// The model's bytes at that rate.
    pub seconds: f64,
    /// Busy CPU seconds of the machine for the model's bytes at fio's best
    /// (that invocation's, scaled to the model's bytes): the CPU part's.
    pub busy_cpu_seconds: f64,
    /// The least any invocation of the sweep spent for the model's bytes,
    /// and which: the fastest is not always the cheapest (on zram its
    /// `force_async=1` workers spent 0.135 s/GB where an inline invocation
    /// spent 0.119). Reported, not used (a minimum of noisy samples).
    pub least_busy_cpu_seconds: f64,
    pub least_busy_label: String,
    pub best_label: String,
    /// fio's whole sweep.
    pub sweep: FioReport,
}

/// One fault-in of fresh anonymous memory.
#[derive(Debug, Clone, Serialize)]
pub struct FaultRun {
    /// `4k` or `thp`.
    pub pages: &'static str,
    pub threads: usize,
    pub bytes: u64,
    pub seconds: f64,
    pub gbps: f64,
    /// Busy CPU seconds of the machine meanwhile.
    pub busy_cpu_seconds: f64,
    /// Transparent huge pages the kernel allocated on fault meanwhile
    /// (`thp_fault_alloc` of `/proc/vmstat`), and those it could not
    /// (`thp_fault_fallback`): a `thp` run with no huge page is a `4k` run.
    pub thp_fault_alloc: u64,
    pub thp_fault_fallback: u64,
}

/// The fault part: the faster page size's best fault-in.
#[derive(Debug, Clone, Serialize)]
pub struct FaultPart {
    pub gbps: f64,
    pub seconds: f64,
    /// Busy CPU seconds of the machine during that fault-in.
    pub busy_cpu_seconds: f64,
    /// The page size that set it: `4k` or `thp`.
    pub pages: &'static str,
    pub runs: Vec<FaultRun>,
}

/// The CPU part: both parts' busy CPU over every CPU.
#[derive(Debug, Clone, Serialize)]
pub struct CpuPart {
    pub seconds: f64,
    pub busy_cpu_seconds: f64,
    pub cpus: usize,
}

/// One drive's share of the model, alone.
#[derive(Debug, Clone, Serialize)]
pub struct DriveCeiling {
    pub device: String,
    pub files: Vec<PathBuf>,
    /// Bytes of the model's files on this drive.
    pub file_bytes: u64,
    /// fio's best on this drive alone (with one drive: the model's figure).
    pub read_gbps: f64,
    /// The load ceiling for this drive's files alone, its fault-in and CPU
    /// parts scaled from the whole model's by bytes.
    pub load_gbps: f64,
    pub bound: &'static str,
}

/// The load ceiling of one model on this machine (GB = 10^9 bytes).
#[derive(Debug, Clone, Serialize)]
pub struct LoadCeiling {
    pub model_dir: PathBuf,
    /// Payload bytes of every tensor: what a whole-model load hands back.
    pub bytes: u64,
    /// The load ceiling.
    pub gbps: f64,
    pub seconds: f64,
    /// Which part sets it: `read`, `fault` or `cpu`.
    pub bound: &'static str,
    /// The read ceiling (fio's best): the ceiling of a load into memory
    /// that is already faulted.
    pub read_ceiling_gbps: f64,
    #[serde(rename = "fio")]
    pub read: ReadPart,
    pub fault: FaultPart,
    pub cpu: CpuPart,
    pub drives: Vec<DriveCeiling>,
    pub elapsed_s: f64,
}

/// The three times and which is largest: (seconds, bound).
pub fn bound_of(read_s: f64, fault_s: f64, cpu_s: f64) -> (f64, &'static str) {
    let mut best = (read_s, "read");
    if fault_s > best.0 {
        best = (fault_s, "fault");
    }
    if cpu_s > best.0 {
        best = (cpu_s, "cpu");
    }
    best
}

/// Measures the load ceiling of the model in `dir` (opened as `model`).
pub fn measure(dir: &Path, model: &Model, cfg: &LoadCeilingConfig) -> Result<LoadCeiling> {
    let t0 = Instant::now();
    let bytes: u64 = model.catalog().tensors().iter().map(|t| t.len).sum();
    if bytes == 0 {
        return Err(Error::Config(format!(
            "load-ceiling: the model in {} holds no tensor bytes",
            weightstream::__internal::escape(dir)
        )));
    }
    let paths: Vec<PathBuf> = model.files().iter().map(|f| f.path.clone()).collect();
    let drives = ceiling::drives_of(&paths)?;
    let file_bytes = |files: &[PathBuf]| -> Result<u64> {
        files.iter().try_fold(0u64, |sum, p| {
            std::fs::metadata(p)
                .map(|m| sum + m.len())
                .map_err(|e| Error::io(p, "stat", e))
        })
    };
    let drive_bytes = drives
        .iter()
        .map(|(_, f)| file_bytes(f))
        .collect::<Result<Vec<u64>>>()?;
    let largest_drive = drive_bytes.iter().copied().max().unwrap_or(0);
    // Each invocation reads the files through once (fio's --io_size is per
    // drive here), unless the time bound stops it first.
    let mut sweep = cfg.fio.clone();
    sweep.bytes = largest_drive.max(4 << 20);
    let all: Vec<Vec<PathBuf>> = drives.iter().map(|(_, f)| f.clone()).collect();
    let fio_all = fio::sweep(&all, &sweep)?;
    let read = read_part(fio_all, bytes);

    let fault = fault_part(bytes, ceiling::cpus(), cfg.fault_rounds.max(1))?;
    // Busy time is summed over every online CPU (/proc/stat), so it is
    // spread over as many (not over this process's affinity mask).
    let cpus = ceiling::machine_cpus();
    let busy = read.busy_cpu_seconds + fault.busy_cpu_seconds;
    let cpu = CpuPart {
        seconds: busy / cpus as f64,
        busy_cpu_seconds: busy,
        cpus,
    };
    let (seconds, bound) = bound_of(read.seconds, fault.seconds, cpu.seconds);

    let mut per_drive = Vec::with_capacity(drives.len());
    for ((device, files), &fb) in drives.iter().zip(&drive_bytes) {
        let (read_gbps, read_busy_per_byte) = if drives.len() == 1 {
            (read.gbps, read.busy_cpu_seconds / bytes as f64)
        } else {
            let mut one = sweep.clone();
            one.bytes = fb.max(4 << 20);
            let r = fio::sweep(std::slice::from_ref(files), &one)?;
            (r.gbps, r.busy_cpu_s / r.bytes.max(1) as f64)
        };
        let b = fb as f64;
        let read_s = b / 1e9 / read_gbps.max(1e-12);
        let fault_s = b / 1e9 / fault.gbps.max(1e-12);
        let cpu_s = (b * read_busy_per_byte + fault.busy_cpu_seconds * b / bytes as f64) / cpus as f64;
        let (s, bnd) = bound_of(read_s, fault_s, cpu_s);
        per_drive.push(DriveCeiling {
            device: device.clone(),
            files: files.clone(),
            file_bytes: fb,
            read_gbps,
            load_gbps: b / 1e9 / s.max(1e-12),
            bound: bnd,
        });
    }

    Ok(LoadCeiling {
        model_dir: dir.to_path_buf(),
        bytes,
        gbps: bytes as f64 / 1e9 / seconds.max(1e-12),
        seconds,
        bound,
        read_ceiling_gbps: read.gbps,
        read,
        fault,
        cpu,
        drives: per_drive,
        elapsed_s: t0.elapsed().as_secs_f64(),
    })
}

/// fio's best rate and that invocation's busy CPU, scaled to the model's
/// `bytes`; beside them, the least busy CPU per byte any invocation spent
/// (reported, not used: a minimum over a dozen tick-resolution samples is
/// biased low, as a maximum of rates is biased high).
fn read_part(sweep: FioReport, bytes: u64) -> ReadPart {
    let per_byte = sweep.busy_cpu_s / sweep.bytes.max(1) as f64;
    let cheapest = sweep
        .configs
        .iter()
        .filter(|r| r.error.is_none() && r.skipped.is_none() && r.bytes > 0 && r.gbps > 0.0)
        .map(|r| (r.busy_cpu_s / r.bytes as f64, r.label.clone()))
        .min_by(|a, b| a.0.total_cmp(&b.0))
        .unwrap_or((per_byte, sweep.best_label.clone()));
    ReadPart {
        gbps: sweep.gbps,
        seconds: bytes as f64 / 1e9 / sweep.gbps.max(1e-12),
        busy_cpu_seconds: per_byte * bytes as f64,
        least_busy_cpu_seconds: cheapest.0 * bytes as f64,
        least_busy_label: cheapest.1,
        best_label: sweep.best_label.clone(),
        sweep,
    }
}

/// The fastest fault-in of `bytes` of fresh memory over `threads` CPUs,
/// 4 KiB pages and huge pages each `rounds` times.
fn fault_part(bytes: u64, threads: usize, rounds: usize) -> Result<FaultPart> {
    let mut runs = Vec::with_capacity(2 * rounds);
    // Interleaved, so a machine that speeds up or slows down favours
    // neither page size.
    for _ in 0..rounds {
        for huge in [false, true] {
            runs.push(fault_in(bytes, threads, huge)?);
        }
    }
    let best_of = |pages: &str| {
        runs.iter()
            .filter(|r| r.pages == pages)
            .min_by(|a, b| a.seconds.total_cmp(&b.seconds))
            .cloned()
    };
    let (small, huge) = (best_of("4k"), best_of("thp"));
    let best = match (small, huge) {
        (Some(s), Some(h)) => {
            if h.seconds <= s.seconds {
                h
            } else {
                s
            }
        }
        (Some(x), None) | (None, Some(x)) => x,
        (None, None) => return Err(Error::Config("load-ceiling: no fault-in ran".into())),
    };
    Ok(FaultPart {
        gbps: best.gbps,
        seconds: best.seconds,
        busy_cpu_seconds: best.busy_cpu_seconds,
        pages: best.pages,
        runs,
    })
}

/// `thp_fault_alloc` and `thp_fault_fallback` of `/proc/vmstat`.
fn thp_counters() -> (u64, u64) {
    let text = std::fs::read_to_string("/proc/vmstat").unwrap_or_default();
    let field = |k: &str| {
        text.lines()
            .find_map(|l| l.strip_prefix(k).and_then(|v| v.trim().parse::<u64>().ok()))
            .unwrap_or(0)
    };
    (field("thp_fault_alloc "), field("thp_fault_fallback "))
}

/// Faults `bytes` of fresh anonymous memory in, split over `threads`
/// threads that start together, each `MADV_POPULATE_WRITE` on its part;
/// `huge`: advised `MADV_HUGEPAGE` (else `MADV_NOHUGEPAGE`). The mapping is
/// unmapped after the clock stops.
fn fault_in(bytes: u64, threads: usize, huge: bool) -> Result<FaultRun> {
    const HUGE: usize = 2 << 20;
    let len = usize::try_from(bytes)
        .ok()
        .and_then(|b| b.checked_next_multiple_of(HUGE))
        .filter(|&l| l <= isize::MAX as usize - HUGE)
        .ok_or_else(|| Error::Config(format!("load-ceiling: {bytes} bytes do not fit the address space")))?;
    let threads = threads.max(1);
    let map = memmap2::MmapMut::map_anon(len + HUGE).map_err(|e| {
        Error::Config(format!(
            "load-ceiling: mapping {} bytes of fresh memory for the fault-in: {e}",
            len + HUGE
        ))
    })?;
    // Start on a 2 MiB boundary, so huge pages can back every part.
    let skip = map.as_ptr().align_offset(HUGE).min(HUGE);
    let advice = if huge {
        memmap2::Advice::HugePage
    } else {
        memmap2::Advice::NoHugePage
    };
    // Refused advice (no THP in this kernel) leaves the pages as they are:
    // the run's thp_fault_alloc says what it got.
    let _ = map.advise(advice);
    // Whole huge pages per thread, the last one takes the rest.
    let per = (len / threads).next_multiple_of(HUGE).min(len);
    let parts: Vec<(usize, usize)> = (0..threads)
        .map(|i| (skip + (i * per).min(len), ((i + 1) * per).min(len) - (i * per).min(len)))
        .filter(|&(_, n)| n > 0)
        .collect();
    let start = Barrier::new(parts.len() + 1);
    let (thp0, fb0) = thp_counters();
    let map_ref = &map;
    let (seconds, busy, errors) = std::thread::scope(|s| {
        let handles: Vec<_> = parts
            .iter()
            .map(|&(off, n)| {
                let start = &start;
                s.spawn(move || {
                    start.wait();
                    map_ref.advise_range(memmap2::Advice::PopulateWrite, off, n)
                })
            })
            .collect();
        let busy0 = machine_busy_seconds();
        let t = Instant::now();
        start.wait();
        let errors: Vec<String> = handles
            .into_iter()
            .filter_map(|h| match h.join() {
                Ok(Ok(())) => None,
                Ok(Err(e)) => Some(e.to_string()),
                Err(_) => Some("a fault-in thread panicked".into()),
            })
            .collect();
        let seconds = t.elapsed().as_secs_f64();
        let busy = match (busy0, machine_busy_seconds()) {
            (Some(a), Some(b)) => (b - a).max(0.0),
            _ => 0.0,
        };
        (seconds, busy, errors)
    });
    let (thp1, fb1) = thp_counters();
    drop(map);
    if let Some(e) = errors.first() {
        return Err(Error::Config(format!(
            "load-ceiling: MADV_POPULATE_WRITE of fresh memory failed ({e}): Linux 5.14 or later is needed"
        )));
    }
    Ok(FaultRun {
        pages: if huge { "thp" } else { "4k" },
        threads: parts.len(),
        bytes: len as u64,
        seconds,
        gbps: len as f64 / 1e9 / seconds.max(1e-12),
        busy_cpu_seconds: busy,
        thp_fault_alloc: thp1.saturating_sub(thp0),
        thp_fault_fallback: fb1.saturating_sub(fb0),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_largest_time_sets_the_ceiling() {
        assert_eq!(bound_of(0.25, 0.1, 0.2), (0.25, "read"));
        assert_eq!(bound_of(0.1, 0.3, 0.2), (0.3, "fault"));
        assert_eq!(bound_of(0.1, 0.1, 0.2), (0.2, "cpu"));
        // A tie keeps the read: the ceiling of memory already faulted.
        assert_eq!(bound_of(0.2, 0.2, 0.2), (0.2, "read"));
    }

    #[test]
    fn a_fault_in_touches_every_byte_asked_for_on_every_thread() {
        let r = fault_in(8 << 20, 3, false).unwrap();
        assert_eq!(r.pages, "4k");
        assert_eq!(r.bytes, 8 << 20);
        // 8 MiB in whole 2 MiB parts over 3 threads: 4 + 4 MiB.
        assert_eq!(r.threads, 2);
        assert!(r.seconds > 0.0 && r.gbps > 0.0);
        let h = fault_in((4 << 20) + 1, 1, true).unwrap();
        assert_eq!((h.pages, h.bytes, h.threads), ("thp", 6 << 20, 1));
    }
}
