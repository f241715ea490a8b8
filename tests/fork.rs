//! An engine used in a forked child. The child has copies of the engine,
//! its tickets and arenas, but none of its I/O threads, and (arenas being
//! MADV_DONTFORK) none of the arenas' pages. Every call that would wait for
//! an I/O thread returns `Error::Forked` naming both processes instead;
//! dropping the engine or a ticket in the child neither hangs nor panics.
//! (Before: `wait` hung forever and the engine's drop panicked.)
//!
//! The first test forks from a process whose only other threads are the
//! engine's own; the third forks while parent threads take and return
//! slots of the arenas the child then uses.

mod common;

use std::time::{Duration, Instant};

use weightstream::{BackendChoice, Engine, EngineConfig, Error, Model, ModelConfig, SlotSpec};
use weightstream_synth::SynthSpec;

/// Child exit codes, one per check, so the parent can say which failed.
const OK: i32 = 0;
const READ_NOT_REFUSED: i32 = 10;
const WAIT_NOT_REFUSED: i32 = 11;
const ARENA_NOT_REFUSED: i32 = 12;
const WRONG_ERROR: i32 = 13;
const SLOT_IN_CHILD: i32 = 14;

fn child(
    engine: Engine,
    ticket: weightstream::Ticket,
    arena: &weightstream::Arena,
    t: &weightstream::TensorRef,
    spec: SlotSpec,
) -> i32 {
    // The parent's arena is not mapped here: no slot of it can be had, and
    // the refusal names both processes.
    let parent = std::os::unix::process::parent_id();
    match arena.take() {
        Err(weightstream::TakeError::Forked { parent: p, child: c }) if p == parent && c == std::process::id() => {}
        Err(_) => return WRONG_ERROR,
        Ok(_) => return SLOT_IN_CHILD,
    }
    let forked =
        |e: &Error| matches!(e, Error::Forked { parent: p, child: c } if *p == parent && *c == std::process::id());
    match engine.arena(spec, 1) {
        Err(e) if forked(&e) => {}
        Err(_) => return WRONG_ERROR,
        Ok(_) => return ARENA_NOT_REFUSED,
    }
    match ticket.wait() {
        Err(e) if forked(&e) => {}
        Err(_) => return WRONG_ERROR,
        Ok(_) => return WAIT_NOT_REFUSED,
    }
    // A slot cannot even be had in the child (the arena is not mapped);
    // reading needs one, so read with a slot of a fresh child-local arena.
    let local = weightstream::Arena::new(spec, 1).expect("an arena made in the child");
    match engine.read(t, local.take().unwrap()) {
        Err(e) if forked(&e) => {}
        Err(_) => return WRONG_ERROR,
        Ok(_) => return READ_NOT_REFUSED,
    }
    drop(engine);
    OK
}

#[test]
fn an_engine_in_a_forked_child_refuses_work_and_drops_cleanly() {
    let tmp = common::tempdir();
    let dir = tmp.path().join("model");
    common::synth_model(
        &dir,
        &SynthSpec {
            layers: 1,
            experts: 2,
            expert_bytes: 4 << 20,
            shards: 1,
            ..SynthSpec::default()
        },
    );
    let model = Model::open(ModelConfig::new(&dir)).unwrap();
    let backends = if common::uring_available() {
        vec![BackendChoice::Uring, BackendChoice::Pread]
    } else {
        vec![BackendChoice::Pread]
    };
    for backend in backends {
        let engine = Engine::new(
            &model,
            EngineConfig::default()
                .backend(backend)
                .queue_depth(4096)
                .chunk(Some(4096)),
        )
        .unwrap();
        let t = model
            .tensor("model.layers.0.mlp.experts.0.down_proj.weight")
            .unwrap()
            .clone();
        let spec = SlotSpec::new(t.len as usize).with_align(model.required_align());
        // A big registered arena: fork must not copy it.
        let big = engine.arena(SlotSpec::new(64 << 20), 8).unwrap();
        let arena = engine.arena(spec, 1).unwrap();
        let ticket = engine.read(&t, arena.take().unwrap()).unwrap();
        let t0 = Instant::now();
        // SAFETY: the child runs only this crate's code and `_exit`s; no
        // other thread of this test process holds a lock the child takes
        // (the engine's threads hold none across the fork that the child's
        // refusing paths touch, which is what the test checks).
        let pid = unsafe { libc::fork() };
        assert!(pid >= 0, "fork: {}", std::io::Error::last_os_error());
        if pid == 0 {
            let code = child(engine, ticket, &big, &t, spec);
            // SAFETY: ends the child at once, running no exit handlers.
            unsafe { libc::_exit(code) };
        }
        let fork_time = t0.elapsed();
        let code = exit_code(pid, &format!("{backend:?}: engine use or drop in a forked child"));
        assert_eq!(code, OK, "{backend:?}: child check failed");
        eprintln!(
            "{backend:?}: fork with a {} MiB registered arena took {fork_time:?}",
            8 * 64
        );
        // The parent's engine goes on as before.
        drop(ticket);
        let l = ticket_done(&engine, &model, &t, &arena);
        assert_eq!(l, t.len as usize);
        drop(big);
    }
}

