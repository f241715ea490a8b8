//! Models, engines, caller memory and tickets behind C handles.

use std::ffi::{c_char, c_int, CStr, CString};
use std::future::Future;
use std::os::fd::{BorrowedFd, OwnedFd};
use std::pin::Pin;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, LazyLock, Mutex};
use std::task::{Context, Poll, Wake, Waker};
use std::time::{Duration, Instant};

use ws::{Engine, EngineConfig, Model, ModelConfig, Scratch, Ticket};

use crate::handles::Table;
use crate::status::{guard, ws_status, Fail, Res};

/// An open model (the shards' headers, read and checked). Zero is no model.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ws_model {
    pub id: u64,
}

/// An engine: one I/O thread (or ring) per drive. Zero is no engine.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ws_engine {
    pub id: u64,
}

/// Caller memory lent to an engine. Zero is none.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ws_memory {
    pub id: u64,
}

/// One read in flight, or done and not yet collected. Zero is none.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ws_ticket {
    pub id: u64,
}

/// Layout settings of a model (`ModelConfig`). Every string may be NULL
/// (the default); lists are `;`- or `,`-separated, as in the environment.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct ws_model_options {
    /// `sizeof(ws_model_options)` as the caller compiled it.
    pub struct_size: u32,
    /// Extra directories searched for shards after the primary (split dirs).
    pub dirs: *const c_char,
    /// Mirror directories holding copies of any subset of the shards.
    pub mirrors: *const c_char,
    /// Read weights per copy, primary first: "equal", "probe" or "3,1".
    pub weights: *const c_char,
    /// "hash", "stripe" or "adaptive".
    pub route: *const c_char,
    /// O_DIRECT: "auto", "on" or "off".
    pub direct: *const c_char,
}

/// Engine settings (`EngineConfig`). Zero, NULL or -1 is the default.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct ws_engine_options {
    /// `sizeof(ws_engine_options)` as the caller compiled it.
    pub struct_size: u32,
    /// "auto" (io_uring, else pread), "uring" or "pread"; NULL: auto.
    pub backend: *const c_char,
    /// Chunks in flight per drive (1 to 4096); 0: the default (32).
    pub queue_depth: u32,
    /// Largest chunk in bytes (a multiple of 4096, 4 KiB to 1 GiB); 0: the
    /// drive's own.
    pub chunk_bytes: u64,
    /// NUMA placement: 1 on, 0 off, -1 the default (on).
    pub numa: i32,
    /// "auto", "inline", "async" or "rings:N"; NULL: auto.
    pub submit: *const c_char,
}

/// One tensor. The pointers stay valid while the model is open.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct ws_tensor_info {
    /// The tensor's index in the model (name order): what reads take.
    pub index: usize,
    /// NUL-terminated name.
    pub name: *const c_char,
    /// NUL-terminated safetensors dtype ("BF16", "F32", ...).
    pub dtype: *const c_char,
    /// `ndim` dimensions, in elements.
    pub shape: *const u64,
    pub ndim: u32,
    /// Payload bytes.
    pub bytes: u64,
    /// Index of the shard file holding it.
    pub shard: u32,
    /// Absolute offset of the payload in that file.
    pub file_offset: u64,
}

/// Where a payload lands and what was read.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct ws_read_result {
    /// The payload's first byte, as an offset from the start of the memory
    /// read into.
    pub offset: usize,
    /// Payload bytes read.
    pub bytes: u64,
    /// The payload's first byte. In caller memory it stays valid as the
    /// memory does; in an engine arena (`ws_arena_create*`) while the
    /// arena is open, and (`WS_READ_HOLD`, `ws_read_any`) while the ticket
    /// is held.
    pub data: *mut std::ffi::c_void,
}

/// A completed read, kept without raw pointers (the ticket table is shared
/// between threads).
#[derive(Debug, Clone, Copy)]
struct Out {
    offset: usize,
    bytes: u64,
    data: usize,
}

impl Out {
    fn result(self) -> ws_read_result {
        ws_read_result {
            offset: self.offset,
            bytes: self.bytes,
            data: self.data as *mut std::ffi::c_void,
        }
    }
}

/// What may be overwritten around a payload read into caller memory
/// (`Scratch`).
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ws_scratch {
    /// Exactly the payload's bytes are written. In phase and block-aligned:
    /// in place, O_DIRECT; otherwise through the engine's staging memory
    /// and one copy.
    WS_SCRATCH_NONE = 0,
    /// The `file_offset % align` bytes before the payload may be
    /// overwritten (the in-place window of engines that read
    /// `[off - off % align, ...)` into `buf - off % align`): in phase, every
    /// whole block is read in place O_DIRECT, the tail buffered.
    WS_SCRATCH_BEFORE = 1,
    /// The payload's whole blocks may be overwritten, before and after it:
    /// in phase, every block is read in place O_DIRECT.
    WS_SCRATCH_BLOCKS = 2,
}

/// `ws_read.flags`: the read must land in place O_DIRECT; an address out of
/// phase is `WS_ERR_MISALIGNED` instead of a staged copy.
pub const WS_READ_IN_PLACE: u32 = 1;

/// `ws_read.flags`: after the read completes, its bytes stay reserved (no
/// other read may land on them: `WS_ERR_BUSY`) until `ws_ticket_free`;
/// poll and wait return the result without spending the ticket. What
/// `ws_read_any` always does.
pub const WS_READ_HOLD: u32 = 2;

/// One read into caller memory.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct ws_read {
    /// The tensor's index (`ws_tensor_info.index`).
    pub tensor: usize,
    /// Bytes `[start, end)` of the payload; `start == end == 0`: all of it.
    pub start: u64,
    pub end: u64,
    /// Where the payload's first byte lands: an offset into the memory.
    pub at: usize,
    pub scratch: ws_scratch,
    /// `WS_READ_IN_PLACE` or 0.
    pub flags: u32,
}

/// What a shutdown did.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct ws_shutdown_report {
    /// 1: every I/O thread finished; nothing is in flight.
    pub drained: c_int,
    /// Drives whose I/O threads did not finish in time (detached: they keep
    /// the memory the kernel may write until its reads complete).
    pub drives_left: u32,
    /// Chunks still in flight on those drives.
    pub chunks_left: u64,
}

/// A summary of an engine's counters (`ws_engine_stats_json` has them all).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct ws_stats {
    pub bytes: u64,
    pub reads_direct: u64,
    pub reads_buffered: u64,
    /// Every fallback, by any cause (the JSON has them by cause and drive).
    pub fallbacks: u64,
    /// Reads that landed in staging and were copied into place.
    pub staged_reads: u64,
    pub staged_bytes: u64,
    pub drives: u32,
    /// Warnings the engine has (the JSON has their text).
    pub warnings: u32,
}

pub(crate) struct ModelObj {
    model: Model,
    names: Vec<CString>,
    dtypes: Vec<CString>,
    shapes: Vec<Vec<u64>>,
}

pub(crate) struct EngineObj {
    engine: Engine,
    model: Arc<ModelObj>,
    /// Tickets and memory handles that name this engine and are not closed.
    users: AtomicUsize,
}

/// What a memory handle is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum MemKind {
    /// The caller's memory (`ws_memory_register`).
    Caller,
    /// The engine's packed arena (`ws_arena_create`).
    Packed,
    /// The engine's arena of fixed slots (`ws_arena_create_slots`).
    Slots,
}

