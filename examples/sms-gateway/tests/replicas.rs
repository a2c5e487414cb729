//! Two replicas sharing one real Redis: limits hold across them, campaigns are sent exactly
//! once per number even when the dispatching replica is killed, opted-out numbers are never
//! messaged.

mod support;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use floodgate_testkit::RedisServer;
use serde_json::json;
use support::{
    Gateway, Http, REFUSE, SLOW_REFUSE, TAKE, THROTTLE, sms, temp_dir, wait_campaign, webhook,
};

fn pair(dir: &std::path::Path, redis: &RedisServer, env: &[(&str, &str)]) -> (Gateway, Gateway) {
    let url = redis.url();
    let mut all: Vec<(&str, &str)> = vec![("REDIS_URL", &url)];
    all.extend_from_slice(env);
    (
        Gateway::start(dir, "a", &all),
        Gateway::start(dir, "b", &all),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_replicas_200_requests_for_one_phone_accept_exactly_one() {
    let redis = RedisServer::start().expect("redis-server");
    let dir = temp_dir("one-phone");
    // 200 requests at once from one address: as many connections, past the default bound of
    // an address's connections.
    let (a, b) = pair(
        &dir,
        &redis,
        &[
            ("IP_PER_MINUTE", "100000"),
            ("GLOBAL_PER_SECOND", "100"),
            ("MAX_CONNECTIONS_PER_IP", "512"),
        ],
    );
    let http = Http::new();
    let urls = Arc::new([a.url("/v1/sms"), b.url("/v1/sms")]);
    let tasks: Vec<_> = (0..200)
        .map(|i| {
            let (http, urls) = (http.clone(), Arc::clone(&urls));
            tokio::spawn(async move {
                http.post(&urls[i % 2], &sms("+8613800000000", "your code is 1234"))
                    .await
            })
        })
        .collect();
    let mut accepted = 0;
    let mut by_phone = 0;
    for t in tasks {
        let r = t.await.expect("task");
        match r.status {
            202 => accepted += 1,
            429 => {
                assert_eq!(r.body["error"]["limit"], "phone", "{}", r.body);
                let retry = r.body["error"]["retry_after_ms"].as_u64().expect("retry");
                assert!(retry > 29 * 60_000 && retry <= 30 * 60_000, "{retry}");
                by_phone += 1;
            }
            other => panic!("unexpected {other}: {}", r.body),
        }
    }
    assert_eq!((accepted, by_phone), (1, 199));
    let lines = a.outbox_lines().len() + b.outbox_lines().len();
    assert_eq!(lines, 1);
    // Two more on each replica, one after the other, once its denials have come back: the
    // burst's checks may all have been in flight before the first denial was known, but
    // these repeats stay local.
    for url in urls.iter().chain(urls.iter()) {
        let r = http
            .post(url, &sms("+8613800000000", "your code is 1234"))
            .await;
        assert_eq!(r.status, 429, "{}", r.body);
    }
    // Each of the 204 checks went through a replica's deny cache once, answered there (a hit)
    // or passed to Redis (a miss).
    let (mut hits, mut misses) = (0, 0);
    for gw in [&a, &b] {
        let text = http.get(&gw.url("/metrics")).await.body;
        let text = text.as_str().expect("metrics text");
        hits += metric(text, "floodgate_deny_cache_hits_total");
        misses += metric(text, "floodgate_deny_cache_misses_total");
    }
    assert_eq!(hits + misses, 204, "hits {hits}, misses {misses}");
    assert!(hits >= 4, "hits {hits}, misses {misses}");
    let _ = std::fs::remove_dir_all(dir);
}

/// The value of an unlabelled metric in Prometheus text.
fn metric(text: &str, name: &str) -> u64 {
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok())
        .unwrap_or_else(|| panic!("no {name} in {text}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn per_ip_and_global_limits_hold_across_replicas() {
    let redis = RedisServer::start().expect("redis-server");
    let dir = temp_dir("ip-global");
    let (a, b) = pair(
        &dir,
        &redis,
        &[
            ("IP_PER_MINUTE", "12"),
            ("GLOBAL_PER_SECOND", "1000"),
            ("TRUSTED_PROXIES", "127.0.0.1/32"),
        ],
    );
    let http = Http::new();
    // One client (through the trusted proxy) over both replicas: 12 per minute in all.
    let mut accepted = 0;
    for i in 0..30 {
        let gw = if i % 2 == 0 { &a } else { &b };
        let r = http
            .send(
                "POST",
                &gw.url("/v1/sms"),
                &[("x-forwarded-for", "198.51.100.7")],
                &sms(&format!("+861390000{i:04}"), "x"),
            )
            .await;
        match r.status {
            202 => accepted += 1,
            429 => assert_eq!(r.body["error"]["limit"], "client-ip", "{}", r.body),
            other => panic!("unexpected {other}: {}", r.body),
        }
    }
    assert_eq!(accepted, 12);
    // A spoofed header from the client does not give it a fresh key.
    let r = http
        .send(
            "POST",
            &a.url("/v1/sms"),
            &[("x-forwarded-for", "203.0.113.9, 198.51.100.7")],
            &sms("+8613999999999", "x"),
        )
        .await;
    assert_eq!(r.status, 429, "{}", r.body);
    drop((a, b));

    // The global limit, 5 per second with bursts of 5, over two replicas and many clients.
    let (a, b) = pair(
        &dir,
        &redis,
        &[
            ("GLOBAL_PER_SECOND", "5"),
            ("TRUSTED_PROXIES", "127.0.0.1/32"),
            ("REDIS_PREFIX", "sms2"),
        ],
    );
    let started = Instant::now();
    let mut accepted = 0u64;
    for i in 0..40 {
        let gw = if i % 2 == 0 { &a } else { &b };
        let ip = format!("198.51.100.{i}");
        let r = http
            .send(
                "POST",
                &gw.url("/v1/sms"),
                &[("x-forwarded-for", &ip)],
                &sms(&format!("+861370000{i:04}"), "x"),
            )
            .await;
        if r.status == 202 {
            accepted += 1;
        } else {
            assert_eq!(
                (r.status, r.body["error"]["limit"].as_str()),
                (429, Some("global")),
                "{}",
                r.body
            );
        }
    }
    let elapsed = started.elapsed().as_secs_f64();
    let bound = 5 + (elapsed * 5.0).ceil() as u64;
    assert!(
        accepted >= 5 && accepted <= bound,
        "{accepted} accepted in {elapsed:.2}s (bound {bound})"
    );
    let _ = std::fs::remove_dir_all(dir);
}

/// Every line of both outboxes, by phone.
fn outbox_by_phone(gateways: &[&Gateway], campaign: &str) -> HashMap<String, usize> {
    let mut seen = HashMap::new();
    for gw in gateways {
        for line in gw.outbox_lines() {
            if line["campaign"] == campaign {
                *seen
                    .entry(line["phone"].as_str().expect("phone").to_owned())
                    .or_insert(0) += 1;
            }
        }
    }
    seen
}

fn campaign_phones(n: usize, base: u64) -> Vec<String> {
    (0..n).map(|i| format!("+86{}", base + i as u64)).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_campaign_of_2000_is_sent_exactly_once_and_skips_opt_outs() {
    let redis = RedisServer::start().expect("redis-server");
    let dir = temp_dir("campaign");
    let (a, b) = pair(
        &dir,
        &redis,
        &[("IP_PER_MINUTE", "100000"), ("MAX_PENDING_CAMPAIGNS", "1")],
    );
    let http = Http::new();
    let phones = campaign_phones(2_000, 13_500_000_000);
    // Some numbers opted out, through either replica.
    let opted: Vec<&String> = phones.iter().step_by(97).collect();
    for (i, p) in opted.iter().enumerate() {
        let gw = if i % 2 == 0 { &a } else { &b };
        let r = http
            .post(&gw.url("/v1/opt-outs"), &json!({"phone": p}).to_string())
            .await;
        assert_eq!(r.status, 201, "{}", r.body);
    }
    let created = http
        .post(
            &a.url("/v1/campaigns"),
            &json!({"phones": phones, "text": "spring sale"}).to_string(),
        )
        .await;
    assert_eq!(created.status, 202, "{}", created.body);
    let id = created.body["id"].as_str().expect("id").to_owned();
    // One campaign pending at most, across replicas: the other one refuses a second.
    let another = json!({"phones": ["+8613512345678"], "text": "later"}).to_string();
    let refused = http.post(&b.url("/v1/campaigns"), &another).await;
    assert_eq!(refused.status, 503, "{}", refused.body);
    assert_eq!(refused.body["error"]["code"], "too_many_campaigns");
    let progress = wait_campaign(&http, &[&a, &b], &id, Duration::from_secs(120)).await;
    // Completed, it no longer counts (its leaving the pending set follows its completion by a
    // round trip: asked again for up to 2 s).
    let deadline = Instant::now() + Duration::from_secs(2);
    let accepted = loop {
        let r = http.post(&b.url("/v1/campaigns"), &another).await;
        if r.status != 503 || Instant::now() >= deadline {
            break r;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(accepted.status, 202, "{}", accepted.body);
    assert_eq!(progress["total"], 2_000);
    assert_eq!(progress["opted_out"], opted.len());
    assert_eq!(progress["sent"], 2_000 - opted.len());
    assert_eq!(progress["unknown"], 0);

    let seen = outbox_by_phone(&[&a, &b], &id);
    assert_eq!(seen.len(), 2_000 - opted.len());
    assert!(
        seen.values().all(|n| *n == 1),
        "a number was messaged twice"
    );
    assert!(
        opted.iter().all(|p| !seen.contains_key(p.as_str())),
        "an opted-out number was messaged"
    );
    let _ = std::fs::remove_dir_all(dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killing_the_dispatching_replica_mid_campaign_still_completes_it_once() {
    let redis = RedisServer::start().expect("redis-server");
    let dir = temp_dir("failover");
    let lease = "2s";
    let (mut a, mut b) = pair(
        &dir,
        &redis,
        &[("IP_PER_MINUTE", "100000"), ("CAMPAIGN_LEASE", lease)],
    );
    let http = Http::new();
    let phones = campaign_phones(2_000, 13_600_000_000);
    let created = http
        .post(
            &a.url("/v1/campaigns"),
            &json!({"phones": phones, "text": "flash sale"}).to_string(),
        )
        .await;
    assert_eq!(created.status, 202, "{}", created.body);
    let id = created.body["id"].as_str().expect("id").to_owned();

    // Wait until a replica is well into it, then kill that one.
    let deadline = Instant::now() + Duration::from_secs(60);
    let (dispatcher, fence) = loop {
        let p = http.get(&a.url(&format!("/v1/campaigns/{id}"))).await.body;
        if p["claimed"].as_u64().unwrap_or(0) >= 200
            && let (Some(d), Some(f)) = (p["dispatcher"].as_str(), p["fence"].as_u64())
        {
            break (d.to_owned(), f);
        }
        assert!(Instant::now() < deadline, "the campaign did not start: {p}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let killed_at = Instant::now();
    let survivor = if dispatcher == "a" {
        a.kill();
        &b
    } else {
        b.kill();
        &a
    };
    let progress = wait_campaign(&http, &[survivor], &id, Duration::from_secs(120)).await;
    let took = killed_at.elapsed();
    assert_eq!(
        progress["dispatcher"],
        survivor.instance.as_str(),
        "{progress}"
    );
    // The survivor writes with its own fencing token, larger than the killed one's (whose
    // late writes the campaign would refuse: `a_superseded_dispatcher_writes_nothing`).
    assert!(
        progress["fence"].as_u64().expect("fence") > fence && fence > 0,
        "{progress} after {fence}"
    );
    assert_eq!(progress["total"], 2_000);
    // A number the dead replica claimed but did not record is never retried: at most one.
    let unknown = progress["unknown"].as_u64().expect("unknown");
    assert!(unknown <= 1, "{progress}");
    assert_eq!(
        progress["sent"].as_u64().expect("sent") + unknown,
        2_000,
        "{progress}"
    );

    let seen = outbox_by_phone(&[&a, &b], &id);
    assert!(
        seen.values().all(|n| *n == 1),
        "a number was messaged twice"
    );
    assert!(seen.len() as u64 >= 2_000 - unknown);
    eprintln!("resumed and completed {took:?} after the kill (lease {lease})");
    let _ = std::fs::remove_dir_all(dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idempotency_keys_and_opt_outs_are_shared_by_replicas() {
    let redis = RedisServer::start().expect("redis-server");
    let dir = temp_dir("idem");
    let (a, b) = pair(&dir, &redis, &[]);
    let http = Http::new();
    let key = [("idempotency-key", "req-7f3a")];
    let first = http
        .send(
            "POST",
            &a.url("/v1/sms"),
            &key,
            &sms("+8613700000001", "code 9"),
        )
        .await;
    let again = http
        .send(
            "POST",
            &b.url("/v1/sms"),
            &key,
            &sms("+8613700000001", "code 9"),
        )
        .await;
    assert_eq!(
        (first.status, again.status),
        (202, 202),
        "{} {}",
        first.body,
        again.body
    );
    assert_eq!(first.body["id"], again.body["id"]);
    assert_eq!(again.headers["idempotent-replayed"], "true");
    let other = http
        .send(
            "POST",
            &b.url("/v1/sms"),
            &key,
            &sms("+8613700000001", "code 10"),
        )
        .await;
    assert_eq!(other.status, 422, "{}", other.body);
    // Opted out on one replica, refused on the other.
    let r = http
        .post(&a.url("/v1/opt-outs"), r#"{"phone":"+8613700000002"}"#)
        .await;
    assert_eq!(r.status, 201);
    let r = http
        .post(&b.url("/v1/sms"), &sms("+8613700000002", "hi"))
        .await;
    assert_eq!(r.status, 403, "{}", r.body);
    assert_eq!(a.outbox_lines().len() + b.outbox_lines().len(), 1);
    let _ = std::fs::remove_dir_all(dir);
}

/// A double submit across replicas: a phone's first message goes to replica A, its second to
/// B, which refuses it (the phone's limit) and remembers that; A's provider then refuses the
/// message, and A gives the phone's units back. The client's retry on B is accepted within
/// about a second (B holds a denial a second at most), not in 30 minutes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refund_on_one_replica_reaches_the_other() {
    use std::sync::atomic::{AtomicU8, Ordering};
    let redis = RedisServer::start().expect("redis-server");
    let mode = Arc::new(AtomicU8::new(SLOW_REFUSE));
    let (hook, taken) = webhook(Arc::clone(&mode)).await;
    let dir = temp_dir("refund-replicas");
    let (a, b) = pair(&dir, &redis, &[("WEBHOOK_URL", &hook)]);
    let http = Http::new();
    let phone = "+8613866666666";
    let to_a = a.url("/v1/sms");
    let first = tokio::spawn(async move { Http::new().post(&to_a, &sms(phone, "one")).await });
    // A has counted the message and waits on the provider: B refuses the second.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let second = http.post(&b.url("/v1/sms"), &sms(phone, "two")).await;
    assert_eq!(second.status, 429, "{}", second.body);
    assert_eq!(second.body["error"]["limit"], "phone");
    let first = first.await.expect("task");
    assert_eq!(first.status, 502, "{}", first.body);
    assert_eq!(first.body["error"]["code"], "provider_error");

    mode.store(TAKE, Ordering::SeqCst);
    let refunded = Instant::now();
    loop {
        let retry = http.post(&b.url("/v1/sms"), &sms(phone, "two")).await;
        if retry.status == 202 {
            break;
        }
        assert_eq!(retry.status, 429, "{}", retry.body);
        assert!(
            refunded.elapsed() < Duration::from_secs(5),
            "B still refuses {:?} after A's refund",
            refunded.elapsed()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(taken.load(Ordering::SeqCst), 1);
    let _ = std::fs::remove_dir_all(dir);
}

/// On Redis, behind the deny cache: a message the provider refused gives the phone's units
/// back, and the same client's retry on the same replica goes out at once. The check that
/// spent the phone's last unit had the cache hold a denial for the whole check; the refund
/// must clear it, or the retry is told to wait the phone's 30 minutes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retry_after_a_provider_refusal_is_sent_on_the_same_replica() {
    use std::sync::atomic::{AtomicU8, Ordering};
    let redis = RedisServer::start().expect("redis-server");
    let mode = Arc::new(AtomicU8::new(REFUSE));
    let (hook, taken) = webhook(Arc::clone(&mode)).await;
    let dir = temp_dir("refund-same-replica");
    let url = redis.url();
    let gw = Gateway::start(&dir, "solo", &[("REDIS_URL", &url), ("WEBHOOK_URL", &hook)]);
    let http = Http::new();
    let phone = "+8613877777777";
    let refused = http.post(&gw.url("/v1/sms"), &sms(phone, "hello")).await;
    assert_eq!(refused.status, 502, "{}", refused.body);
    assert_eq!(refused.body["error"]["code"], "provider_error");
    mode.store(TAKE, Ordering::SeqCst);
    let retried = http.post(&gw.url("/v1/sms"), &sms(phone, "hello")).await;
    assert_eq!(retried.status, 202, "{}", retried.body);
    assert_eq!(taken.load(Ordering::SeqCst), 1);
    let _ = std::fs::remove_dir_all(dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_hanging_up_mid_creation_does_not_cut_the_campaign_off() {
    use std::io::Write;
    let redis = RedisServer::start().expect("redis-server");
    let dir = temp_dir("hang-up-campaign");
    let url = redis.url();
    let gw = Gateway::start(&dir, "a", &[("REDIS_URL", &url)]);
    let phones = campaign_phones(100_000, 13_500_000_000);
    let body = json!({"text": "sale", "phones": phones}).to_string();
    let mut stream = std::net::TcpStream::connect(("127.0.0.1", gw.port)).expect("connect");
    write!(
        stream,
        "POST /v1/campaigns HTTP/1.1\r\nhost: gw\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    )
    .expect("send the campaign");
    // Hang up as soon as the creation has begun writing the numbers.
    let started = Instant::now();
    while keys(&redis, "sms:campaign:*").is_empty() {
        assert!(
            started.elapsed() < Duration::from_secs(20),
            "the creation never began"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
    drop(stream);
    // The campaign is created whole: pending, with every number.
    let mut last = String::new();
    while started.elapsed() < Duration::from_secs(20) {
        let pending = redis
            .cmd_ok(&["SMEMBERS", "sms:campaigns:pending"])
            .expect("SMEMBERS");
        if let floodgate_testkit::Resp::Array(Some(ids)) = &pending
            && let [floodgate_testkit::Resp::Bulk(Some(id))] = ids.as_slice()
        {
            let id = String::from_utf8_lossy(id);
            let list = format!("sms:campaign:{{{id}}}:phones");
            let hash = format!("sms:campaign:{{{id}}}");
            let len = redis.cmd_ok(&["LLEN", &list]).expect("LLEN");
            let kept = redis.cmd_ok(&["PTTL", &list]).expect("PTTL");
            let total = redis.cmd_ok(&["HGET", &hash, "total"]).expect("HGET");
            last = format!("{len:?} {kept:?} {total:?}");
            if matches!(len, floodgate_testkit::Resp::Int(100_000))
                && matches!(kept, floodgate_testkit::Resp::Int(-1))
            {
                return;
            }
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    panic!(
        "no whole campaign: {last}; campaign keys {:?}",
        keys(&redis, "sms:campaign*")
    );
}

/// The keys of `redis` matching `pattern`.
fn keys(redis: &RedisServer, pattern: &str) -> Vec<String> {
    match redis.cmd_ok(&["KEYS", pattern]).expect("KEYS") {
        floodgate_testkit::Resp::Array(Some(keys)) => keys
            .iter()
            .map(|k| match k {
                floodgate_testkit::Resp::Bulk(Some(k)) => String::from_utf8_lossy(k).into_owned(),
                other => panic!("KEYS: {other:?}"),
            })
            .collect(),
        other => panic!("KEYS: {other:?}"),
    }
}

/// A campaign whose creation has not completed (its parts written, its place among the
/// pending ones taken, not yet kept: the creating replica died, or its last step failed) is
/// neither dispatched nor shown; once kept, it is sent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_campaign_not_yet_kept_is_neither_sent_nor_shown() {
    let redis = RedisServer::start().expect("redis-server");
    let dir = temp_dir("staged-campaign");
    let url = redis.url();
    let gw = Gateway::start(&dir, "a", &[("REDIS_URL", &url)]);
    let (hash, list) = ("sms:campaign:{staged1}", "sms:campaign:{staged1}:phones");
    redis
        .cmd_ok(&[
            "HSET",
            hash,
            "text",
            "hi",
            "total",
            "2",
            "status",
            "staged",
            "created_ms",
            "1",
            "cursor",
            "0",
        ])
        .expect("HSET");
    redis
        .cmd_ok(&["RPUSH", list, "+8613500000001", "+8613500000002"])
        .expect("RPUSH");
    redis
        .cmd_ok(&["SADD", "sms:campaigns:pending", "staged1"])
        .expect("SADD");
    let http = Http::new();
    let shown = http.get(&gw.url("/v1/campaigns/staged1")).await;
    assert_eq!(shown.status, 404, "{}", shown.body);
    // The dispatcher has taken the campaign's lock (its fence is counted), looked, and left
    // it; and again, half a second later.
    let looked = Instant::now();
    while !keys(&redis, "sms:lock:{campaign:staged1}*")
        .iter()
        .any(|k| k.ends_with(":fence"))
    {
        assert!(
            looked.elapsed() < Duration::from_secs(10),
            "no dispatcher looked at the campaign"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    tokio::time::sleep(Duration::from_millis(700)).await;
    assert!(
        outbox_by_phone(&[&gw], "staged1").is_empty(),
        "a staged campaign was sent"
    );
    assert_eq!(
        redis.cmd_ok(&["HGET", hash, "status"]).expect("HGET"),
        floodgate_testkit::Resp::Bulk(Some(b"staged".to_vec())),
        "a staged campaign was taken up"
    );
    // Kept, it is a campaign like any other.
    redis
        .cmd_ok(&["HSET", hash, "status", "pending"])
        .expect("HSET");
    let progress = wait_campaign(&http, &[&gw], "staged1", Duration::from_secs(30)).await;
    assert_eq!(progress["sent"], 2, "{progress}");
    assert_eq!(outbox_by_phone(&[&gw], "staged1").len(), 2);
    let _ = std::fs::remove_dir_all(dir);
}

/// A provider that is busy (429 with `Retry-After`) did not take the message: the client is
/// told to come back then (503 `provider_busy`), and the phone's units are given back, so that
/// its retry goes out; a campaign's numbers wait for the provider instead of failing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_busy_provider_is_waited_for_not_failed() {
    use std::sync::atomic::{AtomicU8, Ordering};
    let redis = RedisServer::start().expect("redis-server");
    let mode = Arc::new(AtomicU8::new(THROTTLE));
    let (hook, taken) = webhook(Arc::clone(&mode)).await;
    let dir = temp_dir("busy-provider");
    let url = redis.url();
    let gw = Gateway::start(&dir, "solo", &[("REDIS_URL", &url), ("WEBHOOK_URL", &hook)]);
    let http = Http::new();
    let phone = "+8613866666666";
    let busy = http.post(&gw.url("/v1/sms"), &sms(phone, "hello")).await;
    assert_eq!(busy.status, 503, "{}", busy.body);
    assert_eq!(busy.body["error"]["code"], "provider_busy", "{}", busy.body);
    assert_eq!(
        busy.headers.get("retry-after").map(|v| v.as_bytes()),
        Some(&b"1"[..]),
        "{:?}",
        busy.headers
    );
    // A campaign meanwhile: its numbers wait for the provider (held back during its pause).
    let phones = campaign_phones(3, 13_600_000_000);
    let created = http
        .post(
            &gw.url("/v1/campaigns"),
            &json!({"phones": phones, "text": "sale"}).to_string(),
        )
        .await;
    assert_eq!(created.status, 202, "{}", created.body);
    let id = created.body["id"].as_str().expect("id").to_owned();
    // A campaign message met the busy provider too (the API's was the first).
    let waited = Instant::now();
    while busy_count(&http, &gw).await < 2 {
        assert!(
            waited.elapsed() < Duration::from_secs(10),
            "no campaign message met the busy provider"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    mode.store(TAKE, Ordering::SeqCst);
    // The pause it asked for passes before the next message goes to it.
    tokio::time::sleep(Duration::from_millis(1_100)).await;
    let retried = http.post(&gw.url("/v1/sms"), &sms(phone, "hello")).await;
    assert_eq!(retried.status, 202, "{}", retried.body);
    let progress = wait_campaign(&http, &[&gw], &id, Duration::from_secs(30)).await;
    assert_eq!(progress["sent"], 3, "{progress}");
    assert_eq!(progress["failed"], 0, "{progress}");
    assert_eq!(taken.load(Ordering::SeqCst), 4);
    let _ = std::fs::remove_dir_all(dir);
}

/// How many messages met a busy provider on `gw` (`sms_errors_total{what="provider_busy"}`).
async fn busy_count(http: &Http, gw: &Gateway) -> u64 {
    let metrics = http.get(&gw.url("/metrics")).await;
    let text = metrics.body.as_str().unwrap_or_default().to_owned();
    text.lines()
        .filter(|l| l.starts_with("sms_errors_total") && l.contains("what=\"provider_busy\""))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum::<f64>() as u64
}
