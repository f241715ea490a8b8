//! A model opened for reading: its catalog, every copy of every shard opened
//! twice (O_DIRECT and buffered), and the drives the copies live on.
//!
//! Shards are found along a search path (the primary directory, then the
//! split directories in order; the first directory holding a basename wins).
//! Mirrors add copies: a mirror's file is accepted only if its size and its
//! whole header (length prefix included) equal the primary's, otherwise it
//! is refused with the reason and the primary keeps serving that shard.

use std::collections::BTreeMap;
use std::ffi::OsString;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use crate::arena::{Slot, SlotSpec};
use crate::catalog::{self, libc_flags, Catalog, OpenRefusal, ShardInfo, TensorRef};
use crate::direct::{self, DirectMode, Loaded};
use crate::error::{Error, Result};
use crate::layout::{self, escape, serialize_escaped, ModelConfig, RootRole, RoutePolicy, Weights};
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
    /// What the file was when it was opened (from `fstat` of the open
    /// descriptor): re-checked by [`ShardFile::changed_since_open`] when a
    /// read fails, and by [`Model::verify`].
    pub identity: FileIdentity,
    /// A failover away from this copy has been warned about.
    pub(crate) failover_warned: AtomicBool,
    /// A change after open has been warned about.
    pub(crate) change_warned: AtomicBool,
}

/// Who a file is and what it looked like: `(st_dev, st_ino)` name the
/// inode; `size` and `ctime` change when it is written, truncated or
/// extended in place (ctime also on metadata changes: chmod, link count).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct FileIdentity {
    pub dev: u64,
    pub ino: u64,
    pub size: u64,
    pub ctime_sec: i64,
    pub ctime_nsec: i64,
}

impl FileIdentity {
    pub(crate) fn of(st: &rustix::fs::Stat) -> Self {
        FileIdentity {
            dev: st.st_dev,
            ino: st.st_ino,
            size: st.st_size as u64,
            ctime_sec: st.st_ctime,
            ctime_nsec: st.st_ctime_nsec as i64,
        }
    }
}

/// One thing found changed about an opened file (see [`Model::verify`]).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Change {
    /// The path no longer exists (reads still see the file as opened).
    Removed,
    /// The path names another inode now: replaced, e.g. by a rename (reads
    /// still see the file as opened).
    Replaced { was: (u64, u64), now: (u64, u64) },
    /// The size differs.
    Size { was: u64, now: u64 },
    /// The ctime differs: written in place, truncated, or its metadata changed.
    Ctime,
    /// The header bytes differ from the ones validated at open (`at`: the
    /// first differing byte, when known).
    Header { at: Option<u64> },
    /// Tensor payloads differ from `against` (the primary copy, or a record).
    Digest { against: String, tensors: Vec<String> },
    /// Not in the model now, or not in the record compared against.
    Unlisted { cause: String },
    /// The check itself failed (fstat, stat, a read).
    Unreadable { cause: String },
}

impl std::fmt::Display for Change {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Change::Removed => write!(f, "removed (the path no longer exists)"),
            Change::Replaced { was, now } => write!(
                f,
                "replaced (inode changed: {}:{} -> {}:{})",
                was.0, was.1, now.0, now.1
            ),
            Change::Size { was, now } => write!(f, "size {was} -> {now}"),
            Change::Ctime => write!(
                f,
                "ctime changed (written in place, truncated, or its metadata changed)"
            ),
            Change::Header { at: Some(at) } => write!(f, "header bytes differ (first difference at byte {at})"),
            Change::Header { at: None } => write!(f, "header bytes differ"),
            Change::Digest { against, tensors } => {
                let n = tensors.len();
                let shown: Vec<&str> = tensors.iter().take(8).map(String::as_str).collect();
                write!(
                    f,
                    "payload differs from {against} in {n} tensor(s): {}{}",
                    shown.join(", "),
                    if n > shown.len() { ", ..." } else { "" }
                )
            }
            Change::Unlisted { cause } => f.write_str(cause),
            Change::Unreadable { cause } => write!(f, "cannot be checked: {cause}"),
        }
    }
}

