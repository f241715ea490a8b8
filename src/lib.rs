//! weightstream: stream model weights from `.safetensors` shards on NVMe
//! straight into the memory an engine computes from. io_uring and O_DIRECT
//! land each payload in place (no page cache, no copy after the read), one
//! ring per drive, every read spread over the copies of its shard. Linux
//! only.
//!
//! # Which call for which job
//!
//! | the job | the calls | what comes back |
//! |---|---|---|
//! | **Load a whole model at start-up** | [`load`]`(dir)`, or [`load_with`]`(dir, &opts)`; with mirrors, your own settings or your engine: [`Engine::load_all`] with [`LoadOptions`] (which tensors, alignment, order, progress) | a [`LoadedModel`]: one mapping, a [`TensorView`] per name, each payload aligned for its dtype; its [`LoadReport`] and [`warnings`](LoadedModel::warnings) |
//! | **Stream tensors towards a GPU** | [`Engine::stream`]`(tensors, budget)` -> [`TensorStream`] (an `Iterator`; a `futures_core::Stream` with the `futures` feature) | each tensor as a [`Loaded`] as soon as it lands, in a staging budget you set: copy it to the device, drop it, its memory takes the next read |
//! | **Read experts step after step** | [`Engine::packed_arena`] once; each step [`Arena::take_for`] per chosen expert and one [`Engine::read_batch`] -> [`Ticket`]s (the decode loop: [`Engine`]). A layer's experts by number: [`Model::experts`] (`.layer(l)?.expert(e)?.tensors()`: exactly the expert's bytes; per-expert, shared and fused layouts); sized for `n` steps in flight: [`Engine::packed_arena_for`] | each expert as a [`Loaded`] in a slot of your arena, in place; dropping it frees the slot for the next step |
//! | **Read into memory you own** | [`Engine::lend`] (a `&mut [u8]` for the length of a closure: safe; sized with [`Engine::placement_bytes`]) with [`Lent::placement`], [`Lent::read_into`] / [`Lent::read_anywhere`]; raw memory (a GPU runtime's pinned host buffer, a C engine's): `unsafe` [`Engine::register_memory`], then [`Engine::placement`], [`Engine::read_into`] / [`Engine::read_anywhere`] | payloads at your offsets. An address in phase with the file offset (as [`Engine::placement`] lays out) is read in place O_DIRECT; any other goes O_DIRECT through the engine's staging and one copy (see [`Engine::read_into`]; counted in [`Stats::staged`]) |
//! | **Check a model on disk** | [`Model::verify`]`(digest)` -> [`VerifyReport`]; [`VerifyReport::compare_with`] a report saved before | every copy re-checked: the file's identity, its header, with `digest` every tensor's sha256; each [`Change`] named |
//! | **See what cost speed** | [`Engine::warnings`], [`Model::warnings`], [`LoadedModel::warnings`]; `{}` of [`Stats`] ([`Engine::stats`]) | [`Warning`]s, worst first: what fell back (buffered reads, staging, the pread backend, memory not registered, NUMA), where, how often, the fix and the cost; empty when nothing did |
//!
//! Setting things up: [`Model::open`] with a [`ModelConfig`] (split
//! directories, mirrors, read weights, route policy, O_DIRECT mode), then
//! [`Engine::new`] with an [`EngineConfig`] (backend, queue depth, chunk
//! size, polling, NUMA placement and its [`TopologyProvider`]). Both also
//! come from the environment ([`ModelConfig::from_env`],
//! [`EngineConfig::from_env`]; the variables are in [`env`](mod@env)).
//! A model written across drives (mirror, split, one file per layer) is
//! [`place::place`]'s job, and [`Model::open`] of its primary folder reads
//! it back. Errors are one [`Error`] type naming the file or tensor, the
//! operation and the cause.
//!
//! # Examples
//!
//! A whole model at start-up: one call, then the tensors by name.
//!
//! ```
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! # use weightstream::Dtype;
//! # let dir = weightstream::__internal::doc_model("front-load", &[("embed", Dtype::Bf16, 8192), ("norm", Dtype::F32, 64)])?;
//! let model = weightstream::load(&dir)?;
//! let embed = model.get("embed").expect("in the model");
//! assert_eq!((embed.dtype(), embed.shape(), embed.len()), (Dtype::Bf16, &[4096][..], 8192));
//! let norm: &[f32] = model.get("norm").unwrap().as_slice()?; // typed, aligned
//! assert_eq!(norm.len(), 16);
//! assert!(model.warnings().iter().all(|w| !w.to_string().is_empty()));
//! # drop(model);
//! # std::fs::remove_dir_all(&dir)?;
//! # Ok(())
//! # }
//! ```
//!
//! A decode step: the experts the router chose, read with one batch into
//! one packed arena and used in place.
//!
//! ```
//! use weightstream::{Dtype, Engine, EngineConfig, Model, ModelConfig};
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! # let spec: Vec<(String, Dtype, usize)> = (0..4).map(|e| (format!("layers.0.experts.{e}.w"), Dtype::Bf16, 12_000)).collect();
//! # let spec: Vec<(&str, Dtype, usize)> = spec.iter().map(|(n, d, l)| (n.as_str(), *d, *l)).collect();
//! # let dir = weightstream::__internal::doc_model("front-step", &spec)?;
//! let model = Model::open(ModelConfig::new(&dir))?;
//! let engine = Engine::new(&model, EngineConfig::default())?;
//! let arena = engine.packed_arena(1 << 20, true)?;
//! let chosen = [model.tensor("layers.0.experts.1.w")?, model.tensor("layers.0.experts.3.w")?];
//! let reads = chosen.map(|t| (t, arena.take_for(t).expect("room for one step")));
//! for ticket in engine.read_batch(reads)? {
//!     let expert = ticket.wait()?;
//!     assert_eq!(expert.len(), 12_000); // ... compute with &expert[..] ...
//! } // each expert drops here: its slot takes the next step's reads
//! # drop(engine);
//! # std::fs::remove_dir_all(&dir)?;
//! # Ok(())
//! # }
//! ```
//!
//! One tensor into a slot of an arena (here a one-shard model written by
//! hand), the payload used in place:
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
//! let arena = engine.arena(model.slot_spec_for_largest("")?, 4)?;
//! let loaded = engine.read(tensor, arena.take()?)?.wait()?; // or a TakeError: why no slot
//! assert_eq!(loaded.len(), 5000);
//! assert!(loaded.iter().enumerate().all(|(i, &b)| b == (i % 251) as u8));
//! arena.give_back(loaded.into_slot());
//! # drop(engine);
//! # Ok(())
//! # }
//! ```
//!
//! The same read without threads or rings: `model.read_sync(tensor, slot)`.
//! More, each a program: `examples/` (a decode loop, whole-model loads and
//! streams, tokio, caller memory, layers striped over drives).
//!
//! # Features
//!
//! `numa` (default): NUMA placement through hwloc (needs libhwloc-dev,
//! libudev-dev, pkg-config); without it every drive's locality is unknown.
//! `half`: typed views of F16 / BF16 as `half::f16` / `half::bf16`.
//! `futures`: [`TensorStream`] as a `futures_core::Stream`. None pulls a
//! runtime.
//!
//! # Inside
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
//! load     -> whole-model loads (LoadedModel, load) and streams (TensorStream)
//! ```
//!
//! Nothing below imports anything above it (`ci/layers` checks it). See
//! `docs/contracts.md` for the contracts each module keeps.
//!
//! Everything public here is the API. The hidden `__internal` module (the
//! command, the tests, the fuzz targets and the benches use it: test
//! knobs, fault injection, the layout index, file-level helpers) is **not
//! a stable API** and may change with any release.

