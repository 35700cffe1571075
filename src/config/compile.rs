//! From the file as written ([`raw`](super::raw)) to a checked [`Config`].
//!
//! Every problem found is collected (not only the first), each as
//! `file:line: where: what`, so one `sluice check` run shows them all.

use std::collections::{BTreeMap, HashSet};
use std::net::{IpAddr, SocketAddr};
use std::ops::Range;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{Method, StatusCode};
use ipnet::IpNet;
use toml::Spanned;

use super::raw::*;
use super::*;

/// Collects messages that point into the file.
struct Diag<'a> {
    name: &'a str,
    text: &'a str,
    errors: Vec<String>,
}

impl Diag<'_> {
    fn line(&self, span: &Range<usize>) -> usize {
        let end = span.start.min(self.text.len());
        self.text.as_bytes()[..end]
            .iter()
            .filter(|&&b| b == b'\n')
            .count()
            + 1
    }

    fn err(&mut self, span: &Range<usize>, msg: impl AsRef<str>) {
        let line = self.line(span);
        // A value quoted in the message may hold a line break: escaped, each
        // message stays one line that names its file and line.
        let mut text = String::new();
        for c in msg.as_ref().chars() {
            if c.is_control() {
                text.extend(c.escape_default());
            } else {
                text.push(c);
            }
        }
        self.errors.push(format!("{}:{line}: {text}", self.name));
    }
}

pub fn compile(text: &str, name: &str, base: &Path) -> Result<Config, ConfigError> {
    let mut d = Diag {
        name,
        text,
        errors: Vec::new(),
    };
    let raw: RawConfig = match toml::from_str(text) {
        Ok(raw) => raw,
        Err(e) => {
            let span = e.span().unwrap_or(0..0);
            d.err(&span, e.message().trim_end());
            return Err(ConfigError::Invalid(d.errors));
        }
    };

    let server = server(&mut d, &raw.server, base);
    let store = store(&mut d, raw.store.as_ref(), base);
    let headers = match &raw.headers.style {
        None => HeaderStyle::XRateLimit,
        Some(s) => match s.get_ref().as_str() {
            "x-ratelimit" => HeaderStyle::XRateLimit,
            "ietf" => HeaderStyle::Ietf,
            "both" => HeaderStyle::Both,
            "none" => HeaderStyle::None,
            other => {
                d.err(
                    &s.span(),
                    format!("headers.style: unknown style '{other}' (use \"x-ratelimit\", \"ietf\", \"both\" or \"none\")"),
                );
                HeaderStyle::XRateLimit
            }
        },
    };

    let mut upstreams = BTreeMap::new();
    for (name, raw) in &raw.upstreams {
        if let Some(u) = upstream(&mut d, name, raw, base) {
            upstreams.insert(name.clone(), Arc::new(u));
        }
    }
    let mut policies = BTreeMap::new();
    for (name, raw) in &raw.policies {
        if let Some(p) = policy(&mut d, name, raw) {
            policies.insert(name.clone(), Arc::new(p));
        }
    }
    // A route naming a declared but broken upstream or policy gets no second error.
    let declared_upstreams: HashSet<&str> = raw.upstreams.keys().map(|k| k.as_str()).collect();
    let declared_policies: HashSet<&str> = raw.policies.keys().map(|k| k.as_str()).collect();
    let mut routes = Vec::new();
    for (i, raw) in raw.routes.iter().enumerate() {
        let names = Names {
            upstreams: &upstreams,
            policies: &policies,
            declared_upstreams: &declared_upstreams,
            declared_policies: &declared_policies,
        };
        if let Some(r) = route(&mut d, i, raw, &names, server.escaped_slashes) {
            routes.push(r);
        }
    }

    if !d.errors.is_empty() {
        return Err(ConfigError::Invalid(d.errors));
    }
    Ok(Config {
        server,
        store,
        headers,
        upstreams: upstreams.into_values().collect(),
        policies: policies.into_values().collect(),
        routes,
    })
}

struct Names<'a> {
    upstreams: &'a BTreeMap<String, Arc<Upstream>>,
    policies: &'a BTreeMap<String, Arc<Policy>>,
    declared_upstreams: &'a HashSet<&'a str>,
    declared_policies: &'a HashSet<&'a str>,
}

fn duration_value(d: &mut Diag, key: &str, value: &Spanned<String>) -> Option<Duration> {
    match duration::parse(value.get_ref()) {
        Ok(v) if v.is_zero() => {
            d.err(&value.span(), format!("{key}: must be longer than zero"));
            None
        }
        Ok(v) => Some(v),
        Err(e) => {
            d.err(&value.span(), format!("{key}: {e}"));
            None
        }
    }
}

/// A size: `"0"`, `"4096"`, `"512KiB"`, `"1MiB"`, `"1GiB"` (also `B`, `KB`,
/// `MB`, `GB`); at most 4 GiB.
fn size_value(d: &mut Diag, key: &str, value: &Spanned<String>) -> Option<usize> {
    let text = value.get_ref().trim();
    let digits = text
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(text.len());
    let (number, unit) = text.split_at(digits);
    let unit_bytes: u64 = match unit.trim() {
        "" | "B" => 1,
        "KiB" => 1 << 10,
        "MiB" => 1 << 20,
        "GiB" => 1 << 30,
        "KB" => 1_000,
        "MB" => 1_000_000,
        "GB" => 1_000_000_000,
        _ => 0,
    };
    match number
        .parse::<u64>()
        .ok()
        .and_then(|n| n.checked_mul(unit_bytes))
    {
        Some(n) if unit_bytes > 0 && n <= 4 << 30 => Some(n as usize),
        _ => {
            d.err(
                &value.span(),
                format!("{key}: '{text}' is not a size like \"1MiB\", \"512KiB\" or \"0\" (at most 4GiB)"),
            );
            None
        }
    }
}

fn positive(d: &mut Diag, key: &str, value: &Spanned<i64>) -> Option<u64> {
    if *value.get_ref() <= 0 {
        d.err(
            &value.span(),
            format!(
                "{key}: must be a whole number above zero, not {}",
                value.get_ref()
            ),
        );
        return None;
    }
    Some(*value.get_ref() as u64)
}

