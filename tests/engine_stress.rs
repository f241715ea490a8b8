//! Many threads, one engine, one arena: four threads share `&Engine` and a
//! 16-slot arena, per backend (io_uring and pread), each issuing a fixed
//! number of reads of random tensors (seeded PRNG) and holding up to three tickets
//! at once, finished in random order by `wait()`, by `try_wait()` polling,
//! or dropped unread. Before every read the slot is scribbled over, so a
//! chunk that never landed (or landed in the wrong slot, or a late chunk of
//! a dropped read landing in a slot already handed to someone else) shows
//! up as a mismatch: every payload is checked byte for byte with
//! `synth::verify`. At the end every slot is home, the engine drops cleanly,
//! and the counters account for at least every verified byte.

mod common;

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use weightstream::{Arena, BackendChoice, Engine, EngineConfig, Model, ModelConfig, TensorRef, Ticket};
use weightstream_synth::{self as synth, SplitMix64, SynthSpec};

const THREADS: usize = 4;
const SLOTS: usize = 16;
/// Reads each thread issues (and finishes): a fixed count, not a time, so
/// a loaded machine runs the same mix, only slower.
const READS_PER_THREAD: usize = 60;

#[derive(Default)]
struct Tally {
    verified: AtomicU64,
    verified_bytes: AtomicU64,
    dropped: AtomicU64,
    polled: AtomicU64,
    mismatches: AtomicU64,
    errors: AtomicU64,
}

const SCRIBBLE: u8 = 0x5A;

fn finish(seed: u64, t: &TensorRef, ticket: Ticket, how: usize, tally: &Tally) {
    let r = match how {
        // Dropped unread: the slot comes back when the read completes.
        0 => {
            drop(ticket);
            tally.dropped.fetch_add(1, Ordering::Relaxed);
            return;
        }
        // try_wait polling.
        1 => {
            let mut ticket = ticket;
            let deadline = Instant::now() + Duration::from_secs(60);
            loop {
                match ticket.try_wait() {
                    Ok(r) => break r,
                    Err(back) => ticket = back,
                }
                assert!(Instant::now() < deadline, "{}: try_wait never ready", t.name);
                std::thread::yield_now();
            }
        }
        _ => ticket.wait(),
    };
    if how == 1 {
        tally.polled.fetch_add(1, Ordering::Relaxed);
    }
    match r {
        Ok(loaded) => {
            if loaded.len() as u64 == t.len && synth::verify(seed, &t.name, &loaded) {
                tally.verified.fetch_add(1, Ordering::Relaxed);
                tally.verified_bytes.fetch_add(t.len, Ordering::Relaxed);
            } else {
                let first_bad = {
                    let mut want = vec![0u8; loaded.len()];
                    synth::fill(seed, &t.name, 0, &mut want);
                    want.iter().zip(loaded.iter()).position(|(a, b)| a != b)
                };
                eprintln!(
                    "MISMATCH {}: {} bytes (want {}), first differing byte {first_bad:?}",
                    t.name,
                    loaded.len(),
                    t.len
                );
                tally.mismatches.fetch_add(1, Ordering::Relaxed);
            }
        }
        Err(e) => {
            eprintln!("ERROR {}: {e}", t.name);
            tally.errors.fetch_add(1, Ordering::Relaxed);
        }
    }
}

fn worker(engine: &Engine, arena: &Arena, tensors: &[TensorRef], seed: u64, thread_seed: u64, tally: &Tally) {
    let mut rng = SplitMix64(thread_seed);
    let mut held: VecDeque<(usize, Ticket)> = VecDeque::new();
    let mut issued = 0;
    while issued < READS_PER_THREAD || !held.is_empty() {
        let issue = issued < READS_PER_THREAD && held.len() < 3 && (held.is_empty() || rng.below(2) == 0);
        if issue {
            if let Ok(mut slot) = arena.take() {
                let i = rng.below(tensors.len());
                slot.as_bytes_mut().fill(SCRIBBLE);
                issued += 1;
                match engine.read(&tensors[i], slot) {
                    Ok(t) => held.push_back((i, t)),
                    Err(e) => {
                        eprintln!("ERROR read {}: {e}", tensors[i].name);
                        tally.errors.fetch_add(1, Ordering::Relaxed);
                    }
                }
                continue;
            }
            if held.is_empty() {
                // Every slot is out (with other threads, or coming back from
                // dropped reads): let them finish (a back-off; the loop
                // checks again).
                std::thread::sleep(Duration::from_micros(200));
                continue;
            }
        }
        // Finish one held ticket, not necessarily the oldest.
        let k = rng.below(held.len());
        let (i, ticket) = held.remove(k).expect("k < len");
        let how = match rng.below(8) {
            0 => 0,
            1 | 2 => 1,
            _ => 2,
        };
        finish(seed, &tensors[i], ticket, how, tally);
    }
}

