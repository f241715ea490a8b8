//! The hand-off from callers to a drive's I/O thread(s): a job queue, the
//! credits that bound chunks in flight, and the wake-up that fits the
//! backend (an eventfd the ring has a read armed on, or a condvar the pread
//! workers sleep on).

use std::collections::VecDeque;
use std::os::fd::OwnedFd;

use std::sync::atomic::{AtomicBool, AtomicI32, Ordering};
use std::sync::{Condvar, Mutex};

use crate::engine::inflight::Request;
use crate::engine::load::DriveLoad;
use crate::engine::sync::{lock_std as lock, Arc as ReqArc};
use crate::error::Error;
use crate::memory::{Slot, SlotRange};
use crate::model::Model;
use crate::plan::chunk::Chunk;

/// Whether a read goes with a fixed buffer, and if not, why.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Plain {
    /// With its fixed buffer.
    Fixed,
    /// The pread backend: no ring, nothing to count.
    NoRing,
    /// An arena nobody asked the engine to register (`Arena::packed`,
    /// `Arena::new`, a whole-model load's own mapping: pinning memory read
    /// into once costs more than it saves): plain Read by choice, counted
    /// in `chunks_unregistered` and `chunks_unregistered_arena`, not warned.
    Unasked,
    /// Meant to be registered and is not (a slot across two registered
    /// pieces; registration refused or off for this engine; an arena
    /// registered with another engine): a fallback, counted in
    /// `chunks_unregistered` and warned.
    Fallback,
}

/// Where a chunk's bytes go: the slot's memory (a [`SlotRange`]: its
/// address travels as a pointer, never as an integer) and, when its arena
/// is registered with the ring, the fixed-buffer index that covers the slot.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Target {
    pub range: SlotRange,
    pub buf_index: Option<u16>,
    /// Without a fixed buffer, why (counted per chunk): see `Engine::buf_index`.
    pub plain: Plain,
    /// NUMA node of the slot's arena, when bound.
    pub node: Option<usize>,
}

impl Target {
    /// The target of a read into `slot`, with its fixed buffer or why it
    /// has none (`Engine::buf_index`).
    pub(crate) fn of(slot: &Slot, (buf_index, plain): (Option<u16>, Plain)) -> Self {
        Target {
            range: slot.range(),
            buf_index,
            plain,
            node: slot.node(),
        }
    }

    /// The slot's base address, for alignment checks.
    pub(crate) fn addr(&self) -> usize {
        self.range.addr()
    }

    /// Where chunk `c` lands: inside the slot (the window and chunk planning
    /// keep `slot_off + len` within the slot's length; checked again here).
    pub(crate) fn chunk_ptr(&self, c: &Chunk) -> std::ptr::NonNull<u8> {
        self.range.at(c.slot_off, c.len as usize)
    }
}

/// One chunk to read. A job is an obligation: its request's
/// [`Request::chunk_done`] is called exactly once for it (landed, failed,
/// or abandoned). A job dropped without that (an I/O thread unwinding with
/// it in hand, a queue dropped with it queued) fails its request on drop,
/// so no ticket waits forever; a job the kernel may still write for is
/// never dropped that way (the ring abandons it first, leaking the slot).
pub(crate) struct Job {
    pub req: ReqArc<Request<Slot>>,
    pub chunk: Chunk,
    pub target: Target,
    /// Catalog index of the tensor, for error messages.
    pub tensor: u32,
    /// Payload placement, for byte accounting.
    pub pad: usize,
    pub len: usize,
    /// Times this chunk was retried after EINTR/EAGAIN.
    pub retries: u8,
    /// Copy ranks this chunk has failed on (bit per rank).
    pub tried: u32,
    /// (file, cause) of each failed copy, for the error when all fail.
    pub failures: Vec<(u32, String)>,
    /// `chunk_done` was called for this job.
    settled: bool,
}

impl Job {
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn new(
        req: ReqArc<Request<Slot>>,
        chunk: Chunk,
        target: Target,
        tensor: u32,
        pad: usize,
        len: usize,
    ) -> Self {
        Job {
            req,
            chunk,
            target,
            tensor,
            pad,
            len,
            retries: 0,
            tried: 0,
            failures: Vec::new(),
            settled: false,
        }
    }

    /// Completes this chunk: the request fails with `err` if given.
    pub(crate) fn done(mut self, err: Option<Error>) {
        if let Some(e) = err {
            self.req.fail(e);
        }
        self.settled = true;
        self.req.chunk_done();
    }

    /// Gives this chunk up while the kernel may still write into its slot:
    /// the request fails with `err` and its slot is leaked, never reused.
    pub(crate) fn abandon(mut self, err: Error) {
        self.settled = true;
        self.req.abandon(err);
    }
}

impl Drop for Job {
    fn drop(&mut self) {
        if !self.settled {
            self.req.fail(Error::io(
                "<engine>",
                "read",
                std::io::Error::other("a chunk was dropped before it completed (its I/O thread stopped)"),
            ));
            self.req.chunk_done();
        }
    }
}

