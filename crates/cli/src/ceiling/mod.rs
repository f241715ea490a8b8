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
//! the drives measured here (docs/contracts.md). Each configuration is
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
//! docs/contracts.md).

use std::path::PathBuf;
use std::time::Instant;

use crate::error::{Error, Result};

mod config;
mod cpu;
mod drives;
mod plan;
mod reader;
mod report;
mod run;

use drives::group;
use reader::pages_label;
use run::{run_jobs, Bound, Job};

pub use config::{size_label, Buffers, ReadConfig, Submit, SweepConfig};
pub use cpu::{
    children_cpu_seconds, cpus, machine_busy_seconds, machine_cpu, machine_cpus, peak_rss_bytes, process_cpu_seconds,
};
pub use drives::drives_of;
pub use report::{choose, CeilingReport, ConfigResult, DriveCeiling};

const MIB: usize = 1 << 20;

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
    use super::drives::{group, Drive};
    use super::plan::{Part, Plan};
    use super::reader::Reader;
    use super::*;
    use io_uring::IoUring;
    use std::path::Path;
    use std::time::{Duration, Instant};

    /// One live thread of this process and its CPU seconds, from
    /// `/proc/self/task/*/stat` (clock-tick resolution).
    #[derive(Debug, Clone)]
    struct TaskCpu {
        pub tid: u32,
        /// The thread's name (`iou-wrk-<tid>` for an io-wq worker, `iou-sqp-<tid>`
        /// for an SQPOLL thread).
        pub comm: String,
        pub cpu_s: f64,
    }

    /// Every live thread of this process with its CPU seconds. Threads that
    /// have exited are gone from the list (their time stays in getrusage).
    fn task_cpu() -> Vec<TaskCpu> {
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

    /// What getrusage and `/proc/self/task` say about one stretch of reads
    /// punted to io-wq workers ([`cpu_accounting`]).
    #[derive(Debug, Clone, Copy, serde::Serialize)]
    struct CpuAccounting {
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

    /// Reads `path` for `seconds` on the calling thread with `IOSQE_ASYNC` on
    /// every read (1 MiB blocks, 32 in flight), so the work runs in io-wq
    /// workers, which stay alive with the calling thread to be seen in
    /// `/proc/self/task`; returns both accounts of the CPU used. The check
    /// behind the claim that getrusage counts io-wq workers (docs/contracts.md).
    fn cpu_accounting(path: &Path, seconds: f64) -> Result<CpuAccounting> {
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
            return Err(Error::Config(format!(
                "{}: empty file",
                weightstream::__internal::escape(path)
            )));
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