fn stress(backend: BackendChoice) {
    let tmp = common::tempdir();
    let dir = tmp.path().join("model");
    let spec = SynthSpec {
        layers: 2,
        experts: 4,
        expert_bytes: 1 << 20,
        shards: 2,
        seed: 0x57e5_5000 + backend as u64,
        ..SynthSpec::default()
    };
    common::synth_model(&dir, &spec);
    let model = Model::open(ModelConfig::new(&dir)).unwrap();
    let tensors: Vec<TensorRef> = model.catalog().tensors().to_vec();
    assert!(tensors.len() >= 20);
    let cfg = EngineConfig::default().backend(backend).queue_depth(16).// Several chunks per expert(// Several chunks per expert).one for the small tensors.
        chunk(Some(256 << 10)).pread_threads(4);
    let engine = Engine::new(&model, cfg).unwrap();
    let name = engine.backend_name();
    assert_eq!(
        name,
        if backend == BackendChoice::Pread {
            "pread"
        } else {
            "uring"
        }
    );
    let arena = engine.arena(model.slot_spec_for_largest("").unwrap(), SLOTS).unwrap();
    let tally = Tally::default();
    let before = engine.stats().bytes;
    let t0 = Instant::now();
    std::thread::scope(|s| {
        for k in 0..THREADS {
            let (engine, arena, tensors, tally) = (&engine, &arena, &tensors, &tally);
            s.spawn(move || worker(engine, arena, tensors, spec.seed, 0xC0FFEE + k as u64, tally));
        }
    });
    let elapsed = t0.elapsed();
    // Dropped tickets hand their slots back when their reads complete.
    // A watchdog (a hang becomes a failure), generous for a loaded machine.
    let deadline = Instant::now() + Duration::from_secs(60);
    while arena.available() != SLOTS {
        assert!(
            Instant::now() < deadline,
            "{name}: slots never came home: {}",
            arena.available()
        );
        std::thread::sleep(Duration::from_millis(1));
    }
    let landed = engine.stats().bytes - before;
    let st = engine.stats();
    drop(engine);
    assert_eq!(arena.available(), SLOTS);

    let ld = |a: &AtomicU64| a.load(Ordering::Relaxed);
    let (verified, dropped, polled) = (ld(&tally.verified), ld(&tally.dropped), ld(&tally.polled));
    eprintln!(
        "{name}: {verified} reads verified ({} MB), {polled} of them by try_wait, {dropped} dropped unread, in {:.1}s; inflight_max {:?}",
        ld(&tally.verified_bytes) / 1_000_000,
        elapsed.as_secs_f64(),
        st.drives.iter().map(|d| d.inflight_max).collect::<Vec<_>>()
    );
    assert_eq!(
        ld(&tally.mismatches),
        0,
        "{name}: payloads differed from what was written"
    );
    assert_eq!(ld(&tally.errors), 0, "{name}: reads failed");
    assert_eq!(
        verified + dropped,
        (THREADS * READS_PER_THREAD) as u64,
        "{name}: every read issued is verified or dropped"
    );
    assert!(
        dropped >= 5 && polled >= 10,
        "{name}: the mix did not happen: {dropped} dropped, {polled} polled"
    );
    assert!(
        landed >= ld(&tally.verified_bytes),
        "{name}: counters hold {landed} bytes, fewer than the {} verified",
        ld(&tally.verified_bytes)
    );
    if backend == BackendChoice::Uring {
        assert!(
            st.drives.iter().any(|d| d.inflight_max >= 2),
            "{name}: four threads never had two chunks in flight"
        );
    }
}

#[test]
fn four_threads_share_one_uring_engine() {
    stress(BackendChoice::Uring);
}

#[test]
fn four_threads_share_one_pread_engine() {
    stress(BackendChoice::Pread);
}
