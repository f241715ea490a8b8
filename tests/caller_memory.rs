//! Reads into memory the caller owns, into one packed arena of mixed slot
//! sizes, of parts of tensors (byte ranges, rows), typed views, and a
//! submission that never blocks. Every payload is compared with what the
//! writer wrote (or the reference reader's slices), on both backends, and
//! every byte the caller did not hand over stays untouched.

mod common;

use std::ptr::NonNull;
use std::time::{Duration, Instant};

use weightstream::__internal::Fault;
use weightstream::{
    BackendChoice, DirectMode, Dtype, Engine, EngineConfig, Error, Loaded, Model, ModelConfig, Scratch, TensorRef,
};
use weightstream_synth::{self as synth, SynthSpec};

const GUARD: u8 = 0xA5;

fn spec() -> SynthSpec {
    SynthSpec {
        layers: 2,
        experts: 2,
        expert_bytes: 300_000,
        shards: 2,
        seed: 0xca11,
        ..SynthSpec::default()
    }
}

fn model(dir: &std::path::Path) -> (Model, SynthSpec) {
    let s = spec();
    common::synth_model(dir, &s);
    (Model::open(ModelConfig::new(dir)).unwrap(), s)
}

fn engine(model: &Model, backend: BackendChoice) -> Engine {
    Engine::new(model, EngineConfig::default().backend(backend)).unwrap()
}

/// Page-aligned memory the test owns, freed on drop.
struct Owned {
    ptr: NonNull<u8>,
    layout: std::alloc::Layout,
}

impl Owned {
    fn new(len: usize, fill: u8) -> Self {
        let layout = std::alloc::Layout::from_size_align(len, 4096).unwrap();
        // SAFETY: a non-zero size with a valid layout.
        let p = unsafe { std::alloc::alloc(layout) };
        let ptr = NonNull::new(p).expect("allocation");
        // SAFETY: freshly allocated, `len` bytes.
        unsafe { std::ptr::write_bytes(ptr.as_ptr(), fill, len) };
        Owned { ptr, layout }
    }

    fn bytes(&self) -> &[u8] {
        // SAFETY: the allocation lives as long as `self`; read only after
        // every read into it completed (the tests wait first).
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.layout.size()) }
    }
}

impl Drop for Owned {
    fn drop(&mut self) {
        // SAFETY: allocated in `new` with this layout.
        unsafe { std::alloc::dealloc(self.ptr.as_ptr(), self.layout) };
    }
}

/// The writer's bytes of `t` (or of the part of it `t` names).
fn expected(seed: u64, model: &Model, t: &TensorRef) -> Vec<u8> {
    let whole = model.tensor(&t.name).unwrap();
    let mut v = vec![0u8; t.len as usize];
    synth::fill(seed, &t.name, (t.offset - whole.offset) as usize, &mut v);
    v
}

/// Every tensor of every size from ONE packed arena, all held at once: no
/// two slots overlap, every payload is the writer's, and the arena is one
/// registered mapping (no chunk read unregistered on io_uring).
#[test]
fn one_packed_arena_holds_every_tensor_of_every_size() {
    let tmp = common::tempdir();
    let (model, s) = model(&tmp.path().join("m"));
    let tensors = model.catalog().tensors();
    let sizes: std::collections::BTreeSet<u64> = tensors.iter().map(|t| t.len).collect();
    assert!(sizes.len() >= 4, "the fixture has tensors of several sizes: {sizes:?}");
    for backend in common::engine_backend_choices() {
        let e = engine(&model, backend);
        let need: usize = tensors
            .iter()
            .map(|t| (t.len as usize + 4096).next_multiple_of(4096))
            .sum();
        let arena = e.packed_arena(need, false).unwrap();
        let tickets: Vec<_> = tensors
            .iter()
            .map(|t| {
                let slot = arena
                    .take_for(t)
                    .unwrap_or_else(|e| panic!("{backend:?}: no room for {}: {e}", t.name));
                e.read(t, slot).unwrap()
            })
            .collect();
        let loaded: Vec<Loaded> = tickets.into_iter().map(|k| k.wait().unwrap()).collect();
        for (t, l) in tensors.iter().zip(&loaded) {
            assert!(synth::verify(s.seed, &t.name, l), "{backend:?}: {}", t.name);
            assert_eq!(
                (l.name(), l.dtype(), l.shape()),
                (t.name.as_str(), t.dtype, &t.shape[..])
            );
        }
        // Disjoint: every slot's bytes are its own.
        let mut ranges: Vec<(usize, usize)> = loaded
            .iter()
            .map(|l| (l.slot().offset(), l.slot().offset() + l.slot().len()))
            .collect();
        ranges.sort();
        assert!(
            ranges.windows(2).all(|w| w[0].1 <= w[1].0),
            "{backend:?}: overlapping slots"
        );
        if backend == BackendChoice::Uring {
            let st = e.stats();
            assert!(st.registered_buffers.unwrap().enabled);
            assert_eq!(st.drives.iter().map(|d| d.chunks_unregistered).sum::<u64>(), 0);
        }
        drop(loaded);
        assert_eq!(arena.available(), arena.bytes(), "{backend:?}: every extent came back");
    }
}

