//! Whole-model loads (`Engine::load_all`) and streaming loads
//! (`Engine::stream`): every payload is the reference reader's (the
//! reference writer's shards have odd sizes and unaligned offsets, so both
//! the in-place and the placed paths run), aligned as promised, on both
//! backends; filters, order and progress; the stream's staging budget.

mod common;

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use weightstream::{
    BackendChoice, Engine, EngineConfig, Error, LoadOptions, LoadProgress, Loaded, Model, ModelConfig, Order, TensorRef,
};
use weightstream_synth::{self as synth, SynthSpec};

fn engine(model: &Model, backend: BackendChoice) -> Engine {
    Engine::new(model, EngineConfig::default().backend(backend)).unwrap()
}

/// The reference model (or, without Python's reference, a synthetic one)
/// and name -> sha256 of each payload as the reference reader (or the
/// one-read-at-a-time sync path) returns it.
fn reference_model(dir: &std::path::Path) -> (Model, BTreeMap<String, String>) {
    let sums = common::reference_or_synth(dir);
    let model = Model::open(ModelConfig::new(dir)).unwrap();
    let sums = sums.unwrap_or_else(|| {
        let arena = weightstream::Arena::new(
            weightstream::SlotSpec::new(model.catalog().tensors().iter().map(|t| t.len).max().unwrap() as usize + 1),
            1,
        )
        .unwrap();
        model
            .catalog()
            .tensors()
            .iter()
            .map(|t| {
                let l = model.read_sync(t, arena.take().unwrap()).unwrap();
                (t.name.clone(), common::sha256_hex(&l))
            })
            .collect()
    });
    (model, sums)
}

fn element_size(t: &TensorRef) -> usize {
    ((t.dtype.bits() / 8).max(1) as usize).next_power_of_two()
}

#[test]
fn load_all_gives_the_reference_bytes_aligned_for_each_dtype_on_every_backend() {
    let tmp = common::tempdir();
    let dir = tmp.path().join("m");
    let (model, sums) = reference_model(&dir);
    let tensors = model.catalog().tensors();
    let misaligned = tensors
        .iter()
        .filter(|t| t.len > 0 && !(t.offset % 4096).is_multiple_of(element_size(t) as u64))
        .count();
    for backend in common::engine_backend_choices() {
        // The fault-ahead helper racing the reads (on) must change no byte.
        // (alignment, fault ahead, helpers: None for the default count)
        for (align, ahead, helpers) in [
            (0usize, true, None),
            (0, false, None),
            (64, true, None),
            (4096, false, None),
            // Several helpers, each faulting every third 32 MiB piece.
            (0, true, Some(3)),
        ] {
            let e = engine(&model, backend);
            // The drives' counters are the model's: compare deltas.
            // A placed payload goes O_DIRECT through staging and one copy
            // (counted staged; where the file system refuses O_DIRECT it
            // goes buffered, counted as that refusal).
            let placed_stat = |e: &Engine| -> u64 { e.stats().staged.reads };
            let placed_before = placed_stat(&e);
            let mut opts = LoadOptions::new().align(align).fault_ahead(ahead);
            if let Some(n) = helpers {
                opts = opts.fault_ahead_threads(n);
            }
            let all = e.load_all(&opts).unwrap();
            assert_eq!(all.report().faulted_ahead, ahead);
            assert_eq!(all.report().faulted_ahead, all.report().fault_ahead_threads > 0);
            if let Some(n) = helpers {
                assert_eq!(all.report().fault_ahead_threads, n);
            }
            // Linux >= 5.14 (MADV_POPULATE_WRITE): the helper never gave up.
            assert_eq!(all.report().fault_ahead_refused, None);
            assert_eq!(all.len(), tensors.len());
            assert_eq!(all.total_bytes(), model.catalog().total_bytes());
            let names: Vec<&str> = all.iter().map(|t| t.name()).collect();
            let want: Vec<&str> = tensors.iter().map(|t| t.name.as_str()).collect();
            assert_eq!(names, want, "iteration is in the model's name order");
            for t in tensors {
                let v = all.get(&t.name).unwrap();
                assert_eq!(
                    common::sha256_hex(v.bytes()),
                    sums[&t.name],
                    "{backend:?} align {align}: {}",
                    t.name
                );
                assert_eq!((v.dtype(), v.shape()), (t.dtype, &t.shape[..]));
                if t.len > 0 {
                    let a = element_size(t).max(align);
                    assert_eq!(
                        v.bytes().as_ptr() as usize % a,
                        0,
                        "{backend:?}: {} not {a}-aligned",
                        t.name
                    );
                }
            }
            let r = all.report();
            let empty = tensors.iter().filter(|t| t.len == 0).count();
            assert_eq!(r.in_place + r.placed + empty, tensors.len(), "{r:?}");
            if align == 0 {
                assert_eq!(
                    r.placed, misaligned,
                    "only payloads misaligned for their dtype are placed"
                );
            }
            // Every placed payload is counted as such in the stats.
            if common::fs_reads_o_direct(&dir) {
                assert_eq!(
                    placed_stat(&e) - placed_before,
                    r.placed as u64,
                    "{backend:?} align {align}"
                );
            }
            assert!(r.mapped_bytes >= r.bytes as usize && r.mapped_bytes.is_multiple_of(4096));
        }
    }
}

