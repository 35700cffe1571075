//! Route matching: which `[[routes]]` entry a request belongs to, and the
//! normal forms of the path and host it is matched (and forwarded) by.
//!
//! The most specific route wins: a host match over none, then an exact path over a
//! prefix, then a longer prefix over a shorter one; ties go to the earlier route.
//! Routes are sorted once by that order, so matching is a scan that stops at the
//! first hit. Prefixes are plain string prefixes (as in nginx and Envoy): write
//! `"/api/"` to keep `/apiary` out of `"/api"`.
//!
//! Paths are compared in a normal form (see [`normalize`]), on both sides, and
//! the request goes upstream in that form: a client cannot step around a route,
//! and its policy, by spelling a path another way that the upstream would read
//! as the same (`/api/%73earch`, `/api//search`, `/x/../api/search`,
//! `/api;x/search`, `/x/..%2Fapi/search`). Spellings no normal form can make
//! safe (an encoded slash under `escaped_slashes = "reject"`, a bad escape,
//! an escape of NUL or of bytes that are not UTF-8) are refused. Hosts are
//! compared lowercased, without a trailing dot, their port checked (see
//! [`normalize_host`]).

use std::borrow::Cow;
use std::net::Ipv6Addr;

use http::Method;

use crate::config::{EscapedSlashes, PathMatch, Route};

/// Why a request's method, path or host is refused (400): a spelling that
/// sluice and an upstream could read as different things.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum Refused {
    #[error("a method with lowercase letters")]
    LowercaseMethod,
    #[error("an encoded slash or backslash (%2F, %5C) or a backslash in the path")]
    EscapedSlash,
    #[error("a '%' in the path that starts no escape")]
    BadEscape,
    #[error("an escape in the path that decodes to bytes that are not UTF-8")]
    NotUtf8,
    #[error("an escaped NUL (%00) in the path")]
    Nul,
    #[error("a malformed Host: {0}")]
    Host(&'static str),
}

/// Refuses a method with lowercase letters, as nginx does: `post` is not
/// `POST` to a route's `methods`, but some servers treat it as one.
pub fn check_method(method: &Method) -> Result<(), Refused> {
    if method.as_str().bytes().any(|b| b.is_ascii_lowercase()) {
        return Err(Refused::LowercaseMethod);
    }
    Ok(())
}

pub struct Router {
    /// Routes in match order, their paths in normal form.
    routes: Vec<Route>,
}

impl Router {
    /// `slashes`: the server's `escaped_slashes`, which configured paths are
    /// normalised with too (the config check refuses one it cannot take).
    pub fn new(routes: &[Route], slashes: EscapedSlashes) -> Router {
        let mut routes: Vec<Route> = Self::ordered(routes, slashes)
            .into_iter()
            .cloned()
            .collect();
        // Configured paths in the same form as requests' (`/%7Euser` is `/~user`).
        for r in &mut routes {
            let (PathMatch::Exact(p) | PathMatch::Prefix(p)) = &mut r.path;
            if let Ok(Cow::Owned(n)) = normalize(p, slashes) {
                *p = n;
            }
        }
        Router { routes }
    }

    /// The routes in the order they are tried.
    pub fn ordered(routes: &[Route], slashes: EscapedSlashes) -> Vec<&Route> {
        let mut order: Vec<(usize, &Route)> = routes.iter().enumerate().collect();
        // Lengths of the normal form, which is what requests are matched to.
        let len = |p: &str| normalize(p, slashes).map_or(p.len(), |n| n.len());
        // Stable sort: equal specificity keeps file order.
        order.sort_by_key(|(i, r)| {
            let (exact, len) = match &r.path {
                PathMatch::Exact(p) => (true, len(p)),
                PathMatch::Prefix(p) => (false, len(p)),
            };
            (
                std::cmp::Reverse(r.host.is_some()),
                std::cmp::Reverse(exact),
                std::cmp::Reverse(len),
                *i,
            )
        });
        order.into_iter().map(|(_, r)| r).collect()
    }

