//! Hostile identity values: braces, colons, control bytes, invalid UTF-8 and
//! 64 KiB values never fail a store call, never touch another client's
//! counters, never bypass a limit, and never grow a key.

#[macro_use]
mod support;

use http::{HeaderValue, Request, StatusCode};
use support::*;

async fn start(redis: &TestRedis, up: &Upstream) -> Sluice {
    let cfg = format!(
        r#"
[server]
trusted_proxies = ["127.0.0.1"]
# Room for the 64 KiB value (the default is 32 KiB).
max_header_bytes = 131072

[store]
backend = "redis"
{}
on_error = "deny"
deny_cache = false
# Not the default 100ms: with "deny", a call slowed by a busy test machine
# (a debug build hashing a 64 KiB value, a cluster's first connection) is a 503.
timeout = "2s"

[upstreams.api]
url = "{}"

[policies.h]
key = "header:X-Key"
limits = [{{ limit = 2, window = "1h" }}]

[policies.q]
key = "query:key"
limits = [{{ limit = 2, window = "1h" }}]

[[routes]]
path = "/h"
upstream = "api"
policy = "h"

[[routes]]
path = "/q"
upstream = "api"
policy = "q"
"#,
        redis.store_toml(),
        up.url()
    );
    Sluice::start(&cfg).await
}

async fn with_header(s: &Sluice, value: HeaderValue) -> StatusCode {
    let req = Request::get(s.url("/h"))
        .header("x-key", value)
        .body(empty())
        .unwrap();
    send(&client(), req).await.status
}

fn hostile_header_values() -> Vec<HeaderValue> {
    let mut values: Vec<HeaderValue> = [
        "{victim}",
        "}{",
        "{",
        "a:b:c",
        "sluice:{x}:p:1h:fixed",
        "*",
        "\t x \t",
    ]
    .iter()
    .map(|v| HeaderValue::from_str(v).unwrap())
    .collect();
    values.push(HeaderValue::from_bytes(b"\xff\xfe\x80 not utf-8").unwrap());
    values.push(HeaderValue::from_str(&"k".repeat(64 * 1024)).unwrap());
    values
}

on_both!(
    hostile_header_values_are_counted_like_any_other,
    hostile_header_values_are_counted_like_any_other_on
);

async fn hostile_header_values_are_counted_like_any_other_on(redis: TestRedis) {
    let up = Upstream::start().await;
    let s = start(&redis, &up).await;
    // A victim identity with one unit spent.
    assert_eq!(
        with_header(&s, HeaderValue::from_static("victim")).await,
        StatusCode::OK
    );
    for value in hostile_header_values() {
        // Each works (on_error = "deny" would make a failed store call a 503)...
        assert_eq!(with_header(&s, value.clone()).await, StatusCode::OK);
        assert_eq!(with_header(&s, value.clone()).await, StatusCode::OK);
        // ...and is limited like any other value.
        assert_eq!(with_header(&s, value).await, StatusCode::TOO_MANY_REQUESTS);
    }
    // The victim still has exactly one unit left.
    assert_eq!(
        with_header(&s, HeaderValue::from_static("victim")).await,
        StatusCode::OK
    );
    assert_eq!(
        with_header(&s, HeaderValue::from_static("victim")).await,
        StatusCode::TOO_MANY_REQUESTS
    );
    // Every key has the same shape and size, whatever the value was.
    let keys: Vec<String> = redis.keys();
    assert_eq!(keys.len(), hostile_header_values().len() + 1, "{keys:?}");
    let lengths: std::collections::HashSet<usize> = keys.iter().map(|k| k.len()).collect();
    assert_eq!(lengths.len(), 1, "{keys:?}");
    let used: u64 = redis.query(redis::cmd("MEMORY").arg("USAGE").arg(&keys[0]));
    assert!(used < 300, "{used} bytes for one counter");
}

on_both!(
    hostile_query_values_are_counted_like_any_other,
    hostile_query_values_are_counted_like_any_other_on
);

async fn hostile_query_values_are_counted_like_any_other_on(redis: TestRedis) {
    let up = Upstream::start().await;
    let s = start(&redis, &up).await;
    let long = "q".repeat(30_000);
    for query in [
        "key=%7Bx%7D",
        "key=%00%00",
        "key=a%0Ab",
        "key=%FF%FE",
        "key=a%3Ab%3Ac",
        &format!("key={long}"),
    ] {
        let url = s.url(&format!("/q?{query}"));
        assert_eq!(get(&url, &[]).await.status, StatusCode::OK, "{query}");
        assert_eq!(get(&url, &[]).await.status, StatusCode::OK, "{query}");
        assert_eq!(
            get(&url, &[]).await.status,
            StatusCode::TOO_MANY_REQUESTS,
            "{query}"
        );
    }
    // Percent-encoding another spelling of a spent value buys nothing.
    assert_eq!(
        get(&s.url("/q?key=%7b%78%7d"), &[]).await.status,
        StatusCode::TOO_MANY_REQUESTS
    );
}

on_both!(
    a_header_value_equal_to_an_address_does_not_touch_that_address,
    a_header_value_equal_to_an_address_does_not_touch_that_address_on
);

