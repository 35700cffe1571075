//! Spellings a client could use to walk around a route and its policy:
//! paths (encoded slashes, dot segments, `;` parameters, bad escapes),
//! methods, hosts, header names with `_`, `Upgrade: h2c`, and an upstream
//! answer framed twice. Each is sent on both of sluice's paths: its own
//! (a request without a body) and hyper's (one with a body, or HTTP/2), as
//! raw bytes where a client library would not send the spelling.

#[macro_use]
mod support;

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http::{Method, Request, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper_util::rt::{TokioExecutor, TokioIo};
use support::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// The two ways a request goes through sluice.
#[derive(Clone, Copy, Debug)]
enum Way {
    /// No body: sluice's own front and upstream client.
    Own,
    /// A body: hyper's server and client.
    Hyper,
}

const WAYS: [Way; 2] = [Way::Own, Way::Hyper];

/// An answer read off a raw connection.
#[derive(Debug)]
struct Raw {
    status: u16,
    /// The head, lowercased.
    head: String,
    body: Vec<u8>,
}

impl Raw {
    /// Whether the route that answered has a policy (its answers carry
    /// rate-limit fields).
    fn limited(&self) -> bool {
        self.head.contains("\r\nx-ratelimit-limit:")
    }

    fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|_| panic!("not JSON: {}", String::from_utf8_lossy(&self.body)))
    }
}

/// Sends `method target` with `fields` (each `name: value`) the `way` says,
/// on a fresh connection, and reads one answer: its head, then the body its
/// `Content-Length` gives.
async fn exchange(addr: SocketAddr, way: Way, method: &str, target: &str, fields: &[&str]) -> Raw {
    let mut req = format!("{method} {target} HTTP/1.1\r\n");
    if !fields
        .iter()
        .any(|f| f.to_ascii_lowercase().starts_with("host:"))
    {
        req += "host: sluice.test\r\n";
    }
    for f in fields {
        req += f;
        req += "\r\n";
    }
    match way {
        Way::Own => req += "\r\n",
        Way::Hyper => req += "content-length: 2\r\n\r\nhi",
    }
    let mut conn = TcpStream::connect(addr).await.unwrap();
    conn.write_all(req.as_bytes()).await.unwrap();
    tokio::time::timeout(Duration::from_secs(5), read_answer(&mut conn))
        .await
        .unwrap_or_else(|_| panic!("no answer to {method} {target} ({way:?})"))
}

async fn read_answer(conn: &mut TcpStream) -> Raw {
    let mut buf = Vec::new();
    let head_end = loop {
        if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break i + 4;
        }
        let mut chunk = [0u8; 4096];
        let n = conn.read(&mut chunk).await.unwrap();
        assert!(
            n > 0,
            "closed before an answer: {:?}",
            String::from_utf8_lossy(&buf)
        );
        buf.extend_from_slice(&chunk[..n]);
    };
    let head = String::from_utf8_lossy(&buf[..head_end]).to_ascii_lowercase();
    let status = head[9..12].parse().unwrap();
    let length: usize = head
        .lines()
        .find_map(|l| l.strip_prefix("content-length: "))
        .map_or(0, |v| v.trim().parse().unwrap());
    let mut body = buf[head_end..].to_vec();
    while body.len() < length {
        let mut chunk = [0u8; 4096];
        let n = conn.read(&mut chunk).await.unwrap();
        assert!(n > 0, "body cut short");
        body.extend_from_slice(&chunk[..n]);
    }
    Raw { status, head, body }
}

/// sluice in front of the echo upstream: `/w/admin/` and `/m` (POST only)
/// are limited, host `api.example.com` too; everything else is not.
async fn start(up: &Upstream, server: &str) -> Sluice {
    Sluice::start(&format!(
        r#"
[server]
{server}

[upstreams.api]
url = "{}"
pass_host = true

[policies.wide]
limits = [{{ limit = 1000, window = "1h" }}]

[[routes]]
path = "/w/admin/"
upstream = "api"
policy = "wide"

[[routes]]
path = "/m"
methods = ["POST"]
upstream = "api"
policy = "wide"

[[routes]]
path = "/"
host = "api.example.com"
upstream = "api"
policy = "wide"

[[routes]]
path = "/"
upstream = "api"
"#,
        up.url()
    ))
    .await
}

