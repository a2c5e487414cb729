//! Calendar-aligned windows: natural seconds, minutes, hours, days, ISO weeks and months, at a
//! fixed UTC offset ("10 per calendar day in Beijing time" is `Day` at `+08:00`).

use std::fmt;
use std::str::FromStr;

use crate::error::PolicyError;

const SECOND_US: i64 = 1_000_000;
const MINUTE_US: i64 = 60 * SECOND_US;
const HOUR_US: i64 = 60 * MINUTE_US;
const DAY_US: i64 = 24 * HOUR_US;

/// The largest UTC offset accepted, in either direction (UTC+14:00 is the furthest in use).
pub const MAX_UTC_OFFSET_SECS: i32 = 14 * 3600;

/// A unit of the calendar.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum CalendarUnit {
    /// A natural second.
    Second,
    /// A natural minute (starting at second 0).
    Minute,
    /// A natural hour.
    Hour,
    /// A day, from local midnight.
    Day,
    /// An ISO week, from Monday 00:00 local time.
    Week,
    /// A calendar month, from the 1st at 00:00 local time.
    Month,
}

impl CalendarUnit {
    /// The unit's name: `second`, `minute`, ...
    pub fn as_str(self) -> &'static str {
        match self {
            CalendarUnit::Second => "second",
            CalendarUnit::Minute => "minute",
            CalendarUnit::Hour => "hour",
            CalendarUnit::Day => "day",
            CalendarUnit::Week => "week",
            CalendarUnit::Month => "month",
        }
    }

    /// A stable small number for the unit, used by the Redis scripts.
    pub fn code(self) -> u8 {
        match self {
            CalendarUnit::Second => 1,
            CalendarUnit::Minute => 2,
            CalendarUnit::Hour => 3,
            CalendarUnit::Day => 4,
            CalendarUnit::Week => 5,
            CalendarUnit::Month => 6,
        }
    }

    /// How many of this unit make the next larger one, which `n` must divide.
    fn parent(self) -> Option<(u32, &'static str)> {
        match self {
            CalendarUnit::Second => Some((60, "minute")),
            CalendarUnit::Minute => Some((60, "hour")),
            CalendarUnit::Hour => Some((24, "day")),
            CalendarUnit::Day | CalendarUnit::Week => None,
            CalendarUnit::Month => Some((12, "year")),
        }
    }
}

impl fmt::Display for CalendarUnit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for CalendarUnit {
    type Err = PolicyError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let lower = s.trim().to_ascii_lowercase();
        let unit = match lower.as_str() {
            // Milliseconds and microseconds, not minutes: no calendar unit.
            "ms" | "us" | "\u{b5}s" | "\u{3bc}s" => None,
            // One plural `s` at most (`sss` is no unit).
            l => match l.strip_suffix('s').unwrap_or(l) {
                "" | "sec" | "second" => Some(CalendarUnit::Second),
                "m" | "min" | "minute" => Some(CalendarUnit::Minute),
                "h" | "hr" | "hour" => Some(CalendarUnit::Hour),
                "d" | "day" => Some(CalendarUnit::Day),
                "w" | "week" => Some(CalendarUnit::Week),
                "mo" | "month" => Some(CalendarUnit::Month),
                _ => None,
            },
        };
        unit.ok_or_else(|| PolicyError::Invalid {
            field: "calendar unit",
            reason: format!("{s:?} is not one of second, minute, hour, day, week, month"),
        })
    }
}

/// `n` calendar units at a UTC offset: the windows a calendar-aligned fixed window counts in.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Calendar {
    unit: CalendarUnit,
    n: u32,
    offset_us: i64,
}

impl Calendar {
    /// Windows of `n` units, in UTC. `n` must divide the next larger unit (5 minutes divide an
    /// hour, 7 minutes do not); days and weeks come one at a time; months by 1, 2, 3, 4, 6 or 12.
    pub fn new(n: u32, unit: CalendarUnit) -> Result<Self, PolicyError> {
        if n == 0 {
            return Err(PolicyError::Zero {
                field: "calendar units",
            });
        }
        let ok = match unit.parent() {
            Some((per, _)) => per % n == 0,
            None => n == 1,
        };
        if !ok {
            let reason = match unit.parent() {
                Some((per, parent)) => format!(
                    "{n} {unit}s do not divide a {parent} ({per} {unit}s), so the windows \
                     would not line up with the calendar"
                ),
                None => format!("calendar {unit}s come one at a time, not {n}"),
            };
            return Err(PolicyError::Invalid {
                field: "calendar units",
                reason,
            });
        }
        Ok(Calendar {
            unit,
            n,
            offset_us: 0,
        })
    }

