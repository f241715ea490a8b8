//! The writer: every planned file is written under a temporary name in its
//! folder, with O_DIRECT from aligned buffers, so placing a model leaves
//! the page cache as it found it.
//!
//! Per destination root, two threads: a *composer* reads the source
//! (O_DIRECT, through an aligned staging window) and lays each file's bytes
//! out in aligned buffers (the header, then the payloads); a *writer*
//! hashes every tensor as its bytes pass and writes the buffers (O_DIRECT)
//! into the temporary file. So reading the source overlaps hashing and
//! writing, and every drive is written at once.
//!
//! A file's tail that is not a whole block: the aligned part goes O_DIRECT,
//! then `O_DIRECT` is cleared on the descriptor and the rest is written
//! buffered, `fdatasync`ed and its pages dropped (`POSIX_FADV_DONTNEED`).
//! That is the read path's rule (direct bulk, buffered tail) applied to
//! writes; writing a padded block and `ftruncate`-ing it back would make
//! the filesystem zero the end of the last block through the page cache
//! anyway, and would briefly give the file a wrong size.
//!
//! A filesystem that refuses O_DIRECT (EINVAL at open or at a write)
//! gets buffered writes, each buffer `fdatasync`ed and dropped; that is
//! said once per root and recorded in the report. Each finished file is
//! `fsync`ed, its size checked and its header read back, compared with the
//! planned bytes and validated by [`ShardHeader::parse`] before the file
//! counts as written.

use std::collections::BTreeMap;
use std::ffi::OsString;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc;
use std::time::Duration;

use rustix::fs::{Mode, OFlags};
use sha2::Digest;

use super::plan::{Content, Output, Plan, Range};
use super::rules::{temp_name, SafeDir};
use super::source::Source;
use super::{Hook, Step};
use crate::error::{escape, Error, Result};
use crate::format::container::ShardHeader;
use crate::memory::{Arena, Slot, SlotSpec};
use crate::storage::files::drop_all_pages;
use crate::storage::files::drop_pages;
use crate::storage::files::pread_full;
use crate::storage::open::{self as catalog, libc_flags};

/// Buffers per root in the composer -> writer pipeline.
const DEPTH: usize = 3;

/// sha256 of each tensor of a byte stream fed in order.
pub(crate) struct StreamHasher {
    ranges: Vec<Range>,
    next: usize,
    cur: sha2::Sha256,
    out: BTreeMap<String, String>,
}

impl StreamHasher {
    /// `ranges` sorted by `begin`, not overlapping.
    pub(crate) fn new(mut ranges: Vec<Range>) -> Self {
        ranges.sort_by_key(|r| (r.begin, r.end));
        StreamHasher {
            ranges,
            next: 0,
            cur: sha2::Sha256::new(),
            out: BTreeMap::new(),
        }
    }

    /// The stream's bytes `[pos, pos + bytes.len())`, in order.
    pub(crate) fn feed(&mut self, pos: u64, bytes: &[u8]) {
        let end = pos + bytes.len() as u64;
        while let Some(r) = self.ranges.get(self.next) {
            let a = r.begin.max(pos);
            if r.end <= end {
                if r.end > a {
                    self.cur.update(&bytes[(a - pos) as usize..(r.end - pos) as usize]);
                }
                let h = std::mem::take(&mut self.cur);
                self.out
                    .insert(r.name.clone(), crate::model::placed::hex(&h.finalize()));
                self.next += 1;
                continue;
            }
            if r.begin < end {
                self.cur.update(&bytes[(a - pos) as usize..]);
            }
            break;
        }
    }

    /// Every tensor's digest; `None` when the stream ended before the last.
    pub(crate) fn finish(self) -> Option<BTreeMap<String, String>> {
        (self.next == self.ranges.len()).then_some(self.out)
    }
}

/// A file read with O_DIRECT where its filesystem allows (else buffered,
/// pages dropped after each read).
pub(crate) struct SrcFile {
    pub path: PathBuf,
    buffered: File,
    direct: Option<File>,
    pub size: u64,
    align: u64,
    /// Why reads of this file go buffered.
    pub direct_note: Option<String>,
}

