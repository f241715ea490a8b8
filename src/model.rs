//! A model opened for reading: its catalog, every copy of every shard opened
//! twice (O_DIRECT and buffered), and the drives the copies live on.
//!
//! Shards are found along a search path (the primary directory, then the
//! split directories in order; the first directory holding a basename wins).
//! Mirrors add copies: a mirror's file is accepted only if its size and its
//! whole header (length prefix included) equal the primary's, otherwise it
//! is refused with the reason and the primary keeps serving that shard.

use std::fs::File;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::arena::{Slot, SlotSpec};
use crate::catalog::{self, libc_flags, Catalog, ShardInfo, TensorRef};
use crate::direct::{self, DirectMode, Loaded};
use crate::error::{Error, Result};
use crate::layout::{self, ModelConfig, RootRole, RoutePolicy, Weights};
use crate::stats::{self, DriveCounters, DriveStats, FallbackCause, Stats};
use crate::topology::{self, FileTopology};

/// One shard, opened.
#[derive(Debug)]
pub struct ShardFile {
    pub path: PathBuf,
    /// Size the header was validated against.
    pub size: u64,
    pub buffered: File,
    /// The O_DIRECT descriptor, if the filesystem accepted one.
    pub direct: Option<File>,
    /// Why there is no O_DIRECT descriptor.
    pub direct_refused: Option<String>,
    pub topo: FileTopology,
    /// Index into [`Model::drives`].
    pub drive: usize,
    /// The shard this file is a copy of (index into the catalog's shards).
    pub shard: usize,
    /// Copy rank: 0 for the primary (or split) copy, k for mirror directory k.
    pub rank: usize,
    /// A failover away from this copy has been warned about.
    pub(crate) failover_warned: std::sync::atomic::AtomicBool,
}

/// What became of one candidate copy.
#[derive(Debug, Clone, serde::Serialize)]
pub struct CopyReport {
    pub shard: String,
    pub path: PathBuf,
    /// `primary`, `split` or `mirror`.
    pub role: &'static str,
    pub rank: usize,
    pub accepted: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub device: Option<String>,
}

/// One volume (`st_dev`) holding shards.
#[derive(Debug)]
pub struct Drive {
    pub dev: u64,
    pub device: String,
    pub mount: PathBuf,
    pub fs_type: String,
    /// Largest O_DIRECT offset alignment among its files.
    pub dio_align: u32,
    pub direct_open: bool,
    pub counters: DriveCounters,
}

/// A model ready to read. Cloning is cheap (shared); an engine keeps a clone
/// so its threads can reach the open files.
#[derive(Debug, Clone)]
pub struct Model {
    inner: Arc<ModelInner>,
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
    rank_weights: Vec<f64>,
    /// Expert-major group key per tensor (by catalog index), for `hash`.
    keys: Vec<u64>,
    report: Vec<CopyReport>,
}

