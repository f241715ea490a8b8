//! A failed replica is not a failed read (DESIGN contract 6), at the library
//! level, on both engine backends:
//!
//! - the mirror copy of a shard truncated to half *after* the model and
//!   engine opened it: every read still returns the right bytes (checked
//!   against the generator), the mirror's drive counts failovers, and with
//!   `stripe` / `adaptive` over 4096-byte chunks the truncated part is
//!   certainly hit; then the primary copy truncated too: the reads that need
//!   the lost bytes fail with `ReadFailed` naming both copies, the
//!   others still succeed, and no read returns wrong bytes;
//! - the primary truncated, the mirror intact, `hash` routing: the reads
//!   hashed to the primary move to the mirror;
//! - a mirror copy replaced after open (a different file renamed over its
//!   path): reads still return the original bytes (the engine holds the
//!   inode it opened and proved);
//! - `hash` is deterministic: the same tensor goes to the same drive in two
//!   independently opened models and engines (per-drive byte deltas), the
//!   drive the field's multiplicative hash of the flat expert index picks;
//!   `read_keyed` routes by the key it is given.
//!
//! The second drive is `/dev/shm`; without it the tests print SKIP and pass.

mod common;

use std::path::{Path, PathBuf};

use weightstream::__internal as route;
use weightstream::{BackendChoice, Engine, EngineConfig, Error, Model, ModelConfig, RoutePolicy, TensorRef};
use weightstream_synth::{self as synth, SynthSpec};

struct Fixture {
    _tmp: tempfile::TempDir,
    shm: tempfile::TempDir,
    primary: PathBuf,
    spec: SynthSpec,
}

fn fixture() -> Option<Fixture> {
    let shm = common::second_drive_tempdir()?;
    let tmp = common::tempdir();
    let primary = tmp.path().join("primary");
    let spec = common::small_synth_spec();
    common::synth_model(&primary, &spec);
    Some(Fixture {
        _tmp: tmp,
        shm,
        primary,
        spec,
    })
}

impl Fixture {
    /// A full mirror on the second drive, in a fresh directory.
    fn mirror(&self, name: &str) -> PathBuf {
        let m = self.shm.path().join(name);
        let names = common::shard_names(&self.primary);
        let names: Vec<&str> = names.iter().map(String::as_str).collect();
        common::copy_files(&self.primary, &m, &names);
        m
    }
}

fn backends() -> Vec<(&'static str, BackendChoice)> {
    common::engine_backends()
        .into_iter()
        .map(|b| {
            (
                b,
                if b == "uring" {
                    BackendChoice::Uring
                } else {
                    BackendChoice::Pread
                },
            )
        })
        .collect()
}

fn open(primary: &Path, mirror: &Path, route: RoutePolicy, backend: BackendChoice) -> (Model, Engine) {
    let model = Model::open(ModelConfig::new(primary).mirrors([mirror]).route(route)).expect("open model");
    let engine = Engine::new(&model, EngineConfig::default().backend(backend).chunk(Some(4096))).expect("start engine");
    (model, engine)
}

fn drive_of(model: &Model, dir: &Path) -> usize {
    let dev = common::st_dev(dir);
    model
        .drives()
        .iter()
        .position(|d| d.dev == dev)
        .unwrap_or_else(|| panic!("no drive for {}", dir.display()))
}

fn truncate_half(path: &Path) -> u64 {
    let f = std::fs::OpenOptions::new().write(true).open(path).unwrap();
    let half = f.metadata().unwrap().len() / 2;
    f.set_len(half).unwrap();
    half
}

/// Reads every tensor; returns per tensor Ok(()) when the bytes are the
/// generator's, or the error. Wrong bytes are a panic.
fn read_all(engine: &Engine, model: &Model, seed: u64, what: &str) -> Vec<(TensorRef, Result<(), Error>)> {
    let arena = engine.arena(model.slot_spec_for_largest("").unwrap(), 4).unwrap();
    let tensors: Vec<TensorRef> = model.catalog().tensors().to_vec();
    let mut out = Vec::new();
    // Up to 4 reads in flight.
    let mut pending = std::collections::VecDeque::new();
    let mut next = tensors.into_iter();
    loop {
        while let Ok(slot) = arena.take() {
            let Some(t) = next.next() else {
                drop(slot);
                break;
            };
            let ticket = engine.read(&t, slot).expect("read accepted");
            pending.push_back((t, ticket));
        }
        let Some((t, ticket)) = pending.pop_front() else { break };
        match ticket.wait() {
            Ok(loaded) => {
                assert_eq!(loaded.len() as u64, t.len, "{what}: {}", t.name);
                assert!(
                    synth::verify(seed, &t.name, &loaded),
                    "{what}: {} returned wrong bytes",
                    t.name
                );
                arena.give_back(loaded.into_slot());
                out.push((t, Ok(())));
            }
            Err(e) => out.push((t, Err(e))),
        }
    }
    out
}

