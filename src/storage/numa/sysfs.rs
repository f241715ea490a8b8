//! NUMA placement from sysfs alone, without hwloc: what a build without the
//! `numa` feature places by (the wheel: hwloc's library and libudev are not
//! on a stock system, and a wheel that bundled them could not keep its old
//! glibc baseline), and what any build falls back to when hwloc fails.
//!
//! A drive's node is the `numa_node` of the first device above it in
//! `/sys/devices` that has one (an NVMe namespace's PCI function), its CPUs
//! `/sys/devices/system/node/nodeN/cpulist`: what hwloc reports for a
//! block device, whose first non-I/O ancestor is that node. A thread is
//! bound with `sched_setaffinity`, memory with `mbind(MPOL_BIND)`. What
//! hwloc adds and this lacks: topologies read from XML
//! (`WEIGHTSTREAM_NUMA_XML`, for tests of machines one does not have).

use std::path::{Path, PathBuf};

use super::{bind_cpus, disk_of, list_string, majority, members_of, parse_list, Locality, TopologyProvider};

/// Localities from a sysfs tree (`/sys`, or a copy of one in tests).
#[derive(Debug, Clone)]
pub(crate) struct Sysfs {
    root: PathBuf,
}

const SOURCE: &str = "sysfs";

impl Sysfs {
    /// The running system's `/sys`.
    pub(crate) fn live() -> Self {
        Sysfs { root: "/sys".into() }
    }

    #[cfg(test)]
    fn at(root: &Path) -> Self {
        Sysfs { root: root.into() }
    }

    /// The device directory of whole disk `disk` (or, when sysfs does not
    /// know the name, of `major:minor`).
    fn device_dir(&self, disk: &str, dev_id: Option<(u32, u32)>) -> Result<PathBuf, String> {
        let by_name = self.root.join("class/block").join(disk);
        if let Ok(p) = std::fs::canonicalize(&by_name) {
            return Ok(p);
        }
        if let Some((a, b)) = dev_id {
            let by_id = self.root.join(format!("dev/block/{a}:{b}"));
            if let Ok(p) = std::fs::canonicalize(&by_id) {
                return Ok(p);
            }
        }
        Err(format!("{disk}: not in {} (not a block device)", by_name.display()))
    }

    /// The node sysfs gives whole disk `disk`, or why none.
    fn node_of(&self, disk: &str, dev_id: Option<(u32, u32)>) -> Result<usize, String> {
        let dir = self.device_dir(disk, dev_id)?;
        if dir.starts_with(self.root.join("devices/virtual")) {
            return Err(format!("{disk}: a virtual device (no bus, so no locality)"));
        }
        let top = self.root.join("devices");
        let mut at: &Path = &dir;
        while at.starts_with(&top) && at != top {
            let file = at.join("numa_node");
            if let Ok(text) = std::fs::read_to_string(&file) {
                return match text.trim().parse::<i64>() {
                    Ok(n) if n >= 0 => usize::try_from(n).map_err(|e| e.to_string()),
                    Ok(_) => Err(format!(
                        "{disk}: {} says -1 (the firmware reports no locality; typical of virtual disks)",
                        file.display()
                    )),
                    Err(_) => Err(format!(
                        "{disk}: {} holds {:?}, not a node",
                        file.display(),
                        text.trim()
                    )),
                };
            }
            at = match at.parent() {
                Some(p) => p,
                None => break,
            };
        }
        Err(format!("{disk}: no numa_node above {}", dir.display()))
    }

    /// The locality of one whole disk.
    fn disk_locality(&self, disk: &str, dev_id: Option<(u32, u32)>) -> Locality {
        let node = match self.node_of(disk, dev_id) {
            Ok(n) => n,
            Err(why) => return Locality::unknown(SOURCE, why),
        };
        let file = self.root.join(format!("devices/system/node/node{node}/cpulist"));
        let cpus = std::fs::read_to_string(&file)
            .map_err(|e| format!("{}: {e}", file.display()))
            .and_then(|t| parse_list(t.trim()).ok_or_else(|| format!("{}: not a CPU list", file.display())));
        match cpus {
            Ok(cpus) if !cpus.is_empty() => Locality {
                node: Some(node),
                cpuset: Some(list_string(cpus)),
                nodeset: Some(node.to_string()),
                source: SOURCE,
                note: None,
            },
            Ok(_) => Locality::unknown(SOURCE, format!("{disk}: node {node} has no CPUs ({})", file.display())),
            Err(why) => Locality::unknown(SOURCE, format!("{disk}: node {node}: {why}")),
        }
    }
}

