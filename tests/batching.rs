//! Decisions batched on the Redis connection: decisions that queue for it
//! together go to Redis as one call (lua/batch.lua), and each is answered,
//! and leaves Redis, exactly as it would have on its own; a lone decision
//! goes at once, as acquire.lua's own call. A real redis-server each.

mod support;

use std::future::Future;
use std::time::Duration;

use futures_util::future::maybe_done;
use http::StatusCode;
use sluice::clock::Clock;
use sluice::config::Algorithm;
use sluice::store::redis::RedisStore;
use sluice::store::{Counter, Memo, Outcome};
use support::{RedisCluster, RedisServer, Sluice, Upstream, get, store_at};

/// xorshift64*: reproducible sequences.
struct Rng(u64);

impl Rng {
    fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d) % n
    }
}

fn store(redis: &RedisServer, prefix: &str) -> RedisStore {
    store_at(Some(redis.url()), Vec::new(), prefix)
}

fn counter(id: &str, limit: u64, window_ms: u64, algorithm: Algorithm) -> Counter {
    Counter {
        key: format!("{{{id}}}:p:{}:{window_ms}", algorithm.name())
            .as_bytes()
            .into(),
        group_len: id.len() + 4,
        limit,
        window_ms,
        algorithm,
        calendar: None,
    }
}

/// A `gcra` limit.
fn gcra(burst: u64, delay_ms: u64) -> Algorithm {
    Algorithm::Gcra {
        burst,
        delay: Duration::from_millis(delay_ms),
    }
}

/// One identity's counters: every algorithm, in one packed string but the
/// log and the concurrency slots (a sorted set each).
fn counters(id: &str) -> Vec<Counter> {
    vec![
        counter(id, 9, 1_000, Algorithm::Fixed),
        counter(
            id,
            20,
            10_000,
            Algorithm::Sliding {
                precision: Duration::from_secs(1),
            },
        ),
        counter(id, 6, 1_000, gcra(3, 0)),
        counter(id, 5, 2_000, gcra(2, 700)),
        counter(id, 12, 3_000, Algorithm::Log),
        counter(
            id,
            4,
            2_000,
            Algorithm::Concurrency {
                lease: Duration::from_secs(2),
            },
        ),
    ]
}

/// Whether a counter's marks are its call's nonce (which differs from store
/// to store), not a bucket.
fn nonce_marked(c: &Counter) -> bool {
    matches!(c.algorithm, Algorithm::Log | Algorithm::Concurrency { .. })
}

/// Runs `calls` as concurrent requests do: each is polled once, in order (so
/// each queues its command on the connection, in that order, before any is
/// written), then all are awaited.
async fn together<F: Future>(calls: Vec<F>) -> Vec<F::Output> {
    let mut calls: Vec<_> = calls.into_iter().map(|f| Box::pin(maybe_done(f))).collect();
    for call in &mut calls {
        let _ = futures_util::poll!(call.as_mut());
    }
    let mut out = Vec::new();
    for mut call in calls {
        call.as_mut().await;
        out.push(call.as_mut().take_output().expect("awaited"));
    }
    out
}

/// A charged decision that may be refunded: its counters, both stores'
/// marks, its cost.
type Ticket = (Vec<Counter>, Vec<u64>, Vec<u64>, u64);

/// A decision of the sequence: which identities, cost, charge, and the
/// proxy's clock.
struct Decision {
    who: Vec<usize>,
    triple: bool,
    cost: u64,
    charge: bool,
    now: u64,
}

impl Decision {
    fn counters(&self, ids: &[&str]) -> Vec<Counter> {
        let mut out: Vec<Counter> = self.who.iter().flat_map(|&w| counters(ids[w])).collect();
        // Another plan's limits on the same counters (a set of its own).
        if self.triple {
            out.iter_mut().for_each(|c| c.limit *= 3);
        }
        out
    }
}

