//! Many shards: tensor name -> (shard, absolute file range, dtype, shape).
//!
//! A tensor name present in two shards is an error naming both files,
//! unless the primary directory's `model.safetensors.index.json` maps the
//! name to one of them. `config.json`, tokenizer files and the index are
//! metadata of the primary directory only; they are never read as shards.

use std::collections::HashMap;
use std::ffi::{OsStr, OsString};
use std::fs::File;
use std::io::Read;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use rustix::fs::{FileType, OFlags, Stat};

use crate::container::ShardHeader;
use crate::dtype::Dtype;
use crate::error::{Error, Result};
use crate::layout::escape;

/// File name of the sharded-model index.
pub const INDEX_FILE: &str = "model.safetensors.index.json";

/// The largest `model.safetensors.index.json` read (64 MiB). Real indexes
/// are a few MB at most (one line per tensor name); the cap keeps a link
/// to `/dev/zero` or a runaway file from growing memory without bound.
pub const MAX_INDEX_LEN: u64 = 64 << 20;

/// One shard of the catalog.
#[derive(Debug, Clone)]
pub struct ShardInfo {
    /// The file as opened (a symlinked entry is resolved once, then opened
    /// with `O_NOFOLLOW`).
    pub path: PathBuf,
    /// The file name as listed in its directory (any bytes: names are not
    /// required to be UTF-8; show them with [`crate::layout::escape`]).
    pub name: OsString,
    /// The path as listed (before resolving a link).
    pub listed: PathBuf,
    pub header: ShardHeader,
}

impl ShardInfo {
    /// The shard as the user sees it: the listed path, and the file it
    /// resolves to when that differs.
    pub fn describe(&self) -> String {
        if self.listed == self.path {
            escape(&self.listed)
        } else {
            format!("{} (-> {})", escape(&self.listed), escape(&self.path))
        }
    }
}

/// Where one tensor's payload lives.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorRef {
    pub name: String,
    /// Index into [`Catalog::shards`].
    pub shard: usize,
    /// Absolute file offset of the payload.
    pub offset: u64,
    /// Payload length in bytes.
    pub len: u64,
    pub dtype: Dtype,
    pub shape: Vec<usize>,
    /// Position in the catalog's name order (a stable small id).
    pub index: usize,
}

/// All tensors of a model.
#[derive(Debug, Clone)]
pub struct Catalog {
    dir: PathBuf,
    shards: Vec<ShardInfo>,
    tensors: Vec<TensorRef>,
    by_name: HashMap<String, usize>,
}

/// Opens a shard read-only, close-on-exec, refusing a symlink at the last
/// component and anything but a regular file (opened non-blocking, then
/// checked with `fstat`), and reads its header.
pub fn open_shard(path: &Path) -> Result<(File, ShardHeader)> {
    let (file, _) = open_regular(path, true).map_err(|r| r.into_error(path))?;
    let header = ShardHeader::read(path, &file)?;
    Ok((file, header))
}

pub(crate) mod libc_flags {
    use rustix::fs::OFlags;
    pub const O_NOFOLLOW: i32 = OFlags::NOFOLLOW.bits() as i32;
    pub const O_CLOEXEC: i32 = OFlags::CLOEXEC.bits() as i32;
    pub const O_DIRECT: i32 = OFlags::DIRECT.bits() as i32;
    pub const O_NONBLOCK: i32 = OFlags::NONBLOCK.bits() as i32;
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
pub type ListedShard = (OsString, PathBuf, PathBuf);

/// The `*.safetensors` entries of a directory, sorted by name (as bytes),
/// each resolved to the file it names (Hugging Face caches keep shards as
/// links to blobs). An entry that is not a regular file (a directory, FIFO,
/// socket, device, or a link to one, or a dangling link) is an error naming
/// it: a model never opens silently with fewer shards.
pub fn list_shards(dir: &Path) -> Result<Vec<ListedShard>> {
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
        let path = if ft.is_symlink() {
            std::fs::canonicalize(&listed).map_err(|e| {
                Error::catalog(
                    &listed,
                    format!("is a link that cannot be resolved ({e}): a *.safetensors entry must name a shard file"),
                )
            })?
        } else {
            listed.clone()
        };
        let st = rustix::fs::stat(&path).map_err(|e| Error::io(&path, "stat", e))?;
        let ft = FileType::from_raw_mode(st.st_mode);
        if ft != FileType::RegularFile {
            let what = if path == listed {
                format!("is {}", kind_of(ft))
            } else {
                format!("links to {}, which is {}", escape(&path), kind_of(ft))
            };
            return Err(Error::catalog(
                &listed,
                format!("{what}, not a regular file: a *.safetensors entry must be a shard file (move or rename it)"),
            ));
        }
        out.push((name, listed, path));
    }
    out.sort();
    Ok(out)
}

