//! Staging for reads into caller memory whose address is out of phase
//! with the file offset (see `lend`): engine-owned registered arenas the
//! blocks land in O_DIRECT, and the one copy of the payload into place,
//! made on the thread that resolves the ticket.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use crate::memory::{Arena, Slot, SlotSpec};

/// Engine-owned staging for reads whose address is out of phase, and for
/// the pieces of slices: packed, registered arenas that grow to the peak of
/// staged bytes in flight (each new one at least as large as all before
/// it, so at most about twice that peak). A slice gives back what is idle
/// beyond [`Staging::trim`]'s bound when it resolves; the rest is freed
/// with the engine.
#[derive(Default)]
pub(crate) struct Staging {
    pub(crate) arenas: Mutex<Vec<Arena>>,
    pub(crate) counters: Arc<StagingCounters>,
}

/// Counters of staged reads (all threads).
#[derive(Default, Debug)]
pub(crate) struct StagingCounters {
    pub(crate) reads: AtomicU64,
    pub(crate) bytes: AtomicU64,
    /// CPU time of the copies, nanoseconds (the waiting thread's).
    pub(crate) copy_ns: AtomicU64,
    /// Bytes of staging memory mapped now.
    pub(crate) mapped: AtomicU64,
    /// The most bytes of staging mapped at once.
    pub(crate) peak: AtomicU64,
}

/// The smallest staging arena: room for a few experts' projections.
pub(crate) const STAGING_MIN: usize = 16 << 20;

impl Staging {
    /// A free staging slot of `want` bytes for `spec` from an arena already
    /// mapped, if one has room.
    pub(crate) fn take(&self, want: usize, spec: SlotSpec) -> Option<Slot> {
        lock(&self.arenas).iter().find_map(|a| a.take_window(want, spec))
    }

    /// Bytes of every staging arena.
    pub(crate) fn bytes(&self) -> usize {
        lock(&self.arenas).iter().map(Arena::bytes).sum()
    }

    /// Adds `arena` (just mapped, with no lock held while it was mapped
    /// and registered) and takes `want` bytes for `spec` from it.
    pub(crate) fn add(&self, arena: Arena, want: usize, spec: SlotSpec) -> Option<Slot> {
        let slot = arena.take_window(want, spec);
        self.count_mapped(&arena);
        lock(&self.arenas).push(arena);
        slot
    }

    /// An idle staging arena (no slot out) of at least `bytes`, taken out
    /// of the pool for one caller's exclusive use (`Engine::fill`); the
    /// smallest such. Still counted as mapped.
    pub(crate) fn borrow_idle(&self, bytes: usize) -> Option<Arena> {
        let mut arenas = lock(&self.arenas);
        let i = (0..arenas.len())
            .filter(|&i| arenas[i].is_empty() && arenas[i].bytes() >= bytes)
            .min_by_key(|&i| arenas[i].bytes())?;
        Some(arenas.swap_remove(i))
    }

    /// Counts `arena` (just mapped for staging, not yet in the pool) as
    /// mapped.
    pub(crate) fn count_mapped(&self, arena: &Arena) {
        let now = self.counters.mapped.fetch_add(arena.bytes() as u64, Ordering::Relaxed) + arena.bytes() as u64;
        self.counters.peak.fetch_max(now, Ordering::Relaxed);
    }

    /// Puts an arena from [`Staging::borrow_idle`] (or counted with
    /// [`Staging::count_mapped`]) back in the pool, for later reads.
    pub(crate) fn put_back(&self, arena: Arena) {
        lock(&self.arenas).push(arena);
    }

    /// Unmaps idle staging arenas (no slot out) beyond `keep` bytes of idle
    /// ones, smallest kept first: a slice that needed much staging leaves
    /// no more than `keep` behind. An arena with a slot out stays: a read
    /// may be landing in it. Unmapping queues the arena's unregistration on
    /// the rings (no round trip is waited for).
    pub(crate) fn trim(&self, keep: usize) {
        let gone: Vec<Arena> = {
            let mut arenas = lock(&self.arenas);
            let mut idle: Vec<usize> = (0..arenas.len()).filter(|&i| arenas[i].is_empty()).collect();
            idle.sort_by_key(|&i| arenas[i].bytes());
            let mut kept = 0usize;
            let mut drop_at = Vec::new();
            for i in idle {
                if kept + arenas[i].bytes() <= keep {
                    kept += arenas[i].bytes();
                } else {
                    drop_at.push(i);
                }
            }
            drop_at.sort_unstable_by(|a, b| b.cmp(a));
            drop_at.into_iter().map(|i| arenas.swap_remove(i)).collect()
        };
        for a in gone {
            self.counters.mapped.fetch_sub(a.bytes() as u64, Ordering::Relaxed);
            drop(a);
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// A staged read's destination: the payload's exact bytes in the caller's
/// memory, filled from the staging slot when the ticket resolves.
pub(crate) struct Staged {
    dest: Slot,
    counters: Arc<StagingCounters>,
}

impl Staged {
    pub(crate) fn new(dest: Slot, counters: Arc<StagingCounters>) -> Self {
        Staged { dest, counters }
    }

    /// Copies the payload (`len` bytes at `pad` in `stage`) into place and
    /// hands back the staging slot; the caller's thread pays the copy.
    pub(crate) fn finish(mut self, stage: Slot, pad: usize, len: usize) -> (Slot, usize) {
        let t0 = thread_cpu_ns();
        self.dest.as_bytes_mut()[..len].copy_from_slice(&stage.as_bytes()[pad..pad + len]);
        let t1 = thread_cpu_ns();
        drop(stage);
        let c = &self.counters;
        c.reads.fetch_add(1, Ordering::Relaxed);
        c.bytes.fetch_add(len as u64, Ordering::Relaxed);
        c.copy_ns.fetch_add(t1.saturating_sub(t0), Ordering::Relaxed);
        (self.dest, 0)
    }
}

pub(crate) fn thread_cpu_ns() -> u64 {
    let t = rustix::time::clock_gettime(rustix::time::ClockId::ThreadCPUTime);
    (t.tv_sec as u64)
        .saturating_mul(1_000_000_000)
        .saturating_add(t.tv_nsec as u64)
}
