//! The expert cache: the bytes of every expert fetched equal the synthetic
//! model's (the reference reader's are checked against the same generator
//! in tests/reference.rs); hits equal an LRU simulation of the same trace;
//! a pinned entry is never evicted nor overwritten while many threads get
//! and prefetch; prefetch never waits for room; a failed read caches
//! nothing; a handle outlives its cache.

mod common;

use std::sync::Arc;

use proptest::prelude::*;
use weightstream::__internal::Fault;
use weightstream::{
    simulate_lru, BackendChoice, CacheConfig, CacheError, Capacity, EngineConfig, Error, ExpertCache, ExpertHandle,
    Model, ModelConfig, Policy,
};
use weightstream_synth::{self as synth, SynthSpec};

fn spec(seed: u64) -> SynthSpec {
    SynthSpec {
        layers: 3,
        experts: 8,
        expert_bytes: 40_000,
        shards: 2,
        seed,
        ..SynthSpec::default()
    }
}

fn model(seed: u64) -> (tempfile::TempDir, Model, SynthSpec) {
    let tmp = common::tempdir();
    let s = spec(seed);
    common::synth_model(tmp.path(), &s);
    let m = Model::open(ModelConfig::new(tmp.path())).unwrap();
    (tmp, m, s)
}

fn check(h: &ExpertHandle, seed: u64) {
    assert!(h.part_count() > 0);
    for (proj, part, l) in h.parts() {
        let want = format!("model.layers.{}.mlp.experts.{}.{proj}.{part}", h.layer(), h.expert());
        assert_eq!(l.name(), want);
        assert!(synth::verify(seed, l.name(), l), "{}: wrong bytes", l.name());
    }
}

/// A decode-like trace: per step, per layer, `k` experts from a skewed
/// (roughly Zipf) distribution, from `seed`.
fn trace(seed: u64, steps: usize, layers: usize, experts: usize, k: usize) -> Vec<(usize, usize)> {
    let mut x = seed | 1;
    let mut next = move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    let mut out = Vec::new();
    for _ in 0..steps {
        for l in 0..layers {
            let mut chosen = Vec::new();
            while chosen.len() < k {
                // Zipf-ish: expert i with weight 1/(i+1).
                let u = (next() % 1_000_000) as f64 / 1e6;
                let e = ((experts as f64 + 1.0).powf(u) - 1.0) as usize % experts;
                if !chosen.contains(&e) {
                    chosen.push(e);
                }
            }
            out.extend(chosen.into_iter().map(|e| (l, e)));
        }
    }
    out
}

#[test]
fn every_expert_fetched_has_the_models_bytes() {
    let (_tmp, model, s) = model(7);
    let cache = ExpertCache::new(&model, CacheConfig::new(Capacity::Experts(5))).unwrap();
    assert_eq!(cache.capacity(), 5);
    for (l, e) in trace(3, 20, s.layers, s.experts, 2) {
        let h = cache.get(l, e).unwrap();
        check(&h, s.seed);
    }
    let many = cache.get_many(1, &[0, 3, 5, 3]).unwrap();
    assert_eq!(many.iter().map(|h| h.expert()).collect::<Vec<_>>(), [0, 3, 5, 3]);
    many.iter().for_each(|h| check(h, s.seed));
    let st = cache.stats();
    assert_eq!(st.failed_reads, 0);
    assert!(st.bytes_read > 0 && st.bytes_read_per_drive.iter().map(|d| d.1).sum::<u64>() >= st.bytes_read);
    // Unknown experts are errors, and nothing is counted for them.
    assert!(matches!(cache.get(0, 99), Err(Error::Experts(_))));
    assert!(matches!(cache.get(9, 0), Err(Error::Experts(_))));
    assert_eq!(cache.stats().misses, st.misses);
}

#[test]
fn a_budget_in_bytes_holds_whole_experts_and_too_small_a_budget_is_refused() {
    let (_tmp, model, _) = model(8);
    let one = ExpertCache::new(&model, CacheConfig::new(Capacity::Experts(1))).unwrap();
    let per = one.entry_bytes();
    let c = ExpertCache::new(&model, CacheConfig::new(Capacity::Bytes(3 * per + per / 2))).unwrap();
    assert_eq!(c.capacity(), 3);
    let e = ExpertCache::new(&model, CacheConfig::new(Capacity::Bytes(per - 1))).unwrap_err();
    assert!(matches!(e, Error::Cache(CacheError::Config(_))), "{e}");
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 12, ..ProptestConfig::default() })]
    /// With nothing pinned and no prefetch, the hits equal an LRU
    /// simulation of the trace, exactly.
    #[test]
    fn hits_equal_an_lru_simulation(seed in 1u64..u64::MAX, cap in 1usize..12, k in 1usize..4) {
        let (_tmp, model, s) = model(seed % 1000);
        let cache = ExpertCache::new(&model, CacheConfig::new(Capacity::Experts(cap))).unwrap();
        let t = trace(seed, 15, s.layers, s.experts, k);
        for &(l, e) in &t {
            drop(cache.get(l, e).unwrap());
        }
        let st = cache.stats();
        let want = simulate_lru(&t, cap);
        prop_assert_eq!(st.hits, want);
        prop_assert_eq!(st.misses, t.len() as u64 - want);
        prop_assert!(st.entries <= cap);
    }
}

