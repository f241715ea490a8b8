//! The hwloc providers (feature `numa`): the live system, or a topology
//! exported as XML; and the fallbacks when hwloc fails or the feature is
//! off: the live system through sysfs ([`super::sysfs`]), an XML topology
//! to [`SingleNode`] (only hwloc reads one).
//!
//! [`SingleNode`]: super::SingleNode

use std::collections::HashMap;
#[cfg(feature = "numa")]
use std::sync::Arc;

use super::sysfs::Sysfs;
use super::Provider;
#[cfg(feature = "numa")]
use super::{disk_of, list_string, majority, members_of, parse_list, Locality, TopologyProvider};

fn warn_fallback_once(why: &str) {
    static WARNED: std::sync::Once = std::sync::Once::new();
    WARNED.call_once(|| tracing::warn!("NUMA placement unavailable ({why}); every drive's locality is unknown"));
}

#[cfg(feature = "numa")]
pub(super) fn xml_or_fallback(path: &std::path::Path, aliases: HashMap<String, String>) -> Provider {
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
pub(super) fn xml_or_fallback(path: &std::path::Path, _aliases: HashMap<String, String>) -> Provider {
    let why = format!(
        "WEIGHTSTREAM_NUMA_XML={} ignored: built without the `numa` feature",
        path.display()
    );
    warn_fallback_once(&why);
    Provider::off(&why)
}

#[cfg(feature = "numa")]
pub(super) fn live_or_fallback(aliases: HashMap<String, String>) -> Provider {
    static LIVE: std::sync::OnceLock<Result<Arc<Shared>, String>> = std::sync::OnceLock::new();
    match LIVE.get_or_init(|| Shared::live().map(Arc::new)) {
        Ok(shared) => Provider::new(Hwloc {
            shared: Arc::clone(shared),
            aliases,
        }),
        Err(e) => {
            static WARNED: std::sync::Once = std::sync::Once::new();
            WARNED.call_once(|| {
                tracing::warn!("hwloc topology: {e}; NUMA placement from sysfs instead (each drive's numa_node)")
            });
            Provider::new(Sysfs::live())
        }
    }
}

/// Without hwloc (the wheel's build), the live system through sysfs:
/// said once, as every fallback is. Device aliases are for XML topologies
/// only.
#[cfg(not(feature = "numa"))]
pub(super) fn live_or_fallback(_aliases: HashMap<String, String>) -> Provider {
    static SAID: std::sync::Once = std::sync::Once::new();
    SAID.call_once(|| {
        tracing::info!(
            "NUMA placement from sysfs (each drive's numa_node): this build has no hwloc (the `numa` feature)"
        )
    });
    Provider::new(Sysfs::live())
}

#[cfg(feature = "numa")]
pub use imp::Hwloc;
#[cfg(feature = "numa")]
use imp::Shared;

#[cfg(feature = "numa")]
mod imp {
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
    use std::fmt;

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
