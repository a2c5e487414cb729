//! `floodgate simulate`: runs one policy (or several, all-or-nothing) over a trace of events
//! read from stdin, with the time taken from the trace, and prints every decision as JSON.

use std::collections::HashMap;
use std::io::{self, BufRead, BufReader, Read, Write};
use std::time::Duration;

use clap::Args;
use floodgate_core::{
    AlgorithmKind, CalendarUnit, Check, CheckOptions, Decision, LeaseId, ManualClock,
    MemoryLimiter, Policy, State, Timestamp,
};
use serde::Serialize;

use crate::args;
use crate::error::CliError;

const LONG_ABOUT: &str = "\
Run a rate-limiting policy over events read from stdin and print each decision as JSON.

The time comes from the events, not from the clock, so a run is exactly reproducible: the
same trace always gives the same decisions. The policy runs in memory, with the same
algorithms the Redis backend runs as scripts.

Choose the policy either with --algorithm and that algorithm's flags, or with --policy and a
policy string (repeat --policy to check several policies all-or-nothing).";

const AFTER_HELP: &str = "\
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
  --policy STR    any policy string: \"10/minute\", \"funnel:1/30m\", \"calendar:10/day@+08:00\",
                  \"log:100/h\", \"token:10/s intervally\", \"shaper:5/s burst 2\",
                  \"concurrency:2 ttl 30s\"; repeat --policy to check all-or-nothing (adds
                  \"policies\", one decision per policy; nothing is counted unless all allow)

Input (stdin), one event per line:
  <t_ms> <key> [cost]    t_ms: milliseconds since the start (never decreasing), key: any
                         word, cost: a whole number of units (default 1; 0 only peeks)
  <t_ms> <key> release   concurrency: release the key's oldest lease still held,
                         prints {\"released\":true} or {\"released\":false}
  Blank lines and # comments are skipped. t=0 is --start (Unix ms, default 0: the Unix
  epoch, a midnight, so calendar windows line up the same way on every run).

