//! sluice's own HTTP/1.1 client exchange, for the usual request: no body, no
//! upgrade, to a plain-HTTP upstream (see [`super::pool`] for who uses it).
//!
//! hyper's client runs each upstream connection as a task of its own, handed
//! the request and its answer through channels; for a `GET` that is about a
//! fifth of sluice's work per request. Here the request's own task writes the
//! head and reads the answer, on a connection with one buffer kept for its
//! life. What an answer may be is handled in full (RFC 9112 §6.3): interim
//! 1xx answers skipped, bodiless answers (`HEAD`, 204, 304), `Content-Length`
//! (every copy checked, digits only), chunked bodies with their extensions
//! and trailers, and bodies that end with the connection. A connection is
//! kept only when its answer said so, ended exactly where its framing said,
//! and nothing has come since.

use std::io;
use std::mem::MaybeUninit;
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use bytes::{Buf, Bytes, BytesMut};
use http::header::{HeaderMap, HeaderName, HeaderValue};
use http::{Response, StatusCode, Version};
use hyper::body::{Frame, SizeHint};
use smallvec::SmallVec;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use super::plain_head::{self, Head};
use crate::ascii::eq_lower;

/// The most header fields an answer head (or its trailers) may have.
const MAX_HEADERS: usize = 100;
/// The longest answer head, trailer section or chunk-size line read.
const MAX_HEAD: usize = 64 * 1024;
/// Room made in the buffer before each read.
const READ_SIZE: usize = 8 * 1024;

