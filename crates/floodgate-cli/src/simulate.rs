//! `floodgate simulate`: runs one policy (or several, all-or-nothing) over a trace of events
//! read from stdin, with the time taken from the trace, and prints every decision as JSON.

use std::collections::HashMap;
use std::io::{self, BufRead, BufReader, Read, Write};
use std::time::Duration;

use clap::Args;
use floodgate_core::{
    AlgorithmKind, Check, CheckOptions, Decision, LeaseId, ManualClock, MemoryLimiter, Policy,
    State, Timestamp,
};
use serde::Serialize;

use crate::error::CliError;
use crate::policy_args::{PolicyArgs, PolicySet, algorithms_help};

const LONG_ABOUT: &str = "\
Run a rate-limiting policy over events read from stdin and print each decision as JSON.

The time comes from the events, not from the clock, so a run is exactly reproducible: the
same trace always gives the same decisions. The policy runs in memory, with the same
algorithms the Redis backend runs as scripts.

Choose the policy either with --algorithm and that algorithm's flags, or with --policy and a
policy string (repeat --policy to check several policies all-or-nothing).";

const AFTER_HELP: &str = concat!(
    algorithms_help!(),
    "
Input (stdin), one event per line:
  <t_ms> <key> [cost]    t_ms: milliseconds since the start (never decreasing), key: any
                         word not beginning with #, cost: a whole number of units
                         (default 1; 0 only peeks)
  <t_ms> <key> release   concurrency: release the key's oldest lease still held,
                         prints {\"released\":true} or {\"released\":false}
  Blank lines are skipped, and so is the rest of a line from a word beginning
  with #. t=0 is --start (Unix ms, default 0: the Unix
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
are printed), 2 for a bad command line or policy."
);

/// Flags of `floodgate simulate`.
#[derive(Debug, Args)]
#[command(
    about = "Run a policy over events read from stdin and print each decision as JSON",
    long_about = LONG_ABOUT,
    after_help = AFTER_HELP
)]
pub(crate) struct SimulateArgs {
    #[command(flatten)]
    policy: PolicyArgs,

    /// The Unix time in milliseconds of t=0 in the input.
    #[arg(long, value_name = "UNIX_MS", default_value_t = 0)]
    start: u64,
}

/// Runs `floodgate simulate`.
pub(crate) fn run(args: SimulateArgs) -> Result<(), CliError> {
    let setup = args.policy.build()?;
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
    fn new(setup: PolicySet, start_ms: u64) -> Self {
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
        if let Some(previous) = self.previous_t
            && event.t_ms < previous
        {
            return Err(format!(
                "time {} goes backwards (previous {previous})",
                event.t_ms
            ));
        }
        let now_ms = self
            .start_ms
            .checked_add(event.t_ms)
            // The memory store's last second (2106): past it, it refuses to decide.
            .filter(|ms| *ms <= MAX_TIME_MS)
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

/// The latest time `simulate` accepts, in ms since the epoch: the memory store's latest
/// (2106-02-07 06:28:14 UTC, where its expiry times run out), well within the 2^53 us up to
/// which the algorithms' (and Lua's) times stay exact.
const MAX_TIME_MS: u64 = (u32::MAX as u64 - 1) * 1_000;

#[cfg(test)]
mod tests {
    use super::*;

    fn sim(policies: &[&str]) -> Simulator {
        let policies = policies
            .iter()
            .map(|p| p.parse().expect("valid policy"))
            .collect();
        Simulator::new(
            PolicySet {
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
