//! Placing a model across drives: `weightstream place SRC --to ROOT;ROOT
//! --layout mirror|split|layers`, as a library call.
//!
//! ```no_run
//! use weightstream::place::{self, LayoutKind, PlaceConfig};
//! let cfg = PlaceConfig::new("/models/qwen", ["/nvme0/ws", "/nvme1/ws"], LayoutKind::Layers)
//!     .on_progress(|p| eprintln!("{} of {} bytes", p.bytes, p.bytes_total));
//! let report = place::place(&cfg)?;
//! // The placed model: its primary folder, which holds the layout index.
//! let model = weightstream::Model::open(weightstream::ModelConfig::new(&report.primary))?;
//! # Ok::<(), weightstream::Error>(())
//! ```
//!
//! The modules, in the order a placement runs:
//!
//! - `rules`: the roots (validated, one volume each) and the per-model
//!   folder on each (owner-only, checked before every write, marked,
//!   locked);
//! - `source`: the model being placed (headers validated, catalog built,
//!   extras, fingerprint);
//! - `plan`: which file goes where (mirror, split, layers; the layer
//!   files' headers made and validated);
//! - `write`: temporary files written O_DIRECT from aligned buffers, one
//!   reader and one writer thread per destination drive;
//! - `commit`: the protocol that keeps the layout index the commit point
//!   (reuse, space, park, rename, index, stale copies, orphans);
//! - `verify` ([`verify()`]): every file re-checked against the index.
//!
//! The layout index format (`weightstream-layout.json`: the roots, every
//! file with its size and header hash) lives one layer down, in
//! `model/placed.rs`, beside its reader:
//! [`Model::open`](crate::Model::open) reads it, and `model` imports nothing from `place`
//! (`ci/layers`).
//!
//! The rules are stated in `docs/layouts.md`.

use std::path::PathBuf;
use std::str::FromStr;
use std::sync::Arc;

use crate::error::{serialize_escaped, Error, Result};

mod commit;
mod plan;
mod rules;
mod source;
mod verify;
mod write;

pub use crate::model::placed::LayoutKind;
pub use verify::{verify, FileCheck, PlacedVerify};

/// The layout index (its format, reader and file names), the folder and
/// layer-file names, and the commit protocol's steps: for
/// `crate::__internal::place` (the command, the tests, the `layout_index`
/// fuzz target; not a stable API).
pub(crate) mod internal {
    pub use super::plan::{layer_file, EXTRAS_FILE};
    pub use super::rules::folder_name;
    pub use super::{Hook, Step};
    pub use crate::model::placed::{
        FileDigests, FileKind, IndexExtra, IndexFile, IndexRoot, LayoutIndex, OsName, Placed, INDEX_FILE, MARKER_FILE,
        PARKED_FILE,
    };
}

/// How far a placement has got (passed to the progress callback).
#[derive(Debug, Clone, Copy)]
pub struct Progress {
    /// Bytes of safetensors files written so far (files proven identical
    /// are not rewritten and not counted).
    pub bytes: u64,
    /// Bytes this run writes in all.
    pub bytes_total: u64,
    /// Files written so far.
    pub files: usize,
    /// Files this run writes in all.
    pub files_total: usize,
    /// Time since the run started.
    pub elapsed: std::time::Duration,
}

/// A progress callback: called on the thread that called [`place`], about
/// every 100 ms while files are written, and once at the end (set with
/// [`PlaceConfig::on_progress`]).
pub(crate) type ProgressFn = Arc<dyn Fn(&Progress) + Send + Sync>;

/// A step of the commit protocol (for tests: a hook may stop the run at
/// any of them, as a crash would).
#[doc(hidden)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Step {
    /// Folders made private, locked and marked; nothing written yet.
    Folders,
    /// The k-th temporary file is complete (fsync'ed, header checked).
    FileWritten(usize),
    /// The previous index was parked (a content re-shard).
    Parked,
    /// The k-th file was renamed to its final name.
    Renamed(usize),
    /// Every file renamed, the folders synced; the index not yet written.
    AllRenamed,
    /// The new index is written and synced under its temporary name.
    IndexWritten,
    /// The new index renamed into place and the folder synced.
    Committed,
    /// Stale copies deleted, orphans reported.
    Cleaned,
}

