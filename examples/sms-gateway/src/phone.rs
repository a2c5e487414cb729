//! Phone numbers in E.164 form and message texts.

use crate::error::ApiError;

/// The longest message text accepted, in characters (ten concatenated UCS-2 segments).
pub const MAX_TEXT_CHARS: usize = 670;

/// A phone number in E.164 form: `+`, a country code that does not start with 0, and at most
/// 15 digits in all (at least 7).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Phone(String);

impl Phone {
    /// Validates `raw` as E.164; `field` names it in the error.
    pub fn parse(raw: &str, field: &str) -> Result<Phone, ApiError> {
        let digits = raw.strip_prefix('+').ok_or_else(|| {
            ApiError::invalid(
                field,
                "must be in E.164 form, starting with + (e.g. +8613800000000)",
            )
        })?;
        let ok = (7..=15).contains(&digits.len())
            && digits.bytes().all(|b| b.is_ascii_digit())
            && !digits.starts_with('0');
        if !ok {
            return Err(ApiError::invalid(
                field,
                "must be + and 7 to 15 digits, not starting with 0 (E.164)",
            ));
        }
        Ok(Phone(raw.to_owned()))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// Validates a message text: not blank, at most [`MAX_TEXT_CHARS`] characters, no control
/// characters other than line breaks and tabs.
pub fn validate_text(text: &str, field: &str) -> Result<(), ApiError> {
    if text.trim().is_empty() {
        return Err(ApiError::invalid(field, "must not be empty"));
    }
    let chars = text.chars().count();
    if chars > MAX_TEXT_CHARS {
        return Err(ApiError::invalid(
            field,
            format!("is {chars} characters long; the most is {MAX_TEXT_CHARS}"),
        ));
    }
    if text
        .chars()
        .any(|c| c.is_control() && !matches!(c, '\n' | '\r' | '\t'))
    {
        return Err(ApiError::invalid(
            field,
            "must not contain control characters",
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn e164() {
        assert!(Phone::parse("+8613800000000", "phone").is_ok());
        assert!(Phone::parse("+14155552671", "phone").is_ok());
        for bad in [
            "8613800000000",
            "+",
            "+0123456789",
            "+12345",
            "+1234567890123456",
            "+86 138",
            "+86138000000a0",
            "",
            "+８６１３８",
        ] {
            let err = Phone::parse(bad, "phone").expect_err(bad);
            assert_eq!(err.field(), Some("phone"), "{bad}");
        }
    }

    #[test]
    fn texts() {
        assert!(validate_text("Your code is 1234", "text").is_ok());
        assert!(validate_text("line\nbreak", "text").is_ok());
        assert!(validate_text("  ", "text").is_err());
        assert!(validate_text(&"x".repeat(MAX_TEXT_CHARS + 1), "text").is_err());
        assert!(validate_text(&"汉".repeat(MAX_TEXT_CHARS), "text").is_ok());
        assert!(validate_text("bell\u{7}", "text").is_err());
    }
}