/// Why an exchange failed.
#[derive(Debug, thiserror::Error)]
pub enum H1Error {
    /// The request could not be written: the connection was already closed,
    /// so the upstream never had it.
    #[error("the connection was closed before the request was sent: {0}")]
    NotSent(io::Error),
    /// Written, then the connection ended before any byte of an answer.
    #[error("the connection closed without an answer")]
    Unanswered,
    #[error("{0}")]
    Io(#[from] io::Error),
    #[error("malformed answer head: {0}")]
    Head(httparse::Error),
    #[error("answer head over {MAX_HEAD} bytes")]
    HeadTooLarge,
    #[error("{0}")]
    Framing(&'static str),
    #[error("the connection closed in the middle of the body")]
    CutShort,
}

/// A request head's bytes, in a buffer the thread keeps for a later head
/// when this one is done with: an allocation fewer a request. Each request
/// in flight holds one (its head is kept for a resend), so the thread keeps
/// up to [`MAX_SPARE_HEADS`].
pub struct HeadBuf(Vec<u8>);

/// Spare head buffers a thread keeps (see [`HeadBuf`]): as many as its
/// spare exchange buffers, one for each request in flight.
const MAX_SPARE_HEADS: usize = crate::front::MAX_SPARE;

thread_local! {
    static SPARE_HEADS: std::cell::RefCell<Vec<Vec<u8>>> = const { std::cell::RefCell::new(Vec::new()) };
}

impl HeadBuf {
    /// An empty buffer, with room for `len` bytes.
    pub fn with_capacity(len: usize) -> HeadBuf {
        let mut buf = SPARE_HEADS
            .with_borrow_mut(|spare| spare.pop())
            .unwrap_or_default();
        buf.reserve(len);
        HeadBuf(buf)
    }
}

impl std::ops::Deref for HeadBuf {
    type Target = Vec<u8>;
    fn deref(&self) -> &Vec<u8> {
        &self.0
    }
}

impl std::ops::DerefMut for HeadBuf {
    fn deref_mut(&mut self) -> &mut Vec<u8> {
        &mut self.0
    }
}

impl Drop for HeadBuf {
    fn drop(&mut self) {
        // A rare large head's buffer is not kept.
        if self.0.capacity() <= 4096 {
            let mut buf = std::mem::take(&mut self.0);
            buf.clear();
            SPARE_HEADS.with_borrow_mut(|spare| {
                if spare.len() < MAX_SPARE_HEADS {
                    spare.push(buf);
                }
            });
        }
    }
}

/// An open connection to an upstream and what was read from it.
pub struct Conn {
    stream: TcpStream,
    buf: BytesMut,
}

impl Conn {
    pub fn new(stream: TcpStream) -> Conn {
        Conn {
            stream,
            buf: BytesMut::with_capacity(READ_SIZE),
        }
    }

    /// True while the upstream has sent nothing since the last answer: not
    /// its end (a close), not stray bytes. Costs a system call only when the
    /// runtime saw the socket readable, which an idle kept connection is not.
    pub fn is_quiet(&self) -> bool {
        let mut probe = [0u8; 1];
        self.buf.is_empty()
            && matches!(self.stream.try_read(&mut probe), Err(e) if e.kind() == io::ErrorKind::WouldBlock)
    }
}

/// Writes `head` and reads the final answer's head. `head_only`: the request
/// was a `HEAD`, whose answer has no body whatever it announces.
pub async fn send(
    conn: &mut Conn,
    head: &[u8],
    head_only: bool,
) -> Result<(Response<()>, Reader), H1Error> {
    conn.stream
        .write_all(head)
        .await
        .map_err(H1Error::NotSent)?;
    loop {
        if let Some((resp, said, fields)) = parse_head(&mut conn.buf)? {
            let status = resp.status();
            if status.is_informational() {
                if status == StatusCode::SWITCHING_PROTOCOLS {
                    return Err(H1Error::Framing(
                        "a 101 to a request that asked for no upgrade",
                    ));
                }
                continue;
            }
            let (framing, keep) = framing(head_only, status, &said)?;
            let reader = Reader {
                framing,
                keep,
                fields,
            };
            return Ok((resp, reader));
        }
        let had = !conn.buf.is_empty();
        if conn.buf.len() >= MAX_HEAD {
            return Err(H1Error::HeadTooLarge);
        }
        conn.buf.reserve(READ_SIZE);
        match conn.stream.read_buf(&mut conn.buf).await {
            Ok(0) if had => return Err(H1Error::CutShort),
            Ok(0) => return Err(H1Error::Unanswered),
            Ok(_) => {}
            Err(e) if !had && is_reset(&e) => return Err(H1Error::Unanswered),
            Err(e) => return Err(e.into()),
        }
    }
}

fn is_reset(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::ConnectionReset
            | io::ErrorKind::BrokenPipe
            | io::ErrorKind::ConnectionAborted
    )
}

/// One answer head from the front of `buf`, taken out of it, with what it
/// says about its framing; `None` if the head is not all there yet. Its
/// fields come as read ([`Fields`]), or in the answer's map when they must
/// be edited.
#[allow(clippy::type_complexity)]
fn parse_head(
    buf: &mut BytesMut,
) -> Result<Option<(Response<()>, Said, Option<Box<Fields>>)>, H1Error> {
    if buf.is_empty() {
        return Ok(None);
    }
    // The usual plain head quickly, any other by httparse.
    let mut read = plain_head::ReadFields::new();
    let head = match plain_head::parse(buf, MAX_HEADERS, &mut read) {
        Some(head) => head,
        None => {
            read.clear();
            match parse_other(buf, &mut read)? {
                Some(head) => head,
                None => return Ok(None),
            }
        }
    };
    let status = StatusCode::from_u16(head.code)
        .map_err(|_| H1Error::Framing("a status code out of range"))?;
    let version = if head.http10 {
        Version::HTTP_10
    } else {
        Version::HTTP_11
    };
    let len = head.len;
    // The fields stay where they were read: spans of the head, not copies.
    let start = buf.as_ptr() as usize;
    // What framing and keep-alive depend on, noted on the way.
    let mut said = Said::default();
    // Boxed empty and filled in place: the 270-odd bytes are copied once,
    // not a second time when a filled struct is moved into a box.
    let mut fields = Box::new(Fields {
        head: Bytes::new(),
        spans: SmallVec::new(),
        dated: false,
        rate_limit_like: false,
        block: None,
    });
    // Whether the kept fields lie back to back, each line ended by CRLF.
    let mut adjacent = true;
    for &(name, value) in &read {
        said.note(name, value);
        // The connection's fields (`Connection: keep-alive`...) say what
        // they say to `said`, and are not the answer's.
        if !super::forward::lone_hop(name, value) {
            fields.dated |= eq_lower(name, b"date");
            fields.rate_limit_like |= is_rate_limit_like(name);
            let (n, v) = (
                name.as_ptr() as usize - start,
                value.as_ptr() as usize - start,
            );
            let w = v + value.len();
            adjacent &= buf.get(w..w + 2) == Some(&b"\r\n"[..])
                && fields
                    .spans
                    .last()
                    .is_none_or(|&[.., prev]| prev as usize + 2 == n);
            // A head is at most MAX_HEAD and one read long: u32 holds it.
            fields
                .spans
                .push([n, n + name.len(), v, w].map(|at| at as u32));
        }
    }
    // Its slices of `buf` are spans now; `buf` is split next.
    drop(read);
    if said.chunked.is_some() && !matches!(said.length, Ok(None)) {
        // Both framings (RFC 9112 6.3): the Transfer-Encoding rules and the
        // length is removed before forwarding; the client would otherwise
        // be given it, and a body cut to it.
        fields
            .spans
            .retain(|&mut [n, m, ..]| !eq_lower(&buf[n as usize..m as usize], b"content-length"));
        adjacent = false;
    }
    let spans = &fields.spans;
    fields.block = match (adjacent, said.length, spans.first(), spans.last()) {
        (true, Ok(length), Some(&[from, ..]), Some(&[.., to])) => Some(Block {
            from,
            to: to + 2,
            length,
        }),
        _ => None,
    };
    fields.head = buf.split_to(len).freeze();
    said.http10 = version == Version::HTTP_10;
    said.keep = match version {
        Version::HTTP_10 => said.keep_alive,
        _ => !said.close,
    };
    let mut resp = Response::new(());
    *resp.status_mut() = status;
    *resp.version_mut() = version;
    if !said.names_others {
        return Ok(Some((resp, said, Some(fields))));
    }
    // A `Connection` that names other fields (rare): they go too, by way of
    // the map and `strip_hop_by_hop`. Room for the rate-limit headers, which
    // hyper's server gets in the map.
    let mut headers = HeaderMap::with_capacity(fields.spans.len() + 3);
    fields.append_to(&mut headers);
    *resp.headers_mut() = headers;
    Ok(Some((resp, said, None)))
}

/// httparse's reading of a head that is not plain (see
/// [`super::plain_head`]): `None` while it is not all there.
fn parse_other<'b>(
    buf: &'b [u8],
    fields: &mut plain_head::ReadFields<'b>,
) -> Result<Option<Head>, H1Error> {
    let mut slots = [const { MaybeUninit::<httparse::Header>::uninit() }; MAX_HEADERS];
    let mut parsed = httparse::Response::new(&mut []);
    let len = match httparse::ParserConfig::default().parse_response_with_uninit_headers(
        &mut parsed,
        buf,
        &mut slots,
    ) {
        Ok(httparse::Status::Complete(len)) => len,
        Ok(httparse::Status::Partial) => return Ok(None),
        Err(e) => return Err(H1Error::Head(e)),
    };
    fields.extend(parsed.headers.iter().map(|h| (h.name.as_bytes(), h.value)));
    Ok(Some(Head {
        len,
        code: parsed.code.unwrap_or(0),
        http10: parsed.version == Some(0),
    }))
}

