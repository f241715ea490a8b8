//! `Model::open`, step by step: validate the directories, walk the search
//! path, count and budget the descriptors, open and validate every primary
//! shard, prove every mirror copy, build the catalog and the weights.

use std::ffi::OsString;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicBool;
use std::sync::Arc;

use super::placed::{self, Placed};
use super::roots::{self, Root, RootRole};
use super::{Model, ModelInner, Weighting};
use crate::config::{DirectMode, ModelConfig, Weights, MAX_COPY_RANKS};
use crate::error::{escape, serialize_escaped, Error, Result};
use crate::format::catalog::{self, Catalog, ShardInfo};
use crate::format::container::{self, ShardHeader};
use crate::stats::{DriveCounters, FallbackCause};
use crate::storage::files::{Drive, FileIdentity, ShardFile};
use crate::storage::open::{open_direct_checked, open_regular, OpenRefusal};
use crate::storage::topology;

/// What became of one candidate copy.
#[derive(Debug, Clone, serde::Serialize)]
pub struct CopyReport {
    /// The shard's file name (serialised escaped, see `layout::escape`).
    #[serde(serialize_with = "serialize_escaped")]
    pub shard: OsString,
    #[serde(serialize_with = "serialize_escaped")]
    /// The candidate file (serialised escaped).
    pub path: PathBuf,
    /// `primary`, `split` or `mirror`.
    pub role: &'static str,
    /// Copy rank: 0 for the primary or split copy, k for mirror directory k.
    pub rank: usize,
    /// Whether the copy was accepted.
    pub accepted: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    /// Why it was refused.
    pub reason: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    /// The drive of an accepted copy.
    pub device: Option<String>,
}

/// A shard found along the search path: its name, the path as listed, the
/// file it names, and the root (index into the validated roots) it was found in.
struct Found {
    name: OsString,
    listed: PathBuf,
    path: PathBuf,
    root: usize,
}

impl Model {
    /// Validates every directory, finds the shards along the search path,
    /// opens and validates every header, proves every mirror copy and probes
    /// every drive. Nothing is read from the data sections. With
    /// [`Weights::Probe`] the weights are measured later, by the first
    /// [`Engine`](crate::Engine) made on the model (the engine owns the
    /// drives' I/O); until then they are equal.
    pub fn open(config: ModelConfig) -> Result<Self> {
        // A placed model (`weightstream place`): its layout index names the
        // roots and the files; no environment variable needed.
        let (config, placed) = placed::for_open(config)?;
        if placed.is_some() && !config.only.is_empty() {
            return Err(Error::catalog(
                &config.primary,
                "a placed model is opened whole: its layout index names its files (no `only`)",
            ));
        }
        let roots = roots::validate_roots(&config)?;
        let found = if config.only.is_empty() {
            search_path(&roots, &config.primary, placed.as_ref())?
        } else {
            named(&roots, &config.primary, &config.only)?
        };
        let mirrors: Vec<&Root> = roots.iter().filter(|r| r.role == RootRole::Mirror).collect();
        if mirrors.len() + 1 > MAX_COPY_RANKS {
            return Err(Error::Config(format!(
                "{} mirror directories given; at most {} (with the primary, {MAX_COPY_RANKS} copies of a shard)",
                mirrors.len(),
                MAX_COPY_RANKS - 1
            )));
        }
        // Descriptors: every copy is opened twice (buffered + O_DIRECT);
        // counted before anything is opened, the soft limit raised if need be.
        let per_copy = if config.direct == DirectMode::Off { 1 } else { 2 };
        let mut b = Builder {
            direct: config.direct,
            files: Vec::new(),
            drives: Vec::new(),
            report: Vec::new(),
            fds: FdBudget::plan(count_copies(&found, &mirrors), per_copy),
        };
        let shards = b.open_primaries(found, &roots)?;
        let mut copies: Vec<Vec<usize>> = (0..shards.len()).map(|i| vec![i]).collect();
        let mirror_ranks = b.add_mirrors(&mirrors, &shards, &mut copies)?;
        let catalog = if config.only.is_empty() {
            Catalog::new(&config.primary, shards)?
        } else {
            // The chosen files on their own: the directory's index describes
            // the whole model, not them.
            Catalog::without_index(&config.primary, shards)?
        };
        let keys = group_keys(&catalog);
        let shared_mirrors = warn_shared_filesystems(&b.files, &copies, &b.drives);
        let weights = weighting(&config.weights, mirror_ranks)?;
        Ok(Model {
            inner: Arc::new(ModelInner {
                catalog,
                files: b.files,
                copies,
                drives: b.drives,
                direct: config.direct,
                route: config.route,
                weights,
                keys,
                report: b.report,
                shared_mirrors,
                experts: std::sync::OnceLock::new(),
            }),
        })
    }
}

