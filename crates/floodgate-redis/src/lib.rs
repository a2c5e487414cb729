//! floodgate-redis
