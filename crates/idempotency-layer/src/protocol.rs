//! Which protocol a request speaks (plain HTTP, gRPC, gRPC-Web), and reading a gRPC-Web
//! response's status from its body.
//!
//! gRPC-Web (`application/grpc-web`, `application/grpc-web+proto`,
//! `application/grpc-web-text`, ...) is gRPC for browsers: the status travels in the response
//! headers of a trailers-only response, or else in a trailers frame at the end of the body
//! (flag `0x80`), base64-encoded with the rest of the body in the `-text` variants. Without
//! reading it, a gRPC-Web error would be recorded as an HTTP 200 success.

use base64::Engine;
use http::header::CONTENT_TYPE;
use http::{HeaderMap, HeaderValue};
use reason_code::Code;

/// The protocol of a request, which decides how the layer answers it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Protocol {
    Http,
    Grpc,
    /// gRPC-Web; rejections are answered with the request's own content type.
    GrpcWeb(HeaderValue),
}

impl Protocol {
    pub(crate) fn of(headers: &HeaderMap) -> Protocol {
        match headers.get(CONTENT_TYPE) {
            // What `reason_code::is_grpc` checks, with the one lookup.
            Some(ct) if has_media_type(ct.as_bytes(), b"application/grpc") => Protocol::Grpc,
            Some(ct) if is_grpc_web_content_type(ct.as_bytes()) => Protocol::GrpcWeb(ct.clone()),
            _ => Protocol::Http,
        }
    }

    /// gRPC or gRPC-Web: answered with `grpc-status`, scoped by the gRPC path.
    pub(crate) fn is_grpc(&self) -> bool {
        !matches!(self, Protocol::Http)
    }
}

fn is_grpc_web_content_type(b: &[u8]) -> bool {
    has_media_type(b, b"application/grpc-web") || is_text_variant(b)
}

fn is_text_variant(b: &[u8]) -> bool {
    has_media_type(b, b"application/grpc-web-text")
}

/// `b` is `media_type`, alone or followed by `+subtype` or `;parameters`.
fn has_media_type(b: &[u8], media_type: &[u8]) -> bool {
    b.len() >= media_type.len()
        && b[..media_type.len()].eq_ignore_ascii_case(media_type)
        && matches!(b.get(media_type.len()), None | Some(b'+') | Some(b';'))
}

/// True when response headers say gRPC-Web (any variant).
pub(crate) fn is_grpc_web(headers: &HeaderMap) -> bool {
    headers
        .get(CONTENT_TYPE)
        .is_some_and(|ct| is_grpc_web_content_type(ct.as_bytes()))
}

/// The `grpc-status` in the trailers frame of a gRPC-Web response body, if one can be read.
///
/// `body` is the whole body, or (when the body was too large to keep) its last data frame,
/// which is where servers put the trailers frame.
pub(crate) fn grpc_web_status(headers: &HeaderMap, body: &[u8]) -> Option<Code> {
    let text = headers
        .get(CONTENT_TYPE)
        .is_some_and(|ct| is_text_variant(ct.as_bytes()));
    let decoded;
    let mut frames: &[u8] = if text {
        decoded = decode_text(body)?;
        &decoded
    } else {
        body
    };
    while frames.len() >= 5 {
        let flag = frames[0];
        let len = u32::from_be_bytes([frames[1], frames[2], frames[3], frames[4]]) as usize;
        let payload = frames.get(5..5usize.checked_add(len)?)?;
        if flag & 0x80 != 0 {
            return trailer_status(payload);
        }
        frames = &frames[5 + len..];
    }
    None
}

/// Decodes a `grpc-web-text` body: base64 chunks, each padded on its own, one after another.
fn decode_text(body: &[u8]) -> Option<Vec<u8>> {
    let engine = base64::engine::general_purpose::STANDARD;
    let clean: Vec<u8> = body
        .iter()
        .copied()
        .filter(|b| !b.is_ascii_whitespace())
        .collect();
    let mut out = Vec::with_capacity(clean.len() / 4 * 3);
    let mut rest = &clean[..];
    while !rest.is_empty() {
        // A chunk ends after its padding, or at the end of the body.
        let end = match rest.iter().position(|&b| b == b'=') {
            Some(i) => {
                let pad = rest[i..].iter().take_while(|&&b| b == b'=').count();
                i + pad
            }
            None => rest.len(),
        };
        engine.decode_vec(&rest[..end], &mut out).ok()?;
        rest = &rest[end..];
    }
    Some(out)
}

