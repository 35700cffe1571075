//! The limiter: turns a policy and a request's identities into store counters,
//! asks the store, and reads the answer as a verdict with the headers' numbers.
//!
//! It is the boundary the proxy sees: [`Limiter::decide`] before forwarding,
//! [`Limiter::settle`] once the response status is known. Stores plug in below
//! it without the proxy knowing which one answers.

use std::net::IpAddr;
use std::sync::{Arc, Mutex};

use http::StatusCode;

use crate::fields::Fields;
use sha2::{Digest, Sha256};

use crate::clock::Clock;
use crate::config::{Algorithm, Charge, KeySpec, Mode, Policy};
use crate::deny_cache::DenyCache;
use crate::identity::{self, Identity, Values};
use crate::plans::{Change, Plans, Polled};
use crate::store::{Counter, Key, Memo, PerCounter, Store, StoreError};

pub struct Limiter {
    store: Arc<Store>,
    clock: Clock,
    /// `store.deny_cache`: only for a remote store (the memory store is as
    /// cheap as the cache).
    deny_cache: Option<DenyCache>,
    /// The plans assigned at run time.
    plans: Plans,
    /// The `concurrency` slots of requests running here, to renew.
    leases: Arc<LeaseBook>,
}

/// Why no plan could be chosen for a request (answered 400).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum PlanError {
    #[error(transparent)]
    TooManyValues(#[from] identity::TooManyValues),
    /// The values of the policy's `plan_key` are on different plans.
    #[error("the request names identities on different plans")]
    Mixed,
}

/// Where an identity's plan comes from (see [`Limiter::assigned`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Assigned {
    /// An assignment made at run time: the plan it names, and its index in
    /// the policy's `plans` (`None`: the default, named so or a plan
    /// removed from the file since).
    RunTime { name: Arc<str>, plan: Option<usize> },
    /// The file's `assign`: an index in the policy's `plans`.
    File(usize),
}

impl Assigned {
    /// The index in the policy's `plans`; `None` for the default.
    pub fn plan(&self) -> Option<usize> {
        match self {
            Assigned::RunTime { plan, .. } => *plan,
            Assigned::File(i) => Some(*i),
        }
    }
}

/// How long a request of a plan that refuses everything is told to wait
/// (`Retry-After`): an hour, after which a client may ask whether its plan
/// has changed.
pub const BLOCKED_RETRY_MS: u64 = 3_600_000;

/// The numbers the rate-limit headers show: the limit that binds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Binding {
    pub limit: u64,
    pub window_ms: u64,
    pub remaining: u64,
    pub reset_ms: u64,
    /// Ms from the decision to `reset_ms`, on the store's own clock (the
    /// proxy's may disagree with Redis's).
    pub reset_in_ms: u64,
    /// Ms until a retry can pass; 0 when allowed.
    pub retry_ms: u64,
    /// Index of the limit in its policy.
    pub index: usize,
    /// On a denial, the limits that refused: bit `i` for limit `i` (limits
    /// past the 64th are not marked). 0 when allowed.
    pub refused: u64,
}

/// What the limiter says about a request.
pub enum Verdict {
    /// Go on (after `delay_ms`, which a `gcra` limit's `delay` asks; the
    /// units are charged already); settle the ticket once the response is
    /// known.
    Allowed {
        binding: Binding,
        ticket: Ticket,
        delay_ms: u64,
    },
    /// Rejected: answer 429 with these numbers.
    Limited { binding: Binding },
    /// A shadow policy would have rejected: go on (nothing was charged), but
    /// say so in logs and metrics.
    ShadowLimited { binding: Binding },
    /// The request names more identities than are counted for one request
    /// (see [`identity::MAX_VALUES`]): answer 400, nothing was asked.
    TooManyValues,
}

/// What [`Limiter::settle`] needs to give back or charge a request's units.
/// Dropped unsettled (the client went away), it gives back what its
/// [`Undo`] says: its `concurrency` slots always, its units while it is
/// held by a `delay`.
pub struct Ticket {
    counters: Arc<Counters>,
    marks: PerCounter<u64>,
    cost: u64,
    undo: Option<Undo>,
}

/// What a ticket dropped unsettled gives back.
struct Undo {
    settler: Settler,
    /// Its entry in the [`LeaseBook`], when it holds `concurrency` slots.
    lease: Option<u64>,
    /// Units to give back (its cost while a `delay` holds it, else 0).
    units: u64,
}

impl Ticket {
    /// The plan the request was decided by.
    pub fn policy(&self) -> &Arc<Policy> {
        &self.counters.policy
    }

