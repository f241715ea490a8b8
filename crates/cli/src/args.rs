//! What every argument may be, checked when it is parsed (clap names the
//! flag and says the accepted range in the error), and the bounds on what
//! one run may read or allocate: files read whole are read with a cap, a
//! path names the kind of file it must be before anything opens it (a FIFO
//! is never opened), and sizes that multiply are checked against the memory
//! and the volume they would take.

use std::io::Read;
use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use weightstream::__internal::escape;

/// A count flag within `lo..=hi` (clap says the range when refused).
pub(crate) fn count(lo: u64, hi: u64) -> clap::builder::RangedU64ValueParser<usize> {
    clap::builder::RangedU64ValueParser::<usize>::new().range(lo..=hi)
}

/// A size (`4GiB`, `300MB`, `1048576`) within `lo..=hi` bytes, a multiple of
/// `multiple`.
pub(crate) fn bytes_in(lo: u64, hi: u64, multiple: u64) -> impl Fn(&str) -> Result<u64, String> + Clone {
    move |s| {
        let b = parse_bytes(s)?;
        if b < lo || b > hi {
            return Err(format!("{b} bytes is outside the accepted range {lo}..={hi} bytes"));
        }
        if multiple > 1 && !b.is_multiple_of(multiple) {
            return Err(format!("{b} bytes is not a multiple of {multiple}"));
        }
        Ok(b)
    }
}

/// `load --align`: 0 (none) or a power of two of at most the load limit.
pub(crate) fn load_align(s: &str) -> Result<usize, String> {
    let max = weightstream::MAX_LOAD_ALIGN;
    let a: usize = s
        .trim()
        .parse()
        .map_err(|_| format!("{s:?}: expected 0 or a power of two of at most {max}"))?;
    if a != 0 && (!a.is_power_of_two() || a > max) {
        return Err(format!("{a} is not 0 or a power of two of at most {max}"));
    }
    Ok(a)
}

/// Seconds, above 0 and at most an hour (`ceiling --seconds`).
pub(crate) fn seconds(s: &str) -> Result<f64, String> {
    let v: f64 = s
        .trim()
        .parse()
        .map_err(|_| format!("{s:?}: expected seconds, such as 0.5"))?;
    if !(v.is_finite() && v > 0.0 && v <= 3600.0) {
        return Err(format!(
            "{v} is outside the accepted range: above 0, at most 3600 seconds"
        ));
    }
    Ok(v)
}

/// What a file is, in words (`a FIFO`), from its type.
fn kind(ft: std::fs::FileType) -> &'static str {
    if ft.is_dir() {
        "a directory"
    } else if ft.is_file() {
        "a regular file"
    } else if ft.is_fifo() {
        "a FIFO"
    } else if ft.is_char_device() {
        "a character device"
    } else if ft.is_block_device() {
        "a block device"
    } else if ft.is_socket() {
        "a socket"
    } else {
        "a special file"
    }
}

