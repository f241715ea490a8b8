//! CPU time and memory of the process, from `getrusage`: every thread,
//! io_uring's io-wq and SQPOLL workers included (checked against
//! `/proc/self/task/*/stat` by the tests).

/// CPU seconds (user, system) this process has used so far, all threads
/// (`getrusage(RUSAGE_SELF)`: io_uring's io-wq workers and SQPOLL threads
/// included, live or exited; see docs/contracts.md).
pub fn process_cpu() -> (f64, f64) {
    rusage(libc::RUSAGE_SELF)
}

/// CPU seconds (user + system) of this process's children that have been
/// waited for (`getrusage(RUSAGE_CHILDREN)`: a finished fio, all its
/// threads and io-wq workers).
pub fn children_cpu_seconds() -> f64 {
    let (u, s) = rusage(libc::RUSAGE_CHILDREN);
    u + s
}

pub(super) fn rusage(who: libc::c_int) -> (f64, f64) {
    let Some(u) = getrusage(who) else {
        return (0.0, 0.0);
    };
    let t = |tv: libc::timeval| tv.tv_sec as f64 + tv.tv_usec as f64 * 1e-6;
    (t(u.ru_utime), t(u.ru_stime))
}

/// Peak resident set of this process so far, bytes (`ru_maxrss`).
pub fn peak_rss_bytes() -> u64 {
    getrusage(libc::RUSAGE_SELF).map_or(0, |u| u.ru_maxrss.max(0) as u64 * 1024)
}

pub(super) fn getrusage(who: libc::c_int) -> Option<libc::rusage> {
    let mut u = std::mem::MaybeUninit::<libc::rusage>::zeroed();
    // SAFETY: getrusage writes one `rusage` into the pointer it is given; the
    // buffer is a properly sized and aligned `rusage`.
    let rc = unsafe { libc::getrusage(who, u.as_mut_ptr()) };
    // SAFETY: on success the struct is initialised (and it was zeroed
    // before: every bit pattern of it is valid anyway).
    (rc == 0).then(|| unsafe { u.assume_init() })
}

/// CPU seconds (user + system) this process has used so far, all threads.
pub fn process_cpu_seconds() -> f64 {
    let (u, s) = process_cpu();
    u + s
}

/// Busy CPU seconds of the whole machine since boot, every CPU summed, from
/// the first line of `/proc/stat` (user, nice, system, irq, softirq,
/// steal; idle and iowait left out; guest time is already inside user).
/// Kernel threads that work for a process count here and in no process's
/// `getrusage`: the loop driver's workers that copy a memloop drive's
/// reads, the block layer's softirqs. Resolution: one clock tick
/// (`_SC_CLK_TCK`, usually 10 ms) per CPU. `None` without `/proc/stat`.
pub fn machine_busy_seconds() -> Option<f64> {
    machine_cpu().map(|t| t.busy())
}

/// The whole machine's busy and steal seconds since boot, from one read of
/// `/proc/stat`. `None` without it.
pub fn machine_cpu() -> Option<CpuLine> {
    let text = std::fs::read_to_string("/proc/stat").ok()?;
    cpu_line_of(&text, clock_ticks_per_second())
}

/// The clock ticks of `/proc/stat`'s summary `cpu` line that the
/// measurements use, every CPU summed. Kept in ticks so that a difference
/// of two is exact (seconds since boot in f64 would round one tick of
/// busy below one tick of steal).
#[derive(Debug, Clone, Copy)]
pub struct CpuLine {
    busy_ticks: u64,
    steal_ticks: u64,
    ticks_per_second: f64,
}

impl CpuLine {
    /// As [`machine_busy_seconds`].
    pub fn busy(&self) -> f64 {
        self.busy_ticks as f64 / self.ticks_per_second
    }

