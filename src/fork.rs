//! Fork detection. After `fork()` a child has copies of every engine, ticket
//! and arena handle, but none of the I/O threads (only the forking thread
//! survives) and none of the arenas' pages (they are `MADV_DONTFORK`). A
//! child that waited on a ticket would wait forever, and one that joined an
//! I/O thread would join a thread that does not exist.
//!
//! A `pthread_atfork` child handler bumps a process-wide generation, so an
//! engine or ticket made before the fork notices it is in a child with one
//! relaxed atomic load, not a system call per read.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
#[cfg(not(miri))]
use std::sync::Once;

use crate::error::{Error, Result};

static GENERATION: AtomicU64 = AtomicU64::new(0);
#[cfg(not(miri))]
static WATCH: Once = Once::new();

#[cfg(not(miri))]
extern "C" fn in_child() {
    // Async-signal-safe: one atomic add, nothing else.
    GENERATION.fetch_add(1, Relaxed);
}

/// Where an engine or ticket was made: the fork generation and the pid.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Origin {
    generation: u64,
    pid: u32,
}

impl Origin {
    /// The current process; registers the fork handler on first use.
    pub(crate) fn here() -> Self {
        // Miri runs no fork and cannot call pthread_atfork.
        #[cfg(not(miri))]
        WATCH.call_once(|| {
            // SAFETY: `in_child` is an `extern "C" fn()` that only does an
            // atomic add (async-signal-safe, as a child handler must be);
            // the prepare and parent handlers are absent.
            let rc = unsafe { libc::pthread_atfork(None, None, Some(in_child)) };
            if rc != 0 {
                tracing::warn!(
                    "pthread_atfork failed ({}): an engine used in a forked child is not detected",
                    std::io::Error::from_raw_os_error(rc)
                );
            }
        });
        Origin {
            generation: GENERATION.load(Relaxed),
            pid: std::process::id(),
        }
    }

    /// Whether this is a process forked after the origin was taken.
    pub(crate) fn forked(&self) -> bool {
        GENERATION.load(Relaxed) != self.generation
    }

    /// The process the origin was taken in.
    pub(crate) fn pid(&self) -> u32 {
        self.pid
    }

    /// An error naming both processes when called in a forked child.
    pub(crate) fn check(&self) -> Result<()> {
        if self.forked() {
            return Err(Error::Forked {
                parent: self.pid,
                child: std::process::id(),
            });
        }
        Ok(())
    }
}