/// The metadata of `p` (links followed), or why not; never opens it.
fn stat(p: &Path) -> Result<Option<std::fs::Metadata>, String> {
    if p.as_os_str().is_empty() {
        return Err("an empty path".into());
    }
    match std::fs::metadata(p) {
        Ok(m) => Ok(Some(m)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(format!("{}: {e}", escape(p))),
    }
}

/// A path argument checked by `check` (any bytes: a name need not be
/// UTF-8); clap names the argument when it is refused.
fn path_parser(check: fn(PathBuf) -> Result<PathBuf, String>) -> impl clap::builder::TypedValueParser<Value = PathBuf> {
    use clap::builder::TypedValueParser;
    clap::builder::OsStringValueParser::new().try_map(move |s| check(PathBuf::from(s)))
}

/// A model directory or a file to read: any path but an empty one. What
/// it is, is the library's to say (it opens nothing that blocks, refuses
/// what is not a directory or a regular file, and names the path), with
/// the command's plain failure.
pub(crate) fn non_empty_path() -> impl clap::builder::TypedValueParser<Value = PathBuf> {
    path_parser(|p| {
        if p.as_os_str().is_empty() {
            return Err("an empty path".into());
        }
        Ok(p)
    })
}

/// A regular file that must exist (read, never a FIFO or a device).
pub(crate) fn existing_file() -> impl clap::builder::TypedValueParser<Value = PathBuf> {
    path_parser(|p| match stat(&p)? {
        Some(m) if m.is_file() => Ok(p),
        Some(m) => Err(format!("{} is {}, not a regular file", escape(&p), kind(m.file_type()))),
        None => Err(format!("{}: no such file", escape(&p))),
    })
}

/// A directory to write into: a directory, or nothing yet.
pub(crate) fn output_dir() -> impl clap::builder::TypedValueParser<Value = PathBuf> {
    path_parser(|p| match stat(&p)? {
        Some(m) if !m.is_dir() => Err(format!("{} is {}, not a directory", escape(&p), kind(m.file_type()))),
        _ => Ok(p),
    })
}

/// A file to write: a regular file or nothing yet, in a directory that
/// exists and is writable (checked now, so a long run does not fail at its
/// end).
pub(crate) fn output_file() -> impl clap::builder::TypedValueParser<Value = PathBuf> {
    path_parser(check_output_file)
}

fn check_output_file(p: PathBuf) -> Result<PathBuf, String> {
    if let Some(m) = stat(&p)? {
        if !m.is_file() {
            return Err(format!("{} is {}, not a regular file", escape(&p), kind(m.file_type())));
        }
    }
    let parent = match p.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    if !parent.is_dir() {
        return Err(format!(
            "{}: its directory {} does not exist",
            escape(&p),
            escape(parent)
        ));
    }
    // Writable now (as far as access(2) says), so a long run does not end
    // refused at its last step.
    let target = if p.exists() { p.as_path() } else { parent };
    rustix::fs::access(target, rustix::fs::Access::WRITE_OK)
        .map_err(|e| format!("{}: not writable: {e}", escape(target)))?;
    Ok(p)
}

/// A file read whole: opened non-blocking (a FIFO never hangs the open),
/// refused unless it is a regular file of at most `max` bytes, and read
/// with that cap (a file that grows is refused too). The error names the
/// file, what it is for, its size and the bound.
pub(crate) fn read_bounded(path: &Path, max: u64, what: &str) -> Result<Vec<u8>, String> {
    let f = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(path)
        .map_err(|e| format!("{}: open {what}: {e}", escape(path)))?;
    let m = f
        .metadata()
        .map_err(|e| format!("{}: fstat {what}: {e}", escape(path)))?;
    if !m.is_file() {
        return Err(format!(
            "{}: {what} is {}, not a regular file: refused",
            escape(path),
            kind(m.file_type())
        ));
    }
    if m.len() > max {
        return Err(format!(
            "{}: {what} is {} bytes, over the {max}-byte bound: refused",
            escape(path),
            m.len()
        ));
    }
    let mut bytes = Vec::with_capacity(m.len() as usize);
    (&f).take(max + 1)
        .read_to_end(&mut bytes)
        .map_err(|e| format!("{}: read {what}: {e}", escape(path)))?;
    if bytes.len() as u64 > max {
        return Err(format!(
            "{}: {what} grew past the {max}-byte bound while read: refused",
            escape(path)
        ));
    }
    Ok(bytes)
}

/// Bytes this process may still allocate: the least of the machine's
/// `MemAvailable`, the address-space limit less what is mapped, and the
/// memory cgroup's limit less its use (v2, then v1), where each is known.
pub(crate) fn memory_room() -> (u64, String) {
    let mut room = (u64::MAX, "no limit known".to_string());
    let mut least = |v: u64, why: String| {
        if v < room.0 {
            room = (v, why);
        }
    };
    let status = small_text(Path::new("/proc/self/status"));
    let kib = |text: &str, key: &str| -> Option<u64> {
        text.lines()
            .find_map(|l| l.strip_prefix(key))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
            .map(|k| k * 1024)
    };
    if let Some(avail) = small_text(Path::new("/proc/meminfo")).and_then(|m| kib(&m, "MemAvailable:")) {
        least(avail, format!("MemAvailable {avail} bytes"));
    }
    let r#as = rustix::process::getrlimit(rustix::process::Resource::As);
    if let Some(limit) = r#as.current {
        let mapped = status.as_deref().and_then(|s| kib(s, "VmSize:")).unwrap_or(0);
        least(
            limit.saturating_sub(mapped),
            format!("RLIMIT_AS {limit} bytes, {mapped} mapped"),
        );
    }
    if let Some((max, cur, name)) = cgroup_memory() {
        least(
            max.saturating_sub(cur),
            format!("cgroup {name} {max} bytes, {cur} in use"),
        );
    }
    room
}

