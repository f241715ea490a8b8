//! Helpers shared by the integration tests of the library and of the
//! command (which includes this file): a tiny hand-written safetensors
//! writer (so headers can have any length, including odd ones the reference
//! writer never produces, and any defect a test needs), deterministic
//! content, reference digests, simulated drives.

#![allow(dead_code)]

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

/// The repository's root: the nearest folder at or above the including
/// crate's manifest that holds the workspace's `Cargo.lock` (the library
/// is the root package; the command's tests, which include this file, are
/// in `crates/cli`).
pub fn repo_root() -> PathBuf {
    let here = Path::new(env!("CARGO_MANIFEST_DIR"));
    here.ancestors()
        .find(|d| d.join("Cargo.lock").is_file())
        .unwrap_or(here)
        .to_path_buf()
}

/// The library's `tests/` folder: reference scripts and fixtures.
pub fn lib_tests_dir() -> PathBuf {
    repo_root().join("tests")
}

/// A fresh directory under Cargo's per-target temp dir (same filesystem as
/// the build, so O_DIRECT behaves as on the project's disk, not on a tmpfs
/// `/tmp`).
pub fn tempdir() -> tempfile::TempDir {
    tempfile::Builder::new()
        .prefix("ws-test-")
        .tempdir_in(env!("CARGO_TARGET_TMPDIR"))
        .expect("create a temp dir under CARGO_TARGET_TMPDIR")
}

/// Voluntary context switches of the calling thread so far
/// (`getrusage(RUSAGE_THREAD)`'s `ru_nvcsw`): the count goes up each time
/// the thread sleeps (waits on a lock, a condition variable, a pipe, an I/O
/// thread, a timer) and never for being preempted, so "unchanged across a
/// call" says the call never waited, however loaded the machine is.
pub fn thread_voluntary_switches() -> u64 {
    // SAFETY: `getrusage` writes one `rusage` into the zeroed value it is
    // given and reads nothing else.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: `ru` is a valid, writable `rusage` for the whole call.
    let r = unsafe { libc::getrusage(libc::RUSAGE_THREAD, &mut ru) };
    assert_eq!(r, 0, "getrusage(RUSAGE_THREAD): {}", std::io::Error::last_os_error());
    ru.ru_nvcsw as u64
}

/// Runs `f` and returns its result with the voluntary context switches the
/// calling thread made inside it ([`thread_voluntary_switches`]).
pub fn voluntary_switches_in<T>(f: impl FnOnce() -> T) -> (T, u64) {
    let before = thread_voluntary_switches();
    let out = f();
    (out, thread_voluntary_switches() - before)
}

/// Deterministic bytes that differ at every position and between seeds, so
/// a payload read from the wrong offset (even off by one) never matches.
pub fn content(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ 0xd1b5_4a32_d192_ed03;
    let mut out = Vec::with_capacity(len + 8);
    while out.len() < len {
        // xorshift64*
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        out.extend_from_slice(&x.wrapping_mul(0x2545_f491_4f6c_dd1d).to_le_bytes());
    }
    out.truncate(len);
    out
}

/// One tensor entry of a hand-written header.
#[derive(Debug, Clone)]
pub struct Entry {
    pub name: String,
    pub dtype: String,
    pub shape: Vec<usize>,
    /// `data_offsets`, relative to the data section.
    pub begin: u64,
    pub end: u64,
}

impl Entry {
    pub fn u8(name: &str, begin: u64, end: u64) -> Self {
        Entry {
            name: name.into(),
            dtype: "U8".into(),
            shape: vec![(end - begin) as usize],
            begin,
            end,
        }
    }
}

/// The JSON header for `entries` (no padding).
pub fn header_json(entries: &[Entry]) -> String {
    let items: Vec<String> = entries
        .iter()
        .map(|e| {
            let shape: Vec<String> = e.shape.iter().map(|d| d.to_string()).collect();
            format!(
                "\"{}\":{{\"dtype\":\"{}\",\"shape\":[{}],\"data_offsets\":[{},{}]}}",
                e.name,
                e.dtype,
                shape.join(","),
                e.begin,
                e.end
            )
        })
        .collect();
    format!("{{{}}}", items.join(","))
}

