//! The Redis Bloom filter against real redis-server processes: a single node and a cluster.

use std::time::Duration;

use floodgate_core::bloom::{BloomFilter, BloomParams, MemoryBloom};
use floodgate_redis::{RedisBloom, RedisConfig, RedisConn};
use floodgate_testkit::{RedisCluster, RedisServer, Resp};

type TestResult = Result<(), Box<dyn std::error::Error>>;

/// Items per call in the large tests.
const BATCH: usize = 10_000;

/// Generous: these tests measure correctness, and the machine is shared.
async fn connect(config: RedisConfig) -> Result<RedisConn, floodgate_redis::Error> {
    RedisConn::connect(&config.timeout(Duration::from_secs(20))).await
}

async fn single(server: &RedisServer) -> Result<RedisConn, floodgate_redis::Error> {
    connect(RedisConfig::new(&server.url())?).await
}

async fn cluster_conn(cluster: &RedisCluster) -> Result<RedisConn, floodgate_redis::Error> {
    connect(RedisConfig::from_urls(cluster.urls())?).await
}

fn present(i: u64) -> Vec<u8> {
    format!("+86138{i:08}").into_bytes()
}

fn absent(i: u64) -> Vec<u8> {
    format!("+86139{i:08}").into_bytes()
}

fn refs(items: &[Vec<u8>]) -> Vec<&[u8]> {
    items.iter().map(Vec::as_slice).collect()
}

fn int(reply: &Resp) -> i64 {
    reply
        .as_int()
        .unwrap_or_else(|| panic!("expected an integer, got {reply:?}"))
}

/// Sends `args` to the node that serves `key` (the only node when there is no cluster).
fn cmd_for_key(
    server: Target<'_>,
    key: &[u8],
    args: &[&[u8]],
) -> Result<Resp, Box<dyn std::error::Error>> {
    Ok(match server {
        Target::Single(s) => s.cmd(args)?,
        Target::Cluster(c) => c.node(c.node_for_key(key)?).cmd(args)?,
    })
}

