//! What the caller asks for: how to open a model ([`ModelConfig`]: the
//! directories, mirrors, weights, route policy, O_DIRECT mode) and how to
//! run an engine ([`EngineConfig`]), from builders or from the one table of
//! `WEIGHTSTREAM_*` variables ([`env`]).

pub(crate) mod engine;
pub mod env;
pub(crate) mod model;

pub use engine::{BackendChoice, EngineConfig, IoPoll, SubmitMode};
pub(crate) use model::MAX_COPY_RANKS;
pub use model::{split_list, DirectMode, ModelConfig, RoutePolicy, Weights};