fn ticket_done(engine: &Engine, model: &Model, t: &weightstream::TensorRef, arena: &weightstream::Arena) -> usize {
    let deadline = Instant::now() + Duration::from_secs(60); // a watchdog
    let slot = loop {
        if let Ok(s) = arena.take() {
            break s;
        }
        assert!(Instant::now() < deadline, "the parent's read never finished");
        std::thread::sleep(Duration::from_millis(1));
    };
    let _ = model;
    engine.read(t, slot).unwrap().wait().unwrap().len()
}

/// A stream in a forked child: the next item is `Error::Forked`, then the
/// stream ends (no wait on I/O threads that are not there), and dropping it
/// and an item it yielded in the parent neither hangs nor touches a lock
/// the parent's threads may have held. The parent's stream goes on.
#[test]
fn a_stream_in_a_forked_child_ends_after_one_forked_error() {
    let tmp = common::tempdir();
    let dir = tmp.path().join("model");
    let s = SynthSpec {
        layers: 1,
        experts: 4,
        expert_bytes: 4 << 20,
        shards: 1,
        seed: 0xf0,
        ..SynthSpec::default()
    };
    common::synth_model(&dir, &s);
    let model = Model::open(ModelConfig::new(&dir)).unwrap();
    // Small chunks keep reads in flight across the fork.
    let engine = Engine::new(&model, EngineConfig::default().queue_depth(4).chunk(Some(4096))).unwrap();
    let mut st = engine.stream(model.catalog().tensors(), 64 << 20).unwrap();
    let held = st.next().unwrap().unwrap();
    // SAFETY: the child runs only this crate's refusing paths and `_exit`s.
    let pid = unsafe { libc::fork() };
    assert!(pid >= 0, "fork: {}", std::io::Error::last_os_error());
    if pid == 0 {
        let code = match st.next() {
            Some(Err(Error::Forked { .. })) => match st.next() {
                None => OK,
                Some(_) => 21,
            },
            _ => 20,
        };
        drop(held);
        drop(st);
        // SAFETY: ends the child at once, running no exit handlers.
        unsafe { libc::_exit(code) };
    }
    assert_eq!(exit_code(pid, "a stream in a forked child"), OK, "child check failed");
    assert!(weightstream_synth::verify(s.seed, held.name(), &held));
    let mut n = 1;
    for item in st {
        let l = item.unwrap();
        assert!(weightstream_synth::verify(s.seed, l.name(), &l), "{}", l.name());
        n += 1;
    }
    assert_eq!(n, model.catalog().tensors().len());
}