impl std::fmt::Display for Step {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Step::Folders => f.write_str("folders"),
            Step::FileWritten(k) => write!(f, "file:{k}"),
            Step::Parked => f.write_str("parked"),
            Step::Renamed(k) => write!(f, "renamed:{k}"),
            Step::AllRenamed => f.write_str("renamed"),
            Step::IndexWritten => f.write_str("index-written"),
            Step::Committed => f.write_str("committed"),
            Step::Cleaned => f.write_str("cleaned"),
        }
    }
}

impl FromStr for Step {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        let num = |v: &str| {
            v.parse::<usize>()
                .map_err(|_| Error::Config(format!("step {s:?}: {v:?} is not a number")))
        };
        Ok(match s.trim() {
            "folders" => Step::Folders,
            "parked" => Step::Parked,
            "renamed" => Step::AllRenamed,
            "index-written" => Step::IndexWritten,
            "committed" => Step::Committed,
            "cleaned" => Step::Cleaned,
            t => match t.split_once(':') {
                Some(("file", k)) => Step::FileWritten(num(k)?),
                Some(("renamed", k)) => Step::Renamed(num(k)?),
                _ => {
                    return Err(Error::Config(format!(
                        "step {s:?}: expected folders, file:K, parked, renamed:K, renamed, index-written, \
                         committed or cleaned"
                    )))
                }
            },
        })
    }
}

/// A test hook: called at each [`Step`]; returning `true` stops the run
/// right there, leaving everything as a crash would (no clean-up).
#[doc(hidden)]
pub type Hook = dyn Fn(&Step) -> bool + Send + Sync;

/// What to place where, and how.
#[derive(Clone)]
pub struct PlaceConfig {
    /// The model directory to place (its `*.safetensors` shards and the
    /// extra files beside them).
    pub source: PathBuf,
    /// The roots, primary first: each an existing directory on its own
    /// drive.
    pub roots: Vec<PathBuf>,
    /// How the model is laid out over the roots.
    pub layout: LayoutKind,
    /// Also prove files kept from an earlier run by the sha256 of every
    /// tensor (destination and source read in full); without it, size,
    /// header hash and the source's fingerprint prove them.
    pub digest: bool,
    /// Accept a root on the source's volume (warned: it adds no read
    /// bandwidth, and placing reads and writes one drive).
    pub allow_source_volume: bool,
    /// Bytes per I/O buffer (a multiple of 1 MiB; 8 MiB by default).
    pub buffer_bytes: usize,
    pub(crate) progress: Option<ProgressFn>,
    pub(crate) hook: Option<Arc<Hook>>,
}

impl std::fmt::Debug for PlaceConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PlaceConfig")
            .field("source", &self.source)
            .field("roots", &self.roots)
            .field("layout", &self.layout)
            .field("digest", &self.digest)
            .field("allow_source_volume", &self.allow_source_volume)
            .field("buffer_bytes", &self.buffer_bytes)
            .field("progress", &self.progress.is_some())
            .finish()
    }
}

impl PlaceConfig {
    /// Places `source` on `roots` (primary first) in `layout`; no tensor
    /// digests, no root on the source's volume, 8 MiB buffers.
    pub fn new<I, P>(source: impl Into<PathBuf>, roots: I, layout: LayoutKind) -> Self
    where
        I: IntoIterator<Item = P>,
        P: Into<PathBuf>,
    {
        PlaceConfig {
            source: source.into(),
            roots: roots.into_iter().map(Into::into).collect(),
            layout,
            digest: false,
            allow_source_volume: false,
            buffer_bytes: 8 << 20,
            progress: None,
            hook: None,
        }
    }

    /// Sets [`digest`](PlaceConfig::digest).
    pub fn digest(mut self, on: bool) -> Self {
        self.digest = on;
        self
    }

    /// Sets [`allow_source_volume`](PlaceConfig::allow_source_volume).
    pub fn allow_source_volume(mut self, on: bool) -> Self {
        self.allow_source_volume = on;
        self
    }

    /// Sets [`buffer_bytes`](PlaceConfig::buffer_bytes).
    pub fn buffer_bytes(mut self, bytes: usize) -> Self {
        self.buffer_bytes = bytes;
        self
    }

    /// Calls `f` with the progress about every 100 ms while files are
    /// written (on the calling thread), and once at the end.
    pub fn on_progress(mut self, f: impl Fn(&Progress) + Send + Sync + 'static) -> Self {
        self.progress = Some(Arc::new(f));
        self
    }

