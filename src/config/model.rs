//! Where a model's bytes live, as the user configured it: the primary
//! directory, split directories (a search path: whole shard files spread
//! over drives), mirror directories (copies of any subset of the shards,
//! proven identical before they are trusted), drive weights and the route
//! policy. Read from a builder or from the environment; every directory is
//! validated before anything is opened.

use std::path::{Path, PathBuf};
use std::str::FromStr;

use crate::config::env;
use crate::error::{Error, Result};

/// Whether reads use O_DIRECT.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DirectMode {
    /// O_DIRECT where the file and slot allow it; every fallback counted.
    #[default]
    Auto,
    /// As `Auto`, but a shard whose filesystem refuses O_DIRECT is an error
    /// at open instead of a counted fallback.
    On,
    /// Buffered reads only (pages dropped after each read).
    Off,
}

impl FromStr for DirectMode {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        super::parse_word(
            "direct mode",
            s,
            &[
                (&["auto"], DirectMode::Auto),
                (&["on", "1", "true"], DirectMode::On),
                (&["off", "0", "false"], DirectMode::Off),
            ],
        )
    }
}

/// Most copy ranks (the primary and its mirrors) a shard may have.
pub(crate) const MAX_COPY_RANKS: usize = 8;

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
        super::parse_word(
            "route",
            s,
            &[
                (&["hash"], RoutePolicy::Hash),
                (&["stripe"], RoutePolicy::Stripe),
                (&["adaptive"], RoutePolicy::Adaptive),
            ],
        )
    }
}

impl RoutePolicy {
    /// The policy's name (`hash`, `stripe`, `adaptive`).
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
#[non_exhaustive]
pub struct ModelConfig {
    /// The primary model directory (index, config, tokenizer live here).
    pub primary: PathBuf,
    /// Extra directories searched for shards after the primary, in order.
    pub dirs: Vec<PathBuf>,
    /// Mirror directories: copies of any subset of the shards.
    pub mirrors: Vec<PathBuf>,
    /// Read weight of each copy rank (primary first), or probed.
    pub weights: Weights,
    /// How a read's chunks are spread over the copies.
    pub route: RoutePolicy,
    /// Whether reads use O_DIRECT.
    pub direct: DirectMode,
    /// Only the shards of these file names (found along the primary and
    /// split directories, with their mirror copies), the primary's index
    /// ignored: one file opened on its own, as `safe_open(path)` does.
    /// Empty: every shard (the default).
    pub only: Vec<std::ffi::OsString>,
}

impl ModelConfig {
    /// A configuration for the model in `primary`: no split directories, no mirrors, equal weights, `adaptive` routing, O_DIRECT where possible.
    pub fn new(primary: impl Into<PathBuf>) -> Self {
        ModelConfig {
            primary: primary.into(),
            dirs: Vec::new(),
            mirrors: Vec::new(),
            weights: Weights::Equal,
            route: RoutePolicy::Adaptive,
            direct: DirectMode::Auto,
            only: Vec::new(),
        }
    }

    /// One `.safetensors` file on its own: its directory as the primary,
    /// only that file ([`ModelConfig::only`]). A path without a file name
    /// (`/`, `..`) is taken as a directory.
    pub fn file(path: impl Into<PathBuf>) -> Self {
        let path = path.into();
        match (path.parent(), path.file_name()) {
            (Some(dir), Some(name)) => {
                let dir = if dir.as_os_str().is_empty() {
                    Path::new(".")
                } else {
                    dir
                };
                ModelConfig::new(dir).only([name])
            }
            _ => ModelConfig::new(path),
        }
    }

