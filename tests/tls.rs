//! TLS: termination with HTTP/1.1 and HTTP/2 by ALPN, and https upstreams
//! verified against an extra CA. Certificates are made on the spot.

mod support;

use std::path::PathBuf;

use http::{Request, StatusCode, Version};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use support::*;

/// A self-signed certificate for 127.0.0.1 and localhost: (cert, key) files.
fn certificate(dir: &std::path::Path) -> (PathBuf, PathBuf) {
    std::fs::create_dir_all(dir).unwrap();
    let c =
        rcgen::generate_simple_self_signed(vec!["127.0.0.1".to_string(), "localhost".to_string()])
            .unwrap();
    let (cert, key) = (dir.join("server.crt"), dir.join("server.key"));
    std::fs::write(&cert, c.cert.pem()).unwrap();
    std::fs::write(&key, c.signing_key.serialize_pem()).unwrap();
    (cert, key)
}

fn temp_dir(name: &str) -> PathBuf {
    std::env::temp_dir().join(format!("sluice-{name}-{}", std::process::id()))
}

/// A TLS config with the certificate `cert` and `key` whose one route
/// answers `200 hi` itself.
fn respond_hi(cert: &std::path::Path, key: &std::path::Path) -> String {
    format!(
        "[server.tls]\ncert = \"{}\"\nkey = \"{}\"\n\
         [[routes]]\npath = \"/\"\nrespond = {{ status = 200, body = \"hi\" }}\n",
        cert.display(),
        key.display()
    )
}

/// A real TLS client trusting `ca`, speaking HTTP/2 when ALPN offers it
/// (`h2 = true`) or HTTP/1.1 only.
fn tls_client(
    ca: &std::path::Path,
    h2: bool,
) -> Client<hyper_rustls::HttpsConnector<hyper_util::client::legacy::connect::HttpConnector>, BoxBody>
{
    let config = sluice::tls::client_config(Some(ca)).unwrap();
    let builder = hyper_rustls::HttpsConnectorBuilder::new()
        .with_tls_config(config)
        .https_only();
    let connector = if h2 {
        builder.enable_all_versions().build()
    } else {
        builder.enable_http1().build()
    };
    Client::builder(TokioExecutor::new()).build(connector)
}

#[tokio::test]
async fn terminates_tls_with_http1_and_http2_by_alpn() {
    let dir = temp_dir("tls-term");
    let (cert, key) = certificate(&dir);
    let up = Upstream::start().await;
    let cfg = format!(
        "[server.tls]\ncert = \"{}\"\nkey = \"{}\"\n[upstreams.api]\nurl = \"{}\"\n\
         [policies.p]\nlimits = [{{ limit = 5, window = \"1h\" }}]\n\
         [[routes]]\npath = \"/\"\nupstream = \"api\"\npolicy = \"p\"\n",
        cert.display(),
        key.display(),
        up.url()
    );
    let s = Sluice::start(&cfg).await;
    let url = format!("https://127.0.0.1:{}/echo?x=1", s.addr.port());
    for (h2, version) in [(false, Version::HTTP_11), (true, Version::HTTP_2)] {
        let c = tls_client(&cert, h2);
        let resp = c
            .request(Request::get(&url).body(empty()).unwrap())
            .await
            .unwrap();
        assert_eq!(resp.status(), StatusCode::OK);
        assert_eq!(resp.version(), version);
        assert!(resp.headers().contains_key("x-ratelimit-remaining"));
        let body = http_body_util::BodyExt::collect(resp.into_body())
            .await
            .unwrap()
            .to_bytes();
        let echo: serde_json::Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(echo["headers"]["x-forwarded-proto"][0], "https");
        assert_eq!(echo["uri"], "/echo?x=1");
    }
    // Plain HTTP on the TLS port is not served.
    let plain = raw(s.addr, b"GET / HTTP/1.1\r\nhost: a\r\n\r\n").await;
    assert!(!plain.starts_with("HTTP/1.1 200"), "{plain}");
    std::fs::remove_dir_all(&dir).ok();
}

