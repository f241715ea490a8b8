//! NUMA placement: which node each drive sits on, and binding threads and
//! memory to it.
//!
//! A [`TopologyProvider`] answers three questions: where a block device is
//! ([`Locality`]: node, cpuset, nodeset, or unknown with the reason), bind
//! the calling thread to a locality's cpuset, and bind a memory area to a
//! node before first touch. Three providers:
//!
//! - [`Hwloc::live`] (feature `numa`): the running system through hwloc,
//!   topology built with I/O devices kept.
//! - [`Hwloc::from_xml_file`] (feature `numa`): a topology exported by
//!   `lstopo --of xml` (or written by hand), for tests and for users who pin
//!   a layout (`WEIGHTSTREAM_NUMA_XML=path`). Binding on an XML topology is a
//!   no-op (the machine it describes is not this one); the binding that
//!   *would* be made is still recorded, so placement is testable anywhere.
//! - [`SingleNode`]: no placement. Used when the feature is off, when hwloc
//!   fails (one warning), or with `WEIGHTSTREAM_NUMA=off` / `--numa off`.
//!
//! Device names are resolved before lookup: a partition to its disk, and a
//! device-mapper or md device to its members (`/sys/block/X/slaves`); when
//! members sit on different nodes the majority wins and the split is logged.
//! A device whose first non-I/O ancestor is the whole machine (virtual disks,
//! PCI `numa_node = -1`) has *unknown* locality, never "node 0".

use std::collections::HashMap;
use std::fmt;
use std::sync::Arc;

mod devices;
mod hwloc;
mod one_node;
mod sysfs;

pub(crate) use devices::parse_list;
pub(crate) use devices::{disk_of, list_string, majority, members_of};
#[cfg(feature = "numa")]
pub use hwloc::Hwloc;

/// Where a drive is: its NUMA node and the CPUs near it, or unknown and why.
#[derive(Debug, Clone, PartialEq, Eq, Default, serde::Serialize)]
pub struct Locality {
    /// The NUMA node (OS index); `None` when unknown.
    pub node: Option<usize>,
    /// CPUs local to the device, hwloc list syntax (`0-3,8`).
    pub cpuset: Option<String>,
    /// NUMA nodes local to the device, list syntax.
    pub nodeset: Option<String>,
    /// Which provider answered (`hwloc`, `hwloc-xml`, `single-node`).
    pub source: &'static str,
    /// Why the locality is unknown, or what was noticed (members split
    /// across nodes, an alias used).
    pub note: Option<String>,
}

impl Locality {
    /// An unknown locality with the reason.
    pub fn unknown(source: &'static str, why: impl Into<String>) -> Self {
        Locality {
            node: None,
            cpuset: None,
            nodeset: None,
            source,
            note: Some(why.into()),
        }
    }

    /// Whether the node is known.
    pub fn is_known(&self) -> bool {
        self.node.is_some()
    }
}

/// Answers where devices are, and binds threads and memory.
pub trait TopologyProvider: Send + Sync {
    /// Short name (`hwloc`, `hwloc-xml <path>`, `single-node`).
    fn name(&self) -> String;

    /// The locality of block device `device` (`nvme0n1`, `vda1`, `dm-0`;
    /// partitions and dm/md devices are resolved here), with its
    /// `major:minor` when known (matched against hwloc's `LinuxDeviceID`).
    fn drive_locality(&self, device: &str, dev_id: Option<(u32, u32)>) -> Locality;

    /// Binds the calling thread to `locality`'s cpuset. `Ok` when bound (or,
    /// for a provider that does not describe this system, when the binding
    /// would be valid: see [`TopologyProvider::binds_for_real`]).
    fn bind_current_thread(&self, locality: &Locality) -> Result<(), String>;

    /// Binds the pages of `area` to NUMA node `node` (policy bind). Call
    /// before the pages are first touched.
    fn bind_area(&self, area: &[u8], node: usize) -> Result<(), String>;

    /// Whether bind calls change this process (false for an XML topology of
    /// another machine, and for [`SingleNode`]).
    fn binds_for_real(&self) -> bool;

    /// Whether this provider places anything at all (false for [`SingleNode`]).
    fn places(&self) -> bool {
        true
    }
}

/// A shared provider handle (what [`crate::EngineConfig`] carries).
#[derive(Clone)]
pub struct Provider(pub Arc<dyn TopologyProvider>);

impl fmt::Debug for Provider {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Provider({})", self.0.name())
    }
}

impl std::ops::Deref for Provider {
    type Target = dyn TopologyProvider;
    fn deref(&self) -> &Self::Target {
        &*self.0
    }
}