#[tokio::test]
async fn decisions_sent_together_answer_and_write_as_one_by_one() {
    let redis = RedisServer::start();
    // The same sequence on two stores: batched (each group of decisions
    // sent together) and one by one (each awaited before the next).
    let batched = store(&redis, "b:");
    let single = store(&redis, "s:");
    batched.preload().await;
    single.preload().await;
    // (Renewals' script too, so that every call below is an EVALSHA.)
    let _: String = redis::cmd("SCRIPT")
        .arg("LOAD")
        .arg(include_str!("../lua/lease.lua"))
        .query(&mut redis.conn())
        .unwrap();
    let ids = ["a", "b", "c", "d", "e"];
    let memos: [[Memo; 5]; 2] = Default::default();
    let mut rng = Rng(0x5eed_ba7c);
    let mut now = 1_800_000_000_123u64;
    let (mut decisions, mut groups, mut settlements, mut denied) = (0u64, 0u64, 0u64, 0u64);
    let mut tickets: Vec<Ticket> = Vec::new();
    let mut slowest = 0;
    redis.reset_stats();
    for group in 0..150 {
        now += rng.below(900);
        // Settlements, one at a time (they are not batched): all or part
        // given back, or more charged, slots freed; or slots renewed.
        for _ in 0..rng.below(4) {
            if tickets.is_empty() {
                break;
            }
            let (counters, b, s, cost) =
                tickets.swap_remove(rng.below(tickets.len() as u64) as usize);
            match rng.below(3) {
                0 => {
                    let back = rng.below(cost + 1);
                    batched.refund(&counters, &b, back, now).await.unwrap();
                    single.refund(&counters, &s, back, now).await.unwrap();
                }
                1 => {
                    let extra = 1 + rng.below(6);
                    batched
                        .charge_more(&counters, &b, extra, now)
                        .await
                        .unwrap();
                    single.charge_more(&counters, &s, extra, now).await.unwrap();
                }
                _ => {
                    let renewed = batched.renew(&counters, &b, now).await.unwrap();
                    assert_eq!(renewed, single.renew(&counters, &s, now).await.unwrap());
                    tickets.push((counters, b, s, cost));
                }
            }
            settlements += 1;
        }
        // Mostly a few, sometimes more than one batch holds.
        let size = if group == 75 { 300 } else { 1 + rng.below(40) };
        let group: Vec<Decision> = (0..size)
            .map(|_| {
                now += rng.below(20);
                let mut who = vec![rng.below(5) as usize];
                if rng.below(4) == 0 {
                    let other = rng.below(5) as usize;
                    if other != who[0] {
                        who.push(other);
                    }
                }
                Decision {
                    who,
                    triple: rng.below(5) == 0,
                    cost: 1 + rng.below(3),
                    charge: rng.below(6) != 0,
                    now,
                }
            })
            .collect();
        let sets: Vec<Vec<Counter>> = group.iter().map(|d| d.counters(&ids)).collect();
        // One identity's own counters go with its memo, as a connection's do.
        let memo = |d: &Decision, store: usize| {
            (d.who.len() == 1 && !d.triple).then(|| &memos[store][d.who[0]])
        };
        let began = redis_ms(&redis);
        let mut answers: Vec<Outcome> = together(
            group
                .iter()
                .zip(&sets)
                .map(|(d, c)| batched.acquire(c, memo(d, 0), d.cost, u8::from(d.charge), d.now))
                .collect(),
        )
        .await
        .into_iter()
        .map(Result::unwrap)
        .collect();
        for ((d, c), b) in group.iter().zip(&sets).zip(answers.drain(..)) {
            let s = single
                .acquire(c, memo(d, 1), d.cost, u8::from(d.charge), d.now)
                .await
                .unwrap();
            assert_eq!(
                (b.allowed, b.now_ms, &b.states),
                (s.allowed, s.now_ms, &s.states),
                "decision {decisions}"
            );
            for (i, c) in c.iter().enumerate() {
                if !nonce_marked(c) {
                    assert_eq!(b.marks[i], s.marks[i], "decision {decisions}");
                }
            }
            if b.allowed && d.charge {
                tickets.push((c.clone(), b.marks.to_vec(), s.marks.to_vec(), d.cost));
            }
            denied += u64::from(!b.allowed);
            decisions += 1;
        }
        groups += 1;
        // A key's expiry is set relative to when a call ran: the twins'
        // differ by as long as a group took at most (in whole ms).
        slowest = slowest.max(redis_ms(&redis) - began + 2);
        same_in_redis(&redis, &format!("decision {decisions}"), slowest);
    }
    // Both answers were met often, and the groups were mostly batches.
    assert!(
        denied > 200 && decisions - denied > 200,
        "{denied} of {decisions} refused"
    );
    assert!(decisions > 8 * groups, "{decisions} decisions");
    // One call per group (the group of 300 is three: at most 128 a batch),
    // one per decision one by one, one per settlement for each store.
    assert_eq!(redis.calls("eval"), 0);
    assert_eq!(
        redis.calls("evalsha"),
        (groups + 2) + decisions + 2 * settlements
    );
    let keys: Vec<String> = redis::cmd("KEYS")
        .arg("b:*")
        .query(&mut redis.conn())
        .unwrap();
    assert_eq!(keys.len(), 15, "{keys:?}");
}

