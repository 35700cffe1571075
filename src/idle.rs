//! The server's client connections: closing those that have no request
//! going, and closing or telling them all at shutdown.
//!
//! A connection with no request in flight is closed once no request head has
//! arrived for `server.header_timeout`: that ends idle keep-alive connections
//! and clients that send a head too slowly (or never finish it). hyper can do
//! this itself (`header_read_timeout`, HTTP/1 only), but it makes and drops a
//! timer for every request. Here a connection counts its requests in flight
//! and notes when the last one ended, and the server's [`Connections`] looks
//! at every connection once a tick ([`tick`]: a quarter second at most) and closes
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
//! flight is told to close after it (see [`Conn::stopping`]); connections
//! handed off to hyper's HTTP/1 or the own HTTP/2 server get the shutdown
//! signal (see `crate::graceful`).
//!
//! A connection of the own HTTP/1.1 server on plain TCP that waits for its
//! next request may be parked ([`Ended::park`]): its task ends, and its
//! socket waits in its [`Conn`], with the `Conn` itself as the waker of the
//! socket's registration. Once the client sends (or closes), the `Conn`
//! wakes and a task is spawned for it again ([`Connections::resume`]). So
//! such a connection holds no task while it idles; the sweep and
//! [`Connections::stop`] close parked connections as they close waiting
//! ones.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::task::{Context, Poll, Wake, Waker};
use std::time::Duration;

use hyper::body::{Body, Frame, SizeHint};
use tokio::net::TcpStream;
use tokio::sync::{Semaphore, watch};
use tokio::task::{AbortHandle, JoinHandle};

use crate::front::Client;

/// Milliseconds on a monotonic clock, to the kernel's tick: the timeout is
/// in seconds, and this is read at the end of every request.
fn now_ms() -> u64 {
    crate::clock::coarse_ms()
}

// `Conn::state`: the requests in flight in the low bits, and these flags.
/// Handed off to hyper's HTTP/1 or the own HTTP/2 server, which is told of a
/// shutdown by the signal.
const HANDED_OFF: u64 = 1 << 60;
/// Shutting down: close after the requests in flight.
const STOPPING: u64 = 1 << 61;
/// Being closed: begin no request.
const CLOSING: u64 = 1 << 62;
/// Its task has ended.
const DONE: u64 = 1 << 63;
/// Asked by the sweep to park: its task waits for a client that has sent
/// nothing for a while (see [`Conn::asked_to_park`]).
const PARK: u64 = 1 << 59;
/// Its task may park it (sluice's own HTTP/1.1 server on plain TCP).
const PARKABLE: u64 = 1 << 58;
const COUNT: u64 = PARKABLE - 1;

/// One client connection: its requests in flight, when it last had one,
/// its task (or its socket, parked), and what its requests share
/// (`client`), in one allocation: what a parked connection costs besides
/// its socket's registration.
pub struct Conn<T = Client> {
    /// Requests in flight, and the flags above.
    state: AtomicU64,
    /// When the connection was accepted or its last request ended.
    since_ms: AtomicU64,
    /// `server.header_timeout` when it was accepted.
    limit_ms: u64,
    /// The connection's task, to close it, or its parked socket.
    slot: Mutex<Slot>,
    /// Its server, to be served again once parked (see [`Conn::wake`]).
    server: Weak<Connections>,
    pub client: T,
}

/// What runs a connection (see [`Conn::slot`]).
enum Slot {
    /// Not begun, or ended.
    Empty,
    /// A task is being spawned for it: the spawn's number (see
    /// [`Connections::started`]).
    Starting(u32),
    Task(AbortHandle),
    /// Its task waits for the client's next request and may park: the
    /// sweep wakes it to, once the client has been quiet for a while.
    Waiting(AbortHandle, Waker),
    /// No task: its socket waits for the client's next bytes.
    Parked(TcpStream),
}

impl<T> Conn<T> {
    /// A connection of `server`, closed after `limit`
    /// (`server.header_timeout`) without a request.
    pub fn new(limit: Duration, client: T, server: Weak<Connections>) -> Arc<Conn<T>> {
        Arc::new(Conn {
            state: AtomicU64::new(0),
            since_ms: AtomicU64::new(now_ms()),
            limit_ms: u64::try_from(limit.as_millis()).unwrap_or(u64::MAX),
            slot: Mutex::new(Slot::Empty),
            server,
            client,
        })
    }

