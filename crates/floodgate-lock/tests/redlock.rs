//! Redlock over 5 independent servers: keeps working with 2 killed, fails cleanly (an error,
//! no hang past the deadline) with 3 killed, releases a partial acquisition on every node,
//! and keeps its fencing tokens increasing across node failures.

mod support;

use std::time::Duration;

use floodgate_lock::{Error, Lock, LockStore, Redlock};
use floodgate_testkit::{RedisServers, TcpProxy};
use support::{redis_locks_with, run, scripts_run, servers};
use tokio::time::Instant;

const TTL: Duration = Duration::from_secs(5);

async fn redlock(servers: &RedisServers) -> Redlock {
    let mut nodes = Vec::new();
    for s in servers.iter() {
        nodes.push(redis_locks_with(&s.url(), Duration::from_millis(500)).await);
    }
    Redlock::new(nodes)
        .expect("nodes")
        .with_node_timeout(Duration::from_millis(300))
        .expect("timeout")
}

/// Takes and gives back a lock on every node: each node's connection is open and its scripts
/// are loaded, so that a node paused next has only the next call's commands pending.
async fn warm_up(redlock: &Redlock) {
    let warm = redlock
        .try_lock(b"warm", b"mine", TTL)
        .await
        .expect("all up");
    assert!(matches!(warm, floodgate_lock::LockAttempt::Acquired { .. }));
    redlock.unlock(b"warm", b"mine").await.expect("unlock");
}

/// Someone else's lock `name` on nodes 0, 1 and 2 (a quorum of 5); its Redis key.
async fn held_by_other(servers: &RedisServers, name: &[u8]) -> Vec<u8> {
    let node = redis_locks_with(&servers.servers()[0].url(), Duration::from_secs(1)).await;
    let key = node.lock_key(name);
    for i in [0, 1, 2] {
        servers.servers()[i]
            .cmd(&[&b"SET"[..], &key, b"other", b"PX", b"60000"])
            .expect("SET");
    }
    key
}

/// Asserts that no server holds the lock key `key`.
fn assert_unlocked_everywhere(servers: &RedisServers, key: &[u8]) {
    for server in servers.iter() {
        let exists = server.cmd(&[&b"EXISTS"[..], key]).expect("EXISTS");
        assert_eq!(
            exists,
            floodgate_testkit::Resp::Int(0),
            "still locked on {}",
            server.url()
        );
    }
}

#[test]
fn keeps_working_with_two_of_five_nodes_down() {
    let servers = servers(5);
    run(Duration::from_secs(60), async {
        let redlock = redlock(&servers).await;
        assert_eq!(redlock.quorum(), 3);
        let lock = Lock::new(redlock.clone(), "report", TTL).expect("valid");
        let mut last = lock
            .acquire(Duration::from_secs(2))
            .await
            .expect("all up")
            .fence();

        servers.servers()[1].kill().expect("kill");
        servers.servers()[3].kill().expect("kill");
        let contender = Lock::new(redlock, "report", TTL).expect("valid");
        for _ in 0..20 {
            let guard = lock
                .acquire(Duration::from_secs(5))
                .await
                .expect("quorum of 3");
            assert!(guard.fence() > last, "{} after {last}", guard.fence());
            last = guard.fence();
            assert!(
                contender
                    .try_acquire()
                    .await
                    .expect("3 nodes answer")
                    .is_none()
            );
            guard.extend().await.expect("extended on the quorum");
            guard.release().await.expect("released on the quorum");
        }
    });
}

/// A node down at start, and slower to connect to than the node timeout once it is back (far
/// away, or behind TLS), still joins: its connection is made in a task of its own, not inside
/// calls that give up at the node timeout. With another node down, the quorum needs it.
#[test]
fn a_node_down_at_start_and_slow_to_connect_joins_later() {
    let servers = servers(3);
    let slow = TcpProxy::start(servers.servers()[2].addr()).expect("proxy");
    run(Duration::from_secs(60), async {
        servers.servers()[2].kill().expect("kill");
        let urls = [
            servers.servers()[0].url(),
            servers.servers()[1].url(),
            slow.url(),
        ];
        let redlock = Redlock::connect(&urls)
            .await
            .expect("a quorum of 2 at start")
            .with_node_timeout(Duration::from_millis(300))
            .expect("timeout");
        servers.servers()[2].restart().expect("restart");
        // Every new connection to it takes 600 ms to answer, twice the node timeout.
        slow.delay_new_connections(Duration::from_millis(600));
        let lock = Lock::new(redlock, "report", TTL).expect("valid");
        // Asked now, node 2 times out (and starts connecting).
        let guard = lock
            .acquire(Duration::from_secs(5))
            .await
            .expect("nodes 0 and 1");
        guard.release().await.expect("released");
        tokio::time::sleep(Duration::from_millis(1_500)).await;
        servers.servers()[0].kill().expect("kill");
        let guard = lock
            .acquire(Duration::from_secs(5))
            .await
            .expect("nodes 1 and 2: node 2 joined");
        guard.release().await.expect("released");
    });
}

