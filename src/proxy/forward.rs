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
use smallvec::SmallVec;

use crate::ascii::eq_lower;
use crate::config::{Upstream, UpstreamServer};
use crate::fields::Fields;
use crate::front::line;
use crate::proxy::RequestBody;
use crate::proxy::h1::HeadBuf;

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
    hop_position_of(name.as_str().as_bytes())
}

/// [`hop_position`] of a name as read, in any case.
fn hop_position_of(name: &[u8]) -> Option<usize> {
    let i = match name.len() {
        10 if eq_lower(name, b"connection") => return Some(0),
        10 => 1,
        16 => 2,
        18 => 3,
        19 => 4,
        2 => 5,
        17 => 6,
        7 => 7,
        _ => return None,
    };
    eq_lower(name, HOP_BY_HOP[i].as_str().as_bytes()).then_some(i)
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
    if present & 1 != 0 {
        for name in connection_named(Fields::Map(headers)) {
            headers.remove(name);
        }
    }
    for (i, name) in HOP_BY_HOP.iter().enumerate() {
        if present & 1 << i != 0 {
            headers.remove(name);
        }
    }
}

/// The headers `Connection` names besides the hop-by-hop ones (and `close`):
/// they are hop-by-hop too. Usually none (`keep-alive`, `close`), and then
/// nothing is allocated.
fn connection_named(fields: Fields<'_>) -> Vec<HeaderName> {
    if fields.values(&header::CONNECTION).all(names_none) {
        return Vec::new();
    }
    fields
        .values(&header::CONNECTION)
        .filter_map(crate::fields::text)
        .flat_map(|v| v.split(','))
        .map(str::trim)
        .filter(|t| hop_index(t).is_none() && !t.eq_ignore_ascii_case("close"))
        .filter_map(|t| HeaderName::from_bytes(t.as_bytes()).ok())
        .collect()
}

/// `Connection: keep-alive` or `close`, the usual values, name no field.
pub(super) fn names_none(connection: &[u8]) -> bool {
    eq_lower(connection, b"keep-alive") || eq_lower(connection, b"close")
}

