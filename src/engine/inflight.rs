//! In-flight bookkeeping shared by every backend: one [`Request`] per tensor
//! read, counting its outstanding chunks, holding the slot the kernel writes
//! into, and waking whoever waits.
//!
//! Ownership is the safety argument. A request owns its slot; the submitter
//! of each chunk (a ring thread or a pread worker) holds an `Arc` of the
//! request from submission until that chunk's completion is reaped. The
//! caller's ticket holds one more. The slot is dropped (returned to its
//! arena) when the last `Arc` goes, so neither a ticket dropped early nor an
//! engine shutting down can hand back memory the kernel may still write.
//!
//! Ordering: each chunk's completion does `pending.fetch_sub(1, AcqRel)`.
//! Release publishes the bytes that completer observed landing; the last
//! completer's Acquire collects every earlier completer's, and it then
//! publishes `done` under the state mutex, which the waiter acquires. The
//! loom models at the bottom check this, and fail when it is weakened.

use std::task::{Poll, Waker};

use crate::engine::sync::{lock, Arc, AtomicUsize, Condvar, Mutex, MutexGuard, Ordering};
use crate::error::Error;

struct State<S> {
    slot: Option<S>,
    error: Option<Error>,
    done: bool,
    taken: bool,
    /// A chunk was abandoned while the kernel may still write into the slot
    /// (its I/O thread stopped with it in flight): the slot is leaked, never
    /// returned to its arena or handed to the caller.
    leak: bool,
    /// A thread sleeps in `wait` (notify only then).
    sleeping: bool,
    waker: Option<Waker>,
}

/// One read: its slot, its outstanding chunks, its first error.
pub struct Request<S> {
    pending: AtomicUsize,
    state: Mutex<State<S>>,
    done_cv: Condvar,
}

/// What a finished request hands back.
pub enum Outcome<S> {
    /// Every chunk landed: the slot.
    Ready(S),
    /// The read failed (the first error).
    Failed(Error),
    /// The result was already taken (polled after completion).
    Spent,
}

impl<S> Request<S> {
    /// A request of `chunks` chunks holding `slot`. With 0 chunks it is
    /// complete at once.
    pub fn new(slot: S, chunks: usize) -> Arc<Self> {
        Arc::new(Request {
            pending: AtomicUsize::new(chunks),
            state: Mutex::new(State {
                slot: Some(slot),
                error: None,
                done: chunks == 0,
                taken: false,
                leak: false,
                sleeping: false,
                waker: None,
            }),
            done_cv: Condvar::new(),
        })
    }

    /// Records an error; the first one is kept (it names the copy and errno).
    pub(crate) fn fail(&self, e: Error) {
        let mut st = lock(&self.state);
        if st.error.is_none() {
            st.error = Some(e);
        }
    }

    /// One chunk is finished (landed or failed). Returns true for the one
    /// call that completed the request and published it.
    ///
    /// The caller's waker runs after the bookkeeping is published and under
    /// `catch_unwind`: this runs on I/O threads, and a panicking waker must
    /// not unwind one (its ring and in-flight table would go with it).
    pub fn chunk_done(&self) -> bool {
        if self.pending.fetch_sub(1, Ordering::AcqRel) != 1 {
            return false;
        }
        let (waker, sleeping) = {
            let mut st = lock(&self.state);
            debug_assert!(!st.done, "a request is published exactly once");
            st.done = true;
            (st.waker.take(), st.sleeping)
        };
        if sleeping {
            self.done_cv.notify_all();
        }
        if let Some(w) = waker {
            wake_guarded(w);
        }
        true
    }

    /// One chunk is given up while the kernel may still own it (its I/O
    /// thread stopped): the request fails with `e`, and its slot is leaked
    /// rather than ever reused.
    pub(crate) fn abandon(&self, e: Error) {
        {
            let mut st = lock(&self.state);
            st.leak = true;
            if st.error.is_none() {
                st.error = Some(e);
            }
        }
        self.chunk_done();
    }

    /// Drops the registered waker, if any (a ticket going away drops it on
    /// the caller's thread, not later on an I/O thread).
    pub(crate) fn forget_waker(&self) {
        let w = lock(&self.state).waker.take();
        drop(w);
    }

