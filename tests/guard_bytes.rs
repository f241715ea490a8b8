//! The guard-byte matrix of the in-place read (DESIGN contract 1, 3, 4).
//!
//! Hand-written shards put the data section at odd offsets and place U8
//! tensors at chosen file ranges: the start of the data section, mid-file,
//! across several block boundaries, inside one block, across one boundary,
//! exactly one aligned block, 512-aligned but sub-4096, ending at EOF with
//! and without a whole block, ending at an aligned EOF, zero-length ones, and
//! one of several MiB. Every range is read in every combination of
//! `DirectMode` x tail room x slot alignment into the middle slot of a
//! three-slot arena filled with 0xA5, then:
//!
//! - the payload equals the file's bytes (read with `std::fs::read`);
//! - the slots before and after are untouched (nothing before `slot_base`,
//!   nothing past the slot);
//! - in the slot, scratch before the payload holds only 0xA5 or the file's
//!   own bytes of the window; every byte after the payload stays 0xA5
//!   without tail room, and after `round_up(pad + len, align)` with it;
//! - the stats say how the read went: direct when the window has a whole
//!   block, otherwise one counted `no_bulk` fallback; nothing direct and
//!   nothing counted with `--direct off`; on a filesystem that cannot do the
//!   direct read, a counted fallback for every buffered read (never silent).

mod common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use common::Layout;
use weightstream::{Arena, DirectMode, Model, ModelConfig, SlotSpec, Stats};

const B: u64 = 4096;
const FILL: u8 = 0xA5;
static FILL_BLOCK: [u8; 4096] = [FILL; 4096];

/// One tensor of the matrix: where it is in which file.
#[derive(Debug, Clone)]
struct Case {
    name: String,
    file: usize,
    off: u64,
    len: u64,
}

/// The model directory: the shards, their bytes and the tensors to read.
struct Fixture {
    dir: PathBuf,
    files: Vec<(PathBuf, Vec<u8>)>,
    cases: Vec<Case>,
}

fn write_fixture(dir: &Path) -> Fixture {
    let mut shards: Vec<(&str, Layout, u64)> = Vec::new();

    // Data section at 2007 (header length 1999: odd, not 8-byte padded).
    let mut a = Layout::new(2007);
    a.place("a_start_of_data", 2007, 5000)
        .place("a_mid_file", 10_003, 7777)
        .place("a_cross_blocks", 5 * B + 1234, 3 * B + 333)
        .place("a_sub_block_inside", 9 * B + 100, 200)
        .place("a_sub_block_across", 10 * B + 4000, 300)
        .place("a_one_block_aligned", 12 * B, B)
        .place("a_zero_len", 13 * B + 77, 0)
        .place("a_512_aligned_1k", 14 * B + 512, 1024)
        .place("a_large", 16 * B + 999, (3 << 20) + 12_345);
    let end = a.placed.last().map(|(_, o, l)| o + l).unwrap() + 1000;
    a.end_at(end);
    shards.push(("a.safetensors", a, 11));

    // Ends at EOF with whole blocks in the window; EOF off a block boundary.
    let mut b = Layout::new(309);
    b.place("b_eof_with_blocks", 2 * B + 55, 3 * B + 777);
    shards.push(("b.safetensors", b, 22));

    // Ends at EOF inside the last partial block; a zero-length tensor at EOF.
    let mut c = Layout::new(511);
    c.place("c_eof_sub_block", 3 * B + 1500, 1000)
        .place("c_eof_zero_len", 3 * B + 2500, 0);
    shards.push(("c.safetensors", c, 33));

    // Ends at an EOF that is itself a multiple of 4096.
    let mut e = Layout::new(4001);
    e.place("e_eof_aligned_end", B + 3000, 4 * B - (B + 3000));
    shards.push(("e.safetensors", e, 44));

    let mut files = Vec::new();
    let mut cases = Vec::new();
    for (i, (fname, layout, seed)) in shards.iter().enumerate() {
        let path = dir.join(fname);
        let bytes = layout.write(&path, *seed);
        for (name, off, len) in &layout.placed {
            cases.push(Case {
                name: name.clone(),
                file: i,
                off: *off,
                len: *len,
            });
        }
        files.push((path, bytes));
    }
    // The fixture is what it claims to be.
    assert_eq!(files[1].1.len() as u64, 5 * B + 832, "b ends at EOF off a boundary");
    assert_eq!(files[2].1.len() as u64, 3 * B + 2500, "c ends inside its last block");
    assert_eq!(files[3].1.len() as u64, 4 * B, "e ends on a block boundary");
    Fixture {
        dir: dir.to_path_buf(),
        files,
        cases,
    }
}

