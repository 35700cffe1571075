//! Rate limiting on the memory store, end to end: real upstream, real client,
//! sluice in-process with a clock the tests move (no sleeping).

mod support;

use http::{Request, StatusCode};
use sluice::clock::Clock;
use sluice::store::Store;
use support::*;

/// A clock just past the start of a `window_ms` window (aligned to the epoch),
/// so a test has the whole window before it rolls over.
fn clock_at_window_start(window_ms: u64) -> Clock {
    let clock = Clock::system();
    let now = clock.now_ms();
    clock.set_offset_ms((window_ms - now % window_ms) as i64 + 1);
    clock
}

async fn start(upstream: &Upstream, policies: &str, routes: &str, window_ms: u64) -> Sluice {
    let cfg = format!(
        r#"
[server]
trusted_proxies = ["127.0.0.1"]

[upstreams.api]
url = "{}"

[upstreams.dead]
url = "http://{}"

{policies}

{routes}
"#,
        upstream.url(),
        dead_port().await
    );
    Sluice::start_with_clock(&cfg, clock_at_window_start(window_ms)).await
}

fn from(ip: &str) -> (&'static str, String) {
    ("x-forwarded-for", ip.to_string())
}

async fn get_as(url: &str, headers: &[(&str, String)]) -> Reply {
    let h: Vec<(&str, &str)> = headers.iter().map(|(k, v)| (*k, v.as_str())).collect();
    get(url, &h).await
}

