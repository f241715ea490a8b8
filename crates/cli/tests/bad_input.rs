//! Untrusted input gets an error, not a panic (DESIGN contract 8).
//!
//! Each broken model directory is given to the built binary's `digest` (in
//! every direct mode) and `inspect`: the exit status is a plain failure,
//! stdout is empty, stderr names the file (or directory) and the cause and
//! never contains "panicked". The library says the same: `Model::open`
//! returns an error whose Display names the file and the cause.

mod common;

use std::ffi::OsStr;
use std::path::{Path, PathBuf};

use common::{container_bytes, header_json, Entry};
use weightstream::{Arena, DirectMode, Model, ModelConfig, SlotSpec};

const SHARD: &str = "model.safetensors";

/// A valid header: `a` U8 [10] then `b` F32 [2,3], 34 data bytes.
fn good_entries() -> Vec<Entry> {
    vec![
        Entry::u8("a", 0, 10),
        Entry {
            name: "b".into(),
            dtype: "F32".into(),
            shape: vec![2, 3],
            begin: 10,
            end: 34,
        },
    ]
}

fn good_container() -> Vec<u8> {
    container_bytes(header_json(&good_entries()).as_bytes(), &common::content(1, 34))
}

/// A container with header `h` and `data_len` data bytes.
fn with_header(h: &[u8], data_len: usize) -> Vec<u8> {
    container_bytes(h, &common::content(2, data_len))
}

/// A raw 8-byte length followed by `rest`.
fn with_length(n: u64, rest: &[u8]) -> Vec<u8> {
    let mut v = n.to_le_bytes().to_vec();
    v.extend_from_slice(rest);
    v
}

/// Writes a broken input under the given root; returns the model dir and
/// the path the error must name.
type Make = Box<dyn Fn(&Path) -> (PathBuf, PathBuf)>;

/// One broken model: what to write, and what the error must say.
struct Bad {
    what: &'static str,
    make: Make,
    /// Substrings of the cause (all must appear).
    cause: &'static [&'static str],
}

