//! Limits on what the upstream really serves, end to end: a policy's `meter`
//! (the cost a response reports in its head or trailers, or the body bytes
//! sent), `concurrency` slots (held while a request runs, leases renewed,
//! freed when the body is sent or the client goes, and by their lease when
//! an instance dies), and a `gcra` limit's `delay` (requests held, then
//! forwarded). Real upstream, real clients, real redis-server and cluster.

mod support;

use std::time::{Duration, Instant};

use http::StatusCode;
use support::*;

fn config(upstream: &Upstream, store: &str, policy: &str, route: &str) -> String {
    format!(
        r#"
[server]
trusted_proxies = ["127.0.0.1"]
{store}

[upstreams.api]
url = "{}"

[policies.p]
{policy}

[[routes]]
path = "/"
upstream = "api"
policy = "p"
{route}
"#,
        upstream.url()
    )
}

async fn usage(s: &Sluice, value: &str) -> serde_json::Value {
    let url = s.admin_url(&format!("/usage?policy=p&key=header:X-Key&value={value}"));
    let reply = get(&url, &[]).await;
    assert_eq!(reply.status, StatusCode::OK, "{:?}", reply.body);
    reply.json()
}

/// `used` of the policy's limit `i` for identity `value`.
async fn used(s: &Sluice, value: &str, i: usize) -> u64 {
    usage(s, value).await["limits"][i]["used"].as_u64().unwrap()
}

#[tokio::test]
async fn a_header_meter_settles_to_the_reported_cost_or_keeps_the_estimate() {
    let up = Upstream::start().await;
    let s = Sluice::start(&config(
        &up,
        "",
        "key = \"header:X-Key\"\nmeter = \"header:X-Tokens-Used\"\nlimits = [{ limit = 100, window = \"1h\" }]",
        "cost = 10",
    ))
    .await;
    let k = [("x-key", "k")];
    // Less than the estimate: the difference comes back.
    let r = get(&s.url("/tokens/3"), &k).await;
    assert_eq!(r.status, StatusCode::OK);
    assert_eq!(used(&s, "k", 0).await, 3);
    // More: charged.
    get(&s.url("/tokens/25"), &k).await;
    assert_eq!(used(&s, "k", 0).await, 28);
    // Missing or malformed: the estimate stays, and is counted.
    for bad in [
        "abc",
        "-5",
        "1.5",
        "99999999999999999999",
        "9007199254740993",
    ] {
        get(&s.url(&format!("/tokens/{bad}")), &k).await;
    }
    get(&s.url("/echo"), &k).await;
    assert_eq!(used(&s, "k", 0).await, 28 + 6 * 10);
    let errors = "sluice_meter_errors_total{policy=\"p\"}";
    assert_eq!(s.metric(errors).await, 6.0);
    let units = "sluice_metered_units_total{policy=\"p\"}";
    assert_eq!(s.metric(units).await, 28.0 + 60.0);
    // Past the limit: the extra is charged all the same, and the next
    // request waits until the window has room.
    // (/usage shows at most the limit as used.)
    get(&s.url("/tokens/50"), &k).await;
    assert_eq!(used(&s, "k", 0).await, 100);
    let r = get(&s.url("/tokens/1"), &k).await;
    assert_eq!(r.status, StatusCode::TOO_MANY_REQUESTS);
    assert!(r.header_u64("retry-after") >= 1);
    // Another identity is untouched.
    assert_eq!(
        get(&s.url("/tokens/1"), &[("x-key", "other")]).await.status,
        StatusCode::OK
    );
}

#[tokio::test]
async fn body_bytes_are_metered_as_sent_even_when_the_client_leaves() {
    let up = Upstream::start().await;
    let s = Sluice::start(&config(
        &up,
        "",
        "key = \"header:X-Key\"\nmeter = \"body-bytes\"\nlimits = [{ limit = 100000000, window = \"1h\" }]",
        "cost = 1000",
    ))
    .await;
    let r = get(&s.url("/bytes/300000"), &[("x-key", "whole")]).await;
    assert_eq!(r.body.len(), 300_000);
    wait_until_async(|| async { used(&s, "whole", 0).await == 300_000 }).await;
    // A client that reads the head and a little, then goes.
    let mut stream = tokio::net::TcpStream::connect(s.addr).await.unwrap();
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    stream
        .write_all(b"GET /bytes/50000000 HTTP/1.1\r\nhost: x\r\nx-key: gone\r\n\r\n")
        .await
        .unwrap();
    let mut buf = vec![0u8; 64 * 1024];
    let mut got = 0;
    while got < 200_000 {
        got += stream.read(&mut buf).await.unwrap();
    }
    drop(stream);
    // Settled on what was sent: more than the estimate, far less than all.
    wait_until_async(|| async { used(&s, "gone", 0).await >= 200_000 }).await;
    let u = used(&s, "gone", 0).await;
    assert!(u < 50_000_000, "{u}");
}