    /// Whether it holds `concurrency` slots, which the settlement frees.
    pub fn holds_slots(&self) -> bool {
        self.undo.as_ref().is_some_and(|u| u.lease.is_some())
    }

    /// While held by a `delay` (`true`), a ticket dropped unsettled gives
    /// its units back: the request never went anywhere.
    pub fn give_back_if_dropped(&mut self, settler: &Settler, held: bool) {
        let units = if held { self.cost } else { 0 };
        match &mut self.undo {
            Some(undo) => undo.units = units,
            None if held => {
                self.undo = Some(Undo {
                    settler: settler.clone(),
                    lease: None,
                    units,
                })
            }
            None => {}
        }
        if self
            .undo
            .as_ref()
            .is_some_and(|u| u.lease.is_none() && u.units == 0)
        {
            self.undo = None;
        }
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        let Some(undo) = self.undo.take() else {
            return;
        };
        let slots = undo.lease.is_some_and(|id| undo.settler.leases.remove(id));
        if !slots && undo.units == 0 {
            return;
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let (counters, marks, units) = (self.counters.clone(), self.marks.clone(), undo.units);
        let settler = undo.settler;
        runtime.spawn(async move {
            let now = settler.clock.now_ms();
            if let Err(e) = settler
                .store
                .refund(&counters.list, &marks, units, now)
                .await
            {
                crate::store::log_error(&e, "could not give back a request that went away");
            }
        });
    }
}

/// How a request was settled (see [`Limiter::settle`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Settled {
    /// Everything was given back (a `refund` status, or sluice's own 502/504).
    pub refunded: bool,
    /// The units the request was charged in the end.
    pub charged: u64,
}

/// What settles tickets, apart from the limiter: a body that settles its
/// request when it ends keeps one (see `proxy::metering`).
#[derive(Clone)]
pub struct Settler {
    store: Arc<Store>,
    clock: Clock,
    leases: Arc<LeaseBook>,
}

/// The `concurrency` slots of the requests running on this instance, each
/// renewed once a third of its lease has gone (see [`Limiter::renew_leases`]),
/// so that a slot outlives its lease only while its request runs.
#[derive(Default)]
pub struct LeaseBook {
    held: Mutex<std::collections::HashMap<u64, Lease>>,
    next: std::sync::atomic::AtomicU64,
    /// `sluice_concurrency_slots`, once the proxy has given it.
    gauge: std::sync::OnceLock<SlotGauge>,
}

type SlotGauge = prometheus_client::metrics::family::Family<
    crate::metrics::PolicyLabel,
    prometheus_client::metrics::gauge::Gauge,
>;

struct Lease {
    counters: Arc<Counters>,
    marks: PerCounter<u64>,
    /// Unix ms (the proxy's clock) at which to renew it next.
    renew_at: u64,
}

