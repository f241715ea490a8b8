//! The device ceiling: sequential O_DIRECT reads with io_uring over a set of
//! files, one reader thread per drive, all drives at once. It is the same
//! job as `fio --ioengine=io_uring --direct=1 --rw=read --bs=BS
//! --iodepth=QD`, so every weightstream figure can be stated as a ratio to
//! what the drives did in the same run.

use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::time::Instant;

use io_uring::{opcode, types, IoUring};
use serde::Serialize;

use crate::arena::{Arena, Slot, SlotSpec};
use crate::error::{Error, Result};
use crate::model::open_direct;

/// How to measure.
#[derive(Debug, Clone, Copy)]
pub struct CeilingConfig {
    /// Bytes per read.
    pub bs: usize,
    /// Reads in flight per drive.
    pub qd: usize,
    /// Stop after this many bytes per drive (default: every byte of the files).
    pub bytes: Option<u64>,
}

impl Default for CeilingConfig {
    fn default() -> Self {
        CeilingConfig {
            bs: 1 << 20,
            qd: 16,
            bytes: None,
        }
    }
}

/// One drive's result.
#[derive(Debug, Clone, Serialize)]
pub struct DriveCeiling {
    pub device: String,
    pub files: Vec<PathBuf>,
    pub bytes: u64,
    pub seconds: f64,
    pub gbps: f64,
}

/// The whole measurement. GB are 10^9 bytes.
#[derive(Debug, Clone, Serialize)]
pub struct CeilingReport {
    pub drives: Vec<DriveCeiling>,
    pub bytes: u64,
    pub seconds: f64,
    pub gbps: f64,
    /// CPU seconds (user + system) of the whole process during the run.
    pub cpu_seconds: f64,
}

/// CPU seconds (user, system) this process has used so far, all threads
/// (`getrusage(RUSAGE_SELF)`).
pub fn process_cpu() -> (f64, f64) {
    let mut u = std::mem::MaybeUninit::<libc::rusage>::zeroed();
    // SAFETY: getrusage writes one `rusage` into the pointer it is given; the
    // buffer is a properly sized and aligned `rusage`.
    let rc = unsafe { libc::getrusage(libc::RUSAGE_SELF, u.as_mut_ptr()) };
    if rc != 0 {
        return (0.0, 0.0);
    }
    // SAFETY: the call succeeded, so the struct is initialised (and it was
    // zeroed before: every bit pattern of it is valid anyway).
    let u = unsafe { u.assume_init() };
    let t = |tv: libc::timeval| tv.tv_sec as f64 + tv.tv_usec as f64 * 1e-6;
    (t(u.ru_utime), t(u.ru_stime))
}

/// CPU seconds (user + system) this process has used so far, all threads.
pub fn process_cpu_seconds() -> f64 {
    let (u, s) = process_cpu();
    u + s
}

/// Reads `paths` (grouped by drive) and reports GB/s per drive and in total.
pub fn measure(paths: &[PathBuf], cfg: &CeilingConfig) -> Result<CeilingReport> {
    if cfg.bs == 0 || !cfg.bs.is_multiple_of(4096) {
        return Err(Error::Config(format!(
            "block size {} must be a non-zero multiple of 4096",
            cfg.bs
        )));
    }
    let mut groups: Vec<(u64, String, Vec<PathBuf>)> = Vec::new();
    for p in paths {
        let f = std::fs::File::open(p).map_err(|e| Error::io(p, "open", e))?;
        let t = crate::topology::probe(p, &f).map_err(|e| Error::io(p, "statx", e))?;
        match groups.iter_mut().find(|g| g.0 == t.dev) {
            Some(g) => g.2.push(p.clone()),
            None => groups.push((t.dev, t.device.clone(), vec![p.clone()])),
        }
    }
    let cpu0 = process_cpu_seconds();
    let t0 = Instant::now();
    let results: Vec<Result<DriveCeiling>> = std::thread::scope(|s| {
        let hs: Vec<_> = groups
            .iter()
            .map(|(_, dev, files)| s.spawn(move || read_drive(dev, files, cfg)))
            .collect();
        hs.into_iter()
            .map(|h| h.join().expect("ceiling reader panicked"))
            .collect()
    });
    let seconds = t0.elapsed().as_secs_f64();
    let cpu_seconds = process_cpu_seconds() - cpu0;
    let drives = results.into_iter().collect::<Result<Vec<_>>>()?;
    let bytes = drives.iter().map(|d| d.bytes).sum();
    Ok(CeilingReport {
        gbps: bytes as f64 / 1e9 / seconds.max(1e-9),
        drives,
        bytes,
        seconds,
        cpu_seconds,
    })
}

