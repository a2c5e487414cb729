//! The HTTP API: routes, handlers and the limits they apply.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use axum::Json;
use axum::Router;
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{ConnectInfo, DefaultBodyLimit, Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use floodgate::tower::key::{ClientIp, Key, TrustedProxies};
use floodgate::tower::{OnStoreError, RateLimitLayer, Rule};
use floodgate::{CalendarUnit, Check, CheckOptions, Limiter, Policy, Verdict};
use metrics_exporter_prometheus::PrometheusHandle;
use serde_json::{Value, json};
use tokio::sync::Notify;

use crate::config::Config;
use crate::error::ApiError;
use crate::phone::{Phone, validate_text};
use crate::provider::{OutboundSms, SmsProvider};
use crate::server::BodyTimeout;
use crate::shared::{Campaign, CreateError, Idempotency, STAGED, Shared, now_ms};

/// The most bytes of a `POST /v1/sms` body.
pub const MAX_SMS_BODY: usize = 16 * 1024;

/// How an idempotency key records an answer whose message may or may not have gone out (a
/// 502 `provider_unknown`), before its JSON body; accepted answers are stored as their body.
const UNKNOWN_FATE: &str = "502 ";

/// Marks the refusal of a message that may have gone out, with what its Idempotency-Key
/// records.
#[derive(Clone)]
struct UnknownFate(String);

/// The key of the global budget: the one `GlobalKey` gives the layer's rule, so that the API's
/// messages, the campaigns' and campaign creation all spend one budget.
pub const GLOBAL_KEY: &[u8] = b"global";
/// The most bytes of a `POST /v1/campaigns` body.
pub const MAX_CAMPAIGN_BODY: usize = 4 * 1024 * 1024;
/// The most numbers in one campaign.
pub const MAX_CAMPAIGN_PHONES: usize = 100_000;

/// The four limits, named as clients see them in headers and errors.
#[derive(Clone, Debug)]
pub struct Limits {
    pub client_ip: Policy,
    pub global: Policy,
    /// The campaigns' share of the global budget, four fifths rounded down and at least one
    /// per second (so all of a budget of one per second): while campaigns run, the API keeps
    /// the rest.
    pub campaigns: Policy,
    pub phone: Policy,
    pub phone_daily: Policy,
}

impl Limits {
    pub fn from_config(c: &Config) -> Result<Limits, floodgate::PolicyError> {
        Ok(Limits {
            // A sliding window: never much more than the limit in any minute.
            client_ip: Policy::sliding_window(c.ip_per_minute, Duration::from_secs(60))?
                .named("client-ip")?,
            global: Policy::per_second(c.global_per_second)?.named("global")?,
            campaigns: Policy::per_second((c.global_per_second * 4 / 5).max(1))?
                .named("campaigns")?,
            // The article's funnel: capacity 1 draining in 30 minutes by default.
            phone: Policy::funnel(c.phone_burst, c.phone_interval)?.named("phone")?,
            phone_daily: Policy::calendar_window(c.phone_daily_limit, 1, CalendarUnit::Day)?
                .with_utc_offset(c.utc_offset_secs)?
                .named("phone-daily")?,
        })
    }
}

/// Everything a handler needs.
pub struct App<S: Shared> {
    pub config: Config,
    pub shared: S,
    pub limits: Limits,
    pub provider: Arc<dyn SmsProvider>,
    pub client_ip: ClientIp,
    pub metrics: PrometheusHandle,
    /// Wakes the campaign dispatcher when a campaign is created.
    pub new_campaign: Notify,
    /// Sends and campaign creations that may outlive their request (the client hung up):
    /// shutdown waits for them.
    pub sends: Arc<InFlight>,
}

/// Work that shutdown waits for.
#[derive(Debug, Default)]
pub struct InFlight {
    count: AtomicUsize,
    idle: Notify,
}

impl InFlight {
    /// Counts one more until the guard drops.
    fn enter(self: &Arc<Self>) -> InFlightGuard {
        self.count.fetch_add(1, Ordering::SeqCst);
        InFlightGuard(Arc::clone(self))
    }

    /// Waits until nothing is in flight, for `patience` at most; whether it got there.
    pub async fn idle(&self, patience: Duration) -> bool {
        let deadline = tokio::time::Instant::now() + patience;
        loop {
            let notified = self.idle.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if self.count.load(Ordering::SeqCst) == 0 {
                return true;
            }
            if tokio::time::timeout_at(deadline, notified).await.is_err() {
                return false;
            }
        }
    }
}

struct InFlightGuard(Arc<InFlight>);

impl Drop for InFlightGuard {
    fn drop(&mut self) {
        if self.0.count.fetch_sub(1, Ordering::SeqCst) == 1 {
            self.0.idle.notify_waiters();
        }
    }
}

impl<S: Shared> std::fmt::Debug for App<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("App")
            .field("instance", &self.config.instance_id)
            .field("limits", &self.limits)
            .finish_non_exhaustive()
    }
}