impl LeaseBook {
    fn lock(&self) -> std::sync::MutexGuard<'_, std::collections::HashMap<u64, Lease>> {
        self.held.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// How many requests hold slots here now.
    pub fn len(&self) -> usize {
        self.lock().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Counts slots held in `gauge` from now on.
    pub fn count_in(&self, gauge: SlotGauge) {
        let _ = self.gauge.set(gauge);
    }

    fn gauge(&self, policy: &Policy) -> Option<prometheus_client::metrics::gauge::Gauge> {
        let label = crate::metrics::PolicyLabel {
            policy: policy.name.to_string(),
        };
        Some(self.gauge.get()?.get_or_create(&label).clone())
    }

    fn add(&self, counters: &Arc<Counters>, marks: &PerCounter<u64>, now: u64) -> u64 {
        use std::sync::atomic::Ordering;
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        let lease = Lease {
            counters: counters.clone(),
            marks: marks.clone(),
            renew_at: now + counters.lease_ms / 3,
        };
        if let Some(g) = self.gauge(&counters.policy) {
            g.inc();
        }
        self.lock().insert(id, lease);
        id
    }

    /// Takes entry `id` out; whether it was there (not settled yet).
    fn remove(&self, id: u64) -> bool {
        let Some(lease) = self.lock().remove(&id) else {
            return false;
        };
        if let Some(g) = self.gauge(&lease.counters.policy) {
            g.dec();
        }
        true
    }
}

impl Settler {
    /// Settles a request once its answer is known. `proxy_error` is set when
    /// sluice itself answered 502/504 (the upstream never served it);
    /// `metered`: what the answer says the request cost (a policy's
    /// `meter`), `None` to keep what was reserved. One store call at most:
    /// it gives back or charges the difference, and frees the request's
    /// `concurrency` slots.
    pub async fn settle(
        &self,
        mut ticket: Ticket,
        status: StatusCode,
        proxy_error: bool,
        metered: Option<u64>,
    ) -> Result<Settled, StoreError> {
        let policy = &ticket.counters.policy;
        let free = proxy_error || policy.refund.contains(&status);
        let slots = match ticket.undo.take() {
            Some(Undo {
                lease: Some(id), ..
            }) => self.leases.remove(id),
            _ => false,
        };
        let cost = ticket.cost;
        let (list, marks) = (&ticket.counters.list, &ticket.marks[..]);
        // The clock is read only when there is something to do (the usual
        // request has nothing to settle).
        match policy.charge {
            Charge::Reserve if free => {
                let now = self.clock.now_ms();
                self.store.refund(list, marks, cost, now).await?;
                Ok(Settled {
                    refunded: true,
                    charged: 0,
                })
            }
            Charge::Reserve => {
                let used = metered.unwrap_or(cost);
                if used > cost {
                    let now = self.clock.now_ms();
                    // A calendar window may have ended since the decision.
                    let counters = ticket.counters.current(now);
                    self.store
                        .charge_more(&counters.list, marks, used - cost, now)
                        .await?;
                } else if used < cost || slots {
                    let now = self.clock.now_ms();
                    self.store.refund(list, marks, cost - used, now).await?;
                }
                Ok(Settled {
                    refunded: false,
                    charged: used,
                })
            }
            Charge::After if !free => {
                let used = metered.unwrap_or(cost);
                let now = self.clock.now_ms();
                let counters = ticket.counters.current(now);
                self.store.charge(&counters.list, used, now).await?;
                Ok(Settled {
                    refunded: false,
                    charged: used,
                })
            }
            Charge::After => Ok(Settled {
                refunded: true,
                charged: 0,
            }),
        }
    }
}

impl Limiter {
    pub fn new(store: Store, clock: Clock, deny_cache: bool) -> Limiter {
        let deny_cache =
            (deny_cache && !matches!(store, Store::Memory(_))).then(DenyCache::default);
        Limiter {
            store: Arc::new(store),
            clock,
            deny_cache,
            plans: Plans::default(),
            leases: Arc::default(),
        }
    }

    pub fn plans(&self) -> &Plans {
        &self.plans
    }

    /// The plan `value` of `policy`'s `plan_key` is assigned, if anything
    /// assigns it one: at run time (which wins), else in the file.
    pub fn assigned(&self, policy: &Policy, value: &[u8]) -> Option<Assigned> {
        match self.plans.get(&policy.name, value) {
            Some(name) => Some(Assigned::RunTime {
                plan: policy.plan_index(name.as_bytes()),
                name,
            }),
            None => policy.assign.get(value).map(|&i| Assigned::File(i)),
        }
    }

