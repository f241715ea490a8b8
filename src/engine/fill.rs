//! `Engine::fill`: tensors (or tensor-parallel slices of them) read
//! straight into memory the caller already has, such as a model's own
//! parameters, in that memory plus a fixed staging budget.
//!
//! Each destination is a name (a [`TensorRef`] or a [`TensorSlice`]) and
//! the bytes its payload lands in. How each byte gets there, with `A` =
//! [`Engine::direct_align`] and `off` the payload's file offset:
//! - **In place.** A destination whose address is in phase with its
//!   payload (`addr % A == off % A`) has its payload's whole blocks read
//!   O_DIRECT straight into it; only the bytes of its first and last block
//!   that belong to the payload but not to a whole block (at most `A - 1`
//!   on each side) go through staging. Nothing outside the destination is
//!   written.
//! - **Staged.** Everything else (out of phase, a slice of many runs, the
//!   ends above) goes O_DIRECT into one registered staging arena of
//!   [`FillOptions::staging_bytes`], in pieces of at most
//!   [`SLICE_PIECE_BYTES`], and one copy moves each piece's bytes into
//!   place. Copies run on copy threads while later pieces are read: a read
//!   waits only when the staging is full of pieces not yet copied.
//! - **Buffered.** Only where no copy of a shard can be opened O_DIRECT
//!   does a read go through the page cache, straight into place.
//!
//! Memory: the destinations plus the staging arena, whatever the model's
//! size. The arena is the engine's: kept after the call for the next one
//! (it is freed with the engine), and counted in `Stats::staged`.
//!
//! The kernel writes a destination only for its in-place reads; the call
//! returns only once every read into the destinations is complete, also on
//! an error (or aborts the process, with a message, where an I/O thread
//! died with such a read still in the kernel: see `Engine::lend`).

use std::collections::VecDeque;
use std::marker::PhantomData;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

use crate::config::DirectMode;
use crate::engine::slice::SLICE_PIECE_BYTES;
use crate::engine::staging::{thread_cpu_ns, FillStaging};
use crate::engine::ticket::Ticket;
use crate::engine::Engine;
use crate::error::{Error, Result};
use crate::format::catalog::TensorRef;
use crate::format::dtype::Dtype;
use crate::format::slice::{Piece, TensorSlice, SLICE_GAP_BYTES};
use crate::memory::region::Region;
use crate::memory::{Arena, SlotSpec};
use crate::plan::placement::window_bytes;

/// The staging a fill keeps by default ([`FillOptions::staging_bytes`]):
/// enough pieces in flight to keep several NVMe drives busy while earlier
/// pieces are copied.
pub const DEFAULT_FILL_STAGING: usize = 32 << 20;

/// The most copy threads a fill starts by default.
pub const MAX_FILL_COPY_THREADS: usize = 8;

/// The most copy threads a fill may be asked for
/// ([`FillOptions::copy_threads`]); more is refused before anything is
/// read. The same bound holds in C (`ws_fill`) and Python (`load_into`).
pub const FILL_COPY_THREADS_LIMIT: usize = 256;

/// How [`Engine::fill`] reads.
#[derive(Debug, Clone)]
pub struct FillOptions {
    /// Bytes of staging (one registered arena of the engine, reused by
    /// later fills): the most the reads not yet copied into place hold.
    /// At least two pieces' worth is used (a piece is at most
    /// [`SLICE_PIECE_BYTES`] of blocks, less with a smaller budget).
    pub staging_bytes: usize,
    /// Threads that copy staged pieces into place, besides the calling
    /// thread (which copies too when the staging is full). `None`: the
    /// CPUs the engine's I/O threads leave spare, at least 1, at most
    /// [`MAX_FILL_COPY_THREADS`]. `Some(0)`: the calling thread alone.
    /// Never more than the fill has staged pieces; more than
    /// [`FILL_COPY_THREADS_LIMIT`] is refused.
    pub copy_threads: Option<usize>,
    /// Reads in place where a destination is in phase (the default).
    /// `false` sends every byte through staging and one copy: for memory
    /// the kernel must not write (or a test of that path).
    pub in_place: bool,
    /// Set from another thread to stop the fill: no read starts after it
    /// is seen, the reads in flight are waited for, and the call returns
    /// [`Error::Incomplete`] (a cancellation as its cause). For a caller
    /// that must stop early (Ctrl-C) without handing memory back while the
    /// kernel may write it.
    pub cancel: Option<std::sync::Arc<std::sync::atomic::AtomicBool>>,
}