/// A problem+json 400.
fn assert_refused(r: &Raw, what: &str) {
    assert_eq!(r.status, 400, "{what}: {}", r.head);
    assert!(
        r.head.contains("application/problem+json"),
        "{what}: {}",
        r.head
    );
}

#[tokio::test]
async fn encoded_slashes_and_hostile_escapes_are_refused_by_default() {
    let up = Upstream::start().await;
    let s = start(&up, "").await;
    for way in WAYS {
        for target in [
            "/w/admin%2Fx",
            "/w/admin%2fx",
            "/w/x/..%2Fadmin/x",
            "/w/x%2F..%2Fadmin/x",
            "/w/admin%5Cx",
            "/w/x\\..\\admin/x",
            // Double encoding: a slash to a backend that decodes twice.
            "/w/admin%252Fx",
            // Overlong UTF-8 for `/` and `.`, a lone continuation byte.
            "/w/x%C0%AF..%C0%AFadmin/x",
            "/w/x/%C0%AE%C0%AE/admin/x",
            "/w/x%E0%80%AFadmin",
            "/w/%80",
            // NUL, and a `%` that starts no escape.
            "/w/admin%00/x",
            "/w/admin%zz",
            "/w/admin%",
        ] {
            let r = exchange(s.addr, way, "GET", target, &[]).await;
            assert_refused(&r, &format!("{target} {way:?}"));
        }
    }
    assert_eq!(up.hits(), 0, "nothing refused reached the upstream");
}

#[tokio::test]
async fn spellings_of_a_path_meet_its_route_and_the_upstream_gets_what_matched() {
    let up = Upstream::start().await;
    let s = start(&up, "").await;
    for way in WAYS {
        for (target, forwarded) in [
            ("/w/admin/x", "/w/admin/x"),
            ("/w/admin;x/y", "/w/admin/y"),
            ("/w/admin;jsessionid=1/", "/w/admin/"),
            ("/w/x/..;y/admin/z", "/w/admin/z"),
            ("/w/x/%2e%2e/admin/x", "/w/admin/x"),
            ("/w/x/%2E%2e/admin/x", "/w/admin/x"),
            ("/w/./%61dmin//x", "/w/admin/x"),
            ("//w/admin/.", "/w/admin/"),
            // The query goes as it came.
            (
                "/w/x/../admin/?k=a%2Fb;c=..%2F",
                "/w/admin/?k=a%2Fb;c=..%2F",
            ),
        ] {
            let r = exchange(s.addr, way, "GET", target, &[]).await;
            assert_eq!(r.status, 200, "{target} {way:?}");
            assert!(r.limited(), "{target} {way:?} missed the limited route");
            assert_eq!(r.json()["uri"], forwarded, "{target} {way:?}");
        }
        // Escapes that are data stay escaped (uppercase), and decoded once.
        let r = exchange(s.addr, way, "GET", "/x/a%3bb/%252e%252e/c%3a", &[]).await;
        assert_eq!(r.json()["uri"], "/x/a%3Bb/%252e%252e/c%3A", "{way:?}");
        assert!(!r.limited());
    }
}

