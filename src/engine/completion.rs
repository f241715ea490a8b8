//! The completion and failover policy, the same for every backend: what a
//! chunk's result means (done, again, a buffered re-issue counted by cause,
//! or this copy failed), moving a chunk to the next copy of its shard when
//! a copy fails, and failing the read only when every copy has.

use std::sync::atomic::Ordering;

use crate::engine::queue::{Control, Io, Job};
use crate::error::{escape, Error};
use crate::model::Model;
use crate::plan::chunk::{on_result, payload_bytes, Chunk, Next};
use crate::stats::DriveCounters;
use crate::storage::files::{drop_pages, ShardFile};

/// Fails over (or fails) jobs taken from a closed drive's queue: none of
/// them reached the kernel. Control requests waiting for a reply get one.
pub(crate) fn fail_queued(io: &Io, lane: usize, why: &str, queued: (Vec<Job>, Vec<Control>)) {
    let (reads, controls) = queued;
    for job in reads {
        if let Some(again) = fail_over(job, why.to_string(), io, lane) {
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

/// Applies a chunk's result (the completion policy): counts it, and either finishes the chunk
/// (returning its credit and completing the request when it was the last),
/// returns the job to issue again on this drive (a remainder, a retry, or a
/// buffered re-issue after an O_DIRECT failure, counted by cause), or moves
/// it to the next copy of its shard when this copy failed (failover, counted
/// per drive and warned once per copy). The request fails only when every
/// copy has failed, with each copy and its cause in the error.
pub(crate) fn complete(mut job: Job, res: i32, io: &Io, lane: usize) -> Option<Job> {
    /// EINTR/EAGAIN retries of one chunk before giving up on this copy.
    const MAX_RETRIES: u8 = 64;

    let model = &io.model;
    let drive_index = io.queues[lane].drive;
    let file = &model.files()[job.chunk.file as usize];
    let drive = &model.drives()[file.drive];
    let c = &drive.counters;
    // Counts the payload bytes of `landed` (a chunk, or the prefix of one
    // that a short read delivered) and drops buffered pages.
    let count = |landed: &Chunk| {
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
            drop_pages(&file.buffered, landed.file_off, landed.len as u64);
        }
        io.loads[drive_index].done(landed.len as u64, true);
    };
    let prefix = |next: &Chunk| Chunk {
        len: job.chunk.len - next.len,
        ..job.chunk
    };
    let failure = match on_result(&job.chunk, res, file.topo.dio_offset_align) {
        Next::Done => {
            count(&job.chunk);
            DriveCounters::add(&c.chunks, 1);
            return finish(job, None);
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
    fail_over(job, failure, io, lane)
}

/// This copy failed for `job` (`why`): the chunk moves to the next copy of
/// its shard that has not failed yet and whose drive still runs (after this
/// one, wrapping to the primary; counted per drive as a failover and warned
/// once per copy), or, when none is left, the request fails with every copy
/// and its cause. After `Engine::shutdown` cancelled the reads, a failure is
/// final. Returns the job when it is to be issued again on this drive.
pub(crate) fn fail_over(mut job: Job, why: String, io: &Io, lane: usize) -> Option<Job> {
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
        warn_failover_once(file, &drive.device, to, &job);
        // Kept for the warnings (the log line reaches only a subscriber).
        drive.counters.first_failover.get_or_init(|| {
            format!(
                "{}: {}; read again from {}",
                escape(&file.path),
                job.failures.last().map_or("", |f| f.1.as_str()),
                escape(&to.path)
            )
        });
        job.chunk.file = next as u32;
        job.chunk.direct = job.chunk.direct && can_direct(to, &job);
        job.retries = 0;
        if to.drive == drive_index {
            io.loads[to.drive].add(job.chunk.len as u64);
            return Some(job);
        }
        // Another drive: queued on one of its lanes.
        let target = &io.queues[io.pick_lane(to.drive)];
        let len = job.chunk.len as u64;
        io.loads[to.drive].add(len);
        match target.push(job) {
            Ok(()) => {
                target.notify();
                return None;
            }
            Err(back) => {
                // Closed between the check and the push.
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
    let err = read_failed(&job, model, copies.len(), cancelled);
    finish(job, Some(err))
}

/// The first failover from `file` is logged (then only counted).
fn warn_failover_once(file: &ShardFile, device: &str, to: &ShardFile, job: &Job) {
    if !file.failover_warned.swap(true, Ordering::Relaxed) {
        tracing::warn!(
            drive = %device,
            "{}: read failed ({}); retrying on {} (warned once per copy; counted per drive as failovers)",
            file.path.display(),
            job.failures.last().map_or("", |f| f.1.as_str()),
            to.path.display()
        );
    }
}

/// The error of a chunk no copy could read: the tensor, the byte range,
/// and every copy tried with its cause.
fn read_failed(job: &Job, model: &Model, copies: usize, cancelled: bool) -> Error {
    let causes: Vec<String> = job
        .failures
        .iter()
        .map(|(f, why)| format!("{}: {why}", escape(&model.files()[*f as usize].path)))
        .collect();
    let mut causes = causes.join("; ");
    if cancelled {
        causes.push_str(" (cancelled by Engine::shutdown)");
    }
    Error::ReadFailed {
        tensor: model
            .catalog()
            .tensors()
            .get(job.tensor as usize)
            .map_or_else(|| "?".to_string(), |t| t.name.clone()),
        start: job.chunk.file_off,
        end: job.chunk.file_off + job.chunk.len as u64,
        copies,
        causes,
    }
}
/// Whether `job`'s chunk may go O_DIRECT on copy `f`: it has an O_DIRECT
/// descriptor and the chunk's offset, length and memory meet its alignment.
pub(crate) fn can_direct(f: &ShardFile, job: &Job) -> bool {
    let (oa, ma) = (f.topo.dio_offset_align as u64, f.topo.dio_mem_align as usize);
    f.direct.is_some()
        && job.chunk.file_off.is_multiple_of(oa)
        && (job.chunk.len as u64).is_multiple_of(oa)
        && (job.target.addr() + job.chunk.slot_off).is_multiple_of(ma)
}

fn finish(job: Job, err: Option<Error>) -> Option<Job> {
    job.done(err);
    None
}