    /// The route for a request, if any. `host` is the request's host in its
    /// normal form ([`normalize_host`]), with or without a port; `path` in
    /// its normal form ([`normalize`]).
    pub fn find(&self, method: &Method, host: Option<&str>, path: &str) -> Option<&Route> {
        self.routes.iter().find(|r| {
            let path_ok = match &r.path {
                PathMatch::Exact(p) => path == p,
                PathMatch::Prefix(p) => path.starts_with(p.as_str()),
            };
            path_ok
                && r.methods.as_ref().is_none_or(|m| m.contains(method))
                && r.host
                    .as_deref()
                    // The port is cut off only for a route that names a host.
                    .is_none_or(|want| {
                        host.is_some_and(|h| strip_port(h).eq_ignore_ascii_case(want))
                    })
        })
    }
}

/// A path's normal form, or why it is refused. In order:
///
/// 1. escapes are decoded when they name an unreserved character (`%61` →
///    `a`, `%2e` → `.`), kept with uppercase hex digits otherwise (`%3b` →
///    `%3B`); a `%` that starts no escape, `%00`, and escapes whose bytes
///    (with the literal ones around them) are not UTF-8 (`%C0%AF`, an
///    overlong `/`) are refused;
/// 2. an encoded slash or backslash (`%2F`, `%5C`) and a literal `\` are, by
///    `slashes`: refused (`Reject`; so is their double encoding, `%252F`,
///    which a backend that decodes twice would read as a slash); segment
///    separators (`Decode`); or characters of their segment (`Keep`: `%2F`,
///    `%5C`);
/// 3. in each segment, its `;` parameters are left out (`/a;v=1/b` →
///    `/a/b`, as Java servers read it; an encoded `%3B` is data);
/// 4. empty segments are dropped (`//` → `/`) and `.` and `..` segments
///    resolved (never above the root). A trailing `/` is kept.
///
/// Escapes are decoded once: `%252e` is the text `%2e`, never `.`.
/// A target that does not start with `/` (`*`) is left as it is.
/// Borrowed when the path is already normal, as nearly every path is.
pub fn normalize(path: &str, slashes: EscapedSlashes) -> Result<Cow<'_, str>, Refused> {
    if !path.starts_with('/') || is_normal(path.as_bytes()) {
        return Ok(Cow::Borrowed(path));
    }
    let text = decode(path.as_bytes(), slashes)?;
    let mut segments: Vec<&[u8]> = Vec::new();
    let mut trailing = false;
    for segment in text.split(|&b| b == b'/').skip(1) {
        // A segment's parameters are not part of its name.
        let segment = match segment.iter().position(|&b| b == b';') {
            Some(i) => &segment[..i],
            None => segment,
        };
        trailing = matches!(segment, b"" | b"." | b"..");
        match segment {
            b"" | b"." => {}
            b".." => {
                segments.pop();
            }
            s => segments.push(s),
        }
    }
    let mut out = Vec::with_capacity(text.len());
    for s in &segments {
        out.push(b'/');
        out.extend_from_slice(s);
    }
    if trailing || segments.is_empty() {
        out.push(b'/');
    }
    // Only ASCII was put in place of ASCII, and whole segments (split at
    // ASCII bytes) were left out: still UTF-8.
    String::from_utf8(out)
        .map(Cow::Owned)
        .map_err(|_| Refused::NotUtf8)
}

/// No `%`, `\`, `;`, `//`, and no `.` or `..` segment: nothing to normalize.
fn is_normal(path: &[u8]) -> bool {
    let mut prev = 0u8;
    for (i, &b) in path.iter().enumerate() {
        match b {
            b'%' | b'\\' | b';' => return false,
            b'/' if prev == b'/' => return false,
            b'.' if prev == b'/' => {
                let rest = &path[i + 1..];
                if rest.is_empty()
                    || rest[0] == b'/'
                    || rest[0] == b'.' && (rest.len() == 1 || rest[1] == b'/')
                {
                    return false;
                }
            }
            _ => {}
        }
        prev = b;
    }
    true
}

fn hex(b: u8) -> Option<u8> {
    (b as char).to_digit(16).map(|d| d as u8)
}

/// The value of the escape at `at` (`%XX`), if one is there.
fn escape_at(path: &[u8], at: usize) -> Option<u8> {
    match path.get(at..at + 3) {
        Some(&[b'%', h, l]) => Some(hex(h)? * 16 + hex(l)?),
        _ => None,
    }
}

