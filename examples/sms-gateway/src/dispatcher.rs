//! The campaign dispatcher: every replica runs one; a floodgate lock per campaign makes sure
//! only one replica sends a campaign at a time, and another resumes it when the lease of a
//! dispatcher that died runs out.
//!
//! A dispatcher can outlive its lease without knowing it (a long pause, a partition from
//! Redis): its watchdog cannot tell it in time. So every claim, progress, give-back and
//! completion it writes carries the lock's fencing token, and the campaign refuses them once a
//! newer dispatcher (a larger token) has written: the old one stops at its next write.

use std::sync::Arc;
use std::time::Duration;

use floodgate::LockStore;
use floodgate::lock::{Lock, LockGuard};
use floodgate::{Check, CheckOptions, Limiter};
use tokio::sync::watch;

use crate::app::{App, GLOBAL_KEY, message_id};
use crate::provider::OutboundSms;
use crate::shared::{Campaign, Claim, Completion, Outcome, Progress, STAGED, Shared, now_ms};

/// How often a replica looks for campaigns that need a dispatcher.
const POLL: Duration = Duration::from_millis(500);
/// Numbers read from the store at a time.
const CHUNK: u64 = 200;

/// Runs until `shutdown` turns true.
pub async fn run<S: Shared>(app: Arc<App<S>>, mut shutdown: watch::Receiver<bool>)
where
    floodgate::lock::Error: From<<S::Locks as LockStore>::Error>,
{
    loop {
        tokio::select! {
            _ = app.new_campaign.notified() => {}
            _ = tokio::time::sleep(POLL) => {}
            _ = shutdown.changed() => {}
        }
        if *shutdown.borrow() {
            return;
        }
        let ids = match app.shared.campaigns_pending().await {
            Ok(ids) => ids,
            Err(e) => {
                tracing::warn!(error = %e, "cannot list pending campaigns");
                continue;
            }
        };
        for id in ids {
            if *shutdown.borrow() {
                return;
            }
            let lock = match Lock::new(
                app.shared.locks().clone(),
                format!("campaign:{id}"),
                app.config.campaign_lease,
            ) {
                Ok(lock) => lock.watchdog(true),
                Err(e) => {
                    tracing::warn!(error = %e, "bad campaign lock");
                    continue;
                }
            };
            match lock.try_acquire().await {
                Ok(Some(guard)) => {
                    tracing::info!(campaign = %id, fence = guard.fence(), "dispatching campaign");
                    dispatch(&app, &id, &guard, &shutdown).await;
                    if let Err(e) = guard.release().await {
                        tracing::warn!(campaign = %id, error = %e, "campaign lease lost");
                    }
                }
                // Another replica is dispatching it.
                Ok(None) => {}
                Err(e) => tracing::warn!(campaign = %id, error = %e, "cannot take a campaign lock"),
            }
        }
    }
}

