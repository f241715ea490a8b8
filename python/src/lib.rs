//! `weightstream._native`: the Rust side of the `weightstream` Python
//! package (the package itself, `weightstream/`, is the Python API).
//!
//! - [`Reader`]: one file or a model directory, opened with an engine: its
//!   tensors' names, dtypes, shapes and metadata, and reads of a tensor,
//!   a byte range or rows of it into fresh memory of its own.
//! - [`load`]: a whole-model load (`Engine::load_all`), every tensor in one
//!   mapping, each an owned payload.
//! - [`dlpack::Payload`]: what both return: memory no read writes any more
//!   and the engine never reuses while Python holds it, exported through
//!   DLPack without a copy.
//!
//! Every read and every wait runs with the GIL released. A load runs on a
//! thread of its own while the caller's thread checks for signals, so
//! Ctrl-C raises `KeyboardInterrupt` within 50 ms; the abandoned load then
//! finishes into memory Python never sees, and frees it.

use std::sync::Arc;
use std::time::Duration;

use pyo3::create_exception;
use pyo3::exceptions::{PyException, PyFileNotFoundError, PyOSError, PyValueError};
use pyo3::prelude::*;

mod dlpack;

use dlpack::{Bytes, Payload};

/// One tensor handed to Python: `(name, dtype, shape, payload)`.
type Item = (String, String, Vec<usize>, Payload);

/// `Reader._fill`'s targets: `(name, bounds, (start, end), address, nbytes)`.
type FillTargets = Vec<(String, Option<Vec<(usize, usize)>>, Option<(u64, u64)>, usize, usize)>;

create_exception!(
    _native,
    SafetensorError,
    PyException,
    "A file refused (its header, its index, a missing tensor): as safetensors' own SafetensorError."
);

/// The class raised as `SafetensorError`: the package's
/// (`weightstream.SafetensorError`, which is safetensors' own class when
/// safetensors is installed, so that code catching safetensors' errors
/// catches these), set once at import; this module's own until then.
static ERROR_TYPE: pyo3::sync::PyOnceLock<Py<pyo3::types::PyType>> = pyo3::sync::PyOnceLock::new();

/// A `SafetensorError` (see [`ERROR_TYPE`]) with `msg`.
fn safetensor_error(msg: impl Into<String>) -> PyErr {
    let msg: String = msg.into();
    Python::attach(|py| match ERROR_TYPE.get(py) {
        Some(t) => PyErr::from_type(t.bind(py).clone(), msg),
        None => SafetensorError::new_err(msg),
    })
}

/// Sets the class raised as `SafetensorError` (the package does, at
/// import); a second call is refused.
#[pyfunction]
fn _set_error_type(py: Python<'_>, cls: Bound<'_, pyo3::types::PyType>) -> PyResult<()> {
    if !cls.is_subclass_of::<PyException>()? {
        return Err(PyValueError::new_err("the error type must be an Exception subclass"));
    }
    ERROR_TYPE
        .set(py, cls.unbind())
        .map_err(|_| PyValueError::new_err("the error type is already set"))
}

/// A library error as the Python exception a safetensors caller expects:
/// a missing file is `FileNotFoundError`, another I/O error `OSError`, a
/// refused header, index or missing tensor `SafetensorError`, a bad setting
/// `ValueError`. The message is the library's: file, operation, cause.
///
/// A fill that failed part way (`Error::Incomplete`) is raised as its
/// cause is, with the whole message (how many destinations are complete).
fn to_py(e: ws::Error) -> PyErr {
    let msg = e.to_string();
    let cause = match &e {
        ws::Error::Incomplete { source, .. } => source.as_ref(),
        e => e,
    };
    match cause {
        ws::Error::Io { source, .. } if source.kind() == std::io::ErrorKind::NotFound => {
            PyFileNotFoundError::new_err(msg)
        }
        ws::Error::Io { .. } => PyOSError::new_err(msg),
        ws::Error::NoSuchTensor { name, .. } => {
            safetensor_error(format!("File does not contain tensor {name} ({msg})"))
        }
        ws::Error::Config(_) => PyValueError::new_err(msg),
        ws::Error::Cache(ws::CacheError::Full { .. }) => pyo3::exceptions::PyRuntimeError::new_err(msg),
        ws::Error::Cache(ws::CacheError::ReadFailed { .. }) => PyOSError::new_err(msg),
        ws::Error::Cache(ws::CacheError::Config(_)) => PyValueError::new_err(msg),
        // An expert or a layer out of range is an index error, as a
        // sequence's; one that exists but is not there (a dense layer, a
        // projection the expert lacks, a model without experts) is a value
        // error: neither is a problem of the file.
        ws::Error::Experts(ws::ExpertsError::LayerOutOfRange { .. } | ws::ExpertsError::NoSuchExpert { .. }) => {
            pyo3::exceptions::PyIndexError::new_err(msg)
        }
        ws::Error::Experts(_) => PyValueError::new_err(msg),
        _ => safetensor_error(msg),
    }
}

fn layout(
    path: &str,
    dirs: Option<Vec<String>>,
    mirrors: Option<Vec<String>>,
    route: Option<&str>,
    direct: Option<&str>,
) -> PyResult<ws::ModelConfig> {
    layout_with(path, (dirs, mirrors, route, direct), false)
}

/// The layout arguments: split dirs, mirrors, route, direct.
type LayoutArgs<'a> = (
    Option<Vec<String>>,
    Option<Vec<String>>,
    Option<&'a str>,
    Option<&'a str>,
);

/// [`layout`], with the `WEIGHTSTREAM_*` layout variables applied first
/// when `env` (`WEIGHTSTREAM_MODEL_DIRS`, `_MIRROR`, `_DISK_WEIGHTS`,
/// `_ROUTE`, `_DIRECT`, as the command and `ModelConfig::from_env` read
/// them); the arguments given override them.
fn layout_with(path: &str, (dirs, mirrors, route, direct): LayoutArgs<'_>, env: bool) -> PyResult<ws::ModelConfig> {
    let p = std::path::Path::new(path);
    if !p.exists() {
        // As safetensors says it, before anything else is looked at.
        return Err(PyFileNotFoundError::new_err(format!(
            "No such file or directory: {path}"
        )));
    }
    let mut c = ws::ModelConfig::path(p).map_err(to_py)?;
    if env {
        c = c.settings(|k| std::env::var(k).ok()).map_err(to_py)?;
    }
    if let Some(d) = dirs {
        c = c.dirs(d);
    }
    if let Some(m) = mirrors {
        c = c.mirrors(m);
    }
    if let Some(r) = route {
        c = c.route(r.parse().map_err(to_py)?);
    }
    if let Some(d) = direct {
        c = c.direct(d.parse().map_err(to_py)?);
    }
    Ok(c)
}

/// Opens the model and its engine (the `WEIGHTSTREAM_*` settings), with
/// the GIL released.
fn open(py: Python<'_>, config: ws::ModelConfig) -> PyResult<(ws::Model, ws::Engine)> {
    py.detach(|| -> ws::Result<_> {
        let model = ws::Model::open(config)?;
        let engine = ws::Engine::new(&model, ws::EngineConfig::from_env()?)?;
        Ok((model, engine))
    })
    .map_err(to_py)
}

