//! sluice's own HTTP/1.1 server, for client connections on plain TCP and
//! over TLS (unless ALPN chose HTTP/2).
//!
//! It serves the usual request itself: HTTP/1.1 or HTTP/1.0, no body or a
//! small one framed by its `Content-Length` (read whole first, see
//! [`MAX_BODY`]), no upgrade, no `Expect`, no `TE`. A head that cannot be
//! parsed gets sluice's own `400` (problem+json, `Connection: close`). At
//! the first request it does not serve (a larger or chunked body, an
//! upgrade, `CONNECT`, more header lines than it has room for, a head larger
//! than [`MAX_HEAD`]), it hands the connection
//! to hyper's server with every byte it has read and not used ([`Rewind`]),
//! and hyper serves the rest of the connection. So everything unusual meets
//! hyper's handling, as before, and the common `GET` skips hyper's
//! dispatcher, whose request and response futures it moved about a dozen
//! times a request (measured: about a quarter of the instructions per
//! proxied `GET`, see docs/performance.md).
//!
//! What a client sees is what hyper's server does:
//!
//! - the status line is `HTTP/1.1` with the status's usual reason phrase
//!   (`HTTP/1.0` to an HTTP/1.0 client);
//! - a `Date` header is added when the response has none;
//! - the body is framed by its `Content-Length`, else by its known size,
//!   else chunked (trailers are dropped: a client that wants them says
//!   `TE: trailers`, and such a request goes to hyper);
//! - `Connection: close` from the client gets `connection: close` back, and
//!   the connection ends after the response (over TLS with close_notify);
//!   so does one at shutdown, and an HTTP/1.0 client's unless it said
//!   `Connection: keep-alive` (then answered `connection: keep-alive`, and
//!   a body of unknown length, which HTTP/1.0 cannot chunk, ends with the
//!   connection);
//! - a client that closes its connection while its request is in flight
//!   cancels the request (the upstream exchange is dropped, as with hyper);
//! - a body that fails or is longer than its `Content-Length` ends the
//!   connection, so the client sees it cut short and never a wrong message.
//!
//! A connection waiting for its next request holds nothing but its socket
//! (and its TLS session): see [`serve`].

use std::cell::RefCell;
use std::future::poll_fn;
use std::io;
use std::mem::MaybeUninit;
use std::net::{IpAddr, SocketAddr};
use std::pin::{Pin, pin};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Weak};
use std::task::{Context, Poll};
use std::time::{Duration, UNIX_EPOCH};

use bytes::{Buf, Bytes, BytesMut};
use http::{Method, Request, Response, StatusCode, Uri, Version};
use http_body_util::Either;
use hyper::body::Body as _;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::net::TcpStream;
use tokio::time::Sleep;
use tokio_rustls::server::TlsStream;

use crate::ascii::eq_lower;
use crate::fields::HeadFields;
use crate::idle::Conn;
use crate::limiter::KeyCache;
use crate::proxy::{Answer, Body, Limits, Proxy, ProxyError, RequestBody, plain_head};
use crate::stall::SendTimeout;

/// The most a request head may take here; a longer one goes to hyper, whose
/// limit is `server.max_header_bytes`.
pub const MAX_HEAD: usize = 8 * 1024;
/// The 24 bytes a client speaking HTTP/2 with prior knowledge opens with.
pub const H2_PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
/// The largest request body served here, read whole after its head (as
/// nginx's `client_body_buffer_size`); a larger one, or one framed
/// otherwise than by a `Content-Length`, goes to hyper, which streams it.
/// Less when an upstream's `buffer` is less (see `State::read_whole`).
pub const MAX_BODY: usize = 16 * 1024;
/// Header lines a head may have here; more go to hyper (its limit is 100).
const MAX_HEADERS: usize = 64;
/// Body data up to this size is copied behind the head, to go out in one
/// write; larger pieces are written as they are.
const COPY_LIMIT: usize = 16 * 1024;

/// What a connection's requests need from the server: kept in its
/// [`Conn`], for the connection's life. (The limiter's cache of the last
/// request's identities is kept by the connection's task, not here: a
/// parked connection has no use for it.)
pub struct Client {
    pub proxy: Arc<Proxy>,
    /// The client's address, as its parts: a `SocketAddr` takes 32 bytes.
    ip: IpAddr,
    port: u16,
    /// `server.client_send_timeout` (see [`crate::stall`]), in milliseconds.
    send_timeout_ms: u32,
}

impl Client {
    pub fn new(proxy: Arc<Proxy>, peer: SocketAddr, send_timeout: Duration) -> Client {
        Client {
            proxy,
            ip: peer.ip(),
            port: peer.port(),
            send_timeout_ms: u32::try_from(send_timeout.as_millis()).unwrap_or(u32::MAX),
        }
    }

    pub fn peer(&self) -> SocketAddr {
        SocketAddr::new(self.ip, self.port)
    }

    pub fn send_timeout(&self) -> Duration {
        Duration::from_millis(self.send_timeout_ms.into())
    }
}

/// A client that sends its next request within this time of its last
/// answer is busy: its connection waits for it in its task rather than
/// parking, so that a busy client's requests cost no task each.
pub const BUSY_MS: u64 = 250;