/// The window the contract asks for (closed form; `window_props` checks the
/// planner against a brute-force oracle). `direct` is the allowed maximum:
/// whole blocks from `start`, not past the payload (or its rounded-up end
/// with tail room), not past the last whole block in the file.
#[derive(Debug, Clone, Copy)]
struct Want {
    start: u64,
    pad: u64,
    direct: u64,
    tail: u64,
}

fn want(off: u64, len: u64, size: u64, align: u64, room: bool) -> Want {
    let start = off / align * align;
    let end = off + len;
    let limit = if room { end.div_ceil(align) * align } else { end };
    let direct = (limit.min(size) - start) / align * align;
    let tail = end - (start + direct).clamp(off, end);
    Want {
        start,
        pad: off - start,
        direct,
        tail,
    }
}

fn round_up(x: u64, align: u64) -> u64 {
    x.div_ceil(align) * align
}

fn all_fill(b: &[u8]) -> bool {
    b.chunks(FILL_BLOCK.len()).all(|c| c == &FILL_BLOCK[..c.len()])
}

fn first_not_fill(b: &[u8]) -> Option<usize> {
    b.iter().position(|&x| x != FILL)
}

/// Counters summed over drives, for before/after deltas.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
struct Counts {
    bytes: u64,
    bytes_direct: u64,
    bytes_buffered: u64,
    reads_direct: u64,
    reads_buffered: u64,
    fallbacks: BTreeMap<String, u64>,
}

fn counts(s: &Stats) -> Counts {
    let mut c = Counts::default();
    for d in &s.drives {
        c.bytes += d.bytes;
        c.bytes_direct += d.bytes_direct;
        c.bytes_buffered += d.bytes_buffered;
        c.reads_direct += d.reads_direct;
        c.reads_buffered += d.reads_buffered;
        for (k, v) in &d.fallbacks {
            *c.fallbacks.entry(k.to_string()).or_default() += v;
        }
    }
    c
}

fn delta(before: &Counts, after: &Counts) -> Counts {
    let mut fallbacks = BTreeMap::new();
    for (k, v) in &after.fallbacks {
        let d = v - before.fallbacks.get(k).copied().unwrap_or(0);
        if d > 0 {
            fallbacks.insert(k.clone(), d);
        }
    }
    Counts {
        bytes: after.bytes - before.bytes,
        bytes_direct: after.bytes_direct - before.bytes_direct,
        bytes_buffered: after.bytes_buffered - before.bytes_buffered,
        reads_direct: after.reads_direct - before.reads_direct,
        reads_buffered: after.reads_buffered - before.reads_buffered,
        fallbacks,
    }
}

/// How strictly the stats are checked on this filesystem.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Fs {
    /// A disk filesystem that does O_DIRECT (ext4, xfs): the direct path is
    /// required wherever the window has a whole block.
    DirectCapable,
    /// Anything else (tmpfs, overlay, a filesystem refusing O_DIRECT): the
    /// bytes must still be right and every buffered read counted.
    Other,
}

