//! Owner tokens: who holds a lock.

use std::fmt;

use crate::Error;

/// Random bytes in a token; as hex, twice as many characters.
const TOKEN_BYTES: usize = 16;

/// 128 bits from the operating system's CSPRNG, as 32 lowercase hex characters. Knowing a
/// holder's token is enough to release or extend its lock, so it must not be guessable by other
/// processes: a per-process seeded PRNG would not do.
#[derive(Clone, PartialEq, Eq)]
pub(crate) struct Token([u8; TOKEN_BYTES * 2]);

impl Token {
    pub(crate) fn random() -> Result<Self, Error> {
        let mut raw = [0u8; TOKEN_BYTES];
        getrandom::fill(&mut raw).map_err(|e| Error::Random(e.to_string()))?;
        let mut hex = [0u8; TOKEN_BYTES * 2];
        for (i, byte) in raw.iter().enumerate() {
            hex[2 * i] = HEX[usize::from(byte >> 4)];
            hex[2 * i + 1] = HEX[usize::from(byte & 0x0f)];
        }
        Ok(Self(hex))
    }

    pub(crate) fn as_bytes(&self) -> &[u8] {
        &self.0
    }
}

const HEX: &[u8; 16] = b"0123456789abcdef";

impl fmt::Debug for Token {
    // Whoever reads a token can release the lock: show a prefix only.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Token({}...)", String::from_utf8_lossy(&self.0[..6]))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_are_hex_and_distinct() {
        let a = Token::random().expect("random");
        let b = Token::random().expect("random");
        assert_ne!(a, b);
        assert_eq!(a.as_bytes().len(), 32);
        assert!(a.as_bytes().iter().all(u8::is_ascii_hexdigit));
        assert!(!format!("{a:?}").contains(std::str::from_utf8(a.as_bytes()).expect("hex")));
    }
}