fn socket_addr(d: &mut Diag, key: &str, value: &Spanned<String>) -> Option<SocketAddr> {
    let text = value.get_ref();
    let text = text
        .strip_prefix("localhost:")
        .map_or(text.clone(), |port| format!("127.0.0.1:{port}"));
    match text.parse() {
        Ok(addr) => Some(addr),
        Err(_) => {
            d.err(
                &value.span(),
                format!(
                    "{key}: '{}' is not an address like \"127.0.0.1:8080\" or \"[::]:8080\"",
                    value.get_ref()
                ),
            );
            None
        }
    }
}

fn file(base: &Path, name: &str) -> std::path::PathBuf {
    base.join(name)
}

fn server(d: &mut Diag, raw: &RawServer, base: &Path) -> ServerConfig {
    let mut s = ServerConfig {
        listen: SocketAddr::from(([127, 0, 0, 1], 8080)),
        workers: 0,
        admin_listen: None,
        trusted_proxies: Vec::new(),
        upstream_timeout: Duration::from_secs(30),
        max_header_bytes: 32 * 1024,
        shutdown_timeout: Duration::from_secs(10),
        header_timeout: Duration::from_secs(30),
        client_body_timeout: Duration::from_secs(60),
        client_send_timeout: Duration::from_secs(60),
        max_connections: 16_384,
        listen_backlog: 1024,
        max_streams: 100,
        max_upstream_per_client: 256,
        tls: None,
        escaped_slashes: EscapedSlashes::Reject,
        underscore_headers: UnderscoreHeaders::Drop,
        max_delayed: 1024,
    };
    if let Some(v) = &raw.listen {
        s.listen = socket_addr(d, "server.listen", v).unwrap_or(s.listen);
    }
    if let Some(v) = &raw.admin_listen {
        s.admin_listen = socket_addr(d, "server.admin_listen", v);
    }
    if let Some(v) = &raw.workers {
        if *v.get_ref() < 0 || *v.get_ref() > 1024 {
            d.err(
                &v.span(),
                "server.workers: must be between 0 (one per core) and 1024",
            );
        } else {
            s.workers = *v.get_ref() as usize;
        }
    }
    for (i, v) in raw.trusted_proxies.iter().flatten().enumerate() {
        let text = v.get_ref().trim();
        let net = text
            .parse::<IpNet>()
            .ok()
            .or_else(|| text.parse::<IpAddr>().ok().map(IpNet::from));
        match net {
            // An IPv4-mapped range (`::ffff:10.0.0.0/104`) is matched as the
            // IPv4 range it names: clients are compared in their IPv4 form.
            Some(net) => s
                .trusted_proxies
                .push(crate::identity::canonical_net(net.trunc())),
            None => d.err(
                &v.span(),
                format!("server.trusted_proxies[{i}]: '{text}' is not an address or CIDR range like \"10.0.0.0/8\""),
            ),
        }
    }
    if let Some(v) = &raw.upstream_timeout {
        s.upstream_timeout =
            duration_value(d, "server.upstream_timeout", v).unwrap_or(s.upstream_timeout);
    }
    if let Some(v) = &raw.shutdown_timeout {
        s.shutdown_timeout =
            duration_value(d, "server.shutdown_timeout", v).unwrap_or(s.shutdown_timeout);
    }
    if let Some(v) = &raw.header_timeout {
        s.header_timeout =
            duration_value(d, "server.header_timeout", v).unwrap_or(s.header_timeout);
    }
    if let Some(v) = &raw.client_body_timeout {
        s.client_body_timeout =
            duration_value(d, "server.client_body_timeout", v).unwrap_or(s.client_body_timeout);
    }
    if let Some(v) = &raw.client_send_timeout {
        s.client_send_timeout =
            duration_value(d, "server.client_send_timeout", v).unwrap_or(s.client_send_timeout);
    }
    let mut count = |key: &str, v: &Spanned<i64>, max: u64| match positive(d, key, v) {
        Some(n) if n > max => {
            d.err(&v.span(), format!("{key}: must be between 1 and {max}"));
            None
        }
        n => n,
    };
    if let Some(v) = &raw.max_connections {
        s.max_connections = count("server.max_connections", v, 10_000_000)
            .map_or(s.max_connections, |n| n as usize);
    }
    if let Some(v) = &raw.listen_backlog {
        s.listen_backlog =
            count("server.listen_backlog", v, 65_535).map_or(s.listen_backlog, |n| n as u32);
    }
    if let Some(v) = &raw.max_streams {
        s.max_streams = count("server.max_streams", v, 10_000).map_or(s.max_streams, |n| n as u32);
    }
    if let Some(v) = &raw.max_upstream_per_client {
        s.max_upstream_per_client = count("server.max_upstream_per_client", v, 10_000_000)
            .map_or(s.max_upstream_per_client, |n| n as usize);
    }
    if let Some(v) = &raw.max_delayed {
        s.max_delayed =
            count("server.max_delayed", v, 10_000_000).map_or(s.max_delayed, |n| n as usize);
    }
    if let Some(v) = &raw.max_header_bytes {
        match positive(d, "server.max_header_bytes", v) {
            Some(n) if !(1024..=16 * 1024 * 1024).contains(&n) => d.err(
                &v.span(),
                "server.max_header_bytes: must be between 1024 and 16777216",
            ),
            Some(n) => s.max_header_bytes = n as usize,
            None => {}
        }
    }
    if let Some(v) = &raw.escaped_slashes {
        match v.get_ref().as_str() {
            "reject" => s.escaped_slashes = EscapedSlashes::Reject,
            "decode" => s.escaped_slashes = EscapedSlashes::Decode,
            "keep" => s.escaped_slashes = EscapedSlashes::Keep,
            other => d.err(
                &v.span(),
                format!("server.escaped_slashes: unknown value '{other}' (use \"reject\", \"decode\" or \"keep\")"),
            ),
        }
    }
    if let Some(v) = &raw.underscore_headers {
        match v.get_ref().as_str() {
            "drop" => s.underscore_headers = UnderscoreHeaders::Drop,
            "reject" => s.underscore_headers = UnderscoreHeaders::Reject,
            "pass" => s.underscore_headers = UnderscoreHeaders::Pass,
            other => d.err(
                &v.span(),
                format!("server.underscore_headers: unknown value '{other}' (use \"drop\", \"reject\" or \"pass\")"),
            ),
        }
    }
    if let Some(tls) = &raw.tls {
        let t = tls.get_ref();
        let files = TlsFiles {
            cert: file(base, t.cert.get_ref()),
            key: file(base, t.key.get_ref()),
        };
        // Load them now, so that `sluice check` (and a reload) refuse a bad
        // certificate instead of the server failing at start.
        if let Err(e) = crate::tls::server_config(&files) {
            d.err(&tls.span(), format!("server.tls: {e}"));
        }
        s.tls = Some(files);
    }
    s
}