impl ShardFile {
    /// What changed since open, from one `fstat` of the open descriptor
    /// (size, ctime) and one `stat` of the path (removed, replaced).
    /// Cheap: no data is read, so a same-size rewrite shows only as a ctime
    /// change, and its bytes are compared only by [`Model::verify`] with
    /// `digest`.
    pub fn identity_changes(&self) -> Vec<Change> {
        let id = &self.identity;
        let mut out = Vec::new();
        match rustix::fs::fstat(&self.buffered) {
            Ok(st) => {
                let now = FileIdentity::of(&st);
                if now.size != id.size {
                    out.push(Change::Size {
                        was: id.size,
                        now: now.size,
                    });
                }
                if (now.ctime_sec, now.ctime_nsec) != (id.ctime_sec, id.ctime_nsec) {
                    out.push(Change::Ctime);
                }
            }
            Err(e) => out.push(Change::Unreadable {
                cause: format!("fstat: {e}"),
            }),
        }
        match rustix::fs::stat(&self.path) {
            Ok(st) if (st.st_dev, st.st_ino) != (id.dev, id.ino) => out.push(Change::Replaced {
                was: (id.dev, id.ino),
                now: (st.st_dev, st.st_ino),
            }),
            Ok(_) => {}
            Err(rustix::io::Errno::NOENT) => out.push(Change::Removed),
            Err(e) => out.push(Change::Unreadable {
                cause: format!("stat: {e}"),
            }),
        }
        out
    }

    /// `"changed after open: size 123 -> 456, ctime changed ..."` when the
    /// cheap check ([`ShardFile::identity_changes`]) finds a change.
    pub fn changed_since_open(&self) -> Option<String> {
        let c = self.identity_changes();
        if c.is_empty() {
            return None;
        }
        let parts: Vec<String> = c.iter().map(Change::to_string).collect();
        Some(format!("changed after open: {}", parts.join(", ")))
    }

    /// A failed or short read's cause, with the change after open appended
    /// when there is one (warned once per file). The engine calls this when
    /// a chunk fails on this copy (`queue::settle`).
    pub(crate) fn explain_failure(&self, failure: String) -> String {
        let Some(change) = self.changed_since_open() else {
            return failure;
        };
        if !self.change_warned.swap(true, Ordering::Relaxed) {
            tracing::warn!(
                "{}: {change}: its catalog (offsets, sizes) is from the file as opened; reopen the model to read \
                 the file as it is now (`weightstream verify` names every change; warned once per file)",
                escape(&self.path)
            );
        }
        format!("{failure}; {change}")
    }
}

