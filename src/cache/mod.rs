//! An expert cache for mixture-of-experts decode: whole experts (every
//! part of every projection, or their rows of fused tensors) kept in
//! registered slot memory within a budget, misses read O_DIRECT in place
//! on the cache's own engine (striped over the drives and mirrors as every
//! read is), prefetch in the background, exact LRU (or LFU with aging)
//! over unpinned entries.
//!
//! # Memory
//! One fixed arena per part name (`gate_proj.weight`, `down_proj.bias`,
//! ...), each with `capacity` slots as large as that part's largest
//! expert: an entry takes one slot of each arena its expert has a part
//! in, so `capacity` entries always fit and never fragment, and eviction
//! order is free (exact LRU needs that: an arena carved next fit would
//! refuse a slot that LRU order freed in the wrong place).
//!
//! # Pinning and the kernel
//! An entry's bytes are [`Loaded`]s shared behind an `Arc`: the cache holds
//! one reference, each [`ExpertHandle`] (and each tensor Python or C was
//! handed) another. An entry is evictable only when the cache's reference
//! is the last, checked under the cache's lock; a new reference is only
//! ever made under that lock or from a live handle, so the check cannot
//! race. Evicting drops the cache's reference: the slots go back to their
//! arenas only with the last handle, and a handle outliving the cache
//! keeps its slots' mapping alive. A read in flight is never evicted, and
//! its slots belong to its [`Ticket`]s (the engine's contract: never
//! reused before the kernel is done, on any path).
//!
//! # Waiting
//! A miss's reads start under the lock (submission never blocks); whoever
//! needs the entry first (the getter, or a later get of a prefetched
//! entry) takes its tickets and waits with no lock held; concurrent gets
//! of the same expert wait on the entry's condition variable for that one
//! read. A prefetched entry nobody asked for is settled lazily, when its
//! tickets are all ready and the cache needs room or counts.

mod policy;

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::Instant;

use crate::config::EngineConfig;
use crate::engine::{Engine, Loaded, Ticket};
use crate::error::{CacheError, Error, Result};
use crate::fork::Origin;
use crate::format::catalog::TensorRef;
use crate::memory::{Arena, SlotSpec};
use crate::model::Model;

use policy::Order;
pub use policy::{simulate_lru, ExpertKey, Policy};

/// How much an [`ExpertCache`] holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Capacity {
    /// This many whole experts.
    Experts(usize),
    /// As many whole experts as these bytes of slot memory hold (each
    /// entry costs [`ExpertCache::entry_bytes`]).
    Bytes(u64),
}

/// Settings of an [`ExpertCache`].
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct CacheConfig {
    /// The budget.
    pub capacity: Capacity,
    /// Which unpinned entry goes when room is needed.
    pub policy: Policy,
    /// The cache's engine (backend, depth, NUMA, ...).
    pub engine: EngineConfig,
    /// Hand each landed entry's pages to processes forked from then on
    /// ([`Loaded::inherit_on_fork`]: a forked worker reads the tensors its
    /// parent holds); the slots are fork-protected again before they are
    /// read into again. Off by default.
    pub inherit_on_fork: bool,
}

impl CacheConfig {
    /// `capacity`, exact LRU, the engine's defaults.
    pub fn new(capacity: Capacity) -> Self {
        CacheConfig {
            capacity,
            policy: Policy::Lru,
            engine: EngineConfig::default(),
            inherit_on_fork: false,
        }
    }

    /// Sets [`CacheConfig::inherit_on_fork`].
    pub fn inherit_on_fork(mut self, on: bool) -> Self {
        self.inherit_on_fork = on;
        self
    }

    /// Sets the eviction policy.
    pub fn policy(mut self, policy: Policy) -> Self {
        self.policy = policy;
        self
    }

    /// Sets the engine's configuration.
    pub fn engine(mut self, engine: EngineConfig) -> Self {
        self.engine = engine;
        self
    }
}

