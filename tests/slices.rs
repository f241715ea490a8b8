//! Tensor-parallel slices read alone (`TensorRef::slice`,
//! `Engine::read_slice`): every block of a grid equals the reference
//! reader's slice (`safe_open(...).get_slice(name)[...]`) and an
//! element-by-element oracle, at awkward places in caller memory, on both
//! backends and both direct modes; column parts of at least 64 KiB a row
//! read at most 1.1x their bytes; misuse is an error, not a write.

// One range (rows) is a slice with one dimension cut, not a mistaken range.
#![allow(clippy::single_range_in_vec_init)]

mod common;

use std::ops::Range;

use weightstream::{BackendChoice, DirectMode, Engine, EngineConfig, Model, ModelConfig, Scratch, TensorRef};

fn engine(model: &Model, backend: BackendChoice) -> Engine {
    Engine::new(model, EngineConfig::default().backend(backend)).unwrap()
}

/// "a:b,c:d" -> [a..b, c..d].
fn parse_block(spec: &str) -> Vec<Range<usize>> {
    spec.split(',')
        .map(|r| {
            let (a, b) = r.split_once(':').unwrap();
            a.parse().unwrap()..b.parse().unwrap()
        })
        .collect()
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

/// The reference model (`ref_blocks.py`) and its lines, or `None` (SKIP)
/// without the reference reader.
fn reference(dir: &std::path::Path) -> Option<String> {
    common::run_reference("ref_blocks.py", &[dir.as_os_str()])
}

#[test]
fn blocks_equal_the_reference_readers_slices() {
    let tmp = common::tempdir();
    let dir = tmp.path().join("blocks");
    let Some(lines) = reference(&dir) else {
        return;
    };
    assert!(lines.lines().count() > 50, "{lines}");
    for direct in [DirectMode::Auto, DirectMode::Off] {
        let model = Model::open(ModelConfig::new(&dir).direct(direct)).unwrap();
        for backend in common::engine_backend_choices() {
            let e = engine(&model, backend);
            let arena = e.packed_arena(8 << 20, false).unwrap();
            for (i, line) in lines.lines().enumerate() {
                let (hex, rest) = line.split_once("  ").unwrap();
                let (name, spec) = rest.split_once(' ').unwrap();
                let t = model.tensor(name).unwrap();
                let bounds = parse_block(spec);
                let s = t.slice(&bounds).unwrap();
                // At the start, at an odd byte, and one past a page.
                let at = [0, 1, 4096 + 7][i % 3];
                let l = e.read_slice(&s, &arena, at, Scratch::Before).unwrap().wait().unwrap();
                assert_eq!(common::sha256_hex(&l), hex, "{direct:?} {backend:?}: {rest} at {at}");
                assert_eq!(l.shape(), s.shape(), "{rest}");
                assert_eq!(l.dtype(), t.dtype, "{rest}");
                assert_eq!(l.len() as u64, s.len());
                assert_eq!(l.offset(), at, "{rest}: the slice lands where it was asked");
            }
            let st = e.stats().slices;
            assert_eq!(st.reads, lines.lines().count() as u64);
            assert!(st.bytes_read >= st.bytes_wanted, "{st:?}");
        }
    }
}

/// A model the test writes itself (no Python needed): the same shapes as
/// the reference's, bytes from `common::content`, the data section at an
/// odd offset so no tensor starts on a block.
fn own_model(dir: &std::path::Path) -> (Model, Vec<u8>) {
    std::fs::create_dir_all(dir).unwrap();
    let specs: [(&str, &str, usize, Vec<usize>); 5] = [
        ("a.odd", "U8", 1, vec![13, 1001]),
        ("b.narrow", "F32", 4, vec![300, 96]),
        ("c.cube", "F16", 2, vec![5, 7, 33]),
        ("wide.w2", "F16", 2, vec![12, 65536]),
        ("wide.w4", "F32", 4, vec![6, 65536]),
    ];
    let mut entries = Vec::new();
    let mut at = 0u64;
    for (name, dtype, size, shape) in &specs {
        let len = (*size * shape.iter().product::<usize>()) as u64;
        entries.push(common::Entry {
            name: name.to_string(),
            dtype: dtype.to_string(),
            shape: shape.clone(),
            begin: at,
            end: at + len,
        });
        at += len;
    }
    let data = common::content(41, at as usize);
    let json = common::header_json(&entries);
    let header = common::pad_json(&json, json.len() + 1001);
    common::write_container(&dir.join("model.safetensors"), &header, &data);
    (Model::open(ModelConfig::new(dir)).unwrap(), data)
}

fn whole<'a>(model: &Model, data: &'a [u8], t: &TensorRef) -> &'a [u8] {
    let shard = &model.catalog().shards()[t.shard];
    let start = (t.offset - shard.header.data_start) as usize;
    &data[start..start + t.len as usize]
}

