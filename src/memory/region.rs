//! The memory of an arena: an anonymous private mapping this crate owns
//! (`MADV_DONTFORK`, on transparent huge pages when large enough; under
//! Miri a page-aligned heap allocation), or memory a caller owns and lent
//! to an engine (`Engine::register_memory`), which is never unmapped here.

use std::ptr::NonNull;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use crate::error::{Error, Result};

/// The system page size (what every mapping and slot is aligned to at
/// least).
pub(crate) fn page_size() -> usize {
    rustix::param::page_size()
}

/// The memory of one arena: an anonymous private mapping, `MADV_DONTFORK`
/// (under Miri: a page-aligned, zeroed heap allocation). Released on drop.
pub(crate) struct Region {
    pub(crate) ptr: NonNull<u8>,
    pub(crate) len: usize,
    /// `madvise(MADV_DONTFORK)` succeeded: a forked child does not get these
    /// pages. Always false under Miri (no mapping, no fork).
    pub(crate) dontfork: bool,
    /// `madvise(MADV_HUGEPAGE)` succeeded on a 2 MiB-aligned region: the
    /// kernel backs it with transparent huge pages where it can.
    pub(crate) huge: bool,
    /// The caller's memory (`Engine::register_memory`): never unmapped or
    /// advised here.
    pub(crate) borrowed: bool,
    /// What the memory was allocated with (Miri only).
    #[cfg(miri)]
    layout: std::alloc::Layout,
}

/// A transparent huge page (x86-64, arm64 with 4 KiB base pages).
#[cfg(not(miri))]
const HUGE_PAGE: usize = 2 << 20;

static HUGEPAGE_REFUSALS: AtomicU64 = AtomicU64::new(0);
static HUGEPAGE_WARNED: AtomicBool = AtomicBool::new(false);

/// Arena mappings of at least 2 MiB whose `madvise(MADV_HUGEPAGE)` the
/// kernel refused (they use 4 KiB pages; warned once). A kernel with
/// transparent huge pages `never` accepts the advice and ignores it: see
/// [`Arena::huge_page_bytes`](crate::Arena::huge_page_bytes) for what an arena really got.
pub(crate) fn hugepage_refusals() -> u64 {
    HUGEPAGE_REFUSALS.load(Ordering::Relaxed)
}

/// Mappings whose `madvise(MADV_DONTFORK)` failed, in this process.
static DONTFORK_FAILURES: AtomicU64 = AtomicU64::new(0);
static DONTFORK_WARNED: AtomicBool = AtomicBool::new(false);

/// How many arena mappings of this process `fork()` would copy into a child
/// because `madvise(MADV_DONTFORK)` failed on them (warned once, at the
/// first). 0 when every arena is fork-protected.
pub(crate) fn dontfork_failures() -> u64 {
    DONTFORK_FAILURES.load(Ordering::Relaxed)
}

/// Payloads whose pages could not be handed to forked children
/// (`madvise(MADV_DOFORK)` refused; warned once): a child does not have
/// them.
static INHERIT_FAILURES: AtomicU64 = AtomicU64::new(0);
static INHERIT_WARNED: AtomicBool = AtomicBool::new(false);
/// Slots whose pages could not be fork-protected again when they came
/// back (`madvise(MADV_DONTFORK)` refused; warned once): kept out of use
/// for the arena's life rather than read into while a child may inherit
/// them.
static REPROTECT_LEAKS: AtomicU64 = AtomicU64::new(0);
static REPROTECT_WARNED: AtomicBool = AtomicBool::new(false);

/// Payloads handed over whose pages a forked child does not get, because
/// the kernel refused `MADV_DOFORK` on them (warned once, at the first).
pub(crate) fn inherit_failures() -> u64 {
    INHERIT_FAILURES.load(Ordering::Relaxed)
}

/// Slots kept out of use because their pages could not be fork-protected
/// again (warned once, at the first).
pub(crate) fn reprotect_leaks() -> u64 {
    REPROTECT_LEAKS.load(Ordering::Relaxed)
}

/// Whether a forked child inherits pages: what [`Region::advise_fork`] sets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ForkAdvice {
    /// `MADV_DOFORK`: ordinary memory, copied on write into a child. Only
    /// for bytes no read writes any more.
    Inherit,
    /// `MADV_DONTFORK`: absent in a child (what every mapping starts as).
    Protect,
}

