//! The crate's one error type. Every message names the file (or entry), the
//! operation and the cause, so a user can act on it without a debugger.

use std::path::PathBuf;

/// Shows a path or file name for people: control characters escaped (so a
/// refusal can be read and matched against what was typed), and bytes that
/// are not UTF-8 as `\xNN` (names need not be UTF-8; two names that differ
/// only in such bytes still show differently, which a lossy display would
/// not). Identity is never the escaped form: names stay `OsStr`/`Path`.
pub fn escape(p: impl AsRef<std::ffi::OsStr>) -> String {
    use std::fmt::Write;
    use std::os::unix::ffi::OsStrExt;
    let mut out = String::new();
    for chunk in p.as_ref().as_bytes().utf8_chunks() {
        out.extend(chunk.valid().chars().flat_map(char::escape_debug));
        for b in chunk.invalid() {
            let _ = write!(out, "\\x{b:02x}");
        }
    }
    out
}

/// Serialises a path or name as its [`escape`]d text (serde's own
/// `Path` serialisation fails on names that are not UTF-8).
pub(crate) fn serialize_escaped<T: AsRef<std::ffi::OsStr>, S: serde::Serializer>(
    v: &T,
    s: S,
) -> Result<S::Ok, S::Error> {
    s.serialize_str(&escape(v))
}

/// Result alias for this crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Why a shard header was refused.
#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum HeaderError {
    /// The file cannot hold the 8-byte length.
    #[error("file is {size} bytes, too small to hold the 8-byte header length")]
    TooSmallForLength {
        /// The file's size.
        size: u64,
    },
    /// The header length is 0.
    #[error("header length is 0")]
    LengthZero,
    /// The header length is over the limit (100 MB, as the reference reader).
    #[error("header length {len} exceeds the {max}-byte limit")]
    LengthTooLarge {
        /// The length read.
        len: u64,
        /// The limit.
        max: u64,
    },
    /// The header runs past the end of the file.
    #[error("header length {len} runs past end of file ({size} bytes)")]
    LengthPastEof {
        /// The length read.
        len: u64,
        /// The file's size.
        size: u64,
    },
    /// The header does not start with `{`.
    #[error("header does not start with '{{' (first byte 0x{first:02x})")]
    NotAnObject {
        /// Its first byte.
        first: u8,
    },
    /// The header is not UTF-8 (the decoder's message).
    #[error("header is not valid UTF-8: {0}")]
    Utf8(String),
    /// The JSON table is not a valid safetensors table (what is wrong).
    #[error("header is not a valid safetensors table: {0}")]
    Invalid(String),
    /// Header and data do not add up to the file's size.
    #[error("8 + header ({header_len}) + data ({data_len}) = {expected} bytes, but the file is {size} bytes")]
    SizeMismatch {
        /// The header's length.
        header_len: u64,
        /// The data section's length (the last tensor's end).
        data_len: u64,
        /// What the file's size should be.
        expected: u64,
        /// The file's size.
        size: u64,
    },
}

/// Why an arena handed out no slot ([`Arena::take`](crate::Arena::take),
/// [`Arena::take_sized`](crate::Arena::take_sized),
/// [`Arena::take_for`](crate::Arena::take_for)). Every message names the
/// numbers and what to do; `?` turns it into [`Error::Take`].
///
/// Byte counts are the arena's: `need` is the slot's bytes as the arena
/// carves them (scratch + payload, rounded to the page).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum TakeError {
    /// Fewer bytes are free than the slot needs: slots still out hold the
    /// rest (a fixed arena: every slot is out). Return some first, or make
    /// the arena larger.
    Full {
        /// Bytes the slot needs.
        need: usize,
        /// Bytes free right now.
        free: usize,
        /// Bytes of the whole arena.
        bytes: usize,
    },
    /// Enough bytes are free, but no free extent (hole) holds the slot: the
    /// free bytes are scattered between slots still out (or, in an arena
    /// over 1 GiB, a hole large enough crosses a registration piece, which
    /// a slot of at most a piece may not).
    Fragmented {
        /// Bytes the slot needs.
        need: usize,
        /// Bytes free right now, in all holes together.
        free: usize,
        /// The largest hole: the longest run of free pages.
        largest: usize,
        /// Bytes of the whole arena.
        bytes: usize,
    },
    /// No slot of this arena can ever hold it, however many come back.
    NeverFits {
        /// What does not fit: `bytes` (the slot is larger than a packed
        /// arena), or the field of the asked [`SlotSpec`](crate::SlotSpec)
        /// a fixed arena's slots do not meet: `capacity`, `align` or
        /// `tail_room`.
        field: &'static str,
        /// What the slot needs (for `tail_room`: 1, tail room asked).
        need: usize,
        /// What the arena has (for `tail_room`: 0, its slots have none).
        have: usize,
    },
    /// [`Arena::take`](crate::Arena::take) on a packed arena, whose slots
    /// have no size of their own.
    WrongKind,
    /// Asked in a process forked from the one that made the arena: its
    /// pages and lock exist only in the parent.
    Forked {
        /// The process that made the arena.
        parent: u32,
        /// This process.
        child: u32,
    },
    /// The asked slot cannot exist at all (a spec that
    /// [`SlotSpec::validate`](crate::SlotSpec::validate) refuses, or a
    /// tensor whose slot size overflows): why.
    Invalid {
        /// What is wrong, with its numbers.
        reason: String,
    },
}

