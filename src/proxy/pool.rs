//! The upstream client: keep-alive HTTP/1.1 connections to the upstreams,
//! plain or TLS, kept in a pool per origin.
//!
//! Two ways to make an exchange, each with its own idle connections:
//!
//! - **sluice's own** ([`super::h1`]), for the usual request: no body, no
//!   upgrade, to a plain-HTTP upstream. The request's task writes the head
//!   and reads the answer itself (measured: about a fifth of the instructions
//!   per proxied `GET`, see docs/performance.md).
//! - **hyper's** (`hyper::client::conn::http1`), for the rest: requests with
//!   a body (streamed both ways at once), upgrades, TLS upstreams. Each
//!   connection is driven by a task of its own.
//!
//! So an upstream that gets both kinds of request holds up to two sets of
//! idle connections from one sluice. Either pool is as simple as the proxy
//! needs: a stack of idle connections per origin, last used first. A
//! connection goes back to its pool when the response body has been read to
//! its end (the wrapper [`PooledBody`] sees it), not before: a connection
//! still streaming a body cannot take another request, and one whose body
//! was abandoned is closed.
//!
//! A pooled connection the upstream closed just as it was picked fails
//! before the request is written; the request is then sent once more on a
//! new connection, as hyper-util's client does. One the upstream closes just
//! as the request is written (its idle timeout running out then) fails with
//! no answer: a request that can safely be sent again (`GET`, `HEAD`,
//! `OPTIONS`, `TRACE`, without a body, as Go's client and nginx judge it) is
//! sent once more on a new connection, when its connection had been idle long
//! enough for that to be the likely cause. (hyper's way keeps a copy of the
//! head for that only then: a busy connection is never idle that long, and
//! the copy is not free. Sluice's own way has the head's bytes anyway.)

use std::collections::{HashMap, VecDeque};
use std::pin::Pin;
use std::sync::{Arc, Mutex, OnceLock};
use std::task::{Context, Poll, ready};
use std::time::Duration;

use bytes::Bytes;
use http::header::HeaderValue;
use http::{Method, Request, Response, StatusCode};
use hyper::body::{Body, Frame, Incoming, SizeHint};
use hyper::client::conn::http1::{self, SendRequest};
use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;

use super::h1;
use super::per_client::Slot;
use crate::coalesce::Coalesce;
use crate::config::{Keepalive, UpstreamServer};
use crate::tls::TlsError;

/// A connection idle this long may be one the upstream is closing: a request
/// sent on it that can be sent again is kept, in case.
const REPLAY_AFTER_IDLE: Duration = Duration::from_millis(100);

/// An upstream origin: TLS or not, and `host:port`.
type Origin = (bool, HeaderValue);

/// A kept connection that can tell whether it is still worth using.
trait Reusable {
    fn is_open(&self) -> bool;
}

impl Reusable for SendRequest<RequestBody> {
    fn is_open(&self) -> bool {
        !self.is_closed()
    }
}

impl Reusable for h1::Conn {
    fn is_open(&self) -> bool {
        self.is_quiet()
    }
}

struct Idle<C> {
    conn: C,
    /// When it was put back: [`crate::clock::coarse_ms`], which is precise
    /// enough for the idle times here (100 ms and up) and cheaper to read
    /// than `Instant`, twice a request.
    since_ms: u64,
}

/// Idle connections by origin, each origin's a stack (its top at the back).
struct Stacks<C> {
    idle: Mutex<HashMap<Origin, VecDeque<Idle<C>>, foldhash::fast::RandomState>>,
}

impl<C> Default for Stacks<C> {
    fn default() -> Self {
        Stacks {
            idle: Mutex::default(),
        }
    }
}

