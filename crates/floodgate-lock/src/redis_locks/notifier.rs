//! Release notifications: one subscriber connection per [`RedisLocks`](super::RedisLocks),
//! dispatching each channel's messages to the waiters of that lock.
//!
//! A channel is subscribed while some waiter wants it and a little longer (so that a waiter
//! that loops does not make it flap), then unsubscribed. A waiter registered before its
//! channel's subscription is confirmed is woken by the confirmation (a release in between
//! would otherwise go unseen); every waiter is woken when the connection drops (messages may
//! have been lost) and the subscriptions are restored on a new connection, rotating through
//! the configured URLs. Waiters never rely on this alone: they also retry when the holder's
//! lease ends.

use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use floodgate_core::lock::Released;
use futures_util::StreamExt;
use futures_util::stream::FuturesUnordered;
use redis::aio::PubSubSink;
use tokio::sync::{Notify, mpsc};
use tokio::time::Instant;

/// How long a channel stays subscribed after its last waiter left.
const LINGER: Duration = Duration::from_secs(1);
/// How often idle channels are swept and the connection is pinged.
const TICK: Duration = Duration::from_secs(1);
/// Bound on connecting and on each SUBSCRIBE / UNSUBSCRIBE / PING.
const OP_TIMEOUT: Duration = Duration::from_secs(2);
/// Reconnection backoff.
const RECONNECT_MIN: Duration = Duration::from_millis(50);
const RECONNECT_MAX: Duration = Duration::from_secs(2);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Status {
    /// Needs a SUBSCRIBE.
    Wanted,
    /// SUBSCRIBE sent, not confirmed.
    Subscribing,
    Subscribed,
    /// UNSUBSCRIBE sent, not confirmed.
    Unsubscribing,
}

struct Channel {
    notify: Arc<Notify>,
    waiters: usize,
    status: Status,
    idle_since: Instant,
}

struct Shared {
    clients: Vec<redis::Client>,
    channels: Mutex<HashMap<Vec<u8>, Channel>>,
}

impl Shared {
    fn channels(&self) -> MutexGuard<'_, HashMap<Vec<u8>, Channel>> {
        self.channels.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// The subscriber of one lock client. Its task starts with the first waiter (it needs a tokio
/// runtime) and stops when the notifier is dropped.
pub(crate) struct Notifier {
    shared: Arc<Shared>,
    /// Wakes the task (a channel is wanted); closing it stops the task.
    kick: Mutex<Option<mpsc::UnboundedSender<()>>>,
}

impl Notifier {
    pub(crate) fn new(clients: Vec<redis::Client>) -> Self {
        Self {
            shared: Arc::new(Shared {
                clients,
                channels: Mutex::new(HashMap::new()),
            }),
            kick: Mutex::new(None),
        }
    }

    /// A future that resolves on the next message on `channel` (or spuriously: on the
    /// subscription's confirmation, on a reconnection). Registered when this returns.
    pub(crate) fn released(&self, channel: Vec<u8>) -> Released {
        let (notified, wanted) = {
            let mut channels = self.shared.channels();
            let entry = channels.entry(channel.clone()).or_insert_with(|| Channel {
                notify: Arc::new(Notify::new()),
                waiters: 0,
                status: Status::Wanted,
                idle_since: Instant::now(),
            });
            entry.waiters += 1;
            (
                Arc::clone(&entry.notify).notified_owned(),
                entry.status == Status::Wanted,
            )
        };
        let waiter = Waiter {
            shared: Arc::clone(&self.shared),
            channel,
        };
        if wanted {
            self.kick();
        }
        Box::pin(async move {
            let _waiter = waiter;
            notified.await;
        })
    }

    /// Wakes the task, starting it if it is not running (first use, or its runtime is gone).
    fn kick(&self) {
        let mut kick = self.kick.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(tx) = kick.as_ref()
            && tx.send(()).is_ok()
        {
            return;
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let (tx, rx) = mpsc::unbounded_channel();
        let _ = tx.send(());
        runtime.spawn(run(Arc::clone(&self.shared), rx));
        *kick = Some(tx);
    }
}

impl std::fmt::Debug for Notifier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Notifier")
            .field("urls", &self.shared.clients.len())
            .field("channels", &self.shared.channels().len())
            .finish()
    }
}

