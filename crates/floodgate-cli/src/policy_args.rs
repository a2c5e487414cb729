//! The policy flags every subcommand that runs a policy shares: `--algorithm NAME` with that
//! algorithm's flags, or `--policy "10/minute"` (repeatable, all-or-nothing).

use std::time::Duration;

use clap::Args;
use floodgate_core::{AlgorithmKind, CalendarUnit, Policy};

use crate::args;
use crate::error::CliError;

/// The algorithms and their flags, for the subcommands' `--help` (a macro so that it can be
/// `concat!`ed into each subcommand's after-help text).
macro_rules! algorithms_help {
    () => {
        "\
Algorithms and their flags (DUR is a duration: 500ms, 1s, 1.5s, 30m, 2h, 1d):
  fixed_window    --limit N --window DUR
                    a window opens at the first request and counts up to N
                  --limit N --calendar UNIT [--units N] [--utc-offset +08:00]
                    windows aligned to the calendar: UNIT is second, minute, hour, day,
                    week or month; --units 5 --calendar minute is every 5 minutes
  sliding_log     --limit N --window DUR        at most N in any window (exact)
  sliding_window  --limit N --window DUR        about N in any window (two counters)
  token_bucket    --capacity N --refill N --interval DUR [--intervally]
                    N tokens per DUR, one at a time (or all at once with --intervally)
  leaky_bucket    --capacity N --drain DUR      (alias funnel) the bucket drains in DUR
  gcra            --max-burst N --count N --period DUR
                    redis-cell's CL.THROTTLE: max-burst + 1 at once, then count per period
  shaper          --count N --period DUR [--burst N] [--max-wait DUR]
                    requests wait up to --max-wait for their turn (adds \"wait_ms\")
  concurrency     --limit N --lease-ttl DUR     at most N in flight (adds \"lease\")
  --name NAME     the policy's name (one per policy), as the service named it: its state's
                  Redis key carries the name, so reset, check and inspect need it to reach
                  the state of a named policy
  --policy STR    any policy string: \"10/minute\", \"funnel:1/30m\", \"calendar:10/day@+08:00\",
                  \"log:100/h\", \"token:10/s intervally\", \"shaper:5/s burst 2\",
                  \"concurrency:2 ttl 30s\"; repeat --policy to check all-or-nothing (adds
                  \"policies\", one decision per policy; nothing is counted unless all allow)
"
    };
}
pub(crate) use algorithms_help;

/// The policy flags (flattened into each subcommand's flags).
#[derive(Debug, Clone, Default, Args)]
pub(crate) struct PolicyArgs {
    /// The algorithm: fixed_window, sliding_log, sliding_window, token_bucket, leaky_bucket
    /// (alias funnel), gcra, shaper or concurrency.
    #[arg(long, short = 'a', value_name = "NAME", value_parser = args::algorithm)]
    pub(crate) algorithm: Option<AlgorithmKind>,

    /// A policy string such as "10/minute" instead of --algorithm and its flags; repeat (or
    /// separate with ';') to check several policies all-or-nothing.
    #[arg(long, short = 'p', value_name = "POLICY", conflicts_with = "algorithm")]
    pub(crate) policy: Vec<String>,

    /// The policy's name, which its state's Redis key carries: the name the service gave it
    /// (`Policy::named`), to reach that state. One per policy, in order.
    #[arg(long, value_name = "NAME")]
    pub(crate) name: Vec<String>,

    /// gcra: requests admitted at once beyond the first (redis-cell's max_burst).
    #[arg(long, value_name = "N", help_heading = "Policy flags")]
    pub(crate) max_burst: Option<u64>,

    /// gcra, shaper: requests per --period.
    #[arg(long, value_name = "N", help_heading = "Policy flags")]
    pub(crate) count: Option<u64>,

    /// gcra, shaper: the period --count requests are spread over.
    #[arg(long, value_name = "DUR", value_parser = args::duration, help_heading = "Policy flags")]
    pub(crate) period: Option<Duration>,

    /// fixed_window, sliding_log, sliding_window, concurrency: units per window (in flight).
    #[arg(long, value_name = "N", help_heading = "Policy flags")]
    pub(crate) limit: Option<u64>,

    /// fixed_window, sliding_log, sliding_window: the window.
    #[arg(long, value_name = "DUR", value_parser = args::duration, help_heading = "Policy flags")]
    pub(crate) window: Option<Duration>,

    /// fixed_window: align windows to the calendar (second, minute, hour, day, week, month).
    #[arg(long, value_name = "UNIT", value_parser = args::calendar_unit, help_heading = "Policy flags")]
    pub(crate) calendar: Option<CalendarUnit>,

    /// fixed_window with --calendar: calendar units per window [default: 1].
    #[arg(long, value_name = "N", help_heading = "Policy flags")]
    pub(crate) units: Option<u32>,

    /// fixed_window with --calendar: the time zone's UTC offset, such as +08:00 [default: UTC].
    #[arg(
        long,
        value_name = "OFFSET",
        value_parser = args::utc_offset,
        allow_hyphen_values = true,
        help_heading = "Policy flags"
    )]
    pub(crate) utc_offset: Option<i32>,

    /// token_bucket, leaky_bucket: the bucket's capacity.
    #[arg(long, value_name = "N", help_heading = "Policy flags")]
    pub(crate) capacity: Option<u64>,

    /// token_bucket: tokens added per --interval.
    #[arg(long, value_name = "N", help_heading = "Policy flags")]
    pub(crate) refill: Option<u64>,

    /// token_bucket: the refill interval.
    #[arg(long, value_name = "DUR", value_parser = args::duration, help_heading = "Policy flags")]
    pub(crate) interval: Option<Duration>,

    /// token_bucket: add the --refill tokens all at once at the end of each interval.
    #[arg(long, help_heading = "Policy flags")]
    pub(crate) intervally: bool,

    /// leaky_bucket: the time a full bucket takes to drain.
    #[arg(long, value_name = "DUR", value_parser = args::duration, help_heading = "Policy flags")]
    pub(crate) drain: Option<Duration>,

    /// shaper: requests that may leave at once [default: 1].
    #[arg(long, value_name = "N", help_heading = "Policy flags")]
    pub(crate) burst: Option<u64>,

    /// shaper (also with --policy): how long a request may wait for its turn [default: 0].
    #[arg(long, value_name = "DUR", value_parser = args::duration, help_heading = "Policy flags")]
    pub(crate) max_wait: Option<Duration>,

    /// concurrency: how long a lease lasts unless released.
    #[arg(long, value_name = "DUR", value_parser = args::duration, help_heading = "Policy flags")]
    pub(crate) lease_ttl: Option<Duration>,
}

