//! Many instances, one limit; and Redis Cluster: identities in different
//! slots, reservations given back, a master failover.

mod support;

use std::sync::Arc;
use std::time::{Duration, Instant};

use http::StatusCode;
use support::*;

fn config(store: &str, upstream: &Upstream, policy: &str) -> String {
    format!(
        r#"
[server]
trusted_proxies = ["127.0.0.1"]

[store]
backend = "redis"
{store}
timeout = "1s"
on_error = "deny"
deny_cache = false

[upstreams.api]
url = "{}"

{policy}

[[routes]]
path = "/"
upstream = "api"
policy = "p"
"#,
        upstream.url()
    )
}

/// Three sluice instances, 60 concurrent clients of one identity, 300
/// requests: exactly `limit` admitted, for a fixed window and a log.
async fn exact_across_instances(store: &str, read_count: impl Fn(&str) -> u64) {
    let up = Upstream::start().await;
    for algorithm in ["fixed", "log"] {
        let policy = format!(
            "[policies.p]\nlimits = [{{ limit = 100, window = \"1h\", algorithm = \"{algorithm}\" }}]"
        );
        let cfg = config(store, &up, &policy).replace(
            "deny_cache = false",
            &format!("deny_cache = false\nprefix = \"{algorithm}:\""),
        );
        let instances = Arc::new([
            Sluice::start(&cfg).await,
            Sluice::start(&cfg).await,
            Sluice::start(&cfg).await,
        ]);
        let mut tasks = Vec::new();
        for i in 0..60 {
            let instances = instances.clone();
            tasks.push(tokio::spawn(async move {
                let c = client();
                let mut admitted = 0;
                for j in 0..5 {
                    let s = &instances[(i + j) % 3];
                    let req = http::Request::get(s.url("/")).body(empty()).unwrap();
                    let r = send(&c, req).await;
                    match r.status {
                        StatusCode::OK => admitted += 1,
                        StatusCode::TOO_MANY_REQUESTS => {}
                        other => panic!("unexpected {other}"),
                    }
                }
                admitted
            }));
        }
        let mut admitted = 0;
        for t in tasks {
            admitted += t.await.unwrap();
        }
        assert_eq!(admitted, 100, "{algorithm}: admitted across instances");
        assert_eq!(read_count(algorithm), 100, "{algorithm}: counted in Redis");
    }
}

