//! The one retryability table: what the client may retry and what the server may record, for
//! every outcome, as data in one place.

use crate::Code;

/// What happened to one attempt, as the client sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Outcome {
    /// A response (HTTP status, `grpc-status` or reason code) classified into a code.
    Status(Code),
    /// The request provably never left the client: connect refused, DNS or TLS failure, h2
    /// `REFUSED_STREAM`, GOAWAY beyond the last stream id.
    Unsent,
    /// The connection was lost after the request was sent, or the attempt timed out: the server
    /// may or may not have executed it.
    Ambiguous,
}

impl Outcome {
    /// The code this outcome is reported as (`Unsent` and `Ambiguous` are UNAVAILABLE).
    pub const fn code(self) -> Code {
        match self {
            Outcome::Status(c) => c,
            Outcome::Unsent | Outcome::Ambiguous => Code::Unavailable,
        }
    }
}

/// When the client may retry an outcome.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum ClientRule {
    /// Never retried.
    Never,
    /// Retried for any request, idempotent or not: the server did not act on it.
    Always,
    /// Retried only when the request is idempotent: a safe HTTP method, a gRPC method declared
    /// idempotent, or a request carrying an idempotency key.
    IfIdempotent,
    /// Returned as it is, unless the caller installed a hook that rebuilds the request (after a
    /// re-read, for a conflict such as STOCK_CONFLICT).
    Rebuild,
}

/// When the server may record an outcome for replay.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum RecordRule {
    /// Recorded: replayed to every duplicate.
    Always,
    /// A permanent failure: recorded only when the server opts in.
    OptIn,
    /// Never recorded: the claim is released and a retry executes again.
    Never,
}

/// The client's verdict for one outcome, before the attempt, deadline and budget checks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Verdict {
    /// The outcome may be retried.
    Retry,
    /// The outcome may be retried only through a request-rebuilding hook.
    Rebuild,
    /// The outcome is final.
    Final,
}

/// One row of the table: a code, its client rule and its record rule.
type Row = (Code, ClientRule, RecordRule);

/// The design table, row by row. This is the only place the defaults are written.
const ROWS: [Row; 17] = [
    (Code::Ok, ClientRule::Never, RecordRule::Always),
    (Code::Cancelled, ClientRule::Never, RecordRule::Never),
    (Code::Unknown, ClientRule::Never, RecordRule::Never),
    (Code::InvalidArgument, ClientRule::Never, RecordRule::OptIn),
    (
        Code::DeadlineExceeded,
        ClientRule::IfIdempotent,
        RecordRule::Never,
    ),
    (Code::NotFound, ClientRule::Never, RecordRule::OptIn),
    (Code::AlreadyExists, ClientRule::Never, RecordRule::OptIn),
    (Code::PermissionDenied, ClientRule::Never, RecordRule::OptIn),
    (
        Code::ResourceExhausted,
        ClientRule::Always,
        RecordRule::Never,
    ),
    (
        Code::FailedPrecondition,
        ClientRule::Never,
        RecordRule::OptIn,
    ),
    (Code::Aborted, ClientRule::Rebuild, RecordRule::Never),
    (Code::OutOfRange, ClientRule::Never, RecordRule::OptIn),
    (Code::Unimplemented, ClientRule::Never, RecordRule::OptIn),
    (Code::Internal, ClientRule::Never, RecordRule::Never),
    (
        Code::Unavailable,
        ClientRule::IfIdempotent,
        RecordRule::Never,
    ),
    (Code::DataLoss, ClientRule::Never, RecordRule::Never),
    (Code::Unauthenticated, ClientRule::Never, RecordRule::OptIn),
];