/// One registered waiter; leaving decrements its channel's count.
struct Waiter {
    shared: Arc<Shared>,
    channel: Vec<u8>,
}

impl Drop for Waiter {
    fn drop(&mut self) {
        let mut channels = self.shared.channels();
        if let Some(entry) = channels.get_mut(&self.channel) {
            entry.waiters = entry.waiters.saturating_sub(1);
            if entry.waiters == 0 {
                entry.idle_since = Instant::now();
                // Never subscribed (nor being): nothing to undo on the server, and kept, it
                // would stay for as long as the subscriber cannot connect.
                if entry.status == Status::Wanted {
                    channels.remove(&self.channel);
                }
            }
        }
    }
}

enum Done {
    Subscribed(Vec<u8>),
    Unsubscribed(Vec<u8>),
    Pinged,
    /// The connection is unusable.
    Failed(String),
}

type Op = Pin<Box<dyn Future<Output = Done> + Send>>;

enum Ended {
    /// The notifier is gone.
    Stop,
    /// The connection broke, or the server refused a command (why). `served`: whether the
    /// session had one confirmed SUBSCRIBE or PING first, and so worked for a while.
    Reconnect { why: String, served: bool },
}

/// Ends a subscriber's task however it ends (returned, or dropped with its runtime): no
/// channel stays marked subscribed without a subscriber, and the waiters are woken to look
/// again (a waiter that comes next starts a new task, see `Notifier::kick`).
struct Ending<'a>(&'a Shared);

impl Drop for Ending<'_> {
    fn drop(&mut self) {
        wake_all_after_disconnect(self.0);
    }
}

async fn run(shared: Arc<Shared>, mut kicks: mpsc::UnboundedReceiver<()>) {
    let _ending = Ending(&shared);
    let mut next_client = 0;
    let mut backoff = RECONNECT_MIN;
    let mut failing = false;
    loop {
        let Some(client) = shared
            .clients
            .get(next_client % shared.clients.len().max(1))
        else {
            return;
        };
        // Waiters that arrive meanwhile are picked up once connected.
        let connected = tokio::select! {
            connected = tokio::time::timeout(OP_TIMEOUT, client.get_async_pubsub()) => connected,
            _ = closed(&mut kicks) => return,
        };
        match connected {
            Ok(Ok(pubsub)) => {
                let (sink, stream) = pubsub.split();
                let ended = session(&shared, sink, stream, &mut kicks).await;
                wake_all_after_disconnect(&shared);
                let Ended::Reconnect { why, served } = ended else {
                    return;
                };
                if served {
                    if failing {
                        tracing::info!("lock release notifications: subscriber working again");
                    }
                    failing = false;
                    backoff = RECONNECT_MIN;
                } else {
                    // Connected, then refused or cut off at once (a user without rights on the
                    // channels, a proxy that does not relay SUBSCRIBE): not a connection that
                    // works, so the backoff keeps growing rather than reconnecting every 50 ms.
                    if !failing {
                        tracing::warn!(
                            error = %why,
                            "lock release notifications: the subscriber's connection does not work; waiters fall back to backoff"
                        );
                    }
                    failing = true;
                }
            }
            Ok(Err(e)) => {
                if !failing {
                    tracing::warn!(error = %e, "lock release notifications: cannot subscribe; waiters fall back to backoff");
                }
                failing = true;
            }
            Err(_) => {
                if !failing {
                    tracing::warn!(
                        "lock release notifications: connecting the subscriber timed out; waiters fall back to backoff"
                    );
                }
                failing = true;
            }
        }
        next_client += 1;
        let jittered = backoff.mul_f64(0.5 + fastrand::f64());
        tokio::select! {
            () = tokio::time::sleep(jittered) => {}
            _ = closed(&mut kicks) => return,
        }
        backoff = (backoff * 2).min(RECONNECT_MAX);
    }
}

/// Resolves when the notifier is gone (kicks are swallowed until then).
async fn closed(kicks: &mut mpsc::UnboundedReceiver<()>) {
    while kicks.recv().await.is_some() {}
}

