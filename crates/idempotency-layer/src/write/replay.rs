//! The responses a duplicate gets: the record replayed byte for byte, or the failure of the
//! leader it waited for.

use http::header::{CONTENT_LENGTH, CONTENT_TYPE};
use http::{HeaderValue, Response};
use reason_code::{
    encode_grpc_message, Code, GRPC_MESSAGE, GRPC_STATUS, IDEMPOTENT_BODY_OMITTED,
    IDEMPOTENT_REPLAYED,
};

use crate::body::IdempotencyBody;
use crate::store::Record;

/// The answer of a duplicate whose leader failed without a record: the leader's own answer,
/// as it was (not marked as a replay: nothing was recorded).
pub(super) fn shared_failure<B>(answer: &Record) -> Response<IdempotencyBody<B>> {
    let mut res = Response::new(IdempotencyBody::replay(
        answer.body.clone(),
        answer.trailers.as_deref().cloned(),
    ));
    *res.status_mut() = answer.status;
    *res.headers_mut() = answer.headers.clone();
    if answer.body_omitted {
        // The body was not kept: its length no longer describes what is sent.
        res.headers_mut().remove(CONTENT_LENGTH);
    }
    res
}

/// The recorded response, for a duplicate (`grpc`: the request's protocol): clones of the head
/// the record's replays send ([`Record::replay_head`]) and of its body's `Bytes`.
pub(super) fn replay<B>(
    record: &Record,
    grpc: bool,
    max_record_bytes: usize,
) -> Response<IdempotencyBody<B>> {
    if record.body_omitted && grpc {
        return replay_without_message(record, max_record_bytes);
    }
    let mut res = Response::new(IdempotencyBody::replay(
        record.body.clone(),
        record.trailers.as_deref().cloned(),
    ));
    *res.status_mut() = record.status;
    *res.headers_mut() = record.replay_head().clone();
    res
}

/// The replay of a gRPC response whose message was too large to record: a gRPC client cannot use
/// an OK without its message (a unary call fails with INTERNAL "missing response message"), so
/// it gets a trailers-only ALREADY_EXISTS that says what happened: final, never retried.
pub(super) fn replay_without_message<B>(
    record: &Record,
    max_record_bytes: usize,
) -> Response<IdempotencyBody<B>> {
    let mut res = Response::new(IdempotencyBody::empty());
    let h = res.headers_mut();
    let content_type = record
        .headers
        .get(CONTENT_TYPE)
        .cloned()
        .unwrap_or_else(|| HeaderValue::from_static("application/grpc"));
    h.insert(CONTENT_TYPE, content_type);
    h.insert(
        GRPC_STATUS,
        HeaderValue::from_static(Code::AlreadyExists.as_header_str()),
    );
    h.insert(
        GRPC_MESSAGE,
        encode_grpc_message(&format!(
            "the call with this idempotency key was executed once; its response was larger than \
             the server's max_record_bytes ({max_record_bytes} bytes) and is not replayed: read \
             the result another way, or raise max_record_bytes"
        )),
    );
    h.insert(IDEMPOTENT_REPLAYED, HeaderValue::from_static("true"));
    h.insert(IDEMPOTENT_BODY_OMITTED, HeaderValue::from_static("true"));
    res
}
