//! Redis outages: killed, hung (SIGSTOP), restarted, scripts flushed. No
//! request waits longer than `store.timeout`, and limiting comes back by itself.

mod support;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU16, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use http::StatusCode;
use support::*;

const TIMEOUT_MS: u64 = 100;

async fn start(redis_port: u16, upstream: &Upstream, on_error: &str, limit: u64) -> Sluice {
    let cfg = format!(
        r#"
[store]
backend = "redis"
url = "redis://127.0.0.1:{redis_port}/0"
timeout = "{TIMEOUT_MS}ms"
on_error = "{on_error}"
deny_cache = false

[upstreams.api]
url = "{}"

[policies.p]
limits = [{{ limit = {limit}, window = "1h" }}]

[[routes]]
path = "/"
upstream = "api"
policy = "p"
"#,
        upstream.url()
    );
    Sluice::start(&cfg).await
}

/// GETs `/`, returning the status and how long it took.
async fn timed(s: &Sluice) -> (StatusCode, Duration) {
    let started = Instant::now();
    let r = get(&s.url("/"), &[]).await;
    (r.status, started.elapsed())
}

/// The slowest of `n` requests, all expected to have `want`.
async fn slowest(s: &Sluice, n: usize, want: StatusCode) -> Duration {
    let mut worst = Duration::ZERO;
    for _ in 0..n {
        let (status, took) = timed(s).await;
        assert_eq!(status, want);
        worst = worst.max(took);
    }
    worst
}

#[tokio::test]
async fn killed_redis_fails_open_fast_and_limiting_resumes_when_it_returns() {
    let up = Upstream::start().await;
    let redis = RedisServer::start();
    let s = start(redis.port, &up, "allow", 3).await;
    for _ in 0..3 {
        assert_eq!(timed(&s).await.0, StatusCode::OK);
    }
    assert_eq!(timed(&s).await.0, StatusCode::TOO_MANY_REQUESTS);

    let port = redis.kill();
    let worst = slowest(&s, 10, StatusCode::OK).await;
    let bound = Duration::from_millis(TIMEOUT_MS + 50);
    assert!(worst < bound, "slowest request with Redis dead: {worst:?}");
    eprintln!("slowest request with Redis dead: {worst:?}");
    assert!(s.metric("sluice_store_errors_total").await >= 10.0);

    // Back, empty (a restart without persistence): limiting resumes by itself.
    let _redis = RedisServer::start_on(port);
    let back = Instant::now();
    let mut statuses = Vec::new();
    loop {
        let (status, took) = timed(&s).await;
        assert!(took < bound, "{took:?}");
        statuses.push(status);
        if status == StatusCode::TOO_MANY_REQUESTS {
            break;
        }
        assert!(
            back.elapsed() < Duration::from_secs(1),
            "not limiting 1 s after Redis came back: {statuses:?}"
        );
    }
    let counted = statuses.len();
    assert!(counted >= 4, "{statuses:?}");
    eprintln!(
        "first limited request {:?} after Redis came back",
        back.elapsed()
    );
}