/// `read_into` with no scratch writes exactly the payload at the offset
/// asked for: every other byte of the caller's memory keeps its pattern.
/// Payloads whose file offset starts a block read O_DIRECT in place; the
/// others go O_DIRECT through staging and one copy (counted as staged),
/// never buffered, no fallback counted.
#[test]
fn read_into_writes_exactly_the_payload_where_asked() {
    let tmp = common::tempdir();
    let (model, s) = model(&tmp.path().join("m"));
    let tensors = model.catalog().tensors();
    for backend in common::engine_backend_choices() {
        let e = engine(&model, backend);
        // Packed tightly, 64-byte aligned, with 4096 guard bytes at each end.
        let mut at = 4096;
        let places: Vec<usize> = tensors
            .iter()
            .map(|t| {
                let p = at;
                at = (at + t.len as usize).next_multiple_of(64);
                p
            })
            .collect();
        let mem = Owned::new(at + 4096, GUARD);
        // SAFETY: `mem` outlives the arena and every ticket (dropped first,
        // below); nothing else touches it while reads are in flight.
        let arena = unsafe { e.register_memory(mem.ptr, mem.layout.size()) }.unwrap();
        assert!(arena.is_borrowed());
        let before = e.stats();
        // Asked before the reads: the same answer the tickets give after.
        let would: Vec<bool> = tensors
            .iter()
            .zip(&places)
            .map(|(t, &p)| e.would_stage(t, &arena, p, Scratch::None))
            .collect();
        let tickets: Vec<_> = tensors
            .iter()
            .zip(&places)
            .map(|(t, &p)| e.read_into(t, &arena, p, Scratch::None).unwrap())
            .collect();
        let staged_tickets = tickets.iter().filter(|k| k.is_staged()).count() as u64;
        let said: Vec<bool> = tickets.iter().map(|k| k.is_staged()).collect();
        if common::fs_reads_o_direct(&tmp.path().join("m")) {
            assert_eq!(would, said, "{backend:?}: would_stage before = is_staged after");
        }
        for k in tickets {
            drop(k.wait().unwrap());
        }
        drop(arena);
        let b = mem.bytes();
        let mut covered = vec![false; b.len()];
        for (t, &p) in tensors.iter().zip(&places) {
            assert_eq!(
                &b[p..p + t.len as usize],
                &expected(s.seed, &model, t)[..],
                "{backend:?}: {}",
                t.name
            );
            covered[p..p + t.len as usize].fill(true);
        }
        let stray = b.iter().zip(&covered).filter(|(&x, &c)| !c && x != GUARD).count();
        assert_eq!(stray, 0, "{backend:?}: bytes outside the payloads were written");
        let after = e.stats();
        if common::fs_reads_o_direct(&tmp.path().join("m")) {
            let in_place = tensors
                .iter()
                .zip(&places)
                .filter(|(t, &p)| t.offset % 4096 == 0 && p % 4096 == 0 && t.len >= 4096)
                .count() as u64;
            assert_eq!(
                after.fallbacks_total(),
                before.fallbacks_total(),
                "{backend:?}: {after:?}"
            );
            assert_eq!(after.reads_buffered(), before.reads_buffered(), "{backend:?}");
            assert_eq!(
                after.staged.reads - before.staged.reads,
                tensors.len() as u64 - in_place,
                "{backend:?}"
            );
            // Each ticket said, before its read completed, what the stats
            // counted after: staged or in place.
            assert_eq!(staged_tickets, tensors.len() as u64 - in_place, "{backend:?}");
            let staged_bytes: u64 = tensors
                .iter()
                .zip(&places)
                .filter(|(t, &p)| !(t.offset % 4096 == 0 && p % 4096 == 0 && t.len >= 4096))
                .map(|(t, _)| t.len)
                .sum();
            assert_eq!(after.staged.bytes - before.staged.bytes, staged_bytes, "{backend:?}");
            assert!(after.staged.staging_bytes > 0);
        }
    }
}

