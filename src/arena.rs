//! Page-aligned memory carved into slots that payloads land in.
//!
//! A slot reserves `align` bytes of scratch before the payload (so the
//! aligned O_DIRECT window can start at the slot base) and, optionally, tail
//! room up to the next `align` boundary after the payload (so the last
//! partial block can be read with O_DIRECT too). Slots are owned handles:
//! not `Clone`, returned to their arena on drop or with
//! [`Arena::give_back`]. The mapping lives as long as any slot of it does.

use std::ptr::NonNull;
use std::sync::{Arc, Mutex};

use rustix::mm::{MapFlags, ProtFlags};

use crate::error::{Error, Result};
use crate::window::round_up;

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

    pub fn with_align(mut self, align: usize) -> Self {
        self.align = align;
        self
    }

    pub fn with_tail_room(mut self, tail_room: bool) -> Self {
        self.tail_room = tail_room;
        self
    }

    /// Bytes of one slot: scratch + payload (+ tail room), rounded to the page.
    pub fn slot_len(&self) -> usize {
        let body = if self.tail_room {
            round_up(self.capacity, self.align)
        } else {
            self.capacity
        };
        round_up(self.align + body.max(1), page_size().max(self.align))
    }

    fn validate(&self) -> Result<()> {
        if !self.align.is_power_of_two() || self.align < 512 {
            return Err(Error::Config(format!(
                "slot alignment {} must be a power of two of at least 512",
                self.align
            )));
        }
        Ok(())
    }
}

static NEXT_ARENA_ID: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);

pub(crate) fn page_size() -> usize {
    rustix::param::page_size()
}

struct Mapping {
    /// Unique for the process lifetime: registrations are keyed by it, never
    /// by address (a new arena may be mapped where a dropped one was).
    id: u64,
    ptr: NonNull<u8>,
    map_len: usize,
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
        // SAFETY: `ptr`/`map_len` are exactly the mapping made by `map`,
        // and no `Slot` exists any more (each holds an `Arc<Mapping>`), so
        // nothing can reach the memory after this.
        let _ = unsafe { rustix::mm::munmap(self.ptr.as_ptr().cast(), self.map_len) };
    }
}

/// One anonymous private mapping for `count` slots of `spec`: (base, length,
/// slot length). `populate` faults every page in now.
fn map(spec: SlotSpec, count: usize, populate: bool) -> Result<(NonNull<u8>, usize, usize)> {
    spec.validate()?;
    if count == 0 {
        return Err(Error::Config("an arena needs at least one slot".into()));
    }
    let slot_len = spec.slot_len();
    let len = slot_len
        .checked_mul(count)
        .ok_or_else(|| Error::Config(format!("{count} slots of {slot_len} bytes overflow the address space")))?;
    let flags = if populate {
        MapFlags::PRIVATE | MapFlags::POPULATE
    } else {
        MapFlags::PRIVATE
    };
    // SAFETY: a fresh anonymous private mapping at an address of the
    // kernel's choosing aliases no existing memory.
    let ptr =
        unsafe { rustix::mm::mmap_anonymous(std::ptr::null_mut(), len, ProtFlags::READ | ProtFlags::WRITE, flags) }
            .map_err(|e| Error::io("<anonymous arena>", "mmap", e))?;
    let ptr = NonNull::new(ptr.cast::<u8>()).expect("mmap never returns null on success");
    Ok((ptr, len, slot_len))
}

/// A set of equally sized, page-aligned slots in one anonymous mapping.
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
        let (ptr, len, slot_len) = map(spec, count, true)?;
        Ok(Arena::from_mapping(ptr, len, spec, slot_len, count, None))
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
        let (ptr, len, slot_len) = map(spec, count, false)?;
        // Built first so the mapping is unmapped on every error path.
        let arena = Arena::from_mapping(ptr, len, spec, slot_len, count, Some(node));
        // SAFETY: `ptr..ptr+len` is the fresh mapping just made, readable and
        // writable; no slot has been handed out, so nothing else reaches it.
        // An untouched anonymous page reads as zeros.
        let area = unsafe { std::slice::from_raw_parts(ptr.as_ptr(), len) };
        bind(area).map_err(|e| Error::Config(format!("binding an arena of {len} bytes to NUMA node {node}: {e}")))?;
        let page = page_size();
        for off in (0..len).step_by(page) {
            // SAFETY: `off < len`, inside the mapping; no slot exists yet, so
            // this write aliases nothing. Volatile so the first touch happens.
            unsafe { std::ptr::write_volatile(ptr.as_ptr().add(off), 0) };
        }
        Ok(arena)
    }

    fn from_mapping(
        ptr: NonNull<u8>,
        len: usize,
        spec: SlotSpec,
        slot_len: usize,
        count: usize,
        node: Option<usize>,
    ) -> Self {
        Arena {
            map: Arc::new(Mapping {
                id: NEXT_ARENA_ID.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
                ptr,
                map_len: len,
                spec,
                slot_len,
                count,
                node,
                free: Mutex::new((0..count).rev().collect()),
                on_release: Mutex::new(Vec::new()),
            }),
        }
    }

    /// The NUMA node this arena's pages are bound to, when it was made with
    /// [`Arena::new_on_node`] (or `Engine::arena_on`).
    pub fn node(&self) -> Option<usize> {
        self.map.node
    }

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

    pub fn is_empty(&self) -> bool {
        self.map.count == 0
    }

    /// Slots not handed out right now.
    pub fn available(&self) -> usize {
        self.map.free.lock().expect("arena free list").len()
    }

    /// Takes a free slot, or `None` when all are out.
    pub fn take(&self) -> Option<Slot> {
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
        (self.map.ptr.as_ptr(), self.map.map_len)
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

    pub fn is_empty(&self) -> bool {
        self.map.slot_len == 0
    }

    /// Address of the slot base (where the aligned window starts).
    pub fn base(&self) -> *const u8 {
        self.base_mut_ptr()
    }

    pub(crate) fn base_mut_ptr(&self) -> *mut u8 {
        // SAFETY: index < count, so the offset stays inside the mapping.
        unsafe { self.map.ptr.as_ptr().add(self.index * self.map.slot_len) }
    }

    /// The whole slot, scratch included.
    pub fn as_bytes(&self) -> &[u8] {
        // SAFETY: this slot index is held only by `self` (see `Mapping`), the
        // range is inside the live mapping, and `&self` excludes writers.
        unsafe { std::slice::from_raw_parts(self.base(), self.map.slot_len) }
    }

    /// The whole slot, scratch included, writable.
    pub fn as_bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: as `as_bytes`, and `&mut self` makes the access exclusive.
        unsafe { std::slice::from_raw_parts_mut(self.base_mut_ptr(), self.map.slot_len) }
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
        assert_eq!(SlotSpec::new(4096).slot_len(), 8192);
        assert_eq!(SlotSpec::new(4097).slot_len(), 12288);
        assert_eq!(SlotSpec::new(4097).with_tail_room(true).slot_len(), 12288);
        assert_eq!(SlotSpec::new(8192).with_tail_room(true).slot_len(), 12288);
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
}
