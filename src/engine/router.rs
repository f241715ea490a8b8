//! Which copy serves each chunk: the routing stage the submit path calls.
//!
//! All copies of a shard are proven byte-identical, so the chunks of one
//! read may come from different copies on different drives and still land
//! in place in the same slot. `hash` sends a whole read to one copy (the
//! field's baseline); `stripe` spreads its chunks over the copies in
//! proportion to the weights; `adaptive` sends each chunk to the copy whose
//! drive has the least outstanding bytes per unit of measured throughput.

use std::sync::atomic::{AtomicUsize, Ordering};

use crate::config::{RoutePolicy, MAX_COPY_RANKS};
use crate::engine::queue::Io;

/// `adaptive` routing: a copy on a drive of another NUMA node than the
/// slot's arena costs this much more than a local one, so local copies are
/// preferred while a remote copy still takes work when the local drive is
/// busy enough.
pub(crate) const REMOTE_COST_FACTOR: f64 = 1.5;

/// The routing stage of an engine: its policy, and the rotation that breaks
/// ties so one-chunk reads alternate between copies.
#[derive(Debug)]
pub(crate) struct Router {
    policy: RoutePolicy,
    turn: AtomicUsize,
}

/// One copy of the shard a read may use: the drive it is on, its read
/// weight, and whether that drive is on another NUMA node than the slot.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Candidate {
    pub(crate) drive: usize,
    pub(crate) weight: f64,
    pub(crate) remote: bool,
}

/// The routing of one read: which copy each of its chunks goes to. No
/// allocation: at most [`MAX_COPY_RANKS`] copies.
#[derive(Debug)]
pub(crate) struct ReadRoute {
    policy: RoutePolicy,
    n: usize,
    copies: [Candidate; MAX_COPY_RANKS],
    weights: [f64; MAX_COPY_RANKS],
    /// The copy `hash` sends the whole read to.
    hashed: usize,
    /// Where `stripe` and `adaptive` start looking (rotates per read).
    turn: usize,
    /// Chunks given to each copy so far.
    given: [u32; MAX_COPY_RANKS],
}

impl Router {
    pub(crate) fn new(policy: RoutePolicy) -> Self {
        Router {
            policy,
            turn: AtomicUsize::new(0),
        }
    }

    /// The policy this router applies.
    pub(crate) fn policy(&self) -> RoutePolicy {
        self.policy
    }

    /// Routes one read over `copies` (primary first; at most
    /// [`MAX_COPY_RANKS`] are used) with group key `key` for `hash`. A read
    /// with one copy goes to it (`hash`, with nothing to hash over).
    pub(crate) fn route_read(&self, key: u64, copies: &[Candidate]) -> ReadRoute {
        let n = copies.len().clamp(1, MAX_COPY_RANKS);
        let mut c = [Candidate::default(); MAX_COPY_RANKS];
        c[..n].copy_from_slice(&copies[..n]);
        let mut weights = [1.0f64; MAX_COPY_RANKS];
        for (w, k) in weights.iter_mut().zip(&c[..n]) {
            *w = k.weight;
        }
        let turn = if n > 1 {
            self.turn.fetch_add(1, Ordering::Relaxed) % n
        } else {
            0
        };
        ReadRoute {
            policy: if n == 1 { RoutePolicy::Hash } else { self.policy },
            n,
            copies: c,
            weights,
            hashed: hash_pick(key, &cuts(&weights[..n])),
            turn,
            given: [0; MAX_COPY_RANKS],
        }
    }
}

impl ReadRoute {
    /// The copy (index into the read's copies) the next chunk of `len`
    /// bytes goes to. A copy whose drive stopped is passed over (if every
    /// copy's drive stopped, the caller's push fails with each one's reason).
    pub(crate) fn pick(&mut self, len: u32, io: &Io) -> usize {
        let n = self.n;
        let alive = |k: usize| io.drive_open(self.copies[k].drive);
        let r = match self.policy {
            RoutePolicy::Hash => self.hashed,
            RoutePolicy::Stripe => stripe_pick(&self.weights[..n], &self.given[..n], self.turn),
            RoutePolicy::Adaptive => {
                let cost = |k: usize| {
                    if !alive(k) {
                        return f64::INFINITY;
                    }
                    let factor = if self.copies[k].remote { REMOTE_COST_FACTOR } else { 1.0 };
                    io.loads[self.copies[k].drive].cost(len as u64) * factor
                };
                (0..n)
                    .map(|k| (self.turn + k) % n)
                    .min_by(|&a, &b| cost(a).total_cmp(&cost(b)))
                    .unwrap_or(0)
            }
        };
        let r = (0..n).map(|k| (r + k) % n).find(|&k| alive(k)).unwrap_or(r);
        self.given[r] += 1;
        r
    }
}

