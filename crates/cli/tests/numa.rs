//! NUMA placement on a one-node machine: a hand-written XML topology of a
//! two-socket host (tests/fixtures/two-socket-nvme.xml: node 0 = CPUs 0-3
//! with nvme0n1 = 259:0, node 1 = CPUs 4-7 with nvme1n1 = 259:1) drives the
//! whole mapping, with this machine's drives aliased onto its NVMe devices;
//! the live hwloc path is checked against what this machine is (a virtual
//! disk: locality unknown); `numa: false` and a build without the feature
//! give the single-node provider, and everything still reads.

mod common;

use weightstream::{Arena, Engine, EngineConfig, Model, ModelConfig, RoutePolicy};
use weightstream_synth as synth;

/// A small synthetic model on the build's volume with a full mirror on
/// /dev/shm (a second drive); `None` (SKIP) without a second volume.
struct Fixture {
    _primary: tempfile::TempDir,
    _mirror: tempfile::TempDir,
    model: Model,
    seed: u64,
}

fn mirrored(route: RoutePolicy) -> Option<Fixture> {
    let mirror = common::second_drive_tempdir()?;
    let primary = common::tempdir();
    let spec = common::small_synth_spec();
    common::synth_model(primary.path(), &spec);
    let names = common::shard_names(primary.path());
    let names: Vec<&str> = names.iter().map(String::as_str).collect();
    common::copy_files(primary.path(), mirror.path(), &names);
    let model = Model::open(ModelConfig::new(primary.path()).mirrors([mirror.path()]).route(route)).unwrap();
    assert_eq!(model.drives().len(), 2, "primary and mirror on two drives");
    Some(Fixture {
        _primary: primary,
        _mirror: mirror,
        model,
        seed: spec.seed,
    })
}

/// Reads every tensor one at a time into `arena`, verifies every byte, and
/// returns the bytes each drive served and the cross-node bytes, as deltas.
fn read_all(engine: &Engine, arena: &Arena, seed: u64) -> (Vec<u64>, u64) {
    read_these(engine, arena, engine.model().catalog().tensors(), seed)
}

/// [`read_all`] for one tensor.
#[cfg(feature = "numa")]
fn read_one(engine: &Engine, arena: &Arena, t: &weightstream::TensorRef, seed: u64) -> (Vec<u64>, u64) {
    read_these(engine, arena, std::slice::from_ref(t), seed)
}

fn read_these(engine: &Engine, arena: &Arena, tensors: &[weightstream::TensorRef], seed: u64) -> (Vec<u64>, u64) {
    let before = engine.stats();
    for t in tensors {
        let slot = arena.take().expect("a free slot");
        let loaded = engine.read(t, slot).unwrap().wait().unwrap();
        assert!(synth::verify(seed, &t.name, &loaded[..]), "{}: bytes differ", t.name);
        arena.give_back(loaded.into_slot());
    }
    let after = engine.stats();
    let bytes = after
        .drives
        .iter()
        .zip(&before.drives)
        .map(|(a, b)| a.bytes - b.bytes)
        .collect();
    let cross = after.drives.iter().map(|d| d.cross_node_bytes).sum::<u64>()
        - before.drives.iter().map(|d| d.cross_node_bytes).sum::<u64>();
    (bytes, cross)
}

fn largest(model: &Model) -> usize {
    model.catalog().largest("").unwrap() as usize
}

fn configs() -> Vec<EngineConfig> {
    common::engine_backends()
        .into_iter()
        .map(|b| EngineConfig::default().backend(b.parse().unwrap()))
        .collect()
}

/// With placement off the single-node provider answers: nothing known,
/// nothing bound, `arena_on` is a plain arena, and every byte still arrives.
/// Runs with and without the `numa` feature.
#[test]
fn numa_off_is_single_node_and_reads_verify() {
    let Some(fx) = mirrored(RoutePolicy::Adaptive) else {
        return;
    };
    for base in configs() {
        let engine = Engine::new(&fx.model, base.numa(false)).unwrap();
        assert_eq!(engine.numa_provider().name(), "single-node");
        for p in engine.placements() {
            assert_eq!(p.locality.node, None, "{p:?}");
            assert!(p.thread_binding.starts_with("not bound"), "{p:?}");
            assert!(p.locality.note.as_deref().unwrap().contains("off"), "{p:?}");
        }
        let arena = engine
            .arena_on(0, weightstream::SlotSpec::new(largest(&fx.model)), 2)
            .unwrap();
        assert_eq!(arena.node(), None);
        let (bytes, cross) = read_all(&engine, &arena, fx.seed);
        assert!(bytes.iter().sum::<u64>() > 0);
        assert_eq!(cross, 0);
        let v = serde_json::to_value(engine.stats()).unwrap();
        for d in v["drives"].as_array().unwrap() {
            assert!(d["numa_node"].is_null(), "{d}");
            assert_eq!(d["cross_node_bytes"], 0);
            assert!(d["thread_binding"].as_str().unwrap().starts_with("not bound"), "{d}");
        }
    }
}