/// Three instances on one store; concurrent streams whose trailers carry
/// random token counts (some with none, charged the estimate): the count in
/// Redis is the exact sum.
async fn trailers_are_exact_across_instances(store: &str) {
    let up = Upstream::start().await;
    let cfg = config(
        &up,
        store,
        "key = \"header:X-Key\"\nmeter = \"trailer:X-Tokens\"\nlimits = [{ limit = 1000000000, window = \"1h\" }]",
        "cost = 50",
    );
    let instances = [
        Sluice::start(&cfg).await,
        Sluice::start(&cfg).await,
        Sluice::start(&cfg).await,
    ];
    let mut want = 0u64;
    let mut calls = Vec::new();
    let mut seed = 0x2545_f491_4f6c_dd1du64;
    for i in 0..60 {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        let tokens = seed % 1000;
        let value = if i % 10 == 9 {
            want += 50;
            "none".to_string()
        } else {
            want += tokens;
            tokens.to_string()
        };
        let url = instances[i % 3].url(&format!("/trailer/{value}/{}", seed % 20));
        calls.push(tokio::spawn(async move {
            let r = get(&url, &[("x-key", "shared")]).await;
            assert_eq!(r.status, StatusCode::OK);
            assert_eq!(&r.body[..], b"tokens");
        }));
    }
    for c in calls {
        c.await.unwrap();
    }
    wait_until_async(|| async { used(&instances[0], "shared", 0).await == want }).await;
    for s in &instances {
        assert_eq!(used(s, "shared", 0).await, want);
    }
    let errors: f64 = {
        let mut sum = 0.0;
        for s in &instances {
            sum += s.metric("sluice_meter_errors_total{policy=\"p\"}").await;
        }
        sum
    };
    assert_eq!(errors, 6.0);
}

#[tokio::test]
async fn trailer_counts_are_exact_across_three_instances_on_redis() {
    let redis = RedisServer::start();
    let store = format!(
        "\n[store]\nbackend = \"redis\"\nurl = \"{}\"\n",
        redis.url()
    );
    trailers_are_exact_across_instances(&store).await;
}

#[tokio::test]
async fn trailer_counts_are_exact_across_three_instances_on_a_cluster() {
    let cluster = RedisCluster::start(3);
    let store = format!(
        "\n[store]\nbackend = \"redis\"\ncluster = [{}]\n",
        cluster.seeds_toml()
    );
    trailers_are_exact_across_instances(&store).await;
}