/// An answer's header fields as the upstream sent them, in order, but for
/// the hop-by-hop ones: spans of its head, not a header map. A map (each
/// name parsed and hashed, each value checked and counted) that was then
/// walked again to write the answer cost about 2,000 instructions a request.
/// httparse has checked every field already, by the rules `HeaderName` and
/// `HeaderValue` apply: names are tokens, values hold no control character
/// but tab. Names keep the upstream's case (they are case-insensitive).
pub struct Fields {
    head: Bytes,
    /// Name from, to; value from, to.
    spans: SmallVec<[[u32; 4]; 12]>,
    /// Whether one of them is `Date`.
    pub dated: bool,
    /// Whether one of them may be a rate-limit field sluice writes itself
    /// (`X-RateLimit-*`, `RateLimit*`), to be left out for sluice's own.
    pub rate_limit_like: bool,
    /// Where they lie back to back, if they do (see [`Fields::block`]).
    block: Option<Block>,
}

/// Fields that are one stretch of their head.
struct Block {
    /// From the first name to the last line's CRLF, included.
    from: u32,
    to: u32,
    /// The `Content-Length`, checked (see `Said`).
    length: Option<u64>,
}

impl Fields {
    /// All the fields as one stretch of lines, each ended by CRLF, with the
    /// answer's `Content-Length`, when they came so: as usual, nothing was
    /// taken from between them (a `Connection` comes first or last) and no
    /// line ended in a bare LF or blanks. Then they are written in one copy,
    /// not line by line (about 300 instructions of a proxied `GET`).
    pub fn block(&self) -> Option<(&[u8], Option<u64>)> {
        let b = self.block.as_ref()?;
        Some((&self.head[b.from as usize..b.to as usize], b.length))
    }

    /// Each field as its name and its value.
    pub fn iter(&self) -> impl Iterator<Item = (&[u8], &[u8])> {
        self.spans.iter().map(|&[n, m, v, w]| {
            let (n, m, v, w) = (n as usize, m as usize, v as usize, w as usize);
            (&self.head[n..m], &self.head[v..w])
        })
    }

    /// Keeps the head in a copy of its own, not in the connection's read
    /// buffer: for what outlives the connection's next use (see
    /// `PooledBody::detach`).
    pub fn detach(&mut self) {
        self.head = Bytes::copy_from_slice(&self.head);
    }

    /// Adds the fields to `headers`, for hyper's server.
    pub fn append_to(&self, headers: &mut HeaderMap) {
        for &[n, m, v, w] in &self.spans {
            let name = HeaderName::from_bytes(&self.head[n as usize..m as usize]);
            let value = HeaderValue::from_maybe_shared(self.head.slice(v as usize..w as usize));
            // Both were checked as they were read: neither can fail.
            if let (Ok(name), Ok(value)) = (name, value) {
                headers.append(name, value);
            }
        }
    }
}