/// What became of one candidate copy.
#[derive(Debug, Clone, serde::Serialize)]
pub struct CopyReport {
    /// The shard's file name (serialised escaped, see [`layout::escape`]).
    #[serde(serialize_with = "serialize_escaped")]
    pub shard: OsString,
    #[serde(serialize_with = "serialize_escaped")]
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
    /// Why the weights are not what was asked for (a failed probe).
    weights_note: Option<String>,
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
        // Names are compared as bytes (they need not be UTF-8).
        let mut found: Vec<(OsString, PathBuf, PathBuf, usize)> = Vec::new();
        let mut primary_count = 0;
        for (ri, root) in roots.iter().enumerate().filter(|(_, r)| r.role != RootRole::Mirror) {
            let mut added = 0;
            for (name, listed, path) in catalog::list_shards(&root.given)? {
                if let Some(prev) = found.iter().find(|f| f.0 == name) {
                    tracing::warn!(
                        "{} skipped: {} was already found in {} (the first directory listed wins)",
                        escape(&listed),
                        escape(&name),
                        escape(&roots[prev.3].given)
                    );
                    continue;
                }
                found.push((name, listed, path, ri));
                added += 1;
            }
            if root.role == RootRole::Primary {
                primary_count = added;
            } else {
                tracing::info!("+{} -> {added} shard(s)", escape(&root.given));
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
                escape(&config.primary)
            );
        }
        let mirrors: Vec<&layout::Root> = roots.iter().filter(|r| r.role == RootRole::Mirror).collect();
        if mirrors.len() + 1 > MAX_COPY_RANKS {
            return Err(Error::Config(format!(
                "{} mirror directories given; at most {} (with the primary, {MAX_COPY_RANKS} copies of a shard)",
                mirrors.len(),
                MAX_COPY_RANKS - 1
            )));
        }
        // Descriptors: every copy is opened twice (buffered + O_DIRECT);
        // counted before anything is opened, the soft limit raised if need be.
        let candidates = found.len()
            + mirrors
                .iter()
                .map(|m| {
                    found
                        .iter()
                        .filter(|f| std::fs::symlink_metadata(m.given.join(&f.0)).is_ok())
                        .count()
                })
                .sum::<usize>();
        let per_copy = if config.direct == DirectMode::Off { 1 } else { 2 };
        let fds = FdBudget::plan(candidates, per_copy);
        let mut b = Builder {
            direct: config.direct,
            files: Vec::new(),
            drives: Vec::new(),
            report: Vec::new(),
            fds,
        };
        let mut shards = Vec::with_capacity(found.len());
        for (i, (name, listed, path, ri)) in found.into_iter().enumerate() {
            let (buffered, st) = catalog::open_regular(&path, true).map_err(|r| b.fds.error(&path, r))?;
            let header = crate::container::ShardHeader::read(&path, &buffered)?;
            let role = roots[ri].role.name();
            b.add(path.clone(), buffered, &st, header.file_size, i, 0, &name, role)?;
            shards.push(ShardInfo {
                path,
                listed,
                name,
                header,
            });
        }
        let mut copies: Vec<Vec<usize>> = (0..shards.len()).map(|i| vec![i]).collect();
        // Mirrors: each may hold any subset; every copy is proven first.
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
                        Ok(real) => prove_copy(&real, shard, &b.fds)?.map(|f| (real, f)),
                        Err(e) => Err(format!("is a link that cannot be resolved: {e}")),
                    },
                    Ok(_) => prove_copy(&cand, shard, &b.fds)?.map(|f| (cand.clone(), f)),
                };
                match proven {
                    Ok((real, (file, st))) => {
                        let idx = b.add(real, file, &st, shard.header.file_size, i, rank, &shard.name, "mirror")?;
                        copies[i].push(idx);
                        contributed += 1;
                    }
                    Err(reason) => {
                        tracing::warn!(
                            "{}: {reason} - file skipped; the primary copy serves this shard",
                            escape(&cand)
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
                tracing::warn!("mirror {}: no usable shard; ignored", escape(&m.given));
                rank -= 1;
            } else {
                tracing::info!(
                    "mirror {} -> {contributed} of {} shard(s)",
                    escape(&m.given),
                    shards.len()
                );
            }
        }
        let catalog = Catalog::new(&config.primary, shards)?;
        let keys = group_keys(&catalog);
        let ranks = 1 + rank;
        warn_shared_filesystems(&b.files, &copies, &b.drives);
        let mut weights_note = None;
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
            Weights::Probe => match probe_weights(&b.files, ranks) {
                Ok(w) => w,
                Err(why) => {
                    weights_note = Some(why);
                    vec![1.0; ranks]
                }
            },
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
                weights_note,
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

    /// Re-checks every opened copy (primary, split and mirror files) against
    /// what it was at [`Model::open`]: the path still names the same inode
    /// (else `replaced` or `removed`: reads go on seeing the file as opened,
    /// the old contents), the size and the ctime of the open file (written,
    /// truncated or extended in place), and its whole header bytes re-read
    /// and compared with the ones validated at open.
    ///
    /// With `digest`, every tensor of every copy is read (buffered, its
    /// pages dropped after) and hashed (sha256); a mirror copy whose
    /// payloads differ from the primary copy's is named with the tensors.
    /// A rewrite that keeps size and header shows only as a ctime change
    /// without `digest`; with a single copy, its bytes can be compared with
    /// an earlier report ([`VerifyReport::compare_with`]). Problems are
    /// reported, never returned as errors: the report names each file and
    /// what changed.
    pub fn verify(&self, digest: bool) -> Result<VerifyReport> {
        let cat = &self.inner.catalog;
        let mut buf = Vec::new();
        let mut files: Vec<FileVerdict> = Vec::with_capacity(self.inner.files.len());
        for f in &self.inner.files {
            let shard = &cat.shards()[f.shard];
            let raw = &shard.header.raw;
            let mut changes = f.identity_changes();
            let mut now = vec![0u8; raw.len()];
            match crate::container::read_exact_at(&f.path, &f.buffered, &mut now, 0) {
                Ok(()) if now != *raw => changes.push(Change::Header {
                    at: now.iter().zip(raw).position(|(a, b)| a != b).map(|i| i as u64),
                }),
                Ok(()) => {}
                Err(e) => changes.push(Change::Unreadable {
                    cause: format!("header: {e}"),
                }),
            }
            direct::drop_pages(&f.buffered, 0, raw.len() as u64);
            let mut tensors = BTreeMap::new();
            if digest {
                match digest_copy(f, shard, &mut buf) {
                    Ok(t) => tensors = t,
                    Err(cause) => changes.push(Change::Unreadable { cause }),
                }
            }
            files.push(FileVerdict {
                path: escape(&f.path),
                shard: escape(&shard.name),
                rank: f.rank,
                identity: f.identity,
                header_sha256: sha256_hex(raw),
                tensors,
                changes,
            });
        }
        if digest {
            for copies in &self.inner.copies {
                let p = copies[0];
                for &c in &copies[1..] {
                    let (primary, copy) = (&files[p], &files[c]);
                    if primary.tensors.is_empty() || copy.tensors.is_empty() {
                        continue; // unreadable: reported already
                    }
                    let differ = differing(&primary.tensors, &copy.tensors);
                    if !differ.is_empty() {
                        let against = format!("the primary copy {}", primary.path);
                        files[c].changes.push(Change::Digest {
                            against,
                            tensors: differ,
                        });
                    }
                }
            }
        }
        Ok(VerifyReport { digest, files })
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
                    submit: None,
                    rings: None,
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
        Stats {
            backend: "sync",
            backend_reason: None,
            rank_weights: self.inner.rank_weights.clone(),
            weights_note: self.inner.weights_note.clone(),
            arena_dontfork_failures: crate::arena::dontfork_failures(),
            bytes: drives.iter().map(|d| d.bytes).sum(),
            fixed_files: None,
            registered_buffers: None,
            drives,
        }
    }
}