/// A file or a model, open, with an engine: what `safe_open` wraps.
///
/// Any number of threads use one reader at once (transformers reads a
/// checkpoint from a thread pool over one `safe_open`): the class is
/// frozen (no borrow flag to trip over), and no lock of it is ever held
/// across a release of the GIL, so a thread that waits for one with the
/// GIL held never waits for a thread that needs the GIL to let it go.
///
/// Fields drop in order: the read-ahead's tickets first, then the arena
/// handle, then the engine.
#[pyclass(module = "weightstream._native", frozen)]
struct Reader {
    /// Read-ahead of whole tensors in file order (what a loop of
    /// `get_tensor` over the keys asks for next), into the shared arena.
    /// Locked only with the GIL released, never across a wait.
    ahead: std::sync::Mutex<Ahead>,
    /// Memory for `read`s: one packed arena for every tensor of the file or
    /// model (not registered: see [`read_once_arena`]; each page faulted by
    /// the read that fills it), made at the first
    /// read. A payload keeps its slot, so its bytes are never reused while
    /// Python holds it; a slot comes back only when its tensor is gone, and
    /// its pages go back to the kernel then (`Arena::discard_freed_pages`).
    /// When the arena has no room (tensors kept and read again), a read
    /// gets an arena of its own.
    /// `Some(None)`: the kernel refused it (said once); each read then has
    /// memory of its own. Locked only to look at or set the handle.
    arena: std::sync::Mutex<Option<Option<ws::Arena>>>,
    engine: Gate,
    model: ws::Model,
    path: String,
    /// The process that opened it: a forked child may read the tensors
    /// its parent was handed, but not use the reader (its engine's I/O
    /// threads are the parent's, and a parent thread may have held one of
    /// its locks at the fork). Checked before any lock is taken.
    pid: u32,
}

/// The engine of a reader, and the calls using it: each call holds a
/// [`InUse`] (a counted handle) for as long as it runs, and `close` takes
/// the engine away (no call starts after it), then waits for the calls
/// already in, with the GIL released. The lock is held only to clone or
/// take the handle and count, never across a wait or a GIL release.
struct Gate {
    state: std::sync::Mutex<GateState>,
    idle: std::sync::Condvar,
}

struct GateState {
    engine: Option<Arc<ws::Engine>>,
    /// Calls holding the engine now.
    calls: usize,
}

/// One call's hold on a reader's engine (see [`Gate`]).
struct InUse<'a> {
    gate: &'a Gate,
    engine: Arc<ws::Engine>,
}

impl std::ops::Deref for InUse<'_> {
    type Target = ws::Engine;
    fn deref(&self) -> &ws::Engine {
        &self.engine
    }
}

impl Drop for InUse<'_> {
    fn drop(&mut self) {
        let mut g = self.gate.lock();
        g.calls -= 1;
        if g.calls == 0 {
            self.gate.idle.notify_all();
        }
    }
}

impl Gate {
    fn new(engine: ws::Engine) -> Self {
        Gate {
            state: std::sync::Mutex::new(GateState {
                engine: Some(Arc::new(engine)),
                calls: 0,
            }),
            idle: std::sync::Condvar::new(),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, GateState> {
        self.state.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The engine for one call; `None` once closed.
    fn enter(&self) -> Option<InUse<'_>> {
        let mut g = self.lock();
        let engine = Arc::clone(g.engine.as_ref()?);
        g.calls += 1;
        Some(InUse { gate: self, engine })
    }

    fn is_open(&self) -> bool {
        self.lock().engine.is_some()
    }

    /// Takes the engine away (no call starts after this), then waits until
    /// `deadline` for the calls already in: the engine, and the calls left
    /// when the deadline came (0 when every call finished). `None` when it
    /// was already closed. Call with the GIL released.
    fn close(&self, deadline: std::time::Instant) -> Option<(Arc<ws::Engine>, usize)> {
        let mut g = self.lock();
        let engine = g.engine.take()?;
        while g.calls > 0 {
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            if left.is_zero() {
                break;
            }
            g = self
                .idle
                .wait_timeout(g, left)
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .0;
        }
        Some((engine, g.calls))
    }
}

/// Tensors read ahead of `get_tensor`: after a whole-tensor read, the next
/// tensors in (shard, offset) order are started, up to [`AHEAD_BYTES`] and
/// [`AHEAD_READS`] in flight or landed and not yet asked for, each in a
/// slot of the shared arena (none when it has no room). A tensor asked for
/// takes its read over; reads never asked for are dropped with the reader
/// (they finish into the arena; their slots come back then).
#[derive(Default)]
struct Ahead {
    /// Tensor indexes in (shard, offset) order, and each one's position.
    order: Vec<usize>,
    position: std::collections::HashMap<usize, usize>,
    pending: std::collections::HashMap<usize, ws::Ticket>,
    bytes: u64,
}

/// Read-ahead bounds: bytes and reads started and not yet asked for.
const AHEAD_BYTES: u64 = 64 << 20;
const AHEAD_READS: usize = 32;

/// A completed read's bytes as a payload Python owns, readable by
/// processes forked from now on, so a forked worker (multiprocessing, a
/// DataLoader, a pre-fork server) reads the tensors its parent holds, as it
/// would safetensors': its pages handed over (`Loaded::inherit_on_fork`;
/// no read writes them any more), or, where that is refused, a copy
/// (`Bytes::for_children`: counted, said once).
fn payload(loaded: ws::Loaded) -> Payload {
    Payload {
        bytes: Arc::new(Bytes::for_children(loaded)),
    }
}

impl Reader {
    /// A whole tensor: its read-ahead read if one was started, else a read
    /// now; then the read-ahead is topped up past it; then the wait.
    fn read_whole(
        &self,
        py: Python<'_>,
        engine: &ws::Engine,
        shared: Option<&ws::Arena>,
        t: &ws::TensorRef,
    ) -> PyResult<Payload> {
        let Some(shared) = shared else {
            return read_one(py, engine, None, t);
        };
        if t.len == 0 {
            return read_one(py, engine, None, t);
        }
        let all = self.model.catalog().tensors();
        let ticket = py
            .detach(|| -> ws::Result<ws::Ticket> {
                let mut a = self.ahead.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
                if a.order.is_empty() {
                    let mut order: Vec<usize> = (0..all.len()).collect();
                    order.sort_by_key(|&i| (all[i].shard, all[i].offset));
                    a.position = order.iter().enumerate().map(|(p, &i)| (i, p)).collect();
                    a.order = order;
                }
                let ticket = match a.pending.remove(&t.index) {
                    Some(tk) => {
                        a.bytes -= t.len;
                        tk
                    }
                    None => {
                        let slot = match shared.take_for(t) {
                            Ok(slot) => slot,
                            Err(_) => read_once_arena_for(engine, t)?.take_for(t)?,
                        };
                        engine.read(t, slot)?
                    }
                };
                let from = a.position.get(&t.index).map_or(a.order.len(), |p| p + 1);
                for k in from..a.order.len() {
                    if a.bytes >= AHEAD_BYTES || a.pending.len() >= AHEAD_READS {
                        break;
                    }
                    let i = a.order[k];
                    let next = &all[i];
                    if next.len == 0 || a.pending.contains_key(&i) {
                        continue;
                    }
                    // No room in the arena: no read-ahead (never an arena of
                    // its own for a read nobody asked for yet).
                    let Ok(slot) = shared.take_for(next) else { break };
                    let tk = engine.read(next, slot)?;
                    a.pending.insert(i, tk);
                    a.bytes += next.len;
                }
                Ok(ticket)
            })
            .map_err(to_py)?;
        let loaded = py.detach(|| ticket.wait()).map_err(to_py)?;
        Ok(payload(loaded))
    }

    /// The shared arena (a handle to it), made at the first read; None when
    /// the kernel refused the memory (each read then gets its own). The
    /// lock is held only to look at and set the handle: the mapping is made
    /// with the GIL released and no lock held, so threads that ask at once
    /// may each map one, and all but the first drop theirs.
    fn shared_arena(&self, py: Python<'_>, engine: &ws::Engine) -> PyResult<Option<ws::Arena>> {
        let lock = || self.arena.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(made) = lock().clone() {
            return Ok(made);
        }
        let all: Vec<&ws::TensorRef> = self.model.catalog().tensors().iter().collect();
        let bytes = engine.placement_bytes(&all).map_err(to_py)?;
        // Its slots come back as Python drops their tensors: their pages go
        // back to the kernel then, so the reader's resident memory is the
        // tensors alive plus the read-ahead, not every tensor ever read.
        let made = py.detach(|| {
            let a = read_once_arena(engine, bytes.max(4096))?;
            a.discard_freed_pages()?;
            Ok::<_, ws::Error>(a)
        });
        let (out, refused) = {
            let mut g = lock();
            match (&*g, made) {
                (Some(first), _) => (first.clone(), None),
                (None, Ok(a)) => {
                    *g = Some(Some(a.clone()));
                    (Some(a), None)
                }
                (None, Err(e)) => {
                    *g = Some(None);
                    (None, Some(e))
                }
            }
        };
        if let Some(e) = refused {
            // Not silent: each read then gets memory of its own (slower,
            // never wrong); said once, for this file (no lock held).
            let msg = format!(
                "{}: no shared memory for reads ({e}); each tensor is read into memory of its own",
                self.path
            );
            pyo3::PyErr::warn(
                py,
                &py.get_type::<pyo3::exceptions::PyResourceWarning>(),
                &std::ffi::CString::new(msg).unwrap_or_default(),
                1,
            )?;
        }
        Ok(out)
    }

    /// The engine for one call, or `SafetensorError` naming the file once
    /// the reader is closed (or in a forked child).
    fn engine(&self) -> PyResult<InUse<'_>> {
        self.not_forked()?;
        self.engine.enter().ok_or_else(|| self.closed())
    }

    /// `SafetensorError` in a forked child, before any lock is looked at.
    fn not_forked(&self) -> PyResult<()> {
        let here = std::process::id();
        if here == self.pid {
            return Ok(());
        }
        Err(safetensor_error(format!(
            "{}: opened in process {}, used in its forked child {here}: the tensors it returned are readable here, \
             the reader is not (open the file again in this process)",
            self.path, self.pid
        )))
    }

    fn closed(&self) -> PyErr {
        safetensor_error(format!(
            "File is closed: {} (safe_open's with block has ended)",
            self.path
        ))
    }

    /// `SafetensorError` once closed: every method of a closed reader
    /// raises, as safetensors' does.
    fn check_open(&self) -> PyResult<()> {
        self.not_forked()?;
        if self.engine.is_open() {
            Ok(())
        } else {
            Err(self.closed())
        }
    }

    fn tensor(&self, name: &str) -> PyResult<&ws::TensorRef> {
        self.check_open()?;
        self.model.tensor(name).map_err(to_py)
    }
}

/// Memory for reads that land once: each tensor handed to Python owns its
/// bytes and none is read into again. A packed arena, not registered with
/// the rings: registering pins every page at once, on the calling thread,
/// before the first read (a whole shard's arena at its first `get_tensor`),
/// where unregistered pages are faulted by the reads that fill them, on
/// the ring threads, alongside the other reads. Its reads are plain Read
/// by choice, counted per drive in `chunks_unregistered_arena` (as a
/// whole-model load's own mapping is), not warned.
fn read_once_arena(engine: &ws::Engine, bytes: usize) -> ws::Result<ws::Arena> {
    ws::Arena::packed(bytes, engine.model().required_align(), false)
}

/// [`read_once_arena`] with room for `t` alone: exactly its blocks
/// (`Engine::placement_bytes`; an arena sized for the ring bound,
/// `Arena::packed_bytes_for`, would map twice the tensor).
fn read_once_arena_for(engine: &ws::Engine, t: &ws::TensorRef) -> ws::Result<ws::Arena> {
    read_once_arena(engine, engine.placement_bytes(&[t])?)
}

/// Reads `part` into memory nothing else holds: a slot of `shared` (the
/// payload in place, O_DIRECT), or of an arena of its own when `shared`
/// has no room; with the GIL released.
fn read_one(
    py: Python<'_>,
    engine: &ws::Engine,
    shared: Option<&ws::Arena>,
    part: &ws::TensorRef,
) -> PyResult<Payload> {
    if part.len == 0 {
        return Ok(Payload {
            bytes: Arc::new(Bytes::Empty),
        });
    }
    let loaded = py
        .detach(|| -> ws::Result<ws::Loaded> {
            let slot = match shared.map(|a| a.take_for(part)) {
                Some(Ok(slot)) => slot,
                _ => read_once_arena_for(engine, part)?.take_for(part)?,
            };
            engine.read(part, slot)?.wait()
        })
        .map_err(to_py)?;
    Ok(payload(loaded))
}

#[pymethods]
impl Reader {
    /// Opens `path`: a `.safetensors` file on its own, or a model directory
    /// (its index, split `dirs`, `mirrors`). `route` and `direct` as the
    /// command line's; `env`: the `WEIGHTSTREAM_*` variables apply where an
    /// argument is not given (as the command line's).
    #[new]
    #[pyo3(signature = (path, dirs=None, mirrors=None, route=None, direct=None, env=false))]
    fn new(
        py: Python<'_>,
        path: &str,
        dirs: Option<Vec<String>>,
        mirrors: Option<Vec<String>>,
        route: Option<&str>,
        direct: Option<&str>,
        env: bool,
    ) -> PyResult<Self> {
        let config = layout_with(path, (dirs, mirrors, route, direct), env)?;
        let (model, engine) = open(py, config)?;
        Ok(Reader {
            model,
            engine: Gate::new(engine),
            path: path.to_string(),
            arena: std::sync::Mutex::new(None),
            ahead: std::sync::Mutex::new(Ahead::default()),
            pid: std::process::id(),
        })
    }

