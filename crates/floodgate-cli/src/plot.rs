//! `floodgate plot`: runs one traffic pattern through several algorithms, each set to the same
//! nominal "limit per window", and draws what each admits and rejects, one lane per algorithm.
//!
//! The picture answers "why a sliding log?": under the `boundary` pattern a fixed window admits
//! a full window's worth just before a window boundary and again just after it, twice its limit
//! within one window's length, where the sliding log admits its limit and no more.

use std::fmt;
use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, ValueEnum};
use floodgate_core::{
    AlgorithmKind, CalendarUnit, Check, CheckOptions, MemoryLimiter, Policy, State, Timestamp,
};
use plotters::prelude::*;

use crate::args::{self, short_duration};
use crate::error::CliError;

/// The most requests a pattern may send (the SVG gets one mark per request and algorithm).
const MAX_REQUESTS: u64 = 20_000;

/// 2024-01-01T00:00:00Z, a Monday: aligned to every calendar unit, so calendar windows start at
/// multiples of the window from the start of the plot.
const BASE_US: u64 = 1_704_067_200_000_000;

const US_PER_S: f64 = 1_000_000.0;

const LONG_ABOUT: &str = "\
Run a traffic pattern through several algorithms and draw an SVG of what each one admits
(green dots) and rejects (red crosses) over time, one lane per algorithm.

Every algorithm is set to the same nominal limit per window, so the lanes differ only in how
each one counts:
  fixed_window     --limit per --window, windows aligned to the clock (rolling when the window
                   is not a calendar unit: 1, 2, 3, 4, 5, 6, 10, 12, 15, 20, 30 seconds or
                   minutes, hours dividing a day, a day or a week)
  sliding_log      --limit in any --window
  sliding_window   about --limit in any --window
  token_bucket     capacity --limit, refilled --limit per --window
  leaky_bucket     capacity --limit, draining in --window
  gcra             max burst --limit - 1, --limit per --window
  shaper           --limit per --window, bursts of --limit, no waiting
  concurrency      (only when listed) --limit leases lasting --window, never released

It also prints a table: per algorithm, the requests admitted and rejected, and the most it
admitted within any window of length --window. Under --pattern boundary that last column is
twice the limit for fixed_window and exactly the limit for sliding_log.";

const AFTER_HELP: &str = "\
Patterns:
  steady     requests evenly spaced at 1.5x the limit
  bursty     a burst of --limit requests (spread over 1/8 of the window) every half window
  boundary   a burst of --limit just before a window boundary and another just after it:
             the classic double spend of a fixed window

Examples:
  floodgate plot --pattern boundary
  floodgate plot --pattern bursty --limit 20 --window 1m --algorithms fixed_window,gcra,sliding_log
  floodgate plot --pattern steady --duration 5m --out steady.svg";

/// A traffic pattern.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub(crate) enum Pattern {
    /// Evenly spaced requests at 1.5x the limit.
    Steady,
    /// A burst of --limit requests every half window.
    Bursty,
    /// A burst just before a window boundary and another just after it.
    Boundary,
}

impl Pattern {
    fn as_str(self) -> &'static str {
        match self {
            Pattern::Steady => "steady",
            Pattern::Bursty => "bursty",
            Pattern::Boundary => "boundary",
        }
    }
}

impl fmt::Display for Pattern {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Flags of `floodgate plot`.
#[derive(Debug, Args)]
#[command(
    about = "Run a traffic pattern through several algorithms and draw what each admits (SVG)",
    long_about = LONG_ABOUT,
    after_help = AFTER_HELP
)]
pub(crate) struct PlotArgs {
    /// The traffic to send.
    #[arg(long, value_enum, default_value_t = Pattern::Boundary)]
    pattern: Pattern,

    /// Requests each algorithm allows per window.
    #[arg(long, value_name = "N", default_value_t = 10)]
    limit: u64,

    /// The window of the limit.
    #[arg(long, value_name = "DUR", default_value = "10s", value_parser = args::duration)]
    window: Duration,

