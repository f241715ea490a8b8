//! Bytes are identical whatever the layout (DESIGN contracts 4 and 5,
//! "Routing"): the same model read through `weightstream digest` gives the
//! sha256 sums the Python reference reader prints, and the `--backend sync`
//! sums of the primary-only model, when its shards are
//!
//! - all in the primary directory;
//! - split: some moved to a directory on a second drive (`--dirs`);
//! - fully mirrored on a second drive (`--mirror`);
//! - partially mirrored (only some shards copied);
//! - split and partially mirrored: the shards of the split directory (on the
//!   second drive) mirrored on the first drive, one primary shard mirrored on
//!   the second;
//!
//! for every route (hash, stripe, adaptive), both engine backends (io_uring
//! and pread) and `--direct auto` and `off`, with 4096-byte chunks so one
//! read really splits over copies. The `--json` stats must agree with the
//! layout: every chunk counted once, no failovers, a drive serves only
//! tensors it holds a copy of; `hash` sends each read wholly to the copy the
//! field's multiplicative hash picks (per-drive bytes and chunks exactly as
//! predicted); `stripe` gives each copy its share of every read's chunks;
//! `stripe` and `adaptive` make both drives of a mirrored model serve bytes.
//! Once more through `WEIGHTSTREAM_MODEL_DIRS` / `WEIGHTSTREAM_MIRROR` /
//! `WEIGHTSTREAM_ROUTE` / `WEIGHTSTREAM_DISK_WEIGHTS` instead of flags.
//!
//! The second drive is a directory on `/dev/shm` (a tmpfs: another
//! `st_dev`); without one the tests print SKIP and pass. Without python3 +
//! `safetensors` + `numpy` the reference comparison is skipped (a failure
//! under `WEIGHTSTREAM_REQUIRE_REFERENCE=1`) and a synthetic model is
//! compared against the sync path instead.

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::ffi::{OsStr, OsString};
use std::path::{Path, PathBuf};

use serde_json::Value;
use weightstream::__internal as route;
use weightstream::__internal::split_list;
use weightstream::__internal::Window;
use weightstream::{Model, ModelConfig, RoutePolicy, Weights};

const CHUNK: usize = 4096;

#[derive(Debug, Clone, Copy, PartialEq)]
enum Kind {
    Primary,
    Split,
    FullMirror,
    PartialMirror,
    SplitPartialMirror,
}

/// One model laid out one way.
struct Setup {
    _tmp: tempfile::TempDir,
    _shm: tempfile::TempDir,
    primary: PathBuf,
    dirs: Vec<PathBuf>,
    mirrors: Vec<PathBuf>,
    /// The reference reader's sums, when python is available.
    want: Option<BTreeMap<String, String>>,
    /// `digest --backend sync` of the model with every shard in the primary.
    sync: BTreeMap<String, String>,
    /// Per shard basename: how many copies the layout gives it.
    copies: BTreeMap<String, usize>,
}

fn os(s: &str) -> &OsStr {
    OsStr::new(s)
}

fn join(paths: &[PathBuf]) -> String {
    paths.iter().map(|p| p.to_str().unwrap()).collect::<Vec<_>>().join(",")
}

fn sizes(dir: &Path) -> Vec<(String, u64)> {
    common::shard_names(dir)
        .into_iter()
        .map(|n| {
            let len = std::fs::metadata(dir.join(&n)).unwrap().len();
            (n, len)
        })
        .collect()
}

