//! Property tests of the own upstream client's reading of answers: generated
//! heads against httparse, and generated whole answers (framing spelled
//! every way, the bytes split across reads anywhere) against hyper's client
//! reading the same bytes from a real socket.

use std::future::{Future, poll_fn};
use std::pin::pin;
use std::sync::Arc;

use bytes::{Bytes, BytesMut};
use http::header::HeaderMap;
use http_body_util::{BodyExt, Empty};
use hyper_util::rt::TokioIo;
use proptest::collection::vec;
use proptest::prelude::*;
use proptest::sample::select;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Notify;

use super::{Conn, parse_head, send};
use crate::proxy::plain_head;

fn words(list: &'static [&'static str]) -> impl Strategy<Value = Vec<u8>> {
    select(list).prop_map(|w| w.as_bytes().to_vec())
}

/// A byte of a class some parser treats apart.
fn odd_byte() -> BoxedStrategy<u8> {
    prop_oneof![
        select(&b" \t\r\n:;,\"()/\\"[..]),
        Just(0u8),
        Just(0x7f),
        0x80u8..=0xff,
        any::<u8>(),
    ]
    .boxed()
}

fn status_line() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        12 => words(&["HTTP/1.1 200 OK\r\n", "HTTP/1.1 404 Not Found\r\n", "HTTP/1.0 200 OK\r\n", "HTTP/1.1 500 \r\n"]),
        2 => words(&["HTTP/1.1 204 No Content\r\n", "HTTP/1.1 304 Not Modified\r\n", "HTTP/1.0 304 x\r\n"]),
        1 => words(&[
            "HTTP/1.1 200\r\n", "HTTP/1.1 099 x\r\n", "HTTP/1.1 2000 OK\r\n", "HTTP/1.1 20 OK\r\n",
            "HTTP/2.0 200 OK\r\n", "http/1.1 200 OK\r\n", "HTTP/1.1 200 OK\n", "HTTP/1.1  200 OK\r\n",
            "HTTP/1.1 200 O\u{e9}\r\n", "HTTP/1.1 200 O\u{1}K\r\n", "HTTP/1.1 999 x\r\n",
        ]),
    ]
}

fn field_name() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        8 => words(&["Server", "Date", "Content-Type", "X-A", "Set-Cookie", "Connection", "Keep-Alive", "X-RateLimit-Remaining"]),
        2 => vec(select(&b"abcXYZ-_!~09"[..]), 1..12),
        1 => vec(prop_oneof![8 => select(&b"abcXYZ-"[..]), 1 => odd_byte()], 0..8),
    ]
}

fn field_value() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        8 => vec(prop_oneof![20 => 0x20u8..=0x7e, 1 => Just(b'\t')], 0..24),
        1 => vec(prop_oneof![10 => 0x20u8..=0x7e, 1 => odd_byte()], 0..24),
        1 => words(&["a\r\n folded", "a\rb", "a\nb", "keep-alive", "close", "x, close"]),
    ]
}

/// `Name: value` and a line end, now and then spelled otherwise.
fn field() -> impl Strategy<Value = Vec<u8>> {
    (
        field_name(),
        prop_oneof![20 => Just(b": ".to_vec()), 1 => words(&[":", " : ", "", ":\t"])],
        field_value(),
        prop_oneof![30 => Just(b"\r\n".to_vec()), 1 => words(&["\n", " \r\n", "\r"])],
    )
        .prop_map(|(n, s, v, e)| [n, s, v, e].concat())
}

/// Answer heads (no body) for the head parsers alone.
fn answer_head() -> impl Strategy<Value = Vec<u8>> {
    (
        status_line(),
        prop_oneof![12 => vec(field(), 0..8), 1 => vec(field(), 95..105)],
        prop_oneof![20 => Just(b"\r\n".to_vec()), 1 => words(&["\n", "", "\r"])],
        vec(any::<u8>(), 0..8),
    )
        .prop_map(|(line, fields, end, extra)| [line, fields.concat(), end, extra].concat())
}

/// What httparse (as hyper's client sets it) reads: length, code, HTTP/1.0,
/// fields; `Err` for a refusal, `Ok(None)` while it is not all there.
type Reading = (usize, u16, bool, Vec<(Vec<u8>, Vec<u8>)>);