    /// Test hook, see [`Hook`].
    #[doc(hidden)]
    pub fn fault_hook(mut self, f: impl Fn(&Step) -> bool + Send + Sync + 'static) -> Self {
        self.hook = Some(Arc::new(f));
        self
    }
}

/// A file named in a report, with its size.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct FileNote {
    /// The file.
    #[serde(serialize_with = "serialize_escaped")]
    pub path: PathBuf,
    /// Its size in bytes.
    pub size: u64,
}

/// One root of a finished placement.
#[derive(Debug, Clone, serde::Serialize)]
pub struct RootReport {
    /// The root (its real path).
    #[serde(serialize_with = "serialize_escaped")]
    pub root: PathBuf,
    /// The placement's folder on it.
    #[serde(serialize_with = "serialize_escaped")]
    pub folder: PathBuf,
    /// Safetensors files the layout puts here.
    pub files: usize,
    /// Their bytes.
    pub bytes: u64,
    /// Of those files, written by this run.
    pub written: usize,
    /// Their bytes.
    pub bytes_written: u64,
    /// The folder was made by this run.
    pub created: bool,
}

/// What a placement did.
#[derive(Debug, Clone, serde::Serialize)]
pub struct PlaceReport {
    /// The layout placed.
    pub layout: LayoutKind,
    /// The source directory (its real path).
    #[serde(serialize_with = "serialize_escaped")]
    pub source: PathBuf,
    /// The source's fingerprint, as the index records it.
    pub source_fingerprint: String,
    /// The placed model's primary folder: open this directory.
    #[serde(serialize_with = "serialize_escaped")]
    pub primary: PathBuf,
    /// The layout index (the commit point).
    #[serde(serialize_with = "serialize_escaped")]
    pub index: PathBuf,
    /// Every root, primary first.
    pub roots: Vec<RootReport>,
    /// Safetensors files written by this run.
    pub files_written: usize,
    /// Their bytes.
    pub bytes_written: u64,
    /// Files kept from an earlier placement, proven identical.
    pub files_reused: usize,
    /// Their bytes.
    pub bytes_reused: u64,
    /// Extra files (config, tokenizer, index) written to the primary.
    pub extras_written: usize,
    /// Nothing to do: every file proven identical and the index unchanged.
    pub no_op: bool,
    /// The previous run's index was parked (files it named are replaced).
    pub parked: bool,
    /// What an earlier, interrupted run left and this one repaired.
    pub repaired: Vec<String>,
    /// Temporary files of interrupted runs, removed.
    pub temps_removed: Vec<FileNote>,
    /// Copies the previous layout named and this one does not: deleted
    /// after the new index was committed.
    pub deleted: Vec<FileNote>,
    /// Files in the placement folders that no index names and that are not
    /// weightstream's: reported, never deleted.
    pub orphans: Vec<FileNote>,
    /// Every warning (also logged once).
    pub warnings: Vec<String>,
    /// Decisions worth knowing (metadata merges, buffered fallbacks).
    pub notes: Vec<String>,
    /// Wall time of the run.
    pub seconds: f64,
    /// Bytes written per second of the writing phase (GB/s, 10^9).
    pub write_gbps: f64,
    /// Wall time of the writing phase.
    pub write_seconds: f64,
    /// Growth of `Cached` in `/proc/meminfo` over the run (the whole
    /// machine's page cache: other processes count too).
    pub cache_growth_bytes: i64,
}

/// Places the model `cfg.source` on `cfg.roots` in `cfg.layout` (see the
/// module documentation and `docs/layouts.md` for the rules).
pub fn place(cfg: &PlaceConfig) -> Result<PlaceReport> {
    commit::run(cfg)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn steps_round_trip() {
        for s in [
            Step::Folders,
            Step::FileWritten(3),
            Step::Parked,
            Step::Renamed(1),
            Step::AllRenamed,
            Step::IndexWritten,
            Step::Committed,
            Step::Cleaned,
        ] {
            assert_eq!(s.to_string().parse::<Step>().unwrap(), s);
        }
        assert!("file:x".parse::<Step>().is_err());
        assert!("later".parse::<Step>().is_err());
    }

    #[test]
    fn layouts_parse() {
        assert_eq!("Layers".parse::<LayoutKind>().unwrap(), LayoutKind::Layers);
        assert!("raid0".parse::<LayoutKind>().is_err());
    }
}