    /// How long to send traffic [default: 3 windows].
    #[arg(long, value_name = "DUR", value_parser = args::duration)]
    duration: Option<Duration>,

    /// Algorithms to compare, comma-separated [default: every one but concurrency].
    #[arg(long, value_name = "LIST", value_delimiter = ',', value_parser = args::algorithm)]
    algorithms: Vec<AlgorithmKind>,

    /// The SVG file to write [default: floodgate-<pattern>.svg].
    #[arg(long, value_name = "FILE")]
    out: Option<PathBuf>,
}

/// The algorithms compared by default: every rate algorithm.
const DEFAULT_ALGORITHMS: [AlgorithmKind; 7] = [
    AlgorithmKind::FixedWindow,
    AlgorithmKind::SlidingLog,
    AlgorithmKind::SlidingWindow,
    AlgorithmKind::TokenBucket,
    AlgorithmKind::LeakyBucket,
    AlgorithmKind::Gcra,
    AlgorithmKind::Shaper,
];

/// One algorithm's run.
#[derive(Debug)]
struct Lane {
    kind: AlgorithmKind,
    policy: Policy,
    /// Admitted request times, microseconds from the start of the plot.
    admitted: Vec<u64>,
    rejected: Vec<u64>,
    /// The most admitted within any window of the limit's length.
    max_in_window: usize,
    /// For a rolling fixed window: the start of every window it opened.
    window_starts: Vec<u64>,
}

impl Lane {
    fn label(&self) -> String {
        format!(
            "{}: {} admitted / {} rejected",
            self.kind,
            self.admitted.len(),
            self.rejected.len()
        )
    }
}

/// Runs `floodgate plot`.
pub(crate) fn run(args: PlotArgs) -> Result<(), CliError> {
    let limit = args.limit;
    if limit == 0 {
        return Err(CliError::usage("--limit must be greater than zero"));
    }
    let window = micros(args.window);
    if window < 1_000 {
        return Err(CliError::usage("--window must be at least 1ms"));
    }
    let duration = match args.duration {
        Some(d) => micros(d),
        None => window.saturating_mul(3),
    };
    if duration == 0 {
        return Err(CliError::usage("--duration must be greater than zero"));
    }
    let kinds = if args.algorithms.is_empty() {
        DEFAULT_ALGORITHMS.to_vec()
    } else {
        args.algorithms.clone()
    };
    for (i, kind) in kinds.iter().enumerate() {
        if kinds[..i].contains(kind) {
            return Err(CliError::usage(format!(
                "{kind} is listed twice in --algorithms"
            )));
        }
    }
    let calendar = calendar_of(window);
    let base = match calendar {
        Some(_) => BASE_US,
        None => BASE_US - BASE_US % window,
    };
    if calendar.is_none() && kinds.contains(&AlgorithmKind::FixedWindow) {
        eprintln!(
            "note: a {} window is not a calendar unit, so fixed_window opens each window at \
             its first request instead of at multiples of the window",
            short_duration(args.window)
        );
    }
    let traffic = traffic(args.pattern, limit, window, duration)?;
    let mut lanes = Vec::with_capacity(kinds.len());
    for kind in kinds {
        let policy = policy_for(kind, limit, args.window, calendar)?;
        lanes.push(simulate(kind, policy, &traffic, base, window)?);
    }

    let window_name = short_duration(args.window);
    let summary = format!(
        "{} pattern: {} requests over {}; every algorithm allows {limit} per {window_name}",
        args.pattern,
        traffic.len(),
        short_duration(Duration::from_micros(duration)),
    );
    crate::error::print(&format!("{summary}\n{}", table(&lanes, &window_name)))?;

    let boundaries = boundaries(&lanes, calendar.is_some(), window, duration);
    let title = format!(
        "{}, against {limit} per {window_name}",
        describe(args.pattern, limit, window, duration),
    );
    let svg = draw(&title, &lanes, &window_name, duration, &boundaries)?;
    let out = args
        .out
        .unwrap_or_else(|| PathBuf::from(format!("floodgate-{}.svg", args.pattern)));
    std::fs::write(&out, svg)
        .map_err(|e| CliError::io(format!("cannot write {}", out.display()), e))?;
    eprintln!("wrote {}", out.display());
    Ok(())
}

