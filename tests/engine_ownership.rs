//! Memory the kernel may write is never freed or reused early (DESIGN
//! contract 7), and the engine's ticket API behaves as documented, on both
//! the io_uring and the pread backend:
//!
//! - a ticket dropped while its read is in flight hands the slot back only
//!   once every chunk has landed: at the moment the slot is back, the drive
//!   counters already hold the whole tensor, and a pattern written into the
//!   retaken slot is never overwritten by a late chunk;
//! - dropping the engine waits for every in-flight read: right after the
//!   drop every slot is home, and a ticket that outlived the engine is ready;
//! - `wait`, `try_wait`, `is_ready` and the `Future` impl give the same bytes;
//!   `try_wait` hands the ticket back while the read is in flight; the
//!   future's waker is really called;
//! - a slot of an arena the engine did not make still reads correctly (plain
//!   `Read`), counted per chunk in `drives[].chunks_unregistered`;
//! - a slot too small, a tensor of another model, a shard truncated after
//!   the engine opened it: errors that name the tensor or the file, never a
//!   panic, never short or wrong bytes.
//!
//! Reads are made long on purpose (4 KiB chunks of 4 MiB tensors: about a
//! thousand chunks each), so "in flight" is a window of milliseconds, not a
//! race the test hopes to win. Where a check only proves something when the
//! read really was in flight, the test records that and requires it.

mod common;

use std::path::PathBuf;
use std::pin::pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll, Wake, Waker};
use std::thread::Thread;
use std::time::{Duration, Instant};

use weightstream::__internal::Window;
use weightstream::{Arena, BackendChoice, DirectMode, Engine, EngineConfig, Model, ModelConfig, SlotSpec, TensorRef};
use weightstream_synth::{self as synth, SynthSpec};

const BACKENDS: [BackendChoice; 2] = [BackendChoice::Uring, BackendChoice::Pread];

/// Attempts at catching a read in flight before a check counts as vacuous.
const ATTEMPTS: usize = 8;

struct Fixture {
    _tmp: tempfile::TempDir,
    dir: PathBuf,
    spec: SynthSpec,
    model: Model,
}

impl Fixture {
    /// About 50 MB: 2 layers x 2 experts x 3 projections of ~4 MiB, 2 shards.
    fn new() -> Self {
        let tmp = common::tempdir();
        let dir = tmp.path().join("model");
        let spec = SynthSpec {
            layers: 2,
            experts: 2,
            expert_bytes: 4 << 20,
            shards: 2,
            seed: 0x0a11_0c8e,
            ..SynthSpec::default()
        };
        common::synth_model(&dir, &spec);
        let model = Model::open(ModelConfig::new(&dir)).expect("open the synthetic model");
        Fixture {
            _tmp: tmp,
            dir,
            spec,
            model,
        }
    }

    /// The expert projections (about 4 MiB each), largest first.
    fn experts(&self) -> Vec<TensorRef> {
        let mut v: Vec<TensorRef> = self
            .model
            .catalog()
            .tensors()
            .iter()
            .filter(|t| t.name.contains(".experts."))
            .cloned()
            .collect();
        v.sort_by(|a, b| b.len.cmp(&a.len).then(a.name.cmp(&b.name)));
        assert!(v.len() >= 4 && v[v.len() - 1].len > 4_000_000, "fixture: {v:?}");
        v
    }

    fn spec_for(&self, len: u64) -> SlotSpec {
        SlotSpec::new(len as usize).with_align(self.model.required_align())
    }

    fn verify(&self, t: &TensorRef, bytes: &[u8]) {
        assert_eq!(bytes.len() as u64, t.len, "{}: payload length", t.name);
        assert!(
            synth::verify(self.spec.seed, &t.name, bytes),
            "{}: payload differs from what the writer wrote",
            t.name
        );
    }
}

/// About a thousand 4 KiB chunks per read, all queued at once (the caller
/// never blocks on credits), worked off one at a time by the pread pool.
fn deep(backend: BackendChoice) -> EngineConfig {
    EngineConfig::default()
        .backend(backend)
        .queue_depth(4096)
        .chunk(Some(4096))
}

fn shallow(backend: BackendChoice) -> EngineConfig {
    EngineConfig::default()
        .backend(backend)
        .queue_depth(1)
        .chunk(Some(4096))
}

