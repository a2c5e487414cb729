//! `floodgate simulate` end to end: the built binary, events on stdin, JSON on stdout.
//!
//! The expected lines are worked out by hand from the algorithms in floodgate-core (the
//! arithmetic is in the comments), not copied from the program's output.

mod common;

use common::floodgate;

/// Runs `floodgate simulate args...` over `input` and checks every output line.
fn expect(args: &[&str], input: &str, expected: &[&str]) {
    let mut full = vec!["simulate"];
    full.extend_from_slice(args);
    let run = floodgate(&full, input);
    run.success();
    assert_eq!(run.lines(), expected, "floodgate {full:?}");
}

/// A decision line with redis-cell's five fields.
fn d(allowed: bool, limit: u64, remaining: u64, retry: Option<u64>, reset: u64) -> String {
    let retry = retry.map_or("null".to_string(), |r| r.to_string());
    format!(
        "{{\"allowed\":{allowed},\"limit\":{limit},\"remaining\":{remaining},\
         \"retry_after_ms\":{retry},\"reset_after_ms\":{reset}}}"
    )
}

fn strs(lines: &[String]) -> Vec<&str> {
    lines.iter().map(String::as_str).collect()
}

#[test]
fn gcra_reproduces_redis_cell_readme() {
    // CL.THROTTLE user123 15 30 60 1 -> 0 16 15 -1 2: T = 2 s, tau = 32 s.
    let args = ["--algorithm", "gcra", "--max-burst", "15", "--count", "30"];
    let args = [&args[..], &["--period", "60s"]].concat();
    let run = floodgate(&[&["simulate"], &args[..]].concat(), "0 user123\n");
    run.success();
    assert_eq!(
        run.lines(),
        [
            r#"{"allowed":true,"limit":16,"remaining":15,"retry_after_ms":null,"reset_after_ms":2000}"#
        ]
    );

    // 16 at the same instant drain the burst; the 17th waits one emission interval.
    let input = "0 user123\n".repeat(17);
    let mut want: Vec<String> = (0..16)
        .map(|i| d(true, 16, 15 - i, None, 2000 * (i + 1)))
        .collect();
    want.push(d(false, 16, 0, Some(2000), 32000));
    expect(&args, &input, &strs(&want));
}

#[test]
fn gcra_matches_redis_cell_table() {
    // Limit 5 (max_burst 4), 1 per second; quantity 6 never fits, 0 peeks.
    let input = "0 k 6\n0 k\n0 k\n0 k\n0 k\n0 k\n0 k\n3000 k\n3100 k\n4000 k\n8000 k\n\
                 9500 k\n9500 k 0\n9500 k 2\n9500 k 5\n";
    let want = [
        d(false, 5, 5, None, 0),
        d(true, 5, 4, None, 1000),
        d(true, 5, 3, None, 2000),
        d(true, 5, 2, None, 3000),
        d(true, 5, 1, None, 4000),
        d(true, 5, 0, None, 5000),
        d(false, 5, 0, Some(1000), 5000),
        d(true, 5, 2, None, 3000),
        d(true, 5, 1, None, 3900),
        d(true, 5, 1, None, 4000),
        d(true, 5, 4, None, 1000),
        d(true, 5, 4, None, 1000),
        d(true, 5, 4, None, 1000),
        d(true, 5, 2, None, 3000),
        d(false, 5, 2, Some(3000), 3000),
    ];
    let args = [
        "-a",
        "gcra",
        "--max-burst",
        "4",
        "--count",
        "1",
        "--period",
        "1s",
    ];
    expect(&args, input, &strs(&want));
}

#[test]
fn fixed_window_rolling() {
    // The window opens at the first request: [0, 1000), then [1000, 2000).
    let want = [
        d(true, 2, 1, None, 1000),
        d(true, 2, 0, None, 800),
        d(false, 2, 0, Some(600), 600),
        d(true, 2, 1, None, 1000),
        // Cost 2 fits in a later window; cost 3 never does.
        d(false, 2, 1, Some(500), 500),
        d(false, 2, 1, None, 500),
    ];
    let args = ["-a", "fixed_window", "--limit", "2", "--window", "1s"];
    expect(
        &args,
        "0 a\n200 a\n400 a\n1000 a\n1500 a 2\n1500 a 3\n",
        &strs(&want),
    );
}

