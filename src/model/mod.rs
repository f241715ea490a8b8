//! A model opened for reading: its catalog, every copy of every shard opened
//! twice (O_DIRECT and buffered), and the drives the copies live on.
//!
//! Shards are found along a search path (the primary directory, then the
//! split directories in order; the first directory holding a basename wins).
//! Mirrors add copies: a mirror's file is accepted only if its size and its
//! whole header (length prefix included) equal the primary's, otherwise it
//! is refused with the reason and the primary keeps serving that shard.
//!
//! A placed model (`weightstream place`) is found through its layout index
//! (`placed.rs`): the index names the roots and the files; nothing else in
//! its folders is read.

use std::sync::{Arc, OnceLock};

use crate::config::{DirectMode, RoutePolicy};
use crate::error::{Error, ExpertsError, Result};
use crate::format::catalog::{Catalog, TensorRef};
use crate::format::experts::Experts;
use crate::memory::SlotSpec;
use crate::stats::warning::{self, Warning};
use crate::stats::{self, DriveStats, FallbackCause, Stats};
use crate::storage::files::{Drive, ShardFile};

mod open;
pub(crate) mod placed;
mod roots;
pub(crate) use roots::{absolute, resolved};
mod verify;

pub use open::CopyReport;
pub use verify::{FileVerdict, VerifyReport};

/// A model ready to read. Cloning is cheap (shared); an engine keeps a clone
/// so its threads can reach the open files.
#[derive(Debug, Clone)]
pub struct Model {
    inner: Arc<ModelInner>,
}

/// The read weight of each copy rank: as configured, or probed once.
#[derive(Debug)]
struct Weighting {
    configured: Vec<f64>,
    /// [`Weights::Probe`](crate::Weights::Probe): measured by the first engine.
    probe: bool,
    /// (weights, why they are not what was asked for), once measured.
    probed: OnceLock<(Vec<f64>, Option<String>)>,
}

#[derive(Debug)]
struct ModelInner {
    catalog: Catalog,
    /// Primary copies first (file index = shard index), then mirror copies.
    files: Vec<ShardFile>,
    /// Per shard: its copies' file indices, by rank (primary first).
    copies: Vec<Vec<usize>>,
    drives: Vec<Drive>,
    direct: DirectMode,
    route: RoutePolicy,
    /// Read weight per copy rank (primary, mirror 1, ...).
    weights: Weighting,
    /// Expert-major group key per tensor (by catalog index), for `hash`.
    keys: Vec<u64>,
    report: Vec<CopyReport>,
    /// Mirror directories on the same filesystem as the other copies of
    /// their shards, with the device (warned at open; in the warnings).
    shared_mirrors: Vec<(std::path::PathBuf, String)>,
    /// The expert view, recognised from the names on first use.
    experts: OnceLock<Experts>,
}

impl Model {
    /// The tensors and shards.
    pub fn catalog(&self) -> &Catalog {
        &self.inner.catalog
    }

    /// Every opened copy: primary copies first (file index = shard index),
    /// then mirror copies. For the command's `inspect` and the tests (the
    /// descriptors, the statx topology; not a stable API): the copies a
    /// caller sees are [`Model::copy_report`].
    #[doc(hidden)]
    pub fn files(&self) -> &[ShardFile] {
        &self.inner.files
    }

    /// The volumes (one per `st_dev`) holding copies; a file's `drive`
    /// indexes this. For the command and the tests (not a stable API): a
    /// caller's view of the drives is [`Model::stats`]'s `drives`.
    #[doc(hidden)]
    pub fn drives(&self) -> &[Drive] {
        &self.inner.drives
    }

    /// The O_DIRECT mode the model was opened with.
    pub fn direct_mode(&self) -> DirectMode {
        self.inner.direct
    }