/// Counts a refused fork advice by what it costs, and warns once per kind.
fn note_refusal(advice: ForkAdvice, len: usize, e: &std::io::Error) {
    let (count, warned, what) = match advice {
        ForkAdvice::Inherit => (
            &INHERIT_FAILURES,
            &INHERIT_WARNED,
            "a forked child will not have these bytes (counted in Stats::arena_inherit_failures)",
        ),
        ForkAdvice::Protect => (
            &REPROTECT_LEAKS,
            &REPROTECT_WARNED,
            "the slot is kept out of use for the arena's life (counted in Stats::arena_reprotect_leaks)",
        ),
    };
    count.fetch_add(1, Ordering::Relaxed);
    if !warned.swap(true, Ordering::Relaxed) {
        tracing::warn!("fork advice {advice:?} on {len} bytes of an arena refused: {e}; {what} (said once)");
    }
}

impl Region {
    /// Sets whether a forked child inherits the pages of
    /// `offset..offset + len` (page-aligned, inside the region). Our own
    /// mappings only: a caller's memory is never advised, and a mapping
    /// whose first `MADV_DONTFORK` failed is inherited whatever this says.
    /// A refusal is counted and warned once (naming what it costs), and
    /// returned.
    pub(crate) fn advise_fork(&self, offset: usize, len: usize, advice: ForkAdvice) -> std::io::Result<()> {
        if self.borrowed || !self.dontfork || len == 0 {
            return Ok(());
        }
        let page = page_size();
        assert!(
            offset.is_multiple_of(page)
                && len.is_multiple_of(page)
                && offset.checked_add(len).is_some_and(|e| e <= self.len),
            "fork advice on [{offset}, +{len}) of a region of {} bytes: not whole pages inside it",
            self.len
        );
        let r = self.madvise_fork(offset, len, advice);
        if let Err(e) = &r {
            note_refusal(advice, len, e);
        }
        r
    }

    /// A hand-over to forked children refused before the kernel is asked
    /// (`why`: a page it would share holds another slot in use): counted
    /// and warned once as the kernel's refusals are, and returned as the
    /// error to give.
    pub(crate) fn refuse_fork_advice(&self, why: String) -> std::io::Error {
        let e = std::io::Error::other(why);
        note_refusal(ForkAdvice::Inherit, 0, &e);
        e
    }

    #[cfg(not(miri))]
    fn madvise_fork(&self, offset: usize, len: usize, advice: ForkAdvice) -> std::io::Result<()> {
        let advice = match advice {
            ForkAdvice::Inherit => rustix::mm::Advice::LinuxDoFork,
            ForkAdvice::Protect => rustix::mm::Advice::LinuxDontFork,
        };
        // SAFETY: `offset..offset + len` is whole pages inside the mapping
        // this region owns (asserted by the caller above); MADV_DOFORK and
        // MADV_DONTFORK change only what fork() copies, never the contents
        // or the address of a page.
        unsafe { rustix::mm::madvise(self.ptr.as_ptr().add(offset).cast(), len, advice) }.map_err(Into::into)
    }

    /// Miri has no mapping and no fork.
    #[cfg(miri)]
    fn madvise_fork(&self, _offset: usize, _len: usize, _advice: ForkAdvice) -> std::io::Result<()> {
        Ok(())
    }

