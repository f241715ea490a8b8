//! Reads and tickets: submit (one, a batch, or where the engine picks),
//! then poll, wait, notify through an eventfd, or free.
//!
//! A ticket's state is taken out of its lock by the call working on it
//! (`Waiting`) and put back when that call is done; a guard puts a
//! `Done(panic)` back if the call unwinds, so a caught panic never leaves a
//! ticket that cannot be freed. A ticket removed from its table is marked
//! `Spent`, so a thread that looked it up just before sees `WS_ERR_HANDLE`.

use std::ffi::c_int;
use std::future::Future;
use std::os::fd::{BorrowedFd, OwnedFd};
use std::pin::Pin;
use std::sync::atomic::Ordering;
use std::sync::{Arc, LazyLock, Mutex, MutexGuard};
use std::task::{Context, Poll, Wake, Waker};
use std::time::Duration;

use ws::{Scratch, SliceTicket};

use crate::engine::{EngineObj, ENGINES};
use crate::handles::Table;
use crate::memory::{MemKind, MemoryObj};
use crate::status::{guard, ws_status, Fail, Res};
use crate::types::{
    ws_engine, ws_memory, ws_range, ws_read, ws_read_result, ws_slice_info, ws_ticket, WS_READ_HOLD, WS_READ_IN_PLACE,
    WS_SCRATCH_BEFORE, WS_SCRATCH_BLOCKS, WS_SCRATCH_NONE,
};
use crate::util::{invalid, null, MAX_BATCH};

/// A completed read, kept without raw pointers (the table is shared
/// between threads).
#[derive(Debug, Clone, Copy)]
struct Out {
    offset: usize,
    bytes: u64,
    data: usize,
}

impl Out {
    fn result(self) -> ws_read_result {
        ws_read_result {
            offset: self.offset,
            bytes: self.bytes,
            data: self.data as *mut std::ffi::c_void,
        }
    }
}

enum State {
    /// In flight (a plain read is a one-piece slice ticket).
    Pending(SliceTicket),
    /// A call is working on it (waiting, polling, notifying).
    Waiting,
    /// Completed and not yet handed out, or held (`WS_READ_HOLD`: the
    /// payload's `Loaded` keeps its bytes reserved until the ticket is freed).
    Done(Res<Out>, Option<ws::Loaded>),
    /// Collected or freed: out of the table.
    Spent,
}

pub(crate) struct TicketObj {
    state: Mutex<State>,
    memory: Arc<MemoryObj>,
    hold: bool,
}

impl Drop for TicketObj {
    fn drop(&mut self) {
        self.memory.tickets.fetch_sub(1, Ordering::SeqCst);
    }
}

static TICKETS: LazyLock<Table<TicketObj>> = LazyLock::new(|| Table::new("ticket"));

impl TicketObj {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The state, for this call to work on (`Waiting` meanwhile).
    fn take(&self, id: u64) -> Res<Taken<'_>> {
        let mut st = self.lock();
        match std::mem::replace(&mut *st, State::Waiting) {
            State::Waiting => Err(Fail::new(
                ws_status::WS_ERR_BUSY,
                format!("ticket {id}: another thread is working on it (waiting on it)"),
            )),
            State::Spent => {
                *st = State::Spent;
                Err(Fail::new(
                    ws_status::WS_ERR_HANDLE,
                    format!("ticket {id}: already collected or freed"),
                ))
            }
            s => Ok(Taken {
                obj: self,
                state: Some(s),
            }),
        }
    }
}

/// A ticket's state taken out for one call. Dropped without `put`: the
/// call unwound, and the ticket is left `Done` with that error, so that it
/// can still be freed.
struct Taken<'a> {
    obj: &'a TicketObj,
    state: Option<State>,
}

impl Taken<'_> {
    fn put(mut self, s: State) {
        self.state = None;
        *self.obj.lock() = s;
    }
}

impl Drop for Taken<'_> {
    fn drop(&mut self) {
        if self.state.is_some() || std::thread::panicking() {
            let mut st = self.obj.lock();
            if matches!(*st, State::Waiting) {
                *st = State::Done(
                    Err(Fail::new(
                        ws_status::WS_ERR_PANIC,
                        "an earlier call on this ticket panicked (a bug in weightstream); free it",
                    )),
                    None,
                );
            }
        }
    }
}

