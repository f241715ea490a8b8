//! Whole-model and streaming loads, on top of the engine.
//!
//! - [`Engine::load_all`](crate::Engine::load_all): every tensor (or a
//!   filtered set) into one mapping, laid out before anything is read
//!   (`layout`: each payload in place where its file offset allows the
//!   alignment asked for, else placed at an aligned address), read with
//!   many tickets in flight on every drive, returned as a [`LoadedModel`]
//!   of typed views.
//! - [`Engine::stream`](crate::Engine::stream): tensors yielded as they
//!   complete ([`TensorStream`], an `Iterator`, and a `futures_core::Stream`
//!   with the `futures` feature), staged in a bounded packed arena.
//!
//! - [`load`] / [`load_with`]: the start-up case in one call (open the
//!   model, start an engine, `load_all`, return the [`LoadedModel`]).
//!
//! Both wait on many tickets at once through `waitset` (each ticket's
//! waker records which one completed).

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use crate::config::{EngineConfig, ModelConfig};
use crate::engine::Engine;
use crate::error::{Error, Result};
use crate::format::catalog::{Catalog, TensorRef};
use crate::format::dtype::Dtype;
use crate::model::Model;

mod layout;
mod stream;
mod waitset;
mod whole;

pub use stream::TensorStream;
pub use whole::{LoadReport, LoadedModel, TensorView};

/// The order a whole-model load lays tensors out and reads them in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize)]
#[serde(rename_all = "lowercase")]
#[non_exhaustive]
pub enum Order {
    /// By shard, then by file offset: each file is read front to back.
    #[default]
    File,
    /// Largest payload first (ties in file order).
    Size,
}

/// Where a whole-model load stands, handed to the progress callback.
#[derive(Debug, Clone, Copy, PartialEq)]
#[non_exhaustive]
pub struct LoadProgress {
    /// Payload bytes landed so far.
    pub bytes: u64,
    /// Tensors landed so far.
    pub tensors: usize,
    /// Payload bytes of the whole load.
    pub total_bytes: u64,
    /// Tensors of the whole load.
    pub total_tensors: usize,
    /// Since the load started (mapping included).
    pub elapsed: Duration,
}

type Predicate = Arc<dyn Fn(&TensorRef) -> bool + Send + Sync>;
type ProgressFn = Arc<dyn Fn(&LoadProgress) + Send + Sync>;

/// How [`Engine::load_all`](crate::Engine::load_all) loads: which tensors,
/// their alignment, the order, the progress callback. `Default` loads every
/// tensor, each aligned for its dtype, in file order.
///
/// ```
/// use weightstream::{LoadOptions, Order};
/// let opts = LoadOptions::new()
///     .names_containing(["layers.0.", "embed"])
///     .align(64)
///     .order(Order::File)
///     .progress(|p| eprintln!("{} of {} bytes", p.bytes, p.total_bytes));
/// # let _ = opts;
/// ```
#[derive(Clone, Default)]
pub struct LoadOptions {
    align: usize,
    order: Order,
    names: Vec<String>,
    predicate: Option<Predicate>,
    progress: Option<ProgressFn>,
    window: Option<usize>,
    populate: bool,
    register: bool,
    /// `None`: the default (on when a CPU is spare).
    fault_ahead: Option<bool>,
    /// `None`: the default count.
    fault_ahead_threads: Option<usize>,
}

impl std::fmt::Debug for LoadOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LoadOptions")
            .field("align", &self.align)
            .field("order", &self.order)
            .field("names", &self.names)
            .field("predicate", &self.predicate.is_some())
            .field("progress", &self.progress.is_some())
            .field("window", &self.window_bytes())
            .field("populate", &self.populate)
            .field("fault_ahead", &self.fault_ahead)
            .field("fault_ahead_threads", &self.fault_ahead_threads)
            .field("register", &self.register)
            .finish()
    }
}

/// Bytes of payload a whole-model load keeps submitted ahead of what has
/// landed, by default: far more than every drive's queue holds (32 chunks
/// of at most 4 MiB), small enough that the adaptive router still routes
/// the later reads by what it has measured.
pub const DEFAULT_LOAD_WINDOW: usize = 1 << 30;

/// The most fault-ahead helpers a load starts
/// ([`LoadOptions::fault_ahead_helpers`]).
pub const MAX_FAULT_AHEAD_THREADS: usize = 16;

/// The largest alignment a load may ask for: the page. A payload lands in
/// place at `file offset % block` from a page boundary, so an alignment
/// beyond the page could only ever be met by placing (buffered) reads.
pub const MAX_LOAD_ALIGN: usize = 4096;

impl LoadOptions {
    /// Every tensor, each aligned for its dtype, in file order.
    pub fn new() -> Self {
        LoadOptions::default()
    }