/// Whether `name` (in any case) starts `RateLimit` or `X-RateLimit`.
fn is_rate_limit_like(name: &[u8]) -> bool {
    let name = match name {
        [b'x' | b'X', b'-', rest @ ..] => rest,
        _ => name,
    };
    name.get(..9).is_some_and(|n| eq_lower(n, b"ratelimit"))
}

/// What an answer's head says about its body's framing and its connection.
#[derive(Debug)]
struct Said {
    /// `Connection: close`, `Connection: keep-alive`.
    close: bool,
    keep_alive: bool,
    /// Whether the connection may be kept, by version and `Connection`.
    keep: bool,
    /// A `Connection` that names fields besides itself.
    names_others: bool,
    /// The `Content-Length`: every copy and every item of a list must be
    /// the same number, in digits alone.
    length: Result<Option<u64>, &'static str>,
    /// With a `Transfer-Encoding`: whether its last coding is chunked.
    chunked: Option<bool>,
    /// An HTTP/1.0 answer, which cannot use a `Transfer-Encoding`.
    http10: bool,
}

impl Default for Said {
    fn default() -> Said {
        Said {
            close: false,
            keep_alive: false,
            keep: true,
            names_others: false,
            length: Ok(None),
            chunked: None,
            http10: false,
        }
    }
}

impl Said {
    /// `name` as read, in any case.
    fn note(&mut self, name: &[u8], value: &[u8]) {
        let tokens = || value.split(|&b| b == b',').map(<[u8]>::trim_ascii);
        if eq_lower(name, b"connection") {
            for t in tokens() {
                self.close |= eq_lower(t, b"close");
                self.keep_alive |= eq_lower(t, b"keep-alive");
            }
            self.names_others |= !super::forward::names_none(value);
        } else if eq_lower(name, b"transfer-encoding") {
            let last = tokens().next_back().unwrap_or_default();
            // A value with bytes above 0x7F is not text, so not "chunked"
            // (as hyper's client reads it): its body ends with the connection.
            self.chunked = Some(value.is_ascii() && eq_lower(last, b"chunked"));
        } else if eq_lower(name, b"content-length") {
            for item in tokens() {
                let Some(n) = length(item) else {
                    self.length = Err("a Content-Length that is not a number");
                    return;
                };
                match self.length {
                    Ok(Some(l)) if l != n => {
                        self.length = Err("Content-Lengths that disagree");
                        return;
                    }
                    Ok(_) => self.length = Ok(Some(n)),
                    Err(_) => return,
                }
            }
        }
    }
}

/// One item of a `Content-Length`: digits alone, any number of leading
/// zeros, at most `u64::MAX - 2` (as hyper's client reads it).
fn length(item: &[u8]) -> Option<u64> {
    if item.is_empty() {
        return None;
    }
    let n = item.iter().try_fold(0u64, |n, &d| {
        let d = char::from(d).to_digit(10)?;
        n.checked_mul(10)?.checked_add(u64::from(d))
    })?;
    (n <= u64::MAX - 2).then_some(n)
}

/// How the body of an answer ends (RFC 9112 §6.3), and whether its
/// connection may still be kept.
fn framing(head_only: bool, status: StatusCode, said: &Said) -> Result<(Framing, bool), H1Error> {
    if head_only || status == StatusCode::NO_CONTENT || status == StatusCode::NOT_MODIFIED {
        return Ok((Framing::Length(0), said.keep));
    }
    Ok(match said.chunked {
        // RFC 9112 §6.1: its framing is faulty (hyper's client refuses it).
        Some(_) if said.http10 => {
            return Err(H1Error::Framing(
                "an HTTP/1.0 answer with a Transfer-Encoding",
            ));
        }
        // Both framings at once is how requests get smuggled: the length,
        // whatever it says, is ignored (as hyper's client ignores it) and
        // the connection not trusted again.
        Some(true) => (
            Framing::Chunked(Chunk::Size),
            said.keep && said.length == Ok(None),
        ),
        // A coding that is not chunked last: the body ends with the connection.
        Some(false) => (Framing::Close, false),
        None => match said.length.map_err(H1Error::Framing)? {
            Some(n) => (Framing::Length(n), said.keep),
            None => (Framing::Close, false),
        },
    })
}

/// Where the body's end is.
#[derive(Debug, Clone, Copy)]
enum Framing {
    /// This many bytes are left.
    Length(u64),
    Chunked(Chunk),
    /// The body ends with the connection.
    Close,
    Done,
}

