//! The commit protocol: the layout index is the commit point, and every
//! file the current index names exists, with the bytes it says, at every
//! instant.
//!
//! 1. Source scanned, roots validated, layout planned: a refusal here
//!    writes nothing.
//! 2. Folders made private and locked (see `rules`); the previous layouts
//!    read: the primary folder's committed index, a parked index left by
//!    an interrupted re-shard, and the index of another primary a folder's
//!    marker names (the primary root changed).
//! 3. Each planned file is proven identical to what it should be (a
//!    committed index of the same source fingerprint names it on the same
//!    folder with its size and header hash, and on disk it has that size
//!    and those header bytes; with `digest`, every tensor's sha256 equals
//!    the source's) and kept, or is to be written.
//! 4. Space checked (statvfs) per root for what is to be written; temporary
//!    files of interrupted runs removed; markers written.
//! 5. Every file to write is written under a temporary name (see `write`).
//!    A failure (ENOSPC...) removes them all: the index was not touched.
//! 6. If a rename would replace a file a committed index names (a content
//!    re-shard), that index is first parked as `PARKED_FILE`: an
//!    interruption from here on leaves a miss (the model does not open,
//!    saying why), never a stale hit.
//! 7. The temporary files are renamed into place, the folders `fsync`ed.
//! 8. The new index is written to a temporary file, `fsync`ed, renamed over
//!    the index, and the folder `fsync`ed: committed.
//! 9. Only then: the parked index removed, a retired primary's index
//!    removed, and the copies the previous layouts named and the new one
//!    does not deleted (a failure is a warning). Files no index names are
//!    reported as orphans, never deleted.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::ffi::{OsStr, OsString};
use std::path::{Path, PathBuf};
use std::time::Instant;

use rustix::fs::{AtFlags, FileType, Mode, OFlags};

use super::plan::{self, Content, Output};
use super::rules::{self, SafeDir};
use super::source::{self, Source};
use super::write::{self, RootJobs};
use super::{FileNote, PlaceConfig, PlaceReport, Progress, RootReport, Step};
use crate::error::{escape, Error, Result};
use crate::model::placed::{
    self as index, FileDigests, IndexExtra, IndexFile, IndexRoot, LayoutIndex, Marker, OsName, INDEX_FILE,
    INDEX_FORMAT, MARKER_FILE, MARKER_FORMAT, PARKED_FILE,
};

/// A layout found before this run.
struct Prev {
    /// The folder holding it (index into the folder table).
    home: usize,
    index: LayoutIndex,
    /// Read from `PARKED_FILE` (an interrupted re-shard), or parked by
    /// this run.
    parked: bool,
    /// The index of another primary than this run's.
    foreign: bool,
}

/// Warnings and notes, each logged once.
#[derive(Default)]
struct Log {
    warnings: Vec<String>,
    notes: Vec<String>,
    repaired: Vec<String>,
}

impl Log {
    fn warn(&mut self, w: String) {
        if !self.warnings.contains(&w) {
            tracing::warn!("{w}");
            self.warnings.push(w);
        }
    }

    fn note(&mut self, n: String) {
        if !self.notes.contains(&n) {
            tracing::info!("{n}");
            self.notes.push(n);
        }
    }

    fn repaired(&mut self, r: String) {
        tracing::warn!("{r}");
        self.repaired.push(r);
    }
}

/// `Cached:` of `/proc/meminfo`, in bytes (0 when unreadable). Kept here
/// rather than borrowed from `bench`, which the CLI may own one day.
fn cached_bytes() -> i64 {
    std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|s| {
            let line = s.lines().find(|l| l.starts_with("Cached:"))?;
            line.split_whitespace().nth(1)?.parse::<i64>().ok()
        })
        .map_or(0, |kb| kb * 1024)
}

/// Reads a folder's index (`name`: committed or parked); a parked index
/// that cannot be read is a warning (it only names what to clean up).
fn read_index(dir: &SafeDir, name: &str, log: &mut Log) -> Result<Option<LayoutIndex>> {
    let shown = dir.path.join(name);
    let bytes = index::read_small_at(&dir.fd, name, &shown)?;
    match bytes.map(|b| LayoutIndex::parse(&shown, &b)) {
        None => Ok(None),
        Some(Ok(i)) => Ok(Some(i)),
        Some(Err(e)) if name == PARKED_FILE => {
            log.warn(format!(
                "{e}: ignored (the files it named are reported as orphans, not deleted)"
            ));
            Ok(None)
        }
        Some(Err(e)) => Err(Error::Config(format!(
            "{e}; move it away (weightstream then treats the folder's files as orphans) and run again"
        ))),
    }
}