/// Sends what is left of campaign `id` while this replica holds its lock.
async fn dispatch<S: Shared>(
    app: &App<S>,
    id: &str,
    guard: &LockGuard<S::Locks>,
    shutdown: &watch::Receiver<bool>,
) where
    floodgate::lock::Error: From<<S::Locks as LockStore>::Error>,
{
    let fence = guard.fence();
    let campaign = match app.shared.campaign_get(id).await {
        // Its creation has not completed (and may never): not a campaign yet. Left for the
        // next pass; gone once its staging expiry passes, and then dropped below.
        Ok(Some(c)) if c.status == STAGED => return,
        Ok(Some(c)) if c.status != "completed" => c,
        Ok(_) => {
            // Completed or gone, yet listed as pending (the completion's last step failed):
            // completing it again takes it off the list and changes nothing else.
            if let Err(e) = app
                .shared
                .campaign_complete(id, app.config.campaign_retention, fence)
                .await
            {
                tracing::warn!(campaign = %id, error = %e, "cannot complete campaign");
            }
            return;
        }
        Err(e) => {
            tracing::warn!(campaign = %id, error = %e, "cannot load campaign");
            return;
        }
    };
    let instance = &app.config.instance_id;
    let superseded = || {
        tracing::warn!(
            campaign = %id,
            fence,
            "a newer dispatcher took over the campaign: this one stops"
        );
    };
    // The lease is in doubt (another replica may take over) or the replica stops.
    let stopping = || guard.is_lost() || *shutdown.borrow();
    let mut cursor = campaign.cursor;
    while cursor < campaign.total {
        let phones = match app.shared.campaign_phones(id, cursor, CHUNK).await {
            Ok(p) if !p.is_empty() => p,
            Ok(_) => break,
            Err(e) => {
                tracing::warn!(campaign = %id, error = %e, "cannot read campaign numbers");
                return;
            }
        };
        for phone in &phones {
            // Stop as soon as the lease is in doubt: another replica may take over, and the
            // per-number claim below keeps any overlap from sending a number twice.
            if stopping() {
                return;
            }
            match app.shared.campaign_claim(id, phone, instance, fence).await {
                Ok(Claim::Claimed) => {}
                Ok(Claim::Taken) => continue,
                Ok(Claim::Superseded) => return superseded(),
                Err(e) => {
                    tracing::warn!(campaign = %id, error = %e, "cannot claim a number");
                    return;
                }
            }
            // `None`: the number is not decided, and this dispatcher stops.
            let mut busy_for = Duration::ZERO;
            let decided = loop {
                let retry = match send_one(app, &campaign, phone).await {
                    Step::Done(outcome) => break Some(outcome),
                    Step::Wait(retry) => retry,
                    // A provider busy for long: the number goes back (as when the store
                    // fails), and the campaign's lock with it, for the next pass.
                    Step::Busy(_) if busy_for >= MAX_BUSY_WAIT => break None,
                    Step::Busy(retry) => {
                        busy_for += retry;
                        retry
                    }
                    Step::Unsure => break None,
                };
                // The global budget is spent, or the provider is busy: this number waits, as
                // long as the lease holds and the replica runs.
                if stopping() {
                    break None;
                }
                let mut stop = shutdown.clone();
                tokio::select! {
                    _ = tokio::time::sleep(retry) => {}
                    _ = stop.changed() => {}
                    _ = guard.lost() => {}
                }
                if stopping() {
                    break None;
                }
            };
            let Some(outcome) = decided else {
                // The store failed before the send, or the replica stops: the number goes back
                // for whoever dispatches the campaign next (from this chunk, which the saved
                // cursor has not passed), instead of being recorded as failed. Not once the
                // lease is lost: the next dispatcher may already have passed it, and a claim
                // left in place is reported as `unknown`, never dropped.
                if !guard.is_lost()
                    && let Err(e) = app
                        .shared
                        .campaign_unclaim(id, phone, instance, fence)
                        .await
                {
                    tracing::warn!(campaign = %id, error = %e, "cannot give a number back");
                }
                return;
            };
            if let Err(e) = app.shared.campaign_record(id, phone, outcome).await {
                tracing::warn!(campaign = %id, error = %e, "cannot record an outcome");
                return;
            }
        }
        cursor += phones.len() as u64;
        if guard.is_lost() {
            return;
        }
        match app
            .shared
            .campaign_progress(id, cursor, instance, fence)
            .await
        {
            // Behind: a dispatcher still admitted then (an older one, before this one's first
            // write) moved it as far; what is left shows in the next read of its numbers.
            Ok(Progress::Moved | Progress::Behind) => {}
            Ok(Progress::Superseded) => return superseded(),
            Err(e) => {
                tracing::warn!(campaign = %id, error = %e, "cannot record progress");
                return;
            }
        }
    }
    // Completing is for the holder: another replica may have taken over and still be sending.
    if guard.is_lost() {
        return;
    }
    match app
        .shared
        .campaign_complete(id, app.config.campaign_retention, fence)
        .await
    {
        Ok(Completion::Completed) => tracing::info!(campaign = %id, "campaign completed"),
        Ok(Completion::AlreadyDone) => {}
        Ok(Completion::Superseded) => superseded(),
        Err(e) => tracing::warn!(campaign = %id, error = %e, "cannot complete campaign"),
    }
}

