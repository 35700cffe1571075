//! The memory store: counters in this process, behind one mutex.
//!
//! One lock keeps a multi-counter decision all-or-nothing with no lock
//! ordering to get wrong. The counters of one identity under one policy (the
//! `{TAG}:POLICY` part of their keys, which the Redis store packs into one
//! key) share one map entry, so a decision is one hash lookup per identity,
//! not one per limit. Memory is bounded twice: counters past their expiry are
//! swept, and at `max_keys` counters the expired ones go first, then
//! identities in arbitrary order, a sixteenth of `max_keys` worth, never those
//! of the decision being made (the others start afresh: under such a flood,
//! forgetting a few counters beats running out of memory).

use std::collections::{HashMap, VecDeque};
use std::sync::Mutex;
use std::time::Duration;

// foldhash, seeded per process: the seed, unknown to clients, keeps them from
// aiming keys at one bucket (the SHA-256-derived tags are unkeyed, so a client
// can compute them); SipHash was the larger part of a lookup.
type Map = HashMap<Vec<u8>, Group, foldhash::fast::RandomState>;

use super::{Counter, CounterState, Outcome, PerCounter};
use crate::config::Algorithm;

pub struct MemoryStore {
    inner: Mutex<Inner>,
    max_keys: usize,
}

struct Inner {
    /// By the `{TAG}:POLICY` part of the counters' keys.
    map: Map,
    /// Counters held, over all groups: what `max_keys` bounds.
    held: usize,
    /// Source of `log` marks: a refund removes exactly the entry it added.
    next_id: u64,
}

/// One identity's counters under one policy, each under the rest of its key
/// (`:LIMIT`). A policy has a few limits: a list beats a map.
#[derive(Default)]
struct Group(Vec<(Box<[u8]>, Entry)>);

impl Group {
    /// The counter named `id`; looked for at `hint` first (counters are
    /// added in the order the limiter lists them, and asked for in it).
    fn get(&mut self, id: &[u8], hint: usize) -> Option<&mut Entry> {
        let at = match self.0.get(hint) {
            Some((k, _)) if **k == *id => hint,
            _ => self.0.iter().position(|(k, _)| **k == *id)?,
        };
        Some(&mut self.0[at].1)
    }

    /// Keeps the counters `keep` says to; returns how many went.
    fn retain(&mut self, mut keep: impl FnMut(&[u8], &Entry) -> bool) -> usize {
        let before = self.0.len();
        self.0.retain(|(k, e)| keep(k, e));
        before - self.0.len()
    }
}

#[cfg_attr(test, derive(Clone, Debug, PartialEq))]
struct Entry {
    state: State,
    /// Unix ms after which the entry holds nothing that counts.
    expires_ms: u64,
}

#[cfg_attr(test, derive(Clone, Debug, PartialEq))]
enum State {
    /// `window`: the window's name (see [`fixed_window`]).
    Fixed { window: u64, count: u64 },
    /// (bucket index, units), oldest first, and the sum of their units:
    /// a check then walks only the buckets that left the window, not all
    /// of them (up to 1,000).
    Sliding {
        buckets: VecDeque<(u64, u64)>,
        total: u64,
    },
    /// (time ms, units, id), oldest first.
    Log { entries: VecDeque<(u64, u64, u64)> },
    /// Theoretical arrival time, unix µs.
    Gcra { tat_us: u64 },
    /// Slots held: (mark, unix ms the lease ends).
    Leases { held: Vec<(u64, u64)> },
}

/// A counter's key as (its group, its name in the group).
fn split(c: &Counter) -> (&[u8], &[u8]) {
    c.key.split_at(c.group_len.min(c.key.len()))
}

