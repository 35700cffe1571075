//! The answers sluice gives itself: each error knows its status and writes an
//! RFC 9457 `application/problem+json` body.

use bytes::Bytes;
use http::header::{CONNECTION, CONTENT_TYPE, HeaderValue, RETRY_AFTER};
use http::{Response, StatusCode};

use super::Body;

/// The problem type of draft-ietf-httpapi-ratelimit-headers-11, section 5.1
/// (registered in its section 10.2.1 with the title "Quota Exceeded").
pub const QUOTA_EXCEEDED: &str = "https://iana.org/assignments/http-problem-types#quota-exceeded";

#[derive(Debug, thiserror::Error)]
pub enum ProxyError {
    #[error("no route matches this request")]
    NoRoute,
    #[error("malformed request: {0}")]
    BadRequest(&'static str),
    /// A well-formed request spelled in a way sluice does not route: the
    /// connection's framing is intact.
    #[error("refused: {0}")]
    Refused(#[from] crate::router::Refused),
    /// More distinct values for one rate-limit key than are counted (see
    /// `identity::MAX_VALUES`): well-formed, so the connection stays.
    #[error("refused: more than 16 distinct values for a rate-limit key")]
    TooManyValues,
    /// The values of a policy's `plan_key` are on different plans.
    #[error("refused: the request names identities on different plans")]
    MixedPlans,
    #[error("request headers are larger than {0} bytes")]
    HeadersTooLarge(usize),
    /// `violated`: with the IETF header style, the names of the
    /// `RateLimit-Policy` items that refused; the body is then the draft's
    /// `quota-exceeded` problem (see [`QUOTA_EXCEEDED`]).
    #[error("rate limit exceeded; retry in {retry_after} s")]
    Limited {
        retry_after: u64,
        violated: Option<Vec<String>>,
    },
    #[error("the rate-limit store is unavailable")]
    StoreUnavailable,
    #[error("the upstream could not be reached")]
    UpstreamUnreachable,
    #[error("the upstream did not answer within {0} ms")]
    UpstreamTimeout(u128),
    /// `server.max_upstream_per_client` exchanges of this client in flight.
    #[error("this client has {0} requests upstream already; retry when one has ended")]
    ClientBusy(usize),
    /// `server.client_body_timeout`: the client sent no body bytes that long.
    #[error("the request body did not arrive: no bytes for {0} ms")]
    BodyTimeout(u128),
    /// A request that ended without an answer: a defect in sluice, never
    /// expected (see `Proxy::handle`).
    #[error("the request ended without an answer")]
    Unanswered,
}

impl ProxyError {
    pub fn status(&self) -> StatusCode {
        match self {
            ProxyError::NoRoute => StatusCode::NOT_FOUND,
            ProxyError::BadRequest(_)
            | ProxyError::Refused(_)
            | ProxyError::TooManyValues
            | ProxyError::MixedPlans => StatusCode::BAD_REQUEST,
            ProxyError::HeadersTooLarge(_) => StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE,
            ProxyError::Limited { .. } => StatusCode::TOO_MANY_REQUESTS,
            ProxyError::StoreUnavailable => StatusCode::SERVICE_UNAVAILABLE,
            ProxyError::UpstreamUnreachable => StatusCode::BAD_GATEWAY,
            ProxyError::UpstreamTimeout(_) => StatusCode::GATEWAY_TIMEOUT,
            ProxyError::ClientBusy(_) => StatusCode::SERVICE_UNAVAILABLE,
            ProxyError::BodyTimeout(_) => StatusCode::REQUEST_TIMEOUT,
            ProxyError::Unanswered => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    /// True for the errors that mean the upstream never served the request
    /// (its reservation is given back).
    pub fn is_upstream_failure(&self) -> bool {
        matches!(
            self,
            ProxyError::UpstreamUnreachable
                | ProxyError::UpstreamTimeout(_)
                | ProxyError::ClientBusy(_)
        )
    }

    /// The problem+json response for this error.
    pub fn response(&self) -> Response<Body> {
        let status = self.status();
        let body = match self {
            ProxyError::Limited {
                violated: Some(violated),
                ..
            } => serde_json::json!({
                "type": QUOTA_EXCEEDED,
                "title": "Quota Exceeded",
                "status": status.as_u16(),
                "detail": self.to_string(),
                "violated-policies": violated,
            }),
            _ => serde_json::json!({
                "type": "about:blank",
                "title": status.canonical_reason().unwrap_or("Error"),
                "status": status.as_u16(),
                "detail": self.to_string(),
            }),
        };
        let mut resp = Response::new(Body::Right(http_body_util::Full::new(Bytes::from(
            body.to_string(),
        ))));
        *resp.status_mut() = status;
        let headers = resp.headers_mut();
        headers.insert(
            CONTENT_TYPE,
            HeaderValue::from_static("application/problem+json"),
        );
        match self {
            ProxyError::Limited { retry_after, .. } => {
                headers.insert(RETRY_AFTER, HeaderValue::from(*retry_after));
            }
            ProxyError::StoreUnavailable | ProxyError::ClientBusy(_) => {
                headers.insert(RETRY_AFTER, HeaderValue::from_static("1"));
            }
            // After a malformed request the connection's framing cannot be
            // trusted; after a stalled body, the rest of it may still come.
            ProxyError::BadRequest(_) | ProxyError::BodyTimeout(_) => {
                headers.insert(CONNECTION, HeaderValue::from_static("close"));
            }
            _ => {}
        }
        resp
    }
}