fn micros(d: Duration) -> u64 {
    u64::try_from(d.as_micros()).unwrap_or(u64::MAX)
}

/// The calendar windows of the same length as `window_us`, when there are any.
fn calendar_of(window_us: u64) -> Option<(u32, CalendarUnit)> {
    if window_us == 0 || !window_us.is_multiple_of(1_000_000) {
        return None;
    }
    let s = window_us / 1_000_000;
    let (n, unit) = if s < 60 && 60 % s == 0 {
        (s, CalendarUnit::Second)
    } else if s.is_multiple_of(60) && s < 3_600 && 60 % (s / 60) == 0 {
        (s / 60, CalendarUnit::Minute)
    } else if s.is_multiple_of(3_600) && s < 86_400 && 24 % (s / 3_600) == 0 {
        (s / 3_600, CalendarUnit::Hour)
    } else if s == 86_400 {
        (1, CalendarUnit::Day)
    } else if s == 7 * 86_400 {
        (1, CalendarUnit::Week)
    } else {
        return None;
    };
    Some((u32::try_from(n).ok()?, unit))
}

/// Each algorithm set to the same nominal `limit` per `window`.
fn policy_for(
    kind: AlgorithmKind,
    limit: u64,
    window: Duration,
    calendar: Option<(u32, CalendarUnit)>,
) -> Result<Policy, CliError> {
    let policy = match kind {
        AlgorithmKind::FixedWindow => match calendar {
            Some((n, unit)) => Policy::calendar_window(limit, n, unit)?,
            None => Policy::fixed_window(limit, window)?,
        },
        AlgorithmKind::SlidingLog => Policy::sliding_log(limit, window)?,
        AlgorithmKind::SlidingWindow => Policy::sliding_window(limit, window)?,
        AlgorithmKind::TokenBucket => Policy::token_bucket(limit, limit, window)?,
        AlgorithmKind::LeakyBucket => Policy::funnel(limit, window)?,
        AlgorithmKind::Gcra => Policy::gcra(limit - 1, limit, window)?,
        AlgorithmKind::Shaper => Policy::shaper(limit, window)?.with_burst(limit)?,
        AlgorithmKind::Concurrency => Policy::concurrency(limit, window)?,
        other => {
            return Err(CliError::usage(format!(
                "{other} cannot be plotted by this floodgate"
            )));
        }
    };
    Ok(policy)
}

/// Request times of `pattern`, microseconds from the start, in order.
fn traffic(pattern: Pattern, limit: u64, window: u64, duration: u64) -> Result<Vec<u64>, CliError> {
    let (l, w, d) = (u128::from(limit), u128::from(window), u128::from(duration));
    // Bursts are spread over an eighth of a window, so that each request shows.
    let span = w / 8;
    let burst = |start: u128| (0..l).map(move |i| start + i * span / l);
    let expected = match pattern {
        // One every 2w / 3l.
        Pattern::Steady => (d * 3 * l).div_ceil(2 * w),
        Pattern::Bursty => d.div_ceil(w / 2) * l,
        Pattern::Boundary => 2 * l,
    };
    if expected > u128::from(MAX_REQUESTS) {
        return Err(CliError::usage(format!(
            "the {pattern} pattern would send {expected} requests; at most {MAX_REQUESTS} can \
             be plotted (lower --limit or --duration)"
        )));
    }
    let times: Vec<u128> = match pattern {
        Pattern::Steady => (0..)
            .map(|k: u128| k * 2 * w / (3 * l))
            .take_while(|t| *t < d)
            .collect(),
        Pattern::Bursty => (0..)
            .map(|k: u128| w / 4 + k * w / 2)
            .take_while(|s| *s < d)
            .flat_map(burst)
            .filter(|t| *t < d)
            .collect(),
        Pattern::Boundary => {
            // The window boundary nearest the middle (at least the first one).
            let b = (d / 2 / w).max(1) * w;
            if b + span > d {
                return Err(CliError::usage(format!(
                    "--duration must be at least {} with --pattern boundary, so that a window \
                     boundary falls inside it",
                    short_duration(Duration::from_micros(
                        u64::try_from(b + span).unwrap_or(u64::MAX)
                    ))
                )));
            }
            burst(b - span).chain(burst(b)).collect()
        }
    };
    Ok(times
        .into_iter()
        .map(|t| u64::try_from(t).unwrap_or(u64::MAX))
        .collect())
}

