//! `ws_fill`: tensors (or slices of them) read straight into memory the
//! caller already has (`Engine::fill`): each destination a name, a pointer
//! and a length; in place where its address is in phase, through the
//! engine's bounded staging and one copy elsewhere.

use std::ffi::c_int;
use std::ptr::NonNull;

use crate::engine::ENGINES;
use crate::status::{guard, ws_status, Fail, Res};
use crate::types::{ws_engine, ws_range};
use crate::util::{invalid, null, opt_str, options};

/// One destination of `ws_fill`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct ws_fill_target {
    /// The tensor's NUL-terminated name.
    pub name: *const std::ffi::c_char,
    /// A slice of it (`ndims` ranges, one per leading dimension, the rest
    /// whole; as `ws_read_slice`), or NULL with `ndims` 0: all of it.
    pub bounds: *const ws_range,
    /// The number of `bounds`. A dimension count is `ndim` everywhere
    /// else (`ws_tensor_info.ndim`, the slice calls' parameters); this
    /// field keeps the name it was released with (ABI 1.1).
    pub ndims: usize,
    /// Where its bytes (compact, row-major) land: `len` bytes, exactly the
    /// tensor's (or the slice's) payload.
    pub dest: *mut std::ffi::c_void,
    pub len: usize,
}

/// `ws_fill_options.flags`: every byte through staging and one copy, none
/// read in place (memory the kernel must not write).
pub const WS_FILL_STAGED: u32 = 1;

/// How `ws_fill` reads. Start from `ws_fill_options_default()`; a zero
/// field is the default.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct ws_fill_options {
    /// `sizeof(ws_fill_options)` as the caller compiled it.
    pub struct_size: u32,
    /// 0 or `WS_FILL_STAGED`.
    pub flags: u32,
    /// Bytes of staging the reads not yet copied hold at most; 0: the
    /// default (32 MiB).
    pub staging_bytes: u64,
    /// Copy threads besides the calling thread; -1: the default (the CPUs
    /// the I/O threads leave spare, 1 to 8); 0: the calling thread alone;
    /// at most 256, and never more than the call has staged pieces.
    pub copy_threads: i32,
    /// NULL, or `count` bytes the call sets, one per target in order: 1
    /// when that target holds its whole payload, 0 when not. Written on
    /// every return once the options are read: all 1 on success, which
    /// targets are whole after a failed read, all 0 when the call is
    /// refused before reading. (ABI 1.3; a caller built against 1.2 has a
    /// smaller `struct_size` and no such field.)
    pub complete: *mut u8,
}

/// `sizeof(ws_fill_options)` in ABI 1.1 and 1.2, before `complete`.
const FILL_OPTIONS_1_1: usize = std::mem::offset_of!(ws_fill_options, complete);

/// What `ws_fill` did.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct ws_fill_report {
    /// Destinations whose whole payload is in place. On an error, the
    /// others may be partly written.
    pub targets_complete: u64,
    /// Payload bytes written.
    pub bytes: u64,
    /// Bytes of whole blocks the drives moved.
    pub bytes_read: u64,
    /// Payload bytes read in place (O_DIRECT), staged and copied, and read
    /// buffered (no O_DIRECT copy of the shard).
    pub in_place_bytes: u64,
    pub staged_bytes: u64,
    pub buffered_bytes: u64,
    /// Reads of each kind.
    pub in_place_reads: u64,
    pub staged_reads: u64,
    pub buffered_reads: u64,
    /// Bytes of the staging arena used.
    pub staging_bytes: u64,
    /// Copy threads started.
    pub copy_threads: u32,
    /// 1 where the reads ever waited for a copy to give staging back.
    pub staging_waited: c_int,
    /// CPU time of the copies, all threads.
    pub copy_cpu_ns: u64,
    /// Wall time of the call.
    pub elapsed_ns: u64,
}

