//! Memory the caller owns, lent to an engine: pinned host memory of a GPU
//! runtime, a buffer of a C engine, a `Vec`'s allocation. It becomes an
//! [`Arena`] whose memory this crate never frees or unmaps, registered with
//! the rings like any arena, and reads land a payload at an offset the
//! caller names ([`Engine::read_into`]) or one the engine chooses
//! ([`Engine::read_anywhere`], [`Engine::placement`]).
//!
//! Which reads are direct. O_DIRECT moves whole blocks of the file (`A` =
//! [`Engine::direct_align`] bytes) to an `A`-aligned address, so a payload
//! at file offset `off` can be read in place only where its address's
//! offset within a block (its phase) is `off % A`. At such an address the
//! read is in place and O_DIRECT; at any other, its blocks go O_DIRECT into
//! registered staging memory of the engine and one copy moves the payload
//! into place when the ticket is waited on (counted: [`Stats::staged`]).
//! No read into caller memory goes through the page cache unless no copy
//! of its shard can be opened O_DIRECT (counted as that fallback).
//!
//! The safe way to lend memory is [`Engine::lend`]: a `&mut [u8]` for the
//! length of a closure, which returns only once the kernel is done with
//! it. [`Engine::register_memory`] lends raw memory for as long as the
//! caller promises (`unsafe`: a C engine's buffer, a GPU runtime's pinned
//! host memory).
//!
//! [`Stats::staged`]: crate::Stats::staged

use std::marker::PhantomData;
use std::ptr::NonNull;
use std::sync::{Arc, Mutex};

use crate::config::DirectMode;
use crate::engine::inflight::Request;
use crate::engine::staging::{Staged, STAGING_MIN};
use crate::engine::sync::Arc as ReqArc;
use crate::engine::ticket::{Loaded, Ticket};
use crate::engine::Engine;
use crate::error::{Error, Result};
use crate::format::catalog::TensorRef;
use crate::format::dtype::Dtype;
use crate::format::element::Element;
use crate::memory::region::Region;
use crate::memory::{Arena, Slot, SlotSpec};
use crate::plan::placement::{window_bytes, Placement};

/// What [`Engine::read_into`] may write besides the payload, when the
/// payload's address is in phase with its file offset (see the module
/// docs); at any other address only the payload is written, whatever this
/// says.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Scratch {
    /// Nothing: exactly the payload's bytes are written. A payload that
    /// starts a block of its file (`off % A == 0`), at an aligned address
    /// and at least a block long, reads its whole blocks in place O_DIRECT
    /// and the rest of its last block buffered; any other goes O_DIRECT
    /// through staging and one copy.
    #[default]
    None,
    /// The bytes of the payload's first block before it (`off % A` bytes)
    /// may be overwritten: at an in-phase address the read is in place,
    /// its whole blocks O_DIRECT and the rest of its last block buffered.
    Before,
    /// The payload's whole blocks may be overwritten: the bytes of its
    /// first block before it and the rest of its last block after it. At
    /// an in-phase address every block is read in place O_DIRECT (only a
    /// last block that passes the end of the file is read buffered). This
    /// is what [`Engine::placement`] lays memory out for.
    Blocks,
}

/// Where an in-place read of a payload lands in memory: its window.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct InPlace {
    /// The window's first byte (an offset into the memory, on a block).
    start: usize,
    bytes: usize,
    /// The window takes the rest of its last block too.
    tail_room: bool,
}

