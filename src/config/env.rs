//! The `WEIGHTSTREAM_*` variables a user sets: every name, who reads it and
//! what it sets, in one table ([`ALL`]).
//! [`ModelConfig::from_env`](crate::ModelConfig::from_env),
//! [`EngineConfig::from_env`](crate::EngineConfig::from_env), the command's
//! flags (each shadows its variable) and the tests (which run the command
//! without them) all take the names from here.
//!
//! Nothing reads the environment behind a caller's back but the NUMA
//! topology: an engine whose [`EngineConfig::numa_provider`](crate::EngineConfig::numa_provider)
//! is left `None` takes [`NUMA`], [`NUMA_XML`] and [`NUMA_DEVICE_MAP`] from
//! it. Every other variable applies only through a `from_env`.

use std::path::Path;

use crate::storage::numa::Provider;

/// Who reads a variable.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Scope {
    /// The library ([`ModelConfig::from_env`](crate::ModelConfig::from_env),
    /// [`EngineConfig::from_env`](crate::EngineConfig::from_env)).
    Library,
    /// The `weightstream` command only.
    Command,
    /// The test suites and CI scripts only (not in [`ALL`]).
    #[doc(hidden)]
    Tests,
}

/// One environment variable.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct EnvVar {
    /// Its name.
    pub name: &'static str,
    /// Who reads it.
    pub scope: Scope,
    /// What it sets, and its values.
    pub meaning: &'static str,
}

