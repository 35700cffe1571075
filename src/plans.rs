//! Plans at run time: which plan each identity is on, and how a change made
//! on one instance reaches the others.
//!
//! Assignments made through the admin API (`PUT /plans`) live in the store.
//! With Redis they are one hash, `PREFIX{plans}:assign` (field
//! `POLICY\0VALUE`, value the plan's name), beside a capped stream of
//! changes, `PREFIX{plans}:log`; both share a hash tag, so one cluster slot,
//! and `lua/plan.lua` writes a change to both at once. So they survive
//! restarts, and every instance sees them.
//!
//! Every instance keeps every assignment in memory ([`Plans`]), and a request
//! looks its plan up there, with no store call: steady state stays one store
//! round trip per decision, however many assignments there are. A task reads
//! the stream every [`POLL`] and applies what it finds; it reads the hash
//! whole at start, every [`RELOAD`], and after an error (it may have missed
//! changes, or the stream may have dropped some), so a change is in force on
//! every instance within a second, and a lost one within a minute. The same
//! stream carries unbans (`DELETE /usage`), so that no instance's deny cache
//! keeps refusing a client that was just lifted. With the memory store the
//! table is the store.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use arc_swap::ArcSwap;

use crate::store::Reply;
use crate::store::redis::RedisStore;

/// How often an instance reads the stream of changes.
pub const POLL: Duration = Duration::from_millis(250);
/// How often an instance reads every assignment again.
pub const RELOAD: Duration = Duration::from_secs(60);

/// Policy → identity value → plan name.
type Table = HashMap<Arc<str>, HashMap<Box<[u8]>, Arc<str>>>;

/// The run-time assignments this instance knows.
#[derive(Default)]
pub struct Plans {
    table: ArcSwap<Table>,
    /// The id of the last change of the stream applied; `None` until the
    /// hash has been read whole (and after an error).
    last: Mutex<Option<String>>,
}

/// What a poll found.
pub enum Polled {
    /// These changes, applied to the table.
    Changes(Vec<Change>),
    /// The whole table, read again: what changed is not known, so denials
    /// cached before may not hold any more.
    Reloaded,
}

/// One change, as the stream tells it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Change {
    /// `value` of `policy` is on `plan` (`None`: back to the file's plan or
    /// the default).
    Assign {
        policy: Arc<str>,
        value: Vec<u8>,
        plan: Option<Arc<str>>,
    },
    /// The counters of `spec = value` under `policy` were reset.
    Unban {
        policy: Arc<str>,
        spec: String,
        value: Vec<u8>,
    },
}

impl Plans {
    /// The plan `value` of `policy` was assigned at run time, if any.
    pub fn get(&self, policy: &str, value: &[u8]) -> Option<Arc<str>> {
        self.table.load().get(policy)?.get(value).cloned()
    }

    /// Every run-time assignment of `policy`, sorted by value.
    pub fn of(&self, policy: &str) -> Vec<(Vec<u8>, Arc<str>)> {
        let table = self.table.load();
        let mut all: Vec<_> = table
            .get(policy)
            .into_iter()
            .flatten()
            .map(|(v, p)| (v.to_vec(), p.clone()))
            .collect();
        all.sort();
        all
    }

    /// Applies assignments and withdrawals to the table (in one copy of it:
    /// a poll applies all it read at once).
    pub fn apply(&self, changes: &[Change]) {
        let assigns = changes.iter().any(|c| matches!(c, Change::Assign { .. }));
        if !assigns {
            return;
        }
        let mut table = Table::clone(&self.table.load());
        for change in changes {
            let Change::Assign {
                policy,
                value,
                plan,
            } = change
            else {
                continue;
            };
            let of_policy = table.entry(policy.clone()).or_default();
            match plan {
                Some(plan) => {
                    of_policy.insert(value.clone().into_boxed_slice(), plan.clone());
                }
                None => {
                    of_policy.remove(value.as_slice());
                }
            }
        }
        self.table.store(Arc::new(table));
    }

    /// Reads the changes made since the last poll, or every assignment when
    /// `reload` says so (or none were read yet, or the last poll failed).
    /// The caller applies the result to its deny cache.
    pub async fn poll(
        &self,
        redis: &RedisStore,
        reload: bool,
    ) -> Result<Polled, crate::store::StoreError> {
        let [hash, log] = redis.plan_keys();
        let last = self.last.lock().unwrap_or_else(|e| e.into_inner()).clone();
        let Some(last) = last.filter(|_| !reload) else {
            return self.reload(redis, &hash, &log).await;
        };
        let from = format!("({last}");
        let reply = redis
            .call(&[b"XRANGE", &log, from.as_bytes(), b"+", b"COUNT", b"10000"])
            .await;
        let entries = match reply {
            Ok(r) => r,
            Err(e) => {
                *self.last.lock().unwrap_or_else(|e| e.into_inner()) = None;
                return Err(e);
            }
        };
        let (changes, newest) = read_entries(&entries);
        self.apply(&changes);
        if let Some(id) = newest {
            *self.last.lock().unwrap_or_else(|e| e.into_inner()) = Some(id);
        }
        Ok(Polled::Changes(changes))
    }

