//! The admin listener (`server.admin_listen`): `/healthz` (the process is up),
//! `/readyz` (config loaded and the store answers; 503 otherwise), `/metrics`
//! (Prometheus text), `/usage?policy=NAME&key=KEY&value=VALUE` (GET: one
//! identity's usage under each limit of a policy; DELETE: reset it) and
//! `/plans?policy=NAME[&value=VALUE]` (GET, PUT, DELETE: the plans
//! identities are on). Off
//! unless configured; keep it on loopback: it has no authentication.

use std::convert::Infallible;
use std::sync::Arc;

use bytes::Bytes;
use http::{Method, Request, Response, StatusCode, header};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto;
use tokio::net::TcpListener;

use crate::config::{Algorithm, KeySpec};
use crate::limiter::Assigned;
use crate::proxy::Proxy;

/// Serves admin requests until the task is dropped.
pub async fn serve(listener: TcpListener, proxy: Arc<Proxy>) {
    loop {
        let Ok((stream, _)) = listener.accept().await else {
            continue;
        };
        let proxy = proxy.clone();
        tokio::spawn(async move {
            let service = service_fn(move |req| {
                let proxy = proxy.clone();
                async move { Ok::<_, Infallible>(answer(&proxy, req).await) }
            });
            let _ = auto::Builder::new(TokioExecutor::new())
                .serve_connection(TokioIo::new(stream), service)
                .await;
        });
    }
}

async fn answer(proxy: &Proxy, req: Request<Incoming>) -> Response<Full<Bytes>> {
    let text = |status: StatusCode, body: String, content_type: &'static str| {
        let mut resp = Response::new(Full::new(Bytes::from(body)));
        *resp.status_mut() = status;
        resp.headers_mut().insert(
            header::CONTENT_TYPE,
            header::HeaderValue::from_static(content_type),
        );
        resp
    };
    const PLAIN: &str = "text/plain; charset=utf-8";
    if req.uri().path() == "/plans" {
        let (status, body) = plans(proxy, req).await;
        return text(status, body.to_string(), "application/json");
    }
    if req.uri().path() == "/usage" {
        let (status, body) = usage(proxy, &req).await;
        return text(status, body.to_string(), "application/json");
    }
    if req.method() != Method::GET && req.method() != Method::HEAD {
        return text(StatusCode::METHOD_NOT_ALLOWED, "GET only\n".into(), PLAIN);
    }
    match req.uri().path() {
        "/healthz" => text(StatusCode::OK, "ok\n".into(), PLAIN),
        "/readyz" => match proxy.limiter().store().ping().await {
            Ok(()) => text(StatusCode::OK, "ready\n".into(), PLAIN),
            Err(e) => text(
                StatusCode::SERVICE_UNAVAILABLE,
                format!("not ready: {e}\n"),
                PLAIN,
            ),
        },
        "/metrics" => text(
            StatusCode::OK,
            proxy.metrics().render(),
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        ),
        _ => text(StatusCode::NOT_FOUND, "not found\n".into(), PLAIN),
    }
}

/// An admin error: its status, and JSON `{"status", "detail"}`.
fn problem(status: StatusCode, detail: String) -> (StatusCode, serde_json::Value) {
    (
        status,
        serde_json::json!({ "status": status.as_u16(), "detail": detail }),
    )
}

/// The policy named `name` in the config in force.
fn policy_named<'s>(
    state: &'s crate::proxy::State,
    name: &str,
) -> Option<&'s Arc<crate::config::Policy>> {
    state.config.policies.iter().find(|p| *p.name == *name)
}

/// The largest `PUT /plans` body read, and the longest identity value.
const MAX_PLAN_BODY: usize = 64 * 1024;
const MAX_VALUE: usize = 4096;

