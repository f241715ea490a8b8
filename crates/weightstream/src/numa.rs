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

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::sync::Arc;

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
    pub fn new(p: impl TopologyProvider + 'static) -> Self {
        Provider(Arc::new(p))
    }

    /// The provider the environment asks for: [`SingleNode`] with
    /// `WEIGHTSTREAM_NUMA=off`, an XML topology with
    /// `WEIGHTSTREAM_NUMA_XML=path` (aliases from
    /// `WEIGHTSTREAM_NUMA_DEVICE_MAP`), else the live system (built once per
    /// process). Falls back to [`SingleNode`] with one warning when hwloc
    /// fails or the `numa` feature is off.
    pub fn from_env() -> Self {
        let var = |k: &str| std::env::var(k).ok().filter(|v| !v.trim().is_empty());
        if var("WEIGHTSTREAM_NUMA").is_some_and(|v| is_off(&v)) {
            return Provider::new(SingleNode::new("NUMA placement off (WEIGHTSTREAM_NUMA=off)"));
        }
        let aliases = var("WEIGHTSTREAM_NUMA_DEVICE_MAP")
            .map(|v| parse_device_map(&v))
            .unwrap_or_default();
        if let Some(path) = var("WEIGHTSTREAM_NUMA_XML") {
            return xml_or_fallback(std::path::Path::new(&path), aliases);
        }
        live_or_fallback(aliases)
    }

    /// [`SingleNode`]: no placement.
    pub fn off(why: &str) -> Self {
        Provider::new(SingleNode::new(why))
    }
}

/// Whether a switch value means off.
pub fn is_off(v: &str) -> bool {
    matches!(v.trim().to_ascii_lowercase().as_str(), "0" | "off" | "false" | "no")
}

/// `vda=nvme0n1,loop3=nvme1n1` -> aliases (real device name or `MAJ:MIN`
/// -> the OS device name in the topology). For testing with XML topologies.
pub fn parse_device_map(v: &str) -> HashMap<String, String> {
    v.split([',', ';'])
        .filter_map(|kv| {
            let (k, v) = kv.split_once('=')?;
            let (k, v) = (k.trim(), v.trim());
            (!k.is_empty() && !v.is_empty()).then(|| (k.to_string(), v.to_string()))
        })
        .collect()
}

fn warn_fallback_once(why: &str) {
    static WARNED: std::sync::Once = std::sync::Once::new();
    WARNED.call_once(|| tracing::warn!("NUMA placement unavailable ({why}); every drive's locality is unknown"));
}

#[cfg(feature = "numa")]
fn xml_or_fallback(path: &std::path::Path, aliases: HashMap<String, String>) -> Provider {
    match Hwloc::from_xml_file(path, aliases) {
        Ok(h) => Provider::new(h),
        Err(e) => {
            let why = format!("WEIGHTSTREAM_NUMA_XML={}: {e}", path.display());
            warn_fallback_once(&why);
            Provider::off(&why)
        }
    }
}

#[cfg(not(feature = "numa"))]
fn xml_or_fallback(path: &std::path::Path, _aliases: HashMap<String, String>) -> Provider {
    let why = format!(
        "WEIGHTSTREAM_NUMA_XML={} ignored: built without the `numa` feature",
        path.display()
    );
    warn_fallback_once(&why);
    Provider::off(&why)
}

#[cfg(feature = "numa")]
fn live_or_fallback(aliases: HashMap<String, String>) -> Provider {
    static LIVE: std::sync::OnceLock<Result<Arc<hwloc_impl::Shared>, String>> = std::sync::OnceLock::new();
    match LIVE.get_or_init(|| hwloc_impl::Shared::live().map(Arc::new)) {
        Ok(shared) => Provider::new(Hwloc {
            shared: Arc::clone(shared),
            aliases,
        }),
        Err(e) => {
            let why = format!("hwloc topology: {e}");
            warn_fallback_once(&why);
            Provider::off(&why)
        }
    }
}

#[cfg(not(feature = "numa"))]
fn live_or_fallback(_aliases: HashMap<String, String>) -> Provider {
    Provider::off("built without the `numa` feature")
}

/// No placement: every locality unknown, binding a no-op.
#[derive(Debug, Clone)]
pub struct SingleNode {
    why: String,
}

