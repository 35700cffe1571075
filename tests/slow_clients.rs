//! Slow clients against a backend with few workers: sluice reads an answer
//! ahead of its client, up to the upstream's `buffer`, so the backend's worker
//! is free once the answer is read, whatever the client does.

mod support;

use std::time::Duration;

use support::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

const BIG: usize = 48 << 20;

/// A backend with one worker: it serves one connection at a time, one
/// request each (`Connection: close`); `/big` is a 48 MiB answer, anything
/// else a short one. A worker writing `/big` to a reader that does not read
/// waits, and nobody else is served meanwhile.
async fn one_worker_backend() -> String {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        let body = vec![b'x'; BIG];
        loop {
            let Ok((mut s, _)) = listener.accept().await else {
                return;
            };
            // One at a time: the next connection waits in the backlog.
            let Some(head) = read_head(&mut s).await else {
                continue;
            };
            if head.starts_with("GET /big ") {
                let _ = s
                    .write_all(
                        format!(
                            "HTTP/1.1 200 OK\r\ncontent-length: {BIG}\r\nconnection: close\r\n\r\n"
                        )
                        .as_bytes(),
                    )
                    .await;
                let _ = s.write_all(&body).await;
            } else {
                let _ = s
                    .write_all(
                        b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\nconnection: close\r\n\r\nok",
                    )
                    .await;
            }
        }
    });
    format!("http://{addr}")
}

fn config(upstream: &str, buffer: &str) -> String {
    format!(
        "[server]\nupstream_timeout = \"2s\"\nshutdown_timeout = \"1s\"\n[upstreams.api]\nurl = \"{upstream}\"\nbuffer = \"{buffer}\"\n\
         [[routes]]\npath = \"/\"\nupstream = \"api\"\n"
    )
}

/// A client that asks for `/big` and reads nothing: its connection, with
/// the answer's head read (so the backend has begun to answer it).
async fn reader_that_stops(sluice: &Sluice) -> TcpStream {
    let mut s = TcpStream::connect(sluice.addr).await.unwrap();
    s.write_all(b"GET /big HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
        .await
        .unwrap();
    let mut first = [0u8; 64];
    let n = s.read(&mut first).await.unwrap();
    assert!(
        first[..n].starts_with(b"HTTP/1.1 200"),
        "{:?}",
        String::from_utf8_lossy(&first[..n])
    );
    s
}

#[tokio::test]
async fn a_client_that_does_not_read_leaves_the_backend_free() {
    let sluice = Sluice::start(&config(&one_worker_backend().await, "64MiB")).await;
    let mut stalled = reader_that_stops(&sluice).await;
    // Everyone else is served while the first client reads nothing.
    for _ in 0..3 {
        let r = get(&sluice.url("/small"), &[]).await;
        assert_eq!(r.status, 200, "{:?}", r.body);
    }
    // And the stalled client, once it reads, gets every byte.
    let mut rest = Vec::new();
    stalled.read_to_end(&mut rest).await.unwrap();
    let body_at = rest
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .map_or(0, |at| at + 4);
    assert!(
        rest.len() - body_at + 64 >= BIG,
        "cut short: {} bytes",
        rest.len()
    );
    assert!(rest[body_at..].iter().all(|&b| b == b'x'));
    sluice.shutdown().await;
}

/// `buffer = "0"` streams as fast as the client reads: the backend's one
/// worker stays busy, and the next client waits for `upstream_timeout`.
/// (What the test above would see without reading ahead.)
#[tokio::test]
async fn without_a_buffer_the_backend_waits_for_the_client() {
    let sluice = Sluice::start(&config(&one_worker_backend().await, "0")).await;
    let _stalled = reader_that_stops(&sluice).await;
    let r = tokio::time::timeout(Duration::from_secs(10), get(&sluice.url("/small"), &[]))
        .await
        .expect("an answer within the upstream timeout");
    assert_eq!(r.status, 504);
    sluice.shutdown().await;
}
