//! The Redis store: counters shared by every sluice instance.
//!
//! Each decision is one `EVALSHA` of `lua/acquire.lua` over all of a request's
//! counters, so the check and the charge are atomic and cost one round trip;
//! a refund is one call of `lua/refund.lua`. The scripts are embedded in the
//! binary and called by hash (`EVALSHA`); on `NOSCRIPT` (Redis restarted, or
//! `SCRIPT FLUSH`) the call is made again with the script's text (`EVAL`, which
//! also caches it), unseen by clients.
//!
//! A single server is reached through `pipe.rs`: one pipelined connection for
//! every call, made lazily (so sluice starts while Redis is down) and again by
//! the first call after a failure. Decisions that queue on it together go to
//! Redis as one call of `lua/batch.lua`, which runs acquire.lua for each in
//! turn (each still atomic, and answered as on its own); a lone one goes as
//! it is. With `store.cluster` it is the redis crate's
//! cluster client, also connected lazily, which follows slot moves and
//! failovers. Every call is bounded by `store.timeout`.
//!
//! A cluster node that hangs, or is cut off, keeps its connections open, and
//! the redis crate retries a timed-out call on the same connection without
//! reading the slot map again: it would never find the replica promoted in
//! its place. So when cluster calls keep timing out for [`GIVE_UP`], a new
//! cluster connection is made in the background (the slot map read afresh)
//! and replaces the old one.
//!
//! A script may only touch keys of one cluster slot. All counters of one
//! identity share a hash tag, so a request with one identity is still one
//! call. A request whose identities live in different slots (`global` next to
//! `ip`, or a list of keys) is decided slot by slot, one call after another;
//! if a later slot rejects, the reservations already taken are refunded, so
//! nothing is over-charged.

use std::borrow::Cow;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, LazyLock, Mutex, RwLock};
use std::time::Duration;

use redis::cluster::ClusterClient;
use redis::cluster_async::ClusterConnection;
use redis::{RedisError, Script};
use tokio::sync::oneshot;
use tokio::time::Instant;

use super::pipe::{Batching, Command, MAX_BATCH, Pending, Pipe, Reply, Target, is_noscript};
use super::{Counter, CounterState, GIVE_UP, Memo, Outcome, PerCounter, StoreError};
use crate::config::{Algorithm, ClockSource, StoreConfig};

static ACQUIRE: &str = include_str!("../../lua/acquire.lua");
static REFUND: &str = include_str!("../../lua/refund.lua");
static PLAN: &str = include_str!("../../lua/plan.lua");
static LEASE: &str = include_str!("../../lua/lease.lua");
static BATCH: &str = include_str!("../../lua/batch.lua");

/// lua/batch.lua with acquire.lua's text in it: made once, when first
/// needed, so that it is whatever acquire.lua the binary holds.
static BATCH_TEXT: LazyLock<String> =
    LazyLock::new(|| BATCH.replacen("--@acquire.lua\n", &format!("{ACQUIRE}\n"), 1));

// One per process: the variants' sizes do not matter.
#[allow(clippy::large_enum_variant)]
enum Conn {
    Single(Pipe),
    Cluster(Box<Cluster>),
}

struct Cluster {
    client: ClusterClient,
    /// The connection in use: made on first use, replaced after a stall.
    conn: Arc<RwLock<Option<ClusterConnection>>>,
    /// Held while the first connection is made.
    connecting: tokio::sync::Mutex<()>,
    /// The current run of timeouts: when it began, and its latest.
    stall: Mutex<Option<(Instant, Instant)>>,
    /// Whether a replacement connection is being made.
    replacing: Arc<AtomicBool>,
    /// By hash tag, while a decision of it is in flight: the decisions that
    /// queued behind it, to go as one call when it is answered.
    behind: Mutex<HashMap<Vec<u8>, Vec<Queued>>>,
}

/// A decision waiting behind another of its hash tag: its keys, its
/// argument, and where its answer goes.
type Queued = (
    Vec<Vec<u8>>,
    Vec<u8>,
    oneshot::Sender<Result<Reply, StoreError>>,
);

impl Cluster {
    fn new(client: ClusterClient) -> Cluster {
        Cluster {
            client,
            conn: Arc::new(RwLock::new(None)),
            connecting: tokio::sync::Mutex::new(()),
            stall: Mutex::new(None),
            replacing: Arc::new(AtomicBool::new(false)),
            behind: Mutex::new(HashMap::new()),
        }
    }

    /// The cluster's connection (made on first use, one attempt at a time).
    async fn connection(&self) -> Result<ClusterConnection, RedisError> {
        if let Some(c) = self.current() {
            return Ok(c);
        }
        let _one = self.connecting.lock().await;
        if let Some(c) = self.current() {
            return Ok(c);
        }
        let c = self.client.get_async_connection().await?;
        *self.conn.write().unwrap_or_else(|e| e.into_inner()) = Some(c.clone());
        Ok(c)
    }

