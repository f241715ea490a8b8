//! `Engine::load_all`: a model's tensors (or a filtered set) into one
//! mapping, each payload aligned, at device speed, as a [`LoadedModel`].

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use crate::engine::{Engine, Loaded, Scratch};
use crate::error::{Error, Result};
use crate::format::catalog::TensorRef;
use crate::format::dtype::Dtype;
use crate::format::element::Element;
use crate::load::layout::{self, Item};
use crate::load::waitset::WaitSet;
use crate::load::{LoadOptions, LoadProgress, Order};
use crate::memory::arena::PIECE;
use crate::memory::region::page_size;
use crate::memory::{Arena, SlotSpec};
use crate::stats::warning::Warning;

/// How a whole-model load went: where the time went, and how each payload
/// was read.
#[derive(Debug, Clone, serde::Serialize)]
#[non_exhaustive]
pub struct LoadReport {
    /// Tensors loaded.
    pub tensors: usize,
    /// Their payload bytes.
    pub bytes: u64,
    /// Bytes of the mapping (payloads, the scratch before in-place
    /// payloads and the page rounding after them).
    pub mapped_bytes: usize,
    /// Payloads read in place (their O_DIRECT window starts on a block).
    pub in_place: usize,
    /// Payloads whose file offset is not aligned as asked: read O_DIRECT
    /// through staging and copied into an aligned place (counted in
    /// `Stats::staged`).
    pub placed: usize,
    /// The whole `load_all`, layout and mapping included.
    pub seconds: f64,
    /// Creating the mapping (and populating or registering it when asked).
    pub arena_seconds: f64,
    /// The order tensors were laid out and read in.
    pub order: Order,
    /// Whether the mapping was faulted in before reading.
    pub populated: bool,
    /// Whether the memory read into is registered with the engine's rings
    /// (the load's own mapping when asked and not refused; given memory
    /// from `register_memory` or `packed_arena`).
    pub registered: bool,
    /// Whether the load went into memory the caller gave
    /// ([`Engine::load_all_into`]) rather than a mapping of its own.
    pub given_memory: bool,
    /// Whether helper threads faulted the mapping in beside the reads
    /// ([`LoadOptions::fault_ahead`]).
    pub faulted_ahead: bool,
    /// How many helper threads did ([`LoadOptions::fault_ahead_helpers`];
    /// fewer when a thread could not be started, said in
    /// `fault_ahead_refused`).
    pub fault_ahead_threads: usize,
    /// How long the helpers took to fault in the whole mapping, the
    /// slowest one's time (0 when none ran; they stop early when the load
    /// fails).
    pub fault_ahead_seconds: f64,
    /// Why the helpers did not fault the whole mapping in, when it was
    /// meant to (no thread could be started, or the kernel refused
    /// `MADV_POPULATE_WRITE`: Linux before 5.14); the reads then fault
    /// their own pages. Warned once per process too.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub fault_ahead_refused: Option<String>,
    /// Whether processes forked after the load have its tensors: the load's
    /// own mapping is handed over whole (`MADV_DOFORK`) once its last read
    /// has landed. False for memory the caller gave (the caller's to
    /// decide), for a registered mapping (its pages stay pinned by the
    /// rings, and fork would copy every pinned page at once), and when the
    /// kernel refused the advice (counted in
    /// [`Stats::arena_inherit_failures`](crate::Stats::arena_inherit_failures)).
    pub inherited_on_fork: bool,
}

impl LoadReport {
    /// Payload GB (10^9 bytes) per second of the whole load.
    pub fn gbps(&self) -> f64 {
        self.bytes as f64 / 1e9 / self.seconds.max(1e-9)
    }
}

