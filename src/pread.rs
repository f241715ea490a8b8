//! The pread backend: the same contract and the same tickets without
//! io_uring (seccomp profiles, `kernel.io_uring_disabled`, old kernels). A
//! small pool of threads per drive takes chunks from the drive's queue and
//! `pread`s each straight into its place in the slot.

use std::sync::atomic::Ordering;
use std::thread::JoinHandle;

use crate::numa::ThreadPlacement;
use crate::queue::{settle, Io, Job};
use crate::sync::lock_std as lock;
use crate::Model;
use std::sync::Arc;

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
    let handles = (0..threads.max(1))
        .map(|i| {
            let io = Arc::clone(io);
            let (tx, placement) = (tx.clone(), placement.clone());
            std::thread::Builder::new().name(format!("{name}-{i}")).spawn(move || {
                let _ = tx.send(placement.apply());
                drop(tx);
                worker(&io, drive)
            })
        })
        .collect::<std::io::Result<Vec<_>>>()?;
    drop(tx);
    let bindings: Vec<String> = rx.iter().take(handles.len()).collect();
    let binding = bindings
        .first()
        .cloned()
        .unwrap_or_else(|| "not bound: no worker started".into());
    Ok((handles, binding))
}

fn worker(io: &Io, drive_index: usize) {
    let (model, q) = (&io.model, &*io.queues[drive_index]);
    loop {
        let job = {
            let mut jobs = lock(&q.jobs);
            loop {
                if let Some(j) = jobs.reads.pop_front() {
                    break Some(j);
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
            let res = pread_chunk(model, &job);
            match settle(job, res, io, drive_index) {
                Some(again) => job = again,
                None => break,
            }
        }
        q.active.fetch_sub(1, Ordering::Relaxed);
    }
}

/// One `pread` of a chunk into its slot: bytes read, or `-errno`.
pub(crate) fn pread_chunk(model: &Model, job: &Job) -> i32 {
    let file = &model.files()[job.chunk.file as usize];
    let fd = match (&file.direct, job.chunk.direct) {
        (Some(d), true) => d,
        _ => &file.buffered,
    };
    // The slot is owned by `job.req`, which this job keeps alive, and spans
    // `[base, base + slot_len)`; the chunk lies inside it (planned by
    // `window`/`chunk`).
    // SAFETY: in-bounds (above); no other chunk of the request overlaps it,
    // and the caller cannot reach the slot until the request completes.
    let buf = unsafe {
        std::slice::from_raw_parts_mut(
            (job.target.base + job.chunk.slot_off) as *mut u8,
            job.chunk.len as usize,
        )
    };
    match rustix::io::pread(fd, buf, job.chunk.file_off) {
        Ok(n) => n as i32,
        Err(e) => -e.raw_os_error(),
    }
}