impl std::fmt::Display for TakeError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            TakeError::Full { need, free, bytes } => write!(
                f,
                "arena full: a slot of {need} bytes does not fit in the {free} bytes free (of {bytes}); \
                 the rest is held by slots still out: drop them (or Arena::give_back) before taking more, \
                 or make the arena larger (for a loop with batches in flight: Arena::packed_bytes_for)"
            ),
            TakeError::Fragmented {
                need,
                free,
                largest,
                bytes,
            } => {
                write!(
                    f,
                    "arena fragmented: {free} bytes are free (of {bytes}), enough for a slot of {need} bytes, \
                     but in holes between slots still out (the largest: {largest} bytes)"
                )?;
                if largest >= need {
                    write!(
                        f,
                        " (the holes that large cross a 1 GiB registration piece, which a slot of at most a piece may not)"
                    )?;
                }
                write!(
                    f,
                    "; return slots in the order they were taken (whole batches, oldest first: next fit then \
                     reuses the arena as a ring), size it with Arena::packed_bytes_for, or return the slots \
                     between the holes"
                )
            }
            TakeError::NeverFits { field, need, have } => match *field {
                "bytes" => write!(
                    f,
                    "a slot of {need} bytes can never fit in this packed arena of {have} bytes: make the arena \
                     at least {need} bytes (Arena::packed_bytes_for sizes one for a batch)"
                ),
                "tail_room" => write!(
                    f,
                    "the slot spec asks for tail room and this fixed arena's slots have none: no slot of it \
                     ever fits; take from an arena made with SlotSpec::with_tail_room(true), or a packed arena"
                ),
                field => write!(
                    f,
                    "the slot spec's {field} ({need}) exceeds this fixed arena's slots' {field} ({have}): no \
                     slot of it ever fits; take from an arena whose SlotSpec holds it, or a packed arena \
                     (Arena::take_for, Arena::take_sized)"
                ),
            },
            TakeError::WrongKind => write!(
                f,
                "Arena::take on a packed arena: its slots have no size of their own; use Arena::take_for(tensor) \
                 (the smallest slot that reads it in place) or Arena::take_sized(spec)"
            ),
            TakeError::Forked { parent, child } => write!(
                f,
                "a slot asked of an arena in a forked child (pid {child}; the arena was made in pid {parent}): \
                 its pages and lock exist only in the parent; make a new arena (or Engine) in the child"
            ),
            TakeError::Invalid { reason } => write!(f, "no such slot: {reason}"),
        }
    }
}

impl std::error::Error for TakeError {}