/// A sentence naming the pattern for the chart's title.
fn describe(pattern: Pattern, limit: u64, window: u64, duration: u64) -> String {
    let s = |us: u64| fmt_secs(us as f64 / US_PER_S);
    match pattern {
        Pattern::Steady => format!(
            "steady traffic, one request every {}s (1.5x the limit)",
            s(2 * window / (3 * limit))
        ),
        Pattern::Bursty => format!("bursty traffic, {limit} requests every {}s", s(window / 2)),
        Pattern::Boundary => {
            let b = (duration / 2 / window).max(1) * window;
            format!(
                "boundary traffic, {limit} requests just before the window boundary at {}s and \
                 {limit} just after",
                s(b)
            )
        }
    }
}

/// `1.5`, `10`, `0.667`: seconds without trailing zeros.
fn fmt_secs(s: f64) -> String {
    let text = format!("{s:.3}");
    text.trim_end_matches('0').trim_end_matches('.').to_string()
}

/// Runs `traffic` through `policy`.
fn simulate(
    kind: AlgorithmKind,
    policy: Policy,
    traffic: &[u64],
    base: u64,
    window: u64,
) -> Result<Lane, CliError> {
    let limiter = MemoryLimiter::new();
    let key = b"plot";
    let mut lane = Lane {
        kind,
        policy,
        admitted: Vec::new(),
        rejected: Vec::new(),
        max_in_window: 0,
        window_starts: Vec::new(),
    };
    for &t in traffic {
        let check = Check::new(key, &lane.policy);
        let opts = CheckOptions::at(Timestamp::from_micros(base + t));
        let verdict = limiter.check_sync(&[check], opts)?;
        if verdict.allowed() {
            lane.admitted.push(t);
            if let Some(State::FixedWindow(state)) = limiter.state(key, &lane.policy) {
                let start = state.start.saturating_sub(base);
                if lane.window_starts.last() != Some(&start) {
                    lane.window_starts.push(start);
                }
            }
        } else {
            lane.rejected.push(t);
        }
    }
    lane.max_in_window = max_in_window(&lane.admitted, window);
    Ok(lane)
}

/// The most of the sorted `times` within any window `[t, t + window)`.
fn max_in_window(times: &[u64], window: u64) -> usize {
    let mut best = 0;
    let mut end = 0;
    for (i, &t) in times.iter().enumerate() {
        end = end.max(i);
        while end < times.len() && times[end] < t.saturating_add(window) {
            end += 1;
        }
        best = best.max(end - i);
    }
    best
}

/// The table printed on stdout.
fn table(lanes: &[Lane], window_name: &str) -> String {
    let max_header = format!("max in any {window_name}");
    let mut out = format!(
        "{:<16} {:>9} {:>9}  {:>w$}\n",
        "algorithm",
        "admitted",
        "rejected",
        max_header,
        w = max_header.len().max(6)
    );
    for lane in lanes {
        out.push_str(&format!(
            "{:<16} {:>9} {:>9}  {:>w$}\n",
            lane.kind.as_str(),
            lane.admitted.len(),
            lane.rejected.len(),
            lane.max_in_window,
            w = max_header.len().max(6)
        ));
    }
    out
}

/// The most window boundaries drawn: past this, they would be lines closer than the picture's
/// pixels (and a year of 1-second windows, millions of them, would take gigabytes).
const MAX_BOUNDARIES: u64 = 1_000;

