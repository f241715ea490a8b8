//! fio on the same files, in the same run: the device ceiling as the field
//! measures it, beside weightstream's own ([`crate::ceiling`]).
//!
//! A small sweep like the ceiling's: `--ioengine=io_uring --direct=1`,
//! `--rw=read` (two jobs start half-way apart: `--offset_increment`) and
//! `randread`, `--bs`, `--iodepth`, `--numjobs`, with and without
//! `--force_async=1` and `--fixedbufs=1`, `--group_reporting
//! --output-format=json`, bounded by `--io_size` (per job) and `--runtime`.
//! With several drives every invocation reads all of them at once, one job
//! section per drive. The best `read.bw_bytes` (GB = 10^9 bytes) is fio's
//! figure. O_DIRECT keeps the page cache out of it: no eviction needed.
//!
//! CPU: fio's own `usr_cpu`/`sys_cpu` come from `getrusage(RUSAGE_THREAD)`
//! of each job thread, which leaves out io-wq workers: with
//! `--force_async=1` it reported 0.42 CPU s where the process used 4.0
//! (docs/contracts.md). So the CPU figure here is the whole fio process
//! (`getrusage(RUSAGE_CHILDREN)` around the invocation), less the start-up
//! CPU of an invocation that reads nothing; fio's own figure is kept beside
//! it (`cpu_s_fio`).

use std::io::Read;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use crate::ceiling::{size_label, skip_reason, Buffers, ReadConfig, Submit, SweepConfig};
use crate::error::{Error, Result};

/// fio's access pattern.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Rw {
    Read,
    Randread,
}

impl Rw {
    pub fn name(self) -> &'static str {
        match self {
            Rw::Read => "read",
            Rw::Randread => "randread",
        }
    }
}

/// One fio invocation's job: the ceiling's dimensions (readers are
/// `--numjobs`, async is `--force_async=1`, fixed buffers `--fixedbufs=1`)
/// and the access pattern.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct FioConfig {
    pub rw: Rw,
    pub read: ReadConfig,
}

impl FioConfig {
    /// `rw=read bs=1MiB iodepth=16 numjobs=1 force_async=0 fixedbufs=0`.
    pub fn label(&self) -> String {
        format!(
            "rw={} bs={} iodepth={} numjobs={} force_async={} fixedbufs={}",
            self.rw.name(),
            size_label(self.read.bs as u64),
            self.read.qd,
            self.read.readers,
            u8::from(self.read.submit == Submit::Async),
            u8::from(self.read.buffers == Buffers::Fixed)
        )
    }
}

impl std::str::FromStr for FioConfig {
    type Err = String;

    /// The inverse of [`FioConfig::label`] (a trailing `iomem=...`, as the
    /// reports print it, is accepted and ignored: the pool decides).
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        let mut rw = None;
        let (mut bs, mut qd, mut jobs, mut force_async, mut fixed) = (None, None, None, None, None);
        for kv in s.split_whitespace() {
            let (k, v) = kv
                .split_once('=')
                .ok_or_else(|| format!("{kv:?} is not key=value (in {s:?})"))?;
            let num = |v: &str| v.parse::<usize>().map_err(|e| format!("{k}={v}: {e}"));
            let flag = |v: &str| match v {
                "0" => Ok(false),
                "1" => Ok(true),
                _ => Err(format!("{k}={v}: 0 or 1")),
            };
            match k {
                "rw" => {
                    rw = Some(match v {
                        "read" => Rw::Read,
                        "randread" => Rw::Randread,
                        _ => return Err(format!("rw={v}: read or randread")),
                    })
                }
                "bs" => bs = Some(crate::args::parse_bytes(v).map_err(|e| format!("bs={v}: {e}"))?),
                "iodepth" => qd = Some(num(v)?),
                "numjobs" => jobs = Some(num(v)?),
                "force_async" => force_async = Some(flag(v)?),
                "fixedbufs" => fixed = Some(flag(v)?),
                "iomem" => {}
                _ => return Err(format!("unknown key {k:?} (in {s:?})")),
            }
        }
        let missing = |what: &str| format!("{what} missing from {s:?}");
        let bs = bs.ok_or_else(|| missing("bs"))?;
        let read = ReadConfig {
            bs: usize::try_from(bs)
                .ok()
                .filter(|&b| b >= 4096 && b % 4096 == 0 && b <= 1 << 30)
                .ok_or_else(|| format!("bs={bs}: 4 KiB to 1 GiB, a multiple of 4096"))?,
            qd: qd
                .filter(|&q| (1..=4096).contains(&q))
                .ok_or_else(|| missing("iodepth (1 to 4096)"))?,
            readers: jobs
                .filter(|&j| (1..=64).contains(&j))
                .ok_or_else(|| missing("numjobs (1 to 64)"))?,
            submit: if force_async.ok_or_else(|| missing("force_async"))? {
                Submit::Async
            } else {
                Submit::Inline
            },
            buffers: if fixed.ok_or_else(|| missing("fixedbufs"))? {
                Buffers::Fixed
            } else {
                Buffers::Plain
            },
        };
        Ok(FioConfig {
            rw: rw.ok_or_else(|| missing("rw"))?,
            read,
        })
    }
}

