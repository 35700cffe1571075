//! Configuration: reading the TOML file, checking it, and the compiled form the
//! proxy runs on.
//!
//! - `raw.rs` mirrors the file (serde, unknown keys refused, spans kept);
//! - `compile.rs` checks every value and resolves names, collecting one
//!   `file:line: what` message per problem;
//! - this file holds the compiled types, [`load`] and [`parse`], and the listing
//!   `sluice check` prints.

mod compile;
pub mod duration;
mod raw;

use std::fmt;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderName, Method, StatusCode};
use ipnet::IpNet;

/// Why a configuration could not be used.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("{path}: cannot read the configuration: {source}")]
    Read {
        path: String,
        source: std::io::Error,
    },
    /// One line per problem, each `file:line: what is wrong`.
    #[error("{}", .0.join("\n"))]
    Invalid(Vec<String>),
}

/// A checked configuration, ready to serve.
#[derive(Debug)]
pub struct Config {
    pub server: ServerConfig,
    pub store: StoreConfig,
    pub headers: HeaderStyle,
    pub upstreams: Vec<Arc<Upstream>>,
    pub policies: Vec<Arc<Policy>>,
    pub routes: Vec<Route>,
}

#[derive(Debug, Clone)]
pub struct ServerConfig {
    pub listen: SocketAddr,
    /// Worker threads; 0 means one per core.
    pub workers: usize,
    pub admin_listen: Option<SocketAddr>,
    pub trusted_proxies: Vec<IpNet>,
    pub upstream_timeout: Duration,
    pub max_header_bytes: usize,
    pub shutdown_timeout: Duration,
    /// A client connection with no request in flight is closed when no
    /// request head has arrived for this long.
    pub header_timeout: Duration,
    /// A client that sends no request body bytes for this long gets 408.
    pub client_body_timeout: Duration,
    /// A client that accepts no response bytes for this long is cut.
    pub client_send_timeout: Duration,
    /// Client connections served at once; more wait in the listen backlog.
    pub max_connections: usize,
    /// The listen backlog asked of the kernel (start only).
    pub listen_backlog: u32,
    /// HTTP/2 streams at once per client connection.
    pub max_streams: u32,
    /// Upstream exchanges in flight at once per client address.
    pub max_upstream_per_client: usize,
    pub tls: Option<TlsFiles>,
    /// What an encoded slash or backslash in a path gets (see `router::normalize`).
    pub escaped_slashes: EscapedSlashes,
    /// What a request header whose name holds `_` gets.
    pub underscore_headers: UnderscoreHeaders,
    /// Requests held at once by `gcra` limits' `delay`; past it, 429.
    pub max_delayed: usize,
}

/// `server.escaped_slashes`: `%2F`, `%5C` and `\` in a request path.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum EscapedSlashes {
    /// 400 (the default).
    #[default]
    Reject,
    /// Segment separators, before dot segments are resolved.
    Decode,
    /// Characters of their segment.
    Keep,
}

/// `server.underscore_headers`: request header names with `_`, which
/// CGI-style backends (WSGI, Rack) read as the same as with `-`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum UnderscoreHeaders {
    /// Removed before anything reads them (the default, as nginx does).
    #[default]
    Drop,
    /// 400.
    Reject,
    /// Kept and forwarded.
    Pass,
}

#[derive(Debug, Clone)]
pub struct TlsFiles {
    pub cert: PathBuf,
    pub key: PathBuf,
}

