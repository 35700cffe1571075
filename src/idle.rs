//! The server's client connections: closing those that have no request
//! going, and closing or telling them all at shutdown.
//!
//! A connection with no request in flight is closed once no request head has
//! arrived for `server.header_timeout`: that ends idle keep-alive connections
//! and clients that send a head too slowly (or never finish it). hyper can do
//! this itself (`header_read_timeout`, HTTP/1 only), but it makes and drops a
//! timer for every request. Here a connection counts its requests in flight
//! and notes when the last one ended, and the server's [`Connections`] looks
//! at every connection once a tick ([`tick`]: a second at most) and closes
//! those idle for too long. So a connection costs no timer and no second
//! task (a watchdog task per connection cost an idle connection more memory
//! than the rest of it), and the timeout is kept to within a tick.
//!
//! A request is in flight from the moment its head is parsed until its
//! response body has been sent (or dropped), so a slow upstream or a long
//! download is never cut short by this.
//!
//! At shutdown ([`Connections::stop`]) a connection of sluice's own HTTP/1.1
//! server that waits for a request is closed at once, one with a request in
//! flight is told to close after it (see [`Conn::stopping`]); hyper's
//! connections get the shutdown signal (see `crate::graceful`).

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll};
use std::time::Duration;

use hyper::body::{Body, Frame, SizeHint};
use tokio::sync::{OwnedSemaphorePermit, watch};
use tokio::task::AbortHandle;

use crate::front::Client;

/// Milliseconds on a monotonic clock, to the kernel's tick: the timeout is
/// in seconds, and this is read at the end of every request.
fn now_ms() -> u64 {
    crate::clock::coarse_ms()
}

// `Conn::state`: the requests in flight in the low bits, and these flags.
/// Served by hyper, which is told of a shutdown by the signal.
const HYPER: u64 = 1 << 60;
/// Shutting down: close after the requests in flight.
const STOPPING: u64 = 1 << 61;
/// Being closed: begin no request.
const CLOSING: u64 = 1 << 62;
/// Its task has ended.
const DONE: u64 = 1 << 63;
const COUNT: u64 = HYPER - 1;

/// One client connection: its requests in flight, when it last had one,
/// its task, and what its requests share (`client`), in one allocation.
pub struct Conn<T = Client> {
    /// Requests in flight, and the flags above.
    state: AtomicU64,
    /// When the connection was accepted or its last request ended.
    since_ms: AtomicU64,
    /// `server.header_timeout` when it was accepted.
    limit_ms: u64,
    /// The connection's task, to close it; let go when it ends.
    task: Mutex<Option<AbortHandle>>,
    pub client: T,
}

impl<T> Conn<T> {
    /// A connection closed after `limit` (`server.header_timeout`) without
    /// a request.
    pub fn new(limit: Duration, client: T) -> Arc<Conn<T>> {
        Arc::new(Conn {
            state: AtomicU64::new(0),
            since_ms: AtomicU64::new(now_ms()),
            limit_ms: u64::try_from(limit.as_millis()).unwrap_or(u64::MAX),
            task: Mutex::new(None),
            client,
        })
    }

