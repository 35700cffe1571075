//! The configuration file exactly as written: serde structs that mirror the TOML.
//!
//! Every table refuses unknown keys, and values that later checks may refuse are
//! kept `Spanned`, so that an error can name the line it comes from. Turning these
//! into the checked, compiled [`Config`](super::Config) is `compile.rs`'s job.

use std::collections::BTreeMap;

use serde::Deserialize;
use toml::Spanned;

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawConfig {
    #[serde(default)]
    pub server: RawServer,
    pub store: Option<Spanned<RawStore>>,
    #[serde(default)]
    pub headers: RawHeaders,
    #[serde(default)]
    pub upstreams: BTreeMap<String, Spanned<RawUpstream>>,
    #[serde(default)]
    pub policies: BTreeMap<String, Spanned<RawPolicy>>,
    #[serde(default)]
    pub routes: Vec<Spanned<RawRoute>>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawServer {
    pub listen: Option<Spanned<String>>,
    pub workers: Option<Spanned<i64>>,
    pub admin_listen: Option<Spanned<String>>,
    pub trusted_proxies: Option<Vec<Spanned<String>>>,
    pub upstream_timeout: Option<Spanned<String>>,
    pub max_header_bytes: Option<Spanned<i64>>,
    pub shutdown_timeout: Option<Spanned<String>>,
    pub header_timeout: Option<Spanned<String>>,
    pub client_body_timeout: Option<Spanned<String>>,
    pub client_send_timeout: Option<Spanned<String>>,
    pub max_connections: Option<Spanned<i64>>,
    pub listen_backlog: Option<Spanned<i64>>,
    pub max_streams: Option<Spanned<i64>>,
    pub max_upstream_per_client: Option<Spanned<i64>>,
    pub tls: Option<Spanned<RawTls>>,
    pub escaped_slashes: Option<Spanned<String>>,
    pub underscore_headers: Option<Spanned<String>>,
    pub max_delayed: Option<Spanned<i64>>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawTls {
    pub cert: Spanned<String>,
    pub key: Spanned<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawStore {
    pub backend: Option<Spanned<String>>,
    pub url: Option<Spanned<String>>,
    pub cluster: Option<Spanned<Vec<Spanned<String>>>>,
    pub timeout: Option<Spanned<String>>,
    pub ca: Option<Spanned<String>>,
    pub on_error: Option<Spanned<String>>,
    pub clock: Option<Spanned<String>>,
    pub prefix: Option<Spanned<String>>,
    pub deny_cache: Option<bool>,
    pub max_keys: Option<Spanned<i64>>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawHeaders {
    pub style: Option<Spanned<String>>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawUpstream {
    pub url: Option<Spanned<String>>,
    pub urls: Option<Vec<Spanned<String>>>,
    pub ca: Option<Spanned<String>>,
    pub pass_host: Option<bool>,
    pub buffer: Option<Spanned<String>>,
    pub keepalive: Option<Spanned<i64>>,
    pub keepalive_timeout: Option<Spanned<String>>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawPolicy {
    /// `key = "ip"` or `key = ["ip", "header:X-User"]`: checked in `compile.rs`.
    pub key: Option<Spanned<toml::Value>>,
    pub ipv6_prefix: Option<Spanned<i64>>,
    pub timezone: Option<Spanned<String>>,
    pub charge: Option<Spanned<String>>,
    pub refund: Option<Vec<Spanned<i64>>>,
    pub mode: Option<Spanned<String>>,
    /// `"header:NAME"`, `"trailer:NAME"` or `"body-bytes"`: checked in `compile.rs`.
    pub meter: Option<Spanned<String>>,
    pub limits: Spanned<Vec<Spanned<RawLimit>>>,
    /// `[policies.NAME.plans.PLAN]`: named sets of limits in place of `limits`.
    #[serde(default)]
    pub plans: BTreeMap<String, Spanned<RawPlan>>,
    /// The key spec whose value picks an identity's plan.
    pub plan_key: Option<Spanned<String>>,
    /// A header a trusted proxy names the plan in.
    pub plan_header: Option<Spanned<String>>,
    /// `[policies.NAME.assign]`: identity value → plan name.
    #[serde(default)]
    pub assign: BTreeMap<String, Spanned<String>>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawPlan {
    pub limits: Spanned<Vec<Spanned<RawLimit>>>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawLimit {
    pub limit: Spanned<i64>,
    /// Required but for `algorithm = "concurrency"`, which has none.
    pub window: Option<Spanned<String>>,
    pub precision: Option<Spanned<String>>,
    pub algorithm: Option<Spanned<String>>,
    pub burst: Option<Spanned<i64>>,
    /// `gcra` only: how long a request may be held rather than refused.
    pub delay: Option<Spanned<String>>,
    /// `concurrency` only: how long a slot lives unless renewed.
    pub lease: Option<Spanned<String>>,
    /// `key = "ip"` or `key = ["ip", "header:X-User"]`: checked in `compile.rs`.
    pub key: Option<Spanned<toml::Value>>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawRoute {
    pub name: Option<Spanned<String>>,
    pub path: Spanned<String>,
    pub methods: Option<Vec<Spanned<String>>>,
    pub host: Option<Spanned<String>>,
    pub upgrades: Option<Vec<Spanned<String>>>,
    pub upstream: Option<Spanned<String>>,
    pub respond: Option<Spanned<RawRespond>>,
    pub policy: Option<Spanned<String>>,
    pub cost: Option<Spanned<i64>>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawRespond {
    pub status: Spanned<i64>,
    #[serde(default)]
    pub body: String,
    pub content_type: Option<String>,
}
