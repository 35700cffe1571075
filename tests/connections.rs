//! Many and slow clients: `max_connections`, `max_streams`, and what happens
//! to clients that stop reading or sending.

mod support;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use support::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

const RESPOND: &str = "[[routes]]\npath = \"/\"\nrespond = { status = 200, body = \"hi\" }\n";

#[tokio::test]
async fn max_streams_is_announced_in_http2_settings() {
    let s = Sluice::start(&format!("[server]\nmax_streams = 7\n{RESPOND}")).await;
    let mut c = TcpStream::connect(s.addr).await.unwrap();
    c.write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\0\0\0\x04\0\0\0\0\0")
        .await
        .unwrap();
    let mut got = Vec::new();
    let settings = loop {
        let mut chunk = [0u8; 1024];
        let n = tokio::time::timeout(Duration::from_secs(5), c.read(&mut chunk))
            .await
            .unwrap()
            .unwrap();
        assert!(n > 0, "closed before its SETTINGS");
        got.extend_from_slice(&chunk[..n]);
        if let Some((_, p)) = h2_frames(&got).into_iter().find(|(t, _)| *t == 0x4) {
            break p;
        }
    };
    // SETTINGS_MAX_CONCURRENT_STREAMS is parameter 3.
    let max = settings
        .chunks(6)
        .find(|p| p[..2] == [0, 3])
        .map(|p| u32::from_be_bytes([p[2], p[3], p[4], p[5]]));
    assert_eq!(max, Some(7));
}

/// Sends one request on `c` and reads its answer's head.
async fn ask(c: &mut TcpStream) -> Option<String> {
    c.write_all(b"GET / HTTP/1.1\r\nhost: a\r\n\r\n")
        .await
        .ok()?;
    read_head(c).await
}

#[tokio::test]
async fn past_max_connections_new_clients_wait_in_the_backlog() {
    let s = Sluice::start(&format!("[server]\nmax_connections = 2\n{RESPOND}")).await;
    let mut first = TcpStream::connect(s.addr).await.unwrap();
    let mut second = TcpStream::connect(s.addr).await.unwrap();
    assert!(ask(&mut first).await.unwrap().starts_with("HTTP/1.1 200"));
    assert!(ask(&mut second).await.unwrap().starts_with("HTTP/1.1 200"));
    // The kernel completes the third connection; sluice does not take it.
    let mut third = TcpStream::connect(s.addr).await.unwrap();
    third
        .write_all(b"GET / HTTP/1.1\r\nhost: a\r\n\r\n")
        .await
        .unwrap();
    let mut byte = [0u8; 1];
    let waited = tokio::time::timeout(Duration::from_millis(300), third.read(&mut byte)).await;
    assert!(waited.is_err(), "the third connection was served at once");
    // Both kept connections still work meanwhile.
    assert!(ask(&mut first).await.unwrap().starts_with("HTTP/1.1 200"));
    // One of them closes: the third is taken from the backlog and served.
    drop(second);
    let head = tokio::time::timeout(Duration::from_secs(5), read_head(&mut third))
        .await
        .expect("served once a connection closed")
        .unwrap();
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
}

/// The tasks alive on this test's runtime, which the server runs on.
fn tasks() -> usize {
    tokio::runtime::Handle::current()
        .metrics()
        .num_alive_tasks()
}

/// An idle keep-alive connection holds no task: once its client's requests
/// are answered it is parked (its socket and its state), and served again
/// when the client sends. The server closes idle ones by looking at all of
/// them a tick at a time, with no timer task beside each. The read buffers
/// idle connections give back are counted in proxy.rs.
#[tokio::test]
async fn an_idle_keep_alive_connection_holds_no_task() {
    let s = Sluice::start(RESPOND).await;
    // Once a request is answered, the server's own tasks have started.
    let mut idle = vec![TcpStream::connect(s.addr).await.unwrap()];
    assert!(ask(&mut idle[0]).await.unwrap().starts_with("HTTP/1.1 200"));
    let before = tasks();
    for _ in 0..20 {
        let mut c = TcpStream::connect(s.addr).await.unwrap();
        assert!(ask(&mut c).await.unwrap().starts_with("HTTP/1.1 200"));
        idle.push(c);
    }
    wait_until(|| tasks() == before).await;
    // Parked connections are served again.
    for c in &mut idle {
        assert!(ask(c).await.unwrap().starts_with("HTTP/1.1 200"));
    }
}

