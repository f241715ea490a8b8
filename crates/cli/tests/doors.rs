//! The doors a newcomer tries first: `inspect --tensors` against the
//! reference reader, every command that takes a model given one
//! `.safetensors` file or the model's index json (as Python's `load` and
//! `safe_open` take them), and a filter that matches nothing answered
//! with names that exist.

mod common;

use std::collections::BTreeMap;
use std::ffi::OsStr;
use std::path::Path;

use serde_json::Value;

fn os(s: &str) -> &OsStr {
    OsStr::new(s)
}

/// `inspect PATH --tensors --json`'s tensors: name -> the row, the drive
/// checked present and dropped (the reference knows no drives).
fn listed(path: &Path) -> BTreeMap<String, Value> {
    let (v, _) = common::run_json(&[os("inspect"), path.as_os_str(), os("--tensors"), os("--json")]);
    let mut out = BTreeMap::new();
    for t in v["tensors"].as_array().expect("a tensor list") {
        let mut t = t.clone();
        let o = t.as_object_mut().unwrap();
        let drive = o.remove("drive").expect("a drive");
        assert!(drive.as_str().is_some_and(|d| !d.is_empty()), "{t:?}");
        let name = o.remove("name").unwrap().as_str().unwrap().to_string();
        assert!(out.insert(name, t).is_none(), "a name listed twice");
    }
    out
}

/// The reference reader's view of every tensor of `dir`'s files
/// (tests/reference/ref_tensors.py), or None (skipped) without it.
fn reference(dir: &Path) -> Option<BTreeMap<String, Value>> {
    let text = common::run_reference("ref_tensors.py", &[dir.as_os_str()])?;
    let v: BTreeMap<String, Value> = serde_json::from_str(&text).unwrap();
    Some(v)
}

#[test]
fn inspect_tensors_lists_what_the_reference_reader_reads() {
    let tmp = common::tempdir();
    let dir = tmp.path().join("ref");
    let Some(_) = common::reference_digests(&dir) else {
        return;
    };
    let Some(want) = reference(&dir) else { return };
    assert!(want.len() > 10, "{want:?}");
    // Every name, dtype, shape, byte count, file and payload offset.
    assert_eq!(listed(&dir), want);

    // The text form: a header, one row per tensor in name order, a total.
    let out = common::run(&[os("inspect"), dir.as_os_str(), os("--tensors")]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8(out.stdout).unwrap();
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines.len(), want.len() + 2, "{text}");
    let head: Vec<&str> = lines[0].split_whitespace().collect();
    assert_eq!(head, ["name", "dtype", "shape", "bytes", "file", "offset", "drive"]);
    for (line, (name, t)) in lines[1..].iter().zip(&want) {
        let cells: Vec<&str> = line.split("  ").map(str::trim).filter(|c| !c.is_empty()).collect();
        let shape: Vec<String> = t["shape"].as_array().unwrap().iter().map(|d| d.to_string()).collect();
        assert_eq!(cells[0], name);
        assert_eq!(cells[1], t["dtype"].as_str().unwrap());
        assert_eq!(cells[2], format!("[{}]", shape.join(", ")));
        assert_eq!(cells[3], t["bytes"].to_string());
        assert_eq!(cells[4], t["file"].as_str().unwrap());
        assert_eq!(cells[5], t["offset"].to_string());
    }
    let total: u64 = want.values().map(|t| t["bytes"].as_u64().unwrap()).sum();
    assert_eq!(
        *lines.last().unwrap(),
        format!("{} tensor(s), {total} bytes, in 4 file(s)", want.len())
    );
}

