//! `Engine::fill`: tensors and slices read straight into memory the caller
//! already has. Every destination gets exactly its payload (the file's
//! bytes, or the slice's by an element-by-element oracle), in phase and out
//! of phase, in place and with staging forced, with a staging budget far
//! smaller than the model, on both backends and both direct modes; nothing
//! around a destination is written; the report says which path each byte
//! took; misuse is refused before anything is read, and a read that fails
//! part way says so.

#![allow(clippy::single_range_in_vec_init)] // one range: rows

mod common;

use std::ops::Range;

use weightstream::{
    BackendChoice, DirectMode, Engine, EngineConfig, Error, FillOptions, FillTarget, Model, ModelConfig, TensorRef,
};

const GUARD: u8 = 0xA5;
const PAGE: usize = 4096;

/// A shard of U8 tensors at awkward file offsets: on a block, just after
/// one, just before one, inside one block, across several 4 MiB pieces,
/// empty, and one ending at the file's end off a block. Returns the file's
/// bytes and the wanted tensors' (name, offset, len).
fn awkward(dir: &std::path::Path) -> (Vec<u8>, Vec<(String, u64, u64)>) {
    std::fs::create_dir_all(dir).unwrap();
    let mut l = common::Layout::new(4096);
    l.place("on_block", 8192, 20_000)
        .place("after_block", 32_769, 9_000)
        .place("inside_one_block", 45_100, 700)
        .place("before_block", 49_152 + 4_000, 4_096 * 3 + 50)
        .place("big", 70_001, 9 * 1024 * 1024 + 123)
        .place("tiny", 9_560_000, 3)
        .place("empty", 9_560_003, 0)
        .place("last", 9_560_010, 11_111);
    let bytes = l.write(&dir.join("model.safetensors"), 0xf111);
    (bytes, l.placed.clone())
}

/// Page-aligned memory the test owns, every byte GUARD to start with.
struct Buf {
    ptr: std::ptr::NonNull<u8>,
    layout: std::alloc::Layout,
}

impl Buf {
    fn new(len: usize) -> Self {
        let layout = std::alloc::Layout::from_size_align(len, PAGE).unwrap();
        // SAFETY: a non-zero size with a valid layout.
        let ptr = std::ptr::NonNull::new(unsafe { std::alloc::alloc(layout) }).expect("allocation");
        // SAFETY: freshly allocated, `len` bytes.
        unsafe { std::ptr::write_bytes(ptr.as_ptr(), GUARD, len) };
        Buf { ptr, layout }
    }

    fn bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: the allocation lives as long as `self`, borrowed mutably.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.layout.size()) }
    }
}

impl Drop for Buf {
    fn drop(&mut self) {
        // SAFETY: allocated in `new` with this layout.
        unsafe { std::alloc::dealloc(self.ptr.as_ptr(), self.layout) }
    }
}

/// Where each tensor goes in one buffer: in phase with its file offset
/// (`shift` 0) or `shift` bytes off it, with guard bytes between.
fn places(tensors: &[TensorRef], align: usize, shift: usize) -> (Vec<usize>, usize) {
    let mut at = Vec::new();
    let mut cursor = 3 * PAGE;
    for t in tensors {
        let phase = (t.offset as usize + shift) % align;
        let start = (cursor.div_ceil(align)) * align + phase;
        at.push(start);
        cursor = start + t.len as usize + 1000;
    }
    (at, cursor + 3 * PAGE)
}

/// Splits `buf` into the destinations at `at` (sorted, disjoint).
fn dests<'a>(buf: &'a mut [u8], at: &[usize], lens: &[usize]) -> Vec<&'a mut [u8]> {
    let mut out = Vec::new();
    let mut rest = buf;
    let mut base = 0;
    for (&a, &n) in at.iter().zip(lens) {
        let (_, tail) = std::mem::take(&mut rest).split_at_mut(a - base);
        let (d, tail) = tail.split_at_mut(n);
        out.push(d);
        rest = tail;
        base = a + n;
    }
    out
}

