//! weightstream: stream model weights from `.safetensors` shards on NVMe
//! straight into the memory slots an engine computes from.
//!
//! The data flow, and the modules that own each step:
//!
//! ```text
//! model dir -> container (one shard's header, validated)
//!           -> catalog   (tensor name -> shard, file range)
//!           -> model     (open files: O_DIRECT + buffered, drives, stats)
//!           -> window    (pure alignment / EOF-clamp arithmetic)
//!           -> direct    (the in-place range read with counted fallbacks)
//!           -> arena     (page-aligned slots the payload lands in)
//! ```
//!
//! See `docs/architecture.md` for the contracts each module keeps.

#[cfg(not(target_os = "linux"))]
compile_error!("weightstream is Linux-only: it needs O_DIRECT, statx(STATX_DIOALIGN) and io_uring");

pub mod arena;
pub mod catalog;
mod chunk;
pub mod container;
pub mod direct;
pub mod dtype;
pub mod engine;
pub mod error;
mod fork;
mod inflight;
pub mod layout;
pub mod model;
pub mod numa;
mod pread;
mod probe;
mod queue;
mod ring;
pub mod route;
pub mod stats;
pub mod stripe;
mod sync;
pub mod topology;
pub mod window;

pub use arena::{Arena, Slot, SlotSpec};
pub use catalog::{Catalog, TensorRef};
pub use direct::{DirectMode, Loaded};
pub use dtype::Dtype;
pub use engine::{BackendChoice, DrivePlacement, Engine, EngineConfig, IoPoll, ShutdownReport, SubmitMode, Ticket};
pub use error::{Error, Result};
pub use layout::{escape, ModelConfig, RoutePolicy, Weights};
pub use model::open_direct;
pub use topology::FileTopology;
pub use model::{Model, VerifyReport};
pub use stats::{FallbackCause, Stats};

/// Internals exposed only for the microbenchmarks in `benches/` (not a
/// stable API: hidden from the docs, may change with any release).
#[doc(hidden)]
pub mod __bench {
    pub use crate::chunk::{count as chunk_count, on_result as chunk_on_result, split as chunk_split, Chunk};
    pub use crate::inflight::{Credits, Outcome, Request};
    pub use crate::route::DriveLoad;
}