    /// The plan a request is decided by: `policy` itself (its default plan)
    /// or one of its `plans`. Each value of the policy's `plan_key` picks
    /// one: its [`assigned`](Limiter::assigned) plan, else the plan a proxy
    /// in `trusted` (the peer, `peer`) named in `plan_header`, else the
    /// default. Values on different plans are refused: whichever value a
    /// backend reads, the request was decided by its plan.
    pub fn plan_of<'p>(
        &self,
        policy: &'p Arc<Policy>,
        client: IpAddr,
        headers: Fields<'_>,
        query: Option<&str>,
        (peer, trusted): (IpAddr, &[ipnet::IpNet]),
    ) -> Result<&'p Arc<Policy>, PlanError> {
        let Some(spec) = policy
            .plan_key
            .as_ref()
            .filter(|_| !policy.plans.is_empty())
        else {
            return Ok(policy);
        };
        let (_, values) = identity::identify(spec, client, policy.ipv6_prefix, headers, query)?;
        let named = || {
            let header = policy.plan_header.as_ref()?;
            if !identity::is_trusted(peer.to_canonical(), trusted) {
                return None;
            }
            let name = headers.values(header).next()?;
            // An unknown name means the default.
            Some(policy.plan_index(name.trim_ascii()))
        };
        let mut chosen: Option<Option<usize>> = None;
        for value in values.iter() {
            let plan = match self.assigned(policy, value) {
                Some(assigned) => assigned.plan(),
                None => named().flatten(),
            };
            match chosen {
                Some(c) if c != plan => return Err(PlanError::Mixed),
                _ => chosen = Some(plan),
            }
        }
        Ok(match chosen.flatten() {
            Some(i) => &policy.plans[i],
            None => policy,
        })
    }

    /// The plan `value` of `policy`'s `plan_key` is on, without a request:
    /// its run-time assignment, else the file's, else the default.
    pub fn plan_for_value<'p>(&self, policy: &'p Arc<Policy>, value: &[u8]) -> &'p Arc<Policy> {
        let index = self.assigned(policy, value).and_then(|a| a.plan());
        index.map_or(policy, |i| &policy.plans[i])
    }

    /// Puts `value` of `policy` on `plan` (`None`: back to the file's plan,
    /// or the default), for every instance sharing the store: in force here
    /// at once, elsewhere within a second (see [`crate::plans`]).
    pub async fn assign(
        &self,
        policy: &Policy,
        value: &[u8],
        plan: Option<&str>,
    ) -> Result<(), StoreError> {
        if let Store::Redis(redis) = &*self.store {
            let (op, name) = match plan {
                Some(name) => ("set", name),
                None => ("del", ""),
            };
            redis
                .plan_change(op, &crate::plans::field(&policy.name, value), name)
                .await?;
        }
        let change = Change::Assign {
            policy: policy.name.clone(),
            value: value.to_vec(),
            plan: plan.map(Arc::from),
        };
        self.plans.apply(std::slice::from_ref(&change));
        if let Some(cache) = &self.deny_cache {
            cache.forget_policy(&policy.name);
        }
        Ok(())
    }

    /// Reads the plan changes other instances made (Redis), and applies
    /// them and their unbans to the deny cache; `reload`: read every
    /// assignment again. Called every [`crate::plans::POLL`].
    pub async fn sync_plans(&self, policies: &[Arc<Policy>], reload: bool) {
        let Store::Redis(redis) = &*self.store else {
            return;
        };
        let polled = match self.plans.poll(redis, reload).await {
            Ok(polled) => polled,
            Err(e) => {
                crate::store::log_error(&e, "could not read the plans' changes");
                return;
            }
        };
        let Some(cache) = &self.deny_cache else {
            return;
        };
        let changes = match polled {
            Polled::Reloaded => return cache.clear(),
            Polled::Changes(changes) => changes,
        };
        for change in changes {
            match change {
                Change::Assign { policy, .. } => cache.forget_policy(&policy),
                Change::Unban {
                    policy,
                    spec,
                    value,
                } => {
                    let policy = policies.iter().find(|p| p.name == policy);
                    if let (Some(policy), Ok(spec)) = (policy, spec.parse::<KeySpec>()) {
                        for (_, c) in
                            Self::identity_counters(policy, &spec, &value, self.clock.now_ms())
                        {
                            cache.remove(&c.key);
                        }
                    }
                }
            }
        }
    }

    pub fn deny_cache(&self) -> Option<&DenyCache> {
        self.deny_cache.as_ref()
    }

    pub fn store(&self) -> &Store {
        &self.store
    }

    /// Decides one request: every limit of the policy, for every identity, in
    /// one store call. A rejection charges nothing. `keys` is the
    /// connection's cache of counters (see [`KeyCache`]).
    pub async fn decide(
        &self,
        policy: &Arc<Policy>,
        cost: u64,
        client: IpAddr,
        headers: Fields<'_>,
        query: Option<&str>,
        keys: &KeyCache,
    ) -> Result<Verdict, StoreError> {
        // A plan with no limits (`limits = []`) refuses every request.
        if policy.limits.is_empty() {
            let binding = Binding {
                limit: 0,
                window_ms: 0,
                remaining: 0,
                reset_ms: self.clock.now_ms() + BLOCKED_RETRY_MS,
                reset_in_ms: BLOCKED_RETRY_MS,
                retry_ms: BLOCKED_RETRY_MS,
                index: 0,
                // The plan's one item (`q=0`) is what refused.
                refused: 1,
            };
            return Ok(match policy.mode {
                Mode::Enforce => Verdict::Limited { binding },
                Mode::Shadow => Verdict::ShadowLimited { binding },
            });
        }
        let now = self.clock.now_ms();
        let Ok(set) = keys.counters(policy, client, headers, query, now) else {
            return Ok(Verdict::TooManyValues);
        };
        let (counters, limit_of) = (&set.list, &set.limit_of);
        let charge = policy.charge == Charge::Reserve;
        let cache = self
            .deny_cache
            .as_ref()
            .filter(|_| policy.mode == Mode::Enforce);
        if let Some(binding) =
            cache.and_then(|c| c.check(counters.iter().map(|c| &c.key[..]), cost, now))
        {
            return Ok(Verdict::Limited { binding });
        }
        let mut outcome = (self.store)
            .acquire(counters, Some(&set.memo), cost, charge, now)
            .await?;
        // A `gcra` limit with a `delay` passes a request it holds first:
        // the wait, and what its headers show, follow from its reset (its
        // theoretical arrival time) and its burst.
        let mut delay_ms = 0;
        if outcome.allowed {
            for (i, c) in counters.iter().enumerate() {
                let Algorithm::Gcra { burst, delay } = c.algorithm else {
                    continue;
                };
                if delay.is_zero() {
                    continue;
                }
                let t = (c.window_ms * 1000 / c.limit.max(1)).max(1);
                let ahead_us = outcome.states[i].reset_ms.saturating_sub(outcome.now_ms) * 1000;
                let wait_us = ahead_us.saturating_sub(t.saturating_mul(burst));
                delay_ms = delay_ms.max(wait_us.div_ceil(1000));
                outcome.states[i].remaining = t.saturating_mul(burst).saturating_sub(ahead_us) / t;
            }
        }
        let binding = |i: usize| {
            let s = outcome.states[i];
            let l = &policy.limits[limit_of[i]];
            Binding {
                limit: l.limit,
                window_ms: l.window.as_millis() as u64,
                remaining: if outcome.allowed { s.remaining } else { 0 },
                reset_ms: s.reset_ms,
                reset_in_ms: s.reset_ms.saturating_sub(outcome.now_ms),
                retry_ms: s.retry_ms,
                index: limit_of[i],
                refused: 0,
            }
        };
        if let (Some(cache), false) = (cache, outcome.allowed) {
            for (i, s) in outcome.states.iter().enumerate() {
                // A slot may come free at any moment: not cached.
                let slot = matches!(counters[i].algorithm, Algorithm::Concurrency { .. });
                if s.retry_ms > 0 && !slot {
                    cache.insert(&counters[i].key, cost, binding(i), now);
                }
            }
        }
        let chosen = if outcome.allowed {
            // The least remaining binds; on a tie the later reset.
            (0..counters.len()).min_by_key(|&i| {
                let s = outcome.states[i];
                (s.remaining, std::cmp::Reverse(s.reset_ms))
            })
        } else {
            // The denial that lasts longest: waiting for it is waiting for all.
            (0..counters.len())
                .filter(|&i| outcome.states[i].retry_ms > 0)
                .max_by_key(|&i| (outcome.states[i].retry_ms, outcome.states[i].reset_ms))
        };
        // Policies have at least one limit, so there is always a counter.
        let binding = chosen.map(binding).unwrap_or(Binding {
            limit: 0,
            window_ms: 0,
            remaining: 0,
            reset_ms: now,
            reset_in_ms: 0,
            retry_ms: 0,
            index: 0,
            refused: 0,
        });
        // Every limit that refused, for the 429's `violated-policies`.
        let refused = (0..counters.len())
            .filter(|&i| outcome.states[i].retry_ms > 0 && limit_of[i] < 64)
            .fold(0u64, |mask, i| mask | 1 << limit_of[i]);
        let binding = Binding { refused, ..binding };
        let undo = (outcome.allowed && charge && set.lease_ms > 0).then(|| Undo {
            lease: Some(self.leases.add(&set, &outcome.marks, now)),
            settler: self.settler(),
            units: 0,
        });
        let ticket = Ticket {
            counters: set,
            marks: outcome.marks,
            cost,
            undo,
        };
        Ok(match (outcome.allowed, policy.mode) {
            (true, _) => Verdict::Allowed {
                binding,
                ticket,
                delay_ms,
            },
            (false, Mode::Enforce) => Verdict::Limited { binding },
            (false, Mode::Shadow) => Verdict::ShadowLimited { binding },
        })
    }

    /// What settles tickets, for a body that settles its request when it
    /// ends.
    pub fn settler(&self) -> Settler {
        Settler {
            store: self.store.clone(),
            clock: self.clock.clone(),
            leases: self.leases.clone(),
        }
    }

    /// The requests holding `concurrency` slots here.
    pub fn leases(&self) -> &LeaseBook {
        &self.leases
    }

    /// Renews the slots of the requests that have run for a third of their
    /// lease since they were taken or last renewed. Called every
    /// [`RENEW_EVERY`].
    pub async fn renew_leases(&self) {
        let now = self.clock.now_ms();
        let due: Vec<(Arc<Counters>, PerCounter<u64>)> = {
            let mut book = self.leases.lock();
            book.values_mut()
                .filter(|l| l.renew_at <= now)
                .map(|l| {
                    l.renew_at = now + l.counters.lease_ms / 3;
                    (l.counters.clone(), l.marks.clone())
                })
                .collect()
        };
        for (counters, marks) in due {
            if let Err(e) = self.store.renew(&counters.list, &marks, now).await {
                crate::store::log_error(&e, "could not renew a concurrency slot");
            }
        }
    }

    /// Settles a request once its answer is known: see [`Settler::settle`].
    pub async fn settle(
        &self,
        ticket: Ticket,
        status: StatusCode,
        proxy_error: bool,
        metered: Option<u64>,
    ) -> Result<Settled, StoreError> {
        self.settler()
            .settle(ticket, status, proxy_error, metered)
            .await
    }
}