fn engine(model: &Model, cfg: EngineConfig) -> Engine {
    let want = match cfg.backend {
        BackendChoice::Pread => "pread",
        _ => "uring",
    };
    let e = Engine::new(model, cfg).unwrap_or_else(|e| panic!("Engine::new ({want}): {e}"));
    assert_eq!(e.backend_name(), want);
    e
}

/// Spins (yielding) until `done`; a watchdog of 60 s (generous for a loaded
/// machine) turns a hang into a failure.
fn spin_until(what: &str, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(60);
    while !done() {
        assert!(Instant::now() < deadline, "timed out after 60 s waiting for {what}");
        std::thread::yield_now();
    }
}

const SCRIBBLE: u8 = 0xA5;

/// Takes the (only) slot back, fills it, and checks for a while that no late
/// write from the dropped read lands in it.
fn no_late_write(arena: &Arena, what: &str) {
    let mut slot = arena.take().expect("the slot is back");
    slot.as_bytes_mut().fill(SCRIBBLE);
    std::thread::sleep(Duration::from_millis(20));
    if let Some(i) = slot.as_bytes().iter().position(|&b| b != SCRIBBLE) {
        panic!("{what}: byte {i} of the returned slot was written after it came back");
    }
}

#[test]
fn dropped_ticket_returns_its_slot_only_after_every_chunk_landed() {
    let fx = Fixture::new();
    let experts = fx.experts();
    for backend in BACKENDS {
        for (shape, cfg) in [("qd 1", shallow(backend)), ("qd 4096", deep(backend))] {
            let engine = engine(&fx.model, cfg);
            assert_eq!(engine.chunk_bytes(0), 4096, "the read must be ~1000 chunks long");
            let arena = engine.arena(fx.spec_for(experts[0].len), 1).unwrap();
            let mut dropped_in_flight = 0;
            for attempt in 0..ATTEMPTS {
                let t = &experts[attempt % experts.len()];
                let what = format!("{backend:?} {shape} {}", t.name);
                let before = engine.stats().bytes;
                let ticket = engine.read(t, arena.take().unwrap()).unwrap();
                let was_in_flight = !ticket.is_ready();
                drop(ticket);
                spin_until("the dropped ticket's slot", || arena.available() == 1);
                // The slot is home: every chunk must already have been counted.
                let landed = engine.stats().bytes - before;
                assert_eq!(
                    landed, t.len,
                    "{what}: the slot came back after {landed} of {} payload bytes landed",
                    t.len
                );
                no_late_write(&arena, &what);
                dropped_in_flight += usize::from(was_in_flight);
            }
            if shape == "qd 4096" {
                assert!(
                    dropped_in_flight > 0,
                    "{backend:?} {shape}: no ticket was dropped while its read was in flight"
                );
            }
        }
    }
}

#[test]
fn dropping_the_engine_waits_for_every_in_flight_read() {
    let fx = Fixture::new();
    let experts = fx.experts();
    const N: usize = 4;
    for backend in BACKENDS {
        let mut proved = false;
        for _ in 0..ATTEMPTS {
            let engine = engine(&fx.model, deep(backend));
            let arena = engine.arena(fx.spec_for(experts[0].len), N).unwrap();
            let tickets: Vec<_> = experts[..N]
                .iter()
                .map(|t| engine.read(t, arena.take().unwrap()).unwrap())
                .collect();
            let in_flight = tickets.iter().filter(|t| !t.is_ready()).count();
            drop(tickets);
            drop(engine);
            // No waiting here: the drop itself must have drained the drives.
            assert_eq!(
                arena.available(),
                N,
                "{backend:?}: the engine was dropped with slots still owned by reads ({in_flight} were in flight)"
            );
            no_late_write_many(&arena);
            if in_flight > 0 {
                proved = true;
                break;
            }
        }
        assert!(proved, "{backend:?}: no read was in flight when the engine was dropped");
    }
}

/// Like [`no_late_write`] for every slot of a many-slot arena at once.
fn no_late_write_many(arena: &Arena) {
    let mut slots: Vec<_> = std::iter::from_fn(|| arena.take().ok()).collect();
    for s in &mut slots {
        s.as_bytes_mut().fill(SCRIBBLE);
    }
    std::thread::sleep(Duration::from_millis(10));
    for s in &slots {
        assert!(
            s.as_bytes().iter().all(|&b| b == SCRIBBLE),
            "slot {} written after the engine was dropped",
            s.index()
        );
    }
}