fn one_read(fx: &Fixture, model: &Model, mode: DirectMode, fs: Fs, case: &Case, align: u64, room: bool) {
    let ctx = format!("{} mode {mode:?} align {align} tail_room {room}", case.name);
    let (path, file) = &fx.files[case.file];
    let size = file.len() as u64;
    let t = model.tensor(&case.name).unwrap_or_else(|e| panic!("{ctx}: {e}"));
    // The catalog puts it where the writer did.
    assert_eq!((t.offset, t.len), (case.off, case.len), "{ctx}: catalog range");
    assert_eq!(&model.catalog().shards()[t.shard].path, path, "{ctx}: catalog shard");
    let expected = &file[case.off as usize..(case.off + case.len) as usize];

    let spec = SlotSpec::new(case.len.max(1) as usize)
        .with_align(align as usize)
        .with_tail_room(room);
    let arena = Arena::new(spec, 3).expect("arena");
    let mut before_slot = arena.take().unwrap();
    let mut slot = arena.take().unwrap();
    let mut after_slot = arena.take().unwrap();
    assert_eq!((before_slot.index(), slot.index(), after_slot.index()), (0, 1, 2));
    for s in [&mut before_slot, &mut slot, &mut after_slot] {
        s.as_bytes_mut().fill(FILL);
    }
    let shard = &model.files()[t.shard];
    let capable = mode != DirectMode::Off
        && shard.direct().is_some()
        && align.is_multiple_of(shard.topo.dio_offset_align as u64)
        && (slot.base() as usize).is_multiple_of(shard.topo.dio_mem_align as usize);
    let slot_len = slot.len();

    let c0 = counts(&model.stats());
    let loaded = model
        .read_sync(t, slot)
        .unwrap_or_else(|e| panic!("{ctx}: read failed: {e}"));
    let d = delta(&c0, &counts(&model.stats()));

    // The payload, in its place.
    let w = want(case.off, case.len, size, align, room);
    assert_eq!(loaded.pad() as u64, case.off % align, "{ctx}: pad");
    assert_eq!(loaded.len() as u64, case.len, "{ctx}: payload length");
    assert!(&loaded[..] == expected, "{ctx}: payload differs from the file's bytes");

    // Nothing before slot_base, nothing past the slot.
    assert!(all_fill(before_slot.as_bytes()), "{ctx}: the previous slot was written");
    assert!(all_fill(after_slot.as_bytes()), "{ctx}: the next slot was written");

    let bytes = loaded.slot().as_bytes();
    assert_eq!(bytes.len(), slot_len);
    let (pad, len) = (w.pad as usize, case.len as usize);
    let payload_end = pad + len;
    // Scratch: only the fill or the file's own bytes of the window.
    for (i, &b) in bytes[..pad].iter().enumerate() {
        let file_byte = file[(w.start as usize) + i];
        assert!(
            b == FILL || b == file_byte,
            "{ctx}: scratch byte {i} is 0x{b:02x}, neither the fill nor the file's byte 0x{file_byte:02x}"
        );
    }
    // After the payload: untouched, or (with tail room, up to the rounded-up
    // end) the file's own bytes.
    let allowed_end = if room {
        round_up(payload_end as u64, align) as usize
    } else {
        payload_end
    };
    assert!(
        allowed_end <= bytes.len(),
        "{ctx}: slot too short for its own reservation"
    );
    if let Some(i) = first_not_fill(&bytes[allowed_end..]) {
        panic!(
            "{ctx}: byte {} of the slot (payload ends at {payload_end}, allowed end {allowed_end}) was written",
            allowed_end + i
        );
    }
    for (i, &b) in bytes.iter().enumerate().take(allowed_end).skip(payload_end) {
        let fpos = w.start as usize + i;
        let ok = b == FILL || (fpos < file.len() && b == file[fpos]);
        assert!(ok, "{ctx}: tail-room byte {i} holds 0x{b:02x}, not a file byte");
    }
    // Exactly what the path taken writes.
    if d.reads_direct == 1 {
        let dn = w.direct as usize;
        assert!(dn > 0, "{ctx}: reported a direct read for a window with no whole block");
        assert!(
            bytes[..dn] == file[w.start as usize..w.start as usize + dn],
            "{ctx}: the direct window does not hold the file's bytes"
        );
        assert!(
            all_fill(&bytes[dn.max(payload_end)..]),
            "{ctx}: written past the direct window"
        );
    } else {
        assert!(all_fill(&bytes[..pad]), "{ctx}: buffered read wrote into the scratch");
        assert!(
            all_fill(&bytes[payload_end..]),
            "{ctx}: buffered read wrote past the payload"
        );
    }

    // What the stats say.
    assert_eq!(d.bytes, case.len, "{ctx}: bytes counted {d:?}");
    if case.len == 0 {
        // A 0-byte read is a no-op: no I/O, nothing counted, no fallback.
        assert_eq!(
            (d.reads_direct, d.reads_buffered, d.fallbacks.len()),
            (0, 0, 0),
            "{ctx}: a 0-byte read did something {d:?}"
        );
        return;
    }
    assert_eq!(
        d.reads_direct + d.reads_buffered,
        1,
        "{ctx}: one read counted once {d:?}"
    );
    let contract_direct = if case.len == 0 { 0 } else { w.direct };
    if mode == DirectMode::Off {
        assert_eq!(d.reads_direct, 0, "{ctx}: direct read with --direct off {d:?}");
        assert!(d.fallbacks.is_empty(), "{ctx}: off is not a fallback {d:?}");
        assert_eq!(d.bytes_buffered, case.len, "{ctx}: {d:?}");
    } else if capable {
        if contract_direct > 0 {
            assert_eq!(
                (d.reads_direct, d.fallbacks.len()),
                (1, 0),
                "{ctx}: window has a whole block but the read was not direct {d:?}"
            );
            assert_eq!(
                (d.bytes_direct, d.bytes_buffered),
                (case.len - w.tail, w.tail),
                "{ctx}: {d:?}"
            );
        } else {
            assert_eq!(d.reads_buffered, 1, "{ctx}: {d:?}");
            let only_no_bulk: BTreeMap<String, u64> = [("no_bulk".to_string(), 1)].into();
            assert_eq!(
                d.fallbacks, only_no_bulk,
                "{ctx}: sub-block read must count no_bulk only"
            );
            assert_eq!(d.bytes_buffered, case.len, "{ctx}: {d:?}");
        }
    } else if !capable {
        assert!(
            fs == Fs::Other || align < 4096,
            "{ctx}: O_DIRECT should be usable here (shard {:?})",
            shard.direct_refused
        );
        // Not silent: a buffered read carries a counted cause.
        assert!(
            d.reads_direct == 1 || d.fallbacks.values().sum::<u64>() >= 1,
            "{ctx}: buffered read with no fallback counted {d:?}"
        );
    }
}

