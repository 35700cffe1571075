//! One HTTP/2 connection served (RFC 9113), in its one task: the client's
//! frames read and acted on, each request handed to the service as soon as
//! its head is whole, each response written as soon as it is ready. The
//! requests' futures and the responses' bodies are polled here, each woken
//! on its own, never spawned.

use std::cell::RefCell;
use std::collections::{HashMap, VecDeque};
use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, ready};

use bytes::{Buf, Bytes, BytesMut};
use futures_util::stream::{FuturesUnordered, StreamExt};
use http::header::{CONNECTION, CONTENT_LENGTH, DATE, TE, TRANSFER_ENCODING, UPGRADE};
use http::{HeaderMap, HeaderValue, Request, Response, Version};
use hyper::body::{Body, Frame as BodyFrame};
use tokio::io::{AsyncRead, AsyncWrite};

use super::body::{Inbox, RecvBody};
use super::frame::{self, Frame, FrameError, Head, Reason, setting};
use super::hpack::{Decoder, Encoder};
use super::request::Fields;

/// The window each stream starts with for the client's DATA, and the
/// connection's: what a client may have in flight, per stream and in all,
/// before sluice has read it.
pub const STREAM_WINDOW: u32 = 1 << 20;
pub const CONN_WINDOW: u32 = 1 << 20;

/// The window a client gives until it says otherwise (RFC 9113, 6.9.2).
const DEFAULT_WINDOW: i64 = 65_535;

/// Written bytes waiting past this: no more is read or made until they go.
const WRITE_HIGH: usize = 64 * 1024;

/// Streams remembered once closed, to tell a late frame on one (ignored,
/// or STREAM_CLOSED) from one on a stream that never was.
const REMEMBERED: usize = 64;

/// A header block (HEADERS and CONTINUATION) longer than this ends the
/// connection: compressed, a block is never longer than its fields.
fn max_block(max_header_list: usize) -> usize {
    max_header_list.max(16 * 1024) * 2
}

/// Settings of the server's side.
#[derive(Debug, Clone, Copy)]
pub struct Settings {
    /// SETTINGS_MAX_CONCURRENT_STREAMS.
    pub max_streams: u32,
    /// SETTINGS_MAX_HEADER_LIST_SIZE: larger request heads get a 431.
    pub max_header_list: usize,
}

