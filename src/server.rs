//! The listener: accepts connections (at most `server.max_connections` at
//! once), serves HTTP/1.1 and HTTP/2 (prior knowledge, or ALPN over TLS) on
//! the same port, and drains gracefully on shutdown. Each connection is one
//! task, kept small for its life (see `plain`).

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use http::{Request, Response};
use http_body_util::Either;
use hyper::body::Body as _;
use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::io::AsyncWriteExt;
use tokio::net::{TcpListener, TcpStream};

use crate::clock::Clock;
use crate::coalesce::Coalesce;
use crate::config::{Backend, Config};
use crate::front;
use crate::front::{Client, H2_PREFACE, Park, Rewind, Served};
use crate::graceful;
use crate::http2::RecvBody;
use crate::idle::{Conn, Connections, Ended, Tracked};
use crate::limiter::{KeyCache, Limiter};
use crate::proxy::{Answer, ClientBody, Proxy, ProxyError, RequestBody};
use crate::stall::{Pumped, SendTimeout};
use crate::store::Store;
use crate::store::memory::MemoryStore;
use crate::store::redis::RedisStore;

/// Why the server could not start or run. (The cause is the error's source,
/// which `main` prints after it: naming it here too printed it twice.)
#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    #[error("store")]
    Store(#[from] crate::store::StoreError),
    #[error("server.tls")]
    Tls(#[from] crate::tls::TlsError),
    #[error("cannot listen on {addr}: {source}")]
    Listen {
        addr: String,
        source: std::io::Error,
    },
}

/// How long a client may take to finish its TLS handshake.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// A configured server, not yet running: tests reach its proxy and clock.
pub struct Server {
    listener: TcpListener,
    admin: Option<TcpListener>,
    proxy: Arc<Proxy>,
    clock: Clock,
}

impl Server {
    pub fn new(listener: TcpListener, config: Config) -> Result<Server, ServerError> {
        Server::with_clock(listener, config, Clock::system())
    }

    /// A server on `clock` (tests move it instead of sleeping).
    pub fn with_clock(
        listener: TcpListener,
        config: Config,
        clock: Clock,
    ) -> Result<Server, ServerError> {
        crate::tls::install_crypto();
        let store = match config.store.backend {
            Backend::Memory => Store::Memory(MemoryStore::new(config.store.max_keys)),
            Backend::Redis => Store::Redis(RedisStore::new(&config.store)?),
        };
        let limiter = Limiter::new(store, clock.clone(), config.store.deny_cache);
        let https = config.server.tls.is_some();
        let proxy = Arc::new(Proxy::new(config, limiter, https)?);
        Ok(Server {
            listener,
            admin: None,
            proxy,
            clock,
        })
    }

    /// Serves the admin endpoints on `listener` (instead of binding
    /// `server.admin_listen`).
    pub fn with_admin(mut self, listener: TcpListener) -> Server {
        self.admin = Some(listener);
        self
    }

    pub fn proxy(&self) -> Arc<Proxy> {
        self.proxy.clone()
    }

    /// Serves until `shutdown` completes, then stops accepting and gives
    /// requests in flight up to `server.shutdown_timeout` to finish.
    pub async fn run(self, shutdown: impl Future<Output = ()>) -> Result<(), ServerError> {
        let Server {
            listener,
            admin,
            proxy,
            clock,
        } = self;
        let admin = match (admin, proxy.state().config.server.admin_listen) {
            (Some(l), _) => Some(l),
            (None, Some(addr)) => {
                Some(
                    TcpListener::bind(addr)
                        .await
                        .map_err(|source| ServerError::Listen {
                            addr: addr.to_string(),
                            source,
                        })?,
                )
            }
            (None, None) => None,
        };
        let admin = admin.map(|l| tokio::spawn(crate::admin::serve(l, proxy.clone())));
        let sweeper = tokio::spawn(sweep(proxy.clone(), clock));
        let plan_sync = tokio::spawn(sync_plans(proxy.clone()));
        let renewer = tokio::spawn(renew_leases(proxy.clone()));
        // Load the scripts before serving (each load is bounded by
        // store.timeout; if Redis is down, requests load them on demand).
        if let Store::Redis(r) = proxy.limiter().store() {
            r.preload().await;
        }
        // One place per client connection: past `max_connections` nothing is
        // accepted, and new connections wait in the listen backlog (as
        // nginx's `worker_connections`).
        let max_connections = proxy.state().config.server.max_connections;
        // Every client connection, closed once idle for header_timeout.
        let conns = Connections::new(max_connections);
        let idle_sweeper = tokio::spawn(sweep_idle(conns.clone(), proxy.clone()));
        // The builders follow the config: a reload's `max_streams` serves the
        // connections accepted after it.
        let mut built_for = proxy.state();
        let mut protocols = Arc::new(Protocols::new(&built_for.config));
        conns.on_resume(resume(protocols.clone()));
        // TLS or not is fixed at start; the certificate is the current
        // config's (the start's if a reload turned TLS off).
        let boot_tls = proxy.state().tls.clone();
        let mut refused = AcceptErrors::default();
        tokio::pin!(shutdown);
        loop {
            tokio::select! {
                () = conns.admit() => {}
                _ = &mut shutdown => break,
            };
            tokio::select! {
                accepted = listener.accept() => {
                    let (stream, peer) = match accepted {
                        Ok(conn) => conn,
                        Err(e) => {
                            conns.release();
                            refused.failed(&e).await;
                            continue;
                        }
                    };
                    let state = proxy.state();
                    if !Arc::ptr_eq(&state, &built_for) {
                        protocols = Arc::new(Protocols::new(&state.config));
                        conns.on_resume(resume(protocols.clone()));
                        built_for = state;
                    }
                    let _ = stream.set_nodelay(true);
                    let server = &built_for.config.server;
                    let client = Client::new(proxy.clone(), peer, server.client_send_timeout);
                    let conn = Conn::new(server.header_timeout, client, Arc::downgrade(&conns));
                    let servers = Servers { protocols: protocols.clone(), conns: conns.clone() };
                    match &boot_tls {
                        None => conns.spawn(conn, |ended| plain(stream, servers, ended, false)),
                        Some(boot) => {
                            let acceptor = proxy.state().tls.clone().unwrap_or_else(|| boot.clone());
                            // The handshake runs in the connection's own task, so a
                            // slow client cannot hold up accepting.
                            conns.spawn(conn, |ended| tls(stream, acceptor, servers, ended));
                        }
                    }
                }
                _ = &mut shutdown => {
                    conns.release();
                    break;
                }
            }
        }
        drop(listener);
        let timeout = proxy.state().config.server.shutdown_timeout;
        tracing::info!("shutting down: draining requests in flight");
        conns.stop();
        // Each connection holds its place to its end.
        if tokio::time::timeout(timeout, conns.all_ended(max_connections))
            .await
            .is_err()
        {
            tracing::warn!("shutdown timeout reached; closing remaining connections");
        }
        idle_sweeper.abort();
        sweeper.abort();
        plan_sync.abort();
        renewer.abort();
        if let Some(admin) = admin {
            admin.abort();
        }
        Ok(())
    }
}

/// The servers a connection is handed off to, which serve it to its end:
/// hyper's HTTP/1 and sluice's own HTTP/2.
struct Servers {
    protocols: Arc<Protocols>,
    conns: Arc<Connections>,
}

impl Servers {
    /// Serves `io`, the client connection of `conn`, speaking `proto`:
    /// HTTP/1.1 by hyper, HTTP/2 by sluice's own server ([`crate::http2`]),
    /// until it ends or is shut down (see [`Protocols::serve`]).
    fn serve<I>(self, io: I, proto: Proto, conn: Arc<Conn>) -> Serving
    where
        I: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
    {
        conn.hand_off();
        let signal = self.conns.signal();
        // The limiter's cache of the last request's identities (see
        // `front::Client`), for the connection's life.
        let keys = Arc::new(KeyCache::default());
        if let Proto::Http2 = proto {
            let settings = self.protocols.http2;
            let service = move |req: Request<RecvBody>| {
                let req = req.map(|b| RequestBody::Stream(ClientBody::Right(b)));
                // Boxed, made in its box: the proxy's phases make it
                // kilobytes, and the connection keeps it until answered.
                let (conn, keys) = (conn.clone(), keys.clone());
                in_place(move || respond(conn, keys, req))
            };
            let http2 = Box::pin(crate::http2::Connection::new(io, settings, service));
            return Box::pin(async move {
                graceful::watch(http2, signal, |c| c.get_mut().graceful_shutdown())
                    .await
                    .map_err(BoxError::from)
            });
        }
        let service = service_fn(move |req: Request<Incoming>| {
            let req = req.map(|b| RequestBody::Stream(ClientBody::Left(b)));
            let (conn, keys) = (conn.clone(), keys.clone());
            // Boxed, made in its box: hyper moves the future again.
            let serving = in_place(move || respond(conn, keys, req));
            async move { Ok::<_, Infallible>(serving.await) }
        });
        self.protocols.serve(TokioIo::new(io), service, signal)
    }
}

/// The body of a response served by hyper's or the own HTTP/2 server.
type ResponseBody = Tracked<Either<crate::proxy::Body, Pumped>>;

/// Answers `req`, a request of `conn` (served by hyper's HTTP/1.1 or the
/// own HTTP/2 server). The request begins inside the future: begun out
/// here, it made hyper copy the request's future once more. (An `async`
/// block, not an `async fn`, whose arguments would be kept twice, see
/// `plain`.)
#[allow(clippy::manual_async_fn)]
fn respond(
    conn: Arc<Conn>,
    keys: Arc<KeyCache>,
    mut req: Request<RequestBody>,
) -> impl Future<Output = Response<ResponseBody>> + Send {
    async move {
        let request = conn.begin();
        let client = &conn.client;
        // Several requests at once (HTTP/2): each its own timer.
        let mut answer = None;
        client
            .proxy
            .handle(&mut req, None, client.peer(), &keys, None, &mut answer)
            .await;
        // `handle` always answers; a 500 should it ever not.
        let resp = answer.map_or_else(|| ProxyError::Unanswered.response(), Answer::into_response);
        // An HTTP/2 stream without window is never written to: its
        // body is watched apart.
        let h2 = req.version() == http::Version::HTTP_2;
        // A body sluice answered without reading (a 404, a 429, a
        // `respond` route) is read first, a little (see `drain`).
        if h2 && !req.body().is_end_stream() {
            drain(req.body_mut()).await;
        }
        let send_timeout = client.send_timeout();
        let resp = resp.map(|body| match body {
            Either::Left(upstream) if h2 && !upstream.is_end_stream() => {
                let conn = conn.clone();
                let ahead = crate::stall::READ_AHEAD;
                Either::Right(Pumped::new(upstream, ahead, send_timeout, move || {
                    conn.close()
                }))
            }
            body => Either::Left(body),
        });
        resp.map(|body| Tracked::new(body, request))
    }
}

/// A box of what `make` makes, made in the box: `make` writes only its
/// captures there. A future made by the caller and moved in is copied
/// whole, all its 3.4 KB for an HTTP/2 stream's (docs/performance.md,
/// "HTTP/2 alone"). Not inlined, so that the compiler hands `make` the
/// box's memory for its result.
#[inline(never)]
fn in_place<F>(make: impl FnOnce() -> F) -> Pin<Box<F>> {
    let b = Box::new_uninit();
    Box::into_pin(Box::write(b, make()))
}

/// A connection served by hyper's HTTP/1 or the own HTTP/2 server.
type Serving = Pin<Box<dyn Future<Output = Result<(), BoxError>> + Send>>;

/// A client connection on plain TCP: HTTP/1 served by sluice's own server
/// (see [`front`]) until a request it hands to hyper's, HTTP/2 by the own
/// HTTP/2 server ([`crate::http2`]).
/// The own server's connection is parked when it waits for a client that
/// is not busy: its task ends, and a task runs this again, `resumed`, once
/// the client sends (see [`crate::idle::Ended::park`]). The task's future
/// is kept small: everything larger is boxed while it is used. (An `async`
/// block, not an `async fn`, whose arguments would be kept twice.)
#[allow(clippy::manual_async_fn)]
fn plain(
    mut stream: TcpStream,
    servers: Servers,
    ended: Ended,
    resumed: bool,
) -> impl Future<Output = ()> + Send {
    async move {
        // A parked connection has served HTTP/1 already.
        let park = if resumed { Park::Resumed } else { Park::New };
        // The own server reads first, whatever the client speaks: an
        // HTTP/2 client's preface is handed on with the rest (see `handoff`).
        let rest = match front::serve(&mut stream, ended.conn(), park).await {
            Ok(Served::Closed) => return,
            Ok(Served::Idle) => return ended.park(stream),
            Ok(Served::Handoff(rest)) => rest,
            Err(e) => return log_error(&ended, e.into()),
        };
        let conn = ended.conn().clone();
        let proto = handoff(&rest);
        let io = Coalesce(Rewind::new(stream, rest));
        let io = SendTimeout::new(io, conn.client.send_timeout());
        if let Err(e) = servers.serve(io, proto, conn).await {
            log_error(&ended, e);
        }
    }
}

/// Notes why a client connection ended with an error (at debug level: most
/// are the client's doing).
fn log_error(ended: &Ended, e: BoxError) {
    let peer = ended.conn().client.peer();
    tracing::debug!(peer = %peer, error = %e, "connection ended with an error");
}

/// Who serves a connection the own server hands on, its unused bytes
/// `rest` in front: the own HTTP/2 server when they are the HTTP/2 preface
/// (prior knowledge, RFC 9113 3.3), else hyper's HTTP/1 server (the own
/// HTTP/1.1 server hands on a whole request head).
fn handoff(rest: &[u8]) -> Proto {
    if rest.starts_with(H2_PREFACE) {
        Proto::Http2
    } else {
        Proto::Http1
    }
}

/// A client connection over TLS: the handshake, then HTTP/2 by hyper's
/// server if ALPN chose it, else HTTP/1.1 by sluice's own (see [`plain`]),
/// which hands hyper what it does not serve. Each part is boxed while it
/// runs, the handshake's included: the TLS session is large, and a future
/// holds room for the largest of its parts for its whole life.
fn tls(
    stream: TcpStream,
    acceptor: tokio_rustls::TlsAcceptor,
    servers: Servers,
    ended: Ended,
) -> impl Future<Output = ()> + Send {
    Box::pin(async move {
        let conn = ended.conn();
        let handshake = Box::pin(async {
            let accepted = tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(stream)).await;
            match accepted {
                Ok(Ok(stream)) => Some(stream),
                Ok(Err(e)) => {
                    tracing::debug!(peer = %conn.client.peer(), error = %e, "TLS handshake failed");
                    None
                }
                Err(_) => None,
            }
        });
        // The session is moved into the part that serves it before that is
        // awaited: held here across the wait, it would take its room twice.
        let serving = match handshake.await {
            Some(stream) => serve_tls(stream, conn, servers),
            None => return,
        };
        let served = serving.await;
        if let Err(e) = served {
            tracing::debug!(peer = %conn.client.peer(), error = %e, "connection ended with an error");
        }
    })
}

