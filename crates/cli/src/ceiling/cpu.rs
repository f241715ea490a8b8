//! CPU time and memory of the process, from `getrusage`: every thread,
//! io_uring's io-wq and SQPOLL workers included (checked against
//! `/proc/self/task/*/stat` by the tests).

/// CPU seconds (user, system) this process has used so far, all threads
/// (`getrusage(RUSAGE_SELF)`: io_uring's io-wq workers and SQPOLL threads
/// included, live or exited; see docs/architecture.md).
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
