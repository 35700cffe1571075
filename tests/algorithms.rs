//! The four algorithms, at the store level: both stores give the same answers
//! (differential test), each answer respects the algorithm's definition
//! (reference-model test), and the Redis log counts every unit exactly, even
//! thousands in one millisecond from several instances.

mod support;

use std::sync::Arc;
use std::time::Duration;

use sluice::config::{Algorithm, Backend, ClockSource, OnError, StoreConfig};
use sluice::store::memory::MemoryStore;
use sluice::store::redis::RedisStore;
use sluice::store::{Counter, Memo, Outcome};
use support::{RedisCluster, RedisServer};

/// A small deterministic PRNG (xorshift64*): reproducible random sequences.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

fn redis_store(redis: &RedisServer, prefix: &str) -> RedisStore {
    store_at(Some(redis.url()), Vec::new(), prefix)
}

fn store_at(url: Option<String>, cluster: Vec<String>, prefix: &str) -> RedisStore {
    RedisStore::new(&StoreConfig {
        backend: Backend::Redis,
        url,
        cluster,
        timeout: Duration::from_secs(2),
        ca: None,
        on_error: OnError::Deny,
        clock: ClockSource::Local,
        prefix: prefix.to_string(),
        deny_cache: false,
        max_keys: 1_000_000,
    })
    .unwrap()
}

fn counter(id: &str, limit: u64, window_ms: u64, algorithm: Algorithm) -> Counter {
    Counter {
        key: format!("{{{id}}}:{}:{window_ms}", algorithm.name())
            .as_bytes()
            .into(),
        group_len: id.len() + 2,
        limit,
        window_ms,
        algorithm,
        calendar: None,
    }
}

fn algorithms() -> Vec<(u64, u64, Algorithm)> {
    vec![
        (5, 1_000, Algorithm::Fixed),
        (
            12,
            10_000,
            Algorithm::Sliding {
                precision: Duration::from_secs(1),
            },
        ),
        (7, 3_000, Algorithm::Log),
        (4, 1_000, Algorithm::Gcra { burst: 3 }),
    ]
}

/// A charged request that may be refunded: counters, memory marks, redis marks, cost.
type Ticket = (Vec<Counter>, Vec<u64>, Vec<u64>, u64);

/// A start time on no particular boundary.
const T0: u64 = 1_800_000_000_123;

#[tokio::test]
async fn memory_and_redis_stores_decide_identically() {
    let redis = RedisServer::start();
    differential(|seed| redis_store(&redis, &format!("diff{seed}:")), true).await;
}

#[tokio::test]
async fn memory_and_redis_cluster_stores_decide_identically() {
    let cluster = RedisCluster::start(3);
    // On a cluster, a request spanning two identities is decided slot by slot:
    // the decision is the same, but when it is a rejection the slots after the
    // rejecting one are not asked, so their numbers are not compared.
    differential(
        |seed| store_at(None, cluster.seeds(), &format!("diff{seed}:")),
        false,
    )
    .await;
}