#[test]
fn lfu_keeps_a_hot_expert_that_lru_would_evict() {
    let (_tmp, model, _) = model(9);
    let lfu = ExpertCache::new(&model, CacheConfig::new(Capacity::Experts(2)).policy(Policy::LfuAging)).unwrap();
    for _ in 0..3 {
        drop(lfu.get(0, 0).unwrap());
    }
    drop(lfu.get(0, 1).unwrap());
    drop(lfu.get(0, 2).unwrap()); // evicts (0,1), the colder one
    drop(lfu.get(0, 0).unwrap()); // still there
    assert_eq!(lfu.stats().hits, 3);
}

/// Many threads get, hold, re-check and prefetch at once over a cache
/// smaller than their working set: every handle's bytes stay the expert's
/// own for as long as it lives (a pinned entry evicted and its slots
/// reused would show another expert's bytes), and every refusal is
/// `Full`, never a wait.
#[test]
fn pinned_entries_are_never_evicted_under_many_threads() {
    let (_tmp, model, s) = model(10);
    let cache = Arc::new(ExpertCache::new(&model, CacheConfig::new(Capacity::Experts(6))).unwrap());
    let threads: Vec<_> = (0..6u64)
        .map(|t| {
            let cache = Arc::clone(&cache);
            let (layers, experts, seed) = (s.layers, s.experts, s.seed);
            std::thread::spawn(move || {
                let mut held: Vec<ExpertHandle> = Vec::new();
                let mut full = 0;
                for (i, (l, e)) in trace(t + 100, 40, layers, experts, 1).into_iter().enumerate() {
                    if i % 5 == 0 {
                        let r = cache
                            .prefetch(&[(l, (e + 1) % experts), (l, (e + 2) % experts)])
                            .unwrap();
                        assert_eq!(r.started + r.present + r.refused, 2);
                    }
                    match cache.get(l, e) {
                        Ok(h) => {
                            check(&h, seed);
                            held.push(h);
                        }
                        Err(Error::Cache(CacheError::Full { .. })) => full += 1,
                        Err(e) => panic!("{e}"),
                    }
                    // Hold up to one, re-checked when let go.
                    while held.len() > 1 {
                        let h = held.remove(0);
                        check(&h, seed);
                    }
                }
                held.iter().for_each(|h| check(h, seed));
                full
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    let st = cache.stats();
    assert_eq!(st.pinned, 0);
    assert!(st.entries <= 6);
    assert_eq!(st.failed_reads, 0);
}

/// Concurrent gets of one absent expert start one read and all wait for it.
#[test]
fn concurrent_gets_of_one_expert_share_one_read() {
    let (_tmp, model, s) = model(11);
    let cache = Arc::new(ExpertCache::new(&model, CacheConfig::new(Capacity::Experts(4))).unwrap());
    let barrier = Arc::new(std::sync::Barrier::new(8));
    let hs: Vec<_> = (0..8)
        .map(|_| {
            let (cache, barrier) = (Arc::clone(&cache), Arc::clone(&barrier));
            std::thread::spawn(move || {
                barrier.wait();
                cache.get(2, 5).unwrap()
            })
        })
        .collect();
    let got: Vec<ExpertHandle> = hs.into_iter().map(|h| h.join().unwrap()).collect();
    got.iter().for_each(|h| check(h, s.seed));
    let st = cache.stats();
    assert_eq!((st.misses, st.hits), (1, 7));
    assert_eq!(st.pinned, 1);
    assert_eq!(st.bytes_read, got[0].bytes());
}

/// With every entry pinned, a prefetch refuses at once (a prefetch that
/// waited for room would wait forever here: this thread holds the pins),
/// and a get says `Full`.
#[test]
fn prefetch_never_waits_for_room() {
    let (_tmp, model, _) = model(12);
    let cache = ExpertCache::new(&model, CacheConfig::new(Capacity::Experts(2))).unwrap();
    let a = cache.get(0, 0).unwrap();
    let b = cache.get(0, 1).unwrap();
    let r = cache.prefetch(&[(0, 0), (0, 2), (0, 3)]).unwrap();
    assert_eq!((r.started, r.present, r.refused), (0, 1, 2));
    let e = cache.get(0, 4).unwrap_err();
    assert!(matches!(e, Error::Cache(CacheError::Full { pinned: 2, .. })), "{e}");
    drop(a);
    // Room again: the unpinned entry goes.
    let r = cache.prefetch(&[(0, 2)]).unwrap();
    assert_eq!(r.started, 1);
    let c = cache.get(0, 2).unwrap();
    let st = cache.stats();
    assert_eq!((st.prefetched, st.prefetch_used, st.prefetch_refused), (1, 1, 2));
    assert_eq!(st.evictions, 1);
    drop((b, c));
    // A prefetched entry evicted unused is counted as waste, with its bytes.
    cache.prefetch(&[(1, 0)]).unwrap();
    cache.wait_idle().unwrap(); // landed: evictable when its turn comes
    drop(cache.get(1, 1).unwrap());
    drop(cache.get(1, 2).unwrap());
    let st = cache.stats();
    assert_eq!(st.prefetch_wasted, 1);
    assert!(st.prefetch_wasted_bytes > 0);
}

/// A read that fails caches nothing: the get says why, the entry is not
/// there, the next get reads again (and fails again: the injected fault
/// breaks the drive's ring for good); an entry cached before stays good.
#[test]
fn a_failed_read_caches_nothing() {
    if !common::uring_available() {
        return;
    }
    let (_tmp, model, s) = model(13);
    let config = CacheConfig::new(Capacity::Experts(3)).engine(EngineConfig::default().backend(BackendChoice::Uring));
    let cache = ExpertCache::new(&model, config).unwrap();
    let before = cache.get(0, 2).unwrap();
    cache.engine().inject_fault(0, Fault::EnterFails(libc::EIO));
    let e = cache.get(1, 1).unwrap_err();
    assert!(matches!(e, Error::Cache(CacheError::ReadFailed { .. })), "{e}");
    assert!(e.to_string().contains("layer 1 expert 1"), "{e}");
    let st = cache.stats();
    assert_eq!((st.failed_reads, st.entries, st.misses), (1, 1, 2));
    let again = cache.get(1, 1).unwrap_err();
    assert!(matches!(again, Error::Cache(CacheError::ReadFailed { .. })), "{again}");
    let st = cache.stats();
    assert_eq!((st.failed_reads, st.entries, st.misses, st.hits), (2, 1, 3, 0));
    check(&before, s.seed);
    drop(before);
    // The entry cached before the fault is still a hit.
    check(&cache.get(0, 2).unwrap(), s.seed);
    assert_eq!(cache.stats().hits, 1);
}

/// A handle keeps its memory after the cache (and its engine) is gone.
#[test]
fn a_handle_outlives_its_cache() {
    let (_tmp, model, s) = model(14);
    let cache = ExpertCache::new(&model, CacheConfig::new(Capacity::Experts(2))).unwrap();
    let h = cache.get(2, 7).unwrap();
    cache.prefetch(&[(2, 6)]).unwrap(); // in flight or landed at the drop
    drop(cache);
    check(&h, s.seed);
    let again = h.clone();
    drop(h);
    check(&again, s.seed);
}

/// A refused `get_many` (every entry pinned or in flight) counts no hit
/// and no miss, takes no prefetch's use and leaves the eviction order
/// alone, however often it is repeated; a read such a call had started
/// goes on as a prefetch. (Each refused call used to count the present
/// experts as hits and move them to the front of the LRU order.)
#[test]
fn a_refused_get_many_counts_nothing_and_reorders_nothing() {
    let (_tmp, model, s) = model(15);
    let cache = ExpertCache::new(&model, CacheConfig::new(Capacity::Experts(3))).unwrap();
    let h1 = cache.get(0, 1).unwrap();
    let h0 = cache.get(0, 0).unwrap();
    let before = cache.stats();
    for _ in 0..50 {
        // (0, 1) present, (0, 2) a miss that fits (the first time; then
        // present), (0, 3) a miss with no room left: refused.
        let e = cache.get_many(0, &[1, 2, 3]).unwrap_err();
        assert!(matches!(e, Error::Cache(CacheError::Full { .. })), "{e}");
    }
    let after = cache.stats();
    assert_eq!(
        (after.hits, after.misses, after.prefetch_used),
        (before.hits, before.misses, before.prefetch_used),
        "refused calls counted gets: {before:?} -> {after:?}"
    );
    assert_eq!(
        after.prefetched,
        before.prefetched + 1,
        "(0, 2) went on as a prefetch: {after:?}"
    );
    cache.wait_idle().unwrap();
    drop((h1, h0));
    // The order is (0, 1), (0, 0), (0, 2), oldest first, as before the
    // refused calls: a new expert evicts (0, 1).
    drop(cache.get(0, 5).unwrap());
    check(&cache.get(0, 0).unwrap(), s.seed);
    check(&cache.get(0, 2).unwrap(), s.seed);
    let st = cache.stats();
    assert_eq!(st.evictions, 1, "{st:?}");
    assert_eq!(
        (st.hits, st.misses, st.prefetch_used),
        (before.hits + 2, before.misses + 1, 1),
        "(0, 0) and the prefetched (0, 2) are hits: {st:?}"
    );
}

/// A capacity above the model's routed experts maps only what they take:
/// the stats say what was asked and what is held.
#[test]
fn a_capacity_above_the_routed_experts_is_clamped_and_said() {
    let (_tmp, model, s) = model(16);
    let routed = s.layers * s.experts;
    let cache = ExpertCache::new(&model, CacheConfig::new(Capacity::Experts(100_000))).unwrap();
    assert_eq!(cache.capacity(), routed);
    let st = cache.stats();
    assert_eq!((st.capacity, st.capacity_asked), (routed, 100_000));
    // Every expert fits at once, and a byte budget is clamped the same way.
    let all: Vec<ExpertHandle> = (0..s.layers)
        .flat_map(|l| (0..s.experts).map(move |e| (l, e)))
        .map(|(l, e)| cache.get(l, e).unwrap())
        .collect();
    all.iter().for_each(|h| check(h, s.seed));
    let by_bytes = ExpertCache::new(&model, CacheConfig::new(Capacity::Bytes(1 << 40))).unwrap();
    assert_eq!(by_bytes.capacity(), routed);
    assert!(by_bytes.stats().capacity_asked > routed);
}

/// An expert whose first part fails while another part is still in the
/// kernel (held on a second drive): the get fails at once, and until that
/// part lands the cache says `Full` with it counted in flight, never
/// "full" with nothing pinned or in flight; once it lands the slots are
/// back. (The other part's ticket used to be dropped while in flight: its
/// slot was held by nothing the cache could see, and every get said full.)
#[test]
fn a_failed_read_holds_its_slots_only_while_its_parts_are_in_flight() {
    if !common::uring_available() {
        return;
    }
    let Some(shm) = common::second_drive_tempdir() else {
        return;
    };
    let tmp = common::tempdir();
    let (a, b) = (tmp.path().join("primary"), shm.path().join("split"));
    std::fs::create_dir_all(&a).unwrap();
    std::fs::create_dir_all(&b).unwrap();
    // w1 of each expert on the primary's drive, w2 on the second drive.
    for (dir, proj) in [(&a, "w1"), (&b, "w2")] {
        let mut l = common::Layout::new(4096);
        for e in 0..2u64 {
            l.place(
                &format!("model.layers.0.mlp.experts.{e}.{proj}.weight"),
                4096 + e * 40_000,
                40_000,
            );
        }
        l.write(&dir.join(format!("{proj}.safetensors")), 21);
    }
    let model = Model::open(ModelConfig::new(&a).dirs([&b])).unwrap();
    let drive = |dir: &std::path::Path| {
        let dev = common::st_dev(dir);
        model.drives().iter().position(|d| d.dev == dev).unwrap()
    };
    let (da, db) = (drive(&a), drive(&b));
    assert_ne!(da, db);
    let config = CacheConfig::new(Capacity::Experts(1)).engine(EngineConfig::default().backend(BackendChoice::Uring));
    let cache = ExpertCache::new(&model, config).unwrap();
    cache.engine().inject_fault(db, Fault::HoldQueued(true));
    cache.engine().inject_fault(da, Fault::EnterFails(libc::EIO));
    // w1 (first) fails; w2 is queued on the held drive.
    let e = cache.get(0, 0).unwrap_err();
    assert!(matches!(e, Error::Cache(CacheError::ReadFailed { .. })), "{e}");
    let full = cache.get(0, 1).unwrap_err();
    match &full {
        Error::Cache(CacheError::Full { pinned, loading, .. }) => {
            assert_eq!(*pinned, 0, "{full}");
            assert_eq!(*loading, 1, "the failed read's part in flight is counted: {full}");
        }
        other => panic!("{other}"),
    }
    cache.engine().inject_fault(db, Fault::HoldQueued(false));
    cache.wait_idle().unwrap();
    // Its slot is back: the next get gets room and starts its read (which
    // fails again: drive A's ring stays broken), instead of "full".
    let again = cache.get(0, 1).unwrap_err();
    assert!(matches!(again, Error::Cache(CacheError::ReadFailed { .. })), "{again}");
    let st = cache.stats();
    assert_eq!((st.failed_reads, st.entries, st.pinned), (2, 0, 0), "{st:?}");
}