/// Opens a file for O_DIRECT reads as weightstream opens shards: read-only,
/// close-on-exec, no symbolic link at the last component, and non-blocking
/// until `fstat` says it is a regular file (anything else is refused before
/// a byte is read).
pub fn open_direct(path: &Path) -> std::io::Result<File> {
    open_direct_checked(path).map(|(f, _)| f)
}

fn open_direct_checked(path: &Path) -> std::io::Result<(File, rustix::fs::Stat)> {
    catalog::open_regular_with(path, true, libc_flags::O_DIRECT).map_err(|r| match r {
        OpenRefusal::Io(_, e) => e,
        r @ OpenRefusal::NotRegular(_) => std::io::Error::other(r.to_string()),
    })
}

/// File descriptors a model needs against `RLIMIT_NOFILE`.
#[derive(Debug, Clone, Copy)]
struct FdBudget {
    /// Descriptors the model's copies take (each copy twice: buffered and
    /// O_DIRECT, unless direct I/O is off) plus those already open.
    needed: u64,
}

impl FdBudget {
    /// Descriptors kept free beyond the model's for the engine (a ring and
    /// an eventfd per drive), the index and sysfs reads while opening.
    const HEADROOM: u64 = 64;

    /// Counts what `copies` copies need and raises the soft limit toward
    /// the hard one when they do not fit (said once, at info); a hard limit
    /// too low is warned (the opens will then fail naming `ulimit -n`).
    fn plan(copies: usize, per_copy: usize) -> Self {
        // Descriptors open now (the listing's own one excluded).
        let open_now = std::fs::read_dir("/proc/self/fd").map_or(16, |d| d.count().saturating_sub(1)) as u64;
        let needed = open_now + (copies * per_copy) as u64;
        let (soft, hard) = nofile_limits();
        let want = needed + Self::HEADROOM;
        if want > soft {
            let to = want.min(hard);
            if to > soft {
                match rustix::process::setrlimit(
                    rustix::process::Resource::Nofile,
                    rustix::process::Rlimit {
                        current: Some(to),
                        maximum: (hard != u64::MAX).then_some(hard),
                    },
                ) {
                    Ok(()) => tracing::info!(
                        "raised the soft RLIMIT_NOFILE from {soft} to {to} (hard limit {}): this model opens {copies} \
                         file(s) x {per_copy} descriptor(s) (buffered + O_DIRECT), {open_now} already open",
                        show_limit(hard)
                    ),
                    Err(e) => tracing::warn!(
                        "cannot raise the soft RLIMIT_NOFILE from {soft} to {to} (hard limit {}): {e}",
                        show_limit(hard)
                    ),
                }
            }
            if want > hard {
                tracing::warn!(
                    "this model needs about {needed} file descriptors ({copies} file(s) x {per_copy}, {open_now} already \
                     open) but the hard limit (ulimit -Hn) is {hard}: opening may fail; raise it (ulimit -n, or \
                     LimitNOFILE= for a service)"
                );
            }
        }
        FdBudget { needed }
    }