fn setup(kind: Kind) -> Option<Setup> {
    let shm = common::second_drive_tempdir()?;
    let tmp = common::tempdir();
    let primary = tmp.path().join("primary");
    let want = common::reference_or_synth(&primary);

    // The baseline: the one-read-at-a-time path on the unsplit model.
    let out = common::run(&[os("digest"), primary.as_os_str(), os("--backend"), os("sync")]);
    assert!(
        out.status.success(),
        "sync digest: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let sync = common::parse_sums(&String::from_utf8(out.stdout).unwrap());
    if let Some(w) = &want {
        assert_eq!(&sync, w, "the sync path differs from the reference reader");
    }

    let shards = sizes(&primary);
    assert!(shards.len() >= 3, "fixture has too few shards: {shards:?}");
    let largest = shards.iter().max_by_key(|s| s.1).unwrap().0.clone();
    let others: Vec<String> = shards.iter().map(|s| s.0.clone()).filter(|n| *n != largest).collect();
    // On the split drive: the largest shard and one other; the rest stays.
    let moved = [largest.as_str(), others[0].as_str()];
    let stays: Vec<&str> = others[1..].iter().map(String::as_str).collect();
    let mut copies: BTreeMap<String, usize> = shards.iter().map(|s| (s.0.clone(), 1)).collect();
    let (mut dirs, mut mirrors) = (Vec::new(), Vec::new());
    match kind {
        Kind::Primary => {}
        Kind::Split => {
            let s = shm.path().join("split");
            common::move_files(&primary, &s, &moved);
            dirs.push(s);
        }
        Kind::FullMirror => {
            let m = shm.path().join("mirror");
            let all: Vec<&str> = shards.iter().map(|s| s.0.as_str()).collect();
            common::copy_files(&primary, &m, &all);
            for c in copies.values_mut() {
                *c = 2;
            }
            mirrors.push(m);
        }
        Kind::PartialMirror => {
            let m = shm.path().join("mirror");
            let some = [largest.as_str(), others[others.len() - 1].as_str()];
            common::copy_files(&primary, &m, &some);
            for n in some {
                copies.insert(n.to_string(), 2);
            }
            mirrors.push(m);
        }
        Kind::SplitPartialMirror => {
            let s = shm.path().join("split");
            common::move_files(&primary, &s, &moved);
            // The split drive's shards mirrored on the first drive, one of
            // the primary's shards mirrored on the second.
            let m1 = tmp.path().join("mirror-on-first-drive");
            common::copy_files(&s, &m1, &moved);
            let m2 = shm.path().join("mirror-on-second-drive");
            common::copy_files(&primary, &m2, &stays[..1]);
            for n in moved.iter().chain(&stays[..1]) {
                copies.insert(n.to_string(), 2);
            }
            dirs.push(s);
            mirrors.push(m1);
            mirrors.push(m2);
        }
    }
    Some(Setup {
        _tmp: tmp,
        _shm: shm,
        primary,
        dirs,
        mirrors,
        want,
        sync,
        copies,
    })
}

impl Setup {
    fn layout_args(&self) -> Vec<OsString> {
        let mut a = Vec::new();
        if !self.dirs.is_empty() {
            a.push("--dirs".into());
            a.push(join(&self.dirs).into());
        }
        if !self.mirrors.is_empty() {
            a.push("--mirror".into());
            a.push(join(&self.mirrors).into());
        }
        a
    }

    fn model(&self, route: RoutePolicy, weights: Weights) -> Model {
        let m = Model::open(
            ModelConfig::new(&self.primary)
                .dirs(self.dirs.clone())
                .mirrors(self.mirrors.clone())
                .route(route)
                .weights(weights),
        )
        .expect("open the laid-out model");
        // The layout is what this test thinks it is.
        for (i, s) in m.catalog().shards().iter().enumerate() {
            let name = s.name.to_str().unwrap();
            assert_eq!(m.copies(i).len(), self.copies[name], "copies of {name}");
        }
        assert_eq!(m.catalog().shards().len(), self.copies.len());
        m
    }

    /// `digest --json` with `extra` arguments; checks the sums against the
    /// sync baseline and the reference. Returns the stats.
    fn digest(&self, extra: &[&str], env: &[(&str, &OsStr)], use_flags: bool) -> Value {
        let mut args: Vec<OsString> = vec!["digest".into(), self.primary.clone().into(), "--json".into()];
        args.extend(extra.iter().map(OsString::from));
        if use_flags {
            args.extend(self.layout_args());
        }
        let argv: Vec<&OsStr> = args.iter().map(OsString::as_os_str).collect();
        let out = common::run_with_env(&argv, env);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "digest {args:?} env {env:?} failed:\n{stderr}");
        assert!(!stderr.contains("panicked"), "{args:?}:\n{stderr}");
        let v: Value = serde_json::from_slice(&out.stdout).expect("--json output");
        let got = common::json_sums(&v);
        assert_eq!(got, self.sync, "digest {args:?} env {env:?} differs from the sync path");
        if let Some(w) = &self.want {
            assert_eq!(&got, w, "digest {args:?} env {env:?} differs from the reference reader");
        }
        v["stats"].clone()
    }
}

/// What the layout predicts for one read of every tensor.
struct Prediction {
    total_bytes: u64,
    total_chunks: u64,
    /// Per drive: bytes and chunks if every read went wholly to its hashed copy.
    hash: BTreeMap<String, (u64, u64)>,
    /// Per drive: the least and most chunks `stripe` can give it.
    stripe: BTreeMap<String, (u64, u64)>,
    /// Per drive: the most bytes it can serve (payloads of shards it holds).
    can_serve: BTreeMap<String, u64>,
    /// Drives holding a copy of a shard that also has a copy on another drive.
    shared: BTreeSet<String>,
}

