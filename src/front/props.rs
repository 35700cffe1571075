//! Property tests of the front's request-head reading (`parse`, with
//! `plain_head::parse_request` and `parse_other` under it): generated heads,
//! read as hyper's server reads them (httparse with hyper's settings, then
//! `Method` and `Uri`), at every length they can be cut to.

use bytes::BytesMut;
use http::{Method, Uri, Version};
use proptest::collection::vec;
use proptest::prelude::*;
use proptest::sample::select;

use super::{Parsed, parse};
use crate::fields::{Fields, HeadFields};
use crate::proxy::plain_head;

/// How hyper's server reads a head (its parser settings are httparse's
/// defaults, with room for 100 fields).
#[derive(Debug, PartialEq)]
enum Hyper {
    Partial,
    Refused(httparse::Error),
    Complete(Reading),
}

/// A whole head: its length, method, target, HTTP/1.1 or not, its fields.
#[derive(Debug, PartialEq)]
struct Reading {
    len: usize,
    method: Vec<u8>,
    target: Vec<u8>,
    http11: bool,
    fields: Vec<(Vec<u8>, Vec<u8>)>,
}

fn hyper_reads(buf: &[u8]) -> Hyper {
    let mut slots = vec![httparse::EMPTY_HEADER; 100];
    let mut req = httparse::Request::new(&mut slots);
    match httparse::ParserConfig::default().parse_request(&mut req, buf) {
        Ok(httparse::Status::Partial) => Hyper::Partial,
        Err(e) => Hyper::Refused(e),
        Ok(httparse::Status::Complete(len)) => Hyper::Complete(Reading {
            len,
            method: req.method.unwrap_or_default().as_bytes().to_vec(),
            target: req.path.unwrap_or_default().as_bytes().to_vec(),
            http11: req.version == Some(1),
            fields: req
                .headers
                .iter()
                .map(|h| (h.name.as_bytes().to_vec(), h.value.to_vec()))
                .collect(),
        }),
    }
}

/// The quick parser alone: whatever it takes, httparse reads the same way.
fn check_quick(buf: &[u8]) -> Result<(), TestCaseError> {
    let mut read = plain_head::ReadFields::new();
    let Some(line) = plain_head::parse_request(buf, 100, &mut read) else {
        return Ok(());
    };
    let quick = Reading {
        len: line.len,
        method: line.method.to_vec(),
        target: line.target.to_vec(),
        http11: !line.http10,
        fields: read.iter().map(|(n, v)| (n.to_vec(), v.to_vec())).collect(),
    };
    prop_assert_eq!(Hyper::Complete(quick), hyper_reads(buf));
    Ok(())
}