#[test]
fn the_reference_model_exercises_both_the_in_place_and_the_placed_path() {
    let tmp = common::tempdir();
    let dir = tmp.path().join("m");
    if common::reference_digests(&dir).is_none() {
        return; // SKIP printed by the helper
    }
    let model = Model::open(ModelConfig::new(&dir)).unwrap();
    let r = engine(&model, BackendChoice::Auto)
        .load_all(&LoadOptions::new().align(64))
        .unwrap()
        .report()
        .clone();
    assert!(r.in_place > 0 && r.placed > 0, "{r:?}");
}

#[test]
fn filters_order_and_progress() {
    let tmp = common::tempdir();
    let dir = tmp.path().join("m");
    let s = SynthSpec {
        layers: 3,
        experts: 3,
        expert_bytes: 200_000,
        shards: 2,
        seed: 0x10ad,
        ..SynthSpec::default()
    };
    common::synth_model(&dir, &s);
    let model = Model::open(ModelConfig::new(&dir)).unwrap();
    let e = engine(&model, BackendChoice::Auto);

    // Names: substring match, and a predicate on top.
    let some = e
        .load_all(&LoadOptions::new().names_containing(["layers.1.", "embed"]))
        .unwrap();
    assert!(!some.is_empty());
    for t in &some {
        assert!(
            t.name().contains("layers.1.") || t.name().contains("embed"),
            "{}",
            t.name()
        );
        assert!(synth::verify(s.seed, t.name(), t.bytes()), "{}", t.name());
    }
    let want = model
        .catalog()
        .tensors()
        .iter()
        .filter(|t| t.name.contains("layers.1.") || t.name.contains("embed"))
        .count();
    assert_eq!(some.len(), want);
    let experts_only = e
        .load_all(
            &LoadOptions::new()
                .names_containing(["layers.1."])
                .filter(|t| t.name.contains(".experts.")),
        )
        .unwrap();
    assert_eq!(experts_only.len(), 3 * 3, "3 experts x gate, up, down");
    // An empty selection is an error naming the filter, never a load of nothing.
    let none = e
        .load_all(&LoadOptions::new().names_containing(["no such"]))
        .unwrap_err()
        .to_string();
    assert!(
        none.contains("no tensor selected") && none.contains("names_containing [\"no such\"]"),
        "{none}"
    );
    let none = e
        .load_all(&LoadOptions::new().filter(|_| false))
        .unwrap_err()
        .to_string();
    assert!(none.contains("no tensor selected by LoadOptions::filter"), "{none}");
    let none: Vec<&weightstream::TensorRef> = Vec::new();
    let err = e.stream(none, 1 << 20).map(|_| ()).unwrap_err().to_string();
    assert!(err.contains("stream: no tensor given"), "{err}");

    // Largest first, with progress on this thread, monotone, ending at the total.
    let seen: Arc<Mutex<Vec<LoadProgress>>> = Arc::default();
    let me = std::thread::current().id();
    let s2 = Arc::clone(&seen);
    let all = e
        .load_all(&LoadOptions::new().order(Order::Size).progress(move |p| {
            assert_eq!(std::thread::current().id(), me, "progress runs on the caller's thread");
            s2.lock().unwrap().push(*p);
        }))
        .unwrap();
    assert_eq!(all.report().order, Order::Size);
    for t in &all {
        assert!(synth::verify(s.seed, t.name(), t.bytes()), "{}", t.name());
    }
    let seen = seen.lock().unwrap();
    assert_eq!(seen.len(), all.len() + 1, "once at the start, then once per tensor");
    assert_eq!((seen[0].bytes, seen[0].tensors), (0, 0));
    assert!(seen
        .windows(2)
        .all(|w| w[0].bytes <= w[1].bytes && w[0].tensors + 1 == w[1].tensors));
    let last = seen.last().unwrap();
    assert_eq!((last.bytes, last.tensors), (last.total_bytes, last.total_tensors));
    assert_eq!(last.total_bytes, model.catalog().total_bytes());

    // The tensors outlive the LoadedModel as owned results.
    let owned: Vec<Loaded> = all.into_loaded();
    assert_eq!(owned.len(), model.catalog().tensors().len());
    assert!(owned.iter().all(|l| synth::verify(s.seed, l.name(), l)));
}

