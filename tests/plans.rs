//! Plans: limits per customer from the file and from the admin API, the
//! precedence between them, counts that carry over a switch, bad input to
//! `/plans`, and, on Redis (one server and a cluster), a change made on one
//! instance in force on another within a second, unbans included.

mod support;

use std::time::{Duration, Instant};

use http::{Method, Request, StatusCode};
use support::*;

const POLICY: &str = r#"
[policies.api]
key = "header:X-Api-Key"
limits = [ { limit = 2, window = "1h" } ]
plan_header = "X-Plan"

[policies.api.plans.gold]
limits = [ { limit = 5, window = "1h" } ]

[policies.api.plans.blocked]
limits = []

[policies.api.assign]
"key-file" = "gold"

[policies.plain]
limits = [ { limit = 100, window = "1h" } ]
"#;

fn config(upstream: &str, store: &str) -> String {
    format!(
        "[server]\ntrusted_proxies = [\"10.9.9.9\"]\n{store}\n[upstreams.api]\nurl = \"{upstream}\"\n{POLICY}\n\
         [[routes]]\npath = \"/plain\"\nupstream = \"api\"\npolicy = \"plain\"\n\
         [[routes]]\npath = \"/\"\nupstream = \"api\"\npolicy = \"api\"\n"
    )
}

/// A request as the API key `key`; its status and `x-ratelimit-limit`.
async fn ask(s: &Sluice, key: &str) -> (StatusCode, Option<String>) {
    let r = get(&s.url("/"), &[("x-api-key", key)]).await;
    (r.status, r.header("x-ratelimit-limit").map(str::to_string))
}

/// An admin call to `/plans` (`body` for PUT).
async fn admin(s: &Sluice, method: Method, query: &str, body: &str) -> Reply {
    let req = Request::builder()
        .method(method)
        .uri(s.admin_url(&format!("/plans?{query}")))
        .body(full(body.to_string()))
        .unwrap();
    send(&client(), req).await
}

fn full(text: String) -> BoxBody {
    use http_body_util::BodyExt;
    http_body_util::Full::new(bytes::Bytes::from(text))
        .map_err(|never| match never {})
        .boxed()
}

#[tokio::test]
async fn plans_from_the_file_and_the_admin_api() {
    let up = Upstream::start().await;
    let s = Sluice::start_with_clock(&config(&up.url(), ""), clock_mid_hour()).await;
    let ok = StatusCode::OK;
    let limited = StatusCode::TOO_MANY_REQUESTS;

    // The default plan: 2 an hour.
    assert_eq!(ask(&s, "k1").await, (ok, Some("2".into())));
    assert_eq!(ask(&s, "k1").await.0, ok);
    assert_eq!(ask(&s, "k1").await.0, limited);
    // The file's assignment: gold, 5.
    for _ in 0..5 {
        assert_eq!(ask(&s, "key-file").await, (ok, Some("5".into())));
    }
    assert_eq!(ask(&s, "key-file").await.0, limited);

    // Moved to gold at run time: its count carries over (2 used of 5).
    let put = admin(
        &s,
        Method::PUT,
        "policy=api&value=k1",
        r#"{"plan": "gold"}"#,
    )
    .await;
    assert_eq!(put.status, ok, "{:?}", put.body);
    assert_eq!(put.json()["plan"], "gold");
    for _ in 0..3 {
        assert_eq!(ask(&s, "k1").await, (ok, Some("5".into())));
    }
    assert_eq!(ask(&s, "k1").await.0, limited);
    // Back to the default: the count stays, so it is still refused; no
    // switch back and forth buys a fresh budget.
    let del = admin(&s, Method::DELETE, "policy=api&value=k1", "").await;
    assert_eq!(del.json()["plan"], "default");
    assert_eq!(ask(&s, "k1").await.0, limited);

    // A run-time assignment wins over the file's: key-file blocked.
    let put = admin(
        &s,
        Method::PUT,
        "policy=api&value=key-file",
        r#"{"plan": "blocked"}"#,
    )
    .await;
    assert_eq!(put.status, ok);
    let r = get(&s.url("/"), &[("x-api-key", "key-file")]).await;
    assert_eq!(r.status, limited);
    assert_eq!(r.header("retry-after"), Some("3600"));
    let got = admin(&s, Method::GET, "policy=api&value=key-file", "")
        .await
        .json();
    assert_eq!(
        (got["plan"].as_str(), got["source"].as_str()),
        (Some("blocked"), Some("run-time"))
    );
    let all = admin(&s, Method::GET, "policy=api", "").await.json();
    assert_eq!(
        all["plans"],
        serde_json::json!(["default", "blocked", "gold"])
    );
    assert_eq!(
        all["assignments"].as_array().map(Vec::len),
        Some(1),
        "{all}"
    );

    // /usage names the plan in force.
    let usage = get(
        &s.admin_url("/usage?policy=api&key=header:X-Api-Key&value=key-file"),
        &[],
    )
    .await;
    assert_eq!(usage.json()["plan"], "blocked");

    // Values on different plans: refused, whichever a backend would read.
    let r = get(&s.url("/"), &[("x-api-key", "key-file, k9")]).await;
    assert_eq!(r.status, StatusCode::BAD_REQUEST);

    // plan_header counts only from a trusted proxy.
    let named = [("x-api-key", "k7"), ("x-plan", "gold")];
    let r = get(&s.url("/"), &named).await;
    assert_eq!(
        r.header("x-ratelimit-limit"),
        Some("2"),
        "from an untrusted peer"
    );
}