impl Default for FillOptions {
    fn default() -> Self {
        FillOptions {
            staging_bytes: DEFAULT_FILL_STAGING,
            copy_threads: None,
            in_place: true,
            cancel: None,
        }
    }
}

/// What [`Engine::fill`] did.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct FillReport {
    /// Destinations filled.
    pub targets: usize,
    /// Payload bytes written into them.
    pub bytes: u64,
    /// Bytes the drives moved for them (whole blocks).
    pub bytes_read: u64,
    /// Reads that landed in place, O_DIRECT.
    pub in_place_reads: u64,
    /// Their payload bytes.
    pub in_place_bytes: u64,
    /// Pieces read O_DIRECT into staging and copied into place.
    pub staged_reads: u64,
    /// Their payload bytes (the bytes copied).
    pub staged_bytes: u64,
    /// Reads through the page cache (no copy of the shard opens O_DIRECT).
    pub buffered_reads: u64,
    /// Their payload bytes.
    pub buffered_bytes: u64,
    /// Destinations with at least one byte in place.
    pub targets_in_place: usize,
    /// The staging arena's bytes.
    pub staging_bytes: usize,
    /// Times a read waited for staging (the copies were behind).
    pub staging_waits: u64,
    /// Copy threads started (the calling thread copies too).
    pub copy_threads: usize,
    /// CPU time of the copies, all threads, nanoseconds.
    pub copy_cpu_ns: u64,
    /// Wall time of the call.
    pub elapsed: Duration,
}

impl FillReport {
    /// Payload bytes per second of the call (10^9 bytes = 1 GB).
    pub fn gb_per_s(&self) -> f64 {
        self.bytes as f64 / self.elapsed.as_secs_f64().max(1e-9) / 1e9
    }
}

/// What a destination of [`Engine::fill`] holds.
#[derive(Debug, Clone)]
enum What {
    Tensor(TensorRef),
    Slice(TensorSlice),
}

/// One destination of [`Engine::fill`]: a tensor, or a slice of one, and
/// the caller's bytes its payload (compact, row-major) lands in.
#[derive(Debug)]
pub struct FillTarget<'a> {
    what: What,
    ptr: NonNull<u8>,
    len: usize,
    _mem: PhantomData<&'a mut [u8]>,
}

// SAFETY: a target is a `&'a mut [u8]` (or memory the caller promised is
// as good as one, see `FillTarget::from_raw`) with its tensor: sending it
// to another thread is sending the exclusive borrow.
unsafe impl Send for FillTarget<'_> {}

impl<'a> FillTarget<'a> {
    /// `tensor`'s payload into `dest` (exactly its bytes long).
    pub fn tensor(tensor: &TensorRef, dest: &'a mut [u8]) -> Self {
        Self::over(What::Tensor(tensor.clone()), dest)
    }

    /// `slice`'s bytes (compact, row-major) into `dest` (exactly
    /// `slice.len()` long): only the pieces [`Engine::slice_plan`] chooses
    /// are read.
    pub fn slice(slice: &TensorSlice, dest: &'a mut [u8]) -> Self {
        Self::over(What::Slice(slice.clone()), dest)
    }

    fn over(what: What, dest: &'a mut [u8]) -> Self {
        FillTarget {
            what,
            // A dangling pointer for an empty destination: never written.
            ptr: NonNull::new(dest.as_mut_ptr()).unwrap_or(NonNull::dangling()),
            len: dest.len(),
            _mem: PhantomData,
        }
    }

    /// A target over `len` bytes at `ptr` (a C engine's buffer, a Python
    /// tensor's storage): `tensor` whole, or `slice` when given.
    ///
    /// # Safety
    /// `ptr..ptr + len` is valid for writes, and nothing else reads or
    /// writes it, from when the target is made until the `Engine::fill`
    /// call it is given to returns (the call returns only once nothing
    /// writes it any more). Two targets of one call do not overlap (the
    /// call checks this too).
    pub unsafe fn from_raw(tensor: &TensorRef, slice: Option<&TensorSlice>, ptr: NonNull<u8>, len: usize) -> Self {
        FillTarget {
            what: match slice {
                Some(s) => What::Slice(s.clone()),
                None => What::Tensor(tensor.clone()),
            },
            ptr,
            len,
            _mem: PhantomData,
        }
    }

    fn tensor_ref(&self) -> &TensorRef {
        match &self.what {
            What::Tensor(t) => t,
            What::Slice(s) => s.tensor(),
        }
    }

    /// The payload bytes the target wants.
    fn want(&self) -> u64 {
        match &self.what {
            What::Tensor(t) => t.len,
            What::Slice(s) => s.len(),
        }
    }

