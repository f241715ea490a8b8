//! The layout index: the commit point of a placed model (written by
//! `place`, the layer above), and what [`Model::open`](crate::Model::open)
//! reads to find a placed model's roots. The format lives here, beside
//! the reader, so that `model` needs nothing from above it.
//!
//! One JSON file, [`INDEX_FILE`], in the primary folder (root 0). It names
//! the roots (in order), every file of the layout with its root, size and
//! the sha256 of its raw header bytes (length prefix included), the extra
//! files the primary keeps (config, tokenizer, the Hugging Face index) with
//! their sha256, the sha256 of every tensor written, and the fingerprint of
//! the source it was placed from. Every file it names exists at every
//! instant (see `place/commit.rs`); a folder whose index was parked
//! ([`PARKED_FILE`]) or never committed is a miss for readers, never a
//! stale hit.
//!
//! Names are bytes: file and path names that are not UTF-8 are stored as
//! `{"hex": "..."}` objects (see [`OsName`]). The index is untrusted input
//! when read back: its size is capped, and every name must be one plain
//! path component (no `/`, `.` or `..`), so a crafted index cannot make a
//! re-run write or delete outside its folders.

use std::collections::BTreeMap;
use std::ffi::{OsStr, OsString};
use std::io::Read;
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::ffi::{OsStrExt, OsStringExt};
use std::path::{Path, PathBuf};

use rustix::fs::{FileType, Mode, OFlags};

use crate::config::ModelConfig;
use crate::error::{escape, Error, Result};
use crate::storage::open::{kind_of, list_shards, ListedShard};

/// The layout index, in the primary folder.
pub const INDEX_FILE: &str = "weightstream-layout.json";
/// The layout index parked while a content re-shard replaces files it names.
pub const PARKED_FILE: &str = "weightstream-layout.json.resharding";
/// The marker every placement folder holds.
pub const MARKER_FILE: &str = "weightstream-marker.json";
/// Prefix of the temporary files a placement writes (then renames).
pub(crate) const TEMP_PREFIX: &str = ".weightstream-tmp.";
/// The format tag of [`LayoutIndex`].
pub(crate) const INDEX_FORMAT: &str = "weightstream-layout/1";
/// Largest index (or marker) read back: 64 MiB, as the Hugging Face index.
pub(crate) const MAX_INDEX_LEN: u64 = crate::format::catalog::MAX_INDEX_LEN;
/// Most roots a placement may have (the most copy ranks a model opens).
pub(crate) const MAX_ROOTS: usize = crate::config::MAX_COPY_RANKS;

/// How a model is laid out over its roots.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LayoutKind {
    /// A full copy of every shard on each root (root 0 also keeps the
    /// extras); read as mirrors: every read may use every drive.
    Mirror,
    /// Each shard on one root, bytes balanced, largest first.
    Split,
    /// Re-sharded into one file per decoder layer, layer i on root i mod N.
    Layers,
}

impl LayoutKind {
    /// The layout's name: `mirror`, `split` or `layers`.
    pub fn name(self) -> &'static str {
        match self {
            LayoutKind::Mirror => "mirror",
            LayoutKind::Split => "split",
            LayoutKind::Layers => "layers",
        }
    }
}

impl std::str::FromStr for LayoutKind {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s.trim().to_ascii_lowercase().as_str() {
            "mirror" => Ok(LayoutKind::Mirror),
            "split" => Ok(LayoutKind::Split),
            "layers" => Ok(LayoutKind::Layers),
            other => Err(Error::Config(format!(
                "layout {other:?}: expected mirror, split or layers"
            ))),
        }
    }
}

impl std::fmt::Display for LayoutKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// What each placement folder holds about itself.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub(crate) struct Marker {
    pub(crate) format: String,
    /// The source directory (real path) whose sha256 names the folder.
    pub(crate) source: OsName,
    /// Fingerprint of the source when this folder was last written.
    pub(crate) source_fingerprint: String,
    /// This root's position (0: the primary).
    pub(crate) position: usize,
    pub(crate) n_roots: usize,
    /// The primary folder (root 0's), which holds the layout index.
    pub(crate) primary: OsName,
    pub(crate) layout: LayoutKind,
    /// The binding that makes the marker a proof (see [`Marker::proves`]):
    /// the root's real path, the folder's name in it, and the folder's
    /// inode when the marker was written. Absent in markers written before
    /// the binding existed: such a marker proves nothing.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) root: Option<OsName>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) folder: Option<OsName>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) folder_ino: Option<u64>,
}

/// The format tag of [`Marker`].
pub(crate) const MARKER_FORMAT: &str = "weightstream-marker/1";

impl Marker {
    pub(crate) fn parse(path: &Path, bytes: &[u8]) -> Result<Self> {
        let m: Marker = serde_json::from_slice(bytes)
            .map_err(|e| Error::catalog(path, format!("not a weightstream placement marker: {e}")))?;
        if m.format != MARKER_FORMAT {
            return Err(Error::catalog(
                path,
                format!("marker format {:?}, expected {MARKER_FORMAT:?}", m.format),
            ));
        }
        Ok(m)
    }

