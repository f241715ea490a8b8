//! `weightstream load`: a whole model into memory, by weightstream's
//! `load_all` or by the loaders it replaces, with what each cost: wall
//! time, CPU, peak resident memory and page-cache growth.
//!
//! Every method ends holding every selected tensor's bytes in memory the
//! process can read (the `mmap` method's are the page cache's pages), so
//! peak RSS compares like with like. The timed region starts before the
//! model's headers are read and ends when the last payload is in memory;
//! `--digest` hashes afterwards, untimed.

use std::collections::BTreeMap;
use std::io::{IsTerminal, Write};
use std::path::{Path, PathBuf};
use std::time::Instant;

use sha2::{Digest, Sha256};
use weightstream::__internal::escape;
use weightstream::{Engine, LoadOptions, Model, Order};

use crate::args::alloc_flags;

use crate::bench::page_cache_bytes;
use crate::cli::{EngineArgs, LayoutArgs, LoadMemory, LoadMethod};
use crate::commands::digest::hex;
use crate::commands::CliResult;

/// The command's options (beyond the engine's and the layout's).
pub(crate) struct LoadArgs {
    pub(crate) method: LoadMethod,
    pub(crate) names: Vec<String>,
    pub(crate) align: usize,
    pub(crate) order: Order,
    pub(crate) populate: bool,
    pub(crate) register: bool,
    pub(crate) fault_ahead: Option<bool>,
    pub(crate) fault_ahead_threads: Option<usize>,
    pub(crate) memory: LoadMemory,
    pub(crate) digest: bool,
    pub(crate) json: bool,
}

/// What one load cost (`--json` prints it).
#[derive(Debug, serde::Serialize)]
struct LoadRecord {
    method: LoadMethod,
    /// weightstream only: `fresh` (a new mapping), `reused` (memory a
    /// previous load wrote; the timed region is the second load alone) or
    /// `faulted` (memory faulted in, never read into).
    #[serde(skip_serializing_if = "Option::is_none")]
    memory: Option<LoadMemory>,
    /// `--memory reused`: the first, untimed load into the memory (while it
    /// was still fresh), seconds.
    #[serde(skip_serializing_if = "Option::is_none")]
    first_load_seconds: Option<f64>,
    model_dir: PathBuf,
    tensors: usize,
    /// Payload bytes loaded.
    bytes: u64,
    /// Opening the model (headers) through the last payload in memory.
    seconds: f64,
    /// Payload GB (10^9 bytes) per second of `seconds`.
    gbps: f64,
    /// Of `seconds`: `Model::open` (every header read and validated).
    open_seconds: f64,
    /// Of `seconds`: `Engine::new` (weightstream only: rings, fixed files,
    /// the submit probe).
    engine_seconds: f64,
    /// Process CPU seconds over the timed region (getrusage: io-wq workers
    /// included).
    cpu_seconds: f64,
    cpu_seconds_per_gb: f64,
    /// The whole machine's busy CPU seconds over the timed region
    /// (`/proc/stat`, every CPU): the kernel threads that work for the
    /// reads (a memloop drive's loop worker) count here and not in
    /// `cpu_seconds`; so does anything else running. `None` without
    /// `/proc/stat`.
    busy_cpu_seconds: Option<f64>,
    /// Of `busy_cpu_seconds`: the host's steal (a virtual machine's CPUs
    /// runnable while its host ran something else). Large steal means the
    /// figure was paced by other tenants as well as by this load.
    steal_seconds: Option<f64>,
    /// Peak resident set of the process (ru_maxrss), over its whole life.
    peak_rss_bytes: u64,
    /// Resident set when the timed region started (the binary, its heap).
    rss_start_bytes: u64,
    /// `Cached` of /proc/meminfo after minus before (the whole machine's:
    /// other processes' I/O shows up too).
    page_cache_growth_bytes: i64,
    /// weightstream only: the load's own report (mapping time, in place
    /// and placed payloads) and the engine's stats.
    #[serde(skip_serializing_if = "Option::is_none")]
    report: Option<weightstream::LoadReport>,
    #[serde(skip_serializing_if = "Option::is_none")]
    stats: Option<weightstream::Stats>,
}

/// The tensors a method ended with: name -> payload bytes (borrowed from
/// wherever the method keeps them).
type Payloads<'a> = BTreeMap<String, &'a [u8]>;

/// Each selected tensor's name and byte range within a shard's bytes.
type Ranges = Vec<(String, std::ops::Range<usize>)>;