fn new_ticket(m: &Arc<MemoryObj>, ticket: impl Into<SliceTicket>, hold: bool) -> ws_ticket {
    // Counted before the submission's hold on the memory ends (the caller
    // drops its `Entry` after this), so an unregister sees it.
    m.tickets.fetch_add(1, Ordering::SeqCst);
    ws_ticket {
        id: TICKETS.insert(TicketObj {
            state: Mutex::new(State::Pending(ticket.into())),
            memory: Arc::clone(m),
            hold,
        }),
    }
}

/// The tensor (or byte range of it) a `ws_read` names.
fn target(e: &EngineObj, r: &ws_read) -> Res<ws::TensorRef> {
    let whole = e.model.tensor(r.tensor)?;
    if r.start == 0 && r.end == 0 {
        return Ok(whole.clone());
    }
    if r.start >= r.end || r.end > whole.len {
        return Err(invalid(format!(
            "tensor {}: bytes [{}, {}) are not a non-empty range of its {} bytes",
            whole.name, r.start, r.end, whole.len
        )));
    }
    Ok(whole.byte_range(r.start..r.end)?)
}

fn scratch_of(v: u32) -> Res<Scratch> {
    match v {
        WS_SCRATCH_NONE => Ok(Scratch::None),
        WS_SCRATCH_BEFORE => Ok(Scratch::Before),
        WS_SCRATCH_BLOCKS => Ok(Scratch::Blocks),
        s => Err(invalid(format!(
            "scratch {s} (WS_SCRATCH_NONE 0, WS_SCRATCH_BEFORE 1, WS_SCRATCH_BLOCKS 2)"
        ))),
    }
}

/// A range of memory that a read in flight or a held ticket covers is
/// `WS_ERR_BUSY`, not a generic refusal.
fn busy_if_overlap(err: ws::Error) -> Fail {
    let f = Fail::from(err);
    if f.msg.contains("overlap a slot in use") {
        Fail::new(ws_status::WS_ERR_BUSY, f.msg)
    } else {
        f
    }
}

fn submit(e: &EngineObj, m: &Arc<MemoryObj>, r: &ws_read) -> Res<ws_ticket> {
    let t = target(e, r)?;
    if r.flags & !(WS_READ_IN_PLACE | WS_READ_HOLD) != 0 {
        return Err(invalid(format!("flags {:#x}: unknown bits", r.flags)));
    }
    let scratch = scratch_of(r.scratch)?;
    if m.kind == MemKind::Slots {
        return Err(invalid(
            "an arena of fixed slots is read into with ws_read_any (the engine picks the slot), not ws_read_into",
        ));
    }
    let len = usize::try_from(t.len).map_err(|_| invalid("the tensor does not fit this address space"))?;
    if r.at.checked_add(len).is_none_or(|end| end > m.len) {
        return Err(Fail::new(
            ws_status::WS_ERR_TOO_SMALL,
            format!(
                "tensor {}: {} bytes at offset {} do not fit the {}-byte memory",
                t.name, t.len, r.at, m.len
            ),
        ));
    }
    let must = r.flags & WS_READ_IN_PLACE != 0;
    let align = e.engine.direct_align();
    let pad = (t.offset % align as u64) as usize;
    let entry = m.enter()?;
    if must && e.engine.would_stage(&t, &entry.arena, r.at, scratch) {
        return Err(Fail::new(
            ws_status::WS_ERR_MISALIGNED,
            format!(
                "tensor {}: WS_READ_IN_PLACE at offset {} (address {:#x}) with scratch {}: the payload must start at an \
                 address that is {pad} mod {align} (its file offset {} mod {align}), with {pad} bytes of the memory \
                 before it that the scratch may overwrite; WS_SCRATCH_NONE needs a payload on a block boundary of at \
                 least a block, WS_SCRATCH_BEFORE one that reaches past its first block",
                t.name,
                r.at,
                m.base.wrapping_add(r.at),
                r.scratch,
                t.offset
            ),
        ));
    }
    let ticket = e
        .engine
        .read_into(&t, &entry.arena, r.at, scratch)
        .map_err(busy_if_overlap)?;
    if must && ticket.is_staged() {
        // In phase, but the window overlaps bytes in use: the engine chose
        // staging. The read is dropped (it completes into staging memory).
        drop(ticket);
        return Err(Fail::new(
            ws_status::WS_ERR_BUSY,
            format!(
                "tensor {}: WS_READ_IN_PLACE at offset {}: its in-place window overlaps bytes of the memory in use (a read \
                 in flight or a held ticket)",
                t.name, r.at
            ),
        ));
    }
    let tk = new_ticket(m, ticket, r.flags & WS_READ_HOLD != 0);
    drop(entry);
    Ok(tk)
}