/// The in-place window of a read of `len` payload bytes with phase `pad`
/// (`file offset % align`) at byte `at` of `bytes` bytes of memory at
/// address `base`, or None where it cannot land in place: out of phase
/// (`(base + at) % align != pad`), no room before the payload for the rest
/// of its first block, or a scratch that does not allow it there. The one
/// rule behind [`Engine::read_into`] and [`Engine::would_stage`].
fn in_place_window(
    scratch: Scratch,
    base: usize,
    bytes: usize,
    at: usize,
    pad: usize,
    len: usize,
    align: usize,
) -> Option<InPlace> {
    if len == 0 || at < pad || base.wrapping_add(at) % align != pad {
        return None;
    }
    // In phase: the window's first block starts `pad` bytes before the
    // payload, on an aligned address inside the memory.
    let start = at - pad;
    let blocks = window_bytes(pad, len as u64, align).filter(|w| start.checked_add(*w).is_some_and(|e| e <= bytes));
    match (scratch, blocks) {
        (Scratch::Blocks, Some(w)) => Some(InPlace {
            start,
            bytes: w,
            tail_room: true,
        }),
        (Scratch::Blocks | Scratch::Before, _) if pad + len >= align => Some(InPlace {
            start,
            bytes: pad + len,
            tail_room: false,
        }),
        (Scratch::None, _) if pad == 0 && len >= align => Some(InPlace {
            start: at,
            bytes: len,
            tail_room: false,
        }),
        _ => None,
    }
}

impl Engine {
    /// Lends `len` bytes of the caller's memory at `ptr` to the engine, as
    /// an [`Arena`] registered with every ring (the same RLIMIT_MEMLOCK
    /// fallback as [`Engine::arena`]). Read into it with
    /// [`Engine::read_into`] or [`Engine::read_anywhere`], or take slots
    /// with [`Arena::take_for`] / [`Arena::take_sized`]. The memory is
    /// never freed, unmapped or advised by this crate. Which reads are in
    /// place and O_DIRECT: see [`Engine::read_into`]. Prefer the safe
    /// [`Engine::lend`] where the memory is a Rust slice.
    ///
    /// # Safety
    /// - `ptr..ptr + len` is valid for reads and writes, and stays so (not
    ///   freed, unmapped, remapped or made read-only) until the returned
    ///   arena and every slot, ticket and `Loaded` taken from it are
    ///   dropped: the kernel may write into it until a read completes, and
    ///   a ticket dropped early completes later.
    /// - While a slot of it exists, the caller neither reads nor writes the
    ///   slot's bytes except through that slot (in particular never while a
    ///   read into it is in flight), and does not lend the same bytes to
    ///   another arena.
    /// - A forked child must not touch the memory through this arena (it is
    ///   the caller's mapping: `MADV_DONTFORK` is not set on it).
    pub unsafe fn register_memory(&self, ptr: NonNull<u8>, len: usize) -> Result<Arena> {
        self.origin.check()?;
        if len == 0 || len > isize::MAX as usize {
            return Err(Error::Config(format!(
                "register_memory: {len} bytes (must be 1 to isize::MAX)"
            )));
        }
        // SAFETY: the caller's obligations above are exactly Region::borrowed's.
        let region = unsafe { Region::borrowed(ptr, len) };
        let arena = Arena::packed_over(region, self.model.required_align(), None);
        self.maybe_register(&arena);
        Ok(arena)
    }

    /// The block size `A` of O_DIRECT reads of this model (the largest
    /// alignment any of its files needs, at least 4096): a payload at file
    /// offset `off` is read in place O_DIRECT at an address `a` with
    /// `a % A == off % A`.
    pub fn direct_align(&self) -> usize {
        self.model.required_align()
    }

    /// Where the payloads of `tensors` land in `memory` (an arena from
    /// [`Engine::register_memory`] or [`Engine::packed_arena`]) so that
    /// every read of them with [`Scratch::Blocks`] is in place and
    /// O_DIRECT: back to back from its first aligned address, each on its
    /// phase. Errors when they do not fit in `memory` (the message gives
    /// the bytes they need).
    pub fn placement(&self, tensors: &[&TensorRef], memory: &Arena) -> Result<Placement> {
        self.placement_from(tensors, memory, 0)
    }

    /// [`Engine::placement`] from byte `from` of `memory` on (offsets are
    /// still from its start): one half of a double buffer, say.
    pub fn placement_from(&self, tensors: &[&TensorRef], memory: &Arena, from: usize) -> Result<Placement> {
        let (base, bytes) = memory.region();
        let start = (base as usize)
            .checked_add(from)
            .filter(|_| from <= bytes)
            .ok_or_else(|| Error::Config(format!("placement: byte {from} is outside the {bytes}-byte memory")))?;
        let p = Placement::of_tensors(tensors, start, self.direct_align())?.shifted(from)?;
        if p.bytes() > bytes {
            return Err(Error::Config(format!(
                "placement: {} tensors need {} bytes of this memory (from byte {from}, its first {}-aligned address on), it has {bytes}",
                tensors.len(),
                p.bytes() - from,
                self.direct_align()
            )));
        }
        Ok(p)
    }

