//! The failure model (docs/failure-model.md): what happens
//! to memory in flight, tickets, the engine and the caller when an I/O
//! thread dies, a waker panics, io_uring_enter keeps failing, an arena is
//! dropped from a ring thread, or the engine is stopped with reads in the
//! kernel. Each test failed (hung, deadlocked or saw kernel writes into a
//! reused slot) before the failure model was built.
//!
//! Slow-drive variants run on a `simdrives` loop drive capped at 2 MB/s
//! (root only; they print SKIP elsewhere), where a 4 MiB read stays in the
//! kernel for about 2 s, so "in flight" is certain, not a race.

mod common;

use std::future::Future;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{mpsc, Arc};
use std::task::{Context, Poll, Wake, Waker};
use std::time::{Duration, Instant};

use common::SimDrives;
use weightstream::__internal::Fault;
use weightstream::{
    Arena, BackendChoice, Engine, EngineConfig, Error, IoPoll, Model, ModelConfig, SlotSpec, TensorRef,
};
use weightstream_synth::{self as synth, SynthSpec};

const SCRIBBLE: u8 = 0xAA;

/// About 26 MB: 1 layer x 2 experts x 3 projections of ~4 MiB, 1 shard.
fn spec() -> SynthSpec {
    SynthSpec {
        layers: 1,
        experts: 2,
        expert_bytes: 4 << 20,
        shards: 1,
        seed: 0xfa17,
        ..SynthSpec::default()
    }
}

fn write_model(dir: &Path) -> SynthSpec {
    let s = spec();
    common::synth_model(dir, &s);
    s
}

/// The expert projections (about 4 MiB each), largest first.
fn experts(model: &Model) -> Vec<TensorRef> {
    let mut v: Vec<TensorRef> = model
        .catalog()
        .tensors()
        .iter()
        .filter(|t| t.name.contains(".experts."))
        .cloned()
        .collect();
    v.sort_by(|a, b| b.len.cmp(&a.len).then(a.name.cmp(&b.name)));
    assert!(v.len() >= 4, "fixture: {v:?}");
    v
}

fn spec_for(model: &Model, t: &TensorRef) -> SlotSpec {
    SlotSpec::new(t.len as usize).with_align(model.required_align())
}

fn config(backend: BackendChoice, depth: usize, chunk: usize) -> EngineConfig {
    EngineConfig::default()
        .backend(backend)
        .queue_depth(depth)
        .chunk(Some(chunk))
        .pread_threads(2)
}

/// Runs `f` on its own thread and fails the test (instead of hanging it)
/// when it takes longer than `limit`: the defects these tests cover were
/// hangs and deadlocks.
fn within<T: Send + 'static>(limit: Duration, what: &str, f: impl FnOnce() -> T + Send + 'static) -> T {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    match rx.recv_timeout(limit) {
        Ok(v) => v,
        Err(_) => panic!("{what}: still not done after {limit:?} (hang or deadlock)"),
    }
}

/// Fills `slot` with the scribble, waits, and says which bytes changed (a
/// late kernel write into memory safe code owns).
fn late_writes(arena: &Arena, wait: Duration) -> usize {
    let mut slots: Vec<_> = std::iter::from_fn(|| arena.take().ok()).collect();
    for s in &mut slots {
        s.as_bytes_mut().fill(SCRIBBLE);
    }
    std::thread::sleep(wait);
    slots
        .iter()
        .map(|s| s.as_bytes().iter().filter(|&&b| b != SCRIBBLE).count())
        .sum()
}

/// A read on a drive whose I/O thread is gone fails at once: `read`
/// refuses it, or returns a ticket already complete (its chunks failed in
/// the caller's thread, none was queued for a thread that will never take
/// it); either way no wait. Returns the error.
fn fails_at_once(engine: &Engine, t: &TensorRef, slot: weightstream::Slot, what: &str) -> Error {
    match engine.read(t, slot) {
        Err(e) => e,
        Ok(ticket) => {
            assert!(
                ticket.is_ready(),
                "{what}: a read on a dead drive was queued, not failed at once"
            );
            ticket.wait().expect_err("a read on a dead drive succeeded")
        }
    }
}

