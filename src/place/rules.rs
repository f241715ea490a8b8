//! Where a placement may write, and the folder rules that keep it safe
//! (the field's trainer rules, see `docs/layouts.md`):
//!
//! - roots are validated as `Model::open` validates
//!   model directories (absolute, an existing directory, not a link, no
//!   control characters, not the source or overlapping it or each other,
//!   not twice), and each must be its own volume (`st_dev`): not the
//!   source's (unless allowed) and not another root's;
//! - on each root, one folder per model, `<basename>-<12 hex of
//!   sha256(realpath of the source)>`, created `0700`; on reuse opened
//!   `O_NOFOLLOW | O_DIRECTORY` and refused unless a directory owned by the
//!   effective uid with no group or other write bit, then `fchmod`ed to
//!   `0700` (and checked: a filesystem that ignores the mode refuses the
//!   run);
//! - the folder is re-checked before every file written into it, and files
//!   are written with `*at` calls relative to the verified descriptor;
//! - each folder holds a marker ([`Marker`]) and is locked (`flock`) for
//!   the run.
//!
//! Every refusal names the entry as typed (control characters escaped) and
//! the way out.

use std::ffi::{OsStr, OsString};
use std::os::fd::OwnedFd;
use std::os::unix::ffi::{OsStrExt, OsStringExt};
use std::path::{Path, PathBuf};

use rustix::fs::{AtFlags, FileType, Mode, OFlags};

use crate::error::{escape, Error, Result};
use crate::model::placed::{self as index, Marker, MARKER_FILE, MAX_ROOTS, TEMP_PREFIX};

/// A validated root.
#[derive(Debug)]
pub(crate) struct Root {
    /// As given.
    pub given: PathBuf,
    /// Real path.
    pub path: PathBuf,
    pub dev: u64,
}

fn refuse(given: &Path, why: impl std::fmt::Display) -> Error {
    Error::Config(format!(
        "root \"{}\"{}: {why}",
        escape(given),
        crate::model::resolved(given)
    ))
}

/// `st_dev` as `MAJ:MIN`.
pub(crate) fn show_dev(dev: u64) -> String {
    format!("{}:{}", rustix::fs::major(dev), rustix::fs::minor(dev))
}

/// Validates the roots of a placement against its source (`source_real`,
/// on `source_dev`). A root on the source's volume is refused unless
/// `allow_source_volume`.
pub(crate) fn check_roots(
    given: &[PathBuf],
    source_real: &Path,
    source_dev: u64,
    allow_source_volume: bool,
) -> Result<Vec<Root>> {
    use std::os::unix::fs::MetadataExt;
    if given.is_empty() {
        return Err(Error::Config(
            "no root given: name at least one directory to place the model on (--to ROOT[;ROOT...])".into(),
        ));
    }
    if given.len() > MAX_ROOTS {
        return Err(Error::Config(format!(
            "{} roots given; at most {MAX_ROOTS} (the most copies of a shard a model opens)",
            given.len()
        )));
    }
    let mut roots: Vec<Root> = Vec::with_capacity(given.len());
    for g in given {
        if g.as_os_str().to_string_lossy().chars().any(char::is_control) {
            return Err(refuse(g, "contains control characters; retype the path"));
        }
        let at = crate::model::absolute(g).map_err(|e| refuse(g, e))?;
        let meta = match std::fs::symlink_metadata(&at) {
            Ok(m) => m,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Err(refuse(g, "does not exist: reconnect the drive, or remove this entry"))
            }
            Err(e) => return Err(refuse(g, format!("cannot be read: {e}"))),
        };
        if meta.file_type().is_symlink() {
            return Err(refuse(g, "is a symbolic link; give the directory it points to"));
        }
        if !meta.is_dir() {
            return Err(refuse(g, "is not a directory"));
        }
        let path = std::fs::canonicalize(&at).map_err(|e| refuse(g, format!("cannot be resolved: {e}")))?;
        if path == source_real || path.starts_with(source_real) || source_real.starts_with(&path) {
            return Err(refuse(
                g,
                format!(
                    "overlaps the source directory \"{}\"; give a directory outside it (on another drive)",
                    escape(source_real)
                ),
            ));
        }
        for r in &roots {
            if path == r.path {
                return Err(refuse(
                    g,
                    format!("is listed twice (as \"{}\"); remove this entry", escape(&r.given)),
                ));
            }
            if path.starts_with(&r.path) || r.path.starts_with(&path) {
                return Err(refuse(
                    g,
                    format!("overlaps the root \"{}\"; give separate directories", escape(&r.given)),
                ));
            }
            if meta.dev() == r.dev {
                return Err(refuse(
                    g,
                    format!(
                        "is on the same volume (device {}) as the root \"{}\": two roots on one drive read no \
                         faster than one; give one root per drive",
                        show_dev(r.dev),
                        escape(&r.given)
                    ),
                ));
            }
        }
        if meta.dev() == source_dev {
            if !allow_source_volume {
                return Err(refuse(
                    g,
                    format!(
                        "is on the same volume (device {}) as the source \"{}\": the copy would read and write one \
                         drive and add no read bandwidth; give a root on another drive, or allow it \
                         (--allow-source-volume)",
                        show_dev(source_dev),
                        escape(source_real)
                    ),
                ));
            }
            tracing::warn!(
                "root \"{}\" is on the source's volume (device {}): allowed (--allow-source-volume)",
                escape(g),
                show_dev(source_dev)
            );
        }
        roots.push(Root {
            given: g.clone(),
            path,
            dev: meta.dev(),
        });
    }
    Ok(roots)
}