#[test]
fn a_window_of_one_byte_still_loads_everything() {
    let tmp = common::tempdir();
    let dir = tmp.path().join("m");
    let s = common::small_synth_spec();
    common::synth_model(&dir, &s);
    let model = Model::open(ModelConfig::new(&dir)).unwrap();
    for backend in common::engine_backend_choices() {
        let e = engine(&model, backend);
        let all = e
            .load_all(&LoadOptions::new().window(1).populate(true).register(true))
            .unwrap();
        assert!(all.report().populated);
        // Registered says what happened: with rings, unless refused.
        let refused = e
            .warnings()
            .iter()
            .any(|w| w.kind == weightstream::WarningKind::BuffersUnregistered);
        assert_eq!(
            all.report().registered,
            e.stats().backend == "uring" && !refused,
            "{backend:?}"
        );
        for t in &all {
            assert!(synth::verify(s.seed, t.name(), t.bytes()), "{backend:?} {}", t.name());
        }
    }
}

#[test]
fn bad_alignments_are_refused() {
    let tmp = common::tempdir();
    let dir = tmp.path().join("m");
    common::synth_model(&dir, &common::small_synth_spec());
    let model = Model::open(ModelConfig::new(&dir)).unwrap();
    let e = engine(&model, BackendChoice::Auto);
    for a in [3usize, 96, 8192] {
        match e.load_all(&LoadOptions::new().align(a)) {
            Err(Error::Config(m)) => assert!(m.contains(&a.to_string()), "{m}"),
            other => panic!("align {a}: {other:?}"),
        }
    }
}

/// Every tensor through a staging budget that holds about two of the
/// largest: each item is the reference's bytes, and the staging memory in
/// use never exceeds the budget.
#[test]
fn a_stream_yields_every_tensor_within_its_budget_on_every_backend() {
    let tmp = common::tempdir();
    let dir = tmp.path().join("m");
    let (model, sums) = reference_model(&dir);
    let tensors = model.catalog().tensors();
    let largest = tensors.iter().map(|t| t.len).max().unwrap() as usize;
    for backend in common::engine_backend_choices() {
        let e = engine(&model, backend);
        let budget = 2 * (largest + 8192);
        let mut st = e.stream(tensors, budget).unwrap();
        assert_eq!(st.remaining(), tensors.len());
        let mut got = BTreeMap::new();
        while let Some(item) = st.next() {
            let l = item.unwrap();
            assert!(st.free_bytes() <= st.budget());
            got.insert(l.name().to_string(), common::sha256_hex(&l));
        }
        assert_eq!(got, sums, "{backend:?}");
        assert_eq!(st.free_bytes(), st.budget(), "every slot came back");
    }
}