/// Chunks the engine cuts a read of `t` into.
fn chunks_of(m: &Model, t: &weightstream::TensorRef, direct: bool) -> u64 {
    let align = m.required_align();
    let chunk = (CHUNK.max(align) / align) * align;
    let size = m.files()[t.shard].size;
    let w = Window::plan(t.offset, t.len, size, align as u64, false).unwrap();
    let can_direct = direct && m.copies(t.shard).iter().any(|&f| m.files()[f].direct().is_some());
    let w = if can_direct { w } else { w.buffered() };
    (w.direct.div_ceil(chunk) + w.tail.div_ceil(chunk)) as u64
}

fn predict(m: &Model, direct: bool) -> Prediction {
    let mut p = Prediction {
        total_bytes: 0,
        total_chunks: 0,
        hash: BTreeMap::new(),
        stripe: BTreeMap::new(),
        can_serve: BTreeMap::new(),
        shared: BTreeSet::new(),
    };
    let dev = |f: usize| m.drives()[m.files()[f].drive].device.clone();
    for d in m.drives() {
        p.hash.insert(d.device.clone(), (0, 0));
        p.stripe.insert(d.device.clone(), (0, 0));
        p.can_serve.insert(d.device.clone(), 0);
    }
    for t in m.catalog().tensors() {
        let n = chunks_of(m, t, direct);
        p.total_bytes += t.len;
        p.total_chunks += n;
        let copies = m.copies(t.shard);
        let weights: Vec<f64> = copies.iter().map(|&f| m.rank_weights()[m.files()[f].rank]).collect();
        let r = route::hash_pick(m.group_key(t), &route::cuts(&weights));
        let h = p.hash.get_mut(&dev(copies[r])).unwrap();
        h.0 += t.len;
        h.1 += n;
        let k = copies.len() as u64;
        for &f in copies {
            let s = p.stripe.get_mut(&dev(f)).unwrap();
            s.0 += n / k;
            s.1 += n.div_ceil(k);
        }
        let devs: BTreeSet<String> = copies.iter().map(|&f| dev(f)).collect();
        for d in &devs {
            *p.can_serve.get_mut(d).unwrap() += t.len;
        }
        if devs.len() > 1 && t.len > 0 {
            p.shared.extend(devs);
        }
    }
    p
}

fn drives(stats: &Value) -> BTreeMap<String, &Value> {
    stats["drives"]
        .as_array()
        .expect("stats.drives")
        .iter()
        .map(|d| (d["device"].as_str().unwrap().to_string(), d))
        .collect()
}

fn u(d: &Value, k: &str) -> u64 {
    d[k].as_u64().unwrap_or_else(|| panic!("drives[].{k} in {d:#}"))
}

/// Checks what the stats of one digest say against the layout's prediction.
fn check_stats(stats: &Value, p: &Prediction, route: &str, direct: &str, backend: &str, what: &str) {
    assert_eq!(stats["backend"], backend, "{what}: {stats:#}");
    let ds = drives(stats);
    let devs: BTreeSet<&String> = ds.keys().collect();
    assert_eq!(devs, p.hash.keys().collect(), "{what}: drives in the stats");
    assert_eq!(stats["bytes"].as_u64(), Some(p.total_bytes), "{what}: {stats:#}");
    let chunks: u64 = ds.values().map(|d| u(d, "chunks")).sum();
    assert_eq!(chunks, p.total_chunks, "{what}: chunks counted, {stats:#}");
    for (name, d) in &ds {
        assert_eq!(u(d, "failovers"), 0, "{what}: {name}: {stats:#}");
        assert!(
            u(d, "bytes") <= p.can_serve[name],
            "{what}: drive {name} served {} bytes but holds only {} bytes of payload: {stats:#}",
            u(d, "bytes"),
            p.can_serve[name]
        );
        for cause in d["fallbacks"].as_object().unwrap().keys() {
            assert_eq!(cause, "no_bulk", "{what}: {name}: unexpected fallback: {stats:#}");
        }
        if direct == "off" {
            assert_eq!(u(d, "bytes_direct"), 0, "{what}: {name}: {stats:#}");
            assert_eq!(u(d, "reads_direct"), 0, "{what}: {name}: {stats:#}");
        }
    }
    if direct == "auto" {
        let direct_bytes: u64 = ds.values().map(|d| u(d, "bytes_direct")).sum();
        assert!(direct_bytes > 0, "{what}: nothing read direct: {stats:#}");
    }
    match route {
        "hash" => {
            for (name, d) in &ds {
                assert_eq!(
                    (u(d, "bytes"), u(d, "chunks")),
                    p.hash[name],
                    "{what}: drive {name}: (bytes, chunks) differ from every read going wholly to its hashed copy: {stats:#}"
                );
            }
        }
        "stripe" | "adaptive" => {
            for name in &p.shared {
                let d = ds[name];
                assert!(
                    u(d, "bytes") > 0 && u(d, "chunks") > 0 && d["share"].as_f64().unwrap() > 0.0,
                    "{what}: drive {name} holds copies but served nothing: {stats:#}"
                );
            }
            if route == "stripe" {
                for (name, d) in &ds {
                    let (lo, hi) = p.stripe[name];
                    let c = u(d, "chunks");
                    assert!(
                        (lo..=hi).contains(&c),
                        "{what}: drive {name} got {c} chunks; stripe over equal weights gives it {lo}..={hi}: {stats:#}"
                    );
                }
            }
        }
        other => panic!("route {other}"),
    }
}