    /// Whether every chunk has completed.
    pub(crate) fn is_done(&self) -> bool {
        lock(&self.state).done
    }

    fn take(st: &mut State<S>) -> Outcome<S> {
        if st.taken {
            return Outcome::Spent;
        }
        st.taken = true;
        if st.leak {
            // The kernel may still write into the slot: it never comes back.
            std::mem::forget(st.slot.take());
        }
        match st.error.take() {
            // Done means every chunk was reaped: the kernel is finished with
            // the slot, so it goes back to its arena before the caller hears
            // of the error.
            Some(e) => {
                drop(st.slot.take());
                Outcome::Failed(e)
            }
            None => match st.slot.take() {
                Some(s) => Outcome::Ready(s),
                None => Outcome::Spent,
            },
        }
    }

    /// Blocks until the request completes, then takes its result.
    pub fn wait(&self) -> Outcome<S> {
        Self::take(&mut self.wait_done())
    }

    /// Blocks until every chunk has completed, taking nothing: true when
    /// the kernel is finished with the slot, false when a chunk was
    /// abandoned while the kernel may still write into it (the slot is
    /// leaked, see [`Request::abandon`]).
    pub(crate) fn settle(&self) -> bool {
        !self.wait_done().leak
    }

    /// Sleeps until the request is done; the state, locked.
    fn wait_done(&self) -> MutexGuard<'_, State<S>> {
        let mut st = lock(&self.state);
        while !st.done {
            st.sleeping = true;
            st = match self.done_cv.wait(st) {
                Ok(g) => g,
                Err(p) => p.into_inner(),
            };
        }
        st.sleeping = false;
        st
    }

    /// [`Request::wait`] for at most `timeout`: `None` when the request is
    /// still in flight then (nothing taken).
    pub(crate) fn wait_timeout(&self, timeout: std::time::Duration) -> Option<Outcome<S>> {
        let deadline = std::time::Instant::now().checked_add(timeout);
        let mut st = lock(&self.state);
        while !st.done {
            // A timeout too large for the clock is no timeout.
            let left = match deadline {
                Some(d) => d.saturating_duration_since(std::time::Instant::now()),
                None => std::time::Duration::MAX,
            };
            if left.is_zero() {
                st.sleeping = false;
                return None;
            }
            st.sleeping = true;
            st = match self.done_cv.wait_timeout(st, left) {
                Ok((g, _)) => g,
                Err(p) => p.into_inner().0,
            };
        }
        st.sleeping = false;
        Some(Self::take(&mut st))
    }

    /// Takes the result if the request is complete.
    pub(crate) fn try_take(&self) -> Option<Outcome<S>> {
        let mut st = lock(&self.state);
        st.done.then(|| Self::take(&mut st))
    }

    /// Future-style: the result, or registers `waker`.
    pub(crate) fn poll(&self, waker: &Waker) -> Poll<Outcome<S>> {
        // The caller's waker is cloned, and the one it replaces dropped,
        // outside the lock an I/O thread takes to complete the request:
        // the caller's code never runs under it.
        let mut fresh = None;
        loop {
            let mut st = lock(&self.state);
            if st.done {
                return Poll::Ready(Self::take(&mut st));
            }
            match (&st.waker, fresh.take()) {
                (Some(w), _) if w.will_wake(waker) => return Poll::Pending,
                (_, Some(w)) => {
                    let old = st.waker.replace(w);
                    drop(st);
                    drop(old);
                    return Poll::Pending;
                }
                (_, None) => {
                    drop(st);
                    fresh = Some(waker.clone());
                }
            }
        }
    }
}

impl<S> Drop for Request<S> {
    fn drop(&mut self) {
        let mut st = lock(&self.state);
        if st.leak {
            std::mem::forget(st.slot.take());
        }
    }
}

/// Calls a caller's waker so that a panic in it (or in its drop) is caught
/// and logged instead of unwinding the I/O thread that completed the read.
fn wake_guarded(w: Waker) {
    if let Err(payload) = std::panic::catch_unwind(std::panic::AssertUnwindSafe(move || w.wake())) {
        static WARNED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
        if !WARNED.swap(true, std::sync::atomic::Ordering::Relaxed) {
            let what = payload
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| payload.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "a non-string payload".into());
            tracing::error!(
                "a waker panicked on an I/O thread ({what}); caught, the read completed normally (logged once)"
            );
        }
        WAKER_PANICS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        // Its drop could panic again; a small leak is the safe choice.
        std::mem::forget(payload);
    }
}

