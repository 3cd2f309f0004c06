//! What the server's answers mean: conflicts by API error code, reads and message headers.

use async_nats::jetstream;
use bytes::Bytes;

/// Conflict: wrong last sequence.
pub(crate) const WRONG_LAST_SEQUENCE: u64 = 10071;
/// Conflict as reported by clustered streams.
pub(crate) const CLUSTERED_CONFLICT: u64 = 10164;
/// Invalid per-message TTL.
pub(crate) const INVALID_TTL: u64 = 10165;
/// Per-message TTL on a stream that does not allow it.
pub(crate) const TTL_NOT_ALLOWED: u64 = 10166;
/// The account is at a JetStream limit (its storage, on a publish).
pub(crate) const ACCOUNT_RESOURCES: u64 = 10002;
/// The account holds its maximum number of consumers.
pub(crate) const MAX_CONSUMERS: u64 = 10026;
/// The stream refused to store a message; its description says why ("maximum bytes exceeded":
/// the bucket is at its bound).
pub(crate) const STORE_FAILED: u64 = 10077;

/// The latest message of a key: its value, revision, and whether it is a live value (not a
/// delete, purge or expiry marker).
pub(crate) struct Latest {
    pub(crate) value: Bytes,
    pub(crate) revision: u64,
    pub(crate) live: bool,
}

/// The JetStream API error code anywhere in an error's source chain.
pub(crate) fn api_code(err: &(dyn std::error::Error + 'static)) -> Option<u64> {
    let mut cur = Some(err);
    while let Some(e) = cur {
        if let Some(js) = e.downcast_ref::<jetstream::Error>() {
            return Some(js.error_code().0);
        }
        cur = e.source();
    }
    None
}

/// What a KV message is, from its headers: the one decoder of `KV-Operation` and
/// `Nats-Marker-Reason` for reads and watches.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum MessageKind {
    /// A value.
    Value,
    /// A delete or purge (with or without a marker TTL).
    Deleted,
    /// A limit marker: the key's TTL ran out.
    Expired,
}

impl MessageKind {
    pub(crate) fn of(headers: Option<&async_nats::HeaderMap>) -> MessageKind {
        let op = headers.and_then(|h| h.get("KV-Operation")).map(|v| v.as_str());
        let marker = headers.and_then(|h| h.get("Nats-Marker-Reason")).is_some();
        match op {
            Some("DEL") | Some("PURGE") => MessageKind::Deleted,
            _ if marker => MessageKind::Expired,
            _ => MessageKind::Value,
        }
    }
}