/// What every I/O thread of an engine shares: the model, every lane's
/// queue (a chunk that fails on one copy moves to another drive's lane) and
/// every drive's load (for adaptive routing).
///
/// A drive has one lane per I/O thread that takes its chunks: one ring, or
/// several rings for a drive that completes reads inline in the submitter
/// (each ring then copies its share on its own core), or one queue shared by
/// the pread workers. The lanes of a drive share its credits.
pub(crate) struct Io {
    pub model: Model,
    /// Every lane, drive by drive (`lanes[d]` are drive `d`'s).
    pub queues: Vec<std::sync::Arc<DriveQueue>>,
    /// Drive -> its lanes' indices in `queues`.
    pub lanes: Vec<std::ops::Range<usize>>,
    /// Drive -> the lane its next chunk goes to (round robin).
    pub next_lane: Vec<std::sync::atomic::AtomicUsize>,
    pub loads: Vec<DriveLoad>,
    /// NUMA node of each drive, when known.
    pub nodes: Vec<Option<usize>>,
    /// `Engine::shutdown` cancelled what was in flight: a failed chunk is
    /// final (no failover to another copy).
    pub cancelled: AtomicBool,
}

impl Io {
    /// Whether any lane of drive `d` still takes work.
    pub(crate) fn drive_open(&self, d: usize) -> bool {
        self.queues[self.lanes[d].clone()].iter().any(|q| !q.is_closed())
    }

    /// The lane of drive `d` the next chunk goes to: round robin over the
    /// lanes still open (lane 0 when every one is closed: a push there is
    /// refused with its reason).
    pub(crate) fn pick_lane(&self, d: usize) -> usize {
        let r = self.lanes[d].clone();
        let n = r.len();
        if n == 1 {
            return r.start;
        }
        let k = self.next_lane[d].fetch_add(1, Ordering::Relaxed);
        (0..n)
            .map(|i| r.start + (k + i) % n)
            .find(|&l| !self.queues[l].is_closed())
            .unwrap_or(r.start)
    }

    /// Chunks drive `d`'s I/O threads hold now (in a ring's in-flight
    /// table, or in a pread worker's hand); rings update it once per loop.
    pub(crate) fn in_flight(&self, d: usize) -> usize {
        self.queues[self.lanes[d].clone()]
            .iter()
            .map(|q| q.in_kernel.load(Ordering::Relaxed) + q.active.load(Ordering::Relaxed))
            .sum()
    }

    /// Why drive `d` takes no more work: `None` while any lane is open.
    pub(crate) fn drive_stopped(&self, d: usize) -> Option<String> {
        let lanes = &self.queues[self.lanes[d].clone()];
        let closed: Vec<String> = lanes.iter().filter_map(|q| q.closed_reason()).collect();
        match closed.len() {
            0 => None,
            n if n == lanes.len() => closed.into_iter().next(),
            n => Some(format!("{n} of {} rings stopped: {}", lanes.len(), closed[0])),
        }
    }

    /// Closes lane `lane` for good (its thread is gone or going). Returns
    /// what was queued on the lane, for the caller to fail over or fail.
    pub(crate) fn close_lane(&self, lane: usize, why: &str) -> (Vec<Job>, Vec<Control>) {
        self.queues[lane].close(why)
    }
}

/// Control work that must run on the ring's own thread (a single-issuer
/// ring accepts registrations only from its submitter).
pub(crate) enum Control {
    RegisterBuffers {
        first: u32,
        /// Whole slots of one arena per registered buffer.
        iovecs: Vec<SlotRange>,
        reply: std::sync::mpsc::Sender<std::io::Result<()>>,
    },
    /// Empties `n` table entries from `first` (their arena is gone): the
    /// kernel unpins the pages and returns the locked-memory charge.
    UnregisterBuffers { first: u32, n: u32 },
    /// `Engine::shutdown`: cancel every read the kernel holds.
    CancelAll,
}

pub(crate) struct Jobs {
    pub reads: VecDeque<Job>,
    pub control: VecDeque<Control>,
    pub shutdown: bool,
    /// Why the drive takes no more work (its threads are gone), once closed.
    pub closed: Option<String>,
}