/// How often [`Limiter::renew_leases`] looks for slots to renew.
/// A quarter of the shortest lease allowed (1 s): a slot is renewed within
/// a third of its lease plus this, well before it runs out.
pub const RENEW_EVERY: std::time::Duration = std::time::Duration::from_millis(250);

/// One limit's standing for one identity, as the usage endpoint reports it.
pub struct Usage {
    pub limit: crate::config::Limit,
    pub used: u64,
    pub remaining: u64,
    pub reset_ms: u64,
}

impl Limiter {
    /// The counters of `policy` that count the identity `spec = value`. An
    /// `ip` value is an address (or a range, `2001:db8::/64`), counted as
    /// the policy counts its clients: an IPv6 one by its `ipv6_prefix`.
    fn identity_counters(
        policy: &Policy,
        spec: &KeySpec,
        value: &[u8],
        now: u64,
    ) -> Vec<(usize, Counter)> {
        let mut value = value.to_vec();
        if *spec == KeySpec::Ip {
            let text = std::str::from_utf8(&value).unwrap_or_default();
            let ip = text
                .parse::<IpAddr>()
                .ok()
                .or_else(|| text.parse::<ipnet::IpNet>().ok().map(|n| n.network()));
            if let Some(ip) = ip {
                value.clear();
                identity::push_client_text(&mut value, ip, policy.ipv6_prefix);
            }
        }
        let id = Identity {
            spec: spec.clone(),
            value,
        };
        policy
            .limits
            .iter()
            .enumerate()
            // A header or query key falls back to the address when missing:
            // those clients are counted (and reset) under `ip`.
            .filter(|(_, l)| {
                l.keys.contains(spec)
                    || *spec == KeySpec::Ip
                        && l.keys
                            .iter()
                            .any(|k| matches!(k, KeySpec::Header(_) | KeySpec::Query(_)))
            })
            .map(|(i, l)| (i, counter(&policy.name, l, &id, now)))
            .collect()
    }

