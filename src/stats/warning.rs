//! Every fallback that costs speed, as values a caller can print: what fell
//! back, where, how many times, the fix and the cost. They reach a user who
//! installed no `tracing` subscriber (the log lines are said once, and only
//! to a subscriber): [`Engine::warnings`](crate::Engine::warnings),
//! [`Model::warnings`](crate::Model::warnings) and the first lines of a
//! [`Stats`](super::Stats) shown with `{}`.
//!
//! The text of every kind lives here (the model and the engine decide which
//! apply, from what they hold); the order is the kind's, worst first.

use std::fmt;
use std::path::{Path, PathBuf};

use serde::{Serialize, Serializer};

use super::FallbackCause;
use crate::error::escape;

/// What fell back. The order of the variants is the order of
/// [`Engine::warnings`](crate::Engine::warnings): worst first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
#[non_exhaustive]
pub enum WarningKind {
    /// A drive's I/O thread stopped: reads that need the drive go to another
    /// copy or fail.
    DriveStopped,
    /// Chunks failed on a copy and were read again from another copy.
    Failover,
    /// io_uring could not be set up: the pread backend serves every read.
    PreadBackend,
    /// Reads went buffered through the page cache instead of O_DIRECT, by
    /// cause (only the causes that are not the caller's own choice: never
    /// [`FallbackCause::NoBulk`] or [`FallbackCause::Placed`]).
    Buffered(FallbackCause),
    /// An arena could not be registered as io_uring fixed buffers because
    /// the locked-memory limit (`RLIMIT_MEMLOCK`, `ulimit -l`) is too low.
    Memlock,
    /// An arena could not be registered as fixed buffers for another reason
    /// (the table is full, a slot is over the fixed-buffer size, the ring
    /// refused the table).
    BuffersUnregistered,
    /// A mirror's copy of a shard was refused when the model was opened
    /// (another size, another header, unreadable): the primary serves it.
    MirrorRefused,
    /// A mirror sits on the same filesystem as the other copies of its
    /// shards: accepted, but it adds no bandwidth.
    MirrorSharesDrive,
    /// The copies' read weights could not be probed: they stay equal.
    WeightsProbeFailed,
    /// A drive's NUMA node is unknown on a machine with more than one node.
    NumaUnknown,
    /// Binding a drive's I/O threads to the CPUs near it failed.
    NumaBindingFailed,
    /// The rings could not register the files (fixed files off).
    FixedFilesOff,
    /// Chunks into slots that span two registered 1 GiB pieces went as plain
    /// reads (the arena itself is registered).
    SlotsUnregistered,
    /// Reads into caller memory at addresses out of phase with their file
    /// offsets: O_DIRECT into staging, then one copy each into place.
    Staged,
    /// `madvise(MADV_HUGEPAGE)` was refused on arena mappings: 4 KiB pages.
    HugePagesRefused,
    /// The kernel refused the ring's setup flags: a plain ring serves.
    RingFlagsRefused,
    /// io-wq's worker limit could not be set on a ring that punts reads.
    IowqLimitUnset,
    /// `madvise(MADV_DONTFORK)` failed on arena mappings: `fork()` copies
    /// them.
    DontforkFailed,
    /// `madvise(MADV_DOFORK)` failed on payloads handed over: a forked
    /// child does not have them.
    InheritFailed,
    /// Slots handed to forked children could not be fork-protected again:
    /// kept out of use.
    ReprotectFailed,
}

