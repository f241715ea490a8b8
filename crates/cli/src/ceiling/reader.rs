//! One reader: a thread's own io_uring, its buffers (one mapping, faulted
//! in before the timed region, optionally on huge pages and registered),
//! and its loop of O_DIRECT reads. The unsafe of the ceiling lives here:
//! every buffer an SQE names stays mapped until its completion is reaped,
//! or the ring and the buffers are leaked together.

use std::mem::ManuallyDrop;
use std::os::fd::AsRawFd;
use std::path::Path;
use std::time::{Duration, Instant};

use io_uring::{opcode, squeue, types, IoUring};

use super::config::{size_label, Buffers, ReadConfig, Submit};
use super::drives::Drive;
use super::plan::{Part, Plan, ReaderOutcome};
use crate::error::{Error, Result};

/// A reader's `qd` buffers of `bs` bytes, one anonymous mapping
/// (`MADV_DONTFORK`), faulted in before the timed region. With `huge`, the
/// buffers start on a 2 MiB boundary and are advised `MADV_HUGEPAGE`:
/// physically contiguous buffers make fewer, larger device requests where
/// a request's segment count is capped (virtio: 254 segments, 1 MiB of 4 KiB
/// pages; measured: 1.4-1.5 GB/s with 4 KiB pages, 3.5-3.8 GB/s with huge
/// pages, same configuration, same files).
pub(super) struct BufMap {
    /// The mapping (for munmap).
    pub(super) map: std::ptr::NonNull<u8>,
    pub(super) map_len: usize,
    /// The first buffer.
    pub(super) base: *mut u8,
    pub(super) len: usize,
    pub(super) bs: usize,
}

pub(super) const HUGE: usize = 2 << 20;

impl BufMap {
    pub(super) fn new(bs: usize, qd: usize, huge: bool) -> Result<Self> {
        use rustix::mm::{Advice, MapFlags, ProtFlags};
        let len = bs
            .checked_mul(qd)
            .filter(|&l| l <= isize::MAX as usize - HUGE)
            .ok_or_else(|| Error::Config(format!("{qd} buffers of {bs} bytes overflow")))?;
        let map_len = if huge { len + HUGE } else { len };
        // SAFETY: a fresh anonymous private mapping at an address of the
        // kernel's choosing aliases no existing memory.
        let map = unsafe {
            rustix::mm::mmap_anonymous(
                std::ptr::null_mut(),
                map_len,
                ProtFlags::READ | ProtFlags::WRITE,
                MapFlags::PRIVATE,
            )
        }
        .map_err(|e| Error::io("<ceiling buffers>", "mmap", e))?;
        let map = std::ptr::NonNull::new(map.cast::<u8>())
            .ok_or_else(|| Error::Config("mmap returned a null address".into()))?;
        let skip = if huge {
            map.as_ptr().align_offset(HUGE).min(HUGE)
        } else {
            0
        };
        // SAFETY: `skip <= HUGE`, and the mapping is `len + HUGE` bytes when
        // `huge` (`skip` is 0 otherwise): `base..base+len` is inside it.
        let base = unsafe { map.as_ptr().add(skip) };
        let me = BufMap {
            map,
            map_len,
            base,
            len,
            bs,
        };
        if huge {
            // SAFETY: exactly the mapping just made, owned by `me`; the advice
            // changes how it is backed, never its contents or address. A
            // kernel without THP refuses it: small pages then.
            let _ = unsafe { rustix::mm::madvise(map.as_ptr().cast(), map_len, Advice::LinuxHugepage) };
        }
        // SAFETY: as above; fork() then does not copy memory the kernel may
        // be writing.
        let _ = unsafe { rustix::mm::madvise(map.as_ptr().cast(), map_len, Advice::LinuxDontFork) };
        // Fault every page in now (one write per page), outside the timing.
        for off in (0..len).step_by(4096) {
            // SAFETY: `off < len`: inside the buffers, which nothing else
            // references yet.
            unsafe { base.add(off).write_volatile(0) };
        }
        Ok(me)
    }

    /// Buffer `i` (< qd).
    pub(super) fn buf(&self, i: usize) -> *mut u8 {
        debug_assert!((i + 1) * self.bs <= self.len);
        // SAFETY: `i * bs + bs <= len` (i < qd): inside the buffers.
        unsafe { self.base.add(i * self.bs) }
    }
}