/// `json` padded with trailing spaces to exactly `len` bytes.
pub fn pad_json(json: &str, len: usize) -> Vec<u8> {
    assert!(
        json.len() <= len,
        "header JSON of {} bytes does not fit in {len}",
        json.len()
    );
    let mut h = json.as_bytes().to_vec();
    h.resize(len, b' ');
    h
}

/// Bytes of a container: 8-byte little-endian header length, header, data.
pub fn container_bytes(header: &[u8], data: &[u8]) -> Vec<u8> {
    let mut out = (header.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(header);
    out.extend_from_slice(data);
    out
}

pub fn write_container(path: &Path, header: &[u8], data: &[u8]) {
    std::fs::write(path, container_bytes(header, data)).expect("write container");
}

/// A shard built from wanted absolute file ranges: U8 tensors placed at the
/// given file offsets, with filler tensors closing the gaps (offsets must be
/// contiguous; named after `data_start`, so give each shard of one model its
/// own), and the JSON header padded so the data section starts at exactly
/// `data_start` (odd values give an odd header length).
pub struct Layout {
    data_start: u64,
    cursor: u64,
    entries: Vec<Entry>,
    fillers: usize,
    /// (name, absolute file offset, length) of the wanted tensors.
    pub placed: Vec<(String, u64, u64)>,
}

impl Layout {
    pub fn new(data_start: u64) -> Self {
        assert!(data_start > 8);
        Layout {
            data_start,
            cursor: data_start,
            entries: Vec::new(),
            fillers: 0,
            placed: Vec::new(),
        }
    }

    /// Places tensor `name` at absolute file offset `at`, `len` bytes.
    pub fn place(&mut self, name: &str, at: u64, len: u64) -> &mut Self {
        assert!(
            at >= self.cursor,
            "{name} at {at} overlaps what is placed before (cursor {})",
            self.cursor
        );
        if at > self.cursor {
            let fname = format!("zz_filler_{}_{:02}", self.data_start, self.fillers);
            self.fillers += 1;
            let c = self.cursor;
            self.push(&fname, c, at - c);
        }
        self.push(name, at, len);
        self.placed.push((name.to_string(), at, len));
        self
    }

    fn push(&mut self, name: &str, at: u64, len: u64) {
        let b = at - self.data_start;
        self.entries.push(Entry::u8(name, b, b + len));
        self.cursor = at + len;
    }

    /// Pads with a filler so the file ends at absolute `size`.
    pub fn end_at(&mut self, size: u64) -> &mut Self {
        assert!(size >= self.cursor);
        if size > self.cursor {
            let fname = format!("zz_filler_{}_{:02}", self.data_start, self.fillers);
            self.fillers += 1;
            let c = self.cursor;
            self.push(&fname, c, size - c);
        }
        self
    }

    /// Writes the shard with content from `seed`; returns the whole file.
    pub fn write(&self, path: &Path, seed: u64) -> Vec<u8> {
        let header = pad_json(&header_json(&self.entries), (self.data_start - 8) as usize);
        let data = content(seed, (self.cursor - self.data_start) as usize);
        let bytes = container_bytes(&header, &data);
        assert_eq!(bytes.len() as u64, self.cursor);
        std::fs::write(path, &bytes).expect("write shard");
        bytes
    }
}

pub fn sha256_hex(bytes: &[u8]) -> String {
    use sha2::Digest;
    sha2::Sha256::digest(bytes).iter().map(|b| format!("{b:02x}")).collect()
}

/// Whether the filesystem holding `dir` accepts `open(O_DIRECT)` and an
/// aligned O_DIRECT read (checked with plain std calls into a page-aligned
/// buffer, independently of the crate's read path).
pub fn fs_reads_o_direct(dir: &Path) -> bool {
    use std::os::unix::fs::{FileExt, OpenOptionsExt};
    let probe = dir.join(".odirect-probe");
    if std::fs::write(&probe, vec![7u8; 8192]).is_err() {
        return false;
    }
    let arena = weightstream::Arena::new(weightstream::SlotSpec::new(4096), 1).expect("arena");
    let mut slot = arena.take().expect("one slot");
    let ok = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(rustix::fs::OFlags::DIRECT.bits() as i32)
        .open(&probe)
        .and_then(|f| f.read_at(&mut slot.as_bytes_mut()[..4096], 4096))
        .map(|n| n == 4096 && slot.as_bytes()[..4096].iter().all(|&b| b == 7))
        .unwrap_or(false);
    let _ = std::fs::remove_file(&probe);
    ok
}

/// Set to 1 (as CI does) to make a missing Python reference a failure.
pub const REQUIRE_REFERENCE: &str = "WEIGHTSTREAM_REQUIRE_REFERENCE";

pub fn reference_required() -> bool {
    std::env::var(REQUIRE_REFERENCE).map(|v| v == "1").unwrap_or(false)
}

/// Runs the Python reference script `tests/reference/<script>` with
/// `args` and returns its stdout. `None`, with a SKIP notice, when python3
/// or its `safetensors`/`numpy` modules are missing (the scripts exit 3),
/// unless `WEIGHTSTREAM_REQUIRE_REFERENCE=1`, where that is a failure; any
/// other failure of the script panics with its stderr.
pub fn run_reference(script: &str, args: &[&std::ffi::OsStr]) -> Option<String> {
    let script = lib_tests_dir().join("reference").join(script);
    let unavailable = |why: String| {
        if reference_required() {
            panic!("{REQUIRE_REFERENCE}=1 but the reference is unavailable: {why}");
        }
        eprintln!(
            "SKIP reference comparison: {why} (install python3 with `safetensors` and `numpy`; \
             set {REQUIRE_REFERENCE}=1 to make this a failure)"
        );
        None
    };
    let out = match Command::new("python3").arg(&script).args(args).output() {
        Ok(o) => o,
        Err(e) => return unavailable(format!("cannot run python3: {e}")),
    };
    let stderr = String::from_utf8_lossy(&out.stderr);
    match out.status.code() {
        Some(0) => {}
        Some(3) => return unavailable(stderr.trim().to_string()),
        _ => panic!("{} failed ({}):\n{stderr}", script.display(), out.status),
    }
    Some(String::from_utf8(out.stdout).expect("utf-8 output"))
}

/// Runs `tests/reference/ref_digest.py` into `dir` (the reference writer
/// makes the shards; the reference reader prints `<sha256>  <name>` lines,
/// sorted by name). `None` as [`run_reference`].
pub fn reference_digests(dir: &Path) -> Option<String> {
    run_reference("ref_digest.py", &[dir.as_os_str()])
}

/// `<hex>  <name>` lines -> name -> hex, checking the format on the way.
pub fn parse_sums(text: &str) -> BTreeMap<String, String> {
    let mut m = BTreeMap::new();
    for line in text.lines() {
        let (hex, name) = line.split_once("  ").unwrap_or_else(|| panic!("bad line {line:?}"));
        assert_eq!(hex.len(), 64, "{line:?}");
        assert!(hex.bytes().all(|b| b.is_ascii_hexdigit()), "{line:?}");
        assert!(
            m.insert(name.to_string(), hex.to_string()).is_none(),
            "duplicate {name}"
        );
    }
    m
}

/// The `tensors` map of `digest --json` output: name -> hex.
pub fn json_sums(v: &serde_json::Value) -> BTreeMap<String, String> {
    v["tensors"]
        .as_object()
        .expect("--json output has a tensors object")
        .iter()
        .map(|(k, h)| (k.clone(), h.as_str().expect("hex string").to_string()))
        .collect()
}

/// Writes a synthetic model (`weightstream_synth`) into `dir`.
pub fn synth_model(dir: &Path, spec: &weightstream_synth::SynthSpec) {
    weightstream_synth::write_model(dir, spec).expect("write a synthetic model");
}

/// `st_dev` of `path`.
pub fn st_dev(path: &Path) -> u64 {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata(path)
        .unwrap_or_else(|e| panic!("stat {}: {e}", path.display()))
        .dev()
}

/// Where tests put a second "drive": a tmpfs with its own `st_dev`.
pub const SECOND_DRIVE: &str = "/dev/shm";

/// A fresh directory on [`SECOND_DRIVE`], another volume than
/// `CARGO_TARGET_TMPDIR` (so it counts as a second drive, no root needed).
/// `None`, with a SKIP notice, when there is no such volume here.
pub fn second_drive_tempdir() -> Option<tempfile::TempDir> {
    let root = Path::new(SECOND_DRIVE);
    if !root.is_dir() {
        eprintln!("SKIP: {SECOND_DRIVE} is missing: no second volume for multi-drive tests");
        return None;
    }
    if st_dev(root) == st_dev(Path::new(env!("CARGO_TARGET_TMPDIR"))) {
        eprintln!("SKIP: {SECOND_DRIVE} is on the same volume as the build: no second drive");
        return None;
    }
    match tempfile::Builder::new().prefix("ws-test-").tempdir_in(root) {
        Ok(t) => Some(t),
        Err(e) => {
            eprintln!("SKIP: cannot create a directory under {SECOND_DRIVE}: {e}");
            None
        }
    }
}

/// Whether io_uring is open to this process (`kernel.io_uring_disabled` is
/// 0, or 1 and we are root).
pub fn uring_available() -> bool {
    match std::fs::read_to_string("/proc/sys/kernel/io_uring_disabled") {
        Ok(v) => match v.trim() {
            "0" => true,
            "1" => rustix::process::geteuid().is_root(),
            _ => false,
        },
        Err(_) => true,
    }
}

/// The engine backends to test: io_uring where it is open, and pread.
pub fn engine_backends() -> Vec<&'static str> {
    if uring_available() {
        vec!["uring", "pread"]
    } else {
        eprintln!("note: io_uring is closed to this process; only the pread backend is tested");
        vec!["pread"]
    }
}