/// Drives the memory store and `make(seed)` with the same random sequences.
async fn differential(make: impl Fn(u64) -> RedisStore, exact_denials: bool) {
    for seed in 1..=4u64 {
        let memory = MemoryStore::new(1_000_000);
        let store = make(seed);
        let mut rng = Rng(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15));
        // Three identities, each with every algorithm; a request touches one
        // identity's counters, or two identities' at once.
        let per_identity: Vec<Vec<Counter>> = ["a", "b", "c"]
            .iter()
            .map(|id| {
                algorithms()
                    .into_iter()
                    .map(|(l, w, a)| counter(id, l, w, a))
                    .collect()
            })
            .collect();
        let memos: [Memo; 3] = Default::default();
        let mut now = T0;
        let (mut allowed, mut denied, mut refunds) = (0, 0, 0);
        let mut tickets: Vec<Ticket> = Vec::new();
        for step in 0..400 {
            match rng.below(10) {
                0..=1 => now += rng.below(1_500),
                2 => {
                    if let Some((counters, m, r, cost)) = (!tickets.is_empty())
                        .then(|| tickets.swap_remove(rng.below(tickets.len() as u64) as usize))
                    {
                        refunds += 1;
                        memory.refund(&counters, &m, cost, now);
                        store.refund(&counters, &r, cost, now).await.unwrap();
                    }
                }
                _ => {
                    let who = rng.below(3) as usize;
                    let mut counters = per_identity[who].clone();
                    let single = counters.len();
                    // One identity's counters go with its memo, as a
                    // connection's cached counters do; two identities' without.
                    let mut memo = Some(&memos[who]);
                    if rng.below(4) == 0 {
                        memo = None;
                        counters.extend(per_identity[rng.below(3) as usize].iter().cloned());
                        counters.dedup_by(|a, b| a.key == b.key);
                        let mut seen = std::collections::HashSet::new();
                        counters.retain(|c| seen.insert(c.key.clone()));
                    }
                    let cost = 1 + rng.below(3);
                    let charge = rng.below(5) != 0;
                    let m: Outcome = memory.acquire(&counters, cost, charge, now);
                    let r: Outcome = store
                        .acquire(&counters, memo, cost, u8::from(charge), now)
                        .await
                        .unwrap();
                    assert_eq!(
                        m.allowed, r.allowed,
                        "seed {seed} step {step}: decisions differ"
                    );
                    if m.allowed || exact_denials || counters.len() == single {
                        assert_eq!(
                            m.states, r.states,
                            "seed {seed} step {step}: header values differ"
                        );
                    }
                    if m.allowed {
                        allowed += 1
                    } else {
                        denied += 1
                    }
                    if m.allowed && charge {
                        tickets.push((counters, m.marks.to_vec(), r.marks.to_vec(), cost));
                    }
                }
            }
        }
        // The sequence must have exercised both answers and refunds.
        assert!(
            allowed > 50 && denied > 50 && refunds > 10,
            "{allowed} {denied} {refunds}"
        );
    }
}

/// Drives one counter with a random stream; returns (time, cost, allowed).
fn drive(
    algorithm: Algorithm,
    limit: u64,
    window_ms: u64,
    seed: u64,
    unit_cost: bool,
) -> Vec<(u64, u64, bool)> {
    let memory = MemoryStore::new(1000);
    let c = counter("ref", limit, window_ms, algorithm);
    let mut rng = Rng(seed);
    let mut now = T0;
    let mut log = Vec::new();
    for _ in 0..3000 {
        now += rng.below(window_ms / 8);
        let cost = if unit_cost { 1 } else { 1 + rng.below(3) };
        let out = memory.acquire(std::slice::from_ref(&c), cost, true, now);
        log.push((now, cost, out.allowed));
    }
    log
}

#[test]
fn reference_model_fixed_never_more_and_never_fewer_than_the_limit() {
    let (limit, window) = (10, 1_000);
    let log = drive(Algorithm::Fixed, limit, window, 7, true);
    let mut per_window: std::collections::BTreeMap<u64, (u64, u64)> = Default::default();
    for (t, cost, allowed) in log {
        let w = per_window.entry(t / window).or_default();
        w.0 += cost;
        if allowed {
            w.1 += cost;
        }
    }
    for (w, (asked, admitted)) in per_window {
        assert!(admitted <= limit, "window {w}: {admitted} admitted");
        assert_eq!(
            admitted,
            asked.min(limit),
            "window {w}: demand {asked}, admitted {admitted}"
        );
    }
}

