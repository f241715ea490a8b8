//! Where the bytes are: opening shard files (and refusing what is not a
//! regular file), what each opened copy is (identity, O_DIRECT descriptor,
//! volume), what the kernel says about its volume (topology: DIOALIGN,
//! device, mount), and which NUMA node a drive sits on.

pub(crate) mod files;
pub(crate) mod numa;
pub(crate) mod open;
pub(crate) mod topology;
