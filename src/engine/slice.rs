//! `Engine::read_slice`: a block of a tensor (a tensor-parallel rank's
//! rows or columns) read from the drives without the tensor's other
//! bytes, into caller memory (see `format::slice` for the runs and the
//! plan).
//!
//! Rows are one run: an ordinary `read_into` (in place and O_DIRECT when
//! in phase). A slice of many runs is read piece by piece, O_DIRECT, into
//! the engine's staging memory, and each run is copied to its place in the
//! caller's memory as its piece resolves, on the thread that waits: the
//! caller's bytes are written by that copy only, never by the kernel.

use std::collections::VecDeque;
use std::future::Future;
use std::ops::Range;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::task::{Context, Poll, Wake, Waker};
use std::time::{Duration, Instant};

use crate::engine::lend::{Destination, Scratch};
use crate::engine::staging::thread_cpu_ns;
use crate::engine::ticket::{Loaded, Meta, Ticket};
use crate::engine::Engine;
use crate::error::{Error, Result};
use crate::format::catalog::TensorRef;
use crate::format::dtype::Dtype;
use crate::format::slice::{Run, TensorSlice, SLICE_GAP_BYTES};
use crate::memory::{Arena, Slot, SlotSpec};

/// Counters of slice reads (all threads).
#[derive(Default, Debug)]
pub(crate) struct SliceCounters {
    pub(crate) reads: AtomicU64,
    pub(crate) pieces: AtomicU64,
    pub(crate) runs: AtomicU64,
    pub(crate) wanted: AtomicU64,
    pub(crate) read: AtomicU64,
}

impl Engine {
    /// Reads `slice` ([`TensorRef::slice`]) so that its bytes, compact and
    /// row-major, land at byte `at` of `memory` (an arena from
    /// [`Engine::register_memory`] or [`Engine::packed_arena`]), reading
    /// from the drives only the pieces [`TensorSlice::plan`] chooses with
    /// [`SLICE_GAP_BYTES`] (counted in [`Stats::slices`]: bytes wanted and
    /// bytes read).
    ///
    /// A slice of one run (rows) is [`Engine::read_into`] with `scratch`:
    /// in place when in phase. A slice of many runs (columns, blocks) goes
    /// O_DIRECT into the engine's staging memory, piece by piece, and each
    /// run is copied into place when its piece is waited on ([`Stats::staged`]
    /// counts the copies); only the slice's exact bytes of `memory` are
    /// written, and only by that copy. The bytes `[at, at + slice.len())`
    /// must not overlap a slot of `memory` in use.
    ///
    /// [`Stats::slices`]: crate::Stats::slices
    /// [`Stats::staged`]: crate::Stats::staged
    pub fn read_slice(&self, slice: &TensorSlice, memory: &Arena, at: usize, scratch: Scratch) -> Result<SliceTicket> {
        self.origin.check()?;
        let tensor = slice.tensor();
        // A slice of another model's tensor is refused before anything else.
        self.model.file_of(tensor)?;
        let align = self.direct_align();
        let plan = slice.plan(align as u64, SLICE_GAP_BYTES);
        let count = |plan_read: u64, pieces: usize| {
            let c = &self.slices;
            c.reads.fetch_add(1, Ordering::Relaxed);
            c.pieces.fetch_add(pieces as u64, Ordering::Relaxed);
            c.runs.fetch_add(slice.runs().len() as u64, Ordering::Relaxed);
            c.wanted.fetch_add(slice.len(), Ordering::Relaxed);
            c.read.fetch_add(plan_read, Ordering::Relaxed);
        };
        if let Some(rows) = slice.as_range() {
            let t = self.read_into(&rows, memory, at, scratch)?;
            count(plan.read, 1);
            return Ok(SliceTicket { inner: Inner::One(t) });
        }
        let len = usize::try_from(slice.len()).map_err(|_| {
            Error::Config(format!(
                "tensor {}: a slice of {} bytes does not fit usize",
                tensor.name,
                slice.len()
            ))
        })?;
        let dest = Destination {
            call: "read_slice",
            fixed_slots: "",
            name: &tensor.name,
            what: "slice bytes",
            at,
            len,
        };
        dest.check(memory)?;
        let dest = dest.take(memory, SlotSpec::new(len).with_align(align))?;
        let mut parts = VecDeque::with_capacity(plan.pieces.len());
        for p in &plan.pieces {
            let piece = TensorRef {
                offset: tensor.offset + p.range.start,
                len: p.range.end - p.range.start,
                dtype: Dtype::U8,
                shape: vec![(p.range.end - p.range.start) as usize],
                ..tensor.clone()
            };
            let pad = (piece.offset % align as u64) as usize;
            let stage = self.staging_slot(&piece, pad, align)?;
            // A piece that fails to queue drops the pieces before it: their
            // tickets settle (or leak) staging as any dropped ticket does.
            let ticket = self.read(&piece, stage)?;
            parts.push_back(Part {
                ticket,
                runs: p.runs.clone(),
                from: p.range.start,
            });
        }
        count(plan.read, plan.pieces.len());
        let shaped = TensorRef {
            shape: slice.shape().to_vec(),
            offset: tensor.offset + slice.covering().start,
            len: slice.len(),
            ..tensor.clone()
        };
        Ok(SliceTicket {
            inner: Inner::Pieces(Box::new(Pieces {
                dest: Some(dest),
                parts,
                runs: slice.runs().to_vec(),
                meta: Meta::of(&self.model, &shaped),
                len,
                counters: std::sync::Arc::clone(&self.staging.counters),
            })),
        })
    }
}