    /// The name for messages: the tensor's, with the slice's bounds.
    fn label(&self) -> String {
        match &self.what {
            What::Tensor(t) => t.name.clone(),
            What::Slice(s) => format!("{} {:?}", s.tensor().name, s.bounds()),
        }
    }
}

/// A pointer into a destination that a copy thread writes through.
#[derive(Clone, Copy)]
struct DestPtr(*mut u8);

// SAFETY: the pointer is into a target the fill call holds exclusively
// (see `FillTarget`); every job writes bytes no other job writes (pieces
// of one target cover disjoint bytes of it, targets do not overlap).
unsafe impl Send for DestPtr {}

/// How a staged piece's bytes reach their place.
enum Copy {
    /// The piece's bytes, whole, to `dest`.
    Whole(DestPtr),
    /// The runs of a slice inside `piece`, each to its place in the
    /// slice's bytes at `dest`.
    Runs { slice: usize, piece: Piece, dest: DestPtr },
}

/// One read of the plan.
enum Unit {
    /// Whole blocks straight into the target's memory at `at`.
    InPlace { target: usize, read: TensorRef, at: usize },
    /// Through staging, then `copy` (`lands`: the payload bytes it copies).
    Staged {
        target: usize,
        read: TensorRef,
        copy: Copy,
        lands: u64,
    },
    /// No O_DIRECT copy of the shard: buffered straight into place.
    Buffered { target: usize, read: TensorRef, at: usize },
}

/// A staged piece in flight.
struct Job {
    ticket: Ticket,
    target: usize,
    copy: Copy,
    bytes: u64,
    /// Bytes of staging its slot takes (its window).
    staged: usize,
}

#[derive(Default)]
struct State {
    jobs: VecDeque<Job>,
    /// Jobs taken off the queue by a thread, not finished yet.
    busy: usize,
    /// No more jobs will come.
    closed: bool,
    /// Jobs finished (their staging back), ever.
    finished: u64,
    /// Bytes of staging this fill's pieces hold now (at most its lease's
    /// budget, but for a single piece).
    staged: usize,
    error: Option<Error>,
}

/// What the copy threads and the calling thread share.
struct Shared<'s> {
    state: Mutex<State>,
    /// Signalled when a job is queued, finished, or the queue closes.
    changed: Condvar,
    slices: &'s [TensorSlice],
    /// The engine's fill staging, told when a piece's staging comes back
    /// (other fills may be waiting for room).
    pool: &'s FillStaging,
    /// Units left per target (a target is complete at 0).
    left: Vec<AtomicUsize>,
    copy_ns: AtomicU64,
    copied: AtomicU64,
}

impl Shared<'_> {
    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn failed(&self) -> bool {
        self.lock().error.is_some()
    }

    /// Waits for `job`'s read and copies it into place (unless the fill
    /// already failed: then it only waits, so nothing is left in flight).
    fn run(&self, job: Job) {
        let Job {
            ticket,
            target,
            copy,
            bytes,
            staged,
        } = job;
        let got = ticket.wait();
        let err = match got {
            Ok(loaded) => {
                if !self.failed() {
                    let t0 = thread_cpu_ns();
                    self.copy(&copy, loaded.bytes());
                    self.copy_ns
                        .fetch_add(thread_cpu_ns().saturating_sub(t0), Ordering::Relaxed);
                    self.copied.fetch_add(bytes, Ordering::Relaxed);
                    self.left[target].fetch_sub(1, Ordering::AcqRel);
                }
                // The staging slot goes back here, after the copy.
                drop(loaded);
                None
            }
            Err(e) => Some(e),
        };
        let mut st = self.lock();
        st.busy -= 1;
        st.finished += 1;
        st.staged -= staged;
        if let Some(e) = err {
            st.error.get_or_insert(e);
        }
        drop(st);
        self.changed.notify_all();
        self.pool.piece_back();
    }

    fn copy(&self, copy: &Copy, src: &[u8]) {
        match copy {
            Copy::Whole(dest) => {
                // SAFETY: `dest` is `src.len()` bytes of a target held by
                // this call (the piece's place, see `plan`), written by no
                // other job, and never inside staging.
                unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), dest.0, src.len()) }
            }
            Copy::Runs { slice, piece, dest } => {
                let s = &self.slices[*slice];
                for r in &s.runs()[piece.runs.clone()] {
                    let (a, b) = (r.src.max(piece.range.start), (r.src + r.len).min(piece.range.end));
                    if a >= b {
                        continue;
                    }
                    let from = &src[(a - piece.range.start) as usize..(b - piece.range.start) as usize];
                    let at = (r.dst + a - r.src) as usize;
                    // SAFETY: `at + from.len()` is inside the slice's
                    // bytes (a run's place in them), which the target
                    // holds exactly; the run's bytes inside this piece are
                    // written by this job only.
                    unsafe { std::ptr::copy_nonoverlapping(from.as_ptr(), dest.0.add(at), from.len()) }
                }
            }
        }
    }

    /// Takes the oldest queued job, if any, and runs it on this thread.
    fn help(&self) -> bool {
        let job = {
            let mut st = self.lock();
            let Some(job) = st.jobs.pop_front() else { return false };
            st.busy += 1;
            job
        };
        self.run(job);
        true
    }

    /// A copy thread: runs jobs until the queue is closed and empty.
    fn copier(&self) {
        loop {
            let job = {
                let mut st = self.lock();
                loop {
                    if let Some(job) = st.jobs.pop_front() {
                        st.busy += 1;
                        break job;
                    }
                    if st.closed {
                        return;
                    }
                    st = self.changed.wait(st).unwrap_or_else(|p| p.into_inner());
                }
            };
            self.run(job);
        }
    }
}