    /// Whether this marker proves that the folder `name` of `root`, whose
    /// inode is `ino`, is a placement folder weightstream made for the
    /// model whose source (real path) is `source`: the marker names that
    /// source, that root, that folder name, and that inode, and the folder
    /// name is the one weightstream derives from the source
    /// ([`folder_name`]). A marker copied into another directory (another
    /// inode), one of another model, or one without the binding proves
    /// nothing. `Err` says why, for a warning.
    pub(crate) fn proves(&self, source: &Path, root: &Path, name: &OsStr, ino: u64) -> std::result::Result<(), String> {
        let want_name = folder_name(source);
        if name != want_name {
            return Err(format!(
                "its name is not \"{}\", the folder name of the model \"{}\"",
                escape(&want_name),
                escape(source)
            ));
        }
        let (Some(r), Some(f), Some(i)) = (&self.root, &self.folder, self.folder_ino) else {
            return Err("its marker is not bound to the folder (written by an older weightstream)".into());
        };
        if self.source.as_path() != source {
            return Err(format!("its marker names another model (\"{}\")", self.source));
        }
        if r.as_path() != root || f.as_os_str() != name {
            return Err(format!("its marker names another folder (\"{}\" in \"{}\")", f, r));
        }
        if i != ino {
            return Err(format!(
                "its marker was written for another directory (inode {i}, this one is {ino}): a copy, or a folder \
                 made again"
            ));
        }
        Ok(())
    }
}

/// The per-model folder name: `<basename>-<12 hex of sha256(realpath of
/// the source)>` (the basename cut to 200 bytes, so the name fits a
/// filesystem's 255).
pub fn folder_name(source_real: &Path) -> OsString {
    let base = source_real.file_name().map_or(&b"model"[..], |b| b.as_bytes());
    let base = &base[..base.len().min(200)];
    let digest = sha256_hex(source_real.as_os_str().as_bytes());
    let mut v = base.to_vec();
    v.push(b'-');
    v.extend_from_slice(&digest.as_bytes()[..12]);
    OsString::from_vec(v)
}

/// A file or path name, kept as bytes. Serialised as a JSON string when it
/// is UTF-8, else as `{"hex": "<bytes in hex>"}`: lossless both ways.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct OsName(pub OsString);

impl OsName {
    /// The name.
    pub fn as_os_str(&self) -> &OsStr {
        &self.0
    }

    /// The name as a path.
    pub fn as_path(&self) -> &Path {
        Path::new(&self.0)
    }
}

impl From<&OsStr> for OsName {
    fn from(s: &OsStr) -> Self {
        OsName(s.to_os_string())
    }
}

impl From<&Path> for OsName {
    fn from(p: &Path) -> Self {
        OsName(p.as_os_str().to_os_string())
    }
}

impl std::fmt::Display for OsName {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&escape(&self.0))
    }
}

impl serde::Serialize for OsName {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        match self.0.to_str() {
            Some(t) => s.serialize_str(t),
            None => {
                use serde::ser::SerializeMap;
                let mut m = s.serialize_map(Some(1))?;
                m.serialize_entry("hex", &hex(self.0.as_bytes()))?;
                m.end()
            }
        }
    }
}

impl<'de> serde::Deserialize<'de> for OsName {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        #[derive(serde::Deserialize)]
        #[serde(untagged)]
        enum Repr {
            Text(String),
            Hex { hex: String },
        }
        match Repr::deserialize(d)? {
            Repr::Text(t) => Ok(OsName(OsString::from(t))),
            Repr::Hex { hex } => unhex(&hex)
                .map(|b| OsName(OsString::from_vec(b)))
                .ok_or_else(|| serde::de::Error::custom(format!("{hex:?} is not an even number of hex digits"))),
        }
    }
}

/// Lower-case hex of `b`.
pub(crate) fn hex(b: &[u8]) -> String {
    use std::fmt::Write;
    let mut s = String::with_capacity(b.len() * 2);
    for x in b {
        let _ = write!(s, "{x:02x}");
    }
    s
}

fn unhex(s: &str) -> Option<Vec<u8>> {
    if !s.len().is_multiple_of(2) {
        return None;
    }
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(s.get(i..i + 2)?, 16).ok())
        .collect()
}

/// sha256 of `b`, hex.
pub(crate) fn sha256_hex(b: &[u8]) -> String {
    use sha2::Digest;
    hex(&sha2::Sha256::digest(b))
}

/// sha256 (hex) of the next `len` bytes of `file` (from its current
/// offset), streamed through a 1 MiB buffer: memory stays bounded whatever
/// `len` an index records. `Ok(None)` when the file holds fewer.
pub(crate) fn sha256_of_prefix(file: &std::fs::File, len: u64) -> std::io::Result<Option<String>> {
    use sha2::Digest;
    let mut h = sha2::Sha256::new();
    let mut buf = vec![0u8; (1 << 20).min(len.max(1) as usize)];
    let mut left = len;
    let mut r = file;
    while left > 0 {
        let want = buf.len().min(usize::try_from(left).unwrap_or(usize::MAX));
        let got = match r.read(&mut buf[..want]) {
            Ok(0) => return Ok(None),
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        };
        h.update(&buf[..got]);
        left -= got as u64;
    }
    Ok(Some(hex(&h.finalize())))
}