    fn current(&self) -> Option<ClusterConnection> {
        self.conn.read().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// A call's reply by `deadline`; timeouts are watched for a stall.
    async fn within(
        &self,
        deadline: Instant,
        call: impl std::future::Future<Output = Result<Reply, RedisError>>,
    ) -> Result<Reply, StoreError> {
        let reply = match tokio::time::timeout_at(deadline, call).await {
            Err(_) => Err(StoreError::Timeout),
            Ok(Err(e)) if e.is_timeout() => Err(StoreError::Timeout),
            Ok(Err(e)) => Err(StoreError::Unavailable(e.to_string())),
            Ok(Ok(reply)) => Ok(reply),
        };
        if matches!(reply, Err(StoreError::Timeout)) {
            self.timed_out(Instant::now());
        }
        checked(reply)
    }

    /// Counts a timeout into the current run of them (a gap of more than
    /// [`GIVE_UP`] ends a run). A run longer than that is a stall: a new
    /// connection is made in the background, so that no request waits for
    /// it, and replaces the old one once it is ready. Until the cluster has
    /// promoted a replica the new one stalls too, and is replaced in turn.
    fn timed_out(&self, now: Instant) {
        let stalled = {
            let mut run = self.stall.lock().unwrap_or_else(|e| e.into_inner());
            let began = match *run {
                Some((began, latest)) if now - latest <= GIVE_UP => began,
                _ => now,
            };
            let stalled = now - began >= GIVE_UP;
            *run = if stalled { None } else { Some((began, now)) };
            stalled
        };
        if !stalled || self.replacing.swap(true, Ordering::AcqRel) {
            return;
        }
        let (client, conn, replacing) = (
            self.client.clone(),
            self.conn.clone(),
            self.replacing.clone(),
        );
        tokio::spawn(async move {
            // Each node's connection is bounded by `store.timeout`; this
            // bounds the whole in case the redis crate waits longer.
            let made = tokio::time::timeout(10 * GIVE_UP, client.get_async_connection()).await;
            match made {
                Ok(Ok(c)) => *conn.write().unwrap_or_else(|e| e.into_inner()) = Some(c),
                Ok(Err(e)) => tracing::debug!(error = %e, "could not reconnect to the cluster"),
                Err(_) => tracing::debug!("timed out reconnecting to the cluster"),
            }
            replacing.store(false, Ordering::Release);
        });
    }
}

/// Cheap to clone: refunds that must outlive a request run in their own task.
#[derive(Clone)]
pub struct RedisStore(Arc<Inner>);

impl std::ops::Deref for RedisStore {
    type Target = Inner;
    fn deref(&self) -> &Inner {
        &self.0
    }
}

pub struct Inner {
    conn: Conn,
    acquire: Script,
    refund: Script,
    plan: Script,
    /// lua/batch.lua around acquire.lua, for a cluster (a single server's
    /// connection has its own, see `pipe.rs`).
    batch: Script,
    lease: Script,
    prefix: String,
    timeout: Duration,
    clock: ClockSource,
    /// Source of log nonces: random per process, then counting; kept below
    /// 2^53 so Lua's doubles hold it exactly.
    nonce: AtomicU64,
}

impl RedisStore {
    pub fn new(config: &StoreConfig) -> Result<RedisStore, StoreError> {
        let bad = |e: RedisError| StoreError::Unavailable(e.to_string());
        // rediss:// verifies against the system roots, or only `store.ca`.
        let ca = match &config.ca {
            Some(path) => Some(std::fs::read(path).map_err(|e| {
                StoreError::Unavailable(format!("store.ca: cannot read {}: {e}", path.display()))
            })?),
            None => None,
        };
        let certs = || redis::TlsCertificates {
            client_tls: None,
            root_cert: ca.clone(),
        };
        let conn = match &config.url {
            Some(url) => {
                let target =
                    Target::from_url(url, ca.as_deref()).map_err(StoreError::Unavailable)?;
                let batching = Batching {
                    hash: Script::new(&BATCH_TEXT).get_hash().to_string(),
                    text: BATCH_TEXT.clone(),
                };
                Conn::Single(Pipe::new(target, config.timeout, Some(batching)))
            }
            None => {
                let mut builder = ClusterClient::builder(config.cluster.iter().map(String::as_str));
                if ca.is_some() {
                    builder = builder.certs(certs());
                }
                let client = builder
                    .connection_timeout(config.timeout)
                    .response_timeout(config.timeout)
                    .retries(2)
                    .min_retry_wait(10)
                    .max_retry_wait(100)
                    .build()
                    .map_err(bad)?;
                Conn::Cluster(Box::new(Cluster::new(client)))
            }
        };
        Ok(RedisStore(Arc::new(Inner {
            conn,
            acquire: Script::new(ACQUIRE),
            refund: Script::new(REFUND),
            plan: Script::new(PLAN),
            batch: Script::new(&BATCH_TEXT),
            lease: Script::new(LEASE),
            prefix: config.prefix.clone(),
            timeout: config.timeout,
            clock: config.clock,
            nonce: AtomicU64::new(random_seed() & ((1 << 52) - 1)),
        })))
    }

    /// Loads the scripts, so the first requests do not meet `NOSCRIPT`. If
    /// Redis is down this fails quietly: each call loads on demand anyway.
    /// (A single server's connection loads the batch script itself too, see
    /// `pipe.rs`.)
    pub async fn preload(&self) {
        for (script, text) in [
            (&self.acquire, ACQUIRE),
            (&self.refund, REFUND),
            (&self.batch, BATCH_TEXT.as_str()),
        ] {
            let load = async {
                match &self.conn {
                    Conn::Single(pipe) => match pipe
                        .call(
                            &Command::of(&[b"SCRIPT", b"LOAD", text.as_bytes()]),
                            Instant::now() + self.timeout,
                        )
                        .await
                        .map_err(|e| e.to_string())?
                    {
                        Reply::Error(e) => Err(e),
                        _ => Ok(()),
                    },
                    Conn::Cluster(cluster) => {
                        let mut conn = cluster.connection().await.map_err(|e| e.to_string())?;
                        script
                            .load_async(&mut conn)
                            .await
                            .map(|_| ())
                            .map_err(|e| e.to_string())
                    }
                }
            };
            match tokio::time::timeout(self.timeout, load).await {
                Ok(Ok(())) => {}
                Ok(Err(e)) => {
                    tracing::debug!(error = %e, "could not preload the Lua scripts");
                    return;
                }
                Err(_) => return,
            }
        }
    }