/// The guards: every byte outside the destinations is GUARD.
fn assert_guards(buf: &[u8], at: &[usize], lens: &[usize], what: &str) {
    let mut inside = vec![false; buf.len()];
    for (&a, &n) in at.iter().zip(lens) {
        inside[a..a + n].iter_mut().for_each(|b| *b = true);
    }
    let bad = buf
        .iter()
        .zip(&inside)
        .enumerate()
        .find(|(_, (&b, &i))| !i && b != GUARD);
    assert!(
        bad.is_none(),
        "{what}: byte {} outside every destination was written",
        bad.unwrap().0
    );
}

fn engine(model: &Model, backend: BackendChoice) -> Engine {
    Engine::new(model, EngineConfig::default().backend(backend)).unwrap()
}

#[test]
fn every_tensor_lands_whole_in_and_out_of_phase_on_every_path() {
    let tmp = common::tempdir();
    let dir = tmp.path().join("awkward");
    let (file, placed) = awkward(&dir);
    let fs_direct = common::fs_reads_o_direct(&dir);
    for direct in [DirectMode::Auto, DirectMode::Off] {
        let model = Model::open(ModelConfig::new(&dir).direct(direct)).unwrap();
        let tensors: Vec<TensorRef> = placed
            .iter()
            .map(|(n, _, _)| model.tensor(n).unwrap().clone())
            .collect();
        let lens: Vec<usize> = tensors.iter().map(|t| t.len as usize).collect();
        for backend in common::engine_backend_choices() {
            let e = engine(&model, backend);
            let align = e.direct_align();
            for (shift, in_place) in [(0, true), (0, false), (1, true), (PAGE / 2 + 3, true)] {
                for copy_threads in [None, Some(0), Some(3)] {
                    let what = format!(
                        "{backend:?} direct {direct:?} shift {shift} in_place {in_place} copy {copy_threads:?}"
                    );
                    let (at, len) = places(&tensors, align, shift);
                    let mut buf = Buf::new(len);
                    let opts = FillOptions {
                        // Far less than the 9 MiB tensor: read through it.
                        staging_bytes: 256 << 10,
                        copy_threads,
                        in_place,
                        ..FillOptions::default()
                    };
                    let r = {
                        let targets = dests(buf.bytes_mut(), &at, &lens)
                            .into_iter()
                            .zip(&tensors)
                            .map(|(d, t)| FillTarget::tensor(t, d))
                            .collect();
                        e.fill(targets, &opts).unwrap_or_else(|err| panic!("{what}: {err}"))
                    };
                    let got = buf.bytes_mut();
                    for (i, t) in tensors.iter().enumerate() {
                        let want = &file[t.offset as usize..(t.offset + t.len) as usize];
                        assert!(got[at[i]..at[i] + lens[i]] == *want, "{what}: {} differs", t.name);
                    }
                    assert_guards(got, &at, &lens, &what);
                    // Which path each byte took.
                    let total: u64 = lens.iter().map(|&n| n as u64).sum();
                    assert_eq!(r.bytes, total, "{what}");
                    assert_eq!(r.in_place_bytes + r.staged_bytes + r.buffered_bytes, total, "{what}");
                    assert_eq!(r.targets, tensors.len());
                    let direct_reads = direct == DirectMode::Auto && fs_direct;
                    if !direct_reads {
                        assert_eq!(r.in_place_reads, 0, "{what}: in place without O_DIRECT");
                    } else if shift == 0 && in_place {
                        // Every tensor holding a whole block lands its
                        // blocks in place; only the ends are staged.
                        let with_block = tensors
                            .iter()
                            .filter(|t| t.offset.div_ceil(align as u64) < (t.offset + t.len) / align as u64)
                            .count();
                        assert_eq!(r.targets_in_place, with_block, "{what}");
                        assert!(r.staged_bytes < (2 * align * tensors.len()) as u64, "{what}: {r:?}");
                    } else {
                        assert_eq!(r.in_place_reads, 0, "{what}: out of phase or forced, yet in place");
                        assert_eq!(r.staged_bytes, total, "{what}");
                    }
                    if direct_reads {
                        assert_eq!(r.buffered_reads, 0, "{what}");
                        assert!(r.staging_bytes <= (256 << 10) + 2 * align, "{what}: {r:?}");
                    }
                    if r.staged_reads > 0 {
                        assert_eq!(r.copy_threads, copy_threads.unwrap_or(r.copy_threads), "{what}");
                        assert!(r.copy_threads >= usize::from(copy_threads.is_none()), "{what}");
                    }
                }
            }
        }
    }
}