    /// Every tensor name, sorted.
    fn keys(&self) -> PyResult<Vec<String>> {
        self.check_open()?;
        Ok(self.model.catalog().tensors().iter().map(|t| t.name.clone()).collect())
    }

    /// The `__metadata__` of the file (of the first shard that has one for
    /// a model), or None.
    fn metadata(&self) -> PyResult<Option<std::collections::HashMap<String, String>>> {
        self.check_open()?;
        Ok(self
            .model
            .catalog()
            .shards()
            .iter()
            .find_map(|s| s.header.metadata.clone()))
    }

    /// The O_DIRECT block size `A` (`Engine::direct_align`): a payload at
    /// file offset `off` lands in place at an address `a` with
    /// `a % A == off % A`.
    fn direct_align(&self) -> PyResult<usize> {
        Ok(self.engine()?.direct_align())
    }

    /// `(dtype, shape, nbytes, file_offset)` of `name`.
    fn info(&self, name: &str) -> PyResult<(String, Vec<usize>, u64, u64)> {
        let t = self.tensor(name)?;
        Ok((t.dtype.name().to_string(), t.shape.clone(), t.len, t.offset))
    }

    /// `(wanted, read)`: the bytes of the block of `name` that keeps
    /// `bounds[d]` of each dimension, and the bytes of whole blocks the
    /// drives move to read it alone (`Engine::slice_plan`: runs merged
    /// across short gaps, as `_fill` reads a slice). Nothing is read.
    fn _slice_read_bytes(&self, name: &str, bounds: Vec<(usize, usize)>) -> PyResult<(u64, u64)> {
        let t = self.tensor(name)?;
        let ranges: Vec<_> = bounds.iter().map(|&(a, z)| a..z).collect();
        let slice = t.slice(&ranges).map_err(|e| PyValueError::new_err(e.to_string()))?;
        let plan = self.engine()?.slice_plan(&slice);
        Ok((plan.wanted, plan.read))
    }

    /// The payload of `name`, or bytes `[start, end)` of it, in memory of
    /// its own.
    #[pyo3(signature = (name, start=None, end=None))]
    fn read(&self, py: Python<'_>, name: &str, start: Option<u64>, end: Option<u64>) -> PyResult<Payload> {
        let t = self.tensor(name)?;
        let engine = self.engine()?;
        let shared = self.shared_arena(py, &engine)?;
        let shared = shared.as_ref();
        let got = match (start, end) {
            (None, None) => self.read_whole(py, &engine, shared, t),
            (s, e) => {
                let (s, e) = (s.unwrap_or(0), e.unwrap_or(t.len));
                if s == e && s <= t.len {
                    return Ok(Payload {
                        bytes: Arc::new(Bytes::Empty),
                    });
                }
                let part = t
                    .byte_range(s..e)
                    .map_err(|err| PyValueError::new_err(err.to_string()))?;
                read_one(py, &engine, shared, &part)
            }
        }?;
        dlpack::warn_fork_copies(py)?;
        Ok(got)
    }

