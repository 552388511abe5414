//! Derived idempotency keys: an outbound write made by a handler that is executing an inbound
//! write gets a key derived from that write, the same on every run of the handler.

use std::borrow::Cow;
use std::fmt;

use http::request::Parts;
use http::HeaderValue;
use reason_code::InboundWrite;

/// How the layer derives keys ([`RetryPolicyBuilder::derive_idempotency_keys`]): a secret
/// shared by every instance of the service, turned into a BLAKE3 key.
///
/// [`RetryPolicyBuilder::derive_idempotency_keys`]: crate::RetryPolicyBuilder::derive_idempotency_keys
#[derive(Clone)]
pub(crate) struct DerivedKeys {
    key: [u8; 32],
}

impl fmt::Debug for DerivedKeys {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("DerivedKeys { .. }")
    }
}

impl DerivedKeys {
    pub(crate) fn new(secret: &[u8]) -> Self {
        DerivedKeys {
            key: blake3::derive_key("retry-layer 2026 derived idempotency keys v1", secret),
        }
    }

    /// The key of the outbound write `parts`, when the current task runs the handler of an
    /// inbound write: a keyed hash of that write's scope, the call's target (its
    /// [`KeyLabel`], else its method, authority and path) and its place among the handler's
    /// calls to that target. `None` outside a handler.
    pub(crate) fn key_for(&self, parts: &Parts) -> Option<HeaderValue> {
        InboundWrite::with_current(|_| ())?;
        let target = match parts.extensions.get::<KeyLabel>() {
            Some(label) => format!("label {}", label.0),
            None => format!(
                "{} {}{}",
                parts.method,
                parts.uri.authority().map_or("", |a| a.as_str()),
                parts.uri.path()
            ),
        };
        let (scope, n) = InboundWrite::with_current(|w| (w.scope_bytes(), w.next_call(&target)))?;
        let mut hasher = blake3::Hasher::new_keyed(&self.key);
        hasher.update(&scope);
        hasher.update(&(target.len() as u64).to_le_bytes());
        hasher.update(target.as_bytes());
        hasher.update(&n.to_le_bytes());
        let hash = hasher.finalize();
        let hex = hash.to_hex();
        Some(HeaderValue::from_str(&hex[..32]).expect("hex is a valid header value"))
    }
}

/// The label of an outbound write, for its derived idempotency key (a request extension).
///
/// By default a derived key names its call by target (method, authority, path) and its place
/// among the handler's calls to that target, which is the same on every run of a handler that
/// makes its calls in the same order. A handler whose outbound calls depend on timing or
/// randomness (calls raced against each other, a target picked at random, a call made only
/// when a cache misses) labels them instead: each label names one call (or, used again, the
/// next call under that label).
///
/// ```
/// use retry_layer::KeyLabel;
///
/// let mut req = http::Request::post("http://inventory/deduct").body(()).unwrap();
/// req.extensions_mut().insert(KeyLabel::new("deduct-for-line-1"));
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KeyLabel(Cow<'static, str>);

impl KeyLabel {
    /// A label.
    pub fn new(label: impl Into<Cow<'static, str>>) -> Self {
        KeyLabel(label.into())
    }

    /// The label.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parts(uri: &str) -> Parts {
        http::Request::post(uri).body(()).unwrap().into_parts().0
    }

    /// Same scope, same calls in the same order: same keys. Another scope, another secret,
    /// another target or place: another key. Outside a handler: none.
    #[tokio::test]
    async fn keys_follow_the_scope_the_target_and_the_place() {
        let derive = DerivedKeys::new(b"secret");
        assert!(derive.key_for(&parts("http://inv/deduct")).is_none());
        let run = |scope: [u8; 32], derive: DerivedKeys| async move {
            InboundWrite::new(scope)
                .scope(async move {
                    let mut labelled = parts("http://inv/deduct");
                    labelled.extensions.insert(KeyLabel::new("line-1"));
                    [
                        derive.key_for(&parts("http://inv/deduct")).unwrap(),
                        derive.key_for(&parts("http://inv/deduct")).unwrap(),
                        derive.key_for(&parts("http://pay/charge")).unwrap(),
                        derive.key_for(&labelled).unwrap(),
                    ]
                })
                .await
        };
        let first = run([1; 32], derive.clone()).await;
        assert_eq!(first, run([1; 32], derive.clone()).await, "deterministic");
        let mut all: Vec<_> = first.to_vec();
        all.extend(run([2; 32], derive.clone()).await);
        all.extend(run([1; 32], DerivedKeys::new(b"other secret")).await);
        let distinct: std::collections::HashSet<_> = all.iter().collect();
        assert_eq!(
            distinct.len(),
            all.len(),
            "every other input makes another key"
        );
        assert!(first.iter().all(|k| k.len() == 32));
    }
}
