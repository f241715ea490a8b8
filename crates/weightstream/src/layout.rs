//! Where a model's bytes live, as the user configured it: the primary
//! directory, split directories (a search path: whole shard files spread
//! over drives), mirror directories (copies of any subset of the shards,
//! proven identical before they are trusted), drive weights and the route
//! policy. Read from a builder or from the environment; every directory is
//! validated before anything is opened.

use std::path::{Path, PathBuf};
use std::str::FromStr;

use crate::direct::DirectMode;
use crate::error::{Error, Result};

/// How a read's chunks are spread over the copies of its shard.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum RoutePolicy {
    /// The whole read to one copy, chosen by a multiplicative hash of the
    /// tensor's group key against cut points from the weights (the field's
    /// behaviour, kept as the baseline).
    Hash,
    /// Every read split into aligned chunks over all copies, in proportion
    /// to the weights.
    Stripe,
    /// Each chunk to the copy whose drive has the least outstanding bytes per
    /// unit of measured throughput.
    #[default]
    Adaptive,
}

impl FromStr for RoutePolicy {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s.trim().to_ascii_lowercase().as_str() {
            "hash" => Ok(RoutePolicy::Hash),
            "stripe" => Ok(RoutePolicy::Stripe),
            "adaptive" => Ok(RoutePolicy::Adaptive),
            other => Err(Error::Config(format!(
                "route {other:?}: expected hash, stripe or adaptive"
            ))),
        }
    }
}

impl RoutePolicy {
    pub fn name(self) -> &'static str {
        match self {
            RoutePolicy::Hash => "hash",
            RoutePolicy::Stripe => "stripe",
            RoutePolicy::Adaptive => "adaptive",
        }
    }
}

/// Relative read weights of the copies (primary first, then each mirror
/// directory in order).
#[derive(Debug, Clone, PartialEq, Default)]
pub enum Weights {
    /// Every copy the same.
    #[default]
    Equal,
    /// One positive weight per copy rank (primary, mirror 1, ...).
    Explicit(Vec<f64>),
    /// Measured at startup by a short O_DIRECT read of each copy.
    Probe,
}

impl FromStr for Weights {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        let t = s.trim();
        if t.is_empty() || t.eq_ignore_ascii_case("equal") {
            return Ok(Weights::Equal);
        }
        if t.eq_ignore_ascii_case("probe") {
            return Ok(Weights::Probe);
        }
        let w = split_list(t)
            .iter()
            .map(|x| match x.parse::<f64>() {
                Ok(v) if v > 0.0 && v.is_finite() => Ok(v),
                _ => Err(Error::Config(format!(
                    "weights {s:?}: {x:?} is not a positive number (expected e.g. 1,1 or 3,1, or probe)"
                ))),
            })
            .collect::<Result<Vec<f64>>>()?;
        Ok(Weights::Explicit(w))
    }
}

/// Splits a `;`- or `,`-separated list, trimming entries and dropping empty ones.
pub fn split_list(s: &str) -> Vec<String> {
    s.split([';', ','])
        .map(str::trim)
        .filter(|x| !x.is_empty())
        .map(str::to_string)
        .collect()
}

/// How to open a model.
#[derive(Debug, Clone)]
pub struct ModelConfig {
    /// The primary model directory (index, config, tokenizer live here).
    pub primary: PathBuf,
    /// Extra directories searched for shards after the primary, in order.
    pub dirs: Vec<PathBuf>,
    /// Mirror directories: copies of any subset of the shards.
    pub mirrors: Vec<PathBuf>,
    pub weights: Weights,
    pub route: RoutePolicy,
    /// Whether reads use O_DIRECT.
    pub direct: DirectMode,
}

impl ModelConfig {
    pub fn new(primary: impl Into<PathBuf>) -> Self {
        ModelConfig {
            primary: primary.into(),
            dirs: Vec::new(),
            mirrors: Vec::new(),
            weights: Weights::Equal,
            route: RoutePolicy::Adaptive,
            direct: DirectMode::Auto,
        }
    }