    /// Per shard: the indices into `Model::files` of its copies, primary
    /// first (for the command and the tests, like `files`).
    #[doc(hidden)]
    pub fn copies(&self, shard: usize) -> &[usize] {
        &self.inner.copies[shard]
    }

    /// The route policy engines use unless their configuration says otherwise.
    pub fn route(&self) -> RoutePolicy {
        self.inner.route
    }

    /// Read weight of each copy rank (primary, mirror 1, ...).
    ///
    /// With [`Weights::Probe`](crate::Weights::Probe): equal until the first
    /// [`Engine`](crate::Engine) made on this model has measured them.
    pub fn rank_weights(&self) -> &[f64] {
        let w = &self.inner.weights;
        w.probed.get().map_or(&w.configured, |p| &p.0)
    }

    /// Why the weights are not what was asked for (a failed probe).
    pub fn weights_note(&self) -> Option<&str> {
        self.inner.weights.probed.get().and_then(|p| p.1.as_deref())
    }

    /// The weights are to be probed and no engine has measured them yet.
    pub(crate) fn weights_to_probe(&self) -> bool {
        let w = &self.inner.weights;
        w.probe && w.probed.get().is_none()
    }

    /// Records probed weights (the first engine's; later ones are ignored).
    pub(crate) fn set_probed_weights(&self, weights: Vec<f64>, note: Option<String>) {
        let _ = self.inner.weights.probed.set((weights, note));
    }

    /// The group key `hash` routing uses for a tensor: the flat expert index
    /// `layer * experts_per_layer + expert` for `layers.{L}...experts.{E}`
    /// names, else the tensor's catalog index.
    pub fn group_key(&self, tensor: &TensorRef) -> u64 {
        self.inner
            .keys
            .get(tensor.index)
            .copied()
            .unwrap_or(tensor.index as u64)
    }

    /// Every copy considered: accepted (with its drive) or refused (with why).
    pub fn copy_report(&self) -> &[CopyReport] {
        &self.inner.report
    }

    /// Looks a tensor up by name; when absent, an error suggesting the
    /// nearest names ([`Catalog::tensor`]).
    pub fn tensor(&self, name: &str) -> Result<&TensorRef> {
        self.inner.catalog.tensor(name)
    }

    /// The tensor named `name`, if there is one: for optional tensors (no
    /// suggestions computed on a miss; [`Catalog::get`]).
    pub fn get(&self, name: &str) -> Option<&TensorRef> {
        self.inner.catalog.get(name)
    }

    /// The slot alignment every shard of this model is satisfied by.
    pub fn required_align(&self) -> usize {
        self.inner
            .files
            .iter()
            .map(|f| (f.topo.dio_offset_align.max(f.topo.dio_mem_align) as usize).max(4096))
            .max()
            .unwrap_or(4096)
    }

    /// A slot spec that holds the largest tensor whose name contains
    /// `filter` ("" for every tensor), aligned for every shard. A filter
    /// that no tensor name contains is an error naming it (never a slot
    /// sized for nothing).
    pub fn slot_spec_for_largest(&self, filter: &str) -> Result<SlotSpec> {
        let cat = &self.inner.catalog;
        let largest = cat.largest(filter).ok_or_else(|| {
            Error::Config(format!(
                "slot_spec_for_largest({filter:?}): no tensor name contains {filter:?} (the model in {} has {} tensor(s))",
                crate::error::escape(cat.dir()),
                cat.tensors().len()
            ))
        })?;
        let len = usize::try_from(largest.max(1)).map_err(|_| {
            Error::Config(format!(
                "slot_spec_for_largest({filter:?}): the largest tensor is {largest} bytes, more than this machine can address"
            ))
        })?;
        Ok(SlotSpec::new(len).with_align(self.required_align()))
    }