pub(crate) struct MemoryObj {
    kind: MemKind,
    arena: Mutex<Option<ws::Arena>>,
    base: usize,
    len: usize,
    engine: Arc<EngineObj>,
    /// Tickets into this memory not yet collected or freed.
    tickets: AtomicUsize,
}

enum TicketState {
    Pending(Ticket),
    /// Another thread is in `ws_ticket_wait` with it.
    Waiting,
    /// Completed, and either polled by a notifier or holding its bytes
    /// (`WS_READ_HOLD`: the payload's slot kept until `ws_ticket_free`).
    Done(Res<Out>, Option<ws::Loaded>),
}

pub(crate) struct TicketObj {
    state: Mutex<TicketState>,
    memory: Arc<MemoryObj>,
    /// `WS_READ_HOLD` or `ws_read_any`.
    hold: bool,
}

impl Drop for TicketObj {
    fn drop(&mut self) {
        self.memory.tickets.fetch_sub(1, Ordering::AcqRel);
    }
}

impl Drop for MemoryObj {
    fn drop(&mut self) {
        self.engine.users.fetch_sub(1, Ordering::AcqRel);
    }
}

static MODELS: LazyLock<Table<ModelObj>> = LazyLock::new(|| Table::new("model"));
static ENGINES: LazyLock<Table<EngineObj>> = LazyLock::new(|| Table::new("engine"));
static MEMORY: LazyLock<Table<MemoryObj>> = LazyLock::new(|| Table::new("memory"));
static TICKETS: LazyLock<Table<TicketObj>> = LazyLock::new(|| Table::new("ticket"));

fn null(what: &str) -> Fail {
    Fail::new(ws_status::WS_ERR_NULL, format!("{what} is NULL"))
}

/// A caller's optional string.
///
/// # Safety
/// `p` is NULL or a NUL-terminated string valid for the call.
unsafe fn opt_str<'a>(p: *const c_char, what: &str) -> Res<Option<&'a str>> {
    if p.is_null() {
        return Ok(None);
    }
    // SAFETY: non-NULL and NUL-terminated by the caller's contract.
    let s = unsafe { CStr::from_ptr(p) };
    s.to_str()
        .map(Some)
        .map_err(|_| Fail::new(ws_status::WS_ERR_INVALID, format!("{what}: not UTF-8")))
}

/// Writes `v` to the caller's `out`.
///
/// # Safety
/// `out` is NULL or valid for a write of `T`.
unsafe fn put<T>(out: *mut T, what: &str, v: T) -> Res<()> {
    if out.is_null() {
        return Err(null(what));
    }
    // SAFETY: non-NULL and valid for writes by the caller's contract.
    unsafe { out.write(v) };
    Ok(())
}

fn parse<T: std::str::FromStr<Err = ws::Error>>(v: Option<&str>, what: &str) -> Res<Option<T>> {
    v.filter(|s| !s.trim().is_empty())
        .map(|s| {
            s.trim()
                .parse::<T>()
                .map_err(|e| Fail::new(ws_status::WS_ERR_INVALID, format!("{what} {s:?}: {e}")))
        })
        .transpose()
}

fn open_model(config: ModelConfig) -> Res<ws_model> {
    let model = Model::open(config)?;
    let t = model.catalog().tensors();
    let cstring = |s: &str| CString::new(s.replace('\0', "\\0")).unwrap_or_default();
    let obj = ModelObj {
        names: t.iter().map(|t| cstring(&t.name)).collect(),
        dtypes: t.iter().map(|t| cstring(t.dtype.name())).collect(),
        shapes: t.iter().map(|t| t.shape.iter().map(|&d| d as u64).collect()).collect(),
        model,
    };
    Ok(ws_model { id: MODELS.insert(obj) })
}

/// Opens the model in `dir` (`model.safetensors.index.json` or
/// `*.safetensors`) with the layout in `options` (NULL: defaults). Reads
/// and checks every shard's header; the files stay open until
/// `ws_model_close`.
///
/// Thread safety: any thread; the model is shared by every engine made from
/// it and may be used from many threads at once.
///
/// # Safety
/// `dir` is a NUL-terminated path; `options` is NULL or points to a
/// `ws_model_options` whose strings are NULL or NUL-terminated; `out` is
/// valid for a write.
#[no_mangle]
pub unsafe extern "C" fn ws_model_open(
    dir: *const c_char,
    options: *const ws_model_options,
    out: *mut ws_model,
) -> ws_status {
    guard("ws_model_open", || {
        // SAFETY: the caller's contract above.
        let dir = unsafe { opt_str(dir, "dir") }?.ok_or_else(|| null("dir"))?;
        let mut config = ModelConfig::new(dir);
        if !options.is_null() {
            // SAFETY: non-NULL, a ws_model_options by the caller's contract;
            // read by value (Copy).
            let o = unsafe { options.read() };
            if o.struct_size as usize != std::mem::size_of::<ws_model_options>() {
                return Err(Fail::new(
                    ws_status::WS_ERR_INVALID,
                    format!(
                        "options: struct_size {} is not this library's {} (a header from another version?)",
                        o.struct_size,
                        std::mem::size_of::<ws_model_options>()
                    ),
                ));
            }
            // SAFETY: each string is NULL or NUL-terminated (the contract).
            let (dirs, mirrors, weights, route, direct) = unsafe {
                (
                    opt_str(o.dirs, "options.dirs")?,
                    opt_str(o.mirrors, "options.mirrors")?,
                    opt_str(o.weights, "options.weights")?,
                    opt_str(o.route, "options.route")?,
                    opt_str(o.direct, "options.direct")?,
                )
            };
            if let Some(d) = dirs {
                config = config.dirs(ws::__internal::split_list(d));
            }
            if let Some(m) = mirrors {
                config = config.mirrors(ws::__internal::split_list(m));
            }
            if let Some(w) = parse(weights, "options.weights")? {
                config = config.weights(w);
            }
            if let Some(r) = parse(route, "options.route")? {
                config = config.route(r);
            }
            if let Some(d) = parse(direct, "options.direct")? {
                config = config.direct(d);
            }
        }
        let m = open_model(config)?;
        // SAFETY: `out` is valid for a write (the contract).
        unsafe { put(out, "out", m) }?;
        Ok(ws_status::WS_OK)
    })
}

/// Opens the model the environment names: `WEIGHTSTREAM_MODEL` (or `dir`
/// when not NULL), `WEIGHTSTREAM_MODEL_DIRS`, `_MIRROR`, `_DISK_WEIGHTS`,
/// `_ROUTE`, `_DIRECT`.
///
/// # Safety
/// `dir` is NULL or NUL-terminated; `out` is valid for a write.
#[no_mangle]
pub unsafe extern "C" fn ws_model_open_env(dir: *const c_char, out: *mut ws_model) -> ws_status {
    guard("ws_model_open_env", || {
        // SAFETY: the caller's contract above.
        let config = match unsafe { opt_str(dir, "dir") }? {
            Some(d) => ModelConfig::new(d).settings(|k| std::env::var(k).ok())?,
            None => ModelConfig::from_env()?,
        };
        let m = open_model(config)?;
        // SAFETY: `out` is valid for a write (the contract).
        unsafe { put(out, "out", m) }?;
        Ok(ws_status::WS_OK)
    })
}

