//! `ConcurrencyLease` against a store that takes its time.

mod common;

use std::time::Duration;

use common::Store;
use floodgate_core::{Check, CheckOptions, ConcurrencyLease, Policy};

/// The lease's TTL passes while a renewal is under way, and the store (counting real time while
/// Tokio's clock jumps) still accepts it: the lease was lost meanwhile, and the renewal says so
/// rather than `true`.
#[tokio::test(start_paused = true)]
async fn a_renewal_accepted_after_the_lease_was_lost_says_it_is_lost() {
    let store = Store::new();
    let policy = Policy::concurrency(1, Duration::from_secs(10))
        .and_then(|p| p.named("one"))
        .expect("policy");
    let checks = [Check::new(b"k", &policy)];
    let (_, lease) = ConcurrencyLease::check(&store, &checks, CheckOptions::default())
        .await
        .expect("check");
    let lease = lease.expect("admitted");
    store.set_delay(Duration::from_secs(11));
    let renewed = lease.renew().await.expect("renew");
    assert!(lease.is_lost(), "past its TTL on the lease's clock");
    assert!(!renewed, "a lost lease reported as renewed");
}
