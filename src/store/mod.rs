//! Stores: where counters live. The limiter asks a store to check (and charge)
//! several counters at once, all-or-nothing, and later to refund or charge.
//!
//! - `memory.rs`: in this process only; the default, no Redis needed.
//! - `redis.rs`: shared by every instance; the algorithms are Lua scripts in `lua/`.
//! - `pipe.rs`: the Redis store's connection to a single server.
//!
//! Every store implements the same four algorithms with the same results, so a
//! policy behaves the same whatever it is stored in. What the algorithms mean:
//!
//! - `fixed`: a counter per window; windows are aligned to the unix epoch,
//!   or, for calendar windows, have the bounds the limiter gives ([`Ends`]).
//! - `sliding`: `window / precision` buckets; the buckets of the last `window`
//!   (the current one included) are summed. Its reset is when the units
//!   counted now have all left the window.
//! - `log`: every charged unit is remembered with its time; units younger than
//!   `window` are counted.
//! - `gcra`: a theoretical arrival time (TAT) that moves `window / limit` per unit;
//!   a request passes if the TAT stays within `burst` units (and `delay`) of now.
//! - `concurrency`: slots held by requests in flight, each a lease that ends
//!   unless renewed; a request takes one slot whatever its cost, and its
//!   settlement frees it.

pub mod memory;
mod pipe;
pub mod redis;

pub use pipe::Reply;

use std::time::Duration;

use crate::config::Algorithm;

/// How long Redis may stay silent past a call's deadline before its
/// connection is taken for dead and made anew: a single server's (`pipe.rs`)
/// once its oldest call is that late, a cluster's (`redis.rs`) once its calls
/// have timed out for that long. Long enough for a Redis busy with a slow
/// command or a fork to catch up; short enough that a dead peer costs
/// seconds of failed decisions, not the kernel's quarter of an hour.
pub const GIVE_UP: Duration = Duration::from_secs(1);

/// A counter's key. Inline up to 56 bytes, which holds `{TAG}:POLICY:LIMIT`
/// for policy names of up to about 17 characters: a connection's counters,
/// keys included, then sit together in one allocation (a decision read
/// them from a handful of scattered cache lines).
pub type Key = smallvec::SmallVec<[u8; 56]>;

/// One counter a decision touches: a limit of a policy for one identity.
#[derive(Debug, Clone)]
pub struct Counter {
    /// Unique among all counters (the limiter builds it from policy, limit and
    /// identity, as `{TAG}:POLICY:LIMIT`); the store adds its own prefix.
    pub key: Key,
    /// Length of the `{TAG}:POLICY` part of `key`: the Redis store keeps all
    /// counters of one identity and policy in one key, one record per limit.
    pub group_len: usize,
    pub limit: u64,
    pub window_ms: u64,
    pub algorithm: Algorithm,
    /// For a `fixed` calendar window ("1w", "1mo", "1d" outside UTC), whose
    /// bounds the store cannot work out from `window_ms`: where the current
    /// and the next window end.
    pub calendar: Option<Ends>,
}

/// Where a calendar window ends, as the proxy's clock sees it when it
/// builds a counter: `end` of the window it is in, and `next_end` of the
/// one after. The store picks by its own clock (Redis `TIME` with
/// `clock = "redis"`, which the proxy does not know when it builds the
/// call): before `end`, the window ending at `end`, else the one ending at
/// `next_end`. So a decision a few milliseconds either side of a boundary
/// counts in the window its own clock is in, with the window's true end as
/// its reset, without the store knowing time zones. A window is named by
/// its end (the mark a refund compares). A Redis clock behind the proxy's
/// counts the last moments of a window into the next one: each window still
/// admits at most its limit. The limiter builds counters afresh once its
/// clock passes `end` (see `limiter::Counters`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ends {
    pub end: u64,
    pub next_end: u64,
}

impl Ends {
    /// The end of the window `now_ms` counts in (the window's name too).
    pub fn pick(self, now_ms: u64) -> u64 {
        if now_ms < self.end {
            self.end
        } else {
            self.next_end
        }
    }
}

/// What a store keeps with one set of counters from one decision to the next.
/// A connection's requests usually come from one client and so reuse one set
/// (see `limiter::KeyCache`): the Redis store encodes its command for them
/// once, with the per-call part left blank, instead of building keys, the
/// counters' binary spec and the command on every decision (about 2,000
/// instructions). Empty until a store first uses it.
#[derive(Debug, Default)]
pub struct Memo(std::sync::OnceLock<(pipe::Command, usize)>);

/// Where one counter stands after a decision.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CounterState {
    /// Units left after this request (as if charged, when only checking).
    pub remaining: u64,
    /// Unix ms when this counter next gives units back.
    pub reset_ms: u64,
    /// When it denied: ms until the same request would pass; 0 when it allowed.
    pub retry_ms: u64,
}