/// A slice read in flight: [`SliceTicket::wait`] gives the slice's bytes
/// as a [`Loaded`] in the caller's memory. Dropped early, the pieces still
/// in flight settle into staging (never into the caller's memory), and
/// the caller's bytes are released.
#[derive(Debug)]
pub struct SliceTicket {
    inner: Inner,
}

#[derive(Debug)]
enum Inner {
    One(Ticket),
    /// Boxed: a ticket moves through `wait_timeout` and `try_wait`.
    Pieces(Box<Pieces>),
}

struct Part {
    ticket: Ticket,
    runs: Range<usize>,
    /// The piece's first byte, as an offset in the tensor.
    from: u64,
}

struct Pieces {
    /// The slice's bytes in the caller's memory (taken until resolved).
    dest: Option<Slot>,
    /// Pieces not yet copied, in order.
    parts: VecDeque<Part>,
    runs: Vec<Run>,
    meta: Meta,
    len: usize,
    counters: std::sync::Arc<crate::engine::staging::StagingCounters>,
}

impl std::fmt::Debug for Pieces {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pieces")
            .field("pending", &self.parts.len())
            .field("runs", &self.runs.len())
            .field("len", &self.len)
            .finish()
    }
}

impl Pieces {
    /// Copies the runs `runs` of a resolved piece (whose first byte is
    /// byte `from` of the tensor) into place.
    fn copy(&mut self, runs: Range<usize>, from: u64, staged: &Loaded) {
        let t0 = thread_cpu_ns();
        let dest = self
            .dest
            .as_mut()
            .expect("the slice's bytes are held until it resolves");
        let out = dest.as_bytes_mut();
        let src = staged.bytes();
        let mut bytes = 0u64;
        for r in &self.runs[runs] {
            let (s, d, n) = ((r.src - from) as usize, r.dst as usize, r.len as usize);
            out[d..d + n].copy_from_slice(&src[s..s + n]);
            bytes += r.len;
        }
        let c = &self.counters;
        c.reads.fetch_add(1, Ordering::Relaxed);
        c.bytes.fetch_add(bytes, Ordering::Relaxed);
        c.copy_ns
            .fetch_add(thread_cpu_ns().saturating_sub(t0), Ordering::Relaxed);
    }

    /// Waits for the pieces in order until `deadline` (`None`: for as long
    /// as it takes), copying each into place as it resolves; the slice
    /// once every piece is in place, `None` when the deadline came first
    /// (the pieces copied so far stay copied).
    fn settle(&mut self, deadline: Option<Instant>) -> Option<Result<Loaded>> {
        while let Some(Part { ticket, runs, from }) = self.parts.pop_front() {
            let got = match deadline {
                None => Ok(ticket.wait()),
                Some(d) => ticket.wait_timeout(d.saturating_duration_since(Instant::now())),
            };
            match got {
                // The staging slot goes back when `staged` drops, after the copy.
                Ok(Ok(staged)) => self.copy(runs, from, &staged),
                Ok(Err(e)) => return Some(Err(e)),
                Err(ticket) => {
                    self.parts.push_front(Part { ticket, runs, from });
                    return None;
                }
            }
        }
        let dest = self.dest.take().expect("a slice resolves once");
        Some(Ok(Loaded::new(dest, 0, self.len, self.meta.clone())))
    }
}

impl From<Ticket> for SliceTicket {
    /// A read of one range (`Engine::read_into`) as a slice ticket, so
    /// that callers keeping both kinds keep one type.
    fn from(t: Ticket) -> Self {
        SliceTicket { inner: Inner::One(t) }
    }
}

