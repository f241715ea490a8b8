//! The command line's definition (clap): commands, their flags, and a typed
//! value for every option with a fixed set of values.

use std::path::PathBuf;

use clap::{Parser, Subcommand, ValueEnum};
use weightstream::place::LayoutKind;
use weightstream::{DirectMode, IoPoll, RoutePolicy, SubmitMode, Weights};

use crate::args::{bytes_in, count, existing_file, load_align, non_empty_path, output_dir, output_file, seconds};
use crate::bench::Arm;
use crate::ceiling::{Buffers, Submit};

/// The most of anything one run counts (runs, passes, layers): far above
/// any real use, far below what would exhaust memory.
pub(crate) const MAX_LAYERS: u64 = 1024;
/// Experts per layer, at most.
pub(crate) const MAX_EXPERTS: u64 = 4096;
/// Chunks or reads in flight, at most (the engine's own queue-depth cap).
pub(crate) const MAX_DEPTH: u64 = 4096;
/// Bench runs and passes, at most.
pub(crate) const MAX_RUNS: u64 = 1000;
/// The largest size flag (`--size`, `--bytes`): 1 PiB.
pub(crate) const MAX_SIZE: u64 = 1 << 50;
/// One expert projection of `gen`, at most: 4 GiB.
pub(crate) const MAX_EXPERT_BYTES: u64 = 4 << 30;
/// The smallest expert projection of `gen`: one row of the hidden size
/// (2880 BF16 elements); sizes are rounded down to whole rows.
pub(crate) const MIN_EXPERT_BYTES: u64 = 2 * 2880;
/// A chunk or a ceiling block: 4 KiB to 1 GiB, a multiple of 4 KiB.
pub(crate) const MIN_BLOCK: u64 = 4096;
pub(crate) const MAX_BLOCK: u64 = 1 << 30;

#[derive(Parser)]
#[command(
    name = "weightstream",
    version,
    about = "Stream model weights from NVMe into engine memory"
)]
pub(crate) struct Cli {
    /// More logging (-v info, -vv debug); WEIGHTSTREAM_LOG overrides.
    #[arg(short, long, action = clap::ArgAction::Count, global = true)]
    pub(crate) verbose: u8,
    #[command(subcommand)]
    pub(crate) cmd: Cmd,
}