/// Decisions identical but for their nonce (one busy client's: the same
/// counters, cost and time) go to Redis as one that charges their costs
/// together, and each gets the answer it would have had alone; a run that
/// would not all pass is sent again, one by one. Compared with the same
/// decisions sent one by one: answers, marks and what Redis holds.
#[tokio::test]
async fn identical_decisions_are_decided_as_one_and_answered_each() {
    let redis = RedisServer::start();
    let batched = store(&redis, "b:");
    let single = store(&redis, "s:");
    batched.preload().await;
    single.preload().await;
    // Windows (a GCRA, a log or concurrency slots are never joined).
    let counters = |id: &str| {
        vec![
            counter(id, 50, 1_000, Algorithm::Fixed),
            counter(
                id,
                120,
                10_000,
                Algorithm::Sliding {
                    precision: Duration::from_secs(1),
                },
            ),
        ]
    };
    let mut rng = Rng(0x1de7_1ca1);
    let mut now = 1_800_000_000_123u64;
    let (mut decisions, mut denied, mut slowest) = (0u64, 0u64, 0);
    redis.reset_stats();
    for round in 0..60 {
        now += rng.below(300);
        let set = counters(["a", "b"][rng.below(2) as usize]);
        let cost = 1 + rng.below(3);
        let size = 2 + rng.below(40);
        let began = redis_ms(&redis);
        let answers: Vec<Outcome> = together(
            (0..size)
                .map(|_| batched.acquire(&set, None, cost, 1, now))
                .collect(),
        )
        .await
        .into_iter()
        .map(Result::unwrap)
        .collect();
        for b in answers {
            let s = single.acquire(&set, None, cost, 1, now).await.unwrap();
            assert_eq!(
                (b.allowed, b.now_ms, &b.states, &b.marks),
                (s.allowed, s.now_ms, &s.states, &s.marks),
                "round {round}, decision {decisions}"
            );
            denied += u64::from(!b.allowed);
            decisions += 1;
        }
        slowest = slowest.max(redis_ms(&redis) - began + 2);
        same_in_redis(&redis, &format!("round {round}"), slowest);
    }
    assert!(
        denied > 100 && decisions - denied > 100,
        "{denied} of {decisions} refused"
    );
    // The one-by-one store made a call a decision; the batched one far
    // fewer, its refused runs' second tries included.
    let batched_calls = redis.calls("evalsha") - decisions;
    assert!(
        batched_calls < decisions / 3,
        "{batched_calls} calls for {decisions}"
    );
}

/// Redis's clock, in unix ms.
fn redis_ms(redis: &RedisServer) -> i64 {
    let (s, us): (i64, i64) = redis::cmd("TIME").query(&mut redis.conn()).unwrap();
    s * 1000 + us / 1000
}

/// Checks that Redis holds the same under prefixes `b:` and `s:`: every
/// packed string byte for byte, expiring at the same time (within
/// `tolerance` ms), and every sorted set (a log, concurrency slots) the same
/// entries' scores.
fn same_in_redis(redis: &RedisServer, after: &str, tolerance: i64) {
    let mut conn = redis.conn();
    let mut keys: Vec<String> = redis::cmd("KEYS").arg("b:*").query(&mut conn).unwrap();
    keys.sort();
    for key in keys {
        let twin = format!("s:{}", &key[2..]);
        let kind: String = redis::cmd("TYPE").arg(&key).query(&mut conn).unwrap();
        let expiry = |k: &str, conn: &mut redis::Connection| -> i64 {
            redis::cmd("PEXPIRETIME").arg(k).query(conn).unwrap()
        };
        let (b, s) = (expiry(&key, &mut conn), expiry(&twin, &mut conn));
        assert!(
            b > 0 && (b - s).abs() <= tolerance,
            "{key} after {after}: expires at {b} and {s} (tolerance {tolerance})"
        );
        if kind == "string" {
            let get = |k: &str, conn: &mut redis::Connection| -> Vec<u8> {
                redis::cmd("GET").arg(k).query(conn).unwrap()
            };
            assert_eq!(
                get(&key, &mut conn),
                get(&twin, &mut conn),
                "{key} after {after}"
            );
        } else {
            let times = |k: &str, conn: &mut redis::Connection| -> Vec<u64> {
                redis::cmd("ZRANGE")
                    .arg(k)
                    .arg(0)
                    .arg(-1)
                    .arg("WITHSCORES")
                    .query::<Vec<(String, u64)>>(conn)
                    .unwrap()
                    .into_iter()
                    .map(|e| e.1)
                    .collect()
            };
            assert_eq!(
                times(&key, &mut conn),
                times(&twin, &mut conn),
                "{key} after {after}"
            );
        }
    }
}

