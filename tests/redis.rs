//! The Redis store end to end: a real redis-server (and, for each test again,
//! a real Redis Cluster) per test, real upstream, real client, sluice
//! in-process.

#[macro_use]
mod support;

use std::time::Duration;

use http::StatusCode;
use sluice::clock::Clock;
use support::*;

fn config(redis: &TestRedis, upstream: &Upstream, clock: &str, policy: &str) -> String {
    format!(
        r#"
[store]
backend = "redis"
{redis}
timeout = "500ms"
clock = "{clock}"
prefix = "t:"

[headers]
style = "both"

[upstreams.api]
url = "{upstream}"

{policy}

[[routes]]
path = "/"
upstream = "api"
policy = "p"
"#,
        redis = redis.store_toml(),
        upstream = upstream.url(),
    )
}

/// A clock just past the start of a window, so a test has the whole window.
fn clock_at_window_start(window_ms: u64) -> Clock {
    let clock = Clock::system();
    let now = clock.now_ms();
    clock.set_offset_ms((window_ms - now % window_ms) as i64 + 1);
    clock
}

on_both!(
    one_evalsha_per_decision_and_one_more_per_refund,
    one_evalsha_per_decision_and_one_more_per_refund_on
);

async fn one_evalsha_per_decision_and_one_more_per_refund_on(redis: TestRedis) {
    let up = Upstream::start().await;
    let policy = "[policies.p]\nlimits = [{ limit = 3, window = \"1m\" }, { limit = 100, window = \"1h\", precision = \"1m\" }]";
    let s = Sluice::start_with_clock(
        &config(&redis, &up, "local", policy),
        clock_at_window_start(60_000),
    )
    .await;
    // Make sure both scripts are loaded (sluice preloads them, but does not
    // wait for it); count from then on.
    assert_eq!(
        get(&s.url("/status/304"), &[]).await.status,
        StatusCode::NOT_MODIFIED
    );
    redis.reset_stats();

    let allowed = get(&s.url("/a"), &[]).await;
    assert_eq!(allowed.status, StatusCode::OK);
    assert_eq!(
        redis.round_trips(),
        1,
        "an allowed request is one Redis command"
    );
    assert_eq!(redis.evalsha_calls(), 1);

    redis.reset_stats();
    let refunded = get(&s.url("/status/304"), &[]).await;
    assert_eq!(refunded.status, StatusCode::NOT_MODIFIED);
    assert_eq!(
        redis.evalsha_calls(),
        2,
        "a refunded request: decision + refund"
    );
    assert_eq!(redis.round_trips(), 2);

    assert_eq!(get(&s.url("/b"), &[]).await.status, StatusCode::OK);
    assert_eq!(get(&s.url("/b"), &[]).await.status, StatusCode::OK);
    redis.reset_stats();
    let denied = get(&s.url("/c"), &[]).await;
    assert_eq!(denied.status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(
        redis.round_trips(),
        1,
        "a rejection is answered from the deciding call"
    );
    // The headers came from that call.
    assert_eq!(denied.header_u64("x-ratelimit-limit"), 3);
    assert_eq!(denied.header_u64("x-ratelimit-remaining"), 0);
    assert!(denied.header_u64("retry-after") >= 1);
    assert_eq!(up.hits(), 5);
    let refunds = s.metric("sluice_refunds_total{policy=\"p\"}").await;
    assert_eq!(refunds, 2.0, "the warm-up 304 and the counted one");
    let metrics =
        String::from_utf8_lossy(&get(&s.admin_url("/metrics"), &[]).await.body).into_owned();
    assert!(
        metrics.contains("sluice_requests_total{route=\"/\",status=\"429\"} 1"),
        "{metrics}"
    );
    // Every decision is timed: the five forwarded and the one denied.
    assert!(
        metrics.contains("sluice_store_call_seconds_count 6"),
        "{metrics}"
    );
    assert!(
        metrics.contains("sluice_upstream_seconds_count{upstream=\"api\"} 5"),
        "{metrics}"
    );
}

on_both!(
    script_flush_is_invisible_to_clients,
    script_flush_is_invisible_to_clients_on
);

async fn script_flush_is_invisible_to_clients_on(redis: TestRedis) {
    let up = Upstream::start().await;
    let policy = "[policies.p]\nlimits = [{ limit = 100, window = \"1m\" }]";
    let s = Sluice::start(&config(&redis, &up, "redis", policy)).await;
    // One connection: its first decision takes the general way (and keeps
    // its command), the next ones the short way; a fresh connection's first
    // takes the general way again. Each must get past a flush.
    let c = client();
    let remaining = |r: &Reply| (r.status, r.header_u64("x-ratelimit-remaining"));
    let on_c = || send(&c, http::Request::get(s.url("/")).body(empty()).unwrap());
    assert_eq!(remaining(&on_c().await), (StatusCode::OK, 99));
    assert_eq!(remaining(&on_c().await), (StatusCode::OK, 98));
    redis.script_flush();
    assert_eq!(
        remaining(&on_c().await),
        (StatusCode::OK, 97),
        "the count survived the flush, on a connection's short way"
    );
    redis.script_flush();
    assert_eq!(
        remaining(&get(&s.url("/"), &[]).await),
        (StatusCode::OK, 96),
        "the count survived the flush, on the general way"
    );
}

on_both!(
    instances_with_disagreeing_clocks_share_one_exact_limit,
    instances_with_disagreeing_clocks_share_one_exact_limit_on
);

async fn instances_with_disagreeing_clocks_share_one_exact_limit_on(redis: TestRedis) {
    let up = Upstream::start().await;
    let policy = "[policies.p]\nlimits = [{ limit = 10, window = \"1h\" }]";
    let cfg = config(&redis, &up, "redis", policy);
    // Half an hour apart: with local clocks they would count in different windows.
    let early = Clock::system();
    early.set_offset_ms(-30 * 60 * 1000);
    let late = Clock::system();
    late.set_offset_ms(30 * 60 * 1000);
    let a = Sluice::start_with_clock(&cfg, early).await;
    let b = Sluice::start_with_clock(&cfg, late).await;
    let mut admitted = 0;
    let mut resets = std::collections::HashSet::new();
    for i in 0..30 {
        let s = if i % 2 == 0 { &a } else { &b };
        let r = get(&s.url("/"), &[]).await;
        if r.status == StatusCode::OK {
            admitted += 1;
            resets.insert(r.header_u64("x-ratelimit-reset"));
        }
        // Seconds to the reset are measured on Redis's clock, not the skewed one.
        let t: u64 = r
            .header("ratelimit")
            .unwrap()
            .rsplit("t=")
            .next()
            .unwrap()
            .parse()
            .unwrap();
        assert!(t <= 3600, "t={t}");
    }
    assert_eq!(admitted, 10);
    // Unless the hour turned during the test, both report the same reset.
    assert!(resets.len() <= 2, "{resets:?}");
}

on_both!(
    every_algorithm_with_weighted_cost_through_redis,
    every_algorithm_with_weighted_cost_through_redis_on
);

async fn every_algorithm_with_weighted_cost_through_redis_on(redis: TestRedis) {
    let up = Upstream::start().await;
    let policy = "[policies.p]\nlimits = [\n\
        { limit = 10, window = \"1m\" },\n\
        { limit = 10, window = \"1h\", precision = \"1m\" },\n\
        { limit = 10, window = \"30s\", algorithm = \"log\" },\n\
        { limit = 10, window = \"10s\", algorithm = \"gcra\", burst = 10 },\n]";
    let s = Sluice::start_with_clock(
        &config(&redis, &up, "local", policy),
        clock_at_window_start(60_000),
    )
    .await;
    let c = client();
    let req = || {
        http::Request::get(s.url("/x"))
            .header("x-cost", "1")
            .body(empty())
            .unwrap()
    };
    for expected in [9, 8, 7] {
        let r = send(&c, req()).await;
        assert_eq!(r.header_u64("x-ratelimit-remaining"), expected);
    }
    // Every limit holds the same count: the IETF header lists them all.
    let r = send(&c, req()).await;
    let policy_header = r.header("ratelimit-policy").unwrap();
    assert_eq!(
        policy_header.matches(";q=10;").count(),
        4,
        "{policy_header}"
    );
    let keys: Vec<String> = redis
        .keys()
        .into_iter()
        .filter(|k| k.starts_with("t:"))
        .collect();
    // One packed string for the identity's fixed, sliding and gcra records,
    // and the log's own sorted set.
    assert_eq!(keys.len(), 2, "{keys:?}");
    let packed = keys.iter().find(|k| !k.ends_with(":log")).unwrap();
    let records: u64 = redis.query(
        redis::cmd("EVAL")
            .arg(
                "local raw, off, n = redis.call('GET', KEYS[1]), 10, 0 \
                 while off + 9 <= #raw do \
                   off, n = off + 10 + struct.unpack('>I2', raw, off + 8), n + 1 \
                 end return n",
            )
            .arg(1)
            .arg(packed),
    );
    assert_eq!(records, 3);
    let log_key = keys.iter().find(|k| k.ends_with(":30s:log")).unwrap();
    let units: u64 = redis.query(redis::cmd("ZCARD").arg(log_key));
    assert_eq!(units, 4, "one sorted-set entry per charged unit");
}

on_both!(
    refunds_give_back_exactly_and_after_mode_charges_later,
    refunds_give_back_exactly_and_after_mode_charges_later_on
);

async fn refunds_give_back_exactly_and_after_mode_charges_later_on(redis: TestRedis) {
    let up = Upstream::start().await;
    let policy = "[policies.p]\nlimits = [{ limit = 5, window = \"1m\" }, { limit = 5, window = \"1m\", algorithm = \"log\" }, { limit = 5, window = \"1m\", algorithm = \"gcra\", burst = 5 }]";
    let s = Sluice::start_with_clock(
        &config(&redis, &up, "local", policy),
        clock_at_window_start(60_000),
    )
    .await;
    for _ in 0..10 {
        assert_eq!(
            get(&s.url("/status/304"), &[]).await.status,
            StatusCode::NOT_MODIFIED
        );
    }
    let r = get(&s.url("/"), &[]).await;
    assert_eq!(
        r.header_u64("x-ratelimit-remaining"),
        4,
        "every 304 was refunded in every algorithm"
    );

    let after = "[policies.p]\ncharge = \"after\"\nlimits = [{ limit = 2, window = \"1m\" }]";
    let s2 = Sluice::start_with_clock(
        &config(&redis, &up, "local", after).replace("prefix = \"t:\"", "prefix = \"after:\""),
        clock_at_window_start(60_000),
    )
    .await;
    for _ in 0..4 {
        assert_eq!(
            get(&s2.url("/status/304"), &[]).await.status,
            StatusCode::NOT_MODIFIED
        );
    }
    assert_eq!(get(&s2.url("/"), &[]).await.status, StatusCode::OK);
    assert_eq!(get(&s2.url("/"), &[]).await.status, StatusCode::OK);
    assert_eq!(
        get(&s2.url("/"), &[]).await.status,
        StatusCode::TOO_MANY_REQUESTS
    );
}

on_both!(
    ietf_headers_put_the_denying_limit_first,
    ietf_headers_put_the_denying_limit_first_on
);

async fn ietf_headers_put_the_denying_limit_first_on(redis: TestRedis) {
    let up = Upstream::start().await;
    let policy = "[policies.p]\nlimits = [{ limit = 100, window = \"1h\" }, { limit = 1, window = \"10s\" }]";
    let s = Sluice::start_with_clock(
        &config(&redis, &up, "local", policy),
        clock_at_window_start(3_600_000),
    )
    .await;
    let ok = get(&s.url("/"), &[]).await;
    assert_eq!(ok.header("ratelimit").unwrap(), "\"p-10s\";r=0;t=10");
    let denied = get(&s.url("/"), &[]).await;
    assert_eq!(denied.status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(
        denied.header("ratelimit-policy").unwrap(),
        "\"p-10s\";q=1;w=10, \"p-1h\";q=100;w=3600"
    );
    let t: u64 = denied
        .header("ratelimit")
        .unwrap()
        .rsplit("t=")
        .next()
        .unwrap()
        .parse()
        .unwrap();
    // -11: on a denial the effective window ends when Retry-After does.
    assert_eq!(denied.header_u64("retry-after"), t);
    // Only the limit that refused is named in the problem body.
    assert_eq!(
        denied.json()["violated-policies"],
        serde_json::json!(["p-10s"])
    );
    s.clock
        .advance(Duration::from_secs(denied.header_u64("retry-after")));
    assert_eq!(get(&s.url("/"), &[]).await.status, StatusCode::OK);
}

#[tokio::test]
async fn a_dead_redis_fails_open_or_closed_within_the_timeout() {
    let up = Upstream::start().await;
    let dead = dead_port().await;
    for (on_error, want) in [
        ("allow", StatusCode::OK),
        ("deny", StatusCode::SERVICE_UNAVAILABLE),
    ] {
        let cfg = format!(
            "[store]\nbackend = \"redis\"\nurl = \"redis://{dead}\"\ntimeout = \"100ms\"\non_error = \"{on_error}\"\n\
             [upstreams.api]\nurl = \"{}\"\n[policies.p]\nlimits = [{{ limit = 1, window = \"1m\" }}]\n\
             [[routes]]\npath = \"/\"\nupstream = \"api\"\npolicy = \"p\"\n",
            up.url()
        );
        let s = Sluice::start(&cfg).await;
        let ready = get(&s.admin_url("/readyz"), &[]).await;
        assert_eq!(
            ready.status,
            StatusCode::SERVICE_UNAVAILABLE,
            "/readyz while Redis is down"
        );
        assert_eq!(
            get(&s.admin_url("/healthz"), &[]).await.status,
            StatusCode::OK
        );
        for _ in 0..3 {
            let started = std::time::Instant::now();
            let r = get(&s.url("/"), &[]).await;
            assert_eq!(r.status, want);
            assert!(
                started.elapsed() < Duration::from_millis(600),
                "{:?}",
                started.elapsed()
            );
            if want == StatusCode::SERVICE_UNAVAILABLE {
                assert_eq!(r.header("retry-after"), Some("1"));
                assert_eq!(r.header("content-type"), Some("application/problem+json"));
            }
        }
        assert_eq!(s.metric("sluice_store_errors_total").await, 3.0);
    }
}

on_both!(
    deny_cache_makes_an_abusive_client_free_for_redis,
    deny_cache_makes_an_abusive_client_free_for_redis_on
);

async fn deny_cache_makes_an_abusive_client_free_for_redis_on(redis: TestRedis) {
    let up = Upstream::start().await;
    let policy = "[policies.p]\nlimits = [{ limit = 2, window = \"1m\" }]";
    for deny_cache in [true, false] {
        let cfg = config(&redis, &up, "local", policy).replace(
            "prefix = \"t:\"",
            &format!("prefix = \"t{deny_cache}:\"\ndeny_cache = {deny_cache}"),
        );
        let s = Sluice::start_with_clock(&cfg, clock_at_window_start(60_000)).await;
        get(&s.url("/"), &[]).await;
        get(&s.url("/"), &[]).await;
        redis.reset_stats();
        let first = get(&s.url("/"), &[]).await;
        assert_eq!(first.status, StatusCode::TOO_MANY_REQUESTS);
        for _ in 0..50 {
            let r = get(&s.url("/"), &[]).await;
            assert_eq!(r.status, StatusCode::TOO_MANY_REQUESTS);
            assert_eq!(
                r.header("x-ratelimit-reset"),
                first.header("x-ratelimit-reset")
            );
            assert_eq!(r.header_u64("x-ratelimit-remaining"), 0);
            assert!(r.header_u64("retry-after") >= 1);
        }
        let trips = redis.round_trips();
        if deny_cache {
            assert_eq!(trips, 1, "only the first rejection asked Redis");
            // Once the window has passed, the client is served again.
            s.clock
                .advance(Duration::from_secs(first.header_u64("retry-after")));
            assert_eq!(get(&s.url("/"), &[]).await.status, StatusCode::OK);
        } else {
            assert_eq!(trips, 51);
        }
    }
}

on_both!(
    usage_endpoint_reports_and_resets_an_identity,
    usage_endpoint_on
);

async fn usage_endpoint_on(redis: TestRedis) {
    let up = Upstream::start().await;
    let policy = "[policies.p]\nlimits = [{ limit = 3, window = \"1h\" }, { limit = 10, window = \"1d\", algorithm = \"log\" }]";
    let s = Sluice::start_with_clock(
        &config(&redis, &up, "local", policy),
        clock_at_window_start(3_600_000),
    )
    .await;
    for _ in 0..3 {
        assert_eq!(get(&s.url("/"), &[]).await.status, StatusCode::OK);
    }
    let denied = get(&s.url("/"), &[]).await;
    assert_eq!(denied.status, StatusCode::TOO_MANY_REQUESTS);
    let usage = get(&s.admin_url("/usage?policy=p&key=ip&value=127.0.0.1"), &[]).await;
    assert_eq!(usage.status, StatusCode::OK);
    let u = usage.json();
    assert_eq!(u["policy"], "p");
    assert_eq!(u["limits"][0]["used"], 3);
    assert_eq!(u["limits"][0]["remaining"], 0);
    assert_eq!(u["limits"][0]["window"], "1h");
    assert_eq!(
        u["limits"][0]["reset"].as_u64(),
        denied
            .header("x-ratelimit-reset")
            .map(|r| r.parse().unwrap())
    );
    assert_eq!(u["limits"][1]["algorithm"], "log");
    assert_eq!(u["limits"][1]["used"], 3);
    // Asking charged nothing.
    let again = get(&s.admin_url("/usage?policy=p&key=ip&value=127.0.0.1"), &[]).await;
    assert_eq!(again.json()["limits"][0]["used"], 3);
    // The operator's unban: the client is served at once (the deny cache forgets it too).
    let del = send(
        &client(),
        http::Request::delete(s.admin_url("/usage?policy=p&key=ip&value=127.0.0.1"))
            .body(empty())
            .unwrap(),
    )
    .await;
    assert_eq!(del.status, StatusCode::OK);
    let r = get(&s.url("/"), &[]).await;
    assert_eq!(r.status, StatusCode::OK);
    assert_eq!(r.header_u64("x-ratelimit-remaining"), 2);
    // Bad questions get clear answers.
    assert_eq!(
        get(&s.admin_url("/usage?policy=nope&key=ip&value=1.2.3.4"), &[])
            .await
            .status,
        StatusCode::NOT_FOUND
    );
    assert_eq!(
        get(&s.admin_url("/usage?policy=p&key=cookie:x&value=1"), &[])
            .await
            .status,
        StatusCode::BAD_REQUEST
    );
    assert_eq!(
        get(&s.admin_url("/usage?policy=p&key=ip&value=not-an-ip"), &[])
            .await
            .status,
        StatusCode::BAD_REQUEST
    );
}

on_both!(a_fallback_record_keeps_its_lifetime, fallback_lifetime_on);

async fn fallback_lifetime_on(redis: TestRedis) {
    let up = Upstream::start().await;
    // A daily budget per API key (by address when the key is missing), next
    // to a per-second budget per address: both can live in the address's string.
    let policy = "[policies.p]\nlimits = [\n\
        { limit = 5, window = \"1d\", key = \"header:X-Key\" },\n\
        { limit = 100, window = \"1s\" },\n]";
    let s = Sluice::start(&config(&redis, &up, "redis", policy)).await;
    assert_eq!(get(&s.url("/"), &[]).await.status, StatusCode::OK);
    // Now with a key: only the address's per-second record is charged there.
    assert_eq!(
        get(&s.url("/"), &[("x-key", "k1")]).await.status,
        StatusCode::OK
    );
    let keys: Vec<String> = redis
        .keys()
        .into_iter()
        .filter(|k| k.starts_with("t:"))
        .collect();
    let ttls: Vec<i64> = keys
        .iter()
        .map(|k| redis.query(redis::cmd("PTTL").arg(k)))
        .collect();
    // The address's string still holds the daily record, so it lives until
    // the day's window ends (midnight UTC on Redis's clock), not for a second.
    // (It once asked for more than an hour: that failed in a day's last hour.)
    let (secs, micros): (u64, u64) = redis.query(&redis::cmd("TIME"));
    let now_ms = secs * 1000 + micros / 1000;
    let left = 86_400_000 - now_ms % 86_400_000;
    assert!(
        ttls.iter().filter(|&&t| t as u64 + 5_000 >= left).count() == 2,
        "{keys:?} {ttls:?}, {left} ms left in the day"
    );
    let usage = get(&s.admin_url("/usage?policy=p&key=ip&value=127.0.0.1"), &[])
        .await
        .json();
    let used: Vec<u64> = usage["limits"]
        .as_array()
        .unwrap()
        .iter()
        .map(|l| l["used"].as_u64().unwrap())
        .collect();
    // The daily record survived (the per-second one may have rolled over).
    assert_eq!(used[0], 1, "{usage}");
}

/// The database number of `store.url` is the one counters go to.
#[tokio::test]
async fn the_database_in_the_url_is_used() {
    let redis = RedisServer::start();
    let up = Upstream::start().await;
    let policy = "[policies.p]\nlimits = [{ limit = 5, window = \"1m\" }]";
    let single = TestRedis::Single(redis);
    let cfg = config(&single, &up, "local", policy).replace("/0\"", "/5\"");
    assert!(cfg.contains("/5\""), "{cfg}");
    let s = Sluice::start(&cfg).await;
    let r = get(&s.url("/"), &[]).await;
    assert_eq!(r.header_u64("x-ratelimit-remaining"), 4);
    let TestRedis::Single(redis) = &single else {
        unreachable!()
    };
    let mut conn = redis.conn();
    let mut keys_in = |db: i64| -> Vec<String> {
        let (keys,): (Vec<String>,) = redis::pipe()
            .cmd("SELECT")
            .arg(db)
            .ignore()
            .cmd("KEYS")
            .arg("t:*")
            .query(&mut conn)
            .unwrap();
        keys
    };
    let in_5 = keys_in(5);
    assert_eq!(in_5.len(), 1, "{in_5:?}");
    let in_0 = keys_in(0);
    assert!(in_0.is_empty(), "{in_0:?}");
}

/// A packed string outlives what its records need by a sixteenth of their life
/// (lua/acquire.lua), so that an identity asking once a minute moves its TTL
/// every few calls rather than every call; never by more, never by less.
#[tokio::test]
async fn the_ttl_moves_every_few_buckets_not_every_call() {
    let redis = TestRedis::Single(RedisServer::start());
    let up = Upstream::start().await;
    let policy = "[policies.p]\nlimits = [{ limit = 100, window = \"1h\", precision = \"1m\" }]";
    let clock = clock_at_window_start(60_000);
    let s = Sluice::start_with_clock(&config(&redis, &up, "local", policy), clock.clone()).await;
    let pttl = || -> i64 {
        let keys = redis.keys();
        assert_eq!(keys.len(), 1, "{keys:?}");
        redis.query(redis::cmd("PTTL").arg(&keys[0]))
    };
    // Just past the start of a minute, the hour of minutes needs an hour.
    let life = 60 * 60_000;
    let want = life + life / 16 + 1000;
    assert_eq!(get(&s.url("/"), &[]).await.status, StatusCode::OK);
    let first = pttl();
    assert!((want - 1000..=want).contains(&first), "{first} vs {want}");
    // A minute later the records need a minute more: the TTL stays.
    clock.advance(Duration::from_secs(60));
    assert_eq!(get(&s.url("/"), &[]).await.status, StatusCode::OK);
    let second = pttl();
    assert!(first - second < 1000, "moved: {first} -> {second}");
    // Four minutes after the first call they need more than it gives: moved,
    // by the same rule.
    clock.advance(Duration::from_secs(180));
    assert_eq!(get(&s.url("/"), &[]).await.status, StatusCode::OK);
    let later = pttl();
    assert!((want - 1000..=want).contains(&later), "{later} vs {want}");
}

on_both!(
    records_survive_reordered_removed_and_restored_limits,
    reordered_limits_on
);

/// Records are found by their limit, not their place: a reload that reorders
/// a policy's limits keeps every count, and one that drops a limit keeps its
/// record in the string, so restoring the limit restores its count.
async fn reordered_limits_on(redis: TestRedis) {
    let up = Upstream::start().await;
    let hour = "{ limit = 10, window = \"1h\" }";
    let day = "{ limit = 20, window = \"1d\" }";
    let sliding = "{ limit = 30, window = \"1h\", precision = \"1m\" }";
    let cfg = |limits: &[&str]| {
        config(
            &redis,
            &up,
            "local",
            &format!("[policies.p]\nlimits = [\n{}\n]", limits.join(",\n")),
        )
    };
    let parse = |text: String| {
        sluice::config::parse(&text, "test.toml", std::path::Path::new(".")).unwrap()
    };
    let s = Sluice::start_with_clock(
        &cfg(&[hour, day, sliding]),
        clock_at_window_start(86_400_000),
    )
    .await;
    let used = || async {
        let usage = get(&s.admin_url("/usage?policy=p&key=ip&value=127.0.0.1"), &[])
            .await
            .json();
        usage["limits"]
            .as_array()
            .unwrap()
            .iter()
            .map(|l| l["used"].as_u64().unwrap())
            .collect::<Vec<u64>>()
    };
    for _ in 0..3 {
        assert_eq!(get(&s.url("/"), &[]).await.status, StatusCode::OK);
    }
    assert_eq!(used().await, [3, 3, 3]);

    s.proxy.replace(parse(cfg(&[sliding, day, hour]))).unwrap();
    assert_eq!(get(&s.url("/"), &[]).await.status, StatusCode::OK);
    assert_eq!(used().await, [4, 4, 4], "reordered");

    s.proxy.replace(parse(cfg(&[hour, sliding]))).unwrap();
    assert_eq!(get(&s.url("/"), &[]).await.status, StatusCode::OK);
    assert_eq!(used().await, [5, 5], "the daily limit dropped");

    s.proxy.replace(parse(cfg(&[hour, day, sliding]))).unwrap();
    assert_eq!(get(&s.url("/"), &[]).await.status, StatusCode::OK);
    assert_eq!(
        used().await,
        [6, 5, 6],
        "the daily count was kept meanwhile"
    );
}