/// What ALPN chose is spoken from the first byte: a client that chose h2 and
/// sends no valid preface gets HTTP/2's GOAWAY, not an HTTP/1 400. Without
/// ALPN, an HTTP/2 client's preface is handed on by the own HTTP/1.1
/// server to the HTTP/2 one (see [`handoff`]).
fn serve_tls<'a>(
    stream: tokio_rustls::server::TlsStream<TcpStream>,
    conn: &'a Arc<Conn>,
    servers: Servers,
) -> Pin<Box<dyn Future<Output = Result<(), BoxError>> + Send + 'a>> {
    match stream.get_ref().1.alpn_protocol() {
        Some(b"h2") => {
            let io = SendTimeout::new(stream, conn.client.send_timeout());
            servers.serve(io, Proto::Http2, conn.clone())
        }
        _ => Box::pin(tls_http1(stream, conn, servers)),
    }
}

/// HTTP/1.1 over TLS by sluice's own server, handed to hyper's at the first
/// request it does not serve (see [`handoff`]). (An `async` block: see
/// [`plain`].)
#[allow(clippy::manual_async_fn)]
fn tls_http1(
    mut stream: tokio_rustls::server::TlsStream<TcpStream>,
    conn: &Arc<Conn>,
    servers: Servers,
) -> impl Future<Output = Result<(), BoxError>> + Send + '_ {
    async move {
        let send_timeout = conn.client.send_timeout();
        // Settled before hyper's part is awaited (see `plain`).
        // Not parked: the TLS session stays with the connection anyway.
        let rest = match front::serve(&mut stream, conn, Park::Never).await {
            Ok(Served::Idle | Served::Closed) => {
                // TLS's close_notify, as hyper's server sends: the client
                // knows the connection ended as meant.
                let _ = tokio::time::timeout(send_timeout, stream.shutdown()).await;
                return Ok(());
            }
            Ok(Served::Handoff(rest)) => rest,
            Err(e) => return Err(e.into()),
        };
        // Only a client that chose no protocol by ALPN may speak HTTP/2 here.
        let proto = match stream.get_ref().1.alpn_protocol() {
            None => handoff(&rest),
            Some(_) => Proto::Http1,
        };
        let io = SendTimeout::new(Rewind::new(stream, rest), send_timeout);
        servers.serve(io, proto, conn.clone()).await
    }
}