fn matrix(kind: Kind) {
    let Some(s) = setup(kind) else { return };
    let mut predictions = BTreeMap::new();
    for (direct, d) in [("auto", true), ("off", false)] {
        let m = s.model(RoutePolicy::Hash, Weights::Equal);
        predictions.insert(direct, predict(&m, d));
    }
    let p = &predictions["auto"];
    if kind != Kind::Primary && kind != Kind::Split {
        assert!(p.shared.len() >= 2, "{kind:?}: no shard with copies on two drives");
    }
    if kind == Kind::FullMirror {
        // The model is big enough for hash to use both copies.
        assert!(
            p.hash.values().all(|&(b, _)| b > 0),
            "{kind:?}: hash routes every tensor to one drive; the fixture cannot tell routes apart"
        );
    }
    let chunk = CHUNK.to_string();
    for backend in common::engine_backends() {
        for route in ["hash", "stripe", "adaptive"] {
            for direct in ["auto", "off"] {
                let what = format!("{kind:?} --backend {backend} --route {route} --direct {direct}");
                let args = [
                    "--backend",
                    backend,
                    "--route",
                    route,
                    "--direct",
                    direct,
                    "--chunk",
                    &chunk,
                ];
                let stats = s.digest(&args, &[], true);
                check_stats(&stats, &predictions[direct], route, direct, backend, &what);
                if kind == Kind::FullMirror && route == "stripe" {
                    // Equal weights: each drive about half, and each read
                    // direct on both.
                    for (name, d) in drives(&stats) {
                        let share = d["share"].as_f64().unwrap();
                        assert!((0.35..=0.65).contains(&share), "{what}: {name} share {share}");
                        if direct == "auto" {
                            assert!(u(d, "bytes_direct") > 0, "{what}: {name} read nothing direct");
                        }
                    }
                }
            }
        }
    }
}

#[test]
fn primary_only() {
    matrix(Kind::Primary);
}

#[test]
fn split_directory_on_a_second_drive() {
    matrix(Kind::Split);
}

#[test]
fn full_mirror_on_a_second_drive() {
    matrix(Kind::FullMirror);
}

#[test]
fn partial_mirror() {
    matrix(Kind::PartialMirror);
}

#[test]
fn split_and_partial_mirrors() {
    matrix(Kind::SplitPartialMirror);
}