#[tokio::test]
async fn escaped_slashes_decode_or_keep() {
    let up = Upstream::start().await;
    let s = start(&up, r#"escaped_slashes = "decode""#).await;
    for way in WAYS {
        for target in [
            "/w/admin%2Fx",
            "/w/x/..%2Fadmin/x",
            "/w/x%2F..%2Fadmin/x",
            "/w\\admin\\x",
            "/w/admin%5cx",
        ] {
            let r = exchange(s.addr, way, "GET", target, &[]).await;
            assert_eq!(r.status, 200, "{target} {way:?}");
            assert!(r.limited(), "{target} {way:?} missed the limited route");
            assert_eq!(r.json()["uri"], "/w/admin/x", "{target} {way:?}");
        }
        // Still once: a double-encoded slash is the text `%2F`.
        let r = exchange(s.addr, way, "GET", "/w/admin%252Fx", &[]).await;
        assert_eq!(r.json()["uri"], "/w/admin%252Fx");
        assert!(!r.limited());
    }

    let s = start(&up, r#"escaped_slashes = "keep""#).await;
    for way in WAYS {
        // A character of its segment: not the route's `/w/admin/`.
        for (target, forwarded) in [
            ("/w/admin%2fx", "/w/admin%2Fx"),
            ("/w/x/..%2Fadmin/x", "/w/x/..%2Fadmin/x"),
            ("/w\\admin", "/w%5Cadmin"),
        ] {
            let r = exchange(s.addr, way, "GET", target, &[]).await;
            assert_eq!(r.status, 200, "{target} {way:?}");
            assert!(!r.limited(), "{target} {way:?}");
            assert_eq!(r.json()["uri"], forwarded, "{target} {way:?}");
        }
        // Overlong UTF-8 and NUL are refused whatever the mode.
        for target in ["/w/x%C0%AFadmin", "/w/%00"] {
            assert_refused(&exchange(s.addr, way, "GET", target, &[]).await, target);
        }
    }
}

#[tokio::test]
async fn lowercase_methods_are_refused() {
    let up = Upstream::start().await;
    let s = start(&up, "").await;
    for way in WAYS {
        for method in ["post", "Post", "get"] {
            let r = exchange(s.addr, way, method, "/m", &[]).await;
            assert_refused(&r, &format!("{method} {way:?}"));
        }
        let r = exchange(s.addr, way, "POST", "/m", &[]).await;
        assert_eq!(r.status, 200);
        assert!(r.limited());
    }
    // HTTP/2 too.
    let req = Request::builder()
        .method(Method::from_bytes(b"post").unwrap())
        .uri(s.url("/m"))
        .body(empty())
        .unwrap();
    assert_eq!(
        send(&h2_client(), req).await.status,
        StatusCode::BAD_REQUEST
    );
    assert_eq!(up.hits(), 2);
}

#[tokio::test]
async fn hosts_are_compared_lowercased_without_a_trailing_dot() {
    let up = Upstream::start().await;
    let s = start(&up, "").await;
    for way in WAYS {
        for host in [
            "api.example.com",
            "api.example.com.",
            "API.Example.COM.",
            "api.example.com.:8080",
        ] {
            let r = exchange(s.addr, way, "GET", "/x", &[&format!("Host: {host}")]).await;
            assert_eq!(r.status, 200, "{host} {way:?}");
            assert!(r.limited(), "{host} {way:?} missed the host's route");
            // Forwarded in the form that matched.
            let want = host.to_ascii_lowercase().replace(".:", ":");
            let want = want.trim_end_matches('.');
            assert_eq!(r.json()["headers"]["host"][0], want, "{host}");
            assert_eq!(r.json()["headers"]["x-forwarded-host"][0], want, "{host}");
        }
        for host in [
            "api.example.com:80:80",
            "api.example.com:http",
            "api.example.com:65536",
            "api.example.com..",
            "api..example.com",
            "api.example.com,other.example",
            "api%2Eexample.com",
            "[::1",
        ] {
            let r = exchange(s.addr, way, "GET", "/x", &[&format!("Host: {host}")]).await;
            assert_refused(&r, &format!("{host} {way:?}"));
        }
    }

    // HTTP/2's `:authority`, sent as written.
    let conn = TcpStream::connect(s.addr).await.unwrap();
    let (mut h2, driver) =
        hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(conn))
            .await
            .unwrap();
    tokio::spawn(driver);
    for authority in ["api.example.com.", "API.EXAMPLE.COM.:8443"] {
        let req = Request::get(format!("http://{authority}/x"))
            .body(empty())
            .unwrap();
        let resp = h2.send_request(req).await.unwrap();
        assert_eq!(resp.status(), StatusCode::OK, "{authority}");
        assert!(
            resp.headers().contains_key("x-ratelimit-limit"),
            "{authority}"
        );
    }
}

/// An absolute-form target names the host, whatever `Host` says (RFC 9112
/// 3.2.2); over HTTP/2, a `Host` that differs from `:authority` is refused.
#[tokio::test]
async fn the_target_s_authority_wins_over_host() {
    let up = Upstream::start().await;
    let s = start(&up, "").await;
    for way in WAYS {
        let r = exchange(
            s.addr,
            way,
            "GET",
            "http://api.example.com/x",
            &["Host: other.example"],
        )
        .await;
        assert_eq!(r.status, 200, "{way:?}");
        assert!(r.limited(), "{way:?}: routed by Host, not the target");
        assert_eq!(r.json()["headers"]["host"][0], "api.example.com");
    }
    let conn = TcpStream::connect(s.addr).await.unwrap();
    let (mut h2, driver) =
        hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(conn))
            .await
            .unwrap();
    tokio::spawn(driver);
    let req = Request::get("http://api.example.com/x")
        .header("host", "other.example")
        .body(empty())
        .unwrap();
    let resp = h2.send_request(req).await.unwrap();
    assert_eq!(resp.status(), StatusCode::BAD_REQUEST);
}

