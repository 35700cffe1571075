//! The request path. Every request passes the same phases, in order, with one
//! [`RequestCtx`] carrying what each phase learns:
//!
//! 1. **match**: the route (404 if none), after the request's own checks (400, 431);
//! 2. **identify**: the client address (trusted proxies considered), when a
//!    policy will count it;
//! 3. **decide**: the limiter's verdict (429 ends the request here; a
//!    `gcra` limit's `delay` holds it first);
//! 4. **forward**: to the upstream, or the route's own `respond`;
//! 5. **settle**: refund or charge now that the status is known (or, for a
//!    metered request or one holding `concurrency` slots, when the body ends);
//! 6. **log**: one access-log event.
//!
//! - `forward.rs`: request/response rewriting for the upstream;
//! - `pool.rs`: the upstream client and its keep-alive connections, and the
//!   bodies on their way (read ahead of slow clients, taken whole before
//!   forwarding, up to the upstream's `buffer`);
//! - `per_client.rs`: upstream exchanges in flight per client address;
//! - `metering.rs`: requests settled when their answer's body ends (a
//!   `meter` in the trailers or the body's bytes, `concurrency` slots);
//! - `h1.rs`: sluice's own HTTP/1.1 exchange, for requests without a body;
//! - `plain_head.rs`: the quick parser for usual heads (answers here,
//!   requests in `crate::front`);
//! - `error.rs`: the errors sluice answers itself, as problem+json;
//! - `ratelimit_headers.rs`: the `X-RateLimit-*` / IETF headers.

mod error;
mod forward;
mod h1;
mod metering;
mod per_client;
pub(crate) mod plain_head;
mod pool;
mod ratelimit_headers;

use std::future::{Future, poll_fn};
use std::net::SocketAddr;
use std::pin::{Pin, pin};
use std::sync::Arc;
use std::task::{Poll, ready};
use std::time::{Duration, Instant};

use arc_swap::ArcSwap;
use bytes::Bytes;
use http::header::{self, HeaderValue};
use http::{Request, Response, Version};
use http_body_util::{Either, Full};
use std::collections::HashMap;

use http::StatusCode;
use hyper_util::rt::TokioIo;

use pool::{PooledBody, UpstreamClient, UpstreamError};

pub use pool::{ClientBody, RequestBody};

pub use error::ProxyError;
pub use ratelimit_headers::Limits;

use crate::config::{
    Config, Meter, Mode, OnError, Policy, Route, StoreConfig, Target, UnderscoreHeaders,
};
use crate::fields::{Fields, HeadFields};
use crate::identity;
use crate::limiter::{Binding, KeyCache, Limiter, PlanError, Ticket, Verdict};
use crate::metrics::{DecisionCounters, Metrics, Name, RouteCounters, UpstreamLabel};
use crate::router::{self, Router};
use crate::store::{Store, StoreError};
use crate::tls::TlsError;
use prometheus_client::metrics::histogram::Histogram;

/// The body of every response sluice sends: the upstream's, streamed, or its own.
pub type Body = Either<PooledBody, Full<Bytes>>;

/// What a config turns into at run time; replaced whole on reload.
pub struct State {
    pub config: Config,
    router: Router,
    /// Clients of the upstreams that trust an extra CA, by upstream name; the
    /// others share the proxy's client.
    clients: HashMap<Arc<str>, UpstreamClient>,
    /// Each policy's `sluice_decisions_total` counters, by [`addr`] of its
    /// `Arc<Policy>` (routes share the config's; each plan of a policy is an
    /// `Arc<Policy>` of its own, counted under its `plan` label).
    decisions: HashMap<usize, DecisionCounters, foldhash::fast::RandomState>,
    /// Each route's `sluice_requests_total` counters, by [`addr`] of its
    /// name (an `Arc<str>` the router's copy of the route shares): every
    /// route of the config is here.
    requests: HashMap<usize, RouteCounters, foldhash::fast::RandomState>,
    /// The counters of requests no route matched (`route="-"`).
    unrouted: RouteCounters,
    /// Each upstream's `sluice_upstream_seconds` histogram, by [`addr`] of
    /// its `Arc<Upstream>`.
    upstream_seconds: HashMap<usize, Histogram, foldhash::fast::RandomState>,
    /// `server.tls`'s certificate and key as this config's load found them:
    /// new connections use the current state's, so a reload puts a renewed
    /// certificate in service.
    pub tls: Option<tokio_rustls::TlsAcceptor>,
    /// The largest request body sluice's own HTTP/1.1 server reads whole
    /// before the request is routed: [`crate::front::MAX_BODY`], or the
    /// least upstream `buffer` if less (an upstream that takes bodies as
    /// they come gets them so, through hyper's server).
    pub read_whole: usize,
}

/// Where a config's shared item lives: what the per-request lookups of its
/// metrics hash (a pointer is cheaper to hash than a name, on every request).
/// The state holds the config, so no address is reused while it is in use.
fn addr<T: ?Sized>(item: &Arc<T>) -> usize {
    Arc::as_ptr(item) as *const () as usize
}

impl State {
    /// Counts a decision; `outcome` indexes [`crate::metrics::OUTCOMES`].
    fn count_decision(&self, policy: &Arc<Policy>, outcome: usize) {
        if let Some(counters) = self.decisions.get(&addr(policy)) {
            counters[outcome].inc();
        }
    }