/// The engine backends to run a test on: io_uring (where this process may
/// use it) and the pread pool.
pub fn engine_backend_choices() -> Vec<weightstream::BackendChoice> {
    if uring_available() {
        vec![weightstream::BackendChoice::Uring, weightstream::BackendChoice::Pread]
    } else {
        vec![weightstream::BackendChoice::Pread]
    }
}

/// The small synthetic model the multi-drive tests fall back to when the
/// Python reference is unavailable: 4 layers x 3 experts, 4 shards.
pub fn small_synth_spec() -> weightstream_synth::SynthSpec {
    weightstream_synth::SynthSpec {
        layers: 4,
        experts: 3,
        expert_bytes: 40_000,
        shards: 4,
        ..weightstream_synth::SynthSpec::default()
    }
}

/// Fills `dir` with the reference model and returns its digests; without
/// the reference (and without `WEIGHTSTREAM_REQUIRE_REFERENCE=1`) writes
/// [`small_synth_spec`] instead and returns `None`: the caller still
/// compares every layout against the sync path.
pub fn reference_or_synth(dir: &Path) -> Option<BTreeMap<String, String>> {
    match reference_digests(dir) {
        Some(text) => Some(parse_sums(&text)),
        None => {
            synth_model(dir, &small_synth_spec());
            None
        }
    }
}