    /// Deletes counters, one `DEL` per key (keys of several slots cannot share
    /// one on a cluster).
    pub async fn forget(&self, counters: &[Counter]) -> Result<(), StoreError> {
        let deadline = Instant::now() + self.timeout;
        let mut keys: Vec<Vec<u8>> = counters.iter().map(|c| self.redis_key(c)).collect();
        keys.sort();
        keys.dedup();
        for key in keys {
            self.command(&[b"DEL", &key], deadline).await?;
        }
        Ok(())
    }

    /// Sends one command that is not a script; an error reply is an error.
    async fn command(&self, args: &[&[u8]], deadline: Instant) -> Result<Reply, StoreError> {
        match &self.conn {
            Conn::Single(pipe) => checked(pipe.call(&Command::of(args), deadline).await),
            Conn::Cluster(cluster) => {
                let call = async {
                    let mut cmd = redis::Cmd::new();
                    args.iter().for_each(|a| {
                        cmd.arg(*a);
                    });
                    let mut conn = cluster.connection().await?;
                    let value: redis::Value = cmd.query_async(&mut conn).await?;
                    Ok(reply_of(value))
                };
                cluster.within(deadline, call).await
            }
        }
    }

    /// One command that is not a script, within `store.timeout` (for the
    /// plans' assignments and their stream of changes).
    pub async fn call(&self, args: &[&[u8]]) -> Result<Reply, StoreError> {
        self.command(args, Instant::now() + self.timeout).await
    }

    /// The keys of the plans' assignments and of their stream of changes
    /// (see `lua/plan.lua`): one hash tag, so one cluster slot.
    pub fn plan_keys(&self) -> [Vec<u8>; 2] {
        [b":assign".as_slice(), b":log"].map(|end| {
            let mut key = self.prefix.as_bytes().to_vec();
            key.extend_from_slice(b"{plans}");
            key.extend_from_slice(end);
            key
        })
    }

    /// `lua/plan.lua`: one change of the assignments, kept and announced.
    pub async fn plan_change(&self, op: &str, field: &[u8], plan: &str) -> Result<(), StoreError> {
        let keys = self.plan_keys();
        let args: [&[u8]; 3] = [op.as_bytes(), field, plan.as_bytes()];
        let deadline = Instant::now() + self.timeout;
        self.eval(&self.plan, PLAN, &keys, &args, deadline)
            .await
            .map(|_| ())
    }

    fn is_cluster(&self) -> bool {
        matches!(self.conn, Conn::Cluster(_))
    }

    pub async fn ping(&self) -> Result<(), StoreError> {
        self.command(&[b"PING"], Instant::now() + self.timeout)
            .await
            .map(|_| ())
    }

    /// `now` for the scripts: the proxy's clock, or negative for Redis `TIME`.
    fn now_arg(&self, now_ms: u64) -> f64 {
        match self.clock {
            ClockSource::Redis => -1.0,
            ClockSource::Local => now_ms as f64,
        }
    }

    /// The Redis key a counter lives in: the prefix, then its [`key_part`].
    fn redis_key(&self, c: &Counter) -> Vec<u8> {
        let part = key_part(c);
        let mut key = Vec::with_capacity(self.prefix.len() + part.len());
        key.extend_from_slice(self.prefix.as_bytes());
        key.extend_from_slice(part);
        key
    }

    /// The distinct keys of `counters` (the scripts' KEYS), and per counter
    /// the (1-based) index of its key.
    fn keys(&self, counters: &[Counter]) -> Result<(Vec<Vec<u8>>, Vec<u8>), StoreError> {
        // Compared without the prefix, so that a key is built only once.
        let mut parts: Vec<&[u8]> = Vec::with_capacity(counters.len());
        let mut keys = Vec::with_capacity(counters.len());
        let mut index = Vec::with_capacity(counters.len());
        for c in counters {
            let part = key_part(c);
            let i = match parts.iter().position(|k| *k == part) {
                Some(i) => i + 1,
                None => {
                    keys.push(self.redis_key(c));
                    parts.push(part);
                    parts.len()
                }
            };
            // The scripts take a key index in one byte.
            index.push(u8::try_from(i).map_err(|_| {
                StoreError::Unavailable("more than 255 Redis keys in one decision".into())
            })?);
        }
        Ok((keys, index))
    }

    /// Runs `script` (whose text is `text`): `EVALSHA`, and on `NOSCRIPT`
    /// (Redis restarted, or `SCRIPT FLUSH`) `EVAL` of the text, which also
    /// caches it. An error reply (the script failed) is an error.
    async fn eval(
        &self,
        script: &Script,
        text: &str,
        keys: &[Vec<u8>],
        args: &[&[u8]],
        deadline: Instant,
    ) -> Result<Reply, StoreError> {
        match &self.conn {
            Conn::Single(pipe) => {
                let evalsha = script_command(b"EVALSHA", script.get_hash().as_bytes(), keys, args);
                let eval = || Ok(script_command(b"EVAL", text.as_bytes(), keys, args));
                // acquire.lua's calls may share one with others.
                if std::ptr::eq(script, &self.acquire) {
                    return run_decision(pipe, (&evalsha, 0, &[]), eval, deadline).await;
                }
                run_script(pipe, &[evalsha.bytes()], eval, deadline).await
            }
            Conn::Cluster(cluster) => match args {
                [arg] if std::ptr::eq(script, &self.acquire) && !keys.is_empty() => {
                    Box::pin(self.cluster_decision(cluster, keys, arg, deadline)).await
                }
                _ => Box::pin(cluster_call(cluster, script, keys, args, deadline)).await,
            },
        }
    }