    pub fn new(config: Config, metrics: &Metrics) -> Result<State, TlsError> {
        let mut clients = HashMap::new();
        for u in config.upstreams.iter() {
            if let Some(ca) = &u.ca {
                clients.insert(u.name.clone(), UpstreamClient::new(Some(ca))?);
            }
        }
        // A plan is an `Arc<Policy>` of its own: its decisions are counted
        // under its policy.
        let decisions = config
            .policies
            .iter()
            .flat_map(|p| std::iter::once(p).chain(&p.plans))
            .map(|p| (addr(p), metrics.decision_counters(&p.name, &p.plan)))
            .collect();
        let requests = config
            .routes
            .iter()
            .map(|r| (addr(&r.name), RouteCounters::new(r.name.clone())))
            .collect();
        let upstream_seconds = config
            .upstreams
            .iter()
            .map(|u| {
                let label = UpstreamLabel {
                    upstream: Name(u.name.clone()),
                };
                let histogram = metrics.upstream_seconds.get_or_create(&label).clone();
                (addr(u), histogram)
            })
            .collect();
        let tls = match &config.server.tls {
            Some(files) => Some(crate::tls::server_config(files)?.into()),
            None => None,
        };
        let read_whole = config
            .upstreams
            .iter()
            .map(|u| u.buffer)
            .fold(crate::front::MAX_BODY, usize::min);
        Ok(State {
            read_whole,
            router: Router::new(&config.routes, config.server.escaped_slashes),
            config,
            clients,
            decisions,
            requests,
            unrouted: RouteCounters::new(Arc::from("-")),
            upstream_seconds,
            tls,
        })
    }
}

/// The proxy: the current state, the limiter and the upstream client.
pub struct Proxy {
    state: ArcSwap<State>,
    limiter: Limiter,
    client: UpstreamClient,
    metrics: Arc<Metrics>,
    /// Set when sluice terminates TLS: the scheme of `X-Forwarded-Proto`.
    https: bool,
    /// What was set up at start and only a restart changes.
    boot: Boot,
    /// Upstream exchanges in flight per client address.
    per_client: Arc<per_client::PerClient>,
    /// Requests a `gcra` limit's `delay` holds now (`server.max_delayed`).
    delayed: std::sync::atomic::AtomicUsize,
}

/// The settings a reload cannot change.
struct Boot {
    server: crate::config::ServerConfig,
    store: StoreConfig,
}

/// What the phases of one request learn, for the later phases and the log.
struct RequestCtx<'t> {
    /// The connection's timer for the upstream's answer, if it has one
    /// (see [`within`]): taken by the forward phase.
    timer: Option<Pin<&'t mut tokio::time::Sleep>>,
    /// The request's fields when the front read them (see [`Proxy::handle`]).
    head: Option<&'t HeadFields>,
    route: Option<Arc<str>>,
    /// The client address, once the identify phase has worked it out (the
    /// forward phase's per-client slot counts by it too).
    client: Option<std::net::IpAddr>,
    decision: &'static str,
    upstream_time: Option<Duration>,
    /// The rate-limit fields of the answer, written where it is written.
    limits: Option<Limits>,
    /// How long a `gcra` limit's `delay` held the request, in ms.
    delayed_ms: u64,
}

/// `exchange`'s output, or `None` once `deadline` has passed.
///
/// With `timer` (a connection's, reused for each of its requests) the timer
/// is not moved for each request: it stays at an earlier request's deadline,
/// which is never later than this one's, and when it fires before
/// `deadline` it is moved to `deadline` then and waited on again. So the
/// deadline is exact, and a connection busy with requests moves its timer
/// about once per `upstream_timeout` instead of once a request (a move and
/// its time arithmetic, about 120 instructions a request, callgrind wrk
/// -c10). A timer made for each request (`timeout_at`, the way without one)
/// is put in the runtime's timer wheel and taken out again under the
/// driver's lock: about 220 more. Between requests the kept timer may wake
/// its connection once, at the last deadline, to no effect.
///
/// `exchange` comes pinned where its caller made it (a large future: moving
/// it in here would copy it, twice).
async fn within<F: Future + Unpin>(
    deadline: tokio::time::Instant,
    timer: Option<Pin<&mut tokio::time::Sleep>>,
    mut exchange: F,
) -> Option<F::Output> {
    let Some(mut timer) = timer else {
        return tokio::time::timeout_at(deadline, exchange).await.ok();
    };
    // Later than this deadline (a shorter timeout after a reload): moved now.
    if timer.deadline() > deadline {
        timer.as_mut().reset(deadline);
    }
    poll_fn(|cx| match Pin::new(&mut exchange).poll(cx) {
        Poll::Ready(out) => Poll::Ready(Some(out)),
        Poll::Pending => loop {
            ready!(timer.as_mut().poll(cx));
            if timer.deadline() >= deadline {
                return Poll::Ready(None);
            }
            // An earlier request's deadline: this one's is still to come.
            timer.as_mut().reset(deadline);
        },
    })
    .await
}

impl Proxy {
    pub fn new(config: Config, limiter: Limiter, https: bool) -> Result<Proxy, TlsError> {
        let boot = Boot {
            server: config.server.clone(),
            store: config.store.clone(),
        };
        let metrics = Arc::new(Metrics::default());
        limiter.leases().count_in(metrics.slots.clone());
        Ok(Proxy {
            boot,
            state: ArcSwap::from_pointee(State::new(config, &metrics)?),
            limiter,
            client: UpstreamClient::new(None)?,
            metrics,
            https,
            per_client: Arc::default(),
            delayed: Default::default(),
        })
    }

    /// The upstream exchanges `client` has in flight
    /// (`server.max_upstream_per_client`).
    pub fn upstream_in_flight(&self, client: std::net::IpAddr) -> usize {
        self.per_client.count(client)
    }

    pub fn metrics(&self) -> &Metrics {
        &self.metrics
    }

    pub fn state(&self) -> Arc<State> {
        self.state.load_full()
    }

    /// The current config's [`State::read_whole`].
    pub fn read_whole(&self) -> usize {
        self.state.load().read_whole
    }

