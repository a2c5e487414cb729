//! The circuit breaker: while Redis is down, calls fail fast instead of each waiting out its
//! timeout; after a restart, decisions come back within the breaker's longest open period.

mod support;

use std::time::{Duration, Instant};

use floodgate_core::{Check, CheckOptions, Limiter, Policy};
use floodgate_redis::{
    BatchConfig, BreakerConfig, ConnectionKind, Error, RedisConfig, RedisLimiter,
};
use support::{run, server};

#[test]
fn fault_calls_fail_fast_while_redis_is_down_and_recover_after_restart() {
    let server = server();
    run(Duration::from_secs(60), async {
        for kind in [
            ConnectionKind::Multiplexed,
            ConnectionKind::Pool { size: 4 },
        ] {
            let config = RedisConfig::new(&server.url())
                .expect("url")
                .connection(kind)
                .timeout(Duration::from_millis(300));
            let limiter = RedisLimiter::connect(&config).await.expect("connect");
            let p = Policy::per_second(1_000).expect("valid");
            assert!(first_check(&limiter, &p).await.allowed);

            server.kill().expect("kill");
            // The first failures wait for their timeout (or fail on the broken connection)...
            for _ in 0..3 {
                let started = Instant::now();
                let err = limiter.check_one(b"k", &p, 1).await.expect_err("down");
                assert!(err.is_connection() || err.is_timeout(), "{err:?}");
                assert!(
                    started.elapsed() < Duration::from_millis(900),
                    "{:?}",
                    started.elapsed()
                );
            }
            // ...then the breaker is open: every call fails at once.
            let started = Instant::now();
            let mut fast = 0;
            for _ in 0..100 {
                match limiter.check_one(b"k", &p, 1).await {
                    Err(Error::Unavailable { .. }) => fast += 1,
                    Err(e) => assert!(e.is_connection() || e.is_timeout(), "{e:?}"),
                    Ok(d) => panic!("decided while down: {d:?}"),
                }
            }
            assert!(fast >= 90, "{kind}: only {fast} calls failed fast");
            assert!(
                started.elapsed() < Duration::from_secs(2),
                "{kind}: 100 calls took {:?} while the breaker was open",
                started.elapsed()
            );
            assert!(limiter.conn().is_circuit_open());

            // Back up: decisions are served again within the longest open period plus a
            // reconnection.
            server.restart().expect("restart");
            let restarted = Instant::now();
            loop {
                if let Ok(d) = limiter.check_one(b"k", &p, 1).await {
                    assert!(d.allowed);
                    break;
                }
                assert!(
                    restarted.elapsed() < Duration::from_secs(2),
                    "{kind}: still failing {:?} after the restart",
                    restarted.elapsed()
                );
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            assert!(!limiter.conn().is_circuit_open());
        }
    });
}

/// The first check of a new limiter on a server that is up (loading the script takes three
/// round trips): tried again after a timeout, up to five times, since a loaded machine can
/// stall one past these tests' short call timeouts. Their faults come after.
async fn first_check(limiter: &RedisLimiter, p: &Policy) -> floodgate_core::Decision {
    for _ in 0..4 {
        match limiter.check_one(b"k", p, 1).await {
            Err(e) if e.is_timeout() => {}
            result => return result.expect("up"),
        }
    }
    limiter.check_one(b"k", p, 1).await.expect("up")
}

#[test]
fn a_disabled_breaker_waits_for_every_timeout() {
    let server = server();
    run(Duration::from_secs(60), async {
        let config = RedisConfig::new(&server.url())
            .expect("url")
            .timeout(Duration::from_millis(200))
            .circuit_breaker(BreakerConfig::disabled());
        let limiter = RedisLimiter::connect(&config).await.expect("connect");
        let p = Policy::per_second(1_000).expect("valid");
        assert!(first_check(&limiter, &p).await.allowed);
        server.pause().expect("pause");
        for _ in 0..5 {
            let err = limiter.check_one(b"k", &p, 1).await.expect_err("paused");
            assert!(err.is_timeout(), "{err:?}");
        }
        server.resume().expect("resume");
    });
}

/// A probe whose caller gives up (a cancelled request) must not leave the breaker half-open:
/// once Redis answers again, decisions come back.
#[test]
fn fault_a_cancelled_probe_does_not_wedge_the_breaker() {
    let server = server();
    run(Duration::from_secs(60), async {
        let config = RedisConfig::new(&server.url())
            .expect("url")
            .timeout(Duration::from_millis(300))
            .circuit_breaker(BreakerConfig {
                open_for: Duration::from_millis(50),
                max_open_for: Duration::from_millis(50),
                ..BreakerConfig::default()
            });
        let limiter = RedisLimiter::connect(&config).await.expect("connect");
        let p = Policy::per_second(1_000).expect("valid");
        assert!(first_check(&limiter, &p).await.allowed);

        server.pause().expect("pause");
        // Direct calls (as the lock makes): the caller's future is the call itself.
        let conn = limiter.conn();
        for _ in 0..3 {
            let err = conn.ping().await.expect_err("paused");
            assert!(err.is_timeout(), "{err:?}");
        }
        assert!(limiter.conn().is_circuit_open());
        tokio::time::sleep(Duration::from_millis(60)).await;
        // This call is the probe; its caller gives up long before the call timeout.
        let gave_up = tokio::time::timeout(Duration::from_millis(20), conn.ping()).await;
        assert!(gave_up.is_err(), "the paused server answered: {gave_up:?}");
        server.resume().expect("resume");

        let resumed = Instant::now();
        loop {
            match limiter.check_one(b"k", &p, 1).await {
                Ok(d) => {
                    assert!(d.allowed);
                    break;
                }
                Err(e) => assert!(e.is_connection() || e.is_timeout(), "{e:?}"),
            }
            assert!(
                resumed.elapsed() < Duration::from_secs(2),
                "still failing {:?} after the server came back",
                resumed.elapsed()
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert!(!limiter.conn().is_circuit_open());
    });
}

/// A server that is up but refuses writes is unavailable, not one key's script error: out of
/// memory under `maxmemory` with `noeviction`, or a replica (a failover demoted the node the
/// client still talks to). Whatever path a check takes (the GCRA batch script, the generic
/// script's deferred writes, an all-or-nothing group on its own `pcall`), the error is
/// [`Error::NotServing`], so the breaker opens and a layer's failure policy takes over instead
/// of every request paying a round trip and a warning. Decisions come back once it serves.
#[test]
fn fault_a_server_that_refuses_writes_is_unavailable() {
    // `other` is the master the server is made a replica of.
    let (server, other) = (server(), server());
    run(Duration::from_secs(60), async {
        let gcra = Policy::per_second(1_000).expect("valid");
        let window = Policy::fixed_window(1_000, Duration::from_secs(60)).expect("valid");
        let log = Policy::sliding_log(1_000, Duration::from_secs(60)).expect("valid");
        let config = RedisConfig::new(&server.url())
            .expect("url")
            .timeout(Duration::from_secs(2))
            .circuit_breaker(BreakerConfig::disabled());
        let batched = RedisLimiter::connect(&config).await.expect("connect");
        let unbatched = support::limiter_batching(&config, BatchConfig::disabled()).await;
        for limiter in [&batched, &unbatched] {
            assert!(
                limiter
                    .check_one(b"up", &gcra, 1)
                    .await
                    .expect("up")
                    .allowed
            );
        }

        let port = other.port().to_string();
        let refusals: [(&str, &[&str], &[&str]); 2] = [
            (
                "OOM",
                &["CONFIG", "SET", "maxmemory", "1"],
                &["CONFIG", "SET", "maxmemory", "0"],
            ),
            (
                "READONLY",
                &["REPLICAOF", "127.0.0.1", &port],
                &["REPLICAOF", "NO", "ONE"],
            ),
        ];
        server
            .cmd_ok(&["CONFIG", "SET", "maxmemory-policy", "noeviction"])
            .expect("CONFIG SET");
        other
            .cmd_ok(&["CONFIG", "SET", "repl-diskless-sync-delay", "0"])
            .expect("CONFIG SET");
        for (code, refuse, serve) in refusals {
            server.cmd_ok(refuse).expect("refuse writes");
            // A replica answers LOADING or MASTERDOWN while it syncs: wait for READONLY.
            let synced = Instant::now();
            while code == "READONLY" && !replica_synced(&server) {
                assert!(synced.elapsed() < Duration::from_secs(10), "never synced");
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            for (name, limiter) in [("batched", &batched), ("unbatched", &unbatched)] {
                // New keys: each check must write.
                let (single, key) = (format!("{code}-{name}-1"), format!("{code}-{name}-2"));
                let one = [Check::new(single.as_bytes(), &gcra)];
                let group = [
                    Check::new(key.as_bytes(), &window),
                    Check::new(key.as_bytes(), &log),
                ];
                for checks in [&one[..], &group[..]] {
                    let err = limiter
                        .check(checks, CheckOptions::default())
                        .await
                        .expect_err("the server refuses writes");
                    match &err {
                        Error::NotServing { message, .. } => {
                            assert!(message.starts_with(code), "{name}: {message}");
                        }
                        // A client leaves a server that answers READONLY (a demoted primary,
                        // see below): a call made meanwhile finds its connection closed.
                        _ if code == "READONLY" && err.is_connection() => {}
                        _ => panic!("{code} {name}: expected NotServing, got {err:?}"),
                    }
                    assert!(err.is_connection(), "{code} {name}: {err:?}");
                    assert!(RedisLimiter::is_unavailable(&err), "{code} {name}: {err:?}");
                }
            }
            // With the breaker on, refusals inside the script (a group's, the others
            // answered) open it as whole-call failures do: each must not count as a success.
            let guarded = RedisLimiter::connect(
                &RedisConfig::new(&server.url())
                    .expect("url")
                    .timeout(Duration::from_secs(2)),
            )
            .await
            .expect("connect");
            for i in 0..3 {
                let key = format!("{code}-guarded-{i}");
                let group = [
                    Check::new(key.as_bytes(), &window),
                    Check::new(key.as_bytes(), &log),
                ];
                let err = guarded
                    .check(&group, CheckOptions::default())
                    .await
                    .expect_err("refused");
                assert!(err.is_connection(), "{code}: {err:?}");
            }
            assert!(guarded.conn().is_circuit_open(), "{code}");

            server.cmd_ok(serve).expect("serve again");
            for limiter in [&batched, &unbatched] {
                // (Once the client is done connecting again, after READONLY.)
                let again = Instant::now();
                let d = loop {
                    match limiter.check_one(code.as_bytes(), &gcra, 1).await {
                        Err(e) if e.is_connection() && again.elapsed() < Duration::from_secs(5) => {
                            tokio::time::sleep(Duration::from_millis(50)).await;
                        }
                        d => break d,
                    }
                };
                assert!(d.expect("serving again").allowed, "{code}");
            }
        }
    });
}

/// Whether `server`, made a replica, has synced with its master.
fn replica_synced(server: &floodgate_testkit::RedisServer) -> bool {
    let status = server.info("replication", "master_link_status");
    status.expect("INFO").as_deref() == Some("up")
}

/// A lazy connection starts while Redis is down: no wait and no error at start, checks fail as
/// unavailable (so a layer's failure policy can decide them) and quickly (the breaker), and
/// decisions come once Redis is up. A bad configuration is still refused at once.
#[test]
fn fault_a_lazy_connection_starts_while_redis_is_down() {
    let server = server();
    server.kill().expect("kill");
    run(Duration::from_secs(60), async {
        let bad = RedisConfig::new(&server.url())
            .expect("url")
            .connection(ConnectionKind::Pool { size: 0 });
        assert!(
            matches!(RedisLimiter::connect_lazy(&bad), Err(Error::Config(_))),
            "a pool of no connection is refused at once"
        );
        for kind in [
            ConnectionKind::Multiplexed,
            ConnectionKind::Pool { size: 2 },
        ] {
            let config = RedisConfig::new(&server.url())
                .expect("url")
                .connection(kind)
                .timeout(Duration::from_millis(300))
                .connect_timeout(Duration::from_millis(300));
            assert!(
                RedisLimiter::connect(&config).await.is_err(),
                "{kind}: connected to a server that is down"
            );
            let limiter = RedisLimiter::connect_lazy(&config).expect("lazy");
            let p = Policy::per_second(1_000).expect("valid");
            let started = Instant::now();
            for _ in 0..20 {
                let err = limiter.check_one(b"k", &p, 1).await.expect_err("down");
                assert!(RedisLimiter::is_unavailable(&err), "{kind}: {err:?}");
            }
            assert!(
                started.elapsed() < Duration::from_secs(2),
                "{kind}: 20 checks took {:?}",
                started.elapsed()
            );

            server.restart().expect("restart");
            let restarted = Instant::now();
            loop {
                match limiter.check_one(b"k", &p, 1).await {
                    Ok(d) => {
                        assert!(d.allowed);
                        break;
                    }
                    Err(e) => assert!(RedisLimiter::is_unavailable(&e), "{kind}: {e:?}"),
                }
                assert!(
                    restarted.elapsed() < Duration::from_secs(3),
                    "{kind}: still failing {:?} after Redis came up",
                    restarted.elapsed()
                );
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            server.kill().expect("kill");
        }
    });
}

/// A TCP proxy on loopback to one Redis port, which can be pointed at another: the stable
/// endpoint (a DNS name) of a managed Redis, whose primary moves in a failover. Connections
/// made before a move stay with the server they reached.
struct Endpoint {
    port: u16,
    upstream: std::sync::Arc<std::sync::atomic::AtomicU16>,
}

impl Endpoint {
    async fn start(upstream: u16) -> Self {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let port = listener.local_addr().expect("addr").port();
        let upstream = std::sync::Arc::new(std::sync::atomic::AtomicU16::new(upstream));
        let to = std::sync::Arc::clone(&upstream);
        tokio::spawn(async move {
            while let Ok((mut client, _)) = listener.accept().await {
                let port = to.load(std::sync::atomic::Ordering::SeqCst);
                tokio::spawn(async move {
                    if let Ok(mut server) =
                        tokio::net::TcpStream::connect(("127.0.0.1", port)).await
                    {
                        let _ = tokio::io::copy_bidirectional(&mut client, &mut server).await;
                    }
                });
            }
        });
        Endpoint { port, upstream }
    }

    fn point_to(&self, port: u16) {
        self.upstream
            .store(port, std::sync::atomic::Ordering::SeqCst);
    }
}

/// A failover behind a stable endpoint: the old primary is demoted (`REPLICAOF`, so it answers
/// `READONLY`) and keeps the client's connections, while the endpoint now leads to the new
/// one. The client leaves the demoted server for the endpoint's new primary instead of being
/// refused by it for as long as its connections last.
#[test]
fn fault_a_demoted_primary_is_left_for_the_one_the_endpoint_leads_to() {
    let (old, new) = (server(), server());
    run(Duration::from_secs(90), async {
        let p = Policy::per_second(1_000).expect("valid");
        let endpoint = Endpoint::start(old.port()).await;
        for kind in [
            ConnectionKind::Multiplexed,
            ConnectionKind::Pool { size: 3 },
        ] {
            old.cmd_ok(&["REPLICAOF", "NO", "ONE"])
                .expect("primary again");
            endpoint.point_to(old.port());
            let config = RedisConfig::new(&format!("redis://127.0.0.1:{}", endpoint.port))
                .expect("url")
                .connection(kind)
                .timeout(Duration::from_secs(1));
            let limiter = RedisLimiter::connect(&config).await.expect("connect");
            assert!(first_check(&limiter, &p).await.allowed);

            old.cmd_ok(&["REPLICAOF", "127.0.0.1", &new.port().to_string()])
                .expect("demoted");
            endpoint.point_to(new.port());
            let err = limiter.check_one(b"k", &p, 1).await.expect_err("READONLY");
            assert!(err.is_connection(), "{err:?}");
            let deadline = Instant::now() + Duration::from_secs(15);
            let mut refused = 0;
            loop {
                match limiter.check_one(b"k", &p, 1).await {
                    Ok(d) => {
                        assert!(d.allowed);
                        break;
                    }
                    Err(e) => {
                        assert!(e.is_connection(), "{e:?}");
                        refused += 1;
                    }
                }
                assert!(
                    Instant::now() < deadline,
                    "{kind:?}: still refused after {refused} tries: the demoted server kept"
                );
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    });
}

/// A connection over `config` that has run `return 1` once, to a server then paused; and
/// that script.
async fn paused_conn(
    server: &floodgate_testkit::RedisServer,
    config: &RedisConfig,
) -> (floodgate_redis::RedisConn, redis::Script) {
    let conn = floodgate_redis::RedisConn::connect(config)
        .await
        .expect("connect");
    let script = redis::Script::new("return 1");
    conn.invoke_script(&script, &[b"k"], &[]).await.expect("up");
    server.pause().expect("pause");
    (conn, script)
}

/// The error of one call of `script` given `within` (the configured timeout when `None`).
async fn failed_call(
    conn: &floodgate_redis::RedisConn,
    script: &redis::Script,
    within: Option<Duration>,
) -> Error {
    match within {
        Some(within) => {
            conn.invoke_script_within(script, &[b"k"], &[], within)
                .await
        }
        None => conn.invoke_script(script, &[b"k"], &[]).await,
    }
    .expect_err("paused")
}

/// Calls given a small share of the timeout (batched checks that waited for the pipeline) time
/// out on a server that is merely slow: those timeouts do not open the breaker, while as many
/// with the whole timeout do.
#[test]
fn timeouts_of_calls_with_little_time_do_not_open_the_breaker() {
    let server = server();
    run(Duration::from_secs(60), async {
        let config = RedisConfig::new(&server.url())
            .expect("url")
            .timeout(Duration::from_millis(400));
        let (conn, script) = paused_conn(&server, &config).await;
        // A tenth of the timeout each: timeouts, and the breaker stays closed.
        for _ in 0..6 {
            let err = failed_call(&conn, &script, Some(Duration::from_millis(40))).await;
            assert!(err.is_timeout(), "{err:?}");
        }
        assert!(!conn.is_circuit_open());
        // The whole timeout: three in a row open it.
        for _ in 0..3 {
            let err = failed_call(&conn, &script, None).await;
            assert!(err.is_timeout(), "{err:?}");
        }
        assert!(conn.is_circuit_open());
        server.resume().expect("resume");
    });
}

/// A short call that is the breaker's probe, and times out, counts as a failure: the breaker
/// stays open for its (doubled) period, instead of letting the very next call probe again.
#[test]
fn a_short_probe_that_times_out_keeps_the_breaker_open() {
    let server = server();
    run(Duration::from_secs(60), async {
        let config = RedisConfig::new(&server.url())
            .expect("url")
            .timeout(Duration::from_millis(400))
            .circuit_breaker(BreakerConfig {
                open_for: Duration::from_millis(50),
                max_open_for: Duration::from_secs(5),
                ..BreakerConfig::default()
            });
        let (conn, script) = paused_conn(&server, &config).await;
        for _ in 0..3 {
            let err = failed_call(&conn, &script, None).await;
            assert!(err.is_timeout(), "{err:?}");
        }
        assert!(conn.is_circuit_open());
        tokio::time::sleep(Duration::from_millis(60)).await;
        // The probe, with a tenth of the timeout.
        let err = failed_call(&conn, &script, Some(Duration::from_millis(40))).await;
        assert!(err.is_timeout(), "{err:?}");
        // Open again, for 100 ms now: the next call fails fast.
        let err = failed_call(&conn, &script, Some(Duration::from_millis(40))).await;
        assert!(matches!(err, Error::Unavailable { .. }), "{err:?}");
        server.resume().expect("resume");
    });
}
