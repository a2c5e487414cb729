//! Policies from strings: `"10/minute"`, `"1 per 30 minutes"`, `"calendar:10/day@+08:00"`.
//!
//! ```text
//! policy  := [algorithm ":"] amount ("/" | "per") [number] unit [option]*
//! option  := "burst" N | "ttl" duration | "@" utc-offset | "intervally"
//! unit    := ms | s | sec | second(s) | m | min | minute(s) | h | hour(s) | d | day(s)
//!          | w | week(s) | month(s) (calendar only)
//! ```
//!
//! Without an algorithm the policy is GCRA (`n` at once, then spread evenly), like
//! `Policy::per`. Algorithms: `gcra`, `fixed`, `calendar`, `sliding_log`/`log`,
//! `sliding_window`/`sliding`, `token_bucket`/`token`, `funnel`/`leaky_bucket`, `shaper`,
//! `concurrency` (`concurrency:10 ttl 30s`).

use std::str::FromStr;
use std::time::Duration;

use crate::calendar::CalendarUnit;
use crate::error::PolicyError;
use crate::policy::{AlgorithmKind, Policy};

const DEFAULT_LEASE_TTL: Duration = Duration::from_secs(60);

impl FromStr for Policy {
    type Err = PolicyError;

    /// Parses one policy; see the [module docs](crate::parse) for the grammar.
    fn from_str(input: &str) -> Result<Self, Self::Err> {
        parse_one(input).map_err(|e| match e {
            PolicyError::Parse { .. } => e,
            other => PolicyError::Parse {
                input: input.trim().into(),
                reason: other.to_string(),
            },
        })
    }
}

fn fail(input: &str, reason: impl Into<String>) -> PolicyError {
    PolicyError::Parse {
        input: input.trim().into(),
        reason: reason.into(),
    }
}

fn parse_one(input: &str) -> Result<Policy, PolicyError> {
    let text = input.trim().to_ascii_lowercase();
    if text.is_empty() {
        return Err(fail(input, "empty policy"));
    }
    if text.len() > 200 {
        return Err(fail(input, "longer than 200 characters"));
    }
    let (algo, calendar, rest) = match text.split_once(':') {
        // `calendar:` is a fixed window aligned to the calendar.
        Some((a, rest)) if !a.trim().contains(['/', ' ']) => {
            let a = a.trim();
            (a.parse::<AlgorithmKind>()?, a == "calendar", rest.trim())
        }
        _ => (AlgorithmKind::Gcra, false, text.as_str()),
    };
    let (amount, after) = split_amount(input, rest)?;
    if algo == AlgorithmKind::Concurrency {
        let opts = Options::parse(input, after)?;
        opts.check_for(input, algo)?;
        let limit = whole(input, amount)?;
        return Policy::concurrency(limit, opts.ttl.unwrap_or(DEFAULT_LEASE_TTL));
    }
    let after = after
        .strip_prefix('/')
        .or_else(|| after.strip_prefix("per"))
        .ok_or_else(|| fail(input, "expected '/' or 'per' after the amount"))?
        .trim_start();
    let (period_n, unit, opts_text) = split_period(input, after, "period", false)?;
    let opts = Options::parse(input, opts_text)?;
    opts.check_for(input, algo)?;
    let policy = if calendar {
        let n = u32::try_from(whole(input, period_n)?)
            .map_err(|_| fail(input, "too many calendar units"))?;
        let unit = unit.parse::<CalendarUnit>()?;
        let p = Policy::calendar_window(whole(input, amount)?, n, unit)?;
        match opts.offset {
            Some(secs) => p.with_utc_offset(secs)?,
            None => p,
        }
    } else {
        if opts.offset.is_some() {
            return Err(fail(input, "a UTC offset only applies to calendar windows"));
        }
        let period = duration(input, period_n, unit)?;
        match algo {
            AlgorithmKind::Gcra => Policy::rate(amount, period)?,
            AlgorithmKind::FixedWindow => Policy::fixed_window(whole(input, amount)?, period)?,
            AlgorithmKind::SlidingLog => Policy::sliding_log(whole(input, amount)?, period)?,
            AlgorithmKind::SlidingWindow => Policy::sliding_window(whole(input, amount)?, period)?,
            AlgorithmKind::TokenBucket => {
                let n = whole(input, amount)?;
                if opts.intervally {
                    Policy::token_bucket_intervally(n, n, period)?
                } else {
                    Policy::token_bucket(n, n, period)?
                }
            }
            AlgorithmKind::LeakyBucket => Policy::funnel(whole(input, amount)?, period)?,
            AlgorithmKind::Shaper => Policy::shaper(whole(input, amount)?, period)?,
            AlgorithmKind::Concurrency => unreachable!("handled above"),
        }
    };
    match opts.burst {
        Some(b) => policy.with_burst(b),
        None => Ok(policy),
    }
}