#[derive(Subcommand)]
pub(crate) enum Cmd {
    /// Shards, tensors, bytes, and each file's drive and O_DIRECT alignment.
    ///
    /// Shards, tensors, bytes, and for each file its filesystem, device, O_DIRECT alignment and whether O_DIRECT opens.
    Inspect {
        /// The model: its directory, its model.safetensors.index.json, or one .safetensors file.
        #[arg(value_name = "MODEL", value_parser = non_empty_path())]
        model_dir: PathBuf,
        #[command(flatten)]
        layout: LayoutArgs,
        /// NUMA placement shown per drive: on (hwloc, or WEIGHTSTREAM_NUMA_XML) or off (default: WEIGHTSTREAM_NUMA or on).
        #[arg(long, value_enum)]
        numa: Option<OnOff>,
        /// List every tensor instead: name, dtype, shape, bytes, file, offset (of its payload in the file) and
        /// drive, in name order.
        #[arg(long, conflicts_with = "numa")]
        tensors: bool,
        #[arg(long)]
        json: bool,
    },
    /// sha256 of every tensor (or the named ones), in sha256sum format.
    ///
    /// sha256 of every tensor (or the named ones), read through the in-place path; sha256sum format, sorted by name.
    Digest {
        /// The model: its directory, its model.safetensors.index.json, or one .safetensors file.
        #[arg(value_name = "MODEL", value_parser = non_empty_path())]
        model_dir: PathBuf,
        /// Only these tensors (repeatable).
        #[arg(long = "tensor")]
        tensors: Vec<String>,
        /// O_DIRECT: auto (where possible, fallbacks counted), on (refuse files that cannot open O_DIRECT), off.
        #[arg(long, value_enum, default_value = "auto")]
        direct: DirectArg,
        #[command(flatten)]
        engine: EngineArgs,
        #[command(flatten)]
        layout: LayoutArgs,
        #[arg(long)]
        json: bool,
    },
    /// Re-check a model's files and copies; compare with an earlier record.
    ///
    /// Re-check a model's files: each copy opened, proven and re-read (header), with --digest every tensor
    /// of every copy hashed (mirror copies compared with the primary), with --against compared with an
    /// earlier `verify --json` record (inode, size, ctime, header, digests). A placed model (`place`) is first
    /// checked against its layout index (every file present, size, header sha256; with --digest every
    /// tensor's sha256). Exit status 0: nothing changed; 1: something changed (each file named with what
    /// changed); 2: the check could not run.
    Verify {
        /// The model: its directory, its model.safetensors.index.json, or one .safetensors file.
        #[arg(value_name = "MODEL", value_parser = non_empty_path())]
        model_dir: PathBuf,
        /// Hash every tensor of every copy (reads the whole model, buffered, page cache dropped after).
        #[arg(long)]
        digest: bool,
        /// A report saved by an earlier `verify --json` (with --digest, to compare payloads too); a regular
        /// file of at most 256 MiB.
        #[arg(long, value_parser = existing_file())]
        against: Option<PathBuf>,
        #[command(flatten)]
        layout: LayoutArgs,
        /// The report as JSON (save it to compare against later).
        #[arg(long)]
        json: bool,
    },
    /// Place a model across drives: mirror, split, or one file per layer.
    ///
    /// Place a model across drives: a full copy on each root (mirror), its shards spread over the roots
    /// (split), or re-sharded into one file per decoder layer, layer i on root i mod N (layers). Each root gets
    /// a private per-model folder; files are written O_DIRECT under temporary names, then the layout index is
    /// committed. Re-running is a no-op when every file is proven identical. Open the printed primary folder.
    Place {
        #[arg(value_parser = non_empty_path())]
        src_dir: PathBuf,
        /// The roots, primary first, `;`-separated: existing directories, one per drive.
        #[arg(long = "to", value_name = "ROOT[;ROOT...]", value_parser = parse_roots)]
        to: Roots,
        /// How the model is laid out over the roots.
        #[arg(long, value_enum)]
        layout: LayoutArg,
        /// Prove files kept from an earlier run by the sha256 of every tensor too (reads them and the source).
        #[arg(long)]
        digest: bool,
        /// Accept a root on the source's drive (it adds no read bandwidth).
        #[arg(long)]
        allow_source_volume: bool,
        /// The report as JSON.
        #[arg(long)]
        json: bool,
    },
    /// The device ceiling: the best of a sweep of O_DIRECT reads per drive.
    ///
    /// The device ceiling: a sweep of O_DIRECT io_uring read configurations (block size, depth, readers,
    /// inline or async submission, plain or registered buffers) on each drive alone, the best and the
    /// configuration that reached it per drive, then all drives at once with their best.
    Ceiling {
        /// Files to read (regular files, O_DIRECT; anything else is refused before it is read).
        #[arg(required = true, value_parser = non_empty_path())]
        paths: Vec<PathBuf>,
        /// 8 configurations, up to 1 GiB or 0.25 s each (default: 32, up to 2 GiB or 0.5 s each).
        #[arg(long)]
        quick: bool,
        /// Block sizes to try, comma-separated (e.g. 1MiB,4MiB; 4 KiB to 1 GiB, multiples of 4096); each
        /// dimension given replaces the sweep's values (at most 4096 configurations in all).
        #[arg(long, value_delimiter = ',', value_parser = bytes_in(MIN_BLOCK, MAX_BLOCK, 4096))]
        bs: Vec<u64>,
        /// Reads in flight per reader, comma-separated (e.g. 16,64; 1 to 4096).
        #[arg(long, value_delimiter = ',', value_parser = count(1, MAX_DEPTH))]
        qd: Vec<usize>,
        /// Reader threads per drive, each with its own ring (e.g. 1,2; 1 to 64).
        #[arg(long, value_delimiter = ',', value_parser = count(1, 64))]
        readers: Vec<usize>,
        /// inline and/or async (IOSQE_ASYNC on every read, fio --force_async=1).
        #[arg(long, value_enum, value_delimiter = ',')]
        submit: Vec<Submit>,
        /// plain and/or fixed (registered buffers, ReadFixed; fio --fixedbufs=1).
        #[arg(long, value_enum, value_delimiter = ',')]
        buffers: Vec<Buffers>,
        /// Byte cap per configuration and drive (files are read round again if smaller; 1 byte to 1 PiB).
        #[arg(long, value_parser = bytes_in(1, MAX_SIZE, 1))]
        bytes: Option<u64>,
        /// Time cap per configuration, seconds (above 0, at most 3600).
        #[arg(long, value_parser = seconds)]
        seconds: Option<f64>,
        /// Read into 4 KiB pages (as fio's default buffers) instead of huge pages (MADV_HUGEPAGE).
        #[arg(long)]
        small_pages: bool,
        #[arg(long)]
        json: bool,
    },
    /// Load a whole model into memory; report speed, CPU and memory.
    ///
    /// Load every tensor (or those named) into memory and report how fast, with how much CPU, peak
    /// memory and page-cache growth: weightstream's load_all (one mapping, payloads aligned for their
    /// dtype, O_DIRECT in place), or the loaders it replaces, for comparison.
    Load {
        /// The model: its directory, its model.safetensors.index.json, or one .safetensors file.
        #[arg(value_name = "MODEL", value_parser = non_empty_path())]
        model_dir: PathBuf,
        /// weightstream (load_all), safetensors-mmap (memmap2 + the safetensors crate + to_vec of every
        /// tensor, as candle-style loaders do), fs-read (std::fs::read of each shard, tensors borrowed from
        /// it), mmap (mapped, every page touched, nothing copied: the pages stay in the page cache).
        #[arg(long, value_enum, default_value = "weightstream")]
        method: LoadMethod,
        /// Only tensors whose name contains one of these (repeatable; not empty: leave the flag out for every
        /// tensor); none matching is an error.
        #[arg(long = "name", value_parser = clap::builder::NonEmptyStringValueParser::new())]
        names: Vec<String>,
        /// Every payload's address a multiple of this too (a power of two, at most 4096; weightstream only).
        #[arg(long, default_value_t = 0, value_parser = load_align)]
        align: usize,
        /// The order tensors are laid out and read in (weightstream only).
        #[arg(long, value_enum, default_value = "file")]
        order: OrderArg,
        /// Fault the whole mapping in before reading (weightstream only; default: each page is faulted by
        /// the read that lands in it).
        #[arg(long)]
        populate: bool,
        /// Register the mapping with the rings before reading (weightstream only; pins every page first).
        /// Memory that is reused (--memory reused) is always registered.
        #[arg(long)]
        register: bool,
        /// Helper threads faulting the mapping in ahead of the reads (weightstream only): auto (when a
        /// CPU is spare beside the engine's I/O threads), on, or off (each page faulted by the read
        /// landing in it).
        #[arg(long, value_enum, default_value = "auto")]
        fault_ahead: AutoOnOff,
        /// How many fault-ahead helpers, 0 to 16 (0: none; default: the CPUs the I/O threads leave
        /// spare, at most two per drive).
        #[arg(long, value_parser = clap::value_parser!(u8).range(0..=16))]
        fault_ahead_threads: Option<u8>,
        /// fresh: the load's own new mapping (what a start-up load pays: every page faulted in). reused: into
        /// memory the engine already has and has written (a registered arena of Engine::load_bytes, loaded into
        /// once untimed, then Engine::load_all_into timed: an engine reloading weights into its own buffers;
        /// the timed region is that load alone). faulted: into such an arena faulted in by a
        /// write to every page instead of a first load (the timed load is then the files' first read since
        /// the cache was dropped, as fio's is). weightstream only.
        #[arg(long, value_enum, default_value = "fresh")]
        memory: LoadMemory,
        /// sha256 of every tensor after the load (not timed): printed as `digest` does, or in the JSON.
        #[arg(long)]
        digest: bool,
        #[command(flatten)]
        engine: EngineArgs,
        #[command(flatten)]
        layout: LayoutArgs,
        #[arg(long)]
        json: bool,
    },
    /// The load ceiling: fio's best read and the fault-in of fresh memory.
    ///
    /// The load ceiling of a model on this machine: the model's bytes over the largest of fio's best read of its
    /// files (a sweep, all drives at once), the fastest fault-in of as much fresh memory (MADV_POPULATE_WRITE on
    /// every CPU, 4 KiB and huge pages), and both their busy CPU (/proc/stat) spread over the CPUs. A whole-model
    /// load into fresh memory cannot beat it; into memory already faulted, the read alone is the ceiling.
    LoadCeiling {
        /// The model: its directory, its model.safetensors.index.json, or one .safetensors file.
        #[arg(value_name = "MODEL", value_parser = non_empty_path())]
        model_dir: PathBuf,
        /// fio's sweep: quick (8 configurations and 4 randread) or full (32 and 8).
        #[arg(long, value_enum, default_value = "quick")]
        sweep: SweepArg,
        /// Fault-ins per page size (1 to 100; the fastest counts).
        #[arg(long, default_value_t = 3, value_parser = count(1, 100))]
        fault_rounds: usize,
        /// fio's configuration alone instead of its sweep, as the reports print it (`rw=read bs=4MiB iodepth=16
        /// numjobs=1 force_async=1 fixedbufs=1`): a benchmark picks the best once, then measures it in every
        /// round beside the loaders.
        #[arg(long)]
        fio_config: Option<crate::bench::fio::FioConfig>,
        #[command(flatten)]
        layout: LayoutArgs,
        #[arg(long)]
        json: bool,
    },
    /// Write a synthetic MoE model (deterministic content from a seed).
    ///
    /// Write a synthetic MoE model (safetensors' own serializer; deterministic content from a seed).
    /// The model must fit on the target volume and its largest tensor in memory: checked before anything is
    /// written.
    Gen {
        #[arg(value_parser = output_dir())]
        model_dir: PathBuf,
        /// Approximate total size (1 byte to 1 PiB; with --expert-bytes, at most 4096 experts per layer).
        #[arg(long, default_value = "4GiB", value_parser = bytes_in(1, MAX_SIZE, 1))]
        size: u64,
        /// Decoder layers (1 to 1024).
        #[arg(long, default_value_t = 8, value_parser = count(1, MAX_LAYERS))]
        layers: usize,
        /// Experts per layer (1 to 4096; default: from --size).
        #[arg(long, value_parser = count(1, MAX_EXPERTS))]
        experts: Option<usize>,
        /// Bytes of each expert projection (gate, up, down): 5760 (one row of 2880 BF16) to 4 GiB, rounded down to
        /// whole rows.
        #[arg(long, default_value = "19MiB", value_parser = bytes_in(MIN_EXPERT_BYTES, MAX_EXPERT_BYTES, 1))]
        expert_bytes: u64,
        /// Shard files (1 to --layers).
        #[arg(long, default_value_t = 4, value_parser = count(1, MAX_LAYERS))]
        shards: usize,
        #[arg(long, default_value_t = 0x5eed)]
        seed: u64,
    },
    /// Read every expert through several arms; ratios to the device's ceiling.
    ///
    /// Read every expert in a seeded random order through several arms, interleaved, cold cache; ratios to the
    /// ceiling and to fio's best in the same run.
    Bench {
        /// The model: its directory, its model.safetensors.index.json, or one .safetensors file.
        #[arg(value_name = "MODEL", value_parser = non_empty_path())]
        model_dir: PathBuf,
        /// Arms, in the order they run each round (ceiling, fio, engine, engine-hash, engine-stripe,
        /// engine-adaptive, pread, buffered, mmap).
        #[arg(
            long,
            value_enum,
            value_delimiter = ',',
            default_value = "ceiling,fio,engine,pread,buffered,mmap"
        )]
        arms: Vec<Arm>,
        /// The ceiling's and fio's sweep each run: quick (8 configurations) or full (32).
        #[arg(long, value_enum, default_value = "quick")]
        sweep: SweepArg,
        /// The ceiling reads into 4 KiB pages (as fio's default buffers) instead of huge pages.
        #[arg(long)]
        small_pages: bool,
        /// The ceiling's and fio's figure per run: rerun (the sweep's best configuration run again
        /// alone: one run, as every other arm gets) or max (the sweep's largest figure: a maximum of
        /// 8 or 32 runs, biased up where runs vary).
        #[arg(long, value_enum, default_value = "rerun")]
        sweep_figure: crate::bench::SweepFigure,
        /// Interleaved runs (1 to 1000).
        #[arg(long, default_value_t = 3, value_parser = count(1, MAX_RUNS))]
        runs: usize,
        /// Reads in flight (1 = one expert at a time, decode-like; at most 4096).
        #[arg(long, default_value_t = 8, value_parser = count(1, MAX_DEPTH))]
        concurrency: usize,
        /// Order seed.
        #[arg(long, default_value_t = 1)]
        seed: u64,
        /// Tensors whose name contains this (not empty; none matching is an error).
        #[arg(long, default_value = ".experts.", value_parser = clap::builder::NonEmptyStringValueParser::new())]
        filter: String,
        #[command(flatten)]
        engine: EngineArgs,
        #[command(flatten)]
        layout: LayoutArgs,
        /// Read the whole order this many times per run (1 to 1000).
        #[arg(long, default_value_t = 1, value_parser = count(1, MAX_RUNS))]
        passes: usize,
        /// Sample per-drive bytes every MS milliseconds during engine arms (JSON: runs[].timeline; 1 to 3600000).
        #[arg(long, value_parser = clap::value_parser!(u64).range(1..=3_600_000))]
        timeline_ms: Option<u64>,
        /// Write a bar chart of GB/s per arm (SVG).
        #[arg(long, value_parser = output_file())]
        plot: Option<PathBuf>,
        #[arg(long)]
        json: bool,
    },
    /// Draw a benchmark chart (SVG) from a JSON spec.
    ///
    /// Draw a chart for a benchmark record from a JSON spec: {"title", "xlabel", "ylabel",
    /// "series": [{"name", "points": [[x, y], ...]}]} (lines), or {"title", "unit", "bars": [[label, value], ...],
    /// "reference": y} (bars). Writes SVG.
    #[command(hide = true)]
    Plot {
        /// The JSON spec (a regular file of at most 16 MiB).
        #[arg(value_parser = existing_file())]
        spec: PathBuf,
        #[arg(value_parser = output_file())]
        out: PathBuf,
    },
    /// The command line's own definition as JSON.
    ///
    /// The command line's own definition as JSON: every command, its arguments and their values (for the
    /// argument test, which runs every command with hostile values for each).
    #[command(hide = true, name = "cli-tree")]
    CliTree,
    /// Write a synthetic MoE model, read and verify every expert, remove it.
    ///
    /// Write a synthetic MoE model, read every expert through weightstream, verify every byte, remove it.
    Demo {
        /// Where to write the model (default: a temporary directory).
        #[arg(long, value_parser = output_dir())]
        dir: Option<PathBuf>,
        /// Approximate model size (e.g. 300MB, 1GiB; at least one 4-layer expert set, about 20 MB, is written;
        /// it must fit on the volume).
        #[arg(long, default_value = "320MiB", value_parser = bytes_in(1, MAX_SIZE, 1))]
        size: u64,
        /// Keep the model directory afterwards.
        #[arg(long)]
        keep: bool,
    },
}

