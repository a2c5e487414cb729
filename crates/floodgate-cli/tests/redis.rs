//! `floodgate check`, `inspect` and `reset` end to end: the built binary against real
//! `redis-server` processes started by floodgate-testkit.

mod common;

use std::net::TcpListener;
use std::time::{Duration, Instant};

use common::{Run, floodgate};
use floodgate_testkit::{RedisCluster, RedisServer};
use serde_json::Value;

fn server() -> RedisServer {
    RedisServer::start().expect("redis-server starts (if it is missing, run scripts/install-redis)")
}

/// Runs `floodgate <sub> --redis <url> <args...>`.
fn run(sub: &str, url: &str, args: &[&str]) -> Run {
    let mut full = vec![sub, "--redis", url];
    full.extend_from_slice(args);
    floodgate(&full, "")
}

/// The JSON a successful run printed.
fn json(run: &Run) -> Value {
    run.success();
    serde_json::from_str(run.stdout.trim()).unwrap_or_else(|e| panic!("{e}: {run:#?}"))
}

fn int(v: &Value, field: &str) -> i64 {
    v[field]
        .as_i64()
        .unwrap_or_else(|| panic!("{field} is not an integer in {v}"))
}

#[test]
fn check_allows_up_to_the_limit_then_denies_with_a_retry_time() {
    let server = server();
    let url = server.url();
    for i in 0..3 {
        let d = json(&run("check", &url, &["--policy", "3/hour", "alice"]));
        assert_eq!(d["allowed"], true, "call {i}: {d}");
        assert_eq!(int(&d, "limit"), 3);
        assert_eq!(int(&d, "remaining"), 2 - i);
        assert!(d["retry_after_ms"].is_null(), "{d}");
        assert!(int(&d, "reset_after_ms") > 0, "{d}");
        assert_eq!(d["key"], "floodgate:gcra:gcra-3-per-1h:{alice}");
        assert_eq!(d["policy"], "gcra-3-per-1h");
        assert!(int(&d, "server_time_us") > 1_600_000_000_000_000, "{d}");
        assert_eq!(d["connection"], "multiplexed");
        assert_eq!(
            d["redis_cell"], false,
            "a plain redis-server has no CL.THROTTLE"
        );
    }
    let denied = json(&run("check", &url, &["--policy", "3/hour", "alice"]));
    assert_eq!(denied["allowed"], false, "{denied}");
    assert_eq!(int(&denied, "remaining"), 0);
    // One emission interval (20 minutes) minus the few milliseconds since the first call.
    let retry = int(&denied, "retry_after_ms");
    assert!(retry > 19 * 60_000 && retry <= 20 * 60_000, "{denied}");
    // The state is really in Redis: another key is untouched, and the key has a TTL.
    let other = json(&run("check", &url, &["--policy", "3/hour", "bob"]));
    assert_eq!(int(&other, "remaining"), 2);
    let ttl = server
        .cmd(&["PTTL", "floodgate:gcra:gcra-3-per-1h:{alice}"])
        .expect("PTTL")
        .as_int()
        .expect("an integer");
    assert!(ttl > 0, "{ttl}");
}

#[test]
fn check_takes_algorithm_flags_cost_and_prefix() {
    let server = server();
    let url = server.url();
    let args = [
        "--algorithm",
        "fixed_window",
        "--limit",
        "5",
        "--window",
        "1h",
        "--prefix",
        "sms",
        "--cost",
        "2",
        "+8613800000000",
    ];
    let first = json(&run("check", &url, &args));
    assert_eq!(first["allowed"], true);
    assert_eq!(int(&first, "remaining"), 3);
    assert_eq!(first["key"], "sms:fw:fixed-5-per-1h:{+8613800000000}");
    json(&run("check", &url, &args));
    let third = json(&run("check", &url, &args));
    assert_eq!(third["allowed"], false, "{third}");
    assert_eq!(int(&third, "remaining"), 1);
    assert!(int(&third, "retry_after_ms") > 0, "{third}");
    // Cost 0 peeks.
    let peek = json(&run(
        "check",
        &url,
        &[&args[..8], &["--cost", "0", "+8613800000000"]].concat(),
    ));
    assert_eq!(int(&peek, "remaining"), 1);
}