/// Closes a model. Engines made from it keep what they need and stay
/// usable; `ws_tensor_info` pointers from it are invalid afterwards unless
/// an engine made from it is still open. A second close is
/// `WS_ERR_HANDLE`.
#[no_mangle]
pub extern "C" fn ws_model_close(model: ws_model) -> ws_status {
    guard("ws_model_close", || {
        MODELS.remove(model.id)?;
        Ok(ws_status::WS_OK)
    })
}

/// The number of tensors in the model.
///
/// # Safety
/// `count` is valid for a write.
#[no_mangle]
pub unsafe extern "C" fn ws_model_tensor_count(model: ws_model, count: *mut usize) -> ws_status {
    guard("ws_model_tensor_count", || {
        let m = MODELS.get(model.id)?;
        // SAFETY: the contract above.
        unsafe { put(count, "count", m.names.len()) }?;
        Ok(ws_status::WS_OK)
    })
}

fn info(m: &ModelObj, index: usize) -> Res<ws_tensor_info> {
    let t = m.model.catalog().tensors().get(index).ok_or_else(|| {
        Fail::new(
            ws_status::WS_ERR_NOT_FOUND,
            format!("tensor index {index}: the model has {}", m.names.len()),
        )
    })?;
    Ok(ws_tensor_info {
        index,
        name: m.names[index].as_ptr(),
        dtype: m.dtypes[index].as_ptr(),
        shape: m.shapes[index].as_ptr(),
        ndim: m.shapes[index].len() as u32,
        bytes: t.len,
        shard: t.shard as u32,
        file_offset: t.offset,
    })
}

/// Tensor `index` (0 to count - 1, name order).
///
/// # Safety
/// `out` is valid for a write.
#[no_mangle]
pub unsafe extern "C" fn ws_model_tensor(model: ws_model, index: usize, out: *mut ws_tensor_info) -> ws_status {
    guard("ws_model_tensor", || {
        let m = MODELS.get(model.id)?;
        let i = info(&m, index)?;
        // SAFETY: the contract above.
        unsafe { put(out, "out", i) }?;
        Ok(ws_status::WS_OK)
    })
}

/// The tensor named `name`; `WS_ERR_NOT_FOUND` (with the nearest names in
/// the message) when there is none.
///
/// # Safety
/// `name` is NUL-terminated; `out` is valid for a write.
#[no_mangle]
pub unsafe extern "C" fn ws_model_find(model: ws_model, name: *const c_char, out: *mut ws_tensor_info) -> ws_status {
    guard("ws_model_find", || {
        let m = MODELS.get(model.id)?;
        // SAFETY: the contract above.
        let name = unsafe { opt_str(name, "name") }?.ok_or_else(|| null("name"))?;
        let t = m.model.tensor(name)?;
        let i = info(&m, t.index)?;
        // SAFETY: the contract above.
        unsafe { put(out, "out", i) }?;
        Ok(ws_status::WS_OK)
    })
}

/// Checks every shard against what was opened (size, identity, header) and,
/// with `digest` non-zero, hashes every tensor. `*clean` is 1 when nothing
/// changed; `json` (may be NULL) receives the whole report, to be freed
/// with `ws_string_free`.
///
/// # Safety
/// `clean` is valid for a write; `json` is NULL or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn ws_model_verify(
    model: ws_model,
    digest: c_int,
    clean: *mut c_int,
    json: *mut *mut c_char,
) -> ws_status {
    guard("ws_model_verify", || {
        let m = MODELS.get(model.id)?;
        let r = m.model.verify(digest != 0)?;
        if !json.is_null() {
            let s = serde_json::to_string(&r).map_err(|e| Fail::new(ws_status::WS_ERR_CONFIG, e.to_string()))?;
            // SAFETY: non-NULL and valid for a write (the contract).
            unsafe { json.write(CString::new(s).unwrap_or_default().into_raw()) };
        }
        // SAFETY: the contract above.
        unsafe { put(clean, "clean", c_int::from(r.is_clean())) }?;
        Ok(ws_status::WS_OK)
    })
}

/// Frees a string this library returned (`json` outputs). NULL is a no-op.
///
/// # Safety
/// `s` is NULL or a string from this library not freed before.
#[no_mangle]
pub unsafe extern "C" fn ws_string_free(s: *mut c_char) {
    if !s.is_null() {
        // SAFETY: from CString::into_raw here, freed once (the contract).
        drop(unsafe { CString::from_raw(s) });
    }
}

/// The default engine options, `struct_size` filled in.
#[no_mangle]
pub extern "C" fn ws_engine_options_default() -> ws_engine_options {
    ws_engine_options {
        struct_size: std::mem::size_of::<ws_engine_options>() as u32,
        backend: std::ptr::null(),
        queue_depth: 0,
        chunk_bytes: 0,
        numa: -1,
        submit: std::ptr::null(),
    }
}

/// The default model options, `struct_size` filled in.
#[no_mangle]
pub extern "C" fn ws_model_options_default() -> ws_model_options {
    ws_model_options {
        struct_size: std::mem::size_of::<ws_model_options>() as u32,
        dirs: std::ptr::null(),
        mirrors: std::ptr::null(),
        weights: std::ptr::null(),
        route: std::ptr::null(),
        direct: std::ptr::null(),
    }
}

fn make_engine(model: ws_model, config: EngineConfig) -> Res<ws_engine> {
    let m = MODELS.get(model.id)?;
    let engine = Engine::new(&m.model, config)?;
    Ok(ws_engine {
        id: ENGINES.insert(EngineObj {
            engine,
            model: m,
            users: AtomicUsize::new(0),
        }),
    })
}

/// Starts an engine for `model` with `options` (NULL: defaults).
///
/// Thread safety: an engine is used from any number of threads at once
/// (registering memory, reading, polling, stats); only `ws_engine_shutdown`
/// must not race the other calls on it.
///
/// # Safety
/// `options` is NULL or a `ws_engine_options` whose strings are NULL or
/// NUL-terminated; `out` is valid for a write.
#[no_mangle]
pub unsafe extern "C" fn ws_engine_create(
    model: ws_model,
    options: *const ws_engine_options,
    out: *mut ws_engine,
) -> ws_status {
    guard("ws_engine_create", || {
        let mut c = EngineConfig::default();
        if !options.is_null() {
            // SAFETY: non-NULL, a ws_engine_options (the contract); Copy.
            let o = unsafe { options.read() };
            if o.struct_size as usize != std::mem::size_of::<ws_engine_options>() {
                return Err(Fail::new(
                    ws_status::WS_ERR_INVALID,
                    format!(
                        "options: struct_size {} is not this library's {} (use ws_engine_options_default)",
                        o.struct_size,
                        std::mem::size_of::<ws_engine_options>()
                    ),
                ));
            }
            // SAFETY: NULL or NUL-terminated (the contract).
            let (backend, submit) = unsafe {
                (
                    opt_str(o.backend, "options.backend")?,
                    opt_str(o.submit, "options.submit")?,
                )
            };
            if let Some(b) = parse(backend, "options.backend")? {
                c = c.backend(b);
            }
            if let Some(s) = parse(submit, "options.submit")? {
                c = c.submit(s);
            }
            if o.queue_depth != 0 {
                if o.queue_depth > 4096 {
                    return Err(Fail::new(
                        ws_status::WS_ERR_INVALID,
                        format!("options.queue_depth {} (1 to 4096)", o.queue_depth),
                    ));
                }
                c = c.queue_depth(o.queue_depth as usize);
            }
            if o.chunk_bytes != 0 {
                if !o.chunk_bytes.is_multiple_of(4096) || o.chunk_bytes > 1 << 30 {
                    return Err(Fail::new(
                        ws_status::WS_ERR_INVALID,
                        format!(
                            "options.chunk_bytes {} (a multiple of 4096, 4 KiB to 1 GiB)",
                            o.chunk_bytes
                        ),
                    ));
                }
                c = c.chunk(Some(o.chunk_bytes as usize));
            }
            match o.numa {
                -1 => {}
                0 => c = c.numa(false),
                1 => c = c.numa(true),
                n => {
                    return Err(Fail::new(
                        ws_status::WS_ERR_INVALID,
                        format!("options.numa {n} (1 on, 0 off, -1 default)"),
                    ))
                }
            }
        }
        let e = make_engine(model, c)?;
        // SAFETY: the contract above.
        unsafe { put(out, "out", e) }?;
        Ok(ws_status::WS_OK)
    })
}