/// `hash` sends a read wholly to one copy: one tensor at a time, exactly one
/// drive counts chunks, all of them; and the weights move the cut points
/// (`1000,1`: the mirror gets nothing; `3,1` under `stripe`: about a quarter).
#[test]
fn hash_reads_go_wholly_to_one_drive_and_weights_move_the_split() {
    let Some(s) = setup(Kind::FullMirror) else { return };
    let m = s.model(RoutePolicy::Hash, Weights::Equal);
    let mut by_size: Vec<&weightstream::TensorRef> = m.catalog().tensors().iter().collect();
    by_size.sort_by_key(|t| std::cmp::Reverse(t.len));
    let chunk = CHUNK.to_string();
    for t in by_size.iter().take(4) {
        let want_chunks = chunks_of(&m, t, true);
        assert!(want_chunks > 1, "{}: a single-chunk tensor proves nothing", t.name);
        let copies = m.copies(t.shard);
        let r = route::hash_pick(m.group_key(t), &route::cuts(&[1.0, 1.0]));
        let want_dev = &m.drives()[m.files()[copies[r]].drive].device;
        for backend in common::engine_backends() {
            let what = format!("--tensor {} --backend {backend}", t.name);
            let args = [
                "--tensor",
                &t.name,
                "--route",
                "hash",
                "--backend",
                backend,
                "--chunk",
                &chunk,
            ];
            let st = s.digest_subset(&args, &t.name);
            let ds = drives(&st);
            let busy: Vec<(&String, u64)> = ds
                .iter()
                .map(|(n, d)| (n, u(d, "chunks")))
                .filter(|&(_, c)| c > 0)
                .collect();
            assert_eq!(busy, [(want_dev, want_chunks)], "{what}: {st:#}");
            assert_eq!(u(ds[want_dev], "bytes"), t.len, "{what}");
        }
    }
    // Weights: 1000,1 cuts at [256, 256]: the mirror gets nothing.
    let mirror_dev = m.drives()[m.files()[m.copies(0)[1]].drive].device.clone();
    let st = s.digest(
        &["--route", "hash", "--weights", "1000,1", "--chunk", &chunk],
        &[],
        true,
    );
    assert_eq!(u(drives(&st)[&mirror_dev], "bytes"), 0, "--weights 1000,1: {st:#}");
    // 1,1000 cuts at [1, 256]: the primary gets only keys hashing below 1.
    let m2 = s.model(RoutePolicy::Hash, Weights::Explicit(vec![1.0, 1000.0]));
    let p = predict(&m2, true);
    let st = s.digest(
        &["--route", "hash", "--weights", "1,1000", "--chunk", &chunk],
        &[],
        true,
    );
    check_stats(
        &st,
        &p,
        "hash",
        "auto",
        st["backend"].as_str().unwrap(),
        "--weights 1,1000",
    );
    assert!(
        p.hash[&mirror_dev].0 > p.total_bytes / 2,
        "1,1000 should favour the mirror"
    );
    // Stripe follows 3,1: the mirror serves about a quarter.
    let st = s.digest(&["--route", "stripe", "--weights", "3,1", "--chunk", &chunk], &[], true);
    let share = drives(&st)[&mirror_dev]["share"].as_f64().unwrap();
    assert!(
        (0.15..=0.35).contains(&share),
        "--weights 3,1 stripe: mirror share {share}: {st:#}"
    );
}

/// `stripe` and `adaptive` split one read inside itself: a single tensor of
/// many chunks is served by both drives (`stripe`: its chunks halved
/// between them), where `hash` gives it to one.
#[test]
fn stripe_and_adaptive_split_a_single_read_over_both_drives() {
    for kind in [Kind::FullMirror, Kind::SplitPartialMirror] {
        let Some(s) = setup(kind) else { return };
        let m = s.model(RoutePolicy::Hash, Weights::Equal);
        let t = m.catalog().tensors().iter().max_by_key(|t| t.len).unwrap();
        let n = chunks_of(&m, t, true);
        assert!(n >= 4, "{}: {n} chunks", t.name);
        let chunk = CHUNK.to_string();
        for backend in common::engine_backends() {
            for route in ["stripe", "adaptive"] {
                let what = format!("{kind:?} --tensor {} --route {route} --backend {backend}", t.name);
                let args = [
                    "--tensor",
                    &t.name,
                    "--route",
                    route,
                    "--backend",
                    backend,
                    "--chunk",
                    &chunk,
                ];
                let st = s.digest_subset(&args, &t.name);
                let ds = drives(&st);
                let per: Vec<u64> = ds.values().map(|d| u(d, "chunks")).collect();
                assert_eq!(per.iter().sum::<u64>(), n, "{what}: {st:#}");
                assert!(
                    per.iter().all(|&c| c > 0),
                    "{what}: one read not split over both drives: {per:?}"
                );
                if route == "stripe" {
                    assert!(per.iter().all(|&c| c == n / 2 || c == n.div_ceil(2)), "{what}: {per:?}");
                }
            }
        }
    }
}

