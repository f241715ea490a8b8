//! The direct/buffered decision, in one place: where a tensor lands in a
//! slot (a window checked against the slot's real length before any I/O),
//! and whether its bulk may go O_DIRECT on each copy of its shard, every
//! refusal counted by cause and logged once per drive. The synchronous read
//! and the engine both decide here, so they cannot decide differently.

use std::path::Path;

use crate::config::{DirectMode, MAX_COPY_RANKS};
use crate::error::{Error, Result};
use crate::format::catalog::TensorRef;
use crate::memory::{Slot, SlotSpec};
use crate::plan::window::{Window, WindowError};
use crate::stats::FallbackCause;
use crate::storage::files::{Drive, ShardFile};

/// Plans where `tensor` lands in `slot`. Errors name the tensor or the file.
///
/// Both the synchronous path and the engine plan through here, so no read
/// of either reaches the kernel unless every byte it may write lies inside
/// the slot: see [`plan_in`].
pub(crate) fn plan(path: &Path, file_size: u64, tensor: &TensorRef, slot: &Slot) -> Result<Window> {
    if slot.exact() {
        // The payload at the slot's first byte. A payload that starts on a
        // block keeps its O_DIRECT window (it starts at the slot base);
        // any other is read buffered into place: the extent is the payload.
        let w = plan_in(path, file_size, tensor, slot.spec(), usize::MAX)?;
        let w = if w.pad == 0 { w } else { w.placed() };
        if w.slot_extent().is_none_or(|e| e > slot.len()) {
            return Err(Error::SlotTooSmall {
                tensor: tensor.name.clone(),
                need: w.len,
                capacity: slot.len(),
            });
        }
        return Ok(w);
    }
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

/// How one read's bulk goes, decided before any I/O: the window to read
/// (the buffered fallback when no copy can go direct), and per copy of the
/// shard (primary first) whether its chunks may go O_DIRECT, with the
/// refusal counted when a chunk is routed to a copy that cannot.
pub(crate) struct DirectPlan {
    /// The window to read: as planned, or [`Window::buffered`].
    pub(crate) window: Window,
    direct: [bool; MAX_COPY_RANKS],
    refusals: [Option<(FallbackCause, String)>; MAX_COPY_RANKS],
    counted: [bool; MAX_COPY_RANKS],
}

impl DirectPlan {
    /// Decides for `copies` (the shard's copies, primary first; at most
    /// [`MAX_COPY_RANKS`] are considered) of a read planned as `w` into
    /// `slot`. With `DirectMode::Off` everything goes buffered and nothing
    /// is counted; a payload without a whole block is counted `no_bulk` on
    /// the primary's drive; when no copy can go direct, the primary's
    /// refusal is counted once on its drive.
    pub(crate) fn decide(mode: DirectMode, w: Window, slot: &Slot, copies: &[&ShardFile], drives: &[Drive]) -> Self {
        let mut p = DirectPlan {
            window: w,
            direct: [false; MAX_COPY_RANKS],
            refusals: Default::default(),
            counted: [false; MAX_COPY_RANKS],
        };
        let primary = copies[0];
        let count_on_primary = |cause: FallbackCause, why: &str| {
            let d = &drives[primary.drive];
            d.counters.fallback(&d.device, &primary.path, cause, &why);
        };
        if mode == DirectMode::Off || w.len == 0 {
            p.window = if w.len == 0 { w } else { w.buffered() };
            return p;
        }
        if slot.exact() {
            // Caller memory read straight into place: only when no copy
            // can go direct (the refusal is the cause), else the caller's
            // choice of place (Engine::read_into stages those instead).
            match direct_refusal(primary, &w, slot) {
                Some((FallbackCause::DirectOpenRefused, why)) => {
                    count_on_primary(FallbackCause::DirectOpenRefused, &why)
                }
                _ => count_on_primary(
                    FallbackCause::Placed,
                    &format!(
                        "payload of {} bytes placed by the caller with no room for an O_DIRECT window",
                        w.len
                    ),
                ),
            }
            return p;
        }
        if w.direct == 0 {
            let why = format!(
                "payload of {} bytes holds no whole {}-byte block",
                w.len,
                slot.spec().align
            );
            count_on_primary(FallbackCause::NoBulk, &why);
            return p;
        }
        let n = copies.len().min(MAX_COPY_RANKS);
        for (k, f) in copies[..n].iter().enumerate() {
            p.refusals[k] = direct_refusal(f, &w, slot);
            p.direct[k] = p.refusals[k].is_none();
        }
        if !p.direct[..n].iter().any(|&x| x) {
            // No copy can: counted once, on the primary's drive.
            if let Some((cause, why)) = &p.refusals[0] {
                count_on_primary(*cause, why);
            }
            p.counted[0] = true;
            p.window = w.buffered();
        }
        p
    }

    /// Whether chunks routed to copy `k` may go O_DIRECT.
    pub(crate) fn copy_direct(&self, k: usize) -> bool {
        self.direct.get(k).copied().unwrap_or(false)
    }

    /// A direct chunk was routed to copy `k` (file `file` on `drive`), which
    /// cannot take it: counts its refusal, once per read and copy.
    pub(crate) fn count_refusal(&mut self, k: usize, file: &ShardFile, drive: &Drive) {
        if k >= MAX_COPY_RANKS || self.counted[k] {
            return;
        }
        self.counted[k] = true;
        if let Some((cause, why)) = &self.refusals[k] {
            drive.counters.fallback(&drive.device, &file.path, *cause, why);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory::Arena;
    use crate::plan::chunk;
    use proptest::prelude::*;

    fn tensor(offset: u64, len: u64) -> TensorRef {
        TensorRef {
            name: "model.layers.0.w".into(),
            shard: 0,
            offset,
            len,
            dtype: crate::format::dtype::Dtype::U8,
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