/// Starts an engine with the `WEIGHTSTREAM_*` environment's settings.
///
/// # Safety
/// `out` is valid for a write.
#[no_mangle]
pub unsafe extern "C" fn ws_engine_create_env(model: ws_model, out: *mut ws_engine) -> ws_status {
    guard("ws_engine_create_env", || {
        let e = make_engine(model, EngineConfig::from_env()?)?;
        // SAFETY: the contract above.
        unsafe { put(out, "out", e) }?;
        Ok(ws_status::WS_OK)
    })
}

/// Waits (bounded by `deadline`) until `arc` is the only reference: calls
/// on other threads that looked the handle up just before it was removed
/// finish in microseconds.
fn sole<T>(mut arc: Arc<T>, deadline: Instant) -> Result<T, Arc<T>> {
    loop {
        match Arc::try_unwrap(arc) {
            Ok(v) => return Ok(v),
            Err(a) if Instant::now() >= deadline => return Err(a),
            Err(a) => {
                arc = a;
                std::thread::yield_now();
            }
        }
    }
}

/// Stops the engine: waits up to `timeout_ms` for its I/O threads, then
/// reports what was left in flight (those threads are detached and keep
/// the memory the kernel may write: a leak, never an early free). Refused
/// with `WS_ERR_BUSY` (the engine stays open) while tickets or memory
/// handles on it are not freed, unregistered or collected. A second
/// shutdown is `WS_ERR_HANDLE`.
///
/// # Safety
/// `report` is NULL or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn ws_engine_shutdown(
    engine: ws_engine,
    timeout_ms: u64,
    report: *mut ws_shutdown_report,
) -> ws_status {
    guard("ws_engine_shutdown", || {
        let e = ENGINES.remove(engine.id)?;
        let users = e.users.load(Ordering::Acquire);
        if users > 0 {
            ENGINES.reinsert(engine.id, e);
            return Err(Fail::new(
                ws_status::WS_ERR_BUSY,
                format!(
                    "engine {}: {users} memory handle(s) still registered on it (unregister them first; tickets into them keep them)",
                    engine.id
                ),
            ));
        }
        let timeout = Duration::from_millis(timeout_ms);
        let obj = sole(e, Instant::now() + timeout.min(Duration::from_secs(1))).map_err(|e| {
            ENGINES.reinsert(engine.id, e);
            Fail::new(
                ws_status::WS_ERR_BUSY,
                format!("engine {}: another thread is still in a call on it", engine.id),
            )
        })?;
        let r = obj.engine.shutdown(timeout);
        let out = ws_shutdown_report {
            drained: c_int::from(r.drained),
            drives_left: r.left_in_flight.len() as u32,
            chunks_left: r.left_in_flight.iter().map(|(_, n)| *n as u64).sum(),
        };
        if !report.is_null() {
            // SAFETY: non-NULL, valid for a write (the contract).
            unsafe { report.write(out) };
        }
        Ok(ws_status::WS_OK)
    })
}

/// The block size `A` of O_DIRECT reads of this engine's model (at least
/// 4096): a payload at file offset `off` lands in place O_DIRECT at an
/// address `a` with `a % A == off % A`.
///
/// # Safety
/// `align` is valid for a write.
#[no_mangle]
pub unsafe extern "C" fn ws_engine_direct_align(engine: ws_engine, align: *mut usize) -> ws_status {
    guard("ws_engine_direct_align", || {
        let e = ENGINES.get(engine.id)?;
        // SAFETY: the contract above.
        unsafe { put(align, "align", e.engine.direct_align()) }?;
        Ok(ws_status::WS_OK)
    })
}

/// Lends `len` bytes of the caller's memory at `ptr` (page-aligned) to the
/// engine, registered with its rings where the kernel allows (a refusal is
/// counted in the stats and warned once, never silent).
///
/// Ownership: the memory stays the caller's; this library never frees,
/// unmaps or advises it. The caller must not free, unmap or remap it until
/// `ws_memory_unregister` returned `WS_OK`, and must not touch the bytes of
/// a read in flight (between `ws_read_into` and the ticket's completion).
///
/// # Safety
/// `ptr..ptr + len` is valid for reads and writes and stays so until
/// `ws_memory_unregister` returns `WS_OK`; the same bytes are not lent to
/// another memory handle at the same time; a forked child does not read
/// into it. `out` is valid for a write.
#[no_mangle]
pub unsafe extern "C" fn ws_memory_register(
    engine: ws_engine,
    ptr: *mut std::ffi::c_void,
    len: usize,
    out: *mut ws_memory,
) -> ws_status {
    guard("ws_memory_register", || {
        let e = ENGINES.get(engine.id)?;
        let p = NonNull::new(ptr.cast::<u8>()).ok_or_else(|| null("ptr"))?;
        if !(p.as_ptr() as usize).is_multiple_of(4096) {
            return Err(Fail::new(
                ws_status::WS_ERR_MISALIGNED,
                format!(
                    "ptr {:p} is not page-aligned (4096): use mmap or posix_memalign",
                    p.as_ptr()
                ),
            ));
        }
        if len == 0 {
            return Err(Fail::new(ws_status::WS_ERR_TOO_SMALL, "len is 0"));
        }
        if out.is_null() {
            return Err(null("out"));
        }
        // SAFETY: the caller's obligations above are exactly those of
        // Engine::register_memory (the header repeats them).
        let arena = unsafe { e.engine.register_memory(p, len) }?;
        e.users.fetch_add(1, Ordering::AcqRel);
        let id = MEMORY.insert(MemoryObj {
            kind: MemKind::Caller,
            arena: Mutex::new(Some(arena)),
            base: p.as_ptr() as usize,
            len,
            engine: e,
            tickets: AtomicUsize::new(0),
        });
        // SAFETY: checked non-NULL above; valid for a write (the contract).
        unsafe { out.write(ws_memory { id }) };
        Ok(ws_status::WS_OK)
    })
}