    /// Counts and logs, as [`Proxy::handle`] does, a request sluice's own
    /// server answered with `status` before it was routed (its body
    /// stopped coming: `408`): under no route (`route="-"`).
    pub fn answered_unrouted<B>(&self, req: &Request<B>, status: StatusCode) {
        self.state
            .load()
            .unrouted
            .count(&self.metrics, status.as_u16());
        tracing::info!(
            target: "sluice::access",
            method = %req.method(),
            path = %req.uri().path(),
            route = "-",
            status = status.as_u16(),
            decision = "none",
        );
    }

    /// Puts a new config in place for new requests; requests in flight finish
    /// on the one they started with, and connections stay open.
    ///
    /// The store, the listeners and the worker count were set up at start: a
    /// change to `[store]`, `listen`, `admin_listen`, `workers`, turning
    /// `tls` on or off, `max_connections` or `listen_backlog` is logged and
    /// waits for a restart (`max_header_bytes` and `max_streams` apply to
    /// connections accepted after the reload). (`tls`'s files are read again: a renewed certificate serves new
    /// connections.) Counters live in the store, so they survive.
    pub fn replace(&self, config: Config) -> Result<(), TlsError> {
        let state = State::new(config, &self.metrics)?;
        // Compared with what the process started with, not the last reload:
        // a pending change is reported until the restart.
        let (was, now) = (&self.boot, &state.config);
        let mut later = Vec::new();
        let store_at_start = StoreConfig {
            on_error: now.store.on_error,
            ..was.store.clone()
        };
        if store_at_start != now.store {
            later.push("[store] (but on_error)");
        }
        if was.server.tls.is_some() != now.server.tls.is_some() {
            later.push("server.tls (on or off)");
        }
        if was.server.listen != now.server.listen {
            later.push("server.listen");
        }
        if was.server.admin_listen != now.server.admin_listen {
            later.push("server.admin_listen");
        }
        if was.server.workers != now.server.workers {
            later.push("server.workers");
        }
        if was.server.max_connections != now.server.max_connections {
            later.push("server.max_connections");
        }
        if was.server.listen_backlog != now.server.listen_backlog {
            later.push("server.listen_backlog");
        }
        if !later.is_empty() {
            tracing::warn!(changed = %later.join(", "), "these settings take effect after a restart; the rest is in force");
        }
        self.state.store(Arc::new(state));
        Ok(())
    }

    /// Re-reads the config file (SIGHUP): a valid file takes over, an invalid
    /// one is refused with its reason and the old config keeps serving.
    pub fn reload(&self, path: &std::path::Path) -> Result<(), crate::config::ConfigError> {
        let loaded = crate::config::load(path).and_then(|config| {
            self.replace(config)
                .map_err(|e| crate::config::ConfigError::Invalid(vec![e.to_string()]))
        });
        match loaded {
            Ok(()) => {
                self.metrics.reload("ok");
                tracing::info!(config = %path.display(), "configuration reloaded");
                Ok(())
            }
            Err(e) => {
                self.metrics.reload("error");
                tracing::error!(config = %path.display(), reason = %e, "configuration refused; the old one keeps serving");
                Err(e)
            }
        }
    }

    pub fn limiter(&self) -> &Limiter {
        &self.limiter
    }

    /// Serves one request from `peer`. Never fails: every error is a response.
    /// `head`: the request's fields as sluice's own front read them, where it
    /// made no header map (see [`crate::fields`]); `None`: they are in the
    /// request's map.
    /// `keys` is the connection's cache of counter keys. The request is lent,
    /// not given: the caller's future holds it once, where a request passed
    /// by value took room in every phase's future, twice.
    ///
    /// The answer is put in `answer`, not returned: returned, it was copied
    /// at each `await` on its way out (about 200 bytes, five copies). Its
    /// rate-limit fields come beside it, for the caller to write (see
    /// [`Limits`]): they are not in its header map yet.
    ///
    /// `timer`: the connection's own timer for `server.upstream_timeout`,
    /// when it serves one request at a time (see [`within`]); without one,
    /// the request makes its own.
    ///
    /// `head` is lent mutably for `server.underscore_headers` only: fields
    /// it drops are gone before any phase reads the request.
    pub async fn handle(
        &self,
        req: &mut Request<RequestBody>,
        mut head: Option<&mut HeadFields>,
        peer: SocketAddr,
        keys: &KeyCache,
        timer: Option<Pin<&mut tokio::time::Sleep>>,
        answer: &mut Option<Answer>,
    ) {
        let state = self.state.load_full();
        let underscores = self.underscores(&state, req, head.as_deref_mut());
        let head = head.map(|h| &*h);
        let mut ctx = RequestCtx {
            timer,
            head,
            route: None,
            client: None,
            decision: "none",
            upstream_time: None,
            limits: None,
            delayed_ms: 0,
        };
        // Kept only when the access log is on (it usually is not under load
        // tests). The log never shows the query: it often carries credentials.
        let logged = tracing::enabled!(target: "sluice::access", tracing::Level::INFO).then(|| {
            (
                Instant::now(),
                req.method().clone(),
                req.uri().path().to_string(),
            )
        });
        let resp = match underscores {
            Err(e) => e.response(),
            Ok(()) => match self.phases(&state, req, peer, keys, &mut ctx).await {
                Ok(resp) => resp,
                Err(e) => e.response(),
            },
        };
        ctx.route
            .as_ref()
            .and_then(|r| state.requests.get(&addr(r)))
            .unwrap_or(&state.unrouted)
            .count(&self.metrics, resp.status().as_u16());
        let status = resp.status().as_u16();
        *answer = Some(Answer {
            resp,
            limits: ctx.limits,
        });
        let Some((started, method, path)) = logged else {
            return;
        };
        tracing::info!(
            target: "sluice::access",
            method = %method,
            path = %path,
            route = ctx.route.as_deref().unwrap_or("-"),
            status,
            decision = ctx.decision,
            upstream_ms = ctx.upstream_time.map(millis),
            total_ms = millis(started.elapsed()),
        );
    }