/// A client connection served here: plain TCP, or TLS over it.
pub trait Stream: AsyncRead + AsyncWrite + Unpin + Send {
    /// Ready once the client's next bytes can be read: the wait of a
    /// connection between requests, which holds nothing but its socket.
    fn poll_readable(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>>;
}

impl Stream for TcpStream {
    fn poll_readable(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        // `poll_read_ready`, not `readable()`: the same wait as a read's,
        // without a waiter list entry (about 200 instructions a request).
        self.poll_read_ready(cx)
    }
}

impl Stream for TlsStream<TcpStream> {
    fn poll_readable(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let (tcp, tls) = self.get_mut();
        // Bytes rustls has decrypted already (a request sent with the end of
        // the handshake) are there to read: the socket will not say so. An
        // error is for the read to tell.
        match tls.process_new_packets() {
            Ok(io) if io.plaintext_bytes_to_read() == 0 => tcp.poll_read_ready(cx),
            _ => Poll::Ready(Ok(())),
        }
    }
}

/// Whether [`serve`] parks its connection (see there).
#[derive(Clone, Copy)]
pub enum Park {
    /// Never (over TLS: the session stays anyway).
    Never,
    /// A new connection.
    New,
    /// A connection that was parked and whose client has sent.
    Resumed,
}

/// How serving a connection here ended.
pub enum Served {
    /// It is closed: by the client, after `Connection: close`, at shutdown,
    /// or after a response that could not be sent whole.
    Closed,
    /// Every request is answered, nothing more is read, and the client is
    /// not busy: the connection is to be parked (see
    /// [`crate::idle::Ended::park`]).
    Idle,
    /// A request for hyper: the bytes read and not used (see [`Rewind`]).
    Handoff(BytesMut),
}

/// Serves `stream` until it closes or has a request for hyper, or (unless
/// `park` says never) until it waits for a request from a client that is
/// not busy. At shutdown (see [`crate::idle::Connections::stop`]) a
/// connection waiting for a request is closed from outside, one with a
/// request in flight closes after its response.
///
/// When to park: after an exchange (the requests the client sent, answered,
/// nothing more read), unless the client is busy: the exchange began within
/// [`BUSY_MS`] of the last request's end. A new connection's first exchange
/// is not busy: a client that sends one request and idles is parked at once.
/// A busy client's connection that then goes quiet is parked by the sweep
/// (see [`Conn::asked_to_park`]).
///
/// A connection waiting for its next request holds its socket and nothing
/// else: no read buffer, no request, no timer (as nginx's keep-alive
/// connections hold no buffer). Once the client sends, the work of its
/// requests (the buffers, the request and its answer, the proxy's future)
/// is made in a box of its own (see [`while_busy`]), dropped once the
/// connection parks; so the connection's task, which lives as long as the
/// connection, stays small (figures in docs/performance.md, "Idle
/// connections").
pub async fn serve<S: Stream>(
    stream: &mut S,
    conn: &Arc<Conn>,
    mut park: Park,
) -> io::Result<Served> {
    if !matches!(park, Park::Never) {
        conn.may_park();
    }
    // Made at the first request and kept while the connection's task is.
    let mut keys = None;
    loop {
        if next_request(stream, conn).await? {
            return Ok(Served::Idle);
        }
        // Nothing served yet on this connection (see `exchange`).
        let first = keys.is_none() && !matches!(park, Park::Resumed);
        // The box is made first and the future in it: `Box::pin` made the
        // future on the stack and copied it.
        let busy = Box::write(
            Box::new_uninit(),
            while_busy(stream, conn, &mut keys, first, &mut park),
        );
        if let Some(served) = Box::into_pin(busy).await? {
            return Ok(served);
        }
    }
}

/// Waits for the client's next request: `true` when the sweep asks the
/// connection to park first (its client has been quiet for [`BUSY_MS`]).
/// (Not an `async fn`: its future would hold both references twice, and
/// it is in every connection's task.)
fn next_request<'a, S: Stream>(
    stream: &'a mut S,
    conn: &'a Conn,
) -> impl Future<Output = io::Result<bool>> + 'a {
    poll_fn(move |cx| match stream.poll_readable(cx) {
        Poll::Ready(read) => Poll::Ready(read.map(|()| false)),
        Poll::Pending if conn.asked_to_park(cx.waker()) => Poll::Ready(Ok(true)),
        Poll::Pending => Poll::Pending,
    })
}

/// Serves the client's exchanges while it is busy, waiting for each next
/// request in the same box: one box for a busy client's run of requests,
/// not one a request (up to [`KEPT_BOXES`] connections at once). A box a
/// request had the allocator hand out a different block each time, and
/// after a burst of connections those blocks were spread over all the
/// pages the burst had filled, which made every later request dearer
/// (docs/performance.md, "After a burst"). `None`: the connection waits
/// for its next request outside the box, holding nothing: over TLS (never
/// parked), or past the cap.
async fn while_busy<S: Stream>(
    stream: &mut S,
    conn: &Arc<Conn>,
    keys: &mut Option<Box<KeyCache>>,
    mut first: bool,
    park: &mut Park,
) -> io::Result<Option<Served>> {
    let mut kept = None;
    loop {
        let busy = match *park {
            Park::Never => true,
            Park::New => {
                *park = Park::Resumed;
                false
            }
            Park::Resumed => conn.idle_ms() < BUSY_MS,
        };
        match exchange(stream, conn, keys, first).await? {
            Next::Idle if !busy => return Ok(Some(Served::Idle)),
            Next::Idle if matches!(park, Park::Never) => return Ok(None),
            Next::Idle => {}
            Next::Closed => return Ok(Some(Served::Closed)),
            Next::Handoff(buf) => return Ok(Some(Served::Handoff(buf))),
        }
        first = false;
        // Past the cap, the box goes and the connection waits outside it.
        if kept.is_none() {
            kept = Kept::take();
            if kept.is_none() {
                return Ok(None);
            }
        }
        if next_request(stream, conn).await? {
            return Ok(Some(Served::Idle));
        }
    }
}

