//! The engine: one I/O thread per drive (an io_uring ring, or a small pread
//! pool), arenas registered with the rings, and tickets that own their slot
//! until every chunk is reaped. A read flows through `submit` (plan, then
//! the router, then a lane's queue), a backend (`backend::{ring, pread}`),
//! and back through `completion` (the completion and failover policy) to
//! the `inflight` request its ticket waits on.

use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use crate::config::RoutePolicy;
use crate::error::Result;
use crate::fork::Origin;
use crate::format::catalog::TensorRef;
use crate::memory::{Arena, Slot, SlotSpec};
use crate::model::Model;
use crate::plan::chunk;
use crate::stats::{warning, Feature, Stats};
use crate::storage::numa::{Locality, Provider};

mod backend;
mod completion;
mod fill;
mod inflight;
mod lanes;
mod lend;
mod load;
mod probe;
mod queue;
mod registry;
mod router;
mod slice;
mod staging;
mod start;
mod submit;
mod sync;
mod ticket;
mod warnings;

pub use fill::{
    FillOptions, FillReport, FillTarget, DEFAULT_FILL_STAGING, FILL_COPY_THREADS_LIMIT, MAX_FILL_COPY_THREADS,
};
pub use lend::{Lent, LentLoaded, LentTicket, Scratch};
use queue::{Control, Io};
use registry::Registry;
use router::Router;
pub use slice::{SliceTicket, SLICE_PIECE_BYTES};
use sync::lock_std as lock;
pub use ticket::{Loaded, Ticket};

/// Engine internals for `crate::__internal` (microbenchmarks and tests of
/// the pure cores; not a stable API).
pub(crate) mod internal {
    pub use super::inflight::{Outcome, Request};
    pub use super::load::DriveLoad;
    pub use super::router::{cuts, hash_pick, stripe_pick};
}

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
    /// `true`: the drive's I/O threads take no queued chunk (what they hold
    /// completes) until `false` releases them; shutting down releases them
    /// too. For tests that need reads queued and not yet taken.
    HoldQueued(bool),
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

enum Backend {
    Uring,
    Pread,
}

struct DriveIo {
    threads: Vec<JoinHandle<()>>,
    chunk: usize,
    /// Largest chunk one read's chunks may grow to (`chunk` itself when the
    /// configuration fixed the size; see `plan::chunk::for_read`).
    chunk_max: usize,
    /// Largest chunk of a whole-model load's reads (`plan::chunk::for_bulk`),
    /// for a drive read by pread workers because it completes reads inline;
    /// `None`: such reads are chunked as any other.
    bulk_max: Option<usize>,
    ring: Option<String>,
    /// How the drive's rings issue reads (io_uring backend), and io-wq's
    /// bound when they punt.
    submit: Option<(lanes::SubmitPlan, Option<u32>)>,
    /// What the drive's I/O thread(s) bound themselves to.
    binding: String,
}

/// Where one drive is, and what its I/O threads are bound to.
#[derive(Debug, Clone)]
pub struct DrivePlacement {
    /// The drive's device name.
    pub device: String,
    /// Its NUMA locality (node, cpuset), or unknown and why.
    pub locality: Locality,
    /// `cpuset 0-3`, `would bind cpuset 0-3 (...)`, or `not bound: why`.
    pub thread_binding: String,
}

/// Reads tensors of one model into slots, concurrently, on every drive.
///
/// A mixture-of-experts decode loop: each step reads the experts the
/// router chose with one `read_batch` into one packed arena, uses them in
/// place, and drops them (their slots take the next step's reads).
///
/// ```
/// use weightstream::{Dtype, Engine, EngineConfig, Model, ModelConfig};
/// # fn main() -> Result<(), Box<dyn std::error::Error>> {
/// # let names: Vec<String> = (0..8).map(|e| format!("layers.0.experts.{e}.w")).collect();
/// # let spec: Vec<(&str, Dtype, usize)> = names.iter().map(|n| (n.as_str(), Dtype::Bf16, 20_000)).collect();
/// # let dir = weightstream::__internal::doc_model("decode", &spec)?;
/// let model = Model::open(ModelConfig::new(&dir))?;
/// let engine = Engine::new(&model, EngineConfig::default())?;
/// // Room for one step's two experts at a time (each step's slots are back
/// // before the next takes its own), sized by the arena's own rule.
/// let two = [model.tensor("layers.0.experts.0.w")?, model.tensor("layers.0.experts.1.w")?];
/// let arena = engine.packed_arena_for(&two, 1, true)?;
/// for step in 0..4 {
///     // The router's choice for this step: two experts.
///     let chosen = [step % 8, (step + 3) % 8];
///     let mut reads = Vec::new();
///     for e in chosen {
///         let t = model.tensor(&format!("layers.0.experts.{e}.w"))?;
///         reads.push((t, arena.take_for(t)?)); // a TakeError says why not
///     }
///     for ticket in engine.read_batch(reads)? {
///         let expert = ticket.wait()?;
///         assert_eq!(expert.len(), 20_000);
///         // ... compute with &expert[..] in place ...
///     } // each expert drops here: its slot is free for the next step
/// }
/// # drop(engine);
/// # std::fs::remove_dir_all(&dir)?;
/// # Ok(())
/// # }
/// ```
pub struct Engine {
    model: Model,
    io: Arc<Io>,
    /// The routing stage: the policy and its tie-breaking rotation.
    router: Router,
    backend: Backend,
    backend_reason: Option<String>,
    /// The pread backend serves because io_uring could not be set up (not
    /// because the configuration chose it).
    pread_fallback: bool,
    /// NUMA placement was asked for (`EngineConfig::numa`).
    numa_wanted: bool,
    drives: Vec<DriveIo>,
    fixed_files: Feature,
    fixed_buffers_ok: bool,
    registry: Arc<Mutex<Registry>>,
    provider: Provider,
    localities: Vec<Locality>,
    /// Where the engine was made (fork detection).
    origin: Origin,
    /// Staging for reads into caller memory out of phase, and slices'
    /// pieces (shared with the slice tickets, which give idle staging back).
    staging: Arc<staging::Staging>,
    /// Slice reads: bytes wanted against bytes read.
    slices: slice::SliceCounters,
    /// Staging one slice read keeps in flight at most (`EngineConfig::slice_staging`).
    slice_staging: usize,
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

