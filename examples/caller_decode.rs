//! A mixture-of-experts decode loop into the engine's own memory, four
//! ways, interleaved: each step reads 8 experts x their projections of one
//! layer, double-buffered (step k+1's reads are in flight while step k is
//! computed on). The arms:
//!
//! - `arena`: the crate's packed arena (`take_for`), the baseline;
//! - `aligned`: a page-aligned buffer of the caller's on 2 MiB pages
//!   (`register_memory`), laid out by `Engine::placement`;
//! - `vec`: a plain `Vec<u8>` lent for the loop (`Engine::lend`), laid out
//!   by the placement helper;
//! - `fixed`: the caller fixes every address (page-aligned tensor storage,
//!   out of phase with the file): O_DIRECT through staging plus one copy.
//!
//! Every payload is checked against the writer's bytes (synthetic model).
//! The run fails if any read of any arm went buffered or fell back, or if
//! a placed arm needed staging. It prints each arm's median wait per step
//! and its ratio to the arena's.
//!
//! cargo run --release --example caller_decode -- [STEPS] [ROUNDS] [EXPERT_BYTES] [DIR] [check|nocheck] [LAYERS]
//!
//! `nocheck` checks the bytes in the first round only, so the later
//! rounds' waits are the reads' alone (no compute to hide them behind).
//!
//! DIR (default: a temporary directory) must be on a file system that
//! reads O_DIRECT; the model is written there by the reference writer
//! (the safetensors crate's serializer, as Python's `safetensors`), so no
//! payload starts on a block.

use std::ptr::NonNull;
use std::time::{Duration, Instant};

use weightstream::{Engine, EngineConfig, Model, ModelConfig, Scratch, Stats, TensorRef};
use weightstream_synth::{self as synth, SynthSpec};

/// Experts per step (the router's top-k), each with its projections.
const TOP_K: usize = 8;

type Result<T> = std::result::Result<T, Box<dyn std::error::Error>>;