#[test]
fn check_of_two_policies_is_all_or_nothing() {
    let server = server();
    let url = server.url();
    let args = ["--policy", "5/hour", "--policy", "fixed:2/h", "carol"];
    for _ in 0..2 {
        let d = json(&run("check", &url, &args));
        assert_eq!(d["allowed"], true, "{d}");
    }
    let d = json(&run("check", &url, &args));
    assert_eq!(d["allowed"], false, "{d}");
    let policies = d["policies"].as_array().expect("policies");
    assert_eq!(policies.len(), 2, "{d}");
    assert_eq!(policies[0]["policy"], "gcra-5-per-1h");
    assert_eq!(policies[0]["key"], "floodgate:gcra:gcra-5-per-1h:{carol}");
    assert_eq!(policies[1]["key"], "floodgate:fw:fixed-2-per-1h:{carol}");
    // The denied call counted nothing against the GCRA policy: 5 - 2 = 3 left.
    assert_eq!(policies[0]["allowed"], true);
    assert_eq!(int(&policies[0], "remaining"), 3);
    assert_eq!(policies[1]["allowed"], false);
    // The top-level fields are the strictest policy's, with its key.
    assert_eq!(d["key"], "floodgate:fw:fixed-2-per-1h:{carol}");
    assert!(int(&d, "retry_after_ms") > 0, "{d}");
}

#[test]
fn a_corrupted_key_fails_naming_the_key() {
    let server = server();
    let url = server.url();
    let key = "floodgate:gcra:gcra-3-per-1h:{mallory}";
    server.cmd_ok(&["SET", key, "garbage"]).expect("SET");
    let run = run("check", &url, &["--policy", "3/hour", "mallory"]);
    run.failure(1);
    assert!(run.stdout.is_empty(), "{run:#?}");
    assert!(run.stderr.contains(key), "{run:#?}");
    assert!(run.stderr.contains("corrupted"), "{run:#?}");
    // Nothing was changed.
    let value = server.cmd(&["GET", key]).expect("GET");
    assert_eq!(value.as_str(), Some("garbage"));

    // Another Redis type in the key.
    let key = "floodgate:gcra:gcra-3-per-1h:{trudy}";
    server.cmd_ok(&["HSET", key, "a", "1"]).expect("HSET");
    let run = self::run("check", &url, &["--policy", "3/hour", "trudy"]);
    run.failure(1);
    assert!(run.stderr.contains(key), "{run:#?}");
    assert!(run.stderr.contains("wrong type"), "{run:#?}");
    // inspect still shows the raw content (that is what it is for), and says what is wrong.
    let inspected = self::run("inspect", &url, &["--policy", "3/hour", "trudy"]);
    inspected.failure(1);
    let state: Value = serde_json::from_str(inspected.stdout.trim()).expect("JSON");
    assert_eq!(state["type"], "hash", "{state}");
    assert_eq!(state["fields"]["a"], 1, "{state}");
    assert!(state["decision"].is_null(), "{state}");
    assert!(inspected.stderr.contains(key), "{inspected:#?}");
}

