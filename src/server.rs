//! The listener: accepts connections, serves HTTP/1.1 and HTTP/2 (prior
//! knowledge) on the same port, and drains gracefully on shutdown.

use std::convert::Infallible;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use hyper_util::server::graceful::GracefulShutdown;
use tokio::net::TcpListener;

use crate::clock::Clock;
use crate::config::{Backend, Config};
use crate::idle::{self, Idle, Tracked};
use crate::limiter::{KeyCache, Limiter};
use crate::proxy::Proxy;
use crate::store::Store;
use crate::store::memory::MemoryStore;
use crate::store::redis::RedisStore;

/// Why the server could not start or run. (The cause is the error's source,
/// which `main` prints after it: naming it here too printed it twice.)
#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    #[error("store")]
    Store(#[from] crate::store::StoreError),
    #[error("server.tls")]
    Tls(#[from] crate::tls::TlsError),
    #[error("cannot listen on {addr}: {source}")]
    Listen {
        addr: String,
        source: std::io::Error,
    },
}

/// How long a client may take to finish its TLS handshake.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// A configured server, not yet running: tests reach its proxy and clock.
pub struct Server {
    listener: TcpListener,
    admin: Option<TcpListener>,
    proxy: Arc<Proxy>,
    clock: Clock,
}

impl Server {
    pub fn new(listener: TcpListener, config: Config) -> Result<Server, ServerError> {
        Server::with_clock(listener, config, Clock::system())
    }

    /// A server on `clock` (tests move it instead of sleeping).
    pub fn with_clock(
        listener: TcpListener,
        config: Config,
        clock: Clock,
    ) -> Result<Server, ServerError> {
        crate::tls::install_crypto();
        let store = match config.store.backend {
            Backend::Memory => Store::Memory(MemoryStore::new(config.store.max_keys)),
            Backend::Redis => Store::Redis(RedisStore::new(&config.store)?),
        };
        let limiter = Limiter::new(store, clock.clone(), config.store.deny_cache);
        let https = config.server.tls.is_some();
        let proxy = Arc::new(Proxy::new(config, limiter, https)?);
        Ok(Server {
            listener,
            admin: None,
            proxy,
            clock,
        })
    }

    /// Serves the admin endpoints on `listener` (instead of binding
    /// `server.admin_listen`).
    pub fn with_admin(mut self, listener: TcpListener) -> Server {
        self.admin = Some(listener);
        self
    }

    pub fn proxy(&self) -> Arc<Proxy> {
        self.proxy.clone()
    }

    /// Serves until `shutdown` completes, then stops accepting and gives
    /// requests in flight up to `server.shutdown_timeout` to finish.
    pub async fn run(self, shutdown: impl Future<Output = ()>) -> Result<(), ServerError> {
        let Server {
            listener,
            admin,
            proxy,
            clock,
        } = self;
        let admin = match (admin, proxy.state().config.server.admin_listen) {
            (Some(l), _) => Some(l),
            (None, Some(addr)) => {
                Some(
                    TcpListener::bind(addr)
                        .await
                        .map_err(|source| ServerError::Listen {
                            addr: addr.to_string(),
                            source,
                        })?,
                )
            }
            (None, None) => None,
        };
        let admin = admin.map(|l| tokio::spawn(crate::admin::serve(l, proxy.clone())));
        let sweeper = tokio::spawn(sweep(proxy.clone(), clock));
        // Load the scripts before serving (each load is bounded by
        // store.timeout; if Redis is down, requests load them on demand).
        if let Store::Redis(r) = proxy.limiter().store() {
            r.preload().await;
        }
        let graceful = GracefulShutdown::new();
        let builder = connection_builder(&proxy.state().config);
        // TLS or not is fixed at start; the certificate is the current
        // config's (the start's if a reload turned TLS off).
        let boot_tls = proxy.state().tls.clone();
        tokio::pin!(shutdown);
        loop {
            tokio::select! {
                accepted = listener.accept() => {
                    let (stream, peer) = match accepted {
                        Ok(conn) => conn,
                        Err(e) => {
                            // Out of file descriptors and the like: wait a moment
                            // rather than spin.
                            tracing::warn!(error = %e, "accept failed");
                            tokio::time::sleep(Duration::from_millis(10)).await;
                            continue;
                        }
                    };
                    let _ = stream.set_nodelay(true);
                    let limit = proxy.state().config.server.header_timeout;
                    let idle = Idle::new();
                    let keys = Arc::new(KeyCache::default());
                    let service = {
                        let (proxy, idle) = (proxy.clone(), idle.clone());
                        service_fn(move |req| {
                            // The request begins inside the future: begun out
                            // here, it made hyper copy the (4 KB) future once more.
                            let (proxy, idle, keys) = (proxy.clone(), idle.clone(), keys.clone());
                            async move {
                                let request = idle.begin();
                                let resp = proxy.handle(req, peer, &keys).await;
                                Ok::<_, Infallible>(resp.map(|body| Tracked::new(body, request)))
                            }
                        })
                    };
                    match &boot_tls {
                        None => {
                            let conn = builder.serve_connection_with_upgrades(TokioIo::new(stream), service);
                            let conn = graceful.watch(conn.into_owned());
                            idle::spawn(conn, idle, limit, peer);
                        }
                        Some(boot) => {
                            let acceptor = proxy.state().tls.clone().unwrap_or_else(|| boot.clone());
                            // The handshake runs in the connection's own task, so a
                            // slow client cannot hold up accepting.
                            let (builder, watcher) = (builder.clone(), graceful.watcher());
                            tokio::spawn(async move {
                                let stream = match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(stream)).await {
                                    Ok(Ok(stream)) => stream,
                                    Ok(Err(e)) => {
                                        tracing::debug!(peer = %peer, error = %e, "TLS handshake failed");
                                        return;
                                    }
                                    Err(_) => return,
                                };
                                let conn = builder.serve_connection_with_upgrades(TokioIo::new(stream), service);
                                let conn = watcher.watch(conn.into_owned());
                                idle::spawn(conn, idle, limit, peer);
                            });
                        }
                    }
                }
                _ = &mut shutdown => break,
            }
        }
        drop(listener);
        let timeout = proxy.state().config.server.shutdown_timeout;
        tracing::info!("shutting down: draining requests in flight");
        if tokio::time::timeout(timeout, graceful.shutdown())
            .await
            .is_err()
        {
            tracing::warn!("shutdown timeout reached; closing remaining connections");
        }
        sweeper.abort();
        if let Some(admin) = admin {
            admin.abort();
        }
        Ok(())
    }
}

