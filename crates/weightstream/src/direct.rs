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

use crate::arena::{Slot, SlotSpec};
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

/// Plans where `tensor` lands in `slot`. Errors name the tensor or the file.
///
/// Both the synchronous path and the engine plan through here, so no read
/// of either reaches the kernel unless every byte it may write lies inside
/// the slot: see [`plan_in`].
pub(crate) fn plan(path: &Path, file_size: u64, tensor: &TensorRef, slot: &Slot) -> Result<Window> {
    plan_in(path, file_size, tensor, slot.spec(), slot.len())
}

/// [`plan`] for a slot of `spec` that is `slot_len` bytes long (the real
/// length of its memory, not what the spec claims).
///
/// Refuses a payload longer than the spec's capacity, a range outside the
/// file, and (always on, in release builds too) a window whose
/// [`Window::slot_extent`], the furthest slot byte any of its reads may
/// write, passes `slot_len`. The buffered fallback of an accepted window
/// writes less ([`Window::buffered`] has the smaller extent `pad + len`), so
/// every chunk `chunk::split` makes of either lies in `[0, slot_len)`.
pub(crate) fn plan_in(
    path: &Path,
    file_size: u64,
    tensor: &TensorRef,
    spec: SlotSpec,
    slot_len: usize,
) -> Result<Window> {
    if tensor.len > spec.capacity as u64 {
        return Err(Error::SlotTooSmall {
            tensor: tensor.name.clone(),
            need: usize::try_from(tensor.len).unwrap_or(usize::MAX),
            capacity: spec.capacity,
        });
    }
    let w =
        Window::plan(tensor.offset, tensor.len, file_size, spec.align as u64, spec.tail_room).map_err(|e| match e {
            WindowError::OutOfFile { start, end, size } => Error::OutOfRange {
                path: path.to_path_buf(),
                start,
                end,
                size,
            },
            WindowError::BadAlign(a) => Error::Config(format!(
                "tensor {}: slot alignment {a} is not a power of two",
                tensor.name
            )),
            WindowError::TooLarge { start, end } => Error::Config(format!(
                "tensor {} in {}: its read window [{start}, {end}) does not fit in the address space",
                tensor.name,
                path.display()
            )),
        })?;
    match w.slot_extent() {
        Some(extent) if extent <= slot_len => Ok(w),
        extent => Err(Error::Config(format!(
            "tensor {} in {}: its read window ends {} bytes from the slot base (pad {}, payload {}, direct part {}), \
             past the slot's {slot_len} bytes; refused before any I/O",
            tensor.name,
            path.display(),
            extent.map_or_else(|| "more than usize::MAX".to_string(), |e| e.to_string()),
            w.pad,
            w.len,
            w.direct,
        ))),
    }
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::arena::Arena;
    use crate::chunk;
    use proptest::prelude::*;

    fn tensor(offset: u64, len: u64) -> TensorRef {
        TensorRef {
            name: "model.layers.0.w".into(),
            shard: 0,
            offset,
            len,
            dtype: crate::dtype::Dtype::U8,
            shape: vec![len as usize],
            index: 0,
        }
    }

    /// Checks every chunk of `w` (and of its buffered fallback) against a
    /// slot of `slot_len` bytes and a file of `size` bytes, in u128.
    fn chunks_inside(w: &Window, slot_len: usize, size: u64, chunk: usize) -> std::result::Result<(), String> {
        for w in [*w, w.buffered()] {
            let n = chunk::count(&w, chunk);
            let mut seen = 0;
            for c in chunk::split(&w, 0, chunk) {
                seen += 1;
                let slot_end = c.slot_off as u128 + c.len as u128;
                let file_end = c.file_off as u128 + c.len as u128;
                if slot_end > slot_len as u128 || file_end > size as u128 || c.len == 0 {
                    return Err(format!(
                        "chunk {c:?} of {w:?} leaves the slot ({slot_len} bytes) or the file ({size} bytes)"
                    ));
                }
            }
            if seen != n {
                return Err(format!("split made {seen} chunks, count says {n}"));
            }
        }
        Ok(())
    }

    /// A capacity around `len`, or near the top of usize / isize.
    fn capacity(len: u64) -> impl Strategy<Value = usize> {
        let len = len as usize;
        let imax = isize::MAX as usize;
        prop_oneof![
            4 => (0usize..10_000).prop_map(move |k| len.saturating_add(k)),
            1 => (0usize..10_000).prop_map(move |k| len.saturating_sub(k)),
            1 => (0usize..5_000).prop_map(move |k| usize::MAX - k),
            1 => (0usize..10_000).prop_map(move |k| (imax - 5_000).saturating_add(k)),
            1 => any::<usize>(),
        ]
    }

    /// (offset, len, file size): mostly in a file of up to a few MiB, some
    /// past its end, some near `u64::MAX`.
    fn range() -> impl Strategy<Value = (u64, u64, u64)> {
        prop_oneof![
            4 => (0u64..(4 << 20)).prop_flat_map(|size| (0..=size, 0..=size, Just(size)))
                .prop_map(|(a, b, size)| (a.min(b), a.max(b) - a.min(b), size)),
            1 => (0u64..(1 << 20), 0u64..(1 << 20), 0u64..(1 << 20)),
            1 => (0u64..(1 << 16), 0u64..(1 << 16), 0u64..(1 << 16))
                .prop_map(|(back, len, before)| {
                    let size = u64::MAX - back;
                    (size.saturating_sub(len).saturating_sub(before), len, size)
                }),
        ]
    }

    fn case() -> impl Strategy<Value = (u64, u64, u64, usize, bool, usize, Option<usize>, usize)> {
        (range(), 9u32..=16, any::<bool>(), 0usize..4, 0usize..40).prop_flat_map(
            |((off, len, size), shift, room, slot_pick, chunk_blocks)| {
                let align = 1usize << shift;
                // The slot's real length: the spec's (what every arena has),
                // or a disagreeing one (a slot whose memory is not what its
                // spec claims), from 0 to a little past the window.
                let other = (0usize..(len as usize).saturating_add(4 * align).min(1 << 24)).prop_map(Some);
                let slot = if slot_pick == 0 {
                    other.boxed()
                } else {
                    Just(None).boxed()
                };
                (
                    Just(off),
                    Just(len),
                    Just(size),
                    Just(align),
                    Just(room),
                    capacity(len),
                    slot,
                    Just((chunk_blocks + 1) * align),
                )
            },
        )
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 2000, ..ProptestConfig::default() })]

        /// For every accepted spec and every slot length: `plan_in` accepts
        /// exactly the reads whose every chunk lies inside the slot (and the
        /// payload in the capacity, the range in the file); whatever it
        /// accepts, `chunk::split` keeps inside `[0, slot_len)`. With the
        /// spec's own slot length, a read is never refused for its extent.
        #[test]
        fn planned_chunks_lie_inside_the_slot(
            (off, len, size, align, room, cap, other_len, chunk) in case()
        ) {
            let spec = SlotSpec::new(cap).with_align(align).with_tail_room(room);
            let spec_len = spec.slot_len();
            // A refused spec has no slot: Arena::new must refuse it too.
            let slot_len = match (other_len, &spec_len) {
                (Some(l), _) => l,
                (None, Ok(l)) => *l,
                (None, Err(_)) => {
                    prop_assert!(Arena::new(spec, 1).is_err());
                    return Ok(());
                }
            };
            let t = tensor(off, len);
            let got = plan_in(Path::new("shard.safetensors"), size, &t, spec, slot_len);
            // What the unguarded planner would do, and whether it fits.
            let raw = Window::plan(off, len, size, align as u64, room);
            let fits = match &raw {
                Ok(w) => chunks_inside(w, slot_len, size, chunk).is_ok(),
                Err(_) => false,
            };
            let should = len <= cap as u64 && raw.is_ok() && fits;
            match got {
                Ok(w) => {
                    prop_assert!(should, "accepted {:?} for a slot of {} bytes", w, slot_len);
                    prop_assert_eq!(Ok(w), raw);
                    prop_assert!(w.slot_extent().unwrap() <= slot_len);
                    chunks_inside(&w, slot_len, size, chunk).map_err(TestCaseError::fail)?;
                }
                Err(e) => {
                    prop_assert!(!should, "refused a read that fits: {}", e);
                    let msg = e.to_string();
                    if len <= cap as u64 && raw.is_ok() {
                        // Refused for its extent: the message names the
                        // tensor and both numbers.
                        prop_assert!(other_len.is_some(), "the spec's own slot refused: {}", msg);
                        let extent = raw.unwrap().slot_extent().unwrap();
                        prop_assert!(msg.contains(&t.name), "{}", msg);
                        prop_assert!(msg.contains(&extent.to_string()), "{}", msg);
                        prop_assert!(msg.contains(&slot_len.to_string()), "{}", msg);
                    }
                }
            }
        }
    }

    /// The same through real slots: `plan` (what the sync path and the
    /// engine call) uses the slot's real length, and a planned read of every
    /// small case lands inside it.
    #[test]
    fn plan_uses_the_real_slot_length() {
        let arena = Arena::new(SlotSpec::new(10_000).with_tail_room(true), 1).unwrap();
        let slot = arena.take().unwrap();
        let path = Path::new("shard.safetensors");
        for off in [0u64, 1, 71, 4095, 4096, 5000] {
            for len in [0u64, 1, 4096, 9_999, 10_000] {
                let w = plan(path, 1 << 20, &tensor(off, len), &slot).unwrap();
                chunks_inside(&w, slot.len(), 1 << 20, 4096).unwrap();
            }
        }
        let e = plan(path, 1 << 20, &tensor(0, 10_001), &slot).unwrap_err();
        assert!(e.to_string().contains("10001"), "{e}");
        // A slot that is shorter than its spec claims is refused by extent.
        let t = tensor(71, 10_000);
        let e = plan_in(path, 1 << 20, &t, slot.spec(), 8192).unwrap_err().to_string();
        assert!(
            e.contains("model.layers.0.w") && e.contains("12288") && e.contains("8192"),
            "{e}"
        );
    }
}