#[test]
fn a_ticket_that_outlives_its_engine_is_complete() {
    let fx = Fixture::new();
    let experts = fx.experts();
    for backend in BACKENDS {
        let engine = engine(&fx.model, deep(backend));
        let arena = engine.arena(fx.spec_for(experts[0].len), 2).unwrap();
        let t0 = engine.read(&experts[0], arena.take().unwrap()).unwrap();
        let t1 = engine.read(&experts[1], arena.take().unwrap()).unwrap();
        drop(engine);
        assert!(
            t0.is_ready() && t1.is_ready(),
            "{backend:?}: engine drop left a read unfinished"
        );
        let l1 = t1.wait().unwrap_or_else(|e| panic!("{backend:?}: {e}"));
        fx.verify(&experts[1], &l1);
        let l0 = match t0.try_wait() {
            Ok(r) => r.unwrap_or_else(|e| panic!("{backend:?}: {e}")),
            Err(_) => panic!("{backend:?}: try_wait on a ready ticket handed it back"),
        };
        fx.verify(&experts[0], &l0);
    }
}

/// Wakes the blocked thread and counts how often the waker was used.
struct Unparker {
    thread: Thread,
    wakes: AtomicUsize,
}

impl Wake for Unparker {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }
    fn wake_by_ref(self: &Arc<Self>) {
        self.wakes.fetch_add(1, Ordering::SeqCst);
        self.thread.unpark();
    }
}

struct Polled<T> {
    out: T,
    pending: usize,
    wakes: usize,
}

/// Minimal executor: polls `f` on this thread, parking between polls. A
/// park times out after 2 s, so a future that never wakes still finishes
/// (and the caller sees `wakes == 0`).
fn block_on<F: std::future::Future>(f: F) -> Polled<F::Output> {
    let mut f = pin!(f);
    let unparker = Arc::new(Unparker {
        thread: std::thread::current(),
        wakes: AtomicUsize::new(0),
    });
    let waker = Waker::from(Arc::clone(&unparker));
    let mut cx = Context::from_waker(&waker);
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut pending = 0;
    loop {
        if let Poll::Ready(out) = f.as_mut().poll(&mut cx) {
            return Polled {
                out,
                pending,
                wakes: unparker.wakes.load(Ordering::SeqCst),
            };
        }
        pending += 1;
        assert!(Instant::now() < deadline, "future still pending after 30 s");
        std::thread::park_timeout(Duration::from_secs(2));
    }
}

#[test]
fn wait_try_wait_is_ready_and_future_give_the_same_bytes() {
    let fx = Fixture::new();
    let experts = fx.experts();
    for backend in BACKENDS {
        let engine = engine(&fx.model, deep(backend));
        let arena = engine.arena(fx.spec_for(experts[0].len), 1).unwrap();
        let mut future_pending = 0;
        let mut try_wait_pending = 0;
        for attempt in 0..ATTEMPTS {
            let t = &experts[attempt % experts.len()];
            let what = format!("{backend:?} {}", t.name);

            // wait()
            let loaded = engine.read(t, arena.take().unwrap()).unwrap().wait().unwrap();
            fx.verify(t, &loaded);
            let by_wait = loaded.to_vec();
            drop(loaded);

            // .await on a hand-rolled executor; polling it again after it
            // completed is an error, not a panic.
            let mut ticket = engine.read(t, arena.take().unwrap()).unwrap();
            let polled = block_on(&mut ticket);
            let loaded = polled.out.unwrap_or_else(|e| panic!("{what}: future: {e}"));
            assert!(loaded[..] == by_wait[..], "{what}: future and wait() bytes differ");
            if polled.pending > 0 {
                assert!(
                    polled.wakes > 0,
                    "{what}: future was pending but its waker was never called"
                );
                future_pending += 1;
            }
            let again = block_on(&mut ticket);
            assert_eq!(again.pending, 0);
            assert!(
                again.out.is_err(),
                "{what}: a completed ticket polled again must be an error"
            );
            drop((loaded, ticket));

            // try_wait() / is_ready()
            let mut ticket = engine.read(t, arena.take().unwrap()).unwrap();
            let deadline = Instant::now() + Duration::from_secs(60);
            let loaded = loop {
                let ready = ticket.is_ready();
                match ticket.try_wait() {
                    Ok(r) => break r.unwrap_or_else(|e| panic!("{what}: try_wait: {e}")),
                    Err(back) => {
                        assert!(
                            !ready,
                            "{what}: is_ready() said ready but try_wait() handed the ticket back"
                        );
                        try_wait_pending += 1;
                        ticket = back;
                    }
                }
                assert!(Instant::now() < deadline, "{what}: try_wait never ready");
                std::thread::yield_now();
            };
            assert!(loaded[..] == by_wait[..], "{what}: try_wait and wait() bytes differ");
        }
        assert!(future_pending > 0, "{backend:?}: the future was never pending");
        assert!(try_wait_pending > 0, "{backend:?}: try_wait never handed a ticket back");
    }
}