#[tokio::test]
async fn hung_redis_is_treated_like_a_dead_one() {
    let up = Upstream::start().await;
    let redis = RedisServer::start();
    for (on_error, want) in [
        ("allow", StatusCode::OK),
        ("deny", StatusCode::SERVICE_UNAVAILABLE),
    ] {
        let s = start(redis.port, &up, on_error, 1000).await;
        assert_eq!(timed(&s).await.0, StatusCode::OK);
        redis.signal("-STOP");
        let worst = slowest(&s, 5, want).await;
        redis.signal("-CONT");
        let bound = Duration::from_millis(TIMEOUT_MS + 50);
        assert!(
            worst < bound,
            "{on_error}: slowest request with Redis hung: {worst:?}"
        );
        eprintln!("{on_error}: slowest request with Redis hung: {worst:?}");
        // Thawed: answers again within a second.
        let thawed = Instant::now();
        loop {
            let r = get(&s.url("/"), &[]).await;
            if r.header("x-ratelimit-remaining").is_some() {
                break;
            }
            assert!(
                thawed.elapsed() < Duration::from_secs(1),
                "{on_error}: not limiting 1 s after SIGCONT"
            );
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restart_and_script_flush_under_load_give_no_client_errors() {
    let up = Upstream::start().await;
    let redis = RedisServer::start();
    let s = Arc::new(start(redis.port, &up, "allow", 1_000_000).await);
    let stop = Arc::new(AtomicBool::new(false));
    let done = Arc::new(AtomicU64::new(0));
    let mut load = Vec::new();
    for _ in 0..8 {
        let (s, stop, done) = (s.clone(), stop.clone(), done.clone());
        load.push(tokio::spawn(async move {
            let c = client();
            while !stop.load(Ordering::Relaxed) {
                let req = http::Request::get(s.url("/")).body(empty()).unwrap();
                assert_eq!(send(&c, req).await.status, StatusCode::OK);
                done.fetch_add(1, Ordering::Relaxed);
            }
        }));
    }
    // Each event happens while the load runs: wait for 50 more requests around it.
    let more = |n: u64| {
        let done = done.clone();
        let target = done.load(Ordering::Relaxed) + n;
        async move { wait_until(|| done.load(Ordering::Relaxed) >= target).await }
    };
    more(50).await;
    let _: () = redis::cmd("SCRIPT")
        .arg("FLUSH")
        .query(&mut redis.conn())
        .unwrap();
    more(50).await;
    let port = redis.kill();
    more(50).await;
    let redis = RedisServer::start_on(port);
    more(50).await;
    stop.store(true, Ordering::Relaxed);
    for t in load {
        t.await.unwrap();
    }
    // And the counts are Redis's again.
    let r = get(&s.url("/"), &[]).await;
    assert!(r.header("x-ratelimit-remaining").is_some());
    drop(redis);
}

/// Calls that time out while Redis hangs still have replies on the way: those
/// are dropped when they come, and every later call gets its own reply.
#[tokio::test]
async fn replies_to_timed_out_calls_do_not_reach_later_calls() {
    use sluice::config::{Algorithm, Backend, ClockSource, OnError, StoreConfig};
    use sluice::store::redis::RedisStore;
    use sluice::store::{Counter, StoreError};

    let redis = RedisServer::start();
    let store = RedisStore::new(&StoreConfig {
        backend: Backend::Redis,
        url: Some(redis.url()),
        cluster: Vec::new(),
        timeout: Duration::from_millis(TIMEOUT_MS),
        ca: None,
        on_error: OnError::Deny,
        clock: ClockSource::Local,
        prefix: "t:".into(),
        deny_cache: false,
        max_keys: 1000,
    })
    .unwrap();
    let counter = |id: &str| Counter {
        key: format!("{{{id}}}:p:0").as_bytes().into(),
        group_len: id.len() + 4,
        limit: 100,
        window_ms: 3_600_000,
        algorithm: Algorithm::Fixed,
        calendar: None,
    };
    let (a, b) = ([counter("a")], [counter("b")]);
    let now = sluice::clock::wall_ms();
    let remaining = |o: sluice::store::Outcome| o.states[0].remaining;
    for _ in 0..5 {
        store.acquire(&a, None, 1, 1, now).await.unwrap();
    }

    redis.signal("-STOP");
    let hung = Instant::now();
    let calls = (0..3).map(|_| store.acquire(&a, None, 1, 1, now));
    for r in futures_util::future::join_all(calls).await {
        assert!(matches!(r, Err(StoreError::Timeout)), "{r:?}");
    }
    let waited = hung.elapsed();
    assert!(
        waited < Duration::from_millis(TIMEOUT_MS + 50),
        "{waited:?}"
    );
    redis.signal("-CONT");

    // Redis runs the three timed-out calls (they were sent), then these.
    assert_eq!(
        remaining(store.acquire(&b, None, 1, 1, now).await.unwrap()),
        99
    );
    assert_eq!(
        remaining(store.acquire(&a, None, 1, 1, now).await.unwrap()),
        91
    );
}

/// A TCP relay to Redis whose connections can be made to go silent: they stay
/// open but pass nothing on, as with a host gone dark. Connections made after
/// that pass bytes as usual (the address now leads to a live server).
struct Relay {
    port: u16,
    /// Connections numbered below this pass nothing on.
    silent_below: Arc<AtomicU64>,
    /// The Redis port that new connections lead to.
    to: Arc<AtomicU16>,
    made: Arc<AtomicU64>,
}

impl Relay {
    async fn start(redis_port: u16) -> Relay {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let silent_below = Arc::new(AtomicU64::new(0));
        let made = Arc::new(AtomicU64::new(0));
        let to = Arc::new(AtomicU16::new(redis_port));
        let (silent, count, port_now) = (silent_below.clone(), made.clone(), to.clone());
        tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let n = count.fetch_add(1, Ordering::SeqCst);
                let redis =
                    tokio::net::TcpStream::connect(("127.0.0.1", port_now.load(Ordering::SeqCst)))
                        .await
                        .unwrap();
                let (cr, cw) = client.into_split();
                let (rr, rw) = redis.into_split();
                for (mut from, mut to) in [
                    (
                        Box::new(cr) as Box<dyn tokio::io::AsyncRead + Unpin + Send>,
                        Box::new(rw) as Box<dyn tokio::io::AsyncWrite + Unpin + Send>,
                    ),
                    (Box::new(rr), Box::new(cw)),
                ] {
                    let silent = silent.clone();
                    tokio::spawn(async move {
                        let mut buf = vec![0; 64 * 1024];
                        while let Ok(read @ 1..) = from.read(&mut buf).await {
                            if n < silent.load(Ordering::SeqCst) {
                                // Keeps both ends open, passing nothing on.
                                std::future::pending::<()>().await;
                            }
                            if to.write_all(&buf[..read]).await.is_err() {
                                break;
                            }
                        }
                    });
                }
            }
        });
        Relay {
            port,
            silent_below,
            to,
            made,
        }
    }

    /// Every connection made so far goes silent.
    fn silence(&self) {
        let made = self.made.load(Ordering::SeqCst);
        self.silent_below.store(made, Ordering::SeqCst);
    }

    /// New connections lead to the Redis on `port` (as a name would after a
    /// failover).
    fn point_to(&self, port: u16) {
        self.to.store(port, Ordering::SeqCst);
    }

    fn connections(&self) -> u64 {
        self.made.load(Ordering::SeqCst)
    }
}