/// Where the model's bytes live, shared by the commands that open a model.
/// Each flag overrides its environment variable.
#[derive(clap::Args, Debug, Default)]
pub(crate) struct LayoutArgs {
    /// Extra directories searched for shards after the primary (`;` or `,`
    /// separated; WEIGHTSTREAM_MODEL_DIRS).
    #[arg(long)]
    pub(crate) dirs: Option<String>,
    /// Mirror directories holding copies of any subset of the shards
    /// (WEIGHTSTREAM_MIRROR).
    #[arg(long)]
    pub(crate) mirror: Option<String>,
    /// Read weights per copy, primary first (e.g. 1,1 or 3,1), equal, or
    /// probe (WEIGHTSTREAM_DISK_WEIGHTS).
    #[arg(long, value_parser = parse_weights)]
    pub(crate) weights: Option<Weights>,
    /// How a read's chunks are spread over the copies (WEIGHTSTREAM_ROUTE;
    /// default adaptive).
    #[arg(long, value_enum)]
    pub(crate) route: Option<RouteArg>,
}

/// Engine settings shared by the commands that read.
#[derive(clap::Args, Debug)]
pub(crate) struct EngineArgs {
    /// I/O backend: auto (io_uring, else pread), uring, pread, or sync (the
    /// one-read-at-a-time reference path). Default: WEIGHTSTREAM_BACKEND or auto.
    #[arg(long, value_enum)]
    pub(crate) backend: Option<BackendArg>,
    /// Chunks in flight per drive, 1 to 4096 (default: WEIGHTSTREAM_QD or 32).
    #[arg(long, value_parser = count(1, MAX_DEPTH))]
    pub(crate) qd: Option<usize>,
    /// Largest chunk, e.g. 1MiB: 4 KiB to 1 GiB, a multiple of 4096 (default: the device's max_sectors_kb, clamped to 1-4 MiB; a large read's chunks grow by a whole factor up to 4 MiB while each I/O thread serving it keeps 4).
    #[arg(long, value_parser = bytes_in(MIN_BLOCK, MAX_BLOCK, 4096))]
    pub(crate) chunk: Option<u64>,
    /// Reads kept in flight (slots in the arena; 1 to 4096).
    #[arg(long, default_value_t = 8, value_parser = count(1, MAX_DEPTH))]
    pub(crate) inflight: usize,
    /// Kernel-side submission polling (a kernel thread per ring spins; opt-in).
    #[arg(long)]
    pub(crate) sqpoll: bool,
    /// Completion polling: auto (the bare flag: on drives whose queue/io_poll
    /// says they poll), force (every drive) or off (default: WEIGHTSTREAM_IOPOLL or off).
    #[arg(long, value_enum, num_args = 0..=1, default_missing_value = "auto")]
    pub(crate) iopoll: Option<IoPollArg>,
    /// How reads are issued per drive: auto (a probe at start: one ring per
    /// CPU on a drive that completes reads inline, like zram; else one
    /// ring), inline, rings:N, or async (IOSQE_ASYNC: io-wq workers issue
    /// the reads). Default: WEIGHTSTREAM_SUBMIT or auto.
    #[arg(long, value_parser = parse_submit)]
    pub(crate) submit: Option<SubmitMode>,
    /// NUMA placement: on (bind each drive's I/O threads to its node's CPUs,
    /// prefer local copies) or off (default: WEIGHTSTREAM_NUMA or on).
    #[arg(long, value_enum)]
    pub(crate) numa: Option<OnOff>,
}