/// With `Scratch::Before` the block before each payload may be used, so
/// every payload with a whole block reads O_DIRECT in place; nothing more
/// than one block before a payload, and nothing after it, is written.
#[test]
fn read_into_with_scratch_reads_direct_and_stays_within_a_block() {
    let tmp = common::tempdir();
    let (model, s) = model(&tmp.path().join("m"));
    let experts: Vec<&TensorRef> = model
        .catalog()
        .tensors()
        .iter()
        .filter(|t| t.name.contains(".experts."))
        .collect();
    for backend in common::engine_backend_choices() {
        let e = engine(&model, backend);
        // Each payload at a block boundary + its file pad, two blocks apart.
        let mut at = 8192;
        let places: Vec<usize> = experts
            .iter()
            .map(|t| {
                let p = at + (t.offset % 4096) as usize;
                at = (p + t.len as usize + 8192).next_multiple_of(4096);
                p
            })
            .collect();
        let mem = Owned::new(at, GUARD);
        // SAFETY: as above.
        let arena = unsafe { e.register_memory(mem.ptr, mem.layout.size()) }.unwrap();
        let direct0 = e.stats().reads_direct();
        let tickets: Vec<_> = experts
            .iter()
            .zip(&places)
            .map(|(t, &p)| e.read_into(t, &arena, p, Scratch::Before).unwrap())
            .collect();
        for k in tickets {
            drop(k.wait().unwrap());
        }
        drop(arena);
        assert!(
            e.stats().reads_direct() - direct0 >= experts.len() as u64,
            "{backend:?}: not O_DIRECT"
        );
        let b = mem.bytes();
        let mut allowed = vec![false; b.len()];
        for (t, &p) in experts.iter().zip(&places) {
            assert_eq!(
                &b[p..p + t.len as usize],
                &expected(s.seed, &model, t)[..],
                "{backend:?}: {}",
                t.name
            );
            allowed[p - (t.offset % 4096) as usize..p + t.len as usize].fill(true);
        }
        assert!(
            b.iter().zip(&allowed).all(|(&x, &ok)| ok || x == GUARD),
            "{backend:?}: a byte outside payload + its block was written"
        );
    }
}