    /// `server.underscore_headers`: request fields whose names hold `_`
    /// (`X_Api_Key`), which WSGI and Rack read as the `-` name (both are
    /// `HTTP_X_API_KEY` to them), so a client could pick the value a
    /// backend reads while sluice counts another. Dropped (and counted),
    /// refused, or kept.
    fn underscores(
        &self,
        state: &State,
        req: &mut Request<RequestBody>,
        head: Option<&mut HeadFields>,
    ) -> Result<(), ProxyError> {
        let mode = state.config.server.underscore_headers;
        if mode == UnderscoreHeaders::Pass {
            return Ok(());
        }
        let aliased = |name: &[u8]| name.contains(&b'_');
        let found = match &head {
            Some(head) => Fields::Head(head),
            None => Fields::Map(req.headers()),
        }
        .iter()
        .filter(|(name, _)| aliased(name))
        .count();
        if found == 0 {
            return Ok(());
        }
        if mode == UnderscoreHeaders::Reject {
            self.metrics.underscore_headers("rejected", found);
            return Err(ProxyError::BadRequest(
                "a header name with '_' (server.underscore_headers = \"reject\")",
            ));
        }
        match head {
            Some(head) => head.remove_names(aliased),
            None => {
                let names: Vec<header::HeaderName> = req
                    .headers()
                    .keys()
                    .filter(|n| aliased(n.as_str().as_bytes()))
                    .cloned()
                    .collect();
                for name in names {
                    req.headers_mut().remove(name);
                }
            }
        }
        self.metrics.underscore_headers("dropped", found);
        Ok(())
    }

    async fn phases(
        &self,
        state: &State,
        req: &mut Request<RequestBody>,
        peer: SocketAddr,
        keys: &KeyCache,
        ctx: &mut RequestCtx<'_>,
    ) -> Result<Response<Body>, ProxyError> {
        let config = &state.config;

        // 1. match
        let max = config.server.max_header_bytes;
        if head_size(req, ctx.head) > max {
            return Err(ProxyError::HeadersTooLarge(max));
        }
        router::check_method(req.method())?;
        // Routed by its normal form, and forwarded in it, so that sluice
        // and the upstream read one path.
        let normal = match router::normalize(req.uri().path(), config.server.escaped_slashes)? {
            std::borrow::Cow::Borrowed(_) => None,
            std::borrow::Cow::Owned(path) => Some(path),
        };
        if let Some(path) = normal {
            *req.uri_mut() = with_path(req.uri(), &path)
                .ok_or(ProxyError::BadRequest("invalid request target"))?;
        }
        let host = request_host(req, ctx.head)?;
        let route = state
            .router
            .find(
                req.method(),
                host.as_ref().and_then(|h| h.to_str().ok()),
                req.uri().path(),
            )
            .ok_or(ProxyError::NoRoute)?;
        ctx.route = Some(route.name.clone());

        // 2. identify and 3. decide: only a route with a policy needs the
        // client's address (the upstream learns it from X-Forwarded-For).
        let mut ticket: Option<Ticket> = None;
        let mut binding: Option<Binding> = None;
        let mut plan: Option<&Arc<Policy>> = None;
        if let Some(policy) = &route.policy {
            let trusted = &config.server.trusted_proxies;
            let client = identity::client_ip(peer.ip(), fields(req, ctx.head), trusted);
            ctx.client = Some(client);
            // The policy's plan for this client (itself, without plans).
            let policy = match self.limiter.plan_of(
                policy,
                client,
                fields(req, ctx.head),
                req.uri().query(),
                (peer.ip(), trusted),
            ) {
                Ok(policy) => policy,
                Err(PlanError::TooManyValues(_)) => {
                    ctx.decision = "too-many-identities";
                    return Err(ProxyError::TooManyValues);
                }
                Err(PlanError::Mixed) => {
                    ctx.decision = "mixed-plans";
                    return Err(ProxyError::MixedPlans);
                }
            };
            plan = Some(policy);
            // Not timed for the memory store: its decisions take about a
            // microsecond (all in the histogram's first bucket), and the two
            // clock reads cost a fifth of that.
            let asked = matches!(self.limiter.store(), Store::Redis(_)).then(Instant::now);
            let verdict = self
                .limiter
                .decide(
                    policy,
                    route.cost,
                    client,
                    fields(req, ctx.head),
                    req.uri().query(),
                    keys,
                )
                .await;
            if let Some(asked) = asked {
                self.metrics
                    .store_seconds
                    .observe(asked.elapsed().as_secs_f64());
            }
            match verdict {
                Ok(Verdict::Allowed {
                    binding: b,
                    ticket: mut t,
                    delay_ms,
                }) if delay_ms > 0 && policy.mode == Mode::Enforce => {
                    let max = config.server.max_delayed;
                    let Some(_held) = Held::take(&self.delayed, max) else {
                        // Past `server.max_delayed`: refused, and given back.
                        ctx.decision = "limited";
                        state.count_decision(policy, 2);
                        if let Err(e) = self
                            .limiter
                            .settle(t, StatusCode::TOO_MANY_REQUESTS, true, None)
                            .await
                        {
                            log_store_error(&e);
                        }
                        let b = Binding {
                            remaining: 0,
                            retry_ms: delay_ms,
                            refused: 1u64.checked_shl(b.index as u32).unwrap_or(0),
                            ..b
                        };
                        return Ok(self.limited(config, policy, b, ctx));
                    };
                    ctx.decision = "delayed";
                    state.count_decision(policy, 0);
                    // A client that leaves while held gets its units back.
                    let settler = self.limiter.settler();
                    t.give_back_if_dropped(&settler, true);
                    tokio::time::sleep(Duration::from_millis(delay_ms)).await;
                    t.give_back_if_dropped(&settler, false);
                    let label = crate::metrics::PolicyLabel {
                        policy: policy.name.to_string(),
                    };
                    self.metrics.delayed.get_or_create(&label).inc();
                    (self.metrics.delay_seconds.get_or_create(&label))
                        .inc_by(delay_ms as f64 / 1000.0);
                    ctx.delayed_ms = delay_ms;
                    binding = Some(b);
                    ticket = Some(t);
                }
                Ok(Verdict::Allowed {
                    binding: b,
                    ticket: t,
                    ..
                }) => {
                    ctx.decision = "allowed";
                    state.count_decision(policy, 0);
                    binding = Some(b);
                    ticket = Some(t);
                }
                Ok(Verdict::ShadowLimited { binding: b }) => {
                    ctx.decision = "shadow-limited";
                    state.count_decision(policy, 1);
                    tracing::info!(policy = %policy.name, client = %client, "shadow policy would have limited this request");
                    binding = Some(b);
                }
                Ok(Verdict::Limited { binding: b }) => {
                    ctx.decision = "limited";
                    state.count_decision(policy, 2);
                    return Ok(self.limited(config, policy, b, ctx));
                }
                Ok(Verdict::TooManyValues) => {
                    ctx.decision = "too-many-identities";
                    return Err(ProxyError::TooManyValues);
                }
                Err(e) => {
                    ctx.decision = "store-error";
                    state.count_decision(policy, 3);
                    self.metrics.store_errors.inc();
                    log_store_error(&e);
                    if config.store.on_error == OnError::Deny {
                        return Err(ProxyError::StoreUnavailable);
                    }
                }
            }
        }

        // 4. forward
        let outcome = self.forward(route, req, peer, host, state, ctx).await;

        // 5. settle
        let mut outcome = outcome;
        if let Some(ticket) = ticket {
            self.settle(ticket, &mut outcome).await;
        }
        let resp = outcome?;
        if let (Some(b), Some(policy)) = (binding, plan) {
            ctx.limits = Limits::new(config.headers, policy, b);
            if let Some(limits) = &mut ctx.limits {
                limits.delayed(ctx.delayed_ms);
            }
        }
        Ok(resp)
    }