/// Takes the memory back. Refused with `WS_ERR_BUSY` while tickets into it
/// are held (collect them with poll/wait, or free them). Then waits up to
/// `timeout_ms` for reads still in the kernel (those of freed tickets):
/// `WS_OK` means the memory may be freed or reused now, and the handle is
/// closed; `WS_TIMEOUT` means reads are still in the kernel: the memory
/// must not be freed, and the handle stays valid (call again).
#[no_mangle]
pub extern "C" fn ws_memory_unregister(memory: ws_memory, timeout_ms: u64) -> ws_status {
    guard("ws_memory_unregister", || {
        let m = MEMORY.remove(memory.id)?;
        let held = m.tickets.load(Ordering::Acquire);
        if held > 0 {
            MEMORY.reinsert(memory.id, m);
            return Err(Fail::new(
                ws_status::WS_ERR_BUSY,
                format!(
                    "memory {}: {held} ticket(s) into it not collected or freed (wait, poll or free them first)",
                    memory.id
                ),
            ));
        }
        let arena = m.arena.lock().unwrap_or_else(std::sync::PoisonError::into_inner).take();
        let Some(arena) = arena else {
            return Ok(ws_status::WS_OK);
        };
        match arena.release(Duration::from_millis(timeout_ms)) {
            Ok(()) => Ok(ws_status::WS_OK),
            Err(arena) => {
                *m.arena.lock().unwrap_or_else(std::sync::PoisonError::into_inner) = Some(arena);
                MEMORY.reinsert(memory.id, m);
                Ok(ws_status::WS_TIMEOUT)
            }
        }
    })
}

/// Where the payloads of `tensors[0..n]` land in `memory` so that every read
/// of them with `WS_SCRATCH_BLOCKS` is in place and O_DIRECT: back to back,
/// each on its phase. `offsets[i]` receives tensor i's `at`;
/// `WS_ERR_TOO_SMALL` (with the bytes needed) when they do not fit.
///
/// # Safety
/// `tensors` holds `n` indexes; `offsets` is valid for `n` writes.
#[no_mangle]
pub unsafe extern "C" fn ws_memory_placement(
    memory: ws_memory,
    tensors: *const usize,
    n: usize,
    offsets: *mut usize,
) -> ws_status {
    guard("ws_memory_placement", || {
        let m = MEMORY.get(memory.id)?;
        if n == 0 {
            return Ok(ws_status::WS_OK);
        }
        if tensors.is_null() {
            return Err(null("tensors"));
        }
        if offsets.is_null() {
            return Err(null("offsets"));
        }
        // SAFETY: `tensors` holds `n` indexes (the contract).
        let idx = unsafe { std::slice::from_raw_parts(tensors, n) };
        let all = m.engine.model.model.catalog().tensors();
        let refs = idx
            .iter()
            .map(|&i| {
                all.get(i).ok_or_else(|| {
                    Fail::new(
                        ws_status::WS_ERR_NOT_FOUND,
                        format!("tensor index {i}: the model has {}", all.len()),
                    )
                })
            })
            .collect::<Res<Vec<_>>>()?;
        let guard = m.arena.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let arena = guard
            .as_ref()
            .ok_or_else(|| Fail::new(ws_status::WS_ERR_HANDLE, "memory unregistered"))?;
        let p = m.engine.engine.placement(&refs, arena).map_err(|e| {
            let f = Fail::from(e);
            Fail::new(ws_status::WS_ERR_TOO_SMALL, f.msg)
        })?;
        // SAFETY: `offsets` is valid for `n` writes (the contract).
        let out = unsafe { std::slice::from_raw_parts_mut(offsets, n) };
        out.copy_from_slice(&p.offsets()[..n]);
        Ok(ws_status::WS_OK)
    })
}

/// The tensor (or byte range of it) a `ws_read` names.
fn target(e: &EngineObj, r: &ws_read) -> Res<ws::TensorRef> {
    let all = e.model.model.catalog().tensors();
    let whole = all.get(r.tensor).ok_or_else(|| {
        Fail::new(
            ws_status::WS_ERR_NOT_FOUND,
            format!("tensor index {}: the model has {}", r.tensor, all.len()),
        )
    })?;
    if r.start == 0 && r.end == 0 {
        return Ok(whole.clone());
    }
    if r.start >= r.end || r.end > whole.len {
        return Err(Fail::new(
            ws_status::WS_ERR_INVALID,
            format!(
                "tensor {}: bytes [{}, {}) are not a non-empty range of its {} bytes",
                whole.name, r.start, r.end, whole.len
            ),
        ));
    }
    Ok(whole.byte_range(r.start..r.end)?)
}

fn new_ticket(m: &Arc<MemoryObj>, ticket: Ticket, hold: bool) -> ws_ticket {
    m.tickets.fetch_add(1, Ordering::AcqRel);
    ws_ticket {
        id: TICKETS.insert(TicketObj {
            state: Mutex::new(TicketState::Pending(ticket)),
            memory: Arc::clone(m),
            hold,
        }),
    }
}

/// A range of memory that a read in flight or a held ticket covers is
/// `WS_ERR_BUSY`, not a generic refusal.
fn busy_if_overlap(err: ws::Error) -> Fail {
    let f = Fail::from(err);
    if f.msg.contains("overlap a slot in use") || f.msg.contains("no free run") {
        Fail::new(ws_status::WS_ERR_BUSY, f.msg)
    } else {
        f
    }
}

fn submit(e: &Arc<EngineObj>, m: &Arc<MemoryObj>, r: &ws_read) -> Res<ws_ticket> {
    let t = target(e, r)?;
    if r.flags & !(WS_READ_IN_PLACE | WS_READ_HOLD) != 0 {
        return Err(Fail::new(
            ws_status::WS_ERR_INVALID,
            format!("flags {:#x}: unknown bits", r.flags),
        ));
    }
    if m.kind == MemKind::Slots {
        return Err(Fail::new(
            ws_status::WS_ERR_INVALID,
            "an arena of fixed slots is read into with ws_read_any (the engine picks the slot), not ws_read_into",
        ));
    }
    let scratch = match r.scratch {
        ws_scratch::WS_SCRATCH_NONE => Scratch::None,
        ws_scratch::WS_SCRATCH_BEFORE => Scratch::Before,
        ws_scratch::WS_SCRATCH_BLOCKS => Scratch::Blocks,
    };
    let end = r.at.checked_add(t.len as usize).filter(|&e| e <= m.len);
    if end.is_none() {
        return Err(Fail::new(
            ws_status::WS_ERR_TOO_SMALL,
            format!(
                "tensor {}: {} bytes at offset {} do not fit the {}-byte memory",
                t.name, t.len, r.at, m.len
            ),
        ));
    }
    if r.flags & WS_READ_IN_PLACE != 0 {
        let align = e.engine.direct_align();
        let phase = (t.offset % align as u64) as usize;
        let addr = m.base.wrapping_add(r.at);
        let len = t.len as usize;
        // Engine::read_into's own rule for a read in place: in phase, room
        // before it for the scratch that needs it, and a first block the
        // scratch allows to be read whole.
        let fits = match r.scratch {
            ws_scratch::WS_SCRATCH_NONE => phase == 0 && len >= align,
            ws_scratch::WS_SCRATCH_BEFORE | ws_scratch::WS_SCRATCH_BLOCKS => r.at >= phase && phase + len >= align,
        };
        if addr % align != phase || !fits {
            return Err(Fail::new(
                ws_status::WS_ERR_MISALIGNED,
                format!(
                    "tensor {}: WS_READ_IN_PLACE at offset {} (address {addr:#x}) with {:?}: the payload must start at an \
                     address that is {phase} mod {align} (its file offset {} mod {align}), with {phase} bytes of the memory \
                     before it that the scratch may overwrite (WS_SCRATCH_NONE: only for a payload on a block boundary), \
                     and hold at least one whole block",
                    t.name, r.at, r.scratch, t.offset
                ),
            ));
        }
    }
    let ticket = {
        let guard = m.arena.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let arena = guard
            .as_ref()
            .ok_or_else(|| Fail::new(ws_status::WS_ERR_HANDLE, "memory unregistered"))?;
        e.engine.read_into(&t, arena, r.at, scratch).map_err(busy_if_overlap)?
    };
    Ok(new_ticket(m, ticket, r.flags & WS_READ_HOLD != 0))
}