/// What the fio arm runs, and its bounds per invocation.
#[derive(Debug, Clone)]
pub struct FioSweep {
    pub configs: Vec<FioConfig>,
    /// Bytes per drive per invocation (split over `--numjobs`: `--io_size`
    /// is per job).
    pub bytes: u64,
    /// `--runtime`.
    pub seconds: f64,
    /// Wall-clock limit per invocation beyond `seconds` (a hung device or
    /// fio): the invocation is killed and recorded as failed.
    pub grace: Duration,
    /// Buffers on huge pages (`--iomem=shmhuge`, from the hugetlb pool) when
    /// the pool has room, as the ceiling's are: a device that caps the
    /// segments of a request (virtio-blk: 254) splits a 1 MiB read into
    /// 4 KiB pages in two, so fio on small pages is not the device's limit.
    pub huge_pages: bool,
}

impl FioSweep {
    /// The ceiling sweep's configurations with `--rw=read`, then `randread`
    /// for those with `--force_async=1 --fixedbufs=1` (fio's best family on
    /// fast drives), with the same bounds.
    pub fn like(ceiling: &SweepConfig) -> Self {
        let mut configs: Vec<FioConfig> = ceiling
            .configs
            .iter()
            .map(|&read| FioConfig { rw: Rw::Read, read })
            .collect();
        configs.extend(
            ceiling
                .configs
                .iter()
                .filter(|c| c.submit == Submit::Async && c.buffers == Buffers::Fixed)
                .map(|&read| FioConfig { rw: Rw::Randread, read }),
        );
        FioSweep {
            configs,
            bytes: ceiling.bytes,
            seconds: ceiling.seconds,
            grace: Duration::from_secs(60),
            huge_pages: ceiling.huge_pages,
        }
    }

    /// The same bounds with `config` alone: the rerun of the sweep's best
    /// configuration ([`crate::bench::SweepFigure`]).
    pub fn only(&self, config: FioConfig) -> Self {
        FioSweep {
            configs: vec![config],
            ..self.clone()
        }
    }
}

/// One invocation's figure. A failed or skipped one has `gbps` 0 and says
/// why.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct FioRun {
    pub config: FioConfig,
    pub label: String,
    pub bytes: u64,
    pub seconds: f64,
    pub gbps: f64,
    /// The fio process's CPU seconds (RUSAGE_CHILDREN; io-wq workers
    /// included) less the start-up CPU of an empty invocation.
    pub cpu_s: f64,
    pub cpu_s_per_gb: f64,
    /// fio's own `usr_cpu + sys_cpu` (RUSAGE_THREAD per job: io-wq workers
    /// NOT included).
    pub cpu_s_fio: f64,
    /// Busy CPU seconds of the whole machine over the invocation
    /// (`/proc/stat`: kernel threads that work for fio, as a memloop
    /// drive's loop workers, included; so is anything else running) less
    /// the same of an invocation that reads nothing.
    #[serde(default)]
    pub busy_cpu_s: f64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub skipped: Option<String>,
    /// fio's buffers: `shmhuge` (2 MiB hugetlb pages) or `malloc` (4 KiB
    /// pages: the hugetlb pool was empty, too small, or huge pages off).
    #[serde(default)]
    pub iomem: String,
}