#[test]
fn reference_model_log_never_more_than_limit_in_any_window() {
    let (limit, window) = (9, 1_000);
    let log = drive(Algorithm::Log, limit, window, 11, false);
    let admitted: Vec<(u64, u64)> = log.iter().filter(|e| e.2).map(|e| (e.0, e.1)).collect();
    for &(t, _) in &admitted {
        let in_window: u64 = admitted
            .iter()
            .filter(|(u, _)| *u > t.saturating_sub(window) && *u <= t)
            .map(|e| e.1)
            .sum();
        assert!(
            in_window <= limit,
            "{in_window} units in the window ending {t}"
        );
    }
    // And a request is refused only when it would not fit.
    for &(t, cost, allowed) in &log {
        if !allowed {
            let in_window: u64 = admitted
                .iter()
                .filter(|(u, _)| *u > t - window && *u < t)
                .map(|e| e.1)
                .sum();
            let at_t: u64 = admitted.iter().filter(|(u, _)| *u == t).map(|e| e.1).sum();
            assert!(
                in_window + at_t + cost > limit,
                "refused at {t} with room to spare"
            );
        }
    }
}

#[test]
fn reference_model_sliding_never_more_than_limit_in_its_buckets() {
    let (limit, window, precision) = (20, 10_000, 1_000);
    let log = drive(
        Algorithm::Sliding {
            precision: Duration::from_millis(precision),
        },
        limit,
        window,
        13,
        false,
    );
    let n = window / precision;
    let mut per_bucket: std::collections::BTreeMap<u64, u64> = Default::default();
    for (t, cost, allowed) in &log {
        if *allowed {
            *per_bucket.entry(t / precision).or_default() += cost;
        }
    }
    let first = *per_bucket.keys().next().unwrap();
    let last = *per_bucket.keys().last().unwrap();
    for b in first..=last {
        let sum: u64 = (b.saturating_sub(n - 1)..=b)
            .filter_map(|i| per_bucket.get(&i))
            .sum();
        assert!(sum <= limit, "{sum} units in the {n} buckets ending at {b}");
    }
}

#[test]
fn reference_model_gcra_paces_to_the_rate_with_burst() {
    let (limit, window, burst) = (10, 1_000, 4);
    let log = drive(Algorithm::Gcra { burst }, limit, window, 17, true);
    let admitted: Vec<u64> = log.iter().filter(|e| e.2).map(|e| e.0).collect();
    let t = window / limit;
    // In any span [a, b]: at most burst + (b - a) / T requests.
    for (i, &a) in admitted.iter().enumerate() {
        for (j, &b) in admitted.iter().enumerate().skip(i) {
            let count = (j - i + 1) as u64;
            assert!(
                count <= burst + (b - a) / t,
                "{count} admitted in {} ms",
                b - a
            );
        }
        if i > 200 {
            break;
        }
    }
    // And pacing is not starving: about limit per window over the run.
    let span = admitted.last().unwrap() - admitted[0];
    assert!(
        admitted.len() as u64 >= span / t / 2,
        "only {} admitted",
        admitted.len()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_log_counts_thousands_in_one_millisecond_across_instances() {
    let redis = RedisServer::start();
    let instances = [
        Arc::new(redis_store(&redis, "log:")),
        Arc::new(redis_store(&redis, "log:")),
    ];
    let c = counter("crowd", 1_000, 60_000, Algorithm::Log);
    let mut tasks = Vec::new();
    for i in 0..3_000 {
        let store = instances[i % 2].clone();
        let c = c.clone();
        // Every request at the same millisecond.
        tasks.push(tokio::spawn(async move {
            store
                .acquire(std::slice::from_ref(&c), None, 1, 1, T0)
                .await
                .unwrap()
                .allowed
        }));
    }
    let mut admitted = 0;
    for t in tasks {
        admitted += u64::from(t.await.unwrap());
    }
    assert_eq!(admitted, 1_000);
    let key = format!("log:{}", String::from_utf8(c.key.to_vec()).unwrap());
    let units: u64 = redis::cmd("ZCARD")
        .arg(key)
        .query(&mut redis.conn())
        .unwrap();
    assert_eq!(units, 1_000);
}