impl<C: Reusable + Send + 'static> Stacks<C> {
    fn lock(
        &self,
    ) -> std::sync::MutexGuard<'_, HashMap<Origin, VecDeque<Idle<C>>, foldhash::fast::RandomState>>
    {
        // Nothing panics while holding the lock; a poisoned one is still sound.
        self.idle.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The most recently used idle connection of `origin` that is still open,
    /// and how long it was idle. Those passed over are closed apart (see
    /// [`close_apart`]): once the top has been idle too long, so have all
    /// below it.
    fn checkout(&self, origin: &Origin, keep: Keepalive) -> Option<(C, Duration)> {
        let now = crate::clock::coarse_ms();
        let mut pools = self.lock();
        let stack = pools.get_mut(origin)?;
        let mut passed = Vec::new();
        let found = loop {
            let Some(idle) = stack.pop_back() else {
                break None;
            };
            let idle_for = Duration::from_millis(now.saturating_sub(idle.since_ms));
            if idle_for >= keep.timeout {
                passed.push(idle.conn);
                passed.extend(stack.drain(..).map(|i| i.conn));
                break None;
            }
            if idle.conn.is_open() {
                break Some((idle.conn, idle_for));
            }
            passed.push(idle.conn);
        };
        drop(pools);
        close_apart(passed);
        found
    }

    fn give_back(&self, origin: Origin, conn: C, keep: Keepalive) {
        if !conn.is_open() || keep.idle == 0 {
            return;
        }
        let now = crate::clock::coarse_ms();
        let mut pools = self.lock();
        let stack = pools.entry(origin).or_default();
        // The oldest is at the bottom: let go once it is too old or the
        // stack too high.
        let too_old =
            |i: &Idle<C>| now.saturating_sub(i.since_ms) >= keep.timeout.as_millis() as u64;
        let oldest = if stack.front().is_some_and(too_old) || stack.len() >= keep.idle {
            stack.pop_front()
        } else {
            None
        };
        stack.push_back(Idle {
            conn,
            since_ms: now,
        });
        // Closed after the lock is let go (another worker may want it).
        drop(pools);
        drop(oldest);
    }
}

/// Closes `conns` by a task of their own, eight a millisecond, so that no
/// request waits for them and the upstream is not handed all their ends at
/// once: the connections a burst opened go idle together and run out
/// together, and closing some hundreds at once (a system call and a FIN
/// each, which the upstream answers) held the request that found them, and
/// every other on its thread and the upstream's, for tens of milliseconds.
fn close_apart<C: Send + 'static>(conns: Vec<C>) {
    const AT_ONCE: usize = 8;
    // A few are closed at once; none (most checkouts) costs nothing.
    if conns.len() <= AT_ONCE {
        drop(conns);
        return;
    }
    match tokio::runtime::Handle::try_current() {
        Ok(runtime) => {
            runtime.spawn(async move {
                let mut conns = conns.into_iter();
                while conns.len() > 0 {
                    conns.by_ref().take(AT_ONCE).for_each(drop);
                    tokio::time::sleep(Duration::from_millis(1)).await;
                }
            });
        }
        Err(_) => drop(conns),
    }
}

/// The idle connections of both ways of making an exchange.
#[derive(Default)]
struct Pools {
    hyper: Stacks<SendRequest<RequestBody>>,
    own: Stacks<h1::Conn>,
}

