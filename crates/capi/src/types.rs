//! The C types: handles, option structs, what a read names and returns.
//! Every struct is `repr(C)` with fixed-width fields; no field is a C enum
//! (its size depends on the compiler's flags), so enum-like fields are
//! `uint32_t` with `WS_` constants.

use std::ffi::{c_char, c_int};

/// An open model (the shards' headers, read and checked). Zero is no model.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ws_model {
    pub id: u64,
}

/// An engine: one I/O thread (or ring) per drive. Zero is no engine.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ws_engine {
    pub id: u64,
}

/// Memory an engine reads into: the caller's (`ws_memory_register`) or the
/// engine's (`ws_arena_create`, `ws_arena_create_slots`). Zero is none.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ws_memory {
    pub id: u64,
}

/// One read in flight, or done and not yet collected (or held). Zero is
/// none.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ws_ticket {
    pub id: u64,
}

/// Layout settings of a model (`ModelConfig`). Every string may be NULL
/// (the default); lists are `;`- or `,`-separated, as in the environment.
/// Start from `ws_model_options_default()`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct ws_model_options {
    /// `sizeof(ws_model_options)` as the caller compiled it (read first,
    /// before the rest).
    pub struct_size: u32,
    /// Extra directories searched for shards after the primary (split dirs).
    pub dirs: *const c_char,
    /// Mirror directories holding copies of any subset of the shards.
    pub mirrors: *const c_char,
    /// Read weights per copy, primary first: "equal", "probe" or "3,1".
    pub weights: *const c_char,
    /// "hash", "stripe" or "adaptive".
    pub route: *const c_char,
    /// O_DIRECT: "auto", "on" or "off".
    pub direct: *const c_char,
}

/// `ws_engine_options.numa`: the default (on).
pub const WS_NUMA_DEFAULT: i32 = 0;
/// `ws_engine_options.numa`: bind each drive's I/O threads to its node.
pub const WS_NUMA_ON: i32 = 1;
/// `ws_engine_options.numa`: no placement.
pub const WS_NUMA_OFF: i32 = 2;

/// Engine settings (`EngineConfig`). A zero or NULL field is the default,
/// so a zeroed struct with `struct_size` set is all defaults. Start from
/// `ws_engine_options_default()`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct ws_engine_options {
    /// `sizeof(ws_engine_options)` as the caller compiled it (read first,
    /// before the rest).
    pub struct_size: u32,
    /// "auto" (io_uring, else pread), "uring" or "pread"; NULL: auto.
    pub backend: *const c_char,
    /// Chunks in flight per drive (1 to 4096); 0: the default (32).
    pub queue_depth: u32,
    /// Largest chunk in bytes (a multiple of 4096, 4 KiB to 1 GiB); 0: the
    /// drive's own.
    pub chunk_bytes: u64,
    /// `WS_NUMA_DEFAULT` (0), `WS_NUMA_ON` or `WS_NUMA_OFF`.
    pub numa: i32,
    /// "auto", "inline", "async" or "rings:N"; NULL: auto.
    pub submit: *const c_char,
}

/// One tensor. The pointers stay valid while the model is open, or while an
/// engine made from it is.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct ws_tensor_info {
    /// The tensor's index in the model (name order): what reads take.
    pub index: usize,
    /// NUL-terminated name.
    pub name: *const c_char,
    /// NUL-terminated safetensors dtype ("BF16", "F32", ...).
    pub dtype: *const c_char,
    /// `ndim` dimensions, in elements.
    pub shape: *const u64,
    pub ndim: u32,
    /// Payload bytes.
    pub bytes: u64,
    /// Index of the shard file holding it.
    pub shard: u32,
    /// Absolute offset of the payload in that file.
    pub file_offset: u64,
}

/// Where a payload landed and what was read.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct ws_read_result {
    /// The payload's first byte, as an offset from the start of the memory.
    pub offset: usize,
    /// Payload bytes read.
    pub bytes: u64,
    /// The payload's first byte. A held read's bytes (`WS_READ_HOLD`,
    /// `ws_read_any`) stay reserved until `ws_ticket_free`. Any other read's
    /// bytes are the caller's to use once collected. The engine may place a
    /// later `ws_read_any` over them, so in memory where `ws_read_any` is
    /// used, hold every read whose bytes are still needed.
    pub data: *mut std::ffi::c_void,
}

/// `ws_read.scratch`: exactly the payload's bytes are written. In phase
/// and block-aligned: in place, O_DIRECT; otherwise through the engine's
/// staging memory and one copy.
pub const WS_SCRATCH_NONE: u32 = 0;
/// `ws_read.scratch`: the `file_offset % align` bytes before the payload
/// may be overwritten (the in-place window of engines that read
/// `[off - off % align, ...)` into `buf - off % align`): in phase, every
/// whole block is read in place O_DIRECT, the tail buffered.
pub const WS_SCRATCH_BEFORE: u32 = 1;
/// `ws_read.scratch`: the payload's whole blocks may be overwritten, before
/// and after it: in phase, every block is read in place O_DIRECT.
pub const WS_SCRATCH_BLOCKS: u32 = 2;

/// `ws_read.flags`: the read must land in place, never through staging:
/// out of phase (or a scratch that does not allow it there) is
/// `WS_ERR_MISALIGNED`, an in-place window overlapping bytes in use is
/// `WS_ERR_BUSY`. (A file that refuses O_DIRECT is read buffered into
/// place, counted in the stats as a fallback.)
pub const WS_READ_IN_PLACE: u32 = 1;