/// Requests until one is counted again (has rate-limit fields), each passing
/// (failing open) meanwhile; `may_fail` is asked after each failed one, with
/// how many have. Returns that number and the counted one's remaining.
async fn until_counted(s: &Sluice, may_fail: impl Fn(u32) -> bool) -> (u32, String) {
    let mut failed_open = 0;
    loop {
        let r = get(&s.url("/"), &[]).await;
        assert_eq!(r.status, StatusCode::OK);
        if let Some(remaining) = r.header("x-ratelimit-remaining") {
            return (failed_open, remaining.to_string());
        }
        failed_open += 1;
        assert!(
            may_fail(failed_open),
            "still failing open after {failed_open} requests"
        );
    }
}

/// A Redis connection that goes silent but stays open (a host gone dark, a
/// failover that moved the address) is taken for dead once a call is
/// `GIVE_UP` (1 s) late, and the next request connects anew: limiting comes
/// back without a restart, instead of every request timing out until the
/// kernel gives the connection up.
#[tokio::test]
async fn a_connection_gone_silent_is_made_anew() {
    let up = Upstream::start().await;
    let redis = RedisServer::start();
    let relay = Relay::start(redis.port).await;
    let s = start(relay.port, &up, "allow", 1000).await;
    let r = get(&s.url("/"), &[]).await;
    assert_eq!(r.header("x-ratelimit-remaining"), Some("999"));
    assert_eq!(relay.connections(), 1);

    relay.silence();
    let silent = Instant::now();
    let (failed_open, remaining) =
        until_counted(&s, |_| silent.elapsed() < Duration::from_secs(10)).await;
    // The silenced call reached Redis no more; this one is counted.
    assert_eq!(remaining, "998");
    eprintln!(
        "limiting back {:?} after the connection went silent ({failed_open} requests failed open)",
        silent.elapsed()
    );
    assert!(failed_open > 0, "the silent connection was never used");
    assert_eq!(relay.connections(), 2, "one new connection");
}

/// A failover behind one address (a managed Redis's primary endpoint, moved to
/// the promoted replica): the old connection leads to a server that became a
/// replica, which refuses the script's write with READONLY. sluice connects
/// anew and counts on the new primary, instead of failing every decision on
/// the old connection.
#[tokio::test]
async fn a_primary_turned_replica_is_left_for_the_new_one() {
    let up = Upstream::start().await;
    let (old, new) = (RedisServer::start(), RedisServer::start());
    let relay = Relay::start(old.port).await;
    let s = start(relay.port, &up, "allow", 1000).await;
    for want in ["999", "998"] {
        let r = get(&s.url("/"), &[]).await;
        assert_eq!(r.header("x-ratelimit-remaining"), Some(want));
    }

    // The failover: the old primary follows the new one, and the address
    // leads to the new one.
    let _: () = redis::cmd("REPLICAOF")
        .arg("127.0.0.1")
        .arg(new.port)
        .query(&mut old.conn())
        .unwrap();
    relay.point_to(new.port);
    let (failed_open, remaining) = until_counted(&s, |failed| failed < 5).await;
    // The new primary's count (this one never had the old one's data).
    assert_eq!(remaining, "999");
    assert_eq!(failed_open, 1, "only the request that met READONLY");
    assert_eq!(relay.connections(), 2, "one new connection");
    assert!(s.metric("sluice_store_errors_total").await >= 1.0);
}
