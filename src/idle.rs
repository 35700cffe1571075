//! Closing client connections that have no request going.
//!
//! A connection with no request in flight is closed once no request head has
//! arrived for `server.header_timeout`: that ends idle keep-alive connections
//! and clients that send a head too slowly (or never finish it). hyper can do
//! this itself (`header_read_timeout`, HTTP/1 only), but it makes and drops a
//! timer for every request, about 1,400 instructions a request, 4 % of
//! proxying one. Here a connection counts its requests in flight and notes when
//! the last one ended; one timer per connection wakes at most once per
//! `header_timeout` to look at them.
//!
//! A request is in flight from the moment its head is parsed until its
//! response body has been sent (or dropped), so a slow upstream or a long
//! download is never cut short by this timer.

use std::fmt::Display;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use std::task::{Context, Poll};
use std::time::Duration;

use hyper::body::{Body, Frame, SizeHint};
use tokio::task::AbortHandle;

/// Milliseconds on a monotonic clock, to the kernel's tick: the timeout is
/// in seconds, and this is read at the end of every request.
fn now_ms() -> u64 {
    crate::clock::coarse_ms()
}

/// One client connection's requests.
#[derive(Debug)]
pub struct Idle {
    in_flight: AtomicUsize,
    /// When the connection was accepted or its last request ended.
    since_ms: AtomicU64,
    /// The task that closes the connection, stopped when the connection ends.
    watchdog: OnceLock<AbortHandle>,
    /// The connection's own task (see [`Idle::close`]).
    conn: OnceLock<AbortHandle>,
}

impl Idle {
    pub fn new() -> Arc<Idle> {
        Arc::new(Idle {
            in_flight: AtomicUsize::new(0),
            since_ms: AtomicU64::new(now_ms()),
            watchdog: OnceLock::new(),
            conn: OnceLock::new(),
        })
    }

    /// Closes the connection now, its requests in flight included (a
    /// client that stopped reading, see [`crate::stall`]).
    pub fn close(&self) {
        if let Some(conn) = self.conn.get() {
            conn.abort();
        }
    }

    /// A request head has arrived; the request ends when the guard drops.
    pub fn begin(self: Arc<Self>) -> InFlight {
        self.in_flight.fetch_add(1, Ordering::AcqRel);
        InFlight(self)
    }

    /// Resolves once the connection has had no request in flight for `limit`.
    pub async fn expired(&self, limit: Duration) {
        let limit_ms = limit.as_millis() as u64;
        loop {
            let wait = if self.in_flight.load(Ordering::Acquire) > 0 {
                limit_ms
            } else {
                let idle = now_ms().saturating_sub(self.since_ms.load(Ordering::Acquire));
                if idle >= limit_ms {
                    return;
                }
                limit_ms - idle
            };
            tokio::time::sleep(Duration::from_millis(wait)).await;
        }
    }
}

/// A request in flight (see [`Idle::begin`]).
#[derive(Debug)]
pub struct InFlight(Arc<Idle>);

impl Drop for InFlight {
    fn drop(&mut self) {
        // The time first: a watcher that sees no request in flight must also
        // see when the last one ended.
        self.0.since_ms.store(now_ms(), Ordering::Release);
        self.0.in_flight.fetch_sub(1, Ordering::AcqRel);
    }
}

/// A response body that keeps its request in flight until it is done.
#[derive(Debug)]
pub struct Tracked<B> {
    inner: B,
    _request: InFlight,
}

impl<B> Tracked<B> {
    pub fn new(inner: B, request: InFlight) -> Tracked<B> {
        Tracked {
            inner,
            _request: request,
        }
    }
}

impl<B: Body + Unpin> Body for Tracked<B> {
    type Data = B::Data;
    type Error = B::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        Pin::new(&mut self.inner).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// Runs `conn`, the connection from `peer`, in a task of its own until it
/// ends or has had no request for `limit`, whichever comes first (then its
/// task is aborted, which drops it and closes the connection).
///
/// The timer lives in a second task rather than beside `conn` in one `select!`:
/// there it would be polled each time the connection's task wakes, a few
/// times a request.
pub fn spawn<F, E>(conn: F, idle: Arc<Idle>, limit: Duration, peer: SocketAddr)
where
    F: Future<Output = Result<(), E>> + Send + 'static,
    E: Display,
{
    let conn_task = {
        let idle = idle.clone();
        tokio::spawn(async move {
            let out = conn.await;
            if let Some(watchdog) = idle.watchdog.get() {
                watchdog.abort();
            }
            if let Err(e) = out {
                tracing::debug!(peer = %peer, error = %e, "connection ended with an error");
            }
        })
    };
    let conn_abort = conn_task.abort_handle();
    let _ = idle.conn.set(conn_abort.clone());
    let watchdog = tokio::spawn({
        let idle = idle.clone();
        async move {
            idle.expired(limit).await;
            if !conn_abort.is_finished() {
                conn_abort.abort();
                tracing::debug!(peer = %peer, "closed a connection without a request for server.header_timeout");
            }
        }
    });
    // Were the connection over already, the watchdog ends at its next look.
    let _ = idle.watchdog.set(watchdog.abort_handle());
}