/// The policies to check together, all-or-nothing, and the shapers' patience.
#[derive(Debug, Clone)]
pub(crate) struct PolicySet {
    pub(crate) policies: Vec<Policy>,
    pub(crate) max_wait: Duration,
}

impl PolicySet {
    /// Whether some policy is a shaper (decisions have `wait_ms`).
    pub(crate) fn shaping(&self) -> bool {
        self.policies
            .iter()
            .any(|p| p.algorithm() == AlgorithmKind::Shaper)
    }

    /// The first concurrency policy, if any (decisions have `lease`).
    pub(crate) fn concurrency(&self) -> Option<usize> {
        self.policies
            .iter()
            .position(|p| p.algorithm() == AlgorithmKind::Concurrency)
    }
}

/// What to do about a policy flag that is not given.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Missing {
    /// Refuse: the flag is required.
    Refuse,
    /// Use a benchmark default: every algorithm about 10 per second.
    Default,
}

impl PolicyArgs {
    /// Whether any policy flag was given (`--algorithm`, `--policy` or a parameter).
    pub(crate) fn any_given(&self) -> bool {
        self.algorithm.is_some() || !self.policy.is_empty() || !self.given_flags().is_empty()
    }

    /// Builds the policies, refusing missing, conflicting and stray flags.
    pub(crate) fn build(&self) -> Result<PolicySet, CliError> {
        self.build_with(Missing::Refuse)
    }

    /// Builds the policies like [`PolicyArgs::build`], but a missing algorithm parameter (or a
    /// missing `--algorithm`: gcra) takes a default of about 10 per second (`floodgate bench
    /// --help` lists them).
    pub(crate) fn build_or_default(&self) -> Result<PolicySet, CliError> {
        self.build_with(Missing::Default)
    }

