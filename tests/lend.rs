//! Caller memory that stays direct: `Engine::lend` (a `&mut [u8]` for a
//! scope), the placement helper, `read_anywhere`, and staging for payloads
//! whose address is out of phase with their file offset. On a model the
//! reference writer wrote (no tensor starts on a block), every read is
//! O_DIRECT, byte-exact, and writes nothing it was not given; `lend`
//! returns only once the kernel is done with the memory.

mod common;

use std::time::Duration;

use weightstream::{
    BackendChoice, DirectMode, Engine, EngineConfig, Model, ModelConfig, Scratch, Stats, TensorRef, WarningKind,
};
use weightstream_synth::{self as synth, SynthSpec};

const GUARD: u8 = 0x5A;

/// A model written by the safetensors crate's serializer (as Python's
/// `safetensors` writes): data starts at 8 + header length, so payloads
/// start anywhere in a block.
fn reference_model(dir: &std::path::Path) -> (Model, SynthSpec) {
    let s = SynthSpec {
        layers: 2,
        experts: 3,
        expert_bytes: 200_000,
        shards: 2,
        seed: 0x1e4d,
        ..SynthSpec::default()
    };
    common::synth_model(dir, &s);
    (Model::open(ModelConfig::new(dir)).unwrap(), s)
}

fn experts(model: &Model) -> Vec<&TensorRef> {
    model
        .catalog()
        .tensors()
        .iter()
        .filter(|t| t.name.contains(".experts."))
        .collect()
}

/// (fallbacks, reads buffered, reads direct, staged reads).
fn counts(st: &Stats) -> [u64; 4] {
    [
        st.fallbacks_total(),
        st.reads_buffered(),
        st.reads_direct(),
        st.staged.reads,
    ]
}

fn delta(a: [u64; 4], b: [u64; 4]) -> [u64; 4] {
    std::array::from_fn(|i| b[i] - a[i])
}

/// A plain `Vec` lent for a scope, laid out by the placement helper: every
/// expert of a reference-written model is read in place and O_DIRECT (no
/// fallback, nothing buffered, nothing staged), byte-exact, and no byte
/// outside the payloads' own blocks is written. Both backends.
#[test]
fn a_lent_vec_laid_out_by_placement_reads_every_expert_in_place_and_direct() {
    let tmp = common::tempdir();
    let dir = tmp.path().join("m");
    let (model, s) = reference_model(&dir);
    let xs = experts(&model);
    assert!(
        xs.iter().any(|t| t.offset % 4096 != 0),
        "the reference layout puts payloads off blocks"
    );
    let direct_fs = common::fs_reads_o_direct(&dir);
    for backend in common::engine_backend_choices() {
        let e = Engine::new(&model, EngineConfig::default().backend(backend)).unwrap();
        let need = e.placement_bytes(&xs).unwrap();
        // Whatever address the allocator gives, `need` bytes hold them.
        let mut buf = vec![GUARD; need + 100];
        let before = counts(&e.stats());
        let placed = e
            .lend(&mut buf, |mem| {
                let p = mem.placement(&xs).unwrap();
                assert!(p.bytes() <= need, "{} > {need}", p.bytes());
                let tickets: Vec<_> = xs
                    .iter()
                    .zip(p.offsets())
                    .map(|(t, &at)| mem.read_into(t, at, Scratch::Blocks).unwrap())
                    .collect();
                for (k, (t, &at)) in tickets.into_iter().zip(xs.iter().zip(p.offsets())) {
                    let l = k.wait().unwrap();
                    assert_eq!((l.offset(), l.len(), l.name()), (at, t.len as usize, t.name.as_str()));
                    assert_eq!((l.as_ptr() as usize) % 4096, (t.offset % 4096) as usize, "in phase");
                    assert!(synth::verify(s.seed, &t.name, &l), "{backend:?}: {}", t.name);
                }
                p
            })
            .unwrap();
        let d = delta(before, counts(&e.stats()));
        if direct_fs {
            assert_eq!(
                d,
                [0, 0, xs.len() as u64, 0],
                "{backend:?}: [fallbacks, buffered, direct, staged]"
            );
        }
        // After the scope the bytes are the caller's: payloads in place,
        // and outside each payload's blocks every guard byte intact.
        let mut mine = vec![false; buf.len()];
        let align = e.direct_align();
        for (t, &at) in xs.iter().zip(placed.offsets()) {
            let pad = (t.offset % align as u64) as usize;
            let mut want = vec![0u8; t.len as usize];
            synth::fill(s.seed, &t.name, 0, &mut want);
            assert!(buf[at..at + t.len as usize] == want[..], "{}", t.name);
            let base = buf.as_ptr() as usize;
            let blocks_end = (base + at + t.len as usize).next_multiple_of(align) - base;
            mine[at - pad..blocks_end.min(buf.len())].fill(true);
        }
        assert!(
            buf.iter().zip(&mine).all(|(&b, &m)| m || b == GUARD),
            "{backend:?}: a byte outside the payloads' blocks was written"
        );
    }
}

