//! A pipelined connection to one Redis server (the Redis store's, without
//! `store.cluster`).
//!
//! Every caller's command goes into one buffer of one connection; a writer task
//! sends whatever gathered since its last write, and a reader task hands each
//! reply to the caller waiting for it, in order (Redis answers in order). It
//! stands in for redis-rs's multiplexed connection, which passes each command
//! through a channel, a codec and a general parser: about 5,000 instructions a
//! decision more. A cluster still goes through redis-rs.
//!
//! Decisions (calls of acquire.lua) that gather while the writer is busy are
//! sent as one call of the batch script ([`Batching`]), whose answer is an
//! array of theirs: Redis then reads, sets up and answers one call for all of
//! them, and a key several of them share once. A decision that finds nothing
//! gathering is queued as it is, and goes out as such unless another joins
//! it before the writer runs: nothing waits for company, so a lone request
//! is not delayed. Decisions that follow each other in a batch and differ
//! only in their nonce (one busy client's, on windows) go as one charging
//! their costs together, and each gets the answer it would have had alone
//! (see [`Gather::add`]).
//!
//! The connection is made lazily, and again after any failure, by the first
//! call that finds it down. One attempt runs at a time; the calls that waited
//! for a failed one fail with it rather than each trying again (a burst of
//! requests makes one attempt, a Redis back up is found by the next request).
//!
//! A call never waits past the deadline its caller gives. Rather than a timer
//! per call (a tokio timer, with the larger futures it made, cost about 1,700
//! instructions a decision, and woke the driver's thread through its eventfd
//! whenever it was the earliest), each connection has one watchdog
//! task: it sleeps until the earliest deadline of the calls waiting, answers
//! the calls whose deadline has passed with a timeout (their replies, still
//! due, are dropped when they come), and sleeps again; with no call waiting
//! it waits for one. Under load it wakes about once per `store.timeout`.
//!
//! A server that stops answering but keeps the connection (a host gone dark,
//! a failover that moved its address) would otherwise keep every call timing
//! out on it until the kernel gave up, a quarter of an hour later. So the
//! watchdog also takes the connection for dead once its oldest call has gone
//! unanswered [`GIVE_UP`] past its deadline, and the next call connects anew.
//! Likewise a server that answers `READONLY`: it became a replica, as after a
//! failover behind one name (a managed Redis's primary endpoint), and a new
//! connection finds the new primary.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use rustls::pki_types::{CertificateDer, ServerName};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::{Notify, oneshot};
use tokio::task::AbortHandle;
use tokio::time::Instant;

use super::{GIVE_UP, StoreError};

/// Calls waiting for replies on one connection, at most: a Redis that stopped
/// answering (but kept the connection) must not make the queue grow forever.
const MAX_WAITING: usize = 10_000;

/// Rounds of the worker's ready tasks the writer lets run before it writes,
/// at most, while decisions are being joined (see [`write_loop`]).
const JOINED_ROUNDS: usize = 4;

/// A reply, as far as the store reads replies (RESP2).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reply {
    Status(Vec<u8>),
    Error(String),
    Int(i64),
    Bulk(Option<Vec<u8>>),
    Array(Option<Vec<Reply>>),
}

/// A command in RESP: an array of bulk strings.
#[derive(Debug, Clone)]
pub struct Command(Vec<u8>, Option<Script>);

/// Where a script call's keys and its one argument are in its command (the
/// offsets of their first `$`), and how many keys it has: what a batch takes
/// from it.
#[derive(Debug, Clone, Copy)]
struct Script {
    keys: usize,
    arg: usize,
    count: usize,
}

impl Command {
    /// A command of `args` arguments (the command's name included), sized for
    /// `bytes` bytes of them.
    pub fn new(args: usize, bytes: usize) -> Command {
        let mut out = Vec::with_capacity(16 + bytes + 16 * args);
        out.push(b'*');
        push_decimal(&mut out, args);
        out.extend_from_slice(b"\r\n");
        Command(out, None)
    }

    /// `EVALSHA` (or `EVAL`) of a script, by hash (or text), over `keys` and
    /// `args`.
    pub fn script(verb: &[u8], script: &[u8], keys: &[Vec<u8>], args: &[&[u8]]) -> Command {
        let bytes =
            keys.iter().map(Vec::len).sum::<usize>() + args.iter().map(|a| a.len()).sum::<usize>();
        let mut cmd = Command::new(3 + keys.len() + args.len(), script.len() + bytes);
        cmd.arg(verb).arg(script).arg_number(keys.len());
        let at = cmd.0.len();
        for k in keys {
            cmd.arg(k);
        }
        let arg = cmd.0.len();
        for a in args {
            cmd.arg(a);
        }
        if let [_] = args {
            cmd.1 = Some(Script {
                keys: at,
                arg,
                count: keys.len(),
            });
        }
        cmd
    }

    pub fn arg(&mut self, arg: &[u8]) -> &mut Command {
        self.0.push(b'$');
        push_decimal(&mut self.0, arg.len());
        self.0.extend_from_slice(b"\r\n");
        self.0.extend_from_slice(arg);
        self.0.extend_from_slice(b"\r\n");
        self
    }

    /// A number as an argument, in decimal, without formatting a `String`.
    pub fn arg_number(&mut self, n: usize) -> &mut Command {
        let mut digits = [0u8; 20];
        let at = decimal(n, &mut digits);
        self.arg(&digits[at..])
    }

    /// The command with its bytes from `at` replaced by `bytes` (the same
    /// length: an argument's value, whose length is already written before
    /// it), as the parts [`Pipe::call_parts`] sends: no copy of the command is
    /// made.
    pub fn with<'a>(&'a self, at: usize, bytes: &'a [u8]) -> [&'a [u8]; 3] {
        [&self.0[..at], bytes, &self.0[at + bytes.len()..]]
    }

    /// How many bytes the command takes.
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// The command's bytes, as sent.
    pub fn bytes(&self) -> &[u8] {
        &self.0
    }

    /// A whole command from its arguments.
    pub fn of(args: &[&[u8]]) -> Command {
        let mut c = Command::new(args.len(), args.iter().map(|a| a.len()).sum());
        for a in args {
            c.arg(a);
        }
        c
    }
}

fn push_decimal(out: &mut Vec<u8>, n: usize) {
    let mut digits = [0u8; 20];
    let at = decimal(n, &mut digits);
    out.extend_from_slice(&digits[at..]);
}

/// Writes `n` in decimal at the end of `digits`; returns where it starts.
fn decimal(mut n: usize, digits: &mut [u8; 20]) -> usize {
    let mut at = digits.len();
    loop {
        at -= 1;
        digits[at] = b'0' + (n % 10) as u8;
        n /= 10;
        if n == 0 {
            return at;
        }
    }
}

