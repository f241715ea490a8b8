//! Many shards: tensor name -> (shard, absolute file range, dtype, shape).
//!
//! A tensor name present in two shards is an error naming both files,
//! unless the primary directory's `model.safetensors.index.json` maps the
//! name to one of them. `config.json`, tokenizer files and the index are
//! metadata of the primary directory only; they are never read as shards.

use std::collections::HashMap;
use std::ffi::{OsStr, OsString};
use std::io::Read;
use std::path::{Path, PathBuf};

use crate::error::{escape, Error, Result};
use crate::format::container::ShardHeader;
use crate::format::dtype::Dtype;
use crate::storage::open::{open_regular, OpenRefusal};

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
    /// required to be UTF-8; [`ShardInfo::describe`] shows them escaped).
    pub name: OsString,
    /// The path as listed (before resolving a link).
    pub listed: PathBuf,
    /// The validated header.
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
    /// The tensor's name.
    pub name: String,
    /// Index into [`Catalog::shards`].
    pub shard: usize,
    /// Absolute file offset of the payload.
    pub offset: u64,
    /// Payload length in bytes.
    pub len: u64,
    /// Element type.
    pub dtype: Dtype,
    /// Shape, in elements.
    pub shape: Vec<usize>,
    /// Position in the catalog's name order (a stable small id).
    pub index: usize,
}

impl TensorRef {
    /// Bytes `range` of this tensor's payload (relative to its first byte),
    /// as a reference an engine reads like any other (the same in-place,
    /// EOF and alignment rules). The dtype is kept when the range holds
    /// whole elements (shape: one dimension of that many), else it becomes
    /// `U8` (shape: the byte count). An empty or out-of-payload range is an
    /// error naming the tensor.
    pub fn byte_range(&self, range: std::ops::Range<u64>) -> Result<TensorRef> {
        if range.start >= range.end || range.end > self.len {
            return Err(Error::Config(format!(
                "tensor {}: byte range {}..{} is not inside its {} bytes",
                self.name, range.start, range.end, self.len
            )));
        }
        let len = range.end - range.start;
        let bits = self.dtype.bits() as u64;
        let whole = (range.start * 8).is_multiple_of(bits) && (len * 8).is_multiple_of(bits);
        let (dtype, shape) = if whole {
            (self.dtype, vec![(len * 8 / bits) as usize])
        } else {
            (Dtype::U8, vec![len as usize])
        };
        Ok(TensorRef {
            offset: self.offset + range.start,
            len,
            dtype,
            shape,
            ..self.clone()
        })
    }

    /// Rows `rows` of this tensor (its first dimension), as tensor-parallel
    /// loaders slice a weight: the shape keeps every other dimension. A
    /// scalar, a range outside the first dimension, or a row that is not a
    /// whole number of bytes (sub-byte dtypes) is an error naming the tensor.
    pub fn rows(&self, rows: std::ops::Range<usize>) -> Result<TensorRef> {
        let Some((&first, rest)) = self.shape.split_first() else {
            return Err(Error::Config(format!(
                "tensor {} is a scalar: it has no rows",
                self.name
            )));
        };
        if rows.start >= rows.end || rows.end > first {
            return Err(Error::Config(format!(
                "tensor {}: rows {}..{} are not inside its {first} rows",
                self.name, rows.start, rows.end
            )));
        }
        let row_bits = rest
            .iter()
            .try_fold(self.dtype.bits() as u64, |acc, &d| acc.checked_mul(d as u64))
            .filter(|b| b.is_multiple_of(8))
            .ok_or_else(|| {
                Error::Config(format!(
                    "tensor {}: a row of shape {rest:?} of {} is not a whole number of bytes",
                    self.name,
                    self.dtype.name()
                ))
            })?;
        let row = row_bits / 8;
        let mut shape = self.shape.clone();
        shape[0] = rows.end - rows.start;
        Ok(TensorRef {
            offset: self.offset + rows.start as u64 * row,
            len: (rows.end - rows.start) as u64 * row,
            shape,
            ..self.clone()
        })
    }

    /// Whether this reference reads (part of) `whole`'s payload: the same
    /// tensor (name, shard, catalog index), its bytes inside `whole`'s.
    pub(crate) fn is_part_of(&self, whole: &TensorRef) -> bool {
        self.index == whole.index
            && self.shard == whole.shard
            && self.name == whole.name
            && self.offset >= whole.offset
            && self
                .offset
                .checked_add(self.len)
                .is_some_and(|end| end <= whole.offset + whole.len)
    }
}

/// All tensors of a model.
#[derive(Debug, Clone)]
pub struct Catalog {
    dir: PathBuf,
    shards: Vec<ShardInfo>,
    tensors: Vec<TensorRef>,
    by_name: HashMap<String, usize>,
}

impl Catalog {
    /// Builds the catalog of `dir` from already opened and validated shards
    /// ([`Model::open`](crate::Model::open) does; not a stable API).
    #[doc(hidden)]
    pub fn new(dir: &Path, shards: Vec<ShardInfo>) -> Result<Self> {
        let index = read_index(dir)?;
        // Every holder of every name first, so the index can pick any of them.
        let mut holders: HashMap<&str, Vec<(usize, &crate::format::container::TensorEntry)>> = HashMap::new();
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

    /// The shards, in name order (a tensor's `shard` indexes this).
    pub fn shards(&self) -> &[ShardInfo] {
        &self.shards
    }

    /// Tensors sorted by name.
    pub fn tensors(&self) -> &[TensorRef] {
        &self.tensors
    }

    /// Looks a tensor up by name; [`Error::NoSuchTensor`](crate::Error::NoSuchTensor) when absent.
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
pub(crate) fn index_after(name: &str, key: &str) -> Option<u64> {
    let rest = &name[name.find(key)? + key.len()..];
    let end = rest.find(|c: char| !c.is_ascii_digit()).unwrap_or(rest.len());
    rest[..end].parse().ok()
}