/// A client that sends again soon after its answer is busy: its connection
/// waits for it in its task instead of parking after each request (which
/// would cost a task a request).
#[tokio::test]
async fn a_busy_connection_keeps_its_task_until_its_client_is_quiet() {
    // A sweep every 250 ms.
    let s = Sluice::start(&format!("[server]\nheader_timeout = \"2s\"\n{RESPOND}")).await;
    let mut c = TcpStream::connect(s.addr).await.unwrap();
    assert!(ask(&mut c).await.unwrap().starts_with("HTTP/1.1 200"));
    let parked = tasks();
    // Its next request comes at once: it is served, and waits in a task.
    assert!(ask(&mut c).await.unwrap().starts_with("HTTP/1.1 200"));
    assert!(ask(&mut c).await.unwrap().starts_with("HTTP/1.1 200"));
    assert_eq!(tasks(), parked + 1);
    // Quiet for a while: the sweep has it parked, and it is served again.
    wait_until(|| tasks() == parked).await;
    assert!(ask(&mut c).await.unwrap().starts_with("HTTP/1.1 200"));
}

/// Parked connections are closed as waiting ones are: by
/// `server.header_timeout`, at shutdown, and at once when their client
/// closes (its place under `max_connections` is free again).
#[tokio::test]
async fn parked_connections_close_by_timeout_by_shutdown_and_by_their_client() {
    let s = Sluice::start(&format!(
        "[server]\nheader_timeout = \"200ms\"\nmax_connections = 1\n{RESPOND}"
    ))
    .await;
    let mut c = TcpStream::connect(s.addr).await.unwrap();
    assert!(ask(&mut c).await.unwrap().starts_with("HTTP/1.1 200"));
    let parked = tasks();
    // Closed by the client: the one place is free at once.
    drop(c);
    let mut c = TcpStream::connect(s.addr).await.unwrap();
    let head = tokio::time::timeout(Duration::from_secs(5), ask(&mut c)).await;
    assert!(head.expect("served").unwrap().starts_with("HTTP/1.1 200"));
    // Parked again, then closed by header_timeout.
    wait_until(|| tasks() == parked).await;
    let mut rest = Vec::new();
    let read = tokio::time::timeout(Duration::from_secs(5), c.read_to_end(&mut rest)).await;
    assert!(read.is_ok(), "still open after 5 s");

    let s = Sluice::start(RESPOND).await;
    let mut first = TcpStream::connect(s.addr).await.unwrap();
    assert!(ask(&mut first).await.unwrap().starts_with("HTTP/1.1 200"));
    let before = tasks();
    let mut c = TcpStream::connect(s.addr).await.unwrap();
    assert!(ask(&mut c).await.unwrap().starts_with("HTTP/1.1 200"));
    wait_until(|| tasks() == before).await;
    // server.shutdown_timeout is 10 s: a parked connection left open would
    // hold the shutdown that long.
    tokio::time::timeout(Duration::from_secs(5), s.shutdown())
        .await
        .expect("shutdown waited for a parked connection");
    for c in [&mut first, &mut c] {
        let mut rest = Vec::new();
        c.read_to_end(&mut rest).await.unwrap();
    }
}