/// Connections at most that keep their box between requests (see
/// [`while_busy`]): about 0.5 MB. The allocator keeps the memory of boxes
/// let go together (when the sweep parks a burst of clients that went
/// quiet) until it is next busy; a cap keeps that small.
const KEPT_BOXES: usize = 128;

/// Boxes kept between requests now, of all workers.
static KEPT: AtomicUsize = AtomicUsize::new(0);

/// One of the [`KEPT_BOXES`], counted until dropped with its box.
struct Kept;

impl Kept {
    fn take() -> Option<Kept> {
        KEPT.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| {
            (n < KEPT_BOXES).then_some(n + 1)
        })
        .ok()
        .map(|_| Kept)
    }
}

impl Drop for Kept {
    fn drop(&mut self) {
        KEPT.fetch_sub(1, Ordering::Relaxed);
    }
}

/// What comes after [`exchange`].
enum Next {
    /// Nothing more read: the connection waits for its next request.
    Idle,
    Closed,
    /// A request for hyper; the bytes read and not used.
    Handoff(BytesMut),
}

/// Serves the requests the client has sent, as they come, until all are
/// answered and nothing more has been read (or the connection closes, or has
/// a request for hyper). `first`: the connection has served nothing yet.
async fn exchange<S: Stream>(
    stream: &mut S,
    conn: &Arc<Conn>,
    keys: &mut Option<Box<KeyCache>>,
    mut first: bool,
) -> io::Result<Next> {
    let client = &conn.client;
    let keys = &**keys.get_or_insert_with(Box::default);
    let mut lent = Lent::take(&client.proxy);
    let Buffers {
        read: buf,
        out,
        timer,
    } = &mut lent.0;
    // Each request and its answer are made in these, not moved there (each
    // is about 200 bytes): emptied after each request. The request's fields
    // are where `fields` says in its head, not in its header map.
    let mut slot = None;
    let mut answer = None;
    let mut fields = HeadFields::default();
    let max_body = client.proxy.read_whole();
    loop {
        // The next request's head, read as far as needed, its request made
        // in `slot`.
        let (close, body) = loop {
            match parse(buf, &mut slot, &mut fields, max_body) {
                Parsed::Request(close, body) => break (close, body),
                Parsed::Partial if buf.len() < MAX_HEAD => {}
                Parsed::Partial | Parsed::Other => {
                    return Ok(Next::Handoff(std::mem::take(buf)));
                }
                // A connection that opens with bytes that are no HTTP/1
                // request line at all (no `HTTP/` version: a client whose
                // HTTP/2 preface is wrong, RFC 9113 3.4) is closed, as an
                // HTTP/2 server closes it, not answered in HTTP/1.1.
                Parsed::Malformed(_) if first && !names_http(buf) => return Ok(Next::Closed),
                Parsed::Malformed(why) => {
                    let resp = ProxyError::BadRequest(why).response();
                    return answer_and_close(stream, out, resp, client.send_timeout()).await;
                }
            }
            // Reclaims the space of heads already served.
            buf.reserve(if buf.is_empty() { 4096 } else { 1024 });
            // 0 bytes: the client closed.
            if stream.read_buf(buf).await? == 0 {
                return Ok(Next::Closed);
            }
        };
        // Made by `parse`, which said so.
        let Some(req) = &mut slot else {
            return Ok(Next::Closed);
        };
        let mut asked = Asked {
            head_only: req.method() == Method::HEAD,
            keep: false,
            http10: req.version() == Version::HTTP_10,
        };
        // None: closed at shutdown before the request began.
        let Some(in_flight) = conn.begin() else {
            return Ok(Next::Closed);
        };
        if body > 0 {
            let idle = client.proxy.state().config.server.client_body_timeout;
            match read_body(stream, buf, body, idle).await? {
                BodyRead::Whole => {}
                BodyRead::Closed => return Ok(Next::Closed),
                BodyRead::Stalled => {
                    // As hyper's bodies answer (see `RequestBody::take`).
                    let resp = ProxyError::BodyTimeout(idle.as_millis()).response();
                    client.proxy.answered_unrouted(req, resp.status());
                    return answer_and_close(stream, out, resp, client.send_timeout()).await;
                }
            }
            let data = buf.split_to(body).freeze();
            *req.body_mut() = RequestBody::Read(data);
        }
        // The request, or the client gone first (leaving no answer), each
        // polled where it is pinned (`select!` made more copies of the
        // request's future).
        {
            let mut handling = pin!(client.proxy.handle(
                req,
                Some(&mut fields),
                client.peer(),
                keys,
                Some(Lent::timer(timer, &client.proxy)),
                &mut answer,
            ));
            let mut gone = pin!(client_gone(&mut *stream, &mut *buf));
            poll_fn(|cx| match handling.as_mut().poll(cx) {
                Poll::Ready(()) => Poll::Ready(()),
                Poll::Pending => gone.as_mut().poll(cx),
            })
            .await;
        }
        let Some(Answer { resp, limits }) = &mut answer else {
            return Ok(Next::Closed);
        };
        asked.keep = !close && !conn.stopping();
        // A client that takes no bytes for the timeout fails the write: the
        // connection ends, and the answer's upstream exchange with it. One
        // that closes while the body waits for the upstream ends it too:
        // the body (and what it holds: a concurrency slot, a metered
        // charge) is not kept for a client that is gone.
        let mut sending = SendTimeout::new(&mut *stream, client.send_timeout());
        let again = write_response(
            &mut sending,
            out,
            resp,
            limits.as_ref(),
            asked,
            Some(&mut *buf),
        )
        .await?;
        first = false;
        // Dropped where they are (`drop` would copy them first).
        answer = None;
        slot = None;
        fields.clear();
        drop(in_flight);
        if !again {
            return Ok(Next::Closed);
        }
        if buf.is_empty() {
            return Ok(Next::Idle);
        }
        // A large body's copy is not kept while pipelined requests are served.
        if out.capacity() > 4 * COPY_LIMIT {
            *out = Vec::new();
        }
    }
}