    /// The model's experts (mixture-of-experts layers), recognised from the
    /// tensor names once and kept: per layer, per expert, the projections
    /// and their companions (see [`Experts`] for the conventions). A model
    /// whose names follow none of them is an error
    /// ([`ExpertsError::NoneRecognised`](crate::ExpertsError::NoneRecognised)).
    ///
    /// ```
    /// # fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// use weightstream::{Dtype, Model, ModelConfig};
    /// let dir = weightstream::__internal::doc_model("experts", &[
    ///     ("model.layers.0.mlp.experts.0.up_proj.weight", Dtype::Bf16, 64),
    ///     ("model.layers.0.mlp.experts.1.up_proj.weight", Dtype::Bf16, 64),
    ///     ("model.layers.0.mlp.experts.1.up_proj.weight_scale", Dtype::F32, 4),
    /// ])?;
    /// let model = Model::open(ModelConfig::new(&dir))?;
    /// let expert = model.experts()?.layer(0)?.expert(1)?;
    /// let up = expert.projection("up_proj")?;
    /// assert_eq!(up.weight().unwrap().name, "model.layers.0.mlp.experts.1.up_proj.weight");
    /// assert!(up.part("weight_scale").is_some());
    /// assert_eq!(expert.bytes(), 68);
    /// assert!(model.experts()?.layer(1).is_err()); // one layer: 0
    /// # std::fs::remove_dir_all(dir)?;
    /// # Ok(())
    /// # }
    /// ```
    pub fn experts(&self) -> Result<&Experts> {
        let cat = &self.inner.catalog;
        let experts = self.inner.experts.get_or_init(|| Experts::from_tensors(cat.tensors()));
        if experts.is_empty() {
            return Err(Error::Experts(ExpertsError::NoneRecognised {
                dir: cat.dir().to_path_buf(),
                tensors: cat.tensors().len(),
                example: cat.tensors().first().map(|t| t.name.clone()),
            }));
        }
        Ok(experts)
    }

    /// The open shard holding `tensor`, after checking that `tensor` is this
    /// model's own (a `TensorRef` of another model could name a shard index
    /// and range that fit here and read the wrong bytes).
    /// A reference to part of a tensor ([`TensorRef::byte_range`],
    /// [`TensorRef::rows`]) is this model's own when its bytes lie inside
    /// the whole tensor's.
    pub(crate) fn file_of(&self, tensor: &TensorRef) -> Result<&ShardFile> {
        match self.inner.catalog.tensors().get(tensor.index) {
            Some(own) if tensor.is_part_of(own) => Ok(&self.inner.files[tensor.shard]),
            _ => Err(Error::ForeignTensor {
                name: tensor.name.clone(),
                model: self.inner.catalog.dir().to_path_buf(),
            }),
        }
    }

