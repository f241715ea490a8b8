//! Counters per drive, read lock-free on the hot path, and the rule that no
//! fallback is silent: each is counted by cause and logged once per drive and
//! cause, naming the drive and the file.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::OnceLock;

use serde::Serialize;

mod display;
pub(crate) mod warning;

pub use warning::{Warning, WarningKind, WarningLocation};

/// Why a read (or part of one) went buffered instead of O_DIRECT.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum FallbackCause {
    /// The filesystem refused `open(O_DIRECT)` (or statx says no direct I/O).
    DirectOpenRefused,
    /// The slot's base address does not meet the file's memory alignment.
    SlotMisaligned,
    /// The slot reserves less alignment than the file's offsets need.
    SlotAlignTooSmall,
    /// The payload holds no whole aligned block: nothing to read direct.
    NoBulk,
    /// The device answered EINVAL to an O_DIRECT read at run time.
    DeviceEinval,
    /// An O_DIRECT read came back short; the range was re-read buffered.
    ShortDirect,
    /// An O_DIRECT read failed with another errno; re-read buffered.
    DirectError,
    /// The caller placed the payload (`Engine::read_into`) where no O_DIRECT
    /// window fits before it (scratch taken by another slot, or the address
    /// off the files' alignment): read buffered straight into place.
    Placed,
}

impl FallbackCause {
    /// Every cause, in counter order.
    pub const ALL: [FallbackCause; 8] = [
        FallbackCause::DirectOpenRefused,
        FallbackCause::SlotMisaligned,
        FallbackCause::SlotAlignTooSmall,
        FallbackCause::NoBulk,
        FallbackCause::DeviceEinval,
        FallbackCause::ShortDirect,
        FallbackCause::DirectError,
        FallbackCause::Placed,
    ];

    /// The cause's name in the stats (`direct_open_refused`, ...).
    pub fn name(self) -> &'static str {
        match self {
            FallbackCause::DirectOpenRefused => "direct_open_refused",
            FallbackCause::SlotMisaligned => "slot_misaligned",
            FallbackCause::SlotAlignTooSmall => "slot_align_too_small",
            FallbackCause::NoBulk => "no_bulk",
            FallbackCause::DeviceEinval => "device_einval",
            FallbackCause::ShortDirect => "short_direct",
            FallbackCause::DirectError => "direct_error",
            FallbackCause::Placed => "placed",
        }
    }

    /// `NoBulk` (sub-block tensors) and `Placed` (the caller's choice of
    /// address) are expected paths: counted, but not worth a warning.
    fn is_warning(self) -> bool {
        !matches!(self, FallbackCause::NoBulk | FallbackCause::Placed)
    }
}

const N_CAUSES: usize = FallbackCause::ALL.len();

/// Live counters of one drive.
#[derive(Debug, Default)]
pub(crate) struct DriveCounters {
    pub(crate) bytes: AtomicU64,
    pub(crate) bytes_direct: AtomicU64,
    pub(crate) bytes_buffered: AtomicU64,
    pub(crate) reads_direct: AtomicU64,
    pub(crate) reads_buffered: AtomicU64,
    /// Most chunks in flight at once on this drive.
    pub(crate) inflight_max: AtomicU64,
    /// Chunks that landed.
    pub(crate) chunks: AtomicU64,
    /// Chunks that failed on a copy here and moved to another copy.
    pub(crate) failovers: AtomicU64,
    /// Chunks issued as plain reads because their slot's arena is not
    /// registered with the ring (every cause).
    pub(crate) chunks_unregistered: AtomicU64,
    /// Of those, chunks into arenas nobody asked the engine to register
    /// (a whole-model load's own mapping, `Arena::new`, `Arena::packed`):
    /// a choice, not a fallback.
    pub(crate) chunks_unregistered_arena: AtomicU64,
    /// Payload bytes read from this drive into a slot whose arena is bound
    /// to another NUMA node (both nodes known).
    pub(crate) cross_node_bytes: AtomicU64,
    /// Chunks given up while the kernel still held them (the drive's I/O
    /// thread stopped): their slots are leaked, never reused.
    pub(crate) chunks_abandoned: AtomicU64,
    fallbacks: [AtomicU64; N_CAUSES],
    logged: [AtomicBool; N_CAUSES],
    /// The first fallback of each cause: its file and detail (for
    /// [`Warning`]s: the log line reaches only a subscriber).
    first: [OnceLock<(PathBuf, String)>; N_CAUSES],
    /// The first failover from a copy on this drive: what failed, and where
    /// the chunk went.
    pub(crate) first_failover: OnceLock<String>,
}

impl DriveCounters {
    /// Counts a fallback and logs it the first time this drive sees `cause`.
    pub(crate) fn fallback(&self, drive: &str, file: &Path, cause: FallbackCause, detail: &dyn std::fmt::Display) {
        let i = cause as usize;
        self.fallbacks[i].fetch_add(1, Relaxed);
        if !self.logged[i].swap(true, Relaxed) {
            let _ = self.first[i].set((file.to_path_buf(), detail.to_string()));
            if cause.is_warning() {
                tracing::warn!(drive, file = %file.display(), cause = cause.name(), "falling back to buffered reads: {detail} (logged once per drive and cause; counted in stats)");
            } else {
                tracing::info!(drive, file = %file.display(), cause = cause.name(), "buffered read: {detail} (logged once per drive and cause; counted in stats)");
            }
        }
    }