fn engine_and_memory(engine: ws_engine, memory: ws_memory) -> Res<(Arc<EngineObj>, Arc<MemoryObj>)> {
    let e = ENGINES.get(engine.id)?;
    let m = MemoryObj::get(memory)?;
    if !Arc::ptr_eq(&m.engine, &e) {
        return Err(invalid(format!(
            "memory {} belongs to another engine than {}",
            memory.id, engine.id
        )));
    }
    Ok((e, m))
}

/// Starts one read into caller memory (or a packed engine arena): the
/// payload (or bytes `[start, end)` of it) lands at offset `at` of
/// `memory`. Returns at once with a ticket; collect it with
/// `ws_ticket_poll` / `ws_ticket_wait`, or drop it with `ws_ticket_free`.
/// Until then the caller must not touch those bytes. A range overlapping
/// a read in flight (or a held ticket's bytes) is `WS_ERR_BUSY`.
///
/// Thread safety: any number of threads may submit at once, to one engine
/// and one memory (distinct ranges).
///
/// # Safety
/// `read` points to a `ws_read`; `ticket` is valid for a write.
#[no_mangle]
pub unsafe extern "C" fn ws_read_into(
    engine: ws_engine,
    memory: ws_memory,
    read: *const ws_read,
    ticket: *mut ws_ticket,
) -> ws_status {
    guard("ws_read_into", || {
        if read.is_null() {
            return Err(null("read"));
        }
        if ticket.is_null() {
            return Err(null("ticket"));
        }
        // SAFETY: non-NULL, a ws_read (the contract); plain integers only.
        let r = unsafe { read.read() };
        let (e, m) = engine_and_memory(engine, memory)?;
        let t = submit(&e, &m, &r)?;
        // SAFETY: non-NULL, valid for a write (the contract).
        unsafe { ticket.write(t) };
        Ok(ws_status::WS_OK)
    })
}

/// The slice of tensor `tensor` that `bounds` (`ndim` ranges, one per
/// leading dimension; the rest whole) name.
///
/// # Safety
/// `bounds` is valid for `ndim` reads (or `ndim` is 0).
pub(crate) unsafe fn slice_of(
    e: &EngineObj,
    tensor: usize,
    bounds: *const ws_range,
    ndim: usize,
) -> Res<ws::TensorSlice> {
    let t = e.model.tensor(tensor)?;
    if ndim > 0 && bounds.is_null() {
        return Err(null("bounds"));
    }
    if ndim > t.shape.len() {
        return Err(invalid(format!(
            "tensor {}: {ndim} ranges for its {} dimensions",
            t.name,
            t.shape.len()
        )));
    }
    let ranges: &[ws_range] = if ndim == 0 {
        &[]
    } else {
        // SAFETY: non-NULL, valid for `ndim` reads (the contract), and
        // `ndim` is at most the tensor's dimensions (checked above).
        unsafe { std::slice::from_raw_parts(bounds, ndim) }
    };
    let mut r = Vec::with_capacity(ndim);
    for (d, b) in ranges.iter().enumerate() {
        let (Ok(a), Ok(z)) = (usize::try_from(b.start), usize::try_from(b.end)) else {
            return Err(invalid(format!(
                "tensor {}: range {d} does not fit this address space",
                t.name
            )));
        };
        r.push(a..z);
    }
    // Bounds are the caller's arguments: a bad one is WS_ERR_INVALID.
    t.slice(&r).map_err(|e| invalid(e.to_string()))
}