#[test]
fn every_block_of_a_grid_equals_the_oracle_and_waits_in_steps() {
    let tmp = common::tempdir();
    let (model, data) = own_model(&tmp.path().join("m"));
    for backend in common::engine_backend_choices() {
        let e = engine(&model, backend);
        let arena = e.packed_arena(8 << 20, false).unwrap();
        let mut n = 0;
        for t in model.catalog().tensors() {
            let bytes = whole(&model, &data, t);
            let dims = t.shape.len();
            // Every range of the first dimension in steps of a third, and
            // of the last dimension (first ones whole).
            let cuts = |n: usize| [0, n / 3, n / 2, n - 1, n].into_iter().collect::<Vec<_>>();
            let mut blocks = Vec::new();
            for &a in &cuts(t.shape[0]) {
                for &b in &cuts(t.shape[0]) {
                    if a < b {
                        blocks.push(vec![a..b]);
                    }
                }
            }
            let last = t.shape[dims - 1];
            for &a in &cuts(last) {
                for &b in &cuts(last) {
                    if a < b {
                        let mut v: Vec<Range<usize>> = t.shape[..dims - 1].iter().map(|&n| 1.min(n - 1)..n).collect();
                        v.push(a..b);
                        blocks.push(v);
                    }
                }
            }
            for bounds in blocks {
                let s = t.slice(&bounds).unwrap();
                let want = naive(t, bytes, &bounds);
                assert_eq!(s.len() as usize, want.len());
                let at = 3 * n % 5000;
                let mut ticket = e.read_slice(&s, &arena, at, Scratch::Before).unwrap();
                // Polled to the end (no clock: each round either copies a
                // landed piece or finds one still in flight).
                let l = loop {
                    match ticket.try_wait() {
                        Ok(r) => break r.unwrap(),
                        Err(t) => {
                            ticket = t;
                            std::thread::yield_now();
                        }
                    }
                };
                assert!(l[..] == want[..], "{backend:?} {}: {bounds:?}", t.name);
                n += 1;
            }
        }
        assert_eq!(n, 100, "blocks read");
    }
}

/// The done-means figure: 2- and 4-way column parts of at least 64 KiB a
/// row read at most 1.1x their bytes, in the plan, in the stats and at the
/// drive.
#[test]
fn column_parts_of_64_kib_read_at_most_1_1x_their_bytes() {
    let tmp = common::tempdir();
    let (model, data) = own_model(&tmp.path().join("m"));
    let e = engine(&model, BackendChoice::Auto);
    let arena = e.packed_arena(8 << 20, false).unwrap();
    for (name, world) in [("wide.w2", 2), ("wide.w4", 4)] {
        let t = model.tensor(name).unwrap();
        let (rows, cols) = (t.shape[0], t.shape[1]);
        for rank in 0..world {
            let part = cols / world * rank..cols / world * (rank + 1);
            let s = t.slice(&[0..rows, part.clone()]).unwrap();
            assert!(s.len() / rows as u64 >= 64 << 10, "each row's part is at least 64 KiB");
            let plan = s.plan(e.direct_align() as u64, weightstream::SLICE_GAP_BYTES);
            assert_eq!(plan.pieces.len(), rows, "{name} rank {rank}: one piece a row");
            assert!(
                plan.read * 10 <= plan.wanted * 11,
                "{name} rank {rank}: {} of {}",
                plan.read,
                plan.wanted
            );
            let (before, drive0) = (e.stats().slices, e.stats().bytes);
            let l = e.read_slice(&s, &arena, 0, Scratch::Before).unwrap().wait().unwrap();
            assert!(l[..] == naive(t, whole(&model, &data, t), &[0..rows, part])[..]);
            let (after, drive1) = (e.stats().slices, e.stats().bytes);
            let (wanted, read) = (
                after.bytes_wanted - before.bytes_wanted,
                after.bytes_read - before.bytes_read,
            );
            assert_eq!(wanted, s.len());
            assert!(read * 10 <= wanted * 11, "{name} rank {rank}: read {read} for {wanted}");
            assert!(
                (drive1 - drive0) * 10 <= wanted * 11,
                "{name} rank {rank}: the drive moved {}",
                drive1 - drive0
            );
            assert_eq!(after.pieces - before.pieces, rows as u64);
        }
    }
    let st = e.stats();
    assert!(st.slices.read_amplification().unwrap() <= 1.1, "{:?}", st.slices);
    assert!(st.to_string().contains("slices: 6 read as"), "{st}");
}