/// `load --method`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub(crate) enum LoadMethod {
    /// `Engine::load_all`.
    Weightstream,
    /// memmap2 + safetensors + `to_vec` of every tensor.
    SafetensorsMmap,
    /// `std::fs::read` of every shard, tensors borrowed from the bytes.
    FsRead,
    /// Mapped and touched, never copied.
    Mmap,
}

/// `load --memory`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub(crate) enum LoadMemory {
    /// `Engine::load_all`: a new mapping.
    Fresh,
    /// `Engine::load_all_into` memory a previous load wrote.
    Reused,
    /// `Engine::load_all_into` memory already faulted in (a write to
    /// every page) but never read into.
    Faulted,
}

/// A choice the library makes unless told.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub(crate) enum AutoOnOff {
    /// The library decides.
    Auto,
    On,
    Off,
}

impl AutoOnOff {
    /// `None` for auto.
    pub(crate) fn chosen(self) -> Option<bool> {
        match self {
            AutoOnOff::Auto => None,
            AutoOnOff::On => Some(true),
            AutoOnOff::Off => Some(false),
        }
    }
}

/// `load --order`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub(crate) enum OrderArg {
    /// By shard, then file offset.
    File,
    /// Largest payload first.
    Size,
}

impl From<OrderArg> for weightstream::Order {
    fn from(o: OrderArg) -> Self {
        match o {
            OrderArg::File => weightstream::Order::File,
            OrderArg::Size => weightstream::Order::Size,
        }
    }
}