pub(crate) fn load(dir: &Path, args: &LoadArgs, engine_args: &EngineArgs, layout: &LayoutArgs) -> CliResult {
    if args.memory != LoadMemory::Fresh && args.method != LoadMethod::Weightstream {
        return Err(
            "load: --memory reused and faulted are weightstream's (Engine::load_all_into); the other methods allocate"
                .into(),
        );
    }
    let cache0 = page_cache_bytes();
    let rss0 = current_rss_bytes();
    let machine = crate::ceiling::machine_cpu;
    let mut cpu0 = crate::ceiling::process_cpu_seconds();
    let mut machine0 = machine();
    let mut t0 = Instant::now();
    let model = Model::open(layout.config(dir, None)?)?;
    let _said = crate::warnings::Watch(|| model.warnings());
    let open_seconds = t0.elapsed().as_secs_f64();
    let mut engine_seconds = 0.0;
    let selected = |name: &str| args.names.is_empty() || args.names.iter().any(|n| name.contains(n.as_str()));
    let (count, total) = model
        .catalog()
        .tensors()
        .iter()
        .filter(|t| selected(&t.name))
        .fold((0usize, 0u64), |(n, b), t| (n + 1, b.saturating_add(t.len)));
    // A --name in no tensor name is a mistake (a typo loads less than
    // asked, silently), even when the other names select tensors; nothing
    // selected is never a load of nothing reported per GB of nothing.
    let unmatched: Vec<&String> = args
        .names
        .iter()
        .filter(|n| !model.catalog().tensors().iter().any(|t| t.name.contains(n.as_str())))
        .collect();
    if count == 0 || !unmatched.is_empty() {
        let n = model.catalog().tensors().len();
        return Err(if args.names.is_empty() {
            format!("load: the model in {} has no tensors", escape(dir))
        } else {
            let shown: Vec<String> = unmatched.iter().map(|n| format!("{n:?}")).collect();
            format!(
                "load: --name {}: no tensor name contains {} (the model in {} has {n} tensor(s); \
                 `weightstream inspect --tensors` lists them){}",
                shown.join(", --name "),
                if unmatched.len() == 1 { "it" } else { "any of them" },
                escape(dir),
                // A hint for the first: the others are most often alike.
                unmatched
                    .first()
                    .map_or(String::new(), |f| crate::suggest::no_match_hint(
                        f,
                        model.catalog().tensors().iter().map(|t| t.name.as_str())
                    ))
            )
        }
        .into());
    }
    let bar = ProgressBar::new(!args.json && std::io::stderr().is_terminal(), total);

    // Each arm keeps what it loaded alive until the measurements are taken.
    let mut report = None;
    let mut stats = None;
    let engine;
    let memory;
    let mut first_load_seconds = None;
    let loaded;
    let owned: Vec<(String, Vec<u8>)>;
    let files: Vec<(Vec<u8>, Ranges)>;
    let maps: Vec<(memmap2::Mmap, Ranges)>;
    let payloads: Payloads<'_> = match args.method {
        LoadMethod::Weightstream => {
            let Some(cfg) = engine_args.config()? else {
                return Err("load: the sync backend has no engine; use auto, uring or pread".into());
            };
            let t = Instant::now();
            engine = Engine::new(&model, cfg)?;
            engine_seconds = t.elapsed().as_secs_f64();
            let _said = crate::warnings::Watch(|| engine.warnings());
            let mut opts = LoadOptions::new()
                .align(args.align)
                .order(args.order)
                .populate(args.populate)
                .register(args.register)
                .names_containing(args.names.iter().cloned());
            if let Some(on) = args.fault_ahead {
                opts = opts.fault_ahead(on);
            }
            if let Some(n) = args.fault_ahead_threads {
                opts = opts.fault_ahead_threads(n);
            }
            let b = bar.clone();
            opts = opts.progress(move |p| b.set(p.bytes));
            let flags = |e| alloc_flags(e, "--name selects the tensors loaded, --align pads them");
            loaded = match args.memory {
                LoadMemory::Fresh => engine.load_all(&opts).map_err(flags)?,
                LoadMemory::Reused | LoadMemory::Faulted => {
                    // Registered: memory kept for reloads pays its pinning
                    // once, then every read is a fixed-buffer read (zram,
                    // where the CPU is the limit: 1.02 of fio's run against
                    // 0.87 unregistered, 6 interleaved rounds). Faulted:
                    // populated first (a write to every page, untimed).
                    let faulted = args.memory == LoadMemory::Faulted;
                    memory = engine.packed_arena(engine.load_bytes(&opts)?, faulted).map_err(flags)?;
                    if !faulted {
                        // Reused: the engine's previous load writes every
                        // page of the memory, untimed; the timed load is
                        // the files' second read in a row.
                        let first = engine.load_all_into(&opts, &memory)?;
                        first_load_seconds = Some(first.report().seconds);
                        drop(first);
                    }
                    cpu0 = crate::ceiling::process_cpu_seconds();
                    machine0 = machine();
                    t0 = Instant::now();
                    engine.load_all_into(&opts, &memory)?
                }
            };
            report = Some(loaded.report().clone());
            stats = Some(engine.stats());
            loaded.iter().map(|t| (t.name().to_string(), t.bytes())).collect()
        }
        LoadMethod::SafetensorsMmap => {
            let mut v = Vec::new();
            for shard in model.catalog().shards() {
                let map = map_file(&shard.path)?;
                let st = safetensors::SafeTensors::deserialize(&map)
                    .map_err(|e| format!("{}: {e}", shard.path.display()))?;
                for (name, view) in st.tensors() {
                    if selected(&name) {
                        // What candle-style loaders do: an owned copy of each tensor.
                        let bytes = view.data().to_vec();
                        bar.add(bytes.len() as u64);
                        v.push((name, bytes));
                    }
                }
            }
            owned = v;
            owned.iter().map(|(n, b)| (n.clone(), &b[..])).collect()
        }
        LoadMethod::FsRead => {
            let mut v = Vec::new();
            for shard in model.catalog().shards() {
                let bytes = std::fs::read(&shard.path).map_err(|e| format!("{}: {e}", shard.path.display()))?;
                bar.add(bytes.len() as u64);
                let ranges = tensor_ranges(&bytes, &shard.path, &selected)?;
                v.push((bytes, ranges));
            }
            files = v;
            files
                .iter()
                .flat_map(|(b, r)| r.iter().map(move |(n, r)| (n.clone(), &b[r.clone()])))
                .collect()
        }
        LoadMethod::Mmap => {
            let mut v = Vec::new();
            for shard in model.catalog().shards() {
                let map = map_file(&shard.path)?;
                let ranges = tensor_ranges(&map, &shard.path, &selected)?;
                // Touch every page of every payload so it is really read.
                for (_, r) in &ranges {
                    touch(&map[r.clone()]);
                    bar.add(r.len() as u64);
                }
                v.push((map, ranges));
            }
            maps = v;
            maps.iter()
                .flat_map(|(m, r)| r.iter().map(move |(n, r)| (n.clone(), &m[r.clone()])))
                .collect()
        }
    };
    let seconds = t0.elapsed().as_secs_f64();
    let cpu_seconds = crate::ceiling::process_cpu_seconds() - cpu0;
    let machine1 = machine();
    let (busy_cpu_seconds, steal_seconds) = match (&machine0, &machine1) {
        (Some(a), Some(b)) => {
            let (busy, steal) = b.since(a);
            (Some(busy), Some(steal))
        }
        _ => (None, None),
    };
    let peak_rss_bytes = crate::ceiling::peak_rss_bytes();
    let page_cache_growth_bytes = page_cache_bytes() - cache0;
    bar.finish();
    let bytes: u64 = payloads.values().map(|p| p.len() as u64).sum();
    let record = LoadRecord {
        method: args.method,
        memory: (args.method == LoadMethod::Weightstream).then_some(args.memory),
        first_load_seconds,
        model_dir: dir.to_path_buf(),
        tensors: payloads.len(),
        bytes,
        seconds,
        gbps: bytes as f64 / 1e9 / seconds.max(1e-9),
        open_seconds,
        engine_seconds,
        cpu_seconds,
        cpu_seconds_per_gb: cpu_seconds / (bytes as f64 / 1e9).max(1e-9),
        busy_cpu_seconds,
        steal_seconds,
        peak_rss_bytes,
        rss_start_bytes: rss0,
        page_cache_growth_bytes,
        report,
        stats,
    };
    let sums: Option<BTreeMap<&str, String>> = args.digest.then(|| {
        payloads
            .iter()
            .map(|(n, p)| (n.as_str(), hex(&Sha256::digest(p))))
            .collect()
    });
    if args.json {
        let mut v = serde_json::to_value(&record)?;
        if let Some(s) = sums {
            v["tensors_sha256"] = serde_json::to_value(s)?;
        }
        println!("{}", serde_json::to_string_pretty(&v)?);
    } else if let Some(s) = sums {
        let mut out = std::io::stdout().lock();
        for (n, h) in s {
            writeln!(out, "{h}  {n}")?;
        }
    } else {
        print_record(&record);
    }
    Ok(())
}

