//! The `weightstream` command: inspect a model, digest its tensors through the
//! direct read path, and a demo that shows the point in one command.

use std::io::{IsTerminal, Write};
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Instant;

use bench::{Arm, BenchConfig};
use ceiling::{Buffers, ReadConfig, Submit, SweepConfig};
use clap::{Parser, Subcommand};
use sha2::{Digest, Sha256};
use weightstream::escape;
use weightstream::{Arena, DirectMode, Engine, EngineConfig, Model, ModelConfig};
use weightstream_synth::{self as synth, SynthSpec};

mod bench;
mod ceiling;
mod error;
mod plot;

#[derive(Parser)]
#[command(
    name = "weightstream",
    version,
    about = "Stream model weights from NVMe into engine memory"
)]
struct Cli {
    /// More logging (-v info, -vv debug); WEIGHTSTREAM_LOG overrides.
    #[arg(short, long, action = clap::ArgAction::Count, global = true)]
    verbose: u8,
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Shards, tensors, bytes, and for each file its filesystem, device, O_DIRECT alignment and whether O_DIRECT opens.
    Inspect {
        model_dir: PathBuf,
        #[command(flatten)]
        layout: LayoutArgs,
        /// NUMA placement shown per drive: on (hwloc, or WEIGHTSTREAM_NUMA_XML) or off (default: WEIGHTSTREAM_NUMA or on).
        #[arg(long)]
        numa: Option<String>,
        #[arg(long)]
        json: bool,
    },
    /// sha256 of every tensor (or the named ones), read through the in-place path; sha256sum format, sorted by name.
    Digest {
        model_dir: PathBuf,
        /// Only these tensors (repeatable).
        #[arg(long = "tensor")]
        tensors: Vec<String>,
        /// O_DIRECT: auto (where possible, fallbacks counted), on (refuse files that cannot open O_DIRECT), off.
        #[arg(long, default_value = "auto")]
        direct: DirectMode,
        #[command(flatten)]
        engine: EngineArgs,
        #[command(flatten)]
        layout: LayoutArgs,
        #[arg(long)]
        json: bool,
    },
    /// Re-check a model's files: each copy opened, proven and re-read (header), with --digest every tensor
    /// of every copy hashed (mirror copies compared with the primary), with --against compared with an
    /// earlier `verify --json` record (inode, size, ctime, header, digests). Exit status 0: nothing changed;
    /// 1: something changed (each file named with what changed); 2: the check could not run.
    Verify {
        model_dir: PathBuf,
        /// Hash every tensor of every copy (reads the whole model, buffered, page cache dropped after).
        #[arg(long)]
        digest: bool,
        /// A report saved by an earlier `verify --json` (with --digest, to compare payloads too).
        #[arg(long)]
        against: Option<PathBuf>,
        #[command(flatten)]
        layout: LayoutArgs,
        /// The report as JSON (save it to compare against later).
        #[arg(long)]
        json: bool,
    },
    /// The device ceiling: a sweep of O_DIRECT io_uring read configurations (block size, depth, readers,
    /// inline or async submission, plain or registered buffers) on each drive alone, the best and the
    /// configuration that reached it per drive, then all drives at once with their best.
    Ceiling {
        #[arg(required = true)]
        paths: Vec<PathBuf>,
        /// 8 configurations, up to 1 GiB or 0.25 s each (default: 32, up to 2 GiB or 0.5 s each).
        #[arg(long)]
        quick: bool,
        /// Block sizes to try, comma-separated (e.g. 1MiB,4MiB); each dimension given replaces the sweep's values.
        #[arg(long, value_delimiter = ',', value_parser = parse_bytes)]
        bs: Vec<u64>,
        /// Reads in flight per reader, comma-separated (e.g. 16,64).
        #[arg(long, value_delimiter = ',')]
        qd: Vec<usize>,
        /// Reader threads per drive, each with its own ring (e.g. 1,2).
        #[arg(long, value_delimiter = ',')]
        readers: Vec<usize>,
        /// inline and/or async (IOSQE_ASYNC on every read, fio --force_async=1).
        #[arg(long, value_delimiter = ',')]
        submit: Vec<String>,
        /// plain and/or fixed (registered buffers, ReadFixed; fio --fixedbufs=1).
        #[arg(long, value_delimiter = ',')]
        buffers: Vec<String>,
        /// Byte cap per configuration and drive (files are read round again if smaller).
        #[arg(long, value_parser = parse_bytes)]
        bytes: Option<u64>,
        /// Time cap per configuration, seconds.
        #[arg(long)]
        seconds: Option<f64>,
        /// Read into 4 KiB pages (as fio's default buffers) instead of huge pages (MADV_HUGEPAGE).
        #[arg(long)]
        small_pages: bool,
        #[arg(long)]
        json: bool,
    },
    /// Write a synthetic MoE model (safetensors' own serializer; deterministic content from a seed).
    Gen {
        model_dir: PathBuf,
        /// Approximate total size.
        #[arg(long, default_value = "4GiB", value_parser = parse_bytes)]
        size: u64,
        #[arg(long, default_value_t = 8)]
        layers: usize,
        /// Experts per layer (default: from --size).
        #[arg(long)]
        experts: Option<usize>,
        /// Bytes of each expert projection (gate, up, down).
        #[arg(long, default_value = "19MiB", value_parser = parse_bytes)]
        expert_bytes: u64,
        #[arg(long, default_value_t = 4)]
        shards: usize,
        #[arg(long, default_value_t = 0x5eed)]
        seed: u64,
    },
    /// Read every expert in a seeded random order through several arms, interleaved, cold cache; ratios to the
    /// ceiling and to fio's best in the same run.
    Bench {
        model_dir: PathBuf,
        /// Arms, in the order they run each round (ceiling, fio, engine, engine-hash, engine-stripe,
        /// engine-adaptive, pread, buffered, mmap).
        #[arg(long, default_value = "ceiling,fio,engine,pread,buffered,mmap")]
        arms: String,
        /// The ceiling's and fio's sweep each run: quick (8 configurations) or full (32).
        #[arg(long, default_value = "quick")]
        sweep: String,
        /// The ceiling reads into 4 KiB pages (as fio's default buffers) instead of huge pages.
        #[arg(long)]
        small_pages: bool,
        #[arg(long, default_value_t = 3)]
        runs: usize,
        /// Reads in flight (1 = one expert at a time, decode-like).
        #[arg(long, default_value_t = 8)]
        concurrency: usize,
        /// Order seed.
        #[arg(long, default_value_t = 1)]
        seed: u64,
        /// Tensors whose name contains this.
        #[arg(long, default_value = ".experts.")]
        filter: String,
        #[command(flatten)]
        engine: EngineArgs,
        #[command(flatten)]
        layout: LayoutArgs,
        /// Read the whole order this many times per run.
        #[arg(long, default_value_t = 1)]
        passes: usize,
        /// Sample per-drive bytes every MS milliseconds during engine arms (JSON: runs[].timeline).
        #[arg(long)]
        timeline_ms: Option<u64>,
        /// Write a bar chart of GB/s per arm (SVG).
        #[arg(long)]
        plot: Option<PathBuf>,
        #[arg(long)]
        json: bool,
    },
    /// Draw a chart for a benchmark record from a JSON spec: {"title", "xlabel", "ylabel",
    /// "series": [{"name", "points": [[x, y], ...]}]} (lines), or {"title", "unit", "bars": [[label, value], ...],
    /// "reference": y} (bars). Writes SVG.
    #[command(hide = true)]
    Plot { spec: PathBuf, out: PathBuf },
    /// Write a synthetic MoE model, read every expert through weightstream, verify every byte, remove it.
    Demo {
        /// Where to write the model (default: a temporary directory).
        #[arg(long)]
        dir: Option<PathBuf>,
        /// Approximate model size (e.g. 300MB, 1GiB).
        #[arg(long, default_value = "320MiB", value_parser = parse_bytes)]
        size: u64,
        /// Keep the model directory afterwards.
        #[arg(long)]
        keep: bool,
    },
}

