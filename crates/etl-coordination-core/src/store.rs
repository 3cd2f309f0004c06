//! The store vocabulary shared by the core and every backend: keys, entries, watch events,
//! requests, replies and the classified error (S1, S2).
//!
//! These are plain comparable data so that a run of the core is a replayable list of inputs.

use std::fmt;
use std::time::Duration;

use bytes::Bytes;

use crate::ids::Revision;

/// Longest accepted key, in bytes.
pub const MAX_KEY_LEN: usize = 512;

/// A key was rejected by [`Key::new`] or [`Prefix::new`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid store key {key:?}: {rule}")]
pub struct KeyError {
    /// The rejected key.
    pub key: String,
    /// The rule it broke.
    pub rule: &'static str,
}

fn validate_tokens(key: &str, allow_trailing_dot: bool) -> Result<(), KeyError> {
    let err = |rule| KeyError { key: key.to_owned(), rule };
    if key.len() > MAX_KEY_LEN {
        return Err(err("must be at most 512 bytes"));
    }
    if !key.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'/' | b'_' | b'=' | b'.')) {
        return Err(err("may contain only [-/_=.a-zA-Z0-9]"));
    }
    if key.starts_with('.') {
        return Err(err("must not start with a dot"));
    }
    let body = if allow_trailing_dot { key.strip_suffix('.').unwrap_or(key) } else { key };
    if body.ends_with('.') {
        return Err(err("must not end with a dot"));
    }
    if body.contains("..") {
        return Err(err("must not contain an empty segment (\"..\")"));
    }
    Ok(())
}

/// A validated store key: `[-/_=.a-zA-Z0-9]+`, no leading or trailing dot, no empty segment.
/// Dots separate segments; prefixes ([`Prefix`]) match whole leading segments.
#[derive(Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Key(String);

impl Key {
    /// Validates `key`.
    pub fn new(key: impl Into<String>) -> Result<Self, KeyError> {
        let key = key.into();
        if key.is_empty() {
            return Err(KeyError { key, rule: "must not be empty" });
        }
        validate_tokens(&key, false)?;
        Ok(Key(key))
    }

    /// The key as a string slice.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for Key {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl fmt::Debug for Key {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:?}", self.0)
    }
}

/// A watch/list scope: either every key (empty prefix) or the keys whose leading segments are
/// the prefix's (a prefix always ends with a dot, e.g. `split.`). Segment prefixes are what a
/// subject-based store (NATS) can filter natively.
#[derive(Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Debug)]
pub struct Prefix(String);

impl Prefix {
    /// Every key of the bucket.
    pub fn all() -> Self {
        Prefix(String::new())
    }

    /// Validates `prefix`: empty, or key segments followed by a trailing dot.
    pub fn new(prefix: impl Into<String>) -> Result<Self, KeyError> {
        let prefix = prefix.into();
        if prefix.is_empty() {
            return Ok(Prefix(prefix));
        }
        if !prefix.ends_with('.') {
            return Err(KeyError { key: prefix, rule: "a prefix must be empty or end with a dot" });
        }
        validate_tokens(&prefix, true)?;
        Ok(Prefix(prefix))
    }

    /// The prefix as a string slice (empty or ending with a dot).
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// Whether `key` lies under this prefix.
    pub fn matches(&self, key: &Key) -> bool {
        key.as_str().starts_with(&self.0)
    }
}

/// A live value read from the store.
#[derive(Clone, PartialEq, Eq, Debug)]
pub struct Entry {
    /// The key.
    pub key: Key,
    /// The value bytes.
    pub value: Bytes,
    /// The revision of the write that produced this value.
    pub revision: Revision,
}

/// Why a key disappeared.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
#[non_exhaustive]
pub enum DeleteCause {
    /// A guarded delete.
    Deleted,
    /// Its TTL ran out (S3).
    Expired,
}

/// One event of a prefix watch. A watch first delivers every current value under the prefix,
/// then [`WatchEvent::SnapshotComplete`], then changes in revision order.
#[derive(Clone, PartialEq, Eq, Debug)]
pub enum WatchEvent {
    /// A value was written (or is current, during the snapshot).
    Put(Entry),
    /// A key was deleted or expired; `revision` is the revision of the deletion.
    Delete {
        /// The deleted key.
        key: Key,
        /// The revision of the delete (higher than the revision of the value it removed).
        revision: Revision,
        /// Guarded delete or TTL expiry.
        cause: DeleteCause,
    },
    /// The initial snapshot has been delivered in full.
    SnapshotComplete,
}

impl WatchEvent {
    /// The key a put or delete is about (`None` for [`WatchEvent::SnapshotComplete`]).
    pub fn key(&self) -> Option<&Key> {
        match self {
            WatchEvent::Put(e) => Some(&e.key),
            WatchEvent::Delete { key, .. } => Some(key),
            WatchEvent::SnapshotComplete => None,
        }
    }
}

