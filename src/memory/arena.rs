//! Page-aligned memory carved into slots that payloads land in.
//!
//! A slot reserves `align` bytes of scratch before the payload (so the
//! aligned O_DIRECT window can start at the slot base) and, optionally, tail
//! room up to the next `align` boundary after the payload (so the last
//! partial block can be read with O_DIRECT too). Slots are owned handles:
//! not `Clone`, returned to their arena on drop or with
//! [`Arena::give_back`]. The mapping lives as long as any slot of it does.
//!
//! Every size that becomes an address is computed checked: a spec whose
//! slot length overflows, or exceeds `isize::MAX` bytes (the most a Rust
//! slice or allocation may span), or whose `count` slots do, is refused with
//! an error naming the numbers, in release builds as in debug builds.
//!
//! Each mapping is `madvise(MADV_DONTFORK)`: `fork()` does not copy it, so
//! a forked child cannot touch (or copy) memory the kernel may be writing.
//!
//! Under Miri, which cannot model `mmap`/`madvise`, the memory comes from
//! the global allocator (page-aligned, zeroed) instead; slot carving, the
//! free list, slot access, drop order and release hooks are the same code.

use std::ptr::NonNull;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use crate::error::{Error, Result, TakeError};
use crate::memory::carve::{ring_bytes, Extents};
use crate::memory::region::{page_size, ForkAdvice, Region};

/// The shape of every slot in an arena.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SlotSpec {
    /// Largest payload a slot holds.
    pub capacity: usize,
    /// Scratch reserved before the payload; a power of two, at least the
    /// O_DIRECT offset alignment of the files read into it.
    pub align: usize,
    /// Reserve room after the payload up to the next `align` boundary.
    pub tail_room: bool,
}

impl SlotSpec {
    /// Slots for payloads up to `capacity` bytes, 4096-byte scratch, no tail room.
    pub fn new(capacity: usize) -> Self {
        SlotSpec {
            capacity,
            align: 4096,
            tail_room: false,
        }
    }

    /// Sets the scratch reserved before the payload (a power of two, at least the files' O_DIRECT offset alignment).
    pub fn with_align(mut self, align: usize) -> Self {
        self.align = align;
        self
    }

    /// Reserves room after the payload up to the next `align` boundary (the last partial block can then go O_DIRECT too).
    pub fn with_tail_room(mut self, tail_room: bool) -> Self {
        self.tail_room = tail_room;
        self
    }

    /// Bytes of one slot: scratch + payload (+ tail room), rounded to the
    /// page (or to `align` when that is larger).
    ///
    /// Checked: an error naming the spec when the alignment is not a power
    /// of two of at least 512, when a sum or a rounding overflows `usize`,
    /// or when the slot would exceed `isize::MAX` bytes.
    pub fn slot_len(&self) -> Result<usize> {
        self.check_align()?;
        let refuse = |why: String| {
            Error::Config(format!(
                "slot spec (capacity {}, align {}, tail room {}): {why}",
                self.capacity, self.align, self.tail_room
            ))
        };
        let body = if self.tail_room {
            round_up(self.capacity, self.align).ok_or_else(|| {
                refuse(format!(
                    "the capacity rounded up to {} bytes overflows usize",
                    self.align
                ))
            })?
        } else {
            self.capacity
        };
        let raw = self
            .align
            .checked_add(body.max(1))
            .ok_or_else(|| refuse(format!("{} scratch bytes + {body} overflows usize", self.align)))?;
        let unit = page_size().max(self.align);
        let len =
            round_up(raw, unit).ok_or_else(|| refuse(format!("{raw} bytes rounded up to {unit} overflows usize")))?;
        if len > isize::MAX as usize {
            return Err(refuse(format!(
                "a slot of {len} bytes exceeds isize::MAX ({} bytes)",
                isize::MAX
            )));
        }
        Ok(len)
    }

    /// Checks that slots of this spec can exist ([`SlotSpec::slot_len`]
    /// succeeds); [`Arena::new`] refuses every spec this refuses.
    pub fn validate(&self) -> Result<()> {
        self.slot_len().map(drop)
    }

    fn check_align(&self) -> Result<()> {
        if !self.align.is_power_of_two() || self.align < 512 {
            return Err(Error::Config(format!(
                "slot alignment {} must be a power of two of at least 512 (slot spec of capacity {})",
                self.align, self.capacity
            )));
        }
        Ok(())
    }
}

/// Bytes a slot needs to read a payload of `len` bytes at file offset
/// `offset` in place: the `offset % align` bytes of scratch before it, then
/// the payload (at least one byte). `None` when that overflows `usize`.
pub(crate) fn in_place_bytes(offset: u64, len: u64, align: usize) -> Option<usize> {
    let pad = (offset % align as u64) as usize;
    pad.checked_add(usize::try_from(len).ok()?.max(1))
}

/// Rounds `x` up to a multiple of `align`; `None` when `align` is not a
/// power of two or the result does not fit `usize`.
pub fn round_up(x: usize, align: usize) -> Option<usize> {
    if !align.is_power_of_two() {
        return None;
    }
    x.checked_add(align - 1).map(|v| v & !(align - 1))
}

static NEXT_ARENA_ID: AtomicU64 = AtomicU64::new(1);

/// The largest range registered as one fixed buffer (the kernel's limit):
/// an arena is registered in pieces of at most this, and a slot inside one
/// piece has a buffer index.
pub(crate) const PIECE: usize = 1 << 30;

/// How a mapping is carved into slots.
enum Carve {
    /// `count` slots of one spec, `slot_len` bytes each, handed out by index.
    Fixed {
        spec: SlotSpec,
        slot_len: usize,
        count: usize,
        free: Mutex<Vec<usize>>,
    },
    /// Slots of any size: next fit over the free extents (none crossing a
    /// [`PIECE`], except a slot larger than a piece: it has no buffer index
    /// and reads unregistered), or at a place the caller names.
    Packed {
        /// Scratch alignment of the slots this arena sizes itself
        /// ([`Arena::take_for`]).
        align: usize,
        extents: Mutex<Extents>,
    },
}

struct Mapping {
    /// Unique for the process lifetime: registrations are keyed by it, never
    /// by address (a new arena may be mapped where a dropped one was).
    id: u64,
    region: Region,
    carve: Carve,
    /// The NUMA node the pages are bound to (`None`: wherever first touch
    /// put them).
    node: Option<usize>,
    /// Run when the mapping goes (no slot or arena handle left): engines
    /// unregister the arena's fixed buffers here.
    on_release: Mutex<Vec<ReleaseHook>>,
    /// The process that mapped it: in a forked child a `MADV_DONTFORK`
    /// region is not mapped at all.
    origin: crate::fork::Origin,
    /// An engine asked to register it as fixed buffers (whether or not
    /// that succeeded): a read into it without a fixed buffer is then a
    /// fallback, not a choice.
    register_asked: std::sync::atomic::AtomicBool,
    /// [`Arena`] handles alive. A slot is only ever taken through one, so
    /// once this is 0 (it never rises again: a new handle is a clone of a
    /// live one) no byte of the mapping is read into again.
    handles: AtomicUsize,
    /// Every page was handed to forked children at once
    /// ([`Arena::inherit_all_on_fork`]: a load's own mapping after its
    /// last read, when no handle is left).
    inherited: std::sync::atomic::AtomicBool,
    /// The pages of each slot that comes back are handed back to the
    /// kernel ([`Arena::discard_freed_pages`]); never with fixed buffers.
    discard_freed: std::sync::atomic::AtomicBool,
}

impl Mapping {
    /// Whether this mapping's pages are absent here (a forked child).
    fn unmapped_here(&self) -> bool {
        self.region.dontfork && self.origin.forked() && !self.inherited.load(Ordering::Acquire)
    }

    /// Whether this is a forked child of the process that made the
    /// mapping: there no slot is handed out and no lock of the arena is
    /// taken (a parent thread may have held it at fork, and it would never
    /// be released here), whatever memory the arena is over (its own,
    /// `MADV_DONTFORK`, or lent by the caller, which the child may still
    /// have).
    fn in_child(&self) -> bool {
        self.origin.forked()
    }

