//! A block of a row-major tensor (a tensor-parallel rank's rows or
//! columns), as the byte runs it is made of, and the plan that reads those
//! runs without the tensor's other bytes.
//!
//! A slice keeps a range of every dimension. Its bytes in the file are
//! runs: one per index of the dimensions before the last one it cuts
//! (rows of a column slice), each as long as that dimension's range times
//! the elements inside it. Rows `a..b` (dimension 0 only) are one run.
//!
//! The plan ([`TensorSlice::plan`]) reads neighbouring runs as one piece
//! when the whole blocks between them total at most a gap (the engine's is
//! [`SLICE_GAP_BYTES`]): one more request costs a drive about as long as
//! moving that many bytes, so reading through a short gap is no slower
//! and saves a request. Long gaps split the pieces, so a rank's columns of
//! a wide tensor read little more than the rank's bytes. A slice whose
//! gaps are all short becomes one read of its covering window; the runs
//! are then compacted out of it.

use std::ops::Range;

use crate::error::{Error, Result};
use crate::format::catalog::TensorRef;
use crate::format::dtype::Dtype;

/// The gap (bytes of whole blocks between two runs) up to which the
/// engine reads two runs as one piece. 32 KiB is what an NVMe drive moves
/// in the time of one more request at queue depth (about 5-10 µs at
/// 3-7 GB/s); longer gaps are skipped.
pub const SLICE_GAP_BYTES: u64 = 32 << 10;

/// The most runs one slice may have (16 Mi): beyond that the run list
/// itself (24 bytes a run) costs more than reading the covering rows.
pub const MAX_SLICE_RUNS: u64 = 1 << 24;

/// Bytes `src..src + len` of the tensor's payload, landing at `dst` of
/// the slice's compact row-major bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Run {
    /// Offset in the tensor's payload.
    pub src: u64,
    /// Offset in the slice's bytes.
    pub dst: u64,
    /// Length in bytes.
    pub len: u64,
}

/// A block of a tensor: a range of each dimension. Made by
/// [`TensorRef::slice`]; read by `Engine::read_slice`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorSlice {
    tensor: TensorRef,
    bounds: Vec<Range<usize>>,
    shape: Vec<usize>,
    runs: Vec<Run>,
    len: u64,
}

/// One read of a [`SlicePlan`]: bytes `range` of the tensor's payload,
/// holding the slice's runs `runs` (indices into [`TensorSlice::runs`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Piece {
    /// Bytes of the tensor's payload read as one.
    pub range: Range<u64>,
    /// The runs it holds.
    pub runs: Range<usize>,
}

/// How a slice is read: its pieces, the bytes wanted (the slice's) and
/// the bytes the drives move for them (each piece's whole blocks).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SlicePlan {
    /// The reads, in file order.
    pub pieces: Vec<Piece>,
    /// The slice's bytes.
    pub wanted: u64,
    /// Bytes of the whole blocks the pieces span.
    pub read: u64,
}

impl SlicePlan {
    /// Whether the slice is read as one piece holding more than one run
    /// (its covering window, compacted).
    pub fn is_window(&self) -> bool {
        self.pieces.len() == 1 && self.pieces[0].runs.len() > 1
    }
}

