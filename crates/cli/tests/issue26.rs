//! The four hostile inputs of issue 26, each as a new user would try it,
//! under a 2 GiB address-space limit: each gets a clear error that names
//! the flag or the file, never an abort, an OOM or a report of nothing.
//!
//! 1. `gen --expert-bytes 0` (and `--size` of u64::MAX): refused by the
//!    flag's range before any tensor list is built.
//! 2. `verify DIR --against /dev/zero` (and a large sparse file): refused by
//!    kind and by size, never read whole.
//! 3. `load DIR --name nosuch`: an error naming `--name`, not "0 tensors".
//! 4. An arena the kernel refuses (`digest --inflight 4096` on a 512 MiB
//!    tensor asks for 2 TiB): the bytes, the limit in force and the flag.

mod common;

use std::ffi::OsStr;
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::Path;
use std::process::{Command, Output};

use common::{container_bytes, header_json, Entry};
use weightstream_synth::{self as synth, SynthSpec};

const ADDRESS_SPACE: u64 = 2 << 30;

/// The binary with `args` under a 2 GiB address space.
fn run_limited(args: &[&OsStr]) -> Output {
    let mut c = common::hermetic(Command::new(common::bin()));
    c.args(args);
    // SAFETY: between fork and exec the closure only calls setrlimit, which
    // is async-signal-safe; it allocates nothing and takes no lock.
    unsafe {
        c.pre_exec(|| {
            let lim = libc::rlimit {
                rlim_cur: ADDRESS_SPACE,
                rlim_max: ADDRESS_SPACE,
            };
            if libc::setrlimit(libc::RLIMIT_AS, &lim) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    c.output().expect("run the weightstream binary")
}

/// Exit status (not a signal), stderr; asserts no panic or abort.
fn refused(out: &Output, what: &str) -> String {
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert_eq!(out.status.signal(), None, "{what}: killed by a signal:\n{stderr}");
    assert!(!out.status.success(), "{what}: exit 0:\n{stderr}");
    assert!(
        !stderr.contains("panicked") && !stderr.contains("memory allocation of"),
        "{what}: {stderr}"
    );
    stderr
}

fn tiny_model(dir: &Path) {
    let spec = SynthSpec {
        layers: 2,
        experts: 2,
        expert_bytes: 64 << 10,
        shards: 1,
        ..SynthSpec::default()
    };
    synth::write_model(dir, &spec).unwrap();
}

#[test]
fn gen_refuses_absurd_sizes_by_flag_before_building_anything() {
    let tmp = tempfile::tempdir().unwrap();
    let out_dir = tmp.path().join("m");
    for (flag, value) in [("--expert-bytes", "0"), ("--size", "18446744073709551615")] {
        let out = run_limited(&[
            OsStr::new("gen"),
            out_dir.as_os_str(),
            OsStr::new(flag),
            OsStr::new(value),
        ]);
        let e = refused(&out, &format!("gen {flag} {value}"));
        assert!(e.contains(flag) && e.contains("accepted range"), "{e}");
        assert!(!out_dir.exists(), "nothing is written");
    }
    // Legal flags whose product is absurd: refused by the plan, naming them.
    let out = run_limited(&[
        OsStr::new("gen"),
        out_dir.as_os_str(),
        OsStr::new("--expert-bytes"),
        OsStr::new("5760"),
    ]);
    let e = refused(&out, "gen --expert-bytes 5760");
    assert!(
        e.contains("--size") && e.contains("experts per layer, more than 4096"),
        "{e}"
    );
    assert!(!out_dir.exists(), "nothing is written");
}

#[test]
fn verify_against_reads_no_unbounded_record() {
    let tmp = tempfile::tempdir().unwrap();
    let model = tmp.path().join("m");
    tiny_model(&model);
    let out = run_limited(&[
        OsStr::new("verify"),
        model.as_os_str(),
        OsStr::new("--against"),
        OsStr::new("/dev/zero"),
    ]);
    let e = refused(&out, "verify --against /dev/zero");
    assert!(
        e.contains("--against") && e.contains("/dev/zero") && e.contains("character device"),
        "{e}"
    );
    // A regular file over the bound: its size and the bound named, unread.
    let big = tmp.path().join("big.json");
    std::fs::File::create(&big).unwrap().set_len(8 << 30).unwrap();
    let out = run_limited(&[
        OsStr::new("verify"),
        model.as_os_str(),
        OsStr::new("--against"),
        big.as_os_str(),
    ]);
    let e = refused(&out, "verify --against an 8 GiB file");
    assert!(
        e.contains("big.json") && e.contains("8589934592 bytes, over the 268435456-byte bound"),
        "{e}"
    );
    assert_eq!(out.status.code(), Some(2), "the check could not run: {e}");
}

#[test]
fn load_of_nothing_is_an_error_naming_the_filter() {
    let tmp = tempfile::tempdir().unwrap();
    let model = tmp.path().join("m");
    tiny_model(&model);
    for method in ["weightstream", "safetensors-mmap", "fs-read", "mmap"] {
        let out = run_limited(&[
            OsStr::new("load"),
            model.as_os_str(),
            OsStr::new("--name"),
            OsStr::new("nosuch"),
            OsStr::new("--method"),
            OsStr::new(method),
        ]);
        let e = refused(&out, &format!("load --name nosuch --method {method}"));
        assert!(
            e.contains("--name \"nosuch\"") && e.contains("no tensor name contains"),
            "{e}"
        );
        assert!(out.stdout.is_empty(), "no report of nothing");
    }
}

/// One --name of several that matches nothing is a typo, refused naming
/// it, never a load of less than was asked (issue 19).
#[test]
fn load_with_one_name_matching_nothing_is_an_error_naming_it() {
    let tmp = tempfile::tempdir().unwrap();
    let model = tmp.path().join("m");
    tiny_model(&model);
    for method in ["weightstream", "mmap"] {
        let out = run_limited(&[
            OsStr::new("load"),
            model.as_os_str(),
            OsStr::new("--name"),
            OsStr::new("layers.0."),
            OsStr::new("--name"),
            OsStr::new("lm_haed"),
            OsStr::new("--method"),
            OsStr::new(method),
        ]);
        let e = refused(&out, &format!("load --name layers.0. --name lm_haed --method {method}"));
        assert!(
            e.contains("--name \"lm_haed\": no tensor name contains it") && !e.contains("\"layers.0.\""),
            "{e}"
        );
        assert!(out.stdout.is_empty(), "no report of a partial load");
    }
}

#[test]
fn a_refused_arena_names_the_bytes_the_limit_and_the_flag() {
    let tmp = tempfile::tempdir().unwrap();
    let model = tmp.path().join("m");
    std::fs::create_dir(&model).unwrap();
    // One 512 MiB tensor in a sparse file: never read (the arena is refused
    // first).
    let len: u64 = 512 << 20;
    let header = header_json(&[Entry::u8("big", 0, len)]);
    let shard = model.join("model.safetensors");
    std::fs::write(&shard, container_bytes(header.as_bytes(), &[])).unwrap();
    let f = std::fs::OpenOptions::new().write(true).open(&shard).unwrap();
    f.set_len(8 + header.len() as u64 + len).unwrap();
    let out = run_limited(&[
        OsStr::new("digest"),
        model.as_os_str(),
        OsStr::new("--inflight"),
        OsStr::new("4096"),
        OsStr::new("--backend"),
        OsStr::new("pread"),
    ]);
    let e = refused(&out, "digest --inflight 4096 of a 512 MiB tensor");
    assert!(e.contains("mmap of ") && e.contains(" bytes refused"), "{e}");
    assert!(e.contains(&format!("RLIMIT_AS {ADDRESS_SPACE} bytes")), "{e}");
    assert!(e.contains("RLIMIT_MEMLOCK") && e.contains("cgroup"), "{e}");
    assert!(e.contains("--inflight 4096"), "{e}");
}
