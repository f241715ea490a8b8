//! Payloads handed to Python, without a copy, through DLPack.
//!
//! A [`Payload`] owns the memory a read landed in (its `Loaded`, which keeps
//! the slot, so the engine never reuses it while the payload lives).
//! `__dlpack__` exports it as a one-dimensional `uint8` tensor. The
//! capsule's `DLManagedTensor` holds an `Arc` of that memory, released by
//! the consumer's deleter (numpy and torch call it when their array or
//! tensor dies, on whatever thread). That deleter is plain Rust: it touches
//! no Python object and needs no GIL. The Python layer views the bytes as
//! the tensor's dtype and shape (`weightstream/_convert.py`).
//!
//! Only the DLPack structs (v0.8, the `"dltensor"` capsule every consumer
//! takes) and the capsule calls are unsafe here: the C ABI, in the limited
//! API (abi3), that CPython 3.9 and later provide.

use std::ffi::{c_void, CStr};
use std::sync::Arc;

use pyo3::ffi;
use pyo3::prelude::*;

/// The bytes of one payload: a read's `Loaded`, or nothing (an empty
/// tensor).
pub(crate) enum Bytes {
    Loaded(ws::Loaded),
    /// Part `i` of a cached expert: the handle pins the cache entry (never
    /// evicted nor overwritten) for as long as the payload lives.
    Expert(ws::ExpertHandle, usize),
    /// A copy in memory of its own (the allocator's, which a forked child
    /// inherits as any heap memory): for a payload the kernel would not
    /// hand to children (`Bytes::for_children`).
    Copied(Copied),
    Empty,
}

/// Page-aligned heap bytes this payload owns.
pub(crate) struct Copied {
    ptr: std::ptr::NonNull<u8>,
    layout: std::alloc::Layout,
}

// SAFETY: plain heap memory owned by this value alone, written once when
// made and only read after.
unsafe impl Send for Copied {}
// SAFETY: as above: shared references only read.
unsafe impl Sync for Copied {}

impl Drop for Copied {
    fn drop(&mut self) {
        // SAFETY: allocated in `Bytes::copy_of` with this layout, freed once.
        unsafe { std::alloc::dealloc(self.ptr.as_ptr(), self.layout) }
    }
}

/// Payloads copied because the kernel refused to hand their pages to
/// forked children, and their bytes (said once per process by
/// [`warn_fork_copies`]).
static FORK_COPIES: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
static FORK_COPY_BYTES: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
static FORK_COPIES_SAID: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

impl Bytes {
    /// A landed read's bytes as memory a forked child can read (what every
    /// tensor handed to Python must be): its pages handed to children
    /// (`Loaded::inherit_on_fork`), or, where that is refused (the kernel,
    /// or a page shared with bytes still in use), copied once into memory
    /// of its own, counted and said once ([`warn_fork_copies`]).
    pub(crate) fn for_children(mut loaded: ws::Loaded) -> Bytes {
        if loaded.bytes().is_empty() {
            return Bytes::Empty;
        }
        match loaded.inherit_on_fork() {
            Ok(()) => Bytes::Loaded(loaded),
            Err(_) => {
                use std::sync::atomic::Ordering::Relaxed;
                FORK_COPIES.fetch_add(1, Relaxed);
                FORK_COPY_BYTES.fetch_add(loaded.bytes().len() as u64, Relaxed);
                Bytes::copy_of(loaded.bytes())
            }
        }
    }

    /// `src` copied into page-aligned heap memory of its own.
    fn copy_of(src: &[u8]) -> Bytes {
        let Ok(layout) = std::alloc::Layout::from_size_align(src.len().max(1), 4096) else {
            return Bytes::Empty;
        };
        // SAFETY: a non-zero size (at least 1) with a valid layout.
        let ptr = unsafe { std::alloc::alloc(layout) };
        let Some(ptr) = std::ptr::NonNull::new(ptr) else {
            std::alloc::handle_alloc_error(layout)
        };
        // SAFETY: `ptr` is `src.len()` fresh bytes, disjoint from `src`.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), ptr.as_ptr(), src.len()) };
        Bytes::Copied(Copied { ptr, layout })
    }

    fn ptr_len(&self) -> (*mut u8, usize) {
        match self {
            Bytes::Copied(c) => (c.ptr.as_ptr(), c.layout.size()),
            Bytes::Loaded(l) => {
                let b = l.bytes();
                (b.as_ptr().cast_mut(), b.len())
            }
            Bytes::Expert(h, i) => match h.part_at(*i) {
                Some(l) if !l.is_empty() => (l.as_ptr().cast_mut(), l.len()),
                // No bytes: the same non-NULL pointer as an empty tensor.
                _ => (std::ptr::NonNull::<u64>::dangling().as_ptr().cast(), 0),
            },
            // DLPack consumers want a non-NULL pointer even for no bytes.
            Bytes::Empty => (std::ptr::NonNull::<u64>::dangling().as_ptr().cast(), 0),
        }
    }
}

