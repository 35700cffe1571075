//! The admin listener (`server.admin_listen`): `/healthz` (the process is up),
//! `/readyz` (config loaded and the store answers; 503 otherwise) and
//! `/metrics` (Prometheus text). Off unless configured; keep it on loopback.

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