/// Chunks `engine` issues for `t` into a slot of `spec` (the window the
/// contract fixes, cut at the engine's chunk size).
fn chunks_for(engine: &Engine, model: &Model, t: &TensorRef, spec: SlotSpec) -> u64 {
    let f = &model.files()[t.shard];
    let w = Window::plan(t.offset, t.len, f.size, spec.align as u64, spec.tail_room).unwrap();
    let c = engine.chunk_bytes(f.drive);
    (w.direct.div_ceil(c) + w.tail.div_ceil(c)) as u64
}

fn unregistered(engine: &Engine) -> u64 {
    engine.stats().drives.iter().map(|d| d.chunks_unregistered).sum()
}

#[test]
fn slot_of_an_arena_the_engine_did_not_make_reads_and_is_counted() {
    let fx = Fixture::new();
    let mut tensors = fx.experts();
    // Small ones too (a chunk or two, partly or wholly buffered), on both shards.
    tensors.extend(
        fx.model
            .catalog()
            .tensors()
            .iter()
            .filter(|t| !t.name.contains(".experts."))
            .cloned(),
    );
    let cfg = EngineConfig::default()
        .backend(BackendChoice::Uring)
        .chunk(Some(1 << 20));
    let engine = engine(&fx.model, cfg);
    let spec = fx.spec_for(tensors[0].len);
    let registered = engine.arena(spec, 1).unwrap();
    let root = rustix::process::geteuid().is_root();
    // The engine's spec, and one it would never make (512-byte scratch, tail
    // room), so windows start off 4096 boundaries.
    for spec in [spec, SlotSpec::new(spec.capacity).with_align(512).with_tail_room(true)] {
        let foreign = Arena::new(spec, 1).unwrap();
        for t in &tensors {
            let what = format!("{} in a foreign {spec:?}", t.name);
            let before = unregistered(&engine);
            let before_choice: u64 = engine.stats().drives.iter().map(|d| d.chunks_unregistered_arena).sum();
            let loaded = engine.read(t, foreign.take().unwrap()).unwrap().wait().unwrap();
            fx.verify(t, &loaded);
            drop(loaded);
            let want = chunks_for(&engine, &fx.model, t, spec);
            assert!(want > 0);
            assert_eq!(
                unregistered(&engine) - before,
                want,
                "{what}: every chunk into the foreign arena is counted unregistered"
            );
            let by_choice: u64 = engine.stats().drives.iter().map(|d| d.chunks_unregistered_arena).sum();
            assert_eq!(
                by_choice - before_choice,
                want,
                "{what}: an arena nobody asked to register: by choice, not a fallback"
            );
        }
        assert_eq!(foreign.available(), 1);
    }
    if root {
        // The engine's own arena is registered: nothing counted.
        for t in &tensors {
            let before = unregistered(&engine);
            let loaded = engine.read(t, registered.take().unwrap()).unwrap().wait().unwrap();
            fx.verify(t, &loaded);
            assert_eq!(unregistered(&engine), before, "{}: registered arena", t.name);
        }
    }
}

