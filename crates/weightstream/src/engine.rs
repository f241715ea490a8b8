//! The public facade: an engine over an open model, with one I/O thread per
//! drive (an io_uring ring, or a small pread pool), arenas registered with
//! the rings, and tickets that own their slot until every chunk is reaped.

use std::future::Future;
use std::pin::Pin;
use std::str::FromStr;
use std::task::{Context, Poll};
use std::thread::JoinHandle;

use crate::arena::{Arena, Slot, SlotSpec};
use crate::catalog::TensorRef;
use crate::chunk;
use crate::direct::{self, DirectMode, Loaded};
use crate::error::{Error, Result};
use crate::fork::Origin;
use crate::inflight::{Outcome, Request};
use crate::layout::RoutePolicy;
use crate::numa::{self, Locality, Provider, ThreadPlacement};
use crate::queue::{Control, DriveQueue, Io, Job, Target};
use crate::ring::{self, RingConfig, MAX_FIXED_BUFFERS, MAX_FIXED_BUFFER_BYTES};
use crate::route;
use crate::stats::FallbackCause;
use crate::stats::{DriveCounters, Feature, Stats};
use crate::sync::{lock_std as lock, Arc as ReqArc};
use crate::topology;
use crate::Model;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

/// Copies of one shard a read routes over (primary + mirrors).
const MAX_COPIES: usize = crate::model::MAX_COPY_RANKS;

/// A drive one read touches.
#[derive(Debug, Clone, Copy, Default)]
struct Touched {
    drive: usize,
    /// Lanes of the drive (bit k: its k-th lane) with chunks queued since
    /// the last notify.
    queued: u64,
    direct: bool,
    buffered: bool,
}

impl Touched {
    /// Wakes the lanes this read queued chunks on since the last notify.
    fn notify(&mut self, io: &Io) {
        let start = io.lanes[self.drive].start;
        while self.queued != 0 {
            let k = self.queued.trailing_zeros() as usize;
            io.queues[start + k].notify();
            self.queued &= self.queued - 1;
        }
    }
}

/// `adaptive` routing: a copy on a drive of another NUMA node than the
/// slot's arena costs this much more than a local one, so local copies are
/// preferred while a remote copy still takes work when the local drive is
/// busy enough.
pub const REMOTE_COST_FACTOR: f64 = 1.5;

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
        match s.trim().to_ascii_lowercase().as_str() {
            "auto" => Ok(BackendChoice::Auto),
            "uring" | "io_uring" | "io-uring" => Ok(BackendChoice::Uring),
            "pread" => Ok(BackendChoice::Pread),
            other => Err(Error::Config(format!(
                "backend {other:?}: expected auto, uring or pread"
            ))),
        }
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
        match s.trim().to_ascii_lowercase().as_str() {
            "0" | "off" | "false" => Ok(IoPoll::Off),
            "1" | "on" | "true" | "auto" => Ok(IoPoll::Auto),
            "force" => Ok(IoPoll::Force),
            other => Err(Error::Config(format!(
                "iopoll {other:?}: expected off, auto (on) or force"
            ))),
        }
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

/// How one drive's reads are issued, decided at `Engine::new`.
#[derive(Debug, Clone, PartialEq)]
struct SubmitPlan {
    /// Ring threads (lanes) for the drive.
    rings: usize,
    /// Reads flagged `IOSQE_ASYNC`.
    punt: bool,
    why: String,
}

/// The plan for a drive from the configuration and, for `Auto`, its probe
/// (`None`: no probe ran). An inline-completing drive gets one ring per CPU
/// it may use, even when other such drives use the same CPUs: two zram
/// drives on 2 CPUs, mirrored, concurrency 8, medians of 3: one ring each
/// 12.4 GB/s, two each 14.1 (a ring thread between copies leaves its core
/// idle unless another is ready). Pure: unit-tested with made-up probes.
fn plan_submit(mode: SubmitMode, probe: Option<&std::io::Result<ring::SubmitProbe>>, cpus: usize) -> SubmitPlan {
    let plan = |rings: usize, punt: bool, why: String| SubmitPlan { rings, punt, why };
    match mode {
        SubmitMode::Inline => plan(1, false, "inline (by configuration)".into()),
        SubmitMode::Async => plan(1, true, "async: punted to io-wq (by configuration)".into()),
        SubmitMode::Rings(n) => plan(n as usize, false, format!("{n} rings (by configuration)")),
        SubmitMode::Auto => match probe {
            None => plan(1, false, "inline (no probe: a polled ring)".into()),
            Some(Err(e)) => plan(1, false, format!("inline (the submit probe failed: {e})")),
            Some(Ok(p)) => match ring::completes_inline(p) {
                (true, seen) if cpus > 1 => {
                    let n = cpus.min(MAX_RINGS_PER_DRIVE);
                    plan(n, false, format!("{n} rings, one per CPU: {seen}"))
                }
                (_, seen) => plan(1, false, format!("inline: {seen}")),
            },
        },
    }
}

/// Most ring threads one drive gets under `SubmitMode::Auto`.
const MAX_RINGS_PER_DRIVE: usize = 8;

/// A fault to inject into a drive's I/O, for tests of the failure model
/// (not a stable API).
#[doc(hidden)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// The drive's I/O thread panics: a ring with its chunks in flight, a
    /// pread worker with a chunk in hand.
    PanicIoThread,
    /// Every later `io_uring_enter` of the drive's ring fails with this
    /// errno (0 clears the fault).
    EnterFails(i32),
}

/// What a bounded [`Engine::shutdown`] achieved.
#[derive(Debug, Clone)]
pub struct ShutdownReport {
    /// Every I/O thread finished within the timeout: nothing is in flight.
    pub drained: bool,
    /// Per drive whose I/O thread(s) did not finish in time: the device and
    /// the chunks still in flight there. Those threads were detached: they
    /// keep the memory the kernel may write (slots, rings) until the kernel
    /// completes the reads, which on a hung device is never (a leak, never
    /// an early free).
    pub left_in_flight: Vec<(String, usize)>,
}

/// Engine settings. `Default` suits NVMe; [`EngineConfig::from_env`] reads
/// `WEIGHTSTREAM_BACKEND`, `WEIGHTSTREAM_QD`, `WEIGHTSTREAM_CHUNK`,
/// `WEIGHTSTREAM_SQPOLL`, `WEIGHTSTREAM_IOPOLL` and `WEIGHTSTREAM_NUMA`.
#[derive(Debug, Clone)]
pub struct EngineConfig {
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
    /// The topology provider; default: [`Provider::from_env`] (live hwloc,
    /// or `WEIGHTSTREAM_NUMA_XML`).
    pub numa_provider: Option<Provider>,
}

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
        }
    }
}