fn run_matrix(fx: &Fixture, fs: Fs) -> usize {
    let mut reads = 0;
    for mode in [DirectMode::Auto, DirectMode::On, DirectMode::Off] {
        let model = match Model::open(ModelConfig::new(&fx.dir).direct(mode)) {
            Ok(m) => m,
            Err(e) if mode == DirectMode::On && fs == Fs::Other => {
                let msg = e.to_string();
                assert!(
                    fx.files.iter().any(|(p, _)| msg.contains(&p.display().to_string())) && msg.contains("--direct on"),
                    "--direct on refusal must name the shard and say why: {msg}"
                );
                eprintln!("note: --direct on refused on this filesystem ({msg}); On arm skipped");
                continue;
            }
            Err(e) => panic!("open {mode:?}: {e}"),
        };
        if fs == Fs::DirectCapable && mode != DirectMode::Off {
            for f in model.files() {
                assert!(
                    f.direct().is_some(),
                    "{}: no O_DIRECT descriptor: {:?}",
                    f.path.display(),
                    f.direct_refused
                );
            }
        }
        let dio = model.files().iter().map(|f| f.topo.dio_offset_align).max().unwrap();
        if dio > 512 {
            eprintln!("note: the files need {dio}-byte O_DIRECT alignment: 512-byte slots must read buffered, counted");
        }
        for case in &fx.cases {
            for align in [4096u64, 512] {
                for room in [false, true] {
                    one_read(fx, &model, mode, fs, case, align, room);
                    reads += 1;
                }
            }
        }
        let c = counts(&model.stats());
        eprintln!(
            "{fs:?} {mode:?}: {} direct / {} buffered reads, fallbacks {:?}",
            c.reads_direct, c.reads_buffered, c.fallbacks
        );
        if fs == Fs::DirectCapable && mode != DirectMode::Off {
            assert!(c.reads_direct > 0, "no read went direct on a direct-capable filesystem");
        }
    }
    reads
}

