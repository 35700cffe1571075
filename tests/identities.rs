//! Identities, on generated input: distinct identity bytes never share a
//! budget, and no arrangement of copies of a value (headers sent again,
//! comma lists, query parameters repeated with `&` or `;`, escapes spelled
//! another way) gives that value a fresh one. Decided by the real limiter
//! on the memory store (the Redis store counts in keys the limiter makes the
//! same way).

use std::net::IpAddr;
use std::path::Path;
use std::sync::Arc;

use http::{HeaderMap, HeaderName, HeaderValue};
use proptest::prelude::*;
use sluice::clock::Clock;
use sluice::config::{self, Policy};
use sluice::fields::Fields;
use sluice::limiter::{KeyCache, Limiter, Verdict};
use sluice::store::Store;
use sluice::store::memory::MemoryStore;

/// A limiter on the memory store whose clock sits mid-way through an hour,
/// so that no case sees a window end.
fn limiter() -> Limiter {
    let clock = Clock::system();
    let now = clock.now_ms() as i64;
    let hour = 3_600_000;
    clock.set_offset_ms(now / hour * hour + hour / 2 - now);
    Limiter::new(Store::Memory(MemoryStore::new(100_000)), clock, false)
}

fn policy(key: &str, limit: u64, ipv6_prefix: u8) -> Arc<Policy> {
    let text = format!(
        "[upstreams.u]\nurl = \"http://127.0.0.1:1\"\n[policies.p]\nkey = \"{key}\"\n\
         ipv6_prefix = {ipv6_prefix}\nlimits = [{{ limit = {limit}, window = \"1h\" }}]\n"
    );
    let config = config::parse(&text, "test.toml", Path::new(".")).expect("a valid policy");
    config.policies[0].clone()
}

/// One request's identities: its address, header lines and query.
struct Request {
    client: IpAddr,
    headers: HeaderMap,
    query: Option<String>,
}

impl Request {
    fn from(client: IpAddr) -> Request {
        Request {
            client,
            headers: HeaderMap::new(),
            query: None,
        }
    }
}

/// Whether the limiter lets `req` pass (a fresh connection each time, so
/// no cached counters carry over).
fn passes(limiter: &Limiter, policy: &Arc<Policy>, req: &Request) -> bool {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .build()
        .expect("a runtime");
    let verdict = runtime.block_on(limiter.decide(
        policy,
        1,
        req.client,
        Fields::Map(&req.headers),
        req.query.as_deref(),
        &KeyCache::default(),
    ));
    match verdict {
        Ok(Verdict::Allowed { .. }) => true,
        Ok(Verdict::Limited { .. }) => false,
        _ => panic!("neither allowed nor limited"),
    }
}

const CLIENT: [u8; 4] = [192, 0, 2, 1];

/// Bytes a header value may hold inside a list element: visible ASCII but
/// the comma, and obs-text.
fn element_byte() -> impl Strategy<Value = u8> {
    prop_oneof![0x21u8..=0x2b, 0x2du8..=0x7e, 0x80u8..=0xff]
}

fn element() -> impl Strategy<Value = Vec<u8>> {
    proptest::collection::vec(element_byte(), 1..12)
}

/// `bytes` as a query value: each byte raw when it may be, else escaped,
/// escapes in either case; a space as `+` or `%20`.
fn encode(bytes: &[u8], choices: &[u8]) -> String {
    let mut out = String::new();
    for (i, &b) in bytes.iter().enumerate() {
        let choice = choices.get(i).copied().unwrap_or(0);
        let safe = b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~');
        match (b, choice % 3) {
            (b' ', 0) => out.push('+'),
            (_, 0) if safe => out.push(b as char),
            (_, 1) => out.push_str(&format!("%{b:02x}")),
            _ => out.push_str(&format!("%{b:02X}")),
        }
    }
    out
}