    /// The block of `name` that keeps `bounds[d]` of each leading
    /// dimension (the rest whole), compact and row-major, in memory of its
    /// own: rows in place, other blocks piece by piece (see
    /// `Engine::read_slice`), never the tensor's other bytes.
    fn read_slice(&self, py: Python<'_>, name: &str, bounds: Vec<(usize, usize)>) -> PyResult<Payload> {
        let t = self.tensor(name)?;
        let engine = self.engine()?;
        let ranges: Vec<std::ops::Range<usize>> = bounds.iter().map(|&(a, b)| a..b).collect();
        let slice = t.slice(&ranges).map_err(|e| PyValueError::new_err(e.to_string()))?;
        let loaded = py
            .detach(|| -> ws::Result<ws::Loaded> {
                let memory = read_once_arena(&engine, slice_room(&slice, engine.direct_align()))?;
                let at = slice_offset(&slice, 0, engine.direct_align());
                engine.read_slice(&slice, &memory, at, ws::Scratch::Before)?.wait()
            })
            .map_err(to_py)?;
        let out = payload(loaded);
        dlpack::warn_fork_copies(py)?;
        Ok(out)
    }

    /// Reads `name` (or bytes `[start, end)` of it) into `nbytes` bytes at
    /// address `address`: the memory of a tensor or array the Python layer
    /// checked (contiguous, writable, on the CPU, of this size) and keeps
    /// alive, and that nothing else touches, during this call (which
    /// returns only once the read is complete). An empty range reads
    /// nothing. Private: the Python layer's `Engine.read_into` is the API.
    #[pyo3(signature = (name, address, nbytes, start=None, end=None))]
    fn _read_into_address(
        &self,
        py: Python<'_>,
        name: &str,
        address: usize,
        nbytes: usize,
        start: Option<u64>,
        end: Option<u64>,
    ) -> PyResult<()> {
        let t = self.tensor(name)?;
        let (s, e) = (start.unwrap_or(0), end.unwrap_or(t.len));
        if s > e || e > t.len {
            return Err(PyValueError::new_err(format!(
                "tensor {name}: bytes [{s}, {e}) are not inside its {} bytes",
                t.len
            )));
        }
        if e - s != nbytes as u64 {
            return Err(PyValueError::new_err(format!(
                "tensor {name}: {} bytes to read, the buffer has {nbytes}",
                e - s
            )));
        }
        if nbytes == 0 {
            return Ok(());
        }
        let part = if (s, e) == (0, t.len) {
            t.clone()
        } else {
            t.byte_range(s..e)
                .map_err(|err| PyValueError::new_err(err.to_string()))?
        };
        if address == 0 {
            return Err(PyValueError::new_err("a NULL buffer"));
        }
        let engine = self.engine()?;
        py.detach(|| -> ws::Result<()> {
            let ptr = std::ptr::NonNull::new(address as *mut u8).expect("checked non-zero above");
            // SAFETY: the Python layer's contract above: `nbytes` writable
            // bytes at `address`, kept alive and untouched by anyone else
            // until this returns; the arena is released (nothing in flight)
            // before it does.
            let arena = unsafe { engine.register_memory(ptr, nbytes) }?;
            let r = engine
                .read_into(&part, &arena, 0, ws::Scratch::None)
                .and_then(|t| t.wait().map(drop));
            if arena.release(Duration::from_secs(3600)).is_err() {
                // Unreachable short of a read left in the kernel by a dead
                // drive: never return while it may still write.
                loop {
                    std::thread::sleep(Duration::from_secs(3600));
                }
            }
            r
        })
        .map_err(to_py)
    }

    /// Fills memory Python already has (`Engine::fill`): each target is
    /// `(name, bounds or None, (start, end) or None, address, nbytes)`:
    /// the tensor, a slice of it, or bytes `[start, end)` of its payload,
    /// into `nbytes` at `address`, the memory of a tensor
    /// the Python layer checked (CPU, contiguous, writable, of the payload's
    /// size and dtype) and keeps alive, and that nothing else touches,
    /// during this call. The fill runs on a thread of its own while this
    /// one checks for signals every 50 ms; on Ctrl-C it is cancelled (no
    /// read starts after it) and this call returns only once no read into
    /// any target is in flight, then raises. Returns the report as JSON.
    /// Private: `weightstream.torch.load_into` is the API.
    #[pyo3(signature = (targets, staging_bytes=None, copy_threads=None, in_place=true))]
    fn _fill(
        &self,
        py: Python<'_>,
        targets: FillTargets,
        staging_bytes: Option<usize>,
        copy_threads: Option<usize>,
        in_place: bool,
    ) -> PyResult<String> {
        let engine = self.engine()?;
        let mut fill = Vec::with_capacity(targets.len());
        for (name, bounds, range, address, nbytes) in &targets {
            let whole = self.tensor(name)?;
            let part;
            let t = match range {
                None => whole,
                Some((a, z)) => {
                    part = whole
                        .byte_range(*a..*z)
                        .map_err(|e| PyValueError::new_err(e.to_string()))?;
                    &part
                }
            };
            let slice = match bounds {
                None => None,
                Some(_) if range.is_some() => {
                    return Err(PyValueError::new_err(format!(
                        "tensor {name}: a fill target is a slice or a byte range, not both"
                    )))
                }
                Some(b) => Some(
                    t.slice(&b.iter().map(|&(a, z)| a..z).collect::<Vec<_>>())
                        .map_err(|e| PyValueError::new_err(e.to_string()))?,
                ),
            };
            let ptr = match std::ptr::NonNull::new(*address as *mut u8) {
                Some(p) => p,
                None if *nbytes == 0 => std::ptr::NonNull::dangling(),
                None => return Err(PyValueError::new_err(format!("tensor {name}: a NULL destination"))),
            };
            // SAFETY: the Python layer's contract above: `nbytes` writable
            // bytes at `address`, kept alive and untouched by anyone else
            // until this call returns, which it does only once the fill
            // (below, on its own thread) has returned: Engine::fill returns
            // only once nothing writes any target.
            fill.push(unsafe { ws::FillTarget::from_raw(t, slice.as_ref(), ptr, *nbytes) });
        }
        let cancel = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let mut opts = ws::FillOptions {
            copy_threads,
            in_place,
            cancel: Some(Arc::clone(&cancel)),
            ..ws::FillOptions::default()
        };
        if let Some(b) = staging_bytes {
            opts.staging_bytes = b;
        }
        let shared = Arc::clone(&engine.engine);
        let (tx, rx) = std::sync::mpsc::channel();
        let worker = std::thread::Builder::new()
            .name("ws-py-fill".into())
            .spawn(move || {
                let _ = tx.send(shared.fill(fill, &opts));
            })
            .map_err(|e| PyOSError::new_err(format!("start the fill thread: {e}")))?;
        let rx = std::sync::Mutex::new(rx);
        let recv = |timeout: Option<Duration>| {
            let rx = rx.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            match timeout {
                Some(t) => rx.recv_timeout(t),
                None => rx.recv().map_err(|_| std::sync::mpsc::RecvTimeoutError::Disconnected),
            }
        };
        let result = loop {
            match py.detach(|| recv(Some(Duration::from_millis(50)))) {
                Ok(r) => break r,
                Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {
                    if let Err(signal) = py.check_signals() {
                        // Never return while a read may still write into
                        // Python's memory: cancel, then wait for the end.
                        cancel.store(true, std::sync::atomic::Ordering::Release);
                        let _ = py.detach(|| recv(None));
                        let _ = py.detach(|| worker.join());
                        return Err(signal);
                    }
                }
                Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => {
                    // The thread ended without a result: it panicked, and
                    // Engine::fill's guards waited out every read first.
                    let _ = py.detach(|| worker.join());
                    return Err(PyOSError::new_err(
                        "the fill thread ended without a result (it panicked)",
                    ));
                }
            }
        };
        let _ = py.detach(|| worker.join());
        drop(engine);
        let r = match result {
            Ok(r) => r,
            Err(e) => {
                // Which destinations are whole, by the checkpoint names the
                // caller gave (also in the message): `complete` and
                // `incomplete` on the exception.
                let whole: Option<std::collections::HashSet<usize>> = match &e {
                    ws::Error::Incomplete { complete, .. } => Some(complete.iter().copied().collect()),
                    _ => None,
                };
                let err = to_py(e);
                if let Some(whole) = whole {
                    let names = |done: bool| -> Vec<String> {
                        (0..targets.len())
                            .filter(|i| whole.contains(i) == done)
                            .map(|i| targets[i].0.clone())
                            .collect()
                    };
                    let v = err.value(py);
                    v.setattr("complete", names(true))?;
                    v.setattr("incomplete", names(false))?;
                }
                return Err(err);
            }
        };
        Ok(serde_json::json!({
            "targets": r.targets,
            "bytes": r.bytes,
            "bytes_read": r.bytes_read,
            "in_place_reads": r.in_place_reads,
            "in_place_bytes": r.in_place_bytes,
            "staged_reads": r.staged_reads,
            "staged_bytes": r.staged_bytes,
            "buffered_reads": r.buffered_reads,
            "buffered_bytes": r.buffered_bytes,
            "targets_in_place": r.targets_in_place,
            "staging_bytes": r.staging_bytes,
            "staging_waits": r.staging_waits,
            "copy_threads": r.copy_threads,
            "copy_cpu_seconds": r.copy_cpu_ns as f64 / 1e9,
            "seconds": r.elapsed.as_secs_f64(),
            "gbps": r.gb_per_s(),
        })
        .to_string())
    }

