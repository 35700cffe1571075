//! The local deny cache: once a counter has denied a request until a known
//! time, later requests that need at least as many units from it are denied
//! here, with the same headers, without asking the store.
//!
//! An abusive client then costs Redis one call per window instead of one per
//! request. The cache may deny a little longer than strictly needed when
//! another instance refunds units meanwhile; it never admits anything. It is
//! bounded: at `MAX_ENTRIES` it drops expired entries, and if none are, all.

use std::collections::HashMap;
use std::sync::RwLock;

use crate::limiter::Binding;

const MAX_ENTRIES: usize = 100_000;

#[derive(Clone, Copy)]
struct Entry {
    /// Unix ms until which the counter cannot give `cost` units.
    until_ms: u64,
    cost: u64,
    /// `binding.reset_ms` on this host's clock.
    reset_at_ms: u64,
    binding: Binding,
}

#[derive(Default)]
pub struct DenyCache {
    entries: RwLock<HashMap<Vec<u8>, Entry>>,
}

impl DenyCache {
    /// The binding of a cached denial for any of `keys`, if one still holds for
    /// a request of `cost` units, with its retry time brought up to `now`.
    pub fn check<'a>(
        &self,
        keys: impl Iterator<Item = &'a [u8]>,
        cost: u64,
        now: u64,
    ) -> Option<Binding> {
        let entries = self.entries.read().unwrap_or_else(|e| e.into_inner());
        if entries.is_empty() {
            return None;
        }
        keys.filter_map(|k| entries.get(k))
            .filter(|e| e.until_ms > now && cost >= e.cost)
            .max_by_key(|e| e.until_ms)
            .map(|e| Binding {
                retry_ms: e.until_ms - now,
                reset_in_ms: e.reset_at_ms.saturating_sub(now),
                remaining: 0,
                ..e.binding
            })
    }

    /// Remembers that `key` denied `cost` units until `now + binding.retry_ms`.
    pub fn insert(&self, key: &[u8], cost: u64, binding: Binding, now: u64) {
        let mut entries = self.entries.write().unwrap_or_else(|e| e.into_inner());
        if entries.len() >= MAX_ENTRIES {
            entries.retain(|_, e| e.until_ms > now);
            if entries.len() >= MAX_ENTRIES {
                entries.clear();
            }
        }
        entries.insert(
            key.to_vec(),
            Entry {
                until_ms: now + binding.retry_ms,
                cost,
                reset_at_ms: now + binding.reset_in_ms,
                binding,
            },
        );
    }

    pub fn remove(&self, key: &[u8]) {
        self.entries
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .remove(key);
    }

    /// Forgets every denial of `policy`'s counters (keys `{TAG}:POLICY:LIMIT`):
    /// its plans changed.
    pub fn forget_policy(&self, policy: &str) {
        let mut entries = self.entries.write().unwrap_or_else(|e| e.into_inner());
        entries.retain(|key, _| {
            let after_tag = key
                .iter()
                .position(|&b| b == b'}')
                .map_or(&key[..], |at| &key[at + 1..]);
            !(after_tag.starts_with(b":")
                && after_tag[1..].starts_with(policy.as_bytes())
                && after_tag.get(1 + policy.len()) == Some(&b':'))
        });
    }

    /// Forgets every denial.
    pub fn clear(&self) {
        self.entries
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .clear();
    }

    pub fn len(&self) -> usize {
        self.entries.read().unwrap_or_else(|e| e.into_inner()).len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}