/// The front's verdict on `input` against hyper's: a request served here is
/// one hyper reads the same way; a head hyper refuses is refused here or
/// handed to hyper; a head not all there is never served nor refused.
fn check_front(input: &[u8]) -> Result<(), TestCaseError> {
    let mut buf = BytesMut::from(input);
    let mut slot = None;
    let mut fields = HeadFields::default();
    let hyper = hyper_reads(input);
    match parse(&mut buf, &mut slot, &mut fields, super::MAX_BODY) {
        Parsed::Request(close, body) => {
            let Hyper::Complete(read) = hyper else {
                return Err(TestCaseError::fail(format!("served; hyper: {hyper:?}")));
            };
            let req = slot.as_ref().expect("a request made");
            let version = if read.http11 {
                Version::HTTP_11
            } else {
                Version::HTTP_10
            };
            prop_assert_eq!(req.version(), version);
            // The connection is kept only when hyper keeps it, and exactly
            // when it does for values hyper can read (visible ASCII).
            let hyper_keeps = hyper_keeps_alive(&read);
            prop_assert!(close || hyper_keeps, "kept; hyper closes");
            let connection = |(n, _): &&(Vec<u8>, Vec<u8>)| n.eq_ignore_ascii_case(b"connection");
            if read
                .fields
                .iter()
                .filter(connection)
                .all(|(_, v)| crate::fields::text(v).is_some())
            {
                prop_assert_eq!(close, !hyper_keeps);
            }
            prop_assert_eq!(req.method(), &Method::from_bytes(&read.method).unwrap());
            prop_assert_ne!(req.method(), &Method::CONNECT);
            let uri = Uri::try_from(&read.target[..]).expect("hyper's Uri too");
            prop_assert_eq!(req.uri(), &uri);
            let served: Vec<_> = Fields::Head(&fields)
                .iter()
                .map(|(n, v)| (n.to_vec(), v.to_vec()))
                .collect();
            prop_assert_eq!(&served, &read.fields);
            prop_assert!(fields.to_map().is_some(), "a header map takes them");
            prop_assert_eq!(fields.head().len(), read.len);
            prop_assert_eq!(&buf[..], &input[read.len..]);
            // A body framed otherwise than by one length, an upgrade or an
            // expectation is hyper's; a length is read as hyper reads it.
            let mut lengths = Vec::new();
            for (name, value) in &read.fields {
                let name = name.to_ascii_lowercase();
                if name == b"content-length" {
                    lengths.push(hyper_length(value));
                }
                let others: [&[u8]; 4] = [b"transfer-encoding", b"upgrade", b"expect", b"te"];
                prop_assert!(!others.contains(&&name[..]));
            }
            match lengths[..] {
                [] => prop_assert_eq!(body, 0),
                [length] => prop_assert_eq!(length, Some(body as u64)),
                _ => return Err(TestCaseError::fail("served with two lengths")),
            }
        }
        Parsed::Partial => {
            prop_assert_eq!(hyper, Hyper::Partial);
            prop_assert_eq!(&buf[..], input);
        }
        Parsed::Malformed(_) => {
            prop_assert!(
                matches!(hyper, Hyper::Refused(e) if e != httparse::Error::TooManyHeaders),
                "refused here; hyper: {:?}",
                hyper
            );
            prop_assert_eq!(&buf[..], input);
        }
        Parsed::Other => prop_assert_eq!(&buf[..], input),
    }
    Ok(())
}

/// Whether hyper's server keeps the connection after this request (hyper's
/// `role.rs`): HTTP/1.1 unless a `Connection` line says `close`, HTTP/1.0
/// only when one says `keep-alive` and none `close`; a value that is not
/// visible ASCII says nothing.
fn hyper_keeps_alive(read: &Reading) -> bool {
    let has = |value: &[u8], token: &str| {
        std::str::from_utf8(value).is_ok_and(|v| {
            crate::fields::text(value).is_some()
                && v.split(',').any(|t| t.trim().eq_ignore_ascii_case(token))
        })
    };
    let lines = read
        .fields
        .iter()
        .filter(|(n, _)| n.eq_ignore_ascii_case(b"connection"));
    let (mut keep, mut closed) = (read.http11, false);
    for (_, value) in lines {
        if closed || has(value, "close") {
            closed = true;
            keep = false;
        } else if !keep {
            keep = has(value, "keep-alive");
        }
    }
    keep
}

/// A `Content-Length` value as hyper's server reads it (`from_digits`).
fn hyper_length(value: &[u8]) -> Option<u64> {
    if value.is_empty() {
        return None;
    }
    value.iter().try_fold(0u64, |n, &b| {
        b.is_ascii_digit()
            .then(|| n.checked_mul(10)?.checked_add(u64::from(b - b'0')))
            .flatten()
    })
}

/// What hyper's server makes of `input`, sent whole on a connection that
/// the client then closes: the target and body of each request it reads,
/// in order.
fn hyper_serves(input: &[u8]) -> Vec<(String, Vec<u8>)> {
    use http_body_util::{BodyExt, Empty};
    use std::sync::{Arc, Mutex};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a runtime");
    runtime.block_on(async {
        let (client, server) = tokio::io::duplex(64 * 1024);
        let seen = Arc::new(Mutex::new(Vec::new()));
        let noted = seen.clone();
        let service =
            hyper::service::service_fn(move |req: http::Request<hyper::body::Incoming>| {
                let noted = noted.clone();
                async move {
                    let target = req.uri().to_string();
                    if let Ok(body) = req.into_body().collect().await {
                        noted
                            .lock()
                            .unwrap()
                            .push((target, body.to_bytes().to_vec()));
                    }
                    Ok::<_, std::convert::Infallible>(http::Response::new(
                        Empty::<bytes::Bytes>::new(),
                    ))
                }
            });
        // (Half-closed: the requests read before the client's end are
        // served, not dropped with it.)
        let conn = hyper::server::conn::http1::Builder::new()
            .half_close(true)
            .serve_connection(hyper_util::rt::TokioIo::new(server), service);
        let (mut answers, mut requests) = tokio::io::split(client);
        let talk = async {
            let _ = requests.write_all(input).await;
            let _ = requests.shutdown().await;
            let _ = answers.read_to_end(&mut Vec::new()).await;
        };
        let both = async { tokio::join!(conn, talk) };
        let _ = tokio::time::timeout(std::time::Duration::from_secs(5), both).await;
        seen.lock().unwrap().clone()
    })
}

