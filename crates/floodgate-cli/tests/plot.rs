//! `floodgate plot` end to end: the SVG it writes and the table it prints.

mod common;

use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use common::floodgate;

/// A fresh directory under the system's temp dir, removed on drop.
#[derive(Debug)]
struct TempDir(PathBuf);

impl TempDir {
    fn new(name: &str) -> Self {
        let nanos = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.subsec_nanos());
        let dir = std::env::temp_dir().join(format!(
            "floodgate-cli-{name}-{}-{nanos}",
            std::process::id()
        ));
        std::fs::create_dir_all(&dir).expect("temp dir");
        TempDir(dir)
    }

    fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// One row of the table: algorithm, admitted, rejected, most admitted in any window.
#[derive(Debug, PartialEq, Eq)]
struct Row {
    algorithm: String,
    admitted: u64,
    rejected: u64,
    max_in_window: u64,
}

const RATE_ALGORITHMS: [&str; 7] = [
    "fixed_window",
    "sliding_log",
    "sliding_window",
    "token_bucket",
    "leaky_bucket",
    "gcra",
    "shaper",
];

fn rows(lines: &[&str]) -> Vec<Row> {
    lines
        .iter()
        .filter_map(|line| {
            let words: Vec<&str> = line.split_whitespace().collect();
            let [algorithm, admitted, rejected, max] = words[..] else {
                return None;
            };
            Some(Row {
                algorithm: algorithm.to_owned(),
                admitted: admitted.parse().ok()?,
                rejected: rejected.parse().ok()?,
                max_in_window: max.parse().ok()?,
            })
        })
        .collect()
}

fn row<'a>(rows: &'a [Row], algorithm: &str) -> &'a Row {
    rows.iter()
        .find(|r| r.algorithm == algorithm)
        .unwrap_or_else(|| panic!("no row for {algorithm} in {rows:?}"))
}

/// Runs `floodgate plot --pattern <pattern> --out <dir>/<pattern>.svg extra...`.
fn plot(dir: &TempDir, pattern: &str, extra: &[&str]) -> (Vec<Row>, String) {
    let out = dir.path().join(format!("{pattern}.svg"));
    let out_arg = out.to_str().expect("UTF-8 temp path");
    let mut args = vec!["plot", "--pattern", pattern, "--out", out_arg];
    args.extend_from_slice(extra);
    let run = floodgate(&args, "");
    run.success();
    let svg = std::fs::read_to_string(&out).expect("the SVG was written");
    (rows(&run.lines()), svg)
}

#[test]
fn every_pattern_writes_an_svg_with_every_lane() {
    let dir = TempDir::new("patterns");
    for pattern in ["steady", "bursty", "boundary"] {
        let (rows, svg) = plot(&dir, pattern, &[]);
        let start = svg.trim_start();
        assert!(
            start.starts_with("<svg") || start.starts_with("<?xml"),
            "{pattern}: {}",
            &svg[..svg.len().min(200)]
        );
        assert!(svg.trim_end().ends_with("</svg>"), "{pattern}: not closed");
        let names: Vec<&str> = rows.iter().map(|r| r.algorithm.as_str()).collect();
        assert_eq!(names, RATE_ALGORITHMS, "{pattern}: default algorithms");
        for r in &rows {
            let label = format!(
                "{}: {} admitted / {} rejected",
                r.algorithm, r.admitted, r.rejected
            );
            assert!(svg.contains(&label), "{pattern}: no lane label {label:?}");
        }
        assert!(
            svg.contains(pattern),
            "{pattern}: the title names the pattern"
        );
        assert!(
            svg.contains("10 per 10s"),
            "{pattern}: the title names the policy"
        );
        // Every request is either admitted or rejected by each algorithm.
        let total = rows[0].admitted + rows[0].rejected;
        assert!(rows.iter().all(|r| r.admitted + r.rejected == total));
    }
}

#[test]
fn boundary_pattern_shows_the_fixed_window_double_spend() {
    let dir = TempDir::new("boundary");
    let (rows, _) = plot(&dir, "boundary", &[]);
    assert_eq!(row(&rows, "fixed_window").max_in_window, 20, "{rows:?}");
    assert_eq!(row(&rows, "fixed_window").admitted, 20);
    assert_eq!(row(&rows, "sliding_log").max_in_window, 10, "{rows:?}");
    assert_eq!(row(&rows, "sliding_log").admitted, 10);

    // Another limit and window: still twice the limit against exactly the limit.
    let (rows, svg) = plot(
        &dir,
        "boundary",
        &[
            "--limit",
            "4",
            "--window",
            "1m",
            "--algorithms",
            "sliding_log,fixed_window",
        ],
    );
    let names: Vec<&str> = rows.iter().map(|r| r.algorithm.as_str()).collect();
    assert_eq!(names, ["sliding_log", "fixed_window"]);
    assert_eq!(row(&rows, "fixed_window").max_in_window, 8);
    assert_eq!(row(&rows, "sliding_log").max_in_window, 4);
    assert!(
        !svg.contains("gcra:"),
        "only the listed algorithms are drawn"
    );
}

#[test]
fn default_output_file_is_named_after_the_pattern() {
    let dir = TempDir::new("default-out");
    let run = std::process::Command::new(env!("CARGO_BIN_EXE_floodgate"))
        .args(["plot", "--pattern", "steady"])
        .current_dir(dir.path())
        .output()
        .expect("floodgate runs");
    assert!(run.status.success(), "{run:?}");
    assert!(dir.path().join("floodgate-steady.svg").is_file());
}

#[test]
fn plot_errors() {
    let run = floodgate(&["plot", "--pattern", "sideways"], "");
    run.failure(2);
    assert!(run.stderr.contains("sideways"), "{}", run.stderr);

    let run = floodgate(&["plot", "--limit", "0"], "");
    run.failure(2);
    assert!(run.stderr.contains("--limit"), "{}", run.stderr);

    let run = floodgate(&["plot", "--algorithms", "gcra,bogus"], "");
    run.failure(2);
    assert!(run.stderr.contains("bogus"), "{}", run.stderr);

    let run = floodgate(&["plot", "--algorithms", "gcra,gcra"], "");
    run.failure(2);
    assert!(run.stderr.contains("listed twice"), "{}", run.stderr);

    let run = floodgate(&["plot", "--limit", "1000000", "--pattern", "steady"], "");
    run.failure(2);
    assert!(run.stderr.contains("at most"), "{}", run.stderr);

    let run = floodgate(&["plot", "--out", "/nonexistent-dir/x.svg"], "");
    run.failure(1);
    assert!(
        run.stderr.contains("/nonexistent-dir/x.svg"),
        "{}",
        run.stderr
    );
}