impl SrcFile {
    pub(crate) fn open(path: &Path) -> Result<Self> {
        let (buffered, st) = catalog::open_regular(path, true).map_err(|r| r.into_error(path))?;
        let topo = crate::storage::topology::probe(path, &buffered).map_err(|e| Error::io(path, "statx", e))?;
        let align = u64::from(topo.dio_offset_align.max(4096));
        let (direct, direct_note) = if topo.statx_says_no_direct {
            (None, Some(format!("statx reports no direct I/O on {}", topo.fs_type)))
        } else if topo.dio_mem_align > 4096 {
            (
                None,
                Some(format!("O_DIRECT needs {}-byte aligned memory", topo.dio_mem_align)),
            )
        } else {
            match catalog::open_regular_with(path, true, libc_flags::O_DIRECT) {
                Ok((f, d)) if (d.st_dev, d.st_ino) == (st.st_dev, st.st_ino) => (Some(f), None),
                Ok(_) => return Err(Error::catalog(path, "was replaced while it was being opened")),
                Err(r) => (None, Some(format!("open(O_DIRECT) refused: {r}"))),
            }
        };
        Ok(SrcFile {
            path: path.to_path_buf(),
            buffered,
            direct,
            size: st.st_size as u64,
            align,
            direct_note,
        })
    }

    /// Reads at least `want` bytes at `off` into `buf` (whose length is a
    /// multiple of the alignment and at least `want` rounded up to it):
    /// O_DIRECT when `off` is aligned, else (or when the device refuses)
    /// buffered.
    fn read_at_least(&self, buf: &mut [u8], off: u64, want: usize) -> Result<()> {
        if off + want as u64 > self.size {
            return Err(self.changed(off + want as u64));
        }
        let mut done = 0usize;
        if let Some(d) = self.direct.as_ref().filter(|_| off.is_multiple_of(self.align)) {
            let n = round_up(want as u64, self.align).min(buf.len() as u64) as usize;
            while done < want {
                match d.read_at(&mut buf[done..n], off + done as u64) {
                    Ok(0) => return Err(self.changed(off + done as u64)),
                    Ok(k) => {
                        done += k;
                        if done < want && !(done as u64).is_multiple_of(self.align) {
                            break; // the rest buffered, from an unaligned offset
                        }
                    }
                    Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                    Err(e) if e.raw_os_error() == Some(libc::EINVAL) => break,
                    Err(e) => return Err(Error::io(&self.path, "read (O_DIRECT)", e)),
                }
            }
            if done >= want {
                return Ok(());
            }
        }
        let got = pread_full(&self.buffered, &mut buf[done..want], off + done as u64)
            .map_err(|e| Error::io(&self.path, "read", e))?;
        drop_all_pages(&self.buffered);
        if done + got < want {
            return Err(self.changed(off + (done + got) as u64));
        }
        Ok(())
    }

    fn changed(&self, at: u64) -> Error {
        Error::catalog(
            &self.path,
            format!(
                "ends before byte {at} (it was {} bytes when scanned): the source changed while being placed; \
                 nothing was committed, run again",
                self.size
            ),
        )
    }
}

fn round_up(v: u64, a: u64) -> u64 {
    v.div_ceil(a) * a
}

/// An aligned window of a source file, re-read only when a read falls
/// outside it.
struct Stage {
    slot: Slot,
    cap: usize,
    key: Option<(usize, u64, usize)>,
}

impl Stage {
    fn new(cap: usize) -> Result<Self> {
        let arena = Arena::new(SlotSpec::new(cap), 1)?;
        let slot = arena.take().expect("an arena of one slot has one");
        Ok(Stage { slot, cap, key: None })
    }

    /// Calls `f` with the bytes `[off, end)` of `src` (file `id`), in
    /// order, in pieces.
    fn each(&mut self, id: usize, src: &SrcFile, mut off: u64, end: u64, mut f: impl FnMut(&[u8])) -> Result<()> {
        if end > src.size {
            return Err(src.changed(end));
        }
        while off < end {
            let hit = matches!(self.key, Some((k, s, l)) if k == id && s <= off && off < s + l as u64);
            if !hit {
                let start = off - off % src.align;
                let want = (self.cap as u64).min(src.size - start) as usize;
                self.key = None;
                src.read_at_least(&mut self.slot.as_bytes_mut()[..self.cap], start, want)?;
                self.key = Some((id, start, want));
            }
            let (_, s, l) = self.key.expect("filled above");
            let from = (off - s) as usize;
            let to = ((end - s) as usize).min(l);
            f(&self.slot.as_bytes()[from..to]);
            off = s + to as u64;
        }
        Ok(())
    }
}

