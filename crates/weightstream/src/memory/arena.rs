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
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use crate::error::{Error, Result};

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

/// Rounds `x` up to a multiple of `align`; `None` when `align` is not a
/// power of two or the result does not fit `usize`.
pub fn round_up(x: usize, align: usize) -> Option<usize> {
    if !align.is_power_of_two() {
        return None;
    }
    x.checked_add(align - 1).map(|v| v & !(align - 1))
}

static NEXT_ARENA_ID: AtomicU64 = AtomicU64::new(1);

pub(crate) fn page_size() -> usize {
    rustix::param::page_size()
}

struct Mapping {
    /// Unique for the process lifetime: registrations are keyed by it, never
    /// by address (a new arena may be mapped where a dropped one was).
    id: u64,
    region: Region,
    spec: SlotSpec,
    slot_len: usize,
    count: usize,
    /// The NUMA node the pages are bound to (`None`: wherever first touch
    /// put them).
    node: Option<usize>,
    free: Mutex<Vec<usize>>,
    /// Run when the mapping goes (no slot or arena handle left): engines
    /// unregister the arena's fixed buffers here.
    on_release: Mutex<Vec<ReleaseHook>>,
    /// The process that mapped it: in a forked child a `MADV_DONTFORK`
    /// region is not mapped at all.
    origin: crate::fork::Origin,
}

impl Mapping {
    /// Whether this mapping's pages are absent here (a forked child).
    fn unmapped_here(&self) -> bool {
        self.region.dontfork && self.origin.forked()
    }
}

type ReleaseHook = Box<dyn FnOnce() + Send>;

// SAFETY: the mapping is plain memory owned by this struct; every byte of it
// is reached only through a `Slot`, and each slot index is held by at most
// one `Slot` at a time (the free list hands an index out once), so sharing
// the mapping across threads never aliases a mutable byte.
unsafe impl Send for Mapping {}
// SAFETY: as above; `&Mapping` only exposes the free list (a Mutex) and
// read-only geometry.
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

/// The memory of one arena: an anonymous private mapping, `MADV_DONTFORK`
/// (under Miri: a page-aligned, zeroed heap allocation). Released on drop.
struct Region {
    ptr: NonNull<u8>,
    len: usize,
    /// `madvise(MADV_DONTFORK)` succeeded: a forked child does not get these
    /// pages. Always false under Miri (no mapping, no fork).
    dontfork: bool,
    /// `madvise(MADV_HUGEPAGE)` succeeded on a 2 MiB-aligned region: the
    /// kernel backs it with transparent huge pages where it can.
    huge: bool,
    /// What the memory was allocated with (Miri only).
    #[cfg(miri)]
    layout: std::alloc::Layout,
}

/// A transparent huge page (x86-64, arm64 with 4 KiB base pages).
#[cfg(not(miri))]
const HUGE_PAGE: usize = 2 << 20;

static HUGEPAGE_REFUSALS: AtomicU64 = AtomicU64::new(0);
static HUGEPAGE_WARNED: AtomicBool = AtomicBool::new(false);

/// Arena mappings of at least 2 MiB whose `madvise(MADV_HUGEPAGE)` the
/// kernel refused (they use 4 KiB pages; warned once). A kernel with
/// transparent huge pages `never` accepts the advice and ignores it: see
/// [`Arena::huge_page_bytes`] for what an arena really got.
pub fn hugepage_refusals() -> u64 {
    HUGEPAGE_REFUSALS.load(Ordering::Relaxed)
}

/// Mappings whose `madvise(MADV_DONTFORK)` failed, in this process.
static DONTFORK_FAILURES: AtomicU64 = AtomicU64::new(0);
static DONTFORK_WARNED: AtomicBool = AtomicBool::new(false);

/// How many arena mappings of this process `fork()` would copy into a child
/// because `madvise(MADV_DONTFORK)` failed on them (warned once, at the
/// first). 0 when every arena is fork-protected.
pub fn dontfork_failures() -> u64 {
    DONTFORK_FAILURES.load(Ordering::Relaxed)
}