fn print_record(r: &LoadRecord) {
    let gb = |b: u64| b as f64 / 1e9;
    println!(
        "{:?}: {} tensors, {:.3} GB in {:.3} s = {:.2} GB/s; CPU {:.2} s ({:.2} s/GB); peak RSS {:.3} GB ({:.2}x the payload); page cache {:+.3} GB",
        r.method,
        r.tensors,
        gb(r.bytes),
        r.seconds,
        r.gbps,
        r.cpu_seconds,
        r.cpu_seconds_per_gb,
        gb(r.peak_rss_bytes),
        r.peak_rss_bytes as f64 / (r.bytes.max(1)) as f64,
        r.page_cache_growth_bytes as f64 / 1e9,
    );
    if let (Some(busy), Some(steal)) = (r.busy_cpu_seconds, r.steal_seconds) {
        println!(
            "  the machine meanwhile: {busy:.2} busy CPU seconds ({:.2} s/GB; loop workers and softirqs included), \
             of them {steal:.2} the host's steal",
            busy / gb(r.bytes).max(1e-9)
        );
    }
    if let Some(rep) = &r.report {
        println!(
            "  mapping {:.3} s of {:.3} s; faulted in ahead of the reads: {}; {} payloads in place, {} placed (buffered: file offset not aligned as asked); {} bytes mapped",
            rep.arena_seconds,
            rep.seconds,
            if rep.faulted_ahead {
                format!("in {:.3} s on {} helper(s)", rep.fault_ahead_seconds, rep.fault_ahead_threads)
            } else {
                "no".to_string()
            },
            rep.in_place,
            rep.placed,
            rep.mapped_bytes
        );
    }
}

