//! Business reason codes: a response header such as `x-reason-code: STOCK_CONFLICT` that names
//! why a call failed in the service's own words, mapped onto a [`Code`].

use std::collections::HashMap;
use std::sync::Arc;

use http::header::{HeaderMap, HeaderName};

use crate::headers::X_REASON_CODE;
use crate::Code;

/// The user-extensible map from business reason codes to [`Code`]s, and the header they travel in.
///
/// A reason code in a response takes precedence over the HTTP or gRPC status: a 409 that says
/// `UPSTREAM_UNAVAILABLE` is retried like a 503. Names match exactly (they are identifiers, not
/// prose). Cloning is cheap (the map is shared).
///
/// ```
/// use http::HeaderMap;
/// use reason_code::{Code, ReasonCodes};
///
/// let reasons = ReasonCodes::default().with("INVENTORY_LOCKED", Code::Unavailable);
/// let mut headers = HeaderMap::new();
/// headers.insert("x-reason-code", "STOCK_CONFLICT".parse().unwrap());
/// assert_eq!(reasons.classify(&headers), Some(Code::Aborted));
/// headers.insert("x-reason-code", "INVENTORY_LOCKED".parse().unwrap());
/// assert_eq!(reasons.classify(&headers), Some(Code::Unavailable));
/// headers.insert("x-reason-code", "SOMETHING_ELSE".parse().unwrap());
/// assert_eq!(reasons.classify(&headers), None);
/// ```
#[derive(Debug, Clone)]
pub struct ReasonCodes {
    header: HeaderName,
    map: Arc<HashMap<Box<str>, Code>>,
}

impl Default for ReasonCodes {
    /// `x-reason-code` with UPSTREAM_UNAVAILABLE -> UNAVAILABLE, RATE_LIMITED ->
    /// RESOURCE_EXHAUSTED, STOCK_CONFLICT -> ABORTED.
    fn default() -> Self {
        ReasonCodes::empty()
            .with("UPSTREAM_UNAVAILABLE", Code::Unavailable)
            .with("RATE_LIMITED", Code::ResourceExhausted)
            .with("STOCK_CONFLICT", Code::Aborted)
    }
}

impl ReasonCodes {
    /// A table with no entries, read from `x-reason-code`.
    pub fn empty() -> Self {
        ReasonCodes {
            header: X_REASON_CODE,
            map: Arc::default(),
        }
    }

    /// Adds (or replaces) the mapping of `reason` to `code`.
    pub fn with(mut self, reason: impl Into<String>, code: Code) -> Self {
        Arc::make_mut(&mut self.map).insert(reason.into().into_boxed_str(), code);
        self
    }

    /// Reads reason codes from another header.
    pub fn header(mut self, name: HeaderName) -> Self {
        self.header = name;
        self
    }

    /// The header reason codes are read from.
    pub fn header_name(&self) -> &HeaderName {
        &self.header
    }

    /// The code a reason maps to, if it is in the table.
    pub fn get(&self, reason: &str) -> Option<Code> {
        self.map.get(reason).copied()
    }

    /// The code named by the reason-code header of `headers`, if the header is present, single,
    /// and names a known reason. Unknown reasons are ignored: the status decides.
    pub fn classify(&self, headers: &HeaderMap) -> Option<Code> {
        if self.map.is_empty() {
            return None;
        }
        let value = headers.get(&self.header)?;
        self.get(value.to_str().ok()?.trim())
    }
}