/// Why an upstream request failed.
#[derive(Debug, thiserror::Error)]
pub enum UpstreamError {
    /// No connection: refused, unreachable, a name that does not resolve, a
    /// TLS handshake that failed.
    #[error("connect to {server}: {reason}")]
    Connect { server: String, reason: String },
    /// The exchange failed on an open connection.
    #[error(transparent)]
    Http(#[from] hyper::Error),
    /// The exchange failed on an open connection (sluice's own client).
    #[error(transparent)]
    Own(#[from] h1::H1Error),
}

/// The client of every upstream that trusts the same CAs.
#[derive(Clone)]
pub struct UpstreamClient {
    /// Made on the first TLS connection when only the system roots are
    /// trusted: reading them (some 150 PEM certificates) was most of
    /// sluice's start-up, and plain-HTTP upstreams never use them. With an
    /// extra CA it is made at once, so that a bad file fails the config.
    tls: Arc<OnceLock<tokio_rustls::TlsConnector>>,
    pools: Arc<Pools>,
}

/// A connector for upstreams, trusting the system roots plus `extra_ca`.
fn tls_connector(
    extra_ca: Option<&std::path::Path>,
) -> Result<tokio_rustls::TlsConnector, TlsError> {
    let mut tls = crate::tls::client_config(extra_ca)?;
    tls.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(tokio_rustls::TlsConnector::from(Arc::new(tls)))
}

impl UpstreamClient {
    /// A client trusting the system roots, plus `extra_ca` if given.
    pub fn new(extra_ca: Option<&std::path::Path>) -> Result<UpstreamClient, TlsError> {
        let tls = Arc::new(OnceLock::new());
        if extra_ca.is_some() {
            let _ = tls.set(tls_connector(extra_ca)?);
        }
        Ok(UpstreamClient {
            tls,
            pools: Arc::default(),
        })
    }

    /// The TLS connector, made now if it was not yet (see [`UpstreamClient`]).
    fn tls(&self) -> Result<&tokio_rustls::TlsConnector, TlsError> {
        if let Some(tls) = self.tls.get() {
            return Ok(tls);
        }
        // Two first connections may both build one; the first stored wins.
        let made = tls_connector(None)?;
        Ok(self.tls.get_or_init(|| made))
    }

    /// Whether a request for `server` goes the own way ([`request_own`]):
    /// plain HTTP, no body or one read whole ([`RequestBody::Read`]), no
    /// upgrade, not `CONNECT`. Others go through hyper's client
    /// ([`request`]).
    ///
    /// [`request_own`]: UpstreamClient::request_own
    /// [`request`]: UpstreamClient::request
    pub fn own_way(server: &UpstreamServer, req: &Request<RequestBody>, upgrade: bool) -> bool {
        server.scheme != http::uri::Scheme::HTTPS
            && !upgrade
            && (req.body().is_end_stream() || matches!(req.body(), RequestBody::Read(_)))
            && req.method() != Method::CONNECT
    }

    /// Sends `req` (its URI in origin form, its `Host` set) to `server`
    /// through hyper's client.
    pub async fn request(
        &self,
        server: &UpstreamServer,
        mut req: Request<RequestBody>,
    ) -> Result<Response<PooledBody>, UpstreamError> {
        let origin: Origin = (
            server.scheme == http::uri::Scheme::HTTPS,
            server.host.clone(),
        );
        // Set once a request was resent: it goes on a new connection.
        let mut fresh = false;
        loop {
            let pooled = if fresh {
                None
            } else {
                self.pools.hyper.checkout(&origin, server.keepalive)
            };
            let (mut sender, idle_for, reused) = match pooled {
                Some((sender, idle_for)) => (sender, idle_for, true),
                // Boxed: rare once the pool is warm, and its state is large.
                None => {
                    let sender = Box::pin(self.connect_hyper(server, origin.0)).await?;
                    (sender, Duration::ZERO, false)
                }
            };
            // A pooled connection may have been closed since it was checked.
            if reused && sender.ready().await.is_err() {
                continue;
            }
            let replay = (reused && idle_for >= REPLAY_AFTER_IDLE)
                .then(|| replayable(&req))
                .flatten();
            match sender.try_send_request(req).await {
                Ok(resp) => {
                    let back = (resp.status() != StatusCode::SWITCHING_PROTOCOLS)
                        .then(|| (sender, Arc::clone(&self.pools), origin, server.keepalive));
                    return Ok(resp.map(|body| PooledBody::hyper(body, back)));
                }
                Err(mut e) => match (e.take_message(), replay) {
                    // Not sent: the connection was closed under it. A fresh
                    // one gets the request; a fresh one that fails is an error.
                    (Some(unsent), _) if reused => req = unsent,
                    // Sent, and the connection closed without an answer.
                    (None, Some(again)) if closed_unanswered(e.error()) => {
                        req = again;
                        fresh = true;
                    }
                    _ => return Err(UpstreamError::Http(e.into_error())),
                },
            }
        }
    }

    /// Sends a request the own way ([`h1`]): its `head`, HTTP/1.1 bytes
    /// (with its body behind, if it has one), as
    /// [`own_way`](UpstreamClient::own_way) allows.
    pub async fn request_own(
        &self,
        server: &UpstreamServer,
        head: h1::HeadBuf,
        method: Method,
    ) -> Result<Response<PooledBody>, UpstreamError> {
        let origin: Origin = (false, server.host.clone());
        let head_only = method == Method::HEAD;
        let safe = safe_to_repeat(&method);
        // Set once a request was resent: it goes on a new connection.
        let mut fresh = false;
        loop {
            let pooled = if fresh {
                None
            } else {
                self.pools.own.checkout(&origin, server.keepalive)
            };
            let (mut conn, idle_for, reused) = match pooled {
                Some((conn, idle_for)) => (conn, idle_for, true),
                // Boxed, as in `request`: its state would size every
                // request's future.
                None => (
                    h1::Conn::new(Box::pin(self.connect_tcp(server, false)).await?),
                    Duration::ZERO,
                    false,
                ),
            };
            match h1::send(&mut conn, &head, head_only).await {
                Ok((resp, reader)) => {
                    let back = (Arc::clone(&self.pools), origin, server.keepalive);
                    return Ok(resp.map(|()| PooledBody::own(conn, reader, back)));
                }
                // Not sent: the connection was closed under it.
                Err(h1::H1Error::NotSent(_)) if reused => {}
                // Sent, and the connection closed without an answer.
                Err(h1::H1Error::Unanswered) if reused && safe && idle_for >= REPLAY_AFTER_IDLE => {
                    fresh = true;
                }
                Err(e) => return Err(e.into()),
            }
        }
    }

    /// A new TCP connection to `server`.
    async fn connect_tcp(
        &self,
        server: &UpstreamServer,
        tls: bool,
    ) -> Result<TcpStream, UpstreamError> {
        let failed = |reason: String| UpstreamError::Connect {
            server: server.to_string(),
            reason,
        };
        let port = server
            .authority
            .port_u16()
            .unwrap_or(if tls { 443 } else { 80 });
        let tcp = TcpStream::connect((bare_host(server), port))
            .await
            .map_err(|e| failed(e.to_string()))?;
        let _ = tcp.set_nodelay(true);
        let keepalive = socket2::TcpKeepalive::new().with_time(Duration::from_secs(60));
        let _ = socket2::SockRef::from(&tcp).set_tcp_keepalive(&keepalive);
        Ok(tcp)
    }

    /// A new hyper connection to `server`, its task spawned.
    async fn connect_hyper(
        &self,
        server: &UpstreamServer,
        tls: bool,
    ) -> Result<SendRequest<RequestBody>, UpstreamError> {
        let failed = |reason: String| UpstreamError::Connect {
            server: server.to_string(),
            reason,
        };
        let tcp = self.connect_tcp(server, tls).await?;
        let builder = http1::Builder::new();
        if !tls {
            let (sender, conn) = builder
                .handshake(TokioIo::new(Coalesce(tcp)))
                .await
                .map_err(|e| failed(e.to_string()))?;
            tokio::spawn(conn.with_upgrades());
            return Ok(sender);
        }
        let name = rustls::pki_types::ServerName::try_from(bare_host(server).to_string())
            .map_err(|e| failed(format!("not a TLS server name: {e}")))?;
        let tls = self.tls().map_err(|e| failed(format!("TLS: {e}")))?;
        let stream = tls
            .connect(name, tcp)
            .await
            .map_err(|e| failed(format!("TLS: {e}")))?;
        let (sender, conn) = builder
            .handshake(TokioIo::new(stream))
            .await
            .map_err(|e| failed(e.to_string()))?;
        tokio::spawn(conn.with_upgrades());
        Ok(sender)
    }
}

/// An upstream response body that returns its connection to the pool once
/// read to the end.
///
/// Boxed: a response is moved about twenty times on its way to the client,
/// and the connection it holds would make each move a copy of some 170
/// bytes; one allocation is cheaper.
pub struct PooledBody(Box<Held>);

/// What the body holds: its reader, and its client's slot (see
/// [`super::per_client`]), given back when the body is dropped.
struct Held {
    read: Read,
    slot: Option<Slot>,
    /// The request's settlement, when it waits for the body's end.
    meter: Option<Box<super::metering::Metering>>,
    /// Small data frames are copied out of the connection's read buffer
    /// (see [`PooledBody::detach`]).
    detached: bool,
}

type Back<C> = (C, Arc<Pools>, Origin, Keepalive);

enum Read {
    Hyper {
        inner: Incoming,
        back: Option<Back<SendRequest<RequestBody>>>,
    },
    Own {
        reader: h1::Reader,
        /// The connection, while the body is being read from it.
        back: Option<Back<h1::Conn>>,
    },
    /// Read ahead of the client by a task (see [`PooledBody::read_ahead`]).
    Ahead {
        pumped: crate::stall::Pumped,
        fields: Option<Box<h1::Fields>>,
    },
}

/// The largest data frame a detached body copies (see
/// [`PooledBody::detach`]); a larger one costs the connection a new buffer.
const DETACHED_COPY: usize = 4 * 1024;

/// Answers of known length up to this size are not read ahead: the
/// sockets' buffers on both sides hold them, so the upstream is done with
/// them anyway, and a task per answer would cost the usual small one.
const SMALL: u64 = 64 * 1024;

impl PooledBody {
    /// The answer's fields as the own client read them (see [`h1::Fields`]);
    /// `None` when they are in the answer's map.
    pub fn take_fields(&mut self) -> Option<Box<h1::Fields>> {
        match &mut self.0.read {
            Read::Own { reader, .. } => reader.take_fields(),
            Read::Hyper { .. } => None,
            Read::Ahead { fields, .. } => fields.take(),
        }
    }

    /// For an answer hyper's server sends: its fields (`None` when they are
    /// in the answer's map), and from now on its small data frames, are
    /// copied out of the upstream connection's read buffer. hyper keeps them
    /// until they are written (HTTP/2 frames wait for the connection's task;
    /// HPACK's table keeps values for the connection's life), while the
    /// connection, given back at the body's end, reads its next answer: a
    /// buffer they still shared could not be reused, and a new one was
    /// allocated for that answer.
    pub fn detach(&mut self) -> Option<Box<h1::Fields>> {
        self.0.detached = true;
        let mut fields = self.take_fields()?;
        fields.detach();
        Some(fields)
    }

    /// Reads the rest of the answer up to `bytes` ahead of the client (the
    /// upstream's `buffer`), so that a slow client does not hold the upstream
    /// (a backend worker, its connection) longer than the answer takes to
    /// arrive; a client that takes nothing for `send_timeout` from a full
    /// buffer ends it. `0`: streamed as the client takes it.
    pub fn read_ahead(mut self, bytes: usize, send_timeout: Duration) -> PooledBody {
        if bytes == 0
            || self.is_end_stream()
            || self.size_hint().exact().is_some_and(|n| n <= SMALL)
        {
            return self;
        }
        let fields = self.take_fields();
        let slot = self.0.slot.take();
        // Metered here, where the client takes the body, not where it is
        // read ahead.
        let meter = self.0.meter.take();
        let pumped = crate::stall::Pumped::new(self, bytes, send_timeout, || {});
        PooledBody(Box::new(Held {
            read: Read::Ahead { pumped, fields },
            slot,
            meter,
            detached: false,
        }))
    }

    /// Field `name` of the answer, when the own client read its head
    /// (hyper's answers keep theirs in the map).
    pub fn field(&self, name: &http::HeaderName) -> Option<&[u8]> {
        let fields = match &self.0.read {
            Read::Own { reader, .. } => reader.fields()?,
            Read::Ahead { fields, .. } => fields.as_deref()?,
            Read::Hyper { .. } => return None,
        };
        let name = name.as_str().as_bytes();
        fields
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v)
    }

    /// Keeps the client's slot until the body is done with.
    pub fn hold(&mut self, slot: Slot) {
        self.0.slot = Some(slot);
    }

    /// Settles the request when the body has been sent, or dropped.
    pub fn settle_at_end(&mut self, meter: super::metering::Metering) {
        self.0.meter = Some(Box::new(meter));
    }

    fn hyper(inner: Incoming, back: Option<Back<SendRequest<RequestBody>>>) -> PooledBody {
        let end = inner.is_end_stream();
        let mut body = PooledBody(Box::new(Held {
            read: Read::Hyper { inner, back },
            slot: None,
            meter: None,
            detached: false,
        }));
        // An empty body (a 204, a HEAD) may never be polled.
        if end {
            body.give_back();
        }
        body
    }

    fn own(
        conn: h1::Conn,
        reader: h1::Reader,
        (pools, origin, keep): (Arc<Pools>, Origin, Keepalive),
    ) -> PooledBody {
        let end = reader.is_end();
        let mut body = PooledBody(Box::new(Held {
            read: Read::Own {
                reader,
                back: Some((conn, pools, origin, keep)),
            },
            slot: None,
            meter: None,
            detached: false,
        }));
        if end {
            body.give_back();
        }
        body
    }

    fn give_back(&mut self) {
        match &mut self.0.read {
            Read::Hyper { back, .. } => {
                if let Some((sender, pools, origin, keep)) = back.take() {
                    pools.hyper.give_back(origin, sender, keep);
                }
            }
            Read::Own { reader, back } => {
                if let Some((conn, pools, origin, keep)) = back.take()
                    && reader.reusable(&conn)
                {
                    pools.own.give_back(origin, conn, keep);
                }
            }
            // The task gives its body's connection back.
            Read::Ahead { .. } => {}
        }
    }
}

impl Body for PooledBody {
    type Data = Bytes;
    type Error = Box<dyn std::error::Error + Send + Sync>;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        let this = &mut *self;
        let (frame, end) = match &mut this.0.read {
            Read::Hyper { inner, back } => {
                let frame = ready!(Pin::new(&mut *inner).poll_frame(cx));
                let end = ends(&frame, inner.is_end_stream(), back);
                (frame.map(|f| f.map_err(Into::into)), end)
            }
            Read::Own { reader, back } => {
                let Some((conn, ..)) = back else {
                    return Poll::Ready(None);
                };
                let mut frame = ready!(reader.poll_frame(conn, cx));
                if this.0.detached
                    && let Some(Ok(f)) = &mut frame
                    && let Some(data) = f.data_mut()
                    && data.len() <= DETACHED_COPY
                {
                    *data = Bytes::copy_from_slice(data);
                }
                let end = ends(&frame, reader.is_end(), back);
                (frame.map(|f| f.map_err(Into::into)), end)
            }
            Read::Ahead { pumped, .. } => {
                let frame = ready!(Pin::new(&mut *pumped).poll_frame(cx));
                let end = frame.is_none() || pumped.is_end_stream();
                (frame, end)
            }
        };
        if let Some(meter) = &mut this.0.meter {
            match &frame {
                Some(Ok(f)) => {
                    if let Some(data) = f.data_ref() {
                        meter.data(data.len());
                    } else if let Some(trailers) = f.trailers_ref() {
                        meter.trailers(trailers);
                    }
                }
                Some(Err(_)) => {}
                None => meter.ended(),
            }
            if end && !matches!(frame, Some(Err(_))) {
                meter.ended();
            }
        }
        if end {
            this.give_back();
        }
        Poll::Ready(frame)
    }

