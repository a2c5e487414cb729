//! `floodgate bench` end to end against real `redis-server` processes: short runs (speed is
//! measured by the benchmark itself, never asserted here beyond "it made decisions").

mod common;

use common::floodgate;
use floodgate_testkit::{RedisCluster, RedisServer};
use serde_json::Value;

fn server() -> RedisServer {
    RedisServer::start().expect("redis-server starts (if it is missing, run scripts/install-redis)")
}

const SHORT: [&str; 8] = [
    "--duration",
    "1s",
    "--warmup",
    "200ms",
    "--concurrency",
    "8",
    "--keys",
    "1000",
];

/// The number in the first column of `name`'s table row (`ops/s`).
fn rate(table: &str, name: &str) -> f64 {
    let line = table
        .lines()
        .find(|l| l.starts_with(name))
        .unwrap_or_else(|| panic!("no row {name} in\n{table}"));
    line[name.len()..]
        .split_whitespace()
        .next()
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no rate in {line:?}"))
}

fn incr_keys_left(server: &RedisServer) -> usize {
    server
        .cmd(&["KEYS", "floodgate:bench-incr:*"])
        .expect("KEYS")
        .as_array()
        .expect("an array")
        .len()
}

/// `redis-benchmark` writes progress lines as it runs (about 1 KiB a second): more than a pipe
/// holds (64 KiB) on a long run. Read only at its end, it blocked on them and its rows were
/// skipped as too slow. A stand-in that writes 200 KB before its result is measured.
#[test]
fn a_chatty_redis_benchmark_is_read_while_it_runs() {
    let server = server();
    let table = bench_with_stand_in(
        &server,
        "#!/bin/sh\nhead -c 200000 /dev/zero | tr '\\0' 'x'\n\
         printf '\\r'\necho 'INCR: 123456.00 requests per second, p50=0.100 msec'\n",
    );
    assert!(
        (rate(&table, "redis-benchmark INCR -P 16") - 123_456.0).abs() < 1.0,
        "{table}"
    );
}

/// The INCR baselines' keys are created with a TTL, so that a run killed before it deletes
/// them leaves nothing behind for good. A stand-in `redis-benchmark` (run while the keys
/// exist) reports a key's PTTL as its rate.
#[test]
fn the_incr_baseline_keys_expire_by_themselves() {
    let server = server();
    let cli = floodgate_testkit::redis_cli_binary().expect("redis-cli");
    let script = format!(
        "#!/bin/sh\n\
         while [ $# -gt 0 ]; do case \"$1\" in -h) h=$2; shift;; -p) p=$2; shift;; esac; shift; done\n\
         t=$('{}' -h \"$h\" -p \"$p\" PTTL 'floodgate:bench-incr:{{bench-000000000000}}')\n\
         echo \"INCR: $t.00 requests per second, p50=0.100 msec\"\n",
        cli.display()
    );
    let table = bench_with_stand_in(&server, &script);
    let pttl = rate(&table, "redis-benchmark INCR -P 16");
    assert!(
        pttl > 3_000_000.0 && pttl <= 3_600_000.0,
        "the key's PTTL: {pttl} in\n{table}"
    );
    assert_eq!(incr_keys_left(&server), 0, "deleted at the end too");
}