    fn new(region: Region, carve: Carve, node: Option<usize>) -> Arc<Self> {
        Arc::new(Mapping {
            id: NEXT_ARENA_ID.fetch_add(1, Ordering::Relaxed),
            region,
            carve,
            node,
            on_release: Mutex::new(Vec::new()),
            origin: crate::fork::Origin::here(),
            register_asked: std::sync::atomic::AtomicBool::new(false),
            handles: AtomicUsize::new(0),
            inherited: std::sync::atomic::AtomicBool::new(false),
            discard_freed: std::sync::atomic::AtomicBool::new(false),
        })
    }
}

type ReleaseHook = Box<dyn FnOnce() + Send>;

// SAFETY: the mapping is plain memory owned (or, for caller memory, lent for
// its whole life) by this struct; every byte of it is reached only through
// a `Slot`, and each byte range is held by at most one `Slot` at a time (the
// free list and the extents hand a range out once), so sharing the mapping
// across threads never aliases a mutable byte.
unsafe impl Send for Mapping {}
// SAFETY: as above; `&Mapping` only exposes the free structures (behind
// Mutexes) and read-only geometry.
unsafe impl Sync for Mapping {}

impl Drop for Mapping {
    fn drop(&mut self) {
        let hooks = std::mem::take(self.on_release.get_mut().unwrap_or_else(|p| p.into_inner()));
        for h in hooks {
            h();
        }
        // `region` (a field) is released after this body: after the hooks.
    }
}

/// The memory for `count` slots of `spec`: (region, slot length). The spec,
/// the count and their product are checked first; nothing is mapped for a
/// refused spec.
fn map(spec: SlotSpec, count: usize, populate: bool) -> Result<(Region, usize)> {
    let slot_len = spec.slot_len()?;
    if count == 0 {
        return Err(Error::Config("an arena needs at least one slot".into()));
    }
    let len = slot_len
        .checked_mul(count)
        .filter(|&len| len <= isize::MAX as usize)
        .ok_or_else(|| {
            Error::Config(format!(
                "{count} slots of {slot_len} bytes (capacity {}) exceed isize::MAX ({} bytes)",
                spec.capacity,
                isize::MAX
            ))
        })?;
    let what = || {
        (
            format!(
                "an arena of {count} slot(s) of {slot_len} bytes (capacity {})",
                spec.capacity
            ),
            "the SlotSpec's capacity and the slot count (Arena::new, Engine::arena)".to_string(),
        )
    };
    Ok((Region::new(len, populate, &what)?, slot_len))
}

/// Page-aligned memory payloads land in, carved into slots: either `count`
/// slots of one [`SlotSpec`] ([`Arena::new`]), or slots of any size taken
/// as needed from one mapping ([`Arena::packed`], [`Arena::take_for`]), so
/// a model's tensors of every size share one registered arena. Memory a
/// caller owns can be lent to an engine as an arena too
/// (`Engine::register_memory`). Cloning an arena clones a handle; the
/// memory lives as long as any handle or slot of it does.
///
/// A forked child cannot touch an arena: its pages are not mapped in the
/// child (`MADV_DONTFORK`, so `fork()` neither copies them nor lets a child
/// reach memory the kernel may be writing for the parent); in a child
/// every take is [`TakeError::Forked`] and touching a slot panics naming
/// the cause. If the kernel refuses the advice the arena still works, but
/// is copied on fork: warned once, and visible in [`Arena::fork_protected`]
/// and [`Stats::arena_dontfork_failures`](crate::Stats::arena_dontfork_failures).
///
/// ```
/// use weightstream::{Arena, SlotSpec, TakeError};
/// # fn main() -> Result<(), Box<dyn std::error::Error>> {
/// // 8 MiB for slots of any size, 4096-byte O_DIRECT alignment, faulted in now.
/// let arena = Arena::packed(8 << 20, 4096, true)?;
/// let small = arena.take_sized(SlotSpec::new(10_000))?; // a TakeError says why not
/// let large = arena.take_sized(SlotSpec::new(3 << 20))?;
/// assert!(small.len() >= 10_000 && large.len() >= 3 << 20);
/// assert_eq!(small.offset() % 4096, 0);
/// drop(small); // its extent is free again (merged with free neighbours)
/// assert!(arena.available() >= arena.bytes() - large.len());
/// // Never room for 9 MiB, however many slots come back; and a packed
/// // arena has no slot size of its own for `take`.
/// let e = arena.take_sized(SlotSpec::new(9 << 20)).unwrap_err();
/// assert!(matches!(e, TakeError::NeverFits { field: "bytes", .. }), "{e}");
/// assert_eq!(arena.take().unwrap_err(), TakeError::WrongKind);
/// # Ok(())
/// # }
/// ```
pub struct Arena {
    map: Arc<Mapping>,
}

impl Clone for Arena {
    fn clone(&self) -> Self {
        Arena::handle(Arc::clone(&self.map))
    }
}

impl Drop for Arena {
    fn drop(&mut self) {
        self.map.handles.fetch_sub(1, Ordering::AcqRel);
    }
}

impl std::fmt::Debug for Arena {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut d = f.debug_struct("Arena");
        d.field("bytes", &self.map.region.len);
        match &self.map.carve {
            Carve::Fixed { spec, count, .. } => {
                d.field("spec", spec).field("slots", count);
            }
            Carve::Packed { align, .. } => {
                d.field("packed", &true).field("align", align);
            }
        }
        d.field("available", &self.available()).finish()
    }
}

impl Arena {
    /// Maps `count` slots of `spec`, faulted in up front so the first read
    /// does not pay page faults.
    pub fn new(spec: SlotSpec, count: usize) -> Result<Self> {
        let (region, slot_len) = map(spec, count, true)?;
        Ok(Arena::fixed(region, spec, slot_len, count, None))
    }

    /// Maps `count` slots of `spec` without faulting them in, runs `bind`
    /// on the untouched mapping (a NUMA memory policy for node `node`), then
    /// touches every page, so each is allocated under that policy. A `bind`
    /// error unmaps and is returned.
    pub fn new_on_node(
        spec: SlotSpec,
        count: usize,
        node: usize,
        bind: impl FnOnce(&[u8]) -> std::result::Result<(), String>,
    ) -> Result<Self> {
        let (region, slot_len) = map(spec, count, false)?;
        let (ptr, len) = (region.ptr, region.len);
        // Built first so the mapping is unmapped on every error path.
        let arena = Arena::fixed(region, spec, slot_len, count, Some(node));
        // SAFETY: `ptr..ptr+len` is the fresh mapping just made, readable and
        // writable; no slot has been handed out, so nothing else reaches it.
        // An untouched anonymous page reads as zeros.
        let area = unsafe { std::slice::from_raw_parts(ptr.as_ptr(), len) };
        bind(area).map_err(|e| Error::Config(format!("binding an arena of {len} bytes to NUMA node {node}: {e}")))?;
        arena.map.region.touch();
        Ok(arena)
    }

    /// An arena of `bytes` (rounded up to the page) carved into slots of any
    /// size as they are taken ([`Arena::take_sized`], [`Arena::take_for`]),
    /// each a multiple of the page, next fit: each search starts where the
    /// last slot taken ended and wraps once, so slots returned in the order
    /// they were taken reuse the arena as a ring ([`Arena::packed_bytes_for`]
    /// sizes one for a loop over batches); `align` is the scratch the
    /// slots it sizes itself reserve before a payload (a power of two, at
    /// least the files' O_DIRECT alignment). `populate` faults every page in
    /// now (else each is faulted by its first read).
    pub fn packed(bytes: usize, align: usize, populate: bool) -> Result<Self> {
        let len = round_up(bytes.max(1), page_size())
            .filter(|&l| l <= isize::MAX as usize)
            .ok_or_else(|| Error::Config(format!("a packed arena of {bytes} bytes exceeds isize::MAX")))?;
        SlotSpec::new(0).with_align(align).validate()?;
        let what = || {
            (
                format!("a packed arena of {len} bytes"),
                "the byte count asked for (Arena::packed, Engine::packed_arena)".to_string(),
            )
        };
        let region = Region::new(len, populate, &what)?;
        Ok(Arena::packed_over(region, align, None))
    }

