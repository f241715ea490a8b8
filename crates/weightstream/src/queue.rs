//! The hand-off from callers to a drive's I/O thread(s): a job queue, the
//! credits that bound chunks in flight, and the wake-up that fits the
//! backend (an eventfd the ring has a read armed on, or a condvar the pread
//! workers sleep on).

use std::collections::VecDeque;
use std::os::fd::OwnedFd;

use std::sync::atomic::{AtomicBool, AtomicI32, Ordering};
use std::sync::{Condvar, Mutex};

use crate::arena::Slot;
use crate::chunk::Chunk;
use crate::error::Error;
use crate::inflight::{Credits, Request};
use crate::sync::{lock_std as lock, Arc as ReqArc};

/// Where a chunk's bytes go: the slot's base address and, when its arena is
/// registered with the ring, the fixed-buffer index that covers the slot.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Target {
    pub base: usize,
    pub buf_index: Option<u16>,
    /// NUMA node of the slot's arena, when bound.
    pub node: Option<usize>,
}

impl Target {
    /// Where chunk `c` lands: inside the slot (the window and chunk planning
    /// keep `slot_off + len` within the slot's length).
    pub(crate) fn chunk_ptr(&self, c: &Chunk) -> *mut u8 {
        (self.base + c.slot_off) as *mut u8
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
    pub model: crate::Model,
    /// Every lane, drive by drive (`lanes[d]` are drive `d`'s).
    pub queues: Vec<std::sync::Arc<DriveQueue>>,
    /// Drive -> its lanes' indices in `queues`.
    pub lanes: Vec<std::ops::Range<usize>>,
    /// Drive -> the lane its next chunk goes to (round robin).
    pub next_lane: Vec<std::sync::atomic::AtomicUsize>,
    pub loads: Vec<crate::route::DriveLoad>,
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

    /// Closes lane `lane` for good (its thread is gone or going) and, when
    /// it was the drive's last open lane, the drive's credits (producers
    /// waiting for one are woken and refused). Returns what was queued on
    /// the lane, for the caller to fail over or fail.
    pub(crate) fn close_lane(&self, lane: usize, why: &str) -> (Vec<Job>, Vec<Control>) {
        let q = &self.queues[lane];
        let queued = q.close(why);
        if !self.drive_open(q.drive) {
            q.credits.close();
        }
        queued
    }
}

/// Control work that must run on the ring's own thread (a single-issuer
/// ring accepts registrations only from its submitter).
pub(crate) enum Control {
    RegisterBuffers {
        first: u32,
        iovecs: Vec<(usize, usize)>,
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
    /// The drive's credits, shared by its lanes.
    pub credits: std::sync::Arc<Credits>,
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
    /// Chunks the drive's ring holds in the kernel (updated once per loop).
    pub(crate) in_kernel: std::sync::atomic::AtomicUsize,
    /// Pread workers still running (the last one to exit closes the queue).
    pub(crate) workers: std::sync::atomic::AtomicUsize,
}

impl DriveQueue {
    pub(crate) fn new(drive: usize, credits: std::sync::Arc<Credits>, eventfd: Option<OwnedFd>) -> Self {
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
            credits,
            active: std::sync::atomic::AtomicUsize::new(0),
            closed: AtomicBool::new(false),
            enter_fault: AtomicI32::new(0),
            panic_fault: AtomicBool::new(false),
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

    /// Queues control work and wakes the thread; hands it back when closed.
    pub(crate) fn push_control(&self, c: Control) -> Result<(), Control> {
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

    /// Stops the drive: no more credits, the thread(s) drain what is in
    /// flight and exit.
    pub(crate) fn shutdown(&self) {
        lock(&self.jobs).shutdown = true;
        self.credits.close();
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

/// Fails over (or fails) jobs taken from a closed drive's queue: none of
/// them reached the kernel. Control requests waiting for a reply get one.
pub(crate) fn fail_queued(io: &Io, lane: usize, why: &str, queued: (Vec<Job>, Vec<Control>)) {
    let (reads, controls) = queued;
    for job in reads {
        if let Some(again) = fail_copy(job, why.to_string(), io, lane) {
            requeue(io, again, why);
        }
    }
    for c in controls {
        if let Control::RegisterBuffers { reply, .. } = c {
            let _ = reply.send(Err(std::io::Error::other(DRIVE_CLOSED)));
        }
    }
}

/// The text a closed drive answers a registration with (the engine skips
/// such a drive instead of refusing the arena everywhere).
pub(crate) const DRIVE_CLOSED: &str = "the drive's I/O thread is gone";

/// A job that `fail_copy` kept on its drive, from a lane that cannot take it
/// (closed): another open lane of the drive takes it, or it fails.
pub(crate) fn requeue(io: &Io, job: Job, why: &str) {
    let drive = io.model.files()[job.chunk.file as usize].drive;
    let to = io.pick_lane(drive);
    match io.queues[to].push(job) {
        Ok(()) => io.queues[to].notify(),
        Err(back) => back.done(Some(stopped(io, drive, why))),
    }
}

fn stopped(io: &Io, drive_index: usize, why: &str) -> Error {
    Error::DriveStopped {
        device: io.model.drives()[drive_index].device.clone(),
        reason: why.to_string(),
    }
}

/// Applies a chunk's result: counts it, and either finishes the chunk
/// (returning its credit and completing the request when it was the last),
/// returns the job to issue again on this drive (a remainder, a retry, or a
/// buffered re-issue after an O_DIRECT failure, counted by cause), or moves
/// it to the next copy of its shard when this copy failed (failover, counted
/// per drive and warned once per copy). The request fails only when every
/// copy has failed, with each copy and its cause in the error.
pub(crate) fn settle(mut job: Job, res: i32, io: &Io, lane: usize) -> Option<Job> {
    use crate::chunk::{on_result, payload_bytes, Next};
    use crate::stats::DriveCounters;

    /// EINTR/EAGAIN retries of one chunk before giving up on this copy.
    const MAX_RETRIES: u8 = 64;

    let model = &io.model;
    let drive_index = io.queues[lane].drive;
    let file = &model.files()[job.chunk.file as usize];
    let drive = &model.drives()[file.drive];
    let c = &drive.counters;
    // Counts the payload bytes of `landed` (a chunk, or the prefix of one
    // that a short read delivered) and drops buffered pages.
    let count = |landed: &crate::chunk::Chunk| {
        let n = payload_bytes(landed, job.pad, job.len);
        DriveCounters::add(&c.bytes, n);
        if let (Some(a), Some(b)) = (job.target.node, io.nodes.get(file.drive).copied().flatten()) {
            if a != b {
                DriveCounters::add(&c.cross_node_bytes, n);
            }
        }
        if landed.direct {
            DriveCounters::add(&c.bytes_direct, n);
        } else {
            DriveCounters::add(&c.bytes_buffered, n);
            crate::direct::drop_pages(&file.buffered, landed.file_off, landed.len as u64);
        }
        io.loads[drive_index].done(landed.len as u64, true);
    };
    let prefix = |next: &crate::chunk::Chunk| crate::chunk::Chunk {
        len: job.chunk.len - next.len,
        ..job.chunk
    };
    let failure = match on_result(&job.chunk, res, file.topo.dio_offset_align) {
        Next::Done => {
            count(&job.chunk);
            DriveCounters::add(&c.chunks, 1);
            return finish(job, &io.queues[lane], None);
        }
        Next::Again(next) => {
            if next == job.chunk {
                job.retries += 1;
                if job.retries <= MAX_RETRIES {
                    return Some(job);
                }
                std::io::Error::from_raw_os_error(-res).to_string() + " (retries exhausted)"
            } else {
                // Progress: the prefix landed; the remainder goes again.
                count(&prefix(&next));
                job.chunk = next;
                return Some(job);
            }
        }
        Next::Fallback(next, cause) => {
            let why = format!(
                "O_DIRECT read of {} bytes at {} returned {}",
                job.chunk.len,
                job.chunk.file_off,
                if res < 0 {
                    std::io::Error::from_raw_os_error(-res).to_string()
                } else {
                    format!("{res} bytes")
                }
            );
            c.fallback(&drive.device, &file.path, cause, &why);
            if next.len < job.chunk.len {
                count(&prefix(&next));
            }
            job.chunk = next;
            return Some(job);
        }
        Next::Eof { at } => format!("end of file at byte {at} (truncated after it was opened?)"),
        Next::Fail { errno } => std::io::Error::from_raw_os_error(errno).to_string(),
    };
    // A file changed after open (truncated, replaced) says so (one fstat and
    // one stat, only on this failure path; warned once per file).
    let failure = file.explain_failure(failure);
    fail_copy(job, failure, io, lane)
}

/// This copy failed for `job` (`why`): the chunk moves to the next copy of
/// its shard that has not failed yet and whose drive still runs (after this
/// one, wrapping to the primary; counted per drive as a failover and warned
/// once per copy), or, when none is left, the request fails with every copy
/// and its cause. After `Engine::shutdown` cancelled the reads, a failure is
/// final. Returns the job when it is to be issued again on this drive.
pub(crate) fn fail_copy(mut job: Job, why: String, io: &Io, lane: usize) -> Option<Job> {
    use crate::stats::DriveCounters;
    let model = &io.model;
    let drive_index = io.queues[lane].drive;
    let file = &model.files()[job.chunk.file as usize];
    let drive = &model.drives()[file.drive];
    io.loads[drive_index].done(job.chunk.len as u64, false);
    job.tried |= 1 << file.rank.min(31);
    job.failures.push((job.chunk.file, why));
    let copies = model.copies(file.shard);
    let pos = copies.iter().position(|&f| f == job.chunk.file as usize).unwrap_or(0);
    let cancelled = io.cancelled.load(Ordering::Relaxed);
    for k in 1..copies.len() {
        if cancelled {
            break;
        }
        let next = copies[(pos + k) % copies.len()];
        let to = &model.files()[next];
        if job.tried & (1 << to.rank.min(31)) != 0 {
            continue;
        }
        if !io.drive_open(to.drive) {
            job.tried |= 1 << to.rank.min(31);
            let reason = io.drive_stopped(to.drive).unwrap_or_default();
            job.failures.push((
                next as u32,
                format!("drive {} is not running: {reason}", model.drives()[to.drive].device),
            ));
            continue;
        }
        DriveCounters::add(&drive.counters.failovers, 1);
        if !file.failover_warned.swap(true, Ordering::Relaxed) {
            tracing::warn!(
                drive = %drive.device,
                "{}: read failed ({}); retrying on {} (warned once per copy; counted per drive as failovers)",
                file.path.display(),
                job.failures.last().map_or("", |f| f.1.as_str()),
                to.path.display()
            );
        }
        job.chunk.file = next as u32;
        job.chunk.direct = job.chunk.direct && can_direct(to, &job);
        job.retries = 0;
        if to.drive == drive_index {
            io.loads[to.drive].add(job.chunk.len as u64);
            return Some(job);
        }
        // Another drive: the job takes its credit with it.
        let target = &io.queues[io.pick_lane(to.drive)];
        let len = job.chunk.len as u64;
        target.credits.force_acquire();
        io.loads[to.drive].add(len);
        match target.push(job) {
            Ok(()) => {
                target.notify();
                io.queues[lane].credits.release(1);
                return None;
            }
            Err(back) => {
                // Closed between the check and the push.
                target.credits.release(1);
                io.loads[to.drive].done(len, false);
                job = back;
                job.tried |= 1 << to.rank.min(31);
                job.failures.push((
                    next as u32,
                    format!("drive {} stopped", model.drives()[to.drive].device),
                ));
            }
        }
    }
    let causes: Vec<String> = job
        .failures
        .iter()
        .map(|(f, why)| format!("{}: {why}", crate::layout::escape(&model.files()[*f as usize].path)))
        .collect();
    let mut causes = causes.join("; ");
    if cancelled {
        causes.push_str(" (cancelled by Engine::shutdown)");
    }
    let err = Error::ReadFailed {
        tensor: model
            .catalog()
            .tensors()
            .get(job.tensor as usize)
            .map_or_else(|| "?".to_string(), |t| t.name.clone()),
        start: job.chunk.file_off,
        end: job.chunk.file_off + job.chunk.len as u64,
        copies: copies.len(),
        causes,
    };
    finish(job, &io.queues[lane], Some(err))
}
/// Whether `job`'s chunk may go O_DIRECT on copy `f`: it has an O_DIRECT
/// descriptor and the chunk's offset, length and memory meet its alignment.
pub(crate) fn can_direct(f: &crate::model::ShardFile, job: &Job) -> bool {
    let (oa, ma) = (f.topo.dio_offset_align as u64, f.topo.dio_mem_align as usize);
    f.direct.is_some()
        && job.chunk.file_off.is_multiple_of(oa)
        && (job.chunk.len as u64).is_multiple_of(oa)
        && (job.target.base + job.chunk.slot_off).is_multiple_of(ma)
}

fn finish(job: Job, q: &DriveQueue, err: Option<Error>) -> Option<Job> {
    q.credits.release(1);
    job.done(err);
    None
}