impl EngineConfig {
    /// Defaults overridden by the environment.
    pub fn from_env() -> Result<Self> {
        let mut c = EngineConfig::default();
        let var = |k: &str| std::env::var(k).ok().filter(|v| !v.trim().is_empty());
        if let Some(v) = var("WEIGHTSTREAM_BACKEND") {
            c.backend = v.parse()?;
        }
        if let Some(v) = var("WEIGHTSTREAM_QD") {
            c.queue_depth = parse_num("WEIGHTSTREAM_QD", &v)?;
        }
        if let Some(v) = var("WEIGHTSTREAM_CHUNK") {
            c.chunk = Some(parse_num("WEIGHTSTREAM_CHUNK", &v)?);
        }
        if let Some(v) = var("WEIGHTSTREAM_SQPOLL") {
            c.sqpoll = matches!(v.trim(), "1" | "on" | "true");
        }
        if let Some(v) = var("WEIGHTSTREAM_IOPOLL") {
            c.iopoll = v.parse()?;
        }
        if let Some(v) = var("WEIGHTSTREAM_SUBMIT") {
            c.submit = v.parse()?;
        }
        if let Some(v) = var("WEIGHTSTREAM_IOWQ_WORKERS") {
            c.iowq_workers = Some(parse_num("WEIGHTSTREAM_IOWQ_WORKERS", &v)? as u32);
        }
        if let Some(v) = var("WEIGHTSTREAM_NUMA") {
            c.numa = !numa::is_off(&v);
        }
        Ok(c)
    }
}

fn parse_num(what: &str, v: &str) -> Result<usize> {
    v.trim()
        .parse()
        .map_err(|_| Error::Config(format!("{what}={v:?}: expected a positive integer")))
}

enum Backend {
    Uring,
    Pread,
}

struct DriveIo {
    threads: Vec<JoinHandle<()>>,
    chunk: usize,
    ring: Option<String>,
    /// How the drive's rings issue reads (io_uring backend), and io-wq's
    /// bound when they punt.
    submit: Option<(SubmitPlan, Option<u32>)>,
    /// What the drive's I/O thread(s) bound themselves to.
    binding: String,
}

/// Where one drive is, and what its I/O threads are bound to.
#[derive(Debug, Clone)]
pub struct DrivePlacement {
    pub device: String,
    pub locality: Locality,
    /// `cpuset 0-3`, `would bind cpuset 0-3 (...)`, or `not bound: why`.
    pub thread_binding: String,
}

/// An arena registered as fixed buffers: `slots_per_buffer` consecutive
/// slots per registered buffer, starting at table index `first`.
struct ArenaReg {
    id: u64,
    slots_per_buffer: usize,
    first: u32,
    n: u32,
}

struct Registry {
    arenas: Vec<ArenaReg>,
    /// Table ranges `(first, n)` free for reuse (their arena was released).
    holes: Vec<(u32, u32)>,
    next: u32,
    unregistered: Option<String>,
}

impl Registry {
    fn new(unregistered: Option<String>) -> Self {
        Registry {
            arenas: Vec::new(),
            holes: Vec::new(),
            next: 0,
            unregistered,
        }
    }

    /// A free range of `n` table entries: a hole first-fit, else the end.
    fn alloc(&mut self, n: u32) -> Option<u32> {
        if let Some(i) = self.holes.iter().position(|h| h.1 >= n) {
            let (first, len) = self.holes[i];
            if len == n {
                self.holes.remove(i);
            } else {
                self.holes[i] = (first + n, len - n);
            }
            return Some(first);
        }
        (self.next + n <= MAX_FIXED_BUFFERS).then(|| {
            self.next += n;
            self.next - n
        })
    }
}

/// Reads tensors of one model into slots, concurrently, on every drive.
pub struct Engine {
    model: Model,
    io: Arc<Io>,
    /// Rotation that breaks routing ties, so one-chunk reads alternate.
    turn: AtomicUsize,
    backend: Backend,
    backend_reason: Option<String>,
    route: RoutePolicy,
    drives: Vec<DriveIo>,
    fixed_files: Feature,
    fixed_buffers_ok: bool,
    registry: Arc<Mutex<Registry>>,
    provider: Provider,
    localities: Vec<Locality>,
    /// Where the engine was made (fork detection).
    origin: Origin,
}

impl std::fmt::Debug for Engine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Engine")
            .field("backend", &self.backend_name())
            .field("drives", &self.drives.len())
            .finish()
    }
}