/// Addresses the caller fixes, out of phase (page-aligned, as an engine's
/// tensor storage is, or at any byte): the blocks still go O_DIRECT, into
/// staging, and one copy lands exactly the payload; nothing around it is
/// written, nothing is buffered, no fallback is counted; the copies' bytes
/// and CPU time are counted. A staged read whose ticket is dropped never
/// writes the caller's memory.
#[test]
fn fixed_addresses_out_of_phase_go_direct_through_staging() {
    let tmp = common::tempdir();
    let dir = tmp.path().join("m");
    let (model, s) = reference_model(&dir);
    let xs = experts(&model);
    let direct_fs = common::fs_reads_o_direct(&dir);
    for backend in common::engine_backend_choices() {
        let e = Engine::new(&model, EngineConfig::default().backend(backend)).unwrap();
        let step = (xs[0].len as usize).next_multiple_of(4096) + 4096;
        let mut buf = vec![GUARD; step * (xs.len() + 1) + 4096];
        let base = buf.as_ptr() as usize;
        // Page-aligned addresses (the first aligned one, then every `step`),
        // and odd ones 3 bytes past them, each with every scratch choice.
        let first = base.next_multiple_of(4096) - base;
        let places: Vec<(usize, Scratch)> = xs
            .iter()
            .enumerate()
            .map(|(i, t)| {
                let at = first + i * step + if i % 2 == 1 { 3 } else { 0 };
                // Never in phase by chance.
                assert_ne!((base + at) % 4096, (t.offset % 4096) as usize);
                (at, [Scratch::None, Scratch::Before, Scratch::Blocks][i % 3])
            })
            .collect();
        let before = e.stats();
        e.lend(&mut buf, |mem| {
            let tickets: Vec<_> = xs
                .iter()
                .zip(&places)
                .map(|(t, &(at, sc))| mem.read_into(t, at, sc).unwrap())
                .collect();
            for (k, (t, &(at, _))) in tickets.into_iter().zip(xs.iter().zip(&places)) {
                let l = k.wait().unwrap();
                assert_eq!(l.offset(), at);
                assert!(synth::verify(s.seed, &t.name, &l), "{backend:?}: {}", t.name);
            }
            // A staged read dropped in flight: its payload never lands.
            let last = first + xs.len() * step;
            drop(mem.read_into(xs[0], last, Scratch::None).unwrap());
        })
        .unwrap();
        let after = e.stats();
        let d = delta(counts(&before), counts(&after));
        if direct_fs {
            assert_eq!(
                d,
                [0, 0, xs.len() as u64 + 1, xs.len() as u64],
                "{backend:?}: [fallbacks, buffered, direct, staged]"
            );
            let bytes: u64 = xs.iter().map(|t| t.len).sum();
            assert_eq!(after.staged.bytes - before.staged.bytes, bytes);
            assert!(after.staged.copy_cpu_ns > before.staged.copy_cpu_ns);
            assert!(after.staged.copy_cpu_s_per_gb().is_some());
            assert!(after.staged.staging_bytes >= xs[0].len);
            // The user sees it without a subscriber: a warning naming the
            // fix, and a line of the stats' display.
            let w = e.warnings();
            let staged: Vec<_> = w.iter().filter(|w| w.kind == WarningKind::Staged).collect();
            assert_eq!(staged.len(), 1, "{w:?}");
            assert_eq!(staged[0].count, after.staged.reads);
            assert!(staged[0].message.contains("Engine::placement"), "{}", staged[0].message);
            assert!(format!("{after}").contains("staged "), "{after}");
        }
        drop(e); // every read reaped: the dropped one too
        let mut mine = vec![false; buf.len()];
        for (t, &(at, _)) in xs.iter().zip(&places) {
            mine[at..at + t.len as usize].fill(true);
        }
        assert!(
            buf.iter().zip(&mine).all(|(&b, &m)| m || b == GUARD),
            "{backend:?}: a staged read wrote outside its payload (or a dropped one wrote at all)"
        );
    }
}

