//! The rate-limit headers a client sees, in the configured style.
//!
//! - `x-ratelimit`: `X-RateLimit-Limit`, `-Remaining`, `-Reset` (unix seconds).
//! - `ietf`: draft-ietf-httpapi-ratelimit-headers-11: `RateLimit-Policy` lists
//!   every limit of the plan in force as `"name";q=LIMIT;w=WINDOW_SECONDS`
//!   (see `config::IetfTexts`), and `RateLimit` gives the binding one as
//!   `"name";r=AVAILABLE;t=EFFECTIVE_WINDOW_SECONDS`.
//!
//! - `X-RateLimit-Delay-Ms`, in every style, on a request a `gcra` limit's
//!   `delay` held: how long, in milliseconds.
//!
//! Resets are rounded up to whole seconds: a fixed window of a second or more
//! ends on a whole second, so every response of one window shows the same value.
//! `t` is -11's effective window (section 4.1.2), the time in which the client
//! can use no more than `r`: the time to the counter's reset while allowed,
//! and on a denial (`r=0`) the time until the request would pass, which is
//! `Retry-After` itself (section 6: Retry-After is never earlier than the end
//! of the effective window).
//!
//! A decision's fields travel beside the answer as [`Limits`] and are written
//! where the answer is: sluice's own HTTP/1.1 front writes them as text after
//! the upstream's fields ([`Limits::each`]), and hyper's way puts them in the
//! header map ([`Limits::insert`], from `proxy::Answer::into_response`). Either way they
//! take the place of any field of the same name the upstream sent. (Put in
//! the map on every answer, they cost a tenth of a request's work: three
//! lookups of custom names and a value allocated for each.)

use std::sync::Arc;

use http::HeaderMap;
use http::header::{HeaderName, HeaderValue};
use smallvec::SmallVec;

use crate::ascii::eq_lower;
use crate::config::{HeaderStyle, Policy};
use crate::front::line;
use crate::limiter::Binding;

const LIMIT: HeaderName = HeaderName::from_static("x-ratelimit-limit");
const REMAINING: HeaderName = HeaderName::from_static("x-ratelimit-remaining");
const RESET: HeaderName = HeaderName::from_static("x-ratelimit-reset");
const POLICY: HeaderName = HeaderName::from_static("ratelimit-policy");
const RATELIMIT: HeaderName = HeaderName::from_static("ratelimit");
const DELAY: HeaderName = HeaderName::from_static("x-ratelimit-delay-ms");

/// The rate-limit fields of one answer, not yet written.
pub struct Limits {
    style: HeaderStyle,
    policy: Arc<Policy>,
    binding: Binding,
    /// Ms a `delay` held the request; 0 when it was not held.
    delayed_ms: u64,
}

impl Limits {
    /// `None` when the style is to show none.
    pub fn new(style: HeaderStyle, policy: &Arc<Policy>, binding: Binding) -> Option<Limits> {
        (style != HeaderStyle::None).then(|| Limits {
            style,
            policy: policy.clone(),
            binding,
            delayed_ms: 0,
        })
    }

    /// The request was held `ms` by a `gcra` limit's `delay`: said in
    /// `X-RateLimit-Delay-Ms`.
    pub fn delayed(&mut self, ms: u64) {
        self.delayed_ms = ms;
    }

    fn x_ratelimit(&self) -> bool {
        matches!(self.style, HeaderStyle::XRateLimit | HeaderStyle::Both)
    }

    fn ietf(&self) -> bool {
        matches!(self.style, HeaderStyle::Ietf | HeaderStyle::Both)
    }

    /// Whether `name` (in any case) is one of the fields these limits
    /// write: the upstream's field of that name is left out.
    pub fn writes(&self, name: &[u8]) -> bool {
        let is = |ours: &HeaderName| eq_lower(name, ours.as_str().as_bytes());
        (self.x_ratelimit() && (is(&LIMIT) || is(&REMAINING) || is(&RESET)))
            || (self.ietf() && (is(&POLICY) || is(&RATELIMIT)))
            || (self.delayed_ms > 0 && is(&DELAY))
    }