/// The fio arm's sweep. GB are 10^9 bytes.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct FioReport {
    pub version: String,
    /// Every drive at once in each invocation.
    pub drives: usize,
    pub gbps: f64,
    pub best: FioConfig,
    pub best_label: String,
    pub bytes: u64,
    pub seconds: f64,
    pub cpu_s: f64,
    /// CPU seconds of an invocation that reads nothing (subtracted above).
    pub startup_cpu_s: f64,
    /// The best invocation's machine-wide busy CPU seconds
    /// ([`FioRun::busy_cpu_s`]).
    #[serde(default)]
    pub busy_cpu_s: f64,
    /// Machine-wide busy CPU seconds of an invocation that reads nothing
    /// (subtracted from each invocation's).
    #[serde(default)]
    pub startup_busy_cpu_s: f64,
    pub configs: Vec<FioRun>,
    pub elapsed_s: f64,
}

/// fio's version (`fio --version`), or why fio cannot be run.
pub fn available() -> std::result::Result<String, String> {
    match Command::new("fio").arg("--version").stdin(Stdio::null()).output() {
        Ok(o) if o.status.success() => Ok(String::from_utf8_lossy(&o.stdout).trim().to_string()),
        Ok(o) => Err(format!(
            "`fio --version` failed ({}): {}",
            o.status,
            String::from_utf8_lossy(&o.stderr).trim()
        )),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Err("fio is not installed (not in PATH)".into()),
        Err(e) => Err(format!("cannot run fio: {e}")),
    }
}

/// What one fio JSON report says, summed over its job entries.
#[derive(Debug, Clone, PartialEq)]
pub struct FioOutput {
    /// Sum of `read.bw_bytes` (bytes/s).
    pub bw_bytes: f64,
    /// Sum of `read.io_bytes`.
    pub io_bytes: u64,
    /// Longest `read.runtime`, seconds.
    pub runtime_s: f64,
    /// Sum over entries of `(usr_cpu + sys_cpu) / 100 * job_runtime`,
    /// seconds (fio's own account).
    pub cpu_s: f64,
    /// Job entries (1 with --group_reporting).
    pub jobs: usize,
}