/// Where the model's bytes live, shared by the commands that open a model.
/// Each flag overrides its environment variable.
#[derive(clap::Args, Debug, Default)]
struct LayoutArgs {
    /// Extra directories searched for shards after the primary (`;` or `,`
    /// separated; WEIGHTSTREAM_MODEL_DIRS).
    #[arg(long)]
    dirs: Option<String>,
    /// Mirror directories holding copies of any subset of the shards
    /// (WEIGHTSTREAM_MIRROR).
    #[arg(long)]
    mirror: Option<String>,
    /// Read weights per copy, primary first (e.g. 1,1 or 3,1), or probe
    /// (WEIGHTSTREAM_DISK_WEIGHTS).
    #[arg(long)]
    weights: Option<String>,
    /// hash | stripe | adaptive (WEIGHTSTREAM_ROUTE; default adaptive).
    #[arg(long)]
    route: Option<String>,
}

impl LayoutArgs {
    /// The model configuration: each flag given shadows its variable.
    fn config(&self, dir: &std::path::Path, direct: Option<DirectMode>) -> Result<ModelConfig, weightstream::Error> {
        let c = ModelConfig::new(dir).settings(|k| {
            let flag = match k {
                "WEIGHTSTREAM_MODEL_DIRS" => &self.dirs,
                "WEIGHTSTREAM_MIRROR" => &self.mirror,
                "WEIGHTSTREAM_DISK_WEIGHTS" => &self.weights,
                "WEIGHTSTREAM_ROUTE" => &self.route,
                // --direct (digest) always says; other commands follow the variable.
                "WEIGHTSTREAM_DIRECT" if direct.is_some() => return None,
                _ => &None,
            };
            flag.clone().or_else(|| weightstream::env::get(k))
        })?;
        Ok(match direct {
            Some(d) => c.direct(d),
            None => c,
        })
    }
}

