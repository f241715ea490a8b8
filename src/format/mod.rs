//! The safetensors container: one shard's header (validated without reading
//! the data), the dtypes, and the catalog of a model's tensors.

pub(crate) mod catalog;
pub(crate) mod container;
pub(crate) mod dtype;
pub(crate) mod element;
pub(crate) mod experts;
pub(crate) mod slice;
