//! Running one configuration on one or more drives: each reader's part of
//! the files ([`Plan`]), the byte and time bounds, the readers started
//! together (a rendezvous, so none is timed while another is still
//! opening), and what they read and used.

use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

use super::config::{size_label, ReadConfig};
use super::cpu::process_cpu_seconds;
use super::drives::Drive;
use super::plan::{Part, Plan, ReaderOutcome};
use super::reader::Reader;
use crate::error::Error;

/// Bounds on one run.
#[derive(Debug, Clone, Copy)]
pub(super) struct Bound {
    /// Per drive (split evenly over its readers).
    pub(super) bytes: Option<u64>,
    pub(super) seconds: Option<f64>,
    /// Go round the files again when a reader reaches the end of its part
    /// (only with a cap).
    pub(super) repeat: bool,
    /// Buffers on huge pages (`MADV_HUGEPAGE`).
    pub(super) huge: bool,
}

/// One drive read with one configuration, starting `start` bytes in.
pub(super) struct Job<'a> {
    pub(super) drive: &'a Drive,
    pub(super) config: ReadConfig,
    pub(super) start: u64,
}

/// One job's result within a run.
pub(super) struct JobOutcome {
    pub(super) bytes: u64,
    /// From the run's start to this drive's last completion.
    pub(super) seconds: f64,
    pub(super) error: Option<Error>,
}

/// A run: several jobs (drives) read at once, one time and CPU measurement.
pub(super) struct RunOutcome {
    pub(super) jobs: Vec<JobOutcome>,
    pub(super) seconds: f64,
    pub(super) cpu_s: f64,
}

/// `MemAvailable` from /proc/meminfo, bytes.
pub(super) fn mem_available() -> Option<u64> {
    let s = std::fs::read_to_string("/proc/meminfo").ok()?;
    let l = s.lines().find(|l| l.starts_with("MemAvailable:"))?;
    Some(l.split_whitespace().nth(1)?.parse::<u64>().ok()? * 1024)
}

/// Where readers meet the coordinator: each reader arrives and waits until
/// the coordinator, having seen every reader that was started arrive, opens
/// it. Unlike a `Barrier`, the count is known only once the threads are
/// started (a thread that fails to start is not waited for).
pub(super) struct Rendezvous {
    pub(super) state: Mutex<(usize, bool)>,
    pub(super) cv: Condvar,
}

impl Rendezvous {
    pub(super) fn new() -> Self {
        Rendezvous {
            state: Mutex::new((0, false)),
            cv: Condvar::new(),
        }
    }

    pub(super) fn lock(&self) -> std::sync::MutexGuard<'_, (usize, bool)> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(super) fn arrive_and_wait(&self) {
        let mut g = self.lock();
        g.0 += 1;
        self.cv.notify_all();
        while !g.1 {
            g = self.cv.wait(g).unwrap_or_else(|p| p.into_inner());
        }
    }

    pub(super) fn wait_for(&self, n: usize) {
        let mut g = self.lock();
        while g.0 < n {
            g = self.cv.wait(g).unwrap_or_else(|p| p.into_inner());
        }
    }

    pub(super) fn open(&self) {
        self.lock().1 = true;
        self.cv.notify_all();
    }
}

/// A reader's arrival at a [`Rendezvous`], exactly once: at `pass`, or when
/// dropped (a panic unwinding through a reader still arrives).
pub(super) struct Arrival<'a> {
    pub(super) at: &'a Rendezvous,
    pub(super) passed: bool,
}

impl<'a> Arrival<'a> {
    pub(super) fn new(at: &'a Rendezvous) -> Self {
        Arrival { at, passed: false }
    }

    pub(super) fn pass(&mut self) {
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
pub(super) struct Opener<'a>(&'a Rendezvous);

impl Drop for Opener<'_> {
    fn drop(&mut self) {
        self.0.open();
    }
}

/// Reads `jobs` at once: every reader of every job sets up (ring, buffers,
/// registration), then all start together; the time and CPU are taken
/// between the start and the moment the last reader has its last
/// completion (set-up and tear-down excluded).
pub(super) fn run_jobs(jobs: &[Job], bound: Bound) -> RunOutcome {
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