/// `--route`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub(crate) enum RouteArg {
    /// The whole read to one copy, by a hash of the tensor's group key.
    Hash,
    /// Every read split over all copies, in proportion to the weights.
    Stripe,
    /// Each chunk to the least loaded copy.
    Adaptive,
}

impl From<RouteArg> for RoutePolicy {
    fn from(r: RouteArg) -> Self {
        match r {
            RouteArg::Hash => RoutePolicy::Hash,
            RouteArg::Stripe => RoutePolicy::Stripe,
            RouteArg::Adaptive => RoutePolicy::Adaptive,
        }
    }
}

/// `place --layout`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub(crate) enum LayoutArg {
    /// A full copy of every shard on each root; read as mirrors.
    Mirror,
    /// Each shard on one root, bytes balanced, largest first.
    Split,
    /// Re-sharded into one file per decoder layer, layer i on root i mod N.
    Layers,
}

impl From<LayoutArg> for LayoutKind {
    fn from(l: LayoutArg) -> Self {
        match l {
            LayoutArg::Mirror => LayoutKind::Mirror,
            LayoutArg::Split => LayoutKind::Split,
            LayoutArg::Layers => LayoutKind::Layers,
        }
    }
}

/// `place --to`: the roots, primary first.
#[derive(Debug, Clone)]
pub(crate) struct Roots(pub(crate) Vec<PathBuf>);

