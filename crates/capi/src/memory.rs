//! Memory an engine reads into: the caller's, lent and taken back
//! (`ws_memory_register`, `ws_memory_unregister`), and the engine's own
//! arenas; where a batch's payloads go (`ws_memory_placement`).
//!
//! A memory handle's arena sits behind a lock held only to clone it (an
//! `Arc`): reads are submitted outside it, so threads submitting into one
//! memory do not queue behind each other. Unregistering takes the arena
//! out (no new read can start), waits for the submissions already past the
//! lock (they count themselves), refuses while tickets are held, then
//! waits for the kernel (`Arena::release`). The handle stays in its table
//! until that succeeds, so other threads never see it as closed too early.

use std::collections::BTreeMap;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, LazyLock, Mutex, RwLock};
use std::time::{Duration, Instant};

use ws::Arena;

use crate::engine::{EngineObj, ENGINES};
use crate::handles::Table;
use crate::status::{guard, ws_status, Fail, Res};
use crate::types::{ws_engine, ws_memory};
use crate::util::{invalid, null, MAX_BATCH};

/// What a memory handle is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum MemKind {
    /// The caller's memory (`ws_memory_register`).
    Caller,
    /// The engine's packed arena (`ws_arena_create`).
    Packed,
    /// The engine's arena of fixed slots (`ws_arena_create_slots`).
    Slots,
}

pub(crate) struct MemoryObj {
    pub(crate) kind: MemKind,
    /// `None` while an unregister is deciding.
    arena: RwLock<Option<Arena>>,
    pub(crate) base: usize,
    pub(crate) len: usize,
    pub(crate) engine: Arc<EngineObj>,
    /// Tickets into this memory not yet collected, freed or (held) freed.
    pub(crate) tickets: AtomicUsize,
    /// Submissions between cloning the arena and counting their ticket.
    submitting: AtomicUsize,
}

impl Drop for MemoryObj {
    fn drop(&mut self) {
        self.engine.users.fetch_sub(1, Ordering::SeqCst);
    }
}

pub(crate) static MEMORY: LazyLock<Table<MemoryObj>> = LazyLock::new(|| Table::new("memory"));

/// Ranges of memory handles open now, the caller's and the engines' own
/// arenas alike: start -> (end, handle). Two handles over the same bytes
/// would let two reads land on them at once (or a caller's register the
/// bytes of an engine arena holding a read).
static LENT: LazyLock<Mutex<BTreeMap<usize, (usize, u64)>>> = LazyLock::new(|| Mutex::new(BTreeMap::new()));

fn lent() -> std::sync::MutexGuard<'static, BTreeMap<usize, (usize, u64)>> {
    LENT.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// One submission's hold on a memory: the arena, and the count that keeps
/// an unregister from deciding before this submission's ticket is counted.
pub(crate) struct Entry<'a> {
    m: &'a MemoryObj,
    pub(crate) arena: Arena,
}

impl Drop for Entry<'_> {
    fn drop(&mut self) {
        self.m.submitting.fetch_sub(1, Ordering::SeqCst);
    }
}

impl MemoryObj {
    pub(crate) fn get(memory: ws_memory) -> Res<Arc<MemoryObj>> {
        MEMORY.get(memory.id)
    }

    /// The arena for one submission (or a placement); `WS_ERR_BUSY` while
    /// an unregister is deciding.
    pub(crate) fn enter(&self) -> Res<Entry<'_>> {
        let g = self.arena.read().unwrap_or_else(std::sync::PoisonError::into_inner);
        match &*g {
            Some(a) => {
                self.submitting.fetch_add(1, Ordering::SeqCst);
                Ok(Entry {
                    m: self,
                    arena: a.clone(),
                })
            }
            None => Err(Fail::new(
                ws_status::WS_ERR_BUSY,
                "the memory is being unregistered by another call",
            )),
        }
    }

    fn put_back(&self, arena: Arena) {
        *self.arena.write().unwrap_or_else(std::sync::PoisonError::into_inner) = Some(arena);
    }
}

fn insert(e: Arc<EngineObj>, arena: Arena, kind: MemKind, base: usize, len: usize) -> ws_memory {
    e.users.fetch_add(1, Ordering::SeqCst);
    ws_memory {
        id: MEMORY.insert(MemoryObj {
            kind,
            arena: RwLock::new(Some(arena)),
            base,
            len,
            engine: e,
            tickets: AtomicUsize::new(0),
            submitting: AtomicUsize::new(0),
        }),
    }
}

/// An engine's own arena as a memory handle, its bytes in the ledger of
/// open ranges (a fresh mapping overlaps none still open: the kernel gave
/// it addresses nothing else holds).
fn insert_arena(e: Arc<EngineObj>, arena: Arena, kind: MemKind) -> ws_memory {
    let (base, len) = arena.region();
    let (base, end) = (base as usize, base as usize + len);
    let mut ranges = lent();
    let m = insert(e, arena, kind, base, len);
    ranges.insert(base, (end, m.id));
    m
}