/// Sends sluice's own answer `resp` (a `400`, a `408`: it says
/// `Connection: close`), and ends the connection.
async fn answer_and_close<S: Stream>(
    stream: &mut S,
    out: &mut Vec<u8>,
    mut resp: Response<Body>,
    send_timeout: Duration,
) -> io::Result<Next> {
    let mut sending = SendTimeout::new(&mut *stream, send_timeout);
    write_response(&mut sending, out, &mut resp, None, Asked::default(), None).await?;
    sending.flush().await?;
    Ok(Next::Closed)
}

/// How reading a request body ended (see [`read_body`]).
enum BodyRead {
    Whole,
    /// The client closed first.
    Closed,
    /// The client sent nothing for `server.client_body_timeout`.
    Stalled,
}

/// Reads until `buf` holds the `len` bytes of a request body, each wait for
/// the client bounded by `idle` (`server.client_body_timeout`), as it is
/// for the bodies hyper reads.
async fn read_body<S: Stream>(
    stream: &mut S,
    buf: &mut BytesMut,
    len: usize,
    idle: Duration,
) -> io::Result<BodyRead> {
    while buf.len() < len {
        buf.reserve(len - buf.len());
        match tokio::time::timeout(idle, stream.read_buf(buf)).await {
            Err(_) => return Ok(BodyRead::Stalled),
            Ok(Ok(0)) => return Ok(BodyRead::Closed),
            Ok(read) => {
                read?;
            }
        }
    }
    Ok(BodyRead::Whole)
}

/// What an exchange works with: the buffers it reads requests into and
/// writes answers from, and the timer of its requests' upstream deadline.
#[derive(Default)]
struct Buffers {
    read: BytesMut,
    out: Vec<u8>,
    /// Made for each request, a timer is put in the runtime's timer wheel
    /// and taken out again; kept, it moves about once per
    /// `upstream_timeout` (see `proxy::within`). It
    /// may wake the task of its last request once, to no effect. It serves
    /// only connections of the server it was made for: a server runs on one
    /// runtime, and a timer cannot move to another.
    timer: Option<(Weak<Proxy>, Pin<Box<Sleep>>)>,
}

/// A thread's spare [`Buffers`], lent to an exchange and given back when it
/// ends however it ends. Under load each exchange uses what the last one
/// used, still in cache; spares are kept, not freed, as making them costs
/// allocations (the read buffer, its shared header once a request's head is
/// split off it, the answer's growing to its size) and the timer's moves.
struct Lent(Buffers);

impl Lent {
    fn take(proxy: &Arc<Proxy>) -> Lent {
        let mut lent = SPARE
            .with_borrow_mut(|spare| spare.pop())
            .unwrap_or_default();
        let theirs = |(server, _): &(Weak<Proxy>, _)| !std::ptr::eq(server.as_ptr(), &**proxy);
        if lent.timer.as_ref().is_some_and(theirs) {
            lent.timer = None;
        }
        Lent(lent)
    }

    /// The timer, made for `proxy`'s connections if there was none.
    fn timer<'t>(
        timer: &'t mut Option<(Weak<Proxy>, Pin<Box<Sleep>>)>,
        proxy: &Arc<Proxy>,
    ) -> Pin<&'t mut Sleep> {
        let (_, timer) = timer.get_or_insert_with(|| {
            // Its first deadline has passed: the first request moves it.
            (
                Arc::downgrade(proxy),
                Box::pin(tokio::time::sleep(Duration::ZERO)),
            )
        });
        timer.as_mut()
    }
}