/// The folder at `path` in the table, when it is there and proven; else,
/// when it is not there, opened if its marker proves it this model's
/// folder ([`SafeDir::open_proven`]: nothing changed). `None`, warned
/// naming the folder and why, when it is gone or not proven: `what` (its
/// files) is then left as it is.
fn find_proven(dirs: &mut Vec<SafeDir>, path: &Path, source: &Path, log: &mut Log, what: &str) -> Option<usize> {
    if let Some(i) = dirs.iter().position(|d| d.path == path) {
        if dirs[i].proven {
            return Some(i);
        }
        log.warn(format!(
            "\"{}\": its marker does not prove it this model's placement folder (it was there before this run, \
             without a marker bound to it): {what} left as they are",
            escape(path)
        ));
        return None;
    }
    match SafeDir::open_proven(path, source) {
        Ok(d) => {
            dirs.push(d);
            Some(dirs.len() - 1)
        }
        Err(why) => {
            log.warn(format!(
                "\"{}\": {why}: {what} left as they are (weightstream changes only folders it can prove it made \
                 for this model)",
                escape(path)
            ));
            None
        }
    }
}

/// What a previous index recorded of a file it named: its size and the
/// sha256 of its header (a safetensors file) or of all its bytes (an
/// extra). A stale copy is deleted only when it still is that file.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
enum Recorded {
    Header { size: u64, sha256: String },
    Whole { size: u64, sha256: String },
}

/// Whether the entry `name` of `dir` is the file `rec` describes: regular
/// (not followed if a link), of its size, with its header's or its whole
/// content's sha256. `Err` says why not.
fn is_recorded(dir: &SafeDir, name: &OsStr, rec: &Recorded) -> std::result::Result<(), String> {
    let fd = rustix::fs::openat(
        &dir.fd,
        name,
        OFlags::RDONLY | OFlags::NOFOLLOW | OFlags::NONBLOCK | OFlags::CLOEXEC,
        Mode::empty(),
    )
    .map_err(|e| format!("cannot be opened ({e})"))?;
    let st = rustix::fs::fstat(&fd).map_err(|e| format!("fstat: {e}"))?;
    if FileType::from_raw_mode(st.st_mode) != FileType::RegularFile {
        return Err("is not a regular file".into());
    }
    let (size, want) = match rec {
        Recorded::Header { size, sha256 } | Recorded::Whole { size, sha256 } => (*size, sha256),
    };
    if st.st_size as u64 != size {
        return Err(format!("is {} bytes, the index recorded {size}", st.st_size));
    }
    let file = std::fs::File::from(fd);
    let shown = dir.path.join(name);
    let sha = match rec {
        Recorded::Whole { .. } => index::sha256_of_exactly(&file, size),
        Recorded::Header { .. } => {
            let mut prefix = [0u8; 8];
            crate::format::container::read_exact_at(&shown, &file, &mut prefix, 0)
                .map_err(|e| format!("its header cannot be read ({e})"))?;
            let n = u64::from_le_bytes(prefix);
            if n > crate::format::container::MAX_HEADER_LEN || n.saturating_add(8) > size {
                return Err(format!("its header length {n} does not fit the file"));
            }
            // `read_exact_at` does not move the offset: hashed from byte 0.
            index::sha256_of_prefix(&file, n + 8)
        }
    }
    .map_err(|e| format!("cannot be read ({e})"))?;
    crate::storage::files::drop_all_pages(&file);
    if sha.as_ref() != Some(want) {
        return Err(match (rec, sha) {
            (_, None) => "changed size while it was read".into(),
            (Recorded::Header { .. }, _) => "its header differs from the one the index recorded".into(),
            (Recorded::Whole { .. }, _) => "its content differs from what the index recorded (sha256)".into(),
        });
    }
    Ok(())
}

/// Whether the file `name` in `dir` is regular, of `out.size` bytes, and
/// starts with `out.raw`.
fn same_on_disk(dir: &SafeDir, out: &Output) -> Result<std::result::Result<(), String>> {
    let shown = dir.path.join(&out.name);
    let fd = match rustix::fs::openat(
        &dir.fd,
        &out.name,
        OFlags::RDONLY | OFlags::NOFOLLOW | OFlags::NONBLOCK | OFlags::CLOEXEC,
        Mode::empty(),
    ) {
        Ok(fd) => fd,
        Err(rustix::io::Errno::NOENT) => return Ok(Err("missing".into())),
        Err(e) => return Ok(Err(format!("cannot be opened ({e})"))),
    };
    let st = rustix::fs::fstat(&fd).map_err(|e| Error::io(&shown, "fstat", e))?;
    if FileType::from_raw_mode(st.st_mode) != FileType::RegularFile {
        return Ok(Err("not a regular file".into()));
    }
    if st.st_size as u64 != out.size {
        return Ok(Err(format!("{} bytes, {} expected", st.st_size, out.size)));
    }
    let file = std::fs::File::from(fd);
    if out.raw.is_empty() {
        // An extra: compared by sha256 of the whole file, streamed (it
        // may grow after the fstat: never read past its size).
        let sha = index::sha256_of_exactly(&file, out.size).map_err(|e| Error::io(&shown, "read", e))?;
        crate::storage::files::drop_all_pages(&file);
        return Ok(match sha {
            Some(sha) if sha == out.header_sha256 => Ok(()),
            Some(_) => Err("its sha256 differs".to_string()),
            None => Err("it changed size while read".to_string()),
        });
    }
    let mut raw = vec![0u8; out.raw.len()];
    let r = crate::format::container::read_exact_at(&shown, &file, &mut raw, 0);
    crate::storage::files::drop_all_pages(&file);
    match r {
        Ok(()) if raw == out.raw => Ok(Ok(())),
        Ok(()) => Ok(Err("its header differs".into())),
        Err(e) => Ok(Err(format!("its header cannot be read ({e})"))),
    }
}