/// A placement that overlaps a slot in use is an error, not a wait, and not
/// a write; caller memory off the page reads through staging, correctly.
#[test]
fn overlapping_or_misaligned_caller_memory() {
    let tmp = common::tempdir();
    let (model, s) = model(&tmp.path().join("m"));
    let t = model.catalog().tensors().iter().max_by_key(|t| t.len).unwrap().clone();
    let e = engine(&model, common::engine_backend_choices()[0]);
    let mem = Owned::new(2 * t.len as usize + 8192, GUARD);
    // SAFETY: as above.
    let arena = unsafe { e.register_memory(mem.ptr, mem.layout.size()) }.unwrap();
    let held = e.read_into(&t, &arena, 100, Scratch::None).unwrap().wait().unwrap();
    let err = e.read_into(&t, &arena, 200, Scratch::None).unwrap_err();
    assert!(
        err.to_string().contains("overlap") && err.to_string().contains(&t.name),
        "{err}"
    );
    assert!(
        e.read_into(&t, &arena, mem.layout.size() - 10, Scratch::None).is_err(),
        "past the end"
    );
    drop(held);
    drop(arena);
    // One byte off the page: staged (out of phase), bytes still right;
    // in phase (at 4095 + the file's pad) it is in place.
    let off = NonNull::new(mem.ptr.as_ptr().wrapping_add(1)).unwrap();
    // SAFETY: inside `mem`, which outlives the arena.
    let arena = unsafe { e.register_memory(off, mem.layout.size() - 1) }.unwrap();
    let staged0 = e.stats().staged.reads;
    let l = e.read_into(&t, &arena, 0, Scratch::Before).unwrap().wait().unwrap();
    assert!(synth::verify(s.seed, &t.name, &l));
    assert_eq!(l.offset(), 0);
    drop(l);
    let at = 4095 + (t.offset % 4096) as usize;
    let l = e.read_into(&t, &arena, at, Scratch::Blocks).unwrap().wait().unwrap();
    assert!(synth::verify(s.seed, &t.name, &l));
    assert_eq!(
        (l.offset(), l.as_ptr() as usize % 4096),
        (at, (t.offset % 4096) as usize)
    );
    if common::fs_reads_o_direct(&tmp.path().join("m")) {
        assert_eq!(
            e.stats().staged.reads - staged0,
            1,
            "only the read out of phase is staged"
        );
    }
}

/// Rows and byte ranges of a tensor read like any other, with the bytes the
/// reference reader's slices have (`get_slice(name)[1:3]`, and bytes
/// 1..len-2 of `get_tensor`), on both backends and both direct modes.
#[test]
fn parts_of_tensors_match_the_reference_readers_slices() {
    let tmp = common::tempdir();
    let dir = tmp.path().join("ref");
    let Some(_) = common::reference_digests(&dir) else {
        return;
    };
    let Some(lines) = common::run_reference("ref_slices.py", &[dir.as_os_str()]) else {
        return;
    };
    assert!(lines.lines().count() > 10, "{lines}");
    for direct in [DirectMode::Auto, DirectMode::Off] {
        let model = Model::open(ModelConfig::new(&dir).direct(direct)).unwrap();
        for backend in common::engine_backend_choices() {
            let e = engine(&model, backend);
            let arena = e.packed_arena(16 << 20, false).unwrap();
            for line in lines.lines() {
                let (hex, rest) = line.split_once("  ").unwrap();
                let f: Vec<&str> = rest.rsplitn(4, ' ').collect(); // end, start, kind, name
                let (name, kind, a, b) = (f[3], f[2], f[1].parse::<u64>().unwrap(), f[0].parse::<u64>().unwrap());
                let t = model.tensor(name).unwrap();
                let part = match kind {
                    "rows" => t.rows(a as usize..b as usize).unwrap(),
                    _ => t.byte_range(a..b).unwrap(),
                };
                let l = e.read(&part, arena.take_for(&part).unwrap()).unwrap().wait().unwrap();
                assert_eq!(common::sha256_hex(&l), hex, "{direct:?} {backend:?}: {rest}");
                if kind == "rows" {
                    assert_eq!(l.shape()[0], 2);
                    assert_eq!(l.dtype(), t.dtype);
                }
            }
        }
    }
}

#[test]
fn parts_refuse_what_is_not_inside_the_tensor() {
    let tmp = common::tempdir();
    let (model, _) = model(&tmp.path().join("m"));
    let t = model.tensor("model.layers.0.mlp.router.weight").unwrap();
    assert!(t.rows(0..t.shape[0] + 1).is_err());
    assert!(t.rows(1..1).is_err());
    assert!(t.byte_range(0..t.len + 1).is_err());
    let cut = t.byte_range(1..4).unwrap();
    assert_eq!(
        (cut.dtype, &cut.shape[..]),
        (Dtype::U8, &[3][..]),
        "a range cutting BF16 elements is bytes"
    );
    let whole = t.byte_range(2..t.len).unwrap();
    assert_eq!(whole.dtype, t.dtype);
    // A part whose bytes leave the tensor is another model's, not wrong bytes.
    let mut forged = t.clone();
    forged.len += 2;
    let e = engine(&model, common::engine_backend_choices()[0]);
    let arena = e.packed_arena(1 << 20, false).unwrap();
    assert!(matches!(
        e.read(&forged, arena.take_for(t).unwrap()),
        Err(Error::ForeignTensor { .. })
    ));
}