/// Where and how to connect.
pub struct Target {
    pub host: String,
    pub port: u16,
    /// For `rediss://`: the TLS client and the name the certificate must carry.
    pub tls: Option<(tokio_rustls::TlsConnector, ServerName<'static>)>,
    pub username: Option<String>,
    pub password: Option<String>,
    pub db: i64,
}

impl Target {
    /// From a `redis://` or `rediss://` URL; `ca` (PEM) replaces the system
    /// roots for `rediss://`.
    pub fn from_url(url: &str, ca: Option<&[u8]>) -> Result<Target, String> {
        use redis::{ConnectionAddr, IntoConnectionInfo};
        let info = url.into_connection_info().map_err(|e| e.to_string())?;
        let settings = info.redis_settings();
        let (host, port, tls) = match info.addr() {
            ConnectionAddr::Tcp(host, port) => (host.clone(), *port, None),
            ConnectionAddr::TcpTls {
                host,
                port,
                insecure,
                ..
            } => {
                if *insecure {
                    return Err("rediss:// without certificate checks is not supported".into());
                }
                let name = ServerName::try_from(host.clone())
                    .map_err(|e| format!("{host}: not a TLS server name: {e}"))?;
                (host.clone(), *port, Some((tls_connector(ca)?, name)))
            }
            _ => return Err("only redis:// and rediss:// URLs are supported".into()),
        };
        Ok(Target {
            host,
            port,
            tls,
            username: settings.username().map(str::to_string),
            password: settings.password().map(str::to_string),
            db: settings.db(),
        })
    }
}

fn tls_connector(ca: Option<&[u8]>) -> Result<tokio_rustls::TlsConnector, String> {
    crate::tls::install_crypto();
    let mut roots = rustls::RootCertStore::empty();
    match ca {
        Some(pem) => {
            use rustls::pki_types::pem::PemObject;
            for cert in CertificateDer::pem_slice_iter(pem) {
                let cert = cert.map_err(|e| format!("store.ca: bad PEM: {e}"))?;
                roots
                    .add(cert)
                    .map_err(|e| format!("store.ca: not a usable CA certificate: {e}"))?;
            }
        }
        None => {
            for cert in rustls_native_certs::load_native_certs().certs {
                let _ = roots.add(cert);
            }
        }
    }
    let config = rustls::ClientConfig::builder()
        .with_root_certificates(roots)
        .with_no_client_auth();
    Ok(tokio_rustls::TlsConnector::from(Arc::new(config)))
}

/// A script whose calls may go to Redis together, as one call of another
/// (`lua/batch.lua` for `lua/acquire.lua`): the other's hash and text.
pub struct Batching {
    /// SHA1 of `text`, in hex.
    pub hash: String,
    /// Loaded again when Redis has lost it (a restart, `SCRIPT FLUSH`).
    pub text: String,
}

/// Decisions in one batch, at most: a script runs alone in Redis, and
/// a longer one would hold up other clients' commands.
pub(super) const MAX_BATCH: usize = 128;

/// The connection to one server, shared by every call.
pub struct Pipe {
    target: Target,
    /// Bounds connecting, TLS and the handshake.
    connect_timeout: Duration,
    batching: Option<Arc<Batching>>,
    link: Mutex<Option<Arc<Link>>>,
    /// Held while connecting; why the last attempt failed.
    connecting: tokio::sync::Mutex<String>,
    /// Attempts made so far.
    attempts: AtomicU64,
}

impl Pipe {
    pub fn new(target: Target, connect_timeout: Duration, batching: Option<Batching>) -> Pipe {
        Pipe {
            target,
            connect_timeout,
            batching: batching.map(Arc::new),
            link: Mutex::new(None),
            connecting: tokio::sync::Mutex::new(String::new()),
            attempts: AtomicU64::new(0),
        }
    }

    /// Sends `cmd` and waits for its reply until `deadline`. An error reply
    /// is a `Reply`, not an `Err`; `Err` says the connection failed or the
    /// deadline passed.
    pub async fn call(&self, cmd: &Command, deadline: Instant) -> Result<Reply, StoreError> {
        self.call_parts(&[&cmd.0], deadline).await
    }

    /// [`Pipe::call`] of a command sent as the concatenation of `parts`.
    pub async fn call_parts(
        &self,
        parts: &[&[u8]],
        deadline: Instant,
    ) -> Result<Reply, StoreError> {
        self.call_out(Out::Parts(parts), deadline).await
    }

    /// [`Pipe::call`] of a decision: `cmd`, a call of the batched script
    /// made by [`Command::script`], with its bytes from `at` replaced by
    /// `head` (as [`Command::with`]). Decisions that gather while the
    /// connection is busy writing go to Redis as one call of the batch
    /// script; a lone one goes as it is.
    pub async fn call_decision(
        &self,
        cmd: &Command,
        at: usize,
        head: &[u8],
        deadline: Instant,
    ) -> Result<Reply, StoreError> {
        self.call_out(Out::Decision(cmd, at, head), deadline).await
    }

    async fn call_out(&self, out: Out<'_>, deadline: Instant) -> Result<Reply, StoreError> {
        if let Some(sent) = self.queue_now(out, deadline) {
            return sent?.await;
        }
        // Connecting (rare) is bounded by a timer of its own. Boxed: its
        // state (two timers, a lock) would otherwise make every call's
        // future, and every decision's, several times larger.
        let link = Box::pin(async {
            tokio::time::timeout_at(deadline, self.link())
                .await
                .map_err(|_| StoreError::Timeout)?
                .map_err(StoreError::Unavailable)
        })
        .await?;
        link.send(out, deadline)?.await
    }

    /// Queues a decision (as [`Pipe::call_decision`]) on the live
    /// connection and returns its reply to come, without waiting: the usual
    /// decision's future then holds only that. `None` when no connection is
    /// live (the caller goes through [`Pipe::call_decision`], which
    /// connects).
    pub fn send_decision(
        &self,
        cmd: &Command,
        at: usize,
        head: &[u8],
        deadline: Instant,
    ) -> Option<Result<Pending, StoreError>> {
        self.queue_now(Out::Decision(cmd, at, head), deadline)
    }

    fn queue_now(&self, out: Out<'_>, deadline: Instant) -> Option<Result<Pending, StoreError>> {
        // Sent under the lock rather than with a clone of the link: two
        // atomic operations fewer on every decision.
        let link = self.link.lock().unwrap_or_else(|e| e.into_inner());
        link.as_ref()
            .filter(|l| !l.broken.load(Ordering::Acquire))
            .map(|l| l.send(out, deadline))
    }