/// How a parked plain connection is served again, by hyper's builders
/// `protocols` should it hand a request on.
fn resume(protocols: Arc<Protocols>) -> crate::idle::Resume {
    // The socket's waker may run where no runtime is current (at the
    // runtime's end).
    let runtime = tokio::runtime::Handle::current();
    Arc::new(move |stream, ended, conns| {
        let servers = Servers {
            protocols: protocols.clone(),
            conns,
        };
        runtime.spawn(plain(stream, servers, ended, true))
    })
}

/// Closes connections idle for `server.header_timeout`, a tick at a time.
async fn sweep_idle(conns: Arc<Connections>, proxy: Arc<Proxy>) {
    loop {
        let limit = proxy.state().config.server.header_timeout;
        tokio::time::sleep(crate::idle::tick(limit)).await;
        conns.sweep();
    }
}

/// Runs sluice on `listener` with `config` until `shutdown` completes.
pub async fn run(
    listener: TcpListener,
    config: Config,
    shutdown: impl Future<Output = ()>,
) -> Result<(), ServerError> {
    Server::new(listener, config)?.run(shutdown).await
}

/// Reads and drops what is left of an HTTP/2 request body sluice answered
/// without reading, at most [`DRAIN_BYTES`] within [`DRAIN_TIME`], before
/// the answer goes: answered first, the stream would be closed on sluice's
/// side while the client still sends on it, and what HTTP/2 says of the
/// rest (a malformed body's PROTOCOL_ERROR, a window overflow's
/// FLOW_CONTROL_ERROR) would be lost. A body that goes on longer is reset.
async fn drain(body: &mut RequestBody) {
    use http_body_util::BodyExt;
    let mut left = DRAIN_BYTES;
    let _ = tokio::time::timeout(DRAIN_TIME, async {
        while let Some(Ok(frame)) = body.frame().await {
            let size = frame.data_ref().map_or(0, |d| d.len());
            match left.checked_sub(size) {
                Some(rest) => left = rest,
                None => return,
            }
        }
    })
    .await;
}