#[tokio::test]
async fn https_upstreams_verify_against_an_extra_ca() {
    let dir = temp_dir("tls-up");
    let (cert, key) = certificate(&dir);
    // The upstream: another sluice, terminating TLS and answering itself.
    let upstream = Sluice::start(&format!(
        "[server.tls]\ncert = \"{}\"\nkey = \"{}\"\n\
         [[routes]]\npath = \"/\"\nrespond = {{ status = 200, body = \"secure\" }}\n",
        cert.display(),
        key.display()
    ))
    .await;
    let front = |ca: &str| {
        format!(
            "[upstreams.secure]\nurl = \"https://127.0.0.1:{}\"\n{ca}\n\
             [[routes]]\npath = \"/\"\nupstream = \"secure\"\n",
            upstream.addr.port()
        )
    };
    let trusting = Sluice::start(&front(&format!("ca = \"{}\"", cert.display()))).await;
    let r = get(&trusting.url("/x"), &[]).await;
    assert_eq!(r.status, StatusCode::OK);
    assert_eq!(&r.body[..], b"secure");
    // With the system roots only, the private certificate is refused: 502.
    let strict = Sluice::start(&front("")).await;
    assert_eq!(
        get(&strict.url("/x"), &[]).await.status,
        StatusCode::BAD_GATEWAY
    );
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn a_bad_certificate_is_a_clear_error() {
    let dir = temp_dir("tls-bad");
    std::fs::create_dir_all(&dir).unwrap();
    let junk = dir.join("junk.pem");
    std::fs::write(&junk, "not a certificate").unwrap();
    let cfg = format!(
        "[server.tls]\ncert = \"{0}\"\nkey = \"{0}\"\n",
        junk.display()
    );
    let err = sluice::config::parse(&cfg, "tls.toml", &dir)
        .unwrap_err()
        .to_string();
    assert!(err.starts_with("tls.toml:1: server.tls: "), "{err}");
    assert!(err.contains("junk.pem"), "{err}");
    std::fs::remove_dir_all(&dir).ok();
}

#[tokio::test]
async fn a_reload_puts_a_renewed_certificate_in_service() {
    let dir = temp_dir("tls-renew");
    let (cert, key) = certificate(&dir);
    let old_ca = dir.join("old.crt");
    std::fs::copy(&cert, &old_ca).unwrap();
    let cfg = respond_hi(&cert, &key);
    let s = Sluice::start(&cfg).await;
    let url = format!("https://127.0.0.1:{}/", s.addr.port());
    let ok = |ca: PathBuf| {
        let url = url.clone();
        async move {
            tls_client(&ca, false)
                .request(Request::get(&url).body(empty()).unwrap())
                .await
                .is_ok_and(|r| r.status() == StatusCode::OK)
        }
    };
    assert!(ok(old_ca.clone()).await);

    // Renewed in place (same paths), as an ACME client does; then a reload.
    let (cert, _) = certificate(&dir);
    let file = dir.join("sluice.toml");
    std::fs::write(&file, &cfg).unwrap();
    s.proxy.reload(&file).unwrap();
    assert!(
        ok(cert.clone()).await,
        "new connections get the renewed certificate"
    );
    assert!(!ok(old_ca).await, "and no longer the old one");

    // A renewal gone wrong (a key that does not match) is refused; the
    // certificate in service stays.
    let (_, other_key) = certificate(&dir.join("other"));
    std::fs::copy(&other_key, &key).unwrap();
    assert!(s.proxy.reload(&file).is_err());
    assert!(ok(cert).await);
    std::fs::remove_dir_all(&dir).ok();
}

#[tokio::test]
async fn alpn_h2_speaks_http2_from_the_first_byte() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let dir = temp_dir("tls-h2-preface");
    let (cert, key) = certificate(&dir);
    let cfg = respond_hi(&cert, &key);
    let s = Sluice::start(&cfg).await;
    let mut config = sluice::tls::client_config(Some(&cert)).unwrap();
    config.alpn_protocols = vec![b"h2".to_vec()];
    let connector = tokio_rustls::TlsConnector::from(std::sync::Arc::new(config));
    let tcp = tokio::net::TcpStream::connect(s.addr).await.unwrap();
    let name = rustls::pki_types::ServerName::try_from("localhost").unwrap();
    let mut tls = connector.connect(name, tcp).await.unwrap();
    assert_eq!(tls.get_ref().1.alpn_protocol(), Some(&b"h2"[..]));
    // As h2spec 3.5/2, not the preface; as long as it, so that the server
    // reads all of it and closes without a reset that could lose its answer.
    tls.write_all(b"PRI * HTTP/2.0\r\n\r\nXX\r\n\r\n")
        .await
        .unwrap();
    let mut out = Vec::new();
    let ended = loop {
        let mut chunk = [0u8; 1024];
        let read = tokio::time::timeout(std::time::Duration::from_secs(5), tls.read(&mut chunk));
        match read.await {
            Ok(Ok(n)) if n > 0 => out.extend_from_slice(&chunk[..n]),
            // Closed (with or without TLS's close_notify).
            Ok(_) => break true,
            Err(_) => break false,
        }
    };
    assert!(ended, "the connection stayed open");
    assert!(!out.starts_with(b"HTTP/1.1"), "answered as HTTP/1");
    // HTTP/2 from the first byte: the server's SETTINGS, then at most a
    // GOAWAY with PROTOCOL_ERROR (h2spec accepts that or the close alone).
    let frames = h2_frames(&out);
    assert_eq!(frames.first().map(|f| f.0), Some(0x4), "{out:?}");
    for (kind, payload) in &frames[1..] {
        assert_eq!(*kind, 0x7, "{out:?}");
        assert_eq!(&payload[4..8], &[0, 0, 0, 1]);
    }
    std::fs::remove_dir_all(&dir).ok();
}

