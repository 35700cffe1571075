//! The request path: forwarding, the errors sluice answers itself, client
//! identity, HTTP/2. Real upstream, real client, sluice in-process.

mod support;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering::SeqCst};
use std::time::{Duration, Instant};

use http::{Request, StatusCode};
use http_body_util::{BodyExt, Full};
use support::*;

async fn config(upstream: &str) -> String {
    format!(
        r#"
[server]
upstream_timeout = "300ms"
max_header_bytes = 4096
trusted_proxies = ["127.0.0.1"]

[upstreams.api]
url = "{upstream}"

[upstreams.dead]
url = "http://{dead}"

[upstreams.based]
url = "{upstream}/base/"

[[routes]]
path = "/"
upstream = "api"

[[routes]]
path = "/dead"
upstream = "dead"

[[routes]]
path = "/based"
upstream = "based"

[[routes]]
path = "=/ping"
methods = ["GET"]
respond = {{ status = 200, body = "pong" }}

[[routes]]
path = "/hosted"
host = "api.example.com"
respond = {{ status = 200, body = "hosted" }}
"#,
        dead = dead_port().await
    )
}

async fn setup() -> (Upstream, Sluice) {
    let up = Upstream::start().await;
    let sluice = Sluice::start(&config(&up.url()).await).await;
    (up, sluice)
}

#[tokio::test]
async fn forwards_method_path_query_and_headers() {
    let (_up, sluice) = setup().await;
    let req = Request::post(sluice.url("/items/7?sort=asc&q=a%20b"))
        .header("x-custom", "one")
        .header("connection", "keep-alive, x-secret")
        .header("x-secret", "hop")
        .header("keep-alive", "timeout=5")
        .header("proxy-authorization", "Basic Zm9v")
        .header("x-forwarded-for", "198.51.100.7")
        .body(empty())
        .unwrap();
    let reply = send(&client(), req).await;
    assert_eq!(reply.status, StatusCode::OK);
    let echo = reply.json();
    assert_eq!(echo["method"], "POST");
    assert_eq!(echo["uri"], "/items/7?sort=asc&q=a%20b");
    let h = &echo["headers"];
    assert_eq!(h["x-custom"][0], "one");
    for hop in [
        "x-secret",
        "keep-alive",
        "proxy-authorization",
        "connection",
    ] {
        assert!(h.get(hop).is_none(), "{hop} was forwarded: {h}");
    }
    assert_eq!(h["x-forwarded-for"][0], "198.51.100.7, 127.0.0.1");
    assert_eq!(h["x-forwarded-proto"][0], "http");
    assert_eq!(h["x-forwarded-host"][0], sluice.addr.to_string());
    // The upstream sees its own authority, as with nginx's proxy_pass.
    assert_eq!(h["host"][0], _up.addr.to_string());
}

#[tokio::test]
async fn upstream_base_path_is_prepended() {
    let (_up, sluice) = setup().await;
    let reply = get(&sluice.url("/based/x?y=1"), &[]).await;
    assert_eq!(reply.json()["uri"], "/base/based/x?y=1");
}

#[tokio::test]
async fn strips_hop_by_hop_headers_from_responses() {
    let (_up, sluice) = setup().await;
    let reply = get(&sluice.url("/status/201"), &[]).await;
    assert_eq!(reply.status, StatusCode::CREATED);
    assert_eq!(reply.header("x-upstream"), Some("yes"));
    assert!(reply.header("keep-alive").is_none());
    // A field the upstream's `Connection` names is the connection's too.
    assert!(reply.header("x-secret").is_none());
    assert!(reply.header("connection").is_none());
}

#[tokio::test]
async fn routes_by_specificity_method_and_host() {
    let (_up, sluice) = setup().await;
    let ping = get(&sluice.url("/ping"), &[]).await;
    assert_eq!(&ping.body[..], b"pong");
    // POST /ping does not match the GET-only route: it falls to the prefix "/".
    let c = client();
    let post = send(
        &c,
        Request::post(sluice.url("/ping")).body(empty()).unwrap(),
    )
    .await;
    assert_eq!(post.json()["method"], "POST");
    let hosted = get(&sluice.url("/hosted"), &[("host", "API.example.com:8080")]).await;
    assert_eq!(&hosted.body[..], b"hosted");
    let other = get(&sluice.url("/hosted"), &[("host", "other.example.com")]).await;
    assert_eq!(other.json()["uri"], "/hosted");
}

async fn assert_problem(reply: &Reply, status: StatusCode) {
    assert_eq!(reply.status, status);
    assert_eq!(
        reply.header("content-type"),
        Some("application/problem+json")
    );
    let p = reply.json();
    assert_eq!(p["status"], status.as_u16());
    assert!(p["title"].is_string() && p["detail"].is_string(), "{p}");
}

#[tokio::test]
async fn no_route_is_404() {
    let up = Upstream::start().await;
    let cfg = format!(
        "[upstreams.api]\nurl = \"{}\"\n[[routes]]\npath = \"/api\"\nupstream = \"api\"\n",
        up.url()
    );
    let sluice = Sluice::start(&cfg).await;
    assert_problem(
        &get(&sluice.url("/other"), &[]).await,
        StatusCode::NOT_FOUND,
    )
    .await;
    assert_eq!(up.hits(), 0);
}

