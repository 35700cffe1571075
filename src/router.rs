//! Route matching: which `[[routes]]` entry a request belongs to.
//!
//! The most specific route wins: a host match over none, then an exact path over a
//! prefix, then a longer prefix over a shorter one; ties go to the earlier route.
//! Routes are sorted once by that order, so matching is a scan that stops at the
//! first hit. Prefixes are plain string prefixes (as in nginx and Envoy): write
//! `"/api/"` to keep `/apiary` out of `"/api"`.
//!
//! Paths are compared in a normal form (see [`normalize`]), on both sides: a
//! client cannot step around a route, and its policy, by spelling a path
//! another way that the upstream would read as the same (`/api/%73earch`,
//! `/api//search`, `/x/../api/search`). The request is forwarded as sent.

use std::borrow::Cow;

use http::Method;

use crate::config::{PathMatch, Route};

pub struct Router {
    /// Routes in match order.
    routes: Vec<Route>,
}

impl Router {
    pub fn new(routes: &[Route]) -> Router {
        let mut routes: Vec<Route> = Self::ordered(routes).into_iter().cloned().collect();
        // Configured paths in the same form as requests' (`/%7Euser` is `/~user`).
        for r in &mut routes {
            let (PathMatch::Exact(p) | PathMatch::Prefix(p)) = &mut r.path;
            if let Cow::Owned(n) = normalize(p) {
                *p = n;
            }
        }
        Router { routes }
    }

