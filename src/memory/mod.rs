//! The memory payloads land in: page-aligned arenas carved into slots
//! (scratch before the payload so the O_DIRECT window starts at the slot
//! base), `MADV_DONTFORK`, optionally bound to a NUMA node.

pub(crate) mod arena;
pub(crate) mod carve;
pub(crate) mod limits;
pub(crate) mod region;

pub use crate::error::TakeError;
pub(crate) use arena::SlotRange;
pub use arena::{Arena, Slot, SlotSpec};
pub(crate) use region::{dontfork_failures, hugepage_refusals, inherit_failures, reprotect_leaks};