/// The default fill options, `struct_size` filled in.
#[no_mangle]
pub extern "C" fn ws_fill_options_default() -> ws_fill_options {
    ws_fill_options {
        struct_size: std::mem::size_of::<ws_fill_options>() as u32,
        flags: 0,
        staging_bytes: 0,
        copy_threads: -1,
        complete: std::ptr::null_mut(),
    }
}

fn fill_options(o: Option<ws_fill_options>) -> Res<ws::FillOptions> {
    let mut f = ws::FillOptions::default();
    let Some(o) = o else { return Ok(f) };
    if o.flags & !WS_FILL_STAGED != 0 {
        return Err(invalid(format!("options.flags {:#x}: 0 or WS_FILL_STAGED", o.flags)));
    }
    f.in_place = o.flags & WS_FILL_STAGED == 0;
    if o.staging_bytes != 0 {
        f.staging_bytes = usize::try_from(o.staging_bytes)
            .map_err(|_| invalid(format!("options.staging_bytes {}", o.staging_bytes)))?;
    }
    f.copy_threads = match o.copy_threads {
        -1 => None,
        n if (0..=ws::FILL_COPY_THREADS_LIMIT as i64).contains(&i64::from(n)) => Some(n as usize),
        n => {
            return Err(invalid(format!(
                "options.copy_threads {n} (-1, or 0 to {})",
                ws::FILL_COPY_THREADS_LIMIT
            )))
        }
    };
    Ok(f)
}