/// The memory cgroup's (limit, use, file name), where readable.
fn cgroup_memory() -> Option<(u64, u64, &'static str)> {
    let table = small_text(Path::new("/proc/self/cgroup"))?;
    let num = |p: PathBuf| small_text(&p).and_then(|s| s.trim().parse::<u64>().ok());
    for line in table.lines() {
        let mut f = line.splitn(3, ':');
        let (_, controllers, path) = (f.next()?, f.next()?, f.next()?);
        let rel = path.trim_start_matches('/');
        if controllers.is_empty() {
            let dir = Path::new("/sys/fs/cgroup").join(rel);
            if let Some(max) = num(dir.join("memory.max")) {
                return Some((max, num(dir.join("memory.current")).unwrap_or(0), "memory.max"));
            }
        } else if controllers.split(',').any(|c| c == "memory") {
            let dir = Path::new("/sys/fs/cgroup/memory").join(rel);
            if let Some(max) = num(dir.join("memory.limit_in_bytes")) {
                return Some((
                    max,
                    num(dir.join("memory.usage_in_bytes")).unwrap_or(0),
                    "memory.limit_in_bytes",
                ));
            }
        }
    }
    None
}

/// Free bytes (for an unprivileged writer) on the volume `path` would be
/// written to: statvfs of its nearest existing ancestor, named.
pub(crate) fn volume_room(path: &Path) -> Option<(u64, PathBuf)> {
    let abs = std::path::absolute(path).ok()?;
    let mut at = abs.as_path();
    loop {
        if at.exists() {
            let st = rustix::fs::statvfs(at).ok()?;
            return Some((st.f_bavail.saturating_mul(st.f_frsize), at.to_path_buf()));
        }
        at = at.parent()?;
    }
}

/// A small kernel file's text (at most 64 KiB read).
fn small_text(path: &Path) -> Option<String> {
    let mut s = String::new();
    std::fs::File::open(path)
        .ok()?
        .take(64 << 10)
        .read_to_string(&mut s)
        .ok()?;
    Some(s)
}

/// A library error with the flags that set an arena's size named (an
/// allocation refused); any other error as it is.
pub(crate) fn alloc_flags(e: weightstream::Error, flags: &str) -> weightstream::Error {
    match &e {
        weightstream::Error::Alloc { set_by, .. } => {
            let said = format!("{set_by}; on the command line: {flags}");
            e.size_set_by(said)
        }
        _ => e,
    }
}