    /// The bytes memory must have (wherever it starts) to hold `tensors`
    /// placed by [`Engine::placement`].
    pub fn placement_bytes(&self, tensors: &[&TensorRef]) -> Result<usize> {
        Placement::bytes_for(tensors.iter().map(|t| (t.offset, t.len)), self.direct_align())
    }

    /// Reads `tensor` (or a range of it: [`TensorRef::byte_range`],
    /// [`TensorRef::rows`]) so that its payload lands at byte `at` of
    /// `memory` (an arena from [`Engine::register_memory`] or
    /// [`Engine::packed_arena`]). The range must not overlap a slot of
    /// `memory` in use (a read in flight, a `Loaded` held): that is an
    /// error, not a wait.
    ///
    /// Which addresses are direct, with `A` = [`Engine::direct_align`] and
    /// `off` the tensor's file offset:
    /// - **In phase** (`(memory base + at) % A == off % A`) and `scratch`
    ///   allows it: in place, O_DIRECT. [`Scratch::Blocks`] reads every
    ///   block direct; [`Scratch::Before`] and (for `off % A == 0`)
    ///   [`Scratch::None`] read the rest of the last block buffered.
    /// - **Anywhere else**: the payload's blocks go O_DIRECT into the
    ///   engine's registered staging memory, and one copy moves exactly the
    ///   payload's bytes into place when the ticket is waited on (or
    ///   polled), on that thread. Counted in [`Stats::staged`] with the
    ///   copy's CPU time. Nothing but the payload is written.
    ///
    /// Only when no copy of the shard can be read O_DIRECT (`DirectMode::Off`,
    /// or the file system refused O_DIRECT, counted) does the read go
    /// buffered straight into place.
    ///
    /// [`Stats::staged`]: crate::Stats::staged
    pub fn read_into(&self, tensor: &TensorRef, memory: &Arena, at: usize, scratch: Scratch) -> Result<Ticket> {
        // First: in a forked child nothing below may lock (a parent thread
        // may have held the arena's lock at fork) or take a slot.
        self.origin.check()?;
        let len = usize::try_from(tensor.len)
            .map_err(|_| Error::Config(format!("tensor {}: {} bytes do not fit usize", tensor.name, tensor.len)))?;
        let dest = Destination {
            call: "read_into",
            fixed_slots: " (use Engine::read with Arena::take)",
            name: &tensor.name,
            what: "bytes",
            at,
            len,
        };
        dest.check(memory)?;
        let align = self.direct_align();
        let spec = SlotSpec::new(len).with_align(align);
        let pad = (tensor.offset % align as u64) as usize;
        let direct = self.can_read_direct(tensor);
        let window = in_place_window(scratch, memory.region().0 as usize, memory.bytes(), at, pad, len, align);
        if let (true, Some(w)) = (direct, window) {
            let spec = if w.tail_room { spec.with_tail_room(true) } else { spec };
            if let Some(slot) = memory.take_at(w.start, w.bytes, spec, false) {
                return self.read(tensor, slot);
            }
        }
        // Exactly the payload's bytes, whatever goes around them.
        let dest = dest.take(memory, spec)?;
        if !direct || len == 0 {
            // Buffered into place: the refusal is counted when it is planned.
            return self.read(tensor, dest);
        }
        let stage = self.staging_slot(tensor, pad, align)?;
        let ticket = self.read(tensor, stage)?;
        Ok(ticket.staged(Staged::new(dest, Arc::clone(&self.staging.counters))))
    }