#[tokio::test]
async fn refused_upstream_is_502_at_once() {
    let (_up, sluice) = setup().await;
    let started = Instant::now();
    let reply = get(&sluice.url("/dead"), &[]).await;
    assert_problem(&reply, StatusCode::BAD_GATEWAY).await;
    assert!(
        started.elapsed() < Duration::from_millis(300),
        "took {:?}",
        started.elapsed()
    );
}

#[tokio::test]
async fn slow_upstream_is_504_after_upstream_timeout() {
    let (_up, sluice) = setup().await;
    let started = Instant::now();
    let reply = get(&sluice.url("/slow/5000"), &[]).await;
    assert_problem(&reply, StatusCode::GATEWAY_TIMEOUT).await;
    let took = started.elapsed();
    assert!(
        took >= Duration::from_millis(300) && took < Duration::from_secs(3),
        "took {took:?}"
    );
    // On one keep-alive connection (which keeps one timer for its requests):
    // a request answered within the timeout, a slow one that ends at its own
    // deadline (not at the first request's, 150 ms before), and one after it
    // that is not cut by an earlier deadline.
    let c = client();
    let ask = |path: &str| send(&c, Request::get(sluice.url(path)).body(empty()).unwrap());
    assert_eq!(ask("/slow/150").await.status, StatusCode::OK);
    let started = Instant::now();
    assert_problem(&ask("/slow/5000").await, StatusCode::GATEWAY_TIMEOUT).await;
    let took = started.elapsed();
    assert!(
        took >= Duration::from_millis(300) && took < Duration::from_secs(3),
        "took {took:?}"
    );
    assert_eq!(ask("/slow/100").await.status, StatusCode::OK);
}

#[tokio::test]
async fn oversized_headers_are_431_with_problem_body() {
    let (up, sluice) = setup().await;
    let big = "x".repeat(5000);
    let reply = get(&sluice.url("/"), &[("x-big", &big)]).await;
    assert_problem(&reply, StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE).await;
    // Far beyond the read buffer, hyper itself refuses; still a 431, never a crash.
    let huge = "y".repeat(200_000);
    let raw_reply = raw(
        sluice.addr,
        format!("GET / HTTP/1.1\r\nhost: a\r\nx-huge: {huge}\r\n\r\n").as_bytes(),
    )
    .await;
    assert!(raw_reply.starts_with("HTTP/1.1 431"), "{raw_reply}");
    assert_eq!(up.hits(), 0);
    // The server still serves.
    assert_eq!(get(&sluice.url("/ping"), &[]).await.status, StatusCode::OK);
}

/// A client speaking HTTP/2 with prior knowledge whose preface comes in
/// pieces is still served HTTP/2: the own server reads until it knows, then
/// hands every byte on.
#[tokio::test]
async fn an_http2_preface_in_pieces_is_still_http2() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let (_up, sluice) = setup().await;
    let mut s = tokio::net::TcpStream::connect(sluice.addr).await.unwrap();
    s.set_nodelay(true).unwrap();
    // The preface, then an empty SETTINGS frame.
    for piece in [
        &b"PRI * HTTP/2.0\r\n"[..],
        b"\r\nSM\r\n",
        b"\r\n",
        b"\0\0\0\x04\0\0\0\0\0",
    ] {
        s.write_all(piece).await.unwrap();
        tokio::task::yield_now().await;
    }
    // The server's first frame: its SETTINGS (type 4, stream 0).
    let mut frame = [0u8; 9];
    let read = tokio::time::timeout(Duration::from_secs(5), s.read_exact(&mut frame)).await;
    assert!(matches!(read, Ok(Ok(_))), "{read:?}");
    assert_eq!((frame[3], &frame[5..9]), (4, &[0u8; 4][..]), "{frame:?}");
}

#[tokio::test]
async fn malformed_requests_are_400_and_harmless() {
    let (up, sluice) = setup().await;
    let no_host = raw(sluice.addr, b"GET / HTTP/1.1\r\n\r\n").await;
    assert!(no_host.starts_with("HTTP/1.1 400"), "{no_host}");
    assert!(no_host.contains("application/problem+json"), "{no_host}");
    let two_hosts = raw(sluice.addr, b"GET / HTTP/1.1\r\nhost: a\r\nhost: b\r\n\r\n").await;
    assert!(two_hosts.starts_with("HTTP/1.1 400"), "{two_hosts}");
    // A connection that opens with no HTTP/1 request line at all (no
    // `HTTP/` version: here h2spec's invalid HTTP/2 preface, a TLS hello)
    // is closed unanswered, as an HTTP/2 server closes it (RFC 9113 3.4).
    for garbage in [
        &b"INVALID CONNECTION PREFACE\r\n\r\n"[..],
        b"\x00\x01\x02garbage\r\n\r\n",
        b"\x16\x03\x01\x00\x05\x01\x00\x00\x01\x00\r\n\r\n",
    ] {
        let reply = raw(sluice.addr, garbage).await;
        assert_eq!(reply, "", "{:?}", String::from_utf8_lossy(garbage));
    }
    // Heads that do not parse: sluice's own answer, and the connection closes.
    for garbage in [
        &b"GET /ping HTTP/1.1\r\nhost: a\r\n\r\n\x00\x01\x02garbage\r\n\r\n"[..],
        b"GET /\x7f HTTP/1.1\r\nhost: a\r\n\r\n",
        b"GET / HTTP/9.9\r\nhost: a\r\n\r\n",
        b"GET / HTTP/2.0\r\nhost: a\r\n\r\n",
        b"GET / HTTP/1.1\r\nbad header\r\n\r\n",
        b"GET /ping HTTP/1.1\r\nhost: a\r\n\r\nGET / HTTP/1.1\r\nx: \x01\r\n\r\n",
    ] {
        let reply = raw(sluice.addr, garbage).await;
        let (head, body) = reply.rsplit_once("\r\n\r\n").unwrap_or_default();
        assert!(
            head.contains("HTTP/1.1 400 Bad Request\r\n")
                && head.contains("content-type: application/problem+json\r\n")
                && head.contains("connection: close\r\n")
                && body.starts_with("{\"detail\":\"malformed request: invalid "),
            "{:?} -> {reply}",
            String::from_utf8_lossy(garbage)
        );
    }
    // Bodies framed wrongly: hyper's answer.
    for garbage in [
        &b"POST / HTTP/1.1\r\nhost: a\r\ncontent-length: -5\r\n\r\n"[..],
        b"POST / HTTP/1.1\r\nhost: a\r\ntransfer-encoding: chunked\r\n\r\nzz\r\n",
    ] {
        let reply = raw(sluice.addr, garbage).await;
        assert!(
            reply.starts_with("HTTP/1.1 400"),
            "{:?} -> {reply}",
            String::from_utf8_lossy(garbage)
        );
    }
    // Only the bad chunked body got as far as the upstream (its head was fine).
    assert!(up.hits() <= 1);
    assert_eq!(get(&sluice.url("/ping"), &[]).await.status, StatusCode::OK);
}