/// The oracle: the block's bytes taken element by element from the whole
/// tensor's bytes (row-major, every dimension past `bounds` whole).
fn naive(t: &TensorRef, whole: &[u8], bounds: &[Range<usize>]) -> Vec<u8> {
    let size = t.dtype.bits() as usize / 8;
    let dims = t.shape.len();
    let full: Vec<Range<usize>> = (0..dims)
        .map(|d| bounds.get(d).cloned().unwrap_or(0..t.shape[d]))
        .collect();
    let mut out = Vec::new();
    let mut index: Vec<usize> = full.iter().map(|b| b.start).collect();
    'all: loop {
        let flat = (0..dims).fold(0usize, |f, d| f * t.shape[d] + index[d]);
        out.extend_from_slice(&whole[flat * size..(flat + 1) * size]);
        for d in (0..dims).rev() {
            index[d] += 1;
            if index[d] < full[d].end {
                continue 'all;
            }
            index[d] = full[d].start;
        }
        return out;
    }
}

/// A 2-D bf16 tensor and a 3-D f32 one at odd offsets.
fn matrices(dir: &std::path::Path) -> Vec<u8> {
    std::fs::create_dir_all(dir).unwrap();
    let entries = [
        common::Entry {
            name: "w".into(),
            dtype: "BF16".into(),
            shape: vec![300, 1000],
            begin: 13,
            end: 13 + 300 * 1000 * 2,
        },
        common::Entry {
            name: "x".into(),
            dtype: "F32".into(),
            shape: vec![6, 50, 700],
            begin: 13 + 600_000,
            end: 13 + 600_000 + 6 * 50 * 700 * 4,
        },
    ];
    let mut json = common::header_json(&[common::Entry::u8("pad", 0, 13)]);
    json.pop();
    json.push(',');
    json.push_str(&common::header_json(&entries)[1..]);
    let header = common::pad_json(&json, 4096 - 8 + 100);
    let data = common::content(0x51ce, 13 + 600_000 + 6 * 50 * 700 * 4);
    let bytes = common::container_bytes(&header, &data);
    std::fs::write(dir.join("model.safetensors"), &bytes).unwrap();
    bytes
}