/// A quorum that grants the lock after the lease has run out (a node waited for up to the node
/// timeout, longer than the lease) is a store too slow for the lease, not a lock someone holds:
/// an error that says so. (The grant is given back everywhere too; the lease, shorter than the
/// wait, has run out by the time that could be seen.)
#[test]
fn a_grant_later_than_the_lease_is_answered_too_late_not_busy() {
    let servers = servers(3);
    run(Duration::from_secs(60), async {
        let redlock = redlock(&servers).await;
        warm_up(&redlock).await;
        let ttl = Duration::from_millis(200);
        let lock = Lock::new(redlock.clone(), "report", ttl).expect("valid");
        servers.servers()[2].pause().expect("SIGSTOP");
        let e = lock.try_acquire().await.expect_err("too late");
        servers.servers()[2].resume().expect("SIGCONT");
        assert!(matches!(e, Error::AnsweredTooLate { .. }), "{e}");
        assert!(e.is_transient(), "{e}");
    });
}

#[test]
fn fails_cleanly_with_three_of_five_nodes_down() {
    let servers = servers(5);
    run(Duration::from_secs(60), async {
        let redlock = redlock(&servers).await;
        let lock = Lock::new(redlock, "report", TTL).expect("valid");
        for i in [0, 2, 4] {
            servers.servers()[i].kill().expect("kill");
        }
        let started = Instant::now();
        let e = lock.try_acquire().await.expect_err("no quorum");
        assert!(matches!(e, Error::NoQuorum { failed: 3, .. }), "{e}");
        assert!(e.is_transient());

        let wait = Duration::from_secs(1);
        let started_wait = Instant::now();
        let e = lock.acquire(wait).await.expect_err("no quorum");
        let took = started_wait.elapsed();
        eprintln!("gave up after {took:?} (wait {wait:?}): {e}");
        assert!(matches!(e, Error::NoQuorum { .. }), "{e}");
        // The deadline plus at most one attempt bounded by the node timeout.
        assert!(took < wait + Duration::from_millis(900), "{took:?}");
        assert!(started.elapsed() < Duration::from_secs(5));
    });
}

#[test]
fn a_failed_attempt_releases_on_every_node() {
    let servers = servers(5);
    run(Duration::from_secs(60), async {
        let redlock = redlock(&servers).await;
        // Someone else holds it on 3 of the 5 nodes.
        let key = held_by_other(&servers, b"split").await;
        let attempt = redlock
            .try_lock(b"split", b"mine", TTL)
            .await
            .expect("every node answered");
        assert!(
            matches!(attempt, floodgate_lock::LockAttempt::Held { .. }),
            "{attempt:?}"
        );
        // The 2 nodes it got were released again; the other owner's keys are untouched.
        for i in [3, 4] {
            let exists = servers.servers()[i]
                .cmd(&[&b"EXISTS"[..], key.as_slice()])
                .expect("EXISTS");
            assert_eq!(
                exists.as_int(),
                Some(0),
                "node {i} still holds our partial lock"
            );
        }
        for i in [0, 1, 2] {
            let value = servers.servers()[i]
                .cmd(&[&b"GET"[..], key.as_slice()])
                .expect("GET");
            assert_eq!(value.as_str(), Some("other"));
        }
    });
}