/// An upstream that answers every request with an endless body (a 1 GiB
/// `Content-Length`, written as fast as it is taken); the flag turns true
/// once sluice has closed such an exchange.
async fn endless_upstream() -> (String, Arc<AtomicBool>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let closed = Arc::new(AtomicBool::new(false));
    let flag = closed.clone();
    tokio::spawn(async move {
        while let Ok((mut conn, _)) = listener.accept().await {
            let flag = flag.clone();
            tokio::spawn(async move {
                if read_head(&mut conn).await.is_none() {
                    return;
                }
                let head = b"HTTP/1.1 200 OK\r\ncontent-length: 1073741824\r\n\r\n";
                if conn.write_all(head).await.is_err() {
                    return;
                }
                let chunk = vec![0u8; 64 * 1024];
                while conn.write_all(&chunk).await.is_ok() {}
                flag.store(true, Ordering::SeqCst);
            });
        }
    });
    (url, closed)
}

/// A client connection that takes in little at a time, and here nothing.
async fn stalled_client(addr: std::net::SocketAddr, request: &[u8]) -> TcpStream {
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.set_recv_buffer_size(4096).unwrap();
    let mut c = socket.connect(addr).await.unwrap();
    c.write_all(request).await.unwrap();
    c
}

/// Reads what `c` still delivers: how many bytes, until it ends.
async fn drain(mut c: TcpStream) -> u64 {
    let mut n = 0;
    let mut chunk = vec![0u8; 64 * 1024];
    loop {
        match tokio::time::timeout(Duration::from_secs(5), c.read(&mut chunk)).await {
            Ok(Ok(0)) | Ok(Err(_)) => return n,
            Ok(Ok(k)) => n += k as u64,
            Err(_) => panic!("the connection stayed open after the cut"),
        }
    }
}

fn send_timeout_config(upstream: &str) -> String {
    format!(
        "[server]\nclient_send_timeout = \"300ms\"\n\
         [upstreams.u]\nurl = \"{upstream}\"\n[[routes]]\npath = \"/\"\nupstream = \"u\"\n"
    )
}

#[tokio::test]
async fn a_client_that_does_not_read_is_cut_with_its_upstream_exchange() {
    let (upstream, closed) = endless_upstream().await;
    let s = Sluice::start(&send_timeout_config(&upstream)).await;
    // sluice's own server (no body), then hyper's (a body).
    for request in [
        &b"GET /big HTTP/1.1\r\nhost: a\r\n\r\n"[..],
        b"POST /big HTTP/1.1\r\nhost: a\r\ncontent-length: 1\r\n\r\nx",
    ] {
        closed.store(false, Ordering::SeqCst);
        let c = stalled_client(s.addr, request).await;
        wait_until(|| closed.load(Ordering::SeqCst)).await;
        let got = drain(c).await;
        assert!(got < 1 << 30, "{got} bytes");
    }
}

#[tokio::test]
async fn an_http2_stream_whose_window_stays_shut_is_cut() {
    let (upstream, closed) = endless_upstream().await;
    let s = Sluice::start(&send_timeout_config(&upstream)).await;
    let tcp = TcpStream::connect(s.addr).await.unwrap();
    let (mut sender, conn) = hyper::client::conn::http2::handshake(
        hyper_util::rt::TokioExecutor::new(),
        hyper_util::rt::TokioIo::new(tcp),
    )
    .await
    .unwrap();
    let ended = Arc::new(AtomicBool::new(false));
    let flag = ended.clone();
    tokio::spawn(async move {
        let _ = conn.await;
        flag.store(true, Ordering::SeqCst);
    });
    let req = http::Request::get(format!("http://{}/big", s.addr))
        .body(empty())
        .unwrap();
    // The answer's head comes; its body is never read, so the stream's
    // window is never opened again.
    let resp = sender.send_request(req).await.unwrap();
    assert_eq!(resp.status(), http::StatusCode::OK);
    wait_until(|| closed.load(Ordering::SeqCst)).await;
    wait_until(|| ended.load(Ordering::SeqCst)).await;
    drop(resp);
}

