//! The hand-off from callers to a drive's I/O thread(s): a job queue, the
//! credits that bound chunks in flight, and the wake-up that fits the
//! backend (an eventfd the ring has a read armed on, or a condvar the pread
//! workers sleep on).

use std::collections::VecDeque;
use std::os::fd::OwnedFd;

use crate::arena::Slot;
use crate::chunk::Chunk;
use crate::inflight::{Credits, Request};
use crate::sync::{lock_std as lock, Arc as ReqArc};
use std::sync::{Condvar, Mutex};

/// Where a chunk's bytes go: the slot's base address and, when its arena is
/// registered with the ring, the fixed-buffer index that covers the slot.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Target {
    pub base: usize,
    pub buf_index: Option<u16>,
    /// NUMA node of the slot's arena, when bound.
    pub node: Option<usize>,
}

/// One chunk to read.
pub(crate) struct Job {
    pub req: ReqArc<Request<Slot>>,
    pub chunk: Chunk,
    pub target: Target,
    /// Payload placement, for byte accounting.
    pub pad: usize,
    pub len: usize,
    /// Times this chunk was retried after EINTR/EAGAIN.
    pub retries: u8,
    /// Copy ranks this chunk has failed on (bit per rank).
    pub tried: u32,
    /// (file, cause) of each failed copy, for the error when all fail.
    pub failures: Vec<(u32, String)>,
}

/// What every I/O thread of an engine shares: the model, every drive's
/// queue (a chunk that fails on one copy moves to another drive's queue) and
/// every drive's load (for adaptive routing).
pub(crate) struct Io {
    pub model: crate::Model,
    pub queues: Vec<std::sync::Arc<DriveQueue>>,
    pub loads: Vec<crate::route::DriveLoad>,
    /// NUMA node of each drive, when known.
    pub nodes: Vec<Option<usize>>,
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
}

pub(crate) struct Jobs {
    pub reads: VecDeque<Job>,
    pub control: VecDeque<Control>,
    pub shutdown: bool,
}

/// A drive's queue.
pub(crate) struct DriveQueue {
    pub jobs: Mutex<Jobs>,
    /// Pread workers sleep here.
    pub ready: Condvar,
    /// The ring's wake-up (it keeps a read armed on it).
    pub eventfd: Option<OwnedFd>,
    pub credits: Credits,
    /// Chunks a pread worker is reading right now.
    pub active: std::sync::atomic::AtomicUsize,
}

impl DriveQueue {
    pub(crate) fn new(depth: usize, eventfd: Option<OwnedFd>) -> Self {
        DriveQueue {
            jobs: Mutex::new(Jobs {
                reads: VecDeque::with_capacity(depth),
                control: VecDeque::new(),
                shutdown: false,
            }),
            ready: Condvar::new(),
            eventfd,
            credits: Credits::new(depth),
            active: std::sync::atomic::AtomicUsize::new(0),
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

    /// Queues `job` (its credit already held) without waking anyone.
    pub(crate) fn push(&self, job: Job) {
        lock(&self.jobs).reads.push_back(job);
    }

    pub(crate) fn push_control(&self, c: Control) {
        lock(&self.jobs).control.push_back(c);
        self.notify();
    }

    /// Stops the drive: no more credits, the thread(s) drain what is in
    /// flight and exit.
    pub(crate) fn shutdown(&self) {
        lock(&self.jobs).shutdown = true;
        self.credits.close();
        self.notify();
    }
}

/// Applies a chunk's result: counts it, and either finishes the chunk
/// (returning its credit and completing the request when it was the last),
/// returns the job to issue again on this drive (a remainder, a retry, or a
/// buffered re-issue after an O_DIRECT failure, counted by cause), or moves
/// it to the next copy of its shard when this copy failed (failover, counted
/// per drive and warned once per copy). The request fails only when every
/// copy has failed, with each copy and its cause in the error.
pub(crate) fn settle(mut job: Job, res: i32, io: &Io, drive_index: usize) -> Option<Job> {
    use crate::chunk::{on_result, payload_bytes, Next};
    use crate::error::Error;
    use crate::stats::DriveCounters;

    /// EINTR/EAGAIN retries of one chunk before giving up on this copy.
    const MAX_RETRIES: u8 = 64;

    let model = &io.model;
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
            return finish(job, &io.queues[drive_index], None);
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
    // This copy failed: the next copy of the shard that has not failed yet
    // (after this one, wrapping to the primary), else the read fails.
    io.loads[drive_index].done(job.chunk.len as u64, false);
    job.tried |= 1 << file.rank.min(31);
    job.failures.push((job.chunk.file, failure));
    let copies = model.copies(file.shard);
    let pos = copies.iter().position(|&f| f == job.chunk.file as usize).unwrap_or(0);
    let next = (1..copies.len())
        .map(|k| copies[(pos + k) % copies.len()])
        .find(|&f| job.tried & (1 << model.files()[f].rank.min(31)) == 0);
    let Some(next) = next else {
        let list: Vec<String> = job
            .failures
            .iter()
            .map(|(f, why)| format!("{}: {why}", model.files()[*f as usize].path.display()))
            .collect();
        let err = Error::AllCopiesFailed {
            start: job.chunk.file_off,
            end: job.chunk.file_off + job.chunk.len as u64,
            copies: list.join("; "),
        };
        return finish(job, &io.queues[drive_index], Some(err));
    };
    DriveCounters::add(&c.failovers, 1);
    let to = &model.files()[next];
    if !file.failover_warned.swap(true, std::sync::atomic::Ordering::Relaxed) {
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
    io.loads[to.drive].add(job.chunk.len as u64);
    if to.drive == drive_index {
        return Some(job);
    }
    // Another drive: the job takes its credit with it.
    let target = &io.queues[to.drive];
    target.credits.force_acquire();
    target.push(job);
    target.notify();
    io.queues[drive_index].credits.release(1);
    None
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

fn finish(job: Job, q: &DriveQueue, err: Option<crate::error::Error>) -> Option<Job> {
    if let Some(e) = err {
        job.req.fail(e);
    }
    q.credits.release(1);
    job.req.chunk_done();
    None
}