pub use crate::model::placed::folder_name;

/// A placement folder, verified, open, locked for the run.
#[derive(Debug)]
pub(crate) struct SafeDir {
    /// The root's real path.
    pub root: PathBuf,
    /// `root/<folder name>`.
    pub path: PathBuf,
    pub name: OsString,
    root_fd: OwnedFd,
    pub fd: OwnedFd,
    dev: u64,
    /// Its inode (what its marker is bound to).
    pub ino: u64,
    /// Made by this run (removed again if the run is refused before writing).
    pub created: bool,
    /// Made by this run, or proven by its marker (read before this run
    /// rewrote it) to be this model's folder on this root: only in such a
    /// folder does a placement delete anything.
    pub proven: bool,
}

/// Why a folder is not safe to write into, with the way out.
fn unsafe_folder(path: &Path, why: impl std::fmt::Display) -> Error {
    Error::Config(format!("placement folder \"{}\" {why}", escape(path)))
}

impl SafeDir {
    /// Opens (creating it `0700` when `create` and missing) the folder
    /// `name` of `root`, checks it (a directory, not a link, owned by the
    /// effective uid, no group or other write bit), makes it `0700` and
    /// locks it. `Ok(None)` when missing and not `create`.
    pub(crate) fn open(root: &Path, name: &OsStr, create: bool) -> Result<Option<SafeDir>> {
        let path = root.join(name);
        let root_fd = index::open_dir_no_links(root)?;
        let mut created = false;
        if create {
            match rustix::fs::mkdirat(&root_fd, name, Mode::from_raw_mode(0o700)) {
                Ok(()) => created = true,
                Err(rustix::io::Errno::EXIST) => {}
                Err(e) => return Err(Error::io(&path, "create placement folder (mkdir 0700)", e)),
            }
        }
        let fd = match rustix::fs::openat(
            &root_fd,
            name,
            OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
            Mode::empty(),
        ) {
            Ok(fd) => fd,
            Err(rustix::io::Errno::NOENT) if !create => return Ok(None),
            Err(e @ (rustix::io::Errno::LOOP | rustix::io::Errno::NOTDIR)) => {
                let what = match rustix::fs::statat(&root_fd, name, AtFlags::SYMLINK_NOFOLLOW) {
                    Ok(st) => FileType::from_raw_mode(st.st_mode),
                    Err(_) => FileType::Unknown,
                };
                return Err(match what {
                    FileType::Symlink => unsafe_folder(
                        &path,
                        "is a symbolic link: refused (a link could send the model's files anywhere); remove the \
                         link and run again",
                    ),
                    FileType::Unknown => Error::io(&path, "open placement folder", e),
                    other => unsafe_folder(
                        &path,
                        format!(
                            "is {}, not a directory: refused; move it away (weightstream did not make it) and run \
                             again",
                            crate::storage::open::kind_of(other)
                        ),
                    ),
                });
            }
            Err(e) => return Err(Error::io(&path, "open placement folder", e)),
        };
        let st = rustix::fs::fstat(&fd).map_err(|e| Error::io(&path, "fstat", e))?;
        let dir = SafeDir {
            root: root.to_path_buf(),
            path,
            name: name.to_os_string(),
            root_fd,
            fd,
            dev: st.st_dev,
            ino: st.st_ino,
            created,
            proven: created,
        };
        let done = dir
            .check_owner_and_mode(&st)
            .and_then(|()| dir.make_private())
            .and_then(|()| dir.lock());
        if let Err(e) = done {
            dir.remove_if_created();
            return Err(e);
        }
        Ok(Some(dir))
    }

