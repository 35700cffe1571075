//! The four algorithms, at the store level: both stores give the same answers
//! (differential test), each answer respects the algorithm's definition
//! (reference-model test), and the Redis log counts every unit exactly, even
//! thousands in one millisecond from several instances. Calendar windows
//! ("1d", "1w", "1mo" in a policy's time zone) too: at the store level with
//! windows of uneven lengths, and through the limiter with a moved clock
//! across month ends and daylight-saving changes.

mod support;

use std::sync::Arc;
use std::time::Duration;

use sluice::clock::Clock;
use sluice::config::{Algorithm, ClockSource, HeaderStyle};
use sluice::limiter::{KeyCache, Limiter, Verdict};
use sluice::proxy::Limits;
use sluice::store::memory::MemoryStore;
use sluice::store::redis::RedisStore;
use sluice::store::{Counter, Ends, Memo, Outcome, Store};
use support::{RedisCluster, RedisServer, store_at, store_with_clock};

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
        (
            4,
            1_000,
            Algorithm::Gcra {
                burst: 3,
                delay: Duration::ZERO,
            },
        ),
    ]
}

/// The algorithms the differential test drives: the four, a `gcra` with a
/// `delay`, and `concurrency` slots.
fn differential_algorithms() -> Vec<(u64, u64, Algorithm)> {
    let mut all = algorithms();
    all.push((
        6,
        2_000,
        Algorithm::Gcra {
            burst: 2,
            delay: Duration::from_millis(700),
        },
    ));
    all.push((
        3,
        2_000,
        Algorithm::Concurrency {
            lease: Duration::from_secs(2),
        },
    ));
    all
}

/// A charged request that may be refunded: counters, memory marks, redis marks, cost.
type Ticket = (Vec<Counter>, Vec<u64>, Vec<u64>, u64);

/// A start time on no particular boundary.
const T0: u64 = 1_800_000_000_123;

#[tokio::test]
async fn memory_and_redis_stores_decide_identically() {
    let redis = RedisServer::start();
    differential(|seed| redis_store(&redis, &format!("diff{seed}:")), true).await;
    calendar_differential(&redis_store(&redis, "cal:")).await;
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
    calendar_differential(&store_at(None, cluster.seeds(), "cal:")).await;
}

