//! The result of a read: a [`Ticket`] while it is in flight (it owns the
//! slot until every chunk is reaped), and the [`Loaded`] payload once it
//! has landed (the synchronous read returns one too).

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use crate::engine::inflight::{Outcome, Request};
use crate::engine::staging::Staged;
use crate::engine::sync::Arc as ReqArc;
use crate::error::{Error, Result};
use crate::fork::Origin;
use crate::format::catalog::TensorRef;
use crate::format::dtype::Dtype;
use crate::format::element::Element;
use crate::memory::Slot;
use crate::model::Model;

/// What a read is of: the model's tensor (by catalog index, so a read
/// allocates nothing for it), and for a part of one ([`TensorRef::rows`],
/// [`TensorRef::byte_range`]) the part's own dtype and shape.
#[derive(Clone)]
pub(crate) struct Meta {
    model: Model,
    index: usize,
    part: Option<std::sync::Arc<(Dtype, Vec<usize>)>>,
}

impl Meta {
    /// The description of a read of `tensor` (one of `model`'s, checked).
    pub(crate) fn of(model: &Model, tensor: &TensorRef) -> Self {
        let own = &model.catalog().tensors()[tensor.index];
        let part = (own.dtype != tensor.dtype || own.shape != tensor.shape)
            .then(|| std::sync::Arc::new((tensor.dtype, tensor.shape.clone())));
        Meta {
            model: model.clone(),
            index: tensor.index,
            part,
        }
    }

    fn tensor(&self) -> &TensorRef {
        &self.model.catalog().tensors()[self.index]
    }
}

/// A read in flight. It owns the slot: the payload is reachable only once
/// every chunk has completed. Dropping it early is safe: the slot returns
/// to its arena after the last completion is reaped (or, if the drive's I/O
/// thread stopped with a chunk still in the kernel, never).
///
/// A ticket is a `Future`, and `Engine::read` never blocks, so an async
/// task reads without holding up its executor thread (tokio here; the
/// library depends on no runtime):
///
/// ```
/// use weightstream::{Dtype, Engine, EngineConfig, Model, ModelConfig};
/// # fn main() -> Result<(), Box<dyn std::error::Error>> {
/// # let dir = weightstream::__internal::doc_model("ticket", &[("a", Dtype::U8, 9000), ("b", Dtype::U8, 7000)])?;
/// let model = Model::open(ModelConfig::new(&dir))?;
/// let engine = Engine::new(&model, EngineConfig::default())?;
/// let arena = engine.packed_arena(1 << 20, false)?;
/// let rt = tokio::runtime::Builder::new_current_thread().build()?;
/// let total = rt.block_on(async {
///     let a = model.tensor("a")?;
///     let b = model.tensor("b")?;
///     // A TakeError becomes a weightstream::Error through `?`.
///     let ta = engine.read(a, arena.take_for(a)?)?; // returns at once
///     let tb = engine.read(b, arena.take_for(b)?)?;
///     Ok::<_, weightstream::Error>(ta.await?.len() + tb.await?.len())
/// })?;
/// assert_eq!(total, 16_000);
/// // Blocking forms: wait(), wait_timeout(d), try_wait(), is_ready().
/// # drop(engine);
/// # std::fs::remove_dir_all(&dir)?;
/// # Ok(())
/// # }
/// ```
#[must_use = "a ticket owns its slot; wait() for the payload"]
pub struct Ticket {
    /// Dropped in `Drop` (leaked instead in a forked child).
    req: std::mem::ManuallyDrop<ReqArc<Request<Slot>>>,
    pad: usize,
    len: usize,
    origin: Origin,
    meta: Meta,
    /// A read staged for caller memory: where the payload is copied to.
    staged: Option<Box<Staged>>,
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
    pub(crate) fn new(req: ReqArc<Request<Slot>>, pad: usize, len: usize, origin: Origin, meta: Meta) -> Self {
        Ticket {
            req: std::mem::ManuallyDrop::new(req),
            pad,
            len,
            origin,
            meta,
            staged: None,
        }
    }

    /// This read lands in staging; resolving it copies the payload to
    /// `staged`'s destination and hands that back instead.
    pub(crate) fn staged(mut self, staged: Staged) -> Self {
        self.staged = Some(Box::new(staged));
        self
    }

    /// The request, for a scope that must see it complete.
    pub(crate) fn request(&self) -> ReqArc<Request<Slot>> {
        ReqArc::clone(&self.req)
    }

    /// The name of the tensor being read.
    pub fn name(&self) -> &str {
        &self.meta.tensor().name
    }