/// Borrowed arenas over the targets read in place or buffered: when the
/// call ends, however it ends, each is released only once no read into it
/// is left (or the process aborts: see the module docs).
struct Settle(Vec<Option<Arena>>);

impl Drop for Settle {
    fn drop(&mut self) {
        for a in self.0.drain(..).flatten() {
            if a.release(Duration::from_secs(3600)).is_err() {
                eprintln!(
                    "weightstream: a read into memory given to Engine::fill is still in the kernel an hour after the call \
                     ended (an I/O thread died with it); returning would hand that memory back while the kernel may write it: aborting"
                );
                std::process::abort();
            }
        }
    }
}

impl Engine {
    /// Reads each target's tensor (or slice) into the target's memory,
    /// which the caller already has (a model's parameters, an engine's
    /// buffers), and returns once all of them are there: in place and
    /// O_DIRECT where a target is in phase, else through a bounded staging
    /// arena and one copy on copy threads, pipelined with the reads (see
    /// the module docs of `fill`).
    ///
    /// Checked before any read: every tensor is this model's, every
    /// target's length is its payload's (the error names the tensor and
    /// both lengths), and no two targets overlap.
    ///
    /// An error after reads began (a drive's) names the first failure and
    /// how many targets were complete; the others may be partly written.
    /// Either way the call returns only once no read into any target is in
    /// flight.
    pub fn fill(&self, targets: Vec<FillTarget<'_>>, opts: &FillOptions) -> Result<FillReport> {
        self.origin.check()?;
        let t0 = Instant::now();
        if let Some(n) = opts.copy_threads.filter(|&n| n > FILL_COPY_THREADS_LIMIT) {
            return Err(Error::Config(format!(
                "fill: {n} copy threads asked for; at most {FILL_COPY_THREADS_LIMIT} (FillOptions::copy_threads)"
            )));
        }
        self.check_targets(&targets)?;
        let align = self.direct_align();
        let piece_bytes = fill_piece_bytes(opts.staging_bytes, align);
        let (units, slices) = self.plan_fill(&targets, opts.in_place, piece_bytes as u64)?;
        // The budget, or less when the staged pieces need less; two pieces
        // of blocks at least (one being copied, one being read), or the
        // one piece there is.
        let (mut staged_need, mut largest) = (0usize, 0usize);
        for u in &units {
            if let Unit::Staged { read, .. } = u {
                let pad = (read.offset % align as u64) as usize;
                let w = window_bytes(pad, read.len, align).unwrap_or(usize::MAX);
                staged_need = staged_need.saturating_add(w);
                largest = largest.max(w);
            }
        }
        let staging_bytes = opts
            .staging_bytes
            .max(2 * (piece_bytes + align))
            .min(staged_need)
            .max(largest)
            .div_ceil(align)
            .saturating_mul(align);
        let mut report = FillReport {
            targets: targets.len(),
            staging_bytes,
            ..Default::default()
        };
        let mut in_place_targets = vec![false; targets.len()];
        for u in &units {
            let (stat_reads, stat_bytes, read) = match u {
                Unit::InPlace { target, read, .. } => {
                    in_place_targets[*target] = true;
                    (&mut report.in_place_reads, &mut report.in_place_bytes, read)
                }
                Unit::Staged { read, lands, .. } => {
                    report.staged_reads += 1;
                    report.staged_bytes += lands;
                    let pad = (read.offset % align as u64) as usize;
                    report.bytes_read += window_bytes(pad, read.len, align).unwrap_or(0) as u64;
                    continue;
                }
                Unit::Buffered { read, .. } => (&mut report.buffered_reads, &mut report.buffered_bytes, read),
            };
            *stat_reads += 1;
            *stat_bytes += read.len;
            let pad = (read.offset % align as u64) as usize;
            report.bytes_read += window_bytes(pad, read.len, align).unwrap_or(0) as u64;
        }
        report.targets_in_place = in_place_targets.iter().filter(|&&b| b).count();
        let mut left: Vec<AtomicUsize> = (0..targets.len()).map(|_| AtomicUsize::new(0)).collect();
        for u in &units {
            let (Unit::InPlace { target, .. } | Unit::Staged { target, .. } | Unit::Buffered { target, .. }) = u;
            *left[*target].get_mut() += 1;
        }
        // Counted as slice reads, as read_slice counts them.
        for t in &targets {
            if let What::Slice(s) = &t.what {
                let plan = self.slice_plan(s);
                let c = &self.slices;
                c.reads.fetch_add(1, Ordering::Relaxed);
                c.pieces.fetch_add(plan.pieces.len() as u64, Ordering::Relaxed);
                c.runs.fetch_add(s.runs().len() as u64, Ordering::Relaxed);
                c.wanted.fetch_add(s.len(), Ordering::Relaxed);
                c.read.fetch_add(plan.read, Ordering::Relaxed);
            }
        }
        // The budget this call may fill the shared staging up to (at least
        // two of its pieces), and the largest piece's window.
        let cap = opts
            .staging_bytes
            .max(2 * (piece_bytes + align))
            .max(largest)
            .div_ceil(align)
            .saturating_mul(align);
        let lease = if report.staged_reads > 0 {
            let lease = self
                .staging
                .fill
                .lease(&self.staging.counters, staging_bytes, cap, largest, |bytes| {
                    self.packed_arena(bytes, false).map_err(|e| {
                        e.size_set_by("FillOptions::staging_bytes (the staging a fill keeps in flight)".to_string())
                    })
                })?;
            report.staging_bytes = lease.budget;
            Some(lease)
        } else {
            None
        };
        // Never more copy threads than pieces to copy (the calling thread
        // copies too).
        report.copy_threads = opts
            .copy_threads
            .unwrap_or_else(|| self.default_copy_threads())
            .min(report.staged_reads as usize);
        let shared = Shared {
            state: Mutex::new(State::default()),
            changed: Condvar::new(),
            slices: &slices,
            pool: &self.staging.fill,
            left: std::mem::take(&mut left),
            copy_ns: AtomicU64::new(0),
            copied: AtomicU64::new(0),
        };
        // Declared before the copy threads' scope: its drop (waiting out
        // every in-place read) runs after every job is done.
        let in_place_count = units.iter().filter(|u| matches!(u, Unit::InPlace { .. })).count();
        let mut settle = Settle((0..targets.len()).map(|_| None).collect());
        let mut in_place: Vec<(usize, Ticket)> = Vec::new();
        std::thread::scope(|scope| {
            for i in 0..report.copy_threads {
                let shared = &shared;
                if let Err(e) = std::thread::Builder::new()
                    .name(format!("ws-fill-copy-{i}"))
                    .spawn_scoped(scope, move || shared.copier())
                {
                    tracing::warn!("fill: copy thread {i} could not start ({e}); the calling thread copies");
                    report.copy_threads = i;
                    break;
                }
            }
            // Closes the queue however the submitting loop ends (a panic
            // included), so the copy threads finish and the scope joins.
            let _close = CloseOnExit(&shared);
            // When the in-place reads alone can keep every I/O thread busy,
            // each takes a whole-model load's chunks (`read_bulk`: as large
            // as the read, up to 16 MiB, on a drive read by pread workers)
            // instead of the 1 MiB chunks that spread one read over the
            // workers: on pread workers a chunk costs a syscall and a
            // worker hand-off, and there are enough reads to go round.
            let bulk = in_place_count >= self.io_threads();
            // A read straight into a target's memory (`exact`: the payload
            // lands at the slot's first byte, buffered).
            let mut into_place = |target: usize, read: TensorRef, at: usize, exact: bool| -> Result<()> {
                let t = &targets[target];
                let arena = settle.0[target].get_or_insert_with(|| {
                    // SAFETY: the target's memory is held by this call
                    // (FillTarget's contract) and `settle` releases this
                    // arena, waiting out every read into it, before the
                    // call returns.
                    let region = unsafe { Region::borrowed(t.ptr, t.len) };
                    Arena::packed_over(region, align, None)
                });
                let spec = SlotSpec::new(read.len as usize).with_align(align);
                match arena.take_at(at, read.len as usize, spec, exact) {
                    Some(slot) => if bulk && !exact {
                        self.read_bulk(&read, slot)
                    } else {
                        self.read(&read, slot)
                    }
                    .map(|ticket| in_place.push((target, ticket))),
                    None => Err(Error::Config(format!(
                        "fill: tensor {}: bytes [{at}, {}) of its destination are taken twice (a bug)",
                        read.name,
                        at + read.len as usize
                    ))),
                }
            };
            for u in units {
                if shared.failed() {
                    break;
                }
                if opts.cancel.as_ref().is_some_and(|c| c.load(Ordering::Acquire)) {
                    shared
                        .lock()
                        .error
                        .get_or_insert(Error::Config("fill: cancelled".into()));
                    break;
                }
                let submitted = match u {
                    Unit::Staged {
                        target,
                        read,
                        copy,
                        lands,
                    } => {
                        let lease = lease.as_ref().expect("leased when any unit is staged");
                        let pad = (read.offset % align as u64) as usize;
                        let want = window_bytes(pad, read.len, align).unwrap_or(usize::MAX);
                        let spec = SlotSpec::new(read.len as usize).with_align(align).with_tail_room(true);
                        let slot = loop {
                            let (seen, within) = {
                                let st = shared.lock();
                                (st.finished, st.staged == 0 || st.staged + want <= lease.budget)
                            };
                            let others_seen = lease.pool_returned();
                            if within {
                                if let Some(s) = lease.arena.take_window(want, spec) {
                                    shared.lock().staged += want;
                                    break Some(s);
                                }
                            }
                            report.staging_waits += 1;
                            // The staging is full of pieces not yet
                            // copied: copy the oldest here, or wait for a
                            // copy thread to finish one.
                            if shared.help() {
                                continue;
                            }
                            let st = shared.lock();
                            if st.error.is_some() {
                                break None;
                            }
                            if st.finished != seen {
                                // A piece's staging came back since the try.
                                continue;
                            }
                            if st.busy == 0 && st.jobs.is_empty() {
                                drop(st);
                                if lease.shared() {
                                    // This fill holds no staging: other
                                    // fills' pieces fill the arena. Wait
                                    // for one to come back.
                                    lease.wait_returned(others_seen);
                                    continue;
                                }
                                // Nothing holds staging, yet it has no
                                // room: the plan's pieces are sized to
                                // fit, so this is a bug, not a wait.
                                shared.lock().error.get_or_insert(Error::Config(format!(
                                    "fill: tensor {}: a piece of {want} bytes found no room in {staging_bytes} bytes of idle staging",
                                    read.name
                                )));
                                break None;
                            }
                            drop(shared.changed.wait(st).unwrap_or_else(|p| p.into_inner()));
                        };
                        let Some(slot) = slot else { break };
                        self.read(&read, slot).map(|ticket| {
                            shared.lock().jobs.push_back(Job {
                                ticket,
                                target,
                                copy,
                                bytes: lands,
                                staged: want,
                            });
                            shared.changed.notify_one();
                        })
                    }
                    Unit::InPlace { target, read, at } => into_place(target, read, at, false),
                    // A buffered payload lands at its slot's first byte.
                    Unit::Buffered { target, read, at } => into_place(target, read, at, true),
                };
                if let Err(e) = submitted {
                    shared.lock().error.get_or_insert(e);
                    break;
                }
            }
            // Every staged piece is submitted: copy alongside the copy
            // threads until none is left.
            drop(_close);
            while shared.help() {}
        });
        // Every staged piece is copied (or waited for). Now the in-place reads.
        for (target, ticket) in in_place {
            match ticket.wait() {
                Ok(loaded) => {
                    drop(loaded);
                    shared.left[target].fetch_sub(1, Ordering::AcqRel);
                }
                Err(e) => {
                    shared.lock().error.get_or_insert(e);
                }
            }
        }
        drop(settle);
        // Every piece is back: the shared staging is free for other fills.
        drop(lease);
        let copy_ns = shared.copy_ns.load(Ordering::Relaxed);
        let copied = shared.copied.load(Ordering::Relaxed);
        let c = &self.staging.counters;
        c.reads.fetch_add(report.staged_reads, Ordering::Relaxed);
        c.bytes.fetch_add(copied, Ordering::Relaxed);
        c.copy_ns.fetch_add(copy_ns, Ordering::Relaxed);
        report.copy_cpu_ns = copy_ns;
        let state = shared.state.into_inner().unwrap_or_else(|p| p.into_inner());
        if let Some(e) = state.error {
            let complete: Vec<usize> = (0..targets.len())
                .filter(|&i| shared.left[i].load(Ordering::Acquire) == 0)
                .collect();
            let incomplete: Vec<String> = (0..targets.len())
                .filter(|&i| shared.left[i].load(Ordering::Acquire) != 0)
                .map(|i| targets[i].label())
                .collect();
            return Err(Error::Incomplete {
                source: Box::new(e),
                done: complete.len(),
                total: targets.len(),
                complete,
                incomplete,
            });
        }
        report.bytes = targets.iter().map(FillTarget::want).sum();
        report.elapsed = t0.elapsed();
        Ok(report)
    }