#[test]
fn fencing_tokens_keep_increasing_when_nodes_lose_their_data() {
    let servers = servers(5);
    run(Duration::from_secs(90), async {
        let redlock = redlock(&servers).await;
        let lock = Lock::new(redlock, "fenced", TTL).expect("valid");
        let mut last = 0;
        // Each round, a different node restarts empty (its counter gone) and another is down.
        for round in 0..5 {
            servers.servers()[round].restart().expect("restart");
            servers.servers()[(round + 1) % 5].kill().expect("kill");
            for _ in 0..5 {
                let guard = lock.acquire(Duration::from_secs(5)).await.expect("quorum");
                assert!(
                    guard.fence() > last,
                    "round {round}: {} after {last}",
                    guard.fence()
                );
                last = guard.fence();
                guard.release().await.expect("release");
            }
            servers.servers()[(round + 1) % 5]
                .restart()
                .expect("restart");
        }
    });
}

#[test]
fn a_failed_attempt_releases_on_a_node_that_timed_out_too() {
    let servers = servers(5);
    run(Duration::from_secs(60), async {
        let redlock = redlock(&servers).await;
        warm_up(&redlock).await;
        let key = held_by_other(&servers, b"slow").await;
        // Node 3 answers too late: it cools off, yet it takes our lock when it wakes up.
        let scripts_before = scripts_run(&servers.servers()[3]);
        servers.servers()[3].pause().expect("pause");
        let attempt = redlock
            .try_lock(b"slow", b"mine", TTL)
            .await
            .expect("a quorum answered");
        assert!(
            matches!(attempt, floodgate_lock::LockAttempt::Held { .. }),
            "{attempt:?}"
        );
        servers.servers()[3].resume().expect("resume");
        // The unlock sent after the lock runs after it: once node 3 has run both, it keeps
        // nothing for nobody.
        let started = Instant::now();
        while scripts_run(&servers.servers()[3]) < scripts_before + 2 {
            assert!(
                started.elapsed() < Duration::from_secs(2),
                "node 3 never got the unlock"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let value = servers.servers()[3]
            .cmd(&[&b"GET"[..], key.as_slice()])
            .expect("GET");
        assert_ne!(
            value.as_str(),
            Some("mine"),
            "node 3 holds our lock for its ttl"
        );
    });
}

/// Of 3 nodes, one is down and one answered once too late: while the late one cools off, the
/// two that answer are still a quorum, and are both asked. Passing the late one over for its
/// cool-off would fail every call of that second with `NoQuorum` (and lose a lease due for
/// renewal in it).
#[test]
fn a_node_cooling_off_is_asked_when_a_quorum_needs_it() {
    let servers = servers(3);
    run(Duration::from_secs(60), async {
        let redlock = redlock(&servers).await;
        warm_up(&redlock).await;
        servers.servers()[2].kill().expect("kill");
        // Node 1 answers too late once: it cools off for a second.
        servers.servers()[1].pause().expect("pause");
        let slow = redlock.try_lock(b"slow", b"mine", TTL).await;
        servers.servers()[1].resume().expect("resume");
        assert!(
            matches!(slow, Err(Error::NoQuorum { .. })),
            "one node of three answered: {slow:?}"
        );
        // At once, well inside node 1's cool-off.
        let started = Instant::now();
        let attempt = redlock
            .try_lock(b"next", b"mine", TTL)
            .await
            .expect("nodes 0 and 1 answer");
        assert!(
            matches!(attempt, floodgate_lock::LockAttempt::Acquired { .. }),
            "{attempt:?}"
        );
        assert!(started.elapsed() < Duration::from_secs(1));
    });
}

#[test]
fn raising_a_corrupt_fencing_counter_is_an_error_that_writes_nothing() {
    let server = floodgate_testkit::RedisServer::start().expect("start redis-server");
    let script = concat!(
        include_str!("../src/redis_locks/fence.lua"),
        include_str!("../src/redis_locks/raise_fence.lua")
    );
    server.cmd(&["SET", "lock", "mine"]).expect("SET");
    for corrupt in ["garbage", "nan", "inf", "1e300", "9007199254740993"] {
        server.cmd(&["SET", "fence", corrupt]).expect("SET");
        let reply = server
            .cmd(&["EVAL", script, "2", "lock", "fence", "mine", "42", "60000"])
            .expect("EVAL");
        assert!(
            matches!(&reply, floodgate_testkit::Resp::Error(e) if e.starts_with("FLOODGATE_CORRUPT")),
            "{corrupt}: {reply:?}"
        );
        let now = server.cmd(&["GET", "fence"]).expect("GET");
        assert_eq!(now.as_bytes(), Some(corrupt.as_bytes()), "overwritten");
    }
    // A sound counter is raised.
    server.cmd(&["SET", "fence", "7"]).expect("SET");
    let reply = server
        .cmd(&["EVAL", script, "2", "lock", "fence", "mine", "42", "60000"])
        .expect("EVAL");
    assert_eq!(reply.as_int(), Some(1));
    let now = server.cmd(&["GET", "fence"]).expect("GET");
    assert_eq!(now.as_bytes(), Some(&b"42"[..]));
}

#[test]
fn a_node_that_cannot_answer_makes_a_renewal_undecided_not_lost() {
    let servers = servers(3);
    run(Duration::from_secs(60), async {
        let redlock = redlock(&servers).await;
        let lock = Lock::new(redlock, "undecided", TTL).expect("valid");
        let guard = lock.try_acquire().await.expect("ok").expect("free");
        // Node 2 lost our key (a restart without persistence); node 1 hangs.
        let node = redis_locks_with(&servers.servers()[0].url(), Duration::from_secs(1)).await;
        let key = node.lock_key(b"undecided");
        servers.servers()[2].cmd(&[&b"DEL"[..], &key]).expect("DEL");
        servers.servers()[1].pause().expect("pause");
        // One node says ours, one not, one cannot say: a quorum of two may still hold it.
        let e = guard.extend().await.expect_err("undecided");
        servers.servers()[1].resume().expect("resume");
        assert!(matches!(e, Error::NoQuorum { failed: 1, .. }), "{e}");
        assert!(e.is_transient(), "{e}");
        assert!(!guard.is_lost(), "not reported lost");
        // Node 1 answers again, once its cool-off after the timeout is over: still ours on a
        // quorum.
        tokio::time::sleep(Duration::from_millis(1100)).await;
        guard.extend().await.expect("extended on nodes 0 and 1");
        guard.release().await.expect("released on the quorum");
    });
}

/// A release while two of three nodes cool off (each timed out once) asks them all the same:
/// the two that answer after all make a quorum, and the release is reported done. Passed over
/// (unlocked in the background), they counted as failed and the release was `NoQuorum`.
#[test]
fn a_release_with_a_majority_cooling_off_asks_them_all() {
    let servers = servers(3);
    run(Duration::from_secs(60), async {
        let redlock = redlock(&servers).await;
        warm_up(&redlock).await;
        let lock = Lock::new(redlock.clone(), "cooling", TTL).expect("valid");
        let guard = lock.try_acquire().await.expect("ok").expect("free");
        for i in [1, 2] {
            servers.servers()[i].pause().expect("pause");
        }
        let e = guard.extend().await.expect_err("nodes 1 and 2 time out");
        for i in [1, 2] {
            servers.servers()[i].resume().expect("resume");
        }
        assert!(matches!(e, Error::NoQuorum { failed: 2, .. }), "{e}");
        // At once, well inside both nodes' cool-off.
        guard.release().await.expect("released on every node");
        let node = redis_locks_with(&servers.servers()[0].url(), Duration::from_secs(1)).await;
        let key = node.lock_key(b"cooling");
        assert_unlocked_everywhere(&servers, &key);
    });
}

/// Our lock is held on nodes 0 and 1 (a quorum of 3); node 2 answers, but never had it.
/// Node 0 answers one call about another lock too late, and cools off: the nodes not cooling
/// off are still a quorum, but only one of them holds our lock. A renewal and a release inside
/// node 0's cool-off ask it all the same: extended, then released, on the quorum that holds
/// it. Passed over, node 0 made the renewal `NoQuorum`, and the release's retry "lost".
#[test]
fn a_node_cooling_off_that_holds_our_lock_is_asked() {
    let servers = servers(3);
    run(Duration::from_secs(60), async {
        let redlock = redlock(&servers).await;
        warm_up(&redlock).await;
        let lock = Lock::new(redlock.clone(), "held", TTL).expect("valid");
        let guard = lock.try_acquire().await.expect("ok").expect("free");
        let node = redis_locks_with(&servers.servers()[0].url(), Duration::from_secs(1)).await;
        let key = node.lock_key(b"held");
        servers.servers()[2].cmd(&[&b"DEL"[..], &key]).expect("DEL");
        servers.servers()[0].pause().expect("pause");
        let other = redlock.try_lock(b"other", b"theirs", TTL).await;
        servers.servers()[0].resume().expect("resume");
        assert!(
            matches!(other, Ok(floodgate_lock::LockAttempt::Acquired { .. })),
            "nodes 1 and 2 granted it: {other:?}"
        );
        // At once, well inside node 0's cool-off.
        let started = Instant::now();
        guard.extend().await.expect("extended on nodes 0 and 1");
        guard.release().await.expect("released on nodes 0 and 1");
        assert!(started.elapsed() < Duration::from_secs(1));
        assert_unlocked_everywhere(&servers, &key);
    });
}

#[test]
fn half_the_nodes_saying_not_ours_is_lost_even_when_the_others_fail() {
    let servers = servers(4);
    run(Duration::from_secs(60), async {
        let redlock = redlock(&servers).await;
        let lock = Lock::new(redlock, "halves", TTL).expect("valid");
        let guard = lock.try_acquire().await.expect("ok").expect("free");
        let node = redis_locks_with(&servers.servers()[0].url(), Duration::from_secs(1)).await;
        let key = node.lock_key(b"halves");
        for i in [0, 1] {
            servers.servers()[i].cmd(&[&b"DEL"[..], &key]).expect("DEL");
        }
        for i in [2, 3] {
            servers.servers()[i].pause().expect("pause");
        }
        // Two of four say "not ours": the other two cannot make a quorum of three.
        let e = guard.extend().await.expect_err("lost");
        for i in [2, 3] {
            servers.servers()[i].resume().expect("resume");
        }
        assert!(e.is_lost(), "{e}");
        assert!(guard.is_lost());
    });
}

#[test]
fn an_invalid_node_url_is_a_configuration_error() {
    let servers = servers(1);
    run(Duration::from_secs(20), async {
        let urls = [servers.servers()[0].url(), "not a url".to_owned()];
        let e = Redlock::connect(urls.iter())
            .await
            .expect_err("invalid URL");
        assert!(matches!(&e, Error::Invalid(m) if m.contains("URL")), "{e}");
    });
}

/// Two URLs that reach one server (here two of its databases) vote as two nodes: with one
/// more server, that one server alone would be a quorum. `connect` asks each node who it is
/// and refuses them; independent servers pass.
#[test]
fn one_server_behind_two_urls_is_refused() {
    let servers = servers(2);
    run(Duration::from_secs(20), async {
        let (a, b) = (servers.servers()[0].url(), servers.servers()[1].url());
        let urls = [a.clone(), format!("{a}/1"), b.clone()];
        let e = Redlock::connect(urls.iter())
            .await
            .expect_err("one server twice");
        assert!(
            matches!(&e, Error::Invalid(m) if m.contains("are one server")),
            "{e}"
        );
        let independent = Redlock::connect([a, b].iter())
            .await
            .expect("independent servers");
        independent
            .check_independence()
            .await
            .expect("still independent");
    });
}

/// A master and its replica are one replication group: a failover would hand the replica's
/// (possibly older) copy of the lock to the next holder. `connect` refuses them too.
#[test]
fn a_master_and_its_replica_are_refused() {
    let servers = servers(2);
    let master = &servers.servers()[0];
    // Sync at once rather than after the default 5 s wait for more replicas.
    master
        .cmd_ok(&["CONFIG", "SET", "repl-diskless-sync-delay", "0"])
        .expect("CONFIG SET");
    let replica = floodgate_testkit::RedisServer::builder()
        .config(format!("replicaof 127.0.0.1 {}", master.port()))
        .start()
        .expect("replica");
    // The replica takes the master's replication id once it has synced.
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let info = replica.cmd(&["INFO", "replication"]).expect("INFO");
        let info = String::from_utf8_lossy(info.as_bytes().expect("bulk")).into_owned();
        if info.contains("master_link_status:up") {
            break;
        }
        assert!(std::time::Instant::now() < deadline, "never synced: {info}");
        std::thread::sleep(Duration::from_millis(50));
    }
    run(Duration::from_secs(20), async {
        let urls = [master.url(), replica.url(), servers.servers()[1].url()];
        let e = Redlock::connect(urls.iter())
            .await
            .expect_err("a master and its replica");
        assert!(
            matches!(&e, Error::Invalid(m) if m.contains("copy one dataset")),
            "{e}"
        );
    });
}