    /// An acquire.lua call on a cluster (all `keys` of one hash tag, so one
    /// slot). While another decision of the tag is in flight it waits behind
    /// it, and those that waited go as one call of the batch script once it
    /// is answered: what queues behind a call is batched, a lone decision
    /// goes at once.
    async fn cluster_decision(
        &self,
        cluster: &Cluster,
        keys: &[Vec<u8>],
        arg: &[u8],
        deadline: Instant,
    ) -> Result<Reply, StoreError> {
        let tag = hash_tag(&keys[0]).to_vec();
        let queued = {
            let mut behind = cluster.behind.lock().unwrap_or_else(|e| e.into_inner());
            match behind.get_mut(&tag) {
                Some(queue) if queue.len() < MAX_BATCH => {
                    let (tx, rx) = oneshot::channel();
                    queue.push((keys.to_vec(), arg.to_vec(), tx));
                    Some(Some(rx))
                }
                // (Enough wait already: this one goes on its own.)
                Some(_) => Some(None),
                None => {
                    behind.insert(tag.clone(), Vec::new());
                    None
                }
            }
        };
        match queued {
            Some(Some(answer)) => match tokio::time::timeout_at(deadline, answer).await {
                Ok(Ok(reply)) => checked(reply),
                Ok(Err(_)) => Err(StoreError::Unavailable("a batched call was dropped".into())),
                Err(_) => Err(StoreError::Timeout),
            },
            Some(None) => cluster_call(cluster, &self.acquire, keys, &[arg], deadline).await,
            None => {
                let _next = Behind {
                    store: self.clone(),
                    tag,
                };
                cluster_call(cluster, &self.acquire, keys, &[arg], deadline).await
            }
        }
    }

    /// Sends `queued` (decisions of one hash tag) as one call: acquire.lua's
    /// own for one, else the batch script's; each gets its answer.
    async fn send_queued(&self, cluster: &Cluster, queued: Vec<Queued>) {
        let deadline = Instant::now() + self.timeout;
        let (mut keys, mut args, mut answers) = (Vec::new(), vec![Vec::new()], Vec::new());
        // Whether a key is more than one decision's: of one tag, they are
        // (as lua/batch.lua's first byte says, see `pipe.rs`).
        args[0].push(1);
        for (k, arg, answer) in queued {
            args[0].push(k.len().min(255) as u8);
            keys.extend(k);
            args.push(arg);
            answers.push(answer);
        }
        let reply = if answers.len() == 1 {
            let arg: Vec<&[u8]> = args[1..].iter().map(Vec::as_slice).collect();
            cluster_call(cluster, &self.acquire, &keys, &arg, deadline).await
        } else {
            let args: Vec<&[u8]> = args.iter().map(Vec::as_slice).collect();
            cluster_call(cluster, &self.batch, &keys, &args, deadline).await
        };
        let error = match reply {
            Ok(Reply::Array(Some(each))) if answers.len() > 1 && each.len() == answers.len() => {
                for (answer, reply) in answers.into_iter().zip(each) {
                    let _ = answer.send(Ok(reply));
                }
                return;
            }
            Ok(reply) if answers.len() == 1 => {
                if let Some(answer) = answers.pop() {
                    let _ = answer.send(Ok(reply));
                }
                return;
            }
            Ok(reply) => format!("the batch script answered {reply:?}"),
            Err(StoreError::Unavailable(e)) => e,
            Err(StoreError::Timeout) => {
                for answer in answers {
                    let _ = answer.send(Err(StoreError::Timeout));
                }
                return;
            }
        };
        for answer in answers {
            let _ = answer.send(Err(StoreError::Unavailable(error.clone())));
        }
    }

    /// Checks (mode 0), checks and charges (1) or charges (2) `counters`; see
    /// `lua/acquire.lua`. `memo` (see [`Memo`]) belongs to `counters`.
    pub async fn acquire(
        &self,
        counters: &[Counter],
        memo: Option<&Memo>,
        cost: u64,
        mode: u8,
        now_ms: u64,
    ) -> Result<Outcome, StoreError> {
        // One deadline for the whole decision, however many slots it takes.
        let deadline = Instant::now() + self.timeout;
        // The usual decision (one server, a live connection, counters whose
        // command `memo` keeps) is queued before the first wait, so that
        // this future holds little more than the reply to come: the layers
        // of futures the general way takes, and moving the outcome up
        // through them, cost about 500 instructions a decision.
        if let Some((pipe, sent)) = self.send_kept(memo, mode, now_ms, cost, deadline) {
            match sent?.await? {
                reply if is_noscript(&reply) => {}
                reply => return read_outcome(&checked(Ok(reply))?, counters.len()),
            }
            // Rare, and boxed: this future, which every decision's future
            // carries whatever its store, holds only the reply to come. (The
            // header is made again: the script did not run.)
            let reply = Box::pin(async {
                let eval = self.eval_command(counters, &self.head(mode, now_ms, cost))?;
                checked(pipe.call(&eval, deadline).await)
            })
            .await?;
            return read_outcome(&reply, counters.len());
        }
        // Boxed: the usual decision's future need not carry this one's state.
        Box::pin(self.acquire_general(counters, memo, cost, mode, now_ms, deadline)).await
    }

    /// acquire.lua's `EVALSHA` as `memo` keeps it, with a header made now,
    /// queued on the live connection (which is returned too, for `EVAL`
    /// after `NOSCRIPT`); `None` off the usual way (a cluster, no memo or
    /// none kept yet, no live connection).
    fn send_kept(
        &self,
        memo: Option<&Memo>,
        mode: u8,
        now_ms: u64,
        cost: u64,
        deadline: Instant,
    ) -> Option<(&Pipe, Result<Pending, StoreError>)> {
        let Conn::Single(pipe) = &self.conn else {
            return None;
        };
        let (template, at) = memo?.0.get()?;
        let head = self.head(mode, now_ms, cost);
        Some((pipe, pipe.send_decision(template, *at, &head, deadline)?))
    }

    fn eval_command(&self, counters: &[Counter], head: &[u8; HEAD]) -> Result<Command, StoreError> {
        let (keys, arg) = self.acquire_args(counters, head)?;
        Ok(script_command(b"EVAL", ACQUIRE.as_bytes(), &keys, &[&arg]))
    }

