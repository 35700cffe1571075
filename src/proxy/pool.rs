//! The upstream client: keep-alive HTTP/1.1 connections to the upstreams,
//! plain or TLS, kept in a pool per origin.
//!
//! hyper's own connections (`hyper::client::conn::http1`), each driven by a
//! task of its own, with a pool kept as simple as the proxy needs: a stack of
//! idle connections per origin, last used first. A connection goes back to
//! the pool when the response body has been read to its end (the wrapper
//! [`PooledBody`] sees it), not before: a connection still streaming a body
//! cannot take another request, and one whose body was abandoned is closed
//! by hyper. Compared with hyper-util's general-purpose client this saves, per
//! request, a pool checkout future, a task that waits for the connection to
//! be idle again, and several moves of the request (measured: about 5,000
//! instructions of sluice's 48,000 per request).
//!
//! A pooled connection the upstream closed just as it was picked fails
//! before the request is written; the request is then sent once more on a
//! new connection, as hyper-util's client does. One the upstream closes just
//! as the request is written (its idle timeout running out then) fails with
//! no answer: a request that can safely be sent again (`GET`, `HEAD`,
//! `OPTIONS`, `TRACE`, without a body, as Go's client and nginx judge it) is
//! sent once more on a new connection, when its connection had been idle long
//! enough for that to be the likely cause. Its head is kept for that only then:
//! a busy connection is never idle that long, and the copy is not free.

use std::collections::HashMap;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, ready};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::header::HeaderValue;
use http::{Method, Request, Response, StatusCode};
use hyper::body::{Body, Frame, Incoming, SizeHint};
use hyper::client::conn::http1::{self, SendRequest};
use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;

use crate::coalesce::Coalesce;
use crate::config::UpstreamServer;
use crate::tls::TlsError;

/// Idle connections kept per origin, at most.
const MAX_IDLE: usize = 256;
/// An idle connection older than this is closed rather than reused.
const IDLE_TIMEOUT: Duration = Duration::from_secs(60);
/// A connection idle this long may be one the upstream is closing: a request
/// sent on it that can be sent again is kept, in case.
const REPLAY_AFTER_IDLE: Duration = Duration::from_millis(100);

/// An upstream origin: TLS or not, and `host:port`.
type Origin = (bool, HeaderValue);

struct Idle {
    sender: SendRequest<UpBody>,
    since: Instant,
}

#[derive(Default)]
struct Pools {
    idle: Mutex<HashMap<Origin, Vec<Idle>, foldhash::fast::RandomState>>,
}

impl Pools {
    fn lock(
        &self,
    ) -> std::sync::MutexGuard<'_, HashMap<Origin, Vec<Idle>, foldhash::fast::RandomState>> {
        // Nothing panics while holding the lock; a poisoned one is still sound.
        self.idle.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The most recently used idle connection of `origin` that is still open,
    /// and how long it was idle.
    fn checkout(&self, origin: &Origin) -> Option<(SendRequest<UpBody>, Duration)> {
        let mut pools = self.lock();
        let stack = pools.get_mut(origin)?;
        while let Some(idle) = stack.pop() {
            let idle_for = idle.since.elapsed();
            if !idle.sender.is_closed() && idle_for < IDLE_TIMEOUT {
                return Some((idle.sender, idle_for));
            }
        }
        None
    }

    fn give_back(&self, origin: Origin, sender: SendRequest<UpBody>) {
        if sender.is_closed() {
            return;
        }
        let now = Instant::now();
        let mut pools = self.lock();
        let stack = pools.entry(origin).or_default();
        // The oldest is at the bottom: drop it once it is too old or the
        // stack too high (dropping the sender closes its connection).
        if stack.first().is_some_and(|i| now - i.since >= IDLE_TIMEOUT) || stack.len() >= MAX_IDLE {
            stack.remove(0);
        }
        stack.push(Idle { sender, since: now });
    }
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
}

/// The client of every upstream that trusts the same CAs.
#[derive(Clone)]
pub struct UpstreamClient {
    tls: tokio_rustls::TlsConnector,
    pools: Arc<Pools>,
}

impl UpstreamClient {
    /// A client trusting the system roots, plus `extra_ca` if given.
    pub fn new(extra_ca: Option<&std::path::Path>) -> Result<UpstreamClient, TlsError> {
        let mut tls = crate::tls::client_config(extra_ca)?;
        tls.alpn_protocols = vec![b"http/1.1".to_vec()];
        Ok(UpstreamClient {
            tls: tokio_rustls::TlsConnector::from(Arc::new(tls)),
            pools: Arc::default(),
        })
    }