/// `GET|PUT|DELETE /plans?policy=NAME[&value=VALUE]`: the plans identities
/// are on. `PUT` with `{"plan": "NAME"}` assigns one (for every instance
/// sharing the store), `DELETE` takes the run-time assignment back (the
/// file's, or the default, is in force again), `GET` tells one identity's
/// plan, or without `value` every assignment of the policy.
async fn plans(proxy: &Proxy, req: Request<Incoming>) -> (StatusCode, serde_json::Value) {
    let query = req.uri().query().unwrap_or("").as_bytes().to_vec();
    let policy_name = form_urlencoded::parse(&query)
        .find(|(k, _)| k == "policy")
        .map(|(_, v)| v.into_owned());
    let value = crate::identity::query_value(&query, b"value");
    let Some(policy_name) = policy_name else {
        return problem(StatusCode::BAD_REQUEST, "policy is required".into());
    };
    let state = proxy.state();
    let Some(policy) = policy_named(&state, &policy_name) else {
        return problem(StatusCode::NOT_FOUND, format!("no policy '{policy_name}'"));
    };
    if policy.plans.is_empty() {
        return problem(
            StatusCode::BAD_REQUEST,
            format!("policy '{policy_name}' has no plans"),
        );
    }
    if value.as_ref().is_some_and(|v| v.len() > MAX_VALUE) {
        return problem(
            StatusCode::BAD_REQUEST,
            format!("value is longer than {MAX_VALUE} bytes"),
        );
    }
    let limiter = proxy.limiter();
    let names = || {
        std::iter::once(crate::config::DEFAULT_PLAN)
            .chain(policy.plans.iter().map(|p| &*p.plan))
            .collect::<Vec<_>>()
    };
    // The plan `value` is on, and why.
    let in_force = |value: &[u8]| {
        let default = || Arc::from(crate::config::DEFAULT_PLAN);
        match limiter.assigned(policy, value) {
            Some(Assigned::RunTime { plan: Some(i), .. }) => {
                (policy.plans[i].plan.clone(), "run-time")
            }
            Some(Assigned::RunTime { name, plan: None })
                if &*name == crate::config::DEFAULT_PLAN =>
            {
                (name, "run-time")
            }
            // A plan removed from the file since: the default.
            Some(Assigned::RunTime { plan: None, .. }) => (default(), "run-time (plan removed)"),
            Some(Assigned::File(i)) => (policy.plans[i].plan.clone(), "file"),
            None => (default(), "default"),
        }
    };
    let method = req.method().clone();
    let Some(value) = value else {
        if method != Method::GET && method != Method::HEAD {
            return problem(StatusCode::BAD_REQUEST, "value is required".into());
        }
        let mut assigned: Vec<serde_json::Value> = limiter
            .plans()
            .of(&policy.name)
            .into_iter()
            .map(|(v, plan)| {
                serde_json::json!({ "value": String::from_utf8_lossy(&v), "plan": &*plan, "source": "run-time" })
            })
            .collect();
        let mut file: Vec<_> = policy
            .assign
            .iter()
            .filter(|(v, _)| limiter.plans().get(&policy.name, v).is_none())
            .map(|(v, &i)| {
                (
                    String::from_utf8_lossy(v).into_owned(),
                    &*policy.plans[i].plan,
                )
            })
            .collect();
        file.sort();
        assigned
            .extend(file.into_iter().map(
                |(v, plan)| serde_json::json!({ "value": v, "plan": plan, "source": "file" }),
            ));
        return (
            StatusCode::OK,
            serde_json::json!({ "policy": &*policy.name, "plans": names(), "assignments": assigned }),
        );
    };
    let shown = String::from_utf8_lossy(&value).into_owned();
    match method {
        Method::GET | Method::HEAD => {
            let (plan, source) = in_force(&value);
            (
                StatusCode::OK,
                serde_json::json!({ "policy": &*policy.name, "value": shown, "plan": &*plan, "source": source }),
            )
        }
        Method::PUT => {
            let body = match http_body_util::Limited::new(req.into_body(), MAX_PLAN_BODY)
                .collect()
                .await
            {
                Ok(body) => body.to_bytes(),
                Err(_) => {
                    return problem(
                        StatusCode::BAD_REQUEST,
                        format!("the body must be JSON of at most {MAX_PLAN_BODY} bytes"),
                    );
                }
            };
            #[derive(serde::Deserialize)]
            #[serde(deny_unknown_fields)]
            struct Put {
                plan: String,
            }
            let put: Put = match serde_json::from_slice(&body) {
                Ok(put) => put,
                Err(e) => {
                    return problem(
                        StatusCode::BAD_REQUEST,
                        format!("the body must be {{\"plan\": \"NAME\"}}: {e}"),
                    );
                }
            };
            if !names().contains(&put.plan.as_str()) {
                return problem(
                    StatusCode::BAD_REQUEST,
                    format!(
                        "policy '{policy_name}' has no plan '{}' (its plans: {})",
                        put.plan,
                        names().join(", ")
                    ),
                );
            }
            if let Err(e) = limiter.assign(policy, &value, Some(&put.plan)).await {
                return problem(StatusCode::SERVICE_UNAVAILABLE, e.to_string());
            }
            (
                StatusCode::OK,
                serde_json::json!({ "policy": &*policy.name, "value": shown, "plan": put.plan, "source": "run-time" }),
            )
        }
        Method::DELETE => {
            if let Err(e) = limiter.assign(policy, &value, None).await {
                return problem(StatusCode::SERVICE_UNAVAILABLE, e.to_string());
            }
            let (plan, source) = in_force(&value);
            (
                StatusCode::OK,
                serde_json::json!({ "policy": &*policy.name, "value": shown, "plan": &*plan, "source": source }),
            )
        }
        _ => problem(StatusCode::METHOD_NOT_ALLOWED, "GET, PUT or DELETE".into()),
    }
}