impl Drop for Lent {
    fn drop(&mut self) {
        let Buffers {
            mut read,
            mut out,
            timer,
        } = std::mem::take(&mut self.0);
        read.clear();
        out.clear();
        // Nor is a buffer a request body made large (it is not kept as a
        // spare).
        if read.capacity() > MAX_HEAD {
            read = BytesMut::new();
        }
        // A large body's copy is not kept.
        if out.capacity() > 4 * COPY_LIMIT {
            out = Vec::new();
        }
        // At the thread's end the spares may be gone already.
        let _ = SPARE.try_with(|spare| {
            let mut spare = spare.borrow_mut();
            if read.capacity() > 0 && spare.len() < MAX_SPARE {
                spare.push(Buffers { read, out, timer });
            }
        });
    }
}

/// Spare buffers kept per thread (see [`Lent`]): enough for the requests
/// one thread has in flight at once under load (as many as an upstream's
/// default `keepalive` keeps connections for); above it they are freed. A
/// request that finds none makes its own, which costs more than the
/// allocations (docs/performance.md, "Spare buffers at 1,000 connections").
pub(crate) const MAX_SPARE: usize = 1024;

/// How many spare read buffers this thread holds: for tests, which run the
/// server on their own thread and can see that idle connections hold none.
#[doc(hidden)]
pub fn spare_read_buffers() -> usize {
    SPARE.with_borrow(|spare| spare.len())
}

/// What the front of the read buffer holds.
enum Parsed {
    /// A request served here, made in the caller's slot: whether the
    /// connection closes after it (its client said `Connection: close`, or
    /// is HTTP/1.0 and did not say `keep-alive`), and its body's length
    /// (its bytes follow the head, see [`read_body`]).
    Request(bool, usize),
    /// Not a whole head yet.
    Partial,
    /// A head for hyper: unusual, or one hyper judges (see `parse`).
    Other,
    /// Bytes that are not an HTTP/1 request head; why, for the client.
    Malformed(&'static str),
}

/// Takes a request head from the front of `buf` when it is one served here,
/// and makes its request in `slot`, its fields noted in `fields`; otherwise
/// leaves `buf` as it was.
fn parse(
    buf: &mut BytesMut,
    slot: &mut Option<Request<RequestBody>>,
    fields: &mut HeadFields,
    max_body: usize,
) -> Parsed {
    if buf.is_empty() {
        return Parsed::Partial;
    }
    // The usual plain head quickly, any other by httparse.
    let mut read = plain_head::ReadFields::new();
    let line = match plain_head::parse_request(buf, MAX_HEADERS, &mut read) {
        Some(line) => line,
        None => {
            // The HTTP/2 preface (prior knowledge, or a TLS client that
            // chose no protocol): hyper's to serve (see `server::handoff`).
            let start = &buf[..buf.len().min(H2_PREFACE.len())];
            if H2_PREFACE.starts_with(start) {
                return if start.len() < H2_PREFACE.len() {
                    Parsed::Partial
                } else {
                    Parsed::Other
                };
            }
            read.clear();
            match parse_other(buf, &mut read) {
                Ok(line) => line,
                Err(Instead::Partial) => return Parsed::Partial,
                Err(Instead::Hyper) => return Parsed::Other,
                Err(Instead::Refuse(why)) => return Parsed::Malformed(why),
            }
        }
    };
    let plain_head::RequestLine {
        len,
        method,
        target,
        http10,
    } = line;
    let method = match Method::from_bytes(method) {
        Ok(m) if m != Method::CONNECT => m,
        _ => return Parsed::Other,
    };
    // The target and the values stay where they were read: slices of the
    // head, not copies.
    let start = buf.as_ptr() as usize;
    let target = (target.as_ptr() as usize - start, target.len());
    let (mut close, mut keep_alive) = (false, false);
    let mut body = None;
    fields.clear();
    for &(name, value) in &read {
        // The names that decide whether the request is served here (by
        // length first: most names share none with them).
        match name.len() {
            // One length, in digits, that a small body has (as hyper reads
            // a length); any other is hyper's to judge.
            14 if eq_lower(name, b"content-length") => match body_length(value) {
                Some(len) if body.is_none() && len <= max_body => body = Some(len),
                _ => return Parsed::Other,
            },
            17 if eq_lower(name, b"transfer-encoding") => return Parsed::Other,
            7 if eq_lower(name, b"upgrade") => return Parsed::Other,
            6 if eq_lower(name, b"expect") => return Parsed::Other,
            2 if eq_lower(name, b"te") => return Parsed::Other,
            10 if eq_lower(name, b"connection") => {
                for token in value.split(|&b| b == b',').map(<[u8]>::trim_ascii) {
                    close |= eq_lower(token, b"close");
                    // As hyper reads it: a value of visible ASCII.
                    keep_alive |=
                        eq_lower(token, b"keep-alive") && crate::fields::text(value).is_some();
                }
            }
            _ => {}
        }
        let name_at = name.as_ptr() as usize - start;
        let value_at = value.as_ptr() as usize - start;
        fields.push(
            name_at..name_at + name.len(),
            value_at..value_at + value.len(),
        );
    }
    // Its slices of `buf` are offsets now; `buf` is split next.
    drop(read);
    let head = buf.split_to(len).freeze();
    // HTTP/1.0 keeps its connection only when it asks to (RFC 9112 9.3).
    let close = close || (http10 && !keep_alive);
    let version = if http10 {
        Version::HTTP_10
    } else {
        Version::HTTP_11
    };
    match build(&head, target, method, version, slot) {
        Some(()) => {
            fields.set_head(head);
            Parsed::Request(close, body.unwrap_or(0))
        }
        None => {
            // hyper's to refuse: put the head back where it was.
            let mut whole = BytesMut::with_capacity(head.len() + buf.len());
            whole.extend_from_slice(&head);
            whole.extend_from_slice(buf);
            *buf = whole;
            Parsed::Other
        }
    }
}

/// Whether the first line of `buf` names an HTTP version (`HTTP/`), as an
/// HTTP/1 request line does, right or wrong.
fn names_http(buf: &[u8]) -> bool {
    let line = buf.split(|&b| b == b'\n').next().unwrap_or_default();
    line.windows(6).any(|w| w == b" HTTP/")
}

/// The length a `Content-Length` value says, as hyper reads one (ASCII
/// digits, nothing else, not past `usize`).
fn body_length(value: &[u8]) -> Option<usize> {
    if value.is_empty() {
        return None;
    }
    value.iter().try_fold(0usize, |len, &b| {
        b.is_ascii_digit()
            .then(|| len.checked_mul(10)?.checked_add(usize::from(b - b'0')))
            .flatten()
    })
}

/// What becomes of a head httparse does not give back (see [`Parsed`]).
enum Instead {
    Partial,
    Hyper,
    Refuse(&'static str),
}

/// httparse's reading of a request head that is not plain (see
/// [`plain_head`]): its request line, its fields added to `fields`; or what
/// to do with it instead.
fn parse_other<'b>(
    buf: &'b [u8],
    fields: &mut plain_head::ReadFields<'b>,
) -> Result<plain_head::RequestLine<'b>, Instead> {
    let mut slots = [const { MaybeUninit::<httparse::Header>::uninit() }; MAX_HEADERS];
    let mut parsed = httparse::Request::new(&mut []);
    let len = match parsed.parse_with_uninit_headers(buf, &mut slots) {
        Ok(httparse::Status::Complete(len)) => len,
        Ok(httparse::Status::Partial) => return Err(Instead::Partial),
        // hyper takes more lines (and answers 431 above its limit).
        Err(httparse::Error::TooManyHeaders) => return Err(Instead::Hyper),
        // hyper would answer these with a bare 400: the same parser, the
        // same settings. A client that sent the HTTP/2 preface never gets
        // here (`parse` hands it on first).
        Err(e) => return Err(Instead::Refuse(malformed(e))),
    };
    let (Some(version), Some(method), Some(target)) = (parsed.version, parsed.method, parsed.path)
    else {
        return Err(Instead::Hyper);
    };
    fields.extend(parsed.headers.iter().map(|h| (h.name.as_bytes(), h.value)));
    Ok(plain_head::RequestLine {
        len,
        method: method.as_bytes(),
        target: target.as_bytes(),
        http10: version == 0,
    })
}

