//! `Engine::new`, step by step: each drive's chunk size and NUMA locality,
//! then the io_uring backend (a submit plan and lanes per drive, one ring
//! thread per lane, or a pread worker pool for a drive that completes reads
//! inline) or the pread backend (a worker pool per drive) when io_uring is
//! unavailable or not chosen.

use std::sync::{Arc, Mutex};

use crate::config::{env, BackendChoice, EngineConfig, IoPoll, SubmitMode};
use crate::engine::backend::pread;
use crate::engine::backend::ring::{self, RingConfig};
use crate::engine::lanes;
use crate::engine::load::DriveLoad;
use crate::engine::queue::{DriveQueue, Io};
use crate::engine::registry::Registry;
use crate::engine::router::Router;
use crate::engine::{stop, Backend, DriveIo, Engine};
use crate::error::{Error, Result};
use crate::fork::Origin;
use crate::memory::limits::memlock_limit;
use crate::model::Model;
use crate::plan::chunk;
use crate::stats::Feature;
use crate::storage::numa::{parse_list, Locality, Provider, ThreadPlacement};
use crate::storage::topology;

/// The I/O threads an engine started, however they came to be.
struct Started {
    io: Arc<Io>,
    backend: Backend,
    backend_reason: Option<String>,
    /// The pread backend because io_uring could not be set up.
    fallback: bool,
    drives: Vec<DriveIo>,
    fixed_files: Feature,
    fixed_buffers_ok: bool,
    unregistered: Option<String>,
}

impl Engine {
    /// Starts one I/O thread (ring) or pool per drive of `model`. With
    /// [`Weights::Probe`](crate::Weights::Probe), the first engine made on a
    /// model measures the copies' weights first (a short O_DIRECT read of
    /// each copy rank; a failed probe leaves them equal, said once).
    pub fn new(model: &Model, config: EngineConfig) -> Result<Self> {
        if model.weights_to_probe() {
            let (weights, note) = crate::engine::probe::probe_weights(model);
            model.set_probed_weights(weights, note);
        }
        let depth = config.queue_depth.clamp(1, 4096);
        let chunks = chunk_sizes(model, config.chunk);
        let provider = if config.numa {
            config.numa_provider.clone().unwrap_or_else(env::numa_provider)
        } else {
            Provider::off("NUMA placement off (--numa off, WEIGHTSTREAM_NUMA=off or EngineConfig::numa)")
        };
        let localities = localities(model, &provider);
        let placements: Vec<ThreadPlacement> = localities
            .iter()
            .map(|l| ThreadPlacement {
                provider: provider.clone(),
                locality: l.clone(),
            })
            .collect();
        let nodes: Vec<Option<usize>> = localities.iter().map(|l| l.node).collect();
        let s = start(model, depth, &config, &chunks, &placements, &nodes)?;
        Ok(Engine {
            model: model.clone(),
            io: s.io,
            router: Router::new(config.route.unwrap_or(model.route())),
            pread_fallback: s.fallback,
            numa_wanted: config.numa,
            backend: s.backend,
            backend_reason: s.backend_reason,
            drives: s.drives,
            fixed_files: s.fixed_files,
            fixed_buffers_ok: s.fixed_buffers_ok,
            registry: Arc::new(Mutex::new(Registry::new(s.unregistered))),
            provider,
            localities,
            origin: Origin::here(),
            staging: Default::default(),
            slices: Default::default(),
            slice_staging: config.slice_staging,
        })
    }
}

/// Per drive: `chunk` or the device's `max_sectors_kb` clamped to 1-4 MiB,
/// rounded to a multiple of the model's required alignment (a direct
/// chunk must stay aligned).
fn chunk_sizes(model: &Model, chunk: Option<usize>) -> Vec<usize> {
    let align = model.required_align();
    (0..model.drives().len())
        .map(|i| {
            let dev_max = model
                .files()
                .iter()
                .find(|f| f.drive == i)
                .and_then(|f| topology::max_request_bytes(f.topo.dev_major, f.topo.dev_minor));
            let c = chunk.unwrap_or_else(|| dev_max.unwrap_or(1 << 20).clamp(1 << 20, 4 << 20));
            (c.max(align) / align) * align
        })
        .collect()
}

/// The largest chunk a drive's reads may grow to: the configured chunk
/// when there is one (the caller chose), else up to
/// `plan::chunk::GROWN_CHUNK_MAX`.
fn chunk_max(chunk: usize, config: &EngineConfig) -> usize {
    match config.chunk {
        Some(_) => chunk,
        None => chunk.max(chunk::GROWN_CHUNK_MAX),
    }
}