/// `floodgate bench` (gcra, short) against `server`, with `script` as the `redis-benchmark` on
/// its PATH: the table it printed.
fn bench_with_stand_in(server: &RedisServer, script: &str) -> String {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().expect("temp dir");
    let fake = dir.path().join("redis-benchmark");
    std::fs::write(&fake, script).expect("write the stand-in");
    std::fs::set_permissions(&fake, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    let path = format!(
        "{}:{}",
        dir.path().display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let url = server.url();
    let mut args = vec!["bench", "--redis", &url, "--algorithm", "gcra"];
    args.extend_from_slice(&SHORT);
    let run = common::floodgate_env(&args, "", &[("PATH", &path)]);
    run.success();
    run.stdout.clone()
}

#[test]
fn bench_prints_a_table_with_baselines() {
    let server = server();
    let url = server.url();
    let mut args = vec!["bench", "--redis", &url, "--algorithm", "gcra"];
    args.extend_from_slice(&SHORT);
    let run = floodgate(&args, "");
    run.success();
    let table = &run.stdout;
    assert!(table.contains("gcra-10-per-1s"), "{table}");
    assert!(rate(table, "floodgate check") > 0.0, "{table}");
    assert!(rate(table, "EVALSHA, pipelined x16") > 0.0, "{table}");
    assert!(rate(table, "INCR, pipelined x16") > 0.0, "{table}");
    for header in [
        "ops/s", "allowed", "denied", "errors", "p50", "p99.9", "max",
    ] {
        assert!(table.contains(header), "{header}: {table}");
    }
    assert!(table.contains("floodgate/evalsha = "), "{table}");
    assert!(table.contains("floodgate/incr = "), "{table}");
    // redis-benchmark's rows: measured when it is installed, else said to be skipped.
    assert!(table.contains("redis-benchmark INCR -P 16"), "{table}");
    assert!(
        table.contains("CL.THROTTLE, pipelined") && table.contains("no redis-cell module"),
        "{table}"
    );
    assert_eq!(
        incr_keys_left(&server),
        0,
        "the INCR baseline's keys are deleted"
    );
}

#[test]
fn bench_json_parses_with_every_row() {
    let server = server();
    let url = server.url();
    let mut args = vec![
        "bench",
        "--redis",
        &url,
        "--policy",
        "100/s",
        "--json",
        "--threads",
        "1",
    ];
    args.extend_from_slice(&SHORT);
    let run = floodgate(&args, "");
    run.success();
    let report: Value = serde_json::from_str(run.stdout.trim()).expect("one JSON object");
    assert_eq!(report["policies"], serde_json::json!(["gcra-100-per-1s"]));
    assert_eq!(report["concurrency"], 8);
    assert_eq!(report["keys"], 1000);
    assert!(report["decisions_per_sec"].as_f64().expect("a rate") > 0.0);
    let fg = &report["floodgate"];
    let decided = fg["allowed"].as_u64().expect("allowed") + fg["denied"].as_u64().expect("denied");
    assert_eq!(fg["ops"].as_u64(), Some(decided));
    assert!(decided > 0);
    assert_eq!(fg["errors"], 0, "{fg}");
    for q in ["p50", "p90", "p99", "p99_9", "max"] {
        assert!(
            fg["latency_ms"][q].as_f64().expect("a latency") > 0.0,
            "{q}: {fg}"
        );
    }
    let p50 = fg["latency_ms"]["p50"].as_f64().unwrap_or_default();
    let max = fg["latency_ms"]["max"].as_f64().unwrap_or_default();
    assert!(p50 <= max, "{fg}");
    let baselines = report["baselines"].as_array().expect("baselines");
    let ids: Vec<&str> = baselines.iter().filter_map(|b| b["id"].as_str()).collect();
    assert_eq!(
        ids,
        [
            "evalsha_pipelined",
            "incr_pipelined",
            "redis_benchmark_incr",
            "redis_benchmark_evalsha",
            "cell_pipelined"
        ]
    );
    // The test servers have no redis-cell module: the native baseline says so.
    let cell = &baselines[4];
    let why = cell["skipped"].as_str().expect("skipped");
    assert!(why.contains("no redis-cell module"), "{cell}");
    for b in &baselines[..2] {
        assert!(b["ops_per_sec"].as_f64().expect("a rate") > 0.0, "{b}");
        assert_eq!(b["errors"], 0, "{b}");
        assert!(b["floodgate_ratio"].as_f64().expect("a ratio") > 0.0, "{b}");
    }
    for b in &baselines[2..4] {
        // Either measured or skipped with a reason (redis-benchmark not installed).
        let measured = b["ops_per_sec"].as_f64().unwrap_or_default() > 0.0;
        assert!(measured || b["skipped"].is_string(), "{b}");
    }
    let ratios = report["ratios"].as_object().expect("ratios");
    assert!(
        ratios.contains_key("floodgate_per_evalsha_pipelined"),
        "{report}"
    );
    assert!(
        ratios.contains_key("floodgate_per_incr_pipelined"),
        "{report}"
    );
    assert_eq!(incr_keys_left(&server), 0);

    // --no-baselines: floodgate only.
    let mut args = vec![
        "bench",
        "--redis",
        &url,
        "--algorithm",
        "sliding_log",
        "--json",
        "--no-baselines",
        "--no-batching",
    ];
    args.extend_from_slice(&SHORT);
    let run = floodgate(&args, "");
    run.success();
    let report: Value = serde_json::from_str(run.stdout.trim()).expect("one JSON object");
    assert_eq!(report["baselines"], serde_json::json!([]));
    assert_eq!(report["batching"], "off");
    assert!(report["decisions_per_sec"].as_f64().expect("a rate") > 0.0);

    // Without baselines no table of keys is built: a trillion keys run as well (building
    // them aborted the process). With baselines, that many is refused up front.
    let mut args = vec![
        "bench",
        "--redis",
        &url,
        "--json",
        "--no-baselines",
        "--keys",
        "1000000000000",
    ];
    args.extend_from_slice(&SHORT[..6]);
    let run = floodgate(&args, "");
    run.success();
    let report: Value = serde_json::from_str(run.stdout.trim()).expect("one JSON object");
    assert_eq!(report["keys"], 1_000_000_000_000_u64);
    assert!(report["decisions_per_sec"].as_f64().expect("a rate") > 0.0);
    let mut args = vec!["bench", "--redis", &url, "--keys", "1000000000000"];
    args.extend_from_slice(&SHORT[..6]);
    let run = floodgate(&args, "");
    run.failure(2);
    assert!(run.stderr.contains("--no-baselines"), "{run:#?}");
}

#[test]
fn bench_fails_when_redis_is_unreachable() {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .expect("bind")
        .local_addr()
        .expect("addr")
        .port();
    let url = format!("redis://:secret@127.0.0.1:{port}");
    let run = floodgate(&["bench", "--redis", &url, "--duration", "1s"], "");
    run.failure(1);
    assert!(run.stderr.contains("127.0.0.1"), "{run:#?}");
    assert!(!run.stderr.contains("secret"), "{run:#?}");
}

/// Batch flags that cannot work together are refused before connecting (nothing listens on
/// the port), in the flags' own words.
#[test]
fn bench_refuses_a_batch_window_as_long_as_the_timeout() {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .expect("bind")
        .local_addr()
        .expect("addr")
        .port();
    let url = format!("redis://127.0.0.1:{port}");
    let run = floodgate(
        &[
            "bench",
            "--redis",
            &url,
            "--batch-window",
            "1s",
            "--timeout",
            "1s",
        ],
        "",
    );
    run.failure(2);
    assert!(run.stderr.contains("--batch-window"), "{run:#?}");
    assert!(run.stderr.contains("window (1s)"), "{run:#?}");
}

#[test]
fn bench_on_a_cluster() {
    let cluster = RedisCluster::builder()
        .replicas_per_master(0)
        .start()
        .expect(
            "a local Redis Cluster starts (if redis-server is missing, run scripts/install-redis)",
        );
    let url = cluster.urls()[0].clone();
    let mut args = vec!["bench", "--redis", &url, "--cluster", "--json"];
    args.extend_from_slice(&SHORT);
    let run = floodgate(&args, "");
    run.success();
    let report: Value = serde_json::from_str(run.stdout.trim()).expect("one JSON object");
    assert_eq!(report["connection"], "cluster");
    assert!(report["decisions_per_sec"].as_f64().expect("a rate") > 0.0);
    assert_eq!(report["floodgate"]["errors"], 0, "{report}");
    let baselines = report["baselines"].as_array().expect("baselines");
    for b in &baselines[..2] {
        assert!(b["ops_per_sec"].as_f64().expect("a rate") > 0.0, "{b}");
        assert_eq!(b["errors"], 0, "{b}");
    }
    assert!(
        baselines[2]["skipped"].is_string(),
        "redis-benchmark is not run on a cluster"
    );
    for node in cluster.nodes() {
        let left = node
            .cmd(&["KEYS", "floodgate:bench-incr:*"])
            .expect("KEYS")
            .as_array()
            .expect("an array")
            .len();
        assert_eq!(left, 0, "INCR keys left on {}", node.port());
    }
}