    /// Every payload's address a multiple of `align` too (a power of two,
    /// at most [`MAX_LOAD_ALIGN`]); the dtype's element size still applies
    /// when larger. A payload whose file offset is not a multiple of it
    /// is read O_DIRECT through staging and copied into an aligned place
    /// (counted in `Stats::staged`).
    pub fn align(mut self, align: usize) -> Self {
        self.align = align;
        self
    }

    /// The order tensors are laid out and read in.
    pub fn order(mut self, order: Order) -> Self {
        self.order = order;
        self
    }

    /// Only tensors whose name contains one of `parts` (added to any given
    /// before; with none, every name matches). A part that no tensor name
    /// of the model contains is an error of the load naming it (a typo
    /// would otherwise load less than asked, silently), even when the
    /// other parts select tensors.
    pub fn names_containing<I, S>(mut self, parts: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        self.names.extend(parts.into_iter().map(Into::into));
        self
    }

    /// Only tensors `keep` accepts (and, if names were given, whose name
    /// matches one).
    pub fn filter(mut self, keep: impl Fn(&TensorRef) -> bool + Send + Sync + 'static) -> Self {
        self.predicate = Some(Arc::new(keep));
        self
    }

    /// Called on the caller's thread after each tensor lands (and once at
    /// the start, with nothing landed).
    pub fn progress(mut self, report: impl Fn(&LoadProgress) + Send + Sync + 'static) -> Self {
        self.progress = Some(Arc::new(report));
        self
    }

    /// Payload bytes kept submitted ahead of what has landed (at least one
    /// tensor is always in flight); default [`DEFAULT_LOAD_WINDOW`].
    pub fn window(mut self, bytes: usize) -> Self {
        self.window = Some(bytes);
        self
    }

    /// Fault the whole mapping in before the first read (default: off; each
    /// page is faulted by the read that lands in it, overlapped with the
    /// other reads in flight).
    pub fn populate(mut self, populate: bool) -> Self {
        self.populate = populate;
        self
    }

    /// Fault the mapping in on helper threads while the reads run, ahead
    /// of them in layout order. A page is zero-filled when first touched;
    /// with the helpers that happens beside the reads instead of inside the
    /// I/O thread's submission of the read landing in it. The helpers only
    /// ask the kernel to allocate pages (`MADV_POPULATE_WRITE`): they write
    /// nothing, so they never race a read's bytes. How many:
    /// [`LoadOptions::fault_ahead_helpers`]. Off: each page is
    /// faulted by the read that lands in it.
    ///
    /// Default (not called): on when the machine has a CPU to spare beside
    /// the engine's I/O threads, off when they already use every CPU (a
    /// drive that completes reads inline gets one ring per CPU: the helpers
    /// would only take CPU from them). Never with
    /// [`LoadOptions::populate`], which faults the mapping in first.
    pub fn fault_ahead(mut self, on: bool) -> Self {
        self.fault_ahead = Some(on);
        self
    }

    /// Fault ahead on `threads` helpers (0: not at all), instead of the
    /// default count (see [`LoadOptions::fault_ahead_helpers`]). They take
    /// the mapping's 32 MiB pieces in turn, so together they advance one
    /// front in layout order. At most [`MAX_FAULT_AHEAD_THREADS`] (a larger
    /// count is taken as that; [`LoadReport::fault_ahead_threads`] says how
    /// many ran). Never with [`LoadOptions::populate`].
    pub fn fault_ahead_threads(mut self, threads: usize) -> Self {
        self.fault_ahead_threads = Some(threads.min(MAX_FAULT_AHEAD_THREADS));
        self
    }

    /// Whether a load with `io_threads` I/O threads on `cpus` CPUs faults
    /// the mapping in ahead of its reads (see [`LoadOptions::fault_ahead`]).
    pub fn faults_ahead(&self, io_threads: usize, cpus: usize) -> bool {
        self.fault_ahead_helpers(io_threads, cpus, 1) > 0
    }

    /// How many helper threads a load with `io_threads` I/O threads on
    /// `cpus` CPUs, reading from `drives` drives, faults its mapping in
    /// with (0: none). As asked with [`LoadOptions::fault_ahead_threads`];
    /// otherwise, when faulting ahead ([`LoadOptions::fault_ahead`]), the
    /// CPUs the I/O threads leave spare (at least 1 when asked on), at
    /// most two per drive and [`MAX_FAULT_AHEAD_THREADS`]. Why that many: a
    /// core zero-fills fresh memory at about 3-10 GB/s (huge pages; 2.8-4.5
    /// on the development VM, measured by `weightstream load-ceiling`), and
    /// one NVMe drive reads up to 7-14 GB/s, so one helper would pace a
    /// load from several drives at one core's clearing rate.
    pub fn fault_ahead_helpers(&self, io_threads: usize, cpus: usize, drives: usize) -> usize {
        if self.populate {
            return 0;
        }
        if let Some(n) = self.fault_ahead_threads {
            return n;
        }
        let spare = cpus.saturating_sub(io_threads);
        let on = self.fault_ahead.unwrap_or(spare > 0);
        if !on {
            return 0;
        }
        spare.clamp(1, (2 * drives.max(1)).min(MAX_FAULT_AHEAD_THREADS))
    }