/// The cache's counters ([`ExpertCache::stats`]).
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
#[non_exhaustive]
pub struct CacheStats {
    /// Entries the budget holds: what it asked for, or the model's routed
    /// experts when it asked for more (nothing more is mapped).
    pub capacity: usize,
    /// Entries the budget asked for ([`Capacity::Experts`], or what
    /// [`Capacity::Bytes`] holds); above `capacity` when clamped.
    pub capacity_asked: usize,
    /// Slot bytes one entry costs.
    pub entry_bytes: u64,
    /// Entries present now (landed or in flight).
    pub entries: usize,
    /// Entries a live handle pins now.
    pub pinned: usize,
    /// `get`s of an expert present (landed, or in flight: the get waited
    /// for the read already started).
    pub hits: u64,
    /// `get`s that started a read.
    pub misses: u64,
    /// Prefetch reads started.
    pub prefetched: u64,
    /// Prefetched entries a `get` then used (counted once each).
    pub prefetch_used: u64,
    /// Prefetched entries evicted before any `get` used them.
    pub prefetch_wasted: u64,
    /// Their bytes.
    pub prefetch_wasted_bytes: u64,
    /// Experts a prefetch did not start because every entry was pinned or
    /// in flight.
    pub prefetch_refused: u64,
    /// Entries evicted.
    pub evictions: u64,
    /// Reads that failed (nothing cached).
    pub failed_reads: u64,
    /// Payload bytes read (misses and prefetches).
    pub bytes_read: u64,
    /// Bytes read per drive (device name, bytes): the cache's engine's
    /// counters, which only the cache uses.
    pub bytes_read_per_drive: Vec<(String, u64)>,
    /// Seconds callers spent blocked in `get` / `get_many` waiting for
    /// reads.
    pub wait_seconds: f64,
}

/// What a [`ExpertCache::prefetch`] did with its list.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PrefetchReport {
    /// Reads started.
    pub started: usize,
    /// Experts already present (or listed twice): nothing to do.
    pub present: usize,
    /// Experts not started because every entry was pinned or in flight
    /// (the rest of the list is counted here too: prefetch never waits).
    pub refused: usize,
}

/// One part of a cached expert.
struct Part {
    projection: String,
    part: String,
    loaded: Loaded,
}

/// A landed expert, shared by the cache and its handles.
struct ExpertData {
    key: ExpertKey,
    parts: Vec<Part>,
}

/// A cached expert, pinned (never evicted, never overwritten) while this
/// handle or a clone lives. Its memory outlives the cache if need be.
#[derive(Clone)]
pub struct ExpertHandle {
    data: Arc<ExpertData>,
}

impl std::fmt::Debug for ExpertHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ExpertHandle")
            .field("layer", &self.data.key.0)
            .field("expert", &self.data.key.1)
            .field("parts", &self.data.parts.len())
            .finish()
    }
}

impl ExpertHandle {
    /// The layer.
    pub fn layer(&self) -> usize {
        self.data.key.0
    }

    /// The expert's number.
    pub fn expert(&self) -> usize {
        self.data.key.1
    }

    /// Every part: (projection, part, payload), in name order.
    pub fn parts(&self) -> impl Iterator<Item = (&str, &str, &Loaded)> + '_ {
        self.data
            .parts
            .iter()
            .map(|p| (p.projection.as_str(), p.part.as_str(), &p.loaded))
    }

    /// The part `part` (`weight`, `bias`, ...) of `projection`.
    pub fn part(&self, projection: &str, part: &str) -> Option<&Loaded> {
        self.parts().find(|p| p.0 == projection && p.1 == part).map(|p| p.2)
    }

    /// The weight of `projection` (the part `weight`, else `qweight`,
    /// `weight_packed` or `blocks`).
    pub fn weight(&self, projection: &str) -> Option<&Loaded> {
        ["weight", "qweight", "weight_packed", "blocks"]
            .iter()
            .find_map(|w| self.part(projection, w))
    }

    /// Payload bytes of every part.
    pub fn bytes(&self) -> u64 {
        self.data.parts.iter().map(|p| p.loaded.len() as u64).sum()
    }

    /// The `i`th part's payload (in [`ExpertHandle::parts`] order).
    pub fn part_at(&self, i: usize) -> Option<&Loaded> {
        self.data.parts.get(i).map(|p| &p.loaded)
    }

    /// Number of parts.
    pub fn part_count(&self) -> usize {
        self.data.parts.len()
    }
}

