//! A model opened for reading: its catalog, every shard opened twice
//! (O_DIRECT and buffered), and the drives the shards live on.

use std::fs::File;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::arena::{Slot, SlotSpec};
use crate::catalog::{self, libc_flags, Catalog, ShardInfo, TensorRef};
use crate::direct::{self, DirectMode, Loaded};
use crate::error::{Error, Result};
use crate::stats::{self, DriveCounters, DriveStats, FallbackCause, Stats};
use crate::topology::{self, FileTopology};

/// How to open a model.
#[derive(Debug, Clone)]
pub struct ModelConfig {
    /// The primary model directory.
    pub primary: PathBuf,
    /// Whether reads use O_DIRECT.
    pub direct: DirectMode,
}

impl ModelConfig {
    pub fn new(primary: impl Into<PathBuf>) -> Self {
        ModelConfig {
            primary: primary.into(),
            direct: DirectMode::Auto,
        }
    }

    pub fn direct(mut self, mode: DirectMode) -> Self {
        self.direct = mode;
        self
    }
}

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
    files: Vec<ShardFile>,
    drives: Vec<Drive>,
    direct: DirectMode,
}

impl Model {
    /// Opens every shard of the primary directory, validates every header and
    /// probes every drive. Nothing is read from the data sections.
    pub fn open(config: ModelConfig) -> Result<Self> {
        let dir = &config.primary;
        let meta = std::fs::metadata(dir).map_err(|e| Error::io(dir, "open model directory", e))?;
        if !meta.is_dir() {
            return Err(Error::catalog(dir, "not a directory"));
        }
        let listed = catalog::list_shards(dir)?;
        if listed.is_empty() {
            return Err(Error::catalog(dir, "no *.safetensors shards in this directory"));
        }
        let mut shards = Vec::with_capacity(listed.len());
        let mut files = Vec::with_capacity(listed.len());
        let mut drives: Vec<Drive> = Vec::new();
        for (name, listed_path, path) in listed {
            let (buffered, header) = catalog::open_shard(&path)?;
            let topo = topology::probe(&path, &buffered).map_err(|e| Error::io(&path, "statx", e))?;
            let (direct, direct_refused) = if config.direct == DirectMode::Off {
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
            if config.direct == DirectMode::On {
                if let Some(why) = &direct_refused {
                    return Err(Error::catalog(&path, format!("--direct on, but {why}")));
                }
            }
            let drive = match drives.iter().position(|d| d.dev == topo.dev) {
                Some(i) => i,
                None => {
                    drives.push(Drive {
                        dev: topo.dev,
                        device: topo.device.clone(),
                        mount: topo.mount.clone(),
                        fs_type: topo.fs_type.clone(),
                        dio_align: 0,
                        direct_open: true,
                        counters: DriveCounters::default(),
                    });
                    drives.len() - 1
                }
            };
            let d = &mut drives[drive];
            d.dio_align = d.dio_align.max(topo.dio_offset_align);
            d.direct_open &= direct.is_some();
            if config.direct != DirectMode::Off {
                if let Some(why) = &direct_refused {
                    d.counters
                        .fallback(&d.device, &path, FallbackCause::DirectOpenRefused, why);
                }
            }
            files.push(ShardFile {
                path: path.clone(),
                size: header.file_size,
                buffered,
                direct,
                direct_refused,
                topo,
                drive,
            });
            shards.push(ShardInfo {
                path,
                listed: listed_path,
                name,
                header,
            });
        }
        let catalog = Catalog::new(dir, shards)?;
        Ok(Model {
            inner: Arc::new(ModelInner {
                catalog,
                files,
                drives,
                direct: config.direct,
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
                    ring: None,
                }
            })
            .collect();
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
