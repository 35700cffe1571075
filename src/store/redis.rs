//! The Redis store: counters shared by every sluice instance.
//!
//! Each decision is one `EVALSHA` of `lua/acquire.lua` over all of a request's
//! counters, so the check and the charge are atomic and cost one round trip;
//! a refund is one call of `lua/refund.lua`. The scripts are embedded in the
//! binary; `redis::Script` sends `EVALSHA` and, on `NOSCRIPT` (Redis restarted
//! or `SCRIPT FLUSH`), loads the script and retries, unseen by clients.
//!
//! The connection is a `ConnectionManager`: multiplexed, connected lazily (so
//! sluice starts while Redis is down) and reconnected in the background. Every
//! call is bounded by `store.timeout`.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::{Script, ScriptInvocation};

use super::{Counter, CounterState, Outcome, StoreError};
use crate::config::{Algorithm, ClockSource, StoreConfig};

static ACQUIRE: &str = include_str!("../../lua/acquire.lua");
static REFUND: &str = include_str!("../../lua/refund.lua");

pub struct RedisStore {
    conn: ConnectionManager,
    acquire: Script,
    refund: Script,
    prefix: String,
    timeout: Duration,
    clock: ClockSource,
    /// Source of log nonces: random per process, then counting; kept below
    /// 2^53 so Lua's doubles hold it exactly.
    nonce: AtomicU64,
}

impl RedisStore {
    pub fn new(config: &StoreConfig) -> Result<RedisStore, StoreError> {
        let url = config
            .url
            .as_deref()
            .ok_or_else(|| StoreError::Unavailable("store.url is not set".into()))?;
        let client =
            redis::Client::open(url).map_err(|e| StoreError::Unavailable(e.to_string()))?;
        let manager = ConnectionManagerConfig::new()
            .set_connection_timeout(Some(config.timeout))
            .set_response_timeout(Some(config.timeout))
            .set_number_of_retries(1)
            .set_max_delay(Duration::from_millis(500));
        let conn = ConnectionManager::new_lazy_with_config(client, manager)
            .map_err(|e| StoreError::Unavailable(e.to_string()))?;
        Ok(RedisStore {
            conn,
            acquire: Script::new(ACQUIRE),
            refund: Script::new(REFUND),
            prefix: config.prefix.clone(),
            timeout: config.timeout,
            clock: config.clock,
            nonce: AtomicU64::new(random_seed() & ((1 << 52) - 1)),
        })
    }

    /// Loads both scripts, so the first requests do not meet `NOSCRIPT`. If
    /// Redis is down this fails quietly: each call loads on demand anyway.
    pub async fn preload(&self) {
        let mut conn = self.conn.clone();
        for script in [&self.acquire, &self.refund] {
            let load = script.load_async(&mut conn);
            match tokio::time::timeout(self.timeout, load).await {
                Ok(Ok(_)) => {}
                Ok(Err(e)) => {
                    tracing::debug!(error = %e, "could not preload the Lua scripts");
                    return;
                }
                Err(_) => return,
            }
        }
    }

    pub async fn ping(&self) -> Result<(), StoreError> {
        let mut conn = self.conn.clone();
        let cmd = redis::cmd("PING");
        let ping = cmd.query_async::<String>(&mut conn);
        match tokio::time::timeout(self.timeout, ping).await {
            Err(_) => Err(StoreError::Timeout),
            Ok(Err(e)) => Err(StoreError::Unavailable(e.to_string())),
            Ok(Ok(_)) => Ok(()),
        }
    }

    fn now_arg(&self, now_ms: u64) -> String {
        match self.clock {
            ClockSource::Redis => String::new(),
            ClockSource::Local => now_ms.to_string(),
        }
    }

    fn keys<'a>(&self, inv: &mut ScriptInvocation<'a>, counters: &[Counter]) {
        for c in counters {
            let mut key = Vec::with_capacity(self.prefix.len() + c.key.len());
            key.extend_from_slice(self.prefix.as_bytes());
            key.extend_from_slice(&c.key);
            inv.key(key);
        }
    }

    async fn call<T: redis::FromRedisValue>(
        &self,
        inv: &ScriptInvocation<'_>,
    ) -> Result<T, StoreError> {
        let mut conn = self.conn.clone();
        match tokio::time::timeout(self.timeout, inv.invoke_async(&mut conn)).await {
            Err(_) => Err(StoreError::Timeout),
            Ok(Err(e)) => Err(StoreError::Unavailable(e.to_string())),
            Ok(Ok(v)) => Ok(v),
        }
    }

    pub async fn acquire(
        &self,
        counters: &[Counter],
        cost: u64,
        mode: u8,
        now_ms: u64,
    ) -> Result<Outcome, StoreError> {
        let nonce = self.nonce.fetch_add(1, Ordering::Relaxed) & ((1 << 53) - 1);
        let mut inv = self.acquire.prepare_invoke();
        self.keys(&mut inv, counters);
        inv.arg(mode).arg(self.now_arg(now_ms)).arg(cost).arg(nonce);
        for c in counters {
            let (alg, param) = script_params(c);
            inv.arg(alg).arg(c.limit).arg(c.window_ms).arg(param);
        }
        let reply: Vec<i64> = self.call(&inv).await?;
        if reply.len() != 2 + 4 * counters.len() {
            return Err(StoreError::Unavailable(format!(
                "acquire.lua answered {} values for {} counters",
                reply.len(),
                counters.len()
            )));
        }
        let u = |v: i64| v.max(0) as u64;
        let mut states = Vec::with_capacity(counters.len());
        let mut marks = Vec::with_capacity(counters.len());
        for chunk in reply[2..].chunks_exact(4) {
            states.push(CounterState {
                remaining: u(chunk[0]),
                reset_ms: u(chunk[1]),
                retry_ms: u(chunk[2]),
            });
            marks.push(u(chunk[3]));
        }
        Ok(Outcome {
            allowed: reply[0] == 1,
            now_ms: u(reply[1]),
            states,
            marks,
        })
    }

    pub async fn refund(
        &self,
        counters: &[Counter],
        marks: &[u64],
        cost: u64,
        now_ms: u64,
    ) -> Result<(), StoreError> {
        let mut inv = self.refund.prepare_invoke();
        self.keys(&mut inv, counters);
        inv.arg(self.now_arg(now_ms)).arg(cost);
        for (c, mark) in counters.iter().zip(marks) {
            let (alg, param) = script_params(c);
            inv.arg(alg)
                .arg(c.limit)
                .arg(c.window_ms)
                .arg(param)
                .arg(*mark);
        }
        let _: i64 = self.call(&inv).await?;
        Ok(())
    }
}

/// The script's algorithm code and its parameter for a counter.
fn script_params(c: &Counter) -> (u8, u64) {
    match c.algorithm {
        Algorithm::Fixed => (1, c.window_ms),
        Algorithm::Sliding { precision } => (1, precision.as_millis() as u64),
        Algorithm::Log => (2, 0),
        Algorithm::Gcra { burst } => (3, burst),
    }
}

fn random_seed() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos()),
    );
    h.write_u32(std::process::id());
    h.finish()
}