    /// The policy flags given on the command line, by name.
    fn given_flags(&self) -> Vec<&'static str> {
        let flags = [
            ("--max-burst", self.max_burst.is_some()),
            ("--count", self.count.is_some()),
            ("--period", self.period.is_some()),
            ("--limit", self.limit.is_some()),
            ("--window", self.window.is_some()),
            ("--calendar", self.calendar.is_some()),
            ("--units", self.units.is_some()),
            ("--utc-offset", self.utc_offset.is_some()),
            ("--capacity", self.capacity.is_some()),
            ("--refill", self.refill.is_some()),
            ("--interval", self.interval.is_some()),
            ("--intervally", self.intervally),
            ("--drain", self.drain.is_some()),
            ("--burst", self.burst.is_some()),
            ("--max-wait", self.max_wait.is_some()),
            ("--lease-ttl", self.lease_ttl.is_some()),
        ];
        flags
            .into_iter()
            .filter_map(|(name, given)| given.then_some(name))
            .collect()
    }

    fn build_with(&self, missing: Missing) -> Result<PolicySet, CliError> {
        let mut set = self.build_unnamed(missing)?;
        if !self.name.is_empty() && self.name.len() != set.policies.len() {
            return Err(CliError::usage(format!(
                "{} --name given for {} {}: give one name per policy, in order",
                self.name.len(),
                set.policies.len(),
                if set.policies.len() == 1 {
                    "policy"
                } else {
                    "policies"
                }
            )));
        }
        for (policy, name) in set.policies.iter_mut().zip(&self.name) {
            *policy = policy.clone().named(name)?;
        }
        for (i, policy) in set.policies.iter().enumerate() {
            if set.policies[..i]
                .iter()
                .any(|p| p.ident() == policy.ident())
            {
                return Err(CliError::usage(format!(
                    "policy {policy} is given twice; give each policy once, or each its own \
                     --name"
                )));
            }
        }
        Ok(set)
    }

    fn build_unnamed(&self, missing: Missing) -> Result<PolicySet, CliError> {
        let given = self.given_flags();
        let max_wait = self.max_wait.unwrap_or(Duration::ZERO);
        if !self.policy.is_empty() {
            if let Some(flag) = given.iter().find(|f| **f != "--max-wait") {
                return Err(CliError::usage(format!(
                    "{flag} cannot be used with --policy: the policy string sets the parameters \
                     (or use --algorithm instead of --policy)"
                )));
            }
            let mut policies: Vec<Policy> = Vec::with_capacity(self.policy.len());
            for text in &self.policy {
                policies.extend(Policy::parse_many(text)?);
            }
            let set = PolicySet { policies, max_wait };
            if self.max_wait.is_some() && !set.shaping() {
                return Err(CliError::usage(
                    "--max-wait only applies to shaper policies (such as --policy shaper:5/s)",
                ));
            }
            return Ok(set);
        }
        let kind = match (self.algorithm, missing) {
            (Some(kind), _) => kind,
            (None, Missing::Default) if given.is_empty() => AlgorithmKind::Gcra,
            (None, _) => {
                return Err(CliError::usage(
                    "choose the policy with --algorithm NAME and its flags, or with --policy \
                     \"10/minute\"",
                ));
            }
        };
        let takes = flags_of(kind);
        if let Some(flag) = given.iter().find(|f| !takes.contains(f)) {
            return Err(CliError::usage(format!(
                "{flag} does not apply to --algorithm {kind} (it takes {})",
                takes.join(", ")
            )));
        }
        let policy = self.policy_of(kind, missing)?;
        Ok(PolicySet {
            policies: vec![policy],
            max_wait,
        })
    }

    fn policy_of(&self, kind: AlgorithmKind, missing: Missing) -> Result<Policy, CliError> {
        // A flag's value, its benchmark default, or "required".
        let get = |value: Option<u64>, flag: &str, default: u64| -> Result<u64, CliError> {
            match (value, missing) {
                (Some(v), _) => Ok(v),
                (None, Missing::Default) => Ok(default),
                (None, Missing::Refuse) => Err(CliError::usage(format!(
                    "{flag} is required for --algorithm {kind}"
                ))),
            }
        };
        let dur = |value: Option<Duration>, flag: &str| -> Result<Duration, CliError> {
            match (value, missing) {
                (Some(v), _) => Ok(v),
                (None, Missing::Default) => Ok(BENCH_PERIOD),
                (None, Missing::Refuse) => Err(CliError::usage(format!(
                    "{flag} is required for --algorithm {kind}"
                ))),
            }
        };
        let n = BENCH_RATE;
        let policy = match kind {
            AlgorithmKind::Gcra => Policy::gcra(
                get(self.max_burst, "--max-burst", n - 1)?,
                get(self.count, "--count", n)?,
                dur(self.period, "--period")?,
            )?,
            AlgorithmKind::FixedWindow => self.fixed_window(kind, missing)?,
            AlgorithmKind::SlidingLog => Policy::sliding_log(
                get(self.limit, "--limit", n)?,
                dur(self.window, "--window")?,
            )?,
            AlgorithmKind::SlidingWindow => Policy::sliding_window(
                get(self.limit, "--limit", n)?,
                dur(self.window, "--window")?,
            )?,
            AlgorithmKind::TokenBucket => {
                let capacity = get(self.capacity, "--capacity", n)?;
                let refill = get(self.refill, "--refill", n)?;
                let interval = dur(self.interval, "--interval")?;
                if self.intervally {
                    Policy::token_bucket_intervally(capacity, refill, interval)?
                } else {
                    Policy::token_bucket(capacity, refill, interval)?
                }
            }
            AlgorithmKind::LeakyBucket => Policy::funnel(
                get(self.capacity, "--capacity", n)?,
                dur(self.drain, "--drain")?,
            )?,
            AlgorithmKind::Shaper => {
                let policy = Policy::shaper(
                    get(self.count, "--count", n)?,
                    dur(self.period, "--period")?,
                )?;
                match self.burst {
                    Some(burst) => policy.with_burst(burst)?,
                    None => policy,
                }
            }
            AlgorithmKind::Concurrency => Policy::concurrency(
                get(self.limit, "--limit", n)?,
                dur(self.lease_ttl, "--lease-ttl")?,
            )?,
            other => {
                return Err(CliError::usage(format!(
                    "--algorithm {other} is not supported by this floodgate"
                )));
            }
        };
        Ok(policy)
    }

    /// A rolling (`--window`) or calendar-aligned (`--calendar`) fixed window.
    fn fixed_window(&self, kind: AlgorithmKind, missing: Missing) -> Result<Policy, CliError> {
        let limit = match (self.limit, missing) {
            (Some(limit), _) => limit,
            (None, Missing::Default) => BENCH_RATE,
            (None, Missing::Refuse) => {
                return Err(CliError::usage(format!(
                    "--limit is required for --algorithm {kind}"
                )));
            }
        };
        match (self.window, self.calendar) {
            (Some(_), Some(_)) => Err(CliError::usage(
                "--window and --calendar cannot be used together: --window makes a window open \
                 at the first request, --calendar aligns windows to the calendar",
            )),
            (None, None) if missing == Missing::Refuse => Err(CliError::usage(format!(
                "--window (or --calendar) is required for --algorithm {kind}"
            ))),
            (window, None) => {
                if let Some(flag) = [
                    ("--units", self.units.is_some()),
                    ("--utc-offset", self.utc_offset.is_some()),
                ]
                .iter()
                .find_map(|(f, given)| given.then_some(f))
                {
                    return Err(CliError::usage(format!(
                        "{flag} only applies with --calendar, not with --window"
                    )));
                }
                Ok(Policy::fixed_window(limit, window.unwrap_or(BENCH_PERIOD))?)
            }
            (None, Some(unit)) => {
                let policy = Policy::calendar_window(limit, self.units.unwrap_or(1), unit)?;
                Ok(match self.utc_offset {
                    Some(offset) => policy.with_utc_offset(offset)?,
                    None => policy,
                })
            }
        }
    }
}