fn store(d: &mut Diag, raw: Option<&Spanned<RawStore>>, base: &Path) -> StoreConfig {
    let mut s = StoreConfig {
        backend: Backend::Memory,
        url: None,
        cluster: Vec::new(),
        timeout: Duration::from_millis(100),
        ca: None,
        on_error: OnError::Allow,
        clock: ClockSource::Redis,
        prefix: "sluice:".to_string(),
        deny_cache: true,
        max_keys: 1_000_000,
    };
    let Some(raw) = raw else { return s };
    let span = raw.span();
    let r = raw.get_ref();
    if let Some(v) = &r.backend {
        match v.get_ref().as_str() {
            "memory" => s.backend = Backend::Memory,
            "redis" => s.backend = Backend::Redis,
            other => d.err(
                &v.span(),
                format!("store.backend: unknown backend '{other}' (use \"redis\" or \"memory\")"),
            ),
        }
    }
    let check_url = |d: &mut Diag, key: &str, v: &Spanned<String>| {
        let url = v.get_ref();
        if !(url.starts_with("redis://") || url.starts_with("rediss://")) {
            d.err(
                &v.span(),
                format!(
                    "{key}: '{}' must start with redis:// or rediss://",
                    redact(url)
                ),
            );
        }
    };
    if let Some(v) = &r.url {
        check_url(d, "store.url", v);
        s.url = Some(v.get_ref().clone());
    }
    if let Some(list) = &r.cluster {
        if list.get_ref().is_empty() {
            d.err(
                &list.span(),
                "store.cluster: needs at least one seed node URL",
            );
        }
        for (i, v) in list.get_ref().iter().enumerate() {
            check_url(d, &format!("store.cluster[{i}]"), v);
            s.cluster.push(v.get_ref().clone());
        }
    }
    if s.backend == Backend::Redis {
        match (&r.url, &r.cluster) {
            (Some(v), Some(_)) => d.err(&v.span(), "store: give either url or cluster, not both"),
            (None, None) => d.err(&span, "store: backend \"redis\" needs url (or cluster)"),
            _ => {}
        }
    }
    if let Some(v) = &r.timeout {
        s.timeout = duration_value(d, "store.timeout", v).unwrap_or(s.timeout);
    }
    if let Some(v) = &r.ca {
        let tls = s
            .url
            .iter()
            .chain(&s.cluster)
            .any(|u| u.starts_with("rediss://"));
        if !tls {
            d.err(&v.span(), "store.ca: only used with rediss:// URLs");
        }
        s.ca = Some(file(base, v.get_ref()));
    }
    if let Some(v) = &r.on_error {
        match v.get_ref().as_str() {
            "allow" => s.on_error = OnError::Allow,
            "deny" => s.on_error = OnError::Deny,
            other => d.err(
                &v.span(),
                format!("store.on_error: unknown value '{other}' (use \"allow\" or \"deny\")"),
            ),
        }
    }
    if let Some(v) = &r.clock {
        match v.get_ref().as_str() {
            "redis" => s.clock = ClockSource::Redis,
            "local" => s.clock = ClockSource::Local,
            other => d.err(
                &v.span(),
                format!("store.clock: unknown clock '{other}' (use \"redis\" or \"local\")"),
            ),
        }
    }
    if let Some(v) = &r.prefix {
        if v.get_ref().contains(['{', '}']) {
            // Braces would make the prefix the cluster hash tag of every key.
            d.err(&v.span(), "store.prefix: must not contain '{' or '}'");
        }
        s.prefix = v.get_ref().clone();
    }
    if let Some(v) = r.deny_cache {
        s.deny_cache = v;
    }
    if let Some(n) = r
        .max_keys
        .as_ref()
        .and_then(|v| positive(d, "store.max_keys", v))
    {
        s.max_keys = n as usize;
    }
    s
}

