//! Graceful shutdown of the client connections hyper's HTTP/1 server and
//! the own HTTP/2 server serve: on the signal
//! (see [`crate::idle::Connections::stop`]), each finishes the requests it
//! has in flight and closes.
//!
//! hyper-util has the same (`server::graceful`), but it cannot watch hyper's
//! HTTP/1 connection with upgrades, which `server` serves directly (see
//! `server::handoff`).

use std::future::Future;
use std::pin::Pin;

use tokio::sync::watch;

/// Runs `conn` to its end; when `signal` comes first, `finish` tells it to end
/// after its requests in flight (hyper's `graceful_shutdown`). `conn` comes
/// boxed: a connection moved into this future would be kept twice.
pub async fn watch<C: Future>(
    mut conn: Pin<Box<C>>,
    mut signal: watch::Receiver<()>,
    finish: impl FnOnce(Pin<&mut C>),
) -> C::Output {
    tokio::select! {
        out = conn.as_mut() => return out,
        // A dropped sender (the server gone) means the same.
        _ = signal.changed() => finish(conn.as_mut()),
    }
    conn.await
}