#[derive(Debug, Clone, PartialEq)]
pub struct StoreConfig {
    pub backend: Backend,
    pub url: Option<String>,
    pub cluster: Vec<String>,
    pub timeout: Duration,
    pub ca: Option<PathBuf>,
    pub on_error: OnError,
    pub clock: ClockSource,
    pub prefix: String,
    pub deny_cache: bool,
    /// Memory store only: the most counters kept at once (bounds memory under a
    /// flood of distinct identities).
    pub max_keys: usize,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    Memory,
    Redis,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OnError {
    Allow,
    Deny,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ClockSource {
    Redis,
    Local,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HeaderStyle {
    XRateLimit,
    Ietf,
    Both,
    None,
}

/// A named upstream: one or more servers used in turn.
#[derive(Debug)]
pub struct Upstream {
    pub name: Arc<str>,
    pub servers: Vec<UpstreamServer>,
    pub ca: Option<PathBuf>,
    /// Send the client's `Host` upstream instead of the server's own authority.
    pub pass_host: bool,
    /// Response bytes read ahead of a slow client (0: streamed as the
    /// client takes them).
    pub buffer: usize,
    /// Round-robin position: runtime state, but one counter per upstream is all
    /// balancing needs, and it lives and dies with this config.
    pub next: std::sync::atomic::AtomicUsize,
    /// Per server: unix ms until which it is skipped after refusing a
    /// connection (passive health).
    pub down_until: Vec<std::sync::atomic::AtomicU64>,
}

#[derive(Debug, Clone)]
pub struct UpstreamServer {
    pub scheme: http::uri::Scheme,
    pub authority: http::uri::Authority,
    /// A path the request path is appended to ("" for none).
    pub base_path: String,
    /// `authority` as a ready `Host` header value.
    pub host: http::HeaderValue,
    /// Its upstream's idle-connection settings.
    pub keepalive: Keepalive,
}

/// An upstream's `keepalive` and `keepalive_timeout`: idle connections
/// kept per server, and how long one may stay idle.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Keepalive {
    pub idle: usize,
    pub timeout: Duration,
}

impl Default for Keepalive {
    fn default() -> Keepalive {
        Keepalive {
            idle: 1024,
            timeout: Duration::from_secs(60),
        }
    }
}

impl fmt::Display for UpstreamServer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}://{}{}", self.scheme, self.authority, self.base_path)
    }
}

/// Who a limit counts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KeySpec {
    Ip,
    Header(HeaderName),
    Query(String),
    Global,
}

impl fmt::Display for KeySpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            KeySpec::Ip => f.write_str("ip"),
            KeySpec::Header(name) => write!(f, "header:{name}"),
            KeySpec::Query(name) => write!(f, "query:{name}"),
            KeySpec::Global => f.write_str("global"),
        }
    }
}

impl std::str::FromStr for KeySpec {
    type Err = String;

    /// `ip`, `global`, `header:NAME` or `query:NAME`.
    fn from_str(text: &str) -> Result<KeySpec, String> {
        match text.split_once(':') {
            None if text == "ip" => Ok(KeySpec::Ip),
            None if text == "global" => Ok(KeySpec::Global),
            Some(("header", name)) => HeaderName::from_bytes(name.as_bytes())
                .map(KeySpec::Header)
                .map_err(|_| format!("'{name}' is not a valid header name")),
            Some(("query", name)) if !name.is_empty() => Ok(KeySpec::Query(name.to_string())),
            _ => Err(format!(
                "unknown key '{text}' (use \"ip\", \"header:NAME\", \"query:NAME\" or \"global\")"
            )),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Algorithm {
    Fixed,
    Sliding {
        precision: Duration,
    },
    Log,
    /// `delay`: a request that would pass within it is held, then passes.
    Gcra {
        burst: u64,
        delay: Duration,
    },
    /// Requests in flight at once; a slot lives `lease` unless renewed.
    Concurrency {
        lease: Duration,
    },
}

impl fmt::Display for Algorithm {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Algorithm::Fixed => f.write_str("fixed"),
            Algorithm::Sliding { precision } => {
                write!(f, "sliding (precision {})", duration::format(*precision))
            }
            Algorithm::Log => f.write_str("log"),
            Algorithm::Gcra { burst, delay } if delay.is_zero() => {
                write!(f, "gcra (burst {burst})")
            }
            Algorithm::Gcra { burst, delay } => {
                write!(
                    f,
                    "gcra (burst {burst}, delay {})",
                    duration::format(*delay)
                )
            }
            Algorithm::Concurrency { lease } => {
                write!(f, "concurrency (lease {})", duration::format(*lease))
            }
        }
    }
}

impl Algorithm {
    /// The short name used in keys, metrics and the usage API.
    pub fn name(&self) -> &'static str {
        match self {
            Algorithm::Fixed => "fixed",
            Algorithm::Sliding { .. } => "sliding",
            Algorithm::Log => "log",
            Algorithm::Gcra { .. } => "gcra",
            Algorithm::Concurrency { .. } => "concurrency",
        }
    }
}