/// The leading number, and the text after it.
fn split_amount<'a>(input: &str, s: &'a str) -> Result<(f64, &'a str), PolicyError> {
    let end = s
        .find(|c: char| !(c.is_ascii_digit() || c == '.' || c == '_'))
        .unwrap_or(s.len());
    let (num, rest) = s.split_at(end);
    let (num, rest) = if num.is_empty() {
        // `nan/s`, `inf/s`, `-1/s`: take the word so the error can name the value.
        let end = s.find(['/', ' ']).unwrap_or(s.len());
        s.split_at(end)
    } else {
        (num, rest)
    };
    let value: f64 = num
        .replace('_', "")
        .parse()
        .map_err(|_| fail(input, format!("{num:?} is not a number")))?;
    if !value.is_finite() || value <= 0.0 {
        return Err(PolicyError::NotPositive {
            field: "amount",
            value,
        });
    }
    Ok((value, rest.trim_start()))
}

/// `[number] unit` and the options after it; the number must be positive, or may be zero too
/// with `zero_ok` (a lone duration: a 0 s warm-up). `field` names it in errors.
fn split_period<'a>(
    input: &str,
    s: &'a str,
    field: &'static str,
    zero_ok: bool,
) -> Result<(f64, &'a str, &'a str), PolicyError> {
    let end = s
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(s.len());
    let (num, rest) = s.split_at(end);
    let n = if num.is_empty() {
        1.0
    } else {
        num.parse::<f64>()
            .map_err(|_| fail(input, format!("{num:?} is not a number")))?
    };
    if !n.is_finite() || n < 0.0 || (n == 0.0 && !zero_ok) {
        return Err(PolicyError::NotPositive { field, value: n });
    }
    let rest = rest.trim_start();
    let end = rest
        .find(|c: char| !(c.is_ascii_alphabetic() || c == '\u{b5}' || c == '\u{3bc}'))
        .unwrap_or(rest.len());
    let (unit, opts) = rest.split_at(end);
    if unit.is_empty() {
        return Err(fail(input, "missing time unit (s, minute, hour, day, ...)"));
    }
    Ok((n, unit, opts))
}

fn whole(input: &str, v: f64) -> Result<u64, PolicyError> {
    if v.fract() != 0.0 || v > u64::MAX as f64 {
        return Err(fail(input, format!("{v} is not a whole number")));
    }
    Ok(v as u64)
}

fn duration(input: &str, n: f64, unit: &str) -> Result<Duration, PolicyError> {
    // One plural `s` at most: `mss` and `sss` are no units.
    let secs = match unit.strip_suffix('s').unwrap_or(unit) {
        "m" if unit == "ms" => 0.001,
        "u" | "\u{b5}" | "\u{3bc}" | "micro" | "microsecond" => 0.000_001,
        "millisecond" | "milli" => 0.001,
        "" | "sec" | "second" => 1.0,
        "m" | "min" | "minute" => 60.0,
        "h" | "hr" | "hour" => 3_600.0,
        "d" | "day" => 86_400.0,
        "w" | "week" => 604_800.0,
        "mo" | "month" => {
            return Err(fail(
                input,
                "months vary in length: use a calendar window (calendar:10/month)",
            ));
        }
        _ => return Err(fail(input, format!("unknown time unit {unit:?}"))),
    };
    let total = n * secs;
    Duration::try_from_secs_f64(total).map_err(|_| PolicyError::TooLarge {
        field: "period",
        value: format!("{total}s"),
        max: format!("{}s", u64::MAX),
    })
}

