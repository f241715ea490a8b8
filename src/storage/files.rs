//! The shard files of an opened model: every copy of every shard, opened
//! buffered and (where the filesystem allows) O_DIRECT, with what the file
//! was at open (its identity) and the volume (drive) it lives on.

use std::fs::File;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};

use crate::error::escape;
use crate::stats::DriveCounters;
use crate::storage::topology::FileTopology;

/// One shard, opened.
#[derive(Debug)]
pub struct ShardFile {
    /// The file as opened (a link resolved).
    pub path: PathBuf,
    /// Size the header was validated against.
    pub size: u64,
    /// The buffered descriptor (header, tails, fallbacks).
    pub(crate) buffered: File,
    /// The O_DIRECT descriptor, if the filesystem accepted one.
    pub(crate) direct: Option<File>,
    /// Why there is no O_DIRECT descriptor.
    pub direct_refused: Option<String>,
    /// What the kernel says about the file's volume.
    pub topo: FileTopology,
    /// Index into [`Model::drives`](crate::Model::drives).
    pub drive: usize,
    /// The shard this file is a copy of (index into the catalog's shards).
    pub shard: usize,
    /// Copy rank: 0 for the primary (or split) copy, k for mirror directory k.
    pub rank: usize,
    /// What the file was when it was opened (from `fstat` of the open
    /// descriptor): re-checked by [`ShardFile::changed_since_open`] when a
    /// read fails, and by [`Model::verify`](crate::Model::verify).
    pub identity: FileIdentity,
    /// A failover away from this copy has been warned about.
    pub(crate) failover_warned: AtomicBool,
    /// A change after open has been warned about.
    pub(crate) change_warned: AtomicBool,
}

/// Who a file is and what it looked like: `(st_dev, st_ino)` name the
/// inode; `size` and `ctime` change when it is written, truncated or
/// extended in place (ctime also on metadata changes: chmod, link count).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct FileIdentity {
    /// `st_dev`.
    pub dev: u64,
    /// `st_ino`.
    pub ino: u64,
    /// Size in bytes.
    pub size: u64,
    /// ctime, seconds.
    pub ctime_sec: i64,
    /// ctime, nanoseconds.
    pub ctime_nsec: i64,
}

impl FileIdentity {
    pub(crate) fn of(st: &rustix::fs::Stat) -> Self {
        FileIdentity {
            dev: st.st_dev,
            ino: st.st_ino,
            size: st.st_size as u64,
            ctime_sec: st.st_ctime,
            ctime_nsec: st.st_ctime_nsec as i64,
        }
    }
}

/// One thing found changed about an opened file (see [`Model::verify`](crate::Model::verify)).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Change {
    /// The path no longer exists (reads still see the file as opened).
    Removed,
    /// The path names another inode now: replaced, e.g. by a rename (reads
    /// still see the file as opened).
    Replaced {
        /// `(st_dev, st_ino)` at open.
        was: (u64, u64),
        /// `(st_dev, st_ino)` now.
        now: (u64, u64),
    },
    /// The size differs.
    Size {
        /// At open (or in the record).
        was: u64,
        /// Now.
        now: u64,
    },
    /// The ctime differs: written in place, truncated, or its metadata changed.
    Ctime,
    /// The header bytes differ from the ones validated at open (`at`: the
    /// first differing byte, when known).
    Header {
        /// The first differing byte, when known.
        at: Option<u64>,
    },
    /// Tensor payloads differ from `against` (the primary copy, or a record).
    Digest {
        /// What the payloads were compared with.
        against: String,
        /// The tensors that differ.
        tensors: Vec<String>,
    },
    /// Not in the model now, or not in the record compared against.
    Unlisted {
        /// Which side lacks it.
        cause: String,
    },
    /// The check itself failed (fstat, stat, a read).
    Unreadable {
        /// The failed call and its error.
        cause: String,
    },
}

impl std::fmt::Display for Change {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Change::Removed => write!(f, "removed (the path no longer exists)"),
            Change::Replaced { was, now } => write!(
                f,
                "replaced (inode changed: {}:{} -> {}:{})",
                was.0, was.1, now.0, now.1
            ),
            Change::Size { was, now } => write!(f, "size {was} -> {now}"),
            Change::Ctime => write!(
                f,
                "ctime changed (written in place, truncated, or its metadata changed)"
            ),
            Change::Header { at: Some(at) } => write!(f, "header bytes differ (first difference at byte {at})"),
            Change::Header { at: None } => write!(f, "header bytes differ"),
            Change::Digest { against, tensors } => {
                let n = tensors.len();
                let shown: Vec<&str> = tensors.iter().take(8).map(String::as_str).collect();
                write!(
                    f,
                    "payload differs from {against} in {n} tensor(s): {}{}",
                    shown.join(", "),
                    if n > shown.len() { ", ..." } else { "" }
                )
            }
            Change::Unlisted { cause } => f.write_str(cause),
            Change::Unreadable { cause } => write!(f, "cannot be checked: {cause}"),
        }
    }
}

