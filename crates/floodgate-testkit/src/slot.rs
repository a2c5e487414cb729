//! Redis Cluster key slots: CRC16 (XMODEM) of the key or its hash tag, mod 16384.

/// Number of hash slots in a Redis Cluster.
pub const SLOT_COUNT: u16 = 16384;

/// CRC16/XMODEM (polynomial 0x1021, initial value 0, no reflection), as
/// used by Redis Cluster.
pub fn crc16(bytes: &[u8]) -> u16 {
    let mut crc: u16 = 0;
    for &b in bytes {
        crc ^= u16::from(b) << 8;
        for _ in 0..8 {
            crc = if crc & 0x8000 != 0 {
                (crc << 1) ^ 0x1021
            } else {
                crc << 1
            };
        }
    }
    crc
}

/// The part of `key` that is hashed: the content of the first `{...}` if it
/// is non-empty, else the whole key (the rules of `CLUSTER KEYSLOT`).
pub fn hash_tag(key: &[u8]) -> &[u8] {
    if let Some(open) = key.iter().position(|&b| b == b'{') {
        let after = &key[open + 1..];
        if let Some(close) = after.iter().position(|&b| b == b'}')
            && close > 0
        {
            return &after[..close];
        }
    }
    key
}

/// The cluster slot of `key` (0..16384), honouring hash tags.
pub fn key_slot(key: &[u8]) -> u16 {
    crc16(hash_tag(key)) % SLOT_COUNT
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn crc16_check_value() {
        // The standard check value of CRC-16/XMODEM.
        assert_eq!(crc16(b"123456789"), 0x31C3);
        assert_eq!(crc16(b""), 0);
    }

    #[test]
    fn hash_tags() {
        assert_eq!(hash_tag(b"a{b}c"), b"b");
        assert_eq!(hash_tag(b"{}"), b"{}");
        assert_eq!(hash_tag(b"{}{a}"), b"{}{a}");
        assert_eq!(hash_tag(b"{{a}}"), b"{a");
        assert_eq!(hash_tag(b"{a}{b}"), b"a");
        assert_eq!(hash_tag(b"a{"), b"a{");
        assert_eq!(hash_tag(b"}a{b}"), b"b");
        assert_eq!(
            key_slot(b"{user1000}.following"),
            key_slot(b"{user1000}.followers")
        );
    }

    #[test]
    fn known_slots() {
        // Values from `CLUSTER KEYSLOT` on Redis 7.
        assert_eq!(key_slot(b"foo"), 12182);
        assert_eq!(key_slot(b"bar"), 5061);
        assert_eq!(key_slot(b"somekey"), 11058);
        assert_eq!(key_slot(b""), 0);
    }
}