#[tokio::test]
async fn a_client_holds_at_most_max_upstream_per_client_exchanges() {
    let (endless, _) = endless_upstream().await;
    let up = Upstream::start().await;
    let s = Sluice::start(&format!(
        "[server]\nmax_upstream_per_client = 2\n\
         [upstreams.endless]\nurl = \"{endless}\"\n[upstreams.api]\nurl = \"{}\"\n\
         [[routes]]\npath = \"/big\"\nupstream = \"endless\"\n\
         [[routes]]\npath = \"/\"\nupstream = \"api\"\n",
        up.url()
    ))
    .await;
    let me: std::net::IpAddr = "127.0.0.1".parse().unwrap();
    let request = b"GET /big HTTP/1.1\r\nhost: a\r\n\r\n";
    let first = stalled_client(s.addr, request).await;
    let _second = stalled_client(s.addr, request).await;
    wait_until(|| s.proxy.upstream_in_flight(me) == 2).await;
    let busy = get(&s.url("/echo"), &[]).await;
    assert_eq!(busy.status, http::StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(busy.header("retry-after"), Some("1"));
    assert_eq!(up.hits(), 0);
    // One exchange ends with its client: the next request goes through.
    drop(first);
    wait_until(|| s.proxy.upstream_in_flight(me) == 1).await;
    assert_eq!(get(&s.url("/echo"), &[]).await.status, http::StatusCode::OK);
    // Its slot was given back once its answer was sent.
    wait_until(|| s.proxy.upstream_in_flight(me) == 1).await;
}

#[tokio::test]
async fn upstream_timeout_counts_from_the_end_of_a_slow_steady_upload() {
    let up = Upstream::start().await;
    let s = Sluice::start(&format!(
        "[server]\nupstream_timeout = \"300ms\"\nclient_body_timeout = \"2s\"\n{}",
        proxy_to(&up.url())
    ))
    .await;
    let mut c = TcpStream::connect(s.addr).await.unwrap();
    c.write_all(b"POST /upload HTTP/1.1\r\nhost: a\r\ntransfer-encoding: chunked\r\n\r\n")
        .await
        .unwrap();
    // A byte every 100 ms, for longer than upstream_timeout.
    let mut tick = tokio::time::interval(Duration::from_millis(100));
    for _ in 0..8 {
        tick.tick().await;
        c.write_all(b"1\r\nx\r\n").await.unwrap();
    }
    c.write_all(b"0\r\n\r\n").await.unwrap();
    let head = tokio::time::timeout(Duration::from_secs(5), read_head(&mut c))
        .await
        .unwrap()
        .unwrap();
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    assert!(head.ends_with("\r\n\r\n8"), "{head}");
}

#[tokio::test]
async fn a_silent_upload_gets_408() {
    let up = Upstream::start().await;
    let s = Sluice::start(&format!(
        "[server]\nupstream_timeout = \"10s\"\nclient_body_timeout = \"300ms\"\n{}",
        proxy_to(&up.url())
    ))
    .await;
    let mut c = TcpStream::connect(s.addr).await.unwrap();
    c.write_all(b"POST /upload HTTP/1.1\r\nhost: a\r\ncontent-length: 10\r\n\r\nab")
        .await
        .unwrap();
    let head = tokio::time::timeout(Duration::from_secs(3), read_head(&mut c))
        .await
        .expect("an answer before upstream_timeout")
        .unwrap();
    assert!(head.starts_with("HTTP/1.1 408"), "{head}");
    assert!(
        head.to_ascii_lowercase().contains("connection: close"),
        "{head}"
    );
    // Counted, though never routed: its body had not come.
    let counted = "sluice_requests_total{route=\"-\",status=\"408\"}";
    assert_eq!(s.metric(counted).await, 1.0);
}

#[tokio::test]
async fn an_upstream_that_stops_taking_the_body_times_out() {
    // It reads the head, then neither reads nor answers.
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let upstream = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((mut conn, _)) = listener.accept().await {
            let _ = read_head(&mut conn).await;
            held.push(conn);
        }
    });
    let s = Sluice::start(&format!(
        "[server]\nupstream_timeout = \"300ms\"\n{}",
        proxy_to(&upstream)
    ))
    .await;
    let size = 64 << 20;
    let c = TcpStream::connect(s.addr).await.unwrap();
    let (mut read, mut write) = c.into_split();
    tokio::spawn(async move {
        let head = format!("POST /x HTTP/1.1\r\nhost: a\r\ncontent-length: {size}\r\n\r\n");
        write.write_all(head.as_bytes()).await?;
        write.write_all(&vec![0u8; size]).await
    });
    let mut got = Vec::new();
    let answer = tokio::time::timeout(Duration::from_secs(5), async {
        while !got.windows(4).any(|w| w == b"\r\n\r\n") {
            let mut chunk = [0u8; 1024];
            match read.read(&mut chunk).await {
                Ok(0) | Err(_) => break,
                Ok(n) => got.extend_from_slice(&chunk[..n]),
            }
        }
    })
    .await;
    assert!(answer.is_ok(), "no answer");
    assert!(
        got.starts_with(b"HTTP/1.1 504"),
        "{}",
        String::from_utf8_lossy(&got)
    );
}