    /// The 429 of a request a limit refused, its fields in `ctx`.
    fn limited(
        &self,
        config: &Config,
        policy: &Arc<Policy>,
        b: Binding,
        ctx: &mut RequestCtx<'_>,
    ) -> Response<Body> {
        let limits = Limits::new(config.headers, policy, b);
        let resp = ProxyError::Limited {
            retry_after: ratelimit_headers::retry_after(&b),
            violated: limits.as_ref().and_then(Limits::violated),
        }
        .response();
        ctx.limits = limits;
        resp
    }

    /// The settle phase: gives back or charges what the answer says, now,
    /// or when its body ends (a `meter` in the trailers or the body's bytes,
    /// and `concurrency` slots, which the body holds).
    async fn settle(&self, ticket: Ticket, outcome: &mut Result<Response<Body>, ProxyError>) {
        let (status, upstream_failed) = match &*outcome {
            Ok(resp) => (resp.status(), false),
            Err(e) => (e.status(), e.is_upstream_failure()),
        };
        let policy = ticket.policy().clone();
        let free = upstream_failed || policy.refund.contains(&status);
        // Made only when a metric needs it (a name copied per request).
        let label = || crate::metrics::PolicyLabel {
            policy: policy.name.to_string(),
        };
        let counters = || {
            let label = label();
            metering::MeterCounters {
                units: self.metrics.metered_units.get_or_create(&label).clone(),
                errors: self.metrics.meter_errors.get_or_create(&label).clone(),
            }
        };
        let meter = policy.meter.as_ref();
        // The meter's value in the answer's head, for a header meter.
        let head = match (meter, &*outcome) {
            (Some(Meter::Header(name)), Ok(resp)) if !free => {
                Some(answer_field(resp, name).and_then(metering::parse_units))
            }
            _ => None,
        };
        let at_end =
            ticket.holds_slots() || matches!(meter, Some(Meter::Trailer(_) | Meter::BodyBytes));
        if let (false, Ok(resp)) = (free, &mut *outcome)
            && at_end
            && let Either::Left(body) = resp.body_mut()
        {
            let counters = meter.map(|_| counters());
            let settler = self.limiter.settler();
            let errors = self.metrics.store_errors.clone();
            body.settle_at_end(metering::Metering::new(
                settler, ticket, status, meter, head, counters, errors,
            ));
            return;
        }
        // Settled now: the answer's own bodies are whole.
        let metered = match (meter, &*outcome) {
            _ if free => None,
            (Some(Meter::BodyBytes), Ok(resp)) => hyper::body::Body::size_hint(resp.body()).exact(),
            (Some(Meter::Header(_)), _) => head.flatten(),
            _ => None,
        };
        if metered.is_none() && matches!(meter, Some(Meter::Header(_))) && !free {
            counters().errors.inc();
        }
        match self
            .limiter
            .settle(ticket, status, upstream_failed, metered)
            .await
        {
            Ok(settled) if settled.refunded => {
                self.metrics.refunds.get_or_create(&label()).inc();
            }
            Ok(settled) => {
                if meter.is_some() {
                    counters().units.inc_by(settled.charged);
                }
            }
            Err(e) => {
                self.metrics.store_errors.inc();
                log_store_error(&e);
            }
        }
    }