/// Says once per process (a `ResourceWarning`) that payloads were copied
/// for forked children, how many and how many bytes; nothing when none was.
pub(crate) fn warn_fork_copies(py: Python<'_>) -> PyResult<()> {
    use std::sync::atomic::Ordering::Relaxed;
    let n = FORK_COPIES.load(Relaxed);
    if n == 0 || FORK_COPIES_SAID.swap(true, Relaxed) {
        return Ok(());
    }
    let msg = format!(
        "weightstream: {n} tensor(s), {} bytes, were copied into memory of their own because their pages could not \
         be handed to forked children (the engine's stats count the refusals: arena_inherit_failures); said once",
        FORK_COPY_BYTES.load(Relaxed)
    );
    PyErr::warn(
        py,
        &py.get_type::<pyo3::exceptions::PyResourceWarning>(),
        &std::ffi::CString::new(msg).unwrap_or_default(),
        1,
    )
}

/// One payload in memory that nothing else reuses while Python holds it.
#[pyclass(module = "weightstream._native", frozen)]
pub(crate) struct Payload {
    pub(crate) bytes: Arc<Bytes>,
}

#[repr(C)]
struct DLDevice {
    device_type: i32,
    device_id: i32,
}

#[repr(C)]
struct DLDataType {
    code: u8,
    bits: u8,
    lanes: u16,
}

#[repr(C)]
struct DLTensor {
    data: *mut c_void,
    device: DLDevice,
    ndim: i32,
    dtype: DLDataType,
    shape: *mut i64,
    strides: *mut i64,
    byte_offset: u64,
}

#[repr(C)]
struct DLManagedTensor {
    dl_tensor: DLTensor,
    manager_ctx: *mut c_void,
    deleter: Option<unsafe extern "C" fn(*mut DLManagedTensor)>,
}

#[repr(C)]
struct DLPackVersion {
    major: u32,
    minor: u32,
}

/// DLPack 1.0's tensor: versioned, with flags (none set here: writable,
/// not a copy), so consumers such as numpy hand out writable arrays.
#[repr(C)]
struct DLManagedTensorVersioned {
    version: DLPackVersion,
    manager_ctx: *mut c_void,
    deleter: Option<unsafe extern "C" fn(*mut DLManagedTensorVersioned)>,
    flags: u64,
    dl_tensor: DLTensor,
}

/// What a capsule's tensor keeps alive: the bytes, and the shape array the
/// tensor points into.
struct Ctx {
    _bytes: Arc<Bytes>,
    shape: [i64; 1],
}

const DLTENSOR: &CStr = c"dltensor";
const DLTENSOR_VERSIONED: &CStr = c"dltensor_versioned";
const KDL_CPU: i32 = 1;
const KDL_UINT: u8 = 1;
/// DLPack 1.0: the consumer must not write the tensor.
const DLPACK_FLAG_BITMASK_READ_ONLY: u64 = 1;

/// The consumer's (or the unconsumed capsule's) release of a tensor.
///
/// # Safety
/// `p` is a `DLManagedTensor` made by [`Payload::__dlpack__`], released once.
unsafe extern "C" fn deleter(p: *mut DLManagedTensor) {
    if p.is_null() {
        return;
    }
    // SAFETY: made by Box::into_raw in __dlpack__, released once (DLPack's
    // rule: the deleter is called exactly once, by the owner).
    let m = unsafe { Box::from_raw(p) };
    // SAFETY: the context was made by Box::into_raw with it, released with it.
    drop(unsafe { Box::from_raw(m.manager_ctx.cast::<Ctx>()) });
}

/// [`deleter`] for a versioned tensor.
///
/// # Safety
/// `p` is a `DLManagedTensorVersioned` made by [`Payload::__dlpack__`],
/// released once.
unsafe extern "C" fn deleter_versioned(p: *mut DLManagedTensorVersioned) {
    if p.is_null() {
        return;
    }
    // SAFETY: made by Box::into_raw in __dlpack__, released once.
    let m = unsafe { Box::from_raw(p) };
    // SAFETY: the context was made by Box::into_raw with it, released with it.
    drop(unsafe { Box::from_raw(m.manager_ctx.cast::<Ctx>()) });
}

/// [`capsule_destructor`] for a versioned capsule.
///
/// # Safety
/// Called by CPython with the capsule being destroyed.
unsafe extern "C" fn capsule_destructor_versioned(capsule: *mut ffi::PyObject) {
    // SAFETY: as capsule_destructor, with the versioned name.
    if unsafe { ffi::PyCapsule_IsValid(capsule, DLTENSOR_VERSIONED.as_ptr()) } == 1 {
        // SAFETY: valid with this name, so its pointer is our tensor.
        let p = unsafe { ffi::PyCapsule_GetPointer(capsule, DLTENSOR_VERSIONED.as_ptr()) }
            .cast::<DLManagedTensorVersioned>();
        // SAFETY: our tensor, not consumed, released here once.
        unsafe { deleter_versioned(p) };
    }
}