/// `grpc-status` from a trailers frame's payload (`name:value` lines separated by CRLF).
fn trailer_status(payload: &[u8]) -> Option<Code> {
    for line in payload.split(|&b| b == b'\n') {
        let line = line.strip_suffix(b"\r").unwrap_or(line);
        let Some(colon) = line.iter().position(|&b| b == b':') else {
            continue;
        };
        let (name, value) = (&line[..colon], &line[colon + 1..]);
        if name.trim_ascii().eq_ignore_ascii_case(b"grpc-status") {
            let value = HeaderValue::from_bytes(value.trim_ascii()).ok()?;
            return Some(reason_code::parse_grpc_status(&value).unwrap_or(Code::Unknown));
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(ct: &'static str) -> HeaderMap {
        let mut h = HeaderMap::new();
        h.insert(CONTENT_TYPE, HeaderValue::from_static(ct));
        h
    }

    fn frame(flag: u8, payload: &[u8]) -> Vec<u8> {
        let mut f = vec![flag];
        f.extend_from_slice(&(payload.len() as u32).to_be_bytes());
        f.extend_from_slice(payload);
        f
    }

    #[test]
    fn protocols() {
        assert_eq!(Protocol::of(&headers("application/grpc")), Protocol::Grpc);
        assert_eq!(
            Protocol::of(&headers("application/grpc+proto")),
            Protocol::Grpc
        );
        for ct in [
            "application/grpc-web",
            "application/grpc-web+proto",
            "application/grpc-web-text",
            "application/grpc-web-text+proto",
            "Application/GRPC-Web; charset=utf-8",
        ] {
            assert!(
                matches!(Protocol::of(&headers(ct)), Protocol::GrpcWeb(_)),
                "{ct}"
            );
            assert!(Protocol::of(&headers(ct)).is_grpc());
        }
        for ct in [
            "application/json",
            "application/grpc-webby",
            "application/grpc-web-texts",
            "application/grpcx",
        ] {
            assert_eq!(Protocol::of(&headers(ct)), Protocol::Http, "{ct}");
        }
        assert_eq!(Protocol::of(&HeaderMap::new()), Protocol::Http);
    }

    #[test]
    fn status_from_the_trailers_frame() {
        let mut body = frame(0, b"\x08\x01");
        body.extend(frame(
            0x80,
            b"grpc-status:5\r\ngrpc-message:no such book\r\n",
        ));
        let h = headers("application/grpc-web+proto");
        assert_eq!(grpc_web_status(&h, &body), Some(Code::NotFound));
        // Only the last data frame kept: it starts with the trailers frame.
        let tail = frame(0x80, b"GRPC-STATUS: 0\r\n");
        assert_eq!(grpc_web_status(&h, &tail), Some(Code::Ok));
        // No trailers frame, garbage, truncated: unknown (not recorded as a success).
        assert_eq!(grpc_web_status(&h, &frame(0, b"x")), None);
        assert_eq!(grpc_web_status(&h, b"\x80\xff\xff\xff\xffabc"), None);
        assert_eq!(grpc_web_status(&h, b""), None);
        assert_eq!(
            grpc_web_status(&h, &frame(0x80, b"grpc-status:many\r\n")),
            Some(Code::Unknown)
        );
    }

    #[test]
    fn status_from_a_text_body_in_separately_padded_chunks() {
        let engine = base64::engine::general_purpose::STANDARD;
        let mut body = engine.encode(frame(0, b"\x08\x01\x02")).into_bytes();
        body.extend(
            engine
                .encode(frame(0x80, b"grpc-status:14\r\n"))
                .into_bytes(),
        );
        let h = headers("application/grpc-web-text+proto");
        assert_eq!(grpc_web_status(&h, &body), Some(Code::Unavailable));
        assert_eq!(grpc_web_status(&h, b"!!!not base64"), None);
    }
}