impl Model {
    /// Validates every directory, finds the shards along the search path,
    /// opens and validates every header, proves every mirror copy and probes
    /// every drive. Nothing is read from the data sections (except a short
    /// timed read per copy when the weights are to be probed).
    pub fn open(config: ModelConfig) -> Result<Self> {
        let roots = layout::validate_roots(&config)?;
        // The search path: primary, then split directories; first one wins.
        let mut found: Vec<(String, PathBuf, PathBuf, usize)> = Vec::new();
        let mut primary_count = 0;
        for (ri, root) in roots.iter().enumerate().filter(|(_, r)| r.role != RootRole::Mirror) {
            let mut added = 0;
            for (name, listed, path) in catalog::list_shards(&root.given)? {
                if let Some(prev) = found.iter().find(|f| f.0 == name) {
                    tracing::warn!(
                        "{} skipped: {name} was already found in {} (the first directory listed wins)",
                        listed.display(),
                        roots[prev.3].given.display()
                    );
                    continue;
                }
                found.push((name, listed, path, ri));
                added += 1;
            }
            if root.role == RootRole::Primary {
                primary_count = added;
            } else {
                tracing::info!("+{} -> {added} shard(s)", root.given.display());
            }
        }
        if found.is_empty() {
            return Err(Error::catalog(
                &config.primary,
                "no *.safetensors shards in this directory",
            ));
        }
        let n_dirs = roots.iter().filter(|r| r.role != RootRole::Mirror).count();
        if n_dirs > 1 {
            tracing::info!(
                "model across {n_dirs} dir(s): {} shard(s) total (primary {} -> {primary_count} shard(s)), no duplication",
                found.len(),
                config.primary.display()
            );
        }
        let mut b = Builder {
            direct: config.direct,
            files: Vec::new(),
            drives: Vec::new(),
            report: Vec::new(),
        };
        let mut shards = Vec::with_capacity(found.len());
        for (i, (name, listed, path, ri)) in found.into_iter().enumerate() {
            let (buffered, header) = catalog::open_shard(&path)?;
            let role = roots[ri].role.name();
            b.add(path.clone(), buffered, header.file_size, i, 0, &name, role)?;
            shards.push(ShardInfo {
                path,
                listed,
                name,
                header,
            });
        }
        let mut copies: Vec<Vec<usize>> = (0..shards.len()).map(|i| vec![i]).collect();
        // Mirrors: each may hold any subset; every copy is proven first.
        let mirrors: Vec<&layout::Root> = roots.iter().filter(|r| r.role == RootRole::Mirror).collect();
        if mirrors.len() + 1 > MAX_COPY_RANKS {
            return Err(Error::Config(format!(
                "{} mirror directories given; at most {} (with the primary, {MAX_COPY_RANKS} copies of a shard)",
                mirrors.len(),
                MAX_COPY_RANKS - 1
            )));
        }
        // A mirror that contributes no file takes no rank (no weight slot).
        let mut rank = 0;
        for m in &mirrors {
            rank += 1;
            let mut contributed = 0;
            for (i, shard) in shards.iter().enumerate() {
                let cand = m.given.join(&shard.name);
                let proven = match std::fs::symlink_metadata(&cand) {
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
                    Err(e) => Err(format!("cannot be read: {e}")),
                    Ok(meta) if meta.file_type().is_symlink() => match std::fs::canonicalize(&cand) {
                        Ok(real) => prove_copy(&real, shard).map(|f| (real, f)),
                        Err(e) => Err(format!("is a link that cannot be resolved: {e}")),
                    },
                    Ok(meta) if !meta.is_file() => Err("is not a regular file".to_string()),
                    Ok(_) => prove_copy(&cand, shard).map(|f| (cand.clone(), f)),
                };
                match proven {
                    Ok((real, file)) => {
                        let idx = b.add(real, file, shard.header.file_size, i, rank, &shard.name, "mirror")?;
                        copies[i].push(idx);
                        contributed += 1;
                    }
                    Err(reason) => {
                        tracing::warn!(
                            "{}: {reason} - file skipped; the primary copy serves this shard",
                            cand.display()
                        );
                        b.report.push(CopyReport {
                            shard: shard.name.clone(),
                            path: cand,
                            role: "mirror",
                            rank,
                            accepted: false,
                            reason: Some(reason),
                            device: None,
                        });
                    }
                }
            }
            if contributed == 0 {
                tracing::warn!("mirror {}: no usable shard; ignored", m.given.display());
                rank -= 1;
            } else {
                tracing::info!(
                    "mirror {} -> {contributed} of {} shard(s)",
                    m.given.display(),
                    shards.len()
                );
            }
        }
        let catalog = Catalog::new(&config.primary, shards)?;
        let keys = group_keys(&catalog);
        let ranks = 1 + rank;
        warn_shared_filesystems(&b.files, &copies, &b.drives);
        let rank_weights = match &config.weights {
            Weights::Equal => vec![1.0; ranks],
            Weights::Explicit(w) if w.len() == ranks => w.clone(),
            Weights::Explicit(w) => {
                return Err(Error::Config(format!(
                    "{} weight(s) given for {ranks} copies (the primary and {} mirror director{} holding shards): give one per copy, or probe",
                    w.len(),
                    rank,
                    if rank == 1 { "y" } else { "ies" }
                )))
            }
            Weights::Probe => probe_weights(&b.files, ranks),
        };
        Ok(Model {
            inner: Arc::new(ModelInner {
                catalog,
                files: b.files,
                copies,
                drives: b.drives,
                direct: config.direct,
                route: config.route,
                rank_weights,
                keys,
                report: b.report,
            }),
        })
    }

    pub fn catalog(&self) -> &Catalog {
        &self.inner.catalog
    }

    pub fn files(&self) -> &[ShardFile] {
        &self.inner.files
    }

    pub fn drives(&self) -> &[Drive] {
        &self.inner.drives
    }

    pub fn direct_mode(&self) -> DirectMode {
        self.inner.direct
    }

    /// Per shard: the file indices of its copies, primary first.
    pub fn copies(&self, shard: usize) -> &[usize] {
        &self.inner.copies[shard]
    }

    pub fn route(&self) -> RoutePolicy {
        self.inner.route
    }