/// One `io_uring_enter` waiting for a completion; EINTR, EAGAIN and EBUSY
/// (a signal, a full completion queue) are retried, not errors.
fn enter(ring: &mut IoUring) -> std::io::Result<usize> {
    let mut tries = 0u32;
    loop {
        match ring.submit_and_wait(1) {
            Ok(n) => return Ok(n),
            Err(e) if matches!(e.raw_os_error(), Some(libc::EINTR | libc::EAGAIN | libc::EBUSY)) && tries < 1000 => {
                tries += 1;
                if e.raw_os_error() != Some(libc::EINTR) {
                    std::thread::sleep(std::time::Duration::from_micros(100));
                }
            }
            Err(e) => return Err(e),
        }
    }
}

struct Pending {
    file: usize,
    off: u64,
    len: u32,
}

fn read_drive(device: &str, files: &[PathBuf], cfg: &CeilingConfig) -> Result<DriveCeiling> {
    let opened = files
        .iter()
        .map(|p| {
            let f = open_direct(p).map_err(|e| Error::io(p, "open(O_DIRECT)", e))?;
            let size = f.metadata().map_err(|e| Error::io(p, "fstat", e))?.len();
            Ok((f, size))
        })
        .collect::<Result<Vec<_>>>()?;
    let cap = cfg.bytes.unwrap_or(u64::MAX);
    // Work list: every block of every file, in file order.
    let mut work = opened.iter().enumerate().flat_map(|(i, (_, size))| {
        let bs = cfg.bs as u64;
        (0..size.div_ceil(bs)).map(move |k| {
            let off = k * bs;
            // The last read is rounded up to the block: O_DIRECT returns the
            // bytes up to end of file.
            let len = (size - off).min(bs).div_ceil(4096) * 4096;
            Pending {
                file: i,
                off,
                len: len as u32,
            }
        })
    });
    let qd = cfg.qd.max(1);
    let arena = Arena::new(SlotSpec::new(cfg.bs), qd)?;
    let mut slots: Vec<Slot> = (0..qd).map(|_| arena.take().expect("qd slots")).collect();
    let mut ring =
        IoUring::new((qd as u32).next_power_of_two()).map_err(|e| Error::io(Path::new(device), "io_uring_setup", e))?;
    let mut free: Vec<usize> = (0..qd).rev().collect();
    let (mut inflight, mut bytes, mut issued) = (0usize, 0u64, 0u64);
    let mut first_err: Option<Error> = None;
    let t0 = Instant::now();
    loop {
        while first_err.is_none() && issued < cap {
            let Some(&i) = free.last() else { break };
            let Some(p) = work.next() else { break };
            free.pop();
            let fd = types::Fd(opened[p.file].0.as_raw_fd());
            let ptr = slots[i].as_bytes_mut().as_mut_ptr();
            let e = opcode::Read::new(fd, ptr, p.len)
                .offset(p.off)
                .build()
                .user_data(i as u64 | (p.file as u64) << 32);
            // SAFETY: the buffer is slot `i`, which `slots` keeps alive and
            // hands to no other read until this one's completion is reaped
            // (the loop drains every read before returning, even on error).
            unsafe { ring.submission().push(&e) }.expect("ring sized to qd");
            inflight += 1;
            issued += p.len as u64;
        }
        if inflight == 0 {
            break;
        }
        if let Err(e) = enter(&mut ring) {
            // Stop issuing, and drain what the kernel holds before any slot
            // can go: keep reaping for a while; if the ring cannot be
            // entered at all, leak the ring and the slots rather than free
            // memory the kernel may still write.
            first_err.get_or_insert(Error::io(Path::new(device), "io_uring_enter", e));
            let deadline = Instant::now() + std::time::Duration::from_secs(10);
            while inflight > 0 && Instant::now() < deadline {
                let _ = enter(&mut ring);
                inflight -= ring.completion().count();
                std::thread::sleep(std::time::Duration::from_millis(1));
            }
            if inflight > 0 {
                tracing::error!(device, "ceiling: {inflight} read(s) still in the kernel after io_uring_enter failed; their buffers are leaked");
                std::mem::forget(slots);
                std::mem::forget(arena);
                std::mem::forget(ring);
                return Err(first_err.expect("set above"));
            }
            break;
        }
        for c in ring.completion() {
            let i = (c.user_data() & 0xffff_ffff) as usize;
            let file = (c.user_data() >> 32) as usize;
            inflight -= 1;
            free.push(i);
            if c.result() < 0 {
                let e = std::io::Error::from_raw_os_error(-c.result());
                first_err.get_or_insert(Error::io(&files[file], "O_DIRECT read", e));
            } else {
                bytes += c.result() as u64;
            }
        }
    }
    let seconds = t0.elapsed().as_secs_f64();
    drop(slots);
    if let Some(e) = first_err {
        return Err(e);
    }
    Ok(DriveCeiling {
        device: device.to_string(),
        files: files.to_vec(),
        bytes,
        seconds,
        gbps: bytes as f64 / 1e9 / seconds.max(1e-9),
    })
}