/// sha256 (hex) of exactly the next `len` bytes of `file`, which must end
/// there: `Ok(None)` when it holds fewer bytes, or more (it grew, or was
/// not the size it was checked to be).
pub(crate) fn sha256_of_exactly(file: &std::fs::File, len: u64) -> std::io::Result<Option<String>> {
    let Some(sha) = sha256_of_prefix(file, len)? else {
        return Ok(None);
    };
    let (mut one, mut r) = ([0u8; 1], file);
    loop {
        match r.read(&mut one) {
            Ok(0) => return Ok(Some(sha)),
            Ok(_) => return Ok(None),
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        }
    }
}

/// What a file of the layout holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FileKind {
    /// A source shard copied byte for byte (mirror, split).
    Shard,
    /// One decoder layer's tensors, re-sharded (layers).
    Layer,
    /// The tensors of no decoder layer: embeddings, head, norms (layers).
    Extras,
}

/// One root of a placement, in order (root 0 is the primary).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct IndexRoot {
    /// The root directory (its real path).
    pub path: OsName,
    /// The placement's folder on it: `path/<folder name>`.
    pub folder: OsName,
}

/// One safetensors file of the layout.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct IndexFile {
    /// The file name (in the folder of its root).
    pub name: OsName,
    /// Index into [`LayoutIndex::roots`].
    pub root: usize,
    /// Its size in bytes.
    pub size: u64,
    /// sha256 of the raw header bytes (8-byte length prefix included).
    pub header_sha256: String,
    /// What it holds.
    pub kind: FileKind,
    /// The decoder layer a [`FileKind::Layer`] file holds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub layer: Option<u64>,
}

/// A non-shard file the primary keeps (config, tokenizer, index).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct IndexExtra {
    /// The file name (in the primary folder).
    pub name: OsName,
    /// Its size in bytes.
    pub size: u64,
    /// sha256 of its bytes, hex.
    pub sha256: String,
}

/// sha256 of every tensor of one file name (the same for every copy).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct FileDigests {
    /// The file name.
    pub name: OsName,
    /// Tensor name -> sha256 of its payload, hex.
    pub tensors: BTreeMap<String, String>,
}

/// The layout index (see the module documentation).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct LayoutIndex {
    /// The format tag, `weightstream-layout/1`.
    pub format: String,
    /// The layout.
    pub layout: LayoutKind,
    /// The source directory placed (its real path).
    pub source: OsName,
    /// The fingerprint of the source when placed (sha256 over its files'
    /// names, sizes, mtimes and header hashes; see `place/source.rs`).
    pub source_fingerprint: String,
    /// The folder name used on every root.
    pub folder: OsName,
    /// The roots, primary first.
    pub roots: Vec<IndexRoot>,
    /// Every safetensors file of the layout.
    pub files: Vec<IndexFile>,
    /// The extra files of the primary.
    #[serde(default)]
    pub extras: Vec<IndexExtra>,
    /// The sha256 of every tensor written, per file name.
    #[serde(default)]
    pub digests: Vec<FileDigests>,
}

/// `name` is one plain path component: not empty, no `/`, no NUL, not `.`
/// or `..`.
pub(crate) fn is_plain_name(name: &OsStr) -> bool {
    let b = name.as_bytes();
    !b.is_empty() && b != b"." && b != b".." && !b.contains(&b'/') && !b.contains(&0)
}

/// A name weightstream keeps for itself in a placement folder.
pub(crate) fn is_reserved(name: &OsStr) -> bool {
    let b = name.as_bytes();
    b == INDEX_FILE.as_bytes() || b == PARKED_FILE.as_bytes() || b == MARKER_FILE.as_bytes() || is_temp(name)
}

/// A temporary file of a placement run.
pub(crate) fn is_temp(name: &OsStr) -> bool {
    name.as_bytes().starts_with(TEMP_PREFIX.as_bytes())
}

/// `p` is in the form of a real path: absolute, with no `.` or `..`
/// component and no doubled or trailing `/` (so that comparing paths
/// compares places).
fn is_real_form(p: &Path) -> bool {
    let b = p.as_os_str().as_bytes();
    b.first() == Some(&b'/')
        && !b.contains(&0)
        && (b == b"/"
            || (!b.ends_with(b"/")
                && b[1..]
                    .split(|&c| c == b'/')
                    .all(|c| is_plain_name(OsStr::from_bytes(c)))))
}

fn is_hex64(s: &str) -> bool {
    s.len() == 64 && s.bytes().all(|b| b.is_ascii_hexdigit())
}

impl LayoutIndex {
    /// Parses and checks an index read from `path` (untrusted input): an
    /// error names `path` and what is wrong.
    pub fn parse(path: &Path, bytes: &[u8]) -> Result<Self> {
        let idx: LayoutIndex = serde_json::from_slice(bytes)
            .map_err(|e| Error::catalog(path, format!("not a weightstream layout index: {e}")))?;
        idx.check()
            .map_err(|why| Error::catalog(path, format!("refused layout index: {why}")))?;
        Ok(idx)
    }

