//! `floodgate-lock-holder URL NAME TTL_MS`: takes lock NAME on the Redis at URL with the
//! watchdog on, prints `HOLDING <fence>`, and holds it until the process is killed.
//!
//! A crashed holder on demand: kill it and watch others get the lock once its lease runs out
//! (the crate's crash test does exactly that).

use std::process::ExitCode;
use std::time::Duration;

use floodgate_lock::{Lock, RedisLocks};

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [url, name, ttl] = args.as_slice() else {
        eprintln!("usage: floodgate-lock-holder URL NAME TTL_MS");
        return ExitCode::from(2);
    };
    let Ok(ttl) = ttl.parse::<u64>().map(Duration::from_millis) else {
        eprintln!("floodgate-lock-holder: TTL_MS must be a whole number of milliseconds");
        return ExitCode::from(2);
    };
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("floodgate-lock-holder: {e}");
            return ExitCode::FAILURE;
        }
    };
    let result: Result<(), floodgate_lock::Error> = runtime.block_on(async {
        let locks = RedisLocks::connect(url).await?;
        let guard = Lock::new(locks, name.as_bytes(), ttl)?
            .watchdog(true)
            .acquire(Duration::from_secs(10))
            .await?;
        println!("HOLDING {}", guard.fence());
        let reason = guard.lost().await;
        eprintln!("floodgate-lock-holder: lease lost: {reason:?}");
        Ok(())
    });
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("floodgate-lock-holder: {e}");
            ExitCode::FAILURE
        }
    }
}