/// The largest chunk of a whole-model load's reads on a drive that
/// completes reads inline (its pread workers): [`chunk::BULK_CHUNK_MAX`],
/// unless the configuration fixed the chunk (the caller chose).
fn bulk_max(config: &EngineConfig) -> Option<usize> {
    config.chunk.is_none().then_some(chunk::BULK_CHUNK_MAX)
}

/// Each drive's NUMA locality from `provider`.
fn localities(model: &Model, provider: &Provider) -> Vec<Locality> {
    model
        .drives()
        .iter()
        .enumerate()
        .map(|(i, d)| {
            let id = model
                .files()
                .iter()
                .find(|f| f.drive == i)
                .map(|f| (f.topo.dev_major, f.topo.dev_minor));
            let l = provider.drive_locality(&d.device, id);
            match l.node {
                Some(n) => tracing::debug!(drive = %d.device, node = n, cpuset = ?l.cpuset, "NUMA locality"),
                None => tracing::debug!(drive = %d.device, why = ?l.note, "NUMA locality unknown"),
            }
            l
        })
        .collect()
}

/// The io_uring backend unless the configuration says pread; with `Auto`,
/// the pread backend when io_uring cannot be set up (warned, and the
/// reason kept for the stats).
fn start(
    model: &Model,
    depth: usize,
    config: &EngineConfig,
    chunks: &[usize],
    placements: &[ThreadPlacement],
    nodes: &[Option<usize>],
) -> Result<Started> {
    let (mut reason, mut fallback) = (None, false);
    if config.backend != BackendChoice::Pread {
        match start_rings(model, depth, config, chunks, placements, nodes) {
            Ok((io, drives, files)) => {
                if drives.iter().all(|d| d.1.is_none()) {
                    // Every drive went to pread workers (each completes reads
                    // inline): no ring runs, so nothing is registered.
                    return Ok(Started {
                        io,
                        backend: Backend::Pread,
                        backend_reason: Some(
                            "chosen per drive: every drive completes reads inline, and pread workers read such a drive faster than rings (backend auto)"
                                .into(),
                        ),
                        fallback: false,
                        drives: drives.into_iter().map(|d| d.0).collect(),
                        fixed_files: Feature {
                            enabled: false,
                            reason: Some("pread workers on every drive".into()),
                        },
                        fixed_buffers_ok: false,
                        unregistered: Some("pread workers on every drive".into()),
                    });
                }
                let rings = || drives.iter().filter_map(|d| d.1.as_ref());
                let buffers_ok = rings().all(|r| r.fixed_buffers.is_ok());
                let unregistered = rings().find_map(|r| r.fixed_buffers.clone().err());
                if let Some(why) = &unregistered {
                    tracing::warn!("fixed buffers unavailable ({why}); reads use plain Read (counted per drive as chunks_unregistered)");
                }
                return Ok(Started {
                    io,
                    backend: Backend::Uring,
                    backend_reason: None,
                    fallback: false,
                    drives: drives.into_iter().map(|d| d.0).collect(),
                    fixed_files: files,
                    fixed_buffers_ok: buffers_ok,
                    unregistered,
                });
            }
            Err(ring::StartError::Spawn(e)) => return Err(spawn_error(model, e)),
            Err(ring::StartError::Setup(e)) => {
                let hint = setup_hint(e.raw_os_error(), memlock_limit().0);
                if config.backend != BackendChoice::Auto {
                    return Err(Error::Config(format!(
                        "io_uring_setup failed: {e}{hint}; use --backend pread (or auto)"
                    )));
                }
                let why = format!("io_uring unavailable ({e}{hint}); using the pread backend");
                tracing::warn!("{why}");
                reason = Some(why);
                fallback = true;
            }
        }
    }
    let reason = reason.or_else(|| (config.backend == BackendChoice::Pread).then(|| "chosen by configuration".into()));
    let mut s = start_pread(model, depth, config, chunks, placements, nodes, reason)?;
    s.fallback = fallback;
    Ok(s)
}

/// One pread worker pool per drive.
fn start_pread(
    model: &Model,
    depth: usize,
    config: &EngineConfig,
    chunks: &[usize],
    placements: &[ThreadPlacement],
    nodes: &[Option<usize>],
    reason: Option<String>,
) -> Result<Started> {
    let io = make_io(model, depth, &vec![false; chunks.len()], nodes, &vec![1; chunks.len()])
        .map_err(|e| Error::io("<engine>", "eventfd", e))?;
    let mut drives = Vec::new();
    for (i, &chunk) in chunks.iter().enumerate() {
        let (threads, binding) = match pread::start(&io, i, config.pread_threads.min(depth), &placements[i]) {
            Ok(t) => t,
            Err(e) => {
                stop(&io, &mut drives);
                return Err(spawn_error(model, e));
            }
        };
        drives.push(DriveIo {
            threads,
            chunk,
            chunk_max: chunk_max(chunk, config),
            bulk_max: None,
            ring: None,
            submit: None,
            binding,
        });
    }
    Ok(Started {
        io,
        backend: Backend::Pread,
        backend_reason: reason,
        fallback: false,
        drives,
        fixed_files: Feature {
            enabled: false,
            reason: Some("pread backend".into()),
        },
        fixed_buffers_ok: false,
        unregistered: Some("pread backend".into()),
    })
}

