//! A holder that dies without releasing blocks the others for no longer than its lease: a
//! guard leaked with `mem::forget` (and its client dropped), a task aborted mid-section (its
//! guard's drop releases at once), and a separate process killed with SIGKILL.

mod support;

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::Duration;

use floodgate_lock::{Lock, MemoryLocks};
use support::{redis_locks, run, server};
use tokio::time::Instant;

/// Slack for scheduling on a loaded machine; the bound checked is "ttl + slack".
const SLACK: Duration = Duration::from_millis(700);

#[test]
fn a_leaked_guard_blocks_no_longer_than_its_ttl() {
    let server = server();
    run(Duration::from_secs(30), async {
        let ttl = Duration::from_millis(1_500);
        let crashed = redis_locks(&server.url()).await;
        let guard = Lock::new(crashed.clone(), "leak", ttl)
            .expect("valid")
            .try_acquire()
            .await
            .expect("store")
            .expect("free");
        let taken_at = Instant::now();
        // The holder vanishes: no release, no drop, and its client goes away.
        std::mem::forget(guard);
        drop(crashed);

        let other = Lock::new(redis_locks(&server.url()).await, "leak", ttl).expect("valid");
        let guard = other
            .acquire(Duration::from_secs(10))
            .await
            .expect("acquired");
        let blocked = taken_at.elapsed();
        eprintln!("blocked for {blocked:?} by a leaked guard (ttl {ttl:?})");
        assert!(blocked >= ttl - Duration::from_millis(50), "{blocked:?}");
        assert!(blocked <= ttl + SLACK, "blocked {blocked:?}, ttl {ttl:?}");
        guard.release().await.expect("release");
    });
}

#[test]
fn a_leaked_memory_guard_blocks_no_longer_than_its_ttl() {
    run(Duration::from_secs(30), async {
        let ttl = Duration::from_millis(500);
        let lock = Lock::new(MemoryLocks::new(), "leak", ttl).expect("valid");
        let taken_at = Instant::now();
        std::mem::forget(lock.try_acquire().await.expect("ok").expect("free"));
        let guard = lock
            .acquire(Duration::from_secs(10))
            .await
            .expect("acquired");
        let blocked = taken_at.elapsed();
        eprintln!("blocked for {blocked:?} by a leaked memory guard (ttl {ttl:?})");
        assert!(blocked <= ttl + SLACK, "blocked {blocked:?}, ttl {ttl:?}");
        drop(guard);
    });
}

#[test]
fn an_aborted_holder_releases_on_drop() {
    let server = server();
    run(Duration::from_secs(30), async {
        let ttl = Duration::from_secs(20);
        let holder = Lock::new(redis_locks(&server.url()).await, "abort", ttl).expect("valid");
        let (held_tx, held_rx) = tokio::sync::oneshot::channel();
        let task = tokio::spawn(async move {
            let guard = holder
                .acquire(Duration::from_secs(5))
                .await
                .expect("acquired");
            held_tx.send(()).expect("send");
            std::future::pending::<()>().await;
            drop(guard);
        });
        held_rx.await.expect("held");
        let other = Lock::new(redis_locks(&server.url()).await, "abort", ttl).expect("valid");
        assert!(other.try_acquire().await.expect("ok").is_none());
        let aborted_at = Instant::now();
        task.abort();
        let guard = other
            .acquire(Duration::from_secs(10))
            .await
            .expect("acquired");
        let waited = aborted_at.elapsed();
        eprintln!("acquired {waited:?} after the holder's task was aborted (ttl {ttl:?})");
        // Far below the 20 s lease: the drop released it and the release woke us.
        assert!(waited < Duration::from_secs(5), "{waited:?}");
        guard.release().await.expect("release");
    });
}

const CHILD_TTL: Duration = Duration::from_millis(1_500);

#[test]
fn a_killed_process_blocks_no_longer_than_its_ttl() {
    let server = server();
    let mut child = Command::new(env!("CARGO_BIN_EXE_floodgate-lock-holder"))
        .args([
            server.url(),
            "process".to_owned(),
            CHILD_TTL.as_millis().to_string(),
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("spawn the child");
    let stdout = child.stdout.take().expect("stdout");
    let mut lines = BufReader::new(stdout).lines();
    let fence: u64 = loop {
        let line = lines
            .next()
            .expect("the child exited before holding the lock")
            .expect("read");
        if let Some((_, fence)) = line.split_once("HOLDING ") {
            break fence.trim().parse().expect("fence");
        }
    };
    run(Duration::from_secs(30), async {
        let lock =
            Lock::new(redis_locks(&server.url()).await, "process", CHILD_TTL).expect("valid");
        // Its watchdog keeps it alive well past one ttl.
        tokio::time::sleep(CHILD_TTL * 2).await;
        assert!(lock.try_acquire().await.expect("ok").is_none());

        child.kill().expect("SIGKILL the child");
        child.wait().expect("reap");
        let killed_at = Instant::now();
        let guard = lock
            .acquire(Duration::from_secs(10))
            .await
            .expect("acquired");
        let blocked = killed_at.elapsed();
        eprintln!(
            "blocked for {blocked:?} after the holder process was killed (ttl {CHILD_TTL:?})"
        );
        assert!(blocked <= CHILD_TTL + SLACK, "blocked {blocked:?}");
        assert!(guard.fence() > fence);
        guard.release().await.expect("release");
    });
}