Output (stdout), one JSON object per event:
  {\"allowed\":true,\"limit\":5,\"remaining\":4,\"retry_after_ms\":null,\"reset_after_ms\":1000}
  retry_after_ms is null when allowed, or when the cost can never fit.

Example: 2 at once, then 1 per second (redis-cell: CL.THROTTLE key 1 1 1)
  $ printf '0 alice\\n0 alice\\n0 alice\\n500 alice\\n1000 alice\\n' |
      floodgate simulate --algorithm gcra --max-burst 1 --count 1 --period 1s
  {\"allowed\":true,\"limit\":2,\"remaining\":1,\"retry_after_ms\":null,\"reset_after_ms\":1000}
  {\"allowed\":true,\"limit\":2,\"remaining\":0,\"retry_after_ms\":null,\"reset_after_ms\":2000}
  {\"allowed\":false,\"limit\":2,\"remaining\":0,\"retry_after_ms\":1000,\"reset_after_ms\":2000}
  {\"allowed\":false,\"limit\":2,\"remaining\":0,\"retry_after_ms\":500,\"reset_after_ms\":1500}
  {\"allowed\":true,\"limit\":2,\"remaining\":0,\"retry_after_ms\":null,\"reset_after_ms\":2000}

More:
  echo '0 +8613800000000' | floodgate simulate --policy funnel:1/30m
  floodgate simulate --algorithm fixed_window --limit 10 --calendar day --utc-offset +08:00 < trace
  floodgate simulate --policy 5/s --policy 100/hour < trace

Exit status: 0 when every line was processed, 1 for a bad input line (the decisions before it
are printed), 2 for a bad command line or policy.";

/// Flags of `floodgate simulate`.
#[derive(Debug, Args)]
#[command(
    about = "Run a policy over events read from stdin and print each decision as JSON",
    long_about = LONG_ABOUT,
    after_help = AFTER_HELP
)]
pub(crate) struct SimulateArgs {
    /// The algorithm: fixed_window, sliding_log, sliding_window, token_bucket, leaky_bucket
    /// (alias funnel), gcra, shaper or concurrency.
    #[arg(long, short = 'a', value_name = "NAME", value_parser = args::algorithm)]
    algorithm: Option<AlgorithmKind>,

    /// A policy string such as "10/minute" instead of --algorithm and its flags; repeat (or
    /// separate with ';') to check several policies all-or-nothing.
    #[arg(long, short = 'p', value_name = "POLICY", conflicts_with = "algorithm")]
    policy: Vec<String>,

    /// gcra: requests admitted at once beyond the first (redis-cell's max_burst).
    #[arg(long, value_name = "N", help_heading = "Policy flags")]
    max_burst: Option<u64>,

    /// gcra, shaper: requests per --period.
    #[arg(long, value_name = "N", help_heading = "Policy flags")]
    count: Option<u64>,

    /// gcra, shaper: the period --count requests are spread over.
    #[arg(long, value_name = "DUR", value_parser = args::duration, help_heading = "Policy flags")]
    period: Option<Duration>,

    /// fixed_window, sliding_log, sliding_window, concurrency: units per window (in flight).
    #[arg(long, value_name = "N", help_heading = "Policy flags")]
    limit: Option<u64>,

    /// fixed_window, sliding_log, sliding_window: the window.
    #[arg(long, value_name = "DUR", value_parser = args::duration, help_heading = "Policy flags")]
    window: Option<Duration>,

    /// fixed_window: align windows to the calendar (second, minute, hour, day, week, month).
    #[arg(long, value_name = "UNIT", value_parser = args::calendar_unit, help_heading = "Policy flags")]
    calendar: Option<CalendarUnit>,

    /// fixed_window with --calendar: calendar units per window [default: 1].
    #[arg(long, value_name = "N", help_heading = "Policy flags")]
    units: Option<u32>,

    /// fixed_window with --calendar: the time zone's UTC offset, such as +08:00 [default: UTC].
    #[arg(
        long,
        value_name = "OFFSET",
        value_parser = args::utc_offset,
        allow_hyphen_values = true,
        help_heading = "Policy flags"
    )]
    utc_offset: Option<i32>,

    /// token_bucket, leaky_bucket: the bucket's capacity.
    #[arg(long, value_name = "N", help_heading = "Policy flags")]
    capacity: Option<u64>,

    /// token_bucket: tokens added per --interval.
    #[arg(long, value_name = "N", help_heading = "Policy flags")]
    refill: Option<u64>,

    /// token_bucket: the refill interval.
    #[arg(long, value_name = "DUR", value_parser = args::duration, help_heading = "Policy flags")]
    interval: Option<Duration>,

    /// token_bucket: add the --refill tokens all at once at the end of each interval.
    #[arg(long, help_heading = "Policy flags")]
    intervally: bool,

    /// leaky_bucket: the time a full bucket takes to drain.
    #[arg(long, value_name = "DUR", value_parser = args::duration, help_heading = "Policy flags")]
    drain: Option<Duration>,

    /// shaper: requests that may leave at once [default: 1].
    #[arg(long, value_name = "N", help_heading = "Policy flags")]
    burst: Option<u64>,

    /// shaper (also with --policy): how long a request may wait for its turn [default: 0].
    #[arg(long, value_name = "DUR", value_parser = args::duration, help_heading = "Policy flags")]
    max_wait: Option<Duration>,

    /// concurrency: how long a lease lasts unless released.
    #[arg(long, value_name = "DUR", value_parser = args::duration, help_heading = "Policy flags")]
    lease_ttl: Option<Duration>,

    /// The Unix time in milliseconds of t=0 in the input.
    #[arg(long, value_name = "UNIX_MS", default_value_t = 0)]
    start: u64,
}

/// The policy flags given on the command line, by name.
fn given_flags(a: &SimulateArgs) -> Vec<&'static str> {
    let flags = [
        ("--max-burst", a.max_burst.is_some()),
        ("--count", a.count.is_some()),
        ("--period", a.period.is_some()),
        ("--limit", a.limit.is_some()),
        ("--window", a.window.is_some()),
        ("--calendar", a.calendar.is_some()),
        ("--units", a.units.is_some()),
        ("--utc-offset", a.utc_offset.is_some()),
        ("--capacity", a.capacity.is_some()),
        ("--refill", a.refill.is_some()),
        ("--interval", a.interval.is_some()),
        ("--intervally", a.intervally),
        ("--drain", a.drain.is_some()),
        ("--burst", a.burst.is_some()),
        ("--max-wait", a.max_wait.is_some()),
        ("--lease-ttl", a.lease_ttl.is_some()),
    ];
    flags
        .into_iter()
        .filter_map(|(name, given)| given.then_some(name))
        .collect()
}

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

/// What to run: the policies, checked together, and the shaper's patience.
#[derive(Debug)]
struct Setup {
    policies: Vec<Policy>,
    max_wait: Duration,
}

/// Builds the policies from the flags, refusing missing, conflicting and stray flags.
fn setup(a: &SimulateArgs) -> Result<Setup, CliError> {
    let given = given_flags(a);
    let max_wait = a.max_wait.unwrap_or(Duration::ZERO);
    if !a.policy.is_empty() {
        if let Some(flag) = given.iter().find(|f| **f != "--max-wait") {
            return Err(CliError::usage(format!(
                "{flag} cannot be used with --policy: the policy string sets the parameters \
                 (or use --algorithm instead of --policy)"
            )));
        }
        let mut policies: Vec<Policy> = Vec::with_capacity(a.policy.len());
        for text in &a.policy {
            for policy in Policy::parse_many(text)? {
                if policies.iter().any(|p| p.ident() == policy.ident()) {
                    return Err(CliError::usage(format!(
                        "policy {policy} is given twice in --policy; give each policy once"
                    )));
                }
                policies.push(policy);
            }
        }
        let shaping = policies
            .iter()
            .any(|p| p.algorithm() == AlgorithmKind::Shaper);
        if a.max_wait.is_some() && !shaping {
            return Err(CliError::usage(
                "--max-wait only applies to shaper policies (such as --policy shaper:5/s)",
            ));
        }
        return Ok(Setup { policies, max_wait });
    }
    let Some(kind) = a.algorithm else {
        return Err(CliError::usage(
            "choose the policy with --algorithm NAME and its flags, or with --policy \"10/minute\"",
        ));
    };
    let takes = flags_of(kind);
    if let Some(flag) = given.iter().find(|f| !takes.contains(f)) {
        return Err(CliError::usage(format!(
            "{flag} does not apply to --algorithm {kind} (it takes {})",
            takes.join(", ")
        )));
    }
    let need = |flag: &str| CliError::usage(format!("{flag} is required for --algorithm {kind}"));
    let policy = match kind {
        AlgorithmKind::Gcra => Policy::gcra(
            a.max_burst.ok_or_else(|| need("--max-burst"))?,
            a.count.ok_or_else(|| need("--count"))?,
            a.period.ok_or_else(|| need("--period"))?,
        )?,
        AlgorithmKind::FixedWindow => fixed_window(a, kind)?,
        AlgorithmKind::SlidingLog => Policy::sliding_log(
            a.limit.ok_or_else(|| need("--limit"))?,
            a.window.ok_or_else(|| need("--window"))?,
        )?,
        AlgorithmKind::SlidingWindow => Policy::sliding_window(
            a.limit.ok_or_else(|| need("--limit"))?,
            a.window.ok_or_else(|| need("--window"))?,
        )?,
        AlgorithmKind::TokenBucket => {
            let capacity = a.capacity.ok_or_else(|| need("--capacity"))?;
            let refill = a.refill.ok_or_else(|| need("--refill"))?;
            let interval = a.interval.ok_or_else(|| need("--interval"))?;
            if a.intervally {
                Policy::token_bucket_intervally(capacity, refill, interval)?
            } else {
                Policy::token_bucket(capacity, refill, interval)?
            }
        }
        AlgorithmKind::LeakyBucket => Policy::funnel(
            a.capacity.ok_or_else(|| need("--capacity"))?,
            a.drain.ok_or_else(|| need("--drain"))?,
        )?,
        AlgorithmKind::Shaper => {
            let policy = Policy::shaper(
                a.count.ok_or_else(|| need("--count"))?,
                a.period.ok_or_else(|| need("--period"))?,
            )?;
            match a.burst {
                Some(burst) => policy.with_burst(burst)?,
                None => policy,
            }
        }
        AlgorithmKind::Concurrency => Policy::concurrency(
            a.limit.ok_or_else(|| need("--limit"))?,
            a.lease_ttl.ok_or_else(|| need("--lease-ttl"))?,
        )?,
        other => {
            return Err(CliError::usage(format!(
                "--algorithm {other} is not supported by this floodgate"
            )));
        }
    };
    Ok(Setup {
        policies: vec![policy],
        max_wait,
    })
}

/// A rolling (`--window`) or calendar-aligned (`--calendar`) fixed window.
fn fixed_window(a: &SimulateArgs, kind: AlgorithmKind) -> Result<Policy, CliError> {
    let limit = a
        .limit
        .ok_or_else(|| CliError::usage(format!("--limit is required for --algorithm {kind}")))?;
    match (a.window, a.calendar) {
        (Some(_), Some(_)) => Err(CliError::usage(
            "--window and --calendar cannot be used together: --window makes a window open at \
             the first request, --calendar aligns windows to the calendar",
        )),
        (None, None) => Err(CliError::usage(format!(
            "--window (or --calendar) is required for --algorithm {kind}"
        ))),
        (Some(window), None) => {
            if let Some(flag) = [
                ("--units", a.units.is_some()),
                ("--utc-offset", a.utc_offset.is_some()),
            ]
            .iter()
            .find_map(|(f, given)| given.then_some(f))
            {
                return Err(CliError::usage(format!(
                    "{flag} only applies with --calendar, not with --window"
                )));
            }
            Ok(Policy::fixed_window(limit, window)?)
        }
        (None, Some(unit)) => {
            let policy = Policy::calendar_window(limit, a.units.unwrap_or(1), unit)?;
            Ok(match a.utc_offset {
                Some(offset) => policy.with_utc_offset(offset)?,
                None => policy,
            })
        }
    }
}

/// Runs `floodgate simulate`.
pub(crate) fn run(args: SimulateArgs) -> Result<(), CliError> {
    let setup = setup(&args)?;
    let mut sim = Simulator::new(setup, args.start);
    let input = BufReader::new(io::stdin());
    let out = io::BufWriter::new(io::stdout().lock());
    sim.run(input, out)
}

/// One line of input.
#[derive(Debug, PartialEq, Eq)]
struct Event<'a> {
    t_ms: u64,
    key: &'a str,
    action: Action,
}

