//! Which unpinned expert an [`ExpertCache`](crate::ExpertCache) evicts:
//! exact LRU by default, LFU with aging as an option. Pure bookkeeping over
//! keys (no memory, no reads), so a trace's hits can be checked against a
//! naive simulation ([`simulate_lru`]).

use std::collections::{BTreeMap, HashMap};

/// An expert's key: (layer, expert number).
pub type ExpertKey = (usize, usize);

/// The eviction policy of an expert cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum Policy {
    /// Exact least-recently-used over unpinned entries: with nothing
    /// pinned and no prefetch, the hits of a trace equal
    /// [`simulate_lru`]'s for the same capacity.
    #[default]
    Lru,
    /// Least-frequently-used with aging: each `get` adds one to the
    /// entry's count; every `capacity` gets halve every count (so a once
    /// hot expert cools); ties go to the least recently used.
    LfuAging,
}

impl std::str::FromStr for Policy {
    type Err = crate::error::Error;
    fn from_str(s: &str) -> crate::error::Result<Self> {
        match s.trim().to_ascii_lowercase().as_str() {
            "lru" => Ok(Policy::Lru),
            "lfu" | "lfu-aging" | "lfu_aging" => Ok(Policy::LfuAging),
            other => Err(crate::error::Error::Config(format!(
                "expert cache policy {other:?}: expected \"lru\" or \"lfu\" (LFU with aging)"
            ))),
        }
    }
}

/// Recency and frequency of the entries present, by key.
#[derive(Debug)]
pub(crate) struct Order {
    policy: Policy,
    /// Gets between two halvings of every count (LFU).
    period: u64,
    tick: u64,
    gets: u64,
    /// tick of last use -> key, oldest first.
    by_age: BTreeMap<u64, ExpertKey>,
    meta: HashMap<ExpertKey, (u64, u32)>,
}

impl Order {
    pub(crate) fn new(policy: Policy, capacity: usize) -> Self {
        Order {
            policy,
            period: capacity.max(1) as u64,
            tick: 0,
            gets: 0,
            by_age: BTreeMap::new(),
            meta: HashMap::new(),
        }
    }

    /// An entry put in (a miss or a prefetch): the most recent, count 0.
    pub(crate) fn insert(&mut self, key: ExpertKey) {
        self.remove(key);
        self.tick += 1;
        self.by_age.insert(self.tick, key);
        self.meta.insert(key, (self.tick, 0));
    }

    /// A `get` of a present entry (or of one just inserted by the miss).
    pub(crate) fn used(&mut self, key: ExpertKey) {
        let Some(&(old, freq)) = self.meta.get(&key) else {
            return;
        };
        self.by_age.remove(&old);
        self.tick += 1;
        self.by_age.insert(self.tick, key);
        self.meta.insert(key, (self.tick, freq.saturating_add(1)));
        self.gets += 1;
        if self.policy == Policy::LfuAging && self.gets.is_multiple_of(self.period) {
            for m in self.meta.values_mut() {
                m.1 /= 2;
            }
        }
    }

    pub(crate) fn remove(&mut self, key: ExpertKey) {
        if let Some((t, _)) = self.meta.remove(&key) {
            self.by_age.remove(&t);
        }
    }

    /// The entry to evict among those `evictable` says may go: the least
    /// recently used (LRU), or the least frequently used, oldest first on
    /// a tie (LFU). `None` when none may go.
    pub(crate) fn victim(&self, mut evictable: impl FnMut(ExpertKey) -> bool) -> Option<ExpertKey> {
        match self.policy {
            Policy::Lru => self.by_age.values().copied().find(|&k| evictable(k)),
            Policy::LfuAging => {
                let mut best: Option<(u32, ExpertKey)> = None;
                for &k in self.by_age.values() {
                    let f = self.meta[&k].1;
                    if best.is_none_or(|(bf, _)| f < bf) && evictable(k) {
                        best = Some((f, k));
                    }
                }
                best.map(|b| b.1)
            }
        }
    }
}

/// Hits of `trace` in an LRU cache of `capacity` entries, by the book: a
/// list, most recent last. The oracle [`ExpertCache`](crate::ExpertCache)'s
/// hits are tested against (and the benchmark's expected hits).
pub fn simulate_lru(trace: &[ExpertKey], capacity: usize) -> u64 {
    let mut list: Vec<ExpertKey> = Vec::new();
    let mut hits = 0;
    for &k in trace {
        if let Some(i) = list.iter().position(|&x| x == k) {
            hits += 1;
            list.remove(i);
        } else if list.len() == capacity {
            if capacity == 0 {
                continue;
            }
            list.remove(0);
        }
        list.push(k);
    }
    hits
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// The Order driven as the cache drives it with nothing pinned.
    fn hits_by_order(trace: &[ExpertKey], capacity: usize) -> u64 {
        let mut o = Order::new(Policy::Lru, capacity);
        let mut present = std::collections::HashSet::new();
        let mut hits = 0;
        for &k in trace {
            if present.contains(&k) {
                hits += 1;
            } else {
                if present.len() == capacity {
                    let v = o.victim(|_| true).unwrap();
                    o.remove(v);
                    present.remove(&v);
                }
                o.insert(k);
                present.insert(k);
            }
            o.used(k);
        }
        hits
    }

    proptest! {
        #[test]
        fn lru_order_equals_the_book(trace in proptest::collection::vec((0usize..3, 0usize..12), 0..400), cap in 1usize..10) {
            prop_assert_eq!(hits_by_order(&trace, cap), simulate_lru(&trace, cap));
        }
    }

    #[test]
    fn a_pinned_entry_is_skipped_and_lfu_keeps_the_hot_one() {
        let mut o = Order::new(Policy::Lru, 3);
        for k in [(0, 1), (0, 2), (0, 3)] {
            o.insert(k);
            o.used(k);
        }
        assert_eq!(o.victim(|_| true), Some((0, 1)));
        assert_eq!(o.victim(|k| k != (0, 1)), Some((0, 2)));
        assert_eq!(o.victim(|_| false), None);
        let mut o = Order::new(Policy::LfuAging, 100);
        for k in [(0, 1), (0, 2), (0, 3)] {
            o.insert(k);
        }
        for _ in 0..5 {
            o.used((0, 1));
        }
        o.used((0, 3));
        o.used((0, 2));
        // (0,1) is the oldest by use order of insertion but the hottest.
        assert_eq!(o.victim(|_| true), Some((0, 3)));
        assert_eq!("lfu".parse::<Policy>().unwrap(), Policy::LfuAging);
        assert!("mru".parse::<Policy>().is_err());
    }

    #[test]
    fn aging_halves_counts_every_capacity_gets() {
        let mut o = Order::new(Policy::LfuAging, 4);
        o.insert((0, 0));
        o.insert((0, 1));
        for _ in 0..3 {
            o.used((0, 0)); // 3
        }
        o.used((0, 1)); // 4 gets: halve -> (0,0)=1, (0,1)=0
        assert_eq!(o.meta[&(0, 0)].1, 1);
        assert_eq!(o.meta[&(0, 1)].1, 0);
        assert_eq!(o.victim(|_| true), Some((0, 1)));
    }
}