/// Where a chunked body's reading is.
#[derive(Debug, Clone, Copy)]
enum Chunk {
    /// At a chunk-size line.
    Size,
    /// In a chunk's data, this many bytes left.
    Data(u64),
    /// At the line end after a chunk's data.
    DataEnd,
    /// After the last chunk: trailer fields, then an empty line.
    Trailers,
}

/// Reads an answer's body from its connection, frame by frame.
pub struct Reader {
    framing: Framing,
    keep: bool,
    /// The answer's fields, until the answer is written.
    fields: Option<Box<Fields>>,
}

impl Reader {
    /// The answer's fields as read, if its head did not go to its map.
    pub fn take_fields(&mut self) -> Option<Box<Fields>> {
        self.fields.take()
    }

    /// The answer's fields as read, while they are here.
    pub fn fields(&self) -> Option<&Fields> {
        self.fields.as_deref()
    }

    pub fn is_end(&self) -> bool {
        matches!(self.framing, Framing::Done | Framing::Length(0))
    }

    pub fn size_hint(&self) -> SizeHint {
        match self.framing {
            Framing::Length(n) => SizeHint::with_exact(n),
            Framing::Done => SizeHint::with_exact(0),
            _ => SizeHint::default(),
        }
    }

    /// Whether `conn` may take another request now that the body is read:
    /// its answer allowed it and nothing was sent past the body's end.
    pub fn reusable(&self, conn: &Conn) -> bool {
        self.keep && self.is_end() && conn.buf.is_empty()
    }

    /// The next piece of the body: data, then trailers if there are any.
    pub fn poll_frame(
        &mut self,
        conn: &mut Conn,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, H1Error>>> {
        loop {
            match self.framing {
                Framing::Done | Framing::Length(0) => {
                    self.framing = Framing::Done;
                    return Poll::Ready(None);
                }
                Framing::Length(left) => {
                    if conn.buf.is_empty() && ready!(fill(conn, cx))? == 0 {
                        return Poll::Ready(Some(Err(H1Error::CutShort)));
                    }
                    let data = take(&mut conn.buf, left);
                    self.framing = Framing::Length(left - data.len() as u64);
                    return Poll::Ready(Some(Ok(Frame::data(data))));
                }
                Framing::Close => {
                    if conn.buf.is_empty() && ready!(fill(conn, cx))? == 0 {
                        self.framing = Framing::Done;
                        return Poll::Ready(None);
                    }
                    let data = conn.buf.split().freeze();
                    return Poll::Ready(Some(Ok(Frame::data(data))));
                }
                Framing::Chunked(Chunk::Data(left)) => {
                    if conn.buf.is_empty() && ready!(fill(conn, cx))? == 0 {
                        return Poll::Ready(Some(Err(H1Error::CutShort)));
                    }
                    let data = take(&mut conn.buf, left);
                    let left = left - data.len() as u64;
                    self.framing = Framing::Chunked(if left == 0 {
                        Chunk::DataEnd
                    } else {
                        Chunk::Data(left)
                    });
                    return Poll::Ready(Some(Ok(Frame::data(data))));
                }
                Framing::Chunked(chunk) => match step(chunk, &mut conn.buf)? {
                    Step::Next(next) => self.framing = next,
                    Step::Trailers(trailers) => {
                        self.framing = Framing::Done;
                        return Poll::Ready(Some(Ok(Frame::trailers(trailers))));
                    }
                    Step::More => {
                        if conn.buf.len() >= MAX_HEAD {
                            return Poll::Ready(Some(Err(H1Error::Framing(
                                "a chunk line or trailer section too long",
                            ))));
                        }
                        if ready!(fill(conn, cx))? == 0 {
                            return Poll::Ready(Some(Err(H1Error::CutShort)));
                        }
                    }
                },
            }
        }
    }
}

/// Up to `left` bytes from the front of `buf`.
fn take(buf: &mut BytesMut, left: u64) -> Bytes {
    let n = usize::try_from(left).unwrap_or(usize::MAX).min(buf.len());
    buf.split_to(n).freeze()
}

/// What a chunked body's framing lines gave.
enum Step {
    Next(Framing),
    Trailers(HeaderMap),
    /// Not all there yet.
    More,
}

/// Reads one framing line (or the trailer section) from the front of `buf`.
fn step(chunk: Chunk, buf: &mut BytesMut) -> Result<Step, H1Error> {
    match chunk {
        Chunk::Size => match chunk_size(buf).map_err(H1Error::Framing)? {
            Some((len, size)) => {
                buf.advance(len);
                Ok(Step::Next(Framing::Chunked(if size == 0 {
                    Chunk::Trailers
                } else {
                    Chunk::Data(size)
                })))
            }
            None => Ok(Step::More),
        },
        Chunk::DataEnd => {
            if buf.len() < 2 {
                return Ok(Step::More);
            }
            if &buf[..2] != b"\r\n" {
                return Err(H1Error::Framing("a chunk longer than its size"));
            }
            buf.advance(2);
            Ok(Step::Next(Framing::Chunked(Chunk::Size)))
        }
        Chunk::Trailers => {
            let Some((len, lines)) = trailer_section(buf).map_err(H1Error::Framing)? else {
                return Ok(Step::More);
            };
            if lines == 0 {
                buf.advance(len);
                return Ok(Step::Next(Framing::Done));
            }
            // A field per line: an LF alone that httparse takes for a line's
            // end makes one too many, and is refused (as by hyper's client).
            let mut slots = [httparse::EMPTY_HEADER; MAX_HEADERS];
            let fields = match httparse::parse_headers(&buf[..len], &mut slots[..lines]) {
                Ok(httparse::Status::Complete((_, fields))) => fields,
                Ok(httparse::Status::Partial) => {
                    return Err(H1Error::Framing("a trailer section that does not end"));
                }
                Err(e) => return Err(H1Error::Head(e)),
            };
            // Rare enough for plain copies.
            let mut trailers = HeaderMap::with_capacity(fields.len());
            for f in fields {
                if let (Ok(name), Ok(value)) = (
                    HeaderName::from_bytes(f.name.as_bytes()),
                    HeaderValue::from_bytes(f.value),
                ) {
                    trailers.append(name, value);
                }
            }
            buf.advance(len);
            Ok(Step::Trailers(trailers))
        }
        Chunk::Data(_) => Ok(Step::More),
    }
}

/// The most bytes a trailer section may have (hyper's client's limit).
const MAX_TRAILERS: usize = 16 * 1024;

/// Where the trailer section at the front of `buf` ends, found as hyper's
/// client finds it: lines each ended by CRLF (an LF alone is a byte of its
/// line, a CR alone an error), up to an empty one. Its length and the
/// number of lines before the empty one; `None` while it is not all there.
/// (httparse alone ends it at an empty line ended by an LF alone, where
/// hyper reads on: the two would disagree on where the next answer starts.)
fn trailer_section(buf: &[u8]) -> Result<Option<(usize, usize)>, &'static str> {
    let mut at = 0;
    let mut lines = 0;
    loop {
        match (buf.get(at), buf.get(at + 1)) {
            (Some(b'\r'), Some(b'\n')) => return Ok(Some((at + 2, lines))),
            (Some(b'\r'), Some(_)) => return Err("a CR alone in the trailers"),
            (None, _) | (Some(b'\r'), None) => return Ok(None),
            _ => {}
        }
        while buf.get(at).is_some_and(|&b| b != b'\r') {
            at += 1;
            if at >= MAX_TRAILERS {
                return Err("a trailer section too long");
            }
        }
        match buf.get(at + 1) {
            None => return Ok(None),
            Some(b'\n') if lines < MAX_HEADERS => {}
            Some(b'\n') => return Err("too many trailer fields"),
            Some(_) => return Err("a CR alone in the trailers"),
        }
        lines += 1;
        at += 2;
    }
}