#[test]
fn slot_too_small_is_an_error_naming_the_tensor() {
    let fx = Fixture::new();
    let t = &fx.experts()[0];
    for backend in BACKENDS {
        let engine = engine(&fx.model, deep(backend));
        let arena = engine.arena(fx.spec_for(t.len - 1), 1).unwrap();
        let err = engine
            .read(t, arena.take().unwrap())
            .expect_err("a slot one byte too small must be refused");
        let msg = err.to_string();
        assert!(
            msg.contains(&t.name),
            "{backend:?}: error does not name the tensor: {msg}"
        );
        assert!(msg.contains("too small"), "{backend:?}: {msg}");
        assert_eq!(arena.available(), 1, "{backend:?}: the refused slot went home");
        // The engine still works afterwards.
        let big = engine.arena(fx.spec_for(t.len), 1).unwrap();
        fx.verify(t, &engine.read(t, big.take().unwrap()).unwrap().wait().unwrap());
    }
}

/// A second model with another layout and seed: 4 shards (so some of its
/// tensors name a shard index the fixture does not have) and small tensors
/// at offsets that fall inside the fixture's shards.
fn other_model(fx: &Fixture) -> (tempfile::TempDir, Model) {
    let tmp = common::tempdir();
    let spec = SynthSpec {
        layers: 4,
        experts: 1,
        expert_bytes: 64 << 10,
        shards: 4,
        seed: fx.spec.seed ^ 0xffff,
        ..SynthSpec::default()
    };
    common::synth_model(tmp.path(), &spec);
    let m = Model::open(ModelConfig::new(tmp.path())).unwrap();
    (tmp, m)
}

#[test]
fn tensor_of_another_model_with_a_shard_this_model_lacks_is_an_error() {
    let fx = Fixture::new();
    let (_tmp, other) = other_model(&fx);
    let n = fx.model.files().len();
    let foreign: Vec<&TensorRef> = other.catalog().tensors().iter().filter(|t| t.shard >= n).collect();
    assert!(!foreign.is_empty());
    for backend in BACKENDS {
        let engine = engine(&fx.model, deep(backend));
        let arena = engine.arena(fx.spec_for(1 << 20), 1).unwrap();
        for t in &foreign {
            let r = engine.read(t, arena.take().unwrap()).and_then(|tk| tk.wait());
            let err = r.expect_err("a tensor of another model must be refused");
            assert!(
                err.to_string().contains(&t.name),
                "{backend:?}: error does not name {}: {err}",
                t.name
            );
            assert_eq!(arena.available(), 1);
        }
    }
}

#[test]
fn tensor_of_another_model_inside_this_models_shards_is_an_error_not_wrong_bytes() {
    let fx = Fixture::new();
    let (_tmp, other) = other_model(&fx);
    let mine = fx.model.catalog();
    // Tensors of the other model whose shard index and byte range exist in
    // this one: nothing but the catalog can tell they are foreign.
    let foreign: Vec<&TensorRef> = other
        .catalog()
        .tensors()
        .iter()
        .filter(|t| t.shard < fx.model.files().len() && t.offset + t.len <= fx.model.files()[t.shard].size)
        .filter(|t| mine.tensor(&t.name).map_or(true, |m| m != *t))
        .collect();
    assert!(!foreign.is_empty());
    for backend in BACKENDS {
        let engine = engine(&fx.model, deep(backend));
        let arena = engine.arena(fx.spec_for(1 << 20), 1).unwrap();
        for t in &foreign {
            match engine.read(t, arena.take().unwrap()).and_then(|tk| tk.wait()) {
                Err(e) => assert!(e.to_string().contains(&t.name), "{backend:?}: {e}"),
                Ok(l) => panic!(
                    "{backend:?}: {} of another model was read from this model's {} ({} bytes; they are {} the other model's bytes)",
                    t.name,
                    fx.model.files()[t.shard].path.display(),
                    l.len(),
                    if synth::verify(fx.spec.seed ^ 0xffff, &t.name, &l) {
                        "equal to"
                    } else {
                        "not"
                    }
                ),
            }
            assert_eq!(arena.available(), 1);
        }
    }
}

#[test]
fn shard_truncated_after_the_engine_opened_it_is_an_error_naming_the_file() {
    truncated_shard();
}