/// Typed views check the dtype, the length and the alignment.
#[test]
fn typed_views_are_checked() {
    let tmp = common::tempdir();
    let (model, s) = model(&tmp.path().join("m"));
    let e = engine(&model, common::engine_backend_choices()[0]);
    let arena = e.packed_arena(8 << 20, false).unwrap();
    let t = model.tensor("model.layers.1.mlp.experts.0.up_proj.weight").unwrap();
    let l = e.read(t, arena.take_for(t).unwrap()).unwrap().wait().unwrap();
    assert_eq!(l.dtype(), Dtype::Bf16);
    if (l.as_ptr() as usize).is_multiple_of(2) {
        let v = l.as_slice::<u16>().unwrap();
        assert_eq!(v.len() * 2, l.len());
        assert_eq!(v[0].to_le_bytes(), [l[0], l[1]]);
    } else {
        assert!(matches!(l.as_slice::<u16>(), Err(Error::View { .. })));
    }
    let e32 = l.as_slice::<f32>().unwrap_err();
    assert!(e32.to_string().contains("dtype BF16"), "{e32}");
    assert!(synth::verify(s.seed, &t.name, &l));
}

/// `read` never blocks: with every drive's I/O threads held (they take no
/// queued chunk) and queue depth 1, four reads of 73 chunks each return
/// with nothing read, so `read` waited neither for its chunks nor for room
/// (a read that did would never return: the watchdog turns that into a
/// failure); once released, the chunks are worked off behind it and every
/// payload is the writer's.
#[test]
fn read_returns_at_once_whatever_the_queue_depth() {
    let tmp = common::tempdir();
    let (model, s) = model(&tmp.path().join("m"));
    let t = model.catalog().tensors().iter().max_by_key(|t| t.len).unwrap().clone();
    for backend in common::engine_backend_choices() {
        let e = std::sync::Arc::new(
            Engine::new(
                &model,
                EngineConfig::default()
                    .backend(backend)
                    .queue_depth(1)
                    .chunk(Some(4096))
                    .pread_threads(1),
            )
            .unwrap(),
        );
        let drives = model.drives().len();
        for d in 0..drives {
            e.inject_fault(d, Fault::HoldQueued(true));
        }
        let arena = e.packed_arena(4 * (t.len as usize + 8192), true).unwrap();
        let slots: Vec<_> = (0..4).map(|_| arena.take_for(&t).unwrap()).collect();
        let (tx, rx) = std::sync::mpsc::channel();
        {
            let (e, t) = (std::sync::Arc::clone(&e), t.clone());
            std::thread::spawn(move || {
                // For the record: a wait inside `read` would show here too
                // (a lock an I/O thread held when it was preempted is not
                // one; so this is printed, not asserted).
                let out = common::voluntary_switches_in(|| {
                    slots
                        .into_iter()
                        .map(|slot| e.read(&t, slot).unwrap())
                        .collect::<Vec<_>>()
                });
                let _ = tx.send(out);
            });
        }
        // Not a timing: a read that waited on held I/O would never return.
        let (tickets, switches) = rx
            .recv_timeout(Duration::from_secs(60))
            .unwrap_or_else(|_| panic!("{backend:?}: read() did not return while the drives were held"));
        let ready = tickets.iter().filter(|k| k.is_ready()).count();
        assert_eq!(ready, 0, "{backend:?}: chunks were read while every drive was held");
        for d in 0..drives {
            e.inject_fault(d, Fault::HoldQueued(false));
        }
        for k in tickets {
            assert!(synth::verify(s.seed, &t.name, &k.wait().unwrap()));
        }
        eprintln!(
            "{backend:?}: 4 x {} chunks queued at queue depth 1 with the drives held; \
             {switches} voluntary context switch(es) inside read()",
            t.len / 4096
        );
    }
}