    pub(crate) fn fallback_count(&self, cause: FallbackCause) -> u64 {
        self.fallbacks[cause as usize].load(Relaxed)
    }

    /// The file and detail of the first fallback of `cause` here, if any.
    pub(crate) fn first_fallback(&self, cause: FallbackCause) -> Option<&(PathBuf, String)> {
        self.first[cause as usize].get()
    }

    pub(crate) fn add(counter: &AtomicU64, n: u64) {
        counter.fetch_add(n, Relaxed);
    }
}

/// A snapshot of one drive's counters.
#[derive(Debug, Clone, Serialize)]
pub struct DriveStats {
    /// The drive's device name (`nvme0n1`, `vda`, `loop3`).
    pub device: String,
    /// Its mount point.
    pub mount: PathBuf,
    /// Its filesystem type.
    pub fs_type: String,
    /// The largest O_DIRECT offset alignment of its files.
    pub dio_align: u32,
    /// Whether every file on it opened O_DIRECT.
    pub direct_open: bool,
    /// Payload bytes read from it.
    pub bytes: u64,
    /// ... of which O_DIRECT.
    pub bytes_direct: u64,
    /// ... of which buffered.
    pub bytes_buffered: u64,
    /// Reads that used O_DIRECT on this drive (counted once per read and drive).
    pub reads_direct: u64,
    /// Reads that went wholly buffered on this drive.
    pub reads_buffered: u64,
    /// Fallbacks to buffered reads, by cause name (only causes seen).
    pub fallbacks: BTreeMap<&'static str, u64>,
    /// Most chunks in flight at once.
    pub inflight_max: u64,
    /// Chunks issued as plain reads because their arena is not registered
    /// (every cause).
    pub chunks_unregistered: u64,
    /// Of those, chunks into arenas nobody asked the engine to register
    /// (a whole-model load's own mapping, `Arena::new`, `Arena::packed`:
    /// memory read into once, where pinning it for the ring would cost
    /// more than it saves). Not a fallback, not warned; the rest are.
    #[serde(default)]
    pub chunks_unregistered_arena: u64,
    /// Chunks that landed.
    pub chunks: u64,
    /// Chunks that failed here and moved to another copy.
    pub failovers: u64,
    /// This drive's share of all payload bytes read.
    pub share: f64,
    /// Measured throughput (busy time), GB/s; engines only.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub throughput_gbps: Option<f64>,
    /// The ring's setup (flags, fixed files), for the io_uring backend.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ring: Option<String>,
    /// The drive's NUMA node; null when unknown (see `numa_note`).
    pub numa_node: Option<usize>,
    /// CPUs local to the drive (list syntax), when known.
    pub cpuset: Option<String>,
    /// Which topology provider answered (engines only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub numa_source: Option<&'static str>,
    /// Why the node is unknown, or what was noticed.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub numa_note: Option<String>,
    /// What the drive's I/O thread(s) are bound to (`cpuset 0-3`, `would
    /// bind ...` for an XML topology, `not bound: ...`); engines only.
    pub thread_binding: Option<String>,
    /// Payload bytes landed in a slot on another NUMA node than this drive's.
    pub cross_node_bytes: u64,
    /// Chunks given up while the kernel still held them (their slots leaked).
    pub chunks_abandoned: u64,
    /// Chunks the drive's I/O threads hold right now (a gauge; engines only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub in_flight: Option<u64>,
    /// How the drive's reads are issued: `inline` (by the ring thread),
    /// `async` (punted to io-wq workers) or `pread` (pread workers chosen
    /// for a drive that completes reads inline); io_uring engines only.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub submit: Option<&'static str>,
    /// Ring threads issuing the drive's reads (io_uring engines).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub rings: Option<u32>,
    /// Pread workers reading the drive instead of rings (`submit` is
    /// `pread`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pread_workers: Option<u32>,
    /// Why (the probe's figures, or the configuration).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub submit_reason: Option<String>,
    /// io-wq's bounded-worker limit on the ring, when reads are punted.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub iowq_max_workers: Option<u32>,
    /// Why the drive takes no more work (its I/O thread stopped); engines only.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub stopped: Option<String>,
}

/// Whether an optional kernel feature is in use, and why not.
#[derive(Debug, Clone, Serialize)]
pub struct Feature {
    /// Whether the feature is in use.
    pub enabled: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    /// Why not.
    pub reason: Option<String>,
}

