//! Many tickets waited on at once, taken in the order they complete: each
//! ticket is polled with a waker of its own that records its key, so the
//! caller's thread sleeps on one condition variable (or an async task on
//! one waker) and wakes for whichever read lands first.
//!
//! The wakers run on the engine's I/O threads: they only push a key under a
//! short lock and wake the one waiter. No caller code runs there except an
//! async caller's own waker, which the engine already calls under
//! `catch_unwind` (a ticket's `Future` does the same).

use std::collections::VecDeque;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::task::{Context, Poll, Wake, Waker};

use crate::engine::{Loaded, Ticket};
use crate::error::Result;

#[derive(Default)]
struct Ready {
    /// Keys of tickets woken since the waiter last looked.
    keys: Vec<usize>,
    /// An async waiter to wake (the Stream's task).
    outer: Option<Waker>,
}

#[derive(Default)]
struct Shared {
    ready: Mutex<Ready>,
    cv: Condvar,
}

fn lock(m: &Mutex<Ready>) -> MutexGuard<'_, Ready> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// The waker of one ticket.
struct Waiter {
    shared: Arc<Shared>,
    key: usize,
}

impl Wake for Waiter {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        let outer = {
            let mut r = lock(&self.shared.ready);
            r.keys.push(self.key);
            r.outer.take()
        };
        self.shared.cv.notify_one();
        if let Some(w) = outer {
            w.wake();
        }
    }
}

/// Tickets keyed by the caller's small integers (at most one per key).
#[derive(Default)]
pub(crate) struct WaitSet {
    shared: Arc<Shared>,
    /// By key: the ticket still in flight and its waker.
    pending: Vec<Option<(Ticket, Waker)>>,
    in_flight: usize,
    /// Completed, not yet handed out.
    done: VecDeque<(usize, Result<Loaded>)>,
}

impl WaitSet {
    pub(crate) fn new() -> Self {
        WaitSet::default()
    }

    /// Tickets not yet handed out (in flight or completed).
    pub(crate) fn len(&self) -> usize {
        self.in_flight + self.done.len()
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Adds `ticket` under `key` (not already in the set).
    pub(crate) fn add(&mut self, key: usize, mut ticket: Ticket) {
        let waker = Waker::from(Arc::new(Waiter {
            shared: Arc::clone(&self.shared),
            key,
        }));
        match Pin::new(&mut ticket).poll(&mut Context::from_waker(&waker)) {
            Poll::Ready(r) => self.done.push_back((key, r)),
            Poll::Pending => {
                if self.pending.len() <= key {
                    self.pending.resize_with(key + 1, || None);
                }
                debug_assert!(self.pending[key].is_none(), "key {key} added twice");
                self.pending[key] = Some((ticket, waker));
                self.in_flight += 1;
            }
        }
    }

    /// Polls the tickets woken since the last look; the ready ones move to
    /// `done`.
    fn collect(&mut self, keys: Vec<usize>) {
        for k in keys {
            let Some((mut ticket, waker)) = self.pending.get_mut(k).and_then(Option::take) else {
                continue; // woken twice, or already collected
            };
            match Pin::new(&mut ticket).poll(&mut Context::from_waker(&waker)) {
                Poll::Ready(r) => {
                    self.in_flight -= 1;
                    self.done.push_back((k, r));
                }
                Poll::Pending => self.pending[k] = Some((ticket, waker)),
            }
        }
    }

    /// The next ticket to complete (its key and result), blocking the
    /// calling thread until one does; `None` when the set is empty.
    pub(crate) fn wait(&mut self) -> Option<(usize, Result<Loaded>)> {
        loop {
            if let Some(d) = self.done.pop_front() {
                return Some(d);
            }
            if self.in_flight == 0 {
                return None;
            }
            let keys = {
                let mut r = lock(&self.shared.ready);
                while r.keys.is_empty() {
                    r = self.shared.cv.wait(r).unwrap_or_else(|p| p.into_inner());
                }
                std::mem::take(&mut r.keys)
            };
            self.collect(keys);
        }
    }

    /// [`WaitSet::wait`] for an async task: `Pending` registers `cx`'s
    /// waker, woken when any ticket completes.
    #[cfg(feature = "futures")]
    pub(crate) fn poll_next(&mut self, cx: &mut Context<'_>) -> Poll<Option<(usize, Result<Loaded>)>> {
        loop {
            if let Some(d) = self.done.pop_front() {
                return Poll::Ready(Some(d));
            }
            if self.in_flight == 0 {
                return Poll::Ready(None);
            }
            // Cloned (and the waker it replaces dropped) outside the lock
            // the I/O threads' wakers take: no caller code under it.
            let fresh = cx.waker().clone();
            let (keys, old) = {
                let mut r = lock(&self.shared.ready);
                if r.keys.is_empty() {
                    (Vec::new(), r.outer.replace(fresh))
                } else {
                    (std::mem::take(&mut r.keys), None)
                }
            };
            drop(old);
            if keys.is_empty() {
                return Poll::Pending;
            }
            self.collect(keys);
        }
    }
}
