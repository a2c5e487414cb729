//! The SMS gateway: a web service that sends SMS through floodgate's limits.

pub mod config;
pub mod error;
pub mod phone;
pub mod provider;