/// A read of one expert, from its start until someone settles it.
struct Pending {
    key: ExpertKey,
    state: Mutex<PendingState>,
    settled: Condvar,
}

enum PendingState {
    /// In flight; whoever needs it takes the tickets.
    Reads(Vec<(usize, Ticket)>),
    /// Someone is waiting on the tickets.
    Taken,
    Done(std::result::Result<Arc<ExpertData>, CacheError>),
}

/// Settles a read as failed if the thread that took its tickets unwinds
/// before it settles them (forgotten on the normal path).
struct Unwound<'a>(&'a Arc<Pending>);

impl Drop for Unwound<'_> {
    fn drop(&mut self) {
        let p = self.0;
        let mut s = p.state.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        *s = PendingState::Done(Err(CacheError::ReadFailed {
            expert: format!("layer {} expert {}", p.key.0, p.key.1),
            cause: "the thread waiting for the read unwound (a panic)".into(),
        }));
        drop(s);
        p.settled.notify_all();
    }
}

enum Entry {
    Loading(Arc<Pending>),
    Ready(Arc<ExpertData>),
}

struct Meta {
    entry: Entry,
    bytes: u64,
    /// Prefetched and no get has used it yet.
    prefetched_unused: bool,
}

struct State {
    map: HashMap<ExpertKey, Meta>,
    order: Order,
    /// The reads still in the kernel of experts whose read failed (the
    /// entry is gone; its other parts' slots come back as these land):
    /// counted as in flight, so `Full` never means "nothing held".
    draining: Vec<Vec<Ticket>>,
}

impl State {
    /// The reads in flight (or settled and not yet published).
    fn loading(&self) -> Vec<Arc<Pending>> {
        self.map
            .values()
            .filter_map(|m| match &m.entry {
                Entry::Loading(p) => Some(Arc::clone(p)),
                Entry::Ready(_) => None,
            })
            .collect()
    }
}

/// The parts of one expert, resolved once: (part arena, tensor).
type Plan = Vec<(usize, TensorRef)>;

#[derive(Default)]
struct Counters {
    hits: AtomicU64,
    misses: AtomicU64,
    prefetched: AtomicU64,
    prefetch_used: AtomicU64,
    prefetch_wasted: AtomicU64,
    prefetch_wasted_bytes: AtomicU64,
    prefetch_refused: AtomicU64,
    evictions: AtomicU64,
    failed_reads: AtomicU64,
    bytes_read: AtomicU64,
    wait_ns: AtomicU64,
}

fn add(c: &AtomicU64, n: u64) {
    c.fetch_add(n, Ordering::Relaxed);
}

/// An expert cache over one model's routed experts; see the module docs.
/// Any number of threads may `get` and `prefetch` at once.
///
/// ```
/// use weightstream::{CacheConfig, Capacity, ExpertCache, Model, ModelConfig, Dtype};
/// # fn main() -> Result<(), Box<dyn std::error::Error>> {
/// # let spec: Vec<(String, Dtype, usize)> = (0..4).flat_map(|e| ["w1", "w2"].map(|p| (format!("model.layers.0.mlp.experts.{e}.{p}.weight"), Dtype::Bf16, 8192))).collect();
/// # let spec: Vec<(&str, Dtype, usize)> = spec.iter().map(|(n, d, l)| (n.as_str(), *d, *l)).collect();
/// # let dir = weightstream::__internal::doc_model("cache-doc", &spec)?;
/// let model = Model::open(ModelConfig::new(&dir))?;
/// let cache = ExpertCache::new(&model, CacheConfig::new(Capacity::Experts(2)))?;
/// cache.prefetch(&[(0, 3)]); // never waits
/// let e = cache.get(0, 1)?; // a miss: read in place, pinned while `e` lives
/// assert_eq!(e.weight("w1").unwrap().len(), 8192);
/// let again = cache.get(0, 1)?; // a hit
/// assert_eq!(cache.stats().hits, 1);
/// # drop((e, again, cache));
/// # std::fs::remove_dir_all(&dir)?;
/// # Ok(())
/// # }
/// ```
pub struct ExpertCache {
    // Field order is drop order: handles of in-flight reads (in `state`)
    // before the arenas and the engine.
    state: Mutex<State>,
    counters: Counters,
    /// Per key: its parts (made once at start).
    plans: HashMap<ExpertKey, (Plan, u64, String)>,
    arenas: Vec<Arena>,
    part_names: Vec<(String, String)>,
    capacity: usize,
    capacity_asked: usize,
    entry_bytes: u64,
    inherit_on_fork: bool,
    bytes_at_start: Vec<u64>,
    origin: Origin,
    engine: Engine,
    model: Model,
}

