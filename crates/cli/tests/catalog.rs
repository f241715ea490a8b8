//! Many shards, one catalog: duplicate names, the index, metadata files
//! that are not shards, and Hugging Face style symlinked shards.

mod common;

use std::ffi::OsStr;
use std::path::{Path, PathBuf};

use common::{container_bytes, header_json, Entry};
use weightstream::{Arena, DirectMode, Model, ModelConfig, SlotSpec};

/// (name, absolute file offset, bytes) of each tensor a shard holds.
type Written = Vec<(String, u64, Vec<u8>)>;

/// A shard of U8 tensors written in the given order.
fn shard(path: &Path, tensors: &[(&str, usize)], seed: u64) -> Written {
    let mut entries = Vec::new();
    let mut at = 0u64;
    for (name, len) in tensors {
        entries.push(Entry::u8(name, at, at + *len as u64));
        at += *len as u64;
    }
    let header = header_json(&entries);
    let data = common::content(seed, at as usize);
    std::fs::write(path, container_bytes(header.as_bytes(), &data)).unwrap();
    let data_start = 8 + header.len() as u64;
    entries
        .iter()
        .map(|e| {
            (
                e.name.clone(),
                data_start + e.begin,
                data[e.begin as usize..e.end as usize].to_vec(),
            )
        })
        .collect()
}

fn write_index(dir: &Path, map: &[(&str, &str)]) -> PathBuf {
    let weight_map: serde_json::Map<String, serde_json::Value> =
        map.iter().map(|(t, f)| (t.to_string(), (*f).into())).collect();
    let path = dir.join("model.safetensors.index.json");
    let v = serde_json::json!({"metadata": {"total_size": 0}, "weight_map": weight_map});
    std::fs::write(&path, serde_json::to_vec_pretty(&v).unwrap()).unwrap();
    path
}

/// Reads `name` through the in-place path and returns the payload.
fn read(model: &Model, name: &str) -> Vec<u8> {
    let t = model.tensor(name).unwrap();
    let arena = Arena::new(SlotSpec::new(t.len.max(1) as usize), 1).unwrap();
    model.read_sync(t, arena.take().unwrap()).unwrap().to_vec()
}

