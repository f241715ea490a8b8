//! The limits in force on this process's memory, in words, for an error
//! that says why a mapping was refused: the address-space, data and
//! locked-memory rlimits, and the memory cgroup's limit where it is
//! readable (v2 `memory.max`, v1 `memory.limit_in_bytes`).

use std::io::Read;
use std::path::{Path, PathBuf};

/// `RLIMIT_MEMLOCK` (soft, hard; `None`: unlimited): what registering
/// (pinning) memory with io_uring counts against.
pub(crate) fn memlock_limit() -> (Option<u64>, Option<u64>) {
    let l = rustix::process::getrlimit(rustix::process::Resource::Memlock);
    (l.current, l.maximum)
}

/// The largest procfs or cgroup file read here (they are a few lines).
const SMALL_FILE: u64 = 64 << 10;

/// `RLIMIT_AS ...; RLIMIT_DATA ...; RLIMIT_MEMLOCK ...; cgroup ...`: every
/// limit that can refuse (or later kill) an anonymous mapping, with what
/// the process uses against it now where the kernel says.
#[cfg_attr(miri, allow(dead_code))]
pub(crate) fn describe() -> String {
    use rustix::process::Resource;
    let vm = status_kib("VmSize:");
    let locked = status_kib("VmLck:");
    let mut parts = vec![
        rlimit(
            "RLIMIT_AS",
            Resource::As,
            vm.map(|k| format!("{} bytes mapped now", k * 1024)),
        ),
        rlimit("RLIMIT_DATA", Resource::Data, None),
        rlimit(
            "RLIMIT_MEMLOCK",
            Resource::Memlock,
            locked.map(|k| format!("{} bytes locked now", k * 1024)),
        ),
    ];
    parts.push(cgroup().unwrap_or_else(|| "memory cgroup limit not readable".to_string()));
    parts.join("; ")
}

fn rlimit(name: &str, r: rustix::process::Resource, used: Option<String>) -> String {
    let l = rustix::process::getrlimit(r);
    let soft = l.current.map_or("unlimited".to_string(), |v| format!("{v} bytes"));
    match used {
        Some(u) if l.current.is_some() => format!("{name} {soft} ({u})"),
        _ => format!("{name} {soft}"),
    }
}

/// A `Vm*:` line of /proc/self/status, in KiB.
fn status_kib(key: &str) -> Option<u64> {
    let s = read_small(Path::new("/proc/self/status"))?;
    s.lines()
        .find_map(|l| l.strip_prefix(key))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
}

/// The memory cgroup's limit (and use), v2 first, then v1.
fn cgroup() -> Option<String> {
    let table = read_small(Path::new("/proc/self/cgroup"))?;
    for line in table.lines() {
        let mut f = line.splitn(3, ':');
        let (_, controllers, path) = (f.next()?, f.next()?, f.next()?);
        let rel = path.trim_start_matches('/');
        if controllers.is_empty() {
            let dir = PathBuf::from("/sys/fs/cgroup").join(rel);
            if let Some(max) = read_small(&dir.join("memory.max")) {
                let cur = read_small(&dir.join("memory.current"));
                return Some(format!(
                    "cgroup {} memory.max {}{}",
                    path,
                    max.trim(),
                    cur.map_or(String::new(), |c| format!(" (memory.current {})", c.trim()))
                ));
            }
        } else if controllers.split(',').any(|c| c == "memory") {
            let dir = PathBuf::from("/sys/fs/cgroup/memory").join(rel);
            if let Some(max) = read_small(&dir.join("memory.limit_in_bytes")) {
                let cur = read_small(&dir.join("memory.usage_in_bytes"));
                return Some(format!(
                    "cgroup {} memory.limit_in_bytes {}{}",
                    path,
                    max.trim(),
                    cur.map_or(String::new(), |c| format!(" (memory.usage_in_bytes {})", c.trim()))
                ));
            }
        }
    }
    None
}

/// A small kernel file's text (at most [`SMALL_FILE`] bytes read).
fn read_small(path: &Path) -> Option<String> {
    let mut s = String::new();
    std::fs::File::open(path)
        .ok()?
        .take(SMALL_FILE)
        .read_to_string(&mut s)
        .ok()?;
    Some(s)
}

#[cfg(test)]
mod tests {
    #[test]
    #[cfg_attr(miri, ignore = "reads /proc")]
    fn every_limit_is_named() {
        let d = super::describe();
        for k in ["RLIMIT_AS ", "RLIMIT_DATA ", "RLIMIT_MEMLOCK ", "cgroup"] {
            assert!(d.contains(k), "{k} missing from {d}");
        }
    }
}
