//! Prometheus metrics, served as text on the admin listener's `/metrics`.
//!
//! Names (all prefixed `sluice_`): `requests_total{route,status}`,
//! `decisions_total{policy,plan,outcome}` (plan: the plan in force, `default`
//! for a policy's own limits: plan names only, never identity values, so the
//! series stay bounded by the config; outcome: allowed, limited,
//! shadow_limited, store_error), `refunds_total{policy}`, `store_errors_total`,
//! `store_call_seconds` and `upstream_seconds{upstream}` (histograms),
//! `config_reloads_total{result}`, `underscore_headers_total{action}`
//! (request fields with `_` in their names, dropped or rejected);
//! `metered_units_total{policy}` (units metered requests were charged in the
//! end), `meter_errors_total{policy}` (answers whose meter value was
//! missing or malformed: the estimate stayed charged), `delayed_total{policy}`
//! and `delay_seconds_total{policy}` (requests a `gcra` limit's `delay` held,
//! and for how long), `concurrency_slots{policy}` (slots held by requests
//! running on this instance).

use std::fmt::Write;
use std::sync::{Arc, OnceLock};

use prometheus_client::encoding::{EncodeLabelSet, EncodeLabelValue, LabelValueEncoder};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

/// A label value shared, not copied: a route's or upstream's name, cloned per
/// request at the cost of a reference count.
#[derive(Clone, Debug, Hash, PartialEq, Eq)]
pub struct Name(pub Arc<str>);