#[test]
fn slices_land_as_the_oracle_says_rows_columns_and_blocks() {
    let tmp = common::tempdir();
    let dir = tmp.path().join("matrices");
    let file = matrices(&dir);
    let model = Model::open(ModelConfig::new(&dir)).unwrap();
    let (w, x) = (model.tensor("w").unwrap(), model.tensor("x").unwrap());
    let blocks: Vec<(&TensorRef, Vec<Range<usize>>)> = vec![
        (w, vec![0..150]),                // rows: a column-parallel rank
        (w, vec![150..300]),              //
        (w, vec![0..300, 0..500]),        // columns: a row-parallel rank
        (w, vec![0..300, 500..1000]),     //
        (w, vec![7..9, 3..997]),          // a block
        (x, vec![0..6, 0..50, 350..700]), // the last dimension of a 3-D tensor
        (x, vec![2..3]),                  // one expert
    ];
    for backend in common::engine_backend_choices() {
        let e = engine(&model, backend);
        for (in_place, staging) in [(true, 64 << 10), (false, 1 << 20), (true, 16 << 20)] {
            let slices: Vec<_> = blocks.iter().map(|(t, b)| t.slice(b).unwrap()).collect();
            let lens: Vec<usize> = slices.iter().map(|s| s.len() as usize).collect();
            // Each slice at a page start plus 0..: rows in phase or not.
            let mut at = Vec::new();
            let mut cursor = PAGE;
            for (i, n) in lens.iter().enumerate() {
                at.push(cursor + i * 7);
                cursor = (cursor + i * 7 + n + 100).div_ceil(PAGE) * PAGE + PAGE;
            }
            let mut buf = Buf::new(cursor + PAGE);
            let opts = FillOptions {
                staging_bytes: staging,
                in_place,
                ..FillOptions::default()
            };
            let r = {
                let targets = dests(buf.bytes_mut(), &at, &lens)
                    .into_iter()
                    .zip(&slices)
                    .map(|(d, s)| FillTarget::slice(s, d))
                    .collect();
                e.fill(targets, &opts).unwrap()
            };
            let got = buf.bytes_mut();
            for (i, (t, b)) in blocks.iter().enumerate() {
                let whole = &file[t.offset as usize..(t.offset + t.len) as usize];
                assert!(
                    got[at[i]..at[i] + lens[i]] == naive(t, whole, b)[..],
                    "{backend:?} staging {staging}: {} {b:?} differs",
                    t.name
                );
            }
            assert_guards(got, &at, &lens, &format!("{backend:?} slices"));
            assert_eq!(r.bytes, lens.iter().map(|&n| n as u64).sum::<u64>());
            assert_eq!(r.in_place_bytes + r.staged_bytes + r.buffered_bytes, r.bytes, "{r:?}");
            // Columns move at most their covering rows' blocks.
            assert!(r.bytes_read < file.len() as u64 * 2, "{r:?}");
        }
    }
}

#[test]
fn a_whole_model_fills_through_a_budget_far_smaller_than_it_and_counts_in_the_stats() {
    let tmp = common::tempdir();
    let dir = tmp.path().join("synth");
    let digests = common::reference_or_synth(&dir);
    let model = Model::open(ModelConfig::new(&dir)).unwrap();
    let Some(digests) = digests else {
        // The synthetic model: Engine::read's bytes are the oracle.
        whole_model_against_reads(&model);
        return;
    };
    for backend in common::engine_backend_choices() {
        let e = engine(&model, backend);
        let tensors: Vec<TensorRef> = model.catalog().tensors().to_vec();
        let mut bufs: Vec<Vec<u8>> = tensors.iter().map(|t| vec![GUARD; t.len as usize]).collect();
        let before = e.stats().staged.reads;
        let r = e
            .fill(
                bufs.iter_mut()
                    .zip(&tensors)
                    .map(|(b, t)| FillTarget::tensor(t, b))
                    .collect(),
                &FillOptions {
                    staging_bytes: 1 << 20,
                    ..FillOptions::default()
                },
            )
            .unwrap();
        for (t, b) in tensors.iter().zip(&bufs) {
            assert_eq!(common::sha256_hex(b), digests[&t.name], "{backend:?}: {}", t.name);
        }
        let st = e.stats().staged;
        assert_eq!(
            st.reads - before,
            r.staged_reads,
            "{backend:?}: Stats::staged counts the fill's pieces"
        );
        assert!(st.staging_bytes >= r.staging_bytes as u64, "{st:?}");
    }
}

fn whole_model_against_reads(model: &Model) {
    for backend in common::engine_backend_choices() {
        let e = engine(model, backend);
        let tensors: Vec<TensorRef> = model.catalog().tensors().to_vec();
        let mut bufs: Vec<Vec<u8>> = tensors.iter().map(|t| vec![GUARD; t.len as usize]).collect();
        e.fill(
            bufs.iter_mut()
                .zip(&tensors)
                .map(|(b, t)| FillTarget::tensor(t, b))
                .collect(),
            &FillOptions {
                staging_bytes: 1 << 20,
                ..FillOptions::default()
            },
        )
        .unwrap();
        let arena = e.packed_arena(8 << 20, false).unwrap();
        for (t, b) in tensors.iter().zip(&bufs) {
            let l = e.read(t, arena.take_for(t).unwrap()).unwrap().wait().unwrap();
            assert!(l.bytes() == &b[..], "{backend:?}: {}", t.name);
        }
    }
}

