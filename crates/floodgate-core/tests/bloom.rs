//! The in-memory Bloom filter, the parameters and the hashing scheme.

use std::sync::Arc;

use floodgate_core::bloom::{
    BloomError, BloomFilter, BloomParams, ItemHash, MAX_BITS, MAX_PART_BITS, MemoryBloom,
    SCHEME_VERSION, murmur3_x64_128,
};

type TestResult = Result<(), BloomError>;

/// Inserted items of the false-positive tests: phone numbers.
fn present(i: u64) -> Vec<u8> {
    format!("+86138{i:08}").into_bytes()
}

/// Items never inserted: other phone numbers.
fn absent(i: u64) -> Vec<u8> {
    format!("+86139{i:08}").into_bytes()
}

#[test]
fn murmur3_matches_published_vectors() {
    // Guava's Murmur3Hash128Test known values (also Elasticsearch's MurmurHash3Tests):
    // (seed, h1, h2, input).
    let vectors: [(u32, u64, u64, &str); 8] = [
        (0, 0x6299_4269_3e10_f867, 0x92db_0b82_baeb_5347, "hell"),
        (1, 0xa78d_dff5_adae_8d10, 0x1289_00ef_2090_0135, "hello"),
        (2, 0x8a48_6b23_f422_e826, 0xf962_a2c5_8947_765f, "hello "),
        (3, 0x2ea5_9f46_6f6b_ed8c, 0xc610_990a_cc42_8a17, "hello w"),
        (4, 0x79f6_305a_386c_572c, 0x4630_5aed_3483_b94e, "hello wo"),
        (5, 0xc221_9d21_3ec1_f1b5, 0xa1d8_e2e0_a527_85bd, "hello wor"),
        (
            0,
            0xe34b_bc7b_bc07_1b6c,
            0x7a43_3ca9_c49a_9347,
            "The quick brown fox jumps over the lazy dog",
        ),
        (
            0,
            0x658c_a970_ff85_269a,
            0x43fe_e3ea_a68e_5c3e,
            "The quick brown fox jumps over the lazy cog",
        ),
    ];
    for (seed, h1, h2, input) in vectors {
        assert_eq!(
            murmur3_x64_128(input.as_bytes(), seed),
            (h1, h2),
            "{input:?} seed {seed}"
        );
    }
    // The empty input with seed 0 hashes to zero (the reference implementation's known value).
    assert_eq!(murmur3_x64_128(b"", 0), (0, 0));
    // As hex digest bytes (h1 then h2, little-endian), the usual way it is published.
    let (h1, h2) = murmur3_x64_128(b"The quick brown fox jumps over the lazy dog", 0);
    let hex: String = h1
        .to_le_bytes()
        .iter()
        .chain(h2.to_le_bytes().iter())
        .map(|b| format!("{b:02x}"))
        .collect();
    assert_eq!(hex, "6c1b07bc7bbc4be347939ac4a93c437a");
}

#[test]
fn double_hashing_follows_the_documented_formula() {
    // Recomputed here from the published digest, independently of the iterator.
    let (h1, h2) = (0xe34b_bc7b_bc07_1b6c_u64, 0x7a43_3ca9_c49a_9347_u64);
    let hash = ItemHash::of(b"The quick brown fox jumps over the lazy dog");
    assert_eq!(hash, ItemHash { h1, h2 });
    let m = 9_585_059_u64;
    let expected: Vec<u64> = (0..7u128)
        .map(|i| {
            let combined = (u128::from(h1) + i * u128::from(h2)) % (1u128 << 64);
            ((combined as u64) & (u64::MAX >> 1)) % m
        })
        .collect();
    assert_eq!(hash.indexes(7, m).collect::<Vec<_>>(), expected);
}

/// Fixed items map to fixed parts and indexes. If this fails the hashing scheme changed:
/// filters already stored would answer wrongly, so bump `SCHEME_VERSION` (and update this
/// table) only on purpose.
#[test]
fn scheme_is_pinned() -> TestResult {
    assert_eq!(SCHEME_VERSION, 1);
    let one_part = BloomParams::new(1_000_000, 0.01)?;
    let four_parts = one_part.with_parts(4)?;
    assert_eq!(four_parts.part_bits(), 2_396_265);
    for (item, indexes, part, part_indexes) in PINNED {
        let (p, got) = one_part.locate(item);
        assert_eq!(
            (p, got.collect::<Vec<_>>()),
            (0, indexes.to_vec()),
            "{item:?}"
        );
        let (p, got) = four_parts.locate(item);
        assert_eq!(
            (p, got.collect::<Vec<_>>()),
            (part, part_indexes.to_vec()),
            "{item:?}"
        );
    }
    Ok(())
}