/// A value's spelling among the others of one request, as a backend may read
/// any of them: header lines (`X-Key`, comma lists, spaces around elements)
/// or query pairs (`&` and `;`, `key` spelled `k%65y`).
#[derive(Debug, Clone)]
struct Arrangement {
    /// Where among the junk values the counted one goes, and how often.
    at: usize,
    copies: usize,
    /// Per element: a new line (header) or `;` (query) before it, spaces.
    splits: Vec<bool>,
    spaces: Vec<u8>,
    choices: Vec<u8>,
}

fn arrangement() -> impl Strategy<Value = Arrangement> {
    (
        0usize..6,
        1usize..3,
        proptest::collection::vec(any::<bool>(), 8),
        proptest::collection::vec(0u8..3, 8),
        proptest::collection::vec(any::<u8>(), 16),
    )
        .prop_map(|(at, copies, splits, spaces, choices)| Arrangement {
            at,
            copies,
            splits,
            spaces,
            choices,
        })
}

/// The values of one request: `junk` with `copies` of `value` at `at`.
fn order(value: &[u8], junk: &[Vec<u8>], a: &Arrangement) -> Vec<Vec<u8>> {
    let mut all = junk.to_vec();
    for _ in 0..a.copies {
        all.insert(a.at.min(all.len()), value.to_vec());
    }
    all
}

fn header_request(name: &str, values: &[Vec<u8>], a: &Arrangement) -> Request {
    let mut req = Request::from(IpAddr::from(CLIENT));
    let name = HeaderName::from_bytes(name.as_bytes()).expect("a header name");
    let mut line: Vec<u8> = Vec::new();
    for (i, v) in values.iter().enumerate() {
        if !line.is_empty() && a.splits[i % a.splits.len()] {
            let value = HeaderValue::from_bytes(&line).expect("a header value");
            req.headers.append(name.clone(), value);
            line.clear();
        }
        let pad = b" \t "[..a.spaces[i % a.spaces.len()] as usize].to_vec();
        if !line.is_empty() {
            line.push(b',');
        }
        line.extend_from_slice(&pad);
        line.extend_from_slice(v);
        line.extend_from_slice(&pad);
    }
    let value = HeaderValue::from_bytes(&line).expect("a header value");
    req.headers.append(name, value);
    req
}