/// What the client is told about a head httparse refused.
fn malformed(e: httparse::Error) -> &'static str {
    match e {
        httparse::Error::HeaderName => "invalid header name",
        httparse::Error::HeaderValue => "invalid header value",
        httparse::Error::NewLine => "invalid line ending in the request head",
        httparse::Error::Version => "invalid HTTP version",
        _ => "invalid request line",
    }
}

/// Makes in `slot` the request whose head `head` is, its target at `target`
/// (offset, length); its fields stay in the head (see [`crate::fields`]),
/// its header map empty. `None` (and `slot` as it was) if hyper must judge
/// it.
fn build(
    head: &Bytes,
    target: (usize, usize),
    method: Method,
    version: Version,
    slot: &mut Option<Request<RequestBody>>,
) -> Option<()> {
    let uri = Uri::from_maybe_shared(head.slice(target.0..target.0 + target.1)).ok()?;
    let req = slot.insert(Request::new(RequestBody::Empty));
    *req.method_mut() = method;
    *req.uri_mut() = uri;
    *req.version_mut() = version;
    Some(())
}

/// Resolves when the client closes its side (or its connection fails) while
/// a request is in flight. Bytes it sends meanwhile (the next request,
/// pipelined) are kept in `buf`, up to [`MAX_HEAD`].
async fn client_gone<S: AsyncRead + Unpin>(stream: &mut S, buf: &mut BytesMut) {
    loop {
        if buf.len() >= MAX_HEAD {
            return std::future::pending().await;
        }
        buf.reserve(1024);
        match stream.read_buf(buf).await {
            Ok(0) | Err(_) => return,
            Ok(_) => {}
        }
    }
}

/// How a response body is framed on the wire.
#[derive(Clone, Copy, PartialEq)]
enum Framing {
    /// No body at all (`HEAD`, 1xx, 204, 304).
    None,
    Length(u64),
    Chunked,
    /// Until the connection closes: a `Content-Length` that is not a number.
    Close,
}

/// How a request's answer goes out.
#[derive(Clone, Copy, Default)]
struct Asked {
    /// `HEAD`: the head alone.
    head_only: bool,
    /// Neither the client nor shutdown asks to close after it.
    keep: bool,
    /// The client speaks HTTP/1.0: the answer says `HTTP/1.0` and is never
    /// chunked (a body of unknown length ends with the connection), and a
    /// connection kept says `connection: keep-alive`, as hyper answers.
    http10: bool,
}