/// `wait_timeout` hands the ticket back while the read is in flight (a
/// 2 MB/s drive: a 1 MiB expert takes half a second), and the payload once
/// it lands; the ticket can be polled again in between.
#[test]
fn wait_timeout_hands_the_ticket_back_while_the_read_is_in_flight() {
    let Some((_sim, model, s, t)) = slow_expert(0x71) else {
        return;
    };
    for backend in common::engine_backend_choices() {
        cold();
        let e = engine(&model, backend);
        let arena = e.packed_arena(4 << 20, false).unwrap();
        let mut ticket = e.read(&t, arena.take_for(&t).unwrap()).unwrap();
        let t0 = Instant::now();
        ticket = match ticket.wait_timeout(Duration::from_millis(20)) {
            Err(k) => k,
            Ok(r) => panic!(
                "{backend:?}: 1 MiB at 2 MB/s landed within 20 ms: {:?}",
                r.map(|l| l.len())
            ),
        };
        assert!(t0.elapsed() >= Duration::from_millis(20));
        let loaded = loop {
            match ticket.wait_timeout(Duration::from_millis(50)) {
                Ok(r) => break r.unwrap(),
                Err(k) => ticket = k,
            }
            assert!(t0.elapsed() < Duration::from_secs(30), "{backend:?}: never landed");
        };
        assert!(synth::verify(s.seed, &t.name, &loaded), "{backend:?}");
    }
}

/// `Arena::release` says when lent memory may be freed: not while another
/// handle holds it, not while a dropped ticket's read is still in the
/// kernel (a 2 MB/s drive keeps it there), and at once after.
#[test]
fn release_waits_for_a_dropped_tickets_read_before_the_memory_may_be_freed() {
    let tmp = common::tempdir();
    let (model, _) = model(&tmp.path().join("m"));
    let e = engine(&model, BackendChoice::Auto);
    let mem = Owned::new(1 << 20, GUARD);
    // SAFETY: `mem` outlives the arena: it is freed at the end of the test,
    // after `release` returned Ok (nothing of the arena is left then).
    let arena = unsafe { e.register_memory(mem.ptr, 1 << 20) }.unwrap();
    let other = arena.clone();
    let arena = arena
        .release(Duration::from_millis(5))
        .expect_err("another handle holds it");
    drop(other);
    arena.release(Duration::from_secs(60)).expect("nothing holds it");

    let Some((_sim, slow, s, t)) = slow_expert(0x5e1) else {
        return;
    };
    for backend in common::engine_backend_choices() {
        cold();
        let e = engine(&slow, backend);
        let mem = Owned::new(4 << 20, GUARD);
        // SAFETY: `mem` is freed only after `release` returned Ok.
        let arena = unsafe { e.register_memory(mem.ptr, 4 << 20) }.unwrap();
        // In phase and in place (a staged read would hold staging, not this).
        let at = (t.offset % 4096) as usize;
        let ticket = e.read_into(&t, &arena, at, Scratch::Blocks).unwrap();
        drop(ticket); // in flight: its read holds the slot
        let arena = arena
            .release(Duration::from_millis(20))
            .expect_err("a 1 MiB read at 2 MB/s is still in flight after 20 ms");
        let t0 = Instant::now();
        arena.release(Duration::from_secs(30)).expect("the read completes");
        assert!(t0.elapsed() < Duration::from_secs(30));
        // The payload landed (and nothing after it was written) before Ok.
        let mut want = vec![0u8; t.len as usize];
        synth::fill(s.seed, &t.name, 0, &mut want);
        assert!(mem.bytes()[at..at + t.len as usize] == want[..], "{backend:?}");
        let blocks_end = (at + t.len as usize).next_multiple_of(4096);
        assert!(mem.bytes()[blocks_end..].iter().all(|&b| b == GUARD), "{backend:?}");
        drop(mem);
    }
}