/// A capsule that dies unconsumed (its name still `"dltensor"`) releases
/// its tensor; a consumed one was renamed `"used_dltensor"` and belongs to
/// the consumer.
///
/// # Safety
/// Called by CPython with the capsule being destroyed.
unsafe extern "C" fn capsule_destructor(capsule: *mut ffi::PyObject) {
    // SAFETY: `capsule` is a live capsule (CPython's call); IsValid neither
    // fails nor sets an error for a mere name mismatch.
    if unsafe { ffi::PyCapsule_IsValid(capsule, DLTENSOR.as_ptr()) } == 1 {
        // SAFETY: valid with this name, so its pointer is our tensor.
        let p = unsafe { ffi::PyCapsule_GetPointer(capsule, DLTENSOR.as_ptr()) }.cast::<DLManagedTensor>();
        // SAFETY: our tensor, not consumed, released here once.
        unsafe { deleter(p) };
    }
}

#[pymethods]
impl Payload {
    /// The payload's bytes.
    #[getter]
    fn nbytes(&self) -> usize {
        self.bytes.ptr_len().1
    }

    /// `(kDLCPU, 0)`: host memory.
    fn __dlpack_device__(&self) -> (i32, i32) {
        (KDL_CPU, 0)
    }

    /// A capsule of the bytes as a one-dimensional `uint8` tensor on the
    /// CPU: `"dltensor_versioned"` (DLPack 1.0, writable) when the caller
    /// asks for `max_version` 1.0 or later, else `"dltensor"`. Other
    /// keywords (stream, dl_device, copy) need nothing: host memory, no copy.
    #[pyo3(signature = (**kwargs))]
    fn __dlpack__<'py>(
        &self,
        py: Python<'py>,
        kwargs: Option<&Bound<'py, pyo3::types::PyDict>>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let versioned = match kwargs.map(|k| k.get_item("max_version")).transpose()?.flatten() {
            Some(v) if !v.is_none() => v.extract::<(u32, u32)>()?.0 >= 1,
            _ => false,
        };
        let (data, len) = self.bytes.ptr_len();
        let len = i64::try_from(len).map_err(|_| pyo3::exceptions::PyOverflowError::new_err("payload too large"))?;
        let ctx = Box::into_raw(Box::new(Ctx {
            _bytes: Arc::clone(&self.bytes),
            shape: [len],
        }));
        let tensor = DLTensor {
            data: data.cast(),
            device: DLDevice {
                device_type: KDL_CPU,
                device_id: 0,
            },
            ndim: 1,
            dtype: DLDataType {
                code: KDL_UINT,
                bits: 8,
                lanes: 1,
            },
            // SAFETY: `ctx` is live (just made); its shape lives as long as
            // the tensor, which owns it.
            shape: unsafe { (*ctx).shape.as_mut_ptr() },
            strides: std::ptr::null_mut(),
            byte_offset: 0,
        };
        let cap = if versioned {
            let managed = Box::into_raw(Box::new(DLManagedTensorVersioned {
                version: DLPackVersion { major: 1, minor: 0 },
                manager_ctx: ctx.cast(),
                deleter: Some(deleter_versioned),
                // A cached expert is shared by every get of it (and the
                // cache's next reads of it): a consumer that honours the
                // flag (numpy) hands out a read-only array.
                flags: if matches!(*self.bytes, Bytes::Expert(..)) {
                    DLPACK_FLAG_BITMASK_READ_ONLY
                } else {
                    0
                },
                dl_tensor: tensor,
            }));
            // SAFETY: a valid pointer and static name, and a destructor that
            // releases the tensor only while unconsumed.
            let cap = unsafe {
                ffi::PyCapsule_New(
                    managed.cast(),
                    DLTENSOR_VERSIONED.as_ptr(),
                    Some(capsule_destructor_versioned),
                )
            };
            if cap.is_null() {
                // SAFETY: the capsule was not made: the tensor is still ours.
                unsafe { deleter_versioned(managed) };
            }
            cap
        } else {
            let managed = Box::into_raw(Box::new(DLManagedTensor {
                dl_tensor: tensor,
                manager_ctx: ctx.cast(),
                deleter: Some(deleter),
            }));
            // SAFETY: a valid pointer and static name, and a destructor that
            // releases the tensor only while unconsumed.
            let cap = unsafe { ffi::PyCapsule_New(managed.cast(), DLTENSOR.as_ptr(), Some(capsule_destructor)) };
            if cap.is_null() {
                // SAFETY: the capsule was not made: the tensor is still ours.
                unsafe { deleter(managed) };
            }
            cap
        };
        if cap.is_null() {
            return Err(PyErr::fetch(py));
        }
        // SAFETY: a new reference, owned from here.
        Ok(unsafe { Bound::from_owned_ptr(py, cap) })
    }
}
