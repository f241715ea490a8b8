//! `weightstream verify` for a placed model: every file the layout index
//! names re-checked against it (present, a regular file, its size, the
//! sha256 of its header bytes, the header valid; with `digest`, the sha256
//! of every tensor), the extras (size, sha256), a parked index (a re-shard
//! that did not finish), and the orphans. Each difference is named.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use super::plan::Range;
use super::FileNote;
use crate::error::Result;
use crate::error::{escape, serialize_escaped};
use crate::format::container::{ShardHeader, MAX_HEADER_LEN};
use crate::model::placed::{self as index, folder_state, LayoutIndex, LayoutKind, INDEX_FILE, PARKED_FILE};

/// One file of the layout, checked.
#[derive(Debug, Clone, serde::Serialize)]
pub struct FileCheck {
    /// The file's path (in its root's folder).
    #[serde(serialize_with = "serialize_escaped")]
    pub path: PathBuf,
    /// Root position (0: the primary).
    pub root: usize,
    /// `shard`, `layer`, `extras`, or `extra` (a non-shard file).
    pub kind: String,
    /// Its size in bytes, as found.
    pub size: u64,
    /// With `digest`: tensors hashed.
    pub tensors: usize,
    /// What differs from the index (empty: nothing).
    pub problems: Vec<String>,
}

/// What [`verify`] found.
#[derive(Debug, Clone, serde::Serialize)]
pub struct PlacedVerify {
    /// The primary folder checked.
    #[serde(serialize_with = "serialize_escaped")]
    pub dir: PathBuf,
    /// The layout its index names (`None`: no committed index).
    pub layout: Option<LayoutKind>,
    /// How many roots the index names.
    pub roots: usize,
    /// Every tensor's sha256 was checked too.
    pub digest: bool,
    /// Every file of the layout, checked.
    pub files: Vec<FileCheck>,
    /// A problem with the placement as a whole (a parked index...).
    pub problems: Vec<String>,
    /// Files in the placement folders that no index names (reported, never
    /// deleted).
    pub orphans: Vec<FileNote>,
}

impl PlacedVerify {
    /// Nothing differs (orphans are reported, not counted).
    pub fn is_clean(&self) -> bool {
        self.problems.is_empty() && self.files.iter().all(|f| f.problems.is_empty())
    }
}

/// Checks the placed model whose primary folder is `dir` against its
/// layout index; `Ok(None)` when `dir` is no placement folder. Problems
/// are reported, not returned as errors; an error means the check could
/// not run (the index unreadable...).
pub fn verify(dir: &Path, digest: bool) -> Result<Option<PlacedVerify>> {
    let st = folder_state(dir)?;
    let mut report = PlacedVerify {
        dir: dir.to_path_buf(),
        layout: None,
        roots: 0,
        digest,
        files: Vec::new(),
        problems: Vec::new(),
        orphans: Vec::new(),
    };
    if st.parked {
        report.problems.push(format!(
            "{PARKED_FILE} is here: a re-shard did not finish; run `weightstream place` again to repair it"
        ));
    }
    let Some(idx) = st.index else {
        if st.marker.is_none() && !st.parked {
            return Ok(None);
        }
        report.problems.push(format!(
            "no {INDEX_FILE}: this folder is no committed placement's primary{}",
            match &st.marker {
                Some(m) if m.position > 0 =>
                    format!(" (it is root {} of the placement of \"{}\")", m.position, m.primary),
                _ => String::new(),
            }
        ));
        return Ok(Some(report));
    };
    report.layout = Some(idx.layout);
    report.roots = idx.roots.len();
    // A folder the index names but whose marker does not prove it is not
    // read (the index is untrusted): a problem, and its files unchecked.
    let mut proven = Vec::with_capacity(idx.roots.len());
    for (k, proof) in index::prove_roots(&idx).into_iter().enumerate() {
        match proof {
            Ok(()) => proven.push(true),
            Err(why) => {
                report.problems.push(format!(
                    "root {k} \"{}\": {why}: not read (weightstream reads only folders it can prove it made for \
                     this model)",
                    escape(idx.folder_of(k))
                ));
                proven.push(false);
            }
        }
    }
    for f in &idx.files {
        let path = idx.folder_of(f.root).join(f.name.as_os_str());
        if !proven[f.root] {
            continue;
        }
        let kind = serde_json::to_value(f.kind)
            .ok()
            .and_then(|v| v.as_str().map(str::to_string))
            .unwrap_or_default();
        let mut check = FileCheck {
            path: path.clone(),
            root: f.root,
            kind,
            size: f.size,
            tensors: 0,
            problems: Vec::new(),
        };
        check_file(&idx, f, &path, digest, &mut check);
        report.files.push(check);
    }
    for e in &idx.extras {
        let path = idx.folder_of(0).join(e.name.as_os_str());
        if !proven[0] {
            continue;
        }
        let mut problems = Vec::new();
        match std::fs::symlink_metadata(&path) {
            Ok(m) if !m.file_type().is_file() => problems.push("not a regular file".to_string()),
            Ok(m) if m.len() != e.size => problems.push(format!("size {} (the index says {})", m.len(), e.size)),
            Ok(_) => match crate::storage::open::open_regular(&path, true) {
                Ok((file, _)) => {
                    // Streamed: the size is the index's (untrusted), so
                    // the file is never read whole into memory.
                    match index::sha256_of_exactly(&file, e.size) {
                        Ok(Some(sha)) if sha != e.sha256 => problems.push("content differs (sha256)".to_string()),
                        Ok(Some(_)) => {}
                        Ok(None) => problems.push(format!("changed size while read (the index says {})", e.size)),
                        Err(err) => problems.push(format!("cannot be read ({err})")),
                    }
                    crate::storage::files::drop_all_pages(&file);
                }
                Err(r) => problems.push(format!("cannot be opened ({r})")),
            },
            Err(err) if err.kind() == std::io::ErrorKind::NotFound => problems.push("missing".to_string()),
            Err(err) => problems.push(format!("cannot be read ({err})")),
        }
        report.files.push(FileCheck {
            path,
            root: 0,
            kind: "extra".into(),
            size: e.size,
            tensors: 0,
            problems,
        });
    }
    for (k, r) in idx.roots.iter().enumerate() {
        if !proven[k] {
            continue;
        }
        let Ok(rd) = std::fs::read_dir(r.folder.as_path()) else {
            continue;
        };
        for ent in rd.flatten() {
            let name = ent.file_name();
            if index::is_reserved(&name) || idx.names(k, &name) {
                continue;
            }
            let size = ent.metadata().map(|m| m.len()).unwrap_or(0);
            report.orphans.push(FileNote { path: ent.path(), size });
        }
    }
    report.orphans.sort_by(|a, b| a.path.cmp(&b.path));
    Ok(Some(report))
}

