//! Opening files as weightstream opens shards: read-only, close-on-exec,
//! non-blocking until `fstat` says the file is regular (a FIFO or a device
//! can neither block the open nor be read as a shard), links resolved once;
//! and listing a directory's `*.safetensors` entries.

use std::ffi::OsString;
use std::fs::File;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use rustix::fs::{FileType, OFlags, Stat};

use crate::error::{escape, Error, Result};

pub(crate) mod libc_flags {
    use rustix::fs::OFlags;
    pub(crate) const O_NOFOLLOW: i32 = OFlags::NOFOLLOW.bits() as i32;
    pub(crate) const O_CLOEXEC: i32 = OFlags::CLOEXEC.bits() as i32;
    pub(crate) const O_DIRECT: i32 = OFlags::DIRECT.bits() as i32;
    pub(crate) const O_NONBLOCK: i32 = OFlags::NONBLOCK.bits() as i32;
}

/// What a file is, in words, for refusals ("a FIFO", "a directory", ...).
pub(crate) fn kind_of(ft: FileType) -> &'static str {
    match ft {
        FileType::RegularFile => "a regular file",
        FileType::Directory => "a directory",
        FileType::Symlink => "a symbolic link",
        FileType::Fifo => "a FIFO",
        FileType::Socket => "a socket",
        FileType::CharacterDevice => "a character device",
        FileType::BlockDevice => "a block device",
        _ => "not a file of a known type",
    }
}

/// Why a file was not opened: it is not a regular file, or a system call
/// failed. Shown without the path (callers name it).
#[derive(Debug)]
pub(crate) enum OpenRefusal {
    /// `open` or `fstat` failed.
    Io(&'static str, std::io::Error),
    /// It is not a regular file (the words of [`kind_of`]).
    NotRegular(&'static str),
}

impl std::fmt::Display for OpenRefusal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            OpenRefusal::Io(op, e) => write!(f, "{op}: {e}"),
            OpenRefusal::NotRegular(kind) => write!(f, "is {kind}, not a regular file"),
        }
    }
}

impl OpenRefusal {
    /// The errno of a failed system call.
    pub(crate) fn errno(&self) -> Option<i32> {
        match self {
            OpenRefusal::Io(_, e) => e.raw_os_error(),
            OpenRefusal::NotRegular(_) => None,
        }
    }

    /// The crate's error, naming `path`.
    pub(crate) fn into_error(self, path: &Path) -> Error {
        match self {
            OpenRefusal::Io(op, e) => Error::io(path, op, e),
            OpenRefusal::NotRegular(_) => Error::catalog(path, self.to_string()),
        }
    }
}

/// Opens `path` read-only, close-on-exec and non-blocking (so a FIFO or a
/// device cannot block the open), with `O_NOFOLLOW` when `nofollow` (links
/// already resolved), `fstat`s the descriptor and refuses anything but a
/// regular file before a byte is read; then clears `O_NONBLOCK`, so later
/// reads behave as on any file. `extra` adds open flags (`O_DIRECT`).
/// Returns the file and its `fstat`.
pub(crate) fn open_regular_with(path: &Path, nofollow: bool, extra: i32) -> Result<(File, Stat), OpenRefusal> {
    let mut flags = libc_flags::O_CLOEXEC | libc_flags::O_NONBLOCK | extra;
    if nofollow {
        flags |= libc_flags::O_NOFOLLOW;
    }
    let file = match std::fs::OpenOptions::new().read(true).custom_flags(flags).open(path) {
        Ok(f) => f,
        Err(e) => {
            // A socket refuses open(2) with ENXIO: say what it is instead.
            if e.raw_os_error() == Some(libc::ENXIO) {
                if let Ok(st) = rustix::fs::stat(path) {
                    let ft = FileType::from_raw_mode(st.st_mode);
                    if ft != FileType::RegularFile {
                        return Err(OpenRefusal::NotRegular(kind_of(ft)));
                    }
                }
            }
            return Err(OpenRefusal::Io("open", e));
        }
    };
    let st = rustix::fs::fstat(&file).map_err(|e| OpenRefusal::Io("fstat", e.into()))?;
    let ft = FileType::from_raw_mode(st.st_mode);
    if ft != FileType::RegularFile {
        return Err(OpenRefusal::NotRegular(kind_of(ft)));
    }
    let fl = rustix::fs::fcntl_getfl(&file).map_err(|e| OpenRefusal::Io("fcntl(F_GETFL)", e.into()))?;
    rustix::fs::fcntl_setfl(&file, fl - OFlags::NONBLOCK).map_err(|e| OpenRefusal::Io("fcntl(F_SETFL)", e.into()))?;
    Ok((file, st))
}