    /// Current usage of one identity under each limit of a policy that counts
    /// it; charges nothing.
    pub async fn usage(
        &self,
        policy: &Policy,
        spec: &KeySpec,
        value: &[u8],
    ) -> Result<Vec<Usage>, StoreError> {
        let now = self.clock.now_ms();
        let found = Self::identity_counters(policy, spec, value, now);
        let counters: Vec<Counter> = found.iter().map(|(_, c)| c.clone()).collect();
        if counters.is_empty() {
            return Ok(Vec::new());
        }
        let outcome = self.store.acquire(&counters, None, 0, false, now).await?;
        Ok(found
            .into_iter()
            .zip(outcome.states)
            .map(|((i, c), s)| Usage {
                limit: policy.limits[i].clone(),
                used: c.limit.saturating_sub(s.remaining),
                remaining: s.remaining,
                reset_ms: s.reset_ms,
            })
            .collect())
    }

    /// Deletes one identity's counters under a policy (and forgets any local
    /// denial of them).
    pub async fn reset(
        &self,
        policy: &Policy,
        spec: &KeySpec,
        value: &[u8],
    ) -> Result<(), StoreError> {
        let now = self.clock.now_ms();
        let counters: Vec<Counter> = Self::identity_counters(policy, spec, value, now)
            .into_iter()
            .map(|(_, c)| c)
            .collect();
        if let Some(cache) = &self.deny_cache {
            counters.iter().for_each(|c| cache.remove(&c.key));
        }
        self.store.forget(&counters).await?;
        // Every other instance's deny cache forgets them too.
        if let Store::Redis(redis) = &*self.store {
            let field = crate::plans::unban_field(&policy.name, spec, value);
            redis.plan_change("unban", &field, "").await?;
        }
        Ok(())
    }
}

/// The counters one request counts in, built from its policy and identities.
/// A connection keeps its last ones (see [`KeyCache`]).
pub struct Counters {
    policy: Arc<Policy>,
    /// One per key spec of the policy ([`Policy::specs`]): the spec it was
    /// counted under (after any fallback) and its values.
    ids: Vec<(KeySpec, Values)>,
    list: PerCounter<Counter>,
    /// For each counter, the index of its limit in the policy.
    limit_of: PerCounter<usize>,
    /// The store's encoding of `list`, kept while the connection reuses it.
    memo: Memo,
    /// Unix ms (the proxy's clock) at which the first of its calendar
    /// windows ends: from then on they are built afresh, with the next
    /// windows' bounds (`u64::MAX` without calendar windows).
    until: u64,
    /// The shortest lease of its `concurrency` counters; 0 without any.
    lease_ms: u64,
}