    fn resolve(&mut self, o: Outcome<Slot>) -> Result<Loaded> {
        match o {
            Outcome::Ready(slot) => Ok(match self.staged.take() {
                None => Loaded::new(slot, self.pad, self.len, self.meta.clone()),
                Some(st) => {
                    let (dest, pad) = st.finish(slot, self.pad, self.len);
                    Loaded::new(dest, pad, self.len, self.meta.clone())
                }
            }),
            Outcome::Failed(e) => Err(e),
            Outcome::Spent => Err(Error::Config("ticket polled after it completed".into())),
        }
    }

    /// Blocks until the payload has landed. In a forked child (where the
    /// engine's I/O threads do not exist) it returns [`Error::Forked`] at
    /// once instead of waiting forever.
    pub fn wait(mut self) -> Result<Loaded> {
        self.origin.check()?;
        let o = self.req.wait();
        self.resolve(o)
    }

    /// [`Ticket::wait`] for at most `timeout`: the payload (or the read's
    /// error), or the ticket back when the read is still in flight then.
    /// In a forked child it returns [`Error::Forked`] at once.
    pub fn wait_timeout(mut self, timeout: std::time::Duration) -> std::result::Result<Result<Loaded>, Ticket> {
        if let Err(e) = self.origin.check() {
            return Ok(Err(e));
        }
        match self.req.wait_timeout(timeout) {
            Some(o) => Ok(self.resolve(o)),
            None => Err(self),
        }
    }

    /// Whether this read lands in the engine's staging memory first and is
    /// copied into place when resolved (`Engine::read_into` at an address
    /// out of phase, or whose in-place window overlaps bytes in use),
    /// rather than in place.
    pub fn is_staged(&self) -> bool {
        self.staged.is_some()
    }

    /// Whether every chunk has completed.
    pub fn is_ready(&self) -> bool {
        self.req.is_done()
    }