async fn a_header_value_equal_to_an_address_does_not_touch_that_address_on(redis: TestRedis) {
    let up = Upstream::start().await;
    let s = start(&redis, &up).await;
    let from = |ip: &str| ("x-forwarded-for", ip.to_string());
    let victim = "192.0.2.77";
    // The attacker spends "its" X-Key = the victim's address.
    for _ in 0..2 {
        let r = get(&s.url("/h"), &[("x-key", victim)]).await;
        assert_eq!(r.status, StatusCode::OK);
    }
    // The victim (no X-Key: counted by address) is untouched.
    let h = [from(victim)];
    let h: Vec<(&str, &str)> = h.iter().map(|(k, v)| (*k, v.as_str())).collect();
    assert_eq!(get(&s.url("/h"), &h).await.status, StatusCode::OK);
    assert_eq!(get(&s.url("/h"), &h).await.status, StatusCode::OK);
    assert_eq!(
        get(&s.url("/h"), &h).await.status,
        StatusCode::TOO_MANY_REQUESTS
    );
}

#[tokio::test]
async fn redis_with_a_password_and_an_acl_user() {
    let redis = RedisServer::start();
    let mut c = redis.conn();
    let _: () = redis::cmd("ACL")
        .arg("SETUSER")
        .arg("sluice")
        .arg("on")
        .arg(">s3cret")
        .arg("~*")
        .arg("+@all")
        .query(&mut c)
        .unwrap();
    let _: () = redis::cmd("CONFIG")
        .arg("SET")
        .arg("requirepass")
        .arg("topsecret")
        .query(&mut c)
        .unwrap();
    let up = Upstream::start().await;
    for url in [
        format!("redis://sluice:s3cret@127.0.0.1:{}/0", redis.port),
        format!("redis://:topsecret@127.0.0.1:{}/0", redis.port),
    ] {
        let cfg = format!(
            "[store]\nbackend = \"redis\"\nurl = \"{url}\"\non_error = \"deny\"\n\
             [upstreams.api]\nurl = \"{}\"\n[policies.p]\nlimits = [{{ limit = 5, window = \"1h\" }}]\n\
             [[routes]]\npath = \"/\"\nupstream = \"api\"\npolicy = \"p\"\n",
            up.url()
        );
        let s = Sluice::start(&cfg).await;
        let r = get(&s.url("/"), &[]).await;
        assert_eq!(r.status, StatusCode::OK, "{url}");
        assert!(r.header("x-ratelimit-remaining").is_some());
    }
    // A wrong password is a store error, not a hang or a pass-through.
    let cfg = format!(
        "[store]\nbackend = \"redis\"\nurl = \"redis://:wrong@127.0.0.1:{}/0\"\non_error = \"deny\"\n\
         [upstreams.api]\nurl = \"{}\"\n[policies.p]\nlimits = [{{ limit = 5, window = \"1h\" }}]\n\
         [[routes]]\npath = \"/\"\nupstream = \"api\"\npolicy = \"p\"\n",
        redis.port,
        up.url()
    );
    let s = Sluice::start(&cfg).await;
    assert_eq!(
        get(&s.url("/"), &[]).await.status,
        StatusCode::SERVICE_UNAVAILABLE
    );
}

#[tokio::test]
async fn redis_over_tls_with_a_private_ca() {
    let dir = std::env::temp_dir().join(format!("sluice-tls-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let cert =
        rcgen::generate_simple_self_signed(vec!["127.0.0.1".to_string(), "localhost".to_string()])
            .unwrap();
    let (cert_pem, key_pem) = (dir.join("redis.crt"), dir.join("redis.key"));
    std::fs::write(&cert_pem, cert.cert.pem()).unwrap();
    std::fs::write(&key_pem, cert.signing_key.serialize_pem()).unwrap();
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let mut server = std::process::Command::new("redis-server")
        .args([
            "--port",
            "0",
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
        ])
        .args(["--tls-port", &port.to_string(), "--tls-auth-clients", "no"])
        .arg("--tls-cert-file")
        .arg(&cert_pem)
        .arg("--tls-key-file")
        .arg(&key_pem)
        .arg("--tls-ca-cert-file")
        .arg(&cert_pem)
        .stdout(std::process::Stdio::null())
        .spawn()
        .unwrap();
    wait_until(|| std::net::TcpStream::connect(("127.0.0.1", port)).is_ok()).await;
    let up = Upstream::start().await;
    let cfg = |ca: &str| {
        format!(
            "[store]\nbackend = \"redis\"\nurl = \"rediss://127.0.0.1:{port}/0\"\ntimeout = \"1s\"\non_error = \"deny\"\n{ca}\n\
             [upstreams.api]\nurl = \"{}\"\n[policies.p]\nlimits = [{{ limit = 2, window = \"1h\" }}]\n\
             [[routes]]\npath = \"/\"\nupstream = \"api\"\npolicy = \"p\"\n",
            up.url()
        )
    };
    // Trusting the private CA: limits work over TLS.
    let s = Sluice::start(&cfg(&format!("ca = \"{}\"", cert_pem.display()))).await;
    assert_eq!(get(&s.url("/"), &[]).await.status, StatusCode::OK);
    assert_eq!(get(&s.url("/"), &[]).await.status, StatusCode::OK);
    assert_eq!(
        get(&s.url("/"), &[]).await.status,
        StatusCode::TOO_MANY_REQUESTS
    );
    // With only the system roots, the unknown certificate is refused.
    let s = Sluice::start(&cfg("")).await;
    assert_eq!(
        get(&s.url("/"), &[]).await.status,
        StatusCode::SERVICE_UNAVAILABLE
    );
    let _ = server.kill();
    let _ = server.wait();
    let _ = std::fs::remove_dir_all(&dir);
}
