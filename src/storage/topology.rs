//! Drive discovery for one open file: which volume (`st_dev`) it lives on,
//! the block device behind it, the filesystem and mount point, and the
//! direct-I/O alignment, measured, never assumed:
//! `statx(STATX_DIOALIGN)` first, then the block device's
//! `logical_block_size`, then 4096.

use std::fs::File;
use std::path::{Path, PathBuf};

use rustix::fs::{AtFlags, StatxFlags};
use serde::Serialize;

/// Where an alignment figure came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum AlignSource {
    /// `statx(STATX_DIOALIGN)`.
    Statx,
    /// `/sys/dev/block/MAJ:MIN/queue/logical_block_size`.
    BlockDevice,
    /// Neither answered: 4096.
    Default,
}

/// What the kernel says about one file's volume.
#[derive(Debug, Clone, Serialize)]
pub struct FileTopology {
    /// `st_dev` of the file: one volume = one drive.
    pub dev: u64,
    /// Major number of `st_dev`.
    pub dev_major: u32,
    /// Minor number of `st_dev`.
    pub dev_minor: u32,
    /// Block device name (`vda`, `nvme0n1`, `loop3`), or the mount source for
    /// volumes without one (tmpfs).
    pub device: String,
    /// Mount point of the volume holding the file.
    pub mount: PathBuf,
    /// Filesystem type from mountinfo (`ext4`, `xfs`, `tmpfs`).
    pub fs_type: String,
    /// Required alignment of file offsets and lengths for O_DIRECT.
    pub dio_offset_align: u32,
    /// Required alignment of memory for O_DIRECT.
    pub dio_mem_align: u32,
    /// Where the alignment figures came from.
    pub align_source: AlignSource,
    /// `statx` reported that this file does not support direct I/O.
    pub statx_says_no_direct: bool,
}

impl FileTopology {
    /// What the kernel says about the volume of open file `file` (at `path`).
    pub fn probe(path: &Path, file: &File) -> std::io::Result<Self> {
        probe(path, file)
    }
}

/// Inspects an open file.
pub(crate) fn probe(path: &Path, file: &File) -> std::io::Result<FileTopology> {
    let stx = rustix::fs::statx(
        file,
        "",
        AtFlags::EMPTY_PATH,
        StatxFlags::BASIC_STATS | StatxFlags::DIOALIGN,
    )?;
    let (major, minor) = (stx.stx_dev_major, stx.stx_dev_minor);
    let dev = rustix::fs::makedev(major, minor);
    let sys_dev = format!("/sys/dev/block/{major}:{minor}");
    let has_dio = StatxFlags::from_bits_retain(stx.stx_mask).contains(StatxFlags::DIOALIGN);
    let (mut offset_align, mut mem_align, mut source) = (4096u32, 4096u32, AlignSource::Default);
    let mut statx_says_no_direct = false;
    if has_dio && stx.stx_dio_offset_align != 0 {
        offset_align = stx.stx_dio_offset_align;
        mem_align = stx.stx_dio_mem_align.max(1);
        source = AlignSource::Statx;
    } else {
        // statx answered with zeros: direct I/O unsupported for this file.
        statx_says_no_direct = has_dio;
        if let Some(lbs) = logical_block_size(major, minor) {
            offset_align = lbs;
            mem_align = lbs;
            source = AlignSource::BlockDevice;
        }
    }
    let (mount, fs_type, source_name) =
        mount_of(path, major, minor).unwrap_or_else(|| (PathBuf::from("?"), "?".into(), "?".into()));
    let device = std::fs::read_link(&sys_dev)
        .ok()
        .and_then(|p| p.file_name().map(|s| s.to_string_lossy().into_owned()))
        .unwrap_or_else(|| format!("{source_name} ({major}:{minor})"));
    Ok(FileTopology {
        dev,
        dev_major: major,
        dev_minor: minor,
        device,
        mount,
        fs_type,
        dio_offset_align: offset_align,
        dio_mem_align: mem_align,
        align_source: source,
        statx_says_no_direct,
    })
}

/// A `queue/` attribute of the block device `major:minor`, following a
/// partition to its disk (the one place sysfs queue attributes are read).
pub(crate) fn queue_attr(major: u32, minor: u32, name: &str) -> Option<String> {
    let sys_dev = format!("/sys/dev/block/{major}:{minor}");
    let read = |p: String| std::fs::read_to_string(p).ok().map(|s| s.trim().to_string());
    read(format!("{sys_dev}/queue/{name}")).or_else(|| read(format!("{sys_dev}/../queue/{name}")))
}

/// The logical block size of a block device, following a partition to its disk.
fn logical_block_size(major: u32, minor: u32) -> Option<u32> {
    queue_attr(major, minor, "logical_block_size")?
        .parse::<u32>()
        .ok()
        .filter(|&v| v.is_power_of_two())
}

/// `max_sectors_kb` of the device behind `dev`, in bytes (the largest request
/// the block layer issues without splitting).
pub(crate) fn max_request_bytes(major: u32, minor: u32) -> Option<usize> {
    queue_attr(major, minor, "max_sectors_kb")?
        .parse::<usize>()
        .ok()
        .map(|kb| kb * 1024)
}

/// Mount point, fs type and mount source of the volume `major:minor` holding
/// `path`: the longest mount point that prefixes the path's real location.
fn mount_of(path: &Path, major: u32, minor: u32) -> Option<(PathBuf, String, String)> {
    let info = std::fs::read_to_string("/proc/self/mountinfo").ok()?;
    let real = std::fs::canonicalize(path).unwrap_or_else(|_| path.to_path_buf());
    let want = format!("{major}:{minor}");
    let mut best: Option<(PathBuf, String, String, bool)> = None;
    for line in info.lines() {
        let Some((left, right)) = line.split_once(" - ") else {
            continue;
        };
        let l: Vec<&str> = left.split(' ').collect();
        let r: Vec<&str> = right.split(' ').collect();
        if l.len() < 5 || r.len() < 2 {
            continue;
        }
        let mount = PathBuf::from(unescape_mountinfo(l[4]));
        if !real.starts_with(&mount) {
            continue;
        }
        let dev_match = l[2] == want;
        let better = match &best {
            None => true,
            Some((m, _, _, bm)) => {
                (dev_match && !bm) || (dev_match == *bm && mount.as_os_str().len() >= m.as_os_str().len())
            }
        };
        if better {
            best = Some((mount, r[0].to_string(), r[1].to_string(), dev_match));
        }
    }
    best.map(|(m, t, s, _)| (m, t, s))
}

/// mountinfo escapes space, tab, newline and backslash as octal.
fn unescape_mountinfo(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'\\' && i + 3 < b.len() && b[i + 1..i + 4].iter().all(|c| (b'0'..=b'7').contains(c)) {
            out.push((b[i + 1] - b'0') * 64 + (b[i + 2] - b'0') * 8 + (b[i + 3] - b'0'));
            i += 4;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unescapes_octal() {
        assert_eq!(unescape_mountinfo(r"/mnt/a\040b"), "/mnt/a b");
        assert_eq!(unescape_mountinfo(r"/x\\"), r"/x\\");
    }

    #[test]
    fn probes_a_real_file() {
        let f = tempfile::NamedTempFile::new().unwrap();
        let t = probe(f.path(), f.as_file()).unwrap();
        assert!(t.dio_offset_align.is_power_of_two());
        assert!(t.dio_mem_align.is_power_of_two());
        assert_ne!(t.fs_type, "?");
    }
}