    /// The error for a refused open: `EMFILE`/`ENFILE` name `ulimit -n`
    /// with the numbers (needed, soft, hard).
    fn error(&self, path: &Path, r: OpenRefusal) -> Error {
        match r.errno() {
            Some(libc::EMFILE) | Some(libc::ENFILE) => Error::catalog(path, self.limit_message(&r)),
            _ => r.into_error(path),
        }
    }

    fn limit_message(&self, r: &OpenRefusal) -> String {
        let (soft, hard) = nofile_limits();
        let system = if r.errno() == Some(libc::ENFILE) {
            " (ENFILE: the system-wide file table is full too; see fs.file-max)"
        } else {
            ""
        };
        format!(
            "{r}{system}: the model needs about {} file descriptors (each shard copy is opened twice, buffered and \
             O_DIRECT); soft limit {}, hard limit {}: raise them (`ulimit -n {}` in the shell that starts the \
             process, LimitNOFILE= for a systemd service)",
            self.needed,
            show_limit(soft),
            show_limit(hard),
            self.needed + Self::HEADROOM
        )
    }
}

/// (soft, hard) `RLIMIT_NOFILE`; `u64::MAX` for unlimited.
fn nofile_limits() -> (u64, u64) {
    let l = rustix::process::getrlimit(rustix::process::Resource::Nofile);
    (l.current.unwrap_or(u64::MAX), l.maximum.unwrap_or(u64::MAX))
}

fn show_limit(v: u64) -> String {
    if v == u64::MAX {
        "unlimited".to_string()
    } else {
        v.to_string()
    }
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
            let dir = mine[0].path.parent().map(escape).unwrap_or_default();
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
    fds: FdBudget,
}

impl Builder {
    /// Adds an opened copy (its header already validated or proven; `st` its
    /// `fstat`): probes its volume, opens it O_DIRECT (the same inode, or
    /// refused), files it under its drive.
    #[allow(clippy::too_many_arguments)]
    fn add(
        &mut self,
        path: PathBuf,
        buffered: File,
        st: &rustix::fs::Stat,
        size: u64,
        shard: usize,
        rank: usize,
        name: &OsString,
        role: &'static str,
    ) -> Result<usize> {
        let identity = FileIdentity::of(st);
        let topo = topology::probe(&path, &buffered).map_err(|e| Error::io(&path, "statx", e))?;
        let (direct, direct_refused) = if self.direct == DirectMode::Off {
            (None, Some("direct I/O turned off".to_string()))
        } else if topo.statx_says_no_direct {
            (
                None,
                Some(format!("statx reports no direct I/O support on {}", topo.fs_type)),
            )
        } else {
            match open_direct_checked(&path) {
                Ok((_, d)) if (d.st_dev, d.st_ino) != (identity.dev, identity.ino) => {
                    return Err(Error::catalog(
                        &path,
                        "was replaced while it was being opened (the O_DIRECT descriptor names another inode)",
                    ))
                }
                Ok((f, _)) => (Some(f), None),
                // Out of descriptors is not a filesystem refusing O_DIRECT.
                Err(e) if matches!(e.raw_os_error(), Some(libc::EMFILE) | Some(libc::ENFILE)) => {
                    return Err(self.fds.error(&path, OpenRefusal::Io("open(O_DIRECT)", e)))
                }
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
            shard: name.clone(),
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
            identity,
            failover_warned: AtomicBool::new(false),
            change_warned: AtomicBool::new(false),
        });
        Ok(self.files.len() - 1)
    }
}