#[tokio::test]
async fn fixed_window_admits_limit_then_429_until_the_next_window() {
    let up = Upstream::start().await;
    let s = start(
        &up,
        "[policies.p]\nlimits = [{ limit = 3, window = \"10s\" }]",
        "[[routes]]\npath = \"/\"\nupstream = \"api\"\npolicy = \"p\"",
        10_000,
    )
    .await;
    let mut resets = Vec::new();
    for expected in [2, 1, 0] {
        let r = get(&s.url("/a"), &[]).await;
        assert_eq!(r.status, StatusCode::OK);
        assert_eq!(r.header_u64("x-ratelimit-limit"), 3);
        assert_eq!(r.header_u64("x-ratelimit-remaining"), expected);
        resets.push(r.header_u64("x-ratelimit-reset"));
    }
    // The reset never wobbles: the window's end, on a whole second.
    assert!(resets.windows(2).all(|w| w[0] == w[1]), "{resets:?}");
    let reset = resets[0];
    assert_eq!(
        reset * 1000 % 10_000,
        0,
        "window end is aligned to the epoch"
    );

    let denied = get(&s.url("/a"), &[]).await;
    assert_eq!(denied.status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(
        denied.header("content-type"),
        Some("application/problem+json")
    );
    assert_eq!(denied.json()["status"], 429);
    assert_eq!(denied.header_u64("x-ratelimit-remaining"), 0);
    assert_eq!(denied.header_u64("x-ratelimit-reset"), reset);
    let retry = denied.header_u64("retry-after");
    assert!((1..=10).contains(&retry), "retry-after {retry}");
    assert_eq!(
        up.hits(),
        3,
        "a rejected request never reaches the upstream"
    );

    // Retry-After is true: waiting that long is enough.
    s.clock.advance(std::time::Duration::from_secs(retry));
    let again = get(&s.url("/a"), &[]).await;
    assert_eq!(again.status, StatusCode::OK);
    assert_eq!(again.header_u64("x-ratelimit-remaining"), 2);
    assert!(again.header_u64("x-ratelimit-reset") > reset);
}

#[tokio::test]
async fn other_spellings_of_a_limited_path_meet_its_policy() {
    let up = Upstream::start().await;
    let s = start(
        &up,
        "[policies.strict]\nlimits = [{ limit = 1, window = \"10s\" }]",
        "[[routes]]\npath = \"/api/search\"\nupstream = \"api\"\npolicy = \"strict\"\n\n\
         [[routes]]\npath = \"/\"\nupstream = \"api\"",
        10_000,
    )
    .await;
    let first = get(&s.url("/api/%73earch"), &[]).await;
    assert_eq!(first.status, StatusCode::OK);
    // Matched in its normal form, and forwarded in it.
    assert_eq!(first.json()["uri"], "/api/search");
    for p in [
        "/api/search",
        "//api/search",
        "/x/../api/search",
        "/api/./search?q=1",
        "/api/%2e/search",
        "/api/search/../search/more",
    ] {
        let r = get(&s.url(p), &[]).await;
        assert_eq!(r.status, StatusCode::TOO_MANY_REQUESTS, "{p}");
    }
    // Paths outside the route still reach the unlimited one.
    for p in ["/api/searc", "/api/search/.."] {
        assert_eq!(get(&s.url(p), &[]).await.status, StatusCode::OK, "{p}");
    }
}

#[tokio::test]
async fn all_limits_must_pass_and_a_rejection_charges_nothing() {
    let up = Upstream::start().await;
    let s = start(
        &up,
        "[policies.p]\nlimits = [{ limit = 2, window = \"1s\" }, { limit = 3, window = \"1m\" }]",
        "[[routes]]\npath = \"/\"\nupstream = \"api\"\npolicy = \"p\"",
        60_000,
    )
    .await;
    assert_eq!(get(&s.url("/"), &[]).await.status, StatusCode::OK);
    let second = get(&s.url("/"), &[]).await;
    // Least remaining binds: the 1s limit with 0 left.
    assert_eq!(second.header_u64("x-ratelimit-limit"), 2);
    assert_eq!(second.header_u64("x-ratelimit-remaining"), 0);
    let denied = get(&s.url("/"), &[]).await;
    assert_eq!(denied.status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(
        denied.header_u64("x-ratelimit-limit"),
        2,
        "the limit that denied"
    );
    assert_eq!(denied.header_u64("retry-after"), 1);
    // Denied a few more times: none of it may count against the minute.
    for _ in 0..3 {
        assert_eq!(
            get(&s.url("/"), &[]).await.status,
            StatusCode::TOO_MANY_REQUESTS
        );
    }
    s.clock.advance(std::time::Duration::from_secs(1));
    let third = get(&s.url("/"), &[]).await;
    assert_eq!(third.status, StatusCode::OK);
    assert_eq!(third.header_u64("x-ratelimit-limit"), 3);
    assert_eq!(third.header_u64("x-ratelimit-remaining"), 0);
    s.clock.advance(std::time::Duration::from_secs(1));
    let denied = get(&s.url("/"), &[]).await;
    assert_eq!(denied.status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(denied.header_u64("x-ratelimit-limit"), 3);
    assert!(denied.header_u64("retry-after") > 1);
    assert_eq!(up.hits(), 3);
}

#[tokio::test]
async fn cost_weighs_a_request() {
    let up = Upstream::start().await;
    let s = start(
        &up,
        "[policies.p]\nlimits = [{ limit = 10, window = \"1m\" }]",
        "[[routes]]\npath = \"/search\"\nupstream = \"api\"\npolicy = \"p\"\ncost = 4\n\
         [[routes]]\npath = \"/\"\nupstream = \"api\"\npolicy = \"p\"",
        60_000,
    )
    .await;
    assert_eq!(
        get(&s.url("/search"), &[])
            .await
            .header_u64("x-ratelimit-remaining"),
        6
    );
    assert_eq!(
        get(&s.url("/search"), &[])
            .await
            .header_u64("x-ratelimit-remaining"),
        2
    );
    assert_eq!(
        get(&s.url("/search"), &[]).await.status,
        StatusCode::TOO_MANY_REQUESTS
    );
    // A cheaper request still fits in what is left.
    assert_eq!(
        get(&s.url("/cheap"), &[])
            .await
            .header_u64("x-ratelimit-remaining"),
        1
    );
}

#[tokio::test]
async fn identities_header_query_ip_and_global() {
    let up = Upstream::start().await;
    let s = start(
        &up,
        "[policies.user]\nkey = \"header:X-User\"\nlimits = [{ limit = 1, window = \"1m\" }]\n\
         [policies.apikey]\nkey = \"query:key\"\nlimits = [{ limit = 1, window = \"1m\" }]\n\
         [policies.everyone]\nkey = \"global\"\nlimits = [{ limit = 2, window = \"1m\" }]",
        "[[routes]]\npath = \"/user\"\nupstream = \"api\"\npolicy = \"user\"\n\
         [[routes]]\npath = \"/key\"\nupstream = \"api\"\npolicy = \"apikey\"\n\
         [[routes]]\npath = \"/global\"\nupstream = \"api\"\npolicy = \"everyone\"",
        60_000,
    )
    .await;
    let ok = StatusCode::OK;
    let limited = StatusCode::TOO_MANY_REQUESTS;
    // Header: each value has its own counter.
    let alice = ("x-user", "alice".to_string());
    assert_eq!(
        get_as(&s.url("/user"), std::slice::from_ref(&alice))
            .await
            .status,
        ok
    );
    assert_eq!(
        get_as(&s.url("/user"), std::slice::from_ref(&alice))
            .await
            .status,
        limited
    );
    assert_eq!(
        get_as(&s.url("/user"), &[("x-user", "bob".into())])
            .await
            .status,
        ok
    );
    // A second copy of the header, or a list, cannot buy a fresh alice:
    // every value is counted, and all must pass.
    for copies in [
        vec!["alice", "alice"],
        vec!["alice", "carol"],
        vec!["carol, alice"],
        vec!["dave", " alice ,dave"],
    ] {
        let mut req = Request::get(s.url("/user"));
        for v in &copies {
            req = req.header("x-user", *v);
        }
        let r = send(&client(), req.body(empty()).unwrap()).await;
        assert_eq!(r.status, limited, "{copies:?} still counts alice");
    }
    // More than 16 distinct values: refused, never asked of the store.
    let many: Vec<String> = (0..17).map(|i| format!("u{i}")).collect();
    let r = get_as(&s.url("/user"), &[("x-user", many.join(","))]).await;
    assert_eq!(r.status, StatusCode::BAD_REQUEST);
    // Nothing was charged to the others: carol and dave each pass once.
    for other in ["carol", "dave"] {
        let r = get_as(&s.url("/user"), &[("x-user", other.into())]).await;
        assert_eq!(r.status, ok, "{other}");
    }
    // Missing header: counted by client address, not by a header value equal to it.
    assert_eq!(
        get_as(&s.url("/user"), &[from("192.0.2.1")]).await.status,
        ok
    );
    assert_eq!(
        get_as(&s.url("/user"), &[from("192.0.2.1")]).await.status,
        limited
    );
    assert_eq!(
        get_as(
            &s.url("/user"),
            &[from("192.0.2.9"), ("x-user", "192.0.2.1".into())]
        )
        .await
        .status,
        ok
    );
    // Query parameter, percent-decoded.
    assert_eq!(get(&s.url("/key?key=k%31"), &[]).await.status, ok);
    assert_eq!(get(&s.url("/key?key=k1"), &[]).await.status, limited);
    assert_eq!(get(&s.url("/key?key=k2"), &[]).await.status, ok);
    // Global: one budget for every client.
    assert_eq!(
        get_as(&s.url("/global"), &[from("192.0.2.1")]).await.status,
        ok
    );
    assert_eq!(
        get_as(&s.url("/global"), &[from("192.0.2.2")]).await.status,
        ok
    );
    assert_eq!(
        get_as(&s.url("/global"), &[from("192.0.2.3")]).await.status,
        limited
    );
}

#[tokio::test]
async fn a_list_of_keys_counts_each_identity() {
    let up = Upstream::start().await;
    let s = start(
        &up,
        "[policies.p]\nkey = [\"ip\", \"header:X-User\"]\nlimits = [{ limit = 2, window = \"1m\" }]",
        "[[routes]]\npath = \"/\"\nupstream = \"api\"\npolicy = \"p\"",
        60_000,
    )
    .await;
    let req = |ip: &str, user: &str| vec![from(ip), ("x-user", user.to_string())];
    assert_eq!(
        get_as(&s.url("/"), &req("192.0.2.1", "alice")).await.status,
        StatusCode::OK
    );
    assert_eq!(
        get_as(&s.url("/"), &req("192.0.2.2", "alice")).await.status,
        StatusCode::OK
    );
    // alice is spent, whatever address she comes from...
    assert_eq!(
        get_as(&s.url("/"), &req("192.0.2.3", "alice")).await.status,
        StatusCode::TOO_MANY_REQUESTS
    );
    // ...and 192.0.2.1 has one left, whoever it claims to be.
    assert_eq!(
        get_as(&s.url("/"), &req("192.0.2.1", "bob")).await.status,
        StatusCode::OK
    );
    assert_eq!(
        get_as(&s.url("/"), &req("192.0.2.1", "carol")).await.status,
        StatusCode::TOO_MANY_REQUESTS
    );
    // With no X-User both keys fall back to the address: it counts once, not twice.
    let r = get_as(&s.url("/"), &[from("192.0.2.7")]).await;
    assert_eq!(r.header_u64("x-ratelimit-remaining"), 1);
}

/// A connection keeps its last counters for its next request (src/limiter.rs,
/// `KeyCache`): they must serve only the same identities under the same policy.
#[tokio::test]
async fn one_connection_asking_as_other_identities_or_after_a_reload() {
    let up = Upstream::start().await;
    let cfg = |limit: u64| {
        format!(
            "[server]\ntrusted_proxies = [\"127.0.0.1\"]\n[upstreams.api]\nurl = \"{}\"\n\
             [policies.p]\nkey = [\"ip\", \"header:X-User\"]\nlimits = [{{ limit = {limit}, window = \"1m\" }}]\n\
             [[routes]]\npath = \"/\"\nupstream = \"api\"\npolicy = \"p\"\n",
            up.url()
        )
    };
    let s = Sluice::start_with_clock(&cfg(1), clock_at_window_start(60_000)).await;
    // HTTP/2: every request below shares one connection. (HTTP/1.1 follows.)
    for (client, net) in [(h2_client(), "192.0.2"), (client(), "198.51.100")] {
        let ask = |ip: &str, user: &str| {
            let req = Request::get(s.url("/"))
                .header("x-forwarded-for", format!("{net}.{ip}"))
                .header("x-user", format!("{user}@{net}"))
                .body(empty())
                .unwrap();
            send(&client, req)
        };
        assert_eq!(ask("1", "alice").await.status, StatusCode::OK);
        // Same address, other user; other address, same user: both spent.
        assert_eq!(ask("1", "bob").await.status, StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(
            ask("2", "alice").await.status,
            StatusCode::TOO_MANY_REQUESTS
        );
        // Neither spent: a fresh budget, on the same connection.
        assert_eq!(ask("2", "bob").await.status, StatusCode::OK);
        assert_eq!(ask("2", "bob").await.status, StatusCode::TOO_MANY_REQUESTS);
    }
    // A reload that raises the limit: the same identity, on the same
    // connection, is now counted against the new limit.
    let h2 = h2_client();
    let ask = || {
        let req = Request::get(s.url("/"))
            .header("x-forwarded-for", "203.0.113.1")
            .header("x-user", "carol")
            .body(empty())
            .unwrap();
        send(&h2, req)
    };
    assert_eq!(ask().await.status, StatusCode::OK);
    assert_eq!(ask().await.status, StatusCode::TOO_MANY_REQUESTS);
    let raised = sluice::config::parse(&cfg(3), "test.toml", std::path::Path::new(".")).unwrap();
    s.proxy.replace(raised).unwrap();
    let r = ask().await;
    assert_eq!(r.status, StatusCode::OK);
    assert_eq!(r.header_u64("x-ratelimit-limit"), 3);
    assert_eq!(r.header_u64("x-ratelimit-remaining"), 1);
}

/// The same, for a policy keyed by address alone (the cache compares the
/// addresses themselves): clients behind one proxy connection each get their
/// own budget.
#[tokio::test]
async fn one_connection_asking_from_other_addresses() {
    let up = Upstream::start().await;
    let cfg = format!(
        "[server]\ntrusted_proxies = [\"127.0.0.1\"]\n[upstreams.api]\nurl = \"{}\"\n\
         [policies.p]\nlimits = [{{ limit = 1, window = \"1m\" }}]\n\
         [[routes]]\npath = \"/\"\nupstream = \"api\"\npolicy = \"p\"\n",
        up.url()
    );
    let s = Sluice::start_with_clock(&cfg, clock_at_window_start(60_000)).await;
    let (h1, h2) = (client(), h2_client());
    for (client, ip, want) in [
        (&h1, "192.0.2.1", StatusCode::OK),
        (&h1, "192.0.2.2", StatusCode::OK),
        (&h1, "192.0.2.2", StatusCode::TOO_MANY_REQUESTS),
        (&h1, "192.0.2.1", StatusCode::TOO_MANY_REQUESTS),
        (&h2, "2001:db8:0:1::1", StatusCode::OK),
        (&h2, "2001:db8:0:2::1", StatusCode::OK),
        (&h2, "2001:db8:0:2::1", StatusCode::TOO_MANY_REQUESTS),
        // Another address of the same /64 is the same client.
        (&h2, "2001:db8:0:1::ffff", StatusCode::TOO_MANY_REQUESTS),
        // An IPv4-mapped address is its IPv4 address.
        (&h1, "::ffff:192.0.2.1", StatusCode::TOO_MANY_REQUESTS),
    ] {
        let req = Request::get(s.url("/"))
            .header("x-forwarded-for", ip)
            .body(empty())
            .unwrap();
        assert_eq!(send(client, req).await.status, want, "as {ip}");
    }
}

#[tokio::test]
async fn spoofed_forwarded_for_from_an_untrusted_peer_changes_nothing() {
    let up = Upstream::start().await;
    let cfg = format!(
        "[upstreams.api]\nurl = \"{}\"\n[policies.p]\nlimits = [{{ limit = 2, window = \"1m\" }}]\n\
         [[routes]]\npath = \"/\"\nupstream = \"api\"\npolicy = \"p\"",
        up.url()
    );
    let s = Sluice::start_with_clock(&cfg, clock_at_window_start(60_000)).await;
    for (i, ip) in ["1.1.1.1", "2.2.2.2", "3.3.3.3"].iter().enumerate() {
        let r = get_as(&s.url("/"), &[from(ip)]).await;
        let want = if i < 2 {
            StatusCode::OK
        } else {
            StatusCode::TOO_MANY_REQUESTS
        };
        assert_eq!(r.status, want, "request {i} claiming {ip}");
    }
}

#[tokio::test]
async fn refund_statuses_and_sluice_errors_give_the_charge_back() {
    let up = Upstream::start().await;
    let s = start(
        &up,
        "[policies.p]\nlimits = [{ limit = 3, window = \"1m\" }]\n\
         [policies.after]\ncharge = \"after\"\nrefund = [304, 404]\nlimits = [{ limit = 3, window = \"1m\" }]",
        "[[routes]]\npath = \"/status\"\nupstream = \"api\"\npolicy = \"p\"\n\
         [[routes]]\npath = \"/dead\"\nupstream = \"dead\"\npolicy = \"p\"\n\
         [[routes]]\npath = \"/after\"\nupstream = \"api\"\npolicy = \"after\"",
        60_000,
    )
    .await;
    let remaining = |r: &Reply| r.header_u64("x-ratelimit-remaining");
    // reserve: the charge is taken up front, then given back for a 304...
    let r = get(&s.url("/status/304"), &[]).await;
    assert_eq!(r.status, StatusCode::NOT_MODIFIED);
    assert_eq!(remaining(&r), 2, "headers show the reservation");
    // ...so the next request sees it back.
    let r = get(&s.url("/status/200"), &[]).await;
    assert_eq!(remaining(&r), 2);
    // 502 from sluice itself: refunded too.
    let r = get(&s.url("/dead"), &[]).await;
    assert_eq!(r.status, StatusCode::BAD_GATEWAY);
    assert_eq!(
        remaining(&get(&s.url("/status/500"), &[]).await),
        1,
        "a 500 is charged"
    );

    // after: only checked first, charged once the status is known, never for a refund status.
    for _ in 0..5 {
        assert_eq!(
            get(&s.url("/after/status/404"), &[]).await.status,
            StatusCode::NOT_FOUND
        );
    }
    let r = get(&s.url("/after/status/200"), &[]).await;
    assert_eq!(remaining(&r), 2);
    get(&s.url("/after/x"), &[]).await;
    get(&s.url("/after/x"), &[]).await;
    assert_eq!(
        get(&s.url("/after/x"), &[]).await.status,
        StatusCode::TOO_MANY_REQUESTS
    );
}

#[tokio::test]
async fn shadow_mode_counts_but_never_rejects() {
    let up = Upstream::start().await;
    let s = start(
        &up,
        "[policies.p]\nmode = \"shadow\"\nlimits = [{ limit = 1, window = \"1m\" }]",
        "[[routes]]\npath = \"/\"\nupstream = \"api\"\npolicy = \"p\"",
        60_000,
    )
    .await;
    for _ in 0..3 {
        let r = get(&s.url("/"), &[]).await;
        assert_eq!(r.status, StatusCode::OK);
        assert_eq!(r.header_u64("x-ratelimit-remaining"), 0);
    }
    assert_eq!(up.hits(), 3);
    // A metric counts the would-be rejections.
    let sample = |outcome: &str| {
        format!("sluice_decisions_total{{policy=\"p\",plan=\"default\",outcome=\"{outcome}\"}}")
    };
    assert_eq!(s.metric(&sample("allowed")).await, 1.0);
    assert_eq!(s.metric(&sample("shadow_limited")).await, 2.0);
    assert_eq!(s.metric(&sample("limited")).await, 0.0);
    // The memory store's decisions are not timed (the Redis store's are).
    assert_eq!(s.metric("sluice_store_call_seconds_count").await, 0.0);
}

#[tokio::test]
async fn header_style_none_and_respond_routes() {
    let up = Upstream::start().await;
    let s = start(
        &up,
        "[headers]\nstyle = \"none\"\n[policies.p]\nlimits = [{ limit = 1, window = \"1m\" }]",
        "[[routes]]\npath = \"=/ping\"\nrespond = { status = 200, body = \"pong\" }\npolicy = \"p\"",
        60_000,
    )
    .await;
    let r = get(&s.url("/ping"), &[]).await;
    assert_eq!(&r.body[..], b"pong");
    assert!(r.header("x-ratelimit-limit").is_none());
    let denied = get(&s.url("/ping"), &[]).await;
    assert_eq!(denied.status, StatusCode::TOO_MANY_REQUESTS);
    assert!(
        denied.header("retry-after").is_some(),
        "Retry-After is sent whatever the style"
    );
}

#[tokio::test]
async fn the_proxys_rate_limit_fields_replace_the_upstreams() {
    let up = Upstream::start().await;
    let s = start(
        &up,
        "[headers]\nstyle = \"both\"\n[policies.p]\nlimits = [{ limit = 3, window = \"1m\" }]",
        "[[routes]]\npath = \"/\"\nupstream = \"api\"\npolicy = \"p\"",
        60_000,
    )
    .await;
    // HTTP/1.1 (sluice's own front writes the fields) and HTTP/2 (hyper's
    // way: they go in the header map), then a 429.
    let one = get(&s.url("/claims"), &[]).await;
    let req = Request::get(s.url("/claims")).body(empty()).unwrap();
    let two = send(&h2_client(), req).await;
    get(&s.url("/claims"), &[]).await;
    let denied = get(&s.url("/claims"), &[]).await;
    assert_eq!(denied.status, StatusCode::TOO_MANY_REQUESTS);
    for (r, remaining) in [(&one, "2"), (&two, "1"), (&denied, "0")] {
        assert_eq!(r.all("x-ratelimit-limit"), ["3"]);
        assert_eq!(r.all("x-ratelimit-remaining"), [remaining]);
        assert_eq!(r.all("x-ratelimit-reset").len(), 1);
        assert_ne!(r.all("x-ratelimit-reset"), ["1"]);
        assert_eq!(r.all("ratelimit-policy"), ["\"p-1m\";q=3;w=60"]);
        assert_eq!(r.all("ratelimit").len(), 1);
        assert!(r.all("ratelimit")[0].starts_with(&format!("\"p-1m\";r={remaining};t=")));
    }
    // The upstream's other fields pass.
    assert_eq!(one.header("x-ratelimit-scope"), Some("upstream"));
    assert_eq!(two.header("x-ratelimit-scope"), Some("upstream"));
    assert_eq!(&one.body[..], b"claims");
}

#[tokio::test]
async fn the_429_body_names_the_violated_policies_in_the_ietf_styles_only() {
    let up = Upstream::start().await;
    for style in ["x-ratelimit", "ietf", "both", "none"] {
        // Two limits refuse the second request, the third does not.
        let s = start(
            &up,
            &format!(
                "[headers]\nstyle = \"{style}\"\n[policies.p]\nlimits = [\n\
                 {{ limit = 1, window = \"1m\" }},\n\
                 {{ limit = 100, window = \"1d\" }},\n\
                 {{ limit = 1, window = \"1h\" }},\n]"
            ),
            "[[routes]]\npath = \"/\"\nupstream = \"api\"\npolicy = \"p\"",
            3_600_000,
        )
        .await;
        assert_eq!(get(&s.url("/"), &[]).await.status, StatusCode::OK);
        let denied = get(&s.url("/"), &[]).await;
        assert_eq!(denied.status, StatusCode::TOO_MANY_REQUESTS, "{style}");
        assert_eq!(
            denied.header("content-type"),
            Some("application/problem+json")
        );
        let retry = denied.header_u64("retry-after");
        let detail = format!("rate limit exceeded; retry in {retry} s");
        let expected = match style {
            "ietf" | "both" => serde_json::json!({
                "type": "https://iana.org/assignments/http-problem-types#quota-exceeded",
                "title": "Quota Exceeded",
                "status": 429,
                "detail": detail,
                "violated-policies": ["p-1m", "p-1h"],
            }),
            _ => serde_json::json!({
                "type": "about:blank",
                "title": "Too Many Requests",
                "status": 429,
                "detail": detail,
            }),
        };
        assert_eq!(denied.json(), expected, "{style}");
        if style != "x-ratelimit" && style != "none" {
            // -11: the effective window of a denial ends when Retry-After does.
            let ratelimit = denied.header("ratelimit").expect("RateLimit");
            assert!(
                ratelimit.ends_with(&format!(";r=0;t={retry}")),
                "{ratelimit}"
            );
        }
    }
}

#[tokio::test]
async fn a_denials_effective_window_never_outlasts_retry_after() {
    let up = Upstream::start().await;
    // gcra: the bucket is empty again in 10 s, the next request passes in 5.
    let s = start(
        &up,
        "[headers]\nstyle = \"ietf\"\n[policies.p]\n\
         limits = [{ limit = 2, window = \"10s\", algorithm = \"gcra\", burst = 2 }]",
        "[[routes]]\npath = \"/\"\nupstream = \"api\"\npolicy = \"p\"",
        10_000,
    )
    .await;
    for _ in 0..2 {
        assert_eq!(get(&s.url("/"), &[]).await.status, StatusCode::OK);
    }
    let denied = get(&s.url("/"), &[]).await;
    assert_eq!(denied.status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(denied.header_u64("retry-after"), 5);
    assert_eq!(denied.header("ratelimit"), Some("\"p-10s\";r=0;t=5"));
    s.clock.advance(std::time::Duration::from_secs(5));
    assert_eq!(get(&s.url("/"), &[]).await.status, StatusCode::OK);
}

#[tokio::test]
async fn memory_stays_bounded_under_a_flood_of_identities() {
    let up = Upstream::start().await;
    let s = start(
        &up,
        "[store]\nbackend = \"memory\"\nmax_keys = 50\n\
         [policies.p]\nkey = \"header:X-Key\"\nlimits = [{ limit = 5, window = \"1m\" }]",
        "[[routes]]\npath = \"=/ping\"\nrespond = { status = 200 }\npolicy = \"p\"",
        60_000,
    )
    .await;
    let c = client();
    for i in 0..500 {
        let long = format!("{i}-{}", "v".repeat(10_000));
        let req = Request::get(s.url("/ping"))
            .header("x-key", long)
            .body(empty())
            .unwrap();
        assert_eq!(send(&c, req).await.status, StatusCode::OK);
    }
    let Store::Memory(m) = s.proxy.limiter().store() else {
        panic!("the memory store was configured");
    };
    assert!(m.len() <= 50, "{} counters kept", m.len());
    assert!(!m.is_empty());
    // Idle identities are dropped once their window has passed.
    s.clock.advance(std::time::Duration::from_secs(61));
    m.sweep(s.clock.now_ms());
    assert!(m.is_empty());
}

/// `/usage` finds an identity as the proxy counts it: an IPv6 address by
/// its network (asked by any address of it, or by the range), an
/// IPv4-mapped address as IPv4, a header value by its bytes.
#[tokio::test]
async fn usage_names_identities_as_they_are_counted() {
    let up = Upstream::start().await;
    let cfg = format!(
        "[server]\ntrusted_proxies = [\"127.0.0.1\"]\n[upstreams.api]\nurl = \"{}\"\n\
         [policies.p]\nlimits = [{{ limit = 5, window = \"1h\" }}]\n\
         [policies.h]\nkey = \"header:X-Key\"\nlimits = [{{ limit = 5, window = \"1h\" }}]\n\
         [[routes]]\npath = \"/h\"\nupstream = \"api\"\npolicy = \"h\"\n\
         [[routes]]\npath = \"/\"\nupstream = \"api\"\npolicy = \"p\"\n",
        up.url()
    );
    let s = Sluice::start_with_clock(&cfg, clock_at_window_start(3_600_000)).await;
    for ip in ["2001:db8:1:2::1", "2001:db8:1:2::2", "192.0.2.1"] {
        assert_eq!(
            get_as(&s.url("/"), &[from(ip)]).await.status,
            StatusCode::OK
        );
    }
    let used = |value: &str| {
        let url = s.admin_url(&format!("/usage?policy=p&key=ip&value={value}"));
        async move { get(&url, &[]).await.json()["limits"][0]["used"].clone() }
    };
    assert_eq!(used("2001:db8:1:2::ffff").await, 2);
    assert_eq!(used("2001:db8:1:2::/64").await, 2);
    assert_eq!(used("2001:db8:1:3::1").await, 0);
    assert_eq!(used("::ffff:192.0.2.1").await, 1);
    // A value that is not UTF-8, asked as its escapes.
    let mut req = Request::get(s.url("/h"));
    req = req.header("x-key", http::HeaderValue::from_bytes(b"k\xff").unwrap());
    assert_eq!(
        send(&client(), req.body(empty()).unwrap()).await.status,
        StatusCode::OK
    );
    let url = s.admin_url("/usage?policy=h&key=header:X-Key&value=k%FF");
    assert_eq!(get(&url, &[]).await.json()["limits"][0]["used"], 1);
    let url = s.admin_url("/usage?policy=h&key=header:X-Key&value=k%FE");
    assert_eq!(get(&url, &[]).await.json()["limits"][0]["used"], 0);
}
