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
    /// No tensor of that name in the model.
    #[error("no tensor named {0:?} in the model")]
    NoSuchTensor(String),
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