impl Counters {
    /// These counters, or when a calendar window of theirs has ended by
    /// `now`, the same counters with the current windows' bounds.
    fn current(self: &Arc<Counters>, now: u64) -> Arc<Counters> {
        if now < self.until {
            return self.clone();
        }
        Arc::new(Counters::build(&self.policy, self.ids.clone(), now))
    }

    fn build(policy: &Arc<Policy>, ids: Vec<(KeySpec, Values)>, now: u64) -> Counters {
        let n = policy.limits.len();
        let mut list = PerCounter::<Counter>::with_capacity(n);
        let mut limit_of = PerCounter::with_capacity(n);
        // Limits usually share their keys: hash each identity once.
        let groups: Vec<Vec<Vec<u8>>> = ids
            .iter()
            .map(|(spec, values)| {
                values
                    .iter()
                    .map(|v| group_key(&policy.name, spec, v))
                    .collect()
            })
            .collect();
        for (i, limit) in policy.limits.iter().enumerate() {
            for spec in &limit.keys {
                let Some(g) = policy.specs.iter().position(|s| s == spec) else {
                    continue;
                };
                for group in &groups[g] {
                    let c = counter_in(group, limit, now);
                    // Two specs can fall back to the same identity (both to
                    // the client address): count it once.
                    if list.iter().any(|o| o.key == c.key) {
                        continue;
                    }
                    list.push(c);
                    limit_of.push(i);
                }
            }
        }
        let until = list
            .iter()
            .filter_map(|c| c.calendar.map(|e| e.end))
            .min()
            .unwrap_or(u64::MAX);
        let lease_ms = list
            .iter()
            .filter_map(|c| match c.algorithm {
                Algorithm::Concurrency { lease } => Some(lease.as_millis() as u64),
                _ => None,
            })
            .min()
            .unwrap_or(0);
        Counters {
            policy: policy.clone(),
            ids,
            list,
            limit_of,
            memo: Memo::default(),
            until,
            lease_ms,
        }
    }
}

/// A connection's last [`Counters`]. A keep-alive client asks again and again
/// as the same identity, and turning an identity into keys (a SHA-256, and
/// three keys built) was a quarter of what a memory-store decision costs; a
/// request whose policy and identities match reuses them. Policies are
/// compared by pointer: a reload makes new ones, so old counters never serve;
/// nor do counters whose calendar window has ended (see [`Counters::until`]).
#[derive(Default)]
pub struct KeyCache(Mutex<Cached>);

#[derive(Default)]
struct Cached {
    last: Option<Arc<Counters>>,
    /// The client address `last` was built for: an `ip` identity is compared
    /// as an address, without writing its text.
    client: Option<IpAddr>,
    /// Where a request's identity values are written to be compared.
    scratch: Values,
}

impl KeyCache {
    fn counters(
        &self,
        policy: &Arc<Policy>,
        client: IpAddr,
        headers: Fields<'_>,
        query: Option<&str>,
        now: u64,
    ) -> Result<Arc<Counters>, identity::TooManyValues> {
        // A poisoned lock only means a panic elsewhere: the cache is still
        // whole (it is replaced, never edited in place).
        let mut cached = self.0.lock().unwrap_or_else(|e| e.into_inner());
        let Cached {
            last,
            client: last_client,
            scratch,
        } = &mut *cached;
        if let Some(c) = last
            && Arc::ptr_eq(&c.policy, policy)
            && now < c.until
            && policy
                .specs
                .iter()
                .zip(&c.ids)
                .all(|(spec, (counted_as, values))| match spec {
                    KeySpec::Ip => *last_client == Some(client),
                    KeySpec::Global => true,
                    KeySpec::Header(_) | KeySpec::Query(_) => {
                        let now = identity::identify_into(
                            spec,
                            client,
                            policy.ipv6_prefix,
                            headers,
                            query,
                            scratch,
                        );
                        now.is_ok_and(|now| now == counted_as) && scratch == values
                    }
                })
        {
            return Ok(c.clone());
        }
        let ids = identities(policy, client, headers, query)?;
        let built = Arc::new(Counters::build(policy, ids, now));
        *last = Some(built.clone());
        *last_client = Some(client);
        Ok(built)
    }
}