    /// Every counter of the engine, as JSON text.
    fn stats_json(&self) -> PyResult<String> {
        serde_json::to_string(&self.engine()?.stats()).map_err(|e| PyValueError::new_err(e.to_string()))
    }

    /// Whether the reader is still open (false in a forked child).
    fn is_open(&self) -> bool {
        self.not_forked().is_ok() && self.engine.is_open()
    }

    /// Stops the engine. No call starts after this; calls already running
    /// on other threads finish first (waited for up to `timeout` seconds,
    /// with the GIL released), then the engine's reads in flight get the
    /// rest of `timeout` (bounded: payloads already handed out stay
    /// valid). Returns whether everything drained; a second close does
    /// nothing and returns True. Never raises for reads in flight: a call
    /// still running at the deadline finishes normally, and the engine
    /// goes with the last of them.
    #[pyo3(signature = (timeout=10.0))]
    fn close(&self, py: Python<'_>, timeout: f64) -> bool {
        if self.not_forked().is_err() {
            // A forked child: nothing of the parent's engine is touched
            // (its locks may have been held at the fork); leaving a with
            // block there does not raise.
            return false;
        }
        let timeout = Duration::from_secs_f64(timeout.clamp(0.0, 3600.0));
        py.detach(|| {
            let deadline = std::time::Instant::now() + timeout;
            let Some((engine, calls_left)) = self.engine.close(deadline) else {
                return true;
            };
            // Payloads already handed out keep their slots (and so the
            // arena's memory) alive; only the handle is dropped here.
            // Read-ahead reads nobody asked for are dropped: they finish
            // into the arena.
            *self.ahead.lock().unwrap_or_else(std::sync::PoisonError::into_inner) = Ahead::default();
            self.arena
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .take();
            match Arc::try_unwrap(engine) {
                Ok(e) if calls_left == 0 => {
                    e.shutdown(deadline.saturating_duration_since(std::time::Instant::now()))
                        .drained
                }
                // A call outlived the deadline: it holds the engine, which
                // goes (waiting for its reads) when that call ends.
                _ => false,
            }
        })
    }
}

/// One tensor of [`catalog`]: name, dtype, shape, bytes, file, offset,
/// the volumes (`st_dev`) of its shard's copies, primary first.
type CatalogEntry = (String, String, Vec<usize>, u64, String, u64, Vec<u64>);

/// Where a slice starts in packed memory whose free bytes begin at
/// `cursor`: on a page of its own (no page holds bytes of two slices, so
/// each one's pages can be handed to forked children while its neighbours
/// are still being read); rows (one run) in phase with their file offset,
/// on a block of their own, so they are read in place; any other slice
/// (copied out of staging anyway) at the page's first byte.
fn slice_offset(slice: &ws::TensorSlice, cursor: usize, align: usize) -> usize {
    let page = PAGE.max(align);
    match slice.as_range() {
        Some(rows) => cursor.next_multiple_of(page) + (rows.offset % align as u64) as usize,
        None => cursor.next_multiple_of(page),
    }
}

/// The page size slices are kept apart by ([`slice_offset`]); a multiple
/// of every O_DIRECT alignment up to it.
const PAGE: usize = 4096;

/// Bytes a slice needs in packed memory placed by [`slice_offset`], at most.
fn slice_room(slice: &ws::TensorSlice, align: usize) -> usize {
    usize::try_from(slice.len())
        .unwrap_or(usize::MAX)
        .saturating_add(2 * PAGE.max(align))
}

/// Every tensor of a model (or one file) as `[(name, dtype, shape, bytes,
/// file, offset, drives)]` in name order (`file`: the shard's path,
/// `offset`: the payload's in it, `drives`: the `st_dev` of each copy of
/// the shard, primary first): its headers only, no engine.
#[pyfunction]
#[pyo3(signature = (path, dirs=None, mirrors=None, env=false))]
fn catalog(
    py: Python<'_>,
    path: &str,
    dirs: Option<Vec<String>>,
    mirrors: Option<Vec<String>>,
    env: bool,
) -> PyResult<Vec<CatalogEntry>> {
    let config = layout_with(path, (dirs, mirrors, None, None), env)?;
    let model = py.detach(|| ws::Model::open(config)).map_err(to_py)?;
    let shards = model.catalog().shards();
    // The volumes (st_dev) of each shard's copies, primary first.
    let drives: Vec<Vec<u64>> = (0..shards.len())
        .map(|s| {
            model
                .copies(s)
                .iter()
                .map(|&f| model.drives()[model.files()[f].drive].dev)
                .collect()
        })
        .collect();
    Ok(model
        .catalog()
        .tensors()
        .iter()
        .map(|t| {
            let file = shards[t.shard].listed.to_string_lossy().into_owned();
            (
                t.name.clone(),
                t.dtype.name().to_string(),
                t.shape.clone(),
                t.len,
                file,
                t.offset,
                drives[t.shard].clone(),
            )
        })
        .collect())
}

/// A tensor or slice a load read: name, dtype, shape, its bytes.
type Landed = (String, String, Vec<usize>, ws::Loaded);

/// Bytes a load with `parts` keeps in flight for its slices: each slice
/// counts its own bytes plus the staging its pieces may hold (what the
/// drives move for it, at most the engine's per-slice window), so the
/// staging of many sparse slices at once is bounded by this, not by the
/// model.
const SLICES_IN_FLIGHT: u64 = 256 << 20;

/// The slices of a load (`parts`: name -> a range per leading dimension),
/// read into one packed mapping, at most [`SLICES_IN_FLIGHT`] bytes in
/// flight: `(name, dtype, shape, loaded)` in name order.
fn load_slices(
    engine: &ws::Engine,
    model: &ws::Model,
    parts: &std::collections::BTreeMap<String, Vec<(usize, usize)>>,
) -> ws::Result<Vec<Landed>> {
    let align = engine.direct_align();
    let mut slices = Vec::with_capacity(parts.len());
    for (name, bounds) in parts {
        let ranges: Vec<std::ops::Range<usize>> = bounds.iter().map(|&(a, b)| a..b).collect();
        slices.push(model.tensor(name)?.slice(&ranges)?);
    }
    if slices.is_empty() {
        return Ok(Vec::new());
    }
    let mut at = Vec::with_capacity(slices.len());
    let mut cursor = 0usize;
    for s in &slices {
        let a = slice_offset(s, cursor, align);
        at.push(a);
        cursor = a + usize::try_from(s.len()).unwrap_or(usize::MAX);
    }
    let memory = read_once_arena(engine, cursor.max(4096))?;
    let mut out = Vec::with_capacity(slices.len());
    let mut pending: std::collections::VecDeque<(usize, ws::SliceTicket)> = Default::default();
    let mut in_flight = 0u64;
    let window = engine.slice_staging() as u64;
    let weight = |s: &ws::TensorSlice| {
        let staging = if s.is_contiguous() {
            0
        } else {
            engine.slice_plan(s).read.min(window)
        };
        s.len() + staging
    };
    for (i, s) in slices.iter().enumerate() {
        while in_flight > 0 && in_flight + weight(s) > SLICES_IN_FLIGHT {
            let (k, t) = pending.pop_front().expect("bytes in flight are pending reads");
            in_flight -= weight(&slices[k]);
            out.push((k, t.wait()?));
        }
        pending.push_back((i, engine.read_slice(s, &memory, at[i], ws::Scratch::Before)?));
        in_flight += weight(s);
    }
    for (k, t) in pending {
        out.push((k, t.wait()?));
    }
    out.sort_by_key(|(k, _)| *k);
    Ok(out
        .into_iter()
        .map(|(k, l)| {
            let s = &slices[k];
            (
                s.tensor().name.clone(),
                s.dtype().name().to_string(),
                s.shape().to_vec(),
                l,
            )
        })
        .collect())
}

/// A whole-model (or filtered) load: `[(name, dtype, shape, payload)]` in
/// name order, every payload in one mapping that lives while any of them
/// does; plus the report as JSON text.
#[pyfunction]
#[pyo3(signature = (path, dirs=None, mirrors=None, route=None, direct=None, names=None, parts=None, only=None))]
#[allow(clippy::too_many_arguments)]
fn load(
    py: Python<'_>,
    path: &str,
    dirs: Option<Vec<String>>,
    mirrors: Option<Vec<String>>,
    route: Option<&str>,
    direct: Option<&str>,
    names: Option<Vec<String>>,
    parts: Option<std::collections::BTreeMap<String, Vec<(usize, usize)>>>,
    only: Option<Vec<String>>,
) -> PyResult<(Vec<Item>, String)> {
    let parts = parts.unwrap_or_default();
    // `only`: exactly these tensors whole (and `parts` sliced); an unknown
    // name is an error naming it (below, with the model open).
    let only: Option<std::collections::HashSet<String>> = only.map(|v| v.into_iter().collect());
    let config = layout(path, dirs, mirrors, route, direct)?;
    let (tx, rx) = std::sync::mpsc::channel();
    // The load runs on a thread of its own: this one only waits, checking
    // for signals (Ctrl-C) every 50 ms. An abandoned load finishes into
    // memory that Python never sees and frees it (no read is left writing
    // into anything Python holds).
    std::thread::Builder::new()
        .name("ws-py-load".into())
        .spawn(move || {
            // The engine outlives the result: its shutdown (joining the
            // ring threads, tearing the rings down) runs after the tensors
            // are handed over, not inside the caller's wait. The loaded
            // memory is the tensors' own; the engine never touches it again.
            let mut engine_kept = None;
            let r = (|| -> ws::Result<_> {
                let model = ws::Model::open(config)?;
                let engine = ws::Engine::new(&model, ws::EngineConfig::from_env()?)?;
                let mut opts = ws::LoadOptions::new();
                if let Some(n) = names.filter(|n| !n.is_empty()) {
                    opts = opts.names_containing(n);
                }
                // Tensors read as slices are not read whole; with `only`,
                // nothing else is either.
                if let Some(only) = &only {
                    if let Some(n) = only.iter().find(|n| model.catalog().get(n).is_none()) {
                        return Err(ws::Error::Config(format!("load: no tensor named {n} (only=)")));
                    }
                }
                let sliced: std::collections::HashSet<String> = parts.keys().cloned().collect();
                let keep = move |t: &ws::TensorRef| {
                    !sliced.contains(&t.name) && only.as_ref().is_none_or(|o| o.contains(&t.name))
                };
                // Whole tensors left to read: those the name filter keeps
                // and no slice takes (a load whose every named tensor is
                // sliced reads slices only).
                let whole_left = model.catalog().tensors().iter().any(|t| opts.selects(t) && keep(t));
                if !parts.is_empty() || whole_left {
                    opts = opts.filter(keep);
                }
                let t0 = std::time::Instant::now();
                let mut meta: Vec<(String, String, Vec<usize>)> = Vec::new();
                let mut all: Vec<Bytes> = Vec::new();
                let mut bytes = 0u64;
                // With no slice either, load_all says what selected nothing
                // (the names, the filter).
                if whole_left || parts.is_empty() {
                    let loaded = engine.load_all(&opts)?;
                    bytes += loaded.report().bytes;
                    meta = loaded
                        .iter()
                        .map(|v| (v.name().to_string(), v.dtype().name().to_string(), v.shape().to_vec()))
                        .collect();
                    // Handed to processes forked from now on (see
                    // `payload`): the whole mapping of `load_all` already
                    // is (one check each).
                    all = loaded.into_loaded().into_iter().map(Bytes::for_children).collect();
                }
                // Each slice's pages here, off the caller's thread (each on
                // pages of its own: see `slice_offset`).
                for (name, dtype, shape, l) in load_slices(&engine, &model, &parts)? {
                    bytes += l.bytes().len() as u64;
                    meta.push((name, dtype, shape));
                    all.push(Bytes::for_children(l));
                }
                let seconds = t0.elapsed().as_secs_f64();
                // What the slices cost: the drives move whole blocks, so a
                // narrow column of a wide tensor reads far more than it holds.
                let sl = engine.stats().slices;
                let report = format!(
                    "{{\"tensors\": {}, \"bytes\": {bytes}, \"seconds\": {seconds}, \"gbps\": {}, \"slices\": {}, \
                     \"slice_bytes_wanted\": {}, \"slice_bytes_read\": {}}}",
                    meta.len(),
                    bytes as f64 / seconds.max(1e-9) / 1e9,
                    parts.len(),
                    sl.bytes_wanted,
                    sl.bytes_read
                );
                engine_kept = Some(engine);
                Ok((meta, all, report))
            })();
            let _ = tx.send(r);
            drop(engine_kept);
        })
        .map_err(|e| PyOSError::new_err(format!("start the load thread: {e}")))?;
    // A Mutex to carry the receiver into the GIL-free closure (Sync).
    let rx = std::sync::Mutex::new(rx);
    loop {
        let got = py.detach(|| {
            rx.lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .recv_timeout(Duration::from_millis(50))
        });
        match got {
            Ok(r) => {
                // A Ctrl-C that came while the load ran wins over its
                // result (dropped: nothing of it was handed to Python).
                py.check_signals()?;
                let (meta, loaded, report) = r.map_err(to_py)?;
                let out = meta
                    .into_iter()
                    .zip(loaded)
                    .map(|((name, dtype, shape), bytes)| (name, dtype, shape, Payload { bytes: Arc::new(bytes) }))
                    .collect();
                dlpack::warn_fork_copies(py)?;
                return Ok((out, report));
            }
            Err(std::sync::mpsc::RecvTimeoutError::Timeout) => py.check_signals()?,
            Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => {
                return Err(PyOSError::new_err(
                    "the load thread ended without a result (it panicked)",
                ))
            }
        }
    }
}

/// Tensors read one after another, each into memory of its own (never
/// reused: a tensor Python keeps holds nothing back), `window` in flight,
/// handed out in order as each lands.
///
/// Fields drop in order: reads not handed out yet first, then the engine.
#[pyclass(module = "weightstream._native")]
struct Stream {
    /// Reads in flight: the tensor (or slice) and its ticket (`None`: no
    /// bytes, or its submission failed: the error is handed out in order).
    pending: std::collections::VecDeque<(Meta, ws::Result<Option<ws::SliceTicket>>)>,
    /// Memory whole tensors land in: one packed mapping of at most
    /// [`STREAM_ARENA_BYTES`], each tensor a slot of it that comes back only
    /// when Python has dropped the tensor (so a tensor kept holds its bytes
    /// for as long as it lives, and nothing reads into them meanwhile). A
    /// consumer that copies each tensor and drops it (vLLM's
    /// `load_weights`) reuses the same pages, faulted once; a tensor that
    /// finds no room gets a mapping of its own. `None`: the kernel refused
    /// it (each tensor then has its own).
    arena: Option<ws::Arena>,
    engine: ws::Engine,
    todo: std::collections::VecDeque<Todo>,
    window: usize,
    /// Hand each tensor to forked children (see [`payload`]); off only for
    /// a consumer that copies each tensor away and forks nothing meanwhile
    /// (the vLLM loader): the hand-over splits the mapping's huge pages,
    /// which cost that loader 10% of its load (docs/benchmarks/2026-12-03-vllm).
    inherit: bool,
    _model: ws::Model,
}

/// The most memory a stream's own mapping takes ([`Stream::arena`]): room
/// for many tensors in flight and in the consumer's hands at once, far
/// below a model.
const STREAM_ARENA_BYTES: usize = 256 << 20;

/// An item asked of a stream: a tensor's name, and a range per leading
/// dimension for a slice (`None`: the whole tensor).
type StreamItem = (String, Option<Vec<(usize, usize)>>);

/// What a stream hands out for one item: name, dtype, shape.
type Meta = (String, String, Vec<usize>);

/// One item of a stream: a whole tensor, or a slice of it.
enum Todo {
    Whole(ws::TensorRef),
    Slice(ws::TensorSlice),
}

impl Stream {
    /// Starts reads until `window` are in flight, each into memory of its
    /// own. A read that cannot start is handed out as its error in turn.
    fn fill(&mut self) {
        while self.pending.len() < self.window {
            let Some(item) = self.todo.pop_front() else { break };
            let (meta, ticket) = match item {
                Todo::Whole(t) => {
                    let meta = (t.name.clone(), t.dtype.name().to_string(), t.shape.clone());
                    let ticket = (|| -> ws::Result<_> {
                        if t.len == 0 {
                            return Ok(None);
                        }
                        let slot = match self.arena.as_ref().map(|a| a.take_for(&t)) {
                            Some(Ok(slot)) => slot,
                            _ => read_once_arena_for(&self.engine, &t)?.take_for(&t)?,
                        };
                        Ok(Some(self.engine.read(&t, slot)?.into()))
                    })();
                    (meta, ticket)
                }
                Todo::Slice(s) => {
                    let meta = (
                        s.tensor().name.clone(),
                        s.dtype().name().to_string(),
                        s.shape().to_vec(),
                    );
                    let ticket = (|| -> ws::Result<_> {
                        let align = self.engine.direct_align();
                        let memory = read_once_arena(&self.engine, slice_room(&s, align))?;
                        Ok(Some(self.engine.read_slice(
                            &s,
                            &memory,
                            slice_offset(&s, 0, align),
                            ws::Scratch::Before,
                        )?))
                    })();
                    (meta, ticket)
                }
            };
            self.pending.push_back((meta, ticket));
        }
    }
}

#[pymethods]
impl Stream {
    #[new]
    #[pyo3(signature = (path, dirs=None, mirrors=None, route=None, direct=None, names=None, window=8, items=None, env=false, inherit=true))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        path: &str,
        dirs: Option<Vec<String>>,
        mirrors: Option<Vec<String>>,
        route: Option<&str>,
        direct: Option<&str>,
        names: Option<Vec<String>>,
        window: usize,
        items: Option<Vec<StreamItem>>,
        env: bool,
        inherit: bool,
    ) -> PyResult<Self> {
        let config = layout_with(path, (dirs, mirrors, route, direct), env)?;
        let (model, engine) = open(py, config)?;
        let todo: std::collections::VecDeque<Todo> = match items {
            // These items, in this order: whole tensors, or slices.
            Some(items) => {
                let mut todo = std::collections::VecDeque::with_capacity(items.len());
                for (name, bounds) in items {
                    let t = model.tensor(&name).map_err(to_py)?;
                    todo.push_back(match bounds {
                        None => Todo::Whole(t.clone()),
                        Some(b) => {
                            let r: Vec<std::ops::Range<usize>> = b.iter().map(|&(a, z)| a..z).collect();
                            Todo::Slice(t.slice(&r).map_err(|e| PyValueError::new_err(e.to_string()))?)
                        }
                    });
                }
                todo
            }
            // Every tensor (whose name contains one of `names`), in name order.
            None => {
                let all = model.catalog().tensors();
                let names = names.unwrap_or_default();
                for n in &names {
                    if !all.iter().any(|t| t.name.contains(n.as_str())) {
                        return Err(PyValueError::new_err(format!("names: no tensor name contains {n:?}")));
                    }
                }
                all.iter()
                    .filter(|t| names.is_empty() || names.iter().any(|n| t.name.contains(n.as_str())))
                    .map(|t| Todo::Whole(t.clone()))
                    .collect()
            }
        };
        // The stream's own mapping: as much as its whole tensors take, at
        // most STREAM_ARENA_BYTES (mapped now, faulted by the reads).
        let wholes: Vec<&ws::TensorRef> = todo
            .iter()
            .filter_map(|t| match t {
                Todo::Whole(t) if t.len > 0 => Some(t),
                _ => None,
            })
            .collect();
        let arena = match engine.placement_bytes(&wholes) {
            Ok(0) | Err(_) => None,
            Ok(bytes) => read_once_arena(&engine, bytes.min(STREAM_ARENA_BYTES)).ok(),
        };
        let mut stream = Stream {
            pending: Default::default(),
            arena,
            engine,
            todo,
            window: window.clamp(1, 1024),
            inherit,
            _model: model,
        };
        // The reads start now, not at the first `next`: a caller busy with
        // other work meanwhile (an exchange) finds them landed.
        stream.fill();
        Ok(stream)
    }

