//! The pread backend: the same contract and the same tickets without
//! io_uring (seccomp profiles, `kernel.io_uring_disabled`, old kernels). A
//! small pool of threads per drive takes chunks from the drive's queue and
//! `pread`s each straight into its place in the slot.

use std::sync::atomic::Ordering;
use std::thread::JoinHandle;

use std::sync::Arc;

use crate::engine::backend::pread_chunk;
use crate::engine::completion::{complete, fail_queued};
use crate::engine::queue::Io;
use crate::engine::sync::lock_std as lock;
use crate::storage::numa::ThreadPlacement;

/// Starts `threads` workers for drive `drive`, each bound by `placement`
/// before it takes work. Returns once every worker has bound itself, with
/// what the first one bound to (they all bind alike).
pub(crate) fn start(
    io: &Arc<Io>,
    drive: usize,
    threads: usize,
    placement: &ThreadPlacement,
) -> std::io::Result<(Vec<JoinHandle<()>>, String)> {
    let name = format!("ws-pread-{}", io.model.drives()[drive].device);
    let (tx, rx) = std::sync::mpsc::channel();
    // The pread backend has one lane per drive, shared by its workers.
    let lane = io.lanes[drive].start;
    let q = &io.queues[lane];
    let mut handles = Vec::new();
    for i in 0..threads.max(1) {
        let io2 = Arc::clone(io);
        let (tx, placement) = (tx.clone(), placement.clone());
        q.workers.fetch_add(1, Ordering::AcqRel);
        let spawned = std::thread::Builder::new().name(format!("{name}-{i}")).spawn(move || {
            let _ = tx.send(placement.apply());
            drop(tx);
            worker(&io2, lane);
        });
        match spawned {
            Ok(h) => handles.push(h),
            Err(e) => {
                q.workers.fetch_sub(1, Ordering::AcqRel);
                // The started workers exit at the engine's stop.
                return Err(e);
            }
        }
    }
    drop(tx);
    let bindings: Vec<String> = rx.iter().take(handles.len()).collect();
    let binding = bindings
        .first()
        .cloned()
        .unwrap_or_else(|| "not bound: no worker started".into());
    Ok((handles, binding))
}

/// Takes chunks until the drive shuts down. A pread is synchronous, so
/// nothing of a chunk is left with the kernel once it returns: a panic
/// while a chunk is in hand fails that chunk's read (the job's drop) and
/// the worker goes on; pread workers are never lost to a panic.
fn worker(io: &Io, lane: usize) {
    let q = &*io.queues[lane];
    loop {
        match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| work(io, lane))) {
            Ok(()) => break,
            Err(payload) => {
                let what = crate::engine::backend::ring::panic_text(&*payload);
                std::mem::forget(payload);
                q.active.fetch_sub(1, Ordering::Relaxed);
                tracing::error!(
                    drive = %io.model.drives()[q.drive].device,
                    "a pread worker panicked ({what}); the chunk in hand failed its read, the worker goes on"
                );
            }
        }
    }
    if q.workers.fetch_sub(1, Ordering::AcqRel) == 1 {
        // The last worker: whatever was queued since (a failover from
        // another drive) has no one to read it.
        let why = "the engine was shut down";
        let queued = io.close_lane(lane, why);
        fail_queued(io, lane, why, queued);
    }
}

fn work(io: &Io, lane: usize) {
    let (model, q) = (&io.model, &*io.queues[lane]);
    loop {
        let job = {
            let mut jobs = lock(&q.jobs);
            loop {
                if q.takes_queued(&jobs) {
                    if let Some(j) = jobs.reads.pop_front() {
                        break Some(j);
                    }
                }
                if jobs.shutdown {
                    break None;
                }
                jobs = match q.ready.wait(jobs) {
                    Ok(g) => g,
                    Err(p) => p.into_inner(),
                };
            }
        };
        let Some(mut job) = job else { return };
        let drive = &model.drives()[model.files()[job.chunk.file as usize].drive];
        let now = q.active.fetch_add(1, Ordering::Relaxed) + 1;
        drive.counters.inflight_max.fetch_max(now as u64, Ordering::Relaxed);
        loop {
            // SAFETY: this worker holds the job, and with it the request
            // that owns the slot, until `complete` settles it; no other
            // chunk of the request overlaps this one (planned by `chunk`).
            let res = unsafe { pread_chunk(model, &job) };
            if q.panic_fault.load(Ordering::Relaxed) && q.panic_fault.swap(false, Ordering::Relaxed) {
                // Test-only (`Engine::inject_fault`), with the chunk in hand.
                panic!("injected fault: pread worker panic on drive {}", drive.device);
            }
            match complete(job, res, io, lane) {
                Some(again) => job = again,
                None => break,
            }
        }
        q.active.fetch_sub(1, Ordering::Relaxed);
    }
}
