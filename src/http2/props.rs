//! Property tests of the HTTP/2 codec against the h2 crate (hyper's
//! HTTP/2): header blocks h2's client encodes are decoded to the fields it
//! sent; blocks the own encoder writes are read by h2's client as written;
//! and any generated block is decoded or refused as h2's server decodes or
//! refuses it.

use bytes::Bytes;
use http::{HeaderMap, HeaderName, HeaderValue, Request, Response};
use proptest::collection::vec;
use proptest::prelude::*;
use proptest::sample::select;
use tokio::io::{AsyncReadExt, AsyncWriteExt, DuplexStream};

use super::frame::{self, Frame, Head};
use super::hpack::{DecodeError, Decoder, Encoder, put_int};
use super::huffman;

/// Names h2's encoder treats differently: in the static table or not,
/// indexed or never (it keeps some values out of its table).
const NAMES: &[&str] = &[
    "accept",
    "accept-encoding",
    "authorization",
    "cookie",
    "content-type",
    "content-length",
    "etag",
    "if-none-match",
    "location",
    "set-cookie",
    "user-agent",
    "x-api-key",
    "x-request-id",
    "x-a",
    "age",
    "date",
    "server",
    "vary",
    "via",
    "x-forwarded-for",
];

fn value() -> impl Strategy<Value = Vec<u8>> {
    let byte = prop_oneof![
        8 => 0x21u8..0x7f,
        1 => Just(b' '),
        1 => Just(b'\t'),
        1 => 0x80u8..=0xff,
    ];
    prop_oneof![
        1 => Just(Vec::new()),
        6 => vec(byte.clone(), 1..24),
        1 => vec(byte, 200..400),
    ]
}

fn fields() -> impl Strategy<Value = Fields> {
    vec((select(NAMES), value()), 0..8)
}

