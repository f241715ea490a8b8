//! Arenas registered with every ring as fixed buffers: a table of ranges
//! per engine, registration through each ring's own thread (no lock held
//! across the round trip), and unregistration when the arena goes.

use std::sync::Arc;

use crate::engine::backend::ring::{MAX_FIXED_BUFFERS, MAX_FIXED_BUFFER_BYTES};
use crate::engine::completion;
use crate::engine::queue::{Control, Plain};
use crate::engine::sync::lock_std as lock;
use crate::engine::{Backend, Engine};
use crate::memory::limits::memlock_limit;
use crate::memory::{Arena, Slot};

/// An arena registered as fixed buffers: its pieces (`Arena::pieces`, at
/// most 1 GiB each) at table indices `first..first + n`.
pub(crate) struct ArenaReg {
    id: u64,
    first: u32,
    n: u32,
}

pub(crate) struct Registry {
    pub(crate) arenas: Vec<ArenaReg>,
    /// Table ranges `(first, n)` free for reuse (their arena was released).
    pub(crate) holes: Vec<(u32, u32)>,
    next: u32,
    pub(crate) unregistered: Option<String>,
    /// Arenas refused registration (each warned in `Engine::warnings`).
    pub(crate) refused_arenas: u64,
    /// The last refused arena's size, and whether RLIMIT_MEMLOCK refused it.
    pub(crate) last_refused: Option<(u64, bool)>,
}

impl Registry {
    pub(crate) fn new(unregistered: Option<String>) -> Self {
        Registry {
            arenas: Vec::new(),
            holes: Vec::new(),
            next: 0,
            unregistered,
            refused_arenas: 0,
            last_refused: None,
        }
    }

    /// A free range of `n` table entries: a hole first-fit, else the end.
    fn alloc(&mut self, n: u32) -> Option<u32> {
        if let Some(i) = self.holes.iter().position(|h| h.1 >= n) {
            let (first, len) = self.holes[i];
            if len == n {
                self.holes.remove(i);
            } else {
                self.holes[i] = (first + n, len - n);
            }
            return Some(first);
        }
        (self.next + n <= MAX_FIXED_BUFFERS).then(|| {
            self.next += n;
            self.next - n
        })
    }
}

impl Engine {
    pub(crate) fn maybe_register(&self, arena: &Arena) {
        // Asked, even when fixed buffers are off for this engine: its reads
        // without one are then counted as the fallback they are. An arena
        // that discards freed pages is never registered (its reads are
        // plain by the caller's choice).
        if !arena.mark_register_asked() {
            return;
        }
        if matches!(self.backend, Backend::Uring) && self.fixed_buffers_ok {
            self.register(arena);
        }
    }

