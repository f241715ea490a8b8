//! Expert caches: create, get (a pinned expert and its parts' pointers and
//! lengths), release, prefetch, stats and destroy (`ws::ExpertCache`).

use std::ffi::{c_char, CString};
use std::sync::LazyLock;

use ws::{CacheConfig, Capacity, ExpertCache, ExpertHandle, Policy};

use crate::engine::engine_config;
use crate::handles::Table;
use crate::model::ModelObj;
use crate::status::{guard, ws_status, Fail, Res};
use crate::types::{
    ws_cache_stats, ws_engine_options, ws_expert, ws_expert_cache, ws_expert_cache_options, ws_expert_key,
    ws_expert_part, ws_model, ws_prefetch_report, WS_CACHE_LFU, WS_CACHE_LRU,
};
use crate::util::{invalid, malloc_string, null, options, put, MAX_BATCH};

static CACHES: LazyLock<Table<ExpertCache>> = LazyLock::new(|| Table::new("expert cache"));

/// A handed-out expert: the handle that pins it and the C strings its
/// parts point to (alive as long as the handle).
struct ExpertObj {
    handle: ExpertHandle,
    names: Vec<(CString, CString, CString)>,
}

static EXPERTS: LazyLock<Table<ExpertObj>> = LazyLock::new(|| Table::new("expert"));

fn cstring(s: &str) -> CString {
    CString::new(s.replace('\0', "\\0")).unwrap_or_default()
}

/// The default cache options: `struct_size` set, LRU, no capacity (one
/// of `capacity_experts` and `budget_bytes` must be set).
#[no_mangle]
pub extern "C" fn ws_expert_cache_options_default() -> ws_expert_cache_options {
    ws_expert_cache_options {
        struct_size: std::mem::size_of::<ws_expert_cache_options>() as u32,
        policy: WS_CACHE_LRU,
        capacity_experts: 0,
        budget_bytes: 0,
    }
}

/// An expert cache over `model`'s routed experts, with an engine of its
/// own (`engine_options`, NULL: defaults): whole experts in registered
/// slot memory, misses read O_DIRECT in place on every drive and mirror.
///
/// Thread safety: any number of threads may get, release, prefetch and
/// take stats at once.
///
/// # Safety
/// `options` points to a `ws_expert_cache_options`; `engine_options` is
/// NULL or a `ws_engine_options` whose strings are NULL or NUL-terminated;
/// `out` is valid for a write.
#[no_mangle]
pub unsafe extern "C" fn ws_expert_cache_create(
    model: ws_model,
    options: *const ws_expert_cache_options,
    engine_options: *const ws_engine_options,
    out: *mut ws_expert_cache,
) -> ws_status {
    guard("ws_expert_cache_create", || {
        if out.is_null() {
            return Err(null("out"));
        }
        // SAFETY: a ws_expert_cache_options (the contract).
        let o = unsafe { self::options(options, "options", "ws_expert_cache_options_default()") }?
            .ok_or_else(|| null("options"))?;
        let capacity = match (o.capacity_experts, o.budget_bytes) {
            (0, 0) | (1.., 1..) => {
                return Err(invalid(format!(
                    "options: capacity_experts {} and budget_bytes {}: set exactly one",
                    o.capacity_experts, o.budget_bytes
                )))
            }
            (n, 0) => Capacity::Experts(usize::try_from(n).map_err(|_| invalid("options.capacity_experts too large"))?),
            (0, b) => Capacity::Bytes(b),
        };
        let policy = match o.policy {
            WS_CACHE_LRU => Policy::Lru,
            WS_CACHE_LFU => Policy::LfuAging,
            p => return Err(invalid(format!("options.policy {p} (WS_CACHE_LRU 0, WS_CACHE_LFU 1)"))),
        };
        // SAFETY: the contract above.
        let engine = unsafe { engine_config(engine_options) }?;
        let m = ModelObj::get(model)?;
        let cache = ExpertCache::new(&m.model, CacheConfig::new(capacity).policy(policy).engine(engine))?;
        // SAFETY: checked non-NULL; valid for a write (the contract).
        unsafe {
            out.write(ws_expert_cache {
                id: CACHES.insert(cache),
            })
        };
        Ok(ws_status::WS_OK)
    })
}

fn u(v: u32) -> usize {
    v as usize
}

