//! The SMS gateway: a web service that sends SMS through floodgate's limits.
//!
//! See the example's README for how to run it, alone in memory or as several replicas sharing
//! one Redis.

pub mod app;
pub mod config;
pub mod dispatcher;
pub mod error;
pub mod open_files;
pub mod phone;
pub mod provider;
pub mod server;
pub mod shared;