/// The search path: the primary, then the split directories in order; the
/// first directory holding a basename wins (names compared as bytes: they
/// need not be UTF-8). No shard at all is an error naming the primary. Of a
/// placed model, only the files its layout index names are listed.
fn search_path(roots: &[Root], primary: &Path, placed: Option<&Placed>) -> Result<Vec<Found>> {
    let mut found: Vec<Found> = Vec::new();
    let mut primary_count = 0;
    for (ri, root) in roots.iter().enumerate().filter(|(_, r)| r.role != RootRole::Mirror) {
        let mut added = 0;
        for (name, listed, path) in placed::listing(placed, &root.given)? {
            if let Some(prev) = found.iter().find(|f| f.name == name) {
                tracing::warn!(
                    "{} skipped: {} was already found in {} (the first directory listed wins)",
                    escape(&listed),
                    escape(&name),
                    escape(&roots[prev.root].given)
                );
                continue;
            }
            found.push(Found {
                name,
                listed,
                path,
                root: ri,
            });
            added += 1;
        }
        if root.role == RootRole::Primary {
            primary_count = added;
        } else {
            tracing::info!("+{} -> {added} shard(s)", escape(&root.given));
        }
    }
    if found.is_empty() {
        return Err(Error::catalog(primary, "no *.safetensors shards in this directory"));
    }
    let n_dirs = roots.iter().filter(|r| r.role != RootRole::Mirror).count();
    if n_dirs > 1 {
        tracing::info!(
            "model across {n_dirs} dir(s): {} shard(s) total (primary {} -> {primary_count} shard(s)), no duplication",
            found.len(),
            escape(primary)
        );
    }
    Ok(found)
}

/// The files `only` names, each looked up by name along the search path
/// (the primary, then the split directories: the first holding it wins),
/// sorted by name. Nothing is listed, so a file is what it is, whatever
/// its name (a `NamedTemporaryFile` has no `.safetensors` suffix), and
/// nothing else in its directory is looked at. A name found nowhere, or
/// not a regular file, is an error naming it.
fn named(roots: &[Root], primary: &Path, only: &[std::ffi::OsString]) -> Result<Vec<Found>> {
    let mut found = Vec::with_capacity(only.len());
    for name in only {
        if found.iter().any(|f: &Found| &f.name == name) {
            continue;
        }
        let hit = roots
            .iter()
            .enumerate()
            .filter(|(_, r)| r.role != RootRole::Mirror)
            .find_map(|(ri, r)| {
                let listed = r.given.join(name);
                std::fs::symlink_metadata(&listed).ok().map(|m| (ri, listed, m))
            });
        let Some((root, listed, meta)) = hit else {
            return Err(Error::io(
                primary.join(name),
                "open",
                std::io::Error::from_raw_os_error(libc::ENOENT),
            ));
        };
        let path = crate::storage::open::resolve_shard(&listed, meta.file_type().is_symlink(), "a model file")?;
        found.push(Found {
            name: name.clone(),
            listed,
            path,
            root,
        });
    }
    found.sort_by(|a, b| a.name.cmp(&b.name));
    Ok(found)
}

/// Copies a model may open: every shard found, plus each mirror entry present.
fn count_copies(found: &[Found], mirrors: &[&Root]) -> usize {
    found.len()
        + mirrors
            .iter()
            .map(|m| {
                found
                    .iter()
                    .filter(|f| std::fs::symlink_metadata(m.given.join(&f.name)).is_ok())
                    .count()
            })
            .sum::<usize>()
}

