//! Splitting one planned read into chunks, and deciding what a chunk's
//! completion means. Pure: both backends (io_uring rings and pread workers)
//! use exactly this logic, so they cannot drift apart.

use crate::plan::window::Window;
use crate::stats::FallbackCause;

/// One I/O of a request: `len` bytes of file `file` at `file_off`, landing at
/// `slot_off` from the slot base.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Chunk {
    /// Index of the shard file in the model.
    pub file: u32,
    /// Read through the O_DIRECT descriptor.
    pub direct: bool,
    /// File offset of the chunk.
    pub file_off: u64,
    /// Where it lands, from the slot base.
    pub slot_off: usize,
    /// Bytes.
    pub len: u32,
    /// Position in the request (for diagnostics and `user_data`).
    pub seq: u16,
}

/// Largest chunk: fits a `u32` length and keeps O_DIRECT chunks on 4096-byte
/// boundaries.
const MAX_CHUNK: usize = u32::MAX as usize & !4095;

/// Chunks of a planned window: the direct part cut at multiples of `chunk`
/// (itself a multiple of the alignment), then the buffered tail cut the same
/// way. `direct` false means the whole payload goes buffered.
///
/// `w` is a window `direct::plan` accepted for the slot (or its
/// [`Window::buffered`]): its [`Window::slot_extent`] is at most the slot's
/// real length, and that is checked before anything is split. Then every
/// offset here is provably bounded, none can overflow, and every chunk lies
/// in `[0, slot_extent)` of the slot:
/// - a direct chunk is `[o, o + n)` with `o + n <= w.direct <= slot_extent`,
///   at file offset `w.start + o < w.start + w.direct <= size` (the EOF
///   clamp `Window::plan` applied);
/// - a tail chunk is `[t + o, t + o + n)` with `t + w.tail = w.pad + w.len
///   <= slot_extent`, at file offset `tail_file_offset() + o`, below the
///   payload's end `<= size`.
///
/// A `chunk` of 0 is taken as 1 (never a panic).
pub fn split(w: &Window, file: u32, chunk: usize) -> impl Iterator<Item = Chunk> + '_ {
    let chunk = chunk.clamp(1, MAX_CHUNK);
    let direct = (0..w.direct)
        .step_by(chunk)
        .map(move |o| (true, w.start + o as u64, o, chunk.min(w.direct - o)));
    let (t_file, t_slot) = (w.tail_file_offset(), w.tail_slot_offset());
    let tail = (0..w.tail)
        .step_by(chunk)
        .map(move |o| (false, t_file + o as u64, t_slot + o, chunk.min(w.tail - o)));
    direct
        .chain(tail)
        .enumerate()
        .map(move |(i, (direct, file_off, slot_off, len))| Chunk {
            file,
            direct,
            file_off,
            slot_off,
            // len <= chunk <= MAX_CHUNK <= u32::MAX.
            len: len as u32,
            // Diagnostic only (user_data's top bits): wraps past 65535 chunks.
            seq: i as u16,
        })
}

/// Number of chunks [`split`] yields.
pub fn count(w: &Window, chunk: usize) -> usize {
    let chunk = chunk.clamp(1, MAX_CHUNK);
    w.direct.div_ceil(chunk) + w.tail.div_ceil(chunk)
}

/// Chunks each I/O thread serving a read gets at least when its chunks
/// grow (see [`for_read`]): the last chunk then keeps one thread busy
/// while the others idle for at most about a quarter of the read.
pub(crate) const CHUNKS_PER_LANE: usize = 4;

/// Largest chunk a read's chunks grow to when the configuration leaves the
/// chunk size to the engine.
pub(crate) const GROWN_CHUNK_MAX: usize = 4 << 20;

