//! One replica, no Redis: what README's first command starts.

mod support;

use std::time::{Duration, Instant};

use support::{
    Gateway, Http, REFUSE, STALL, TAKE, open_file_limit, sms, start_refused, temp_dir,
    wait_campaign, webhook,
};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_replica_in_memory_limits_validates_and_opts_out() {
    let dir = temp_dir("memory");
    let gw = Gateway::start(&dir, "solo", &[]);
    let http = Http::new();

    // The first message to a phone is accepted; the next within 30 minutes is not.
    let first = http
        .post(&gw.url("/v1/sms"), &sms("+8613800000000", "hello"))
        .await;
    assert_eq!(first.status, 202, "{}", first.body);
    assert!(first.body["id"].as_str().is_some_and(|s| s.len() == 32));
    let second = http
        .post(&gw.url("/v1/sms"), &sms("+8613800000000", "again"))
        .await;
    assert_eq!(second.status, 429, "{}", second.body);
    assert_eq!(second.body["error"]["limit"], "phone");
    let retry = second.body["error"]["retry_after_ms"]
        .as_u64()
        .expect("retry");
    assert!((29 * 60_000..=30 * 60_000).contains(&retry), "{retry}");
    assert_eq!(second.headers["retry-after"], "1800");
    let ratelimit = second.headers["ratelimit"].to_str().expect("ascii");
    assert!(ratelimit.contains("\"phone\";r=0;t=1800"), "{ratelimit}");

    // Bad input: 4xx naming the field; nothing consumed from the phone's quota.
    let cases: &[(&str, u16, &str)] = &[
        (r#"{"phone":"+8613811111111"}"#, 422, "text"),
        (r#"{"phone":"+8613811111111","text":""}"#, 422, "text"),
        (r#"{"phone":"13811111111","text":"x"}"#, 422, "phone"),
        (r#"{"phone":123,"text":"x"}"#, 422, "phone"),
        (
            r#"{"phone":"+86138111111119999999","text":"x"}"#,
            422,
            "phone",
        ),
    ];
    for (body, status, field) in cases {
        let r = http.post(&gw.url("/v1/sms"), body).await;
        assert_eq!(r.status, *status, "{body}: {}", r.body);
        assert_eq!(r.body["error"]["field"], *field, "{body}");
    }
    let long = "x".repeat(sms_gateway::phone::MAX_TEXT_CHARS + 1);
    let r = http
        .post(&gw.url("/v1/sms"), &sms("+8613811111111", &long))
        .await;
    assert_eq!(
        (r.status, r.body["error"]["field"].as_str()),
        (422, Some("text"))
    );
    let r = http.post(&gw.url("/v1/sms"), "{not json").await;
    assert_eq!(
        (r.status, r.body["error"]["code"].as_str()),
        (400, Some("invalid_json"))
    );
    let huge = format!(
        r#"{{"phone":"+8613811111111","text":"{}"}}"#,
        "x".repeat(40_000)
    );
    let r = http.post(&gw.url("/v1/sms"), &huge).await;
    assert_eq!(r.status, 413, "{}", r.body);
    // An opt-out is one number: not a campaign's 4 MiB.
    let r = http.post(&gw.url("/v1/opt-outs"), &huge).await;
    assert_eq!(r.status, 413, "{}", r.body);
    let r = http
        .send(
            "POST",
            &gw.url("/v1/sms"),
            &[("idempotency-key", "bad key with spaces")],
            &sms("+8613811111111", "x"),
        )
        .await;
    assert_eq!(
        (r.status, r.body["error"]["field"].as_str()),
        (422, Some("Idempotency-Key"))
    );
    // After all that, the phone that only saw invalid requests still has its full quota.
    let ok = http
        .post(&gw.url("/v1/sms"), &sms("+8613811111111", "valid"))
        .await;
    assert_eq!(ok.status, 202, "{}", ok.body);

    // Idempotency: the same key and request replays the answer without sending again.
    let idem = [("idempotency-key", "order-42")];
    let a = http
        .send(
            "POST",
            &gw.url("/v1/sms"),
            &idem,
            &sms("+8613822222222", "code 1"),
        )
        .await;
    let b = http
        .send(
            "POST",
            &gw.url("/v1/sms"),
            &idem,
            &sms("+8613822222222", "code 1"),
        )
        .await;
    assert_eq!((a.status, b.status), (202, 202));
    assert_eq!(a.body["id"], b.body["id"]);
    assert_eq!(b.headers["idempotent-replayed"], "true");
    let c = http
        .send(
            "POST",
            &gw.url("/v1/sms"),
            &idem,
            &sms("+8613822222222", "other"),
        )
        .await;
    assert_eq!(
        (c.status, c.body["error"]["field"].as_str()),
        (422, Some("Idempotency-Key"))
    );

    // Opt-outs are refused, through the Bloom filter and the exact list.
    let r = http
        .post(&gw.url("/v1/opt-outs"), r#"{"phone":"+8613833333333"}"#)
        .await;
    assert_eq!(r.status, 201);
    // The layer's routes tell clients their per-IP budget on allowed responses too.
    let ratelimit = r.headers["ratelimit"].to_str().expect("ascii");
    assert!(ratelimit.contains("\"client-ip\";r="), "{ratelimit}");
    let r = http
        .post(&gw.url("/v1/sms"), &sms("+8613833333333", "hi"))
        .await;
    assert_eq!(
        (r.status, r.body["error"]["code"].as_str()),
        (403, Some("opted_out"))
    );

    // Health and metrics.
    let h = http.get(&gw.url("/healthz")).await;
    assert_eq!((h.status, h.body["store"].as_str()), (200, Some("memory")));
    let m = http.get(&gw.url("/metrics")).await;
    let text = m.body.as_str().expect("text");
    assert!(text.contains("sms_sent_total"), "{text}");
    assert!(
        text.contains("sms_rejected_total{limit=\"phone\"}"),
        "{text}"
    );

    // Exactly the accepted messages reached the outbox; no opted-out number.
    let lines = gw.outbox_lines();
    assert_eq!(lines.len(), 3, "{lines:?}");
    assert!(lines.iter().all(|l| l["phone"] != "+8613833333333"));
    let _ = std::fs::remove_dir_all(dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn per_ip_limit_and_graceful_shutdown() {
    let dir = temp_dir("ip");
    let mut gw = Gateway::start(&dir, "ip", &[("IP_PER_MINUTE", "5")]);
    let http = Http::new();
    let mut accepted = 0;
    for i in 0..8 {
        let r = http
            .post(&gw.url("/v1/sms"), &sms(&format!("+861380000{i:04}"), "x"))
            .await;
        match r.status {
            202 => accepted += 1,
            429 => assert_eq!(r.body["error"]["limit"], "client-ip"),
            other => panic!("unexpected {other}: {}", r.body),
        }
    }
    assert_eq!(accepted, 5);
    // The layer guards the other endpoints with the same per-IP limit: it is spent.
    let r = http
        .post(&gw.url("/v1/opt-outs"), r#"{"phone":"+8613800000000"}"#)
        .await;
    assert_eq!(r.status, 429, "{}", r.body);
    assert!(r.headers.contains_key("retry-after"));
    let status = gw.terminate();
    assert!(status.success(), "{status:?}");
    tokio::time::sleep(Duration::from_millis(10)).await;
    let _ = std::fs::remove_dir_all(dir);
}

/// A message that is not sent gives back the phone's and the global units, not the client's:
/// a client cannot ask at any rate which numbers opted out, nor make the provider refuse
/// messages at any rate. Once over its limit, it is refused before either is asked.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn messages_not_sent_still_spend_the_clients_budget() {
    use std::sync::atomic::Ordering;
    let mode = std::sync::Arc::new(std::sync::atomic::AtomicU8::new(REFUSE));
    let (url, taken) = webhook(std::sync::Arc::clone(&mode)).await;
    let dir = temp_dir("not-sent");
    let gw = Gateway::start(
        &dir,
        "not-sent",
        &[("WEBHOOK_URL", &url), ("IP_PER_MINUTE", "6")],
    );
    let http = Http::new();
    // The opt-out spends one unit of the client's (the layer's per-IP limit).
    let opted = "+8613833333333";
    let r = http
        .post(
            &gw.url("/v1/opt-outs"),
            &format!(r#"{{"phone":"{opted}"}}"#),
        )
        .await;
    assert_eq!(r.status, 201, "{}", r.body);
    let mut seen = Vec::new();
    for i in 0..4 {
        // Two opted-out lookups, then two messages the provider refuses.
        let phone = if i < 2 {
            opted.to_owned()
        } else {
            format!("+86138000001{i:02}")
        };
        let r = http.post(&gw.url("/v1/sms"), &sms(&phone, "hi")).await;
        seen.push((
            r.status,
            r.body["error"]["code"].as_str().map(str::to_owned),
        ));
    }
    assert_eq!(
        seen,
        [
            (403, Some("opted_out".to_owned())),
            (403, Some("opted_out".to_owned())),
            (502, Some("provider_error".to_owned())),
            (502, Some("provider_error".to_owned())),
        ]
    );
    // The phone's units came back: its message goes out once the provider takes it.
    mode.store(TAKE, Ordering::SeqCst);
    let r = http
        .post(&gw.url("/v1/sms"), &sms("+8613800000102", "hi"))
        .await;
    assert_eq!(r.status, 202, "{}", r.body);
    assert_eq!(taken.load(Ordering::SeqCst), 1);
    // Six requests spent the client's six units: the next is refused for the client, neither
    // the opt-out list nor the provider asked.
    for phone in [opted, "+8613800000103"] {
        let r = http.post(&gw.url("/v1/sms"), &sms(phone, "hi")).await;
        assert_eq!(
            (r.status, r.body["error"]["limit"].as_str()),
            (429, Some("client-ip")),
            "{}",
            r.body
        );
    }
    assert_eq!(taken.load(Ordering::SeqCst), 1);
    let _ = std::fs::remove_dir_all(dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_creating_campaigns_spends_the_global_budget() {
    let dir = temp_dir("global");
    let gw = Gateway::start(
        &dir,
        "global",
        &[("GLOBAL_PER_SECOND", "1"), ("IP_PER_MINUTE", "1000")],
    );
    let http = Http::new();
    let campaign = r#"{"text":"sale","phones":["+8613855555555"]}"#;
    let created = http.post(&gw.url("/v1/campaigns"), campaign).await;
    assert_eq!(created.status, 202, "{}", created.body);
    // Creating another campaign at once is turned away by the global limit.
    let again = http.post(&gw.url("/v1/campaigns"), campaign).await;
    assert_eq!(again.status, 429, "{}", again.body);
    let ratelimit = again.headers["ratelimit"].to_str().expect("ascii");
    assert!(ratelimit.contains("\"global\";r=0"), "{ratelimit}");
    // The global budget (one per second) is spent; requests that send nothing still pass,
    // and their headers do not mention it.
    for i in 0..5 {
        let r = http
            .post(
                &gw.url("/v1/opt-outs"),
                &format!(r#"{{"phone":"+86138666666{i:02}"}}"#),
            )
            .await;
        assert_eq!(r.status, 201, "opt-out {i}: {}", r.body);
        let ratelimit = r.headers["ratelimit"].to_str().expect("ascii");
        assert!(!ratelimit.contains("global"), "{ratelimit}");
        let r = http.get(&gw.url("/v1/campaigns/nosuchcampaign")).await;
        assert_eq!(r.status, 404, "read {i}: {}", r.body);
    }
    let _ = std::fs::remove_dir_all(dir);
}

/// One global budget of messages: the API's messages, creating a campaign and the campaign's
/// messages all spend it. Under one per second, a message through the API leaves nothing for
/// creating a campaign at once; a campaign of three numbers then takes three seconds or so to
/// send (its creation spent one), each number sent when the budget allows, none limited.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_api_and_campaigns_spend_one_global_budget() {
    let dir = temp_dir("budget");
    let gw = Gateway::start(
        &dir,
        "budget",
        &[("GLOBAL_PER_SECOND", "1"), ("IP_PER_MINUTE", "1000")],
    );
    let http = Http::new();
    let campaign =
        r#"{"text":"sale","phones":["+8613877777701","+8613877777702","+8613877777703"]}"#;
    let sent = http
        .post(&gw.url("/v1/sms"), &sms("+8613877777700", "hello"))
        .await;
    assert_eq!(sent.status, 202, "{}", sent.body);
    let refused = http.post(&gw.url("/v1/campaigns"), campaign).await;
    assert_eq!(refused.status, 429, "{}", refused.body);
    tokio::time::sleep(Duration::from_millis(1_100)).await;

    let started = Instant::now();
    let created = http.post(&gw.url("/v1/campaigns"), campaign).await;
    assert_eq!(created.status, 202, "{}", created.body);
    let id = created.body["id"].as_str().expect("id").to_owned();
    let progress = wait_campaign(&http, &[&gw], &id, Duration::from_secs(30)).await;
    assert_eq!(progress["sent"], 3, "{progress}");
    assert_eq!(progress["limited"], 0, "{progress}");
    assert!(
        started.elapsed() >= Duration::from_millis(2_500),
        "three messages under one per second in {:?}",
        started.elapsed()
    );
    let _ = std::fs::remove_dir_all(dir);
}

/// Campaigns take at most four fifths of the global budget: while one runs, the API keeps
/// the rest, instead of every message through it being refused until the campaign ends.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_running_campaign_leaves_the_api_a_share_of_the_global_budget() {
    let dir = temp_dir("share");
    let gw = Gateway::start(
        &dir,
        "share",
        &[("GLOBAL_PER_SECOND", "5"), ("IP_PER_MINUTE", "1000")],
    );
    let http = Http::new();
    let phones: Vec<String> = (0..40).map(|i| format!("\"+86139000001{i:02}\"")).collect();
    let campaign = format!(r#"{{"text":"sale","phones":[{}]}}"#, phones.join(","));
    let created = http.post(&gw.url("/v1/campaigns"), &campaign).await;
    assert_eq!(created.status, 202, "{}", created.body);
    // Once the campaign has spent the burst, ten API messages over three seconds.
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    let mut accepted = 0;
    for i in 0..10 {
        let r = http
            .post(
                &gw.url("/v1/sms"),
                &sms(&format!("+86139000002{i:02}"), "hi"),
            )
            .await;
        assert!(
            r.status == 202 || r.status == 429,
            "{}: {}",
            r.status,
            r.body
        );
        accepted += usize::from(r.status == 202);
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    assert!(
        accepted >= 2,
        "the API got {accepted} of 10 messages through"
    );
    let _ = std::fs::remove_dir_all(dir);
}

/// The provider refused the message: the phone's 30 minutes are not spent on a message that
/// did not go out, so the client's retry is sent; the limit still holds after it. A provider
/// that never answers may have sent the message: that one counts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_the_provider_refused_does_not_count() {
    use std::sync::atomic::Ordering;
    let mode = std::sync::Arc::new(std::sync::atomic::AtomicU8::new(REFUSE));
    let (url, taken) = webhook(std::sync::Arc::clone(&mode)).await;
    let dir = temp_dir("refused");
    let gw = Gateway::start(&dir, "solo", &[("WEBHOOK_URL", &url)]);
    let http = Http::new();
    let phone = "+8613822222222";

    let refused = http.post(&gw.url("/v1/sms"), &sms(phone, "hello")).await;
    assert_eq!(refused.status, 502, "{}", refused.body);
    assert_eq!(refused.body["error"]["code"], "provider_error");

    mode.store(TAKE, Ordering::SeqCst);
    let retried = http.post(&gw.url("/v1/sms"), &sms(phone, "hello")).await;
    assert_eq!(
        retried.status, 202,
        "the refused message counted: {}",
        retried.body
    );
    assert_eq!(taken.load(Ordering::SeqCst), 1);

    let again = http.post(&gw.url("/v1/sms"), &sms(phone, "again")).await;
    assert_eq!(again.status, 429, "{}", again.body);
    assert_eq!(again.body["error"]["limit"], "phone");

    // A webhook that takes the message and never answers (the gateway gives up after 5 s).
    let other = "+8613833333333";
    mode.store(STALL, Ordering::SeqCst);
    let unknown = http.post(&gw.url("/v1/sms"), &sms(other, "hello")).await;
    assert_eq!(unknown.status, 502, "{}", unknown.body);
    assert_eq!(unknown.body["error"]["code"], "provider_unknown");
    mode.store(TAKE, Ordering::SeqCst);
    let retried = http.post(&gw.url("/v1/sms"), &sms(other, "hello")).await;
    assert_eq!(
        retried.status, 429,
        "a message that may have gone out must count: {}",
        retried.body
    );

    // With an Idempotency-Key, a retry of a message whose fate is unknown gets that answer
    // again: no second send, no new decision.
    let third = "+8613844444444";
    let with_key = [
        ("content-type", "application/json"),
        ("idempotency-key", "fate-unknown-1"),
    ];
    mode.store(STALL, Ordering::SeqCst);
    let url = gw.url("/v1/sms");
    let unknown = http.send("POST", &url, &with_key, &sms(third, "hi")).await;
    assert_eq!(unknown.status, 502, "{}", unknown.body);
    assert_eq!(unknown.body["error"]["code"], "provider_unknown");
    mode.store(TAKE, Ordering::SeqCst);
    let replayed = http.send("POST", &url, &with_key, &sms(third, "hi")).await;
    assert_eq!(replayed.status, 502, "{}", replayed.body);
    assert_eq!(replayed.body["error"]["code"], "provider_unknown");
    assert_eq!(replayed.headers["idempotent-replayed"], "true");
    assert_eq!(taken.load(Ordering::SeqCst), 1, "sent again");
}

/// Pending campaigns are bounded: one more than `MAX_PENDING_CAMPAIGNS` is refused with 503,
/// naming why, with a `Retry-After`; the units the layer took for it come back, so that clients
/// retrying do not use up the global budget the pending campaigns need to complete.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn campaigns_beyond_the_pending_bound_are_refused() {
    let dir = temp_dir("pending");
    let gw = Gateway::start(
        &dir,
        "pending",
        &[
            // Campaigns send at 16 a second of it (their burst too), leaving the API 4 a
            // second: the two creations and their campaigns' first burst fit in 20.
            ("GLOBAL_PER_SECOND", "20"),
            ("IP_PER_MINUTE", "1000"),
            ("MAX_PENDING_CAMPAIGNS", "2"),
        ],
    );
    let http = Http::new();
    // 300 numbers each, sent at 16 a second: both stay pending for the rest of the test.
    let campaign = long_campaign;
    let mut ids = Vec::new();
    for n in 0..2 {
        let created = http.post(&gw.url("/v1/campaigns"), &campaign(n)).await;
        assert_eq!(created.status, 202, "campaign {n}: {}", created.body);
        ids.push(created.body["id"].as_str().expect("id").to_owned());
    }
    let refused = http.post(&gw.url("/v1/campaigns"), &campaign(2)).await;
    assert_eq!(refused.status, 503, "{}", refused.body);
    assert_eq!(
        refused.body["error"]["code"], "too_many_campaigns",
        "{}",
        refused.body
    );
    assert_eq!(refused.headers["retry-after"], "60");
    // Retried at once, ten times: each is refused for the same reason, never by the global
    // limit (which a refused creation spending its unit would reach after two or three).
    for i in 0..10 {
        let again = http.post(&gw.url("/v1/campaigns"), &campaign(2)).await;
        assert_eq!(again.status, 503, "retry {i}: {}", again.body);
    }
    // The two pending campaigns are the ones created, and still there.
    for id in &ids {
        let got = http.get(&gw.url(&format!("/v1/campaigns/{id}"))).await;
        assert_eq!(got.status, 200, "{}", got.body);
        assert_eq!(got.body["total"], 300, "{}", got.body);
    }
    let _ = std::fs::remove_dir_all(dir);
}

/// A campaign's body: 300 numbers of its own (`n` tells campaigns apart).
fn long_campaign(n: u32) -> String {
    let phones: Vec<String> = (0..300)
        .map(|i| format!("\"+86139{n:02}{i:06}\""))
        .collect();
    format!(r#"{{"text":"sale","phones":[{}]}}"#, phones.join(","))
}

/// One client cannot take every pending place: past its own bound, its next campaign is
/// refused, while another client's is accepted.
#[tokio::test]
async fn a_clients_pending_campaigns_are_bounded() {
    let dir = temp_dir("pending-per-client");
    let gw = Gateway::start(
        &dir,
        "pending-per-client",
        &[
            ("GLOBAL_PER_SECOND", "20"),
            ("IP_PER_MINUTE", "1000"),
            ("MAX_PENDING_CAMPAIGNS", "10"),
            ("MAX_PENDING_CAMPAIGNS_PER_CLIENT", "2"),
            // Clients come through a proxy on loopback, which names them.
            ("TRUSTED_PROXIES", "127.0.0.1/32"),
        ],
    );
    let http = Http::new();
    // 300 numbers each, sent at 16 a second: they stay pending for the rest of the test.
    let campaign = long_campaign;
    let create = |client: &'static str, n: u32| {
        let (http, url, body) = (http.clone(), gw.url("/v1/campaigns"), campaign(n));
        async move {
            http.send(
                "POST",
                &url,
                &[
                    ("content-type", "application/json"),
                    ("x-forwarded-for", client),
                ],
                &body,
            )
            .await
        }
    };
    for n in 0..2 {
        let created = create("203.0.113.1", n).await;
        assert_eq!(created.status, 202, "campaign {n}: {}", created.body);
    }
    let refused = create("203.0.113.1", 2).await;
    assert_eq!(refused.status, 429, "{}", refused.body);
    assert_eq!(
        refused.body["error"]["code"], "too_many_client_campaigns",
        "{}",
        refused.body
    );
    assert_eq!(refused.headers["retry-after"], "60");
    // Not given back: each retry at the bound spends one of the client's requests.
    let again = create("203.0.113.1", 2).await;
    assert_eq!(again.status, 429, "{}", again.body);
    assert_eq!(
        client_ip_remaining(&again.headers),
        client_ip_remaining(&refused.headers) - 1
    );
    let other = create("203.0.113.2", 3).await;
    assert_eq!(other.status, 202, "{}", other.body);
    let _ = std::fs::remove_dir_all(dir);
}

/// What the `client-ip` policy has left, from a response's `RateLimit` header
/// (`"client-ip";r=N;t=S, ...`).
fn client_ip_remaining(headers: &http::HeaderMap) -> u64 {
    let value = headers
        .get("ratelimit")
        .and_then(|v| v.to_str().ok())
        .expect("a RateLimit header");
    value
        .split(',')
        .find(|item| item.trim_start().starts_with("\"client-ip\""))
        .and_then(|item| item.split(';').find_map(|p| p.trim().strip_prefix("r=")))
        .and_then(|r| r.parse().ok())
        .unwrap_or_else(|| panic!("no client-ip remaining in {value:?}"))
}

/// Connects to `gw` with a read timeout.
fn connect(gw: &Gateway, read_timeout: Duration) -> std::net::TcpStream {
    let stream = std::net::TcpStream::connect(("127.0.0.1", gw.port)).expect("connect");
    stream
        .set_read_timeout(Some(read_timeout))
        .expect("read timeout");
    stream
}

/// Everything `stream` receives until the server closes it, and how long that took; a panic if
/// it is still open after the stream's read timeout.
fn read_until_closed(stream: &mut std::net::TcpStream) -> (String, Duration) {
    use std::io::{ErrorKind, Read};
    let started = Instant::now();
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        match stream.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => got.extend_from_slice(&buf[..n]),
            Err(e) if e.kind() == ErrorKind::ConnectionReset => break,
            Err(e) => panic!(
                "still open after {:?} ({e}); received {:?}",
                started.elapsed(),
                String::from_utf8_lossy(&got)
            ),
        }
    }
    (
        String::from_utf8_lossy(&got).into_owned(),
        started.elapsed(),
    )
}

/// One `GET /healthz` on a kept-alive connection; its status line.
fn healthz_on(stream: &mut std::net::TcpStream) -> String {
    use std::io::{Read, Write};
    stream
        .write_all(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        .expect("write");
    let mut buf = [0u8; 4096];
    let n = stream.read(&mut buf).expect("a reply");
    let reply = String::from_utf8_lossy(&buf[..n]).into_owned();
    reply.lines().next().unwrap_or_default().to_owned()
}

/// A client that never finishes its headers ("slowloris"), or leaves its connection idle, is
/// cut off after the header timeout, instead of holding a connection for good.
#[test]
fn a_client_that_never_finishes_its_headers_is_cut_off() {
    use std::io::Write;
    let dir = temp_dir("slow-headers");
    let gw = Gateway::start(&dir, "slow-headers", &[("HEADER_TIMEOUT", "300ms")]);
    let mut slow = connect(&gw, Duration::from_secs(5));
    slow.write_all(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        .expect("write");
    let (got, after) = read_until_closed(&mut slow);
    assert!(after < Duration::from_secs(3), "closed after {after:?}");
    // Nothing, or hyper's 408: never the answer to a request it did not finish reading.
    assert!(got.is_empty() || got.starts_with("HTTP/1.1 408"), "{got:?}");

    let mut idle = connect(&gw, Duration::from_secs(5));
    assert_eq!(healthz_on(&mut idle), "HTTP/1.1 200 OK");
    let (got, after) = read_until_closed(&mut idle);
    assert!(after < Duration::from_secs(3), "closed after {after:?}");
    assert!(got.is_empty(), "{got:?}");
    let _ = std::fs::remove_dir_all(dir);
}

/// A body that never ends gets 408 after the body timeout, and the connection is closed.
#[test]
fn a_request_whose_body_never_ends_gets_408() {
    use std::io::Write;
    let dir = temp_dir("slow-body");
    let gw = Gateway::start(&dir, "slow-body", &[("BODY_TIMEOUT", "500ms")]);
    let mut slow = connect(&gw, Duration::from_secs(10));
    let started = Instant::now();
    slow.write_all(
        b"POST /v1/sms HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n\
          Content-Length: 100\r\n\r\n{\"phone\":",
    )
    .expect("write");
    let (got, _) = read_until_closed(&mut slow);
    let after = started.elapsed();
    assert!(got.starts_with("HTTP/1.1 408"), "{got:?}");
    assert!(got.contains("request_timeout"), "{got:?}");
    assert!(
        after >= Duration::from_millis(500) && after < Duration::from_secs(5),
        "answered after {after:?}"
    );
    assert!(gw.outbox_lines().is_empty());
    let _ = std::fs::remove_dir_all(dir);
}

/// A client that sends requests and never reads the responses does not hold its connection
/// (nor its place among the bounded connections) for good: once the responses have waited the
/// header timeout for it to read, the connection is closed and the next client is served.
#[test]
fn a_client_that_never_reads_gives_its_connection_up() {
    use std::io::Write;
    let dir = temp_dir("never-reads");
    let gw = Gateway::start(
        &dir,
        "never-reads",
        &[("MAX_CONNECTIONS", "1"), ("HEADER_TIMEOUT", "1s")],
    );
    let sock = socket2_free_recv_buffer(&gw);
    // 20,000 pipelined requests, megabytes of answers nobody reads: they fill the buffers.
    let writer = std::thread::spawn(move || {
        let mut sock = sock;
        let request = b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n";
        for _ in 0..20_000 {
            if sock.write_all(request).is_err() {
                break;
            }
        }
        sock
    });
    std::thread::sleep(Duration::from_millis(500));
    let mut next = connect(&gw, Duration::from_secs(10));
    let started = Instant::now();
    assert_eq!(healthz_on(&mut next), "HTTP/1.1 200 OK");
    assert!(started.elapsed() < Duration::from_secs(8));
    drop(writer.join().expect("writer"));
    let _ = std::fs::remove_dir_all(dir);
}

/// A connection to `gw` whose receive buffer is as small as the kernel allows.
fn socket2_free_recv_buffer(gw: &Gateway) -> std::net::TcpStream {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    rt.block_on(async {
        let socket = tokio::net::TcpSocket::new_v4().expect("socket");
        socket.set_recv_buffer_size(1024).expect("SO_RCVBUF");
        let stream = socket
            .connect(([127, 0, 0, 1], gw.port).into())
            .await
            .expect("connect");
        let stream = stream.into_std().expect("std stream");
        stream.set_nonblocking(false).expect("blocking");
        stream
    })
}

/// Past the connection bound, the next client waits until a connection closes.
#[test]
fn connections_beyond_the_bound_wait_their_turn() {
    let dir = temp_dir("max-connections");
    let gw = Gateway::start(&dir, "max-connections", &[("MAX_CONNECTIONS", "2")]);
    // Two kept-alive connections, each answered: both are being served.
    let mut first = connect(&gw, Duration::from_secs(5));
    assert_eq!(healthz_on(&mut first), "HTTP/1.1 200 OK");
    let mut second = connect(&gw, Duration::from_secs(5));
    assert_eq!(healthz_on(&mut second), "HTTP/1.1 200 OK");
    let mut third = waiting_connection(&gw);
    drop(first);
    let (got, _) = read_until_closed(&mut third);
    assert!(got.starts_with("HTTP/1.1 200"), "{got:?}");
    drop(second);
    let _ = std::fs::remove_dir_all(dir);
}

/// A connection to `gw` whose request is not answered within 700 ms, as one past the
/// connection bound: its read timeout is then 5 s, for the answer it gets once a connection
/// closes.
fn waiting_connection(gw: &Gateway) -> std::net::TcpStream {
    use std::io::Write;
    let mut stream = connect(gw, Duration::from_millis(700));
    stream
        .write_all(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
        .expect("write");
    let mut buf = [0u8; 64];
    let waited = std::io::Read::read(&mut stream, &mut buf);
    assert!(
        waited.as_ref().is_err_and(|e| matches!(
            e.kind(),
            std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
        )),
        "a connection past the bound was served at once: {waited:?}"
    );
    stream
        .set_read_timeout(Some(Duration::from_secs(5)))
        .expect("read timeout");
    stream
}

/// The connection bound fits the open-file limit: the soft limit is raised as far as the
/// bound needs; a default bound the hard limit cannot hold is lowered to fit; an explicit one
/// is refused, with the bound that would fit.
#[cfg(target_os = "linux")]
#[test]
fn the_connection_bound_fits_the_open_file_limit() {
    let dir = temp_dir("open-files");
    // A hard limit can be lowered, not raised (unless by root): at most this process' own.
    let hard = own_hard_open_file_limit().min(4096);
    assert!(
        hard >= 1128,
        "this test needs a hard open-file limit of 1128 or more (ulimit -Hn), not {hard}"
    );
    // 1,000 connections and 128 files for the rest: raised from 256 to 1,128.
    let gw = Gateway::start_with(
        &dir,
        "files-raised",
        &[("MAX_CONNECTIONS", "1000")],
        Some((256, hard)),
    );
    assert_eq!(open_file_limit(&gw), (1128, hard));
    drop(gw);

    let (status, stderr) = start_refused(&dir, &[("MAX_CONNECTIONS", "1000")], (256, 512));
    assert!(!status.success(), "{status}");
    assert!(
        stderr.contains("MAX_CONNECTIONS=1000 needs up to 1128 open files")
            && stderr.contains("set MAX_CONNECTIONS to at most 384"),
        "{stderr}"
    );

    // The default 512 under a hard limit of 150: 22 connections at once, the next one waits.
    let gw = Gateway::start_with(&dir, "files-lowered", &[], Some((150, 150)));
    let mut served: Vec<_> = (0..22).map(|_| served_connection(&gw)).collect();
    let mut waiting = waiting_connection(&gw);
    served.pop();
    let (got, _) = read_until_closed(&mut waiting);
    assert!(got.starts_with("HTTP/1.1 200"), "{got:?}");
    let _ = std::fs::remove_dir_all(dir);
}

/// Past the bound of connections from one address, the next one is answered 503 and closed;
/// once one closes, the address is served again. Trusted proxies are exempt.
#[test]
fn connections_beyond_the_bound_of_an_address_are_refused() {
    use std::io::Write;
    let dir = temp_dir("max-per-ip");
    let gw = Gateway::start(&dir, "max-per-ip", &[("MAX_CONNECTIONS_PER_IP", "2")]);
    let first = served_connection(&gw);
    let second = served_connection(&gw);
    // The third has sent its request when it is refused: it still reads the answer.
    let mut third = connect(&gw, Duration::from_secs(5));
    third
        .write_all(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        .expect("write");
    let (got, _) = read_until_closed(&mut third);
    assert!(got.starts_with("HTTP/1.1 503"), "{got:?}");
    assert!(got.contains("retry-after: 1"), "{got:?}");
    assert!(got.contains("\"too_many_connections\""), "{got:?}");
    // One closes: the address has room again (its close reaches the server first).
    drop(first);
    drop(served_connection(&gw));
    drop(second);

    // Behind a trusted proxy, every client comes from its address: not bounded.
    let proxied = Gateway::start(
        &dir,
        "max-per-ip-proxied",
        &[
            ("MAX_CONNECTIONS_PER_IP", "1"),
            ("TRUSTED_PROXIES", "127.0.0.1/32"),
        ],
    );
    let mut kept: Vec<_> = (0..3)
        .map(|_| connect(&proxied, Duration::from_secs(5)))
        .collect();
    for stream in &mut kept {
        assert_eq!(healthz_on(stream), "HTTP/1.1 200 OK");
    }
    let _ = std::fs::remove_dir_all(dir);
}

/// SIGTERM lets a request in progress finish within the grace period, then closes it: a
/// client that never sends its body cannot keep the process from stopping. An idle kept-alive
/// connection is closed at once.
#[test]
fn shutdown_closes_requests_that_outlast_the_grace_period() {
    use std::io::Write;
    let dir = temp_dir("grace");
    let mut gw = Gateway::start(
        &dir,
        "grace",
        &[("SHUTDOWN_GRACE", "3s"), ("BODY_TIMEOUT", "60s")],
    );
    let partial = b"POST /v1/sms HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n\
          Content-Length: 40\r\n\r\n{\"phone\":";
    let mut slow = connect(&gw, Duration::from_secs(10));
    slow.write_all(partial).expect("write");
    // This one's body ends within the grace period: it is answered.
    let mut finishing = connect(&gw, Duration::from_secs(10));
    finishing.write_all(partial).expect("write");
    let mut idle = connect(&gw, Duration::from_secs(5));
    assert_eq!(healthz_on(&mut idle), "HTTP/1.1 200 OK");
    std::thread::sleep(Duration::from_millis(200));
    let idle_closed = std::thread::spawn(move || {
        let started = Instant::now();
        let (got, _) = read_until_closed(&mut idle);
        (got, started.elapsed())
    });
    let started = Instant::now();
    let finish = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(300));
        finishing
            .write_all(b"\"+8613812345678\",\"text\":\"late\"}")
            .expect("the rest of the body");
        read_until_closed(&mut finishing).0
    });
    let status = gw.terminate();
    assert!(status.success(), "{status:?}");
    let took = started.elapsed();
    assert!(
        took >= Duration::from_millis(2900) && took < Duration::from_secs(8),
        "stopped after {took:?}"
    );
    let (got, idle_after) = idle_closed.join().expect("idle");
    assert!(got.is_empty(), "{got:?}");
    assert!(
        idle_after < Duration::from_secs(2),
        "idle closed after {idle_after:?}"
    );
    let answered = finish.join().expect("finishing");
    assert!(answered.starts_with("HTTP/1.1 202"), "{answered:?}");
    let (got, _) = read_until_closed(&mut slow);
    assert!(!got.starts_with("HTTP/1.1 2"), "{got:?}");
    assert_eq!(gw.outbox_lines().len(), 1);
    let _ = std::fs::remove_dir_all(dir);
}

/// This process' hard open-file limit, from /proc (`u64::MAX` when unlimited).
#[cfg(target_os = "linux")]
fn own_hard_open_file_limit() -> u64 {
    let limits = std::fs::read_to_string("/proc/self/limits").expect("/proc/self/limits");
    let line = limits
        .lines()
        .find(|l| l.starts_with("Max open files"))
        .expect("an open-file limit");
    match line.split_whitespace().nth(4) {
        Some("unlimited") => u64::MAX,
        Some(hard) => hard.parse().expect("a number"),
        None => panic!("no hard limit in {line:?}"),
    }
}

/// A kept-alive connection to `gw` that has been answered. A connection whose client has just
/// seen it closed (the start's readiness probe, one the test dropped) may still count against
/// the address for a moment: refused, the next one is tried, for 5 s at most.
fn served_connection(gw: &Gateway) -> std::net::TcpStream {
    let started = Instant::now();
    loop {
        let mut stream = connect(gw, Duration::from_secs(5));
        let status = healthz_on(&mut stream);
        if status == "HTTP/1.1 200 OK" {
            return stream;
        }
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "no connection served: {status}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}