    /// The structural rules every index must keep: the format, 1 to 8
    /// roots, each a real-form absolute path listed once whose folder is
    /// `root/<folder>`, the folder name the one derived from the source
    /// ([`folder_name`]), at least one file, every name one plain component
    /// (`*.safetensors` for files, anything else for extras, none of
    /// weightstream's own), hashes of 64 hex digits, nothing listed twice.
    /// A checked index still proves nothing about the disk: readers and
    /// `place` follow it only into folders whose marker proves them (see
    /// `docs/layouts.md`).
    pub fn check(&self) -> std::result::Result<(), String> {
        if self.format != INDEX_FORMAT {
            return Err(format!(
                "format {:?}, expected {INDEX_FORMAT:?} (written by another version of weightstream?)",
                self.format
            ));
        }
        if self.roots.is_empty() || self.roots.len() > MAX_ROOTS {
            return Err(format!("{} roots (1 to {MAX_ROOTS} expected)", self.roots.len()));
        }
        if !is_plain_name(self.folder.as_os_str()) {
            return Err(format!("folder name \"{}\" is not one path component", self.folder));
        }
        if !is_real_form(self.source.as_path()) {
            return Err(format!(
                "source \"{}\" is not an absolute path without \".\" or \"..\"",
                self.source
            ));
        }
        let derived = folder_name(self.source.as_path());
        if self.folder.as_os_str() != derived {
            return Err(format!(
                "folder name \"{}\" is not \"{}\", the one weightstream derives from the source \"{}\"",
                self.folder,
                escape(&derived),
                self.source
            ));
        }
        if self.files.is_empty() {
            return Err("it names no safetensors file (\"files\" is empty)".into());
        }
        for (k, r) in self.roots.iter().enumerate() {
            if !is_real_form(r.path.as_path()) {
                return Err(format!(
                    "root {k} \"{}\" is not an absolute path without \".\" or \"..\"",
                    r.path
                ));
            }
            if self.roots[..k].iter().any(|o| o.path == r.path) {
                return Err(format!("root {k} \"{}\" is listed twice", r.path));
            }
            if r.folder.as_path() != r.path.as_path().join(self.folder.as_os_str()) {
                return Err(format!(
                    "root {k}: folder \"{}\" is not \"{}\" inside the root \"{}\"",
                    r.folder, self.folder, r.path
                ));
            }
        }
        let mut seen = std::collections::BTreeSet::new();
        for f in &self.files {
            let n = f.name.as_os_str();
            if !is_plain_name(n) || is_reserved(n) || !n.as_bytes().ends_with(b".safetensors") {
                return Err(format!(
                    "file name \"{}\" is not a plain *.safetensors name of one component",
                    f.name
                ));
            }
            if f.root >= self.roots.len() {
                return Err(format!(
                    "file \"{}\" is on root {}, of {}",
                    f.name,
                    f.root,
                    self.roots.len()
                ));
            }
            if !is_hex64(&f.header_sha256) {
                return Err(format!("file \"{}\": header_sha256 is not 64 hex digits", f.name));
            }
            if !seen.insert((f.root, f.name.clone())) {
                return Err(format!("file \"{}\" is listed twice on root {}", f.name, f.root));
            }
        }
        for e in &self.extras {
            let n = e.name.as_os_str();
            if !is_plain_name(n) || is_reserved(n) || n.as_bytes().ends_with(b".safetensors") {
                return Err(format!(
                    "extra file name \"{}\" is not a plain name of one component",
                    e.name
                ));
            }
            if !is_hex64(&e.sha256) {
                return Err(format!("extra file \"{}\": sha256 is not 64 hex digits", e.name));
            }
            if !seen.insert((0, e.name.clone())) {
                return Err(format!("extra file \"{}\" is listed twice", e.name));
            }
        }
        Ok(())
    }

    /// The folder of root `k`.
    pub fn folder_of(&self, k: usize) -> &Path {
        self.roots[k].folder.as_path()
    }

    /// The tensor digests recorded for file `name`.
    pub(crate) fn digests_of(&self, name: &OsStr) -> Option<&BTreeMap<String, String>> {
        self.digests
            .iter()
            .find(|d| d.name.as_os_str() == name)
            .map(|d| &d.tensors)
    }

    /// Whether `(root, name)` is a file of this layout (or an extra of the
    /// primary).
    pub(crate) fn names(&self, root: usize, name: &OsStr) -> bool {
        self.files.iter().any(|f| f.root == root && f.name.as_os_str() == name)
            || (root == 0 && self.extras.iter().any(|e| e.name.as_os_str() == name))
    }

    /// The serialised form written to disk (pretty, with a final newline).
    pub(crate) fn to_bytes(&self) -> Vec<u8> {
        let mut v = serde_json::to_vec_pretty(self).expect("a layout index serialises");
        v.push(b'\n');
        v
    }
}