fn query_request(values: &[Vec<u8>], a: &Arrangement) -> Request {
    let mut req = Request::from(IpAddr::from(CLIENT));
    let mut query = String::from("other=1");
    for (i, v) in values.iter().enumerate() {
        query.push(if a.splits[i % a.splits.len()] {
            ';'
        } else {
            '&'
        });
        let name = if a.spaces[i % a.spaces.len()] == 1 {
            "k%65y"
        } else {
            "key"
        };
        query.push_str(name);
        query.push('=');
        query.push_str(&encode(v, &a.choices));
    }
    req.query = Some(query);
    req
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(128))]

    /// Two header values that differ in any byte have budgets of their own.
    #[test]
    fn distinct_header_values_never_share_a_budget(a in element(), b in element()) {
        prop_assume!(a != b);
        let (limiter, policy) = (limiter(), policy("header:X-Key", 1, 64));
        let one = |v: &Vec<u8>| header_request("x-key", std::slice::from_ref(v), &Arrangement {
            at: 0, copies: 0, splits: vec![false], spaces: vec![0], choices: vec![],
        });
        prop_assert!(passes(&limiter, &policy, &one(&a)));
        prop_assert!(passes(&limiter, &policy, &one(&b)));
        prop_assert!(!passes(&limiter, &policy, &one(&a)));
    }

    /// Two query values that differ in any byte, UTF-8 or not, have budgets
    /// of their own.
    #[test]
    fn distinct_query_values_never_share_a_budget(
        a in proptest::collection::vec(any::<u8>(), 1..12),
        b in proptest::collection::vec(any::<u8>(), 1..12),
        choices in proptest::collection::vec(any::<u8>(), 12),
    ) {
        prop_assume!(a != b);
        let (limiter, policy) = (limiter(), policy("query:key", 1, 64));
        let a_spelled = Arrangement { at: 0, copies: 0, splits: vec![false], spaces: vec![0], choices };
        let b_spelled = Arrangement { choices: vec![], ..a_spelled.clone() };
        prop_assert!(passes(&limiter, &policy, &query_request(std::slice::from_ref(&a), &a_spelled)));
        prop_assert!(passes(&limiter, &policy, &query_request(std::slice::from_ref(&b), &b_spelled)));
        // The same bytes spelled another way are the same identity.
        prop_assert!(!passes(&limiter, &policy, &query_request(std::slice::from_ref(&a), &b_spelled)));
    }

    /// Distinct addresses have budgets of their own (IPv6 by /128 here); a
    /// header value spelling an address shares nothing with that address.
    #[test]
    fn distinct_addresses_never_share_a_budget(a in any::<IpAddr>(), b in any::<IpAddr>()) {
        prop_assume!(a.to_canonical() != b.to_canonical());
        let (limiter, policy) = (limiter(), policy("ip", 1, 128));
        prop_assert!(passes(&limiter, &policy, &Request::from(a)));
        prop_assert!(passes(&limiter, &policy, &Request::from(b)));
        prop_assert!(!passes(&limiter, &policy, &Request::from(a)));
        let (limiter, policy) = (self::limiter(), self::policy("header:X-Key", 1, 128));
        let spelled = header_request("x-key", &[a.to_string().into_bytes()], &Arrangement {
            at: 0, copies: 0, splits: vec![false], spaces: vec![0], choices: vec![],
        });
        prop_assert!(passes(&limiter, &policy, &Request::from(a)));
        let spelled = Request { client: b, ..spelled };
        prop_assert!(passes(&limiter, &policy, &spelled));
    }

    /// A header value counted with a limit of 3 passes three times, however
    /// its copies are arranged among fresh junk values, and never a fourth.
    #[test]
    fn no_arrangement_of_header_copies_buys_a_fresh_budget(
        value in element(),
        arrangements in proptest::collection::vec(arrangement(), 6),
    ) {
        let (limiter, policy) = (limiter(), policy("header:X-Key", 3, 64));
        for (n, a) in arrangements.iter().enumerate() {
            let junk: Vec<Vec<u8>> = (0..a.at).map(|k| format!("j{n}.{k}").into_bytes()).collect();
            prop_assume!(!junk.contains(&value));
            let req = header_request("x-key", &order(&value, &junk, a), a);
            prop_assert_eq!(passes(&limiter, &policy, &req), n < 3, "request {}", n);
        }
    }

    /// The same for a query value, with `&` and `;` and its bytes spelled
    /// any way.
    #[test]
    fn no_arrangement_of_query_copies_buys_a_fresh_budget(
        value in proptest::collection::vec(any::<u8>(), 1..10),
        arrangements in proptest::collection::vec(arrangement(), 6),
    ) {
        let (limiter, policy) = (limiter(), policy("query:key", 3, 64));
        for (n, a) in arrangements.iter().enumerate() {
            let junk: Vec<Vec<u8>> = (0..a.at).map(|k| format!("j{n}.{k}").into_bytes()).collect();
            prop_assume!(!junk.contains(&value));
            let req = query_request(&order(&value, &junk, a), a);
            prop_assert_eq!(passes(&limiter, &policy, &req), n < 3, "request {}", n);
        }
    }

    /// Every address of one /64 shares the /64's budget.
    #[test]
    fn an_ipv6_network_is_one_client(net in any::<u64>(), hosts in proptest::collection::vec(any::<u64>(), 4)) {
        let (limiter, policy) = (limiter(), policy("ip", 3, 64));
        for (n, host) in hosts.iter().enumerate() {
            let addr = IpAddr::from((u128::from(net) << 64 | u128::from(*host)).to_be_bytes());
            prop_assume!(addr.to_canonical() == addr);
            prop_assert_eq!(passes(&limiter, &policy, &Request::from(addr)), n < 3);
        }
    }
}
