//! weightstream: stream model weights from `.safetensors` shards on NVMe
//! straight into the memory slots an engine computes from.
//!
//! The data flow, and the modules that own each step:
//!
//! ```text
//! config   -> what to open and how to read (builders, WEIGHTSTREAM_* table)
//! storage  -> shard files opened (O_DIRECT + buffered), DIOALIGN, NUMA node
//! format   -> one shard's header validated; the catalog (name -> range)
//! model    -> Model::open: search path, proven mirrors, drives, verify
//! memory   -> page-aligned arenas of slots the payload lands in
//! plan     -> window, chunks, the direct/buffered decision (pure)
//! engine   -> submit -> router -> lanes -> backend (ring | pread | sync)
//!             -> completion -> ticket -> Loaded
//! place    -> a model written across drives (mirror, split, layers)
//!             behind a layout index that Model::open reads
//! load     -> whole-model loads (LoadedModel) and streams (TensorStream)
//! ```
//!
//! Nothing below imports anything above it (`ci/layers` checks it). See
//! `docs/architecture.md` for the contracts each module keeps.
//!
//! # Example
//!
//! Open a model (here a one-shard model written by hand), start an engine,
//! read a tensor into a slot of an arena, and use the payload in place:
//!
//! ```
//! use weightstream::{Engine, EngineConfig, Model, ModelConfig};
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! // A safetensors shard: 8-byte header length, JSON header, data.
//! let tmp = tempfile::tempdir()?;
//! let dir = tmp.path();
//! let header = br#"{"w":{"dtype":"U8","shape":[5000],"data_offsets":[0,5000]}}"#;
//! let mut shard = (header.len() as u64).to_le_bytes().to_vec();
//! shard.extend_from_slice(header);
//! shard.extend((0..5000u32).map(|i| (i % 251) as u8));
//! std::fs::write(dir.join("model.safetensors"), &shard)?;
//!
//! let model = Model::open(ModelConfig::new(&dir))?;
//! let engine = Engine::new(&model, EngineConfig::default())?;
//! let tensor = model.tensor("w")?;
//! let arena = engine.arena(model.slot_spec_for_largest(""), 4)?;
//! let loaded = engine.read(tensor, arena.take().unwrap())?.wait()?;
//! assert_eq!(loaded.len(), 5000);
//! assert!(loaded.iter().enumerate().all(|(i, &b)| b == (i % 251) as u8));
//! arena.give_back(loaded.into_slot());
//! # drop(engine);
//! # Ok(())
//! # }
//! ```
//!
//! The same read without threads or rings: `model.read_sync(tensor, slot)`.
//! Configuration also comes from the environment
//! ([`ModelConfig::from_env`], [`EngineConfig::from_env`], the table in
//! [`env`](mod@env)).

#![warn(missing_docs, unreachable_pub)]

#[cfg(not(target_os = "linux"))]
compile_error!("weightstream is Linux-only: it needs O_DIRECT, statx(STATX_DIOALIGN) and io_uring");

mod config;
mod engine;
mod error;
mod fork;
mod format;
pub mod layer_placement;
mod load;
mod memory;
mod model;
pub mod place;
mod plan;
mod stats;
mod storage;

pub use config::{env, BackendChoice, DirectMode, EngineConfig, IoPoll, ModelConfig, RoutePolicy, SubmitMode, Weights};
pub use engine::{DrivePlacement, Engine, Lent, LentLoaded, LentTicket, Loaded, Scratch, ShutdownReport, Ticket};
pub use error::{Error, HeaderError, Result};
pub use format::catalog::{Catalog, ShardInfo, TensorRef};
pub use format::container::{ShardHeader, TensorEntry};
pub use format::dtype::Dtype;
pub use format::element::Element;
pub use load::{
    load, load_with, LoadOptions, LoadProgress, LoadReport, LoadedModel, Order, TensorStream, TensorView,
    DEFAULT_LOAD_WINDOW, MAX_LOAD_ALIGN,
};
pub use memory::{Arena, Slot, SlotSpec};
pub use model::{CopyReport, FileVerdict, Model, VerifyReport};
pub use plan::placement::Placement;
pub use stats::{DriveStats, FallbackCause, Feature, StagedStats, Stats, Warning, WarningKind, WarningLocation};
pub use storage::files::{Change, FileIdentity};
#[cfg(feature = "numa")]
pub use storage::numa::Hwloc;
pub use storage::numa::{Locality, Provider, SingleNode, TopologyProvider};