/// sha256 of each range of `path`, read O_DIRECT where possible.
pub(crate) fn digest_ranges(path: &Path, ranges: &[Range]) -> Result<BTreeMap<String, String>> {
    let src = SrcFile::open(path)?;
    let mut stage = Stage::new(8 << 20)?;
    let mut out = BTreeMap::new();
    for r in ranges {
        let mut h = sha2::Sha256::new();
        stage.each(0, &src, r.begin, r.end, |b| h.update(b))?;
        out.insert(r.name.clone(), crate::model::placed::hex(&h.finalize()));
    }
    Ok(out)
}

/// What happened to one planned file.
#[derive(Debug)]
pub(crate) struct Written {
    /// Index into [`Plan::files`].
    pub out: usize,
    pub tmp: OsString,
    pub digests: BTreeMap<String, String>,
}

/// The files a root's threads write.
pub(crate) struct RootJobs<'a> {
    pub root: usize,
    pub dir: &'a SafeDir,
    /// Indices into [`Plan::files`].
    pub outs: Vec<usize>,
}

/// What the writers did: the files written, the temporary files created
/// (to remove on failure), notes (buffered fallbacks), and the first
/// error, or that a test hook stopped the run.
#[derive(Default)]
pub(crate) struct Outcome {
    pub written: Vec<Written>,
    pub created: Vec<(usize, OsString)>,
    pub notes: Vec<String>,
    pub error: Option<Error>,
    pub stopped: Option<String>,
    pub bytes: u64,
    /// The progress callback panicked: the writers were stopped at once
    /// (the caller removes the temporary files, then resumes the panic).
    pub panic: Option<Box<dyn std::any::Any + Send>>,
}

enum Event {
    Created(usize, OsString),
    Done(Written),
    Note(String),
    Failed(Error),
    Stopped(String),
    Finished,
}

struct Msg {
    out: usize,
    off: u64,
    len: usize,
    last: bool,
    slot: Slot,
}

struct Shared<'a> {
    cancel: AtomicBool,
    bytes: AtomicU64,
    files: AtomicUsize,
    hook: Option<&'a Hook>,
}