/// Runs sluice on `listener` with `config` until `shutdown` completes.
pub async fn run(
    listener: TcpListener,
    config: Config,
    shutdown: impl Future<Output = ()>,
) -> Result<(), ServerError> {
    Server::new(listener, config)?.run(shutdown).await
}

fn connection_builder(config: &Config) -> auto::Builder<TokioExecutor> {
    let mut builder = auto::Builder::new(TokioExecutor::new());
    // Our own check answers 431 with a problem+json body; hyper's buffer only
    // needs room for a head of that size, plus slack for the request line.
    let max = config.server.max_header_bytes;
    builder
        .http1()
        .timer(TokioTimer::new())
        // server.header_timeout is kept by crate::idle, without a timer per request.
        .header_read_timeout(None::<Duration>)
        .max_buf_size((max + 16 * 1024).max(8192));
    builder
        .http2()
        .timer(TokioTimer::new())
        .max_header_list_size(max as u32);
    builder
}

/// Drops the memory store's expired counters now and then.
async fn sweep(proxy: Arc<Proxy>, clock: Clock) {
    let mut tick = tokio::time::interval(Duration::from_secs(5));
    loop {
        tick.tick().await;
        if let Store::Memory(m) = proxy.limiter().store() {
            m.sweep(clock.now_ms());
        }
    }
}
