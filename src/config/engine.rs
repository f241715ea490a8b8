//! How an engine runs: backend, queue depth, chunk size, polling, how
//! reads are issued, NUMA placement.

use std::str::FromStr;

use crate::config::env;
use crate::config::RoutePolicy;
use crate::error::{Error, Result};
use crate::storage::numa::Provider;

/// Which I/O backend to use.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum BackendChoice {
    /// io_uring, or the pread backend when io_uring is unavailable (said once).
    #[default]
    Auto,
    /// io_uring only: an error if it is unavailable.
    Uring,
    /// The pread worker pool.
    Pread,
}

impl FromStr for BackendChoice {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        super::parse_word(
            "backend",
            s,
            &[
                (&["auto"], BackendChoice::Auto),
                (&["uring", "io_uring", "io-uring"], BackendChoice::Uring),
                (&["pread"], BackendChoice::Pread),
            ],
        )
    }
}

/// Completion polling: a polled ring busy-polls the device for
/// completions instead of taking interrupts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum IoPoll {
    /// Interrupt-driven completions.
    #[default]
    Off,
    /// Polled rings on drives whose queue polls (`queue/io_poll` is 1).
    Auto,
    /// Polled rings on every drive, even one whose queue does not poll (its
    /// completions still arrive by interrupt; the ring polls for them).
    /// For testing the polled path on any device.
    Force,
}

impl FromStr for IoPoll {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        super::parse_word(
            "iopoll",
            s,
            &[
                (&["off", "0", "false"], IoPoll::Off),
                (&["auto", "on", "1", "true"], IoPoll::Auto),
                (&["force"], IoPoll::Force),
            ],
        )
    }
}

/// How a drive's reads are issued to the kernel (io_uring backend).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum SubmitMode {
    /// Decided per drive at `Engine::new` by a short probe (eight 64 KiB
    /// O_DIRECT reads, timed): a drive that completes reads inside the
    /// submitting call (zram, brd, pmem: the copy runs in `io_uring_enter`)
    /// gets one ring per CPU of its node (`Rings`), every other drive one
    /// ring that issues inline.
    #[default]
    Auto,
    /// One ring thread issues each read itself; a device that completes
    /// asynchronously (NVMe, virtio, loop) runs many at once.
    Inline,
    /// `n` ring threads for the drive, its chunks dealt round robin, each
    /// ring issuing inline: on a device that completes in the submitter,
    /// each copies its share on its own core.
    Rings(u32),
    /// One ring; every read flagged `IOSQE_ASYNC` and issued by io-wq workers
    /// (at most one per CPU of the drive's node).
    Async,
}

impl FromStr for SubmitMode {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        let t = s.trim().to_ascii_lowercase();
        match t.as_str() {
            "auto" => Ok(SubmitMode::Auto),
            "inline" => Ok(SubmitMode::Inline),
            "async" => Ok(SubmitMode::Async),
            _ => match t.strip_prefix("rings:").map(|n| n.trim().parse::<u32>()) {
                Some(Ok(n)) if (1..=64).contains(&n) => Ok(SubmitMode::Rings(n)),
                _ => Err(Error::Config(format!(
                    "submit {t:?}: expected auto, inline, async or rings:N (N from 1 to 64)"
                ))),
            },
        }
    }
}

/// Engine settings. `Default` suits NVMe; [`EngineConfig::from_env`] reads
/// `WEIGHTSTREAM_BACKEND`, `WEIGHTSTREAM_QD`, `WEIGHTSTREAM_CHUNK`,
/// `WEIGHTSTREAM_SQPOLL`, `WEIGHTSTREAM_IOPOLL` and `WEIGHTSTREAM_NUMA`.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct EngineConfig {
    /// Which I/O backend reads (io_uring, or the pread pool).
    pub backend: BackendChoice,
    /// Chunks in flight per drive.
    pub queue_depth: usize,
    /// Largest chunk in bytes; default: the device's `max_sectors_kb`,
    /// clamped to 1-4 MiB.
    pub chunk: Option<usize>,
    /// Kernel-side submission polling (costs a core per ring); off by default.
    pub sqpoll: bool,
    /// Completion polling (IOPOLL rings): off by default.
    pub iopoll: IoPoll,
    /// How reads are issued per drive (io_uring backend): decided by a probe
    /// by default.
    pub submit: SubmitMode,
    /// io-wq's bounded-worker limit per ring when reads are punted
    /// (default: the number of CPUs of the drive's node, or of the machine).
    pub iowq_workers: Option<u32>,
    /// Worker threads per drive for the pread backend.
    pub pread_threads: usize,
    /// Route policy for this engine (default: the model's).
    pub route: Option<RoutePolicy>,
    /// NUMA placement (default on): each drive's I/O threads bound to the
    /// drive's cpuset, `arena_on`/`arena_near` bind memory, routing prefers
    /// local copies. Off: the single-node provider (nothing is bound).
    pub numa: bool,
    /// The topology provider; default: `Provider::from_env` (live hwloc,
    /// or `WEIGHTSTREAM_NUMA_XML`).
    pub numa_provider: Option<Provider>,
    /// Staging one slice read keeps in flight at most
    /// (`Engine::read_slice`: the pieces of a column or block slice land
    /// in staging, then are copied into place); default
    /// [`DEFAULT_SLICE_STAGING`].
    pub slice_staging: usize,
}

