//! The proxy's clock: unix milliseconds, with an offset tests can move.
//!
//! Limits are defined on unix time (windows align to the epoch), so the clock is
//! wall time, not `Instant`. Tests advance it instead of sleeping, and can give
//! two instances clocks that disagree.

use std::sync::Arc;
use std::sync::atomic::{AtomicI64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// This host's clock in unix ms, for what no test needs to move (passive
/// health, log throttling): no `Clock` to make, so no allocation.
pub fn wall_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default()
        .as_millis() as u64
}

#[derive(Clone, Default)]
pub struct Clock {
    offset_ms: Arc<AtomicI64>,
}

impl Clock {
    /// This host's clock.
    pub fn system() -> Clock {
        Clock::default()
    }

    /// Milliseconds since the unix epoch, offset included.
    pub fn now_ms(&self) -> u64 {
        (wall_ms() as i64)
            .saturating_add(self.offset_ms.load(Ordering::Relaxed))
            .max(0) as u64
    }

    /// Moves this clock (and its clones) forward.
    pub fn advance(&self, by: Duration) {
        self.offset_ms
            .fetch_add(by.as_millis() as i64, Ordering::Relaxed);
    }

    /// Sets the offset from the host's clock (may be negative).
    pub fn set_offset_ms(&self, offset: i64) {
        self.offset_ms.store(offset, Ordering::Relaxed);
    }
}