    /// Registers `arena` with every running ring. No lock is held while a
    /// ring thread is asked (a ring thread may itself need the registry: an
    /// arena's release hook runs wherever its last slot is dropped).
    fn register(&self, arena: &Arena) {
        let bytes = arena.bytes();
        let refuse = |why: String, memlock: bool| {
            let mut reg = lock(&self.registry);
            if reg.unregistered.is_none() {
                tracing::warn!("arena of {bytes} bytes not registered as fixed buffers: {why}; its reads use plain Read (counted as chunks_unregistered)");
            }
            reg.unregistered = Some(why);
            reg.refused_arenas += 1;
            reg.last_refused = Some((bytes as u64, memlock));
        };
        let Some(iovecs) = arena.pieces() else {
            return refuse(
                format!(
                    "a slot of {} bytes exceeds the {MAX_FIXED_BUFFER_BYTES}-byte fixed-buffer limit",
                    arena.slot_len()
                ),
                false,
            );
        };
        let n = iovecs.len() as u32;
        let Some(first) = lock(&self.registry).alloc(n) else {
            return refuse(
                format!("the fixed-buffer table ({MAX_FIXED_BUFFERS} entries) is full"),
                false,
            );
        };
        let mut took = Vec::with_capacity(self.io.queues.len());
        for (i, q) in self.io.queues.iter().enumerate() {
            let (tx, rx) = std::sync::mpsc::channel();
            let pushed = q.push_control(Control::RegisterBuffers {
                first,
                iovecs: iovecs.clone(),
                reply: tx,
            });
            if pushed.is_err() {
                continue; // a stopped drive: no read goes there any more
            }
            let failed = match rx.recv() {
                Ok(Ok(())) => {
                    took.push(i);
                    None
                }
                Ok(Err(e)) if e.to_string() == completion::DRIVE_CLOSED => None,
                Err(_) => None, // the thread stopped without answering
                Ok(Err(e)) if e.raw_os_error() == Some(libc::ENOMEM) => {
                    let (soft, _) = memlock_limit();
                    let need_kib = (bytes.div_ceil(1024) * self.io.queues.len()) as u64;
                    Some((soft.is_some(), format!(
                        "registering {bytes} bytes failed with ENOMEM: RLIMIT_MEMLOCK is {}; raise it (`ulimit -l {}` or more, in KiB) or run with CAP_IPC_LOCK",
                        soft.map_or("unlimited".to_string(), |s| format!("{s} bytes")),
                        need_kib + soft.unwrap_or(0) / 1024
                    )))
                }
                Ok(Err(e)) => Some((false, format!("register_buffers_update: {e}"))),
            };
            if let Some((memlock, why)) = failed {
                // Undo the rings that took it, and give the range back.
                for &j in &took {
                    let _ = self.io.queues[j].push_control(Control::UnregisterBuffers { first, n });
                }
                lock(&self.registry).holes.push((first, n));
                return refuse(why, memlock);
            }
        }
        lock(&self.registry).arenas.push(ArenaReg {
            id: arena.id(),
            first,
            n,
        });
        // When the arena goes, empty its entries in every ring (unpinning the
        // pages and returning the locked-memory charge) and free the range.
        // Control messages run in order per ring, so a later registration of
        // the same range always follows the unregistration. This may run on
        // a ring thread (its last slot dropped there): it holds the registry
        // only while it queues the unregistrations (no waiting), and nobody
        // holds the registry while waiting for a ring.
        let registry = Arc::downgrade(&self.registry);
        let queues: Vec<_> = self.io.queues.iter().map(Arc::downgrade).collect();
        let id = arena.id();
        let origin = self.origin;
        arena.on_release(move || {
            if origin.forked() {
                return; // a child has no rings, and the registry lock may be held forever
            }
            let Some(registry) = registry.upgrade() else { return };
            let mut reg = lock(&registry);
            let Some(i) = reg.arenas.iter().position(|a| a.id == id) else {
                return;
            };
            let a = reg.arenas.swap_remove(i);
            // Queued before the range is free again, so in every ring this
            // unregistration precedes any later registration of the range.
            for q in queues.iter().filter_map(|q| q.upgrade()) {
                let _ = q.push_control(Control::UnregisterBuffers { first: a.first, n: a.n });
            }
            reg.holes.push((a.first, a.n));
        });
    }

    /// Whether `arena` is registered with this engine's rings now.
    pub(crate) fn is_registered(&self, arena: &Arena) -> bool {
        let id = arena.id();
        lock(&self.registry).arenas.iter().any(|a| a.id == id)
    }

    /// The fixed buffer a read into `slot` uses, and why it has none.
    pub(crate) fn buf_index(&self, slot: &Slot) -> (Option<u16>, Plain) {
        if !matches!(self.backend, Backend::Uring) {
            return (None, Plain::NoRing);
        }
        let reg = lock(&self.registry);
        let Some(a) = reg.arenas.iter().find(|a| a.id == slot.arena_id()) else {
            // Not registered here: a fallback when an engine asked for it
            // (refused, fixed buffers off, or another engine's arena), a
            // choice when nobody did.
            let why = if slot.register_asked() {
                Plain::Fallback
            } else {
                Plain::Unasked
            };
            return (None, why);
        };
        let Some(piece) = slot.piece() else {
            // A slot across two registered pieces (a packed slot larger
            // than a piece, or one placed across a boundary) has no one
            // fixed buffer: its chunks go as plain Read, counted per chunk.
            static WARNED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
            if !WARNED.swap(true, std::sync::atomic::Ordering::Relaxed) {
                tracing::warn!(
                    "a slot of {} bytes at offset {} of arena {} spans two registered 1 GiB pieces: its reads use plain Read \
                     (said once; counted per drive as chunks_unregistered)",
                    slot.len(),
                    slot.offset(),
                    slot.arena_id()
                );
            }
            return (None, Plain::Fallback);
        };
        let piece = piece as u32;
        match (piece < a.n).then(|| (a.first + piece) as u16) {
            Some(i) => (Some(i), Plain::Fixed),
            None => (None, Plain::Fallback),
        }
    }
}