/// The calls Redis ran since the slow log was emptied, oldest first: each
/// one's arguments (Redis keeps the first 32).
fn slowlog(redis: &RedisServer) -> Vec<Vec<Vec<u8>>> {
    let entries: Vec<redis::Value> = redis::cmd("SLOWLOG")
        .arg("GET")
        .arg(1000)
        .query(&mut redis.conn())
        .unwrap();
    let mut calls: Vec<Vec<Vec<u8>>> = entries
        .into_iter()
        .map(|entry| match entry {
            redis::Value::Array(fields) => redis::from_redis_value(fields[3].clone()).unwrap(),
            other => panic!("{other:?}"),
        })
        .filter(|args: &Vec<Vec<u8>>| args[0].eq_ignore_ascii_case(b"evalsha"))
        .collect();
    calls.reverse();
    calls
}

#[tokio::test]
async fn a_key_written_twice_in_a_batch_lives_as_its_last_write_says() {
    let redis = RedisServer::start();
    let store = store(&redis, "t:");
    store.preload().await;
    // One unit every second, up to 100 at once: a TAT one second on, then
    // 51. Each write moves the key's TTL, by 50 s.
    let gcra = [counter("g", 100, 100_000, gcra(100, 0))];
    let now = 1_800_000_000_000;
    let answers = together(vec![
        store.acquire(&gcra, None, 1, 1, now),
        store.acquire(&gcra, None, 50, 1, now),
    ])
    .await;
    assert!(answers.iter().all(|a| a.as_ref().unwrap().allowed));
    let ttl: i64 = redis::cmd("PTTL")
        .arg("t:{g}:p")
        .query(&mut redis.conn())
        .unwrap();
    // 51 s, a sixteenth more, and a second.
    assert!((54_000..=55_200).contains(&ttl), "{ttl}");
}

#[tokio::test]
async fn a_lone_decision_goes_at_once_as_acquire_lua_itself() {
    let redis = RedisServer::start();
    let store = store(&redis, "l:");
    store.preload().await;
    let mut conn = redis.conn();
    let _: () = redis::cmd("CONFIG")
        .arg("SET")
        .arg("slowlog-log-slower-than")
        .arg(0)
        .query(&mut conn)
        .unwrap();
    let _: () = redis::cmd("SLOWLOG").arg("RESET").query(&mut conn).unwrap();
    let acquire = redis::Script::new(include_str!("../lua/acquire.lua"));
    let memo = Memo::default();
    let a = counters("a");
    // One decision after another, each with no company: each goes as it is
    // (nothing holds a decision back to wait for others, or it would never
    // be answered here).
    for i in 0..3 {
        let o = store
            .acquire(&a, Some(&memo), 1, 1, 1_800_000_000_000 + i)
            .await
            .unwrap();
        assert!(o.allowed);
    }
    let calls = slowlog(&redis);
    assert_eq!(calls.len(), 3);
    for call in &calls {
        assert_eq!(call[1], acquire.get_hash().as_bytes());
        // acquire.lua's keys: the packed string, and the sorted sets of the
        // log and the concurrency slots.
        assert_eq!(call[2], b"3");
    }
    // Five together: one call of the batch script with all their keys.
    let _: () = redis::cmd("SLOWLOG").arg("RESET").query(&mut conn).unwrap();
    let ids = ["v", "w", "x", "y", "z"];
    let sets: Vec<Vec<Counter>> = ids.iter().map(|id| counters(id)).collect();
    let answers = together(
        sets.iter()
            .map(|c| store.acquire(c, None, 1, 1, 1_800_000_000_010))
            .collect(),
    )
    .await;
    assert!(answers.iter().all(|a| a.as_ref().unwrap().allowed));
    let calls = slowlog(&redis);
    assert_eq!(calls.len(), 1, "{} calls", calls.len());
    assert_ne!(calls[0][1], acquire.get_hash().as_bytes());
    assert_eq!(calls[0][2], b"15");
    // The keys, then whether a key is more than one decision's and how many
    // are each decision's, then their arguments.
    assert_eq!(calls[0].len(), 3 + 15 + 1 + 5);
    assert_eq!(calls[0][18], [0, 3, 3, 3, 3, 3]);
    // A key in two decisions: the batch says so (the script then reads and
    // writes it once).
    let _: () = redis::cmd("SLOWLOG").arg("RESET").query(&mut conn).unwrap();
    let answers = together(
        [&sets[0], &sets[1], &sets[0]]
            .iter()
            .map(|c| store.acquire(c, None, 1, 1, 1_800_000_000_020))
            .collect(),
    )
    .await;
    let remaining: Vec<u64> = answers
        .into_iter()
        .map(|a| a.unwrap().states[0].remaining)
        .collect();
    assert_eq!(remaining, [7, 7, 6]);
    let calls = slowlog(&redis);
    assert_eq!(calls.len(), 1, "{} calls", calls.len());
    assert_eq!(calls[0][3 + 9], [1, 3, 3, 3]);
}