#[derive(Clone, Copy)]
enum Target<'a> {
    Single(&'a RedisServer),
    Cluster(&'a RedisCluster),
}

/// Every key on every master.
fn all_keys(target: Target<'_>) -> Result<Vec<Vec<u8>>, Box<dyn std::error::Error>> {
    let nodes: Vec<&RedisServer> = match target {
        Target::Single(s) => vec![s],
        Target::Cluster(c) => c.masters()?.into_iter().map(|i| c.node(i)).collect(),
    };
    let mut keys = Vec::new();
    for node in nodes {
        let reply = node.cmd(&["KEYS", "*"])?;
        for key in reply.as_array().unwrap_or_default() {
            keys.push(key.as_bytes().unwrap_or_default().to_vec());
        }
    }
    Ok(keys)
}

/// (bitmap bytes by STRLEN, every key's bytes by MEMORY USAGE).
fn stored_bytes(
    target: Target<'_>,
    filter: &RedisBloom,
) -> Result<(u64, u64), Box<dyn std::error::Error>> {
    let (mut strlen, mut usage) = (0, 0);
    for (bits, cfg) in filter.keys() {
        strlen += int(&cmd_for_key(target, bits, &[b"STRLEN", bits])?);
        for key in [bits, cfg] {
            usage += int(&cmd_for_key(
                target,
                key,
                &[b"MEMORY", b"USAGE", key, b"SAMPLES", b"0"],
            )?);
        }
    }
    Ok((u64::try_from(strlen)?, u64::try_from(usage)?))
}

/// Inserts 1M items, checks them all and 1M absent ones, against the filter and an in-memory
/// filter with the same parameters (same scheme, so the same answers). Returns the
/// false-positive rate.
async fn million(filter: &RedisBloom) -> Result<f64, Box<dyn std::error::Error>> {
    let memory = MemoryBloom::create(*filter.params())?;
    for start in (0..1_000_000u64).step_by(BATCH) {
        let items: Vec<Vec<u8>> = (start..start + BATCH as u64).map(present).collect();
        let added = filter.add_many(&refs(&items)).await?;
        assert_eq!(added, memory.add_many_sync(&refs(&items))?);
    }
    let mut false_positives = 0;
    for start in (0..1_000_000u64).step_by(BATCH) {
        let inserted: Vec<Vec<u8>> = (start..start + BATCH as u64).map(present).collect();
        let others: Vec<Vec<u8>> = (start..start + BATCH as u64).map(absent).collect();
        let (inserted_refs, others_refs) = (refs(&inserted), refs(&others));
        // Two calls in flight, so that the client's work overlaps the server's.
        let (found, maybe) = tokio::try_join!(
            filter.contains_many(&inserted_refs),
            filter.contains_many(&others_refs)
        )?;
        assert!(
            found.iter().all(|f| *f),
            "an inserted item is reported absent"
        );
        assert_eq!(maybe, memory.contains_many_sync(&others_refs)?);
        false_positives += maybe.iter().filter(|f| **f).count();
    }
    // The estimate of the count: within 2% of the truth, and equal to the in-memory one.
    let count = filter.count().await?;
    assert!(count.abs_diff(1_000_000) < 20_000, "count {count}");
    assert_eq!(count, memory.count_sync()?);
    Ok(false_positives as f64 / 1e6)
}

fn assert_memory(target: Target<'_>, filter: &RedisBloom) -> TestResult {
    let m_bytes = filter.params().bits() as f64 / 8.0;
    let (strlen, usage) = stored_bytes(target, filter)?;
    let ratio = strlen as f64 / m_bytes;
    let usage_ratio = usage as f64 / m_bytes;
    eprintln!(
        "m/8 = {m_bytes:.0} bytes; bitmaps (STRLEN) {strlen} = {ratio:.5}x; every key \
         (MEMORY USAGE) {usage} = {usage_ratio:.4}x"
    );
    assert!((ratio - 1.0).abs() < 0.01, "STRLEN ratio {ratio}");
    // Allocator size classes round up (jemalloc's are up to 25% apart), but the bitmaps are
    // never over-allocated the way a string grown bit by bit is (2x below 1 MiB).
    assert!(usage_ratio < 1.26, "MEMORY USAGE ratio {usage_ratio}");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn false_positive_rate_single_node() -> TestResult {
    let server = RedisServer::start()?;
    let params = BloomParams::new(1_000_000, 0.01)?;
    let filter = RedisBloom::new(single(&server).await?, "fp", params)?;
    assert!(filter.try_init().await?);
    // Allocated at once, at its final size.
    assert_memory(Target::Single(&server), &filter)?;

    let rate = million(&filter).await?;
    eprintln!("single node: false-positive rate {rate:.5} (target 0.01)");
    assert!((0.009..=0.011).contains(&rate), "rate {rate}");
    assert_memory(Target::Single(&server), &filter)?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn false_positive_rate_on_a_cluster_with_parts_on_every_master() -> TestResult {
    let cluster = RedisCluster::start()?;
    let params = BloomParams::new(1_000_000, 0.01)?.with_parts(8)?;
    let filter = RedisBloom::new(cluster_conn(&cluster).await?, "fp", params)?;
    assert!(filter.try_init().await?);
    // The parts are spread: every master holds at least one.
    let mut nodes: Vec<usize> = filter
        .keys()
        .map(|(bits, cfg)| {
            assert_eq!(RedisCluster::key_slot(bits), RedisCluster::key_slot(cfg));
            cluster.node_for_key(bits)
        })
        .collect::<Result<_, _>>()?;
    nodes.sort_unstable();
    nodes.dedup();
    assert_eq!(
        nodes.len(),
        cluster.masters()?.len(),
        "parts on nodes {nodes:?}"
    );

    let rate = million(&filter).await?;
    eprintln!("cluster, 8 parts: false-positive rate {rate:.5} (target 0.01)");
    assert!((0.009..=0.011).contains(&rate), "rate {rate}");
    assert_memory(Target::Cluster(&cluster), &filter)?;

    assert!(filter.delete().await?);
    assert_eq!(all_keys(Target::Cluster(&cluster))?, Vec::<Vec<u8>>::new());
    Ok(())
}

/// try_init twice, other parameters, not initialised, open, delete: on one node and on a
/// cluster with the filter split in parts.
async fn contract(target: Target<'_>, conn: RedisConn, parts: u32) -> TestResult {
    let params = BloomParams::new(10_000, 0.01)?.with_parts(parts)?;
    let filter = RedisBloom::new(conn.clone(), "optout", params)?;

    // Not there yet: typed errors, and nothing is created by them.
    assert!(
        filter
            .contains(b"a")
            .await
            .expect_err("absent")
            .is_not_initialized()
    );
    assert!(
        filter
            .add(b"a")
            .await
            .expect_err("absent")
            .is_not_initialized()
    );
    assert!(
        filter
            .count()
            .await
            .expect_err("absent")
            .is_not_initialized()
    );
    let open = RedisBloom::open(conn.clone(), "optout").await;
    assert!(open.expect_err("absent").is_not_initialized());
    assert_eq!(all_keys(target)?, Vec::<Vec<u8>>::new());

    assert!(filter.try_init().await?);
    assert!(!filter.try_init().await?);
    assert!(filter.add(b"+8613800000000").await?);
    assert!(!filter.add(b"+8613800000000").await?);
    assert_eq!(
        filter.add_many(&[b"x", b"y", b"x"]).await?,
        [true, true, false]
    );

    // Batches split into several calls per part keep the callers' order.
    let small = filter.clone().max_items_per_call(2);
    assert_eq!(
        small.add_many(&[b"m1", b"m2", b"m1", b"m3", b"m2"]).await?,
        [true, true, false, true, false]
    );
    assert_eq!(
        small.contains_many(&[b"m3", b"m4", b"m1", b"x"]).await?,
        [true, false, true, true]
    );
    assert!(small.delete().await?);
    assert!(filter.try_init().await?);
    assert_eq!(filter.add_many(&[b"x", b"y"]).await?, [true, true]);

    // Another handle with other parameters: try_init names both sets; every call fails.
    let other = RedisBloom::new(conn.clone(), "optout", BloomParams::new(10_000, 0.001)?)?;
    let err = other.try_init().await.expect_err("other parameters");
    assert!(err.is_mismatch(), "{err}");
    let text = err.to_string();
    assert!(
        text.contains("p=0.01 ") && text.contains("p=0.001 "),
        "{text}"
    );
    assert!(other.add(b"z").await.expect_err("mismatch").is_mismatch());
    assert!(
        other
            .contains(b"x")
            .await
            .expect_err("mismatch")
            .is_mismatch()
    );
    assert!(
        other
            .add_many(&[b"z"])
            .await
            .expect_err("mismatch")
            .is_mismatch()
    );
    let many = other.contains_many(&[b"x", b"y"]).await;
    assert!(many.expect_err("mismatch").is_mismatch());
    assert!(other.count().await.expect_err("mismatch").is_mismatch());
    // Same n and p, another split: also another filter, and a refused try_init creates no
    // part of its own.
    let keys = all_keys(target)?.len();
    let resplit = RedisBloom::new(conn.clone(), "optout", params.with_parts(parts + 1)?)?;
    let err = resplit.contains(b"x").await.expect_err("mismatch");
    assert!(err.is_mismatch(), "{err}");
    let err = resplit.try_init().await.expect_err("mismatch");
    assert!(err.is_mismatch(), "{err}");
    assert_eq!(all_keys(target)?.len(), keys);
    // None of that changed anything.
    assert!(!filter.contains(b"z").await?);
    assert_eq!(filter.count().await?, 2);

    // A reader that does not know the sizes opens it by name.
    let reader = RedisBloom::open(conn.clone(), "optout").await?;
    assert_eq!(reader.params(), &params);
    assert_eq!(reader.contains_many(&[b"x", b"q"]).await?, [true, false]);

    // Hostile items.
    let big = vec![0x5au8; 1 << 20];
    let binary: Vec<u8> = (0..=255).rev().collect();
    let hostile: [&[u8]; 5] = [b"", &big, &binary, b"\0", b"{}\r\n*1\r\n"];
    assert_eq!(filter.add_many(&hostile).await?, [true; 5]);
    assert_eq!(filter.contains_many(&hostile).await?, [true; 5]);
    assert!(!filter.contains(&big[1..]).await?);
    assert!(!filter.contains(&binary[1..]).await?);

    // Delete removes every key, even through a handle that knows fewer parts.
    let fewer = RedisBloom::new(conn.clone(), "optout", BloomParams::new(10_000, 0.01)?)?;
    assert!(fewer.delete().await?);
    assert_eq!(all_keys(target)?, Vec::<Vec<u8>>::new());
    assert!(!filter.delete().await?);
    assert!(
        filter
            .contains(b"x")
            .await
            .expect_err("deleted")
            .is_not_initialized()
    );
    // And the name is free for other parameters.
    assert!(other.try_init().await?);
    assert!(!other.contains(b"x").await?);
    assert!(other.delete().await?);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn contract_single_node() -> TestResult {
    let server = RedisServer::start()?;
    let conn = single(&server).await?;
    contract(Target::Single(&server), conn.clone(), 1).await?;
    contract(Target::Single(&server), conn, 3).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn contract_cluster() -> TestResult {
    let cluster = RedisCluster::start()?;
    let conn = cluster_conn(&cluster).await?;
    contract(Target::Cluster(&cluster), conn.clone(), 1).await?;
    contract(Target::Cluster(&cluster), conn, 5).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn damaged_keys_are_typed_errors() -> TestResult {
    let server = RedisServer::start()?;
    let conn = single(&server).await?;
    let filter = RedisBloom::new(conn.clone(), "damaged", BloomParams::new(1_000, 0.01)?)?;
    filter.try_init().await?;
    let (bits, cfg) = filter
        .keys()
        .next()
        .map(|(b, c)| (b.to_vec(), c.to_vec()))
        .ok_or("keys")?;

    // The bitmap lost (evicted, deleted by hand): never read as "absent".
    server.cmd(&[&b"DEL"[..], &bits])?;
    let err = filter.contains(b"x").await.expect_err("bitmap missing");
    assert!(err.is_corrupted(), "{err}");
    assert!(err.to_string().contains("bitmap is 0 bytes"), "{err}");
    // try_init does not call such a filter one that exists (so a caller that rebuilds damaged
    // filters does), nor makes it again holding nothing.
    let err = filter.try_init().await.expect_err("bitmap missing");
    assert!(err.is_corrupted(), "{err}");
    assert!(err.to_string().contains("bitmap is 0 bytes"), "{err}");
    // Another type under the bitmap's key.
    server.cmd(&[&b"LPUSH"[..], &bits, b"x"])?;
    let err = filter.add(b"x").await.expect_err("wrong type");
    assert!(err.is_corrupted(), "{err}");
    // A bitmap without a config is not taken over by try_init.
    server.cmd(&[&b"DEL"[..], &bits, &cfg])?;
    server.cmd(&[&b"SET"[..], &bits, b"foreign"])?;
    let err = filter.try_init().await.expect_err("foreign key");
    assert!(err.is_corrupted(), "{err}");
    assert_eq!(
        server.cmd(&[&b"GET"[..], &bits])?.as_bytes(),
        Some(&b"foreign"[..])
    );
    // A config with a corrupt part count: delete goes no further than the most parts a filter
    // can have (it would otherwise send a call for each of 100,000 parts, or billions).
    server.cmd(&[&b"HSET"[..], &cfg, b"parts", b"100000"])?;
    server.cmd(&["CONFIG", "RESETSTAT"])?;
    filter.delete().await?;
    let stats = server.cmd(&["INFO", "commandstats"])?;
    let calls: u64 = stats
        .as_str()
        .unwrap_or_default()
        .lines()
        .filter(|l| l.starts_with("cmdstat_evalsha:") || l.starts_with("cmdstat_eval:"))
        .filter_map(|l| {
            l.split("calls=")
                .nth(1)?
                .split(',')
                .next()?
                .parse::<u64>()
                .ok()
        })
        .sum();
    // One call per part, and one EVAL after the first EVALSHA found the script not loaded.
    let most = u64::from(floodgate_core::bloom::MAX_PARTS) + 1;
    assert!((1..=most).contains(&calls), "{calls} delete calls");
    Ok(())
}

#[test]
fn invalid_names_are_refused_before_any_io() -> TestResult {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let server = RedisServer::start()?;
    let conn = runtime.block_on(single(&server))?;
    let params = BloomParams::new(1_000, 0.01)?;
    for name in ["", "a{b}", &"n".repeat(201)] {
        let err = RedisBloom::new(conn.clone(), name, params).expect_err("invalid name");
        assert_eq!(err.field(), Some("name"), "{err}");
    }
    Ok(())
}