    pub fn direct(mut self, mode: DirectMode) -> Self {
        self.direct = mode;
        self
    }

    pub fn dirs<I: IntoIterator<Item = P>, P: Into<PathBuf>>(mut self, dirs: I) -> Self {
        self.dirs = dirs.into_iter().map(Into::into).collect();
        self
    }

    pub fn mirrors<I: IntoIterator<Item = P>, P: Into<PathBuf>>(mut self, mirrors: I) -> Self {
        self.mirrors = mirrors.into_iter().map(Into::into).collect();
        self
    }

    pub fn weights(mut self, w: Weights) -> Self {
        self.weights = w;
        self
    }

    pub fn route(mut self, r: RoutePolicy) -> Self {
        self.route = r;
        self
    }

    /// From `WEIGHTSTREAM_MODEL` (required), `WEIGHTSTREAM_MODEL_DIRS`,
    /// `WEIGHTSTREAM_MIRROR`, `WEIGHTSTREAM_DISK_WEIGHTS`, `WEIGHTSTREAM_ROUTE`
    /// and `WEIGHTSTREAM_DIRECT`; lists are `;`- or `,`-separated.
    pub fn from_env() -> Result<Self> {
        let primary = env_var("WEIGHTSTREAM_MODEL")
            .ok_or_else(|| Error::Config("WEIGHTSTREAM_MODEL is not set (the primary model directory)".into()))?;
        ModelConfig::new(primary.trim()).settings(env_var)
    }

    /// Applies `WEIGHTSTREAM_MODEL_DIRS`, `_MIRROR`, `_DISK_WEIGHTS`, `_ROUTE`
    /// and `_DIRECT` as `get` answers them: the one parser behind
    /// [`ModelConfig::from_env`] and the CLI (whose flags shadow the
    /// variables). Unset or blank values leave the field as it is.
    pub fn settings(mut self, get: impl Fn(&str) -> Option<String>) -> Result<Self> {
        let get = |k: &str| get(k).filter(|v| !v.trim().is_empty());
        if let Some(v) = get("WEIGHTSTREAM_MODEL_DIRS") {
            self.dirs = split_list(&v).into_iter().map(PathBuf::from).collect();
        }
        if let Some(v) = get("WEIGHTSTREAM_MIRROR") {
            self.mirrors = split_list(&v).into_iter().map(PathBuf::from).collect();
        }
        if let Some(v) = get("WEIGHTSTREAM_DISK_WEIGHTS") {
            self.weights = v.parse()?;
        }
        if let Some(v) = get("WEIGHTSTREAM_ROUTE") {
            self.route = v.parse()?;
        }
        if let Some(v) = get("WEIGHTSTREAM_DIRECT") {
            self.direct = v.parse()?;
        }
        Ok(self)
    }
}

/// A variable of the environment, if set (to anything but blanks).
pub fn env_var(k: &str) -> Option<String> {
    std::env::var(k).ok().filter(|v| !v.trim().is_empty())
}

/// What a directory is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RootRole {
    Primary,
    Split,
    Mirror,
}

impl RootRole {
    pub fn name(self) -> &'static str {
        match self {
            RootRole::Primary => "primary",
            RootRole::Split => "split",
            RootRole::Mirror => "mirror",
        }
    }
}

/// A validated directory.
#[derive(Debug, Clone)]
pub struct Root {
    /// As the user typed it.
    pub given: PathBuf,
    /// Canonical path.
    pub path: PathBuf,
    pub role: RootRole,
    pub dev: u64,
}