impl Provider {
    /// A handle to `p`.
    pub fn new(p: impl TopologyProvider + 'static) -> Self {
        Provider(Arc::new(p))
    }

    /// The provider a configuration asks for: [`SingleNode`] when `off`, the
    /// XML topology at `xml` (device aliases from `device_map`, see
    /// `parse_device_map`), else the live system (built once per
    /// process) when more than one node is online; with one node online,
    /// node 0 with its CPUs from sysfs (`one_node`: what hwloc answers
    /// there, without its 10 ms topology build). Falls back to [`SingleNode`] with one warning when hwloc
    /// fails or the `numa` feature is off. (`WEIGHTSTREAM_NUMA`,
    /// `WEIGHTSTREAM_NUMA_XML` and `WEIGHTSTREAM_NUMA_DEVICE_MAP` are read by
    /// the configuration, which calls this.)
    pub fn from_settings(off: bool, xml: Option<&std::path::Path>, device_map: Option<&str>) -> Self {
        if off {
            return Provider::new(SingleNode::new("NUMA placement off (WEIGHTSTREAM_NUMA=off)"));
        }
        let aliases = device_map.map(parse_device_map).unwrap_or_default();
        if let Some(path) = xml {
            return hwloc::xml_or_fallback(path, aliases);
        }
        // One node online: every drive, CPU and page is on it, so there is
        // nothing to place, and building hwloc's topology (10 ms, the
        // largest part of Engine::new on such a machine, measured) would
        // only say so.
        if one_node_online() {
            if let Some(p) = one_node::OneNode::from_sysfs() {
                return Provider::new(p);
            }
        }
        hwloc::live_or_fallback(aliases)
    }

    /// [`SingleNode`]: no placement.
    pub fn off(why: &str) -> Self {
        Provider::new(SingleNode::new(why))
    }
}

/// What a machine with one NUMA node online says of every drive.
pub(crate) const ONE_NODE: &str =
    "one NUMA node online (/sys/devices/system/node/online): node 0, its CPUs from sysfs, hwloc not consulted";

/// `vda=nvme0n1,loop3=nvme1n1` -> aliases (real device name or `MAJ:MIN`
/// -> the OS device name in the topology). For testing with XML topologies.
pub(crate) fn parse_device_map(v: &str) -> HashMap<String, String> {
    v.split([',', ';'])
        .filter_map(|kv| {
            let (k, v) = kv.split_once('=')?;
            let (k, v) = (k.trim(), v.trim());
            (!k.is_empty() && !v.is_empty()).then(|| (k.to_string(), v.to_string()))
        })
        .collect()
}

/// No placement: every locality unknown, binding a no-op.
#[derive(Debug, Clone)]
pub struct SingleNode {
    why: String,
}

impl SingleNode {
    /// A provider that places nothing, saying `why` in every locality.
    pub fn new(why: &str) -> Self {
        SingleNode { why: why.to_string() }
    }
}

impl TopologyProvider for SingleNode {
    fn name(&self) -> String {
        "single-node".into()
    }
    fn drive_locality(&self, _device: &str, _dev_id: Option<(u32, u32)>) -> Locality {
        Locality::unknown("single-node", self.why.clone())
    }
    fn bind_current_thread(&self, _locality: &Locality) -> Result<(), String> {
        Err(self.why.clone())
    }
    fn bind_area(&self, _area: &[u8], _node: usize) -> Result<(), String> {
        Err(self.why.clone())
    }
    fn binds_for_real(&self) -> bool {
        false
    }
    fn places(&self) -> bool {
        false
    }
}

/// Binds the calling thread to `locality`'s cpuset (`sched_setaffinity`).
pub(crate) fn bind_cpus(locality: &Locality) -> Result<(), String> {
    let list = locality.cpuset.as_deref().ok_or("no cpuset")?;
    let cpus = parse_list(list).ok_or_else(|| format!("bad cpuset {list:?}"))?;
    let mut set = rustix::thread::CpuSet::new();
    for c in cpus {
        if c >= rustix::thread::CpuSet::MAX_CPU {
            return Err(format!(
                "CPU {c} is beyond the {} a CPU set holds",
                rustix::thread::CpuSet::MAX_CPU
            ));
        }
        set.set(c);
    }
    rustix::thread::sched_setaffinity(None, &set).map_err(|e| format!("sched_setaffinity: {e}"))
}

