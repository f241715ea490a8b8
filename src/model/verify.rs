//! `Model::verify`: every opened copy re-checked against what it was at
//! open (inode, size, ctime, header bytes), optionally every tensor hashed
//! (mirrors compared with the primary), and reports saved and compared
//! across runs.

use std::collections::BTreeMap;

use super::Model;
use crate::error::{escape, Result};
use crate::format::catalog::ShardInfo;
use crate::format::container;
use crate::storage::files::{drop_pages, Change, FileIdentity, ShardFile};

impl Model {
    /// Re-checks every opened copy (primary, split and mirror files) against
    /// what it was at [`Model::open`]: the path still names the same inode
    /// (else `replaced` or `removed`: reads go on seeing the file as opened,
    /// the old contents), the size and the ctime of the open file (written,
    /// truncated or extended in place), and its whole header bytes re-read
    /// and compared with the ones validated at open.
    ///
    /// With `digest`, every tensor of every copy is read (buffered, its
    /// pages dropped after) and hashed (sha256); a mirror copy whose
    /// payloads differ from the primary copy's is named with the tensors.
    /// A rewrite that keeps size and header shows only as a ctime change
    /// without `digest`; with a single copy, its bytes can be compared with
    /// an earlier report ([`VerifyReport::compare_with`]). Problems are
    /// reported, never returned as errors: the report names each file and
    /// what changed.
    pub fn verify(&self, digest: bool) -> Result<VerifyReport> {
        let cat = &self.inner.catalog;
        let mut buf = Vec::new();
        let mut files: Vec<FileVerdict> = Vec::with_capacity(self.inner.files.len());
        for f in &self.inner.files {
            let shard = &cat.shards()[f.shard];
            let raw = &shard.header.raw;
            let mut changes = f.identity_changes();
            let mut now = vec![0u8; raw.len()];
            match container::read_exact_at(&f.path, &f.buffered, &mut now, 0) {
                Ok(()) if now != *raw => changes.push(Change::Header {
                    at: now.iter().zip(raw).position(|(a, b)| a != b).map(|i| i as u64),
                }),
                Ok(()) => {}
                Err(e) => changes.push(Change::Unreadable {
                    cause: format!("header: {e}"),
                }),
            }
            drop_pages(&f.buffered, 0, raw.len() as u64);
            let mut tensors = BTreeMap::new();
            if digest {
                match digest_copy(f, shard, &mut buf) {
                    Ok(t) => tensors = t,
                    Err(cause) => changes.push(Change::Unreadable { cause }),
                }
            }
            files.push(FileVerdict {
                path: escape(&f.path),
                shard: escape(&shard.name),
                rank: f.rank,
                identity: f.identity,
                header_sha256: sha256_hex(raw),
                tensors,
                changes,
            });
        }
        if digest {
            for copies in &self.inner.copies {
                let p = copies[0];
                for &c in &copies[1..] {
                    let (primary, copy) = (&files[p], &files[c]);
                    if primary.tensors.is_empty() || copy.tensors.is_empty() {
                        continue; // unreadable: reported already
                    }
                    let differ = differing(&primary.tensors, &copy.tensors);
                    if !differ.is_empty() {
                        let against = format!("the primary copy {}", primary.path);
                        files[c].changes.push(Change::Digest {
                            against,
                            tensors: differ,
                        });
                    }
                }
            }
        }
        Ok(VerifyReport { digest, files })
    }
}

/// What [`Model::verify`] found, per opened copy. Serialisable: saved (e.g.
/// `weightstream verify --json`), it is the record a later check compares
/// against ([`VerifyReport::compare_with`]).
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct VerifyReport {
    /// Whether tensor payloads were hashed.
    pub digest: bool,
    /// Every copy, in file order (primary copies first, then mirror copies).
    pub files: Vec<FileVerdict>,
}

/// One copy of a shard, re-checked.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct FileVerdict {
    /// The file opened (escaped, see `layout::escape`).
    pub path: String,
    /// The shard's file name (escaped).
    pub shard: String,
    /// Copy rank (0 primary or split, k mirror directory k).
    pub rank: usize,
    /// The file as opened.
    pub identity: FileIdentity,
    /// sha256 of the header bytes validated at open (length prefix included).
    pub header_sha256: String,
    /// With `digest`: sha256 of every tensor of the shard, read from this copy.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub tensors: BTreeMap<String, String>,
    /// What changed (empty: nothing).
    pub changes: Vec<Change>,
}