/// The router: the API behind the per-IP and global limits.
pub fn router<S: Shared>(app: Arc<App<S>>) -> Result<Router, floodgate::tower::ConfigError> {
    // Campaigns and opt-outs go through the layer (the per-IP limit on all of them, the global
    // one on creating campaigns). `POST /v1/sms` checks the same per-IP and global limits
    // itself, together with the phone's, all-or-nothing: the phone is in the body.
    let trusted = TrustedProxies::new(app.config.trusted_proxies.iter().copied());
    let layer = RateLimitLayer::builder(app.shared.limiter().clone())
        .rule(Rule::new(app.limits.client_ip.clone()).key(ClientIp::new(trusted)))
        // The global budget is a budget of messages (a campaign's spend it as they are sent):
        // of the other routes, only creating a campaign spends it, not reading one or opting
        // out (cheap requests many clients could use to exhaust it).
        .rule(
            Rule::new(app.limits.global.clone())
                .key(floodgate::tower::key::GlobalKey)
                .path_prefix("/v1/campaigns")
                .methods([http::Method::POST]),
        )
        .on_store_error(OnStoreError::FailClosed)
        // A 503 did nothing (the store failed, or too many campaigns are pending): the units
        // come back, so that clients retrying it do not spend the global budget of messages.
        .refund_when(|status, _| status == http::StatusCode::SERVICE_UNAVAILABLE)
        // Clients see their remaining budget before they are turned away.
        .headers_on_allowed(true)
        // The shared limiter has its deny cache already (`POST /v1/sms` uses it too).
        .deny_cache(false)
        .build()?
        // Answers with axum's own body type: axum does not box the body again.
        .native_body();
    // `/metrics` brings the deny cache's counters up to date before rendering.
    let stats = layer.clone();
    let limited = Router::new()
        .route("/v1/campaigns", post(create_campaign::<S>))
        .route("/v1/campaigns/{id}", get(get_campaign::<S>))
        // An opt-out is one number: the small limit of a message, not a campaign's.
        .route(
            "/v1/opt-outs",
            post(opt_out::<S>).layer(DefaultBodyLimit::max(MAX_SMS_BODY)),
        )
        .layer(DefaultBodyLimit::max(MAX_CAMPAIGN_BODY))
        .layer(layer);
    Ok(Router::new()
        .route(
            "/v1/sms",
            post(send_sms::<S>).layer(DefaultBodyLimit::max(MAX_SMS_BODY)),
        )
        .route("/healthz", get(healthz::<S>))
        .route(
            "/metrics",
            get(move |state| {
                stats.stats();
                metrics::<S>(state)
            }),
        )
        .merge(limited)
        .fallback(|| async {
            ApiError::new(StatusCode::NOT_FOUND, "not_found", "no such endpoint")
        })
        .with_state(app))
}