impl Engine {
    /// Starts one I/O thread (ring) or pool per drive of `model`.
    pub fn new(model: &Model, config: EngineConfig) -> Result<Self> {
        let depth = config.queue_depth.clamp(1, 4096);
        let align = model.required_align();
        let chunks: Vec<usize> = (0..model.drives().len())
            .map(|i| {
                let dev_max = model
                    .files()
                    .iter()
                    .find(|f| f.drive == i)
                    .and_then(|f| topology::max_request_bytes(f.topo.dev_major, f.topo.dev_minor));
                let c = config
                    .chunk
                    .unwrap_or_else(|| dev_max.unwrap_or(1 << 20).clamp(1 << 20, 4 << 20));
                // A direct chunk must stay aligned: a multiple of the slot alignment.
                (c.max(align) / align) * align
            })
            .collect();
        let provider = if config.numa {
            config.numa_provider.clone().unwrap_or_else(Provider::from_env)
        } else {
            Provider::off("NUMA placement off (--numa off, WEIGHTSTREAM_NUMA=off or EngineConfig::numa)")
        };
        let localities: Vec<Locality> = model
            .drives()
            .iter()
            .enumerate()
            .map(|(i, d)| {
                let id = model
                    .files()
                    .iter()
                    .find(|f| f.drive == i)
                    .map(|f| (f.topo.dev_major, f.topo.dev_minor));
                let l = provider.drive_locality(&d.device, id);
                match l.node {
                    Some(n) => tracing::debug!(drive = %d.device, node = n, cpuset = ?l.cpuset, "NUMA locality"),
                    None => tracing::debug!(drive = %d.device, why = ?l.note, "NUMA locality unknown"),
                }
                l
            })
            .collect();
        let placements: Vec<ThreadPlacement> = localities
            .iter()
            .map(|l| ThreadPlacement {
                provider: provider.clone(),
                locality: l.clone(),
            })
            .collect();
        let nodes: Vec<Option<usize>> = localities.iter().map(|l| l.node).collect();
        let mut reason = None;
        if config.backend != BackendChoice::Pread {
            match start_rings(model, depth, &config, &chunks, &placements, &nodes) {
                Ok((io, drives, files)) => {
                    let buffers_ok = drives.iter().all(|d| d.1.fixed_buffers.is_ok());
                    let unregistered = drives.iter().find_map(|d| d.1.fixed_buffers.clone().err());
                    if let Some(why) = &unregistered {
                        tracing::warn!("fixed buffers unavailable ({why}); reads use plain Read (counted per drive as chunks_unregistered)");
                    }
                    return Ok(Engine {
                        model: model.clone(),
                        io,
                        turn: AtomicUsize::new(0),
                        backend: Backend::Uring,
                        backend_reason: None,
                        route: config.route.unwrap_or(model.route()),
                        drives: drives.into_iter().map(|d| d.0).collect(),
                        fixed_files: files,
                        fixed_buffers_ok: buffers_ok,
                        registry: Arc::new(Mutex::new(Registry::new(unregistered))),
                        provider,
                        localities,
                        origin: Origin::here(),
                    });
                }
                Err(ring::StartError::Spawn(e)) => return Err(spawn_error(model, e)),
                Err(ring::StartError::Setup(e)) => {
                    let hint = setup_hint(e.raw_os_error(), memlock_limit().0);
                    if config.backend != BackendChoice::Auto {
                        return Err(Error::Config(format!(
                            "io_uring_setup failed: {e}{hint}; use --backend pread (or auto)"
                        )));
                    }
                    let why = format!("io_uring unavailable ({e}{hint}); using the pread backend");
                    tracing::warn!("{why}");
                    reason = Some(why);
                }
            }
        }
        let io = make_io(model, depth, false, &nodes, &vec![1; chunks.len()])
            .map_err(|e| Error::io("<engine>", "eventfd", e))?;
        let mut drives = Vec::new();
        for (i, &chunk) in chunks.iter().enumerate() {
            let (threads, binding) = match crate::pread::start(&io, i, config.pread_threads.min(depth), &placements[i])
            {
                Ok(t) => t,
                Err(e) => {
                    stop(&io, &mut drives);
                    return Err(spawn_error(model, e));
                }
            };
            drives.push(DriveIo {
                threads,
                chunk,
                ring: None,
                submit: None,
                binding,
            });
        }
        Ok(Engine {
            model: model.clone(),
            io,
            turn: AtomicUsize::new(0),
            backend: Backend::Pread,
            route: config.route.unwrap_or(model.route()),
            backend_reason: reason
                .or_else(|| (config.backend == BackendChoice::Pread).then(|| "chosen by configuration".into())),
            drives,
            fixed_files: Feature {
                enabled: false,
                reason: Some("pread backend".into()),
            },
            fixed_buffers_ok: false,
            registry: Arc::new(Mutex::new(Registry::new(Some("pread backend".into())))),
            provider,
            localities,
            origin: Origin::here(),
        })
    }

    /// The topology provider this engine placed its drives with.
    pub fn numa_provider(&self) -> &Provider {
        &self.provider
    }

    /// Each drive's locality and its I/O threads' binding, by drive index.
    pub fn placements(&self) -> Vec<DrivePlacement> {
        self.localities
            .iter()
            .zip(&self.drives)
            .zip(self.model.drives())
            .map(|((l, io), d)| DrivePlacement {
                device: d.device.clone(),
                locality: l.clone(),
                thread_binding: io.binding.clone(),
            })
            .collect()
    }

    /// An arena like [`Engine::arena`] whose pages are bound to NUMA node
    /// `node` before first touch (mmap, bind, then fault in). Reads into its
    /// slots prefer copies on drives of that node (`adaptive`). With
    /// placement off (single-node provider) this is a plain arena with no
    /// node. A node the topology does not have is an error.
    pub fn arena_on(&self, node: usize, spec: SlotSpec, count: usize) -> Result<Arena> {
        self.origin.check()?;
        if !self.provider.places() {
            return self.arena(spec, count);
        }
        let spec = self.engine_spec(spec);
        let provider = self.provider.clone();
        let arena = Arena::new_on_node(spec, count, node, |area| provider.bind_area(area, node))?;
        self.maybe_register(&arena);
        Ok(arena)
    }

    /// An arena on the NUMA node of the drive holding `tensor`'s primary
    /// copy; a plain arena when that drive's node is unknown.
    pub fn arena_near(&self, tensor: &TensorRef, spec: SlotSpec, count: usize) -> Result<Arena> {
        let drive = self.model.file_of(tensor)?.drive;
        match self.localities.get(drive).and_then(|l| l.node) {
            Some(node) => self.arena_on(node, spec, count),
            None => self.arena(spec, count),
        }
    }

    /// The model this engine reads.
    pub fn model(&self) -> &Model {
        &self.model
    }