#[test]
fn fixed_window_calendar_with_utc_offset() {
    // t=0 is 1970-01-01T00:00Z = 08:00 at +08:00; that local day ends at 16:00Z (57 600 000 ms).
    let want = [
        d(true, 1, 0, None, 57_600_000),
        d(false, 1, 0, Some(57_599_000), 57_599_000),
        d(true, 1, 0, None, 86_400_000),
    ];
    let args = ["-a", "fixed_window", "--limit", "1", "--calendar", "day"];
    let args = [&args[..], &["--utc-offset", "+08:00"]].concat();
    expect(&args, "0 a\n1000 a\n57600000 a\n", &strs(&want));

    // Calendar minutes from the epoch (a minute boundary), in UTC.
    let want = [
        d(true, 2, 1, None, 60_000),
        d(true, 2, 0, None, 30_000),
        d(false, 2, 0, Some(15_000), 15_000),
        d(true, 2, 1, None, 60_000),
    ];
    let args = ["-a", "fixed", "--limit", "2", "--calendar", "minute"];
    expect(&args, "0 a\n30000 a\n45000 a\n60000 a\n", &strs(&want));
}

#[test]
fn sliding_log() {
    let want = [
        d(true, 2, 1, None, 1000),
        d(true, 2, 0, None, 1000),
        // Full: the entry at 0 leaves at 1000 (retry 400); the newest at 1400 (reset 800).
        d(false, 2, 0, Some(400), 800),
        // The entry at 0 is gone at exactly 1000.
        d(true, 2, 0, None, 1000),
        d(false, 2, 0, Some(300), 900),
    ];
    let args = ["-a", "sliding_log", "--limit", "2", "--window", "1s"];
    expect(&args, "0 a\n400 a\n600 a\n1000 a\n1100 a\n", &strs(&want));
}

#[test]
fn sliding_window() {
    // Windows at multiples of 1 s; the previous window weighs (1000 - elapsed) / 1000.
    let want = [
        d(true, 4, 0, None, 2000),
        // Next window, prev 4 must weigh <= 3: from 250 ms in, at 1250.
        d(false, 4, 0, Some(1150), 1900),
        // At 1250 prev weighs 4 * 0.75 = 3: one fits.
        d(true, 4, 0, None, 1750),
        // Two need prev to weigh <= 2: at 1500.
        d(false, 4, 0, Some(250), 1750),
        d(true, 4, 0, None, 1500),
        // At 2600 prev (2) weighs 0.8: 4 - 0.8 - 1 leaves 2.
        d(true, 4, 2, None, 1400),
    ];
    let args = ["-a", "sliding_window", "--limit", "4", "--window", "1s"];
    let input = "0 a 4\n100 a\n1250 a\n1250 a\n1500 a\n2600 a\n";
    expect(&args, input, &strs(&want));
}

#[test]
fn token_bucket() {
    // 3 tokens, one more every second.
    let want = [
        d(true, 3, 0, None, 3000),
        d(false, 3, 0, Some(500), 2500),
        d(true, 3, 0, None, 3000),
        d(true, 3, 0, None, 2500),
        d(true, 3, 2, None, 1000),
    ];
    let args = ["-a", "token_bucket", "--capacity", "3", "--refill", "1"];
    let args = [&args[..], &["--interval", "1s"]].concat();
    expect(
        &args,
        "0 a 3\n500 a\n1000 a\n2500 a\n5000 a\n",
        &strs(&want),
    );

    // Intervally: both tokens come back at once, a full interval after the bucket emptied.
    let want = [
        d(true, 2, 0, None, 1000),
        d(false, 2, 0, Some(1), 1),
        d(true, 2, 1, None, 1000),
    ];
    let args = ["-a", "token", "--capacity", "2", "--refill", "2"];
    let args = [&args[..], &["--interval", "1s", "--intervally"]].concat();
    expect(&args, "0 a 2\n999 a\n1000 a\n", &strs(&want));
}