impl TopologyProvider for Sysfs {
    fn name(&self) -> String {
        SOURCE.into()
    }

    fn drive_locality(&self, device: &str, dev_id: Option<(u32, u32)>) -> Locality {
        let device = device.strip_prefix("/dev/").unwrap_or(device);
        let disk = disk_of(device);
        let members = members_of(&disk);
        if members.is_empty() {
            // A partition's MAJ:MIN is not its disk's.
            return self.disk_locality(&disk, if disk == device { dev_id } else { None });
        }
        let locs: Vec<(String, Locality)> = members
            .iter()
            .map(|m| (m.clone(), self.disk_locality(m, None)))
            .collect();
        majority(device, &locs, SOURCE)
    }

    fn bind_current_thread(&self, locality: &Locality) -> Result<(), String> {
        bind_cpus(locality)
    }

    fn bind_area(&self, area: &[u8], node: usize) -> Result<(), String> {
        if !self.root.join(format!("devices/system/node/node{node}")).exists() {
            return Err(format!("NUMA node {node} is not online"));
        }
        if !self.binds_for_real() {
            // A copy of another machine's sysfs: the binding would be
            // valid there; nothing of this process changes.
            return Ok(());
        }
        mbind_bind(area, node)
    }

    fn binds_for_real(&self) -> bool {
        self.root == Path::new("/sys")
    }
}