/// A request with a body is framed here as hyper frames it: when the front
/// serves a head with a length, hyper reads the same body after it, and
/// what follows (another request) is read alike.
fn check_body(input: &[u8]) -> Result<(), TestCaseError> {
    let mut buf = BytesMut::from(input);
    let mut slot = None;
    let mut fields = HeadFields::default();
    let Parsed::Request(close, len) = parse(&mut buf, &mut slot, &mut fields, super::MAX_BODY)
    else {
        // Hyper's to serve, or refused as hyper refuses (`check_front`).
        return Ok(());
    };
    if buf.len() < len {
        // Both wait for more.
        return Ok(());
    }
    let body = buf.split_to(len);
    let hyper = hyper_serves(input);
    prop_assert!(!hyper.is_empty(), "served here, refused by hyper");
    prop_assert_eq!(&hyper[0].1[..], &body[..]);
    if close {
        // Neither reads on.
        prop_assert_eq!(hyper.len(), 1);
        return Ok(());
    }
    let mut next = None;
    match parse(&mut buf, &mut next, &mut fields, super::MAX_BODY) {
        Parsed::Request(_, 0) => {
            prop_assert_eq!(hyper.len(), 2);
            let uri = next.as_ref().expect("a request made").uri().to_string();
            prop_assert_eq!(&hyper[1].0, &uri);
        }
        Parsed::Malformed(_) | Parsed::Partial => prop_assert_eq!(hyper.len(), 1),
        Parsed::Request(..) | Parsed::Other => {}
    }
    Ok(())
}

/// Both checks on `head`, and on each of its beginnings: every one when it
/// is short, else a spread of them.
fn check_cuts(head: &[u8]) -> Result<(), TestCaseError> {
    let step = (head.len() / 300).max(1);
    for cut in (0..head.len()).step_by(step).chain([head.len()]) {
        check_quick(&head[..cut])?;
        check_front(&head[..cut])?;
    }
    Ok(())
}

const TOKEN: &[u8] =
    b"!#$%&'*+-.^_`|~0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz";

fn token_byte() -> impl Strategy<Value = u8> {
    select(TOKEN)
}

/// A byte of a class some parser treats apart: blanks, line ends,
/// separators, NUL and other controls, DEL, bytes above 0x7F.
fn odd_byte() -> BoxedStrategy<u8> {
    prop_oneof![
        select(&b" \t\r\n:;,\"()<>@[]{}/\\?=%"[..]),
        Just(0u8),
        Just(0x7f),
        0x80u8..=0xff,
        0u8..0x20,
        any::<u8>(),
    ]
    .boxed()
}

fn words(list: &'static [&'static str]) -> impl Strategy<Value = Vec<u8>> {
    select(list).prop_map(|w| w.as_bytes().to_vec())
}

fn method() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        6 => words(&["GET", "POST", "HEAD", "PUT", "DELETE", "OPTIONS", "PATCH", "TRACE", "M-SEARCH"]),
        2 => words(&["get", "Post", "CONNECT", "GET ", "G\u{e9}T"]),
        2 => vec(token_byte(), 1..10),
        1 => vec(prop_oneof![8 => token_byte(), 1 => odd_byte()], 0..10),
    ]
}