    /// The same windows at a UTC offset in seconds (east positive: Beijing is `8 * 3600`).
    pub fn with_utc_offset(mut self, offset_secs: i32) -> Result<Self, PolicyError> {
        if offset_secs.unsigned_abs() > MAX_UTC_OFFSET_SECS.unsigned_abs() || offset_secs % 60 != 0
        {
            return Err(PolicyError::Invalid {
                field: "utc_offset",
                reason: format!(
                    "{offset_secs}s is not a whole number of minutes within \u{b1}14:00"
                ),
            });
        }
        self.offset_us = i64::from(offset_secs) * SECOND_US;
        Ok(self)
    }

    /// The unit.
    pub fn unit(&self) -> CalendarUnit {
        self.unit
    }

    /// How many units a window spans.
    pub fn n(&self) -> u32 {
        self.n
    }

    /// The UTC offset in seconds.
    pub fn utc_offset_secs(&self) -> i32 {
        (self.offset_us / SECOND_US) as i32
    }

    /// The window's nominal length in microseconds: `n` of its unit, a month taken as 30 days
    /// (the length of every window but months', whatever the offset).
    pub fn nominal_us(&self) -> u64 {
        let unit = match self.unit {
            CalendarUnit::Second => SECOND_US,
            CalendarUnit::Minute => MINUTE_US,
            CalendarUnit::Hour => HOUR_US,
            CalendarUnit::Day => DAY_US,
            CalendarUnit::Week => 7 * DAY_US,
            CalendarUnit::Month => 30 * DAY_US,
        };
        unit.unsigned_abs() * u64::from(self.n)
    }

    /// The window containing `now`: `(start, end)` in microseconds since the epoch.
    pub fn bounds(&self, now: u64) -> (u64, u64) {
        let local = now as i64 + self.offset_us;
        let (start, end) = match self.unit {
            CalendarUnit::Second => fixed(local, SECOND_US * i64::from(self.n)),
            CalendarUnit::Minute => fixed(local, MINUTE_US * i64::from(self.n)),
            CalendarUnit::Hour => fixed(local, HOUR_US * i64::from(self.n)),
            CalendarUnit::Day => fixed(local, DAY_US),
            CalendarUnit::Week => {
                let days = local.div_euclid(DAY_US);
                // 1970-01-01 was a Thursday: Monday-based weekday is (days + 3) mod 7.
                let monday = days - (days + 3).rem_euclid(7);
                (monday * DAY_US, (monday + 7) * DAY_US)
            }
            CalendarUnit::Month => {
                let (y, m) = year_month(local.div_euclid(DAY_US));
                let first = (m - 1) / i64::from(self.n) * i64::from(self.n);
                let start = month_start(y * 12 + first);
                let end = month_start(y * 12 + first + i64::from(self.n));
                (start * DAY_US, end * DAY_US)
            }
        };
        let to_utc = |t: i64| (t - self.offset_us).max(0) as u64;
        (to_utc(start), to_utc(end))
    }
}

fn fixed(local: i64, size: i64) -> (i64, i64) {
    let start = local.div_euclid(size) * size;
    (start, start + size)
}

/// Year and month (1-12) of a day number (days since 1970-01-01), proleptic Gregorian.
fn year_month(days: i64) -> (i64, i64) {
    // Howard Hinnant's civil_from_days, with years starting in March.
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1_460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    (y, m)
}