/// A TLS connection to `addr` trusting `cert`, offering `alpn` (none if
/// empty).
async fn tls_connect(
    addr: std::net::SocketAddr,
    cert: &std::path::Path,
    alpn: &[&[u8]],
) -> tokio_rustls::client::TlsStream<tokio::net::TcpStream> {
    let mut config = sluice::tls::client_config(Some(cert)).unwrap();
    config.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
    let connector = tokio_rustls::TlsConnector::from(std::sync::Arc::new(config));
    let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
    let name = rustls::pki_types::ServerName::try_from("localhost").unwrap();
    connector.connect(name, tcp).await.unwrap()
}

/// Reads an answer's head (and what came with it) from `s`, within 5 s.
async fn head_of<S: tokio::io::AsyncRead + Unpin>(s: &mut S) -> String {
    use tokio::io::AsyncReadExt;
    let mut got = Vec::new();
    while !got.windows(4).any(|w| w == b"\r\n\r\n") {
        let mut chunk = [0u8; 1024];
        let read = tokio::time::timeout(std::time::Duration::from_secs(5), s.read(&mut chunk));
        let n = read.await.expect("an answer in time").unwrap();
        assert!(n > 0, "closed before answering: {got:?}");
        got.extend_from_slice(&chunk[..n]);
    }
    String::from_utf8_lossy(&got).into_owned()
}