/// The two key spaces of a job. In NATS they are two buckets; only the lease bucket carries TTLs.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Debug)]
pub enum Bucket {
    /// Durable records: meta, plan head, manifest chunks, descriptors, split records.
    State,
    /// TTL'd keys: leader, presence, split leases.
    Lease,
}

/// One store primitive, as an action of the core (S1).
#[derive(Clone, PartialEq, Eq, Debug)]
pub enum StoreRequest {
    /// Create-if-absent, with an optional TTL.
    Create {
        /// Key to create.
        key: Key,
        /// Value.
        value: Bytes,
        /// Time to live; `None` is permanent.
        ttl: Option<Duration>,
    },
    /// Update expecting `expected` to be the key's current revision, with an optional TTL
    /// (a CAS with a TTL is a heartbeat: it replaces the previous TTL).
    CompareAndSwap {
        /// Key to update.
        key: Key,
        /// Revision the key must currently have.
        expected: Revision,
        /// New value.
        value: Bytes,
        /// Time to live; `None` is permanent.
        ttl: Option<Duration>,
    },
    /// Delete guarded by the expected current revision.
    Delete {
        /// Key to delete.
        key: Key,
        /// Revision the key must currently have.
        expected: Revision,
    },
    /// Point read.
    Get {
        /// Key to read.
        key: Key,
    },
    /// Every live entry under a prefix.
    List {
        /// Scope.
        prefix: Prefix,
    },
}

impl StoreRequest {
    /// Whether this request writes.
    pub fn is_write(&self) -> bool {
        matches!(self, Self::Create { .. } | Self::CompareAndSwap { .. } | Self::Delete { .. })
    }

    /// The operation's name, as used in the `op` metric label.
    pub fn op_name(&self) -> &'static str {
        match self {
            Self::Create { .. } => "create",
            Self::CompareAndSwap { .. } => "cas",
            Self::Delete { .. } => "delete",
            Self::Get { .. } => "get",
            Self::List { .. } => "list",
        }
    }
}

/// The successful result of a [`StoreRequest`].
#[derive(Clone, PartialEq, Eq, Debug)]
pub enum StoreReply {
    /// Create or CAS applied at this revision.
    Written(Revision),
    /// Delete applied.
    Deleted,
    /// Point read result (`None`: absent, deleted or expired).
    Value(Option<Entry>),
    /// Listing result, in key order.
    Entries(Vec<Entry>),
}

/// A classified store failure (S2). Fatal variants carry an actionable message.
#[derive(Clone, PartialEq, Eq, Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StoreError {
    /// Create found a live value.
    #[error("key {0} already exists")]
    AlreadyExists(Key),
    /// The fence said no: the key's revision is not the expected one (or the key is absent).
    #[error("revision mismatch on key {0}")]
    RevisionMismatch(Key),
    /// The outcome is unknown (timeout, connection lost mid-request): the write may or may not
    /// have applied. Never treat as failed; resolve by re-reading.
    #[error("outcome unknown: {0}")]
    Indeterminate(String),
    /// Nothing was applied; retry later.
    #[error("store unavailable: {0}")]
    Unavailable(String),
    /// The key was rejected.
    #[error(transparent)]
    InvalidKey(#[from] KeyError),
    /// The value was rejected (too large, TTL out of range, ...).
    #[error("invalid value: {0}")]
    InvalidValue(String),
    /// The server or bucket cannot be used (too old, misconfigured); the message says what to do.
    #[error("store setup: {0}")]
    Setup(String),
}

impl StoreError {
    /// Whether retrying the same request later may succeed without operator action.
    /// `Indeterminate` is retryable only after its outcome has been resolved by a read.
    pub fn is_retryable(&self) -> bool {
        matches!(self, Self::Indeterminate(_) | Self::Unavailable(_))
    }

    /// Whether this error means operator action is needed.
    pub fn is_fatal(&self) -> bool {
        matches!(self, Self::Setup(_) | Self::InvalidKey(_) | Self::InvalidValue(_))
    }
}

/// The result of one store request.
pub type StoreResult = Result<StoreReply, StoreError>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_follow_the_store_charset() {
        assert!(Key::new("split.abc-1").is_ok());
        assert!(Key::new("manifest.1.2.0").is_ok());
        for bad in ["", ".a", "a.", "a..b", "a b", "a>b", "a*"] {
            assert!(Key::new(bad).is_err(), "{bad:?} should be rejected");
        }
    }

    #[test]
    fn prefixes_end_with_a_dot_and_match_leading_segments() {
        let p = Prefix::new("split.").unwrap();
        assert!(p.matches(&Key::new("split.x").unwrap()));
        assert!(!p.matches(&Key::new("splitx").unwrap()));
        assert!(Prefix::new("split").is_err());
        assert!(Prefix::all().matches(&Key::new("anything").unwrap()));
    }
}