fn httparse_reads(buf: &[u8]) -> Result<Option<Reading>, httparse::Error> {
    let mut slots = vec![httparse::EMPTY_HEADER; 100];
    let mut resp = httparse::Response::new(&mut slots);
    match httparse::ParserConfig::default().parse_response(&mut resp, buf)? {
        httparse::Status::Partial => Ok(None),
        httparse::Status::Complete(len) => Ok(Some((
            len,
            resp.code.unwrap_or_default(),
            resp.version == Some(0),
            resp.headers
                .iter()
                .map(|h| (h.name.as_bytes().to_vec(), h.value.to_vec()))
                .collect(),
        ))),
    }
}

/// The quick parser and `parse_head` against httparse, for `head` and each
/// of its beginnings.
fn check_head(head: &[u8]) -> Result<(), TestCaseError> {
    let step = (head.len() / 300).max(1);
    for cut in (0..head.len()).step_by(step).chain([head.len()]) {
        let buf = &head[..cut];
        let want = httparse_reads(buf);
        let mut read = plain_head::ReadFields::new();
        if let Some(quick) = plain_head::parse(buf, 100, &mut read) {
            let fields = read.iter().map(|(n, v)| (n.to_vec(), v.to_vec())).collect();
            let quick = (quick.len, quick.code, quick.http10, fields);
            prop_assert_eq!(Ok(Some(quick)), want.clone());
        }
        let mut bytes = BytesMut::from(buf);
        match (parse_head(&mut bytes), want) {
            (Ok(None), Ok(None)) => prop_assert_eq!(&bytes[..], buf),
            (Ok(Some((resp, _, fields))), Ok(Some((len, code, http10, all)))) => {
                prop_assert_eq!(resp.status().as_u16(), code);
                prop_assert_eq!(resp.version() == http::Version::HTTP_10, http10);
                prop_assert_eq!(&bytes[..], &buf[len..]);
                // The answer's own fields, the connection's left out.
                let kept: Vec<_> = all
                    .into_iter()
                    .filter(|(n, v)| !crate::proxy::forward::lone_hop(n, v))
                    .collect();
                let got: Vec<_> = match &fields {
                    Some(f) => f.iter().map(|(n, v)| (n.to_vec(), v.to_vec())).collect(),
                    None => resp
                        .headers()
                        .iter()
                        .map(|(n, v)| (n.as_str().as_bytes().to_vec(), v.as_bytes().to_vec()))
                        .collect(),
                };
                if fields.is_some() {
                    prop_assert_eq!(got, kept);
                } else {
                    let lower: Vec<_> = kept
                        .into_iter()
                        .map(|(n, v)| (n.to_ascii_lowercase(), v))
                        .collect();
                    prop_assert_eq!(got.len(), lower.len());
                }
            }
            // A code out of range is refused after httparse took it.
            (Err(super::H1Error::Framing(_)), Ok(Some((_, code, ..)))) => {
                prop_assert!(!(100..=999).contains(&code))
            }
            (Err(super::H1Error::Head(e)), Err(want)) => prop_assert_eq!(e, want),
            (got, want) => {
                let got = got.map(|o| o.map(|(r, ..)| r.status()));
                return Err(TestCaseError::fail(format!("{got:?} / {want:?}")));
            }
        }
    }
    Ok(())
}

/// A whole answer and how its bytes are split across reads.
#[derive(Debug, Clone)]
struct Case {
    head_only: bool,
    bytes: Vec<u8>,
    /// Where the bytes are cut: each piece is read on its own.
    cuts: Vec<usize>,
}

impl Case {
    fn pieces(&self) -> Vec<&[u8]> {
        let mut cuts: Vec<usize> = self.cuts.iter().map(|&c| c.min(self.bytes.len())).collect();
        cuts.sort_unstable();
        cuts.dedup();
        let mut pieces = Vec::new();
        let mut from = 0;
        for cut in cuts.into_iter().chain([self.bytes.len()]) {
            if cut > from {
                pieces.push(&self.bytes[from..cut]);
                from = cut;
            }
        }
        pieces
    }
}

