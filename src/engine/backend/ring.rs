//! One io_uring per drive, owned by its own thread.
//!
//! The ring is created on its thread (a single-issuer ring accepts
//! submissions only from its creator), registers the drive's shard files as
//! fixed files and arenas as fixed buffers on request, and turns each chunk
//! into one `ReadFixed` (or plain `Read` for a slot of an unregistered
//! arena). A read is kept armed on the drive queue's eventfd, so a caller's
//! notify wakes a thread sleeping in `io_uring_enter` without any spinning;
//! a polled (IOPOLL) ring cannot read an eventfd, so it blocks in a plain
//! `read(2)` of it when nothing is in flight.
//!
//! `user_data` packs (table index: 32 bits, generation: 16 bits, chunk
//! sequence: 16 bits). The in-flight table holds each chunk's job, and with
//! it an `Arc` of its request (which owns the slot), from before its entry
//! is pushed until its completion is reaped.
//!
//! However the thread ends (drained at shutdown, `io_uring_enter` failing
//! past its budget, a panic), the thread's `Drop` decides what the kernel
//! may still own: when anything is in flight, the ring and the eventfd
//! buffer are leaked (never unmapped or freed) and every in-flight job is
//! abandoned (its request fails naming the drive and its slot is leaked,
//! never reused). The drive's queue is closed, so later reads fail over to
//! another copy or fail at once.

use std::collections::VecDeque;
use std::mem::ManuallyDrop;
use std::os::fd::{AsRawFd, RawFd};
use std::sync::mpsc;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use io_uring::{opcode, types, IoUring};

use crate::engine::backend::pread_chunk;
use crate::engine::completion::{complete, fail_over, fail_queued, requeue};
use crate::engine::queue::{Control, DriveQueue, Io, Job};
use crate::engine::sync::lock_std as lock;
use crate::error::Error;
use crate::memory::{Arena, SlotSpec};
use crate::model::Model;
use crate::stats::DriveCounters;
use crate::storage::files::ShardFile;
use crate::storage::numa::ThreadPlacement;

/// Most fixed buffers a ring takes (the kernel's limit).
pub(crate) const MAX_FIXED_BUFFERS: u32 = 1 << 14;
/// Largest single registered buffer.
pub(crate) const MAX_FIXED_BUFFER_BYTES: usize = 1 << 30;

const EVENTFD_TAG: u64 = u64::MAX;
const CANCEL_TAG: u64 = u64::MAX - 1;

/// How long `io_uring_enter` may keep failing, with no completion reaped in
/// between, before the ring is declared broken.
pub(crate) const ENTER_FAILURE_BUDGET: Duration = Duration::from_secs(2);
/// After that, how long the thread keeps trying to reap the chunks the
/// kernel did accept before it abandons them (leaking their slots).
const BROKEN_DRAIN: Duration = Duration::from_secs(10);

/// How to set a ring up.
#[derive(Debug, Clone, Copy)]
pub(crate) struct RingConfig {
    pub depth: u32,
    pub sqpoll: bool,
    pub iopoll: bool,
    /// Every read is flagged `IOSQE_ASYNC` (issued by io-wq workers).
    pub punt: bool,
    /// CPUs the drive's work may use (the io-wq bound when reads are punted).
    pub cpus: u32,
}

/// What a submit probe saw: `k` O_DIRECT reads submitted in one
/// `io_uring_enter` without waiting; how many had completed when that call
/// returned, the time it took, and the time until the last completion.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct SubmitProbe {
    pub k: u32,
    pub bytes: u64,
    /// Completions already posted when the submitting call returned (the
    /// probe's ring runs completion work on the way back to user space, so
    /// a read the device finished inside the call is counted here).
    pub done_at_submit: u32,
    pub submit: Duration,
    pub total: Duration,
    /// Passes measured, and of those the clean ones: the submitting thread
    /// neither slept nor was preempted inside the submitting call. A pass
    /// that was not clean may count completions the device posted while
    /// the thread was off the CPU (a busy machine, a full device queue),
    /// so the reported pass is the clean one with the fewest completions.
    pub passes: u32,
    pub clean: u32,
}

impl SubmitProbe {
    /// No probe read was possible (no O_DIRECT descriptor, an empty file).
    pub(crate) const NONE: SubmitProbe = SubmitProbe {
        k: 0,
        bytes: 0,
        done_at_submit: 0,
        submit: Duration::ZERO,
        total: Duration::ZERO,
        passes: 0,
        clean: 0,
    };
}