    pub fn backend_name(&self) -> &'static str {
        match self.backend {
            Backend::Uring => "uring",
            Backend::Pread => "pread",
        }
    }

    /// The route policy this engine uses.
    pub fn route(&self) -> RoutePolicy {
        self.route
    }

    /// Chunk size used on drive `i`.
    pub fn chunk_bytes(&self, drive: usize) -> usize {
        self.drives[drive].chunk
    }

    /// An arena of `count` slots of `spec`, registered with every ring as
    /// fixed buffers. When registration is refused (RLIMIT_MEMLOCK for
    /// non-root users, or a full table) the arena still works through plain
    /// reads; the reason is warned once and reported in the stats.
    pub fn arena(&self, spec: SlotSpec, count: usize) -> Result<Arena> {
        self.origin.check()?;
        let arena = Arena::new(self.engine_spec(spec), count)?;
        self.maybe_register(&arena);
        Ok(arena)
    }

    fn engine_spec(&self, spec: SlotSpec) -> SlotSpec {
        SlotSpec {
            align: spec.align.max(self.model.required_align()),
            ..spec
        }
    }

    fn maybe_register(&self, arena: &Arena) {
        if matches!(self.backend, Backend::Uring) && self.fixed_buffers_ok {
            self.register(arena);
        }
    }

    /// Registers `arena` with every running ring. No lock is held while a
    /// ring thread is asked (a ring thread may itself need the registry: an
    /// arena's release hook runs wherever its last slot is dropped).
    fn register(&self, arena: &Arena) {
        let slot_len = arena.slot_len();
        let (base, _) = arena.region();
        let refuse = |why: String| {
            let mut reg = lock(&self.registry);
            if reg.unregistered.is_none() {
                tracing::warn!("arena of {} bytes not registered as fixed buffers: {why}; its reads use plain Read (counted as chunks_unregistered)", arena.len() * slot_len);
            }
            reg.unregistered = Some(why);
        };
        if slot_len > MAX_FIXED_BUFFER_BYTES {
            return refuse(format!(
                "a slot of {slot_len} bytes exceeds the 1 GiB fixed-buffer limit"
            ));
        }
        let per = (MAX_FIXED_BUFFER_BYTES / slot_len).max(1);
        let n = arena.len().div_ceil(per) as u32;
        let Some(first) = lock(&self.registry).alloc(n) else {
            return refuse(format!("the fixed-buffer table ({MAX_FIXED_BUFFERS} entries) is full"));
        };
        let iovecs: Vec<(usize, usize)> = (0..n as usize)
            .map(|k| {
                let first_slot = k * per;
                let slots = per.min(arena.len() - first_slot);
                (base as usize + first_slot * slot_len, slots * slot_len)
            })
            .collect();
        let mut took = Vec::with_capacity(self.io.queues.len());
        for (i, q) in self.io.queues.iter().enumerate() {
            let (tx, rx) = std::sync::mpsc::channel();
            let pushed = q.push_control(Control::RegisterBuffers {
                first,
                iovecs: iovecs.clone(),
                reply: tx,
            });
            if pushed.is_err() {
                continue; // a stopped drive: no read goes there any more
            }
            let failed = match rx.recv() {
                Ok(Ok(())) => {
                    took.push(i);
                    None
                }
                Ok(Err(e)) if e.to_string() == crate::queue::DRIVE_CLOSED => None,
                Err(_) => None, // the thread stopped without answering
                Ok(Err(e)) if e.raw_os_error() == Some(libc::ENOMEM) => {
                    let (soft, _) = memlock_limit();
                    let need_kib = ((arena.len() * slot_len).div_ceil(1024) * self.drives.len()) as u64;
                    Some(format!(
                        "registering {} bytes failed with ENOMEM: RLIMIT_MEMLOCK is {}; raise it (`ulimit -l {}` or more, in KiB) or run with CAP_IPC_LOCK",
                        arena.len() * slot_len,
                        soft.map_or("unlimited".to_string(), |s| format!("{s} bytes")),
                        need_kib + soft.unwrap_or(0) / 1024
                    ))
                }
                Ok(Err(e)) => Some(format!("register_buffers_update: {e}")),
            };
            if let Some(why) = failed {
                // Undo the rings that took it, and give the range back.
                for &j in &took {
                    let _ = self.io.queues[j].push_control(Control::UnregisterBuffers { first, n });
                }
                lock(&self.registry).holes.push((first, n));
                return refuse(why);
            }
        }
        lock(&self.registry).arenas.push(ArenaReg {
            id: arena.id(),
            slots_per_buffer: per,
            first,
            n,
        });
        // When the arena goes, empty its entries in every ring (unpinning the
        // pages and returning the locked-memory charge) and free the range.
        // Control messages run in order per ring, so a later registration of
        // the same range always follows the unregistration. This may run on
        // a ring thread (its last slot dropped there): it holds the registry
        // only while it queues the unregistrations (no waiting), and nobody
        // holds the registry while waiting for a ring.
        let registry = Arc::downgrade(&self.registry);
        let queues: Vec<_> = self.io.queues.iter().map(Arc::downgrade).collect();
        let id = arena.id();
        let origin = self.origin;
        arena.on_release(move || {
            if origin.forked() {
                return; // a child has no rings, and the registry lock may be held forever
            }
            let Some(registry) = registry.upgrade() else { return };
            let mut reg = lock(&registry);
            let Some(i) = reg.arenas.iter().position(|a| a.id == id) else {
                return;
            };
            let a = reg.arenas.swap_remove(i);
            // Queued before the range is free again, so in every ring this
            // unregistration precedes any later registration of the range.
            for q in queues.iter().filter_map(|q| q.upgrade()) {
                let _ = q.push_control(Control::UnregisterBuffers { first: a.first, n: a.n });
            }
            reg.holes.push((a.first, a.n));
        });
    }

    fn buf_index(&self, slot: &Slot) -> Option<u16> {
        if !matches!(self.backend, Backend::Uring) {
            return None;
        }
        let reg = lock(&self.registry);
        let a = reg.arenas.iter().find(|a| a.id == slot.arena_id())?;
        Some((a.first as usize + slot.index() / a.slots_per_buffer) as u16)
    }

    /// Starts reading `tensor` into `slot`; the slot moves into the ticket
    /// and comes back with the payload (or goes back to its arena on error).
    /// Each chunk goes to a copy chosen by the model's route policy; `hash`
    /// uses [`Model::group_key`]. Blocks only while a drive already has
    /// `queue_depth` chunks in flight.
    pub fn read(&self, tensor: &TensorRef, slot: Slot) -> Result<Ticket> {
        self.read_keyed(tensor, slot, self.model.group_key(tensor))
    }

    /// [`Engine::read`] with a caller-supplied group key for `hash` routing.
    pub fn read_keyed(&self, tensor: &TensorRef, slot: Slot, key: u64) -> Result<Ticket> {
        self.origin.check()?;
        let model = &self.model;
        let primary = model.file_of(tensor)?;
        let mut w = direct::plan(&primary.path, primary.size, tensor, &slot)?;
        if w.len == 0 {
            return Ok(Ticket::new(Request::new(slot, 0), w.pad, 0, self.origin));
        }
        let copies = model.copies(tensor.shard);
        let nc = copies.len().min(MAX_COPIES);
        // Direct or buffered, per copy (copies may sit on different filesystems).
        let mut copy_direct = [false; MAX_COPIES];
        let mut refusals: [Option<(FallbackCause, String)>; MAX_COPIES] = Default::default();
        if model.direct_mode() == DirectMode::Off {
            w = w.buffered();
        } else if w.direct == 0 {
            let d = &model.drives()[primary.drive];
            let why = format!(
                "payload of {} bytes holds no whole {}-byte block",
                w.len,
                slot.spec().align
            );
            d.counters
                .fallback(&d.device, &primary.path, FallbackCause::NoBulk, &why);
        } else {
            for (r, &f) in copies[..nc].iter().enumerate() {
                refusals[r] = direct::direct_refusal(&model.files()[f], &w, &slot);
            }
            for (r, refusal) in refusals[..nc].iter().enumerate() {
                copy_direct[r] = refusal.is_none();
            }
            if !copy_direct[..nc].iter().any(|&x| x) {
                // No copy can: counted once, on the primary's drive.
                if let Some((cause, why)) = direct::direct_refusal(primary, &w, &slot) {
                    let d = &model.drives()[primary.drive];
                    d.counters.fallback(&d.device, &primary.path, cause, &why);
                }
                w = w.buffered();
            }
        }
        let chunk_size = self.drives[primary.drive].chunk;
        let slot_node = slot.node();
        let target = Target {
            base: slot.base() as usize,
            buf_index: self.buf_index(&slot),
            node: slot_node,
        };
        // Per copy: the cost factor of its drive for this slot's node.
        let mut remote = [1.0f64; MAX_COPIES];
        if let Some(sn) = slot_node {
            for (k, &f) in copies[..nc].iter().enumerate() {
                if matches!(self.localities[model.files()[f].drive].node, Some(dn) if dn != sn) {
                    remote[k] = REMOTE_COST_FACTOR;
                }
            }
        }
        let n = chunk::count(&w, chunk_size);
        let (pad, len) = (w.pad, w.len);
        let req = Request::new(slot, n);
        let mut weights = [1.0f64; MAX_COPIES];
        for (r, &f) in copies[..nc].iter().enumerate() {
            weights[r] = self.weight_of(f);
        }
        let weights = &weights[..nc];
        let policy = if nc == 1 { RoutePolicy::Hash } else { self.route };
        let hashed = route::hash_pick(key, &route::cuts(weights));
        let turn = if nc > 1 {
            self.turn.fetch_add(1, Ordering::Relaxed) % nc
        } else {
            0
        };
        let mut given = [0u32; MAX_COPIES];
        // The drives this read touches (at most one per copy): chunks queued
        // since the last notify, and whether it used the drive direct /
        // buffered (counted once per read per drive). No allocation per read.
        let mut touched = [Touched::default(); MAX_COPIES];
        let mut nt = 0usize;
        let mut refused_counted = [false; MAX_COPIES];
        let split = chunk::split(&w, tensor.shard as u32, chunk_size);
        let alive = |k: usize| self.io.drive_open(model.files()[copies[k]].drive);
        for mut ch in split {
            let r = match policy {
                RoutePolicy::Hash => hashed,
                RoutePolicy::Stripe => route::stripe_pick(weights, &given[..nc], turn),
                RoutePolicy::Adaptive => (0..nc)
                    .map(|k| (turn + k) % nc)
                    .min_by(|&a, &b| {
                        let cost = |k: usize| {
                            if alive(k) {
                                self.io.loads[model.files()[copies[k]].drive].cost(ch.len as u64) * remote[k]
                            } else {
                                f64::INFINITY
                            }
                        };
                        cost(a).total_cmp(&cost(b))
                    })
                    .unwrap_or(0),
            };
            // A copy on a stopped drive is passed over (if every copy's drive
            // stopped, the push below fails with each one's reason).
            let r = (0..nc).map(|k| (r + k) % nc).find(|&k| alive(k)).unwrap_or(r);
            given[r] += 1;
            let f = copies[r];
            let file = &model.files()[f];
            let d = file.drive;
            ch.file = f as u32;
            if ch.direct && !copy_direct[r] {
                ch.direct = false;
                if !refused_counted[r] {
                    refused_counted[r] = true;
                    if let Some(Some((cause, why))) = refusals.get(r) {
                        let dr = &model.drives()[d];
                        dr.counters.fallback(&dr.device, &file.path, *cause, why);
                    }
                }
            }
            let ti = match touched[..nt].iter().position(|t| t.drive == d) {
                Some(i) => i,
                None => {
                    touched[nt] = Touched {
                        drive: d,
                        ..Touched::default()
                    };
                    nt += 1;
                    nt - 1
                }
            };
            if ch.direct {
                touched[ti].direct = true;
            } else {
                touched[ti].buffered = true;
            }
            if target.buf_index.is_none() && matches!(self.backend, Backend::Uring) {
                DriveCounters::add(&model.drives()[d].counters.chunks_unregistered, 1);
            }
            let lane = self.io.pick_lane(d);
            let q = &self.io.queues[lane];
            let job = Job::new(ReqArc::clone(&req), ch, target, tensor.index as u32, pad, len);
            if !q.credits.try_acquire() {
                for t in touched[..nt].iter_mut() {
                    t.notify(&self.io);
                }
                if !q.credits.acquire() {
                    // The drive stopped: this chunk goes to another copy or
                    // fails, naming the drive (its credit is not held).
                    q.credits.force_acquire();
                    self.io.loads[d].add(ch.len as u64);
                    self.divert(job, lane);
                    continue;
                }
            }
            self.io.loads[d].add(ch.len as u64);
            match q.push(job) {
                Ok(()) => touched[ti].queued |= 1 << ((lane - self.io.lanes[d].start) % 64),
                Err(job) => self.divert(job, lane),
            }
        }
        for t in touched[..nt].iter_mut() {
            t.notify(&self.io);
            let c = &model.drives()[t.drive].counters;
            if t.direct {
                DriveCounters::add(&c.reads_direct, 1);
            } else if t.buffered {
                DriveCounters::add(&c.reads_buffered, 1);
            }
        }
        Ok(Ticket::new(req, pad, len, self.origin))
    }

    /// A chunk routed to lane `lane`, which stopped before it could be
    /// queued (it holds the drive's credit): another lane or copy takes it,
    /// or the read fails naming the drive.
    fn divert(&self, job: Job, lane: usize) {
        let d = self.io.queues[lane].drive;
        let why = self.io.queues[lane]
            .closed_reason()
            .unwrap_or_else(|| "the engine is shutting down".to_string());
        let why = format!("drive {} is not running: {why}", self.model.drives()[d].device);
        if let Some(again) = crate::queue::fail_copy(job, why.clone(), &self.io, lane) {
            crate::queue::requeue(&self.io, again, &why);
        }
    }

    /// Read weight of the copy in file `f` (by its rank).
    fn weight_of(&self, f: usize) -> f64 {
        let rank = self.model.files()[f].rank;
        self.model.rank_weights().get(rank).copied().unwrap_or(1.0)
    }

    /// Starts several reads; stops at the first refused one (the tickets
    /// already issued are returned with it dropped: their slots come back
    /// when their reads complete).
    pub fn read_batch<'a, I>(&self, reads: I) -> Result<Vec<Ticket>>
    where
        I: IntoIterator<Item = (&'a TensorRef, Slot)>,
    {
        reads.into_iter().map(|(t, s)| self.read(t, s)).collect()
    }

    /// A snapshot of the counters.
    pub fn stats(&self) -> Stats {
        let mut s = self.model.stats();
        s.backend = self.backend_name();
        s.backend_reason = self.backend_reason.clone();
        s.fixed_files = Some(self.fixed_files.clone());
        let unregistered = lock(&self.registry).unregistered.clone();
        s.registered_buffers = Some(Feature {
            enabled: unregistered.is_none(),
            reason: unregistered,
        });
        for (((d, io), load), l) in s
            .drives
            .iter_mut()
            .zip(&self.drives)
            .zip(&self.io.loads)
            .zip(&self.localities)
        {
            d.ring = io.ring.clone();
            d.throughput_gbps = Some(load.throughput() / 1e9);
            d.numa_node = l.node;
            d.cpuset = l.cpuset.clone();
            d.numa_source = Some(l.source);
            d.numa_note = l.note.clone();
            d.thread_binding = Some(io.binding.clone());
            if let Some((plan, iowq)) = &io.submit {
                d.submit = Some(if plan.punt { "async" } else { "inline" });
                d.rings = Some(plan.rings as u32);
                d.submit_reason = Some(plan.why.clone());
                d.iowq_max_workers = *iowq;
            }
        }
        for (i, d) in s.drives.iter_mut().enumerate() {
            d.stopped = self.io.drive_stopped(i);
        }
        s
    }
}