/// Basenames of the `*.safetensors` files in `dir`, sorted.
pub fn shard_names(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("list {}: {e}", dir.display()))
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".safetensors"))
        .collect();
    v.sort();
    v
}

/// Copies the named files from `from` into `to` (created if missing).
pub fn copy_files(from: &Path, to: &Path, names: &[&str]) {
    std::fs::create_dir_all(to).unwrap();
    for n in names {
        std::fs::copy(from.join(n), to.join(n)).unwrap_or_else(|e| panic!("copy {n} to {}: {e}", to.display()));
    }
}

/// Moves the named files from `from` into `to` (created if missing); works
/// across volumes.
pub fn move_files(from: &Path, to: &Path, names: &[&str]) {
    copy_files(from, to, names);
    for n in names {
        std::fs::remove_file(from.join(n)).unwrap();
    }
}

/// Drives made by `simdrives` (each its own loop or zram device, ext4, with
/// a read-bandwidth cap), for tests that need a slow drive (a read that
/// stays in the kernel for seconds) or two independent drives. Root only:
/// `up` returns `None` with a SKIP notice elsewhere. Torn down on drop.
///
/// Nothing is named for the machine: the base is `/tmp/ws-simdrives-PID-N`,
/// the loop and zram devices are the next free ones, and the bandwidth caps
/// live in this process's own cgroup (`ws-simdrives-PID`, through
/// `SIMDRIVES_CGROUP`), which the process joins while it has drives up and
/// leaves (back to where it was) before the last `down` removes it; so two
/// runs on one machine never share or remove each other's. (A simdrives
/// script without `SIMDRIVES_CGROUP` uses its fixed `simdrives` cgroup, as
/// before.)
pub struct SimDrives {
    base: PathBuf,
    script: PathBuf,
    pub mounts: Vec<PathBuf>,
}