/// (item, indexes with 1 part, part of 4, indexes within that part).
type Pin = (&'static [u8], [u64; 7], u32, [u64; 7]);

const PINNED: [Pin; 4] = [
    // h1 = h2 = 0: every index is 0 (as in Guava).
    (b"", [0; 7], 0, [0; 7]),
    (
        b"+8613800000000",
        [
            739_296, 302_282, 9_450_327, 9_013_313, 4_373_873, 3_936_859, 3_499_845,
        ],
        1,
        [
            813_989, 1_331_359, 1_848_729, 2_366_099, 884_021, 1_401_391, 1_918_761,
        ],
    ),
    (
        b"\x00\xff\x7b\x7d",
        [
            7_499_788, 8_044_743, 8_589_698, 9_134_653, 94_549, 639_504, 1_184_459,
        ],
        3,
        [
            1_002_572, 994_071, 985_570, 977_069, 968_568, 960_067, 951_566,
        ],
    ),
    (
        b"The quick brown fox jumps over the lazy dog",
        [
            9_515_579, 1_854_639, 3_778_758, 5_702_877, 7_626_996, 9_551_115, 1_890_175,
        ],
        3,
        [
            883_745, 1_753_688, 227_366, 1_097_309, 1_967_252, 440_930, 1_310_873,
        ],
    ),
];

#[test]
fn params_follow_the_formulas() -> TestResult {
    for (n, p) in [
        (1_u64, 0.5),
        (1_000, 0.01),
        (1_000_000, 0.01),
        (1_000_000, 0.001),
        (10_000_000, 1e-6),
        (123_457, 0.0317),
    ] {
        let params = BloomParams::new(n, p)?;
        let ln2 = std::f64::consts::LN_2;
        let m = (-(n as f64) * p.ln() / (ln2 * ln2)).ceil() as u64;
        let k = ((m as f64 / n as f64) * ln2).round().max(1.0) as u32;
        assert_eq!((params.bits(), params.hashes()), (m, k), "n={n} p={p}");
        assert_eq!(params.parts(), 1);
        assert_eq!(params.part_bits(), m);
        assert_eq!(params.expected_insertions(), n);
        assert_eq!(params.false_probability(), p);
        assert_eq!(params.scheme(), SCHEME_VERSION);
    }
    // Well-known sizes: 1M items at 1% take 9,585,059 bits (1.14 MiB) and 7 hashes.
    let p = BloomParams::new(1_000_000, 0.01)?;
    assert_eq!(
        (p.bits(), p.hashes(), p.part_bytes()),
        (9_585_059, 7, 1_198_133)
    );
    assert_eq!(
        p.to_string(),
        "n=1000000 p=0.01 (m=9585059 bits, k=7, 1 part, scheme 1)"
    );
    // k is at least 1 even when the formula rounds to 0.
    assert_eq!(BloomParams::new(1_000, 0.9)?.hashes(), 1);
    Ok(())
}

#[test]
fn large_filters_split_into_parts_of_at_most_2_pow_32_bits() -> TestResult {
    let p = BloomParams::new(1_000_000_000, 0.01)?; // 9.6e9 bits
    assert_eq!(p.parts(), 3);
    assert!(p.part_bits() <= MAX_PART_BITS);
    assert_eq!(p.part_bits(), p.bits().div_ceil(3));
    assert!(p.total_bits() >= p.bits() && p.total_bits() < p.bits() + 3);
    // Fewer parts than fit is refused, naming `parts`.
    let err = p.with_parts(2).expect_err("should be refused");
    assert_eq!(err.field(), Some("parts"), "{err}");
    assert!(err.to_string().contains("at least 3"), "{err}");
    // More is fine, up to one per cluster slot.
    assert_eq!(p.with_parts(16_384)?.parts(), 16_384);
    assert_eq!(
        p.with_parts(16_385).expect_err("should be refused").field(),
        Some("parts")
    );
    assert_eq!(
        p.with_parts(0).expect_err("should be refused").field(),
        Some("parts")
    );
    // No more parts than bits.
    let tiny = BloomParams::new(1, 0.5)?;
    assert_eq!(tiny.bits(), 2);
    assert_eq!(
        tiny.with_parts(3).expect_err("should be refused").field(),
        Some("parts")
    );
    Ok(())
}

#[test]
fn invalid_params_name_the_parameter() {
    let field = |r: Result<BloomParams, BloomError>| r.expect_err("should be refused").field();
    assert_eq!(
        field(BloomParams::new(0, 0.01)),
        Some("expected_insertions")
    );
    for p in [0.0, 1.0, -0.5, 1.5, f64::NAN, f64::INFINITY, -0.0] {
        let err = BloomParams::new(1_000, p).expect_err("should be refused");
        assert_eq!(err.field(), Some("false_probability"), "{p}: {err}");
        assert!(err.to_string().contains("between 0 and 1"), "{err}");
    }
    // Beyond 2^40 bits.
    let err = BloomParams::new(200_000_000_000, 0.001).expect_err("should be refused");
    assert_eq!(err.field(), Some("expected_insertions"), "{err}");
    assert!(err.to_string().contains(&MAX_BITS.to_string()), "{err}");
    // Just within: m = 2^40 bits at most.
    assert!(BloomParams::new(114_000_000_000, 0.01).is_ok());
    // Too many hash functions.
    let err = BloomParams::new(10, 1e-30).expect_err("should be refused");
    assert_eq!(err.field(), Some("false_probability"), "{err}");
    assert!(err.to_string().contains("hash functions"), "{err}");
}

#[test]
fn false_positive_rate_is_within_10_percent_of_target() -> TestResult {
    for parts in [1, 8] {
        let params = BloomParams::new(1_000_000, 0.01)?.with_parts(parts)?;
        let filter = MemoryBloom::create(params)?;
        let inserted: Vec<Vec<u8>> = (0..1_000_000).map(present).collect();
        for chunk in inserted.chunks(10_000) {
            let refs: Vec<&[u8]> = chunk.iter().map(Vec::as_slice).collect();
            filter.add_many_sync(&refs)?;
        }
        // No false negatives, ever.
        for chunk in inserted.chunks(10_000) {
            let refs: Vec<&[u8]> = chunk.iter().map(Vec::as_slice).collect();
            let found = filter.contains_many_sync(&refs)?;
            assert!(
                found.iter().all(|f| *f),
                "an inserted item is reported absent"
            );
        }
        let mut false_positives = 0u64;
        for i in 0..1_000_000 {
            false_positives += u64::from(filter.contains_sync(&absent(i))?);
        }
        let rate = false_positives as f64 / 1e6;
        eprintln!("memory, {parts} part(s): false-positive rate {rate:.5} (target 0.01)");
        assert!(
            (0.009..=0.011).contains(&rate),
            "{parts} part(s): rate {rate}"
        );
        // The estimate of the count is within 2% of the truth.
        let count = filter.count_sync()?;
        assert!(count.abs_diff(1_000_000) < 20_000, "count {count}");
    }
    Ok(())
}

#[test]
fn try_init_twice_and_other_params() -> TestResult {
    let params = BloomParams::new(1_000, 0.01)?;
    let filter = MemoryBloom::new(params);
    // Before try_init every operation is a typed error.
    assert!(
        filter
            .add_sync(b"a")
            .expect_err("should be refused")
            .is_not_initialized()
    );
    assert!(
        filter
            .contains_sync(b"a")
            .expect_err("should be refused")
            .is_not_initialized()
    );
    assert!(
        filter
            .count_sync()
            .expect_err("should be refused")
            .is_not_initialized()
    );
    assert!(filter.try_init_sync()?);
    assert!(!filter.try_init_sync()?);
    assert!(filter.add_sync(b"a")?);

    // A handle with other parameters: try_init names both sets, and every operation fails.
    let other = filter.handle(BloomParams::new(1_000, 0.001)?);
    let err = other.try_init_sync().expect_err("should be refused");
    assert!(err.is_mismatch(), "{err}");
    let text = err.to_string();
    assert!(
        text.contains("p=0.01 ") && text.contains("p=0.001 "),
        "{text}"
    );
    assert!(
        other
            .add_sync(b"a")
            .expect_err("should be refused")
            .is_mismatch()
    );
    assert!(
        other
            .contains_sync(b"a")
            .expect_err("should be refused")
            .is_mismatch()
    );
    assert!(
        other
            .add_many_sync(&[b"b"])
            .expect_err("should be refused")
            .is_mismatch()
    );
    assert!(
        other
            .contains_many_sync(&[b"a"])
            .expect_err("should be refused")
            .is_mismatch()
    );
    assert!(
        other
            .count_sync()
            .expect_err("should be refused")
            .is_mismatch()
    );
    // Same n and p, other parts: also another filter.
    let split = filter.handle(params.with_parts(2)?);
    assert!(
        split
            .contains_sync(b"a")
            .expect_err("should be refused")
            .is_mismatch()
    );
    // The failed calls changed nothing.
    assert!(!filter.contains_sync(b"b")?);
    assert!(filter.contains_sync(b"a")?);
    Ok(())
}

#[test]
fn delete_then_reinit() -> TestResult {
    let filter = MemoryBloom::create(BloomParams::new(1_000, 0.01)?)?;
    filter.add_sync(b"x")?;
    let other = filter.handle(BloomParams::new(50, 0.1)?);
    // Delete works whatever the handle's parameters.
    assert!(other.delete_sync());
    assert!(!other.delete_sync());
    assert!(
        filter
            .contains_sync(b"x")
            .expect_err("should be refused")
            .is_not_initialized()
    );
    // Now the other parameters may create it, and the first handle is refused.
    assert!(other.try_init_sync()?);
    assert!(!other.contains_sync(b"x")?);
    assert!(
        filter
            .contains_sync(b"x")
            .expect_err("should be refused")
            .is_mismatch()
    );
    Ok(())
}

#[test]
fn hostile_items() -> TestResult {
    let filter = MemoryBloom::create(BloomParams::new(10_000, 0.001)?)?;
    let big = vec![0xa5u8; 1 << 20];
    let mut big2 = big.clone();
    big2[(1 << 20) - 1] ^= 1;
    let binary: Vec<u8> = (0..=255).collect();
    let items: [&[u8]; 6] = [b"", &big, b"\0", b"\xff\xfe{}\r\n", &binary, b"\0\0"];
    assert_eq!(filter.add_many_sync(&items)?, vec![true; 6]);
    assert_eq!(filter.contains_many_sync(&items)?, vec![true; 6]);
    assert!(!filter.contains_sync(&big2)?);
    assert!(!filter.contains_sync(&binary[1..])?);
    Ok(())
}

#[test]
fn add_reports_new_items_in_order() -> TestResult {
    let filter = MemoryBloom::create(BloomParams::new(1_000, 0.001)?)?;
    assert_eq!(
        filter.add_many_sync(&[b"a", b"b", b"a", b"c", b"b"])?,
        [true, true, false, true, false]
    );
    assert!(!filter.add_sync(b"c")?);
    assert_eq!(filter.contains_many_sync(&[])?, Vec::<bool>::new());
    Ok(())
}

#[test]
fn count_estimates_within_a_few_percent() -> TestResult {
    let params = BloomParams::new(100_000, 0.01)?;
    let filter = MemoryBloom::create(params)?;
    assert_eq!(filter.count_sync()?, 0);
    let mut last = 0;
    for (i, target) in [1_000u64, 10_000, 50_000, 100_000, 150_000]
        .into_iter()
        .enumerate()
    {
        let from = if i == 0 { 0 } else { last };
        for n in from..target {
            filter.add_sync(&present(n))?;
        }
        last = target;
        let count = filter.count_sync()?;
        let error = count.abs_diff(target) as f64 / target as f64;
        assert!(error < 0.03, "{target} items estimated as {count}");
    }
    // Adding the same items again changes nothing.
    for n in 0..1_000 {
        filter.add_sync(&present(n))?;
    }
    assert!(filter.count_sync()?.abs_diff(150_000) < 4_500);
    Ok(())
}

#[test]
fn full_filter_count_saturates() -> TestResult {
    let params = BloomParams::new(1, 0.5)?;
    assert_eq!(params.estimate_count([params.part_bits()]), u64::MAX);
    assert_eq!(params.estimate_count([0]), 0);
    Ok(())
}

#[test]
fn many_threads_add_and_find_everything() -> TestResult {
    let filter = Arc::new(MemoryBloom::create(BloomParams::new(200_000, 0.01)?)?);
    let threads: Vec<_> = (0..8u64)
        .map(|t| {
            let filter = Arc::clone(&filter);
            std::thread::spawn(move || -> TestResult {
                for i in 0..25_000 {
                    filter.add_sync(&present(t * 25_000 + i))?;
                }
                Ok(())
            })
        })
        .collect();
    for t in threads {
        t.join().expect("thread")?;
    }
    for i in 0..200_000 {
        assert!(filter.contains_sync(&present(i))?, "item {i} lost");
    }
    Ok(())
}

#[tokio::test]
async fn the_trait_drives_the_memory_filter() -> TestResult {
    async fn roundtrip<F: BloomFilter>(filter: &F) -> Result<(), F::Error> {
        assert!(filter.try_init().await?);
        assert!(!filter.try_init().await?);
        assert!(filter.add(b"one").await?);
        assert_eq!(filter.add_many(&[b"one", b"two"]).await?, [false, true]);
        assert!(filter.contains(b"two").await?);
        assert_eq!(
            filter.contains_many(&[b"one", b"three"]).await?,
            [true, false]
        );
        assert_eq!(filter.count().await?, 2);
        assert!(filter.delete().await?);
        assert!(!filter.delete().await?);
        Ok(())
    }
    let filter = MemoryBloom::new(BloomParams::new(1_000, 0.01)?);
    roundtrip(&filter).await?;
    assert!(
        filter
            .contains(b"one")
            .await
            .expect_err("should be refused")
            .is_not_initialized()
    );
    Ok(())
}