/// Decides how a drive's reads are issued from its probe (pure: unit-tested
/// with made-up probes). A drive that completes reads inside the submitting
/// call (zram, brd, pmem, some stacked drivers: the copy runs in
/// `io_uring_enter`) serialises every read on the one ring thread: its
/// reads are punted to io-wq, whose workers run them in parallel. A drive
/// that completes asynchronously (NVMe, virtio, loop) is already parallel
/// in the device: reads stay inline, the cheaper path.
///
/// The test is a count, not a clock: more than half of the reads complete
/// before the submitting call returns, in the clean pass with the fewest
/// (see [`SubmitProbe::clean`]). A device that completes inline does so in
/// every pass; an asynchronous one only looks inline when the submitter
/// was held up inside the call, which a clean pass rules out. (The share of
/// the probe's time spent in that call, reported beside it, says the same
/// on an idle machine but drifts on a busy one.)
pub(crate) fn completes_inline(p: &SubmitProbe) -> (bool, String) {
    let total = p.total.as_secs_f64();
    if p.k == 0 {
        return (false, "inline (no probe read was possible)".into());
    }
    let share = if total > 0.0 {
        (p.submit.as_secs_f64() / total).min(1.0)
    } else {
        0.0
    };
    let gbps = if total > 0.0 { p.bytes as f64 / 1e9 / total } else { 0.0 };
    let passes = if p.passes > 1 {
        if p.clean > 0 {
            format!("; fewest of {} clean passes", p.clean)
        } else {
            format!(
                "; fewest of {} passes, none clean: the submitter slept or was preempted in each",
                p.passes
            )
        }
    } else {
        String::new()
    };
    let seen = format!(
        "{} reads of {} KiB: {} done when the submitting call returned, which took {:.0}% of {:.2} ms ({gbps:.2} GB/s){passes}",
        p.k,
        p.bytes / p.k as u64 / 1024,
        p.done_at_submit,
        share * 100.0,
        total * 1e3
    );
    if 2 * p.done_at_submit > p.k {
        (true, format!("the device completes reads inline ({seen})"))
    } else {
        (false, format!("the device completes reads asynchronously ({seen})"))
    }
}

/// Submits a few O_DIRECT reads of `file` in one call (no wait) on a ring of
/// its own, and times that call against the last completion, several times
/// over the same ranges. The first pass is not measured (it flushes pages
/// still dirty from a recent write, which would send any read to io-wq, and
/// warms the path). Of the measured passes, up to [`PROBE_PASSES`], the
/// clean one (no context switch of the submitter inside the call) with the
/// fewest completions is returned; the passes stop after
/// [`PROBE_CLEAN_PASSES`] clean ones.
pub(crate) fn probe_submit(file: &ShardFile) -> std::io::Result<SubmitProbe> {
    const K: u32 = 8;
    const READ: u64 = 64 << 10;
    let Some(direct) = file.direct.as_ref() else {
        return Ok(SubmitProbe::NONE);
    };
    let align = (file.topo.dio_offset_align.max(file.topo.dio_mem_align) as u64).max(4096);
    let stride = file.size / K as u64 / align * align;
    let len = READ.min(stride);
    if len == 0 {
        return Ok(SubmitProbe::NONE);
    }
    let spec = SlotSpec::new(len as usize).with_align(align as usize);
    let arena = Arena::new(spec, K as usize).map_err(std::io::Error::other)?;
    let mut slots: Vec<_> = (0..K).filter_map(|_| arena.take().ok()).collect();
    let mut ring = IoUring::new(2 * K)?;
    // The pass kept so far, and whether it was clean.
    let mut probe: Option<(SubmitProbe, bool)> = None;
    let (mut passes, mut clean) = (0, 0);
    for pass in 0..=PROBE_PASSES {
        for (k, slot) in slots.iter_mut().enumerate() {
            let e = opcode::Read::new(
                types::Fd(direct.as_raw_fd()),
                slot.as_bytes_mut().as_mut_ptr(),
                len as u32,
            )
            .offset(k as u64 * stride)
            .build();
            // SAFETY: each entry reads into its own slot of `arena`; both
            // live until every completion is reaped below, or are leaked
            // when the ring cannot be entered.
            unsafe { ring.submission().push(&e) }.expect("the ring holds 2K entries");
        }
        let switches_before = thread_context_switches();
        let t0 = Instant::now();
        let submitted = ring.submit();
        let t_submit = t0.elapsed();
        let done_at_submit = ring.completion().len() as u32;
        let switches_after = thread_context_switches();
        // Unknown counts (getrusage failed) are taken as clean: the pass
        // is then judged as before there was a check.
        let was_clean = match (switches_before, switches_after) {
            (Some(a), Some(b)) => a == b,
            _ => true,
        };
        let mut left = K as usize;
        let mut failed = submitted.err();
        let mut tries = 0;
        while left > 0 {
            match ring.submit_and_wait(1) {
                Ok(_) => {}
                Err(e)
                    if matches!(e.raw_os_error(), Some(libc::EINTR | libc::EAGAIN | libc::EBUSY)) && tries < 10_000 =>
                {
                    tries += 1;
                }
                Err(e) => {
                    // The kernel may still write into the probe's slots.
                    std::mem::forget(slots);
                    std::mem::forget(arena);
                    std::mem::forget(ring);
                    return Err(e);
                }
            }
            for c in ring.completion() {
                left -= 1;
                if c.result() < 0 && failed.is_none() {
                    failed = Some(std::io::Error::from_raw_os_error(-c.result()));
                }
            }
        }
        if let Some(e) = failed {
            return Err(e);
        }
        if pass == 0 {
            continue;
        }
        let this = SubmitProbe {
            k: K,
            bytes: K as u64 * len,
            done_at_submit,
            submit: t_submit,
            total: t0.elapsed(),
            passes: 0,
            clean: 0,
        };
        passes += 1;
        clean += was_clean as u32;
        probe = Some(match probe {
            Some(kept) if !replaces(kept, (this, was_clean)) => kept,
            _ => (this, was_clean),
        });
        if clean >= PROBE_CLEAN_PASSES {
            break;
        }
    }
    Ok(probe.map_or(SubmitProbe::NONE, |(p, _)| SubmitProbe { passes, clean, ..p }))
}