    /// Register the mapping with the rings as fixed buffers before reading
    /// (default: off). Registration pins, and so faults in, every page, one
    /// ring after another, before the first read: for memory read into
    /// once it costs more than it saves (see `docs/contracts.md`).
    pub fn register(mut self, register: bool) -> Self {
        self.register = register;
        self
    }

    /// Whether `tensor` is one this load takes.
    pub fn selects(&self, tensor: &TensorRef) -> bool {
        (self.names.is_empty() || self.names.iter().any(|n| tensor.name.contains(n.as_str())))
            && self.predicate.as_ref().is_none_or(|p| p(tensor))
    }

    /// What this load selects by, in words, for an error that found
    /// nothing: the name parts, the predicate, or neither (every tensor).
    pub(crate) fn selection(&self) -> String {
        let names = (!self.names.is_empty()).then(|| {
            let parts: Vec<String> = self.names.iter().map(|n| format!("{n:?}")).collect();
            format!("LoadOptions::names_containing [{}]", parts.join(", "))
        });
        let pred = self.predicate.is_some().then(|| "LoadOptions::filter".to_string());
        match (names, pred) {
            (Some(n), Some(p)) => format!("{n} and {p}"),
            (Some(n), None) => n,
            (None, Some(p)) => p,
            (None, None) => "no filter (every tensor)".to_string(),
        }
    }

    /// Every name part given ([`LoadOptions::names_containing`]) is in
    /// some tensor name of `catalog`; else an error naming the parts that
    /// are in none.
    pub(crate) fn check_names(&self, catalog: &Catalog) -> Result<()> {
        let unmatched: Vec<String> = self
            .names
            .iter()
            .filter(|n| !catalog.tensors().iter().any(|t| t.name.contains(n.as_str())))
            .map(|n| format!("{n:?}"))
            .collect();
        if unmatched.is_empty() {
            return Ok(());
        }
        Err(Error::Config(format!(
            "load_all: no tensor selected by {} for {}: no tensor name contains it (the model in {} has {} tensor(s); \
             every part given must select at least one)",
            self.selection(),
            unmatched.join(", "),
            crate::error::escape(catalog.dir()),
            catalog.tensors().len()
        )))
    }

    /// The alignment asked for with [`LoadOptions::align`] (0: none).
    pub fn alignment(&self) -> usize {
        self.align
    }

    /// The order of the load.
    pub fn load_order(&self) -> Order {
        self.order
    }

    fn window_bytes(&self) -> usize {
        self.window.unwrap_or(DEFAULT_LOAD_WINDOW)
    }

    fn check(&self) -> Result<()> {
        if self.align != 0 && (!self.align.is_power_of_two() || self.align > MAX_LOAD_ALIGN) {
            return Err(Error::Config(format!(
                "load alignment {} must be a power of two of at most {MAX_LOAD_ALIGN}",
                self.align
            )));
        }
        Ok(())
    }

    /// The alignment of `dtype`'s payloads in this load.
    fn align_of(&self, dtype: Dtype) -> usize {
        element_align(dtype).max(self.align).max(1)
    }
}