/// One limit of a policy: `limit` units per `window`, for each identity in `keys`.
#[derive(Debug, Clone)]
pub struct Limit {
    pub limit: u64,
    /// A calendar window's nominal length (see [`crate::calendar::Unit::nominal_ms`]).
    pub window: Duration,
    /// A `fixed` window that starts at midnight, on Monday or on the first of
    /// the month in its policy's `timezone`: `"1w"`, `"1mo"`, and `"1d"`
    /// outside UTC. `None`: windows aligned to the unix epoch.
    pub calendar: Option<crate::calendar::Calendar>,
    pub algorithm: Algorithm,
    pub keys: Vec<KeySpec>,
    /// Stable name of this limit inside its policy, e.g. `1m:fixed`: counters are
    /// stored under it, so reordering limits or reloading keeps them.
    pub id: String,
}

impl Limit {
    /// The window as the config writes it: `"1m"`, `"1w"`, `"1mo"`.
    pub fn window_text(&self) -> String {
        if let Algorithm::Concurrency { .. } = self.algorithm {
            return "concurrency".to_string();
        }
        match &self.calendar {
            Some(c) => c.unit.text().to_string(),
            None => duration::format(self.window),
        }
    }
}

/// A policy's `meter`: where a response tells what its request cost.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Meter {
    /// A field of the response's head.
    Header(HeaderName),
    /// A trailer field, read when the body ends.
    Trailer(HeaderName),
    /// The body bytes sent to the client.
    BodyBytes,
}

impl fmt::Display for Meter {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Meter::Header(name) => write!(f, "header:{name}"),
            Meter::Trailer(name) => write!(f, "trailer:{name}"),
            Meter::BodyBytes => f.write_str("body-bytes"),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Charge {
    Reserve,
    After,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    Enforce,
    Shadow,
}

/// The name of a policy's own `limits` as a plan.
pub const DEFAULT_PLAN: &str = "default";

#[derive(Debug)]
pub struct Policy {
    pub name: Arc<str>,
    /// The plan these limits are: [`DEFAULT_PLAN`] for the policy's own
    /// `limits`, else the name of one of its `plans`.
    pub plan: Arc<str>,
    /// IPv6 clients are counted by their network of this many bits.
    pub ipv6_prefix: u8,
    /// `timezone`, the IANA name its calendar windows follow ("UTC" by default).
    pub timezone: Arc<str>,
    pub charge: Charge,
    pub refund: Vec<StatusCode>,
    pub mode: Mode,
    /// `meter`: where the response says what a request really cost.
    pub meter: Option<Meter>,
    pub limits: Vec<Limit>,
    /// The distinct key specs of its limits, in order of first use: a request
    /// has one identity for each.
    pub specs: Vec<KeySpec>,
    /// The policy's named plans (each a `Policy` of its own, with the same
    /// name, settings and limit shapes, its own limits, and no plans), in
    /// file order; empty for a policy without plans and for a plan itself.
    pub plans: Vec<Arc<Policy>>,
    /// The key spec whose value picks an identity's plan (a policy with plans).
    pub plan_key: Option<KeySpec>,
    /// The header a trusted proxy names an identity's plan in.
    pub plan_header: Option<HeaderName>,
    /// The file's assignments: identity value → index into `plans`.
    pub assign: std::collections::HashMap<Vec<u8>, usize>,
    /// The IETF rate-limit headers' texts, made once.
    pub ietf: IetfTexts,
    /// For each limit, the constant start of its x-ratelimit fields as
    /// HTTP/1.1 head lines: `x-ratelimit-limit: LIMIT\r\nx-ratelimit-remaining: `
    /// (sluice's own front copies it in one piece; see
    /// `proxy::ratelimit_headers`).
    pub x_heads: Vec<String>,
}

impl Policy {
    /// This policy's settings with other `limits` (their ids final), as plan
    /// `plan`: its header texts and key specs made for them; no plans.
    pub fn variant(&self, plan: &str, limits: Vec<Limit>) -> Policy {
        let mut specs: Vec<KeySpec> = Vec::new();
        for spec in limits.iter().flat_map(|l| &l.keys) {
            if !specs.contains(spec) {
                specs.push(spec.clone());
            }
        }
        Policy {
            ietf: IetfTexts::new(
                &self.name,
                plan,
                &limits,
                self.meter == Some(Meter::BodyBytes),
            ),
            x_heads: limits
                .iter()
                .map(|l| format!("x-ratelimit-limit: {}\r\nx-ratelimit-remaining: ", l.limit))
                .collect(),
            name: self.name.clone(),
            plan: Arc::from(plan),
            ipv6_prefix: self.ipv6_prefix,
            timezone: self.timezone.clone(),
            charge: self.charge,
            refund: self.refund.clone(),
            mode: self.mode,
            meter: self.meter.clone(),
            limits,
            specs,
            plans: Vec::new(),
            plan_key: self.plan_key.clone(),
            plan_header: self.plan_header.clone(),
            assign: Default::default(),
        }
    }