/// A model's tensors in one mapping, each payload aligned for its dtype (or
/// as asked), returned by [`Engine::load_all`]. It owns the mapping: the
/// views borrow from it, and dropping it frees the memory. `Send + Sync`.
///
/// ```
/// use weightstream::{Engine, EngineConfig, LoadOptions, Model, ModelConfig};
/// # fn main() -> Result<(), Box<dyn std::error::Error>> {
/// # let tmp = tempfile::tempdir()?;
/// # let dir = tmp.path();
/// // A shard of two tensors: "a" (3 bytes of U8) and "b" (4 F32 values).
/// let header = br#"{"a":{"dtype":"U8","shape":[3],"data_offsets":[0,3]},"b":{"dtype":"F32","shape":[4],"data_offsets":[3,19]}}"#;
/// let mut shard = (header.len() as u64).to_le_bytes().to_vec();
/// shard.extend_from_slice(header);
/// shard.extend_from_slice(&[1, 2, 3]);
/// shard.extend([1.5f32, 2.5, 3.5, 4.5].iter().flat_map(|x| x.to_le_bytes()));
/// std::fs::write(dir.join("model.safetensors"), &shard)?;
///
/// let model = Model::open(ModelConfig::new(dir))?;
/// let engine = Engine::new(&model, EngineConfig::default())?;
/// let all = engine.load_all(&LoadOptions::default())?;
/// assert_eq!(all.len(), 2);
/// assert_eq!(all.get("a").unwrap().bytes(), &[1, 2, 3]);
/// // "b" starts 3 bytes after "a" in the file; whatever its file offset,
/// // its payload is 4-aligned here (in place, or copied into place from staging).
/// let b = all.get("b").unwrap();
/// assert_eq!(b.bytes().as_ptr() as usize % 4, 0);
/// assert_eq!(b.shape(), &[4]);
/// assert_eq!(b.as_slice::<f32>()?, &[1.5, 2.5, 3.5, 4.5]);
/// for t in &all {
///     println!("{} {} {:?}: {} bytes", t.name(), t.dtype(), t.shape(), t.len());
/// }
/// # drop(all); drop(engine);
/// # Ok(())
/// # }
/// ```
pub struct LoadedModel {
    /// In layout order.
    tensors: Vec<Loaded>,
    /// Name -> index into `tensors`.
    by_name: HashMap<String, usize>,
    /// Indices into `tensors` in the catalog's (name) order.
    in_name_order: Vec<usize>,
    report: LoadReport,
    /// The engine's warnings when the load ended.
    warnings: Vec<Warning>,
}

impl std::fmt::Debug for LoadedModel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LoadedModel")
            .field("tensors", &self.tensors.len())
            .field("report", &self.report)
            .field("warnings", &self.warnings.len())
            .finish()
    }
}

impl LoadedModel {
    /// The tensor named `name`, if this load took it.
    pub fn get(&self, name: &str) -> Option<TensorView<'_>> {
        self.by_name.get(name).map(|&i| TensorView {
            loaded: &self.tensors[i],
        })
    }

    /// Every tensor, in the model's name order.
    pub fn iter(&self) -> impl ExactSizeIterator<Item = TensorView<'_>> + '_ {
        self.in_name_order.iter().map(|&i| TensorView {
            loaded: &self.tensors[i],
        })
    }

    /// Number of tensors.
    pub fn len(&self) -> usize {
        self.tensors.len()
    }

    /// Whether no tensor was loaded (a filter that matched none).
    pub fn is_empty(&self) -> bool {
        self.tensors.is_empty()
    }

    /// Payload bytes of every tensor.
    pub fn total_bytes(&self) -> u64 {
        self.report.bytes
    }

    /// How the load went: times, in-place and placed counts, the mapping.
    pub fn report(&self) -> &LoadReport {
        &self.report
    }

    /// What fell back, as the engine said when the load ended
    /// ([`Engine::warnings`] then, worst first): reads buffered instead of
    /// O_DIRECT, payloads copied from staging, the pread backend, memory
    /// not registered, ... Empty when nothing did. Kept here because the
    /// engine of [`load`](crate::load) is gone when it returns.
    pub fn warnings(&self) -> &[Warning] {
        &self.warnings
    }

    /// The tensors as owned results (each keeps the mapping alive), in the
    /// model's name order.
    pub fn into_loaded(self) -> Vec<Loaded> {
        let mut slots: Vec<Option<Loaded>> = self.tensors.into_iter().map(Some).collect();
        self.in_name_order.iter().filter_map(|&i| slots[i].take()).collect()
    }
}