/// The bytes of a slice of tensor `tensor` (`bounds`: `ndim` ranges
/// `[start, end)`, one per leading dimension; the dimensions after them
/// whole), and how `ws_read_slice` would read it on this engine's drives.
/// A range outside its dimension, an empty slice, or one that cuts
/// sub-byte elements is `WS_ERR_INVALID` naming the tensor.
///
/// # Safety
/// `bounds` is valid for `ndim` reads (or `ndim` is 0); `info` is valid
/// for a write.
#[no_mangle]
pub unsafe extern "C" fn ws_slice_size(
    engine: ws_engine,
    tensor: usize,
    bounds: *const ws_range,
    ndim: usize,
    info: *mut ws_slice_info,
) -> ws_status {
    guard("ws_slice_size", || {
        if info.is_null() {
            return Err(null("info"));
        }
        let e = ENGINES.get(engine.id)?;
        // SAFETY: the contract above.
        let s = unsafe { slice_of(&e, tensor, bounds, ndim) }?;
        let plan = e.engine.slice_plan(&s);
        let out = ws_slice_info {
            bytes: s.len(),
            read_bytes: plan.read,
            runs: s.runs().len() as u64,
            pieces: plan.pieces.len() as u64,
        };
        // SAFETY: checked non-NULL; valid for a write (the contract).
        unsafe { info.write(out) };
        Ok(ws_status::WS_OK)
    })
}

/// Starts the read of a slice of tensor `tensor` (a tensor-parallel
/// rank's rows or columns: `bounds` as `ws_slice_size`), its bytes
/// landing compact and row-major at offset `at` of `memory`. Only the
/// slice's pieces are read from the drives: rows as one read (in place and
/// O_DIRECT when `at` is in phase, as `ws_read_into` with `scratch`), and
/// any other block run by run, neighbouring runs merged across gaps of at
/// most 32 KiB, O_DIRECT into the engine's staging memory, then copied
/// into place when the ticket is collected (poll, wait), on that thread.
/// `flags`: 0 or `WS_READ_HOLD`. The result's `bytes` is the slice's.
/// Busy bytes are `WS_ERR_BUSY`; bytes past the memory `WS_ERR_TOO_SMALL`.
///
/// Thread safety: as `ws_read_into`.
///
/// # Safety
/// `bounds` is valid for `ndim` reads (or `ndim` is 0); `ticket` is
/// valid for a write.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn ws_read_slice(
    engine: ws_engine,
    memory: ws_memory,
    tensor: usize,
    bounds: *const ws_range,
    ndim: usize,
    at: usize,
    scratch: u32,
    flags: u32,
    ticket: *mut ws_ticket,
) -> ws_status {
    guard("ws_read_slice", || {
        if ticket.is_null() {
            return Err(null("ticket"));
        }
        if flags & !WS_READ_HOLD != 0 {
            return Err(invalid(format!(
                "flags {flags:#x}: ws_read_slice takes 0 or WS_READ_HOLD"
            )));
        }
        let scratch = scratch_of(scratch)?;
        let (e, m) = engine_and_memory(engine, memory)?;
        // SAFETY: the contract above.
        let s = unsafe { slice_of(&e, tensor, bounds, ndim) }?;
        if m.kind == MemKind::Slots {
            return Err(invalid(
                "an arena of fixed slots cannot take a slice at an offset: use packed memory (ws_memory_register, ws_arena_create)",
            ));
        }
        if usize::try_from(s.len())
            .ok()
            .and_then(|n| at.checked_add(n))
            .is_none_or(|end| end > m.len)
        {
            return Err(Fail::new(
                ws_status::WS_ERR_TOO_SMALL,
                format!(
                    "tensor {}: a slice of {} bytes at offset {at} does not fit the {}-byte memory",
                    s.tensor().name,
                    s.len(),
                    m.len
                ),
            ));
        }
        let entry = m.enter()?;
        let t = e
            .engine
            .read_slice(&s, &entry.arena, at, scratch)
            .map_err(busy_if_overlap)?;
        let tk = new_ticket(&m, t, flags & WS_READ_HOLD != 0);
        drop(entry);
        // SAFETY: non-NULL, valid for a write (the contract).
        unsafe { ticket.write(tk) };
        Ok(ws_status::WS_OK)
    })
}

