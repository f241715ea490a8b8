//! Microbenchmarks of the per-read and per-chunk hot path: the CPU work
//! `Engine::read` and the completion side do around each I/O, with no I/O.
//!
//! Run: `cargo bench --bench hot_path -- --warm-up-time 1 --measurement-time 3`
//!
//! What one iteration is, and so what criterion's `time:` line means:
//!
//! - `window/plan/expert_19MiB`, `window/plan/sub_block_2KiB`: one
//!   `Window::plan`; ns per read.
//! - `chunk/split_19MiB_1MiB`: `count` + `split` of one 19 MiB read into
//!   20 chunks of 1 MiB; ns per read. Throughput is in chunks, so `thrpt:` is
//!   chunks/s and ns per chunk = `time:` / 20.
//! - `chunk/on_result/{full,short,eintr}`: one `on_result`; ns per chunk
//!   completion.
//! - `inflight/request_per_chunk`: `Request::new` + 20 `chunk_done` + `wait`;
//!   ns per read, `thrpt:` in chunks/s (ns per chunk = `time:` / 20).
//!   ns per chunk.
//!
//! - `route/*`: the routing decision for one chunk over two copies, and the
//!   per-drive load bookkeeping each routed chunk pays; ns per chunk.
//!
//! These go through `weightstream::__internal`, a hidden re-export of internals
//! that is not a stable API.

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use weightstream::__internal::Window;
use weightstream::__internal::{chunk_count, chunk_on_result, chunk_split, Chunk, DriveLoad, Request};
use weightstream::__internal::{cuts, hash_pick, stripe_pick};

/// A typical MoE expert's payload: 19918080 bytes (just under 19 MiB).
const EXPERT_LEN: u64 = 19_918_080;
/// The safetensors header of the test shard ends at byte 71, so no payload
/// starts aligned.
const DATA_START: u64 = 71;
/// A 1 GB shard.
const SHARD_SIZE: u64 = 1_000_000_000;
const ALIGN: u64 = 4096;
/// The default chunk size.
const CHUNK: usize = 1 << 20;
/// How many experts fit in the shard: `plan` is asked about each in turn.
const EXPERTS: u64 = (SHARD_SIZE - DATA_START) / EXPERT_LEN;
/// A sub-block tensor (a norm weight of 1024 bf16): shorter than one block,
/// so the whole payload is a buffered tail.
const SMALL_LEN: u64 = 2048;

fn expert_window(k: u64) -> Window {
    Window::plan(DATA_START + k * EXPERT_LEN, EXPERT_LEN, SHARD_SIZE, ALIGN, false).expect("expert inside the shard")
}

fn window(c: &mut Criterion) {
    let mut g = c.benchmark_group("window");
    // Per read: one plan per tensor read.
    g.bench_function("plan/expert_19MiB", |b| {
        let mut k = 0u64;
        b.iter(|| {
            k = if k + 1 == EXPERTS { 0 } else { k + 1 };
            let off = DATA_START + black_box(k) * EXPERT_LEN;
            black_box(Window::plan(
                off,
                black_box(EXPERT_LEN),
                black_box(SHARD_SIZE),
                black_box(ALIGN),
                black_box(false),
            ))
        })
    });
    g.bench_function("plan/sub_block_2KiB", |b| {
        let mut k = 0u64;
        b.iter(|| {
            k = (k + 1) & 1023;
            let off = DATA_START + black_box(k) * SMALL_LEN;
            black_box(Window::plan(
                off,
                black_box(SMALL_LEN),
                black_box(SHARD_SIZE),
                black_box(ALIGN),
                black_box(false),
            ))
        })
    });
    g.finish();
}