/// The retryability table that both layers read: the client's view ([`RetryTable::verdict`]) and
/// the server's view ([`RetryTable::may_record`]) of the same rows.
///
/// | outcome | code | client retries? | server records? |
/// |---|---|---|---|
/// | 2xx, 3xx (a 303 after a POST is a completed create), gRPC OK | OK | no (success) | yes |
/// | the idempotency layer's "in flight" (409 / ABORTED + [`IDEMPOTENCY_IN_FLIGHT`]) | UNAVAILABLE | yes, same request and key, after the pushback | never |
/// | the idempotency layer's "too large" (413 / RESOURCE_EXHAUSTED + [`REQUEST_TOO_LARGE`]) | INVALID_ARGUMENT | no: it never fits | never |
/// | nothing was sent | UNAVAILABLE (unsent) | yes, any request | n/a |
/// | lost after send, attempt timeout | UNAVAILABLE (ambiguous) | if idempotent or keyed | n/a |
/// | 502, 503, UNAVAILABLE | UNAVAILABLE | if idempotent or keyed | no |
/// | 429, RESOURCE_EXHAUSTED | RESOURCE_EXHAUSTED | yes, after pushback or backoff | no |
/// | 504, DEADLINE_EXCEEDED | DEADLINE_EXCEEDED | if idempotent or keyed, and the deadline fits | no |
/// | 409, ABORTED | ABORTED | only through a rebuild hook | no |
/// | 500, INTERNAL, UNKNOWN | INTERNAL / UNKNOWN | no (opt-in) | no |
/// | 400, 401, 403, 404, ... | as named | no | opt-in (permanent failures) |
/// | 412, 501 | FAILED_PRECONDITION, UNIMPLEMENTED | no | opt-in |
/// | DATA_LOSS | DATA_LOSS | never | no |
///
/// [`IDEMPOTENCY_IN_FLIGHT`]: crate::IDEMPOTENCY_IN_FLIGHT
/// [`REQUEST_TOO_LARGE`]: crate::REQUEST_TOO_LARGE
///
/// The attempt count, deadline and retry budget checks are the retry layer's; this table only
/// says whether an outcome is retryable at all.
///
/// ```
/// use reason_code::{ClientRule, Code, Outcome, RetryTable, Verdict};
///
/// let table = RetryTable::default();
/// assert_eq!(table.verdict(Outcome::Status(Code::Unavailable), true), Verdict::Retry);
/// // A POST without a key that got a 503 may have run: not retried.
/// assert_eq!(table.verdict(Outcome::Status(Code::Unavailable), false), Verdict::Final);
/// // A request that never left the client is always safe to send again.
/// assert_eq!(table.verdict(Outcome::Unsent, false), Verdict::Retry);
/// assert!(table.may_record(Code::Ok));
/// assert!(!table.may_record(Code::InvalidArgument));
///
/// // Opt in: retry INTERNAL for idempotent requests, record permanent failures.
/// let table = table
///     .with_client_rule(Code::Internal, ClientRule::IfIdempotent)
///     .record_permanent_failures(true);
/// assert_eq!(table.verdict(Outcome::Status(Code::Internal), true), Verdict::Retry);
/// assert!(table.may_record(Code::InvalidArgument));
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RetryTable {
    client: [ClientRule; 17],
    record: [RecordRule; 17],
    unsent: ClientRule,
    ambiguous: ClientRule,
    record_opt_in: bool,
}

impl Default for RetryTable {
    fn default() -> Self {
        Self::DEFAULT
    }
}

impl RetryTable {
    /// The design table.
    pub const DEFAULT: RetryTable = {
        let mut client = [ClientRule::Never; 17];
        let mut record = [RecordRule::Never; 17];
        let mut i = 0;
        while i < ROWS.len() {
            let (code, c, r) = ROWS[i];
            client[code.index()] = c;
            record[code.index()] = r;
            i += 1;
        }
        RetryTable {
            client,
            record,
            unsent: ClientRule::Always,
            ambiguous: ClientRule::IfIdempotent,
            record_opt_in: false,
        }
    };

    /// A table where no status is retryable (transport outcomes keep their rules): the start for
    /// an allow-list such as gRPC's `retryableStatusCodes`.
    pub const fn no_status_retries() -> RetryTable {
        let mut t = RetryTable::DEFAULT;
        t.client = [ClientRule::Never; 17];
        t
    }

    /// Sets the client rule of a status code. `OK` and `DATA_LOSS` are never retried, whatever
    /// the rule: the call keeps them [`ClientRule::Never`].
    pub const fn with_client_rule(mut self, code: Code, rule: ClientRule) -> Self {
        if !matches!(code, Code::Ok | Code::DataLoss) {
            self.client[code.index()] = rule;
        }
        self
    }

    /// Sets the client rule of ambiguous transport failures (lost after send, attempt timeout).
    /// The default is [`ClientRule::IfIdempotent`]; [`ClientRule::Always`] is unsafe for writes.
    pub const fn with_ambiguous_rule(mut self, rule: ClientRule) -> Self {
        self.ambiguous = rule;
        self
    }

    /// Sets the client rule of requests that were never sent (default [`ClientRule::Always`]).
    pub const fn with_unsent_rule(mut self, rule: ClientRule) -> Self {
        self.unsent = rule;
        self
    }

    /// Sets the server's record rule of a code. `OK` is always recorded.
    pub const fn with_record_rule(mut self, code: Code, rule: RecordRule) -> Self {
        if !matches!(code, Code::Ok) {
            self.record[code.index()] = rule;
        }
        self
    }

    /// Records the [`RecordRule::OptIn`] codes (permanent failures such as INVALID_ARGUMENT) too.
    pub const fn record_permanent_failures(mut self, yes: bool) -> Self {
        self.record_opt_in = yes;
        self
    }

    /// The client rule for an outcome.
    pub const fn client_rule(&self, outcome: Outcome) -> ClientRule {
        match outcome {
            Outcome::Status(code) => self.client[code.index()],
            Outcome::Unsent => self.unsent,
            Outcome::Ambiguous => self.ambiguous,
        }
    }