fn shard_case(what: &'static str, bytes: Vec<u8>, cause: &'static [&'static str]) -> Bad {
    Bad {
        what,
        make: Box::new(move |root| {
            let dir = root.join(what.replace(' ', "_"));
            std::fs::create_dir(&dir).unwrap();
            let path = dir.join(SHARD);
            std::fs::write(&path, &bytes).unwrap();
            (dir, path)
        }),
        cause,
    }
}

fn cases() -> Vec<Bad> {
    let good = good_container();
    let mut v = vec![
        shard_case("truncated data", good[..good.len() - 5].to_vec(), &["but the file is"]),
        shard_case("extra trailing bytes", [&good[..], b"xyz"].concat(), &["but the file is"]),
        shard_case("header length zero", with_length(0, &good[8..]), &["header length is 0"]),
        shard_case(
            "header length past eof",
            with_length(1000, &good[8..]),
            &["header length 1000", "past end of file"],
        ),
        shard_case(
            "header length over limit",
            with_length(200_000_000, &good[8..]),
            &["header length 200000000", "limit"],
        ),
        shard_case(
            "header not an object",
            with_header(format!(" {}", header_json(&good_entries())).as_bytes(), 34),
            &["does not start with '{'"],
        ),
        shard_case(
            "invalid json",
            with_header(br#"{"a":{"dtype":"U8","shape":[10],"data_offsets":[0,10]"#, 10),
            &["not a valid safetensors table"],
        ),
        shard_case(
            "invalid utf8",
            with_header(b"{\"a\xff\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1]}}", 1),
            &["UTF-8"],
        ),
        shard_case(
            "unknown dtype",
            with_header(br#"{"a":{"dtype":"Q9","shape":[4],"data_offsets":[0,4]}}"#, 4),
            &["not a valid safetensors table", "Q9"],
        ),
        shard_case(
            "overlapping offsets",
            with_header(
                br#"{"a":{"dtype":"U8","shape":[10],"data_offsets":[0,10]},"b":{"dtype":"F32","shape":[2,3],"data_offsets":[5,29]}}"#,
                29,
            ),
            &["not a valid safetensors table", "offset"],
        ),
        shard_case(
            "gap in offsets",
            with_header(
                br#"{"a":{"dtype":"U8","shape":[10],"data_offsets":[0,10]},"b":{"dtype":"F32","shape":[2,3],"data_offsets":[12,36]}}"#,
                36,
            ),
            &["not a valid safetensors table", "offset"],
        ),
        shard_case(
            "dtype shape mismatch",
            with_header(
                br#"{"a":{"dtype":"U8","shape":[10],"data_offsets":[0,10]},"b":{"dtype":"F32","shape":[2,3],"data_offsets":[10,30]}}"#,
                30,
            ),
            &["not a valid safetensors table", "shape"],
        ),
        shard_case("file shorter than the length", b"\x05\x00\x00".to_vec(), &["too small"]),
    ];
    v.push(Bad {
        what: "header length over limit in a big sparse file",
        // 100 MB + 1 byte of header length inside a file that is large enough
        // for it: only the limit refuses it (sparse: no disk used).
        make: Box::new(|root| {
            let dir = root.join("sparse_big_header");
            std::fs::create_dir(&dir).unwrap();
            let path = dir.join(SHARD);
            let f = std::fs::File::create(&path).unwrap();
            use std::os::unix::fs::FileExt;
            f.write_all_at(&100_000_001u64.to_le_bytes(), 0).unwrap();
            f.write_all_at(b"{", 8).unwrap();
            f.set_len(100_000_200).unwrap();
            (dir, path)
        }),
        cause: &["header length 100000001", "limit"],
    });
    v.push(Bad {
        what: "empty directory",
        make: Box::new(|root| {
            let dir = root.join("empty");
            std::fs::create_dir(&dir).unwrap();
            (dir.clone(), dir)
        }),
        cause: &["no *.safetensors"],
    });
    v.push(Bad {
        what: "non-existent directory",
        make: Box::new(|root| {
            let dir = root.join("does-not-exist");
            (dir.clone(), dir)
        }),
        cause: &["No such file or directory"],
    });
    // A file is opened as one .safetensors file (as safe_open takes it):
    // one that is not a container is refused by its header.
    v.push(Bad {
        what: "a file that is not a container given as the model",
        make: Box::new(|root| {
            let p = root.join("plain-file");
            std::fs::write(&p, "hello, not a model\n").unwrap();
            (p.clone(), p)
        }),
        cause: &["refused safetensors header", "header length"],
    });
    v
}

fn check_cli(what: &str, args: &[&OsStr], names: &Path, cause: &[&str]) {
    let out = common::run(args);
    let stderr = String::from_utf8_lossy(&out.stderr);
    let stdout = String::from_utf8_lossy(&out.stdout);
    let ctx = format!("{what}: weightstream {:?}\nstderr: {stderr}\nstdout: {stdout}", args);
    assert!(!out.status.success(), "{ctx}: exited successfully");
    assert_eq!(
        out.status.code(),
        Some(1),
        "{ctx}: not a plain failure exit (signal or abort?)"
    );
    assert!(!stderr.contains("panicked"), "{ctx}: panicked");
    assert!(stdout.is_empty(), "{ctx}: wrote to stdout");
    assert!(stderr.contains("error"), "{ctx}: no error line");
    let p = names.display().to_string();
    assert!(stderr.contains(&p), "{ctx}: stderr does not name {p}");
    for c in cause {
        assert!(stderr.contains(c), "{ctx}: stderr does not give the cause {c:?}");
    }
}

/// Every broken input, through `digest` (auto, on, off) and `inspect`.
#[test]
fn cli_refuses_bad_input_naming_file_and_cause() {
    let tmp = common::tempdir();
    let all = cases();
    assert!(all.len() >= 17);
    for bad in &all {
        let (dir, names) = (bad.make)(tmp.path());
        let d = dir.as_os_str();
        let s = OsStr::new;
        check_cli(bad.what, &[s("digest"), d], &names, bad.cause);
        check_cli(bad.what, &[s("digest"), d, s("--direct"), s("off")], &names, bad.cause);
        check_cli(
            bad.what,
            &[s("digest"), d, s("--direct"), s("on"), s("--json")],
            &names,
            bad.cause,
        );
        check_cli(bad.what, &[s("inspect"), d], &names, bad.cause);
        check_cli(bad.what, &[s("inspect"), d, s("--json")], &names, bad.cause);
    }
}

/// The same inputs through the library (`ModelConfig::path`, the door the
/// command takes): `Model::open` is an error whose
/// Display names the file and the cause.
#[test]
fn model_open_refuses_bad_input_naming_file_and_cause() {
    let tmp = common::tempdir();
    for bad in cases() {
        let (dir, names) = (bad.make)(tmp.path());
        let err = match Model::open(ModelConfig::path(&dir).unwrap()) {
            Ok(_) => panic!("{}: Model::open accepted it", bad.what),
            Err(e) => e.to_string(),
        };
        let p = names.display().to_string();
        assert!(err.contains(&p), "{}: error does not name {p}: {err}", bad.what);
        for c in bad.cause {
            // The binary appends the error's sources; the library's own
            // Display must already carry the cause.
            assert!(
                err.contains(c),
                "{}: error does not give the cause {c:?}: {err}",
                bad.what
            );
        }
    }
}

/// One bad shard among good ones spoils the model, and the error names the
/// bad one, not its neighbours.
#[test]
fn one_bad_shard_among_good_ones_is_named() {
    let tmp = common::tempdir();
    let dir = tmp.path().join("mixed");
    std::fs::create_dir(&dir).unwrap();
    let mut entries = good_entries();
    for e in &mut entries {
        e.name = format!("first.{}", e.name);
    }
    std::fs::write(
        dir.join("model-00001-of-00002.safetensors"),
        container_bytes(header_json(&entries).as_bytes(), &common::content(3, 34)),
    )
    .unwrap();
    let bad = dir.join("model-00002-of-00002.safetensors");
    let good = good_container();
    std::fs::write(&bad, &good[..good.len() - 1]).unwrap();
    check_cli(
        "bad second shard",
        &[OsStr::new("digest"), dir.as_os_str()],
        &bad,
        &["but the file is"],
    );
    let err = Model::open(ModelConfig::new(&dir)).unwrap_err().to_string();
    assert!(err.contains(&bad.display().to_string()), "{err}");
    assert!(!err.contains("model-00001-of-00002"), "names the good shard: {err}");
}

/// The control: the good container is accepted by both the CLI and the
/// library, so the refusals above are about the defects, not the writer.
#[test]
fn good_container_is_accepted() {
    let tmp = common::tempdir();
    let dir = tmp.path().join("good");
    std::fs::create_dir(&dir).unwrap();
    let bytes = good_container();
    std::fs::write(dir.join(SHARD), &bytes).unwrap();
    let out = common::run(&[OsStr::new("digest"), dir.as_os_str()]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let data_start = bytes.len() - 34;
    let want = format!(
        "{}  a\n{}  b\n",
        common::sha256_hex(&bytes[data_start..data_start + 10]),
        common::sha256_hex(&bytes[data_start + 10..])
    );
    assert_eq!(String::from_utf8_lossy(&out.stdout), want);
    let m = Model::open(ModelConfig::new(&dir)).unwrap();
    assert_eq!(m.catalog().tensors().len(), 2);
}

/// A shard cut short after it was opened (and validated): the read is an
/// error naming the file, never a short payload, in every direct mode.
#[test]
fn shard_truncated_after_open_is_an_error_not_a_short_payload() {
    let tmp = common::tempdir();
    for mode in [DirectMode::Auto, DirectMode::Off] {
        let dir = tmp.path().join(format!("{mode:?}"));
        std::fs::create_dir(&dir).unwrap();
        let path = dir.join(SHARD);
        let data = common::content(4, 64 << 10);
        let header = header_json(&[Entry::u8("big", 0, data.len() as u64)]);
        std::fs::write(&path, container_bytes(header.as_bytes(), &data)).unwrap();
        let model = Model::open(ModelConfig::new(&dir).direct(mode)).unwrap();
        let t = model.tensor("big").unwrap().clone();
        let f = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
        f.set_len(t.offset + 5000).unwrap();
        drop(f);
        let arena = Arena::new(SlotSpec::new(t.len as usize), 1).unwrap();
        let err = match model.read_sync(&t, arena.take().unwrap()) {
            Ok(l) => panic!("{mode:?}: a truncated shard gave a payload of {} bytes", l.len()),
            Err(e) => e.to_string(),
        };
        assert!(err.contains(&path.display().to_string()), "{mode:?}: {err}");
        assert!(err.contains("end of file"), "{mode:?}: {err}");
        // The slot went back to the arena with the error.
        assert_eq!(arena.available(), 1);
    }
}

/// The CLI states each cause once (the error chain is not printed twice).
#[test]
fn cli_states_each_cause_once() {
    let tmp = common::tempdir();
    let dir = tmp.path().join("does-not-exist");
    let out = common::run(&[OsStr::new("digest"), dir.as_os_str()]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(stderr.matches("No such file or directory").count(), 1, "{stderr}");
}
