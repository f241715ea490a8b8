//! Staging for reads into caller memory whose address is out of phase
//! with the file offset (see `lend`): engine-owned registered arenas the
//! blocks land in O_DIRECT, and the one copy of the payload into place,
//! made on the thread that resolves the ticket.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use crate::memory::{Arena, Slot};

/// Engine-owned staging for reads whose address is out of phase: packed,
/// registered arenas that grow to the peak of staged bytes in flight (each
/// new one at least as large as all before it, so at most about twice that
/// peak), freed with the engine.
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
    /// Bytes of staging memory mapped.
    pub(crate) mapped: AtomicU64,
}

/// The smallest staging arena: room for a few experts' projections.
pub(crate) const STAGING_MIN: usize = 16 << 20;

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