#[test]
fn a_truncated_mirror_fails_over_then_both_truncated_fail_naming_both() {
    let Some(fx) = fixture() else { return };
    let shard_name = fx.spec.shard_name(1);
    for (backend, choice) in backends() {
        for route in [RoutePolicy::Stripe, RoutePolicy::Adaptive] {
            let what = format!("{backend} {}", route.name());
            let m = fx.mirror(&format!("mirror-{backend}-{}", route.name()));
            let (model, engine) = open(&fx.primary, &m, route, choice);
            let si = model
                .catalog()
                .shards()
                .iter()
                .position(|s| s.name == shard_name.as_str())
                .unwrap();
            assert_eq!(model.copies(si).len(), 2);
            let (pd, md) = (drive_of(&model, &fx.primary), drive_of(&model, &m));
            assert_ne!(pd, md);

            // The mirror copy loses its second half after it was opened and proven.
            let half = truncate_half(&m.join(&shard_name));
            let past: Vec<&TensorRef> = model
                .catalog()
                .tensors()
                .iter()
                .filter(|t| t.shard == si && t.offset + t.len > half)
                .collect();
            assert!(
                past.iter().any(|t| t.len > 8 * 4096),
                "{what}: nothing big past the cut"
            );
            let before = engine.stats();
            let results = read_all(&engine, &model, fx.spec.seed, &what);
            for (t, r) in &results {
                if let Err(e) = r {
                    panic!("{what}: {} failed with a whole primary copy: {e}", t.name);
                }
            }
            let st = engine.stats();
            let total: u64 = model.catalog().total_bytes();
            // Exact only once short-read prefixes are counted: see
            // `bytes_count_the_prefix_of_a_short_read`.
            assert!(st.bytes - before.bytes <= total, "{what}");
            assert!(
                st.drives[md].failovers > 0,
                "{what}: the truncated mirror was never hit: {:#?}",
                st.drives
            );
            assert_eq!(st.drives[pd].failovers, 0, "{what}");
            assert!(st.drives[md].bytes > 0, "{what}: the mirror served nothing");

            // Now the primary copy loses its second half too.
            truncate_half(&fx.primary.join(&shard_name));
            let results = read_all(&engine, &model, fx.spec.seed, &what);
            let (p_path, m_path) = (fx.primary.join(&shard_name), m.join(&shard_name));
            let mut failed = 0;
            for (t, r) in &results {
                let lost = t.shard == si && t.offset + t.len > half;
                match (lost, r) {
                    (false, Ok(())) => {}
                    (false, Err(e)) => panic!("{what}: {} needs no lost byte but failed: {e}", t.name),
                    (true, Ok(())) => panic!("{what}: {} read bytes no copy holds", t.name),
                    (true, Err(e)) => {
                        failed += 1;
                        assert!(
                            matches!(e, Error::ReadFailed { copies: 2, .. }),
                            "{what}: {}: {e:?}",
                            t.name
                        );
                        let msg = e.to_string();
                        for p in [&p_path, &m_path] {
                            assert!(
                                msg.contains(p.to_str().unwrap()),
                                "{what}: {}: error does not name {}: {msg}",
                                t.name,
                                p.display()
                            );
                        }
                        assert!(msg.contains("end of file"), "{what}: {msg}");
                    }
                }
            }
            assert_eq!(failed, past.len(), "{what}");
            // Put the primary back for the next round.
            drop(engine);
            drop(model);
            std::fs::remove_dir_all(&fx.primary).unwrap();
            common::synth_model(&fx.primary, &fx.spec);
        }
    }
}