/// Cut points over 256 from per-copy weights: `cut_r = round(256 * cum_r /
/// sum)`, forced strictly increasing, capped at 256.
pub fn cuts(weights: &[f64]) -> Vec<u32> {
    let sum: f64 = weights.iter().sum();
    let mut cum = 0.0;
    let mut prev = 0u32;
    weights
        .iter()
        .map(|w| {
            cum += w;
            let c = ((256.0 * cum / sum).round() as u32).max(prev + 1).min(256);
            prev = c;
            c
        })
        .collect()
}

/// The copy (index into `cuts`) a group key hashes to: `h = u32(key *
/// 2654435761)`, `hv = (h >> 16) & 255`, the first copy with `hv < cut`.
pub fn hash_pick(key: u64, cuts: &[u32]) -> usize {
    let h = (key as u32).wrapping_mul(2_654_435_761);
    let hv = (h >> 16) & 255;
    cuts.iter()
        .position(|&c| hv < c)
        .unwrap_or(cuts.len().saturating_sub(1))
}

/// Smooth weighted round robin: the next copy for a read that has already
/// given `given[r]` chunks to copy r. Deterministic; the rotation `start`
/// breaks ties so one-chunk reads alternate between copies.
pub fn stripe_pick(weights: &[f64], given: &[u32], start: usize) -> usize {
    let n = weights.len();
    (0..n)
        .map(|k| (start + k) % n)
        .min_by(|&a, &b| {
            let fa = (given[a] as f64 + 1.0) / weights[a];
            let fb = (given[b] as f64 + 1.0) / weights[b];
            fa.total_cmp(&fb)
        })
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn field_cut_points() {
        assert_eq!(cuts(&[1.0, 1.0]), [128, 256]);
        assert_eq!(cuts(&[9.0, 3.0]), [192, 256]);
        assert_eq!(cuts(&[1.0, 1.0, 1.0]), [85, 171, 256]);
        assert_eq!(cuts(&[1.0, 1000.0]), [1, 256]);
        assert_eq!(cuts(&[1000.0, 1.0]), [256, 256]);
    }

    #[test]
    fn field_routes() {
        let c = cuts(&[1.0, 1.0]);
        let key = |l: u64, e: u64| l * 384 + e;
        assert_eq!(hash_pick(key(0, 0), &c), 0);
        assert_eq!(hash_pick(key(0, 1), &c), 0);
        assert_eq!(hash_pick(key(5, 17), &c), 1);
        // 1000,1: the mirror gets nothing.
        let c = cuts(&[1000.0, 1.0]);
        assert!((0..10_000).all(|k| hash_pick(k, &c) == 0));
    }

    #[test]
    fn hash_spreads_one_decode_step_over_copies() {
        // The dozen experts one step touches, in one layer, land on both copies.
        let c = cuts(&[1.0, 1.0]);
        let picks: Vec<usize> = (0..12).map(|e| hash_pick(3 * 384 + e * 31, &c)).collect();
        assert!(picks.contains(&0) && picks.contains(&1), "{picks:?}");
    }

    #[test]
    fn stripe_follows_the_weights() {
        let w = [3.0, 1.0];
        let mut given = [0u32; 2];
        for _ in 0..400 {
            let r = stripe_pick(&w, &given, 0);
            given[r] += 1;
        }
        assert_eq!(given, [300, 100]);
        // One-chunk reads alternate with the rotation.
        assert_eq!(stripe_pick(&[1.0, 1.0], &[0, 0], 0), 0);
        assert_eq!(stripe_pick(&[1.0, 1.0], &[0, 0], 1), 1);
    }
}