/// Whether the block device behind drive `i` completes by polling
/// (`queue/io_poll`).
fn drive_polls(model: &Model, i: usize) -> bool {
    model
        .files()
        .iter()
        .find(|f| f.drive == i)
        .and_then(|f| topology::queue_attr(f.topo.dev_major, f.topo.dev_minor, "io_poll"))
        .is_some_and(|v| v == "1")
}

/// The lanes (`lanes[d]` per drive, with an eventfd each where `rings[d]`:
/// a ring thread waits on it; pread workers wait on the lane's condvar)
/// and the load trackers of every drive. A drive's lanes share its queue
/// depth.
fn make_io(
    model: &Model,
    depth: usize,
    rings: &[bool],
    nodes: &[Option<usize>],
    lanes: &[usize],
) -> std::io::Result<Arc<Io>> {
    let n = model.drives().len();
    let mut queues = Vec::new();
    let mut ranges = Vec::with_capacity(n);
    for (d, &k) in lanes.iter().enumerate() {
        // The drive's depth, shared by its lanes (each at least 1).
        let share = depth.div_ceil(k.max(1)).max(1);
        let start = queues.len();
        for _ in 0..k.max(1) {
            let efd = if rings[d] {
                Some(rustix::event::eventfd(0, rustix::event::EventfdFlags::CLOEXEC)?)
            } else {
                None
            };
            queues.push(Arc::new(DriveQueue::new(d, share, efd)));
        }
        ranges.push(start..queues.len());
    }
    Ok(Arc::new(Io {
        model: model.clone(),
        queues,
        lanes: ranges,
        next_lane: (0..n).map(|_| std::sync::atomic::AtomicUsize::new(0)).collect(),
        loads: (0..n).map(|_| DriveLoad::new(1e9)).collect(),
        nodes: nodes.to_vec(),
        cancelled: std::sync::atomic::AtomicBool::new(false),
    }))
}

/// Per drive, its threads and, for rings, the first ring's setup (`None`:
/// pread workers read the drive).
type RingStart = (Arc<Io>, Vec<(DriveIo, Option<ring::RingSetup>)>, Feature);