/// Reads a small regular file `name` of the directory `dir` (opened
/// `O_NOFOLLOW | O_NONBLOCK`, refused unless regular, capped at
/// [`MAX_INDEX_LEN`]). `None` when it does not exist. `shown` names it in
/// errors.
pub(crate) fn read_small_at(dir: impl AsFd, name: &str, shown: &Path) -> Result<Option<Vec<u8>>> {
    let fd = match rustix::fs::openat(
        &dir,
        name,
        OFlags::RDONLY | OFlags::NOFOLLOW | OFlags::NONBLOCK | OFlags::CLOEXEC,
        Mode::empty(),
    ) {
        Ok(fd) => fd,
        Err(rustix::io::Errno::NOENT) => return Ok(None),
        Err(rustix::io::Errno::LOOP) => {
            return Err(Error::catalog(
                shown,
                "is a symbolic link: refused (weightstream never follows one here)",
            ))
        }
        Err(e) => return Err(Error::io(shown, "open", e)),
    };
    let st = rustix::fs::fstat(&fd).map_err(|e| Error::io(shown, "fstat", e))?;
    let ft = FileType::from_raw_mode(st.st_mode);
    if ft != FileType::RegularFile {
        return Err(Error::catalog(shown, format!("is {}, not a regular file", kind_of(ft))));
    }
    if st.st_size as u64 > MAX_INDEX_LEN {
        return Err(Error::catalog(
            shown,
            format!("is {} bytes, over the {MAX_INDEX_LEN}-byte limit: refused", st.st_size),
        ));
    }
    let mut bytes = Vec::with_capacity(st.st_size as usize);
    std::fs::File::from(fd)
        .take(MAX_INDEX_LEN + 1)
        .read_to_end(&mut bytes)
        .map_err(|e| Error::io(shown, "read", e))?;
    if bytes.len() as u64 > MAX_INDEX_LEN {
        return Err(Error::catalog(
            shown,
            format!("grew past the {MAX_INDEX_LEN}-byte limit while read"),
        ));
    }
    Ok(Some(bytes))
}

/// Opens the directory at the absolute path `path` one component at a
/// time from `/`, each with `O_DIRECTORY | O_NOFOLLOW`: a symbolic link
/// anywhere on the way (swapped in after a path was checked, or named by
/// an index) is refused, never followed; so are `..` and a relative path.
/// Placement folders are always reached this way: their roots are real
/// paths, which hold no link.
pub(crate) fn open_dir_no_links(path: &Path) -> Result<OwnedFd> {
    use std::path::Component;
    let flags = OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC;
    if !path.is_absolute() {
        return Err(Error::catalog(path, "is not an absolute path: refused"));
    }
    let mut fd = rustix::fs::open("/", flags, Mode::empty()).map_err(|e| Error::io("/", "open directory", e))?;
    let mut walked = PathBuf::from("/");
    for c in path.components() {
        let name = match c {
            Component::RootDir | Component::CurDir => continue,
            Component::Normal(n) => n,
            Component::ParentDir | Component::Prefix(_) => {
                return Err(Error::catalog(path, "holds a \"..\" component: refused"));
            }
        };
        walked.push(name);
        fd = match rustix::fs::openat(&fd, name, flags, Mode::empty()) {
            Ok(next) => next,
            Err(e @ (rustix::io::Errno::LOOP | rustix::io::Errno::NOTDIR)) => {
                let what = match rustix::fs::statat(&fd, name, rustix::fs::AtFlags::SYMLINK_NOFOLLOW) {
                    Ok(st) => FileType::from_raw_mode(st.st_mode),
                    Err(_) => FileType::Unknown,
                };
                return Err(match what {
                    FileType::Symlink => Error::catalog(
                        path,
                        format!(
                            "\"{}\" on the way is a symbolic link: refused (weightstream never follows a link to a \
                             placement folder)",
                            escape(&walked)
                        ),
                    ),
                    FileType::Unknown => Error::io(&walked, "open directory", e),
                    other => Error::catalog(
                        path,
                        format!("\"{}\" on the way is {}", escape(&walked), kind_of(other)),
                    ),
                });
            }
            Err(e) => return Err(Error::io(&walked, "open directory", e)),
        };
    }
    Ok(fd)
}

/// A placement folder opened and proven by its marker (see
/// [`open_marked`]).
#[derive(Debug)]
pub(crate) struct MarkedFolder {
    /// The root, opened without links.
    pub(crate) root_fd: OwnedFd,
    /// The folder (`O_NOFOLLOW | O_DIRECTORY`, relative to `root_fd`).
    pub(crate) fd: OwnedFd,
    /// Its `fstat`.
    pub(crate) stat: rustix::fs::Stat,
    /// Its marker, which proves it.
    pub(crate) marker: Marker,
}