/// Parses fio's `--output-format=json` output: fio may print warnings
/// before the JSON (and after it), so the first line that starts with `{`
/// begins it. A job with a non-zero `error` is an error naming the job and
/// the errno.
pub fn parse_output(text: &str) -> Result<FioOutput> {
    let start = if text.starts_with('{') {
        Some(0)
    } else {
        text.find("\n{").map(|i| i + 1)
    };
    let Some(start) = start else {
        return Err(Error::Config(format!("fio printed no JSON report: {}", excerpt(text))));
    };
    let v: serde_json::Value = serde_json::Deserializer::from_str(&text[start..])
        .into_iter::<serde_json::Value>()
        .next()
        .ok_or_else(|| Error::Config("fio's JSON report is empty".into()))?
        .map_err(|e| Error::Config(format!("fio's JSON report does not parse: {e}")))?;
    let jobs = v
        .get("jobs")
        .and_then(|j| j.as_array())
        .ok_or_else(|| Error::Config("fio's JSON report has no \"jobs\" array".into()))?;
    if jobs.is_empty() {
        return Err(Error::Config("fio's JSON report has no job".into()));
    }
    let num = |x: Option<&serde_json::Value>| x.and_then(serde_json::Value::as_f64);
    let mut out = FioOutput {
        bw_bytes: 0.0,
        io_bytes: 0,
        runtime_s: 0.0,
        cpu_s: 0.0,
        jobs: jobs.len(),
    };
    for j in jobs {
        let name = j.get("jobname").and_then(|n| n.as_str()).unwrap_or("?");
        let err = j.get("error").and_then(serde_json::Value::as_i64).unwrap_or(0);
        if err != 0 {
            return Err(Error::Config(format!(
                "fio job {name}: error {err} ({})",
                std::io::Error::from_raw_os_error(err.clamp(0, i32::MAX as i64) as i32)
            )));
        }
        let read = j
            .get("read")
            .ok_or_else(|| Error::Config(format!("fio job {name}: no \"read\" section")))?;
        let bw = num(read.get("bw_bytes"))
            .filter(|b| b.is_finite() && *b >= 0.0)
            .ok_or_else(|| Error::Config(format!("fio job {name}: no usable read.bw_bytes")))?;
        out.bw_bytes += bw;
        out.io_bytes += num(read.get("io_bytes")).unwrap_or(0.0).max(0.0) as u64;
        out.runtime_s = out.runtime_s.max(num(read.get("runtime")).unwrap_or(0.0) / 1e3);
        let pct = num(j.get("usr_cpu")).unwrap_or(0.0) + num(j.get("sys_cpu")).unwrap_or(0.0);
        let cpu = pct / 100.0 * num(j.get("job_runtime")).unwrap_or(0.0) / 1e3;
        if cpu.is_finite() && cpu >= 0.0 {
            out.cpu_s += cpu;
        }
    }
    Ok(out)
}

fn excerpt(text: &str) -> String {
    let t = text.trim();
    match t.char_indices().nth(300) {
        Some((i, _)) => format!("{}...", &t[..i]),
        None if t.is_empty() => "(nothing)".into(),
        None => t.to_string(),
    }
}

/// A path as fio's `--filename` takes it: `:` separates files, so it is
/// escaped.
fn fio_path(p: &std::path::Path) -> String {
    p.to_string_lossy().replace('\\', "\\\\").replace(':', "\\:")
}

/// fio's arguments for `cfg` over `drives` (each drive's files), one job
/// section per drive. `smallest_file` (bytes) sets `--offset_increment`
/// for sequential jobs.
pub fn args(
    drives: &[Vec<PathBuf>],
    smallest_file: u64,
    cfg: &FioConfig,
    bytes: u64,
    seconds: f64,
    huge: bool,
) -> Vec<String> {
    let r = cfg.read;
    let per_job = (bytes / r.readers.max(1) as u64).max(r.bs as u64);
    let mut a = vec![
        "--ioengine=io_uring".to_string(),
        "--direct=1".into(),
        format!("--rw={}", cfg.rw.name()),
        format!("--bs={}", r.bs),
        format!("--iodepth={}", r.qd),
        format!("--numjobs={}", r.readers),
        format!("--io_size={per_job}"),
        format!("--runtime={}ms", (seconds * 1e3).ceil().max(1.0) as u64),
        "--group_reporting".into(),
        "--output-format=json".into(),
    ];
    if r.submit == Submit::Async {
        a.push("--force_async=1".into());
    }
    if r.buffers == Buffers::Fixed {
        a.push("--fixedbufs=1".into());
    }
    if huge {
        a.push("--iomem=shmhuge".into());
    }
    if cfg.rw == Rw::Read && r.readers > 1 {
        // Sequential jobs start apart, as the ceiling's readers do.
        let inc = smallest_file / r.readers as u64 / 4096 * 4096;
        if inc > 0 {
            a.push(format!("--offset_increment={inc}"));
        }
    }
    for (i, files) in drives.iter().enumerate() {
        a.push(format!("--name=drive{i}"));
        let names: Vec<String> = files.iter().map(|p| fio_path(p)).collect();
        a.push(format!("--filename={}", names.join(":")));
    }
    a
}