fn chunk(c: &mut Criterion) {
    let mut g = c.benchmark_group("chunk");

    // Per read: `count` then `split` of one 19 MiB expert into 1 MiB chunks,
    // as `Engine::read` does (it pushes each chunk to the drive's queue; here
    // they go into a reused Vec, so no allocation is timed). The window is
    // 19 direct chunks (18 x 1 MiB + 1015808 B) and a 3399 B buffered tail:
    // 20 chunks. Throughput is in chunks, so criterion's `thrpt:` is chunks/s
    // and ns per chunk = `time:` / 20.
    let w = expert_window(0);
    let n = chunk_count(&w, CHUNK);
    assert_eq!(n, 20, "the 19 MiB expert is 20 chunks of 1 MiB");
    assert_eq!(chunk_split(&w, 0, CHUNK).count(), n);
    g.throughput(Throughput::Elements(n as u64));
    g.bench_function("split_19MiB_1MiB", |b| {
        let mut out: Vec<Chunk> = Vec::with_capacity(n);
        b.iter(|| {
            let w = black_box(&w);
            let n = chunk_count(w, black_box(CHUNK));
            out.clear();
            out.extend(chunk_split(w, black_box(0), black_box(CHUNK)));
            black_box(&out);
            n
        })
    });

    // Per chunk completion: one `on_result` each.
    let mib = CHUNK as u32;
    let direct = Chunk {
        file: 0,
        direct: true,
        file_off: 1 << 20,
        slot_off: 1 << 20,
        len: mib,
        seq: 1,
    };
    g.throughput(Throughput::Elements(1));
    // The common case: the whole chunk landed -> Done.
    g.bench_function("on_result/full", |b| {
        b.iter(|| chunk_on_result(black_box(&direct), black_box(mib as i32), black_box(4096)))
    });
    // A short direct read of half the chunk, on an aligned boundary -> Again(rest).
    g.bench_function("on_result/short", |b| {
        b.iter(|| chunk_on_result(black_box(&direct), black_box((mib / 2) as i32), black_box(4096)))
    });
    // Interrupted -> Again(same chunk).
    g.bench_function("on_result/eintr", |b| {
        b.iter(|| chunk_on_result(black_box(&direct), black_box(-libc::EINTR), black_box(4096)))
    });
    g.finish();
}

fn inflight(c: &mut Criterion) {
    let mut g = c.benchmark_group("inflight");

    // Per read of 20 chunks: allocate the request, complete every chunk on
    // this thread (the last one publishes and notifies), take the result,
    // free the request. Single-threaded and uncontended: no cross-core cache
    // traffic, and the Arc clone/drop each queued chunk costs in the engine
    // is not included. `thrpt:` is chunks/s.
    const CHUNKS: usize = 20;
    g.throughput(Throughput::Elements(CHUNKS as u64));
    g.bench_function("request_per_chunk", |b| {
        b.iter(|| {
            let r = Request::new((), black_box(CHUNKS));
            for _ in 0..CHUNKS {
                black_box(r.chunk_done());
            }
            black_box(r.wait())
        })
    });

    // Per chunk: the submitter takes a credit, the reaper returns it.
    // Uncontended, one thread, nobody waiting on the condvar.

    g.finish();
}

/// The routing decision per chunk, for two copies: `hash` (cut points from
/// the weights, then one multiply-shift per read), `stripe` (smooth weighted
/// round robin), `adaptive` (one load lookup per candidate drive: a mutex and
/// a division each), and the load bookkeeping every routed chunk pays
/// (`add` when routed, `done` when it lands).
fn routing(c: &mut Criterion) {
    let mut g = c.benchmark_group("route");
    let weights = [1.0, 1.0];
    g.bench_function("hash_cuts_and_pick", |b| {
        let mut key = 0u64;
        b.iter(|| {
            key = key.wrapping_add(1);
            hash_pick(black_box(key), &cuts(black_box(&weights)))
        })
    });
    g.bench_function("stripe_pick", |b| {
        let mut given = [0u32; 2];
        let mut turn = 0usize;
        b.iter(|| {
            turn = turn.wrapping_add(1);
            let r = stripe_pick(black_box(&weights), &given, turn % 2);
            given[r] = given[r].wrapping_add(1);
            r
        })
    });
    let loads = [DriveLoad::new(1e9), DriveLoad::new(2e9)];
    g.bench_function("adaptive_pick_2_copies", |b| {
        b.iter(|| {
            let len = black_box(1u64 << 20);
            (0..2).min_by(|&x, &y| loads[x].cost(len).total_cmp(&loads[y].cost(len)))
        })
    });
    g.bench_function("load_add_done", |b| {
        b.iter(|| {
            loads[0].add(black_box(1 << 20));
            loads[0].done(black_box(1 << 20), true);
        })
    });
    g.finish();
}

criterion_group!(benches, window, chunk, inflight, routing);
criterion_main!(benches);
