//! Reading what the caller passes and writing what it gets back: strings,
//! option structs, out-pointers, and strings handed out with `malloc`.

use std::ffi::{c_char, CStr};

use crate::status::{ws_status, Fail, Res};

/// Most entries one batch call takes (`ws_read_batch`, `ws_memory_placement`):
/// a larger `n` is refused before any allocation sized by it.
pub(crate) const MAX_BATCH: usize = 1 << 20;

pub(crate) fn null(what: &str) -> Fail {
    Fail::new(ws_status::WS_ERR_NULL, format!("{what} is NULL"))
}

pub(crate) fn invalid(msg: impl Into<String>) -> Fail {
    Fail::new(ws_status::WS_ERR_INVALID, msg)
}

/// A caller's optional string.
///
/// # Safety
/// `p` is NULL or a NUL-terminated string valid for the call.
pub(crate) unsafe fn opt_str<'a>(p: *const c_char, what: &str) -> Res<Option<&'a str>> {
    if p.is_null() {
        return Ok(None);
    }
    // SAFETY: non-NULL and NUL-terminated by the caller's contract.
    let s = unsafe { CStr::from_ptr(p) };
    s.to_str().map(Some).map_err(|_| invalid(format!("{what}: not UTF-8")))
}

/// Writes `v` to the caller's `out`.
///
/// # Safety
/// `out` is NULL or valid for a write of `T`.
pub(crate) unsafe fn put<T>(out: *mut T, what: &str, v: T) -> Res<()> {
    if out.is_null() {
        return Err(null(what));
    }
    // SAFETY: non-NULL and valid for writes by the caller's contract.
    unsafe { out.write(v) };
    Ok(())
}

/// An options struct whose first field is its `struct_size`: that field is
/// read first, and the rest only when it says the caller's struct is this
/// library's (a struct from another header version is refused, never read
/// past its end).
///
/// # Safety
/// `p` is NULL or points to at least `struct_size` readable bytes, the
/// first four of which are the `u32` `struct_size`.
pub(crate) unsafe fn options<T: Copy>(p: *const T, what: &str, default: &str) -> Res<Option<T>> {
    if p.is_null() {
        return Ok(None);
    }
    // SAFETY: every options struct starts with its u32 size (the contract).
    let size = unsafe { p.cast::<u32>().read() } as usize;
    if size != std::mem::size_of::<T>() {
        return Err(invalid(format!(
            "{what}: struct_size {size} is not this library's {} (a header from another version? start from {default})",
            std::mem::size_of::<T>()
        )));
    }
    // SAFETY: the caller says it has `size` bytes, which is all of T.
    Ok(Some(unsafe { p.read() }))
}

pub(crate) fn parse<T: std::str::FromStr<Err = ws::Error>>(v: Option<&str>, what: &str) -> Res<Option<T>> {
    v.filter(|s| !s.trim().is_empty())
        .map(|s| s.trim().parse::<T>().map_err(|e| invalid(format!("{what} {s:?}: {e}"))))
        .transpose()
}

/// `s` as a NUL-terminated string from `malloc`, for the caller to free with
/// `ws_string_free` (or `free`): freeing needs no length, so a caller that
/// writes into it (a NUL, `strtok`) cannot make the free wrong.
pub(crate) fn malloc_string(s: &str) -> Res<*mut c_char> {
    let bytes = s.as_bytes();
    // SAFETY: malloc of a non-zero size; the result is checked for NULL.
    let p = unsafe { libc::malloc(bytes.len() + 1) }.cast::<u8>();
    if p.is_null() {
        return Err(Fail::new(
            ws_status::WS_ERR_CONFIG,
            format!("out of memory for a {}-byte string", bytes.len() + 1),
        ));
    }
    // SAFETY: `p` has bytes.len() + 1 writable bytes, disjoint from `bytes`.
    unsafe {
        std::ptr::copy_nonoverlapping(bytes.as_ptr(), p, bytes.len());
        p.add(bytes.len()).write(0);
    }
    Ok(p.cast())
}

/// Frees a string this library returned (the `json` outputs). NULL is a
/// no-op. The string is `malloc`ed: `free` works as well.
///
/// # Safety
/// `s` is NULL or a string from this library not freed before.
#[no_mangle]
pub unsafe extern "C" fn ws_string_free(s: *mut c_char) {
    // SAFETY: NULL, or from malloc in malloc_string, freed once (the contract).
    unsafe { libc::free(s.cast()) };
}