/// `read_into` in a forked child while a parent thread takes and returns
/// slots of the same arenas at the moment of the fork: on memory lent with
/// `register_memory` and on an engine's own packed arena, every child gets
/// `Error::Forked` at once (before: `read_into` took its slot first, so a
/// child whose parent thread held the arena's lock at fork blocked forever
/// (32 of 40), and on an engine arena it said "overlap a slot in use"),
/// and `take_sized` / `take_for` / `available` in the child lock nothing.
#[test]
fn read_into_in_a_forked_child_is_refused_first_while_a_parent_thread_uses_the_arena() {
    use std::sync::atomic::{AtomicBool, Ordering};
    let tmp = common::tempdir();
    let dir = tmp.path().join("model");
    common::synth_model(
        &dir,
        &SynthSpec {
            layers: 1,
            experts: 2,
            expert_bytes: 64 << 10,
            shards: 1,
            seed: 0xf1,
            ..SynthSpec::default()
        },
    );
    let model = Model::open(ModelConfig::new(&dir)).unwrap();
    let engine = Engine::new(&model, EngineConfig::default()).unwrap();
    let t = model
        .tensor("model.layers.0.mlp.experts.0.down_proj.weight")
        .unwrap()
        .clone();
    let len = 4 << 20;
    let mut lent_mem = vec![0u8; len + 4096];
    let base = lent_mem.as_mut_ptr().wrapping_add(lent_mem.as_ptr().align_offset(4096));
    // SAFETY: `lent_mem` outlives the arena (it is released below before the
    // Vec drops) and nothing else touches it while lent.
    let lent = unsafe { engine.register_memory(std::ptr::NonNull::new(base).unwrap(), len) }.unwrap();
    let own = engine.packed_arena(len, false).unwrap();
    let stop = AtomicBool::new(false);
    let spec = SlotSpec::new(64 << 10);
    std::thread::scope(|scope| {
        for arena in [&lent, &own] {
            let stop = &stop;
            scope.spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    for _ in 0..64 {
                        drop(arena.take_sized(spec));
                    }
                    std::thread::yield_now();
                }
            });
        }
        // The hammers stop when this scope's body ends, by a failed
        // check too (a panic here must not leave the scope waiting on them).
        struct StopOnDrop<'a>(&'a AtomicBool);
        impl Drop for StopOnDrop<'_> {
            fn drop(&mut self) {
                self.0.store(true, Ordering::Relaxed);
            }
        }
        let _stop = StopOnDrop(&stop);
        for round in 0..40 {
            // SAFETY: the child runs only this crate's refusing paths (and the
            // allocator, whose fork handlers keep it usable) and `_exit`s.
            let pid = unsafe { libc::fork() };
            assert!(pid >= 0, "fork: {}", std::io::Error::last_os_error());
            if pid == 0 {
                let parent = std::os::unix::process::parent_id();
                let forked = |r: weightstream::Result<weightstream::Ticket>| matches!(r, Err(Error::Forked { parent: p, .. }) if p == parent);
                let mut code = OK;
                if !forked(engine.read_into(&t, &lent, 4096, weightstream::Scratch::Before)) {
                    code = 30;
                } else if !forked(engine.read_into(&t, &own, 0, weightstream::Scratch::None)) {
                    code = 31;
                } else if !matches!(lent.take_sized(spec), Err(weightstream::TakeError::Forked { parent: p, .. }) if p == parent)
                    || !matches!(own.take_for(&t), Err(weightstream::TakeError::Forked { parent: p, .. }) if p == parent)
                {
                    code = 32;
                } else if lent.available() != 0 || !own.is_empty() {
                    code = 33;
                }
                // SAFETY: ends the child at once, running no exit handlers.
                unsafe { libc::_exit(code) };
            }
            assert_eq!(
                exit_code(pid, &format!("read_into in a forked child (round {round})")),
                OK,
                "round {round}: child check failed"
            );
        }
    });
    // The parent goes on: a read into the lent memory lands.
    let l = engine
        .read_into(&t, &lent, 4096, weightstream::Scratch::Before)
        .unwrap()
        .wait()
        .unwrap();
    assert!(weightstream_synth::verify(0xf1, l.name(), &l));
    drop(l);
    drop(own);
    assert!(lent.release(Duration::from_secs(30)).is_ok());
    drop(lent_mem);
}