#[test]
fn rows_are_one_read_and_narrow_columns_one_window() {
    let tmp = common::tempdir();
    let (model, data) = own_model(&tmp.path().join("m"));
    let e = engine(&model, BackendChoice::Auto);
    let arena = e.packed_arena(8 << 20, false).unwrap();
    let t = model.tensor("b.narrow").unwrap();
    let rows = t.slice(&[10..20]).unwrap();
    let ticket = e.read_slice(&rows, &arena, 0, Scratch::Before).unwrap();
    assert_eq!(ticket.pieces(), 1);
    assert_eq!(ticket.wait().unwrap().shape(), &[10, 96]);
    // 300 rows of 384 bytes, half of each: the gaps are short, one window.
    let cols = t.slice(&[0..300, 0..48]).unwrap();
    assert!(cols.plan(4096, weightstream::SLICE_GAP_BYTES).is_window());
    let ticket = e.read_slice(&cols, &arena, 0, Scratch::Before).unwrap();
    assert_eq!(ticket.pieces(), 1);
    let l = ticket.wait().unwrap();
    assert!(l[..] == naive(t, whole(&model, &data, t), &[0..300, 0..48])[..]);
    assert_eq!(e.stats().slices.runs, 1 + 300);
}

#[test]
fn misuse_is_an_error_and_writes_nothing() {
    let tmp = common::tempdir();
    let (model, _) = own_model(&tmp.path().join("m"));
    let e = engine(&model, BackendChoice::Auto);
    let t = model.tensor("wide.w2").unwrap();
    let s = t.slice(&[0..12, 0..32768]).unwrap();
    let arena = e.packed_arena(4 << 20, false).unwrap();
    // Outside the memory.
    let err = e.read_slice(&s, &arena, (4 << 20) - 100, Scratch::Before).unwrap_err();
    assert!(err.to_string().contains("outside"), "{err}");
    // A tensor this model does not have.
    let mut alien = t.clone();
    alien.name = "not.in.model".into();
    let err = e
        .read_slice(&alien.slice(&[0..12, 0..32768]).unwrap(), &arena, 0, Scratch::Before)
        .unwrap_err();
    assert!(err.to_string().contains("not.in.model"), "{err}");
    // Overlapping a slice still held.
    let held = e.read_slice(&s, &arena, 0, Scratch::Before).unwrap();
    let err = e.read_slice(&s, &arena, 1000, Scratch::Before).unwrap_err();
    assert!(err.to_string().contains("overlap"), "{err}");
    // Dropped before it resolves: its bytes are free again, and nothing
    // the kernel writes lands there (pieces go to staging).
    drop(held);
    let l = e.read_slice(&s, &arena, 1000, Scratch::Before).unwrap().wait().unwrap();
    assert_eq!(l.len() as u64, s.len());
    drop(l);
    // An arena of fixed slots is refused.
    let fixed = e.arena(weightstream::SlotSpec::new(1 << 20), 1).unwrap();
    let err = e.read_slice(&s, &fixed, 0, Scratch::Before).unwrap_err();
    assert!(err.to_string().contains("packed"), "{err}");
    // Bad bounds name the tensor.
    let err = t.slice(&[0..13]).unwrap_err().to_string();
    assert!(err.contains("wide.w2") && err.contains("dimension 0"), "{err}");
}

