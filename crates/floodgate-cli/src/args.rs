//! Value parsers shared by the subcommands' flags.

use std::time::Duration;

use floodgate_core::{AlgorithmKind, CalendarUnit, PolicyError, parse};

/// Core's message without the "cannot parse policy" framing, which reads oddly for a flag value.
fn message(err: PolicyError) -> String {
    match err {
        PolicyError::Parse { reason, .. } => reason,
        other => other.to_string(),
    }
}

/// `1s`, `500ms`, `30m`, `1.5h`, ... (see [`parse::parse_duration`]).
pub(crate) fn duration(s: &str) -> Result<Duration, String> {
    parse::parse_duration(s).map_err(message)
}

/// `+08:00`, `-0530`, `UTC`, ... in seconds east of UTC.
pub(crate) fn utc_offset(s: &str) -> Result<i32, String> {
    parse::parse_utc_offset(s).map_err(message)
}

/// An algorithm name or alias (`gcra`, `funnel`, `sliding_log`, ...). Not `calendar`: as a
/// flag it would name a fixed window that `--window` makes rolling, while `calendar:` in a
/// policy string means windows aligned to the calendar.
pub(crate) fn algorithm(s: &str) -> Result<AlgorithmKind, String> {
    if s.trim().eq_ignore_ascii_case("calendar") {
        return Err(
            "for windows aligned to the calendar, use --algorithm fixed_window with \
                    --calendar UNIT (or --policy \"calendar:10/day\")"
                .into(),
        );
    }
    s.parse().map_err(message)
}

/// `second`, `minute`, `hour`, `day`, `week` or `month`.
pub(crate) fn calendar_unit(s: &str) -> Result<CalendarUnit, String> {
    s.parse().map_err(message)
}

/// A duration the way policies name them: `10s`, `1500ms`, `2m`.
pub(crate) fn short_duration(d: Duration) -> String {
    parse::format_duration(d)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_values_with_plain_messages() {
        assert_eq!(duration("500ms"), Ok(Duration::from_millis(500)));
        let err = duration("5").expect_err("no unit");
        assert!(!err.contains("policy"), "{err}");
        assert!(err.contains("unit"), "{err}");
        assert_eq!(utc_offset("+08:00"), Ok(8 * 3600));
        assert_eq!(algorithm("funnel"), Ok(AlgorithmKind::LeakyBucket));
        assert!(algorithm("nope").is_err());
        let calendar = algorithm("Calendar").expect_err("ambiguous");
        assert!(calendar.contains("--calendar UNIT"), "{calendar}");
        assert_eq!(calendar_unit("day"), Ok(CalendarUnit::Day));
    }

    #[test]
    fn short_durations() {
        assert_eq!(short_duration(Duration::from_secs(10)), "10s");
        assert_eq!(short_duration(Duration::from_millis(1500)), "1500ms");
        assert_eq!(short_duration(Duration::from_secs(120)), "2m");
    }
}