/// Opens a mirror's copy of `shard` and proves it: a regular file (opened
/// non-blocking, so a FIFO cannot hang the open), the same size and the
/// same header bytes (length prefix included) as the primary. Identical
/// headers mean identical offsets; the data is trusted to match as a copy
/// (`Model::verify` with `digest` compares it). The inner error is why the
/// copy is refused; the outer one (out of file descriptors) fails the open.
#[allow(clippy::type_complexity)]
fn prove_copy(
    path: &Path,
    shard: &ShardInfo,
    fds: &FdBudget,
) -> Result<std::result::Result<(File, rustix::fs::Stat), String>> {
    let (file, st) = match catalog::open_regular(path, true) {
        Ok(f) => f,
        Err(r) if matches!(r.errno(), Some(libc::EMFILE) | Some(libc::ENFILE)) => return Err(fds.error(path, r)),
        Err(r @ OpenRefusal::NotRegular(_)) => return Ok(Err(r.to_string())),
        Err(r) => return Ok(Err(format!("cannot be opened: {r}"))),
    };
    let size = st.st_size as u64;
    if size != shard.header.file_size {
        return Ok(Err(format!(
            "size differs from the primary copy ({size} bytes, primary {} bytes)",
            shard.header.file_size
        )));
    }
    let mut raw = vec![0u8; shard.header.raw.len()];
    if let Err(e) = crate::container::read_exact_at(path, &file, &mut raw, 0) {
        return Ok(Err(format!("header cannot be read: {e}")));
    }
    if raw != shard.header.raw {
        let at = raw.iter().zip(&shard.header.raw).position(|(a, b)| a != b).unwrap_or(0);
        return Ok(Err(format!(
            "header differs from the primary copy (first difference at byte {at})"
        )));
    }
    Ok(Ok((file, st)))
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
/// flight per drive, 8 x 19 MiB per drive, the rank's drives at once) and
/// turns GB/s into weights; a failed probe gives equal weights, said once.
fn probe_weights(files: &[ShardFile], ranks: usize) -> std::result::Result<Vec<f64>, String> {
    const BS: usize = 19 << 20;
    const QD: usize = 8;
    let mut w = Vec::with_capacity(ranks);
    for r in 0..ranks {
        // The rank's O_DIRECT descriptors, grouped by drive.
        let mut drives: Vec<(usize, Vec<&File>)> = Vec::new();
        let mut missing = None;
        for f in files.iter().filter(|f| f.rank == r) {
            let Some(d) = f.direct.as_ref() else {
                missing = Some(format!("{} has no O_DIRECT descriptor", escape(&f.path)));
                break;
            };
            match drives.iter_mut().find(|g| g.0 == f.drive) {
                Some(g) => g.1.push(d),
                None => drives.push((f.drive, vec![d])),
            }
        }
        let groups: Vec<Vec<&File>> = drives.into_iter().map(|g| g.1).collect();
        let why = match missing {
            Some(m) => m,
            None => match crate::probe::timed_read(&groups, BS, QD, (QD * BS) as u64) {
                Ok(gbps) if gbps > 0.0 => {
                    w.push(gbps);
                    continue;
                }
                Ok(gbps) => format!("it measured {gbps} GB/s"),
                Err(e) => e.to_string(),
            },
        };
        let why = format!("weight probe of copy rank {r} failed ({why}); using equal weights");
        tracing::warn!("{why} (reported as weights_note in the stats)");
        return Err(why);
    }
    tracing::info!("probed weights (GB/s per copy rank): {w:?}");
    Ok(w)
}

/// What [`Model::verify`] found, per opened copy. Serialisable: saved (e.g.
/// `weightstream verify --json`), it is the record a later check compares
/// against ([`VerifyReport::compare_with`]).
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct VerifyReport {
    /// Whether tensor payloads were hashed.
    pub digest: bool,
    /// Every copy, in file order (primary copies first, then mirror copies).
    pub files: Vec<FileVerdict>,
}

/// One copy of a shard, re-checked.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct FileVerdict {
    /// The file opened (escaped, see [`layout::escape`]).
    pub path: String,
    /// The shard's file name (escaped).
    pub shard: String,
    /// Copy rank (0 primary or split, k mirror directory k).
    pub rank: usize,
    /// The file as opened.
    pub identity: FileIdentity,
    /// sha256 of the header bytes validated at open (length prefix included).
    pub header_sha256: String,
    /// With `digest`: sha256 of every tensor of the shard, read from this copy.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub tensors: BTreeMap<String, String>,
    /// What changed (empty: nothing).
    pub changes: Vec<Change>,
}