/// Free bytes of the hugetlb pool (`HugePages_Free` x `Hugepagesize`).
pub fn hugetlb_free_bytes() -> u64 {
    let Ok(m) = std::fs::read_to_string("/proc/meminfo") else {
        return 0;
    };
    let field = |k: &str| {
        m.lines()
            .find(|l| l.starts_with(k))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse::<u64>().ok())
    };
    match (field("HugePages_Free:"), field("Hugepagesize:")) {
        (Some(n), Some(kb)) => n * kb * 1024,
        _ => 0,
    }
}

/// What one fio invocation printed and cost.
struct Invocation {
    stdout: String,
    stderr: String,
    /// CPU seconds of the fio process (RUSAGE_CHILDREN).
    cpu_s: f64,
    /// Busy CPU seconds of the whole machine meanwhile (`/proc/stat`).
    busy_cpu_s: f64,
}

/// Runs fio with `args`, killed (its process group) after `limit`.
fn invoke(args: &[String], limit: Duration) -> Result<Invocation> {
    use std::os::unix::process::CommandExt;
    let cpu0 = crate::ceiling::children_cpu_seconds();
    let busy0 = crate::ceiling::machine_busy_seconds();
    let mut child = Command::new("fio")
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .process_group(0)
        .spawn()
        .map_err(|e| Error::Config(format!("cannot run fio: {e}")))?;
    let mut out = child.stdout.take();
    let mut err = child.stderr.take();
    let t_out = std::thread::spawn(move || {
        let mut s = String::new();
        if let Some(o) = out.as_mut() {
            let _ = o.read_to_string(&mut s);
        }
        s
    });
    let t_err = std::thread::spawn(move || {
        let mut s = String::new();
        if let Some(e) = err.as_mut() {
            let _ = e.read_to_string(&mut s);
        }
        s
    });
    let deadline = Instant::now() + limit;
    let status = loop {
        match child.try_wait() {
            Ok(Some(s)) => break Ok(s),
            Ok(None) if Instant::now() >= deadline => {
                // The whole group: fio and any job process it forked.
                if let Some(pid) = rustix::process::Pid::from_raw(child.id() as i32) {
                    let _ = rustix::process::kill_process_group(pid, rustix::process::Signal::KILL);
                }
                let _ = child.wait();
                break Err(Error::Config(format!(
                    "fio still running after {:.0} s: killed",
                    limit.as_secs_f64()
                )));
            }
            Ok(None) => std::thread::sleep(Duration::from_millis(10)),
            Err(e) => {
                let _ = child.kill();
                let _ = child.wait();
                break Err(Error::Config(format!("waiting for fio: {e}")));
            }
        }
    };
    let stdout = t_out.join().unwrap_or_default();
    let stderr = t_err.join().unwrap_or_default();
    let cpu = (crate::ceiling::children_cpu_seconds() - cpu0).max(0.0);
    let busy = match (busy0, crate::ceiling::machine_busy_seconds()) {
        (Some(a), Some(b)) => (b - a).max(0.0),
        _ => 0.0,
    };
    let status = status?;
    if !status.success() {
        return Err(Error::Config(format!(
            "fio exited with {status}: {}",
            excerpt(if stderr.trim().is_empty() { &stdout } else { &stderr })
        )));
    }
    Ok(Invocation {
        stdout,
        stderr,
        cpu_s: cpu,
        busy_cpu_s: busy,
    })
}

