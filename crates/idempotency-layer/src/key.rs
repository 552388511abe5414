//! The idempotency key: extraction from the request's headers and validation.

use std::fmt;

use http::HeaderValue;

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
    /// The key breaks the layer's own [`key_rule`](crate::IdempotencyLayer::key_rule): its
    /// message.
    Rule(String),
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
            KeyError::Rule(_) => "rule",
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
            KeyError::Rule(message) => f.write_str(message),
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
    // Every write's key is checked, and almost every key is bare and valid: one pass over its
    // bytes accepts it. Anything else (quoted, padded, refused) takes the rules below, which give
    // the same answer for such a key.
    if (MIN_KEY_LEN..=MAX_KEY_LEN).contains(&raw.len()) && raw.iter().all(|&b| is_key_byte(b)) {
        return std::str::from_utf8(raw).map_err(|_| KeyError::NotAscii);
    }
    by_the_rules(raw)
}

/// [`validate_key`]'s rules, one after the other.
fn by_the_rules(raw: &[u8]) -> Result<&str, KeyError> {
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
    if s.len() < MIN_KEY_LEN {
        return Err(KeyError::TooShort(s.len()));
    }
    if s.len() > MAX_KEY_LEN {
        return Err(KeyError::TooLong(s.len()));
    }
    if !s.bytes().all(is_key_byte) {
        return Err(KeyError::InvalidCharacter);
    }
    Ok(s)
}

/// The shortest and the longest key accepted.
const MIN_KEY_LEN: usize = 8;
const MAX_KEY_LEN: usize = 64;

/// Whether `b` may appear in a key: `A-Z a-z 0-9 _ -`.
fn is_key_byte(b: u8) -> bool {
    /// The bytes of a key, as a table: one load per byte.
    const KEY_BYTES: [bool; 256] = {
        let mut table = [false; 256];
        let mut b = 0;
        while b < 256 {
            let c = b as u8;
            table[b] = c.is_ascii_alphanumeric() || c == b'_' || c == b'-';
            b += 1;
        }
        table
    };
    KEY_BYTES[usize::from(b)]
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

/// The key of a write from the one value of its key headers (see
/// [`HeadScan`](crate::head::HeadScan)), checked by the layer's rules or by `rule`.
pub(crate) fn key_of<'h>(
    found: Option<&'h HeaderValue>,
    rule: Option<&KeyRuleFn>,
) -> Result<Option<&'h str>, KeyError> {
    match (found, rule) {
        (None, _) => Ok(None),
        (Some(v), None) => validate_key(v.as_bytes()).map(Some),
        (Some(v), Some(rule)) => {
            let key = unwrap_key(v.as_bytes())?;
            rule(key).map_err(KeyError::Rule)?;
            Ok(Some(key))
        }
    }
}

/// The key of a header value the layer already accepted (checked by [`key_of`]): its
/// structured-field quotes taken off, no rule applied again.
pub(crate) fn accepted_key(found: &HeaderValue) -> Option<&str> {
    unwrap_key(found.as_bytes()).ok()
}

/// A key rule of the layer's own ([`key_rule`](crate::IdempotencyLayer::key_rule)).
pub(crate) type KeyRuleFn = std::sync::Arc<dyn Fn(&str) -> Result<(), String> + Send + Sync>;

/// The key a header value carries, bare or as a structured-field string, before any rule of
/// length or characters: visible ASCII, with no escapes, not empty.
fn unwrap_key(raw: &[u8]) -> Result<&str, KeyError> {
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
    if s.is_empty() {
        return Err(KeyError::TooShort(0));
    }
    if s.bytes().any(|b| b == b' ' || b == b'\t' || b == b'"') {
        return Err(KeyError::InvalidCharacter);
    }
    Ok(s)
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

    /// The table of key bytes is the rule: `A-Z a-z 0-9 _ -`, nothing else.
    #[test]
    fn the_key_byte_table_is_the_rule() {
        for b in 0..=255u8 {
            let rule = b.is_ascii_alphanumeric() || b == b'_' || b == b'-';
            assert_eq!(is_key_byte(b), rule, "byte {b}");
        }
    }

    /// Every byte in every position of keys of the boundary lengths, and every length from 0
    /// to 70, bare, quoted and padded: the fast path gives the same answer as the rules.
    #[test]
    fn validation_agrees_with_the_rules() {
        let mut cases: Vec<Vec<u8>> = Vec::new();
        for len in [7, 8, 9, 63, 64, 65] {
            for pos in [0, len / 2, len - 1] {
                for b in 0..=255u8 {
                    let mut key = vec![b'a'; len];
                    key[pos] = b;
                    cases.push(key);
                }
            }
        }
        for len in 0..=70 {
            let key = vec![b'k'; len];
            cases.push([b"\"", &key[..], b"\""].concat());
            cases.push([b" ", &key[..], b"\t"].concat());
            cases.push(key);
        }
        for raw in &cases {
            assert_eq!(validate_key(raw), by_the_rules(raw), "{raw:?}");
        }
    }

    #[test]
    fn extraction_rejects_repeats_across_headers() {
        use http::HeaderMap;
        let names = [crate::X_IDEMPOTENCY_KEY, crate::IDEMPOTENCY_KEY];
        let extract = |h: &HeaderMap| {
            let found = crate::head::HeadScan::of(h, &names).key?;
            key_of(found, None).map(|k| k.map(str::to_owned))
        };
        let mut h = HeaderMap::new();
        assert_eq!(extract(&h), Ok(None));
        h.insert(crate::IDEMPOTENCY_KEY, "\"order-0001\"".parse().unwrap());
        assert_eq!(extract(&h), Ok(Some("order-0001".to_owned())));
        h.insert(crate::X_IDEMPOTENCY_KEY, "order-0001".parse().unwrap());
        assert_eq!(extract(&h), Err(KeyError::Repeated));
        h.remove(crate::IDEMPOTENCY_KEY);
        h.append(crate::X_IDEMPOTENCY_KEY, "order-0002".parse().unwrap());
        assert_eq!(extract(&h), Err(KeyError::Repeated));
    }
}
