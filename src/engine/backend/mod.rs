//! The backends that issue a read's chunks: io_uring rings and pread
//! worker pools, siblings over the engine's shared queue, in-flight
//! bookkeeping and completion policy; and the synchronous reference read
//! (one read at a time on the calling thread).

pub(crate) mod pread;
pub(crate) mod ring;
pub(crate) mod sync;

use crate::engine::queue::Job;
use crate::model::Model;

/// One `pread` of a chunk into its slot: bytes read, or `-errno`. Shared by
/// the pread workers and by a polled ring's buffered chunks.
///
/// # Safety
/// The caller holds `job` (and with it the request that owns the slot) for
/// the whole call, and no other chunk of that request that overlaps this
/// one is being read: the chunk's bytes of the slot are written through a
/// slice built from the slot's address.
pub(crate) unsafe fn pread_chunk(model: &Model, job: &Job) -> i32 {
    let file = &model.files()[job.chunk.file as usize];
    let fd = match (&file.direct, job.chunk.direct) {
        (Some(d), true) => d,
        _ => &file.buffered,
    };
    // SAFETY: the chunk lies inside the slot (`SlotRange::slice_mut`
    // checks it); the slot is alive and this chunk's bytes unaliased by
    // this function's contract.
    let buf = unsafe { job.target.range.slice_mut(job.chunk.slot_off, job.chunk.len as usize) };
    match rustix::io::pread(fd, buf, job.chunk.file_off) {
        Ok(n) => n as i32,
        Err(e) => -e.raw_os_error(),
    }
}
