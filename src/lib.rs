//! sluice: a reverse proxy with built-in rate limiting.
//!
//! A map of the modules, in the order a request meets them:
//!
//! - [`server`]: accepts connections, HTTP/1.1 and HTTP/2, graceful shutdown;
//!   [`server::run`] is the whole program minus the command line.
//! - [`front`]: sluice's own HTTP/1.1 server for the usual request, on
//!   plain TCP and TLS; it hands anything else to hyper's.
//! - [`idle`]: the client connections: closed when idle for too long, and
//!   at shutdown.
//! - [`stall`]: cuts clients that stop reading (`client_send_timeout`).
//! - [`coalesce`]: small vectored writes sent as one buffer (plain TCP).
//! - [`graceful`]: shutdown that lets requests in flight finish.
//! - [`http2`]: sluice's own HTTP/2 server (frames, HPACK, streams, flow
//!   control), on plain TCP and TLS.
//! - [`proxy`]: the phases of one request (match, identify, decide, forward,
//!   settle, log) and the responses sluice makes itself.
//! - [`router`]: which route a request belongs to.
//! - [`fields`]: a request's fields, from hyper's map or the front's head.
//! - [`identity`]: the client address and the identities limits count by.
//! - [`limiter`]: policy → counters → verdict; the boundary stores plug into.
//! - [`plans`]: which plan each identity is on, shared by every instance.
//! - [`deny_cache`]: denials remembered locally, so a flood costs the store nothing.
//! - [`store`]: where counters live (memory, Redis).
//! - [`config`]: the TOML file, checked, with `file:line` errors.
//! - [`tls`]: rustls settings for TLS termination and https upstreams.
//! - [`clock`]: unix milliseconds, movable in tests.
//! - [`calendar`]: `"1d"`, `"1w"`, `"1mo"` windows in a policy's time zone.
//! - [`ascii`]: field names compared without case, a word at a time.
//! - [`admin`], [`metrics`]: `/healthz`, `/readyz`, `/metrics` on `admin_listen`.

pub mod admin;
pub mod ascii;
pub mod calendar;
pub mod clock;
pub mod coalesce;
pub mod config;
pub mod deny_cache;
pub mod fields;
pub mod front;
pub mod graceful;
pub mod http2;
pub mod identity;
pub mod idle;
pub mod limiter;
pub mod metrics;
pub mod plans;
pub mod proxy;
pub mod router;
pub mod server;
pub mod stall;
pub mod store;
pub mod tls;

pub use server::{Server, ServerError, run};