#[test]
fn leaky_bucket_alias_funnel() {
    // Capacity 2 draining in 2 s: one unit drains per second.
    let want = [
        d(true, 2, 1, None, 1000),
        d(true, 2, 0, None, 2000),
        d(false, 2, 0, Some(500), 1500),
        d(true, 2, 0, None, 2000),
    ];
    let args = ["--algorithm", "funnel", "--capacity", "2", "--drain", "2s"];
    expect(&args, "0 a\n0 a\n500 a\n1000 a\n", &strs(&want));
    let args = [
        "--algorithm",
        "leaky_bucket",
        "--capacity",
        "2",
        "--drain",
        "2s",
    ];
    expect(&args, "0 a\n0 a\n500 a\n1000 a\n", &strs(&want));
}

#[test]
fn shaper_waits_for_its_turn() {
    // One every 100 ms; willing to wait 350 ms, so 4 fit (limit 1 + 350 / 100).
    let want = [
        r#"{"allowed":true,"limit":4,"remaining":3,"retry_after_ms":null,"reset_after_ms":100,"wait_ms":0}"#,
        r#"{"allowed":true,"limit":4,"remaining":2,"retry_after_ms":null,"reset_after_ms":200,"wait_ms":100}"#,
        r#"{"allowed":true,"limit":4,"remaining":1,"retry_after_ms":null,"reset_after_ms":300,"wait_ms":200}"#,
        r#"{"allowed":true,"limit":4,"remaining":0,"retry_after_ms":null,"reset_after_ms":400,"wait_ms":300}"#,
        // Would wait 400 ms: 50 ms too long.
        r#"{"allowed":false,"limit":4,"remaining":0,"retry_after_ms":50,"reset_after_ms":400,"wait_ms":0}"#,
    ];
    let args = ["-a", "shaper", "--count", "10", "--period", "1s"];
    let args = [&args[..], &["--max-wait", "350ms"]].concat();
    expect(&args, &"0 a\n".repeat(5), &want);

    // With a burst of 2 and no waiting it admits what GCRA with max_burst 1 admits.
    let want = [
        r#"{"allowed":true,"limit":2,"remaining":1,"retry_after_ms":null,"reset_after_ms":500,"wait_ms":0}"#,
        r#"{"allowed":true,"limit":2,"remaining":0,"retry_after_ms":null,"reset_after_ms":1000,"wait_ms":0}"#,
        r#"{"allowed":false,"limit":2,"remaining":0,"retry_after_ms":500,"reset_after_ms":1000,"wait_ms":0}"#,
    ];
    let args = [
        "-a", "shaper", "--count", "2", "--period", "1s", "--burst", "2",
    ];
    expect(&args, &"0 a\n".repeat(3), &want);
}

#[test]
fn concurrency_leases_and_releases() {
    let want = [
        r#"{"allowed":true,"limit":2,"remaining":1,"retry_after_ms":null,"reset_after_ms":10000,"lease":1}"#,
        r#"{"allowed":true,"limit":2,"remaining":0,"retry_after_ms":null,"reset_after_ms":10000,"lease":2}"#,
        // Full until lease 1 lapses at 10 s; the last lease lapses at 11 s.
        r#"{"allowed":false,"limit":2,"remaining":0,"retry_after_ms":8000,"reset_after_ms":9000,"lease":null}"#,
        r#"{"released":true}"#,
        r#"{"allowed":true,"limit":2,"remaining":0,"retry_after_ms":null,"reset_after_ms":10000,"lease":3}"#,
        r#"{"allowed":true,"limit":2,"remaining":1,"retry_after_ms":null,"reset_after_ms":10000,"lease":4}"#,
        // At 12 s lease 2 has lapsed; lease 3 (until 13 s) is released; then none is left.
        r#"{"released":true}"#,
        r#"{"released":false}"#,
    ];
    let args = ["-a", "concurrency", "--limit", "2", "--lease-ttl", "10s"];
    let input = "0 a\n1000 a\n2000 a\n3000 a release\n3000 a\n4000 b\n\
                 12000 a release\n12000 a release\n";
    expect(&args, input, &want);
}

