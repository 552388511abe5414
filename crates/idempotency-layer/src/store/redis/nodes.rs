//! What a Redis URL names and what its nodes say: the node URLs of a cluster or Sentinel URL, and
//! whether the nodes' `maxmemory-policy` can evict the store's keys.

use redis::Value;

use crate::store::StoreError;

/// True for a `maxmemory-policy` under which Redis may evict this store's keys (every policy
/// but `noeviction`): an evicted claim lets a duplicate execute, an evicted record lets a retry
/// execute again.
pub fn maxmemory_policy_can_evict(policy: &str) -> bool {
    !policy.eq_ignore_ascii_case("noeviction")
}

/// The base scheme (`redis` or `rediss`) and the rest of a `redis{suffix}://...` or
/// `rediss{suffix}://...` URL; `None` for any other scheme.
pub(super) fn multi_node_url<'a>(url: &'a str, suffix: &str) -> Option<(&'a str, &'a str)> {
    let (scheme, rest) = url.split_once("://")?;
    let base = scheme.strip_suffix(suffix)?;
    (base == "redis" || base == "rediss").then_some((base, rest))
}

/// The node URLs of a comma-separated `host:port` list, each given the scheme `base` unless it
/// has one of its own.
pub(super) fn node_urls(base: &str, list: &str) -> Vec<String> {
    list.split(',')
        .map(str::trim)
        .filter(|n| !n.is_empty())
        .map(|n| {
            if n.contains("://") {
                n.to_owned()
            } else {
                format!("{base}://{n}")
            }
        })
        .collect()
}

/// What the `CONFIG GET maxmemory-policy` replies of `(node, reply)` say: the policy (an
/// evicting one if any node has one; logged), or, with `require`, an error when a policy can
/// evict or cannot be read.
pub(super) fn judge_maxmemory_policies(
    replies: Vec<(String, Value)>,
    require: bool,
) -> Result<Option<String>, StoreError> {
    let mut policy = None;
    for (node, reply) in replies {
        match policy_in(&reply) {
            None => {
                let refusal = format!(
                    "cannot read maxmemory-policy on {node} (CONFIG is not allowed?); make sure \
                     it is noeviction, or records and claims may be evicted early"
                );
                if require {
                    return Err(StoreError::Config(format!(
                        "{refusal}. require_noeviction is on, so the store refuses to start: \
                         allow CONFIG GET for this user, or check the policy yourself and turn \
                         require_noeviction off"
                    )));
                }
                tracing::info!("idempotency: {refusal}");
            }
            Some(p) if maxmemory_policy_can_evict(&p) => {
                if require {
                    return Err(StoreError::Config(format!(
                        "{node} has maxmemory-policy {p}, which can evict this store's keys (an \
                         evicted claim lets a duplicate execute, an evicted record lets a retry \
                         execute again); require_noeviction is on, so the store refuses to \
                         start: run CONFIG SET maxmemory-policy noeviction on every node (and in \
                         its config file)"
                    )));
                }
                tracing::error!(
                    %node,
                    maxmemory_policy = %p,
                    "idempotency: redis maxmemory-policy can evict this store's keys: under memory \
                     pressure an evicted claim lets a duplicate execute, an evicted record lets a \
                     retry execute again. Set `maxmemory-policy noeviction` (writes then fail \
                     closed with 503 when Redis is full), or give Redis room for \
                     writes/s x TTL x record size"
                );
                policy = Some(p);
            }
            Some(p) => {
                policy.get_or_insert(p);
            }
        }
    }
    Ok(policy)
}

/// The policy in a `CONFIG GET maxmemory-policy` reply (`[name, value]`, or a map in RESP3);
/// `None` for an error reply or anything else.
pub(super) fn policy_in(reply: &Value) -> Option<String> {
    match reply {
        Value::Array(items) if items.len() == 2 => Some(value_text(&items[1])),
        Value::Map(pairs) if pairs.len() == 1 => Some(value_text(&pairs[0].1)),
        _ => None,
    }
}

pub(super) fn value_text(v: &Value) -> String {
    match v {
        Value::BulkString(b) => String::from_utf8_lossy(b).into_owned(),
        Value::SimpleString(s) => s.clone(),
        Value::VerbatimString { text, .. } => text.clone(),
        other => format!("{other:?}"),
    }
}