    /// A snapshot of the counters.
    pub fn stats(&self) -> Stats {
        let drives: Vec<DriveStats> = self
            .inner
            .drives
            .iter()
            .map(|d| {
                let c = &d.counters;
                let ld = |a: &std::sync::atomic::AtomicU64| a.load(std::sync::atomic::Ordering::Relaxed);
                DriveStats {
                    device: d.device.clone(),
                    mount: d.mount.clone(),
                    fs_type: d.fs_type.clone(),
                    dio_align: d.dio_align,
                    direct_open: d.direct_open,
                    bytes: ld(&c.bytes),
                    bytes_direct: ld(&c.bytes_direct),
                    bytes_buffered: ld(&c.bytes_buffered),
                    reads_direct: ld(&c.reads_direct),
                    reads_buffered: ld(&c.reads_buffered),
                    fallbacks: stats::snapshot_fallbacks(c),
                    inflight_max: ld(&c.inflight_max),
                    chunks_unregistered: ld(&c.chunks_unregistered),
                    chunks_unregistered_arena: ld(&c.chunks_unregistered_arena),
                    chunks: ld(&c.chunks),
                    failovers: ld(&c.failovers),
                    share: 0.0,
                    throughput_gbps: None,
                    ring: None,
                    numa_node: None,
                    cpuset: None,
                    numa_source: None,
                    numa_note: None,
                    thread_binding: None,
                    cross_node_bytes: ld(&c.cross_node_bytes),
                    chunks_abandoned: ld(&c.chunks_abandoned),
                    in_flight: None,
                    submit: None,
                    rings: None,
                    pread_workers: None,
                    submit_reason: None,
                    iowq_max_workers: None,
                    stopped: None,
                }
            })
            .collect();
        let total: u64 = drives.iter().map(|d| d.bytes).sum();
        let mut drives = drives;
        for d in &mut drives {
            d.share = d.bytes as f64 / total.max(1) as f64;
        }
        let mut s = Stats {
            backend: "sync",
            backend_reason: None,
            rank_weights: self.rank_weights().to_vec(),
            weights_note: self.weights_note().map(str::to_string),
            arena_dontfork_failures: crate::memory::dontfork_failures(),
            bytes: drives.iter().map(|d| d.bytes).sum(),
            fixed_files: None,
            registered_buffers: None,
            drives,
            staged: Default::default(),
            slices: Default::default(),
            arena_hugepage_refusals: crate::memory::hugepage_refusals(),
            arena_inherit_failures: crate::memory::inherit_failures(),
            arena_reprotect_leaks: crate::memory::reprotect_leaks(),
            warnings: Vec::new(),
        };
        s.warnings = self.model_warnings(&s);
        s
    }

    /// Every fallback of this model that costs speed, worst first: reads
    /// that went buffered instead of O_DIRECT (by drive and cause, with the
    /// first file and detail), chunks that failed over, refused mirror
    /// copies, mirrors that add no bandwidth, a failed weight probe, and
    /// this process's arena mappings refused huge pages or fork protection.
    /// Empty when nothing fell back. An [`Engine`](crate::Engine) adds its
    /// own ([`Engine::warnings`](crate::Engine::warnings)); each is said
    /// whether or not a `tracing` subscriber is installed.
    pub fn warnings(&self) -> Vec<Warning> {
        self.stats().warnings
    }

    /// The model's warnings from its snapshot `s` (sorted).
    fn model_warnings(&self, s: &Stats) -> Vec<Warning> {
        let mut out = Vec::new();
        for (d, st) in self.inner.drives.iter().zip(&s.drives) {
            for cause in FallbackCause::ALL {
                let n = d.counters.fallback_count(cause);
                if n > 0 {
                    out.extend(warning::buffered(&d.device, cause, n, d.counters.first_fallback(cause)));
                }
            }
            if st.failovers > 0 {
                out.push(warning::failover(
                    &d.device,
                    st.failovers,
                    d.counters.first_failover.get().map(String::as_str),
                ));
            }
        }
        // Refused mirror copies, one warning per mirror directory.
        let mut refused: Vec<(&std::path::Path, &CopyReport)> = self
            .inner
            .report
            .iter()
            .filter(|c| !c.accepted)
            .map(|c| (c.path.parent().unwrap_or(&c.path), c))
            .collect();
        refused.sort_by(|a, b| a.0.cmp(b.0));
        for group in refused.chunk_by(|a, b| a.0 == b.0) {
            let (dir, first) = group[0];
            out.push(warning::mirror_refused(
                dir,
                group.len() as u64,
                &first.path,
                first.reason.as_deref().unwrap_or("refused"),
            ));
        }
        for (dir, device) in &self.inner.shared_mirrors {
            out.push(warning::mirror_shares_drive(dir, device));
        }
        if let Some(note) = &s.weights_note {
            out.push(warning::weights_probe_failed(note));
        }
        out.extend(warning::arena_mappings(&warning::ArenaRefusals {
            hugepage: s.arena_hugepage_refusals,
            dontfork: s.arena_dontfork_failures,
            inherit: s.arena_inherit_failures,
            reprotect: s.arena_reprotect_leaks,
        }));
        warning::sort(&mut out);
        out
    }
}