    /// A packed arena over `region` (mapped here, or lent by a caller).
    pub(crate) fn packed_over(region: Region, align: usize, node: Option<usize>) -> Self {
        let len = region.len;
        let carve = Carve::Packed {
            align,
            extents: Mutex::new(Extents::new(len, page_size(), PIECE)),
        };
        Arena::handle(Mapping::new(region, carve, node))
    }

    /// A handle to `map`, counted (see `Mapping::handles`).
    fn handle(map: Arc<Mapping>) -> Self {
        map.handles.fetch_add(1, Ordering::AcqRel);
        Arena { map }
    }

    fn fixed(region: Region, spec: SlotSpec, slot_len: usize, count: usize, node: Option<usize>) -> Self {
        let carve = Carve::Fixed {
            spec,
            slot_len,
            count,
            free: Mutex::new((0..count).rev().collect()),
        };
        Arena::handle(Mapping::new(region, carve, node))
    }

    /// The NUMA node this arena's pages are bound to, when it was made with
    /// [`Arena::new_on_node`] (or `Engine::arena_on`).
    pub fn node(&self) -> Option<usize> {
        self.map.node
    }

    /// The shape of every slot of a fixed arena; for a packed one, the
    /// shape of a zero-capacity slot with the arena's scratch alignment.
    pub fn spec(&self) -> SlotSpec {
        match &self.map.carve {
            Carve::Fixed { spec, .. } => *spec,
            Carve::Packed { align, .. } => SlotSpec::new(0).with_align(*align),
        }
    }

    /// Records that an engine asks to register this arena (called before
    /// it tries, so a refusal still counts the arena's plain reads as a
    /// fallback). `false`: the arena discards freed pages
    /// ([`Arena::discard_freed_pages`]) and must not be registered.
    pub(crate) fn mark_register_asked(&self) -> bool {
        self.map.register_asked.store(true, Ordering::SeqCst);
        if self.map.discard_freed.load(Ordering::SeqCst) {
            // Plain reads by choice, not a fallback.
            self.map.register_asked.store(false, Ordering::SeqCst);
            return false;
        }
        true
    }

    /// From now on, the whole pages of every slot that comes back to this
    /// arena are handed back to the kernel (`MADV_DONTNEED`): the process's
    /// resident memory tracks the slots out, not every byte ever read (a
    /// reader that hands out tensors one by one over a whole-file arena).
    /// A slot taken later over those pages reads zeros there until a read
    /// fills it, and pays the page faults a fresh mapping pays. Pages a
    /// slot shares with another slot's bytes are kept.
    ///
    /// Such an arena is never registered as fixed buffers (the kernel
    /// would keep writing the pages it pinned, not the fresh ones): an
    /// engine reads into it with plain reads. Refused for memory a caller
    /// lent, and for an arena an engine already asked to register.
    ///
    /// # Errors
    /// [`Error::Config`] in the two cases above.
    pub fn discard_freed_pages(&self) -> Result<()> {
        if self.map.region.borrowed {
            return Err(Error::Config(
                "discard_freed_pages: the arena is a caller's memory, never advised here".into(),
            ));
        }
        self.map.discard_freed.store(true, Ordering::SeqCst);
        if self.map.register_asked.load(Ordering::SeqCst) {
            self.map.discard_freed.store(false, Ordering::SeqCst);
            return Err(Error::Config(
                "discard_freed_pages: an engine registers this arena as fixed buffers (their pages stay pinned)".into(),
            ));
        }
        Ok(())
    }

    /// Identity of this arena (unique in the process).
    pub fn id(&self) -> u64 {
        self.map.id
    }

    /// Number of slots of a fixed arena; slots out right now of a packed one
    /// (0 in a forked child, which locks nothing of an arena).
    pub fn len(&self) -> usize {
        match &self.map.carve {
            Carve::Fixed { count, .. } => *count,
            Carve::Packed { .. } if self.map.in_child() => 0,
            Carve::Packed { extents, .. } => lock(extents).used_count(),
        }
    }

    /// Whether a packed arena has no slot out (a fixed arena: never).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Bytes of the whole mapping.
    pub fn bytes(&self) -> usize {
        self.map.region.len
    }

    /// Faults in `offset..offset + len` of the mapping without writing it
    /// (see `Region::populate_range`): safe while reads land there.
    pub(crate) fn populate_range(&self, offset: usize, len: usize) -> rustix::io::Result<()> {
        self.map.region.populate_range(offset, len)
    }

    /// Whether the memory is a caller's, lent with `Engine::register_memory`.
    pub fn is_borrowed(&self) -> bool {
        self.map.region.borrowed
    }

    /// Gives this handle up and waits, up to `timeout`, until nothing else
    /// holds the arena's memory: no other handle, slot, ticket or `Loaded`
    /// (a ticket dropped early holds its slot until its last chunk is
    /// reaped). `Ok` means this crate no longer reaches the memory and the
    /// kernel no longer writes into it for a read: memory lent with
    /// `Engine::register_memory` may be freed then. `Err` gives the handle
    /// back when something still holds the memory at the deadline: a read
    /// in flight, a slot or `Loaded` the caller keeps, or a read that an
    /// I/O thread abandoned in the kernel when it died (see the failure
    /// model): such memory must never be freed.
    pub fn release(self, timeout: std::time::Duration) -> std::result::Result<(), Arena> {
        let t0 = std::time::Instant::now();
        let mut nap = std::time::Duration::from_micros(50);
        // Only this handle left: nothing can take another reference to the
        // mapping (a new slot or handle needs one), so dropping it is final.
        while Arc::strong_count(&self.map) > 1 {
            if t0.elapsed() >= timeout {
                return Err(self);
            }
            std::thread::sleep(nap.min(timeout.saturating_sub(t0.elapsed())));
            nap = (nap * 2).min(std::time::Duration::from_millis(10));
        }
        drop(self);
        Ok(())
    }

    /// Slots not handed out right now (fixed arenas); free bytes (packed).
    /// 0 in a forked child (which takes nothing from an arena, and locks
    /// none).
    pub fn available(&self) -> usize {
        if self.map.in_child() {
            return 0;
        }
        match &self.map.carve {
            Carve::Fixed { free, .. } => lock(free).len(),
            Carve::Packed { extents, .. } => lock(extents).free_bytes(),
        }
    }

    /// Takes a free slot of a fixed arena.
    ///
    /// # Errors
    /// - [`TakeError::Full`] when every slot is out (`free` 0, `need` the
    ///   slot length).
    /// - [`TakeError::WrongKind`] on a packed arena, which has no slot size
    ///   of its own: use [`Arena::take_for`] or [`Arena::take_sized`].
    /// - [`TakeError::Forked`] in a forked child, where no lock of the
    ///   arena is taken and no slot handed out, whatever memory it is over.
    pub fn take(&self) -> std::result::Result<Slot, TakeError> {
        self.not_forked()?;
        match &self.map.carve {
            Carve::Fixed {
                spec, slot_len, free, ..
            } => {
                let index = lock(free).pop().ok_or(TakeError::Full {
                    need: *slot_len,
                    free: 0,
                    bytes: self.bytes(),
                })?;
                Ok(self.slot_at(index * slot_len, *slot_len, *spec, false))
            }
            Carve::Packed { .. } => Err(TakeError::WrongKind),
        }
    }