#[test]
fn misuse_is_refused_before_anything_is_read() {
    let tmp = common::tempdir();
    let dir = tmp.path().join("awkward");
    let (_, placed) = awkward(&dir);
    let model = Model::open(ModelConfig::new(&dir)).unwrap();
    let e = engine(&model, BackendChoice::Auto);
    let a = model.tensor(&placed[0].0).unwrap();
    let b = model.tensor(&placed[1].0).unwrap();
    let reads_before = e.stats().bytes;
    // A destination of the wrong length names the tensor and both lengths.
    let mut short = vec![GUARD; a.len as usize - 1];
    let err = e
        .fill(vec![FillTarget::tensor(a, &mut short)], &FillOptions::default())
        .unwrap_err()
        .to_string();
    assert!(
        err.contains(&a.name) && err.contains(&a.len.to_string()) && err.contains(&(a.len - 1).to_string()),
        "{err}"
    );
    assert!(short.iter().all(|&x| x == GUARD));
    // Two destinations over the same bytes.
    let mut one = vec![GUARD; (a.len + b.len) as usize];
    let p = one.as_mut_ptr();
    // SAFETY: both targets lie inside `one`, which outlives the call; the
    // call refuses them (they overlap) before it writes anything.
    let (ta, tb) = unsafe {
        (
            FillTarget::from_raw(a, None, std::ptr::NonNull::new(p).unwrap(), a.len as usize),
            FillTarget::from_raw(b, None, std::ptr::NonNull::new(p.add(10)).unwrap(), b.len as usize),
        )
    };
    let err = e.fill(vec![ta, tb], &FillOptions::default()).unwrap_err().to_string();
    assert!(
        err.contains("overlap") && err.contains(&a.name) && err.contains(&b.name),
        "{err}"
    );
    assert!(one.iter().all(|&x| x == GUARD));
    // A tensor of another model.
    let other_dir = tmp.path().join("other");
    matrices(&other_dir);
    let other = Model::open(ModelConfig::new(&other_dir)).unwrap();
    let foreign = other.tensor("w").unwrap();
    let mut dest = vec![GUARD; foreign.len as usize];
    let err = e.fill(vec![FillTarget::tensor(foreign, &mut dest)], &FillOptions::default());
    assert!(matches!(err, Err(Error::ForeignTensor { .. })), "{err:?}");
    assert_eq!(e.stats().bytes, reads_before, "nothing was read");
}

