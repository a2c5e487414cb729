//! Where state lives in Redis: `<prefix>:<algorithm>:<policy>:{<user key>}`.
//!
//! The braces are a cluster hash tag: every key of one user key lands on one slot, so a check of
//! several policies for that key is one script call on one node. User keys are bytes; a key that
//! is long (over [`MAX_INLINE_KEY`] bytes), holds a brace (which would move the hash tag), is
//! empty (Redis ignores an empty `{}`, so each policy's key would hash whole, to a slot of its
//! own) or starts with `~` is replaced by `~` and the hex SHA-256 of its bytes: stable across
//! processes and versions. Hashing every key that starts with `~` keeps the two forms apart: a client
//! that sends `~` and the digest of someone else's long key gets a key of its own, not theirs.

use floodgate_core::Policy;
use sha2::{Digest, Sha256};

/// User keys up to this many bytes are stored as they are.
pub const MAX_INLINE_KEY: usize = 256;

/// The user key as it appears between the braces.
pub fn key_tag(key: &[u8]) -> std::borrow::Cow<'_, [u8]> {
    if key.len() <= MAX_INLINE_KEY
        && !key.is_empty()
        && key.first() != Some(&b'~')
        && !key.iter().any(|b| *b == b'{' || *b == b'}')
    {
        return std::borrow::Cow::Borrowed(key);
    }
    let digest = Sha256::digest(key);
    let mut tag = Vec::with_capacity(65);
    tag.push(b'~');
    for byte in digest {
        tag.extend_from_slice(format!("{byte:02x}").as_bytes());
    }
    std::borrow::Cow::Owned(tag)
}

/// The Redis key holding `policy`'s state for `key`.
pub fn state_key(prefix: &str, policy: &Policy, key: &[u8]) -> Vec<u8> {
    let tag = key_tag(key);
    let alg = policy.algorithm().tag();
    let mut out =
        Vec::with_capacity(prefix.len() + alg.len() + policy.name().len() + tag.len() + 5);
    out.extend_from_slice(prefix.as_bytes());
    out.push(b':');
    out.extend_from_slice(alg.as_bytes());
    out.push(b':');
    out.extend_from_slice(policy.name().as_bytes());
    out.extend_from_slice(b":{");
    out.extend_from_slice(&tag);
    out.push(b'}');
    out
}

/// The cluster slot of a Redis key: CRC16/XMODEM of its hash tag (or the whole key), mod 16384.
pub fn key_slot(key: &[u8]) -> u16 {
    let hashed = match key.iter().position(|b| *b == b'{') {
        Some(open) => match key[open + 1..].iter().position(|b| *b == b'}') {
            Some(len) if len > 0 => &key[open + 1..open + 1 + len],
            _ => key,
        },
        None => key,
    };
    crc16(hashed) % 16_384
}

fn crc16(data: &[u8]) -> u16 {
    let mut crc: u16 = 0;
    for &byte in data {
        crc ^= u16::from(byte) << 8;
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layout_and_hash_tags() {
        let p = Policy::per_minute(20).expect("valid");
        let k = state_key("fg", &p, b"10.0.0.1");
        assert_eq!(k, b"fg:gcra:gcra-20-per-1m:{10.0.0.1}");
        // Every policy of one user key shares a slot.
        let q = Policy::funnel(1, std::time::Duration::from_secs(1800)).expect("valid");
        assert_eq!(key_slot(&k), key_slot(&state_key("fg", &q, b"10.0.0.1")));
        // Braces and long keys are hashed, so they cannot move the tag.
        for hostile in [&b"}{"[..], b"{x}", b"a}b", &[b'x'; 300], b""] {
            let k = state_key("fg", &p, hostile);
            let open = k.iter().position(|b| *b == b'{').expect("brace");
            assert_eq!(k[open + 1], b'~', "{}", String::from_utf8_lossy(&k));
            assert_eq!(k.iter().filter(|b| **b == b'{').count(), 1);
            assert_eq!(key_slot(&k), key_slot(&state_key("fg", &q, hostile)));
        }
        // A key in the hashed form is hashed again: it cannot name another key's state.
        let long = [b'x'; 300];
        let hashed = key_tag(&long).into_owned();
        assert_eq!(hashed.len(), 65);
        assert_ne!(key_tag(&hashed), hashed);
        assert_ne!(state_key("fg", &p, &hashed), state_key("fg", &p, &long));
        assert_eq!(key_tag(b"~").len(), 65);
        assert_eq!(&*key_tag(b"a~"), b"a~");
        // Binary keys are kept as they are.
        assert!(state_key("fg", &p, b"\0\xff").ends_with(b"{\0\xff}"));
    }

    #[test]
    fn crc16_matches_redis() {
        // Values from the Redis Cluster specification and CLUSTER KEYSLOT.
        assert_eq!(crc16(b"123456789"), 0x31c3);
        assert_eq!(key_slot(b"foo"), 12_182);
        assert_eq!(key_slot(b"{user1000}.following"), key_slot(b"user1000"));
        assert_eq!(key_slot(b"foo{}{bar}"), key_slot(b"foo{}{bar}"));
    }
}