/// A model on a drive capped at 2 MB/s (so a 1 MiB expert reads in half a
/// second) and one of its experts; `None` (SKIP said) without root.
fn slow_expert(seed: u64) -> Option<(common::SimDrives, Model, SynthSpec, TensorRef)> {
    let sim = common::SimDrives::up(1, "loop", "2")?;
    let dir = sim.mounts[0].join("m");
    let s = SynthSpec {
        layers: 1,
        experts: 2,
        expert_bytes: 1 << 20,
        shards: 1,
        seed,
        ..SynthSpec::default()
    };
    common::synth_model(&dir, &s);
    let model = Model::open(ModelConfig::new(&dir)).unwrap();
    let t = model
        .catalog()
        .tensors()
        .iter()
        .find(|t| t.name.contains(".experts."))
        .unwrap()
        .clone();
    Some((sim, model, s, t))
}

/// Writes the page cache back and drops it, so the next read (a buffered
/// one too) goes to the drive.
fn cold() {
    assert!(std::process::Command::new("sync").status().unwrap().success());
    std::fs::write("/proc/sys/vm/drop_caches", "3").unwrap();
}

/// `Scratch::None` on a payload that starts a block of its file, at an
/// aligned address: the whole blocks go O_DIRECT in place, the tail
/// buffered, and not one byte around the payload is written; at an
/// unaligned address the same payload is staged (O_DIRECT, one copy), and
/// still nothing around it is written.
#[test]
fn a_payload_on_a_block_reads_direct_into_caller_memory_without_scratch() {
    let tmp = common::tempdir();
    let dir = tmp.path().join("m");
    std::fs::create_dir_all(&dir).unwrap();
    let mut layout = common::Layout::new(4096);
    layout.place("on_block", 8192, 10_000).end_at(8192 + 10_000 + 3000);
    let file = layout.write(&dir.join("model.safetensors"), 0xb10c);
    if !common::fs_reads_o_direct(&dir) {
        eprintln!("SKIP: {} cannot open O_DIRECT", dir.display());
        return;
    }
    let model = Model::open(ModelConfig::new(&dir)).unwrap();
    let t = model.tensor("on_block").unwrap().clone();
    for backend in common::engine_backend_choices() {
        let e = engine(&model, backend);
        let mem = Owned::new(64 << 10, GUARD);
        // SAFETY: `mem` outlives the arena and every read into it (all
        // waited for and dropped before `mem`).
        let arena = unsafe { e.register_memory(mem.ptr, 64 << 10) }.unwrap();
        let fallbacks = |e: &Engine| -> u64 { e.stats().fallbacks_total() };
        let direct = |e: &Engine| -> u64 { e.stats().reads_direct() };
        let staged = |e: &Engine| -> u64 { e.stats().staged.reads };
        for (at, in_place) in [(4096usize, true), (4096 + 64, false)] {
            let (f0, d0, s0) = (fallbacks(&e), direct(&e), staged(&e));
            let l = e.read_into(&t, &arena, at, Scratch::None).unwrap().wait().unwrap();
            assert!(l[..] == file[8192..8192 + 10_000], "{backend:?} at {at}");
            drop(l);
            let (df, dd, ds) = (fallbacks(&e) - f0, direct(&e) - d0, staged(&e) - s0);
            assert_eq!((dd, df, ds), (1, 0, u64::from(!in_place)), "{backend:?} at {at}");
            let b = mem.bytes();
            assert!(
                b[..at].iter().all(|&x| x == GUARD),
                "{backend:?}: a byte before the payload was written"
            );
            assert!(
                b[at + 10_000..].iter().all(|&x| x == GUARD),
                "{backend:?}: a byte after the payload was written"
            );
            // Back to the guard pattern for the next placement.
            // SAFETY: no read is in flight (waited), and no slot of the
            // arena is held: the test owns these bytes again.
            unsafe { std::ptr::write_bytes(mem.ptr.as_ptr().add(at), GUARD, 10_000) };
        }
        arena.release(Duration::from_secs(60)).unwrap();
        drop(mem);
    }
}