    /// A slot of `spec`: from a packed arena, `spec.slot_len()` bytes
    /// carved next fit (see [`Arena::packed`]); a fixed arena hands out one
    /// of its own slots if `spec` fits them.
    ///
    /// # Errors
    /// - [`TakeError::Invalid`] for a spec [`SlotSpec::validate`] refuses.
    /// - [`TakeError::NeverFits`]: packed, the slot is larger than the
    ///   whole arena (`field` "bytes"); fixed, the spec asks more than the
    ///   arena's slots have (`field` "capacity", "align" or "tail_room").
    /// - [`TakeError::Full`]: fewer bytes free than the slot needs (fixed:
    ///   every slot is out).
    /// - [`TakeError::Fragmented`]: packed, enough bytes free but no hole
    ///   holds the slot (the largest hole named).
    /// - [`TakeError::Forked`] in a forked child.
    pub fn take_sized(&self, spec: SlotSpec) -> std::result::Result<Slot, TakeError> {
        self.not_forked()?;
        let want = spec
            .slot_len()
            .map_err(|e| TakeError::Invalid { reason: e.to_string() })?;
        match &self.map.carve {
            Carve::Fixed { spec: own, .. } => {
                let short = [
                    ("capacity", spec.capacity, own.capacity),
                    ("align", spec.align, own.align),
                    ("tail_room", spec.tail_room.into(), own.tail_room.into()),
                ]
                .into_iter()
                .find(|&(_, need, have)| need > have);
                match short {
                    Some((field, need, have)) => Err(TakeError::NeverFits { field, need, have }),
                    None => self.take(),
                }
            }
            Carve::Packed { extents, .. } => {
                let (offset, len) = carve(extents, want)?;
                Ok(self.slot_at(offset, len, spec, false))
            }
        }
    }

    /// The smallest slot that holds `tensor` read in place: its payload's
    /// offset within an O_DIRECT block is known, so only that much scratch
    /// is reserved before it (`tensor.offset % align + tensor.len` bytes,
    /// rounded to the page, carved next fit). A fixed arena: one of its
    /// slots, if its capacity holds the payload.
    ///
    /// # Errors
    /// - [`TakeError::Invalid`] when the tensor's length (or its slot)
    ///   does not fit `usize`.
    /// - [`TakeError::NeverFits`]: packed, the slot is larger than the
    ///   whole arena; fixed, the payload exceeds the slots' capacity.
    /// - [`TakeError::Full`]: fewer bytes free than the slot needs (fixed:
    ///   every slot is out).
    /// - [`TakeError::Fragmented`]: packed, enough bytes free but no hole
    ///   holds the slot. Taking whole batches and returning the oldest
    ///   batch first never fragments an arena of
    ///   [`Arena::packed_bytes_for`] bytes.
    /// - [`TakeError::Forked`] in a forked child.
    pub fn take_for(&self, tensor: &crate::format::catalog::TensorRef) -> std::result::Result<Slot, TakeError> {
        self.not_forked()?;
        let align = match &self.map.carve {
            Carve::Fixed { spec, .. } => spec.align,
            Carve::Packed { align, .. } => *align,
        };
        let cap = usize::try_from(tensor.len).map_err(|_| TakeError::Invalid {
            reason: format!("tensor {}: {} bytes do not fit usize", tensor.name, tensor.len),
        })?;
        let spec = SlotSpec::new(cap).with_align(align);
        match &self.map.carve {
            Carve::Fixed { .. } => self.take_sized(spec),
            Carve::Packed { extents, .. } => {
                let want = in_place_bytes(tensor.offset, tensor.len, align).ok_or_else(|| TakeError::Invalid {
                    reason: format!(
                        "tensor {}: {} bytes after {} of scratch overflow usize",
                        tensor.name,
                        tensor.len,
                        tensor.offset % align as u64
                    ),
                })?;
                let (offset, len) = carve(extents, want)?;
                Ok(self.slot_at(offset, len, spec, false))
            }
        }
    }

    /// Bytes a packed arena needs so that a loop over batches never waits
    /// for room nor fragments: each step takes one slot per tensor it reads
    /// ([`Arena::take_for`]), and returns the oldest batch's slots once
    /// `in_flight` batches are out (2: double buffering, one batch computed
    /// from while the next loads). `batch` is the largest batch one step
    /// reads: every step's tensors must match one for one some of
    /// `batch`'s, each no longer than its match (for a mixture of experts:
    /// the top-k experts of the layer with the largest ones). File offsets
    /// do not matter: each tensor is counted at its worst phase (`align -
    /// 1` bytes of scratch before it). `align` is the arena's (the model's
    /// `required_align()`; [`Engine::packed_arena_for`](crate::Engine::packed_arena_for)
    /// passes it).
    ///
    /// The figure: with `B` the bytes of `batch`'s slots and `L` its
    /// largest slot (each rounded to the page `P`), `in_flight * B + (L -
    /// P)`, plus `min(L, 1 GiB) - P` per 1 GiB boundary inside the arena.
    /// Why it suffices: slots are carved next fit (each search starts where
    /// the last slot ended), so slots returned oldest batch first free the
    /// room just ahead of the search: the arena is a ring, and the only
    /// bytes it ever leaves unused are a skip of less than one slot where
    /// the ring wraps, and one before each 1 GiB boundary (no slot of at
    /// most 1 GiB crosses one: each gigabyte is registered as one buffer).
    /// When a slot of `n` bytes is taken, the slots out hold at most
    /// `in_flight * B - n` bytes, so with those skips counted the room
    /// ahead still holds it. The test `tests/packed_ring.rs` runs 10,000
    /// generated steps in such an arena without a refusal, and shows the
    /// figure is tight (one page less fails, as [`TakeError::Fragmented`]).
    ///
    /// A loop that returns slots in another order, or takes more than
    /// `batch` per step, can still fragment the arena; the refusal then
    /// says so, with its numbers.
    ///
    /// # Errors
    /// [`Error::Config`] when `batch` is empty, `in_flight` is 0, `align` is
    /// not a power of two of at least 512, or the figure overflows
    /// `isize::MAX`.
    pub fn packed_bytes_for(
        batch: &[&crate::format::catalog::TensorRef],
        in_flight: usize,
        align: usize,
    ) -> Result<usize> {
        SlotSpec::new(0).with_align(align).validate()?;
        if batch.is_empty() || in_flight == 0 {
            return Err(Error::Config(format!(
                "Arena::packed_bytes_for: a batch of {} tensors, {in_flight} batches in flight: both must be at least 1",
                batch.len()
            )));
        }
        let page = page_size();
        let too_large = || {
            Error::Config(format!(
                "Arena::packed_bytes_for: {in_flight} batches of {} tensors exceed isize::MAX bytes",
                batch.len()
            ))
        };
        let (mut total, mut largest) = (0usize, 0usize);
        for t in batch {
            let worst = usize::try_from(t.len)
                .ok()
                .and_then(|len| len.max(1).checked_add(align - 1))
                .and_then(|b| round_up(b, page))
                .ok_or_else(too_large)?;
            total = total.checked_add(worst).ok_or_else(too_large)?;
            largest = largest.max(worst);
        }
        ring_bytes(total, largest, in_flight, page, PIECE)
            .filter(|&b| b <= isize::MAX as usize)
            .ok_or_else(too_large)
    }

    /// A slot of a packed arena at exactly `[offset, offset + len)` (any
    /// offset and length: nothing is rounded), if that whole range is free.
    /// `exact` makes the payload land at the slot's first byte (no scratch
    /// before it: such a read goes buffered, counted); otherwise it lands
    /// `file offset % spec.align` bytes in, as in every other slot.
    pub(crate) fn take_at(&self, offset: usize, len: usize, spec: SlotSpec, exact: bool) -> Option<Slot> {
        if self.map.in_child() {
            return None;
        }
        let Carve::Packed { extents, .. } = &self.map.carve else {
            return None;
        };
        let (offset, len) = lock(extents).take_at(offset, len)?;
        Some(self.slot_at(offset, len, spec, exact))
    }

    /// A slot of a packed arena holding a payload at phase `pad` (its file
    /// offset % `spec.align`) read in place: the lowest free run of
    /// `want` bytes whose first byte is on a `spec.align`-aligned address
    /// (the window's block), wherever the memory starts. `None` when no
    /// free run holds it (or for a fixed arena, or in a forked child).
    pub(crate) fn take_window(&self, want: usize, spec: SlotSpec) -> Option<Slot> {
        if self.map.in_child() {
            return None;
        }
        let Carve::Packed { extents, .. } = &self.map.carve else {
            return None;
        };
        let base = self.map.region.ptr.as_ptr() as usize;
        let (offset, len) = lock(extents).take_aligned(want, spec.align, base)?;
        Some(self.slot_at(offset, len, spec, false))
    }

