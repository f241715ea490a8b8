//! A machine with one NUMA node online: everything is on node 0, so the
//! only placement left is each I/O thread's CPUs (node 0's, from sysfs),
//! which is what hwloc answered there, without building its topology
//! (10 ms of `Engine::new`, measured).

use super::{list_string, parse_list, Locality, TopologyProvider};

/// Every drive on node 0, whose CPUs are `/sys/devices/system/node/node0/cpulist`.
#[derive(Debug, Clone)]
pub(crate) struct OneNode {
    cpus: Vec<usize>,
}

impl OneNode {
    /// Node 0's CPUs from sysfs; `None` when they cannot be read (then
    /// hwloc is asked, as on any other machine).
    pub(crate) fn from_sysfs() -> Option<Self> {
        let text = std::fs::read_to_string("/sys/devices/system/node/node0/cpulist").ok()?;
        let cpus = parse_list(text.trim())?;
        (!cpus.is_empty()).then_some(OneNode { cpus })
    }
}

impl TopologyProvider for OneNode {
    fn name(&self) -> String {
        "one-node".into()
    }

    fn drive_locality(&self, _device: &str, _dev_id: Option<(u32, u32)>) -> Locality {
        Locality {
            node: Some(0),
            cpuset: Some(list_string(self.cpus.iter().copied())),
            nodeset: Some("0".into()),
            source: "one-node",
            note: Some(super::ONE_NODE.into()),
        }
    }

    fn bind_current_thread(&self, locality: &Locality) -> Result<(), String> {
        super::bind_cpus(locality)
    }

    /// One node: every page is on it already.
    fn bind_area(&self, _area: &[u8], node: usize) -> Result<(), String> {
        if node == 0 {
            Ok(())
        } else {
            Err(format!("NUMA node {node} is not online (one node online: 0)"))
        }
    }

    fn binds_for_real(&self) -> bool {
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_drive_is_on_node_0_with_node_0s_cpus() {
        let p = OneNode { cpus: vec![0, 1, 2, 3] };
        let l = p.drive_locality("nvme0n1", Some((259, 0)));
        assert_eq!(
            (l.node, l.cpuset.as_deref(), l.nodeset.as_deref()),
            (Some(0), Some("0-3"), Some("0"))
        );
        assert!(l.note.unwrap().contains("one NUMA node"));
        assert!(p.bind_area(&[0u8; 8], 0).is_ok());
        assert!(p.bind_area(&[0u8; 8], 1).unwrap_err().contains("node 1"));
    }

    #[test]
    fn binding_a_thread_to_the_cpus_it_may_use_works() {
        // This thread's own allowed CPUs: binding to them changes nothing.
        let mine = rustix::thread::sched_getaffinity(None).unwrap();
        let cpus: Vec<usize> = (0..rustix::thread::CpuSet::MAX_CPU)
            .filter(|&c| mine.is_set(c))
            .collect();
        let p = OneNode { cpus: cpus.clone() };
        let l = p.drive_locality("x", None);
        p.bind_current_thread(&l).unwrap();
        let after = rustix::thread::sched_getaffinity(None).unwrap();
        assert!(cpus.iter().all(|&c| after.is_set(c)));
    }
}
