//! One arm of the expert-cache benchmark (benches/expert-cache.sh runs
//! every arm, each in a process of its own, and tables them): a decode
//! trace over a MoE model, each token reading every layer's top-k experts,
//! with fake compute per layer, through one of:
//!
//! - `cache`: `ExpertCache` (LRU), no prefetch;
//! - `prefetch`: the cache, and each layer prefetches the next layer's
//!   experts from a predictor right `accuracy` of the time;
//! - `direct`: no cache, every use read O_DIRECT into slots (one layer's
//!   top-k of memory);
//! - `pagecache`: `pread` of each expert from buffered files into one
//!   buffer, `posix_fadvise(WILLNEED)` for the same predictions as
//!   `prefetch` (what "trust the OS" engines do; the script runs this arm
//!   in a memory cgroup limited to the same budget).
//!
//! cargo run --release --example expert_cache_bench -- MODEL_DIR ARM
//!     [--budget-experts N] [--tokens T] [--top-k K] [--compute-us U]
//!     [--accuracy A] [--locality P] [--zipf S] [--seed S] [--dirs D;D] [--mirror D;D]
//!
//! Prints one JSON object: wait per token (median, p99; seconds the decode
//! thread spent on expert bytes instead of compute: blocked in gets or
//! reads, and in the prefetch calls themselves), time per token, bytes the process read from the drives per token
//! (/proc/self/io), hits, CPU s/GB, peak RSS, and for `prefetch` the share
//! of prefetched bytes used; for the cache arms, whether the hits equal
//! an LRU simulation of the same gets (`cache` only: exact by contract).

use std::collections::HashMap;
use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

use weightstream::{
    simulate_lru, CacheConfig, Capacity, Engine, EngineConfig, ExpertCache, Model, ModelConfig, TensorRef,
};
use weightstream_synth::SplitMix64;

struct Args {
    dir: String,
    arm: String,
    budget: usize,
    tokens: usize,
    k: usize,
    compute_us: u64,
    accuracy: f64,
    locality: f64,
    zipf: f64,
    seed: u64,
    dirs: Option<String>,
    mirror: Option<String>,
}

fn args() -> Result<Args, String> {
    let mut it = std::env::args().skip(1);
    let dir = it.next().ok_or("usage: expert_cache_bench MODEL_DIR ARM [options]")?;
    let arm = it.next().ok_or("ARM: cache, prefetch, direct or pagecache")?;
    let mut a = Args {
        dir,
        arm,
        budget: 256,
        tokens: 64,
        k: 8,
        compute_us: 2000,
        accuracy: 0.8,
        locality: 0.3,
        zipf: 1.1,
        seed: 7,
        dirs: None,
        mirror: None,
    };
    while let Some(f) = it.next() {
        let v = it.next().ok_or(format!("{f}: a value"))?;
        let num = |v: &str| v.parse::<f64>().map_err(|e| format!("{f} {v}: {e}"));
        match f.as_str() {
            "--budget-experts" => a.budget = num(&v)? as usize,
            "--tokens" => a.tokens = num(&v)? as usize,
            "--top-k" => a.k = num(&v)? as usize,
            "--compute-us" => a.compute_us = num(&v)? as u64,
            "--accuracy" => a.accuracy = num(&v)?,
            "--locality" => a.locality = num(&v)?,
            "--zipf" => a.zipf = num(&v)?,
            "--seed" => a.seed = num(&v)? as u64,
            "--dirs" => a.dirs = Some(v),
            "--mirror" => a.mirror = Some(v),
            _ => return Err(format!("unknown option {f}")),
        }
    }
    if !["cache", "prefetch", "direct", "pagecache"].contains(&a.arm.as_str()) {
        return Err(format!("arm {:?}: cache, prefetch, direct or pagecache", a.arm));
    }
    Ok(a)
}