/// Day number of the first day of month `months` (counted as `year * 12 + month0`).
fn month_start(months: i64) -> i64 {
    let (y, m) = (months.div_euclid(12), months.rem_euclid(12) + 1);
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y.rem_euclid(400);
    let mp = (m + 9) % 12;
    let doy = (153 * mp + 2) / 5;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

#[cfg(test)]
mod tests {
    use super::*;

    /// 2024-02-29T13:45:30Z
    const LEAP: u64 = 1_709_214_330_000_000;

    fn secs(b: (u64, u64)) -> (u64, u64) {
        (b.0 / 1_000_000, b.1 / 1_000_000)
    }

    #[test]
    fn natural_units() {
        let c = |n, u| Calendar::new(n, u).expect("valid");
        assert_eq!(
            secs(c(1, CalendarUnit::Minute).bounds(LEAP)),
            (1_709_214_300, 1_709_214_360)
        );
        assert_eq!(
            secs(c(15, CalendarUnit::Minute).bounds(LEAP)),
            (1_709_214_300, 1_709_215_200)
        );
        assert_eq!(
            secs(c(1, CalendarUnit::Day).bounds(LEAP)),
            (1_709_164_800, 1_709_251_200)
        );
        // Monday 2024-02-26 to Monday 2024-03-04.
        assert_eq!(
            secs(c(1, CalendarUnit::Week).bounds(LEAP)),
            (1_708_905_600, 1_709_510_400)
        );
        // February 2024 (29 days), and the first quarter.
        assert_eq!(
            secs(c(1, CalendarUnit::Month).bounds(LEAP)),
            (1_706_745_600, 1_709_251_200)
        );
        assert_eq!(
            secs(c(3, CalendarUnit::Month).bounds(LEAP)),
            (1_704_067_200, 1_711_929_600)
        );
        // December rolls into the next year.
        let dec = 1_733_961_600_000_000; // 2024-12-12
        assert_eq!(
            secs(c(1, CalendarUnit::Month).bounds(dec)),
            (1_733_011_200, 1_735_689_600)
        );
    }

    #[test]
    fn utc_offset_moves_midnight() {
        let day = Calendar::new(1, CalendarUnit::Day)
            .and_then(|c| c.with_utc_offset(8 * 3600))
            .expect("valid");
        // 13:45Z is 21:45 in UTC+8; that day began at 16:00Z the day before.
        assert_eq!(secs(day.bounds(LEAP)), (1_709_136_000, 1_709_222_400));
        let west = Calendar::new(1, CalendarUnit::Day)
            .and_then(|c| c.with_utc_offset(-5 * 3600))
            .expect("valid");
        assert_eq!(secs(west.bounds(LEAP)), (1_709_182_800, 1_709_269_200));
    }

    #[test]
    fn offsets_past_fourteen_hours_are_refused_to_the_extremes() {
        let day = Calendar::new(1, CalendarUnit::Day).expect("valid");
        for bad in [i32::MIN, i32::MAX, 14 * 3600 + 60, -14 * 3600 - 60, 30] {
            assert!(day.with_utc_offset(bad).is_err(), "{bad}");
        }
        assert!(day.with_utc_offset(-14 * 3600).is_ok());
        // `ms` is no calendar unit (it was read as minutes), nor is `sss`.
        for bad in ["ms", "us", "sss", "mss"] {
            assert!(bad.parse::<CalendarUnit>().is_err(), "{bad}");
        }
        assert_eq!("mins".parse::<CalendarUnit>(), Ok(CalendarUnit::Minute));
        assert_eq!("s".parse::<CalendarUnit>(), Ok(CalendarUnit::Second));
    }

    #[test]
    fn rejects_units_that_do_not_line_up() {
        assert!(Calendar::new(7, CalendarUnit::Minute).is_err());
        assert!(Calendar::new(5, CalendarUnit::Hour).is_err());
        assert!(Calendar::new(2, CalendarUnit::Day).is_err());
        assert!(Calendar::new(5, CalendarUnit::Month).is_err());
        assert!(Calendar::new(0, CalendarUnit::Second).is_err());
        assert!(Calendar::new(6, CalendarUnit::Hour).is_ok());
        let c = Calendar::new(1, CalendarUnit::Day).expect("valid");
        assert!(c.with_utc_offset(15 * 3600).is_err());
        assert!(c.with_utc_offset(30).is_err());
        assert!(c.with_utc_offset(-(9 * 3600 + 30 * 60)).is_ok());
    }
}
