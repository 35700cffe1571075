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

/// Milliseconds on a monotonic clock that moves in the kernel's ticks (1 to
/// 4 ms): for what is timed in seconds (idle connections, kept upstream
/// connections). On Linux it reads the time the kernel last noted, with no
/// hardware counter read and no `Instant` arithmetic: about 100
/// instructions fewer than `Instant::elapsed`, which counted three times a
/// proxied request.
pub fn coarse_ms() -> u64 {
    coarse(CoarseClock::Monotonic).as_millis() as u64
}

/// Seconds since the unix epoch, to the kernel's last tick (see
/// [`coarse_ms`]): for the `Date` header.
pub fn coarse_unix_secs() -> u64 {
    coarse(CoarseClock::Wall).as_secs()
}

#[derive(Clone, Copy)]
enum CoarseClock {
    Monotonic,
    Wall,
}

#[cfg(target_os = "linux")]
fn coarse(which: CoarseClock) -> Duration {
    let id = match which {
        CoarseClock::Monotonic => libc::CLOCK_MONOTONIC_COARSE,
        CoarseClock::Wall => libc::CLOCK_REALTIME_COARSE,
    };
    let mut t = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `t` is a valid timespec to write to, and both clocks exist on
    // every Linux since 2.6.32; a failure leaves it at zero.
    unsafe { libc::clock_gettime(id, &mut t) };
    Duration::new(
        t.tv_sec.max(0) as u64,
        t.tv_nsec.clamp(0, 999_999_999) as u32,
    )
}

#[cfg(not(target_os = "linux"))]
fn coarse(which: CoarseClock) -> Duration {
    match which {
        CoarseClock::Monotonic => {
            static START: std::sync::OnceLock<std::time::Instant> = std::sync::OnceLock::new();
            START.get_or_init(std::time::Instant::now).elapsed()
        }
        CoarseClock::Wall => SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or_default(),
    }
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