/// Wakers that panicked on an I/O thread (caught), process-wide.
pub(crate) static WAKER_PANICS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn last_chunk_publishes_once() {
        let r = Request::new(7u32, 3);
        assert!(!r.chunk_done());
        assert!(!r.chunk_done());
        assert!(r.try_take().is_none());
        assert!(r.chunk_done());
        assert!(matches!(r.wait(), Outcome::Ready(7)));
        assert!(matches!(r.wait(), Outcome::Spent));
    }

    #[test]
    fn first_error_wins_and_keeps_the_slot_until_drop() {
        let r = Request::new(1u8, 2);
        r.fail(Error::Config("first".into()));
        r.fail(Error::Config("second".into()));
        r.chunk_done();
        r.chunk_done();
        match r.wait() {
            Outcome::Failed(e) => assert_eq!(e.to_string(), "first"),
            _ => panic!("expected the first error"),
        }
    }

    #[test]
    fn a_panicking_waker_does_not_unwind_the_completer() {
        struct Boom;
        impl std::task::Wake for Boom {
            fn wake(self: std::sync::Arc<Self>) {
                panic!("waker");
            }
        }
        let r = Request::new(5u8, 1);
        let w = Waker::from(std::sync::Arc::new(Boom));
        assert!(r.poll(&w).is_pending());
        let before = WAKER_PANICS.load(std::sync::atomic::Ordering::Relaxed);
        assert!(r.chunk_done(), "the completer must publish, not unwind");
        assert!(WAKER_PANICS.load(std::sync::atomic::Ordering::Relaxed) > before);
        assert!(matches!(r.wait(), Outcome::Ready(5)));
    }

    #[test]
    fn an_abandoned_chunk_fails_the_request_and_leaks_the_slot() {
        struct Counted(std::sync::Arc<std::sync::atomic::AtomicUsize>);
        impl Drop for Counted {
            fn drop(&mut self) {
                self.0.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            }
        }
        // Outcome taken by the caller.
        let drops = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let r = Request::new(Counted(drops.clone()), 2);
        r.chunk_done();
        r.abandon(Error::Config("drive stopped".into()));
        assert!(matches!(r.wait(), Outcome::Failed(_)));
        drop(r);
        assert_eq!(
            drops.load(std::sync::atomic::Ordering::SeqCst),
            0,
            "an abandoned slot was dropped"
        );
        // Nobody takes the outcome (the ticket was dropped).
        let r = Request::new(Counted(drops.clone()), 1);
        r.abandon(Error::Config("drive stopped".into()));
        drop(r);
        assert_eq!(
            drops.load(std::sync::atomic::Ordering::SeqCst),
            0,
            "an abandoned slot was dropped"
        );
        // A failure that is not an abandonment hands the slot back.
        let r = Request::new(Counted(drops.clone()), 1);
        r.fail(Error::Config("eio".into()));
        r.chunk_done();
        drop(r);
        assert_eq!(drops.load(std::sync::atomic::Ordering::SeqCst), 1);
    }

    #[test]
    fn zero_chunks_is_complete() {
        let r = Request::new((), 0);
        assert!(r.is_done());
    }
}

/// Model checks of the bookkeeping with a mock kernel: run with
/// `RUSTFLAGS="--cfg loom" cargo test --release --lib inflight::loom_models`.
#[cfg(all(test, loom))]
mod loom_models {
    use super::*;
    use loom::cell::UnsafeCell;
    use loom::thread;

    /// A slot the "kernel" writes into: one byte (cell) per chunk.
    struct MockSlot {
        bytes: [UnsafeCell<u8>; 2],
        freed: Arc<AtomicUsize>,
        kernel_busy: Arc<AtomicUsize>,
    }

    // SAFETY: the model checks exactly this claim: each byte is written by
    // one completer and read only after publication.
    unsafe impl Sync for MockSlot {}

    impl Drop for MockSlot {
        fn drop(&mut self) {
            // Never early: no chunk may still be in flight when the slot goes.
            assert_eq!(
                self.kernel_busy.load(Ordering::Acquire),
                0,
                "slot freed while the kernel owns it"
            );
            self.freed.fetch_add(1, Ordering::Relaxed);
        }
    }