    /// Whether this arena carves slots of any size (packed or lent memory).
    pub(crate) fn is_packed(&self) -> bool {
        matches!(self.map.carve, Carve::Packed { .. })
    }

    /// [`TakeError::Forked`] in a forked child of the process that made
    /// the arena (nothing of it may be locked or handed out there).
    fn not_forked(&self) -> std::result::Result<(), TakeError> {
        if self.map.in_child() {
            return Err(TakeError::Forked {
                parent: self.map.origin.pid(),
                child: std::process::id(),
            });
        }
        Ok(())
    }

    /// The slot handle for `[offset, offset + len)` of this arena's
    /// mapping, which the caller has just taken from the free list or the
    /// extents (so nothing else holds it).
    fn slot_at(&self, offset: usize, len: usize, spec: SlotSpec, exact: bool) -> Slot {
        Slot {
            map: Arc::clone(&self.map),
            offset,
            len,
            spec,
            exact,
            inherited: None,
        }
    }

    /// Returns a slot; the same as dropping it. A slot of another arena is
    /// returned to its own arena.
    pub fn give_back(&self, slot: Slot) {
        drop(slot)
    }

    /// Base address and length of the whole mapping.
    pub fn region(&self) -> (*mut u8, usize) {
        (self.map.region.ptr.as_ptr(), self.map.region.len)
    }

    /// The pieces this arena is registered in (at most [`PIECE`] bytes each;
    /// a fixed arena's pieces hold whole slots), in order: piece k is fixed
    /// buffer `first + k`. `None` when a slot is larger than a piece.
    pub(crate) fn pieces(&self) -> Option<Vec<SlotRange>> {
        let total = self.map.region.len;
        let step = match &self.map.carve {
            Carve::Fixed { slot_len, .. } if *slot_len > PIECE => return None,
            Carve::Fixed { slot_len, .. } => (PIECE / slot_len) * slot_len,
            Carve::Packed { .. } => PIECE,
        };
        Some(
            (0..total)
                .step_by(step)
                .map(|off| SlotRange {
                    // SAFETY: `off < total`, the mapping's length (at most
                    // isize::MAX bytes): the offset stays inside it.
                    base: unsafe { self.map.region.ptr.add(off) },
                    len: step.min(total - off),
                })
                .collect(),
        )
    }

    /// Whether `fork()` leaves this arena out of a child
    /// (`madvise(MADV_DONTFORK)` succeeded). False when the kernel refused
    /// the advice (warned once), for caller memory, and under Miri. Slots
    /// handed over with [`Loaded::inherit_on_fork`](crate::Loaded::inherit_on_fork)
    /// are inherited while they are out, whatever this says.
    pub fn fork_protected(&self) -> bool {
        self.map.region.dontfork
    }

    /// Hands every page of the mapping to processes forked from now on
    /// (`MADV_DOFORK`, one call), and gives up this handle: memory no read
    /// writes any more, of which nothing is ever taken again (a load's own
    /// mapping once its last read has landed). Refused, with the handle
    /// dropped and nothing advised, when another handle is alive (it could
    /// take a slot and read into pages a child would share). A kernel
    /// refusal is counted and warned once ([`Stats::arena_inherit_failures`](crate::Stats::arena_inherit_failures)).
    ///
    /// The caller guarantees that no read into the mapping is in flight.
    pub(crate) fn inherit_all_on_fork(self) -> std::io::Result<()> {
        if self.map.handles.load(Ordering::Acquire) != 1 {
            return Err(std::io::Error::other("another handle of the arena is alive"));
        }
        let r = self.map.region.advise_fork(0, self.map.region.len, ForkAdvice::Inherit);
        if r.is_ok() {
            self.map.inherited.store(true, Ordering::Release);
        }
        r
    }

    /// Whether the kernel accepted `MADV_HUGEPAGE` for this arena (a mapping
    /// of at least 2 MiB, aligned to 2 MiB).
    pub fn huge_pages_advised(&self) -> bool {
        self.map.region.huge
    }

    /// Bytes of this arena backed by transparent huge pages right now
    /// (`AnonHugePages` of its range in `/proc/self/smaps`; `None` when that
    /// cannot be read). Not for hot paths: it reads and parses smaps.
    pub fn huge_page_bytes(&self) -> Option<u64> {
        let start = self.map.region.ptr.as_ptr() as usize;
        let smaps = std::fs::read_to_string("/proc/self/smaps").ok()?;
        let mut inside = false;
        let mut total = 0u64;
        for line in smaps.lines() {
            if let Some((range, _)) = line.split_once(' ') {
                if let Some((a, b)) = range.split_once('-') {
                    if let (Ok(a), Ok(b)) = (usize::from_str_radix(a, 16), usize::from_str_radix(b, 16)) {
                        inside = a < start + self.map.region.len && b > start;
                        continue;
                    }
                }
            }
            if inside {
                if let Some(kb) = line.strip_prefix("AnonHugePages:") {
                    total += kb.trim().trim_end_matches("kB").trim().parse::<u64>().ok()? * 1024;
                }
            }
        }
        Some(total)
    }

    /// Bytes of one slot of a fixed arena (0 for a packed one).
    pub fn slot_len(&self) -> usize {
        match &self.map.carve {
            Carve::Fixed { slot_len, .. } => *slot_len,
            Carve::Packed { .. } => 0,
        }
    }

    /// Runs `f` once, when the last handle and slot of this arena are gone.
    pub(crate) fn on_release(&self, f: impl FnOnce() + Send + 'static) {
        lock(&self.map.on_release).push(Box::new(f));
    }
}

/// `want` bytes of a packed arena's extents, or why not.
fn carve(extents: &Mutex<Extents>, want: usize) -> std::result::Result<(usize, usize), TakeError> {
    let mut e = lock(extents);
    e.take(want).ok_or_else(|| e.refusal(want))
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// The memory of one slot as a read sees it: a non-null base and a length.
/// It carries the address, never the right to touch the bytes: turning it
/// into a slice is `unsafe` ([`SlotRange::slice_mut`]), and is sound only
/// while the caller holds the slot's ownership (a request in flight owns
/// its slot until every chunk is reaped).
#[derive(Debug, Clone, Copy)]
pub(crate) struct SlotRange {
    base: NonNull<u8>,
    len: usize,
}

// SAFETY: a `SlotRange` is an address and a length; every access to the
// bytes goes through `SlotRange::slice_mut`, an `unsafe fn` whose caller
// guarantees the slot is alive and not otherwise accessed, whatever thread
// it runs on.
unsafe impl Send for SlotRange {}
// SAFETY: as above; `&SlotRange` exposes only the address and the length.
unsafe impl Sync for SlotRange {}

impl SlotRange {
    /// The base address as a pointer (for the kernel: buffer registration).
    pub(crate) fn as_ptr(&self) -> *mut u8 {
        self.base.as_ptr()
    }

    /// Bytes in the range.
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// The base address, for alignment arithmetic.
    pub(crate) fn addr(&self) -> usize {
        self.base.as_ptr() as usize
    }

    /// The pointer `off` bytes into the slot, where `len` bytes will land.
    /// Panics unless `[off, off + len)` lies inside the slot (planning
    /// guarantees it; this keeps a planning bug from becoming a wild write).
    pub(crate) fn at(&self, off: usize, len: usize) -> NonNull<u8> {
        assert!(
            off.checked_add(len).is_some_and(|end| end <= self.len),
            "a chunk [{off}, +{len}) outside its slot of {} bytes",
            self.len
        );
        // SAFETY: `off <= len` of the slot (checked above), so the offset
        // stays inside (or one past) the slot's memory, one allocation.
        unsafe { self.base.add(off) }
    }

    /// `len` bytes of the slot from `off`, writable.
    ///
    /// # Safety
    /// The slot must be alive (its arena mapping not released) and no other
    /// reference to these bytes may be used while the slice lives: the
    /// caller owns the slot (e.g. the request in flight that holds it), and
    /// no other chunk of it overlaps `[off, off + len)`.
    pub(crate) unsafe fn slice_mut<'a>(&self, off: usize, len: usize) -> &'a mut [u8] {
        let p = self.at(off, len);
        // SAFETY: in bounds (`at` checked it); alive and unaliased by the
        // caller's obligation above.
        unsafe { std::slice::from_raw_parts_mut(p.as_ptr(), len) }
    }
}

/// One slot of an arena: exclusive access to its bytes until it is dropped
/// (or handed back), when they return to the arena.
pub struct Slot {
    map: Arc<Mapping>,
    /// Where the slot starts in the mapping, and its bytes.
    offset: usize,
    len: usize,
    spec: SlotSpec,
    /// The payload lands at the slot's first byte (no scratch before it).
    exact: bool,
    /// The pages handed to forked children ([`Slot::inherit_on_fork`]):
    /// `MADV_DOFORK`, the slot's bytes rounded out to whole pages. Made
    /// fork-protected again before the slot is read into
    /// ([`Slot::protect_for_read`]) or goes back to its arena.
    inherited: Option<Inherited>,
}

/// A slot's pages handed to forked children: the page range advised, and
/// the free bytes around the slot that share its first and last page,
/// claimed from the arena meanwhile (no other slot may be carved there
/// and read into while a child would share the page).
#[derive(Debug)]
struct Inherited {
    pages: std::ops::Range<usize>,
    fringe: [Option<usize>; 2],
}

impl std::fmt::Debug for Slot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Slot")
            .field("offset", &self.offset)
            .field("len", &self.len)
            .field("base", &self.base())
            .finish()
    }
}