/// Opens the folder `name` of `root` (walked without links, the folder
/// itself `O_NOFOLLOW`) and proves it by its marker, read from the open
/// descriptor: a placement folder weightstream made for the model whose
/// source is `source` ([`Marker::proves`]). Nothing is changed: no mode,
/// no file. `Err` says why the folder is not proven (for a warning naming
/// it); the caller checks owner and mode as its use needs.
pub(crate) fn open_marked(root: &Path, name: &OsStr, source: &Path) -> std::result::Result<MarkedFolder, String> {
    let path = root.join(name);
    let root_fd = open_dir_no_links(root).map_err(|e| e.to_string())?;
    let fd = rustix::fs::openat(
        &root_fd,
        name,
        OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
        Mode::empty(),
    )
    .map_err(|e| match e {
        rustix::io::Errno::NOENT => "does not exist".to_string(),
        rustix::io::Errno::LOOP | rustix::io::Errno::NOTDIR => "is not a directory (or is a symbolic link)".into(),
        e => format!("cannot be opened ({e})"),
    })?;
    let stat = rustix::fs::fstat(&fd).map_err(|e| format!("fstat: {e}"))?;
    let shown = path.join(MARKER_FILE);
    let marker = match read_small_at(&fd, MARKER_FILE, &shown) {
        Ok(Some(b)) => Marker::parse(&shown, &b).map_err(|e| e.to_string())?,
        Ok(None) => return Err(format!("holds no {MARKER_FILE}")),
        Err(e) => return Err(e.to_string()),
    };
    marker.proves(source, root, name, stat.st_ino)?;
    Ok(MarkedFolder {
        root_fd,
        fd,
        stat,
        marker,
    })
}

/// What a placement folder says about itself: its marker, its index, a
/// parked index.
#[derive(Debug)]
pub(crate) struct FolderState {
    pub(crate) marker: Option<Marker>,
    pub(crate) index: Option<LayoutIndex>,
    pub(crate) parked: bool,
}

/// Reads the marker, index and parked index of the folder `dir` (a reader:
/// `dir` itself may be given through a link; its entries are opened
/// without following one).
pub(crate) fn folder_state(dir: &Path) -> Result<FolderState> {
    let fd = rustix::fs::open(dir, OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC, Mode::empty())
        .map_err(|e| Error::io(dir, "open directory", e))?;
    let marker = match read_small_at(&fd, MARKER_FILE, &dir.join(MARKER_FILE))? {
        Some(b) => Some(Marker::parse(&dir.join(MARKER_FILE), &b)?),
        None => None,
    };
    let index = match read_small_at(&fd, INDEX_FILE, &dir.join(INDEX_FILE))? {
        Some(b) => Some(LayoutIndex::parse(&dir.join(INDEX_FILE), &b)?),
        None => None,
    };
    let parked = match rustix::fs::statat(&fd, PARKED_FILE, rustix::fs::AtFlags::SYMLINK_NOFOLLOW) {
        Ok(_) => true,
        Err(rustix::io::Errno::NOENT) => false,
        Err(e) => return Err(Error::io(dir.join(PARKED_FILE), "stat", e)),
    };
    Ok(FolderState { marker, index, parked })
}

/// A placed model as [`Model::open`](crate::Model::open) reads it: the
/// committed layout index of its primary folder.
#[derive(Debug, Clone)]
pub struct Placed {
    /// The primary folder, as given.
    pub dir: PathBuf,
    /// Its layout index.
    pub index: LayoutIndex,
}

impl Placed {
    /// The placement `dir` is the primary folder of, if any: `None` for a
    /// directory that is no placement folder (no marker, no index). A
    /// placement folder that is not a committed primary is an error naming
    /// why and what to do (a miss, never a stale hit): a parked index (a
    /// re-shard that did not finish), a marker without an index (a first
    /// placement that did not commit), the folder of another root.
    pub fn read(dir: &Path) -> Result<Option<Self>> {
        let st = folder_state(dir)?;
        let Some(index) = st.index else {
            if st.parked {
                return Err(Error::catalog(
                    dir,
                    format!(
                        "a re-shard of this placed model did not finish ({PARKED_FILE} is here, no {INDEX_FILE}): \
                         its files may be part old, part new, so it is not opened; run `weightstream place` again \
                         to repair it"
                    ),
                ));
            }
            return match st.marker {
                None => Ok(None),
                Some(m) if m.position > 0 => Err(Error::catalog(
                    dir,
                    format!(
                        "is root {} of {} of a placed model: open its primary folder \"{}\"",
                        m.position, m.n_roots, m.primary
                    ),
                )),
                Some(_) => Err(Error::catalog(
                    dir,
                    format!(
                        "is a placement folder whose placement never committed (a marker, no {INDEX_FILE}): run \
                         `weightstream place` again"
                    ),
                )),
            };
        };
        let real = std::fs::canonicalize(dir).map_err(|e| Error::io(dir, "resolve", e))?;
        if index.folder_of(0) != real {
            return Err(Error::catalog(
                dir.join(INDEX_FILE),
                format!(
                    "names \"{}\" as its primary folder, but it is in \"{}\": the folder was moved or copied; run \
                     `weightstream place` again",
                    escape(index.folder_of(0)),
                    escape(&real)
                ),
            ));
        }
        let placed = Placed {
            dir: dir.to_path_buf(),
            index,
        };
        placed.check_folders()?;
        placed.check_present()?;
        Ok(Some(placed))
    }