    /// Reads `tensor` into `memory` (an arena from
    /// [`Engine::register_memory`] or [`Engine::packed_arena`]) at a place
    /// the engine chooses: the lowest free run of its whole blocks, in
    /// phase, so the read is in place and O_DIRECT (as
    /// [`Scratch::Blocks`]). Returns the payload's offset in `memory` and
    /// the ticket; errors when no free run of the memory holds it.
    pub fn read_anywhere(&self, tensor: &TensorRef, memory: &Arena) -> Result<(usize, Ticket)> {
        self.origin.check()?;
        if !memory.is_packed() {
            return Err(Error::Config(format!(
                "tensor {}: read_anywhere needs memory from Engine::register_memory, Engine::lend or Engine::packed_arena (for fixed slots use Engine::read with Arena::take)",
                tensor.name
            )));
        }
        let align = self.direct_align();
        let pad = (tensor.offset % align as u64) as usize;
        let len = usize::try_from(tensor.len)
            .map_err(|_| Error::Config(format!("tensor {}: {} bytes do not fit usize", tensor.name, tensor.len)))?;
        let want = window_bytes(pad, tensor.len, align)
            .ok_or_else(|| Error::Config(format!("tensor {}: its blocks do not fit usize", tensor.name)))?;
        let spec = SlotSpec::new(len).with_align(align).with_tail_room(true);
        let slot = memory.take_window(want, spec).ok_or_else(|| {
            Error::Config(format!(
                "tensor {}: no free run of {want} bytes ({len} bytes of payload in whole {align}-byte blocks) in the {}-byte memory ({} bytes free)",
                tensor.name,
                memory.bytes(),
                memory.available()
            ))
        })?;
        let at = slot.offset() + pad;
        Ok((at, self.read(tensor, slot)?))
    }

    /// Whether some copy of `tensor`'s shard can be read O_DIRECT.
    /// Whether [`Engine::read_into`] of `tensor` at byte `at` of `memory`
    /// with `scratch` would go through staging (and one copy) rather than
    /// land in place: out of phase, no room before the payload for its
    /// block, or a scratch that does not allow it there. The answer leaves
    /// slots in use aside (a read into bytes another read holds is staged
    /// too, or refused: [`Ticket::is_staged`] says after the fact). A read
    /// that cannot be O_DIRECT at all is buffered into place, not staged.
    pub fn would_stage(&self, tensor: &TensorRef, memory: &Arena, at: usize, scratch: Scratch) -> bool {
        let align = self.direct_align();
        let Ok(len) = usize::try_from(tensor.len) else {
            return true;
        };
        let pad = (tensor.offset % align as u64) as usize;
        self.can_read_direct(tensor)
            && len > 0
            && in_place_window(scratch, memory.region().0 as usize, memory.bytes(), at, pad, len, align).is_none()
    }

    fn can_read_direct(&self, tensor: &TensorRef) -> bool {
        self.model.direct_mode() != DirectMode::Off
            && self
                .model
                .copies(tensor.shard)
                .iter()
                .any(|&i| self.model.files()[i].direct.is_some())
    }

    /// A staging slot for `tensor`'s whole blocks, from the first staging
    /// arena with room, or a new one (registered like any arena).
    pub(crate) fn staging_slot(&self, tensor: &TensorRef, pad: usize, align: usize) -> Result<Slot> {
        let len = tensor.len as usize;
        let want = window_bytes(pad, tensor.len, align)
            .ok_or_else(|| Error::Config(format!("tensor {}: its blocks do not fit usize", tensor.name)))?;
        let spec = SlotSpec::new(len).with_align(align).with_tail_room(true);
        if let Some(s) = self.staging.take(want, spec) {
            return Ok(s);
        }
        // No staging lock is held while the new arena is mapped and
        // registered (a round trip to every ring thread).
        let bytes = want.max(STAGING_MIN).max(self.staging.bytes());
        let arena = self.packed_arena(bytes, true).map_err(|e| {
            Error::Config(format!(
                "tensor {}: its address in the caller's memory is out of phase with its file offset, and {bytes} bytes of staging could not be mapped: {e}",
                tensor.name
            ))
        })?;
        tracing::info!(
            "staging: mapped {} bytes for reads into caller memory out of phase (tensor {})",
            arena.bytes(),
            tensor.name
        );
        self.staging.add(arena, want, spec).ok_or_else(|| {
            Error::Config(format!(
                "tensor {}: a fresh staging arena of {bytes} bytes has no run of {want}",
                tensor.name
            ))
        })
    }