/// A backend with one worker: one connection at a time, `Connection:
/// close`; `/big` is 48 MiB. The flag turns true once it has written all of
/// `/big`.
async fn one_worker_upstream() -> (String, Arc<AtomicBool>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let done = Arc::new(AtomicBool::new(false));
    let flag = done.clone();
    tokio::spawn(async move {
        while let Ok((mut conn, _)) = listener.accept().await {
            let Some(head) = read_head(&mut conn).await else {
                continue;
            };
            if head.starts_with("GET /big ") {
                let size = 48 << 20;
                let head = format!(
                    "HTTP/1.1 200 OK\r\ncontent-length: {size}\r\nconnection: close\r\n\r\n"
                );
                if conn.write_all(head.as_bytes()).await.is_ok()
                    && conn.write_all(&vec![7u8; size]).await.is_ok()
                {
                    flag.store(true, Ordering::SeqCst);
                }
            } else {
                let _ = conn
                    .write_all(
                        b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\nconnection: close\r\n\r\nok",
                    )
                    .await;
            }
        }
    });
    (url, done)
}

#[tokio::test]
async fn a_slow_reader_does_not_hold_a_one_worker_backend() {
    let (upstream, big_sent) = one_worker_upstream().await;
    let s = Sluice::start(&format!(
        "[server]\nupstream_timeout = \"2s\"\n\
         [upstreams.one]\nurl = \"{upstream}\"\nbuffer = \"64MiB\"\n\
         [[routes]]\npath = \"/\"\nupstream = \"one\"\n"
    ))
    .await;
    let request = b"GET /big HTTP/1.1\r\nhost: a\r\nconnection: close\r\n\r\n";
    let slow = stalled_client(s.addr, request).await;
    // sluice takes the whole answer, so the worker is free again...
    wait_until(|| big_sent.load(Ordering::SeqCst)).await;
    // ...for everyone else, while the slow client has read nothing.
    let other = get(&s.url("/small"), &[]).await;
    assert_eq!(other.status, http::StatusCode::OK);
    assert_eq!(&other.body[..], b"ok");
    // And the slow client still gets all of it (and a head) when it reads.
    let got = drain(slow).await;
    assert!(got > 48 << 20 && got < (48 << 20) + 1024, "{got}");
}

/// A backend with one worker that reads each request's whole body
/// (`Content-Length`) before it answers with its size, as a WSGI worker
/// does; one connection at a time.
async fn one_worker_reading_bodies() -> String {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move {
        while let Ok((mut conn, _)) = listener.accept().await {
            let Some(head) = read_head(&mut conn).await else {
                continue;
            };
            let (head, body) = head.split_once("\r\n\r\n").unwrap_or((&head, ""));
            let length: usize = head
                .lines()
                .find_map(|l| {
                    l.to_ascii_lowercase()
                        .strip_prefix("content-length:")
                        .map(|v| v.trim().to_string())
                })
                .and_then(|v| v.parse().ok())
                .unwrap_or(0);
            let mut got = body.len();
            let mut chunk = [0u8; 4096];
            while got < length {
                match conn.read(&mut chunk).await {
                    Ok(0) | Err(_) => break,
                    Ok(n) => got += n,
                }
            }
            let answer = got.to_string();
            let _ = conn
                .write_all(
                    format!(
                        "HTTP/1.1 200 OK\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{answer}",
                        answer.len()
                    )
                    .as_bytes(),
                )
                .await;
        }
    });
    url
}