fn content_length(real: usize) -> impl Strategy<Value = Vec<u8>> {
    let real = real.to_string();
    prop_oneof![
        8 => Just(real.clone().into_bytes()),
        1 => Just(format!("{real}, {real}").into_bytes()),
        1 => Just(format!("{real},{real}").into_bytes()),
        1 => Just(format!("0000000000000000000{real}").into_bytes()),
        1 => Just(format!("00{real}").into_bytes()),
        1 => Just(format!("+{real}").into_bytes()),
        1 => Just(format!("{real}, 1{real}").into_bytes()),
        1 => Just(format!("{real},").into_bytes()),
        2 => words(&[
            "0", "3", "-1", "0x5", "5 5", "", "1e2", "18446744073709551615",
            "18446744073709551614", "18446744073709551613", "18446744073709551616",
            "99999999999999999999", "\u{e9}", "\u{665}",
        ]),
    ]
}

fn transfer_encoding() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        6 => Just(b"chunked".to_vec()),
        1 => words(&[
            "Chunked", "gzip, chunked", "chunked, gzip", "identity", "chunked,", " chunked",
            "gzip,chunked", "chunked, chunked", "\u{e9}, chunked", "x\u{80}, chunked", "",
        ]),
    ]
}

/// A chunk's size line for `size` bytes, in one of its spellings.
fn size_line(size: usize) -> impl Strategy<Value = Vec<u8>> {
    let lower = format!("{size:x}");
    let upper = format!("{size:X}");
    (
        prop_oneof![
            8 => Just(lower.clone()),
            2 => Just(upper),
            1 => (1usize..20).prop_map(move |n| format!("{}{lower}", "0".repeat(n))),
            1 => words(&["", " ", "g", "-1", "ffffffffffffffff", "10000000000000000", "1 1", "0x1"])
                .prop_map(|w| String::from_utf8(w).unwrap_or_default()),
        ],
        prop_oneof![
            10 => Just(""),
            1 => select(&[";a=b", "; a", " ;a", "\t", " ", ";a\nb", ";\u{e9}", ";a=\"x;y\""][..]),
        ],
        prop_oneof![30 => Just("\r\n"), 1 => select(&["\n", "\r", ""][..])],
    )
        .prop_map(|(digits, ext, end)| format!("{digits}{ext}{end}").into_bytes())
}

/// A chunked encoding of `body` (in up to four chunks), its trailers, its end.
fn chunked(body: Vec<u8>) -> impl Strategy<Value = Vec<u8>> {
    let n = body.len();
    (
        vec(0..=n, 0..4),
        prop_oneof![20 => Just(b"\r\n".to_vec()), 1 => words(&["\n", "", "\r\r\n"])],
        prop_oneof![6 => Just(Vec::new()), 2 => vec(field(), 1..4).prop_map(|f| f.concat())],
        prop_oneof![20 => Just(b"\r\n".to_vec()), 1 => words(&["\n", "", "\r", "x"])],
    )
        .prop_flat_map(move |(mut cuts, data_end, trailers, end)| {
            cuts.push(0);
            cuts.push(n);
            cuts.sort_unstable();
            cuts.dedup();
            let chunks: Vec<Vec<u8>> = cuts.windows(2).map(|w| body[w[0]..w[1]].to_vec()).collect();
            let lines: Vec<_> = chunks.iter().map(|c| size_line(c.len())).collect();
            (
                Just(chunks),
                lines,
                size_line(0),
                Just(data_end),
                Just(trailers),
                Just(end),
            )
        })
        .prop_map(|(chunks, lines, last, data_end, trailers, end)| {
            let mut out = Vec::new();
            for (chunk, line) in chunks.iter().zip(lines) {
                out.extend_from_slice(&line);
                out.extend_from_slice(chunk);
                out.extend_from_slice(&data_end);
            }
            out.extend_from_slice(&last);
            out.extend_from_slice(&trailers);
            out.extend_from_slice(&end);
            out
        })
}

/// Which framing fields an answer gets (its body is sent to suit the first).
#[derive(Debug, Clone)]
enum Frame {
    Length(Vec<Vec<u8>>),
    Chunked(Vec<Vec<u8>>),
    Both(Vec<u8>, Vec<u8>),
    None,
}