/// Internals for the microbenchmarks, the fuzz targets and the tests that
/// check the pure cores directly. **Not a stable API**: hidden from the
/// docs, may change with any release.
#[doc(hidden)]
pub mod __internal {
    pub use crate::config::split_list;
    pub use crate::engine::internal::{cuts, hash_pick, stripe_pick, DriveLoad, Outcome, Request};
    pub use crate::engine::Fault;
    pub use crate::error::escape;
    pub use crate::format::catalog::{INDEX_FILE, MAX_INDEX_LEN};
    pub use crate::format::container::MAX_HEADER_LEN;
    pub use crate::memory::arena::round_up;
    pub use crate::plan::chunk::{count as chunk_count, on_result as chunk_on_result, split as chunk_split, Chunk};
    pub use crate::plan::window::{Window, WindowError};
    pub use crate::storage::files::{Drive, ShardFile};
    pub use crate::storage::numa::bind_thread_described;
    pub use crate::storage::open::open_direct;
    pub use crate::storage::topology::{AlignSource, FileTopology};

    /// The variables only the test suites, CI and the command's crash tests
    /// read, and the one reader of the environment.
    pub mod env {
        pub use crate::config::env::knobs::*;

        /// A variable of the environment, if set to anything but blanks
        /// (the reader behind every `from_env`, and the command's flags'
        /// fallback).
        pub fn get(k: &str) -> Option<String> {
            crate::config::env::get(k)
        }
    }

    /// The layout index of a placed model (its format, its reader, its
    /// file names), and the commit protocol's steps (the crash tests'
    /// hook): for the command, the tests and the `layout_index` fuzz target.
    pub mod place {
        pub use crate::place::internal::*;
    }

    /// Writes a one-shard model for the documentation's examples: a fresh
    /// directory under the system temporary directory (named by `tag`, the
    /// process id and the clock, and made new: never one another run left
    /// or uses) holding `model.safetensors` with `tensors` (name, dtype,
    /// payload bytes) back to back, byte `i` of each payload being
    /// `i % 251`. Returns the directory.
    pub fn doc_model(tag: &str, tensors: &[(&str, crate::Dtype, usize)]) -> std::io::Result<std::path::PathBuf> {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos());
        let mut n = 0u32;
        let dir = loop {
            let dir = std::env::temp_dir().join(format!("weightstream-doc-{tag}-{}-{nanos}-{n}", std::process::id()));
            match std::fs::create_dir(&dir) {
                Ok(()) => break dir,
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists && n < 1000 => n += 1,
                Err(e) => return Err(e),
            }
        };
        let (mut at, mut entries) = (0usize, serde_json::Map::new());
        for &(name, dtype, len) in tensors {
            let elem = crate::load::element_align(dtype);
            entries.insert(
                name.to_string(),
                serde_json::json!({"dtype": dtype.name(), "shape": [len / elem], "data_offsets": [at, at + len]}),
            );
            at += len;
        }
        let header = serde_json::Value::Object(entries).to_string();
        let mut shard = (header.len() as u64).to_le_bytes().to_vec();
        shard.extend_from_slice(header.as_bytes());
        for &(_, _, len) in tensors {
            shard.extend((0..len).map(|i| (i % 251) as u8));
        }
        std::fs::write(dir.join("model.safetensors"), &shard)?;
        Ok(dir)
    }
}

/// The README's Rust example, compiled (not run) with the doctests, so the
/// front page cannot drift from the API.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeExample;