    /// The plan named `name` (the default plan is this policy), if it has one.
    pub fn plan_index(&self, name: &[u8]) -> Option<usize> {
        self.plans.iter().position(|p| p.plan.as_bytes() == name)
    }
}

/// What the IETF rate-limit headers (`RateLimit-Policy`, `RateLimit`, of
/// draft-ietf-httpapi-ratelimit-headers-11) say of a plan that does not
/// change from one answer to the next. Made per answer, they cost as much as
/// the rest of a request.
///
/// There is always at least one item: a plan without limits (one that
/// refuses everything) is described as one item of quota 0 and no window,
/// `"policy-plan";q=0`, since the draft's `RateLimit-Policy` is a non-empty
/// list and `q=0` is what such a plan grants.
#[derive(Debug)]
pub struct IetfTexts {
    /// Each item's name as the client reads it: `policy-window`
    /// (`standard-1m`) for the policy's own limits, `policy-plan-window`
    /// (`api-gold-1m`) for a named plan's, with `-INDEX` when two limits
    /// share a window; printable ASCII only. The 429 body's
    /// `violated-policies` lists these.
    pub ids: Vec<String>,
    /// The same names as structured-field strings (quoted, escaped).
    pub names: Vec<String>,
    /// For each item, the `RateLimit-Policy` value that lists it first (on a
    /// 429 the binding limit is the one that denied), then the others:
    /// `"name";q=LIMIT;w=WINDOW_SECONDS, ...`.
    pub lists: Vec<String>,
}

impl IetfTexts {
    /// The texts of `limits`, plan `plan` of policy `policy`; `bytes`: its
    /// units are the body's bytes (`meter = "body-bytes"`), said by the
    /// items' quota unit, `qu="content-bytes"`.
    pub fn new(policy: &str, plan: &str, limits: &[Limit], bytes: bool) -> IetfTexts {
        let prefix = if plan == DEFAULT_PLAN {
            policy.to_string()
        } else {
            format!("{policy}-{plan}")
        };
        let ids: Vec<String> = if limits.is_empty() {
            vec![printable(&prefix)]
        } else {
            (0..limits.len())
                .map(|i| item_id(&prefix, limits, i))
                .collect()
        };
        let names: Vec<String> = ids.iter().map(|id| sf_string(id)).collect();
        let item = |i: usize| match limits.get(i) {
            Some(l) if matches!(l.algorithm, Algorithm::Concurrency { .. }) => {
                format!("{};q={};qu=\"concurrent-requests\"", names[i], l.limit)
            }
            Some(l) => format!(
                "{};q={}{};w={}",
                names[i],
                l.limit,
                if bytes { ";qu=\"content-bytes\"" } else { "" },
                // A window under a second is shown as one: w is a positive
                // whole number of seconds.
                (l.window.as_millis() as u64).div_ceil(1000).max(1)
            ),
            None => format!("{};q=0", names[i]),
        };
        let lists = (0..names.len())
            .map(|first| {
                std::iter::once(first)
                    .chain((0..names.len()).filter(|&i| i != first))
                    .map(item)
                    .collect::<Vec<_>>()
                    .join(", ")
            })
            .collect();
        IetfTexts { ids, names, lists }
    }