impl<'a> IntoIterator for &'a LoadedModel {
    type Item = TensorView<'a>;
    type IntoIter = Box<dyn ExactSizeIterator<Item = TensorView<'a>> + 'a>;
    fn into_iter(self) -> Self::IntoIter {
        Box::new(self.iter())
    }
}

/// One tensor of a [`LoadedModel`]: its name, dtype, shape and payload.
#[derive(Clone, Copy)]
pub struct TensorView<'a> {
    loaded: &'a Loaded,
}

impl std::fmt::Debug for TensorView<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.loaded.fmt(f)
    }
}

impl<'a> TensorView<'a> {
    /// The tensor's name.
    pub fn name(&self) -> &'a str {
        self.loaded.name()
    }

    /// Its dtype.
    pub fn dtype(&self) -> Dtype {
        self.loaded.dtype()
    }

    /// Its shape, in elements.
    pub fn shape(&self) -> &'a [usize] {
        self.loaded.shape()
    }

    /// The payload's bytes.
    pub fn bytes(&self) -> &'a [u8] {
        self.loaded.bytes()
    }

    /// Payload bytes.
    pub fn len(&self) -> usize {
        self.loaded.len()
    }

    /// Whether the payload is empty.
    pub fn is_empty(&self) -> bool {
        self.loaded.is_empty()
    }

    /// The payload as `&[T]`, checked as [`Loaded::as_slice`] (dtype,
    /// length, alignment). A load aligns every payload for its dtype, so
    /// the alignment check passes for the dtype's own element type.
    pub fn as_slice<T: Element>(&self) -> Result<&'a [T]> {
        self.loaded.as_slice()
    }

    /// The underlying read result.
    pub fn loaded(&self) -> &'a Loaded {
        self.loaded
    }
}

impl Engine {
    /// Loads every tensor of the model (or those `opts` selects) into one
    /// mapping and returns them by name.
    ///
    /// The layout is computed first (see [`LoadOptions`] for the order):
    /// each tensor whose file offset is a multiple of its alignment (its
    /// dtype's element size, or [`LoadOptions::align`] when larger) lands
    /// in place (its O_DIRECT window starts on a page of the mapping, the
    /// last partial block read O_DIRECT too); any other is read O_DIRECT
    /// into the engine's staging and copied to an aligned address (counted
    /// in `Stats::staged`, and in [`LoadReport::placed`]). The mapping is not
    /// populated or registered up front (unless asked): helper threads
    /// fault it in ahead of the reads, beside them
    /// ([`LoadOptions::fault_ahead`]).
    ///
    /// Reads are submitted ahead up to a window of bytes, so every drive
    /// has its queue full; the submission never blocks. The progress
    /// callback runs on this thread. On an error the load stops and the
    /// error (naming the tensor or file) is returned; reads still in flight
    /// complete into memory that is freed only after they do.
    pub fn load_all(&self, opts: &LoadOptions) -> Result<LoadedModel> {
        self.load_impl(opts, None)
    }

    /// Bytes of memory [`Engine::load_all_into`] needs for `opts`: the
    /// layout's length (payloads, the scratch before in-place payloads, the
    /// page rounding after them), the same for every load of this model
    /// with these options.
    pub fn load_bytes(&self, opts: &LoadOptions) -> Result<usize> {
        opts.check()?;
        let chosen = self.load_selection(opts)?;
        Ok(self.load_layout(opts, &chosen)?.0.bytes)
    }

