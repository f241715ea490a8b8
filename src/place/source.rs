//! The model being placed: its shards (headers validated, the catalog built
//! as [`crate::Model::open`] builds it, so a source that would not open is
//! not placed), the extra files its directory holds (config, tokenizer, the
//! Hugging Face index), and its fingerprint.

use std::ffi::OsString;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use crate::error::{escape, Error, Result};
use crate::format::catalog::{Catalog, ShardInfo};
use crate::format::container::ShardHeader;
use crate::model::placed::{self as index, hex, MARKER_FILE};
use crate::storage::open::{list_shards, open_regular};

/// Extra (non-shard) files larger than this are not copied (warned): a
/// model directory may hold other formats of the same weights.
pub(crate) const MAX_EXTRA_LEN: u64 = 1 << 30;

/// One shard of the source.
#[derive(Debug)]
pub(crate) struct SrcShard {
    pub info: ShardInfo,
    pub size: u64,
    pub mtime: (i64, i64),
}

/// One extra file of the source directory.
#[derive(Debug, Clone)]
pub(crate) struct Extra {
    pub name: OsString,
    /// The file (a link resolved once).
    pub path: PathBuf,
    pub size: u64,
    pub mtime: (i64, i64),
}

/// The source, scanned.
#[derive(Debug)]
pub(crate) struct Source {
    /// Real path.
    pub real: PathBuf,
    pub dev: u64,
    pub catalog: Catalog,
    /// Same order as the catalog's shards.
    pub shards: Vec<SrcShard>,
    pub extras: Vec<Extra>,
    /// sha256 over every shard's (name, size, header sha256, mtime) and
    /// every extra's (name, size, mtime): a new download, an edit, a
    /// re-save change it; a change that keeps size, header and mtime does
    /// not (`--digest` compares the bytes).
    pub fingerprint: String,
    /// Entries not placed, each with why (also warned).
    pub skipped: Vec<String>,
}

fn mtime(m: &std::fs::Metadata) -> (i64, i64) {
    (m.mtime(), m.mtime_nsec())
}

/// Scans `dir`: every `*.safetensors` shard opened and its header
/// validated, the catalog built (a tensor in two shards without an index
/// saying which is refused, as at open), the extras listed.
pub(crate) fn scan(dir: &Path) -> Result<Source> {
    let meta = std::fs::metadata(dir).map_err(|e| Error::io(dir, "open source model directory", e))?;
    if !meta.is_dir() {
        return Err(Error::catalog(dir, "the source is not a directory"));
    }
    let real = std::fs::canonicalize(dir).map_err(|e| Error::io(dir, "resolve", e))?;
    for own in [index::INDEX_FILE, index::PARKED_FILE, MARKER_FILE] {
        if real.join(own).exists() {
            return Err(Error::catalog(
                dir,
                format!("is a placement folder ({own} is here): place from the original model directory"),
            ));
        }
    }
    let mut shards = Vec::new();
    let mut infos = Vec::new();
    for (name, listed, path) in list_shards(&real)? {
        // As `Model::open` opens a shard: no link at the last component, a
        // regular file (checked before a byte is read), its header read.
        let (file, _) = open_regular(&path, true).map_err(|r| r.into_error(&path))?;
        let header = ShardHeader::read(&path, &file)?;
        // The header was read buffered: drop it and its read-ahead.
        crate::storage::files::drop_all_pages(&file);
        let m = file.metadata().map_err(|e| Error::io(&path, "fstat", e))?;
        shards.push(SrcShard {
            info: ShardInfo {
                path: path.clone(),
                name: name.clone(),
                listed: listed.clone(),
                header: header.clone(),
            },
            size: m.len(),
            mtime: mtime(&m),
        });
        infos.push(ShardInfo {
            path,
            name,
            listed,
            header,
        });
    }
    if shards.is_empty() {
        return Err(Error::catalog(dir, "no *.safetensors shards in the source directory"));
    }
    let catalog = Catalog::new(&real, infos)?;
    let mut extras = Vec::new();
    let mut skipped = Vec::new();
    let rd = std::fs::read_dir(&real).map_err(|e| Error::io(&real, "list source directory", e))?;
    let mut entries: Vec<_> = rd
        .collect::<std::io::Result<Vec<_>>>()
        .map_err(|e| Error::io(&real, "list source directory", e))?;
    entries.sort_by_key(|e| e.file_name());
    for e in entries {
        let name = e.file_name();
        let b = name.as_bytes();
        if b.ends_with(b".safetensors") {
            continue;
        }
        let listed = e.path();
        let skip = |why: String| format!("{}: {why}; not placed", escape(&listed));
        if b.starts_with(b".") {
            skipped.push(skip("a hidden entry".into()));
            continue;
        }
        if index::is_reserved(&name) {
            skipped.push(skip("a name weightstream keeps for itself".into()));
            continue;
        }
        let m = match std::fs::metadata(&listed) {
            Ok(m) => m,
            Err(err) => {
                skipped.push(skip(format!("cannot be read ({err})")));
                continue;
            }
        };
        if m.is_dir() {
            skipped.push(skip(
                "a directory (only the top level of the model directory is placed)".into(),
            ));
            continue;
        }
        if !m.is_file() {
            skipped.push(skip("not a regular file".into()));
            continue;
        }
        if m.len() > MAX_EXTRA_LEN {
            skipped.push(skip(format!(
                "{} bytes, over the {MAX_EXTRA_LEN}-byte limit for a non-shard file (other weights?)",
                m.len()
            )));
            continue;
        }
        let path = std::fs::canonicalize(&listed).map_err(|err| Error::io(&listed, "resolve", err))?;
        extras.push(Extra {
            name,
            path,
            size: m.len(),
            mtime: mtime(&m),
        });
    }
    for s in &skipped {
        tracing::warn!("{s}");
    }
    let fingerprint = fingerprint(&shards, &extras);
    Ok(Source {
        real,
        dev: meta.dev(),
        catalog,
        shards,
        extras,
        fingerprint,
        skipped,
    })
}

fn fingerprint(shards: &[SrcShard], extras: &[Extra]) -> String {
    use sha2::Digest;
    let mut h = sha2::Sha256::new();
    h.update(b"weightstream-source/1\n");
    for s in shards {
        h.update(format!(
            "shard {} {} {} {}.{}\n",
            hex(s.info.name.as_bytes()),
            s.size,
            index::sha256_hex(&s.info.header.raw),
            s.mtime.0,
            s.mtime.1
        ));
    }
    for e in extras {
        h.update(format!(
            "extra {} {} {}.{}\n",
            hex(e.name.as_bytes()),
            e.size,
            e.mtime.0,
            e.mtime.1
        ));
    }
    hex(&h.finalize())
}