/// The crate's error type.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A system call on a file failed.
    #[error("{}: {op}: {source}", escape(path))]
    Io {
        /// The file.
        path: PathBuf,
        /// The operation (`open`, `statx`, `buffered read`, ...).
        op: &'static str,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// A shard's header was refused; nothing was read from its data.
    #[error("{}: refused safetensors header: {cause}", escape(path))]
    Header {
        /// The shard.
        path: PathBuf,
        /// Why.
        cause: HeaderError,
    },
    /// A model directory or index is inconsistent.
    #[error("{}: {cause}", escape(path))]
    Catalog {
        /// The directory, file or index.
        path: PathBuf,
        /// What is wrong.
        cause: String,
    },
    /// A requested range is not inside the file: untrusted container.
    #[error(
        "{}: range [{start}, {end}) is outside the file ({size} bytes): untrusted container",
        escape(path)
    )]
    OutOfRange {
        /// The shard.
        path: PathBuf,
        /// Start of the range.
        start: u64,
        /// End of the range (exclusive).
        end: u64,
        /// The file's size.
        size: u64,
    },
    /// The file ended before a read inside its validated size completed.
    #[error("{}: {op}: end of file at byte {at} while reading [{start}, {end}); was the file truncated after it was opened?", escape(path))]
    UnexpectedEof {
        /// The shard.
        path: PathBuf,
        /// The operation.
        op: &'static str,
        /// Start of the read.
        start: u64,
        /// End of the read (exclusive).
        end: u64,
        /// Where the file ended.
        at: u64,
    },
    /// A chunk of a tensor's read failed on every copy of its shard (with
    /// one copy: that copy's error). `causes` names each copy tried and why.
    #[error("tensor {tensor}: bytes [{start}, {end}): {}{causes}", if *.copies > 1 { format!("every copy failed ({} copies): ", .copies) } else { "read failed: ".to_string() })]
    ReadFailed {
        /// The tensor.
        tensor: String,
        /// File offset of the failed chunk.
        start: u64,
        /// Its end (exclusive).
        end: u64,
        /// Copies of the shard the read could use.
        copies: usize,
        /// Each copy tried and why it failed.
        causes: String,
    },
    /// A call that fills many destinations (`Engine::fill`) failed after
    /// its reads began: `source` is the first failure; `done` of `total`
    /// destinations hold their whole payload (`complete` says which), the
    /// others (`incomplete` names them) may be partly written. Nothing is
    /// in flight when this is returned.
    #[error(
        "{source}; {done} of {total} destinations are complete, the others may be partly written: {}",
        list_names(incomplete)
    )]
    Incomplete {
        /// The first failure.
        #[source]
        source: Box<Error>,
        /// Destinations complete.
        done: usize,
        /// Destinations asked for.
        total: usize,
        /// The complete destinations: their indices in the call's list, in
        /// order.
        complete: Vec<usize>,
        /// The names of the others (a slice's with its bounds), in the
        /// call's order.
        incomplete: Vec<String>,
    },
    /// A drive's I/O thread is gone (it stopped after a fault, or the
    /// engine is shutting down): reads that need it fail at once.
    #[error("drive {device}: {reason}")]
    DriveStopped {
        /// The drive's device name.
        device: String,
        /// Why it stopped.
        reason: String,
    },
    /// An engine (or a ticket of one) was used in a process forked from the
    /// one that made it: its I/O threads and arenas exist only in the parent.
    #[error("weightstream engine used in a forked child (pid {child}; made in pid {parent}): its I/O threads and arenas exist only in the parent; open a new Engine in the child")]
    Forked {
        /// The process that made the engine.
        parent: u32,
        /// This process.
        child: u32,
    },
    /// The slot handed to a read cannot hold the tensor.
    #[error("tensor {tensor}: slot too small ({need} payload bytes, slot capacity {capacity})")]
    SlotTooSmall {
        /// The tensor.
        tensor: String,
        /// Its payload bytes.
        need: usize,
        /// The slot's capacity.
        capacity: usize,
    },
    /// No tensor of that name in the model. `suggestions` are the nearest
    /// names, best first (at most [`SUGGESTIONS`]): the name with a
    /// missing or extra `model.` prefix, then names that differ from it in
    /// one `.`-separated part (a layer or expert number, a projection),
    /// closest part first; `more` counts the near names not shown.
    #[error("no tensor named {name:?} in the model{}", near_names(suggestions, *more))]
    NoSuchTensor {
        /// The name asked for.
        name: String,
        /// The nearest names of the model, best first.
        suggestions: Vec<String>,
        /// Near names beyond those in `suggestions`.
        more: usize,
    },
    /// A tensor reference that is not one of this model's: made by another
    /// [`Model`](crate::Model) (its shard index and range would name other
    /// bytes here), or a part of a tensor whose range leaves the tensor.
    #[error("tensor {name:?}: this reference belongs to another model than the one opened from {} (or was edited to leave its tensor's bytes); use a TensorRef only with the Model it came from", escape(model))]
    ForeignTensor {
        /// The tensor's name.
        name: String,
        /// The primary directory of the model it was used with.
        model: PathBuf,
    },
    /// An expert of a mixture-of-experts model was asked for and is not
    /// there ([`Model::experts`](crate::Model::experts)).
    #[error("{0}")]
    Experts(ExpertsError),
    /// A payload cannot be viewed as the type asked for.
    #[error("tensor {tensor}: cannot view its payload as [{ty}]: {why}")]
    View {
        /// The tensor's name.
        tensor: String,
        /// The element type asked for.
        ty: &'static str,
        /// What does not fit (dtype, length or alignment).
        why: String,
    },
    /// A configuration value was refused.
    #[error("{0}")]
    Config(String),
    /// An arena handed out no slot: why, with its numbers
    /// ([`TakeError`]).
    #[error(transparent)]
    Take(#[from] TakeError),
    /// The kernel refused the memory for an arena: the bytes asked for,
    /// the limits in force, and what sets the size.
    #[error("{what}: mmap of {bytes} bytes refused: {source}; limits in force: {limits}; the size is set by {set_by}")]
    Alloc {
        /// What the memory was for (`an arena of 8 slots of 1052672 bytes`).
        what: String,
        /// Bytes asked of the kernel.
        bytes: usize,
        /// The limits that can refuse it (RLIMIT_AS, RLIMIT_DATA,
        /// RLIMIT_MEMLOCK, the memory cgroup), with their values.
        limits: String,
        /// The option (or the command's flag) that sets the size.
        set_by: String,
        /// The kernel's answer.
        #[source]
        source: std::io::Error,
    },
    /// The kernel refused to change whether a forked child inherits an
    /// arena's pages: a payload handed over that a child would not have
    /// (`MADV_DOFORK`), or a slot that could not be protected again before
    /// a read (`MADV_DONTFORK`).
    #[error("madvise({advice}) on {bytes} bytes of an arena refused: {source}")]
    ForkAdvice {
        /// `MADV_DOFORK` or `MADV_DONTFORK`.
        advice: &'static str,
        /// Bytes of the slot.
        bytes: usize,
        /// The kernel's answer.
        #[source]
        source: std::io::Error,
    },
    /// An expert cache could not serve a call
    /// ([`ExpertCache`](crate::ExpertCache)).
    #[error(transparent)]
    Cache(#[from] CacheError),
}

/// The most names an [`Error::Incomplete`] message lists (all of them are
/// in its `incomplete`).
const INCOMPLETE_SHOWN: usize = 8;

/// `a, b, c` (and how many more), for [`Error::Incomplete`]'s message.
fn list_names(names: &[String]) -> String {
    let mut out = names
        .iter()
        .take(INCOMPLETE_SHOWN)
        .map(escape)
        .collect::<Vec<_>>()
        .join(", ");
    if names.len() > INCOMPLETE_SHOWN {
        out.push_str(&format!(" and {} more", names.len() - INCOMPLETE_SHOWN));
    }
    out
}

/// The most names a [`Error::NoSuchTensor`] suggests.
pub const SUGGESTIONS: usize = 4;

/// `; did you mean "a" or "b"?` and how many more there are, or nothing.
fn near_names(suggestions: &[String], more: usize) -> String {
    let Some((last, first)) = suggestions.split_last() else {
        return String::new();
    };
    let quoted: Vec<String> = first.iter().map(|s| format!("{s:?}")).collect();
    let list = if quoted.is_empty() {
        format!("{last:?}")
    } else {
        format!("{} or {last:?}", quoted.join(", "))
    };
    let more = match more {
        0 => String::new(),
        1 => " (1 more name differs from it in one part)".to_string(),
        n => format!(" ({n} more names differ from it in one part)"),
    };
    format!("; did you mean {list}?{more}")
}

/// Why an expert cache could not serve a call
/// ([`ExpertCache`](crate::ExpertCache)).
#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum CacheError {
    /// Every entry is pinned by a handle or has a read in flight: there is
    /// no room for another expert until a handle is dropped.
    #[error("expert cache full: all {capacity} entries are in use ({pinned} pinned by live handles, {loading} with reads in flight); drop a handle or make the cache larger")]
    Full {
        /// Entries the budget holds.
        capacity: usize,
        /// Entries a live handle pins.
        pinned: usize,
        /// Entries whose read is in flight.
        loading: usize,
    },
    /// The expert's read failed (on every copy); nothing was cached.
    #[error("{expert}: read failed, nothing cached: {cause}")]
    ReadFailed {
        /// `layer 3 expert 17`.
        expert: String,
        /// The read's error.
        cause: String,
    },
    /// The budget holds no whole expert, or the model has none.
    #[error("expert cache: {0}")]
    Config(String),
}