/// Starts one read to a place the engine picks: in packed memory (the
/// caller's or `ws_arena_create`), the lowest free run of whole blocks in
/// phase (in place, O_DIRECT); in an arena of fixed slots
/// (`ws_arena_create_slots`), a free slot. Only `read->tensor`,
/// `read->start` and `read->end` are used (`at`, `scratch` and `flags`
/// must be 0). The ticket always holds its bytes (as `WS_READ_HOLD`):
/// collect the result with poll or wait (`offset`, `data`), use the
/// payload, then `ws_ticket_free` gives the place back. No free place now
/// is `WS_ERR_BUSY`; a tensor larger than the memory (or a slot) can ever
/// hold is `WS_ERR_TOO_SMALL`.
///
/// # Safety
/// `read` points to a `ws_read`; `ticket` is valid for a write.
#[no_mangle]
pub unsafe extern "C" fn ws_read_any(
    engine: ws_engine,
    memory: ws_memory,
    read: *const ws_read,
    ticket: *mut ws_ticket,
) -> ws_status {
    guard("ws_read_any", || {
        if read.is_null() {
            return Err(null("read"));
        }
        if ticket.is_null() {
            return Err(null("ticket"));
        }
        // SAFETY: non-NULL, a ws_read (the contract); plain integers only.
        let r = unsafe { read.read() };
        if r.at != 0 || r.flags != 0 || r.scratch != WS_SCRATCH_NONE {
            return Err(invalid(
                "ws_read_any picks the place itself: at, scratch and flags must be 0",
            ));
        }
        let (e, m) = engine_and_memory(engine, memory)?;
        let t = target(&e, &r)?;
        let entry = m.enter()?;
        let tk = match m.kind {
            MemKind::Slots => {
                let slot = entry.arena.take_for(&t).map_err(|err| match err {
                    ws::TakeError::Full { .. } | ws::TakeError::Fragmented { .. } => Fail::new(
                        ws_status::WS_ERR_BUSY,
                        format!("tensor {}: every slot is held ({err})", t.name),
                    ),
                    _ => Fail::new(ws_status::WS_ERR_TOO_SMALL, format!("tensor {}: {err}", t.name)),
                })?;
                e.engine.read(&t, slot)?
            }
            MemKind::Caller | MemKind::Packed => {
                let need = e.engine.placement_bytes(&[&t])?;
                if need > m.len {
                    return Err(Fail::new(
                        ws_status::WS_ERR_TOO_SMALL,
                        format!(
                            "tensor {}: its {} bytes in whole blocks need up to {need} bytes; the memory has {}",
                            t.name, t.len, m.len
                        ),
                    ));
                }
                e.engine
                    .read_anywhere(&t, &entry.arena)
                    .map_err(|err| Fail::new(ws_status::WS_ERR_BUSY, Fail::from(err).msg))?
                    .1
            }
        };
        let tk = new_ticket(&m, tk, true);
        drop(entry);
        // SAFETY: non-NULL, valid for a write (the contract).
        unsafe { ticket.write(tk) };
        Ok(ws_status::WS_OK)
    })
}

/// Starts `n` reads (as `ws_read_into`, one ticket each in `tickets`). All
/// or nothing: when read k is refused, the k reads already started are
/// freed (their memory stays busy until the kernel is done with it, as
/// with `ws_ticket_free`), every `tickets[i]` is zeroed, and the error
/// names k.
///
/// # Safety
/// `reads` holds `n` `ws_read`s; `tickets` is valid for `n` writes.
#[no_mangle]
pub unsafe extern "C" fn ws_read_batch(
    engine: ws_engine,
    memory: ws_memory,
    reads: *const ws_read,
    n: usize,
    tickets: *mut ws_ticket,
) -> ws_status {
    guard("ws_read_batch", || {
        if n == 0 {
            return Ok(ws_status::WS_OK);
        }
        if n > MAX_BATCH {
            return Err(invalid(format!("n {n}: at most {MAX_BATCH} reads per batch")));
        }
        if reads.is_null() {
            return Err(null("reads"));
        }
        if tickets.is_null() {
            return Err(null("tickets"));
        }
        let (e, m) = engine_and_memory(engine, memory)?;
        // SAFETY: `reads` holds `n` entries (the contract); n is bounded.
        let reads = unsafe { std::slice::from_raw_parts(reads, n) };
        // SAFETY: `tickets` is valid for `n` writes (the contract).
        let out = unsafe { std::slice::from_raw_parts_mut(tickets, n) };
        for k in 0..n {
            match submit(&e, &m, &reads[k]) {
                Ok(t) => out[k] = t,
                Err(f) => {
                    for t in &out[..k] {
                        if let Ok(obj) = TICKETS.remove(t.id) {
                            *obj.lock() = State::Spent;
                        }
                    }
                    out.fill(ws_ticket::default());
                    return Err(Fail::new(f.code, format!("read {k} of {n}: {}", f.msg)));
                }
            }
        }
        Ok(ws_status::WS_OK)
    })
}

