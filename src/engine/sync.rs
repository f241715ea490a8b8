//! The loom facade: the in-flight bookkeeping uses these types, which are
//! `loom`'s model-checked versions under `--cfg loom` and `std`'s otherwise.

#[cfg(loom)]
pub(crate) use loom::sync::{
    atomic::{AtomicUsize, Ordering},
    Arc, Condvar, Mutex, MutexGuard,
};

#[cfg(not(loom))]
pub(crate) use std::sync::{
    atomic::{AtomicUsize, Ordering},
    Arc, Condvar, Mutex, MutexGuard,
};

/// Locks a mutex, ignoring poisoning: the bookkeeping it guards stays
/// consistent across a panicking holder (every update is a single store).
pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    match m.lock() {
        Ok(g) => g,
        Err(p) => p.into_inner(),
    }
}

/// `lock` for the plain `std` mutexes of the I/O threads, which loom does
/// not model (they are the same type as the facade's outside `--cfg loom`).
#[allow(dead_code)]
pub(crate) fn lock_std<T>(m: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    match m.lock() {
        Ok(g) => g,
        Err(p) => p.into_inner(),
    }
}