fn main() -> Result<()> {
    let mut args = std::env::args().skip(1);
    let steps: usize = args.next().map(|s| s.parse()).transpose()?.unwrap_or(12);
    let rounds: usize = args.next().map(|s| s.parse()).transpose()?.unwrap_or(1);
    let expert_bytes: usize = args.next().map(|s| s.parse()).transpose()?.unwrap_or(256 << 10);
    let tmp = match args.next() {
        Some(d) => tempfile::tempdir_in(d)?,
        None => tempfile::tempdir()?,
    };
    let check_every_round = args.next().is_none_or(|a| a != "nocheck");
    let layers: usize = args.next().map(|s| s.parse()).transpose()?.unwrap_or(2);
    let spec = SynthSpec {
        layers,
        experts: 16,
        expert_bytes,
        shards: 3,
        seed: 19,
        ..SynthSpec::default()
    };
    synth::write_model(tmp.path(), &spec)?;
    let model = Model::open(ModelConfig::new(tmp.path()))?;
    let engine = Engine::new(&model, EngineConfig::from_env()?)?;
    if let Some(d) = engine.stats().drives.iter().find(|d| !d.direct_open) {
        return Err(format!(
            "{} ({}) refuses O_DIRECT: give a directory on a file system that reads O_DIRECT",
            tmp.path().display(),
            d.fs_type
        )
        .into());
    }
    let plan = Plan::new(&model, steps)?;
    println!(
        "{} steps x {} reads ({:.1} MB a step), {} rounds, payloads off blocks: {} of {}",
        steps,
        plan.steps[0].len(),
        plan.step_bytes(0) as f64 / 1e6,
        rounds,
        plan.steps.iter().flatten().filter(|t| t.offset % 4096 != 0).count(),
        plan.steps.iter().map(Vec::len).sum::<usize>(),
    );

    let arms = ["arena", "aligned", "vec", "fixed"];
    let mut waits: Vec<Vec<Duration>> = vec![Vec::new(); arms.len()];
    let mut cpu_per_gb: Vec<Vec<f64>> = vec![Vec::new(); arms.len()];
    let mut gbps: Vec<Vec<f64>> = vec![Vec::new(); arms.len()];
    let mut failures = Vec::new();
    for round in 0..rounds {
        for (i, arm) in arms.iter().enumerate() {
            let before = engine.stats();
            CHECK.store(round == 0 || check_every_round, std::sync::atomic::Ordering::Relaxed);
            let cpu0 = process_cpu_s();
            let t0 = Instant::now();
            let w = match *arm {
                "arena" => arena_arm(&engine, &plan, &spec)?,
                "aligned" => aligned_arm(&engine, &plan, &spec)?,
                "vec" => vec_arm(&engine, &plan, &spec)?,
                _ => fixed_arm(&engine, &plan, &spec)?,
            };
            let wall = t0.elapsed().as_secs_f64()
                - COMPUTE_WALL_NS.swap(0, std::sync::atomic::Ordering::Relaxed) as f64 * 1e-9;
            cpu_per_gb[i].push((process_cpu_s() - cpu0) / (plan.reads_bytes() as f64 / 1e9));
            gbps[i].push(plan.reads_bytes() as f64 / 1e9 / wall);
            let d = Counts::between(&before, &engine.stats());
            if d.fallbacks + d.buffered > 0 {
                failures.push(format!("round {round} {arm}: {d:?}"));
            }
            if matches!(*arm, "arena" | "aligned" | "vec") && d.staged > 0 {
                failures.push(format!("round {round} {arm}: {} reads staged, none expected", d.staged));
            }
            if *arm == "fixed" && d.staged != plan.reads() as u64 {
                failures.push(format!("round {round} fixed: {} of {} staged", d.staged, plan.reads()));
            }
            waits[i].extend(w);
        }
    }
    let p50 = |v: &mut Vec<Duration>| {
        v.sort();
        v[v.len() / 2]
    };
    let base = p50(&mut waits[0]);
    let median = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    for (((arm, w), c), g) in arms
        .iter()
        .zip(waits.iter_mut())
        .zip(cpu_per_gb.iter_mut())
        .zip(gbps.iter_mut())
    {
        let m = p50(w);
        println!(
            "{arm:>8}: wait p50 {:7.3} ms a step ({:.3}x the arena's); {:.2} GB/s; process CPU {:.3} s per GB read (medians of {} runs; the byte checks' time and CPU left out)",
            m.as_secs_f64() * 1e3,
            m.as_secs_f64() / base.as_secs_f64().max(1e-9),
            median(g),
            median(c),
            c.len()
        );
    }
    let st = engine.stats();
    println!(
        "staged (fixed arm): {} reads, {:.1} MB copied, {:.3} CPU s per GB copied, {:.1} MB of staging",
        st.staged.reads,
        st.staged.bytes as f64 / 1e6,
        st.staged.copy_cpu_s_per_gb().unwrap_or(0.0),
        st.staged.staging_bytes as f64 / 1e6
    );
    println!(
        "all arms: {} reads direct, {} buffered, {} fallbacks",
        st.reads_direct(),
        st.reads_buffered(),
        st.fallbacks_total()
    );
    for w in engine.warnings() {
        println!("warning: {w}");
    }
    if !failures.is_empty() {
        return Err(format!(
            "reads fell back or were staged where none should be:\n  {}",
            failures.join("\n  ")
        )
        .into());
    }
    Ok(())
}

/// Each step's reads: one layer's TOP_K experts' projections, chosen by a
/// fixed pseudo-random router.
struct Plan<'m> {
    steps: Vec<Vec<&'m TensorRef>>,
}