    /// [`RedisStore::acquire`] the general way: the first decision on a
    /// memo, one without, or on a cluster, or while (re)connecting.
    async fn acquire_general(
        &self,
        counters: &[Counter],
        memo: Option<&Memo>,
        cost: u64,
        mode: u8,
        now_ms: u64,
        deadline: Instant,
    ) -> Result<Outcome, StoreError> {
        // Not on a cluster (the usual case), or one slot: one call.
        let groups = self.slot_groups(counters);
        if groups.len() <= 1 {
            return self
                .acquire_one(counters, memo, cost, mode, now_ms, deadline)
                .await;
        }
        self.acquire_slots(counters, groups, cost, mode, now_ms, deadline)
            .await
    }

    /// acquire.lua's per-call header: mode, now, cost and a fresh nonce.
    fn head(&self, mode: u8, now_ms: u64, cost: u64) -> [u8; HEAD] {
        let nonce = self.nonce.fetch_add(1, Ordering::Relaxed) & ((1 << 53) - 1);
        let mut head = [0u8; HEAD];
        head[0] = mode;
        head[1..9].copy_from_slice(&self.now_arg(now_ms).to_be_bytes());
        head[9..17].copy_from_slice(&(cost as f64).to_be_bytes());
        head[17..25].copy_from_slice(&(nonce as f64).to_be_bytes());
        head
    }

    /// [`RedisStore::acquire`] of counters in several cluster slots, `groups`
    /// (indices of `counters`): slot by slot, all or nothing.
    async fn acquire_slots(
        &self,
        counters: &[Counter],
        groups: Vec<Vec<usize>>,
        cost: u64,
        mode: u8,
        now_ms: u64,
        deadline: Instant,
    ) -> Result<Outcome, StoreError> {
        let mut out = Outcome {
            allowed: true,
            now_ms,
            // Slots never asked (after a rejection) show a full, passing counter.
            states: counters
                .iter()
                .map(|c| CounterState {
                    remaining: c.limit,
                    reset_ms: now_ms,
                    retry_ms: 0,
                })
                .collect(),
            marks: smallvec::smallvec![0; counters.len()],
        };
        let mut charged: Vec<(Vec<Counter>, PerCounter<u64>)> = Vec::new();
        for group in groups {
            let part: Vec<Counter> = group.iter().map(|&i| counters[i].clone()).collect();
            let o = match self
                .acquire_one(&part, None, cost, mode, now_ms, deadline)
                .await
            {
                Ok(o) => o,
                Err(e) => {
                    self.give_back(charged, cost, now_ms, deadline).await;
                    return Err(e);
                }
            };
            out.now_ms = o.now_ms;
            for (k, &i) in group.iter().enumerate() {
                out.states[i] = o.states[k];
                out.marks[i] = o.marks[k];
            }
            if !o.allowed {
                out.allowed = false;
                if mode == 1 {
                    // All or nothing: what earlier slots reserved goes back.
                    self.give_back(charged, cost, now_ms, deadline).await;
                    out.marks.iter_mut().for_each(|m| *m = 0);
                    return Ok(out);
                }
            } else if mode == 1 {
                charged.push((part, o.marks));
            }
        }
        Ok(out)
    }

    /// Refunds what earlier slots reserved. It runs in a task of its own, so
    /// that it completes even when the request stops waiting for it at its
    /// deadline.
    async fn give_back(
        &self,
        charged: Vec<(Vec<Counter>, PerCounter<u64>)>,
        cost: u64,
        now_ms: u64,
        deadline: Instant,
    ) {
        if charged.is_empty() {
            return;
        }
        let this = self.clone();
        let task = tokio::spawn(async move {
            for (part, marks) in charged {
                let deadline = Instant::now() + this.timeout;
                if let Err(e) = this.refund_one(&part, &marks, cost, now_ms, deadline).await {
                    super::log_error(&e, "could not give back a partial reservation");
                }
            }
        });
        let _ = tokio::time::timeout_at(deadline, task).await;
    }

    /// Indices of `counters` grouped by cluster hash tag, in first-seen order;
    /// none off a cluster, where every call goes to one server anyway (and
    /// grouping would cost two allocations per decision).
    fn slot_groups(&self, counters: &[Counter]) -> Vec<Vec<usize>> {
        if !self.is_cluster() {
            return Vec::new();
        }
        let mut groups: Vec<(&[u8], Vec<usize>)> = Vec::new();
        for (i, c) in counters.iter().enumerate() {
            let tag = hash_tag(&c.key);
            match groups.iter_mut().find(|(t, _)| *t == tag) {
                Some((_, g)) => g.push(i),
                None => groups.push((tag, vec![i])),
            }
        }
        groups.into_iter().map(|(_, g)| g).collect()
    }

    async fn acquire_one(
        &self,
        counters: &[Counter],
        memo: Option<&Memo>,
        cost: u64,
        mode: u8,
        now_ms: u64,
        deadline: Instant,
    ) -> Result<Outcome, StoreError> {
        // One argument: the call's header, then the counters (a second
        // argument costs Redis about 1,500 instructions).
        let head = self.head(mode, now_ms, cost);
        let reply = match (&self.conn, memo) {
            (Conn::Single(pipe), Some(memo)) => {
                self.acquire_memo(pipe, memo, counters, &head, deadline)
                    .await?
            }
            _ => {
                let (keys, arg) = self.acquire_args(counters, &head)?;
                self.eval(&self.acquire, ACQUIRE, &keys, &[&arg], deadline)
                    .await?
            }
        };
        read_outcome(&reply, counters.len())
    }

    /// acquire.lua's keys and its one argument: `head`, then the counters.
    fn acquire_args(
        &self,
        counters: &[Counter],
        head: &[u8; HEAD],
    ) -> Result<(Vec<Vec<u8>>, Vec<u8>), StoreError> {
        let (keys, index) = self.keys(counters)?;
        Ok((keys, spec(head, counters, &index, None)))
    }