    /// [`Engine::load_all`] into memory the caller already has: a packed
    /// arena of at least [`Engine::load_bytes`] bytes starting on a page
    /// (one from [`Engine::register_memory`] over the caller's own buffer,
    /// from [`Engine::packed_arena`], or [`Arena::packed`]). The tensors
    /// land where `load_all` would put them in its own mapping, relative to
    /// the arena's start; nothing is mapped, populated or faulted ahead
    /// here. This is the reload of an engine that keeps its weights'
    /// memory: once the memory has been written (faulted) by a first load,
    /// a load pays only for the reads, and a registered arena (the first
    /// two kinds) reads with fixed buffers, no page pinned again.
    ///
    /// No slot of the arena may be out: drop the [`LoadedModel`] of a
    /// previous load into it first (its views hold the slots). An arena
    /// that is too small, not page-aligned, not packed or with a slot out
    /// is an error naming the numbers, and nothing is read (a slot taken
    /// by another thread during the load fails the load at that tensor).
    /// However the call ends, no read into the arena is in flight when it
    /// returns: after an error the memory may be loaded into again, or,
    /// once the arena is dropped or released, freed.
    pub fn load_all_into(&self, opts: &LoadOptions, memory: &Arena) -> Result<LoadedModel> {
        self.load_impl(opts, Some(memory))
    }

    /// The tensors `opts` selects, in its order; an error when none is.
    fn load_selection(&self, opts: &LoadOptions) -> Result<Vec<&TensorRef>> {
        let model = self.model();
        opts.check_names(model.catalog())?;
        let mut chosen: Vec<&TensorRef> = model.catalog().tensors().iter().filter(|t| opts.selects(t)).collect();
        if chosen.is_empty() {
            // Nothing to load is a mistake in the filter, never a load of
            // nothing (with rates per GB of nothing).
            return Err(Error::Config(format!(
                "load_all: no tensor selected by {} (the model in {} has {} tensor(s))",
                opts.selection(),
                crate::error::escape(model.catalog().dir()),
                model.catalog().tensors().len()
            )));
        }
        match opts.order {
            Order::File => chosen.sort_by_key(|t| (t.shard, t.offset, t.index)),
            Order::Size => chosen.sort_by(|a, b| b.len.cmp(&a.len).then((a.shard, a.offset).cmp(&(b.shard, b.offset)))),
        }
        Ok(chosen)
    }

    /// The layout of `chosen` and their payload bytes.
    fn load_layout(&self, opts: &LoadOptions, chosen: &[&TensorRef]) -> Result<(layout::Layout, u64)> {
        let block = self.model().required_align();
        let unit = page_size().max(block);
        let items: Vec<Item> = chosen
            .iter()
            .map(|t| Item {
                offset: t.offset,
                len: t.len,
                align: opts.align_of(t.dtype),
            })
            .collect();
        let total_bytes = chosen
            .iter()
            .try_fold(0u64, |sum, t| sum.checked_add(t.len))
            .ok_or_else(|| Error::Config("load_all: the tensors' bytes overflow u64".into()))?;
        let plan = layout::plan(&items, block, unit, PIECE).ok_or_else(|| {
            Error::Config(format!(
                "load_all: laying out {} tensors of {total_bytes} bytes overflows the address space",
                chosen.len()
            ))
        })?;
        Ok((plan, total_bytes))
    }

    /// `memory` can take a load laid out in `bytes` bytes: packed, starting
    /// on a `unit` boundary, long enough.
    fn check_load_memory(&self, memory: &Arena, bytes: usize) -> Result<()> {
        let unit = page_size().max(self.model().required_align());
        let (base, len) = memory.region();
        let why = if !memory.is_packed() {
            Some("it is a fixed-slot arena (use a packed one: Engine::register_memory, Engine::packed_arena, Arena::packed)".to_string())
        } else if !(base as usize).is_multiple_of(unit) {
            Some(format!("it starts at {base:p}, not on a {unit}-byte boundary"))
        } else if len < bytes {
            Some(format!(
                "it holds {len} bytes and the load needs {bytes} (Engine::load_bytes)"
            ))
        } else if !memory.is_empty() {
            Some(format!(
                "{} slot(s) of it are in use (a read in flight, or a tensor still held): drop what a previous load into \
                 it returned first",
                memory.len()
            ))
        } else {
            None
        };
        match why {
            Some(why) => Err(Error::Config(format!("load_all_into: arena {}: {why}", memory.id()))),
            None => Ok(()),
        }
    }