    /// `len` bytes (> 0, <= `isize::MAX`), readable and writable, starting
    /// on a page boundary (on a 2 MiB boundary, advised for transparent huge
    /// pages, when `len` is at least 2 MiB). `populate` faults every page in
    /// now.
    ///
    /// Huge pages matter for I/O: a read into physically contiguous memory
    /// is one segment per 2 MiB instead of one per 4 KiB page, and a device
    /// caps the segments of a request (virtio-blk: 254, so a 1 MiB read into
    /// 4 KiB pages is split in two); registering them pins fewer pages.
    #[cfg(not(miri))]
    pub(crate) fn new(len: usize, populate: bool, what: &dyn Fn() -> (String, String)) -> Result<Region> {
        use rustix::mm::{Advice, MapFlags, ProtFlags};
        let huge = len >= HUGE_PAGE;
        // Room to align the start to a huge page, trimmed off below.
        let map_len = if huge { len.checked_add(HUGE_PAGE) } else { Some(len) }
            .filter(|&l| l <= isize::MAX as usize)
            .ok_or_else(|| Error::Config(format!("an arena of {len} bytes exceeds isize::MAX")))?;
        // SAFETY: a fresh anonymous private mapping at an address of the
        // kernel's choosing aliases no existing memory.
        let raw = unsafe {
            rustix::mm::mmap_anonymous(
                std::ptr::null_mut(),
                map_len,
                ProtFlags::READ | ProtFlags::WRITE,
                MapFlags::PRIVATE,
            )
        }
        .map_err(|e| {
            let (mut what, set_by) = what();
            if map_len != len {
                what.push_str(&format!(
                    " (mapped as {map_len} bytes: room to start on a 2 MiB boundary)"
                ));
            }
            Error::Alloc {
                what,
                bytes: len,
                limits: crate::memory::limits::describe(),
                set_by,
                source: e.into(),
            }
        })?;
        let base = raw as usize;
        let start = if huge { base.next_multiple_of(HUGE_PAGE) } else { base };
        if huge {
            let (head, tail) = (start - base, map_len - len - (start - base));
            // SAFETY: both ranges are the unused ends of the mapping just
            // made (before `start`, after `start + len`); nothing refers to
            // them. Unmapping them leaves exactly `start..start + len`.
            unsafe {
                if head > 0 {
                    let _ = rustix::mm::munmap(raw, head);
                }
                if tail > 0 {
                    let _ = rustix::mm::munmap((start + len) as *mut std::ffi::c_void, tail);
                }
            }
        }
        let Some(ptr) = NonNull::new(start as *mut u8) else {
            return Err(Error::Config(format!("mmap of {len} bytes returned a null address")));
        };
        let mut region = Region {
            ptr,
            len,
            dontfork: false,
            huge: false,
            borrowed: false,
        };
        // SAFETY: `ptr..ptr+len` is exactly the mapping owned by `region`;
        // MADV_DONTFORK changes only whether fork() copies it, never its
        // contents or its address.
        match unsafe { rustix::mm::madvise(ptr.as_ptr().cast(), len, Advice::LinuxDontFork) } {
            Ok(()) => region.dontfork = true,
            Err(e) => {
                DONTFORK_FAILURES.fetch_add(1, Ordering::Relaxed);
                if !DONTFORK_WARNED.swap(true, Ordering::Relaxed) {
                    tracing::warn!(
                        "madvise(MADV_DONTFORK) on an arena of {len} bytes failed: {e}; fork() will copy this arena \
                         into the child (said once; counted in weightstream::arena::dontfork_failures)"
                    );
                }
            }
        }
        if huge {
            // SAFETY: as above; MADV_HUGEPAGE changes only how the kernel
            // backs the (still untouched) pages.
            match unsafe { rustix::mm::madvise(ptr.as_ptr().cast(), len, Advice::LinuxHugepage) } {
                Ok(()) => region.huge = true,
                Err(e) => {
                    HUGEPAGE_REFUSALS.fetch_add(1, Ordering::Relaxed);
                    if !HUGEPAGE_WARNED.swap(true, Ordering::Relaxed) {
                        tracing::warn!(
                            "madvise(MADV_HUGEPAGE) on an arena of {len} bytes failed: {e}; it uses 4 KiB pages \
                             (more segments per read; said once; counted in weightstream::arena::hugepage_refusals)"
                        );
                    }
                }
            }
        }
        if populate {
            region.touch();
        }
        Ok(region)
    }

    /// Faults in the pages of `offset..offset + len` (clamped to the
    /// region) without writing them: `MADV_POPULATE_WRITE` (Linux 5.14)
    /// allocates what is missing and leaves present pages, and their
    /// contents, alone, so it may run while reads land in the same range.
    /// Our own mappings only (a caller's memory is never advised).
    #[cfg(not(miri))]
    pub(crate) fn populate_range(&self, offset: usize, len: usize) -> rustix::io::Result<()> {
        let page = page_size();
        let start = offset.min(self.len) / page * page;
        let end = offset.saturating_add(len).min(self.len);
        if self.borrowed || end <= start {
            return Ok(());
        }
        // SAFETY: `start..end` lies inside the mapping this region owns
        // (clamped above; `start` page-aligned as madvise requires);
        // MADV_POPULATE_WRITE only faults pages in (never changes the
        // contents of one present, nor the mapping), so a read landing in
        // the range at the same time is unaffected.
        unsafe {
            rustix::mm::madvise(
                self.ptr.as_ptr().add(start).cast(),
                end - start,
                rustix::mm::Advice::LinuxPopulateWrite,
            )
        }
    }

    /// Miri has no madvise: nothing to fault in (the memory is the heap's).
    #[cfg(miri)]
    pub(crate) fn populate_range(&self, _offset: usize, _len: usize) -> rustix::io::Result<()> {
        Ok(())
    }

