//! The connection layer against real redis-server processes: configuration,
//! every connection kind, scripts and their errors, pipelines, TLS, and
//! recovery from kills, pauses and a cluster failover.

use std::future::Future;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use floodgate_core::Limiter as _;
use floodgate_redis::{
    BatchConfig, ConnectionKind, DEFAULT_SINGLE_NODE_KIND, Error, RedisConfig, RedisConn,
    RedisLimiter, ScriptCall, display_key,
};
use floodgate_testkit::{RedisCluster, RedisServer, Resp, TcpProxy};
use redis::{Script, Value};

/// No test may run longer than this.
const TEST_LIMIT: Duration = Duration::from_secs(90);
/// How late a failing call may come back, on top of its timeout, on a busy 2-core machine.
const MARGIN: Duration = Duration::from_millis(300);

const SINGLE_KINDS: [ConnectionKind; 2] = [
    ConnectionKind::Multiplexed,
    ConnectionKind::Pool { size: 4 },
];

fn run<F: Future>(test: F) -> F::Output {
    floodgate_testkit::run(TEST_LIMIT, test)
}

fn incr() -> Script {
    Script::new("return redis.call('INCR', KEYS[1])")
}

async fn connect(url: &str, kind: ConnectionKind, timeout: Duration) -> RedisConn {
    let config = RedisConfig::new(url)
        .expect("valid URL")
        .connection(kind)
        .timeout(timeout)
        .connect_timeout(Duration::from_secs(2));
    RedisConn::connect(&config).await.expect("connect")
}

fn int(value: &Value) -> i64 {
    match value {
        Value::Int(i) => *i,
        other => panic!("expected an integer reply, got {other:?}"),
    }
}

fn config_error(result: Result<RedisConfig, Error>) -> String {
    match result {
        Err(Error::Config(message)) => message,
        Err(other) => panic!("expected Error::Config, got {other:?}"),
        Ok(config) => panic!("expected Error::Config, got {config:?}"),
    }
}