fn engine_and_memory(engine: ws_engine, memory: ws_memory) -> Res<(Arc<EngineObj>, Arc<MemoryObj>)> {
    let e = ENGINES.get(engine.id)?;
    let m = MEMORY.get(memory.id)?;
    if !Arc::ptr_eq(&m.engine, &e) {
        return Err(Fail::new(
            ws_status::WS_ERR_INVALID,
            format!(
                "memory {} is registered with another engine than {}",
                memory.id, engine.id
            ),
        ));
    }
    Ok((e, m))
}

/// Starts one read into caller memory (or a packed engine arena): the
/// payload (or bytes `[start, end)` of it) lands at offset `at` of
/// `memory`. Returns at once with a ticket; collect it with
/// `ws_ticket_poll` / `ws_ticket_wait`, or drop it with `ws_ticket_free`.
/// Until then the caller must not touch those bytes. A range overlapping
/// a read in flight (or a held ticket's bytes) is `WS_ERR_BUSY`.
///
/// Thread safety: any number of threads may submit at once, to one engine
/// and one memory (distinct ranges).
///
/// # Safety
/// `read` points to a `ws_read`; `ticket` is valid for a write.
#[no_mangle]
pub unsafe extern "C" fn ws_read_into(
    engine: ws_engine,
    memory: ws_memory,
    read: *const ws_read,
    ticket: *mut ws_ticket,
) -> ws_status {
    guard("ws_read_into", || {
        if read.is_null() {
            return Err(null("read"));
        }
        if ticket.is_null() {
            return Err(null("ticket"));
        }
        // SAFETY: non-NULL, a ws_read (the contract).
        let r = unsafe { read_req(read) }?;
        let (e, m) = engine_and_memory(engine, memory)?;
        let t = submit(&e, &m, &r)?;
        // SAFETY: non-NULL, valid for a write (the contract).
        unsafe { ticket.write(t) };
        Ok(ws_status::WS_OK)
    })
}

/// Starts one read to a place the engine picks: in a packed memory
/// (caller memory or `ws_arena_create`), the lowest free run of whole
/// blocks in phase (in place, O_DIRECT); in an arena of fixed slots
/// (`ws_arena_create_slots`), a free slot. Only `read->tensor`,
/// `read->start` and `read->end` are used (`at`, `scratch` and `flags` must
/// be 0). The ticket always holds its bytes (as `WS_READ_HOLD`): collect
/// the result with poll or wait (`result.offset`, `result.data`), use the
/// payload, then `ws_ticket_free` gives the place back. No free place is
/// `WS_ERR_BUSY`; a slot too small for the tensor is `WS_ERR_TOO_SMALL`.
///
/// # Safety
/// `read` points to a `ws_read`; `ticket` is valid for a write.
#[no_mangle]
pub unsafe extern "C" fn ws_read_any(
    engine: ws_engine,
    memory: ws_memory,
    read: *const ws_read,
    ticket: *mut ws_ticket,
) -> ws_status {
    guard("ws_read_any", || {
        if read.is_null() {
            return Err(null("read"));
        }
        if ticket.is_null() {
            return Err(null("ticket"));
        }
        // SAFETY: non-NULL, a ws_read (the contract).
        let r = unsafe { read_req(read) }?;
        if r.at != 0 || r.flags != 0 || r.scratch != ws_scratch::WS_SCRATCH_NONE {
            return Err(Fail::new(
                ws_status::WS_ERR_INVALID,
                "ws_read_any picks the place itself: at, scratch and flags must be 0",
            ));
        }
        let (e, m) = engine_and_memory(engine, memory)?;
        let t = target(&e, &r)?;
        let tk = {
            let guard = m.arena.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            let arena = guard
                .as_ref()
                .ok_or_else(|| Fail::new(ws_status::WS_ERR_HANDLE, "memory unregistered"))?;
            match m.kind {
                MemKind::Slots => {
                    let slot = arena.take_for(&t).map_err(|err| match err {
                        ws::TakeError::Full { .. } | ws::TakeError::Fragmented { .. } => Fail::new(
                            ws_status::WS_ERR_BUSY,
                            format!("tensor {}: every slot is held ({err})", t.name),
                        ),
                        _ => Fail::new(ws_status::WS_ERR_TOO_SMALL, format!("tensor {}: {err}", t.name)),
                    })?;
                    e.engine.read(&t, slot)?
                }
                MemKind::Caller | MemKind::Packed => e.engine.read_anywhere(&t, arena).map_err(busy_if_overlap)?.1,
            }
        };
        let tk = new_ticket(&m, tk, true);
        // SAFETY: non-NULL, valid for a write (the contract).
        unsafe { ticket.write(tk) };
        Ok(ws_status::WS_OK)
    })
}

/// Reads a `ws_read` without trusting its enum field: a value outside
/// `ws_scratch` from C would be undefined behaviour as a Rust enum, so the
/// field is read as the integer it is and checked.
///
/// # Safety
/// `p` is non-NULL and points to a readable `ws_read`.
unsafe fn read_req(p: *const ws_read) -> Res<ws_read> {
    #[repr(C)]
    #[derive(Clone, Copy)]
    struct Raw {
        tensor: usize,
        start: u64,
        end: u64,
        at: usize,
        scratch: u32,
        flags: u32,
    }
    const _: () = assert!(std::mem::size_of::<Raw>() == std::mem::size_of::<ws_read>());
    // SAFETY: the same layout as ws_read (repr(C); a C enum is a 32-bit
    // int on Linux targets), readable (the contract).
    let raw = unsafe { p.cast::<Raw>().read() };
    let scratch = match raw.scratch {
        0 => ws_scratch::WS_SCRATCH_NONE,
        1 => ws_scratch::WS_SCRATCH_BEFORE,
        2 => ws_scratch::WS_SCRATCH_BLOCKS,
        s => {
            return Err(Fail::new(
                ws_status::WS_ERR_INVALID,
                format!("scratch {s} (WS_SCRATCH_NONE, _BEFORE or _BLOCKS)"),
            ))
        }
    };
    Ok(ws_read {
        tensor: raw.tensor,
        start: raw.start,
        end: raw.end,
        at: raw.at,
        scratch,
        flags: raw.flags,
    })
}