/// Engine settings shared by the commands that read.
#[derive(clap::Args, Debug)]
struct EngineArgs {
    /// I/O backend: auto (io_uring, else pread), uring, pread, or sync (the
    /// one-read-at-a-time reference path). Default: WEIGHTSTREAM_BACKEND or auto.
    #[arg(long)]
    backend: Option<String>,
    /// Chunks in flight per drive (default: WEIGHTSTREAM_QD or 32).
    #[arg(long)]
    qd: Option<usize>,
    /// Largest chunk, e.g. 1MiB (default: the device's max_sectors_kb, clamped to 1-4 MiB).
    #[arg(long, value_parser = parse_bytes)]
    chunk: Option<u64>,
    /// Reads kept in flight (slots in the arena).
    #[arg(long, default_value_t = 8)]
    inflight: usize,
    /// Kernel-side submission polling (a kernel thread per ring spins; opt-in).
    #[arg(long)]
    sqpoll: bool,
    /// Completion polling, on drives whose queue/io_poll says they poll.
    #[arg(long)]
    iopoll: bool,
    /// How reads are issued per drive: auto (a probe at start: one ring per
    /// CPU on a drive that completes reads inline, like zram; else one
    /// ring), inline, rings:N, or async (IOSQE_ASYNC: io-wq workers issue
    /// the reads). Default: WEIGHTSTREAM_SUBMIT or auto.
    #[arg(long)]
    submit: Option<String>,
    /// NUMA placement: on (bind each drive's I/O threads to its node's CPUs,
    /// prefer local copies) or off (default: WEIGHTSTREAM_NUMA or on).
    #[arg(long)]
    numa: Option<String>,
}

impl EngineArgs {
    /// The engine configuration, or None for the sync reference path.
    fn config(&self) -> Result<Option<EngineConfig>, weightstream::Error> {
        let mut c = EngineConfig::from_env()?;
        if let Some(b) = &self.backend {
            if b.trim().eq_ignore_ascii_case("sync") {
                return Ok(None);
            }
            c.backend = b.parse()?;
        }
        if let Some(q) = self.qd {
            c.queue_depth = q;
        }
        if let Some(ch) = self.chunk {
            c.chunk = Some(ch as usize);
        }
        c.sqpoll |= self.sqpoll;
        if self.iopoll {
            c.iopoll = weightstream::IoPoll::Auto;
        }
        if let Some(v) = &self.submit {
            c.submit = v.parse()?;
        }
        if let Some(v) = &self.numa {
            c.numa = parse_on_off("--numa", v)?;
        }
        Ok(Some(c))
    }
}

fn parse_on_off(what: &str, v: &str) -> Result<bool, weightstream::Error> {
    match v.trim().to_ascii_lowercase().as_str() {
        "on" | "1" | "true" | "yes" => Ok(true),
        "off" | "0" | "false" | "no" => Ok(false),
        other => Err(weightstream::Error::Config(format!(
            "{what} {other:?}: expected on or off"
        ))),
    }
}

fn parse_bytes(s: &str) -> Result<u64, String> {
    let s = s.trim();
    let split = s.find(|c: char| !c.is_ascii_digit() && c != '.').unwrap_or(s.len());
    let (num, unit) = s.split_at(split);
    let num: f64 = num
        .parse()
        .map_err(|_| format!("{s:?}: expected a size such as 4GiB, 300MB or 1048576"))?;
    let mult: u64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kb" => 1_000,
        "kib" => 1 << 10,
        "m" | "mb" => 1_000_000,
        "mib" => 1 << 20,
        "g" | "gb" => 1_000_000_000,
        "gib" => 1 << 30,
        "t" | "tb" => 1_000_000_000_000,
        "tib" => 1 << 40,
        u => return Err(format!("{s:?}: unknown unit {u:?}")),
    };
    Ok((num * mult as f64) as u64)
}

fn main() -> ExitCode {
    // A command-line tool dies quietly when its reader goes away
    // (`weightstream digest ... | head`), instead of panicking in println!.
    // SAFETY: restoring the default disposition of SIGPIPE at the start of
    // main, before any thread exists, races with nothing.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
    let cli = Cli::parse();
    let default = match cli.verbose {
        0 => "warn",
        1 => "info",
        _ => "debug",
    };
    let filter = tracing_subscriber::EnvFilter::try_from_env("WEIGHTSTREAM_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .with_target(false)
        .init();
    let r = match cli.cmd {
        // Its own exit status: 0 nothing changed, 1 changed, 2 could not check.
        Cmd::Verify {
            model_dir,
            digest,
            against,
            layout,
            json,
        } => {
            return match verify(&model_dir, digest, against.as_deref(), &layout, json) {
                Ok(true) => ExitCode::SUCCESS,
                Ok(false) => ExitCode::from(1),
                Err(e) => {
                    eprintln!("{}", error_text(&*e));
                    ExitCode::from(2)
                }
            }
        }
        Cmd::Inspect {
            model_dir,
            layout,
            numa,
            json,
        } => inspect(model_dir, &layout, numa.as_deref(), json),
        Cmd::Digest {
            model_dir,
            tensors,
            direct,
            engine,
            layout,
            json,
        } => digest(model_dir, tensors, direct, &engine, &layout, json),
        Cmd::Ceiling {
            paths,
            quick,
            bs,
            qd,
            readers,
            submit,
            buffers,
            bytes,
            seconds,
            small_pages,
            json,
        } => sweep_config(quick, &bs, &qd, &readers, &submit, &buffers, bytes, seconds).and_then(|mut cfg| {
            cfg.huge_pages = !small_pages;
            ceiling_cmd(paths, &cfg, json)
        }),
        Cmd::Gen {
            model_dir,
            size,
            layers,
            experts,
            expert_bytes,
            shards,
            seed,
        } => gen(model_dir, size, layers, experts, expert_bytes, shards, seed),
        Cmd::Bench {
            model_dir,
            arms,
            sweep,
            small_pages,
            runs,
            concurrency,
            seed,
            filter,
            engine,
            layout,
            passes,
            timeline_ms,
            plot,
            json,
        } => bench_cmd(
            model_dir,
            &arms,
            (&sweep, small_pages),
            (runs, concurrency, seed, passes, timeline_ms),
            filter,
            &engine,
            &layout,
            plot,
            json,
        ),
        Cmd::Plot { spec, out } => plot(spec, out),
        Cmd::Demo { dir, size, keep } => demo(dir, size, keep),
    };
    match r {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("{}", error_text(&*e));
            ExitCode::FAILURE
        }
    }
}