/// The identities of one request under `policy`: for each of
/// [`Policy::specs`], the spec counted and its values.
fn identities(
    policy: &Policy,
    client: IpAddr,
    headers: Fields<'_>,
    query: Option<&str>,
) -> Result<Vec<(KeySpec, Values)>, identity::TooManyValues> {
    policy
        .specs
        .iter()
        .map(|spec| identity::identify(spec, client, policy.ipv6_prefix, headers, query))
        .collect()
}

/// The counter of one limit for one identity, at `now`.
fn counter(policy: &str, limit: &crate::config::Limit, id: &Identity, now: u64) -> Counter {
    counter_in(&group_key(policy, &id.spec, &id.value), limit, now)
}

/// The counter of one limit in an identity's group (see [`group_key`]), at
/// `now`: a calendar window's bounds are those of the window `now` is in.
fn counter_in(group: &[u8], limit: &crate::config::Limit, now: u64) -> Counter {
    let mut key = Key::with_capacity(group.len() + 1 + limit.id.len());
    key.extend_from_slice(group);
    key.push(b':');
    key.extend_from_slice(limit.id.as_bytes());
    Counter {
        key,
        group_len: group.len(),
        limit: limit.limit,
        window_ms: limit.window.as_millis() as u64,
        algorithm: limit.algorithm,
        calendar: limit.calendar.as_ref().map(|c| c.ends(now)),
    }
}

/// `{TAG}:POLICY`: the part of its counters' keys one identity shares; a
/// counter's key is this, `:` and the limit's id. TAG is the first 128 bits of
/// the SHA-256 of the identity (spec and value), base64url-encoded (22
/// characters).
///
/// The value itself never appears in a key: whatever bytes a client sends, and
/// however many, its keys have the same shape and size, and the `{...}` hash
/// tag puts all counters of one identity in one Redis Cluster slot.
fn group_key(policy: &str, spec: &KeySpec, value: &[u8]) -> Vec<u8> {
    let mut hasher = Sha256::new();
    // The spec as its Display writes it, without formatting a String.
    match spec {
        KeySpec::Ip => hasher.update(b"ip"),
        KeySpec::Global => hasher.update(b"global"),
        KeySpec::Header(name) => {
            hasher.update(b"header:");
            hasher.update(name.as_str().as_bytes());
        }
        KeySpec::Query(name) => {
            hasher.update(b"query:");
            hasher.update(name.as_bytes());
        }
    }
    hasher.update([0]);
    hasher.update(value);
    let digest = hasher.finalize();
    let mut key = Vec::with_capacity(26 + policy.len());
    key.push(b'{');
    base64url(&digest[..16], &mut key);
    key.extend_from_slice(b"}:");
    key.extend_from_slice(policy.as_bytes());
    key
}

/// Base64url without padding (no `{`, `}` or `:` in it).
fn base64url(bytes: &[u8], out: &mut Vec<u8>) {
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_";
    let char_at = |n: u32, shift: u32| ALPHABET[(n >> shift & 63) as usize];
    let mut chunks = bytes.chunks_exact(3);
    for c in &mut chunks {
        let n = u32::from(c[0]) << 16 | u32::from(c[1]) << 8 | u32::from(c[2]);
        out.extend_from_slice(&[char_at(n, 18), char_at(n, 12), char_at(n, 6), char_at(n, 0)]);
    }
    match *chunks.remainder() {
        [a] => {
            let n = u32::from(a) << 16;
            out.extend_from_slice(&[char_at(n, 18), char_at(n, 12)]);
        }
        [a, b] => {
            let n = u32::from(a) << 16 | u32::from(b) << 8;
            out.extend_from_slice(&[char_at(n, 18), char_at(n, 12), char_at(n, 6)]);
        }
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn group_keys_stay_as_documented() {
        // Changing this changes every Redis key: counts would restart on upgrade.
        let id = Identity {
            spec: KeySpec::Ip,
            value: b"203.0.113.9".to_vec(),
        };
        assert_eq!(
            group_key("standard", &id.spec, &id.value),
            b"{scNGtWJnPGS1PNrahGtNKQ}:standard".to_vec()
        );
        let header = Identity {
            spec: KeySpec::Header(http::HeaderName::from_static("x-api-key")),
            value: b"k".to_vec(),
        };
        let mut hasher = Sha256::new();
        hasher.update(b"header:x-api-key\0k");
        let mut want = b"{".to_vec();
        base64url(&hasher.finalize()[..16], &mut want);
        want.extend_from_slice(b"}:p");
        assert_eq!(group_key("p", &header.spec, &header.value), want);
    }
}