async fn session(
    shared: &Shared,
    sink: PubSubSink,
    mut stream: redis::aio::PubSubStream,
    kicks: &mut mpsc::UnboundedReceiver<()>,
) -> Ended {
    let mut ops: FuturesUnordered<Op> = FuturesUnordered::new();
    schedule(shared, &sink, &mut ops);
    let mut tick = tokio::time::interval(TICK);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let started = Instant::now();
    let mut served = false;
    loop {
        tokio::select! {
            message = stream.next() => {
                let Some(message) = message else {
                    tracing::debug!("lock release notifications: subscriber connection closed");
                    return Ended::Reconnect { why: "connection closed".to_owned(), served };
                };
                let Ok(channel) = message.get_channel::<Vec<u8>>() else { continue };
                if let Some(entry) = shared.channels().get(&channel) {
                    entry.notify.notify_waiters();
                }
            }
            kick = kicks.recv() => {
                if kick.is_none() {
                    return Ended::Stop;
                }
                while kicks.try_recv().is_ok() {}
                schedule(shared, &sink, &mut ops);
            }
            Some(done) = ops.next(), if !ops.is_empty() => match done {
                Done::Subscribed(channel) => {
                    served = true;
                    if let Some(entry) = shared.channels().get_mut(&channel) {
                        if entry.status == Status::Subscribing {
                            entry.status = Status::Subscribed;
                        }
                        // Waiters registered before the subscription may have missed a release.
                        entry.notify.notify_waiters();
                    }
                }
                Done::Unsubscribed(channel) => {
                    let mut channels = shared.channels();
                    if let Some(entry) = channels.get_mut(&channel) {
                        if entry.waiters > 0 {
                            entry.status = Status::Wanted;
                            drop(channels);
                            schedule(shared, &sink, &mut ops);
                        } else {
                            channels.remove(&channel);
                        }
                    }
                }
                // Not the first PING (sent at once, which may be answered before a refused
                // SUBSCRIBE is).
                Done::Pinged => served |= started.elapsed() >= TICK,
                Done::Failed(e) => {
                    tracing::debug!(error = %e, "lock release notifications: subscriber failed");
                    return Ended::Reconnect { why: e, served };
                }
            },
            _ = tick.tick() => {
                sweep(shared, &sink, &mut ops);
                let mut ping = sink.clone();
                ops.push(Box::pin(async move {
                    match tokio::time::timeout(OP_TIMEOUT, ping.ping::<redis::Value>()).await {
                        Ok(Ok(_)) => Done::Pinged,
                        Ok(Err(e)) => Done::Failed(e.to_string()),
                        Err(_) => Done::Failed("PING timed out".to_owned()),
                    }
                }));
            }
        }
    }
}

/// Sends SUBSCRIBE for every wanted channel (one command each: redis-rs pairs one reply with
/// one request).
fn schedule(shared: &Shared, sink: &PubSubSink, ops: &mut FuturesUnordered<Op>) {
    let mut channels = shared.channels();
    for (name, entry) in channels.iter_mut() {
        if entry.status != Status::Wanted {
            continue;
        }
        entry.status = Status::Subscribing;
        let mut sink = sink.clone();
        let name = name.clone();
        ops.push(Box::pin(async move {
            match tokio::time::timeout(OP_TIMEOUT, sink.subscribe(&name)).await {
                Ok(Ok(())) => Done::Subscribed(name),
                Ok(Err(e)) => Done::Failed(e.to_string()),
                Err(_) => Done::Failed("SUBSCRIBE timed out".to_owned()),
            }
        }));
    }
}

/// Unsubscribes channels nobody has waited on for a while.
fn sweep(shared: &Shared, sink: &PubSubSink, ops: &mut FuturesUnordered<Op>) {
    let now = Instant::now();
    let mut channels = shared.channels();
    for (name, entry) in channels.iter_mut() {
        if entry.status != Status::Subscribed
            || entry.waiters > 0
            || now.duration_since(entry.idle_since) < LINGER
        {
            continue;
        }
        entry.status = Status::Unsubscribing;
        let mut sink = sink.clone();
        let name = name.clone();
        ops.push(Box::pin(async move {
            match tokio::time::timeout(OP_TIMEOUT, sink.unsubscribe(&name)).await {
                Ok(Ok(())) => Done::Unsubscribed(name),
                Ok(Err(e)) => Done::Failed(e.to_string()),
                Err(_) => Done::Failed("UNSUBSCRIBE timed out".to_owned()),
            }
        }));
    }
}