fn start_rings(
    model: &Model,
    depth: usize,
    config: &EngineConfig,
    chunks: &[usize],
    placements: &[ThreadPlacement],
    nodes: &[Option<usize>],
) -> std::result::Result<RingStart, ring::StartError> {
    // Per drive: polled or not, its CPUs, and how reads are issued (for
    // `auto`, from a probe of how the drive completes reads).
    let mut setups = Vec::with_capacity(chunks.len());
    for (i, place) in placements.iter().enumerate() {
        let iopoll = match config.iopoll {
            IoPoll::Off => false,
            IoPoll::Auto => drive_polls(model, i),
            IoPoll::Force => true,
        };
        let cpus = place
            .locality
            .cpuset
            .as_deref()
            .and_then(parse_list)
            .map(|c| c.len())
            .filter(|&n| n > 0)
            .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
        let probe = (config.submit == SubmitMode::Auto && !iopoll)
            .then(|| model.files().iter().filter(|f| f.drive == i).max_by_key(|f| f.size))
            .flatten()
            .map(ring::probe_submit);
        let workers = (config.backend == BackendChoice::Auto).then(|| config.pread_threads.min(depth));
        let plan = lanes::plan_submit(config.submit, probe.as_ref(), cpus, workers);
        match plan.pread {
            // A choice, said once per drive (and kept in its stats).
            Some(_) => tracing::info!(drive = %model.drives()[i].device, "submit: {}", plan.why),
            None => tracing::debug!(drive = %model.drives()[i].device, "submit: {}", plan.why),
        }
        setups.push((iopoll, cpus, plan));
    }
    let lanes: Vec<usize> = setups.iter().map(|s| s.2.rings).collect();
    let rings: Vec<bool> = setups.iter().map(|s| s.2.pread.is_none()).collect();
    let io = make_io(model, depth, &rings, nodes, &lanes).map_err(ring::StartError::Setup)?;
    let mut out: Vec<(DriveIo, Option<ring::RingSetup>)> = Vec::new();
    for (i, (&chunk, (iopoll, cpus, plan))) in chunks.iter().zip(setups).enumerate() {
        if let Some(workers) = plan.pread {
            match pread::start(&io, i, workers, &placements[i]) {
                Ok((threads, binding)) => out.push((
                    DriveIo {
                        threads,
                        chunk,
                        chunk_max: chunk_max(chunk, config),
                        bulk_max: bulk_max(config),
                        ring: None,
                        submit: Some((plan, None)),
                        binding,
                    },
                    None,
                )),
                Err(e) => {
                    let mut started: Vec<DriveIo> = out.into_iter().map(|d| d.0).collect();
                    stop(&io, &mut started);
                    return Err(ring::StartError::Spawn(e));
                }
            }
            continue;
        }
        let cfg = RingConfig {
            depth: depth as u32,
            sqpoll: config.sqpoll,
            iopoll,
            punt: plan.punt,
            cpus: config.iowq_workers.unwrap_or(cpus as u32),
        };
        let mut threads = Vec::new();
        let mut first: Option<ring::RingSetup> = None;
        for lane in io.lanes[i].clone() {
            match ring::start(&io, lane, cfg, placements[i].clone()) {
                Ok((handle, setup)) => {
                    threads.push(handle);
                    first.get_or_insert(setup);
                }
                Err(e) => {
                    let mut started: Vec<DriveIo> = out.into_iter().map(|d| d.0).collect();
                    started.push(DriveIo {
                        threads,
                        chunk,
                        chunk_max: chunk_max(chunk, config),
                        bulk_max: None,
                        ring: None,
                        submit: None,
                        binding: String::new(),
                    });
                    stop(&io, &mut started);
                    return Err(e);
                }
            }
        }
        let setup = first.expect("a drive has at least one lane");
        let desc = format!(
            "{}{}",
            setup.flags,
            match &setup.fixed_files {
                Ok(()) => ", fixed files".to_string(),
                Err(e) => format!(", no fixed files ({e})"),
            }
        );
        out.push((
            DriveIo {
                threads,
                chunk,
                chunk_max: chunk_max(chunk, config),
                bulk_max: None,
                ring: Some(desc),
                submit: Some((plan, setup.iowq_workers)),
                binding: setup.binding.clone(),
            },
            Some(setup),
        ));
    }
    let refused = out
        .iter()
        .filter_map(|d| d.1.as_ref())
        .find_map(|r| r.fixed_files.clone().err());
    if let Some(why) = &refused {
        tracing::warn!("fixed files unavailable ({why}); reads use plain descriptors");
    }
    Ok((
        io,
        out,
        Feature {
            enabled: refused.is_none(),
            reason: refused,
        },
    ))
}

/// What to do about an `io_uring_setup` failure, by errno.
fn setup_hint(errno: Option<i32>, memlock_soft: Option<u64>) -> String {
    match errno {
        Some(libc::EPERM) => ": kernel.io_uring_disabled or a seccomp profile".to_string(),
        Some(libc::ENOSYS) => ": kernel without io_uring or a seccomp profile".to_string(),
        Some(libc::ENOMEM) => format!(
            ": out of memory, or RLIMIT_MEMLOCK ({}) too low for the rings (kernels before 5.12 charge rings to it; raise `ulimit -l`)",
            memlock_soft.map_or("unlimited".to_string(), |s| format!("{} KiB", s / 1024))
        ),
        _ => String::new(),
    }
}

/// A thread could not be created: no backend works without threads.
fn spawn_error(model: &Model, e: std::io::Error) -> Error {
    let hint = if e.raw_os_error() == Some(libc::EAGAIN) {
        let l = rustix::process::getrlimit(rustix::process::Resource::Nproc);
        format!(
            " (the user's process/thread limit RLIMIT_NPROC is {}: raise `ulimit -u`, or the system's threads-max / a cgroup pids.max is reached)",
            l.current.map_or("unlimited".to_string(), |v| v.to_string())
        )
    } else {
        String::new()
    };
    Error::io(
        model.catalog().dir(),
        "start an I/O thread",
        std::io::Error::new(e.kind(), format!("{e}{hint}")),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn setup_failures_say_what_to_do() {
        let h = setup_hint(Some(libc::ENOMEM), Some(64 << 10));
        assert!(h.contains("RLIMIT_MEMLOCK (64 KiB)") && h.contains("ulimit -l"), "{h}");
        assert!(setup_hint(Some(libc::EPERM), None).contains("io_uring_disabled"));
        assert!(setup_hint(Some(libc::ENOSYS), None).contains("kernel without io_uring"));
        assert_eq!(setup_hint(Some(libc::EINVAL), None), "");
    }
}