    /// Hands the whole pages inside `offset..offset + len` (clamped to the
    /// region) back to the kernel (`MADV_DONTNEED`): they stop counting in
    /// the process's resident memory and read as zeros, faulted fresh, when
    /// next touched. Our own mappings only (a caller's memory is never
    /// advised). A refusal leaves the pages as they were (still good
    /// memory, only resident): returned for the caller to count.
    ///
    /// # Safety
    /// Nobody reads or writes those bytes now or until they are handed out
    /// again (a slot's, with the slot gone and its extent not yet free),
    /// and no kernel I/O targets them: the region is not registered as
    /// fixed buffers (the kernel would keep writing the old, pinned pages).
    #[cfg(not(miri))]
    pub(crate) unsafe fn discard_pages(&self, offset: usize, len: usize) -> rustix::io::Result<()> {
        let page = page_size();
        let start = offset.min(self.len).div_ceil(page) * page;
        let end = offset.saturating_add(len).min(self.len) / page * page;
        if self.borrowed || end <= start {
            return Ok(());
        }
        // SAFETY: `start..end` is whole pages inside the mapping this region
        // owns (clamped and rounded inwards above); the caller guarantees
        // nothing uses those bytes, so dropping their contents loses nothing
        // anyone reads, and no kernel I/O holds them.
        unsafe {
            rustix::mm::madvise(
                self.ptr.as_ptr().add(start).cast(),
                end - start,
                rustix::mm::Advice::LinuxDontNeed,
            )
        }
    }

    /// Miri has no madvise: the bytes are zeroed, as a discarded page reads.
    ///
    /// # Safety
    /// As the real one's.
    #[cfg(miri)]
    pub(crate) unsafe fn discard_pages(&self, offset: usize, len: usize) -> rustix::io::Result<()> {
        let page = page_size();
        let start = offset.min(self.len).div_ceil(page) * page;
        let end = offset.saturating_add(len).min(self.len) / page * page;
        if !self.borrowed && start < end {
            // SAFETY: inside the allocation; unused by anyone (the contract).
            unsafe { std::ptr::write_bytes(self.ptr.as_ptr().add(start), 0, end - start) };
        }
        Ok(())
    }

    /// Faults every page in (after any advice or NUMA policy is set, so
    /// each page is allocated under it).
    pub(crate) fn touch(&self) {
        for off in (0..self.len).step_by(page_size()) {
            // SAFETY: `off < len`, inside the mapping; no slot exists yet, so
            // this write aliases nothing. Volatile so the first touch happens.
            unsafe { std::ptr::write_volatile(self.ptr.as_ptr().add(off), 0) };
        }
    }

    /// Miri cannot model mmap or madvise: the same geometry from the global
    /// allocator, page-aligned and zeroed like a fresh anonymous mapping.
    #[cfg(miri)]
    pub(crate) fn new(len: usize, _populate: bool, _what: &dyn Fn() -> (String, String)) -> Result<Region> {
        let layout = std::alloc::Layout::from_size_align(len, page_size())
            .map_err(|e| Error::Config(format!("an arena of {len} bytes: {e}")))?;
        // SAFETY: the layout's size is non-zero (`len` > 0, checked by `map`).
        let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
        let Some(ptr) = NonNull::new(ptr) else {
            return Err(Error::Config(format!("allocating an arena of {len} bytes failed")));
        };
        Ok(Region {
            ptr,
            len,
            dontfork: false,
            huge: false,
            borrowed: false,
            layout,
        })
    }
}

impl Region {
    /// Memory the caller owns, `len` bytes at `ptr`: used in place, never
    /// advised, unmapped or freed here.
    ///
    /// # Safety
    /// `ptr..ptr + len` must stay valid for reads and writes for as long as
    /// the region lives (see `Engine::register_memory`).
    pub(crate) unsafe fn borrowed(ptr: NonNull<u8>, len: usize) -> Region {
        Region {
            ptr,
            len,
            dontfork: false,
            huge: false,
            borrowed: true,
            #[cfg(miri)]
            layout: std::alloc::Layout::new::<u8>(),
        }
    }
}

impl Drop for Region {
    fn drop(&mut self) {
        if self.borrowed {
            return;
        }
        #[cfg(not(miri))]
        {
            // SAFETY: `ptr`/`len` are exactly the mapping made by
            // `Region::new`, and no `Slot` exists any more (each holds an
            // `Arc<Mapping>`, which owns this region), so nothing can reach
            // the memory after this.
            let _ = unsafe { rustix::mm::munmap(self.ptr.as_ptr().cast(), self.len) };
        }
        #[cfg(miri)]
        {
            // SAFETY: allocated by `Region::new` with this same layout; no
            // `Slot` exists any more (as above).
            unsafe { std::alloc::dealloc(self.ptr.as_ptr(), self.layout) };
        }
    }
}