    fn __iter__(slf: PyRef<'_, Self>) -> PyRef<'_, Self> {
        slf
    }

    /// Every counter of the stream's engine, as JSON text (bytes per
    /// drive among them).
    fn stats_json(&self) -> PyResult<String> {
        serde_json::to_string(&self.engine.stats()).map_err(|e| PyValueError::new_err(e.to_string()))
    }

    /// The next item as it lands; a read that failed raises its error in
    /// turn (the stream goes on with the next item after it).
    fn __next__(&mut self, py: Python<'_>) -> PyResult<Option<Item>> {
        py.check_signals()?;
        self.fill();
        let Some(((name, dtype, shape), ticket)) = self.pending.pop_front() else {
            return Ok(None);
        };
        // The next reads start before Python works on this one.
        let waited = match ticket {
            Ok(None) => Ok(Payload {
                bytes: Arc::new(Bytes::Empty),
            }),
            Ok(Some(ticket)) => py.detach(|| {
                ticket.wait().map(|l| {
                    if self.inherit {
                        payload(l)
                    } else {
                        Payload {
                            bytes: Arc::new(Bytes::Loaded(l)),
                        }
                    }
                })
            }),
            Err(e) => Err(e),
        };
        self.fill();
        let waited = waited.map_err(to_py)?;
        dlpack::warn_fork_copies(py)?;
        Ok(Some((name, dtype, shape, waited)))
    }
}

/// Makes the pages of `nbytes` at `address` (memory a tensor the caller
/// holds owns, about to be written: a model's parameters before their
/// weights are copied in) ready for writes: `MADV_HUGEPAGE` on the 2 MiB
/// pages inside it when `huge`, then (when `populate`) `MADV_POPULATE_WRITE`
/// on its whole pages, so the writer meets neither a page fault nor a clear
/// per 4 KiB. `huge` alone is cheap (no page is touched) and makes each
/// later fault, an O_DIRECT read's included, take a whole 2 MiB page.
/// Neither advice changes a byte of a page already there. Returns None, or
/// why the kernel refused (populating needs Linux 5.14), with the GIL
/// released.
#[pyfunction]
#[pyo3(signature = (address, nbytes, huge, populate=true))]
fn _prepare_for_writes(py: Python<'_>, address: usize, nbytes: usize, huge: bool, populate: bool) -> Option<String> {
    const PAGE: usize = 4096;
    const HUGE: usize = 2 << 20;
    let end = address.checked_add(nbytes)?;
    let (lo, hi) = (address.next_multiple_of(PAGE), end / PAGE * PAGE);
    if address == 0 || hi <= lo {
        return None;
    }
    py.detach(|| {
        let advise = |from: usize, to: usize, advice: rustix::mm::Advice| {
            // SAFETY: `from..to` lies inside the caller's live tensor
            // (whole pages of it); MADV_HUGEPAGE and MADV_POPULATE_WRITE
            // change how the range is backed and fault missing pages in,
            // never the contents of a page that is there or the mapping
            // itself. A range the kernel does not like is an error
            // returned, never a write.
            unsafe { rustix::mm::madvise(from as *mut std::ffi::c_void, to - from, advice) }
                .map_err(|e| format!("madvise({advice:?}) on {} bytes: {e}", to - from))
        };
        let (hlo, hhi) = (address.next_multiple_of(HUGE), end / HUGE * HUGE);
        let huge_refused = (huge && hhi > hlo)
            .then(|| advise(hlo, hhi, rustix::mm::Advice::LinuxHugepage).err())
            .flatten();
        let populate_refused = populate
            .then(|| advise(lo, hi, rustix::mm::Advice::LinuxPopulateWrite).err())
            .flatten();
        populate_refused.or(huge_refused)
    })
}

/// `weightstream.ExpertCache`'s native half: a `ws::ExpertCache` over a
/// model's routed experts, its own engine (the `WEIGHTSTREAM_*` settings).
/// Every call runs with the GIL released; `close` drops the cache (calls
/// running hold it until they return). Tensors handed out hold their
/// entry's handle, so an entry stays pinned, and its memory valid, until
/// the last of its tensors dies, after `close` too.
#[pyclass(module = "weightstream._native", frozen)]
struct ExpertCache {
    cache: std::sync::Mutex<Option<Arc<ws::ExpertCache>>>,
}

/// One part of a cached expert for Python: `(key, dtype, shape, payload)`,
/// the key `projection` for its weight and `projection.part` for the rest.
fn expert_items(h: &ws::ExpertHandle) -> Vec<Item> {
    h.parts()
        .enumerate()
        .map(|(i, (proj, part, l))| {
            let key = if h.weight(proj).is_some_and(|w| std::ptr::eq(w, l)) {
                proj.to_string()
            } else {
                format!("{proj}.{part}")
            };
            (
                key,
                l.dtype().name().to_string(),
                l.shape().to_vec(),
                Payload {
                    bytes: Arc::new(Bytes::Expert(h.clone(), i)),
                },
            )
        })
        .collect()
}

impl ExpertCache {
    fn cache(&self) -> PyResult<Arc<ws::ExpertCache>> {
        self.cache
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
            .ok_or_else(|| PyValueError::new_err("ExpertCache is closed"))
    }
}

#[pymethods]
impl ExpertCache {
    #[new]
    #[pyo3(signature = (path, capacity=None, budget_bytes=None, policy="lru", dirs=None, mirrors=None, route=None, direct=None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        path: &str,
        capacity: Option<usize>,
        budget_bytes: Option<u64>,
        policy: &str,
        dirs: Option<Vec<String>>,
        mirrors: Option<Vec<String>>,
        route: Option<&str>,
        direct: Option<&str>,
    ) -> PyResult<Self> {
        let cap = match (capacity, budget_bytes) {
            (Some(n), None) => ws::Capacity::Experts(n),
            (None, Some(b)) => ws::Capacity::Bytes(b),
            _ => {
                return Err(PyValueError::new_err(
                    "ExpertCache: give exactly one of capacity= (experts) and budget_bytes=",
                ))
            }
        };
        let policy: ws::Policy = policy.parse().map_err(to_py)?;
        let config = layout_with(path, (dirs, mirrors, route, direct), true)?;
        let cache = py
            .detach(|| -> ws::Result<_> {
                let model = ws::Model::open(config)?;
                let c = ws::CacheConfig::new(cap)
                    .policy(policy)
                    .engine(ws::EngineConfig::from_env()?)
                    .inherit_on_fork(true);
                ws::ExpertCache::new(&model, c)
            })
            .map_err(to_py)?;
        Ok(ExpertCache {
            cache: std::sync::Mutex::new(Some(Arc::new(cache))),
        })
    }