#[derive(Default)]
struct Options {
    burst: Option<u64>,
    ttl: Option<Duration>,
    offset: Option<i32>,
    intervally: bool,
}

impl Options {
    fn parse(input: &str, s: &str) -> Result<Options, PolicyError> {
        let mut opts = Options::default();
        let mut words = s.split_whitespace().peekable();
        while let Some(word) = words.next() {
            let twice = || fail(input, format!("{word:?} is given twice"));
            if let Some(off) = word.strip_prefix('@') {
                if opts.offset.is_some() {
                    return Err(fail(input, "the UTC offset is given twice"));
                }
                opts.offset = Some(utc_offset(input, off)?);
                continue;
            }
            match word {
                "burst" if opts.burst.is_some() => return Err(twice()),
                "ttl" if opts.ttl.is_some() => return Err(twice()),
                "intervally" if opts.intervally => return Err(twice()),
                "burst" => {
                    let v = words
                        .next()
                        .ok_or_else(|| fail(input, "burst needs a number"))?;
                    let v: u64 = v
                        .parse()
                        .map_err(|_| fail(input, format!("burst {v:?} is not a whole number")))?;
                    opts.burst = Some(v);
                }
                "ttl" => {
                    let v = words
                        .next()
                        .ok_or_else(|| fail(input, "ttl needs a duration"))?;
                    let (n, unit, rest) = split_period(input, v, "ttl", false)?;
                    if !rest.is_empty() {
                        return Err(fail(input, format!("bad ttl {v:?}")));
                    }
                    opts.ttl = Some(duration(input, n, unit)?);
                }
                "intervally" => opts.intervally = true,
                other => return Err(fail(input, format!("unexpected {other:?}"))),
            }
        }
        Ok(opts)
    }

    /// Refuses the options `algo` has no use for: silently ignored, they would make the
    /// policy mean less than it says.
    fn check_for(&self, input: &str, algo: AlgorithmKind) -> Result<(), PolicyError> {
        let concurrency = algo == AlgorithmKind::Concurrency;
        let unused = if self.ttl.is_some() && !concurrency {
            Some("ttl (concurrency limits only)")
        } else if self.intervally && algo != AlgorithmKind::TokenBucket {
            Some("intervally (token buckets only)")
        } else if self.burst.is_some() && concurrency {
            Some("burst")
        } else if self.offset.is_some() && concurrency {
            Some("a UTC offset")
        } else {
            None
        };
        match unused {
            Some(what) => Err(fail(input, format!("{what} does not apply to this policy"))),
            None => Ok(()),
        }
    }
}

/// Parses a duration such as `30m`, `1.5s`, `500ms`, `2 hours`, `1d`.
///
/// ```
/// use std::time::Duration;
/// assert_eq!(floodgate_core::parse::parse_duration("30m").unwrap(), Duration::from_secs(1800));
/// assert!(floodgate_core::parse::parse_duration("soon").is_err());
/// ```
pub fn parse_duration(s: &str) -> Result<Duration, PolicyError> {
    let text = s.trim().to_ascii_lowercase();
    let parsed = split_period(s, &text, "duration", true).and_then(|(n, unit, rest)| {
        if rest.trim().is_empty() {
            duration(s, n, unit)
        } else {
            Err(fail(
                s,
                format!("unexpected {:?} after the duration", rest.trim()),
            ))
        }
    });
    parsed.map_err(|e| as_field("duration", s, e))
}

/// Parses a UTC offset such as `+08:00`, `-0530`, `+8` or `UTC` into seconds east of UTC.
pub fn parse_utc_offset(s: &str) -> Result<i32, PolicyError> {
    utc_offset(s, &s.trim().to_ascii_lowercase()).map_err(|e| as_field("utc_offset", s, e))
}