#[tokio::test]
async fn http2_prior_knowledge_is_served() {
    let (_up, sluice) = setup().await;
    let c = h2_client();
    let reply = send(&c, Request::get(sluice.url("/ping")).body(empty()).unwrap()).await;
    assert_eq!(reply.status, StatusCode::OK);
    assert_eq!(&reply.body[..], b"pong");
    let echo = send(
        &c,
        Request::get(sluice.url("/h2?x=1")).body(empty()).unwrap(),
    )
    .await;
    assert_eq!(echo.json()["uri"], "/h2?x=1");
    assert_eq!(
        echo.json()["headers"]["x-forwarded-host"][0],
        sluice.addr.to_string()
    );
}

/// sluice's own HTTP/2 server, with hyper's client: bodies larger than
/// every flow-control window pass both ways, on streams of one connection
/// at once. (Trailers over HTTP/2: tests/upstream_answers.rs.)
#[tokio::test]
async fn http2_bodies_beyond_the_windows_pass_on_streams_at_once() {
    let (_up, sluice) = setup().await;
    let c = h2_client();
    const N: u64 = 3 * 1024 * 1024;
    let mut streams = Vec::new();
    for i in 0..6 {
        let c = c.clone();
        let (up, down) = (sluice.url("/upload"), sluice.url(&format!("/bytes/{N}")));
        streams.push(tokio::spawn(async move {
            if i % 2 == 0 {
                let r = send(&c, Request::post(up).body(chunked_body(N)).unwrap()).await;
                assert_eq!((r.status, r.body), (StatusCode::OK, N.to_string().into()));
            } else {
                let r = send(&c, Request::get(down).body(empty()).unwrap()).await;
                assert_eq!((r.status, r.body.len() as u64), (StatusCode::OK, N));
            }
        }));
    }
    for s in streams {
        s.await.unwrap();
    }
}

#[tokio::test]
async fn keeps_upstream_connections_alive() {
    let (_up, sluice) = setup().await;
    // Sequential requests reuse one pooled upstream connection: the upstream
    // sees them all from the same peer port.
    let c = client();
    let mut peers = std::collections::HashSet::new();
    for _ in 0..20 {
        let reply = send(&c, Request::get(sluice.url("/k")).body(empty()).unwrap()).await;
        assert_eq!(reply.status, StatusCode::OK);
        peers.insert(reply.json()["peer"].to_string());
    }
    assert_eq!(peers.len(), 1, "{peers:?}");
}

#[tokio::test]
async fn graceful_shutdown_finishes_requests_in_flight() {
    let (up, sluice) = setup().await;
    let url = sluice.url("/slow/150");
    let in_flight = tokio::spawn(async move { get(&url, &[]).await });
    wait_until(|| up.hits() == 1).await;
    let addr = sluice.addr;
    sluice.shutdown().await;
    let reply = in_flight.await.unwrap();
    assert_eq!(reply.status, StatusCode::OK);
    assert!(
        tokio::net::TcpStream::connect(addr).await.is_err(),
        "still accepting"
    );
}

#[tokio::test]
async fn graceful_shutdown_closes_idle_and_silent_connections_at_once() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let (_up, sluice) = setup().await;
    // Connected first, so it has been accepted once the second is answered;
    // it never sends a byte.
    let mut silent = tokio::net::TcpStream::connect(sluice.addr).await.unwrap();
    let mut used = tokio::net::TcpStream::connect(sluice.addr).await.unwrap();
    used.write_all(b"GET /x HTTP/1.1\r\nhost: x\r\n\r\n")
        .await
        .unwrap();
    let mut head = Vec::new();
    while !head.windows(4).any(|w| w == b"\r\n\r\n") {
        let mut buf = [0u8; 1024];
        let n = used.read(&mut buf).await.unwrap();
        assert!(n > 0, "closed before answering");
        head.extend_from_slice(&buf[..n]);
    }
    assert!(head.starts_with(b"HTTP/1.1 200"), "{head:?}");
    // Both connections are now idle. server.shutdown_timeout is 10 s: a
    // connection not told to close would hold the shutdown that long.
    tokio::time::timeout(std::time::Duration::from_secs(5), sluice.shutdown())
        .await
        .expect("shutdown waited for idle connections");
    let mut rest = Vec::new();
    used.read_to_end(&mut rest).await.unwrap();
    assert_eq!(silent.read(&mut [0u8; 1]).await.unwrap(), 0);
}

