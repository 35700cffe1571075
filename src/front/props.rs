//! Property tests of the front's request-head reading (`parse`, with
//! `plain_head::parse_request` and `parse_other` under it): generated heads,
//! read as hyper's server reads them (httparse with hyper's settings, then
//! `Method` and `Uri`), at every length they can be cut to.

use bytes::BytesMut;
use http::{Method, Uri};
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
        http11: true,
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
    match parse(&mut buf, &mut slot, &mut fields) {
        Parsed::Request(_) => {
            let Hyper::Complete(read) = hyper else {
                return Err(TestCaseError::fail(format!("served; hyper: {hyper:?}")));
            };
            let req = slot.as_ref().expect("a request made");
            prop_assert!(read.http11);
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
            // A body, an upgrade or an expectation is hyper's.
            for (name, value) in &read.fields {
                let name = name.to_ascii_lowercase();
                let bodied = name == b"content-length" && value != b"0";
                let others: [&[u8]; 4] = [b"transfer-encoding", b"upgrade", b"expect", b"te"];
                prop_assert!(!bodied && !others.contains(&&name[..]));
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
        3 => words(&["0", "5", "0, 0", "00", "chunked", "close", "keep-alive, Close", "websocket", "100-continue", "a", ""]),
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
    (method, target, vec(field, 0..12), vec(any::<u8>(), 0..8)).prop_map(|(m, t, fields, extra)| {
        [
            m,
            b" ".to_vec(),
            t,
            b" HTTP/1.1\r\n".to_vec(),
            fields.concat(),
            b"\r\n".to_vec(),
            extra,
        ]
        .concat()
    })
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