impl Drop for BufMap {
    fn drop(&mut self) {
        // SAFETY: the mapping made by `new`; its owner (a `Reader`) drops it
        // only with nothing in flight and after the ring that registered it.
        let _ = unsafe { rustix::mm::munmap(self.map.as_ptr().cast(), self.map_len) };
    }
}

pub(super) fn pages_label(huge: bool) -> String {
    if huge {
        format!("huge pages (MADV_HUGEPAGE, THP {})", thp_mode())
    } else {
        "4 KiB pages".into()
    }
}

/// Whether transparent huge pages can back a `MADV_HUGEPAGE` mapping, as
/// the kernel says (`always`, `madvise` or `never`, from
/// /sys/kernel/mm/transparent_hugepage/enabled).
pub fn thp_mode() -> String {
    std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/enabled")
        .ok()
        .and_then(|s| {
            let a = s.find('[')?;
            let b = s[a..].find(']')? + a;
            Some(s[a + 1..b].to_string())
        })
        .unwrap_or_else(|| "unknown".into())
}

/// One reader: a ring, `qd` buffers (registered for `Buffers::Fixed`), and
/// the count of reads the kernel holds. Dropping it with reads in flight
/// reaps them first (up to 10 s); if the kernel keeps some, the ring and
/// the buffers are leaked, never freed under it.
pub(super) struct Reader<'d> {
    pub(super) device: &'d str,
    pub(super) config: ReadConfig,
    pub(super) ring: ManuallyDrop<IoUring>,
    pub(super) bufs: ManuallyDrop<BufMap>,
    /// File index of the read in flight into each slot.
    pub(super) file_of: Vec<u32>,
    pub(super) free: Vec<usize>,
    pub(super) inflight: usize,
}

impl<'d> Reader<'d> {
    pub(super) fn new(drive: &'d Drive, config: ReadConfig, huge: bool) -> Result<Self> {
        let dev = Path::new(&drive.device);
        let qd = config.qd;
        let bufs = BufMap::new(config.bs, qd, huge)?;
        let ring = IoUring::new((qd as u32).next_power_of_two()).map_err(|e| Error::io(dev, "io_uring_setup", e))?;
        let me = Reader {
            device: &drive.device,
            config,
            ring: ManuallyDrop::new(ring),
            bufs: ManuallyDrop::new(bufs),
            file_of: vec![0; qd],
            free: (0..qd).rev().collect(),
            inflight: 0,
        };
        if config.buffers == Buffers::Fixed {
            let iov: Vec<libc::iovec> = (0..qd)
                .map(|i| libc::iovec {
                    iov_base: me.bufs.buf(i).cast(),
                    iov_len: config.bs,
                })
                .collect();
            // SAFETY: each iovec is one slot of `arena`, which the reader owns
            // and drops only after the ring (the registration ends with the
            // ring), or leaks with it.
            unsafe { me.ring.submitter().register_buffers(&iov) }.map_err(|e| {
                let hint = if e.raw_os_error() == Some(libc::ENOMEM) {
                    " (RLIMIT_MEMLOCK: raise `ulimit -l`)"
                } else {
                    ""
                };
                Error::Config(format!(
                    "drive {}: io_uring register_buffers of {qd} x {} (registered buffers): {e}{hint}",
                    drive.device,
                    size_label(config.bs as u64)
                ))
            })?;
        }
        Ok(me)
    }