    /// Each field, in order, as its name and its value.
    pub fn each(&self, mut field: impl FnMut(&HeaderName, &[u8])) {
        let b = &self.binding;
        if self.x_ratelimit() {
            let mut digits = itoa::Buffer::new();
            field(&LIMIT, digits.format(b.limit).as_bytes());
            field(&REMAINING, digits.format(b.remaining).as_bytes());
            field(&RESET, digits.format(b.reset_ms.div_ceil(1000)).as_bytes());
        }
        self.each_ietf(&mut field);
        self.each_delay(field);
    }

    /// `X-RateLimit-Delay-Ms`, if the request was held.
    fn each_delay(&self, mut field: impl FnMut(&HeaderName, &[u8])) {
        if self.delayed_ms > 0 {
            let mut digits = itoa::Buffer::new();
            field(&DELAY, digits.format(self.delayed_ms).as_bytes());
        }
    }

    /// The IETF fields, if the style has them.
    fn each_ietf(&self, mut field: impl FnMut(&HeaderName, &[u8])) {
        let b = &self.binding;
        if self.ietf() {
            let texts = &self.policy.ietf;
            field(&POLICY, texts.list(b.index).as_bytes());
            let t = if b.retry_ms > 0 {
                retry_after(b)
            } else {
                b.reset_in_ms.div_ceil(1000)
            };
            let mut value: SmallVec<[u8; 128]> = SmallVec::new();
            let mut digits = itoa::Buffer::new();
            value.extend_from_slice(texts.name(b.index).as_bytes());
            value.extend_from_slice(b";r=");
            value.extend_from_slice(digits.format(b.remaining).as_bytes());
            value.extend_from_slice(b";t=");
            value.extend_from_slice(digits.format(t).as_bytes());
            field(&RATELIMIT, &value);
        }
    }

    /// The names of the items that refused, for a 429's `violated-policies`,
    /// when the style is the IETF one; `None` otherwise (the body stays the
    /// plain one).
    pub fn violated(&self) -> Option<Vec<String>> {
        let b = &self.binding;
        self.ietf()
            .then(|| self.policy.ietf.violated(b.refused, b.index))
    }

    /// Writes the fields as HTTP/1.1 head lines (`name: value\r\n`), as
    /// [`Limits::each`] gives them. The x-ratelimit fields' constant start
    /// (see `Policy::x_heads`) is copied in one piece: written field by
    /// field they were a sixth of what a policy adds to a request.
    pub fn write_lines(&self, out: &mut Vec<u8>) {
        let b = &self.binding;
        let head = (self.policy.limits.get(b.index))
            .filter(|l| l.limit == b.limit)
            .and_then(|_| self.policy.x_heads.get(b.index));
        match head {
            Some(head) if self.x_ratelimit() => {
                let mut digits = itoa::Buffer::new();
                let reset = b.reset_ms.div_ceil(1000);
                out.extend_from_slice(head.as_bytes());
                out.extend_from_slice(digits.format(b.remaining).as_bytes());
                out.extend_from_slice(b"\r\nx-ratelimit-reset: ");
                out.extend_from_slice(digits.format(reset).as_bytes());
                out.extend_from_slice(b"\r\n");
                self.each_ietf(|name, value| line(out, name.as_str().as_bytes(), value));
                self.each_delay(|name, value| line(out, name.as_str().as_bytes(), value));
            }
            _ => self.each(|name, value| line(out, name.as_str().as_bytes(), value)),
        }
    }

    /// Puts the fields in `headers`, in place of any of the same names.
    pub fn insert(&self, headers: &mut HeaderMap) {
        self.each(|name, value| {
            // Digits and printable ASCII (see `IetfTexts`): always valid.
            if let Ok(value) = HeaderValue::from_bytes(value) {
                headers.insert(name.clone(), value);
            }
        });
    }
}

