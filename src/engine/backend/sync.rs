//! The synchronous reference read, the contract every faster path must
//! reproduce byte for byte: the block-aligned bulk by one O_DIRECT `pread`
//! into the slot base, the sub-block tail by one buffered `pread` straight
//! into its place after it. When the bulk cannot go direct (decided by
//! `plan::direct`, as for the engine) or the direct read fails or comes
//! back short, the payload is read wholly buffered into its place, the
//! fallback counted by cause and logged once per drive. Buffered reads
//! drop their pages afterwards.
//!
//! It is reached as [`Model::read_sync`] (defined here, beside its sibling
//! backends: the model layer below does no reads of its own).

use crate::config::DirectMode;
use crate::engine::ticket::{Loaded, Meta};
use crate::error::{Error, Result};
use crate::format::catalog::TensorRef;
use crate::memory::Slot;
use crate::model::Model;
use crate::plan::direct::{plan, DirectPlan};
use crate::stats::{DriveCounters, FallbackCause};
use crate::storage::files::pread_full;
use crate::storage::files::{drop_pages, Drive, ShardFile};

impl Model {
    /// Reads `tensor` into `slot` on the calling thread: the payload lands at
    /// `slot base + offset % align`. On error the slot goes back to its arena.
    pub fn read_sync(&self, tensor: &TensorRef, slot: Slot) -> Result<Loaded> {
        let file = self.file_of(tensor)?;
        let meta = Meta::of(self, tensor);
        read_sync(file, self.drives(), tensor, slot, self.direct_mode(), meta)
    }
}

/// Reads `tensor` into `slot` synchronously. On error the slot is dropped
/// (returned to its arena): nothing the kernel writes outlives this call.
fn read_sync(
    file: &ShardFile,
    drives: &[Drive],
    tensor: &TensorRef,
    mut slot: Slot,
    mode: DirectMode,
    meta: Meta,
) -> Result<Loaded> {
    let path = &file.path;
    let drive = &drives[file.drive];
    let w = plan(path, file.size, tensor, &slot)?;
    let c = &drive.counters;
    if w.len == 0 {
        return Ok(Loaded::new(slot, w.pad, 0, meta));
    }
    // The same decision as the engine's, with one copy.
    let mut w = DirectPlan::decide(mode, w, &slot, &[file], drives).window;
    let mut direct_ok = false;
    if w.direct > 0 {
        let dfile = file
            .direct
            .as_ref()
            .expect("decided direct: the file has an O_DIRECT descriptor");
        let buf = &mut slot.as_bytes_mut()[..w.direct];
        match pread_full(dfile, buf, w.start) {
            Ok(n) if n == w.direct => direct_ok = true,
            Ok(n) => {
                let why = format!("O_DIRECT read of {} bytes at {} returned {n}", w.direct, w.start);
                c.fallback(&drive.device, path, FallbackCause::ShortDirect, &why);
                w = w.buffered();
            }
            Err(e) => {
                let cause = if e.raw_os_error() == Some(rustix::io::Errno::INVAL.raw_os_error()) {
                    FallbackCause::DeviceEinval
                } else {
                    FallbackCause::DirectError
                };
                let why = format!("O_DIRECT read of {} bytes at {}: {e}", w.direct, w.start);
                c.fallback(&drive.device, path, cause, &why);
                w = w.buffered();
            }
        }
    }
    if w.tail > 0 {
        let at = w.tail_slot_offset();
        let buf = &mut slot.as_bytes_mut()[at..at + w.tail];
        let off = w.tail_file_offset();
        let n = pread_full(&file.buffered, buf, off).map_err(|e| Error::io(path, "buffered read", e))?;
        if n < w.tail {
            return Err(Error::UnexpectedEof {
                path: path.clone(),
                op: "buffered read",
                start: off,
                end: off + w.tail as u64,
                at: off + n as u64,
            });
        }
        drop_pages(&file.buffered, off, w.tail as u64);
        DriveCounters::add(&c.bytes_buffered, w.tail as u64);
    }
    if direct_ok {
        DriveCounters::add(&c.reads_direct, 1);
        DriveCounters::add(&c.bytes_direct, (w.len - w.tail) as u64);
    } else {
        DriveCounters::add(&c.reads_buffered, 1);
    }
    DriveCounters::add(&c.bytes, w.len as u64);
    Ok(Loaded::new(slot, w.pad, w.len, meta))
}