    /// Lends `memory` to the engine for the length of `f`: the safe form
    /// of [`Engine::register_memory`]. `f` reads into it through the
    /// [`Lent`] it is given ([`Lent::read_into`], [`Lent::read_anywhere`],
    /// [`Lent::placement`]); payloads come back as [`LentLoaded`], which
    /// cannot outlive the call. `lend` returns only once the kernel is
    /// done with every read into the memory, also when `f` panics or a
    /// ticket was dropped or forgotten, so the memory is the caller's
    /// again, with every payload read into it, when `lend` returns.
    ///
    /// If an I/O thread died with a read into the memory still in the
    /// kernel (see the failure model), returning could hand the caller
    /// memory the kernel may still write: the process is aborted instead,
    /// with a message.
    ///
    /// ```
    /// use weightstream::{Dtype, Engine, EngineConfig, Model, ModelConfig, Scratch};
    /// # fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// # let dir = weightstream::__internal::doc_model("lend", &[("a", Dtype::U8, 9000), ("b", Dtype::U8, 7000)])?;
    /// let model = Model::open(ModelConfig::new(&dir))?;
    /// let engine = Engine::new(&model, EngineConfig::default())?;
    /// let (a, b) = (model.tensor("a")?, model.tensor("b")?);
    /// let mut buf = vec![0u8; engine.placement_bytes(&[a, b])?];
    /// let placed = engine.lend(&mut buf, |mem| -> weightstream::Result<_> {
    ///     let p = mem.placement(&[a, b])?; // in phase: in place and O_DIRECT
    ///     let ta = mem.read_into(a, p.at(0), Scratch::Blocks)?;
    ///     let tb = mem.read_into(b, p.at(1), Scratch::Blocks)?;
    ///     assert_eq!((ta.wait()?.len(), tb.wait()?.len()), (9000, 7000));
    ///     Ok(p)
    /// })??;
    /// // The memory is the caller's again, with both payloads in it.
    /// assert_eq!(buf[placed.at(1) + 5], 5);
    /// # drop(engine);
    /// # std::fs::remove_dir_all(&dir)?;
    /// # Ok(())
    /// # }
    /// ```
    pub fn lend<'mem, F, R>(&self, memory: &'mem mut [u8], f: F) -> Result<R>
    where
        F: for<'scope> FnOnce(&'scope Lent<'scope, 'mem>) -> R,
    {
        self.origin.check()?;
        let ptr = NonNull::new(memory.as_mut_ptr())
            .filter(|_| !memory.is_empty())
            .ok_or_else(|| Error::Config("lend: the memory is empty".into()))?;
        // SAFETY: `memory` is borrowed mutably for 'mem, which outlives
        // this call, and this call returns only after `SettleOnExit` has
        // seen every read into it complete (or aborts): the memory stays
        // valid while the kernel or this crate may touch it. The caller
        // cannot reach it during the call (it is borrowed), `f` reaches it
        // only through slots of this arena, and `LentLoaded`s cannot leave
        // `f`. A forgotten slot or `Loaded` keeps only an address.
        let arena = unsafe { self.register_memory(ptr, memory.len())? };
        let lent = Lent {
            engine: self,
            arena,
            reads: Mutex::new(Vec::new()),
            _scope: PhantomData,
            _mem: PhantomData,
        };
        let guard = SettleOnExit(&lent);
        let r = f(&lent);
        drop(guard);
        Ok(r)
    }
}

/// Waits, when a [`Lent`] scope ends (normally or by a panic), until the
/// kernel is done with every read into the lent memory.
struct SettleOnExit<'a, 'scope, 'mem>(&'a Lent<'scope, 'mem>);