/// Runs the sweep over `drives` (each drive's files), all drives at once in
/// every invocation; the best `read.bw_bytes` is fio's figure. A failed
/// invocation is recorded with its cause; if every one failed the error
/// names each.
pub fn sweep(drives: &[Vec<PathBuf>], cfg: &FioSweep) -> Result<FioReport> {
    let version = available().map_err(Error::Config)?;
    if drives.is_empty() || drives.iter().any(Vec::is_empty) {
        return Err(Error::Config("fio: no file to read".into()));
    }
    let t_all = Instant::now();
    let mut smallest = u64::MAX;
    for p in drives.iter().flatten() {
        let m = std::fs::metadata(p).map_err(|e| Error::io(p, "stat", e))?;
        smallest = smallest.min(m.len());
    }
    // Start-up CPU: an invocation that reads one 4 KiB block.
    let probe = FioConfig {
        rw: Rw::Read,
        read: ReadConfig {
            bs: 4096,
            qd: 1,
            readers: 1,
            submit: Submit::Inline,
            buffers: Buffers::Plain,
        },
    };
    let (startup_cpu_s, startup_busy_cpu_s) =
        invoke(&args(&drives[..1], smallest, &probe, 4096, 1.0, false), cfg.grace)
            .map(|i| (i.cpu_s, i.busy_cpu_s))
            .unwrap_or((0.0, 0.0));
    let mut runs: Vec<FioRun> = Vec::with_capacity(cfg.configs.len());
    let mut best_so_far = 0.0f64;
    for &c in &cfg.configs {
        let blank = |error: Option<String>, skipped: Option<String>| FioRun {
            config: c,
            label: c.label(),
            bytes: 0,
            seconds: 0.0,
            gbps: 0.0,
            cpu_s: 0.0,
            cpu_s_per_gb: 0.0,
            cpu_s_fio: 0.0,
            busy_cpu_s: 0.0,
            error,
            skipped,
            iomem: String::new(),
        };
        // The same bound as the ceiling's: windows the drives cannot fill
        // within the runtime are skipped (fio's best per drive so far).
        if let Some(why) = skip_reason(&c.read, best_so_far / drives.len() as f64, cfg.seconds) {
            runs.push(blank(None, Some(why)));
            continue;
        }
        // Every job's buffers (iodepth x bs, with fio's alignment slack) from
        // the hugetlb pool, or 4 KiB pages when it cannot hold them.
        let need = drives.len() as u64 * c.read.readers as u64 * (c.read.qd as u64 * c.read.bs as u64 + (4 << 20));
        let huge = cfg.huge_pages && hugetlb_free_bytes() >= need;
        let a = args(drives, smallest, &c, cfg.bytes, cfg.seconds, huge);
        let limit = Duration::from_secs_f64(cfg.seconds) + cfg.grace;
        let r = invoke(&a, limit).and_then(|i| {
            parse_output(&i.stdout)
                .map(|p| (p, i.cpu_s, i.busy_cpu_s))
                .map_err(|e| Error::Config(format!("{e}; fio's stderr: {}", excerpt(&i.stderr))))
        });
        let run = match r {
            Ok((p, cpu, busy)) => {
                let gbps = p.bw_bytes / 1e9;
                let cpu_s = (cpu - startup_cpu_s).max(0.0);
                let gb = p.io_bytes as f64 / 1e9;
                FioRun {
                    bytes: p.io_bytes,
                    seconds: p.runtime_s,
                    gbps,
                    cpu_s,
                    cpu_s_per_gb: if gb > 0.0 { cpu_s / gb } else { 0.0 },
                    cpu_s_fio: p.cpu_s,
                    busy_cpu_s: (busy - startup_busy_cpu_s).max(0.0),
                    iomem: if huge { "shmhuge" } else { "malloc" }.into(),
                    label: format!("{} iomem={}", c.label(), if huge { "shmhuge" } else { "malloc" }),
                    ..blank(None, None)
                }
            }
            Err(e) => {
                tracing::warn!("fio {}: {e}", c.label());
                blank(Some(format!("{e} (fio {})", a.join(" "))), None)
            }
        };
        if run.error.is_none() && run.gbps.is_finite() && run.gbps > 0.0 {
            best_so_far = best_so_far.max(run.gbps);
        }
        runs.push(run);
    }
    let best = runs
        .iter()
        .enumerate()
        .filter(|(_, r)| r.error.is_none() && r.skipped.is_none() && r.gbps.is_finite() && r.gbps > 0.0)
        .max_by(|a, b| a.1.gbps.total_cmp(&b.1.gbps).then(b.0.cmp(&a.0)))
        .map(|(i, _)| i);
    let Some(best) = best else {
        let causes: Vec<String> = runs
            .iter()
            .map(|r| {
                format!(
                    "{}: {}",
                    r.label,
                    r.error
                        .clone()
                        .or_else(|| r.skipped.clone().map(|s| format!("skipped: {s}")))
                        .unwrap_or_else(|| format!("measured {} GB/s", r.gbps))
                )
            })
            .collect();
        return Err(Error::Config(format!(
            "fio reached no rate on {} ({} invocations): {}",
            drives
                .iter()
                .map(|f| f
                    .iter()
                    .map(weightstream::__internal::escape)
                    .collect::<Vec<_>>()
                    .join(", "))
                .collect::<Vec<_>>()
                .join("; "),
            runs.len(),
            causes.join("; ")
        )));
    };
    let b = &runs[best];
    Ok(FioReport {
        version,
        drives: drives.len(),
        gbps: b.gbps,
        best: b.config,
        best_label: b.label.clone(),
        bytes: b.bytes,
        seconds: b.seconds,
        cpu_s: b.cpu_s,
        startup_cpu_s,
        busy_cpu_s: b.busy_cpu_s,
        startup_busy_cpu_s,
        configs: runs,
        elapsed_s: t_all.elapsed().as_secs_f64(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const SAMPLE: &str = include_str!("../../tests/fixtures/fio-3.33-two-drives.txt");

    #[test]
    fn a_captured_report_parses_past_the_warning_before_it() {
        let p = parse_output(SAMPLE).unwrap();
        assert_eq!(p.jobs, 1, "--group_reporting: one entry");
        assert_eq!(p.bw_bytes, 3231395973.0);
        assert_eq!(p.io_bytes, 988807168);
        assert!((p.runtime_s - 0.306).abs() < 1e-9);
        assert!(p.cpu_s > 0.0);
    }

    #[test]
    fn bad_reports_are_errors_that_say_what_is_wrong() {
        let e = parse_output("fio: unrecognized option '--force_async=1'\n").unwrap_err();
        assert!(e.to_string().contains("no JSON report"), "{e}");
        assert!(e.to_string().contains("unrecognized option"), "{e}");
        assert!(parse_output("").unwrap_err().to_string().contains("(nothing)"));
        let e = parse_output("{\"jobs\": [").unwrap_err();
        assert!(e.to_string().contains("does not parse"), "{e}");
        let e = parse_output("{\"jobs\": []}").unwrap_err();
        assert!(e.to_string().contains("no job"), "{e}");
        let e = parse_output("{}").unwrap_err();
        assert!(e.to_string().contains("\"jobs\""), "{e}");
        let e = parse_output("{\"jobs\": [{\"jobname\": \"drive0\", \"error\": 5, \"read\": {}}]}").unwrap_err();
        assert!(
            e.to_string().contains("drive0") && e.to_string().contains("error 5"),
            "{e}"
        );
        let e = parse_output("{\"jobs\": [{\"jobname\": \"drive1\", \"read\": {\"bw_bytes\": -1}}]}").unwrap_err();
        assert!(e.to_string().contains("bw_bytes"), "{e}");
        // Two entries (no --group_reporting) are summed.
        let two = "{\"jobs\": [{\"read\": {\"bw_bytes\": 1000, \"io_bytes\": 10, \"runtime\": 5}},\
                   {\"read\": {\"bw_bytes\": 500, \"io_bytes\": 5, \"runtime\": 7}}]}";
        let p = parse_output(two).unwrap();
        assert_eq!((p.bw_bytes, p.io_bytes, p.jobs), (1500.0, 15, 2));
        assert!((p.runtime_s - 0.007).abs() < 1e-12);
    }

    #[test]
    fn arguments_mirror_the_ceiling_configuration() {
        let c = FioConfig {
            rw: Rw::Read,
            read: ReadConfig {
                bs: 4 << 20,
                qd: 64,
                readers: 2,
                submit: Submit::Async,
                buffers: Buffers::Fixed,
            },
        };
        let drives = vec![
            vec![PathBuf::from("/a/x:1.safetensors"), PathBuf::from("/a/y")],
            vec![PathBuf::from("/b/z")],
        ];
        let a = args(&drives, 1 << 30, &c, 1 << 30, 0.5, true);
        assert!(a.iter().any(|x| x == "--iomem=shmhuge"));
        for want in [
            "--ioengine=io_uring",
            "--direct=1",
            "--rw=read",
            "--bs=4194304",
            "--iodepth=64",
            "--numjobs=2",
            "--io_size=536870912",
            "--runtime=500ms",
            "--group_reporting",
            "--output-format=json",
            "--force_async=1",
            "--fixedbufs=1",
            "--offset_increment=536870912",
            "--name=drive0",
            "--filename=/a/x\\:1.safetensors:/a/y",
            "--name=drive1",
            "--filename=/b/z",
        ] {
            assert!(a.iter().any(|x| x == want), "{want} missing from {a:?}");
        }
        // Global options come before the first job section.
        let first_job = a.iter().position(|x| x.starts_with("--name=")).unwrap();
        assert!(a[..first_job].iter().any(|x| x == "--fixedbufs=1"));
        let plain = FioConfig {
            rw: Rw::Randread,
            read: ReadConfig::BASELINE,
        };
        let a = args(&drives[..1], 1 << 30, &plain, 1 << 30, 0.25, false);
        assert!(!a.iter().any(|x| x.starts_with("--iomem")));
        assert!(!a
            .iter()
            .any(|x| x.contains("force_async") || x.contains("fixedbufs") || x.contains("offset_increment")));
        assert_eq!(
            plain.label(),
            "rw=randread bs=1MiB iodepth=16 numjobs=1 force_async=0 fixedbufs=0"
        );
    }

    #[test]
    fn a_label_parses_back_into_its_configuration() {
        let c = FioConfig {
            rw: Rw::Randread,
            read: ReadConfig {
                bs: 4 << 20,
                qd: 64,
                readers: 2,
                submit: Submit::Async,
                buffers: Buffers::Fixed,
            },
        };
        assert_eq!(c.label().parse::<FioConfig>(), Ok(c));
        let printed = format!("{} iomem=shmhuge", c.label());
        assert_eq!(printed.parse::<FioConfig>(), Ok(c));
        let plain = FioConfig {
            rw: Rw::Read,
            read: ReadConfig::BASELINE,
        };
        assert_eq!(plain.label().parse::<FioConfig>(), Ok(plain));
        for bad in [
            "",
            "rw=write bs=1MiB iodepth=1 numjobs=1 force_async=0 fixedbufs=0",
            "rw=read bs=1000 iodepth=1 numjobs=1 force_async=0 fixedbufs=0",
            "rw=read bs=1MiB iodepth=0 numjobs=1 force_async=0 fixedbufs=0",
            "rw=read bs=1MiB iodepth=1 numjobs=1 force_async=2 fixedbufs=0",
            "rw=read bs=1MiB iodepth=1 numjobs=1 force_async=0",
            "rw=read bs=1MiB iodepth=1 numjobs=1 force_async=0 fixedbufs=0 color=red",
            "read",
        ] {
            assert!(bad.parse::<FioConfig>().is_err(), "{bad:?} accepted");
        }
    }

    #[test]
    fn the_fio_sweep_follows_the_ceiling_sweep() {
        let q = SweepConfig::quick();
        let f = FioSweep::like(&q);
        let reads = f.configs.iter().filter(|c| c.rw == Rw::Read).count();
        assert_eq!(reads, q.configs.len());
        assert!(f.configs.iter().any(|c| c.rw == Rw::Randread));
        assert_eq!((f.bytes, f.seconds), (q.bytes, q.seconds));
    }
}
