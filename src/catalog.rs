//! Many shards: tensor name -> (shard, absolute file range, dtype, shape).
//!
//! A tensor name present in two shards is an error naming both files,
//! unless the primary directory's `model.safetensors.index.json` maps the
//! name to one of them. `config.json`, tokenizer files and the index are
//! metadata of the primary directory only; they are never read as shards.

use std::collections::HashMap;
use std::fs::File;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use crate::container::ShardHeader;
use crate::dtype::Dtype;
use crate::error::{Error, Result};

/// File name of the sharded-model index.
pub const INDEX_FILE: &str = "model.safetensors.index.json";

/// One shard of the catalog.
#[derive(Debug, Clone)]
pub struct ShardInfo {
    /// The file as opened (a symlinked entry is resolved once, then opened
    /// with `O_NOFOLLOW`).
    pub path: PathBuf,
    /// The file name as listed in its directory.
    pub name: String,
    /// The path as listed (before resolving a link).
    pub listed: PathBuf,
    pub header: ShardHeader,
}

impl ShardInfo {
    /// The shard as the user sees it: the listed path, and the file it
    /// resolves to when that differs.
    pub fn describe(&self) -> String {
        if self.listed == self.path {
            self.listed.display().to_string()
        } else {
            format!("{} (-> {})", self.listed.display(), self.path.display())
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
/// component, and reads its header.
pub fn open_shard(path: &Path) -> Result<(File, ShardHeader)> {
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc_flags::O_NOFOLLOW | libc_flags::O_CLOEXEC)
        .open(path)
        .map_err(|e| Error::io(path, "open", e))?;
    let header = ShardHeader::read(path, &file)?;
    Ok((file, header))
}

pub(crate) mod libc_flags {
    use rustix::fs::OFlags;
    pub const O_NOFOLLOW: i32 = OFlags::NOFOLLOW.bits() as i32;
    pub const O_CLOEXEC: i32 = OFlags::CLOEXEC.bits() as i32;
    pub const O_DIRECT: i32 = OFlags::DIRECT.bits() as i32;
}

/// The `*.safetensors` files of a directory, sorted by name, each resolved to
/// the file it names (Hugging Face caches keep shards as links to blobs).
pub fn list_shards(dir: &Path) -> Result<Vec<(String, PathBuf, PathBuf)>> {
    let rd = std::fs::read_dir(dir).map_err(|e| Error::io(dir, "list model directory", e))?;
    let mut out = Vec::new();
    for entry in rd {
        let entry = entry.map_err(|e| Error::io(dir, "list model directory", e))?;
        let name = entry.file_name().to_string_lossy().into_owned();
        if !name.ends_with(".safetensors") {
            continue;
        }
        let listed = entry.path();
        let ft = entry.file_type().map_err(|e| Error::io(&listed, "stat", e))?;
        let path = if ft.is_symlink() {
            std::fs::canonicalize(&listed).map_err(|e| Error::io(&listed, "resolve link", e))?
        } else {
            listed.clone()
        };
        if !std::fs::metadata(&path)
            .map_err(|e| Error::io(&path, "stat", e))?
            .is_file()
        {
            continue;
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
                match chosen.and_then(|f| hs.iter().find(|(si, _)| shards[*si].name == *f)) {
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
            let mut missing: Vec<&String> = map.values().filter(|f| !shards.iter().any(|s| &&s.name == f)).collect();
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

/// `weight_map` of the primary's index, if there is one.
fn read_index(dir: &Path) -> Result<Option<HashMap<String, String>>> {
    let path = dir.join(INDEX_FILE);
    let text = match std::fs::read_to_string(&path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(Error::io(&path, "read index", e)),
    };
    #[derive(serde::Deserialize)]
    struct Index {
        weight_map: HashMap<String, String>,
    }
    let idx: Index = serde_json::from_str(&text).map_err(|e| Error::catalog(&path, format!("invalid index: {e}")))?;
    Ok(Some(idx.weight_map))
}

/// The number right after `key` in a tensor name (`index_after("model.layers.12.mlp", "layers.")`
/// is 12): layer and expert ids for routing keys and layer striping.
pub fn index_after(name: &str, key: &str) -> Option<u64> {
    let rest = &name[name.find(key)? + key.len()..];
    let end = rest.find(|c: char| !c.is_ascii_digit()).unwrap_or(rest.len());
    rest[..end].parse().ok()
}