    fn is_end_stream(&self) -> bool {
        match &self.0.read {
            Read::Hyper { inner, .. } => inner.is_end_stream(),
            Read::Own { reader, back } => back.is_none() || reader.is_end(),
            Read::Ahead { pumped, .. } => pumped.is_end_stream(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match &self.0.read {
            Read::Hyper { inner, .. } => inner.size_hint(),
            Read::Own { reader, .. } => reader.size_hint(),
            Read::Ahead { pumped, .. } => pumped.size_hint(),
        }
    }
}

/// Whether `frame` ends the body (`at_end`: the body says it is complete).
/// The server stops polling once the body says so, or once it has had the
/// trailers (always the last frame: the whole answer has been read by then).
/// A broken body leaves a broken connection: it is not pooled.
fn ends<E, C>(frame: &Option<Result<Frame<Bytes>, E>>, at_end: bool, back: &mut Option<C>) -> bool {
    match frame {
        None => true,
        Some(Ok(f)) => f.is_trailers() || at_end,
        Some(Err(_)) => {
            *back = None;
            false
        }
    }
}

/// An upstream's host as a name or address to connect to (an IPv6 literal
/// comes bracketed in the authority).
fn bare_host(server: &UpstreamServer) -> &str {
    server
        .authority
        .host()
        .trim_start_matches('[')
        .trim_end_matches(']')
}

/// A client's request body as a server reads it: hyper's (HTTP/1.1, left),
/// or sluice's own HTTP/2 server's (right).
pub type ClientBody = http_body_util::Either<Incoming, crate::http2::RecvBody>;

/// A request's body: the client's as a server reads it, or none (a
/// request sluice's own server ([`crate::front`]) took, which never has one,
/// or one sent once more, see [`replayable`]).
pub enum RequestBody {
    Stream(ClientBody),
    /// Taken whole from the client before forwarding (see
    /// [`RequestBody::take`]).
    Taken(VecDeque<Frame<Bytes>>),
    /// Read whole by sluice's own server (at most [`crate::front::MAX_BODY`]
    /// bytes), framed by its request's one `Content-Length`, which says its
    /// size: it may go the own way, behind the head.
    Read(Bytes),
    /// Larger than the upstream's `buffer`: what was taken, then the rest.
    Begun(VecDeque<Frame<Bytes>>, ClientBody),
    /// The client's, on its way upstream (see [`RequestBody::watch`]).
    Uploading(Box<Uploading>),
    Empty,
}

/// A request body being sent upstream: it fails once the client has sent
/// nothing for `server.client_body_timeout`, and says when it has all gone.
pub struct Uploading {
    /// Frames taken before the upload began (see [`RequestBody::take`]).
    first: VecDeque<Frame<Bytes>>,
    inner: ClientBody,
    /// `server.client_body_timeout`, while the client keeps the body waiting.
    waiting: crate::stall::Waiting,
    /// Told when the whole body has been handed to the upstream connection.
    sent: Option<tokio::sync::oneshot::Sender<()>>,
    progress: Arc<Progress>,
}

/// How an upload is going, for the wait on the upstream meanwhile.
#[derive(Default)]
pub struct Progress {
    /// When the upstream connection last asked for more ([`crate::clock::coarse_ms`]).
    asked_ms: std::sync::atomic::AtomicU64,
    /// Whether that ask is waiting for the client.
    waiting_for_client: std::sync::atomic::AtomicBool,
}

impl Progress {
    /// How long the upstream has taken nothing while the client had given
    /// all it was asked for (nginx's `proxy_send_timeout`).
    pub fn upstream_stalled_for(&self) -> Duration {
        use std::sync::atomic::Ordering;
        if self.waiting_for_client.load(Ordering::Acquire) {
            return Duration::ZERO;
        }
        let asked = self.asked_ms.load(Ordering::Acquire);
        Duration::from_millis(crate::clock::coarse_ms().saturating_sub(asked))
    }
}

/// The client sent no request body bytes for `server.client_body_timeout`.
#[derive(Debug, thiserror::Error)]
#[error("no request body bytes for server.client_body_timeout")]
pub struct BodyStalled;

/// Why a request body could not be taken (see [`RequestBody::take`]).
#[derive(Debug)]
pub enum TakeError {
    /// The client sent nothing for `server.client_body_timeout`.
    Stalled,
    /// The client's body was malformed or cut off.
    Failed,
}

impl RequestBody {
    /// Reads the client's body before it goes upstream, as nginx does, so
    /// that a slow upload keeps no backend worker waiting: the whole body
    /// when it is at most `limit` bytes (the upstream's `buffer`), else the
    /// first `limit` bytes and the rest streamed after them. Each wait for
    /// the client is bounded by `idle` (`server.client_body_timeout`).
    pub async fn take(&mut self, limit: usize, idle: Duration) -> Result<(), TakeError> {
        let known_larger = self.size_hint().lower() > limit as u64;
        if limit == 0 || known_larger || self.is_end_stream() {
            return Ok(());
        }
        let mut inner = match std::mem::replace(self, RequestBody::Empty) {
            RequestBody::Stream(inner) => inner,
            other => {
                *self = other;
                return Ok(());
            }
        };
        let mut frames = VecDeque::new();
        let mut size = 0;
        while !inner.is_end_stream() {
            let frame = match tokio::time::timeout(idle, http_body_util::BodyExt::frame(&mut inner))
                .await
            {
                Err(_) => return Err(TakeError::Stalled),
                Ok(Some(Err(_))) => return Err(TakeError::Failed),
                Ok(None) => break,
                Ok(Some(Ok(frame))) => frame,
            };
            size += frame.data_ref().map_or(0, Bytes::len);
            frames.push_back(frame);
            if size > limit && !inner.is_end_stream() {
                *self = RequestBody::Begun(frames, inner);
                return Ok(());
            }
        }
        *self = RequestBody::Taken(frames);
        Ok(())
    }

    /// Watches a body still to come from the client: it fails after `limit`
    /// without a byte from the client (a timer that runs only while the
    /// upstream waits for the client, not the other way round), and the
    /// receiver learns when all of it has been sent. `None`: no body to wait for.
    pub fn watch(
        &mut self,
        limit: Duration,
    ) -> Option<(tokio::sync::oneshot::Receiver<()>, Arc<Progress>)> {
        if self.is_end_stream() {
            return None;
        }
        let (first, inner) = match std::mem::replace(self, RequestBody::Empty) {
            RequestBody::Stream(inner) => (VecDeque::new(), inner),
            RequestBody::Begun(first, inner) => (first, inner),
            other => {
                *self = other;
                return None;
            }
        };
        let (tx, rx) = tokio::sync::oneshot::channel();
        let progress = Arc::new(Progress {
            asked_ms: crate::clock::coarse_ms().into(),
            waiting_for_client: false.into(),
        });
        *self = RequestBody::Uploading(Box::new(Uploading {
            first,
            inner,
            waiting: crate::stall::Waiting::new(limit),
            sent: Some(tx),
            progress: progress.clone(),
        }));
        Some((rx, progress))
    }
}

impl Uploading {
    fn poll_frame(&mut self, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        use std::sync::atomic::Ordering;
        if let Some(frame) = self.first.pop_front() {
            self.progress
                .asked_ms
                .store(crate::clock::coarse_ms(), Ordering::Release);
            return Poll::Ready(Some(Ok(frame)));
        }
        let poll = Pin::new(&mut self.inner).poll_frame(cx);
        self.progress
            .asked_ms
            .store(crate::clock::coarse_ms(), Ordering::Release);
        self.progress
            .waiting_for_client
            .store(poll.is_pending(), Ordering::Release);
        if self.waiting.poll(cx, poll.is_pending()).is_ready() {
            // hyper's client reports it as a user error whose source this
            // is (see `is_body_stalled`).
            return Poll::Ready(Some(Err(Box::new(BodyStalled))));
        }
        if let Poll::Ready(frame) = &poll {
            let over = match frame {
                None | Some(Err(_)) => true,
                Some(Ok(_)) => self.inner.is_end_stream(),
            };
            if over && let Some(sent) = self.sent.take() {
                let _ = sent.send(());
            }
        }
        poll
    }
}

/// Whether `e` (from hyper's client) is a request body that stalled.
pub fn is_body_stalled(e: &hyper::Error) -> bool {
    let mut cause = std::error::Error::source(e);
    while let Some(c) = cause {
        if c.is::<BodyStalled>() {
            return true;
        }
        cause = c.source();
    }
    false
}

type BoxError = Box<dyn std::error::Error + Send + Sync>;

impl Body for RequestBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        match self.get_mut() {
            RequestBody::Stream(body) => Pin::new(body).poll_frame(cx),
            RequestBody::Taken(frames) => Poll::Ready(frames.pop_front().map(Ok)),
            RequestBody::Read(data) if data.is_empty() => Poll::Ready(None),
            RequestBody::Read(data) => Poll::Ready(Some(Ok(Frame::data(std::mem::take(data))))),
            RequestBody::Begun(frames, body) => match frames.pop_front() {
                Some(frame) => Poll::Ready(Some(Ok(frame))),
                None => Pin::new(body).poll_frame(cx),
            },
            RequestBody::Uploading(body) => body.poll_frame(cx),
            RequestBody::Empty => Poll::Ready(None),
        }
    }