/// Starts `n` reads (as `ws_read_into`, one ticket each in `tickets`). All
/// or nothing: when read k is refused, the k reads already started are
/// freed (their memory stays busy until the kernel is done with it, as
/// with `ws_ticket_free`), every `tickets[i]` is zeroed, and the error
/// names k.
///
/// # Safety
/// `reads` holds `n` `ws_read`s; `tickets` is valid for `n` writes.
#[no_mangle]
pub unsafe extern "C" fn ws_read_batch(
    engine: ws_engine,
    memory: ws_memory,
    reads: *const ws_read,
    n: usize,
    tickets: *mut ws_ticket,
) -> ws_status {
    guard("ws_read_batch", || {
        if n == 0 {
            return Ok(ws_status::WS_OK);
        }
        if reads.is_null() {
            return Err(null("reads"));
        }
        if tickets.is_null() {
            return Err(null("tickets"));
        }
        let (e, m) = engine_and_memory(engine, memory)?;
        let mut done: Vec<ws_ticket> = Vec::with_capacity(n);
        for k in 0..n {
            // SAFETY: `reads` holds `n` entries (the contract); k < n.
            let r = unsafe { read_req(reads.add(k)) };
            match r.and_then(|r| submit(&e, &m, &r)) {
                Ok(t) => done.push(t),
                Err(f) => {
                    for t in done {
                        let _ = TICKETS.remove(t.id);
                    }
                    // SAFETY: `tickets` is valid for `n` writes (the contract).
                    unsafe { std::slice::from_raw_parts_mut(tickets, n) }.fill(ws_ticket::default());
                    return Err(Fail::new(f.code, format!("read {k} of {n}: {}", f.msg)));
                }
            }
        }
        // SAFETY: `tickets` is valid for `n` writes (the contract).
        unsafe { std::slice::from_raw_parts_mut(tickets, n) }.copy_from_slice(&done);
        Ok(ws_status::WS_OK)
    })
}

/// A completed read's outcome, and its `Loaded` when the ticket holds it.
/// Otherwise the `Loaded` is dropped here: the slot goes back to the
/// memory, and the bytes stay where they landed, the caller's to use.
fn finish(r: ws::Result<ws::Loaded>, hold: bool) -> (Res<Out>, Option<ws::Loaded>) {
    match r {
        Ok(loaded) => {
            let out = Out {
                offset: loaded.offset(),
                bytes: loaded.bytes().len() as u64,
                data: loaded.bytes().as_ptr() as usize,
            };
            (Ok(out), hold.then_some(loaded))
        }
        Err(e) => (Err(e.into()), None),
    }
}

/// Hands a completed read's outcome to the caller. A held success keeps
/// the ticket (its state back in `st`); anything else spends it.
///
/// # Safety
/// `result` is NULL or valid for a write.
unsafe fn deliver(
    id: u64,
    st: &mut TicketState,
    (r, held): (Res<Out>, Option<ws::Loaded>),
    result: *mut ws_read_result,
) -> Res<ws_status> {
    if held.is_some() && r.is_ok() {
        *st = TicketState::Done(r.clone(), held);
    } else {
        let _ = TICKETS.remove(id);
    }
    let v = r?;
    if !result.is_null() {
        // SAFETY: non-NULL, valid for a write (the caller's contract).
        unsafe { result.write(v.result()) };
    }
    Ok(ws_status::WS_OK)
}

/// `WS_OK` (and `*result`, if not NULL) when the read is done, the ticket
/// then spent (unless it holds its bytes: `WS_READ_HOLD`, `ws_read_any`);
/// `WS_PENDING` when it is still in flight; the read's error (the ticket
/// spent) when it failed. Never blocks.
///
/// # Safety
/// `result` is NULL or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn ws_ticket_poll(ticket: ws_ticket, result: *mut ws_read_result) -> ws_status {
    guard("ws_ticket_poll", || {
        let obj = TICKETS.get(ticket.id)?;
        let mut st = obj.state.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let done = match std::mem::replace(&mut *st, TicketState::Waiting) {
            TicketState::Waiting => {
                *st = TicketState::Waiting;
                return Ok(ws_status::WS_PENDING);
            }
            TicketState::Done(r, held) => (r, held),
            TicketState::Pending(t) => match t.try_wait() {
                Ok(r) => finish(r, obj.hold),
                Err(t) => {
                    *st = TicketState::Pending(t);
                    return Ok(ws_status::WS_PENDING);
                }
            },
        };
        // SAFETY: the contract above.
        unsafe { deliver(ticket.id, &mut st, done, result) }
    })
}

/// Blocks until the read is done (then as `ws_ticket_poll`) or `timeout_ms`
/// passes (`WS_TIMEOUT`, the ticket still valid). `UINT64_MAX` waits
/// without a bound. A ticket another thread is waiting on is
/// `WS_ERR_BUSY`; one already collected or freed is `WS_ERR_HANDLE`.
///
/// # Safety
/// `result` is NULL or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn ws_ticket_wait(ticket: ws_ticket, timeout_ms: u64, result: *mut ws_read_result) -> ws_status {
    guard("ws_ticket_wait", || {
        let obj = TICKETS.get(ticket.id)?;
        let taken = {
            let mut st = obj.state.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            match std::mem::replace(&mut *st, TicketState::Waiting) {
                TicketState::Waiting => {
                    return Err(Fail::new(
                        ws_status::WS_ERR_BUSY,
                        format!("ticket {}: another thread is waiting on it", ticket.id),
                    ))
                }
                TicketState::Done(r, held) => {
                    // SAFETY: the contract above.
                    return unsafe { deliver(ticket.id, &mut st, (r, held), result) };
                }
                TicketState::Pending(t) => t,
            }
        };
        let waited = if timeout_ms == u64::MAX {
            Ok(taken.wait())
        } else {
            taken.wait_timeout(Duration::from_millis(timeout_ms))
        };
        let mut st = obj.state.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        match waited {
            Ok(r) => {
                let done = finish(r, obj.hold);
                // SAFETY: the contract above.
                unsafe { deliver(ticket.id, &mut st, done, result) }
            }
            Err(t) => {
                *st = TicketState::Pending(t);
                Ok(ws_status::WS_TIMEOUT)
            }
        }
    })
}

/// Whether the read is done, without collecting it: 1 done, 0 in flight.
///
/// # Safety
/// `done` is valid for a write.
#[no_mangle]
pub unsafe extern "C" fn ws_ticket_is_done(ticket: ws_ticket, done: *mut c_int) -> ws_status {
    guard("ws_ticket_is_done", || {
        let obj = TICKETS.get(ticket.id)?;
        let st = obj.state.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let d = match &*st {
            TicketState::Pending(t) => t.is_ready(),
            TicketState::Waiting => false,
            TicketState::Done(..) => true,
        };
        drop(st);
        // SAFETY: the contract above.
        unsafe { put(done, "done", c_int::from(d)) }?;
        Ok(ws_status::WS_OK)
    })
}

/// Writes 1 to an eventfd when a read completes: the waker of a polled
/// ticket. It owns a duplicate of the caller's descriptor, so the caller may
/// close its own at any time.
struct EventFdWaker(OwnedFd);

impl Wake for EventFdWaker {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }
    fn wake_by_ref(self: &Arc<Self>) {
        // An eventfd write of 1 never blocks short of 2^64 - 2 unread
        // wake-ups; an error (a descriptor that is not an eventfd) has no
        // one to report to on this I/O thread, and the ticket still
        // completes for poll and wait.
        let _ = rustix::io::write(&self.0, &1u64.to_ne_bytes());
    }
}