#[test]
fn a_stream_of_parts_of_tensors_gives_their_bytes() {
    let tmp = common::tempdir();
    let dir = tmp.path().join("m");
    let s = common::small_synth_spec();
    common::synth_model(&dir, &s);
    let model = Model::open(ModelConfig::new(&dir)).unwrap();
    let parts: Vec<TensorRef> = model
        .catalog()
        .tensors()
        .iter()
        .filter(|t| t.len >= 10_000)
        .map(|t| t.byte_range(1234..t.len - 777).unwrap())
        .collect();
    assert!(!parts.is_empty());
    for backend in common::engine_backend_choices() {
        let e = engine(&model, backend);
        let mut n = 0;
        for item in e.stream(&parts, 1 << 20).unwrap() {
            let l = item.unwrap();
            let whole = model.tensor(l.name()).unwrap();
            let mut want = vec![0u8; l.len()];
            synth::fill(s.seed, l.name(), 1234, &mut want);
            assert_eq!(l.len() as u64, whole.len - 1234 - 777);
            assert!(l[..] == want[..], "{backend:?}: {}", l.name());
            n += 1;
        }
        assert_eq!(n, parts.len());
    }
}

#[test]
fn a_stream_whose_items_are_held_says_so_instead_of_waiting_forever() {
    let tmp = common::tempdir();
    let dir = tmp.path().join("m");
    let s = SynthSpec {
        layers: 1,
        experts: 4,
        expert_bytes: 100_000,
        shards: 1,
        seed: 7,
        ..SynthSpec::default()
    };
    common::synth_model(&dir, &s);
    let model = Model::open(ModelConfig::new(&dir)).unwrap();
    let e = engine(&model, BackendChoice::Auto);
    let experts: Vec<TensorRef> = model
        .catalog()
        .tensors()
        .iter()
        .filter(|t| t.name.contains(".experts."))
        .cloned()
        .collect();
    // Room for one expert's slot at a time.
    let budget = (experts[0].len as usize + 4096).next_multiple_of(4096);
    let mut st = e.stream(&experts, budget).unwrap();
    let first = st.next().unwrap().unwrap();
    match st.next() {
        Some(Err(Error::Config(m))) => assert!(m.contains("no room") && m.contains(&experts[1].name), "{m}"),
        other => panic!("{other:?}"),
    }
    // That tensor left the stream with its error: an item per tensor, so
    // even a caller that keeps every item sees the stream end.
    assert_eq!(st.remaining(), experts.len() - 2);
    drop(first);
    // Dropping the held item frees its room: the stream goes on.
    let mut n = 2;
    for item in st.by_ref() {
        let l = item.unwrap();
        assert!(synth::verify(s.seed, l.name(), &l));
        n += 1;
    }
    assert_eq!(n, experts.len());
    // The refused tensor streams again once there is room.
    let again: Vec<Loaded> = e.stream(&experts[1..2], budget).unwrap().map(Result::unwrap).collect();
    assert!(again.len() == 1 && synth::verify(s.seed, again[0].name(), &again[0]));

    // A caller that keeps everything (collecting) still gets an end: one
    // item per tensor, payloads or errors.
    let all: Vec<weightstream::Result<Loaded>> = e.stream(&experts, budget).unwrap().collect();
    assert_eq!(all.len(), experts.len());
    assert!(all[0].is_ok() && all[1..].iter().all(|r| r.is_err()));
    drop(all);

    // A hand-edited reference is refused before any arithmetic on it.
    let mut huge = experts[0].clone();
    huge.len = u64::MAX;
    assert!(e.stream([&huge], budget).is_err());

    // A tensor larger than the whole budget is refused up front, by name.
    match e.stream(&experts, 4096) {
        Err(Error::Config(m)) => assert!(m.contains(&experts[0].name) && m.contains("budget"), "{m}"),
        other => panic!("{other:?}"),
    }
    assert!(matches!(e.stream(&experts, 0), Err(Error::Config(_))));
}