/// A slice of many pieces polled as a future: its waker is woken once
/// every piece has landed, never at a piece before the last (the C ABI's
/// eventfd rests on this), and the poll after the wake is ready.
#[test]
fn a_slice_wakes_its_waker_only_when_every_piece_landed() {
    use std::future::Future;
    use std::sync::mpsc;
    use std::task::{Context, Poll, Wake, Waker};

    struct Signal(std::sync::Mutex<mpsc::Sender<()>>);
    impl Wake for Signal {
        fn wake(self: std::sync::Arc<Self>) {
            let _ = self.0.lock().unwrap().send(());
        }
    }
    let tmp = common::tempdir();
    let (model, data) = own_model(&tmp.path().join("m"));
    for backend in common::engine_backend_choices() {
        let e = engine(&model, backend);
        let arena = e.packed_arena(8 << 20, false).unwrap();
        let t = model.tensor("wide.w4").unwrap();
        for rank in 0..4 {
            let bounds = [0..6, 16384 * rank..16384 * (rank + 1)];
            let s = t.slice(&bounds).unwrap();
            let mut ticket = e.read_slice(&s, &arena, 0, Scratch::Before).unwrap();
            assert_eq!(ticket.pieces(), 6, "one piece a row");
            let (tx, rx) = mpsc::channel();
            let waker = Waker::from(std::sync::Arc::new(Signal(std::sync::Mutex::new(tx))));
            let mut cx = Context::from_waker(&waker);
            let l = match std::pin::Pin::new(&mut ticket).poll(&mut cx) {
                Poll::Ready(r) => r.unwrap(),
                Poll::Pending => {
                    // A watchdog, not a timing: a waker never woken fails
                    // here instead of hanging the suite.
                    rx.recv_timeout(std::time::Duration::from_secs(120))
                        .unwrap_or_else(|_| panic!("{backend:?}: the waker was never woken"));
                    match std::pin::Pin::new(&mut ticket).poll(&mut cx) {
                        Poll::Ready(r) => r.unwrap(),
                        Poll::Pending => panic!("{backend:?}: woken before the last piece landed"),
                    }
                }
            };
            assert!(l[..] == naive(t, whole(&model, &data, t), &bounds)[..]);
        }
    }
}

/// A sparse file holding one U8 tensor of `rows` x `width`, row `r`'s
/// first `written` bytes `(7 r + c) % 251`, the rest holes (zeros): a wide
/// tensor without writing it.
fn sparse_model(dir: &std::path::Path, rows: usize, width: usize, written: usize) -> Model {
    use std::os::unix::fs::FileExt;
    std::fs::create_dir_all(dir).unwrap();
    let len = (rows * width) as u64;
    let json = common::header_json(&[common::Entry {
        name: "t".into(),
        dtype: "U8".into(),
        shape: vec![rows, width],
        begin: 0,
        end: len,
    }]);
    let header = common::pad_json(&json, json.len() + 3);
    let path = dir.join("model.safetensors");
    std::fs::write(&path, common::container_bytes(&header, &[])).unwrap();
    let f = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
    let data_start = 8 + header.len() as u64;
    f.set_len(data_start + len).unwrap();
    for r in 0..rows {
        let row: Vec<u8> = (0..written).map(|c| ((7 * r + c) % 251) as u8).collect();
        f.write_all_at(&row, data_start + (r * width) as u64).unwrap();
    }
    drop(f);
    Model::open(ModelConfig::new(dir)).unwrap()
}