/// A denial's `Retry-After` in whole seconds: rounded up, never 0.
pub fn retry_after(b: &Binding) -> u64 {
    b.retry_ms.div_ceil(1000).max(1)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    #[test]
    fn lines_written_in_one_piece_match_the_fields_one_by_one() {
        let text = r#"
[upstreams.api]
url = "http://127.0.0.1:1"
[policies.p]
limits = [{ limit = 5, window = "1s" }, { limit = 700, window = "1h" }]
"#;
        let config = crate::config::parse(text, "test.toml", Path::new(".")).expect("valid");
        let policy = config.policies.into_iter().next().expect("a policy");
        let styles = [
            HeaderStyle::XRateLimit,
            HeaderStyle::Ietf,
            HeaderStyle::Both,
        ];
        for (style, index) in styles.into_iter().flat_map(|s| [(s, 0), (s, 1)]) {
            let binding = Binding {
                limit: policy.limits[index].limit,
                window_ms: 1_000,
                remaining: 42,
                reset_ms: 1_700_000_000_001,
                reset_in_ms: 999,
                retry_ms: 0,
                index,
                refused: 0,
            };
            let limits = Limits::new(style, &policy, binding).expect("a style with fields");
            let mut fast = Vec::new();
            limits.write_lines(&mut fast);
            let mut slow = Vec::new();
            limits.each(|name, value| line(&mut slow, name.as_str().as_bytes(), value));
            assert_eq!(
                String::from_utf8_lossy(&fast),
                String::from_utf8_lossy(&slow),
                "{style:?}, limit {index}"
            );
            let limit_line = format!("x-ratelimit-limit: {}\r\n", binding.limit);
            let has_x = style != HeaderStyle::Ietf;
            assert_eq!(String::from_utf8_lossy(&fast).contains(&limit_line), has_x);
        }
    }

    fn fields(limits: &Limits) -> Vec<(String, String)> {
        let mut all = Vec::new();
        limits.each(|name, value| {
            all.push((
                name.to_string(),
                String::from_utf8_lossy(value).into_owned(),
            ))
        });
        all
    }

    #[test]
    fn a_denials_effective_window_is_its_retry_after() {
        let text = r#"
[upstreams.api]
url = "http://127.0.0.1:1"
[policies.p]
limits = [{ limit = 2, window = "10s", algorithm = "gcra", burst = 2 }]
"#;
        let config = crate::config::parse(text, "test.toml", Path::new(".")).expect("valid");
        let policy = config.policies.into_iter().next().expect("a policy");
        // A gcra denial: the bucket empties in 10 s, one more request
        // passes in 5 s.
        let binding = Binding {
            limit: 2,
            window_ms: 10_000,
            remaining: 0,
            reset_ms: 1_700_000_010_000,
            reset_in_ms: 10_000,
            retry_ms: 4_200,
            index: 0,
            refused: 1,
        };
        let limits = Limits::new(HeaderStyle::Ietf, &policy, binding).expect("fields");
        assert_eq!(retry_after(&binding), 5);
        assert_eq!(
            fields(&limits),
            [
                ("ratelimit-policy".into(), r#""p-10s";q=2;w=10"#.into()),
                ("ratelimit".into(), r#""p-10s";r=0;t=5"#.into()),
            ]
        );
        assert_eq!(limits.violated(), Some(vec!["p-10s".to_string()]));
        let plain = Limits::new(HeaderStyle::XRateLimit, &policy, binding).expect("fields");
        assert_eq!(plain.violated(), None);
    }

    #[test]
    fn a_plan_without_limits_gets_well_formed_fields() {
        let text = r#"
[upstreams.api]
url = "http://127.0.0.1:1"
[policies.p]
limits = [{ limit = 5, window = "1s" }]
"#;
        let config = crate::config::parse(text, "test.toml", Path::new(".")).expect("valid");
        let own = &config.policies[0];
        // A plan with `limits = []`, as the limiter answers it: nothing
        // counted, so the binding is the limiter's empty one.
        let blocked = Arc::new(own.variant("blocked", Vec::new()));
        let binding = Binding {
            limit: 0,
            window_ms: 0,
            remaining: 0,
            reset_ms: 1_700_000_000_000,
            reset_in_ms: 0,
            retry_ms: 60_000,
            index: 0,
            refused: 0,
        };
        let limits = Limits::new(HeaderStyle::Both, &blocked, binding).expect("fields");
        assert_eq!(
            fields(&limits),
            [
                ("x-ratelimit-limit".into(), "0".into()),
                ("x-ratelimit-remaining".into(), "0".into()),
                ("x-ratelimit-reset".into(), "1700000000".into()),
                ("ratelimit-policy".into(), r#""p-blocked";q=0"#.into()),
                ("ratelimit".into(), r#""p-blocked";r=0;t=60"#.into()),
            ]
        );
        let mut fast = Vec::new();
        limits.write_lines(&mut fast);
        let mut slow = Vec::new();
        limits.each(|name, value| line(&mut slow, name.as_str().as_bytes(), value));
        assert_eq!(fast, slow);
        assert_eq!(limits.violated(), Some(vec!["p-blocked".to_string()]));
    }
}
