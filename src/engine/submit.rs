//! The submit path of one read, step by step: plan the window and decide
//! direct or buffered (`plan`), route each chunk to a copy (the router),
//! then queue it on a lane of that copy's drive, waking each lane once.
//! Never blocks: each lane's I/O thread keeps at most its share of the
//! drive's `queue_depth` chunks in flight and takes the rest as room frees,
//! and the caller's slots bound how much can be queued.

use crate::config::MAX_COPY_RANKS;
use crate::engine::completion;
use crate::engine::inflight::Request;
use crate::engine::queue::Plain;
use crate::engine::queue::{Io, Job, Target};
use crate::engine::router::Candidate;
use crate::engine::sync::Arc as ReqArc;
use crate::engine::ticket::{Meta, Ticket};
use crate::engine::Engine;
use crate::error::Result;
use crate::format::catalog::TensorRef;
use crate::memory::Slot;
use crate::model::Model;
use crate::plan::chunk::{self, Chunk};
use crate::plan::direct::{self, DirectPlan};
use crate::stats::DriveCounters;
use crate::storage::files::ShardFile;

/// A drive one read touches.
#[derive(Debug, Clone, Copy, Default)]
struct Touched {
    drive: usize,
    /// Lanes of the drive (bit k: its k-th lane) with chunks queued since
    /// the last notify.
    queued: u64,
    direct: bool,
    buffered: bool,
}

impl Touched {
    /// Wakes the lanes this read queued chunks on since the last notify.
    fn notify(&mut self, io: &Io) {
        let start = io.lanes[self.drive].start;
        while self.queued != 0 {
            let k = self.queued.trailing_zeros() as usize;
            io.queues[start + k].notify();
            self.queued &= self.queued - 1;
        }
    }
}

/// The drives one read touches (at most one per copy): chunks queued since
/// the last notify, and whether it used each drive direct or buffered
/// (counted once per read per drive). No allocation per read.
#[derive(Default)]
struct Fanout {
    touched: [Touched; MAX_COPY_RANKS],
    n: usize,
}

impl Fanout {
    /// The entry of drive `d`, added on first use.
    fn of(&mut self, d: usize) -> &mut Touched {
        let i = match self.touched[..self.n].iter().position(|t| t.drive == d) {
            Some(i) => i,
            None => {
                self.touched[self.n] = Touched {
                    drive: d,
                    ..Touched::default()
                };
                self.n += 1;
                self.n - 1
            }
        };
        &mut self.touched[i]
    }

    /// Wakes every lane with chunks queued since the last notify.
    fn notify(&mut self, io: &Io) {
        for t in self.touched[..self.n].iter_mut() {
            t.notify(io);
        }
    }

    /// The read is queued: wake the drives, count one read per drive.
    fn finish(mut self, io: &Io, model: &Model) {
        self.notify(io);
        for t in &self.touched[..self.n] {
            let c = &model.drives()[t.drive].counters;
            if t.direct {
                DriveCounters::add(&c.reads_direct, 1);
            } else if t.buffered {
                DriveCounters::add(&c.reads_buffered, 1);
            }
        }
    }
}

impl Engine {
    /// [`Engine::read`] with a caller-supplied group key for `hash` routing.
    pub fn read_keyed(&self, tensor: &TensorRef, slot: Slot, key: u64) -> Result<Ticket> {
        self.read_with(tensor, slot, key, false)
    }

    /// [`Engine::read`] for a whole-model load, which keeps many reads in
    /// flight: on a drive that completes reads inline its chunks are as
    /// large as `plan::chunk::BULK_CHUNK_MAX` (no single read needs to
    /// spread over the drive's workers); elsewhere the same as `read`.
    pub(crate) fn read_bulk(&self, tensor: &TensorRef, slot: Slot) -> Result<Ticket> {
        self.read_with(tensor, slot, self.model.group_key(tensor), true)
    }