impl Engine {
    /// Stops the engine within `timeout`: reads not yet handed to the kernel
    /// fail at once, reads the kernel holds are cancelled
    /// (`IORING_OP_ASYNC_CANCEL`; a read already at the device completes
    /// normally), and failures are final (no failover). Every ticket of the
    /// engine then completes, with its payload or an error.
    ///
    /// Past the timeout (a hung device), the I/O threads that still own
    /// in-flight reads are detached, not joined: they keep the memory the
    /// kernel may write (the slots, the rings) until the kernel completes
    /// those reads, which on a device that never answers is never. That
    /// memory is leaked, never freed early; the report names each drive and
    /// how many chunks it still held.
    ///
    /// Dropping an engine instead waits for every read, however long.
    pub fn shutdown(mut self, timeout: std::time::Duration) -> ShutdownReport {
        let deadline = std::time::Instant::now() + timeout;
        if self.origin.forked() {
            return ShutdownReport {
                drained: false,
                left_in_flight: Vec::new(),
            };
        }
        self.io.cancelled.store(true, Ordering::Relaxed);
        for (lane, q) in self.io.queues.iter().enumerate() {
            // Nothing queued reaches the kernel any more.
            let queued = std::mem::take(&mut lock(&q.jobs).reads);
            let why = "cancelled by Engine::shutdown";
            crate::queue::fail_queued(&self.io, lane, why, (queued.into_iter().collect(), Vec::new()));
            let _ = q.push_control(Control::CancelAll);
            q.shutdown();
        }
        let mut left = Vec::new();
        for (d, io) in self.drives.iter_mut().enumerate() {
            let threads = std::mem::take(&mut io.threads);
            while threads.iter().any(|t| !t.is_finished()) && std::time::Instant::now() < deadline {
                std::thread::sleep(std::time::Duration::from_millis(1));
            }
            if threads.iter().all(|t| t.is_finished()) {
                for t in threads {
                    let _ = t.join();
                }
            } else {
                let n: usize = self.io.queues[self.io.lanes[d].clone()]
                    .iter()
                    .map(|q| q.in_kernel.load(Ordering::Relaxed) + q.active.load(Ordering::Relaxed))
                    .sum();
                let device = self.model.drives()[d].device.clone();
                tracing::warn!(
                    drive = %device,
                    "Engine::shutdown: the I/O thread did not finish within {timeout:?}; it is detached with the reads the kernel still holds (about {n} chunk(s)): their memory is leaked until the kernel completes them"
                );
                left.push((device, n));
                drop(threads); // detached
            }
        }
        ShutdownReport {
            drained: left.is_empty(),
            left_in_flight: left,
        }
    }