/// Waits up to 30 s for child `pid` and returns its exit code; panics
/// (after killing it) when it hangs, and when it dies of a signal. `what`
/// names what the child did.
fn exit_code(pid: libc::pid_t, what: &str) -> i32 {
    let mut status = 0;
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        // SAFETY: waits for our own child; `status` is a valid out-pointer.
        let r = unsafe { libc::waitpid(pid, &mut status, libc::WNOHANG) };
        if r == pid {
            break;
        }
        if Instant::now() > deadline {
            // SAFETY: kills our own child.
            unsafe { libc::kill(pid, libc::SIGKILL) };
            panic!("the child hung ({what})");
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    assert!(
        libc::WIFEXITED(status),
        "the child died abnormally ({what}; status {status:#x})"
    );
    libc::WEXITSTATUS(status)
}

/// `Engine::stats` in a forked child while the parent's I/O threads are
/// busy (reads in flight) and a parent thread takes the stats at the moment
/// of the fork: the child's snapshot takes none of the engine's locks (the
/// registry, each lane's queue, each drive's load), which a parent thread
/// may have held at fork and would never release in the child. Before: it
/// took them all, and a child whose parent thread held one hung forever.
#[test]
fn stats_in_a_forked_child_takes_no_lock_a_parent_thread_may_have_held() {
    use std::sync::atomic::{AtomicBool, Ordering};
    let tmp = common::tempdir();
    let dir = tmp.path().join("model");
    common::synth_model(
        &dir,
        &SynthSpec {
            layers: 1,
            experts: 2,
            expert_bytes: 256 << 10,
            shards: 1,
            seed: 0xf2,
            ..SynthSpec::default()
        },
    );
    let model = Model::open(ModelConfig::new(&dir)).unwrap();
    let engine = Engine::new(&model, EngineConfig::default().chunk(Some(4096))).unwrap();
    let t = model
        .tensor("model.layers.0.mlp.experts.0.down_proj.weight")
        .unwrap()
        .clone();
    let arena = engine
        .arena(SlotSpec::new(t.len as usize).with_align(model.required_align()), 4)
        .unwrap();
    let stop = AtomicBool::new(false);
    let mut hung = Vec::new();
    std::thread::scope(|scope| {
        let (engine, arena, t, stop) = (&engine, &arena, &t, &stop);
        scope.spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                if let Ok(s) = arena.take() {
                    let _ = engine.read(t, s).map(|tk| tk.wait());
                }
            }
        });
        scope.spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                std::hint::black_box(engine.stats());
            }
        });
        struct StopOnDrop<'a>(&'a AtomicBool);
        impl Drop for StopOnDrop<'_> {
            fn drop(&mut self) {
                self.0.store(true, Ordering::Relaxed);
            }
        }
        let _stop = StopOnDrop(stop);
        std::thread::sleep(Duration::from_millis(50));
        for round in 0..40 {
            // SAFETY: the child takes the engine's stats (this crate's code
            // and the allocator, whose fork handlers keep it usable) and
            // `_exit`s.
            let pid = unsafe { libc::fork() };
            assert!(pid >= 0, "fork: {}", std::io::Error::last_os_error());
            if pid == 0 {
                let s = engine.stats();
                let code = if s.drives.is_empty() { 40 } else { OK };
                // SAFETY: ends the child at once, running no exit handlers.
                unsafe { libc::_exit(code) };
            }
            let deadline = Instant::now() + Duration::from_secs(5);
            let mut status = 0;
            loop {
                // SAFETY: waits for our own child; `status` is a valid out-pointer.
                let r = unsafe { libc::waitpid(pid, &mut status, libc::WNOHANG) };
                if r == pid {
                    assert!(
                        libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == OK,
                        "round {round}: {status:#x}"
                    );
                    break;
                }
                if Instant::now() > deadline {
                    // SAFETY: kills our own child.
                    unsafe {
                        libc::kill(pid, libc::SIGKILL);
                        libc::waitpid(pid, &mut status, 0);
                    }
                    hung.push(round);
                    break;
                }
                std::thread::sleep(Duration::from_millis(2));
            }
        }
    });
    assert!(
        hung.is_empty(),
        "Engine::stats hung in the forked child in rounds {hung:?} of 40"
    );
}

/// The VmFlags of the /proc/self/smaps entry that holds `[base, base + len)`
/// (`None` when no one entry holds it all).
fn vm_flags_of(base: usize, len: usize) -> Option<String> {
    let smaps = std::fs::read_to_string("/proc/self/smaps").ok()?;
    let mut inside = false;
    for line in smaps.lines() {
        let first = line.split_whitespace().next().unwrap_or("");
        if let Some((lo, hi)) = first.split_once('-') {
            if let (Ok(lo), Ok(hi)) = (usize::from_str_radix(lo, 16), usize::from_str_radix(hi, 16)) {
                inside = lo <= base && base + len <= hi;
                continue;
            }
        }
        if inside {
            if let Some(flags) = line.strip_prefix("VmFlags:") {
                return Some(flags.trim().to_string());
            }
        }
    }
    None
}

