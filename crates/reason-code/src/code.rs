//! The 17 gRPC status codes.

use std::fmt;
use std::str::FromStr;

/// A gRPC status code: the one classification every attempt outcome is reduced to.
///
/// HTTP responses are mapped onto these codes with [`Code::from_http_status`], gRPC responses carry
/// them in `grpc-status`, and business reason codes map onto them through
/// [`ReasonCodes`](crate::ReasonCodes). The numbers are the ones on the wire.
///
/// ```
/// use reason_code::Code;
///
/// assert_eq!(Code::from_i32(14), Code::Unavailable);
/// assert_eq!(Code::Unavailable.as_str(), "UNAVAILABLE");
/// assert_eq!("RESOURCE_EXHAUSTED".parse::<Code>(), Ok(Code::ResourceExhausted));
/// // gRPC says an unknown number is UNKNOWN.
/// assert_eq!(Code::from_i32(99), Code::Unknown);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[non_exhaustive]
#[repr(i32)]
pub enum Code {
    /// Not an error: the call succeeded.
    Ok = 0,
    /// The operation was cancelled, typically by the caller.
    Cancelled = 1,
    /// Unknown error.
    Unknown = 2,
    /// The client sent an invalid argument.
    InvalidArgument = 3,
    /// The deadline expired before the operation could complete.
    DeadlineExceeded = 4,
    /// Some requested entity was not found.
    NotFound = 5,
    /// The entity a client attempted to create already exists.
    AlreadyExists = 6,
    /// The caller does not have permission to execute the operation.
    PermissionDenied = 7,
    /// Some resource has been exhausted (a quota, a rate limit, space).
    ResourceExhausted = 8,
    /// The system is not in a state required for the operation's execution.
    FailedPrecondition = 9,
    /// The operation was aborted, typically by a concurrency conflict.
    Aborted = 10,
    /// The operation was attempted past the valid range.
    OutOfRange = 11,
    /// The operation is not implemented or supported.
    Unimplemented = 12,
    /// Internal error: an invariant of the server is broken.
    Internal = 13,
    /// The service is currently unavailable; a retry with backoff may succeed.
    Unavailable = 14,
    /// Unrecoverable data loss or corruption.
    DataLoss = 15,
    /// The request does not have valid authentication credentials.
    Unauthenticated = 16,
}

impl Code {
    /// Every code, in numeric order.
    pub const ALL: [Code; 17] = [
        Code::Ok,
        Code::Cancelled,
        Code::Unknown,
        Code::InvalidArgument,
        Code::DeadlineExceeded,
        Code::NotFound,
        Code::AlreadyExists,
        Code::PermissionDenied,
        Code::ResourceExhausted,
        Code::FailedPrecondition,
        Code::Aborted,
        Code::OutOfRange,
        Code::Unimplemented,
        Code::Internal,
        Code::Unavailable,
        Code::DataLoss,
        Code::Unauthenticated,
    ];

    /// The code for a wire number; numbers outside 0..=16 are [`Code::Unknown`], as gRPC specifies.
    pub const fn from_i32(n: i32) -> Code {
        if n >= 0 && n < 17 {
            Code::ALL[n as usize]
        } else {
            Code::Unknown
        }
    }

    /// The wire number.
    pub const fn as_i32(self) -> i32 {
        self as i32
    }

    /// The index of this code in a 17-entry table.
    pub(crate) const fn index(self) -> usize {
        self as usize
    }

    /// The canonical upper-case name (`"UNAVAILABLE"`), as gRPC documents it.
    pub const fn as_str(self) -> &'static str {
        match self {
            Code::Ok => "OK",
            Code::Cancelled => "CANCELLED",
            Code::Unknown => "UNKNOWN",
            Code::InvalidArgument => "INVALID_ARGUMENT",
            Code::DeadlineExceeded => "DEADLINE_EXCEEDED",
            Code::NotFound => "NOT_FOUND",
            Code::AlreadyExists => "ALREADY_EXISTS",
            Code::PermissionDenied => "PERMISSION_DENIED",
            Code::ResourceExhausted => "RESOURCE_EXHAUSTED",
            Code::FailedPrecondition => "FAILED_PRECONDITION",
            Code::Aborted => "ABORTED",
            Code::OutOfRange => "OUT_OF_RANGE",
            Code::Unimplemented => "UNIMPLEMENTED",
            Code::Internal => "INTERNAL",
            Code::Unavailable => "UNAVAILABLE",
            Code::DataLoss => "DATA_LOSS",
            Code::Unauthenticated => "UNAUTHENTICATED",
        }
    }

    /// The wire number as an ASCII header value (`grpc-status: 14`), without allocating.
    pub const fn as_header_str(self) -> &'static str {
        const NUMS: [&str; 17] = [
            "0", "1", "2", "3", "4", "5", "6", "7", "8", "9", "10", "11", "12", "13", "14", "15",
            "16",
        ];
        NUMS[self as usize]
    }
}

impl fmt::Display for Code {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The error of parsing a [`Code`] from its canonical name.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown status code name {name:?}: expected one of the 17 gRPC names such as UNAVAILABLE")]
pub struct UnknownCodeName {
    name: String,
}

impl FromStr for Code {
    type Err = UnknownCodeName;

    /// Parses a canonical name (`"UNAVAILABLE"`), case-insensitively, as gRPC service configs
    /// write them.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Code::ALL
            .iter()
            .copied()
            .find(|c| c.as_str().eq_ignore_ascii_case(s))
            .ok_or_else(|| UnknownCodeName { name: s.to_owned() })
    }
}

impl From<i32> for Code {
    fn from(n: i32) -> Self {
        Code::from_i32(n)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numbers_and_names_round_trip() {
        for (i, code) in Code::ALL.iter().enumerate() {
            assert_eq!(code.as_i32(), i as i32);
            assert_eq!(Code::from_i32(i as i32), *code);
            assert_eq!(code.as_str().parse::<Code>().unwrap(), *code);
            assert_eq!(code.as_header_str(), i.to_string());
        }
        assert_eq!(Code::from_i32(-1), Code::Unknown);
        assert_eq!(Code::from_i32(17), Code::Unknown);
        assert!("NOPE".parse::<Code>().is_err());
        assert_eq!("unavailable".parse::<Code>().unwrap(), Code::Unavailable);
    }
}