/// Concurrency: two slots per key. Two long answers hold them; a third
/// request is refused with the IETF item's `qu`; a slot comes back when a
/// body has been sent, and when a client goes away mid-body.
async fn slots_are_held_while_requests_run(store: &str) {
    let up = Upstream::start().await;
    let cfg = config(
        &up,
        &format!("{store}\n[headers]\nstyle = \"ietf\""),
        "key = \"header:X-Key\"\nlimits = [{ limit = 2, algorithm = \"concurrency\" }]",
        "",
    );
    let a = Sluice::start(&cfg).await;
    // Two instances share the count on Redis; the memory store is one's own.
    let other = if store.is_empty() {
        None
    } else {
        Some(Sluice::start(&cfg).await)
    };
    let b = other.as_ref().unwrap_or(&a);
    let k = [("x-key", "c")];
    let long = |s: &Sluice| {
        let url = s.url("/drip/1500");
        tokio::spawn(async move { get(&url, &[("x-key", "c")]).await })
    };
    let first = long(&a);
    let second = long(b);
    wait_until_async(|| async { used(&a, "c", 0).await == 2 }).await;
    assert_eq!(usage(b, "c").await["limits"][0]["in_flight"], 2);
    let refused = get(&b.url("/echo"), &k).await;
    assert_eq!(refused.status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(refused.header("retry-after"), Some("1"));
    let policy = refused.header("ratelimit-policy").unwrap();
    assert!(
        policy.contains("qu=\"concurrent-requests\"") && policy.contains("q=2"),
        "{policy}"
    );
    let here = if other.is_some() { 1.0 } else { 2.0 };
    assert_eq!(
        a.metric("sluice_concurrency_slots{policy=\"p\"}").await,
        here
    );
    assert_eq!(first.await.unwrap().status, StatusCode::OK);
    assert_eq!(second.await.unwrap().status, StatusCode::OK);
    wait_until_async(|| async { used(&a, "c", 0).await == 0 }).await;
    assert_eq!(
        a.metric("sluice_concurrency_slots{policy=\"p\"}").await,
        0.0
    );
    // A client that goes away mid-body gives its slot back.
    {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let mut stream = tokio::net::TcpStream::connect(a.addr).await.unwrap();
        stream
            .write_all(b"GET /drip/60000 HTTP/1.1\r\nhost: x\r\nx-key: c\r\n\r\n")
            .await
            .unwrap();
        let mut buf = [0u8; 1024];
        let _ = stream.read(&mut buf).await.unwrap();
        assert_eq!(used(&a, "c", 0).await, 1);
    }
    wait_until_async(|| async { used(&a, "c", 0).await == 0 }).await;
    // And one that goes away before the answer (the upstream still busy).
    {
        use tokio::io::AsyncWriteExt;
        let mut stream = tokio::net::TcpStream::connect(a.addr).await.unwrap();
        stream
            .write_all(b"GET /slow/60000 HTTP/1.1\r\nhost: x\r\nx-key: c\r\n\r\n")
            .await
            .unwrap();
        wait_until_async(|| async { used(&a, "c", 0).await == 1 }).await;
    }
    wait_until_async(|| async { used(&a, "c", 0).await == 0 }).await;
    assert_eq!(get(&a.url("/echo"), &k).await.status, StatusCode::OK);
}

#[tokio::test]
async fn concurrency_slots_on_the_memory_store() {
    slots_are_held_while_requests_run("").await;
}

#[tokio::test]
async fn concurrency_slots_across_instances_on_redis() {
    let redis = RedisServer::start();
    let store = format!(
        "\n[store]\nbackend = \"redis\"\nurl = \"{}\"\n",
        redis.url()
    );
    slots_are_held_while_requests_run(&store).await;
}

#[tokio::test]
async fn concurrency_slots_across_instances_on_a_cluster() {
    let cluster = RedisCluster::start(3);
    let store = format!(
        "\n[store]\nbackend = \"redis\"\ncluster = [{}]\n",
        cluster.seeds_toml()
    );
    slots_are_held_while_requests_run(&store).await;
}

/// An instance killed (SIGKILL) while it holds slots: they come free within
/// one lease, and a request that outlives its lease keeps its slot (renewed).
#[tokio::test]
async fn slots_of_a_killed_instance_come_free_within_a_lease() {
    let up = Upstream::start().await;
    let redis = RedisServer::start();
    let policy = "key = \"header:X-Key\"\nlimits = [{ limit = 1, algorithm = \"concurrency\", lease = \"2s\" }]";
    let store = format!(
        "\n[store]\nbackend = \"redis\"\nurl = \"{}\"\n",
        redis.url()
    );
    let dir = std::env::temp_dir().join(format!("sluice-kill-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let file = dir.join("kill.toml");
    let text = config(&up, &store, policy, "").replace(
        "[server]",
        &format!("[server]\nlisten = \"127.0.0.1:{port}\""),
    );
    std::fs::write(&file, text).unwrap();
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_sluice"))
        .arg("--config")
        .arg(&file)
        .stdout(std::process::Stdio::null())
        .stderr(std::fs::File::create(dir.join("stderr")).unwrap())
        .spawn()
        .unwrap();
    let other = Sluice::start(&config(&up, &store, policy, "")).await;
    let url = format!("http://127.0.0.1:{port}/slow/60000");
    wait_until_async(|| async {
        tokio::net::TcpStream::connect(("127.0.0.1", port))
            .await
            .is_ok()
    })
    .await;
    // The killed instance's request holds the one slot.
    let held = tokio::spawn(async move { get(&url, &[("x-key", "k")]).await });
    wait_until_async(|| async { used(&other, "k", 0).await == 1 }).await;
    let k = [("x-key", "k")];
    assert_eq!(
        get(&other.url("/echo"), &k).await.status,
        StatusCode::TOO_MANY_REQUESTS
    );
    let killed = Instant::now();
    child.kill().unwrap();
    child.wait().unwrap();
    held.abort();
    wait_until_async(|| async { get(&other.url("/echo"), &k).await.status == StatusCode::OK })
        .await;
    let took = killed.elapsed();
    assert!(took <= Duration::from_millis(2_500), "{took:?}");
    // A request longer than its lease keeps its slot: renewed while it runs.
    let url = other.url("/drip/4000");
    let long = tokio::spawn(async move { get(&url, &[("x-key", "k")]).await });
    wait_until_async(|| async { used(&other, "k", 0).await == 1 }).await;
    let started = Instant::now();
    while started.elapsed() < Duration::from_millis(3_000) {
        let r = get(&other.url("/echo"), &k).await;
        assert_eq!(
            r.status,
            StatusCode::TOO_MANY_REQUESTS,
            "after {:?}",
            started.elapsed()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert_eq!(long.await.unwrap().status, StatusCode::OK);
    let _ = std::fs::remove_dir_all(&dir);
}

/// nginx's `limit_req` with `burst` and without `nodelay`: 10 a second
/// (one every 100 ms) and a burst of 1; a request that passes within 450 ms
/// is held, then forwarded, and says how long; later ones are refused.
#[tokio::test]
async fn a_delay_paces_requests_instead_of_refusing_them() {
    let up = Upstream::start().await;
    let s = Sluice::start(&config(
        &up,
        "",
        "key = \"header:X-Key\"\nlimits = [{ limit = 10, window = \"1s\", algorithm = \"gcra\", delay = \"450ms\" }]",
        "",
    ))
    .await;
    let k = [("x-key", "d")];
    let started = Instant::now();
    let mut delays = Vec::new();
    for _ in 0..5 {
        let r = get(&s.url("/echo"), &k).await;
        assert_eq!(r.status, StatusCode::OK);
        delays.push(
            r.header("x-ratelimit-delay-ms")
                .map_or(0, |v| v.parse::<u64>().unwrap()),
        );
    }
    // Five at once pass in about 400 ms: paced, not refused.
    assert_eq!(delays[0], 0);
    assert!(delays[1..].iter().all(|&d| d > 0), "{delays:?}");
    assert!(
        started.elapsed() >= Duration::from_millis(300),
        "{:?}",
        started.elapsed()
    );
    // Sent together, the ones past the delay are refused.
    let burst: Vec<_> = (0..8)
        .map(|_| {
            let url = s.url("/echo");
            tokio::spawn(async move { get(&url, &[("x-key", "e")]).await.status })
        })
        .collect();
    let mut ok = 0;
    for b in burst {
        if b.await.unwrap() == StatusCode::OK {
            ok += 1;
        }
    }
    assert!((4..=6).contains(&ok), "{ok}");
    assert_eq!(
        s.metric("sluice_delayed_total{policy=\"p\"}").await as u64,
        4 + (ok - 1)
    );
}

/// Held requests are bounded (`server.max_delayed`): past it, 429 and
/// nothing charged; a client that leaves while held gets its charge back.
#[tokio::test]
async fn held_requests_are_bounded_and_a_client_that_leaves_is_refunded() {
    let up = Upstream::start().await;
    let cfg = config(
        &up,
        "max_delayed = 1",
        "key = \"header:X-Key\"\nlimits = [{ limit = 1, window = \"1s\", algorithm = \"gcra\", burst = 1, delay = \"5s\" }]",
        "",
    );
    let s = Sluice::start(&cfg).await;
    let k = [("x-key", "m")];
    assert_eq!(get(&s.url("/echo"), &k).await.status, StatusCode::OK);
    // The second is held (about a second); the third finds no room.
    use tokio::io::AsyncWriteExt;
    let mut held = tokio::net::TcpStream::connect(s.addr).await.unwrap();
    held.write_all(b"GET /echo HTTP/1.1\r\nhost: x\r\nx-key: m\r\n\r\n")
        .await
        .unwrap();
    wait_until_async(|| async {
        s.metric("sluice_decisions_total{policy=\"p\",plan=\"default\",outcome=\"allowed\"}")
            .await
            == 2.0
    })
    .await;
    let refused = get(&s.url("/echo"), &k).await;
    assert_eq!(refused.status, StatusCode::TOO_MANY_REQUESTS);
    assert!(refused.header_u64("retry-after") >= 1);
    // The held client leaves: its charge comes back, so the next request
    // waits a second (the first one's), not two.
    drop(held);
    // (Its remaining counts the room the delay gives: 5 once only the
    // first request's second is taken.)
    wait_until_async(|| async { usage(&s, "m").await["limits"][0]["remaining"] == 5 }).await;
    let r = get(&s.url("/echo"), &k).await;
    assert_eq!(r.status, StatusCode::OK);
    let waited = r
        .header("x-ratelimit-delay-ms")
        .map_or(0, |v| v.parse::<u64>().unwrap());
    assert!(waited <= 1_000, "{waited}");
}