/// The review's unbounded case, scaled: a narrow column of a wide tensor,
/// rows far apart, so every row is a piece of its own (2048 pieces of 2-3
/// blocks, about 20 MiB of blocks). Its staging stays within the engine's
/// window (1 MiB here): the first staging arena (16 MiB) is never
/// outgrown, the call read through its window, and every byte is right.
/// Before, every piece was submitted at once, each with its own staging:
/// staging grew to hold them all (the review's 4 GiB) and stayed.
#[test]
fn a_sparse_column_reads_through_a_bounded_staging_window() {
    let tmp = common::tempdir();
    let (rows, width, cols) = (2048, 100_000, 5000);
    let model = sparse_model(&tmp.path().join("m"), rows, width, cols);
    let t = model.tensor("t").unwrap();
    for backend in common::engine_backend_choices() {
        let e = Engine::new(&model, EngineConfig::default().backend(backend).slice_staging(1 << 20)).unwrap();
        let s = t.slice(&[0..rows, 0..cols]).unwrap();
        let plan = e.slice_plan(&s);
        assert_eq!(plan.pieces.len(), rows, "one piece a row");
        assert!(
            plan.read > 16 << 20,
            "the pieces need more than the first staging arena: {}",
            plan.read
        );
        let arena = e.packed_arena(s.len() as usize + 4096, false).unwrap();
        let l = e.read_slice(&s, &arena, 0, Scratch::Before).unwrap().wait().unwrap();
        let want: Vec<u8> = (0..rows)
            .flat_map(|r| (0..cols).map(move |c| ((7 * r + c) % 251) as u8))
            .collect();
        assert!(l[..] == want[..], "{backend:?}: the slice's bytes");
        let st = e.stats();
        assert_eq!(st.slices.windowed, 1, "{backend:?}: {:?}", st.slices);
        assert_eq!(st.slices.bytes_read, plan.read);
        assert!(
            st.staged.staging_peak_bytes <= 16 << 20,
            "{backend:?}: staging grew to {} bytes for a 1 MiB window",
            st.staged.staging_peak_bytes
        );
    }
}

/// Staging grown by many slices in flight at once (each holds its last
/// window until waited on) is given back when they resolve: idle staging
/// beyond the window (or the first arena) is unmapped, and what is left
/// reads again.
#[test]
fn staging_grown_by_slices_in_flight_shrinks_back_when_they_resolve() {
    let tmp = common::tempdir();
    let (rows, width, cols) = (1024, 100_000, 5000);
    let model = sparse_model(&tmp.path().join("m"), rows, width, cols);
    let t = model.tensor("t").unwrap();
    let e = Engine::new(&model, EngineConfig::default().slice_staging(1 << 20)).unwrap();
    let n = 20;
    let slices: Vec<_> = (0..n)
        .map(|k| t.slice(&[0..rows, k * cols..(k + 1) * cols]).unwrap())
        .collect();
    let arena = e.packed_arena(n * (rows * cols + 4096), false).unwrap();
    let tickets: Vec<_> = slices
        .iter()
        .enumerate()
        .map(|(k, s)| {
            e.read_slice(s, &arena, k * (rows * cols + 4096), Scratch::Before)
                .unwrap()
        })
        .collect();
    let grown = e.stats().staged.staging_bytes;
    assert!(
        grown > 16 << 20,
        "20 windows of 1 MiB in flight outgrow the first arena: {grown}"
    );
    for (k, tk) in tickets.into_iter().enumerate() {
        let l = tk.wait().unwrap();
        if k == 0 {
            let want: Vec<u8> = (0..rows)
                .flat_map(|r| (0..cols).map(move |c| ((7 * r + c) % 251) as u8))
                .collect();
            assert!(l[..] == want[..]);
        } else {
            assert!(l.iter().all(|&b| b == 0), "slice {k}: holes read as zeros");
        }
    }
    let st = e.stats().staged;
    assert!(st.staging_peak_bytes >= grown);
    assert!(
        st.staging_bytes <= 16 << 20,
        "idle staging was not given back: {} bytes mapped after every slice resolved",
        st.staging_bytes
    );
    // What is left serves the next slice.
    let l = e
        .read_slice(&slices[0], &arena, 0, Scratch::Before)
        .unwrap()
        .wait()
        .unwrap();
    assert_eq!(l.len(), rows * cols);
}
