//! The admin listener (`server.admin_listen`): `/healthz` (the process is up),
//! `/readyz` (config loaded and the store answers; 503 otherwise), `/metrics`
//! (Prometheus text) and `/usage?policy=NAME&key=KEY&value=VALUE` (GET: one
//! identity's usage under each limit of a policy; DELETE: reset it). Off
//! unless configured; keep it on loopback: it has no authentication.

use std::convert::Infallible;
use std::sync::Arc;

use bytes::Bytes;
use http::{Method, Request, Response, StatusCode, header};
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto;
use tokio::net::TcpListener;

use crate::config::KeySpec;
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

/// `GET|DELETE /usage?policy=NAME&key=KEY&value=VALUE`.
async fn usage(proxy: &Proxy, req: &Request<Incoming>) -> (StatusCode, serde_json::Value) {
    let problem = |status: StatusCode, detail: String| {
        (
            status,
            serde_json::json!({ "status": status.as_u16(), "detail": detail }),
        )
    };
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
    let Some(policy) = state
        .config
        .policies
        .iter()
        .find(|p| *p.name == *policy_name)
    else {
        return problem(StatusCode::NOT_FOUND, format!("no policy '{policy_name}'"));
    };
    let limiter = proxy.limiter();
    let result = match *req.method() {
        Method::DELETE => limiter
            .reset(policy, &spec, &value)
            .await
            .map(|_| Vec::new()),
        Method::GET | Method::HEAD => limiter.usage(policy, &spec, &value).await,
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
        .map(|u| {
            serde_json::json!({
                "limit": u.limit.limit,
                "window": u.limit.window_text(),
                "algorithm": u.limit.algorithm.name(),
                "used": u.used,
                "remaining": u.remaining,
                "reset": u.reset_ms.div_ceil(1000),
            })
        })
        .collect();
    (
        StatusCode::OK,
        serde_json::json!({ "policy": &*policy.name, "key": key, "value": value, "limits": limits }),
    )
}
