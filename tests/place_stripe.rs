//! A layer-striped placement reads faster than one drive (issue 13): the
//! same model (840 MB) placed `--layout layers` on one drive and on two
//! other drives (loop drives from `simdrives`, each capped at 200 MB/s for
//! reads), read the way a trainer streams it: one layer at a time, in
//! order, with read-ahead N + 1 layers (`layer_placement::readahead_default`). Two
//! drives must reach at least 1.8x one drive (median of 5 interleaved runs
//! each, after one unmeasured pass), with every byte verified.
//!
//! Slow (about a minute and a half) and root only: `#[ignore]`d; run it by
//! hand with `cargo test --release -p weightstream --test place_stripe --
//! --ignored --nocapture` (the figures are recorded in docs/benchmarks/*-placement).

mod common;

use std::collections::{BTreeMap, VecDeque};
use std::path::Path;
use std::time::Instant;

use weightstream::layer_placement as stripe;
use weightstream::place::{self, LayoutKind, PlaceConfig};
use weightstream::{Engine, EngineConfig, Model, ModelConfig};
use weightstream_synth::{self as synth, SynthSpec};

/// Streams every layer of the placed model at `primary` in order, `ahead`
/// layers in flight; returns (bytes, seconds), every tensor verified.
fn stream_layers(primary: &Path, seed: u64) -> (u64, f64) {
    let model = Model::open(ModelConfig::new(primary)).unwrap();
    let n_roots = model.drives().len();
    let engine = Engine::new(&model, EngineConfig::default()).unwrap();
    let mut by_layer: BTreeMap<usize, Vec<_>> = BTreeMap::new();
    for t in model.catalog().tensors() {
        if let Some(l) = stripe::layer_of(&t.name) {
            by_layer.entry(l).or_default().push(t);
        }
    }
    let ahead = stripe::readahead_default(n_roots);
    let per_layer = by_layer.values().map(Vec::len).max().unwrap();
    let arena = engine
        .arena(model.slot_spec_for_largest("").unwrap(), ahead * per_layer)
        .unwrap();
    let order: Vec<_> = by_layer.values().flatten().collect();
    let mut pending = VecDeque::new();
    let (mut bytes, mut bad) = (0u64, 0usize);
    let t0 = Instant::now();
    let mut check = |name: &String, ticket: weightstream::Ticket| {
        let loaded = ticket.wait().unwrap();
        bytes += loaded.len() as u64;
        bad += usize::from(!synth::verify(seed, name, &loaded));
    };
    for t in order {
        let slot = loop {
            if let Ok(s) = arena.take() {
                break s;
            }
            let (name, ticket) = pending.pop_front().expect("a read is pending");
            check(name, ticket);
        };
        pending.push_back((&t.name, engine.read(t, slot).unwrap()));
    }
    for (name, ticket) in pending {
        check(name, ticket);
    }
    let secs = t0.elapsed().as_secs_f64();
    assert_eq!(bad, 0, "every byte verified");
    (bytes, secs)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

#[test]
#[ignore = "slow, root only: run by hand (cargo test --release -p weightstream --test place_stripe -- --ignored --nocapture)"]
fn layers_on_two_capped_drives_stream_at_least_1_8x_one_drive() {
    let Some(sim) = common::SimDrives::up(3, "loop", "200") else {
        return;
    };
    let tmp = common::tempdir();
    let src = tmp.path().join("model");
    let spec = SynthSpec {
        layers: 14,
        experts: 4,
        expert_bytes: 5_000_000,
        shards: 4,
        seed: 21,
        ..SynthSpec::default()
    };
    common::synth_model(&src, &spec);
    let one_root = sim.mounts[2].join("one");
    let two = [sim.mounts[0].join("two"), sim.mounts[1].join("two")];
    for d in two.iter().chain([&one_root]) {
        std::fs::create_dir_all(d).unwrap();
    }
    let one = place::place(&PlaceConfig::new(&src, [one_root], LayoutKind::Layers)).unwrap();
    let striped = place::place(&PlaceConfig::new(&src, two.clone(), LayoutKind::Layers)).unwrap();
    eprintln!(
        "placed {:.3} GB: one drive {:.3} GB/s written, two drives {:.3} GB/s written; page cache {:+.1} / {:+.1} MB",
        one.bytes_written as f64 / 1e9,
        one.write_gbps,
        striped.write_gbps,
        one.cache_growth_bytes as f64 / 1e6,
        striped.cache_growth_bytes as f64 / 1e6
    );
    // One pass each unmeasured (threads, rings, first touch), then five
    // interleaved.
    stream_layers(&one.primary, spec.seed);
    stream_layers(&striped.primary, spec.seed);
    let (mut a, mut b) = (Vec::new(), Vec::new());
    for run in 0..5 {
        let (bytes, s1) = stream_layers(&one.primary, spec.seed);
        let (_, s2) = stream_layers(&striped.primary, spec.seed);
        let (g1, g2) = (bytes as f64 / 1e9 / s1, bytes as f64 / 1e9 / s2);
        eprintln!(
            "run {run}: one drive {g1:.3} GB/s, two drives {g2:.3} GB/s ({:.2}x)",
            g2 / g1
        );
        a.push(g1);
        b.push(g2);
    }
    let (g1, g2) = (median(a), median(b));
    eprintln!(
        "median: one drive {g1:.3} GB/s, layers on two drives {g2:.3} GB/s: {:.2}x",
        g2 / g1
    );
    assert!(
        g2 / g1 >= 1.8,
        "two drives {g2:.3} GB/s vs one {g1:.3} GB/s: {:.2}x < 1.8x",
        g2 / g1
    );
    drop(sim);
}
