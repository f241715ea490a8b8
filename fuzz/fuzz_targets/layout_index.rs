//! Parses and checks a layout index (`weightstream-layout.json`, untrusted
//! input read back from disk) from arbitrary bytes (an input starting with
//! `{`), and from structured
//! inputs whose paths and names come from hostile pools (`..`, links'
//! targets, `/`, doubled slashes, NULs, reserved names, another folder
//! name). Every accepted index must keep the properties the re-run and
//! the readers rely on: its folder name is the one derived from its
//! source, every root's folder is `root/<folder>` with the root in real
//! form, every file and extra joined to its folder stays directly inside
//! that folder, and the index round-trips.

#![no_main]

use std::ffi::OsStr;
use std::os::unix::ffi::OsStrExt;
use std::path::{Component, Path};

use arbitrary::Arbitrary;
use libfuzzer_sys::fuzz_target;
use weightstream::__internal::place::{folder_name, LayoutIndex};

const PATHS: [&str; 10] = [
    "/", "/a", "/a/b", "/a/../b", "//a", "/a/", "/a/./b", "relative", "/etc", "/a\u{0}b",
];
const NAMES: [&str; 12] = [
    "x.safetensors",
    "../x.safetensors",
    "a/b.safetensors",
    ".",
    "..",
    "",
    "passwd",
    "weightstream-layout.json",
    "weightstream-marker.json",
    ".weightstream-tmp.1.x.safetensors",
    "config.json",
    "x\u{0}.safetensors",
];

#[derive(Debug, Arbitrary)]
struct Shaped {
    source: u8,
    /// Use the folder name derived from the source (else a pool name).
    derived_folder: bool,
    folder: u8,
    roots: Vec<(u8, bool)>,
    files: Vec<(u8, u8, bool)>,
    extras: Vec<(u8, bool)>,
}

fn pick<'a>(pool: &[&'a str], i: u8) -> &'a str {
    pool[i as usize % pool.len()]
}

impl Shaped {
    fn json(&self) -> Vec<u8> {
        let source = pick(&PATHS, self.source);
        let folder = if self.derived_folder {
            folder_name(Path::new(source)).to_string_lossy().into_owned()
        } else {
            pick(&NAMES, self.folder).to_string()
        };
        let roots: Vec<serde_json::Value> = self
            .roots
            .iter()
            .take(10)
            .map(|&(p, joined)| {
                let path = pick(&PATHS, p);
                let f = if joined {
                    Path::new(path).join(&folder).to_string_lossy().into_owned()
                } else {
                    format!("{path}/../{folder}")
                };
                serde_json::json!({"path": path, "folder": f})
            })
            .collect();
        let hex = |ok: bool| if ok { "a".repeat(64) } else { "xyz".into() };
        let files: Vec<serde_json::Value> = self
            .files
            .iter()
            .take(10)
            .map(|&(n, r, ok)| {
                serde_json::json!({"name": pick(&NAMES, n), "root": r % 4, "size": 1,
                                   "header_sha256": hex(ok), "kind": "shard"})
            })
            .collect();
        let extras: Vec<serde_json::Value> = self
            .extras
            .iter()
            .take(10)
            .map(|&(n, ok)| serde_json::json!({"name": pick(&NAMES, n), "size": 1, "sha256": hex(ok)}))
            .collect();
        serde_json::to_vec(&serde_json::json!({
            "format": "weightstream-layout/1", "layout": "mirror", "source": source,
            "source_fingerprint": "0", "folder": folder, "roots": roots, "files": files, "extras": extras,
        }))
        .unwrap()
    }
}

/// `p` is absolute with only plain components (what the re-run compares
/// and walks without links).
fn real_form(p: &Path) -> bool {
    p.is_absolute()
        && p.components()
            .all(|c| matches!(c, Component::RootDir | Component::Normal(_)))
        && !p.as_os_str().as_bytes().contains(&0)
}

fn directly_inside(folder: &Path, name: &OsStr) -> bool {
    let joined = folder.join(name);
    joined.parent() == Some(folder) && joined.file_name() == Some(name)
}

fuzz_target!(|data: &[u8]| {
    // JSON as it is (the committed seeds are indexes), else a shaped index.
    let bytes = if data.first() == Some(&b'{') {
        data.to_vec()
    } else {
        match Shaped::arbitrary_take_rest(arbitrary::Unstructured::new(data)) {
            Ok(s) => s.json(),
            Err(_) => return,
        }
    };
    let Ok(idx) = LayoutIndex::parse(Path::new("/fuzz/weightstream-layout.json"), &bytes) else {
        return;
    };
    assert!(real_form(idx.source.as_path()), "{idx:?}");
    assert_eq!(idx.folder.as_os_str(), folder_name(idx.source.as_path()), "{idx:?}");
    assert!(!idx.files.is_empty() && !idx.roots.is_empty());
    for (k, r) in idx.roots.iter().enumerate() {
        assert!(real_form(r.path.as_path()), "{idx:?}");
        assert_eq!(r.folder.as_path(), r.path.as_path().join(idx.folder.as_os_str()));
        assert!(directly_inside(r.path.as_path(), idx.folder.as_os_str()));
        assert!(idx.roots[..k].iter().all(|o| o.path != r.path), "a root twice: {idx:?}");
    }
    for f in &idx.files {
        assert!(f.root < idx.roots.len());
        assert!(directly_inside(idx.folder_of(f.root), f.name.as_os_str()), "{idx:?}");
        assert!(f.name.as_os_str().as_bytes().ends_with(b".safetensors"));
    }
    for e in &idx.extras {
        assert!(directly_inside(idx.folder_of(0), e.name.as_os_str()), "{idx:?}");
    }
    let again = serde_json::to_vec(&idx).unwrap();
    let back = LayoutIndex::parse(Path::new("/fuzz/again"), &again).expect("an accepted index round-trips");
    assert_eq!(back, idx);
});