/// sha256 of every tensor of source shard `s`, computed once.
fn source_digests<'a>(
    cache: &'a mut HashMap<usize, BTreeMap<String, String>>,
    source: &Source,
    s: usize,
) -> Result<&'a BTreeMap<String, String>> {
    if let std::collections::hash_map::Entry::Vacant(v) = cache.entry(s) {
        let h = &source.shards[s].info.header;
        let ranges: Vec<plan::Range> = h
            .tensors
            .iter()
            .map(|t| plan::Range {
                name: t.name.clone(),
                begin: h.data_start + t.begin,
                end: h.data_start + t.end,
            })
            .collect();
        v.insert(write::digest_ranges(&source.shards[s].info.path, &ranges)?);
    }
    Ok(&cache[&s])
}

/// What every tensor of `out` should hash to, from the source.
fn expected_digests(
    cache: &mut HashMap<usize, BTreeMap<String, String>>,
    source: &Source,
    out: &Output,
) -> Result<BTreeMap<String, String>> {
    match &out.content {
        Content::Copy { shard } => Ok(source_digests(cache, source, *shard)?.clone()),
        Content::Build { tensors } => {
            let all = source.catalog.tensors();
            let mut m = BTreeMap::new();
            for &t in tensors {
                let d = source_digests(cache, source, all[t].shard)?;
                if let Some(h) = d.get(&all[t].name) {
                    m.insert(all[t].name.clone(), h.clone());
                }
            }
            Ok(m)
        }
        _ => Ok(BTreeMap::new()),
    }
}

fn unlink(dir: &SafeDir, name: &OsStr) -> std::io::Result<()> {
    match rustix::fs::unlinkat(&dir.fd, name, AtFlags::empty()) {
        Ok(()) | Err(rustix::io::Errno::NOENT) => Ok(()),
        Err(e) => Err(e.into()),
    }
}

/// Removes the temporary files this run made (after a failure).
fn remove_temps(dirs: &[SafeDir], created: &[(usize, OsString)]) -> usize {
    let mut n = 0;
    for (k, tmp) in created {
        if unlink(&dirs[*k], tmp).is_ok() {
            n += 1;
        }
    }
    for d in dirs {
        let _ = d.sync();
    }
    n
}

fn stopped(at: impl std::fmt::Display) -> Error {
    Error::Config(format!(
        "placement stopped at step {at} by the test hook (as a crash would: nothing cleaned up)"
    ))
}

fn hook(cfg: &PlaceConfig, step: Step) -> Result<()> {
    match &cfg.hook {
        Some(h) if h(&step) => Err(stopped(step)),
        _ => Ok(()),
    }
}