/// `A;B` (or `A,B`, as the directory lists of the library's variables):
/// entries trimmed, empty ones dropped.
pub(crate) fn parse_roots(s: &str) -> Result<Roots, String> {
    let roots: Vec<PathBuf> = s
        .split([';', ','])
        .map(str::trim)
        .filter(|x| !x.is_empty())
        .map(PathBuf::from)
        .collect();
    if roots.is_empty() {
        return Err("no root given: name at least one directory (ROOT[;ROOT...])".into());
    }
    Ok(Roots(roots))
}

/// `--backend`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub(crate) enum BackendArg {
    /// io_uring, else pread.
    Auto,
    /// io_uring only.
    #[value(alias = "io_uring", alias = "io-uring")]
    Uring,
    /// The pread worker pool.
    Pread,
    /// The one-read-at-a-time reference path (no engine).
    Sync,
}

/// `--numa`: on or off.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub(crate) enum OnOff {
    /// On.
    #[value(alias = "1", alias = "true", alias = "yes")]
    On,
    /// Off.
    #[value(alias = "0", alias = "false", alias = "no")]
    Off,
}

/// `--direct`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub(crate) enum DirectArg {
    /// O_DIRECT where possible, fallbacks counted.
    Auto,
    /// Refuse files that cannot open O_DIRECT.
    On,
    /// Buffered only.
    Off,
}

