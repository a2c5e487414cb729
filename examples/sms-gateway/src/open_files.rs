//! The open-file limit against the connection bound.
//!
//! Every client connection holds a socket, and so does every webhook call in flight. A
//! process that runs out of file descriptors cannot accept connections, nor open its webhook
//! calls, nor reconnect to Redis: under load, it fails every request at once. At start, the
//! gateway makes sure `MAX_CONNECTIONS` fits the limit (`ulimit -n`): it raises the soft limit
//! as far as the hard one allows, lowers the default bound when that is not enough, and refuses
//! to start with a bound given explicitly that could never be reached.

use rustix::process::{Resource, Rlimit, getrlimit, setrlimit};

use crate::config::Config;

/// Open files the gateway may hold besides its client connections and webhook calls: the
/// refused connections it answers (64 at most), the listener, Redis connections and the lock
/// notifier's, the outbox, the runtime's own, with room to spare.
pub const OTHER_FILES: u64 = 128;

/// The most webhook calls `config` may have in flight, each with a connection of its own: a
/// message is sent only when the global limit allows it (its burst, a second's worth, and its
/// rate after), and a call takes 5 s at most; idle connections are kept for the next ones.
/// Sends go on when their clients hang up, so connections do not bound them.
pub fn webhook_calls(config: &Config) -> u64 {
    if config.webhook_url.is_some() {
        config.global_per_second.saturating_mul(6)
    } else {
        0
    }
}

/// What to do about the limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Plan {
    /// The soft limit to set, when it must be raised.
    pub raise_to: Option<u64>,
    /// The soft limit after that (`None`: unlimited).
    pub limit: Option<u64>,
    /// The most connections that fit under it.
    pub fits: usize,
}

/// The plan for `connections` and `calls` webhook calls under a `soft` and `hard` limit
/// (`None`: unlimited): raise the soft limit as far as they need and the hard limit allows,
/// and say how many connections fit (webhook calls do not count against them: how many are
/// in flight depends on the provider, which is seldom that slow).
pub fn plan(connections: usize, calls: u64, soft: Option<u64>, hard: Option<u64>) -> Plan {
    let need = files_for(connections, calls);
    let (raise_to, limit) = match soft {
        Some(soft) if soft < need => {
            let to = hard.map_or(need, |hard| hard.min(need));
            ((to > soft).then_some(to), Some(to.max(soft)))
        }
        soft => (None, soft),
    };
    Plan {
        raise_to,
        limit,
        fits: limit.map_or(usize::MAX, fitting),
    }
}

/// Open files for `connections`, `calls` webhook calls and the rest ([`OTHER_FILES`]).
fn files_for(connections: usize, calls: u64) -> u64 {
    u64::try_from(connections)
        .unwrap_or(u64::MAX)
        .saturating_add(calls)
        .saturating_add(OTHER_FILES)
}

/// The most connections under a limit of `files`.
fn fitting(files: u64) -> usize {
    usize::try_from(files.saturating_sub(OTHER_FILES)).unwrap_or(usize::MAX)
}

/// Fits `config`'s connection bound to the process' open-file limit: raises the soft limit
/// when it is too low and the hard limit allows; else lowers a default bound (and the
/// per-address one with it), or refuses an explicit one with what to do about it.
pub fn fit(config: &mut Config) -> Result<(), String> {
    let limit = getrlimit(Resource::Nofile);
    let wanted = config.max_connections;
    let calls = webhook_calls(config);
    let mut plan = plan(wanted, calls, limit.current, limit.maximum);
    if let (Some(to), Some(from)) = (plan.raise_to, limit.current) {
        let raised = Rlimit {
            current: Some(to),
            maximum: limit.maximum,
        };
        match setrlimit(Resource::Nofile, raised) {
            Ok(()) => tracing::info!(from, to, "raised the open-file limit"),
            Err(e) => {
                tracing::warn!(error = %e, from, to, "cannot raise the open-file limit");
                plan.limit = Some(from);
                plan.fits = fitting(from);
            }
        }
    }
    let shown = plan
        .limit
        .map_or_else(|| "unlimited".to_owned(), |l| l.to_string());
    let hard = limit
        .maximum
        .map_or_else(|| "unlimited".to_owned(), |h| h.to_string());
    if plan.fits >= wanted {
        let need = files_for(wanted, calls);
        if plan.limit.is_some_and(|l| l < need) {
            tracing::warn!(
                "MAX_CONNECTIONS={wanted} and up to {calls} webhook calls in flight (the \
                 global limit's burst and 5 s of its rate) may need {need} open files with \
                 {OTHER_FILES} for the rest, but this process may open {shown} (ulimit -n; \
                 hard limit {hard}): a slow provider may run it out of files"
            );
        }
        return Ok(());
    }
    let why = format!(
        "MAX_CONNECTIONS={wanted} needs up to {} open files (one per connection, and \
         {OTHER_FILES} for the rest), but this process may open {shown} (ulimit -n; hard limit \
         {hard})",
        files_for(wanted, 0),
    );
    // Not even one connection: whatever the bound, raising the limit is the only way.
    if plan.fits == 0 {
        return Err(format!("{why}: raise the limit"));
    }
    if config.max_connections_set {
        return Err(format!(
            "{why}: raise the limit, or set MAX_CONNECTIONS to at most {}",
            plan.fits
        ));
    }
    let per_ip = config.max_connections_per_ip.min(plan.fits);
    tracing::warn!(
        "{why}: serving at most {} connections at once (MAX_CONNECTIONS_PER_IP {per_ip}); \
         raise the limit for more",
        plan.fits
    );
    config.max_connections = plan.fits;
    config.max_connections_per_ip = per_ip;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_limit_with_room_is_left_alone() {
        let p = plan(512, 0, Some(1024), Some(4096));
        assert_eq!(p.raise_to, None);
        assert_eq!(p.fits, 1024 - 128);
        let p = plan(512, 600, None, None);
        assert_eq!(
            p,
            Plan {
                raise_to: None,
                limit: None,
                fits: usize::MAX
            }
        );
    }

    #[test]
    fn a_low_soft_limit_is_raised_as_far_as_needed() {
        // 512 connections, 600 webhook calls and the rest: 1,240.
        let p = plan(512, 600, Some(1024), Some(1 << 20));
        assert_eq!(p.raise_to, Some(1240));
        assert_eq!(p.fits, 1240 - 128);
        assert_eq!(plan(512, 600, Some(1024), None).raise_to, Some(1240));
    }

    #[test]
    fn a_low_hard_limit_is_reached_and_says_what_fits() {
        let p = plan(1000, 0, Some(256), Some(512));
        assert_eq!(p.raise_to, Some(512));
        assert_eq!(p.fits, 512 - 128);
        // Soft already at the hard limit: nothing to raise. Webhook calls do not count
        // against connections.
        let p = plan(1000, 600, Some(512), Some(512));
        assert_eq!(p.raise_to, None);
        assert_eq!(p.fits, 512 - 128);
        // Not even the rest fits.
        assert_eq!(plan(10, 0, Some(100), Some(100)).fits, 0);
    }
}