impl SingleNode {
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

/// What an I/O thread of one drive binds itself to when it starts.
#[derive(Debug, Clone)]
pub(crate) struct ThreadPlacement {
    pub provider: Provider,
    pub locality: Locality,
}

impl ThreadPlacement {
    /// Binds the calling thread; says what happened (a failed binding of
    /// a known locality is also warned, once per process).
    pub fn apply(&self) -> String {
        let b = bind_thread_described(&*self.provider, &self.locality);
        if b.starts_with("not bound: binding") {
            static WARNED: std::sync::Once = std::sync::Once::new();
            WARNED.call_once(|| tracing::warn!("I/O thread {b} (reported per drive as thread_binding in the stats)"));
        }
        b
    }
}

// ---------------------------------------------------------------------------
// Device-name resolution (sysfs)
// ---------------------------------------------------------------------------

/// The whole-disk name of `dev` (`nvme0n1p2` -> `nvme0n1`), through sysfs;
/// `dev` itself when sysfs does not know it.
pub fn disk_of(dev: &str) -> String {
    let dev = dev.strip_prefix("/dev/").unwrap_or(dev);
    let Ok(real) = std::fs::canonicalize(format!("/sys/class/block/{dev}")) else {
        return dev.to_string();
    };
    let disk = if real.join("partition").exists() {
        real.parent().map(|p| p.to_path_buf()).unwrap_or(real)
    } else {
        real
    };
    disk.file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| dev.to_string())
}

/// The members of a stacked device (device-mapper, md): the disks behind
/// `/sys/block/X/slaves`, resolved recursively to whole disks. Empty for a
/// plain disk.
pub fn members_of(disk: &str) -> Vec<String> {
    fn walk(disk: &str, depth: usize, out: &mut Vec<String>) {
        let Ok(rd) = std::fs::read_dir(format!("/sys/block/{disk}/slaves")) else {
            if depth > 0 {
                out.push(disk.to_string());
            }
            return;
        };
        let mut names: Vec<String> = rd
            .filter_map(|e| e.ok())
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        if names.is_empty() {
            if depth > 0 {
                out.push(disk.to_string());
            }
            return;
        }
        for n in names {
            let d = disk_of(&n);
            if depth < 8 && !out.contains(&d) {
                walk(&d, depth + 1, out);
            }
        }
    }
    let mut out = Vec::new();
    walk(disk, 0, &mut out);
    out.dedup();
    out
}

/// Combines member localities: the majority node wins (ties: the lowest
/// node); a split is noted and logged.
pub fn majority(device: &str, members: &[(String, Locality)], source: &'static str) -> Locality {
    let mut votes: BTreeMap<usize, usize> = BTreeMap::new();
    for (_, l) in members {
        if let Some(n) = l.node {
            *votes.entry(n).or_default() += 1;
        }
    }
    let Some((&node, _)) = votes.iter().max_by(|a, b| a.1.cmp(b.1).then(b.0.cmp(a.0))) else {
        let why: Vec<String> = members
            .iter()
            .map(|(m, l)| format!("{m}: {}", l.note.as_deref().unwrap_or("unknown")))
            .collect();
        return Locality::unknown(
            source,
            format!("{device}: no member with a known node ({})", why.join("; ")),
        );
    };
    let mut loc = members
        .iter()
        .find(|(_, l)| l.node == Some(node))
        .map(|(_, l)| l.clone())
        .expect("a member voted for this node");
    let placed: Vec<String> = members
        .iter()
        .map(|(m, l)| {
            format!(
                "{m} on {}",
                l.node.map_or("unknown".to_string(), |n| format!("node {n}"))
            )
        })
        .collect();
    if votes.len() > 1 || members.iter().any(|(_, l)| l.node.is_none()) {
        let note = format!(
            "{device}: members on different nodes ({}); placed on node {node} by majority",
            placed.join(", ")
        );
        tracing::warn!("{note}");
        loc.note = Some(note);
    } else {
        loc.note = Some(format!("{device}: members {}", placed.join(", ")));
    }
    loc
}

/// `0-3,8,10-11` from sorted indices.
pub fn list_string(idx: impl IntoIterator<Item = usize>) -> String {
    let mut out: Vec<String> = Vec::new();
    let mut run: Option<(usize, usize)> = None;
    let flush = |run: (usize, usize), out: &mut Vec<String>| {
        out.push(if run.0 == run.1 {
            run.0.to_string()
        } else {
            format!("{}-{}", run.0, run.1)
        })
    };
    for i in idx {
        run = match run {
            Some((a, b)) if i == b + 1 => Some((a, i)),
            Some(r) => {
                flush(r, &mut out);
                Some((i, i))
            }
            None => Some((i, i)),
        };
    }
    if let Some(r) = run {
        flush(r, &mut out);
    }
    out.join(",")
}