    /// acquire.lua's `EVALSHA` as `memo` keeps it for `counters` (made now if
    /// it is not yet), with `head` written in; on `NOSCRIPT`, `EVAL` built
    /// the long way.
    async fn acquire_memo(
        &self,
        pipe: &Pipe,
        memo: &Memo,
        counters: &[Counter],
        head: &[u8; HEAD],
        deadline: Instant,
    ) -> Result<Reply, StoreError> {
        let (template, at) = match memo.0.get() {
            Some(kept) => kept,
            None => {
                let (keys, arg) = self.acquire_args(counters, head)?;
                let hash = self.acquire.get_hash().as_bytes();
                let cmd = script_command(b"EVALSHA", hash, &keys, &[&arg]);
                // The argument comes last, then its "\r\n".
                let at = cmd.len() - 2 - arg.len();
                memo.0.get_or_init(|| (cmd, at))
            }
        };
        let eval = || self.eval_command(counters, head);
        run_decision(pipe, (template, *at, head), eval, deadline).await
    }

    pub async fn refund(
        &self,
        counters: &[Counter],
        marks: &[u64],
        cost: u64,
        now_ms: u64,
    ) -> Result<(), StoreError> {
        let deadline = Instant::now() + self.timeout;
        // Every slot gets its refund even when one fails; the first error is reported.
        let mut result = Ok(());
        for (part, part_marks) in self.by_slot(counters, marks) {
            let done = self
                .refund_one(&part, &part_marks, cost, now_ms, deadline)
                .await;
            if result.is_ok() {
                result = done;
            }
        }
        result
    }

    /// Charges `extra` more units without checking (mode 2) and frees the
    /// request's concurrency slots (`marks`), slot group by slot group.
    pub async fn charge_more(
        &self,
        counters: &[Counter],
        marks: &[u64],
        extra: u64,
        now_ms: u64,
    ) -> Result<(), StoreError> {
        let deadline = Instant::now() + self.timeout;
        let mut result = Ok(());
        for (part, part_marks) in self.by_slot(counters, marks) {
            let head = self.head(2, now_ms, extra);
            let (keys, index) = self.keys(&part)?;
            let arg = spec(&head, &part, &index, Some(&part_marks));
            let done = self
                .eval(&self.acquire, ACQUIRE, &keys, &[&arg], deadline)
                .await
                .map(|_| ());
            if result.is_ok() {
                result = done;
            }
        }
        result
    }

    /// Renews the concurrency slots `marks` took, each for its lease from
    /// now (lua/lease.lua); returns how many were still held.
    pub async fn renew(
        &self,
        counters: &[Counter],
        marks: &[u64],
        now_ms: u64,
    ) -> Result<usize, StoreError> {
        let deadline = Instant::now() + self.timeout;
        let mut renewed = 0;
        for (part, part_marks) in self.by_slot(counters, marks) {
            let mut keys = Vec::new();
            let mut slots: Vec<[u8; 16]> = Vec::new();
            for (c, &mark) in part.iter().zip(part_marks.iter()) {
                if let Algorithm::Concurrency { lease } = c.algorithm {
                    keys.push(self.redis_key(c));
                    let mut slot = [0u8; 16];
                    slot[..8].copy_from_slice(&(mark as f64).to_be_bytes());
                    slot[8..].copy_from_slice(&(lease.as_millis() as f64).to_be_bytes());
                    slots.push(slot);
                }
            }
            if keys.is_empty() {
                continue;
            }
            let now = self.now_arg(now_ms).to_be_bytes();
            let mut args: Vec<&[u8]> = vec![&now];
            args.extend(slots.iter().map(|m| &m[..]));
            if let Reply::Int(n) = self
                .eval(&self.lease, LEASE, &keys, &args, deadline)
                .await?
            {
                renewed += usize::try_from(n).unwrap_or(0);
            }
        }
        Ok(renewed)
    }

    /// `counters` and their `marks` by cluster slot: borrowed as they are
    /// when they are all in one (always off a cluster), copied per slot
    /// otherwise.
    fn by_slot<'a>(&self, counters: &'a [Counter], marks: &'a [u64]) -> Vec<SlotPart<'a>> {
        let groups = self.slot_groups(counters);
        if groups.len() <= 1 {
            return vec![(Cow::Borrowed(counters), Cow::Borrowed(marks))];
        }
        groups
            .into_iter()
            .map(|g| {
                let part: Vec<Counter> = g.iter().map(|&i| counters[i].clone()).collect();
                let part_marks: Vec<u64> = g
                    .iter()
                    .map(|&i| marks.get(i).copied().unwrap_or(0))
                    .collect();
                (Cow::Owned(part), Cow::Owned(part_marks))
            })
            .collect()
    }