    /// Injects a fault into drive `drive`'s I/O, for tests of the failure
    /// model (not a stable API).
    #[doc(hidden)]
    pub fn inject_fault(&self, drive: usize, fault: Fault) {
        // A panic takes one I/O thread (the drive's first lane); a failing
        // io_uring_enter hits every ring of the drive.
        let lanes = &self.io.queues[self.io.lanes[drive].clone()];
        match fault {
            Fault::PanicIoThread => {
                lanes[0].panic_fault.store(true, Ordering::Relaxed);
                lanes[0].notify();
            }
            Fault::EnterFails(errno) => {
                for q in lanes {
                    q.enter_fault.store(errno, Ordering::Relaxed);
                }
            }
        }
    }
}

impl Drop for Engine {
    /// Drains every drive: each thread finishes what is in flight (the
    /// kernel may be writing into those slots) before it exits. This waits
    /// as long as the device takes (forever on a hung device): use
    /// [`Engine::shutdown`] for a bounded stop. In a forked child, where
    /// the threads do not exist, nothing is joined or locked: the child's
    /// copy of the engine is leaked.
    fn drop(&mut self) {
        if self.origin.forked() {
            for d in &mut self.drives {
                for t in d.threads.drain(..) {
                    std::mem::forget(t);
                }
            }
            std::mem::forget(Arc::clone(&self.io));
            std::mem::forget(Arc::clone(&self.registry));
            return;
        }
        stop(&self.io, &mut self.drives);
    }
}

/// Shuts every drive's queue, then joins every thread: each finishes what
/// is in flight before it exits (the kernel may be writing into those
/// slots), and closes its queue on the way out, failing over (or failing)
/// whatever was queued there since.
fn stop(io: &Io, drives: &mut [DriveIo]) {
    for q in &io.queues {
        q.shutdown();
    }
    for d in drives {
        for t in d.threads.drain(..) {
            let _ = t.join();
        }
    }
}