/// Whether probe pass `this` (with whether it was clean) is kept instead of
/// `kept`: a clean pass beats an unclean one, and among equals the one
/// with fewer completions at submit wins (an asynchronous device can only
/// look inline by accident; an inline one looks inline every time).
fn replaces(kept: (SubmitProbe, bool), this: (SubmitProbe, bool)) -> bool {
    (this.1 && !kept.1) || (this.1 == kept.1 && this.0.done_at_submit < kept.0.done_at_submit)
}

/// Most measured passes of the submit probe.
const PROBE_PASSES: u32 = 6;
/// Clean passes after which the probe stops.
const PROBE_CLEAN_PASSES: u32 = 3;

/// The calling thread's context switches so far, voluntary and not
/// (`getrusage(RUSAGE_THREAD)`), or None when the call fails.
fn thread_context_switches() -> Option<u64> {
    let mut u = std::mem::MaybeUninit::<libc::rusage>::zeroed();
    // SAFETY: getrusage writes one `rusage` into the pointer it is given,
    // which points at a zeroed `rusage` that lives across the call.
    let rc = unsafe { libc::getrusage(libc::RUSAGE_THREAD, u.as_mut_ptr()) };
    if rc != 0 {
        return None;
    }
    // SAFETY: the call succeeded, so it filled the struct (which was
    // zeroed before, so every field is initialised either way).
    let u = unsafe { u.assume_init() };
    Some(u.ru_nvcsw as u64 + u.ru_nivcsw as u64)
}

/// What setup achieved, reported back to the engine.
#[derive(Debug, Clone)]
pub(crate) struct RingSetup {
    pub flags: String,
    pub fixed_files: Result<(), String>,
    pub fixed_buffers: Result<(), String>,
    /// What the ring thread bound itself to (see `numa::bind_thread_described`).
    pub binding: String,
    /// io-wq's bounded-worker limit, when the ring's reads are punted.
    pub iowq_workers: Option<u32>,
}

/// Why a ring could not be started.
#[derive(Debug)]
pub(crate) enum StartError {
    /// `io_uring_setup` refused (the pread backend may take over).
    Setup(std::io::Error),
    /// The thread could not be created (RLIMIT_NPROC, memory): no backend
    /// can run without threads.
    Spawn(std::io::Error),
}