/// Writes every file of `jobs` (one composer and one writer thread per
/// root); `progress(bytes, files)` is called on this thread about every
/// 100 ms and at the end.
pub(crate) fn write_files(
    source: &Source,
    plan: &Plan,
    jobs: &[RootJobs<'_>],
    buf: usize,
    hook: Option<&Hook>,
    progress: &mut dyn FnMut(u64, usize),
) -> Outcome {
    let shared = Shared {
        cancel: AtomicBool::new(false),
        bytes: AtomicU64::new(0),
        files: AtomicUsize::new(0),
        hook,
    };
    let mut outcome = Outcome::default();
    // The caller's callback runs under `catch_unwind`: a panic in it stops
    // the writers now (cancel), instead of unwinding out of the scope,
    // which would wait for every file to be written first.
    let mut report = |outcome: &mut Outcome, bytes: u64, files: usize| {
        if outcome.panic.is_some() {
            return;
        }
        if let Err(p) = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| progress(bytes, files))) {
            shared.cancel.store(true, Ordering::Relaxed);
            outcome.panic = Some(p);
        }
    };
    let (tx, rx) = mpsc::channel::<Event>();
    std::thread::scope(|s| {
        let mut writers = 0;
        for job in jobs.iter().filter(|j| !j.outs.is_empty()) {
            let arena = match Arena::new(SlotSpec::new(buf), DEPTH) {
                Ok(a) => a,
                Err(e) => {
                    outcome.error.get_or_insert(e);
                    shared.cancel.store(true, Ordering::Relaxed);
                    break;
                }
            };
            let (to_writer, from_composer) = mpsc::sync_channel::<Msg>(DEPTH);
            let (back, returned) = mpsc::channel::<Slot>();
            let slots: Vec<Slot> = std::iter::from_fn(|| arena.take().ok()).collect();
            let (tx_c, tx_w) = (tx.clone(), tx.clone());
            let shared = &shared;
            std::thread::Builder::new()
                .name(format!("ws-place-read-{}", job.root))
                .spawn_scoped(s, move || {
                    let r = compose(source, plan, job, buf, slots, &returned, &to_writer, &tx_c, shared);
                    if let Err(e) = r {
                        shared.cancel.store(true, Ordering::Relaxed);
                        let _ = tx_c.send(Event::Failed(e));
                    }
                })
                .expect("spawn a placement reader thread");
            std::thread::Builder::new()
                .name(format!("ws-place-write-{}", job.root))
                .spawn_scoped(s, move || {
                    let r = write_root(plan, job, &from_composer, &back, &tx_w, shared);
                    if let Err(e) = r {
                        shared.cancel.store(true, Ordering::Relaxed);
                        let _ = tx_w.send(Event::Failed(e));
                    }
                    // The composer stops when its channels close.
                    drop(from_composer);
                    drop(back);
                    let _ = tx_w.send(Event::Finished);
                })
                .expect("spawn a placement writer thread");
            writers += 1;
        }
        drop(tx);
        let mut finished = 0;
        while finished < writers {
            match rx.recv_timeout(Duration::from_millis(100)) {
                Ok(Event::Created(root, tmp)) => outcome.created.push((root, tmp)),
                Ok(Event::Done(w)) => outcome.written.push(w),
                Ok(Event::Note(n)) => {
                    if !outcome.notes.contains(&n) {
                        tracing::warn!("{n}");
                        outcome.notes.push(n);
                    }
                }
                Ok(Event::Failed(e)) => {
                    shared.cancel.store(true, Ordering::Relaxed);
                    outcome.error.get_or_insert(e);
                }
                Ok(Event::Stopped(at)) => {
                    shared.cancel.store(true, Ordering::Relaxed);
                    outcome.stopped.get_or_insert(at);
                }
                Ok(Event::Finished) => finished += 1,
                Err(mpsc::RecvTimeoutError::Timeout) => {}
                Err(mpsc::RecvTimeoutError::Disconnected) => break,
            }
            report(
                &mut outcome,
                shared.bytes.load(Ordering::Relaxed),
                shared.files.load(Ordering::Relaxed),
            );
        }
        // Events sent after the last `Finished` (a composer's error).
        while let Ok(ev) = rx.try_recv() {
            match ev {
                Event::Failed(e) => {
                    outcome.error.get_or_insert(e);
                }
                Event::Created(root, tmp) => outcome.created.push((root, tmp)),
                _ => {}
            }
        }
    });
    outcome.bytes = shared.bytes.load(Ordering::Relaxed);
    let (bytes, files) = (outcome.bytes, shared.files.load(Ordering::Relaxed));
    report(&mut outcome, bytes, files);
    outcome
}

/// Takes a free buffer: one never used, or one the writer gave back.
fn take_slot(pool: &mut Vec<Slot>, returned: &mpsc::Receiver<Slot>, shared: &Shared<'_>) -> Option<Slot> {
    if let Some(s) = pool.pop() {
        return Some(s);
    }
    loop {
        if shared.cancel.load(Ordering::Relaxed) {
            return None;
        }
        match returned.recv_timeout(Duration::from_millis(100)) {
            Ok(s) => return Some(s),
            Err(mpsc::RecvTimeoutError::Timeout) => {}
            Err(mpsc::RecvTimeoutError::Disconnected) => return None,
        }
    }
}

