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
/// (returning its credit and completing the request when it was the last)
/// or returns the job to issue again (a remainder, a retry, or a buffered
/// re-issue after an O_DIRECT failure, counted by cause).
pub(crate) fn settle(mut job: Job, res: i32, model: &crate::Model, q: &DriveQueue) -> Option<Job> {
    use crate::chunk::{on_result, payload_bytes, Next};
    use crate::error::Error;
    use crate::stats::DriveCounters;

    /// EINTR/EAGAIN retries of one chunk before giving up.
    const MAX_RETRIES: u8 = 64;

    let file = &model.files()[job.chunk.file as usize];
    let drive = &model.drives()[file.drive];
    let c = &drive.counters;
    let err = match on_result(&job.chunk, res, file.topo.dio_offset_align) {
        Next::Done => {
            let n = payload_bytes(&job.chunk, job.pad, job.len);
            DriveCounters::add(&c.bytes, n);
            if job.chunk.direct {
                DriveCounters::add(&c.bytes_direct, n);
            } else {
                DriveCounters::add(&c.bytes_buffered, n);
                crate::direct::drop_pages(&file.buffered, job.chunk.file_off, job.chunk.len as u64);
            }
            None
        }
        Next::Again(next) => {
            if next == job.chunk {
                job.retries += 1;
                if job.retries > MAX_RETRIES {
                    let e = std::io::Error::from_raw_os_error(-res);
                    return finish(job, q, Some(Error::io(&file.path, "read (retries exhausted)", e)));
                }
            }
            job.chunk = next;
            return Some(job);
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
            job.chunk = next;
            return Some(job);
        }
        Next::Eof { at } => Some(Error::UnexpectedEof {
            path: file.path.clone(),
            op: if job.chunk.direct {
                "O_DIRECT read"
            } else {
                "buffered read"
            },
            start: job.chunk.file_off,
            end: job.chunk.file_off + job.chunk.len as u64,
            at,
        }),
        Next::Fail { errno } => Some(Error::io(
            &file.path,
            if job.chunk.direct {
                "O_DIRECT read"
            } else {
                "buffered read"
            },
            std::io::Error::from_raw_os_error(errno),
        )),
    };
    finish(job, q, err)
}

fn finish(job: Job, q: &DriveQueue, err: Option<crate::error::Error>) -> Option<Job> {
    if let Some(e) = err {
        job.req.fail(e);
    }
    q.credits.release(1);
    job.req.chunk_done();
    None
}