/// Keeps calling until a call succeeds, each call bounded by the conn's
/// timeout; returns how long it took.
async fn time_to_recover(conn: &RedisConn, script: &Script, limit: Duration) -> Duration {
    let started = Instant::now();
    let mut last = None;
    while started.elapsed() < limit {
        match conn.invoke_script(script, &[b"recover"], &[]).await {
            Ok(_) => return started.elapsed(),
            Err(e) => {
                assert!(
                    e.is_timeout() || e.is_connection(),
                    "while recovering: {e:?}"
                );
                last = Some(e);
            }
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!("{conn:?} did not recover within {limit:?}; last error: {last:?}");
}

/// Every call while the server is down or frozen fails fast with a timeout
/// or connection error.
async fn assert_calls_fail_in_time(conn: &RedisConn, script: &Script, calls: usize) {
    for _ in 0..calls {
        let started = Instant::now();
        let result = conn.invoke_script(script, &[b"down"], &[]).await;
        let took = started.elapsed();
        match result {
            Err(e) => assert!(e.is_timeout() || e.is_connection(), "{e:?}"),
            Ok(v) => panic!("a call to a dead server succeeded: {v:?}"),
        }
        assert!(
            took <= conn.timeout() + MARGIN,
            "a failing call took {took:?} (timeout {:?})",
            conn.timeout()
        );
    }
}

#[test]
fn urls_are_parsed_and_passwords_never_shown() {
    let config = RedisConfig::new("redis://app:p%40ss%2Fw0rd@127.0.0.1:6380/3").expect("valid");
    assert_eq!(config.redacted_url(), "redis://app:***@127.0.0.1:6380/3");
    for shown in [
        format!("{config:?}"),
        config.to_string(),
        config.redacted_url(),
    ] {
        assert!(!shown.contains("p%40ss"), "{shown}");
        assert!(!shown.contains("w0rd"), "{shown}");
        assert!(shown.contains("***"), "{shown}");
    }
    assert_eq!(config.kind(), DEFAULT_SINGLE_NODE_KIND);
    assert_eq!(config.get_timeout(), Duration::from_millis(250));
    assert_eq!(config.get_key_prefix(), "floodgate");
    assert!(!config.is_tls());

    let tls = RedisConfig::new("rediss://:s3cr3t@cache.example:6390").expect("valid");
    assert_eq!(tls.redacted_url(), "rediss://:***@cache.example:6390");
    assert!(tls.is_tls());

    let secret = "hunter2";
    for (url, says) in [
        ("", "empty"),
        ("http://:hunter2@h:1", "scheme `http`"),
        ("redis://:hunter2@h:notaport", "invalid Redis URL"),
        ("redis://:hunter2@h:1/abc", "database"),
        ("redis://:hunter2@h:1/0#insecure", "fragment"),
        ("redis://:hunter2@h:1/?protocol=3", "query parameter"),
        ("redis://:hunter2@h:1/?cluster=maybe", "query parameter"),
        ("redis://:hun/ter2@h:1", "invalid Redis URL"),
        ("redis://:hunter2@", "invalid Redis URL"),
    ] {
        let message = config_error(RedisConfig::new(url));
        assert!(message.contains(says), "{url}: {message}");
        assert!(!message.contains(secret), "{url}: {message}");
        assert!(!message.contains("ter2"), "{url}: {message}");
    }

    let seeds = RedisConfig::from_urls(["redis://10.0.0.1:7000", "redis://10.0.0.2:7000"])
        .expect("valid seeds");
    assert_eq!(seeds.kind(), ConnectionKind::Cluster);
    assert_eq!(
        seeds.redacted_url(),
        "redis://10.0.0.1:7000, redis://10.0.0.2:7000"
    );
    let flagged = RedisConfig::new("redis://10.0.0.1:7000?cluster=true").expect("valid");
    assert_eq!(flagged.kind(), ConnectionKind::Cluster);
    let unflagged = flagged.cluster(false);
    assert_eq!(unflagged.kind(), DEFAULT_SINGLE_NODE_KIND);
    let message = config_error(RedisConfig::from_urls(Vec::<String>::new()));
    assert!(message.contains("no Redis URL"), "{message}");
    let message = config_error(RedisConfig::from_urls([
        "redis://:hunter2@a:1",
        "rediss://:hunter2@b:1",
    ]));
    assert!(message.contains("same scheme"), "{message}");
    assert!(!message.contains(secret), "{message}");
}

#[test]
fn invalid_settings_are_config_errors() {
    let base = || RedisConfig::new("redis://:hunter2@127.0.0.1:1/2").expect("valid");
    let invalid = |config: RedisConfig, says: &str| match config.validate() {
        Err(Error::Config(message)) => {
            assert!(message.contains(says), "{message}");
            assert!(!message.contains("hunter2"), "{message}");
        }
        other => panic!("expected Error::Config containing {says:?}, got {other:?}"),
    };
    invalid(
        base().connection(ConnectionKind::Pool { size: 0 }),
        "at least 1",
    );
    invalid(base().timeout(Duration::ZERO), "call timeout");
    invalid(base().connect_timeout(Duration::ZERO), "connect timeout");
    invalid(base().cluster(true), "only database 0");
    invalid(
        RedisConfig::from_urls(["redis://a:1", "redis://b:1"])
            .expect("valid")
            .connection(ConnectionKind::Multiplexed),
        "several URLs",
    );
    #[cfg(feature = "tls")]
    {
        invalid(base().tls_insecure(), "not a rediss://");
        invalid(
            RedisConfig::new("rediss://h:1")
                .expect("valid")
                .tls_ca_cert("not a certificate"),
            "not PEM",
        );
    }
    base().validate().expect("the base config is valid");

    // connect() validates too, before touching the network.
    run(async {
        let err = RedisConn::connect(&base().connection(ConnectionKind::Pool { size: 0 }))
            .await
            .expect_err("pool of 0");
        assert!(matches!(err, Error::Config(_)), "{err:?}");
    });
}

#[test]
fn key_prefix_is_validated() {
    let base = || RedisConfig::new("redis://127.0.0.1:1").expect("valid");
    let config = base().key_prefix("sms-gateway:v2").expect("valid prefix");
    assert_eq!(config.get_key_prefix(), "sms-gateway:v2");
    base()
        .key_prefix(&"p".repeat(64))
        .expect("64 bytes are allowed");
    for (prefix, says) in [
        ("", "empty"),
        (&*"p".repeat(65), "65 bytes"),
        ("a{b", "brace"),
        ("a}b", "brace"),
        ("a b", "whitespace"),
        ("a\tb", "whitespace"),
        ("a\u{7}b", "control"),
        ("a\u{a0}b", "whitespace"),
    ] {
        let message = config_error(base().key_prefix(prefix));
        assert!(message.contains(says), "{prefix:?}: {message}");
    }
}

#[test]
fn a_limiter_over_an_existing_connection_checks_its_prefix() {
    let server = RedisServer::start().expect("start redis-server");
    run(async {
        let conn = connect(
            &server.url(),
            ConnectionKind::Multiplexed,
            Duration::from_secs(1),
        )
        .await;
        let limiter = RedisLimiter::new(conn.clone(), "sms:v2").expect("valid prefix");
        assert_eq!(limiter.prefix(), "sms:v2");
        for (prefix, says) in [("", "empty"), ("a{b", "brace"), ("a b", "whitespace")] {
            for made in [
                RedisLimiter::new(conn.clone(), prefix),
                RedisLimiter::with_batching(conn.clone(), prefix, BatchConfig::disabled()),
            ] {
                match made {
                    Err(Error::Config(message)) => {
                        assert!(message.contains(says), "{prefix:?}: {message}");
                    }
                    Err(other) => panic!("{prefix:?}: {other:?}"),
                    Ok(_) => panic!("{prefix:?} accepted"),
                }
            }
        }
    });
}

#[test]
fn keys_in_errors_are_escaped_and_truncated() {
    assert_eq!(
        display_key(b"floodgate:gcra:{+15551234}"),
        "floodgate:gcra:{+15551234}"
    );
    assert_eq!(display_key(b"a\xffb\x00\\"), "a\\xffb\\x00\\\\");
    let long = display_key(&vec![b'x'; 5000]);
    assert!(long.starts_with("xxxx"), "{long}");
    assert!(long.ends_with("...(5000 bytes)"), "{long}");
    assert!(long.len() <= 220, "{} chars", long.len());
}

#[test]
fn refused_connection_names_the_redacted_address() {
    let server = RedisServer::builder()
        .password("pw-secret")
        .start()
        .expect("start redis-server");
    let url = server.url();
    server.kill().expect("kill");
    run(async {
        for kind in SINGLE_KINDS {
            let config = RedisConfig::new(&url)
                .expect("valid")
                .connection(kind)
                .connect_timeout(Duration::from_secs(2));
            let started = Instant::now();
            let err = RedisConn::connect(&config)
                .await
                .expect_err("nothing listens there");
            assert!(
                started.elapsed() <= Duration::from_secs(2) + MARGIN,
                "{kind}: took {:?}",
                started.elapsed()
            );
            let Error::Connect { addr, .. } = &err else {
                panic!("{kind}: expected Error::Connect, got {err:?}");
            };
            let expected = format!("redis://:***@127.0.0.1:{}", server.port());
            assert_eq!(addr, &expected, "{kind}");
            assert!(err.is_connection(), "{kind}: {err:?}");
            let shown = format!("{err} {err:?}");
            assert!(!shown.contains("pw-secret"), "{kind}: {shown}");
            assert!(shown.contains(&expected), "{kind}: {shown}");
        }
    });
}

#[test]
fn wrong_password_is_a_connect_error_without_the_password() {
    let server = RedisServer::builder()
        .password("right-secret")
        .start()
        .expect("start redis-server");
    let url = format!("redis://:wrong-secret@127.0.0.1:{}", server.port());
    run(async {
        for kind in SINGLE_KINDS {
            let config = RedisConfig::new(&url).expect("valid").connection(kind);
            let err = RedisConn::connect(&config)
                .await
                .expect_err("the password is wrong");
            assert!(matches!(err, Error::Connect { .. }), "{kind}: {err:?}");
            let shown = format!("{err} {err:?}");
            assert!(!shown.contains("secret"), "{kind}: {shown}");
        }
    });
}

#[test]
fn every_single_node_kind_runs_commands_and_scripts() {
    // A password with characters that need percent-encoding in the URL.
    let password = "s3cr:t@/?#%";
    let server = RedisServer::builder()
        .password(password)
        .start()
        .expect("start redis-server");
    server.cmd_ok(&["SET", "text", "abc"]).expect("SET text");
    run(async {
        for kind in SINGLE_KINDS {
            let conn = connect(&server.url(), kind, Duration::from_millis(500)).await;
            assert_eq!(conn.kind(), kind);
            let shown = format!("{conn:?}");
            assert!(!shown.contains("s3cr"), "{shown}");
            assert!(shown.contains("***"), "{shown}");
            assert!(!conn.redacted_url().contains("s3cr"));

            conn.ping().await.expect("PING");
            let server_now = conn.server_time().await.expect("TIME");
            let local_now = u64::try_from(
                SystemTime::now()
                    .duration_since(UNIX_EPOCH)
                    .expect("after 1970")
                    .as_micros(),
            )
            .expect("fits");
            assert!(
                server_now.abs_diff(local_now) < 5_000_000,
                "server {server_now} vs local {local_now}"
            );
            assert!(conn.has_command("GET").await.expect("COMMAND INFO"));
            assert!(!conn.has_command("CL.THROTTLE").await.expect("COMMAND INFO"));
            assert!(!conn.has_redis_cell().await.expect("redis-cell"));
            assert!(
                !conn
                    .clone()
                    .has_redis_cell()
                    .await
                    .expect("redis-cell, cached")
            );

            let key = format!("hits:{kind}");
            let script = incr();
            let first = conn
                .invoke_script(&script, &[key.as_bytes()], &[])
                .await
                .expect("EVALSHA");
            assert_eq!(int(&first), 1);
            // Scripts lost by the server (SCRIPT FLUSH) are loaded again.
            server.cmd_ok(&["SCRIPT", "FLUSH"]).expect("SCRIPT FLUSH");
            let second = conn
                .invoke_script(&script, &[key.as_bytes()], &[])
                .await
                .expect("EVALSHA after NOSCRIPT");
            assert_eq!(int(&second), 2);
            let exists = server
                .cmd(&["SCRIPT", "EXISTS", script.get_hash()])
                .expect("SCRIPT EXISTS");
            assert_eq!(exists.as_array().and_then(|a| a[0].as_int()), Some(1));

            let mut get = redis::cmd("GET");
            get.arg(&key);
            assert_eq!(conn.query::<i64>(get).await.expect("GET"), 2);
            let mut get = redis::cmd("GET");
            get.arg("text");
            let err = conn.query::<i64>(get).await.expect_err("not a number");
            assert!(
                matches!(err, Error::UnexpectedReply { expected, .. } if expected.contains("i64")),
                "{err:?}"
            );

            // Arguments reach the script as bytes.
            let echo = Script::new("return {KEYS[1], ARGV[1], ARGV[2]}");
            let reply = conn
                .invoke_script(&echo, &[b"k\xff"], &[b"a\x00b", b""])
                .await
                .expect("echo");
            assert_eq!(
                reply,
                Value::Array(vec![
                    Value::BulkString(b"k\xff".to_vec()),
                    Value::BulkString(b"a\x00b".to_vec()),
                    Value::BulkString(Vec::new()),
                ])
            );
        }
    });
}

#[test]
fn script_errors_are_typed() {
    let server = RedisServer::start().expect("start redis-server");
    server.cmd_ok(&["SET", "str", "x"]).expect("SET");
    let bin: &[u8] = b"bin\xff";
    server
        .cmd_ok(&[b"SET" as &[u8], bin, b"x"])
        .expect("SET bin");
    run(async {
        for kind in SINGLE_KINDS {
            let conn = connect(&server.url(), kind, Duration::from_millis(500)).await;

            let hget = Script::new("return redis.call('HGET', KEYS[1], 'f')");
            let err = conn
                .invoke_script(&hget, &[b"str"], &[])
                .await
                .expect_err("WRONGTYPE");
            assert!(
                matches!(&err, Error::WrongType { key } if key == "str"),
                "{err:?}"
            );
            assert!(err.is_corrupted());
            let err = conn
                .invoke_script(&hget, &[bin], &[])
                .await
                .expect_err("WRONGTYPE");
            assert!(
                matches!(&err, Error::WrongType { key } if key == "bin\\xff"),
                "{err:?}"
            );

            let corrupt = Script::new("return redis.error_reply('FLOODGATE_CORRUPT 1 tat is -5')");
            let err = conn
                .invoke_script(&corrupt, &[b"a", b"b"], &[])
                .await
                .expect_err("corrupt");
            assert!(
                matches!(&err, Error::Corrupted { key, detail } if key == "b" && detail == "tat is -5"),
                "{err:?}"
            );
            assert!(err.is_corrupted() && !err.is_connection() && !err.is_timeout());
            assert!(err.to_string().contains("tat is -5"), "{err}");

            // Raised with error(): Redis appends "script: <sha>, on @user_script:1."
            let raised = Script::new("error({err = 'FLOODGATE_CORRUPT 0 count is \"x\"'})");
            let err = conn
                .invoke_script(&raised, &[b"a"], &[])
                .await
                .expect_err("corrupt");
            assert!(
                matches!(&err, Error::Corrupted { key, detail } if key == "a" && detail == "count is \"x\""),
                "{err:?}"
            );
            let wrongtype = Script::new("error({err = 'FLOODGATE_WRONGTYPE 1'})");
            let err = conn
                .invoke_script(&wrongtype, &[b"a", b"b"], &[])
                .await
                .expect_err("wrong type");
            assert!(
                matches!(&err, Error::WrongType { key } if key == "b"),
                "{err:?}"
            );
            let out_of_range = Script::new("error({err = 'FLOODGATE_WRONGTYPE 7'})");
            let err = conn
                .invoke_script(&out_of_range, &[b"a"], &[])
                .await
                .expect_err("wrong type");
            assert!(
                matches!(&err, Error::WrongType { key } if key.contains("index 7")),
                "{err:?}"
            );

            let boom = Script::new("error('boom')");
            let err = conn
                .invoke_script(&boom, &[b"a"], &[])
                .await
                .expect_err("boom");
            let Error::Script { message } = &err else {
                panic!("expected Error::Script, got {err:?}");
            };
            assert!(message.contains("boom"), "{message}");
            assert!(!message.contains("@user_script"), "{message}");
            let custom = Script::new("return redis.error_reply('MYAPP_LIMIT too many')");
            let err = conn
                .invoke_script(&custom, &[], &[])
                .await
                .expect_err("custom");
            assert!(
                matches!(&err, Error::Script { message } if message == "MYAPP_LIMIT too many"),
                "{err:?}"
            );
            let syntax = Script::new("return (");
            let err = conn
                .invoke_script(&syntax, &[], &[])
                .await
                .expect_err("does not compile");
            assert!(matches!(err, Error::Script { .. }), "{err:?}");

            let mut hget = redis::cmd("HGET");
            hget.arg("str").arg("f");
            let err = conn
                .query::<Option<String>>(hget)
                .await
                .expect_err("WRONGTYPE");
            assert!(
                matches!(&err, Error::WrongType { key } if key == "str"),
                "{err:?}"
            );
        }
    });
}

#[test]
fn pipelined_scripts_get_one_result_each() {
    let server = RedisServer::start().expect("start redis-server");
    run(async {
        for kind in SINGLE_KINDS {
            let conn = connect(&server.url(), kind, Duration::from_millis(500)).await;
            let script = incr();
            let failing = Script::new("return redis.error_reply('FLOODGATE_CORRUPT 0 nope')");
            let a = format!("a:{kind}");
            let b = format!("b:{kind}");
            assert!(
                conn.pipeline_scripts(Vec::new())
                    .await
                    .expect("empty")
                    .is_empty()
            );
            // Both scripts unknown to the server: every call meets NOSCRIPT first.
            server.cmd_ok(&["SCRIPT", "FLUSH"]).expect("SCRIPT FLUSH");
            let calls = vec![
                ScriptCall::new(&script).key(a.as_bytes()),
                ScriptCall::new(&script).key(b.as_bytes()),
                ScriptCall::new(&failing).key("broken"),
                ScriptCall::new(&script).key(a.as_bytes()),
            ];
            let results = conn.pipeline_scripts(calls).await.expect("pipeline");
            assert_eq!(results.len(), 4);
            assert_eq!(int(results[0].as_ref().expect("a")), 1);
            assert_eq!(int(results[1].as_ref().expect("b")), 1);
            assert!(
                matches!(&results[2], Err(Error::Corrupted { key, .. }) if key == "broken"),
                "{:?}",
                results[2]
            );
            assert_eq!(int(results[3].as_ref().expect("a again")), 2);
            // Now loaded: one round trip, same answers.
            let calls = vec![
                ScriptCall::new(&script).key(a.as_bytes()),
                ScriptCall::new(&failing).key("broken"),
            ];
            let results = conn.pipeline_scripts(calls).await.expect("pipeline");
            assert_eq!(int(results[0].as_ref().expect("a")), 3);
            assert!(results[1].is_err());
        }
    });
}

/// A pipeline whose first calls ran and whose others met `NOSCRIPT` and then failed (here: a
/// user not allowed `SCRIPT LOAD`) keeps the results of the calls that ran: failing them all
/// would have the caller run them again.
#[test]
fn pipelined_scripts_that_ran_keep_their_results_when_the_others_fail() {
    let server = RedisServer::start().expect("start redis-server");
    run(async {
        server
            .cmd_ok(&[
                "ACL",
                "SETUSER",
                "noload",
                "on",
                ">secret",
                "~*",
                "&*",
                "+@all",
                "-script|load",
            ])
            .expect("ACL SETUSER");
        let url = format!("redis://noload:secret@127.0.0.1:{}", server.port());
        let script = incr();
        let unknown = Script::new("return 'never loaded'");
        for kind in SINGLE_KINDS {
            let key = format!("ran:{kind}");
            server.cmd_ok(&["SCRIPT", "FLUSH"]).expect("SCRIPT FLUSH");
            server
                .cmd_ok(&["SCRIPT", "LOAD", "return redis.call('INCR', KEYS[1])"])
                .expect("SCRIPT LOAD");
            let conn = connect(&url, kind, Duration::from_millis(500)).await;
            let calls = vec![
                ScriptCall::new(&script).key(key.as_bytes()),
                ScriptCall::new(&unknown).key(key.as_bytes()),
            ];
            let results = conn.pipeline_scripts(calls).await.expect("one call ran");
            assert_eq!(int(results[0].as_ref().expect("ran")), 1, "{kind}");
            let err = results[1].as_ref().expect_err("cannot be loaded");
            assert!(err.to_string().contains("script|load"), "{kind}: {err}");
            // It ran once.
            let value = server.cmd(&["GET", key.as_str()]).expect("GET");
            assert_eq!(
                value,
                floodgate_testkit::Resp::Bulk(Some(b"1".to_vec())),
                "{kind}"
            );
        }
    });
}

#[test]
fn fault_kill_and_restart_recovers_without_reconnecting_by_hand() {
    let server = RedisServer::start().expect("start redis-server");
    run(async {
        for kind in SINGLE_KINDS {
            let conn = connect(&server.url(), kind, Duration::from_millis(200)).await;
            let script = incr();
            conn.invoke_script(&script, &[b"before"], &[])
                .await
                .expect("before the kill");
            server.kill().expect("kill");
            assert_calls_fail_in_time(&conn, &script, 5).await;
            server.restart().expect("restart on the same port");
            let took = time_to_recover(&conn, &script, Duration::from_secs(5)).await;
            println!("{kind}: calls succeed again {took:?} after the restart");
            assert!(
                took < Duration::from_millis(2500),
                "{kind}: recovery took {took:?}"
            );
            // The restarted server has no scripts and no data.
            let value = conn
                .invoke_script(&script, &[b"after"], &[])
                .await
                .expect("after the restart");
            assert_eq!(int(&value), 1);
        }
    });
}

/// A quick restart while the pool sits idle: every idle connection is dead, and each would fail
/// one call (with the circuit breaker open after three, one probe per open period) if the pool
/// did not drop its idle connections at the first connection error.
#[test]
fn fault_a_quick_restart_under_an_idle_pool_recovers_at_once() {
    let server = RedisServer::start().expect("start redis-server");
    run(async {
        let kind = ConnectionKind::Pool { size: 16 };
        let conn = connect(&server.url(), kind, Duration::from_millis(250)).await;
        let script = incr();
        // Sixteen at once: the pool has all its connections up.
        let calls = (0..16).map(|_| conn.invoke_script(&script, &[b"before"], &[]));
        for result in futures_util::future::join_all(calls).await {
            result.expect("before the restart");
        }
        server.kill().expect("kill");
        server.restart().expect("restart on the same port");
        tokio::time::sleep(Duration::from_secs(1)).await;
        let took = time_to_recover(&conn, &script, Duration::from_secs(10)).await;
        assert!(took < Duration::from_millis(1500), "recovery took {took:?}");
    });
}

/// A connection that goes silent without an error (a proxy or load balancer in front of Redis
/// lost its backend, a NAT dropped its entry: the kernel still acknowledges what is sent, so
/// neither an error nor `TCP_USER_TIMEOUT` ever comes) while Redis itself is fine: calls time
/// out on it for as long as it stays open unless the client gives up on it and connects again.
#[test]
fn fault_a_connection_gone_silent_is_replaced_while_redis_answers_new_ones() {
    let server = RedisServer::start().expect("start redis-server");
    let proxy = TcpProxy::start(server.addr()).expect("proxy");
    run(async {
        for kind in SINGLE_KINDS {
            let conn = connect(&proxy.url(), kind, Duration::from_millis(200)).await;
            let script = incr();
            conn.invoke_script(&script, &[b"before"], &[])
                .await
                .expect("before the freeze");
            let before = proxy.connections();
            proxy.freeze_open_connections();
            let took = time_to_recover(&conn, &script, Duration::from_secs(10)).await;
            println!("{kind}: calls succeed again {took:?} after the freeze");
            assert!(
                took < Duration::from_secs(5),
                "{kind}: recovery took {took:?}"
            );
            assert!(proxy.connections() > before, "{kind}: no new connection");
        }
    });
}

/// The same on a cluster: the connection to one master goes silent while the master (and the
/// rest of the cluster) answers new connections. The other masters' keys answering meanwhile
/// do not hide it: the calls to that master's slots time out until the cluster connection is
/// made again.
#[test]
fn fault_a_cluster_node_connection_gone_silent_is_replaced() {
    let cluster = RedisCluster::builder()
        .masters(3)
        .replicas_per_master(0)
        .start()
        .expect("start a 3-master cluster");
    let master = cluster.masters().expect("masters")[0];
    let key = (0..)
        .map(|i| format!("silent{i}"))
        .find(|k| cluster.node_for_key(k.as_bytes()).expect("owner") == master)
        .expect("a key of the master");
    let other = (0..)
        .map(|i| format!("other{i}"))
        .find(|k| cluster.node_for_key(k.as_bytes()).expect("owner") != master)
        .expect("a key of another master");
    let node = cluster.node(master);
    let proxy = TcpProxy::start(node.addr()).expect("proxy");
    // The master announces the proxy's port: clients reach it through the proxy (the cluster
    // bus keeps its own port).
    let port = proxy.addr().port().to_string();
    node.cmd_ok(&["CONFIG", "SET", "cluster-announce-port", port.as_str()])
        .expect("announce the proxy");
    let announced = Resp::Int(i64::from(proxy.addr().port()));
    let started = Instant::now();
    while !(0..cluster.len()).all(|i| {
        let slots = cluster.node(i).cmd(&["CLUSTER", "SLOTS"]).expect("slots");
        format!("{slots:?}").contains(&format!("{announced:?}"))
    }) {
        assert!(
            started.elapsed() < Duration::from_secs(20),
            "the proxy's port was not gossiped"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    run(async {
        let config = RedisConfig::from_urls(cluster.urls())
            .expect("valid seeds")
            .timeout(Duration::from_millis(200));
        let conn = RedisConn::connect(&config).await.expect("connect");
        let script = incr();
        let call = |key: &str| {
            let key = key.as_bytes().to_vec();
            let (conn, script) = (&conn, &script);
            async move { conn.invoke_script(script, &[key.as_slice()], &[]).await }
        };
        let (key, other) = (key.as_str(), other.as_str());
        // Retried: a busy machine may take longer than 200 ms to load the script at first.
        let started = Instant::now();
        while let Err(e) = call(key).await {
            assert!(started.elapsed() < Duration::from_secs(5), "before: {e:?}");
        }
        let before = proxy.connections();
        assert!(before > 0, "the master is not reached through the proxy");
        proxy.freeze_open_connections();
        let started = Instant::now();
        let took = loop {
            // Another master's key answers all along.
            call(other).await.expect("another master's key");
            match call(key).await {
                Ok(_) => break started.elapsed(),
                Err(e) => {
                    assert!(e.is_timeout() || e.is_connection(), "{e:?}");
                    assert!(
                        started.elapsed() < Duration::from_secs(10),
                        "the silent master's keys did not answer again; last error: {e:?}"
                    );
                }
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        };
        println!("the master's keys answer again {took:?} after the freeze");
        assert!(took < Duration::from_secs(5), "recovery took {took:?}");
        assert!(proxy.connections() > before, "no new connection");
    });
}

/// A Redis that stalls for less than a second (a fork, a slow script) keeps its connection:
/// the calls that time out meanwhile do not make it connect again, and commands are not
/// reordered across two connections.
#[test]
fn fault_a_short_stall_keeps_the_multiplexed_connection() {
    let server = RedisServer::start().expect("start redis-server");
    let proxy = TcpProxy::start(server.addr()).expect("proxy");
    run(async {
        let kind = ConnectionKind::Multiplexed;
        let conn = connect(&proxy.url(), kind, Duration::from_millis(100)).await;
        let script = incr();
        // The script loaded (retried: a busy machine may take longer than 100 ms at first).
        time_to_recover(&conn, &script, Duration::from_secs(5)).await;
        let before = proxy.connections();
        server.pause().expect("SIGSTOP");
        // Calls one after the other for 500 ms: several time out, half a second short of the
        // second of silence that replaces a connection.
        let started = Instant::now();
        let mut timed_out = 0;
        while started.elapsed() < Duration::from_millis(500) {
            if let Err(e) = conn.invoke_script(&script, &[b"during"], &[]).await {
                timed_out += usize::from(e.is_timeout());
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
        server.resume().expect("SIGCONT");
        assert!(timed_out >= 2, "only {timed_out} calls timed out");
        let took = time_to_recover(&conn, &script, Duration::from_secs(5)).await;
        println!("calls succeed again {took:?} after SIGCONT");
        assert_eq!(
            proxy.connections(),
            before,
            "connected again for a short stall"
        );
    });
}

#[test]
fn fault_pause_and_resume_never_hangs() {
    let server = RedisServer::start().expect("start redis-server");
    run(async {
        for kind in SINGLE_KINDS {
            let conn = connect(&server.url(), kind, Duration::from_millis(200)).await;
            let script = incr();
            conn.invoke_script(&script, &[b"before"], &[])
                .await
                .expect("before the pause");
            server.pause().expect("SIGSTOP");
            assert_calls_fail_in_time(&conn, &script, 4).await;
            let started = Instant::now();
            let err = conn.ping().await.expect_err("paused");
            // After the failures above the circuit breaker fails it at once.
            assert!(
                err.is_timeout() || matches!(err, Error::Unavailable { .. }),
                "{err:?}"
            );
            assert!(started.elapsed() <= conn.timeout() + MARGIN);
            server.resume().expect("SIGCONT");
            let took = time_to_recover(&conn, &script, Duration::from_secs(5)).await;
            println!("{kind}: calls succeed again {took:?} after SIGCONT");
            assert!(
                took < Duration::from_millis(2500),
                "{kind}: recovery took {took:?}"
            );
        }
    });
}

/// While a slot migrates, a key not yet on the importing node is asked about there (`ASK`),
/// whose script cache may not have the script (a node restarted, flushed, or new): loaded on
/// the slot's owner only, as after a plain `NOSCRIPT`, the call would fail until the migration
/// ends. It is then loaded on every master, and the call succeeds.
#[test]
fn cluster_loads_a_script_where_a_migrating_slot_asks() {
    let cluster = RedisCluster::start().expect("start a 6-node cluster");
    run(async {
        let (_, conn) = connect_cluster(&cluster, Duration::from_secs(2)).await;
        let script = incr();
        let seed = b"{seed}:n".as_slice();
        let slot = RedisCluster::key_slot(seed);
        // Loaded on the owner, by a key it holds.
        let value = conn
            .invoke_script(&script, &[seed], &[])
            .await
            .expect("EVALSHA");
        assert_eq!(int(&value), 1);
        let migration = Migration::begin(&cluster, slot);
        let target = migration.target;
        cluster
            .node(target)
            .cmd_ok(&["SCRIPT", "FLUSH"])
            .expect("SCRIPT FLUSH");
        // A key of the slot that the owner does not hold: asked about on the importing node.
        let fresh = (0..100_000)
            .map(|i| format!("{{seed}}:fresh-{i}"))
            .find(|k| RedisCluster::key_slot(k.as_bytes()) == slot)
            .expect("a key in the slot");
        let value = conn
            .invoke_script(&script, &[fresh.as_bytes()], &[])
            .await
            .expect("EVALSHA of a key that moved");
        assert_eq!(int(&value), 1);
        migration.cancel(&cluster);
    });
}

/// Pipelined calls of a slot whose keys a migration split run once each: the call of the key
/// still on the source is not sent again to the target with the redirected one (the cluster
/// client sends a redirected pipeline again whole). Run twice, it counted twice, and made the
/// key on the importing node too, where the migration could then not move it (`BUSYKEY`).
#[test]
fn cluster_pipelined_calls_of_a_migrating_slot_run_once() {
    let cluster = RedisCluster::start().expect("start a 6-node cluster");
    run(async {
        let (_, conn) = connect_cluster(&cluster, Duration::from_secs(2)).await;
        let script = incr();
        let (stays, moves) = ("{pipelined}:stays", "{pipelined}:moves");
        let slot = RedisCluster::key_slot(stays.as_bytes());
        for key in [stays, moves] {
            let value = conn
                .invoke_script(&script, &[key.as_bytes()], &[])
                .await
                .expect("EVALSHA");
            assert_eq!(int(&value), 1, "{key}");
        }
        let migration = Migration::begin(&cluster, slot);
        migration.migrate(&cluster, moves.as_bytes());
        for round in 2..5 {
            let calls = vec![
                ScriptCall::new(&script).key(stays.as_bytes()),
                ScriptCall::new(&script).key(moves.as_bytes()),
            ];
            let results = conn.pipeline_scripts(calls).await.expect("pipeline");
            let values: Vec<i64> = results
                .iter()
                .map(|r| int(r.as_ref().expect("each call answered")))
                .collect();
            assert_eq!(values, [round, round], "each key counted once a round");
        }
        let slot_arg = slot.to_string();
        let keys = cluster
            .node(migration.target)
            .cmd(&["CLUSTER", "COUNTKEYSINSLOT", &slot_arg])
            .expect("COUNTKEYSINSLOT");
        assert_eq!(
            keys.as_int(),
            Some(1),
            "the target holds the moved key only"
        );
        // The rest of the migration goes through.
        migration.migrate(&cluster, stays.as_bytes());
        migration.cancel(&cluster);
    });
}

/// A connection to `cluster` with call timeout `timeout`, and its configuration.
async fn connect_cluster(cluster: &RedisCluster, timeout: Duration) -> (RedisConfig, RedisConn) {
    let config = RedisConfig::from_urls(cluster.urls())
        .expect("valid seeds")
        .timeout(timeout);
    let conn = RedisConn::connect(&config).await.expect("connect");
    (config, conn)
}

/// A slot moving from node `source` to node `target` of a cluster: `IMPORTING` on the target,
/// `MIGRATING` on the source, as `redis-cli --cluster reshard` leaves them between its
/// `MIGRATE`s (or for good, when it dies half-way).
struct Migration {
    slot: String,
    source: usize,
    target: usize,
    source_id: String,
}

impl Migration {
    /// The slot moving from its owner to another master.
    fn begin(cluster: &RedisCluster, slot: u16) -> Self {
        let source = cluster.node_for_slot(slot).expect("owner");
        let target = cluster
            .masters()
            .expect("masters")
            .into_iter()
            .find(|&m| m != source)
            .expect("another master");
        let id = |node: usize| -> String {
            let reply = cluster.node(node).cmd(&["CLUSTER", "MYID"]).expect("MYID");
            String::from_utf8_lossy(reply.as_bytes().expect("an id")).into_owned()
        };
        let (source_id, target_id) = (id(source), id(target));
        let slot = slot.to_string();
        cluster
            .node(target)
            .cmd_ok(&["CLUSTER", "SETSLOT", &slot, "IMPORTING", &source_id])
            .expect("IMPORTING");
        cluster
            .node(source)
            .cmd_ok(&["CLUSTER", "SETSLOT", &slot, "MIGRATING", &target_id])
            .expect("MIGRATING");
        Migration {
            slot,
            source,
            target,
            source_id,
        }
    }

    /// Moves `key` to the target, as the resharding tool does.
    fn migrate(&self, cluster: &RedisCluster, key: &[u8]) {
        let target = cluster.node(self.target);
        let port = target.port().to_string();
        let reply = cluster
            .node(self.source)
            .cmd(&[
                b"MIGRATE".as_slice(),
                b"127.0.0.1",
                port.as_bytes(),
                key,
                b"0",
                b"5000",
            ])
            .expect("MIGRATE");
        assert_eq!(reply.as_str(), Some("OK"), "MIGRATE: {reply:?}");
    }

    /// Gives the slot back to the source (keys moved stay where they are).
    fn cancel(self, cluster: &RedisCluster) {
        for node in [self.source, self.target] {
            cluster
                .node(node)
                .cmd_ok(&["CLUSTER", "SETSLOT", &self.slot, "NODE", &self.source_id])
                .expect("SETSLOT NODE");
        }
    }
}

/// How many times `node` answered `code` (`INFO errorstats`, Redis 6.2 and later).
fn error_replies(node: &RedisServer, code: &str) -> u64 {
    let reply = node.cmd(&["INFO", "errorstats"]).expect("INFO");
    let info = String::from_utf8_lossy(reply.as_bytes().expect("bulk reply")).into_owned();
    let prefix = format!("errorstat_{code}:count=");
    info.lines()
        .find_map(|l| l.strip_prefix(prefix.as_str()))
        .and_then(|n| n.trim().parse().ok())
        .unwrap_or(0)
}

/// Half-way through a slot's migration, a batch of checks whose keys are some on each node is
/// refused with `TRYAGAIN` for as long as the slot stays split, which a resharding tool that
/// died half-way makes for good. The client retries a `TRYAGAIN` for a little, within the
/// call's time (it used to wait over a second, past any sensible timeout), then sends each
/// check of the batch on its own: each key is where one node or the other can serve it (`ASK`),
/// and so are the slot's next batches, at once, for a while.
/// The state of the key that moved goes on counting. A check of several keys of one user that
/// the migration split fails, but the server that answered `TRYAGAIN` is not counted as down: a
/// later check of another key in its breaker's range gets through.
#[test]
fn cluster_batches_split_by_a_migrating_slot_are_sent_check_by_check() {
    let cluster = RedisCluster::start().expect("start a 6-node cluster");
    run(async {
        let config = RedisConfig::from_urls(cluster.urls())
            .expect("valid seeds")
            // Room for the eight checks of the moved user that each go back and forth between the
            // nodes before they are asked about with ASKING (some 200-400 ms on an idle machine),
            // and still under the 16 tries, over a second apart, that TRYAGAIN used to take.
            .timeout(Duration::from_secs(2));
        let conn = RedisConn::connect(&config).await.expect("connect");
        let limiter =
            RedisLimiter::with_batching(conn, config.get_key_prefix(), BatchConfig::default())
                .expect("valid prefix");
        let policy = floodgate_core::Policy::per_hour(1_000).expect("valid");
        let key_of = |user: &str| limiter.state_key(&policy, user.as_bytes());
        let slot_of = |user: &str| RedisCluster::key_slot(&key_of(user));
        let first = "user-0";
        let slot = slot_of(first);
        let second = (1..100_000)
            .map(|i| format!("user-{i}"))
            .find(|u| slot_of(u) == slot)
            .expect("another user in the slot");
        // `n` checks of each user at once, interleaved (so that batches hold both), every one
        // allowed: the lowest remaining of each user's.
        let (limiter, policy, users) = (&limiter, &policy, [first, second.as_str()]);
        let round = |n: usize| async move {
            let checks = (0..n).flat_map(|_| users).map(|user| async move {
                let d = limiter.check_one(user.as_bytes(), policy, 1).await;
                (user, d.unwrap_or_else(|e| panic!("{user}: {e:?}")))
            });
            let mut lowest = [u64::MAX; 2];
            for (user, d) in futures_util::future::join_all(checks).await {
                assert!(d.allowed, "{user}: {d:?}");
                let i = usize::from(user != first);
                lowest[i] = lowest[i].min(d.remaining);
            }
            lowest
        };
        assert_eq!(round(1).await, [999, 999], "before the migration");
        let migration = Migration::begin(&cluster, slot);
        let (source, target) = (migration.source, migration.target);
        // The script loaded on the target, by a check of a user it holds.
        let local = (0..100_000)
            .map(|i| format!("local-{i}"))
            .find(|u| cluster.node_for_slot(slot_of(u)).ok() == Some(target))
            .expect("a user on the target");
        limiter
            .check_one(local.as_bytes(), policy, 1)
            .await
            .expect("a check on the target");
        migration.migrate(&cluster, &key_of(first));
        let refused = error_replies(cluster.node(source), "TRYAGAIN");

        // Eight checks of each at once: they are batched together, unless the idle limiter
        // sent the first alone before the others came (a busy machine): then again, up to 5
        // times. Sent one by one, the eight checks of the user that moved are redirected to
        // the target together (`ASK`), and each is still answered.
        let mut left = 999;
        let mut batched = false;
        for _ in 0..5 {
            left -= 8;
            let started = Instant::now();
            assert_eq!(round(8).await, [left, left], "the states went on counting");
            let took = started.elapsed();
            assert!(took <= config.get_timeout() + MARGIN, "{took:?}");
            batched = error_replies(cluster.node(source), "TRYAGAIN") > refused;
            if batched {
                break;
            }
        }
        assert!(batched, "no batch held both users");
        // The slot is remembered as migrating: its next batches go check by check at once,
        // and are not refused first.
        let refused = error_replies(cluster.node(source), "TRYAGAIN");
        assert_eq!(round(1).await, [left - 1, left - 1]);
        assert_eq!(
            error_replies(cluster.node(source), "TRYAGAIN"),
            refused,
            "a batch of the migrating slot was refused again"
        );
        // Each state is where it was: the moved one counted on the target, the other on the
        // source, and no new key made on either.
        let slot_arg = slot.to_string();
        for node in [source, target] {
            let keys = cluster
                .node(node)
                .cmd(&["CLUSTER", "COUNTKEYSINSLOT", &slot_arg])
                .expect("COUNTKEYSINSLOT");
            assert_eq!(keys.as_int(), Some(1), "node {node}: {keys:?}");
        }

        // A check of two policies of one user whose states the migration split (one on the
        // source, one not there) cannot run on either node, batched or not: it fails as
        // `Migrating`, in time. The servers are fine: however often that happens, the breaker
        // stays closed, and a user of another slot in its range of 128 gets through.
        let daily = floodgate_core::Policy::per_day(50)
            .and_then(|p| p.named("daily"))
            .expect("valid");
        let both = [
            floodgate_core::Check::new(second.as_bytes(), policy),
            floodgate_core::Check::new(second.as_bytes(), &daily),
        ];
        for _ in 0..5 {
            let started = Instant::now();
            let err = limiter
                .check(&both, floodgate_core::CheckOptions::default())
                .await
                .expect_err("the user's states are split");
            assert!(err.is_migrating() && !err.is_connection(), "{err:?}");
            assert!(started.elapsed() <= config.get_timeout() + MARGIN);
        }
        let neighbour = (0..100_000)
            .map(|i| format!("neighbour-{i}"))
            .find(|u| slot_of(u) != slot && slot_of(u) / 128 == slot / 128)
            .expect("a user in the same range of slots");
        limiter
            .check_one(neighbour.as_bytes(), policy, 1)
            .await
            .expect("a slot in the same breaker range");
        migration.cancel(&cluster);
    });
}

#[test]
fn cluster_routes_scripts_by_slot_and_pipelines_per_slot() {
    let cluster = RedisCluster::start().expect("start a 6-node cluster");
    run(async {
        let (_, conn) = connect_cluster(&cluster, Duration::from_millis(500)).await;
        assert_eq!(conn.kind(), ConnectionKind::Cluster);
        conn.ping().await.expect("PING");
        conn.server_time().await.expect("TIME");
        assert!(!conn.has_redis_cell().await.expect("redis-cell"));

        let script = incr();
        for i in 0..20 {
            let key = format!("user:{i}");
            let value = conn
                .invoke_script(&script, &[key.as_bytes()], &[])
                .await
                .expect("EVALSHA");
            assert_eq!(int(&value), 1, "{key}");
            let owner = cluster.node_for_key(key.as_bytes()).expect("owner");
            let stored = cluster.node(owner).cmd(&["GET", &key]).expect("GET");
            assert_eq!(stored.as_str(), Some("1"), "{key} on its slot's master");
        }

        // NOSCRIPT: the script is loaded on the node serving the key only.
        for node in cluster.nodes() {
            node.cmd_ok(&["SCRIPT", "FLUSH"]).expect("SCRIPT FLUSH");
        }
        let key = b"{tenant-7}:sms";
        let value = conn
            .invoke_script(&script, &[key, b"{tenant-7}:other"], &[])
            .await
            .expect("EVALSHA after NOSCRIPT");
        assert_eq!(int(&value), 1);
        let owner = cluster.node_for_key(key).expect("owner");
        let loaded_on = |index: usize| {
            let reply = cluster
                .node(index)
                .cmd(&["SCRIPT", "EXISTS", script.get_hash()])
                .expect("SCRIPT EXISTS");
            reply.as_array().and_then(|a| a[0].as_int()) == Some(1)
        };
        assert!(loaded_on(owner), "not loaded on the slot's master");
        let masters = cluster.masters().expect("masters");
        assert_eq!(masters.len(), 3);
        for &m in masters.iter().filter(|&&m| m != owner) {
            assert!(
                !loaded_on(m),
                "loaded on master {m}, which does not serve the key"
            );
        }

        let err = conn
            .invoke_script(&script, &[b"{a}x", b"{b}x"], &[])
            .await
            .expect_err("two slots");
        assert!(matches!(err, Error::CrossSlot { .. }), "{err:?}");

        let mut get = redis::cmd("GET");
        get.arg("user:3");
        assert_eq!(conn.query::<i64>(get).await.expect("GET"), 1);

        // One pipeline per slot, concurrently; a cross-slot call fails alone.
        for node in cluster.nodes() {
            node.cmd_ok(&["SCRIPT", "FLUSH"]).expect("SCRIPT FLUSH");
        }
        let keys: Vec<String> = (0..12).map(|i| format!("p{}:{{k{}}}", i, i % 6)).collect();
        let mut calls: Vec<ScriptCall<'_>> = keys
            .iter()
            .map(|k| ScriptCall::new(&script).key(k.as_bytes()))
            .collect();
        calls.push(ScriptCall::new(&script).key("{x}1").key("{y}1"));
        let keyless = Script::new("return 42");
        calls.push(ScriptCall::new(&keyless));
        let results = conn.pipeline_scripts(calls).await.expect("pipeline");
        assert_eq!(results.len(), 14);
        for (i, result) in results[..12].iter().enumerate() {
            assert_eq!(
                int(result.as_ref().expect("pipelined call")),
                1,
                "{}",
                keys[i]
            );
        }
        assert!(
            matches!(&results[12], Err(Error::CrossSlot { .. })),
            "{:?}",
            results[12]
        );
        assert_eq!(int(results[13].as_ref().expect("keyless")), 42);
    });
}

#[test]
fn fault_cluster_failover_of_a_master() {
    let cluster = RedisCluster::start().expect("start a 6-node cluster");
    run(async {
        let (_, conn) = connect_cluster(&cluster, Duration::from_millis(500)).await;
        let script = incr();
        let key = b"{campaign-42}:sent";
        conn.invoke_script(&script, &[key], &[])
            .await
            .expect("before the failover");

        let slot = RedisCluster::key_slot(key);
        let dead = cluster.kill_master_for_slot(slot).expect("kill the master");
        let replica = cluster.replicas_of(dead).expect("replicas")[0];
        // Until a replica takes over, calls for that slot fail, in time.
        let started = Instant::now();
        let err = conn
            .invoke_script(&script, &[key], &[])
            .await
            .expect_err("the slot's master is dead");
        assert!(err.is_timeout() || err.is_connection(), "{err:?}");
        assert!(
            started.elapsed() <= conn.timeout() + MARGIN,
            "{:?}",
            started.elapsed()
        );
        tokio::task::block_in_place(|| {
            cluster.failover(replica).expect("failover");
            cluster
                .wait_healthy(Duration::from_secs(30))
                .expect("healthy cluster");
        });
        assert_eq!(cluster.node_for_key(key).expect("owner"), replica);

        // The client learns the new topology by itself.
        let started = Instant::now();
        let mut last = None;
        let value = loop {
            match conn.invoke_script(&script, &[key], &[]).await {
                Ok(value) => break value,
                Err(e) => {
                    assert!(e.is_timeout() || e.is_connection(), "{e:?}");
                    assert!(
                        started.elapsed() < Duration::from_secs(20),
                        "no success 20 s after the failover; last error: {e:?}"
                    );
                    last = Some(e);
                }
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        };
        println!(
            "first success {:?} after the failover (last error before: {last:?})",
            started.elapsed()
        );
        assert!(int(&value) >= 1);
        let stored = cluster
            .node(replica)
            .cmd(&["GET", "{campaign-42}:sent"])
            .expect("GET");
        assert_eq!(
            stored.as_int().or_else(|| stored.as_str()?.parse().ok()),
            Some(int(&value))
        );
    });
}

#[cfg(feature = "tls")]
mod tls {
    use super::*;

    fn free_port() -> u16 {
        std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("a free port")
            .port()
    }

    #[test]
    fn tls_with_a_private_ca_and_the_insecure_escape_hatch() {
        let dir = tempfile::tempdir().expect("temporary directory");
        floodgate_testkit::tls_certificates(dir.path()).expect("certificates");
        let path = |name: &str| dir.path().join(name).display().to_string();
        let tls_port = free_port();
        let _server = RedisServer::builder()
            .password("tls-secret")
            .config(format!("tls-port {tls_port}"))
            .config(format!("tls-cert-file \"{}\"", path("server.crt")))
            .config(format!("tls-key-file \"{}\"", path("server.key")))
            .config(format!("tls-ca-cert-file \"{}\"", path("ca.crt")))
            .config("tls-auth-clients no")
            .start()
            .expect("start redis-server with TLS");
        let ca = std::fs::read(dir.path().join("ca.crt")).expect("read ca.crt");
        let url = format!("rediss://:tls-secret@127.0.0.1:{tls_port}");
        run(async {
            for kind in SINGLE_KINDS {
                let config = RedisConfig::new(&url)
                    .expect("valid")
                    .connection(kind)
                    // Generous: ring's handshakes are slow in an unoptimized test build.
                    .timeout(Duration::from_secs(3))
                    .tls_ca_cert(ca.clone());
                assert!(config.is_tls());
                let conn = RedisConn::connect(&config).await.expect("TLS connect");
                conn.ping().await.expect("PING over TLS");
                let value = conn
                    .invoke_script(&incr(), &[format!("tls:{kind}").as_bytes()], &[])
                    .await
                    .expect("EVALSHA over TLS");
                assert_eq!(int(&value), 1);

                // The system roots do not know the throwaway CA.
                let untrusted = RedisConfig::new(&url).expect("valid").connection(kind);
                let err = RedisConn::connect(&untrusted)
                    .await
                    .expect_err("unknown CA must be rejected");
                assert!(matches!(err, Error::Connect { .. }), "{err:?}");
                assert!(!format!("{err} {err:?}").contains("tls-secret"));

                let insecure = RedisConfig::new(&url)
                    .expect("valid")
                    .connection(kind)
                    .timeout(Duration::from_secs(3))
                    .tls_insecure();
                let conn = RedisConn::connect(&insecure).await.expect("insecure TLS");
                conn.ping().await.expect("PING over unverified TLS");
            }
        });
    }
}