/// Why an expert view or a part of it is not there
/// ([`Model::experts`](crate::Model::experts)).
#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum ExpertsError {
    /// No tensor name follows a known expert convention.
    #[error(
        "{}: no experts recognised among the model's {tensors} tensor(s){}: expected names such as \
         model.layers.<L>.mlp.experts.<E>.gate_proj.weight, model.layers.<L>.block_sparse_moe.experts.<E>.w1.weight, \
         model.layers.<L>.mlp.shared_expert.up_proj.weight or fused model.layers.<L>.mlp.experts.gate_up_proj",
        escape(dir),
        example.as_ref().map_or(String::new(), |e| format!(" (the first is {e:?})"))
    )]
    NoneRecognised {
        /// The model's primary directory.
        dir: PathBuf,
        /// How many tensors the model has.
        tensors: usize,
        /// The first tensor name, for a glance at the convention used.
        example: Option<String>,
    },
    /// A layer past the last one with experts.
    #[error("experts: layer {layer} is out of range: the model's experts are in layers numbered below {layers} ({layers} layer(s), 0 to {})", .layers.saturating_sub(1))]
    LayerOutOfRange {
        /// The layer asked for.
        layer: usize,
        /// One past the highest layer number that has experts.
        layers: usize,
    },
    /// A layer in range that has no experts (a dense layer).
    #[error("experts: layer {layer} has no experts (a dense layer?); {with} of the model's {layers} layer(s) have experts: {list}")]
    LayerWithoutExperts {
        /// The layer asked for.
        layer: usize,
        /// One past the highest layer number that has experts.
        layers: usize,
        /// How many layers have experts.
        with: usize,
        /// Those layers, as ranges (`3-60`).
        list: String,
    },
    /// An expert number the layer does not have.
    #[error("experts: layer {layer} has no expert {expert}: {}", routed(*.count, *.highest))]
    NoSuchExpert {
        /// The layer.
        layer: usize,
        /// The expert asked for.
        expert: usize,
        /// How many routed experts the layer has.
        count: usize,
        /// The highest expert number it has (0 when it has none).
        highest: usize,
    },
    /// A projection the expert does not have.
    #[error("experts: {expert} has no projection {projection:?}; it has {}", .have.iter().map(|p| format!("{p:?}")).collect::<Vec<_>>().join(", "))]
    NoSuchProjection {
        /// The expert (`layer 3 expert 17`, `layer 3 shared expert`).
        expert: String,
        /// The projection asked for.
        projection: String,
        /// The projections it has.
        have: Vec<String>,
    },
}