/// This process's drives up (across threads), and the cgroup it was in
/// before it joined the drives' one; held across `up` and `down` so that
/// one test's `down` never removes the cgroup another's `up` is filling.
static SIM_USERS: std::sync::Mutex<(usize, Option<PathBuf>)> = std::sync::Mutex::new((0, None));

/// The cgroup name this process's drives use.
fn sim_cgroup() -> String {
    format!("ws-simdrives-{}", std::process::id())
}

/// `cgroup.procs` of the cgroup this process is in now (the blkio one on
/// cgroup v1, the unified one on v2).
fn own_cgroup_procs() -> Option<PathBuf> {
    let table = std::fs::read_to_string("/proc/self/cgroup").ok()?;
    let v1 = table.lines().find_map(|l| {
        let mut f = l.splitn(3, ':');
        let (_, ctl, path) = (f.next()?, f.next()?, f.next()?);
        ctl.split(',')
            .any(|c| c == "blkio")
            .then(|| format!("/sys/fs/cgroup/blkio{path}"))
    });
    let v2 = table
        .lines()
        .find_map(|l| l.strip_prefix("0::").map(|p| format!("/sys/fs/cgroup{p}")));
    let dir = PathBuf::from(v1.or(v2)?);
    Some(dir.join("cgroup.procs")).filter(|p| p.exists())
}

impl SimDrives {
    /// `n` drives of `kind` (loop, zram, memloop) capped at `mbps` (MB/s,
    /// comma-separated per drive; 0 = no cap), 1 GiB each.
    pub fn up(n: usize, kind: &str, mbps: &str) -> Option<Self> {
        if !rustix::process::geteuid().is_root() {
            eprintln!("SKIP: simdrives needs root");
            return None;
        }
        let scripts: Vec<PathBuf> = [
            std::env::var_os("WEIGHTSTREAM_SIMDRIVES").map(PathBuf::from),
            Some(repo_root().join("../shared/tools/simdrives")),
            Some(repo_root().join("ci/simdrives")),
        ]
        .into_iter()
        .flatten()
        .filter(|p| p.is_file())
        .collect();
        // The first that names its cgroup by SIMDRIVES_CGROUP (nothing
        // fixed for the machine), else the first.
        let per_run = |p: &PathBuf| std::fs::read_to_string(p).is_ok_and(|t| t.contains("SIMDRIVES_CGROUP"));
        let script = scripts.iter().find(|p| per_run(p)).or(scripts.first())?.clone();
        let mut users = SIM_USERS.lock().unwrap_or_else(|e| e.into_inner());
        static NEXT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let base = PathBuf::from(format!(
            "/tmp/ws-simdrives-{}-{}",
            std::process::id(),
            NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
        ));
        let out = Command::new(&script)
            .args([
                "up",
                &n.to_string(),
                "--kind",
                kind,
                "--mbps",
                mbps,
                "--size",
                "1",
                "--base",
            ])
            .arg(&base)
            .env("SIMDRIVES_BASE", &base)
            .env("SIMDRIVES_CGROUP", sim_cgroup())
            .output()
            .expect("run simdrives");
        let me = SimDrives {
            base,
            script,
            mounts: String::from_utf8_lossy(&out.stdout)
                .lines()
                .map(PathBuf::from)
                .collect(),
        };
        // Counted from here: dropping `me` (on failure too) undoes it.
        users.0 += 1;
        if !out.status.success() || me.mounts.len() != n {
            drop(users);
            eprintln!(
                "SKIP: simdrives up {n} --kind {kind} failed: {}",
                String::from_utf8_lossy(&out.stderr).trim()
            );
            return None;
        }
        // The caps apply to processes in the drives' cgroup: join it (this
        // process's own, or the script's fixed one).
        let name = sim_cgroup();
        let dirs = [
            format!("/sys/fs/cgroup/blkio/{name}"),
            format!("/sys/fs/cgroup/{name}"),
            "/sys/fs/cgroup/blkio/simdrives".to_string(),
            "/sys/fs/cgroup/simdrives".to_string(),
        ];
        if let Some(procs) = dirs
            .iter()
            .map(|d| Path::new(d).join("cgroup.procs"))
            .find(|p| p.exists())
        {
            if users.0 == 1 && users.1.is_none() {
                users.1 = own_cgroup_procs().filter(|p| *p != procs);
            }
            std::fs::write(&procs, std::process::id().to_string()).expect("join the simdrives cgroup");
        }
        drop(users);
        Some(me)
    }