    /// Item `i`'s structured-field name; the first item's if there is no
    /// such item.
    pub fn name(&self, i: usize) -> &str {
        self.names.get(i).or(self.names.first()).map_or("", |s| s)
    }

    /// The `RateLimit-Policy` value that lists item `i` first (see
    /// [`IetfTexts::name`] for an `i` out of range).
    pub fn list(&self, i: usize) -> &str {
        self.lists.get(i).or(self.lists.first()).map_or("", |s| s)
    }

    /// The names of the items whose bit is set in `refused` (bit `i`: item
    /// `i`), or item `binding`'s alone when none is.
    pub fn violated(&self, refused: u64, binding: usize) -> Vec<String> {
        let named: Vec<String> = (self.ids.iter().enumerate())
            .filter(|(i, _)| *i < 64 && refused & (1 << i) != 0)
            .map(|(_, id)| id.clone())
            .collect();
        if !named.is_empty() {
            return named;
        }
        let id = self.ids.get(binding).or(self.ids.first());
        id.into_iter().cloned().collect()
    }
}

/// The name of limit `i` of a plan whose names start with `prefix`.
fn item_id(prefix: &str, limits: &[Limit], i: usize) -> String {
    let window = limits[i].window_text();
    let mut name = format!("{prefix}-{window}");
    if limits.iter().filter(|o| o.window_text() == window).count() > 1 {
        name += &format!("-{i}");
    }
    printable(&name)
}

/// `text` without what a structured-field string cannot hold (anything but
/// printable ASCII).
fn printable(text: &str) -> String {
    text.chars().filter(|c| (' '..='~').contains(c)).collect()
}

/// `text` (printable ASCII) as a structured-field string: quoted, with
/// quotes and backslashes escaped.
fn sf_string(text: &str) -> String {
    let mut out = String::with_capacity(text.len() + 2);
    out.push('"');
    for c in text.chars() {
        if c == '"' || c == '\\' {
            out.push('\\');
        }
        out.push(c);
    }
    out.push('"');
    out
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PathMatch {
    Exact(String),
    Prefix(String),
}

#[derive(Debug, Clone)]
pub enum Target {
    Upstream(Arc<Upstream>),
    Respond {
        status: StatusCode,
        body: Bytes,
        content_type: String,
    },
}

#[derive(Debug, Clone)]
pub struct Route {
    /// `name` from the file, or the path: what logs and metrics call it.
    pub name: Arc<str>,
    pub path: PathMatch,
    pub methods: Option<Vec<Method>>,
    /// Lowercase, without a port.
    pub host: Option<String>,
    /// `Upgrade` protocol names passed through, lowercase (never `h2c`).
    pub upgrades: Vec<String>,
    pub target: Target,
    pub policy: Option<Arc<Policy>>,
    pub cost: u64,
}

/// Reads and checks the file at `path`.
pub fn load(path: &Path) -> Result<Config, ConfigError> {
    let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
        path: path.display().to_string(),
        source,
    })?;
    let base = path.parent().unwrap_or(Path::new("."));
    parse(&text, &path.display().to_string(), base)
}

/// Checks configuration `text`; `name` is used in messages and relative file
/// names in it are taken from `base`.
pub fn parse(text: &str, name: &str, base: &Path) -> Result<Config, ConfigError> {
    compile::compile(text, name, base)
}