impl TensorRef {
    /// The block of this tensor that keeps `bounds[d]` of each dimension
    /// `d` (dimensions past `bounds.len()` are kept whole), in row-major
    /// order, as tensor-parallel loaders slice a weight: `[a..b]` is rows,
    /// `[0..rows, a..b]` columns. A bound outside its dimension, more
    /// bounds than dimensions, an empty slice, or a run that is not a
    /// whole number of bytes (sub-byte dtypes) is an error naming the
    /// tensor.
    pub fn slice(&self, bounds: &[Range<usize>]) -> Result<TensorSlice> {
        let bad = |why: String| Error::Config(format!("tensor {}: slice {bounds:?}: {why}", self.name));
        let dims = self.shape.len();
        if bounds.len() > dims {
            return Err(bad(format!("{} ranges for {dims} dimensions", bounds.len())));
        }
        let mut full = Vec::with_capacity(dims);
        for (d, &n) in self.shape.iter().enumerate() {
            let b = bounds.get(d).cloned().unwrap_or(0..n);
            if b.start > b.end || b.end > n {
                return Err(bad(format!(
                    "{}..{} is not inside dimension {d} of size {n}",
                    b.start, b.end
                )));
            }
            full.push(b);
        }
        let shape: Vec<usize> = full.iter().map(|b| b.end - b.start).collect();
        let elements = shape.iter().try_fold(1u64, |a, &n| a.checked_mul(n as u64));
        if elements == Some(0) {
            return Err(bad("it holds no element".into()));
        }
        let bits = self.dtype.bits() as u64;
        // The last dimension the slice cuts: every one after it is whole,
        // so a run spans it and everything inside.
        let cut = (0..dims).rev().find(|&d| full[d] != (0..self.shape[d]));
        // Elements in one index of dimension d: the product of those after.
        let mut stride = vec![1u64; dims];
        for d in (0..dims.saturating_sub(1)).rev() {
            stride[d] = stride[d + 1] * self.shape[d + 1] as u64;
        }
        let Some(k) = cut else {
            let len = self.len;
            return Ok(TensorSlice {
                tensor: self.clone(),
                bounds: full,
                shape,
                runs: vec![Run { src: 0, dst: 0, len }],
                len,
            });
        };
        let run_elems = shape[k] as u64 * stride[k];
        let count: u64 = shape[..k].iter().map(|&n| n as u64).product();
        if count > MAX_SLICE_RUNS {
            return Err(bad(format!(
                "{count} separate runs (more than {MAX_SLICE_RUNS}); read the covering rows and slice them in memory"
            )));
        }
        let whole = |elems: u64| (elems * bits).is_multiple_of(8);
        if !whole(run_elems) || !whole(full[k].start as u64 * stride[k]) || (k > 0 && !whole(stride[k - 1])) {
            return Err(bad(format!(
                "its runs of {run_elems} {} elements are not whole bytes",
                self.dtype.name()
            )));
        }
        let run_len = run_elems * bits / 8;
        let mut runs: Vec<Run> = Vec::with_capacity(count as usize);
        // The outer index (dimensions 0..k), advanced like an odometer.
        let mut index: Vec<usize> = full[..k].iter().map(|b| b.start).collect();
        let mut dst = 0u64;
        for _ in 0..count {
            let elem =
                index.iter().zip(&stride).map(|(&i, &s)| i as u64 * s).sum::<u64>() + full[k].start as u64 * stride[k];
            let src = elem * bits / 8;
            match runs.last_mut() {
                Some(last) if last.src + last.len == src => last.len += run_len,
                _ => runs.push(Run { src, dst, len: run_len }),
            }
            dst += run_len;
            for d in (0..k).rev() {
                index[d] += 1;
                if index[d] < full[d].end {
                    break;
                }
                index[d] = full[d].start;
            }
        }
        Ok(TensorSlice {
            tensor: self.clone(),
            bounds: full,
            shape,
            runs,
            len: dst,
        })
    }
}

impl TensorSlice {
    /// The tensor sliced.
    pub fn tensor(&self) -> &TensorRef {
        &self.tensor
    }

    /// The range kept of each dimension.
    pub fn bounds(&self) -> &[Range<usize>] {
        &self.bounds
    }

    /// The slice's shape.
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    /// The tensor's dtype.
    pub fn dtype(&self) -> Dtype {
        self.tensor.dtype
    }