/// Dropped with reads in flight (on a drive slow enough that they are): no
/// hang, and the engine goes on reading correctly afterwards.
#[test]
fn a_stream_dropped_with_reads_in_flight_is_safe() {
    let tmp = common::tempdir();
    let dir = tmp.path().join("m");
    let s = SynthSpec {
        layers: 2,
        experts: 8,
        expert_bytes: 1 << 20,
        shards: 2,
        seed: 0xd0,
        ..SynthSpec::default()
    };
    common::synth_model(&dir, &s);
    let model = Model::open(ModelConfig::new(&dir)).unwrap();
    for backend in common::engine_backend_choices() {
        let e = engine(&model, backend);
        let tensors = model.catalog().tensors();
        for _ in 0..5 {
            let mut st = e.stream(tensors, 16 << 20).unwrap();
            let one = st.next().unwrap().unwrap();
            assert!(synth::verify(s.seed, one.name(), &one));
            drop(st); // reads still in flight
            drop(one);
        }
        let all = e.load_all(&LoadOptions::new()).unwrap();
        assert!(all.iter().all(|t| synth::verify(s.seed, t.name(), t.bytes())));
    }
}

#[cfg(feature = "futures")]
#[test]
fn a_stream_is_a_futures_stream_on_an_executor() {
    use std::future::Future;
    use std::pin::Pin;
    use std::task::{Context, Poll};

    /// `StreamExt::next` without the futures crate.
    struct Next<'a, S>(&'a mut S);
    impl<S: futures_core::Stream + Unpin> Future for Next<'_, S> {
        type Output = Option<S::Item>;
        fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
            Pin::new(&mut *self.0).poll_next(cx)
        }
    }

    let tmp = common::tempdir();
    let dir = tmp.path().join("m");
    let (model, sums) = reference_model(&dir);
    let e = engine(&model, BackendChoice::Auto);
    let rt = tokio::runtime::Builder::new_current_thread().build().unwrap();
    let largest = model.catalog().tensors().iter().map(|t| t.len).max().unwrap() as usize;
    let got = rt.block_on(async {
        let mut st = e.stream(model.catalog().tensors(), largest + 8192).unwrap();
        let mut got = BTreeMap::new();
        while let Some(item) = Next(&mut st).await {
            let l = item.unwrap();
            got.insert(l.name().to_string(), common::sha256_hex(&l));
        }
        got
    });
    assert_eq!(got, sums);
}

/// The handles a C ABI or another thread takes are Send + Sync (the
/// stream is Send: one consumer at a time).
#[test]
fn load_handles_are_send_and_sync() {
    fn send_sync<T: Send + Sync>() {}
    fn send<T: Send>() {}
    send_sync::<weightstream::LoadedModel>();
    send_sync::<weightstream::TensorView<'static>>();
    send_sync::<weightstream::LoadOptions>();
    send_sync::<weightstream::LoadReport>();
    send_sync::<weightstream::Arena>();
    send_sync::<weightstream::Loaded>();
    send_sync::<Engine>();
    send::<weightstream::Ticket>();
    send::<weightstream::TensorStream<'static>>();
}