    /// Reads the hash whole, and where the stream stands before it.
    async fn reload(
        &self,
        redis: &RedisStore,
        hash: &[u8],
        log: &[u8],
    ) -> Result<Polled, crate::store::StoreError> {
        // The stream's newest id first: a change made while the hash is read
        // is then read again from the stream, never missed.
        let newest = redis
            .call(&[b"XREVRANGE", log, b"+", b"-", b"COUNT", b"1"])
            .await?;
        let newest = read_entries(&newest).1.unwrap_or_else(|| "0-0".into());
        let mut table = Table::new();
        let mut cursor = b"0".to_vec();
        loop {
            let reply = redis
                .call(&[b"HSCAN", hash, &cursor, b"COUNT", b"1000"])
                .await?;
            let Reply::Array(Some(parts)) = reply else {
                break;
            };
            let [Reply::Bulk(Some(next)), Reply::Array(Some(pairs))] = &parts[..] else {
                break;
            };
            for pair in pairs.chunks_exact(2) {
                let (Reply::Bulk(Some(field)), Reply::Bulk(Some(plan))) = (&pair[0], &pair[1])
                else {
                    continue;
                };
                let Some((policy, value)) = split_field(field) else {
                    continue;
                };
                table
                    .entry(Arc::from(policy))
                    .or_default()
                    .insert(value.into(), Arc::from(String::from_utf8_lossy(plan)));
            }
            if next == b"0" {
                break;
            }
            cursor = next.clone();
        }
        self.table.store(Arc::new(table));
        *self.last.lock().unwrap_or_else(|e| e.into_inner()) = Some(newest);
        Ok(Polled::Reloaded)
    }
}

/// `POLICY\0VALUE` as the hash's field (and a change's).
pub fn field(policy: &str, value: &[u8]) -> Vec<u8> {
    let mut f = Vec::with_capacity(policy.len() + 1 + value.len());
    f.extend_from_slice(policy.as_bytes());
    f.push(0);
    f.extend_from_slice(value);
    f
}

/// `POLICY\0SPEC\0VALUE`: an unban's field in the stream (see
/// [`Change::Unban`]).
pub fn unban_field(policy: &str, spec: &crate::config::KeySpec, value: &[u8]) -> Vec<u8> {
    let mut spec_and_value = spec.to_string().into_bytes();
    spec_and_value.push(0);
    spec_and_value.extend_from_slice(value);
    field(policy, &spec_and_value)
}

/// A field's policy and value (policy names hold no NUL; values may).
fn split_field(field: &[u8]) -> Option<(&str, &[u8])> {
    let at = field.iter().position(|&b| b == 0)?;
    Some((std::str::from_utf8(&field[..at]).ok()?, &field[at + 1..]))
}

/// The changes of an `XRANGE` answer, and the id of its last entry.
fn read_entries(reply: &Reply) -> (Vec<Change>, Option<String>) {
    let mut changes = Vec::new();
    let mut newest = None;
    let Reply::Array(Some(entries)) = reply else {
        return (changes, newest);
    };
    for entry in entries {
        let Reply::Array(Some(parts)) = entry else {
            continue;
        };
        let [Reply::Bulk(Some(id)), Reply::Array(Some(kv))] = &parts[..] else {
            continue;
        };
        newest = Some(String::from_utf8_lossy(id).into_owned());
        let get = |name: &[u8]| {
            kv.chunks_exact(2).find_map(|p| match (&p[0], &p[1]) {
                (Reply::Bulk(Some(k)), Reply::Bulk(Some(v))) if k == name => Some(v.as_slice()),
                _ => None,
            })
        };
        let (Some(op), Some(f), Some(plan)) = (get(b"op"), get(b"field"), get(b"plan")) else {
            continue;
        };
        let Some((policy, value)) = split_field(f) else {
            continue;
        };
        let policy: Arc<str> = Arc::from(policy);
        match op {
            b"set" => changes.push(Change::Assign {
                policy,
                value: value.to_vec(),
                plan: Some(Arc::from(String::from_utf8_lossy(plan))),
            }),
            b"del" => changes.push(Change::Assign {
                policy,
                value: value.to_vec(),
                plan: None,
            }),
            b"unban" => {
                if let Some((spec, value)) = split_field(value) {
                    changes.push(Change::Unban {
                        policy,
                        spec: spec.to_string(),
                        value: value.to_vec(),
                    });
                }
            }
            _ => {}
        }
    }
    (changes, newest)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fields_keep_any_value_bytes() {
        let f = field("api", b"k\0\xff");
        assert_eq!(split_field(&f), Some(("api", &b"k\0\xff"[..])));
    }

    #[test]
    fn changes_apply_in_order() {
        let plans = Plans::default();
        let set = |v: &[u8], p: Option<&str>| Change::Assign {
            policy: Arc::from("api"),
            value: v.to_vec(),
            plan: p.map(Arc::from),
        };
        plans.apply(&[
            set(b"a", Some("gold")),
            set(b"b", Some("gold")),
            set(b"a", None),
        ]);
        assert_eq!(plans.get("api", b"a"), None);
        assert_eq!(plans.get("api", b"b").as_deref(), Some("gold"));
        assert_eq!(plans.of("api").len(), 1);
    }
}