    /// The copy threads a fill starts by default: the CPUs the I/O
    /// threads leave spare, at least 1, at most [`MAX_FILL_COPY_THREADS`].
    fn default_copy_threads(&self) -> usize {
        let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
        cpus.saturating_sub(self.io_threads()).clamp(1, MAX_FILL_COPY_THREADS)
    }

    /// Every check [`Engine::fill`] makes before it reads.
    fn check_targets(&self, targets: &[FillTarget<'_>]) -> Result<()> {
        for t in targets {
            self.model.file_of(t.tensor_ref())?;
            let want = t.want();
            if want != t.len as u64 {
                return Err(Error::Config(format!(
                    "fill: tensor {}: its payload is {want} bytes, the destination {}",
                    t.label(),
                    t.len
                )));
            }
        }
        let mut spans: Vec<(usize, usize, usize)> = targets
            .iter()
            .enumerate()
            .filter(|(_, t)| t.len > 0)
            .map(|(i, t)| (t.ptr.as_ptr() as usize, t.len, i))
            .collect();
        spans.sort_unstable();
        for w in spans.windows(2) {
            let ((a, alen, i), (b, _, j)) = (w[0], w[1]);
            if a + alen > b {
                return Err(Error::Config(format!(
                    "fill: the destinations of {} and {} overlap (give a tensor stored under two names once)",
                    targets[i].label(),
                    targets[j].label()
                )));
            }
        }
        Ok(())
    }

    /// The reads of a fill, in file order, and the slices their runs
    /// copies refer to.
    fn plan_fill(
        &self,
        targets: &[FillTarget<'_>],
        in_place: bool,
        piece_bytes: u64,
    ) -> Result<(Vec<Unit>, Vec<TensorSlice>)> {
        let align = self.direct_align() as u64;
        let direct_mode = self.model.direct_mode() != DirectMode::Off;
        let mut units = Vec::new();
        let mut slices = Vec::new();
        let mut order: Vec<usize> = (0..targets.len()).collect();
        order.sort_by_key(|&i| {
            let t = targets[i].tensor_ref();
            (t.shard, t.offset)
        });
        for i in order {
            let t = &targets[i];
            if t.len == 0 {
                continue;
            }
            let tensor = t.tensor_ref();
            let direct = direct_mode
                && self
                    .model
                    .copies(tensor.shard)
                    .iter()
                    .any(|&c| self.model.files()[c].direct.is_some());
            let range = match &t.what {
                What::Tensor(r) => Some(r.clone()),
                What::Slice(s) => s.as_range(),
            };
            let base = t.ptr.as_ptr() as usize;
            match range {
                Some(r) if !direct => units.push(Unit::Buffered {
                    target: i,
                    read: r,
                    at: 0,
                }),
                Some(r) => {
                    let (off, end) = (r.offset, r.offset + r.len);
                    let (body_start, body_end) = (off.div_ceil(align) * align, end / align * align);
                    let in_phase = in_place && (base as u64 % align) == off % align;
                    if in_phase && body_start < body_end {
                        if off < body_start {
                            staged_range(&mut units, i, &r, off..body_start, base, piece_bytes);
                        }
                        units.push(Unit::InPlace {
                            target: i,
                            read: part(&r, body_start..body_end),
                            at: (body_start - off) as usize,
                        });
                        if body_end < end {
                            staged_range(&mut units, i, &r, body_end..end, base, piece_bytes);
                        }
                    } else {
                        staged_range(&mut units, i, &r, off..end, base, piece_bytes);
                    }
                }
                None => {
                    let What::Slice(s) = &t.what else {
                        unreachable!("a whole tensor is one range")
                    };
                    let plan = s.plan_within(align, SLICE_GAP_BYTES, Some(piece_bytes));
                    let k = slices.len();
                    slices.push(s.clone());
                    for p in plan.pieces {
                        let read = part(
                            s.tensor(),
                            s.tensor().offset + p.range.start..s.tensor().offset + p.range.end,
                        );
                        let lands = s.runs()[p.runs.clone()]
                            .iter()
                            .map(|r| {
                                (r.src + r.len)
                                    .min(p.range.end)
                                    .saturating_sub(r.src.max(p.range.start))
                            })
                            .sum();
                        units.push(Unit::Staged {
                            target: i,
                            read,
                            lands,
                            copy: Copy::Runs {
                                slice: k,
                                piece: p,
                                dest: DestPtr(t.ptr.as_ptr()),
                            },
                        });
                    }
                }
            }
        }
        Ok((units, slices))
    }
}

/// The pieces of `r`'s file bytes `span` through staging, cut at the
/// file's multiples of `piece_bytes`, each copied whole to its place.
fn staged_range(
    units: &mut Vec<Unit>,
    target: usize,
    r: &TensorRef,
    span: std::ops::Range<u64>,
    base: usize,
    piece_bytes: u64,
) {
    let mut a = span.start;
    while a < span.end {
        let b = ((a / piece_bytes + 1) * piece_bytes).min(span.end);
        units.push(Unit::Staged {
            target,
            read: part(r, a..b),
            copy: Copy::Whole(DestPtr((base + (a - r.offset) as usize) as *mut u8)),
            lands: b - a,
        });
        a = b;
    }
}

/// File bytes `span` of `r`'s shard as a read of its own (bytes).
fn part(r: &TensorRef, span: std::ops::Range<u64>) -> TensorRef {
    TensorRef {
        offset: span.start,
        len: span.end - span.start,
        dtype: Dtype::U8,
        shape: vec![(span.end - span.start) as usize],
        ..r.clone()
    }
}

/// The largest piece a fill stages: [`SLICE_PIECE_BYTES`], or an eighth
/// of a smaller budget, in whole blocks (one at least): eight pieces in
/// flight keep several drives busy while earlier pieces are copied.
fn fill_piece_bytes(staging: usize, align: usize) -> usize {
    (SLICE_PIECE_BYTES.min(staging / 8) / align).max(1) * align
}

/// Closes a fill's job queue when dropped (see `Engine::fill`).
struct CloseOnExit<'a, 's>(&'a Shared<'s>);

impl Drop for CloseOnExit<'_, '_> {
    fn drop(&mut self) {
        self.0.lock().closed = true;
        self.0.changed.notify_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pieces_are_whole_blocks_within_an_eighth_of_the_budget() {
        assert_eq!(fill_piece_bytes(64 << 20, 4096), SLICE_PIECE_BYTES);
        assert_eq!(fill_piece_bytes(DEFAULT_FILL_STAGING, 4096), SLICE_PIECE_BYTES);
        assert_eq!(fill_piece_bytes(4 << 20, 4096), 512 << 10);
        assert_eq!(fill_piece_bytes(1000, 4096), 4096);
        assert_eq!(fill_piece_bytes(0, 4096), 4096);
    }

    fn t(offset: u64, len: u64) -> TensorRef {
        TensorRef {
            name: "w".into(),
            shape: vec![len as usize],
            dtype: Dtype::U8,
            offset,
            len,
            shard: 0,
            index: 0,
        }
    }

    #[test]
    fn staged_ranges_cover_the_span_once_cut_at_the_files_multiples() {
        for (off, len, piece) in [
            (100u64, 10_000u64, 4096u64),
            (0, 8192, 4096),
            (4095, 2, 4096),
            (5, 1, 4096),
        ] {
            let r = t(off, len);
            let mut units = Vec::new();
            staged_range(&mut units, 0, &r, off..off + len, 1 << 20, piece);
            let mut next = off;
            for u in &units {
                let Unit::Staged {
                    read,
                    copy: Copy::Whole(d),
                    ..
                } = u
                else {
                    panic!("a whole copy")
                };
                assert_eq!(read.offset, next, "contiguous");
                assert!(
                    read.offset / piece == (read.offset + read.len - 1) / piece,
                    "inside one piece of the file"
                );
                assert_eq!(
                    d.0 as usize,
                    (1 << 20) + (read.offset - off) as usize,
                    "lands at its place"
                );
                next = read.offset + read.len;
            }
            assert_eq!(next, off + len);
        }
    }
}
