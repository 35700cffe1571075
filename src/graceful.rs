//! Graceful shutdown of client connections: on the signal, each connection
//! finishes the requests it has in flight and closes, and the server waits for
//! the last one (within `server.shutdown_timeout`).
//!
//! hyper-util has the same (`server::graceful`), but it cannot watch hyper's
//! HTTP/1 connection with upgrades, which `server` serves directly (see
//! `server::starts_as_http1`).

use std::future::Future;
use std::pin::{Pin, pin};

use tokio::sync::watch;

/// The server's side: one signal for every connection.
pub struct Shutdown(watch::Sender<()>);

impl Shutdown {
    pub fn new() -> Shutdown {
        Shutdown(watch::channel(()).0)
    }

    /// A connection's side. Taken when the connection is accepted, before any
    /// signal: a receiver made after it would not see it.
    pub fn signal(&self) -> watch::Receiver<()> {
        self.0.subscribe()
    }

    /// Tells every connection to finish, and waits until all have.
    pub async fn drain(self) {
        self.0.send_replace(());
        self.0.closed().await;
    }
}

impl Default for Shutdown {
    fn default() -> Shutdown {
        Shutdown::new()
    }
}

/// Runs `conn` to its end; when `signal` comes first, `finish` tells it to end
/// after its requests in flight (hyper's `graceful_shutdown`).
pub async fn watch<C: Future>(
    conn: C,
    mut signal: watch::Receiver<()>,
    finish: impl FnOnce(Pin<&mut C>),
) -> C::Output {
    let mut conn = pin!(conn);
    tokio::select! {
        out = conn.as_mut() => return out,
        // A dropped sender (the server gone) means the same.
        _ = signal.changed() => finish(conn.as_mut()),
    }
    // `signal` lives until here: the server's drain waits for it.
    conn.await
}