    async fn forward(
        &self,
        route: &Route,
        req: &mut Request<RequestBody>,
        peer: SocketAddr,
        host: Option<HeaderValue>,
        state: &State,
        ctx: &mut RequestCtx<'_>,
    ) -> Result<Response<Body>, ProxyError> {
        let timeout = state.config.server.upstream_timeout;
        let upstream = match &route.target {
            Target::Respond {
                status,
                body,
                content_type,
            } => {
                let mut resp = Response::new(Either::Right(Full::new(body.clone())));
                *resp.status_mut() = *status;
                if let Ok(v) = HeaderValue::from_str(content_type) {
                    resp.headers_mut().insert(header::CONTENT_TYPE, v);
                }
                return Ok(resp);
            }
            Target::Upstream(upstream) => upstream,
        };
        // A slot of the client's, held until the answer's body is done with.
        let server_config = &state.config.server;
        let client_ip = ctx.client.unwrap_or_else(|| {
            identity::client_ip(
                peer.ip(),
                fields(req, ctx.head),
                &server_config.trusted_proxies,
            )
        });
        let max = server_config.max_upstream_per_client;
        let slot = self
            .per_client
            .take(client_ip, max)
            .ok_or(ProxyError::ClientBusy(max))?;
        let index = forward::pick(upstream);
        let server = &upstream.servers[index];
        // An Upgrade the route allows (WebSocket...) is passed through: both
        // sides switch, then bytes are copied both ways until either closes.
        // Any other goes on as a plain request, its `Upgrade` removed with
        // the hop-by-hop fields.
        let upgrade = (req.version() == http::Version::HTTP_11)
            .then(|| forward::upgrade_protocol(fields(req, ctx.head), &route.upgrades))
            .flatten();
        let client_side = upgrade.as_ref().map(|_| hyper::upgrade::on(&mut *req));
        let client = state.clients.get(&*upstream.name).unwrap_or(&self.client);
        // A meter read from the trailers asks for them: an HTTP/1.1 server
        // (hyper's, for one) sends trailers only to a client that says it
        // takes them.
        let trailers = matches!(
            route.policy.as_ref().and_then(|p| p.meter.as_ref()),
            Some(Meter::Trailer(_))
        );
        // One clock read, when the request is ready to go, for the deadline
        // and the histogram.
        let sent;
        let result = if UpstreamClient::own_way(server, req, upgrade.is_some()) {
            let head = forward::upstream_head(
                req,
                fields(req, ctx.head),
                upstream,
                server,
                peer.ip(),
                host.as_ref(),
                self.https,
            )
            .map_err(ProxyError::BadRequest)?;
            let mut head = head;
            if trailers {
                let end = head.len() - 2;
                head.truncate(end);
                head.extend_from_slice(b"te: trailers\r\n\r\n");
            }
            // A body read whole goes in the same write, behind the head,
            // which says its length (see `upstream_head`).
            if let RequestBody::Read(body) = req.body() {
                head.extend_from_slice(body);
            }
            let method = req.method().clone();
            let exchange = pin!(client.request_own(server, head, method));
            sent = tokio::time::Instant::now();
            within(sent + timeout, ctx.timer.take(), exchange).await
        } else {
            // hyper's client takes the request itself, with its fields in
            // its map.
            if let Some(head) = ctx.head {
                *req.headers_mut() = head
                    .to_map()
                    .ok_or(ProxyError::BadRequest("invalid header field"))?;
            }
            let req = std::mem::replace(req, Request::new(RequestBody::Empty));
            let mut req = forward::rewrite_request(
                req,
                upstream,
                server,
                peer.ip(),
                host.as_ref(),
                self.https,
                upgrade.as_ref(),
            )
            .map_err(ProxyError::BadRequest)?;
            if trailers {
                req.headers_mut()
                    .insert(header::TE, HeaderValue::from_static("trailers"));
            }
            let body_timeout = server_config.client_body_timeout;
            // Taken whole first when it fits the upstream's `buffer` (not for
            // an upgrade: its body, if any, is the tunnel's).
            if upgrade.is_none() {
                match req.body_mut().take(upstream.buffer, body_timeout).await {
                    Ok(()) => {}
                    Err(pool::TakeError::Stalled) => {
                        return Err(ProxyError::BodyTimeout(body_timeout.as_millis()));
                    }
                    Err(pool::TakeError::Failed) => {
                        return Err(ProxyError::BadRequest(
                            "the request body was malformed or cut off",
                        ));
                    }
                }
            }
            let uploaded = req.body_mut().watch(body_timeout);
            // Boxed: hyper's exchange has a large state, which would size
            // every request's future.
            let mut exchange = Box::pin(client.request(server, req));
            // `upstream_timeout` counts from the end of the upload: a slow
            // but steady client is not the upstream's fault. (An upstream
            // may answer before it has the whole body.)
            let early = match uploaded {
                Some((uploaded, progress)) => {
                    let up = (&mut exchange, uploaded, &*progress);
                    match upload(up, timeout).await {
                        Upload::Answered(out) => Some(out),
                        Upload::Sent => None,
                        Upload::Stalled => {
                            return Err(ProxyError::UpstreamTimeout(timeout.as_millis()));
                        }
                    }
                }
                None => None,
            };
            sent = tokio::time::Instant::now();
            match early {
                Some(out) => Some(out),
                None => within(sent + timeout, ctx.timer.take(), exchange).await,
            }
        };
        let took = sent.elapsed();
        ctx.upstream_time = Some(took);
        if let Some(h) = state.upstream_seconds.get(&addr(upstream)) {
            h.observe(took.as_secs_f64());
        }
        let mut resp = match result {
            None => return Err(ProxyError::UpstreamTimeout(timeout.as_millis())),
            Some(Err(UpstreamError::Http(e))) if pool::is_body_stalled(&e) => {
                let limit = server_config.client_body_timeout;
                return Err(ProxyError::BodyTimeout(limit.as_millis()));
            }
            Some(Err(UpstreamError::Http(e))) if client_body_failed(&e) => {
                return Err(ProxyError::BadRequest(
                    "the request body was malformed or cut off",
                ));
            }
            Some(Err(e)) => {
                if matches!(e, UpstreamError::Connect { .. }) && upstream.servers.len() > 1 {
                    forward::mark_down(upstream, index);
                }
                tracing::warn!(upstream = %upstream.name, server = %server, error = %error_chain(&e), "upstream request failed");
                return Err(ProxyError::UpstreamUnreachable);
            }
            Some(Ok(mut resp)) => {
                resp.body_mut().hold(slot);
                resp
            }
        };
        if resp.status() == StatusCode::SWITCHING_PROTOCOLS && client_side.is_none() {
            // A switch nobody asked for (RFC 9110 15.2.2): what follows is
            // not HTTP/1.1 this proxy could relay. The own client refuses
            // one the same way.
            tracing::warn!(upstream = %upstream.name, server = %server, "upstream answered 101 to a request that asked for no upgrade");
            return Err(ProxyError::UpstreamUnreachable);
        }
        // Both framings (RFC 9112 6.3): the length is wrong and goes; the
        // client gets the chunked body framed anew. (The own client's
        // fields never hold both.)
        if resp.headers().contains_key(header::TRANSFER_ENCODING) {
            resp.headers_mut().remove(header::CONTENT_LENGTH);
        }
        if let (StatusCode::SWITCHING_PROTOCOLS, Some(client_side)) = (resp.status(), client_side) {
            let upstream_side = hyper::upgrade::on(&mut resp);
            tokio::spawn(async move {
                match (client_side.await, upstream_side.await) {
                    (Ok(client), Ok(upstream)) => {
                        let (mut client, mut upstream) =
                            (TokioIo::new(client), TokioIo::new(upstream));
                        let _ = tokio::io::copy_bidirectional(&mut client, &mut upstream).await;
                    }
                    (Err(e), _) | (_, Err(e)) => tracing::debug!(error = %e, "upgrade failed"),
                }
            });
            // The 101 keeps the headers that say what was switched to.
            let protocol = resp.headers().get(header::UPGRADE).cloned();
            forward::strip_hop_by_hop(resp.headers_mut());
            resp.headers_mut()
                .insert(header::CONNECTION, HeaderValue::from_static("upgrade"));
            if let Some(protocol) = protocol {
                resp.headers_mut().insert(header::UPGRADE, protocol);
            }
            return Ok(resp.map(Either::Left));
        }
        forward::strip_hop_by_hop(resp.headers_mut());
        // Read ahead of a slow client, up to the upstream's `buffer`.
        let send_timeout = server_config.client_send_timeout;
        Ok(resp.map(|body| Either::Left(body.read_ahead(upstream.buffer, send_timeout))))
    }
}