/// The chunk-size line at the front of `buf`, read as hyper's client reads
/// it: at least one hex digit (leading zeros as many as come, the size
/// within a u64), blanks, an extension up to the CR with no LF in it, CRLF.
/// Its length and the size; `None` while it is not all there. (httparse's
/// reading takes a line without digits as the last chunk, and an LF in an
/// extension: hyper's refuses both.)
fn chunk_size(buf: &[u8]) -> Result<Option<(usize, u64)>, &'static str> {
    let mut size = 0u64;
    let mut at = 0;
    while let Some(d) = buf.get(at).and_then(|&b| char::from(b).to_digit(16)) {
        size = size
            .checked_mul(16)
            .and_then(|s| s.checked_add(u64::from(d)))
            .ok_or("a chunk size past 64 bits")?;
        at += 1;
    }
    if at == buf.len() {
        return Ok(None);
    }
    if at == 0 {
        return Err("a chunk size line without a size");
    }
    while matches!(buf.get(at), Some(b' ' | b'\t')) {
        at += 1;
    }
    if buf.get(at) == Some(&b';') {
        while buf.get(at).is_some_and(|&b| b != b'\r') {
            if buf[at] == b'\n' {
                return Err("an LF in a chunk extension");
            }
            at += 1;
        }
    }
    match (buf.get(at), buf.get(at + 1)) {
        (None, _) | (Some(b'\r'), None) => Ok(None),
        (Some(b'\r'), Some(b'\n')) => Ok(Some((at + 2, size))),
        _ => Err("a chunk size that is not hex"),
    }
}