    /// The slice's bytes (compact, row-major).
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Never: an empty slice is refused when it is made.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The runs, in file order (which is also the slice's order), each
    /// already merged with a run it touches.
    pub fn runs(&self) -> &[Run] {
        &self.runs
    }

    /// Bytes of the payload from the first run's first byte to the last
    /// run's last: what one read of the covering window moves.
    pub fn covering(&self) -> Range<u64> {
        let first = self.runs.first().map_or(0, |r| r.src);
        let last = self.runs.last().map_or(0, |r| r.src + r.len);
        first..last
    }

    /// Whether the slice is one run: rows, or the whole tensor. Such a
    /// slice is an ordinary byte range of the tensor.
    pub fn is_contiguous(&self) -> bool {
        self.runs.len() == 1
    }

    /// The slice as a tensor reference of its own when it is one run (rows
    /// of the tensor): offset and length of that run, the slice's shape.
    pub fn as_range(&self) -> Option<TensorRef> {
        let [r] = self.runs[..] else { return None };
        Some(TensorRef {
            offset: self.tensor.offset + r.src,
            len: r.len,
            shape: self.shape.clone(),
            ..self.tensor.clone()
        })
    }

    /// Groups the runs into pieces: a run joins the piece before it when
    /// the whole `align`-byte blocks between them (file offsets) total at
    /// most `gap` bytes. `read` counts each piece's whole blocks.
    ///
    /// This is also the choice between reading the runs apart and reading
    /// the covering rows once: skipping a gap costs one more request,
    /// which `gap` prices in bytes, and reading through it costs its
    /// bytes. Each gap is decided on its own, so a slice whose runs lie
    /// close together is read as its covering window, and one whose runs
    /// lie far apart (a narrow column of a wide tensor) as separate runs,
    /// whichever moves fewer bytes per request.
    pub fn plan(&self, align: u64, gap: u64) -> SlicePlan {
        self.plan_within(align, gap, None)
    }

    /// [`TensorSlice::plan`] with no piece spanning more than `max_piece`
    /// bytes of whole blocks (`None`: no bound): a piece that would is
    /// cut at the multiples of `max_piece` in the file (rounded down to a
    /// multiple of `align`, at least `align`), each part trimmed to the
    /// runs it holds, a run cut across two parts where it crosses a cut. A reader that
    /// stages pieces then needs at most `max_piece` of staging per piece.
    pub fn plan_within(&self, align: u64, gap: u64, max_piece: Option<u64>) -> SlicePlan {
        let align = align.max(1);
        let base = self.tensor.offset;
        let down = |x: u64| (base + x) / align * align;
        let up = |x: u64| (base + x).div_ceil(align) * align;
        let merged = self.merge(down, up, gap);
        let pieces = match max_piece.map(|m| (m / align).max(1) * align) {
            None => merged,
            Some(max) => merged
                .into_iter()
                .flat_map(|p| {
                    if up(p.range.end) - down(p.range.start) <= max {
                        vec![p]
                    } else {
                        self.cut(&p, base, max)
                    }
                })
                .collect(),
        };
        let read = pieces.iter().map(|p| up(p.range.end) - down(p.range.start)).sum();
        SlicePlan {
            pieces,
            wanted: self.len,
            read,
        }
    }

    /// The runs merged across gaps of at most `gap` bytes of whole blocks.
    fn merge(&self, down: impl Fn(u64) -> u64, up: impl Fn(u64) -> u64, gap: u64) -> Vec<Piece> {
        let mut pieces: Vec<Piece> = Vec::new();
        for (i, r) in self.runs.iter().enumerate() {
            let end = r.src + r.len;
            match pieces.last_mut() {
                Some(p) if down(r.src).saturating_sub(up(p.range.end)) <= gap => {
                    p.range.end = end;
                    p.runs.end = i + 1;
                }
                _ => pieces.push(Piece {
                    range: r.src..end,
                    runs: i..i + 1,
                }),
            }
        }
        pieces
    }

    /// `p` cut at the file offsets that are multiples of `max` (itself a
    /// multiple of the block), each part trimmed to the bytes of the runs
    /// it holds; a part holding no run's byte is dropped.
    fn cut(&self, p: &Piece, base: u64, max: u64) -> Vec<Piece> {
        let mut out = Vec::new();
        let mut start = p.range.start;
        // The first run that may still hold bytes at or after `start`.
        let mut i = p.runs.start;
        while start < p.range.end && i < p.runs.end {
            // The next cut after `start` (tensor offsets; the file's
            // multiples of `max`), at most the piece's end.
            let cut = ((base + start) / max)
                .checked_add(1)
                .and_then(|k| k.checked_mul(max))
                .map_or(p.range.end, |c| (c - base).min(p.range.end));
            // Runs [i, j) start before the cut; those with bytes in
            // [start, cut) set the part's range.
            let mut j = i;
            let mut held: Option<Range<u64>> = None;
            while j < p.runs.end && self.runs[j].src < cut {
                let r = self.runs[j];
                let (a, b) = (r.src.max(start), (r.src + r.len).min(cut));
                if a < b {
                    held = Some(held.map_or(a..b, |h| h.start..b));
                }
                j += 1;
            }
            if let Some(range) = held {
                out.push(Piece { range, runs: i..j });
            }
            // Runs that end by the cut are done; one that crosses it goes
            // on in the next part.
            while i < j && self.runs[i].src + self.runs[i].len <= cut {
                i += 1;
            }
            start = cut;
        }
        out
    }

    /// Copies the bytes of the runs that fall inside `piece` from `src`
    /// (the piece's bytes, its first byte at `src[0]`) to their places in
    /// `dst` (the slice's compact bytes). Returns the bytes copied.
    pub fn copy_piece(&self, piece: &Piece, src: &[u8], dst: &mut [u8]) -> u64 {
        let mut n = 0;
        for r in &self.runs[piece.runs.clone()] {
            let (a, b) = (r.src.max(piece.range.start), (r.src + r.len).min(piece.range.end));
            if a >= b {
                continue;
            }
            let (s, d, len) = (
                (a - piece.range.start) as usize,
                (r.dst + a - r.src) as usize,
                (b - a) as usize,
            );
            dst[d..d + len].copy_from_slice(&src[s..s + len]);
            n += b - a;
        }
        n
    }
}

#[cfg(test)]
#[allow(clippy::single_range_in_vec_init)] // one range: rows
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn tensor(shape: &[usize], dtype: Dtype, offset: u64) -> TensorRef {
        let elems: u64 = shape.iter().map(|&n| n as u64).product();
        TensorRef {
            name: "w".into(),
            shape: shape.to_vec(),
            dtype,
            offset,
            len: elems * dtype.bits() as u64 / 8,
            shard: 0,
            index: 0,
        }
    }