    /// `[(key, dtype, shape, payload)]` of expert `expert` of layer `layer`.
    fn get(&self, py: Python<'_>, layer: usize, expert: usize) -> PyResult<Vec<Item>> {
        let c = self.cache()?;
        let h = py.detach(|| c.get(layer, expert)).map_err(to_py)?;
        Ok(expert_items(&h))
    }

    /// One list as `get`'s per expert, every miss started at once.
    fn get_many(&self, py: Python<'_>, layer: usize, experts: Vec<usize>) -> PyResult<Vec<Vec<Item>>> {
        let c = self.cache()?;
        let hs = py.detach(|| c.get_many(layer, &experts)).map_err(to_py)?;
        Ok(hs.iter().map(expert_items).collect())
    }

    /// `(started, present, refused)`; never waits.
    fn prefetch(&self, py: Python<'_>, keys: Vec<(usize, usize)>) -> PyResult<(usize, usize, usize)> {
        let c = self.cache()?;
        let r = py.detach(|| c.prefetch(&keys)).map_err(to_py)?;
        Ok((r.started, r.present, r.refused))
    }

    /// Waits for every read started so far.
    fn wait_idle(&self, py: Python<'_>) -> PyResult<()> {
        let c = self.cache()?;
        py.detach(|| c.wait_idle()).map_err(to_py)
    }