impl Slot {
    /// Position of this slot in its arena: its index in a fixed arena, its
    /// page number in a packed one.
    pub fn index(&self) -> usize {
        match &self.map.carve {
            Carve::Fixed { slot_len, .. } => self.offset / slot_len,
            Carve::Packed { .. } => self.offset / page_size(),
        }
    }

    /// Byte offset of the slot's base in its arena.
    pub fn offset(&self) -> usize {
        self.offset
    }

    /// The shape of the slot.
    pub fn spec(&self) -> SlotSpec {
        self.spec
    }

    /// Payload capacity.
    pub fn capacity(&self) -> usize {
        self.spec.capacity
    }

    /// Bytes in the slot (scratch + payload + tail room, page-rounded).
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the slot has no bytes (never, for a slot of an arena).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Whether the payload lands at the slot's first byte (a slot placed by
    /// `Engine::read_into` where no scratch fits before the payload).
    pub(crate) fn exact(&self) -> bool {
        self.exact
    }

    /// Address of the slot base (where the aligned window starts).
    pub fn base(&self) -> *const u8 {
        self.base_mut_ptr()
    }

    pub(crate) fn base_mut_ptr(&self) -> *mut u8 {
        // SAFETY: `offset + len <= region.len` (the carving hands out only
        // ranges inside the mapping, itself at most isize::MAX bytes), so
        // the offset stays inside it.
        unsafe { self.map.region.ptr.as_ptr().add(self.offset) }
    }

    /// The whole slot, scratch included.
    pub fn as_bytes(&self) -> &[u8] {
        self.assert_mapped();
        // SAFETY: this byte range is held only by `self` (see `Mapping`), the
        // range is inside the live mapping, and `&self` excludes writers.
        unsafe { std::slice::from_raw_parts(self.base(), self.len) }
    }

    /// The whole slot, scratch included, writable.
    pub fn as_bytes_mut(&mut self) -> &mut [u8] {
        self.assert_mapped();
        // SAFETY: as `as_bytes`, and `&mut self` makes the access exclusive.
        unsafe { std::slice::from_raw_parts_mut(self.base_mut_ptr(), self.len) }
    }

    /// Lets processes forked from now on inherit this slot's pages, as
    /// ordinary copy-on-write memory: `MADV_DOFORK` on its bytes rounded
    /// out to whole pages. A slot carved by the arena is whole pages; one
    /// placed at an exact offset (`take_at`: a caller's offset, a slice)
    /// may share its first or last page with bytes around it, which are
    /// then claimed from the arena while the slot is inherited, so that no
    /// other slot is carved there and read into while a child would share
    /// the page. Only for a slot whose read has completed: no read writes
    /// it any more. Nothing to do for caller memory (never advised here)
    /// or a mapping the kernel would not protect in the first place.
    ///
    /// # Errors
    /// [`Error::Forked`] in a forked child; [`Error::ForkAdvice`] when a
    /// page of the slot holds bytes of another slot in use, or the kernel
    /// refuses the advice (both counted and warned once).
    pub(crate) fn inherit_on_fork(&mut self) -> Result<()> {
        let region = &self.map.region;
        if self.inherited.is_some() || region.borrowed || !region.dontfork || self.map.inherited.load(Ordering::Acquire)
        {
            return Ok(());
        }
        self.map.origin.check()?;
        let page = page_size();
        let end = self.offset + self.len.max(1);
        let pages = self.offset / page * page..end.next_multiple_of(page).min(region.len);
        let refused = |source: std::io::Error| Error::ForkAdvice {
            advice: "MADV_DOFORK",
            bytes: self.len,
            source,
        };
        let fringe = self
            .claim_fringe(&pages)
            .map_err(|why| refused(region.refuse_fork_advice(why)))?;
        if let Err(e) = region.advise_fork(pages.start, pages.len(), ForkAdvice::Inherit) {
            self.give_back_fringe(fringe);
            return Err(refused(e));
        }
        self.inherited = Some(Inherited { pages, fringe });
        Ok(())
    }

    /// Claims the free bytes of `pages` outside the slot (its first and
    /// last page's other bytes), or says why not: another slot holds some.
    fn claim_fringe(&self, pages: &std::ops::Range<usize>) -> std::result::Result<[Option<usize>; 2], String> {
        let end = self.offset + self.len.max(1);
        if pages.start == self.offset && pages.end <= end {
            return Ok([None, None]);
        }
        let Carve::Packed { extents, .. } = &self.map.carve else {
            // A fixed arena's slots are whole pages.
            return Ok([None, None]);
        };
        let mut e = lock(extents);
        let before = (pages.start < self.offset).then(|| (pages.start, self.offset - pages.start));
        let after = (end < pages.end).then(|| (end, pages.end - end));
        let mut got = [None, None];
        for (k, part) in [before, after].into_iter().enumerate() {
            let Some((at, n)) = part else { continue };
            match e.take_at(at, n) {
                Some(_) => got[k] = Some(at),
                None => {
                    for at in got.into_iter().flatten() {
                        e.give_back(at);
                    }
                    return Err(format!(
                        "bytes [{at}, {}) of its {} page hold another slot in use",
                        at + n,
                        if k == 0 { "first" } else { "last" }
                    ));
                }
            }
        }
        Ok(got)
    }

    fn give_back_fringe(&self, fringe: [Option<usize>; 2]) {
        if let Carve::Packed { extents, .. } = &self.map.carve {
            let mut e = lock(extents);
            for at in fringe.into_iter().flatten() {
                e.give_back(at);
            }
        }
    }

    /// Whether this slot's memory is kept from forked children at all
    /// (the crate's own mapping, whose `MADV_DONTFORK` succeeded).
    pub(crate) fn fork_protected(&self) -> bool {
        self.map.region.dontfork && !self.map.region.borrowed
    }

    /// Whether this slot's pages are handed to forked children now.
    pub(crate) fn inherited(&self) -> bool {
        self.inherited.is_some() || self.map.inherited.load(Ordering::Acquire)
    }

    /// Protects the inherited pages again and gives the claimed fringe
    /// back; `false` (the pages still inherited, the fringe kept) when the
    /// kernel refuses (counted and warned once).
    fn protect(&mut self) -> std::io::Result<()> {
        let Some(inh) = self.inherited.take() else {
            return Ok(());
        };
        if let Err(e) = self
            .map
            .region
            .advise_fork(inh.pages.start, inh.pages.len(), ForkAdvice::Protect)
        {
            self.inherited = Some(inh);
            return Err(e);
        }
        self.give_back_fringe(inh.fringe);
        Ok(())
    }

