//! Staging for reads into caller memory whose address is out of phase
//! with the file offset (see `lend`): engine-owned registered arenas the
//! blocks land in O_DIRECT, and the one copy of the payload into place,
//! made on the thread that resolves the ticket.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};

use crate::error::Result;
use crate::memory::{Arena, Slot, SlotSpec};

/// Engine-owned staging for reads whose address is out of phase, and for
/// the pieces of slices: packed, registered arenas that grow to the peak of
/// staged bytes in flight (each new one at least as large as all before
/// it, so at most about twice that peak). A slice gives back what is idle
/// beyond [`Staging::trim`]'s bound when it resolves; the rest is freed
/// with the engine. Fills have staging of their own ([`FillStaging`]).
#[derive(Default)]
pub(crate) struct Staging {
    pub(crate) arenas: Mutex<Vec<Arena>>,
    pub(crate) counters: Arc<StagingCounters>,
    /// The one arena every `Engine::fill` of the engine shares.
    pub(crate) fill: FillStaging,
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
        self.counters.count_mapped(arena.bytes());
        lock(&self.arenas).push(arena);
        slot
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

impl StagingCounters {
    fn count_mapped(&self, bytes: usize) {
        let now = self.mapped.fetch_add(bytes as u64, Ordering::Relaxed) + bytes as u64;
        self.peak.fetch_max(now, Ordering::Relaxed);
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// The staging of every `Engine::fill` of one engine: one registered
/// packed arena that fills running at once share, each keeping at most its
/// own budget of it in flight. The arena is never larger than the budget
/// of the fills that use it (the largest budget among the fills running,
/// else the last one's), whatever the order of sizes and calls: it is
/// replaced (unmapped, then a new one mapped) only while no fill uses it,
/// when a fill needs more than it has (it then grows to at least twice its
/// size, within that fill's budget, so a run of slowly growing fills maps
/// a few arenas, not one per call) or when it is larger than that fill's
/// budget. A fill that needs more than the shared arena while others use
/// it takes the smaller share; one whose largest piece would not fit
/// waits until the others are done.
#[derive(Default)]
pub(crate) struct FillStaging {
    state: Mutex<FillState>,
    /// Signalled when staging comes back: a piece copied into place, a
    /// fill done, a new arena mapped.
    changed: Condvar,
}

#[derive(Default)]
struct FillState {
    arena: Option<Arena>,
    /// Fills holding a lease on `arena`.
    users: usize,
    /// A fill is mapping a new arena (no lock held while it maps and
    /// registers); the others wait for it.
    mapping: bool,
    /// Counts every return of staging: a waiter compares it with what it
    /// saw before its last try, so it never misses one.
    returned: u64,
}

/// One fill's use of the shared fill staging; given back on drop.
pub(crate) struct FillLease<'a> {
    pool: &'a FillStaging,
    /// The shared arena.
    pub(crate) arena: Arena,
    /// The most of it this fill's pieces hold at once.
    pub(crate) budget: usize,
}

impl FillStaging {
    fn lock(&self) -> std::sync::MutexGuard<'_, FillState> {
        lock(&self.state)
    }

    /// A lease for a fill that would use `want` bytes of staging (its
    /// pieces in flight at once), within a budget of `cap` bytes, whose
    /// largest piece takes `floor` bytes: the shared arena, or a new one
    /// that `map` makes (`map` runs with no lock held; what it maps is
    /// counted in `counters`, and uncounted when it is replaced).
    pub(crate) fn lease(
        &self,
        counters: &StagingCounters,
        want: usize,
        cap: usize,
        floor: usize,
        map: impl FnOnce(usize) -> Result<Arena>,
    ) -> Result<FillLease<'_>> {
        let cap = cap.max(want);
        let mut gone = None;
        let mut st = self.lock();
        let size = loop {
            if st.mapping {
                st = self.changed.wait(st).unwrap_or_else(|p| p.into_inner());
                continue;
            }
            let Some(have) = st.arena.as_ref().map(Arena::bytes) else {
                break want;
            };
            if st.users == 0 && (have < want || have > cap) {
                gone = st.arena.take();
                counters.mapped.fetch_sub(have as u64, Ordering::Relaxed);
                break want.max(have.saturating_mul(2).min(cap));
            }
            if have >= floor && (have >= want || st.users > 0) {
                st.users += 1;
                let arena = st.arena.clone().expect("looked at above");
                return Ok(FillLease {
                    pool: self,
                    arena,
                    budget: want.min(have),
                });
            }
            // Used by others and too small for this fill's largest piece:
            // replaced once they are done.
            st = self.changed.wait(st).unwrap_or_else(|p| p.into_inner());
        };
        st.mapping = true;
        drop(st);
        // The old arena goes with no lock held (its unregistration is
        // queued on the rings, no round trip waited for).
        drop(gone);
        let made = map(size);
        let mut st = self.lock();
        st.mapping = false;
        let out = made.map(|arena| {
            counters.count_mapped(arena.bytes());
            st.arena = Some(arena.clone());
            st.users += 1;
            FillLease {
                pool: self,
                budget: want.min(arena.bytes()),
                arena,
            }
        });
        drop(st);
        self.changed.notify_all();
        out
    }

    /// How many times staging came back so far (see [`FillStaging::wait_returned`]).
    pub(crate) fn returned(&self) -> u64 {
        self.lock().returned
    }

    /// Whether fills other than the caller (which holds a lease) use the
    /// shared arena now.
    pub(crate) fn shared(&self) -> bool {
        self.lock().users > 1
    }

    /// Says that a piece's staging came back.
    pub(crate) fn piece_back(&self) {
        self.lock().returned += 1;
        self.changed.notify_all();
    }

    /// Waits until staging came back since [`FillStaging::returned`] said
    /// `seen`.
    pub(crate) fn wait_returned(&self, seen: u64) {
        let mut st = self.lock();
        while st.returned == seen {
            st = self.changed.wait(st).unwrap_or_else(|p| p.into_inner());
        }
    }
}

impl FillLease<'_> {
    /// See [`FillStaging::returned`].
    pub(crate) fn pool_returned(&self) -> u64 {
        self.pool.returned()
    }

    /// See [`FillStaging::shared`].
    pub(crate) fn shared(&self) -> bool {
        self.pool.shared()
    }

    /// See [`FillStaging::wait_returned`].
    pub(crate) fn wait_returned(&self, seen: u64) {
        self.pool.wait_returned(seen)
    }
}

impl Drop for FillLease<'_> {
    fn drop(&mut self) {
        let mut st = self.pool.lock();
        st.users -= 1;
        st.returned += 1;
        drop(st);
        self.pool.changed.notify_all();
    }
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