/// How the upload of a request body ended (see [`upload`]).
enum Upload<T> {
    /// The upstream answered before it had the whole body.
    Answered(T),
    /// All of it was handed to the upstream connection.
    Sent,
    /// The upstream took nothing for `upstream_timeout` while the client
    /// had sent all it was asked for.
    Stalled,
}

/// Waits while a request body goes upstream: `upstream_timeout` does not
/// run then (the client's pace is not the upstream's fault), but an
/// upstream that stops taking the body is given that long.
async fn upload<F: Future + Unpin>(
    (exchange, mut sent, progress): (F, tokio::sync::oneshot::Receiver<()>, &pool::Progress),
    timeout: Duration,
) -> Upload<F::Output> {
    let mut exchange = exchange;
    let check = tokio::time::sleep(timeout);
    tokio::pin!(check);
    loop {
        tokio::select! {
            out = &mut exchange => return Upload::Answered(out),
            _ = &mut sent => return Upload::Sent,
            _ = &mut check => {
                let stalled = progress.upstream_stalled_for();
                if stalled >= timeout {
                    return Upload::Stalled;
                }
                check.as_mut().reset(tokio::time::Instant::now() + (timeout - stalled));
            }
        }
    }
}

/// A request held by a `gcra` limit's `delay`, counted in
/// `server.max_delayed` while it waits.
struct Held<'a>(&'a std::sync::atomic::AtomicUsize);

impl<'a> Held<'a> {
    /// A place among the `max` held requests, if one is free.
    fn take(count: &'a std::sync::atomic::AtomicUsize, max: usize) -> Option<Held<'a>> {
        use std::sync::atomic::Ordering;
        count
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < max).then_some(n + 1)
            })
            .ok()
            .map(|_| Held(count))
    }
}

impl Drop for Held<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, std::sync::atomic::Ordering::AcqRel);
    }
}

/// A field of an upstream's answer, from its map or, when sluice's own
/// client read it, its fields.
fn answer_field<'a>(resp: &'a Response<Body>, name: &header::HeaderName) -> Option<&'a [u8]> {
    if let Some(v) = resp.headers().get(name) {
        return Some(v.as_bytes());
    }
    match resp.body() {
        Either::Left(body) => body.field(name),
        Either::Right(_) => None,
    }
}

/// What [`Proxy::handle`] answers a request with.
pub struct Answer {
    pub resp: Response<Body>,
    /// The rate-limit fields, written beside the response's own.
    pub limits: Option<Limits>,
}

impl Answer {
    /// The response with what travels beside it in its header map, for
    /// hyper's server: the upstream's fields as the own client read them,
    /// then the rate-limit fields (which replace the upstream's of the same
    /// names).
    pub fn into_response(self) -> Response<Body> {
        let Answer { mut resp, limits } = self;
        if let Either::Left(body) = resp.body_mut()
            && let Some(fields) = body.detach()
        {
            fields.append_to(resp.headers_mut());
        }
        if let Some(limits) = limits {
            limits.insert(resp.headers_mut());
        }
        resp
    }
}

/// An error and its causes, `a: b: c`: "client error (Connect)" alone does
/// not tell a refused connection from an untrusted certificate.
fn error_chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut text = e.to_string();
    let mut cause = e.source();
    while let Some(c) = cause {
        text.push_str(": ");
        text.push_str(&c.to_string());
        cause = c.source();
    }
    text
}

/// Milliseconds to the microsecond, for the log.
fn millis(d: Duration) -> f64 {
    d.as_micros() as f64 / 1000.0
}

