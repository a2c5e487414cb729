//! floodgate-tower
