//! What a write does with what the store's `begin` found: a pure function of that answer and
//! the write's settings, tested as a table. The write's flow (`write.rs`) carries it out.

use std::borrow::Cow;
use std::sync::Arc;

use crate::config::InFlight;
use crate::observe::WriteOutcome;
use crate::reject::RejectReason;
use crate::store::{Begin, Fingerprint, Record, StoreError, Token};

/// What the write knows when `begin` answers.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Asking {
    /// This request's fingerprint.
    pub(crate) fingerprint: Fingerprint,
    /// It has waited for a request in flight already (its replay is then a wait's).
    pub(crate) waited: bool,
    /// What a duplicate does while another request holds the key.
    pub(crate) in_flight: InFlight,
    /// Execute without a claim when the store is down.
    pub(crate) fail_open: bool,
    /// A write with this key is known to be in flight: a claim of this process holds the scope
    /// (the renewals know every claim the layer holds), or the client says an earlier attempt
    /// of this call was told so (`idempotency-seen-in-flight`). Looked up only when the store
    /// failed and the layer fails open.
    pub(crate) known_in_flight: bool,
}

/// The next step of a write.
#[derive(Debug)]
pub(crate) enum Next {
    /// The scope was free and is now this request's: run the handler as its leader.
    Lead(Token),
    /// The scope has a record of this very request: replay it.
    Replay(Arc<Record>, WriteOutcome),
    /// Another request with this fingerprint holds the scope: wait for it, then ask again.
    Wait(Token),
    /// Answer with a rejection; nothing runs.
    Reject(RejectReason, Cow<'static, str>),
    /// The store is down and the layer fails open: run the handler without a claim.
    ExecuteUnprotected,
}

pub(crate) const MISMATCH: &str = "this idempotency key was used with a different request \
                                   (method, path, query, content type or body); use a new key \
                                   for a new request";
pub(crate) const IN_FLIGHT: &str =
    "a request with this idempotency key is in flight; retry after it completes";
pub(crate) const STORE_FULL: &str = "the idempotency store has no room for a new request now; \
                                     nothing was executed, retry later";
pub(crate) const STORE_DOWN: &str =
    "idempotency store unavailable; nothing was executed, retry later";

/// What a write does with what `begin` found (`found`), given what it knows (`asking`).
///
/// | `begin` found | then |
/// |---|---|
/// | the scope free (`New`) | lead |
/// | a record of another request | reject: the key was reused (422) |
/// | a record of this request | replay (as a wait's if this request waited) |
/// | a claim of another request | reject: the key was reused (422) |
/// | a claim of this request, `InFlight::Reject` | reject: in flight (409) |
/// | a claim of this request, `InFlight::Wait` | wait for it |
/// | a corrupt entry | reject (500): retrying cannot help, running could run twice; never fail open |
/// | no room (`Full`) | reject (503): the store is up; never fail open |
/// | the store failing, a write with this key known in flight (this request waited on it, a claim of this process holds it, or the client was told so) | reject (503); never fail open |
/// | the store failing | fail open if set, else reject (503) |
pub(crate) fn after_begin(found: Result<Begin, StoreError>, asking: &Asking) -> Next {
    match found {
        Ok(Begin::New(token)) => Next::Lead(token),
        Ok(Begin::Completed(record)) if record.fingerprint != asking.fingerprint => {
            Next::Reject(RejectReason::Mismatch, MISMATCH.into())
        }
        Ok(Begin::Completed(record)) => Next::Replay(
            record,
            if asking.waited {
                WriteOutcome::Waited
            } else {
                WriteOutcome::Replayed
            },
        ),
        Ok(Begin::InFlight { fingerprint, .. }) if fingerprint != asking.fingerprint => {
            Next::Reject(RejectReason::Mismatch, MISMATCH.into())
        }
        Ok(Begin::InFlight { token, .. }) => match asking.in_flight {
            InFlight::Reject => Next::Reject(RejectReason::InFlight, IN_FLIGHT.into()),
            InFlight::Wait => Next::Wait(token),
        },
        Err(StoreError::Corrupt(_)) => Next::Reject(
            RejectReason::Internal,
            "the stored record of this idempotency key cannot be read (a corrupt entry); \
             nothing was executed: use a new key, or have an operator forget this one"
                .into(),
        ),
        Err(StoreError::Full) => Next::Reject(RejectReason::StoreFull, STORE_FULL.into()),
        // Fail-open is for "we cannot know whether this ran": a request that has waited on its
        // key, whose process holds a claim on it, or whose call was told it is in flight, knows
        // a write for it may run, so it never runs unprotected.
        Err(_) if asking.fail_open && !asking.waited && !asking.known_in_flight => {
            Next::ExecuteUnprotected
        }
        Err(_) => Next::Reject(RejectReason::StoreUnavailable, STORE_DOWN.into()),
    }
}

#[cfg(test)]
mod tests {
    use bytes::Bytes;
    use http::{HeaderMap, StatusCode};