impl Future for SliceTicket {
    type Output = Result<Loaded>;
    /// Polls every piece still in flight, copying each one that landed;
    /// the waker is woken once, when every piece pending at this poll has
    /// landed (not at each piece: an event loop waiting on it, such as the
    /// C ABI's eventfd, wakes only when the slice is done).
    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let p = match &mut self.get_mut().inner {
            Inner::One(t) => return Pin::new(t).poll(cx),
            Inner::Pieces(p) => p,
        };
        loop {
            if p.dest.is_none() {
                return Poll::Ready(Err(Error::Config("slice ticket polled after it completed".into())));
            }
            let all = std::sync::Arc::new(AllLanded {
                remaining: AtomicUsize::new(ARMING),
                waker: cx.waker().clone(),
            });
            let waker = Waker::from(std::sync::Arc::clone(&all));
            let mut inner_cx = Context::from_waker(&waker);
            let mut pending = 0usize;
            let mut i = 0;
            while i < p.parts.len() {
                match Pin::new(&mut p.parts[i].ticket).poll(&mut inner_cx) {
                    Poll::Ready(Ok(staged)) => {
                        let part = p.parts.remove(i).expect("a piece at i");
                        p.copy(part.runs, part.from, &staged);
                    }
                    Poll::Ready(Err(e)) => {
                        // The rest settle into staging as they drop; the
                        // caller's bytes are released.
                        p.parts.clear();
                        p.dest = None;
                        return Poll::Ready(Err(e));
                    }
                    Poll::Pending => {
                        pending += 1;
                        i += 1;
                    }
                }
            }
            if pending == 0 {
                let dest = p.dest.take().expect("checked above");
                return Poll::Ready(Ok(Loaded::new(dest, 0, p.len, p.meta.clone())));
            }
            // Armed: the count becomes the pieces pending, less those that
            // already woke it. All of them already did: poll again.
            let before = all.remaining.fetch_sub(ARMING - pending, Ordering::AcqRel);
            if before - (ARMING - pending) > 0 {
                return Poll::Pending;
            }
        }
    }
}

/// The count an [`AllLanded`] starts from before it knows how many pieces
/// it waits for (wakes before arming count down from it).
const ARMING: usize = usize::MAX / 2;

/// A waker for a slice's pieces: wakes the slice's waker when the last of
/// the pieces it was registered on has landed.
struct AllLanded {
    remaining: AtomicUsize,
    waker: Waker,
}

impl Wake for AllLanded {
    fn wake(self: std::sync::Arc<Self>) {
        self.wake_by_ref();
    }
    fn wake_by_ref(self: &std::sync::Arc<Self>) {
        if self.remaining.fetch_sub(1, Ordering::AcqRel) == 1 {
            self.waker.wake_by_ref();
        }
    }
}

impl SliceTicket {
    /// Waits for every piece and returns the slice's bytes in the caller's
    /// memory (dtype and shape the slice's), or the first piece's error.
    pub fn wait(self) -> Result<Loaded> {
        match self.inner {
            Inner::One(t) => t.wait(),
            Inner::Pieces(mut p) => p.settle(None).expect("no deadline"),
        }
    }

    /// [`SliceTicket::wait`] for at most `timeout`: the slice (or the
    /// error), or the ticket back with the pieces that landed meanwhile
    /// already copied.
    pub fn wait_timeout(self, timeout: Duration) -> std::result::Result<Result<Loaded>, SliceTicket> {
        match self.inner {
            Inner::One(t) => t
                .wait_timeout(timeout)
                .map_err(|t| SliceTicket { inner: Inner::One(t) }),
            Inner::Pieces(mut p) => match p.settle(Some(Instant::now() + timeout)) {
                Some(r) => Ok(r),
                None => Err(SliceTicket {
                    inner: Inner::Pieces(p),
                }),
            },
        }
    }

    /// The slice if every piece has landed (copying those that have), else
    /// the ticket back.
    pub fn try_wait(self) -> std::result::Result<Result<Loaded>, SliceTicket> {
        self.wait_timeout(Duration::ZERO)
    }

    /// Whether every piece has landed (nothing left but the copies).
    pub fn is_ready(&self) -> bool {
        match &self.inner {
            Inner::One(t) => t.is_ready(),
            Inner::Pieces(p) => p.parts.iter().all(|part| part.ticket.is_ready()),
        }
    }

    /// Pieces read for the slice (1 for rows).
    pub fn pieces(&self) -> usize {
        match &self.inner {
            Inner::One(_) => 1,
            Inner::Pieces(p) => p.parts.len(),
        }
    }
}