#[test]
fn a_shard_cut_short_fails_saying_which_destinations_are_complete() {
    let tmp = common::tempdir();
    let dir = tmp.path().join("awkward");
    let (file, placed) = awkward(&dir);
    for backend in common::engine_backend_choices() {
        let model = Model::open(ModelConfig::new(&dir)).unwrap();
        let e = engine(&model, backend);
        let tensors: Vec<TensorRef> = placed
            .iter()
            .map(|(n, _, _)| model.tensor(n).unwrap().clone())
            .collect();
        let big = tensors.iter().find(|t| t.name == "big").unwrap().clone();
        std::fs::OpenOptions::new()
            .write(true)
            .open(dir.join("model.safetensors"))
            .unwrap()
            .set_len(big.offset + big.len / 2)
            .unwrap();
        let mut bufs: Vec<Vec<u8>> = tensors.iter().map(|t| vec![GUARD; t.len as usize]).collect();
        let err = e
            .fill(
                bufs.iter_mut()
                    .zip(&tensors)
                    .map(|(b, t)| FillTarget::tensor(t, b))
                    .collect(),
                &FillOptions {
                    staging_bytes: 1 << 20,
                    ..FillOptions::default()
                },
            )
            .unwrap_err();
        let Error::Incomplete {
            done,
            total,
            complete,
            incomplete,
            ..
        } = &err
        else {
            panic!("{backend:?}: {err:?}")
        };
        assert_eq!(*total, tensors.len());
        // The tensors before the cut may be complete; "big" and everything
        // after it (but the empty one) cannot be.
        assert!(*done <= 5, "{backend:?}: {err}");
        assert!(err.to_string().contains("partly written"), "{err}");
        // Which ones: the complete ones by index, each holding its bytes;
        // the others by name, in the message too.
        assert_eq!(complete.len(), *done);
        assert_eq!(complete.len() + incomplete.len(), *total);
        for &i in complete {
            let t = &tensors[i];
            assert!(
                bufs[i][..] == file[t.offset as usize..(t.offset + t.len) as usize],
                "{}",
                t.name
            );
            assert!(!incomplete.contains(&t.name));
        }
        for name in ["big", "tiny", "last"] {
            assert!(
                incomplete.iter().any(|n| n == name),
                "{backend:?}: {name} in {incomplete:?}"
            );
            assert!(err.to_string().contains(name), "{err}");
        }
        // Put the file back for the next backend.
        awkward(&dir);
    }
}

#[test]
fn a_cancelled_fill_starts_no_read_after_it_and_says_so() {
    let tmp = common::tempdir();
    let dir = tmp.path().join("awkward");
    let (_, placed) = awkward(&dir);
    let model = Model::open(ModelConfig::new(&dir)).unwrap();
    let e = engine(&model, BackendChoice::Auto);
    let tensors: Vec<TensorRef> = placed
        .iter()
        .map(|(n, _, _)| model.tensor(n).unwrap().clone())
        .collect();
    let mut bufs: Vec<Vec<u8>> = tensors.iter().map(|t| vec![GUARD; t.len as usize]).collect();
    let cancel = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(true));
    let before = e.stats().bytes;
    let err = e
        .fill(
            bufs.iter_mut()
                .zip(&tensors)
                .map(|(b, t)| FillTarget::tensor(t, b))
                .collect(),
            &FillOptions {
                cancel: Some(cancel),
                ..FillOptions::default()
            },
        )
        .unwrap_err();
    assert!(
        matches!(&err, Error::Incomplete { total, .. } if *total == tensors.len()),
        "{err:?}"
    );
    assert!(err.to_string().contains("cancelled"), "{err}");
    assert_eq!(e.stats().bytes, before, "no read started");
    assert!(bufs.iter().flatten().all(|&b| b == GUARD));
}

/// A shard of `n` U8 tensors growing slowly in size (`base + i * step`
/// bytes), back to back.
fn growing(dir: &std::path::Path, n: usize, base: u64, step: u64) -> Vec<(String, u64)> {
    std::fs::create_dir_all(dir).unwrap();
    let mut l = common::Layout::new(4096);
    let mut at = 4096;
    let mut out = Vec::new();
    for i in 0..n {
        let (name, len) = (format!("t{i:03}"), base + i as u64 * step);
        l.place(&name, at, len);
        out.push((name, len));
        at += len;
    }
    l.write(&dir.join("model.safetensors"), 0x5eed);
    out
}