#[tokio::test]
async fn bad_input_to_plans_changes_nothing() {
    let up = Upstream::start().await;
    let s = Sluice::start(&config(&up.url(), "")).await;
    let bad = StatusCode::BAD_REQUEST;
    let huge = "v".repeat(5000);
    let cases: Vec<(Method, String, String, StatusCode)> = vec![
        (
            Method::PUT,
            "policy=nope&value=k".into(),
            r#"{"plan":"gold"}"#.into(),
            StatusCode::NOT_FOUND,
        ),
        (
            Method::PUT,
            "policy=plain&value=k".into(),
            r#"{"plan":"gold"}"#.into(),
            bad,
        ),
        (
            Method::PUT,
            "policy=api&value=k".into(),
            r#"{"plan":"platinum"}"#.into(),
            bad,
        ),
        (
            Method::PUT,
            "policy=api&value=k".into(),
            r#"{"plan":"#.into(),
            bad,
        ),
        (
            Method::PUT,
            "policy=api&value=k".into(),
            r#"{"plan":"gold","x":1}"#.into(),
            bad,
        ),
        (
            Method::PUT,
            "policy=api&value=k".into(),
            r#"{"plan":7}"#.into(),
            bad,
        ),
        (
            Method::PUT,
            "policy=api&value=k".into(),
            "x".repeat(70_000),
            bad,
        ),
        (
            Method::PUT,
            format!("policy=api&value={huge}"),
            r#"{"plan":"gold"}"#.into(),
            bad,
        ),
        (
            Method::PUT,
            "policy=api".into(),
            r#"{"plan":"gold"}"#.into(),
            bad,
        ),
        (
            Method::PUT,
            "value=k".into(),
            r#"{"plan":"gold"}"#.into(),
            bad,
        ),
        (
            Method::POST,
            "policy=api&value=k".into(),
            r#"{"plan":"gold"}"#.into(),
            StatusCode::METHOD_NOT_ALLOWED,
        ),
    ];
    for (method, query, body, want) in cases {
        let r = admin(&s, method.clone(), &query, &body).await;
        assert_eq!(r.status, want, "{method} {}", &query[..query.len().min(40)]);
        assert!(r.json()["detail"].is_string());
    }
    let all = admin(&s, Method::GET, "policy=api", "").await.json();
    assert_eq!(
        all["assignments"].as_array().map(Vec::len),
        Some(1),
        "only the file's: {all}"
    );
}

