//! The synchronous in-place range read: the contract every faster path must
//! reproduce byte for byte.
//!
//! The block-aligned bulk goes by one O_DIRECT `pread` into the slot base;
//! the sub-block tail by one buffered `pread` straight into its place after
//! it. When the bulk cannot go direct (no O_DIRECT descriptor, a slot that
//! does not meet the file's alignment, no whole block in the payload) or
//! the direct read fails or comes back short, the payload is read wholly
//! buffered into its place. Every such fallback is counted by cause and
//! logged once per drive. Buffered reads drop their pages afterwards so a
//! fallback does not fill the page cache with bytes nobody reads again.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::str::FromStr;

use crate::arena::Slot;
use crate::catalog::TensorRef;
use crate::error::{Error, Result};
use crate::model::{Drive, ShardFile};
use crate::stats::{DriveCounters, FallbackCause};
use crate::window::{Window, WindowError};

/// Whether reads use O_DIRECT.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DirectMode {
    /// O_DIRECT where the file and slot allow it; every fallback counted.
    #[default]
    Auto,
    /// As `Auto`, but a shard whose filesystem refuses O_DIRECT is an error
    /// at open instead of a counted fallback.
    On,
    /// Buffered reads only (pages dropped after each read).
    Off,
}

impl FromStr for DirectMode {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s.trim().to_ascii_lowercase().as_str() {
            "auto" => Ok(DirectMode::Auto),
            "on" | "1" | "true" => Ok(DirectMode::On),
            "off" | "0" | "false" => Ok(DirectMode::Off),
            other => Err(Error::Config(format!(
                "direct mode {other:?}: expected auto, on or off"
            ))),
        }
    }
}

/// A payload that has landed in its slot.
pub struct Loaded {
    slot: Slot,
    pad: usize,
    len: usize,
}

impl Loaded {
    pub(crate) fn new(slot: Slot, pad: usize, len: usize) -> Self {
        debug_assert!(pad + len <= slot.len());
        Loaded { slot, pad, len }
    }

    /// Offset of the payload from the slot base (`file offset % align`).
    pub fn pad(&self) -> usize {
        self.pad
    }

    /// The slot, for reuse.
    pub fn into_slot(self) -> Slot {
        self.slot
    }

    /// The slot, read-only (scratch included), e.g. for guard checks.
    pub fn slot(&self) -> &Slot {
        &self.slot
    }
}

impl std::ops::Deref for Loaded {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        &self.slot.as_bytes()[self.pad..self.pad + self.len]
    }
}

impl std::fmt::Debug for Loaded {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Loaded")
            .field("pad", &self.pad)
            .field("len", &self.len)
            .finish()
    }
}

/// Plans where `tensor` lands in a slot of `slot`'s spec. Errors name the file.
pub(crate) fn plan(path: &Path, file_size: u64, tensor: &TensorRef, slot: &Slot) -> Result<Window> {
    if tensor.len > slot.capacity() as u64 {
        return Err(Error::SlotTooSmall {
            tensor: tensor.name.clone(),
            need: tensor.len as usize,
            capacity: slot.capacity(),
        });
    }
    let spec = slot.spec();
    Window::plan(tensor.offset, tensor.len, file_size, spec.align as u64, spec.tail_room).map_err(|e| match e {
        WindowError::OutOfFile { start, end, size } => Error::OutOfRange {
            path: path.to_path_buf(),
            start,
            end,
            size,
        },
        WindowError::BadAlign(a) => Error::Config(format!("slot alignment {a} is not a power of two")),
    })
}

/// Why this read cannot take the direct path, if it cannot.
pub(crate) fn direct_refusal(file: &ShardFile, w: &Window, slot: &Slot) -> Option<(FallbackCause, String)> {
    if file.direct.is_none() {
        let why = file.direct_refused.as_deref().unwrap_or("no O_DIRECT descriptor");
        return Some((FallbackCause::DirectOpenRefused, why.to_string()));
    }
    let mem = file.topo.dio_mem_align as usize;
    if !(slot.base() as usize).is_multiple_of(mem) {
        return Some((
            FallbackCause::SlotMisaligned,
            format!("slot base {:p} is not {mem}-byte aligned", slot.base()),
        ));
    }
    let need = file.topo.dio_offset_align as usize;
    let have = slot.spec().align;
    if !have.is_multiple_of(need) {
        return Some((
            FallbackCause::SlotAlignTooSmall,
            format!("slot reserves {have}-byte alignment, the file needs {need}"),
        ));
    }
    if w.direct == 0 {
        return Some((
            FallbackCause::NoBulk,
            format!("payload of {} bytes holds no whole {have}-byte block", w.len),
        ));
    }
    None
}

/// Reads `tensor` into `slot` synchronously. On error the slot is dropped
/// (returned to its arena): nothing the kernel writes outlives this call.
pub(crate) fn read_sync(
    file: &ShardFile,
    drive: &Drive,
    tensor: &TensorRef,
    mut slot: Slot,
    mode: crate::DirectMode,
) -> Result<Loaded> {
    let path = &file.path;
    let w = plan(path, file.size, tensor, &slot)?;
    let c = &drive.counters;
    let mut w = w;
    let mut direct_ok = false;
    if w.len == 0 {
        return Ok(Loaded::new(slot, w.pad, 0));
    }
    if mode == DirectMode::Off {
        w = w.buffered();
    } else if let Some((cause, why)) = direct_refusal(file, &w, &slot) {
        c.fallback(&drive.device, path, cause, &why);
        w = w.buffered();
    } else {
        let dfile = file.direct.as_ref().expect("checked by direct_refusal");
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
    Ok(Loaded::new(slot, w.pad, w.len))
}

/// `pread` until `buf` is full or end of file; returns the bytes read.
/// EINTR is retried; any other error is returned.
pub(crate) fn pread_full(file: &File, buf: &mut [u8], off: u64) -> std::io::Result<usize> {
    let mut done = 0;
    while done < buf.len() {
        match file.read_at(&mut buf[done..], off + done as u64) {
            Ok(0) => break,
            Ok(k) => done += k,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(done)
}

/// Drops the page-cache pages of a range read buffered: weights are read once
/// per step and must not crowd out the engine's memory.
pub(crate) fn drop_pages(file: &File, off: u64, len: u64) {
    // Advisory: a failure costs only cache, never bytes.
    let _ = rustix::fs::fadvise(file, off, std::num::NonZeroU64::new(len), rustix::fs::Advice::DontNeed);
}