/// Whether `fork()` leaves the pages of `slot` out of a child now
/// (`dc`, VM_DONTCOPY, on the memory area that holds them).
fn kept_from_children(slot: &weightstream::Slot) -> bool {
    let flags = vm_flags_of(slot.base() as usize, slot.len()).expect("the slot is in /proc/self/smaps");
    flags.split_whitespace().any(|f| f == "dc")
}

/// A forked child reads what its parent handed over: a whole-model load
/// (its mapping is handed over whole once its last read has landed) and a
/// read's payload given `Loaded::inherit_on_fork`, byte for byte. A payload
/// not handed over stays out of the child (its pages are `MADV_DONTFORK`):
/// touching it there is a panic naming the cause, not a fault. Before, the
/// child of a loaded model died of SIGSEGV at its first tensor.
#[test]
fn a_forked_child_reads_what_its_parent_handed_over() {
    const LOAD_WRONG: i32 = 50;
    const KEPT_WRONG: i32 = 51;
    const PRIVATE_READ: i32 = 52;
    let tmp = common::tempdir();
    let dir = tmp.path().join("model");
    let s = SynthSpec {
        layers: 2,
        experts: 3,
        expert_bytes: 300_000,
        shards: 2,
        seed: 0xf3,
        ..SynthSpec::default()
    };
    common::synth_model(&dir, &s);
    let model = Model::open(ModelConfig::new(&dir)).unwrap();
    for backend in common::engine_backend_choices() {
        let engine = Engine::new(&model, EngineConfig::default().backend(backend)).unwrap();
        let all = engine.load_all(&weightstream::LoadOptions::new()).unwrap();
        assert!(all.report().inherited_on_fork, "{backend:?}: {:?}", all.report());
        let names: Vec<&str> = model.catalog().tensors().iter().map(|t| t.name.as_str()).collect();
        let (a, b) = (model.tensor(names[0]).unwrap(), model.tensor(names[1]).unwrap());
        let arena = engine.packed_arena(4 << 20, false).unwrap();
        let mut kept = engine.read(a, arena.take_for(a).unwrap()).unwrap().wait().unwrap();
        let private = engine.read(b, arena.take_for(b).unwrap()).unwrap().wait().unwrap();
        assert!(!kept.inherited_on_fork() && !private.inherited_on_fork());
        kept.inherit_on_fork().unwrap();
        assert!(kept.inherited_on_fork());
        assert!(
            !kept_from_children(kept.slot()),
            "{backend:?}: the payload handed over is still MADV_DONTFORK"
        );
        assert!(
            kept_from_children(private.slot()),
            "{backend:?}: a payload not handed over lost its protection"
        );
        // SAFETY: the child reads memory of this test and `_exit`s; the
        // panic it provokes on purpose unwinds only its own frames.
        let pid = unsafe { libc::fork() };
        assert!(pid >= 0, "fork: {}", std::io::Error::last_os_error());
        if pid == 0 {
            let mut code = OK;
            if all.len() != names.len()
                || !all
                    .iter()
                    .all(|t| weightstream_synth::verify(s.seed, t.name(), t.bytes()))
            {
                code = LOAD_WRONG;
            } else if !weightstream_synth::verify(s.seed, kept.name(), &kept) {
                code = KEPT_WRONG;
            } else if std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| private.bytes()[0])).is_ok() {
                code = PRIVATE_READ;
            }
            // SAFETY: ends the child at once, running no exit handlers.
            unsafe { libc::_exit(code) };
        }
        assert_eq!(
            exit_code(pid, &format!("{backend:?}: a child reading its parent's tensors")),
            OK,
            "{backend:?}: child check failed"
        );
        // The parent's payloads are as they were.
        assert!(weightstream_synth::verify(s.seed, private.name(), &private));
        assert!(all
            .iter()
            .all(|t| weightstream_synth::verify(s.seed, t.name(), t.bytes())));
    }
}