/// Binds the calling thread to `locality` through `provider` and says what
/// happened: `cpuset 0-3`, `would bind cpuset 4-7 (...)`, `not bound: ...`.
pub fn bind_thread_described(provider: &dyn TopologyProvider, locality: &Locality) -> String {
    let Some(cpus) = locality.cpuset.as_deref().filter(|_| locality.is_known()) else {
        return "not bound: NUMA locality unknown".to_string();
    };
    match provider.bind_current_thread(locality) {
        Ok(()) if provider.binds_for_real() => format!("cpuset {cpus}"),
        Ok(()) => format!(
            "would bind cpuset {cpus} ({} does not describe this system: not applied)",
            provider.name()
        ),
        Err(e) => format!("not bound: binding cpuset {cpus} failed: {e}"),
    }
}

/// Whether `binding` (what [`bind_thread_described`] said) is a binding of a
/// known locality that failed.
pub(crate) fn binding_failed(binding: &str) -> bool {
    binding.starts_with("not bound: binding")
}

/// NUMA nodes online on this machine (`/sys/devices/system/node/online`;
/// 1 when unreadable), read once.
pub(crate) fn online_nodes() -> usize {
    online_node_count().unwrap_or(1)
}

/// Whether `/sys/devices/system/node/online` says exactly one node is
/// online (false when it cannot be read: then hwloc is asked).
fn one_node_online() -> bool {
    online_node_count() == Some(1)
}

/// The nodes `/sys/devices/system/node/online` lists (None when it cannot
/// be read or parsed), read once.
fn online_node_count() -> Option<usize> {
    static NODES: std::sync::OnceLock<Option<usize>> = std::sync::OnceLock::new();
    *NODES.get_or_init(|| {
        std::fs::read_to_string("/sys/devices/system/node/online")
            .ok()
            .and_then(|s| parse_list(s.trim()))
            .map(|nodes| nodes.len())
            .filter(|&n| n > 0)
    })
}

/// What an I/O thread of one drive binds itself to when it starts.
#[derive(Debug, Clone)]
pub(crate) struct ThreadPlacement {
    pub provider: Provider,
    pub locality: Locality,
}

impl ThreadPlacement {
    /// Binds the calling thread; says what happened (a failed binding of
    /// a known locality is also warned, once per process).
    pub(crate) fn apply(&self) -> String {
        let b = bind_thread_described(&*self.provider, &self.locality);
        if binding_failed(&b) {
            static WARNED: std::sync::Once = std::sync::Once::new();
            WARNED.call_once(|| tracing::warn!("I/O thread {b} (reported per drive as thread_binding in the stats)"));
        }
        b
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lists_round_trip() {
        assert_eq!(list_string([0, 1, 2, 3, 8, 10, 11]), "0-3,8,10-11");
        assert_eq!(list_string([5]), "5");
        assert_eq!(list_string([]), "");
        assert_eq!(parse_list("0-3,8,10-11").unwrap(), [0, 1, 2, 3, 8, 10, 11]);
        assert!(parse_list("3-1").is_none());
        assert!(parse_list("x").is_none());
    }

    #[test]
    fn device_map_parses() {
        let m = parse_device_map("vda=nvme0n1, loop3 = nvme1n1,bad,=x");
        assert_eq!(m.len(), 2);
        assert_eq!(m["vda"], "nvme0n1");
        assert_eq!(m["loop3"], "nvme1n1");
    }

    #[test]
    fn majority_picks_the_most_members_and_notes_a_split() {
        let at = |n: usize| Locality {
            node: Some(n),
            cpuset: Some(format!("{n}")),
            nodeset: Some(format!("{n}")),
            source: "t",
            note: None,
        };
        let m = vec![("a".into(), at(1)), ("b".into(), at(0)), ("c".into(), at(1))];
        let l = majority("md0", &m, "t");
        assert_eq!(l.node, Some(1));
        assert!(l.note.unwrap().contains("different nodes"));
        let none = vec![("a".into(), Locality::unknown("t", "virtual"))];
        assert_eq!(majority("dm-0", &none, "t").node, None);
    }

    #[test]
    fn single_node_knows_nothing_and_binds_nothing() {
        let p = SingleNode::new("off for the test");
        let l = p.drive_locality("nvme0n1", Some((259, 0)));
        assert_eq!(l.node, None);
        assert!(bind_thread_described(&p, &l).starts_with("not bound"));
        assert!(p.bind_area(&[0u8; 16], 0).is_err());
    }

    #[test]
    fn partitions_resolve_to_their_disk() {
        // Whatever this machine has: a name sysfs does not know maps to itself.
        assert_eq!(disk_of("no-such-dev"), "no-such-dev");
        assert!(members_of("no-such-dev").is_empty());
    }
}