/// Why a connection ended other than cleanly.
#[derive(Debug, thiserror::Error)]
pub enum ConnError {
    #[error("HTTP/2 client connection: {0}")]
    Io(#[from] io::Error),
    #[error("HTTP/2 protocol error (code {0}), told the client with GOAWAY")]
    Protocol(u32),
    #[error("HTTP/2 client sent no connection preface")]
    Preface,
}

/// A stream's work, polled by the connection: its request being answered,
/// or its response body's next frame.
enum Task<F, B> {
    Answer(u32, F),
    Body(u32, B),
    /// Its stream was reset: it ends at its next poll, nothing polled.
    Gone,
}

enum Event<B: Body> {
    Answered(Response<B>),
    Frame(B, Option<Result<BodyFrame<Bytes>, B::Error>>),
    Gone,
}

impl<F, B> Future for Task<F, B>
where
    F: Future<Output = Response<B>> + Unpin,
    B: Body<Data = Bytes> + Unpin,
{
    type Output = (u32, Event<B>);

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<(u32, Event<B>)> {
        match &mut *self {
            Task::Answer(id, f) => {
                let id = *id;
                Pin::new(f).poll(cx).map(|r| (id, Event::Answered(r)))
            }
            Task::Body(id, b) => {
                let id = *id;
                let frame = ready!(Pin::new(&mut *b).poll_frame(cx));
                let Task::Body(_, body) = std::mem::replace(&mut *self, Task::Gone) else {
                    unreachable!("matched above")
                };
                Poll::Ready((id, Event::Frame(body, frame)))
            }
            Task::Gone => Poll::Ready((0, Event::Gone)),
        }
    }
}

/// A stream the client opened, until both sides are done with it.
struct Stream<B> {
    /// The request body's inbox (`None` for a request without one).
    inbox: Option<Arc<Inbox>>,
    /// The client may still send DATA.
    recv_open: bool,
    /// Read from the inbox (or dropped: padding, data nobody reads) and not
    /// given back to the client as stream window yet.
    to_release: usize,
    /// What the client may still send on the stream before window is
    /// given back.
    recv_window: i64,
    /// The request's `content-length`, and the DATA received so far.
    length: Option<u64>,
    received: u64,
    send: Send<B>,
    /// What sluice may still send on the stream.
    send_window: i64,
}

enum Send<B> {
    /// The request is being answered.
    Answering,
    /// The response body: `body` is `None` while its next frame is
    /// awaited (in `tasks`); `pending` is data the windows have held back.
    Body {
        body: Option<B>,
        pending: Option<Bytes>,
        /// The body ended after `pending`.
        end: bool,
    },
    /// The response has been sent whole.
    Done,
}

/// What the connection is doing.
#[derive(PartialEq, Eq)]
enum Phase {
    /// Reading the client's preface.
    Preface,
    /// Serving.
    Open,
    /// Told GOAWAY (shutdown, or the client's): the streams open finish.
    Draining,
    /// Writing what is left, then closing.
    Closing,
}

/// One HTTP/2 client connection (a future: poll it to its end).
pub struct Connection<I, S, F, B> {
    io: I,
    service: S,
    settings: Settings,
    phase: Phase,
    /// The error the connection ends with, once it has been told.
    error: Option<ConnError>,
    read: BytesMut,
    /// Frames to write; the first `written` bytes have been.
    write: Vec<u8>,
    written: usize,
    eof: bool,
    decoder: Decoder,
    encoder: Encoder,
    streams: HashMap<u32, Stream<B>>,
    tasks: FuturesUnordered<Task<F, B>>,
    /// Tasks of reset streams still in `tasks` (see [`Task::Gone`]).
    gone: usize,
    /// The highest stream the client has opened.
    last_id: u32,
    /// Streams lately closed, and those sluice reset (whose frames in
    /// flight are ignored).
    closed: VecDeque<u32>,
    reset: VecDeque<u32>,
    /// A header block waiting for its CONTINUATION: stream, END_STREAM,
    /// bytes.
    continuing: Option<(u32, bool, Vec<u8>)>,
    /// The client's SETTINGS_INITIAL_WINDOW_SIZE and MAX_FRAME_SIZE.
    peer_window: i64,
    peer_max_frame: usize,
    /// What sluice may still send on the connection.
    send_window: i64,
    /// What the client may still send on the connection, and what has
    /// been read since window was last given back.
    recv_window: i64,
    recv_released: usize,
    /// Streams held back by the connection's window, waiting for it.
    blocked: Vec<u32>,
    /// The first frame after the preface has been SETTINGS.
    settings_seen: bool,
    /// Streams the client reset while sluice worked on them, and
    /// responses sent whole: a client that resets far more than it lets
    /// finish is told to stop (see [`too_many_resets`]).
    resets: u64,
    answered: u64,
}

/// A client that keeps opening streams and resetting them makes sluice
/// start work it never finishes (the "rapid reset" attack, CVE-2023-44487):
/// past this many resets more than twice the answers, it is told
/// ENHANCE_YOUR_CALM and the connection ends.
const RESETS_ALLOWED: u64 = 200;

fn too_many_resets(resets: u64, answered: u64) -> bool {
    resets > RESETS_ALLOWED + 2 * answered
}

impl<I, S, F, B> Connection<I, S, F, B>
where
    I: AsyncRead + AsyncWrite + Unpin,
    S: FnMut(Request<RecvBody>) -> F,
    F: Future<Output = Response<B>> + Unpin,
    B: Body<Data = Bytes> + Unpin,
    B::Error: std::fmt::Display,
{
    pub fn new(io: I, settings: Settings, service: S) -> Self {
        let mut write = Vec::with_capacity(256);
        frame::put_settings(
            &mut write,
            &[
                (setting::MAX_CONCURRENT_STREAMS, settings.max_streams),
                (setting::INITIAL_WINDOW_SIZE, STREAM_WINDOW),
                (
                    setting::MAX_HEADER_LIST_SIZE,
                    u32::try_from(settings.max_header_list).unwrap_or(u32::MAX),
                ),
            ],
        );
        Connection {
            io,
            service,
            settings,
            phase: Phase::Preface,
            error: None,
            read: BytesMut::new(),
            write,
            written: 0,
            eof: false,
            decoder: Decoder::new(4096),
            encoder: Encoder::default(),
            streams: HashMap::new(),
            tasks: FuturesUnordered::new(),
            gone: 0,
            last_id: 0,
            closed: VecDeque::new(),
            reset: VecDeque::new(),
            continuing: None,
            peer_window: DEFAULT_WINDOW,
            peer_max_frame: frame::DEFAULT_MAX_FRAME,
            send_window: DEFAULT_WINDOW,
            recv_window: i64::from(CONN_WINDOW),
            recv_released: 0,
            blocked: Vec::new(),
            settings_seen: false,
            resets: 0,
            answered: 0,
        }
    }

    /// Ends the connection gracefully: GOAWAY, then the streams open
    /// finish, and no new one is served.
    pub fn graceful_shutdown(&mut self) {
        if matches!(self.phase, Phase::Preface | Phase::Open) {
            frame::put_goaway(&mut self.write, self.last_id, Reason::NO_ERROR);
            self.phase = Phase::Draining;
        }
    }

    /// Ends the connection with a connection error: GOAWAY with `reason`.
    fn fail(&mut self, reason: Reason) {
        if self.phase != Phase::Closing {
            frame::put_goaway(&mut self.write, self.last_id, reason);
            self.error = Some(ConnError::Protocol(reason.0));
            self.close_all(reason);
        }
    }

    /// Drops every stream (their tasks too) and closes once written.
    fn close_all(&mut self, reason: Reason) {
        for (_, s) in self.streams.drain() {
            if let Some(inbox) = s.inbox {
                inbox.detach(Some(reason));
            }
        }
        self.tasks = FuturesUnordered::new();
        self.gone = 0;
        self.phase = Phase::Closing;
    }

    fn waiting_to_write(&self) -> usize {
        self.write.len() - self.written
    }

    /// Reads and acts on whatever the client has sent.
    fn poll_read(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<usize>> {
        if self.read.capacity() == 0 {
            let (read, mut write) = lend();
            self.read = read;
            // A larger spare write buffer is kept rather than freed; what
            // waits to be written (a new connection's SETTINGS) moves in.
            if write.capacity() > self.write.capacity() {
                write.extend_from_slice(&self.write);
                self.write = write;
            }
        }
        if self.read.capacity() - self.read.len() < 4096 {
            self.read.reserve(16 * 1024);
        }
        tokio_util::io::poll_read_buf(Pin::new(&mut self.io), cx, &mut self.read)
    }

    /// Acts on every whole frame read.
    fn on_bytes(&mut self) {
        if self.phase == Phase::Preface {
            let n = self.read.len().min(frame::PREFACE.len());
            if self.read[..n] != frame::PREFACE[..n] {
                // Not HTTP/2: told, and closed (RFC 9113, 3.4).
                self.fail(Reason::PROTOCOL_ERROR);
                self.error = Some(ConnError::Preface);
                return;
            }
            if n < frame::PREFACE.len() {
                return;
            }
            self.read.advance(n);
            self.phase = Phase::Open;
            // The connection's window, once the client is known to speak
            // HTTP/2.
            frame::put_window_update(&mut self.write, 0, CONN_WINDOW - DEFAULT_WINDOW as u32);
        }
        while self.phase != Phase::Closing {
            let Some(head) = Head::read(&self.read) else {
                return;
            };
            if head.len > frame::DEFAULT_MAX_FRAME {
                return self.fail(Reason::FRAME_SIZE_ERROR);
            }
            if self.read.len() < frame::HEAD_LEN + head.len {
                self.read
                    .reserve(frame::HEAD_LEN + head.len - self.read.len());
                return;
            }
            let bytes = self.read.split_to(frame::HEAD_LEN + head.len).freeze();
            let payload = bytes.slice(frame::HEAD_LEN..);
            if let Err(e) = self.on_frame(head, &payload) {
                match e {
                    FrameError::Connection(reason) => return self.fail(reason),
                    FrameError::Stream(id, reason) => self.reset_stream(id, reason),
                }
            }
        }
    }

    fn on_frame(&mut self, head: Head, payload: &Bytes) -> Result<(), FrameError> {
        let frame = frame::parse(head, payload)?;
        // The first frame is SETTINGS (RFC 9113, 3.4).
        if !self.settings_seen {
            if !matches!(frame, Frame::Settings(_)) {
                return Err(FrameError::Connection(Reason::PROTOCOL_ERROR));
            }
            self.settings_seen = true;
        }
        // Inside a header block only its CONTINUATION may come (6.10).
        if let Some((id, _, _)) = &self.continuing {
            let ok = matches!(frame, Frame::Continuation { stream, .. } if stream == *id);
            if !ok {
                return Err(FrameError::Connection(Reason::PROTOCOL_ERROR));
            }
        }
        match frame {
            Frame::Data {
                stream,
                end_stream,
                data,
                flow_len,
            } => self.on_data(stream, end_stream, payload.slice_ref(data), flow_len),
            Frame::Headers {
                stream,
                end_stream,
                end_headers,
                block,
                ..
            } => {
                if end_headers {
                    self.on_headers(stream, end_stream, block)
                } else {
                    if block.len() > max_block(self.settings.max_header_list) {
                        return Err(FrameError::Connection(Reason::ENHANCE_YOUR_CALM));
                    }
                    self.continuing = Some((stream, end_stream, block.to_vec()));
                    Ok(())
                }
            }
            Frame::Continuation {
                stream,
                end_headers,
                block,
            } => {
                let Some((id, end_stream, mut bytes)) = self.continuing.take() else {
                    return Err(FrameError::Connection(Reason::PROTOCOL_ERROR));
                };
                bytes.extend_from_slice(block);
                if bytes.len() > max_block(self.settings.max_header_list) {
                    return Err(FrameError::Connection(Reason::ENHANCE_YOUR_CALM));
                }
                if end_headers {
                    self.on_headers(stream, end_stream, &bytes)
                } else {
                    self.continuing = Some((id, end_stream, bytes));
                    Ok(())
                }
            }
            Frame::Priority { .. } | Frame::Unknown | Frame::SettingsAck => Ok(()),
            Frame::RstStream { stream, reason } => {
                if stream > self.last_id && !self.reset.contains(&stream) {
                    return Err(FrameError::Connection(Reason::PROTOCOL_ERROR));
                }
                if self.streams.contains_key(&stream) {
                    self.remove(stream, Some(reason));
                    self.cancel_tasks(stream);
                    self.remember(stream, false);
                    self.resets += 1;
                    if too_many_resets(self.resets, self.answered) {
                        return Err(FrameError::Connection(Reason::ENHANCE_YOUR_CALM));
                    }
                }
                Ok(())
            }
            Frame::Settings(settings) => {
                for param in settings.each() {
                    let (id, value) = param?;
                    match id {
                        setting::HEADER_TABLE_SIZE => self.encoder.table_size_set(),
                        setting::INITIAL_WINDOW_SIZE => {
                            let delta = i64::from(value) - self.peer_window;
                            self.peer_window = i64::from(value);
                            for s in self.streams.values_mut() {
                                s.send_window += delta;
                                if s.send_window > i64::from(frame::MAX_WINDOW) {
                                    return Err(FrameError::Connection(Reason::FLOW_CONTROL_ERROR));
                                }
                            }
                            if delta > 0 {
                                self.blocked.extend(self.streams.keys().copied());
                            }
                        }
                        setting::MAX_FRAME_SIZE => self.peer_max_frame = value as usize,
                        _ => {}
                    }
                }
                frame::put_settings_ack(&mut self.write);
                Ok(())
            }
            Frame::Ping { ack, data } => {
                if !ack {
                    frame::put_ping_ack(&mut self.write, data);
                }
                Ok(())
            }
            Frame::GoAway { .. } => {
                // The client opens no more streams; those open finish.
                if self.phase == Phase::Open {
                    self.phase = Phase::Draining;
                }
                Ok(())
            }
            Frame::WindowUpdate { stream, increment } => {
                let increment = i64::from(increment);
                if stream == 0 {
                    self.send_window += increment;
                    if self.send_window > i64::from(frame::MAX_WINDOW) {
                        return Err(FrameError::Connection(Reason::FLOW_CONTROL_ERROR));
                    }
                    // The streams it held back are in `blocked`.
                    return Ok(());
                }
                if stream > self.last_id && !self.reset.contains(&stream) {
                    return Err(FrameError::Connection(Reason::PROTOCOL_ERROR));
                }
                if let Some(s) = self.streams.get_mut(&stream) {
                    s.send_window += increment;
                    if s.send_window > i64::from(frame::MAX_WINDOW) {
                        return Err(FrameError::Stream(stream, Reason::FLOW_CONTROL_ERROR));
                    }
                    self.blocked.push(stream);
                }
                Ok(())
            }
        }
    }

    fn on_data(
        &mut self,
        id: u32,
        end_stream: bool,
        data: Bytes,
        flow_len: usize,
    ) -> Result<(), FrameError> {
        // Not yet opened (and not reset by sluice: see below).
        if id > self.last_id && !self.reset.contains(&id) {
            return Err(FrameError::Connection(Reason::PROTOCOL_ERROR));
        }
        self.recv_window -= flow_len as i64;
        if self.recv_window < 0 {
            return Err(FrameError::Connection(Reason::FLOW_CONTROL_ERROR));
        }
        // Padding is given back at once; data once read (see `release`).
        let padding = flow_len - data.len();
        self.recv_released += padding;
        let Some(s) = self.streams.get_mut(&id) else {
            // A stream closed: in flight when sluice reset it, ignored;
            // else a stream error (6.1).
            self.recv_released += data.len();
            return if self.reset.contains(&id) {
                Ok(())
            } else {
                Err(FrameError::Stream(id, Reason::STREAM_CLOSED))
            };
        };
        if !s.recv_open {
            // After the client's END_STREAM: a connection error, as h2
            // makes it (RFC 9113, 5.1, allows a stream error).
            self.recv_released += data.len();
            return Err(FrameError::Connection(Reason::STREAM_CLOSED));
        }
        let Some(inbox) = &s.inbox else {
            // Unreachable: a stream open for DATA has an inbox.
            self.recv_released += data.len();
            return Err(FrameError::Stream(id, Reason::STREAM_CLOSED));
        };
        s.recv_window -= flow_len as i64;
        if s.recv_window < 0 {
            self.recv_released += data.len();
            return Err(FrameError::Stream(id, Reason::FLOW_CONTROL_ERROR));
        }
        s.to_release += padding;
        s.received += data.len() as u64;
        if s.length
            .is_some_and(|n| s.received > n || (end_stream && s.received != n))
        {
            // A body longer or shorter than its content-length (8.1.1).
            self.recv_released += data.len();
            return Err(FrameError::Stream(id, Reason::PROTOCOL_ERROR));
        }
        let len = data.len();
        if !data.is_empty() && !inbox.push(data) {
            // Nobody reads it any more: given back at once.
            self.recv_released += len;
            s.to_release += len;
        }
        if end_stream {
            inbox.end(None);
            s.recv_open = false;
            self.finish_if_done(id);
        }
        Ok(())
    }

    fn on_headers(&mut self, id: u32, end_stream: bool, block: &[u8]) -> Result<(), FrameError> {
        // The block is decoded whatever becomes of it: the table is the
        // connection's.
        let mut fields = Fields::new(self.settings.max_header_list);
        self.decoder
            .decode(block, |name, value| fields.field(name, value))
            .map_err(|_| FrameError::Connection(Reason::COMPRESSION_ERROR))?;
        if fields.invalid() {
            return Err(FrameError::Connection(Reason::PROTOCOL_ERROR));
        }
        // h2 resets the stream of a malformed block before it looks at
        // the stream: so does sluice (a new stream then counts as used).
        if fields.malformed_block() {
            return Err(FrameError::Stream(id, Reason::PROTOCOL_ERROR));
        }
        // A stream sluice reset: what was in flight is ignored (5.4.2).
        if self.reset.contains(&id) {
            return Ok(());
        }
        if id.is_multiple_of(2) {
            return Err(FrameError::Connection(Reason::PROTOCOL_ERROR));
        }
        if id <= self.last_id {
            return self.on_trailers(id, end_stream, fields);
        }
        self.last_id = id;
        if self.phase != Phase::Open {
            // After GOAWAY: not served (RFC 9113, 6.8).
            return Err(FrameError::Stream(id, Reason::REFUSED_STREAM));
        }
        if self.streams.len() >= self.settings.max_streams as usize {
            return Err(FrameError::Stream(id, Reason::REFUSED_STREAM));
        }
        if fields.too_large() {
            // As h2 answers: 431, and nothing more of the stream is read.
            let mut block = Vec::new();
            self.encoder.status(431, &mut block);
            frame::put_headers(&mut self.write, id, &block, true, self.peer_max_frame);
            if !end_stream {
                frame::put_rst_stream(&mut self.write, id, Reason::REFUSED_STREAM);
            }
            self.remember(id, !end_stream);
            return Ok(());
        }
        let head = fields
            .finish()
            .map_err(|_| FrameError::Stream(id, Reason::PROTOCOL_ERROR))?;
        // A body's content-length is checked against its DATA (8.1.1);
        // several must agree.
        let mut length = None;
        for v in head.headers.get_all(CONTENT_LENGTH) {
            let n = parse_length(v).ok_or(FrameError::Stream(id, Reason::PROTOCOL_ERROR))?;
            if *length.get_or_insert(n) != n {
                return Err(FrameError::Stream(id, Reason::PROTOCOL_ERROR));
            }
        }
        if end_stream && length.is_some_and(|n| n != 0) {
            return Err(FrameError::Stream(id, Reason::PROTOCOL_ERROR));
        }
        let (inbox, body) = if end_stream {
            (None, RecvBody::empty())
        } else {
            let inbox = Arc::new(Inbox::default());
            (Some(inbox.clone()), RecvBody::new(inbox, length))
        };
        let mut req = Request::new(body);
        *req.method_mut() = head.method;
        *req.uri_mut() = head.uri;
        *req.version_mut() = Version::HTTP_2;
        *req.headers_mut() = head.headers;
        self.streams.insert(
            id,
            Stream {
                inbox,
                recv_open: !end_stream,
                to_release: 0,
                recv_window: i64::from(STREAM_WINDOW),
                length,
                received: 0,
                send: Send::Answering,
                send_window: self.peer_window,
            },
        );
        let answer = (self.service)(req);
        self.tasks.push(Task::Answer(id, answer));
        Ok(())
    }

    /// A header block on a stream already opened: its trailers, or a
    /// frame on a stream that is closed.
    fn on_trailers(&mut self, id: u32, end_stream: bool, fields: Fields) -> Result<(), FrameError> {
        let Some(s) = self.streams.get_mut(&id) else {
            return if self.reset.contains(&id) {
                Ok(())
            } else if self.closed.contains(&id) {
                Err(FrameError::Connection(Reason::STREAM_CLOSED))
            } else {
                // A stream the client skipped (5.1.1).
                Err(FrameError::Connection(Reason::PROTOCOL_ERROR))
            };
        };
        // Trailers end the stream (8.1); after its end, nothing more may
        // come (5.1: a connection error, as h2 has it).
        if !end_stream {
            return Err(FrameError::Stream(id, Reason::PROTOCOL_ERROR));
        }
        if !s.recv_open {
            return Err(FrameError::Connection(Reason::STREAM_CLOSED));
        }
        let trailers = fields
            .finish_trailers()
            .map_err(|_| FrameError::Stream(id, Reason::PROTOCOL_ERROR))?;
        if s.length.is_some_and(|n| n != s.received) {
            return Err(FrameError::Stream(id, Reason::PROTOCOL_ERROR));
        }
        if let Some(inbox) = &s.inbox {
            inbox.end(Some(trailers));
        }
        s.recv_open = false;
        self.finish_if_done(id);
        Ok(())
    }

    /// Resets stream `id` (a stream error): its work is dropped.
    fn reset_stream(&mut self, id: u32, reason: Reason) {
        frame::put_rst_stream(&mut self.write, id, reason);
        // A stream not yet opened counts as used once reset, as h2 counts
        // it: no later stream may take a lower number.
        if id % 2 == 1 {
            self.last_id = self.last_id.max(id);
        }
        if self.streams.contains_key(&id) {
            self.remove(id, Some(reason));
            self.cancel_tasks(id);
        }
        self.remember(id, true);
    }

    /// Takes stream `id` out; what its body holds is given back to the
    /// connection's window. `failed`: the body will not be whole.
    fn remove(&mut self, id: u32, failed: Option<Reason>) {
        if let Some(s) = self.streams.remove(&id)
            && let Some(inbox) = s.inbox
        {
            let failed = if s.recv_open {
                failed.or(Some(Reason::CANCEL))
            } else {
                failed
            };
            self.recv_released += inbox.detach(failed);
        }
    }

    /// Drops the futures and body of stream `id` (see [`Task::Gone`]).
    fn cancel_tasks(&mut self, id: u32) {
        for task in self.tasks.iter_mut() {
            let mine = matches!(task, Task::Answer(i, _) | Task::Body(i, _) if *i == id);
            if mine {
                *task = Task::Gone;
                self.gone += 1;
            }
        }
        // A task made Gone is never woken: when there are many, the set is
        // made again without them.
        if self.gone > 64 && self.gone > self.tasks.len() / 2 {
            let tasks = std::mem::take(&mut self.tasks);
            self.tasks = tasks
                .into_iter()
                .filter(|t| !matches!(t, Task::Gone))
                .collect();
            self.gone = 0;
        }
    }

    /// Notes a stream closed: reset by sluice (its frames in flight are
    /// ignored), or closed.
    fn remember(&mut self, id: u32, reset: bool) {
        let list = if reset {
            &mut self.reset
        } else {
            &mut self.closed
        };
        if list.len() == REMEMBERED {
            list.pop_front();
        }
        list.push_back(id);
    }

    /// Removes stream `id` once both sides are done. A response sent whole
    /// while the client is still sending leaves the stream open until the
    /// client ends it, what it sends given back at once once nobody reads
    /// it, as h2 does: RFC 9113 (8.1) allows a RST_STREAM with NO_ERROR
    /// there, but clients (curl among them) take that for an error and
    /// drop the response.
    fn finish_if_done(&mut self, id: u32) {
        let Some(s) = self.streams.get(&id) else {
            return;
        };
        if !matches!(s.send, Send::Done) || s.recv_open {
            return;
        }
        self.answered += 1;
        self.remove(id, None);
        self.remember(id, false);
    }

    /// A response is ready: its head written, its body begun.
    fn on_answer(&mut self, id: u32, resp: Response<B>, cx: &mut Context<'_>) {
        if !self.streams.contains_key(&id) {
            return;
        }
        let (mut parts, body) = resp.into_parts();
        strip_connection_fields(&mut parts.headers);
        if !parts.headers.contains_key(DATE) {
            parts.headers.insert(DATE, crate::front::date_value());
        }
        let end = body.is_end_stream();
        if !end
            && !parts.headers.contains_key(CONTENT_LENGTH)
            && let Some(n) = body.size_hint().exact()
        {
            parts.headers.insert(CONTENT_LENGTH, HeaderValue::from(n));
        }
        let mut block = Vec::with_capacity(128);
        self.encoder.status(parts.status.as_u16(), &mut block);
        self.encoder.fields(&parts.headers, &mut block);
        frame::put_headers(&mut self.write, id, &block, end, self.peer_max_frame);
        let Some(s) = self.streams.get_mut(&id) else {
            return;
        };
        if end {
            s.send = Send::Done;
            return self.finish_if_done(id);
        }
        s.send = Send::Body {
            body: Some(body),
            pending: None,
            end: false,
        };
        self.pump(id, cx);
    }

    /// Sends what stream `id`'s windows allow of its response body, and
    /// asks for its next frame when there is room.
    fn pump(&mut self, id: u32, cx: &mut Context<'_>) {
        loop {
            let Some(s) = self.streams.get_mut(&id) else {
                return;
            };
            let Send::Body { body, pending, end } = &mut s.send else {
                return;
            };
            if let Some(data) = pending {
                let room = s
                    .send_window
                    .min(self.send_window)
                    .min(self.peer_max_frame as i64);
                if room <= 0 && !data.is_empty() {
                    if self.send_window <= 0 {
                        self.blocked.push(id);
                    }
                    return;
                }
                let n = data.len().min(room.max(0) as usize);
                let chunk = data.split_to(n);
                let last = data.is_empty() && *end;
                frame::put_data_head(&mut self.write, id, n, last);
                self.write.extend_from_slice(&chunk);
                s.send_window -= n as i64;
                self.send_window -= n as i64;
                if !data.is_empty() {
                    continue;
                }
                *pending = None;
                if last {
                    s.send = Send::Done;
                    return self.finish_if_done(id);
                }
            }
            if self.write.len() - self.written > WRITE_HIGH {
                // Asked for again once written (see `poll`).
                self.blocked.push(id);
                return;
            }
            let Some(mut b) = body.take() else {
                return;
            };
            match Pin::new(&mut b).poll_frame(cx) {
                Poll::Pending => {
                    self.tasks.push(Task::Body(id, b));
                    return;
                }
                Poll::Ready(frame) => {
                    if let Send::Body { body, .. } = &mut s.send {
                        *body = Some(b);
                    }
                    self.on_body_frame(id, frame);
                }
            }
        }
    }

    /// A response body's frame: data to send, trailers, the end, or an
    /// error (the stream is reset).
    fn on_body_frame(&mut self, id: u32, frame: Option<Result<BodyFrame<Bytes>, B::Error>>) {
        let Some(s) = self.streams.get_mut(&id) else {
            return;
        };
        let Send::Body { body, pending, end } = &mut s.send else {
            return;
        };
        match frame {
            None => {
                frame::put_data_head(&mut self.write, id, 0, true);
                s.send = Send::Done;
                self.finish_if_done(id);
            }
            Some(Err(e)) => {
                tracing::debug!(stream = id, error = %e, "response body failed; stream reset");
                self.reset_stream(id, Reason::INTERNAL_ERROR);
            }
            Some(Ok(frame)) => match frame.into_data() {
                Ok(data) => {
                    *end = body.as_ref().is_some_and(|b| b.is_end_stream());
                    if data.is_empty() && !*end {
                        return;
                    }
                    *pending = Some(data);
                }
                Err(frame) => {
                    if let Ok(trailers) = frame.into_trailers() {
                        let mut block = Vec::new();
                        self.encoder.fields(&trailers, &mut block);
                        frame::put_headers(&mut self.write, id, &block, true, self.peer_max_frame);
                        s.send = Send::Done;
                        self.finish_if_done(id);
                    }
                }
            },
        }
    }

    /// Gives the client window back for what has been read: a stream's
    /// once a quarter of its window has been, the connection's once half.
    /// (No client waits for it: what it has not been given back, it has
    /// sent, and is read.)
    fn release(&mut self, cx: &mut Context<'_>) {
        for (&id, s) in &mut self.streams {
            if let Some(inbox) = &s.inbox {
                let n = inbox.take_released(cx.waker());
                self.recv_released += n;
                s.to_release += n;
            }
            if s.recv_open && s.to_release >= STREAM_WINDOW as usize / 4 {
                let inc = std::mem::take(&mut s.to_release);
                frame::put_window_update(&mut self.write, id, inc as u32);
                s.recv_window += inc as i64;
            }
        }
        if self.recv_released >= CONN_WINDOW as usize / 2 {
            let inc = std::mem::take(&mut self.recv_released);
            frame::put_window_update(&mut self.write, 0, inc as u32);
            self.recv_window += inc as i64;
        }
    }

    /// Writes what is waiting.
    fn poll_write(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        while self.written < self.write.len() {
            let n = ready!(Pin::new(&mut self.io).poll_write(cx, &self.write[self.written..]))?;
            if n == 0 {
                return Poll::Ready(Err(io::ErrorKind::WriteZero.into()));
            }
            self.written += n;
        }
        self.write.clear();
        self.written = 0;
        Pin::new(&mut self.io).poll_flush(cx)
    }

    fn poll_inner(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), ConnError>> {
        loop {
            let mut progress = false;
            let reading =
                self.phase != Phase::Closing && !self.eof && self.waiting_to_write() <= WRITE_HIGH;
            if reading {
                match self.poll_read(cx) {
                    Poll::Ready(Ok(0)) => {
                        // The client has gone: nothing of its streams can end.
                        self.eof = true;
                        self.close_all(Reason::CANCEL);
                        progress = true;
                    }
                    Poll::Ready(Ok(_)) => {
                        self.on_bytes();
                        progress = true;
                    }
                    Poll::Ready(Err(e)) => return Poll::Ready(Err(e.into())),
                    Poll::Pending => {}
                }
            }
            while let Poll::Ready(Some((id, event))) = self.tasks.poll_next_unpin(cx) {
                progress = true;
                match event {
                    Event::Answered(resp) => self.on_answer(id, resp, cx),
                    Event::Frame(body, frame) => {
                        if let Some(Stream {
                            send: Send::Body { body: slot, .. },
                            ..
                        }) = self.streams.get_mut(&id)
                        {
                            *slot = Some(body);
                            self.on_body_frame(id, frame);
                            self.pump(id, cx);
                        }
                    }
                    Event::Gone => self.gone = self.gone.saturating_sub(1),
                }
            }
            if self.waiting_to_write() <= WRITE_HIGH && !self.blocked.is_empty() {
                let mut blocked = std::mem::take(&mut self.blocked);
                blocked.sort_unstable();
                blocked.dedup();
                for id in blocked {
                    self.pump(id, cx);
                }
            }
            self.release(cx);
            if self.waiting_to_write() > 0 {
                match self.poll_write(cx) {
                    Poll::Ready(Ok(())) => progress = true,
                    Poll::Ready(Err(e)) => return Poll::Ready(Err(e.into())),
                    Poll::Pending => {}
                }
            }
            let finished = match self.phase {
                Phase::Closing => true,
                Phase::Draining => self.streams.is_empty(),
                _ => false,
            };
            if finished && self.waiting_to_write() == 0 {
                let _ = Pin::new(&mut self.io).poll_shutdown(cx);
                return Poll::Ready(match self.error.take() {
                    Some(e) => Err(e),
                    None => Ok(()),
                });
            }
            if !progress {
                // An idle connection keeps no buffers (it may wait for a
                // long time, and there may be many such).
                if self.streams.is_empty() && self.read.is_empty() && self.write.is_empty() {
                    give_back(
                        std::mem::take(&mut self.read),
                        std::mem::take(&mut self.write),
                    );
                }
                return Poll::Pending;
            }
        }
    }
}

impl<I, S, F, B> Future for Connection<I, S, F, B>
where
    I: AsyncRead + AsyncWrite + Unpin,
    S: FnMut(Request<RecvBody>) -> F + Unpin,
    F: Future<Output = Response<B>> + Unpin,
    B: Body<Data = Bytes> + Unpin,
    B::Error: std::fmt::Display,
{
    type Output = Result<(), ConnError>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        self.get_mut().poll_inner(cx)
    }
}

thread_local! {
    /// Buffers of this thread's idle HTTP/2 connections, for the next busy
    /// one: an idle connection holds none, and a busy one costs no
    /// allocation to get them.
    static SPARE: RefCell<Vec<(BytesMut, Vec<u8>)>> = const { RefCell::new(Vec::new()) };
}

/// Spare buffers kept per thread; above it they are freed.
const MAX_SPARE: usize = 64;

/// A read and a write buffer, spare or new.
fn lend() -> (BytesMut, Vec<u8>) {
    SPARE
        .try_with(|spare| spare.borrow_mut().pop())
        .ok()
        .flatten()
        .unwrap_or_else(|| (BytesMut::with_capacity(16 * 1024), Vec::new()))
}

/// Keeps an idle connection's (empty) buffers for the next busy one.
fn give_back(mut read: BytesMut, mut write: Vec<u8>) {
    read.clear();
    write.clear();
    if read.capacity() == 0 || read.capacity() > 64 * 1024 || write.capacity() > 64 * 1024 {
        return;
    }
    // At the thread's end the spares may be gone already.
    let _ = SPARE.try_with(|spare| {
        let mut spare = spare.borrow_mut();
        if spare.len() < MAX_SPARE {
            spare.push((read, write));
        }
    });
}

/// A `content-length` value: digits only (as h2 reads it).
fn parse_length(v: &HeaderValue) -> Option<u64> {
    let b = v.as_bytes();
    if b.is_empty() || b.len() > 19 || !b.iter().all(u8::is_ascii_digit) {
        return None;
    }
    std::str::from_utf8(b).ok()?.parse().ok()
}

/// Fields HTTP/2 has no use for (RFC 9113, 8.2.2), taken out of a
/// response as hyper does: `Connection` and those it names, and the
/// other connection-specific ones.
fn strip_connection_fields(headers: &mut HeaderMap) {
    for name in [TRANSFER_ENCODING, UPGRADE, TE] {
        headers.remove(name);
    }
    headers.remove("keep-alive");
    headers.remove("proxy-connection");
    if let Some(named) = headers.remove(CONNECTION)
        && let Ok(named) = named.to_str()
    {
        for name in named.split(',') {
            headers.remove(name.trim());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::http2::frame::{flag, kind};
    use http_body_util::{BodyExt, Full};
    use tokio::io::{AsyncReadExt, AsyncWriteExt, DuplexStream};

    const SETTINGS: Settings = Settings {
        max_streams: 100,
        max_header_list: 16 * 1024,
    };

    /// A client speaking raw frames to a connection that answers every
    /// request with `200 ok` at once, never reading its body.
    async fn start() -> DuplexStream {
        let (client, server) = tokio::io::duplex(1 << 16);
        let service = |_req: Request<RecvBody>| {
            Box::pin(async { Response::new(Full::new(Bytes::from_static(b"ok"))) })
        };
        tokio::spawn(Connection::new(server, SETTINGS, service));
        let mut hello = frame::PREFACE.to_vec();
        frame::put_settings(&mut hello, &[]);
        let mut client = client;
        client.write_all(&hello).await.unwrap();
        client
    }

    /// A POST's header block: literals without indexing.
    fn post_block(length: usize) -> Vec<u8> {
        let mut b = vec![0x83, 0x86, 0x84];
        let len = length.to_string();
        b.push(0x0f);
        b.push(0x0d); // content-length: static index 28, as 15 + 13
        b.push(len.len() as u8);
        b.extend_from_slice(len.as_bytes());
        b
    }

    /// Reads frames until `until` says stop (or the connection ends); each
    /// frame's head and payload. Panics if the server goes quiet first.
    async fn read_until(
        io: &mut DuplexStream,
        buf: &mut Vec<u8>,
        mut until: impl FnMut(&Head, &[u8]) -> bool,
    ) -> Vec<(Head, Vec<u8>)> {
        let mut frames = Vec::new();
        loop {
            while let Some(head) = Head::read(buf) {
                if buf.len() < frame::HEAD_LEN + head.len {
                    break;
                }
                let payload = buf[frame::HEAD_LEN..frame::HEAD_LEN + head.len].to_vec();
                buf.drain(..frame::HEAD_LEN + head.len);
                let stop = until(&head, &payload);
                frames.push((head, payload));
                if stop {
                    return frames;
                }
            }
            let mut chunk = [0u8; 16 * 1024];
            // A server that never sends what the test waits for fails the
            // test rather than hanging it.
            let read =
                tokio::time::timeout(std::time::Duration::from_secs(10), io.read(&mut chunk));
            match read.await.expect("the server sent nothing for 10 s") {
                Ok(0) | Err(_) => return frames,
                Ok(n) => buf.extend_from_slice(&chunk[..n]),
            }
        }
    }

    /// A client whose request body the answer did not need may still send
    /// all of it: the window comes back, no stream or connection error.
    #[tokio::test]
    async fn a_body_nobody_reads_is_taken_to_its_end() {
        let mut c = start().await;
        const N: usize = 3 << 20;
        let mut out = Vec::new();
        frame::put_headers(&mut out, 1, &post_block(N), false, 16_384);
        c.write_all(&out).await.unwrap();
        let mut buf = Vec::new();
        // The answer comes whole.
        read_until(&mut c, &mut buf, |h, _| {
            h.kind == kind::DATA && h.flags & flag::END_STREAM != 0
        })
        .await;
        // The client's windows: 1 MiB each once the server's SETTINGS and
        // WINDOW_UPDATE are in.
        let (mut stream_window, mut conn_window) =
            (i64::from(STREAM_WINDOW), i64::from(CONN_WINDOW));
        let mut sent = 0;
        let chunk = vec![b'x'; 16_384];
        while sent < N {
            while sent < N
                && stream_window >= chunk.len() as i64
                && conn_window >= chunk.len() as i64
            {
                let n = chunk.len().min(N - sent);
                let mut f = Vec::new();
                frame::put_data_head(&mut f, 1, n, sent + n == N);
                f.extend_from_slice(&chunk[..n]);
                c.write_all(&f).await.unwrap();
                sent += n;
                stream_window -= n as i64;
                conn_window -= n as i64;
            }
            if sent == N {
                break;
            }
            let frames = read_until(&mut c, &mut buf, |h, _| h.kind == kind::WINDOW_UPDATE).await;
            for (h, p) in frames {
                assert_ne!(h.kind, kind::RST_STREAM, "stream reset");
                assert_ne!(h.kind, kind::GOAWAY, "connection ended");
                if h.kind == kind::WINDOW_UPDATE {
                    let inc = i64::from(u32::from_be_bytes([p[0], p[1], p[2], p[3]]));
                    if h.stream == 0 {
                        conn_window += inc;
                    } else {
                        stream_window += inc;
                    }
                }
            }
        }
        // Then a PING is answered: the connection is well.
        let mut ping = Vec::new();
        frame::put_head(&mut ping, 8, kind::PING, 0, 0);
        ping.extend_from_slice(&[9; 8]);
        c.write_all(&ping).await.unwrap();
        let frames = read_until(&mut c, &mut buf, |h, _| h.kind == kind::PING).await;
        assert!(
            frames
                .iter()
                .all(|(h, _)| h.kind != kind::RST_STREAM && h.kind != kind::GOAWAY)
        );
        assert_eq!(frames.last().map(|(h, _)| h.flags), Some(flag::ACK));
    }

    /// Opening streams and resetting them, over and over, ends the
    /// connection with ENHANCE_YOUR_CALM.
    #[tokio::test]
    async fn rapid_reset_ends_the_connection() {
        let (client, server) = tokio::io::duplex(1 << 20);
        // Never answered: every stream is still worked on when reset.
        let service =
            |_req: Request<RecvBody>| Box::pin(std::future::pending::<Response<Full<Bytes>>>());
        tokio::spawn(Connection::new(server, SETTINGS, service));
        let mut c = client;
        let mut out = frame::PREFACE.to_vec();
        frame::put_settings(&mut out, &[]);
        for i in 0..(RESETS_ALLOWED as u32 + 10) {
            let id = 2 * i + 1;
            frame::put_headers(&mut out, id, &[0x82, 0x86, 0x84], false, 16_384);
            frame::put_rst_stream(&mut out, id, Reason::CANCEL);
        }
        c.write_all(&out).await.unwrap();
        let mut buf = Vec::new();
        let frames = read_until(&mut c, &mut buf, |h, _| h.kind == kind::GOAWAY).await;
        let (_, payload) = frames.last().expect("a GOAWAY");
        assert_eq!(&payload[4..8], &Reason::ENHANCE_YOUR_CALM.0.to_be_bytes());
    }

    /// The own server's answer reaches h2's client whole, body included.
    #[tokio::test]
    async fn h2_client_reads_an_answer_whole() {
        let (client, server) = tokio::io::duplex(1 << 16);
        let service = |req: Request<RecvBody>| {
            Box::pin(async move {
                let body = req
                    .into_body()
                    .collect()
                    .await
                    .map(|b| b.to_bytes())
                    .unwrap_or_default();
                Response::new(Full::new(body))
            })
        };
        tokio::spawn(Connection::new(server, SETTINGS, service));
        let (mut h2, conn) = h2::client::handshake(client).await.unwrap();
        tokio::spawn(conn);
        let req = Request::post("http://a/echo").body(()).unwrap();
        let (answer, mut send) = h2.send_request(req, false).unwrap();
        send.send_data(Bytes::from(vec![7u8; 200_000]), true)
            .unwrap();
        let mut body = answer.await.unwrap().into_body();
        let mut got = 0;
        while let Some(data) = body.data().await {
            let data = data.unwrap();
            got += data.len();
            let _ = body.flow_control().release_capacity(data.len());
        }
        assert_eq!(got, 200_000);
    }
}