/// The composer: lays out each file's bytes in aligned buffers.
#[allow(clippy::too_many_arguments)]
fn compose(
    source: &Source,
    plan: &Plan,
    job: &RootJobs<'_>,
    buf: usize,
    mut pool: Vec<Slot>,
    returned: &mpsc::Receiver<Slot>,
    to_writer: &mpsc::SyncSender<Msg>,
    events: &mpsc::Sender<Event>,
    shared: &Shared<'_>,
) -> Result<()> {
    let mut files: BTreeMap<usize, SrcFile> = BTreeMap::new();
    let mut stage: Option<Stage> = None;
    let open = |files: &mut BTreeMap<usize, SrcFile>, shard: usize| -> Result<()> {
        if let std::collections::btree_map::Entry::Vacant(v) = files.entry(shard) {
            let f = v.insert(SrcFile::open(&source.shards[shard].info.path)?);
            if let Some(note) = &f.direct_note {
                let _ = events.send(Event::Note(format!(
                    "source {}: {note}: read buffered (pages dropped after each read)",
                    escape(&f.path)
                )));
            }
        }
        Ok(())
    };
    for &oi in &job.outs {
        let out = &plan.files[oi];
        match &out.content {
            Content::Copy { shard } => {
                open(&mut files, *shard)?;
                let src = &files[shard];
                if src.size != out.size {
                    return Err(src.changed(out.size));
                }
                let mut off = 0u64;
                loop {
                    let Some(mut slot) = take_slot(&mut pool, returned, shared) else {
                        return Ok(());
                    };
                    let len = (buf as u64).min(out.size - off) as usize;
                    src.read_at_least(&mut slot.as_bytes_mut()[..buf], off, len)?;
                    let last = off + len as u64 == out.size;
                    if to_writer
                        .send(Msg {
                            out: oi,
                            off,
                            len,
                            last,
                            slot,
                        })
                        .is_err()
                    {
                        return Ok(());
                    }
                    if last {
                        break;
                    }
                    off += len as u64;
                }
            }
            Content::Build { tensors } => {
                let stage = match &mut stage {
                    Some(s) => s,
                    None => stage.insert(Stage::new(buf)?),
                };
                let all = source.catalog.tensors();
                // The stream: header, then each payload, cut into buffers.
                let mut pieces: Vec<(Option<usize>, u64, u64)> = vec![(None, 0, out.raw.len() as u64)];
                for &t in tensors {
                    let r = &all[t];
                    open(&mut files, r.shard)?;
                    pieces.push((Some(r.shard), r.offset, r.offset + r.len));
                }
                let Some(mut slot) = take_slot(&mut pool, returned, shared) else {
                    return Ok(());
                };
                let (mut fill, mut off) = (0usize, 0u64);
                let mut pending: Option<Result<()>> = None;
                for (shard, a, b) in pieces {
                    let mut put = |bytes: &[u8], slot: &mut Slot, fill: &mut usize, off: &mut u64| -> bool {
                        let mut rest = bytes;
                        while !rest.is_empty() {
                            let n = rest.len().min(buf - *fill);
                            slot.as_bytes_mut()[*fill..*fill + n].copy_from_slice(&rest[..n]);
                            *fill += n;
                            rest = &rest[n..];
                            if *fill == buf && *off + buf as u64 != out.size {
                                let Some(next) = take_slot(&mut pool, returned, shared) else {
                                    return false;
                                };
                                let full = std::mem::replace(slot, next);
                                let msg = Msg {
                                    out: oi,
                                    off: *off,
                                    len: buf,
                                    last: false,
                                    slot: full,
                                };
                                if to_writer.send(msg).is_err() {
                                    return false;
                                }
                                *off += buf as u64;
                                *fill = 0;
                            }
                        }
                        true
                    };
                    let mut alive = true;
                    match shard {
                        None => alive = put(&out.raw[a as usize..b as usize], &mut slot, &mut fill, &mut off),
                        Some(sh) => {
                            let src = &files[&sh];
                            let r = stage.each(sh, src, a, b, |bytes| {
                                if alive {
                                    alive = put(bytes, &mut slot, &mut fill, &mut off);
                                }
                            });
                            if let Err(e) = r {
                                pending = Some(Err(e));
                            }
                        }
                    }
                    if let Some(Err(e)) = pending.take() {
                        return Err(e);
                    }
                    if !alive {
                        return Ok(());
                    }
                }
                if off + fill as u64 != out.size {
                    return Err(Error::catalog(
                        source.real.join(&out.name),
                        format!(
                            "composed {} bytes, planned {}: refused (a bug in weightstream)",
                            off + fill as u64,
                            out.size
                        ),
                    ));
                }
                let msg = Msg {
                    out: oi,
                    off,
                    len: fill,
                    last: true,
                    slot,
                };
                if to_writer.send(msg).is_err() {
                    return Ok(());
                }
            }
            Content::Extra { .. } | Content::Bytes(_) => {}
        }
    }
    Ok(())
}