/// The default engine works in both builds: with the feature the live (or
/// environment's) provider, without it sysfs's (one node online: node 0's
/// CPUs from sysfs), never no placement at all.
#[test]
fn default_engine_reports_placement_in_both_builds() {
    let Some(fx) = mirrored(RoutePolicy::Adaptive) else {
        return;
    };
    let engine = Engine::new(&fx.model, EngineConfig::default()).unwrap();
    if cfg!(not(feature = "numa")) {
        let name = engine.numa_provider().name();
        assert!(name == "sysfs" || name == "one-node", "{name}");
    }
    for p in engine.placements() {
        // Known or not, the binding is reported, and an unknown node says why.
        assert!(!p.thread_binding.is_empty());
        if p.locality.node.is_none() {
            assert!(p.locality.note.is_some(), "{p:?}");
        }
    }
    let arena = engine
        .arena(weightstream::SlotSpec::new(largest(&fx.model)), 2)
        .unwrap();
    let (bytes, _) = read_all(&engine, &arena, fx.seed);
    assert!(bytes.iter().sum::<u64>() > 0);
}

#[cfg(feature = "numa")]
mod with_hwloc {
    use super::*;
    use std::collections::HashMap;
    use std::path::{Path, PathBuf};
    use weightstream::__internal::bind_thread_described;
    use weightstream::{Hwloc, Provider, TopologyProvider};

    fn fixture() -> PathBuf {
        common::lib_tests_dir().join("fixtures/two-socket-nvme.xml")
    }

    fn xml(aliases: HashMap<String, String>) -> Hwloc {
        Hwloc::from_xml_file(&fixture(), aliases).expect("load the two-socket fixture")
    }

    /// The two-socket fixture maps each NVMe drive to its socket, by name
    /// and by LinuxDeviceID; an unknown device is unknown, not node 0.
    #[test]
    fn xml_maps_each_nvme_to_its_socket() {
        let p = xml(HashMap::new());
        assert!(!p.binds_for_real(), "an XML topology of another machine binds nothing");
        let n0 = p.drive_locality("nvme0n1", None);
        assert_eq!(
            (n0.node, n0.cpuset.as_deref(), n0.nodeset.as_deref()),
            (Some(0), Some("0-3"), Some("0"))
        );
        assert_eq!(n0.source, "hwloc-xml");
        let n1 = p.drive_locality("/dev/nvme1n1", None);
        assert_eq!((n1.node, n1.cpuset.as_deref()), (Some(1), Some("4-7")));
        // By MAJ:MIN alone (a name hwloc does not have).
        let by_id = p.drive_locality("not-in-topology", Some((259, 1)));
        assert_eq!((by_id.node, by_id.cpuset.as_deref()), (Some(1), Some("4-7")));
        let by_id0 = p.drive_locality("not-in-topology", Some((259, 0)));
        assert_eq!(by_id0.node, Some(0));
        let unknown = p.drive_locality("sdz", Some((8, 240)));
        assert_eq!(unknown.node, None);
        assert!(unknown.note.unwrap().contains("no hwloc block device"));
        // The binding that would be made is reported, not applied.
        let b = bind_thread_described(&p, &n1);
        assert!(b.starts_with("would bind cpuset 4-7"), "{b}");
        assert!(bind_thread_described(&p, &p.drive_locality("sdz", None)).starts_with("not bound"));
        // Memory binding: a node the topology has is accepted, another refused.
        assert!(p.bind_area(&[0u8; 4096], 1).is_ok());
        assert!(p
            .bind_area(&[0u8; 4096], 5)
            .unwrap_err()
            .contains("not in the topology"));
    }

    #[test]
    fn xml_errors_are_errors_not_panics() {
        let e = Hwloc::from_xml_file(Path::new("/nonexistent/topo.xml"), HashMap::new()).unwrap_err();
        assert!(e.contains("/nonexistent/topo.xml"), "{e}");
        let dir = common::tempdir();
        let bad = dir.path().join("bad.xml");
        std::fs::write(&bad, "<topology version=\"2.0\"><object type=\"Bogus\"/></topology>").unwrap();
        assert!(Hwloc::from_xml_file(&bad, HashMap::new()).is_err());
    }