/// `weightstream::load(dir)` is the long path (`Model::open(ModelConfig::new(dir))`,
/// `Engine::new(.., EngineConfig::default())`, `load_all(&LoadOptions::default())`)
/// in one call: the same tensors, bytes, alignment and layout, with the
/// engine gone before the first byte is looked at. `load_with` applies its
/// options as `load_all` does. The warnings the engine had at the end are
/// kept in the result (a placed payload read O_DIRECT through staging is one).
#[test]
fn load_is_the_long_path_in_one_call_and_needs_no_engine_after() {
    let tmp = common::tempdir();
    let dir = tmp.path().join("m");
    let (model, sums) = reference_model(&dir);
    let short = weightstream::load(&dir).unwrap();
    // The engine is a temporary: it is dropped at the end of the statement.
    let long = Engine::new(&model, EngineConfig::default())
        .unwrap()
        .load_all(&LoadOptions::default())
        .unwrap();
    assert_eq!(short.len(), model.catalog().tensors().len());
    let names = |l: &weightstream::LoadedModel| -> Vec<String> { l.iter().map(|t| t.name().to_string()).collect() };
    assert_eq!(names(&short), names(&long));
    for t in model.catalog().tensors() {
        let (s, l) = (short.get(&t.name).unwrap(), long.get(&t.name).unwrap());
        assert_eq!(common::sha256_hex(s.bytes()), sums[&t.name], "{}", t.name);
        assert_eq!((s.dtype(), s.shape(), s.len()), (l.dtype(), l.shape(), l.len()));
        if t.len > 0 {
            assert_eq!(s.bytes().as_ptr() as usize % element_size(t), 0, "{} aligned", t.name);
        }
    }
    let (rs, rl) = (short.report(), long.report());
    assert_eq!(
        (rs.tensors, rs.bytes, rs.mapped_bytes, rs.in_place, rs.placed, rs.order),
        (rl.tensors, rl.bytes, rl.mapped_bytes, rl.in_place, rl.placed, rl.order)
    );
    let staged = short
        .warnings()
        .iter()
        .any(|w| w.kind == weightstream::WarningKind::Staged);
    if common::fs_reads_o_direct(&dir) {
        assert_eq!(staged, rs.placed > 0, "{:?}", short.warnings());
    }

    // A selection: the same as load_all with the same options.
    let first = &model.catalog().tensors()[0].name;
    let opts = LoadOptions::new().names_containing([first.clone()]).align(64);
    let some = weightstream::load_with(&dir, &opts).unwrap();
    let want = engine(&model, BackendChoice::Auto).load_all(&opts).unwrap();
    assert_eq!(names(&some), names(&want));
    assert!(some
        .iter()
        .all(|t| (t.bytes().as_ptr() as usize).is_multiple_of(64) || t.is_empty()));

    // A directory that is no model is the error Model::open gives.
    let none = tmp.path().join("none");
    std::fs::create_dir(&none).unwrap();
    let (a, b) = (
        weightstream::load(&none).unwrap_err().to_string(),
        Model::open(ModelConfig::new(&none)).unwrap_err().to_string(),
    );
    assert_eq!(a, b);
}