impl WarningKind {
    /// The kind's name (`memlock`, `pread_backend`, or for
    /// [`WarningKind::Buffered`] the cause's name: `direct_open_refused`).
    pub fn name(self) -> &'static str {
        match self {
            WarningKind::DriveStopped => "drive_stopped",
            WarningKind::Failover => "failover",
            WarningKind::PreadBackend => "pread_backend",
            WarningKind::Buffered(c) => c.name(),
            WarningKind::Memlock => "memlock",
            WarningKind::BuffersUnregistered => "buffers_unregistered",
            WarningKind::MirrorRefused => "mirror_refused",
            WarningKind::MirrorSharesDrive => "mirror_shares_drive",
            WarningKind::WeightsProbeFailed => "weights_probe_failed",
            WarningKind::NumaUnknown => "numa_unknown",
            WarningKind::NumaBindingFailed => "numa_binding_failed",
            WarningKind::FixedFilesOff => "fixed_files_off",
            WarningKind::SlotsUnregistered => "slots_unregistered",
            WarningKind::Staged => "staged",
            WarningKind::HugePagesRefused => "huge_pages_refused",
            WarningKind::RingFlagsRefused => "ring_flags_refused",
            WarningKind::IowqLimitUnset => "iowq_limit_unset",
            WarningKind::DontforkFailed => "dontfork_failed",
            WarningKind::InheritFailed => "inherit_failed",
            WarningKind::ReprotectFailed => "reprotect_failed",
        }
    }

    /// What [`Warning::count`] counts for this kind (`fallbacks`,
    /// `arenas`, `chunks`, `files`, ...).
    pub fn unit(self) -> &'static str {
        match self {
            WarningKind::Buffered(_) => "fallbacks",
            WarningKind::Failover | WarningKind::SlotsUnregistered => "chunks",
            WarningKind::Staged => "reads",
            WarningKind::Memlock | WarningKind::BuffersUnregistered => "arenas",
            WarningKind::MirrorRefused => "files",
            WarningKind::HugePagesRefused | WarningKind::DontforkFailed => "mappings",
            WarningKind::InheritFailed => "payloads",
            WarningKind::ReprotectFailed => "slots",
            WarningKind::DriveStopped
            | WarningKind::PreadBackend
            | WarningKind::MirrorSharesDrive
            | WarningKind::WeightsProbeFailed
            | WarningKind::NumaUnknown
            | WarningKind::NumaBindingFailed
            | WarningKind::FixedFilesOff
            | WarningKind::RingFlagsRefused
            | WarningKind::IowqLimitUnset => "times",
        }
    }

    /// What the fallback costs, in a phrase.
    pub fn cost(self) -> &'static str {
        match self {
            WarningKind::DriveStopped => "reads that need this drive go to another copy, or fail",
            WarningKind::Failover => {
                "each failed chunk is read again from another copy: a round trip lost, and this copy's bandwidth while it fails"
            }
            WarningKind::PreadBackend => {
                "reads go through a pool of pread threads instead of io_uring: a system call and a thread wake-up per chunk"
            }
            WarningKind::Buffered(_) => {
                "reads buffered through the page cache: an extra copy of every byte, and the cache's memory"
            }
            WarningKind::Memlock | WarningKind::BuffersUnregistered | WarningKind::SlotsUnregistered => {
                "plain reads instead of fixed-buffer reads: the kernel pins and maps the pages again on every chunk"
            }
            WarningKind::MirrorRefused => "the shard is read from fewer copies: less bandwidth for it",
            WarningKind::MirrorSharesDrive => "no bandwidth added: two copies behind one device read no faster than one",
            WarningKind::WeightsProbeFailed => "copies are weighted equally: a slow copy gets as many reads as a fast one",
            WarningKind::NumaUnknown => {
                "the drive's I/O threads and arenas are not placed near it: reads may cross NUMA nodes"
            }
            WarningKind::NumaBindingFailed => "the drive's I/O threads run on any CPU: reads may cross NUMA nodes",
            WarningKind::FixedFilesOff => "every chunk looks its file descriptor up in the kernel (no fixed files)",
            WarningKind::Staged => {
                "one copy of every payload on the thread that waits, and the staging memory"
            }
            WarningKind::HugePagesRefused => "arenas on 4 KiB pages: more segments per read, more TLB misses",
            WarningKind::RingFlagsRefused => {
                "a plain ring: more interrupts and task work per completion (no single_issuer / defer_taskrun)"
            }
            WarningKind::IowqLimitUnset => {
                "io-wq may start more workers than the drive's CPUs: they contend for the same cores"
            }
            WarningKind::DontforkFailed => "fork() copies these arenas into the child: memory and time at every fork",
            WarningKind::InheritFailed => {
                "a forked child that touches these payloads fails (a panic naming the cause in Rust, a fault through raw pointers)"
            }
            WarningKind::ReprotectFailed => "the slots' memory stays mapped and out of use until their arena goes",
        }
    }
}