/// Whether a field read from an upstream need not be kept at all: it is
/// hop-by-hop, and names no other field that [`strip_hop_by_hop`] would
/// have to remove with it. `name` as read, in any case.
pub(super) fn lone_hop(name: &[u8], value: &[u8]) -> bool {
    match hop_position_of(name) {
        None => false,
        Some(0) => names_none(value),
        Some(_) => true,
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

/// The protocols a request asks to switch to (`Connection: upgrade` with an
/// `Upgrade` header, e.g. WebSocket) that `allowed` (a route's `upgrades`,
/// lowercase names) lets through, if any: the `Upgrade` value to forward.
/// A token is compared by its name (`websocket` in `websocket/13`); `h2c`
/// never passes, whatever the list says: requests inside its tunnel would
/// meet no route and no policy.
pub fn upgrade_protocol(fields: Fields<'_>, allowed: &[String]) -> Option<HeaderValue> {
    let asks = fields
        .values(&header::CONNECTION)
        .filter_map(crate::fields::text)
        .flat_map(|v| v.split(','))
        .any(|t| t.trim().eq_ignore_ascii_case("upgrade"));
    if !asks {
        return None;
    }
    let offered: Vec<&str> = fields
        .values(&header::UPGRADE)
        .filter_map(crate::fields::text)
        .flat_map(|v| v.split(','))
        .map(str::trim)
        .filter(|t| !t.is_empty())
        .collect();
    let passes = |token: &&str| {
        let name = token.split('/').next().unwrap_or_default().trim();
        !name.eq_ignore_ascii_case("h2c") && allowed.iter().any(|a| name.eq_ignore_ascii_case(a))
    };
    let kept: Vec<&str> = offered.iter().copied().filter(passes).collect();
    if kept.is_empty() {
        return None;
    }
    HeaderValue::from_str(&kept.join(", ")).ok()
}

/// The upstream's request target when it is not the client's as it came:
/// `None` for the usual origin form (`/path?query`, from which the upstream
/// learns its authority from Host) with no `base_path` to put before it.
fn upstream_target(
    uri: &Uri,
    server: &UpstreamServer,
) -> Result<Option<PathAndQuery>, &'static str> {
    let origin_form = uri.scheme().is_none() && uri.authority().is_none();
    if origin_form && server.base_path.is_empty() {
        return Ok(None);
    }
    let pq = uri.path_and_query().map_or("/", PathAndQuery::as_str);
    if server.base_path.is_empty() {
        PathAndQuery::try_from(pq)
    } else {
        PathAndQuery::try_from(format!("{}{}", server.base_path, pq))
    }
    .map(Some)
    .map_err(|_| "bad request target")
}

/// The upstream's request head as HTTP/1.1 bytes, written straight from the
/// client's request: the same request [`rewrite_request`] makes (less an
/// upgrade, which goes through hyper), for sluice's own upstream client.
/// Writing it directly skips changing the header map (four insertions, a
/// removal or two) and then reading it again: about 2,000 instructions of a
/// proxied `GET`. `Host` comes first; the `X-Forwarded-*` headers after the
/// client's.
pub fn upstream_head(
    req: &Request<RequestBody>,
    fields: Fields<'_>,
    upstream: &Upstream,
    server: &UpstreamServer,
    peer: IpAddr,
    host: Option<&HeaderValue>,
    https: bool,
) -> Result<HeadBuf, &'static str> {
    let uri = req.uri();
    // Without a base path the client's path is written as it came, in
    // whatever form its target had (an HTTP/2 request's is absolute).
    let target = if server.base_path.is_empty() {
        None
    } else {
        upstream_target(uri, server)?
    };
    let pq = match &target {
        Some(pq) => pq.as_str(),
        None => uri.path_and_query().map_or("/", PathAndQuery::as_str),
    };
    let size: usize = fields.iter().map(|(k, v)| k.len() + v.len() + 4).sum();
    // The line, the client's fields, the four set here (at most a host and
    // an address each, with their names), the blank line.
    let mut head = HeadBuf::with_capacity(req.method().as_str().len() + pq.len() + 13 + size + 160);
    head.extend_from_slice(req.method().as_str().as_bytes());
    head.push(b' ');
    head.extend_from_slice(pq.as_bytes());
    head.extend_from_slice(b" HTTP/1.1\r\n");
    // Host first, where servers (and people reading dumps) look for it.
    let host_value = match (upstream.pass_host, host) {
        (true, Some(host)) => host,
        _ => &server.host,
    };
    line(&mut head, b"host", host_value.as_bytes());

    // A scan of the names is cheaper than looking `Connection` up.
    let named = if fields.iter().any(|(n, _)| eq_lower(n, b"connection")) {
        connection_named(fields)
    } else {
        Vec::new()
    };
    // A body read whole goes behind the head (see `RequestBody::Read`): its
    // length is said here, in place of the client's field, which the
    // client's `Connection` might have named.
    let read = match req.body() {
        RequestBody::Read(data) => Some(data.len()),
        _ => None,
    };
    let mut prior_for: SmallVec<[&[u8]; 2]> = SmallVec::new();
    for (name, value) in fields.iter() {
        if hop_position_of(name).is_some()
            || eq_lower(name, b"host")
            || named.iter().any(|n| eq_lower(name, n.as_str().as_bytes()))
            || (read.is_some() && eq_lower(name, b"content-length"))
        {
            continue;
        }
        if eq_lower(name, X_FORWARDED_FOR.as_str().as_bytes()) {
            if crate::fields::text(value).is_some() {
                prior_for.push(value);
            }
            continue;
        }
        if eq_lower(name, X_FORWARDED_PROTO.as_str().as_bytes())
            || (host.is_some() && eq_lower(name, X_FORWARDED_HOST.as_str().as_bytes()))
        {
            continue;
        }
        line(&mut head, name, value);
    }
    // Every prior line, in order, then the peer.
    head.extend_from_slice(b"x-forwarded-for: ");
    for prior in prior_for {
        head.extend_from_slice(prior);
        head.extend_from_slice(b", ");
    }
    crate::identity::push_ip_text(&mut head, peer.to_canonical());
    head.extend_from_slice(b"\r\n");
    let proto: &[u8] = if https { b"https" } else { b"http" };
    line(&mut head, b"x-forwarded-proto", proto);
    if let Some(host) = host {
        line(&mut head, b"x-forwarded-host", host.as_bytes());
    }
    if let Some(len) = read {
        use std::io::Write as _;
        let _ = write!(&mut *head, "content-length: {len}\r\n");
    }
    head.extend_from_slice(b"\r\n");
    Ok(head)
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
    if let Some(pq) = upstream_target(&parts.uri, server)? {
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
    use crate::fields::HeadFields;

    fn upstream(pass_host: bool, base_path: &str) -> Upstream {
        Upstream {
            name: "api".into(),
            servers: vec![UpstreamServer {
                scheme: http::uri::Scheme::HTTP,
                authority: http::uri::Authority::from_static("10.0.0.9:8080"),
                base_path: base_path.to_string(),
                host: HeaderValue::from_static("10.0.0.9:8080"),
                keepalive: Default::default(),
            }],
            ca: None,
            pass_host,
            buffer: 0,
            next: Default::default(),
            down_until: vec![Default::default()],
        }
    }

    /// A head as (request line, each name's values in order), to compare
    /// heads whose fields of different names come in different orders.
    fn fields(head: &[u8]) -> (String, std::collections::BTreeMap<String, Vec<String>>) {
        let text = std::str::from_utf8(head).unwrap();
        let body_at = text.find("\r\n\r\n").expect("a whole head");
        assert_eq!(body_at + 4, text.len(), "nothing after the head");
        let mut lines = text[..body_at].split("\r\n");
        let line = lines.next().unwrap().to_string();
        let mut map = std::collections::BTreeMap::<String, Vec<String>>::new();
        for l in lines {
            let (name, value) = l.split_once(": ").unwrap();
            map.entry(name.to_string())
                .or_default()
                .push(value.to_string());
        }
        (line, map)
    }

    /// The same request as the head `rewrite_request` leads to.
    fn rewritten_head(req: &Request<RequestBody>) -> Vec<u8> {
        let mut head = format!(
            "{} {} HTTP/1.1\r\n",
            req.method(),
            req.uri().path_and_query().map_or("/", |p| p.as_str())
        )
        .into_bytes();
        for (name, value) in req.headers() {
            line(&mut head, name.as_str().as_bytes(), value.as_bytes());
        }
        head.extend_from_slice(b"\r\n");
        head
    }

    /// The head written for the own client and the request rewritten for
    /// hyper's say the same: they are two ways to one request.
    #[test]
    fn the_written_head_says_what_the_rewritten_request_says() {
        let peer: IpAddr = "192.0.2.7".parse().unwrap();
        // (target, headers, pass_host, base_path)
        type Case<'a> = (&'a str, &'a [(&'a str, &'a str)], bool, &'a str);
        let cases: &[Case] = &[
            ("/", &[("host", "api.example")], false, ""),
            (
                "/a?b=1",
                &[("host", "api.example"), ("accept", "*/*")],
                true,
                "",
            ),
            ("/a?b=1", &[("host", "api.example")], false, "/v2"),
            ("http://api.example/x", &[], false, ""),
            (
                "/hops",
                &[
                    ("host", "api.example"),
                    ("connection", "keep-alive, X-Secret"),
                    ("x-secret", "1"),
                    ("keep-alive", "timeout=5"),
                    ("proxy-authorization", "Basic x"),
                    ("x-kept", "a"),
                    ("x-kept", "b"),
                ],
                false,
                "",
            ),
            (
                "/fwd",
                &[
                    ("host", "api.example"),
                    ("x-forwarded-for", "198.51.100.1"),
                    ("x-forwarded-for", "198.51.100.2, 198.51.100.3"),
                    ("x-forwarded-proto", "https"),
                    ("x-forwarded-host", "spoofed.example"),
                ],
                true,
                "",
            ),
            // A Connection that names a header sluice sets itself.
            (
                "/named",
                &[
                    ("host", "api.example"),
                    ("connection", "x-forwarded-for"),
                    ("x-forwarded-for", "198.51.100.1"),
                ],
                false,
                "",
            ),
            // No Host at all: an HTTP/1.0 request in origin form.
            ("/old", &[("x-forwarded-host", "kept.example")], false, ""),
        ];
        for &(target, headers, pass_host, base_path) in cases {
            let up = upstream(pass_host, base_path);
            let server = &up.servers[0];
            let mut req = Request::new(RequestBody::Empty);
            *req.uri_mut() = target.parse().unwrap();
            for &(name, value) in headers {
                req.headers_mut().append(
                    HeaderName::from_static(name),
                    HeaderValue::from_static(value),
                );
            }
            let host = req.headers().get(header::HOST).cloned().or_else(|| {
                req.uri()
                    .authority()
                    .map(|a| HeaderValue::from_str(a.as_str()).unwrap())
            });
            // The front's reading of the same fields (no map).
            let head = HeadFields::of_lines(headers);
            for https in [false, true] {
                let write = |fields| {
                    upstream_head(&req, fields, &up, server, peer, host.as_ref(), https).unwrap()
                };
                let written = write(Fields::Map(req.headers()));
                let from_head = write(Fields::Head(&head));
                assert_eq!(&written[..], &from_head[..], "{target} {headers:?}");
                let mut copy = Request::new(RequestBody::Empty);
                *copy.uri_mut() = req.uri().clone();
                *copy.headers_mut() = req.headers().clone();
                let rewritten =
                    rewrite_request(copy, &up, server, peer, host.as_ref(), https, None).unwrap();
                assert_eq!(
                    fields(&written),
                    fields(&rewritten_head(&rewritten)),
                    "{target} {headers:?}"
                );
            }
        }

        // Spot checks of what both say.
        let up = upstream(false, "/v2");
        let mut req = Request::new(RequestBody::Empty);
        *req.uri_mut() = "/a?b=1".parse().unwrap();
        req.headers_mut()
            .append("x-forwarded-for", HeaderValue::from_static("198.51.100.1"));
        req.headers_mut()
            .append("connection", HeaderValue::from_static("close"));
        let host = HeaderValue::from_static("api.example");
        let head = upstream_head(
            &req,
            Fields::Map(req.headers()),
            &up,
            &up.servers[0],
            peer,
            Some(&host),
            false,
        )
        .unwrap();
        assert!(head.starts_with(b"GET /v2/a?b=1 HTTP/1.1\r\nhost: 10.0.0.9:8080\r\n"));
        let (line, map) = fields(&head);
        assert_eq!(line, "GET /v2/a?b=1 HTTP/1.1");
        assert_eq!(map["host"], ["10.0.0.9:8080"]);
        assert_eq!(map["x-forwarded-for"], ["198.51.100.1, 192.0.2.7"]);
        assert_eq!(map["x-forwarded-host"], ["api.example"]);
        assert_eq!(map["x-forwarded-proto"], ["http"]);
        assert!(!map.contains_key("connection"));
    }

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