/// The file a writer is filling.
struct Open {
    out: usize,
    file: File,
    tmp: OsString,
    shown: PathBuf,
    direct: bool,
    align: u64,
    /// sha256 of each tensor, fed as the buffers are written (on this
    /// thread, so hashing overlaps the composer's reads).
    hasher: StreamHasher,
}

/// The writer of one root.
fn write_root(
    plan: &Plan,
    job: &RootJobs<'_>,
    from: &mpsc::Receiver<Msg>,
    back: &mpsc::Sender<Slot>,
    events: &mpsc::Sender<Event>,
    shared: &Shared<'_>,
) -> Result<()> {
    let dir = job.dir;
    let mut cur: Option<Open> = None;
    while let Ok(msg) = from.recv() {
        if shared.cancel.load(Ordering::Relaxed) {
            return Ok(());
        }
        let out = &plan.files[msg.out];
        if msg.off == 0 {
            dir.recheck()?;
            let tmp = temp_name(&out.name);
            let shown = dir.path.join(&out.name);
            let flags = OFlags::RDWR | OFlags::CREATE | OFlags::EXCL | OFlags::NOFOLLOW | OFlags::CLOEXEC;
            let mode = Mode::from_raw_mode(0o600);
            let (fd, mut note) = match rustix::fs::openat(&dir.fd, &tmp, flags | OFlags::DIRECT, mode) {
                Ok(fd) => (fd, None),
                Err(rustix::io::Errno::INVAL) => {
                    let fd = rustix::fs::openat(&dir.fd, &tmp, flags, mode)
                        .map_err(|e| Error::io(&shown, "create a temporary file", e))?;
                    (fd, Some("open(O_DIRECT) refused (EINVAL)".to_string()))
                }
                Err(e) => return Err(Error::io(&shown, "create a temporary file", e)),
            };
            let _ = events.send(Event::Created(job.root, tmp.clone()));
            let file = File::from(fd);
            let mut align = 4096u64;
            if note.is_none() {
                match crate::storage::topology::probe(&dir.path, &file) {
                    Ok(t) if t.statx_says_no_direct => {
                        note = Some(format!("statx reports no direct I/O on {}", t.fs_type))
                    }
                    Ok(t) if t.dio_mem_align > 4096 => {
                        note = Some(format!("O_DIRECT needs {}-byte aligned memory", t.dio_mem_align))
                    }
                    Ok(t) => align = u64::from(t.dio_offset_align.max(4096)),
                    Err(e) => return Err(Error::io(&shown, "statx", e)),
                }
                if note.is_some() {
                    clear_direct(&file, &shown)?;
                }
            }
            let direct = note.is_none();
            if let Some(n) = note {
                let _ = events.send(Event::Note(buffered_note(dir, &n)));
            }
            cur = Some(Open {
                out: msg.out,
                file,
                tmp,
                shown,
                direct,
                align,
                hasher: StreamHasher::new(out.ranges.clone()),
            });
        }
        let Some(o) = cur.as_mut().filter(|o| o.out == msg.out) else {
            return Err(Error::catalog(
                dir.path.join(&out.name),
                "a buffer arrived for a file not being written: refused (a bug in weightstream)",
            ));
        };
        let bytes = &msg.slot.as_bytes()[..msg.len];
        o.hasher.feed(msg.off, bytes);
        if let Some(n) = write_chunk(o, bytes, msg.off, msg.last)? {
            let _ = events.send(Event::Note(buffered_note(dir, &n)));
        }
        shared.bytes.fetch_add(msg.len as u64, Ordering::Relaxed);
        let _ = back.send(msg.slot);
        if msg.last {
            let o = cur.take().expect("a file is open");
            finish(out, &o)?;
            let Some(digests) = o.hasher.finish() else {
                return Err(Error::catalog(
                    &o.shown,
                    "the stream ended before its last tensor: refused (a bug in weightstream)",
                ));
            };
            let k = shared.files.fetch_add(1, Ordering::Relaxed) + 1;
            let _ = events.send(Event::Done(Written {
                out: msg.out,
                tmp: o.tmp,
                digests,
            }));
            if let Some(h) = shared.hook {
                let step = Step::FileWritten(k);
                if h(&step) {
                    let _ = events.send(Event::Stopped(step.to_string()));
                    shared.cancel.store(true, Ordering::Relaxed);
                    return Ok(());
                }
            }
        }
    }
    Ok(())
}