#[test]
fn an_unreachable_server_fails_fast_without_the_password() {
    let port = {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
        listener.local_addr().expect("addr").port()
    };
    let url = format!("redis://user:secret@127.0.0.1:{port}");
    for sub in ["check", "inspect", "reset"] {
        let started = Instant::now();
        let run = run(sub, &url, &["--policy", "3/hour", "alice"]);
        let took = started.elapsed();
        run.failure(1);
        assert!(took < Duration::from_secs(5), "{sub} took {took:?}");
        let shown = format!("redis://user:***@127.0.0.1:{port}");
        assert!(run.stderr.contains(&shown), "{sub}: {run:#?}");
        assert!(!run.stderr.contains("secret"), "{sub}: {run:#?}");
        assert!(!run.stdout.contains("secret"), "{sub}: {run:#?}");
    }
    // A bad URL is a usage error, also without the password.
    let run = floodgate(
        &["check", "--redis", "http://u:secret@h:1", "-p", "1/s", "k"],
        "",
    );
    run.failure(2);
    assert!(!run.stderr.contains("secret"), "{run:#?}");
    // REDIS_URL is read, and --help does not show its value.
    let help = std::process::Command::new(env!("CARGO_BIN_EXE_floodgate"))
        .args(["check", "--help"])
        .env("REDIS_URL", "redis://:hunter2@example:6379")
        .output()
        .expect("runs");
    let help = String::from_utf8_lossy(&help.stdout);
    assert!(help.contains("REDIS_URL"), "{help}");
    assert!(!help.contains("hunter2"), "{help}");
}

#[test]
fn inspect_shows_type_ttl_content_and_a_peek_that_changes_nothing() {
    let server = server();
    let url = server.url();
    // Missing key.
    let missing = json(&run("inspect", &url, &["--policy", "3/hour", "dave"]));
    assert_eq!(missing["exists"], false, "{missing}");
    assert_eq!(missing["type"], "none");
    assert!(
        missing["note"]
            .as_str()
            .expect("note")
            .contains("does not exist")
    );
    assert_eq!(int(&missing["decision"], "remaining"), 3);

    // GCRA: a string holding the TAT.
    json(&run("check", &url, &["--policy", "3/hour", "dave"]));
    let first = json(&run("inspect", &url, &["--policy", "3/hour", "dave"]));
    assert_eq!(first["key"], "floodgate:gcra:gcra-3-per-1h:{dave}");
    assert_eq!(first["exists"], true);
    assert_eq!(first["type"], "string");
    let pttl = int(&first, "pttl_ms");
    assert!(pttl > 0 && pttl <= 20 * 60_000, "{first}");
    let tat: i64 = first["value"]
        .as_str()
        .expect("value")
        .parse()
        .expect("a TAT");
    assert!(tat > int(&first, "server_time_us"), "{first}");
    assert_eq!(first["decision"]["allowed"], true);
    assert_eq!(int(&first["decision"], "remaining"), 2);
    // Peeking twice: the same remaining, the same stored value.
    let second = json(&run("inspect", &url, &["--policy", "3/hour", "dave"]));
    assert_eq!(int(&second["decision"], "remaining"), 2);
    assert_eq!(second["value"], first["value"]);

    // Sliding log: a sorted set, members with scores.
    for _ in 0..2 {
        json(&run("check", &url, &["--policy", "log:5/h", "erin"]));
    }
    let log = json(&run("inspect", &url, &["--policy", "log:5/h", "erin"]));
    assert_eq!(log["type"], "zset", "{log}");
    assert_eq!(int(&log, "size"), 2);
    let members = log["members"].as_array().expect("members");
    assert_eq!(members.len(), 2, "{log}");
    assert!(members[0]["score"].as_i64().expect("an integer score") > 0);
    assert!(int(&log, "pttl_ms") > 0);
    assert_eq!(int(&log["decision"], "remaining"), 3);

    // Token bucket: a hash, fields decoded.
    let tb = [
        "--algorithm",
        "token_bucket",
        "--capacity",
        "10",
        "--refill",
        "1",
    ];
    let tb = [&tb[..], &["--interval", "1m", "frank"]].concat();
    json(&run("check", &url, &tb));
    let bucket = json(&run("inspect", &url, &tb));
    assert_eq!(bucket["type"], "hash", "{bucket}");
    assert!(
        bucket["fields"].as_object().expect("fields").len() >= 2,
        "{bucket}"
    );
    assert_eq!(int(&bucket["decision"], "remaining"), 9);

    // Several policies: each state, and the combined peek.
    let both = json(&run(
        "inspect",
        &url,
        &["--policy", "3/hour", "--policy", "log:5/h", "dave"],
    ));
    assert_eq!(both["allowed"], true, "{both}");
    let states = both["policies"].as_array().expect("policies");
    assert_eq!(states.len(), 2);
    assert_eq!(states[0]["type"], "string");
    assert_eq!(states[1]["type"], "none");
}

