//! `Engine::stream`: tensors yielded as their reads complete, staged in a
//! packed arena of a fixed budget, so an engine can copy each one on (to a
//! GPU, into its own layout) while the rest are read.

use std::collections::VecDeque;

use crate::engine::{Engine, Loaded};
use crate::error::{Error, Result};
use crate::format::catalog::TensorRef;
use crate::load::waitset::WaitSet;
use crate::memory::arena::{in_place_bytes, round_up};
use crate::memory::region::page_size;
use crate::memory::Arena;

/// Tensors read in the order given and yielded as they complete, staged in
/// at most `budget` bytes ([`Engine::stream`]). Each item is a [`Loaded`]
/// (name, dtype, shape, payload) that holds its part of the budget until
/// it is dropped; a read starts when a tensor's slot fits in the free part
/// (next fit, in order: a large tensor waits for room rather than being
/// passed by smaller ones).
///
/// An `Iterator` (blocking the calling thread while nothing has landed)
/// and, with the `futures` feature, a `futures_core::Stream`. Dropping it
/// early is safe: reads still in flight complete into their slots, and the
/// staging memory is freed only after the last one is reaped.
///
/// When nothing is in flight and the next tensor does not fit because the
/// items already yielded hold the budget, the next item is an error naming
/// that tensor, which is taken off the stream (stream it again once items
/// are dropped): every tensor is yielded exactly once, as its payload or
/// as an error, so the stream always ends. In a forked child the next item
/// is [`Error::Forked`] and the stream ends.
///
/// ```
/// use weightstream::{Engine, EngineConfig, Model, ModelConfig};
/// # fn main() -> Result<(), Box<dyn std::error::Error>> {
/// # let tmp = tempfile::tempdir()?;
/// # let dir = tmp.path();
/// # let header = br#"{"l0":{"dtype":"U8","shape":[9000],"data_offsets":[0,9000]},"l1":{"dtype":"U8","shape":[9000],"data_offsets":[9000,18000]}}"#;
/// # let mut shard = (header.len() as u64).to_le_bytes().to_vec();
/// # shard.extend_from_slice(header);
/// # shard.extend((0..18000u32).map(|i| (i % 249) as u8));
/// # std::fs::write(dir.join("model.safetensors"), &shard)?;
/// let model = Model::open(ModelConfig::new(dir))?;
/// let engine = Engine::new(&model, EngineConfig::default())?;
/// // Every tensor, through at most 1 MiB of staging memory.
/// let mut seen = 0;
/// for loaded in engine.stream(model.catalog().tensors(), 1 << 20)? {
///     let loaded = loaded?;
///     // Copy it on (to a device, into the engine's layout), then drop it:
///     // its staging memory takes the next read.
///     assert_eq!(loaded.len(), 9000);
///     seen += 1;
/// }
/// assert_eq!(seen, 2);
/// # drop(engine);
/// # Ok(())
/// # }
/// ```
pub struct TensorStream<'e> {
    engine: &'e Engine,
    arena: Arena,
    /// Tensors not started yet, in order.
    queue: VecDeque<TensorRef>,
    set: WaitSet,
    next_key: usize,
    budget: usize,
}

impl std::fmt::Debug for TensorStream<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TensorStream")
            .field("budget", &self.budget)
            .field("queued", &self.queue.len())
            .field("in_flight", &self.set.len())
            .finish()
    }
}