    /// The whole placement on the two-socket fixture: the primary's drive
    /// aliased to nvme0n1, the mirror's to nvme1n1. Each drive gets its
    /// node, its ring thread (or pread workers) the socket's cpuset, arenas
    /// their node, and adaptive reads prefer the copy local to the arena.
    #[test]
    fn engine_places_drives_threads_arenas_and_routes_locally() {
        let Some(fx) = mirrored(RoutePolicy::Adaptive) else {
            return;
        };
        let d = fx.model.drives();
        let aliases: HashMap<String, String> = [
            (d[0].device.clone(), "nvme0n1".to_string()),
            (d[1].device.clone(), "nvme1n1".to_string()),
        ]
        .into();
        let provider = Provider::new(xml(aliases));
        let spec = weightstream::SlotSpec::new(largest(&fx.model));
        for base in configs() {
            let backend = base.backend;
            let config = base.numa_provider(Some(provider.clone()));
            let engine = Engine::new(&fx.model, config.clone()).unwrap();
            let p = engine.placements();
            assert_eq!(p[0].locality.node, Some(0), "{:?}: {p:?}", backend);
            assert_eq!(p[1].locality.node, Some(1), "{p:?}");
            assert!(p[0].thread_binding.contains("cpuset 0-3"), "{p:?}");
            assert!(p[1].thread_binding.contains("cpuset 4-7"), "{p:?}");
            assert!(p[0].locality.note.as_deref().unwrap().contains("mapped to nvme0n1"));
            let v = serde_json::to_value(engine.stats()).unwrap();
            assert_eq!(v["drives"][0]["numa_node"], 0);
            assert_eq!(v["drives"][1]["numa_node"], 1);
            assert_eq!(v["drives"][1]["cpuset"], "4-7");
            assert!(v["drives"][1]["thread_binding"].as_str().unwrap().contains("4-7"));

            // A tensor's primary is on drive 0 (node 0): arena_near follows it.
            let t = &fx.model.catalog().tensors()[0];
            assert_eq!(engine.arena_near(t, spec, 1).unwrap().node(), Some(0));
            assert!(engine.arena_on(5, spec, 1).is_err(), "node 5 is not in the topology");

            // Into each node, on a fresh engine (equal throughput estimates,
            // nothing outstanding) with one chunk for the largest tensor's
            // O_DIRECT blocks: that chunk is the read's first pick, and goes
            // to the copy local to the arena. Only the tail past the last
            // whole block (under one block, picked after it, with the local
            // drive now loaded) may go to the other copy. Later reads follow
            // measured throughput, which depends on timing, so they are not
            // asserted; whatever they pick, the cross-node bytes are exactly
            // the other node's drive's.
            drop(engine);
            let big = fx.model.catalog().tensors().iter().max_by_key(|t| t.len).unwrap();
            let block = 4096;
            assert!(big.len > 4 * block, "the largest tensor spans several blocks");
            let one_chunk = config.clone().chunk(Some(big.len.next_multiple_of(1 << 20) as usize));
            for (node, other) in [(1usize, 0usize), (0, 1)] {
                let engine = Engine::new(&fx.model, one_chunk.clone()).unwrap();
                let arena = engine.arena_on(node, spec, 2).unwrap();
                assert_eq!(arena.node(), Some(node));
                let (bytes, cross) = read_one(&engine, &arena, big, fx.seed);
                let msg = format!("{backend:?}: into node {node}: {bytes:?}");
                assert!(bytes[node] + block >= big.len, "{msg}");
                assert!(bytes[other] < block, "{msg}");
                assert_eq!(cross, bytes[other], "{msg}");
                let (bytes, cross) = read_all(&engine, &arena, fx.seed);
                assert_eq!(cross, bytes[other], "cross-node bytes are the node-{other} drive's");
            }
            let engine = Engine::new(&fx.model, config).unwrap();

            // A plain arena has no node: no preference, nothing cross-node.
            let plain = engine.arena(spec, 2).unwrap();
            assert_eq!(plain.node(), None);
            let (_, cross) = read_all(&engine, &plain, fx.seed);
            assert_eq!(cross, 0);
        }
    }

    /// The real hwloc path on this machine: the topology loads, binding is
    /// real, and a drive hwloc attaches to the whole machine (a virtio disk
    /// in a VM) or cannot see (a tmpfs) is unknown, not node 0.
    #[test]
    fn live_hwloc_reports_virtual_and_missing_devices_as_unknown() {
        let p = Hwloc::live().expect("hwloc loads this machine's topology");
        assert!(p.binds_for_real());
        let dir = common::tempdir();
        common::synth_model(dir.path(), &common::small_synth_spec());
        let model = Model::open(ModelConfig::new(dir.path())).unwrap();
        let dev = model.drives()[0].device.clone();
        let l = p.drive_locality(&dev, None);
        eprintln!("live: {dev} -> {l:?}");
        match l.node {
            Some(_) => assert!(l.cpuset.is_some() && l.nodeset.is_some(), "{l:?}"),
            None => assert!(l.note.is_some(), "{l:?}"),
        }
        if dev.starts_with("vd") {
            assert_eq!(l.node, None, "a virtio disk has no NUMA locality: {l:?}");
            assert!(l.note.as_deref().unwrap().contains("whole machine"), "{l:?}");
        }
        let shm = p.drive_locality("tmpfs (0:99)", Some((0, 99)));
        assert_eq!(shm.node, None);
        // Binding to a known cpuset of this machine works for real.
        if let Some(cpus) = l.cpuset.as_ref().filter(|_| l.node.is_some()) {
            let b = bind_thread_described(&p, &l);
            assert_eq!(b, format!("cpuset {cpus}"));
        }
    }

