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
//!
//! Staging is bounded: no piece spans more than [`SLICE_PIECE_BYTES`] of
//! blocks, and a slice keeps at most `EngineConfig::slice_staging` of
//! staging in flight. A slice whose pieces need more is read through that
//! window: the submitting call waits for its oldest piece, copies it into
//! place and returns its staging before it submits the next, so memory is
//! the slice's own bytes plus the window, whatever the slice's shape (a
//! one-byte column of a wide tensor moves one block per row: 4096 times
//! its bytes, through the same window). When a slice resolves, idle
//! staging beyond the window is unmapped.

use std::collections::VecDeque;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::task::{Context, Poll, Wake, Waker};
use std::time::{Duration, Instant};

use crate::engine::lend::{Destination, Scratch};
use crate::engine::staging::{thread_cpu_ns, Staging, STAGING_MIN};
use crate::engine::ticket::{Loaded, Meta, Ticket};
use crate::engine::Engine;
use crate::error::{Error, Result};
use crate::format::catalog::TensorRef;
use crate::format::dtype::Dtype;
use crate::format::slice::{Piece, SlicePlan, TensorSlice, SLICE_GAP_BYTES};
use crate::memory::{Arena, Slot, SlotSpec};
use crate::plan::placement::window_bytes;

/// The most bytes of blocks one piece of a slice spans (a piece longer
/// than this is cut, see `TensorSlice::plan_within`): the largest chunk a
/// drive is given, so a piece is one request.
pub const SLICE_PIECE_BYTES: usize = 4 << 20;

/// Counters of slice reads (all threads).
#[derive(Default, Debug)]
pub(crate) struct SliceCounters {
    pub(crate) reads: AtomicU64,
    pub(crate) pieces: AtomicU64,
    pub(crate) runs: AtomicU64,
    pub(crate) wanted: AtomicU64,
    pub(crate) read: AtomicU64,
    /// Slices read through their staging window (the submitting call
    /// waited for earlier pieces before it could submit later ones).
    pub(crate) windowed: AtomicU64,
}

impl Engine {
    /// How [`Engine::read_slice`] reads `slice` on this engine: its
    /// pieces (each at most [`SLICE_PIECE_BYTES`] of blocks, runs merged
    /// across gaps of at most [`SLICE_GAP_BYTES`]), the bytes wanted and
    /// the bytes the drives move.
    pub fn slice_plan(&self, slice: &TensorSlice) -> SlicePlan {
        let align = self.direct_align() as u64;
        slice.plan_within(align, SLICE_GAP_BYTES, Some(self.slice_piece_bytes() as u64))
    }

    /// The staging one slice read keeps in flight at most
    /// (`EngineConfig::slice_staging`).
    pub fn slice_staging(&self) -> usize {
        self.slice_staging
    }

    /// The largest piece: [`SLICE_PIECE_BYTES`], or less when the window
    /// is smaller (one block at least).
    fn slice_piece_bytes(&self) -> usize {
        let align = self.direct_align();
        (SLICE_PIECE_BYTES.min(self.slice_staging) / align).max(1) * align
    }