/// Writes `resp` (lent: moved, it was copied twice); `Ok(true)` when it
/// went out whole and framed and neither side asked to close (see
/// [`Asked::keep`]), so the connection can take another request.
/// `watch`: the connection's read buffer; the connection is watched while
/// the body waits for more (see [`client_gone`]): a client that closes
/// ends it.
async fn write_response<W: AsyncRead + AsyncWrite + Unpin>(
    stream: &mut W,
    out: &mut Vec<u8>,
    resp: &mut Response<Body>,
    limits: Option<&Limits>,
    asked: Asked,
    mut watch: Option<&mut BytesMut>,
) -> io::Result<bool> {
    let fields = match resp.body_mut() {
        Either::Left(body) => body.take_fields(),
        Either::Right(_) => None,
    };
    let status = resp.status();
    out.clear();
    out.extend_from_slice(if asked.http10 {
        b"HTTP/1.0 "
    } else {
        b"HTTP/1.1 "
    });
    out.extend_from_slice(status.as_str().as_bytes());
    out.push(b' ');
    out.extend_from_slice(status.canonical_reason().unwrap_or("").as_bytes());
    out.extend_from_slice(b"\r\n");
    let mut length = None;
    let mut dated = false;
    let mut said_close = false;
    // The upstream's fields in one copy when they allow it (see
    // `Fields::block`) and none is to give way to a rate-limit field.
    let block = fields
        .as_deref()
        .filter(|f| limits.is_none() || !f.rate_limit_like)
        .and_then(|f| Some((f.block()?, f.dated)));
    if let Some(((block, content_length), has_date)) = block {
        out.extend_from_slice(block);
        length = content_length.map(Some);
        dated = has_date;
    }
    // The upstream's fields as read, or the answer's map: names in any case.
    let mut field = |name: &[u8], value: &[u8]| {
        if eq_lower(name, b"content-length") {
            length = Some(
                std::str::from_utf8(value)
                    .ok()
                    .and_then(|v| v.parse::<u64>().ok()),
            );
        } else if eq_lower(name, b"date") {
            dated = true;
        } else if eq_lower(name, b"connection") {
            // Sluice's own answers to a broken request end the connection.
            said_close |= eq_lower(value, b"close");
        } else if limits.is_some_and(|l| l.writes(name)) {
            // The upstream's own count gives way to the proxy's.
            return;
        }
        line(out, name, value);
    };
    if block.is_none() {
        for (name, value) in fields.iter().flat_map(|f| f.iter()) {
            field(name, value);
        }
    }
    for (name, value) in resp.headers() {
        field(name.as_str().as_bytes(), value.as_bytes());
    }
    if let Some(limits) = limits {
        limits.write_lines(out);
    }
    if !dated {
        DATE.with_borrow_mut(|date| line(out, b"date", date.now()));
    }
    let bodiless = status.is_informational()
        || status == StatusCode::NO_CONTENT
        || status == StatusCode::NOT_MODIFIED;
    let framing = match (length, resp.body().size_hint().exact()) {
        (Some(Some(n)), _) => Framing::Length(n),
        (Some(None), _) => Framing::Close,
        (None, _) if bodiless => Framing::None,
        (None, Some(n)) => {
            let mut digits = itoa::Buffer::new();
            line(out, b"content-length", digits.format(n).as_bytes());
            Framing::Length(n)
        }
        (None, None) if asked.http10 => Framing::Close,
        (None, None) => {
            line(out, b"transfer-encoding", b"chunked");
            Framing::Chunked
        }
    };
    let framing = if asked.head_only || bodiless {
        Framing::None
    } else {
        framing
    };
    let keep = asked.keep && !said_close && framing != Framing::Close;
    if !keep && !said_close {
        line(out, b"connection", b"close");
    } else if keep && asked.http10 {
        line(out, b"connection", b"keep-alive");
    }
    out.extend_from_slice(b"\r\n");
    if framing == Framing::None {
        // Its connection, if any, is let go before the client's write.
        *resp.body_mut() = Either::Right(Default::default());
        stream.write_all(out).await?;
        return Ok(keep);
    }

    let body = resp.body_mut();
    let mut sent = 0u64;
    let ended = loop {
        // A piece ready now goes out with what is waiting; otherwise what
        // is waiting goes first.
        let frame = match poll_fn(|cx| Poll::Ready(Pin::new(&mut *body).poll_frame(cx))).await {
            Poll::Ready(frame) => frame,
            Poll::Pending => {
                flush(stream, out).await?;
                let next = poll_fn(|cx| Pin::new(&mut *body).poll_frame(cx));
                match &mut watch {
                    Some(buf) => {
                        let mut gone = pin!(client_gone(&mut *stream, buf));
                        let mut next = pin!(next);
                        let frame = poll_fn(|cx| match next.as_mut().poll(cx) {
                            Poll::Ready(frame) => Poll::Ready(Some(frame)),
                            Poll::Pending => gone.as_mut().poll(cx).map(|()| None),
                        })
                        .await;
                        match frame {
                            Some(frame) => frame,
                            None => return Ok(false),
                        }
                    }
                    None => next.await,
                }
            }
        };
        let mut data = match frame {
            None => break true,
            // Cut short: the client must see it so.
            Some(Err(_)) => break false,
            Some(Ok(frame)) => match frame.into_data() {
                Ok(data) if !data.is_empty() => data,
                // Trailers (see the module's doc), or nothing.
                _ => continue,
            },
        };
        if let Framing::Length(n) = framing {
            let room = n - sent;
            if data.len() as u64 > room {
                data.truncate(room as usize);
                send(stream, out, &data).await?;
                flush(stream, out).await?;
                return Ok(false);
            }
        }
        sent += data.len() as u64;
        if framing == Framing::Chunked {
            chunk_line(out, data.len());
            send(stream, out, &data).await?;
            out.extend_from_slice(b"\r\n");
        } else {
            send(stream, out, &data).await?;
        }
    };
    if ended && framing == Framing::Chunked {
        out.extend_from_slice(b"0\r\n\r\n");
    }
    flush(stream, out).await?;
    Ok(keep
        && ended
        && match framing {
            Framing::Length(n) => sent == n,
            Framing::Chunked => true,
            Framing::None | Framing::Close => false,
        })
}