/// Loads every tensor of the model in `dir` into one mapping: the start-up
/// load of a whole model in one call. Each payload is aligned for its
/// dtype, read O_DIRECT in place where its file offset allows (else through
/// staging and one copy), every drive busy. The same as
/// [`load_with`]`(dir, &LoadOptions::default())`.
///
/// `dir` is a model directory (its `*.safetensors` shards, and the
/// `model.safetensors.index.json` when there is one) or the primary folder
/// of a placed model (`weightstream place`), opened with
/// [`ModelConfig::new`]: no split directories, no mirrors, `adaptive`
/// routing, O_DIRECT where the file system allows. The engine is
/// [`EngineConfig::default`]. No `WEIGHTSTREAM_*` variable changes what is
/// read or how (not [`ModelConfig::from_env`]: the directory is the one
/// given, and a variable left in a shell cannot add mirrors or change the
/// backend), except the NUMA topology, which every default engine takes
/// from the environment (`WEIGHTSTREAM_NUMA`, `WEIGHTSTREAM_NUMA_XML`; see
/// [`EngineConfig::numa_provider`]). For mirrors, split directories, other
/// settings or the environment's: open the model and start the engine
/// yourself, then [`Engine::load_all`].
///
/// The engine is gone when this returns: the [`LoadedModel`] owns its
/// mapping and needs nothing else. What fell back on the way (reads that
/// went buffered or through staging, the pread backend, ...) is in
/// [`LoadedModel::warnings`].
///
/// ```
/// # fn main() -> Result<(), Box<dyn std::error::Error>> {
/// # use weightstream::Dtype;
/// # let dir = weightstream::__internal::doc_model("load", &[("embed", Dtype::Bf16, 8192), ("head", Dtype::F32, 4000)])?;
/// let model = weightstream::load(&dir)?;
/// let embed = model.get("embed").expect("a tensor of the model");
/// assert_eq!((embed.dtype(), embed.len()), (Dtype::Bf16, 8192));
/// assert_eq!(model.get("head").unwrap().as_slice::<f32>()?.len(), 1000);
/// for w in model.warnings() {
///     eprintln!("warning: {w}");
/// }
/// # drop(model);
/// # std::fs::remove_dir_all(&dir)?;
/// # Ok(())
/// # }
/// ```
pub fn load(dir: impl Into<PathBuf>) -> Result<LoadedModel> {
    load_with(dir, &LoadOptions::default())
}

/// [`load`] with [`LoadOptions`]: which tensors, their alignment, the
/// order, a progress callback. The model and the engine are opened as
/// [`load`] opens them.
///
/// ```no_run
/// use weightstream::LoadOptions;
/// # fn main() -> weightstream::Result<()> {
/// let opts = LoadOptions::new()
///     .names_containing(["layers.0.", "embed_tokens"])
///     .align(64)
///     .progress(|p| eprintln!("{} of {} bytes", p.bytes, p.total_bytes));
/// let first_layer = weightstream::load_with("/nvme0/qwen3-moe", &opts)?;
/// println!("{} tensors, {:.2} GB/s", first_layer.len(), first_layer.report().gbps());
/// # Ok(())
/// # }
/// ```
pub fn load_with(dir: impl Into<PathBuf>, opts: &LoadOptions) -> Result<LoadedModel> {
    let model = Model::open(ModelConfig::new(dir))?;
    let engine = Engine::new(&model, EngineConfig::default())?;
    // The engine drops on return, every read landed: the LoadedModel's
    // slots keep the mapping alive, nothing of the engine.
    engine.load_all(opts)
}

/// The alignment a dtype's elements need: its size in bytes (1 for
/// sub-byte dtypes), a power of two for every dtype.
pub(crate) fn element_align(dtype: Dtype) -> usize {
    ((dtype.bits() / 8).max(1) as usize).next_power_of_two()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fault_ahead_helpers_take_the_spare_cpus_at_most_two_per_drive() {
        let auto = LoadOptions::new();
        // (I/O threads, CPUs, drives) -> helpers
        assert_eq!(
            auto.fault_ahead_helpers(1, 2, 1),
            1,
            "the development VM: one spare CPU"
        );
        assert_eq!(auto.fault_ahead_helpers(2, 2, 1), 0, "no CPU spare: off");
        assert_eq!(auto.fault_ahead_helpers(4, 128, 4), 8, "two per drive");
        assert_eq!(auto.fault_ahead_helpers(8, 256, 16), MAX_FAULT_AHEAD_THREADS);
        assert_eq!(auto.fault_ahead_helpers(1, 3, 8), 2, "no more than the spare CPUs");
        assert_eq!(auto.fault_ahead_helpers(1, 8, 0), 2, "no drive counts as one");
        let on = LoadOptions::new().fault_ahead(true);
        assert_eq!(on.fault_ahead_helpers(2, 2, 1), 1, "asked on with no CPU spare: one");
        assert_eq!(LoadOptions::new().fault_ahead(false).fault_ahead_helpers(1, 64, 4), 0);
        assert_eq!(
            LoadOptions::new().fault_ahead_threads(3).fault_ahead_helpers(2, 2, 1),
            3
        );
        assert_eq!(
            LoadOptions::new().fault_ahead_threads(0).fault_ahead_helpers(1, 64, 4),
            0
        );
        assert_eq!(
            LoadOptions::new()
                .fault_ahead_threads(1000)
                .fault_ahead_helpers(1, 2, 1),
            MAX_FAULT_AHEAD_THREADS
        );
        assert_eq!(
            LoadOptions::new()
                .fault_ahead_threads(4)
                .populate(true)
                .fault_ahead_helpers(1, 64, 4),
            0,
            "populated first: nothing to fault ahead"
        );
        assert!(auto.faults_ahead(1, 2) && !auto.faults_ahead(2, 2));
    }
}