fn digest_cli(args: &[&OsStr]) -> String {
    let out = common::run(args);
    assert!(
        out.status.success(),
        "weightstream {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

const S1: &str = "model-00001-of-00002.safetensors";
const S2: &str = "model-00002-of-00002.safetensors";

/// Two shards both holding `dup` (at different offsets, different bytes).
fn two_shards_with_dup(dir: &Path) -> (Written, Written) {
    let one = shard(&dir.join(S1), &[("a", 1001), ("dup", 5003)], 1);
    let two = shard(&dir.join(S2), &[("dup", 5003), ("b", 777)], 2);
    assert_ne!(one[1].2, two[0].2);
    (one, two)
}

#[test]
fn same_tensor_in_two_shards_without_index_is_an_error_naming_both() {
    let tmp = common::tempdir();
    let dir = tmp.path();
    two_shards_with_dup(dir);
    let err = Model::open(ModelConfig::new(dir)).unwrap_err().to_string();
    for want in ["\"dup\"", S1, S2, "model.safetensors.index.json"] {
        assert!(err.contains(want), "error does not mention {want}: {err}");
    }
    let out = common::run(&[OsStr::new("digest"), dir.as_os_str()]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && out.stdout.is_empty(), "{stderr}");
    assert!(
        stderr.contains(S1) && stderr.contains(S2) && !stderr.contains("panicked"),
        "{stderr}"
    );
}

/// The index decides a duplicate, whichever shard it names; the catalog
/// points at that shard's range and every read path returns its bytes.
#[test]
fn index_decides_a_duplicate_in_favour_of_the_named_shard() {
    for (chosen, other) in [(S2, S1), (S1, S2)] {
        let tmp = common::tempdir();
        let dir = tmp.path();
        let (one, two) = two_shards_with_dup(dir);
        write_index(dir, &[("a", S1), ("dup", chosen), ("b", S2)]);
        let (want_off, want_bytes) = if chosen == S1 {
            (one[1].1, one[1].2.clone())
        } else {
            (two[0].1, two[0].2.clone())
        };

        let model = Model::open(ModelConfig::new(dir)).unwrap();
        let cat = model.catalog();
        let t = model.tensor("dup").unwrap();
        assert_eq!(
            cat.shards()[t.shard].name,
            chosen,
            "index chose {chosen}, catalog kept the other"
        );
        assert_eq!(cat.shards()[t.shard].path, dir.join(chosen));
        assert_eq!((t.offset, t.len), (want_off, 5003));
        assert_eq!(cat.tensors().iter().filter(|t| t.name == "dup").count(), 1);
        assert_eq!(cat.tensors().len(), 3);
        assert_eq!(read(&model, "dup"), want_bytes, "read the bytes of {other}");

        let hex = common::sha256_hex(&want_bytes);
        let d = dir.as_os_str();
        for mode in ["auto", "off"] {
            let s = OsStr::new;
            let one_line = digest_cli(&[s("digest"), d, s("--tensor"), s("dup"), s("--direct"), s(mode)]);
            assert_eq!(one_line, format!("{hex}  dup\n"), "mode {mode}, index chose {chosen}");
            let all = digest_cli(&[s("digest"), d, s("--direct"), s(mode)]);
            let lines: Vec<&str> = all.lines().collect();
            assert_eq!(lines.len(), 3, "{all}");
            assert!(lines.contains(&format!("{hex}  dup").as_str()), "{all}");
        }
    }
}

/// An index that maps the duplicate to a shard that does not hold it does
/// not settle it.
#[test]
fn index_mapping_a_duplicate_elsewhere_is_an_error() {
    let tmp = common::tempdir();
    let dir = tmp.path();
    two_shards_with_dup(dir);
    let s3 = "model-extra.safetensors";
    shard(&dir.join(s3), &[("c", 10)], 3);
    write_index(dir, &[("a", S1), ("dup", s3), ("b", S2), ("c", s3)]);
    let err = Model::open(ModelConfig::new(dir)).unwrap_err().to_string();
    for want in ["\"dup\"", S1, S2, s3] {
        assert!(err.contains(want), "error does not mention {want}: {err}");
    }
}

/// `config.json`, tokenizer files, the index and other JSON are not shards
/// (each would fail to open as one). (A directory named `*.safetensors` is
/// an error naming it, not skipped: `tests/nonregular.rs`.)
#[test]
fn metadata_files_are_not_treated_as_shards() {
    let tmp = common::tempdir();
    let dir = tmp.path();
    let only = shard(&dir.join("model.safetensors"), &[("w", 4099)], 4);
    std::fs::write(dir.join("config.json"), br#"{"model_type": "x"}"#).unwrap();
    std::fs::write(dir.join("tokenizer.json"), br#"{"version": "1.0"}"#).unwrap();
    std::fs::write(dir.join("tokenizer_config.json"), b"{}").unwrap();
    std::fs::write(dir.join("generation_config.json"), b"{}").unwrap();
    std::fs::write(dir.join("special_tokens_map.json"), b"{}").unwrap();
    std::fs::write(dir.join("README.md"), b"# not a shard").unwrap();
    std::fs::write(dir.join("model.safetensors.index.json.bak"), b"garbage").unwrap();
    std::fs::write(dir.join("model.safetensors.partial"), b"garbage").unwrap();
    write_index(dir, &[("w", "model.safetensors")]);

    let model = Model::open(ModelConfig::new(dir)).unwrap();
    let names: Vec<&str> = model
        .catalog()
        .shards()
        .iter()
        .map(|s| s.name.to_str().unwrap())
        .collect();
    assert_eq!(names, ["model.safetensors"]);
    assert_eq!(read(&model, "w"), only[0].2);

    let out = digest_cli(&[OsStr::new("inspect"), dir.as_os_str(), OsStr::new("--json")]);
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["shards"].as_array().unwrap().len(), 1, "{out}");
    assert_eq!(v["tensors"], 1, "{out}");
}

/// The layout of a Hugging Face cache: the snapshot holds relative links to
/// content-addressed blobs. The catalog resolves them, reads the blob's
/// bytes, keeps the listed name (so the index still matches), and O_DIRECT
/// opens the resolved file.
#[test]
fn symlinked_shards_like_a_hugging_face_cache_are_read() {
    let tmp = common::tempdir();
    let root = tmp.path();
    let blobs = root.join("blobs");
    let snap = root.join("snapshots").join("0123abcd");
    std::fs::create_dir_all(&blobs).unwrap();
    std::fs::create_dir_all(&snap).unwrap();
    let b1 = blobs.join("9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08");
    let b2 = blobs.join("60303ae22b998861bce3b28f33eec1be758a213c86c93c076dbe9f558c11c752");
    let t1 = shard(&b1, &[("l0.w", 9000), ("l0.b", 13)], 5);
    let t2 = shard(&b2, &[("l1.w", 70_001)], 6);
    std::os::unix::fs::symlink(Path::new("../../blobs").join(b1.file_name().unwrap()), snap.join(S1)).unwrap();
    std::os::unix::fs::symlink(Path::new("../../blobs").join(b2.file_name().unwrap()), snap.join(S2)).unwrap();
    let index_blob = blobs.join("index-blob");
    write_index(&blobs, &[("l0.w", S1), ("l0.b", S1), ("l1.w", S2)]);
    std::fs::rename(blobs.join("model.safetensors.index.json"), &index_blob).unwrap();
    std::os::unix::fs::symlink("../../blobs/index-blob", snap.join("model.safetensors.index.json")).unwrap();

    let modes = if common::fs_reads_o_direct(root) {
        vec![DirectMode::Auto, DirectMode::On, DirectMode::Off]
    } else {
        eprintln!("note: no O_DIRECT on this filesystem; --direct on not checked");
        vec![DirectMode::Auto, DirectMode::Off]
    };
    for mode in modes {
        let model = Model::open(ModelConfig::new(&snap).direct(mode)).unwrap();
        let cat = model.catalog();
        let names: Vec<&str> = cat.shards().iter().map(|s| s.name.to_str().unwrap()).collect();
        assert_eq!(names, [S1, S2]);
        assert_eq!(cat.shards()[0].path, std::fs::canonicalize(&b1).unwrap());
        for (name, off, bytes) in t1.iter().chain(t2.iter()) {
            assert_eq!(model.tensor(name).unwrap().offset, *off);
            assert_eq!(&read(&model, name), bytes, "{name} via {mode:?}");
        }
        if mode == DirectMode::On {
            assert!(model.files().iter().all(|f| f.direct().is_some()));
            assert!(model.stats().reads_direct() > 0, "{:?}", model.stats());
        }
    }
    let s = OsStr::new;
    let out = digest_cli(&[s("digest"), snap.as_os_str(), s("--direct"), s("auto")]);
    let mut want: Vec<String> = t1
        .iter()
        .chain(t2.iter())
        .map(|(n, _, b)| format!("{}  {n}", common::sha256_hex(b)))
        .collect();
    want.sort_by(|a, b| a[66..].cmp(&b[66..]));
    assert_eq!(out.lines().collect::<Vec<_>>(), want);
}

#[test]
fn dangling_shard_link_is_an_error_naming_the_link() {
    let tmp = common::tempdir();
    let dir = tmp.path();
    shard(&dir.join(S1), &[("a", 10)], 7);
    let link = dir.join(S2);
    std::os::unix::fs::symlink("../blobs/gone", &link).unwrap();
    let err = Model::open(ModelConfig::new(dir)).unwrap_err().to_string();
    assert!(err.contains(&link.display().to_string()), "{err}");
}

#[test]
fn index_naming_a_missing_shard_is_an_error_naming_the_index() {
    let tmp = common::tempdir();
    let dir = tmp.path();
    shard(&dir.join(S1), &[("a", 10)], 8);
    let missing = "model-00002-of-00002.safetensors";
    let index = write_index(dir, &[("a", S1), ("b", missing)]);
    let err = Model::open(ModelConfig::new(dir)).unwrap_err().to_string();
    assert!(
        err.contains(&index.display().to_string()),
        "does not name the index: {err}"
    );
    assert!(err.contains(missing), "does not name the missing shard: {err}");
    // Said as what it is: files missing from the directory, which is named.
    assert!(
        err.contains(&format!(
            "names 1 shard file(s) that are missing from {}: \"{missing}\"",
            dir.display()
        )),
        "does not say the file is missing from the directory: {err}"
    );
    assert!(err.contains("1 *.safetensors file(s) found there"), "{err}");

    let out = common::run(&[OsStr::new("digest"), dir.as_os_str()]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && out.stdout.is_empty(), "{stderr}");
    assert!(
        stderr.contains(&index.display().to_string()) && !stderr.contains("panicked"),
        "{stderr}"
    );
}

/// With split directories, the message names every directory searched.
#[test]
fn index_naming_a_shard_missing_from_every_directory_names_them() {
    let tmp = common::tempdir();
    let (primary, split) = (tmp.path().join("primary"), tmp.path().join("split"));
    std::fs::create_dir_all(&primary).unwrap();
    std::fs::create_dir_all(&split).unwrap();
    shard(&primary.join(S1), &[("a", 10)], 8);
    shard(&split.join(S2), &[("b", 10)], 9);
    write_index(&primary, &[("a", S1), ("b", S2), ("c", S3), ("d", "zz.safetensors")]);
    let err = Model::open(ModelConfig::new(&primary).dirs([&split]))
        .unwrap_err()
        .to_string();
    let want = format!(
        "names 2 shard file(s) that are missing from {} and the split directory {}: \"{S3}\", \"zz.safetensors\" \
         (2 *.safetensors file(s) found there",
        primary.display(),
        split.display()
    );
    assert!(err.contains(&want), "{err}\nwanted: {want}");
}

#[test]
fn invalid_index_is_an_error_naming_the_index() {
    let tmp = common::tempdir();
    let dir = tmp.path();
    shard(&dir.join(S1), &[("a", 10)], 9);
    let index = dir.join("model.safetensors.index.json");
    std::fs::write(&index, b"{\"weight_map\": [1, 2]}").unwrap();
    let err = Model::open(ModelConfig::new(dir)).unwrap_err().to_string();
    assert!(err.contains(&index.display().to_string()), "{err}");
}

const S3: &str = "model-00003-of-00003.safetensors";

/// `dup` in three shards at different offsets; the index names `chosen`.
/// That shard's range and bytes must win.
fn name_in_three_shards(chosen: &str) {
    let tmp = common::tempdir();
    let dir = tmp.path();
    let one = shard(&dir.join(S1), &[("dup", 100)], 11);
    let two = shard(&dir.join(S2), &[("x", 3), ("dup", 100)], 12);
    let three = shard(&dir.join(S3), &[("y", 5), ("dup", 100)], 13);
    write_index(dir, &[("dup", chosen), ("x", S2), ("y", S3)]);
    let want = match chosen {
        c if c == S1 => &one[0],
        c if c == S2 => &two[1],
        _ => &three[1],
    };
    let model = Model::open(ModelConfig::new(dir)).unwrap_or_else(|e| panic!("index chose {chosen}: {e}"));
    let t = model.tensor("dup").unwrap();
    assert_eq!(model.catalog().shards()[t.shard].name, chosen);
    assert_eq!(t.offset, want.1);
    assert_eq!(read(&model, "dup"), want.2);
}

#[test]
fn index_decides_a_name_held_by_three_shards_first_or_second() {
    name_in_three_shards(S1);
    name_in_three_shards(S2);
}

/// The index names one of the files that hold the name: the third one.
#[test]
fn index_decides_a_name_held_by_three_shards_third() {
    name_in_three_shards(S3);
}

/// In a Hugging Face cache the shards are links to hash-named blobs; an
/// error about a duplicate must name the files as the user sees them in the
/// model directory (the listed names), not only the blob hashes.
#[test]
fn duplicate_in_symlinked_shards_names_the_listed_files() {
    let tmp = common::tempdir();
    let root = tmp.path();
    let blobs = root.join("blobs");
    let snap = root.join("snap");
    std::fs::create_dir_all(&blobs).unwrap();
    std::fs::create_dir_all(&snap).unwrap();
    shard(&blobs.join("aaaa1111"), &[("dup", 10)], 14);
    shard(&blobs.join("bbbb2222"), &[("dup", 10)], 15);
    std::os::unix::fs::symlink("../blobs/aaaa1111", snap.join(S1)).unwrap();
    std::os::unix::fs::symlink("../blobs/bbbb2222", snap.join(S2)).unwrap();
    let err = Model::open(ModelConfig::new(&snap)).unwrap_err().to_string();
    assert!(err.contains(S1) && err.contains(S2), "{err}");
}