    fn is_end_stream(&self) -> bool {
        match self {
            RequestBody::Stream(body) => body.is_end_stream(),
            RequestBody::Taken(frames) => frames.is_empty(),
            RequestBody::Read(data) => data.is_empty(),
            RequestBody::Begun(..) => false,
            RequestBody::Uploading(body) => body.first.is_empty() && body.inner.is_end_stream(),
            RequestBody::Empty => true,
        }
    }

    fn size_hint(&self) -> SizeHint {
        match self {
            RequestBody::Stream(body) => body.size_hint(),
            RequestBody::Taken(frames) => SizeHint::with_exact(data_size(frames)),
            RequestBody::Read(data) => SizeHint::with_exact(data.len() as u64),
            RequestBody::Begun(frames, body) => after(data_size(frames), body.size_hint()),
            RequestBody::Uploading(body) => after(data_size(&body.first), body.inner.size_hint()),
            RequestBody::Empty => SizeHint::with_exact(0),
        }
    }
}

/// The data bytes of `frames`.
fn data_size(frames: &VecDeque<Frame<Bytes>>) -> u64 {
    frames
        .iter()
        .map(|f| f.data_ref().map_or(0, |d| d.len() as u64))
        .sum()
}

/// The size of `taken` bytes followed by a body of size `rest`.
fn after(taken: u64, rest: SizeHint) -> SizeHint {
    let mut hint = SizeHint::new();
    hint.set_lower(rest.lower().saturating_add(taken));
    if let Some(upper) = rest.upper() {
        hint.set_upper(upper.saturating_add(taken));
    }
    hint
}

