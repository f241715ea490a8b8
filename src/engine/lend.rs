//! Memory the caller owns, lent to an engine: pinned host memory of a GPU
//! runtime, a buffer of a C engine, a `Vec`'s allocation. It becomes an
//! [`Arena`] whose memory this crate never frees or unmaps, registered with
//! the rings like any arena, and reads land a payload at an offset the
//! caller names ([`Engine::read_into`]).

use std::ptr::NonNull;

use crate::engine::ticket::Ticket;
use crate::engine::Engine;
use crate::error::{Error, Result};
use crate::format::catalog::TensorRef;
use crate::memory::region::Region;
use crate::memory::{Arena, SlotSpec};

/// What [`Engine::read_into`] may write besides the payload.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Scratch {
    /// Nothing: exactly the payload's bytes are written. When the payload
    /// starts an O_DIRECT block of its file and its address is aligned too,
    /// its whole blocks go O_DIRECT and the tail buffered; otherwise the
    /// read goes buffered straight into place (counted as the `placed`
    /// fallback).
    #[default]
    None,
    /// Up to one block (the model's alignment, 4096 bytes typically) before
    /// the payload may be overwritten, so the O_DIRECT window can start on
    /// a block: in-place direct reads for any file offset, as in an
    /// engine's own arenas. When those bytes belong to another slot in use,
    /// the read falls back to [`Scratch::None`].
    Before,
}

impl Engine {
    /// Lends `len` bytes of the caller's memory at `ptr` to the engine, as
    /// an [`Arena`] registered with every ring (the same RLIMIT_MEMLOCK
    /// fallback as [`Engine::arena`]). Read into it with
    /// [`Engine::read_into`], or take slots with [`Arena::take_for`] /
    /// [`Arena::take_sized`]. The memory is never freed, unmapped or
    /// advised by this crate. Page-aligned memory reads O_DIRECT; anything
    /// else is read buffered (counted per read as a fallback).
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

    /// Reads `tensor` (or a range of it: [`TensorRef::byte_range`],
    /// [`TensorRef::rows`]) so that its payload lands at byte `at` of
    /// `memory` (an arena from [`Engine::register_memory`], or a packed
    /// arena), writing nothing after the payload and, with
    /// [`Scratch::None`], nothing before it. The range must not overlap a
    /// slot of `memory` in use (a read in flight, a `Loaded` held): that is
    /// an error, not a wait.
    pub fn read_into(&self, tensor: &TensorRef, memory: &Arena, at: usize, scratch: Scratch) -> Result<Ticket> {
        // First: in a forked child nothing below may lock (a parent thread
        // may have held the arena's lock at fork) or take a slot.
        self.origin.check()?;
        let len = usize::try_from(tensor.len)
            .map_err(|_| Error::Config(format!("tensor {}: {} bytes do not fit usize", tensor.name, tensor.len)))?;
        let end = at.checked_add(len).filter(|&e| e <= memory.bytes()).ok_or_else(|| {
            Error::Config(format!(
                "tensor {}: bytes [{at}, {at} + {len}) are outside the {}-byte memory",
                tensor.name,
                memory.bytes()
            ))
        })?;
        let align = self.model.required_align();
        let spec = SlotSpec::new(len).with_align(align);
        let pad = (tensor.offset % align as u64) as usize;
        // With scratch: the window's block starts `pad` bytes before the
        // payload, inside the memory and on an aligned address.
        let with_scratch = (scratch == Scratch::Before && at >= pad)
            .then(|| memory.take_at(at - pad, pad + len, spec, false))
            .flatten()
            .filter(|s| (s.base() as usize).is_multiple_of(align));
        // No scratch needed: the payload starts a block of its file and
        // lands on an aligned address, so the whole blocks go O_DIRECT and
        // only the tail is read buffered, nothing written after it.
        let on_block = || {
            (pad == 0 && len > 0)
                .then(|| memory.take_at(at, len, spec, false))
                .flatten()
                .filter(|s| (s.base() as usize).is_multiple_of(align))
        };
        let slot = match with_scratch.or_else(on_block) {
            Some(s) => s,
            None => memory.take_at(at, len, spec, true).ok_or_else(|| {
                Error::Config(format!(
                    "tensor {}: bytes [{at}, {end}) of the memory overlap a slot in use (a read in flight or a Loaded still held)",
                    tensor.name
                ))
            })?,
        };
        self.read(tensor, slot)
    }
}
