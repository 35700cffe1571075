//! Bodies stream through the proxy both ways: 100 MB up and 100 MB down pass
//! while the process's memory stays flat. (Alone in its own test binary, so no
//! other test's allocations blur the measurement.)

mod support;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use http::{Request, StatusCode};
use http_body_util::BodyExt;
use support::*;

const SIZE: u64 = 100 * 1024 * 1024;

fn rss_kib() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn large_bodies_stream_both_ways_in_flat_memory() {
    let up = Upstream::start().await;
    let sluice = Sluice::start(&proxy_to(&up.url())).await;
    let c = client();
    // Warm up pools and allocator before the baseline.
    let warm = send(
        &c,
        Request::get(sluice.url("/bytes/1000000"))
            .body(empty())
            .unwrap(),
    )
    .await;
    assert_eq!(warm.body.len(), 1_000_000);

    let baseline = rss_kib();
    let peak = Arc::new(AtomicU64::new(baseline));
    let done = Arc::new(AtomicBool::new(false));
    let sampler = {
        let (peak, done) = (peak.clone(), done.clone());
        tokio::spawn(async move {
            while !done.load(Ordering::Relaxed) {
                peak.fetch_max(rss_kib(), Ordering::Relaxed);
                tokio::time::sleep(std::time::Duration::from_millis(5)).await;
            }
        })
    };

    // Up: the upstream counts what arrives.
    let req = Request::post(sluice.url("/upload"))
        .body(chunked_body(SIZE))
        .unwrap();
    let up_reply = send(&c, req).await;
    assert_eq!(up_reply.status, StatusCode::OK);
    assert_eq!(up_reply.body, SIZE.to_string());

    // Down: read frame by frame, never holding the whole body.
    let resp = c
        .request(
            Request::get(sluice.url(&format!("/bytes/{SIZE}")))
                .body(empty())
                .unwrap(),
        )
        .await
        .unwrap();
    assert_eq!(resp.status(), StatusCode::OK);
    let mut body = resp.into_body();
    let mut got = 0u64;
    while let Some(frame) = body.frame().await {
        if let Ok(data) = frame.unwrap().into_data() {
            got += data.len() as u64;
        }
    }
    assert_eq!(got, SIZE);

    done.store(true, Ordering::Relaxed);
    sampler.await.unwrap();
    let grew_mib = (peak.load(Ordering::Relaxed).saturating_sub(baseline)) / 1024;
    assert!(
        grew_mib < 40,
        "memory grew by {grew_mib} MiB while moving 2 x 100 MiB"
    );
}