fn upstream(d: &mut Diag, name: &str, raw: &Spanned<RawUpstream>, base: &Path) -> Option<Upstream> {
    let r = raw.get_ref();
    let key = format!("upstream '{name}'");
    let mut urls: Vec<&Spanned<String>> = Vec::new();
    match (&r.url, &r.urls) {
        (Some(u), None) => urls.push(u),
        (None, Some(list)) if !list.is_empty() => urls.extend(list),
        (Some(u), Some(_)) => {
            d.err(
                &u.span(),
                format!("{key}: give either url or urls, not both"),
            );
            return None;
        }
        _ => {
            d.err(
                &raw.span(),
                format!("{key}: needs url = \"http://host:port\" (or urls = [...])"),
            );
            return None;
        }
    }
    let mut servers = Vec::new();
    for u in urls {
        match server_url(u.get_ref()) {
            Ok(s) => servers.push(s),
            Err(e) => d.err(&u.span(), format!("{key}: url '{}': {e}", u.get_ref())),
        }
    }
    if servers.is_empty() {
        return None;
    }
    let ca = r.ca.as_ref().map(|v| (v, file(base, v.get_ref())));
    if let Some((v, _)) = &ca
        && !servers.iter().any(|s| s.scheme == http::uri::Scheme::HTTPS)
    {
        d.err(
            &v.span(),
            format!("{key}: ca: only used with https:// URLs"),
        );
        return None;
    }
    if let Some((v, path)) = &ca
        && let Err(e) = crate::tls::check_ca(path)
    {
        d.err(&v.span(), format!("{key}: ca: {e}"));
        return None;
    }
    let mut keepalive = Keepalive::default();
    if let Some(v) = &r.keepalive {
        match u32::try_from(*v.get_ref()) {
            Ok(n @ 0..=100_000) => keepalive.idle = n as usize,
            _ => {
                d.err(
                    &v.span(),
                    format!("{key}: keepalive: must be between 0 and 100000 (idle connections kept per server)"),
                );
                return None;
            }
        }
    }
    if let Some(v) = &r.keepalive_timeout {
        keepalive.timeout = duration_value(d, &format!("{key}: keepalive_timeout"), v)?;
    }
    let servers = servers
        .into_iter()
        .map(|s| UpstreamServer { keepalive, ..s })
        .collect::<Vec<_>>();
    Some(Upstream {
        name: Arc::from(name),
        down_until: servers.iter().map(|_| Default::default()).collect(),
        servers,
        ca: ca.map(|(_, path)| path),
        pass_host: r.pass_host.unwrap_or(false),
        buffer: match &r.buffer {
            Some(v) => size_value(d, &format!("{key}: buffer"), v)?,
            None => 1 << 20,
        },
        next: Default::default(),
    })
}

fn server_url(text: &str) -> Result<UpstreamServer, &'static str> {
    let uri: http::Uri = text.parse().map_err(|_| "not a URL")?;
    let scheme = uri.scheme().cloned().ok_or("needs http:// or https://")?;
    if scheme != http::uri::Scheme::HTTP && scheme != http::uri::Scheme::HTTPS {
        return Err("needs http:// or https://");
    }
    let authority = uri.authority().cloned().ok_or("needs a host")?;
    if authority.as_str().contains('@') {
        return Err("user info in an upstream URL is not supported");
    }
    if uri.query().is_some() {
        return Err("an upstream URL cannot have a query");
    }
    let base_path = uri.path().trim_end_matches('/').to_string();
    let host = http::HeaderValue::from_str(authority.as_str()).map_err(|_| "bad host")?;
    Ok(UpstreamServer {
        host,
        scheme,
        authority,
        base_path,
        keepalive: Keepalive::default(),
    })
}

fn key_specs(d: &mut Diag, key: &str, value: &Spanned<toml::Value>) -> Option<Vec<KeySpec>> {
    let items: Vec<&toml::Value> = match value.get_ref() {
        toml::Value::String(_) => vec![value.get_ref()],
        toml::Value::Array(list) if !list.is_empty() => list.iter().collect(),
        _ => {
            d.err(
                &value.span(),
                format!("{key}: must be a key like \"ip\" or a list of them"),
            );
            return None;
        }
    };
    let mut specs = Vec::new();
    for item in items {
        let Some(text) = item.as_str() else {
            d.err(
                &value.span(),
                format!("{key}: must be a key like \"ip\" or a list of them"),
            );
            return None;
        };
        let spec = match text.parse::<KeySpec>() {
            Ok(spec) => spec,
            Err(e) => {
                d.err(&value.span(), format!("{key}: {e}"));
                return None;
            }
        };
        if specs.contains(&spec) {
            d.err(&value.span(), format!("{key}: '{text}' is listed twice"));
            return None;
        }
        specs.push(spec);
    }
    Some(specs)
}

