//! One io_uring per drive, owned by its own thread.
//!
//! The ring is created on its thread (a single-issuer ring accepts
//! submissions only from its creator), registers the drive's shard files as
//! fixed files (a sparse table, so later layouts can add files) and arenas
//! as fixed buffers on request, and turns each chunk into one `ReadFixed`
//! (or plain `Read` for a slot of an unregistered arena). A read is kept
//! armed on the drive queue's eventfd, so a caller's notify wakes a thread
//! sleeping in `io_uring_enter` without any spinning.
//!
//! `user_data` packs (table index: 32 bits, generation: 16 bits, chunk
//! sequence: 16 bits). The in-flight table holds each chunk's job, and with
//! it an `Arc` of its request (which owns the slot), from submission until
//! its completion is reaped; the thread exits only when the table is empty.

use std::os::fd::{AsRawFd, RawFd};
use std::sync::mpsc;
use std::thread::JoinHandle;

use io_uring::{opcode, types, IoUring};

use crate::numa::ThreadPlacement;
use crate::queue::{settle, Control, DriveQueue, Io, Job};
use crate::sync::lock_std as lock;
use crate::Model;
use std::sync::Arc;

/// Most fixed buffers a ring takes (the kernel's limit).
pub(crate) const MAX_FIXED_BUFFERS: u32 = 1 << 14;
/// Largest single registered buffer.
pub(crate) const MAX_FIXED_BUFFER_BYTES: usize = 1 << 30;

const EVENTFD_TAG: u64 = u64::MAX;

/// How to set a ring up.
#[derive(Debug, Clone, Copy)]
pub(crate) struct RingConfig {
    pub depth: u32,
    pub sqpoll: bool,
    pub iopoll: bool,
}

/// What setup achieved, reported back to the engine.
#[derive(Debug, Clone)]
pub(crate) struct RingSetup {
    pub flags: String,
    pub fixed_files: Result<(), String>,
    pub fixed_buffers: Result<(), String>,
    /// What the ring thread bound itself to (see `numa::bind_thread_described`).
    pub binding: String,
}

/// Starts the ring thread of drive `drive`. Returns after the ring exists
/// (or failed to be created: the error is `io_uring_setup`'s).
pub(crate) fn start(
    io: &Arc<Io>,
    drive: usize,
    cfg: RingConfig,
    placement: ThreadPlacement,
) -> std::io::Result<(JoinHandle<()>, RingSetup)> {
    let (tx, rx) = mpsc::channel();
    let model = &io.model;
    let io2 = Arc::clone(io);
    let handle = std::thread::Builder::new()
        .name(format!("ws-ring-{}", model.drives()[drive].device))
        .spawn(move || {
            // Bound before the ring exists, so its memory and any kernel
            // worker it spawns start on the drive's node.
            let binding = placement.apply();
            let ring = match build(cfg) {
                Ok(r) => r,
                Err(e) => {
                    let _ = tx.send(Err(e));
                    return;
                }
            };
            let mut t = RingThread::new(ring.0, io2, drive, cfg);
            let setup = RingSetup {
                flags: ring.1,
                fixed_files: t.register_files(),
                fixed_buffers: t.sparse_buffers(),
                binding,
            };
            let _ = tx.send(Ok(setup));
            t.run();
        })?;
    match rx.recv() {
        Ok(Ok(setup)) => Ok((handle, setup)),
        Ok(Err(e)) => {
            let _ = handle.join();
            Err(e)
        }
        Err(_) => {
            let _ = handle.join();
            Err(std::io::Error::other("ring thread exited during setup"))
        }
    }
}

/// Creates the ring with the flags that suit one submitter thread, falling
/// back to a plain setup on kernels that refuse them.
fn build(cfg: RingConfig) -> std::io::Result<(IoUring, String)> {
    let entries = (cfg.depth + 8).next_power_of_two();
    let mut b = IoUring::builder();
    let mut flags = vec![];
    if cfg.sqpoll {
        // The kernel's poller thread submits; task-run flags do not apply.
        b.setup_sqpoll(50).setup_single_issuer();
        flags.extend(["sqpoll", "single_issuer"]);
    } else {
        // DEFER_TASKRUN runs completions only when this thread enters the
        // kernel to wait: no interrupts of other work, no task_work storms.
        b.setup_single_issuer().setup_defer_taskrun().setup_coop_taskrun();
        flags.extend(["single_issuer", "defer_taskrun", "coop_taskrun"]);
    }
    b.setup_submit_all();
    flags.push("submit_all");
    if cfg.iopoll {
        b.setup_iopoll();
        flags.push("iopoll");
    }
    match b.build(entries) {
        Ok(r) => Ok((r, flags.join("+"))),
        Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
            tracing::warn!(
                "io_uring refused {} ({e}); using a plain ring (reported per drive in the stats)",
                flags.join("+")
            );
            let mut b = IoUring::builder();
            let mut flags = vec!["plain"];
            if cfg.sqpoll {
                b.setup_sqpoll(50);
                flags.push("sqpoll");
            }
            if cfg.iopoll {
                b.setup_iopoll();
                flags.push("iopoll");
            }
            b.build(entries).map(|r| (r, flags.join("+")))
        }
        Err(e) => Err(e),
    }
}

