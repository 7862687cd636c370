//! A least-recently-used map under a byte budget (the cache of loaded adapters).

use std::collections::HashMap;
use std::hash::Hash;

pub struct ByteLru<K, V> {
    budget: usize,
    used: usize,
    /// Each entry's value, size and last use (a counter, larger = more recent).
    entries: HashMap<K, (V, usize, u64)>,
    clock: u64,
}

impl<K: Hash + Eq + Clone, V: Clone> ByteLru<K, V> {
    pub fn new(budget: usize) -> Self {
        ByteLru {
            budget,
            used: 0,
            entries: HashMap::new(),
            clock: 0,
        }
    }

    pub fn get(&mut self, key: &K) -> Option<V> {
        self.clock += 1;
        let clock = self.clock;
        self.entries.get_mut(key).map(|(v, _, used)| {
            *used = clock;
            v.clone()
        })
    }

    /// Inserts (or replaces) and evicts the least recently used entries until the rest fits the
    /// budget. The new entry always stays, even alone over the budget: it is about to be used.
    pub fn insert(&mut self, key: K, value: V, bytes: usize) {
        self.clock += 1;
        if let Some((_, old, _)) = self.entries.insert(key.clone(), (value, bytes, self.clock)) {
            self.used -= old;
        }
        self.used += bytes;
        while self.used > self.budget {
            let oldest = self
                .entries
                .iter()
                .filter(|(k, _)| **k != key)
                .min_by_key(|(_, (_, _, used))| *used)
                .map(|(k, _)| k.clone());
            let Some(oldest) = oldest else { break };
            if let Some((_, size, _)) = self.entries.remove(&oldest) {
                self.used -= size;
            }
        }
    }

    #[cfg(test)]
    fn used_bytes(&self) -> usize {
        self.used
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.entries.len()
    }

    #[cfg(test)]
    fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn evicts_least_recently_used_past_the_budget() {
        let mut lru = ByteLru::new(10);
        lru.insert("a", 1, 4);
        lru.insert("b", 2, 4);
        assert_eq!(lru.get(&"a"), Some(1)); // b is now the oldest
        lru.insert("c", 3, 4);
        assert_eq!(lru.get(&"b"), None);
        assert_eq!((lru.get(&"a"), lru.get(&"c")), (Some(1), Some(3)));
        assert_eq!(lru.used_bytes(), 8);

        // Replacing counts the new size only.
        lru.insert("a", 5, 2);
        assert_eq!(lru.used_bytes(), 6);
        // One entry over the whole budget evicts everything else but stays.
        lru.insert("big", 9, 50);
        assert_eq!(lru.len(), 1);
        assert_eq!(lru.get(&"big"), Some(9));
        assert_eq!(lru.used_bytes(), 50);
        lru.insert("d", 4, 1);
        assert_eq!((lru.get(&"big"), lru.get(&"d")), (None, Some(4)));
        assert!(!lru.is_empty());
    }
}
