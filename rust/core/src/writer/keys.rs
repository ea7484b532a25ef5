//! The keys a writer has taken, to refuse one given again: every key of the writer's lifetime,
//! or, with `WriterConfig::key_memory`, the most recent ones, so that a writer that runs for
//! weeks (a server's) keeps bounded memory.

use std::collections::{HashSet, VecDeque};
use std::sync::Arc;

/// Keys taken, oldest forgotten past `limit` (each key stored once, shared by the set and the
/// order).
pub(crate) struct KeyMemory {
    limit: Option<usize>,
    keys: HashSet<Arc<str>>,
    order: VecDeque<Arc<str>>,
}

impl KeyMemory {
    /// Every key (`None`) or the last `limit` keys.
    pub fn new(limit: Option<u64>) -> KeyMemory {
        KeyMemory {
            limit: limit.map(|n| usize::try_from(n).unwrap_or(usize::MAX)),
            keys: HashSet::new(),
            order: VecDeque::new(),
        }
    }

    /// Whether `key` is remembered.
    pub fn contains(&self, key: &str) -> bool {
        self.keys.contains(key)
    }

    /// Remembers `key` (not remembered yet), forgetting the oldest beyond the limit.
    pub fn insert(&mut self, key: &str) {
        let key: Arc<str> = Arc::from(key);
        self.keys.insert(key.clone());
        if let Some(limit) = self.limit {
            self.order.push_back(key);
            while self.order.len() > limit {
                if let Some(old) = self.order.pop_front() {
                    self.keys.remove(&old);
                }
            }
        }
    }

    /// Keys remembered now.
    #[cfg(test)]
    pub fn len(&self) -> usize {
        self.keys.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unbounded_remembers_every_key() {
        let mut m = KeyMemory::new(None);
        for i in 0..1000 {
            m.insert(&format!("k{i}"));
        }
        assert_eq!(m.len(), 1000);
        assert!(m.contains("k0") && m.contains("k999") && !m.contains("k1000"));
    }

    #[test]
    fn bounded_keeps_the_most_recent() {
        let mut m = KeyMemory::new(Some(10));
        for i in 0..1000 {
            m.insert(&format!("k{i}"));
            assert!(m.len() <= 10);
        }
        assert!(m.contains("k990") && m.contains("k999"));
        assert!(!m.contains("k989") && !m.contains("k0"));
        m.insert("k0"); // forgotten: taken again
        assert!(m.contains("k0") && !m.contains("k990"));
    }
}