    /// Reads `slice` ([`TensorRef::slice`]) so that its bytes, compact and
    /// row-major, land at byte `at` of `memory` (an arena from
    /// [`Engine::register_memory`] or [`Engine::packed_arena`]), reading
    /// from the drives only the pieces [`Engine::slice_plan`] chooses
    /// (counted in [`Stats::slices`]: bytes wanted and bytes read).
    ///
    /// A slice of one run (rows) is [`Engine::read_into`] with `scratch`:
    /// in place when in phase. A slice of many runs (columns, blocks) goes
    /// O_DIRECT into the engine's staging memory, piece by piece, and each
    /// run is copied into place when its piece is waited on ([`Stats::staged`]
    /// counts the copies); only the slice's exact bytes of `memory` are
    /// written, and only by that copy. The bytes `[at, at + slice.len())`
    /// must not overlap a slot of `memory` in use.
    ///
    /// Memory: at most `EngineConfig::slice_staging` of staging is in
    /// flight for one slice. When its pieces need more, this call reads
    /// through that window: it waits for the oldest piece, copies it into
    /// place and returns its staging before submitting the next, and
    /// returns with the last window in flight (counted in
    /// [`SliceStats::windowed`](crate::stats::SliceStats::windowed)). Only
    /// then does it block; a slice within the window is submitted without
    /// waiting. Idle staging beyond the window is unmapped when the slice
    /// resolves.
    ///
    /// [`Stats::slices`]: crate::Stats::slices
    /// [`Stats::staged`]: crate::Stats::staged
    pub fn read_slice(&self, slice: &TensorSlice, memory: &Arena, at: usize, scratch: Scratch) -> Result<SliceTicket> {
        self.origin.check()?;
        let tensor = slice.tensor();
        // A slice of another model's tensor is refused before anything else.
        self.model.file_of(tensor)?;
        let align = self.direct_align();
        let plan = self.slice_plan(slice);
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
        let shaped = TensorRef {
            shape: slice.shape().to_vec(),
            offset: tensor.offset + slice.covering().start,
            len: slice.len(),
            ..tensor.clone()
        };
        let mut pieces = Pieces {
            dest: Some(dest),
            parts: VecDeque::with_capacity(plan.pieces.len().min(1024)),
            slice: slice.clone(),
            meta: Meta::of(&self.model, &shaped),
            len,
            staging: std::sync::Arc::clone(&self.staging),
            staged: 0,
            keep: self.slice_staging.max(STAGING_MIN),
        };
        let budget = self.slice_staging;
        let mut waited = false;
        for p in &plan.pieces {
            let piece = TensorRef {
                offset: tensor.offset + p.range.start,
                len: p.range.end - p.range.start,
                dtype: Dtype::U8,
                shape: vec![(p.range.end - p.range.start) as usize],
                ..tensor.clone()
            };
            let pad = (piece.offset % align as u64) as usize;
            let need = window_bytes(pad, piece.len, align).unwrap_or(usize::MAX);
            // The window is full: the oldest piece is copied into place and
            // its staging returned before this one takes any. An error
            // drops the pieces in flight: their tickets settle into
            // staging (or leak) as any dropped ticket does.
            while !pieces.parts.is_empty() && pieces.staged.saturating_add(need) > budget {
                waited = true;
                pieces.settle_oldest()?;
            }
            let stage = self.staging_slot(&piece, pad, align)?;
            let ticket = self.read(&piece, stage)?;
            pieces.parts.push_back(Part {
                ticket,
                piece: p.clone(),
                staged: need,
            });
            pieces.staged += need;
        }
        count(plan.read, plan.pieces.len());
        if waited {
            self.slices.windowed.fetch_add(1, Ordering::Relaxed);
        }
        Ok(SliceTicket {
            inner: Inner::Pieces(Box::new(pieces)),
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
    /// The bytes of the tensor the piece holds, and its runs.
    piece: Piece,
    /// Bytes of staging it holds.
    staged: usize,
}

struct Pieces {
    /// The slice's bytes in the caller's memory (taken until resolved).
    dest: Option<Slot>,
    /// Pieces not yet copied, in order.
    parts: VecDeque<Part>,
    slice: TensorSlice,
    meta: Meta,
    len: usize,
    /// The engine's staging: its copy counters, and the idle staging given
    /// back when the slice resolves.
    staging: std::sync::Arc<Staging>,
    /// Staging the pieces in flight hold.
    staged: usize,
    /// Idle staging left mapped when the slice resolves.
    keep: usize,
}

impl std::fmt::Debug for Pieces {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pieces")
            .field("pending", &self.parts.len())
            .field("runs", &self.slice.runs().len())
            .field("len", &self.len)
            .field("staged", &self.staged)
            .finish()
    }
}

impl Pieces {
    /// Copies the runs of a resolved piece into place; its staging goes
    /// back when `staged` drops, right after.
    fn copy(&mut self, piece: &Piece, staging: usize, loaded: &Loaded) {
        let t0 = thread_cpu_ns();
        let dest = self
            .dest
            .as_mut()
            .expect("the slice's bytes are held until it resolves");
        let bytes = self.slice.copy_piece(piece, loaded.bytes(), dest.as_bytes_mut());
        self.staged -= staging;
        let c = &self.staging.counters;
        c.reads.fetch_add(1, Ordering::Relaxed);
        c.bytes.fetch_add(bytes, Ordering::Relaxed);
        c.copy_ns
            .fetch_add(thread_cpu_ns().saturating_sub(t0), Ordering::Relaxed);
    }

    /// Waits for the oldest piece and copies it into place (its staging
    /// then goes back).
    fn settle_oldest(&mut self) -> Result<()> {
        let Part { ticket, piece, staged } = self.parts.pop_front().expect("a piece in flight");
        let loaded = ticket.wait()?;
        self.copy(&piece, staged, &loaded);
        Ok(())
    }

    /// The slice, once every piece is in place: the caller's bytes, and
    /// idle staging beyond the window unmapped.
    fn finish(&mut self) -> Loaded {
        let dest = self.dest.take().expect("a slice resolves once");
        self.staging.trim(self.keep);
        Loaded::new(dest, 0, self.len, self.meta.clone())
    }

    /// Waits for the pieces in order until `deadline` (`None`: for as long
    /// as it takes), copying each into place as it resolves; the slice
    /// once every piece is in place, `None` when the deadline came first
    /// (the pieces copied so far stay copied).
    fn settle(&mut self, deadline: Option<Instant>) -> Option<Result<Loaded>> {
        while let Some(Part { ticket, piece, staged }) = self.parts.pop_front() {
            let got = match deadline {
                None => Ok(ticket.wait()),
                Some(d) => ticket.wait_timeout(d.saturating_duration_since(Instant::now())),
            };
            match got {
                // The staging slot goes back when `loaded` drops, after the copy.
                Ok(Ok(loaded)) => self.copy(&piece, staged, &loaded),
                Ok(Err(e)) => return Some(Err(e)),
                Err(ticket) => {
                    self.parts.push_front(Part { ticket, piece, staged });
                    return None;
                }
            }
        }
        Some(Ok(self.finish()))
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
                    Poll::Ready(Ok(loaded)) => {
                        let part = p.parts.remove(i).expect("a piece at i");
                        p.copy(&part.piece, part.staged, &loaded);
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
                return Poll::Ready(Ok(p.finish()));
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