/// One lane of a drive: the queue of one ring thread (or of a drive's pread
/// workers).
pub(crate) struct DriveQueue {
    /// The drive this lane belongs to.
    pub drive: usize,
    pub jobs: Mutex<Jobs>,
    /// Pread workers sleep here.
    pub ready: Condvar,
    /// The ring's wake-up (it keeps a read armed on it, or blocks reading
    /// it when the ring polls).
    pub eventfd: Option<OwnedFd>,
    /// Chunks this lane's I/O thread keeps in flight at most: the drive's
    /// queue depth shared by its lanes. Producers never wait for it: the
    /// thread takes queued chunks as room frees.
    pub depth: usize,
    /// Chunks a pread worker is reading right now.
    pub active: std::sync::atomic::AtomicUsize,
    /// Mirrors `jobs.closed.is_some()` for lock-free checks when routing.
    closed: AtomicBool,
    /// Test-only (`Engine::inject_fault`): io_uring_enter on this drive
    /// fails with this errno (0: no fault).
    pub(crate) enter_fault: AtomicI32,
    /// Test-only: the drive's next I/O thread to look panics (a ring with
    /// its chunks in flight, a pread worker with a chunk in hand).
    pub(crate) panic_fault: AtomicBool,
    /// Test-only (`Fault::HoldQueued`): the lane's I/O thread(s) take no
    /// queued chunk (what they hold goes on) until released or shut down.
    /// Written under `jobs`' lock, so a pread worker cannot miss the
    /// release between its check and its wait.
    pub(crate) held: AtomicBool,
    /// Chunks the drive's ring holds in the kernel (updated once per loop).
    pub(crate) in_kernel: std::sync::atomic::AtomicUsize,
    /// Pread workers still running (the last one to exit closes the queue).
    pub(crate) workers: std::sync::atomic::AtomicUsize,
}

impl DriveQueue {
    pub(crate) fn new(drive: usize, depth: usize, eventfd: Option<OwnedFd>) -> Self {
        DriveQueue {
            drive,
            jobs: Mutex::new(Jobs {
                reads: VecDeque::new(),
                control: VecDeque::new(),
                shutdown: false,
                closed: None,
            }),
            ready: Condvar::new(),
            eventfd,
            depth,
            active: std::sync::atomic::AtomicUsize::new(0),
            closed: AtomicBool::new(false),
            enter_fault: AtomicI32::new(0),
            panic_fault: AtomicBool::new(false),
            held: AtomicBool::new(false),
            workers: std::sync::atomic::AtomicUsize::new(0),
            in_kernel: std::sync::atomic::AtomicUsize::new(0),
        }
    }

    /// Wakes the drive's thread(s).
    pub(crate) fn notify(&self) {
        match &self.eventfd {
            Some(fd) => {
                // A full counter (it saturates at 2^64 - 2) still wakes the
                // ring, so a failed write loses nothing.
                let _ = rustix::io::write(fd, &1u64.to_ne_bytes());
            }
            None => self.ready.notify_all(),
        }
    }

    /// Test-only (`Fault::HoldQueued`): holds or releases the lane's queued
    /// chunks, and wakes its thread(s) to look.
    pub(crate) fn hold(&self, held: bool) {
        {
            let _jobs = lock(&self.jobs);
            self.held.store(held, Ordering::Relaxed);
        }
        self.notify();
    }

    /// Whether the lane's thread(s) may take queued chunks now (call with
    /// `jobs` locked): always once shutting down, so a held lane still
    /// drains.
    pub(crate) fn takes_queued(&self, jobs: &Jobs) -> bool {
        jobs.shutdown || !self.held.load(Ordering::Relaxed)
    }

    /// Queues `job` (its credit already held) without waking anyone; hands
    /// it back when the drive is closed.
    #[allow(clippy::result_large_err)] // handed back by value: a box would allocate per chunk
    pub(crate) fn push(&self, job: Job) -> Result<(), Job> {
        let mut j = lock(&self.jobs);
        if j.closed.is_some() {
            return Err(job);
        }
        j.reads.push_back(job);
        Ok(())
    }

    /// Queues control work and wakes the thread; hands it back when closed,
    /// or when the lane has no ring (pread workers: nothing to register,
    /// and nothing of theirs is left with the kernel to cancel).
    pub(crate) fn push_control(&self, c: Control) -> Result<(), Control> {
        if self.eventfd.is_none() {
            return Err(c);
        }
        {
            let mut j = lock(&self.jobs);
            if j.closed.is_some() {
                return Err(c);
            }
            j.control.push_back(c);
        }
        self.notify();
        Ok(())
    }

    /// Stops the drive: the thread(s) finish what is queued and in flight,
    /// then exit.
    pub(crate) fn shutdown(&self) {
        lock(&self.jobs).shutdown = true;
        self.notify();
    }

    /// Whether the drive takes no more work.
    pub(crate) fn is_closed(&self) -> bool {
        self.closed.load(Ordering::Acquire)
    }

    /// Why the drive is closed (`None` while it runs).
    pub(crate) fn closed_reason(&self) -> Option<String> {
        lock(&self.jobs).closed.clone()
    }

    /// Closes the lane for good: later pushes are refused. Returns what was
    /// queued. (Use [`Io::close_lane`], which also closes the drive's
    /// credits with its last lane.)
    fn close(&self, why: &str) -> (Vec<Job>, Vec<Control>) {
        let (reads, controls) = {
            let mut j = lock(&self.jobs);
            if j.closed.is_none() {
                j.closed = Some(why.to_string());
            }
            self.closed.store(true, Ordering::Release);
            (
                std::mem::take(&mut j.reads).into_iter().collect(),
                std::mem::take(&mut j.control).into_iter().collect(),
            )
        };
        self.ready.notify_all();
        (reads, controls)
    }
}
