//! The bench's progress line on a terminal (stderr), after the first second.

use std::time::Instant;

/// A progress bar for `runs` runs of several arms.
pub(crate) struct Progress {
    show: bool,
    runs: usize,
    started: Instant,
}

impl Progress {
    /// Shown only when `show` (stderr is a terminal, no `--json`).
    pub(crate) fn new(show: bool, runs: usize) -> Self {
        Progress {
            show,
            runs,
            started: Instant::now(),
        }
    }

    /// Arm `arm`, run `run`, fraction `f` done.
    pub(crate) fn show(&self, arm: &str, run: usize, f: f64) {
        if self.show && self.started.elapsed().as_secs_f64() > 1.0 {
            let w = 30;
            let k = (f * w as f64) as usize;
            eprint!(
                "\r{:>8} run {}/{} [{}{}] {:>3.0}%",
                arm,
                run + 1,
                self.runs.max(1),
                "#".repeat(k),
                " ".repeat(w - k),
                f * 100.0
            );
            if f >= 1.0 {
                eprint!("\r{}\r", " ".repeat(60));
            }
        }
    }
}