/// `read_anywhere` chooses the place: in phase, in place, O_DIRECT, in
/// lent memory and in an engine's packed arena, and reports the offset.
#[test]
fn read_anywhere_chooses_an_in_phase_place() {
    let tmp = common::tempdir();
    let dir = tmp.path().join("m");
    let (model, s) = reference_model(&dir);
    let xs = experts(&model);
    let direct_fs = common::fs_reads_o_direct(&dir);
    let e = Engine::new(&model, EngineConfig::default()).unwrap();
    let mut buf = vec![0u8; e.placement_bytes(&xs).unwrap()];
    let before = counts(&e.stats());
    e.lend(&mut buf, |mem| {
        let (mut spans, mut held) = (Vec::new(), Vec::new());
        let tickets: Vec<_> = xs.iter().map(|t| mem.read_anywhere(t).unwrap()).collect();
        for ((at, k), t) in tickets.into_iter().zip(&xs) {
            let l = k.wait().unwrap();
            assert_eq!(l.offset(), at);
            assert_eq!((l.as_ptr() as usize) % 4096, (t.offset % 4096) as usize);
            assert!(synth::verify(s.seed, &t.name, &l));
            spans.push((at, at + t.len as usize));
            held.push(l);
        }
        spans.sort();
        assert!(spans.windows(2).all(|w| w[0].1 <= w[1].0), "overlap");
        // Full: the error says how much is free.
        let one_more = mem.read_anywhere(xs[0]).unwrap_err().to_string();
        assert!(
            one_more.contains("free") && one_more.contains(&xs[0].name),
            "{one_more}"
        );
    })
    .unwrap();
    let arena = e.packed_arena(4 << 20, false).unwrap();
    let (at, k) = e.read_anywhere(xs[1], &arena).unwrap();
    let l = k.wait().unwrap();
    assert_eq!(l.offset(), at);
    assert!(synth::verify(s.seed, &xs[1].name, &l));
    if direct_fs {
        let d = delta(before, counts(&e.stats()));
        assert_eq!(
            d,
            [0, 0, xs.len() as u64 + 1, 0],
            "[fallbacks, buffered, direct, staged]"
        );
    }
    // A fixed arena has no places to choose: an error naming the fix.
    let fixed = e.arena(model.slot_spec_for_largest("").unwrap(), 1).unwrap();
    let err = e.read_anywhere(xs[0], &fixed).unwrap_err().to_string();
    assert!(err.contains("Arena::take"), "{err}");
}

/// `lend` returns only once the kernel is done with the memory: a ticket
/// forgotten, or dropped, while its read crawls from a 2 MB/s drive, and a
/// closure that panics with a read in flight, all leave the whole payload
/// in place by the time `lend` returns (or unwinds). Root only (simulated
/// drive).
#[test]
fn lend_returns_only_after_every_read_into_the_memory_completed() {
    let Some(sim) = common::SimDrives::up(1, "loop", "2") else {
        return;
    };
    let dir = sim.mounts[0].join("m");
    let s = SynthSpec {
        layers: 1,
        experts: 2,
        expert_bytes: 1 << 20,
        shards: 1,
        seed: 0x1e4e,
        ..SynthSpec::default()
    };
    common::synth_model(&dir, &s);
    let model = Model::open(ModelConfig::new(&dir)).unwrap();
    let t = experts(&model)[0].clone();
    let mut want = vec![0u8; t.len as usize];
    synth::fill(s.seed, &t.name, 0, &mut want);
    for backend in common::engine_backend_choices() {
        let e = Engine::new(&model, EngineConfig::default().backend(backend)).unwrap();
        for how in ["forget", "drop", "panic"] {
            assert!(std::process::Command::new("sync").status().unwrap().success());
            std::fs::write("/proc/sys/vm/drop_caches", "3").unwrap();
            let mut buf = vec![GUARD; e.placement_bytes(&[&t]).unwrap()];
            let at = e.lend(&mut buf, |mem| mem.placement(&[&t]).unwrap().at(0)).unwrap();
            let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                e.lend(&mut buf, |mem| {
                    let k = mem.read_into(&t, at, Scratch::Blocks).unwrap();
                    // 1 MiB at 2 MB/s: in flight for about half a second.
                    let k = k.wait_timeout(Duration::ZERO).expect_err("still in flight");
                    match how {
                        "forget" => std::mem::forget(k),
                        "drop" => drop(k),
                        _ => panic!("the engine's caller panics with a read in flight"),
                    }
                })
            }));
            assert_eq!(r.is_err(), how == "panic", "{backend:?} {how}");
            assert!(
                buf[at..at + t.len as usize] == want[..],
                "{backend:?} {how}: lend returned before the read completed"
            );
        }
    }
    drop(sim);
}