#[test]
fn policy_strings() {
    // "2/s" is GCRA: 2 at once, then one every 500 ms.
    let want = [
        d(true, 2, 1, None, 500),
        d(true, 2, 0, None, 1000),
        d(false, 2, 0, Some(500), 1000),
    ];
    expect(&["--policy", "2/s"], "0 a\n0 a\n0 a\n", &strs(&want));
}

#[test]
fn several_policies_are_all_or_nothing() {
    let log = r#"{"policy":"log-3-per-10s","allowed":true,"limit":3"#;
    let want = [
        // Both allow: both count. The summary is the stricter (less remaining).
        format!(
            "{{\"allowed\":true,\"limit\":1,\"remaining\":0,\"retry_after_ms\":null,\"reset_after_ms\":1000,\
             \"policies\":[{log},\"remaining\":2,\"retry_after_ms\":null,\"reset_after_ms\":10000}},\
             {{\"policy\":\"fixed-1-per-1s\",\"allowed\":true,\"limit\":1,\"remaining\":0,\"retry_after_ms\":null,\"reset_after_ms\":1000}}]}}"
        ),
        // The fixed window denies, so the log counts nothing: still 2 remaining.
        format!(
            "{{\"allowed\":false,\"limit\":1,\"remaining\":0,\"retry_after_ms\":500,\"reset_after_ms\":500,\
             \"policies\":[{log},\"remaining\":2,\"retry_after_ms\":null,\"reset_after_ms\":9500}},\
             {{\"policy\":\"fixed-1-per-1s\",\"allowed\":false,\"limit\":1,\"remaining\":0,\"retry_after_ms\":500,\"reset_after_ms\":500}}]}}"
        ),
        // Only two have been counted by the log.
        format!(
            "{{\"allowed\":true,\"limit\":1,\"remaining\":0,\"retry_after_ms\":null,\"reset_after_ms\":1000,\
             \"policies\":[{log},\"remaining\":1,\"retry_after_ms\":null,\"reset_after_ms\":10000}},\
             {{\"policy\":\"fixed-1-per-1s\",\"allowed\":true,\"limit\":1,\"remaining\":0,\"retry_after_ms\":null,\"reset_after_ms\":1000}}]}}"
        ),
    ];
    let args = ["--policy", "log:3/10s", "--policy", "fixed:1/1s"];
    expect(&args, "0 a\n500 a\n1000 a\n", &strs(&want));
    // The same with one --policy and ';'.
    expect(
        &["--policy", "log:3/10s; fixed:1/1s"],
        "0 a\n500 a\n1000 a\n",
        &strs(&want),
    );
}

#[test]
fn start_sets_the_absolute_time() {
    // Calendar minutes: starting 59 s into a minute, the window ends 1 s later.
    let args = ["-a", "fixed_window", "--limit", "1", "--calendar", "minute"];
    let args = [&args[..], &["--start", "1700000039000"]].concat();
    let want = [d(true, 1, 0, None, 1000), d(true, 1, 0, None, 60_000)];
    expect(&args, "0 a\n1000 a\n", &strs(&want));
}

#[test]
fn blank_lines_and_comments_are_skipped() {
    let args = ["-a", "sliding_log", "--limit", "1", "--window", "1s"];
    let input = "# a trace\n\n0 a # first\n   \n0 b\n";
    let want = [d(true, 1, 0, None, 1000), d(true, 1, 0, None, 1000)];
    expect(&args, input, &strs(&want));
}

fn simulate_fails(args: &[&str], input: &str, code: i32) -> (Vec<String>, String) {
    let mut full = vec!["simulate"];
    full.extend_from_slice(args);
    let run = floodgate(&full, input);
    run.failure(code);
    (
        run.lines().into_iter().map(str::to_owned).collect(),
        run.stderr,
    )
}

const FW: [&str; 6] = ["-a", "fixed_window", "--limit", "5", "--window", "1s"];