    /// Sends `req` (its URI in origin form, its `Host` set) to `server`.
    pub async fn request(
        &self,
        server: &UpstreamServer,
        req: Request<Incoming>,
    ) -> Result<Response<PooledBody>, UpstreamError> {
        let origin: Origin = (
            server.scheme == http::uri::Scheme::HTTPS,
            server.host.clone(),
        );
        let mut req = req.map(UpBody::Stream);
        // Set once a request was resent: it goes on a new connection.
        let mut fresh = false;
        loop {
            let pooled = if fresh {
                None
            } else {
                self.pools.checkout(&origin)
            };
            let (mut sender, idle_for, reused) = match pooled {
                Some((sender, idle_for)) => (sender, idle_for, true),
                // Boxed: rare once the pool is warm, and its state is large.
                None => {
                    let sender = Box::pin(self.connect(server, origin.0)).await?;
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
                        .then(|| (sender, Arc::clone(&self.pools), origin));
                    return Ok(resp.map(|body| PooledBody::new(body, back)));
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

    /// A new connection to `server`, its task spawned.
    async fn connect(
        &self,
        server: &UpstreamServer,
        tls: bool,
    ) -> Result<SendRequest<UpBody>, UpstreamError> {
        let failed = |reason: String| UpstreamError::Connect {
            server: server.to_string(),
            reason,
        };
        let host = server.authority.host();
        let port = server
            .authority
            .port_u16()
            .unwrap_or(if tls { 443 } else { 80 });
        // An IPv6 literal comes bracketed in the authority.
        let bare = host.trim_start_matches('[').trim_end_matches(']');
        let tcp = TcpStream::connect((bare, port))
            .await
            .map_err(|e| failed(e.to_string()))?;
        let _ = tcp.set_nodelay(true);
        let keepalive = socket2::TcpKeepalive::new().with_time(Duration::from_secs(60));
        let _ = socket2::SockRef::from(&tcp).set_tcp_keepalive(&keepalive);
        let builder = http1::Builder::new();
        if !tls {
            let (sender, conn) = builder
                .handshake(TokioIo::new(Coalesce(tcp)))
                .await
                .map_err(|e| failed(e.to_string()))?;
            tokio::spawn(conn.with_upgrades());
            return Ok(sender);
        }
        let name = rustls::pki_types::ServerName::try_from(bare.to_string())
            .map_err(|e| failed(format!("not a TLS server name: {e}")))?;
        let stream = self
            .tls
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
pub struct PooledBody {
    inner: Incoming,
    back: Option<(SendRequest<UpBody>, Arc<Pools>, Origin)>,
}

impl PooledBody {
    fn new(inner: Incoming, back: Option<(SendRequest<UpBody>, Arc<Pools>, Origin)>) -> PooledBody {
        let mut body = PooledBody { inner, back };
        // An empty body (a 204, a HEAD) may never be polled.
        if body.inner.is_end_stream() {
            body.give_back();
        }
        body
    }

    fn give_back(&mut self) {
        if let Some((sender, pools, origin)) = self.back.take() {
            pools.give_back(origin, sender);
        }
    }
}

impl Body for PooledBody {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, hyper::Error>>> {
        let frame = ready!(Pin::new(&mut self.inner).poll_frame(cx));
        match &frame {
            // The server stops polling once the body says it is complete, or
            // once it has had the trailers (always the last frame: hyper has
            // read the whole answer by then).
            None => self.give_back(),
            Some(Ok(f)) if f.is_trailers() || self.inner.is_end_stream() => self.give_back(),
            // A broken body leaves a broken connection: not pooled.
            Some(Err(_)) => self.back = None,
            Some(Ok(_)) => {}
        }
        Poll::Ready(frame)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// A request body on its way upstream: the client's, or none (a request sent
/// once more, see [`replayable`]).
pub enum UpBody {
    Stream(Incoming),
    Empty,
}

impl Body for UpBody {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, hyper::Error>>> {
        match self.get_mut() {
            UpBody::Stream(body) => Pin::new(body).poll_frame(cx),
            UpBody::Empty => Poll::Ready(None),
        }
    }

    fn is_end_stream(&self) -> bool {
        match self {
            UpBody::Stream(body) => body.is_end_stream(),
            UpBody::Empty => true,
        }
    }

    fn size_hint(&self) -> SizeHint {
        match self {
            UpBody::Stream(body) => body.size_hint(),
            UpBody::Empty => SizeHint::with_exact(0),
        }
    }
}

/// A copy of `req` to send again if it is lost with its connection: only a
/// request that asks for nothing to change (`GET`, `HEAD`, `OPTIONS`,
/// `TRACE`) and has no body.
fn replayable(req: &Request<UpBody>) -> Option<Request<UpBody>> {
    let safe = matches!(
        *req.method(),
        Method::GET | Method::HEAD | Method::OPTIONS | Method::TRACE
    );
    if !safe || !req.body().is_end_stream() {
        return None;
    }
    let mut copy = Request::new(UpBody::Empty);
    *copy.method_mut() = req.method().clone();
    *copy.uri_mut() = req.uri().clone();
    *copy.version_mut() = req.version();
    *copy.headers_mut() = req.headers().clone();
    Some(copy)
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