impl Region {
    /// `len` bytes (> 0, <= `isize::MAX`), readable and writable, starting
    /// on a page boundary (on a 2 MiB boundary, advised for transparent huge
    /// pages, when `len` is at least 2 MiB). `populate` faults every page in
    /// now.
    ///
    /// Huge pages matter for I/O: a read into physically contiguous memory
    /// is one segment per 2 MiB instead of one per 4 KiB page, and a device
    /// caps the segments of a request (virtio-blk: 254, so a 1 MiB read into
    /// 4 KiB pages is split in two); registering them pins fewer pages.
    #[cfg(not(miri))]
    fn new(len: usize, populate: bool) -> Result<Region> {
        use rustix::mm::{Advice, MapFlags, ProtFlags};
        let huge = len >= HUGE_PAGE;
        // Room to align the start to a huge page, trimmed off below.
        let map_len = if huge { len.checked_add(HUGE_PAGE) } else { Some(len) }
            .filter(|&l| l <= isize::MAX as usize)
            .ok_or_else(|| Error::Config(format!("an arena of {len} bytes exceeds isize::MAX")))?;
        // SAFETY: a fresh anonymous private mapping at an address of the
        // kernel's choosing aliases no existing memory.
        let raw = unsafe {
            rustix::mm::mmap_anonymous(
                std::ptr::null_mut(),
                map_len,
                ProtFlags::READ | ProtFlags::WRITE,
                MapFlags::PRIVATE,
            )
        }
        .map_err(|e| Error::io("<anonymous arena>", "mmap", e))?;
        let base = raw as usize;
        let start = if huge { base.next_multiple_of(HUGE_PAGE) } else { base };
        if huge {
            let (head, tail) = (start - base, map_len - len - (start - base));
            // SAFETY: both ranges are the unused ends of the mapping just
            // made (before `start`, after `start + len`); nothing refers to
            // them. Unmapping them leaves exactly `start..start + len`.
            unsafe {
                if head > 0 {
                    let _ = rustix::mm::munmap(raw, head);
                }
                if tail > 0 {
                    let _ = rustix::mm::munmap((start + len) as *mut std::ffi::c_void, tail);
                }
            }
        }
        let Some(ptr) = NonNull::new(start as *mut u8) else {
            return Err(Error::Config(format!("mmap of {len} bytes returned a null address")));
        };
        let mut region = Region {
            ptr,
            len,
            dontfork: false,
            huge: false,
        };
        // SAFETY: `ptr..ptr+len` is exactly the mapping owned by `region`;
        // MADV_DONTFORK changes only whether fork() copies it, never its
        // contents or its address.
        match unsafe { rustix::mm::madvise(ptr.as_ptr().cast(), len, Advice::LinuxDontFork) } {
            Ok(()) => region.dontfork = true,
            Err(e) => {
                DONTFORK_FAILURES.fetch_add(1, Ordering::Relaxed);
                if !DONTFORK_WARNED.swap(true, Ordering::Relaxed) {
                    tracing::warn!(
                        "madvise(MADV_DONTFORK) on an arena of {len} bytes failed: {e}; fork() will copy this arena \
                         into the child (said once; counted in weightstream::arena::dontfork_failures)"
                    );
                }
            }
        }
        if huge {
            // SAFETY: as above; MADV_HUGEPAGE changes only how the kernel
            // backs the (still untouched) pages.
            match unsafe { rustix::mm::madvise(ptr.as_ptr().cast(), len, Advice::LinuxHugepage) } {
                Ok(()) => region.huge = true,
                Err(e) => {
                    HUGEPAGE_REFUSALS.fetch_add(1, Ordering::Relaxed);
                    if !HUGEPAGE_WARNED.swap(true, Ordering::Relaxed) {
                        tracing::warn!(
                            "madvise(MADV_HUGEPAGE) on an arena of {len} bytes failed: {e}; it uses 4 KiB pages \
                             (more segments per read; said once; counted in weightstream::arena::hugepage_refusals)"
                        );
                    }
                }
            }
        }
        if populate {
            region.touch();
        }
        Ok(region)
    }

    /// Faults every page in (after any advice or NUMA policy is set, so
    /// each page is allocated under it).
    fn touch(&self) {
        for off in (0..self.len).step_by(page_size()) {
            // SAFETY: `off < len`, inside the mapping; no slot exists yet, so
            // this write aliases nothing. Volatile so the first touch happens.
            unsafe { std::ptr::write_volatile(self.ptr.as_ptr().add(off), 0) };
        }
    }

    /// Miri cannot model mmap or madvise: the same geometry from the global
    /// allocator, page-aligned and zeroed like a fresh anonymous mapping.
    #[cfg(miri)]
    fn new(len: usize, _populate: bool) -> Result<Region> {
        let layout = std::alloc::Layout::from_size_align(len, page_size())
            .map_err(|e| Error::Config(format!("an arena of {len} bytes: {e}")))?;
        // SAFETY: the layout's size is non-zero (`len` > 0, checked by `map`).
        let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
        let Some(ptr) = NonNull::new(ptr) else {
            return Err(Error::Config(format!("allocating an arena of {len} bytes failed")));
        };
        Ok(Region {
            ptr,
            len,
            dontfork: false,
            huge: false,
            layout,
        })
    }
}