/// Asks for a write of 1 to the eventfd `fd` when the read completes (at
/// once if it already has): a C event loop waits on `fd` (epoll, poll,
/// io_uring) and then collects the ticket with `ws_ticket_poll`. One fd may
/// serve many tickets. The library duplicates `fd`; the caller keeps its
/// own and may close it any time. A later call replaces the earlier fd.
#[no_mangle]
pub extern "C" fn ws_ticket_notify(ticket: ws_ticket, fd: c_int) -> ws_status {
    guard("ws_ticket_notify", || {
        let obj = TICKETS.get(ticket.id)?;
        if fd < 0 {
            return Err(Fail::new(ws_status::WS_ERR_INVALID, format!("fd {fd}")));
        }
        // SAFETY: only borrowed for the duplication below, during this call,
        // in which the caller keeps `fd` open (it passed it in).
        let borrowed = unsafe { BorrowedFd::borrow_raw(fd) };
        let own = rustix::io::fcntl_dupfd_cloexec(borrowed, 0)
            .map_err(|e| Fail::new(ws_status::WS_ERR_INVALID, format!("fd {fd}: duplicate it: {e}")))?;
        let waker = Arc::new(EventFdWaker(own));
        let mut st = obj.state.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        match std::mem::replace(&mut *st, TicketState::Waiting) {
            TicketState::Pending(mut t) => {
                let w = Waker::from(Arc::clone(&waker));
                let mut cx = Context::from_waker(&w);
                match Pin::new(&mut t).poll(&mut cx) {
                    Poll::Ready(r) => {
                        let (r, held) = finish(r, obj.hold);
                        *st = TicketState::Done(r, held);
                        waker.wake_by_ref();
                    }
                    Poll::Pending => *st = TicketState::Pending(t),
                }
            }
            TicketState::Done(r, held) => {
                *st = TicketState::Done(r, held);
                waker.wake_by_ref();
            }
            TicketState::Waiting => {
                *st = TicketState::Waiting;
                return Err(Fail::new(
                    ws_status::WS_ERR_BUSY,
                    format!("ticket {}: another thread is waiting on it", ticket.id),
                ));
            }
        }
        Ok(ws_status::WS_OK)
    })
}

/// Drops a ticket. Not yet collected: a read still in flight completes
/// later, and until it does its bytes of memory stay busy (and
/// `ws_memory_unregister` waits for them). Holding its bytes
/// (`WS_READ_HOLD`, `ws_read_any`): gives them back. A second free is
/// `WS_ERR_HANDLE`; a free while another thread waits on the ticket is
/// `WS_ERR_BUSY`.
#[no_mangle]
pub extern "C" fn ws_ticket_free(ticket: ws_ticket) -> ws_status {
    guard("ws_ticket_free", || {
        let obj = TICKETS.remove(ticket.id)?;
        let waiting = matches!(
            *obj.state.lock().unwrap_or_else(std::sync::PoisonError::into_inner),
            TicketState::Waiting
        );
        if waiting {
            TICKETS.reinsert(ticket.id, obj);
            return Err(Fail::new(
                ws_status::WS_ERR_BUSY,
                format!("ticket {}: another thread is waiting on it", ticket.id),
            ));
        }
        drop(obj);
        Ok(ws_status::WS_OK)
    })
}

fn owned_arena(e: Arc<EngineObj>, arena: ws::Arena, kind: MemKind) -> ws_memory {
    let (base, len) = arena.region();
    e.users.fetch_add(1, Ordering::AcqRel);
    ws_memory {
        id: MEMORY.insert(MemoryObj {
            kind,
            arena: Mutex::new(Some(arena)),
            base: base as usize,
            len,
            engine: e,
            tickets: AtomicUsize::new(0),
        }),
    }
}

/// An arena the engine owns: `bytes` of page-aligned memory (2 MiB pages
/// where the kernel gives them), registered with the rings, read into with
/// `ws_read_into` (at offsets `ws_memory_placement` gives) or
/// `ws_read_any`. `populate` non-zero faults it in now. Freed by
/// `ws_memory_unregister` once no read is in flight.
///
/// # Safety
/// `out` is valid for a write.
#[no_mangle]
pub unsafe extern "C" fn ws_arena_create(
    engine: ws_engine,
    bytes: usize,
    populate: c_int,
    out: *mut ws_memory,
) -> ws_status {
    guard("ws_arena_create", || {
        let e = ENGINES.get(engine.id)?;
        if bytes == 0 {
            return Err(Fail::new(ws_status::WS_ERR_TOO_SMALL, "bytes is 0"));
        }
        if out.is_null() {
            return Err(null("out"));
        }
        let arena = e.engine.packed_arena(bytes, populate != 0)?;
        let m = owned_arena(e, arena, MemKind::Packed);
        // SAFETY: checked non-NULL above; valid for a write (the contract).
        unsafe { out.write(m) };
        Ok(ws_status::WS_OK)
    })
}

/// An arena of `count` fixed slots of `slot_bytes` each, the engine's,
/// registered with the rings: `ws_read_any` takes a free slot for each
/// read (a slot holds any tensor of up to `slot_bytes`; the payload lands
/// at `file_offset % align` in it). Freed by `ws_memory_unregister` once
/// no read is in flight.
///
/// # Safety
/// `out` is valid for a write.
#[no_mangle]
pub unsafe extern "C" fn ws_arena_create_slots(
    engine: ws_engine,
    slot_bytes: usize,
    count: usize,
    out: *mut ws_memory,
) -> ws_status {
    guard("ws_arena_create_slots", || {
        let e = ENGINES.get(engine.id)?;
        if slot_bytes == 0 || count == 0 {
            return Err(Fail::new(
                ws_status::WS_ERR_TOO_SMALL,
                format!("{count} slot(s) of {slot_bytes} bytes"),
            ));
        }
        if out.is_null() {
            return Err(null("out"));
        }
        let spec = ws::SlotSpec::new(slot_bytes).with_align(e.engine.direct_align());
        let arena = e.engine.arena(spec, count)?;
        let m = owned_arena(e, arena, MemKind::Slots);
        // SAFETY: checked non-NULL above; valid for a write (the contract).
        unsafe { out.write(m) };
        Ok(ws_status::WS_OK)
    })
}

/// A summary of the engine's counters.
///
/// # Safety
/// `out` is valid for a write.
#[no_mangle]
pub unsafe extern "C" fn ws_engine_stats(engine: ws_engine, out: *mut ws_stats) -> ws_status {
    guard("ws_engine_stats", || {
        let e = ENGINES.get(engine.id)?;
        let s = e.engine.stats();
        let v = ws_stats {
            bytes: s.bytes,
            reads_direct: s.reads_direct(),
            reads_buffered: s.reads_buffered(),
            fallbacks: s.fallbacks_total(),
            staged_reads: s.staged.reads,
            staged_bytes: s.staged.bytes,
            drives: s.drives.len() as u32,
            warnings: s.warnings.len() as u32,
        };
        // SAFETY: the contract above.
        unsafe { put(out, "out", v) }?;
        Ok(ws_status::WS_OK)
    })
}

/// Every counter of the engine as JSON (`Stats`: per drive, by cause, the
/// warnings' text), to be freed with `ws_string_free`.
///
/// # Safety
/// `json` is valid for a write.
#[no_mangle]
pub unsafe extern "C" fn ws_engine_stats_json(engine: ws_engine, json: *mut *mut c_char) -> ws_status {
    guard("ws_engine_stats_json", || {
        let e = ENGINES.get(engine.id)?;
        if json.is_null() {
            return Err(null("json"));
        }
        let s =
            serde_json::to_string(&e.engine.stats()).map_err(|e| Fail::new(ws_status::WS_ERR_CONFIG, e.to_string()))?;
        // SAFETY: non-NULL, valid for a write (the contract).
        unsafe { json.write(CString::new(s).unwrap_or_default().into_raw()) };
        Ok(ws_status::WS_OK)
    })
}