#[derive(Debug, PartialEq, Eq)]
enum Action {
    /// Check with this cost.
    Check(u64),
    /// Release the key's oldest lease.
    Release,
}

/// Parses `<t_ms> <key> [cost|release]`; `None` for blank lines and comments.
fn parse_event(line: &str) -> Result<Option<Event<'_>>, String> {
    let mut words = line.split_whitespace().take_while(|w| !w.starts_with('#'));
    let Some(t) = words.next() else {
        return Ok(None);
    };
    let t_ms = t
        .parse::<u64>()
        .map_err(|_| format!("time {t:?} is not a whole number of milliseconds"))?;
    let key = words
        .next()
        .ok_or("missing the key (expected `<t_ms> <key> [cost]`)")?;
    let action = match words.next() {
        None => Action::Check(1),
        Some("release") => Action::Release,
        Some(cost) => Action::Check(
            cost.parse()
                .map_err(|_| format!("cost {cost:?} is not a whole number"))?,
        ),
    };
    if let Some(extra) = words.next() {
        return Err(format!(
            "unexpected {extra:?} after the cost (expected `<t_ms> <key> [cost]`)"
        ));
    }
    Ok(Some(Event { t_ms, key, action }))
}

/// A decision as printed: redis-cell's five fields, then what the policies add.
#[derive(Debug, Serialize)]
struct DecisionJson<'a> {
    /// The policy's name, in the per-policy list of a multi-policy check.
    #[serde(skip_serializing_if = "Option::is_none")]
    policy: Option<&'a str>,
    allowed: bool,
    limit: u64,
    remaining: u64,
    retry_after_ms: Option<u64>,
    reset_after_ms: u64,
    /// Shapers: how long the request waits for its turn.
    #[serde(skip_serializing_if = "Option::is_none")]
    wait_ms: Option<u64>,
    /// Concurrency: the lease taken (numbered 1, 2, ... in this run), null when denied.
    #[serde(skip_serializing_if = "Option::is_none")]
    lease: Option<Option<u64>>,
    /// Several policies: each one's decision.
    #[serde(skip_serializing_if = "Option::is_none")]
    policies: Option<Vec<DecisionJson<'a>>>,
}