/// sluice with `underscore_headers = mode`, counting by `X_Key` and
/// passing `X-Api-Key` on.
async fn start_underscores(up: &Upstream, mode: &str) -> Sluice {
    Sluice::start(&format!(
        r#"
[server]
underscore_headers = "{mode}"

[upstreams.api]
url = "{}"

[policies.by_key]
key = "header:X_Key"
limits = [{{ limit = 1, window = "1h" }}]

[[routes]]
path = "/k"
upstream = "api"
policy = "by_key"

[[routes]]
path = "/"
upstream = "api"
"#,
        up.url()
    ))
    .await
}

const ALIASED: [&str; 3] = ["X-Api-Key: junk", "X_Api_Key: real", "x_api_key: also"];

#[tokio::test]
async fn underscore_headers_are_dropped_by_default_and_counted() {
    let up = Upstream::start().await;
    let s = start_underscores(&up, "drop").await;
    for way in WAYS {
        let r = exchange(s.addr, way, "GET", "/", &ALIASED).await;
        assert_eq!(r.status, 200);
        let headers = &r.json()["headers"];
        assert_eq!(headers["x-api-key"][0], "junk");
        assert!(headers.get("x_api_key").is_none(), "{headers}");
    }
    let dropped = "sluice_underscore_headers_total{action=\"dropped\"}";
    assert_eq!(s.metric(dropped).await, 4.0);
    // Gone before the identities are read: both are counted by address.
    let first = exchange(s.addr, Way::Own, "GET", "/k", &["X_Key: a"]).await;
    assert_eq!(first.status, 200);
    let second = exchange(s.addr, Way::Hyper, "GET", "/k", &["X_Key: b"]).await;
    assert_eq!(second.status, 429);
}

#[tokio::test]
async fn underscore_headers_can_be_refused_or_passed() {
    let up = Upstream::start().await;
    let s = start_underscores(&up, "reject").await;
    for way in WAYS {
        let r = exchange(s.addr, way, "GET", "/", &ALIASED).await;
        assert_refused(&r, &format!("{way:?}"));
        let plain = exchange(s.addr, way, "GET", "/", &["X-Api-Key: junk"]).await;
        assert_eq!(plain.status, 200);
    }
    let rejected = "sluice_underscore_headers_total{action=\"rejected\"}";
    assert_eq!(s.metric(rejected).await, 4.0);
    assert_eq!(up.hits(), 2);

    let s = start_underscores(&up, "pass").await;
    for way in WAYS {
        let r = exchange(s.addr, way, "GET", "/", &ALIASED).await;
        assert_eq!(r.status, 200);
        assert_eq!(
            r.json()["headers"]["x_api_key"],
            serde_json::json!(["real", "also"])
        );
    }
    // Kept, so each value is an identity of its own (on both ways: the
    // own front's name comparison once never matched a `_`).
    for (key, way) in ["X_Key: a", "X_Key: b", "X_Key: c", "X_Key: d"]
        .into_iter()
        .zip(WAYS.into_iter().cycle())
    {
        let r = exchange(s.addr, way, "GET", "/k", &[key]).await;
        assert_eq!(r.status, 200, "{key} {way:?}");
    }
}