impl Drop for SettleOnExit<'_, '_, '_> {
    fn drop(&mut self) {
        if self.0.engine.origin.forked() {
            // A forked child: the engine's threads are not here, and the
            // kernel writes into the parent's pages, not this copy.
            return;
        }
        let reads = std::mem::take(&mut *self.0.reads.lock().unwrap_or_else(|p| p.into_inner()));
        for r in reads {
            if !r.settle() {
                eprintln!(
                    "weightstream: an I/O thread stopped with a read into memory lent by Engine::lend still in the kernel; \
                     returning would hand that memory back while the kernel may write it: aborting"
                );
                std::process::abort();
            }
        }
    }
}

/// Memory lent to an engine for the length of an [`Engine::lend`] call.
///
/// Nothing read into it can outlive the call, and the memory cannot be
/// touched while it is lent (each of these is a compile error):
///
/// ```compile_fail
/// # use weightstream::{Engine, Scratch, TensorRef};
/// # fn f(engine: &Engine, t: &TensorRef) {
/// let mut buf = vec![0u8; 1 << 20];
/// // A payload returned out of the scope.
/// let kept = engine.lend(&mut buf, |mem| mem.read_into(t, 0, Scratch::None).unwrap().wait().unwrap());
/// # }
/// ```
///
/// ```compile_fail,E0521
/// # use weightstream::{Engine, Scratch, TensorRef};
/// # fn f(engine: &Engine, t: &TensorRef) {
/// let mut buf = vec![0u8; 1 << 20];
/// let mut kept = Vec::new();
/// // A ticket stored outside the scope.
/// engine.lend(&mut buf, |mem| kept.push(mem.read_into(t, 0, Scratch::None).unwrap())).unwrap();
/// # }
/// ```
///
/// ```compile_fail,E0499
/// # use weightstream::{Engine, Scratch, TensorRef};
/// # fn f(engine: &Engine, t: &TensorRef) {
/// let mut buf = vec![0u8; 1 << 20];
/// // The memory written while a read into it may be in flight.
/// engine.lend(&mut buf, |mem| { let _k = mem.read_into(t, 0, Scratch::None); buf[0] = 1; }).unwrap();
/// # }
/// ```
pub struct Lent<'scope, 'mem> {
    engine: &'scope Engine,
    arena: Arena,
    /// Every read into the memory (pruned of finished ones as it grows).
    reads: Mutex<Vec<ReqArc<Request<Slot>>>>,
    /// Invariant in 'scope, as `std::thread::Scope`.
    _scope: PhantomData<&'scope mut &'scope ()>,
    _mem: PhantomData<&'mem mut [u8]>,
}

impl std::fmt::Debug for Lent<'_, '_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Lent").field("bytes", &self.arena.bytes()).finish()
    }
}

impl<'scope> Lent<'scope, '_> {
    /// Bytes of the lent memory.
    pub fn len(&self) -> usize {
        self.arena.bytes()
    }

    /// Whether the memory is empty (never: `lend` refuses that).
    pub fn is_empty(&self) -> bool {
        self.arena.bytes() == 0
    }

    /// Bytes not held by a read in flight or a payload.
    pub fn available(&self) -> usize {
        self.arena.available()
    }

    /// [`Engine::placement`] in this memory.
    pub fn placement(&self, tensors: &[&TensorRef]) -> Result<Placement> {
        self.engine.placement(tensors, &self.arena)
    }

    /// [`Engine::placement_from`] in this memory.
    pub fn placement_from(&self, tensors: &[&TensorRef], from: usize) -> Result<Placement> {
        self.engine.placement_from(tensors, &self.arena, from)
    }

    /// The address of the memory's first byte (for alignment arithmetic:
    /// an engine that fixes its own tensor addresses).
    pub fn addr(&self) -> usize {
        self.arena.region().0 as usize
    }

    /// [`Engine::read_into`] this memory at byte `at`.
    pub fn read_into(&self, tensor: &TensorRef, at: usize, scratch: Scratch) -> Result<LentTicket<'scope>> {
        let t = self.engine.read_into(tensor, &self.arena, at, scratch)?;
        Ok(self.track(t))
    }

    /// [`Engine::read_anywhere`] in this memory: the payload's offset and
    /// its ticket.
    pub fn read_anywhere(&self, tensor: &TensorRef) -> Result<(usize, LentTicket<'scope>)> {
        let (at, t) = self.engine.read_anywhere(tensor, &self.arena)?;
        Ok((at, self.track(t)))
    }

    fn track(&self, t: Ticket) -> LentTicket<'scope> {
        let mut reads = self.reads.lock().unwrap_or_else(|p| p.into_inner());
        if reads.len() >= 64 && reads.len().is_power_of_two() {
            reads.retain(|r| !r.is_done());
        }
        reads.push(t.request());
        LentTicket {
            ticket: t,
            _scope: PhantomData,
        }
    }
}