impl fmt::Display for Config {
    /// The listing printed by `sluice check`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let s = &self.server;
        let tls = if s.tls.is_some() { " (TLS)" } else { "" };
        writeln!(f, "server: listen {}{tls}, workers {}", s.listen, s.workers)?;
        writeln!(
            f,
            "clients: max_connections {}, listen_backlog {}, max_streams {}, max_upstream_per_client {}, max_delayed {}, escaped_slashes {}, underscore_headers {}",
            s.max_connections,
            s.listen_backlog,
            s.max_streams,
            s.max_upstream_per_client,
            s.max_delayed,
            // As the file spells them.
            format!("{:?}", s.escaped_slashes).to_ascii_lowercase(),
            format!("{:?}", s.underscore_headers).to_ascii_lowercase()
        )?;
        writeln!(
            f,
            "timeouts: header {}, client_body {}, upstream {}, client_send {}",
            duration::format(s.header_timeout),
            duration::format(s.client_body_timeout),
            duration::format(s.upstream_timeout),
            duration::format(s.client_send_timeout)
        )?;
        if !s.trusted_proxies.is_empty() {
            let nets: Vec<String> = s.trusted_proxies.iter().map(|n| n.to_string()).collect();
            writeln!(f, "trusted proxies: {}", nets.join(", "))?;
        }
        if let Some(admin) = s.admin_listen {
            writeln!(f, "admin: {admin}")?;
        }
        let store = match self.store.backend {
            Backend::Memory => "memory".to_string(),
            Backend::Redis => match &self.store.url {
                Some(url) => format!("redis {}", redact(url)),
                None => format!("redis cluster {}", self.store.cluster.len()),
            },
        };
        writeln!(f, "store: {store}")?;
        writeln!(f, "upstreams:")?;
        for u in &self.upstreams {
            let servers: Vec<String> = u.servers.iter().map(|s| s.to_string()).collect();
            let keep = u.servers.first().map(|s| s.keepalive).unwrap_or_default();
            writeln!(
                f,
                "  {}: {} (buffer {} bytes, keepalive {} for {})",
                u.name,
                servers.join(", "),
                u.buffer,
                keep.idle,
                duration::format(keep.timeout)
            )?;
        }
        writeln!(f, "policies:")?;
        for p in &self.policies {
            let charge = match p.charge {
                Charge::Reserve => "reserve",
                Charge::After => "after",
            };
            let mode = match p.mode {
                Mode::Enforce => "enforce",
                Mode::Shadow => "shadow",
            };
            let refund: Vec<&str> = p.refund.iter().map(|s| s.as_str()).collect();
            writeln!(
                f,
                "  {}: charge {charge} (refund {}), mode {mode}, IPv6 clients by /{}, timezone {}",
                p.name,
                refund.join(","),
                p.ipv6_prefix,
                p.timezone
            )?;
            if let Some(meter) = &p.meter {
                writeln!(
                    f,
                    "    metered by {meter} (the route's cost is the estimate)"
                )?;
            }
            write_limits(f, "    ", &p.limits)?;
            if let Some(spec) = &p.plan_key {
                let header = p
                    .plan_header
                    .as_ref()
                    .map(|h| format!(", or header {h} from a trusted proxy"))
                    .unwrap_or_default();
                writeln!(f, "    plans by {spec}{header}:")?;
            }
            for plan in &p.plans {
                writeln!(f, "    plan {}:", plan.plan)?;
                if plan.limits.is_empty() {
                    writeln!(f, "      refuses every request")?;
                }
                write_limits(f, "      ", &plan.limits)?;
            }
            let mut assigned: Vec<(String, &str)> = p
                .assign
                .iter()
                .map(|(value, &i)| {
                    (
                        String::from_utf8_lossy(value).into_owned(),
                        &*p.plans[i].plan,
                    )
                })
                .collect();
            assigned.sort();
            for (value, plan) in assigned.iter().take(20) {
                writeln!(f, "    assign {value:?} -> {plan}")?;
            }
            if assigned.len() > 20 {
                writeln!(f, "    ... and {} more assignments", assigned.len() - 20)?;
            }
        }
        writeln!(f, "routes (in match order):")?;
        for r in crate::router::Router::ordered(&self.routes, self.server.escaped_slashes) {
            let path = match &r.path {
                PathMatch::Exact(p) => format!("={p}"),
                PathMatch::Prefix(p) => p.clone(),
            };
            let mut line = format!("  {path}");
            if let Some(host) = &r.host {
                line += &format!(" host {host}");
            }
            if let Some(methods) = &r.methods {
                let m: Vec<&str> = methods.iter().map(|m| m.as_str()).collect();
                line += &format!(" [{}]", m.join(","));
            }
            match &r.target {
                Target::Upstream(u) => line += &format!(" -> {}", u.name),
                Target::Respond { status, .. } => {
                    line += &format!(" -> respond {}", status.as_u16())
                }
            }
            if let Some(p) = &r.policy {
                line += &format!(", policy {}", p.name);
                if r.cost != 1 {
                    line += &format!(" (cost {})", r.cost);
                }
            }
            writeln!(f, "{line}")?;
        }
        Ok(())
    }
}