#[test]
fn inspect_pattern_lists_every_key_with_its_ttl() {
    let server = server();
    let url = server.url();
    let users = ["u1", "u2", "u3", "u4", "u5"];
    for user in users {
        json(&run(
            "check",
            &url,
            &["--prefix", "pat", "--policy", "3/hour", user],
        ));
        json(&run(
            "check",
            &url,
            &["--prefix", "pat", "--policy", "log:5/m", user],
        ));
    }
    let listed = json(&run("inspect", &url, &["--prefix", "pat", "--pattern"]));
    assert_eq!(listed["pattern"], "pat:*");
    assert_eq!(listed["complete"], true);
    assert_eq!(int(&listed, "listed"), 10, "{listed}");
    for key in listed["keys"].as_array().expect("keys") {
        assert!(int(key, "pttl_ms") > 0, "{key}");
        assert!(key["type"] == "string" || key["type"] == "zset", "{key}");
    }
    assert_eq!(listed["without_ttl"], serde_json::json!([]));
    // A key without a TTL is flagged; --count bounds the listing.
    server.cmd_ok(&["SET", "pat:stray", "1"]).expect("SET");
    let run_all = run("inspect", &url, &["--pattern", "pat:*"]);
    let all = json(&run_all);
    assert_eq!(
        all["without_ttl"],
        serde_json::json!(["pat:stray"]),
        "{all}"
    );
    assert!(run_all.stderr.contains("pat:stray"), "{run_all:#?}");
    let some = json(&run(
        "inspect",
        &url,
        &["--pattern", "pat:*", "--count", "4"],
    ));
    assert_eq!(int(&some, "listed"), 4, "{some}");
    assert_eq!(some["complete"], false);
    // Policy flags make no sense with --pattern.
    run("inspect", &url, &["--pattern", "--policy", "1/s"]).failure(2);
    // --name narrows the default pattern to one policy's keys (its prefix and name escaped).
    json(&run(
        "check",
        &url,
        &[
            "--prefix",
            "p*t",
            "--policy",
            "3/hour",
            "--name",
            "per-phone",
            "u1",
        ],
    ));
    json(&run(
        "check",
        &url,
        &[
            "--prefix", "p*t", "--policy", "3/hour", "--name", "per-ip", "u1",
        ],
    ));
    let named = json(&run(
        "inspect",
        &url,
        &["--prefix", "p*t", "--pattern", "--name", "per-phone"],
    ));
    assert_eq!(named["pattern"], "p\\*t:*:per-phone:{*", "{named}");
    assert_eq!(int(&named, "listed"), 1, "{named}");
    assert_eq!(
        named["keys"][0]["key"], "p*t:gcra:per-phone:{u1}",
        "{named}"
    );
    run(
        "inspect",
        &url,
        &["--pattern", "pat:*", "--name", "per-phone"],
    )
    .failure(2);
}