/// Steps 1 and 2 of [`normalize`]: the path with escapes decoded or kept,
/// and slashes by `slashes`; its `/` are the segment separators.
fn decode(path: &[u8], slashes: EscapedSlashes) -> Result<Vec<u8>, Refused> {
    let mut out = Vec::with_capacity(path.len());
    // Every escape decoded, for the UTF-8 check; only made if one decodes
    // to a byte above ASCII.
    let mut high = false;
    let mut i = 0;
    while i < path.len() {
        let b = path[i];
        if b == b'\\' {
            match slashes {
                EscapedSlashes::Reject => return Err(Refused::EscapedSlash),
                EscapedSlashes::Decode => out.push(b'/'),
                EscapedSlashes::Keep => out.extend_from_slice(b"%5C"),
            }
            i += 1;
            continue;
        }
        if b != b'%' {
            out.push(b);
            i += 1;
            continue;
        }
        let c = escape_at(path, i).ok_or(Refused::BadEscape)?;
        match c {
            0 => return Err(Refused::Nul),
            b'/' | b'\\' => match slashes {
                EscapedSlashes::Reject => return Err(Refused::EscapedSlash),
                EscapedSlashes::Decode => out.push(b'/'),
                EscapedSlashes::Keep => {
                    out.extend_from_slice(if c == b'/' { b"%2F" } else { b"%5C" })
                }
            },
            c if c.is_ascii_alphanumeric() || matches!(c, b'-' | b'.' | b'_' | b'~') => out.push(c),
            b'%' if slashes == EscapedSlashes::Reject
                && matches!(
                    path.get(i + 3..i + 5),
                    Some(&[h, l]) if matches!(hex(h).zip(hex(l)), Some((2, 15) | (5, 12)))
                ) =>
            {
                // `%252F`: a slash to a backend that decodes twice.
                return Err(Refused::EscapedSlash);
            }
            c => {
                high |= c >= 0x80;
                out.extend_from_slice(&[
                    b'%',
                    path[i + 1].to_ascii_uppercase(),
                    path[i + 2].to_ascii_uppercase(),
                ]);
            }
        }
        i += 3;
    }
    if high && std::str::from_utf8(&fully_decoded(path)).is_err() {
        return Err(Refused::NotUtf8);
    }
    Ok(out)
}

/// `path` with every escape decoded (all of them valid: [`decode`] checked).
fn fully_decoded(path: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(path.len());
    let mut i = 0;
    while i < path.len() {
        match escape_at(path, i) {
            Some(c) => {
                out.push(c);
                i += 3;
            }
            None => {
                out.push(path[i]);
                i += 1;
            }
        }
    }
    out
}