/// [`open_regular_with`] without extra flags.
pub(crate) fn open_regular(path: &Path, nofollow: bool) -> Result<(File, Stat), OpenRefusal> {
    open_regular_with(path, nofollow, 0)
}

/// One `*.safetensors` entry of a directory: its name as listed, the path
/// as listed, and the file it names (a link resolved once).
pub(crate) type ListedShard = (OsString, PathBuf, PathBuf);

/// The `*.safetensors` entries of a directory, sorted by name (as bytes),
/// each resolved to the file it names (Hugging Face caches keep shards as
/// links to blobs). An entry that is not a regular file (a directory, FIFO,
/// socket, device, or a link to one, or a dangling link) is an error naming
/// it: a model never opens silently with fewer shards.
pub(crate) fn list_shards(dir: &Path) -> Result<Vec<ListedShard>> {
    let rd = std::fs::read_dir(dir).map_err(|e| Error::io(dir, "list model directory", e))?;
    let mut out = Vec::new();
    for entry in rd {
        let entry = entry.map_err(|e| Error::io(dir, "list model directory", e))?;
        let name = entry.file_name();
        if !name.as_bytes().ends_with(b".safetensors") {
            continue;
        }
        let listed = entry.path();
        let ft = entry.file_type().map_err(|e| Error::io(&listed, "stat", e))?;
        let path = resolve_shard(&listed, ft.is_symlink(), "a *.safetensors entry")?;
        out.push((name, listed, path));
    }
    out.sort();
    Ok(out)
}

/// The shard file `listed` names (a link resolved once, as Hugging Face
/// caches keep shards): it must be a regular file, whatever its name; an
/// error naming it otherwise (`what`: how the path came, for the message).
pub(crate) fn resolve_shard(listed: &Path, is_link: bool, what: &str) -> Result<PathBuf> {
    let path = if is_link {
        std::fs::canonicalize(listed).map_err(|e| {
            Error::catalog(
                listed,
                format!("is a link that cannot be resolved ({e}): {what} must name a shard file"),
            )
        })?
    } else {
        listed.to_path_buf()
    };
    let st = rustix::fs::stat(&path).map_err(|e| Error::io(&path, "stat", e))?;
    let ft = FileType::from_raw_mode(st.st_mode);
    if ft != FileType::RegularFile {
        let is = if path == listed {
            format!("is {}", kind_of(ft))
        } else {
            format!("links to {}, which is {}", escape(&path), kind_of(ft))
        };
        return Err(Error::catalog(
            listed,
            format!("{is}, not a regular file: {what} must be a shard file (move or rename it)"),
        ));
    }
    Ok(path)
}

/// Opens a file for O_DIRECT reads as weightstream opens shards: read-only,
/// close-on-exec, no symbolic link at the last component, and non-blocking
/// until `fstat` says it is a regular file (anything else is refused before
/// a byte is read).
pub fn open_direct(path: &Path) -> std::io::Result<File> {
    open_direct_checked(path).map(|(f, _)| f)
}

pub(crate) fn open_direct_checked(path: &Path) -> std::io::Result<(File, rustix::fs::Stat)> {
    open_regular_with(path, true, libc_flags::O_DIRECT).map_err(|r| match r {
        OpenRefusal::Io(_, e) => e,
        r @ OpenRefusal::NotRegular(_) => std::io::Error::other(r.to_string()),
    })
}