impl<'a> DecisionJson<'a> {
    fn new(d: &Decision, policy: Option<&'a str>) -> Self {
        DecisionJson {
            policy,
            allowed: d.allowed,
            limit: d.limit,
            remaining: d.remaining,
            retry_after_ms: d.retry_after_ms(),
            reset_after_ms: d.reset_after_ms(),
            wait_ms: None,
            lease: None,
            policies: None,
        }
    }
}

#[derive(Debug, Serialize)]
struct Released {
    released: bool,
}

/// Runs the events through the policies.
#[derive(Debug)]
struct Simulator {
    policies: Vec<Policy>,
    max_wait: Duration,
    start_ms: u64,
    clock: ManualClock,
    limiter: MemoryLimiter<ManualClock>,
    /// Whether some policy is a shaper (the output has `wait_ms`).
    shaping: bool,
    /// The first concurrency policy (the output has `lease`; `release` lines work).
    concurrency: Option<usize>,
    /// Lease ids (random in core) to the numbers printed, 1, 2, ...
    leases: HashMap<u64, u64>,
    next_lease: u64,
    previous_t: Option<u64>,
}

impl Simulator {
    fn new(setup: Setup, start_ms: u64) -> Self {
        let clock = ManualClock::new(Timestamp::from_millis(start_ms));
        // The limiter's clock is moved to each event's time: releasing a lease reads it.
        let limiter = MemoryLimiter::builder().clock(clock.clone()).build();
        let shaping = setup
            .policies
            .iter()
            .any(|p| p.algorithm() == AlgorithmKind::Shaper);
        let concurrency = setup
            .policies
            .iter()
            .position(|p| p.algorithm() == AlgorithmKind::Concurrency);
        Simulator {
            policies: setup.policies,
            max_wait: setup.max_wait,
            start_ms,
            clock,
            limiter,
            shaping,
            concurrency,
            leases: HashMap::new(),
            next_lease: 1,
            previous_t: None,
        }
    }