    fn current(&self) -> Option<Arc<Link>> {
        let link = self.link.lock().unwrap_or_else(|e| e.into_inner());
        link.as_ref()
            .filter(|l| !l.broken.load(Ordering::Acquire))
            .cloned()
    }

    async fn link(&self) -> Result<Arc<Link>, String> {
        if let Some(link) = self.current() {
            return Ok(link);
        }
        let seen = self.attempts.load(Ordering::Acquire);
        let mut last_error = self.connecting.lock().await;
        // Another call may have connected while this one waited, or failed to.
        if let Some(link) = self.current() {
            return Ok(link);
        }
        if self.attempts.load(Ordering::Acquire) != seen {
            return Err(last_error.clone());
        }
        // Boxed: connecting is rare, and its (TLS) state would otherwise
        // make every call's future, and every decision's, larger.
        let attempt = tokio::time::timeout(
            self.connect_timeout,
            Box::pin(connect(&self.target, self.batching.clone())),
        )
        .await;
        self.attempts.fetch_add(1, Ordering::AcqRel);
        match attempt {
            Ok(Ok(link)) => {
                *self.link.lock().unwrap_or_else(|e| e.into_inner()) = Some(link.clone());
                Ok(link)
            }
            Ok(Err(e)) => {
                last_error.clone_from(&e);
                Err(e)
            }
            Err(_) => {
                *last_error = "timed out connecting to Redis".into();
                Err(last_error.clone())
            }
        }
    }
}

type Answer = Result<Reply, StoreError>;

/// A reply to come: a call's command is queued, its answer not yet read.
pub struct Pending(oneshot::Receiver<Answer>);

impl std::future::Future for Pending {
    type Output = Answer;

    fn poll(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Answer> {
        std::pin::Pin::new(&mut self.0).poll(cx).map(|answer| {
            answer.unwrap_or_else(|_| {
                Err(StoreError::Unavailable(
                    "connection to Redis dropped".into(),
                ))
            })
        })
    }
}

/// What a call sends.
#[derive(Clone, Copy)]
enum Out<'a> {
    /// A command, as the concatenation of these.
    Parts(&'a [&'a [u8]]),
    /// A decision, as [`Pipe::call_decision`] takes it.
    Decision(&'a Command, usize, &'a [u8]),
}

/// A call waiting for its reply.
struct Waiting {
    deadline: Instant,
    /// Taken when the call times out: its reply is still due, and is dropped.
    reply: Option<oneshot::Sender<Answer>>,
}

/// One live connection: its outgoing bytes and the calls waiting, in order.
struct Link {
    state: Mutex<LinkState>,
    batching: Option<Arc<Batching>>,
    broken: AtomicBool,
    /// Wakes the writer when bytes are waiting (or the link broke).
    wake: Notify,
    /// Wakes the watchdog when a call's deadline is earlier than its alarm
    /// (or the link broke).
    watch: Notify,
    reader: OnceLock<AbortHandle>,
}

struct LinkState {
    out: Vec<u8>,
    /// The decision queued last while it is unsent and last in `out`: where
    /// its command starts there, its layout, and whether a decision like it
    /// may be made one with it (see [`Gather::add`]). A next decision makes
    /// the two a batch.
    lone: Option<(usize, Script, bool)>,
    /// The batch being gathered (after everything in `out`), if any.
    batch: Gather,
    waiting: VecDeque<Waiting>,
    /// How many of `waiting` each reply to come answers, in order: 1, or a
    /// batch's calls (its reply is an array of their answers), and the
    /// batch's runs of identical decisions, each answered once (see
    /// [`Gather::add`]).
    replies: VecDeque<(usize, Vec<Run>)>,
    /// How many calls at the front of `waiting` have timed out: the watchdog
    /// looks past them.
    timed_out: usize,
    /// When the watchdog wakes next; `None` while it waits for a call.
    alarm: Option<Instant>,
    /// Why the link broke, once it did.
    error: Option<String>,
}

/// Decisions gathered into one call of the batch script: their keys and
/// arguments (as RESP bulk strings), and how many keys each has.
#[derive(Default)]
struct Gather {
    count: usize,
    keys: Vec<u8>,
    key_count: usize,
    sizes: Vec<u8>,
    args: Vec<u8>,
    /// Hashes of the keys so far, until one comes twice: then `shared`.
    seen: Vec<u64>,
    shared: bool,
    /// Where the decision added last starts in `keys` and `args`.
    last: Option<(usize, usize)>,
    /// Decisions made one with the one before them (see [`Gather::add`]).
    runs: Vec<Run>,
    /// The decision being added, whole (see [`Gather::add`]).
    scratch: Vec<u8>,
}

/// Decisions identical but for their nonce, sent as one that charges their
/// costs together (see [`Gather::add`]).
#[derive(Debug)]
struct Run {
    /// Its place in the batch's answer.
    at: usize,
    /// The calls it answers, in order.
    calls: usize,
    /// Each one's cost.
    cost: f64,
    /// One of them, as its own call, and its layout: what each is queued
    /// as again when the run is refused.
    single: Vec<u8>,
    script: Script,
}

/// A decision's cost, from its argument (see [`joinable`]).
fn cost_of(arg: &[u8]) -> f64 {
    f64::from_be_bytes(arg[9..17].try_into().unwrap_or_default())
}

/// The payload of a RESP bulk string that starts `bytes` (see [`next_bulk`]).
fn payload(bytes: &[u8]) -> Option<&[u8]> {
    next_bulk(bytes).map(|(payload, _)| payload)
}

/// Whether a decision's argument (acquire.lua's `ARGV[1]`) may be made one
/// with identical ones, charging their costs together: a check and charge
/// (mode 1) of fixed, sliding or calendar windows only. For these, `k`
/// decisions of cost `c` all pass one by one exactly when one of cost `k·c`
/// passes, and charge the same; the `i`-th one's answer is that one's, each
/// counter's remaining `(k - i)·c` higher. (A GCRA's reset, a log's or a
/// concurrency limit's entries differ from decision to decision.)
fn joinable(arg: &[u8]) -> bool {
    arg.len() >= 25
        && (arg.len() - 25).is_multiple_of(34)
        && arg[0] == 1
        && arg[25..]
            .chunks(34)
            .all(|counter| matches!(counter[1], 1 | 4))
}

