//! The directories a model is opened from, validated before anything is
//! opened: existing, not a link, no control characters, distinct volumes
//! and no overlap; a relative path is taken against the working directory.

use std::path::{Path, PathBuf};

use crate::config::ModelConfig;
use crate::error::{escape, Error, Result};

/// What a directory is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum RootRole {
    Primary,
    Split,
    Mirror,
}

impl RootRole {
    pub(crate) fn name(self) -> &'static str {
        match self {
            RootRole::Primary => "primary",
            RootRole::Split => "split",
            RootRole::Mirror => "mirror",
        }
    }
}

/// A validated directory.
#[derive(Debug, Clone)]
pub(crate) struct Root {
    /// As the user typed it.
    pub given: PathBuf,
    /// Canonical path.
    pub path: PathBuf,
    pub role: RootRole,
}

fn refuse(given: &Path, role: RootRole, why: &str) -> Error {
    Error::Config(format!(
        "{} directory \"{}\"{}: {why}",
        role.name(),
        escape(given),
        resolved(given)
    ))
}

/// `given` taken against the working directory when it is relative (as
/// `open(2)` takes it): a split or mirror directory, like the primary,
/// may be typed as a relative path.
pub(crate) fn absolute(given: &Path) -> std::result::Result<PathBuf, String> {
    std::path::absolute(given).map_err(|e| format!("cannot be taken against the working directory: {e}"))
}

/// For a message about a relative path: " (PATH)", the absolute path it
/// names now; nothing for an absolute one.
pub(crate) fn resolved(given: &Path) -> String {
    if given.is_absolute() {
        return String::new();
    }
    match std::path::absolute(given) {
        Ok(p) => format!(" ({})", escape(&p)),
        Err(_) => String::new(),
    }
}

/// Validates the primary, split and mirror directories: each (a relative
/// one taken against the working directory, as the primary is) an
/// existing directory, not a symlink, without control characters, not the
/// primary or inside it (or containing it), not overlapping another entry,
/// not listed twice. Mirrors on the same filesystem as another copy are
/// accepted but reported: they add no bandwidth.
pub(crate) fn validate_roots(cfg: &ModelConfig) -> Result<Vec<Root>> {
    let pmeta = std::fs::metadata(&cfg.primary).map_err(|e| {
        Error::io(
            &cfg.primary,
            "open the model (a folder, its index json or one .safetensors file)",
            e,
        )
    })?;
    if !pmeta.is_dir() {
        return Err(Error::catalog(&cfg.primary, "not a directory"));
    }
    let primary = std::fs::canonicalize(&cfg.primary).map_err(|e| Error::io(&cfg.primary, "resolve", e))?;
    let mut roots = vec![Root {
        given: cfg.primary.clone(),
        path: primary.clone(),
        role: RootRole::Primary,
    }];
    let entries = cfg
        .dirs
        .iter()
        .map(|d| (d, RootRole::Split))
        .chain(cfg.mirrors.iter().map(|d| (d, RootRole::Mirror)));
    for (given, role) in entries {
        let text = given.to_string_lossy();
        if text.chars().any(char::is_control) {
            return Err(refuse(given, role, "contains control characters; retype the path"));
        }
        let at = absolute(given).map_err(|e| refuse(given, role, &e))?;
        let meta = match std::fs::symlink_metadata(&at) {
            Ok(m) => m,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Err(refuse(
                    given,
                    role,
                    "does not exist: reconnect the drive, or remove this entry",
                ))
            }
            Err(e) => return Err(refuse(given, role, &format!("cannot be read: {e}"))),
        };
        if meta.file_type().is_symlink() {
            return Err(refuse(
                given,
                role,
                "is a symbolic link; give the directory it points to",
            ));
        }
        if !meta.is_dir() {
            return Err(refuse(given, role, "is not a directory"));
        }
        let path = std::fs::canonicalize(&at).map_err(|e| refuse(given, role, &format!("cannot be resolved: {e}")))?;
        for r in &roots {
            if path == r.path {
                let what = if r.role == RootRole::Primary {
                    "is the primary directory".to_string()
                } else {
                    format!("is listed twice (as \"{}\")", escape(&r.given))
                };
                return Err(refuse(given, role, &format!("{what}; remove this entry")));
            }
            if path.starts_with(&r.path) || r.path.starts_with(&path) {
                return Err(refuse(
                    given,
                    role,
                    &format!(
                        "overlaps the {} directory \"{}\"; give separate directories",
                        r.role.name(),
                        escape(&r.given)
                    ),
                ));
            }
        }
        roots.push(Root {
            // Absolute: the shards are listed and opened through it.
            given: at,
            path,
            role,
        });
    }
    Ok(roots)
}
