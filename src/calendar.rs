//! Calendar windows: `fixed` limits of `"1d"`, `"1w"` and `"1mo"` that start at
//! local midnight, on Monday and on the first of the month in a policy's time
//! zone (IANA rules from the time-zone database bundled into the binary).
//!
//! A day with a daylight-saving change is 23 or 25 hours long, and a month
//! as long as it is: windows are found from civil dates, never by adding a
//! fixed number of milliseconds.

use std::sync::Arc;

use arc_swap::ArcSwapOption;
use jiff::civil::Date;
use jiff::tz::TimeZone;
use jiff::{Timestamp, ToSpan};

use crate::store::Ends;

/// How long a calendar window is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Unit {
    Day,
    Week,
    Month,
}

impl Unit {
    /// As the config writes it.
    pub fn text(self) -> &'static str {
        match self {
            Unit::Day => "1d",
            Unit::Week => "1w",
            Unit::Month => "1mo",
        }
    }

    /// A nominal length (a month is taken as 30 days): what the IETF
    /// `RateLimit-Policy` field's `w` says, and `sluice check` sorts by.
    pub fn nominal_ms(self) -> u64 {
        const DAY: u64 = 86_400_000;
        match self {
            Unit::Day => DAY,
            Unit::Week => 7 * DAY,
            Unit::Month => 30 * DAY,
        }
    }
}

/// A limit's calendar: the window length and the time zone it follows.
#[derive(Debug, Clone)]
pub struct Calendar {
    pub unit: Unit,
    pub tz: TimeZone,
    /// The last window found, [`Calendar::window`]'s answer: counters are
    /// built for the current window again and again (each new connection,
    /// each new client), and finding it in the time-zone rules costs more
    /// than the rest of building them.
    last: Arc<ArcSwapOption<(u64, u64, u64)>>,
}

impl Calendar {
    pub fn new(unit: Unit, tz: TimeZone) -> Calendar {
        Calendar {
            unit,
            tz,
            last: Arc::default(),
        }
    }

    /// The first day of the window holding `day`.
    fn first_day(&self, day: Date) -> Option<Date> {
        match self.unit {
            Unit::Day => Some(day),
            Unit::Week => {
                let back = i64::from(day.weekday().to_monday_zero_offset());
                day.checked_sub(back.days()).ok()
            }
            Unit::Month => Some(day.first_of_month()),
        }
    }

    /// The first day of the window after the one starting on `first`.
    fn next_first_day(&self, first: Date) -> Option<Date> {
        match self.unit {
            Unit::Day => first.tomorrow().ok(),
            Unit::Week => first.checked_add(7.days()).ok(),
            Unit::Month => first.last_of_month().tomorrow().ok(),
        }
    }

    /// The first instant of `day` here, as unix ms: midnight, or when
    /// midnight falls in a daylight-saving gap, the end of the gap.
    fn start_ms(&self, day: Date) -> Option<u64> {
        let zoned = day.to_zoned_datetime(self.tz.clone()).ok()?;
        u64::try_from(zoned.timestamp().as_millisecond()).ok()
    }

    /// The window holding `now_ms`: (its start, its end, the end of the
    /// window after it), unix ms. `None` only for instants out of the
    /// calendar's range (before 1970 or past 9999).
    pub fn window(&self, now_ms: u64) -> Option<(u64, u64, u64)> {
        let now = Timestamp::from_millisecond(i64::try_from(now_ms).ok()?).ok()?;
        let first = self.first_day(self.tz.to_datetime(now).date())?;
        let next = self.next_first_day(first)?;
        let after = self.next_first_day(next)?;
        Some((
            self.start_ms(first)?,
            self.start_ms(next)?,
            self.start_ms(after)?,
        ))
    }