    use super::*;

    const OURS: Fingerprint = Fingerprint([1; 32]);
    const THEIRS: Fingerprint = Fingerprint([2; 32]);
    const TOKEN: Token = Token(7);

    fn record(fingerprint: Fingerprint) -> Begin {
        Begin::Completed(Arc::new(Record::new(
            fingerprint,
            StatusCode::CREATED,
            HeaderMap::new(),
            Bytes::from_static(b"order 1"),
        )))
    }

    fn in_flight(fingerprint: Fingerprint) -> Begin {
        Begin::InFlight {
            token: TOKEN,
            fingerprint,
        }
    }

    /// What a [`Next`] is, in one comparable word.
    fn step(next: &Next) -> String {
        match next {
            Next::Lead(t) => format!("lead {}", t.0),
            Next::Replay(r, o) => format!("replay {} {o:?}", r.status().as_u16()),
            Next::Wait(t) => format!("wait {}", t.0),
            Next::Reject(reason, _) => format!("reject {}", reason.as_str()),
            Next::ExecuteUnprotected => "execute unprotected".to_owned(),
        }
    }

    macro_rules! table {
        ($($name:ident: $found:expr, waited $waited:literal, $mode:ident, fail_open $open:literal $(, known_in_flight $known:literal)? => $want:literal;)*) => {$(
            #[test]
            fn $name() {
                let asking = Asking {
                    fingerprint: OURS,
                    waited: $waited,
                    known_in_flight: false $(|| $known)?,
                    in_flight: InFlight::$mode,
                    fail_open: $open,
                };
                assert_eq!(step(&after_begin($found, &asking)), $want);
            }
        )*};
    }

    table! {
        a_free_scope_is_led: Ok(Begin::New(TOKEN)), waited false, Wait, fail_open false => "lead 7";
        a_free_scope_after_a_wait_is_led: Ok(Begin::New(TOKEN)), waited true, Wait, fail_open true => "lead 7";
        a_record_of_this_request_is_replayed: Ok(record(OURS)), waited false, Wait, fail_open false => "replay 201 Replayed";
        a_record_found_after_a_wait_is_a_waits_replay: Ok(record(OURS)), waited true, Wait, fail_open false => "replay 201 Waited";
        a_record_of_another_request_is_a_reused_key: Ok(record(THEIRS)), waited false, Wait, fail_open true => "reject mismatch";
        a_claim_of_this_request_is_waited_for: Ok(in_flight(OURS)), waited false, Wait, fail_open false => "wait 7";
        a_claim_is_waited_for_again_after_a_wake: Ok(in_flight(OURS)), waited true, Wait, fail_open false => "wait 7";
        a_claim_in_reject_mode_is_refused: Ok(in_flight(OURS)), waited false, Reject, fail_open true => "reject in_flight";
        a_claim_of_another_request_is_a_reused_key: Ok(in_flight(THEIRS)), waited false, Wait, fail_open false => "reject mismatch";
        a_claim_of_another_request_in_reject_mode_is_a_reused_key: Ok(in_flight(THEIRS)), waited false, Reject, fail_open false => "reject mismatch";
        a_corrupt_entry_is_refused: Err(StoreError::Corrupt("x".into())), waited false, Wait, fail_open false => "reject internal";
        a_corrupt_entry_never_fails_open: Err(StoreError::Corrupt("x".into())), waited false, Wait, fail_open true => "reject internal";
        a_full_store_is_refused: Err(StoreError::Full), waited false, Wait, fail_open false => "reject store_full";
        a_full_store_never_fails_open: Err(StoreError::Full), waited false, Wait, fail_open true => "reject store_full";
        a_store_down_fails_closed: Err(StoreError::Backend("down".into())), waited false, Wait, fail_open false => "reject store_unavailable";
        a_store_down_fails_open_when_set: Err(StoreError::Backend("down".into())), waited false, Wait, fail_open true => "execute unprotected";
        a_waiter_never_fails_open: Err(StoreError::Backend("down".into())), waited true, Wait, fail_open true => "reject store_unavailable";
        a_write_known_in_flight_never_fails_open: Err(StoreError::Backend("down".into())), waited false, Wait, fail_open true, known_in_flight true => "reject store_unavailable";
        a_fenced_begin_is_the_store_failing: Err(StoreError::Fenced), waited true, Wait, fail_open false => "reject store_unavailable";
    }
}