/// Per token, per layer, the top-k: Zipf(`s`) popularity over a per-layer
/// permutation of the experts, and with probability `locality` an expert
/// the same layer used for the previous token.
fn make_trace(a: &Args, layers: usize, experts: usize) -> Vec<Vec<Vec<usize>>> {
    let mut rng = SplitMix64(a.seed);
    let perms: Vec<Vec<usize>> = (0..layers)
        .map(|_| {
            let mut p: Vec<usize> = (0..experts).collect();
            for i in (1..p.len()).rev() {
                p.swap(i, (rng.next_u64() % (i as u64 + 1)) as usize);
            }
            p
        })
        .collect();
    let weights: Vec<f64> = (0..experts).map(|r| 1.0 / ((r + 1) as f64).powf(a.zipf)).collect();
    let total: f64 = weights.iter().sum();
    let k = a.k.min(experts);
    let mut prev: Vec<Vec<usize>> = vec![Vec::new(); layers];
    let mut out = Vec::with_capacity(a.tokens);
    for _ in 0..a.tokens {
        let mut token = Vec::with_capacity(layers);
        for l in 0..layers {
            let mut chosen: Vec<usize> = Vec::with_capacity(k);
            while chosen.len() < k {
                let e = if !prev[l].is_empty() && rng.unit() < a.locality {
                    prev[l][(rng.next_u64() % prev[l].len() as u64) as usize]
                } else {
                    let mut u = rng.unit() * total;
                    let mut r = 0;
                    while r + 1 < experts && u >= weights[r] {
                        u -= weights[r];
                        r += 1;
                    }
                    perms[l][r]
                };
                if !chosen.contains(&e) {
                    chosen.push(e);
                }
            }
            prev[l] = chosen.clone();
            token.push(chosen);
        }
        out.push(token);
    }
    out
}

/// The predictor: each true expert of the next layer, or with probability
/// `1 - accuracy` another one not in the set.
fn predict(rng: &mut SplitMix64, truth: &[usize], experts: usize, accuracy: f64) -> Vec<usize> {
    let mut out: Vec<usize> = Vec::with_capacity(truth.len());
    for &e in truth {
        let mut g = e;
        if rng.unit() >= accuracy {
            loop {
                g = (rng.next_u64() % experts as u64) as usize;
                if !truth.contains(&g) && !out.contains(&g) {
                    break;
                }
            }
        }
        if !out.contains(&g) {
            out.push(g);
        }
    }
    out
}

fn spin(us: u64) {
    let t = Instant::now();
    let d = Duration::from_micros(us);
    let mut x = 0u64;
    while t.elapsed() < d {
        x = std::hint::black_box(x.wrapping_mul(6364136223846793005).wrapping_add(1));
    }
}

fn proc_io_read_bytes() -> u64 {
    std::fs::read_to_string("/proc/self/io")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("read_bytes:").map(|v| v.trim().parse().unwrap_or(0)))
        })
        .unwrap_or(0)
}

fn cpu_seconds() -> f64 {
    // SAFETY: getrusage writes the struct it is given.
    let mut u: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: a valid rusage to fill.
    unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut u) };
    let tv = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 / 1e6;
    tv(u.ru_utime) + tv(u.ru_stime)
}

fn peak_rss() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines().find_map(|l| {
                l.strip_prefix("VmHWM:")
                    .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
            })
        })
        .unwrap_or(0)
        * 1024
}