/// A read-only mapping of `path`.
fn map_file(path: &Path) -> Result<memmap2::Mmap, String> {
    let f = std::fs::File::open(path).map_err(|e| format!("{}: {e}", path.display()))?;
    // SAFETY: the mapping is private to this process and read only; the
    // shard is not written while the command runs (a file truncated under
    // it would fault, as it would for any mmap loader this arm stands for).
    unsafe { memmap2::Mmap::map(&f) }.map_err(|e| format!("{}: mmap: {e}", path.display()))
}

/// Every selected tensor's byte range in a whole shard's bytes, by the
/// safetensors crate's parse.
fn tensor_ranges(bytes: &[u8], path: &Path, selected: &dyn Fn(&str) -> bool) -> Result<Ranges, String> {
    let (n, meta) = safetensors::SafeTensors::read_metadata(bytes).map_err(|e| format!("{}: {e}", path.display()))?;
    let start = 8 + n;
    Ok(meta
        .tensors()
        .into_iter()
        .filter(|(name, _)| selected(name))
        .map(|(name, info)| (name, start + info.data_offsets.0..start + info.data_offsets.1))
        .collect())
}

/// Reads one byte of every page of `b` (so a mapping is faulted in).
fn touch(b: &[u8]) {
    let mut sum = 0u8;
    for i in (0..b.len()).step_by(4096) {
        sum = sum.wrapping_add(b[i]);
    }
    std::hint::black_box(sum);
}

/// Resident set of this process now (`VmRSS` of /proc/self/status), bytes.
fn current_rss_bytes() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("VmRSS:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        })
        .map_or(0, |kb| kb * 1024)
}

/// indicatif's bar on a terminal (bytes, rate, time left); nothing
/// otherwise. Cheap to clone into the load's progress callback.
#[derive(Clone)]
struct ProgressBar(Option<indicatif::ProgressBar>);

impl ProgressBar {
    fn new(show: bool, total: u64) -> Self {
        ProgressBar(show.then(|| {
            let b = indicatif::ProgressBar::new(total);
            b.set_style(
                indicatif::ProgressStyle::with_template(
                    "{bar:40} {bytes}/{total_bytes} {binary_bytes_per_sec} eta {eta}",
                )
                .expect("a valid template"),
            );
            b
        }))
    }

    fn set(&self, bytes: u64) {
        if let Some(b) = &self.0 {
            b.set_position(bytes);
        }
    }

    fn add(&self, bytes: u64) {
        if let Some(b) = &self.0 {
            b.inc(bytes);
        }
    }

    fn finish(&self) {
        if let Some(b) = &self.0 {
            b.finish_and_clear();
        }
    }
}