impl Setup {
    /// `digest --json` of one tensor; checks its sum. Returns the stats.
    fn digest_subset(&self, extra: &[&str], name: &str) -> Value {
        let mut args: Vec<OsString> = vec!["digest".into(), self.primary.clone().into(), "--json".into()];
        args.extend(extra.iter().map(OsString::from));
        args.extend(self.layout_args());
        let argv: Vec<&OsStr> = args.iter().map(OsString::as_os_str).collect();
        let (v, _) = common::run_json(&argv);
        let got = common::json_sums(&v);
        assert_eq!(got.len(), 1, "{args:?}");
        assert_eq!(got[name], self.sync[name], "{args:?}");
        v["stats"].clone()
    }
}

/// The same layout through the environment instead of flags: the split
/// directory and both mirrors are used (every tensor found, both drives
/// serve), the route and weights apply (hash stats exactly as predicted;
/// `inspect` reports them), and a flag still overrides its variable.
#[test]
fn layout_from_the_environment() {
    let Some(s) = setup(Kind::SplitPartialMirror) else {
        return;
    };
    let dirs = OsString::from(format!(" {} ;", s.dirs[0].display()));
    let mirrors = OsString::from(format!("{} ; {},", s.mirrors[0].display(), s.mirrors[1].display()));
    let chunk = CHUNK.to_string();
    let env = |route: &'static str, weights: &'static str| -> Vec<(&'static str, OsString)> {
        vec![
            ("WEIGHTSTREAM_MODEL_DIRS", dirs.clone()),
            ("WEIGHTSTREAM_MIRROR", mirrors.clone()),
            ("WEIGHTSTREAM_ROUTE", route.into()),
            ("WEIGHTSTREAM_DISK_WEIGHTS", weights.into()),
        ]
    };
    let call = |extra: &[&str], e: Vec<(&'static str, OsString)>| -> Value {
        let pairs: Vec<(&str, &OsStr)> = e.iter().map(|(k, v)| (*k, v.as_os_str())).collect();
        s.digest(extra, &pairs, false)
    };
    for backend in common::engine_backends() {
        // stripe from the environment: every drive holding a shared copy serves.
        let st = call(&["--backend", backend, "--chunk", &chunk], env("stripe", "1,1,1"));
        let m = s.model(RoutePolicy::Stripe, Weights::Equal);
        let p = predict(&m, true);
        check_stats(&st, &p, "stripe", "auto", backend, "env stripe");
        // hash from the environment, with weights that move the cuts.
        let st = call(&["--backend", backend, "--chunk", &chunk], env("hash", "1;3;1"));
        let m = s.model(RoutePolicy::Hash, Weights::Explicit(vec![1.0, 3.0, 1.0]));
        let p = predict(&m, true);
        check_stats(&st, &p, "hash", "auto", backend, "env hash 1;3;1");
    }
    // A flag overrides its variable: an unparsable route in the environment
    // is never looked at when --route is given.
    let st = call(
        &["--route", "hash", "--weights", "1,3,1", "--chunk", &chunk],
        env("no-such-route", "not-a-weight"),
    );
    let m = s.model(RoutePolicy::Hash, Weights::Explicit(vec![1.0, 3.0, 1.0]));
    check_stats(
        &st,
        &predict(&m, true),
        "hash",
        "auto",
        st["backend"].as_str().unwrap(),
        "flags over env",
    );
    // And without the flag the bad variable is an error naming it.
    let e = env("no-such-route", "1,1,1");
    let pairs: Vec<(&str, &OsStr)> = e.iter().map(|(k, v)| (*k, v.as_os_str())).collect();
    let out = common::run_with_env(&[os("digest"), s.primary.as_os_str()], &pairs);
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("no-such-route") && !stderr.contains("panicked"),
        "{stderr}"
    );
    // inspect reads the same variables.
    let e = env("hash", "2,3,4");
    let pairs: Vec<(&str, &OsStr)> = e.iter().map(|(k, v)| (*k, v.as_os_str())).collect();
    let out = common::run_with_env(&[os("inspect"), s.primary.as_os_str(), os("--json")], &pairs);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["route"], "hash", "{v:#}");
    assert_eq!(v["weights"], serde_json::json!([2.0, 3.0, 4.0]), "{v:#}");
    let shard_copies: BTreeMap<String, usize> = v["shards"]
        .as_array()
        .unwrap()
        .iter()
        .map(|sh| {
            (
                sh["name"].as_str().unwrap().to_string(),
                sh["copies"].as_array().unwrap().len(),
            )
        })
        .collect();
    assert_eq!(shard_copies, s.copies, "{v:#}");
    // The lists are trimmed and split on ; and , (as the variables were typed).
    assert_eq!(split_list(dirs.to_str().unwrap()), [s.dirs[0].to_str().unwrap()]);
}