    /// The oracle: every element's byte offset in the tensor, in the
    /// slice's row-major order, one at a time.
    fn naive(t: &TensorRef, bounds: &[Range<usize>]) -> Vec<u64> {
        let size = t.dtype.bits() as u64 / 8;
        let dims = t.shape.len();
        let mut out = Vec::new();
        let mut index: Vec<usize> = bounds.iter().map(|b| b.start).collect();
        loop {
            let flat = (0..dims).fold(0u64, |f, d| f * t.shape[d] as u64 + index[d] as u64);
            for b in 0..size {
                out.push(flat * size + b);
            }
            let mut d = dims;
            loop {
                if d == 0 {
                    return out;
                }
                d -= 1;
                index[d] += 1;
                if index[d] < bounds[d].end {
                    break;
                }
                index[d] = bounds[d].start;
            }
        }
    }

    fn bytes_of(s: &TensorSlice) -> Vec<u64> {
        let mut v = vec![u64::MAX; s.len() as usize];
        for r in s.runs() {
            for i in 0..r.len {
                v[(r.dst + i) as usize] = r.src + i;
            }
        }
        v
    }

    #[test]
    fn rows_are_one_run_and_columns_one_per_row() {
        let t = tensor(&[8, 6], Dtype::Bf16, 100);
        let rows = t.slice(&[2..5]).unwrap();
        assert_eq!(
            rows.runs(),
            &[Run {
                src: 24,
                dst: 0,
                len: 36
            }]
        );
        assert_eq!(rows.shape(), &[3, 6]);
        assert_eq!(rows.as_range().unwrap().offset, 124);
        let cols = t.slice(&[0..8, 2..4]).unwrap();
        assert_eq!(cols.runs().len(), 8);
        assert_eq!(
            cols.runs()[1],
            Run {
                src: 12 + 4,
                dst: 4,
                len: 4
            }
        );
        assert_eq!(cols.shape(), &[8, 2]);
        // Whole: one run.
        assert_eq!(
            t.slice(&[]).unwrap().runs(),
            &[Run {
                src: 0,
                dst: 0,
                len: 96
            }]
        );
        // A middle dimension cut, the last whole: runs of whole rows.
        let t3 = tensor(&[2, 4, 3], Dtype::F32, 0);
        let s = t3.slice(&[0..2, 1..3]).unwrap();
        assert_eq!(
            s.runs(),
            &[
                Run {
                    src: 12,
                    dst: 0,
                    len: 24
                },
                Run {
                    src: 60,
                    dst: 24,
                    len: 24
                }
            ]
        );
    }