impl Drop for Region {
    fn drop(&mut self) {
        #[cfg(not(miri))]
        {
            // SAFETY: `ptr`/`len` are exactly the mapping made by
            // `Region::new`, and no `Slot` exists any more (each holds an
            // `Arc<Mapping>`, which owns this region), so nothing can reach
            // the memory after this.
            let _ = unsafe { rustix::mm::munmap(self.ptr.as_ptr().cast(), self.len) };
        }
        #[cfg(miri)]
        {
            // SAFETY: allocated by `Region::new` with this same layout; no
            // `Slot` exists any more (as above).
            unsafe { std::alloc::dealloc(self.ptr.as_ptr(), self.layout) };
        }
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
    Ok((Region::new(len, populate)?, slot_len))
}

/// A set of equally sized, page-aligned slots in one anonymous mapping.
///
/// A forked child cannot touch an arena: its pages are not mapped in the
/// child (`MADV_DONTFORK`, so `fork()` neither copies them nor lets a child
/// reach memory the kernel may be writing for the parent). Touching a slot
/// in a child faults. If the kernel refuses the advice the arena still
/// works, but is copied on fork: warned once, and visible in
/// [`Arena::fork_protected`] and [`dontfork_failures`].
#[derive(Clone)]
pub struct Arena {
    map: Arc<Mapping>,
}

impl std::fmt::Debug for Arena {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Arena")
            .field("spec", &self.map.spec)
            .field("slots", &self.map.count)
            .field("free", &self.available())
            .finish()
    }
}

impl Arena {
    /// Maps `count` slots of `spec`, faulted in up front so the first read
    /// does not pay page faults.
    pub fn new(spec: SlotSpec, count: usize) -> Result<Self> {
        let (region, slot_len) = map(spec, count, true)?;
        Ok(Arena::from_mapping(region, spec, slot_len, count, None))
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
        let arena = Arena::from_mapping(region, spec, slot_len, count, Some(node));
        // SAFETY: `ptr..ptr+len` is the fresh mapping just made, readable and
        // writable; no slot has been handed out, so nothing else reaches it.
        // An untouched anonymous page reads as zeros.
        let area = unsafe { std::slice::from_raw_parts(ptr.as_ptr(), len) };
        bind(area).map_err(|e| Error::Config(format!("binding an arena of {len} bytes to NUMA node {node}: {e}")))?;
        arena.map.region.touch();
        Ok(arena)
    }

    fn from_mapping(region: Region, spec: SlotSpec, slot_len: usize, count: usize, node: Option<usize>) -> Self {
        Arena {
            map: Arc::new(Mapping {
                id: NEXT_ARENA_ID.fetch_add(1, Ordering::Relaxed),
                region,
                spec,
                slot_len,
                count,
                node,
                free: Mutex::new((0..count).rev().collect()),
                on_release: Mutex::new(Vec::new()),
                origin: crate::fork::Origin::here(),
            }),
        }
    }

    /// The NUMA node this arena's pages are bound to, when it was made with
    /// [`Arena::new_on_node`] (or `Engine::arena_on`).
    pub fn node(&self) -> Option<usize> {
        self.map.node
    }

    /// The shape of every slot.
    pub fn spec(&self) -> SlotSpec {
        self.map.spec
    }

    /// Identity of this arena (unique in the process).
    pub fn id(&self) -> u64 {
        self.map.id
    }

    /// Number of slots.
    pub fn len(&self) -> usize {
        self.map.count
    }

    /// Never true: an arena has at least one slot.
    pub fn is_empty(&self) -> bool {
        self.map.count == 0
    }

    /// Slots not handed out right now.
    pub fn available(&self) -> usize {
        self.map.free.lock().expect("arena free list").len()
    }

    /// Takes a free slot, or `None` when all are out.
    pub fn take(&self) -> Option<Slot> {
        if self.map.unmapped_here() {
            // A forked child: the slots' pages are not mapped here.
            return None;
        }
        let index = self.map.free.lock().expect("arena free list").pop()?;
        Some(Slot {
            map: Arc::clone(&self.map),
            index,
        })
    }

    /// Returns a slot; the same as dropping it. A slot of another arena is
    /// returned to its own arena.
    pub fn give_back(&self, slot: Slot) {
        drop(slot)
    }

    /// Base address and length of the whole mapping (for buffer registration).
    pub fn region(&self) -> (*mut u8, usize) {
        (self.map.region.ptr.as_ptr(), self.map.region.len)
    }

