//! The rate-limit headers a client sees, in the configured style.
//!
//! - `x-ratelimit`: `X-RateLimit-Limit`, `-Remaining`, `-Reset` (unix seconds).
//! - `ietf`: draft-ietf-httpapi-ratelimit-headers-10: `RateLimit-Policy` lists
//!   every limit of the policy as `"name";q=LIMIT;w=WINDOW_SECONDS`, and
//!   `RateLimit` gives the binding one as `"name";r=REMAINING;t=SECONDS_TO_RESET`.
//!
//! Resets are rounded up to whole seconds: a fixed window of a second or more
//! ends on a whole second, so every response of one window shows the same value.
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
use crate::limiter::Binding;

const LIMIT: HeaderName = HeaderName::from_static("x-ratelimit-limit");
const REMAINING: HeaderName = HeaderName::from_static("x-ratelimit-remaining");
const RESET: HeaderName = HeaderName::from_static("x-ratelimit-reset");
const POLICY: HeaderName = HeaderName::from_static("ratelimit-policy");
const RATELIMIT: HeaderName = HeaderName::from_static("ratelimit");

/// The rate-limit fields of one answer, not yet written.
pub struct Limits {
    style: HeaderStyle,
    policy: Arc<Policy>,
    binding: Binding,
}

impl Limits {
    /// `None` when the style is to show none.
    pub fn new(style: HeaderStyle, policy: &Arc<Policy>, binding: Binding) -> Option<Limits> {
        (style != HeaderStyle::None).then(|| Limits {
            style,
            policy: policy.clone(),
            binding,
        })
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
        if self.ietf() {
            let texts = &self.policy.ietf;
            field(&POLICY, texts.lists[b.index].as_bytes());
            let t = b.reset_in_ms.div_ceil(1000);
            let t = if b.retry_ms > 0 {
                t.max(b.retry_ms.div_ceil(1000)).max(1)
            } else {
                t
            };
            let mut value: SmallVec<[u8; 128]> = SmallVec::new();
            let mut digits = itoa::Buffer::new();
            value.extend_from_slice(texts.names[b.index].as_bytes());
            value.extend_from_slice(b";r=");
            value.extend_from_slice(digits.format(b.remaining).as_bytes());
            value.extend_from_slice(b";t=");
            value.extend_from_slice(digits.format(t).as_bytes());
            field(&RATELIMIT, &value);
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