    #[test]
    #[allow(clippy::reversed_empty_ranges)] // 3..2 on purpose
    fn bad_slices_are_errors_naming_the_tensor() {
        let t = tensor(&[4, 4], Dtype::F16, 0);
        for bounds in [vec![0..5], vec![3..2], vec![0..4, 0..4, 0..1], vec![1..1]] {
            let e = t.slice(&bounds).unwrap_err().to_string();
            assert!(e.contains("tensor w"), "{e}");
        }
        let f4 = tensor(&[4, 3], Dtype::F4, 0);
        let e = f4.slice(&[0..4, 0..1]).unwrap_err().to_string();
        assert!(e.contains("whole bytes"), "{e}");
        assert!(f4.slice(&[1..2]).is_err(), "row 1 of 3 F4 starts 1.5 bytes in");
        assert_eq!(f4.slice(&[0..2]).unwrap().len(), 3);
        let f4 = tensor(&[4, 4], Dtype::F4, 0);
        assert_eq!(
            f4.slice(&[0..4, 2..4]).unwrap().runs()[1],
            Run { src: 3, dst: 1, len: 1 }
        );
    }

    #[test]
    fn a_scalar_is_its_one_run() {
        let t = tensor(&[], Dtype::F32, 8);
        let s = t.slice(&[]).unwrap();
        assert_eq!(s.runs(), &[Run { src: 0, dst: 0, len: 4 }]);
        assert!(t.slice(&[0..1]).is_err());
    }

    #[test]
    fn the_plan_reads_through_short_gaps_and_skips_long_ones() {
        // 4 rows of 256 KiB, two ranks' columns: each run 128 KiB.
        let t = tensor(&[4, 128 << 10], Dtype::Bf16, 4096 + 100);
        let half = t.slice(&[0..4, 0..(64 << 10)]).unwrap();
        let p = half.plan(4096, SLICE_GAP_BYTES);
        assert_eq!(p.pieces.len(), 4, "{p:?}");
        assert!(p.read * 10 <= p.wanted * 11, "{p:?}");
        // Columns of 64 bytes a row: one window.
        let t = tensor(&[1000, 64], Dtype::U8, 7);
        let s = t.slice(&[0..1000, 0..32]).unwrap();
        let p = s.plan(4096, SLICE_GAP_BYTES);
        assert!(p.is_window(), "{p:?}");
        assert_eq!(p.pieces[0].range, s.covering());
        // No gap allowed: one piece a run, unless the blocks touch.
        let p = half.plan(4096, 0);
        assert_eq!(p.pieces.len(), 4);
    }

    fn shape_and_bounds() -> impl Strategy<Value = (Vec<usize>, Vec<Range<usize>>)> {
        proptest::collection::vec(1usize..6, 0..4).prop_flat_map(|shape: Vec<usize>| {
            let bounds: Vec<BoxedStrategy<Range<usize>>> = shape
                .iter()
                .map(|&n| {
                    (0..n)
                        .prop_flat_map(move |a| (a + 1..=n).prop_map(move |b| a..b))
                        .boxed()
                })
                .collect();
            (Just(shape), bounds)
        })
    }