/// A body read as bytes: oversized bodies are a JSON 413, not a plain-text one.
fn body(body: Result<Bytes, BytesRejection>) -> Result<Bytes, ApiError> {
    body.map_err(|rejection| {
        if let Some(timeout) = BodyTimeout::find(&rejection) {
            return ApiError::new(
                StatusCode::REQUEST_TIMEOUT,
                "request_timeout",
                timeout.to_string(),
            );
        }
        let status = rejection.status();
        let code = if status == StatusCode::PAYLOAD_TOO_LARGE {
            "body_too_large"
        } else {
            "bad_body"
        };
        ApiError::new(status, code, rejection.body_text())
    })
}

/// A JSON object, or a 400 saying where it broke.
fn json_object(bytes: &[u8]) -> Result<serde_json::Map<String, Value>, ApiError> {
    match serde_json::from_slice::<Value>(bytes) {
        Ok(Value::Object(map)) => Ok(map),
        Ok(_) => Err(ApiError::new(
            StatusCode::BAD_REQUEST,
            "invalid_json",
            "the body must be a JSON object",
        )),
        Err(e) => Err(ApiError::new(
            StatusCode::BAD_REQUEST,
            "invalid_json",
            format!("the body is not valid JSON: {e}"),
        )),
    }
}

fn string_field<'a>(
    map: &'a serde_json::Map<String, Value>,
    field: &str,
) -> Result<&'a str, ApiError> {
    match map.get(field) {
        Some(Value::String(s)) => Ok(s),
        Some(_) => Err(ApiError::invalid(field, "must be a string")),
        None => Err(ApiError::invalid(field, "is required")),
    }
}

/// The client's address: the peer, or the rightmost untrusted hop of the forwarding headers;
/// IPv6 grouped by /64 so one host cannot rotate through its addresses. Written as the layer
/// writes it, so that a client has one per-IP key on every route.
fn client_key(app_ip: &ClientIp, peer: SocketAddr, headers: &HeaderMap) -> Key {
    Key::from_ip(app_ip.resolve(peer.ip(), headers), 64)
}

fn idempotency_key(headers: &HeaderMap) -> Result<Option<String>, ApiError> {
    let Some(value) = headers.get("idempotency-key") else {
        return Ok(None);
    };
    let ok = !value.is_empty()
        && value.len() <= 128
        && value.as_bytes().iter().all(|b| (0x21..=0x7e).contains(b));
    match value.to_str() {
        Ok(s) if ok => Ok(Some(s.to_owned())),
        _ => Err(ApiError::invalid(
            "Idempotency-Key",
            "must be 1 to 128 visible ASCII characters",
        )),
    }
}

/// A 429 naming the limit that was hit and when to retry, with the standard headers.
fn limited(policies: &[&Policy], verdict: &Verdict) -> Response {
    let (index, decision) = verdict
        .strictest()
        .map(|(i, d)| (i, *d))
        .unwrap_or((0, verdict.decisions[0]));
    let name = policies.get(index).map_or("unknown", |p| p.name());
    metrics::counter!("sms_rejected_total", "limit" => name.to_owned()).increment(1);
    let retry_ms = decision.retry_after_ms();
    let message = match retry_ms {
        Some(ms) => format!(
            "the {name} limit was reached; retry in {:.0}s",
            (ms as f64 / 1000.0).ceil()
        ),
        None => format!("the request exceeds the {name} limit and can never be admitted"),
    };
    let body = json!({
        "error": {
            "code": "rate_limited",
            "limit": name,
            "message": message,
            "retry_after_ms": retry_ms,
        },
        "limits": policies.iter().zip(&verdict.decisions).map(|(p, d)| json!({
            "name": p.name(),
            "allowed": d.allowed,
            "limit": d.limit,
            "remaining": d.remaining,
            "retry_after_ms": d.retry_after_ms(),
            "reset_after_ms": d.reset_after_ms(),
        })).collect::<Vec<_>>(),
    });
    let mut response = (StatusCode::TOO_MANY_REQUESTS, Json(body)).into_response();
    floodgate::tower::headers::insert_headers(response.headers_mut(), policies, verdict, false);
    response
}

