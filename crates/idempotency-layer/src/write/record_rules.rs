//! What of a handler's response is recorded: the one set of rules that the streaming recorder
//! ([`ResponseRecorder`](crate::write::recorder::ResponseRecorder)) and transactional completion (`TxCompletion`, feature
//! `postgres`) both follow, so a record is the same bytes whichever of them stored it.

use bytes::{Bytes, BytesMut};
use http::{HeaderMap, StatusCode};
use http_body::Frame;
use reason_code::Code;

use crate::classify;
use crate::config::Config;
use crate::protocol::is_grpc_web;
use crate::store::{Fingerprint, Record};

/// What a response's head says about recording it.
pub(crate) enum AtHead {
    /// The head decided a code the table does not record (a 503, a 409, ...): the claim is
    /// released, the body passes through unrecorded.
    NotRecordable(Code),
    /// Record the body as it comes; the code is the head's (`Some`) or comes at the end
    /// (`None`: gRPC trailers, a gRPC-Web trailers frame).
    Record(Option<Code>),
}

/// Classifies a response's head (`grpc`: the request's protocol) and asks the table.
pub(crate) fn at_head(cfg: &Config, grpc: bool, status: StatusCode, headers: &HeaderMap) -> AtHead {
    match classify::at_head(&cfg.reasons, grpc, status, headers) {
        Some(code) if !cfg.table.may_record(code) => AtHead::NotRecordable(code),
        head_code => AtHead::Record(head_code),
    }
}

/// How a response that ended turned out ([`RecordBuilder::finish`]).
pub(crate) enum Finished {
    /// Its record, to store.
    Recorded(Record),
    /// Its code, which the table does not record, and the response as it was (for the
    /// duplicates waiting for it).
    NotRecorded(Code, Record),
}

/// Builds the record of one response from its frames, in order: the body is kept up to
/// `max_record_bytes` (beyond, it is omitted and the record says so), trailers are merged, and
/// the code the head left open is read at the end.
pub(crate) struct RecordBuilder {
    fingerprint: Fingerprint,
    status: StatusCode,
    headers: HeaderMap,
    max_record_bytes: usize,
    data: BytesMut,
    omitted: bool,
    trailers: Option<HeaderMap>,
    /// For gRPC-Web: the last data frame, where the trailers frame is (used when the body is too
    /// large to keep).
    last_chunk: Option<Bytes>,
    grpc_web: bool,
    /// The code the head decided (a reason code, a trailers-only gRPC status, an HTTP status);
    /// `None` when the status comes at the end (gRPC trailers, a gRPC-Web trailers frame).
    head_code: Option<Code>,
}

impl RecordBuilder {
    /// `head_code`: what [`at_head`] decided ([`AtHead::Record`]).
    pub(crate) fn new(
        fingerprint: Fingerprint,
        status: StatusCode,
        headers: HeaderMap,
        head_code: Option<Code>,
        max_record_bytes: usize,
    ) -> Self {
        let grpc_web = head_code.is_none() && is_grpc_web(&headers);
        RecordBuilder {
            fingerprint,
            status,
            headers,
            max_record_bytes,
            data: BytesMut::new(),
            omitted: false,
            trailers: None,
            last_chunk: None,
            grpc_web,
            head_code,
        }
    }

    /// Takes one frame of the body into the record.
    pub(crate) fn observe(&mut self, frame: &Frame<Bytes>) {
        if let Some(d) = frame.data_ref() {
            if self.grpc_web && !d.is_empty() {
                self.last_chunk = Some(d.clone());
            }
            if !self.omitted {
                if self.data.len() + d.len() > self.max_record_bytes {
                    self.omitted = true;
                    self.data = BytesMut::new();
                } else {
                    self.data.extend_from_slice(d);
                }
            }
        } else if let Some(t) = frame.trailers_ref() {
            match &mut self.trailers {
                Some(all) => all.extend(t.clone()),
                None => self.trailers = Some(t.clone()),
            }
        }
    }

    /// The trailers seen so far, merged (transactional completion sends them as well as
    /// recording them).
    #[cfg(feature = "postgres")]
    pub(crate) fn trailers(&self) -> Option<&http::HeaderMap> {
        self.trailers.as_ref()
    }

    /// The body has ended: the record, if the table records the response's code; else the code
    /// and the response as it was (the claim is then released, and the duplicates waiting for
    /// it get that response).
    pub(crate) fn finish(self, cfg: &Config) -> Finished {
        let kept: &[u8] = match (&self.last_chunk, self.omitted) {
            (Some(last), true) => last,
            _ => &self.data,
        };
        let code = self
            .head_code
            .unwrap_or_else(|| classify::at_end(&self.headers, self.trailers.as_ref(), kept));
        let record = self.into_record(cfg);
        if cfg.table.may_record(code) {
            Finished::Recorded(record)
        } else {
            Finished::NotRecorded(code, record)
        }
    }

    /// The body broke off before its end (an error, the claim's lifetime, no room left to read
    /// it for a client that went away): a record without its body if the head already decided
    /// an outcome the table records (the handler answered a 2xx, say: its side effect happened,
    /// and a retry must not run it again); `None` when the outcome was to come at the end
    /// (a gRPC status in trailers), which it now never will.
    pub(crate) fn broken(self, cfg: &Config) -> Option<Record> {
        let code = self.head_code?;
        if !cfg.table.may_record(code) {
            return None;
        }
        Some(self.into_record(cfg).with_body_omitted())
    }

    /// The record, its headers filtered by [`recorded_headers`](Config::recorded_headers).
    fn into_record(self, cfg: &Config) -> Record {
        let mut headers = self.headers;
        cfg.recorded_headers.filter(&mut headers);
        Record {
            fingerprint: self.fingerprint,
            status: self.status,
            headers,
            body: self.data.freeze(),
            body_omitted: self.omitted,
            trailers: self.trailers.map(Box::new),
            replay_head: Default::default(),
        }
    }
}