/// A read into lent memory in flight ([`Ticket`], bound to the
/// [`Engine::lend`] call). Also a `Future`.
#[derive(Debug)]
#[must_use = "a ticket owns its slot; wait() for the payload"]
pub struct LentTicket<'scope> {
    ticket: Ticket,
    _scope: PhantomData<&'scope mut &'scope ()>,
}

impl<'scope> LentTicket<'scope> {
    /// [`Ticket::wait`].
    pub fn wait(self) -> Result<LentLoaded<'scope>> {
        self.ticket.wait().map(LentLoaded::new)
    }

    /// [`Ticket::wait_timeout`].
    pub fn wait_timeout(self, timeout: std::time::Duration) -> std::result::Result<Result<LentLoaded<'scope>>, Self> {
        match self.ticket.wait_timeout(timeout) {
            Ok(r) => Ok(r.map(LentLoaded::new)),
            Err(ticket) => Err(LentTicket {
                ticket,
                _scope: PhantomData,
            }),
        }
    }

    /// Whether every chunk has completed.
    pub fn is_ready(&self) -> bool {
        self.ticket.is_ready()
    }

    /// The name of the tensor being read.
    pub fn name(&self) -> &str {
        self.ticket.name()
    }
}

impl<'scope> std::future::Future for LentTicket<'scope> {
    type Output = Result<LentLoaded<'scope>>;
    fn poll(self: std::pin::Pin<&mut Self>, cx: &mut std::task::Context<'_>) -> std::task::Poll<Self::Output> {
        std::pin::Pin::new(&mut self.get_mut().ticket)
            .poll(cx)
            .map(|r| r.map(LentLoaded::new))
    }
}

/// A payload landed in lent memory ([`Loaded`], bound to the
/// [`Engine::lend`] call). Dropping it frees its bytes for other reads.
pub struct LentLoaded<'scope> {
    loaded: Loaded,
    _scope: PhantomData<&'scope mut &'scope ()>,
}

impl LentLoaded<'_> {
    fn new(loaded: Loaded) -> Self {
        LentLoaded {
            loaded,
            _scope: PhantomData,
        }
    }

    /// The tensor's name.
    pub fn name(&self) -> &str {
        self.loaded.name()
    }

    /// The payload's dtype.
    pub fn dtype(&self) -> Dtype {
        self.loaded.dtype()
    }

    /// The payload's shape.
    pub fn shape(&self) -> &[usize] {
        self.loaded.shape()
    }

    /// The payload's offset in the lent memory.
    pub fn offset(&self) -> usize {
        self.loaded.offset()
    }

    /// [`Loaded::as_slice`].
    pub fn as_slice<T: Element>(&self) -> Result<&[T]> {
        self.loaded.as_slice()
    }

    /// [`Loaded::as_mut_slice`].
    pub fn as_mut_slice<T: Element>(&mut self) -> Result<&mut [T]> {
        self.loaded.as_mut_slice()
    }

    /// The payload's bytes, writable.
    pub fn bytes_mut(&mut self) -> &mut [u8] {
        self.loaded.bytes_mut()
    }
}

impl std::ops::Deref for LentLoaded<'_> {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        &self.loaded
    }
}

impl std::fmt::Debug for LentLoaded<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.loaded.fmt(f)
    }
}