    /// Opens the existing placement folder `folder` that a previous layout
    /// names but this run was not given as a root (a retired primary, a
    /// root dropped from the layout), only when its marker proves it this
    /// model's ([`index::open_marked`]: reached without following a link,
    /// the marker bound to the folder's inode) and it is owned by the
    /// effective uid with mode `0700`, as weightstream leaves it. Nothing
    /// is changed (no `fchmod`); the folder is then locked. `Err` says why
    /// not, for a warning naming it: such a folder is left as it is.
    pub(crate) fn open_proven(folder: &Path, source: &Path) -> std::result::Result<SafeDir, String> {
        let (Some(root), Some(name)) = (folder.parent(), folder.file_name()) else {
            return Err("is not a folder inside a root".into());
        };
        let m = index::open_marked(root, name, source)?;
        let euid = rustix::process::geteuid().as_raw();
        if m.stat.st_uid != euid {
            return Err(format!(
                "is owned by uid {}, not by this user (uid {euid})",
                m.stat.st_uid
            ));
        }
        let mode = m.stat.st_mode & 0o7777;
        if mode != 0o700 {
            return Err(format!("has mode {mode:04o}, not the 0700 weightstream leaves"));
        }
        let dir = SafeDir {
            root: root.to_path_buf(),
            path: folder.to_path_buf(),
            name: name.to_os_string(),
            root_fd: m.root_fd,
            fd: m.fd,
            dev: m.stat.st_dev,
            ino: m.stat.st_ino,
            created: false,
            proven: true,
        };
        dir.lock().map_err(|e| e.to_string())?;
        Ok(dir)
    }

    fn check_owner_and_mode(&self, st: &rustix::fs::Stat) -> Result<()> {
        let euid = rustix::process::geteuid().as_raw();
        if st.st_uid != euid {
            return Err(unsafe_folder(
                &self.path,
                format!(
                    "is owned by uid {}, not by this user (uid {euid}): refused (its owner could change the files \
                     you read); remove it, or choose another root",
                    st.st_uid
                ),
            ));
        }
        let mode = st.st_mode & 0o7777;
        if mode & 0o022 != 0 {
            return Err(unsafe_folder(
                &self.path,
                format!(
                    "is writable by group or others (mode {mode:04o}): refused (another user could plant or replace \
                     files); check its contents, then `chmod 700` it or remove it"
                ),
            ));
        }
        Ok(())
    }

    /// `fchmod 0700`, then checks that it took (a filesystem that ignores
    /// Unix permissions refuses the run).
    fn make_private(&self) -> Result<()> {
        let before = rustix::fs::fstat(&self.fd).map_err(|e| Error::io(&self.path, "fstat", e))?;
        if let Err(e) = rustix::fs::fchmod(&self.fd, Mode::from_raw_mode(0o700)) {
            return Err(unsafe_folder(
                &self.path,
                format!(
                    "cannot be made private (fchmod 0700: {e}): refused, nothing was written; check the folder \
                     (immutable? `lsattr -d`) or the filesystem (one without Unix permissions?)"
                ),
            ));
        }
        let st = rustix::fs::fstat(&self.fd).map_err(|e| Error::io(&self.path, "fstat", e))?;
        if st.st_mode & 0o7777 != 0o700 {
            return Err(unsafe_folder(
                &self.path,
                format!(
                    "cannot be made private: its mode is {:04o} after fchmod 0700 (the filesystem ignores Unix \
                     permissions): refused, nothing was written; choose a root on a filesystem with permissions",
                    st.st_mode & 0o7777
                ),
            ));
        }
        if before.st_mode & 0o7777 != 0o700 {
            tracing::info!(
                "placement folder \"{}\": mode {:04o} -> 0700",
                escape(&self.path),
                before.st_mode & 0o7777
            );
        }
        Ok(())
    }

