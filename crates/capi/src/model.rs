//! Models: open (options or the environment), tensors, verify, close.

use std::ffi::{c_char, c_int, CString};
use std::sync::{Arc, LazyLock};

use ws::{Model, ModelConfig};

use crate::handles::Table;
use crate::status::{guard, ws_status, Fail, Res};
use crate::types::{ws_model, ws_model_options, ws_tensor_info};
use crate::util::{malloc_string, null, opt_str, options, parse, put};

pub(crate) struct ModelObj {
    pub(crate) model: Model,
    names: Vec<CString>,
    dtypes: Vec<CString>,
    shapes: Vec<Vec<u64>>,
}

pub(crate) static MODELS: LazyLock<Table<ModelObj>> = LazyLock::new(|| Table::new("model"));

impl ModelObj {
    pub(crate) fn get(model: ws_model) -> Res<Arc<ModelObj>> {
        MODELS.get(model.id)
    }

    /// Tensor `index`, or `WS_ERR_NOT_FOUND` naming the count.
    pub(crate) fn tensor(&self, index: usize) -> Res<&ws::TensorRef> {
        self.model.catalog().tensors().get(index).ok_or_else(|| {
            Fail::new(
                ws_status::WS_ERR_NOT_FOUND,
                format!("tensor index {index}: the model has {}", self.names.len()),
            )
        })
    }

    fn info(&self, index: usize) -> Res<ws_tensor_info> {
        let t = self.tensor(index)?;
        Ok(ws_tensor_info {
            index,
            name: self.names[index].as_ptr(),
            dtype: self.dtypes[index].as_ptr(),
            shape: self.shapes[index].as_ptr(),
            ndim: self.shapes[index].len() as u32,
            bytes: t.len,
            shard: t.shard as u32,
            file_offset: t.offset,
        })
    }
}

fn open_model(config: ModelConfig) -> Res<ws_model> {
    let model = Model::open(config)?;
    let t = model.catalog().tensors();
    // A name cannot hold a NUL (the header parser refuses it); shown as an
    // escape if one ever did, never cut short.
    let cstring = |s: &str| CString::new(s.replace('\0', "\\0")).unwrap_or_default();
    let obj = ModelObj {
        names: t.iter().map(|t| cstring(&t.name)).collect(),
        dtypes: t.iter().map(|t| cstring(t.dtype.name())).collect(),
        shapes: t.iter().map(|t| t.shape.iter().map(|&d| d as u64).collect()).collect(),
        model,
    };
    Ok(ws_model { id: MODELS.insert(obj) })
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

/// Opens the model at `dir`: its folder (`model.safetensors.index.json` or
/// `*.safetensors`), that folder's `model.safetensors.index.json`, or one
/// `.safetensors` file on its own; with the layout in `options` (NULL:
/// defaults; relative `dirs` and `mirrors` are taken against the working
/// directory). Reads and checks every shard's header; the files stay open
/// until `ws_model_close`.
///
/// Thread safety: any thread; a model is shared by every engine made from
/// it and may be used from many threads at once.
///
/// # Safety
/// `dir` is a NUL-terminated path; `options` is NULL or a
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
        if out.is_null() {
            return Err(null("out"));
        }
        let mut config = ModelConfig::path(dir)?;
        // SAFETY: NULL or a ws_model_options (the contract).
        if let Some(o) = unsafe { self::options(options, "options", "ws_model_options_default()") }? {
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
        // SAFETY: checked non-NULL; valid for a write (the contract).
        unsafe { out.write(m) };
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
        if out.is_null() {
            return Err(null("out"));
        }
        // SAFETY: the caller's contract above.
        let config = match unsafe { opt_str(dir, "dir") }? {
            Some(d) => ModelConfig::new(d).settings(|k| std::env::var(k).ok())?,
            None => ModelConfig::from_env()?,
        };
        let m = open_model(config)?;
        // SAFETY: checked non-NULL; valid for a write (the contract).
        unsafe { out.write(m) };
        Ok(ws_status::WS_OK)
    })
}

/// Closes a model. Engines made from it keep what they need and stay
/// usable; `ws_tensor_info` pointers from it stay valid while such an
/// engine is open, and not after. A second close is `WS_ERR_HANDLE`.
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
        let m = ModelObj::get(model)?;
        // SAFETY: the contract above.
        unsafe { put(count, "count", m.names.len()) }?;
        Ok(ws_status::WS_OK)
    })
}

/// Tensor `index` (0 to count - 1, name order).
///
/// # Safety
/// `out` is valid for a write.
#[no_mangle]
pub unsafe extern "C" fn ws_model_tensor(model: ws_model, index: usize, out: *mut ws_tensor_info) -> ws_status {
    guard("ws_model_tensor", || {
        let m = ModelObj::get(model)?;
        let i = m.info(index)?;
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
        let m = ModelObj::get(model)?;
        // SAFETY: the contract above.
        let name = unsafe { opt_str(name, "name") }?.ok_or_else(|| null("name"))?;
        let t = m.model.tensor(name)?;
        let i = m.info(t.index)?;
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
        let m = ModelObj::get(model)?;
        if clean.is_null() {
            return Err(null("clean"));
        }
        let r = m.model.verify(digest != 0)?;
        if !json.is_null() {
            let s = serde_json::to_string(&r).map_err(|e| Fail::new(ws_status::WS_ERR_CONFIG, e.to_string()))?;
            let p = malloc_string(&s)?;
            // SAFETY: non-NULL and valid for a write (the contract).
            unsafe { json.write(p) };
        }
        // SAFETY: checked non-NULL; valid for a write (the contract).
        unsafe { clean.write(c_int::from(r.is_clean())) };
        Ok(ws_status::WS_OK)
    })
}