macro_rules! vars {
    ($(#[$tdoc:meta])* $table:ident; $($(#[$doc:meta])* $id:ident = $name:literal, $scope:ident, $meaning:literal;)*) => {
        $( $(#[$doc])* pub const $id: &str = $name; )*
        $(#[$tdoc])*
        pub const $table: &[EnvVar] = &[$(EnvVar { name: $name, scope: Scope::$scope, meaning: $meaning }),*];
    };
}

vars! {
    /// Every variable a user sets (the library's and the command's), in
    /// one table.
    ALL;
    /// The primary model directory (required by `ModelConfig::from_env`).
    MODEL = "WEIGHTSTREAM_MODEL", Library, "the primary model directory";
    /// Split directories searched for shards after the primary.
    MODEL_DIRS = "WEIGHTSTREAM_MODEL_DIRS", Library, "extra directories searched for shards, `;` or `,` separated";
    /// Mirror directories.
    MIRROR = "WEIGHTSTREAM_MIRROR", Library, "mirror directories holding copies of any subset of the shards";
    /// Read weights per copy rank, or `probe`.
    DISK_WEIGHTS = "WEIGHTSTREAM_DISK_WEIGHTS", Library, "read weights per copy, primary first (1,1 or 3,1), equal, or probe";
    /// The route policy.
    ROUTE = "WEIGHTSTREAM_ROUTE", Library, "hash, stripe or adaptive";
    /// O_DIRECT mode.
    DIRECT = "WEIGHTSTREAM_DIRECT", Library, "auto, on or off";
    /// The I/O backend.
    BACKEND = "WEIGHTSTREAM_BACKEND", Library, "auto, uring or pread (the command also takes sync)";
    /// Chunks in flight per drive.
    QD = "WEIGHTSTREAM_QD", Library, "chunks in flight per drive (default 32)";
    /// Largest chunk in bytes.
    CHUNK = "WEIGHTSTREAM_CHUNK", Library, "largest chunk in bytes (default: the device's max_sectors_kb, 1-4 MiB)";
    /// Kernel-side submission polling.
    SQPOLL = "WEIGHTSTREAM_SQPOLL", Library, "1, on or true: SQPOLL rings";
    /// Completion polling.
    IOPOLL = "WEIGHTSTREAM_IOPOLL", Library, "off, auto (on) or force";
    /// How reads are issued per drive.
    SUBMIT = "WEIGHTSTREAM_SUBMIT", Library, "auto, inline, async or rings:N";
    /// io-wq's worker bound when reads are punted.
    IOWQ_WORKERS = "WEIGHTSTREAM_IOWQ_WORKERS", Library, "io-wq bounded workers per ring when reads are punted";
    /// NUMA placement on or off.
    NUMA = "WEIGHTSTREAM_NUMA", Library, "on or off (0, off, false, no)";
    /// An hwloc XML topology instead of the live system.
    NUMA_XML = "WEIGHTSTREAM_NUMA_XML", Library, "path of an hwloc XML topology used instead of the live system";
    /// Aliases of this machine's devices onto the XML topology's.
    NUMA_DEVICE_MAP = "WEIGHTSTREAM_NUMA_DEVICE_MAP", Library, "vda=nvme0n1,0:27=nvme1n1: this machine's devices as the XML topology's";
    /// The command's log filter.
    LOG = "WEIGHTSTREAM_LOG", Command, "log filter of the command (tracing-subscriber EnvFilter syntax)";
}

/// The variables of the test suites, CI and the command's crash tests
/// (`weightstream::__internal::env`; not a stable API, not in [`ALL`]).
pub(crate) mod knobs {
    use super::{EnvVar, Scope};

    vars! {
        /// Every test, CI and crash-test variable, in one table.
        TESTS;
        /// Tests only: `weightstream place` kills itself (`kill -9`) at a step
        /// of the commit protocol.
        PLACE_FAULT = "WEIGHTSTREAM_PLACE_FAULT", Command, "tests only: `place` kills itself (kill -9) at this step of the commit protocol (folders, file:K, parked, renamed:K, renamed, index-written, committed, cleaned)";
        /// Tests: a missing Python reference fails instead of skipping.
        REQUIRE_REFERENCE = "WEIGHTSTREAM_REQUIRE_REFERENCE", Tests, "1: a missing Python reference is a failure, not a skip";
        /// Tests: where the simdrives script is.
        SIMDRIVES = "WEIGHTSTREAM_SIMDRIVES", Tests, "path of the simdrives script for the drive tests";
        /// CI: seconds per fuzz target.
        FUZZ_SECONDS = "WEIGHTSTREAM_FUZZ_SECONDS", Tests, "seconds per fuzz target in ci/test (default 20)";
    }
}

/// A variable of the environment, if set to anything but blanks (the one
/// reader behind every `from_env`).
pub(crate) fn get(k: &str) -> Option<String> {
    std::env::var(k).ok().filter(|v| !v.trim().is_empty())
}

/// Whether a switch value means off (`0`, `off`, `false`, `no`).
pub(crate) fn is_off(v: &str) -> bool {
    matches!(v.trim().to_ascii_lowercase().as_str(), "0" | "off" | "false" | "no")
}

/// The topology provider the environment asks for (`WEIGHTSTREAM_NUMA`,
/// `WEIGHTSTREAM_NUMA_XML`, `WEIGHTSTREAM_NUMA_DEVICE_MAP`): see
/// [`Provider::from_settings`].
pub(crate) fn numa_provider() -> Provider {
    let xml = get(NUMA_XML);
    Provider::from_settings(
        get(NUMA).is_some_and(|v| is_off(&v)),
        xml.as_deref().map(Path::new),
        get(NUMA_DEVICE_MAP).as_deref(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_name_is_listed_once_and_prefixed() {
        let mut names: Vec<&str> = ALL.iter().chain(knobs::TESTS).map(|v| v.name).collect();
        assert!(names.iter().all(|n| n.starts_with("WEIGHTSTREAM_")));
        names.sort_unstable();
        let n = names.len();
        names.dedup();
        assert_eq!(names.len(), n);
        // The user's table holds no test variable; the tests' no library one.
        assert!(ALL.iter().all(|v| v.scope != Scope::Tests));
        assert!(knobs::TESTS.iter().all(|v| v.scope != Scope::Library));
    }
}