fn policy(d: &mut Diag, name: &str, raw: &Spanned<RawPolicy>) -> Option<Policy> {
    let r = raw.get_ref();
    let key = format!("policy '{name}'");
    let errors_before = d.errors.len();
    let keys = match &r.key {
        Some(v) => key_specs(d, &format!("{key}: key"), v).unwrap_or_default(),
        None => vec![KeySpec::Ip],
    };
    let ipv6_prefix = match &r.ipv6_prefix {
        None => 64,
        Some(v) => match u8::try_from(*v.get_ref()) {
            Ok(n @ 1..=128) => n,
            _ => {
                d.err(
                    &v.span(),
                    format!("{key}: ipv6_prefix: must be between 1 and 128 (64 counts each /64 as one client)"),
                );
                64
            }
        },
    };
    let (timezone, tz) = time_zone(d, &key, r.timezone.as_ref());
    let charge = match &r.charge {
        None => Charge::Reserve,
        Some(v) => match v.get_ref().as_str() {
            "reserve" => Charge::Reserve,
            "after" => Charge::After,
            other => {
                d.err(
                    &v.span(),
                    format!(
                        "{key}: charge: unknown value '{other}' (use \"reserve\" or \"after\")"
                    ),
                );
                Charge::Reserve
            }
        },
    };
    let mode = match &r.mode {
        None => Mode::Enforce,
        Some(v) => match v.get_ref().as_str() {
            "enforce" => Mode::Enforce,
            "shadow" => Mode::Shadow,
            other => {
                d.err(
                    &v.span(),
                    format!("{key}: mode: unknown value '{other}' (use \"enforce\" or \"shadow\")"),
                );
                Mode::Enforce
            }
        },
    };
    let meter = r.meter.as_ref().and_then(|v| {
        let text = v.get_ref().trim();
        let mut named = |kind: &str, name: &str| match HeaderName::from_bytes(name.as_bytes()) {
            Ok(name) => Some(name),
            Err(_) => {
                d.err(
                    &v.span(),
                    format!("{key}: meter: '{name}' is not a {kind} name"),
                );
                None
            }
        };
        match text.split_once(':') {
            None if text == "body-bytes" => Some(Meter::BodyBytes),
            Some(("header", name)) => named("header", name).map(Meter::Header),
            Some(("trailer", name)) => named("trailer", name).map(Meter::Trailer),
            _ => {
                d.err(
                    &v.span(),
                    format!("{key}: meter: unknown meter '{text}' (use \"header:NAME\", \"trailer:NAME\" or \"body-bytes\")"),
                );
                None
            }
        }
    });
    let mut refund = Vec::new();
    match &r.refund {
        None => refund.push(StatusCode::NOT_MODIFIED),
        Some(list) => {
            for v in list {
                match u16::try_from(*v.get_ref())
                    .ok()
                    .and_then(|c| StatusCode::from_u16(c).ok())
                {
                    Some(code) if (100..600).contains(&code.as_u16()) => refund.push(code),
                    _ => d.err(
                        &v.span(),
                        format!("{key}: refund: {} is not an HTTP status", v.get_ref()),
                    ),
                }
            }
        }
    }
    if r.limits.get_ref().is_empty() {
        d.err(
            &r.limits.span(),
            format!("{key}: limits: needs at least one limit"),
        );
    }
    let mut limits = limit_list(
        d,
        &format!("{key}: limits"),
        r.limits.get_ref(),
        &keys,
        tz.as_ref(),
    );
    let mut plan_limits: Vec<(&String, &Spanned<RawPlan>, Vec<Limit>)> = Vec::new();
    for (plan, raw_plan) in &r.plans {
        let pkey = format!("{key}: plans.{plan}");
        if plan == DEFAULT_PLAN
            || !plan
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
        {
            d.err(
                &raw_plan.span(),
                format!("{pkey}: a plan's name is letters, digits, '-' and '_', and not \"{DEFAULT_PLAN}\""),
            );
        }
        let list = &raw_plan.get_ref().limits;
        plan_limits.push((
            plan,
            raw_plan,
            limit_list(
                d,
                &format!("{pkey}: limits"),
                list.get_ref(),
                &keys,
                tz.as_ref(),
            ),
        ));
    }
    // A slot is taken, and a delay's place in line, with the decision:
    // `charge = "after"` takes nothing before the response.
    if let (Charge::After, Some(v)) = (charge, &r.charge) {
        let all = || {
            std::iter::once(&limits)
                .chain(plan_limits.iter().map(|(_, _, l)| l))
                .flatten()
        };
        if all().any(|l| matches!(l.algorithm, Algorithm::Concurrency { .. })) {
            d.err(
                &v.span(),
                format!("{key}: charge: a \"concurrency\" limit takes its slot with the decision; use charge = \"reserve\""),
            );
        } else if all()
            .any(|l| matches!(l.algorithm, Algorithm::Gcra { delay, .. } if !delay.is_zero()))
        {
            d.err(
                &v.span(),
                format!("{key}: charge: a \"delay\" paces requests by what the decision charges; use charge = \"reserve\""),
            );
        }
    }
    if d.errors.len() > errors_before {
        return None;
    }
    // Limits of one window and algorithm that count different keys (a global
    // budget next to a per-client one) need ids of their own: a client whose
    // header is missing is counted by address under both.
    let ids: Vec<String> = limits.iter().map(|l| l.id.clone()).collect();
    let own_id = |l: &Limit| {
        if ids.iter().filter(|id| **id == l.id).count() > 1 {
            let keys: Vec<String> = l.keys.iter().map(|k| k.to_string()).collect();
            format!("{}@{}", l.id, keys.join("+"))
        } else {
            l.id.clone()
        }
    };
    // A plan counts in the same counters as the policy's own limits: every
    // plan (but one that refuses all) has the same windows, algorithms and
    // keys, so a switch of plan keeps each count, and no sequence of
    // switches gives a client more than the largest plan allows.
    for (plan, raw_plan, list) in &mut plan_limits {
        if list.is_empty() {
            continue;
        }
        let shape = |l: &Limit| (own_id(l), l.keys.clone());
        let mut want: Vec<_> = limits.iter().map(shape).collect();
        let mut have: Vec<_> = list.iter().map(shape).collect();
        want.sort_by(|a, b| a.0.cmp(&b.0));
        have.sort_by(|a, b| a.0.cmp(&b.0));
        let same = want.len() == have.len()
            && want.iter().zip(&have).all(|(a, b)| {
                a.0 == b.0 && a.1.len() == b.1.len() && a.1.iter().all(|k| b.1.contains(k))
            });
        if !same {
            let names = |v: &[(String, Vec<KeySpec>)]| {
                v.iter()
                    .map(|(id, _)| id.as_str())
                    .collect::<Vec<_>>()
                    .join(", ")
            };
            d.err(
                &raw_plan.get_ref().limits.span(),
                format!(
                    "{key}: plans.{plan}: limits must count the same windows, algorithms and keys as the policy's limits ({}), with limits of their own, or be [] to refuse all; it has {}",
                    names(&want),
                    names(&have)
                ),
            );
        }
        for l in list.iter_mut() {
            l.id = own_id(l);
        }
    }
    for l in &mut limits {
        l.id = own_id(l);
    }
    let plan_key = match (&r.plan_key, r.plans.is_empty()) {
        (Some(v), true) => {
            d.err(
                &v.span(),
                format!("{key}: plan_key: the policy has no plans"),
            );
            None
        }
        (Some(v), false) => match v.get_ref().parse::<KeySpec>() {
            Ok(KeySpec::Global) => {
                d.err(
                    &v.span(),
                    format!("{key}: plan_key: \"global\" has no value to pick a plan by"),
                );
                None
            }
            // The value that picks the plan must be one the policy counts:
            // else a client could pick its plan by a value it changes at
            // will, at no cost to any of its counts.
            Ok(spec) if !limits.iter().any(|l| l.keys.contains(&spec)) => {
                let counted: Vec<String> = keys.iter().map(|k| k.to_string()).collect();
                d.err(
                    &v.span(),
                    format!(
                        "{key}: plan_key: '{spec}' is not a key the policy counts ({})",
                        counted.join(", ")
                    ),
                );
                None
            }
            Ok(spec) => Some(spec),
            Err(e) => {
                d.err(&v.span(), format!("{key}: plan_key: {e}"));
                None
            }
        },
        (None, false) => keys.iter().find(|k| **k != KeySpec::Global).cloned(),
        (None, true) => None,
    };
    if plan_key.is_none() && !r.plans.is_empty() && r.plan_key.is_none() {
        d.err(
            &raw.span(),
            format!("{key}: plans need a plan_key (the policy counts only \"global\")"),
        );
    }
    let plan_header = match &r.plan_header {
        None => None,
        Some(v) if r.plans.is_empty() => {
            d.err(
                &v.span(),
                format!("{key}: plan_header: the policy has no plans"),
            );
            None
        }
        Some(v) => match HeaderName::from_bytes(v.get_ref().as_bytes()) {
            Ok(name) => Some(name),
            Err(_) => {
                d.err(
                    &v.span(),
                    format!("{key}: plan_header: '{}' is not a header name", v.get_ref()),
                );
                None
            }
        },
    };
    let mut assign = std::collections::HashMap::new();
    for (value, plan) in &r.assign {
        match r.plans.keys().position(|p| p == plan.get_ref()) {
            Some(i) => {
                assign.insert(value.as_bytes().to_vec(), i);
            }
            None => d.err(
                &plan.span(),
                format!(
                    "{key}: assign: \"{value}\" = \"{}\": no such plan (the policy's plans: {})",
                    plan.get_ref(),
                    r.plans
                        .keys()
                        .map(String::as_str)
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
            ),
        }
    }
    if d.errors.len() > errors_before {
        return None;
    }
    let mut policy = Policy {
        name: name.into(),
        plan: Arc::from(DEFAULT_PLAN),
        ipv6_prefix,
        timezone,
        charge,
        refund,
        mode,
        meter,
        limits: Vec::new(),
        specs: Vec::new(),
        plans: Vec::new(),
        plan_key,
        plan_header,
        assign: Default::default(),
        ietf: IetfTexts::new(name, DEFAULT_PLAN, &[], false),
        x_heads: Vec::new(),
    }
    .variant(DEFAULT_PLAN, limits);
    policy.assign = assign;
    policy.plans = plan_limits
        .into_iter()
        .map(|(plan, _, list)| Arc::new(policy.variant(plan, list)))
        .collect();
    Some(policy)
}

/// The limits of one list (`limits` of a policy or of a plan), each checked;
/// two counting the same window are refused.
fn limit_list(
    d: &mut Diag,
    key: &str,
    raw: &[Spanned<RawLimit>],
    keys: &[KeySpec],
    tz: Option<&jiff::tz::TimeZone>,
) -> Vec<Limit> {
    let mut limits: Vec<Limit> = Vec::new();
    for (i, raw_limit) in raw.iter().enumerate() {
        let lkey = format!("{key}[{i}]");
        if let Some(l) = limit(d, &lkey, raw_limit, keys, tz) {
            let same_keys = |a: &[KeySpec], b: &[KeySpec]| {
                a.len() == b.len() && a.iter().all(|k| b.contains(k))
            };
            if let Some(j) = limits
                .iter()
                .position(|o| o.id == l.id && same_keys(&o.keys, &l.keys))
            {
                d.err(
                    &raw_limit.span(),
                    format!("{lkey}: counts the same window as limits[{j}]; merge them"),
                );
            }
            limits.push(l);
        }
    }
    limits
}

/// A policy's `timezone`: its name, and the zone (`None` for UTC, whose
/// days are the unix epoch's, so that `"1d"` keeps its epoch-aligned
/// counters). An unknown name is an error; UTC is used meanwhile.
fn time_zone(
    d: &mut Diag,
    key: &str,
    raw: Option<&Spanned<String>>,
) -> (Arc<str>, Option<jiff::tz::TimeZone>) {
    let Some(v) = raw else {
        return (Arc::from("UTC"), None);
    };
    let name = v.get_ref().trim();
    if name.eq_ignore_ascii_case("UTC") {
        return (Arc::from("UTC"), None);
    }
    match jiff::tz::TimeZone::get(name) {
        Ok(tz) => (Arc::from(name), Some(tz)),
        Err(_) => {
            d.err(
                &v.span(),
                format!("{key}: timezone: unknown time zone '{name}' (use an IANA name like \"Europe/Berlin\", or \"UTC\")"),
            );
            (Arc::from("UTC"), None)
        }
    }
}

/// A limit's window: the span it counts, and for a calendar window its
/// unit. `tz` is its policy's time zone (`None`: UTC); `fixed` whether the
/// limit counts fixed windows (only those follow a calendar).
fn window_value(
    d: &mut Diag,
    key: &str,
    value: &Spanned<String>,
    tz: Option<&jiff::tz::TimeZone>,
    fixed: bool,
) -> Option<(Duration, Option<crate::calendar::Unit>)> {
    use crate::calendar::Unit;
    const DAY: u128 = 86_400_000;
    let text = value.get_ref().trim();
    match duration::parse_window(text) {
        Err(e) => {
            d.err(&value.span(), format!("{key}: {e}"));
            None
        }
        Ok(duration::Window::Span(v)) if v.is_zero() => {
            d.err(&value.span(), format!("{key}: must be longer than zero"));
            None
        }
        Ok(duration::Window::Calendar(unit)) if !fixed => {
            d.err(
                &value.span(),
                format!("{key}: \"{}\" is a calendar window, counted only by algorithm \"fixed\" (without precision)", unit.text()),
            );
            None
        }
        Ok(duration::Window::Calendar(unit)) => {
            Some((Duration::from_millis(unit.nominal_ms()), Some(unit)))
        }
        Ok(duration::Window::Span(v)) if fixed && tz.is_some() && v.as_millis() == DAY => {
            Some((v, Some(Unit::Day)))
        }
        Ok(duration::Window::Span(v)) if fixed && tz.is_some() && v.as_millis() % DAY == 0 => {
            // Days counted from the epoch would start at midnight UTC, not
            // at the policy's midnight: say so rather than surprise.
            d.err(
                &value.span(),
                format!("{key}: '{text}' would start at midnight UTC, not in the policy's timezone; use \"1d\", \"1w\" or \"1mo\", or hours"),
            );
            None
        }
        Ok(duration::Window::Span(v)) => Some((v, None)),
    }
}

fn limit(
    d: &mut Diag,
    key: &str,
    raw: &Spanned<RawLimit>,
    policy_keys: &[KeySpec],
    tz: Option<&jiff::tz::TimeZone>,
) -> Option<Limit> {
    let r = raw.get_ref();
    let limit = positive(d, &format!("{key}: limit"), &r.limit);
    let name = r.algorithm.as_ref().map(|a| a.get_ref().as_str());
    if name == Some("concurrency") {
        return concurrency_limit(d, key, raw, limit, policy_keys);
    }
    if let Some(v) = &r.lease {
        d.err(
            &v.span(),
            format!("{key}: lease applies only to algorithm \"concurrency\""),
        );
        return None;
    }
    let Some(raw_window) = &r.window else {
        d.err(
            &raw.span(),
            format!("{key}: window: missing (like window = \"1m\")"),
        );
        return None;
    };
    let fixed = r.precision.is_none() && matches!(name, None | Some("fixed"));
    let window = window_value(d, &format!("{key}: window"), raw_window, tz, fixed);
    let unit = window.and_then(|(_, unit)| unit);
    let window = window.map(|(span, _)| span);
    let precision = match &r.precision {
        Some(p) => Some((p, duration_value(d, &format!("{key}: precision"), p)?)),
        None => None,
    };
    let algorithm = match (name, precision) {
        (None | Some("sliding"), Some((p, precision))) => {
            let window = window?;
            if precision > window || window.as_millis() % precision.as_millis() != 0 {
                d.err(
                    &p.span(),
                    format!(
                        "{key}: precision '{}' does not divide window '{}'",
                        p.get_ref(),
                        raw_window.get_ref()
                    ),
                );
                return None;
            }
            if window.as_millis() / precision.as_millis() > 1000 {
                d.err(
                    &p.span(),
                    format!(
                        "{key}: precision '{}' makes more than 1000 buckets",
                        p.get_ref()
                    ),
                );
                return None;
            }
            Algorithm::Sliding { precision }
        }
        (Some("sliding"), None) => {
            let a = r.algorithm.as_ref()?;
            d.err(
                &a.span(),
                format!("{key}: algorithm \"sliding\" needs a precision, like precision = \"1m\""),
            );
            return None;
        }
        (None | Some("fixed"), None) => Algorithm::Fixed,
        (Some("log"), None) => Algorithm::Log,
        (Some("gcra"), None) => {
            let burst = match &r.burst {
                Some(b) => positive(d, &format!("{key}: burst"), b)?,
                None => 1,
            };
            let delay = match &r.delay {
                Some(v) => duration_value(d, &format!("{key}: delay"), v)?,
                None => Duration::ZERO,
            };
            Algorithm::Gcra { burst, delay }
        }
        (Some(other @ ("fixed" | "log" | "gcra")), Some((p, _))) => {
            d.err(
                &p.span(),
                format!("{key}: precision applies only to sliding windows, not to \"{other}\""),
            );
            return None;
        }
        (Some(other), _) => {
            let a = r.algorithm.as_ref()?;
            d.err(
                &a.span(),
                format!("{key}: unknown algorithm '{other}' (use \"fixed\", \"sliding\", \"log\", \"gcra\" or \"concurrency\")"),
            );
            return None;
        }
    };
    if let (Some(b), false) = (&r.burst, matches!(algorithm, Algorithm::Gcra { .. })) {
        d.err(
            &b.span(),
            format!("{key}: burst applies only to algorithm \"gcra\""),
        );
        return None;
    }
    if let (Some(v), false) = (&r.delay, matches!(algorithm, Algorithm::Gcra { .. })) {
        d.err(
            &v.span(),
            format!("{key}: delay applies only to algorithm \"gcra\" (nginx's limit_req burst without nodelay)"),
        );
        return None;
    }
    let keys = match &r.key {
        Some(v) => key_specs(d, &format!("{key}: key"), v)?,
        None => policy_keys.to_vec(),
    };
    let (limit, window) = (limit?, window?);
    let calendar = unit.map(|unit| {
        crate::calendar::Calendar::new(unit, tz.cloned().unwrap_or(jiff::tz::TimeZone::UTC))
    });
    let window_text = match &calendar {
        Some(c) => c.unit.text().to_string(),
        None => duration::format(window),
    };
    let mut id = format!("{window_text}:{}", algorithm.name());
    if let Algorithm::Sliding { precision } = algorithm {
        id += &format!(":{}", duration::format(precision));
    }
    Some(Limit {
        limit,
        window,
        calendar,
        algorithm,
        keys,
        id,
    })
}

/// A `concurrency` limit: `limit` requests in flight, each slot a lease of
/// `lease` (30 s by default) renewed while its request runs. It has no
/// window; its one counter per identity is named `concurrency`.
fn concurrency_limit(
    d: &mut Diag,
    key: &str,
    raw: &Spanned<RawLimit>,
    limit: Option<u64>,
    policy_keys: &[KeySpec],
) -> Option<Limit> {
    let r = raw.get_ref();
    let refuse = |d: &mut Diag, span: Range<usize>, what: &str| {
        d.err(
            &span,
            format!("{key}: {what} does not apply to algorithm \"concurrency\" (it counts requests in flight; see lease)"),
        );
    };
    if let Some(v) = &r.window {
        refuse(d, v.span(), "window");
    }
    if let Some(v) = &r.precision {
        refuse(d, v.span(), "precision");
    }
    if let Some(v) = &r.burst {
        refuse(d, v.span(), "burst");
    }
    if let Some(v) = &r.delay {
        refuse(d, v.span(), "delay");
    }
    let lease = match &r.lease {
        Some(v) => {
            let lease = duration_value(d, &format!("{key}: lease"), v)?;
            if lease < Duration::from_secs(1) {
                d.err(
                    &v.span(),
                    format!("{key}: lease: must be at least 1s (it is renewed every third of it)"),
                );
                return None;
            }
            lease
        }
        None => Duration::from_secs(30),
    };
    let keys = match &r.key {
        Some(v) => key_specs(d, &format!("{key}: key"), v)?,
        None => policy_keys.to_vec(),
    };
    if r.window.is_some() || r.precision.is_some() || r.burst.is_some() || r.delay.is_some() {
        return None;
    }
    Some(Limit {
        limit: limit?,
        window: lease,
        calendar: None,
        algorithm: Algorithm::Concurrency { lease },
        keys,
        id: "concurrency".to_string(),
    })
}

fn route(
    d: &mut Diag,
    i: usize,
    raw: &Spanned<RawRoute>,
    names: &Names,
    slashes: EscapedSlashes,
) -> Option<Route> {
    let r = raw.get_ref();
    let key = format!("routes[{i}]");
    let errors_before = d.errors.len();
    let path_text = r.path.get_ref();
    let path = match path_text.strip_prefix('=') {
        Some(exact) => PathMatch::Exact(exact.to_string()),
        None => PathMatch::Prefix(path_text.clone()),
    };
    match &path {
        PathMatch::Exact(p) | PathMatch::Prefix(p) if !p.starts_with('/') => {
            d.err(
                &r.path.span(),
                format!(
                    "{key}: path '{path_text}' must start with '/' (or '=/' for an exact match)"
                ),
            );
        }
        // Requests are matched in their normal form: a path that has none
        // could never match.
        PathMatch::Exact(p) | PathMatch::Prefix(p) => {
            if let Err(e) = crate::router::normalize(p, slashes) {
                d.err(
                    &r.path.span(),
                    format!("{key}: path '{path_text}' has {e}: requests with one are refused, so it could never match"),
                );
            }
        }
    }
    let methods = r.methods.as_ref().map(|list| {
        let mut methods = Vec::new();
        for m in list {
            let upper = m.get_ref().to_ascii_uppercase();
            match Method::from_bytes(upper.as_bytes()) {
                Ok(method) if !upper.is_empty() => methods.push(method),
                _ => d.err(
                    &m.span(),
                    format!("{key}: methods: '{}' is not an HTTP method", m.get_ref()),
                ),
            }
        }
        methods
    });
    let host = r.host.as_ref().map(|h| {
        let lower = h.get_ref().trim().to_ascii_lowercase();
        // `api.example.com.` is the same name, as requests' hosts are read.
        let host = lower.strip_suffix('.').unwrap_or(&lower).to_string();
        if host.is_empty() || host.contains('/') {
            d.err(
                &h.span(),
                format!("{key}: host '{}' is not a host name", h.get_ref()),
            );
        } else if host
            .rsplit_once(':')
            .is_some_and(|(_, port)| !port.contains(']'))
        {
            // Requests match on the host without its port: this could never match.
            d.err(
                &h.span(),
                format!("{key}: host '{}' must not include a port", h.get_ref()),
            );
        }
        host
    });
    let mut upgrades = vec!["websocket".to_string()];
    if let Some(list) = &r.upgrades {
        upgrades.clear();
        for u in list {
            let token = u.get_ref().trim().to_ascii_lowercase();
            if token == "h2c" {
                // Inside an h2c tunnel, requests would never meet a route or a policy.
                d.err(
                    &u.span(),
                    format!("{key}: upgrades: \"h2c\" is never passed through (its requests would bypass every route and policy)"),
                );
            } else if token.is_empty() || http::HeaderName::from_bytes(token.as_bytes()).is_err() {
                d.err(
                    &u.span(),
                    format!(
                        "{key}: upgrades: '{}' is not a protocol name like \"websocket\"",
                        u.get_ref()
                    ),
                );
            } else {
                upgrades.push(token);
            }
        }
    }
    let target = match (&r.upstream, &r.respond) {
        (Some(u), None) => match names.upstreams.get(u.get_ref()) {
            Some(up) => Some(Target::Upstream(up.clone())),
            None => {
                if !names.declared_upstreams.contains(u.get_ref().as_str()) {
                    d.err(
                        &u.span(),
                        format!("{key}: unknown upstream '{}'", u.get_ref()),
                    );
                }
                None
            }
        },
        (None, Some(resp)) => {
            let rr = resp.get_ref();
            match u16::try_from(*rr.status.get_ref())
                .ok()
                .and_then(|c| StatusCode::from_u16(c).ok())
            {
                Some(status) if (200..600).contains(&status.as_u16()) => Some(Target::Respond {
                    status,
                    body: Bytes::from(rr.body.clone()),
                    content_type: rr
                        .content_type
                        .clone()
                        .unwrap_or_else(|| "text/plain; charset=utf-8".to_string()),
                }),
                _ => {
                    d.err(
                        &rr.status.span(),
                        format!(
                            "{key}: respond.status: {} is not a status from 200 to 599",
                            rr.status.get_ref()
                        ),
                    );
                    None
                }
            }
        }
        (Some(u), Some(_)) => {
            d.err(
                &u.span(),
                format!("{key}: give either upstream or respond, not both"),
            );
            None
        }
        (None, None) => {
            d.err(
                &raw.span(),
                format!("{key}: needs upstream = \"NAME\" or respond = {{ status = 200 }}"),
            );
            None
        }
    };
    let policy = match &r.policy {
        None => None,
        Some(p) => match names.policies.get(p.get_ref()) {
            Some(policy) => Some(policy.clone()),
            None => {
                if !names.declared_policies.contains(p.get_ref().as_str()) {
                    d.err(
                        &p.span(),
                        format!("{key}: unknown policy '{}'", p.get_ref()),
                    );
                }
                return None;
            }
        },
    };
    let cost = match &r.cost {
        Some(c) => positive(d, &format!("{key}: cost"), c)?,
        None => 1,
    };
    if d.errors.len() > errors_before {
        return None;
    }
    Some(Route {
        name: r.name.as_ref().map_or_else(
            || path_text.as_str().into(),
            |n| n.get_ref().as_str().into(),
        ),
        path,
        methods,
        host,
        upgrades,
        target: target?,
        policy,
        cost,
    })
}