impl<'m> Plan<'m> {
    fn new(model: &'m Model, steps: usize) -> Result<Self> {
        let tensors = model.catalog().tensors();
        let expert = |l: usize, e: usize| -> Vec<&'m TensorRef> {
            let prefix = format!("model.layers.{l}.mlp.experts.{e}.");
            tensors.iter().filter(|t| t.name.starts_with(&prefix)).collect()
        };
        let layers = (0..).take_while(|&l| !expert(l, 0).is_empty()).count();
        let per_layer = (0..).take_while(|&e| !expert(0, e).is_empty()).count();
        if layers == 0 || per_layer < TOP_K {
            return Err(format!("need {TOP_K} experts a layer, the model has {per_layer}").into());
        }
        let mut rng = 0x9e37_79b9_7f4a_7c15u64;
        let steps = (0..steps)
            .map(|k| {
                let mut chosen = Vec::new();
                while chosen.len() < TOP_K {
                    rng ^= rng << 13;
                    rng ^= rng >> 7;
                    rng ^= rng << 17;
                    let e = (rng % per_layer as u64) as usize;
                    if !chosen.contains(&e) {
                        chosen.push(e);
                    }
                }
                chosen.into_iter().flat_map(|e| expert(k % layers, e)).collect()
            })
            .collect();
        Ok(Plan { steps })
    }

    fn reads_bytes(&self) -> usize {
        (0..self.steps.len()).map(|k| self.step_bytes(k)).sum()
    }

    fn reads(&self) -> usize {
        self.steps.iter().map(Vec::len).sum()
    }

    fn step_bytes(&self, k: usize) -> usize {
        self.steps[k].iter().map(|t| t.len as usize).sum()
    }

    /// Bytes of memory one step needs placed, for the worst step.
    fn placed_bytes(&self, engine: &Engine) -> Result<usize> {
        let mut most = 0;
        for s in &self.steps {
            most = most.max(engine.placement_bytes(s)?);
        }
        Ok(most)
    }
}

/// The engine's "compute" on a step: every byte checked. Its CPU time is
/// kept apart (`COMPUTE_NS`) so the arms' CPU per GB is the reading's.
fn compute(spec: &SynthSpec, name: &str, bytes: &[u8]) -> Result<()> {
    if !CHECK.load(std::sync::atomic::Ordering::Relaxed) {
        return Ok(());
    }
    let (t0, w0) = (thread_cpu_ns(), Instant::now());
    let ok = synth::verify(spec.seed, name, bytes);
    COMPUTE_NS.fetch_add(thread_cpu_ns() - t0, std::sync::atomic::Ordering::Relaxed);
    COMPUTE_WALL_NS.fetch_add(w0.elapsed().as_nanos() as u64, std::sync::atomic::Ordering::Relaxed);
    if !ok {
        return Err(format!("{name}: wrong bytes").into());
    }
    Ok(())
}

static COMPUTE_NS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
static COMPUTE_WALL_NS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
static CHECK: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(true);

fn thread_cpu_ns() -> u64 {
    let t = rustix::time::clock_gettime(rustix::time::ClockId::ThreadCPUTime);
    t.tv_sec as u64 * 1_000_000_000 + t.tv_nsec as u64
}

/// Waits for a step's reads (timed), then computes on them.
fn wait_then_compute<K: Landing>(spec: &SynthSpec, tickets: Vec<K>) -> Result<Duration> {
    let t0 = Instant::now();
    let landed = tickets
        .into_iter()
        .map(K::land)
        .collect::<weightstream::Result<Vec<_>>>()?;
    let waited = t0.elapsed();
    for l in &landed {
        compute(spec, K::name(l), l)?;
    }
    Ok(waited)
}

/// A ticket of either kind (the engine's, or one into lent memory).
trait Landing {
    type Landed: std::ops::Deref<Target = [u8]>;
    fn land(self) -> weightstream::Result<Self::Landed>;
    fn name(l: &Self::Landed) -> &str;
}

impl Landing for weightstream::Ticket {
    type Landed = weightstream::Loaded;
    fn land(self) -> weightstream::Result<Self::Landed> {
        self.wait()
    }
    fn name(l: &Self::Landed) -> &str {
        l.name()
    }
}