/// One entry per counter of a policy: inline for up to 4 counters (a
/// policy's limits times its keys is rarely more).
pub type PerCounter<T> = smallvec::SmallVec<[T; 4]>;

/// The answer to [`Store::acquire`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Outcome {
    pub allowed: bool,
    /// The store's clock at the decision (Redis `TIME` with `clock = "redis"`):
    /// the reference for `reset_ms`.
    pub now_ms: u64,
    /// One per counter, in order.
    pub states: PerCounter<CounterState>,
    /// One per counter: which bucket was charged, so a refund hits the same one.
    pub marks: PerCounter<u64>,
}

/// Why a store call failed.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("store call timed out")]
    Timeout,
    #[error("store unavailable: {0}")]
    Unavailable(String),
}

/// Logs a store failure at most once a second, so an outage cannot flood the log.
pub fn log_error(e: &StoreError, what: &str) {
    use std::sync::atomic::{AtomicU64, Ordering};
    static LAST: AtomicU64 = AtomicU64::new(0);
    let now = crate::clock::wall_ms() / 1000;
    if LAST.swap(now, Ordering::Relaxed) != now {
        tracing::warn!(error = %e, "{what}");
    }
}

/// The configured store.
pub enum Store {
    Memory(memory::MemoryStore),
    Redis(redis::RedisStore),
}

impl Store {
    /// Checks every counter for `cost` units and, when all pass and `charge` is
    /// set, charges them all. `now_ms` is the proxy's clock. `memo` is kept with
    /// `counters` by the caller, and passed again with the same counters only.
    pub async fn acquire(
        &self,
        counters: &[Counter],
        memo: Option<&Memo>,
        cost: u64,
        charge: bool,
        now_ms: u64,
    ) -> Result<Outcome, StoreError> {
        match self {
            Store::Memory(m) => Ok(m.acquire(counters, cost, charge, now_ms)),
            // Not boxed: the usual Redis decision's future is small (its
            // other ways are boxed inside). Carrying it costs a memory-store
            // decision about 60 instructions (moving the larger future); the
            // box cost each Redis decision about 90.
            Store::Redis(r) => {
                r.acquire(counters, memo, cost, u8::from(charge), now_ms)
                    .await
            }
        }
    }

    /// Gives back `cost` units of what [`Store::acquire`] charged, bucket by
    /// bucket, and frees its `concurrency` slots; units whose bucket has left
    /// the window are not given back.
    pub async fn refund(
        &self,
        counters: &[Counter],
        marks: &[u64],
        cost: u64,
        now_ms: u64,
    ) -> Result<(), StoreError> {
        match self {
            Store::Memory(m) => {
                m.refund(counters, marks, cost, now_ms);
                Ok(())
            }
            Store::Redis(r) => Box::pin(r.refund(counters, marks, cost, now_ms)).await,
        }
    }

    /// Settles a request that cost more than it reserved: charges `extra`
    /// units more without checking (the count may pass the limit), and
    /// frees its `concurrency` slots (`marks`), in one call.
    pub async fn charge_more(
        &self,
        counters: &[Counter],
        marks: &[u64],
        extra: u64,
        now_ms: u64,
    ) -> Result<(), StoreError> {
        match self {
            Store::Memory(m) => {
                m.charge_more(counters, marks, extra, now_ms);
                Ok(())
            }
            Store::Redis(r) => Box::pin(r.charge_more(counters, marks, extra, now_ms)).await,
        }
    }

    /// Renews the `concurrency` slots a running request holds (`marks`),
    /// each for its lease from now; returns how many were still held.
    pub async fn renew(
        &self,
        counters: &[Counter],
        marks: &[u64],
        now_ms: u64,
    ) -> Result<usize, StoreError> {
        match self {
            Store::Memory(m) => Ok(m.renew(counters, marks, now_ms)),
            Store::Redis(r) => Box::pin(r.renew(counters, marks, now_ms)).await,
        }
    }

    /// Deletes counters (the admin's "unban").
    pub async fn forget(&self, counters: &[Counter]) -> Result<(), StoreError> {
        match self {
            Store::Memory(m) => {
                m.forget(counters);
                Ok(())
            }
            Store::Redis(r) => Box::pin(r.forget(counters)).await,
        }
    }

    /// Whether the store answers (for `/readyz`).
    pub async fn ping(&self) -> Result<(), StoreError> {
        match self {
            Store::Memory(_) => Ok(()),
            Store::Redis(r) => Box::pin(r.ping()).await,
        }
    }

    /// Charges without checking (for `charge = "after"`, once the response is known).
    pub async fn charge(
        &self,
        counters: &[Counter],
        cost: u64,
        now_ms: u64,
    ) -> Result<(), StoreError> {
        match self {
            Store::Memory(m) => {
                m.charge(counters, cost, now_ms);
                Ok(())
            }
            Store::Redis(r) => Box::pin(r.acquire(counters, None, cost, 2, now_ms))
                .await
                .map(|_| ()),
        }
    }
}