/// The chunk size for one read of `len` bytes whose copies are served by
/// `lanes` I/O threads in all (rings, or pread workers, over every copy's
/// drive): `base` (the drive's chunk, a multiple of the alignment) times
/// the largest whole factor that keeps the chunk at most `max` and gives
/// every lane at least [`CHUNKS_PER_LANE`] chunks; `base` itself when no
/// factor above 1 does (or `max <= base`).
///
/// Why grow: each chunk costs the submitter an SQE, a bio setup and a
/// completion, whatever its size. On an asynchronous fast drive (memloop)
/// 1.25 MiB chunks took 0.008-0.0098 CPU s/GB and 3.75 MiB ones
/// 0.0045-0.0055, 2-7% faster (docs/benchmarks/2026-11-30-grown-chunks).
/// Why not always grow: a decode step reads one expert at a time, and its
/// chunks are what spreads it over the drives' copies and lanes; a 20 MB
/// expert in 4 MiB chunks is 5 chunks, which leaves three of eight
/// mirrored drives idle. The factor is a whole one so the chunk stays a
/// multiple of the alignment `base` already is.
pub(crate) fn for_read(base: usize, max: usize, len: usize, lanes: usize) -> usize {
    let base = base.max(1);
    let per_factor = base.saturating_mul(lanes.max(1)).saturating_mul(CHUNKS_PER_LANE);
    let factor = (len / per_factor).clamp(1, (max / base).max(1));
    base * factor
}

/// Largest chunk of a whole-model load's reads on a drive whose reads
/// complete inline in the submitting thread (zram; its pread workers): a
/// load keeps many reads in flight, so no single read's chunks need to
/// spread over the workers, and each chunk is a syscall and a pass over
/// the device's bookkeeping. Measured on zram, 1.91 GB into fresh memory,
/// 8 workers, 5 rounds: the drive's 1 MiB chunks 0.76 of the bare read
/// (its best: 8 threads x 16 MiB), 16 MiB chunks 1.01; memloop 0.99
/// (docs/benchmarks/2026-12-05-zram-load).
pub(crate) const BULK_CHUNK_MAX: usize = 16 << 20;

/// The chunk size for one read of a whole-model load (`len` bytes, many
/// other reads in flight beside it): as large as the read, between `base`
/// and `max`, a whole multiple of `base`.
pub(crate) fn for_bulk(base: usize, max: usize, len: usize) -> usize {
    let base = base.max(1);
    base * (len / base).clamp(1, (max / base).max(1))
}

/// What to do after a chunk's I/O returned `res` (bytes, or `-errno`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Next {
    /// The chunk landed.
    Done,
    /// Issue this (the remainder after a short read, or the same chunk after
    /// EINTR/EAGAIN) again.
    Again(Chunk),
    /// Issue this buffered instead, counting `cause`.
    Fallback(Chunk, FallbackCause),
    /// End of file before the chunk completed: the file shrank.
    Eof { at: u64 },
    /// An error no retry on this copy can fix.
    Fail { errno: i32 },
}

/// Decides the next step for `c` after its I/O returned `res`. `dio_align`
/// is the file's O_DIRECT offset alignment: a direct remainder must start on
/// it, or it goes buffered.
pub fn on_result(c: &Chunk, res: i32, dio_align: u32) -> Next {
    if res >= 0 {
        let n = res as u32;
        if n >= c.len {
            return Next::Done;
        }
        if n == 0 {
            return Next::Eof { at: c.file_off };
        }
        // Short but not at EOF (the window never runs past EOF): the rest is
        // read again, never trusted.
        let rest = Chunk {
            file_off: c.file_off + n as u64,
            slot_off: c.slot_off + n as usize,
            len: c.len - n,
            ..*c
        };
        if c.direct && !n.is_multiple_of(dio_align.max(1)) {
            return Next::Fallback(Chunk { direct: false, ..rest }, FallbackCause::ShortDirect);
        }
        return Next::Again(rest);
    }
    let errno = -res;
    if errno == libc::EINTR || errno == libc::EAGAIN {
        return Next::Again(*c);
    }
    if c.direct && errno != libc::ECANCELED {
        let cause = if errno == libc::EINVAL {
            FallbackCause::DeviceEinval
        } else {
            FallbackCause::DirectError
        };
        return Next::Fallback(Chunk { direct: false, ..*c }, cause);
    }
    Next::Fail { errno }
}

