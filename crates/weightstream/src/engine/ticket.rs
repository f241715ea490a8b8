//! The result of a read: a [`Ticket`] while it is in flight (it owns the
//! slot until every chunk is reaped), and the [`Loaded`] payload once it
//! has landed (the synchronous read returns one too).

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use crate::engine::inflight::{Outcome, Request};
use crate::engine::sync::Arc as ReqArc;
use crate::error::{Error, Result};
use crate::fork::Origin;
use crate::memory::Slot;

/// A read in flight. It owns the slot: the payload is reachable only once
/// every chunk has completed. Dropping it early is safe: the slot returns
/// to its arena after the last completion is reaped (or, if the drive's I/O
/// thread stopped with a chunk still in the kernel, never).
#[must_use = "a ticket owns its slot; wait() for the payload"]
pub struct Ticket {
    /// Dropped in `Drop` (leaked instead in a forked child).
    req: std::mem::ManuallyDrop<ReqArc<Request<Slot>>>,
    pad: usize,
    len: usize,
    origin: Origin,
}

impl std::fmt::Debug for Ticket {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ticket")
            .field("len", &self.len)
            .field("ready", &self.is_ready())
            .finish()
    }
}

impl Ticket {
    pub(crate) fn new(req: ReqArc<Request<Slot>>, pad: usize, len: usize, origin: Origin) -> Self {
        Ticket {
            req: std::mem::ManuallyDrop::new(req),
            pad,
            len,
            origin,
        }
    }

    fn resolve(&self, o: Outcome<Slot>) -> Result<Loaded> {
        match o {
            Outcome::Ready(slot) => Ok(Loaded::new(slot, self.pad, self.len)),
            Outcome::Failed(e) => Err(e),
            Outcome::Spent => Err(Error::Config("ticket polled after it completed".into())),
        }
    }

    /// Blocks until the payload has landed. In a forked child (where the
    /// engine's I/O threads do not exist) it returns [`Error::Forked`] at
    /// once instead of waiting forever.
    pub fn wait(self) -> Result<Loaded> {
        self.origin.check()?;
        let o = self.req.wait();
        self.resolve(o)
    }

    /// Whether every chunk has completed.
    pub fn is_ready(&self) -> bool {
        self.req.is_done()
    }

    /// The payload if it has landed, else the ticket back.
    pub fn try_wait(self) -> std::result::Result<Result<Loaded>, Ticket> {
        if let Err(e) = self.origin.check() {
            return Ok(Err(e));
        }
        match self.req.try_take() {
            Some(o) => Ok(self.resolve(o)),
            None => Err(self),
        }
    }
}

impl Future for Ticket {
    type Output = Result<Loaded>;
    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        if let Err(e) = self.origin.check() {
            return Poll::Ready(Err(e));
        }
        match self.req.poll(cx.waker()) {
            Poll::Ready(o) => Poll::Ready(self.resolve(o)),
            Poll::Pending => Poll::Pending,
        }
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        if self.origin.forked() {
            // A child: the request's locks may have been held by a parent
            // thread at fork time, and its slot is not mapped here. Touch
            // nothing; the child's copy of the request is leaked.
            return;
        }
        // The waker is the caller's code: drop it here, on the caller's
        // thread, not later on an I/O thread that completes the read.
        self.req.forget_waker();
        // SAFETY: `req` is dropped exactly once, here, and not used after.
        unsafe { std::mem::ManuallyDrop::drop(&mut self.req) };
    }
}

/// A payload that has landed in its slot.
pub struct Loaded {
    slot: Slot,
    pad: usize,
    len: usize,
}

impl Loaded {
    pub(crate) fn new(slot: Slot, pad: usize, len: usize) -> Self {
        debug_assert!(pad + len <= slot.len());
        Loaded { slot, pad, len }
    }

    /// Offset of the payload from the slot base (`file offset % align`).
    pub fn pad(&self) -> usize {
        self.pad
    }

    /// The slot, for reuse.
    pub fn into_slot(self) -> Slot {
        self.slot
    }

    /// The slot, read-only (scratch included), e.g. for guard checks.
    pub fn slot(&self) -> &Slot {
        &self.slot
    }
}

impl std::ops::Deref for Loaded {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        &self.slot.as_bytes()[self.pad..self.pad + self.len]
    }
}

impl std::fmt::Debug for Loaded {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Loaded")
            .field("pad", &self.pad)
            .field("len", &self.len)
            .finish()
    }
}