    fn task(&self) -> MutexGuard<'_, Option<AbortHandle>> {
        // A poisoned lock only means a panic elsewhere; the handle is whole.
        self.task.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Closes the connection now, its requests in flight included (a
    /// client that stopped reading, see [`crate::stall`]).
    pub fn close(&self) {
        if let Some(task) = &*self.task() {
            task.abort();
        }
    }

    /// A request head has arrived; the request ends when the guard drops.
    /// `None` when the connection is being closed (see [`Connections::stop`]):
    /// the request is not to be served.
    pub fn begin(self: &Arc<Self>) -> Option<InFlight<T>> {
        let before = self.state.fetch_add(1, Ordering::AcqRel);
        let request = InFlight(self.clone());
        (before & CLOSING == 0).then_some(request)
    }

    /// The server is shutting down: a connection closes after its requests
    /// in flight.
    pub fn stopping(&self) -> bool {
        self.state.load(Ordering::Acquire) & STOPPING != 0
    }

    /// The connection is served by hyper from now on: at shutdown it is
    /// told by the signal, not closed (HTTP/2 then sends GOAWAY).
    pub fn to_hyper(&self) {
        self.state.fetch_or(HYPER, Ordering::AcqRel);
    }

    /// Closes the connection if no request is in flight: marked first, so a
    /// request that begins meanwhile is not served.
    fn close_if_idle(&self, expired: impl Fn() -> bool) -> bool {
        let state = self.state.load(Ordering::Acquire);
        if state & (COUNT | CLOSING | DONE) != 0 || !expired() {
            return false;
        }
        let closing = self
            .state
            .compare_exchange(state, state | CLOSING, Ordering::AcqRel, Ordering::Acquire)
            .is_ok();
        if closing {
            self.close();
        }
        closing
    }
}

/// A request in flight (see [`Conn::begin`]).
pub struct InFlight<T = Client>(Arc<Conn<T>>);

impl<T> Drop for InFlight<T> {
    fn drop(&mut self) {
        // The time first: a sweep that sees no request in flight must also
        // see when the last one ended.
        self.0.since_ms.store(now_ms(), Ordering::Release);
        self.0.state.fetch_sub(1, Ordering::AcqRel);
    }
}

/// A response body that keeps its request in flight until it is done.
pub struct Tracked<B> {
    inner: B,
    _request: Option<InFlight>,
}

impl<B> Tracked<B> {
    pub fn new(inner: B, request: Option<InFlight>) -> Tracked<B> {
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

/// How often [`Connections::sweep`] runs for a `header_timeout` of `limit`:
/// an eighth of it, between 10 ms and a second.
pub fn tick(limit: Duration) -> Duration {
    (limit / 8).clamp(Duration::from_millis(10), Duration::from_secs(1))
}

/// Every client connection of a server, each with its task.
pub struct Connections {
    list: Mutex<Vec<Arc<Conn>>>,
    stopping: AtomicBool,
    /// For hyper's connections (see `crate::graceful::watch`).
    signal: watch::Sender<()>,
}

impl Connections {
    pub fn new() -> Arc<Connections> {
        Arc::new(Connections {
            list: Mutex::new(Vec::new()),
            stopping: AtomicBool::new(false),
            signal: watch::channel(()).0,
        })
    }

    fn list(&self) -> MutexGuard<'_, Vec<Arc<Conn>>> {
        self.list.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Runs the connection `serve` makes in a task of its own until it ends
    /// or is closed (its task aborted, which drops it and closes the socket).
    /// `serve` is given the connection's [`Ended`], to hold to its end: the
    /// connection's future is spawned as it is, not inside another (which
    /// would take twice its size: an awaited future is moved first).
    pub fn spawn<F>(
        &self,
        conn: Arc<Conn>,
        permit: OwnedSemaphorePermit,
        serve: impl FnOnce(Ended) -> F,
    ) where
        F: Future<Output = ()> + Send + 'static,
    {
        let task = tokio::spawn(serve(Ended {
            conn: conn.clone(),
            _permit: permit,
        }));
        let mut handle = conn.task();
        // Were it over already, its handle is not kept.
        if conn.state.load(Ordering::Acquire) & DONE == 0 {
            *handle = Some(task.abort_handle());
        }
        drop(handle);
        self.list().push(conn);
    }

    /// The shutdown signal for a connection hyper serves from now on: it
    /// finishes its requests in flight, then closes. A shutdown already
    /// begun counts.
    pub fn signal(&self) -> watch::Receiver<()> {
        let mut signal = self.signal.subscribe();
        if self.stopping.load(Ordering::Acquire) {
            signal.mark_changed();
        }
        signal
    }

    /// Closes the connections without a request in flight for longer than
    /// their `header_timeout`, and forgets those that ended.
    pub fn sweep(&self) {
        let now = now_ms();
        self.list().retain(|conn| {
            conn.close_if_idle(|| {
                now.saturating_sub(conn.since_ms.load(Ordering::Acquire)) >= conn.limit_ms
            });
            conn.state.load(Ordering::Acquire) & DONE == 0
        });
    }

    /// Shutdown: connections of sluice's own server are closed now when they
    /// have no request in flight, and otherwise told to close after it;
    /// hyper's get the signal. Wait for them to end by the connection limit's
    /// permits.
    pub fn stop(&self) {
        self.stopping.store(true, Ordering::Release);
        self.signal.send_replace(());
        for conn in self.list().iter() {
            if conn.state.load(Ordering::Acquire) & HYPER != 0 {
                continue;
            }
            conn.state.fetch_or(STOPPING, Ordering::AcqRel);
            conn.close_if_idle(|| true);
        }
    }
}

/// Held by a connection's task: marks its end however the task ends (an
/// abort drops it), and frees its place under `server.max_connections`.
pub struct Ended {
    conn: Arc<Conn>,
    _permit: OwnedSemaphorePermit,
}

impl Ended {
    pub fn conn(&self) -> &Arc<Conn> {
        &self.conn
    }
}

impl Drop for Ended {
    fn drop(&mut self) {
        // The handle kept the task's memory: let go now, not at the sweep.
        let mut task = self.conn.task();
        self.conn.state.fetch_or(DONE, Ordering::AcqRel);
        task.take();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ticks_follow_the_timeout_within_bounds() {
        assert_eq!(tick(Duration::from_secs(30)), Duration::from_secs(1));
        assert_eq!(tick(Duration::from_millis(200)), Duration::from_millis(25));
        assert_eq!(tick(Duration::from_millis(1)), Duration::from_millis(10));
    }

    #[test]
    fn a_connection_closed_while_idle_serves_no_request_begun_after() {
        let idle = Conn::new(Duration::from_secs(1), ());
        assert!(idle.close_if_idle(|| true));
        assert!(idle.begin().is_none());
    }

    #[test]
    fn a_connection_with_a_request_in_flight_is_not_closed_as_idle() {
        let idle = Conn::new(Duration::from_secs(1), ());
        let request = idle.begin().expect("not closing");
        assert!(!idle.close_if_idle(|| true));
        drop(request);
        assert!(idle.close_if_idle(|| true));
    }
}
