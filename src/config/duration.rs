//! Duration strings of the configuration: `"250ms"`, `"1s"`, `"1m"`, `"1h"`, `"1d"`;
//! as a limit's window, also the calendar windows `"1w"` and `"1mo"`.
//!
//! One number and one unit, nothing else: a config file is read by people, and
//! `"1m30s"` or `"1.5m"` invite mistakes that a plain `"90s"` avoids.

use std::time::Duration;

use crate::calendar::Unit;

/// A limit's window as written.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Window {
    Span(Duration),
    /// `"1w"` or `"1mo"` (`"1d"` is a span here: whether it follows a time
    /// zone depends on its policy and algorithm).
    Calendar(Unit),
}

/// Parses a limit's window: a duration, `"1w"` or `"1mo"`.
pub fn parse_window(text: &str) -> Result<Window, String> {
    let trimmed = text.trim();
    let calendar = [("mo", Unit::Month), ("w", Unit::Week)]
        .into_iter()
        .find_map(|(unit, u)| Some((trimmed.strip_suffix(unit)?, unit, u)));
    match calendar {
        Some(("1", _, u)) => Ok(Window::Calendar(u)),
        Some((n, unit, _)) if !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()) => {
            Err(format!(
                "window '{trimmed}': calendar windows are \"1w\" and \"1mo\" only (not {n}{unit})"
            ))
        }
        _ => parse(text).map(Window::Span).map_err(|e| {
            e.replace(
                "(use ms, s, m, h or d)",
                "(use ms, s, m, h, d, or the calendar windows 1w and 1mo)",
            )
        }),
    }
}

/// Parses a duration string; the error says what was expected.
pub fn parse(text: &str) -> Result<Duration, String> {
    let text = text.trim();
    let split = text
        .find(|c: char| !c.is_ascii_digit())
        .ok_or_else(|| format!("duration '{text}' has no unit (use ms, s, m, h or d)"))?;
    let (number, unit) = text.split_at(split);
    if number.is_empty() {
        return Err(format!(
            "duration '{text}' must start with a whole number, like \"250ms\" or \"1m\""
        ));
    }
    let n: u64 = number
        .parse()
        .map_err(|_| format!("duration '{text}' is too large"))?;
    let ms_per_unit: u64 = match unit {
        "ms" => 1,
        "s" => 1_000,
        "m" => 60_000,
        "h" => 3_600_000,
        "d" => 86_400_000,
        _ => {
            return Err(format!(
                "duration '{text}' has an unknown unit '{unit}' (use ms, s, m, h or d)"
            ));
        }
    };
    let ms = n
        .checked_mul(ms_per_unit)
        .ok_or_else(|| format!("duration '{text}' is too large"))?;
    Ok(Duration::from_millis(ms))
}

/// Formats a duration the way the config writes it, with the largest exact unit.
pub fn format(d: Duration) -> String {
    let ms = d.as_millis() as u64;
    for (unit, size) in [
        ("d", 86_400_000),
        ("h", 3_600_000),
        ("m", 60_000),
        ("s", 1_000),
    ] {
        if ms != 0 && ms.is_multiple_of(size) {
            return format!("{}{unit}", ms / size);
        }
    }
    format!("{ms}ms")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_every_unit() {
        assert_eq!(parse("250ms"), Ok(Duration::from_millis(250)));
        assert_eq!(parse("1s"), Ok(Duration::from_secs(1)));
        assert_eq!(parse("2m"), Ok(Duration::from_secs(120)));
        assert_eq!(parse("1h"), Ok(Duration::from_secs(3600)));
        assert_eq!(parse("1d"), Ok(Duration::from_secs(86400)));
    }

    #[test]
    fn windows_are_spans_or_calendar_weeks_and_months() {
        assert_eq!(parse_window("1w"), Ok(Window::Calendar(Unit::Week)));
        assert_eq!(parse_window("1mo"), Ok(Window::Calendar(Unit::Month)));
        assert_eq!(
            parse_window("1d"),
            Ok(Window::Span(Duration::from_secs(86400)))
        );
        for bad in ["2w", "3mo", "0mo", "mo", "1.5w", "1x", "w"] {
            assert!(parse_window(bad).is_err(), "{bad:?} should be refused");
        }
        // Elsewhere a week is no duration.
        assert!(parse("1w").is_err());
    }

    #[test]
    fn refuses_bad_strings() {
        for bad in [
            "",
            "1",
            "s",
            "1.5s",
            "-1s",
            "1x",
            "1 s",
            "99999999999999999999d",
        ] {
            assert!(parse(bad).is_err(), "{bad:?} should be refused");
        }
    }

    #[test]
    fn formats_with_largest_unit() {
        assert_eq!(format(Duration::from_millis(250)), "250ms");
        assert_eq!(format(Duration::from_secs(60)), "1m");
        assert_eq!(format(Duration::from_secs(90)), "90s");
        assert_eq!(format(Duration::from_secs(7200)), "2h");
    }
}