    /// `uring` or `pread`.
    pub fn backend_name(&self) -> &'static str {
        match self.backend {
            Backend::Uring => "uring",
            Backend::Pread => "pread",
        }
    }

    /// The route policy this engine uses.
    pub fn route(&self) -> RoutePolicy {
        self.router.policy()
    }

    /// Chunk size of drive `i`: `EngineConfig::chunk` when set, else the
    /// device's (a large read may use a whole multiple of it, see
    /// [`EngineConfig::chunk`](crate::EngineConfig::chunk)).
    pub fn chunk_bytes(&self, drive: usize) -> usize {
        self.drives[drive].chunk
    }

    /// The chunk size a read of `len` bytes from copies on `drives` is cut
    /// at: the first drive's chunk, grown for a large read when the size
    /// is the engine's to choose, as long as every I/O thread of those
    /// drives keeps its share of chunks.
    fn chunk_for_read(&self, drives: impl Iterator<Item = usize> + Clone, len: usize, bulk: bool) -> usize {
        let Some(first) = drives.clone().next() else { return 1 };
        let d = &self.drives[first];
        if bulk {
            // Every copy's drive takes bulk chunks: the smallest bound.
            let max = drives
                .clone()
                .map(|i| self.drives[i].bulk_max)
                .try_fold(usize::MAX, |m, b| b.map(|b| m.min(b)));
            if let Some(max) = max {
                return chunk::for_bulk(d.chunk, max, len);
            }
        }
        let lanes = drives.map(|i| self.drives[i].threads.len().max(1)).sum();
        chunk::for_read(d.chunk, d.chunk_max, len, lanes)
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

    /// A packed arena of `bytes` (slots of any size taken with
    /// [`Arena::take_for`] or [`Arena::take_sized`], next fit), registered
    /// with every ring like [`Engine::arena`]: one arena for a model's
    /// tensors of every size. `populate` faults the pages in now; without
    /// it each page is faulted by the first read into it (the read then
    /// pays for it, overlapped with other reads).
    pub fn packed_arena(&self, bytes: usize, populate: bool) -> Result<Arena> {
        self.origin.check()?;
        let arena = Arena::packed(bytes, self.model.required_align(), populate)?;
        self.maybe_register(&arena);
        Ok(arena)
    }

    /// A packed arena sized for a loop over batches
    /// ([`Arena::packed_bytes_for`] with the model's `required_align()`):
    /// each step takes a slot per tensor of its batch ([`Arena::take_for`])
    /// and returns the oldest batch's slots once `in_flight` batches are
    /// out; `batch` is the largest batch a step reads. Such a loop never
    /// gets a [`TakeError`](crate::TakeError) from it. Registered and
    /// populated as [`Engine::packed_arena`].
    ///
    /// # Errors
    /// [`Error::Forked`](crate::Error::Forked) in a forked child; what
    /// [`Arena::packed_bytes_for`] refuses (an empty batch, `in_flight`
    /// 0); what [`Engine::packed_arena`] does (the kernel refusing the
    /// memory).
    pub fn packed_arena_for(&self, batch: &[&TensorRef], in_flight: usize, populate: bool) -> Result<Arena> {
        self.origin.check()?;
        let bytes = Arena::packed_bytes_for(batch, in_flight, self.model.required_align())?;
        self.packed_arena(bytes, populate).map_err(|e| {
            e.size_set_by(format!(
                "Engine::packed_arena_for ({in_flight} batches of {} tensors in flight)",
                batch.len()
            ))
        })
    }

    fn engine_spec(&self, spec: SlotSpec) -> SlotSpec {
        SlotSpec {
            align: spec.align.max(self.model.required_align()),
            ..spec
        }
    }

    /// Starts reading `tensor` into `slot`; the slot moves into the ticket
    /// and comes back with the payload (or goes back to its arena on error).
    /// Each chunk goes to a copy chosen by the model's route policy; `hash`
    /// uses [`Model::group_key`]. Never blocks: the chunks are queued, and
    /// each drive's I/O threads keep `queue_depth` of them in flight.
    pub fn read(&self, tensor: &TensorRef, slot: Slot) -> Result<Ticket> {
        self.read_keyed(tensor, slot, self.model.group_key(tensor))
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

    /// `Error::Forked` in a forked child (the engine's threads are not
    /// there), else Ok.
    pub(crate) fn check_origin(&self) -> Result<()> {
        self.origin.check()
    }

    /// The engine's I/O threads (ring threads, or pread workers), all drives.
    pub(crate) fn io_threads(&self) -> usize {
        self.drives.iter().map(|d| d.threads.len()).sum()
    }

    /// A snapshot of the counters. In a forked child: the model's counters
    /// as they were at the fork, each drive `stopped` (no lock of the
    /// engine is taken: a parent thread may have held it at fork).
    ///
    /// `stats().warnings` (also [`Engine::warnings`]) lists every fallback
    /// that costs speed, worst first; `{}` shows them first, then the
    /// backend and each drive.
    pub fn stats(&self) -> Stats {
        let mut s = self.model.stats();
        s.backend = self.backend_name();
        s.backend_reason = self.backend_reason.clone();
        s.fixed_files = Some(self.fixed_files.clone());
        let sc = &self.staging.counters;
        let ld = |a: &std::sync::atomic::AtomicU64| a.load(std::sync::atomic::Ordering::Relaxed);
        s.staged = crate::stats::StagedStats {
            reads: ld(&sc.reads),
            bytes: ld(&sc.bytes),
            copy_cpu_ns: ld(&sc.copy_ns),
            staging_bytes: ld(&sc.mapped),
            staging_peak_bytes: ld(&sc.peak),
        };
        let c = &self.slices;
        s.slices = crate::stats::SliceStats {
            reads: ld(&c.reads),
            pieces: ld(&c.pieces),
            runs: ld(&c.runs),
            bytes_wanted: ld(&c.wanted),
            bytes_read: ld(&c.read),
            windowed: ld(&c.windowed),
        };
        if self.origin.forked() {
            // A child: the registry, the lanes' queues and the drives' loads
            // are behind locks a parent thread may have held at fork (and
            // would never release here). The model's counters (atomics) as
            // they were at fork, and why nothing more.
            let why = format!(
                "a forked child (pid {}): the engine's I/O threads are in the parent",
                std::process::id()
            );
            for d in &mut s.drives {
                d.stopped = Some(why.clone());
            }
            let mine = self.engine_warnings(&s, None);
            s.warnings.extend(mine);
            warning::sort(&mut s.warnings);
            return s;
        }
        let reg = {
            let r = lock(&self.registry);
            warnings::Registration {
                unregistered: r.unregistered.clone(),
                refused_arenas: r.refused_arenas,
                last_refused: r.last_refused,
            }
        };
        s.registered_buffers = Some(Feature {
            enabled: reg.unregistered.is_none(),
            reason: reg.unregistered.clone(),
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
                d.submit = Some(match (plan.pread, plan.punt) {
                    (Some(_), _) => "pread",
                    (None, true) => "async",
                    (None, false) => "inline",
                });
                d.rings = plan.pread.is_none().then_some(plan.rings as u32);
                d.pread_workers = plan.pread.map(|n| n as u32);
                d.submit_reason = Some(plan.why.clone());
                d.iowq_max_workers = *iowq;
            }
        }
        for (i, d) in s.drives.iter_mut().enumerate() {
            d.stopped = self.io.drive_stopped(i);
            d.in_flight = Some(self.io.in_flight(i) as u64);
        }
        let mine = self.engine_warnings(&s, Some(&reg));
        s.warnings.extend(mine);
        warning::sort(&mut s.warnings);
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
        // A timeout too large for the clock (`Duration::MAX`) is no timeout.
        let deadline = std::time::Instant::now().checked_add(timeout);
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
            completion::fail_queued(&self.io, lane, why, (queued.into_iter().collect(), Vec::new()));
            let _ = q.push_control(Control::CancelAll);
            q.shutdown();
        }
        let mut left = Vec::new();
        for (d, io) in self.drives.iter_mut().enumerate() {
            let threads = std::mem::take(&mut io.threads);
            while threads.iter().any(|t| !t.is_finished()) && deadline.is_none_or(|d| std::time::Instant::now() < d) {
                std::thread::sleep(std::time::Duration::from_millis(1));
            }
            if threads.iter().all(|t| t.is_finished()) {
                for t in threads {
                    let _ = t.join();
                }
            } else {
                let n = self.io.in_flight(d);
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
        // io_uring_enter hits every ring of the drive, a hold every lane.
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
            Fault::HoldQueued(held) => {
                for q in lanes {
                    q.hold(held);
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