    /// Read weight of each copy rank (primary, mirror 1, ...).
    pub fn rank_weights(&self) -> &[f64] {
        &self.inner.rank_weights
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

    /// Looks a tensor up by name.
    pub fn tensor(&self, name: &str) -> Result<&TensorRef> {
        self.inner.catalog.tensor(name)
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
    /// `filter` ("" for every tensor), aligned for every shard.
    pub fn slot_spec_for_largest(&self, filter: &str) -> SlotSpec {
        SlotSpec::new(self.inner.catalog.largest(filter).unwrap_or(0).max(1) as usize).with_align(self.required_align())
    }

    /// Reads `tensor` into `slot` on the calling thread: the payload lands at
    /// `slot base + offset % align`. On error the slot goes back to its arena.
    pub fn read_sync(&self, tensor: &TensorRef, slot: Slot) -> Result<Loaded> {
        let file = self.file_of(tensor)?;
        direct::read_sync(file, &self.inner.drives[file.drive], tensor, slot, self.inner.direct)
    }

    /// The open shard holding `tensor`, after checking that `tensor` is this
    /// model's own (a `TensorRef` of another model could name a shard index
    /// and range that fit here and read the wrong bytes).
    pub(crate) fn file_of(&self, tensor: &TensorRef) -> Result<&ShardFile> {
        match self.inner.catalog.tensors().get(tensor.index) {
            Some(own) if own == tensor => Ok(&self.inner.files[tensor.shard]),
            _ => Err(Error::NoSuchTensor(format!(
                "{} (this tensor reference belongs to another model than {})",
                tensor.name,
                self.inner.catalog.dir().display()
            ))),
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
                    stopped: None,
                }
            })
            .collect();
        let total: u64 = drives.iter().map(|d| d.bytes).sum();
        let mut drives = drives;
        for d in &mut drives {
            d.share = d.bytes as f64 / total.max(1) as f64;
        }
        Stats {
            backend: "sync",
            backend_reason: None,
            bytes: drives.iter().map(|d| d.bytes).sum(),
            fixed_files: None,
            registered_buffers: None,
            drives,
        }
    }
}

/// Opens a shard for O_DIRECT reads (read-only, close-on-exec, no link).
pub(crate) fn open_direct(path: &Path) -> std::io::Result<File> {
    std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc_flags::O_NOFOLLOW | libc_flags::O_CLOEXEC | libc_flags::O_DIRECT)
        .open(path)
}

/// Most copy ranks (the primary and its mirrors) a shard may have.
pub const MAX_COPY_RANKS: usize = 8;

/// Says, once per mirror directory, when every copy it holds shares a
/// filesystem with another copy of the same shard: it adds no bandwidth.
fn warn_shared_filesystems(files: &[ShardFile], copies: &[Vec<usize>], drives: &[Drive]) {
    let mut ranks: Vec<usize> = files.iter().filter(|f| f.rank > 0).map(|f| f.rank).collect();
    ranks.sort_unstable();
    ranks.dedup();
    for r in ranks {
        let mine: Vec<&ShardFile> = files.iter().filter(|f| f.rank == r).collect();
        let shared = mine.iter().all(|f| {
            copies[f.shard]
                .iter()
                .any(|&o| files[o].rank != r && files[o].drive == f.drive)
        });
        if shared {
            let dir = mine[0]
                .path
                .parent()
                .map(|p| p.display().to_string())
                .unwrap_or_default();
            tracing::warn!(
                "mirror \"{dir}\" is on the same filesystem ({}) as the other copies of its shards: accepted, but it adds no bandwidth (two copies behind one device read no faster than one)",
                drives[mine[0].drive].device
            );
        }
    }
}

/// Accumulates opened copies and the drives they sit on.
struct Builder {
    direct: DirectMode,
    files: Vec<ShardFile>,
    drives: Vec<Drive>,
    report: Vec<CopyReport>,
}