/// `mbind(area, MPOL_BIND, {node})`: the area's pages, when first touched,
/// come from `node` only. `area` must start on a page (an arena's does).
fn mbind_bind(area: &[u8], node: usize) -> Result<(), String> {
    const MPOL_BIND: libc::c_long = 2;
    const BITS: usize = libc::c_ulong::BITS as usize;
    let page = rustix::param::page_size();
    if area.is_empty() {
        return Ok(());
    }
    if !(area.as_ptr() as usize).is_multiple_of(page) {
        return Err(format!(
            "mbind: the area at {:p} does not start on a page",
            area.as_ptr()
        ));
    }
    if node >= 1 << 16 {
        return Err(format!("mbind: node {node} is beyond any node mask"));
    }
    let mut mask = vec![0 as libc::c_ulong; node / BITS + 1];
    mask[node / BITS] |= 1 << (node % BITS);
    // SAFETY: mbind only sets the memory policy of the pages in
    // [area, area + len), which `area` borrows (it is mapped for as long as
    // the call runs); it reads `mask.len() * BITS` bits from `mask`, which
    // is that long (maxnode = those bits + 1, as the kernel counts it, is
    // not more); flags 0 moves no page and writes no memory of ours.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_mbind,
            area.as_ptr(),
            area.len(),
            MPOL_BIND,
            mask.as_ptr(),
            mask.len() * BITS,
            0 as libc::c_uint,
        )
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(format!("mbind to node {node}: {}", std::io::Error::last_os_error()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A sysfs tree: an NVMe namespace under a PCI function on node 1, a
    /// virtio disk whose function says -1, a loop device (virtual), and
    /// node 1's CPUs.
    fn tree() -> tempfile::TempDir {
        let t = tempfile::tempdir().unwrap();
        let r = t.path();
        let pci = r.join("devices/pci0000:80/0000:80:01.0");
        let ns = pci.join("nvme/nvme0/nvme0n1");
        std::fs::create_dir_all(&ns).unwrap();
        std::fs::write(pci.join("numa_node"), "1\n").unwrap();
        let vd = r.join("devices/pci0000:00/0000:00:04.0/virtio1/block/vda");
        std::fs::create_dir_all(&vd).unwrap();
        std::fs::write(r.join("devices/pci0000:00/0000:00:04.0/numa_node"), "-1\n").unwrap();
        let lo = r.join("devices/virtual/block/loop7");
        std::fs::create_dir_all(&lo).unwrap();
        std::fs::create_dir_all(r.join("devices/system/node/node1")).unwrap();
        std::fs::write(r.join("devices/system/node/node1/cpulist"), "8-11,24\n").unwrap();
        std::fs::create_dir_all(r.join("class/block")).unwrap();
        std::fs::create_dir_all(r.join("dev/block")).unwrap();
        for (name, dir) in [("wsnvme0n1", &ns), ("wsvda", &vd), ("wsloop7", &lo)] {
            std::os::unix::fs::symlink(dir, r.join("class/block").join(name)).unwrap();
        }
        std::os::unix::fs::symlink(&ns, r.join("dev/block/259:0")).unwrap();
        t
    }

    // The names carry a prefix this machine's own /sys does not know, so
    // that disk_of and members_of (the real /sys) leave them as they are.

    #[test]
    fn a_drive_is_on_the_node_of_the_pci_function_above_it() {
        let t = tree();
        let l = Sysfs::at(t.path()).drive_locality("/dev/wsnvme0n1", None);
        assert_eq!(
            (l.node, l.cpuset.as_deref(), l.nodeset.as_deref(), l.source),
            (Some(1), Some("8-11,24"), Some("1"), "sysfs"),
            "{l:?}"
        );
    }

    #[test]
    fn a_name_sysfs_does_not_know_is_found_by_its_device_number() {
        let t = tree();
        let s = Sysfs::at(t.path());
        assert_eq!(s.drive_locality("wsrenamed", Some((259, 0))).node, Some(1));
        let l = s.drive_locality("wsrenamed", Some((8, 0)));
        assert_eq!(l.node, None);
        assert!(l.note.unwrap().contains("not a block device"));
    }

    #[test]
    fn virtual_disks_and_minus_one_are_unknown_never_node_0() {
        let t = tree();
        let s = Sysfs::at(t.path());
        let vd = s.drive_locality("wsvda", None);
        assert_eq!(vd.node, None);
        assert!(vd.note.as_deref().unwrap().contains("says -1"), "{vd:?}");
        let lo = s.drive_locality("wsloop7", None);
        assert_eq!(lo.node, None);
        assert!(lo.note.as_deref().unwrap().contains("virtual device"), "{lo:?}");
    }

    #[test]
    fn a_node_without_its_cpu_list_is_unknown_and_says_which_file() {
        let t = tree();
        std::fs::remove_file(t.path().join("devices/system/node/node1/cpulist")).unwrap();
        let l = Sysfs::at(t.path()).drive_locality("wsnvme0n1", None);
        assert_eq!(l.node, None);
        assert!(l.note.unwrap().contains("node1/cpulist"));
    }

    #[test]
    fn a_copy_of_sysfs_binds_nothing_for_real() {
        let t = tree();
        let s = Sysfs::at(t.path());
        assert!(!s.binds_for_real());
        assert!(Sysfs::live().binds_for_real());
        // Node 1 is online in the copy: valid there, not applied here (this
        // machine may have no node 1, and mbind would refuse it).
        let page = rustix::param::page_size();
        let v = vec![0u8; 2 * page];
        let off = v.as_ptr().align_offset(page);
        assert_eq!(s.bind_area(&v[off..off + page], 1), Ok(()));
        assert!(s.bind_area(&v[off..off + page], 2).unwrap_err().contains("not online"));
    }

    #[test]
    fn memory_binds_to_an_online_node_and_refuses_others() {
        // This machine's own node 0 (every Linux machine has it).
        let s = Sysfs::live();
        let page = rustix::param::page_size();
        let mut v = vec![0u8; 3 * page];
        let off = v.as_ptr().align_offset(page);
        let area = &v[off..off + page];
        if std::path::Path::new("/sys/devices/system/node/node0").exists() {
            assert_eq!(s.bind_area(area, 0), Ok(()));
        }
        assert!(s.bind_area(area, 4095).unwrap_err().contains("not online"));
        assert!(mbind_bind(&v[off + 1..off + 2], 0).unwrap_err().contains("page"));
        v[0] = 1;
    }
}