/// `weightstream: error: ...` with the chain of causes.
fn error_text(e: &(dyn std::error::Error + 'static)) -> String {
    let mut msg = format!("weightstream: error: {e}");
    let mut src = e.source();
    while let Some(s) = src {
        // Messages that already state their cause are not repeated.
        let cause = s.to_string();
        if !msg.contains(&cause) {
            msg.push_str(&format!(": {cause}"));
        }
        src = s.source();
    }
    msg
}

/// `weightstream verify`: Ok(true) when nothing changed.
fn verify(
    dir: &std::path::Path,
    digest: bool,
    against: Option<&std::path::Path>,
    layout: &LayoutArgs,
    json: bool,
) -> Result<bool, Box<dyn std::error::Error>> {
    let earlier: Option<weightstream::VerifyReport> = match against {
        Some(p) => {
            let text = std::fs::read(p).map_err(|e| format!("{}: read the record: {e}", escape(p)))?;
            Some(
                serde_json::from_slice(&text)
                    .map_err(|e| format!("{}: not a `weightstream verify --json` report: {e}", escape(p)))?,
            )
        }
        None => None,
    };
    let model = Model::open(layout.config(dir, None)?)?;
    let mut report = model.verify(digest)?;
    if let Some(e) = &earlier {
        report.compare_with(e);
    }
    let clean = report.is_clean();
    if json {
        println!("{}", serde_json::to_string_pretty(&report)?);
        return Ok(clean);
    }
    let mut out = std::io::stdout().lock();
    for f in report.changed() {
        let what: Vec<String> = f.changes.iter().map(ToString::to_string).collect();
        writeln!(out, "CHANGED {} (copy rank {}): {}", f.path, f.rank, what.join("; "))?;
    }
    let digests: usize = report.files.iter().map(|f| f.tensors.len()).sum();
    let changed = report.changed().count();
    writeln!(
        out,
        "{}: {} file(s) checked{}{}: {}",
        escape(dir),
        report.files.len(),
        if digest {
            format!(", {digests} tensor digest(s)")
        } else {
            String::new()
        },
        match against {
            Some(p) => format!(", against {}", escape(p)),
            None => String::new(),
        },
        if clean {
            "nothing changed".to_string()
        } else {
            format!("{changed} changed")
        }
    )?;
    Ok(clean)
}

type CliResult = Result<(), Box<dyn std::error::Error>>;

fn inspect(dir: PathBuf, layout: &LayoutArgs, numa: Option<&str>, json: bool) -> CliResult {
    let model = Model::open(layout.config(&dir, None)?)?;
    // A short-lived engine places the drives exactly as a reading engine
    // would (its ring threads bind themselves), and reports it.
    let mut ec = EngineConfig::from_env()?;
    if let Some(v) = numa {
        ec.numa = parse_on_off("--numa", v)?;
    }
    let engine = match Engine::new(&model, ec) {
        Ok(e) => Some(e),
        Err(e) => {
            tracing::warn!("no engine to show NUMA placement: {e}");
            None
        }
    };
    let drive_stats = engine
        .as_ref()
        .map_or_else(|| model.stats().drives, |e| e.stats().drives);
    let provider = engine.as_ref().map(|e| e.numa_provider().name());
    let cat = model.catalog();
    let copy_json = |f: &weightstream::ShardFile| {
        serde_json::json!({
            "path": escape(&f.path),
            "rank": f.rank,
            "drive": model.drives()[f.drive].device,
            "fs_type": f.topo.fs_type,
            "mount": escape(&f.topo.mount),
            "dio_offset_align": f.topo.dio_offset_align,
            "dio_mem_align": f.topo.dio_mem_align,
            "align_source": f.topo.align_source,
            "direct_opens": f.direct().is_some(),
            "direct_refused": f.direct_refused,
        })
    };
    let shards: Vec<serde_json::Value> = cat
        .shards()
        .iter()
        .enumerate()
        .map(|(i, s)| {
            // The primary copy's fields at the top level, every copy under "copies".
            let mut v = copy_json(&model.files()[i]);
            let o = v.as_object_mut().expect("an object");
            o.insert("name".into(), escape(&s.name).into());
            o.insert("size".into(), model.files()[i].size.into());
            o.insert("header_len".into(), s.header.header_len.into());
            o.insert("data_start".into(), s.header.data_start.into());
            o.insert("tensors".into(), s.header.tensors.len().into());
            o.insert("device".into(), model.files()[i].topo.device.clone().into());
            let copies: Vec<_> = model.copies(i).iter().map(|&c| copy_json(&model.files()[c])).collect();
            o.insert("copies".into(), copies.into());
            v
        })
        .collect();
    let refused: Vec<_> = model.copy_report().iter().filter(|c| !c.accepted).collect();
    if json {
        // Serialised first: an error (not a panic in `json!`) if a field
        // cannot be.
        let refused = serde_json::to_value(&refused)?;
        let drives = serde_json::to_value(&drive_stats)?;
        let v = serde_json::json!({
            "dir": escape(cat.dir()),
            "shards": shards,
            "tensors": cat.tensors().len(),
            "bytes": cat.total_bytes(),
            "route": model.route().name(),
            "weights": model.rank_weights(),
            "refused_copies": refused,
            "numa_provider": provider,
            "drives": drives,
        });
        println!("{}", serde_json::to_string_pretty(&v)?);
        return Ok(());
    }
    let mut out = std::io::stdout().lock();
    writeln!(
        out,
        "model {}: {} shard(s), {} tensor(s), {} bytes; route {}, weights per copy rank {:?}",
        escape(cat.dir()),
        cat.shards().len(),
        cat.tensors().len(),
        cat.total_bytes(),
        model.route().name(),
        model.rank_weights()
    )?;
    for (i, s) in cat.shards().iter().enumerate() {
        let f = &model.files()[i];
        writeln!(
            out,
            "  {}  {} bytes, header {} bytes (data at {}), {} tensor(s), {} cop{}",
            escape(&s.name),
            f.size,
            s.header.header_len,
            s.header.data_start,
            s.header.tensors.len(),
            model.copies(i).len(),
            if model.copies(i).len() == 1 { "y" } else { "ies" }
        )?;
        for &c in model.copies(i) {
            let f = &model.files()[c];
            writeln!(
                out,
                "    [{}] {}  drive {} ({} at {}), dio align offset {} / memory {} (from {:?}), O_DIRECT: {}",
                f.rank,
                escape(&f.path),
                model.drives()[f.drive].device,
                f.topo.fs_type,
                escape(&f.topo.mount),
                f.topo.dio_offset_align,
                f.topo.dio_mem_align,
                f.topo.align_source,
                match (f.direct(), &f.direct_refused) {
                    (Some(_), _) => "opens".to_string(),
                    (None, Some(why)) => format!("no ({why})"),
                    (None, None) => "no".to_string(),
                }
            )?;
        }
    }
    for c in &refused {
        writeln!(
            out,
            "  refused copy {} ({}): {}",
            escape(&c.path),
            escape(&c.shard),
            c.reason.as_deref().unwrap_or("?")
        )?;
    }
    for (d, st) in model.drives().iter().zip(&drive_stats) {
        writeln!(
            out,
            "drive {} ({}, {}): dio align {}, O_DIRECT on every file: {}",
            d.device,
            d.fs_type,
            escape(&d.mount),
            d.dio_align,
            d.direct_open
        )?;
        let Some(provider) = &provider else { continue };
        let node = match (st.numa_node, &st.numa_note) {
            (Some(n), _) => format!("NUMA node {n}"),
            (None, Some(why)) => format!("NUMA node unknown ({why})"),
            (None, None) => "NUMA node unknown".to_string(),
        };
        writeln!(
            out,
            "  {node}, cpuset {} [{provider}]; {} thread: {}",
            st.cpuset.as_deref().unwrap_or("-"),
            if st.ring.is_some() { "ring" } else { "pread" },
            st.thread_binding.as_deref().unwrap_or("-")
        )?;
        if let Some(why) = &st.submit_reason {
            writeln!(
                out,
                "  submit {why}{}",
                st.iowq_max_workers
                    .map_or(String::new(), |n| format!("; io-wq workers at most {n}"))
            )?;
        }
    }
    Ok(())
}

fn digest(
    dir: PathBuf,
    names: Vec<String>,
    direct: DirectMode,
    args: &EngineArgs,
    layout: &LayoutArgs,
    json: bool,
) -> CliResult {
    let model = Model::open(layout.config(&dir, Some(direct))?)?;
    let cat = model.catalog();
    let mut chosen = Vec::new();
    if names.is_empty() {
        chosen.extend(cat.tensors().iter());
    } else {
        for n in &names {
            chosen.push(model.tensor(n)?);
        }
        chosen.sort_by(|a, b| a.name.cmp(&b.name));
        chosen.dedup_by(|a, b| a.name == b.name);
    }
    let cap = chosen.iter().map(|t| t.len).max().unwrap_or(1).max(1) as usize;
    let spec = weightstream::SlotSpec::new(cap).with_align(model.required_align());
    let mut sums = Vec::with_capacity(chosen.len());
    let stats = match args.config()? {
        None => {
            let arena = Arena::new(spec, 1)?;
            for t in chosen {
                let slot = arena.take().expect("one slot, returned after each read");
                let loaded = model.read_sync(t, slot)?;
                sums.push((t.name.clone(), hex(&Sha256::digest(&loaded[..]))));
            }
            model.stats()
        }
        Some(cfg) => {
            let engine = Engine::new(&model, cfg)?;
            let arena = engine.arena(spec, args.inflight.max(1))?;
            // Keep up to `inflight` reads going; hash in order as each lands.
            let mut pending = std::collections::VecDeque::new();
            let mut next = chosen.iter();
            loop {
                while let Some(slot) = arena.take() {
                    let Some(t) = next.next() else {
                        drop(slot);
                        break;
                    };
                    pending.push_back((t, engine.read(t, slot)?));
                }
                let Some((t, ticket)) = pending.pop_front() else {
                    break;
                };
                let loaded = ticket.wait()?;
                sums.push((t.name.clone(), hex(&Sha256::digest(&loaded[..]))));
            }
            engine.stats()
        }
    };
    if json {
        let map: serde_json::Map<String, serde_json::Value> = sums.into_iter().map(|(n, h)| (n, h.into())).collect();
        // Serialised first: an error, not a panic inside `json!`.
        let stats = serde_json::to_value(&stats)?;
        println!(
            "{}",
            serde_json::to_string_pretty(&serde_json::json!({"tensors": map, "stats": stats}))?
        );
    } else {
        let mut out = std::io::stdout().lock();
        for (n, h) in sums {
            writeln!(out, "{h}  {n}")?;
        }
    }
    Ok(())
}

/// The sweep the `ceiling` flags ask for: full or quick, with each
/// dimension given replacing that dimension's values (every combination).
#[allow(clippy::too_many_arguments)]
fn sweep_config(
    quick: bool,
    bs: &[u64],
    qd: &[usize],
    readers: &[usize],
    submit: &[String],
    buffers: &[String],
    bytes: Option<u64>,
    seconds: Option<f64>,
) -> Result<SweepConfig, Box<dyn std::error::Error>> {
    let mut cfg = if quick {
        SweepConfig::quick()
    } else {
        SweepConfig::full()
    };
    if !(bs.is_empty() && qd.is_empty() && readers.is_empty() && submit.is_empty() && buffers.is_empty()) {
        fn values<T: Copy + PartialEq>(given: Vec<T>, base: &[ReadConfig], f: fn(&ReadConfig) -> T) -> Vec<T> {
            let mut v = if given.is_empty() {
                base.iter().map(f).collect()
            } else {
                given
            };
            let mut seen = Vec::new();
            v.retain(|x| {
                let new = !seen.contains(x);
                seen.push(*x);
                new
            });
            v
        }
        let bs: Vec<usize> = bs
            .iter()
            .map(|&b| usize::try_from(b).map_err(|_| format!("--bs {b}: too large")))
            .collect::<Result<_, _>>()?;
        let submit = submit.iter().map(|s| Submit::parse(s)).collect::<Result<Vec<_>, _>>()?;
        let buffers = buffers
            .iter()
            .map(|s| Buffers::parse(s))
            .collect::<Result<Vec<_>, _>>()?;
        let full = SweepConfig::full().configs;
        cfg.configs = SweepConfig::product(
            &values(bs, &full, |c| c.bs),
            &values(qd.to_vec(), &full, |c| c.qd),
            &values(readers.to_vec(), &full, |c| c.readers),
            &values(submit, &full, |c| c.submit),
            &values(buffers, &full, |c| c.buffers),
        );
        cfg.name = "custom".into();
    }
    if let Some(b) = bytes {
        cfg.bytes = b;
    }
    if let Some(s) = seconds {
        cfg.seconds = s;
    }
    cfg.validate()?;
    Ok(cfg)
}

fn ceiling_cmd(paths: Vec<PathBuf>, cfg: &SweepConfig, json: bool) -> CliResult {
    let r = ceiling::sweep(&paths, cfg)?;
    if json {
        println!("{}", serde_json::to_string_pretty(&r)?);
        return Ok(());
    }
    for d in &r.drives {
        let s = &d.spread;
        println!(
            "drive {}: {} file(s); best {:.3} GB/s with {} (CPU {:.3} s/GB); {} configuration(s): {:.3}-{:.3} GB/s \
             (the weakest {:.2} of the best), {} failed, {} skipped",
            d.device,
            d.files.len(),
            d.gbps,
            d.best_label,
            d.cpu_s / (d.bytes as f64 / 1e9).max(1e-12),
            d.configs.len(),
            s.min_gbps,
            s.max_gbps,
            s.weakest_ratio,
            s.failed,
            s.skipped
        );
        for c in &d.configs {
            let mark = if c.config == d.best { "  <- best" } else { "" };
            match (&c.error, &c.skipped) {
                (Some(e), _) => println!("  {:<52} failed: {e}", c.label),
                (None, Some(why)) => println!("  {:<52} skipped: {why}", c.label),
                _ => println!(
                    "  {:<52} {:>7.3} GB/s  {:.3} GB in {:.2}s  CPU {:.3} s/GB{mark}",
                    c.label,
                    c.gbps,
                    c.bytes as f64 / 1e9,
                    c.seconds,
                    c.cpu_s_per_gb
                ),
            }
        }
    }
    let together = if r.drives.len() > 1 {
        "all drives at once, each with its best"
    } else {
        "one drive: its best"
    };
    println!(
        "total ({together}): {:.3} GB in {:.2}s = {:.3} GB/s, CPU {:.3} s/GB (getrusage: io-wq workers included); \
         {} sweep took {:.1}s; buffers on {}",
        r.bytes as f64 / 1e9,
        r.seconds,
        r.gbps,
        r.cpu_seconds / (r.bytes as f64 / 1e9).max(1e-12),
        r.sweep,
        r.elapsed_s,
        r.pages
    );
    Ok(())
}

#[allow(clippy::too_many_arguments)]
fn gen(
    dir: PathBuf,
    size: u64,
    layers: usize,
    experts: Option<usize>,
    expert_bytes: u64,
    shards: usize,
    seed: u64,
) -> CliResult {
    let mut spec = SynthSpec::sized(size, expert_bytes as usize, layers.max(1), shards.max(1));
    if let Some(e) = experts {
        spec.experts = e.max(1);
    }
    spec.seed = seed;
    let t0 = Instant::now();
    let paths = synth::write_model(&dir, &spec)?;
    println!(
        "wrote {}: {} layers x {} experts x 3 projections of {} bytes, {} shard(s), {:.3} GB of tensors in {:.1}s",
        dir.display(),
        spec.layers,
        spec.experts,
        spec.tensors()
            .iter()
            .find(|t| t.name.contains(".experts."))
            .map_or(0, |t| t.len()),
        paths.len(),
        spec.total_bytes() as f64 / 1e9,
        t0.elapsed().as_secs_f64()
    );
    Ok(())
}

#[allow(clippy::too_many_arguments)]
fn bench_cmd(
    dir: PathBuf,
    arms: &str,
    (sweep, small_pages): (&str, bool),
    (runs, concurrency, seed, passes, timeline_ms): (usize, usize, u64, usize, Option<u64>),
    filter: String,
    eargs: &EngineArgs,
    layout: &LayoutArgs,
    plot: Option<PathBuf>,
    json: bool,
) -> CliResult {
    let model = Model::open(layout.config(&dir, None)?)?;
    let engine = eargs
        .config()?
        .ok_or("bench: --backend sync is not an arm; use --arms")?;
    let mut ceiling = match sweep.trim().to_ascii_lowercase().as_str() {
        "quick" => SweepConfig::quick(),
        "full" => SweepConfig::full(),
        other => return Err(format!("--sweep {other:?}: expected quick or full").into()),
    };
    ceiling.huge_pages = !small_pages;
    let cfg = BenchConfig {
        arms: Arm::parse_list(arms)?,
        runs,
        concurrency,
        seed,
        filter,
        engine,
        fio: bench::fio::FioSweep::like(&ceiling),
        ceiling,
        passes,
        timeline_ms,
    };
    let show = !json && std::io::stderr().is_terminal();
    let started = Instant::now();
    let mut progress = |arm: Arm, run: usize, f: f64| {
        if show && started.elapsed().as_secs_f64() > 1.0 {
            let w = 30;
            let k = (f * w as f64) as usize;
            eprint!(
                "\r{:>8} run {}/{} [{}{}] {:>3.0}%",
                arm.name(),
                run + 1,
                runs.max(1),
                "#".repeat(k),
                " ".repeat(w - k),
                f * 100.0
            );
            if f >= 1.0 {
                eprint!("\r{}\r", " ".repeat(60));
            }
        }
    };
    let r = bench::run(&model, &cfg, &mut progress)?;
    if let Some(p) = &plot {
        let bars: Vec<(String, f64)> = r.arms.iter().map(|(n, a)| (n.clone(), a.gbps)).collect();
        let title = format!(
            "{} experts, concurrency {}, median of {} runs; ceiling {:.2} GB/s",
            r.tensors, r.concurrency, r.runs, r.ceiling_gbps
        );
        std::fs::write(p, plot::bars_svg(&title, "GB/s", &bars, Some(r.ceiling_gbps)))?;
    }
    if json {
        println!("{}", serde_json::to_string_pretty(&r)?);
        return Ok(());
    }
    println!(
        "{} tensors, {:.3} GB per run, concurrency {}, median of {} interleaved run(s)",
        r.tensors,
        r.bytes_per_run as f64 / 1e9,
        r.concurrency,
        r.runs,
    );
    println!("ceiling {:.3} GB/s ({})", r.ceiling_gbps, r.ceiling_config);
    if let (Some(f), Some(c)) = (r.fio_gbps, &r.fio_config) {
        println!(
            "fio     {f:.3} GB/s ({c}; {}); ceiling / fio = {:.3}",
            r.fio_version.as_deref().unwrap_or("fio"),
            r.ceiling_gbps / f.max(1e-12)
        );
    }
    println!(
        "{:>15} {:>8} {:>15} {:>6} {:>9} {:>9} {:>8} {:>8} {:>12}",
        "arm", "GB/s", "min-max", "ratio", "ratio_fio", "CPU s/GB", "p50 ms", "p99 ms", "cache grow"
    );
    for (n, a) in &r.arms {
        let ms = |v: Option<f64>| v.map_or("-".to_string(), |v| format!("{v:.2}"));
        println!(
            "{:>15} {:>8.3} {:>15} {:>6.3} {:>9} {:>9.3} {:>8} {:>8} {:>10.1}MB",
            n,
            a.gbps,
            format!("{:.3}-{:.3}", a.gbps_min, a.gbps_max),
            a.ratio,
            a.ratio_fio.map_or("-".to_string(), |x| format!("{x:.3}")),
            a.cpu_s_per_gb,
            ms(a.p50_ms),
            ms(a.p99_ms),
            a.cache_growth_bytes as f64 / 1e6
        );
    }
    for w in &r.warnings {
        println!("warning: {w}");
    }
    for n in &r.notes {
        println!("note: {n}");
    }
    Ok(())
}

fn plot(spec: PathBuf, out: PathBuf) -> CliResult {
    let v: serde_json::Value = serde_json::from_slice(&std::fs::read(&spec)?)?;
    let text = |k: &str| v.get(k).and_then(|x| x.as_str()).unwrap_or("").to_string();
    let svg = if let Some(series) = v.get("series").and_then(|s| s.as_array()) {
        let series: Vec<(String, Vec<(f64, f64)>)> = series
            .iter()
            .map(|s| {
                let name = s.get("name").and_then(|n| n.as_str()).unwrap_or("").to_string();
                let pts = s
                    .get("points")
                    .and_then(|p| p.as_array())
                    .map(|a| {
                        a.iter()
                            .filter_map(|p| Some((p.get(0)?.as_f64()?, p.get(1)?.as_f64()?)))
                            .collect()
                    })
                    .unwrap_or_default();
                (name, pts)
            })
            .collect();
        plot::lines_svg(&text("title"), &text("xlabel"), &text("ylabel"), &series)
    } else if let Some(bars) = v.get("bars").and_then(|b| b.as_array()) {
        let bars: Vec<(String, f64)> = bars
            .iter()
            .filter_map(|b| Some((b.get(0)?.as_str()?.to_string(), b.get(1)?.as_f64()?)))
            .collect();
        let reference = v.get("reference").and_then(|r| r.as_f64());
        plot::bars_svg(&text("title"), &text("unit"), &bars, reference)
    } else {
        return Err(format!("{}: expected \"series\" or \"bars\"", spec.display()).into());
    };
    std::fs::write(&out, svg)?;
    Ok(())
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn demo(dir: Option<PathBuf>, size: u64, keep: bool) -> CliResult {
    let (tmp, dir) = match dir {
        Some(d) => (None, d),
        None => {
            let t = tempfile::Builder::new()
                .prefix("weightstream-demo-")
                .tempdir_in(std::env::temp_dir())?;
            let d = t.path().to_path_buf();
            (Some(t), d)
        }
    };
    let spec = SynthSpec::sized(size, 1_700_000, 4, 2);
    let t0 = Instant::now();
    synth::write_model(&dir, &spec)?;
    println!(
        "wrote a synthetic MoE model to {}: {} layers x {} experts x 3 projections, {} shards, {:.1} MB in {:.1}s",
        dir.display(),
        spec.layers,
        spec.experts,
        spec.shards,
        spec.total_bytes() as f64 / 1e6,
        t0.elapsed().as_secs_f64()
    );
    let model = Model::open(ModelConfig::new(&dir))?;
    let experts: Vec<_> = model
        .catalog()
        .tensors()
        .iter()
        .filter(|t| t.name.contains(".experts."))
        .collect();
    let arena = Arena::new(model.slot_spec_for_largest(".experts."), 1)?;
    let (mut bytes, mut bad) = (0u64, 0usize);
    for t in &experts {
        let slot = arena.take().expect("one slot, returned after each read");
        let loaded = model.read_sync(t, slot)?;
        bytes += loaded.len() as u64;
        if !synth::verify(spec.seed, &t.name, &loaded) {
            bad += 1;
            eprintln!("MISMATCH: {}", t.name);
        }
    }
    let st = model.stats();
    println!(
        "read {} expert tensors ({:.1} MB) in place with the synchronous reference path, every byte verified: {} \
         (speed: see the headline below, measured against the device ceiling)",
        experts.len(),
        bytes as f64 / 1e9 * 1e3,
        if bad == 0 {
            "ok".to_string()
        } else {
            format!("{bad} MISMATCHED")
        }
    );
    for d in &st.drives {
        println!(
            "drive {} ({}): {} reads direct, {} buffered; {} bytes direct, {} buffered (sub-block tails); fallbacks {:?}",
            d.device, d.fs_type, d.reads_direct, d.reads_buffered, d.bytes_direct, d.bytes_buffered, d.fallbacks
        );
    }
    // The point in one line: a short interleaved bench on the same files.
    let cfg = BenchConfig {
        arms: vec![Arm::Ceiling, Arm::Engine, Arm::Buffered],
        runs: 1,
        ..BenchConfig::default()
    };
    let r = bench::run(&model, &cfg, &mut |_, _, _| {})?;
    if let (Some(e), Some(b)) = (r.arm("engine"), r.arm("buffered")) {
        println!(
            "headline (concurrency {}, cold cache, 1 run): engine {:.2} GB/s = {:.2} x the device ceiling ({:.2} GB/s, measured now), \
             {:.2} x buffered pread+copy ({:.2} GB/s); CPU {:.3} vs {:.3} s/GB; page cache grew {:.0} MB vs {:.0} MB",
            r.concurrency,
            e.gbps,
            e.ratio,
            r.ceiling_gbps,
            e.gbps / b.gbps.max(1e-12),
            b.gbps,
            e.cpu_s_per_gb,
            b.cpu_s_per_gb,
            e.cache_growth_bytes as f64 / 1e6,
            b.cache_growth_bytes as f64 / 1e6
        );
    }
    if keep {
        if let Some(t) = tmp {
            let _ = t.keep();
        }
        println!("kept {}", dir.display());
    } else if let Some(t) = tmp {
        t.close()?;
        println!("removed {}", dir.display());
    }
    if bad > 0 {
        return Err(format!("{bad} tensor(s) did not match").into());
    }
    Ok(())
}