impl Engine {
    /// Streams `tensors` (of this engine's model; parts of tensors too:
    /// [`TensorRef::rows`], [`TensorRef::byte_range`]) through a staging
    /// arena of `budget` bytes (rounded up to the page), yielding each as
    /// its read completes. See [`TensorStream`].
    ///
    /// No tensor at all is an error (an empty selection is a mistake in the
    /// filter that made it). A tensor whose slot (its payload, the `file offset % block` bytes
    /// before it, rounded up to the page) is larger than the budget is an
    /// error naming it and both sizes, before anything is read. The staging
    /// arena is registered with the rings like [`Engine::packed_arena`]
    /// (it is reused, so registration pays), and not populated: each page
    /// is faulted by its first read.
    pub fn stream<I>(&self, tensors: I, budget: usize) -> Result<TensorStream<'_>>
    where
        I: IntoIterator,
        I::Item: std::borrow::Borrow<TensorRef>,
    {
        use std::borrow::Borrow;
        let block = self.model().required_align();
        let page = page_size();
        let room = round_up(budget, page)
            .filter(|&r| r > 0 && r <= isize::MAX as usize)
            .ok_or_else(|| Error::Config(format!("stream: a budget of {budget} bytes (must be 1 to isize::MAX)")))?;
        self.check_origin()?;
        let queue: VecDeque<TensorRef> = tensors.into_iter().map(|t| t.borrow().clone()).collect();
        if queue.is_empty() {
            // An empty selection is a mistake in the caller's filter, never
            // a stream that ends before it starts.
            return Err(Error::Config(format!(
                "stream: no tensor given (the tensors passed to Engine::stream are empty; the model in {} has {})",
                crate::error::escape(self.model().catalog().dir()),
                self.model().catalog().tensors().len()
            )));
        }
        for t in &queue {
            // Refused before any arithmetic on its fields: a reference of
            // another model (or one edited by hand) names another file.
            self.model().file_of(t)?;
            // What `take_for` will ask of the staging arena, page-rounded.
            let need = in_place_bytes(t.offset, t.len, block).and_then(|n| round_up(n, page));
            if need.is_none_or(|n| n > room) {
                let need = need.map_or("more than usize::MAX".to_string(), |n| n.to_string());
                return Err(Error::Config(format!(
                    "stream: tensor {} needs {need} bytes of staging ({} payload bytes, {} before it, page-rounded), more than the budget of {budget} bytes",
                    t.name,
                    t.len,
                    t.offset % block as u64
                )));
            }
        }
        let arena = self
            .packed_arena(room, false)
            .map_err(|e| e.size_set_by(format!("Engine::stream's budget ({budget} bytes)")))?;
        Ok(TensorStream {
            engine: self,
            arena,
            queue,
            set: WaitSet::new(),
            next_key: 0,
            budget: room,
        })
    }
}

impl TensorStream<'_> {
    /// Tensors not yielded yet (queued, in flight or landed).
    pub fn remaining(&self) -> usize {
        self.queue.len() + self.set.len()
    }

    /// The staging budget, in bytes (page-rounded).
    pub fn budget(&self) -> usize {
        self.budget
    }

    /// Staging bytes free right now.
    pub fn free_bytes(&self) -> usize {
        self.arena.available()
    }

    /// Starts the reads of every queued tensor, in order, while its slot
    /// fits. A refused read is the error (that tensor is dropped).
    fn fill(&mut self) -> Result<()> {
        while let Some(t) = self.queue.front() {
            let Ok(slot) = self.arena.take_for(t) else {
                break;
            };
            let t = self.queue.pop_front().expect("a front tensor");
            let ticket = self.engine.read(&t, slot)?;
            self.set.add(self.next_key, ticket);
            self.next_key += 1;
        }
        Ok(())
    }

    /// Nothing in flight, and the front tensor has no room: the items the
    /// caller holds fill the budget. The tensor leaves the stream with the
    /// error (yielded once, as every tensor is).
    fn starved(&mut self) -> Option<Error> {
        let t = self.queue.pop_front()?;
        Some(Error::Config(format!(
            "stream: no room for tensor {} ({} bytes) in the {}-byte staging budget: {} bytes are held by tensors already yielded and not dropped; drop some (or raise the budget) and ask again",
            t.name,
            t.len,
            self.budget,
            self.budget - self.arena.available()
        )))
    }

    /// In a forked child: everything queued or in flight is given up (the
    /// tickets and slots are leaked, as in any child), and the stream ends
    /// after this error.
    fn forked(&mut self) -> Option<Error> {
        if self.queue.is_empty() && self.set.is_empty() {
            return None; // nothing left (or already given up): the end
        }
        let e = self.engine.check_origin().err()?;
        self.queue.clear();
        self.set = WaitSet::new();
        Some(e)
    }
}

impl Iterator for TensorStream<'_> {
    type Item = Result<Loaded>;

    fn next(&mut self) -> Option<Result<Loaded>> {
        if let Some(e) = self.forked() {
            return Some(Err(e));
        }
        if let Err(e) = self.fill() {
            return Some(Err(e));
        }
        if self.set.is_empty() {
            return self.starved().map(Err);
        }
        self.set.wait().map(|(_, r)| r)
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        (0, Some(self.remaining()))
    }
}

#[cfg(feature = "futures")]
impl futures_core::Stream for TensorStream<'_> {
    type Item = Result<Loaded>;

    fn poll_next(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<Loaded>>> {
        use std::task::Poll;
        let this = self.get_mut();
        if let Some(e) = this.forked() {
            return Poll::Ready(Some(Err(e)));
        }
        if let Err(e) = this.fill() {
            return Poll::Ready(Some(Err(e)));
        }
        if this.set.is_empty() {
            return Poll::Ready(this.starved().map(Err));
        }
        this.set.poll_next(cx).map(|o| o.map(|(_, r)| r))
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        (0, Some(self.remaining()))
    }
}