impl Builder {
    /// Adds an opened copy (its header already validated or proven): probes
    /// its volume, opens it O_DIRECT, files it under its drive.
    #[allow(clippy::too_many_arguments)]
    fn add(
        &mut self,
        path: PathBuf,
        buffered: File,
        size: u64,
        shard: usize,
        rank: usize,
        name: &str,
        role: &'static str,
    ) -> Result<usize> {
        let topo = topology::probe(&path, &buffered).map_err(|e| Error::io(&path, "statx", e))?;
        let (direct, direct_refused) = if self.direct == DirectMode::Off {
            (None, Some("direct I/O turned off".to_string()))
        } else if topo.statx_says_no_direct {
            (
                None,
                Some(format!("statx reports no direct I/O support on {}", topo.fs_type)),
            )
        } else {
            match open_direct(&path) {
                Ok(f) => (Some(f), None),
                Err(e) => (None, Some(format!("open(O_DIRECT) refused by {}: {e}", topo.fs_type))),
            }
        };
        if self.direct == DirectMode::On {
            if let Some(why) = &direct_refused {
                return Err(Error::catalog(&path, format!("--direct on, but {why}")));
            }
        }
        let drive = match self.drives.iter().position(|d| d.dev == topo.dev) {
            Some(i) => i,
            None => {
                self.drives.push(Drive {
                    dev: topo.dev,
                    device: topo.device.clone(),
                    mount: topo.mount.clone(),
                    fs_type: topo.fs_type.clone(),
                    dio_align: 0,
                    direct_open: true,
                    counters: DriveCounters::default(),
                });
                self.drives.len() - 1
            }
        };
        let d = &mut self.drives[drive];
        d.dio_align = d.dio_align.max(topo.dio_offset_align);
        d.direct_open &= direct.is_some();
        if self.direct != DirectMode::Off {
            if let Some(why) = &direct_refused {
                d.counters
                    .fallback(&d.device, &path, FallbackCause::DirectOpenRefused, why);
            }
        }
        self.report.push(CopyReport {
            shard: name.to_string(),
            path: path.clone(),
            role,
            rank,
            accepted: true,
            reason: None,
            device: Some(d.device.clone()),
        });
        self.files.push(ShardFile {
            path,
            size,
            buffered,
            direct,
            direct_refused,
            topo,
            drive,
            shard,
            rank,
            failover_warned: std::sync::atomic::AtomicBool::new(false),
        });
        Ok(self.files.len() - 1)
    }
}

/// Opens a mirror's copy of `shard` and proves it: the same size and the
/// same header bytes (length prefix included) as the primary. Identical
/// headers mean identical offsets; the data is trusted to match as a copy.
fn prove_copy(path: &Path, shard: &ShardInfo) -> std::result::Result<File, String> {
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc_flags::O_NOFOLLOW | libc_flags::O_CLOEXEC)
        .open(path)
        .map_err(|e| format!("cannot be opened: {e}"))?;
    let size = file.metadata().map_err(|e| format!("cannot be read: {e}"))?.len();
    if size != shard.header.file_size {
        return Err(format!(
            "size differs from the primary copy ({size} bytes, primary {} bytes)",
            shard.header.file_size
        ));
    }
    let mut raw = vec![0u8; shard.header.raw.len()];
    crate::container::read_exact_at(path, &file, &mut raw, 0).map_err(|e| format!("header cannot be read: {e}"))?;
    if raw != shard.header.raw {
        let at = raw.iter().zip(&shard.header.raw).position(|(a, b)| a != b).unwrap_or(0);
        return Err(format!(
            "header differs from the primary copy (first difference at byte {at})"
        ));
    }
    Ok(file)
}

/// `layer * experts_per_layer + expert` for every `layers.{L}...experts.{E}`
/// tensor (experts per layer = the largest expert index + 1), else the
/// tensor's catalog index: a flat index spreads the experts one decode step
/// touches across copies, where an XOR of the two ids clusters them.
fn group_keys(cat: &Catalog) -> Vec<u64> {
    let parse = catalog::index_after;
    let ids: Vec<Option<(u64, u64)>> = cat
        .tensors()
        .iter()
        .map(|t| Some((parse(&t.name, "layers.")?, parse(&t.name, "experts.")?)))
        .collect();
    let per_layer = ids.iter().flatten().map(|&(_, e)| e + 1).max().unwrap_or(1);
    ids.iter()
        .enumerate()
        .map(|(i, id)| match id {
            Some((l, e)) => l * per_layer + e,
            None => i as u64,
        })
        .collect()
}

/// Measures each copy rank with a short O_DIRECT read (8 reads of 19 MiB in
/// flight over its files) and turns GB/s into weights; a failed probe gives
/// equal weights, said once.
fn probe_weights(files: &[ShardFile], ranks: usize) -> Vec<f64> {
    let cfg = crate::ceiling::CeilingConfig {
        bs: 19 << 20,
        qd: 8,
        bytes: Some(8 * (19 << 20)),
    };
    let mut w = Vec::with_capacity(ranks);
    for r in 0..ranks {
        let paths: Vec<PathBuf> = files.iter().filter(|f| f.rank == r).map(|f| f.path.clone()).collect();
        match crate::ceiling::measure(&paths, &cfg) {
            Ok(m) if m.gbps > 0.0 => w.push(m.gbps),
            Ok(_) | Err(_) => {
                tracing::warn!("weight probe of copy rank {r} failed; using equal weights");
                return vec![1.0; ranks];
            }
        }
    }
    tracing::info!("probed weights (GB/s per copy rank): {w:?}");
    w
}