/// The units one counter holds in Redis, whatever its type.
fn units(conn: &mut impl redis::ConnectionLike, key: &str) -> u64 {
    let kind: String = redis::cmd("TYPE").arg(key).query(conn).unwrap();
    match kind.as_str() {
        "zset" => redis::cmd("ZCARD").arg(key).query(conn).unwrap(),
        // A packed string of records (see lua/acquire.lua); a fixed or
        // sliding record's second number is the units it counts.
        "string" => redis::cmd("EVAL")
            .arg(
                "local raw, off, n = redis.call('GET', KEYS[1]), 10, 0 \
                 while off + 9 <= #raw do \
                   local _, _, size = struct.unpack('>I4I4I2', raw, off) \
                   if size >= 16 then n = n + struct.unpack('>d', raw, off + 18) end \
                   off = off + 10 + size \
                 end return n",
            )
            .arg(1)
            .arg(key)
            .query(conn)
            .unwrap(),
        other => panic!("unexpected type {other}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_instances_one_exact_limit_on_one_redis() {
    let redis = RedisServer::start();
    let store = format!("url = \"{}\"", redis.url());
    exact_across_instances(&store, |prefix| {
        let mut c = redis.conn();
        let keys: Vec<String> = redis::cmd("KEYS")
            .arg(format!("{prefix}:*"))
            .query(&mut c)
            .unwrap();
        keys.iter().map(|k| units(&mut c, k)).sum()
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_instances_one_exact_limit_on_a_cluster() {
    let cluster = RedisCluster::start(3);
    let store = format!("cluster = [{}]", cluster.seeds_toml());
    exact_across_instances(&store, |prefix| {
        let mut c = cluster.conn();
        cluster
            .keys()
            .iter()
            .filter(|k| k.starts_with(prefix))
            .map(|k| units(&mut c, k))
            .sum()
    })
    .await;
}

#[tokio::test]
async fn global_and_per_client_limits_across_slots_without_overcharging() {
    let cluster = RedisCluster::start(3);
    let up = Upstream::start().await;
    // The global limit's counter and each client's live in different slots.
    let policy = "[policies.p]\nlimits = [\n\
        { limit = 100, window = \"1h\", key = \"global\" },\n\
        { limit = 2, window = \"1h\" },\n]";
    let s = Sluice::start(&config(
        &format!("cluster = [{}]", cluster.seeds_toml()),
        &up,
        policy,
    ))
    .await;
    fn from(ip: &str) -> Vec<(&'static str, &str)> {
        vec![("x-forwarded-for", ip)]
    }
    for ip in ["192.0.2.1", "192.0.2.2"] {
        for _ in 0..2 {
            assert_eq!(get(&s.url("/"), &from(ip)).await.status, StatusCode::OK);
        }
        for _ in 0..5 {
            // Rejected by the client's own limit, after the global one was reserved.
            assert_eq!(
                get(&s.url("/"), &from(ip)).await.status,
                StatusCode::TOO_MANY_REQUESTS
            );
        }
    }
    // The global counter holds exactly the 4 admitted requests.
    let global: Vec<String> = cluster
        .keys()
        .into_iter()
        .filter(|k| k.ends_with(":p"))
        .collect();
    let mut c = cluster.conn();
    let counts: Vec<u64> = global.iter().map(|k| units(&mut c, k)).collect();
    assert!(counts.contains(&4), "{global:?} {counts:?}");
    let r = get(&s.url("/"), &from("192.0.2.3")).await;
    assert_eq!(r.status, StatusCode::OK);
    let policy_header = r.header("x-ratelimit-remaining").unwrap();
    assert_eq!(policy_header, "1", "the client's own limit binds");
}

/// sluice on `cluster` (store timeout 300 ms, failing open), with one request
/// of a 1000-an-hour limit counted.
async fn counting_on(cluster: &RedisCluster, up: &Upstream) -> Sluice {
    let policy = "[policies.p]\nlimits = [{ limit = 1000, window = \"1h\" }]";
    let cfg = config(&format!("cluster = [{}]", cluster.seeds_toml()), up, policy)
        .replace("timeout = \"1s\"", "timeout = \"300ms\"")
        .replace("on_error = \"deny\"", "on_error = \"allow\"");
    let s = Sluice::start(&cfg).await;
    let r = get(&s.url("/"), &[]).await;
    assert_eq!(r.header_u64("x-ratelimit-remaining"), 999);
    s
}

/// Requests until one is counted again, each passing (failing open) and
/// quickly meanwhile; how long after `since` that was, or `None` if not
/// within `within`.
async fn limiting_resumes(s: &Sluice, since: Instant, within: Duration) -> Option<Duration> {
    while since.elapsed() < within {
        let started = Instant::now();
        let r = get(&s.url("/"), &[]).await;
        assert_eq!(r.status, StatusCode::OK);
        assert!(
            started.elapsed() < Duration::from_millis(1500),
            "{:?}",
            started.elapsed()
        );
        if let Some(remaining) = r.header("x-ratelimit-remaining") {
            let remaining: u64 = remaining.parse().unwrap();
            // The replica had the count: limiting continues where it was.
            assert!(remaining < 999, "{remaining}");
            return Some(since.elapsed());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    None
}

#[tokio::test]
async fn a_master_failover_interrupts_limiting_only_until_the_promotion() {
    let mut cluster = RedisCluster::start(3);
    let up = Upstream::start().await;
    let s = counting_on(&cluster, &up).await;
    let key = cluster.keys().into_iter().next().unwrap();
    cluster.kill_master_of(&key);
    // While the replica is promoted, requests pass (fail open), each quickly.
    let after = limiting_resumes(&s, Instant::now(), Duration::from_secs(15))
        .await
        .expect("limiting did not resume after the failover");
    eprintln!("limiting resumed {after:?} after the master was killed");
}

/// A master that hangs (SIGSTOP) but keeps its connections open: the cluster
/// promotes its replica, and sluice must find the new master rather than wait
/// on the hung one for ever.
#[tokio::test]
async fn a_hung_master_is_left_for_its_promoted_replica() {
    let cluster = RedisCluster::start(3);
    let up = Upstream::start().await;
    let s = counting_on(&cluster, &up).await;
    let key = cluster.keys().into_iter().next().unwrap();
    let hung = cluster.master_of(&key);
    cluster.nodes[hung].signal("-STOP");
    let resumed = limiting_resumes(&s, Instant::now(), Duration::from_secs(20)).await;
    cluster.nodes[hung].signal("-CONT");
    let after = resumed.expect("limiting did not resume after the hung master's replica took over");
    eprintln!("limiting resumed {after:?} after the master hung");
}