#[tokio::test]
async fn reload_swaps_routes_keeps_counters_and_refuses_bad_files() {
    let up = Upstream::start().await;
    let policy = "[policies.p]\nlimits = [{ limit = 3, window = \"1h\" }]\n";
    let cfg = |body: &str| {
        format!(
            "[upstreams.api]\nurl = \"{}\"\n{policy}[[routes]]\npath = \"=/ping\"\nrespond = {{ status = 200, body = \"{body}\" }}\npolicy = \"p\"\n",
            up.url()
        )
    };
    let s = Sluice::start(&cfg("one")).await;
    assert_eq!(
        get(&s.url("/ping"), &[])
            .await
            .header_u64("x-ratelimit-remaining"),
        2
    );
    let dir = std::env::temp_dir().join(format!("sluice-reload-in-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("config.toml");
    std::fs::write(&file, cfg("two")).unwrap();
    s.proxy.reload(&file).unwrap();
    let r = get(&s.url("/ping"), &[]).await;
    assert_eq!(&r.body[..], b"two");
    assert_eq!(
        r.header_u64("x-ratelimit-remaining"),
        1,
        "counters survive a reload"
    );
    std::fs::write(&file, "[[routes]]\npath = \"/\"\nupstream = \"nope\"\n").unwrap();
    let err = s.proxy.reload(&file).unwrap_err().to_string();
    assert!(err.contains("unknown upstream 'nope'"), "{err}");
    assert_eq!(&get(&s.url("/ping"), &[]).await.body[..], b"two");
    assert_eq!(
        s.metric("sluice_config_reloads_total{result=\"ok\"}").await,
        1.0
    );
    assert_eq!(
        s.metric("sluice_config_reloads_total{result=\"error\"}")
            .await,
        1.0
    );
    std::fs::remove_dir_all(&dir).ok();
}

#[tokio::test]
async fn requests_are_counted_by_route_and_status_across_a_reload() {
    // 200 and 429 are statuses a route keeps its counters for; 418 is not,
    // and an unmatched request has no route.
    let cfg = "[policies.p]\nlimits = [{ limit = 2, window = \"1h\" }]\n\
               [[routes]]\npath = \"=/ok\"\nrespond = { status = 200, body = \"ok\" }\npolicy = \"p\"\n\
               [[routes]]\npath = \"=/teapot\"\nrespond = { status = 418, body = \"tea\" }\n";
    let s = Sluice::start(cfg).await;
    let ok = "sluice_requests_total{route=\"=/ok\",status=\"200\"}";
    let limited = "sluice_requests_total{route=\"=/ok\",status=\"429\"}";
    let teapot = "sluice_requests_total{route=\"=/teapot\",status=\"418\"}";
    let unrouted = "sluice_requests_total{route=\"-\",status=\"404\"}";
    assert_eq!(get(&s.url("/ok"), &[]).await.status, 200);
    assert_eq!(get(&s.url("/teapot"), &[]).await.status, 418);
    assert_eq!(get(&s.url("/none"), &[]).await.status, 404);
    assert_eq!(s.metric(ok).await, 1.0);
    assert_eq!(
        s.metric(limited).await,
        0.0,
        "no series before its first request"
    );
    assert_eq!(s.metric(teapot).await, 1.0);
    assert_eq!(s.metric(unrouted).await, 1.0);

    // A reload makes new routes; their requests add to the same series.
    let dir = std::env::temp_dir().join(format!("sluice-count-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("config.toml");
    std::fs::write(&file, cfg).unwrap();
    s.proxy.reload(&file).unwrap();
    assert_eq!(get(&s.url("/ok"), &[]).await.status, 200);
    assert_eq!(get(&s.url("/ok"), &[]).await.status, 429);
    assert_eq!(get(&s.url("/teapot"), &[]).await.status, 418);
    assert_eq!(s.metric(ok).await, 2.0);
    assert_eq!(s.metric(limited).await, 1.0);
    assert_eq!(s.metric(teapot).await, 2.0);
    assert_eq!(s.metric(unrouted).await, 1.0);
    std::fs::remove_dir_all(&dir).ok();
}

/// Asks the test upstream for its `echo` upgrade; returns the connection and
/// the response head, read byte by byte so nothing after it is consumed.
async fn open_echo_tunnel(addr: std::net::SocketAddr) -> (tokio::net::TcpStream, String) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut conn = tokio::net::TcpStream::connect(addr).await.unwrap();
    conn.write_all(
        // `websocket`: the upgrade a route passes by default; the test
        // upstream answers any upgrade with its own.
        b"GET /upgrade HTTP/1.1\r\nhost: x\r\nconnection: Upgrade\r\nupgrade: websocket\r\n\r\n",
    )
    .await
    .unwrap();
    let mut head = Vec::new();
    while !head.ends_with(b"\r\n\r\n") {
        let mut byte = [0u8; 1];
        conn.read_exact(&mut byte).await.unwrap();
        head.push(byte[0]);
    }
    (conn, String::from_utf8(head).unwrap())
}

#[tokio::test]
async fn upgrade_requests_pass_through_both_ways() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let (up, sluice) = setup().await;
    let (mut conn, head) = open_echo_tunnel(sluice.addr).await;
    let head = head.to_ascii_lowercase();
    assert!(head.starts_with("http/1.1 101"), "{head}");
    assert!(head.contains("upgrade: echo"), "{head}");
    for message in [&b"hello"[..], b"through the proxy"] {
        conn.write_all(message).await.unwrap();
        let mut back = vec![0u8; message.len()];
        conn.read_exact(&mut back).await.unwrap();
        assert_eq!(back, message);
    }
    assert_eq!(up.hits(), 1);
}

#[tokio::test]
async fn round_robin_skips_a_server_that_refuses_connections() {
    let (a, b) = (Upstream::start().await, Upstream::start().await);
    let dead = dead_port().await;
    let cfg = format!(
        "[upstreams.pool]\nurls = [\"http://{dead}\", \"{}\", \"{}\"]\n[[routes]]\npath = \"/\"\nupstream = \"pool\"\n",
        a.url(),
        b.url()
    );
    let s = Sluice::start(&cfg).await;
    let mut statuses = Vec::new();
    for _ in 0..13 {
        statuses.push(get(&s.url("/"), &[]).await.status);
    }
    // The dead server costs one 502, then is skipped.
    let failed = statuses
        .iter()
        .filter(|s| **s == StatusCode::BAD_GATEWAY)
        .count();
    assert_eq!(failed, 1, "{statuses:?}");
    // The live ones share the rest.
    assert_eq!(a.hits() + b.hits(), 12);
    assert!(
        a.hits() >= 4 && b.hits() >= 4,
        "{} / {}",
        a.hits(),
        b.hits()
    );
}

/// Upstream connections are kept alive and reused: one after another, the
/// requests share one connection; ten at once open at most ten, and the next
/// ten reuse them.
#[tokio::test]
async fn upstream_connections_are_pooled_and_reused() {
    let up = Upstream::start().await;
    let s = Sluice::start(&proxy_to(&up.url())).await;
    for _ in 0..5 {
        assert_eq!(get(&s.url("/a"), &[]).await.status, StatusCode::OK);
    }
    assert_eq!(up.conns.load(std::sync::atomic::Ordering::SeqCst), 1);

    let url = s.url("/b");
    let burst = || async {
        let replies = futures_util::future::join_all((0..10).map(|_| get(&url, &[]))).await;
        assert!(replies.iter().all(|r| r.status == StatusCode::OK));
    };
    burst().await;
    let after_first = up.conns.load(std::sync::atomic::Ordering::SeqCst);
    assert!(
        after_first <= 10,
        "{after_first} connections for 10 requests"
    );
    burst().await;
    assert_eq!(
        up.conns.load(std::sync::atomic::Ordering::SeqCst),
        after_first,
        "the second burst reuses the pooled connections"
    );
    assert_eq!(up.hits(), 25);
}

/// An upstream's `keepalive` bounds the idle connections kept, and
/// `keepalive_timeout` how long one may wait: `0` keeps none, and a
/// connection idle past its timeout is not reused.
#[tokio::test]
async fn keepalive_settings_bound_the_idle_connections() {
    use std::sync::atomic::Ordering::SeqCst;
    let up = Upstream::start().await;
    let cfg = |keep: &str| {
        format!(
            "[upstreams.api]\nurl = \"{}\"\n{keep}\n[[routes]]\npath = \"/\"\nupstream = \"api\"\n",
            up.url()
        )
    };
    let none = Sluice::start(&cfg("keepalive = 0")).await;
    for _ in 0..3 {
        assert_eq!(get(&none.url("/a"), &[]).await.status, StatusCode::OK);
    }
    wait_until(|| up.conns.load(SeqCst) == 3).await;
    let clock = sluice::clock::Clock::system();
    let short = Sluice::start_with_clock(&cfg("keepalive_timeout = \"1s\""), clock).await;
    get(&short.url("/a"), &[]).await;
    get(&short.url("/a"), &[]).await;
    assert_eq!(up.conns.load(SeqCst), 4, "reused within its timeout");
    // Idle past its timeout (the pool reads the coarse clock, not the test's).
    tokio::time::sleep(std::time::Duration::from_millis(1_100)).await;
    get(&short.url("/a"), &[]).await;
    assert_eq!(
        up.conns.load(SeqCst),
        5,
        "a connection idle past its timeout is not reused"
    );
}

/// An upstream that answers the first request of each connection and closes
/// the connection, unanswered, when a second one arrives on it: an idle
/// timeout running out just as a pooled connection is used. Returns its URL,
/// and the connections and requests it has seen.
async fn closing_upstream() -> (String, Arc<AtomicU64>, Arc<AtomicU64>) {
    use tokio::io::AsyncWriteExt;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let (conns, requests) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
    let (c, r) = (conns.clone(), requests.clone());
    tokio::spawn(async move {
        while let Ok((mut stream, _)) = listener.accept().await {
            c.fetch_add(1, SeqCst);
            let r = r.clone();
            tokio::spawn(async move {
                for n in 0.. {
                    if !read_request_head(&mut stream).await {
                        return;
                    }
                    r.fetch_add(1, SeqCst);
                    if n > 0 {
                        return;
                    }
                    let ok = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok";
                    if stream.write_all(ok).await.is_err() {
                        return;
                    }
                }
            });
        }
    });
    (url, conns, requests)
}

#[tokio::test]
async fn a_safe_request_lost_with_an_idle_pooled_connection_is_sent_again() {
    let (url, conns, requests) = closing_upstream().await;
    let s = Sluice::start(&proxy_to(&url)).await;
    assert_eq!(get(&s.url("/a"), &[]).await.status, StatusCode::OK);
    // Idle long enough to look like an idle timeout (REPLAY_AFTER_IDLE).
    tokio::time::sleep(Duration::from_millis(150)).await;
    let again = get(&s.url("/b"), &[]).await;
    assert_eq!(again.status, StatusCode::OK);
    assert_eq!(&again.body[..], b"ok");
    // Sent on the pooled connection, lost, then sent on a new one.
    assert_eq!((conns.load(SeqCst), requests.load(SeqCst)), (2, 3));

    // Nor is one that may change something (a DELETE: no body, so it goes
    // sluice's own way, on the connection just used).
    tokio::time::sleep(Duration::from_millis(150)).await;
    let delete = send(
        &client(),
        Request::delete(s.url("/d")).body(empty()).unwrap(),
    )
    .await;
    assert_eq!(delete.status, StatusCode::BAD_GATEWAY);
    assert_eq!((conns.load(SeqCst), requests.load(SeqCst)), (2, 4));

    // A request with a body is not sent twice either: the client hears of
    // the loss. (Requests with a body go hyper's way, with idle connections
    // of their own: the first opens one, the second finds it closed.)
    let c = client();
    let post = |path: &str| {
        send(
            &c,
            Request::post(s.url(path))
                .body(
                    Full::new(bytes::Bytes::from("payload"))
                        .map_err(|e| match e {})
                        .boxed(),
                )
                .unwrap(),
        )
    };
    assert_eq!(post("/c").await.status, StatusCode::OK);
    assert_eq!((conns.load(SeqCst), requests.load(SeqCst)), (3, 5));
    tokio::time::sleep(Duration::from_millis(150)).await;
    assert_eq!(post("/c").await.status, StatusCode::BAD_GATEWAY);
    assert_eq!((conns.load(SeqCst), requests.load(SeqCst)), (3, 6));
}

#[tokio::test]
async fn connections_without_a_request_close_after_header_timeout() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let up = Upstream::start().await;
    let sluice = Sluice::start(&format!(
        "[server]\nheader_timeout = \"200ms\"\nupstream_timeout = \"5s\"\n{}",
        proxy_to(&up.url())
    ))
    .await;
    // Reads until the server closes the connection; returns what came and when.
    async fn until_closed(s: &mut tokio::net::TcpStream) -> (String, Duration) {
        let started = Instant::now();
        let mut out = Vec::new();
        let read = tokio::time::timeout(Duration::from_secs(5), s.read_to_end(&mut out)).await;
        assert!(read.is_ok(), "still open after 5 s");
        (
            String::from_utf8_lossy(&out).into_owned(),
            started.elapsed(),
        )
    }

    // An upgraded connection (a tunnel) is no longer HTTP: it must outlive
    // the timeout. It is used again once the checks below have waited it out.
    let (mut tunnel, head) = open_echo_tunnel(sluice.addr).await;
    assert!(head.starts_with("HTTP/1.1 101"), "{head}");
    let tunnel_opened = Instant::now();

    // A head that never ends.
    let mut slow = tokio::net::TcpStream::connect(sluice.addr).await.unwrap();
    slow.write_all(b"GET / HTTP/1.1\r\nhost: a\r\n")
        .await
        .unwrap();
    let (got, took) = until_closed(&mut slow).await;
    assert!(got.is_empty(), "{got}");
    assert!(took >= Duration::from_millis(150), "closed after {took:?}");

    // A kept-alive connection after its response: closed once idle.
    let mut idle = tokio::net::TcpStream::connect(sluice.addr).await.unwrap();
    idle.write_all(b"GET / HTTP/1.1\r\nhost: a\r\n\r\n")
        .await
        .unwrap();
    let (got, took) = until_closed(&mut idle).await;
    assert!(got.starts_with("HTTP/1.1 200"), "{got}");
    assert!(took >= Duration::from_millis(150), "closed after {took:?}");

    // Requests in flight for longer than the timeout, waiting for the
    // upstream's head or for the rest of its body, are not cut short, and
    // their connection stays usable.
    let mut busy = tokio::net::TcpStream::connect(sluice.addr).await.unwrap();
    busy.write_all(b"GET /slow/600 HTTP/1.1\r\nhost: a\r\n\r\nGET /drip/600 HTTP/1.1\r\nhost: a\r\n\r\nGET / HTTP/1.1\r\nhost: a\r\nconnection: close\r\n\r\n")
        .await
        .unwrap();
    let (got, _) = until_closed(&mut busy).await;
    assert!(got.starts_with("HTTP/1.1 200"), "{got}");
    assert!(got.contains("slow"), "{got}");
    assert!(got.contains("2\r\ndr\r\n2\r\nip\r\n0\r\n"), "{got}");
    assert_eq!(got.matches("HTTP/1.1 200").count(), 3, "{got}");

    assert!(tunnel_opened.elapsed() >= Duration::from_millis(400));
    tunnel.write_all(b"still there").await.unwrap();
    let mut back = [0u8; 11];
    tunnel.read_exact(&mut back).await.unwrap();
    assert_eq!(&back, b"still there");
}

/// One client connection whose requests are served by sluice's own HTTP/1.1
/// server until one with a large body hands the connection to hyper's
/// (small ones are read whole by the own server), read by a
/// strict HTTP/1.1 client (hyper's) that fails on any framing error.
#[tokio::test]
async fn one_connection_goes_from_the_own_server_to_hypers_intact() {
    let (up, sluice) = setup().await;
    let stream = tokio::net::TcpStream::connect(sluice.addr).await.unwrap();
    let (mut conn, driver) =
        hyper::client::conn::http1::handshake::<_, BoxBody>(hyper_util::rt::TokioIo::new(stream))
            .await
            .unwrap();
    tokio::spawn(driver);
    let authority = sluice.addr.to_string();
    let mut ask = async |method: &str, path: &str, body: BoxBody| {
        let req = Request::builder()
            .method(method)
            .uri(path)
            .header("host", &authority)
            .body(body)
            .unwrap();
        let resp = conn.send_request(req).await.expect("connection lost");
        let (parts, body) = resp.into_parts();
        let body = body.collect().await.expect("body cut short").to_bytes();
        (parts, body)
    };

    let (echo, body) = ask("GET", "/items?q=1", empty()).await;
    assert_eq!(echo.status, StatusCode::OK);
    assert!(echo.headers.contains_key("date"));
    let seen: serde_json::Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(seen["uri"], "/items?q=1");
    // The upstream streams it chunked; it arrives whole, in its framing.
    let (big, body) = ask("GET", "/bytes/300000", empty()).await;
    assert_eq!((big.status, body.len()), (StatusCode::OK, 300_000));
    let (head, body) = ask("HEAD", "/bytes/10", empty()).await;
    assert_eq!((head.status, body.len()), (StatusCode::OK, 0));
    for code in [204u16, 304] {
        let (bodiless, body) = ask("GET", &format!("/status/{code}"), empty()).await;
        assert_eq!((bodiless.status.as_u16(), body.len()), (code, 0));
        assert!(!bodiless.headers.contains_key("keep-alive"));
    }
    // `=/ping` is exact: a longer path goes upstream.
    let (longer, _) = ask("GET", "/ping/not-a-route", empty()).await;
    assert_eq!(longer.status, StatusCode::OK, "/ping/... goes upstream");
    // sluice's own answer: dated too.
    let (pong, body) = ask("GET", "/ping", empty()).await;
    assert_eq!((pong.status, &body[..]), (StatusCode::OK, &b"pong"[..]));
    assert!(pong.headers.contains_key("date"));
    // A small body is read here, and goes the own way.
    let upload = Full::new(bytes::Bytes::from_static(b"hello")).map_err(|e| match e {});
    let (uploaded, body) = ask("POST", "/upload", upload.boxed()).await;
    assert_eq!((uploaded.status, &body[..]), (StatusCode::OK, &b"5"[..]));
    assert_eq!(up.conns.load(SeqCst), 1, "the own pool's connection");
    // A large body: from here on hyper's server has the connection.
    let large = bytes::Bytes::from(vec![b'x'; sluice::front::MAX_BODY + 1]);
    let upload = Full::new(large).map_err(|e| match e {});
    let (uploaded, body) = ask("POST", "/upload", upload.boxed()).await;
    let size = (sluice::front::MAX_BODY + 1).to_string();
    assert_eq!(
        (uploaded.status, &body[..]),
        (StatusCode::OK, size.as_bytes())
    );
    let (after, body) = ask("GET", "/bytes/70000", empty()).await;
    assert_eq!((after.status, body.len()), (StatusCode::OK, 70_000));
    assert_eq!(
        up.conns.load(SeqCst),
        2,
        "own and hyper's upstream pools, one each"
    );
}

/// Pipelined requests are answered in order; `Connection: close` gets it
/// back, once, and the connection ends after that answer.
#[tokio::test]
async fn pipelined_requests_and_connection_close() {
    let (_up, sluice) = setup().await;
    let out = raw(
        sluice.addr,
        b"GET /a HTTP/1.1\r\nHost: x\r\n\r\nGET /ping HTTP/1.1\r\nHost: x\r\n\r\n\
          GET /b HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\nGET /never HTTP/1.1\r\nHost: x\r\n\r\n",
    )
    .await;
    let statuses: Vec<&str> = out.matches("HTTP/1.1 200 OK\r\n").collect();
    assert_eq!(statuses.len(), 3, "{out}");
    assert!(out.find("\"/a\"") < out.find("pong") && out.find("pong") < out.find("\"/b\""));
    assert!(!out.contains("/never"), "{out}");
    assert_eq!(
        out.to_ascii_lowercase()
            .matches("connection: close")
            .count(),
        1,
        "{out}"
    );

    // An error sluice answers itself closes the connection, saying so once.
    let out = raw(
        sluice.addr,
        b"GET / HTTP/1.1\r\n\r\nGET / HTTP/1.1\r\nHost: x\r\n\r\n",
    )
    .await;
    assert!(out.starts_with("HTTP/1.1 400 Bad Request\r\n"), "{out}");
    let answers = out.lines().filter(|l| l.starts_with("HTTP/1.1 ")).count();
    assert_eq!(answers, 1, "{out}");
    assert_eq!(
        out.to_ascii_lowercase()
            .matches("connection: close")
            .count(),
        1,
        "{out}"
    );
}

/// Between requests a connection gives its read buffer back, and takes one
/// again when bytes arrive (`front::read_more`). Heads that arrive in pieces,
/// on two keep-alive connections taking turns, each get their own answer.
#[tokio::test]
async fn heads_in_pieces_on_connections_taking_turns() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    // Reads until the answer naming `path` is in; returns all that was read.
    async fn answer(conn: &mut tokio::net::TcpStream, path: &str) -> String {
        let mut got = Vec::new();
        let want = format!("\"{path}\"");
        while !String::from_utf8_lossy(&got).contains(&want) {
            let mut chunk = [0u8; 4096];
            let n = tokio::time::timeout(Duration::from_secs(5), conn.read(&mut chunk))
                .await
                .expect("an answer in time")
                .unwrap();
            assert!(n > 0, "closed before the answer for {path}: {got:?}");
            got.extend_from_slice(&chunk[..n]);
        }
        String::from_utf8(got).unwrap()
    }
    let (_up, sluice) = setup().await;
    let mut a = tokio::net::TcpStream::connect(sluice.addr).await.unwrap();
    let mut b = tokio::net::TcpStream::connect(sluice.addr).await.unwrap();
    for round in 0..3 {
        // A's head starts, then waits while B is served whole.
        a.write_all(b"GET /a").await.unwrap();
        b.write_all(format!("GET /b{round} HTTP/1.1\r\nHost: x\r\n\r\n").as_bytes())
            .await
            .unwrap();
        let out = answer(&mut b, &format!("/b{round}")).await;
        assert!(out.starts_with("HTTP/1.1 200 OK\r\n"), "{out}");
        assert!(!out.contains("/a"), "{out}");
        a.write_all(format!("{round} HTTP/1.1\r\nHost: x\r\n\r\n").as_bytes())
            .await
            .unwrap();
        let out = answer(&mut a, &format!("/a{round}")).await;
        assert!(out.starts_with("HTTP/1.1 200 OK\r\n"), "{out}");
        assert_eq!(out.matches("HTTP/1.1 ").count(), 1, "{out}");
    }
}