/// Lends `len` bytes of the caller's memory at `ptr` (page-aligned) to the
/// engine, registered with its rings where the kernel allows (a refusal is
/// counted in the stats and warned once, never silent). Bytes already lent
/// through another handle are `WS_ERR_BUSY`.
///
/// Ownership: the memory stays the caller's; this library never frees,
/// unmaps or advises it. The caller must not free, unmap or remap it until
/// `ws_memory_unregister` returned `WS_OK`, and must not touch the bytes of
/// a read in flight (between `ws_read_into` and the ticket's completion).
///
/// # Safety
/// `ptr..ptr + len` is valid for reads and writes and stays so until
/// `ws_memory_unregister` returns `WS_OK`; a forked child does not read
/// into it. `out` is valid for a write.
#[no_mangle]
pub unsafe extern "C" fn ws_memory_register(
    engine: ws_engine,
    ptr: *mut std::ffi::c_void,
    len: usize,
    out: *mut ws_memory,
) -> ws_status {
    guard("ws_memory_register", || {
        let e = ENGINES.get(engine.id)?;
        let p = NonNull::new(ptr.cast::<u8>()).ok_or_else(|| null("ptr"))?;
        let start = p.as_ptr() as usize;
        if !start.is_multiple_of(4096) {
            return Err(Fail::new(
                ws_status::WS_ERR_MISALIGNED,
                format!("ptr {start:#x} is not page-aligned (4096): use mmap or posix_memalign"),
            ));
        }
        if len == 0 {
            return Err(Fail::new(ws_status::WS_ERR_TOO_SMALL, "len is 0"));
        }
        let end = start
            .checked_add(len)
            .filter(|_| len <= isize::MAX as usize)
            .ok_or_else(|| invalid(format!("len {len}: past the end of the address space")))?;
        if out.is_null() {
            return Err(null("out"));
        }
        let mut ranges = lent();
        // The range starting at or before `end` with the largest start: the
        // only one that can overlap `[start, end)` from the left, or any
        // that starts inside it.
        if let Some((&s, &(e_end, id))) = ranges.range(..end).next_back() {
            if e_end > start {
                return Err(Fail::new(
                    ws_status::WS_ERR_BUSY,
                    format!(
                        "bytes [{start:#x}, {end:#x}) overlap [{s:#x}, {e_end:#x}), lent as memory {id}: two handles over \
                         the same bytes would let two reads land on them at once"
                    ),
                ));
            }
        }
        // SAFETY: the caller's obligations above are those of
        // Engine::register_memory (the header repeats them); the same bytes
        // are not lent twice (checked above, under the lock).
        let arena = unsafe { e.engine.register_memory(p, len) }?;
        let m = insert(e, arena, MemKind::Caller, start, len);
        ranges.insert(start, (end, m.id));
        drop(ranges);
        // SAFETY: checked non-NULL above; valid for a write (the contract).
        unsafe { out.write(m) };
        Ok(ws_status::WS_OK)
    })
}

/// Takes memory back: the caller's (`ws_memory_register`) or an engine
/// arena (`ws_arena_create*`, freed here). Refused with `WS_ERR_BUSY` while
/// tickets into it are held (collect or free them first), or while another
/// thread unregisters it. Then waits up to `timeout_ms` for reads still in
/// the kernel (those of freed tickets): `WS_OK` means the memory may be
/// freed or reused now, and the handle is closed; `WS_TIMEOUT` means reads
/// are still in the kernel: the memory must not be freed, and the handle
/// stays valid (call again). After `WS_ERR_ABANDONED` from a read into it,
/// it never returns `WS_OK`: that memory must be leaked.
#[no_mangle]
pub extern "C" fn ws_memory_unregister(memory: ws_memory, timeout_ms: u64) -> ws_status {
    guard("ws_memory_unregister", || {
        let m = MemoryObj::get(memory)?;
        let deadline = Instant::now() + Duration::from_millis(timeout_ms);
        let arena = m
            .arena
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .take()
            .ok_or_else(|| {
                Fail::new(
                    ws_status::WS_ERR_BUSY,
                    format!("memory {}: another call is unregistering it", memory.id),
                )
            })?;
        // No submission can start now; those past the lock finish in
        // microseconds, unless a ring stalls them: bounded by the timeout,
        // and by a second at least.
        let settle = deadline.max(Instant::now() + Duration::from_secs(1));
        while m.submitting.load(Ordering::SeqCst) > 0 {
            if Instant::now() >= settle {
                m.put_back(arena);
                return Err(Fail::new(
                    ws_status::WS_ERR_BUSY,
                    format!("memory {}: reads are still being submitted into it", memory.id),
                ));
            }
            std::thread::yield_now();
        }
        let held = m.tickets.load(Ordering::SeqCst);
        if held > 0 {
            m.put_back(arena);
            return Err(Fail::new(
                ws_status::WS_ERR_BUSY,
                format!(
                    "memory {}: {held} ticket(s) into it not collected or freed (wait, poll or free them first)",
                    memory.id
                ),
            ));
        }
        match arena.release(deadline.saturating_duration_since(Instant::now())) {
            Ok(()) => {
                let _ = MEMORY.remove(memory.id);
                lent().remove(&m.base);
                Ok(ws_status::WS_OK)
            }
            Err(arena) => {
                m.put_back(arena);
                Ok(ws_status::WS_TIMEOUT)
            }
        }
    })
}

