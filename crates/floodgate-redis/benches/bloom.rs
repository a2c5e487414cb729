//! Bloom filter throughput against a real redis-server (started by floodgate-testkit): batches
//! of 10k items per `contains_many` / `add_many` on a filter holding 1M items (n = 1M, p = 1%),
//! and the client's share of the work (hashing and building the calls' offsets).
//!
//! `cargo bench -p floodgate-redis --bench bloom`

use std::hint::black_box;
use std::time::Duration;

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use floodgate_core::bloom::{BloomFilter, BloomParams};
use floodgate_redis::{RedisBloom, RedisConfig, RedisConn};
use floodgate_testkit::RedisServer;

const BATCH: u64 = 10_000;

fn phone(prefix: &str, i: u64) -> Vec<u8> {
    format!("{prefix}{i:08}").into_bytes()
}

fn batch(prefix: &str, from: u64) -> Vec<Vec<u8>> {
    (from..from + BATCH).map(|i| phone(prefix, i)).collect()
}

fn refs(items: &[Vec<u8>]) -> Vec<&[u8]> {
    items.iter().map(Vec::as_slice).collect()
}

fn bloom(c: &mut Criterion) {
    let server = RedisServer::start().expect("redis-server (run scripts/install-redis)");
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("tokio runtime");
    let params = BloomParams::new(1_000_000, 0.01).expect("valid parameters");
    let filter = runtime.block_on(async {
        let config = RedisConfig::new(&server.url())
            .expect("URL")
            .timeout(Duration::from_secs(10));
        let conn = RedisConn::connect(&config).await.expect("connect");
        let filter = RedisBloom::new(conn, "bench", params).expect("name");
        filter.try_init().await.expect("try_init");
        for from in (0..1_000_000).step_by(BATCH as usize) {
            let items = batch("+86138", from);
            filter.add_many(&refs(&items)).await.expect("add_many");
        }
        filter
    });

    let present = batch("+86138", 500_000);
    let absent = batch("+86139", 0);
    let mixed: Vec<&[u8]> = present
        .iter()
        .zip(&absent)
        .flat_map(|(p, a)| [p.as_slice(), a.as_slice()])
        .take(BATCH as usize)
        .collect();

    let mut group = c.benchmark_group("bloom");
    group.throughput(Throughput::Elements(BATCH));
    group.sample_size(30);
    group.bench_function("contains_many 10k, half present", |b| {
        b.iter(|| {
            runtime
                .block_on(filter.contains_many(black_box(&mixed)))
                .expect("contains_many")
        });
    });
    // The SMS gateway's case: nearly every number is not opted out.
    let absent_refs = refs(&absent);
    group.bench_function("contains_many 10k, all absent", |b| {
        b.iter(|| {
            runtime
                .block_on(filter.contains_many(black_box(&absent_refs)))
                .expect("contains_many")
        });
    });
    let added = refs(&present);
    group.bench_function("add_many 10k, already present", |b| {
        b.iter(|| {
            runtime
                .block_on(filter.add_many(black_box(&added)))
                .expect("add_many")
        });
    });
    group.bench_function("client side only: locate 10k", |b| {
        b.iter(|| {
            let mut sum = 0u64;
            for item in &mixed {
                let (part, indexes) = params.locate(black_box(item));
                sum = indexes.fold(sum.wrapping_add(u64::from(part)), u64::wrapping_add);
            }
            sum
        });
    });
    group.finish();
}

criterion_group!(benches, bloom);
criterion_main!(benches);
