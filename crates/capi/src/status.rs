//! Status codes, the thread-local last-error message, and the guard every
//! entry point runs in: no panic crosses the boundary.

use std::cell::RefCell;
use std::ffi::{c_char, CString};
use std::panic::{catch_unwind, AssertUnwindSafe};

/// What a call did. `WS_OK` and the two non-errors (`WS_PENDING`,
/// `WS_TIMEOUT`) are zero or positive; every error is negative and leaves a
/// message for `ws_last_error` on the calling thread.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ws_status {
    /// Done.
    WS_OK = 0,
    /// `ws_ticket_poll`: the read is still in flight (the ticket stays valid).
    WS_PENDING = 1,
    /// `ws_ticket_wait` or `ws_memory_unregister`: the timeout passed first;
    /// the handle stays valid (wait, or unregister, again).
    WS_TIMEOUT = 2,
    /// A NULL pointer where one is required.
    WS_ERR_NULL = -1,
    /// An argument out of range, a string that is not UTF-8, an unknown
    /// option value, a `struct_size` this library does not know.
    WS_ERR_INVALID = -2,
    /// A handle that is closed, spent or never was: a double close, a
    /// ticket waited (or freed) twice, a zeroed handle.
    WS_ERR_HANDLE = -3,
    /// No tensor of that name or index.
    WS_ERR_NOT_FOUND = -4,
    /// A buffer or memory too small for what was asked.
    WS_ERR_TOO_SMALL = -5,
    /// Memory not aligned where the alignment matters (registration needs
    /// a page-aligned start; `WS_READ_IN_PLACE` needs the payload's phase).
    WS_ERR_MISALIGNED = -6,
    /// Reads still outstanding: a close or unregister while tickets on it
    /// are held, two threads waiting on one ticket, a range of memory that
    /// overlaps a read in flight.
    WS_ERR_BUSY = -7,
    /// A file could not be opened, stat'ed or read (the message names it).
    WS_ERR_IO = -8,
    /// A safetensors header or index refused (the message names the file
    /// and the cause).
    WS_ERR_FORMAT = -9,
    /// A setting or request the library refuses (the message says why).
    WS_ERR_CONFIG = -10,
    /// Called in a forked child of the process that made the engine.
    WS_ERR_FORKED = -11,
    /// A read failed on every copy, a drive stopped, or a file ended early.
    WS_ERR_READ = -12,
    /// A bug in this library: it panicked; the message has the panic's text.
    /// The handles involved stay usable (a ticket whose call panicked can be
    /// freed).
    WS_ERR_PANIC = -13,
    /// A read failed because its drive's I/O thread stopped with the read
    /// still in the kernel: the kernel may yet write the read's bytes. Do
    /// not reuse them; the memory never unregisters with `WS_OK` after this
    /// (leak it).
    WS_ERR_ABANDONED = -14,
}

/// A failed call: the code and the message `ws_last_error` returns.
#[derive(Debug, Clone)]
pub(crate) struct Fail {
    pub(crate) code: ws_status,
    pub(crate) msg: String,
}

impl Fail {
    pub(crate) fn new(code: ws_status, msg: impl Into<String>) -> Self {
        Fail { code, msg: msg.into() }
    }
}

impl From<ws::Error> for Fail {
    fn from(e: ws::Error) -> Self {
        use ws::Error as E;
        // A fill that failed part way: the code of its cause.
        let cause = match &e {
            E::Incomplete { source, .. } => source.as_ref(),
            e => e,
        };
        let code = match cause {
            E::Io { .. } => ws_status::WS_ERR_IO,
            E::Header { .. } | E::Catalog { .. } | E::Experts(_) => ws_status::WS_ERR_FORMAT,
            E::NoSuchTensor { .. } => ws_status::WS_ERR_NOT_FOUND,
            E::SlotTooSmall { .. } => ws_status::WS_ERR_TOO_SMALL,
            E::OutOfRange { .. } | E::UnexpectedEof { .. } | E::ReadFailed { .. } => ws_status::WS_ERR_READ,
            // The ring died with chunks in flight: they are abandoned in the
            // kernel, their slot leaked (never freed early), and the caller
            // must not reuse the bytes either.
            E::DriveStopped { .. } => ws_status::WS_ERR_ABANDONED,
            E::Forked { .. } => ws_status::WS_ERR_FORKED,
            E::Take(_) => ws_status::WS_ERR_BUSY,
            E::Cache(ws::CacheError::Full { .. }) => ws_status::WS_ERR_BUSY,
            E::Cache(ws::CacheError::ReadFailed { .. }) => ws_status::WS_ERR_READ,
            _ => ws_status::WS_ERR_CONFIG,
        };
        Fail {
            code,
            msg: e.to_string(),
        }
    }
}