/// A client that stops half-way through its upload holds no backend worker:
/// sluice takes bodies up to the upstream's `buffer` whole before it
/// forwards them. (Streamed, the one worker would wait for the rest of the
/// body, and the other client would get 504.)
#[tokio::test]
async fn a_slow_upload_does_not_hold_a_one_worker_backend() {
    let upstream = one_worker_reading_bodies().await;
    for (buffer, other_status) in [("1MiB", 200), ("0", 504)] {
        let s = Sluice::start(&format!(
            "[server]\nupstream_timeout = \"1s\"\nshutdown_timeout = \"1s\"\n\
             [upstreams.one]\nurl = \"{upstream}\"\nbuffer = \"{buffer}\"\n\
             [[routes]]\npath = \"/\"\nupstream = \"one\"\n"
        ))
        .await;
        let mut slow = TcpStream::connect(s.addr).await.unwrap();
        slow.write_all(b"POST /upload HTTP/1.1\r\nhost: a\r\ncontent-length: 1000\r\n\r\n")
            .await
            .unwrap();
        slow.write_all(&[b'u'; 500]).await.unwrap();
        // Half the body sent, the rest held back while another client asks.
        let other = get(&s.url("/other"), &[]).await;
        assert_eq!(other.status.as_u16(), other_status, "buffer {buffer}");
        slow.write_all(&[b'u'; 500]).await.unwrap();
        let head = tokio::time::timeout(Duration::from_secs(5), read_head(&mut slow))
            .await
            .unwrap()
            .unwrap();
        if buffer != "0" {
            assert!(head.starts_with("HTTP/1.1 200"), "{head}");
            assert!(
                head.ends_with("\r\n\r\n1000"),
                "the whole body went on: {head}"
            );
        }
        s.shutdown().await;
    }
}

/// Reads from `c` until `n` answers have come, the last one's body `last`.
async fn answers(c: &mut TcpStream, n: usize, last: &str) -> String {
    let mut got = String::new();
    while got.matches("HTTP/1.1 ").count() < n || !got.ends_with(&format!("\r\n\r\n{last}")) {
        let mut chunk = [0u8; 4096];
        let k = tokio::time::timeout(Duration::from_secs(5), c.read(&mut chunk))
            .await
            .expect("answers within 5 s")
            .unwrap();
        assert!(k > 0, "closed after {got:?}");
        got.push_str(&String::from_utf8_lossy(&chunk[..k]));
    }
    got
}