/// Hands out `h`: a handle number, and up to `cap` parts written to `parts`.
///
/// # Safety
/// `parts` is NULL (then `cap` must be 0) or valid for `cap` writes;
/// `n_parts` is NULL or valid for a write.
unsafe fn hand_out(
    h: ExpertHandle,
    parts: *mut ws_expert_part,
    cap: usize,
    n_parts: *mut usize,
    out: *mut ws_expert,
) -> Res<()> {
    let names = h
        .parts()
        .map(|(p, q, l)| (cstring(p), cstring(q), cstring(l.name())))
        .collect();
    let obj = ExpertObj { handle: h, names };
    // SAFETY: the contract above.
    unsafe { write_parts(&obj, parts, cap, n_parts) }?;
    let id = EXPERTS.insert(obj);
    // SAFETY: checked non-NULL by the callers; valid for a write (the contract).
    unsafe { out.write(ws_expert { id }) };
    Ok(())
}

/// # Safety
/// As [`hand_out`].
unsafe fn write_parts(obj: &ExpertObj, parts: *mut ws_expert_part, cap: usize, n_parts: *mut usize) -> Res<()> {
    if parts.is_null() && cap != 0 {
        return Err(null("parts (with cap > 0)"));
    }
    let n = obj.handle.part_count();
    for (i, ((_, _, l), (p, q, t))) in obj.handle.parts().zip(&obj.names).enumerate().take(cap) {
        let part = ws_expert_part {
            projection: p.as_ptr(),
            part: q.as_ptr(),
            tensor: t.as_ptr(),
            data: l.as_ptr(),
            bytes: l.len() as u64,
        };
        // SAFETY: i < cap, and `parts` has cap slots (the contract).
        unsafe { parts.add(i).write(part) };
    }
    if !n_parts.is_null() {
        // SAFETY: non-NULL, valid for a write (the contract).
        unsafe { n_parts.write(n) };
    }
    Ok(())
}

/// Expert `expert` of layer `layer`, pinned until `ws_expert_release`:
/// at once when cached, else after its read (concurrent gets of one
/// expert wait for the same read). Up to `cap` parts (projection, part,
/// tensor name, pointer, length) are written to `parts`; `*n_parts` says
/// how many the expert has (call `ws_expert_parts` for more).
///
/// Errors: `WS_ERR_FORMAT` no such layer or expert; `WS_ERR_BUSY` every
/// entry pinned or in flight (release one); `WS_ERR_READ` the read failed
/// on every copy (nothing cached).
///
/// # Safety
/// `parts` is NULL (with `cap` 0) or valid for `cap` writes; `n_parts` is
/// NULL or valid for a write; `out` is valid for a write.
#[no_mangle]
pub unsafe extern "C" fn ws_expert_cache_get(
    cache: ws_expert_cache,
    layer: u32,
    expert: u32,
    out: *mut ws_expert,
    parts: *mut ws_expert_part,
    cap: usize,
    n_parts: *mut usize,
) -> ws_status {
    guard("ws_expert_cache_get", || {
        if out.is_null() {
            return Err(null("out"));
        }
        let c = CACHES.get(cache.id)?;
        let h = c.get(u(layer), u(expert))?;
        // SAFETY: the contract above.
        unsafe { hand_out(h, parts, cap, n_parts, out) }?;
        Ok(ws_status::WS_OK)
    })
}

/// Layer `layer`'s `n` experts (its top-k): every miss started at once,
/// then each waited for; `out[i]` pinned until released. Parts with
/// `ws_expert_parts`. On an error no handle is written (the reads
/// started go on; their entries stay for later gets).
///
/// # Safety
/// `experts` is valid for `n` reads and `out` for `n` writes.
#[no_mangle]
pub unsafe extern "C" fn ws_expert_cache_get_many(
    cache: ws_expert_cache,
    layer: u32,
    experts: *const u32,
    n: usize,
    out: *mut ws_expert,
) -> ws_status {
    guard("ws_expert_cache_get_many", || {
        if n > MAX_BATCH {
            return Err(invalid(format!("n {n}: at most {MAX_BATCH}")));
        }
        if n > 0 && (experts.is_null() || out.is_null()) {
            return Err(null(if experts.is_null() { "experts" } else { "out" }));
        }
        let c = CACHES.get(cache.id)?;
        let list: Vec<usize> = if n == 0 {
            Vec::new()
        } else {
            // SAFETY: non-NULL, n readable (the contract).
            unsafe { std::slice::from_raw_parts(experts, n) }
                .iter()
                .map(|&e| u(e))
                .collect()
        };
        let handles = c.get_many(u(layer), &list)?;
        for (i, h) in handles.into_iter().enumerate() {
            // SAFETY: i < n, `out` valid for n writes (the contract).
            unsafe { hand_out(h, std::ptr::null_mut(), 0, std::ptr::null_mut(), out.add(i)) }?;
        }
        Ok(ws_status::WS_OK)
    })
}