impl From<DirectArg> for DirectMode {
    fn from(d: DirectArg) -> Self {
        match d {
            DirectArg::Auto => DirectMode::Auto,
            DirectArg::On => DirectMode::On,
            DirectArg::Off => DirectMode::Off,
        }
    }
}

/// `--iopoll`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub(crate) enum IoPollArg {
    /// Interrupt-driven completions.
    Off,
    /// Polled rings on drives whose queue polls.
    Auto,
    /// Polled rings on every drive.
    Force,
}

impl From<IoPollArg> for IoPoll {
    fn from(p: IoPollArg) -> Self {
        match p {
            IoPollArg::Off => IoPoll::Off,
            IoPollArg::Auto => IoPoll::Auto,
            IoPollArg::Force => IoPoll::Force,
        }
    }
}

/// `bench --sweep`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub(crate) enum SweepArg {
    /// 8 configurations.
    Quick,
    /// 32 configurations.
    Full,
}

/// `--weights`: the library's parser, typed.
fn parse_weights(s: &str) -> Result<Weights, String> {
    s.parse().map_err(|e: weightstream::Error| e.to_string())
}

/// `--submit`: auto, inline, async or rings:N (not a fixed set: typed by the
/// library's parser).
fn parse_submit(s: &str) -> Result<SubmitMode, String> {
    s.parse().map_err(|e: weightstream::Error| e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    /// Every command's summary in `--help`'s list is one line of at most 80
    /// characters (the details are `help CMD` / `CMD --help`), all the way
    /// down the command tree.
    #[test]
    fn every_summary_is_one_short_line() {
        fn walk(c: &clap::Command, path: &str, bad: &mut Vec<String>, seen: &mut usize) {
            for sub in c.get_subcommands() {
                let name = format!("{path} {}", sub.get_name());
                *seen += 1;
                let about = sub.get_about().map(|s| s.to_string()).unwrap_or_default();
                if about.is_empty() || about.contains('\n') || about.chars().count() > 80 {
                    bad.push(format!("{name}: {} chars: {about:?}", about.chars().count()));
                }
                walk(sub, &name, bad, seen);
            }
        }
        let (mut bad, mut seen) = (Vec::new(), 0);
        walk(&Cli::command(), "weightstream", &mut bad, &mut seen);
        assert!(seen >= 10, "only {seen} commands found");
        assert!(
            bad.is_empty(),
            "summaries longer than one line of 80 characters:\n{}",
            bad.join("\n")
        );
    }
}