/// A request's host (`Host`, or HTTP/2's `:authority`) in its normal form,
/// or why it is refused: the name lowercased and without its trailing dot
/// (`API.example.com.` → `api.example.com`, the same name to DNS), the port
/// kept if there is one (digits, at most 65535; an empty one is dropped).
/// Names are letters, digits, `-`, `_` and `.` between non-empty labels, or
/// an IPv6 address in brackets; nothing else (no `%`, no `,`, no second
/// `:`), so that no two spellings of a name reach different routes.
/// Borrowed when already normal. An empty host stays empty (RFC 9112 3.2
/// allows one): it matches no route that names a host.
pub fn normalize_host(host: &[u8]) -> Result<Cow<'_, [u8]>, Refused> {
    if host.is_empty() {
        return Ok(Cow::Borrowed(host));
    }
    let (name, port) = if host[0] == b'[' {
        let close = host
            .iter()
            .position(|&b| b == b']')
            .ok_or(Refused::Host("an IPv6 address without its ']'"))?;
        let inner = std::str::from_utf8(&host[1..close])
            .map_err(|_| Refused::Host("not an IPv6 address"))?;
        inner
            .parse::<Ipv6Addr>()
            .map_err(|_| Refused::Host("not an IPv6 address"))?;
        match &host[close + 1..] {
            [] => (&host[..=close], None),
            [b':', port @ ..] => (&host[..=close], Some(port)),
            _ => return Err(Refused::Host("bytes after an IPv6 address")),
        }
    } else {
        match host.iter().position(|&b| b == b':') {
            Some(i) => (&host[..i], Some(&host[i + 1..])),
            None => (host, None),
        }
    };
    if let Some(port) = port {
        let number = port.len() <= 5
            && port.iter().all(u8::is_ascii_digit)
            && port.iter().fold(0u32, |n, &d| n * 10 + u32::from(d - b'0')) <= 65535;
        if !number {
            return Err(Refused::Host("a port that is not a number up to 65535"));
        }
    }
    let bracketed = name.first() == Some(&b'[');
    let name = if bracketed {
        name
    } else {
        let name = name.strip_suffix(b".").unwrap_or(name);
        if name.is_empty() || name.split(|&b| b == b'.').any(<[u8]>::is_empty) {
            return Err(Refused::Host("an empty label"));
        }
        if !name
            .iter()
            .all(|&b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
        {
            return Err(Refused::Host("a byte not allowed in a host name"));
        }
        name
    };
    let lower = !name.iter().any(u8::is_ascii_uppercase);
    let whole = name.len() + port.map_or(0, |p| p.len() + 1);
    // Unchanged: no dot cut, no empty port, no uppercase.
    if lower && whole == host.len() && port.is_none_or(|p| !p.is_empty()) {
        return Ok(Cow::Borrowed(host));
    }
    let mut out = name.to_ascii_lowercase();
    if let Some(port) = port.filter(|p| !p.is_empty()) {
        out.push(b':');
        out.extend_from_slice(port);
    }
    Ok(Cow::Owned(out))
}