const DRAIN_BYTES: usize = 64 * 1024;
const DRAIN_TIME: Duration = Duration::from_secs(1);

/// How a connection is served.
#[derive(Clone, Copy)]
enum Proto {
    Http1,
    /// HTTP/2 from the first byte: ALPN chose h2, or the client opened
    /// with the preface (see [`handoff`]).
    Http2,
}

/// How connections are served: hyper's HTTP/1 builder, the own HTTP/2
/// server's settings.
struct Protocols {
    http1: http1::Builder,
    http2: crate::http2::Settings,
}

impl Protocols {
    fn new(config: &Config) -> Protocols {
        // Our own check answers 431 with a problem+json body; hyper's buffer
        // only needs room for a head of that size, plus slack for the request line.
        let max = config.server.max_header_bytes;
        let max_buf = (max + 16 * 1024).max(8192);
        let mut http1 = http1::Builder::new();
        http1
            .timer(TokioTimer::new())
            // server.header_timeout is kept by crate::idle, without a timer per request.
            .header_read_timeout(None::<Duration>)
            .max_buf_size(max_buf);
        let http2 = crate::http2::Settings {
            max_streams: config.server.max_streams,
            max_header_list: max,
        };
        Protocols { http1, http2 }
    }

    /// Serves one HTTP/1 client connection by hyper until it ends, or until
    /// `signal` and its requests in flight are done. hyper's connection,
    /// with `io`, is made here and boxed, so that it is kept once: moved
    /// into a future, and from it into another, each kept a copy.
    fn serve<I, S, B>(&self, io: I, service: S, signal: tokio::sync::watch::Receiver<()>) -> Serving
    where
        I: hyper::rt::Read + hyper::rt::Write + Unpin + Send + 'static,
        S: hyper::service::Service<Request<Incoming>, Response = Response<B>> + Send + 'static,
        S::Future: Send + 'static,
        S::Error: Into<BoxError>,
        B: hyper::body::Body + Send + 'static,
        B::Data: Send,
        B::Error: Into<BoxError>,
    {
        let conn = Box::pin(self.http1.serve_connection(io, service).with_upgrades());
        Box::pin(async move {
            graceful::watch(conn, signal, |c| c.graceful_shutdown())
                .await
                .map_err(BoxError::from)
        })
    }
}