#[test]
fn a_truncated_primary_fails_over_to_the_mirror_under_hash() {
    let Some(fx) = fixture() else { return };
    for (backend, choice) in backends() {
        // A fresh primary, and its mirror copied from it (a regenerated
        // model's headers need not be byte-identical).
        let tmp = common::tempdir();
        let primary = tmp.path().join("primary");
        common::synth_model(&primary, &fx.spec);
        let m = fx.shm.path().join(format!("mirror-{backend}"));
        let names = common::shard_names(&primary);
        common::copy_files(&primary, &m, &names.iter().map(String::as_str).collect::<Vec<_>>());
        let (model, engine) = open(&primary, &m, RoutePolicy::Hash, choice);
        let (pd, md) = (drive_of(&model, &primary), drive_of(&model, &m));
        // Every primary copy loses its second half.
        for n in common::shard_names(&primary) {
            truncate_half(&primary.join(n));
        }
        let results = read_all(&engine, &model, fx.spec.seed, backend);
        for (t, r) in &results {
            if let Err(e) = r {
                panic!("{backend}: {} failed with a whole mirror copy: {e}", t.name);
            }
        }
        let st = engine.stats();
        assert!(st.drives[pd].failovers > 0, "{backend}: {:#?}", st.drives);
        assert_eq!(st.drives[md].failovers, 0, "{backend}");
        assert!(
            st.drives[md].bytes > 0 && st.drives[pd].bytes > 0,
            "{backend}: {:#?}",
            st.drives
        );
    }
}

#[test]
fn a_mirror_replaced_after_open_still_reads_the_opened_copy() {
    let Some(fx) = fixture() else { return };
    // Another model of the same shape, other content.
    let other_spec = SynthSpec {
        seed: fx.spec.seed ^ 0xdead,
        ..fx.spec.clone()
    };
    for (backend, choice) in backends() {
        let m = fx.mirror(&format!("mirror-{backend}"));
        let (model, engine) = open(&fx.primary, &m, RoutePolicy::Stripe, choice);
        let other = fx.shm.path().join(format!("other-{backend}"));
        synth::write_model(&other, &other_spec).unwrap();
        for n in common::shard_names(&other) {
            std::fs::rename(other.join(&n), m.join(&n)).unwrap();
        }
        // The path now holds other bytes; a reopen-by-path would read them.
        let t0 = &model.catalog().tensors()[model.catalog().tensors().len() / 2];
        let now = std::fs::read(m.join(&model.catalog().shards()[t0.shard].name)).unwrap();
        assert!(
            !synth::verify(
                fx.spec.seed,
                &t0.name,
                &now[t0.offset as usize..(t0.offset + t0.len) as usize]
            ),
            "the replacement did not change the bytes"
        );
        let md = drive_of(&model, &m);
        let results = read_all(&engine, &model, fx.spec.seed, backend);
        for (t, r) in &results {
            if let Err(e) = r {
                panic!("{backend}: {}: {e}", t.name);
            }
        }
        let st = engine.stats();
        assert!(st.drives[md].bytes > 0, "{backend}: the mirror was not read");
        assert_eq!(st.drives.iter().map(|d| d.failovers).sum::<u64>(), 0, "{backend}");
    }
}

/// The stats count every payload byte once, also when a chunk lands in
/// two pieces: a short read on a truncated copy (its prefix landed), the
/// remainder failed over to the other copy.
#[test]
fn bytes_count_the_prefix_of_a_short_read() {
    let Some(fx) = fixture() else { return };
    for (backend, choice) in backends() {
        let m = fx.mirror(&format!("mirror-{backend}"));
        let (model, engine) = open(&fx.primary, &m, RoutePolicy::Hash, choice);
        let md = drive_of(&model, &m);
        let t = model.catalog().tensors().iter().max_by_key(|t| t.len).unwrap().clone();
        // Cut the mirror copy 1000 bytes into a 4096-byte block of the tensor,
        // and send the whole read there.
        let cut = ((t.offset + t.len / 2) & !4095) + 1000;
        let name = &model.catalog().shards()[t.shard].name;
        let f = std::fs::OpenOptions::new().write(true).open(m.join(name)).unwrap();
        f.set_len(cut).unwrap();
        let to_mirror = (0..)
            .find(|&k| route::hash_pick(k, &route::cuts(model.rank_weights())) == 1)
            .unwrap();
        let arena = engine.arena(model.slot_spec_for_largest("").unwrap(), 1).unwrap();
        let before = engine.stats();
        let loaded = engine
            .read_keyed(&t, arena.take().unwrap(), to_mirror)
            .unwrap()
            .wait()
            .unwrap();
        assert!(synth::verify(fx.spec.seed, &t.name, &loaded), "{backend}");
        let st = engine.stats();
        assert!(st.drives[md].failovers > 0, "{backend}: no failover");
        assert_eq!(st.bytes - before.bytes, t.len, "{backend}: {:#?}", st.drives);
    }
}