    /// Makes an inherited slot fork-protected again before a read lands in
    /// it: memory the kernel may write is never shared with a child.
    ///
    /// # Errors
    /// [`Error::ForkAdvice`] when the kernel refuses (counted and warned
    /// once); the slot must then not be read into.
    pub(crate) fn protect_for_read(&mut self) -> Result<()> {
        if self.map.inherited.load(Ordering::Acquire) {
            // Never: such a mapping has no handle left to take a slot with.
            return Err(Error::Config(
                "a slot of a mapping handed to forked children cannot be read into again".into(),
            ));
        }
        self.protect().map_err(|source| Error::ForkAdvice {
            advice: "MADV_DONTFORK",
            bytes: self.len,
            source,
        })
    }

    /// A clear panic instead of a segmentation fault: a slot of a parent's
    /// arena touched in a forked child (its pages are `MADV_DONTFORK`).
    fn assert_mapped(&self) {
        if self.inherited.is_none() && self.map.unmapped_here() {
            panic!(
                "a weightstream slot was touched in a forked child: arenas are MADV_DONTFORK, their pages exist only in the parent"
            );
        }
    }

    /// The slot's memory as a read sees it (address and length).
    pub(crate) fn range(&self) -> SlotRange {
        SlotRange {
            base: NonNull::new(self.base_mut_ptr()).expect("a slot of a mapping is never null"),
            len: self.len,
        }
    }

    /// The registered piece this slot lies in (its fixed buffer is the
    /// arena's first plus this), or `None` when it spans two (a slot placed
    /// by the caller across a piece boundary).
    pub(crate) fn piece(&self) -> Option<usize> {
        let step = match &self.map.carve {
            Carve::Fixed { slot_len, .. } if *slot_len > PIECE => return None,
            Carve::Fixed { slot_len, .. } => (PIECE / slot_len) * slot_len,
            Carve::Packed { .. } => PIECE,
        };
        let last = self.offset + self.len.max(1) - 1;
        (self.offset / step == last / step).then_some(self.offset / step)
    }

    /// Identity of the arena this slot belongs to (unique in the process).
    pub fn arena_id(&self) -> u64 {
        self.map.id
    }

    /// Whether an engine asked to register this slot's arena
    /// ([`Arena::mark_register_asked`]).
    pub(crate) fn register_asked(&self) -> bool {
        self.map.register_asked.load(Ordering::Relaxed)
    }