/// `ws_read.flags`: after the read completes, its bytes stay reserved (a
/// read onto them is `WS_ERR_BUSY`) until `ws_ticket_free`; poll and wait
/// return the result without spending the ticket. What `ws_read_any`
/// always does.
pub const WS_READ_HOLD: u32 = 2;

/// One read.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct ws_read {
    /// The tensor's index (`ws_tensor_info.index`).
    pub tensor: usize,
    /// Bytes `[start, end)` of the payload; `start == end == 0`: all of it.
    pub start: u64,
    pub end: u64,
    /// Where the payload's first byte lands: an offset into the memory
    /// (`ws_read_into`; 0 for `ws_read_any`).
    pub at: usize,
    /// `WS_SCRATCH_NONE`, `WS_SCRATCH_BEFORE` or `WS_SCRATCH_BLOCKS`.
    pub scratch: u32,
    /// `WS_READ_IN_PLACE`, `WS_READ_HOLD`, both or 0.
    pub flags: u32,
}

/// A range `[start, end)` of one dimension of a tensor (`ws_read_slice`).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct ws_range {
    pub start: u64,
    pub end: u64,
}

/// What a slice is (`ws_slice_size`): its bytes, and how it would be read.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct ws_slice_info {
    /// The slice's bytes, compact and row-major (what lands in memory).
    pub bytes: u64,
    /// Bytes of whole blocks its pieces span (what the drives move).
    pub read_bytes: u64,
    /// Runs of contiguous bytes (one per row of a column slice; 1 for rows).
    pub runs: u64,
    /// Reads it is split into (runs merged across gaps of at most 32 KiB).
    pub pieces: u64,
}

/// What a shutdown did.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct ws_shutdown_report {
    /// 1: every I/O thread finished; nothing is in flight.
    pub drained: c_int,
    /// Drives whose I/O threads did not finish in time (detached: they keep
    /// the memory the kernel may write until its reads complete).
    pub drives_left: u32,
    /// Chunks still in flight on those drives.
    pub chunks_left: u64,
}

/// A summary of an engine's counters (`ws_engine_stats_json` has them all).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct ws_stats {
    pub bytes: u64,
    pub reads_direct: u64,
    pub reads_buffered: u64,
    /// Every fallback, by any cause (the JSON has them by cause and drive).
    pub fallbacks: u64,
    /// Reads that landed in staging and were copied into place.
    pub staged_reads: u64,
    pub staged_bytes: u64,
    /// Slices read (`ws_read_slice`), the bytes they held, and the bytes of
    /// whole blocks their pieces spanned (what the drives moved).
    pub slice_reads: u64,
    pub slice_bytes_wanted: u64,
    pub slice_bytes_read: u64,
    pub drives: u32,
    /// Warnings the engine has (the JSON has their text).
    pub warnings: u32,
}

/// An expert cache (`ws_expert_cache_create`). Zero is none.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ws_expert_cache {
    pub id: u64,
}

/// A cached expert, pinned (never evicted, never overwritten) until
/// `ws_expert_release`; its bytes stay valid until then, even after the
/// cache is destroyed. Zero is none.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ws_expert {
    pub id: u64,
}

/// `ws_expert_cache_options.policy`: exact LRU over unpinned experts.
pub const WS_CACHE_LRU: u32 = 0;
/// `ws_expert_cache_options.policy`: LFU with aging (counts halved every
/// `capacity` gets; ties to the least recently used).
pub const WS_CACHE_LFU: u32 = 1;

/// Expert cache settings. Exactly one of `capacity_experts` and
/// `budget_bytes` is non-zero. Start from `ws_expert_cache_options_default()`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct ws_expert_cache_options {
    /// `sizeof(ws_expert_cache_options)` as the caller compiled it.
    pub struct_size: u32,
    /// `WS_CACHE_LRU` (0) or `WS_CACHE_LFU`.
    pub policy: u32,
    /// Whole experts the cache holds.
    pub capacity_experts: u64,
    /// Or: bytes of slot memory (as many whole experts as fit).
    pub budget_bytes: u64,
}

/// One part of a cached expert: its projection (`gate_proj`), its part
/// (`weight`, `bias`, `weight_scale`, ...), the tensor's name in the
/// model, and its payload in place. Strings and bytes live as long as the
/// `ws_expert` they came with.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct ws_expert_part {
    pub projection: *const c_char,
    pub part: *const c_char,
    pub tensor: *const c_char,
    pub data: *const u8,
    pub bytes: u64,
}

/// Which expert: a layer and a routed expert's number.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ws_expert_key {
    pub layer: u32,
    pub expert: u32,
}

/// What `ws_expert_cache_prefetch` did: reads started, experts already
/// present, and experts refused (every entry pinned or in flight: the
/// call never waits).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ws_prefetch_report {
    pub started: u64,
    pub present: u64,
    pub refused: u64,
}

/// An expert cache's counters (`ws_expert_cache_stats`; the JSON form has
/// the bytes per drive too).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct ws_cache_stats {
    pub capacity: u64,
    pub entry_bytes: u64,
    pub entries: u64,
    pub pinned: u64,
    pub hits: u64,
    pub misses: u64,
    pub prefetched: u64,
    pub prefetch_used: u64,
    pub prefetch_wasted: u64,
    pub prefetch_wasted_bytes: u64,
    pub prefetch_refused: u64,
    pub evictions: u64,
    pub failed_reads: u64,
    pub bytes_read: u64,
    pub wait_seconds: f64,
}