#[test]
fn missing_and_conflicting_flags() {
    let (_, err) = simulate_fails(&["-a", "gcra", "--count", "1", "--period", "1s"], "", 2);
    assert!(
        err.contains("--max-burst is required for --algorithm gcra"),
        "{err}"
    );
    let (_, err) = simulate_fails(&["-a", "token_bucket", "--capacity", "1"], "", 2);
    assert!(err.contains("--refill is required"), "{err}");
    let (_, err) = simulate_fails(&["-a", "sliding_log", "--limit", "1"], "", 2);
    assert!(err.contains("--window is required"), "{err}");
    let (_, err) = simulate_fails(&[&FW[..], &["--calendar", "day"]].concat(), "", 2);
    assert!(
        err.contains("--window and --calendar cannot be used together"),
        "{err}"
    );
    let (_, err) = simulate_fails(&[&FW[..], &["--period", "1s"]].concat(), "", 2);
    assert!(
        err.contains("--period does not apply to --algorithm fixed_window"),
        "{err}"
    );
    let (_, err) = simulate_fails(&[&FW[..], &["--units", "2"]].concat(), "", 2);
    assert!(
        err.contains("--units only applies with --calendar"),
        "{err}"
    );
    let (_, err) = simulate_fails(&["--policy", "5/s", "--limit", "3"], "", 2);
    assert!(
        err.contains("--limit cannot be used with --policy"),
        "{err}"
    );
    let (_, err) = simulate_fails(&["--policy", "5/s", "-a", "gcra"], "", 2);
    assert!(err.contains("cannot be used with"), "{err}");
    let (_, err) = simulate_fails(&["--policy", "5/s", "--max-wait", "1s"], "", 2);
    assert!(err.contains("--max-wait only applies to shaper"), "{err}");
    let (_, err) = simulate_fails(&["--policy", "5/s", "--policy", "5/s"], "", 2);
    assert!(err.contains("given twice"), "{err}");
    let (_, err) = simulate_fails(&[], "", 2);
    assert!(
        err.contains("--algorithm") && err.contains("--policy"),
        "{err}"
    );
}

#[test]
fn unknown_algorithm_and_bad_values() {
    let (_, err) = simulate_fails(&["--algorithm", "bogus", "--limit", "1"], "", 2);
    assert!(err.contains("bogus"), "{err}");
    assert!(err.contains("sliding_log"), "lists the algorithms: {err}");
    let (_, err) = simulate_fails(
        &["-a", "sliding_log", "--limit", "1", "--window", "5"],
        "",
        2,
    );
    assert!(err.contains("--window") && err.contains("unit"), "{err}");
    let (_, err) = simulate_fails(&["-a", "fixed_window", "--limit", "x"], "", 2);
    assert!(err.contains("--limit"), "{err}");
}

#[test]
fn policy_validation_errors_name_the_field() {
    let (_, err) = simulate_fails(
        &[
            "-a",
            "gcra",
            "--max-burst",
            "1",
            "--count",
            "0",
            "--period",
            "1s",
        ],
        "",
        2,
    );
    assert!(err.contains("count must be greater than zero"), "{err}");
    let (_, err) = simulate_fails(
        &["-a", "fixed_window", "--limit", "0", "--window", "1s"],
        "",
        2,
    );
    assert!(err.contains("limit must be greater than zero"), "{err}");
    let (_, err) = simulate_fails(
        &[
            "-a",
            "fixed",
            "--limit",
            "1",
            "--calendar",
            "minute",
            "--units",
            "7",
        ],
        "",
        2,
    );
    assert!(err.contains("calendar units"), "{err}");
    let (_, err) = simulate_fails(&["--policy", "10/fortnight"], "", 2);
    assert!(err.contains("unknown time unit \"fortnight\""), "{err}");
}

#[test]
fn bad_lines_name_the_line_and_keep_earlier_output() {
    let (out, err) = simulate_fails(&FW, "0 a\n1 a x\n2 a\n", 1);
    assert_eq!(out, [d(true, 5, 4, None, 1000)]);
    assert!(
        err.contains("line 2: cost \"x\" is not a whole number"),
        "{err}"
    );

    let (out, err) = simulate_fails(&FW, "0 a\n# comment\nsoon a\n", 1);
    assert_eq!(out.len(), 1);
    assert!(
        err.contains("line 3: time \"soon\" is not a whole number of milliseconds"),
        "{err}"
    );

    let (out, err) = simulate_fails(&FW, "0 a\n1\n", 1);
    assert_eq!(out.len(), 1);
    assert!(err.contains("line 2: missing the key"), "{err}");

    let (out, err) = simulate_fails(&FW, "0 a 1 2\n", 1);
    assert!(out.is_empty());
    assert!(err.contains("line 1: unexpected \"2\""), "{err}");

    let (out, err) = simulate_fails(&FW, "0 a release\n", 1);
    assert!(out.is_empty());
    assert!(
        err.contains("line 1: `release` only applies to concurrency"),
        "{err}"
    );
}

