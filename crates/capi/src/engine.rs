//! Engines: create (options or the environment), the O_DIRECT block size,
//! stats, and a bounded shutdown.

use std::ffi::{c_char, c_int};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, LazyLock};
use std::time::{Duration, Instant};

use ws::{Engine, EngineConfig};

use crate::handles::Table;
use crate::model::ModelObj;
use crate::status::{guard, ws_status, Fail, Res};
use crate::types::{
    ws_engine, ws_engine_options, ws_model, ws_shutdown_report, ws_stats, WS_NUMA_DEFAULT, WS_NUMA_OFF, WS_NUMA_ON,
};
use crate::util::{invalid, malloc_string, null, opt_str, options, parse, put};

pub(crate) struct EngineObj {
    pub(crate) engine: Engine,
    pub(crate) model: Arc<ModelObj>,
    /// Memory handles (the caller's and the engine's arenas) open on it.
    pub(crate) users: AtomicUsize,
}

pub(crate) static ENGINES: LazyLock<Table<EngineObj>> = LazyLock::new(|| Table::new("engine"));

/// The default engine options, `struct_size` filled in (every other field
/// zero or NULL: the defaults).
#[no_mangle]
pub extern "C" fn ws_engine_options_default() -> ws_engine_options {
    ws_engine_options {
        struct_size: std::mem::size_of::<ws_engine_options>() as u32,
        backend: std::ptr::null(),
        queue_depth: 0,
        chunk_bytes: 0,
        numa: WS_NUMA_DEFAULT,
        submit: std::ptr::null(),
    }
}

fn make_engine(model: ws_model, config: EngineConfig) -> Res<ws_engine> {
    let m = ModelObj::get(model)?;
    let engine = Engine::new(&m.model, config)?;
    Ok(ws_engine {
        id: ENGINES.insert(EngineObj {
            engine,
            model: m,
            users: AtomicUsize::new(0),
        }),
    })
}

/// The engine settings `options` (NULL: defaults) say, checked.
///
/// # Safety
/// `options` is NULL or a `ws_engine_options` whose strings are NULL or
/// NUL-terminated.
pub(crate) unsafe fn engine_config(options: *const ws_engine_options) -> Res<EngineConfig> {
    let mut c = EngineConfig::default();
    // SAFETY: NULL or a ws_engine_options (the contract).
    if let Some(o) = unsafe { self::options(options, "options", "ws_engine_options_default()") }? {
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
                return Err(invalid(format!("options.queue_depth {} (1 to 4096)", o.queue_depth)));
            }
            c = c.queue_depth(o.queue_depth as usize);
        }
        if o.chunk_bytes != 0 {
            if !o.chunk_bytes.is_multiple_of(4096) || o.chunk_bytes > 1 << 30 {
                return Err(invalid(format!(
                    "options.chunk_bytes {} (a multiple of 4096, 4 KiB to 1 GiB)",
                    o.chunk_bytes
                )));
            }
            c = c.chunk(Some(o.chunk_bytes as usize));
        }
        c = match o.numa {
            WS_NUMA_DEFAULT => c,
            WS_NUMA_ON => c.numa(true),
            WS_NUMA_OFF => c.numa(false),
            n => {
                return Err(invalid(format!(
                    "options.numa {n} (WS_NUMA_DEFAULT 0, WS_NUMA_ON 1, WS_NUMA_OFF 2)"
                )))
            }
        };
    }
    Ok(c)
}

/// Starts an engine for `model` with `options` (NULL: defaults).
///
/// Thread safety: an engine is used from any number of threads at once
/// (registering memory, reading, polling, stats); `ws_engine_shutdown` is
/// refused (`WS_ERR_BUSY`) while memory is open on it.
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
        if out.is_null() {
            return Err(null("out"));
        }
        // SAFETY: NULL or a ws_engine_options with NULL or NUL-terminated
        // strings (the contract).
        let c = unsafe { engine_config(options) }?;
        let e = make_engine(model, c)?;
        // SAFETY: checked non-NULL; valid for a write (the contract).
        unsafe { out.write(e) };
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
        if out.is_null() {
            return Err(null("out"));
        }
        let e = make_engine(model, EngineConfig::from_env()?)?;
        // SAFETY: checked non-NULL; valid for a write (the contract).
        unsafe { out.write(e) };
        Ok(ws_status::WS_OK)
    })
}

/// Stops the engine: waits up to `timeout_ms` for its I/O threads, then
/// reports what was left in flight (those threads are detached and keep
/// the memory the kernel may write: a leak, never an early free). Refused
/// with `WS_ERR_BUSY` (the engine stays open) while memory handles are open
/// on it (unregister them first). A second shutdown is `WS_ERR_HANDLE`.
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
        let timeout = Duration::from_millis(timeout_ms);
        // Decided under the table's lock: a refused shutdown never takes
        // the engine out of the table, so other threads' calls on it go on
        // (WS_ERR_HANDLE only ever means a closed handle). A memory handle
        // holds the engine too, so it is counted before the wait.
        let e = ENGINES.remove_when(
            engine.id,
            Instant::now() + timeout.min(Duration::from_secs(1)),
            |e| match e.users.load(Ordering::SeqCst) {
                0 => Ok(()),
                users => Err(Fail::new(
                    ws_status::WS_ERR_BUSY,
                    format!(
                        "engine {}: {users} memory handle(s) still open on it (unregister them first; tickets into them keep them)",
                        engine.id
                    ),
                )),
            },
            || {
                Fail::new(
                    ws_status::WS_ERR_BUSY,
                    format!("engine {}: another thread is still in a call on it", engine.id),
                )
            },
        )?;
        let obj = Arc::into_inner(e).expect("remove_when hands back the only reference");
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
            slice_reads: s.slices.reads,
            slice_bytes_wanted: s.slices.bytes_wanted,
            slice_bytes_read: s.slices.bytes_read,
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
        let p = malloc_string(&s)?;
        // SAFETY: non-NULL, valid for a write (the contract).
        unsafe { json.write(p) };
        Ok(ws_status::WS_OK)
    })
}