/// The longest a number waits for a busy provider before it goes back, with the campaign's
/// lock, for the next pass.
const MAX_BUSY_WAIT: Duration = Duration::from_secs(600);

/// What became of one number, or why it is not decided yet.
enum Step {
    Done(Outcome),
    /// The global budget is spent: try again after this.
    Wait(Duration),
    /// The provider is busy: try again after this (for [`MAX_BUSY_WAIT`] in all at most).
    Busy(Duration),
    /// The store failed before the send: whether the number opted out, or its limits, are not
    /// known.
    Unsure,
}

/// One number: refused if opted out, limited by the per-phone limits (reported, not retried),
/// held back while the global budget, or the campaigns' share of it, is spent (campaign
/// messages count against it as the API's do), otherwise sent.
async fn send_one<S: Shared>(app: &App<S>, campaign: &Campaign, phone: &str) -> Step {
    match app.shared.is_opted_out(phone).await {
        Ok(true) => return Step::Done(Outcome::OptedOut),
        Ok(false) => {}
        // Unsure: never message a number that might have opted out.
        Err(_) => return Step::Unsure,
    }
    let l = &app.limits;
    let checks = [
        Check::new(phone.as_bytes(), &l.phone),
        Check::new(phone.as_bytes(), &l.phone_daily),
        Check::new(GLOBAL_KEY, &l.global),
        Check::new(GLOBAL_KEY, &l.campaigns),
    ];
    let verdict = match app
        .shared
        .limiter()
        .check(&checks, CheckOptions::default())
        .await
    {
        Ok(v) if v.allowed() => v,
        Ok(v) => {
            let [phone, daily, global, share] = &v.decisions[..] else {
                return Step::Unsure;
            };
            if phone.allowed && daily.allowed {
                // Only the budget denied (a retry time always comes with a cost of one).
                let retry = global.retry_after.max(share.retry_after);
                return Step::Wait(retry.unwrap_or(Duration::from_millis(10)));
            }
            metrics::counter!("sms_rejected_total", "limit" => "campaign-phone").increment(1);
            return Step::Done(Outcome::Limited);
        }
        // The store is down or hung, or (in memory) full: the number waits for it.
        Err(e) if <S::Limiter as Limiter>::is_unavailable(&e) || is_full(&e) => {
            return Step::Unsure;
        }
        // One key's problem (a corrupted state): it would fail the same way on every pass,
        // and hold back every number after it.
        Err(e) => {
            tracing::warn!(campaign = %campaign.id, error = %e, "cannot check a number's limits");
            return Step::Done(Outcome::Failed);
        }
    };
    let sms = OutboundSms {
        id: message_id(),
        phone: phone.to_owned(),
        text: campaign.text.clone(),
        campaign: Some(campaign.id.clone()),
        instance: app.config.instance_id.clone(),
        sent_at_ms: now_ms(),
    };
    match app.provider.send(&sms).await {
        Ok(()) => {
            metrics::counter!("sms_sent_total", "source" => "campaign").increment(1);
            Step::Done(Outcome::Sent)
        }
        Err(e) => {
            crate::app::note_provider_error(&e);
            if let Some(pause) = e.pause() {
                // The provider is busy: the number is not sent, and waits. Its limits do not
                // count it; the global budget and the campaigns' share stay spent when the
                // provider was asked (its capacity is what ran out).
                let kept: &[Check<'_>] = if e.reached_provider() {
                    &checks[2..]
                } else {
                    &[]
                };
                crate::app::refund_all_but(app, &checks, &verdict, kept).await;
                return Step::Busy(pause);
            }
            // Certainly not sent: the phone's limits do not count it.
            if e.not_sent() {
                crate::app::refund(app, &checks, &verdict).await;
            }
            Step::Done(Outcome::Failed)
        }
    }
}

/// Whether `e` is the in-memory store refusing a new key because it is full: it makes room as
/// states expire, so the number waits rather than failing for good.
fn is_full(e: &(dyn std::any::Any + 'static)) -> bool {
    e.downcast_ref::<floodgate::MemoryError>()
        .is_some_and(|e| matches!(e, floodgate::MemoryError::Full { .. }))
}
