//! Throughput of the connection kinds: 64 concurrent tokio tasks, each
//! running a tiny script (`INCR` of one of 10 000 keys) with `EVALSHA`,
//! against a local redis-server started by floodgate-testkit.
//!
//! `cargo bench -p floodgate-redis --bench connection`
//!
//! The faster single-node kind is `DEFAULT_SINGLE_NODE_KIND`.

use std::hint::black_box;
use std::sync::Arc;
use std::time::{Duration, Instant};

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use floodgate_redis::{ConnectionKind, RedisConfig, RedisConn};
use floodgate_testkit::RedisServer;
use redis::Script;

const TASKS: usize = 64;
const CALLS_PER_TASK: usize = 64;
const KEYS: usize = 10_000;

/// One round: every task makes its calls; returns how long the round took.
async fn round(
    conn: &RedisConn,
    script: &Arc<Script>,
    keys: &Arc<Vec<Vec<u8>>>,
    seed: u64,
) -> Duration {
    let started = Instant::now();
    let mut tasks = Vec::with_capacity(TASKS);
    for task in 0..TASKS {
        let conn = conn.clone();
        let script = Arc::clone(script);
        let keys = Arc::clone(keys);
        // xorshift64*: a different key sequence per task and round.
        let mut state = (seed ^ (task as u64 + 1)).wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        tasks.push(tokio::spawn(async move {
            for _ in 0..CALLS_PER_TASK {
                state ^= state >> 12;
                state ^= state << 25;
                state ^= state >> 27;
                let index = (state.wrapping_mul(0x2545_F491_4F6C_DD1D) % KEYS as u64) as usize;
                let reply = conn
                    .invoke_script(&script, &[&keys[index]], &[])
                    .await
                    .expect("EVALSHA");
                black_box(reply);
            }
        }));
    }
    for task in tasks {
        task.await.expect("benchmark task");
    }
    started.elapsed()
}

fn connection_kinds(c: &mut Criterion) {
    let server = RedisServer::start().expect("start redis-server (run scripts/install-redis)");
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("tokio runtime");
    let script = Arc::new(Script::new("return redis.call('INCR', KEYS[1])"));
    let keys: Arc<Vec<Vec<u8>>> = Arc::new(
        (0..KEYS)
            .map(|i| format!("bench:{i}").into_bytes())
            .collect(),
    );

    let mut group = c.benchmark_group("evalsha_64_tasks");
    group.throughput(Throughput::Elements((TASKS * CALLS_PER_TASK) as u64));
    group.sample_size(30);
    group.measurement_time(Duration::from_secs(8));
    for kind in [
        ConnectionKind::Multiplexed,
        ConnectionKind::Pool { size: 16 },
        ConnectionKind::Pool { size: 64 },
    ] {
        let config = RedisConfig::new(&server.url())
            .expect("valid URL")
            .connection(kind)
            .timeout(Duration::from_secs(5));
        let conn = runtime
            .block_on(RedisConn::connect(&config))
            .expect("connect");
        // Load the script and fill the pool before measuring.
        runtime.block_on(round(&conn, &script, &keys, 0));
        let name = match kind {
            ConnectionKind::Pool { size } => format!("pool_{size}"),
            _ => "multiplexed".to_owned(),
        };
        let mut seed = 1;
        group.bench_function(name, |b| {
            b.iter_custom(|rounds| {
                runtime.block_on(async {
                    let mut total = Duration::ZERO;
                    for _ in 0..rounds {
                        seed += 1;
                        total += round(&conn, &script, &keys, seed).await;
                    }
                    total
                })
            });
        });
    }
    group.finish();
}

criterion_group!(benches, connection_kinds);
criterion_main!(benches);