fn buffered_note(dir: &SafeDir, why: &str) -> String {
    format!(
        "{}: {why}: files written buffered there (each buffer fdatasync'ed and its pages dropped)",
        escape(&dir.root)
    )
}

fn clear_direct(file: &File, shown: &Path) -> Result<()> {
    let fl = rustix::fs::fcntl_getfl(file).map_err(|e| Error::io(shown, "fcntl(F_GETFL)", e))?;
    rustix::fs::fcntl_setfl(file, fl - OFlags::DIRECT).map_err(|e| Error::io(shown, "fcntl(F_SETFL)", e))
}

fn pwrite_all(file: &File, mut buf: &[u8], mut off: u64) -> std::io::Result<()> {
    while !buf.is_empty() {
        match file.write_at(buf, off) {
            Ok(0) => return Err(std::io::Error::from(std::io::ErrorKind::WriteZero)),
            Ok(k) => {
                buf = &buf[k..];
                off += k as u64;
            }
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Writes one buffer of the file at `off`; returns a note when O_DIRECT
/// had to be given up.
fn write_chunk(o: &mut Open, bytes: &[u8], off: u64, last: bool) -> Result<Option<String>> {
    let fail = |what: &'static str, e: std::io::Error| {
        let hint = if e.raw_os_error() == Some(libc::ENOSPC) {
            "; the filesystem is full: nothing was committed (the previous layout, if any, is as it was); free \
             space there or choose another root"
        } else {
            ""
        };
        Error::catalog(
            &o.shown,
            format!("{what} at byte {off} ({} bytes): {e}{hint}", bytes.len()),
        )
    };
    let mut note = None;
    if o.direct {
        let aligned = if last {
            bytes.len() as u64 / o.align * o.align
        } else {
            bytes.len() as u64
        } as usize;
        let direct = if aligned > 0 {
            pwrite_all(&o.file, &bytes[..aligned], off)
        } else {
            Ok(())
        };
        match direct {
            Ok(()) if aligned == bytes.len() => return Ok(None),
            Ok(()) => {
                // The sub-block tail: buffered, synced, dropped.
                clear_direct(&o.file, &o.shown)?;
                o.direct = false;
                let tail = &bytes[aligned..];
                let at = off + aligned as u64;
                pwrite_all(&o.file, tail, at).map_err(|e| fail("write the tail", e))?;
                rustix::fs::fdatasync(&o.file).map_err(|e| fail("fdatasync", e.into()))?;
                drop_pages(&o.file, at, tail.len() as u64);
                return Ok(None);
            }
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
                clear_direct(&o.file, &o.shown)?;
                o.direct = false;
                note = Some(format!(
                    "a write with O_DIRECT was refused (EINVAL) on {}",
                    escape(&o.shown)
                ));
            }
            Err(e) => return Err(fail("write (O_DIRECT)", e)),
        }
    }
    pwrite_all(&o.file, bytes, off).map_err(|e| fail("write", e))?;
    rustix::fs::fdatasync(&o.file).map_err(|e| fail("fdatasync", e.into()))?;
    drop_pages(&o.file, off, bytes.len() as u64);
    Ok(note)
}

/// A finished temporary file: `fsync`ed, its size checked, its header
/// read back, compared with the planned bytes and validated.
fn finish(out: &Output, o: &Open) -> Result<()> {
    rustix::fs::fsync(&o.file).map_err(|e| Error::io(&o.shown, "fsync", e))?;
    let st = rustix::fs::fstat(&o.file).map_err(|e| Error::io(&o.shown, "fstat", e))?;
    if st.st_size as u64 != out.size {
        return Err(Error::catalog(
            &o.shown,
            format!("is {} bytes after writing, {} planned", st.st_size, out.size),
        ));
    }
    let mut back = vec![0u8; out.raw.len()];
    crate::format::container::read_exact_at(&o.shown, &o.file, &mut back, 0)?;
    drop_all_pages(&o.file);
    if back != out.raw {
        return Err(Error::catalog(
            &o.shown,
            "its header read back differs from the bytes written: refused",
        ));
    }
    ShardHeader::parse(&o.shown, back, out.size)?;
    Ok(())
}

/// Writes an extra file of the primary under a temporary name (buffered:
/// small; synced, pages dropped); returns the temporary name and the
/// sha256 of the bytes written.
pub(crate) fn write_extra(dir: &SafeDir, source: &Source, out: &Output) -> Result<(OsString, String)> {
    use std::io::{Read, Write};
    dir.recheck()?;
    let tmp = temp_name(&out.name);
    let shown = dir.path.join(&out.name);
    let fd = rustix::fs::openat(
        &dir.fd,
        &tmp,
        OFlags::WRONLY | OFlags::CREATE | OFlags::EXCL | OFlags::NOFOLLOW | OFlags::CLOEXEC,
        Mode::from_raw_mode(0o600),
    )
    .map_err(|e| Error::io(&shown, "create a temporary file", e))?;
    let mut f = File::from(fd);
    let mut h = sha2::Sha256::new();
    let r = (|| -> Result<u64> {
        match &out.content {
            Content::Bytes(b) => {
                f.write_all(b).map_err(|e| Error::io(&shown, "write", e))?;
                h.update(b);
                Ok(b.len() as u64)
            }
            Content::Extra { extra } => {
                let e = &source.extras[*extra];
                let (src, _) = catalog::open_regular(&e.path, true).map_err(|r| r.into_error(&e.path))?;
                let mut buf = vec![0u8; 1 << 20];
                let mut n = 0u64;
                let mut r = &src;
                loop {
                    let k = r.read(&mut buf).map_err(|err| Error::io(&e.path, "read", err))?;
                    if k == 0 {
                        break;
                    }
                    f.write_all(&buf[..k]).map_err(|err| Error::io(&shown, "write", err))?;
                    h.update(&buf[..k]);
                    n += k as u64;
                }
                drop_all_pages(&src);
                Ok(n)
            }
            _ => Ok(0),
        }
    })();
    let done = r.and_then(|n| {
        rustix::fs::fsync(&f).map_err(|e| Error::io(&shown, "fsync", e))?;
        drop_all_pages(&f);
        if n != out.size {
            return Err(Error::catalog(
                &shown,
                format!(
                    "copied {n} bytes, the source file had {}: it changed while being placed",
                    out.size
                ),
            ));
        }
        Ok(())
    });
    match done {
        Ok(()) => Ok((tmp, crate::model::placed::hex(&h.finalize()))),
        Err(e) => {
            let _ = rustix::fs::unlinkat(&dir.fd, &tmp, rustix::fs::AtFlags::empty());
            Err(e)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn r(name: &str, b: u64, e: u64) -> Range {
        Range {
            name: name.into(),
            begin: b,
            end: e,
        }
    }

    #[test]
    fn stream_hashes_match_whole_hashes_for_any_cut() {
        let data: Vec<u8> = (0..1000u32).map(|i| (i * 7 + 3) as u8).collect();
        let ranges = vec![r("a", 10, 300), r("z", 300, 300), r("b", 300, 999), r("c", 999, 1000)];
        let want: BTreeMap<String, String> = ranges
            .iter()
            .map(|x| {
                (
                    x.name.clone(),
                    crate::model::placed::sha256_hex(&data[x.begin as usize..x.end as usize]),
                )
            })
            .collect();
        for cut in [1usize, 7, 10, 64, 290, 300, 301, 999, 1000] {
            let mut h = StreamHasher::new(ranges.clone());
            for (i, c) in data.chunks(cut).enumerate() {
                h.feed((i * cut) as u64, c);
            }
            assert_eq!(h.finish().unwrap(), want, "cut {cut}");
        }
        let mut h = StreamHasher::new(ranges);
        h.feed(0, &data[..500]);
        assert!(h.finish().is_none());
    }
}