    async fn refund_one(
        &self,
        counters: &[Counter],
        marks: &[u64],
        cost: u64,
        now_ms: u64,
        deadline: Instant,
    ) -> Result<(), StoreError> {
        let (keys, index) = self.keys(counters)?;
        let mut head = [0u8; 16];
        head[..8].copy_from_slice(&self.now_arg(now_ms).to_be_bytes());
        head[8..].copy_from_slice(&(cost as f64).to_be_bytes());
        let marks: Vec<u8> = marks
            .iter()
            .flat_map(|&m| (m as f64).to_be_bytes())
            .collect();
        let spec = spec(&[], counters, &index, None);
        self.eval(
            &self.refund,
            REFUND,
            &keys,
            &[&head, &spec, &marks],
            deadline,
        )
        .await?;
        Ok(())
    }
}

/// A script's call on a cluster, by `deadline`. An error reply is an error.
async fn cluster_call(
    cluster: &Cluster,
    script: &Script,
    keys: &[Vec<u8>],
    args: &[&[u8]],
    deadline: Instant,
) -> Result<Reply, StoreError> {
    let call = async {
        let mut inv = script.prepare_invoke();
        keys.iter().for_each(|k| {
            inv.key(&k[..]);
        });
        args.iter().for_each(|a| {
            inv.arg(*a);
        });
        let mut conn = cluster.connection().await?;
        let value: redis::Value = inv.invoke_async(&mut conn).await?;
        Ok(reply_of(value))
    };
    cluster.within(deadline, call).await
}

/// Held by the decision in flight for a hash tag on a cluster. When it ends
/// (answered, or dropped with its request), the decisions that queued behind
/// it go as one call, in a task of their own, which holds this in turn; with
/// none, the tag has no decision in flight any more.
struct Behind {
    store: RedisStore,
    tag: Vec<u8>,
}

impl Drop for Behind {
    fn drop(&mut self) {
        let Conn::Cluster(cluster) = &self.store.conn else {
            return;
        };
        let queued = {
            let mut behind = cluster.behind.lock().unwrap_or_else(|e| e.into_inner());
            match behind.get_mut(&self.tag) {
                Some(queue) if !queue.is_empty() => std::mem::take(queue),
                _ => {
                    behind.remove(&self.tag);
                    return;
                }
            }
        };
        // (Outside a runtime, as when it shuts down, the queued calls fail:
        // their answers are dropped.)
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            let mut behind = cluster.behind.lock().unwrap_or_else(|e| e.into_inner());
            behind.remove(&self.tag);
            return;
        };
        let next = Behind {
            store: self.store.clone(),
            tag: std::mem::take(&mut self.tag),
        };
        runtime.spawn(async move {
            if let Conn::Cluster(cluster) = &next.store.conn {
                next.store.send_queued(cluster, queued).await;
            }
            drop(next);
        });
    }
}

/// The counters of one cluster slot and their marks (see
/// [`RedisStore::by_slot`]).
type SlotPart<'a> = (Cow<'a, [Counter]>, Cow<'a, [u64]>);

/// An error reply is an error.
fn checked(reply: Result<Reply, StoreError>) -> Result<Reply, StoreError> {
    match reply {
        Ok(Reply::Error(e)) => Err(StoreError::Unavailable(e)),
        other => other,
    }
}

/// A script's `evalsha` on the pipe, and on `NOSCRIPT` (Redis restarted, or
/// `SCRIPT FLUSH`) the `EVAL` that `eval` builds, which also caches the
/// script. An error reply is an error.
async fn run_script(
    pipe: &Pipe,
    evalsha: &[&[u8]],
    eval: impl FnOnce() -> Result<Command, StoreError>,
    deadline: Instant,
) -> Result<Reply, StoreError> {
    match pipe.call_parts(evalsha, deadline).await? {
        reply if is_noscript(&reply) => checked(pipe.call(&eval()?, deadline).await),
        reply => checked(Ok(reply)),
    }
}

/// [`run_script`] of an acquire.lua decision, `(command, at, head)` as
/// [`Pipe::call_decision`] takes it: it may share a call with others.
async fn run_decision(
    pipe: &Pipe,
    (evalsha, at, head): (&Command, usize, &[u8]),
    eval: impl FnOnce() -> Result<Command, StoreError>,
    deadline: Instant,
) -> Result<Reply, StoreError> {
    match pipe.call_decision(evalsha, at, head, deadline).await? {
        reply if is_noscript(&reply) => checked(pipe.call(&eval()?, deadline).await),
        reply => checked(Ok(reply)),
    }
}

/// `EVALSHA` (or `EVAL`) of a script, by hash (or text), over `keys` and `args`.
fn script_command(verb: &[u8], script: &[u8], keys: &[Vec<u8>], args: &[&[u8]]) -> Command {
    Command::script(verb, script, keys, args)
}

/// A redis-rs reply (from a cluster) as the pipe reads replies.
fn reply_of(value: redis::Value) -> Reply {
    use redis::Value;
    match value {
        Value::Nil => Reply::Bulk(None),
        Value::Int(n) => Reply::Int(n),
        Value::BulkString(b) => Reply::Bulk(Some(b)),
        Value::SimpleString(s) => Reply::Status(s.into_bytes()),
        Value::Okay => Reply::Status(b"OK".to_vec()),
        Value::Array(items) => Reply::Array(Some(items.into_iter().map(reply_of).collect())),
        Value::ServerError(e) => Reply::Error(format!("{e:?}")),
        other => Reply::Error(format!("unexpected reply {other:?}")),
    }
}

/// Bytes of acquire.lua's per-call header: mode, now, cost, nonce (`>Bddd`).
const HEAD: usize = 25;

/// `head`, then the counters as the scripts take them: 34 bytes each,
/// `>BBdddI4I4` (key index, algorithm, limit, window ms, parameter, record
/// tag; a calendar window's two ends in place of window and parameter);
/// see `lua/acquire.lua`. Binary, because parsing decimals in Lua was a
/// third of the script's cost.
///
/// `marks`, for a settlement: each counter's mark from its acquire; a
/// concurrency counter carries it as its parameter (the slot to free).
fn spec(head: &[u8], counters: &[Counter], index: &[u8], marks: Option<&[u64]>) -> Vec<u8> {
    let mut out = Vec::with_capacity(head.len() + 34 * counters.len());
    out.extend_from_slice(head);
    for (i, (c, &ki)) in counters.iter().zip(index).enumerate() {
        let (alg, window, mut param) = script_params(c);
        if let (5, Some(marks)) = (alg, marks) {
            param = marks.get(i).copied().unwrap_or(0);
        }
        out.push(ki);
        out.push(alg);
        out.extend_from_slice(&(c.limit as f64).to_be_bytes());
        out.extend_from_slice(&(window as f64).to_be_bytes());
        out.extend_from_slice(&(param as f64).to_be_bytes());
        out.extend_from_slice(&record_tag(c).to_be_bytes());
    }
    out
}

