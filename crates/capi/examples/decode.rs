//! The Rust twin of `examples/decode.c`: the same decode loop through the
//! Rust API (`Engine::register_memory`, `Engine::placement`,
//! `Engine::read_into` with `Scratch::Blocks`), the same router (a 64-bit
//! LCG), the same experts in the same order, the same JSON line. It is the
//! baseline the C ABI is measured against (benches/capi-decode.sh).
//!
//! cargo run --release -p weightstream-capi --example decode -- MODEL_DIR [STEPS [K]]

use std::alloc::Layout;
use std::ptr::NonNull;
use std::time::Instant;

use ws::{Engine, EngineConfig, Model, ModelConfig, Scratch, TensorRef};

type Result<T> = std::result::Result<T, Box<dyn std::error::Error>>;

/// This process's CPU seconds (every thread, the I/O threads included), as
/// the C example's `getrusage(RUSAGE_SELF)`.
fn cpu_seconds() -> f64 {
    // SAFETY: an all-zero `rusage` is a valid value of this plain C struct.
    let mut r: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: `r` is a valid, writable `rusage` for the call.
    if unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut r) } != 0 {
        return 0.0;
    }
    let t = |v: libc::timeval| v.tv_sec as f64 + v.tv_usec as f64 * 1e-6;
    t(r.ru_utime) + t(r.ru_stime)
}

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let dir = args.get(1).ok_or("usage: decode MODEL_DIR [STEPS [K]]")?;
    let steps: usize = args.get(2).map_or(Ok(8), |s| s.parse())?;
    let mut k: usize = args.get(3).map_or(Ok(2), |s| s.parse())?;
    let model = Model::open(ModelConfig::new(dir).settings(|v| std::env::var(v).ok())?)?;
    let engine = Engine::new(&model, EngineConfig::from_env()?)?;
    let name = |l: usize, e: usize, p: &str| format!("model.layers.{l}.mlp.experts.{e}.{p}.weight");
    let layers = (0..)
        .take_while(|&l| model.get(&name(l, 0, "gate_proj")).is_some())
        .count();
    let experts = (0..)
        .take_while(|&e| model.get(&name(0, e, "gate_proj")).is_some())
        .count();
    if layers == 0 || experts == 0 {
        return Err(format!("{dir}: no model.layers.L.mlp.experts.E.*_proj.weight tensors").into());
    }
    k = k.min(experts);
    const PROJ: [&str; 3] = ["gate_proj", "up_proj", "down_proj"];
    let n = 3 * k;
    let mut largest = 0u64;
    for l in 0..layers {
        for e in 0..experts {
            for p in PROJ {
                largest = largest.max(model.tensor(&name(l, e, p))?.len);
            }
        }
    }
    let align = engine.direct_align();
    let len = (n * (largest as usize + 2 * align) + align).next_multiple_of(4096);
    let layout = Layout::from_size_align(len, 2 << 20)?;
    // SAFETY: `layout` has a non-zero size (at least one block).
    let buf = NonNull::new(unsafe { std::alloc::alloc(layout) }).ok_or("allocation failed")?;
    // SAFETY: `buf` is `len` bytes just allocated: faulted once, as the C
    // example's memset does.
    unsafe { buf.as_ptr().write_bytes(0, len) };
    // SAFETY: the allocation stays valid (freed below only after the arena
    // is released with nothing in flight); nothing else touches it while
    // slots of it exist.
    let mem = unsafe { engine.register_memory(buf, len) }?;

    let mut seed: u64 = 1;
    let mut bytes = 0u64;
    let mut picked: Vec<&TensorRef> = Vec::with_capacity(n);
    let (cpu0, t0) = (cpu_seconds(), Instant::now());
    for _ in 0..steps {
        for l in 0..layers {
            picked.clear();
            let mut pick: Vec<usize> = Vec::with_capacity(k);
            for _ in 0..k {
                let e = loop {
                    seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                    let e = ((seed >> 33) % experts as u64) as usize;
                    if !pick.contains(&e) {
                        break e;
                    }
                };
                pick.push(e);
                for p in PROJ {
                    picked.push(model.tensor(&name(l, e, p))?);
                }
            }
            let place = engine.placement(&picked, &mem)?;
            let tickets = picked
                .iter()
                .enumerate()
                .map(|(i, t)| engine.read_into(t, &mem, place.at(i), Scratch::Blocks))
                .collect::<ws::Result<Vec<_>>>()?;
            for t in tickets {
                bytes += t.wait()?.len() as u64;
            }
        }
    }
    let secs = t0.elapsed().as_secs_f64();
    let cpu = cpu_seconds() - cpu0;
    let st = engine.stats();
    println!(
        "{{\"steps\": {steps}, \"layers\": {layers}, \"k\": {k}, \"bytes\": {bytes}, \"seconds\": {secs:.6}, \
         \"gbps\": {:.4}, \"cpu_s_per_gb\": {:.4}, \"verified\": 0, \"bad\": 0, \"fallbacks\": {}, \"staged\": {}}}",
        bytes as f64 / 1e9 / secs,
        cpu / (bytes as f64 / 1e9),
        st.fallbacks_total(),
        st.staged.reads
    );
    if mem.release(std::time::Duration::from_secs(60)).is_err() {
        return Err("reads still in flight after 60 s: the buffer is leaked, not freed".into());
    }
    // SAFETY: allocated above with `layout`; the arena is released and no
    // read is in flight.
    unsafe { std::alloc::dealloc(buf.as_ptr(), layout) };
    drop(engine);
    Ok(())
}