impl EncodeLabelValue for Name {
    fn encode(&self, encoder: &mut LabelValueEncoder) -> std::fmt::Result {
        encoder.write_str(&self.0)
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RouteStatus {
    pub route: Name,
    pub status: u16,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PolicyOutcome {
    pub policy: Name,
    pub plan: Name,
    pub outcome: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PolicyLabel {
    pub policy: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ResultLabel {
    pub result: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ActionLabel {
    pub action: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct UpstreamLabel {
    pub upstream: Name,
}

type HistogramFamily<L> = Family<L, Histogram, fn() -> Histogram>;

pub struct Metrics {
    registry: Registry,
    pub requests: Family<RouteStatus, Counter>,
    pub decisions: Family<PolicyOutcome, Counter>,
    pub refunds: Family<PolicyLabel, Counter>,
    pub store_errors: Counter,
    pub store_seconds: Histogram,
    pub upstream_seconds: HistogramFamily<UpstreamLabel>,
    pub reloads: Family<ResultLabel, Counter>,
    pub underscores: Family<ActionLabel, Counter>,
    pub metered_units: Family<PolicyLabel, Counter>,
    pub meter_errors: Family<PolicyLabel, Counter>,
    pub delayed: Family<PolicyLabel, Counter>,
    pub delay_seconds: Family<PolicyLabel, Counter<f64, std::sync::atomic::AtomicU64>>,
    pub slots: Family<PolicyLabel, Gauge>,
}

fn latency_histogram() -> Histogram {
    // 100 µs to ~6.5 s.
    Histogram::new(exponential_buckets(0.0001, 2.0, 17))
}

impl Default for Metrics {
    fn default() -> Metrics {
        let mut registry = Registry::with_prefix("sluice");
        let requests = Family::default();
        let decisions = Family::default();
        let refunds = Family::default();
        let store_errors = Counter::default();
        let store_seconds = latency_histogram();
        let upstream_seconds: HistogramFamily<UpstreamLabel> =
            Family::new_with_constructor(latency_histogram);
        registry.register("requests", "Requests by route and status", requests.clone());
        registry.register(
            "decisions",
            "Limiter decisions by policy, plan and outcome",
            decisions.clone(),
        );
        registry.register("refunds", "Charges given back, by policy", refunds.clone());
        registry.register(
            "store_errors",
            "Store calls that failed or timed out",
            store_errors.clone(),
        );
        registry.register(
            "store_call_seconds",
            "Latency of limiter decisions in the Redis store",
            store_seconds.clone(),
        );
        let reloads = Family::default();
        registry.register(
            "config_reloads",
            "Configuration reloads by result (ok, error)",
            reloads.clone(),
        );
        registry.register(
            "upstream_seconds",
            "Time to the upstream's response headers",
            upstream_seconds.clone(),
        );
        let underscores = Family::default();
        registry.register(
            "underscore_headers",
            "Request header fields with '_' in their names, by action (dropped, rejected)",
            underscores.clone(),
        );
        let metered_units = Family::default();
        registry.register(
            "metered_units",
            "Units metered requests were charged once their answers were known, by policy",
            metered_units.clone(),
        );
        let meter_errors = Family::default();
        registry.register(
            "meter_errors",
            "Answers whose meter value was missing or malformed (the estimate stayed charged), by policy",
            meter_errors.clone(),
        );
        let delayed = Family::default();
        registry.register(
            "delayed",
            "Requests held by a gcra limit's delay, by policy",
            delayed.clone(),
        );
        let delay_seconds = Family::default();
        registry.register(
            "delay_seconds",
            "Time requests were held by a gcra limit's delay, by policy",
            delay_seconds.clone(),
        );
        let slots = Family::default();
        registry.register(
            "concurrency_slots",
            "Concurrency slots held by requests running on this instance, by policy",
            slots.clone(),
        );
        Metrics {
            registry,
            underscores,
            metered_units,
            meter_errors,
            delayed,
            delay_seconds,
            slots,
            requests,
            decisions,
            refunds,
            store_errors,
            store_seconds,
            upstream_seconds,
            reloads,
        }
    }
}

/// The outcomes `sluice_decisions_total` counts, in [`DecisionCounters`] order.
pub const OUTCOMES: [&str; 4] = ["allowed", "shadow_limited", "limited", "store_error"];

/// One policy's decision counters, looked up once per config instead of once
/// per request (a `Family` lookup takes a lock and hashes the labels).
pub type DecisionCounters = [Counter; 4];

/// The statuses whose `sluice_requests_total` counter a route keeps at hand
/// (see [`RouteCounters`]); the others are looked up in the family.
const USUAL_STATUSES: [u16; 12] = [200, 201, 204, 301, 302, 304, 400, 401, 403, 404, 429, 502];

/// One route's `sluice_requests_total` counters for the usual statuses, each
/// taken from the family when first needed and kept for the config's life: a
/// family lookup takes a lock and hashes the labels (SipHash over the route's
/// name), about 300 instructions a request. A counter is only made for a
/// status the route has answered, so `/metrics` shows no empty series.
pub struct RouteCounters {
    route: Name,
    usual: [OnceLock<Counter>; USUAL_STATUSES.len()],
}

impl RouteCounters {
    pub fn new(route: Arc<str>) -> RouteCounters {
        RouteCounters {
            route: Name(route),
            usual: Default::default(),
        }
    }

    /// Counts a request the route answered with `status`.
    pub fn count(&self, metrics: &Metrics, status: u16) {
        let label = || RouteStatus {
            route: self.route.clone(),
            status,
        };
        match USUAL_STATUSES.iter().position(|&s| s == status) {
            Some(i) => self.usual[i]
                .get_or_init(|| metrics.requests.get_or_create(&label()).clone())
                .inc(),
            None => metrics.requests.get_or_create(&label()).inc(),
        };
    }
}

impl Metrics {
    /// The counters of one plan of a policy.
    pub fn decision_counters(&self, policy: &Arc<str>, plan: &Arc<str>) -> DecisionCounters {
        OUTCOMES.map(|outcome| {
            self.decisions
                .get_or_create(&PolicyOutcome {
                    policy: Name(policy.clone()),
                    plan: Name(plan.clone()),
                    outcome,
                })
                .clone()
        })
    }

    /// Counts `n` request fields with `_` in their names, `action` taken.
    pub fn underscore_headers(&self, action: &'static str, n: usize) {
        self.underscores
            .get_or_create(&ActionLabel { action })
            .inc_by(n as u64);
    }

    pub fn reload(&self, result: &'static str) {
        self.reloads.get_or_create(&ResultLabel { result }).inc();
    }

    /// The Prometheus text exposition of every metric.
    pub fn render(&self) -> String {
        let mut out = String::new();
        // Writing to a String cannot fail.
        let _ = prometheus_client::encoding::text::encode(&mut out, &self.registry);
        out
    }
}
