//! floodgate-lock