    /// Issues the part's blocks, `qd` in flight, until the part, the byte
    /// budget or the deadline ends, and reaps every read before returning.
    pub(super) fn run(
        &mut self,
        drive: &Drive,
        plan: &Plan,
        part: Part,
        budget: Option<u64>,
        deadline: Option<Instant>,
    ) -> ReaderOutcome {
        let n = plan.len;
        let (mut issued_blocks, mut issued, mut bytes) = (0usize, 0u64, 0u64);
        let mut error: Option<Error> = None;
        let mut stop = n == 0;
        loop {
            while !stop && error.is_none() {
                if part.count.is_some_and(|c| issued_blocks >= c)
                    || budget.is_some_and(|b| issued >= b)
                    || deadline.is_some_and(|d| Instant::now() >= d)
                {
                    stop = true;
                    break;
                }
                let Some(&i) = self.free.last() else { break };
                let b = plan.get((part.first + issued_blocks) % n);
                let fd = types::Fd(drive.opened[b.file as usize].0.as_raw_fd());
                let ptr = self.bufs.buf(i);
                let e = match self.config.buffers {
                    Buffers::Plain => opcode::Read::new(fd, ptr, b.len).offset(b.off).build(),
                    Buffers::Fixed => opcode::ReadFixed::new(fd, ptr, b.len, i as u16).offset(b.off).build(),
                };
                let e = match self.config.submit {
                    Submit::Inline => e,
                    Submit::Async => e.flags(squeue::Flags::ASYNC),
                }
                .user_data(i as u64);
                // SAFETY: the buffer is slot `i` (registered as buffer `i` for
                // ReadFixed), which `slots` keeps alive and hands to no other
                // read until this one's completion is reaped; a reader with
                // reads in flight is never freed (`Drop` reaps or leaks).
                if unsafe { self.ring.submission().push(&e) }.is_err() {
                    // Cannot happen (the ring holds `qd` entries and at most
                    // `qd` are out); stop rather than spin.
                    error = Some(Error::Config(format!(
                        "drive {}: io_uring submission queue full with {} reads out",
                        self.device, self.inflight
                    )));
                    break;
                }
                self.free.pop();
                self.file_of[i] = b.file;
                self.inflight += 1;
                issued_blocks += 1;
                issued += b.len as u64;
            }
            if self.inflight == 0 {
                break;
            }
            if let Err(e) = enter(&mut self.ring) {
                // Stop issuing; `Drop` reaps what the kernel holds (or leaks).
                error.get_or_insert(Error::io(Path::new(self.device), "io_uring_enter", e));
                break;
            }
            bytes += self.reap(drive, &mut error);
        }
        ReaderOutcome {
            bytes,
            end: Instant::now(),
            error,
        }
    }

    /// Reaps the completions there are: frees their slots, returns their
    /// bytes, records the first error (naming the file).
    pub(super) fn reap(&mut self, drive: &Drive, error: &mut Option<Error>) -> u64 {
        let mut bytes = 0;
        for c in self.ring.completion() {
            let i = c.user_data() as usize;
            self.inflight -= 1;
            self.free.push(i);
            if c.result() < 0 {
                let e = std::io::Error::from_raw_os_error(-c.result());
                let file = &drive.files[self.file_of[i] as usize];
                let op = match self.config.buffers {
                    Buffers::Plain => "O_DIRECT read (io_uring)",
                    Buffers::Fixed => "O_DIRECT read (io_uring, registered buffer)",
                };
                error.get_or_insert(Error::io(file, op, e));
            } else {
                bytes += c.result() as u64;
            }
        }
        bytes
    }
}

impl Drop for Reader<'_> {
    fn drop(&mut self) {
        let deadline = Instant::now() + Duration::from_secs(10);
        while self.inflight > 0 && Instant::now() < deadline {
            if enter(&mut self.ring).is_err() {
                std::thread::sleep(Duration::from_millis(1));
            }
            let n = self.ring.completion().count();
            self.inflight -= n;
        }
        if self.inflight > 0 {
            tracing::error!(
                device = self.device,
                "ceiling: {} read(s) still in the kernel after 10 s; their buffers and the ring are leaked",
                self.inflight
            );
            return;
        }
        // SAFETY: nothing is in flight, and each field is dropped once, here:
        // the ring first (ending the buffer registration), then the slots,
        // then the arena that maps them.
        unsafe {
            ManuallyDrop::drop(&mut self.ring);
            ManuallyDrop::drop(&mut self.bufs);
        }
    }
}

/// One `io_uring_enter` waiting for a completion; EINTR, EAGAIN and EBUSY
/// (a signal, a full completion queue) are retried, not errors.
pub(super) fn enter(ring: &mut IoUring) -> std::io::Result<usize> {
    let mut tries = 0u32;
    loop {
        match ring.submit_and_wait(1) {
            Ok(n) => return Ok(n),
            Err(e) if matches!(e.raw_os_error(), Some(libc::EINTR | libc::EAGAIN | libc::EBUSY)) && tries < 1000 => {
                tries += 1;
                if e.raw_os_error() != Some(libc::EINTR) {
                    std::thread::sleep(Duration::from_micros(100));
                }
            }
            Err(e) => return Err(e),
        }
    }
}
