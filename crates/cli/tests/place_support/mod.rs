//! Helpers shared by the placement tests (`crates/cli/tests/place_*.rs`): a source
//! model and two roots on two volumes, the reference reader over placed
//! files, page-cache residency, tiny loop filesystems.

#![allow(dead_code)]

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

use crate::common;
use weightstream::place::{LayoutKind, PlaceConfig};
use weightstream_synth::SynthSpec;

/// A source model (under `CARGO_TARGET_TMPDIR`) and roots: one on
/// `/dev/shm` (a tmpfs, another volume), one or more beside the source
/// (the build's volume: placed with `allow_source_volume`, so the tests
/// need no root and no second disk).
pub struct Bed {
    pub tmp: tempfile::TempDir,
    pub shm: tempfile::TempDir,
    pub source: PathBuf,
}

impl Bed {
    /// `None` (SKIP printed) without a second volume.
    pub fn new() -> Option<Self> {
        let shm = common::second_drive_tempdir()?;
        let tmp = common::tempdir();
        let source = tmp.path().join("model");
        Some(Bed { tmp, shm, source })
    }

    /// A root on /dev/shm.
    pub fn shm_root(&self, name: &str) -> PathBuf {
        let p = self.shm.path().join(name);
        std::fs::create_dir_all(&p).unwrap();
        p
    }

    /// A root on the source's volume.
    pub fn disk_root(&self, name: &str) -> PathBuf {
        let p = self.tmp.path().join(name);
        std::fs::create_dir_all(&p).unwrap();
        p
    }

    /// The default pair: root 0 on /dev/shm, root 1 on the disk.
    pub fn roots(&self) -> Vec<PathBuf> {
        vec![self.shm_root("r0"), self.disk_root("r1")]
    }

    pub fn config(&self, roots: &[PathBuf], layout: LayoutKind) -> PlaceConfig {
        PlaceConfig::new(&self.source, roots.to_vec(), layout)
            .allow_source_volume(true)
            .buffer_bytes(1 << 20)
    }
}

/// A small model with decoder layers: 4 layers x 3 experts, 3 shards (a
/// layer split over two shards), irregular sizes.
pub fn layered_spec(seed: u64) -> SynthSpec {
    SynthSpec {
        layers: 4,
        experts: 3,
        expert_bytes: 300_000,
        shards: 3,
        seed,
        ..SynthSpec::default()
    }
}

/// The reference reader (`tests/reference/ref_read.py`) over `dirs`: one
/// `(name, sha256)` per tensor per file. `None` (SKIP printed) without the
/// reference, unless `WEIGHTSTREAM_REQUIRE_REFERENCE=1`.
pub fn ref_read(dirs: &[&Path]) -> Option<Vec<(String, String)>> {
    let args: Vec<&std::ffi::OsStr> = dirs.iter().map(|d| d.as_os_str()).collect();
    Some(
        common::run_reference("ref_read.py", &args)?
            .lines()
            .map(|l| {
                let (h, n) = l.split_once("  ").unwrap();
                (n.to_string(), h.to_string())
            })
            .collect(),
    )
}

/// name -> sha256, checking that every copy of a tensor agrees.
pub fn by_name(lines: &[(String, String)]) -> BTreeMap<String, String> {
    let mut m = BTreeMap::new();
    for (n, h) in lines {
        if let Some(prev) = m.insert(n.clone(), h.clone()) {
            assert_eq!(&prev, h, "two copies of {n} differ");
        }
    }
    m
}

/// `weightstream digest DIR --backend B --json`, no layout flags and no
/// environment: a placed model opens from its index alone.
pub fn digest(dir: &Path, backend: &str) -> BTreeMap<String, String> {
    let (v, _) = common::run_json(&[
        "digest".as_ref(),
        dir.as_os_str(),
        "--backend".as_ref(),
        backend.as_ref(),
        "--json".as_ref(),
    ]);
    common::json_sums(&v)
}

/// sha256 of every tensor of the source, read by the sync path.
pub fn source_sums(dir: &Path) -> BTreeMap<String, String> {
    digest(dir, "sync")
}

/// Pages of `path` in the page cache, as `fincore` (util-linux, mincore)
/// counts them; `None` without `fincore`. (Probing with `RWF_NOWAIT` reads
/// is no test: a probe that misses starts read-ahead, and the next probes
/// hit the pages it brought in.)
pub fn resident_pages(path: &Path) -> Option<u64> {
    let out = Command::new("fincore")
        .args(["--raw", "--noheadings", "--output", "PAGES"])
        .arg(path)
        .output()
        .ok()?;
    if !out.status.success() {
        return None;
    }
    String::from_utf8_lossy(&out.stdout).trim().parse().ok()
}

/// Files of `dir` (names), sorted.
pub fn names(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .map(|rd| {
            rd.map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default();
    v.sort();
    v
}

/// The prefix of a placement's temporary files (`docs/layouts.md`).
pub const TEMP_PREFIX: &str = ".weightstream-tmp.";

/// Temporary files weightstream left in `dir`.
pub fn temps(dir: &Path) -> Vec<String> {
    names(dir).into_iter().filter(|n| n.starts_with(TEMP_PREFIX)).collect()
}

/// sha256 of a whole file.
pub fn file_sha(path: &Path) -> String {
    common::sha256_hex(&std::fs::read(path).unwrap())
}

/// A small ext4 filesystem on a loop device (root only), unmounted and
/// detached on drop.
pub struct TinyFs {
    pub mount: PathBuf,
    dev: String,
    _img: tempfile::TempDir,
}

impl TinyFs {
    /// `mib` MiB; `None` (SKIP printed) without root, losetup or mkfs.ext4.
    pub fn new(mib: u64) -> Option<Self> {
        if !rustix::process::geteuid().is_root() {
            eprintln!("SKIP: a loop filesystem needs root");
            return None;
        }
        let img_dir = common::tempdir();
        let img = img_dir.path().join("fs.img");
        std::fs::File::create(&img).unwrap().set_len(mib << 20).unwrap();
        let out = Command::new("losetup").args(["-f", "--show"]).arg(&img).output();
        let dev = match out {
            Ok(o) if o.status.success() => String::from_utf8_lossy(&o.stdout).trim().to_string(),
            other => {
                eprintln!("SKIP: losetup failed: {other:?}");
                return None;
            }
        };
        let mkfs = Command::new("mkfs.ext4").args(["-q", "-F", &dev]).output();
        let mount = img_dir.path().join("mnt");
        std::fs::create_dir_all(&mount).unwrap();
        let mounted = mkfs.map(|o| o.status.success()).unwrap_or(false)
            && Command::new("mount")
                .arg(&dev)
                .arg(&mount)
                .status()
                .map(|s| s.success())
                .unwrap_or(false);
        if !mounted {
            let _ = Command::new("losetup").args(["-d", &dev]).status();
            eprintln!("SKIP: mkfs.ext4 or mount of {dev} failed");
            return None;
        }
        Some(TinyFs {
            mount,
            dev,
            _img: img_dir,
        })
    }

    /// Bytes available (statvfs `f_bavail`).
    pub fn available(&self) -> u64 {
        let v = rustix::fs::statvfs(&self.mount).unwrap();
        v.f_bavail * v.f_frsize
    }
}

impl Drop for TinyFs {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(&self.mount).status();
        let _ = Command::new("losetup").args(["-d", &self.dev]).status();
    }
}