impl Gather {
    /// Adds a decision: `keys` and `arg` as they are in its command;
    /// `single` makes its command whole. A decision identical to the one
    /// added last but for its nonce (the same keys and counters, cost, mode
    /// and time: one busy client's requests) is made one with it, the
    /// costs added (see [`joinable`]): Redis then decides the run once.
    fn add(
        &mut self,
        keys: &[u8],
        key_count: usize,
        arg: &[&[u8]],
        single: impl FnOnce() -> Vec<u8>,
        script: Script,
        join: bool,
    ) {
        self.scratch.clear();
        for part in arg {
            self.scratch.extend_from_slice(part);
        }
        if join
            && let Some((keys_at, args_at)) = self.last
            && self.keys[keys_at..] == *keys
            && let (Some(last), Some(this)) =
                (payload(&self.args[args_at..]), payload(&self.scratch))
            && joinable(this)
            && last.len() == this.len()
            && last[..9] == this[..9]
            && last[25..] == this[25..]
            && cost_of(this)
                == match self.runs.last() {
                    Some(run) if run.at == self.count - 1 => run.cost,
                    _ => cost_of(last),
                }
        {
            let cost = cost_of(this);
            let total = cost_of(last) + cost;
            // The cost's place in `args`: in the payload, which ends two
            // bytes (`\r\n`) before them.
            let at = self.args.len() - 2 - last.len() + 9;
            self.args[at..at + 8].copy_from_slice(&total.to_be_bytes());
            let at = self.count - 1;
            match self.runs.last_mut() {
                Some(run) if run.at == at => run.calls += 1,
                _ => self.runs.push(Run {
                    at,
                    calls: 2,
                    cost,
                    single: single(),
                    script,
                }),
            }
            return;
        }
        // (A decision sent again after its run was refused is joined by
        // none: each such goes on its own.)
        self.last = join.then_some((self.keys.len(), self.args.len()));
        self.count += 1;
        self.keys.extend_from_slice(keys);
        self.key_count += key_count;
        // (At most 255: see `Link::send`.)
        self.sizes.push(key_count as u8);
        self.args.extend_from_slice(&self.scratch);
        // Whether a key is another decision's too (a decision's own keys
        // differ): the script then keeps keys between decisions, which costs
        // it more than it saves when none is shared.
        let mut rest = keys;
        while !self.shared
            && let Some((key, after)) = next_bulk(rest)
        {
            use std::hash::BuildHasher;
            let hash = foldhash::fast::FixedState::with_seed(0).hash_one(key);
            self.shared = self.seen.contains(&hash);
            self.seen.push(hash);
            rest = after;
        }
    }

    /// Whether decisions were made one in the batch so far.
    fn joins(&self) -> bool {
        !self.runs.is_empty()
    }

    /// Writes the batch to `out` as one `EVALSHA` of the script `hash`, and
    /// empties it; returns its runs.
    fn close(&mut self, out: &mut Vec<u8>, hash: &[u8]) -> Vec<Run> {
        let mut head = Command::new(3 + self.key_count + 1 + self.count, hash.len());
        head.arg(b"EVALSHA").arg(hash).arg_number(self.key_count);
        out.extend_from_slice(&head.0);
        out.extend_from_slice(&self.keys);
        out.push(b'$');
        push_decimal(out, 1 + self.sizes.len());
        out.extend_from_slice(b"\r\n");
        out.push(u8::from(self.shared));
        out.extend_from_slice(&self.sizes);
        out.extend_from_slice(b"\r\n");
        out.extend_from_slice(&self.args);
        self.count = 0;
        self.key_count = 0;
        self.keys.clear();
        self.sizes.clear();
        self.args.clear();
        self.seen.clear();
        self.shared = false;
        self.last = None;
        std::mem::take(&mut self.runs)
    }
}

/// The answers of a run of `calls` decisions of `cost` each from the
/// answer of the one that stood for them, when it passed: the `i`-th one's
/// is the same, each counter's remaining `(calls - i)·cost` higher (see
/// [`joinable`]). `None` when it did not pass.
fn spread(answer: &Reply, calls: usize, cost: f64) -> Option<Vec<Reply>> {
    let Reply::Bulk(Some(bytes)) = answer else {
        return None;
    };
    if bytes.first() != Some(&1) || bytes.len() < 9 || !(bytes.len() - 9).is_multiple_of(24) {
        return None;
    }
    let each = (1..=calls).map(|i| {
        let mut mine = bytes.clone();
        for at in (9..mine.len()).step_by(24) {
            let field = &mut mine[at..at + 8];
            let remaining = f64::from_be_bytes(field.try_into().unwrap_or_default());
            let more = (calls - i) as f64 * cost;
            field.copy_from_slice(&(remaining + more).to_be_bytes());
        }
        Reply::Bulk(Some(mine))
    });
    Some(each.collect())
}

/// The first RESP bulk string of `bytes` (`$LEN\r\nBYTES\r\n`, as
/// [`Command::arg`] writes it) and what follows it; `None` at the end.
fn next_bulk(bytes: &[u8]) -> Option<(&[u8], &[u8])> {
    let digits = bytes.strip_prefix(b"$")?;
    let end = digits.iter().position(|&b| b == b'\r')?;
    let len = number(&digits[..end])?;
    let start = end + 2;
    let stop = start.checked_add(usize::try_from(len).ok()?)?;
    Some((digits.get(start..stop)?, digits.get(stop + 2..)?))
}

impl Link {
    fn send(&self, what: Out<'_>, deadline: Instant) -> Result<Pending, StoreError> {
        // A decision may join others when batching is on and its command
        // says where its keys and argument are; any other command is sent
        // as it is.
        let decision = match (what, &self.batching) {
            (Out::Decision(cmd, at, head), Some(_)) => cmd
                .1
                .filter(|script| {
                    script.count <= usize::from(u8::MAX) && (head.is_empty() || at >= script.arg)
                })
                .map(|script| (cmd, at, head, script)),
            _ => None,
        };
        let (tx, rx) = oneshot::channel();
        let (was_empty, sooner) = {
            let mut s = self.lock();
            if let Some(e) = &s.error {
                return Err(StoreError::Unavailable(e.clone()));
            }
            if s.waiting.len() >= MAX_WAITING {
                return Err(StoreError::Unavailable(
                    "too many calls waiting for Redis".into(),
                ));
            }
            s.waiting.push_back(Waiting {
                deadline,
                reply: Some(tx),
            });
            // Under load the alarm is an older call's deadline: no wake.
            let sooner = s.alarm.is_none_or(|a| deadline < a);
            if sooner {
                s.alarm = Some(deadline);
            }
            let was_empty = s.out.is_empty() && s.batch.count == 0;
            match decision {
                Some((cmd, at, head, script)) => self.queue_decision(&mut s, cmd, at, head, script),
                None => {
                    self.close(&mut s);
                    match what {
                        Out::Parts(parts) => {
                            for part in parts {
                                s.out.extend_from_slice(part);
                            }
                        }
                        Out::Decision(cmd, at, head) => {
                            for part in cmd.with(at, head) {
                                s.out.extend_from_slice(part);
                            }
                        }
                    }
                    s.replies.push_back((1, Vec::new()));
                }
            }
            (was_empty, sooner)
        };
        // Bytes already waiting mean the writer was woken for them.
        if was_empty {
            self.wake.notify_one();
        }
        if sooner {
            self.watch.notify_one();
        }
        Ok(Pending(rx))
    }