    /// The payload if it has landed, else the ticket back.
    pub fn try_wait(mut self) -> std::result::Result<Result<Loaded>, Ticket> {
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
        let this = self.get_mut();
        match this.req.poll(cx.waker()) {
            Poll::Ready(o) => Poll::Ready(this.resolve(o)),
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

/// A payload that has landed in its slot, with what it is: the tensor's
/// name, dtype and shape ([`Loaded::as_slice`] views it typed). It owns the
/// slot: dropping it (or [`Loaded::into_slot`]) hands the slot back.
///
/// ```
/// use weightstream::{Dtype, Engine, EngineConfig, Model, ModelConfig};
/// # fn main() -> Result<(), Box<dyn std::error::Error>> {
/// # let dir = weightstream::__internal::doc_model("loaded", &[("w", Dtype::F32, 4096)])?;
/// let model = Model::open(ModelConfig::new(&dir))?;
/// let engine = Engine::new(&model, EngineConfig::default())?;
/// let arena = engine.packed_arena(1 << 20, false)?;
/// let w = model.tensor("w")?;
/// let loaded = engine.read(w, arena.take_for(w)?)?.wait()?;
/// assert_eq!((loaded.name(), loaded.dtype(), loaded.shape()), ("w", Dtype::F32, &[1024][..]));
/// // Checked: the dtype is F32, the length a multiple of 4, the address 4-aligned.
/// let values: &[f32] = loaded.as_slice()?;
/// assert_eq!(values.len(), 1024);
/// assert!(loaded.as_slice::<u16>().is_err(), "not the tensor's dtype");
/// # drop(loaded); drop(engine);
/// # std::fs::remove_dir_all(&dir)?;
/// # Ok(())
/// # }
/// ```
pub struct Loaded {
    slot: Slot,
    pad: usize,
    len: usize,
    meta: Meta,
}

impl Loaded {
    pub(crate) fn new(slot: Slot, pad: usize, len: usize, meta: Meta) -> Self {
        debug_assert!(pad + len <= slot.len());
        Loaded { slot, pad, len, meta }
    }

    /// The tensor's name.
    pub fn name(&self) -> &str {
        &self.meta.tensor().name
    }

    /// The payload's dtype (a byte range that cuts elements is `U8`).
    pub fn dtype(&self) -> Dtype {
        self.meta.part.as_ref().map_or(self.meta.tensor().dtype, |p| p.0)
    }

    /// The payload's shape, in elements (rows read: the row count first).
    pub fn shape(&self) -> &[usize] {
        self.meta.part.as_ref().map_or(&self.meta.tensor().shape, |p| &p.1)
    }

    /// Offset of the payload from the slot base (`file offset % align`;
    /// 0 for a payload copied into place by `Engine::read_into`).
    pub fn pad(&self) -> usize {
        self.pad
    }

    /// Offset of the payload from the start of its arena (for memory lent
    /// with `Engine::register_memory` or `Engine::lend`: from its start).
    pub fn offset(&self) -> usize {
        self.slot.offset() + self.pad
    }

    /// The payload's bytes (also `&*loaded`).
    pub fn bytes(&self) -> &[u8] {
        self
    }

    /// The payload's bytes, writable (the engine no longer touches them).
    pub fn bytes_mut(&mut self) -> &mut [u8] {
        let (pad, len) = (self.pad, self.len);
        &mut self.slot.as_bytes_mut()[pad..pad + len]
    }

    /// The payload as `&[T]`: checked that `T` holds this dtype's elements
    /// exactly ([`Element::DTYPES`]), that the bytes are a whole number of
    /// `T`, and that they are aligned for `T` (a payload lands at
    /// `file offset % block` in its slot: a file whose offsets are not
    /// aligned for the dtype gives an unaligned payload; view it as bytes or
    /// read it with `Engine::read_into` at an aligned place). No copy.
    pub fn as_slice<T: Element>(&self) -> Result<&[T]> {
        let b = self.bytes();
        self.check_view::<T>(b.as_ptr() as usize, b.len())?;
        // SAFETY: `T` is plain old data with no invalid bit patterns (the
        // sealed `Element`), the pointer is aligned for `T` and the length a
        // whole number of `T` (checked above), and the bytes are borrowed
        // from `self` for the slice's lifetime.
        Ok(unsafe { std::slice::from_raw_parts(b.as_ptr().cast::<T>(), b.len() / std::mem::size_of::<T>()) })
    }

    /// [`Loaded::as_slice`], writable.
    pub fn as_mut_slice<T: Element>(&mut self) -> Result<&mut [T]> {
        let (addr, len) = {
            let b = self.bytes();
            (b.as_ptr() as usize, b.len())
        };
        self.check_view::<T>(addr, len)?;
        let b = self.bytes_mut();
        // SAFETY: as `as_slice`, and `&mut self` makes the access exclusive.
        Ok(unsafe { std::slice::from_raw_parts_mut(b.as_mut_ptr().cast::<T>(), len / std::mem::size_of::<T>()) })
    }

    fn check_view<T: Element>(&self, addr: usize, len: usize) -> Result<()> {
        let (size, align) = (std::mem::size_of::<T>(), std::mem::align_of::<T>());
        let why = if !T::DTYPES.contains(&self.dtype()) {
            format!("its dtype {} is not one of {:?}", self.dtype().name(), T::DTYPES)
        } else if !len.is_multiple_of(size) {
            format!("{len} bytes are not a whole number of {size}-byte elements")
        } else if !addr.is_multiple_of(align) {
            format!(
                "the payload at address {addr:#x} is not {align}-byte aligned (its file offset is not); view it as bytes, or read it with Engine::read_into at an aligned offset"
            )
        } else {
            return Ok(());
        };
        Err(Error::View {
            tensor: self.name().to_string(),
            ty: std::any::type_name::<T>(),
            why,
        })
    }

    /// Lets processes forked from now on read this payload, as they read
    /// any memory of their parent (copied on write): the read is complete,
    /// so no read writes these pages any more. Without it, the pages of an
    /// arena the crate mapped are absent in a forked child (they are
    /// `MADV_DONTFORK`, so memory the kernel may write is never shared):
    /// touching them there panics naming the cause. One `madvise` on
    /// exactly the slot's pages (a slot is whole pages, never shared with
    /// another slot). The slot is fork-protected again before it is read
    /// into or taken again (after [`Loaded::into_slot`], or when it goes
    /// back to its arena). Nothing to do for caller memory
    /// (`Engine::register_memory`, `Engine::lend`), which is never advised.
    ///
    /// A whole-model load's own memory ([`Engine::load_all`](crate::Engine::load_all),
    /// [`load`](crate::load)) is handed over this way as a whole when it
    /// returns.
    ///
    /// # Errors
    /// [`Error::Forked`] in a forked child; [`Error::ForkAdvice`] when the
    /// kernel refuses (counted in [`Stats::arena_inherit_failures`](crate::Stats::arena_inherit_failures)
    /// and warned once): the payload stays readable here, not in a child.
    pub fn inherit_on_fork(&mut self) -> Result<()> {
        self.slot.inherit_on_fork()
    }

    /// Whether a process forked now would have this payload's pages
    /// ([`Loaded::inherit_on_fork`], a whole-model load's memory, or memory
    /// that is not fork-protected at all: the caller's, or a mapping whose
    /// `MADV_DONTFORK` the kernel refused).
    pub fn inherited_on_fork(&self) -> bool {
        self.slot.inherited() || !self.slot.fork_protected()
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
            .field("name", &self.name())
            .field("dtype", &self.dtype())
            .field("shape", &self.shape())
            .field("pad", &self.pad)
            .field("len", &self.len)
            .finish()
    }
}
