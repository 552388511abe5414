//! Header maps for tests of code that reads a request's headers: every combination of some
//! candidate fields, in short maps and in long ones.

use http::{HeaderMap, HeaderName, HeaderValue};

/// Every subset of `candidates` (name, value), in order and appended (so a name given twice
/// holds two values), each alone and after 20 filler fields: a code path for few headers and
/// one for many both see every combination.
pub fn combinations(candidates: &[(&'static str, &'static str)]) -> Vec<HeaderMap> {
    let mut maps = Vec::new();
    for mask in 0u32..(1 << candidates.len()) {
        for filler in [0, 20] {
            let mut headers = HeaderMap::new();
            for i in 0..filler {
                headers.insert(
                    HeaderName::try_from(format!("x-filler-{i}")).expect("a valid name"),
                    HeaderValue::from_static("f"),
                );
            }
            for (i, (name, value)) in candidates.iter().enumerate() {
                if mask & (1 << i) != 0 {
                    headers.append(*name, HeaderValue::from_static(value));
                }
            }
            maps.push(headers);
        }
    }
    maps
}