/// A copy of `req` to send again if it is lost with its connection: only a
/// request that asks for nothing to change (`GET`, `HEAD`, `OPTIONS`,
/// `TRACE`) and has no body.
fn replayable(req: &Request<RequestBody>) -> Option<Request<RequestBody>> {
    if !safe_to_repeat(req.method()) || !req.body().is_end_stream() {
        return None;
    }
    let mut copy = Request::new(RequestBody::Empty);
    *copy.method_mut() = req.method().clone();
    *copy.uri_mut() = req.uri().clone();
    *copy.version_mut() = req.version();
    *copy.headers_mut() = req.headers().clone();
    Some(copy)
}

/// A method that asks for nothing to change, so a lost request may be sent
/// again.
fn safe_to_repeat(method: &Method) -> bool {
    matches!(
        *method,
        Method::GET | Method::HEAD | Method::OPTIONS | Method::TRACE
    )
}

/// The upstream closed the connection after the request was written, before
/// any answer: what an idle timeout running out at that moment looks like.
fn closed_unanswered(e: &hyper::Error) -> bool {
    use std::error::Error as _;
    e.is_incomplete_message()
        || e.source()
            .and_then(|s| s.downcast_ref::<std::io::Error>())
            .is_some_and(|io| {
                matches!(
                    io.kind(),
                    std::io::ErrorKind::ConnectionReset
                        | std::io::ErrorKind::BrokenPipe
                        | std::io::ErrorKind::ConnectionAborted
                )
            })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// A kept connection that counts its closing.
    struct Counted(Arc<AtomicUsize>);

    impl Reusable for Counted {
        fn is_open(&self) -> bool {
            true
        }
    }

    impl Drop for Counted {
        fn drop(&mut self) {
            self.0.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Connections that ran out together are closed by a task of their own,
    /// a few at a time, not in the request that found them.
    #[tokio::test]
    async fn stale_connections_are_closed_apart_from_the_request() {
        let closed = Arc::new(AtomicUsize::new(0));
        let stacks = Stacks::default();
        let origin: Origin = (false, HeaderValue::from_static("upstream:80"));
        let kept = Keepalive {
            idle: 1000,
            timeout: Duration::from_secs(60),
        };
        for _ in 0..100 {
            stacks.give_back(origin.clone(), Counted(closed.clone()), kept);
        }
        assert_eq!(closed.load(Ordering::Relaxed), 0);
        // All of them have now been idle too long.
        let run_out = Keepalive {
            timeout: Duration::ZERO,
            ..kept
        };
        assert!(stacks.checkout(&origin, run_out).is_none());
        assert_eq!(closed.load(Ordering::Relaxed), 0, "closed in the request");
        assert!(stacks.lock()[&origin].is_empty());
        tokio::time::timeout(Duration::from_secs(10), async {
            while closed.load(Ordering::Relaxed) < 100 {
                tokio::task::yield_now().await;
            }
        })
        .await
        .expect("the task closed them all");
    }
}