/// Checks `checks` against the shared limiter, timing the round trip.
async fn check<S: Shared>(app: &App<S>, checks: &[Check<'_>]) -> Result<Verdict, ApiError> {
    let started = Instant::now();
    let result = app
        .shared
        .limiter()
        .check(checks, CheckOptions::default())
        .await;
    metrics::histogram!("sms_limiter_seconds").record(started.elapsed().as_secs_f64());
    // The gateway fails closed: no SMS goes out while its limits cannot be checked.
    result.map_err(|e| ApiError::unavailable("the rate limiter", e))
}

/// Counts and logs a provider's error: every message held back during a pause at debug level
/// only (a busy provider would otherwise log each of them).
pub(crate) fn note_provider_error(e: &crate::provider::ProviderError) {
    let what = if e.pause().is_some() {
        "provider_busy"
    } else {
        "provider"
    };
    metrics::counter!("sms_errors_total", "what" => what).increment(1);
    if e.reached_provider() {
        tracing::warn!(error = %e, "the SMS provider failed");
    } else {
        tracing::debug!(error = %e, "a message waits for the SMS provider's pause");
    }
}

/// Gives back what `verdict` took, for a message that did not go out; whether it could. A
/// failure is logged and counted: the units come back on their own when the limits' windows
/// pass.
pub(crate) async fn refund<S: Shared>(
    app: &App<S>,
    checks: &[Check<'_>],
    verdict: &Verdict,
) -> bool {
    match app.shared.limiter().refund(checks, verdict).await {
        Ok(()) => true,
        Err(e) => {
            metrics::counter!("sms_errors_total", "what" => "refund").increment(1);
            tracing::warn!(error = %e, "could not give back the limits of a message that failed");
            false
        }
    }
}

/// [`refund`] of every check but `kept` (see [`accept_sms`] and the dispatcher): everything is
/// given back, then `kept` are spent again. Giving back all but those would leave a deny
/// cache holding the denial it recorded for the whole check (the phone's last unit spent): the
/// client's retry would be told to wait the phone's 30 minutes.
pub(crate) async fn refund_all_but<S: Shared>(
    app: &App<S>,
    checks: &[Check<'_>],
    verdict: &Verdict,
    kept: &[Check<'_>],
) {
    // Not given back, nothing is spent again (it would count twice).
    if !refund(app, checks, verdict).await {
        return;
    }
    // Each on its own: one denied (another request took its last unit meanwhile) does not
    // keep the others from being spent.
    for kept in kept {
        if let Err(e) = check(app, std::slice::from_ref(kept)).await {
            tracing::warn!(error = %e.body(), "could not spend again a unit of a message not sent");
        }
    }
}

async fn send_sms<S: Shared>(
    State(app): State<Arc<App<S>>>,
    ConnectInfo(peer): ConnectInfo<SocketAddr>,
    headers: HeaderMap,
    raw: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let bytes = body(raw)?;
    let map = json_object(&bytes)?;
    let phone = Phone::parse(string_field(&map, "phone")?, "phone")?;
    let text = string_field(&map, "text")?;
    validate_text(text, "text")?;
    let idem = idempotency_key(&headers)?;
    let request = format!("{}\n{text}", phone.as_str());

    if let Some(key) = &idem {
        match app
            .shared
            .idempotency_begin(key, &request)
            .await
            .map_err(|e| ApiError::unavailable("the idempotency store", e))?
        {
            Idempotency::New => {}
            Idempotency::Replay(response) => {
                // An answer whose fate was unknown replays as such: the message may have gone
                // out, and a retry must not send it again.
                let mut r = match response.strip_prefix(UNKNOWN_FATE) {
                    Some(body) => (StatusCode::BAD_GATEWAY, body.to_owned()).into_response(),
                    None => (StatusCode::ACCEPTED, response).into_response(),
                };
                r.headers_mut().insert(
                    http::header::CONTENT_TYPE,
                    http::HeaderValue::from_static("application/json"),
                );
                r.headers_mut().insert(
                    "idempotent-replayed",
                    http::HeaderValue::from_static("true"),
                );
                return Ok(r);
            }
            Idempotency::InProgress => {
                return Err(ApiError::new(
                    StatusCode::CONFLICT,
                    "in_progress",
                    "a request with this Idempotency-Key is being handled",
                ));
            }
            Idempotency::Mismatch => {
                return Err(ApiError::invalid(
                    "Idempotency-Key",
                    "was already used with a different request",
                ));
            }
        }
    }
    // Accepting (and recording the key's answer) runs in a task of its own, which shutdown
    // waits for: a client that hangs up mid-send (hyper then drops this handler) must not
    // leave units spent for nothing, a message sent but not recorded, or a key "in progress".
    let (text, keyed) = (text.to_owned(), idem.is_some());
    let in_flight = app.sends.enter();
    let task = tokio::spawn(async move {
        let _in_flight = in_flight;
        let answer = accept_sms(&app, peer, &headers, &phone, &text).await;
        let Some(key) = idem else {
            return answer;
        };
        // What a retry with this key gets: an accepted answer, or one whose message was
        // perhaps sent; `None`: not accepted, the same key may be retried.
        let stored = match &answer {
            Ok((_, body)) => Some(body.clone()),
            Err(refused) => refused
                .extensions()
                .get::<UnknownFate>()
                .map(|u| u.0.clone()),
        };
        let recorded = match stored {
            Some(stored) => app.shared.idempotency_finish(&key, &request, &stored).await,
            None => app.shared.idempotency_abort(&key).await,
        };
        if let Err(e) = recorded {
            tracing::warn!(error = %e, "could not record an idempotency key");
        }
        answer
    });
    let answer = task.await.map_err(|e| {
        tracing::error!(error = %e, "the task sending an SMS failed");
        ApiError::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "internal",
            if keyed {
                "the message may or may not have been sent; retry with the same Idempotency-Key"
            } else {
                "the message may or may not have been sent"
            },
        )
    })?;
    Ok(match answer {
        Ok((response, _)) => response,
        Err(refused) => refused,
    })
}

/// Everything after validation: limits, opt-out, send. `Ok` is an accepted message (with the
/// body an idempotent retry gets again); `Err` any refusal, as its response.
///
/// The limits come first: a client over them costs the opt-out list nothing (with Redis, its
/// repeats are answered by the deny cache), and cannot learn at any rate which numbers opted
/// out. A message that is then not sent (the number opted out, the provider refused it) gives
/// back its units but the client's: every request that reaches the provider or the opt-out
/// list spends one of the client's.
async fn accept_sms<S: Shared>(
    app: &App<S>,
    peer: SocketAddr,
    headers: &HeaderMap,
    phone: &Phone,
    text: &str,
) -> Result<(Response, String), Response> {
    let ip = client_key(&app.client_ip, peer, headers);
    let l = &app.limits;
    let policies = [&l.client_ip, &l.global, &l.phone, &l.phone_daily];
    let checks = [
        Check::new(ip.as_bytes(), &l.client_ip),
        Check::new(GLOBAL_KEY, &l.global),
        Check::new(phone.as_str().as_bytes(), &l.phone),
        Check::new(phone.as_str().as_bytes(), &l.phone_daily),
    ];
    let verdict = check(app, &checks)
        .await
        .map_err(IntoResponse::into_response)?;
    if !verdict.allowed() {
        return Err(limited(&policies, &verdict));
    }
    let opted_out = match app.shared.is_opted_out(phone.as_str()).await {
        Ok(opted_out) => opted_out,
        Err(e) => {
            // Not the client's doing: nothing counts (as for the layer's 503s).
            refund(app, &checks, &verdict).await;
            return Err(ApiError::unavailable("the opt-out list", e).into_response());
        }
    };
    if opted_out {
        metrics::counter!("sms_rejected_total", "limit" => "opted-out").increment(1);
        refund_all_but(app, &checks, &verdict, checks.get(..1).unwrap_or_default()).await;
        return Err(ApiError::new(
            StatusCode::FORBIDDEN,
            "opted_out",
            "this phone number opted out of messages",
        )
        .into_response());
    }
    let sms = OutboundSms {
        id: message_id(),
        phone: phone.as_str().to_owned(),
        text: text.to_owned(),
        campaign: None,
        instance: app.config.instance_id.clone(),
        sent_at_ms: now_ms(),
    };
    if let Err(e) = app.provider.send(&sms).await {
        note_provider_error(&e);
        if !e.not_sent() {
            // It may have gone out: it counts, or a retry could message the phone twice; and a
            // retry with the same Idempotency-Key gets this answer again.
            let error = ApiError::new(
                StatusCode::BAD_GATEWAY,
                "provider_unknown",
                "the SMS provider did not confirm the message; it may have been sent",
            );
            let stored = format!("{UNKNOWN_FATE}{}", error.body());
            let mut response = error.into_response();
            response.extensions_mut().insert(UnknownFate(stored));
            return Err(response);
        }
        if let Some(pause) = e.pause() {
            // The provider is busy: the message did not go out, and does not count against
            // the phone's limits; the client's unit stays spent, and the global one too when
            // the provider was asked (its capacity is what ran out: given back, it would go to
            // the next message, which the provider would turn away too).
            let kept = if e.reached_provider() { 2 } else { 1 };
            refund_all_but(
                app,
                &checks,
                &verdict,
                checks.get(..kept).unwrap_or_default(),
            )
            .await;
            let secs = pause.as_secs_f64().ceil() as u64;
            return Err(ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "provider_busy",
                format!("the SMS provider is busy; try again in {secs} s"),
            )
            .retry_after(secs)
            .into_response());
        }
        // The message did not go out: it does not count against the phone's or the global
        // limit, so the client can try again at once (its own unit is spent: a number the
        // provider refuses cannot be sent to it at any rate).
        refund_all_but(app, &checks, &verdict, checks.get(..1).unwrap_or_default()).await;
        return Err(ApiError::new(
            StatusCode::BAD_GATEWAY,
            "provider_error",
            "the SMS provider did not take the message; try again",
        )
        .into_response());
    }
    metrics::counter!("sms_sent_total", "source" => "api").increment(1);
    let body = json!({"id": sms.id, "status": "accepted"}).to_string();
    let mut response = (StatusCode::ACCEPTED, body.clone()).into_response();
    response.headers_mut().insert(
        http::header::CONTENT_TYPE,
        http::HeaderValue::from_static("application/json"),
    );
    floodgate::tower::headers::insert_headers(response.headers_mut(), &policies, &verdict, false);
    Ok((response, body))
}

pub fn message_id() -> String {
    format!("{:016x}{:016x}", fastrand::u64(..), fastrand::u64(..))
}

async fn opt_out<S: Shared>(
    State(app): State<Arc<App<S>>>,
    raw: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let bytes = body(raw)?;
    let map = json_object(&bytes)?;
    let phone = Phone::parse(string_field(&map, "phone")?, "phone")?;
    let new = app
        .shared
        .opt_out(phone.as_str())
        .await
        .map_err(|e| ApiError::unavailable("the opt-out list", e))?;
    let status = if new {
        StatusCode::CREATED
    } else {
        StatusCode::OK
    };
    Ok((
        status,
        Json(json!({"phone": phone.as_str(), "opted_out": true})),
    )
        .into_response())
}

/// A campaign refused because too many are pending (`code` says whose, `status` how it is
/// answered): counted, with a `Retry-After` of a minute (when one completes is not known: a
/// minute is a guess a client can keep to).
fn campaigns_refused(status: StatusCode, code: &'static str, why: String) -> ApiError {
    metrics::counter!("sms_campaigns_refused_total", "reason" => code).increment(1);
    ApiError::new(status, code, format!("{why}; try again when one completes")).retry_after(60)
}

async fn create_campaign<S: Shared>(
    State(app): State<Arc<App<S>>>,
    ConnectInfo(peer): ConnectInfo<SocketAddr>,
    headers: HeaderMap,
    raw: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    // Campaigns wait for the dispatcher with their numbers stored: their count is bounded, or
    // clients could fill the store (a hundred thousand numbers a campaign). Checked first (a
    // refused campaign costs no parsing; the layer gives back the units it took for a 503),
    // across replicas: creations racing past it (from the count to their creation's
    // end) overshoot by their number at most.
    let pending = app
        .shared
        .campaigns_pending_count()
        .await
        .map_err(|e| ApiError::unavailable("the campaign store", e))?;
    let most = app.config.max_pending_campaigns;
    if pending >= most {
        // Everyone's: a 503, whose units the layer gives back.
        return Err(campaigns_refused(
            StatusCode::SERVICE_UNAVAILABLE,
            "too_many_campaigns",
            format!("{pending} campaigns are pending, the most this gateway holds is {most}"),
        ));
    }
    // And a client's own, likewise: one client cannot take every pending place.
    let client = client_key(&app.client_ip, peer, &headers);
    let client = String::from_utf8_lossy(client.as_bytes()).into_owned();
    let most = app.config.max_pending_campaigns_per_client;
    let theirs = app
        .shared
        .campaigns_pending_of(&client, most)
        .await
        .map_err(|e| ApiError::unavailable("the campaign store", e))?;
    if theirs >= most {
        // The client's own: a 429, whose units stay spent, so that its retries count against
        // its per-address limit (each one reads its campaigns' statuses).
        return Err(campaigns_refused(
            StatusCode::TOO_MANY_REQUESTS,
            "too_many_client_campaigns",
            format!("{theirs} of your campaigns are pending, the most a client may have is {most}"),
        ));
    }
    let bytes = body(raw)?;
    let map = json_object(&bytes)?;
    let text = string_field(&map, "text")?;
    validate_text(text, "text")?;
    let list = match map.get("phones") {
        Some(Value::Array(list)) => list,
        Some(_) => return Err(ApiError::invalid("phones", "must be an array of strings")),
        None => return Err(ApiError::invalid("phones", "is required")),
    };
    if list.is_empty() {
        return Err(ApiError::invalid("phones", "must not be empty"));
    }
    if list.len() > MAX_CAMPAIGN_PHONES {
        return Err(ApiError::invalid(
            "phones",
            format!(
                "has {} numbers; the most is {MAX_CAMPAIGN_PHONES}",
                list.len()
            ),
        ));
    }
    let mut seen = std::collections::HashSet::with_capacity(list.len());
    let mut phones = Vec::with_capacity(list.len());
    for (i, v) in list.iter().enumerate() {
        let field = format!("phones[{i}]");
        let Value::String(raw) = v else {
            return Err(ApiError::invalid(&field, "must be a string"));
        };
        let phone = Phone::parse(raw, &field)?;
        // Each number gets at most one message: duplicates are dropped here.
        if seen.insert(phone.as_str().to_owned()) {
            phones.push(phone.as_str().to_owned());
        }
    }
    let campaign = Campaign {
        id: message_id(),
        status: "pending".into(),
        total: phones.len() as u64,
        created_ms: now_ms(),
        text: text.to_owned(),
        client,
        ..Campaign::default()
    };
    // Written in a task of its own, which shutdown waits for: a client that hangs up (hyper
    // then drops this handler) does not cut a creation off half-way.
    let duplicates = list.len() - phones.len();
    let in_flight = app.sends.enter();
    let creating = {
        let (app, campaign) = (Arc::clone(&app), campaign.clone());
        tokio::spawn(async move {
            let _in_flight = in_flight;
            let created = app.shared.campaign_create(&campaign, &phones).await;
            if created.is_ok() {
                app.new_campaign.notify_one();
            }
            created
        })
    };
    let unknown = |id: &str| {
        ApiError::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "campaign_unknown",
            format!(
                "the campaign store did not confirm campaign {id}, which may have been \
                 created: GET /v1/campaigns/{id} says whether it was"
            ),
        )
    };
    match creating.await {
        Ok(Ok(())) => {}
        Ok(Err(CreateError::NotCreated(e))) => {
            return Err(ApiError::unavailable("the campaign store", e));
        }
        Ok(Err(CreateError::Unknown(e))) => {
            tracing::warn!(campaign = %campaign.id, error = %e, "a campaign's creation was not confirmed");
            metrics::counter!("sms_errors_total", "what" => "campaign_unknown").increment(1);
            return Err(unknown(&campaign.id));
        }
        Err(e) => {
            tracing::error!(error = %e, "the task creating a campaign failed");
            return Err(unknown(&campaign.id));
        }
    }
    Ok((
        StatusCode::ACCEPTED,
        Json(json!({
            "id": campaign.id,
            "status": "pending",
            "total": campaign.total,
            "duplicates_dropped": duplicates,
        })),
    )
        .into_response())
}

async fn get_campaign<S: Shared>(
    State(app): State<Arc<App<S>>>,
    Path(id): Path<String>,
) -> Result<Response, ApiError> {
    if id.is_empty() || id.len() > 64 || !id.bytes().all(|b| b.is_ascii_alphanumeric()) {
        return Err(ApiError::invalid("id", "is not a campaign id"));
    }
    match app
        .shared
        .campaign_get(&id)
        .await
        .map_err(|e| ApiError::unavailable("the campaign store", e))?
    {
        // A campaign whose creation has not completed is not one yet.
        Some(c) if c.status != STAGED => Ok(Json(c).into_response()),
        _ => Err(ApiError::new(
            StatusCode::NOT_FOUND,
            "not_found",
            format!("no campaign {id}"),
        )),
    }
}

async fn healthz<S: Shared>(State(app): State<Arc<App<S>>>) -> Response {
    match app.shared.healthy().await {
        Ok(store) => Json(json!({
            "status": "ok",
            "store": store,
            "instance": app.config.instance_id,
        }))
        .into_response(),
        Err(e) => (
            StatusCode::SERVICE_UNAVAILABLE,
            Json(json!({"status": "unavailable", "error": e.to_string(), "instance": app.config.instance_id})),
        )
            .into_response(),
    }
}

async fn metrics<S: Shared>(State(app): State<Arc<App<S>>>) -> Response {
    (
        [(http::header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        app.metrics.render(),
    )
        .into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn shutdown_waits_for_sends_in_flight() {
        let sends = Arc::new(InFlight::default());
        assert!(sends.idle(Duration::from_millis(10)).await);
        let guard = sends.enter();
        assert!(!sends.idle(Duration::from_millis(50)).await);
        let waiter = {
            let sends = Arc::clone(&sends);
            tokio::spawn(async move { sends.idle(Duration::from_secs(5)).await })
        };
        tokio::time::sleep(Duration::from_millis(20)).await;
        drop(guard);
        assert!(
            waiter.await.expect("task"),
            "woken when the last send ended"
        );
    }

    #[test]
    fn ipv6_clients_have_one_key_on_every_route() {
        let ip = ClientIp::new(TrustedProxies::new(std::iter::empty()));
        let peer: SocketAddr = "[2001:db8::1]:443".parse().expect("addr");
        let key = client_key(&ip, peer, &HeaderMap::new());
        assert_eq!(key.as_bytes(), b"2001:db8::/64");
    }
}