struct RingThread {
    ring: IoUring,
    io: Arc<Io>,
    model: Model,
    drive: usize,
    q: Arc<DriveQueue>,
    /// In-flight table: the job of each submitted chunk.
    table: Vec<Option<Job>>,
    generation: Vec<u16>,
    free: Vec<u32>,
    inflight: usize,
    /// Fixed-file slots (direct, buffered) per model file on this drive.
    fixed: Vec<Option<(Option<u32>, u32)>>,
    eventfd_armed: bool,
    eventfd_buf: Box<[u8; 8]>,
    iopoll: bool,
    reaped: Vec<(u64, i32)>,
}

impl RingThread {
    fn new(ring: IoUring, io: Arc<Io>, drive: usize, cfg: RingConfig) -> Self {
        let nfiles = io.model.files().len();
        RingThread {
            ring,
            model: io.model.clone(),
            drive,
            q: Arc::clone(&io.queues[drive]),
            io,
            table: Vec::new(),
            generation: Vec::new(),
            free: Vec::new(),
            inflight: 0,
            fixed: vec![None; nfiles],
            eventfd_armed: false,
            eventfd_buf: Box::new([0; 8]),
            iopoll: cfg.iopoll,
            reaped: Vec::new(),
        }
    }

    /// Registers the O_DIRECT and buffered descriptors of this drive's shards
    /// in a sparse fixed-file table with room for files added later.
    fn register_files(&mut self) -> Result<(), String> {
        let mine: Vec<usize> = (0..self.model.files().len())
            .filter(|&i| self.model.files()[i].drive == self.drive)
            .collect();
        let size = (2 * mine.len() as u32 + 64).next_power_of_two();
        let sub = self.ring.submitter();
        sub.register_files_sparse(size)
            .map_err(|e| format!("register_files_sparse({size}): {e}"))?;
        let mut fds: Vec<RawFd> = Vec::with_capacity(2 * mine.len());
        for &i in &mine {
            let f = &self.model.files()[i];
            fds.push(f.direct.as_ref().map_or(-1, |d| d.as_raw_fd()));
            fds.push(f.buffered.as_raw_fd());
        }
        sub.register_files_update(0, &fds)
            .map_err(|e| format!("register_files_update: {e}"))?;
        for (k, &i) in mine.iter().enumerate() {
            let d = self.model.files()[i].direct.as_ref().map(|_| 2 * k as u32);
            self.fixed[i] = Some((d, 2 * k as u32 + 1));
        }
        Ok(())
    }

    fn sparse_buffers(&mut self) -> Result<(), String> {
        self.ring
            .submitter()
            .register_buffers_sparse(MAX_FIXED_BUFFERS)
            .map_err(|e| format!("register_buffers_sparse: {e}"))
    }

    fn run(mut self) {
        self.arm_eventfd();
        loop {
            let (reads, controls, shutdown) = {
                let mut j = lock(&self.q.jobs);
                (std::mem::take(&mut j.reads), std::mem::take(&mut j.control), j.shutdown)
            };
            for c in controls {
                self.control(c);
            }
            for job in reads {
                self.submit(job);
            }
            if shutdown && self.inflight == 0 && !self.eventfd_armed {
                return;
            }
            match self.ring.submit_and_wait(1) {
                Ok(_) => {}
                Err(e) if matches!(e.raw_os_error(), Some(libc::EINTR | libc::EAGAIN | libc::EBUSY)) => {}
                Err(e) => {
                    // Nothing in flight may be abandoned: the kernel may still
                    // write into those slots. Report, back off, and go on.
                    tracing::error!(drive = %self.model.drives()[self.drive].device, "io_uring_enter: {e}");
                    std::thread::sleep(std::time::Duration::from_millis(10));
                }
            }
            self.reap();
        }
    }

    fn control(&mut self, c: Control) {
        match c {
            Control::RegisterBuffers { first, iovecs, reply } => {
                let iov: Vec<libc::iovec> = iovecs
                    .iter()
                    .map(|&(base, len)| libc::iovec {
                        iov_base: base as *mut libc::c_void,
                        iov_len: len,
                    })
                    .collect();
                // Each iovec is a range of a live arena mapping; the kernel
                // pins those pages for as long as they are registered.
                // SAFETY: a read names these buffers only for a slot of that
                // arena, which it keeps alive until the completion is reaped.
                let r = unsafe { self.ring.submitter().register_buffers_update(first, &iov, None) };
                let _ = reply.send(r);
            }
            Control::UnregisterBuffers { first, n } => {
                let empty = vec![
                    libc::iovec {
                        iov_base: std::ptr::null_mut(),
                        iov_len: 0
                    };
                    n as usize
                ];
                // SAFETY: empty iovecs name no memory; they clear the entries.
                // No read names these entries any more: their arena (and so
                // every slot of it) is gone.
                if let Err(e) = unsafe { self.ring.submitter().register_buffers_update(first, &empty, None) } {
                    tracing::warn!(drive = %self.model.drives()[self.drive].device, "unregistering fixed buffers {first}..{}: {e}", first + n);
                }
            }
        }
    }