    /// What a store is told about the window at `now_ms` (see [`Ends`]).
    /// Out of the calendar's range, a nominal window from `now_ms` on.
    pub fn ends(&self, now_ms: u64) -> Ends {
        if let Some(w) = &*self.last.load()
            && (w.0..w.1).contains(&now_ms)
        {
            return Ends {
                end: w.1,
                next_end: w.2,
            };
        }
        match self.window(now_ms) {
            Some(w @ (_, end, next_end)) => {
                self.last.store(Some(Arc::new(w)));
                Ends { end, next_end }
            }
            None => {
                let end = now_ms.saturating_add(self.unit.nominal_ms());
                Ends {
                    end,
                    next_end: end.saturating_add(self.unit.nominal_ms()),
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(text: &str) -> u64 {
        let ts: Timestamp = text.parse().expect("a timestamp");
        ts.as_millisecond() as u64
    }

    fn calendar(unit: Unit, tz: &str) -> Calendar {
        Calendar::new(unit, TimeZone::get(tz).expect("a zone"))
    }

    #[test]
    fn days_with_a_daylight_saving_change_are_23_and_25_hours() {
        let day = calendar(Unit::Day, "Europe/Berlin");
        // 2026-03-29: clocks go from 02:00 to 03:00.
        let (start, end, next) = day.window(at("2026-03-29T12:00:00+02:00")).unwrap();
        assert_eq!(start, at("2026-03-29T00:00:00+01:00"));
        assert_eq!(end, at("2026-03-30T00:00:00+02:00"));
        assert_eq!(end - start, 23 * 3_600_000);
        assert_eq!(next - end, 24 * 3_600_000);
        // 2026-10-25: clocks go from 03:00 back to 02:00.
        let (start, end, _) = day.window(at("2026-10-25T02:30:00+01:00")).unwrap();
        assert_eq!(start, at("2026-10-25T00:00:00+02:00"));
        assert_eq!(end, at("2026-10-26T00:00:00+01:00"));
        assert_eq!(end - start, 25 * 3_600_000);
        // The last millisecond of a day is in it; the next is not.
        let (_, end_before, _) = day.window(end - 1).unwrap();
        assert_eq!(end_before, end);
        let (start_after, _, _) = day.window(end).unwrap();
        assert_eq!(start_after, end);
    }

    #[test]
    fn a_day_that_starts_in_a_gap_starts_when_the_gap_ends() {
        // America/Santiago, 2026-09-06: midnight does not happen, 01:00 does.
        let day = calendar(Unit::Day, "America/Santiago");
        let (start, end, _) = day.window(at("2026-09-06T12:00:00-03:00")).unwrap();
        assert_eq!(start, at("2026-09-06T01:00:00-03:00"));
        assert_eq!(end - start, 23 * 3_600_000);
    }

    #[test]
    fn weeks_start_on_monday() {
        let week = calendar(Unit::Week, "UTC");
        // 2026-11-25 is a Wednesday.
        let (start, end, next) = week.window(at("2026-11-25T16:00:00Z")).unwrap();
        assert_eq!(start, at("2026-11-23T00:00:00Z"));
        assert_eq!(end, at("2026-11-30T00:00:00Z"));
        assert_eq!(next, at("2026-12-07T00:00:00Z"));
        // Monday 00:00 starts a week; Sunday 23:59:59.999 is in the one before.
        assert_eq!(week.window(start).unwrap().0, start);
        assert_eq!(week.window(start - 1).unwrap().1, start);
        // Across the change to summer time, a week is 167 hours.
        let berlin = calendar(Unit::Week, "Europe/Berlin");
        let (start, end, _) = berlin.window(at("2026-03-29T12:00:00+02:00")).unwrap();
        assert_eq!(start, at("2026-03-23T00:00:00+01:00"));
        assert_eq!(end - start, 167 * 3_600_000);
    }

    #[test]
    fn months_end_on_their_last_day_leap_years_included() {
        let month = calendar(Unit::Month, "UTC");
        let (start, end, next) = month.window(at("2028-02-10T00:00:00Z")).unwrap();
        assert_eq!(start, at("2028-02-01T00:00:00Z"));
        assert_eq!(end, at("2028-03-01T00:00:00Z"), "2028 is a leap year");
        assert_eq!(next, at("2028-04-01T00:00:00Z"));
        let (_, end, _) = month.window(at("2026-02-28T23:59:59.999Z")).unwrap();
        assert_eq!(end, at("2026-03-01T00:00:00Z"));
        let (start, end, next) = month.window(at("2026-12-31T23:00:00Z")).unwrap();
        assert_eq!(start, at("2026-12-01T00:00:00Z"));
        assert_eq!(end, at("2027-01-01T00:00:00Z"));
        assert_eq!(next, at("2027-02-01T00:00:00Z"));
        // In a zone east of UTC, a month starts the evening before in UTC.
        let tokyo = calendar(Unit::Month, "Asia/Tokyo");
        let (start, end, _) = tokyo.window(at("2026-03-31T16:00:00Z")).unwrap();
        assert_eq!(start, at("2026-03-31T15:00:00Z"));
        assert_eq!(end, at("2026-04-30T15:00:00Z"));
    }

    #[test]
    fn the_last_window_found_serves_until_it_ends() {
        let month = calendar(Unit::Month, "Europe/Berlin");
        let end = at("2026-04-01T00:00:00+02:00");
        let next_end = at("2026-05-01T00:00:00+02:00");
        let march = Ends { end, next_end };
        assert_eq!(month.ends(at("2026-03-10T12:00:00+01:00")), march);
        assert_eq!(month.ends(at("2026-03-01T00:00:00+01:00")), march);
        assert_eq!(month.ends(end - 1), march);
        assert_eq!(month.ends(end).end, next_end);
        // Time going back (another limiter's clock) finds the earlier window.
        assert_eq!(month.ends(end - 1), march);
        assert_eq!(
            month.ends(at("2026-02-28T23:59:59+01:00")).end,
            at("2026-03-01T00:00:00+01:00")
        );
    }

    #[test]
    fn utc_days_are_the_epoch_aligned_days() {
        let day = calendar(Unit::Day, "UTC");
        for now in [0, 1, 86_399_999, 86_400_000, 1_800_000_000_123] {
            let (start, end, next) = day.window(now).unwrap();
            assert_eq!(start, now - now % 86_400_000);
            assert_eq!((end, next), (start + 86_400_000, start + 172_800_000));
        }
    }
}