    /// Every folder the index names is proven by its marker (see
    /// [`prove_roots`]): else an error naming it and why.
    fn check_folders(&self) -> Result<()> {
        for (k, proof) in prove_roots(&self.index).into_iter().enumerate() {
            if let Err(why) = proof {
                return Err(Error::catalog(
                    self.index.folder_of(k),
                    format!(
                        "{why}, but the layout index of \"{}\" names it as root {k}: not followed (weightstream \
                         reads only folders it can prove it made for this model); run `weightstream place` again",
                        escape(&self.dir)
                    ),
                ));
            }
        }
        Ok(())
    }

    /// Every file the index names is there, a regular file of its size
    /// (not a link): else an error naming it.
    fn check_present(&self) -> Result<()> {
        for f in &self.index.files {
            let path = self.index.folder_of(f.root).join(f.name.as_os_str());
            let what = match std::fs::symlink_metadata(&path) {
                Ok(m) if m.file_type().is_file() && m.len() == f.size => continue,
                Ok(m) if m.file_type().is_file() => format!("is {} bytes, the index says {}", m.len(), f.size),
                Ok(m) if m.file_type().is_symlink() => "is a symbolic link".to_string(),
                Ok(_) => "is not a regular file".to_string(),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => "is missing".to_string(),
                Err(e) => format!("cannot be read ({e})"),
            };
            return Err(Error::catalog(
                &path,
                format!(
                    "{what}, but the layout index of \"{}\" names it (root {}): the placement was changed outside \
                     weightstream; run `weightstream place` again (`weightstream verify` names every difference)",
                    escape(&self.dir),
                    f.root
                ),
            ));
        }
        Ok(())
    }

    /// The model configuration the layout stands for: mirrors for a mirror
    /// layout, split directories for split and layers. Refused when the
    /// caller gave directories of its own (the index says where the model
    /// is).
    pub(crate) fn model_config(&self, mut config: ModelConfig) -> Result<ModelConfig> {
        if !config.dirs.is_empty() || !config.mirrors.is_empty() {
            return Err(Error::Config(format!(
                "\"{}\" is a placed model ({} layout; its {INDEX_FILE} names its roots): do not give split or \
                 mirror directories (--dirs, --mirror, WEIGHTSTREAM_MODEL_DIRS, WEIGHTSTREAM_MIRROR) with it",
                escape(&self.dir),
                self.index.layout.name()
            )));
        }
        let others: Vec<PathBuf> = (1..self.index.roots.len())
            .map(|k| self.index.folder_of(k).to_path_buf())
            .collect();
        match self.index.layout {
            LayoutKind::Mirror => config.mirrors = others,
            LayoutKind::Split | LayoutKind::Layers => config.dirs = others,
        }
        tracing::info!(
            "{}: placed model, {} layout over {} root(s) (from {INDEX_FILE})",
            escape(&self.dir),
            self.index.layout.name(),
            self.index.roots.len()
        );
        Ok(config)
    }

    /// The shards of `dir` the index names (the others are not part of the
    /// model: orphans, left for the user).
    pub(crate) fn listing(&self, dir: &Path) -> Result<Vec<ListedShard>> {
        let real = std::fs::canonicalize(dir).map_err(|e| Error::io(dir, "resolve", e))?;
        let root = self.index.roots.iter().position(|r| r.folder.as_path() == real);
        let all = list_shards(dir)?;
        Ok(all
            .into_iter()
            .filter(|(name, listed, _)| {
                let named = root.is_some_and(|k| self.index.names(k, name));
                if !named {
                    tracing::info!(
                        "{}: not named by the layout index: not part of the placed model (left as it is)",
                        escape(listed)
                    );
                }
                named
            })
            .collect())
    }
}

/// Proves, for a reader, the folder of every root of `index` (one result
/// per root, in order): opened without following a link ([`open_marked`]),
/// its marker bound to it and naming the index's source, position `k` of
/// as many roots, and the index's primary folder; not writable by group or
/// others; and owned by the user who owns the primary folder (a placement
/// is written by one user, and `place` refuses a folder of another owner:
/// whoever owns a folder can change the files read from it, and a marker
/// is only JSON that its owner can write to match any inode). `Err` says
/// why not.
pub(crate) fn prove_roots(index: &LayoutIndex) -> Vec<std::result::Result<(), String>> {
    let mut owner = None;
    (0..index.roots.len())
        .map(|k| {
            let uid = prove_root(index, k)?;
            match owner {
                None if k == 0 => {
                    owner = Some(uid);
                    Ok(())
                }
                Some(o) if o == uid => Ok(()),
                Some(o) => Err(format!(
                    "it is owned by uid {uid}, not by uid {o} who owns the primary folder (its owner could change the \
                     files read from it)"
                )),
                None => Err("the primary folder is not proven, so neither is this one".into()),
            }
        })
        .collect()
}