/// The lanes (`lanes[d]` per drive, with an eventfd each for rings) and the
/// load trackers of every drive. A drive's lanes share its credits.
fn make_io(
    model: &Model,
    depth: usize,
    eventfd: bool,
    nodes: &[Option<usize>],
    lanes: &[usize],
) -> std::io::Result<Arc<Io>> {
    let n = model.drives().len();
    let mut queues = Vec::new();
    let mut ranges = Vec::with_capacity(n);
    for (d, &k) in lanes.iter().enumerate() {
        let credits = Arc::new(crate::inflight::Credits::new(depth));
        let start = queues.len();
        for _ in 0..k.max(1) {
            let efd = if eventfd {
                Some(rustix::event::eventfd(0, rustix::event::EventfdFlags::CLOEXEC)?)
            } else {
                None
            };
            queues.push(Arc::new(DriveQueue::new(d, Arc::clone(&credits), efd)));
        }
        ranges.push(start..queues.len());
    }
    Ok(Arc::new(Io {
        model: model.clone(),
        queues,
        lanes: ranges,
        next_lane: (0..n).map(|_| AtomicUsize::new(0)).collect(),
        loads: (0..n).map(|_| route::DriveLoad::new(1e9)).collect(),
        nodes: nodes.to_vec(),
        cancelled: std::sync::atomic::AtomicBool::new(false),
    }))
}

type RingStart = (Arc<Io>, Vec<(DriveIo, ring::RingSetup)>, Feature);

fn start_rings(
    model: &Model,
    depth: usize,
    config: &EngineConfig,
    chunks: &[usize],
    placements: &[ThreadPlacement],
    nodes: &[Option<usize>],
) -> std::result::Result<RingStart, ring::StartError> {
    // Per drive: polled or not, its CPUs, and how reads are issued (for
    // `auto`, from a probe of how the drive completes reads).
    let mut setups = Vec::with_capacity(chunks.len());
    for (i, place) in placements.iter().enumerate() {
        let iopoll = match config.iopoll {
            IoPoll::Off => false,
            IoPoll::Auto => device_polls(model, i),
            IoPoll::Force => true,
        };
        let cpus = place
            .locality
            .cpuset
            .as_deref()
            .and_then(numa::parse_list)
            .map(|c| c.len())
            .filter(|&n| n > 0)
            .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
        let probe = (config.submit == SubmitMode::Auto && !iopoll)
            .then(|| model.files().iter().filter(|f| f.drive == i).max_by_key(|f| f.size))
            .flatten()
            .map(ring::probe_submit);
        let plan = plan_submit(config.submit, probe.as_ref(), cpus);
        tracing::debug!(drive = %model.drives()[i].device, "submit: {}", plan.why);
        setups.push((iopoll, cpus, plan));
    }
    let lanes: Vec<usize> = setups.iter().map(|s| s.2.rings).collect();
    let io = make_io(model, depth, true, nodes, &lanes).map_err(ring::StartError::Setup)?;
    let mut out: Vec<(DriveIo, ring::RingSetup)> = Vec::new();
    for (i, (&chunk, (iopoll, cpus, plan))) in chunks.iter().zip(setups).enumerate() {
        let cfg = RingConfig {
            depth: depth as u32,
            sqpoll: config.sqpoll,
            iopoll,
            punt: plan.punt,
            cpus: config.iowq_workers.unwrap_or(cpus as u32),
        };
        let mut threads = Vec::new();
        let mut first: Option<ring::RingSetup> = None;
        for lane in io.lanes[i].clone() {
            match ring::start(&io, lane, cfg, placements[i].clone()) {
                Ok((handle, setup)) => {
                    threads.push(handle);
                    first.get_or_insert(setup);
                }
                Err(e) => {
                    let mut started: Vec<DriveIo> = out.into_iter().map(|d| d.0).collect();
                    started.push(DriveIo {
                        threads,
                        chunk,
                        ring: None,
                        submit: None,
                        binding: String::new(),
                    });
                    stop(&io, &mut started);
                    return Err(e);
                }
            }
        }
        let setup = first.expect("a drive has at least one lane");
        let desc = format!(
            "{}{}",
            setup.flags,
            match &setup.fixed_files {
                Ok(()) => ", fixed files".to_string(),
                Err(e) => format!(", no fixed files ({e})"),
            }
        );
        out.push((
            DriveIo {
                threads,
                chunk,
                ring: Some(desc),
                submit: Some((plan, setup.iowq_workers)),
                binding: setup.binding.clone(),
            },
            setup,
        ));
    }
    let refused = out.iter().find_map(|d| d.1.fixed_files.clone().err());
    if let Some(why) = &refused {
        tracing::warn!("fixed files unavailable ({why}); reads use plain descriptors");
    }
    Ok((
        io,
        out,
        Feature {
            enabled: refused.is_none(),
            reason: refused,
        },
    ))
}

/// What to do about an `io_uring_setup` failure, by errno.
fn setup_hint(errno: Option<i32>, memlock_soft: Option<u64>) -> String {
    match errno {
        Some(libc::EPERM) => ": kernel.io_uring_disabled or a seccomp profile".to_string(),
        Some(libc::ENOSYS) => ": kernel without io_uring or a seccomp profile".to_string(),
        Some(libc::ENOMEM) => format!(
            ": out of memory, or RLIMIT_MEMLOCK ({}) too low for the rings (kernels before 5.12 charge rings to it; raise `ulimit -l`)",
            memlock_soft.map_or("unlimited".to_string(), |s| format!("{} KiB", s / 1024))
        ),
        _ => String::new(),
    }
}

/// A thread could not be created: no backend works without threads.
fn spawn_error(model: &Model, e: std::io::Error) -> Error {
    let hint = if e.raw_os_error() == Some(libc::EAGAIN) {
        let l = rustix::process::getrlimit(rustix::process::Resource::Nproc);
        format!(
            " (the user's process/thread limit RLIMIT_NPROC is {}: raise `ulimit -u`, or the system's threads-max / a cgroup pids.max is reached)",
            l.current.map_or("unlimited".to_string(), |v| v.to_string())
        )
    } else {
        String::new()
    };
    Error::io(
        model.catalog().dir(),
        "start an I/O thread",
        std::io::Error::new(e.kind(), format!("{e}{hint}")),
    )
}

/// Whether the block device behind drive `i` completes by polling.
fn device_polls(model: &Model, i: usize) -> bool {
    let Some(f) = model.files().iter().find(|f| f.drive == i) else {
        return false;
    };
    let p = format!("/sys/dev/block/{}:{}/queue/io_poll", f.topo.dev_major, f.topo.dev_minor);
    std::fs::read_to_string(p).map(|s| s.trim() == "1").unwrap_or(false)
}

