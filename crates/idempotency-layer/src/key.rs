//! The idempotency key: extraction from the request's headers and validation.

use std::fmt;

use http::{HeaderMap, HeaderName};

/// Why an idempotency key was refused: each rule has its own message.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum KeyError {
    /// The key header appears more than once (or two key headers are both present).
    Repeated,
    /// The value is not visible ASCII.
    NotAscii,
    /// Fewer than 8 characters.
    TooShort(usize),
    /// More than 64 characters.
    TooLong(usize),
    /// A character outside `A-Z a-z 0-9 _ -`.
    InvalidCharacter,
}

impl KeyError {
    /// The rule's short name, as used in metrics and problem bodies.
    pub fn rule(&self) -> &'static str {
        match self {
            KeyError::Repeated => "repeated",
            KeyError::NotAscii => "not-ascii",
            KeyError::TooShort(_) => "too-short",
            KeyError::TooLong(_) => "too-long",
            KeyError::InvalidCharacter => "invalid-character",
        }
    }
}

impl fmt::Display for KeyError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            KeyError::Repeated => {
                f.write_str("idempotency key is repeated: send exactly one key header")
            }
            KeyError::NotAscii => {
                f.write_str("idempotency key is not ASCII: use [A-Za-z0-9_-]{8,64}")
            }
            KeyError::TooShort(n) => write!(
                f,
                "idempotency key is too short ({n} characters): use 8 to 64"
            ),
            KeyError::TooLong(n) => write!(
                f,
                "idempotency key is too long ({n} characters): use 8 to 64"
            ),
            KeyError::InvalidCharacter => f.write_str(
                "idempotency key has an invalid character: use only A-Z, a-z, 0-9, '_' and '-'",
            ),
        }
    }
}

impl std::error::Error for KeyError {}

/// Validates a key value: `[A-Za-z0-9_-]{8,64}`, bare or as an RFC 8941 structured-field string
/// (the IETF draft's `Idempotency-Key: "8e03978e-40d5"`), whose parameters (`"k";p=1`) are
/// accepted as the structured-field grammar allows and ignored (the draft gives them no meaning).
///
/// ```
/// use idempotency_layer::{validate_key, KeyError};
///
/// assert_eq!(validate_key(b"order-0042"), Ok("order-0042"));
/// assert_eq!(validate_key(br#""order-0042""#), Ok("order-0042"));
/// assert_eq!(validate_key(br#""order-0042";v=1"#), Ok("order-0042"));
/// assert_eq!(validate_key(b"short"), Err(KeyError::TooShort(5)));
/// assert_eq!(validate_key(br#""order-0042"junk"#), Err(KeyError::InvalidCharacter));
/// ```
pub fn validate_key(raw: &[u8]) -> Result<&str, KeyError> {
    let s = std::str::from_utf8(raw).map_err(|_| KeyError::NotAscii)?;
    if !s.is_ascii() {
        return Err(KeyError::NotAscii);
    }
    let s = s.trim_matches(|c| c == ' ' || c == '\t');
    let s = if s.starts_with('"') {
        structured_string(s)?
    } else {
        s
    };
    if s.len() < 8 {
        return Err(KeyError::TooShort(s.len()));
    }
    if s.len() > 64 {
        return Err(KeyError::TooLong(s.len()));
    }
    if !s
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
    {
        return Err(KeyError::InvalidCharacter);
    }
    Ok(s)
}

/// The string of a structured-field item (`"abc";p=1`), parsed as RFC 8941 says, as a slice of
/// `s`: a valid key needs no escapes, so the string is the text after the opening quote.
fn structured_string(s: &str) -> Result<&str, KeyError> {
    let item: sfv::Item = sfv::Parser::new(s)
        .parse()
        .map_err(|_| KeyError::InvalidCharacter)?;
    let string = item
        .bare_item
        .as_string()
        .ok_or(KeyError::InvalidCharacter)?
        .as_str();
    let inner = s
        .get(1..1 + string.len())
        .filter(|inner| *inner == string)
        // The string had escapes (`\"`, `\\`): not a valid key.
        .ok_or(KeyError::InvalidCharacter)?;
    Ok(inner)
}

/// Finds the one key among `names` in `headers`.
pub(crate) fn extract_key<'h>(
    headers: &'h HeaderMap,
    names: &[HeaderName],
) -> Result<Option<&'h str>, KeyError> {
    let mut found = None;
    for name in names {
        for value in headers.get_all(name) {
            if found.is_some() {
                return Err(KeyError::Repeated);
            }
            found = Some(value);
        }
    }
    match found {
        None => Ok(None),
        Some(v) => validate_key(v.as_bytes()).map(Some),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn key_rules() {
        assert_eq!(validate_key(b"abcdEFGH_-09"), Ok("abcdEFGH_-09"));
        assert_eq!(validate_key(b"\"abcdefgh\""), Ok("abcdefgh"));
        assert_eq!(validate_key(b"abcdefg"), Err(KeyError::TooShort(7)));
        assert_eq!(validate_key(&[b'a'; 65]), Err(KeyError::TooLong(65)));
        assert_eq!(validate_key(&[b'a'; 64]).map(str::len), Ok(64));
        assert_eq!(validate_key(b"abcd efgh"), Err(KeyError::InvalidCharacter));
        assert_eq!(validate_key(b"abcd.efgh"), Err(KeyError::InvalidCharacter));
        assert_eq!(validate_key(b"\"abcdefgh"), Err(KeyError::InvalidCharacter));
        assert_eq!(validate_key("abcdéfgh".as_bytes()), Err(KeyError::NotAscii));
        assert_eq!(validate_key(b"abc\xffdefgh"), Err(KeyError::NotAscii));
    }

    #[test]
    fn extraction_rejects_repeats_across_headers() {
        let names = [crate::X_IDEMPOTENCY_KEY, crate::IDEMPOTENCY_KEY];
        let mut h = HeaderMap::new();
        assert_eq!(extract_key(&h, &names), Ok(None));
        h.insert(crate::IDEMPOTENCY_KEY, "\"order-0001\"".parse().unwrap());
        assert_eq!(extract_key(&h, &names), Ok(Some("order-0001")));
        h.insert(crate::X_IDEMPOTENCY_KEY, "order-0001".parse().unwrap());
        assert_eq!(extract_key(&h, &names), Err(KeyError::Repeated));
        h.remove(crate::IDEMPOTENCY_KEY);
        h.append(crate::X_IDEMPOTENCY_KEY, "order-0002".parse().unwrap());
        assert_eq!(extract_key(&h, &names), Err(KeyError::Repeated));
    }
}