/// `GET|DELETE /usage?policy=NAME&key=KEY&value=VALUE`.
async fn usage(proxy: &Proxy, req: &Request<Incoming>) -> (StatusCode, serde_json::Value) {
    let (mut policy, mut key) = (None, None);
    for (k, v) in form_urlencoded::parse(req.uri().query().unwrap_or("").as_bytes()) {
        match &*k {
            "policy" => policy = Some(v.into_owned()),
            "key" => key = Some(v.into_owned()),
            _ => {}
        }
    }
    // The value as bytes, decoded as the proxy decodes a query's values: an
    // identity that is not UTF-8 can be looked up too.
    let value = crate::identity::query_value(req.uri().query().unwrap_or("").as_bytes(), b"value");
    let (Some(policy_name), Some(key)) = (policy, key) else {
        return problem(
            StatusCode::BAD_REQUEST,
            "policy and key are required".into(),
        );
    };
    let spec: KeySpec = match key.parse() {
        Ok(spec) => spec,
        Err(e) => return problem(StatusCode::BAD_REQUEST, e),
    };
    let value = match (&spec, value) {
        (KeySpec::Global, _) => Vec::new(),
        // The canonical form (an IPv4-mapped address as IPv4), or a range
        // (`2001:db8::/64`); the limiter counts it as the policy does.
        (KeySpec::Ip, Some(v)) => {
            let text = String::from_utf8_lossy(&v);
            if let Ok(ip) = text.parse::<std::net::IpAddr>() {
                ip.to_canonical().to_string().into_bytes()
            } else if let Ok(net) = text.parse::<ipnet::IpNet>() {
                net.trunc().to_string().into_bytes()
            } else {
                return problem(
                    StatusCode::BAD_REQUEST,
                    format!("'{text}' is not an IP address or range"),
                );
            }
        }
        (_, Some(v)) if !v.is_empty() => v,
        _ => {
            return problem(
                StatusCode::BAD_REQUEST,
                "value is required for this key".into(),
            );
        }
    };
    let state = proxy.state();
    let Some(policy) = policy_named(&state, &policy_name) else {
        return problem(StatusCode::NOT_FOUND, format!("no policy '{policy_name}'"));
    };
    let limiter = proxy.limiter();
    // The identity's plan, when it is what picks plans; else the default.
    let plan = match &policy.plan_key {
        Some(plan_key) if *plan_key == spec => limiter.plan_for_value(policy, &value),
        _ => policy,
    };
    let result = match *req.method() {
        Method::DELETE => limiter
            .reset(policy, &spec, &value)
            .await
            .map(|_| Vec::new()),
        Method::GET | Method::HEAD => limiter.usage(plan, &spec, &value).await,
        _ => return problem(StatusCode::METHOD_NOT_ALLOWED, "GET or DELETE".into()),
    };
    let usage = match result {
        Ok(usage) => usage,
        Err(e) => return problem(StatusCode::SERVICE_UNAVAILABLE, e.to_string()),
    };
    let value = String::from_utf8_lossy(&value);
    if req.method() == Method::DELETE {
        return (
            StatusCode::OK,
            serde_json::json!({ "policy": &*policy.name, "key": key, "value": value, "reset": true }),
        );
    }
    let limits: Vec<serde_json::Value> = usage
        .iter()
        .map(|u| match u.limit.algorithm {
            // Requests in flight now, across every instance sharing the store.
            Algorithm::Concurrency { lease } => serde_json::json!({
                "limit": u.limit.limit,
                "algorithm": "concurrency",
                "lease": crate::config::duration::format(lease),
                "in_flight": u.used,
                "used": u.used,
                "remaining": u.remaining,
            }),
            _ => {
                let mut limit = serde_json::json!({
                    "limit": u.limit.limit,
                    "window": u.limit.window_text(),
                    "algorithm": u.limit.algorithm.name(),
                    "used": u.used,
                    "remaining": u.remaining,
                    "reset": u.reset_ms.div_ceil(1000),
                });
                if let Algorithm::Gcra { delay, .. } = u.limit.algorithm
                    && !delay.is_zero()
                {
                    limit["delay"] = crate::config::duration::format(delay).into();
                }
                limit
            }
        })
        .collect();
    (
        StatusCode::OK,
        serde_json::json!({ "policy": &*policy.name, "plan": &*plan.plan, "key": key, "value": value, "limits": limits }),
    )
}