/// A layer's routed experts, in words.
fn routed(count: usize, highest: usize) -> String {
    match count {
        0 => "it has no routed experts (only shared ones)".to_string(),
        n if n == highest.saturating_add(1) => format!("it has {n} routed expert(s), numbered 0 to {highest}"),
        n => format!("it has {n} routed expert(s), numbered up to {highest} with gaps"),
    }
}

impl From<ExpertsError> for Error {
    fn from(e: ExpertsError) -> Self {
        Error::Experts(e)
    }
}

impl Error {
    pub(crate) fn io(path: impl Into<PathBuf>, op: &'static str, source: impl Into<std::io::Error>) -> Self {
        Error::Io {
            path: path.into(),
            op,
            source: source.into(),
        }
    }

    /// For an [`Error::Alloc`]: says instead that `set_by` sets the size (a
    /// caller that knows which of its options asked for it); any other
    /// error is returned as it is.
    pub fn size_set_by(self, set_by: impl Into<String>) -> Self {
        match self {
            Error::Alloc {
                what,
                bytes,
                limits,
                source,
                ..
            } => Error::Alloc {
                what,
                bytes,
                limits,
                set_by: set_by.into(),
                source,
            },
            e => e,
        }
    }

    pub(crate) fn catalog(path: impl Into<PathBuf>, cause: impl Into<String>) -> Self {
        Error::Catalog {
            path: path.into(),
            cause: cause.into(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    #[test]
    fn escape_shows_control_characters() {
        assert_eq!(escape(Path::new("/a\nb\tc")), "/a\\nb\\tc");
    }

    #[test]
    fn escape_shows_invalid_bytes_distinctly() {
        use std::os::unix::ffi::OsStrExt;
        let a = std::ffi::OsStr::from_bytes(b"/m/a\xff.safetensors");
        let b = std::ffi::OsStr::from_bytes(b"/m/a\xfe.safetensors");
        assert_eq!(escape(a), "/m/a\\xff.safetensors");
        assert_ne!(escape(a), escape(b));
        assert_eq!(escape("caf\u{e9}"), "caf\u{e9}");
    }
}
