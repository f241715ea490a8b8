//! Which copy serves each chunk.
//!
//! All copies of a shard are proven byte-identical, so the chunks of one
//! read may come from different copies on different drives and still land
//! in place in the same slot. `hash` sends a whole read to one copy (the
//! field's baseline); `stripe` spreads its chunks over the copies in
//! proportion to the weights; `adaptive` sends each chunk to the copy whose
//! drive has the least outstanding bytes per unit of measured throughput.

use std::sync::Mutex;
use std::time::Instant;

use crate::sync::lock_std as lock;

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

/// Per-drive load: outstanding bytes, and throughput measured from
/// completions over the time the drive was busy (so an idle drive's rate is
/// not mistaken for a slow one).
#[derive(Debug)]
#[doc(hidden)]
pub struct DriveLoad {
    state: Mutex<LoadState>,
}

#[derive(Debug)]
struct LoadState {
    outstanding: u64,
    last_event: Instant,
    window_busy: f64,
    window_bytes: u64,
    /// Bytes per second, a moving average.
    tput: f64,
}

/// How long a measurement window lasts before it updates the average.
const WINDOW_S: f64 = 0.1;

impl DriveLoad {
    pub fn new(initial_bytes_per_s: f64) -> Self {
        DriveLoad {
            state: Mutex::new(LoadState {
                outstanding: 0,
                last_event: Instant::now(),
                window_busy: 0.0,
                window_bytes: 0,
                tput: initial_bytes_per_s.max(1.0),
            }),
        }
    }

    fn tick(st: &mut LoadState, now: Instant) {
        if st.outstanding > 0 {
            st.window_busy += now.duration_since(st.last_event).as_secs_f64();
        }
        st.last_event = now;
    }

    /// `bytes` were routed to this drive.
    pub fn add(&self, bytes: u64) {
        let mut st = lock(&self.state);
        Self::tick(&mut st, Instant::now());
        st.outstanding += bytes;
    }

    /// `bytes` left this drive: `landed` when they were read (they count
    /// toward the throughput), not when the chunk failed or moved away.
    pub fn done(&self, bytes: u64, landed: bool) {
        let mut st = lock(&self.state);
        Self::tick(&mut st, Instant::now());
        st.outstanding = st.outstanding.saturating_sub(bytes);
        if landed {
            st.window_bytes += bytes;
            if st.window_busy >= WINDOW_S {
                let rate = st.window_bytes as f64 / st.window_busy;
                st.tput = 0.5 * st.tput + 0.5 * rate;
                st.window_busy = 0.0;
                st.window_bytes = 0;
            }
        }
    }

    /// Seconds until this drive would finish `extra` more bytes.
    pub fn cost(&self, extra: u64) -> f64 {
        let st = lock(&self.state);
        (st.outstanding + extra) as f64 / st.tput
    }

    /// Measured throughput, bytes per second.
    pub(crate) fn throughput(&self) -> f64 {
        lock(&self.state).tput
    }

    #[cfg(test)]
    pub(crate) fn outstanding(&self) -> u64 {
        lock(&self.state).outstanding
    }
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

    #[test]
    fn load_measures_busy_throughput() {
        let l = DriveLoad::new(1e9);
        assert_eq!(l.cost(1_000_000_000), 1.0);
        l.add(100);
        assert_eq!(l.outstanding(), 100);
        l.done(100, true);
        assert_eq!(l.outstanding(), 0);
        assert!(l.cost(0) == 0.0);
    }
}
