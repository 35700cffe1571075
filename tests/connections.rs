//! Many and slow clients: `max_connections`, `max_streams`, and what happens
//! to clients that stop reading or sending.

mod support;

use std::time::Duration;

use support::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

const RESPOND: &str = "[[routes]]\npath = \"/\"\nrespond = { status = 200, body = \"hi\" }\n";

/// HTTP/2 frames in `bytes`: (type, payload), as far as they are whole.
fn h2_frames(bytes: &[u8]) -> Vec<(u8, Vec<u8>)> {
    let mut frames = Vec::new();
    let mut at = 0;
    while bytes.len() >= at + 9 {
        let len = u32::from_be_bytes([0, bytes[at], bytes[at + 1], bytes[at + 2]]) as usize;
        let Some(payload) = bytes.get(at + 9..at + 9 + len) else {
            break;
        };
        frames.push((bytes[at + 3], payload.to_vec()));
        at += 9 + len;
    }
    frames
}

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
