//! Requests settled when their answer's body ends: a policy's `meter` read
//! from the trailers or counted in body bytes, and `concurrency` slots held
//! until the body has been sent (or the client has gone).
//!
//! A [`Metering`] rides in the answer's body ([`super::pool::PooledBody`]),
//! which shows it every frame on its way to the client; when the body is
//! dropped (read to the end, or abandoned) it settles the ticket in a task
//! of its own, one store call.

use http::{HeaderMap, HeaderName, StatusCode};
use prometheus_client::metrics::counter::Counter;

use crate::config::Meter;
use crate::limiter::{Settler, Ticket};

/// The most units a meter value may say: beyond 2^53 a count is no longer
/// exact in Redis's numbers (and no answer costs that much).
pub const MAX_UNITS: u64 = 1 << 53;

/// A meter value: decimal digits (spaces around allowed), at most
/// [`MAX_UNITS`]; anything else (negative, a fraction, text, empty) is
/// malformed.
pub fn parse_units(value: &[u8]) -> Option<u64> {
    let digits = value.trim_ascii();
    if digits.is_empty() || digits.len() > 16 || !digits.iter().all(u8::is_ascii_digit) {
        return None;
    }
    let n = digits
        .iter()
        .fold(0u64, |n, &d| n * 10 + u64::from(d - b'0'));
    (n <= MAX_UNITS).then_some(n)
}

/// The metrics a settlement counts in, for one policy.
#[derive(Clone)]
pub struct MeterCounters {
    pub units: Counter,
    pub errors: Counter,
}

/// What the answer says the request cost, as far as it is known.
enum Reading {
    /// No meter: the reservation stands (a ticket held for its slots).
    Estimate,
    /// Read from the answer's head: a value, or `None` when missing or
    /// malformed.
    Head(Option<u64>),
    /// To be read from this trailer field: `Some` once the trailers came.
    Trailer(HeaderName, Option<Option<u64>>),
    /// The body bytes sent.
    BodyBytes,
}

/// A ticket settled when the body it rides in is dropped.
pub struct Metering {
    settler: Settler,
    ticket: Option<Ticket>,
    status: StatusCode,
    reading: Reading,
    sent: u64,
    ended: bool,
    counters: Option<MeterCounters>,
    /// `sluice_store_errors_total`: a settlement that fails counts there.
    store_errors: Counter,
}

impl Metering {
    /// `head`: the meter's value in the answer's head, for a header meter.
    pub fn new(
        settler: Settler,
        ticket: Ticket,
        status: StatusCode,
        meter: Option<&Meter>,
        head: Option<Option<u64>>,
        counters: Option<MeterCounters>,
        store_errors: Counter,
    ) -> Metering {
        let reading = match meter {
            None => Reading::Estimate,
            Some(Meter::Header(_)) => Reading::Head(head.flatten()),
            Some(Meter::Trailer(name)) => Reading::Trailer(name.clone(), None),
            Some(Meter::BodyBytes) => Reading::BodyBytes,
        };
        Metering {
            settler,
            ticket: Some(ticket),
            status,
            reading,
            sent: 0,
            ended: false,
            counters,
            store_errors,
        }
    }

    /// `bytes` of the body went to the client.
    pub fn data(&mut self, bytes: usize) {
        self.sent += bytes as u64;
    }

    pub fn trailers(&mut self, trailers: &HeaderMap) {
        if let Reading::Trailer(name, seen) = &mut self.reading {
            *seen = Some(trailers.get(&*name).and_then(|v| parse_units(v.as_bytes())));
        }
    }

    /// The body was read to its end.
    pub fn ended(&mut self) {
        self.ended = true;
    }

    /// What the request cost, and whether a meter value was missing or
    /// malformed (counted as an error; the estimate stands).
    fn reading(&self) -> (Option<u64>, bool) {
        match &self.reading {
            Reading::Estimate => (None, false),
            Reading::Head(value) => (*value, value.is_none()),
            Reading::Trailer(_, Some(value)) => (*value, value.is_none()),
            // Cut off before its trailers: the estimate stands, and only an
            // answer that ended without them is the upstream's error.
            Reading::Trailer(_, None) => (None, self.ended),
            Reading::BodyBytes => (Some(self.sent), false),
        }
    }
}

impl Drop for Metering {
    fn drop(&mut self) {
        let Some(ticket) = self.ticket.take() else {
            return;
        };
        let (metered, error) = self.reading();
        let metering = !matches!(self.reading, Reading::Estimate);
        if let (true, Some(c)) = (error, &self.counters) {
            c.errors.inc();
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let (settler, status, counters) = (self.settler.clone(), self.status, self.counters.take());
        let store_errors = self.store_errors.clone();
        runtime.spawn(async move {
            match settler.settle(ticket, status, false, metered).await {
                Ok(settled) => {
                    if let (true, Some(c)) = (metering && !settled.refunded, counters) {
                        c.units.inc_by(settled.charged);
                    }
                }
                Err(e) => {
                    store_errors.inc();
                    crate::store::log_error(&e, "could not settle a request");
                }
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn meter_values_are_whole_numbers_up_to_2_53() {
        assert_eq!(parse_units(b"42"), Some(42));
        assert_eq!(parse_units(b" 7 "), Some(7));
        assert_eq!(parse_units(b"0"), Some(0));
        assert_eq!(parse_units(b"9007199254740992"), Some(MAX_UNITS));
        for bad in [
            &b""[..],
            b"-1",
            b"+1",
            b"1.5",
            b"1e3",
            b"abc",
            b"9007199254740993",
            b"99999999999999999999",
            b"0x10",
        ] {
            assert_eq!(parse_units(bad), None, "{bad:?}");
        }
    }
}