    fn read_with(&self, tensor: &TensorRef, mut slot: Slot, key: u64, bulk: bool) -> Result<Ticket> {
        self.origin.check()?;
        // A slot handed to forked children (`Loaded::inherit_on_fork`,
        // then `into_slot`) is fork-protected again before the kernel may
        // write it.
        slot.protect_for_read()?;
        let model = &self.model;
        let primary = model.file_of(tensor)?;
        let w = direct::plan(&primary.path, primary.size, tensor, &slot)?;
        if w.len == 0 {
            return Ok(Ticket::new(
                Request::new(slot, 0),
                w.pad,
                0,
                self.origin,
                Meta::of(model, tensor),
            ));
        }
        let copies = model.copies(tensor.shard);
        let n = copies.len().min(MAX_COPY_RANKS);
        let files: [&ShardFile; MAX_COPY_RANKS] = std::array::from_fn(|k| &model.files()[copies[k.min(n - 1)]]);
        // Direct or buffered, per copy (copies may sit on different filesystems).
        let mut direct = DirectPlan::decide(model.direct_mode(), w, &slot, &files[..n], model.drives());
        let w = direct.window;
        let chunk_size = self.chunk_for_read(files[..n].iter().map(|f| f.drive), w.len, bulk);
        let target = Target::of(&slot, self.buf_index(&slot));
        let candidates: [Candidate; MAX_COPY_RANKS] = std::array::from_fn(|k| self.candidate(files[k], &slot));
        let mut route = self.router.route_read(key, &candidates[..n]);
        let (pad, len) = (w.pad, w.len);
        let req = Request::new(slot, chunk::count(&w, chunk_size));
        let mut fanout = Fanout::default();
        for mut ch in chunk::split(&w, tensor.shard as u32, chunk_size) {
            let k = route.pick(ch.len, &self.io);
            let file = files[k];
            ch.file = copies[k] as u32;
            if ch.direct && !direct.copy_direct(k) {
                ch.direct = false;
                direct.count_refusal(k, file, &model.drives()[file.drive]);
            }
            let job = Job::new(ReqArc::clone(&req), ch, target, tensor.index as u32, pad, len);
            self.enqueue(job, file.drive, &mut fanout);
        }
        fanout.finish(&self.io, model);
        Ok(Ticket::new(req, pad, len, self.origin, Meta::of(model, tensor)))
    }

    /// Copy `file` as a routing candidate for a read into `slot`: its drive,
    /// its rank's weight, and whether that drive is on another NUMA node
    /// than the slot's arena (both known).
    fn candidate(&self, file: &ShardFile, slot: &Slot) -> Candidate {
        let rank_weight = self.model.rank_weights().get(file.rank).copied().unwrap_or(1.0);
        Candidate {
            drive: file.drive,
            weight: rank_weight,
            remote: matches!((slot.node(), self.localities[file.drive].node), (Some(s), Some(d)) if s != d),
        }
    }

    /// Queues `job` on a lane of drive `d` (never waiting: the lane's I/O
    /// thread takes queued chunks as its depth allows); a drive that stopped
    /// diverts the chunk to another copy (or fails it).
    fn enqueue(&self, job: Job, d: usize, fanout: &mut Fanout) {
        let ch: Chunk = job.chunk;
        let t = fanout.of(d);
        if ch.direct {
            t.direct = true;
        } else {
            t.buffered = true;
        }
        let counters = &self.model.drives()[d].counters;
        let lane = self.io.pick_lane(d);
        let q = &self.io.queues[lane];
        // A drive read by pread workers has no ring: nothing to count.
        match (job.target.plain, q.eventfd.is_some()) {
            (Plain::Fixed | Plain::NoRing, _) | (_, false) => {}
            (Plain::Unasked, true) => {
                DriveCounters::add(&counters.chunks_unregistered, 1);
                DriveCounters::add(&counters.chunks_unregistered_arena, 1);
            }
            (Plain::Fallback, true) => DriveCounters::add(&counters.chunks_unregistered, 1),
        }
        self.io.loads[d].add(ch.len as u64);
        match q.push(job) {
            Ok(()) => fanout.of(d).queued |= 1 << ((lane - self.io.lanes[d].start) % 64),
            Err(job) => self.divert(job, lane),
        }
    }

    /// A chunk routed to lane `lane`, which stopped before it could be
    /// queued: another lane or copy takes it, or the read fails naming the
    /// drive.
    fn divert(&self, job: Job, lane: usize) {
        let d = self.io.queues[lane].drive;
        let why = self.io.queues[lane]
            .closed_reason()
            .unwrap_or_else(|| "the engine is shutting down".to_string());
        let why = format!("drive {} is not running: {why}", self.model.drives()[d].device);
        if let Some(again) = completion::fail_over(job, why.clone(), &self.io, lane) {
            completion::requeue(&self.io, again, &why);
        }
    }
}
