//! floodgate