    fn lock(&self) -> Result<()> {
        match rustix::fs::flock(&self.fd, rustix::fs::FlockOperation::NonBlockingLockExclusive) {
            Ok(()) => Ok(()),
            Err(rustix::io::Errno::WOULDBLOCK) => Err(unsafe_folder(
                &self.path,
                "is in use by another `weightstream place` (flock): wait for it to finish, then run again",
            )),
            Err(e) => Err(Error::io(&self.path, "flock", e)),
        }
    }

    /// Checks again, before a file is written: the descriptor is still a
    /// directory owned by us with mode `0700`, and the folder's name in its
    /// root still names that directory (not renamed away, not replaced by
    /// a link).
    pub(crate) fn recheck(&self) -> Result<()> {
        let st = rustix::fs::fstat(&self.fd).map_err(|e| Error::io(&self.path, "fstat", e))?;
        let euid = rustix::process::geteuid().as_raw();
        if FileType::from_raw_mode(st.st_mode) != FileType::Directory
            || st.st_uid != euid
            || st.st_mode & 0o7777 != 0o700
        {
            return Err(unsafe_folder(
                &self.path,
                format!(
                    "changed during the run (owner uid {}, mode {:04o}; expected uid {euid}, 0700): stopped; check \
                     who else writes there",
                    st.st_uid,
                    st.st_mode & 0o7777
                ),
            ));
        }
        match rustix::fs::statat(&self.root_fd, &self.name, AtFlags::SYMLINK_NOFOLLOW) {
            Ok(now) if (now.st_dev, now.st_ino) == (self.dev, self.ino) => Ok(()),
            Ok(_) => Err(unsafe_folder(
                &self.path,
                "was replaced during the run (its name now names another file): stopped; check who else writes \
                 there",
            )),
            Err(e) => Err(unsafe_folder(
                &self.path,
                format!("was moved or removed during the run ({e}): stopped"),
            )),
        }
    }

    /// Removes the folder if this run made it and it is still empty.
    pub(crate) fn remove_if_created(&self) {
        if self.created {
            let _ = rustix::fs::unlinkat(&self.root_fd, &self.name, AtFlags::REMOVEDIR);
        }
    }

    /// Removes an empty folder (after its last file was deleted).
    pub(crate) fn remove_dir(&self) -> std::io::Result<()> {
        rustix::fs::unlinkat(&self.root_fd, &self.name, AtFlags::REMOVEDIR).map_err(Into::into)
    }

    /// `fsync` of the folder (its entries: renames, new and removed files).
    pub(crate) fn sync(&self) -> Result<()> {
        rustix::fs::fsync(&self.fd).map_err(|e| Error::io(&self.path, "fsync placement folder", e))
    }

    /// The entries of the folder with their size and type (`.`, `..` left
    /// out).
    pub(crate) fn entries(&self) -> Result<Vec<(OsString, u64, FileType)>> {
        let mut dir = rustix::fs::Dir::read_from(&self.fd).map_err(|e| Error::io(&self.path, "list folder", e))?;
        let mut out = Vec::new();
        while let Some(ent) = dir.read() {
            let ent = ent.map_err(|e| Error::io(&self.path, "list folder", e))?;
            let name = OsStr::from_bytes(ent.file_name().to_bytes()).to_os_string();
            if name == "." || name == ".." {
                continue;
            }
            match rustix::fs::statat(&self.fd, &name, AtFlags::SYMLINK_NOFOLLOW) {
                Ok(st) => out.push((name, st.st_size as u64, FileType::from_raw_mode(st.st_mode))),
                Err(rustix::io::Errno::NOENT) => {}
                Err(e) => return Err(Error::io(self.path.join(&name), "stat", e)),
            }
        }
        out.sort_by(|a, b| a.0.cmp(&b.0));
        Ok(out)
    }

