//! `Weights::Probe`: each copy rank's read rate, measured by the first
//! engine made on a model (the engine owns the drives' I/O; `Model::open`
//! reads no data), with a minimal timed O_DIRECT reader: one io_uring, one
//! configuration. The device ceiling *sweep* (many configurations, fio,
//! bench) is the `weightstream` command's; this is only what the library
//! needs to weigh its copies.

use std::fs::File;
use std::os::fd::AsRawFd;
use std::time::Instant;

use io_uring::{opcode, types, IoUring};

use crate::error::escape;
use crate::memory::{Arena, Slot, SlotSpec};
use crate::model::Model;

/// Reads up to `bytes_per_drive` from each drive's files (sequential blocks
/// of `bs` bytes, one file after the other, at most `qd` reads in flight
/// per drive, every drive at once) through their O_DIRECT descriptors, and
/// returns GB/s over all of them. A failed read is the error.
pub(crate) fn timed_read(drives: &[Vec<&File>], bs: usize, qd: usize, bytes_per_drive: u64) -> std::io::Result<f64> {
    let qd = qd.max(1);
    let total_slots = qd * drives.len();
    if total_slots == 0 {
        return Ok(0.0);
    }
    let arena = Arena::new(SlotSpec::new(bs), total_slots).map_err(std::io::Error::other)?;
    let mut slots: Vec<_> = std::iter::from_fn(|| arena.take().ok()).collect();
    let mut ring = IoUring::new((total_slots as u32).next_power_of_two())?;
    // Per drive: (file index, offset in it, bytes issued).
    let mut cursor: Vec<(usize, u64, u64)> = vec![(0, 0, 0); drives.len()];
    let sizes: Vec<Vec<u64>> = drives
        .iter()
        .map(|fs| fs.iter().map(|f| f.metadata().map_or(0, |m| m.len())).collect())
        .collect();
    // The next block of drive `d`: (fd, offset), or None when its budget or files are spent.
    let mut next = |d: usize| -> Option<(i32, u64)> {
        let c = &mut cursor[d];
        while c.0 < drives[d].len() && c.1 >= sizes[d][c.0] {
            c.0 += 1;
            c.1 = 0;
        }
        if c.0 >= drives[d].len() || c.2 >= bytes_per_drive {
            return None;
        }
        let at = (drives[d][c.0].as_raw_fd(), c.1);
        c.1 += bs as u64;
        c.2 += bs as u64;
        Some(at)
    };
    let t0 = Instant::now();
    let (mut inflight, mut bytes, mut failed) = (0usize, 0u64, None);
    let push =
        |ring: &mut IoUring, k: usize, slot: &mut Slot, next: &mut dyn FnMut(usize) -> Option<(i32, u64)>| -> bool {
            let d = k / qd;
            let Some((fd, off)) = next(d) else { return false };
            let e = opcode::Read::new(types::Fd(fd), slot.as_bytes_mut().as_mut_ptr(), bs as u32)
                .offset(off)
                .build()
                .user_data(k as u64);
            // SAFETY: the entry reads into slot `k` of `arena`, which is not
            // read or reused until this entry's completion is reaped below (or,
            // when the ring cannot be entered, every slot, the arena and the
            // ring are leaked); the ring has room for every slot's entry.
            unsafe { ring.submission().push(&e) }.is_ok()
        };
    for (k, slot) in slots.iter_mut().enumerate() {
        if push(&mut ring, k, slot, &mut next) {
            inflight += 1;
        }
    }
    while inflight > 0 {
        if let Err(e) = ring.submit_and_wait(1) {
            if e.raw_os_error() == Some(libc::EINTR) {
                continue;
            }
            // The kernel may still write into the slots: never free them.
            std::mem::forget(slots);
            std::mem::forget(arena);
            std::mem::forget(ring);
            return Err(e);
        }
        let done: Vec<(usize, i32)> = ring
            .completion()
            .map(|c| (c.user_data() as usize, c.result()))
            .collect();
        for (k, res) in done {
            inflight -= 1;
            if res < 0 {
                failed.get_or_insert(std::io::Error::from_raw_os_error(-res));
                continue;
            }
            bytes += res as u64;
            if failed.is_none() && push(&mut ring, k, &mut slots[k], &mut next) {
                inflight += 1;
            }
        }
    }
    if let Some(e) = failed {
        return Err(e);
    }
    Ok(bytes as f64 / 1e9 / t0.elapsed().as_secs_f64().max(1e-9))
}

/// Measures each copy rank with a short O_DIRECT read (8 reads of 19 MiB in
/// flight per drive, 8 x 19 MiB per drive, the rank's drives at once) and
/// turns GB/s into weights; a failed probe gives equal weights and why
/// (said once).
pub(crate) fn probe_weights(model: &Model) -> (Vec<f64>, Option<String>) {
    let files = model.files();
    let ranks = model.rank_weights().len();
    const BS: usize = 19 << 20;
    const QD: usize = 8;
    let mut w = Vec::with_capacity(ranks);
    for r in 0..ranks {
        // The rank's O_DIRECT descriptors, grouped by drive.
        let mut drives: Vec<(usize, Vec<&File>)> = Vec::new();
        let mut missing = None;
        for f in files.iter().filter(|f| f.rank == r) {
            let Some(d) = f.direct.as_ref() else {
                missing = Some(format!("{} has no O_DIRECT descriptor", escape(&f.path)));
                break;
            };
            match drives.iter_mut().find(|g| g.0 == f.drive) {
                Some(g) => g.1.push(d),
                None => drives.push((f.drive, vec![d])),
            }
        }
        let groups: Vec<Vec<&File>> = drives.into_iter().map(|g| g.1).collect();
        let why = match missing {
            Some(m) => m,
            None => match timed_read(&groups, BS, QD, (QD * BS) as u64) {
                Ok(gbps) if gbps > 0.0 => {
                    w.push(gbps);
                    continue;
                }
                Ok(gbps) => format!("it measured {gbps} GB/s"),
                Err(e) => e.to_string(),
            },
        };
        let why = format!("weight probe of copy rank {r} failed ({why}); using equal weights");
        tracing::warn!("{why} (reported as weights_note in the stats)");
        return (vec![1.0; ranks], Some(why));
    }
    tracing::info!("probed weights (GB/s per copy rank): {w:?}");
    (w, None)
}