    /// Changes drive `k`'s cap (0 = none).
    pub fn throttle(&self, k: usize, mbps: u64) {
        let ok = Command::new(&self.script)
            .args(["throttle", &k.to_string(), &mbps.to_string()])
            .env("SIMDRIVES_BASE", &self.base)
            .env("SIMDRIVES_CGROUP", sim_cgroup())
            .status()
            .expect("run simdrives throttle")
            .success();
        assert!(ok, "simdrives throttle {k} {mbps} failed");
    }
}

impl Drop for SimDrives {
    fn drop(&mut self) {
        let mut users = SIM_USERS.lock().unwrap_or_else(|e| e.into_inner());
        users.0 = users.0.saturating_sub(1);
        if users.0 == 0 {
            // The last drives of this process: back to the cgroup it came
            // from, so that `down` can remove the drives' one.
            if let Some(home) = users.1.take() {
                let _ = std::fs::write(home, std::process::id().to_string());
            }
        }
        // A ring's teardown runs in the kernel after its descriptor is
        // closed and holds the drive's files until it ends, so `down`'s
        // umount could find the file system busy, unmount it lazily and
        // fail to reset a zram device, which then outlived the test with
        // its memory (two per run of tests/fast_drive.rs). Unmount here
        // first, again while the kernel says busy, for up to about 2 s.
        // A drive still busy after that is held by this process on
        // purpose (a test whose dead ring thread leaks what the kernel
        // may still write into): `down` then runs once the process has
        // exited, from a shell left behind to wait for it. Cleanup, not a
        // check: nothing here is asserted.
        let mut busy = false;
        for m in &self.mounts {
            let mut tries = 0;
            loop {
                match Command::new("umount").arg(m).output() {
                    Ok(o) if !o.status.success() && String::from_utf8_lossy(&o.stderr).contains("busy") => {
                        tries += 1;
                        if tries == 200 {
                            busy = true;
                            break;
                        }
                        std::thread::sleep(std::time::Duration::from_millis(10));
                    }
                    _ => break,
                }
            }
        }
        let mut down = if busy {
            let mut c = Command::new("sh");
            c.arg("-c")
                .arg(
                    r#"while kill -0 "$1" 2>/dev/null; do sleep 0.1; done
shift
for m in "$@"; do
    for i in $(seq 100); do
        grep -q " $m " /proc/mounts || break
        umount "$m" 2>/dev/null && break
        sleep 0.1
    done
done
exec "$SIMDRIVES_SCRIPT" down"#,
                )
                .arg("sh")
                .arg(std::process::id().to_string())
                .args(&self.mounts)
                .env("SIMDRIVES_SCRIPT", &self.script)
                .stdin(std::process::Stdio::null())
                .stdout(std::process::Stdio::null())
                .stderr(std::process::Stdio::null());
            c
        } else {
            let mut c = Command::new(&self.script);
            c.arg("down");
            c
        };
        down.env("SIMDRIVES_BASE", &self.base)
            .env("SIMDRIVES_CGROUP", sim_cgroup());
        if busy {
            let _ = down.spawn();
        } else {
            let _ = down.status();
        }
    }
}