/// An upstream on raw TCP: each connection's request (its head, and the
/// body its `Content-Length` gives) is noted in the returned list and
/// answered with `answer(head)`; `true` with it keeps the connection as a
/// tunnel that echoes every byte (as a backend that switched protocols).
async fn raw_upstream(
    answer: fn(&str) -> (Vec<u8>, bool),
) -> (SocketAddr, Arc<Mutex<Vec<String>>>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let seen = Arc::new(Mutex::new(Vec::new()));
    let noted = seen.clone();
    tokio::spawn(async move {
        while let Ok((mut conn, _)) = listener.accept().await {
            let noted = noted.clone();
            tokio::spawn(async move {
                let Some(got) = read_head(&mut conn).await else {
                    return;
                };
                let head_end = got.find("\r\n\r\n").unwrap() + 4;
                let head = got[..head_end].to_ascii_lowercase();
                let length: usize = head
                    .lines()
                    .find_map(|l| l.strip_prefix("content-length: "))
                    .map_or(0, |v| v.trim().parse().unwrap_or(0));
                let mut have = got.len() - head_end;
                while have < length {
                    let mut chunk = [0u8; 1024];
                    match conn.read(&mut chunk).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => have += n,
                    }
                }
                noted.lock().unwrap().push(head.clone());
                let (bytes, tunnel) = answer(&head);
                let _ = conn.write_all(&bytes).await;
                if tunnel {
                    let (mut r, mut w) = conn.split();
                    let _ = tokio::io::copy(&mut r, &mut w).await;
                }
            });
        }
    });
    (addr, seen)
}

#[tokio::test]
async fn h2c_is_never_tunnelled_and_each_request_meets_the_policy() {
    // A backend that takes h2c: it would switch, and sluice would see
    // nothing of the requests inside.
    let (addr, seen) = raw_upstream(|head| {
        if head.contains("\r\nupgrade: h2c") {
            let switch =
                b"HTTP/1.1 101 Switching Protocols\r\nconnection: upgrade\r\nupgrade: h2c\r\n\r\n";
            (switch.to_vec(), true)
        } else {
            let ok = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\nconnection: close\r\n\r\nok";
            (ok.to_vec(), false)
        }
    })
    .await;
    let s = Sluice::start(&format!(
        r#"
[upstreams.api]
url = "http://{addr}"

[policies.hourly]
limits = [{{ limit = 3, window = "1h" }}]

[[routes]]
path = "/"
upstream = "api"
policy = "hourly"
upgrades = ["websocket"]
"#
    ))
    .await;
    let mut statuses = Vec::new();
    for way in [Way::Own, Way::Hyper, Way::Own, Way::Hyper, Way::Own] {
        let r = exchange(
            s.addr,
            way,
            "GET",
            "/",
            &[
                "Connection: Upgrade, HTTP2-Settings",
                "Upgrade: h2c",
                "HTTP2-Settings: AAMAAABkAARAAAAAAAIAAAAA",
            ],
        )
        .await;
        statuses.push(r.status);
    }
    assert_eq!(statuses, [200, 200, 200, 429, 429]);
    let seen = seen.lock().unwrap();
    assert_eq!(seen.len(), 3);
    for head in seen.iter() {
        assert!(!head.contains("upgrade"), "{head}");
        assert!(!head.contains("http2-settings"), "{head}");
    }
}

#[tokio::test]
async fn an_unasked_switch_is_a_bad_gateway() {
    // The test upstream's `/upgrade` switches whatever was asked.
    let up = Upstream::start().await;
    let s = Sluice::start(&proxy_to(&up.url())).await;
    for way in WAYS {
        let asks = ["Connection: upgrade", "Upgrade: echo"];
        let r = exchange(s.addr, way, "GET", "/upgrade", &asks).await;
        assert_eq!(r.status, 502, "{way:?}: {}", r.head);
    }
}

#[tokio::test]
async fn an_answer_framed_both_ways_loses_its_length() {
    let (addr, _) = raw_upstream(|_| {
        let both = b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\ntransfer-encoding: chunked\r\n\r\nb\r\nhello world\r\n0\r\n\r\n";
        (both.to_vec(), false)
    })
    .await;
    let s = Sluice::start(&proxy_to(&format!("http://{addr}"))).await;
    // The own client (no body) and hyper's (a body), to both of sluice's
    // servers (HTTP/1.1, HTTP/2).
    for client in [client(), h2_client()] {
        for method in [Method::GET, Method::POST] {
            let body = if method == Method::POST {
                Full::new(Bytes::from("x")).map_err(|e| match e {}).boxed()
            } else {
                empty()
            };
            let req = Request::builder()
                .method(method.clone())
                .uri(s.url("/"))
                .body(body)
                .unwrap();
            let r = send(&client, req).await;
            assert_eq!(r.status, StatusCode::OK);
            assert_eq!(&r.body[..], b"hello world", "{method}");
            assert_ne!(r.header("content-length"), Some("5"), "{method}");
        }
    }
}