fn answer() -> impl Strategy<Value = Case> {
    let body = vec(any::<u8>(), 0..40);
    (body, any::<bool>())
        .prop_flat_map(|(body, chunk_it)| {
            let n = body.len();
            let frame = prop_oneof![
                6 => vec(content_length(n), 1..3).prop_map(Frame::Length),
                6 => vec(transfer_encoding(), 1..3).prop_map(Frame::Chunked),
                1 => (transfer_encoding(), content_length(n)).prop_map(|(t, l)| Frame::Both(t, l)),
                1 => Just(Frame::None),
            ];
            let encoded = if chunk_it {
                chunked(body.clone()).boxed()
            } else {
                Just(body.clone()).boxed()
            };
            (
                status_line(),
                prop_oneof![10 => Just(Vec::new()), 1 => words(&["HTTP/1.1 100 Continue\r\n\r\n", "HTTP/1.1 103 Early\r\nLink: </a>\r\n\r\n"])],
                vec(field(), 0..4),
                frame,
                prop_oneof![3 => Just(Vec::new()), 1 => words(&["Connection: close\r\n", "Connection: keep-alive\r\n"])],
                Just(body),
                encoded,
                prop_oneof![6 => Just(Vec::new()), 1 => Just(b"HTTP/1.1 200 OK\r\nContent-Length: 4\r\n\r\nnext".to_vec())],
                prop_oneof![10 => Just(false), 1 => Just(true)],
                prop_oneof![
                    3 => Just(Vec::new()),
                    3 => vec(0usize..300, 1..6),
                    1 => Just((0..300).collect::<Vec<_>>()),
                ],
            )
        })
        .prop_map(
            |(line, interim, fields, frame, conn, body, encoded, next, head_only, cuts)| {
                let mut head = interim;
                head.extend_from_slice(&line);
                head.extend_from_slice(&fields.concat());
                head.extend_from_slice(&conn);
                let chunked_body = match &frame {
                    Frame::Length(values) => {
                        for v in values {
                            head.extend_from_slice(&[b"Content-Length: ", &v[..], b"\r\n"].concat());
                        }
                        false
                    }
                    Frame::Chunked(values) => {
                        for v in values {
                            head.extend_from_slice(&[b"Transfer-Encoding: ", &v[..], b"\r\n"].concat());
                        }
                        true
                    }
                    Frame::Both(t, l) => {
                        head.extend_from_slice(&[b"Transfer-Encoding: ", &t[..], b"\r\nContent-Length: ", &l[..], b"\r\n"].concat());
                        true
                    }
                    Frame::None => false,
                };
                head.extend_from_slice(b"\r\n");
                // The body as its framing wants it, mostly.
                let body = if chunked_body { encoded } else { body };
                let bytes = [head, body, next].concat();
                Case { head_only, bytes, cuts }
            },
        )
}

/// What a client made of an answer: its status, body and trailers, or that
/// it failed.
#[derive(Debug, PartialEq)]
struct Got {
    status: u16,
    body: Vec<u8>,
    trailers: Option<HeaderMap>,
}

const GET: &[u8] = b"GET / HTTP/1.1\r\nHost: up\r\n\r\n";
const HEAD: &[u8] = b"HEAD / HTTP/1.1\r\nHost: up\r\n\r\n";

/// A raw upstream on a socket of its own: it reads the request, then writes
/// each piece when `turn` says the client wants more, then closes.
async fn upstream(listener: TcpListener, pieces: Vec<Vec<u8>>, turn: Option<Arc<Notify>>) {
    let Ok((mut stream, _)) = listener.accept().await else {
        return;
    };
    let mut request = Vec::new();
    while !request.ends_with(b"\r\n\r\n") {
        let mut byte = [0u8; 1];
        if stream.read(&mut byte).await.unwrap_or(0) == 0 {
            return;
        }
        request.push(byte[0]);
    }
    for piece in pieces {
        if let Some(turn) = &turn {
            turn.notified().await;
        }
        if stream.write_all(&piece).await.is_err() {
            return;
        }
    }
    if let Some(turn) = &turn {
        turn.notified().await;
    }
    let _ = stream.shutdown().await;
    // Open until the client is done with it.
    let mut rest = Vec::new();
    let _ = stream.read_to_end(&mut rest).await;
}

/// A client's socket to `addr`, closed with a reset: long runs would
/// otherwise use up the ports in TIME_WAIT.
async fn connect(addr: std::net::SocketAddr) -> Result<TcpStream, String> {
    let stream = TcpStream::connect(addr).await.map_err(|e| e.to_string())?;
    stream.set_zero_linger().map_err(|e| e.to_string())?;
    Ok(stream)
}

/// Polls `fut`, telling the upstream to send its next piece each time it
/// waits: so each piece is read apart.
async fn turned<T>(turn: &Notify, fut: impl Future<Output = T>) -> T {
    let mut fut = pin!(fut);
    poll_fn(|cx| {
        let polled = fut.as_mut().poll(cx);
        if polled.is_pending() {
            turn.notify_one();
        }
        polled
    })
    .await
}