/// acquire.lua's answer for `count` counters, or an error that shows it.
fn read_outcome(reply: &Reply, count: usize) -> Result<Outcome, StoreError> {
    let outcome = match reply {
        Reply::Bulk(Some(bytes)) => parse_outcome(bytes, count),
        _ => None,
    };
    outcome.ok_or_else(|| {
        StoreError::Unavailable(format!(
            "acquire.lua answered {reply:?} for {count} counters"
        ))
    })
}

/// Reads acquire.lua's answer: `>B` allowed, `>d` now, then `>ddd` per
/// counter (remaining, reset, mark), then, only when refused, `>d` per counter
/// (retry; an allowed call's are all 0).
fn parse_outcome(reply: &[u8], count: usize) -> Option<Outcome> {
    let allowed = *reply.first()? == 1;
    let retries = if allowed { None } else { Some(9 + 24 * count) };
    if reply.len() != 9 + 24 * count + retries.map_or(0, |_| 8 * count) {
        return None;
    }
    let num = |at: usize| -> Option<u64> {
        let bytes: [u8; 8] = reply.get(at..at + 8)?.try_into().ok()?;
        // `as` saturates, and NaN reads as 0: a negative or NaN value reads
        // as 0. Through i64, which x86-64 converts to in one instruction
        // (the script's numbers are below 2^53).
        Some((f64::from_be_bytes(bytes) as i64).max(0) as u64)
    };
    let mut states = PerCounter::with_capacity(count);
    let mut marks = PerCounter::with_capacity(count);
    for i in 0..count {
        let at = 9 + 24 * i;
        states.push(CounterState {
            remaining: num(at)?,
            reset_ms: num(at + 8)?,
            retry_ms: match retries {
                Some(r) => num(r + 8 * i)?,
                None => 0,
            },
        });
        marks.push(num(at + 16)?);
    }
    Some(Outcome {
        allowed,
        now_ms: num(1)?,
        states,
        marks,
    })
}

/// The part of a key Redis Cluster hashes: between the first `{` and the next
/// `}` when that is not empty, else the whole key. (The prefix, which comes
/// first, may not contain braces: the config refuses them.)
fn hash_tag(key: &[u8]) -> &[u8] {
    let tag = || {
        let open = key.iter().position(|&b| b == b'{')?;
        let close = key[open + 1..].iter().position(|&b| b == b'}')?;
        (close > 0).then(|| &key[open + 1..open + 1 + close])
    };
    tag().unwrap_or(key)
}

/// A counter's record tag in its packed string: 64-bit FNV-1a of the limit's
/// id (the key after its group). A policy has a handful of limits, so two
/// sharing a tag is a 2^-64 chance per pair.
fn record_tag(c: &Counter) -> u64 {
    let id = c.key.get(c.group_len + 1..).unwrap_or_default();
    id.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    })
}

/// The script's algorithm code, window and parameter for a counter.
fn script_params(c: &Counter) -> (u8, u64, u64) {
    match (c.algorithm, c.calendar) {
        (Algorithm::Fixed, Some(ends)) => (4, ends.end, ends.next_end),
        (Algorithm::Fixed, None) => (1, c.window_ms, c.window_ms),
        (Algorithm::Sliding { precision }, _) => (1, c.window_ms, precision.as_millis() as u64),
        (Algorithm::Log, _) => (2, c.window_ms, 0),
        (Algorithm::Gcra { burst, delay }, _) => {
            // The capacity in µs, as the memory store works it out.
            let t = (c.window_ms * 1000 / c.limit.max(1)).max(1);
            (
                3,
                c.window_ms,
                t.saturating_mul(burst) + delay.as_micros() as u64,
            )
        }
        (Algorithm::Concurrency { lease }, _) => (5, lease.as_millis() as u64, 0),
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

/// The part of a counter's key that names its Redis key (before the prefix):
/// the identity's and policy's packed string, or for a log or concurrency
/// counter its own sorted set.
fn key_part(c: &Counter) -> &[u8] {
    match c.algorithm {
        Algorithm::Log | Algorithm::Concurrency { .. } => &c.key[..],
        _ => &c.key[..c.group_len],
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn outcomes_are_read_from_the_binary_answer() {
        // allowed, now, then remaining, reset, mark.
        let mut reply = vec![1u8];
        for v in [1_800_000_000_123.0f64, 5.0, 1_800_000_060_000.0, 30.0] {
            reply.extend_from_slice(&v.to_be_bytes());
        }
        let o = parse_outcome(&reply, 1).unwrap();
        assert!(o.allowed);
        assert_eq!(o.now_ms, 1_800_000_000_123);
        assert_eq!(
            o.states[0],
            CounterState {
                remaining: 5,
                reset_ms: 1_800_000_060_000,
                retry_ms: 0
            }
        );
        assert_eq!(o.marks[..], [30]);
        // An answer of the wrong length (another script, a cut reply) is refused.
        assert!(parse_outcome(&reply, 2).is_none());
        assert!(parse_outcome(&reply[..20], 1).is_none());
        // Refused: the retries follow. A negative number reads as 0, never
        // wraps around.
        let mut denied = reply.clone();
        denied[0] = 0;
        assert!(parse_outcome(&denied, 1).is_none());
        denied[9..17].copy_from_slice(&(-1.0f64).to_be_bytes());
        denied[17..25].copy_from_slice(&f64::NAN.to_be_bytes());
        denied.extend_from_slice(&1500.0f64.to_be_bytes());
        let o = parse_outcome(&denied, 1).unwrap();
        assert!(!o.allowed);
        assert_eq!(o.states[0].remaining, 0);
        assert_eq!(o.states[0].reset_ms, 0);
        assert_eq!(o.states[0].retry_ms, 1500);
        assert_eq!(o.marks[..], [30]);
    }
}