pub(crate) type Res<T> = Result<T, Fail>;

thread_local! {
    static LAST: RefCell<CString> = RefCell::new(CString::default());
}

fn set_last(msg: String) {
    // An interior NUL (a file name can hold none, a message might) would cut
    // the C string short: shown as a visible escape instead.
    let c = CString::new(msg.replace('\0', "\\0")).unwrap_or_default();
    LAST.with(|l| *l.borrow_mut() = c);
}

/// The process that first called into the library. In a forked child every
/// call is `WS_ERR_FORKED` before any lock is taken: a parent thread may
/// have held a handle table's lock at the fork, and the engines' I/O
/// threads do not exist in the child.
static ORIGIN: std::sync::OnceLock<u32> = std::sync::OnceLock::new();

/// Runs one entry point: its error becomes a code and this thread's last
/// error message (prefixed with the call's name); a panic becomes
/// `WS_ERR_PANIC` and the panic's text.
pub(crate) fn guard(call: &str, f: impl FnOnce() -> Res<ws_status>) -> ws_status {
    let pid = std::process::id();
    if *ORIGIN.get_or_init(|| pid) != pid {
        set_last(format!(
            "{call}: called in a forked child (pid {pid}); the library's handles and I/O threads belong to the \
             parent: open models and engines after exec, or before fork in the process that uses them"
        ));
        return ws_status::WS_ERR_FORKED;
    }
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(s)) => s,
        Ok(Err(fail)) => {
            set_last(format!("{call}: {}", fail.msg));
            fail.code
        }
        Err(p) => {
            let what = p
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| p.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "a panic without a message".into());
            set_last(format!(
                "{call}: internal error (a panic, caught at the boundary): {what}"
            ));
            ws_status::WS_ERR_PANIC
        }
    }
}

/// The message of the last failed `ws_` call on this thread: which call,
/// the file, the operation and the cause. Never NULL ("" before any
/// failure). Valid until the next `ws_` call on this thread; copy it to keep
/// it.
#[no_mangle]
pub extern "C" fn ws_last_error() -> *const c_char {
    catch_unwind(|| LAST.with(|l| l.borrow().as_ptr())).unwrap_or(c"".as_ptr())
}

/// The symbolic name of a status code ("WS_ERR_BUSY"), or "WS_UNKNOWN" for
/// a value that is none of them; never NULL, static. Takes the code as an
/// integer so any value is safe to pass.
#[no_mangle]
pub extern "C" fn ws_status_name(status: i32) -> *const c_char {
    use ws_status::*;
    const ALL: [(ws_status, &std::ffi::CStr); 17] = [
        (WS_OK, c"WS_OK"),
        (WS_PENDING, c"WS_PENDING"),
        (WS_TIMEOUT, c"WS_TIMEOUT"),
        (WS_ERR_NULL, c"WS_ERR_NULL"),
        (WS_ERR_INVALID, c"WS_ERR_INVALID"),
        (WS_ERR_HANDLE, c"WS_ERR_HANDLE"),
        (WS_ERR_NOT_FOUND, c"WS_ERR_NOT_FOUND"),
        (WS_ERR_TOO_SMALL, c"WS_ERR_TOO_SMALL"),
        (WS_ERR_MISALIGNED, c"WS_ERR_MISALIGNED"),
        (WS_ERR_BUSY, c"WS_ERR_BUSY"),
        (WS_ERR_IO, c"WS_ERR_IO"),
        (WS_ERR_FORMAT, c"WS_ERR_FORMAT"),
        (WS_ERR_CONFIG, c"WS_ERR_CONFIG"),
        (WS_ERR_FORKED, c"WS_ERR_FORKED"),
        (WS_ERR_READ, c"WS_ERR_READ"),
        (WS_ERR_PANIC, c"WS_ERR_PANIC"),
        (WS_ERR_ABANDONED, c"WS_ERR_ABANDONED"),
    ];
    ALL.iter()
        .find(|(s, _)| *s as i32 == status)
        .map_or(c"WS_UNKNOWN", |(_, n)| *n)
        .as_ptr()
}