fn fs_kind(dir: &Path) -> Fs {
    let model = Model::open(ModelConfig::new(dir)).expect("open");
    let fs_type = model.files()[0].topo.fs_type.clone();
    let disk = matches!(fs_type.as_str(), "ext4" | "xfs");
    if disk && common::fs_reads_o_direct(dir) {
        Fs::DirectCapable
    } else {
        eprintln!(
            "note: {} is on {fs_type}: checking bytes and counted fallbacks only",
            dir.display()
        );
        Fs::Other
    }
}

/// The whole matrix on the build's own filesystem (ext4 here: O_DIRECT with
/// 512-byte alignment, so every arm runs and the stats are held exactly).
#[test]
fn guard_matrix_on_project_filesystem() {
    let tmp = common::tempdir();
    let fx = write_fixture(tmp.path());
    assert_eq!(fx.cases.len(), 13);
    let fs = fs_kind(tmp.path());
    let reads = run_matrix(&fx, fs);
    assert!(reads >= 13 * 2 * 2 * 2, "matrix ran {reads} reads");
}

/// The same matrix on tmpfs (`/dev/shm`): whatever O_DIRECT does there, the
/// bytes are identical and every fallback is counted.
#[test]
fn guard_matrix_on_tmpfs() {
    let shm = Path::new("/dev/shm");
    if !shm.is_dir() {
        eprintln!("skip: no /dev/shm");
        return;
    }
    let tmp = tempfile::Builder::new()
        .prefix("ws-test-")
        .tempdir_in(shm)
        .expect("temp dir in /dev/shm");
    let fx = write_fixture(tmp.path());
    let reads = run_matrix(&fx, Fs::Other);
    assert!(reads >= 13 * 2 * 2 * 2, "matrix ran {reads} reads");
}

/// FIELD-NOTES: "Reads of 0 bytes are no-ops". A zero-length tensor at an
/// unaligned offset, read into a slot with tail room, must not issue I/O.
#[test]
fn zero_length_tensor_with_tail_room_does_no_io() {
    let tmp = common::tempdir();
    let fx = write_fixture(tmp.path());
    let model = Model::open(ModelConfig::new(&fx.dir).direct(DirectMode::Auto)).unwrap();
    let t = model.tensor("a_zero_len").unwrap();
    assert_ne!(t.offset % 4096, 0);
    let arena = Arena::new(SlotSpec::new(1).with_tail_room(true), 1).unwrap();
    let mut slot = arena.take().unwrap();
    slot.as_bytes_mut().fill(FILL);
    let c0 = counts(&model.stats());
    let loaded = model.read_sync(t, slot).unwrap();
    let d = delta(&c0, &counts(&model.stats()));
    assert!(loaded.is_empty());
    assert_eq!(d.reads_direct, 0, "a 0-byte read went to the device: {d:?}");
    assert_eq!(
        first_not_fill(loaded.slot().as_bytes()),
        None,
        "a 0-byte read wrote into the slot"
    );
}

/// The guard check itself catches a write past the payload and into the
/// neighbour (so the matrix cannot pass vacuously).
#[test]
fn guard_checks_detect_stray_writes() {
    let arena = Arena::new(SlotSpec::new(100), 2).unwrap();
    let mut s = arena.take().unwrap();
    s.as_bytes_mut().fill(FILL);
    assert!(all_fill(s.as_bytes()));
    s.as_bytes_mut()[4096 + 100] = 0;
    assert!(!all_fill(s.as_bytes()));
    assert_eq!(first_not_fill(s.as_bytes()), Some(4196));
    let w = want(2007, 5000, 100_000, 4096, false);
    assert_eq!((w.start, w.pad, w.direct, w.tail), (0, 2007, 4096, 2911));
}