    /// Queues a decision: as it is when nothing is gathering (a lone
    /// decision goes out as soon as the writer runs, unchanged), else into
    /// the batch, which the decision queued last (still unsent) starts.
    fn queue_decision(
        &self,
        s: &mut LinkState,
        cmd: &Command,
        at: usize,
        head: &[u8],
        script: Script,
    ) {
        // The command with `head` in its argument (`head` is within it, or
        // empty: `Link::send` checked).
        let whole = if head.is_empty() {
            [&cmd.0[..], &[][..], &[][..]]
        } else {
            cmd.with(at, head)
        };
        self.queue_whole(s, whole, script, true);
    }

    /// [`Link::queue_decision`] of a decision's command as the
    /// concatenation of `whole`, its keys and the start of its argument in
    /// the first part. `join`: it may be made one with the decision before
    /// it (see [`Gather::add`]).
    fn queue_whole(&self, s: &mut LinkState, whole: [&[u8]; 3], script: Script, join: bool) {
        let keys = &whole[0][script.keys..script.arg];
        let arg = [&whole[0][script.arg..], whole[1], whole[2]];
        if s.batch.count == 0 {
            let Some((start, lone, lone_joins)) = s.lone.take() else {
                s.lone = Some((s.out.len(), script, join));
                for part in whole {
                    s.out.extend_from_slice(part);
                }
                s.replies.push_back((1, Vec::new()));
                return;
            };
            // The lone decision, still unsent, leaves `out` for the batch.
            let (from, to) = (start + lone.keys, start + lone.arg);
            let (lone_keys, lone_arg) = (&s.out[from..to], &s.out[to..]);
            s.batch.add(
                lone_keys,
                lone.count,
                &[lone_arg],
                Vec::new,
                lone,
                lone_joins,
            );
            s.out.truncate(start);
        }
        s.batch
            .add(keys, script.count, &arg, || whole.concat(), script, join);
        if let Some(last) = s.replies.back_mut() {
            last.0 += 1;
        }
        if s.batch.count == MAX_BATCH {
            self.close(s);
        }
    }