    fn load_impl(&self, opts: &LoadOptions, memory: Option<&Arena>) -> Result<LoadedModel> {
        let t0 = Instant::now();
        // In a forked child: Error::Forked, before any arena is looked at
        // (a child sees every packed arena as empty).
        self.check_origin()?;
        opts.check()?;
        let chosen = self.load_selection(opts)?;
        let (plan, total_bytes) = self.load_layout(opts, &chosen)?;
        let block = self.model().required_align();
        let own = match memory {
            Some(memory) => {
                self.check_load_memory(memory, plan.bytes)?;
                None
            }
            None => Some(self.load_mapping(opts, &plan, &chosen, total_bytes, block)?),
        };
        let arena: &Arena = memory.or(own.as_ref()).expect("the given memory or the load's own");
        let arena_seconds = t0.elapsed().as_secs_f64();

        let n = chosen.len();
        let mut landed: Vec<Option<Loaded>> = (0..n).map(|_| None).collect();
        let stop = AtomicBool::new(false);
        let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
        // Memory given to the load is the caller's: never advised here.
        let helpers = if memory.is_none() {
            opts.fault_ahead_helpers(self.io_threads(), cpus, self.model().drives().len())
        } else {
            0
        };
        let (read, (fault_ahead_threads, fault_ahead_seconds, fault_ahead_refused)) = std::thread::scope(|scope| {
            let mut refused = None;
            let mut started = Vec::with_capacity(helpers);
            for k in 0..helpers {
                let stop = &stop;
                match std::thread::Builder::new()
                    .name(format!("ws-fault-ahead{k}"))
                    .spawn_scoped(scope, move || {
                        fault_ahead(arena, Stripe::of(plan.bytes, k, helpers), stop)
                    }) {
                    Ok(h) => started.push(h),
                    Err(e) => {
                        // The pieces of the helpers that did not start are
                        // faulted by the reads that land in them.
                        refused = Some(format!(
                            "{} of {helpers} fault-ahead thread(s) started: {e}",
                            started.len()
                        ));
                        break;
                    }
                }
            }
            // Stops the helpers however the reads end (an error, or a panic
            // in the caller's progress callback unwinding through here).
            struct Stop<'a>(&'a AtomicBool);
            impl Drop for Stop<'_> {
                fn drop(&mut self) {
                    self.0.store(true, Ordering::Relaxed);
                }
            }
            let guard = Stop(&stop);
            let read = self.read_all(
                opts,
                &chosen,
                &plan,
                (arena, memory.is_some()),
                &mut landed,
                total_bytes,
                t0,
            );
            drop(guard);
            let threads = started.len();
            let (mut secs, mut why) = (0.0f64, refused);
            for h in started {
                let (s, w) = h.join().unwrap_or((0.0, None));
                secs = secs.max(s);
                why = why.or(w);
            }
            if let Some(why) = &why {
                static WARNED: std::sync::Once = std::sync::Once::new();
                WARNED.call_once(|| {
                    tracing::warn!(
                        "load_all: {why}; the reads fault their own pages (said once; in LoadReport::fault_ahead_refused)"
                    )
                });
            }
            (read, (threads, secs, why))
        });
        read?;
        let tensors: Vec<Loaded> = landed.into_iter().map(|l| l.expect("every tensor landed")).collect();
        let by_name = chosen.iter().enumerate().map(|(i, t)| (t.name.clone(), i)).collect();
        let mut in_name_order: Vec<usize> = (0..n).collect();
        in_name_order.sort_by_key(|&i| chosen[i].index);
        let placed = plan
            .places
            .iter()
            .zip(&chosen)
            .filter(|(p, t)| !p.in_place && t.len > 0)
            .count();
        let registered = self.is_registered(arena);
        // The load's own mapping is the caller's now: every read has
        // landed and no handle is left to take a slot with once `own`
        // goes, so forked children may read it (one madvise for the whole
        // mapping). A registered one stays protected: the rings pin its
        // pages, and fork copies pinned pages at once.
        let inherited_on_fork = match own {
            Some(own) if !registered => own.inherit_all_on_fork().is_ok(),
            _ => false,
        };
        Ok(LoadedModel {
            tensors,
            by_name,
            in_name_order,
            warnings: self.warnings(),
            report: LoadReport {
                tensors: n,
                bytes: total_bytes,
                mapped_bytes: plan.bytes,
                in_place: plan.places.iter().filter(|p| p.in_place).count(),
                placed,
                seconds: t0.elapsed().as_secs_f64(),
                arena_seconds,
                order: opts.order,
                populated: memory.is_none() && opts.populate,
                registered,
                given_memory: memory.is_some(),
                faulted_ahead: fault_ahead_threads > 0,
                fault_ahead_threads,
                fault_ahead_seconds,
                fault_ahead_refused,
                inherited_on_fork,
            },
        })
    }

    /// The load's own mapping, as `opts` asks (registered, populated).
    fn load_mapping(
        &self,
        opts: &LoadOptions,
        plan: &layout::Layout,
        chosen: &[&TensorRef],
        total_bytes: u64,
        block: usize,
    ) -> Result<Arena> {
        if opts.register {
            self.packed_arena(plan.bytes, opts.populate)
        } else {
            Arena::packed(plan.bytes, block, opts.populate)
        }
        .map_err(|e| {
            e.size_set_by(format!(
                "load_all's selection: {} tensor(s) of {total_bytes} payload bytes laid out in {} bytes ({}; LoadOptions::align)",
                chosen.len(),
                plan.bytes,
                opts.selection()
            ))
        })
    }

    /// The load's reads: submitted in order a window of bytes ahead of what
    /// has landed, taken as they complete into `landed`, progress reported
    /// on this thread.
    #[allow(clippy::too_many_arguments)]
    fn read_all(
        &self,
        opts: &LoadOptions,
        chosen: &[&TensorRef],
        plan: &layout::Layout,
        (arena, arena_given): (&Arena, bool),
        landed: &mut [Option<Loaded>],
        total_bytes: u64,
        t0: Instant,
    ) -> Result<()> {
        let block = self.model().required_align();
        let n = chosen.len();
        // Into given memory, the call returns only when no read of it is
        // in flight, however it ends (an error, a panic in the progress
        // callback): the caller may free lent memory once it returns.
        let mut drain = Drain {
            set: WaitSet::new(),
            on: arena_given,
        };
        let set = &mut drain.set;
        let (mut next, mut ahead, mut done, mut done_bytes) = (0usize, 0u64, 0usize, 0u64);
        let window = opts.window_bytes() as u64;
        let report = |done: usize, bytes: u64| {
            if let Some(p) = &opts.progress {
                p(&LoadProgress {
                    bytes,
                    tensors: done,
                    total_bytes,
                    total_tensors: n,
                    elapsed: t0.elapsed(),
                });
            }
        };
        report(0, 0);
        while done < n {
            while next < n && (set.is_empty() || ahead < window) {
                let (t, p) = (chosen[next], plan.places[next]);
                let ticket = if p.in_place {
                    let spec = SlotSpec::new(t.len as usize).with_align(block).with_tail_room(true);
                    let slot = arena.take_at(p.at, p.len, spec, false).ok_or_else(|| {
                        Error::Config(format!(
                            "load_all: tensor {}: bytes [{}, {}) of the load's memory are not free ({})",
                            t.name,
                            p.at,
                            p.at + p.len,
                            if arena_given {
                                "the arena given to load_all_into is in use: drop what a previous load into it returned first"
                            } else {
                                "a layout bug"
                            }
                        ))
                    })?;
                    self.read_bulk(t, slot)?
                } else {
                    self.read_into(t, arena, p.at, Scratch::None)?
                };
                set.add(next, ticket);
                ahead += t.len;
                next += 1;
            }
            let (i, r) = set.wait().expect("a read is in flight while tensors remain");
            let loaded = r?;
            ahead -= chosen[i].len;
            done += 1;
            done_bytes += chosen[i].len;
            landed[i] = Some(loaded);
            report(done, done_bytes);
        }
        Ok(())
    }
}