/// Bytes per drive right now.
fn bytes(engine: &Engine) -> Vec<u64> {
    engine.stats().drives.iter().map(|d| d.bytes).collect()
}

/// Reads `t` (with `key` when given) and returns the index of the one drive
/// whose byte count grew, by exactly the payload.
fn drive_that_served(engine: &Engine, t: &TensorRef, key: Option<u64>, seed: u64) -> usize {
    let arena = engine
        .arena(engine.model().slot_spec_for_largest("").unwrap(), 1)
        .unwrap();
    let before = bytes(engine);
    let slot = arena.take().unwrap();
    let ticket = match key {
        Some(k) => engine.read_keyed(t, slot, k),
        None => engine.read(t, slot),
    }
    .unwrap();
    let loaded = ticket.wait().unwrap();
    assert!(synth::verify(seed, &t.name, &loaded), "{}", t.name);
    let after = bytes(engine);
    let grew: Vec<(usize, u64)> = after
        .iter()
        .zip(&before)
        .enumerate()
        .filter(|(_, (a, b))| a != b)
        .map(|(i, (a, b))| (i, a - b))
        .collect();
    assert_eq!(grew.len(), 1, "{}: {grew:?}: one read, one drive", t.name);
    assert_eq!(grew[0].1, t.len, "{}", t.name);
    grew[0].0
}

#[test]
fn hash_routing_is_deterministic_across_engines() {
    let Some(fx) = fixture() else { return };
    let m = fx.mirror("mirror");
    let b = backends();
    // Two independently opened models and engines (both backends when io_uring is open).
    let (m1, e1) = open(&fx.primary, &m, RoutePolicy::Hash, b[0].1);
    let (m2, e2) = open(&fx.primary, &m, RoutePolicy::Hash, b[b.len() - 1].1);
    let dev = |model: &Model, i: usize| model.drives()[i].dev;
    let cuts = route::cuts(m1.rank_weights());
    assert_eq!(cuts, [128, 256]);
    // The group key is the flat expert index, layer * experts + expert.
    let t = m1.tensor("model.layers.2.mlp.experts.1.up_proj.weight").unwrap();
    assert_eq!(m1.group_key(t), 2 * fx.spec.experts as u64 + 1);
    let mut used = std::collections::BTreeSet::new();
    for t in m1.catalog().tensors().iter().filter(|t| t.len > 0) {
        let d1 = drive_that_served(&e1, t, None, fx.spec.seed);
        let t2 = m2.tensor(&t.name).unwrap();
        let d2 = drive_that_served(&e2, t2, None, fx.spec.seed);
        assert_eq!(dev(&m1, d1), dev(&m2, d2), "{}: two engines, two drives", t.name);
        // Again on the first engine: still the same.
        assert_eq!(drive_that_served(&e1, t, None, fx.spec.seed), d1, "{}", t.name);
        let want = m1.files()[m1.copies(t.shard)[route::hash_pick(m1.group_key(t), &cuts)]].drive;
        assert_eq!(d1, want, "{}: not the hashed copy's drive", t.name);
        used.insert(dev(&m1, d1));
    }
    assert_eq!(used.len(), 2, "hash sent every tensor to one drive");
    // read_keyed routes by the key given.
    let k0 = (0..).find(|&k| route::hash_pick(k, &cuts) == 0).unwrap();
    let k1 = (0..).find(|&k| route::hash_pick(k, &cuts) == 1).unwrap();
    let big = m1.catalog().tensors().iter().max_by_key(|t| t.len).unwrap();
    let (pd, md) = (drive_of(&m1, &fx.primary), drive_of(&m1, &m));
    for (e, model) in [(&e1, &m1), (&e2, &m2)] {
        let t = model.tensor(&big.name).unwrap();
        assert_eq!(drive_that_served(e, t, Some(k0), fx.spec.seed), pd);
        assert_eq!(drive_that_served(e, t, Some(k1), fx.spec.seed), md);
    }
}
