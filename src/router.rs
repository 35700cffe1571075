//! Route matching: which `[[routes]]` entry a request belongs to.
//!
//! The most specific route wins: a host match over none, then an exact path over a
//! prefix, then a longer prefix over a shorter one; ties go to the earlier route.
//! Routes are sorted once by that order, so matching is a scan that stops at the
//! first hit. Prefixes are plain string prefixes (as in nginx and Envoy): write
//! `"/api/"` to keep `/apiary` out of `"/api"`.

use http::Method;

use crate::config::{PathMatch, Route};

pub struct Router {
    /// Routes in match order.
    routes: Vec<Route>,
}

impl Router {
    pub fn new(routes: &[Route]) -> Router {
        Router {
            routes: Self::ordered(routes).into_iter().cloned().collect(),
        }
    }

    /// The routes in the order they are tried.
    pub fn ordered(routes: &[Route]) -> Vec<&Route> {
        let mut order: Vec<(usize, &Route)> = routes.iter().enumerate().collect();
        // Stable sort: equal specificity keeps file order.
        order.sort_by_key(|(i, r)| {
            let (exact, len) = match &r.path {
                PathMatch::Exact(p) => (true, p.len()),
                PathMatch::Prefix(p) => (false, p.len()),
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
    /// without a port, in any case.
    pub fn find(&self, method: &Method, host: Option<&str>, path: &str) -> Option<&Route> {
        let host = host.map(strip_port);
        self.routes.iter().find(|r| {
            let path_ok = match &r.path {
                PathMatch::Exact(p) => path == p,
                PathMatch::Prefix(p) => path.starts_with(p.as_str()),
            };
            path_ok
                && r.methods.as_ref().is_none_or(|m| m.contains(method))
                && r.host
                    .as_deref()
                    .is_none_or(|want| host.is_some_and(|h| h.eq_ignore_ascii_case(want)))
        })
    }
}

/// `example.com:8080` → `example.com`; `[::1]:80` → `[::1]`.
fn strip_port(host: &str) -> &str {
    match host.rfind(':') {
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
}