/// The tickets of a load's reads; with `on`, dropping it waits for every
/// one still in flight.
struct Drain {
    set: WaitSet,
    on: bool,
}

impl Drop for Drain {
    fn drop(&mut self) {
        if self.on {
            while self.set.wait().is_some() {}
        }
    }
}

/// One fault-ahead helper's share of the mapping's first `bytes`: pieces
/// `k`, `k + n`, `k + 2n`, ... of [`Stripe::PIECE`] bytes, so `n` helpers
/// advance one front in layout order together.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Stripe {
    bytes: usize,
    k: usize,
    n: usize,
}

impl Stripe {
    /// Small enough to stop soon, large enough to be one call per 16 huge pages.
    const PIECE: usize = 32 << 20;

    fn of(bytes: usize, k: usize, n: usize) -> Self {
        Stripe { bytes, k, n: n.max(1) }
    }

    /// The stripe's pieces as `(offset, len)`, in order.
    fn pieces(self) -> impl Iterator<Item = (usize, usize)> {
        (self.k..)
            .step_by(self.n)
            .map_while(move |i| i.checked_mul(Self::PIECE).filter(|&at| at < self.bytes))
            .map(move |at| (at, Self::PIECE.min(self.bytes - at)))
    }
}

/// Faults `stripe`'s pieces of `arena` in, in order, until done or `stop`;
/// returns the seconds it took, and why it gave up when the kernel
/// refused. The layout places tensors in the order they are read, so the
/// helpers run ahead of the reads.
fn fault_ahead(arena: &Arena, stripe: Stripe, stop: &AtomicBool) -> (f64, Option<String>) {
    let t0 = Instant::now();
    for (at, len) in stripe.pieces() {
        if stop.load(Ordering::Relaxed) {
            break;
        }
        if let Err(e) = arena.populate_range(at, len) {
            // Before Linux 5.14 (EINVAL), or no memory now (the reads will
            // fault, and fail, themselves): the reads fault their pages.
            return (
                t0.elapsed().as_secs_f64(),
                Some(format!("MADV_POPULATE_WRITE refused at byte {at} of the mapping: {e}")),
            );
        }
    }
    (t0.elapsed().as_secs_f64(), None)
}

#[cfg(test)]
mod tests {
    use super::Stripe;

    #[test]
    fn the_helpers_stripes_cover_the_mapping_once_in_order() {
        const P: usize = Stripe::PIECE;
        for bytes in [0, 1, 4096, P - 1, P, P + 1, 5 * P + 12345, 64 * P] {
            for n in 1..=5 {
                let mut all: Vec<(usize, usize)> = (0..n).flat_map(|k| Stripe::of(bytes, k, n).pieces()).collect();
                for k in 0..n {
                    let mine: Vec<usize> = Stripe::of(bytes, k, n).pieces().map(|p| p.0).collect();
                    assert!(
                        mine.windows(2).all(|w| w[1] == w[0] + n * P),
                        "helper {k} of {n}: in order"
                    );
                }
                all.sort_unstable();
                let mut at = 0;
                for (o, len) in all {
                    assert_eq!(o, at, "{bytes} bytes, {n} helpers: no gap, no overlap");
                    assert!(len > 0 && len <= P);
                    at += len;
                }
                assert_eq!(at, bytes, "{bytes} bytes, {n} helpers: every byte");
            }
        }
        assert_eq!(Stripe::of(P, 0, 0), Stripe::of(P, 0, 1), "no helper count below 1");
    }
}