/// One line per limit, for `sluice check`.
fn write_limits(f: &mut fmt::Formatter<'_>, indent: &str, limits: &[Limit]) -> fmt::Result {
    for l in limits {
        let keys: Vec<String> = l.keys.iter().map(|k| k.to_string()).collect();
        let calendar = if l.calendar.is_some() {
            " (calendar)"
        } else {
            ""
        };
        if let Algorithm::Concurrency { .. } = l.algorithm {
            writeln!(
                f,
                "{indent}{} in flight by {}, {}",
                l.limit,
                keys.join(" + "),
                l.algorithm
            )?;
            continue;
        }
        writeln!(
            f,
            "{indent}{} per {} by {}, {}{calendar}",
            l.limit,
            l.window_text(),
            keys.join(" + "),
            l.algorithm
        )?;
    }
    Ok(())
}

/// Hides a password in a store URL before it is printed or logged.
pub fn redact(url: &str) -> String {
    match (url.find("://"), url.rfind('@')) {
        (Some(scheme_end), Some(at)) if at > scheme_end => {
            format!("{}://***@{}", &url[..scheme_end], &url[at + 1..])
        }
        _ => url.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ietf_texts_name_each_limit_and_list_each_first() {
        let text = r#"
[upstreams.api]
url = "http://127.0.0.1:1"
[policies.'a"b']
limits = [
  { limit = 5, window = "1m" },
  { limit = 7, window = "1m", key = "header:X-Key" },
  { limit = 100, window = "1h" },
]
"#;
        let config = parse(text, "test.toml", Path::new(".")).expect("valid");
        let ietf = &config.policies[0].ietf;
        assert_eq!(
            ietf.names,
            [r#""a\"b-1m-0""#, r#""a\"b-1m-1""#, r#""a\"b-1h""#]
        );
        assert_eq!(
            ietf.lists[1],
            r#""a\"b-1m-1";q=7;w=60, "a\"b-1m-0";q=5;w=60, "a\"b-1h";q=100;w=3600"#
        );
        assert!(ietf.lists[2].starts_with(r#""a\"b-1h";q=100;w=3600, "a\"b-1m-0""#));
    }

    #[test]
    fn ietf_texts_name_the_plan_and_describe_one_without_limits() {
        let text = r#"
[upstreams.api]
url = "http://127.0.0.1:1"
[policies.api]
limits = [{ limit = 1000, window = "1m" }, { limit = 5, window = "250ms" }]
"#;
        let config = parse(text, "test.toml", Path::new(".")).expect("valid");
        let limits = &config.policies[0].limits;
        // The default plan keeps the names it always had.
        let default = IetfTexts::new("api", DEFAULT_PLAN, limits, false);
        assert_eq!(default.ids, ["api-1m", "api-250ms"]);
        // A named plan's items say the plan; a window under a second is w=1.
        let gold = IetfTexts::new("api", "gold", limits, false);
        assert_eq!(gold.ids, ["api-gold-1m", "api-gold-250ms"]);
        assert_eq!(
            gold.list(1),
            r#""api-gold-250ms";q=5;w=1, "api-gold-1m";q=1000;w=60"#
        );
        assert_eq!(gold.violated(0b11, 0), ["api-gold-1m", "api-gold-250ms"]);
        assert_eq!(gold.violated(0, 1), ["api-gold-250ms"]);
        // A plan that refuses everything still has one item: quota 0.
        let blocked = IetfTexts::new("api", "blocked", &[], false);
        assert_eq!(blocked.names, [r#""api-blocked""#]);
        assert_eq!(blocked.list(0), r#""api-blocked";q=0"#);
        assert_eq!(blocked.name(3), r#""api-blocked""#);
        assert_eq!(blocked.list(3), r#""api-blocked";q=0"#);
        assert_eq!(blocked.violated(0, 0), ["api-blocked"]);
        // Units of body bytes say so.
        let bytes = IetfTexts::new("api", DEFAULT_PLAN, limits, true);
        assert_eq!(
            bytes.list(0),
            r#""api-1m";q=1000;qu="content-bytes";w=60, "api-250ms";q=5;qu="content-bytes";w=1"#
        );
    }
}