/// `load_all_into`: the same bytes, alignment and layout as `load_all`, in
/// memory the caller keeps, load after load (the memory is reused, never
/// reallocated); `load_bytes` is the size it needs. Memory that is too
/// small, off a page, fixed-slot or still holding the previous load is
/// refused naming the numbers, before anything is read.
#[test]
fn load_all_into_reuses_the_callers_memory_load_after_load() {
    let tmp = common::tempdir();
    let dir = tmp.path().join("m");
    let (model, sums) = reference_model(&dir);
    for backend in common::engine_backend_choices() {
        let e = engine(&model, backend);
        let opts = LoadOptions::new().align(64);
        let need = e.load_bytes(&opts).unwrap();
        let fresh = e.load_all(&opts).unwrap();
        assert_eq!(need, fresh.report().mapped_bytes, "load_bytes is the layout's length");
        // The caller's memory: page-aligned, one page longer than needed,
        // filled with a pattern that must be overwritten exactly where the
        // payloads land.
        let mut buf = vec![0u8; need + 2 * 4096];
        let skip = buf.as_ptr().align_offset(4096);
        let mem = &mut buf[skip..skip + need + 4096];
        mem.fill(0xA5);
        let base = mem.as_mut_ptr();
        // SAFETY: `mem` outlives the arena and everything loaded into it
        // (all dropped before `buf` at the end of this iteration); nothing
        // touches it while the arena holds it except through the loads.
        let arena = unsafe { e.register_memory(std::ptr::NonNull::new(base).unwrap(), need + 4096) }.unwrap();
        for round in 0..2 {
            let into = e.load_all_into(&opts, &arena).unwrap();
            assert!(into.report().given_memory && !fresh.report().given_memory);
            assert_eq!(into.len(), fresh.len());
            for t in model.catalog().tensors() {
                let (a, b) = (into.get(&t.name).unwrap(), fresh.get(&t.name).unwrap());
                assert_eq!(
                    common::sha256_hex(a.bytes()),
                    sums[&t.name],
                    "{backend:?} round {round}: {}",
                    t.name
                );
                // The same place relative to the memory's start.
                let at = |p: *const u8, base: *const u8| p as usize - base as usize;
                if t.len > 0 {
                    let fresh_base = fresh.iter().map(|v| v.bytes().as_ptr() as usize).min().unwrap();
                    let into_base = into.iter().map(|v| v.bytes().as_ptr() as usize).min().unwrap();
                    assert_eq!(
                        at(a.bytes().as_ptr(), into_base as *const u8),
                        at(b.bytes().as_ptr(), fresh_base as *const u8),
                        "{}: laid out as load_all lays it",
                        t.name
                    );
                    let p = a.bytes().as_ptr() as usize;
                    assert!(p >= base as usize && p + t.len as usize <= base as usize + need);
                }
            }
            // Still held: a second load into the same memory is refused.
            let busy = e.load_all_into(&opts, &arena).unwrap_err().to_string();
            assert!(busy.contains("in use") && busy.contains("load_all_into"), "{busy}");
            drop(into);
        }
        // Nothing past the layout was written.
        drop(arena);
        let mem = &buf[skip..skip + need + 4096];
        assert!(
            mem[need..].iter().all(|&b| b == 0xA5),
            "{backend:?}: bytes past load_bytes written"
        );

        // Refusals, each naming what is wrong; nothing is read.
        let small = weightstream::Arena::packed(need - 4096, 4096, false).unwrap();
        let err = e.load_all_into(&opts, &small).unwrap_err().to_string();
        assert!(err.contains(&need.to_string()) && err.contains("load_bytes"), "{err}");
        let fixed = weightstream::Arena::new(weightstream::SlotSpec::new(need), 1).unwrap();
        let err = e.load_all_into(&opts, &fixed).unwrap_err().to_string();
        assert!(err.contains("fixed-slot"), "{err}");
        let mut odd = vec![0u8; need + 2 * 4096];
        let off = odd.as_ptr().align_offset(4096) + 64;
        // SAFETY: as above; the arena is dropped before `odd`.
        let odd_arena =
            unsafe { e.register_memory(std::ptr::NonNull::new(odd[off..].as_mut_ptr()).unwrap(), need + 4096) }
                .unwrap();
        let err = e.load_all_into(&opts, &odd_arena).unwrap_err().to_string();
        assert!(err.contains("4096-byte boundary"), "{err}");
        drop(odd_arena);
    }
}

/// A whole-model load's own mapping is not registered on purpose: its
/// plain reads are counted as such (`chunks_unregistered_arena`), and no
/// warning calls them a fallback.
#[test]
fn a_loads_own_mapping_is_unregistered_by_choice_not_a_fallback() {
    if !common::uring_available() {
        return;
    }
    let tmp = common::tempdir();
    let dir = tmp.path().join("m");
    let (model, _) = reference_model(&dir);
    let e = engine(&model, BackendChoice::Uring);
    let before: Vec<(u64, u64)> = e
        .stats()
        .drives
        .iter()
        .map(|d| (d.chunks_unregistered, d.chunks_unregistered_arena))
        .collect();
    let all = e.load_all(&LoadOptions::new()).unwrap();
    assert!(!all.is_empty());
    let s = e.stats();
    let (plain, by_choice) = s.drives.iter().zip(&before).fold((0, 0), |(p, c), (d, b)| {
        (p + d.chunks_unregistered - b.0, c + d.chunks_unregistered_arena - b.1)
    });
    assert!(plain > 0, "the load read its mapping with plain reads");
    assert_eq!(plain, by_choice, "every one of them by choice");
    assert!(
        !e.warnings()
            .iter()
            .any(|w| matches!(w.kind, weightstream::WarningKind::SlotsUnregistered)),
        "{:?}",
        e.warnings()
    );
}