/// Where to draw the fixed window's boundaries, microseconds from the start; none when there
/// would be more than [`MAX_BOUNDARIES`].
fn boundaries(lanes: &[Lane], aligned: bool, window: u64, duration: u64) -> Vec<u64> {
    if aligned {
        if duration / window.max(1) > MAX_BOUNDARIES {
            return Vec::new();
        }
        return (1..)
            .map(|k| window.saturating_mul(k))
            .take_while(|t| *t < duration)
            .collect();
    }
    let Some(fixed) = lanes.iter().find(|l| l.kind == AlgorithmKind::FixedWindow) else {
        return Vec::new();
    };
    let mut lines: Vec<u64> = fixed
        .window_starts
        .iter()
        .flat_map(|s| [*s, s.saturating_add(window)])
        .filter(|t| *t <= duration)
        .collect();
    lines.sort_unstable();
    lines.dedup();
    if lines.len() as u64 > MAX_BOUNDARIES {
        lines.clear();
    }
    lines
}

fn plot_error(e: impl fmt::Display) -> CliError {
    CliError::Plot(e.to_string())
}

/// Draws the lanes into an SVG document.
fn draw(
    title: &str,
    lanes: &[Lane],
    window_name: &str,
    duration: u64,
    boundaries: &[u64],
) -> Result<String, CliError> {
    const GREEN_MARK: RGBColor = RGBColor(0, 150, 60);
    const RED_MARK: RGBColor = RGBColor(210, 30, 30);
    const GREY: RGBColor = RGBColor(130, 130, 130);
    let n = lanes.len();
    let lane_px = 100;
    let (width, height) = (
        1200u32,
        150 + lane_px * u32::try_from(n).unwrap_or(u32::MAX / 200),
    );
    let x_max = duration as f64 / US_PER_S;
    // Lane `i` (from the top) is centred on y = n - 1 - i; the band above the top lane holds
    // the legend.
    let lane_y = |i: usize| (n - 1 - i) as f64;
    let top = n as f64 - 0.5 + 0.6;
    let secs = |us: u64| us as f64 / US_PER_S;

    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (width, height)).into_drawing_area();
        root.fill(&WHITE).map_err(plot_error)?;
        let mut chart = ChartBuilder::on(&root)
            .caption(title, ("sans-serif", 20))
            .margin(15)
            .x_label_area_size(45)
            .y_label_area_size(10)
            .build_cartesian_2d(0f64..x_max, -0.5f64..top)
            .map_err(plot_error)?;
        chart
            .configure_mesh()
            .disable_y_mesh()
            .y_labels(0)
            .light_line_style(RGBColor(238, 238, 238))
            .x_desc("time (s)")
            .draw()
            .map_err(plot_error)?;

        for i in 1..n {
            let y = i as f64 - 0.5;
            chart
                .draw_series(LineSeries::new(
                    [(0.0, y), (x_max, y)],
                    RGBColor(200, 200, 200),
                ))
                .map_err(plot_error)?;
        }
        for (k, &b) in boundaries.iter().enumerate() {
            let x = secs(b);
            let series = chart
                .draw_series(DashedLineSeries::new(
                    [(x, -0.5), (x, n as f64 - 0.5)],
                    6,
                    4,
                    GREY.stroke_width(1),
                ))
                .map_err(plot_error)?;
            if k == 0 {
                series
                    .label(format!("fixed window boundary ({window_name} windows)"))
                    .legend(|(x, y)| PathElement::new([(x - 8, y), (x + 8, y)], GREY));
            }
        }

        let admitted = lanes.iter().enumerate().flat_map(|(i, lane)| {
            let y = lane_y(i) + 0.08;
            lane.admitted
                .iter()
                .map(move |t| Circle::new((secs(*t), y), 3, GREEN_MARK.filled()))
        });
        chart
            .draw_series(admitted)
            .map_err(plot_error)?
            .label("admitted")
            .legend(|(x, y)| Circle::new((x, y), 3, GREEN_MARK.filled()));
        let rejected = lanes.iter().enumerate().flat_map(|(i, lane)| {
            let y = lane_y(i) - 0.22;
            lane.rejected
                .iter()
                .map(move |t| Cross::new((secs(*t), y), 3, RED_MARK.stroke_width(2)))
        });
        chart
            .draw_series(rejected)
            .map_err(plot_error)?
            .label("rejected")
            .legend(|(x, y)| Cross::new((x, y), 3, RED_MARK.stroke_width(2)));

        for (i, lane) in lanes.iter().enumerate() {
            let text = format!(
                "{}   (policy {}; at most {} admitted in any {window_name})",
                lane.label(),
                lane.policy.name(),
                lane.max_in_window
            );
            chart
                .draw_series(std::iter::once(Text::new(
                    text,
                    (x_max * 0.005, lane_y(i) + 0.46),
                    ("sans-serif", 15),
                )))
                .map_err(plot_error)?;
        }
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::UpperRight)
            .background_style(WHITE.mix(0.9))
            .border_style(GREY)
            .draw()
            .map_err(plot_error)?;
        root.present().map_err(plot_error)?;
    }
    Ok(svg)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn window_boundaries_are_drawn_only_while_they_are_few() {
        let s = 1_000_000;
        assert_eq!(
            boundaries(&[], true, 10 * s, 35 * s),
            [10 * s, 20 * s, 30 * s]
        );
        // A year of 1-second windows: none, not 31 million.
        assert!(boundaries(&[], true, s, 365 * 86_400 * s).is_empty());
        assert!(boundaries(&[], true, s, u64::MAX).is_empty());
        assert_eq!(boundaries(&[], true, s, MAX_BOUNDARIES * s).len(), 999);
    }

    const S: u64 = 1_000_000;

    #[test]
    fn calendar_windows() {
        assert_eq!(calendar_of(10 * S), Some((10, CalendarUnit::Second)));
        assert_eq!(calendar_of(60 * S), Some((1, CalendarUnit::Minute)));
        assert_eq!(calendar_of(900 * S), Some((15, CalendarUnit::Minute)));
        assert_eq!(calendar_of(7_200 * S), Some((2, CalendarUnit::Hour)));
        assert_eq!(calendar_of(86_400 * S), Some((1, CalendarUnit::Day)));
        assert_eq!(calendar_of(7 * S), None);
        assert_eq!(calendar_of(1_500_000), None);
        assert_eq!(calendar_of(5 * 3_600 * S), None);
    }

    #[test]
    fn max_in_window_is_half_open() {
        assert_eq!(max_in_window(&[], 10), 0);
        assert_eq!(max_in_window(&[0, 10, 20], 10), 1);
        assert_eq!(max_in_window(&[0, 9, 10, 19], 10), 2);
        assert_eq!(max_in_window(&[5, 5, 5, 14, 15], 10), 4);
    }

    #[test]
    fn patterns() {
        let w = 10 * S;
        let steady = traffic(Pattern::Steady, 10, w, 3 * w).expect("fits");
        assert_eq!(steady.len(), 45);
        assert_eq!(&steady[..3], &[0, 666_666, 1_333_333]);
        let bursty = traffic(Pattern::Bursty, 10, w, 3 * w).expect("fits");
        assert_eq!(bursty.len(), 60);
        assert_eq!(bursty[0], 2_500_000);
        assert_eq!(bursty[10], 7_500_000);
        let boundary = traffic(Pattern::Boundary, 10, w, 3 * w).expect("fits");
        assert_eq!(boundary.len(), 20);
        assert!(boundary[..10].iter().all(|t| (8_750_000..w).contains(t)));
        assert!(boundary[10..].iter().all(|t| (w..w + w / 8).contains(t)));
        assert!(traffic(Pattern::Boundary, 10, w, w).is_err());
        assert!(traffic(Pattern::Steady, 1_000_000, w, w).is_err());
    }
}