impl VerifyReport {
    /// The copies with at least one change.
    pub fn changed(&self) -> impl Iterator<Item = &FileVerdict> {
        self.files.iter().filter(|f| !f.changes.is_empty())
    }

    /// Nothing changed.
    pub fn is_clean(&self) -> bool {
        self.changed().next().is_none()
    }

    /// Adds what changed since `earlier`, a report saved from the same
    /// model before (another process, another day): files are matched by
    /// path; a different inode, size, ctime, header or (when both hashed
    /// them) tensor digest is a change; a file in one report and not the
    /// other is one too.
    pub fn compare_with(&mut self, earlier: &VerifyReport) {
        for f in &mut self.files {
            let Some(e) = earlier.files.iter().find(|e| e.path == f.path) else {
                f.changes.push(Change::Unlisted {
                    cause: "not in the record compared against (a new copy)".to_string(),
                });
                continue;
            };
            let (was, now) = (&e.identity, &f.identity);
            if (was.dev, was.ino) != (now.dev, now.ino) {
                f.changes.push(Change::Replaced {
                    was: (was.dev, was.ino),
                    now: (now.dev, now.ino),
                });
            }
            if was.size != now.size {
                f.changes.push(Change::Size {
                    was: was.size,
                    now: now.size,
                });
            }
            if (was.ctime_sec, was.ctime_nsec) != (now.ctime_sec, now.ctime_nsec) {
                f.changes.push(Change::Ctime);
            }
            if e.header_sha256 != f.header_sha256 {
                f.changes.push(Change::Header { at: None });
            }
            if !e.tensors.is_empty() && !f.tensors.is_empty() {
                let differ = differing(&e.tensors, &f.tensors);
                if !differ.is_empty() {
                    f.changes.push(Change::Digest {
                        against: "the record".to_string(),
                        tensors: differ,
                    });
                }
            }
        }
        for e in &earlier.files {
            if !self.files.iter().any(|f| f.path == e.path) {
                self.files.push(FileVerdict {
                    tensors: BTreeMap::new(),
                    changes: vec![Change::Unlisted {
                        cause: "in the record but not a copy in the model now (removed or refused)".to_string(),
                    }],
                    ..e.clone()
                });
            }
        }
    }
}

/// Tensor names whose digests differ, or that only one side has.
fn differing(a: &BTreeMap<String, String>, b: &BTreeMap<String, String>) -> Vec<String> {
    let mut v: Vec<String> = a
        .iter()
        .filter(|(n, h)| b.get(*n) != Some(h))
        .map(|(n, _)| n.clone())
        .chain(b.keys().filter(|n| !a.contains_key(*n)).cloned())
        .collect();
    v.sort();
    v
}

fn sha256_hex(bytes: &[u8]) -> String {
    use sha2::Digest;
    sha2::Sha256::digest(bytes).iter().map(|b| format!("{b:02x}")).collect()
}

/// sha256 of every tensor of `shard` as copy `f` holds it now (buffered
/// reads of 8 MiB, pages dropped after each); the first read that fails or
/// ends early is the error.
fn digest_copy(
    f: &ShardFile,
    shard: &ShardInfo,
    buf: &mut Vec<u8>,
) -> std::result::Result<BTreeMap<String, String>, String> {
    use sha2::Digest;
    use std::os::unix::fs::FileExt;
    const STEP: usize = 8 << 20;
    buf.resize(STEP, 0);
    let mut out = BTreeMap::new();
    for t in &shard.header.tensors {
        let start = shard.header.data_start + t.begin;
        let end = shard.header.data_start + t.end;
        let mut h = sha2::Sha256::new();
        let mut at = start;
        while at < end {
            let want = ((end - at) as usize).min(STEP);
            match f.buffered.read_at(&mut buf[..want], at) {
                Ok(0) => {
                    return Err(format!(
                        "end of file at byte {at} while hashing tensor {:?} [{start}, {end})",
                        t.name
                    ))
                }
                Ok(n) => {
                    h.update(&buf[..n]);
                    at += n as u64;
                }
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(format!("read at byte {at} (tensor {:?}): {e}", t.name)),
            }
        }
        drop_pages(&f.buffered, start, end - start);
        out.insert(
            t.name.clone(),
            h.finalize().iter().map(|b| format!("{b:02x}")).collect(),
        );
    }
    Ok(out)
}