fn target() -> impl Strategy<Value = Vec<u8>> {
    let odd = prop_oneof![12 => 0x21u8..=0x7e, 1 => odd_byte()];
    prop_oneof![
        2 => words(&["/", "*", "http://a.example/x?y=1", "a.example:443", "/a%2Fb?c=%20", "//x", ""]),
        6 => vec(0x21u8..=0x7e, 0..40).prop_map(|rest| [&b"/"[..], &rest].concat()),
        2 => vec(odd, 0..40).prop_map(|rest| [&b"/"[..], &rest].concat()),
    ]
}

fn version() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        12 => Just(b"HTTP/1.1".to_vec()),
        1 => words(&["HTTP/1.0", "HTTP/2.0", "HTTP/1.2", "http/1.1", "HTTP/1.", "HTTP/11", "HTTP/1.1 ", "HTTP/1.1\t", ""]),
    ]
}

fn line_end() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        30 => Just(b"\r\n".to_vec()),
        1 => words(&["\n", "\r", "\r\r\n", "", "\n\r"]),
    ]
}

fn blank() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        6 => Just(b" ".to_vec()),
        2 => Just(Vec::new()),
        1 => words(&["  ", "\t", " \t "]),
    ]
}

/// The space between the request line's parts.
fn gap() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![20 => Just(b" ".to_vec()), 1 => words(&["", "  ", "\t", " \r"])]
}

fn name() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        6 => words(&["Host", "Accept", "X-Api-Key", "x-api-key", "X_Api_Key", "Cookie", "X-Forwarded-For"]),
        1 => words(&[
            "Connection", "Content-Length", "content-length", "Transfer-Encoding", "Upgrade", "Expect",
            "TE", "te",
        ]),
        3 => vec(token_byte(), 1..20),
        1 => vec(prop_oneof![8 => token_byte(), 1 => odd_byte()], 0..12),
    ]
}

fn value() -> impl Strategy<Value = Vec<u8>> {
    let piece = prop_oneof![
        30 => (0x20u8..=0x7e).prop_map(|b| vec![b]),
        2 => Just(vec![b'\t']),
        2 => odd_byte().prop_map(|b| vec![b]),
        // A folded line, and a bare CR or LF before more text.
        1 => words(&["\r\n ", "\r\n\t", "\rx", "\nx", "\r\n"]),
    ];
    prop_oneof![
        3 => words(&["0", "5", "0, 0", "00", "chunked", "close", "keep-alive, Close", "keep-alive", "Keep-Alive", "websocket", "100-continue", "a", ""]),
        6 => plain_value(),
        2 => vec(piece, 0..30).prop_map(|p| p.concat()),
    ]
}

/// A value of visible ASCII, spaces and tabs.
fn plain_value() -> impl Strategy<Value = Vec<u8>> {
    vec(prop_oneof![20 => 0x20u8..=0x7e, 1 => Just(b'\t')], 0..30)
}

fn field() -> impl Strategy<Value = Vec<u8>> {
    let separator = prop_oneof![20 => Just(b":".to_vec()), 1 => words(&[" :", "\t:", "", "::"])];
    (name(), separator, blank(), value(), blank(), line_end()).prop_map(
        |(name, sep, before, value, after, end)| {
            // Blanks after a value only now and then.
            let after = if after.len() == 1 { Vec::new() } else { after };
            [name, sep, before, value, after, end].concat()
        },
    )
}

/// A request head from the grammar of a usual one, every part now and then
/// spelled otherwise; then some bytes after it.
fn request() -> impl Strategy<Value = Vec<u8>> {
    let fields = prop_oneof![
        12 => vec(field(), 0..6),
        1 => vec(field(), 55..110),
    ];
    (
        prop_oneof![20 => Just(Vec::new()), 1 => words(&["\r\n", "\n", " "])],
        method(),
        gap(),
        target(),
        gap(),
        version(),
        line_end(),
        fields,
        prop_oneof![20 => Just(b"\r\n".to_vec()), 1 => words(&["\n", "", "\r", " \r\n"])],
        vec(any::<u8>(), 0..20),
    )
        .prop_map(|(lead, m, sp1, t, sp2, v, end, fields, last, extra)| {
            [lead, m, sp1, t, sp2, v, end, fields.concat(), last, extra].concat()
        })
}