/// Runs a placement (see the module documentation).
pub(crate) fn run(cfg: &PlaceConfig) -> Result<PlaceReport> {
    let t0 = Instant::now();
    let cached0 = cached_bytes();
    let mut log = Log::default();
    if cfg.buffer_bytes < (1 << 20) || !cfg.buffer_bytes.is_multiple_of(1 << 20) || cfg.buffer_bytes > (1 << 30) {
        return Err(Error::Config(format!(
            "buffer of {} bytes: give a multiple of 1 MiB, at most 1 GiB",
            cfg.buffer_bytes
        )));
    }

    // 1. Source, roots, plan: nothing is written if any is refused.
    let source = source::scan(&cfg.source)?;
    log.warnings.extend(source.skipped.iter().cloned());
    let roots = rules::check_roots(&cfg.roots, &source.real, source.dev, cfg.allow_source_volume)?;
    let n = roots.len();
    let plan = plan::plan(&source, cfg.layout, n)?;
    for note in &plan.notes {
        log.note(note.clone());
    }

    // 2. Folders, then what was there before.
    let fname = rules::folder_name(&source.real);
    let mut dirs: Vec<SafeDir> = Vec::with_capacity(n);
    for r in &roots {
        match SafeDir::open(&r.path, &fname, true) {
            Ok(Some(d)) => dirs.push(d),
            // `create` never answers "missing"; an error rather than a panic all the same.
            Ok(None) => {
                for d in &dirs {
                    d.remove_if_created();
                }
                return Err(Error::catalog(
                    &r.path,
                    "the placement folder vanished while it was being made",
                ));
            }
            Err(e) => {
                for d in &dirs {
                    d.remove_if_created();
                }
                return Err(e);
            }
        }
    }
    let refuse = |dirs: &[SafeDir], e: Error| {
        for d in dirs {
            d.remove_if_created();
        }
        e
    };
    // Which of this run's folders were there before and are proven this
    // model's by a marker bound to them: only there (and in the folders
    // made now) may stale copies be deleted.
    for (k, d) in dirs.iter_mut().enumerate() {
        if !d.created {
            d.proven =
                matches!(d.marker(), Ok(Some(m)) if m.proves(&source.real, &roots[k].path, &fname, d.ino).is_ok());
        }
    }
    let primary = dirs[0].path.clone();
    let mut prevs: Vec<Prev> = Vec::new();
    // An index in the primary folder that is not this placement's (it
    // names another folder as its primary: crafted, or copied here) is not
    // followed: nothing it names is deleted or trusted.
    let ours = |i: Option<LayoutIndex>, name: &str, log: &mut Log| match i {
        Some(i) if i.folder_of(0) != primary => {
            log.warn(format!(
                "{}: names \"{}\" as its primary folder, not this one: not followed (nothing it names is deleted \
                 or reused); it is replaced by this run's index",
                escape(primary.join(name)),
                escape(i.folder_of(0))
            ));
            None
        }
        other => other,
    };
    let committed = read_index(&dirs[0], INDEX_FILE, &mut log).map_err(|e| refuse(&dirs, e))?;
    let committed = ours(committed, INDEX_FILE, &mut log);
    let parked0 = read_index(&dirs[0], PARKED_FILE, &mut log).map_err(|e| refuse(&dirs, e))?;
    let parked0 = ours(parked0, PARKED_FILE, &mut log);
    let had_marker0 = dirs[0].marker().ok().flatten().is_some();
    if let Some(i) = committed {
        prevs.push(Prev {
            home: 0,
            index: i,
            parked: false,
            foreign: false,
        });
    }
    if let Some(i) = parked0 {
        log.repaired(format!(
            "the previous re-shard of \"{}\" did not finish (its index was parked as {PARKED_FILE}): its files are \
             proven again or rewritten, and the index is committed again",
            escape(&primary)
        ));
        prevs.push(Prev {
            home: 0,
            index: i,
            parked: true,
            foreign: false,
        });
    } else if prevs.is_empty() && had_marker0 {
        log.repaired(format!(
            "a previous placement into \"{}\" did not commit (a marker, no {INDEX_FILE}): placing again",
            escape(&primary)
        ));
    }
    // Another primary named by a folder's marker: the primary root changed.
    let mut defer_marker = BTreeSet::new();
    for k in 0..n {
        let m = match dirs[k].marker() {
            Ok(Some(m)) => m,
            Ok(None) => continue,
            Err(e) => {
                log.warn(format!("{e}: rewritten"));
                continue;
            }
        };
        let other = m.primary.as_path().to_path_buf();
        if other == primary || prevs.iter().any(|p| dirs[p.home].path == other) {
            continue;
        }
        // The marker is untrusted too: the folder it names is read only
        // when it is this model's folder (its name), proven by its own
        // marker, as the primary (position 0).
        if other.file_name() != Some(fname.as_os_str()) {
            log.warn(format!(
                "{}: names \"{}\" as the primary folder, which is not a folder of this model: not followed",
                escape(dirs[k].path.join(MARKER_FILE)),
                escape(&other)
            ));
            continue;
        }
        let Some(h) = find_proven(
            &mut dirs,
            &other,
            &source.real,
            &mut log,
            "its layout index and the files of that placement are",
        ) else {
            continue;
        };
        if !matches!(dirs[h].marker(), Ok(Some(m)) if m.position == 0) {
            log.warn(format!(
                "\"{}\": its marker does not say it is a primary folder: its layout index is not followed",
                escape(&other)
            ));
            continue;
        }
        let mut found = false;
        for (name, parked) in [(INDEX_FILE, false), (PARKED_FILE, true)] {
            let read = read_index(&dirs[h], name, &mut log).map_err(|e| refuse(&dirs[..n], e))?;
            if let Some(i) = read.filter(|i| i.folder_of(0) == other) {
                found = true;
                prevs.push(Prev {
                    home: h,
                    index: i,
                    parked,
                    foreign: true,
                });
            }
        }
        if found {
            log.note(format!(
                "\"{}\" held the layout index of this model's previous placement (primary root changed): it is \
                 retired once the new index is committed",
                escape(&other)
            ));
            defer_marker.insert(k);
            if h < n {
                defer_marker.insert(h);
            }
        }
    }

    // 3. Proven identical, or to write.
    let mut digest_cache: HashMap<usize, BTreeMap<String, String>> = HashMap::new();
    let proofs: Vec<&Prev> = prevs
        .iter()
        .filter(|p| !p.parked && p.index.source_fingerprint == source.fingerprint)
        .collect();
    let mut to_write: Vec<usize> = Vec::new();
    let mut reused: Vec<usize> = Vec::new();
    for (oi, out) in plan.files.iter().enumerate() {
        let dir = &dirs[out.root];
        let listed = proofs.iter().find(|p| {
            p.index.files.iter().any(|f| {
                p.index.folder_of(f.root) == dir.path
                    && f.name.as_os_str() == out.name
                    && f.size == out.size
                    && f.header_sha256 == out.header_sha256
            })
        });
        if listed.is_none() {
            to_write.push(oi);
            continue;
        }
        match same_on_disk(dir, out).map_err(|e| refuse(&dirs[..n], e))? {
            Ok(()) => {}
            Err(why) => {
                log.note(format!(
                    "{}: {why}, though the index names it: rewritten",
                    escape(dir.path.join(&out.name))
                ));
                to_write.push(oi);
                continue;
            }
        }
        if cfg.digest {
            let want = expected_digests(&mut digest_cache, &source, out).map_err(|e| refuse(&dirs[..n], e))?;
            let have =
                write::digest_ranges(&dir.path.join(&out.name), &out.ranges).map_err(|e| refuse(&dirs[..n], e))?;
            if have != want {
                let differ: Vec<&String> = want.keys().filter(|k| have.get(*k) != want.get(*k)).take(8).collect();
                log.note(format!(
                    "{}: tensor sha256 differs from the source ({differ:?}...): rewritten",
                    escape(dir.path.join(&out.name))
                ));
                to_write.push(oi);
                continue;
            }
        }
        reused.push(oi);
    }
    let mut extras_to_write: Vec<usize> = Vec::new();
    let mut extra_sha: BTreeMap<OsString, String> = BTreeMap::new();
    for (ei, out) in plan.extras.iter().enumerate() {
        let recorded = proofs.iter().find_map(|p| {
            (p.index.folder_of(0) == primary)
                .then(|| {
                    p.index
                        .extras
                        .iter()
                        .find(|e| e.name.as_os_str() == out.name && e.size == out.size)
                })
                .flatten()
        });
        let want_sha = match (&out.content, recorded) {
            (Content::Bytes(_), _) => Some(out.header_sha256.clone()),
            (_, Some(r)) => Some(r.sha256.clone()),
            _ => None,
        };
        let proven = match (&want_sha, recorded) {
            (Some(sha), Some(_)) => {
                let probe = Output {
                    header_sha256: sha.clone(),
                    ..out.clone()
                };
                same_on_disk(&dirs[0], &probe)
                    .map_err(|e| refuse(&dirs[..n], e))?
                    .is_ok()
            }
            _ => false,
        };
        if proven {
            extra_sha.insert(out.name.clone(), want_sha.expect("proven"));
        } else {
            extras_to_write.push(ei);
        }
    }

    // 4. Space, leftovers of interrupted runs, markers.
    for (k, d) in dirs[..n].iter().enumerate() {
        let files: Vec<&Output> = to_write
            .iter()
            .map(|&i| &plan.files[i])
            .filter(|o| o.root == k)
            .collect();
        let mut need: u64 = files.iter().map(|o| o.size.div_ceil(4096) * 4096).sum::<u64>() + (64 << 10);
        if k == 0 {
            need += extras_to_write
                .iter()
                .map(|&i| plan.extras[i].size.div_ceil(4096) * 4096)
                .sum::<u64>()
                + (1 << 20);
        }
        let vfs = rustix::fs::fstatvfs(&d.fd).map_err(|e| refuse(&dirs[..n], Error::io(&d.path, "statvfs", e)))?;
        let avail = vfs.f_bavail.saturating_mul(vfs.f_frsize);
        if need > avail {
            return Err(refuse(
                &dirs[..n],
                Error::Config(format!(
                    "root \"{}\": needs {need} bytes ({:.3} GB: {} file(s) to write) but its filesystem has {avail} \
                     bytes ({:.3} GB) available (statvfs): nothing was written; free space there, or choose another \
                     root",
                    escape(&roots[k].given),
                    need as f64 / 1e9,
                    files.len() + if k == 0 { extras_to_write.len() } else { 0 },
                    avail as f64 / 1e9
                )),
            ));
        }
    }
    let mut temps_removed = Vec::new();
    for d in &dirs {
        for (name, size) in d.remove_stale_temps()? {
            temps_removed.push(FileNote {
                path: d.path.join(name),
                size,
            });
        }
    }
    if !temps_removed.is_empty() {
        log.repaired(format!(
            "{} temporary file(s) of an interrupted run removed",
            temps_removed.len()
        ));
    }
    let folder_inos: Vec<u64> = dirs[..n].iter().map(|d| d.ino).collect();
    let marker_of = |k: usize| Marker {
        format: MARKER_FORMAT.into(),
        source: OsName::from(source.real.as_path()),
        source_fingerprint: source.fingerprint.clone(),
        position: k,
        n_roots: n,
        primary: OsName::from(primary.as_path()),
        layout: cfg.layout,
        root: Some(OsName::from(roots[k].path.as_path())),
        folder: Some(OsName(fname.clone())),
        folder_ino: Some(folder_inos[k]),
    };
    for (k, d) in dirs[..n].iter().enumerate() {
        if defer_marker.contains(&k) {
            continue;
        }
        let m = marker_of(k);
        if d.marker().ok().flatten().as_ref() != Some(&m) {
            let bytes = serde_json::to_vec_pretty(&m).expect("a marker serialises");
            d.write_small(OsStr::new(MARKER_FILE), &bytes)?;
            d.sync()?;
        }
    }
    hook(cfg, Step::Folders)?;

    // 5. Temporary files.
    let write_t0 = Instant::now();
    let mut created: Vec<(usize, OsString)> = Vec::new();
    let mut renames: Vec<(usize, OsString, OsString)> = Vec::new();
    for &ei in &extras_to_write {
        let out = &plan.extras[ei];
        match write::write_extra(&dirs[0], &source, out) {
            Ok((tmp, sha)) => {
                created.push((0, tmp.clone()));
                renames.push((0, tmp, out.name.clone()));
                extra_sha.insert(out.name.clone(), sha);
            }
            Err(e) => {
                remove_temps(&dirs, &created);
                return Err(e);
            }
        }
    }
    let jobs: Vec<RootJobs<'_>> = (0..n)
        .map(|k| RootJobs {
            root: k,
            dir: &dirs[k],
            outs: to_write.iter().copied().filter(|&i| plan.files[i].root == k).collect(),
        })
        .collect();
    let bytes_total: u64 = to_write.iter().map(|&i| plan.files[i].size).sum();
    let files_total = to_write.len();
    let mut progress = |bytes: u64, files: usize| {
        if let Some(p) = &cfg.progress {
            p(&Progress {
                bytes,
                bytes_total,
                files,
                files_total,
                elapsed: write_t0.elapsed(),
            });
        }
    };
    let outcome = write::write_files(
        &source,
        &plan,
        &jobs,
        cfg.buffer_bytes,
        cfg.hook.as_deref(),
        &mut progress,
    );
    drop(jobs);
    let write_seconds = write_t0.elapsed().as_secs_f64();
    created.extend(outcome.created.iter().cloned());
    for n in &outcome.notes {
        log.notes.push(n.clone());
    }
    if let Some(p) = outcome.panic {
        let k = remove_temps(&dirs, &created);
        tracing::warn!(
            "the progress callback panicked: the writers were stopped and {k} temporary file(s) removed; the layout \
             index was not touched"
        );
        std::panic::resume_unwind(p);
    }
    if let Some(at) = outcome.stopped {
        return Err(stopped(at));
    }
    if let Some(e) = outcome.error {
        let k = remove_temps(&dirs, &created);
        tracing::info!("{k} temporary file(s) removed after the failure; the layout index was not touched");
        return Err(e);
    }
    let mut digests: BTreeMap<OsString, BTreeMap<String, String>> = BTreeMap::new();
    let mut written_by_root = vec![(0usize, 0u64); n];
    for w in &outcome.written {
        let out = &plan.files[w.out];
        renames.push((out.root, w.tmp.clone(), out.name.clone()));
        digests.insert(out.name.clone(), w.digests.clone());
        written_by_root[out.root].0 += 1;
        written_by_root[out.root].1 += out.size;
    }
    for &oi in &reused {
        let name = &plan.files[oi].name;
        if digests.contains_key(name) {
            continue;
        }
        if let Some(d) = proofs.iter().find_map(|p| p.index.digests_of(name)) {
            digests.insert(name.clone(), d.clone());
        }
    }

    // The new index.
    let new_index = LayoutIndex {
        format: INDEX_FORMAT.into(),
        layout: cfg.layout,
        source: OsName::from(source.real.as_path()),
        source_fingerprint: source.fingerprint.clone(),
        folder: OsName(fname.clone()),
        roots: (0..n)
            .map(|k| IndexRoot {
                path: OsName::from(roots[k].path.as_path()),
                folder: OsName::from(dirs[k].path.as_path()),
            })
            .collect(),
        files: plan
            .files
            .iter()
            .map(|o| IndexFile {
                name: OsName(o.name.clone()),
                root: o.root,
                size: o.size,
                header_sha256: o.header_sha256.clone(),
                kind: o.kind.expect("a safetensors file has a kind"),
                layer: o.layer,
            })
            .collect(),
        extras: plan
            .extras
            .iter()
            .map(|o| IndexExtra {
                name: OsName(o.name.clone()),
                size: o.size,
                sha256: extra_sha.get(&o.name).cloned().unwrap_or_default(),
            })
            .collect(),
        digests: digests
            .into_iter()
            .map(|(name, tensors)| FileDigests {
                name: OsName(name),
                tensors,
            })
            .collect(),
    };
    if let Err(why) = new_index.check() {
        remove_temps(&dirs, &created);
        return Err(Error::catalog(
            primary.join(INDEX_FILE),
            format!("the index made is refused ({why}): a bug in weightstream; nothing was committed"),
        ));
    }
    let only_current = prevs.iter().all(|p| p.home == 0 && !p.parked && !p.foreign);
    let no_op = renames.is_empty() && only_current && prevs.iter().any(|p| p.index == new_index);

    // 6. Park every committed index naming a file about to be replaced.
    let mut parked_now = false;
    if !no_op {
        let targets: BTreeSet<(PathBuf, OsString)> = renames
            .iter()
            .map(|(k, _, name)| (dirs[*k].path.clone(), name.clone()))
            .collect();
        for p in prevs.iter_mut().filter(|p| !p.parked) {
            let names_target = p
                .index
                .files
                .iter()
                .map(|f| (p.index.folder_of(f.root).to_path_buf(), f.name.0.clone()))
                .chain(
                    p.index
                        .extras
                        .iter()
                        .map(|e| (p.index.folder_of(0).to_path_buf(), e.name.0.clone())),
                )
                .any(|t| targets.contains(&t));
            if names_target {
                let home = &dirs[p.home];
                if let Err(e) = rustix::fs::renameat(&home.fd, INDEX_FILE, &home.fd, PARKED_FILE) {
                    remove_temps(&dirs, &created);
                    return Err(Error::io(home.path.join(INDEX_FILE), "park the layout index", e));
                }
                home.sync()?;
                p.parked = true;
                parked_now = true;
                tracing::info!(
                    "parked {} as {PARKED_FILE}: the files it names are being replaced",
                    escape(home.path.join(INDEX_FILE))
                );
            }
        }
        if parked_now {
            hook(cfg, Step::Parked)?;
        }
    }

    // 7. Renames.
    let mut touched = BTreeSet::new();
    for (i, (k, tmp, name)) in renames.iter().enumerate() {
        let d = &dirs[*k];
        let r = d.recheck().and_then(|()| {
            rustix::fs::renameat(&d.fd, tmp, &d.fd, name)
                .map_err(|e| Error::io(d.path.join(name), "rename into place", e))
        });
        if let Err(e) = r {
            let left: Vec<(usize, OsString)> = renames[i..].iter().map(|(k, t, _)| (*k, t.clone())).collect();
            remove_temps(&dirs, &left);
            let state = if parked_now {
                "the previous index is parked: the model does not open until the next run repairs it"
            } else {
                "the previous index, if any, is as it was"
            };
            return Err(Error::Config(format!("{e}; {state}")));
        }
        touched.insert(*k);
        hook(cfg, Step::Renamed(i + 1))?;
    }
    for &k in &touched {
        dirs[k].sync()?;
    }
    hook(cfg, Step::AllRenamed)?;

    // 8. Commit.
    if !no_op {
        let d = &dirs[0];
        d.recheck()?;
        let tmp = rules::temp_name(OsStr::new(INDEX_FILE));
        let bytes = new_index.to_bytes();
        let shown = d.path.join(INDEX_FILE);
        let fd = rustix::fs::openat(
            &d.fd,
            &tmp,
            OFlags::WRONLY | OFlags::CREATE | OFlags::EXCL | OFlags::NOFOLLOW | OFlags::CLOEXEC,
            Mode::from_raw_mode(0o600),
        )
        .map_err(|e| Error::io(&shown, "create the index's temporary file", e))?;
        let mut f = std::fs::File::from(fd);
        let written = {
            use std::io::Write;
            f.write_all(&bytes).map_err(|e| Error::io(&shown, "write the index", e))
        }
        .and_then(|()| rustix::fs::fsync(&f).map_err(|e| Error::io(&shown, "fsync the index", e)));
        if let Err(e) = written {
            let _ = unlink(d, &tmp);
            return Err(e);
        }
        crate::storage::files::drop_pages(&f, 0, bytes.len() as u64);
        drop(f);
        hook(cfg, Step::IndexWritten)?;
        if let Err(e) = rustix::fs::renameat(&d.fd, &tmp, &d.fd, INDEX_FILE) {
            let _ = unlink(d, &tmp);
            return Err(Error::io(&shown, "rename the index into place (commit)", e));
        }
        d.sync()?;
        hook(cfg, Step::Committed)?;
    }

    // 9. After the commit: retire, delete stale copies, report orphans.
    for k in defer_marker.iter().copied().filter(|&k| k < n) {
        let bytes = serde_json::to_vec_pretty(&marker_of(k)).expect("a marker serialises");
        if let Err(e) = dirs[k].write_small(OsStr::new(MARKER_FILE), &bytes) {
            log.warn(format!(
                "{e}: the marker of \"{}\" was not updated",
                escape(&dirs[k].path)
            ));
        }
    }
    let mut homes: BTreeSet<usize> = prevs.iter().map(|p| p.home).collect();
    homes.insert(0);
    for h in homes {
        let d = &dirs[h];
        let mut gone = vec![PARKED_FILE];
        if h != 0 {
            gone.push(INDEX_FILE); // a retired primary
        }
        for name in gone {
            if let Err(e) = unlink(d, OsStr::new(name)) {
                log.warn(format!(
                    "{}: cannot be removed ({e}); remove it by hand",
                    escape(d.path.join(name))
                ));
            }
        }
        let _ = d.sync();
    }
    let mut deleted: Vec<FileNote> = Vec::new();
    let mut stale: BTreeMap<(PathBuf, OsString), BTreeSet<Recorded>> = BTreeMap::new();
    for p in &prevs {
        for f in &p.index.files {
            stale
                .entry((p.index.folder_of(f.root).to_path_buf(), f.name.0.clone()))
                .or_default()
                .insert(Recorded::Header {
                    size: f.size,
                    sha256: f.header_sha256.clone(),
                });
        }
        for e in &p.index.extras {
            stale
                .entry((p.index.folder_of(0).to_path_buf(), e.name.0.clone()))
                .or_default()
                .insert(Recorded::Whole {
                    size: e.size,
                    sha256: e.sha256.clone(),
                });
        }
    }
    let mut touched_dirs = BTreeSet::new();
    for ((folder, name), recorded) in stale {
        let kept = (0..n).any(|k| dirs[k].path == folder && new_index.names(k, &name));
        if kept {
            continue;
        }
        let Some(j) = find_proven(&mut dirs, &folder, &source.real, &mut log, "stale copies there are") else {
            continue;
        };
        let d = &dirs[j];
        let path = d.path.join(&name);
        let size = match d.stat(&name) {
            Ok(Some(st)) => st.st_size as u64,
            Ok(None) => continue,
            Err(e) => {
                log.warn(format!("{e}: stale copy left as it is"));
                continue;
            }
        };
        // Deleted only when it still is the file weightstream wrote: its
        // size and the sha256 the index recorded.
        let mut why = String::new();
        if !recorded.iter().any(|r| match is_recorded(d, &name, r) {
            Ok(()) => true,
            Err(w) => {
                why = w;
                false
            }
        }) {
            log.warn(format!(
                "{}: a previous index named it, but it {why}: not the file weightstream wrote, left as it is",
                escape(&path)
            ));
            continue;
        }
        match d
            .recheck()
            .map_err(|e| e.to_string())
            .and_then(|()| unlink(d, &name).map_err(|e| e.to_string()))
        {
            Ok(()) => {
                touched_dirs.insert(j);
                deleted.push(FileNote { path, size });
            }
            Err(e) => log.warn(format!(
                "{}: stale copy ({size} bytes) could not be deleted ({e}); delete it by hand",
                escape(&path)
            )),
        }
    }
    for j in touched_dirs {
        let _ = dirs[j].sync();
    }
    // Old folders (proven, not this run's) left with their marker alone
    // are removed: exactly one entry, the marker (an empty or unreadable
    // folder is not "the marker alone").
    for d in &dirs[n..] {
        if let Ok(entries) = d.entries() {
            if entries.len() == 1 && entries[0].0 == MARKER_FILE && entries[0].2 == FileType::RegularFile {
                let _ = unlink(d, OsStr::new(MARKER_FILE));
                match d.remove_dir() {
                    Ok(()) => log.note(format!("removed the empty placement folder \"{}\"", escape(&d.path))),
                    Err(e) => log.warn(format!("\"{}\": cannot be removed ({e})", escape(&d.path))),
                }
            }
        }
    }
    let mut orphans = Vec::new();
    for (j, d) in dirs.iter().enumerate() {
        let Ok(entries) = d.entries() else { continue };
        for (name, size, _) in entries {
            if index::is_reserved(&name) || (j < n && new_index.names(j, &name)) {
                continue;
            }
            if j >= n && name == MARKER_FILE {
                continue;
            }
            orphans.push(FileNote {
                path: d.path.join(&name),
                size,
            });
        }
    }
    if !orphans.is_empty() {
        let shown: Vec<String> = orphans
            .iter()
            .map(|o| format!("{} ({} bytes)", escape(&o.path), o.size))
            .collect();
        log.warn(format!(
            "{} orphan file(s) in the placement folders (no index names them; never deleted by weightstream): {}",
            orphans.len(),
            shown.join(", ")
        ));
    }
    hook(cfg, Step::Cleaned)?;

    let bytes_written: u64 = outcome.written.iter().map(|w| plan.files[w.out].size).sum();
    let cache_growth = cached_bytes() - cached0;
    let roots_report = (0..n)
        .map(|k| {
            let mine: Vec<&Output> = plan.files.iter().filter(|o| o.root == k).collect();
            RootReport {
                root: roots[k].path.clone(),
                folder: dirs[k].path.clone(),
                files: mine.len(),
                bytes: mine.iter().map(|o| o.size).sum(),
                written: written_by_root[k].0,
                bytes_written: written_by_root[k].1,
                created: dirs[k].created,
            }
        })
        .collect();
    if no_op {
        tracing::info!(
            "nothing to do: every file of the {} layout proven identical (size, header{}), index unchanged",
            cfg.layout,
            if cfg.digest { ", tensor sha256" } else { "" }
        );
    }
    Ok(PlaceReport {
        layout: cfg.layout,
        source: source.real.clone(),
        source_fingerprint: source.fingerprint.clone(),
        primary: primary.clone(),
        index: primary.join(INDEX_FILE),
        roots: roots_report,
        files_written: outcome.written.len(),
        bytes_written,
        files_reused: reused.len(),
        bytes_reused: reused.iter().map(|&i| plan.files[i].size).sum(),
        extras_written: extras_to_write.len(),
        no_op,
        parked: parked_now,
        repaired: log.repaired,
        temps_removed,
        deleted,
        orphans,
        warnings: log.warnings,
        notes: log.notes,
        seconds: t0.elapsed().as_secs_f64(),
        write_gbps: bytes_written as f64 / 1e9 / write_seconds.max(1e-9),
        write_seconds,
        cache_growth_bytes: cache_growth,
    })
}