impl fmt::Display for WarningKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl Serialize for WarningKind {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.name())
    }
}

/// Where a warning applies.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
#[non_exhaustive]
pub enum WarningLocation {
    /// This process (every arena mapping).
    Process,
    /// The model as a whole (its copies' weights).
    Model,
    /// The engine as a whole (its backend, every ring).
    Engine,
    /// One drive, by device name (`nvme0n1`).
    Drive(String),
    /// One file (a shard's copy).
    File(PathBuf),
    /// One directory (a mirror).
    Directory(PathBuf),
    /// An arena of this many bytes (the last one refused).
    Arena {
        /// The arena's size in bytes.
        bytes: u64,
    },
}

impl fmt::Display for WarningLocation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            WarningLocation::Process => f.write_str("process"),
            WarningLocation::Model => f.write_str("model"),
            WarningLocation::Engine => f.write_str("engine"),
            WarningLocation::Drive(d) => write!(f, "drive {d}"),
            WarningLocation::File(p) => write!(f, "file {}", escape(p)),
            WarningLocation::Directory(p) => write!(f, "directory {}", escape(p)),
            WarningLocation::Arena { bytes } => write!(f, "arena of {bytes} bytes"),
        }
    }
}

impl Serialize for WarningLocation {
    /// As its `Display` text (paths escaped): `drive vda`, `file /m/x.safetensors`.
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

/// One fallback that costs speed: what, where, how many times, the message
/// with the fix, and what it costs.
///
/// `Display` is one line: `drive vda: <message> (3 fallbacks; costs: <cost>)`
/// (no count for a state said once, such as the backend).
///
/// ```
/// use weightstream::{Engine, EngineConfig, Model, ModelConfig, WarningKind};
/// # fn main() -> Result<(), Box<dyn std::error::Error>> {
/// # let dir = weightstream::__internal::doc_model("warnings", &[("w", weightstream::Dtype::U8, 8192)])?;
/// let model = Model::open(ModelConfig::new(&dir))?;
/// let engine = Engine::new(&model, EngineConfig::default())?;
/// // ... reads ...
/// for w in engine.warnings() {
///     eprintln!("warning: {w}");
///     if w.kind == WarningKind::Memlock {
///         // the message names `ulimit -l` with the figure to set
///     }
/// }
/// # drop(engine);
/// # std::fs::remove_dir_all(&dir)?;
/// # Ok(())
/// # }
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct Warning {
    /// What fell back.
    pub kind: WarningKind,
    /// Where.
    pub location: WarningLocation,
    /// How many times, in the kind's [`unit`](WarningKind::unit) (reads that
    /// fell back, arenas refused, chunks re-read, files refused; 1 for a
    /// state such as the backend). May be 0 for a state seen before any
    /// read (a drive whose files refused O_DIRECT at open and was not read).
    pub count: u64,
    /// One line: what happened (the first occurrence's detail: file, errno,
    /// the limit in force) and how to fix it.
    pub message: String,
    /// What it costs ([`WarningKind::cost`]).
    pub cost: &'static str,
}

impl Warning {
    /// A warning of `kind` at `location`; its cost is the kind's.
    pub(crate) fn new(kind: WarningKind, location: WarningLocation, count: u64, message: impl Into<String>) -> Self {
        Warning {
            kind,
            location,
            count,
            message: message.into(),
            cost: kind.cost(),
        }
    }
}

impl fmt::Display for Warning {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {} (", self.location, self.message)?;
        let unit = self.kind.unit();
        match self.count {
            // A state said once (the backend, a ring): no count.
            1 if unit == "times" => {}
            // `1 arena`, `2 arenas` (every unit is a plural in -s).
            1 => write!(f, "1 {}; ", unit.strip_suffix('s').unwrap_or(unit))?,
            n => write!(f, "{n} {unit}; ")?,
        }
        write!(f, "costs: {})", self.cost)
    }
}

/// Worst first: by kind, then the larger count, then the place (a total,
/// deterministic order).
pub(crate) fn sort(w: &mut [Warning]) {
    w.sort_by(|a, b| {
        (a.kind, std::cmp::Reverse(a.count), &a.location, &a.message).cmp(&(
            b.kind,
            std::cmp::Reverse(b.count),
            &b.location,
            &b.message,
        ))
    });
}

/// Reads of drive `device` that went buffered for `cause`, `n` times; the
/// first occurrence's file and detail when recorded. `None` for the causes
/// that are the caller's choice (`no_bulk`, `placed`).
pub(crate) fn buffered(
    device: &str,
    cause: FallbackCause,
    n: u64,
    first: Option<&(PathBuf, String)>,
) -> Option<Warning> {
    if !cause.is_warning() {
        return None;
    }
    let what = match first {
        Some((file, detail)) => format!("{}: {detail}", escape(file)),
        None => format!("reads fell back ({})", cause.name()),
    };
    let fix = match cause {
        FallbackCause::DirectOpenRefused => {
            "reads of such files go through the page cache; put the model on a filesystem that takes O_DIRECT \
             (ext4, xfs, btrfs on a block device; not tmpfs, overlayfs or most FUSE)"
        }
        FallbackCause::SlotMisaligned => {
            "read into the engine's arenas (Engine::arena, packed_arena) or align lent memory to \
             Model::required_align()"
        }
        FallbackCause::SlotAlignTooSmall => {
            "size slots with Model::slot_spec_for_largest, or SlotSpec::with_align(model.required_align())"
        }
        FallbackCause::DeviceEinval => {
            "the device refused O_DIRECT at run time (a logical block size above the alignment statx gave?); \
             the reads were redone buffered"
        }
        FallbackCause::ShortDirect => {
            "the range was re-read buffered; a file changed since it was opened? (`weightstream verify` names changes)"
        }
        FallbackCause::DirectError => "the range was re-read buffered; check the device (dmesg)",
        FallbackCause::NoBulk | FallbackCause::Placed => "",
    };
    Some(Warning::new(
        WarningKind::Buffered(cause),
        WarningLocation::Drive(device.to_string()),
        n,
        format!("O_DIRECT fell back to buffered reads: {what}; {fix}"),
    ))
}

/// `n` chunks of drive `device` failed and moved to another copy.
pub(crate) fn failover(device: &str, n: u64, first: Option<&str>) -> Warning {
    let first = first.map_or(String::new(), |f| format!(" (first: {f})"));
    Warning::new(
        WarningKind::Failover,
        WarningLocation::Drive(device.to_string()),
        n,
        format!(
            "reads failed on this drive and were read again from another copy{first}; check the drive and the \
             files (`weightstream verify`)"
        ),
    )
}

/// Drive `device` takes no more work: `why`; `abandoned` chunks left with
/// their slots leaked.
pub(crate) fn drive_stopped(device: &str, why: &str, abandoned: u64) -> Warning {
    let abandoned = if abandoned > 0 {
        format!("; {abandoned} chunk(s) abandoned in flight, their slots leaked")
    } else {
        String::new()
    };
    Warning::new(
        WarningKind::DriveStopped,
        WarningLocation::Drive(device.to_string()),
        1,
        format!("the drive's I/O thread stopped: {why}{abandoned}; a new engine (Engine::new) reads from it again"),
    )
}

/// The pread backend serves because io_uring could not be set up (`why`
/// names the errno and the hint).
pub(crate) fn pread_backend(why: &str) -> Warning {
    Warning::new(
        WarningKind::PreadBackend,
        WarningLocation::Engine,
        1,
        format!("{why}; fix what it names to get the io_uring backend"),
    )
}

/// Fixed buffers refused: `why` (the registry's reason), `arenas` refused
/// (the last of `bytes`, or none: refused when the rings started),
/// `chunks` read unregistered so far, `memlock` when the limit was the cause.
pub(crate) fn buffers_unregistered(why: &str, memlock: bool, arenas: u64, bytes: Option<u64>, chunks: u64) -> Warning {
    let kind = if memlock {
        WarningKind::Memlock
    } else {
        WarningKind::BuffersUnregistered
    };
    let location = bytes.map_or(WarningLocation::Engine, |bytes| WarningLocation::Arena { bytes });
    Warning::new(
        kind,
        location,
        arenas,
        format!("not registered as io_uring fixed buffers: {why}; {chunks} chunk(s) read unregistered so far"),
    )
}

/// `chunks` of drive `device` into slots spanning two registered pieces.
pub(crate) fn slots_unregistered(device: &str, chunks: u64) -> Warning {
    Warning::new(
        WarningKind::SlotsUnregistered,
        WarningLocation::Drive(device.to_string()),
        chunks,
        "reads into slots that span two registered 1 GiB pieces of an arena went as plain reads; keep slots inside \
         one piece (smaller packed arenas, or slots under 1 GiB)",
    )
}

/// `reads` into caller memory went through staging: `bytes` copied in
/// `copy_ns` of CPU.
pub(crate) fn staged(reads: u64, bytes: u64, copy_ns: u64) -> Warning {
    let per_gb = copy_ns as f64 / bytes.max(1) as f64;
    Warning::new(
        WarningKind::Staged,
        WarningLocation::Engine,
        reads,
        format!(
            "reads into caller memory at addresses out of phase with their file offsets went O_DIRECT into staging and were copied into place ({bytes} bytes, {per_gb:.3} CPU s per GB); lay payloads out with Engine::placement or read with Engine::read_anywhere to read in place"
        ),
    )
}

/// The rings use no fixed files: `why`.
pub(crate) fn fixed_files_off(why: &str) -> Warning {
    Warning::new(
        WarningKind::FixedFilesOff,
        WarningLocation::Engine,
        1,
        format!("fixed files unavailable: {why}; reads use plain descriptors"),
    )
}

/// `files` of mirror directory `dir` refused; the first is `file`, for `reason`.
pub(crate) fn mirror_refused(dir: &Path, files: u64, file: &Path, reason: &str) -> Warning {
    let which = if files == 1 {
        format!("{}: {reason}", escape(file))
    } else {
        format!("{files} files refused, the first {}: {reason}", escape(file))
    };
    Warning::new(
        WarningKind::MirrorRefused,
        WarningLocation::Directory(dir.to_path_buf()),
        files,
        format!("mirror copy refused ({which}); the primary copy serves; copy the file again from the primary"),
    )
}

/// Mirror directory `dir` is on `device`, as the other copies of its shards.
pub(crate) fn mirror_shares_drive(dir: &Path, device: &str) -> Warning {
    Warning::new(
        WarningKind::MirrorSharesDrive,
        WarningLocation::Directory(dir.to_path_buf()),
        1,
        format!(
            "this mirror is on the same filesystem ({device}) as the other copies of its shards; put it on another \
             drive"
        ),
    )
}

/// The weight probe failed: `note`.
pub(crate) fn weights_probe_failed(note: &str) -> Warning {
    Warning::new(
        WarningKind::WeightsProbeFailed,
        WarningLocation::Model,
        1,
        format!("{note}; give the weights explicitly (Weights::Explicit) or fix what it names"),
    )
}

/// Drive `device`'s NUMA node is unknown (`note`) on a machine of `nodes` nodes.
pub(crate) fn numa_unknown(device: &str, note: Option<&str>, nodes: usize) -> Warning {
    let why = note.map_or(String::new(), |n| format!(": {n}"));
    Warning::new(
        WarningKind::NumaUnknown,
        WarningLocation::Drive(device.to_string()),
        1,
        format!(
            "NUMA node unknown on a machine with {nodes} nodes{why}; build with the `numa` feature (hwloc), or give \
             a topology (WEIGHTSTREAM_NUMA_XML) that names the device"
        ),
    )
}

/// Drive `device`'s I/O threads are not bound: `binding` (what was said).
pub(crate) fn numa_binding_failed(device: &str, binding: &str) -> Warning {
    Warning::new(
        WarningKind::NumaBindingFailed,
        WarningLocation::Drive(device.to_string()),
        1,
        format!("I/O thread {binding}; allow the drive's CPUs in the process's affinity (taskset, a cgroup cpuset)"),
    )
}

/// Drive `device`'s ring was set up plain (`ring`: its description).
pub(crate) fn ring_flags_refused(device: &str, ring: &str) -> Warning {
    Warning::new(
        WarningKind::RingFlagsRefused,
        WarningLocation::Drive(device.to_string()),
        1,
        format!("the kernel refused the ring's setup flags ({ring}); a kernel 6.1 or newer takes them"),
    )
}

/// Drive `device`'s rings punt reads with no io-wq worker limit.
pub(crate) fn iowq_limit_unset(device: &str) -> Warning {
    Warning::new(
        WarningKind::IowqLimitUnset,
        WarningLocation::Drive(device.to_string()),
        1,
        "io-wq's worker limit could not be set on a ring that punts reads (IORING_REGISTER_IOWQ_MAX_WORKERS: Linux \
         5.15); the kernel's default applies",
    )
}

/// Process-wide refusals of advice on arena memory (each a count).
pub(crate) struct ArenaRefusals {
    /// Mappings whose huge-page advice was refused.
    pub(crate) hugepage: u64,
    /// Mappings whose fork protection failed.
    pub(crate) dontfork: u64,
    /// Payloads handed over that a forked child does not have.
    pub(crate) inherit: u64,
    /// Slots that could not be fork-protected again (kept out of use).
    pub(crate) reprotect: u64,
}

/// Process-wide: what the kernel refused of the advice on arena memory.
pub(crate) fn arena_mappings(r: &ArenaRefusals) -> Vec<Warning> {
    let (hugepages, dontfork) = (r.hugepage, r.dontfork);
    let mut out = Vec::new();
    if hugepages > 0 {
        out.push(Warning::new(
            WarningKind::HugePagesRefused,
            WarningLocation::Process,
            hugepages,
            "madvise(MADV_HUGEPAGE) refused on arena mappings; enable transparent huge pages \
             (/sys/kernel/mm/transparent_hugepage/enabled: madvise or always)",
        ));
    }
    if dontfork > 0 {
        out.push(Warning::new(
            WarningKind::DontforkFailed,
            WarningLocation::Process,
            dontfork,
            "madvise(MADV_DONTFORK) failed on arena mappings; avoid fork() while arenas live, or start children \
             with posix_spawn (std::process::Command)",
        ));
    }
    if r.inherit > 0 {
        out.push(Warning::new(
            WarningKind::InheritFailed,
            WarningLocation::Process,
            r.inherit,
            "madvise(MADV_DOFORK) failed on payloads handed over; a forked child does not have them \
             (the memory map may have too many areas: vm.max_map_count)",
        ));
    }
    if r.reprotect > 0 {
        out.push(Warning::new(
            WarningKind::ReprotectFailed,
            WarningLocation::Process,
            r.reprotect,
            "madvise(MADV_DONTFORK) failed on slots handed to forked children when they came back; they are kept out \
             of use until their arena goes (the memory map may have too many areas: vm.max_map_count)",
        ));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn expected_paths_are_no_warning() {
        assert!(buffered("vda", FallbackCause::NoBulk, 3, None).is_none());
        assert!(buffered("vda", FallbackCause::Placed, 3, None).is_none());
        let first = (
            PathBuf::from("/m/a.safetensors"),
            "open(O_DIRECT) refused by tmpfs: EINVAL".to_string(),
        );
        let w = buffered("vda", FallbackCause::DirectOpenRefused, 2, Some(&first)).unwrap();
        assert_eq!(w.kind, WarningKind::Buffered(FallbackCause::DirectOpenRefused));
        assert_eq!(w.location, WarningLocation::Drive("vda".into()));
        let line = w.to_string();
        assert!(line.starts_with("drive vda: "), "{line}");
        assert!(
            line.contains("/m/a.safetensors: open(O_DIRECT) refused by tmpfs"),
            "{line}"
        );
        assert!(
            line.contains("(2 fallbacks; costs: reads buffered through the page cache"),
            "{line}"
        );
        assert!(!line.contains('\n'), "one line: {line}");
    }

    #[test]
    fn memlock_names_the_limit_the_arena_and_the_cost() {
        let why = "registering 4194304 bytes failed with ENOMEM: RLIMIT_MEMLOCK is 65536 bytes; raise it \
                   (`ulimit -l 4160` or more, in KiB) or run with CAP_IPC_LOCK";
        let w = buffers_unregistered(why, true, 1, Some(4194304), 12);
        assert_eq!(w.kind, WarningKind::Memlock);
        assert_eq!(w.kind.name(), "memlock");
        assert_eq!(w.location, WarningLocation::Arena { bytes: 4194304 });
        let line = w.to_string();
        assert!(line.starts_with("arena of 4194304 bytes: not registered"), "{line}");
        assert!(
            line.contains("ulimit -l 4160") && line.contains("12 chunk(s) read unregistered"),
            "{line}"
        );
        assert!(
            line.contains("(1 arena; costs: plain reads instead of fixed-buffer reads"),
            "{line}"
        );
        let other = buffers_unregistered("the fixed-buffer table (16384 entries) is full", false, 2, None, 0);
        assert_eq!(
            (other.kind, other.location),
            (WarningKind::BuffersUnregistered, WarningLocation::Engine)
        );
    }

    #[test]
    fn a_state_has_no_count() {
        let line = pread_backend("io_uring unavailable (EPERM)").to_string();
        assert!(
            line.starts_with("engine: io_uring unavailable (EPERM); fix what it names"),
            "{line}"
        );
        assert!(line.ends_with("(costs: reads go through a pool of pread threads instead of io_uring: a system call and a thread wake-up per chunk)"), "{line}");
    }

    #[test]
    fn sorted_worst_first_and_deterministic() {
        let mut w = vec![
            arena_mappings(&ArenaRefusals {
                hugepage: 1,
                dontfork: 0,
                inherit: 0,
                reprotect: 0,
            })
            .remove(0),
            buffers_unregistered("x", true, 1, Some(1), 0),
            failover("vdb", 1, None),
            failover("vda", 1, None),
            failover("vdc", 5, None),
            drive_stopped("vdb", "injected", 0),
            pread_backend("io_uring unavailable"),
        ];
        let mut again = w.clone();
        again.reverse();
        sort(&mut w);
        sort(&mut again);
        assert_eq!(w, again, "the order does not depend on the input's");
        let order: Vec<(WarningKind, String)> = w.iter().map(|w| (w.kind, w.location.to_string())).collect();
        assert_eq!(
            order,
            [
                (WarningKind::DriveStopped, "drive vdb".to_string()),
                (WarningKind::Failover, "drive vdc".to_string()),
                (WarningKind::Failover, "drive vda".to_string()),
                (WarningKind::Failover, "drive vdb".to_string()),
                (WarningKind::PreadBackend, "engine".to_string()),
                (WarningKind::Memlock, "arena of 1 bytes".to_string()),
                (WarningKind::HugePagesRefused, "process".to_string()),
            ]
        );
    }

    #[test]
    fn serialised_by_name_and_place() {
        let w = mirror_refused(Path::new("/m2"), 3, Path::new("/m2/a.safetensors"), "size differs");
        let v = serde_json::to_value(&w).unwrap();
        assert_eq!(v["kind"], "mirror_refused");
        assert_eq!(v["location"], "directory /m2");
        assert_eq!(v["count"], 3);
        assert!(v["message"]
            .as_str()
            .unwrap()
            .contains("3 files refused, the first /m2/a.safetensors"));
        assert_eq!(v["cost"], WarningKind::MirrorRefused.cost());
    }

    #[test]
    fn every_kind_has_a_distinct_name() {
        let mut kinds = vec![
            WarningKind::DriveStopped,
            WarningKind::Failover,
            WarningKind::PreadBackend,
            WarningKind::Memlock,
            WarningKind::BuffersUnregistered,
            WarningKind::MirrorRefused,
            WarningKind::MirrorSharesDrive,
            WarningKind::WeightsProbeFailed,
            WarningKind::NumaUnknown,
            WarningKind::NumaBindingFailed,
            WarningKind::FixedFilesOff,
            WarningKind::SlotsUnregistered,
            WarningKind::Staged,
            WarningKind::HugePagesRefused,
            WarningKind::RingFlagsRefused,
            WarningKind::IowqLimitUnset,
            WarningKind::DontforkFailed,
        ];
        kinds.extend(FallbackCause::ALL.map(WarningKind::Buffered));
        let mut names: Vec<&str> = kinds.iter().map(|k| k.name()).collect();
        names.sort_unstable();
        let n = names.len();
        names.dedup();
        assert_eq!(names.len(), n, "{names:?}");
        assert!(kinds.iter().all(|k| !k.cost().is_empty() && !k.unit().is_empty()));
    }
}