async fn sluice_reads(case: &Case) -> Result<Got, String> {
    let listener = TcpListener::bind("127.0.0.1:0")
        .await
        .map_err(|e| e.to_string())?;
    let addr = listener.local_addr().map_err(|e| e.to_string())?;
    let turn = Arc::new(Notify::new());
    let pieces = case.pieces().into_iter().map(<[u8]>::to_vec).collect();
    let server = tokio::spawn(upstream(listener, pieces, Some(turn.clone())));
    let stream = connect(addr).await?;
    let mut conn = Conn::new(stream);
    let request = if case.head_only { HEAD } else { GET };
    let got = async {
        let (resp, mut reader) = turned(&turn, send(&mut conn, request, case.head_only))
            .await
            .map_err(|e| e.to_string())?;
        let mut body = Vec::new();
        let mut trailers = None;
        while let Some(frame) = turned(&turn, poll_fn(|cx| reader.poll_frame(&mut conn, cx))).await
        {
            match frame.map_err(|e| e.to_string())?.into_data() {
                Ok(data) => body.extend_from_slice(&data),
                Err(frame) => trailers = frame.into_trailers().ok().filter(|t| !t.is_empty()),
            }
        }
        Ok(Got {
            status: resp.status().as_u16(),
            body,
            trailers,
        })
    }
    .await;
    // The upstream may still wait for its turn to send more.
    server.abort();
    got
}

async fn hyper_reads(case: &Case) -> Result<Got, String> {
    let listener = TcpListener::bind("127.0.0.1:0")
        .await
        .map_err(|e| e.to_string())?;
    let addr = listener.local_addr().map_err(|e| e.to_string())?;
    let server = tokio::spawn(upstream(listener, vec![case.bytes.clone()], None));
    let stream = connect(addr).await?;
    let got = async {
        let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
            .await
            .map_err(|e| e.to_string())?;
        tokio::spawn(conn);
        let method = if case.head_only {
            http::Method::HEAD
        } else {
            http::Method::GET
        };
        let req = http::Request::builder()
            .method(method)
            .uri("/")
            .header("host", "up")
            .body(Empty::<Bytes>::new())
            .map_err(|e| e.to_string())?;
        let resp = sender.send_request(req).await.map_err(|e| e.to_string())?;
        let status = resp.status().as_u16();
        let collected = resp
            .into_body()
            .collect()
            .await
            .map_err(|e| e.to_string())?;
        let trailers = collected.trailers().filter(|t| !t.is_empty()).cloned();
        let body = collected.to_bytes().to_vec();
        Ok(Got {
            status,
            body,
            trailers,
        })
    }
    .await;
    server.abort();
    got
}

/// Both clients over `case`: the same verdict, the same status, body bytes
/// and trailers.
fn check_answer(case: &Case) -> Result<(), TestCaseError> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| TestCaseError::fail(e.to_string()))?;
    // A hang is a failure too, not a test run that never ends.
    let limit = std::time::Duration::from_secs(20);
    let both = async { (sluice_reads(case).await, hyper_reads(case).await) };
    let (ours, theirs) = runtime
        .block_on(async { tokio::time::timeout(limit, both).await })
        .map_err(|_| TestCaseError::fail("no verdict in 20 s"))?;
    match (&ours, &theirs) {
        (Ok(a), Ok(b)) => prop_assert_eq!(a, b, "{:?}", String::from_utf8_lossy(&case.bytes)),
        (Err(_), Err(_)) => {}
        _ => {
            return Err(TestCaseError::fail(format!(
                "sluice {ours:?}\nhyper {theirs:?}\n{:?}",
                String::from_utf8_lossy(&case.bytes)
            )));
        }
    }
    Ok(())
}

proptest! {
    #[test]
    fn an_answer_head_is_read_as_httparse_reads_it(head in answer_head()) {
        check_head(&head)?;
    }
}

proptest! {
    // Two sockets a case.
    #![proptest_config(ProptestConfig::with_cases(
        std::env::var("PROPTEST_CASES").ok().and_then(|n| n.parse().ok()).unwrap_or(128)
    ))]

    #[test]
    fn an_answer_is_framed_as_hyper_frames_it(case in answer()) {
        check_answer(&case)?;
    }
}
