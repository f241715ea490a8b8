//! Helpers of the command's integration tests: the library's test helpers
//! (one file, included), and running the built `weightstream` binary.

#![allow(dead_code)]

use std::path::PathBuf;
use std::process::{Command, Output};

#[path = "../../../../tests/common/mod.rs"]
mod lib_common;
#[allow(unused_imports)]
pub use lib_common::*;

/// The built `weightstream` binary.
pub fn bin() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_weightstream"))
}

/// Environment variables that change what the binary does (every library
/// and command variable of the library's table, `weightstream::env::ALL`,
/// and the command's crash-test variable of the hidden one,
/// `weightstream::__internal::env::TESTS`); tests run it without them so
/// the arguments alone decide (a developer's `WEIGHTSTREAM_MIRROR` or
/// `WEIGHTSTREAM_ROUTE` must never leak into a test's layout).
pub fn env_knobs() -> Vec<&'static str> {
    weightstream::env::ALL
        .iter()
        .chain(weightstream::__internal::env::TESTS)
        .filter(|v| v.scope != weightstream::env::Scope::Tests)
        .map(|v| v.name)
        .collect()
}

/// `cmd` with the [`env_knobs`] removed.
pub fn hermetic(mut cmd: Command) -> Command {
    for k in env_knobs() {
        cmd.env_remove(k);
    }
    cmd
}

/// Runs the binary with `args`; logging at its default level.
pub fn run(args: &[&std::ffi::OsStr]) -> Output {
    let mut cmd = hermetic(Command::new(bin()));
    cmd.args(args).output().expect("run the weightstream binary")
}

/// Runs the binary with `args` and parses its `--json` stdout; panics with
/// stderr when it fails. Returns the JSON and stderr.
pub fn run_json(args: &[&std::ffi::OsStr]) -> (serde_json::Value, String) {
    let out = run(args);
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(out.status.success(), "weightstream {args:?} failed:\n{stderr}");
    let v = serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("weightstream {args:?}: stdout is not JSON ({e}):\n{stderr}"));
    (v, stderr)
}

/// Runs the binary with `args` and the variables in `env` set (on top of the
/// hermetic environment).
pub fn run_with_env(args: &[&std::ffi::OsStr], env: &[(&str, &std::ffi::OsStr)]) -> Output {
    let mut cmd = hermetic(Command::new(bin()));
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd.args(args).output().expect("run the weightstream binary")
}