    /// The NUMA node of this slot's arena (see [`Arena::node`]).
    pub fn node(&self) -> Option<usize> {
        self.map.node
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        if self.map.origin.forked() {
            // A child: a parent thread may have held the free list's lock
            // at fork time (and the memory may not be mapped here). Touch
            // nothing; the child's copy of the slot is leaked.
            return;
        }
        // Pages handed to children are protected again before anyone can
        // take them for a read; with no handle left nobody can, and the
        // mapping goes with its last slot. A refusal keeps the extent out
        // of use (counted and warned once) rather than free to be read
        // into while a child would share it.
        if self.inherited.is_some() && self.map.handles.load(Ordering::Acquire) > 0 && self.protect().is_err() {
            return;
        }
        // With no handle left, the fringe (if any) goes back with the slot
        // (nothing can be carved from the arena any more).
        if let Some(inh) = self.inherited.take() {
            self.give_back_fringe(inh.fringe);
        }
        if self.map.discard_freed.load(Ordering::Acquire) {
            // SAFETY: the slot is going: nobody reads or writes its bytes
            // (a read into it was reaped before its ticket let it go), its
            // extent is not free yet (that is next), and the arena is never
            // registered (`discard_freed_pages`). Only whole pages inside
            // the slot are dropped: a page it shares keeps its bytes. A
            // refusal leaves good memory resident; nothing to undo.
            let _ = unsafe { self.map.region.discard_pages(self.offset, self.len) };
        }
        match &self.map.carve {
            Carve::Fixed { slot_len, free, .. } => lock(free).push(self.offset / slot_len),
            Carve::Packed { extents, .. } => {
                lock(extents).give_back(self.offset);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_up_is_checked() {
        assert_eq!(round_up(0, 4096), Some(0));
        assert_eq!(round_up(1, 4096), Some(4096));
        assert_eq!(round_up(4096, 4096), Some(4096));
        assert_eq!(round_up(usize::MAX - 4095, 4096), Some(usize::MAX - 4095));
        // Used to wrap to 0 in release builds (and panic in debug).
        assert_eq!(round_up(usize::MAX - 4094, 4096), None);
        assert_eq!(round_up(usize::MAX, 2), None);
        assert_eq!(round_up(5, 1 << (usize::BITS - 1)), Some(1 << (usize::BITS - 1)));
        assert_eq!(round_up(5, 3), None);
        assert_eq!(round_up(5, 0), None);
    }

    #[test]
    fn slots_are_page_aligned_distinct_and_returned() {
        let a = Arena::new(SlotSpec::new(10_000), 3).unwrap();
        assert_eq!(a.slot_len(), 16384);
        let s1 = a.take().unwrap();
        let s2 = a.take().unwrap();
        let s3 = a.take().unwrap();
        assert_eq!(
            a.take().unwrap_err(),
            TakeError::Full {
                need: 16384,
                free: 0,
                bytes: 3 * 16384
            }
        );
        for s in [&s1, &s2, &s3] {
            assert_eq!(s.base() as usize % page_size(), 0);
        }
        assert_ne!(s1.base(), s2.base());
        a.give_back(s2);
        drop(s1);
        assert_eq!(a.available(), 2);
        drop(s3);
        assert_eq!(a.available(), 3);
    }

    /// With `discard_freed_pages`, a slot that comes back leaves no
    /// resident page behind: taken again, its bytes read as zeros (a fresh
    /// page), where without it they keep what was written. Refused for an
    /// arena an engine asked to register.
    #[test]
    fn freed_pages_are_discarded_when_asked() {
        for discard in [false, true] {
            let a = Arena::new(SlotSpec::new(3 * page_size()), 1).unwrap();
            if discard {
                a.discard_freed_pages().unwrap();
            }
            let mut s = a.take().unwrap();
            s.as_bytes_mut().fill(0xAB);
            drop(s);
            let s = a.take().unwrap();
            let want = if discard { 0 } else { 0xAB };
            assert!(s.as_bytes().iter().all(|&b| b == want), "discard {discard}");
        }
        let p = Arena::packed(1 << 20, 4096, false).unwrap();
        assert!(p.mark_register_asked());
        assert!(p.discard_freed_pages().is_err());
        let q = Arena::packed(1 << 20, 4096, false).unwrap();
        q.discard_freed_pages().unwrap();
        assert!(!q.mark_register_asked(), "never registered");
        assert!(
            !q.map.register_asked.load(Ordering::SeqCst),
            "and its plain reads are no fallback"
        );
    }

    #[test]
    fn tail_room_and_align_sizes() {
        assert_eq!(SlotSpec::new(4096).slot_len().unwrap(), 8192);
        assert_eq!(SlotSpec::new(4097).slot_len().unwrap(), 12288);
        assert_eq!(SlotSpec::new(4097).with_tail_room(true).slot_len().unwrap(), 12288);
        assert_eq!(SlotSpec::new(8192).with_tail_room(true).slot_len().unwrap(), 12288);
        assert!(Arena::new(SlotSpec::new(1).with_align(1000), 1).is_err());
        assert!(Arena::new(SlotSpec::new(1), 0).is_err());
    }

    #[test]
    fn bound_arena_runs_the_hook_before_touching_and_remembers_its_node() {
        let mut seen = 0;
        let a = Arena::new_on_node(SlotSpec::new(10_000), 2, 3, |area| {
            seen = area.len();
            Ok(())
        })
        .unwrap();
        assert_eq!(seen, 2 * 16384);
        assert_eq!(a.node(), Some(3));
        assert_eq!(a.take().unwrap().node(), Some(3));
        assert_eq!(Arena::new(SlotSpec::new(1), 1).unwrap().node(), None);
        let e = Arena::new_on_node(SlotSpec::new(1), 1, 9, |_| Err("no node 9".into())).unwrap_err();
        assert!(e.to_string().contains("no node 9"), "{e}");
    }

    #[test]
    fn mapping_outlives_the_arena_handle() {
        let a = Arena::new(SlotSpec::new(100), 1).unwrap();
        let mut s = a.take().unwrap();
        drop(a);
        s.as_bytes_mut()[0] = 7;
        assert_eq!(s.as_bytes()[0], 7);
    }

    /// Capacities near the top of `usize` and `isize`: the slot length is
    /// an error naming the capacity, never a wrapped small number (a
    /// release build used to report 4096 bytes for `usize::MAX - 100`).
    #[test]
    fn slot_len_overflow_is_an_error() {
        let imax = isize::MAX as usize;
        let page = page_size();
        for spec in [
            SlotSpec::new(usize::MAX - 100),
            SlotSpec::new(usize::MAX - 4095),
            SlotSpec::new(usize::MAX - 4096),
            SlotSpec::new(usize::MAX - 10).with_tail_room(true),
            SlotSpec::new(imax),
            SlotSpec::new(imax + 1),
            SlotSpec::new(imax - page + 2),
            SlotSpec::new(1).with_align(1 << (usize::BITS - 1)),
        ] {
            let e = spec.slot_len().expect_err(&format!("{spec:?}"));
            assert!(e.to_string().contains(&spec.capacity.to_string()), "{e}");
            assert!(spec.validate().is_err());
            assert!(Arena::new(spec, 1).is_err(), "{spec:?}");
        }
        // The largest capacity whose slot still fits isize::MAX bytes.
        let top = imax - page + 1 - 4096;
        assert_eq!(SlotSpec::new(top).slot_len().unwrap(), imax - page + 1);
        // Two such slots do not.
        let e = map(SlotSpec::new(top), 2, false)
            .err()
            .expect("2 slots past isize::MAX");
        assert!(e.to_string().contains("isize::MAX"), "{e}");
    }

    #[test]
    fn accepted_slots_hold_scratch_and_capacity() {
        for (cap, align, room) in [
            (1, 512, false),
            (4095, 4096, true),
            (100_000, 65536, true),
            (1 << 20, 4096, false),
        ] {
            let spec = SlotSpec::new(cap).with_align(align).with_tail_room(room);
            let len = spec.slot_len().unwrap();
            let body = if room { cap.div_ceil(align) * align } else { cap };
            assert!(len >= align + body, "{spec:?}: {len}");
            assert_eq!(len % page_size().max(align), 0);
        }
    }

    /// The release hooks run once, after the last handle and the last slot
    /// are gone (whichever goes last), and the memory stays usable until then.
    #[test]
    fn release_hooks_run_once_when_the_last_slot_goes() {
        use std::sync::atomic::AtomicUsize;
        let runs = Arc::new(AtomicUsize::new(0));
        let a = Arena::new(SlotSpec::new(100), 2).unwrap();
        for _ in 0..2 {
            let r = Arc::clone(&runs);
            a.on_release(move || {
                r.fetch_add(1, Ordering::SeqCst);
            });
        }
        let mut s1 = a.take().unwrap();
        let mut s2 = a.take().unwrap();
        s1.as_bytes_mut().fill(1);
        s2.as_bytes_mut().fill(2);
        let b = a.clone();
        drop(a);
        drop(b);
        assert_eq!(runs.load(Ordering::SeqCst), 0, "slots still out");
        assert!(s1.as_bytes().iter().all(|&x| x == 1));
        drop(s1);
        assert_eq!(runs.load(Ordering::SeqCst), 0, "one slot still out");
        assert!(s2.as_bytes().iter().all(|&x| x == 2), "slots do not overlap");
        drop(s2);
        assert_eq!(runs.load(Ordering::SeqCst), 2);
    }

    /// Slots of one arena are disjoint, each exactly `slot_len` bytes, and
    /// a returned slot comes back with its bytes (no zeroing, no aliasing).
    #[test]
    fn slots_are_disjoint_and_writable_end_to_end() {
        let a = Arena::new(SlotSpec::new(5000).with_tail_room(true), 3).unwrap();
        let mut slots: Vec<Slot> = std::iter::from_fn(|| a.take().ok()).collect();
        assert_eq!(slots.len(), 3);
        for (i, s) in slots.iter_mut().enumerate() {
            let b = s.as_bytes_mut();
            assert_eq!(b.len(), a.slot_len());
            b[0] = i as u8;
            let last = b.len() - 1;
            b[last] = 0x80 | i as u8;
        }
        for (i, s) in slots.iter().enumerate() {
            let b = s.as_bytes();
            assert_eq!((b[0], b[b.len() - 1]), (i as u8, 0x80 | i as u8));
            assert_eq!(s.base() as usize - a.region().0 as usize, s.index() * a.slot_len());
        }
        let s = slots.pop().unwrap();
        let idx = s.index();
        drop(s);
        let again = a.take().unwrap();
        assert_eq!(again.index(), idx);
        assert_eq!(again.as_bytes()[0], idx as u8);
    }

    /// Arenas of 2 MiB or more start on a huge page and are advised for
    /// transparent huge pages before they are populated.
    #[cfg(not(miri))]
    #[test]
    fn large_arenas_are_huge_page_aligned_and_backed_where_the_kernel_allows() {
        let a = Arena::new(SlotSpec::new(3 << 20), 3).unwrap();
        let (base, len) = a.region();
        assert_eq!(base as usize % (2 << 20), 0, "not 2 MiB aligned");
        assert!(len >= 9 << 20);
        assert!(a.huge_pages_advised());
        let thp = std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/enabled").unwrap_or_default();
        if thp.contains("[always]") || thp.contains("[madvise]") {
            // Populated after the advice: at least one huge page (the
            // kernel may fall back to small pages under fragmentation, so
            // not all of them).
            let huge = a.huge_page_bytes().expect("smaps");
            assert!(
                huge >= 2 << 20,
                "no huge page backs the arena ({huge} bytes; THP: {thp})"
            );
        }
        // Small arenas stay on small pages, page-aligned.
        let small = Arena::new(SlotSpec::new(10_000), 2).unwrap();
        assert!(!small.huge_pages_advised());
        assert_eq!(small.region().0 as usize % page_size(), 0);
    }

    /// Every arena mapping carries VM_DONTCOPY (`dc` in /proc/self/smaps):
    /// fork() does not copy it into a child.
    #[cfg(not(miri))]
    #[test]
    fn arena_mappings_are_not_copied_on_fork() {
        for a in [
            Arena::new(SlotSpec::new(10_000), 3).unwrap(),
            Arena::new_on_node(SlotSpec::new(10_000), 2, 0, |_| Ok(())).unwrap(),
        ] {
            assert!(a.fork_protected());
            let (base, len) = a.region();
            let flags = vm_flags_of(base as usize, len).expect("the arena is in /proc/self/smaps");
            assert!(
                flags.split_whitespace().any(|f| f == "dc"),
                "arena [{base:p}, +{len}) lacks VM_DONTCOPY: VmFlags: {flags}"
            );
        }
        assert_eq!(crate::memory::region::dontfork_failures(), 0);
    }

    /// The VmFlags of the /proc/self/smaps entry that holds `[base, base + len)`.
    #[cfg(not(miri))]
    fn vm_flags_of(base: usize, len: usize) -> Option<String> {
        let smaps = std::fs::read_to_string("/proc/self/smaps").ok()?;
        let mut inside = false;
        for line in smaps.lines() {
            let first = line.split_whitespace().next().unwrap_or("");
            if let Some((lo, hi)) = first.split_once('-') {
                if let (Ok(lo), Ok(hi)) = (usize::from_str_radix(lo, 16), usize::from_str_radix(hi, 16)) {
                    inside = lo <= base && base + len <= hi;
                    continue;
                }
            }
            if inside {
                if let Some(flags) = line.strip_prefix("VmFlags:") {
                    return Some(flags.trim().to_string());
                }
            }
        }
        None
    }
}