/// A completed read's outcome, and its `Loaded` when the ticket holds it.
/// Otherwise the `Loaded` is dropped here: the slot goes back to the
/// memory, and the bytes stay where they landed, the caller's to use.
fn finish(r: ws::Result<ws::Loaded>, hold: bool) -> (Res<Out>, Option<ws::Loaded>) {
    match r {
        Ok(loaded) => {
            let out = Out {
                offset: loaded.offset(),
                bytes: loaded.bytes().len() as u64,
                data: loaded.bytes().as_ptr() as usize,
            };
            (Ok(out), hold.then_some(loaded))
        }
        Err(e) => (Err(e.into()), None),
    }
}

/// Hands a completed read's outcome to the caller. A held success keeps
/// the ticket; anything else spends it.
///
/// # Safety
/// `result` is NULL or valid for a write.
unsafe fn deliver(
    id: u64,
    taken: Taken<'_>,
    (r, held): (Res<Out>, Option<ws::Loaded>),
    result: *mut ws_read_result,
) -> Res<ws_status> {
    if held.is_some() && r.is_ok() {
        taken.put(State::Done(r.clone(), held));
    } else {
        taken.put(State::Spent);
        let _ = TICKETS.remove(id);
    }
    let v = r?;
    if !result.is_null() {
        // SAFETY: non-NULL, valid for a write (the caller's contract).
        unsafe { result.write(v.result()) };
    }
    Ok(ws_status::WS_OK)
}

/// `WS_OK` (and `*result`, if not NULL) when the read is done, the ticket
/// then spent (unless it holds its bytes: `WS_READ_HOLD`, `ws_read_any`);
/// `WS_PENDING` when it is still in flight (or another thread is waiting on
/// it); the read's error (the ticket spent) when it failed. Never blocks.
///
/// # Safety
/// `result` is NULL or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn ws_ticket_poll(ticket: ws_ticket, result: *mut ws_read_result) -> ws_status {
    guard("ws_ticket_poll", || {
        let obj = TICKETS.get(ticket.id)?;
        let mut taken = match obj.take(ticket.id) {
            Ok(t) => t,
            Err(f) if f.code == ws_status::WS_ERR_BUSY => return Ok(ws_status::WS_PENDING),
            Err(f) => return Err(f),
        };
        let done = match taken.state.take() {
            Some(State::Done(r, held)) => (r, held),
            Some(State::Pending(t)) => match t.try_wait() {
                Ok(r) => finish(r, obj.hold),
                Err(t) => {
                    taken.put(State::Pending(t));
                    return Ok(ws_status::WS_PENDING);
                }
            },
            _ => unreachable!("take() hands out Pending or Done"),
        };
        // SAFETY: the contract above.
        unsafe { deliver(ticket.id, taken, done, result) }
    })
}

/// Blocks until the read is done (then as `ws_ticket_poll`) or `timeout_ms`
/// passes (`WS_TIMEOUT`, the ticket still valid). `UINT64_MAX` waits
/// without a bound. A ticket another thread is waiting on is
/// `WS_ERR_BUSY`; one already collected or freed is `WS_ERR_HANDLE`.
///
/// # Safety
/// `result` is NULL or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn ws_ticket_wait(ticket: ws_ticket, timeout_ms: u64, result: *mut ws_read_result) -> ws_status {
    guard("ws_ticket_wait", || {
        let obj = TICKETS.get(ticket.id)?;
        let mut taken = obj.take(ticket.id)?;
        let done = match taken.state.take() {
            Some(State::Done(r, held)) => (r, held),
            Some(State::Pending(t)) => {
                let waited = if timeout_ms == u64::MAX {
                    Ok(t.wait())
                } else {
                    t.wait_timeout(Duration::from_millis(timeout_ms))
                };
                match waited {
                    Ok(r) => finish(r, obj.hold),
                    Err(t) => {
                        taken.put(State::Pending(t));
                        return Ok(ws_status::WS_TIMEOUT);
                    }
                }
            }
            _ => unreachable!("take() hands out Pending or Done"),
        };
        // SAFETY: the contract above.
        unsafe { deliver(ticket.id, taken, done, result) }
    })
}