#[tokio::test]
async fn a_decision_that_fails_in_a_batch_fails_alone() {
    let redis = RedisServer::start();
    let store = store(&redis, "f:");
    store.preload().await;
    // Identity "x"'s packed string is a list: its decision cannot read it.
    let x = counters("x");
    let key = format!(
        "f:{}",
        std::str::from_utf8(&x[0].key[..x[0].group_len]).unwrap()
    );
    let _: () = redis::cmd("RPUSH")
        .arg(&key)
        .arg("not a counter")
        .query(&mut redis.conn())
        .unwrap();
    let sets = [counters("a"), x, counters("b")];
    let decide = || {
        together(
            sets.iter()
                .map(|c| store.acquire(c, None, 1, 1, 1_800_000_000_000))
                .collect(),
        )
    };
    redis.reset_stats();
    let answers = decide().await;
    assert_eq!(redis.calls("evalsha"), 1);
    assert!(answers[0].as_ref().unwrap().allowed);
    let error = answers[1].as_ref().unwrap_err().to_string();
    assert!(error.contains("WRONGTYPE"), "{error}");
    assert!(answers[2].as_ref().unwrap().allowed);
    // The others were charged once, and the list left as it was.
    let again = decide().await;
    assert_eq!(again[0].as_ref().unwrap().states[0].remaining, 7);
    assert_eq!(again[2].as_ref().unwrap().states[0].remaining, 7);
    let len: u64 = redis::cmd("LLEN")
        .arg(&key)
        .query(&mut redis.conn())
        .unwrap();
    assert_eq!(len, 1);
}

#[tokio::test]
async fn a_batch_that_redis_lost_is_made_again_and_reloaded() {
    let redis = RedisServer::start();
    let store = store(&redis, "n:");
    store.preload().await;
    let sets: Vec<Vec<Counter>> = ["a", "b", "c"].iter().map(|id| counters(id)).collect();
    let decide = |now: u64| {
        together(
            sets.iter()
                .map(|c| store.acquire(c, None, 1, 1, now))
                .collect(),
        )
    };
    let _: () = redis::cmd("SCRIPT")
        .arg("FLUSH")
        .query(&mut redis.conn())
        .unwrap();
    redis.reset_stats();
    // The batch meets NOSCRIPT: each decision is made with acquire.lua's
    // text (which Redis keeps again), and the batch script is loaded again.
    for o in decide(1_800_000_000_000).await {
        assert_eq!(o.unwrap().states[0].remaining, 8);
    }
    assert_eq!(redis.calls("evalsha"), 1);
    assert_eq!(redis.calls("eval"), 3);
    redis.reset_stats();
    for o in decide(1_800_000_000_001).await {
        assert_eq!(o.unwrap().states[0].remaining, 7);
    }
    assert_eq!(redis.calls("evalsha"), 1);
    assert_eq!(redis.calls("eval"), 0);
}