    /// The memory of `n` consecutive slots from slot `first` (for buffer
    /// registration). Panics unless they are slots of this arena.
    pub(crate) fn slots_range(&self, first: usize, n: usize) -> SlotRange {
        assert!(
            first.checked_add(n).is_some_and(|end| end <= self.map.count),
            "slots [{first}, +{n}) of an arena of {}",
            self.map.count
        );
        let len = n * self.map.slot_len;
        // SAFETY: `first < count` (checked), so the offset is inside the
        // mapping (at most isize::MAX bytes, checked in `map`).
        let base = unsafe { self.map.region.ptr.add(first * self.map.slot_len) };
        SlotRange { base, len }
    }

    /// Whether `fork()` leaves this arena out of a child
    /// (`madvise(MADV_DONTFORK)` succeeded). False only when the kernel
    /// refused the advice (warned once), and always under Miri.
    pub fn fork_protected(&self) -> bool {
        self.map.region.dontfork
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

    /// Bytes of one slot.
    pub fn slot_len(&self) -> usize {
        self.map.slot_len
    }

    /// Runs `f` once, when the last handle and slot of this arena are gone.
    pub(crate) fn on_release(&self, f: impl FnOnce() + Send + 'static) {
        self.map
            .on_release
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(Box::new(f));
    }
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

/// One slot of an arena: exclusive access to `slot_len` bytes.
pub struct Slot {
    map: Arc<Mapping>,
    index: usize,
}

impl std::fmt::Debug for Slot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Slot")
            .field("index", &self.index)
            .field("base", &self.base())
            .finish()
    }
}

impl Slot {
    /// Position of this slot in its arena.
    pub fn index(&self) -> usize {
        self.index
    }

    /// The shape of the slot (its arena's spec).
    pub fn spec(&self) -> SlotSpec {
        self.map.spec
    }

    /// Payload capacity.
    pub fn capacity(&self) -> usize {
        self.map.spec.capacity
    }

    /// Bytes in the slot (scratch + payload + tail room, page-rounded).
    pub fn len(&self) -> usize {
        self.map.slot_len
    }

    /// Whether the slot has no bytes (never, for a slot of an arena).
    pub fn is_empty(&self) -> bool {
        self.map.slot_len == 0
    }

    /// Address of the slot base (where the aligned window starts).
    pub fn base(&self) -> *const u8 {
        self.base_mut_ptr()
    }

    pub(crate) fn base_mut_ptr(&self) -> *mut u8 {
        // SAFETY: index < count, so `index * slot_len` is at most
        // `(count - 1) * slot_len`, checked in `map` to fit the mapping
        // (itself at most isize::MAX bytes): the offset stays inside it.
        unsafe { self.map.region.ptr.as_ptr().add(self.index * self.map.slot_len) }
    }

    /// The whole slot, scratch included.
    pub fn as_bytes(&self) -> &[u8] {
        self.assert_mapped();
        // SAFETY: this slot index is held only by `self` (see `Mapping`), the
        // range is inside the live mapping, and `&self` excludes writers.
        unsafe { std::slice::from_raw_parts(self.base(), self.map.slot_len) }
    }

    /// The whole slot, scratch included, writable.
    pub fn as_bytes_mut(&mut self) -> &mut [u8] {
        self.assert_mapped();
        // SAFETY: as `as_bytes`, and `&mut self` makes the access exclusive.
        unsafe { std::slice::from_raw_parts_mut(self.base_mut_ptr(), self.map.slot_len) }
    }

    /// A clear panic instead of a segmentation fault: a slot of a parent's
    /// arena touched in a forked child (its pages are `MADV_DONTFORK`).
    fn assert_mapped(&self) {
        if self.map.unmapped_here() {
            panic!(
                "a weightstream slot was touched in a forked child: arenas are MADV_DONTFORK, their pages exist only in the parent"
            );
        }
    }

    /// The slot's memory as a read sees it (address and length).
    pub(crate) fn range(&self) -> SlotRange {
        SlotRange {
            base: NonNull::new(self.base_mut_ptr()).expect("a slot of a mapping is never null"),
            len: self.map.slot_len,
        }
    }

    /// Identity of the arena this slot belongs to (unique in the process).
    pub fn arena_id(&self) -> u64 {
        self.map.id
    }

    /// The NUMA node of this slot's arena (see [`Arena::node`]).
    pub fn node(&self) -> Option<usize> {
        self.map.node
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        if let Ok(mut free) = self.map.free.lock() {
            free.push(self.index);
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
        assert!(a.take().is_none());
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
        let mut slots: Vec<Slot> = std::iter::from_fn(|| a.take()).collect();
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
        assert_eq!(dontfork_failures(), 0);
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