    /// Ends the batch being gathered, if any: it goes after what is in
    /// `out`, and no later decision joins it or the lone one.
    fn close(&self, s: &mut LinkState) {
        s.lone = None;
        if s.batch.count > 0
            && let Some(batching) = &self.batching
        {
            let runs = s.batch.close(&mut s.out, batching.hash.as_bytes());
            if let Some(last) = s.replies.back_mut() {
                last.1 = runs;
            }
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, LinkState> {
        // Nothing is left half-done under this lock: a poisoned one is usable.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Hands `reply` to the oldest waiting call, or to the calls of the
    /// oldest batch each its answer (any of which may have given up, or
    /// timed out). `done` is room for them, kept from reply to reply.
    fn deliver(&self, reply: Reply, done: &mut Vec<Waiting>) -> Result<(), String> {
        let (count, runs) = {
            let mut s = self.lock();
            let (count, runs) = s.replies.pop_front().unwrap_or((1, Vec::new()));
            if s.waiting.len() < count {
                return Err("Redis sent a reply nobody asked for".into());
            }
            s.timed_out = s.timed_out.saturating_sub(count);
            done.extend(s.waiting.drain(..count));
            (count, runs)
        };
        if count == 1 {
            if let Some(tx) = done.pop().and_then(|w| w.reply) {
                let _ = tx.send(Ok(reply));
            }
            return Ok(());
        }
        let lost = is_noscript(&reply);
        let joined: usize = runs.iter().map(|r| r.calls - 1).sum();
        match reply {
            Reply::Array(Some(answers)) if answers.len() + joined == count => {
                let mut calls = done.drain(..);
                let mut runs = runs.into_iter().peekable();
                for (i, answer) in answers.into_iter().enumerate() {
                    let Some(run) = runs.next_if(|r| r.at == i) else {
                        if let Some(tx) = calls.next().and_then(|w| w.reply) {
                            let _ = tx.send(Ok(answer));
                        }
                        continue;
                    };
                    let run_calls = calls.by_ref().take(run.calls);
                    match spread(&answer, run.calls, run.cost) {
                        Some(each) => {
                            for (w, answer) in run_calls.zip(each) {
                                if let Some(tx) = w.reply {
                                    let _ = tx.send(Ok(answer));
                                }
                            }
                        }
                        // Refused: not all of them pass, and none was
                        // charged. Each goes again as itself.
                        None if matches!(answer, Reply::Bulk(_)) => self.resend(&run, run_calls),
                        // An error would be each one's.
                        None => {
                            for w in run_calls {
                                if let Some(tx) = w.reply {
                                    let _ = tx.send(Ok(answer.clone()));
                                }
                            }
                        }
                    }
                }
            }
            // An error for the whole call (NOSCRIPT, BUSY, OOM) is each
            // decision's.
            other => {
                for w in done.drain(..) {
                    if let Some(tx) = w.reply {
                        let _ = tx.send(Ok(other.clone()));
                    }
                }
            }
        }
        // Its decisions are made again with acquire.lua's text (see
        // `redis.rs`); the batch script is loaded again for the next batches.
        if lost {
            self.load_batch_script();
        }
        Ok(())
    }

    /// Queues the calls of a refused run again (see [`Gather::add`]), after
    /// everything queued, each as its own decision: they may go in one
    /// batch, but not as one again.
    fn resend(&self, run: &Run, calls: impl Iterator<Item = Waiting>) {
        let mut sooner = false;
        {
            let mut s = self.lock();
            for w in calls {
                if w.reply.is_none() {
                    continue;
                }
                if let Some(e) = &s.error {
                    if let Some(tx) = w.reply {
                        let _ = tx.send(Err(StoreError::Unavailable(e.clone())));
                    }
                    continue;
                }
                if s.alarm.is_none_or(|a| w.deadline < a) {
                    s.alarm = Some(w.deadline);
                    sooner = true;
                }
                s.waiting.push_back(w);
                self.queue_whole(&mut s, [&run.single, &[], &[]], run.script, false);
            }
        }
        self.wake.notify_one();
        if sooner {
            self.watch.notify_one();
        }
    }

    /// Queues `SCRIPT LOAD` of the batch script, whose reply no one waits
    /// for: a new connection does it first, so that Redis has the script
    /// for any batch (even one whose calls time out, and so cannot fall
    /// back on acquire.lua's text), and again after a batch met `NOSCRIPT`.
    fn load_batch_script(&self) {
        if let Some(batching) = &self.batching {
            let load = Command::of(&[b"SCRIPT", b"LOAD", batching.text.as_bytes()]);
            let _ = self.send(Out::Parts(&[&load.0]), Instant::now() + GIVE_UP);
        }
    }

    /// Times out the calls whose deadline has passed; returns when to look
    /// again (which it also sets as the alarm): the earliest deadline left,
    /// or when the oldest call will be [`GIVE_UP`] late. `Err` once it is.
    fn expire(&self, now: Instant) -> Result<Option<Instant>, String> {
        let mut s = self.lock();
        let s = &mut *s;
        // Redis answers in order: the front call is the one that waited
        // longest for an answer.
        let mut earliest = match s.waiting.front() {
            Some(oldest) if oldest.deadline + GIVE_UP <= now => {
                return Err(format!(
                    "Redis did not answer for {} ms past a call's deadline; connecting again",
                    GIVE_UP.as_millis()
                ));
            }
            Some(oldest) => Some(oldest.deadline + GIVE_UP),
            None => None,
        };
        for w in s.waiting.range_mut(s.timed_out..) {
            if w.deadline <= now {
                if let Some(tx) = w.reply.take() {
                    let _ = tx.send(Err(StoreError::Timeout));
                }
            } else if w.reply.is_some() {
                earliest = Some(earliest.map_or(w.deadline, |e| e.min(w.deadline)));
            }
        }
        while s
            .waiting
            .get(s.timed_out)
            .is_some_and(|w| w.reply.is_none())
        {
            s.timed_out += 1;
        }
        s.alarm = earliest;
        Ok(earliest)
    }

    /// Breaks the link: every waiting call gets `error`, both tasks stop.
    fn fail(&self, error: String) {
        self.broken.store(true, Ordering::Release);
        let waiting = {
            let mut s = self.lock();
            if s.error.is_none() {
                s.error = Some(error.clone());
            }
            s.replies.clear();
            std::mem::take(&mut s.waiting)
        };
        for tx in waiting.into_iter().filter_map(|w| w.reply) {
            let _ = tx.send(Err(StoreError::Unavailable(error.clone())));
        }
        self.wake.notify_one();
        self.watch.notify_one();
        if let Some(reader) = self.reader.get() {
            reader.abort();
        }
    }
}

async fn connect(t: &Target, batching: Option<Arc<Batching>>) -> Result<Arc<Link>, String> {
    let unreachable =
        |e: std::io::Error| format!("cannot connect to Redis at {}:{}: {e}", t.host, t.port);
    let tcp = TcpStream::connect((t.host.as_str(), t.port))
        .await
        .map_err(unreachable)?;
    let _ = tcp.set_nodelay(true);
    match &t.tls {
        None => {
            let (r, w) = tcp.into_split();
            start(r, w, t, batching).await
        }
        Some((tls, name)) => {
            let stream = tls
                .connect(name.clone(), tcp)
                .await
                .map_err(|e| format!("TLS with Redis at {}:{} failed: {e}", t.host, t.port))?;
            let (r, w) = tokio::io::split(stream);
            start(r, w, t, batching).await
        }
    }
}

/// Authenticates and selects the database, then starts the link's tasks.
async fn start<R, W>(
    mut r: R,
    mut w: W,
    t: &Target,
    batching: Option<Arc<Batching>>,
) -> Result<Arc<Link>, String>
where
    R: AsyncRead + Unpin + Send + 'static,
    W: AsyncWrite + Unpin + Send + 'static,
{
    let mut hello = Vec::new();
    let mut expect = 0;
    if let Some(password) = &t.password {
        let auth = match &t.username {
            Some(user) => Command::of(&[b"AUTH", user.as_bytes(), password.as_bytes()]),
            None => Command::of(&[b"AUTH", password.as_bytes()]),
        };
        hello.extend_from_slice(&auth.0);
        expect += 1;
    }
    if t.db != 0 {
        let db = t.db.to_string();
        hello.extend_from_slice(&Command::of(&[b"SELECT", db.as_bytes()]).0);
        expect += 1;
    }
    let io = |e: std::io::Error| format!("Redis connection failed: {e}");
    let mut buf = Vec::with_capacity(16 * 1024);
    if expect > 0 {
        w.write_all(&hello).await.map_err(io)?;
        let mut at = 0;
        while expect > 0 {
            match parse(&buf[at..])? {
                Some((reply, n)) => {
                    at += n;
                    expect -= 1;
                    if let Reply::Error(e) = reply {
                        return Err(format!("Redis refused the connection: {e}"));
                    }
                }
                None => {
                    if r.read_buf(&mut buf).await.map_err(io)? == 0 {
                        return Err("Redis closed the connection".into());
                    }
                }
            }
        }
        buf.drain(..at);
    }
    let link = Arc::new(Link {
        state: Mutex::new(LinkState {
            out: Vec::new(),
            lone: None,
            batch: Gather::default(),
            waiting: VecDeque::new(),
            replies: VecDeque::new(),
            timed_out: 0,
            alarm: None,
            error: None,
        }),
        batching,
        broken: AtomicBool::new(false),
        wake: Notify::new(),
        watch: Notify::new(),
        reader: OnceLock::new(),
    });
    link.load_batch_script();
    tokio::spawn(write_loop(link.clone(), w));
    tokio::spawn(watch_loop(link.clone()));
    let reader = tokio::spawn(read_loop(link.clone(), r, buf));
    let _ = link.reader.set(reader.abort_handle());
    Ok(link)
}

async fn write_loop<W: AsyncWrite + Unpin>(link: Arc<Link>, mut w: W) {
    let mut sending = Vec::new();
    loop {
        link.wake.notified().await;
        // Under load (other calls still waiting for their answers), let every
        // task that is ready run first (and the runtime poll its sockets):
        // their calls join this write, for fewer Redis calls and wake-ups. A
        // lone call is written at once, so that a request alone is not
        // delayed. Decisions made one (a busy client's, on windows) cost
        // Redis one decision however many they are, so more rounds, which
        // gather more into them, pay; where none joined, each decision is
        // Redis's own work, and more rounds only delay it.
        // (docs/performance.md has the figures.)
        if link.lock().waiting.len() > 1 {
            tokio::task::yield_now().await;
            for _ in 1..JOINED_ROUNDS {
                if !link.lock().batch.joins() {
                    break;
                }
                tokio::task::yield_now().await;
            }
        }
        {
            let mut s = link.lock();
            if s.error.is_some() {
                return;
            }
            link.close(&mut s);
            std::mem::swap(&mut s.out, &mut sending);
        }
        if sending.is_empty() {
            continue;
        }
        if let Err(e) = w.write_all(&sending).await {
            link.fail(format!("Redis connection failed: {e}"));
            return;
        }
        sending.clear();
    }
}

/// The watchdog: times out calls at their deadlines until the link breaks.
async fn watch_loop(link: Arc<Link>) {
    loop {
        if link.broken.load(Ordering::Acquire) {
            return;
        }
        // A call queued between `expire` and the wait has notified `watch`,
        // which keeps that for the wait.
        match link.expire(Instant::now()) {
            Ok(Some(at)) => {
                tokio::select! {
                    () = tokio::time::sleep_until(at) => {}
                    () = link.watch.notified() => {}
                }
            }
            Ok(None) => link.watch.notified().await,
            Err(dead) => {
                link.fail(dead);
                return;
            }
        }
    }
}

async fn read_loop<R: AsyncRead + Unpin>(link: Arc<Link>, mut r: R, mut buf: Vec<u8>) {
    let mut done = Vec::new();
    let error = loop {
        let mut at = 0;
        let parsed = loop {
            match parse(&buf[at..]) {
                Ok(Some((reply, n))) => {
                    at += n;
                    // Before anyone is answered, so that no call goes to this
                    // server once one has seen it refuse.
                    if let Some(refusal) = demoted(&reply) {
                        break Err(format!(
                            "Redis is a replica now ({refusal}); connecting again"
                        ));
                    }
                    if let Err(e) = link.deliver(reply, &mut done) {
                        break Err(e);
                    }
                }
                Ok(None) => break Ok(()),
                Err(e) => break Err(e),
            }
        };
        if let Err(e) = parsed {
            break e;
        }
        buf.drain(..at);
        if buf.capacity() - buf.len() < 4096 {
            buf.reserve(16 * 1024);
        }
        match r.read_buf(&mut buf).await {
            Ok(0) => break "Redis closed the connection".to_string(),
            Ok(_) => {}
            Err(e) => break format!("Redis connection failed: {e}"),
        }
    };
    link.fail(error);
}

/// The refusal of a server that became a replica: `READONLY`, or before Redis
/// 7 a script error that carries it; in a batch's answer, any decision's.
fn demoted(reply: &Reply) -> Option<&str> {
    match reply {
        Reply::Error(e) if e.starts_with("READONLY") || e.contains("-READONLY") => Some(e),
        Reply::Array(Some(answers)) => answers.iter().find_map(|a| match a {
            Reply::Error(_) => demoted(a),
            _ => None,
        }),
        _ => None,
    }
}

/// Whether Redis answered that it does not have the script called.
pub fn is_noscript(reply: &Reply) -> bool {
    matches!(reply, Reply::Error(e) if e.starts_with("NOSCRIPT"))
}

/// One reply from the front of `buf` and its length, or `None` when it is not
/// all there yet.
fn parse(buf: &[u8]) -> Result<Option<(Reply, usize)>, String> {
    parse_nested(buf, 0)
}

/// Arrays nested deeper than this are refused: the store's replies nest at
/// most once, and a reader that recursed as deep as a (broken or hostile)
/// server asked would overflow its stack.
const MAX_NESTING: usize = 8;

fn parse_nested(buf: &[u8], depth: usize) -> Result<Option<(Reply, usize)>, String> {
    let malformed = || "Redis sent a malformed reply".to_string();
    // A reply's first line: its kind, then up to "\r\n" (which a line never
    // holds otherwise). Found by its '\n', which takes fewer instructions than
    // looking for the pair.
    let Some(end) = buf.iter().position(|&b| b == b'\n') else {
        return Ok(None);
    };
    if end < 2 || buf[end - 1] != b'\r' {
        return Err(malformed());
    }
    let (kind, line, next) = (buf[0], &buf[1..end - 1], end + 1);
    let number = || number(line).ok_or_else(malformed);
    Ok(Some(match kind {
        b'+' => (Reply::Status(line.to_vec()), next),
        b'-' => (
            Reply::Error(String::from_utf8_lossy(line).into_owned()),
            next,
        ),
        b':' => (Reply::Int(number()?), next),
        b'$' => {
            let len = number()?;
            if len < 0 {
                return Ok(Some((Reply::Bulk(None), next)));
            }
            let len = len as usize;
            if buf.len() < next + len + 2 {
                return Ok(None);
            }
            (
                Reply::Bulk(Some(buf[next..next + len].to_vec())),
                next + len + 2,
            )
        }
        b'*' => {
            if depth >= MAX_NESTING {
                return Err(malformed());
            }
            let count = number()?;
            if count < 0 {
                return Ok(Some((Reply::Array(None), next)));
            }
            let mut items = Vec::with_capacity((count as usize).min(64));
            let mut at = next;
            for _ in 0..count {
                match parse_nested(&buf[at..], depth + 1)? {
                    Some((item, n)) => {
                        items.push(item);
                        at += n;
                    }
                    None => return Ok(None),
                }
            }
            (Reply::Array(Some(items)), at)
        }
        _ => return Err(malformed()),
    }))
}

/// A RESP integer: an optional '-', then decimal digits. By hand: `str::parse`
/// after a UTF-8 check cost about 60 instructions more a reply.
fn number(line: &[u8]) -> Option<i64> {
    let (negative, digits) = match line.split_first() {
        Some((b'-', rest)) => (true, rest),
        _ => (false, line),
    };
    if digits.is_empty() {
        return None;
    }
    let mut n: i64 = 0;
    for &d in digits {
        if !d.is_ascii_digit() {
            return None;
        }
        n = n.checked_mul(10)?.checked_sub(i64::from(d - b'0'))?;
    }
    // Counted down, so that i64::MIN reads too.
    if negative { Some(n) } else { n.checked_neg() }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn commands_are_arrays_of_bulk_strings() {
        let c = Command::of(&[b"GET", b"k\r\n"]);
        assert_eq!(c.0, b"*2\r\n$3\r\nGET\r\n$3\r\nk\r\n\r\n");
        let mut n = Command::new(2, 0);
        n.arg_number(0).arg_number(1234567890);
        assert_eq!(n.0, b"*2\r\n$1\r\n0\r\n$10\r\n1234567890\r\n");
        // An argument's value swapped for another of its length.
        let template = Command::of(&[b"EVALSHA", b"abc", b"xxxx", b"k"]);
        let at = template.0.windows(4).position(|w| w == b"xxxx").unwrap();
        let parts = template.with(at, b"head");
        assert_eq!(
            parts.concat(),
            Command::of(&[b"EVALSHA", b"abc", b"head", b"k"]).0
        );
    }

    #[test]
    fn replies_are_read_whole_or_not_at_all() {
        let all = b"+OK\r\n-NOSCRIPT No matching script\r\n:-3\r\n$3\r\na\r\n\r\n$-1\r\n*2\r\n:1\r\n$0\r\n\r\n";
        let want = [
            Reply::Status(b"OK".to_vec()),
            Reply::Error("NOSCRIPT No matching script".into()),
            Reply::Int(-3),
            Reply::Bulk(Some(b"a\r\n".to_vec())),
            Reply::Bulk(None),
            Reply::Array(Some(vec![Reply::Int(1), Reply::Bulk(Some(Vec::new()))])),
        ];
        let mut at = 0;
        for w in &want {
            // Every cut short of the whole reply waits for more.
            let (reply, n) = parse(&all[at..]).unwrap().unwrap();
            for cut in 0..n {
                assert_eq!(
                    parse(&all[at..at + cut]).unwrap(),
                    None,
                    "{w:?} cut at {cut}"
                );
            }
            assert_eq!(&reply, w);
            at += n;
        }
        assert_eq!(at, all.len());
        assert!(parse(b"?x\r\n").is_err());
        assert!(parse(b":12a\r\n").is_err());
        // A line without its kind, or without its '\r', is refused (it used
        // to panic the reader).
        for bad in [
            &b"\r\n"[..],
            b"\n",
            b":1\n",
            b":\r\n",
            b":-\r\n",
            b":--1\r\n",
        ] {
            assert!(parse(bad).is_err(), "{bad:?}");
        }
        assert_eq!(number(b"9223372036854775807"), Some(i64::MAX));
        assert_eq!(number(b"-9223372036854775808"), Some(i64::MIN));
        assert_eq!(number(b"9223372036854775808"), None);
        assert_eq!(number(b"-0"), Some(0));
        // Arrays nest up to MAX_NESTING deep, no deeper.
        let nested = |depth: usize| [&b"*1\r\n".repeat(depth)[..], b":7\r\n"].concat();
        assert!(parse(&nested(MAX_NESTING)).unwrap().is_some());
        assert!(parse(&nested(MAX_NESTING + 1)).is_err());
        assert!(parse(&nested(100_000)).is_err());
    }

    #[test]
    fn a_batch_says_whether_a_key_is_in_two_decisions() {
        let keys = |names: &[&[u8]]| {
            let mut c = Command::new(0, 0);
            c.0.clear();
            for n in names {
                c.arg(n);
            }
            c.0
        };
        // ARGV[1] of the batch's call: whether a key is in two decisions,
        // then how many keys each has.
        let flag = |decisions: &[&[&[u8]]]| {
            let mut g = Gather::default();
            for d in decisions {
                let script = Script {
                    keys: 0,
                    arg: 0,
                    count: d.len(),
                };
                g.add(&keys(d), d.len(), &[b"$1\r\nx\r\n"], Vec::new, script, true);
            }
            let mut out = Vec::new();
            g.close(&mut out, b"h");
            // A command reads as an array of bulk strings.
            let Ok(Some((Reply::Array(Some(args)), _))) = parse(&out) else {
                panic!("{out:?}")
            };
            let key_count: usize = decisions.iter().map(|d| d.len()).sum();
            assert_eq!(args.len(), 3 + key_count + 1 + decisions.len());
            let Reply::Bulk(Some(argv1)) = &args[3 + key_count] else {
                panic!("{args:?}")
            };
            (argv1[0], argv1[1..].to_vec())
        };
        assert_eq!(flag(&[&[b"a", b"a:log"], &[b"b"]]), (0, vec![2, 1]));
        assert_eq!(flag(&[&[b"a", b"g"], &[b"b", b"g"]]), (1, vec![2, 2]));
        assert_eq!(flag(&[&[b"a"], &[b"b"], &[b"a"]]), (1, vec![1, 1, 1]));
        // Keys are read as the pipe writes them; anything else ends them.
        assert_eq!(
            next_bulk(b"$2\r\nab\r\n$1\r\nc\r\n"),
            Some((&b"ab"[..], &b"$1\r\nc\r\n"[..]))
        );
        for bad in [
            &b""[..],
            b"$",
            b"$x\r\n",
            b"$5\r\nab\r\n",
            b"$-1\r\n",
            b"2\r\nab\r\n",
        ] {
            assert_eq!(next_bulk(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn a_batch_says_whether_decisions_were_made_one() {
        let bulk = |bytes: &[u8]| {
            let mut c = Command::new(0, 0);
            c.0.clear();
            c.arg(bytes);
            c.0
        };
        // acquire.lua's argument: check and charge, the time, a cost of 1,
        // the nonce, one counter of `kind` (1: a fixed window; 2: a GCRA).
        let arg = |nonce: u8, kind: u8| {
            let mut a = vec![1u8];
            a.extend_from_slice(&[7; 8]);
            a.extend_from_slice(&1f64.to_be_bytes());
            a.extend_from_slice(&[nonce; 8]);
            let mut counter = [0u8; 34];
            counter[1] = kind;
            a.extend_from_slice(&counter);
            bulk(&a)
        };
        let joins = |decisions: &[(&[u8], u8, u8)]| {
            let mut g = Gather::default();
            for &(key, nonce, kind) in decisions {
                let script = Script {
                    keys: 0,
                    arg: 0,
                    count: 1,
                };
                g.add(&bulk(key), 1, &[&arg(nonce, kind)], Vec::new, script, true);
            }
            g.joins()
        };
        assert!(joins(&[(b"a", 1, 1), (b"a", 2, 1)]));
        assert!(joins(&[(b"b", 1, 1), (b"a", 1, 1), (b"a", 2, 1)]));
        assert!(!joins(&[(b"a", 1, 1)]));
        assert!(!joins(&[(b"a", 1, 1), (b"b", 2, 1)]));
        assert!(!joins(&[(b"a", 1, 2), (b"a", 2, 2)]));
    }

    #[test]
    fn targets_are_read_from_urls() {
        let t = Target::from_url("redis://user:pw@127.0.0.1:1234/3", None).unwrap();
        assert_eq!((t.host.as_str(), t.port, t.db), ("127.0.0.1", 1234, 3));
        assert_eq!(
            (t.username.as_deref(), t.password.as_deref()),
            (Some("user"), Some("pw"))
        );
        let t = Target::from_url("redis://:pw@127.0.0.1:1234/3", None).unwrap();
        assert_eq!(
            (t.username.as_deref(), t.password.as_deref(), t.db),
            (None, Some("pw"), 3)
        );
    }
}
