//! Each drive's load, for `adaptive` routing: outstanding bytes, and the
//! throughput measured from completions over the time the drive was busy.

use std::sync::Mutex;
use std::time::Instant;

use crate::engine::sync::lock_std as lock;

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
