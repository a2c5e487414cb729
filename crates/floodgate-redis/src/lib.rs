//! floodgate's Redis backend.

mod batch;
mod bloom;
mod breaker;
mod config;
mod conn;
mod error;
mod gcra_batch;
pub mod keys;
mod limiter;

pub use batch::BatchConfig;
pub use bloom::*;
pub use breaker::BreakerConfig;
pub use config::*;
pub use conn::*;
pub use error::*;
pub use limiter::{CHECK_SCRIPT, RedisLimiter, ScriptArgs};