/// HTTP/1.1 over TLS, with ALPN or without, is served by sluice's own server:
/// a connection waiting for its next request gives its read buffer back, as
/// one on plain TCP does (see proxy.rs; hyper's server kept about 16 KB of
/// buffers per idle connection). Without ALPN, an HTTP/2 client's preface is
/// still handed to hyper's server.
#[tokio::test]
async fn idle_tls_http1_connections_hold_no_read_buffer() {
    use tokio::io::AsyncWriteExt;
    let dir = temp_dir("tls-idle");
    let (cert, key) = certificate(&dir);
    let up = Upstream::start().await;
    let cfg = format!(
        "[server]\nupstream_timeout = \"5s\"\n[server.tls]\ncert = \"{}\"\nkey = \"{}\"\n{}",
        cert.display(),
        key.display(),
        proxy_to(&up.url())
    );
    let s = Sluice::start(&cfg).await;
    let before = sluice::front::spare_read_buffers();
    // Three requests held by the upstream at once need three buffers; once
    // all three connections wait for their next request, the three are spare.
    let mut conns = Vec::new();
    for (i, alpn) in [&[&b"http/1.1"[..]][..], &[b"http/1.1"], &[]]
        .into_iter()
        .enumerate()
    {
        let mut c = tls_connect(s.addr, &cert, alpn).await;
        c.write_all(format!("GET /slow/500?{i} HTTP/1.1\r\nHost: x\r\n\r\n").as_bytes())
            .await
            .unwrap();
        conns.push(c);
    }
    for c in &mut conns {
        let head = head_of(c).await;
        assert!(head.starts_with("HTTP/1.1 200 OK\r\n"), "{head}");
    }
    let want = before.max(3);
    wait_until(|| sluice::front::spare_read_buffers() == want).await;
    // Still served after waiting.
    for c in &mut conns {
        c.write_all(b"GET /again HTTP/1.1\r\nHost: x\r\n\r\n")
            .await
            .unwrap();
        let head = head_of(c).await;
        assert!(head.starts_with("HTTP/1.1 200 OK\r\n"), "{head}");
    }

    let mut h2 = tls_connect(s.addr, &cert, &[]).await;
    h2.write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\0\0\0\x04\0\0\0\0\0")
        .await
        .unwrap();
    let mut first = [0u8; 9];
    let read = tokio::io::AsyncReadExt::read_exact(&mut h2, &mut first);
    tokio::time::timeout(std::time::Duration::from_secs(5), read)
        .await
        .expect("an answer in time")
        .unwrap();
    assert_eq!(first[3], 0x4, "the server's SETTINGS first: {first:?}");
    std::fs::remove_dir_all(&dir).ok();
}

/// A TLS connection sluice closes after its answer (the client said
/// `Connection: close`) ends with TLS's close_notify, as hyper's server ends
/// it: a client can tell the end it was meant from a cut connection.
#[tokio::test]
async fn a_tls_connection_closed_after_its_answer_says_so_in_tls() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let dir = temp_dir("tls-close");
    let (cert, key) = certificate(&dir);
    let cfg = respond_hi(&cert, &key);
    let s = Sluice::start(&cfg).await;
    let mut c = tls_connect(s.addr, &cert, &[b"http/1.1"]).await;
    c.write_all(b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        .await
        .unwrap();
    let mut all = Vec::new();
    let read = tokio::time::timeout(std::time::Duration::from_secs(5), c.read_to_end(&mut all));
    // Without close_notify rustls reports an unexpected end.
    read.await
        .expect("closed in time")
        .expect("closed with close_notify");
    let text = String::from_utf8_lossy(&all);
    assert!(text.starts_with("HTTP/1.1 200 OK\r\n"), "{text}");
    assert!(text.ends_with("\r\n\r\nhi"), "{text}");
    std::fs::remove_dir_all(&dir).ok();
}

/// A client that offers only `http/1.0` in ALPN (`curl --http1.0`) is
/// served, as nginx serves it, not refused with `no_application_protocol`.
#[tokio::test]
async fn an_http10_only_alpn_is_served() {
    use tokio::io::AsyncWriteExt;
    let dir = temp_dir("tls-http10");
    let (cert, key) = certificate(&dir);
    let cfg = respond_hi(&cert, &key);
    let s = Sluice::start(&cfg).await;
    let mut c = tls_connect(s.addr, &cert, &[b"http/1.0"]).await;
    assert_eq!(c.get_ref().1.alpn_protocol(), Some(&b"http/1.0"[..]));
    c.write_all(b"GET / HTTP/1.0\r\nHost: x\r\n\r\n")
        .await
        .unwrap();
    let head = head_of(&mut c).await;
    assert!(head.starts_with("HTTP/1.0 200 OK\r\n"), "{head}");
    std::fs::remove_dir_all(&dir).ok();
}