#![warn(missing_docs, unreachable_pub)]

#[cfg(not(target_os = "linux"))]
compile_error!("weightstream is Linux-only: it needs O_DIRECT, statx(STATX_DIOALIGN) and io_uring");

mod cache;
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

pub use cache::{
    simulate_lru, CacheConfig, CacheStats, Capacity, ExpertCache, ExpertHandle, ExpertKey, Policy, PrefetchReport,
};
pub use config::{
    env, BackendChoice, DirectMode, EngineConfig, IoPoll, ModelConfig, RoutePolicy, SubmitMode, Weights,
    DEFAULT_SLICE_STAGING,
};
pub use engine::{
    DrivePlacement, Engine, FillOptions, FillReport, FillTarget, Lent, LentLoaded, LentTicket, Loaded, Scratch,
    ShutdownReport, SliceTicket, Ticket, DEFAULT_FILL_STAGING, FILL_COPY_THREADS_LIMIT, MAX_FILL_COPY_THREADS,
    SLICE_PIECE_BYTES,
};
pub use error::{CacheError, Error, ExpertsError, HeaderError, Result, SUGGESTIONS};
pub use format::catalog::{Catalog, ShardInfo, TensorRef};
pub use format::container::{ShardHeader, TensorEntry};
pub use format::dtype::Dtype;
pub use format::element::Element;
pub use format::experts::{Expert, ExpertLayer, Experts, Projection, MAX_FUSED_EXPERTS};
pub use format::slice::{Piece, Run, SlicePlan, TensorSlice, MAX_SLICE_RUNS, SLICE_GAP_BYTES};
pub use load::{
    load, load_with, LoadOptions, LoadProgress, LoadReport, LoadedModel, Order, TensorStream, TensorView,
    DEFAULT_LOAD_WINDOW, MAX_FAULT_AHEAD_THREADS, MAX_LOAD_ALIGN,
};
pub use memory::{Arena, Slot, SlotSpec, TakeError};
pub use model::{CopyReport, FileVerdict, Model, VerifyReport};
pub use plan::placement::Placement;
pub use stats::{
    DriveStats, FallbackCause, Feature, SliceStats, StagedStats, Stats, Warning, WarningKind, WarningLocation,
};
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
