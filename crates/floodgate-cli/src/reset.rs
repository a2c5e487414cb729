//! `floodgate reset`: deletes a key's state in Redis, as if it had never been used.

use clap::Args;
use floodgate_core::Limiter;
use floodgate_redis::display_key;
use serde::Serialize;

use crate::error::CliError;
use crate::inspect::{StateJson, read_state};
use crate::policy_args::{PolicyArgs, algorithms_help};
use crate::redis_args::{RedisArgs, small_runtime};

const LONG_ABOUT: &str = "\
Delete the state floodgate keeps in Redis for a key (Limiter::reset), as if the key had never
been used: its next request starts afresh. Prints the state that was deleted (as `inspect`
shows it: the Redis key, its type, TTL and content) so that nothing is lost without a trace.

Only the keys of the given policies for the given user key are deleted, one key per policy;
nothing else is touched, so no confirmation is asked.";

const AFTER_HELP: &str = concat!(
    algorithms_help!(),
    "
Example:
  floodgate reset --policy funnel:1/30m +8613800000000

Exit status: 0 when the state was deleted (or there was none), 1 when Redis could not be
reached, 2 for a bad command line or policy."
);

/// Flags of `floodgate reset`.
#[derive(Debug, Args)]
#[command(
    about = "Delete a key's state in Redis and print what was deleted",
    long_about = LONG_ABOUT,
    after_help = AFTER_HELP
)]
pub(crate) struct ResetArgs {
    #[command(flatten)]
    redis: RedisArgs,

    #[command(flatten)]
    policy: PolicyArgs,

    /// The user key: a phone number, an IP address, a user id... (any text).
    #[arg(value_name = "KEY")]
    key: String,
}

#[derive(Debug, Serialize)]
struct ResetJson {
    /// How many of the keys existed (and were deleted).
    deleted: usize,
    /// The state of each key as it was just before.
    keys: Vec<StateJson>,
}

/// Runs `floodgate reset`.
pub(crate) fn run(args: ResetArgs) -> Result<(), CliError> {
    let set = args.policy.build()?;
    let key = args.key.as_bytes();
    // The states deleted, and the error that stopped the deletions, if one did.
    let (keys, failed) = small_runtime()?.block_on(async {
        let limiter = args.redis.connect().await?;
        let url = limiter.conn().redacted_url().to_owned();
        let mut keys: Vec<StateJson> = Vec::with_capacity(set.policies.len());
        for policy in &set.policies {
            let step = async {
                let state = read_state(&limiter, policy, key).await?;
                limiter.reset(key, policy).await.map_err(|e| {
                    CliError::redis(format!("cannot delete key {} on {url}", state.key), e)
                })?;
                Ok::<_, CliError>(state)
            };
            match step.await {
                Ok(state) => keys.push(state),
                Err(e) => return Ok((keys, Some(e))),
            }
        }
        Ok::<_, CliError>((keys, None))
    })?;
    let out = ResetJson {
        deleted: keys.iter().filter(|k| k.exists).count(),
        keys,
    };
    if let Some(e) = failed {
        // The states already deleted are printed all the same: nothing is lost without a
        // trace.
        if !out.keys.is_empty() {
            let _ = crate::error::print_json(&out);
        }
        return Err(e);
    }
    crate::error::print_json(&out)?;
    if out.deleted == 0 {
        eprintln!(
            "note: key \"{}\" had no state for {} (nothing to delete)",
            display_key(key),
            if set.policies.len() == 1 {
                "this policy"
            } else {
                "these policies"
            }
        );
    }
    Ok(())
}