/// Reads into caller memory at an address out of phase with the file
/// offset (`Engine::read_into`): their blocks went O_DIRECT into the
/// engine's staging memory and one copy moved each payload into place.
#[derive(Debug, Clone, Default, Serialize)]
pub struct StagedStats {
    /// Reads staged and copied.
    pub reads: u64,
    /// Payload bytes copied.
    pub bytes: u64,
    /// CPU time of the copies (the waiting threads'), nanoseconds.
    pub copy_cpu_ns: u64,
    /// Bytes of staging memory the engine has mapped now (registered like
    /// any arena; slices give back what is idle when they resolve).
    pub staging_bytes: u64,
    /// The most bytes of staging mapped at once.
    pub staging_peak_bytes: u64,
}

/// Slice reads (`Engine::read_slice`): what was wanted against what the
/// drives moved for it.
#[derive(Debug, Clone, Copy, Default, Serialize, PartialEq, Eq)]
pub struct SliceStats {
    /// Slices read.
    pub reads: u64,
    /// Pieces they were read as (per-run reads, or runs merged across
    /// short gaps).
    pub pieces: u64,
    /// Runs (one per row of a column slice) they held.
    pub runs: u64,
    /// The slices' bytes.
    pub bytes_wanted: u64,
    /// Bytes of whole blocks the pieces span: what the drives move.
    pub bytes_read: u64,
    /// Slices whose pieces needed more staging than
    /// `EngineConfig::slice_staging`: read through that window, the
    /// submitting call waiting for earlier pieces.
    pub windowed: u64,
}

impl SliceStats {
    /// Bytes read per byte wanted (`None` before any slice).
    pub fn read_amplification(&self) -> Option<f64> {
        (self.bytes_wanted > 0).then(|| self.bytes_read as f64 / self.bytes_wanted as f64)
    }
}

impl StagedStats {
    /// CPU seconds the copies cost per GB (10^9 bytes) copied.
    pub fn copy_cpu_s_per_gb(&self) -> Option<f64> {
        (self.bytes > 0).then(|| self.copy_cpu_ns as f64 / self.bytes as f64)
    }
}

/// A snapshot of a model's counters.
#[derive(Debug, Clone, Serialize)]
pub struct Stats {
    /// The backend: `sync`, `uring` or `pread`.
    pub backend: &'static str,
    /// Read weight of each copy rank (primary, mirror 1, ...).
    pub rank_weights: Vec<f64>,
    /// Why the weights are not what was asked for (a failed probe).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub weights_note: Option<String>,
    /// Arena mappings of this process whose `madvise(MADV_DONTFORK)` was
    /// refused: `fork()` copies them (warned once).
    pub arena_dontfork_failures: u64,
    /// Payloads handed over to forked children whose `madvise(MADV_DOFORK)`
    /// was refused (`Loaded::inherit_on_fork`, a whole-model load's
    /// mapping): a child does not have them (warned once).
    pub arena_inherit_failures: u64,
    /// Slots handed to forked children that could not be fork-protected
    /// again (`madvise(MADV_DONTFORK)` refused) when they came back: kept
    /// out of use for their arena's life (warned once).
    pub arena_reprotect_leaks: u64,
    /// Why this backend (when it was not the first choice).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub backend_reason: Option<String>,
    /// Payload bytes read, all drives.
    pub bytes: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    /// Whether the rings use fixed files (io_uring engines).
    pub fixed_files: Option<Feature>,
    #[serde(skip_serializing_if = "Option::is_none")]
    /// Whether arenas are registered as fixed buffers (engines).
    pub registered_buffers: Option<Feature>,
    /// Per drive.
    pub drives: Vec<DriveStats>,
    /// Reads into caller memory staged and copied (engines only).
    pub staged: StagedStats,
    /// Slice reads: bytes wanted against bytes read (engines only).
    pub slices: SliceStats,
    /// Arena mappings of this process whose `madvise(MADV_HUGEPAGE)` was
    /// refused (4 KiB pages; see [`Arena::huge_page_bytes`](crate::Arena::huge_page_bytes)).
    pub arena_hugepage_refusals: u64,
    /// Every fallback that costs speed, worst first (empty when nothing fell
    /// back): what [`Engine::warnings`](crate::Engine::warnings) and
    /// [`Model::warnings`](crate::Model::warnings) return, and the first
    /// lines of this snapshot shown with `{}`.
    pub warnings: Vec<Warning>,
}

impl Stats {
    /// Fallbacks of every cause on every drive.
    pub fn fallbacks_total(&self) -> u64 {
        self.drives.iter().flat_map(|d| d.fallbacks.values()).sum()
    }

    /// Reads that used O_DIRECT, all drives.
    pub fn reads_direct(&self) -> u64 {
        self.drives.iter().map(|d| d.reads_direct).sum()
    }

    /// Reads that went wholly buffered, all drives.
    pub fn reads_buffered(&self) -> u64 {
        self.drives.iter().map(|d| d.reads_buffered).sum()
    }
}

pub(crate) fn snapshot_fallbacks(c: &DriveCounters) -> BTreeMap<&'static str, u64> {
    FallbackCause::ALL
        .iter()
        .filter_map(|&k| {
            let n = c.fallback_count(k);
            (n > 0).then_some((k.name(), n))
        })
        .collect()
}