impl<'s> Landing for weightstream::LentTicket<'s> {
    type Landed = weightstream::LentLoaded<'s>;
    fn land(self) -> weightstream::Result<Self::Landed> {
        self.wait()
    }
    fn name(l: &Self::Landed) -> &str {
        l.name()
    }
}

/// Runs the double-buffered loop: `issue(k, half)` starts step k's reads
/// into buffer `half` and returns the tickets, which `finish` waits for
/// (returning how long it waited) and computes on.
fn double_buffered<T>(
    plan: &Plan<'_>,
    mut issue: impl FnMut(usize, usize) -> Result<T>,
    mut finish: impl FnMut(T) -> Result<Duration>,
) -> Result<Vec<Duration>> {
    let mut waits = Vec::new();
    let mut next = Some(issue(0, 0)?);
    for k in 0..plan.steps.len() {
        let now = next.take().expect("issued");
        // Step k+1 goes in flight before step k is waited on.
        if k + 1 < plan.steps.len() {
            next = Some(issue(k + 1, (k + 1) % 2)?);
        }
        waits.push(finish(now)?);
    }
    Ok(waits)
}

fn arena_arm(engine: &Engine, plan: &Plan<'_>, spec: &SynthSpec) -> Result<Vec<Duration>> {
    // Two steps in flight (double buffering), sized by the arena's rule.
    let largest = plan
        .steps
        .iter()
        .max_by_key(|s| s.iter().map(|t| t.len).sum::<u64>())
        .ok_or("no steps")?;
    let arena = engine.packed_arena_for(largest, 2, true)?;
    double_buffered(
        plan,
        |k, _| {
            let mut reads = Vec::new();
            for t in &plan.steps[k] {
                reads.push((*t, arena.take_for(t)?));
            }
            Ok(engine.read_batch(reads)?)
        },
        |tickets| wait_then_compute(spec, tickets),
    )
}

/// A page-aligned buffer of the caller's, on 2 MiB pages (as a C engine's
/// or a GPU runtime's pinned host buffer would be): fresh zeroed memory
/// (calloc: its pages are not touched before the reads land), aligned to
/// 2 MiB by hand and advised `MADV_HUGEPAGE` (the caller's choice; this
/// crate never advises memory it is lent). On 4 KiB pages the same loop
/// waits about 1.27x the arena's on memloop (the benchmark record).
struct Aligned {
    block: NonNull<u8>,
    layout: std::alloc::Layout,
    ptr: NonNull<u8>,
}

impl Aligned {
    fn new(len: usize) -> Result<Self> {
        const HUGE: usize = 2 << 20;
        let layout = std::alloc::Layout::from_size_align(len + HUGE, 16)?;
        // SAFETY: a valid layout of non-zero size.
        let block = NonNull::new(unsafe { std::alloc::alloc_zeroed(layout) }).ok_or("allocation")?;
        let skip = (block.as_ptr() as usize).next_multiple_of(HUGE) - block.as_ptr() as usize;
        // SAFETY: `skip` < 2 MiB, so `len` bytes from there stay inside the block.
        let ptr = unsafe { NonNull::new_unchecked(block.as_ptr().add(skip)) };
        // SAFETY: advice on whole 2 MiB pages of our own live allocation;
        // MADV_HUGEPAGE changes no contents. A refusal only costs speed.
        let _ = unsafe {
            rustix::mm::madvise(
                ptr.as_ptr().cast(),
                len & !(HUGE - 1),
                rustix::mm::Advice::LinuxHugepage,
            )
        };
        Ok(Aligned { block, layout, ptr })
    }
}

impl Drop for Aligned {
    fn drop(&mut self) {
        // SAFETY: allocated in `new` with this layout.
        unsafe { std::alloc::dealloc(self.block.as_ptr(), self.layout) }
    }
}