/// The read weight of each copy rank (primary, then each mirror directory
/// that contributed a copy), as configured; `Probe` starts equal and is
/// measured by the first engine.
fn weighting(weights: &Weights, mirror_ranks: usize) -> Result<Weighting> {
    let ranks = 1 + mirror_ranks;
    let configured = match weights {
        Weights::Equal | Weights::Probe => vec![1.0; ranks],
        Weights::Explicit(w) if w.len() == ranks => w.clone(),
        Weights::Explicit(w) => {
            return Err(Error::Config(format!(
                "{} weight(s) given for {ranks} copies (the primary and {} mirror director{} holding shards): give one per copy, or probe",
                w.len(),
                mirror_ranks,
                if mirror_ranks == 1 { "y" } else { "ies" }
            )))
        }
    };
    Ok(Weighting {
        configured,
        probe: matches!(weights, Weights::Probe),
        probed: std::sync::OnceLock::new(),
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

/// Says, once per mirror directory, when every copy it holds shares a
/// filesystem with another copy of the same shard: it adds no bandwidth.
/// Returns those directories with the device (the model's warnings).
fn warn_shared_filesystems(files: &[ShardFile], copies: &[Vec<usize>], drives: &[Drive]) -> Vec<(PathBuf, String)> {
    let mut out = Vec::new();
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
            if let Some(parent) = mine[0].path.parent() {
                out.push((parent.to_path_buf(), drives[mine[0].drive].device.clone()));
            }
        }
    }
    out
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
    let (file, st) = match open_regular(path, true) {
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
    if let Err(e) = container::read_exact_at(path, &file, &mut raw, 0) {
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

impl Builder {
    /// Opens and validates every primary (or split) shard found, in order:
    /// file index = shard index.
    fn open_primaries(&mut self, found: Vec<Found>, roots: &[Root]) -> Result<Vec<ShardInfo>> {
        let mut shards = Vec::with_capacity(found.len());
        for (i, f) in found.into_iter().enumerate() {
            let (buffered, st) = open_regular(&f.path, true).map_err(|r| self.fds.error(&f.path, r))?;
            let header = ShardHeader::read(&f.path, &buffered)?;
            let role = roots[f.root].role.name();
            self.add(f.path.clone(), buffered, &st, header.file_size, i, 0, &f.name, role)?;
            shards.push(ShardInfo {
                path: f.path,
                listed: f.listed,
                name: f.name,
                header,
            });
        }
        Ok(shards)
    }

    /// Mirrors: each may hold any subset; every copy is proven first. A
    /// mirror that contributes no file takes no rank (no weight slot).
    /// Returns the ranks taken.
    fn add_mirrors(&mut self, mirrors: &[&Root], shards: &[ShardInfo], copies: &mut [Vec<usize>]) -> Result<usize> {
        let mut rank = 0;
        for m in mirrors {
            rank += 1;
            let mut contributed = 0;
            for (i, shard) in shards.iter().enumerate() {
                let cand = m.given.join(&shard.name);
                let proven = match std::fs::symlink_metadata(&cand) {
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
                    Err(e) => Err(format!("cannot be read: {e}")),
                    Ok(meta) if meta.file_type().is_symlink() => match std::fs::canonicalize(&cand) {
                        Ok(real) => prove_copy(&real, shard, &self.fds)?.map(|f| (real, f)),
                        Err(e) => Err(format!("is a link that cannot be resolved: {e}")),
                    },
                    Ok(_) => prove_copy(&cand, shard, &self.fds)?.map(|f| (cand.clone(), f)),
                };
                match proven {
                    Ok((real, (file, st))) => {
                        let idx = self.add(real, file, &st, shard.header.file_size, i, rank, &shard.name, "mirror")?;
                        copies[i].push(idx);
                        contributed += 1;
                    }
                    Err(reason) => {
                        tracing::warn!(
                            "{}: {reason} - file skipped; the primary copy serves this shard",
                            escape(&cand)
                        );
                        self.report.push(CopyReport {
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
        Ok(rank)
    }
}
