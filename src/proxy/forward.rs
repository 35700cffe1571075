//! Forwarding: rewriting a client request for the upstream and the upstream's
//! response for the client.
//!
//! Hop-by-hop headers (RFC 9110 §7.6.1, and any named in `Connection`) are
//! dropped both ways; `X-Forwarded-For` gets the peer appended,
//! `X-Forwarded-Proto` and `X-Forwarded-Host` are set. The upstream sees its own
//! authority in `Host` (as nginx's `proxy_pass` does) unless the upstream sets
//! `pass_host = true`.

use std::net::IpAddr;
use std::sync::atomic::Ordering;

use bytes::Bytes;
use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::uri::{PathAndQuery, Uri};
use http::{Request, Version};

use crate::config::{Upstream, UpstreamServer};
use crate::proxy::RequestBody;

const X_FORWARDED_FOR: HeaderName = HeaderName::from_static("x-forwarded-for");
const X_FORWARDED_HOST: HeaderName = HeaderName::from_static("x-forwarded-host");
const X_FORWARDED_PROTO: HeaderName = HeaderName::from_static("x-forwarded-proto");

/// Hop-by-hop headers (RFC 9110 §7.6.1), and `Upgrade`, which is re-added
/// for an upgrade only. `Trailer` is not one (RFC 2616 listed it; RFC 7230
/// and 9110 do not): it declares the trailer fields, and hyper sends an
/// HTTP/1.1 client only the trailers it declares.
static HOP_BY_HOP: [HeaderName; 8] = [
    header::CONNECTION,
    HeaderName::from_static("keep-alive"),
    HeaderName::from_static("proxy-connection"),
    header::PROXY_AUTHENTICATE,
    header::PROXY_AUTHORIZATION,
    header::TE,
    header::TRANSFER_ENCODING,
    header::UPGRADE,
];

/// The position of `name` in [`HOP_BY_HOP`], compared without case.
fn hop_index(name: &str) -> Option<usize> {
    HOP_BY_HOP
        .iter()
        .position(|h| h.as_str().eq_ignore_ascii_case(name))
}

/// The position of `name` in [`HOP_BY_HOP`]. By length first: every header
/// of every request and response is looked at, and most share no length with
/// a hop-by-hop one (comparing each with all eight cost about 700
/// instructions a proxied request).
fn hop_position(name: &HeaderName) -> Option<usize> {
    let name = name.as_str();
    let i = match name.len() {
        10 if name == "connection" => 0,
        10 => 1,
        16 => 2,
        18 => 3,
        19 => 4,
        2 => 5,
        17 => 6,
        7 => 7,
        _ => return None,
    };
    // Header names are lowercase once parsed.
    (HOP_BY_HOP[i].as_str() == name).then_some(i)
}

/// Removes hop-by-hop headers, including those `Connection` names.
pub fn strip_hop_by_hop(headers: &mut HeaderMap) {
    // One look at each header says which are there: usually none in a
    // request, and `Connection: keep-alive` alone in a response.
    let mut present = 0u16;
    for name in headers.keys() {
        if let Some(i) = hop_position(name) {
            present |= 1 << i;
        }
    }
    if present == 0 {
        return;
    }
    // `Connection: keep-alive` or `close`, the usual values, name no header.
    let usual = |v: &HeaderValue| {
        let v = v.as_bytes();
        v.eq_ignore_ascii_case(b"keep-alive") || v.eq_ignore_ascii_case(b"close")
    };
    if present & 1 != 0 && !headers.get_all(header::CONNECTION).iter().all(usual) {
        // Names `Connection` lists besides the standard ones (and `close`).
        let named: Vec<HeaderName> = headers
            .get_all(header::CONNECTION)
            .iter()
            .filter_map(|v| v.to_str().ok())
            .flat_map(|v| v.split(','))
            .map(str::trim)
            .filter(|t| hop_index(t).is_none() && !t.eq_ignore_ascii_case("close"))
            .filter_map(|t| HeaderName::from_bytes(t.as_bytes()).ok())
            .collect();
        for name in named {
            headers.remove(name);
        }
    }
    for (i, name) in HOP_BY_HOP.iter().enumerate() {
        if present & 1 << i != 0 {
            headers.remove(name);
        }
    }
}

/// How long a server that refused a connection is skipped.
pub const DOWN_FOR_MS: u64 = 10_000;

/// The next server of an upstream, round robin, skipping servers marked down
/// (unless all are: then the turn's server is tried anyway).
pub fn pick(upstream: &Upstream) -> usize {
    let n = upstream.servers.len();
    if n == 1 {
        return 0;
    }
    let now_ms = crate::clock::wall_ms();
    let start = upstream.next.fetch_add(1, Ordering::Relaxed);
    (0..n)
        .map(|k| (start + k) % n)
        .find(|&i| upstream.down_until[i].load(Ordering::Relaxed) <= now_ms)
        .unwrap_or(start % n)
}

/// Passive health: a server that refused a connection is skipped for a while.
pub fn mark_down(upstream: &Upstream, i: usize) {
    let now_ms = crate::clock::wall_ms();
    upstream.down_until[i].store(now_ms + DOWN_FOR_MS, Ordering::Relaxed);
}