/// A size: `4GiB`, `300MB`, `1048576`, `1.5GiB`; refused when it does not
/// fit in u64.
pub(crate) fn parse_bytes(s: &str) -> Result<u64, String> {
    let s = s.trim();
    let split = s.find(|c: char| !c.is_ascii_digit() && c != '.').unwrap_or(s.len());
    let (num, unit) = s.split_at(split);
    let expected = || format!("{s:?}: expected a size such as 4GiB, 300MB or 1048576");
    let mult: u64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kb" => 1_000,
        "kib" => 1 << 10,
        "m" | "mb" => 1_000_000,
        "mib" => 1 << 20,
        "g" | "gb" => 1_000_000_000,
        "gib" => 1 << 30,
        "t" | "tb" => 1_000_000_000_000,
        "tib" => 1 << 40,
        "p" | "pb" => 1_000_000_000_000_000,
        "pib" => 1 << 50,
        u => return Err(format!("{s:?}: unknown unit {u:?}")),
    };
    let too_large = || format!("{s:?}: more than {} bytes", u64::MAX);
    if !num.contains('.') {
        // Whole numbers exactly (u64::MAX itself is a size).
        let n: u128 = num.parse().map_err(|_| expected())?;
        return u64::try_from(n.checked_mul(mult as u128).ok_or_else(too_large)?).map_err(|_| too_large());
    }
    let b = num.parse::<f64>().map_err(|_| expected())? * mult as f64;
    // u64::MAX as f64 rounds up to 2^64: anything at or past it does not fit.
    if !b.is_finite() || b >= u64::MAX as f64 {
        return Err(too_large());
    }
    Ok(b as u64)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::ffi::OsStrExt;

    #[test]
    fn sizes_outside_the_range_are_refused_naming_it() {
        let p = bytes_in(4096, 1 << 30, 4096);
        assert_eq!(p("1MiB"), Ok(1 << 20));
        assert!(p("0").unwrap_err().contains("4096..=1073741824"));
        assert!(p("4097").unwrap_err().contains("multiple of 4096"));
        assert!(p("18446744073709551615").is_err());
        assert!(p("-1").is_err() && p("").is_err());
        // The largest size the help names can be typed as it is named.
        let big = bytes_in(1, 1 << 50, 1);
        assert_eq!(big("1PiB"), Ok(1 << 50));
        assert_eq!(big("1PB"), Ok(1_000_000_000_000_000));
        assert!(big("2PiB").unwrap_err().contains("1125899906842624"));
    }

    #[test]
    fn alignments_are_zero_or_powers_of_two() {
        assert_eq!(load_align("0"), Ok(0));
        assert_eq!(load_align("64"), Ok(64));
        for bad in ["3", "8192", "-1", "", "18446744073709551615"] {
            assert!(load_align(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn paths_are_checked_without_opening() {
        use clap::builder::TypedValueParser;
        let cmd = clap::Command::new("t");
        let d = tempfile::tempdir().unwrap();
        let f = d.path().join("f");
        std::fs::write(&f, b"x").unwrap();
        let dir = |v: &Path| {
            non_empty_path()
                .parse_ref(&cmd, None, v.as_os_str())
                .map_err(|e| e.to_string())
        };
        let file = |v: &Path| {
            existing_file()
                .parse_ref(&cmd, None, v.as_os_str())
                .map_err(|e| e.to_string())
        };
        assert!(dir(d.path()).is_ok());
        assert!(dir(Path::new("")).unwrap_err().contains("empty path"));
        assert!(file(Path::new("/dev/zero")).unwrap_err().contains("character device"));
        assert!(file(Path::new("")).unwrap_err().contains("empty path"));
        assert!(check_output_file("/no/such/dir/x.svg".into())
            .unwrap_err()
            .contains("does not exist"));
        let out = output_dir().parse_ref(&cmd, None, f.as_os_str());
        assert!(out.is_err());
        // A name that is not UTF-8 is a path like any other.
        let odd = d.path().join(std::ffi::OsStr::from_bytes(b"m\xff"));
        std::fs::create_dir(&odd).unwrap();
        assert_eq!(dir(&odd).unwrap(), odd);
    }

    #[test]
    fn a_bounded_read_refuses_devices_and_large_files() {
        let e = read_bounded(Path::new("/dev/zero"), 1 << 20, "the record").unwrap_err();
        assert!(e.contains("/dev/zero: the record is a character device"), "{e}");
        let d = tempfile::tempdir().unwrap();
        let f = d.path().join("big");
        std::fs::File::create(&f).unwrap().set_len(10 << 20).unwrap();
        let e = read_bounded(&f, 1 << 20, "the record").unwrap_err();
        assert!(e.contains("10485760 bytes, over the 1048576-byte bound"), "{e}");
        std::fs::write(&f, b"{}").unwrap();
        assert_eq!(read_bounded(&f, 1 << 20, "the record").unwrap(), b"{}");
    }
}