fn aligned_arm(engine: &Engine, plan: &Plan<'_>, spec: &SynthSpec) -> Result<Vec<Duration>> {
    let half = plan.placed_bytes(engine)?;
    let bufs = [Aligned::new(half)?, Aligned::new(half)?];
    // SAFETY: both buffers outlive their arenas and every ticket and
    // `Loaded` from them (all dropped inside this function, before the
    // buffers); nothing touches the buffers but those slots; each is lent
    // to one arena.
    let mems = unsafe {
        [
            engine.register_memory(bufs[0].ptr, half)?,
            engine.register_memory(bufs[1].ptr, half)?,
        ]
    };
    let waits = double_buffered(
        plan,
        |k, h| {
            let p = engine.placement(&plan.steps[k], &mems[h])?;
            let mut tickets = Vec::new();
            for (t, &at) in plan.steps[k].iter().zip(p.offsets()) {
                tickets.push(engine.read_into(t, &mems[h], at, Scratch::Blocks)?);
            }
            Ok(tickets)
        },
        |tickets| wait_then_compute(spec, tickets),
    )?;
    for m in mems {
        m.release(Duration::from_secs(60))
            .map_err(|_| "caller memory still in use")?;
    }
    Ok(waits)
}

fn vec_arm(engine: &Engine, plan: &Plan<'_>, spec: &SynthSpec) -> Result<Vec<Duration>> {
    // One Vec, two halves: step k lands in half k % 2.
    let half = plan.placed_bytes(engine)?;
    let mut buf = vec![0u8; 2 * half];
    engine.lend(&mut buf, |mem| {
        double_buffered(
            plan,
            |k, h| {
                let p = mem.placement_from(&plan.steps[k], h * half)?;
                let mut tickets = Vec::new();
                for (t, &at) in plan.steps[k].iter().zip(p.offsets()) {
                    tickets.push(mem.read_into(t, at, Scratch::Blocks)?);
                }
                Ok(tickets)
            },
            |tickets| wait_then_compute(spec, tickets),
        )
    })?
}

fn fixed_arm(engine: &Engine, plan: &Plan<'_>, spec: &SynthSpec) -> Result<Vec<Duration>> {
    // The engine's tensor storage: each payload at a page boundary.
    let slot = |t: &TensorRef| (t.len as usize).next_multiple_of(4096);
    let half = plan
        .steps
        .iter()
        .map(|s| s.iter().map(|t| slot(t)).sum::<usize>())
        .max()
        .unwrap_or(0);
    let mut buf = vec![0u8; 2 * half + 4096];
    engine.lend(&mut buf, |mem| {
        let first = mem.addr().next_multiple_of(4096) - mem.addr();
        double_buffered(
            plan,
            |k, h| {
                let mut at = first + h * half;
                let mut tickets = Vec::new();
                for t in &plan.steps[k] {
                    tickets.push(mem.read_into(t, at, Scratch::None)?);
                    at += slot(t);
                }
                Ok(tickets)
            },
            |tickets| wait_then_compute(spec, tickets),
        )
    })?
}

/// Read and fallback counts between two snapshots.
#[derive(Debug)]
#[allow(dead_code)] // read through Debug in the failure message
struct Counts {
    fallbacks: u64,
    buffered: u64,
    direct: u64,
    staged: u64,
}

impl Counts {
    fn between(a: &Stats, b: &Stats) -> Self {
        Counts {
            fallbacks: b.fallbacks_total() - a.fallbacks_total(),
            buffered: b.reads_buffered() - a.reads_buffered(),
            direct: b.reads_direct() - a.reads_direct(),
            staged: b.staged.reads - a.staged.reads,
        }
    }
}

/// CPU seconds of this process so far (every thread's, the I/O threads'
/// and io-wq workers' included), less the compute's.
fn process_cpu_s() -> f64 {
    let t = rustix::time::clock_gettime(rustix::time::ClockId::ProcessCPUTime);
    let compute = COMPUTE_NS.load(std::sync::atomic::Ordering::Relaxed) as f64 * 1e-9;
    t.tv_sec as f64 + t.tv_nsec as f64 * 1e-9 - compute
}