    fn mock(busy: usize) -> (MockSlot, Arc<AtomicUsize>, Arc<AtomicUsize>) {
        let freed = Arc::new(AtomicUsize::new(0));
        let kernel_busy = Arc::new(AtomicUsize::new(busy));
        (
            MockSlot {
                bytes: [UnsafeCell::new(0), UnsafeCell::new(0)],
                freed: freed.clone(),
                kernel_busy: kernel_busy.clone(),
            },
            freed,
            kernel_busy,
        )
    }

    /// Two chunks complete on two "ring threads"; the waiter sees both
    /// bytes, and exactly one completer publishes.
    #[test]
    fn last_completer_publishes_once_with_data_visible() {
        loom::model(|| {
            let (slot, _, _) = mock(0);
            let req = Request::new(slot, 2);
            let published = Arc::new(AtomicUsize::new(0));
            let handles: Vec<_> = (0..2)
                .map(|i| {
                    let req = req.clone();
                    let published = published.clone();
                    // The completer is handed the slot's address as the kernel is.
                    let cell: *const UnsafeCell<u8> = {
                        let st = lock(&req.state);
                        &st.slot.as_ref().unwrap().bytes[i] as *const _
                    };
                    let cell = cell as usize;
                    thread::spawn(move || {
                        // SAFETY: the slot lives in `req`, which this thread keeps alive.
                        let cell = unsafe { &*(cell as *const UnsafeCell<u8>) };
                        // SAFETY: byte i is written only by completer i.
                        cell.with_mut(|b| unsafe { *b = i as u8 + 1 });
                        if req.chunk_done() {
                            published.fetch_add(1, Ordering::Relaxed);
                        }
                    })
                })
                .collect();
            match req.wait() {
                Outcome::Ready(s) => {
                    // SAFETY: published: no completer writes any more.
                    let b = [s.bytes[0].with(|b| unsafe { *b }), s.bytes[1].with(|b| unsafe { *b })];
                    assert_eq!(b, [1, 2]);
                }
                _ => panic!("expected the slot"),
            }
            for h in handles {
                h.join().unwrap();
            }
            assert_eq!(published.load(Ordering::Relaxed), 1);
        });
    }

    /// The ticket is dropped while a chunk is in flight: the slot is freed
    /// exactly once, and only after the completion was reaped.
    #[test]
    fn ticket_drop_racing_completion_frees_once_never_early() {
        loom::model(|| {
            let (slot, freed, busy) = mock(1);
            let req = Request::new(slot, 1);
            let ticket = req.clone();
            let kernel = {
                let busy = busy.clone();
                thread::spawn(move || {
                    // The completion is reaped: the kernel no longer owns the slot.
                    busy.fetch_sub(1, Ordering::Release);
                    req.chunk_done();
                    drop(req);
                })
            };
            drop(ticket);
            kernel.join().unwrap();
            assert_eq!(freed.load(Ordering::Relaxed), 1);
        });
    }

    /// A ring thread dies with one chunk in the kernel while another chunk
    /// of the same read completes on another drive: the read fails, and
    /// the slot is never freed, whoever drops the last reference.
    #[test]
    fn abandoned_chunk_never_frees_the_slot() {
        // Plain std counters: the slot is leaked on purpose, and loom reports
        // a leaked loom object as an error.
        struct Slot(std::sync::Arc<std::sync::atomic::AtomicUsize>);
        impl Drop for Slot {
            fn drop(&mut self) {
                self.0.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            }
        }
        loom::model(|| {
            let freed = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
            let req = Request::new(Slot(freed.clone()), 2);
            let dead = {
                let req = req.clone();
                thread::spawn(move || req.abandon(Error::Config("drive stopped".into())))
            };
            let live = {
                let req = req.clone();
                thread::spawn(move || {
                    req.chunk_done();
                })
            };
            assert!(matches!(req.wait(), Outcome::Failed(_)));
            dead.join().unwrap();
            live.join().unwrap();
            drop(req);
            assert_eq!(
                freed.load(std::sync::atomic::Ordering::SeqCst),
                0,
                "an abandoned slot was freed"
            );
        });
    }
}