/// A client that sends small bodies (a `Content-Length` up to 16 KiB) is
/// served by sluice's own server, whose connections park once idle: such a
/// connection holds no task between requests, as one that only sends `GET`
/// does, and its bodies, pipelined or in pieces, reach the upstream whole.
/// A larger body is still served (by hyper's server, which streams it).
#[tokio::test]
async fn a_client_that_sends_small_bodies_is_parked_when_idle() {
    let upstream = one_worker_reading_bodies().await;
    let s = Sluice::start(&proxy_to(&upstream)).await;
    let mut first = TcpStream::connect(s.addr).await.unwrap();
    first
        .write_all(b"GET / HTTP/1.1\r\nhost: a\r\n\r\n")
        .await
        .unwrap();
    answers(&mut first, 1, "0").await;
    let before = tasks();
    let mut c = TcpStream::connect(s.addr).await.unwrap();
    c.write_all(b"POST /a HTTP/1.1\r\nhost: a\r\ncontent-length: 5\r\n\r\nhel")
        .await
        .unwrap();
    c.write_all(b"lo").await.unwrap();
    answers(&mut c, 1, "5").await;
    wait_until(|| tasks() == before).await;
    // Parked, it is served again: two bodies and a GET in one write.
    c.write_all(
        b"PUT /b HTTP/1.1\r\nhost: a\r\ncontent-length: 003\r\n\r\nabc\
          POST /c HTTP/1.1\r\nhost: a\r\ncontent-length: 4\r\n\r\nGET GET /d HTTP/1.1\r\nhost: a\r\n\r\n",
    )
    .await
    .unwrap();
    let got = answers(&mut c, 3, "0").await;
    let bodies: Vec<&str> = got
        .split("HTTP/1.1 200 OK")
        .skip(1)
        .map(|a| a.rsplit("\r\n\r\n").next().unwrap())
        .collect();
    assert_eq!(bodies, ["3", "4", "0"], "{got}");
    wait_until(|| tasks() == before).await;
    // A client that names `Content-Length` in `Connection` (a hop-by-hop
    // field, not forwarded) still has its body framed upstream (read here
    // by hyper's server, which counts it).
    let up = Upstream::start().await;
    let strict = Sluice::start(&proxy_to(&up.url())).await;
    let mut c = TcpStream::connect(strict.addr).await.unwrap();
    c.write_all(
        b"POST /upload HTTP/1.1\r\nhost: a\r\nconnection: content-length\r\n\
          content-length: 2\r\n\r\nokPOST /upload HTTP/1.1\r\nhost: a\r\n\r\n",
    )
    .await
    .unwrap();
    let got = answers(&mut c, 2, "0").await;
    assert!(got.contains("\r\n\r\n2HTTP/1.1 200"), "{got}");
    let mut large = TcpStream::connect(s.addr).await.unwrap();
    large
        .write_all(b"POST /e HTTP/1.1\r\nhost: a\r\ncontent-length: 20000\r\n\r\n")
        .await
        .unwrap();
    large.write_all(&[b'x'; 20000]).await.unwrap();
    answers(&mut large, 1, "20000").await;
}

/// An HTTP/1.0 client (ApacheBench is one) is served by sluice's own server
/// as hyper's server answers it: in HTTP/1.0, its connection kept only when
/// it asks (`Connection: keep-alive`, answered so, and parked once idle), a
/// body of unknown length never chunked but ended with the connection.
#[tokio::test]
async fn an_http10_client_is_answered_in_http10_and_kept_only_when_it_asks() {
    let up = Upstream::start().await;
    let s = Sluice::start(&proxy_to(&up.url())).await;
    let mut first = TcpStream::connect(s.addr).await.unwrap();
    first
        .write_all(b"GET / HTTP/1.1\r\nhost: a\r\n\r\n")
        .await
        .unwrap();
    answer_ending(&mut first, "}").await;
    let before = tasks();
    let mut c = TcpStream::connect(s.addr).await.unwrap();
    // Its hop-by-hop fields stay here; no Host is needed.
    c.write_all(b"GET /a HTTP/1.0\r\nConnection: keep-alive, x-secret\r\nx-secret: 1\r\n\r\n")
        .await
        .unwrap();
    let got = answer_ending(&mut c, "}").await;
    let (head, body) = got.split_once("\r\n\r\n").unwrap();
    assert!(head.starts_with("HTTP/1.0 200 OK\r\n"), "{got}");
    assert!(head.contains("\r\nconnection: keep-alive"), "{got}");
    assert!(
        head.contains(&format!("content-length: {}", body.len())),
        "{got}"
    );
    let echo: serde_json::Value = serde_json::from_str(body).unwrap();
    for hop in ["connection", "keep-alive", "x-secret"] {
        assert!(echo["headers"].get(hop).is_none(), "{hop}: {body}");
    }
    wait_until(|| tasks() == before).await;
    // Parked, it is served again; a body of unknown length (here streamed
    // by the upstream) ends with the connection.
    c.write_all(b"GET /drip/0 HTTP/1.0\r\nConnection: Keep-Alive\r\n\r\n")
        .await
        .unwrap();
    let got = answer_ending(&mut c, "").await;
    assert!(got.starts_with("HTTP/1.0 200 OK\r\n"), "{got}");
    assert!(
        !got.to_ascii_lowercase().contains("transfer-encoding"),
        "{got}"
    );
    assert!(
        got.contains("\r\nconnection: close\r\n") && got.ends_with("\r\n\r\ndrip"),
        "{got}"
    );
    // Without keep-alive: answered, then closed; a HEAD's head alone.
    for (request, body) in [
        (&b"GET /b HTTP/1.0\r\nhost: a\r\n\r\n"[..], true),
        (b"HEAD /c HTTP/1.0\r\n\r\n", false),
    ] {
        let mut d = TcpStream::connect(s.addr).await.unwrap();
        d.write_all(request).await.unwrap();
        let got = answer_ending(&mut d, "").await;
        assert!(got.starts_with("HTTP/1.0 200 OK\r\n"), "{got}");
        assert!(got.contains("\r\nconnection: close\r\n"), "{got}");
        assert_eq!(got.ends_with('}'), body, "{got}");
    }
}