/// A slot handed to children is made fork-protected again before the
/// kernel may write it: read into again after `into_slot`, or back in its
/// arena (where the next read may take it). Memory a read may still land
/// in is never shared with a child.
#[test]
fn a_slot_handed_to_children_is_protected_again_before_a_read_can_land_in_it() {
    let tmp = common::tempdir();
    let dir = tmp.path().join("model");
    let s = SynthSpec {
        layers: 1,
        experts: 2,
        expert_bytes: 200_000,
        shards: 1,
        seed: 0xf4,
        ..SynthSpec::default()
    };
    common::synth_model(&dir, &s);
    let model = Model::open(ModelConfig::new(&dir)).unwrap();
    let engine = Engine::new(&model, EngineConfig::default()).unwrap();
    let t = model.catalog().tensors()[0].clone();
    let spec = SlotSpec::new(t.len as usize).with_align(model.required_align());
    let arena = engine.arena(spec, 2).unwrap();
    // Read again into the same slot: protected before the read.
    let mut l = engine.read(&t, arena.take().unwrap()).unwrap().wait().unwrap();
    l.inherit_on_fork().unwrap();
    assert!(!kept_from_children(l.slot()));
    let slot = l.into_slot();
    assert!(!kept_from_children(&slot), "into_slot alone changes nothing");
    let l = engine.read(&t, slot).unwrap().wait().unwrap();
    assert!(
        kept_from_children(l.slot()),
        "read into a slot still shared with children"
    );
    assert!(!l.inherited_on_fork());
    assert!(weightstream_synth::verify(s.seed, l.name(), &l));
    // Back to the arena: protected before anyone can take it.
    let mut l = l;
    l.inherit_on_fork().unwrap();
    let (base, len) = (l.slot().base() as usize, l.slot().len());
    drop(l);
    let flags = vm_flags_of(base, len).unwrap();
    assert!(
        flags.split_whitespace().any(|f| f == "dc"),
        "a free slot shared with children: {flags}"
    );
    let again = arena.take().unwrap();
    assert!(kept_from_children(&again));
}

/// A payload placed at an exact offset (`read_into`, as slices are) may
/// share its first or last page with the bytes around it. Handing it to
/// children claims those bytes while it is inherited (no other slot can
/// be carved there and read into while a child shares the page), and
/// refuses, naming why, when another slot in use already holds them.
#[test]
fn a_payload_sharing_a_page_claims_its_neighbours_or_is_refused() {
    let tmp = common::tempdir();
    let dir = tmp.path().join("model");
    let s = SynthSpec {
        layers: 1,
        experts: 2,
        expert_bytes: 10_000,
        shards: 1,
        seed: 0xf5,
        ..SynthSpec::default()
    };
    common::synth_model(&dir, &s);
    let model = Model::open(ModelConfig::new(&dir)).unwrap();
    let engine = Engine::new(&model, EngineConfig::default()).unwrap();
    let ts = model.catalog().tensors();
    let (a, b) = (&ts[0], &ts[1]);
    let arena = engine.packed_arena(1 << 20, false).unwrap();
    let free0 = arena.available();
    // `a` at byte 100: its first page holds 100 free bytes before it.
    let mut la = engine
        .read_into(a, &arena, 100, weightstream::Scratch::None)
        .unwrap()
        .wait()
        .unwrap();
    assert!(weightstream_synth::verify(s.seed, la.name(), &la));
    la.inherit_on_fork().unwrap();
    let page = 4096;
    let covered = (100 + a.len as usize).next_multiple_of(page);
    assert_eq!(free0 - arena.available(), covered, "the fringe of its pages is claimed");
    let err = engine.read_into(b, &arena, 0, weightstream::Scratch::None).unwrap_err();
    assert!(err.to_string().contains("overlap"), "{err}");
    drop(la);
    assert_eq!(arena.available(), free0, "everything back");
    // A neighbour in use on the same page: refused, nothing changed.
    let held = engine
        .read_into(b, &arena, 0, weightstream::Scratch::None)
        .unwrap()
        .wait()
        .unwrap();
    let at = (b.len as usize) + 8;
    let refusals = engine.stats().arena_inherit_failures;
    let mut la = engine
        .read_into(a, &arena, at, weightstream::Scratch::None)
        .unwrap()
        .wait()
        .unwrap();
    let err = la.inherit_on_fork().unwrap_err();
    assert!(
        matches!(err, Error::ForkAdvice { .. }) && err.to_string().contains("another slot in use"),
        "{err}"
    );
    assert!(!la.inherited_on_fork());
    // Counted (process-wide: other tests may add theirs).
    assert!(engine.stats().arena_inherit_failures > refusals);
    drop((held, la));
    assert_eq!(arena.available(), free0);
}