/// Indices of a list string (`0-3,8`); `None` when malformed.
pub fn parse_list(s: &str) -> Option<Vec<usize>> {
    let mut out = Vec::new();
    for part in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        match part.split_once('-') {
            Some((a, b)) => {
                let (a, b): (usize, usize) = (a.trim().parse().ok()?, b.trim().parse().ok()?);
                if b < a || b - a > 1 << 20 {
                    return None;
                }
                out.extend(a..=b);
            }
            None => out.push(part.parse().ok()?),
        }
    }
    Some(out)
}

#[cfg(feature = "numa")]
pub use hwloc_impl::Hwloc;

#[cfg(feature = "numa")]
mod hwloc_impl {
    use super::*;
    use hwlocality::{
        cpu::{binding::CpuBindingFlags, cpuset::CpuSet},
        memory::{
            binding::{MemoryBindingFlags, MemoryBindingPolicy},
            nodeset::NodeSet,
        },
        object::{attributes::ObjectAttributes, types::OSDeviceType, TopologyObject},
        topology::builder::{TopologyBuilder, TypeFilter},
        Topology,
    };

    /// One loaded topology (shared between providers with different aliases).
    pub(super) struct Shared {
        topo: Topology,
        xml: Option<std::path::PathBuf>,
    }

    impl Shared {
        pub(super) fn live() -> Result<Self, String> {
            let topo = Topology::builder()
                .with_io_type_filter(TypeFilter::KeepImportant)
                .map_err(|e| e.to_string())?
                .build()
                .map_err(|e| e.to_string())?;
            Ok(Shared { topo, xml: None })
        }
    }

    /// hwloc through hwlocality: the live system, or an XML topology.
    pub struct Hwloc {
        pub(super) shared: Arc<Shared>,
        /// Real device name (or `MAJ:MIN`) -> OS device name in the topology.
        pub(super) aliases: HashMap<String, String>,
    }

