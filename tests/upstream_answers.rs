//! The answers real upstreams give, as a client of sluice sees them: chunked
//! bodies with extensions and trailers, HTTP/1.0 bodies that end with the
//! connection, bodiless answers (HEAD, 204, 304), interim 1xx answers, broken
//! framing, and what an answer says about keeping its connection. Each
//! upstream here is a scripted TCP server that writes exact bytes, so the
//! framing is what the test says it is; and whether sluice's pool kept the
//! connection shows in how many it opened.

mod support;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering::SeqCst};

use http::{Method, Request, StatusCode};
use support::*;
use tokio::io::AsyncWriteExt;
use tokio::net::TcpListener;

/// An upstream that answers the n-th request it gets (over all its
/// connections) with `script[n]`: the bytes, and whether to close the
/// connection after them (which ends a body that has no length). Past the
/// script it closes. Counts connections and requests.
struct Scripted {
    url: String,
    conns: Arc<AtomicU64>,
    requests: Arc<AtomicU64>,
}

type Answer = (&'static [u8], bool);

impl Scripted {
    async fn start(script: Vec<Answer>) -> Scripted {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let (conns, requests) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
        let (c, r) = (conns.clone(), requests.clone());
        let script = Arc::new(script);
        tokio::spawn(async move {
            while let Ok((mut stream, _)) = listener.accept().await {
                c.fetch_add(1, SeqCst);
                let (r, script) = (r.clone(), script.clone());
                tokio::spawn(async move {
                    while read_request_head(&mut stream).await {
                        let n = r.fetch_add(1, SeqCst) as usize;
                        let Some(&(answer, close)) = script.get(n) else {
                            return;
                        };
                        if stream.write_all(answer).await.is_err() || close {
                            return;
                        }
                    }
                });
            }
        });
        Scripted {
            url,
            conns,
            requests,
        }
    }

    fn counts(&self) -> (u64, u64) {
        (self.conns.load(SeqCst), self.requests.load(SeqCst))
    }
}

/// Two requests in a row through one sluice client connection.
async fn twice(s: &Sluice, method: Method) -> (Reply, Reply) {
    let c = client();
    let ask = || {
        let req = Request::builder()
            .method(method.clone())
            .uri(s.url("/"))
            .body(empty())
            .unwrap();
        send(&c, req)
    };
    let first = ask().await;
    (first, ask().await)
}

#[tokio::test]
async fn chunked_bodies_with_extensions_and_trailers_arrive_whole() {
    let answer: &[u8] = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n\
        5;name=value\r\nhello\r\n6\r\n world\r\n0\r\nx-checksum: 1\r\n\r\n";
    let up = Scripted::start(vec![(answer, false), (answer, false)]).await;
    let s = Sluice::start(&proxy_to(&up.url)).await;
    let (a, b) = twice(&s, Method::GET).await;
    for r in [&a, &b] {
        assert_eq!(r.status, StatusCode::OK);
        assert_eq!(&r.body[..], b"hello world");
        assert!(r.header("transfer-encoding").is_none_or(|v| v == "chunked"));
    }
    // The connection was kept for the second request.
    assert_eq!(up.counts(), (1, 2));
}

#[tokio::test]
async fn declared_trailers_reach_a_client_that_accepts_them() {
    let answer: &[u8] =
        b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\ntrailer: x-checksum\r\n\r\n\
        5\r\nhello\r\n0\r\nx-checksum: 7\r\n\r\n";
    let up = Scripted::start(vec![(answer, false), (answer, false), (answer, false)]).await;
    let s = Sluice::start(&proxy_to(&up.url)).await;
    let ask = |te: &str| {
        format!("GET / HTTP/1.1\r\nhost: x\r\nconnection: close\r\n{te}\r\n").into_bytes()
    };
    let with = raw(s.addr, &ask("te: trailers\r\n")).await;
    assert!(with.ends_with("0\r\nx-checksum: 7\r\n\r\n"), "{with:?}");
    // A client that did not say it accepts trailers gets the body alone.
    let without = raw(s.addr, &ask("")).await;
    assert!(without.ends_with("hello\r\n0\r\n\r\n"), "{without:?}");
    assert!(!without.contains("x-checksum: 7"), "{without:?}");
    // HTTP/2 carries them as trailers.
    use http_body_util::BodyExt;
    let req = Request::get(s.url("/")).body(empty()).unwrap();
    let resp = h2_client().request(req).await.unwrap();
    let body = resp.into_body().collect().await.unwrap();
    let trailers = body.trailers().cloned().unwrap_or_default();
    assert_eq!(
        trailers.get("x-checksum").map(|v| v.as_bytes()),
        Some(&b"7"[..])
    );
    assert_eq!(&body.to_bytes()[..], b"hello");
}

#[tokio::test]
async fn an_http10_body_that_ends_with_the_connection_arrives_whole() {
    let answer: &[u8] = b"HTTP/1.0 200 OK\r\ncontent-type: text/plain\r\n\r\nuntil the end";
    let up = Scripted::start(vec![(answer, true), (answer, true)]).await;
    let s = Sluice::start(&proxy_to(&up.url)).await;
    let (a, b) = twice(&s, Method::GET).await;
    for r in [&a, &b] {
        assert_eq!(r.status, StatusCode::OK);
        assert_eq!(&r.body[..], b"until the end");
    }
    // A body that ends with the connection cannot leave it for reuse.
    assert_eq!(up.counts(), (2, 2));
}

#[tokio::test]
async fn bodiless_answers_keep_the_connection() {
    // A HEAD's answer announces a length it does not send; 204 and 304 have
    // no body whatever their headers say.
    let cases: [(Method, &'static [u8], StatusCode); 3] = [
        (
            Method::HEAD,
            b"HTTP/1.1 200 OK\r\ncontent-length: 1000\r\n\r\n",
            StatusCode::OK,
        ),
        (
            Method::GET,
            b"HTTP/1.1 204 No Content\r\n\r\n",
            StatusCode::NO_CONTENT,
        ),
        (
            Method::GET,
            b"HTTP/1.1 304 Not Modified\r\netag: \"x\"\r\n\r\n",
            StatusCode::NOT_MODIFIED,
        ),
    ];
    for (method, answer, status) in cases {
        let up = Scripted::start(vec![(answer, false), (answer, false)]).await;
        let s = Sluice::start(&proxy_to(&up.url)).await;
        let (a, b) = twice(&s, method.clone()).await;
        for r in [&a, &b] {
            assert_eq!(r.status, status, "{method} {status}");
            assert!(r.body.is_empty(), "{method} {status}");
        }
        if method == Method::HEAD {
            assert_eq!(a.header("content-length"), Some("1000"));
        }
        assert_eq!(up.counts(), (1, 2), "{method} {status}");
    }
}

#[tokio::test]
async fn an_interim_answer_is_passed_over_for_the_final_one() {
    let answer: &[u8] = b"HTTP/1.1 103 Early Hints\r\nlink: </a.css>; rel=preload\r\n\r\n\
        HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nfinal";
    let up = Scripted::start(vec![(answer, false), (answer, false)]).await;
    let s = Sluice::start(&proxy_to(&up.url)).await;
    let (a, b) = twice(&s, Method::GET).await;
    for r in [&a, &b] {
        assert_eq!(r.status, StatusCode::OK);
        assert_eq!(&r.body[..], b"final");
    }
    assert_eq!(up.counts(), (1, 2));
}

#[tokio::test]
async fn broken_framing_is_a_502_and_the_connection_is_not_reused() {
    // Each answer is framed wrongly: a length that is not a number, two
    // lengths that disagree, a chunk size that is not hex.
    let cases: [&'static [u8]; 3] = [
        b"HTTP/1.1 200 OK\r\ncontent-length: 5x\r\n\r\nhello",
        b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\ncontent-length: 6\r\n\r\nhello!",
        b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\nzz\r\nhello\r\n0\r\n\r\n",
    ];
    for answer in cases {
        let good: &[u8] = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok";
        let up = Scripted::start(vec![(answer, false), (good, false)]).await;
        let s = Sluice::start(&proxy_to(&up.url)).await;
        let head = String::from_utf8_lossy(&answer[..answer.len().min(60)]).into_owned();
        // The chunked case fails only once the body is read: the head has
        // gone out by then, so the client sees its connection cut instead.
        let reply = raw(
            s.addr,
            b"GET / HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n",
        )
        .await;
        assert!(
            reply.starts_with("HTTP/1.1 502") || !reply.contains("hello"),
            "{head:?} gave {reply:?}"
        );
        // The next request gets a clean answer on a new connection.
        let next = get(&s.url("/"), &[]).await;
        assert_eq!(next.status, StatusCode::OK, "{head:?}");
        assert_eq!(&next.body[..], b"ok", "{head:?}");
        assert_eq!(up.counts().0, 2, "{head:?}");
    }
}

#[tokio::test]
async fn a_body_cut_short_is_not_passed_on_as_whole() {
    let short: &[u8] = b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nhello";
    let up = Scripted::start(vec![(short, true)]).await;
    let s = Sluice::start(&proxy_to(&up.url)).await;
    let reply = raw(
        s.addr,
        b"GET / HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n",
    )
    .await;
    // Never a complete answer: sluice answers 502 itself, or the client's
    // connection ends short of the promised length (after the head, or
    // before it when the cut is seen before the head is flushed).
    let cut_short = reply.contains("content-length: 10\r\n") && reply.ends_with("\r\n\r\nhello");
    assert!(
        cut_short || reply.is_empty() || reply.starts_with("HTTP/1.1 502"),
        "got {reply:?}"
    );
}

#[tokio::test]
async fn bytes_after_an_answer_never_become_the_next_answer() {
    // The upstream sends more than its Content-Length says.
    let answer: &[u8] = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nokHTTP/1.1 200 OK\r\ncontent-length: 6\r\n\r\nforged";
    let good: &[u8] = b"HTTP/1.1 200 OK\r\ncontent-length: 4\r\n\r\nreal";
    let up = Scripted::start(vec![(answer, false), (good, false)]).await;
    let s = Sluice::start(&proxy_to(&up.url)).await;
    let (a, b) = twice(&s, Method::GET).await;
    assert_eq!(&a.body[..], b"ok");
    assert_ne!(&b.body[..], b"forged", "stray bytes served as an answer");
}

#[tokio::test]
async fn the_upstreams_word_on_keeping_its_connection_is_followed() {
    // (answer, connections two requests take)
    let cases: [(&'static [u8], u64); 3] = [
        // HTTP/1.1 keeps it unless told otherwise...
        (
            b"HTTP/1.1 200 OK\r\nconnection: close\r\ncontent-length: 2\r\n\r\nok",
            2,
        ),
        // ...HTTP/1.0 closes it unless told otherwise.
        (b"HTTP/1.0 200 OK\r\ncontent-length: 2\r\n\r\nok", 2),
        (
            b"HTTP/1.0 200 OK\r\nconnection: keep-alive\r\ncontent-length: 2\r\n\r\nok",
            1,
        ),
    ];
    for (answer, conns) in cases {
        // The upstream itself never closes: only sluice's choice shows.
        let up = Scripted::start(vec![(answer, false), (answer, false)]).await;
        let s = Sluice::start(&proxy_to(&up.url)).await;
        let (a, b) = twice(&s, Method::GET).await;
        let head = String::from_utf8_lossy(&answer[..30]).into_owned();
        for r in [&a, &b] {
            assert_eq!(r.status, StatusCode::OK, "{head}");
            assert_eq!(&r.body[..], b"ok", "{head}");
        }
        assert_eq!(up.counts(), (conns, 2), "{head}");
    }
}

#[tokio::test]
async fn an_answers_fields_pass_as_sent_whatever_their_case() {
    let answer: &[u8] = b"HTTP/1.1 200 OK\r\nServer: scripted\r\nX-RateLimit-Remaining: 99\r\n\
        Connection: Keep-Alive\r\nKeep-Alive: timeout=5\r\nX-Two: a\r\nx-two: b\r\n\
        Content-Length: 2\r\n\r\nok";
    let up = Scripted::start(vec![(answer, false); 4]).await;
    let config = format!(
        "[policies.p]\nlimits = [{{ limit = 10, window = \"1m\" }}]\n{}policy = \"p\"\n",
        proxy_to(&up.url)
    );
    let s = Sluice::start(&config).await;
    // HTTP/1.1 (sluice writes the fields as they came) twice on one
    // connection, then HTTP/2 (they go through hyper's header map).
    let (a, b) = twice(&s, Method::GET).await;
    let c = send(
        &h2_client(),
        Request::get(s.url("/")).body(empty()).unwrap(),
    )
    .await;
    for (r, remaining) in [(&a, "9"), (&b, "8"), (&c, "7")] {
        assert_eq!(r.status, StatusCode::OK);
        assert_eq!(&r.body[..], b"ok");
        assert_eq!(r.header("server"), Some("scripted"));
        assert_eq!(r.all("x-ratelimit-remaining"), [remaining]);
        assert_eq!(r.all("x-two"), ["a", "b"]);
        assert!(r.all("keep-alive").is_empty());
        assert_eq!(r.all("content-length"), ["2"]);
    }
    // The names keep the upstream's case; the hop-by-hop fields are gone.
    let text = raw(
        s.addr,
        b"GET / HTTP/1.1\r\nhost: a\r\nconnection: close\r\n\r\n",
    )
    .await;
    assert!(text.contains("\r\nServer: scripted\r\n"), "{text}");
    assert!(text.contains("\r\nX-Two: a\r\nx-two: b\r\n"), "{text}");
    assert!(!text.to_ascii_lowercase().contains("keep-alive"), "{text}");
    assert!(text.ends_with("\r\n\r\nok"), "{text}");
    // One upstream connection served all four.
    assert_eq!(up.counts(), (1, 4));
}

#[tokio::test]
async fn an_answers_lines_reach_the_client_whole_and_ended_by_crlf() {
    // (answer, with a policy): fields back to back, which sluice copies in
    // one piece; lines ended by a bare LF, or a blank before the CRLF; a
    // field taken from between others. With and without rate-limit fields
    // to add.
    let usual: &[u8] = b"HTTP/1.1 200 OK\r\nDate: Sun, 06 Nov 1994 08:49:37 GMT\r\n\
        X-A:1\r\nContent-Length: 2\r\nConnection: keep-alive\r\n\r\nok";
    let bare_lf: &[u8] = b"HTTP/1.1 200 OK\nX-B: 2\nContent-Length: 2\n\nok";
    let last_lf: &[u8] = b"HTTP/1.1 200 OK\r\nContent-Length: 2\n\nok";
    let blank: &[u8] = b"HTTP/1.1 200 OK\r\nX-C: 3 \r\nContent-Length: 2\r\n\r\nok";
    let between: &[u8] =
        b"HTTP/1.1 200 OK\r\nX-D: 4\r\nKeep-Alive: timeout=5\r\nX-E: 5\r\nContent-Length: 2\r\n\r\nok";
    let answers = [usual, bare_lf, blank, between, last_lf];
    let script: Vec<Answer> = [answers, answers]
        .concat()
        .into_iter()
        .map(|a| (a, false))
        .collect();
    let up = Scripted::start(script).await;
    let config = format!(
        "[policies.p]\nlimits = [{{ limit = 10, window = \"1m\" }}]\n\
         [upstreams.api]\nurl = \"{}\"\n\
         [[routes]]\npath = \"/limited\"\nupstream = \"api\"\npolicy = \"p\"\n\
         [[routes]]\npath = \"/\"\nupstream = \"api\"\n",
        up.url
    );
    let s = Sluice::start(&config).await;
    for path in ["/", "/limited"] {
        let request = format!("GET {path} HTTP/1.1\r\nhost: a\r\nconnection: close\r\n\r\n");
        let mut texts = Vec::new();
        for _ in answers {
            let text = raw(s.addr, request.as_bytes()).await;
            let (head, body) = text.split_once("\r\n\r\n").expect("a whole answer");
            assert_eq!(body, "ok", "{text}");
            assert_eq!(
                head.matches('\n').count(),
                head.matches("\r\n").count(),
                "a bare LF: {text}"
            );
            let lower = head.to_ascii_lowercase();
            assert_eq!(lower.matches("\r\ndate: ").count(), 1, "{text}");
            assert_eq!(
                lower.matches("\r\ncontent-length: 2\r\n").count(),
                1,
                "{text}"
            );
            assert!(!lower.contains("keep-alive"), "{text}");
            assert_eq!(
                lower.matches("\r\nx-ratelimit-remaining: ").count(),
                usize::from(path == "/limited"),
                "{text}"
            );
            texts.push(text);
        }
        assert!(texts[0].contains("\r\nDate: Sun, 06 Nov 1994 08:49:37 GMT\r\nX-A:1\r\n"));
        assert!(texts[1].contains("\r\nX-B: 2\r\n"), "{}", texts[1]);
        assert!(texts[2].contains("\r\nX-C: 3\r\n"), "{}", texts[2]);
        assert!(
            texts[3].contains("\r\nX-D: 4\r\nX-E: 5\r\n"),
            "{}",
            texts[3]
        );
    }
}