fn map(fields: &[(&'static str, Vec<u8>)]) -> HeaderMap {
    let mut m = HeaderMap::new();
    for (name, v) in fields {
        let v = HeaderValue::from_bytes(v).expect("generated values are valid");
        m.append(HeaderName::from_static(name), v);
    }
    m
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a runtime")
}

/// Reads what h2's client sent on `io` until `n` header blocks have
/// ended: each block's stream and bytes (HEADERS and CONTINUATION joined).
async fn read_blocks(io: &mut DuplexStream, n: usize) -> Vec<(u32, Vec<u8>)> {
    let mut buf = Vec::new();
    let mut chunk = [0u8; 16 * 1024];
    let mut at = frame::PREFACE.len();
    let mut blocks = Vec::new();
    let mut open: Option<(u32, Vec<u8>)> = None;
    while blocks.len() < n {
        let head = buf
            .get(at..)
            .and_then(Head::read)
            .filter(|h| buf.len() >= at + frame::HEAD_LEN + h.len);
        let Some(head) = head else {
            let got = io.read(&mut chunk).await.expect("read");
            assert!(got > 0, "h2's client closed early");
            buf.extend_from_slice(&chunk[..got]);
            continue;
        };
        assert!(buf.starts_with(frame::PREFACE));
        let payload = &buf[at + frame::HEAD_LEN..at + frame::HEAD_LEN + head.len];
        let ended = match frame::parse(head, payload).expect("h2's client sends valid frames") {
            Frame::Headers {
                stream,
                end_headers,
                block,
                ..
            } => {
                open = Some((stream, block.to_vec()));
                end_headers
            }
            Frame::Continuation {
                block, end_headers, ..
            } => {
                open.as_mut()
                    .expect("a block is open")
                    .1
                    .extend_from_slice(block);
                end_headers
            }
            _ => false,
        };
        if ended {
            blocks.extend(open.take());
        }
        at += frame::HEAD_LEN + head.len;
    }
    blocks
}

/// A block's pseudo-header fields, and its other fields.
type Decoded = (Vec<(String, Vec<u8>)>, HeaderMap);

/// Generated fields: a name, and a value's bytes.
type Fields = Vec<(&'static str, Vec<u8>)>;

/// Decodes `block`.
fn decode(d: &mut Decoder, block: &[u8]) -> Result<Decoded, DecodeError> {
    let mut pseudo = Vec::new();
    let mut fields = HeaderMap::new();
    d.decode(block, |name, value| {
        if name.starts_with(b":") {
            pseudo.push((String::from_utf8_lossy(name).into_owned(), value.to_vec()));
        } else {
            fields.append(
                HeaderName::from_bytes(name).expect("h2 sent a valid name"),
                HeaderValue::from_bytes(value).expect("h2 sent a valid value"),
            );
        }
    })?;
    Ok((pseudo, fields))
}

/// h2's client, with a table of `table` bytes, and the server's end of
/// its connection.
async fn h2_client(table: u32) -> (h2::client::SendRequest<Bytes>, DuplexStream) {
    let (client_io, server_io) = tokio::io::duplex(1 << 20);
    let (client, conn) = h2::client::Builder::new()
        .header_table_size(table)
        .handshake::<_, Bytes>(client_io)
        .await
        .expect("handshake");
    tokio::spawn(conn);
    (client, server_io)
}

/// Requests h2's client sends on one connection decode to what it sent.
fn check_requests(requests: &[(String, Fields)], table: u32) -> Result<(), TestCaseError> {
    runtime().block_on(async {
        let (mut client, mut server_io) = h2_client(table).await;
        let mut sent = Vec::new();
        for (path, fields) in requests {
            let mut req = Request::get(format!("http://example.com{path}"))
                .body(())
                .expect("a request");
            *req.headers_mut() = map(fields);
            sent.push((path.clone(), req.headers().clone()));
            client = client.ready().await.expect("ready");
            let (_answer, _) = client.send_request(req, true).expect("sent");
        }
        let blocks = read_blocks(&mut server_io, requests.len()).await;
        let mut d = Decoder::new(4096);
        for ((_, block), (path, headers)) in blocks.iter().zip(&sent) {
            let (pseudo, fields) =
                decode(&mut d, block).map_err(|e| TestCaseError::fail(e.to_string()))?;
            let get = |n: &str| pseudo.iter().find(|(p, _)| p == n).map(|(_, v)| v.clone());
            prop_assert_eq!(get(":method"), Some(b"GET".to_vec()));
            prop_assert_eq!(get(":path"), Some(path.as_bytes().to_vec()));
            prop_assert_eq!(get(":authority"), Some(b"example.com".to_vec()));
            prop_assert_eq!(&fields, headers);
        }
        Ok(())
    })
}

/// Responses the own encoder writes are read by h2's client as written.
fn check_responses(answers: &[(u16, Fields)], table: u32) -> Result<(), TestCaseError> {
    runtime().block_on(async {
        let (mut client, mut server_io) = h2_client(table).await;
        let mut waiting = Vec::new();
        for _ in answers {
            client = client.ready().await.expect("ready");
            let req = Request::get("http://example.com/")
                .body(())
                .expect("a request");
            waiting.push(client.send_request(req, true).expect("sent").0);
        }
        let blocks = read_blocks(&mut server_io, answers.len()).await;
        let mut out = Vec::new();
        frame::put_settings(&mut out, &[]);
        frame::put_settings_ack(&mut out);
        let mut e = Encoder::default();
        for ((stream, _), (status, fields)) in blocks.iter().zip(answers) {
            let mut block = Vec::new();
            e.status(*status, &mut block);
            for (name, value) in fields {
                e.field(name.as_bytes(), value, &mut block);
            }
            frame::put_headers(&mut out, *stream, &block, true, 100);
        }
        server_io.write_all(&out).await.expect("written");
        for (answer, (status, fields)) in waiting.into_iter().zip(answers) {
            let resp: Response<_> = answer
                .await
                .map_err(|e| TestCaseError::fail(e.to_string()))?;
            prop_assert_eq!(resp.status().as_u16(), *status);
            prop_assert_eq!(resp.headers(), &map(fields));
        }
        Ok(())
    })
}

/// One representation in a generated header block (RFC 7541, 6).
#[derive(Debug, Clone)]
enum Rep {
    Indexed(usize),
    Literal {
        kind: u8,
        index: usize,
        name: Str,
        value: Str,
    },
    SizeUpdate(usize),
}

/// A generated string literal: its bytes, Huffman-coded or not, or raw
/// bytes posing as a Huffman code.
#[derive(Debug, Clone)]
enum Str {
    Plain(Vec<u8>),
    Huffman(Vec<u8>),
    Junk(Vec<u8>),
}

fn str_() -> impl Strategy<Value = Str> {
    let name = vec(select(&b"abcdefxyz-_0189:ABZ \x00\xff"[..]), 0..12);
    prop_oneof![
        4 => name.clone().prop_map(Str::Plain),
        4 => name.prop_map(Str::Huffman),
        1 => vec(any::<u8>(), 0..6).prop_map(Str::Junk),
    ]
}

fn rep() -> impl Strategy<Value = Rep> {
    prop_oneof![
        4 => prop_oneof![1 => Just(0usize), 10 => 1usize..64, 2 => 62usize..70].prop_map(Rep::Indexed),
        6 => (select(&[0x00u8, 0x10, 0x40][..]), prop_oneof![3 => Just(0usize), 3 => 1usize..62, 1 => 62usize..70], str_(), str_())
            .prop_map(|(kind, index, name, value)| Rep::Literal { kind, index, name, value }),
        1 => prop_oneof![0usize..5000, Just(4096)].prop_map(Rep::SizeUpdate),
    ]
}

fn put_str(dst: &mut Vec<u8>, s: &Str) {
    match s {
        Str::Plain(b) => {
            put_int(dst, 0, 7, b.len());
            dst.extend_from_slice(b);
        }
        Str::Huffman(b) => {
            let mut coded = Vec::new();
            huffman::encode(b, &mut coded);
            put_int(dst, 0x80, 7, coded.len());
            dst.extend_from_slice(&coded);
        }
        Str::Junk(b) => {
            put_int(dst, 0x80, 7, b.len());
            dst.extend_from_slice(b);
        }
    }
}

/// A request's block: the usual pseudo-header fields, then generated
/// representations, perhaps cut short.
fn block() -> impl Strategy<Value = Vec<u8>> {
    (
        vec(rep(), 0..6),
        any::<bool>(),
        any::<prop::sample::Index>(),
    )
        .prop_map(|(reps, cut, at)| {
            let mut b = Vec::new();
            if let Some(Rep::SizeUpdate(n)) = reps.first() {
                put_int(&mut b, 0x20, 5, *n);
            }
            b.extend_from_slice(&[0x82, 0x86, 0x84, 0x41, 0x01, b'a']);
            for r in &reps {
                match r {
                    Rep::Indexed(i) => put_int(&mut b, 0x80, 7, *i),
                    Rep::Literal {
                        kind,
                        index,
                        name,
                        value,
                    } => {
                        let n = if *kind == 0x40 { 6 } else { 4 };
                        put_int(&mut b, *kind, n, *index);
                        if *index == 0 {
                            put_str(&mut b, name);
                        }
                        put_str(&mut b, value);
                    }
                    Rep::SizeUpdate(n) => put_int(&mut b, 0x20, 5, *n),
                }
            }
            if cut && !b.is_empty() {
                b.truncate(at.index(b.len()));
            }
            b
        })
}

/// What h2's server made of a request whose head is `block`: the error
/// that ended the connection (its reason, and whether it was GOAWAY), or,
/// if it took the request, its fields. A plain request follows on stream
/// 3, so that a refusal of stream 1 alone is seen too.
async fn h2_reads(block: &[u8]) -> (Option<(h2::Reason, bool)>, Option<HeaderMap>) {
    let (mut client_io, server_io) = tokio::io::duplex(1 << 16);
    let mut out = frame::PREFACE.to_vec();
    frame::put_settings(&mut out, &[]);
    frame::put_headers(&mut out, 1, block, true, 1 << 14);
    frame::put_headers(
        &mut out,
        3,
        &[0x82, 0x86, 0x84, 0x01, 0x01, b'b'],
        true,
        1 << 14,
    );
    client_io.write_all(&out).await.expect("written");
    // Whatever h2 writes back is drained, so that it never waits.
    let drain = tokio::spawn(async move {
        let mut sink = Vec::new();
        let _ = client_io.read_to_end(&mut sink).await;
    });
    let mut conn = match h2::server::handshake(server_io).await {
        Ok(c) => c,
        Err(e) => return (e.reason().map(|r| (r, e.is_go_away())), None),
    };
    let result = match conn.accept().await {
        Some(Ok((req, answer))) if answer.stream_id().as_u32() == 1 => {
            (None, Some(req.headers().clone()))
        }
        Some(Ok(_)) | None => (None, None),
        Some(Err(e)) => (e.reason().map(|r| (r, e.is_go_away())), None),
    };
    drop(conn);
    let _ = drain.await;
    result
}

/// Fields h2 takes as a request's: what the server's checks (not HPACK's)
/// are about. A block of other fields is compared only when refused.
fn plain(fields: &[(Vec<u8>, Vec<u8>)]) -> bool {
    let mut seen = Vec::new();
    let mut regular = false;
    fields.iter().all(|(n, v)| {
        let value_ok = v.iter().all(|&b| b == b'\t' || (b >= 0x20 && b != 0x7f));
        let name_ok = if n.starts_with(b":") {
            let known = [&b":method"[..], b":scheme", b":path", b":authority"].contains(&&n[..]);
            let once = !seen.contains(n);
            seen.push(n.clone());
            known && once && !regular
        } else {
            regular = true;
            !n.is_empty()
                && n.iter()
                    .all(|&b| b.is_ascii_lowercase() || b.is_ascii_digit() || b"-_".contains(&b))
        };
        value_ok && name_ok
    })
}

fn check_block(block: &[u8]) -> Result<(), TestCaseError> {
    let (h2_refused, h2_fields) = runtime().block_on(h2_reads(block));
    let mut d = Decoder::new(4096);
    let mut fields = Vec::new();
    let ours = d.decode(block, |n, v| fields.push((n.to_vec(), v.to_vec())));
    // h2 ends the connection with PROTOCOL_ERROR where RFC 9113 (4.3) says
    // COMPRESSION_ERROR (a block cut short): either is a refusal.
    let h2_ended = matches!(
        h2_refused,
        Some((
            h2::Reason::COMPRESSION_ERROR | h2::Reason::PROTOCOL_ERROR,
            true
        ))
    );
    if ours.is_ok() && !plain(&fields) {
        return Ok(());
    }
    prop_assert_eq!(
        ours.is_err(),
        h2_ended,
        "ours: {:?}, h2: {:?}, fields {:?}",
        ours,
        h2_refused,
        fields
    );
    if let Some(h2_fields) = h2_fields {
        let mut m = HeaderMap::new();
        for (n, v) in fields.iter().filter(|(n, _)| !n.starts_with(b":")) {
            m.append(
                HeaderName::from_bytes(n).expect("h2 took the name"),
                HeaderValue::from_bytes(v).expect("h2 took the value"),
            );
        }
        prop_assert_eq!(m, h2_fields);
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(
        std::env::var("PROPTEST_CASES").ok().and_then(|n| n.parse().ok()).unwrap_or(64)
    ))]

    #[test]
    fn requests_h2_encodes_decode_as_sent(
        requests in vec(("/[a-z0-9/?=&%]{0,30}", fields()), 1..6),
        table in select(&[0u32, 64, 4096][..]),
    ) {
        check_requests(&requests, table)?;
    }

    #[test]
    fn responses_the_encoder_writes_h2_reads_as_written(
        // No Content-Length: the answers have no body.
        answers in vec((200u16..600, fields().prop_map(|f| f.into_iter().filter(|(n, _)| *n != "content-length").collect::<Vec<_>>())), 1..6),
        table in select(&[0u32, 4096][..]),
    ) {
        check_responses(&answers, table)?;
    }

    #[test]
    fn any_block_is_decoded_or_refused_as_h2_does(block in block()) {
        check_block(&block)?;
    }
}