/// `example.com:8080` → `example.com`; `[::1]:80` → `[::1]`.
fn strip_port(host: &str) -> &str {
    match host.bytes().rposition(|b| b == b':') {
        Some(i) if !host[i..].contains(']') => &host[..i],
        _ => host,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Target;
    use EscapedSlashes::{Decode, Keep, Reject};

    fn route(
        name: &str,
        path: PathMatch,
        host: Option<&str>,
        methods: Option<Vec<Method>>,
    ) -> Route {
        Route {
            name: name.into(),
            path,
            methods,
            host: host.map(str::to_string),
            upgrades: vec!["websocket".into()],
            target: Target::Respond {
                status: http::StatusCode::OK,
                body: bytes::Bytes::new(),
                content_type: String::new(),
            },
            policy: None,
            cost: 1,
        }
    }

    fn prefix(p: &str) -> PathMatch {
        PathMatch::Prefix(p.to_string())
    }

    fn norm(p: &str) -> String {
        normalize(p, Reject)
            .expect("a path sluice takes")
            .into_owned()
    }

    /// `find` as a request reaches it: path and host in normal form.
    fn find<'r>(r: &'r Router, host: Option<&str>, path: &str) -> Option<&'r str> {
        let host = host.map(|h| {
            String::from_utf8(normalize_host(h.as_bytes()).unwrap().into_owned()).unwrap()
        });
        r.find(&Method::GET, host.as_deref(), &norm(path))
            .map(|r| &*r.name)
    }

    #[test]
    fn most_specific_route_wins() {
        let router = Router::new(
            &[
                route("root", prefix("/"), None, None),
                route("api", prefix("/api"), None, None),
                route("api-search", prefix("/api/search"), None, None),
                route("exact", PathMatch::Exact("/api".to_string()), None, None),
                route("hosted", prefix("/"), Some("api.example.com"), None),
                route("root-again", prefix("/"), None, None),
            ],
            Reject,
        );
        assert_eq!(find(&router, None, "/api/search"), Some("api-search"));
        assert_eq!(find(&router, None, "/api/other"), Some("api"));
        assert_eq!(find(&router, None, "/api"), Some("exact"));
        assert_eq!(
            find(&router, None, "/x"),
            Some("root"),
            "ties go to the earlier route"
        );
        for host in [
            "API.example.com:8080",
            "api.example.com.",
            "api.example.com.:80",
            "api.example.com:",
        ] {
            assert_eq!(
                find(&router, Some(host), "/api/search"),
                Some("hosted"),
                "{host}"
            );
        }
    }

    #[test]
    fn methods_and_misses() {
        let router = Router::new(
            &[route("get", prefix("/a"), None, Some(vec![Method::GET]))],
            Reject,
        );
        assert!(router.find(&Method::GET, None, "/a").is_some());
        assert!(router.find(&Method::POST, None, "/a").is_none());
        assert!(router.find(&Method::GET, None, "/b").is_none());
    }

    #[test]
    fn lowercase_methods_are_refused() {
        for m in ["post", "Post", "gEt", "purge"] {
            let m = Method::from_bytes(m.as_bytes()).unwrap();
            assert_eq!(check_method(&m), Err(Refused::LowercaseMethod), "{m}");
        }
        for m in [
            Method::GET,
            Method::POST,
            Method::from_bytes(b"PURGE").unwrap(),
        ] {
            assert_eq!(check_method(&m), Ok(()));
        }
    }

    #[test]
    fn strips_ports() {
        assert_eq!(strip_port("a.com:80"), "a.com");
        assert_eq!(strip_port("a.com"), "a.com");
        assert_eq!(strip_port("[::1]:80"), "[::1]");
        assert_eq!(strip_port("[::1]"), "[::1]");
    }

    #[test]
    fn hosts_in_normal_form_or_refused() {
        let ok = [
            ("api.example.com", "api.example.com"),
            ("API.Example.COM", "api.example.com"),
            ("api.example.com.", "api.example.com"),
            ("api.example.com.:8080", "api.example.com:8080"),
            ("api.example.com:", "api.example.com"),
            ("a_b.internal:65535", "a_b.internal:65535"),
            ("127.0.0.1:80", "127.0.0.1:80"),
            ("[::1]", "[::1]"),
            ("[::FFFF:1]:443", "[::ffff:1]:443"),
            ("", ""),
        ];
        for (raw, want) in ok {
            let got = normalize_host(raw.as_bytes()).unwrap_or_else(|e| panic!("{raw}: {e}"));
            assert_eq!(&*got, want.as_bytes(), "{raw}");
        }
        assert!(matches!(
            normalize_host(b"api.example.com:80"),
            Ok(Cow::Borrowed(_))
        ));
        for bad in [
            "api.example.com:80:80",
            "api.example.com:http",
            "api.example.com:65536",
            "api.example.com:000080",
            "api.example.com..",
            ".api.example.com",
            "api..example.com",
            ".",
            ":80",
            "api.example.com,evil.com",
            "api%2eexample.com",
            "api example.com",
            "api.example.com/x",
            "user@api.example.com",
            "[::1",
            "[not-v6]",
            "[::1]x",
            "[::1]:99999",
        ] {
            assert!(
                matches!(normalize_host(bad.as_bytes()), Err(Refused::Host(_))),
                "{bad}"
            );
        }
    }

    #[test]
    fn normal_paths_are_borrowed() {
        for p in [
            "/",
            "/api/search",
            "/api/",
            "/.well-known/x",
            "/a..b/c.",
            "/a/.b",
            "*",
        ] {
            for mode in [Reject, Decode, Keep] {
                assert!(matches!(normalize(p, mode), Ok(Cow::Borrowed(_))), "{p}");
            }
        }
    }

    #[test]
    fn other_spellings_of_a_path_normalize_to_it() {
        let cases = [
            ("/api/%73earch", "/api/search"),
            ("/api/%7euser", "/api/~user"),
            ("//api///search", "/api/search"),
            ("/api/./search", "/api/search"),
            ("/x/../api/search", "/api/search"),
            ("/x/%2e%2e/api/search", "/api/search"),
            ("/x/%2E./api/search", "/api/search"),
            ("/../../api", "/api"),
            ("/api/search/..", "/api/"),
            ("/api/search/.", "/api/search/"),
            ("/api//", "/api/"),
            ("/..", "/"),
            ("//", "/"),
            ("/é/%41", "/é/A"),
            ("/%C3%A9", "/%C3%A9"),
            ("/a%3bb", "/a%3Bb"),
            ("/a%3a%20b", "/a%3A%20b"),
            // `;` parameters are left out of their segment.
            ("/w/admin;x/y", "/w/admin/y"),
            ("/w/admin;jsessionid=1", "/w/admin"),
            ("/w/admin/;x", "/w/admin/"),
            ("/w/;x/admin", "/w/admin"),
            ("/w/x/..;y/admin", "/w/admin"),
            // Decoded once: `%25` is the text `%`.
            ("/a%252e%252e/b", "/a%252e%252e/b"),
            ("/a%2541", "/a%2541"),
        ];
        for (raw, want) in cases {
            assert_eq!(norm(raw), want, "{raw}");
        }
    }

    #[test]
    fn escaped_slashes_by_mode() {
        // (raw, reject, decode, keep); None: refused.
        type Case<'a> = (&'a str, Option<&'a str>, Option<&'a str>, Option<&'a str>);
        let cases: &[Case] = &[
            (
                "/w/admin%2Fx",
                None,
                Some("/w/admin/x"),
                Some("/w/admin%2Fx"),
            ),
            (
                "/w/admin%2fx",
                None,
                Some("/w/admin/x"),
                Some("/w/admin%2Fx"),
            ),
            (
                "/w/x/..%2Fadmin/x",
                None,
                Some("/w/admin/x"),
                Some("/w/x/..%2Fadmin/x"),
            ),
            (
                "/w/x%2F..%2Fadmin/x",
                None,
                Some("/w/admin/x"),
                Some("/w/x%2F..%2Fadmin/x"),
            ),
            (
                "/w/admin%5Cx",
                None,
                Some("/w/admin/x"),
                Some("/w/admin%5Cx"),
            ),
            (
                "/w/x\\..\\admin/x",
                None,
                Some("/w/admin/x"),
                Some("/w/x%5C..%5Cadmin/x"),
            ),
            (
                "/w/admin%252Fx",
                None,
                Some("/w/admin%252Fx"),
                Some("/w/admin%252Fx"),
            ),
            (
                "/w/admin%255cx",
                None,
                Some("/w/admin%255cx"),
                Some("/w/admin%255cx"),
            ),
        ];
        for &(raw, reject, decode, keep) in cases {
            for (mode, want) in [(Reject, reject), (Decode, decode), (Keep, keep)] {
                let got = normalize(raw, mode).ok().map(Cow::into_owned);
                assert_eq!(got.as_deref(), want, "{raw} {mode:?}");
            }
        }
        assert_eq!(normalize("/a%2Fb", Reject), Err(Refused::EscapedSlash));
    }

    #[test]
    fn hostile_escapes_are_refused_in_every_mode() {
        let cases = [
            ("/a%zz", Refused::BadEscape),
            ("/a%4", Refused::BadEscape),
            ("/a%", Refused::BadEscape),
            ("/a%%32%65", Refused::BadEscape),
            ("/a%00b", Refused::Nul),
            ("/a%C0%AF", Refused::NotUtf8),
            ("/a%C0%AE%C0%AE/b", Refused::NotUtf8),
            ("/a%E0%80%AF", Refused::NotUtf8),
            ("/a%FF", Refused::NotUtf8),
            ("/a%ED%A0%80", Refused::NotUtf8),
            ("/é%A9", Refused::NotUtf8),
        ];
        for (raw, why) in cases {
            for mode in [Reject, Decode, Keep] {
                assert_eq!(normalize(raw, mode), Err(why), "{raw} {mode:?}");
            }
        }
    }

    #[test]
    fn routes_match_the_normal_form_on_both_sides() {
        let r = Router::new(
            &[
                route("search", prefix("/api/search"), None, None),
                route("user", PathMatch::Exact("/%7Euser".into()), None, None),
                route("rest", prefix("/"), None, None),
            ],
            Reject,
        );
        for p in [
            "/api/search",
            "/api/%73earch",
            "/api//search",
            "/x/../api/search/q",
            "//api/search",
            "/api;v=1/search",
        ] {
            assert_eq!(find(&r, None, p), Some("search"), "{p}");
        }
        assert_eq!(find(&r, None, "/~user"), Some("user"));
        assert_eq!(find(&r, None, "/%7euser"), Some("user"));
        assert_eq!(find(&r, None, "/api/searc"), Some("rest"));
        // Longer means longer in the normal form.
        let r = Router::new(
            &[
                route("short", prefix("/x/../a/b"), None, None),
                route("long", prefix("/a/b/c"), None, None),
            ],
            Reject,
        );
        assert_eq!(find(&r, None, "/a/b/c/d"), Some("long"));
    }

    /// Property tests: generated paths of escapes of every byte, dots,
    /// slashes, semicolons and backslashes.
    mod props {
        use super::*;
        use proptest::prelude::*;

        /// One piece of a generated path.
        fn piece() -> impl Strategy<Value = String> {
            prop_oneof![
                Just("/".to_string()),
                Just("//".to_string()),
                Just(".".to_string()),
                Just("..".to_string()),
                Just("/./".to_string()),
                Just("/../".to_string()),
                Just(";".to_string()),
                Just(";x=1".to_string()),
                Just("\\".to_string()),
                Just("%".to_string()),
                Just("%2".to_string()),
                Just("%252F".to_string()),
                Just("é".to_string()),
                any::<u8>().prop_map(|b| format!("%{b:02X}")),
                any::<u8>().prop_map(|b| format!("%{b:02x}")),
                "[a-zA-Z0-9_~-]{1,4}",
            ]
        }

        fn path() -> impl Strategy<Value = String> {
            prop::collection::vec(piece(), 0..12).prop_map(|p| format!("/{}", p.concat()))
        }

        fn mode() -> impl Strategy<Value = EscapedSlashes> {
            prop_oneof![Just(Reject), Just(Decode), Just(Keep)]
        }

        /// The reference: the path as a list of (byte, was it escaped),
        /// decoded, split, its parameters cut, its dot segments resolved on
        /// a stack, written again.
        fn model(path: &str, mode: EscapedSlashes) -> Result<String, Refused> {
            let b = path.as_bytes();
            let mut items: Vec<(u8, bool)> = Vec::new();
            let mut i = 0;
            while i < b.len() {
                if b[i] == b'%' {
                    let pair = b.get(i + 1..i + 3).ok_or(Refused::BadEscape)?;
                    let text = std::str::from_utf8(pair).map_err(|_| Refused::BadEscape)?;
                    if !pair.iter().all(u8::is_ascii_hexdigit) {
                        return Err(Refused::BadEscape);
                    }
                    let v = u8::from_str_radix(text, 16).map_err(|_| Refused::BadEscape)?;
                    items.push((v, true));
                    i += 3;
                } else {
                    items.push((b[i], false));
                    i += 1;
                }
            }
            let raw: Vec<u8> = items.iter().map(|&(v, _)| v).collect();
            if items.iter().any(|&(v, e)| e && v == 0) {
                return Err(Refused::Nul);
            }
            let slashy = |&(v, e): &(u8, bool)| v == b'\\' || (e && v == b'/');
            if items.iter().any(slashy) && mode == Reject {
                return Err(Refused::EscapedSlash);
            }
            if mode == Reject
                && items.windows(3).any(|w| {
                    w[0] == (b'%', true)
                        && !w[1].1
                        && !w[2].1
                        && matches!(
                            (w[1].0.to_ascii_uppercase(), w[2].0.to_ascii_uppercase()),
                            (b'2', b'F') | (b'5', b'C')
                        )
                })
            {
                return Err(Refused::EscapedSlash);
            }
            if std::str::from_utf8(&raw).is_err() {
                return Err(Refused::NotUtf8);
            }
            // Separators and the segments' text.
            let mut segments: Vec<Vec<u8>> = vec![Vec::new()];
            for item in &items {
                let (v, e) = *item;
                let separator = (!e && v == b'/') || (mode == Decode && slashy(item));
                if separator {
                    segments.push(Vec::new());
                    continue;
                }
                let seg = segments.last_mut().unwrap();
                let unreserved = v.is_ascii_alphanumeric() || b"-._~".contains(&v);
                if (e && !unreserved) || (!e && v == b'\\') {
                    seg.extend_from_slice(format!("%{v:02X}").as_bytes());
                } else {
                    seg.push(v);
                }
            }
            // The first is before the leading `/`.
            segments.remove(0);
            let mut stack: Vec<Vec<u8>> = Vec::new();
            let mut trailing = false;
            for seg in segments {
                let seg = match seg.iter().position(|&c| c == b';') {
                    Some(i) => seg[..i].to_vec(),
                    None => seg,
                };
                trailing = seg.is_empty() || seg == b"." || seg == b"..";
                if seg == b".." {
                    stack.pop();
                } else if !seg.is_empty() && seg != b"." {
                    stack.push(seg);
                }
            }
            let mut out = String::new();
            for s in &stack {
                out.push('/');
                out.push_str(std::str::from_utf8(s).unwrap());
            }
            if trailing || stack.is_empty() {
                out.push('/');
            }
            Ok(out)
        }

        proptest! {
            #![proptest_config(ProptestConfig::with_cases(256))]

            #[test]
            fn normal_forms_are_normal(p in path(), mode in mode()) {
                // No panic, whatever the input.
                let Ok(n) = normalize(&p, mode) else { return Ok(()) };
                prop_assert!(n.starts_with('/'));
                // Idempotent.
                let again = normalize(&n, mode).map(Cow::into_owned);
                prop_assert_eq!(again, Ok(n.clone().into_owned()));
                prop_assert!(!n.contains("//"), "{}", n);
                prop_assert!(!n.contains(';'), "{}", n);
                prop_assert!(!n.contains('\\'), "{}", n);
                for seg in n.split('/') {
                    prop_assert!(seg != "." && seg != "..", "{}", n);
                }
                if mode != Keep {
                    let upper = n.to_ascii_uppercase();
                    prop_assert!(!upper.contains("%2F") && !upper.contains("%5C"), "{}", n);
                }
            }

            #[test]
            fn the_normaliser_agrees_with_the_reference(p in path(), mode in mode()) {
                // Which refusal comes first may differ: whether is the same.
                let got = normalize(&p, mode).map(Cow::into_owned).ok();
                prop_assert_eq!(got, model(&p, mode).ok(), "{}", p);
            }

            /// A path spelled another way (unreserved characters escaped,
            /// `.`/`..` detours, doubled slashes, parameters) is matched as
            /// its plain spelling is.
            #[test]
            fn spellings_match_the_route_of_their_normal_form(
                segs in prop::collection::vec("[a-z0-9._~-]{1,5}", 1..6),
                tricks in prop::collection::vec(0u8..5, 6),
                mode in mode(),
            ) {
                let plain_segs: Vec<&String> = segs.iter().filter(|s| *s != "." && *s != "..").collect();
                prop_assume!(!plain_segs.is_empty());
                let plain = plain_segs.iter().map(|s| format!("/{s}")).collect::<String>();
                let mut spelled = String::new();
                for (i, s) in plain_segs.iter().enumerate() {
                    match tricks[i % tricks.len()] {
                        0 => spelled += &format!("/{}", s.bytes().map(|b| format!("%{b:02x}")).collect::<String>()),
                        1 => spelled += &format!("/./{s}"),
                        2 => spelled += &format!("/zz/..//{s}"),
                        3 => spelled += &format!("/{s};p=1"),
                        _ => spelled += &format!("/{s}"),
                    }
                }
                let normal = normalize(&plain, mode).unwrap().into_owned();
                prop_assert_eq!(normalize(&spelled, mode).unwrap().into_owned(), normal.clone());
                let r = Router::new(&[
                    route("limited", prefix(&plain), None, None),
                    route("rest", prefix("/"), None, None),
                ], mode);
                let found = r.find(&Method::GET, None, &normalize(&spelled, mode).unwrap());
                prop_assert_eq!(found.map(|r| &*r.name), Some("limited"));
            }

            #[test]
            fn hosts_never_panic_and_are_idempotent(h in "[a-zA-Z0-9.:_\\[\\]%-]{0,24}") {
                if let Ok(n) = normalize_host(h.as_bytes()) {
                    let again = normalize_host(&n).map(Cow::into_owned);
                    prop_assert_eq!(again, Ok(n.clone().into_owned()));
                    prop_assert!(!n.ends_with(b".") && !n.iter().any(u8::is_ascii_uppercase));
                }
            }
        }
    }
}