#[tokio::test]
async fn concurrent_clients_share_calls_and_one_exact_limit() {
    let redis = RedisServer::start();
    let up = Upstream::start().await;
    let config = format!(
        r#"
[store]
backend = "redis"
url = "{url}"
timeout = "2s"
clock = "local"
deny_cache = false

[upstreams.api]
url = "{upstream}"

[policies.p]
key = "global"
limits = [{{ limit = 100, window = "1h" }}, {{ limit = 1000, window = "1h", precision = "1m" }}]

[[routes]]
path = "/"
upstream = "api"
policy = "p"
"#,
        url = redis.url(),
        upstream = up.url(),
    );
    // At the start of an hour (on the proxy's clock), so that all fall in one.
    let clock = Clock::system();
    clock.set_offset_ms((3_600_000 - clock.now_ms() % 3_600_000) as i64 + 1);
    let s = Sluice::start_with_clock(&config, clock).await;
    // Connected, scripts loaded.
    assert_eq!(get(&s.url("/"), &[]).await.status, StatusCode::OK);
    redis.reset_stats();
    // 30 clients at once, 5 requests each, one after another.
    let clients = (0..30).map(|_| async {
        let mut seen = Vec::new();
        for _ in 0..5 {
            let r = get(&s.url("/"), &[]).await;
            seen.push((
                r.status,
                r.header("x-ratelimit-remaining").map(str::to_string),
            ));
        }
        seen
    });
    let seen: Vec<_> = futures_util::future::join_all(clients)
        .await
        .into_iter()
        .flatten()
        .collect();
    // Exactly the 99 left were let through, each told a different remainder.
    let mut left: Vec<u64> = seen
        .iter()
        .filter(|(status, _)| *status == StatusCode::OK)
        .map(|(_, r)| r.as_deref().unwrap().parse().unwrap())
        .collect();
    left.sort_unstable();
    assert_eq!(left, (0..99).collect::<Vec<u64>>());
    let refused = seen
        .iter()
        .filter(|(status, _)| *status == StatusCode::TOO_MANY_REQUESTS)
        .count();
    assert_eq!(refused, 150 - 99);
    // Fewer calls than decisions: what queued together went as one.
    let calls = redis.calls("evalsha");
    assert!(calls < 150, "{calls} calls for 150 decisions");
}

#[tokio::test]
async fn on_a_cluster_what_queues_behind_a_decision_goes_as_one_call() {
    let cluster = RedisCluster::start(3);
    let batched = store_at(None, cluster.seeds(), "b:");
    let single = store_at(None, cluster.seeds(), "s:");
    let ids = ["a", "b", "c"];
    let memos: [Memo; 3] = Default::default();
    let mut rng = Rng(0x0c10_57e2);
    let mut now = 1_800_000_000_123u64;
    // Connected, and the scripts loaded on every master.
    for store in [&batched, &single] {
        store.preload().await;
        for c in ids.iter().map(|id| counters(id)) {
            store.acquire(&c, None, 1, 0, now).await.unwrap();
        }
    }
    let calls = || {
        cluster
            .nodes
            .iter()
            .filter(|n| n.is_master())
            .map(|n| n.calls("evalsha"))
            .sum::<u64>()
    };
    let mut denied = 0;
    for _ in 0..30 {
        now += rng.below(900);
        // One identity's decisions: the cluster decides an identity in its
        // own slot, in the order they came.
        let group: Vec<(usize, u64)> = (0..1 + rng.below(12))
            .map(|_| (rng.below(3) as usize, 1 + rng.below(3)))
            .collect();
        let sets: Vec<Vec<Counter>> = group.iter().map(|&(w, _)| counters(ids[w])).collect();
        let before = calls();
        let answers = together(
            group
                .iter()
                .zip(&sets)
                .map(|(&(w, cost), c)| batched.acquire(c, Some(&memos[w]), cost, 1, now))
                .collect(),
        )
        .await;
        // Each identity's first goes at once; those behind it, as one call.
        let mut seen = std::collections::HashMap::new();
        group
            .iter()
            .for_each(|&(w, _)| *seen.entry(w).or_insert(0) += 1);
        let want: u64 = seen.values().map(|&n| if n > 1 { 2 } else { 1 }).sum();
        assert_eq!(calls() - before, want, "group {group:?}");
        for ((&(_, cost), c), b) in group.iter().zip(&sets).zip(answers) {
            let b = b.unwrap();
            let s = single.acquire(c, None, cost, 1, now).await.unwrap();
            assert_eq!((b.allowed, &b.states), (s.allowed, &s.states));
            denied += usize::from(!b.allowed);
        }
    }
    assert!(denied > 10, "{denied}");
}