    /// The counters as JSON.
    fn stats(&self, py: Python<'_>) -> PyResult<String> {
        let c = self.cache()?;
        let s = py.detach(|| c.stats());
        serde_json::to_string(&s).map_err(|e| PyValueError::new_err(e.to_string()))
    }

    /// `(capacity, entry_bytes)`.
    fn budget(&self) -> PyResult<(usize, u64)> {
        let c = self.cache()?;
        Ok((c.capacity(), c.entry_bytes()))
    }

    /// Drops the cache (and its engine, once calls running return); a
    /// second close does nothing.
    fn close(&self, py: Python<'_>) {
        let c = self
            .cache
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .take();
        py.detach(move || drop(c));
    }
}

/// The library's version.
#[pyfunction]
fn version() -> &'static str {
    env!("CARGO_PKG_VERSION")
}

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(catalog, m)?)?;
    m.add_class::<Reader>()?;
    m.add_class::<Payload>()?;
    m.add_class::<Stream>()?;
    m.add_class::<ExpertCache>()?;
    m.add_function(wrap_pyfunction!(load, m)?)?;
    m.add_function(wrap_pyfunction!(version, m)?)?;
    m.add_function(wrap_pyfunction!(_set_error_type, m)?)?;
    m.add_function(wrap_pyfunction!(_prepare_for_writes, m)?)?;
    m.add("SafetensorError", m.py().get_type::<SafetensorError>())?;
    Ok(())
}