/// Where the payloads of `tensors[0..n]` land in `memory` so that every read
/// of them with `WS_SCRATCH_BLOCKS` is in place and O_DIRECT: back to back,
/// each on its phase. `offsets[i]` receives tensor i's `at`;
/// `WS_ERR_TOO_SMALL` (with the bytes needed) when they do not fit.
///
/// # Safety
/// `tensors` holds `n` indexes; `offsets` is valid for `n` writes.
#[no_mangle]
pub unsafe extern "C" fn ws_memory_placement(
    memory: ws_memory,
    tensors: *const usize,
    n: usize,
    offsets: *mut usize,
) -> ws_status {
    guard("ws_memory_placement", || {
        let m = MemoryObj::get(memory)?;
        if n == 0 {
            return Ok(ws_status::WS_OK);
        }
        if n > MAX_BATCH {
            return Err(invalid(format!("n {n}: at most {MAX_BATCH}")));
        }
        if tensors.is_null() {
            return Err(null("tensors"));
        }
        if offsets.is_null() {
            return Err(null("offsets"));
        }
        if m.kind == MemKind::Slots {
            return Err(invalid(
                "an arena of fixed slots has no placement: ws_read_any picks its slots",
            ));
        }
        // SAFETY: `tensors` holds `n` indexes (the contract); n is bounded.
        let idx = unsafe { std::slice::from_raw_parts(tensors, n) };
        let refs = idx.iter().map(|&i| m.engine.model.tensor(i)).collect::<Res<Vec<_>>>()?;
        let need = m
            .engine
            .engine
            .placement_bytes(&refs)
            .map_err(|e| Fail::new(ws_status::WS_ERR_TOO_SMALL, Fail::from(e).msg))?;
        let entry = m.enter()?;
        let p = m.engine.engine.placement(&refs, &entry.arena).map_err(|e| {
            let f = Fail::from(e);
            if need > m.len {
                Fail::new(ws_status::WS_ERR_TOO_SMALL, f.msg)
            } else {
                f
            }
        })?;
        drop(entry);
        // SAFETY: `offsets` is valid for `n` writes (the contract).
        let out = unsafe { std::slice::from_raw_parts_mut(offsets, n) };
        out.copy_from_slice(&p.offsets()[..n]);
        Ok(ws_status::WS_OK)
    })
}

/// An arena the engine owns: `bytes` of page-aligned memory (2 MiB pages
/// where the kernel gives them), registered with the rings, read into with
/// `ws_read_into` (at offsets `ws_memory_placement` gives) or
/// `ws_read_any`. `populate` non-zero faults it in now. Freed by
/// `ws_memory_unregister` once no read is in flight.
///
/// # Safety
/// `out` is valid for a write.
#[no_mangle]
pub unsafe extern "C" fn ws_arena_create(
    engine: ws_engine,
    bytes: usize,
    populate: std::ffi::c_int,
    out: *mut ws_memory,
) -> ws_status {
    guard("ws_arena_create", || {
        let e = ENGINES.get(engine.id)?;
        if bytes == 0 {
            return Err(Fail::new(ws_status::WS_ERR_TOO_SMALL, "bytes is 0"));
        }
        if out.is_null() {
            return Err(null("out"));
        }
        let arena = e.engine.packed_arena(bytes, populate != 0)?;
        let m = insert_arena(e, arena, MemKind::Packed);
        // SAFETY: checked non-NULL above; valid for a write (the contract).
        unsafe { out.write(m) };
        Ok(ws_status::WS_OK)
    })
}

/// An arena of `count` fixed slots of `slot_bytes` each, the engine's,
/// registered with the rings: `ws_read_any` takes a free slot for each
/// read (a slot holds any tensor of up to `slot_bytes`; the payload lands
/// at `file_offset % align` in it). Freed by `ws_memory_unregister` once
/// no read is in flight.
///
/// # Safety
/// `out` is valid for a write.
#[no_mangle]
pub unsafe extern "C" fn ws_arena_create_slots(
    engine: ws_engine,
    slot_bytes: usize,
    count: usize,
    out: *mut ws_memory,
) -> ws_status {
    guard("ws_arena_create_slots", || {
        let e = ENGINES.get(engine.id)?;
        if slot_bytes == 0 || count == 0 {
            return Err(Fail::new(
                ws_status::WS_ERR_TOO_SMALL,
                format!("{count} slot(s) of {slot_bytes} bytes"),
            ));
        }
        if out.is_null() {
            return Err(null("out"));
        }
        let spec = ws::SlotSpec::new(slot_bytes).with_align(e.engine.direct_align());
        let arena = e.engine.arena(spec, count)?;
        let m = insert_arena(e, arena, MemKind::Slots);
        // SAFETY: checked non-NULL above; valid for a write (the contract).
        unsafe { out.write(m) };
        Ok(ws_status::WS_OK)
    })
}