    /// Live binding is real: a thread bound to CPU 0 runs only there (the
    /// kernel's own view, /proc/thread-self/status), and an arena bound to
    /// node 0 (which every Linux machine has) is made; a node the machine
    /// lacks is refused.
    #[test]
    fn live_binding_binds_the_thread_and_the_memory() {
        let p = Hwloc::live().unwrap();
        let allowed = || {
            std::fs::read_to_string("/proc/thread-self/status")
                .unwrap()
                .lines()
                .find_map(|l| l.strip_prefix("Cpus_allowed_list:").map(|v| v.trim().to_string()))
                .unwrap()
        };
        let l = weightstream::Locality {
            node: Some(0),
            cpuset: Some("0".into()),
            nodeset: Some("0".into()),
            source: "test",
            note: None,
        };
        let p2 = xml(HashMap::new());
        let (bound, after, xml_after) = std::thread::scope(|s| {
            s.spawn(|| {
                let before = allowed();
                let b = bind_thread_described(&p, &l);
                let after = allowed();
                // An XML provider changes nothing, even for a valid cpuset.
                let _ = bind_thread_described(&p2, &l);
                (b, after, (before, allowed()))
            })
            .join()
            .unwrap()
        });
        assert_eq!(bound, "cpuset 0");
        assert_eq!(after, "0");
        assert_eq!(xml_after.1, "0", "the XML provider did not rebind");
        let arena = weightstream::Arena::new_on_node(weightstream::SlotSpec::new(1 << 20), 2, 0, |a| p.bind_area(a, 0))
            .unwrap();
        assert_eq!(arena.node(), Some(0));
        let e = weightstream::Arena::new_on_node(weightstream::SlotSpec::new(4096), 1, 4095, |a| p.bind_area(a, 4095))
            .unwrap_err();
        assert!(e.to_string().contains("not in the topology"), "{e}");
    }

    /// WEIGHTSTREAM_NUMA_XML / WEIGHTSTREAM_NUMA_DEVICE_MAP reach the CLI:
    /// inspect shows each drive's node, cpuset and ring binding.
    #[test]
    fn inspect_shows_the_mapping_from_an_xml_topology() {
        let Some(fx) = mirrored(RoutePolicy::Adaptive) else {
            return;
        };
        let d = fx.model.drives();
        // Keyed by MAJ:MIN (a tmpfs has no block device name).
        let id = |dev: u64| format!("{}:{}", rustix::fs::major(dev), rustix::fs::minor(dev));
        let map = format!("{}=nvme0n1,{}=nvme1n1", id(d[0].dev), id(d[1].dev));
        let dir = fx.model.catalog().dir().to_path_buf();
        let mirror = fx._mirror.path().as_os_str().to_owned();
        let xml = fixture();
        let env: [(&str, &std::ffi::OsStr); 2] = [
            ("WEIGHTSTREAM_NUMA_XML", xml.as_os_str()),
            ("WEIGHTSTREAM_NUMA_DEVICE_MAP", map.as_ref()),
        ];
        let out = common::run_with_env(
            &[
                "inspect".as_ref(),
                dir.as_os_str(),
                "--mirror".as_ref(),
                &mirror,
                "--json".as_ref(),
            ],
            &env,
        );
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        let drives = v["drives"].as_array().unwrap();
        assert_eq!(drives[0]["numa_node"], 0, "{v}");
        assert_eq!(drives[1]["numa_node"], 1);
        assert_eq!(drives[1]["cpuset"], "4-7");
        assert!(drives[0]["thread_binding"].as_str().unwrap().contains("0-3"));
        let out = common::run_with_env(
            &["inspect".as_ref(), dir.as_os_str(), "--mirror".as_ref(), &mirror],
            &env,
        );
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(text.contains("NUMA node 1"), "{text}");
        assert!(text.contains("cpuset 4-7"), "{text}");
        // --numa off wins over the environment.
        let out = common::run_with_env(
            &[
                "inspect".as_ref(),
                dir.as_os_str(),
                "--mirror".as_ref(),
                &mirror,
                "--numa".as_ref(),
                "off".as_ref(),
            ],
            &env,
        );
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success());
        assert!(text.contains("single-node"), "{text}");
        assert!(!text.contains("NUMA node 1"), "{text}");
    }
}