    /// The record rule for a code.
    pub const fn record_rule(&self, code: Code) -> RecordRule {
        self.record[code.index()]
    }

    /// The client's view: may this outcome be retried, for a request that is (or is not)
    /// idempotent?
    pub const fn verdict(&self, outcome: Outcome, idempotent: bool) -> Verdict {
        match self.client_rule(outcome) {
            ClientRule::Always => Verdict::Retry,
            ClientRule::IfIdempotent if idempotent => Verdict::Retry,
            ClientRule::Rebuild => Verdict::Rebuild,
            ClientRule::IfIdempotent | ClientRule::Never => Verdict::Final,
        }
    }

    /// The server's view: may a response with this code be recorded and replayed?
    pub const fn may_record(&self, code: Code) -> bool {
        match self.record[code.index()] {
            RecordRule::Always => true,
            RecordRule::OptIn => self.record_opt_in,
            RecordRule::Never => false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use Verdict::*;

    /// One row per line of the design table: (outcome, verdict when idempotent, verdict when not,
    /// recorded by default, recorded when permanent failures are opted in).
    const DESIGN: &[(Outcome, Verdict, Verdict, bool, bool)] = &[
        (Outcome::Status(Code::Ok), Final, Final, true, true),
        (Outcome::Unsent, Retry, Retry, false, false),
        (Outcome::Ambiguous, Retry, Final, false, false),
        (
            Outcome::Status(Code::Unavailable),
            Retry,
            Final,
            false,
            false,
        ),
        (
            Outcome::Status(Code::ResourceExhausted),
            Retry,
            Retry,
            false,
            false,
        ),
        (
            Outcome::Status(Code::DeadlineExceeded),
            Retry,
            Final,
            false,
            false,
        ),
        (
            Outcome::Status(Code::Aborted),
            Rebuild,
            Rebuild,
            false,
            false,
        ),
        (Outcome::Status(Code::Internal), Final, Final, false, false),
        (Outcome::Status(Code::Unknown), Final, Final, false, false),
        (
            Outcome::Status(Code::InvalidArgument),
            Final,
            Final,
            false,
            true,
        ),
        (
            Outcome::Status(Code::Unauthenticated),
            Final,
            Final,
            false,
            true,
        ),
        (
            Outcome::Status(Code::PermissionDenied),
            Final,
            Final,
            false,
            true,
        ),
        (Outcome::Status(Code::NotFound), Final, Final, false, true),
        (
            Outcome::Status(Code::AlreadyExists),
            Final,
            Final,
            false,
            true,
        ),
        (Outcome::Status(Code::OutOfRange), Final, Final, false, true),
        (
            Outcome::Status(Code::FailedPrecondition),
            Final,
            Final,
            false,
            true,
        ),
        (
            Outcome::Status(Code::Unimplemented),
            Final,
            Final,
            false,
            true,
        ),
        (Outcome::Status(Code::DataLoss), Final, Final, false, false),
        (Outcome::Status(Code::Cancelled), Final, Final, false, false),
    ];

    #[test]
    fn the_design_table() {
        let t = RetryTable::default();
        let opted = t.record_permanent_failures(true);
        for &(outcome, idem, non_idem, rec, rec_opt) in DESIGN {
            assert_eq!(t.verdict(outcome, true), idem, "{outcome:?} idempotent");
            assert_eq!(
                t.verdict(outcome, false),
                non_idem,
                "{outcome:?} not idempotent"
            );
            assert_eq!(
                t.may_record(outcome.code()) && matches!(outcome, Outcome::Status(_)),
                rec,
                "{outcome:?}"
            );
            assert_eq!(
                opted.may_record(outcome.code()) && matches!(outcome, Outcome::Status(_)),
                rec_opt,
                "{outcome:?}"
            );
        }
    }

    #[test]
    fn ok_and_data_loss_cannot_be_made_retryable() {
        let t = RetryTable::default()
            .with_client_rule(Code::DataLoss, ClientRule::Always)
            .with_client_rule(Code::Ok, ClientRule::Always)
            .with_record_rule(Code::Ok, RecordRule::Never);
        assert_eq!(t.verdict(Outcome::Status(Code::DataLoss), true), Final);
        assert_eq!(t.verdict(Outcome::Status(Code::Ok), true), Final);
        assert!(t.may_record(Code::Ok));
    }

    #[test]
    fn allow_list_start_keeps_transport_rules() {
        let t = RetryTable::no_status_retries();
        assert_eq!(t.verdict(Outcome::Status(Code::Unavailable), true), Final);
        assert_eq!(t.verdict(Outcome::Unsent, false), Retry);
        assert_eq!(t.verdict(Outcome::Ambiguous, true), Retry);
    }
}