    /// Processes every line of `input`, writing one JSON line per event to `out`.
    ///
    /// Output is flushed whenever the input has nothing more buffered, so decisions appear as
    /// soon as their events are typed, and every decision before a bad line is written.
    fn run<R: Read, W: Write>(
        &mut self,
        mut input: BufReader<R>,
        mut out: W,
    ) -> Result<(), CliError> {
        let write_err = |e| CliError::io("cannot write to stdout", e);
        let mut raw = Vec::new();
        let mut line_no = 0u64;
        let result = loop {
            if input.buffer().is_empty() {
                out.flush().map_err(write_err)?;
            }
            raw.clear();
            match input.read_until(b'\n', &mut raw) {
                Ok(0) => break Ok(()),
                Ok(_) => {}
                Err(e) => break Err(CliError::io("cannot read stdin", e)),
            }
            line_no += 1;
            let Ok(line) = std::str::from_utf8(&raw) else {
                break Err(CliError::Input {
                    line: line_no,
                    message: "not valid UTF-8".into(),
                });
            };
            match self.line(line) {
                Ok(None) => {}
                Ok(Some(json)) => {
                    out.write_all(json.as_bytes()).map_err(write_err)?;
                    out.write_all(b"\n").map_err(write_err)?;
                }
                Err(message) => {
                    break Err(CliError::Input {
                        line: line_no,
                        message,
                    });
                }
            }
        };
        out.flush().map_err(write_err)?;
        result
    }