/// `floodgate bench`'s default rate: a missing count, limit or capacity.
const BENCH_RATE: u64 = 10;
/// `floodgate bench`'s default period, window, interval, drain time or lease ttl.
const BENCH_PERIOD: Duration = Duration::from_secs(1);

/// The flags each algorithm takes.
fn flags_of(kind: AlgorithmKind) -> &'static [&'static str] {
    match kind {
        AlgorithmKind::FixedWindow => &[
            "--limit",
            "--window",
            "--calendar",
            "--units",
            "--utc-offset",
        ],
        AlgorithmKind::SlidingLog | AlgorithmKind::SlidingWindow => &["--limit", "--window"],
        AlgorithmKind::TokenBucket => &["--capacity", "--refill", "--interval", "--intervally"],
        AlgorithmKind::LeakyBucket => &["--capacity", "--drain"],
        AlgorithmKind::Gcra => &["--max-burst", "--count", "--period"],
        AlgorithmKind::Shaper => &["--count", "--period", "--burst", "--max-wait"],
        AlgorithmKind::Concurrency => &["--limit", "--lease-ttl"],
        _ => &[],
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(f: impl FnOnce(&mut PolicyArgs)) -> PolicyArgs {
        let mut a = PolicyArgs::default();
        f(&mut a);
        a
    }

    #[test]
    fn strict_build_requires_every_flag() {
        let a = args(|a| a.algorithm = Some(AlgorithmKind::Gcra));
        let err = a.build().expect_err("missing flags").to_string();
        assert!(err.contains("--max-burst is required"), "{err}");
        let err = PolicyArgs::default().build().expect_err("nothing given");
        assert!(err.to_string().contains("--algorithm NAME"), "{err}");
    }

    #[test]
    fn bench_defaults_fill_in_missing_flags() {
        let set = PolicyArgs::default().build_or_default().expect("defaults");
        assert_eq!(set.policies.len(), 1);
        assert_eq!(set.policies[0].algorithm(), AlgorithmKind::Gcra);
        assert_eq!(set.policies[0].limit(), 10);
        for kind in [
            AlgorithmKind::FixedWindow,
            AlgorithmKind::SlidingLog,
            AlgorithmKind::SlidingWindow,
            AlgorithmKind::TokenBucket,
            AlgorithmKind::LeakyBucket,
            AlgorithmKind::Gcra,
            AlgorithmKind::Shaper,
            AlgorithmKind::Concurrency,
        ] {
            let set = args(|a| a.algorithm = Some(kind))
                .build_or_default()
                .unwrap_or_else(|e| panic!("{kind}: {e}"));
            assert_eq!(set.policies[0].algorithm(), kind);
        }
        // Given flags still win, and stray ones are still refused.
        let set = args(|a| {
            a.algorithm = Some(AlgorithmKind::SlidingLog);
            a.limit = Some(3);
        })
        .build_or_default()
        .expect("valid");
        assert_eq!(set.policies[0].limit(), 3);
        let err = args(|a| {
            a.algorithm = Some(AlgorithmKind::Gcra);
            a.window = Some(Duration::from_secs(1));
        })
        .build_or_default()
        .expect_err("stray flag");
        assert!(err.to_string().contains("--window does not apply"), "{err}");
    }

    #[test]
    fn policy_strings_are_checked_together() {
        let set = args(|a| a.policy = vec!["5/s".into(), "100/hour".into()])
            .build()
            .expect("valid");
        assert_eq!(set.policies.len(), 2);
        let err = args(|a| a.policy = vec!["5/s".into(), "5/s".into()])
            .build()
            .expect_err("twice");
        assert!(err.to_string().contains("given twice"), "{err}");
    }

    #[test]
    fn names_go_to_the_policies_in_order() {
        let set = args(|a| {
            a.policy = vec!["funnel:1/30m; 10/day".into()];
            a.name = vec!["phone".into(), "phone-daily".into()];
        })
        .build()
        .expect("valid");
        let names: Vec<&str> = set.policies.iter().map(|p| p.name()).collect();
        assert_eq!(names, ["phone", "phone-daily"]);
        // The same parameters twice, named apart: two policies.
        let set = args(|a| {
            a.policy = vec!["5/s".into(), "5/s".into()];
            a.name = vec!["per-ip".into(), "per-user".into()];
        })
        .build()
        .expect("valid");
        assert_eq!(set.policies.len(), 2);
        let named = args(|a| {
            a.algorithm = Some(AlgorithmKind::Gcra);
            a.name = vec!["bench".into()];
        })
        .build_or_default()
        .expect("valid");
        assert_eq!(named.policies[0].name(), "bench");

        let err = |f: fn(&mut PolicyArgs)| args(f).build().expect_err("refused").to_string();
        let miscount = err(|a| {
            a.policy = vec!["5/s; 10/m".into()];
            a.name = vec!["one".into()];
        });
        assert!(miscount.contains("one name per policy"), "{miscount}");
        let same = err(|a| {
            a.policy = vec!["5/s".into(), "10/m".into()];
            a.name = vec!["x".into(), "x".into()];
        });
        assert!(same.contains("given twice"), "{same}");
        let invalid = err(|a| {
            a.policy = vec!["5/s".into()];
            a.name = vec!["Not A Name".into()];
        });
        assert!(invalid.contains("name"), "{invalid}");
    }
}