/// Polls `done` until it holds; a watchdog of `limit` turns a hang into a
/// failure (a loaded machine is slow, not stuck: the limits are generous).
fn wait_until(what: &str, limit: Duration, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + limit;
    while !done() {
        assert!(Instant::now() < deadline, "{what}: still not so after {limit:?}");
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// A waker that panics every time it is called.
struct PanickingWaker(AtomicUsize);

impl Wake for PanickingWaker {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }
    fn wake_by_ref(self: &Arc<Self>) {
        self.0.fetch_add(1, Ordering::SeqCst);
        panic!("a caller's waker panics");
    }
}

/// Polls `t` once with a waker that panics when the read completes (on the
/// I/O thread that completes it). `None` when the read had already landed.
fn poll_with_panicking_waker(t: &mut weightstream::Ticket) -> Option<Arc<PanickingWaker>> {
    let w = Arc::new(PanickingWaker(AtomicUsize::new(0)));
    let waker = Waker::from(Arc::clone(&w));
    let mut cx = Context::from_waker(&waker);
    match Pin::new(t).poll(&mut cx) {
        Poll::Pending => Some(w),
        Poll::Ready(_) => None,
    }
}

/// A caller's waker that panics runs on the I/O thread that completes the
/// read. It must not take the thread (and with it the ring and the
/// in-flight table) down: the panic is caught, that read completes, reads
/// in flight beside it complete, and the drive keeps serving. (Before: the
/// ring thread unwound, its ring and table were dropped with chunks in the
/// kernel, later reads queued forever.)
#[test]
fn a_panicking_waker_is_caught_and_the_drive_keeps_serving() {
    let tmp = common::tempdir();
    let dir = tmp.path().join("model");
    let s = write_model(&dir);
    let model = Model::open(ModelConfig::new(&dir)).unwrap();
    let ex = experts(&model);
    for backend in common::engine_backend_choices() {
        let model = model.clone();
        let ex = ex.clone();
        within(Duration::from_secs(60), &format!("{backend:?}"), move || {
            // 4 KiB chunks: about a thousand per read, so the second read is
            // in flight when the first completes.
            let engine = Engine::new(&model, config(backend, 4096, 4096)).unwrap();
            let arena = engine.arena(spec_for(&model, &ex[0]), 3).unwrap();
            let (first, waker) = (0..8)
                .find_map(|_| {
                    let mut t = engine.read(&ex[1], arena.take().unwrap()).unwrap();
                    poll_with_panicking_waker(&mut t).map(|w| (t, w))
                })
                .expect("the read was never still in flight when polled");
            let second = engine.read(&ex[0], arena.take().unwrap()).unwrap();
            let l = second.wait().unwrap_or_else(|e| panic!("{backend:?}: {e}"));
            assert!(synth::verify(s.seed, &ex[0].name, &l));
            drop(l);
            wait_until(
                &format!("{backend:?}: the read whose waker panicked completed"),
                Duration::from_secs(60),
                || first.is_ready(),
            );
            assert_eq!(
                waker.0.load(Ordering::SeqCst),
                1,
                "{backend:?}: the waker was not called"
            );
            let l = first.wait().unwrap_or_else(|e| panic!("{backend:?}: {e}"));
            assert!(synth::verify(s.seed, &ex[1].name, &l));
            drop(l);
            // The drive still serves, and arenas can still be made.
            let more = engine.arena(spec_for(&model, &ex[2]), 1).unwrap();
            let l = engine.read(&ex[2], more.take().unwrap()).unwrap().wait().unwrap();
            assert!(synth::verify(s.seed, &ex[2].name, &l));
            assert!(engine.stats().drives.iter().all(|d| d.stopped.is_none()));
        });
    }
}

/// As above on a drive capped at 2 MB/s, the reproduction: a read
/// whose ticket was dropped is in the kernel for seconds when another read's
/// waker panics. Its slot must not come back (and be scribbled on by safe
/// code) until the kernel is done: no byte of the retaken slot changes.
#[test]
fn a_panicking_waker_on_a_slow_drive_lets_no_kernel_write_into_a_reused_slot() {
    let Some(sim) = SimDrives::up(1, "loop", "2") else {
        return;
    };
    let dir = sim.mounts[0].join("model");
    write_model(&dir);
    let model = Model::open(ModelConfig::new(&dir)).unwrap();
    let ex = experts(&model);
    let norm = model.tensor("model.layers.0.input_layernorm.weight").unwrap().clone();
    within(Duration::from_secs(60), "slow drive", move || {
        let engine = Engine::new(&model, config(BackendChoice::Uring, 64, 1 << 20)).unwrap();
        let big = engine.arena(spec_for(&model, &ex[0]), 1).unwrap();
        let small = engine.arena(spec_for(&model, &norm), 1).unwrap();
        // A small read whose waker panics, then a 4 MiB read (2 s at 2 MB/s)
        // whose ticket is dropped at once.
        // (Polled before it lands: tried a few times, since a small read
        // can land before a preempted test thread polls it.)
        let (first, _w) = (0..8)
            .find_map(|_| {
                let mut t = engine.read(&norm, small.take().unwrap()).unwrap();
                poll_with_panicking_waker(&mut t).map(|w| (t, w))
            })
            .expect("a read on a 2 MB/s drive always landed before it was polled");
        drop(engine.read(&ex[0], big.take().unwrap()).unwrap());
        // The slot comes back only when the kernel is done with it.
        wait_until("the dropped read's slot came back", Duration::from_secs(60), || {
            big.available() == 1
        });
        assert_eq!(
            late_writes(&big, Duration::from_millis(600)),
            0,
            "kernel wrote into a reused slot"
        );
        assert!(first.is_ready());
        drop(engine);
    });
    drop(sim);
}

/// An I/O thread that ends with chunks in the kernel (a panic that escapes
/// everything, injected here) must not free or recycle their memory: the
/// ring is leaked, the ticket fails naming the drive, the slot never comes
/// back to the arena, later reads on the drive fail at once, and the
/// engine's other calls (arena, stats, drop) neither hang nor panic.
fn io_thread_death(model: &Model, ex: &[TensorRef], cfg: EngineConfig, slow: bool) -> Result<(), String> {
    let engine = Engine::new(model, cfg).unwrap();
    let arena = engine.arena(spec_for(model, &ex[0]), 2).unwrap();
    let ticket = engine.read(&ex[0], arena.take().unwrap()).unwrap();
    // The fault hits the ring at the top of its loop: wait until it holds
    // chunks of this read in the kernel, so the death is "with reads in
    // flight" and not "before the read was queued".
    let deadline = Instant::now() + Duration::from_secs(2);
    while engine.stats().drives[0].in_flight == Some(0) && !ticket.is_ready() && Instant::now() < deadline {
        std::thread::yield_now();
    }
    let was_in_flight = !ticket.is_ready();
    engine.inject_fault(0, Fault::PanicIoThread);
    let r = within(Duration::from_secs(20), "the ticket of a dead drive", move || {
        ticket.wait().map(|l| l.len())
    });
    let device = &model.drives()[0].device;
    match &r {
        Ok(_) => assert!(
            !slow,
            "a read in the kernel for seconds completed after its thread died"
        ),
        Err(e) => {
            let msg = e.to_string();
            assert!(
                msg.contains(device.as_str()),
                "the error does not name the drive {device}: {msg}"
            );
            assert!(msg.contains("panicked"), "the error does not say why: {msg}");
        }
    }
    let st = engine.stats();
    assert!(st.drives[0].stopped.is_some(), "{:?}", st.drives[0]);
    // Chunks the kernel held when the thread died: their slot is leaked.
    // A read whose chunks were all still queued failed without reaching the
    // kernel: its slot is back.
    let leaked = st.drives[0].chunks_abandoned > 0;
    assert!(!leaked || r.is_err(), "chunks were abandoned but the read succeeded");
    if leaked {
        // Long enough for the kernel to have finished the read (a 4 MiB
        // read at 2 MB/s: 2 s): a slot wrongly handed back would be back.
        std::thread::sleep(Duration::from_millis(if slow { 2500 } else { 100 }));
        assert_eq!(arena.available(), 1, "the slot of an abandoned read came back");
    } else {
        wait_until(
            "a slot the kernel never held came back",
            Duration::from_secs(60),
            || arena.available() == 2,
        );
    }
    // Later reads on the drive fail at once, naming it.
    let e = fails_at_once(&engine, &ex[1], arena.take().unwrap(), "after the thread died");
    assert!(e.to_string().contains(device.as_str()), "{e}");
    // Arenas can still be made, and the engine drops.
    let engine = within(
        Duration::from_secs(10),
        "engine.arena after a thread death",
        move || {
            engine.arena(SlotSpec::new(4096), 1).unwrap();
            engine
        },
    );
    within(Duration::from_secs(10), "dropping the engine", move || drop(engine));
    if leaked {
        assert_eq!(late_writes(&arena, Duration::from_millis(100)), 0);
    }
    if was_in_flight && leaked {
        Ok(())
    } else {
        Err(format!(
            "in flight when the fault was injected: {was_in_flight}; result {r:?}; {:?}",
            st.drives[0]
        ))
    }
}

#[test]
fn a_dead_ring_thread_leaks_what_the_kernel_holds_and_fails_its_tickets() {
    if !common::uring_available() {
        eprintln!("SKIP: io_uring is closed to this process");
        return;
    }
    let tmp = common::tempdir();
    let dir = tmp.path().join("model");
    write_model(&dir);
    let model = Model::open(ModelConfig::new(&dir)).unwrap();
    let ex = experts(&model);
    let mut last = String::new();
    for _ in 0..8 {
        match io_thread_death(&model, &ex, config(BackendChoice::Uring, 4096, 4096), false) {
            Ok(()) => return,
            Err(e) => last = e,
        }
    }
    panic!("the ring thread never died with a chunk in flight: {last}");
}

#[test]
fn a_dead_ring_thread_on_a_slow_drive_never_hands_back_a_slot_the_kernel_writes() {
    let Some(sim) = SimDrives::up(1, "loop", "2") else {
        return;
    };
    let dir = sim.mounts[0].join("model");
    write_model(&dir);
    let model = Model::open(ModelConfig::new(&dir)).unwrap();
    let ex = experts(&model);
    if let Err(e) = io_thread_death(&model, &ex, config(BackendChoice::Uring, 64, 1 << 20), true) {
        panic!("on a 2 MB/s drive: {e}");
    }
    drop(model);
    drop(sim);
}

/// A pread is synchronous: a worker that panics with a chunk in hand leaves
/// nothing with the kernel. That read fails (it does not hang), the worker
/// goes on, and the drive keeps serving.
#[test]
fn a_pread_worker_panic_fails_its_read_and_the_drive_keeps_serving() {
    let tmp = common::tempdir();
    let dir = tmp.path().join("model");
    let s = write_model(&dir);
    let model = Model::open(ModelConfig::new(&dir)).unwrap();
    let ex = experts(&model);
    within(Duration::from_secs(60), "pread", move || {
        let engine = Engine::new(&model, config(BackendChoice::Pread, 64, 1 << 20)).unwrap();
        let arena = engine.arena(spec_for(&model, &ex[0]), 1).unwrap();
        engine.inject_fault(0, Fault::PanicIoThread);
        let e = engine
            .read(&ex[0], arena.take().unwrap())
            .unwrap()
            .wait()
            .expect_err("the chunk in the panicking worker's hand was not failed");
        assert!(e.to_string().contains("dropped before it completed"), "{e}");
        for t in &ex {
            let l = engine.read(t, arena.take().unwrap()).unwrap().wait().unwrap();
            assert!(synth::verify(s.seed, &t.name, &l));
        }
        assert!(engine.stats().drives[0].stopped.is_none());
    });
}

/// With a mirror on a second drive, a dead ring thread costs nothing but
/// the reads it held: every later read is served by the other copy.
#[test]
fn reads_pass_over_a_dead_drive_to_the_mirror() {
    if !common::uring_available() {
        return;
    }
    let Some(sim) = SimDrives::up(2, "loop", "0") else {
        return;
    };
    let (primary, mirror) = (sim.mounts[0].join("model"), sim.mounts[1].join("mirror"));
    let s = write_model(&primary);
    common::synth_model(&mirror, &s);
    let model = Model::open(ModelConfig::new(&primary).mirrors([&mirror])).unwrap();
    assert_eq!(model.drives().len(), 2);
    let ex = experts(&model);
    let m = model.clone();
    within(Duration::from_secs(60), "mirror", move || {
        let engine = Engine::new(&m, config(BackendChoice::Uring, 64, 1 << 20)).unwrap();
        let arena = engine.arena(spec_for(&m, &ex[0]), 1).unwrap();
        engine.inject_fault(0, Fault::PanicIoThread);
        // Let the thread die.
        wait_until("the drive stopped", Duration::from_secs(60), || {
            engine.stats().drives[0].stopped.is_some()
        });
        for t in m.catalog().tensors() {
            let l = engine
                .read(t, arena.take().unwrap())
                .unwrap()
                .wait()
                .unwrap_or_else(|e| panic!("{}: {e}", t.name));
            assert!(synth::verify(s.seed, &t.name, &l), "{}", t.name);
        }
        assert_eq!(engine.stats().drives[0].bytes, 0);
    });
    drop(model);
    drop(sim);
}

/// Dropping an arena whose last slot goes on a ring thread (a ticket dropped
/// in flight after the arena handle) runs the arena's release hook there,
/// and it takes the engine's registry. Making an arena must not hold the
/// registry while it waits for the rings, or the two deadlock. (Before:
/// deadlocked within 1-2 iterations.)
#[test]
fn arenas_made_and_dropped_around_reads_in_flight_never_deadlock() {
    let tmp = common::tempdir();
    let dir = tmp.path().join("model");
    write_model(&dir);
    let model = Model::open(ModelConfig::new(&dir)).unwrap();
    let ex = experts(&model);
    for backend in common::engine_backend_choices() {
        let (model, ex) = (model.clone(), ex.clone());
        within(Duration::from_secs(60), &format!("{backend:?} arena loop"), move || {
            let engine = Engine::new(&model, config(backend, 4096, 4096)).unwrap();
            for i in 0..100 {
                let arena = engine.arena(spec_for(&model, &ex[0]), 1).unwrap();
                let t = engine.read(&ex[i % ex.len()], arena.take().unwrap()).unwrap();
                drop(t);
                drop(arena);
            }
        });
    }
}

/// `io_uring_enter` failing for good (injected: every call fails with
/// ENOMEM) must not keep the ring thread retrying forever: past the budget
/// the ring is declared broken, the chunks the kernel never accepted fail
/// (naming io_uring_enter and the drive), later reads fail at once, and the
/// engine drops. (Before: logged every 10 ms forever; the read never ended.)
#[test]
fn io_uring_enter_failing_for_good_fails_the_reads_in_bounded_time() {
    if !common::uring_available() {
        return;
    }
    let tmp = common::tempdir();
    let dir = tmp.path().join("model");
    write_model(&dir);
    let model = Model::open(ModelConfig::new(&dir)).unwrap();
    let ex = experts(&model);
    within(Duration::from_secs(60), "enter failures", move || {
        let engine = Engine::new(&model, config(BackendChoice::Uring, 64, 1 << 20)).unwrap();
        let arena = engine.arena(spec_for(&model, &ex[0]), 2).unwrap();
        engine.inject_fault(0, Fault::EnterFails(libc::ENOMEM));
        let t0 = Instant::now();
        let e = engine
            .read(&ex[0], arena.take().unwrap())
            .unwrap()
            .wait()
            .expect_err("read through a broken ring");
        // Bounded: `within`'s watchdog fails a read that never ends; the
        // time (the failure budget, 2 s, plus back-off) is printed.
        eprintln!("the read through a broken ring failed after {:?}", t0.elapsed());
        let msg = e.to_string();
        assert!(
            msg.contains("io_uring_enter") && msg.contains(&model.drives()[0].device),
            "{msg}"
        );
        // Never submitted: the kernel holds nothing of it, so the slot is back.
        assert_eq!(arena.available(), 2, "a never-submitted chunk's slot was kept");
        fails_at_once(&engine, &ex[1], arena.take().unwrap(), "after the ring broke");
        drop(engine);
    });
}

/// With a mirror on another drive, the chunks a broken ring never submitted
/// fail over: the reads succeed with the mirror's bytes.
#[test]
fn chunks_a_broken_ring_never_submitted_fail_over_to_the_mirror() {
    if !common::uring_available() {
        return;
    }
    let Some(sim) = SimDrives::up(2, "loop", "0") else {
        return;
    };
    let (primary, mirror) = (sim.mounts[0].join("model"), sim.mounts[1].join("mirror"));
    let s = write_model(&primary);
    common::synth_model(&mirror, &s);
    let model = Model::open(ModelConfig::new(&primary).mirrors([&mirror])).unwrap();
    let ex = experts(&model);
    let m = model.clone();
    within(Duration::from_secs(60), "enter failures with a mirror", move || {
        let engine = Engine::new(
            &m,
            config(BackendChoice::Uring, 64, 1 << 20).route(Some(weightstream::RoutePolicy::Hash)),
        )
        .unwrap();
        let arena = engine.arena(spec_for(&m, &ex[0]), ex.len()).unwrap();
        engine.inject_fault(0, Fault::EnterFails(libc::EIO));
        let tickets: Vec<_> = ex
            .iter()
            .map(|t| engine.read(t, arena.take().unwrap()).unwrap())
            .collect();
        for (t, k) in ex.iter().zip(tickets) {
            let l = k.wait().unwrap_or_else(|e| panic!("{}: {e}", t.name));
            assert!(synth::verify(s.seed, &t.name, &l), "{}", t.name);
        }
        let st = engine.stats();
        assert!(
            st.drives[0].stopped.is_some() && st.drives[0].failovers > 0,
            "{:?}",
            st.drives[0]
        );
    });
    drop(model);
    drop(sim);
}

/// CPU time (user + system, seconds) of the calling process's thread named
/// `prefix*`, from /proc.
fn thread_cpu(prefix: &str) -> Option<f64> {
    let tick = 100.0; // USER_HZ
    for e in std::fs::read_dir("/proc/self/task").ok()? {
        let p = e.ok()?.path();
        let comm = std::fs::read_to_string(p.join("comm")).ok()?;
        if comm.trim().starts_with(prefix) {
            let stat = std::fs::read_to_string(p.join("stat")).ok()?;
            let rest = &stat[stat.rfind(')')? + 2..];
            let f: Vec<&str> = rest.split(' ').collect();
            let (u, s): (f64, f64) = (f[11].parse().ok()?, f[12].parse().ok()?);
            return Some((u + s) / tick);
        }
    }
    None
}

/// A polled ring (IOPOLL) cannot read its wake-up eventfd (the read fails
/// at once with EOPNOTSUPP). It must not re-arm it forever, spinning a
/// core: reads are right, and an idle polled ring uses no CPU. (Before: the
/// ring thread spun at 100% while idle.)
#[test]
fn an_idle_polled_ring_sleeps() {
    if !common::uring_available() {
        return;
    }
    let tmp = common::tempdir();
    let dir = tmp.path().join("model");
    let s = write_model(&dir);
    let model = Model::open(ModelConfig::new(&dir)).unwrap();
    let ex = experts(&model);
    let engine = Engine::new(&model, config(BackendChoice::Uring, 32, 1 << 20).iopoll(IoPoll::Force)).unwrap();
    assert!(engine.stats().drives[0]
        .ring
        .as_deref()
        .unwrap_or("")
        .contains("iopoll"));
    let arena = engine.arena(spec_for(&model, &ex[0]), 1).unwrap();
    for t in &ex {
        let ticket = engine.read(t, arena.take().unwrap()).unwrap();
        let l = within(Duration::from_secs(20), "polled read", move || ticket.wait()).unwrap();
        assert!(synth::verify(s.seed, &t.name, &l));
    }
    let device = &model.drives()[0].device;
    let name: String = format!("ws-ring-{device}").chars().take(15).collect();
    // A bound on the ring thread's CPU time, not on wall time: a loaded
    // machine cannot make a sleeping thread use CPU (a spinning one still
    // gets a share of a core, well above 0.1 s in 0.5 s).
    let before = thread_cpu(&name).expect("the ring thread");
    std::thread::sleep(Duration::from_millis(500));
    let idle = thread_cpu(&name).unwrap() - before;
    assert!(idle < 0.1, "an idle polled ring used {idle:.2} s of CPU in 0.5 s");
    // And it still wakes for new work.
    let l = engine.read(&ex[0], arena.take().unwrap()).unwrap().wait().unwrap();
    assert!(synth::verify(s.seed, &ex[0].name, &l));
}

/// `Engine::shutdown` is bounded: queued reads fail at once ("cancelled"),
/// reads in the kernel are cancelled or waited for until the timeout, and
/// the report says what was left. Every ticket completes; no slot comes
/// back while the kernel may write it.
#[test]
fn shutdown_is_bounded_and_every_ticket_completes() {
    let tmp = common::tempdir();
    let dir = tmp.path().join("model");
    let s = write_model(&dir);
    let model = Model::open(ModelConfig::new(&dir)).unwrap();
    let ex = experts(&model);
    for backend in common::engine_backend_choices() {
        let engine = Engine::new(&model, config(backend, 4096, 4096)).unwrap();
        let arena = engine.arena(spec_for(&model, &ex[0]), ex.len()).unwrap();
        let tickets: Vec<_> = ex
            .iter()
            .map(|t| engine.read(t, arena.take().unwrap()).unwrap())
            .collect();
        // Bounded: the report and every ticket's state say what shutdown
        // did; `within` only turns a hang into a failure (the time is
        // printed, not bounded: a loaded machine may take longer).
        let t0 = Instant::now();
        // 30 s for the reads already in the kernel: on a busy 2-core
        // machine 4096 of them may take longer than the few seconds they
        // take here, and `drained` is asserted below.
        let report = within(Duration::from_secs(120), &format!("{backend:?} shutdown"), move || {
            engine.shutdown(Duration::from_secs(30))
        });
        eprintln!("{backend:?}: shutdown(30 s) returned after {:?}", t0.elapsed());
        assert!(report.drained, "{backend:?}: {report:?}");
        let mut cancelled = 0;
        for (t, k) in ex.iter().zip(tickets) {
            assert!(
                k.is_ready(),
                "{backend:?}: a ticket outlived a drained shutdown unfinished"
            );
            match k.wait() {
                Ok(l) => assert!(synth::verify(s.seed, &t.name, &l)),
                Err(e) => {
                    assert!(e.to_string().contains("cancelled"), "{backend:?}: {e}");
                    cancelled += 1;
                }
            }
        }
        // Queued chunks are cancelled for certain on the pread backend (two
        // workers cannot finish thousands of chunks first); a ring hands
        // its queue to the kernel at once, where a read already at the
        // device is not cancellable.
        if backend == BackendChoice::Pread {
            assert!(
                cancelled > 0,
                "{backend:?}: nothing was cancelled (the reads all finished first)"
            );
        }
        assert_eq!(arena.available(), ex.len());
        assert_eq!(late_writes(&arena, Duration::from_millis(20)), 0);
    }
}

/// A timeout too large for the clock (`Duration::MAX`) is no timeout, as
/// for `wait_timeout` and `Arena::release` (before: "overflow when adding
/// duration to instant", a panic): every read finishes or is cancelled,
/// and the report says drained.
#[test]
fn shutdown_with_a_timeout_too_large_for_the_clock_drains_like_no_timeout() {
    let tmp = common::tempdir();
    let dir = tmp.path().join("model");
    let s = write_model(&dir);
    let model = Model::open(ModelConfig::new(&dir)).unwrap();
    let ex = experts(&model);
    for backend in common::engine_backend_choices() {
        let engine = Engine::new(&model, config(backend, 4096, 4096)).unwrap();
        let arena = engine.arena(spec_for(&model, &ex[0]), ex.len()).unwrap();
        let tickets: Vec<_> = ex
            .iter()
            .map(|t| engine.read(t, arena.take().unwrap()).unwrap())
            .collect();
        let report = engine.shutdown(Duration::MAX);
        assert!(
            report.drained && report.left_in_flight.is_empty(),
            "{backend:?}: {report:?}"
        );
        for (t, k) in ex.iter().zip(tickets) {
            assert!(k.is_ready(), "{backend:?}");
            if let Ok(l) = k.wait() {
                assert!(synth::verify(s.seed, &t.name, &l));
            }
        }
        assert_eq!(arena.available(), ex.len());
    }
}

/// On a drive slower than the timeout, shutdown returns on time and
/// reports the drive it left with reads in the kernel; those reads'
/// slots come back only when the kernel is done with them.
#[test]
fn shutdown_on_a_slow_drive_returns_on_time_and_leaks_rather_than_frees() {
    let Some(sim) = SimDrives::up(1, "loop", "2") else {
        return;
    };
    let dir = sim.mounts[0].join("model");
    write_model(&dir);
    let model = Model::open(ModelConfig::new(&dir)).unwrap();
    let ex = experts(&model);
    for backend in common::engine_backend_choices() {
        let engine = Engine::new(&model, config(backend, 4, 1 << 20)).unwrap();
        let arena = engine.arena(spec_for(&model, &ex[0]), 1).unwrap();
        let ticket = engine.read(&ex[0], arena.take().unwrap()).unwrap();
        // Shut down once a chunk of the read is at the drive (not while it
        // is still queued, where shutdown cancels it).
        wait_until(
            &format!("{backend:?}: a chunk in flight"),
            Duration::from_secs(60),
            || engine.stats().drives[0].in_flight.unwrap_or(0) > 0,
        );
        // "On time" is the report: shutdown returned with the read still in
        // the kernel (not drained), rather than waiting for it. The time is
        // printed, not bounded.
        let t0 = Instant::now();
        let report = engine.shutdown(Duration::from_millis(300));
        eprintln!("{backend:?}: shutdown(300 ms) returned after {:?}", t0.elapsed());
        assert!(
            !report.drained,
            "{backend:?}: a 4 MiB read at 2 MB/s drained in 300 ms: {report:?}"
        );
        assert_eq!(report.left_in_flight[0].0, model.drives()[0].device, "{report:?}");
        assert_eq!(
            arena.available(),
            0,
            "{backend:?}: a slot came back while its read was in the kernel"
        );
        // The ticket completes once the kernel is done; its slot comes back
        // only then, and nothing writes it afterwards.
        let r = within(Duration::from_secs(30), "the last ticket", move || {
            ticket.wait().map(|l| l.len())
        });
        let _ = r;
        wait_until(
            &format!("{backend:?}: the slot came back"),
            Duration::from_secs(60),
            || arena.available() == 1,
        );
        assert_eq!(late_writes(&arena, Duration::from_millis(300)), 0, "{backend:?}");
    }
    drop(model);
    drop(sim);
}

/// Every copy's error in a failed read names the tensor, and one copy is
/// not "every copy".
#[test]
fn read_errors_name_the_tensor_and_do_not_say_every_copy_for_one() {
    let tmp = common::tempdir();
    let dir = tmp.path().join("model");
    write_model(&dir);
    let model = Model::open(ModelConfig::new(&dir)).unwrap();
    let ex = experts(&model);
    let shard: PathBuf = model.files()[0].path.clone();
    // Cut the file in the middle of the largest expert.
    let f = std::fs::OpenOptions::new().write(true).open(&shard).unwrap();
    f.set_len(ex[0].offset + ex[0].len / 2).unwrap();
    for backend in common::engine_backend_choices() {
        let engine = Engine::new(&model, config(backend, 16, 1 << 20)).unwrap();
        let arena = engine.arena(spec_for(&model, &ex[0]), 1).unwrap();
        let e = engine
            .read(&ex[0], arena.take().unwrap())
            .unwrap()
            .wait()
            .expect_err("read past a truncation");
        assert!(matches!(e, Error::ReadFailed { copies: 1, .. }), "{e:?}");
        let msg = e.to_string();
        assert!(msg.contains(&ex[0].name), "{backend:?}: {msg}");
        assert!(!msg.contains("every copy"), "{backend:?}: {msg}");
        assert!(msg.contains(shard.to_str().unwrap()), "{backend:?}: {msg}");
    }
}