    /// One line: its JSON output, nothing for a blank line, or what is wrong with it.
    fn line(&mut self, line: &str) -> Result<Option<String>, String> {
        let Some(event) = parse_event(line)? else {
            return Ok(None);
        };
        if let Some(previous) = self.previous_t {
            if event.t_ms < previous {
                return Err(format!(
                    "time {} goes backwards (previous {previous})",
                    event.t_ms
                ));
            }
        }
        let now_ms = self
            .start_ms
            .checked_add(event.t_ms)
            .filter(|ms| *ms <= u64::MAX / 1_000)
            .ok_or_else(|| format!("time {} is too far in the future", event.t_ms))?;
        self.previous_t = Some(event.t_ms);
        let now = Timestamp::from_millis(now_ms);
        self.clock.set(now);
        let json = match event.action {
            Action::Check(cost) => self.check(event.key, cost, now)?,
            Action::Release => self.release(event.key, now)?,
        };
        Ok(Some(json))
    }

    fn check(&mut self, key: &str, cost: u64, now: Timestamp) -> Result<String, String> {
        let checks: Vec<Check<'_>> = self
            .policies
            .iter()
            .map(|p| Check::new(key.as_bytes(), p).cost(cost))
            .collect();
        let opts = CheckOptions {
            max_wait: self.max_wait,
            ..CheckOptions::at(now)
        };
        let verdict = self
            .limiter
            .check_sync(&checks, opts)
            .map_err(|e| e.to_string())?;
        let top = verdict
            .decision()
            .ok_or("no decision was returned (no policy to check)")?;
        let mut json = DecisionJson::new(&top, None);
        json.allowed = verdict.allowed();
        if self.shaping {
            json.wait_ms = Some(ceil_ms(verdict.wait));
        }
        if self.concurrency.is_some() {
            json.lease = Some(verdict.lease.map(|LeaseId(id)| {
                let n = self.next_lease;
                self.next_lease += 1;
                self.leases.insert(id, n);
                n
            }));
        }
        if self.policies.len() > 1 {
            json.policies = Some(
                self.policies
                    .iter()
                    .zip(&verdict.decisions)
                    .map(|(p, d)| DecisionJson::new(d, Some(p.name())))
                    .collect(),
            );
        }
        serde_json::to_string(&json).map_err(|e| e.to_string())
    }