    /// What a user types for a model, as Python's `load` and `safe_open`
    /// take it: a model directory ([`ModelConfig::new`]); its
    /// `model.safetensors.index.json` (the directory, its index read as
    /// always); or one `.safetensors` file ([`ModelConfig::file`]). A
    /// path that does not exist is taken as a directory (the open says it
    /// is missing); another `*.index.json` is refused: only the
    /// directory's `model.safetensors.index.json` is ever read.
    pub fn path(path: impl Into<PathBuf>) -> Result<Self> {
        let path = path.into();
        let name = path.file_name().map(|n| n.to_string_lossy().into_owned());
        let is_file = std::fs::metadata(&path).map(|m| !m.is_dir()).unwrap_or(false);
        match name {
            Some(n) if is_file && n == crate::format::catalog::INDEX_FILE => {
                let dir = match path.parent() {
                    Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
                    _ => PathBuf::from("."),
                };
                Ok(ModelConfig::new(dir))
            }
            Some(n) if is_file && n.ends_with(".index.json") => Err(Error::catalog(
                &path,
                format!(
                    "an index is read only as its directory's {}: give the directory, that file, or one .safetensors file",
                    crate::format::catalog::INDEX_FILE
                ),
            )),
            _ if is_file => Ok(ModelConfig::file(path)),
            _ => Ok(ModelConfig::new(path)),
        }
    }

    /// Opens only the shards of these file names ([`ModelConfig::only`]).
    pub fn only<I, S>(mut self, names: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<std::ffi::OsString>,
    {
        self.only = names.into_iter().map(Into::into).collect();
        self
    }

    /// Sets the O_DIRECT mode.
    pub fn direct(mut self, mode: DirectMode) -> Self {
        self.direct = mode;
        self
    }

    /// Sets the split directories, searched for shards after the primary.
    pub fn dirs<I: IntoIterator<Item = P>, P: Into<PathBuf>>(mut self, dirs: I) -> Self {
        self.dirs = dirs.into_iter().map(Into::into).collect();
        self
    }

    /// Sets the mirror directories.
    pub fn mirrors<I: IntoIterator<Item = P>, P: Into<PathBuf>>(mut self, mirrors: I) -> Self {
        self.mirrors = mirrors.into_iter().map(Into::into).collect();
        self
    }

    /// Sets the copies' read weights.
    pub fn weights(mut self, w: Weights) -> Self {
        self.weights = w;
        self
    }

    /// Sets the route policy.
    pub fn route(mut self, r: RoutePolicy) -> Self {
        self.route = r;
        self
    }

    /// From `WEIGHTSTREAM_MODEL` (required), `WEIGHTSTREAM_MODEL_DIRS`,
    /// `WEIGHTSTREAM_MIRROR`, `WEIGHTSTREAM_DISK_WEIGHTS`, `WEIGHTSTREAM_ROUTE`
    /// and `WEIGHTSTREAM_DIRECT`; lists are `;`- or `,`-separated.
    pub fn from_env() -> Result<Self> {
        let primary = env::get(env::MODEL)
            .ok_or_else(|| Error::Config(format!("{} is not set (the primary model directory)", env::MODEL)))?;
        ModelConfig::new(primary.trim()).settings(env::get)
    }

    /// Applies `WEIGHTSTREAM_MODEL_DIRS`, `_MIRROR`, `_DISK_WEIGHTS`, `_ROUTE`
    /// and `_DIRECT` as `get` answers them: the one parser behind
    /// [`ModelConfig::from_env`] and the CLI (whose flags shadow the
    /// variables). Unset or blank values leave the field as it is.
    pub fn settings(mut self, get: impl Fn(&str) -> Option<String>) -> Result<Self> {
        let get = |k: &str| get(k).filter(|v| !v.trim().is_empty());
        if let Some(v) = get(env::MODEL_DIRS) {
            self.dirs = split_list(&v).into_iter().map(PathBuf::from).collect();
        }
        if let Some(v) = get(env::MIRROR) {
            self.mirrors = split_list(&v).into_iter().map(PathBuf::from).collect();
        }
        if let Some(v) = get(env::DISK_WEIGHTS) {
            self.weights = v.parse()?;
        }
        if let Some(v) = get(env::ROUTE) {
            self.route = v.parse()?;
        }
        if let Some(v) = get(env::DIRECT) {
            self.direct = v.parse()?;
        }
        Ok(self)
    }
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
}