    /// Busy seconds from `earlier` to this reading, and of them steal: the
    /// time a virtual machine's CPUs were runnable and its host ran
    /// something else (a figure taken while steal grew was paced by the
    /// host's other tenants too).
    pub fn since(&self, earlier: &CpuLine) -> (f64, f64) {
        (
            self.busy_ticks.saturating_sub(earlier.busy_ticks) as f64 / self.ticks_per_second,
            self.steal_ticks.saturating_sub(earlier.steal_ticks) as f64 / self.ticks_per_second,
        )
    }
}

/// What [`machine_cpu`] reads from `/proc/stat`'s text.
fn cpu_line_of(stat: &str, ticks_per_second: f64) -> Option<CpuLine> {
    let line = stat.lines().find(|l| l.starts_with("cpu "))?;
    let v: Vec<u64> = line.split_whitespace().skip(1).map_while(|x| x.parse().ok()).collect();
    // user nice system idle iowait irq softirq steal [guest guest_nice]
    if v.len() < 8 || ticks_per_second <= 0.0 {
        return None;
    }
    Some(CpuLine {
        busy_ticks: v[0] + v[1] + v[2] + v[5] + v[6] + v[7],
        steal_ticks: v[7],
        ticks_per_second,
    })
}

fn clock_ticks_per_second() -> f64 {
    // SAFETY: sysconf reads a constant of the system; no pointer is passed.
    let t = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    if t > 0 {
        t as f64
    } else {
        100.0
    }
}

/// CPUs the machine-wide busy time of [`machine_busy_seconds`] is summed
/// over: the `cpuN` lines of `/proc/stat` (online CPUs), at least 1.
pub fn machine_cpus() -> usize {
    std::fs::read_to_string("/proc/stat").map_or(1, |t| machine_cpus_of(&t))
}

/// What [`machine_cpus`] counts in `/proc/stat`'s text.
pub fn machine_cpus_of(stat: &str) -> usize {
    stat.lines()
        .filter(|l| {
            l.strip_prefix("cpu")
                .is_some_and(|r| r.starts_with(|c: char| c.is_ascii_digit()))
        })
        .count()
        .max(1)
}

/// CPUs this process may run on (the affinity mask), at least 1.
pub fn cpus() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn busy_time_is_every_column_but_idle_and_iowait() {
        let stat = "cpu  100 2 30 5000 70 4 6 8 50 0\ncpu0 50 1 15 2500 35 2 3 4 25 0\nintr 1 2 3\n";
        // 100 + 2 + 30 + 4 + 6 + 8 = 150 ticks at 100 per second.
        assert_eq!(cpu_line_of(stat, 100.0).map(|t| t.busy()), Some(1.5));
        assert_eq!(
            cpu_line_of("cpu0 1 2 3 4 5 6 7 8\n", 100.0).map(|t| t.busy()),
            None,
            "the summary line only"
        );
        assert_eq!(
            cpu_line_of("cpu  1 2 3\n", 100.0).map(|t| t.busy()),
            None,
            "too few columns"
        );
        assert_eq!(
            cpu_line_of(stat, 100.0).map(|t| t.steal_ticks),
            Some(8),
            "the eighth column"
        );
        assert!(machine_cpu().is_some_and(|t| (0..=t.busy_ticks).contains(&t.steal_ticks)));
        // One tick of each, from readings with large totals: exactly equal.
        let at = |busy: u64, steal: u64| CpuLine {
            busy_ticks: busy,
            steal_ticks: steal,
            ticks_per_second: 100.0,
        };
        assert_eq!(at(2_400_001, 23_849).since(&at(2_400_000, 23_848)), (0.01, 0.01));
        assert_eq!(
            at(5, 1).since(&at(7, 2)),
            (0.0, 0.0),
            "a counter that went back counts nothing"
        );
        assert!(machine_busy_seconds().is_some_and(|s| s > 0.0));
        assert_eq!(machine_cpus_of(stat), 1);
        assert_eq!(machine_cpus_of("cpu  1\ncpu0 1\ncpu1 1\ncpu12 1\nintr 1\n"), 3);
        assert!(machine_cpus() >= cpus().min(machine_cpus()));
    }
}