/// An idle keep-alive connection holds no read buffer: it gives it to its
/// thread's spares (the server runs on this test's thread, so they can be
/// counted here). Three requests held by the upstream at once (for 500 ms,
/// so that all three are read before the first is answered even on a busy
/// machine) need three buffers; once all three connections wait for their
/// next request, the three are spare. Were the buffers kept, the count would
/// only have dropped.
#[tokio::test]
async fn idle_connections_give_their_read_buffers_back() {
    use tokio::io::AsyncWriteExt;
    let up = Upstream::start().await;
    let sluice = Sluice::start(&format!(
        "[server]\nupstream_timeout = \"5s\"\n{}",
        proxy_to(&up.url())
    ))
    .await;
    let before = sluice::front::spare_read_buffers();
    let mut conns = Vec::new();
    for i in 0..3 {
        let mut conn = tokio::net::TcpStream::connect(sluice.addr).await.unwrap();
        conn.write_all(format!("GET /slow/500?{i} HTTP/1.1\r\nHost: x\r\n\r\n").as_bytes())
            .await
            .unwrap();
        conns.push(conn);
    }
    for conn in &mut conns {
        let got = tokio::time::timeout(Duration::from_secs(5), read_head(conn))
            .await
            .expect("an answer in time")
            .expect("an answer before the connection closed");
        assert!(got.starts_with("HTTP/1.1 200 OK\r\n"), "{got}");
    }
    assert_eq!(up.hits(), 3);
    // The connections' tasks put their buffers back before they wait.
    let want = before.max(3);
    wait_until(|| sluice::front::spare_read_buffers() == want).await;
    drop(conns);
}