/// Shows a path or file name for people: control characters escaped (so a
/// refusal can be read and matched against what was typed), and bytes that
/// are not UTF-8 as `\xNN` (names need not be UTF-8; two names that differ
/// only in such bytes still show differently, which a lossy display would
/// not). Identity is never the escaped form: names stay `OsStr`/`Path`.
pub fn escape(p: impl AsRef<std::ffi::OsStr>) -> String {
    use std::fmt::Write;
    use std::os::unix::ffi::OsStrExt;
    let mut out = String::new();
    for chunk in p.as_ref().as_bytes().utf8_chunks() {
        out.extend(chunk.valid().chars().flat_map(char::escape_debug));
        for b in chunk.invalid() {
            let _ = write!(out, "\\x{b:02x}");
        }
    }
    out
}

/// Serialises a path or name as its [`escape`]d text (serde's own
/// `Path` serialisation fails on names that are not UTF-8).
pub fn serialize_escaped<T: AsRef<std::ffi::OsStr>, S: serde::Serializer>(v: &T, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(&escape(v))
}

fn refuse(given: &Path, role: RootRole, why: &str) -> Error {
    Error::Config(format!("{} directory \"{}\": {why}", role.name(), escape(given)))
}

/// Validates the primary, split and mirror directories: each absolute, an
/// existing directory, not a symlink, without control characters, not the
/// primary or inside it (or containing it), not overlapping another entry,
/// not listed twice. Mirrors on the same filesystem as another copy are
/// accepted but reported: they add no bandwidth.
pub fn validate_roots(cfg: &ModelConfig) -> Result<Vec<Root>> {
    use std::os::unix::fs::MetadataExt;
    let pmeta = std::fs::metadata(&cfg.primary).map_err(|e| Error::io(&cfg.primary, "open model directory", e))?;
    if !pmeta.is_dir() {
        return Err(Error::catalog(&cfg.primary, "not a directory"));
    }
    let primary = std::fs::canonicalize(&cfg.primary).map_err(|e| Error::io(&cfg.primary, "resolve", e))?;
    let mut roots = vec![Root {
        given: cfg.primary.clone(),
        path: primary.clone(),
        role: RootRole::Primary,
        dev: pmeta.dev(),
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
        if !given.is_absolute() {
            return Err(refuse(given, role, "is not an absolute path; give the full path"));
        }
        let meta = match std::fs::symlink_metadata(given) {
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
        let path =
            std::fs::canonicalize(given).map_err(|e| refuse(given, role, &format!("cannot be resolved: {e}")))?;
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
            given: given.clone(),
            path,
            role,
            dev: meta.dev(),
        });
    }
    Ok(roots)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lists_split_trim_and_drop_empties() {
        assert_eq!(split_list(" /a ; /b,, /c ;"), ["/a", "/b", "/c"]);
        assert!(split_list(" ; , ").is_empty());
    }

    #[test]
    fn weights_and_routes_parse() {
        assert_eq!("1,3".parse::<Weights>().unwrap(), Weights::Explicit(vec![1.0, 3.0]));
        assert_eq!("probe".parse::<Weights>().unwrap(), Weights::Probe);
        assert!("1,-1".parse::<Weights>().is_err());
        assert!("1,x".parse::<Weights>().is_err());
        assert_eq!("STRIPE".parse::<RoutePolicy>().unwrap(), RoutePolicy::Stripe);
        assert!("fastest".parse::<RoutePolicy>().is_err());
    }

    #[test]
    fn escape_shows_control_characters() {
        assert_eq!(escape(Path::new("/a\nb\tc")), "/a\\nb\\tc");
    }

    #[test]
    fn escape_shows_invalid_bytes_distinctly() {
        use std::os::unix::ffi::OsStrExt;
        let a = std::ffi::OsStr::from_bytes(b"/m/a\xff.safetensors");
        let b = std::ffi::OsStr::from_bytes(b"/m/a\xfe.safetensors");
        assert_eq!(escape(a), "/m/a\\xff.safetensors");
        assert_ne!(escape(a), escape(b));
        assert_eq!(escape("caf\u{e9}"), "caf\u{e9}");
    }
}