    proptest! {
        #[test]
        fn runs_equal_the_element_by_element_oracle(
            (shape, bounds) in shape_and_bounds(),
            keep in 0usize..5,
            dtype in prop_oneof![Just(Dtype::U8), Just(Dtype::Bf16), Just(Dtype::F32), Just(Dtype::F64)],
            offset in 0u64..10_000,
            align in prop_oneof![Just(1u64), Just(512), Just(4096)],
            gap in 0u64..20_000,
        ) {
            let t = tensor(&shape, dtype, offset);
            let bounds = &bounds[..keep.min(bounds.len())];
            let s = t.slice(bounds).unwrap();
            let full: Vec<Range<usize>> = (0..shape.len()).map(|d| bounds.get(d).cloned().unwrap_or(0..shape[d])).collect();
            prop_assert_eq!(bytes_of(&s), naive(&t, &full));
            // Runs are in file order, disjoint and never touching.
            for w in s.runs().windows(2) {
                prop_assert!(w[0].src + w[0].len < w[1].src);
            }
            let p = s.plan(align, gap);
            // The pieces hold every run once, in order, inside their range.
            let mut next = 0;
            for piece in &p.pieces {
                prop_assert_eq!(piece.runs.start, next);
                next = piece.runs.end;
                for r in &s.runs()[piece.runs.clone()] {
                    prop_assert!(piece.range.start <= r.src && r.src + r.len <= piece.range.end);
                }
            }
            prop_assert_eq!(next, s.runs().len());
            prop_assert!(p.read >= p.wanted);
        }

        /// Pieces bounded by `max_piece` (in blocks): each spans at most
        /// that many bytes of whole blocks, they are in file order and do
        /// not overlap, and copying each piece's bytes of a payload into
        /// place gives exactly the element-by-element oracle's slice. With
        /// no bound the plan is `plan`'s.
        #[test]
        fn bounded_pieces_stay_within_their_bound_and_copy_the_slice_exactly(
            (shape, bounds) in shape_and_bounds(),
            keep in 0usize..5,
            dtype in prop_oneof![Just(Dtype::U8), Just(Dtype::Bf16), Just(Dtype::F32)],
            offset in 0u64..10_000,
            align in prop_oneof![Just(1u64), Just(8), Just(64)],
            gap in 0u64..300,
            blocks in 1u64..6,
        ) {
            let t = tensor(&shape, dtype, offset);
            let bounds = &bounds[..keep.min(bounds.len())];
            let s = t.slice(bounds).unwrap();
            let full: Vec<Range<usize>> = (0..shape.len()).map(|d| bounds.get(d).cloned().unwrap_or(0..shape[d])).collect();
            prop_assert_eq!(s.plan_within(align, gap, None), s.plan(align, gap));
            let max = blocks * align;
            let p = s.plan_within(align, gap, Some(max));
            let down = |x: u64| (offset + x) / align * align;
            let up = |x: u64| (offset + x).div_ceil(align) * align;
            // The payload: each byte its own offset in the tensor (mod 251).
            let payload: Vec<u8> = (0..t.len).map(|i| (i % 251) as u8).collect();
            let mut out = vec![0u8; s.len() as usize];
            let mut copied = 0;
            let mut end = 0;
            for piece in &p.pieces {
                prop_assert!(up(piece.range.end) - down(piece.range.start) <= max, "{:?} of {:?}", piece, p);
                prop_assert!(piece.range.start >= end && piece.range.start < piece.range.end);
                end = piece.range.end;
                let src = &payload[piece.range.start as usize..piece.range.end as usize];
                copied += s.copy_piece(piece, src, &mut out);
            }
            prop_assert_eq!(copied, s.len());
            let want: Vec<u8> = naive(&t, &full).iter().map(|&i| (i % 251) as u8).collect();
            prop_assert_eq!(out, want);
            prop_assert_eq!(p.read, p.pieces.iter().map(|q| up(q.range.end) - down(q.range.start)).sum::<u64>());
        }
    }

    #[test]
    fn a_narrow_column_of_a_wide_tensor_is_read_run_by_run_within_the_bound() {
        // The review's case, scaled down: [4096, 100000] U8, column 0. The
        // runs lie 100000 bytes apart (more than the gap): one piece each,
        // of one or two blocks, never the covering rows.
        let t = tensor(&[4096, 100_000], Dtype::U8, 1000);
        let s = t.slice(&[0..4096, 0..1]).unwrap();
        let p = s.plan_within(4096, SLICE_GAP_BYTES, Some(4 << 20));
        assert_eq!(p.pieces.len(), 4096);
        assert!(p.read <= 4096 * 8192, "{}", p.read);
        // Close runs: the covering window, cut into parts of at most 4 MiB.
        let s = t.slice(&[0..4096, 0..90_000]).unwrap();
        let p = s.plan_within(4096, SLICE_GAP_BYTES, Some(4 << 20));
        let covering = s.covering();
        assert_eq!(p.pieces.first().unwrap().range.start, covering.start);
        assert_eq!(p.pieces.last().unwrap().range.end, covering.end);
        assert!(p.pieces.len() >= (covering.end - covering.start) as usize / (4 << 20));
    }
}
