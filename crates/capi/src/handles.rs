//! Handle tables: a C handle is a number, never a pointer, so a closed,
//! spent or made-up handle is found out (`WS_ERR_HANDLE`) instead of being
//! dereferenced. Numbers are never reused (a 64-bit counter), so a double
//! close stays an error even after other handles were opened.
//!
//! Each table is split in shards by number, each behind its own lock held
//! only to look up, insert or remove: many threads submitting at once meet
//! on different shards, and no lock is held across a read or a wait.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock, RwLockReadGuard, RwLockWriteGuard};

use crate::status::{ws_status, Fail, Res};

const SHARDS: usize = 32;

pub(crate) struct Table<T> {
    what: &'static str,
    next: AtomicU64,
    shards: [RwLock<HashMap<u64, Arc<T>>>; SHARDS],
}

impl<T> Table<T> {
    pub(crate) fn new(what: &'static str) -> Self {
        Table {
            what,
            next: AtomicU64::new(1),
            shards: std::array::from_fn(|_| RwLock::new(HashMap::new())),
        }
    }

    fn read(&self, id: u64) -> RwLockReadGuard<'_, HashMap<u64, Arc<T>>> {
        // A poisoned shard only means a panic elsewhere while it was held;
        // the map itself is always consistent (single inserts and removes).
        self.shards[id as usize % SHARDS]
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn write(&self, id: u64) -> RwLockWriteGuard<'_, HashMap<u64, Arc<T>>> {
        self.shards[id as usize % SHARDS]
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// A new handle number for `v`.
    pub(crate) fn insert(&self, v: T) -> u64 {
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        self.write(id).insert(id, Arc::new(v));
        id
    }

    pub(crate) fn get(&self, id: u64) -> Res<Arc<T>> {
        self.read(id).get(&id).cloned().ok_or_else(|| self.unknown(id))
    }

    pub(crate) fn remove(&self, id: u64) -> Res<Arc<T>> {
        self.write(id).remove(&id).ok_or_else(|| self.unknown(id))
    }

    /// Removes `id` only when `refuse` finds nothing against it and no
    /// other thread holds it (no call on it is running), both decided under
    /// the table's lock: the handle stays in the table, usable by every
    /// other thread, until it is removed for good. `refuse`'s error is
    /// returned at once (the handle untouched); while other calls hold it,
    /// it is tried again (the lock released in between) until `deadline`,
    /// then `busy` is returned. A handle removed here can be reached by no
    /// one else: the `Arc` returned is the only one.
    pub(crate) fn remove_when(
        &self,
        id: u64,
        deadline: std::time::Instant,
        refuse: impl Fn(&T) -> Res<()>,
        busy: impl Fn() -> Fail,
    ) -> Res<Arc<T>> {
        loop {
            {
                let mut shard = self.write(id);
                let v = shard.get(&id).ok_or_else(|| self.unknown(id))?;
                refuse(v)?;
                if Arc::strong_count(v) == 1 {
                    return Ok(shard.remove(&id).expect("looked up under the same lock"));
                }
            }
            if std::time::Instant::now() >= deadline {
                return Err(busy());
            }
            std::thread::yield_now();
        }
    }

    fn unknown(&self, id: u64) -> Fail {
        Fail::new(
            ws_status::WS_ERR_HANDLE,
            if id == 0 {
                format!("{} handle 0: never opened (a zeroed handle)", self.what)
            } else {
                format!(
                    "{} handle {id}: closed, spent or never opened (a double close, or a ticket waited or freed twice)",
                    self.what
                )
            },
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numbers_are_never_reused_and_a_second_remove_is_an_error() {
        let t: Table<u32> = Table::new("thing");
        let a = t.insert(1);
        assert_eq!(*t.remove(a).unwrap(), 1);
        let b = t.insert(2);
        assert_ne!(a, b);
        assert_eq!(t.remove(a).unwrap_err().code, ws_status::WS_ERR_HANDLE);
        assert_eq!(t.get(0).unwrap_err().code, ws_status::WS_ERR_HANDLE);
        assert_eq!(*t.get(b).unwrap(), 2);
    }
}
