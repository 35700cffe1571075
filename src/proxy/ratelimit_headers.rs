//! The rate-limit headers a client sees, in the configured style.
//!
//! - `x-ratelimit`: `X-RateLimit-Limit`, `-Remaining`, `-Reset` (unix seconds).
//! - `ietf`: draft-ietf-httpapi-ratelimit-headers-10: `RateLimit-Policy` lists
//!   every limit of the policy as `"name";q=LIMIT;w=WINDOW_SECONDS`, and
//!   `RateLimit` gives the binding one as `"name";r=REMAINING;t=SECONDS_TO_RESET`.
//!
//! Resets are rounded up to whole seconds: a fixed window of a second or more
//! ends on a whole second, so every response of one window shows the same value.

use std::cell::RefCell;
use std::thread::LocalKey;

use http::HeaderMap;
use http::header::{HeaderName, HeaderValue};

use crate::config::{HeaderStyle, Policy};
use crate::limiter::Binding;

// Names built once: a `&str` name is parsed again on every insert.
const LIMIT: HeaderName = HeaderName::from_static("x-ratelimit-limit");
const REMAINING: HeaderName = HeaderName::from_static("x-ratelimit-remaining");
const RESET: HeaderName = HeaderName::from_static("x-ratelimit-reset");
const POLICY: HeaderName = HeaderName::from_static("ratelimit-policy");
const RATELIMIT: HeaderName = HeaderName::from_static("ratelimit");

thread_local! {
    // The limit, and the reset of a window, are the same for many responses
    // in a row: each is formatted once and then shared (a clone of a
    // HeaderValue counts a reference; formatting allocates).
    static LAST_LIMIT: RefCell<(u64, HeaderValue)> = const { RefCell::new((0, HeaderValue::from_static("0"))) };
    static LAST_RESET: RefCell<(u64, HeaderValue)> = const { RefCell::new((0, HeaderValue::from_static("0"))) };
}

/// `n` as a header value, from `last` when it holds the same number.
fn number(last: &'static LocalKey<RefCell<(u64, HeaderValue)>>, n: u64) -> HeaderValue {
    last.with(|last| {
        let mut last = last.borrow_mut();
        if last.0 != n {
            *last = (n, HeaderValue::from(n));
        }
        last.1.clone()
    })
}

pub fn write(headers: &mut HeaderMap, style: HeaderStyle, policy: &Policy, b: &Binding) {
    if matches!(style, HeaderStyle::XRateLimit | HeaderStyle::Both) {
        headers.reserve(3);
        headers.insert(LIMIT, number(&LAST_LIMIT, b.limit));
        headers.insert(REMAINING, HeaderValue::from(b.remaining));
        headers.insert(RESET, number(&LAST_RESET, b.reset_ms.div_ceil(1000)));
    }
    if matches!(style, HeaderStyle::Ietf | HeaderStyle::Both) {
        let name = |i: usize| item_name(policy, i);
        // The binding limit first: on a 429 it is the one that denied.
        let mut items = vec![b.index];
        items.extend((0..policy.limits.len()).filter(|&i| i != b.index));
        let list: Vec<String> = items
            .iter()
            .map(|&i| {
                let l = &policy.limits[i];
                format!(
                    "{};q={};w={}",
                    name(i),
                    l.limit,
                    (l.window.as_millis() as u64).div_ceil(1000)
                )
            })
            .collect();
        if let Ok(v) = HeaderValue::from_str(&list.join(", ")) {
            headers.insert(POLICY, v);
        }
        let t = b.reset_in_ms.div_ceil(1000);
        let t = if b.retry_ms > 0 {
            t.max(b.retry_ms.div_ceil(1000)).max(1)
        } else {
            t
        };
        if let Ok(v) =
            HeaderValue::from_str(&format!("{};r={};t={}", name(b.index), b.remaining, t))
        {
            headers.insert(RATELIMIT, v);
        }
    }
}

/// A structured-field string naming one limit: `"policy-window"`, e.g. `"standard-1m"`.
fn item_name(policy: &Policy, i: usize) -> String {
    let l = &policy.limits[i];
    let mut name = format!(
        "{}-{}",
        policy.name,
        crate::config::duration::format(l.window)
    );
    if policy
        .limits
        .iter()
        .filter(|o| o.window == l.window)
        .count()
        > 1
    {
        name += &format!("-{i}");
    }
    // sf-string allows printable ASCII; escape quotes and backslashes.
    let escaped: String = name
        .chars()
        .filter(|c| (' '..='~').contains(c))
        .flat_map(|c| match c {
            '"' | '\\' => vec!['\\', c],
            c => vec![c],
        })
        .collect();
    format!("\"{escaped}\"")
}