/// What the server sends until `c` has read a whole answer ending with
/// `last` (empty: until the server closes).
async fn answer_ending(c: &mut TcpStream, last: &str) -> String {
    let mut got = String::new();
    loop {
        let mut chunk = [0u8; 4096];
        let k = tokio::time::timeout(Duration::from_secs(5), c.read(&mut chunk))
            .await
            .expect("answers within 5 s")
            .unwrap();
        if k == 0 {
            assert!(last.is_empty(), "closed after {got:?}");
            return got;
        }
        got.push_str(&String::from_utf8_lossy(&chunk[..k]));
        if !last.is_empty() && got.contains("\r\n\r\n") && got.ends_with(last) {
            return got;
        }
    }
}

/// An HTTP/2 request answered by sluice itself (here a 404) while its body
/// is still coming is read first: a body that breaks its `content-length`
/// then gets the PROTOCOL_ERROR HTTP/2 requires (RFC 9113 8.1.1), rather
/// than a stream already closed under it (h2spec 8.1.2.6).
#[tokio::test]
async fn an_http2_body_sluice_answers_without_is_still_checked() {
    let s = Sluice::start("[[routes]]\npath = \"/only\"\nrespond = { status = 200 }\n").await;
    let mut c = TcpStream::connect(s.addr).await.unwrap();
    let mut out = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\0\0\0\x04\0\0\0\0\0".to_vec();
    // HEADERS, stream 1, END_HEADERS: POST / (static table), a literal
    // :authority and `content-length: 5`.
    let block = b"\x83\x86\x84\x41\x09localhost\x5c\x015";
    out.extend_from_slice(&[0, 0, block.len() as u8, 0x1, 0x4, 0, 0, 0, 1]);
    out.extend_from_slice(block);
    c.write_all(&out).await.unwrap();
    // Whatever sluice sends before the body comes (without the fix: its 404).
    let mut got = Vec::new();
    let mut chunk = [0u8; 4096];
    while let Ok(Ok(n)) = tokio::time::timeout(Duration::from_millis(200), c.read(&mut chunk)).await
    {
        assert!(n > 0, "closed");
        got.extend_from_slice(&chunk[..n]);
    }
    // Three bytes, END_STREAM: not the five announced.
    c.write_all(&[0, 0, 3, 0x0, 0x1, 0, 0, 0, 1, b'a', b'b', b'c'])
        .await
        .unwrap();
    let reset = loop {
        if let Some((_, p)) = h2_frames(&got).into_iter().find(|(t, _)| *t == 0x3) {
            break p;
        }
        let n = tokio::time::timeout(Duration::from_secs(5), c.read(&mut chunk))
            .await
            .expect("a RST_STREAM")
            .unwrap();
        assert!(n > 0, "closed without a RST_STREAM");
        got.extend_from_slice(&chunk[..n]);
    };
    // PROTOCOL_ERROR is 0x1.
    assert_eq!(reset, [0, 0, 0, 1]);
}