fn memlock_limit() -> (Option<u64>, Option<u64>) {
    let l = rustix::process::getrlimit(rustix::process::Resource::Memlock);
    (l.current, l.maximum)
}

/// A read in flight. It owns the slot: the payload is reachable only once
/// every chunk has completed. Dropping it early is safe: the slot returns
/// to its arena after the last completion is reaped (or, if the drive's I/O
/// thread stopped with a chunk still in the kernel, never).
#[must_use = "a ticket owns its slot; wait() for the payload"]
pub struct Ticket {
    /// Dropped in `Drop` (leaked instead in a forked child).
    req: std::mem::ManuallyDrop<ReqArc<Request<Slot>>>,
    pad: usize,
    len: usize,
    origin: Origin,
}

impl std::fmt::Debug for Ticket {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ticket")
            .field("len", &self.len)
            .field("ready", &self.is_ready())
            .finish()
    }
}

impl Ticket {
    fn new(req: ReqArc<Request<Slot>>, pad: usize, len: usize, origin: Origin) -> Self {
        Ticket {
            req: std::mem::ManuallyDrop::new(req),
            pad,
            len,
            origin,
        }
    }

    fn resolve(&self, o: Outcome<Slot>) -> Result<Loaded> {
        match o {
            Outcome::Ready(slot) => Ok(Loaded::new(slot, self.pad, self.len)),
            Outcome::Failed(e) => Err(e),
            Outcome::Spent => Err(Error::Config("ticket polled after it completed".into())),
        }
    }

    /// Blocks until the payload has landed. In a forked child (where the
    /// engine's I/O threads do not exist) it returns [`Error::Forked`] at
    /// once instead of waiting forever.
    pub fn wait(self) -> Result<Loaded> {
        self.origin.check()?;
        let o = self.req.wait();
        self.resolve(o)
    }

    /// Whether every chunk has completed.
    pub fn is_ready(&self) -> bool {
        self.req.is_done()
    }

    /// The payload if it has landed, else the ticket back.
    pub fn try_wait(self) -> std::result::Result<Result<Loaded>, Ticket> {
        if let Err(e) = self.origin.check() {
            return Ok(Err(e));
        }
        match self.req.try_take() {
            Some(o) => Ok(self.resolve(o)),
            None => Err(self),
        }
    }
}

impl Future for Ticket {
    type Output = Result<Loaded>;
    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        if let Err(e) = self.origin.check() {
            return Poll::Ready(Err(e));
        }
        match self.req.poll(cx.waker()) {
            Poll::Ready(o) => Poll::Ready(self.resolve(o)),
            Poll::Pending => Poll::Pending,
        }
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        if self.origin.forked() {
            // A child: the request's locks may have been held by a parent
            // thread at fork time, and its slot is not mapped here. Touch
            // nothing; the child's copy of the request is leaked.
            return;
        }
        // The waker is the caller's code: drop it here, on the caller's
        // thread, not later on an I/O thread that completes the read.
        self.req.forget_waker();
        // SAFETY: `req` is dropped exactly once, here, and not used after.
        unsafe { std::mem::ManuallyDrop::drop(&mut self.req) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn probe(submit_us: u64, total_us: u64) -> Option<std::io::Result<ring::SubmitProbe>> {
        Some(Ok(ring::SubmitProbe {
            k: 8,
            bytes: 8 << 16,
            // The made-up probes say inline exactly when the call took most
            // of the time.
            done_at_submit: if submit_us * 2 > total_us { 8 } else { 0 },
            submit: std::time::Duration::from_micros(submit_us),
            total: std::time::Duration::from_micros(total_us),
        }))
    }

    #[test]
    fn an_inline_drive_gets_one_ring_per_cpu_and_others_one_ring() {
        let p = plan_submit(SubmitMode::Auto, probe(190, 200).as_ref(), 2);
        assert_eq!((p.rings, p.punt), (2, false), "{p:?}");
        assert!(p.why.contains("inline") && p.why.contains("2 rings"), "{}", p.why);
        let p = plan_submit(SubmitMode::Auto, probe(190, 200).as_ref(), 64);
        assert_eq!(p.rings, MAX_RINGS_PER_DRIVE, "capped: {p:?}");
        // One CPU: more rings would only take turns on it.
        assert_eq!(plan_submit(SubmitMode::Auto, probe(190, 200).as_ref(), 1).rings, 1);
        let p = plan_submit(SubmitMode::Auto, probe(10, 400).as_ref(), 8);
        assert_eq!((p.rings, p.punt), (1, false), "{p:?}");
        assert!(p.why.contains("asynchronously"), "{}", p.why);
    }

    #[test]
    fn configuration_wins_and_a_failed_probe_is_said() {
        assert_eq!(plan_submit(SubmitMode::Inline, probe(190, 200).as_ref(), 4).rings, 1);
        assert_eq!(plan_submit(SubmitMode::Rings(3), None, 4).rings, 3);
        let a = plan_submit(SubmitMode::Async, None, 4);
        assert_eq!((a.rings, a.punt), (1, true));
        let failed = Err(std::io::Error::from_raw_os_error(libc::EINVAL));
        let f = plan_submit(SubmitMode::Auto, Some(&failed), 4);
        assert_eq!(f.rings, 1);
        assert!(
            f.why.contains("probe failed") && f.why.contains("Invalid argument"),
            "{}",
            f.why
        );
        assert!(plan_submit(SubmitMode::Auto, None, 4).why.contains("polled"));
        assert_eq!("rings:4".parse::<SubmitMode>().unwrap(), SubmitMode::Rings(4));
        assert!("rings:0".parse::<SubmitMode>().is_err());
        assert!("fast".parse::<SubmitMode>().is_err());
    }

    #[test]
    fn setup_failures_say_what_to_do() {
        let h = setup_hint(Some(libc::ENOMEM), Some(64 << 10));
        assert!(h.contains("RLIMIT_MEMLOCK (64 KiB)") && h.contains("ulimit -l"), "{h}");
        assert!(setup_hint(Some(libc::EPERM), None).contains("io_uring_disabled"));
        assert!(setup_hint(Some(libc::ENOSYS), None).contains("kernel without io_uring"));
        assert_eq!(setup_hint(Some(libc::EINVAL), None), "");
    }
}