#[tokio::test]
async fn a_trusted_proxy_names_the_plan() {
    let up = Upstream::start().await;
    let cfg = config(&up.url(), "").replace("10.9.9.9", "127.0.0.1");
    let s = Sluice::start(&cfg).await;
    let r = get(&s.url("/"), &[("x-api-key", "k7"), ("x-plan", "gold")]).await;
    assert_eq!(r.header("x-ratelimit-limit"), Some("5"));
    // An unknown name means the default; the file's assignment wins over it.
    let r = get(&s.url("/"), &[("x-api-key", "k7"), ("x-plan", "diamond")]).await;
    assert_eq!(r.header("x-ratelimit-limit"), Some("2"));
    let r = get(
        &s.url("/"),
        &[("x-api-key", "key-file"), ("x-plan", "blocked")],
    )
    .await;
    assert_eq!(r.header("x-ratelimit-limit"), Some("5"));
}

/// A clock half-way through the hour: no window ends during a test.
fn clock_mid_hour() -> sluice::clock::Clock {
    let clock = sluice::clock::Clock::system();
    let now = clock.now_ms() as i64;
    let hour = 3_600_000;
    clock.set_offset_ms(now / hour * hour + hour / 2 - now);
    clock
}

on_both!(a_plan_change_reaches_every_instance, plan_change_on);

async fn plan_change_on(redis: TestRedis) {
    let up = Upstream::start().await;
    let store = format!(
        "[store]\nbackend = \"redis\"\n{}\ntimeout = \"500ms\"\nclock = \"local\"\nprefix = \"p:\"\n",
        redis.store_toml()
    );
    let clock = clock_mid_hour();
    let a = Sluice::start_with_clock(&config(&up.url(), &store), clock.clone()).await;
    let b = Sluice::start_with_clock(&config(&up.url(), &store), clock.clone()).await;
    // k1 spends its default 2 on B, whose deny cache then holds the denial.
    assert_eq!(ask(&b, "k1").await.0, StatusCode::OK);
    assert_eq!(ask(&b, "k1").await.0, StatusCode::OK);
    assert_eq!(ask(&b, "k1").await.0, StatusCode::TOO_MANY_REQUESTS);
    // Steady state: one EVALSHA per decision, however plans are kept.
    redis.reset_stats();
    for _ in 0..2 {
        assert_eq!(ask(&b, "k-other").await.0, StatusCode::OK);
    }
    assert_eq!(redis.evalsha_calls(), 2);

    // Gold on A: in force on B within a second.
    let put = admin(
        &a,
        Method::PUT,
        "policy=api&value=k1",
        r#"{"plan": "gold"}"#,
    )
    .await;
    assert_eq!(put.status, StatusCode::OK, "{:?}", put.body);
    let changed = Instant::now();
    let mut seen = None;
    while changed.elapsed() < Duration::from_secs(3) {
        if ask(&b, "k1").await.0 == StatusCode::OK {
            seen = Some(changed.elapsed());
            break;
        }
    }
    let seen = seen.expect("B never saw the new plan");
    eprintln!("the other instance saw the new plan after {seen:?}");
    assert!(seen < Duration::from_secs(1), "B saw it after {seen:?}");

    // An unban on A reaches B's deny cache too.
    for _ in 0..5 {
        ask(&b, "k1").await;
    }
    assert_eq!(ask(&b, "k1").await.0, StatusCode::TOO_MANY_REQUESTS);
    let del = Request::delete(a.admin_url("/usage?policy=api&key=header:X-Api-Key&value=k1"))
        .body(empty())
        .unwrap();
    assert_eq!(send(&client(), del).await.status, StatusCode::OK);
    let lifted = Instant::now();
    wait_until_async(|| async { ask(&b, "k1").await.0 == StatusCode::OK }).await;
    eprintln!(
        "the other instance served the unbanned client after {:?}",
        lifted.elapsed()
    );
    assert!(
        lifted.elapsed() < Duration::from_secs(1),
        "after {:?}",
        lifted.elapsed()
    );

    // A new instance finds the assignment at start: it is kept in Redis.
    let c = Sluice::start_with_clock(&config(&up.url(), &store), clock).await;
    wait_until_async(|| async { ask(&c, "k1").await.1.as_deref() == Some("5") }).await;
}