/// Accept failures, logged without flooding the log: a process out of file
/// descriptors fails every accept until one is closed.
#[derive(Default)]
struct AcceptErrors {
    /// When the last one was logged, and how many since.
    logged: Option<std::time::Instant>,
    since: u64,
}

impl AcceptErrors {
    /// Notes `e`, logs at most one line a second, and waits when waiting
    /// helps: out of descriptors or memory, the connection stays in the
    /// backlog and the next accept would fail at once (a busy loop). Other
    /// errors concern one connection, which the kernel has already dropped.
    async fn failed(&mut self, e: &std::io::Error) {
        self.since += 1;
        let now = std::time::Instant::now();
        if self
            .logged
            .is_none_or(|t| now.duration_since(t) >= Duration::from_secs(1))
        {
            tracing::warn!(error = %e, failures = self.since, "accept failed; new connections wait in the backlog");
            self.logged = Some(now);
            self.since = 0;
        }
        let exhausted = matches!(
            e.raw_os_error(),
            Some(libc::EMFILE | libc::ENFILE | libc::ENOBUFS | libc::ENOMEM)
        );
        if exhausted {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

/// A listener on `addr` with a listen backlog of `backlog` connections
/// (`server.listen_backlog`; the kernel caps it at `net.core.somaxconn`).
/// tokio's own `bind` asks for 128, which a burst of connections overflows.
///
/// On Linux the kernel hands a connection over once its client has sent
/// something, or after about `defer` (`TCP_DEFER_ACCEPT`, nginx's `listen ...
/// deferred`): in every protocol sluice speaks the client speaks first, so
/// a new connection's first read finds its request (tokio reads an accepted
/// socket at once, and got `EAGAIN` from a client that connects, then
/// sends), and one that sends nothing takes no task meanwhile.
pub fn listen(
    addr: std::net::SocketAddr,
    backlog: u32,
    defer: Duration,
) -> std::io::Result<TcpListener> {
    use socket2::{Domain, Socket, Type};
    let socket = Socket::new(Domain::for_address(addr), Type::STREAM, None)?;
    socket.set_reuse_address(true)?;
    socket.set_nonblocking(true)?;
    socket.bind(&addr.into())?;
    defer_accept(&socket, defer);
    socket.listen(backlog.min(i32::MAX as u32) as i32)?;
    TcpListener::from_std(socket.into())
}

/// See [`listen`]. Best effort: a kernel that refuses it hands connections
/// over at once, as before.
#[cfg(target_os = "linux")]
fn defer_accept(socket: &socket2::Socket, defer: Duration) {
    use std::os::fd::AsRawFd;
    let secs = libc::c_int::try_from(defer.as_secs().max(1)).unwrap_or(libc::c_int::MAX);
    // SAFETY: `socket` is an open socket, and the option's value is the
    // c_int whose size is passed.
    let _ = unsafe {
        libc::setsockopt(
            socket.as_raw_fd(),
            libc::IPPROTO_TCP,
            libc::TCP_DEFER_ACCEPT,
            (&secs as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
}

#[cfg(not(target_os = "linux"))]
fn defer_accept(_socket: &socket2::Socket, _defer: Duration) {}

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Keeps this instance's plan assignments in step with the store's (Redis:
/// see [`crate::plans`]); the first round reads them all.
async fn sync_plans(proxy: Arc<Proxy>) {
    if !matches!(proxy.limiter().store(), Store::Redis(_)) {
        return;
    }
    let mut tick = tokio::time::interval(crate::plans::POLL);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut reloaded = tokio::time::Instant::now();
    loop {
        tick.tick().await;
        let reload = reloaded.elapsed() >= crate::plans::RELOAD;
        if reload {
            reloaded = tokio::time::Instant::now();
        }
        let state = proxy.state();
        proxy
            .limiter()
            .sync_plans(&state.config.policies, reload)
            .await;
    }
}

/// Renews the `concurrency` slots of long requests (see
/// [`crate::limiter::Limiter::renew_leases`]).
async fn renew_leases(proxy: Arc<Proxy>) {
    let mut tick = tokio::time::interval(crate::limiter::RENEW_EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        if !proxy.limiter().leases().is_empty() {
            proxy.limiter().renew_leases().await;
        }
    }
}

/// Drops the memory store's expired counters now and then.
async fn sweep(proxy: Arc<Proxy>, clock: Clock) {
    let mut tick = tokio::time::interval(Duration::from_secs(5));
    loop {
        tick.tick().await;
        if let Store::Memory(m) = proxy.limiter().store() {
            m.sweep(clock.now_ms());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The size of what `serve` returns, by its type alone.
    fn future_size<F: Future>(_serve: fn(TcpStream, Servers, Ended, bool) -> F) -> usize {
        std::mem::size_of::<F>()
    }

    /// A connection is handed over once its client has sent (Linux): one
    /// that connected first and sends nothing is not the first accepted.
    #[cfg(target_os = "linux")]
    #[tokio::test]
    async fn a_connection_is_accepted_once_its_client_sends() {
        use tokio::io::AsyncReadExt;
        let addr = "127.0.0.1:0".parse().unwrap();
        let listener = listen(addr, 16, Duration::from_secs(30)).unwrap();
        let addr = listener.local_addr().unwrap();
        let silent = TcpStream::connect(addr).await.unwrap();
        let mut talking = TcpStream::connect(addr).await.unwrap();
        talking.write_all(b"GET / HTTP/1.1\r\n\r\n").await.unwrap();
        let (mut accepted, peer) = listener.accept().await.unwrap();
        assert_eq!(peer, talking.local_addr().unwrap());
        let mut first = [0u8; 3];
        accepted.read_exact(&mut first).await.unwrap();
        assert_eq!(&first, b"GET");
        drop(silent);
    }

    /// A plain connection's task holds this future while its client is
    /// busy (a parked connection has no task): the request's work and
    /// hyper's connection are boxed apart, so it stays small.
    #[test]
    fn a_plain_connections_task_stays_small() {
        let size = future_size(plain);
        assert!(size <= 152, "{size} bytes");
    }
}