    fn arm_eventfd(&mut self) {
        let Some(efd) = self.q.eventfd.as_ref() else {
            return;
        };
        let e = opcode::Read::new(types::Fd(efd.as_raw_fd()), self.eventfd_buf.as_mut_ptr(), 8)
            .build()
            .user_data(EVENTFD_TAG);
        // SAFETY: the 8-byte buffer is owned by this thread's struct, which
        // does not exit while the read is armed (`eventfd_armed`).
        self.push_sqe(&e);
        self.eventfd_armed = true;
    }

    fn push_sqe(&mut self, e: &io_uring::squeue::Entry) {
        loop {
            // SAFETY: every entry built here points at memory that outlives
            // its completion (see the callers).
            if unsafe { self.ring.submission().push(e) }.is_ok() {
                return;
            }
            // The queue is sized above the credits, so this is rare: make room.
            let _ = self.ring.submit();
        }
    }

    fn submit(&mut self, job: Job) {
        if self.iopoll && !job.chunk.direct {
            // A polled ring takes only O_DIRECT I/O: buffered chunks go by
            // pread on this thread.
            return self.pread_now(job);
        }
        let file = &self.model.files()[job.chunk.file as usize];
        let fixed = self.fixed[job.chunk.file as usize].and_then(|(d, b)| if job.chunk.direct { d } else { Some(b) });
        let ptr = (job.target.base + job.chunk.slot_off) as *mut u8;
        macro_rules! read_entry {
            ($fd:expr) => {
                match job.target.buf_index {
                    Some(bi) => opcode::ReadFixed::new($fd, ptr, job.chunk.len, bi)
                        .offset(job.chunk.file_off)
                        .build(),
                    None => opcode::Read::new($fd, ptr, job.chunk.len)
                        .offset(job.chunk.file_off)
                        .build(),
                }
            };
        }
        let e = match fixed {
            Some(slot) => read_entry!(types::Fixed(slot)),
            None => {
                // Fixed files refused at setup: raw descriptors.
                let fd = match (&file.direct, job.chunk.direct) {
                    (Some(d), true) => d.as_raw_fd(),
                    _ => file.buffered.as_raw_fd(),
                };
                read_entry!(types::Fd(fd))
            }
        };
        self.enqueue(job, e);
    }

    fn pread_now(&mut self, mut job: Job) {
        loop {
            let res = crate::pread::pread_chunk(&self.model, &job);
            match settle(job, res, &self.io, self.drive) {
                Some(again) if again.chunk.direct => return self.submit(again),
                Some(again) => job = again,
                None => return,
            }
        }
    }

    fn enqueue(&mut self, job: Job, e: io_uring::squeue::Entry) {
        let idx = match self.free.pop() {
            Some(i) => i,
            None => {
                self.table.push(None);
                self.generation.push(0);
                (self.table.len() - 1) as u32
            }
        };
        let gen = self.generation[idx as usize];
        let ud = idx as u64 | (gen as u64) << 32 | (job.chunk.seq as u64) << 48;
        // SAFETY (for push_sqe): the destination is inside the slot owned by
        // `job.req`; the job (and so the request and its slot) stays in the
        // in-flight table until this entry's completion is reaped.
        self.push_sqe(&e.user_data(ud));
        self.table[idx as usize] = Some(job);
        self.inflight += 1;
        let c = &self.model.drives()[self.drive].counters;
        c.inflight_max
            .fetch_max(self.inflight as u64, std::sync::atomic::Ordering::Relaxed);
    }

    fn reap(&mut self) {
        let mut reaped = std::mem::take(&mut self.reaped);
        reaped.extend(self.ring.completion().map(|c| (c.user_data(), c.result())));
        for &(ud, res) in &reaped {
            if ud == EVENTFD_TAG {
                self.eventfd_armed = false;
                if !lock(&self.q.jobs).shutdown {
                    self.arm_eventfd();
                }
                continue;
            }
            let idx = (ud & 0xffff_ffff) as usize;
            let gen = (ud >> 32) as u16;
            if self.generation.get(idx) != Some(&gen) || self.table[idx].is_none() {
                tracing::error!(user_data = ud, "completion for no in-flight chunk (ignored)");
                continue;
            }
            let job = self.table[idx].take().expect("checked above");
            self.generation[idx] = gen.wrapping_add(1);
            self.free.push(idx as u32);
            self.inflight -= 1;
            if let Some(again) = settle(job, res, &self.io, self.drive) {
                self.submit(again);
            }
        }
        reaped.clear();
        self.reaped = reaped;
    }
}