/// `Engine::read` documents that on error the slot "goes back to its
/// arena". Once `try_wait()`/`wait()` has handed out the error every chunk
/// has completed, so nothing stands in the way of the slot being home by
/// then; a caller with a one-slot arena that retries at once must find it.
#[test]
fn failed_read_slot_is_home_when_the_error_is_returned() {
    let fx = Fixture::new();
    let mut on_shard: Vec<TensorRef> = fx
        .model
        .catalog()
        .tensors()
        .iter()
        .filter(|t| t.shard == 1)
        .cloned()
        .collect();
    on_shard.sort_by_key(|t| t.offset);
    let last = on_shard.pop().unwrap();
    let engines: Vec<Engine> = BACKENDS
        .iter()
        .map(|&b| {
            let cfg = deep(b).chunk(Some(1 << 20));
            engine(&fx.model, cfg)
        })
        .collect();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&fx.model.files()[1].path)
        .unwrap()
        .set_len(last.offset + 100)
        .unwrap();
    for engine in &engines {
        let arena = engine.arena(fx.spec_for(last.len), 1).unwrap();
        let mut not_home = 0;
        for i in 0..50 {
            let mut ticket = engine.read(&last, arena.take().unwrap()).unwrap();
            let r = if i % 2 == 0 {
                ticket.wait()
            } else {
                loop {
                    match ticket.try_wait() {
                        Ok(r) => break r,
                        Err(t) => ticket = t,
                    }
                }
            };
            assert!(r.is_err(), "{}: a read past the cut must fail", last.name);
            not_home += usize::from(arena.available() != 1);
            spin_until("a failed read's slot", || arena.available() == 1);
        }
        assert_eq!(
            not_home,
            0,
            "{}: {not_home} of 50 failed reads returned the error before the slot was home",
            engine.backend_name()
        );
    }
}

/// Truncates a shard under engines of every backend and direct mode, then
/// reads every expert of it.
fn truncated_shard() {
    let fx = Fixture::new();
    // Engines over every backend and direct mode, opened before the damage
    // (a model refuses a truncated shard at open).
    let mut engines = Vec::new();
    for backend in BACKENDS {
        for mode in [DirectMode::Auto, DirectMode::Off] {
            let model = Model::open(ModelConfig::new(&fx.dir).direct(mode)).unwrap();
            let e = engine(&model, deep(backend));
            engines.push((format!("{backend:?} direct {mode:?}"), model, e));
        }
    }
    // Cut shard 1 inside one of its experts: that one straddles the new end
    // of file, the ones after it are wholly past it, the ones before intact.
    let shard = 1;
    let mut on_shard: Vec<TensorRef> = fx
        .model
        .catalog()
        .tensors()
        .iter()
        .filter(|t| t.shard == shard && t.name.contains(".experts."))
        .cloned()
        .collect();
    on_shard.sort_by_key(|t| t.offset);
    assert!(on_shard.len() >= 3);
    let cut_in = &on_shard[on_shard.len() / 2];
    let cut = cut_in.offset + cut_in.len / 2 + 777; // off any block boundary
    let path = fx.model.files()[shard].path.clone();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&path)
        .unwrap()
        .set_len(cut)
        .unwrap();
    let spec = fx.spec_for(on_shard.iter().map(|t| t.len).max().unwrap());
    let mut failed = 0;
    for (what, model, engine) in &engines {
        let arena = engine.arena(spec, 1).unwrap();
        for t in &on_shard {
            let r = engine.read(t, arena.take().unwrap()).and_then(|tk| tk.wait());
            if t.offset + t.len <= cut {
                let l = r.unwrap_or_else(|e| panic!("{what}: {} lies before the cut: {e}", t.name));
                fx.verify(t, &l);
                continue;
            }
            match r {
                Ok(l) => panic!(
                    "{what}: {} ({}..{}) read {} bytes from a file cut at {cut}",
                    t.name,
                    t.offset,
                    t.offset + t.len,
                    l.len()
                ),
                Err(e) => {
                    let msg = e.to_string();
                    let named = model.files()[shard].path.display().to_string();
                    assert!(
                        msg.contains(&named),
                        "{what}: {}: error does not name {named}: {msg}",
                        t.name
                    );
                }
            }
            failed += 1;
            // Home soon (at once is `failed_read_slot_is_home_when_the_error_is_returned`).
            spin_until("a failed read's slot", || arena.available() == 1);
        }
    }
    assert!(
        failed >= 2 * engines.len(),
        "the cut must fail a straddling and a later tensor"
    );
}
