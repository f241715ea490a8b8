//! The command's errors: the library's, and the tools' own (each naming the
//! file, the operation and the cause, as the library's do).

use std::path::PathBuf;

use weightstream::__internal::escape;

/// Result alias of the command's tools.
pub(crate) type Result<T, E = Error> = std::result::Result<T, E>;

/// An error of a tool (ceiling sweep, bench, fio arm) or of the library.
#[derive(Debug, thiserror::Error)]
pub(crate) enum Error {
    /// From the library.
    #[error(transparent)]
    Lib(#[from] weightstream::Error),
    /// A system call on a file failed.
    #[error("{}: {op}: {source}", escape(path))]
    Io {
        path: PathBuf,
        op: &'static str,
        #[source]
        source: std::io::Error,
    },
    /// A configuration or a measurement was refused.
    #[error("{0}")]
    Config(String),
}

impl Error {
    pub(crate) fn io(path: impl Into<PathBuf>, op: &'static str, source: impl Into<std::io::Error>) -> Self {
        Error::Io {
            path: path.into(),
            op,
            source: source.into(),
        }
    }
}