/// Fills that each need a little more staging than the last, many calls
/// of them, and several callers at once: the staging an engine maps for
/// fills never exceeds the budget (the peak in its stats), and the bytes
/// are the file's. (A fill used to map a new arena of exactly what it
/// needed whenever no idle one was large enough, and keep them all: 32
/// growing fills kept the sum of their sizes.)
#[test]
fn fill_staging_stays_within_the_budget_whatever_the_sizes_calls_and_callers() {
    let tmp = common::tempdir();
    let dir = tmp.path().join("growing");
    let tensors = growing(&dir, 32, 300_000, 40_000);
    let bytes = std::fs::read(dir.join("model.safetensors")).unwrap();
    let model = Model::open(ModelConfig::new(&dir)).unwrap();
    let budget = 4 << 20;
    let opts = FillOptions {
        staging_bytes: budget,
        in_place: false,
        ..FillOptions::default()
    };
    let fill_one = |e: &Engine, name: &str| {
        let t = model.tensor(name).unwrap();
        let mut dest = vec![GUARD; t.len as usize];
        e.fill(vec![FillTarget::tensor(t, &mut dest)], &opts).unwrap();
        assert!(
            dest[..] == bytes[t.offset as usize..(t.offset + t.len) as usize],
            "{name}"
        );
    };
    for backend in common::engine_backend_choices() {
        let e = engine(&model, backend);
        // Growing sizes, one tensor a call, ten rounds.
        for _ in 0..10 {
            for (name, _) in &tensors {
                fill_one(&e, name);
            }
        }
        let st = e.stats().staged;
        assert!(
            st.staging_peak_bytes <= budget as u64 && st.staging_bytes <= budget as u64,
            "{backend:?}: {st:?} (budget {budget})"
        );
        // Four callers at once, each over every tensor.
        std::thread::scope(|s| {
            for k in 0..4 {
                let (e, tensors, fill_one) = (&e, &tensors, &fill_one);
                s.spawn(move || {
                    for (name, _) in tensors.iter().skip(k).step_by(2) {
                        fill_one(e, name);
                    }
                });
            }
        });
        // And one call of them all.
        let all: Vec<TensorRef> = tensors.iter().map(|(n, _)| model.tensor(n).unwrap().clone()).collect();
        let mut bufs: Vec<Vec<u8>> = all.iter().map(|t| vec![GUARD; t.len as usize]).collect();
        e.fill(
            bufs.iter_mut()
                .zip(&all)
                .map(|(b, t)| FillTarget::tensor(t, b))
                .collect(),
            &opts,
        )
        .unwrap();
        for (t, b) in all.iter().zip(&bufs) {
            assert!(
                b[..] == bytes[t.offset as usize..(t.offset + t.len) as usize],
                "{}",
                t.name
            );
        }
        let st = e.stats().staged;
        assert!(
            st.staging_peak_bytes <= budget as u64,
            "{backend:?}: concurrent fills mapped {st:?} (budget {budget})"
        );
    }
}

/// Copy threads: more than the limit is refused before anything is read,
/// and a fill never starts more threads than it has staged pieces.
#[test]
fn copy_threads_are_bounded_by_the_limit_and_by_the_pieces() {
    let tmp = common::tempdir();
    let dir = tmp.path().join("growing");
    let tensors = growing(&dir, 2, 4 << 20, 0);
    let model = Model::open(ModelConfig::new(&dir)).unwrap();
    let e = engine(&model, BackendChoice::Auto);
    let t = model.tensor(&tensors[0].0).unwrap();
    let mut dest = vec![GUARD; t.len as usize];
    let before = e.stats().bytes;
    let err = e
        .fill(
            vec![FillTarget::tensor(t, &mut dest)],
            &FillOptions {
                copy_threads: Some(weightstream::FILL_COPY_THREADS_LIMIT + 1),
                ..FillOptions::default()
            },
        )
        .unwrap_err();
    assert!(
        err.to_string()
            .contains(&weightstream::FILL_COPY_THREADS_LIMIT.to_string()),
        "{err}"
    );
    assert_eq!(e.stats().bytes, before, "nothing was read");
    let r = e
        .fill(
            vec![FillTarget::tensor(t, &mut dest)],
            &FillOptions {
                copy_threads: Some(weightstream::FILL_COPY_THREADS_LIMIT),
                in_place: false,
                ..FillOptions::default()
            },
        )
        .unwrap();
    assert!(r.staged_reads > 0);
    assert!(
        r.copy_threads as u64 <= r.staged_reads,
        "{} copy threads for {} pieces",
        r.copy_threads,
        r.staged_reads
    );
}