fn quantile(v: &mut [f64], q: f64) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[((v.len() - 1) as f64 * q).round() as usize]
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let a = args()?;
    let mut mc = ModelConfig::new(&a.dir);
    if let Some(d) = &a.dirs {
        mc = mc.dirs(d.split(';').map(String::from).collect::<Vec<_>>());
    }
    if let Some(m) = &a.mirror {
        mc = mc.mirrors(m.split(';').map(String::from).collect::<Vec<_>>());
    }
    let model = Model::open(mc)?;
    let experts_view = model.experts()?;
    let layers: Vec<usize> = experts_view.layers().map(|l| l.index()).collect();
    let per_layer = experts_view.layers().map(|l| l.expert_count()).min().unwrap_or(0);
    let trace = make_trace(&a, layers.len(), per_layer);
    let mut prng = SplitMix64(a.seed ^ 0x5eed);
    // The gets in order, for the LRU check.
    let gets: Vec<(usize, usize)> = trace
        .iter()
        .flat_map(|t| t.iter().enumerate().flat_map(|(l, es)| es.iter().map(move |&e| (l, e))))
        .map(|(l, e)| (layers[l], e))
        .collect();
    let tensors_of = |l: usize, e: usize| -> Vec<TensorRef> {
        experts_view
            .expert(layers[l], e)
            .map(|x| x.tensors().cloned().collect())
            .unwrap_or_default()
    };
    let io0 = proc_io_read_bytes();
    let cpu0 = cpu_seconds();
    let t0 = Instant::now();
    let mut waits = Vec::with_capacity(a.tokens);
    let mut out = serde_json::Map::new();
    match a.arm.as_str() {
        "cache" | "prefetch" => {
            let cache = ExpertCache::new(
                &model,
                CacheConfig::new(Capacity::Experts(a.budget)).engine(EngineConfig::from_env()?),
            )?;
            let prefetch = a.arm == "prefetch";
            for token in &trace {
                let mut w = 0.0;
                for (l, chosen) in token.iter().enumerate() {
                    let t = Instant::now();
                    let hs = cache.get_many(layers[l], chosen)?;
                    w += t.elapsed().as_secs_f64();
                    if prefetch && l + 1 < token.len() {
                        let guess = predict(&mut prng, &token[l + 1], per_layer, a.accuracy);
                        let keys: Vec<(usize, usize)> = guess.iter().map(|&e| (layers[l + 1], e)).collect();
                        // The call's own time is the decode thread's, not compute's.
                        let t = Instant::now();
                        cache.prefetch(&keys)?;
                        w += t.elapsed().as_secs_f64();
                    }
                    spin(a.compute_us);
                    drop(hs);
                }
                waits.push(w);
            }
            let s = cache.stats();
            out.insert("hits".into(), s.hits.into());
            out.insert("misses".into(), s.misses.into());
            out.insert(
                "hit_rate".into(),
                (s.hits as f64 / (s.hits + s.misses).max(1) as f64).into(),
            );
            out.insert("cache_bytes_read".into(), s.bytes_read.into());
            out.insert("prefetched".into(), s.prefetched.into());
            out.insert("prefetch_used".into(), s.prefetch_used.into());
            out.insert("prefetch_wasted_bytes".into(), s.prefetch_wasted_bytes.into());
            out.insert(
                "prefetch_used_share".into(),
                (s.prefetch_used as f64 / s.prefetched.max(1) as f64).into(),
            );
            out.insert("evictions".into(), s.evictions.into());
            out.insert("capacity".into(), s.capacity.into());
            out.insert("entry_bytes".into(), s.entry_bytes.into());
            out.insert("budget_bytes".into(), (s.capacity as u64 * s.entry_bytes).into());
            out.insert(
                "bytes_read_per_drive".into(),
                serde_json::to_value(&s.bytes_read_per_drive)?,
            );
            if !prefetch {
                let want = simulate_lru(&gets, s.capacity);
                out.insert("lru_simulated_hits".into(), want.into());
                out.insert("hits_equal_lru".into(), (want == s.hits).into());
            }
            out.insert("miss_read_seconds".into(), s.wait_seconds.into());
        }
        "direct" => {
            let engine = Engine::new(&model, EngineConfig::from_env()?)?;
            let step: Vec<TensorRef> = (0..a.k.min(per_layer)).flat_map(|e| tensors_of(0, e)).collect();
            let refs: Vec<&TensorRef> = step.iter().collect();
            let arena = engine.packed_arena_for(&refs, 1, true)?;
            for token in &trace {
                let mut w = 0.0;
                for (l, chosen) in token.iter().enumerate() {
                    let t = Instant::now();
                    let ts: Vec<TensorRef> = chosen.iter().flat_map(|&e| tensors_of(l, e)).collect();
                    let mut reads = Vec::with_capacity(ts.len());
                    for t in &ts {
                        reads.push((t, arena.take_for(t)?));
                    }
                    let loaded: Vec<_> = engine
                        .read_batch(reads)?
                        .into_iter()
                        .map(|t| t.wait())
                        .collect::<Result<_, _>>()?;
                    w += t.elapsed().as_secs_f64();
                    spin(a.compute_us);
                    drop(loaded);
                }
                waits.push(w);
            }
            out.insert("hits".into(), 0.into());
            out.insert("hit_rate".into(), 0.0.into());
        }
        _ => {
            // Buffered files, one descriptor per shard path.
            let mut fds: HashMap<usize, std::fs::File> = HashMap::new();
            for f in model.files() {
                if f.rank == 0 {
                    fds.insert(f.shard, std::fs::File::open(&f.path)?);
                }
            }
            let largest = (0..per_layer)
                .map(|e| tensors_of(0, e).iter().map(|t| t.len as usize).sum::<usize>())
                .max()
                .unwrap_or(0);
            let mut buf = vec![0u8; largest * a.k.min(per_layer)];
            for token in &trace {
                let mut w = 0.0;
                for (l, chosen) in token.iter().enumerate() {
                    let t = Instant::now();
                    let mut at = 0;
                    for &e in chosen {
                        for tr in tensors_of(l, e) {
                            let f = &fds[&tr.shard];
                            let n = tr.len as usize;
                            std::os::unix::fs::FileExt::read_exact_at(f, &mut buf[at..at + n], tr.offset)?;
                            at += n;
                        }
                    }
                    if l + 1 < token.len() {
                        // fadvise(WILLNEED) allocates the pages and submits
                        // their reads in the call: counted as waiting too.
                        for g in predict(&mut prng, &token[l + 1], per_layer, a.accuracy) {
                            for tr in tensors_of(l + 1, g) {
                                // SAFETY: an advice on an open descriptor; no memory is passed.
                                unsafe {
                                    libc::posix_fadvise(
                                        fds[&tr.shard].as_raw_fd(),
                                        tr.offset as i64,
                                        tr.len as i64,
                                        libc::POSIX_FADV_WILLNEED,
                                    )
                                };
                            }
                        }
                    }
                    w += t.elapsed().as_secs_f64();
                    spin(a.compute_us);
                }
                waits.push(w);
            }
        }
    }
    let secs = t0.elapsed().as_secs_f64();
    let read = proc_io_read_bytes().saturating_sub(io0);
    let cpu = cpu_seconds() - cpu0;
    let used: u64 = gets
        .iter()
        .map(|&(l, e)| experts_view.expert(l, e).map(|x| x.bytes()).unwrap_or(0))
        .sum();
    let mut w = waits.clone();
    out.insert("arm".into(), a.arm.clone().into());
    out.insert("tokens".into(), a.tokens.into());
    out.insert("layers".into(), layers.len().into());
    out.insert("experts_per_layer".into(), per_layer.into());
    out.insert("top_k".into(), a.k.into());
    out.insert("budget_experts".into(), a.budget.into());
    out.insert("compute_us_per_layer".into(), a.compute_us.into());
    out.insert("accuracy".into(), a.accuracy.into());
    out.insert("seconds".into(), secs.into());
    out.insert("wait_per_token_median_s".into(), quantile(&mut w, 0.5).into());
    out.insert("wait_per_token_p99_s".into(), quantile(&mut w, 0.99).into());
    out.insert("wait_total_s".into(), waits.iter().sum::<f64>().into());
    out.insert("seconds_per_token".into(), (secs / a.tokens.max(1) as f64).into());
    out.insert("bytes_read".into(), read.into());
    out.insert(
        "bytes_read_per_token".into(),
        (read as f64 / a.tokens.max(1) as f64).into(),
    );
    out.insert(
        "bytes_used_per_token".into(),
        (used as f64 / a.tokens.max(1) as f64).into(),
    );
    out.insert("cpu_seconds".into(), cpu.into());
    out.insert(
        "cpu_s_per_gb".into(),
        if read > 0 { cpu / (read as f64 / 1e9) } else { 0.0 }.into(),
    );
    out.insert("peak_rss_bytes".into(), peak_rss().into());
    println!("{}", serde_json::Value::Object(out));
    Ok(())
}