/// A parse error of a lone value, named after the value rather than a policy.
fn as_field(field: &'static str, input: &str, e: PolicyError) -> PolicyError {
    match e {
        PolicyError::Parse { reason, .. } => PolicyError::Invalid {
            field,
            reason: format!("{:?}: {reason}", input.trim()),
        },
        other => other,
    }
}

/// Formats a duration the way policy names spell it: the largest unit that divides it
/// (`30m`, `1d`, `1500ms`).
pub fn format_duration(d: Duration) -> String {
    crate::policy::short_duration(u64::try_from(d.as_micros()).unwrap_or(u64::MAX))
}

/// `+08:00`, `-0530`, `+8`, `utc`, `z` into seconds east of UTC.
fn utc_offset(input: &str, s: &str) -> Result<i32, PolicyError> {
    let bad = || fail(input, format!("bad UTC offset {s:?} (write +08:00)"));
    let s = s.trim();
    if s == "utc" || s == "z" {
        return Ok(0);
    }
    let (sign, digits) = if let Some(d) = s.strip_prefix('+') {
        (1, d)
    } else if let Some(d) = s.strip_prefix('-') {
        (-1, d)
    } else {
        return Err(bad());
    };
    // ASCII digits only (no second sign, no other script's digits): hours in one or two,
    // minutes in exactly two.
    if !digits.bytes().all(|b| b.is_ascii_digit() || b == b':') {
        return Err(bad());
    }
    let (h, m) = match digits.split_once(':') {
        Some((h, m)) => (h, m),
        None if digits.len() == 4 => digits.split_at(2),
        None => (digits, "00"),
    };
    if !(1..=2).contains(&h.len()) || m.len() != 2 || m.contains(':') {
        return Err(bad());
    }
    let h: i32 = h.parse().map_err(|_| bad())?;
    let m: i32 = m.parse().map_err(|_| bad())?;
    if h > 14 || m >= 60 {
        return Err(bad());
    }
    Ok(sign * (h * 3600 + m * 60))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Kind;

    fn p(s: &str) -> Policy {
        s.parse().unwrap_or_else(|e| panic!("{s}: {e}"))
    }

    #[test]
    fn sentences() {
        assert_eq!(p("10/minute"), Policy::per_minute(10).expect("valid"));
        assert_eq!(p("10 per minute"), Policy::per_minute(10).expect("valid"));
        assert_eq!(
            p("1 per 30 minutes"),
            Policy::per(1, Duration::from_secs(1800)).expect("valid")
        );
        assert_eq!(
            p("5/2s"),
            Policy::per(5, Duration::from_secs(2)).expect("valid")
        );
        assert_eq!(p("100/HOUR"), Policy::per_hour(100).expect("valid"));
        assert_eq!(p("1_000/s").limit(), 1000);
        assert_eq!(
            p("2.5/s"),
            Policy::rate(2.5, Duration::from_secs(1)).expect("valid")
        );
        assert_eq!(
            p("funnel:1/30m"),
            Policy::funnel(1, Duration::from_secs(1800)).expect("valid")
        );
        assert_eq!(
            p("gcra:10/s burst 20"),
            Policy::per_second(10)
                .and_then(|p| p.with_burst(20))
                .expect("valid")
        );
        assert_eq!(
            p("calendar:10/day@+08:00"),
            Policy::calendar_window(10, 1, CalendarUnit::Day)
                .and_then(|p| p.with_utc_offset(8 * 3600))
                .expect("valid")
        );
        assert_eq!(
            p("calendar:10/day @-0530").name(),
            "calendar-10-per-1day-utc-0530"
        );
        assert_eq!(p("calendar:3/15min").name(), "calendar-3-per-15minute");
        assert!(matches!(p("log:100/h").kind(), Kind::SlidingLog(_)));
        assert!(matches!(p("sliding:100/h").kind(), Kind::SlidingWindow(_)));
        assert!(
            matches!(p("token:10/s intervally").kind(), Kind::TokenBucket(t) if !t.is_greedy())
        );
        assert!(matches!(p("shaper:10/s").kind(), Kind::Shaper(_)));
        assert!(matches!(p("fixed:10/500ms").kind(), Kind::FixedWindow(_)));
        assert!(
            matches!(p("concurrency:10 ttl 30s").kind(), Kind::Concurrency(c) if c.lease_ttl_us() == 30_000_000)
        );
    }

    #[test]
    fn a_rate_s_period_rounds_up_to_whole_microseconds() {
        let emission = |p: Policy| match p.kind() {
            Kind::Gcra(g) => g.emission_us(),
            other => panic!("not GCRA: {other:?}"),
        };
        // 1.999 us per request is 2 us, not 1 (twice the rate asked for).
        let p = Policy::rate(1.0, Duration::from_nanos(1_999)).expect("valid");
        assert_eq!(emission(p), 2);
        let p = Policy::rate(3.0, Duration::from_millis(700)).expect("valid");
        assert_eq!(emission(p), 233_334);
        let p = Policy::rate(0.5, Duration::from_secs(1)).expect("valid");
        assert_eq!(emission(p), 2_000_000);
        // Under a microsecond per request: refused, but not as a period of zero.
        assert!(matches!(
            Policy::rate(1.0, Duration::from_nanos(500)),
            Err(e) if !matches!(e, PolicyError::Zero { .. })
        ));
        assert!(matches!(
            Policy::rate(1.0, Duration::ZERO),
            Err(PolicyError::Zero { field: "period" })
        ));
    }

    #[test]
    fn durations_and_offsets() {
        assert_eq!(parse_duration("500ms"), Ok(Duration::from_millis(500)));
        assert_eq!(parse_duration("50us"), Ok(Duration::from_micros(50)));
        assert_eq!(parse_duration("1.5s"), Ok(Duration::from_millis(1500)));
        assert_eq!(parse_duration("2 hours"), Ok(Duration::from_secs(7200)));
        assert_eq!(parse_duration("1d"), Ok(Duration::from_secs(86_400)));
        assert!(parse_duration("5").is_err());
        assert!(parse_duration("5s later").is_err());
        assert!(parse_duration("-5s").is_err());
        assert_eq!(parse_utc_offset("+08:00"), Ok(28_800));
        assert_eq!(parse_utc_offset("-0530"), Ok(-19_800));
        assert_eq!(parse_utc_offset("UTC"), Ok(0));
        assert!(parse_utc_offset("8").is_err());
        let err = parse_duration("5").expect_err("no unit").to_string();
        assert!(
            err.starts_with("invalid duration") && !err.contains("policy"),
            "{err}"
        );
        assert_eq!(format_duration(Duration::from_secs(1800)), "30m");
        assert_eq!(format_duration(Duration::from_millis(1500)), "1500ms");
    }

    #[test]
    fn hostile_and_ambiguous_strings_are_refused() {
        // Offsets: other scripts' characters (no panic), a second sign, overflowing hours.
        for bad in [
            "+0\u{20ac}",
            "+0\u{e9}0",
            "+-8",
            "+-268435448",
            "+08:0",
            "+123",
            "++8",
            "+8:00:00",
        ] {
            assert!(parse_utc_offset(bad).is_err(), "{bad:?}");
        }
        assert_eq!(parse_utc_offset("+8"), Ok(28_800));
        assert_eq!(parse_utc_offset("-05:30"), Ok(-19_800));
        let refused = |s: &str| {
            s.parse::<Policy>()
                .expect_err(&format!("{s:?} should be refused"))
                .to_string()
        };
        assert!(refused("calendar:10/day@+0\u{20ac}").contains("UTC offset"));
        assert!(refused("calendar:10/day@+-8").contains("UTC offset"));
        // Options the policy has no use for, or given twice.
        for s in [
            "concurrency:10 burst 5",
            "concurrency:10 @+08:00",
            "concurrency:10 intervally",
            "10/s ttl 30s",
            "fixed:10/s intervally",
            "calendar:10/day intervally",
        ] {
            assert!(refused(s).contains("does not apply"), "{s}: {}", refused(s));
        }
        for s in [
            "token:10/s burst 5 burst 50",
            "token:10/s intervally intervally",
            "concurrency:10 ttl 1s ttl 2s",
            "calendar:10/day@+01:00 @+02:00",
        ] {
            assert!(refused(s).contains("twice"), "{s}: {}", refused(s));
        }
        // Units: one plural `s`, and milliseconds are no calendar unit.
        for s in [
            "10/mss",
            "10/sss",
            "10/hourss",
            "calendar:100/ms",
            "calendar:10/30ms",
            "calendar:1/us",
        ] {
            let _ = refused(s);
        }
        assert_eq!(p("1/5\u{b5}s"), p("1/5us"));
        assert_eq!(p("1/5\u{3bc}s"), p("1/5us"));
        assert_eq!(p("10/2secs"), p("10/2s"));
        // A zero ttl names the ttl.
        assert!(
            refused("concurrency:10 ttl 0s").contains("ttl must be"),
            "{}",
            refused("concurrency:10 ttl 0s")
        );
        // A lone duration may be zero (a 0 s warm-up); a policy's period may not.
        assert_eq!(parse_duration("0s"), Ok(Duration::ZERO));
        assert!(refused("10/0s").contains("period"));
    }

    #[test]
    fn a_token_bucket_s_window_does_not_overflow() {
        // 10,000,000 tokens refilled over 4 weeks: capacity x interval passes u64.
        let policy = p("token:10000000/4w");
        assert_eq!(
            policy.kind().window(),
            Some(Duration::from_secs(4 * 7 * 86_400))
        );
    }

    /// A calendar window's length is its unit's, whatever its offset and whichever weekday
    /// 1970 began on (the first window of each, cut at the epoch, was measured).
    #[test]
    fn a_calendar_window_is_as_long_as_its_unit() {
        for (text, secs) in [
            ("calendar:10/week", 7 * 86_400),
            ("calendar:10/day@+08:00", 86_400),
            ("calendar:10/day@-05:00", 86_400),
            ("calendar:1/hour@+05:30", 3_600),
            ("calendar:3/minute", 60),
            ("calendar:5/month", 30 * 86_400),
        ] {
            assert_eq!(
                p(text).kind().window(),
                Some(Duration::from_secs(secs)),
                "{text}"
            );
        }
    }

    #[test]
    fn several() {
        let ps = Policy::parse_many("5/2s; 100/hour").expect("valid");
        assert_eq!(ps.len(), 2);
        assert_eq!(ps[1], Policy::per_hour(100).expect("valid"));
        assert!(Policy::parse_many(" ; ").is_err());
    }

    #[test]
    fn errors_name_the_problem() {
        let err = |s: &str| s.parse::<Policy>().expect_err(s).to_string();
        assert!(err("0/s").contains("amount"), "{}", err("0/s"));
        assert!(err("nan/s").contains("NaN"), "{}", err("nan/s"));
        assert!(err("-1/s").contains("amount"));
        assert!(err("10/fortnight").contains("unknown time unit"));
        assert!(err("10/month").contains("calendar"));
        assert!(err("calendar:10/7minutes").contains("do not divide"));
        assert!(err("calendar:10/2days").contains("one at a time"));
        assert!(err("fixed:2.5/s").contains("whole number"));
        assert!(err("bogus:1/s").contains("algorithm"));
        assert!(err("10 minute").contains("'/' or 'per'"));
        assert!(err("10/").contains("missing time unit"));
        assert!(err("fixed:10/s burst 2").contains("burst does not apply"));
        assert!(err("10/s@+08:00").contains("calendar"));
        assert!(err("calendar:1/day@+15:00").contains("UTC offset"));
        assert!(err("calendar:1/day@+14:30").contains("utc_offset"));
        assert!(err("1/99999999999999999999999s").contains("too large"));
        assert!(err("").contains("empty"));
    }
}