/// The staging a slice read keeps in flight by default: 32 MiB, enough for
/// 8 pieces of 4 MiB (a drive's queue), small beside the slices of a
/// model's parallel layers.
pub const DEFAULT_SLICE_STAGING: usize = 32 << 20;

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            backend: BackendChoice::Auto,
            queue_depth: 32,
            chunk: None,
            sqpoll: false,
            iopoll: IoPoll::Off,
            submit: SubmitMode::Auto,
            iowq_workers: None,
            pread_threads: 8,
            route: None,
            numa: true,
            numa_provider: None,
            slice_staging: DEFAULT_SLICE_STAGING,
        }
    }
}

impl EngineConfig {
    /// Sets the backend.
    pub fn backend(mut self, backend: BackendChoice) -> Self {
        self.backend = backend;
        self
    }

    /// Sets the chunks in flight per drive.
    pub fn queue_depth(mut self, queue_depth: usize) -> Self {
        self.queue_depth = queue_depth;
        self
    }

    /// Sets the largest chunk. `None` (the default): the device's
    /// `max_sectors_kb` clamped to 1-4 MiB, and a large read's chunks grow
    /// by a whole factor up to 4 MiB as long as every I/O thread serving
    /// the read (over all its copies) still gets at least 4 of them. A set
    /// size is used as is.
    pub fn chunk(mut self, chunk: Option<usize>) -> Self {
        self.chunk = chunk;
        self
    }

    /// Turns kernel-side submission polling on or off.
    pub fn sqpoll(mut self, sqpoll: bool) -> Self {
        self.sqpoll = sqpoll;
        self
    }

    /// Sets completion polling.
    pub fn iopoll(mut self, iopoll: IoPoll) -> Self {
        self.iopoll = iopoll;
        self
    }

    /// Sets how reads are issued per drive.
    pub fn submit(mut self, submit: SubmitMode) -> Self {
        self.submit = submit;
        self
    }

    /// Sets io-wq's worker bound when reads are punted.
    pub fn iowq_workers(mut self, iowq_workers: Option<u32>) -> Self {
        self.iowq_workers = iowq_workers;
        self
    }

    /// Sets the pread workers per drive.
    pub fn pread_threads(mut self, pread_threads: usize) -> Self {
        self.pread_threads = pread_threads;
        self
    }

    /// Sets the route policy (`None`: the model's).
    pub fn route(mut self, route: Option<RoutePolicy>) -> Self {
        self.route = route;
        self
    }

    /// Turns NUMA placement on or off.
    pub fn numa(mut self, numa: bool) -> Self {
        self.numa = numa;
        self
    }

    /// Sets the topology provider (`None`: from the environment).
    pub fn numa_provider(mut self, numa_provider: Option<Provider>) -> Self {
        self.numa_provider = numa_provider;
        self
    }

    /// Sets the staging one slice read keeps in flight (at least one 4 KiB
    /// block is used, whatever this says).
    pub fn slice_staging(mut self, bytes: usize) -> Self {
        self.slice_staging = bytes;
        self
    }

    /// Defaults overridden by the environment.
    pub fn from_env() -> Result<Self> {
        let mut c = EngineConfig::default();
        let var = env::get;
        if let Some(v) = var(env::BACKEND) {
            c.backend = v.parse()?;
        }
        if let Some(v) = var(env::QD) {
            c.queue_depth = parse_num(env::QD, &v)?;
        }
        if let Some(v) = var(env::CHUNK) {
            c.chunk = Some(parse_num(env::CHUNK, &v)?);
        }
        if let Some(v) = var(env::SQPOLL) {
            c.sqpoll = matches!(v.trim(), "1" | "on" | "true");
        }
        if let Some(v) = var(env::IOPOLL) {
            c.iopoll = v.parse()?;
        }
        if let Some(v) = var(env::SUBMIT) {
            c.submit = v.parse()?;
        }
        if let Some(v) = var(env::IOWQ_WORKERS) {
            c.iowq_workers = Some(parse_num(env::IOWQ_WORKERS, &v)? as u32);
        }
        if let Some(v) = var(env::NUMA) {
            c.numa = !env::is_off(&v);
        }
        Ok(c)
    }
}

fn parse_num(what: &str, v: &str) -> Result<usize> {
    v.trim()
        .parse()
        .map_err(|_| Error::Config(format!("{what}={v:?}: expected a positive integer")))
}