/// Where a caller placed a read in packed memory: bytes `[at, at + len)`
/// for `call` (its name, for the messages) of tensor `name` (`what`: the
/// bytes' kind in the messages; `fixed_slots`: what to use instead with
/// an arena of fixed slots, or nothing). The checks `read_into` and
/// `read_slice` share.
pub(super) struct Destination<'a> {
    pub(super) call: &'static str,
    pub(super) fixed_slots: &'static str,
    pub(super) name: &'a str,
    pub(super) what: &'static str,
    pub(super) at: usize,
    pub(super) len: usize,
}

impl Destination<'_> {
    /// The bytes lie inside `memory`, and `memory` is packed (a caller
    /// places reads only there).
    pub(super) fn check(&self, memory: &Arena) -> Result<()> {
        let Destination {
            call,
            fixed_slots,
            name,
            what,
            at,
            len,
        } = *self;
        if at.checked_add(len).is_none_or(|end| end > memory.bytes()) {
            return Err(Error::Config(format!(
                "tensor {name}: {what} [{at}, {at} + {len}) are outside the {}-byte memory",
                memory.bytes()
            )));
        }
        if !memory.is_packed() {
            return Err(Error::Config(format!(
                "tensor {name}: {call} needs memory from Engine::register_memory, Engine::lend or Engine::packed_arena, \
                 not an arena of fixed slots{fixed_slots}"
            )));
        }
        Ok(())
    }

    /// Exactly these bytes of `memory` as a slot (after [`Self::check`]);
    /// an error when they overlap a slot in use.
    pub(super) fn take(&self, memory: &Arena, spec: SlotSpec) -> Result<Slot> {
        let Destination {
            name, what, at, len, ..
        } = *self;
        memory.take_at(at, len, spec, true).ok_or_else(|| {
            Error::Config(format!(
                "tensor {name}: {what} [{at}, {}) of the memory overlap a slot in use (a read in flight or a Loaded still held)",
                at + len
            ))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lands(scratch: Scratch, base: usize, bytes: usize, at: usize, pad: usize, len: usize) -> bool {
        in_place_window(scratch, base, bytes, at, pad, len, 4096).is_some()
    }

    #[test]
    fn the_in_place_window_follows_phase_room_and_scratch() {
        // Phase 100: in place at base + at = 100 mod 4096, with room before.
        assert_eq!(
            in_place_window(Scratch::Before, 0, 1 << 20, 100, 100, 5000, 4096),
            Some(InPlace {
                start: 0,
                bytes: 5100,
                tail_room: false
            })
        );
        assert!(!lands(Scratch::Before, 0, 1 << 20, 101, 100, 5000), "out of phase");
        assert!(
            !lands(Scratch::Before, 0, 1 << 20, 100, 100, 10),
            "inside its first block only"
        );
        // Blocks: the whole blocks when they fit the memory, a short payload too.
        assert_eq!(
            in_place_window(Scratch::Blocks, 0, 1 << 20, 0, 0, 100, 4096),
            Some(InPlace {
                start: 0,
                bytes: 4096,
                tail_room: true
            })
        );
        assert!(
            !lands(Scratch::Blocks, 0, 50, 0, 0, 40),
            "its block does not fit the memory"
        );
        assert!(
            lands(Scratch::Blocks, 0, 4196, 100, 100, 4096),
            "falls back to the payload's own end"
        );
        // None: only on a block boundary, at least a block.
        assert!(lands(Scratch::None, 0, 1 << 20, 4096, 0, 4096));
        assert!(!lands(Scratch::None, 0, 1 << 20, 4096, 0, 100));
        assert!(!lands(Scratch::None, 0, 1 << 20, 100, 100, 5000));
        // Nothing to read: no window.
        assert!(!lands(Scratch::Blocks, 0, 1 << 20, 0, 0, 0));
        // The memory's own base shifts the phase.
        assert!(
            !lands(Scratch::Before, 100, 1 << 20, 0, 100, 5000),
            "in phase, but no room before"
        );
        assert!(lands(Scratch::Before, 100, 1 << 20, 4096, 100, 5000));
        assert!(
            !lands(Scratch::Before, 100, 1 << 20, 100, 100, 5000),
            "base + at is 200 mod 4096"
        );
    }
}