/// Starts the ring thread of lane `lane` (of drive `io.queues[lane].drive`).
/// Returns after the ring exists (or failed to be created).
pub(crate) fn start(
    io: &Arc<Io>,
    lane: usize,
    cfg: RingConfig,
    placement: ThreadPlacement,
) -> Result<(JoinHandle<()>, RingSetup), StartError> {
    let (tx, rx) = mpsc::channel();
    let model = &io.model;
    let drive = io.queues[lane].drive;
    let k = lane - io.lanes[drive].start;
    let io2 = Arc::clone(io);
    let handle = std::thread::Builder::new()
        .name(if k == 0 {
            format!("ws-ring-{}", model.drives()[drive].device)
        } else {
            format!("ws-ring-{}-{k}", model.drives()[drive].device)
        })
        .spawn(move || {
            // Bound before the ring exists, so its memory and any kernel
            // worker it spawns start on the drive's node.
            let binding = placement.apply();
            let (ring, flags) = match build(cfg) {
                Ok(r) => r,
                Err(e) => {
                    let _ = tx.send(Err(e));
                    return;
                }
            };
            let mut t = RingThread::new(ring, io2, lane, cfg);
            let setup = RingSetup {
                flags,
                fixed_files: t.register_files(),
                fixed_buffers: t.sparse_buffers(),
                binding,
                iowq_workers: t.bound_iowq(cfg),
            };
            let _ = tx.send(Ok(setup));
            match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| t.run())) {
                Ok(()) => {}
                Err(payload) => {
                    let what = panic_text(&*payload);
                    // Its drop could panic again; leaking it is the safe choice.
                    std::mem::forget(payload);
                    t.exit_reason = Some(format!("its I/O thread panicked ({what})"));
                }
            }
            // `t` drops here: see `impl Drop for RingThread`.
        })
        .map_err(StartError::Spawn)?;
    match rx.recv() {
        Ok(Ok(setup)) => Ok((handle, setup)),
        Ok(Err(e)) => {
            let _ = handle.join();
            Err(StartError::Setup(e))
        }
        Err(_) => {
            let _ = handle.join();
            Err(StartError::Setup(std::io::Error::other(
                "ring thread exited during setup",
            )))
        }
    }
}

pub(crate) fn panic_text(payload: &(dyn std::any::Any + Send)) -> String {
    payload
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a non-string panic payload".into())
}

/// The first flag of a ring set up plain, the kernel having refused the
/// flags that suit one submitter (its description starts with it).
pub(crate) const PLAIN: &str = "plain";

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
            let mut flags = vec![PLAIN];
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

/// How the ring thread is woken when a caller queues work.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Wake {
    /// A read is kept armed on the eventfd inside the ring.
    Armed,
    /// The thread blocks in `read(2)` of the eventfd while nothing is in
    /// flight (a polled ring cannot read an eventfd, or the armed read
    /// failed).
    Blocking,
}

struct RingThread {
    /// Leaked, not dropped, when the thread ends with anything in flight.
    ring: ManuallyDrop<IoUring>,
    io: Arc<Io>,
    model: Model,
    /// This ring's lane (index into `io.queues`) and its drive.
    lane: usize,
    drive: usize,
    q: Arc<DriveQueue>,
    /// In-flight table: the job of each chunk pushed to the ring.
    table: Vec<Option<Job>>,
    generation: Vec<u16>,
    free: Vec<u32>,
    inflight: usize,
    /// Fixed-file slots (direct, buffered) per model file on this drive.
    fixed: Vec<Option<(Option<u32>, u32)>>,
    eventfd_armed: bool,
    /// The armed eventfd read's buffer: leaked with the ring if it is armed.
    eventfd_buf: ManuallyDrop<Box<[u8; 8]>>,
    wake: Wake,
    /// A cancel of everything in flight was pushed and has not completed.
    cancel_armed: bool,
    iopoll: bool,
    sqpoll: bool,
    /// Every read is flagged `IOSQE_ASYNC` (see `completes_inline`).
    punt: bool,
    reaped: Vec<(u64, i32)>,
    /// `user_data` of entries pushed but maybe not yet consumed by the
    /// kernel, oldest first (trimmed to the submission queue's length after
    /// every enter): when the ring breaks, these never reached the kernel.
    unconsumed: VecDeque<u64>,
    /// Since when `io_uring_enter` has failed with no completion reaped.
    failing_since: Option<Instant>,
    /// Set when the ring can no longer be entered: why.
    broken: Option<String>,
    /// Why the thread ended abnormally (the queue is closed with it).
    exit_reason: Option<String>,
}

impl RingThread {
    fn new(ring: IoUring, io: Arc<Io>, lane: usize, cfg: RingConfig) -> Self {
        let nfiles = io.model.files().len();
        RingThread {
            ring: ManuallyDrop::new(ring),
            model: io.model.clone(),
            lane,
            drive: io.queues[lane].drive,
            q: Arc::clone(&io.queues[lane]),
            io,
            table: Vec::new(),
            generation: Vec::new(),
            free: Vec::new(),
            inflight: 0,
            fixed: vec![None; nfiles],
            eventfd_armed: false,
            eventfd_buf: ManuallyDrop::new(Box::new([0; 8])),
            wake: if cfg.iopoll { Wake::Blocking } else { Wake::Armed },
            cancel_armed: false,
            iopoll: cfg.iopoll,
            sqpoll: cfg.sqpoll,
            punt: cfg.punt,
            reaped: Vec::new(),
            unconsumed: VecDeque::new(),
            failing_since: None,
            broken: None,
            exit_reason: None,
        }
    }