/// Bytes of the payload `[pad, pad + len)` that chunk `c` carries.
pub(crate) fn payload_bytes(c: &Chunk, pad: usize, len: usize) -> u64 {
    let (a, b) = (c.slot_off.max(pad), (c.slot_off + c.len as usize).min(pad + len));
    b.saturating_sub(a) as u64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_large_read_on_one_lane_grows_its_chunks_to_the_cap() {
        // memloop: 1280 KiB chunks, one ring, a 19.9 MB expert.
        let base = 1280 << 10;
        let c = for_read(base, GROWN_CHUNK_MAX, 19_900_000, 1);
        assert_eq!(c, 3 * base, "3.75 MiB: the largest multiple of the base under 4 MiB");
        assert!(19_900_000usize.div_ceil(c) >= CHUNKS_PER_LANE);
        // A base that is already the cap (virtio's 4 MiB) stays.
        assert_eq!(for_read(4 << 20, GROWN_CHUNK_MAX, 19_900_000, 1), 4 << 20);
    }

    #[test]
    fn many_lanes_keep_the_chunks_small() {
        let mib = 1 << 20;
        // zram: two rings per drive; 2 MiB gives each ring 5 chunks.
        assert_eq!(for_read(mib, GROWN_CHUNK_MAX, 19_900_000, 2), 2 * mib);
        // Eight mirrored drives, or a pread pool of 8 workers: the base.
        assert_eq!(for_read(mib, GROWN_CHUNK_MAX, 19_900_000, 8), mib);
        // A small read: the base.
        assert_eq!(for_read(mib, GROWN_CHUNK_MAX, 3 * mib, 1), mib);
    }

    #[test]
    fn odd_inputs_give_the_base_not_a_panic() {
        assert_eq!(for_read(0, GROWN_CHUNK_MAX, usize::MAX, 0), 4 << 20);
        assert_eq!(for_read(4096, 4096, usize::MAX, usize::MAX), 4096);
        assert_eq!(
            for_read(8 << 20, GROWN_CHUNK_MAX, usize::MAX, 1),
            8 << 20,
            "max below the base"
        );
        assert_eq!(for_read(usize::MAX, usize::MAX, usize::MAX, 1), usize::MAX);
    }

    #[test]
    fn a_bulk_read_takes_chunks_as_large_as_itself_up_to_the_cap() {
        let base = 1 << 20;
        // A 3.5 MiB tensor: three whole base chunks (the window's tail is
        // the last chunk's remainder).
        assert_eq!(for_bulk(base, BULK_CHUNK_MAX, 3 * base + base / 2), 3 * base);
        // A 64 MiB tensor: the cap.
        assert_eq!(for_bulk(base, BULK_CHUNK_MAX, 64 << 20), BULK_CHUNK_MAX);
        // Smaller than the base: the base.
        assert_eq!(for_bulk(base, BULK_CHUNK_MAX, 4096), base);
        // A cap below the base, a zero base: no panic, no zero chunk.
        assert_eq!(for_bulk(8 << 20, 4 << 20, 1 << 30), 8 << 20);
        assert_eq!(for_bulk(0, BULK_CHUNK_MAX, 0), 1);
        // A cap that is not a multiple of the base: the largest multiple under it.
        assert_eq!(for_bulk(3 << 20, BULK_CHUNK_MAX, 1 << 30), 15 << 20);
    }

    // Not under Miri: proptest persists failures relative to the current
    // directory (getcwd, refused by Miri's isolation); the unit tests above
    // run there.
    #[cfg(not(miri))]
    proptest::proptest! {
        #[test]
        fn a_grown_chunk_is_the_largest_multiple_of_the_base_within_the_cap_that_keeps_each_lanes_share(
            base_k in 1usize..4096, len in 0usize..(1 << 34), lanes in 1usize..64,
        ) {
            let base = base_k * 512;
            let c = for_read(base, GROWN_CHUNK_MAX, len, lanes);
            proptest::prop_assert_eq!(c % base, 0);
            proptest::prop_assert!(c >= base);
            if c > base {
                proptest::prop_assert!(c <= GROWN_CHUNK_MAX);
                proptest::prop_assert!(len / c >= lanes * CHUNKS_PER_LANE);
            }
            // The largest such factor: the next one up breaks the cap or a
            // lane's share.
            let next = c + base;
            proptest::prop_assert!(next > GROWN_CHUNK_MAX || len / next < lanes * CHUNKS_PER_LANE);
        }
    }

    fn w(off: u64, len: u64) -> Window {
        Window::plan(off, len, 1 << 30, 4096, false).unwrap()
    }

    #[test]
    fn chunks_cover_the_window_exactly() {
        let win = w(71 + 5000, 3 << 20);
        let cs: Vec<_> = split(&win, 3, 1 << 20).collect();
        assert_eq!(cs.len(), count(&win, 1 << 20));
        let mut slot_end = 0;
        for c in &cs {
            assert_eq!(
                c.slot_off,
                slot_end.max(if c.direct { 0 } else { win.tail_slot_offset() })
            );
            assert_eq!(c.file_off - win.start, c.slot_off as u64);
            if c.direct {
                assert_eq!(c.len % 4096, 0);
            }
            slot_end = c.slot_off + c.len as usize;
        }
        assert_eq!(slot_end, win.pad + win.len);
        let total: u64 = cs.iter().map(|c| payload_bytes(c, win.pad, win.len)).sum();
        assert_eq!(total, win.len as u64);
    }

    #[test]
    fn all_buffered_window() {
        let win = w(71, 100).buffered();
        let cs: Vec<_> = split(&win, 0, 1 << 20).collect();
        assert_eq!(
            cs,
            [Chunk {
                file: 0,
                direct: false,
                file_off: 71,
                slot_off: 71,
                len: 100,
                seq: 0
            }]
        );
        assert_eq!(count(&w(0, 0), 4096), 0);
    }

    #[test]
    fn results() {
        let c = Chunk {
            file: 0,
            direct: true,
            file_off: 8192,
            slot_off: 4096,
            len: 8192,
            seq: 1,
        };
        assert_eq!(on_result(&c, 8192, 512), Next::Done);
        assert_eq!(on_result(&c, 0, 512), Next::Eof { at: 8192 });
        let r = on_result(&c, 4096, 512);
        assert_eq!(
            r,
            Next::Again(Chunk {
                file_off: 12288,
                slot_off: 8192,
                len: 4096,
                ..c
            })
        );
        let r = on_result(&c, 100, 512);
        assert_eq!(
            r,
            Next::Fallback(
                Chunk {
                    direct: false,
                    file_off: 8292,
                    slot_off: 4196,
                    len: 8092,
                    ..c
                },
                FallbackCause::ShortDirect
            )
        );
        assert_eq!(on_result(&c, -libc::EINTR, 512), Next::Again(c));
        assert_eq!(on_result(&c, -libc::EAGAIN, 512), Next::Again(c));
        assert_eq!(
            on_result(&c, -libc::EINVAL, 512),
            Next::Fallback(Chunk { direct: false, ..c }, FallbackCause::DeviceEinval)
        );
        assert_eq!(
            on_result(&c, -libc::EIO, 512),
            Next::Fallback(Chunk { direct: false, ..c }, FallbackCause::DirectError)
        );
        assert_eq!(
            on_result(&c, -libc::ECANCELED, 512),
            Next::Fail { errno: libc::ECANCELED }
        );
        let b = Chunk { direct: false, ..c };
        assert_eq!(on_result(&b, -libc::EIO, 512), Next::Fail { errno: libc::EIO });
        assert_eq!(
            on_result(&b, 10, 512),
            Next::Again(Chunk {
                file_off: 8202,
                slot_off: 4106,
                len: 8182,
                ..b
            })
        );
    }

    /// Every chunk lies inside the window's slot extent, and each direct
    /// chunk's file range inside the file: also for windows whose offsets
    /// are near `u64::MAX` (no sum overflows).
    #[test]
    fn chunks_stay_inside_the_slot_extent_near_u64_max() {
        for (off, len, size, room) in [
            (u64::MAX - 5000, 4000, u64::MAX, true),
            (u64::MAX - 5000, 5000, u64::MAX, true),
            (u64::MAX - (3 << 20) - 17, 3 << 20, u64::MAX - 1, false),
            (71, 100_000, 200_000, true),
        ] {
            let win = Window::plan(off, len, size, 4096, room).unwrap();
            let extent = win.slot_extent().unwrap();
            for w in [win, win.buffered()] {
                let cs: Vec<_> = split(&w, 0, 1 << 20).collect();
                assert_eq!(cs.len(), count(&w, 1 << 20));
                for c in &cs {
                    let end = c.slot_off.checked_add(c.len as usize).unwrap();
                    assert!(end <= extent, "{c:?} past {extent}: {w:?}");
                    assert!(c.file_off.checked_add(c.len as u64).unwrap() <= size, "{c:?}");
                    assert_eq!(c.file_off - w.start, c.slot_off as u64);
                }
            }
        }
    }

    #[test]
    fn a_zero_chunk_size_does_not_panic() {
        let win = w(71, 3);
        assert_eq!(count(&win, 0), 3);
        assert_eq!(split(&win, 0, 0).map(|c| c.len).collect::<Vec<_>>(), [1, 1, 1]);
    }
}