    fn slot(&self) -> MutexGuard<'_, Slot> {
        // A poisoned lock only means a panic elsewhere; the slot is whole.
        self.slot.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Milliseconds since the connection's last request ended (or since it
    /// was accepted).
    pub fn idle_ms(&self) -> u64 {
        now_ms().saturating_sub(self.since_ms.load(Ordering::Acquire))
    }

    /// For a task of the own server waiting for its client's next request:
    /// whether the sweep asked it to park (its client has been quiet for
    /// [`crate::front::BUSY_MS`]); if not, `waker` is kept for the sweep to
    /// ask (see [`Connections::sweep`]). A client that sent a burst of
    /// requests and then went quiet is so parked as one that sent one.
    pub fn asked_to_park(&self, waker: &Waker) -> bool {
        let state = self.state.fetch_and(!PARK, Ordering::AcqRel);
        if state & PARK != 0 {
            return true;
        }
        if state & PARKABLE == 0 {
            return false;
        }
        let mut slot = self.slot();
        match &mut *slot {
            Slot::Waiting(_, kept) => {
                if !kept.will_wake(waker) {
                    *kept = waker.clone();
                }
            }
            Slot::Task(_) => {
                if let Slot::Task(task) = std::mem::replace(&mut *slot, Slot::Empty) {
                    *slot = Slot::Waiting(task, waker.clone());
                }
            }
            // Its handle is not kept yet: the next wait will be.
            Slot::Empty | Slot::Starting(_) | Slot::Parked(_) => {}
        }
        false
    }

    /// The connection's task may park it (see [`Ended::park`]): said by
    /// [`crate::front::serve`], from its `park`.
    pub fn may_park(&self) {
        self.state.fetch_or(PARKABLE, Ordering::AcqRel);
    }

    /// The sweep's part: wakes a task waiting for a client quiet for `idle_ms`
    /// to park (see [`Conn::asked_to_park`]).
    fn park_if_quiet(&self, idle_ms: u64) {
        if idle_ms < crate::front::BUSY_MS {
            return;
        }
        let mut slot = self.slot();
        if !matches!(*slot, Slot::Waiting(..))
            || self.state.load(Ordering::Acquire) & (COUNT | HANDED_OFF | CLOSING | STOPPING | DONE)
                != 0
        {
            return;
        }
        if let Slot::Waiting(task, waker) = std::mem::replace(&mut *slot, Slot::Empty) {
            *slot = Slot::Task(task);
            self.state.fetch_or(PARK, Ordering::AcqRel);
            drop(slot);
            waker.wake();
        }
    }