/// A head too large for the own server's buffer goes to hyper's with what
/// was read: either way, one over `max_header_bytes` is a 431 and one under
/// it is served.
#[tokio::test]
async fn large_heads_are_judged_alike_by_both_servers() {
    let (_up, sluice) = setup().await;
    for (size, status) in [(3_000, "200"), (6_000, "431"), (12_000, "431")] {
        let head = format!(
            "GET /x HTTP/1.1\r\nHost: x\r\nX-Big: {}\r\nConnection: close\r\n\r\n",
            "a".repeat(size)
        );
        let out = raw(sluice.addr, head.as_bytes()).await;
        assert!(
            out.starts_with(&format!("HTTP/1.1 {status} ")),
            "{size}: {out}"
        );
    }
}

/// A client that hangs up while its request waits on the upstream cancels
/// the request: the upstream sees its connection close, long before any
/// timeout of sluice's would have ended it.
#[tokio::test]
async fn a_client_that_hangs_up_cancels_its_request() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let upstream = listener.local_addr().unwrap();
    let (got_head, head_seen) = tokio::sync::oneshot::channel();
    let (got_eof, eof_seen) = tokio::sync::oneshot::channel();
    tokio::spawn(async move {
        let (mut s, _) = listener.accept().await.unwrap();
        assert!(read_request_head(&mut s).await);
        let _ = got_head.send(());
        // Never answers; reports the connection's end.
        let mut rest = [0u8; 64];
        let _ = got_eof.send(matches!(s.read(&mut rest).await, Ok(0) | Err(_)));
    });
    let sluice = Sluice::start(&format!(
        "[server]\nupstream_timeout = \"60s\"\n{}",
        proxy_to(&format!("http://{upstream}"))
    ))
    .await;
    let mut client = tokio::net::TcpStream::connect(sluice.addr).await.unwrap();
    client
        .write_all(b"GET /wait HTTP/1.1\r\nHost: x\r\n\r\n")
        .await
        .unwrap();
    head_seen.await.unwrap();
    drop(client);
    let closed = tokio::time::timeout(Duration::from_secs(5), eof_seen)
        .await
        .expect("the upstream exchange outlived its client");
    assert!(closed.unwrap());
}