    impl fmt::Debug for Hwloc {
        fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            write!(f, "Hwloc({})", self.name())
        }
    }

    impl Hwloc {
        /// The running system (topology with I/O devices kept).
        pub fn live() -> Result<Self, String> {
            Ok(Hwloc {
                shared: Arc::new(Shared::live()?),
                aliases: HashMap::new(),
            })
        }

        /// A topology from an XML file (`lstopo --of xml`), with `aliases`
        /// mapping real device names (or `MAJ:MIN`) to OS device names in
        /// the file. Binding through it is a no-op: it describes another
        /// machine (the binding that would be made is still reported).
        pub fn from_xml_file(path: &std::path::Path, aliases: HashMap<String, String>) -> Result<Self, String> {
            // Read it here: hwlocality's from_xml_file panics on a missing file.
            let xml = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
            let topo = TopologyBuilder::new()
                .from_xml(&xml)
                .map_err(|e| format!("{}: {e}", path.display()))?
                .with_io_type_filter(TypeFilter::KeepAll)
                .map_err(|e| e.to_string())?
                .build()
                .map_err(|e| format!("{}: {e}", path.display()))?;
            Ok(Hwloc {
                shared: Arc::new(Shared {
                    topo,
                    xml: Some(path.to_path_buf()),
                }),
                aliases,
            })
        }

        /// The same topology with other aliases.
        pub fn with_aliases(&self, aliases: HashMap<String, String>) -> Self {
            Hwloc {
                shared: Arc::clone(&self.shared),
                aliases,
            }
        }

        fn source(&self) -> &'static str {
            if self.shared.xml.is_some() {
                "hwloc-xml"
            } else {
                "hwloc"
            }
        }

        fn find_osdev(&self, name: &str, dev_id: Option<&str>) -> Option<&TopologyObject> {
            let storage = |obj: &&TopologyObject| {
                matches!(obj.attributes(),
                    Some(ObjectAttributes::OSDevice(a)) if a.device_type() == OSDeviceType::Storage)
            };
            let topo = &self.shared.topo;
            topo.os_devices()
                .filter(storage)
                .find(|o| o.name().is_some_and(|n| n.to_bytes() == name.as_bytes()))
                .or_else(|| {
                    let id = dev_id?;
                    topo.os_devices()
                        .filter(storage)
                        .find(|o| o.info("LinuxDeviceID").is_some_and(|v| v.to_bytes() == id.as_bytes()))
                })
        }

        /// Locality of one whole disk (no stacking).
        fn disk_locality(&self, name: &str, dev_id: Option<&str>) -> Locality {
            let src = self.source();
            let Some(osdev) = self.find_osdev(name, dev_id) else {
                return Locality::unknown(
                    src,
                    format!(
                        "no hwloc block device {name}{} (not a block device, or hwloc cannot see it)",
                        dev_id.map(|d| format!(" or LinuxDeviceID {d}")).unwrap_or_default()
                    ),
                );
            };
            let Some(anc) = osdev.first_non_io_ancestor() else {
                return Locality::unknown(src, format!("{name}: no non-I/O ancestor"));
            };
            if anc.parent().is_none() {
                return Locality::unknown(
                    src,
                    format!("{name}: hwloc attaches it to the whole machine (no locality reported; typical of virtual disks)"),
                );
            }
            let (Some(cpus), Some(nodes)) = (anc.cpuset(), anc.nodeset()) else {
                return Locality::unknown(src, format!("{name}: ancestor without cpuset/nodeset"));
            };
            let cpuset = list_string(cpus.iter_set().map(usize::from));
            let node_list: Vec<usize> = nodes.iter_set().map(usize::from).collect();
            let node = (node_list.len() == 1).then(|| node_list[0]);
            Locality {
                node,
                cpuset: Some(cpuset),
                nodeset: Some(list_string(node_list.iter().copied())),
                source: src,
                note: match node {
                    Some(_) => None,
                    None => Some(format!("{name}: local to several nodes ({})", list_string(node_list))),
                },
            }
        }
    }

    impl TopologyProvider for Hwloc {
        fn name(&self) -> String {
            match &self.shared.xml {
                Some(p) => format!("hwloc-xml {}", p.display()),
                None => "hwloc".into(),
            }
        }

        fn drive_locality(&self, device: &str, dev_id: Option<(u32, u32)>) -> Locality {
            let device = device.strip_prefix("/dev/").unwrap_or(device);
            let id = dev_id.map(|(a, b)| format!("{a}:{b}"));
            // Aliases (testing with XML topologies): by name, then MAJ:MIN.
            if let Some(alias) = self
                .aliases
                .get(device)
                .or_else(|| id.as_ref().and_then(|i| self.aliases.get(i)))
            {
                let mut l = self.disk_locality(alias, None);
                let was = format!("{device} mapped to {alias} (WEIGHTSTREAM_NUMA_DEVICE_MAP)");
                l.note = Some(match l.note {
                    Some(n) => format!("{was}: {n}"),
                    None => was,
                });
                return l;
            }
            let disk = disk_of(device);
            let members = members_of(&disk);
            if members.is_empty() {
                // A partition's MAJ:MIN is not its disk's: match by id only
                // when the name was the disk itself.
                let id = if disk == device { id.as_deref() } else { None };
                return self.disk_locality(&disk, id);
            }
            let locs: Vec<(String, Locality)> = members
                .iter()
                .map(|m| (m.clone(), self.disk_locality(m, None)))
                .collect();
            majority(device, &locs, self.source())
        }

        fn bind_current_thread(&self, locality: &Locality) -> Result<(), String> {
            let list = locality.cpuset.as_deref().ok_or("no cpuset")?;
            let idx = parse_list(list).ok_or_else(|| format!("bad cpuset {list:?}"))?;
            if !self.binds_for_real() {
                return Ok(());
            }
            let mut set = CpuSet::new();
            for i in idx {
                set.set(i);
            }
            self.shared
                .topo
                .bind_cpu(&set, CpuBindingFlags::THREAD)
                .map_err(|e| e.to_string())
        }

        fn bind_area(&self, area: &[u8], node: usize) -> Result<(), String> {
            let topo = &self.shared.topo;
            if !topo.nodeset().iter_set().any(|n| usize::from(n) == node) {
                return Err(format!(
                    "NUMA node {node} is not in the topology (nodes {})",
                    list_string(topo.nodeset().iter_set().map(usize::from))
                ));
            }
            if !self.binds_for_real() {
                return Ok(());
            }
            let mut set = NodeSet::new();
            set.set(node);
            topo.bind_memory_area(area, &set, MemoryBindingPolicy::Bind, MemoryBindingFlags::empty())
                .map_err(|e| e.to_string())
        }

        fn binds_for_real(&self) -> bool {
            self.shared.topo.is_this_system()
        }
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