/// With O_DIRECT off there is nothing to stage for: a read at a fixed
/// address goes buffered straight into place (no staging mapped), bytes
/// right; an empty slice is refused.
#[test]
fn without_o_direct_nothing_is_staged_and_empty_memory_is_refused() {
    let tmp = common::tempdir();
    let dir = tmp.path().join("m");
    let (_, s) = reference_model(&dir);
    let model = Model::open(ModelConfig::new(&dir).direct(DirectMode::Off)).unwrap();
    let xs = experts(&model);
    let e = Engine::new(&model, EngineConfig::default().backend(BackendChoice::Auto)).unwrap();
    let mut buf = vec![0u8; 1 << 20];
    e.lend(&mut buf, |mem| {
        let l = mem.read_into(xs[0], 4096, Scratch::None).unwrap().wait().unwrap();
        assert!(synth::verify(s.seed, &xs[0].name, &l));
    })
    .unwrap();
    let st = e.stats();
    assert_eq!((st.staged.reads, st.staged.staging_bytes), (0, 0));
    let err = e.lend(&mut [], |_| ()).unwrap_err().to_string();
    assert!(err.contains("empty"), "{err}");
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig { cases: 48, ..Default::default() })]

    /// Against a naive oracle, for any tensor, any address and any scratch:
    /// the payload's bytes land exactly, nothing is read buffered or falls
    /// back, and the only bytes written outside the payload are the ones
    /// its scratch allows at an in-phase address (the pad before with
    /// `Before`; the pad and the rest of the last block with `Blocks`).
    #[test]
    fn any_address_any_scratch_lands_exactly_and_writes_only_what_is_allowed(
        pick in 0usize..1000,
        at in 0usize..(64 << 10),
        in_phase in proptest::bool::ANY,
        scratch in proptest::sample::select(vec![Scratch::None, Scratch::Before, Scratch::Blocks]),
    ) {
        let (tmp, model, s) = &*SHARED;
        let tensors = model.catalog().tensors();
        let t = &tensors[pick % tensors.len()];
        let e = Engine::new(model, EngineConfig::default()).unwrap();
        let len = t.len as usize;
        let a = 4096usize;
        let pad = (t.offset % a as u64) as usize;
        let mut buf = vec![GUARD; len + (80 << 10)];
        let base = buf.as_ptr() as usize;
        // Half the cases in phase (the address's block offset = the file's).
        let at = if in_phase {
            let x = (base + at).next_multiple_of(a) - base + pad;
            if x >= a { x - a } else { x }
        } else {
            at
        };
        let phase_ok = (base + at) % a == pad && at >= pad;
        let before = e.stats();
        e.lend(&mut buf, |mem| {
            let l = mem.read_into(t, at, scratch).unwrap().wait().unwrap();
            assert_eq!(l.offset(), at);
            assert!(synth::verify(s.seed, &t.name, &l), "{}", t.name);
        })
        .unwrap();
        let after = e.stats();
        if common::fs_reads_o_direct(tmp.path()) {
            proptest::prop_assert_eq!(after.fallbacks_total(), before.fallbacks_total());
            proptest::prop_assert_eq!(after.reads_buffered(), before.reads_buffered());
        }
        // The oracle: what may be written besides the payload.
        let blocks_end = ((base + at + len).next_multiple_of(a) - base).min(buf.len());
        let (lo, hi) = match scratch {
            Scratch::Blocks if phase_ok => (at - pad, blocks_end),
            Scratch::Before if phase_ok => (at - pad, at + len),
            _ => (at, at + len),
        };
        let stray = buf
            .iter()
            .enumerate()
            .filter(|&(i, &b)| (i < lo || i >= hi) && b != GUARD)
            .count();
        proptest::prop_assert_eq!(stray, 0, "{} at {} with {:?} (in phase: {})", t.name, at, scratch, phase_ok);
    }
}

/// One reference-written model for the property test's cases.
static SHARED: std::sync::LazyLock<(tempfile::TempDir, Model, SynthSpec)> = std::sync::LazyLock::new(|| {
    let tmp = common::tempdir();
    let (model, s) = reference_model(tmp.path());
    (tmp, model, s)
});