fn check_file(idx: &LayoutIndex, f: &index::IndexFile, path: &Path, digest: bool, check: &mut FileCheck) {
    let p = &mut check.problems;
    let (file, st) = match crate::storage::open::open_regular(path, true) {
        Ok(x) => x,
        Err(r) if r.errno() == Some(libc::ENOENT) => {
            p.push("missing".into());
            return;
        }
        Err(r) => {
            p.push(format!("cannot be opened ({r})"));
            return;
        }
    };
    let size = st.st_size as u64;
    if size != f.size {
        p.push(format!("size {size} (the index says {})", f.size));
    }
    let mut len = [0u8; 8];
    if let Err(e) = crate::format::container::read_exact_at(path, &file, &mut len, 0) {
        p.push(format!("header cannot be read ({e})"));
        return;
    }
    let n = u64::from_le_bytes(len);
    if n == 0 || n > MAX_HEADER_LEN || n > size.saturating_sub(8) {
        p.push(format!("header length {n} is not valid for a {size}-byte file"));
        return;
    }
    let mut raw = vec![0u8; 8 + n as usize];
    if let Err(e) = crate::format::container::read_exact_at(path, &file, &mut raw, 0) {
        p.push(format!("header cannot be read ({e})"));
        return;
    }
    crate::storage::files::drop_all_pages(&file);
    let sha = index::sha256_hex(&raw);
    if sha != f.header_sha256 {
        p.push(format!(
            "header differs (sha256 {}..., the index says {}...)",
            &sha[..12],
            &f.header_sha256[..12.min(f.header_sha256.len())]
        ));
    }
    let header = match ShardHeader::parse(path, raw, size) {
        Ok(h) => h,
        Err(e) => {
            p.push(format!("refused header: {e}"));
            return;
        }
    };
    if !digest {
        return;
    }
    let ranges: Vec<Range> = header
        .tensors
        .iter()
        .map(|t| Range {
            name: t.name.clone(),
            begin: header.data_start + t.begin,
            end: header.data_start + t.end,
        })
        .collect();
    match super::write::digest_ranges(path, &ranges) {
        Ok(have) => {
            check.tensors = have.len();
            let empty = BTreeMap::new();
            let want = idx.digests_of(f.name.as_os_str()).unwrap_or(&empty);
            if want.is_empty() {
                p.push("the index records no tensor digests for this file".into());
                return;
            }
            let mut differ: Vec<&String> = want.keys().filter(|k| have.get(*k) != want.get(*k)).collect();
            differ.extend(have.keys().filter(|k| !want.contains_key(*k)));
            if !differ.is_empty() {
                let shown: Vec<&str> = differ.iter().take(8).map(|s| s.as_str()).collect();
                check.problems.push(format!(
                    "{} tensor(s) differ from the index's sha256: {}{}",
                    differ.len(),
                    shown.join(", "),
                    if differ.len() > 8 { ", ..." } else { "" }
                ));
            }
        }
        Err(e) => check.problems.push(format!("tensors cannot be hashed ({e})")),
    }
}

impl std::fmt::Display for FileCheck {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} (root {}, {}): {}",
            escape(&self.path),
            self.root,
            self.kind,
            self.problems.join("; ")
        )
    }
}