impl MemoryStore {
    pub fn new(max_keys: usize) -> MemoryStore {
        MemoryStore {
            inner: Mutex::new(Inner {
                map: Map::default(),
                held: 0,
                next_id: 1,
            }),
            max_keys: max_keys.max(1),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        // A panic while holding the lock cannot leave a counter half-written
        // (each update is one assignment), so a poisoned lock is still usable.
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Each counter is looked at once: checked, and charged at once while
    /// every counter so far allows. One that refuses stops the charging, and
    /// what was charged is given back (the rare case pays more lookups; a
    /// give-back at the same instant restores what a check sees). Counters
    /// of one group in a row (the limiter lists an identity's together)
    /// share one lookup.
    pub fn acquire(&self, counters: &[Counter], cost: u64, charge: bool, now: u64) -> Outcome {
        let mut inner = self.lock();
        let inner = &mut *inner;
        let mut states = PerCounter::with_capacity(counters.len());
        let mut marks: PerCounter<u64> = smallvec::smallvec![0; counters.len()];
        let mut allowed = true;
        // The counters charged so far: always the first ones.
        let mut charged = 0;
        // The group of the counter before, its name, and how many of its
        // counters came before this one.
        let (mut group, mut name_of, mut nth) = (None, &[][..], 0);
        for (i, (c, mark)) in counters.iter().zip(marks.iter_mut()).enumerate() {
            let (name, id) = split(c);
            if i == 0 || name != name_of {
                (group, name_of, nth) = (inner.map.get_mut(name), name, 0);
            }
            let mut entry = group.as_deref_mut().and_then(|g| g.get(id, nth));
            nth += 1;
            // May this counter be charged if it allows?
            let may = allowed && charge;
            let fused = match entry.as_deref_mut() {
                Some(e) if e.expires_ms > now => check_and_charge(e, c, cost, now, may),
                _ => None,
            };
            let (s, charged_at) = match fused {
                Some(done) => done,
                None => {
                    let live = entry.as_deref().filter(|e| e.expires_ms > now);
                    let s = check(live.map(|e| &e.state), c, cost, now);
                    let at = match entry {
                        _ if !may || s.retry_ms > 0 => None,
                        Some(entry) => Some(update(entry, c, cost, now, &mut inner.next_id)),
                        None => {
                            // A new counter (rare): it pays its own lookups.
                            let at = self.add(inner, c, counters, cost, now);
                            group = inner.map.get_mut(name);
                            Some(at)
                        }
                    };
                    (s, at)
                }
            };
            allowed &= s.retry_ms == 0;
            states.push(s);
            if let Some(at) = charged_at {
                *mark = at;
                charged += 1;
            }
        }
        if !allowed {
            for (c, mark) in counters.iter().zip(marks.iter_mut()).take(charged) {
                if let Some(e) = entry(&mut inner.map, c) {
                    give_back(&mut e.state, c, *mark, cost, now);
                }
                *mark = 0;
            }
        }
        Outcome {
            allowed,
            now_ms: now,
            states,
            marks,
        }
    }

    pub fn charge(&self, counters: &[Counter], cost: u64, now: u64) {
        let mut inner = self.lock();
        for c in counters {
            self.add(&mut inner, c, counters, cost, now);
        }
    }

    /// Charges `extra` more units to the request whose marks are `marks`
    /// (without checking: the count may pass the limit), and frees its
    /// `concurrency` slots.
    pub fn charge_more(&self, counters: &[Counter], marks: &[u64], extra: u64, now: u64) {
        let mut inner = self.lock();
        for (c, &mark) in counters.iter().zip(marks) {
            if let Algorithm::Concurrency { .. } = c.algorithm {
                if let Some(e) = entry(&mut inner.map, c) {
                    give_back(&mut e.state, c, mark, 0, now);
                }
            } else {
                // As acquire.lua does: a log keeps one entry per unit, and
                // past its limit more units of one instant change nothing.
                let units = match c.algorithm {
                    Algorithm::Log => extra.min(c.limit + 1),
                    _ => extra,
                };
                self.add(&mut inner, c, counters, units, now);
            }
        }
    }

    /// Renews the `concurrency` slots `marks` took, for their lease from
    /// `now`; returns how many were still held.
    pub fn renew(&self, counters: &[Counter], marks: &[u64], now: u64) -> usize {
        let mut inner = self.lock();
        let mut renewed = 0;
        for (c, &mark) in counters.iter().zip(marks) {
            let Algorithm::Concurrency { lease } = c.algorithm else {
                continue;
            };
            if let Some(e) = entry(&mut inner.map, c)
                && let State::Leases { held } = &mut e.state
                && let Some(slot) = held.iter_mut().find(|l| l.0 == mark && l.1 > now)
            {
                slot.1 = now + lease.as_millis() as u64;
                e.expires_ms = e.expires_ms.max(slot.1);
                renewed += 1;
            }
        }
        renewed
    }

    pub fn refund(&self, counters: &[Counter], marks: &[u64], cost: u64, now: u64) {
        let mut inner = self.lock();
        for (c, &mark) in counters.iter().zip(marks) {
            if let Some(e) = entry(&mut inner.map, c).filter(|e| e.expires_ms > now) {
                give_back(&mut e.state, c, mark, cost, now);
            }
        }
    }

    pub fn forget(&self, counters: &[Counter]) {
        let mut inner = self.lock();
        let Inner { map, held, .. } = &mut *inner;
        for c in counters {
            let (name, id) = split(c);
            let Some(g) = map.get_mut(name) else {
                continue;
            };
            *held -= g.retain(|k, _| k != id);
            if g.0.is_empty() {
                map.remove(name);
            }
        }
    }

    /// Drops expired counters; the server calls it now and then.
    pub fn sweep(&self, now: u64) {
        sweep(&mut self.lock(), now);
    }

    /// How many counters are held (for tests and metrics).
    pub fn len(&self) -> usize {
        self.lock().held
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Makes room for a new counter at `max_keys`: expired counters go, then
    /// identities, a sixteenth of `max_keys` of them so that this is rare.
    /// The groups of `spare` (the decision adding the counter) stay: a
    /// decision never drops what it charged itself.
    fn make_room(&self, inner: &mut Inner, spare: &[Counter], now: u64) {
        sweep(inner, now);
        if inner.held < self.max_keys {
            return;
        }
        let mut excess = (inner.held + 1 - self.max_keys).max(self.max_keys / 16);
        let Inner { map, held, .. } = inner;
        map.retain(|name, g| {
            if excess == 0 || spare.iter().any(|c| split(c).0 == &name[..]) {
                return true;
            }
            excess = excess.saturating_sub(g.0.len());
            *held -= g.0.len();
            false
        });
    }

    /// Adds `cost` units to a counter, made if missing (`spare`: the
    /// decision's counters, see `make_room`); returns the mark a refund needs.
    fn add(&self, inner: &mut Inner, c: &Counter, spare: &[Counter], cost: u64, now: u64) -> u64 {
        // Looked up by reference first: keys are copied only for a new counter.
        if let Some(entry) = entry(&mut inner.map, c) {
            return update(entry, c, cost, now, &mut inner.next_id);
        }
        if inner.held >= self.max_keys {
            self.make_room(inner, spare, now);
        }
        let (name, id) = split(c);
        let mut entry = Entry {
            state: empty(c.algorithm),
            expires_ms: 0,
        };
        let mark = update(&mut entry, c, cost, now, &mut inner.next_id);
        let group = match inner.map.get_mut(name) {
            Some(g) => g,
            None => inner.map.entry(name.to_vec()).or_default(),
        };
        group.0.push((id.into(), entry));
        inner.held += 1;
        mark
    }
}

/// Counter `c`'s entry, if it has one.
fn entry<'m>(map: &'m mut Map, c: &Counter) -> Option<&'m mut Entry> {
    let (name, id) = split(c);
    map.get_mut(name)?.get(id, 0)
}

/// Charges `cost` units to an entry (started afresh if it had expired);
/// returns the mark a refund needs.
fn update(entry: &mut Entry, c: &Counter, cost: u64, now: u64, next_id: &mut u64) -> u64 {
    let id = *next_id;
    *next_id += 1;
    if entry.expires_ms <= now {
        entry.state = empty(c.algorithm);
    }
    let mark = charge(&mut entry.state, c, cost, now, id);
    entry.expires_ms = expiry(&entry.state, c);
    mark
}

fn sweep(inner: &mut Inner, now: u64) {
    let Inner { map, held, .. } = inner;
    map.retain(|_, g| {
        *held -= g.retain(|_, e| e.expires_ms > now);
        !g.0.is_empty()
    });
}

fn empty(algorithm: Algorithm) -> State {
    match algorithm {
        Algorithm::Fixed => State::Fixed {
            window: 0,
            count: 0,
        },
        Algorithm::Sliding { .. } => State::Sliding {
            buckets: VecDeque::new(),
            total: 0,
        },
        Algorithm::Log => State::Log {
            entries: VecDeque::new(),
        },
        Algorithm::Gcra { .. } => State::Gcra { tat_us: 0 },
        Algorithm::Concurrency { .. } => State::Leases { held: Vec::new() },
    }
}

/// Sliding window geometry: (precision ms, buckets per window, current bucket).
/// A clock behind the newest bucket held (the wall clock stepped back)
/// counts into that bucket, as the Lua script does: the buckets stay in
/// order, and the counter lives as long as its newest units need.
fn buckets(
    c: &Counter,
    precision_ms: u64,
    now: u64,
    held: &VecDeque<(u64, u64)>,
) -> (u64, u64, u64) {
    let b = now / precision_ms;
    let b = held.back().map_or(b, |&(newest, _)| newest.max(b));
    (precision_ms, c.window_ms / precision_ms, b)
}

/// GCRA geometry in µs: (emission interval, capacity: the burst, and the
/// `delay` a request may be held).
fn gcra(c: &Counter, burst: u64, delay: Duration) -> (u64, u64) {
    let t = (c.window_ms * 1000 / c.limit).max(1);
    (t, t.saturating_mul(burst) + delay.as_micros() as u64)
}

/// The usual decision in one pass: a live `fixed` or `sliding` counter is
/// checked and, when it allows and `charge` is set, charged with the window
/// position the check found (checking, then charging with [`update`], read
/// the state and divided the clock twice). Gives the counter's state and the
/// refund mark if it was charged; `None` for the other cases, which take
/// [`check`] and [`update`].
fn check_and_charge(
    entry: &mut Entry,
    c: &Counter,
    cost: u64,
    now: u64,
    charge: bool,
) -> Option<(CounterState, Option<u64>)> {
    match (&mut entry.state, c.algorithm) {
        (State::Fixed { window, count }, Algorithm::Fixed) => {
            let (current, reset_ms) = fixed_window(c, now);
            let used = if *window == current { *count } else { 0 };
            let s = fixed_verdict(c, used, cost, now, reset_ms);
            if !(charge && s.retry_ms == 0) {
                return Some((s, None));
            }
            *window = current;
            *count = used + cost;
            entry.expires_ms = reset_ms;
            Some((s, Some(current)))
        }
        (
            State::Sliding {
                buckets: all,
                total,
            },
            Algorithm::Sliding { precision },
        ) => {
            let (p, n, b) = buckets(c, precision.as_millis() as u64, now, all);
            let s = sliding_verdict(all, *total, c, cost, now, (p, n, b));
            if !(charge && s.retry_ms == 0) {
                return Some((s, None));
            }
            add_to_bucket(all, total, n, b, cost);
            // As `expiry` says: the newest bucket, now `b`, leaves the window.
            entry.expires_ms = (b + n) * p;
            Some((s, Some(b)))
        }
        _ => None,
    }
}

/// A `fixed` counter's window at `now`: (its name, when it ends). An
/// epoch-aligned window is named by its start, a calendar one by its end
/// (the store is told no start; see [`super::Ends`]), as acquire.lua does.
fn fixed_window(c: &Counter, now: u64) -> (u64, u64) {
    match c.calendar {
        Some(ends) => {
            let end = ends.pick(now);
            (end, end)
        }
        None => {
            let start = now - now % c.window_ms;
            (start, start + c.window_ms)
        }
    }
}

/// A `fixed` counter's verdict: `used` units of this window taken.
fn fixed_verdict(c: &Counter, used: u64, cost: u64, now: u64, reset_ms: u64) -> CounterState {
    verdict(c.limit, used, cost, reset_ms, || {
        // More than the limit can never pass: say so with a whole window
        // (a calendar one: until it ends).
        if cost > c.limit && c.calendar.is_none() {
            c.window_ms
        } else {
            reset_ms.saturating_sub(now)
        }
    })
}

/// A `sliding` counter's verdict, from its buckets (oldest first), their
/// sum, and the window's geometry (see [`buckets`]).
fn sliding_verdict(
    all: &VecDeque<(u64, u64)>,
    total: u64,
    c: &Counter,
    cost: u64,
    now: u64,
    (p, n, b): (u64, u64, u64),
) -> CounterState {
    // A bucket refunded to zero counts for nothing, not even the reset.
    // (Filtered in place: collecting them cost an allocation per decision.)
    let live = || all.iter().copied().filter(|&(i, u)| i + n > b && u > 0);
    // Buckets leave the window from the front.
    let gone: u64 = all
        .iter()
        .take_while(|&&(i, _)| i + n <= b)
        .map(|&(_, u)| u)
        .sum();
    let used = total.saturating_sub(gone);
    // Reset: when every unit counted now has left the window. A request
    // that passes lands in the current bucket; one that is refused leaves
    // the newest bucket holding units as the last.
    let reset_ms = if used + cost <= c.limit {
        (b + n) * p
    } else {
        (live().next_back().map_or(b, |(i, _)| i) + n) * p
    };
    verdict(c.limit, used, cost, reset_ms, || {
        free_after(live().map(|(i, u)| ((i + n) * p, u)), used + cost - c.limit)
            .map_or(c.window_ms, |t| t - now)
    })
}

/// Where a counter stands for a request of `cost` units, without changing it.
fn check(state: Option<&State>, c: &Counter, cost: u64, now: u64) -> CounterState {
    match (c.algorithm, state) {
        (Algorithm::Fixed, state) => {
            let (current, reset_ms) = fixed_window(c, now);
            let count = match state {
                Some(State::Fixed { window, count }) if *window == current => *count,
                _ => 0,
            };
            fixed_verdict(c, count, cost, now, reset_ms)
        }
        (Algorithm::Sliding { precision }, state) => {
            let none = VecDeque::new();
            let (held, total) = match state {
                Some(State::Sliding { buckets, total }) => (buckets, *total),
                _ => (&none, 0),
            };
            let geometry = buckets(c, precision.as_millis() as u64, now, held);
            sliding_verdict(held, total, c, cost, now, geometry)
        }
        (Algorithm::Log, state) => {
            let live: Vec<(u64, u64)> = match state {
                Some(State::Log { entries }) => entries
                    .iter()
                    .filter(|(t, _, _)| t + c.window_ms > now)
                    .map(|&(t, u, _)| (t, u))
                    .collect(),
                _ => Vec::new(),
            };
            let used: u64 = live.iter().map(|(_, u)| u).sum();
            let reset_ms = live.first().map_or(now, |(t, _)| *t) + c.window_ms;
            verdict(c.limit, used, cost, reset_ms, || {
                free_after(
                    live.iter().map(|&(t, u)| (t + c.window_ms, u)),
                    used + cost - c.limit,
                )
                .map_or(c.window_ms, |t| t - now)
            })
        }
        (Algorithm::Concurrency { .. }, state) => {
            let used = match state {
                Some(State::Leases { held }) => held.iter().filter(|l| l.1 > now).count() as u64,
                _ => 0,
            };
            concurrency_verdict(c.limit, used, cost, now)
        }
        (Algorithm::Gcra { burst, delay }, state) => {
            let (t, cap) = gcra(c, burst, delay);
            let now_us = now * 1000;
            let tat = match state {
                Some(State::Gcra { tat_us }) => (*tat_us).max(now_us),
                _ => now_us,
            };
            let new_tat = tat.saturating_add(cost.saturating_mul(t));
            if new_tat - now_us <= cap {
                CounterState {
                    remaining: (cap - (new_tat - now_us)) / t,
                    reset_ms: new_tat.div_ceil(1000),
                    retry_ms: 0,
                }
            } else {
                let wait_us = if cost.saturating_mul(t) > cap {
                    c.window_ms * 1000
                } else {
                    new_tat - cap - now_us
                };
                CounterState {
                    remaining: cap.saturating_sub(tat - now_us) / t,
                    reset_ms: tat.div_ceil(1000),
                    retry_ms: wait_us.div_ceil(1000).max(1),
                }
            }
        }
    }
}

/// A `concurrency` counter's verdict: `used` slots held of `limit`. A
/// request takes one slot whatever its cost (a check with cost 0, none).
/// The reset is now (a slot comes back when its request ends); a denial
/// says to retry in a second, as no one knows when a request ends.
pub(super) fn concurrency_verdict(limit: u64, used: u64, cost: u64, now: u64) -> CounterState {
    let unit = cost.min(1);
    if used + unit <= limit {
        CounterState {
            remaining: limit - used - unit,
            reset_ms: now,
            retry_ms: 0,
        }
    } else {
        CounterState {
            remaining: 0,
            reset_ms: now + CONCURRENCY_RETRY_MS,
            retry_ms: CONCURRENCY_RETRY_MS,
        }
    }
}

/// How long a request refused by a `concurrency` limit is told to wait.
pub const CONCURRENCY_RETRY_MS: u64 = 1000;

/// A counting algorithm's verdict: `used` units already taken of `limit`.
fn verdict(
    limit: u64,
    used: u64,
    cost: u64,
    reset_ms: u64,
    retry: impl FnOnce() -> u64,
) -> CounterState {
    if used + cost <= limit {
        CounterState {
            remaining: limit - used - cost,
            reset_ms,
            retry_ms: 0,
        }
    } else {
        CounterState {
            remaining: limit.saturating_sub(used),
            reset_ms,
            retry_ms: retry().max(1),
        }
    }
}

/// The first time (unix ms) at which `need` units have been freed, given
/// (time freed, units) pairs in time order; `None` if they never are.
fn free_after(frees: impl Iterator<Item = (u64, u64)>, need: u64) -> Option<u64> {
    let mut freed = 0;
    for (at, units) in frees {
        freed += units;
        if freed >= need {
            return Some(at);
        }
    }
    None
}

/// Adds `cost` units; returns the refund mark.
fn charge(state: &mut State, c: &Counter, cost: u64, now: u64, id: u64) -> u64 {
    match (state, c.algorithm) {
        (State::Fixed { window, count }, _) => {
            let (current, _) = fixed_window(c, now);
            if *window != current {
                *window = current;
                *count = 0;
            }
            *count += cost;
            current
        }
        (
            State::Sliding {
                buckets: list,
                total,
            },
            Algorithm::Sliding { precision },
        ) => {
            let (_, n, b) = buckets(c, precision.as_millis() as u64, now, list);
            add_to_bucket(list, total, n, b, cost);
            b
        }
        (State::Log { entries }, _) => {
            while entries
                .front()
                .is_some_and(|(t, _, _)| t + c.window_ms <= now)
            {
                entries.pop_front();
            }
            entries.push_back((now, cost, id));
            id
        }
        (State::Leases { held }, Algorithm::Concurrency { lease }) => {
            held.retain(|l| l.1 > now);
            held.push((id, now + lease.as_millis() as u64));
            id
        }
        (State::Gcra { tat_us }, Algorithm::Gcra { burst, delay }) => {
            let (t, _) = gcra(c, burst, delay);
            *tat_us = (*tat_us)
                .max(now * 1000)
                .saturating_add(cost.saturating_mul(t));
            0
        }
        // The algorithm of a counter changed under its key (a reload); start anew.
        (state, _) => {
            *state = empty(c.algorithm);
            charge(state, c, cost, now, id)
        }
    }
}

/// Adds `cost` units to bucket `b` of a sliding window of `n` buckets,
/// first dropping the buckets that have left it.
fn add_to_bucket(list: &mut VecDeque<(u64, u64)>, total: &mut u64, n: u64, b: u64, cost: u64) {
    while let Some(&(i, units)) = list.front()
        && i + n <= b
    {
        *total -= units;
        list.pop_front();
    }
    match list.back_mut() {
        Some((i, units)) if *i == b => *units += cost,
        _ => list.push_back((b, cost)),
    }
    *total += cost;
}

fn give_back(state: &mut State, c: &Counter, mark: u64, cost: u64, now: u64) {
    match (state, c.algorithm) {
        (State::Fixed { window, count }, Algorithm::Fixed) if *window == mark => {
            *count = count.saturating_sub(cost);
        }
        (State::Sliding { buckets, total }, Algorithm::Sliding { .. }) => {
            if let Some((_, units)) = buckets.iter_mut().find(|(i, _)| *i == mark) {
                let back = cost.min(*units);
                *units -= back;
                *total -= back;
            }
        }
        (State::Log { entries }, Algorithm::Log) => {
            if let Some(pos) = entries
                .iter()
                .position(|&(t, _, id)| id == mark && t + c.window_ms > now)
            {
                let units = &mut entries[pos].1;
                *units -= cost.min(*units);
                if *units == 0 {
                    entries.remove(pos);
                }
            }
        }
        (State::Leases { held }, Algorithm::Concurrency { .. }) => {
            held.retain(|l| l.0 != mark);
        }
        (State::Gcra { tat_us }, Algorithm::Gcra { burst, delay }) => {
            let (t, _) = gcra(c, burst, delay);
            *tat_us = tat_us
                .saturating_sub(cost.saturating_mul(t))
                .max(now * 1000);
        }
        _ => {}
    }
}

fn expiry(state: &State, c: &Counter) -> u64 {
    match (state, c.algorithm) {
        (State::Fixed { window, .. }, _) => match c.calendar {
            Some(_) => *window,
            None => window + c.window_ms,
        },
        (State::Sliding { buckets, .. }, Algorithm::Sliding { precision }) => {
            let p = precision.as_millis() as u64;
            buckets.back().map_or(0, |(i, _)| (i + c.window_ms / p) * p)
        }
        (State::Log { entries }, _) => entries.back().map_or(0, |(t, _, _)| t + c.window_ms),
        (State::Gcra { tat_us }, _) => tat_us.div_ceil(1000),
        (State::Leases { held }, _) => held.iter().map(|l| l.1).max().unwrap_or(0),
        _ => 0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Counter `limit` (of three) of identity `who`: one group per identity.
    fn counter(who: u32, limit: u64) -> Counter {
        let group = format!("{{{who:08}}}:p");
        Counter {
            key: format!("{group}:{limit}").as_bytes().into(),
            group_len: group.len(),
            limit: 100,
            window_ms: 1_000 * limit,
            algorithm: Algorithm::Fixed,
            calendar: None,
        }
    }

    fn identity(who: u32) -> Vec<Counter> {
        (1..=3).map(|l| counter(who, l)).collect()
    }

    #[test]
    fn groups_count_their_counters_for_max_keys_sweep_and_forget() {
        let store = MemoryStore::new(10);
        let now = 1_000_000;
        for who in 0..20 {
            assert!(store.acquire(&identity(who), 1, true, now).allowed);
            assert!(store.len() <= 10, "{} counters held", store.len());
        }
        // The last identity is whole, and counts on.
        let last = identity(19);
        let out = store.acquire(&last, 1, true, now);
        assert_eq!(out.states[0].remaining, 98);

        // Forgetting one limit of an identity leaves its other two.
        let before = store.len();
        store.forget(&last[1..2]);
        assert_eq!(store.len(), before - 1);
        assert_eq!(store.acquire(&last, 1, true, now).states[0].remaining, 97);
        assert_eq!(store.acquire(&last, 1, true, now).states[1].remaining, 98);

        // The 1 s counters expire first, the 3 s ones last.
        store.sweep(now + 1_000);
        let after_one = store.len();
        assert!(after_one < before, "{after_one} of {before}");
        store.sweep(now + 3_000);
        assert!(store.is_empty(), "{} counters held", store.len());
    }

    #[test]
    fn one_pass_decisions_match_a_check_then_a_charge() {
        let precision = std::time::Duration::from_secs(10);
        for algorithm in [Algorithm::Fixed, Algorithm::Sliding { precision }] {
            let c = Counter {
                algorithm,
                limit: 7,
                window_ms: 60_000,
                ..counter(1, 1)
            };
            let mut next_id = 1;
            let mut reference = Entry {
                state: empty(algorithm),
                expires_ms: 0,
            };
            let mut fused = reference.clone();
            let mut charged = 0;
            // 1.7 s apart: across buckets and windows, some requests refused.
            for step in 0..400u64 {
                let now = 1_000_000 + step * 1_700;
                let (cost, charge) = (step % 3, step % 5 != 0);
                if reference.expires_ms <= now {
                    // Not live: the one-pass way is not taken; start both anew.
                    update(&mut reference, &c, 1, now, &mut next_id);
                    fused = reference.clone();
                    continue;
                }
                let want = check(Some(&reference.state), &c, cost, now);
                let mark = (charge && want.retry_ms == 0)
                    .then(|| update(&mut reference, &c, cost, now, &mut next_id));
                let got = check_and_charge(&mut fused, &c, cost, now, charge);
                assert_eq!(got, Some((want, mark)), "{algorithm:?}, step {step}");
                assert_eq!(fused, reference, "{algorithm:?}, step {step}");
                charged += usize::from(mark.is_some());
            }
            assert!(charged > 50, "{algorithm:?}: only {charged} charged");
        }
    }

    #[test]
    fn a_clock_stepped_back_counts_into_the_newest_bucket() {
        let precision = std::time::Duration::from_secs(10);
        let c = Counter {
            algorithm: Algorithm::Sliding { precision },
            limit: 5,
            window_ms: 60_000,
            ..counter(1, 1)
        };
        let store = MemoryStore::new(100);
        let now = 1_000_000;
        assert!(
            store
                .acquire(std::slice::from_ref(&c), 1, true, now)
                .allowed
        );
        // The wall clock steps back 30 s, three buckets.
        let back = store.acquire(std::slice::from_ref(&c), 1, true, now - 30_000);
        assert!(back.allowed);
        assert_eq!(back.marks[0], now / 10_000, "charged to the newest bucket");
        assert_eq!(back.states[0].remaining, 3);
        // 35 s on, both units are still in the window (the newest bucket's
        // life, not the older one's): a check sees 2 used.
        let later = store.acquire(std::slice::from_ref(&c), 1, false, now + 35_000);
        assert_eq!(later.states[0].remaining, 2);
    }

    #[test]
    fn a_refused_decision_gives_back_across_groups() {
        let store = MemoryStore::new(100);
        let now = 1_000_000;
        // Identity 2's last counter allows only one request.
        let mut both = identity(1);
        both.extend(identity(2));
        both[5].limit = 1;
        assert!(store.acquire(&both, 1, true, now).allowed);
        let refused = store.acquire(&both, 1, true, now);
        assert!(!refused.allowed);
        // Nothing of the refused request stayed charged, in either group.
        let check = store.acquire(&both[..5], 1, false, now);
        assert!(check.states.iter().all(|s| s.remaining == 98));
    }
}