/// Reads more of the connection into its buffer; `Ok(0)` at its end.
fn fill(conn: &mut Conn, cx: &mut Context<'_>) -> Poll<io::Result<usize>> {
    conn.buf.reserve(READ_SIZE);
    tokio_util::io::poll_read_buf(Pin::new(&mut conn.stream), cx, &mut conn.buf)
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::header;

    fn said(fields: &[(HeaderName, &str)]) -> Said {
        let mut said = Said::default();
        for (name, value) in fields {
            said.note(name.as_str().as_bytes(), value.as_bytes());
        }
        said
    }

    #[test]
    fn content_lengths_must_agree_and_be_digits() {
        let cl = header::CONTENT_LENGTH;
        let length = |values: &[&str]| {
            let fields: Vec<_> = values.iter().map(|v| (cl.clone(), *v)).collect();
            said(&fields).length
        };
        assert_eq!(length(&["5"]), Ok(Some(5)));
        assert_eq!(length(&["5", "5"]), Ok(Some(5)));
        assert_eq!(length(&["5, 5"]), Ok(Some(5)));
        assert_eq!(length(&[]), Ok(None));
        // Leading zeros are no limit to a number's length, as with hyper.
        assert_eq!(length(&["00000000000000000005"]), Ok(Some(5)));
        assert_eq!(length(&["18446744073709551613"]), Ok(Some(u64::MAX - 2)));
        for bad in [
            &["5x"][..],
            &["+5"],
            &["5", "6"],
            &["5, 6"],
            &[""],
            &["99999999999999999999"],
            &["18446744073709551614"],
            &["18446744073709551616"],
            &["5x", "5"],
        ] {
            assert!(length(bad).is_err(), "{bad:?}");
        }
    }

    /// The block of fields written in one copy is exactly the kept lines,
    /// and there is none when a line between them was dropped or a line
    /// does not end as the client must see it end.
    #[test]
    fn fields_lying_back_to_back_are_one_block() {
        let parse = |head: &str| {
            let mut buf = BytesMut::from(head);
            let (_, _, fields) = parse_head(&mut buf).unwrap().unwrap();
            fields.unwrap()
        };
        let usual = parse(
            "HTTP/1.1 200 OK\r\nServer: up\r\nDate: x\r\nContent-Length: 2\r\nConnection: keep-alive\r\n\r\nok",
        );
        assert_eq!(
            usual.block(),
            Some((
                &b"Server: up\r\nDate: x\r\nContent-Length: 2\r\n"[..],
                Some(2)
            ))
        );
        assert!(usual.dated && !usual.rate_limit_like);
        for name in ["X-RateLimit-Remaining", "ratelimit", "RateLimit-Policy"] {
            assert!(parse(&format!("HTTP/1.1 200 OK\r\n{name}: 1\r\n\r\n")).rate_limit_like);
        }
        let first = parse("HTTP/1.1 200 OK\r\nConnection: keep-alive\r\nX-A:1\r\n\r\n");
        assert_eq!(first.block(), Some((&b"X-A:1\r\n"[..], None)));
        assert!(!first.dated);
        // (head, the fields kept)
        for (head, kept) in [
            // A line dropped from between them.
            (
                "HTTP/1.1 200 OK\r\nX-A: 1\r\nKeep-Alive: timeout=5\r\nX-B: 2\r\n\r\n",
                2,
            ),
            // A bare LF, blanks after a value.
            ("HTTP/1.1 200 OK\r\nX-A: 1\nX-B: 2\r\n\r\n", 2),
            ("HTTP/1.1 200 OK\nX-A: 1\n\n", 1),
            ("HTTP/1.1 200 OK\r\nX-A: 1 \r\n\r\n", 1),
            // No fields at all.
            ("HTTP/1.1 200 OK\r\nConnection: close\r\n\r\n", 0),
        ] {
            let fields = parse(head);
            assert!(fields.block().is_none(), "{head:?}");
            assert_eq!(fields.iter().count(), kept, "{head:?}");
        }
    }

    #[test]
    fn chunk_size_lines_are_read_as_hyper_reads_them() {
        for (line, read) in [
            (&b"a\r\n"[..], Some((3, 10))),
            (b"A \t;x=\"y\"\r\nrest", Some((11, 10))),
            (b"00000000000000000001\r\n", Some((22, 1))),
            (b"ffffffffffffffff\r\n", Some((18, u64::MAX))),
            (b"0\r\n", Some((3, 0))),
            (b"", None),
            (b"1", None),
            (b"1 ", None),
            (b"1;ab", None),
            (b"1\r", None),
        ] {
            assert_eq!(chunk_size(line), Ok(read), "{line:?}");
        }
        for line in [
            &b"\r\n"[..],
            b";a\r\n",
            b" 1\r\n",
            b"1;a\nb\r\n",
            b"10000000000000000\r\n",
            b"1 1\r\n",
            b"1\n",
            b"1\rx",
            b"g\r\n",
            b"0x1\r\n",
        ] {
            assert!(chunk_size(line).is_err(), "{line:?}");
        }
    }

    #[test]
    fn trailer_sections_end_where_hyper_ends_them() {
        for (section, read) in [
            (&b"\r\nnext"[..], Some((2, 0))),
            (b"X: 1\r\nY: 2\r\n\r\nnext", Some((14, 2))),
            // An LF alone is a byte of its line, not an end.
            (b"X: 1\n\r\n\r\n", Some((9, 1))),
            (b"X: 1\r\n\n", None),
            (b"\n", None),
            (b"X: 1\r\n", None),
            (b"X: 1\r", None),
            (b"", None),
        ] {
            assert_eq!(trailer_section(section), Ok(read), "{section:?}");
        }
        for section in [&b"X: 1\rY\r\n\r\n"[..], b"\rx"] {
            assert!(trailer_section(section).is_err(), "{section:?}");
        }
        let many = "X: 1\r\n".repeat(MAX_HEADERS + 1) + "\r\n";
        assert!(trailer_section(many.as_bytes()).is_err());
        let long = format!("X: {}\r\n\r\n", "a".repeat(MAX_TRAILERS));
        assert!(trailer_section(long.as_bytes()).is_err());
        // A bare LF that httparse takes for a field's end is refused.
        let mut buf = BytesMut::from(&b"X: 1\nY: 2\r\n\r\n"[..]);
        assert!(step(Chunk::Trailers, &mut buf).is_err());
        // Where httparse ends it early, the section is still read whole.
        let mut buf = BytesMut::from(&b"X: 1\r\n\nY: 2\r\n\r\n"[..]);
        let Ok(Step::Trailers(trailers)) = step(Chunk::Trailers, &mut buf) else {
            panic!("trailers");
        };
        assert_eq!((trailers.len(), buf.len()), (1, 0));
        let mut buf = BytesMut::from(&b"X: 1\r\nY: 2\r\n\r\nnext"[..]);
        let Ok(Step::Trailers(trailers)) = step(Chunk::Trailers, &mut buf) else {
            panic!("trailers");
        };
        assert_eq!((trailers.len(), &buf[..]), (2, &b"next"[..]));
    }

    #[test]
    fn a_chunked_body_with_a_length_too_is_not_kept() {
        let te = header::TRANSFER_ENCODING;
        let (f, keep) = framing(
            false,
            StatusCode::OK,
            &said(&[(te.clone(), "gzip, chunked")]),
        )
        .unwrap();
        assert!(matches!(f, Framing::Chunked(Chunk::Size)) && keep);
        let both = said(&[(te.clone(), "chunked"), (header::CONTENT_LENGTH, "3")]);
        let (f, keep) = framing(false, StatusCode::OK, &both).unwrap();
        assert!(matches!(f, Framing::Chunked(Chunk::Size)) && !keep);
        // Nor is a value that is not text.
        let (f, _) = framing(
            false,
            StatusCode::OK,
            &said(&[(te.clone(), "\u{e9}, chunked")]),
        )
        .unwrap();
        assert!(matches!(f, Framing::Close));
        // A coding that is not chunked last: the body ends with the connection.
        let (f, keep) = framing(
            false,
            StatusCode::OK,
            &said(&[(te.clone(), "chunked, gzip")]),
        )
        .unwrap();
        assert!(matches!(f, Framing::Close) && !keep);
        // With a Transfer-Encoding, a Content-Length is not read at all.
        let bad_length = said(&[(te.clone(), "chunked"), (header::CONTENT_LENGTH, "x")]);
        let (f, keep) = framing(false, StatusCode::OK, &bad_length).unwrap();
        assert!(matches!(f, Framing::Chunked(Chunk::Size)) && !keep);
        // A bodiless answer's framing headers are not looked at.
        let bad = said(&[(header::CONTENT_LENGTH, "x")]);
        assert!(framing(false, StatusCode::NOT_MODIFIED, &bad).is_ok());
        assert!(framing(false, StatusCode::OK, &bad).is_err());
        // With a Transfer-Encoding, a Content-Length is not read at all.
        for te_value in ["chunked", "gzip"] {
            let both = said(&[(te.clone(), te_value), (header::CONTENT_LENGTH, "+1")]);
            let (_, keep) = framing(false, StatusCode::OK, &both).unwrap();
            assert!(!keep);
        }
        // An HTTP/1.0 answer with one is refused (RFC 9112 §6.1), unless it
        // has no body anyway.
        let mut old = said(&[(te, "chunked")]);
        old.http10 = true;
        assert!(framing(false, StatusCode::OK, &old).is_err());
        assert!(framing(true, StatusCode::OK, &old).is_ok());
    }
}

#[cfg(test)]
mod props;