#[test]
fn every_command_takes_one_safetensors_file() {
    let tmp = common::tempdir();
    let dir = tmp.path().join("ref");
    let Some(sums) = common::reference_digests(&dir) else {
        return;
    };
    let Some(want) = reference(&dir) else { return };
    let sums = common::parse_sums(&sums);
    let file = "model-00002-of-00003.safetensors";
    let path = dir.join(file);
    let mine: BTreeMap<String, Value> = want.into_iter().filter(|(_, t)| t["file"] == file).collect();
    assert!(mine.len() > 2, "{mine:?}");

    // inspect --tensors: that file's tensors alone.
    assert_eq!(listed(&path), mine);
    // inspect: one shard.
    let (v, _) = common::run_json(&[os("inspect"), path.as_os_str(), os("--json")]);
    assert_eq!(v["shards"].as_array().unwrap().len(), 1, "{v}");
    assert_eq!(v["tensors"], mine.len());
    // digest: the reference reader's digests of that file's tensors.
    let out = common::run(&[os("digest"), path.as_os_str()]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let got = common::parse_sums(&String::from_utf8(out.stdout).unwrap());
    let want_sums: BTreeMap<String, String> = sums.into_iter().filter(|(n, _)| mine.contains_key(n)).collect();
    assert_eq!(got, want_sums);
    // verify: the one file checked, clean.
    let (v, _) = common::run_json(&[os("verify"), path.as_os_str(), os("--json")]);
    assert_eq!(v["files"].as_array().unwrap().len(), 1, "{v}");
    // load: every tensor of the file, its bytes.
    let (v, _) = common::run_json(&[os("load"), path.as_os_str(), os("--json")]);
    assert_eq!(v["tensors"], mine.len(), "{v}");
    let bytes: u64 = mine.values().map(|t| t["bytes"].as_u64().unwrap()).sum();
    assert_eq!(v["bytes"], bytes, "{v}");
    // bench: the file's experts, through the engine.
    let (v, _) = common::run_json(&[
        os("bench"),
        path.as_os_str(),
        os("--arms"),
        os("engine"),
        os("--runs"),
        os("1"),
        os("--filter"),
        os("experts"),
        os("--json"),
    ]);
    let experts = mine.keys().filter(|n| n.contains("experts")).count();
    assert!(experts > 0);
    assert_eq!(v["tensors"], experts, "{v}");
}

#[test]
fn every_command_takes_the_index_json_as_its_folder() {
    let tmp = common::tempdir();
    let dir = tmp.path().join("m");
    common::synth_model(&dir, &common::small_synth_spec());
    let index = dir.join(weightstream::__internal::INDEX_FILE);
    assert!(index.is_file());
    assert_eq!(listed(&index), listed(&dir));
    let digest = |p: &Path| {
        let out = common::run(&[os("digest"), p.as_os_str()]);
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        out.stdout
    };
    assert_eq!(digest(&index), digest(&dir));
    for args in [
        vec![os("inspect"), index.as_os_str(), os("--json")],
        vec![os("verify"), index.as_os_str(), os("--json")],
        vec![os("load"), index.as_os_str(), os("--json")],
        vec![
            os("bench"),
            index.as_os_str(),
            os("--arms"),
            os("engine"),
            os("--runs"),
            os("1"),
            os("--json"),
        ],
    ] {
        let (of_index, _) = common::run_json(&args);
        let mut args = args.clone();
        args[1] = dir.as_os_str();
        let (of_dir, _) = common::run_json(&args);
        // The same model either way (what each command counts).
        for k in ["tensors", "bytes", "files", "bytes_per_run"] {
            assert_eq!(of_index.get(k), of_dir.get(k), "{args:?}: {k}");
        }
    }
    // Another index name is refused, naming the file and the way out.
    let other = dir.join("other.safetensors.index.json");
    std::fs::copy(&index, &other).unwrap();
    let out = common::run(&[os("inspect"), other.as_os_str()]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains(&format!("{}", other.display()))
            && stderr.contains("an index is read only as its directory's model.safetensors.index.json"),
        "{stderr}"
    );
}

#[test]
fn a_filter_that_matches_nothing_names_what_does() {
    let tmp = common::tempdir();
    let dir = tmp.path().join("m");
    common::synth_model(&dir, &common::small_synth_spec());
    // A case slip: the names it meant.
    let out = common::run(&[os("load"), dir.as_os_str(), os("--name"), os("EMBED_tokens")]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("no tensor name contains it") && stderr.contains("; names like it: \"model.embed_tokens"),
        "{stderr}"
    );
    // Nothing like it: the parts the names have, as filters that match.
    let out = common::run(&[
        os("bench"),
        dir.as_os_str(),
        os("--arms"),
        os("engine"),
        os("--filter"),
        os(".self_attn."),
    ]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    let hint = stderr
        .split("; its tensors' names have ")
        .nth(1)
        .unwrap_or_else(|| panic!("no hint in {stderr}"));
    // Each part suggested matches as many tensors as it says.
    let names: Vec<String> = listed(&dir).into_keys().collect();
    let mut parts = 0;
    for item in hint.trim().split(", ") {
        let (part, count) = item.rsplit_once(" (").unwrap();
        let part = part.trim_matches('"');
        let count: usize = count.trim_end_matches(')').parse().unwrap();
        assert_eq!(names.iter().filter(|n| n.contains(part)).count(), count, "{item}");
        parts += 1;
    }
    assert!(parts >= 2, "{hint}");
}