/// Reads each target's tensor (or slice) into its `dest` and returns once
/// all of them are there: the payload's whole blocks in place, O_DIRECT,
/// where `dest` is in phase with the payload (`dest % align == file_offset
/// % align`, `ws_engine_direct_align`); everything else O_DIRECT into the
/// engine's staging (at most `options->staging_bytes`, kept for the next
/// call) and one copy into place, on copy threads while later pieces are
/// read. Only each target's `len` bytes are written.
///
/// Checked before anything is read: every name is the model's
/// (`WS_ERR_NOT_FOUND`), every `len` is its payload's and no two targets
/// overlap (`WS_ERR_INVALID`, naming the tensors and lengths). A read that
/// fails after reads began returns its code; `report->targets_complete`
/// (and the message) say how many destinations are whole, the others may
/// be partly written. Either way the call returns only once nothing writes
/// any `dest` any more.
///
/// `options` and `report` may be NULL; `options->complete` (NULL, or
/// `count` bytes) gets a flag per target: whole (1) or not (0).
///
/// Thread safety: any number of threads may fill at once (distinct
/// destinations); the engine cannot be shut down during the call
/// (`WS_ERR_BUSY`).
///
/// # Safety
/// `targets` is valid for `count` reads; each `name` is NUL-terminated and
/// each `bounds` valid for `ndims` reads; each `dest` is valid for `len`
/// byte writes and nothing else reads or writes it (no read of this
/// library into it in flight either) until the call returns; `options` is
/// NULL or a `ws_fill_options` (of ABI 1.1's size or this one's), whose
/// `complete` is NULL or valid for `count` byte writes and overlaps no
/// target; `report` is NULL or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn ws_fill(
    engine: ws_engine,
    targets: *const ws_fill_target,
    count: usize,
    options: *const ws_fill_options,
    report: *mut ws_fill_report,
) -> ws_status {
    guard("ws_fill", || {
        if count > 0 && targets.is_null() {
            return Err(null("targets"));
        }
        // SAFETY: NULL or a ws_fill_options (the contract).
        let given = unsafe { options_of(options) }?;
        let complete = given.map_or(std::ptr::null_mut(), |o| o.complete);
        let mark = |whole: &dyn Fn(usize) -> bool| {
            if !complete.is_null() {
                for i in 0..count {
                    // SAFETY: non-NULL, valid for `count` byte writes (the
                    // contract), and no target's memory.
                    unsafe { complete.add(i).write(u8::from(whole(i))) };
                }
            }
        };
        mark(&|_| false);
        let opts = fill_options(given)?;
        let e = ENGINES.get(engine.id)?;
        let list: &[ws_fill_target] = if count == 0 {
            &[]
        } else {
            // SAFETY: non-NULL, valid for `count` reads (the contract).
            unsafe { std::slice::from_raw_parts(targets, count) }
        };
        let mut fill = Vec::with_capacity(list.len());
        for (i, t) in list.iter().enumerate() {
            // SAFETY: NUL-terminated (the contract).
            let name =
                unsafe { opt_str(t.name, "targets[].name") }?.ok_or_else(|| null(&format!("targets[{i}].name")))?;
            let tensor = e.engine.model().tensor(name)?;
            let slice = if t.ndims == 0 {
                None
            } else {
                // SAFETY: `bounds` valid for `ndims` reads (the contract).
                Some(unsafe { crate::read::slice_of(&e, tensor.index, t.bounds, t.ndims) }?)
            };
            let ptr = match NonNull::new(t.dest.cast::<u8>()) {
                Some(p) => p,
                None if t.len == 0 => NonNull::dangling(),
                None => return Err(null(&format!("targets[{i}].dest"))),
            };
            // SAFETY: `dest` is valid for `len` byte writes and untouched by
            // anyone else until this call returns (the contract, handed on
            // word for word); Engine::fill returns only once nothing writes
            // it.
            fill.push(unsafe { ws::FillTarget::from_raw(tensor, slice.as_ref(), ptr, t.len) });
        }
        let put = |r: ws_fill_report| {
            if !report.is_null() {
                // SAFETY: non-NULL, valid for a write (the contract).
                unsafe { report.write(r) };
            }
        };
        match e.engine.fill(fill, &opts) {
            Ok(r) => {
                mark(&|_| true);
                put(ws_fill_report {
                    targets_complete: r.targets as u64,
                    bytes: r.bytes,
                    bytes_read: r.bytes_read,
                    in_place_bytes: r.in_place_bytes,
                    staged_bytes: r.staged_bytes,
                    buffered_bytes: r.buffered_bytes,
                    in_place_reads: r.in_place_reads,
                    staged_reads: r.staged_reads,
                    buffered_reads: r.buffered_reads,
                    staging_bytes: r.staging_bytes as u64,
                    copy_threads: r.copy_threads as u32,
                    staging_waited: c_int::from(r.staging_waits > 0),
                    copy_cpu_ns: r.copy_cpu_ns,
                    elapsed_ns: r.elapsed.as_nanos() as u64,
                });
                Ok(ws_status::WS_OK)
            }
            // Refused before any read: the caller's targets.
            Err(ws::Error::Config(msg)) => {
                put(ws_fill_report::default());
                Err(invalid(msg))
            }
            Err(err) => {
                let done = match &err {
                    ws::Error::Incomplete { complete, .. } => {
                        mark(&|i| complete.binary_search(&i).is_ok());
                        complete.len() as u64
                    }
                    _ => 0,
                };
                put(ws_fill_report {
                    targets_complete: done,
                    ..Default::default()
                });
                Err(Fail::from(err))
            }
        }
    })
}

/// The options, from a caller built against this header or against ABI
/// 1.1 / 1.2 (its `struct_size` ends before `complete`, which is then NULL).
///
/// # Safety
/// `p` is NULL or a `ws_fill_options` of the size its `struct_size` says.
unsafe fn options_of(p: *const ws_fill_options) -> Res<Option<ws_fill_options>> {
    if !p.is_null() {
        // SAFETY: every options struct starts with its u32 size (the contract).
        let size = unsafe { p.cast::<u32>().read() } as usize;
        if size == FILL_OPTIONS_1_1 {
            let mut o = ws_fill_options_default();
            // SAFETY: the caller has `size` bytes at `p` (the contract),
            // copied over the fields they hold; `o` is a distinct local.
            unsafe { std::ptr::copy_nonoverlapping(p.cast::<u8>(), (&raw mut o).cast::<u8>(), size) };
            o.struct_size = std::mem::size_of::<ws_fill_options>() as u32;
            return Ok(Some(o));
        }
    }
    // SAFETY: the contract above.
    unsafe { options(p, "options", "ws_fill_options_default()") }
}