    /// Closes the connection now, its requests in flight included (a
    /// client that stopped reading, see [`crate::stall`]); a parked one is
    /// closed here, its place under `server.max_connections` freed.
    pub fn close(&self) {
        let mut slot = self.slot();
        match &*slot {
            Slot::Task(task) | Slot::Waiting(task, _) => task.abort(),
            Slot::Parked(_) => {
                self.state.fetch_or(DONE, Ordering::AcqRel);
                let parked = std::mem::replace(&mut *slot, Slot::Empty);
                drop(slot);
                drop(parked);
                if let Some(server) = self.server.upgrade() {
                    server.release();
                }
            }
            Slot::Empty | Slot::Starting(_) => {}
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

    /// The connection is served by hyper's HTTP/1 or the own HTTP/2 server
    /// from now on: at shutdown it is told by the signal, not closed (HTTP/2
    /// then sends GOAWAY).
    pub fn hand_off(&self) {
        self.state.fetch_or(HANDED_OFF, Ordering::AcqRel);
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

/// A parked connection's socket wakes its `Conn`: the client sent (or
/// closed), and a task serves it again.
impl Wake for Conn<Client> {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        // A server that has ended closed its parked connections.
        if let Some(server) = self.server.upgrade() {
            server.resume(self);
        }
    }
}

impl Conn<Client> {
    /// Waits for the parked socket's next bytes with this `Conn` as the
    /// waker; serves them at once if they are there already.
    fn listen(self: &Arc<Self>) {
        let waker = Waker::from(self.clone());
        let mut cx = Context::from_waker(&waker);
        let ready = match &*self.slot() {
            // An error (the runtime's end) is the task's to meet.
            Slot::Parked(stream) => stream.poll_read_ready(&mut cx).is_ready(),
            _ => false,
        };
        if ready {
            self.wake_by_ref();
        }
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
/// an eighth of it, between 10 ms and a quarter second (the sweep also
/// parks the connections of clients gone quiet, see
/// [`crate::front::BUSY_MS`]).
pub fn tick(limit: Duration) -> Duration {
    (limit / 8).clamp(Duration::from_millis(10), Duration::from_millis(250))
}

/// Spawns the task that serves a parked connection again (see
/// [`Connections::on_resume`]).
pub type Resume = Arc<dyn Fn(TcpStream, Ended, Arc<Connections>) -> JoinHandle<()> + Send + Sync>;

/// Every client connection of a server, each with its task or parked.
pub struct Connections {
    list: Mutex<Vec<Arc<Conn>>>,
    stopping: AtomicBool,
    /// For connections handed off to hyper's HTTP/1 or the own HTTP/2 server
    /// (see `crate::graceful::watch`).
    signal: watch::Sender<()>,
    /// One per connection (`server.max_connections`), taken when it is
    /// accepted and given back when it ends: held by no task, as a parked
    /// connection has none.
    permits: Arc<Semaphore>,
    /// Numbers the spawns (see [`Connections::started`]).
    spawns: AtomicU32,
    resume: Mutex<Option<Resume>>,
}

impl Connections {
    /// The connections of a server that takes at most `max` at once.
    pub fn new(max: usize) -> Arc<Connections> {
        Arc::new(Connections {
            list: Mutex::new(Vec::new()),
            stopping: AtomicBool::new(false),
            signal: watch::channel(()).0,
            permits: Arc::new(Semaphore::new(max)),
            spawns: AtomicU32::new(0),
            resume: Mutex::new(None),
        })
    }

    fn list(&self) -> MutexGuard<'_, Vec<Arc<Conn>>> {
        self.list.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A place for one more connection: waits while `server.max_connections`
    /// are open (new ones wait in the listen backlog, as with nginx's
    /// `worker_connections`). Given back when the connection ends.
    pub async fn admit(&self) {
        if let Ok(permit) = self.permits.acquire().await {
            permit.forget();
        }
    }

    /// Gives back the place [`Connections::admit`] took: the connection has
    /// ended, or was not accepted after all.
    pub fn release(&self) {
        self.permits.add_permits(1);
    }

    /// Shutdown: waits until every connection has ended.
    pub async fn all_ended(&self, max: usize) {
        let all = u32::try_from(max).unwrap_or(u32::MAX);
        let _ = self.permits.acquire_many(all).await;
    }

    /// How a parked connection's task is spawned from now on (the server's
    /// builders change with a reload).
    pub fn on_resume(&self, resume: Resume) {
        *self.resume.lock().unwrap_or_else(|e| e.into_inner()) = Some(resume);
    }

    /// Runs the connection `serve` makes in a task of its own until it ends,
    /// parks, or is closed (its task aborted, which drops it and closes the
    /// socket). `serve` is given the connection's [`Ended`], to hold to its
    /// end: the connection's future is spawned as it is, not inside another
    /// (which would take twice its size: an awaited future is moved first).
    /// The connection has taken its place by [`Connections::admit`].
    pub fn spawn<F>(self: &Arc<Self>, conn: Arc<Conn>, serve: impl FnOnce(Ended) -> F)
    where
        F: Future<Output = ()> + Send + 'static,
    {
        let spawn = self.spawns.fetch_add(1, Ordering::Relaxed);
        *conn.slot() = Slot::Starting(spawn);
        self.list().push(conn.clone());
        let task = tokio::spawn(serve(Ended::new(conn.clone())));
        Self::started(&conn, spawn, task);
    }

    /// A parked connection's client sent (or closed): a task serves it.
    fn resume(self: &Arc<Self>, conn: &Arc<Conn>) {
        let spawn = self.spawns.fetch_add(1, Ordering::Relaxed);
        let stream = {
            let mut slot = conn.slot();
            match std::mem::replace(&mut *slot, Slot::Starting(spawn)) {
                Slot::Parked(stream) => stream,
                // Served or closed meanwhile: left as it was.
                other => {
                    *slot = other;
                    return;
                }
            }
        };
        let resume = self
            .resume
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        let ended = Ended::new(conn.clone());
        match resume {
            Some(resume) => Self::started(conn, spawn, resume(stream, ended, self.clone())),
            // Never so: the server sets it before it accepts.
            None => drop((stream, ended)),
        }
    }

    /// Keeps the handle of the task spawned as `spawn` to close it, unless
    /// the task has parked or ended meanwhile (the slot says so: the spawn's
    /// number is no longer there). A connection being closed meanwhile found
    /// no task to abort: it is aborted here.
    fn started(conn: &Conn, spawn: u32, task: JoinHandle<()>) {
        let mut slot = conn.slot();
        if matches!(*slot, Slot::Starting(s) if s == spawn) {
            *slot = Slot::Task(task.abort_handle());
            if conn.state.load(Ordering::Acquire) & CLOSING != 0 {
                task.abort();
            }
        }
    }

    /// The shutdown signal for a connection handed off from now on: it
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
            let idle = now.saturating_sub(conn.since_ms.load(Ordering::Acquire));
            if !conn.close_if_idle(|| idle >= conn.limit_ms) {
                conn.park_if_quiet(idle);
            }
            conn.state.load(Ordering::Acquire) & DONE == 0
        });
    }

    /// Shutdown: connections of sluice's own server are closed now when they
    /// have no request in flight, and otherwise told to close after it;
    /// those handed off get the signal. Wait for them to end by the
    /// connection limit's permits.
    pub fn stop(&self) {
        self.stopping.store(true, Ordering::Release);
        self.signal.send_replace(());
        for conn in self.list().iter() {
            if conn.state.load(Ordering::Acquire) & HANDED_OFF != 0 {
                continue;
            }
            conn.state.fetch_or(STOPPING, Ordering::AcqRel);
            conn.close_if_idle(|| true);
        }
    }
}

impl Drop for Connections {
    /// Parked connections are closed: each is its socket's waker, which
    /// would keep it (and the socket) for ever.
    fn drop(&mut self) {
        let list = std::mem::take(&mut *self.list());
        for conn in list {
            let parked = std::mem::replace(&mut *conn.slot(), Slot::Empty);
            drop(parked);
        }
    }
}

/// Held by a connection's task: marks its end however the task ends (an
/// abort drops it), and frees its place under `server.max_connections`;
/// unless the task parked the connection ([`Ended::park`]).
pub struct Ended {
    conn: Arc<Conn>,
    parked: bool,
}

impl Ended {
    fn new(conn: Arc<Conn>) -> Ended {
        Ended {
            conn,
            parked: false,
        }
    }

    pub fn conn(&self) -> &Arc<Conn> {
        &self.conn
    }

    /// Ends the connection's task, the connection kept: its socket waits in
    /// its [`Conn`] for the client's next bytes, and a task is spawned for
    /// them (see [`Connections::resume`]). The caller has answered every
    /// request and read nothing more. A connection being closed is closed.
    pub fn park(mut self, stream: TcpStream) {
        {
            let mut slot = self.conn.slot();
            if self.conn.state.load(Ordering::Acquire) & (CLOSING | STOPPING) != 0 {
                return;
            }
            // Its task's handle goes: it kept the task's memory.
            *slot = Slot::Parked(stream);
            self.parked = true;
        }
        self.conn.listen();
    }
}

impl Drop for Ended {
    fn drop(&mut self) {
        if self.parked {
            return;
        }
        // The handle kept the task's memory: let go now, not at the sweep.
        let mut slot = self.conn.slot();
        self.conn.state.fetch_or(DONE, Ordering::AcqRel);
        let task = std::mem::replace(&mut *slot, Slot::Empty);
        drop(slot);
        drop(task);
        if let Some(server) = self.conn.server.upgrade() {
            server.release();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A parked connection costs its `Conn` and its socket's registration:
    /// the `Conn` with its reference counts stays in 128 bytes.
    #[test]
    fn a_connection_stays_small() {
        let size = std::mem::size_of::<Conn>() + 16;
        assert!(size <= 128, "{size} bytes");
    }

    #[test]
    fn ticks_follow_the_timeout_within_bounds() {
        assert_eq!(tick(Duration::from_secs(30)), Duration::from_millis(250));
        assert_eq!(tick(Duration::from_millis(200)), Duration::from_millis(25));
        assert_eq!(tick(Duration::from_millis(1)), Duration::from_millis(10));
    }

    #[test]
    fn a_connection_closed_while_idle_serves_no_request_begun_after() {
        let idle = Conn::new(Duration::from_secs(1), (), Weak::new());
        assert!(idle.close_if_idle(|| true));
        assert!(idle.begin().is_none());
    }

    #[test]
    fn a_connection_with_a_request_in_flight_is_not_closed_as_idle() {
        let idle = Conn::new(Duration::from_secs(1), (), Weak::new());
        let request = idle.begin().expect("not closing");
        assert!(!idle.close_if_idle(|| true));
        drop(request);
        assert!(idle.close_if_idle(|| true));
    }
}