    /// The routes in the order they are tried.
    pub fn ordered(routes: &[Route]) -> Vec<&Route> {
        let mut order: Vec<(usize, &Route)> = routes.iter().enumerate().collect();
        // Stable sort: equal specificity keeps file order.
        order.sort_by_key(|(i, r)| {
            // Lengths of the normal form, which is what requests are matched to.
            let (exact, len) = match &r.path {
                PathMatch::Exact(p) => (true, normalize(p).len()),
                PathMatch::Prefix(p) => (false, normalize(p).len()),
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

    /// The route for a request, if any. `host` is the request's host, with or
    /// without a port, in any case; `path` as the client sent it.
    pub fn find(&self, method: &Method, host: Option<&str>, path: &str) -> Option<&Route> {
        let path = normalize(path);
        let path = path.as_ref();
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

/// A path's normal form (RFC 3986, 6.2.2 and 5.2.4, and runs of `/` merged as
/// nginx does): percent-encoded unreserved characters decoded (`%61` → `a`),
/// other escapes kept with uppercase hex digits (`%2f` → `%2F`: an encoded `/`
/// stays a character of its segment), empty segments dropped (`//` → `/`), and
/// `.` and `..` segments resolved (never above the root). A trailing `/` is kept.
/// Borrowed when the path is already normal, as nearly every path is.
pub fn normalize(path: &str) -> Cow<'_, str> {
    if !path.starts_with('/') || is_normal(path.as_bytes()) {
        return Cow::Borrowed(path);
    }
    let decoded = decode_unreserved(path.as_bytes());
    let trailing = decoded.ends_with("/") || decoded.ends_with("/.") || decoded.ends_with("/..");
    let mut segments: Vec<&str> = Vec::new();
    for segment in decoded.split('/') {
        match segment {
            "" | "." => {}
            ".." => {
                segments.pop();
            }
            s => segments.push(s),
        }
    }
    let mut out = String::with_capacity(decoded.len());
    for s in &segments {
        out.push('/');
        out.push_str(s);
    }
    if trailing || segments.is_empty() {
        out.push('/');
    }
    Cow::Owned(out)
}

/// No `%`, no `//`, and no `.` or `..` segment: nothing to normalize.
fn is_normal(path: &[u8]) -> bool {
    let mut prev = 0u8;
    for (i, &b) in path.iter().enumerate() {
        match b {
            b'%' => return false,
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

/// Decodes `%XX` when it names an unreserved character; upper-cases the hex of
/// the others; leaves a `%` that starts no escape as it is.
fn decode_unreserved(path: &[u8]) -> String {
    let hex = |b: u8| (b as char).to_digit(16);
    let mut out = Vec::with_capacity(path.len());
    let mut i = 0;
    while i < path.len() {
        let escape = (path[i] == b'%' && i + 2 < path.len())
            .then(|| hex(path[i + 1]).zip(hex(path[i + 2])))
            .flatten();
        if let Some((h, l)) = escape {
            let c = (h * 16 + l) as u8;
            if c.is_ascii_alphanumeric() || matches!(c, b'-' | b'.' | b'_' | b'~') {
                out.push(c);
            } else {
                out.extend_from_slice(&[
                    b'%',
                    path[i + 1].to_ascii_uppercase(),
                    path[i + 2].to_ascii_uppercase(),
                ]);
            }
            i += 3;
            continue;
        }
        out.push(path[i]);
        i += 1;
    }
    // Only ASCII was replaced by ASCII: still UTF-8.
    String::from_utf8(out).unwrap_or_else(|e| String::from_utf8_lossy(e.as_bytes()).into_owned())
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

    #[test]
    fn most_specific_route_wins() {
        let router = Router::new(&[
            route("root", prefix("/"), None, None),
            route("api", prefix("/api"), None, None),
            route("api-search", prefix("/api/search"), None, None),
            route("exact", PathMatch::Exact("/api".to_string()), None, None),
            route("hosted", prefix("/"), Some("api.example.com"), None),
            route("root-again", prefix("/"), None, None),
        ]);
        let find = |host, path| router.find(&Method::GET, host, path).map(|r| &*r.name);
        assert_eq!(find(None, "/api/search?q"), Some("api-search"));
        assert_eq!(find(None, "/api/other"), Some("api"));
        assert_eq!(find(None, "/api"), Some("exact"));
        assert_eq!(
            find(None, "/x"),
            Some("root"),
            "ties go to the earlier route"
        );
        assert_eq!(
            find(Some("API.example.com:8080"), "/api/search"),
            Some("hosted")
        );
    }

    #[test]
    fn methods_and_misses() {
        let router = Router::new(&[route("get", prefix("/a"), None, Some(vec![Method::GET]))]);
        assert!(router.find(&Method::GET, None, "/a").is_some());
        assert!(router.find(&Method::POST, None, "/a").is_none());
        assert!(router.find(&Method::GET, None, "/b").is_none());
    }

    #[test]
    fn strips_ports() {
        assert_eq!(strip_port("a.com:80"), "a.com");
        assert_eq!(strip_port("a.com"), "a.com");
        assert_eq!(strip_port("[::1]:80"), "[::1]");
        assert_eq!(strip_port("[::1]"), "[::1]");
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
            assert!(matches!(normalize(p), Cow::Borrowed(_)), "{p}");
        }
    }

    #[test]
    fn other_spellings_of_a_path_normalize_to_it() {
        let cases = [
            ("/api/%73earch", "/api/search"),
            ("/api/%7euser", "/api/~user"),
            ("/a%2fb", "/a%2Fb"),
            ("/a%2Fb", "/a%2Fb"),
            ("/a%zz", "/a%zz"),
            ("/a%4", "/a%4"),
            ("//api///search", "/api/search"),
            ("/api/./search", "/api/search"),
            ("/x/../api/search", "/api/search"),
            ("/x/%2e%2e/api/search", "/api/search"),
            ("/../../api", "/api"),
            ("/api/search/..", "/api/"),
            ("/api/search/.", "/api/search/"),
            ("/api//", "/api/"),
            ("/..", "/"),
            ("//", "/"),
            ("/é/%41", "/é/A"),
        ];
        for (raw, want) in cases {
            assert_eq!(normalize(raw), want, "{raw}");
        }
    }

    #[test]
    fn routes_match_the_normal_form_on_both_sides() {
        let r = Router::new(&[
            route("search", prefix("/api/search"), None, None),
            route("user", PathMatch::Exact("/%7Euser".into()), None, None),
            route("rest", prefix("/"), None, None),
        ]);
        let find = |p: &str| r.find(&Method::GET, None, p).map(|r| r.name.to_string());
        for p in [
            "/api/search",
            "/api/%73earch",
            "/api//search",
            "/x/../api/search/q",
            "//api/search",
        ] {
            assert_eq!(find(p).as_deref(), Some("search"), "{p}");
        }
        assert_eq!(find("/~user").as_deref(), Some("user"));
        assert_eq!(find("/%7euser").as_deref(), Some("user"));
        assert_eq!(find("/api/searc").as_deref(), Some("rest"));
        // Longer means longer in the normal form.
        let r = Router::new(&[
            route("short", prefix("/x/../a/b"), None, None),
            route("long", prefix("/a/b/c"), None, None),
        ]);
        let found = r
            .find(&Method::GET, None, "/a/b/c/d")
            .map(|r| r.name.to_string());
        assert_eq!(found.as_deref(), Some("long"));
    }
}