/// The protocol a request asks to switch to (`Connection: upgrade` with an
/// `Upgrade` header, e.g. WebSocket), if any.
pub fn upgrade_protocol(headers: &HeaderMap) -> Option<HeaderValue> {
    let asks = headers
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .any(|t| t.trim().eq_ignore_ascii_case("upgrade"));
    asks.then(|| headers.get(header::UPGRADE).cloned())
        .flatten()
}

/// Turns the client's request into the upstream's, in place of its parts.
pub fn rewrite_request(
    req: Request<RequestBody>,
    upstream: &Upstream,
    server: &UpstreamServer,
    peer: IpAddr,
    host: Option<&HeaderValue>,
    https: bool,
    upgrade: Option<&HeaderValue>,
) -> Result<Request<RequestBody>, &'static str> {
    let (mut parts, body) = req.into_parts();
    // Origin form (`/path?query`): the upstream learns its authority from Host.
    // HTTP/1 requests usually come in it, and are kept as parsed.
    let origin_form = parts.uri.scheme().is_none() && parts.uri.authority().is_none();
    if !(origin_form && server.base_path.is_empty()) {
        let pq = parts.uri.path_and_query().map_or("/", PathAndQuery::as_str);
        let pq = if server.base_path.is_empty() {
            PathAndQuery::try_from(pq)
        } else {
            PathAndQuery::try_from(format!("{}{}", server.base_path, pq))
        }
        .map_err(|_| "bad request target")?;
        parts.uri = Uri::from(pq);
    }
    parts.version = Version::HTTP_11;

    let headers = &mut parts.headers;
    strip_hop_by_hop(headers);
    if let Some(protocol) = upgrade {
        headers.insert(header::CONNECTION, HeaderValue::from_static("upgrade"));
        headers.insert(header::UPGRADE, protocol.clone());
    }
    if let Some(host) = host {
        headers.insert(X_FORWARDED_HOST, host.clone());
    }
    // Every prior line, in order, then the peer.
    let mut forwarded_for = Vec::with_capacity(16);
    for prior in headers.get_all(&X_FORWARDED_FOR) {
        if prior.to_str().is_ok() {
            forwarded_for.extend_from_slice(prior.as_bytes());
            forwarded_for.extend_from_slice(b", ");
        }
    }
    crate::identity::push_ip_text(&mut forwarded_for, peer.to_canonical());
    if let Ok(v) = HeaderValue::from_maybe_shared(Bytes::from(forwarded_for)) {
        headers.insert(X_FORWARDED_FOR, v);
    }
    headers.insert(
        X_FORWARDED_PROTO,
        HeaderValue::from_static(if https { "https" } else { "http" }),
    );
    match (upstream.pass_host, host) {
        (true, Some(host)) => {
            headers.insert(header::HOST, host.clone());
        }
        _ => {
            headers.insert(header::HOST, server.host.clone());
        }
    }
    Ok(Request::from_parts(parts, body))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hop_by_hop_headers_go_and_others_stay() {
        let mut h = HeaderMap::new();
        h.insert(
            header::CONNECTION,
            HeaderValue::from_static("X-Secret, CLOSE, Keep-Alive"),
        );
        h.insert("x-secret", HeaderValue::from_static("1"));
        h.insert("keep-alive", HeaderValue::from_static("timeout=5"));
        h.insert(
            header::TRANSFER_ENCODING,
            HeaderValue::from_static("chunked"),
        );
        h.insert(header::UPGRADE, HeaderValue::from_static("websocket"));
        h.insert("x-kept", HeaderValue::from_static("1"));
        strip_hop_by_hop(&mut h);
        assert_eq!(h.len(), 1, "{h:?}");
        assert!(h.contains_key("x-kept"));

        // The usual response: `Connection` names nothing else, and goes.
        let mut usual = HeaderMap::new();
        usual.insert(header::CONNECTION, HeaderValue::from_static("Keep-Alive"));
        usual.insert("keep-alive", HeaderValue::from_static("timeout=5"));
        usual.insert("x-kept", HeaderValue::from_static("1"));
        strip_hop_by_hop(&mut usual);
        assert_eq!(usual.len(), 1, "{usual:?}");
        assert!(usual.contains_key("x-kept"));

        // Each hop-by-hop name is found by its own position, and names of
        // the same lengths are not mistaken for them.
        for (i, name) in HOP_BY_HOP.iter().enumerate() {
            assert_eq!(hop_position(name), Some(i));
        }
        for other in ["connections", "x-te", "te-x", "upgrades", "x-connection"] {
            let other = HeaderName::from_bytes(other.as_bytes()).unwrap();
            assert_eq!(hop_position(&other), None, "{other}");
        }
        let lookalike = HeaderName::from_static("keep-alivx");
        assert_eq!(hop_position(&lookalike), None);

        // Nothing to remove: nothing changes.
        let mut plain = HeaderMap::new();
        plain.insert("x-kept", HeaderValue::from_static("1"));
        strip_hop_by_hop(&mut plain);
        assert_eq!(plain.len(), 1);
    }
}