/// Up to `cap` parts of a handed-out expert, and how many it has.
///
/// # Safety
/// As `ws_expert_cache_get`'s `parts`, `cap` and `n_parts`.
#[no_mangle]
pub unsafe extern "C" fn ws_expert_parts(
    expert: ws_expert,
    parts: *mut ws_expert_part,
    cap: usize,
    n_parts: *mut usize,
) -> ws_status {
    guard("ws_expert_parts", || {
        let obj = EXPERTS.get(expert.id)?;
        // SAFETY: the contract above.
        unsafe { write_parts(&obj, parts, cap, n_parts) }?;
        Ok(ws_status::WS_OK)
    })
}

/// Unpins an expert: its parts' pointers are not to be used after this.
/// A second release is `WS_ERR_HANDLE`.
#[no_mangle]
pub extern "C" fn ws_expert_release(expert: ws_expert) -> ws_status {
    guard("ws_expert_release", || {
        EXPERTS.remove(expert.id)?;
        Ok(ws_status::WS_OK)
    })
}

/// Starts background reads of the listed experts not cached; never waits
/// and never evicts a pinned entry: when no entry can make room it stops
/// and counts the rest as refused in `report` (NULL: not reported).
///
/// # Safety
/// `keys` is valid for `n` reads; `report` is NULL or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn ws_expert_cache_prefetch(
    cache: ws_expert_cache,
    keys: *const ws_expert_key,
    n: usize,
    report: *mut ws_prefetch_report,
) -> ws_status {
    guard("ws_expert_cache_prefetch", || {
        if n > MAX_BATCH {
            return Err(invalid(format!("n {n}: at most {MAX_BATCH}")));
        }
        if n > 0 && keys.is_null() {
            return Err(null("keys"));
        }
        let c = CACHES.get(cache.id)?;
        let list: Vec<(usize, usize)> = if n == 0 {
            Vec::new()
        } else {
            // SAFETY: non-NULL, n readable (the contract).
            unsafe { std::slice::from_raw_parts(keys, n) }
                .iter()
                .map(|k| (u(k.layer), u(k.expert)))
                .collect()
        };
        let r = c.prefetch(&list)?;
        if !report.is_null() {
            let v = ws_prefetch_report {
                started: r.started as u64,
                present: r.present as u64,
                refused: r.refused as u64,
            };
            // SAFETY: non-NULL, valid for a write (the contract).
            unsafe { report.write(v) };
        }
        Ok(ws_status::WS_OK)
    })
}

/// The cache's counters.
///
/// # Safety
/// `out` is valid for a write.
#[no_mangle]
pub unsafe extern "C" fn ws_expert_cache_stats(cache: ws_expert_cache, out: *mut ws_cache_stats) -> ws_status {
    guard("ws_expert_cache_stats", || {
        let c = CACHES.get(cache.id)?;
        let s = c.stats();
        let v = ws_cache_stats {
            capacity: s.capacity as u64,
            entry_bytes: s.entry_bytes,
            entries: s.entries as u64,
            pinned: s.pinned as u64,
            hits: s.hits,
            misses: s.misses,
            prefetched: s.prefetched,
            prefetch_used: s.prefetch_used,
            prefetch_wasted: s.prefetch_wasted,
            prefetch_wasted_bytes: s.prefetch_wasted_bytes,
            prefetch_refused: s.prefetch_refused,
            evictions: s.evictions,
            failed_reads: s.failed_reads,
            bytes_read: s.bytes_read,
            wait_seconds: s.wait_seconds,
        };
        // SAFETY: the contract above.
        unsafe { put(out, "out", v) }?;
        Ok(ws_status::WS_OK)
    })
}

/// The cache's counters as JSON (with the bytes read per drive), to be
/// freed with `ws_string_free`.
///
/// # Safety
/// `json` is valid for a write.
#[no_mangle]
pub unsafe extern "C" fn ws_expert_cache_stats_json(cache: ws_expert_cache, json: *mut *mut c_char) -> ws_status {
    guard("ws_expert_cache_stats_json", || {
        if json.is_null() {
            return Err(null("json"));
        }
        let c = CACHES.get(cache.id)?;
        let s = serde_json::to_string(&c.stats()).map_err(|e| Fail::new(ws_status::WS_ERR_CONFIG, e.to_string()))?;
        let p = malloc_string(&s)?;
        // SAFETY: non-NULL, valid for a write (the contract).
        unsafe { json.write(p) };
        Ok(ws_status::WS_OK)
    })
}

/// Destroys the cache: its engine stops once the calls running on it
/// return (reads in flight finish into their slots first). Experts still
/// held stay valid until released. A second destroy is `WS_ERR_HANDLE`.
#[no_mangle]
pub extern "C" fn ws_expert_cache_destroy(cache: ws_expert_cache) -> ws_status {
    guard("ws_expert_cache_destroy", || {
        CACHES.remove(cache.id)?;
        Ok(ws_status::WS_OK)
    })
}