/// `name: value\r\n`: a field of an HTTP/1.1 head (also the upstream
/// request's, see `proxy::forward::upstream_head`).
pub(crate) fn line(out: &mut Vec<u8>, name: &[u8], value: &[u8]) {
    out.extend_from_slice(name);
    out.extend_from_slice(b": ");
    out.extend_from_slice(value);
    out.extend_from_slice(b"\r\n");
}

/// A chunk's size line: the size in hex, then CRLF.
fn chunk_line(out: &mut Vec<u8>, len: usize) {
    let digits = (usize::BITS - len.leading_zeros()).div_ceil(4).max(1);
    for i in (0..digits).rev() {
        out.push(b"0123456789ABCDEF"[(len >> (i * 4)) & 0xF]);
    }
    out.extend_from_slice(b"\r\n");
}

/// Queues `data` behind what is waiting, or writes both when it is large.
async fn send<W: AsyncWrite + Unpin>(
    stream: &mut W,
    out: &mut Vec<u8>,
    data: &[u8],
) -> io::Result<()> {
    if data.len() > COPY_LIMIT {
        flush(stream, out).await?;
        return stream.write_all(data).await;
    }
    out.extend_from_slice(data);
    if out.len() >= COPY_LIMIT {
        flush(stream, out).await?;
    }
    Ok(())
}

async fn flush<W: AsyncWrite + Unpin>(stream: &mut W, out: &mut Vec<u8>) -> io::Result<()> {
    if !out.is_empty() {
        stream.write_all(out).await?;
        out.clear();
    }
    Ok(())
}

thread_local! {
    static SPARE: RefCell<Vec<Buffers>> = const { RefCell::new(Vec::new()) };
    static DATE: RefCell<Date> = const { RefCell::new(Date { second: 0, text: [0; 29] }) };
}

/// The `Date` field's value now (for responses that lack one).
pub fn date_value() -> http::HeaderValue {
    DATE.with_borrow_mut(|date| {
        http::HeaderValue::from_bytes(date.now()).unwrap_or(http::HeaderValue::from_static(""))
    })
}

/// The `Date` value, made again once a second (per thread).
struct Date {
    second: u64,
    text: [u8; 29],
}

impl Date {
    fn now(&mut self) -> &[u8] {
        // The kernel's last tick is soon enough for a value in seconds.
        let second = crate::clock::coarse_unix_secs();
        if second != self.second {
            let text = httpdate::fmt_http_date(UNIX_EPOCH + Duration::from_secs(second));
            if text.len() == self.text.len() {
                self.text.copy_from_slice(text.as_bytes());
                self.second = second;
            }
        }
        &self.text
    }
}

/// A client connection handed to hyper: the bytes read and not used come
/// first, then the stream.
#[derive(Debug)]
pub struct Rewind<S> {
    first: BytesMut,
    stream: S,
}

impl<S> Rewind<S> {
    pub fn new(stream: S, first: BytesMut) -> Rewind<S> {
        Rewind { first, stream }
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for Rewind<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        if self.first.is_empty() {
            return Pin::new(&mut self.stream).poll_read(cx, buf);
        }
        let n = self.first.len().min(buf.remaining());
        buf.put_slice(&self.first[..n]);
        self.first.advance(n);
        // The read buffer they came in is not kept for the connection's life.
        if self.first.is_empty() {
            self.first = BytesMut::new();
        }
        Poll::Ready(Ok(()))
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Rewind<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.stream).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.stream).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.stream.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod props;

#[cfg(test)]
mod tests {
    use super::*;

    /// The bytes handed to hyper are read first, and the buffer they came
    /// in is let go once they are: hyper keeps the connection for its life.
    #[tokio::test]
    async fn rewind_gives_its_bytes_then_lets_its_buffer_go() {
        let mut first = BytesMut::with_capacity(4096);
        first.extend_from_slice(b"POST / HTTP/1.1\r\n");
        let mut rewind = Rewind::new(tokio::io::empty(), first);
        let mut got = [0u8; 64];
        let n = rewind.read(&mut got).await.unwrap();
        assert_eq!(&got[..n], b"POST / HTTP/1.1\r\n");
        assert_eq!(rewind.first.capacity(), 0);
        assert_eq!(rewind.read(&mut got).await.unwrap(), 0);
    }
}