#[test]
fn time_going_backwards_is_an_error() {
    let (out, err) = simulate_fails(&FW, "0 a\n10 a\n\n5 a\n20 a\n", 1);
    assert_eq!(out, [d(true, 5, 4, None, 1000), d(true, 5, 3, None, 990)]);
    assert!(
        err.contains("line 4: time 5 goes backwards (previous 10)"),
        "{err}"
    );
    assert!(!err.contains("panicked"), "{err}");
}

#[test]
fn help_documents_every_algorithm_and_the_input() {
    let run = floodgate(&["simulate", "--help"], "");
    run.success();
    for name in [
        "fixed_window",
        "sliding_log",
        "sliding_window",
        "token_bucket",
        "leaky_bucket",
        "funnel",
        "gcra",
        "shaper",
        "concurrency",
    ] {
        assert!(run.stdout.contains(name), "--help lacks {name}");
    }
    for flag in [
        "--max-burst",
        "--calendar",
        "--utc-offset",
        "--intervally",
        "--drain",
        "--max-wait",
        "--lease-ttl",
        "--start",
        "<t_ms> <key> [cost]",
        "release",
    ] {
        assert!(run.stdout.contains(flag), "--help lacks {flag}");
    }
}

#[test]
fn help_example_is_true() {
    // The worked example in --help, run for real.
    let help = floodgate(&["simulate", "--help"], "").stdout;
    let want: Vec<&str> = help
        .lines()
        .skip_while(|l| !l.contains("floodgate simulate --algorithm gcra --max-burst 1"))
        .skip(1)
        .take_while(|l| l.trim_start().starts_with('{'))
        .map(str::trim)
        .collect();
    assert_eq!(want.len(), 5, "{help}");
    let args = [
        "-a",
        "gcra",
        "--max-burst",
        "1",
        "--count",
        "1",
        "--period",
        "1s",
    ];
    expect(
        &args,
        "0 alice\n0 alice\n0 alice\n500 alice\n1000 alice\n",
        &want,
    );
}

#[test]
fn times_past_what_the_algorithms_hold_exactly_are_refused_with_their_line() {
    // Past 2^53 µs the arithmetic would overflow (a panic, or every request allowed).
    let (out, err) = simulate_fails(&["--policy", "10/s"], "0 k\n18446744073709551 k\n", 1);
    assert_eq!(out.len(), 1);
    assert!(
        err.contains("line 2: time 18446744073709551 is too far in the future"),
        "{err}"
    );
    // 136 years after the start (the epoch): past 2106, where the memory store's expiry times run
    // out (before, the line was taken and the store refused it).
    let (out, err) = simulate_fails(&["--policy", "10/s"], "0 k\n4300000000000 k\n", 1);
    assert_eq!(out.len(), 1);
    assert!(
        err.contains("line 2: time 4300000000000 is too far in the future"),
        "{err}"
    );
}

#[test]
fn zero_durations_are_accepted_where_they_mean_none() {
    // A 0 s maximum wait: decide now.
    expect(
        &[
            "-a",
            "shaper",
            "--count",
            "1",
            "--period",
            "1s",
            "--max-wait",
            "0s",
        ],
        "0 k\n0 k\n",
        &[
            r#"{"allowed":true,"limit":1,"remaining":0,"retry_after_ms":null,"reset_after_ms":1000,"wait_ms":0}"#,
            r#"{"allowed":false,"limit":1,"remaining":0,"retry_after_ms":1000,"reset_after_ms":1000,"wait_ms":0}"#,
        ],
    );
}