/// [`prove_roots`] for root `k` alone, without the owner rule; `Ok` is the
/// folder's owner.
fn prove_root(index: &LayoutIndex, k: usize) -> std::result::Result<u32, String> {
    let r = &index.roots[k];
    let m = open_marked(r.path.as_path(), index.folder.as_os_str(), index.source.as_path())?;
    let mode = m.stat.st_mode & 0o7777;
    if mode & 0o022 != 0 {
        return Err(format!("it is writable by group or others (mode {mode:04o})"));
    }
    let mk = &m.marker;
    if mk.position != k || mk.n_roots != index.roots.len() || mk.primary.as_path() != index.folder_of(0) {
        return Err(format!(
            "its marker says it is root {} of {} of the placement whose primary is \"{}\"",
            mk.position, mk.n_roots, mk.primary
        ));
    }
    Ok(m.stat.st_uid)
}

/// The hook [`Model::open`](crate::Model::open) calls first: for a placed model's
/// primary folder, the configuration its layout index stands for, and the
/// placement (whose [`listing()`] then gives each directory's shards).
pub(crate) fn for_open(config: ModelConfig) -> Result<(ModelConfig, Option<Placed>)> {
    if !config.primary.is_dir() {
        return Ok((config, None));
    }
    match Placed::read(&config.primary)? {
        Some(p) => Ok((p.model_config(config)?, Some(p))),
        None => Ok((config, None)),
    }
}

/// The shards of `dir`: every `*.safetensors` entry, or for a placed model
/// only those its index names.
pub(crate) fn listing(placed: Option<&Placed>, dir: &Path) -> Result<Vec<ListedShard>> {
    match placed {
        Some(p) => p.listing(dir),
        None => list_shards(dir),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn index() -> LayoutIndex {
        LayoutIndex {
            format: INDEX_FORMAT.into(),
            layout: LayoutKind::Split,
            source: OsName(OsString::from("/src/m")),
            source_fingerprint: "0".repeat(64),
            folder: OsName(folder_name(Path::new("/src/m"))),
            roots: vec![IndexRoot {
                path: OsName(OsString::from("/a")),
                folder: OsName(Path::new("/a").join(folder_name(Path::new("/src/m"))).into_os_string()),
            }],
            files: vec![IndexFile {
                name: OsName(OsString::from("x.safetensors")),
                root: 0,
                size: 10,
                header_sha256: "a".repeat(64),
                kind: FileKind::Shard,
                layer: None,
            }],
            extras: vec![],
            digests: vec![],
        }
    }

    #[test]
    fn names_that_are_not_utf8_round_trip() {
        let n = OsName(OsString::from_vec(b"a\xffb.safetensors".to_vec()));
        let j = serde_json::to_string(&n).unwrap();
        assert_eq!(j, r#"{"hex":"61ff622e7361666574656e736f7273"}"#);
        assert_eq!(serde_json::from_str::<OsName>(&j).unwrap(), n);
        let t = OsName(OsString::from("plain"));
        assert_eq!(serde_json::to_string(&t).unwrap(), "\"plain\"");
        assert!(serde_json::from_str::<OsName>(r#"{"hex":"abc"}"#).is_err());
    }

    #[test]
    fn an_index_round_trips_and_is_checked() {
        let i = index();
        let back = LayoutIndex::parse(Path::new("/i"), &i.to_bytes()).unwrap();
        assert_eq!(back, i);
        for (bad, why) in [
            ("../x.safetensors", "not a plain"),
            ("weightstream-layout.json", "not a plain"),
            (".weightstream-tmp.1.x.safetensors", "not a plain"),
            ("x.bin", "not a plain"),
        ] {
            let mut j = index();
            j.files[0].name = OsName(OsString::from(bad));
            let e = LayoutIndex::parse(Path::new("/i"), &j.to_bytes())
                .unwrap_err()
                .to_string();
            assert!(e.contains(why), "{bad}: {e}");
        }
        let mut j = index();
        j.files[0].root = 3;
        assert!(j.check().unwrap_err().contains("root 3"));
        let mut j = index();
        j.roots[0].folder = OsName(
            Path::new("/elsewhere")
                .join(folder_name(Path::new("/src/m")))
                .into_os_string(),
        );
        assert!(j.check().unwrap_err().contains("is not"));
        let mut j = index();
        j.folder = OsName(OsString::from(".."));
        assert!(j.check().is_err());
        let mut j = index();
        j.format = "weightstream-layout/9".into();
        assert!(j.check().unwrap_err().contains("format"));
    }

    #[test]
    fn a_streamed_hash_reads_exactly_the_size_asked() {
        use std::io::{Seek, Write};
        let mut f = tempfile::tempfile().unwrap();
        f.write_all(&[7u8; 3 << 20]).unwrap();
        f.rewind().unwrap();
        assert_eq!(
            sha256_of_exactly(&f, 3 << 20).unwrap(),
            Some(sha256_hex(&[7u8; 3 << 20]))
        );
        f.rewind().unwrap();
        assert_eq!(sha256_of_exactly(&f, 1 << 20).unwrap(), None, "longer than asked");
        f.rewind().unwrap();
        assert_eq!(sha256_of_exactly(&f, 4 << 20).unwrap(), None, "shorter than asked");
    }

    #[test]
    fn plain_names() {
        assert!(is_plain_name(OsStr::new("a.safetensors")));
        for n in ["", ".", "..", "a/b", "a\0b"] {
            assert!(!is_plain_name(OsStr::new(n)), "{n:?}");
        }
    }
}
