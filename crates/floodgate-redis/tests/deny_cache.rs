//! The deny cache against a real Redis: 64 tasks hammering one key that is over its limit cost
//! the server about one call per retry period (the admitted request itself), counted by the
//! server's own command statistics.

mod support;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use floodgate_core::{Check, CheckOptions, DenyCache, Limiter, Policy};
use floodgate_redis::ConnectionKind;
use support::{command_calls, limiter, run, server};

#[test]
fn sixty_four_tasks_on_a_denied_key_cost_about_one_call_per_retry_period() {
    let server = server();
    run(Duration::from_secs(60), async {
        let redis = limiter(&server.url(), ConnectionKind::Multiplexed).await;
        let cache = DenyCache::new(redis);
        let policy = Arc::new(Policy::per(1, Duration::from_millis(500)).expect("valid"));
        // Spend the key's budget, so the hammering starts on a denied key.
        let first = cache
            .check(&[Check::new(b"attacker", &policy)], CheckOptions::default())
            .await
            .expect("check");
        assert!(first.allowed());
        let before = command_calls(&server, "evalsha");
        let started = Instant::now();
        let run_for = Duration::from_secs(5);
        let admitted = Arc::new(AtomicU64::new(0));
        let checks = Arc::new(AtomicU64::new(0));
        let tasks: Vec<_> = (0..64)
            .map(|_| {
                let (cache, policy, admitted, checks) = (
                    cache.clone(),
                    Arc::clone(&policy),
                    Arc::clone(&admitted),
                    Arc::clone(&checks),
                );
                tokio::spawn(async move {
                    while started.elapsed() < run_for {
                        let v = cache
                            .check(&[Check::new(b"attacker", &policy)], CheckOptions::default())
                            .await
                            .expect("check");
                        checks.fetch_add(1, Ordering::Relaxed);
                        if v.allowed() {
                            admitted.fetch_add(1, Ordering::Relaxed);
                        }
                        tokio::task::yield_now().await;
                    }
                })
            })
            .collect();
        for t in tasks {
            t.await.expect("task");
        }
        let calls = command_calls(&server, "evalsha") - before;
        let periods = run_for.as_millis() as u64 / 500;
        let admitted = admitted.load(Ordering::Relaxed);
        let checks = checks.load(Ordering::Relaxed);
        eprintln!(
            "FIGURE: deny_cache.hammer = {checks} checks by 64 tasks in {run_for:?}: \
             {calls} EVALSHA calls, {admitted} admitted, {periods} retry periods"
        );
        // One admitted request per period at most, and about one call per period: the call
        // that admits it (the next unit's time is known, so no probe is denied).
        assert!(
            admitted <= periods + 1,
            "{admitted} admitted in {periods} periods"
        );
        assert!(
            calls <= periods + 2,
            "{calls} calls for {periods} retry periods ({checks} checks)"
        );
        assert!(checks > 10_000, "the tasks made only {checks} checks");
    });
}