impl ExpertCache {
    /// A cache over `model`'s routed experts (shared experts are always
    /// active: keep them resident with a plain read), with an engine of
    /// its own.
    ///
    /// # Errors
    /// The model has no experts ([`Model::experts`]); the budget holds no
    /// whole expert ([`CacheError::Config`]); the engine or the arenas
    /// could not be made (memory, threads).
    pub fn new(model: &Model, config: CacheConfig) -> Result<Self> {
        let experts = model.experts()?;
        // Every routed expert's parts, and the largest of each part name.
        let mut part_index: HashMap<(String, String), usize> = HashMap::new();
        let mut part_names: Vec<(String, String)> = Vec::new();
        let mut largest: Vec<usize> = Vec::new();
        let mut plans = HashMap::new();
        for layer in experts.layers() {
            for e in layer.experts() {
                let Some(index) = e.index() else { continue };
                let mut plan = Vec::new();
                for (pname, proj) in e.projections() {
                    for (part, t) in proj.parts() {
                        let k = (pname.to_string(), part.to_string());
                        let i = *part_index.entry(k.clone()).or_insert_with(|| {
                            part_names.push(k);
                            largest.push(0);
                            largest.len() - 1
                        });
                        let len = usize::try_from(t.len).map_err(|_| {
                            CacheError::Config(format!("{}: {} bytes do not fit this machine", t.name, t.len))
                        })?;
                        largest[i] = largest[i].max(len);
                        plan.push((i, t.clone()));
                    }
                }
                plans.insert((layer.index(), index), (plan, e.bytes(), e.describe()));
            }
        }
        if plans.is_empty() {
            return Err(CacheError::Config(format!(
                "the model in {} has shared experts only: nothing to cache",
                crate::error::escape(model.catalog().dir())
            ))
            .into());
        }
        let align = model.required_align();
        let specs: Vec<SlotSpec> = largest
            .iter()
            .map(|&l| SlotSpec::new(l.max(1)).with_align(align).with_tail_room(true))
            .collect();
        let mut entry_bytes = 0u64;
        for s in &specs {
            entry_bytes += s.slot_len()? as u64;
        }
        let asked = match config.capacity {
            Capacity::Experts(n) => n,
            Capacity::Bytes(b) => usize::try_from(b / entry_bytes.max(1)).unwrap_or(usize::MAX),
        };
        // No slot for an expert that does not exist: a budget above the
        // routed experts maps (and registers) only what they take.
        let capacity = asked.min(plans.len());
        if capacity < asked {
            tracing::info!(
                "expert cache: a budget of {:?} holds {asked} experts; the model has {} routed experts, so {capacity} entries are mapped",
                config.capacity,
                plans.len()
            );
        }
        if capacity == 0 {
            return Err(CacheError::Config(format!(
                "a budget of {:?} holds no whole expert (one entry costs {entry_bytes} bytes of slots)",
                config.capacity
            ))
            .into());
        }
        let engine = Engine::new(model, config.engine)?;
        let mut arenas = Vec::with_capacity(specs.len());
        for s in specs {
            arenas.push(engine.arena(s, capacity)?);
        }
        let bytes_at_start = engine.stats().drives.iter().map(|d| d.bytes).collect();
        Ok(ExpertCache {
            state: Mutex::new(State {
                map: HashMap::new(),
                order: Order::new(config.policy, capacity),
                draining: Vec::new(),
            }),
            counters: Counters::default(),
            plans,
            arenas,
            part_names,
            capacity,
            capacity_asked: asked,
            entry_bytes,
            inherit_on_fork: config.inherit_on_fork,
            bytes_at_start,
            origin: Origin::here(),
            engine,
            model: model.clone(),
        })
    }