/// After the connection dropped: messages may have been lost, so every waiter looks again;
/// channels still wanted are subscribed again on the next connection.
fn wake_all_after_disconnect(shared: &Shared) {
    let mut channels = shared.channels();
    channels.retain(|_, entry| {
        entry.notify.notify_waiters();
        if entry.waiters == 0 {
            return false;
        }
        entry.status = Status::Wanted;
        true
    });
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    use super::*;

    /// A server that answers every command `+OK` but closes the connection on SUBSCRIBE, as a
    /// proxy without pub/sub does (twemproxy): each connection works until it is used. Counts
    /// the connections.
    async fn closes_on_subscribe() -> (String, Arc<AtomicUsize>) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let url = format!("redis://{}/", listener.local_addr().expect("addr"));
        let accepted = Arc::new(AtomicUsize::new(0));
        let count = Arc::clone(&accepted);
        tokio::spawn(async move {
            while let Ok((mut socket, _)) = listener.accept().await {
                count.fetch_add(1, Ordering::Relaxed);
                tokio::spawn(async move {
                    let mut buf = vec![0; 4096];
                    while let Ok(n) = socket.read(&mut buf).await {
                        let read = &buf[..n];
                        if n == 0
                            || read
                                .windows(9)
                                .any(|w| w.eq_ignore_ascii_case(b"SUBSCRIBE"))
                        {
                            return;
                        }
                        // One reply per command (an array, `*`, at the start of a line).
                        let commands = read
                            .iter()
                            .enumerate()
                            .filter(|&(i, &b)| b == b'*' && (i == 0 || read[i - 1] == b'\n'))
                            .count();
                        if socket
                            .write_all(&b"+OK\r\n".repeat(commands))
                            .await
                            .is_err()
                        {
                            return;
                        }
                    }
                });
            }
        });
        (url, accepted)
    }

    /// A subscriber whose connections fail as soon as they are used backs off as when it
    /// cannot connect, rather than reconnecting (and waking every waiter) every 50 ms.
    #[tokio::test]
    async fn a_connection_that_fails_at_once_does_not_reset_the_backoff() {
        let (url, accepted) = closes_on_subscribe().await;
        let client = redis::Client::open(url).expect("url");
        let notifier = Notifier::new(vec![client]);
        let waiter = notifier.released(b"lock".to_vec());
        tokio::time::sleep(Duration::from_secs(2)).await;
        drop(waiter);
        // Backoff from 50 ms, doubling, jittered by half either way: 5 to 8 connections in
        // 2 s; about 40 when every connection reset it.
        let accepted = accepted.load(Ordering::Relaxed);
        assert!(
            (2..=10).contains(&accepted),
            "{accepted} connections in 2 s"
        );
    }

    /// Waiters on locks named per entity, while the subscriber cannot connect: each channel
    /// leaves with its last waiter, as none was ever subscribed.
    #[tokio::test]
    async fn waiters_leave_nothing_behind_while_the_subscriber_cannot_connect() {
        let free = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let port = free.local_addr().expect("addr").port();
        drop(free);
        let client = redis::Client::open(format!("redis://127.0.0.1:{port}/")).expect("url");
        let notifier = Notifier::new(vec![client]);
        let held = notifier.released(b"held".to_vec());
        for i in 0..10_000 {
            drop(notifier.released(format!("order:{i}").into_bytes()));
            if i % 1000 == 0 {
                // The subscriber's task tries (and fails) to connect meanwhile.
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        }
        tokio::time::sleep(TICK + Duration::from_millis(100)).await;
        let channels = notifier.shared.channels().len();
        assert_eq!(channels, 1, "channels left behind");
        assert!(notifier.shared.channels().contains_key(&b"held"[..]));
        drop(held);
        assert!(notifier.shared.channels().is_empty());
    }
}