impl ShardFile {
    /// The buffered descriptor: for tools that read the file as it is
    /// (`pread` at an offset never disturbs the engine's reads).
    pub fn buffered(&self) -> &File {
        &self.buffered
    }

    /// The O_DIRECT descriptor, if the filesystem accepted one (see
    /// `direct_refused` for why not).
    pub fn direct(&self) -> Option<&File> {
        self.direct.as_ref()
    }

    /// What changed since open, from one `fstat` of the open descriptor
    /// (size, ctime) and one `stat` of the path (removed, replaced).
    /// Cheap: no data is read, so a same-size rewrite shows only as a ctime
    /// change, and its bytes are compared only by [`Model::verify`](crate::Model::verify) with
    /// `digest`.
    pub fn identity_changes(&self) -> Vec<Change> {
        let id = &self.identity;
        let mut out = Vec::new();
        match rustix::fs::fstat(&self.buffered) {
            Ok(st) => {
                let now = FileIdentity::of(&st);
                if now.size != id.size {
                    out.push(Change::Size {
                        was: id.size,
                        now: now.size,
                    });
                }
                if (now.ctime_sec, now.ctime_nsec) != (id.ctime_sec, id.ctime_nsec) {
                    out.push(Change::Ctime);
                }
            }
            Err(e) => out.push(Change::Unreadable {
                cause: format!("fstat: {e}"),
            }),
        }
        match rustix::fs::stat(&self.path) {
            Ok(st) if (st.st_dev, st.st_ino) != (id.dev, id.ino) => out.push(Change::Replaced {
                was: (id.dev, id.ino),
                now: (st.st_dev, st.st_ino),
            }),
            Ok(_) => {}
            Err(rustix::io::Errno::NOENT) => out.push(Change::Removed),
            Err(e) => out.push(Change::Unreadable {
                cause: format!("stat: {e}"),
            }),
        }
        out
    }

    /// `"changed after open: size 123 -> 456, ctime changed ..."` when the
    /// cheap check ([`ShardFile::identity_changes`]) finds a change.
    pub fn changed_since_open(&self) -> Option<String> {
        let c = self.identity_changes();
        if c.is_empty() {
            return None;
        }
        let parts: Vec<String> = c.iter().map(Change::to_string).collect();
        Some(format!("changed after open: {}", parts.join(", ")))
    }

    /// A failed or short read's cause, with the change after open appended
    /// when there is one (warned once per file). The engine calls this when
    /// a chunk fails on this copy (`queue::settle`).
    pub(crate) fn explain_failure(&self, failure: String) -> String {
        let Some(change) = self.changed_since_open() else {
            return failure;
        };
        if !self.change_warned.swap(true, Ordering::Relaxed) {
            tracing::warn!(
                "{}: {change}: its catalog (offsets, sizes) is from the file as opened; reopen the model to read \
                 the file as it is now (`weightstream verify` names every change; warned once per file)",
                escape(&self.path)
            );
        }
        format!("{failure}; {change}")
    }
}

/// One volume (`st_dev`) holding shards.
#[derive(Debug)]
pub struct Drive {
    /// `st_dev` of the volume.
    pub dev: u64,
    /// Block device name (or the mount source of a volume without one).
    pub device: String,
    /// Mount point.
    pub mount: PathBuf,
    /// Filesystem type.
    pub fs_type: String,
    /// Largest O_DIRECT offset alignment among its files.
    pub dio_align: u32,
    /// Whether every file on it opened O_DIRECT.
    pub direct_open: bool,
    pub(crate) counters: DriveCounters,
}

/// Drops the page-cache pages of a range read buffered: weights are read once
/// per step and must not crowd out the engine's memory.
pub(crate) fn drop_pages(file: &File, off: u64, len: u64) {
    // Advisory: a failure costs only cache, never bytes.
    let _ = rustix::fs::fadvise(file, off, std::num::NonZeroU64::new(len), rustix::fs::Advice::DontNeed);
}

/// Drops every cached page of `file` (after a buffered read or write of
/// it: read-ahead brings in pages past the range asked for).
pub(crate) fn drop_all_pages(file: &File) {
    drop_pages(file, 0, 0);
}

/// `pread` until `buf` is full or end of file; returns the bytes read.
/// EINTR is retried; any other error is returned.
pub(crate) fn pread_full(file: &File, buf: &mut [u8], off: u64) -> std::io::Result<usize> {
    let mut done = 0;
    while done < buf.len() {
        match std::os::unix::fs::FileExt::read_at(file, &mut buf[done..], off + done as u64) {
            Ok(0) => break,
            Ok(k) => done += k,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(done)
}