    /// Entries the budget holds.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Slot bytes one entry costs (each part's slot: the largest such part
    /// of any expert, plus its O_DIRECT scratch and tail, page-rounded).
    pub fn entry_bytes(&self) -> u64 {
        self.entry_bytes
    }

    /// The model.
    pub fn model(&self) -> &Model {
        &self.model
    }

    /// The cache's engine (its stats and warnings).
    pub fn engine(&self) -> &Engine {
        &self.engine
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn plan(&self, key: ExpertKey) -> Result<&(Plan, u64, String)> {
        match self.plans.get(&key) {
            Some(p) => Ok(p),
            // The view's own error: no such layer, or no such expert.
            None => {
                self.model.experts()?.expert(key.0, key.1)?;
                Err(CacheError::Config(format!("layer {} expert {} is not a routed expert", key.0, key.1)).into())
            }
        }
    }

    /// Expert `expert` of layer `layer`, pinned while the handle lives:
    /// at once when present, else after its read (a concurrent get of the
    /// same expert waits for the same read).
    ///
    /// # Errors
    /// No such expert; [`CacheError::Full`] when every entry is pinned or
    /// in flight; [`CacheError::ReadFailed`] (nothing cached);
    /// [`Error::Forked`] in a forked child.
    pub fn get(&self, layer: usize, expert: usize) -> Result<ExpertHandle> {
        self.origin.check()?;
        self.plan((layer, expert))?;
        let pending = {
            let mut st = self.lock();
            let (found, hit) = self.lookup(&mut st, (layer, expert))?;
            self.count_use(&mut st, (layer, expert), hit);
            match found {
                Ok(h) => return Ok(h),
                Err(p) => p,
            }
        };
        self.settle_timed(&pending)
    }

    /// Layer `layer`'s `experts` (its top-k): every miss started at once,
    /// then each waited for; handles in the order asked.
    ///
    /// # Errors
    /// As [`ExpertCache::get`]. A call refused as [`CacheError::Full`]
    /// counts no hit or miss and leaves the eviction order as it was; the
    /// reads it had already started go on as prefetches (counted in
    /// `prefetched`: a later get uses them).
    pub fn get_many(&self, layer: usize, experts: &[usize]) -> Result<Vec<ExpertHandle>> {
        self.origin.check()?;
        for &e in experts {
            self.plan((layer, e))?;
        }
        let mut got: Vec<std::result::Result<ExpertHandle, Arc<Pending>>> = Vec::with_capacity(experts.len());
        {
            let mut st = self.lock();
            let mut hits = Vec::with_capacity(experts.len());
            for &e in experts {
                match self.lookup(&mut st, (layer, e)) {
                    Ok((found, hit)) => {
                        got.push(found);
                        hits.push(hit);
                    }
                    Err(err) => {
                        // Refused: the reads this call started become
                        // prefetches; nothing is counted as a get.
                        for (&e, _) in experts.iter().zip(&hits).filter(|(_, &hit)| !hit) {
                            if let Some(m) = st.map.get_mut(&(layer, e)) {
                                m.prefetched_unused = true;
                                add(&self.counters.prefetched, 1);
                            }
                        }
                        return Err(err);
                    }
                }
            }
            for (&e, &hit) in experts.iter().zip(&hits) {
                self.count_use(&mut st, (layer, e), hit);
            }
        }
        got.into_iter()
            .map(|g| match g {
                Ok(h) => Ok(h),
                Err(p) => self.settle_timed(&p),
            })
            .collect()
    }

    /// Starts background reads of the listed experts not present, in
    /// order; never waits, never evicts a pinned entry or one in flight.
    /// When no entry can make room it stops and says how many it refused.
    /// Unknown experts are errors, checked before anything starts.
    pub fn prefetch(&self, list: &[ExpertKey]) -> Result<PrefetchReport> {
        self.origin.check()?;
        for &k in list {
            self.plan(k)?;
        }
        let mut r = PrefetchReport::default();
        let mut st = self.lock();
        for (i, &k) in list.iter().enumerate() {
            if st.map.contains_key(&k) {
                r.present += 1;
                continue;
            }
            match self.start(&mut st, k, true) {
                Ok(_) => r.started += 1,
                Err(Error::Cache(CacheError::Full { .. })) => {
                    r.refused = list.len() - i;
                    break;
                }
                Err(e) => return Err(e),
            }
        }
        drop(st);
        add(&self.counters.prefetched, r.started as u64);
        add(&self.counters.prefetch_refused, r.refused as u64);
        Ok(r)
    }

    /// Waits until every read started so far (misses and prefetches) has
    /// landed or failed, without counting a use: a sync point (before
    /// measuring, or before dropping the cache at a quiet moment).
    pub fn wait_idle(&self) -> Result<()> {
        self.origin.check()?;
        let pending = self.lock().loading();
        for p in pending {
            // A failure is the getter's to see (and counted); nothing to do here.
            let _ = self.settle(&p);
        }
        // The parts of failed reads still in the kernel, waited for with no
        // lock held: their slots are back when this returns.
        let draining = std::mem::take(&mut self.lock().draining);
        for t in draining.into_iter().flatten() {
            let _ = t.wait();
        }
        Ok(())
    }

    /// The counters, and the entries present and pinned now.
    pub fn stats(&self) -> CacheStats {
        let c = &self.counters;
        let ld = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let (entries, pinned) = if self.origin.forked() {
            (0, 0)
        } else {
            let mut st = self.lock();
            self.settle_landed(&mut st);
            let pinned = st
                .map
                .values()
                .filter(|m| matches!(&m.entry, Entry::Ready(d) if Arc::strong_count(d) > 1))
                .count();
            (st.map.len(), pinned)
        };
        let drives = self.engine.stats().drives;
        CacheStats {
            capacity: self.capacity,
            capacity_asked: self.capacity_asked,
            entry_bytes: self.entry_bytes,
            entries,
            pinned,
            hits: ld(&c.hits),
            misses: ld(&c.misses),
            prefetched: ld(&c.prefetched),
            prefetch_used: ld(&c.prefetch_used),
            prefetch_wasted: ld(&c.prefetch_wasted),
            prefetch_wasted_bytes: ld(&c.prefetch_wasted_bytes),
            prefetch_refused: ld(&c.prefetch_refused),
            evictions: ld(&c.evictions),
            failed_reads: ld(&c.failed_reads),
            bytes_read: ld(&c.bytes_read),
            bytes_read_per_drive: drives
                .iter()
                .enumerate()
                .map(|(i, d)| {
                    let base = self.bytes_at_start.get(i).copied().unwrap_or(0);
                    (d.device.clone(), d.bytes.saturating_sub(base))
                })
                .collect(),
            wait_seconds: ld(&c.wait_ns) as f64 / 1e9,
        }
    }

    /// The part names (projection, part) the cache keeps a slot arena for.
    pub fn part_names(&self) -> &[(String, String)] {
        &self.part_names
    }

    /// A present entry's handle (`Ok`), or the read to wait for (`Err`),
    /// starting one on a miss, and whether it was present. Nothing is
    /// counted and no use is marked: a call counts its gets
    /// ([`ExpertCache::count_use`]) only once it has them all.
    #[allow(clippy::type_complexity)]
    fn lookup(
        &self,
        st: &mut State,
        key: ExpertKey,
    ) -> Result<(std::result::Result<ExpertHandle, Arc<Pending>>, bool)> {
        if let Some(m) = st.map.get(&key) {
            let out = match &m.entry {
                Entry::Ready(d) => Ok(ExpertHandle { data: Arc::clone(d) }),
                Entry::Loading(p) => Err(Arc::clone(p)),
            };
            return Ok((out, true));
        }
        Ok((Err(self.start(st, key, false)?), false))
    }

    /// Counts a get that returns (a hit, or the miss that read it) and
    /// marks the use in the eviction order.
    fn count_use(&self, st: &mut State, key: ExpertKey, hit: bool) {
        let c = &self.counters;
        if hit {
            add(&c.hits, 1);
            if let Some(m) = st.map.get_mut(&key) {
                if std::mem::take(&mut m.prefetched_unused) {
                    add(&c.prefetch_used, 1);
                }
            }
        } else {
            add(&c.misses, 1);
        }
        st.order.used(key);
    }

    /// Starts the read of `key` (absent) into free slots, evicting as the
    /// policy says when there are none.
    fn start(&self, st: &mut State, key: ExpertKey, prefetch: bool) -> Result<Arc<Pending>> {
        let (plan, bytes, _) = self.plan(key)?;
        let mut slots = Vec::with_capacity(plan.len());
        for (arena, t) in plan {
            let slot = loop {
                match self.arenas[*arena].take() {
                    Ok(s) => break s,
                    Err(crate::error::TakeError::Full { .. }) => {
                        if !self.evict_one(st) {
                            return Err(self.full(st));
                        }
                    }
                    Err(e) => {
                        return Err(CacheError::Config(format!("{}: no slot: {e}", t.name)).into());
                    }
                }
            };
            slots.push((t, slot));
        }
        let tickets = self.engine.read_batch(slots)?;
        add(&self.counters.bytes_read, *bytes);
        let pending = Arc::new(Pending {
            key,
            state: Mutex::new(PendingState::Reads(plan.iter().map(|p| p.0).zip(tickets).collect())),
            settled: Condvar::new(),
        });
        st.map.insert(
            key,
            Meta {
                entry: Entry::Loading(Arc::clone(&pending)),
                bytes: *bytes,
                prefetched_unused: prefetch,
            },
        );
        st.order.insert(key);
        Ok(pending)
    }

    fn full(&self, st: &State) -> Error {
        let loading = st.map.values().filter(|m| matches!(m.entry, Entry::Loading(_))).count();
        CacheError::Full {
            capacity: self.capacity,
            pinned: st.map.len() - loading,
            loading: loading + st.draining.len(),
        }
        .into()
    }

    /// Evicts one entry the policy picks among the unpinned landed ones
    /// (settling prefetches whose reads have all landed first). `false`
    /// when none may go.
    fn evict_one(&self, st: &mut State) -> bool {
        self.settle_landed(st);
        if Self::prune_drained(st) {
            // A failed read's last parts landed: their slots are back.
            return true;
        }
        let map = &st.map;
        let victim = st
            .order
            .victim(|k| matches!(map.get(&k), Some(Meta { entry: Entry::Ready(d), .. }) if Arc::strong_count(d) == 1));
        let Some(k) = victim else { return false };
        st.order.remove(k);
        if let Some(m) = st.map.remove(&k) {
            add(&self.counters.evictions, 1);
            if m.prefetched_unused {
                add(&self.counters.prefetch_wasted, 1);
                add(&self.counters.prefetch_wasted_bytes, m.bytes);
            }
            // `m` drops: the last reference (checked above), so its slots
            // go back to their arenas now.
        }
        true
    }

    /// Drops the failed reads whose last parts have landed (their slots go
    /// back to the arenas); whether any went.
    fn prune_drained(st: &mut State) -> bool {
        let before = st.draining.len();
        st.draining.retain(|reads| !reads.iter().all(Ticket::is_ready));
        st.draining.len() != before
    }

    /// Settles, without waiting, every entry in flight whose reads have
    /// all landed and that nobody is waiting on, and publishes those a
    /// waiter settled.
    fn settle_landed(&self, st: &mut State) {
        for p in st.loading() {
            let mut s = p.state.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            if let PendingState::Done(r) = &*s {
                // Settled by a waiter that has not published it yet (or
                // that unwound): publishing twice is harmless.
                let r = r.clone();
                drop(s);
                self.publish(st, &p, r, Vec::new());
                continue;
            }
            let all = matches!(&*s, PendingState::Reads(t) if t.iter().all(|(_, t)| t.is_ready()));
            if !all {
                continue;
            }
            let PendingState::Reads(tickets) = std::mem::replace(&mut *s, PendingState::Taken) else {
                continue;
            };
            let (r, left) = self.resolve(p.key, tickets);
            *s = PendingState::Done(r.clone());
            drop(s);
            p.settled.notify_all();
            self.publish(st, &p, r, left);
        }
    }

    /// Waits for `p` (taking its tickets if nobody has), counting the wait.
    fn settle_timed(&self, p: &Arc<Pending>) -> Result<ExpertHandle> {
        let t0 = Instant::now();
        let r = self.settle(p);
        add(&self.counters.wait_ns, t0.elapsed().as_nanos() as u64);
        r
    }

    fn settle(&self, p: &Arc<Pending>) -> Result<ExpertHandle> {
        let mut s = p.state.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        loop {
            match &*s {
                PendingState::Done(r) => {
                    return r.clone().map(|data| ExpertHandle { data }).map_err(Error::from);
                }
                PendingState::Taken => {
                    s = p.settled.wait(s).unwrap_or_else(std::sync::PoisonError::into_inner);
                }
                PendingState::Reads(_) => {
                    let PendingState::Reads(tickets) = std::mem::replace(&mut *s, PendingState::Taken) else {
                        unreachable!("matched above")
                    };
                    drop(s);
                    // Should this thread unwind while it holds the reads,
                    // the others waiting on them are told, never left
                    // waiting.
                    let guard = Unwound(p);
                    // No lock held while the reads land.
                    let (r, left) = self.resolve(p.key, tickets);
                    std::mem::forget(guard);
                    {
                        let mut s = p.state.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
                        *s = PendingState::Done(r.clone());
                    }
                    p.settled.notify_all();
                    let mut st = self.lock();
                    self.publish(&mut st, p, r.clone(), left);
                    drop(st);
                    return r.map(|data| ExpertHandle { data }).map_err(Error::from);
                }
            }
        }
    }

    /// Waits for every ticket of one expert's read: its data, or the
    /// first failure and the tickets not waited for (the caller keeps them
    /// as a draining read until they land: their slots are in the kernel's
    /// hands, and the cache counts them as in flight, not as free).
    fn resolve(
        &self,
        key: ExpertKey,
        tickets: Vec<(usize, Ticket)>,
    ) -> (std::result::Result<Arc<ExpertData>, CacheError>, Vec<Ticket>) {
        let mut parts = Vec::with_capacity(tickets.len());
        let mut tickets = tickets.into_iter();
        while let Some((arena, t)) = tickets.next() {
            match t.wait() {
                Ok(mut loaded) => {
                    if self.inherit_on_fork {
                        // Landed: no read writes these pages until the slot
                        // is back in its arena (protected again there). A
                        // refusal is counted and warned by the engine; the
                        // bytes stay good here.
                        let _ = loaded.inherit_on_fork();
                    }
                    let (projection, part) = self.part_names[arena].clone();
                    parts.push(Part {
                        projection,
                        part,
                        loaded,
                    });
                }
                Err(e) => {
                    let expert = self.plans.get(&key).map_or_else(String::new, |p| p.2.clone());
                    let err = CacheError::ReadFailed {
                        expert,
                        cause: e.to_string(),
                    };
                    return (Err(err), tickets.map(|(_, t)| t).collect());
                }
            }
        }
        parts.sort_by(|a, b| (&a.projection, &a.part).cmp(&(&b.projection, &b.part)));
        (Ok(Arc::new(ExpertData { key, parts })), Vec::new())
    }

    /// Puts a settled read into the map (landed) or takes it out (failed),
    /// if the map still holds that read; a failed read's parts still in
    /// the kernel (`left`) drain in `State::draining` until they land.
    fn publish(
        &self,
        st: &mut State,
        p: &Arc<Pending>,
        r: std::result::Result<Arc<ExpertData>, CacheError>,
        left: Vec<Ticket>,
    ) {
        if !left.iter().all(Ticket::is_ready) {
            st.draining.push(left);
        }
        let ours = matches!(st.map.get(&p.key), Some(Meta { entry: Entry::Loading(q), .. }) if Arc::ptr_eq(q, p));
        if !ours {
            return;
        }
        match r {
            Ok(data) => {
                if let Some(m) = st.map.get_mut(&p.key) {
                    m.entry = Entry::Ready(data);
                }
            }
            Err(_) => {
                add(&self.counters.failed_reads, 1);
                st.map.remove(&p.key);
                st.order.remove(p.key);
            }
        }
    }
}

impl std::fmt::Debug for ExpertCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ExpertCache")
            .field("capacity", &self.capacity)
            .field("entry_bytes", &self.entry_bytes)
            .field("parts", &self.part_names.len())
            .finish()
    }
}