    /// Releases the oldest lease on `key` still held at `now`.
    fn release(&mut self, key: &str, now: Timestamp) -> Result<String, String> {
        let Some(index) = self.concurrency else {
            return Err("`release` only applies to concurrency policies".into());
        };
        let now_us = now.as_micros();
        // Leases all last the same ttl, so the oldest is the one that lapses first.
        let oldest = match self.limiter.state(key.as_bytes(), &self.policies[index]) {
            Some(State::Concurrency(state)) => state
                .leases
                .iter()
                .filter(|l| l.expires_at > now_us)
                .min_by_key(|l| l.expires_at)
                .map(|l| l.id),
            _ => None,
        };
        if let Some(id) = oldest {
            let checks: Vec<Check<'_>> = self
                .policies
                .iter()
                .map(|p| Check::new(key.as_bytes(), p))
                .collect();
            self.limiter.release_sync(&checks, LeaseId(id));
            self.leases.remove(&id);
        }
        serde_json::to_string(&Released {
            released: oldest.is_some(),
        })
        .map_err(|e| e.to_string())
    }
}

/// A duration in whole milliseconds, rounded up like every duration in a decision.
fn ceil_ms(d: Duration) -> u64 {
    u64::try_from(d.as_micros().div_ceil(1_000)).unwrap_or(u64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sim(policies: &[&str]) -> Simulator {
        let policies = policies
            .iter()
            .map(|p| p.parse().expect("valid policy"))
            .collect();
        Simulator::new(
            Setup {
                policies,
                max_wait: Duration::ZERO,
            },
            0,
        )
    }

    fn run(s: &mut Simulator, input: &str) -> (String, Result<(), String>) {
        let mut out = Vec::new();
        let res = s
            .run(BufReader::new(input.as_bytes()), &mut out)
            .map_err(|e| e.to_string());
        (String::from_utf8(out).expect("utf-8"), res)
    }

    #[test]
    fn parses_events() {
        assert_eq!(parse_event("   "), Ok(None));
        assert_eq!(parse_event("# a comment"), Ok(None));
        assert_eq!(
            parse_event("10 alice 3 # trailing"),
            Ok(Some(Event {
                t_ms: 10,
                key: "alice",
                action: Action::Check(3)
            }))
        );
        assert_eq!(
            parse_event("10 alice release").map(|e| e.map(|e| e.action)),
            Ok(Some(Action::Release))
        );
        assert!(
            parse_event("x alice")
                .expect_err("bad time")
                .contains("\"x\"")
        );
        assert!(parse_event("1").expect_err("no key").contains("key"));
        assert_eq!(
            parse_event("1 a -2"),
            Err("cost \"-2\" is not a whole number".into())
        );
        assert!(parse_event("1 a 2 3").expect_err("extra").contains("\"3\""));
    }

    #[test]
    fn keys_are_independent_and_errors_keep_earlier_output() {
        let mut s = sim(&["fixed:1/1s"]);
        let (out, res) = run(&mut s, "0 a\n0 b\n0 a\n\n5 a\n4 a\n6 a\n");
        let allowed: Vec<bool> = out
            .lines()
            .map(|l| l.contains("\"allowed\":true"))
            .collect();
        assert_eq!(allowed, [true, true, false, false]);
        assert_eq!(
            res,
            Err("line 6: time 4 goes backwards (previous 5)".to_string())
        );
    }

    #[test]
    fn release_frees_the_oldest_live_lease() {
        let mut s = sim(&["concurrency:2 ttl 10s"]);
        let (out, res) = run(
            &mut s,
            "0 k\n1000 k\n2000 k\n3000 k release\n3000 k\n10500 k release\n20000 k release\n",
        );
        res.expect("runs");
        let lines: Vec<&str> = out.lines().collect();
        assert!(lines[0].ends_with("\"lease\":1}"), "{}", lines[0]);
        assert!(lines[1].ends_with("\"lease\":2}"), "{}", lines[1]);
        assert!(lines[2].ends_with("\"lease\":null}"), "{}", lines[2]);
        assert_eq!(lines[3], "{\"released\":true}");
        assert!(lines[4].ends_with("\"lease\":3}"), "{}", lines[4]);
        // Lease 1 went at 3 s; lease 2 (from t=1000) is the oldest held at 10.5 s.
        assert_eq!(lines[5], "{\"released\":true}");
        assert_eq!(lines[6], "{\"released\":false}");
    }
}