    fn device(&self) -> &str {
        &self.model.drives()[self.drive].device
    }

    /// Registers the O_DIRECT and buffered descriptors of this drive's shards
    /// as fixed files: a table of exactly the entries needed (the kernel
    /// refuses one larger than RLIMIT_NOFILE).
    fn register_files(&mut self) -> Result<(), String> {
        let mine: Vec<usize> = (0..self.model.files().len())
            .filter(|&i| self.model.files()[i].drive == self.drive)
            .collect();
        let size = 2 * mine.len() as u32;
        let sub = self.ring.submitter();
        sub.register_files_sparse(size).map_err(|e| {
            if e.raw_os_error() == Some(libc::EMFILE) {
                let l = rustix::process::getrlimit(rustix::process::Resource::Nofile);
                format!(
                    "register_files_sparse({size}): {e}: a fixed-file table of {size} entries exceeds RLIMIT_NOFILE (soft {}, hard {}); raise `ulimit -n`",
                    l.current.map_or("unlimited".into(), |v| v.to_string()),
                    l.maximum.map_or("unlimited".into(), |v| v.to_string())
                )
            } else {
                format!("register_files_sparse({size}): {e}")
            }
        })?;
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

    fn run(&mut self) {
        if self.wake == Wake::Armed {
            self.arm_eventfd();
        }
        let mut reads = Vec::new();
        loop {
            // At most the lane's depth in flight: the rest stays queued until
            // completions make room (producers never wait for it).
            let budget = self.q.depth.saturating_sub(self.inflight);
            let (controls, shutdown, left) = {
                let mut j = lock(&self.q.jobs);
                // A held lane (test-only) takes nothing and, having nothing
                // it may take, sleeps as an idle one does.
                let takes = self.q.takes_queued(&j);
                let n = if takes { budget.min(j.reads.len()) } else { 0 };
                reads.extend(j.reads.drain(..n));
                let left = if takes { j.reads.len() } else { 0 };
                (std::mem::take(&mut j.control), j.shutdown, left)
            };
            for c in controls {
                self.control(c);
            }
            for job in reads.drain(..) {
                self.submit(job);
            }
            if self.q.panic_fault.load(std::sync::atomic::Ordering::Relaxed)
                && self.q.panic_fault.swap(false, std::sync::atomic::Ordering::Relaxed)
            {
                // Test-only (`Engine::inject_fault`): dies with chunks in flight.
                panic!("injected fault: I/O thread panic on drive {}", self.device());
            }
            if shutdown && left == 0 && self.inflight == 0 && !self.eventfd_armed && !self.cancel_armed {
                return;
            }
            if self.wake == Wake::Blocking && self.inflight == 0 && left == 0 && !self.cancel_armed && !shutdown {
                self.block_on_eventfd();
                continue;
            }
            self.q
                .in_kernel
                .store(self.inflight, std::sync::atomic::Ordering::Relaxed);
            if let Some(why) = self.enter() {
                return self.break_down(why);
            }
            self.reap();
        }
    }

    /// One `io_uring_enter` (submit and wait for a completion). Failures are
    /// retried with a backoff; past the budget with no completion reaped in
    /// between, returns why the ring is broken.
    fn enter(&mut self) -> Option<String> {
        let fault = self.q.enter_fault.load(std::sync::atomic::Ordering::Relaxed);
        let r = if fault != 0 {
            Err(std::io::Error::from_raw_os_error(fault))
        } else {
            self.ring.submit_and_wait(1)
        };
        if !self.sqpoll {
            let left = self.ring.submission().len();
            while self.unconsumed.len() > left {
                self.unconsumed.pop_front();
            }
        }
        match r {
            Ok(_) => {
                self.failing_since = None;
                None
            }
            Err(e) => {
                let errno = e.raw_os_error().unwrap_or(0);
                if self.failing_since.is_none() && errno != libc::EINTR {
                    tracing::warn!(drive = %self.device(), "io_uring_enter: {e}; retrying (the ring is declared broken after {ENTER_FAILURE_BUDGET:?} of failures with no completion)");
                }
                let failing = self.failing_since.get_or_insert_with(Instant::now).elapsed();
                if failing >= ENTER_FAILURE_BUDGET {
                    return Some(format!(
                        "io_uring_enter kept failing for {:.1} s ({e})",
                        failing.as_secs_f64()
                    ));
                }
                if errno != libc::EINTR {
                    let step = if matches!(errno, libc::EAGAIN | libc::EBUSY) {
                        1
                    } else {
                        10
                    };
                    std::thread::sleep(Duration::from_millis(step));
                }
                None
            }
        }
    }

    /// The ring cannot be entered any more: the drive takes no more work;
    /// what never reached the kernel fails over (or fails); what it did
    /// accept is waited for a while, then abandoned by `Drop`.
    fn break_down(&mut self, why: String) {
        tracing::error!(drive = %self.device(), "{why}: this drive's ring is broken; its reads fail over to other copies or fail (logged once)");
        let why = format!("its ring is broken: {why}");
        self.broken = Some(why.clone());
        let queued = self.io.close_lane(self.lane, &why);
        fail_queued(&self.io, self.lane, &why, queued);
        // Entries the kernel never consumed: no enter will ever submit them
        // now (a SQPOLL ring's poller might, so there they stay in flight).
        if !self.sqpoll {
            let never: Vec<u64> = self.unconsumed.drain(..).collect();
            for ud in never {
                if ud == EVENTFD_TAG {
                    self.eventfd_armed = false;
                    continue;
                }
                if ud == CANCEL_TAG {
                    self.cancel_armed = false;
                    continue;
                }
                if let Some(job) = self.take_entry(ud) {
                    self.give_up(job, format!("drive {}: never submitted: {why}", self.device()));
                }
            }
        }
        // What the kernel accepted may still complete: keep reaping.
        let deadline = Instant::now() + BROKEN_DRAIN;
        let mut pause = Duration::from_millis(1);
        while self.inflight > 0 && Instant::now() < deadline {
            let _ = self.ring.submit_and_wait(1);
            let before = self.inflight;
            self.reap();
            if self.inflight == before {
                std::thread::sleep(pause);
                pause = (pause * 2).min(Duration::from_millis(100));
            }
        }
        self.exit_reason = Some(why);
    }

    /// A job that cannot go on on this drive: another copy, or an error.
    fn give_up(&mut self, job: Job, why: String) {
        if let Some(again) = fail_over(job, why.clone(), &self.io, self.lane) {
            requeue(&self.io, again, &why);
        }
    }

    /// No read can be armed on the eventfd: sleep in `read(2)` of it until a
    /// caller notifies (only while nothing is in flight).
    fn block_on_eventfd(&mut self) {
        let Some(efd) = self.q.eventfd.as_ref() else {
            return;
        };
        let mut buf = [0u8; 8];
        match rustix::io::read(efd, &mut buf) {
            Ok(_) | Err(rustix::io::Errno::INTR) => {}
            Err(e) => {
                tracing::error!(drive = %self.device(), "read(eventfd): {e}");
                std::thread::sleep(Duration::from_millis(10));
            }
        }
    }

    fn control(&mut self, c: Control) {
        match c {
            Control::RegisterBuffers { first, iovecs, reply } => {
                let iov: Vec<libc::iovec> = iovecs
                    .iter()
                    .map(|r| libc::iovec {
                        iov_base: r.as_ptr().cast(),
                        iov_len: r.len(),
                    })
                    .collect();
                // SAFETY: each iovec is a range of a live arena mapping; the
                // kernel pins those pages while they are registered, and a
                // read names these buffers only for a slot of that arena,
                // which its request keeps alive until the completion is reaped.
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
                    tracing::warn!(drive = %self.device(), "unregistering fixed buffers {first}..{}: {e}", first + n);
                }
            }
            Control::CancelAll => {
                // A polled ring takes only polled reads (they complete soon
                // anyway): nothing to cancel there.
                if !self.cancel_armed && !self.iopoll {
                    let e = opcode::AsyncCancel2::new(types::CancelBuilder::any())
                        .build()
                        .user_data(CANCEL_TAG);
                    // SAFETY: a cancel names no memory.
                    unsafe { self.push_sqe(&e) };
                    self.cancel_armed = true;
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
        self.eventfd_armed = true;
        // SAFETY: the 8-byte buffer is owned by this thread's struct, and is
        // leaked with the ring rather than freed while the read is armed
        // (`eventfd_armed`; see `Drop`).
        unsafe { self.push_sqe(&e) };
    }

    /// Pushes one entry, making room by submitting when the queue is full.
    ///
    /// # Safety
    /// Every buffer `e` names must stay valid and unaliased until its
    /// completion is reaped or the ring is leaked.
    unsafe fn push_sqe(&mut self, e: &io_uring::squeue::Entry) {
        loop {
            // SAFETY: the caller's obligation (above).
            if unsafe { self.ring.submission().push(e) }.is_ok() {
                if !self.sqpoll {
                    self.unconsumed.push_back(e.get_user_data());
                }
                return;
            }
            // The queue is sized above the lane's depth, so this is rare: make room.
            let _ = self.ring.submit();
            let left = self.ring.submission().len();
            while self.unconsumed.len() > left {
                self.unconsumed.pop_front();
            }
        }
    }

    fn submit(&mut self, job: Job) {
        if self.broken.is_some() {
            let why = self.broken.clone().unwrap_or_default();
            return self.give_up(job, why);
        }
        if self.iopoll && !job.chunk.direct {
            // A polled ring takes only O_DIRECT I/O: buffered chunks go by
            // pread on this thread.
            return self.pread_now(job);
        }
        let file = &self.model.files()[job.chunk.file as usize];
        let fixed = self.fixed[job.chunk.file as usize].and_then(|(d, b)| if job.chunk.direct { d } else { Some(b) });
        let ptr = job.target.chunk_ptr(&job.chunk).as_ptr();
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
        let e = if self.punt {
            e.flags(io_uring::squeue::Flags::ASYNC)
        } else {
            e
        };
        self.enqueue(job, e);
    }

    /// Bounds io-wq's workers when this ring's reads are punted.
    fn bound_iowq(&mut self, cfg: RingConfig) -> Option<u32> {
        if !cfg.punt {
            return None;
        }
        // Bounded work (regular files, block devices): one worker per CPU
        // the drive may use; more only contend for the same cores.
        let n = cfg.cpus.max(1);
        let mut limits = [n, 0];
        match self.ring.submitter().register_iowq_max_workers(&mut limits) {
            Ok(()) => Some(n),
            Err(e) => {
                tracing::warn!(drive = %self.device(), "io-wq worker limit not set ({e}); the kernel's default applies");
                None
            }
        }
    }

    fn pread_now(&mut self, mut job: Job) {
        loop {
            // SAFETY: this thread holds the job (and the request owning its
            // slot) until `complete` settles it; no other chunk of the
            // request overlaps this one.
            let res = unsafe { pread_chunk(&self.model, &job) };
            match complete(job, res, &self.io, self.lane) {
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
        // Into the table before the entry exists: from here on, however the
        // thread ends, the job is abandoned (its slot leaked), never freed.
        self.table[idx as usize] = Some(job);
        self.inflight += 1;
        // SAFETY: the destination is inside the slot owned by the job's
        // request (planned by `window`/`chunk`, checked against the slot's
        // length); the job stays in the in-flight table until this entry's
        // completion is reaped, or is abandoned with its slot leaked.
        unsafe { self.push_sqe(&e.user_data(ud)) };
        let c = &self.model.drives()[self.drive].counters;
        c.inflight_max
            .fetch_max(self.inflight as u64, std::sync::atomic::Ordering::Relaxed);
    }

    /// Removes the in-flight entry `ud` names, if it is live.
    fn take_entry(&mut self, ud: u64) -> Option<Job> {
        let idx = (ud & 0xffff_ffff) as usize;
        let gen = (ud >> 32) as u16;
        if self.generation.get(idx) != Some(&gen) || self.table[idx].is_none() {
            return None;
        }
        let job = self.table[idx].take();
        self.generation[idx] = gen.wrapping_add(1);
        self.free.push(idx as u32);
        self.inflight -= 1;
        job
    }

    fn reap(&mut self) {
        let mut reaped = std::mem::take(&mut self.reaped);
        reaped.extend(self.ring.completion().map(|c| (c.user_data(), c.result())));
        if !reaped.is_empty() {
            self.failing_since = None;
        }
        for &(ud, res) in &reaped {
            if ud == EVENTFD_TAG {
                self.eventfd_armed = false;
                if res < 0 && res != -libc::ECANCELED {
                    // Not re-armed blindly: an armed read that fails at once
                    // would spin this thread. Sleep in read(2) instead.
                    tracing::warn!(
                        drive = %self.device(),
                        "the ring's wake-up read failed ({}); the thread now sleeps in read(2) while idle",
                        std::io::Error::from_raw_os_error(-res)
                    );
                    self.wake = Wake::Blocking;
                } else if self.broken.is_none() && !lock(&self.q.jobs).shutdown {
                    self.arm_eventfd();
                }
                continue;
            }
            if ud == CANCEL_TAG {
                self.cancel_armed = false;
                if res < 0 && !matches!(-res, libc::ENOENT | libc::EALREADY) {
                    tracing::warn!(drive = %self.device(), "cancelling in-flight reads: {}", std::io::Error::from_raw_os_error(-res));
                }
                continue;
            }
            let Some(job) = self.take_entry(ud) else {
                tracing::error!(user_data = ud, res, "completion for no in-flight chunk (ignored)");
                continue;
            };
            if let Some(again) = complete(job, res, &self.io, self.lane) {
                self.submit(again);
            }
        }
        reaped.clear();
        self.reaped = reaped;
    }
}

impl Drop for RingThread {
    fn drop(&mut self) {
        let why = self
            .exit_reason
            .take()
            .unwrap_or_else(|| "the engine was shut down".to_string());
        // No more work: later pushes are refused, queued jobs fail over.
        let queued = self.io.close_lane(self.lane, &why);
        fail_queued(&self.io, self.lane, &why, queued);
        let kernel_owns = self.inflight > 0 || self.eventfd_armed || self.cancel_armed;
        if !kernel_owns {
            // SAFETY: nothing is in flight (every pushed entry's completion
            // was reaped), so the kernel writes into none of our memory;
            // neither field is used again.
            unsafe {
                ManuallyDrop::drop(&mut self.ring);
                ManuallyDrop::drop(&mut self.eventfd_buf);
            }
            return;
        }
        // The kernel may still write into slots of in-flight chunks and into
        // the eventfd buffer: the ring (and so the mappings and pins the
        // kernel holds) and the buffer are leaked, and every in-flight job
        // is abandoned: its request fails, its slot is never reused.
        let device = self.device().to_string();
        let jobs: Vec<Job> = self.table.iter_mut().filter_map(Option::take).collect();
        let n = jobs.len();
        self.inflight = 0;
        // Counted before the tickets hear of it.
        DriveCounters::add(&self.model.drives()[self.drive].counters.chunks_abandoned, n as u64);
        for job in jobs {
            job.abandon(Error::DriveStopped {
                device: device.clone(),
                reason: format!(
                    "{why}; this read's chunk was still in the kernel, so its slot is leaked (never reused)"
                ),
            });
        }
        tracing::error!(
            drive = %device,
            "{why}: {n} chunk(s) were still in the kernel; their slots and the ring are leaked, never reused; their reads fail"
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn probe(done: u32, submit_us: u64, total_us: u64) -> SubmitProbe {
        SubmitProbe {
            k: 8,
            bytes: 8 << 16,
            done_at_submit: done,
            submit: Duration::from_micros(submit_us),
            total: Duration::from_micros(total_us),
            passes: 1,
            clean: 1,
        }
    }

    #[test]
    fn a_drive_that_completes_in_the_submitter_is_inline() {
        // zram: the copy runs inside io_uring_enter; every read is done
        // when the call returns.
        let (inline, why) = completes_inline(&probe(8, 180, 190));
        assert!(inline, "{why}");
        assert!(
            why.contains("completes reads inline") && why.contains("8 done") && why.contains("95%"),
            "{why}"
        );
    }

    #[test]
    fn a_drive_that_completes_asynchronously_is_not() {
        // NVMe, virtio, loop: the call returns at once, the device works on.
        let (inline, why) = completes_inline(&probe(0, 20, 400));
        assert!(!inline, "{why}");
        assert!(why.contains("asynchronously") && why.contains("5%"), "{why}");
    }

    #[test]
    fn the_clean_pass_with_fewest_completions_is_kept() {
        // CI, a busy virtio disk: the submitter was held up in one pass and
        // every read had completed by the time it got the CPU back.
        let held_up = (probe(8, 900, 910), false);
        let clean = (probe(0, 50, 500), true);
        assert!(replaces(held_up, clean));
        assert!(!replaces(clean, held_up));
        // Among clean passes (or among unclean ones), fewer completions win.
        assert!(replaces((probe(3, 50, 500), true), clean));
        assert!(!replaces(clean, (probe(3, 50, 500), true)));
        assert!(replaces(held_up, (probe(2, 50, 500), false)));
        // zram: every pass is inline, so the kept pass is too.
        let inline = (probe(8, 180, 190), true);
        assert!(!replaces(inline, (probe(8, 170, 180), true)));
        assert!(completes_inline(&inline.0).0);
    }

    #[test]
    fn the_count_decides_not_the_clock() {
        assert!(!completes_inline(&probe(4, 100, 100)).0, "exactly half is not inline");
        assert!(completes_inline(&probe(5, 10, 100)).0);
        // A busy machine: the call took most of the probe, but the device
        // completed nothing in it (memloop under load).
        assert!(!completes_inline(&probe(0, 90, 100)).0);
        // A zero clock still decides by the count.
        assert!(completes_inline(&probe(8, 0, 0)).0);
        assert!(!completes_inline(&SubmitProbe::NONE).0);
    }
}