/// Drives the memory store and `make(seed)` with the same random sequences,
/// switching plans (the same counters with other limits) now and then.
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
                differential_algorithms()
                    .into_iter()
                    .map(|(l, w, a)| counter(id, l, w, a))
                    .collect()
            })
            .collect();
        let memos: [Memo; 3] = Default::default();
        let mut now = T0;
        let (mut allowed, mut denied, mut refunds, mut extras) = (0, 0, 0, 0);
        let mut tickets: Vec<Ticket> = Vec::new();
        for step in 0..400 {
            match rng.below(10) {
                0..=1 => now += rng.below(1_500),
                2 => {
                    // A settlement, as the limiter makes them: all given
                    // back, part given back (a meter said less), more
                    // charged (a meter said more, past the limit maybe),
                    // or nothing but the slots freed; or a renewal.
                    if let Some((counters, m, r, cost)) = (!tickets.is_empty())
                        .then(|| tickets.swap_remove(rng.below(tickets.len() as u64) as usize))
                    {
                        match rng.below(4) {
                            0 => {
                                let back = rng.below(cost + 1);
                                refunds += 1;
                                memory.refund(&counters, &m, back, now);
                                store.refund(&counters, &r, back, now).await.unwrap();
                            }
                            1 => {
                                let extra = 1 + rng.below(12);
                                extras += 1;
                                memory.charge_more(&counters, &m, extra, now);
                                store.charge_more(&counters, &r, extra, now).await.unwrap();
                            }
                            2 => {
                                let a = memory.renew(&counters, &m, now);
                                let b = store.renew(&counters, &r, now).await.unwrap();
                                assert_eq!(a, b, "seed {seed} step {step}: renewals differ");
                                tickets.push((counters, m, r, cost));
                            }
                            _ => {
                                refunds += 1;
                                memory.refund(&counters, &m, cost, now);
                                store.refund(&counters, &r, cost, now).await.unwrap();
                            }
                        }
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
                    // A plan switch: the same counters (a plan counts in
                    // the same keys as the others) with another plan's
                    // limits, three times the default's. Its counters are
                    // another set, with a memo of their own (here none).
                    if rng.below(3) == 0 {
                        memo = None;
                        counters.iter_mut().for_each(|c| c.limit *= 3);
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
            allowed > 50 && denied > 50 && refunds > 10 && extras > 5,
            "{allowed} {denied} {refunds} {extras}"
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
    let log = drive(
        Algorithm::Gcra {
            burst,
            delay: Duration::ZERO,
        },
        limit,
        window,
        17,
        true,
    );
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

/// A `fixed` calendar counter of identity `id`, built as the limiter builds
/// it when its clock is in the window ending at `end`.
fn calendar_counter(id: &str, limit: u64, end: u64, next_end: u64) -> Counter {
    Counter {
        calendar: Some(Ends { end, next_end }),
        ..counter(id, limit, 86_400_000, Algorithm::Fixed)
    }
}

/// Calendar windows at the store level: windows of uneven lengths (as days
/// of 23 or 25 hours and months are), each named by the bounds the limiter
/// sends. Counters are kept past their window's end (as a connection's are
/// until its clock passes it, or Redis's clock is ahead of the proxy's), so
/// the stores must pick the window by `now`; they must agree with each
/// other, and never admit more than the limit in a window.
async fn calendar_differential(store: &RedisStore) {
    let memory = MemoryStore::new(1000);
    let mut ends = vec![T0 + 500];
    for i in 0..400 {
        ends.push(ends[i] + [1_700, 2_300, 900, 3_100, 1_300][i % 5]);
    }
    let mut rng = Rng(0x5eed);
    let mut now = T0;
    let mut built = 0;
    let mut memos: [Memo; 2] = Default::default();
    let mut admitted: std::collections::HashMap<(usize, u64), u64> = Default::default();
    let mut tickets: Vec<Ticket> = Vec::new();
    let (mut allowed, mut denied, mut late, mut refunds) = (0, 0, 0, 0);
    for step in 0..400 {
        now += rng.below(600);
        // The window after the one the counters were built in has not
        // ended (the limiter builds them afresh once its clock passes the
        // first end); past the first end, they are rebuilt now and then.
        while now >= ends[built + 1] || (now >= ends[built] && rng.below(2) == 0) {
            built += 1;
            memos = Default::default();
        }
        if rng.below(8) == 0 {
            if let Some((counters, m, r, cost)) = tickets.pop() {
                refunds += 1;
                memory.refund(&counters, &m, cost, now);
                store.refund(&counters, &r, cost, now).await.unwrap();
                let window = ends.iter().copied().find(|&e| e == m[0]).unwrap();
                let who = usize::from(counters[0].key[1] == b'b');
                *admitted.get_mut(&(who, window)).unwrap() -= cost;
            }
            continue;
        }
        let who = rng.below(2) as usize;
        let id = ["a", "b"][who];
        // A calendar limit next to an epoch-aligned one, in one Redis key.
        let counters = vec![
            calendar_counter(id, 5, ends[built], ends[built + 1]),
            counter(id, 4, 1_000, Algorithm::Fixed),
        ];
        let cost = 1 + rng.below(2);
        let m = memory.acquire(&counters, cost, true, now);
        let r = store
            .acquire(&counters, Some(&memos[who]), cost, 1, now)
            .await
            .unwrap();
        assert_eq!(m.allowed, r.allowed, "step {step}: decisions differ");
        assert_eq!(m.states, r.states, "step {step}: header values differ");
        let window = ends.iter().copied().find(|&e| e > now).unwrap();
        assert_eq!(
            m.states[0].reset_ms, window,
            "step {step}: not the window's end"
        );
        late += u64::from(now >= ends[built]);
        if m.allowed {
            allowed += 1;
            let units = admitted.entry((who, window)).or_default();
            *units += cost;
            assert!(*units <= 5, "step {step}: {units} units in one window");
            tickets.push((counters, m.marks.to_vec(), r.marks.to_vec(), cost));
        } else {
            denied += 1;
        }
    }
    assert!(
        allowed > 50 && denied > 50 && late > 20 && refunds > 10,
        "{allowed} allowed, {denied} denied, {late} past the first end, {refunds} refunds"
    );
}

#[tokio::test]
async fn redis_picks_the_calendar_window_by_its_own_clock() {
    let redis = RedisServer::start();
    let cluster = RedisCluster::start(3);
    let stores = [
        store_with_clock(Some(redis.url()), Vec::new(), "pick:", ClockSource::Redis),
        store_with_clock(None, cluster.seeds(), "pick:", ClockSource::Redis),
    ];
    for store in &stores {
        let wall = sluice::clock::wall_ms();
        // The proxy's clock stands an hour before the window's end; Redis's
        // is in the window: it counts there, and says when it ends.
        let (end, next_end) = (wall + 3_600_000, wall + 7_200_000);
        let in_window = [calendar_counter("x", 1, end, next_end)];
        let first = store.acquire(&in_window, None, 1, 1, 0).await.unwrap();
        assert!(first.allowed);
        assert_eq!(first.states[0].reset_ms, end);
        // A proxy whose clock is a window behind sends the window that has
        // ended (by Redis's clock) and this one: Redis counts in this one.
        let behind = [calendar_counter("x", 1, wall - 60_000, end)];
        let again = store.acquire(&behind, None, 1, 1, 0).await.unwrap();
        assert!(!again.allowed, "the same window, and its one unit is taken");
        assert_eq!(again.states[0].reset_ms, end);
        assert_eq!(again.states[0].retry_ms, end - again.now_ms);
        // Past the end Redis starts the next window: the next end is the reset.
        let passed = [calendar_counter("x", 1, wall - 1, next_end)];
        let next = store.acquire(&passed, None, 1, 1, 0).await.unwrap();
        assert!(next.allowed);
        assert_eq!(next.states[0].reset_ms, next_end);
    }
}

/// Unix ms of an RFC 3339 instant.
fn at(text: &str) -> u64 {
    let ts: jiff::Timestamp = text.parse().expect("an instant");
    ts.as_millisecond() as u64
}

const CALENDAR_POLICY: &str = r#"
[upstreams.api]
url = "http://127.0.0.1:1"
[policies.cal]
key = "header:x-key"
timezone = "Europe/Berlin"
limits = [
  { limit = 3, window = "1d" },
  { limit = 7, window = "1w" },
  { limit = 11, window = "1mo" },
]
"#;

/// Instants of Berlin's calendar around a month end and each daylight-saving
/// change, with the ends of the day, week and month they are in, written
/// out by hand (23 hours on 2026-03-29, 25 on 2026-10-25).
const CHECKPOINTS: [(&str, [&str; 3]); 12] = [
    (
        "2026-03-28T23:59:58+01:00",
        [
            "2026-03-29T00:00:00+01:00",
            "2026-03-30T00:00:00+02:00",
            "2026-04-01T00:00:00+02:00",
        ],
    ),
    (
        "2026-03-29T00:00:01+01:00",
        [
            "2026-03-30T00:00:00+02:00",
            "2026-03-30T00:00:00+02:00",
            "2026-04-01T00:00:00+02:00",
        ],
    ),
    (
        "2026-03-29T23:59:58+02:00",
        [
            "2026-03-30T00:00:00+02:00",
            "2026-03-30T00:00:00+02:00",
            "2026-04-01T00:00:00+02:00",
        ],
    ),
    (
        "2026-03-30T00:00:01+02:00",
        [
            "2026-03-31T00:00:00+02:00",
            "2026-04-06T00:00:00+02:00",
            "2026-04-01T00:00:00+02:00",
        ],
    ),
    (
        "2026-03-31T23:59:58+02:00",
        [
            "2026-04-01T00:00:00+02:00",
            "2026-04-06T00:00:00+02:00",
            "2026-04-01T00:00:00+02:00",
        ],
    ),
    (
        "2026-04-01T00:00:01+02:00",
        [
            "2026-04-02T00:00:00+02:00",
            "2026-04-06T00:00:00+02:00",
            "2026-05-01T00:00:00+02:00",
        ],
    ),
    (
        "2026-10-24T23:59:58+02:00",
        [
            "2026-10-25T00:00:00+02:00",
            "2026-10-26T00:00:00+01:00",
            "2026-11-01T00:00:00+01:00",
        ],
    ),
    (
        "2026-10-25T00:00:01+02:00",
        [
            "2026-10-26T00:00:00+01:00",
            "2026-10-26T00:00:00+01:00",
            "2026-11-01T00:00:00+01:00",
        ],
    ),
    (
        "2026-10-25T23:59:58+01:00",
        [
            "2026-10-26T00:00:00+01:00",
            "2026-10-26T00:00:00+01:00",
            "2026-11-01T00:00:00+01:00",
        ],
    ),
    (
        "2026-10-26T00:00:01+01:00",
        [
            "2026-10-27T00:00:00+01:00",
            "2026-11-02T00:00:00+01:00",
            "2026-11-01T00:00:00+01:00",
        ],
    ),
    (
        "2026-10-31T23:59:58+01:00",
        [
            "2026-11-01T00:00:00+01:00",
            "2026-11-02T00:00:00+01:00",
            "2026-11-01T00:00:00+01:00",
        ],
    ),
    (
        "2026-11-01T00:00:01+01:00",
        [
            "2026-11-02T00:00:00+01:00",
            "2026-11-02T00:00:00+01:00",
            "2026-12-01T00:00:00+01:00",
        ],
    ),
];

/// What one request got: allowed, and its rate-limit fields as sent.
type Answer = (bool, Vec<String>);

/// Through the limiter, as the proxy decides: a policy with a day, a week
/// and a month in Europe/Berlin, the clock moved to each checkpoint, on the
/// memory store, a Redis server and a Redis Cluster. At each, one client
/// asks until refused and another once. Every store gives the same answers
/// and fields; the windows end where the calendar says (the usage reports
/// each limit's reset); the number admitted is what a model counting in
/// the hand-written windows admits; a refusal's `Retry-After` and reset are
/// the true end of the window that refused.
#[tokio::test]
async fn calendar_windows_across_month_ends_and_daylight_saving_changes() {
    let config = sluice::config::parse(CALENDAR_POLICY, "cal.toml", std::path::Path::new("."))
        .expect("valid");
    let policy = config.policies[0].clone();
    let redis = RedisServer::start();
    let cluster = RedisCluster::start(3);
    let clock = Clock::system();
    let limiters = [
        Limiter::new(Store::Memory(MemoryStore::new(1000)), clock.clone(), false),
        Limiter::new(
            Store::Redis(redis_store(&redis, "lim:")),
            clock.clone(),
            false,
        ),
        Limiter::new(
            Store::Redis(store_at(None, cluster.seeds(), "lim:")),
            clock.clone(),
            false,
        ),
    ];
    // Each client's connection keeps its counters from one checkpoint to
    // the next, as a keep-alive connection does: the ones of a window that
    // has ended must not serve.
    let caches: Vec<[KeyCache; 2]> = limiters.iter().map(|_| Default::default()).collect();
    let limits = [3u64, 7, 11];
    // The model: units admitted per (limit, window end), for client "a".
    let mut model: std::collections::HashMap<(usize, u64), u64> = Default::default();
    let mut admitted = 0;
    for (when, expect) in CHECKPOINTS {
        let target = at(when);
        let ends = expect.map(at);
        // 100 ms into the second: the answers' whole seconds stay the same
        // for the few milliseconds the three stores take.
        clock.set_offset_ms(target as i64 + 100 - sluice::clock::wall_ms() as i64);
        let mut answers: Vec<Vec<Answer>> = Vec::new();
        for (limiter, cache) in limiters.iter().zip(&caches) {
            let mut got = Vec::new();
            for (i, who) in ["a", "a", "a", "a", "a", "b"].into_iter().enumerate() {
                let mut headers = http::HeaderMap::new();
                headers.insert("x-key", who.parse().unwrap());
                let verdict = limiter
                    .decide(
                        &policy,
                        1,
                        "127.0.0.1".parse().unwrap(),
                        sluice::fields::Fields::Map(&headers),
                        None,
                        &cache[usize::from(who == "b")],
                    )
                    .await
                    .unwrap();
                let (allowed, binding) = match verdict {
                    Verdict::Allowed { binding, .. } => (true, binding),
                    Verdict::Limited { binding } => (false, binding),
                    _ => panic!("{when}: request {i}: neither allowed nor limited"),
                };
                let mut fields = Vec::new();
                Limits::new(HeaderStyle::Both, &policy, binding)
                    .unwrap()
                    .each(|name, value| {
                        fields.push(format!("{name}: {}", String::from_utf8_lossy(value)))
                    });
                if !allowed {
                    // As the proxy's 429 says it.
                    fields.push(format!(
                        "retry-after: {}",
                        binding.retry_ms.div_ceil(1000).max(1)
                    ));
                }
                got.push((allowed, fields));
            }
            // Each limit's window ends where the calendar says.
            let spec: sluice::config::KeySpec = "header:x-key".parse().unwrap();
            let usage = limiter.usage(&policy, &spec, b"a").await.unwrap();
            let resets: Vec<u64> = usage.iter().map(|u| u.reset_ms).collect();
            assert_eq!(resets, ends, "{when}: the windows' ends");
            answers.push(got);
        }
        assert_eq!(answers[0], answers[1], "{when}: memory and Redis differ");
        assert_eq!(
            answers[0], answers[2],
            "{when}: memory and Redis Cluster differ"
        );

        // Client "a" against the model, counting in the hand-written windows.
        for (i, (allowed, fields)) in answers[0].iter().take(5).enumerate() {
            let fits = (0..3).all(|l| model.get(&(l, ends[l])).copied().unwrap_or(0) < limits[l]);
            assert_eq!(*allowed, fits, "{when}: request {i}: {fields:?}");
            if fits {
                (0..3).for_each(|l| *model.entry((l, ends[l])).or_default() += 1);
                admitted += 1;
                continue;
            }
            // Refused by the window that lasts longest among the full ones:
            // its end is the reset, and the wait until then Retry-After.
            let full = (0..3)
                .filter(|&l| model.get(&(l, ends[l])).copied().unwrap_or(0) >= limits[l])
                .max_by_key(|&l| ends[l])
                .unwrap();
            let secs = (ends[full] - target).div_ceil(1000);
            for want in [
                format!("x-ratelimit-reset: {}", ends[full] / 1000),
                "x-ratelimit-remaining: 0".to_string(),
                format!("retry-after: {secs}"),
            ] {
                assert!(
                    fields.contains(&want),
                    "{when}: request {i}: {want} not in {fields:?}"
                );
            }
            assert!(
                fields
                    .iter()
                    .any(|f| f.starts_with("ratelimit: ") && f.ends_with(&format!(";t={secs}"))),
                "{when}: request {i}: {fields:?}"
            );
        }
    }
    // Per daylight-saving change: 3 + 3 + 0 (the 23 or 25 hour day is not
    // over yet) + 3 + 2 (the month is full) + 2 (the week is full).
    assert_eq!(admitted, 2 * 13);
}

/// `charge = "after"` charges once the response is known, which may be
/// windows later (a long download): the charge counts in the window it is
/// made in, on every store.
#[tokio::test]
async fn a_late_charge_counts_in_the_window_it_is_made_in() {
    let text = CALENDAR_POLICY.replace("[policies.cal]", "[policies.cal]\ncharge = \"after\"");
    let config = sluice::config::parse(&text, "cal.toml", std::path::Path::new(".")).unwrap();
    let policy = config.policies[0].clone();
    let redis = RedisServer::start();
    let clock = Clock::system();
    let limiters = [
        Limiter::new(Store::Memory(MemoryStore::new(1000)), clock.clone(), false),
        Limiter::new(
            Store::Redis(redis_store(&redis, "late:")),
            clock.clone(),
            false,
        ),
    ];
    let spec: sluice::config::KeySpec = "header:x-key".parse().unwrap();
    let mut headers = http::HeaderMap::new();
    headers.insert("x-key", "late".parse().unwrap());
    for limiter in &limiters {
        let move_to = |when: &str| {
            clock.set_offset_ms(at(when) as i64 - sluice::clock::wall_ms() as i64);
        };
        move_to("2026-03-28T23:59:58+01:00");
        let verdict = limiter
            .decide(
                &policy,
                1,
                "127.0.0.1".parse().unwrap(),
                sluice::fields::Fields::Map(&headers),
                None,
                &KeyCache::default(),
            )
            .await
            .unwrap();
        let Verdict::Allowed { ticket, .. } = verdict else {
            panic!("the first request is allowed");
        };
        // The response ends two days (and one daylight-saving change) later.
        move_to("2026-03-30T12:00:00+02:00");
        limiter
            .settle(ticket, http::StatusCode::OK, false, None)
            .await
            .unwrap();
        let usage = limiter.usage(&policy, &spec, b"late").await.unwrap();
        let used: Vec<u64> = usage.iter().map(|u| u.used).collect();
        // Today, this week (from Monday 2026-03-30) and this month.
        assert_eq!(
            used,
            [1, 1, 1],
            "{:?}",
            usage.iter().map(|u| u.reset_ms).collect::<Vec<_>>()
        );
    }
}