/// Heads whose parts are all usual, so that most are served here.
fn usual_request() -> impl Strategy<Value = Vec<u8>> {
    let field = (name(), plain_value())
        .prop_filter("a token name", |(n, _)| {
            !n.is_empty() && n.iter().all(|b| TOKEN.contains(b))
        })
        .prop_map(|(n, v)| [&n[..], b": ", v.trim_ascii(), b"\r\n"].concat());
    let method = prop_oneof![
        words(&[
            "GET", "POST", "HEAD", "DELETE", "OPTIONS", "M-SEARCH", "get"
        ]),
        vec(token_byte(), 1..10),
    ];
    let target = vec(0x21u8..=0x7e, 0..40).prop_map(|rest| [&b"/"[..], &rest].concat());
    let version = prop_oneof![4 => Just(" HTTP/1.1\r\n"), 1 => Just(" HTTP/1.0\r\n")];
    let connection = words(&[
        "",
        "",
        "Connection: keep-alive\r\n",
        "Connection: close\r\n",
        "connection: Keep-Alive, x\r\n",
    ]);
    (
        method,
        target,
        version,
        connection,
        vec(field, 0..12),
        vec(any::<u8>(), 0..8),
    )
        .prop_map(|(m, t, v, connection, fields, extra)| {
            [
                m,
                b" ".to_vec(),
                t,
                v.as_bytes().to_vec(),
                connection,
                fields.concat(),
                b"\r\n".to_vec(),
                extra,
            ]
            .concat()
        })
}

/// A usual head with a body and what a client sends with it: its length
/// spelled as clients should and as they should not, once or twice, beside
/// other framings now and then; then another request.
fn bodied_request() -> impl Strategy<Value = Vec<u8>> {
    let body = prop_oneof![
        20 => vec(any::<u8>(), 0..40),
        1 => vec(any::<u8>(), super::MAX_BODY - 2..super::MAX_BODY + 3),
    ];
    let spelling = select(vec![
        "{n}",
        "{n}",
        "{n}",
        "0{n}",
        "000{n}",
        "{m}",
        "{l}",
        "+{n}",
        "-{n}",
        " {n} ",
        "{n},{n}",
        "{n}, {n}",
        "",
        "0x{n}",
        "{n}.0",
        "{n}\r\ncontent-length: {n}",
        "{n}\r\ncontent-length: {m}",
        "{n}\r\ntransfer-encoding: chunked",
        "{n}\r\nexpect: 100-continue",
        "184467440737095516160{n}",
        "00000000000000000000000{n}",
    ]);
    let method = words(&["POST", "PUT", "GET", "PATCH"]);
    let version = select(vec![
        " HTTP/1.1\r\n",
        " HTTP/1.1\r\n",
        " HTTP/1.0\r\nconnection: keep-alive\r\n",
        " HTTP/1.0\r\n",
    ]);
    (method, version, spelling, body, any::<bool>()).prop_map(
        |(method, version, spelling, body, late)| {
            let n = body.len();
            let length = spelling
                .replace("{n}", &n.to_string())
                .replace("{m}", &(n + 1).to_string())
                .replace("{l}", &n.saturating_sub(1).to_string());
            let (before, after) = if late {
                ("", "x-late: 1\r\n")
            } else {
                ("x-early: 1\r\n", "")
            };
            [
                &method[..],
                b" /up",
                version.as_bytes(),
                b"host: a\r\n",
                before.as_bytes(),
                b"content-length: ",
                length.as_bytes(),
                b"\r\n",
                after.as_bytes(),
                b"\r\n",
                &body,
                b"GET /next HTTP/1.1\r\nhost: a\r\n\r\n",
            ]
            .concat()
        },
    )
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]
    #[test]
    fn a_body_is_framed_as_hyper_frames_it(input in bodied_request()) {
        check_front(&input)?;
        check_body(&input)?;
    }
}

proptest! {
    #[test]
    fn a_generated_head_is_read_as_hyper_reads_it(head in request()) {
        check_cuts(&head)?;
    }

    #[test]
    fn a_usual_head_is_served_here_as_hyper_reads_it(head in usual_request()) {
        check_cuts(&head)?;
    }
}