/// The request's host: the `Host` header, or for HTTP/2 the `:authority`.
/// HTTP/1.1 requires one (RFC 9112 §3.2).
fn request_host(
    req: &Request<RequestBody>,
    head: Option<&HeadFields>,
) -> Result<Option<HeaderValue>, ProxyError> {
    const TWO: ProxyError = ProxyError::BadRequest("more than one Host header");
    let host = match head {
        Some(head) => {
            let mut hosts = Fields::Head(head).values(&header::HOST);
            match (hosts.next(), hosts.next()) {
                (Some(_), Some(_)) => return Err(TWO),
                // A slice of the head, not a copy.
                (Some(h), None) => Some(
                    HeaderValue::from_maybe_shared(head.share(h))
                        .map_err(|_| ProxyError::BadRequest("invalid Host header"))?,
                ),
                (None, _) => None,
            }
        }
        None => {
            let mut hosts = req.headers().get_all(header::HOST).iter();
            match (hosts.next(), hosts.next()) {
                (Some(_), Some(_)) => return Err(TWO),
                (h, _) => h.cloned(),
            }
        }
    };
    let host = match (host, req.uri().authority()) {
        // HTTP/2: a Host beside `:authority` must name the same (RFC 9113
        // 8.3.1), or sluice and the upstream could each read another.
        (Some(h), Some(a)) if req.version() == Version::HTTP_2 => {
            if !h.as_bytes().eq_ignore_ascii_case(a.as_str().as_bytes()) {
                return Err(ProxyError::BadRequest("Host differs from :authority"));
            }
            h
        }
        // The target's authority; over HTTP/1.1 (absolute-form) it wins
        // over Host (RFC 9112 3.2.2).
        (_, Some(a)) => HeaderValue::from_str(a.as_str())
            .map_err(|_| ProxyError::Refused(router::Refused::Host("invalid authority")))?,
        (Some(h), None) => h,
        (None, None) if req.version() == Version::HTTP_11 => {
            return Err(ProxyError::BadRequest("HTTP/1.1 request without Host"));
        }
        (None, None) => return Ok(None),
    };
    // Compared and forwarded in its normal form (lowercase, no trailing
    // dot, its port checked).
    let normal = match router::normalize_host(host.as_bytes())? {
        std::borrow::Cow::Borrowed(_) => None,
        std::borrow::Cow::Owned(n) => Some(n),
    };
    match normal {
        None => Ok(Some(host)),
        Some(n) => HeaderValue::from_maybe_shared(Bytes::from(n))
            .map(Some)
            .map_err(|_| ProxyError::BadRequest("invalid Host header")),
    }
}

/// `uri` with its path replaced by `path` (its query kept as it came).
fn with_path(uri: &http::Uri, path: &str) -> Option<http::Uri> {
    let mut target = String::with_capacity(path.len() + uri.query().map_or(0, |q| q.len() + 1));
    target.push_str(path);
    if let Some(query) = uri.query() {
        target.push('?');
        target.push_str(query);
    }
    let mut parts = uri.clone().into_parts();
    parts.path_and_query = Some(http::uri::PathAndQuery::try_from(target).ok()?);
    http::Uri::from_parts(parts).ok()
}

/// True when an upstream call failed because the client's own body did (bad
/// chunked encoding, a client that went away mid-upload): the client's fault.
fn client_body_failed(e: &hyper::Error) -> bool {
    if e.is_user() {
        return true;
    }
    let mut cause = std::error::Error::source(e);
    while let Some(c) = cause {
        if c.downcast_ref::<hyper::Error>()
            .is_some_and(hyper::Error::is_user)
        {
            return true;
        }
        cause = c.source();
    }
    false
}

/// The size of the request head as the client sent it, near enough.
fn head_size(req: &Request<RequestBody>, head: Option<&HeadFields>) -> usize {
    if let Some(head) = head {
        return head.head().len();
    }
    let uri = req.uri();
    let target = uri.path_and_query().map_or(1, |p| p.as_str().len())
        + uri.authority().map_or(0, |a| a.as_str().len());
    let line = req.method().as_str().len() + target + 12;
    req.headers()
        .iter()
        .fold(line, |n, (k, v)| n + k.as_str().len() + v.len() + 4)
}

/// The request's fields: read by the front (`head`), or in its map.
fn fields<'a>(req: &'a Request<RequestBody>, head: Option<&'a HeadFields>) -> Fields<'a> {
    match head {
        Some(head) => Fields::Head(head),
        None => Fields::Map(req.headers()),
    }
}

fn log_store_error(e: &StoreError) {
    crate::store::log_error(e, "rate-limit store call failed");
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decisions_are_counted_by_policy_and_plan() {
        let text = r#"
[upstreams.api]
url = "http://127.0.0.1:1"
[policies.api]
limits = [{ limit = 5, window = "1m" }]
[policies.api.plans.gold]
limits = [{ limit = 50, window = "1m" }]
"#;
        let config =
            crate::config::parse(text, "test.toml", std::path::Path::new(".")).expect("valid");
        let own = config.policies[0].clone();
        // A named plan is a policy value of its own, kept by its policy.
        let gold = own.plans[0].clone();
        let metrics = Metrics::default();
        let state = State::new(config, &metrics).expect("a state");
        state.count_decision(&own, 0);
        state.count_decision(&gold, 2);
        state.count_decision(&gold, 2);
        let text = metrics.render();
        for sample in [
            r#"sluice_decisions_total{policy="api",plan="default",outcome="allowed"} 1"#,
            r#"sluice_decisions_total{policy="api",plan="gold",outcome="limited"} 2"#,
            r#"sluice_decisions_total{policy="api",plan="gold",outcome="allowed"} 0"#,
        ] {
            assert!(text.lines().any(|l| l == sample), "{sample} in\n{text}");
        }
    }
}