/// Whether the read is done, without collecting it: 1 done, 0 in flight.
///
/// # Safety
/// `done` is valid for a write.
#[no_mangle]
pub unsafe extern "C" fn ws_ticket_is_done(ticket: ws_ticket, done: *mut c_int) -> ws_status {
    guard("ws_ticket_is_done", || {
        let obj = TICKETS.get(ticket.id)?;
        if done.is_null() {
            return Err(null("done"));
        }
        let d = match &*obj.lock() {
            State::Pending(t) => t.is_ready(),
            State::Waiting => false,
            State::Done(..) => true,
            State::Spent => {
                return Err(Fail::new(
                    ws_status::WS_ERR_HANDLE,
                    format!("ticket {}: already collected or freed", ticket.id),
                ))
            }
        };
        // SAFETY: checked non-NULL; valid for a write (the contract).
        unsafe { done.write(c_int::from(d)) };
        Ok(ws_status::WS_OK)
    })
}

/// Writes 1 to an eventfd when a read completes: the waker of a polled
/// ticket. It owns a duplicate of the caller's eventfd (checked to be one:
/// a write to an eventfd never blocks short of 2^64 - 2 unread wake-ups, so
/// the I/O thread that wakes it never waits on the caller).
struct EventFdWaker(OwnedFd);

impl Wake for EventFdWaker {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }
    fn wake_by_ref(self: &Arc<Self>) {
        // No one to report an error to on the I/O thread; the ticket still
        // completes for poll and wait.
        let _ = rustix::io::write(&self.0, &1u64.to_ne_bytes());
    }
}

/// Whether `fd` is an eventfd (`/proc/self/fd/N` links to
/// `anon_inode:[eventfd]`).
fn is_eventfd(fd: c_int) -> bool {
    std::fs::read_link(format!("/proc/self/fd/{fd}")).is_ok_and(|p| p.as_os_str() == "anon_inode:[eventfd]")
}

/// Asks for a write of 1 to the eventfd `fd` when the read completes (at
/// once if it already has): a C event loop waits on `fd` (epoll, poll,
/// io_uring) and then collects the ticket with `ws_ticket_poll`. One fd may
/// serve many tickets. Anything but an eventfd is `WS_ERR_INVALID` (a pipe
/// could block the I/O thread). The library duplicates `fd`; the caller
/// keeps its own and may close it any time. A later call replaces the
/// earlier fd. A ticket another thread is waiting on is `WS_ERR_BUSY`.
#[no_mangle]
pub extern "C" fn ws_ticket_notify(ticket: ws_ticket, fd: c_int) -> ws_status {
    guard("ws_ticket_notify", || {
        let obj = TICKETS.get(ticket.id)?;
        if fd < 0 || !is_eventfd(fd) {
            return Err(invalid(format!("fd {fd} is not an eventfd (eventfd(2))")));
        }
        // SAFETY: only borrowed for the duplication below, during this call,
        // in which the caller keeps `fd` open (it passed it in).
        let borrowed = unsafe { BorrowedFd::borrow_raw(fd) };
        let own =
            rustix::io::fcntl_dupfd_cloexec(borrowed, 0).map_err(|e| invalid(format!("fd {fd}: duplicate it: {e}")))?;
        let waker = Arc::new(EventFdWaker(own));
        let mut taken = obj.take(ticket.id)?;
        match taken.state.take() {
            Some(State::Pending(mut t)) => {
                let w = Waker::from(Arc::clone(&waker));
                let mut cx = Context::from_waker(&w);
                match Pin::new(&mut t).poll(&mut cx) {
                    Poll::Ready(r) => {
                        let (r, held) = finish(r, obj.hold);
                        taken.put(State::Done(r, held));
                        waker.wake_by_ref();
                    }
                    Poll::Pending => taken.put(State::Pending(t)),
                }
            }
            Some(State::Done(r, held)) => {
                taken.put(State::Done(r, held));
                waker.wake_by_ref();
            }
            _ => unreachable!("take() hands out Pending or Done"),
        }
        Ok(ws_status::WS_OK)
    })
}

/// Drops a ticket. Not yet collected: a read still in flight completes
/// later, and until it does its bytes of memory stay busy (and
/// `ws_memory_unregister` waits for them). Holding its bytes
/// (`WS_READ_HOLD`, `ws_read_any`): gives them back. A second free is
/// `WS_ERR_HANDLE`; a free while another thread waits on the ticket is
/// `WS_ERR_BUSY`.
#[no_mangle]
pub extern "C" fn ws_ticket_free(ticket: ws_ticket) -> ws_status {
    guard("ws_ticket_free", || {
        let obj = TICKETS.get(ticket.id)?;
        let taken = obj.take(ticket.id)?;
        taken.put(State::Spent);
        let _ = TICKETS.remove(ticket.id);
        Ok(ws_status::WS_OK)
    })
}