    /// Size and type of entry `name`, `None` when missing.
    pub(crate) fn stat(&self, name: &OsStr) -> Result<Option<rustix::fs::Stat>> {
        match rustix::fs::statat(&self.fd, name, AtFlags::SYMLINK_NOFOLLOW) {
            Ok(st) => Ok(Some(st)),
            Err(rustix::io::Errno::NOENT) => Ok(None),
            Err(e) => Err(Error::io(self.path.join(name), "stat", e)),
        }
    }

    /// Removes temporary files of earlier runs (ours: [`TEMP_PREFIX`]);
    /// returns how many.
    pub(crate) fn remove_stale_temps(&self) -> Result<Vec<(OsString, u64)>> {
        let mut gone = Vec::new();
        for (name, size, ft) in self.entries()? {
            if index::is_temp(&name) && ft == FileType::RegularFile {
                self.recheck()?;
                match rustix::fs::unlinkat(&self.fd, &name, AtFlags::empty()) {
                    Ok(()) | Err(rustix::io::Errno::NOENT) => gone.push((name, size)),
                    Err(e) => return Err(Error::io(self.path.join(&name), "remove a temporary file", e)),
                }
            }
        }
        Ok(gone)
    }

    /// Writes a small file atomically: a temporary file in the folder
    /// (`O_EXCL`, `0600`), written, `fsync`ed, renamed over `name`; the
    /// folder is not `fsync`ed (the caller does, once).
    pub(crate) fn write_small(&self, name: &OsStr, bytes: &[u8]) -> Result<()> {
        use std::io::Write;
        self.recheck()?;
        let tmp = temp_name(name);
        let shown = self.path.join(name);
        let fd = rustix::fs::openat(
            &self.fd,
            &tmp,
            OFlags::WRONLY | OFlags::CREATE | OFlags::EXCL | OFlags::NOFOLLOW | OFlags::CLOEXEC,
            Mode::from_raw_mode(0o600),
        )
        .map_err(|e| Error::io(&shown, "create a temporary file", e))?;
        let mut f = std::fs::File::from(fd);
        let done = f
            .write_all(bytes)
            .map_err(|e| Error::io(&shown, "write", e))
            .and_then(|()| rustix::fs::fsync(&f).map_err(|e| Error::io(&shown, "fsync", e)))
            .and_then(|()| {
                crate::storage::files::drop_pages(&f, 0, bytes.len() as u64);
                rustix::fs::renameat(&self.fd, &tmp, &self.fd, name).map_err(|e| Error::io(&shown, "rename", e))
            });
        if done.is_err() {
            let _ = rustix::fs::unlinkat(&self.fd, &tmp, AtFlags::empty());
        }
        done
    }

    /// Reads the marker, if there is one.
    pub(crate) fn marker(&self) -> Result<Option<Marker>> {
        let shown = self.path.join(MARKER_FILE);
        match index::read_small_at(&self.fd, MARKER_FILE, &shown)? {
            Some(b) => Marker::parse(&shown, &b).map(Some),
            None => Ok(None),
        }
    }
}

/// The temporary name `name` is written under (in the same folder).
pub(crate) fn temp_name(name: &OsStr) -> OsString {
    let mut v = format!("{TEMP_PREFIX}{}.", std::process::id()).into_bytes();
    v.extend_from_slice(name.as_bytes());
    OsString::from_vec(v)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn folder_names_hash_the_real_path() {
        let n = folder_name(Path::new("/models/Qwen3-30B"));
        let s = n.to_str().unwrap();
        assert!(s.starts_with("Qwen3-30B-"), "{s}");
        assert_eq!(s.len(), "Qwen3-30B-".len() + 12);
        assert_ne!(n, folder_name(Path::new("/other/Qwen3-30B")));
        assert_eq!(n, folder_name(Path::new("/models/Qwen3-30B")));
        let long = PathBuf::from(format!("/m/{}", "x".repeat(300)));
        assert_eq!(folder_name(&long).len(), 200 + 1 + 12);
    }

    #[test]
    fn temp_names_carry_the_prefix() {
        let t = temp_name(OsStr::new("a.safetensors"));
        assert!(index::is_temp(&t));
        assert!(index::is_reserved(&t));
        assert!(t.to_str().unwrap().ends_with(".a.safetensors"));
    }
}