#[test]
fn reset_deletes_the_state() {
    let server = server();
    let url = server.url();
    let args = ["--policy", "1/hour", "grace"];
    assert_eq!(json(&run("check", &url, &args))["allowed"], true);
    assert_eq!(json(&run("check", &url, &args))["allowed"], false);
    let reset = json(&run("reset", &url, &args));
    assert_eq!(int(&reset, "deleted"), 1, "{reset}");
    let keys = reset["keys"].as_array().expect("keys");
    assert_eq!(keys[0]["key"], "floodgate:gcra:gcra-1-per-1h:{grace}");
    assert_eq!(keys[0]["type"], "string");
    assert!(int(&keys[0], "pttl_ms") > 0);
    let gone = server
        .cmd(&["EXISTS", "floodgate:gcra:gcra-1-per-1h:{grace}"])
        .expect("EXISTS");
    assert_eq!(gone.as_int(), Some(0));
    assert_eq!(json(&run("check", &url, &args))["allowed"], true);
    // Nothing to delete is not an error.
    let none = run("reset", &url, &["--policy", "1/hour", "nobody"]);
    assert_eq!(int(&json(&none), "deleted"), 0);
    assert!(none.stderr.contains("nothing to delete"), "{none:#?}");
}

/// A service names its policies (the SMS gateway's per-phone funnel is `phone`), and the name
/// is part of the state's key: `--name` reaches that state; without it, the default name's
/// state is another key, and nothing is deleted.
#[test]
fn reset_reaches_the_state_of_a_named_policy() {
    let server = server();
    let url = server.url();
    let named = [
        "--prefix",
        "sms",
        "--policy",
        "funnel:1/30m",
        "--name",
        "phone",
        "+8613800000000",
    ];
    assert_eq!(json(&run("check", &url, &named))["allowed"], true);
    assert_eq!(json(&run("check", &url, &named))["allowed"], false);
    let key = "sms:lb:phone:{+8613800000000}";
    let held = server.cmd(&["EXISTS", key]).expect("EXISTS");
    assert_eq!(held.as_int(), Some(1));
    let unnamed = [
        "--prefix",
        "sms",
        "--policy",
        "funnel:1/30m",
        "+8613800000000",
    ];
    assert_eq!(int(&json(&run("reset", &url, &unnamed)), "deleted"), 0);
    let reset = json(&run("reset", &url, &named));
    assert_eq!(int(&reset, "deleted"), 1, "{reset}");
    assert_eq!(reset["keys"][0]["key"], key);
    assert_eq!(json(&run("check", &url, &named))["allowed"], true);
    // One name per policy.
    let miscount = run(
        "reset",
        &url,
        &["--policy", "1/m; 5/h", "--name", "one", "+8613800000000"],
    );
    miscount.failure(2);
    assert!(
        miscount.stderr.contains("one name per policy"),
        "{miscount:#?}"
    );
}

#[test]
fn check_inspect_and_reset_on_a_cluster() {
    let cluster = RedisCluster::builder()
        .replicas_per_master(0)
        .start()
        .expect(
            "a local Redis Cluster starts (if redis-server is missing, run scripts/install-redis)",
        );
    let url = cluster.urls()[0].clone();
    let users: Vec<String> = (0..20).map(|i| format!("user{i}")).collect();
    for user in &users {
        let d = json(&run(
            "check",
            &url,
            &["--cluster", "--policy", "3/hour", user],
        ));
        assert_eq!(d["allowed"], true, "{d}");
        assert_eq!(d["connection"], "cluster");
    }
    // Keys are spread over the masters; --pattern scans every one of them.
    let listed = json(&run("inspect", &url, &["--cluster", "--pattern"]));
    assert_eq!(int(&listed, "nodes"), 3, "{listed}");
    assert_eq!(int(&listed, "listed"), 20, "{listed}");
    assert_eq!(listed["without_ttl"], serde_json::json!([]));
    let state = json(&run(
        "inspect",
        &url,
        &["--cluster", "--policy", "3/hour", "user7"],
    ));
    assert_eq!(state["type"], "string");
    assert_eq!(int(&state["decision"], "remaining"), 2);
    let reset = json(&run(
        "reset",
        &url,
        &["--cluster", "--policy", "3/hour", "user7"],
    ));
    assert_eq!(int(&reset, "deleted"), 1);
    let after = json(&run(
        "check",
        &url,
        &["--cluster", "--policy", "3/hour", "user7"],
    ));
    assert_eq!(int(&after, "remaining"), 2);
}
