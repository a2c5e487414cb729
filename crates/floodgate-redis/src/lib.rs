//! floodgate's Redis backend.

mod bloom;
mod config;
mod conn;
mod error;
pub mod keys;
mod limiter;

pub use bloom::*;
pub use config::*;
pub use conn::*;
pub use error::*;
pub use limiter::RedisLimiter;