impl Catalog {
    /// Builds the catalog of `dir` from already opened and validated shards.
    pub fn new(dir: &Path, shards: Vec<ShardInfo>) -> Result<Self> {
        let index = read_index(dir)?;
        // Every holder of every name first, so the index can pick any of them.
        let mut holders: HashMap<&str, Vec<(usize, &crate::container::TensorEntry)>> = HashMap::new();
        for (si, shard) in shards.iter().enumerate() {
            for t in &shard.header.tensors {
                holders.entry(t.name.as_str()).or_default().push((si, t));
            }
        }
        let mut tensors: Vec<TensorRef> = Vec::with_capacity(holders.len());
        for (name, hs) in &holders {
            let (si, t) = if hs.len() == 1 {
                hs[0]
            } else {
                let chosen = index.as_ref().and_then(|m| m.get(*name));
                match chosen.and_then(|f| hs.iter().find(|(si, _)| shards[*si].name == OsStr::new(f))) {
                    Some(&h) => h,
                    None => {
                        let listed: Vec<String> = hs.iter().map(|(si, _)| shards[*si].describe()).collect();
                        return Err(Error::catalog(
                            dir,
                            format!(
                                "tensor {name:?} is in {}{}",
                                listed.join(" and "),
                                match chosen {
                                    Some(f) => format!(", but {INDEX_FILE} maps it to {f:?}, which does not hold it"),
                                    None => format!(", and no {INDEX_FILE} says which to use"),
                                }
                            ),
                        ));
                    }
                }
            };
            let shard = &shards[si];
            tensors.push(TensorRef {
                name: t.name.clone(),
                shard: si,
                offset: shard.header.data_start + t.begin,
                len: t.len(),
                dtype: t.dtype,
                shape: t.shape.clone(),
                index: 0,
            });
        }
        drop(holders);
        if let Some(map) = &index {
            let mut missing: Vec<&String> = map
                .values()
                .filter(|f| !shards.iter().any(|s| s.name == OsStr::new(f.as_str())))
                .collect();
            missing.sort();
            missing.dedup();
            if !missing.is_empty() {
                return Err(Error::catalog(
                    dir.join(INDEX_FILE),
                    format!("names shard file(s) that are not in the model: {missing:?}"),
                ));
            }
        }
        tensors.sort_by(|a, b| a.name.cmp(&b.name));
        let mut by_name = HashMap::with_capacity(tensors.len());
        for (i, t) in tensors.iter_mut().enumerate() {
            t.index = i;
            by_name.insert(t.name.clone(), i);
        }
        Ok(Catalog {
            dir: dir.to_path_buf(),
            shards,
            tensors,
            by_name,
        })
    }

    /// The primary directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    pub fn shards(&self) -> &[ShardInfo] {
        &self.shards
    }

    /// Tensors sorted by name.
    pub fn tensors(&self) -> &[TensorRef] {
        &self.tensors
    }

    pub fn tensor(&self, name: &str) -> Result<&TensorRef> {
        self.by_name
            .get(name)
            .map(|&i| &self.tensors[i])
            .ok_or_else(|| Error::NoSuchTensor(name.to_string()))
    }

    /// Total payload bytes.
    pub fn total_bytes(&self) -> u64 {
        self.tensors.iter().map(|t| t.len).sum()
    }

    /// The largest payload among tensors whose name contains `filter`.
    pub fn largest(&self, filter: &str) -> Option<u64> {
        self.tensors
            .iter()
            .filter(|t| t.name.contains(filter))
            .map(|t| t.len)
            .max()
    }
}

/// `weight_map` of the primary's index, if there is one. The index is
/// opened like a shard (non-blocking, a regular file or refused; a link is
/// followed, as Hugging Face caches keep it as one) and read from the
/// descriptor with a cap of [`MAX_INDEX_LEN`] bytes.
fn read_index(dir: &Path) -> Result<Option<HashMap<String, String>>> {
    let path = dir.join(INDEX_FILE);
    let (file, st) = match open_regular(&path, false) {
        Ok(f) => f,
        Err(OpenRefusal::Io(_, e)) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(r) => return Err(r.into_error(&path)),
    };
    let too_big = |what: String| {
        Error::catalog(
            &path,
            format!("{what} the {MAX_INDEX_LEN}-byte limit for an index: refused"),
        )
    };
    if st.st_size as u64 > MAX_INDEX_LEN {
        return Err(too_big(format!("is {} bytes, over", st.st_size)));
    }
    let mut bytes = Vec::with_capacity(st.st_size as usize);
    (&file)
        .take(MAX_INDEX_LEN + 1)
        .read_to_end(&mut bytes)
        .map_err(|e| Error::io(&path, "read index", e))?;
    if bytes.len() as u64 > MAX_INDEX_LEN {
        return Err(too_big("grew while being read, past".to_string()));
    }
    #[derive(serde::Deserialize)]
    struct Index {
        weight_map: HashMap<String, String>,
    }
    let idx: Index =
        serde_json::from_slice(&bytes).map_err(|e| Error::catalog(&path, format!("invalid index: {e}")))?;
    Ok(Some(idx.weight_map))
}

/// The number right after `key` in a tensor name (`index_after("model.layers.12.mlp", "layers.")`
/// is 12): layer and expert ids for routing keys and layer striping.
pub fn index_after(name: &str, key: &str) -> Option<u64> {
    let rest = &name[name.find(key)? + key.len()..];
    let end = rest.find(|c: char| !c.is_ascii_digit()).unwrap_or(rest.len());
    rest[..end].parse().ok()
}