impl VerifyReport {
    /// The copies with at least one change.
    pub fn changed(&self) -> impl Iterator<Item = &FileVerdict> {
        self.files.iter().filter(|f| !f.changes.is_empty())
    }

    /// Nothing changed.
    pub fn is_clean(&self) -> bool {
        self.changed().next().is_none()
    }

    /// Adds what changed since `earlier`, a report saved from the same
    /// model before (another process, another day): files are matched by
    /// path; a different inode, size, ctime, header or (when both hashed
    /// them) tensor digest is a change; a file in one report and not the
    /// other is one too.
    pub fn compare_with(&mut self, earlier: &VerifyReport) {
        for f in &mut self.files {
            let Some(e) = earlier.files.iter().find(|e| e.path == f.path) else {
                f.changes.push(Change::Unlisted {
                    cause: "not in the record compared against (a new copy)".to_string(),
                });
                continue;
            };
            let (was, now) = (&e.identity, &f.identity);
            if (was.dev, was.ino) != (now.dev, now.ino) {
                f.changes.push(Change::Replaced {
                    was: (was.dev, was.ino),
                    now: (now.dev, now.ino),
                });
            }
            if was.size != now.size {
                f.changes.push(Change::Size {
                    was: was.size,
                    now: now.size,
                });
            }
            if (was.ctime_sec, was.ctime_nsec) != (now.ctime_sec, now.ctime_nsec) {
                f.changes.push(Change::Ctime);
            }
            if e.header_sha256 != f.header_sha256 {
                f.changes.push(Change::Header { at: None });
            }
            if !e.tensors.is_empty() && !f.tensors.is_empty() {
                let differ = differing(&e.tensors, &f.tensors);
                if !differ.is_empty() {
                    f.changes.push(Change::Digest {
                        against: "the record".to_string(),
                        tensors: differ,
                    });
                }
            }
        }
        for e in &earlier.files {
            if !self.files.iter().any(|f| f.path == e.path) {
                self.files.push(FileVerdict {
                    tensors: BTreeMap::new(),
                    changes: vec![Change::Unlisted {
                        cause: "in the record but not a copy in the model now (removed or refused)".to_string(),
                    }],
                    ..e.clone()
                });
            }
        }
    }
}

/// Tensor names whose digests differ, or that only one side has.
fn differing(a: &BTreeMap<String, String>, b: &BTreeMap<String, String>) -> Vec<String> {
    let mut v: Vec<String> = a
        .iter()
        .filter(|(n, h)| b.get(*n) != Some(h))
        .map(|(n, _)| n.clone())
        .chain(b.keys().filter(|n| !a.contains_key(*n)).cloned())
        .collect();
    v.sort();
    v
}

fn sha256_hex(bytes: &[u8]) -> String {
    use sha2::Digest;
    sha2::Sha256::digest(bytes).iter().map(|b| format!("{b:02x}")).collect()
}

/// sha256 of every tensor of `shard` as copy `f` holds it now (buffered
/// reads of 8 MiB, pages dropped after each); the first read that fails or
/// ends early is the error.
fn digest_copy(
    f: &ShardFile,
    shard: &ShardInfo,
    buf: &mut Vec<u8>,
) -> std::result::Result<BTreeMap<String, String>, String> {
    use sha2::Digest;
    use std::os::unix::fs::FileExt;
    const STEP: usize = 8 << 20;
    buf.resize(STEP, 0);
    let mut out = BTreeMap::new();
    for t in &shard.header.tensors {
        let start = shard.header.data_start + t.begin;
        let end = shard.header.data_start + t.end;
        let mut h = sha2::Sha256::new();
        let mut at = start;
        while at < end {
            let want = ((end - at) as usize).min(STEP);
            match f.buffered.read_at(&mut buf[..want], at) {
                Ok(0) => {
                    return Err(format!(
                        "end of file at byte {at} while hashing tensor {:?} [{start}, {end})",
                        t.name
                    ))
                }
                Ok(n) => {
                    h.update(&buf[..n]);
                    at += n as u64;
                }
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(format!("read at byte {at} (tensor {:?}): {e}", t.name)),
            }
        }
        direct::drop_pages(&f.buffered, start, end - start);
        out.insert(
            t.name.clone(),
            h.finalize().iter().map(|b| format!("{b:02x}")).collect(),
        );
    }
    Ok(out)
}
