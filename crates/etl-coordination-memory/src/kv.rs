//! [`MemoryKv`]: the synchronous, clock-free store semantics. Every call takes `now`; expiry is
//! decided against it. The async [`crate::MemoryStore`] and the deterministic simulator both
//! run on this one implementation, so the simulator checks the protocol against exactly the
//! semantics the conformance suite pins down.

use std::collections::BTreeMap;
use std::time::Duration;

use bytes::Bytes;
use etl_coordination_core::{
    DeleteCause, Entry, Key, Prefix, Revision, StoreError, StoreReply, StoreRequest, StoreResult, Timestamp,
    WatchEvent,
};
use etl_coordination_store::{validate_ttl, validate_value};

#[derive(Clone, Debug)]
struct Slot {
    value: Bytes,
    revision: Revision,
    expires_at: Option<Timestamp>,
}

/// One key space (a NATS bucket) in memory.
///
/// Revisions come from one counter per key space (like a JetStream stream sequence), so they
/// increase per key as S4 requires. Deletions and expiries take a revision of their own.
///
/// Expiry: by default every operation first expires what is due at its `now`, so a key is gone
/// the moment its TTL runs out. [`MemoryKv::with_explicit_expiry`] models NATS more closely: a
/// key past its TTL stays live (readable and CAS-able) until [`MemoryKv::expire`] (the server's
/// expiry timer) removes it.
#[derive(Clone, Debug, Default)]
pub struct MemoryKv {
    slots: BTreeMap<Key, Slot>,
    last_revision: u64,
    /// Events produced since the last [`MemoryKv::take_events`].
    events: Vec<WatchEvent>,
    /// Only [`MemoryKv::expire`] expires keys; operations do not.
    explicit_expiry: bool,
}

impl MemoryKv {
    /// An empty key space whose operations expire what is due first.
    pub fn new() -> Self {
        Self::default()
    }

    /// An empty key space in which keys past their TTL stay live until [`MemoryKv::expire`]
    /// removes them, as on a NATS server whose expiry timer has not fired yet.
    pub fn with_explicit_expiry() -> Self {
        MemoryKv { explicit_expiry: true, ..Self::default() }
    }

    /// Runs one request of the protocol core.
    pub fn execute(&mut self, now: Timestamp, request: StoreRequest) -> StoreResult {
        match request {
            StoreRequest::Create { key, value, ttl } => {
                self.create(now, &key, value, ttl).map(StoreReply::Written)
            }
            StoreRequest::CompareAndSwap { key, expected, value, ttl } => {
                self.compare_and_swap(now, &key, expected, value, ttl).map(StoreReply::Written)
            }
            StoreRequest::Delete { key, expected } => {
                self.delete(now, &key, expected).map(|()| StoreReply::Deleted)
            }
            StoreRequest::Get { key } => Ok(StoreReply::Value(self.get(now, &key))),
            StoreRequest::List { prefix } => Ok(StoreReply::Entries(self.list(now, &prefix))),
        }
    }

    /// Expiry before an operation (unless expiry is explicit).
    fn expire_due(&mut self, now: Timestamp) {
        if !self.explicit_expiry {
            self.expire(now);
        }
    }

    fn next_revision(&mut self) -> Revision {
        self.last_revision += 1;
        Revision(self.last_revision)
    }

    fn live(&self, key: &Key, now: Timestamp) -> Option<&Slot> {
        self.slots.get(key).filter(|s| self.explicit_expiry || s.expires_at.is_none_or(|t| t > now))
    }

    fn write(&mut self, key: &Key, value: Bytes, ttl: Option<Duration>, now: Timestamp) -> Revision {
        let revision = self.next_revision();
        let slot = Slot { value: value.clone(), revision, expires_at: ttl.map(|t| now + t) };
        self.slots.insert(key.clone(), slot);
        self.events.push(WatchEvent::Put(Entry { key: key.clone(), value, revision }));
        revision
    }

    /// Removes every key whose TTL ran out at `now`, emitting an expiry event for each.
    pub fn expire(&mut self, now: Timestamp) {
        let due: Vec<Key> = self
            .slots
            .iter()
            .filter(|(_, s)| s.expires_at.is_some_and(|t| t <= now))
            .map(|(k, _)| k.clone())
            .collect();
        for key in due {
            self.slots.remove(&key);
            let revision = self.next_revision();
            self.events.push(WatchEvent::Delete { key, revision, cause: DeleteCause::Expired });
        }
    }

    /// The earliest pending expiry.
    pub fn next_expiry(&self) -> Option<Timestamp> {
        self.slots.values().filter_map(|s| s.expires_at).min()
    }

    /// Create-if-absent.
    pub fn create(
        &mut self,
        now: Timestamp,
        key: &Key,
        value: Bytes,
        ttl: Option<Duration>,
    ) -> Result<Revision, StoreError> {
        validate_ttl(ttl)?;
        validate_value(&value)?;
        self.expire_due(now);
        if self.live(key, now).is_some() {
            return Err(StoreError::AlreadyExists(key.clone()));
        }
        Ok(self.write(key, value, ttl, now))
    }

    /// Compare-and-swap; the new value carries `ttl` (replacing the previous one).
    pub fn compare_and_swap(
        &mut self,
        now: Timestamp,
        key: &Key,
        expected: Revision,
        value: Bytes,
        ttl: Option<Duration>,
    ) -> Result<Revision, StoreError> {
        validate_ttl(ttl)?;
        validate_value(&value)?;
        self.expire_due(now);
        match self.live(key, now) {
            Some(s) if s.revision == expected => Ok(self.write(key, value, ttl, now)),
            _ => Err(StoreError::RevisionMismatch(key.clone())),
        }
    }

    /// Guarded delete.
    pub fn delete(&mut self, now: Timestamp, key: &Key, expected: Revision) -> Result<(), StoreError> {
        self.expire_due(now);
        match self.live(key, now) {
            Some(s) if s.revision == expected => {
                self.slots.remove(key);
                let revision = self.next_revision();
                self.events.push(WatchEvent::Delete {
                    key: key.clone(),
                    revision,
                    cause: DeleteCause::Deleted,
                });
                Ok(())
            }
            _ => Err(StoreError::RevisionMismatch(key.clone())),
        }
    }

    /// Point read.
    pub fn get(&mut self, now: Timestamp, key: &Key) -> Option<Entry> {
        self.expire_due(now);
        self.live(key, now).map(|s| Entry { key: key.clone(), value: s.value.clone(), revision: s.revision })
    }

    /// Live entries under `prefix`, in key order.
    pub fn list(&mut self, now: Timestamp, prefix: &Prefix) -> Vec<Entry> {
        self.expire_due(now);
        self.slots
            .range(..)
            .filter(|(k, _)| prefix.matches(k))
            .map(|(k, s)| Entry { key: k.clone(), value: s.value.clone(), revision: s.revision })
            .collect()
    }

    /// Events produced since the last call, in revision order.
    pub fn take_events(&mut self) -> Vec<WatchEvent> {
        std::mem::take(&mut self.events)
    }

    /// Erases a key as if its previous TTL had expired, even though it was just written (models
    /// the NATS race in which an acknowledged renewal is rolled back by an expiry decided for
    /// the previous revision; see docs/NATS.md). Used only by the simulator's fault injector.
    pub fn erase_as_expired(&mut self, key: &Key) -> bool {
        if self.slots.remove(key).is_none() {
            return false;
        }
        let revision = self.next_revision();
        self.events.push(WatchEvent::Delete { key: key.clone(), revision, cause: DeleteCause::Expired });
        true
    }

    /// Keys whose TTL ran out by `now` but that are still present (explicit expiry: the expiry
    /// timer has not removed them yet), with their deadlines.
    pub fn overdue(&self, now: Timestamp) -> Vec<(Key, Timestamp)> {
        self.slots
            .iter()
            .filter_map(|(k, s)| s.expires_at.filter(|t| *t <= now).map(|t| (k.clone(), t)))
            .collect()
    }

    /// The TTL deadline of a live key, if any (for the simulator's checks).
    pub fn expires_at(&self, key: &Key) -> Option<Timestamp> {
        self.slots.get(key).and_then(|s| s.expires_at)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn k(s: &str) -> Key {
        Key::new(s).unwrap()
    }

    #[test]
    fn expiry_is_decided_against_now_and_emits_an_event() {
        let mut kv = MemoryKv::new();
        let t0 = Timestamp::ZERO;
        let r = kv.create(t0, &k("a"), Bytes::new(), Some(Duration::from_secs(1))).unwrap();
        assert!(kv.get(t0 + Duration::from_millis(999), &k("a")).is_some());
        assert_eq!(kv.get(t0 + Duration::from_secs(1), &k("a")), None);
        let events = kv.take_events();
        assert!(
            matches!(events.last(), Some(WatchEvent::Delete { cause: DeleteCause::Expired, revision, .. }) if *revision > r)
        );
    }

    #[test]
    fn with_explicit_expiry_an_overdue_key_stays_live_until_expire_runs() {
        let mut kv = MemoryKv::with_explicit_expiry();
        let t0 = Timestamp::ZERO;
        let r = kv.create(t0, &k("a"), Bytes::new(), Some(Duration::from_secs(1))).unwrap();
        let late = t0 + Duration::from_secs(3);
        assert_eq!(kv.get(late, &k("a")).map(|e| e.revision), Some(r), "readable past its TTL");
        let r2 = kv.compare_and_swap(late, &k("a"), r, Bytes::new(), Some(Duration::from_secs(1))).unwrap();
        kv.expire(late + Duration::from_secs(1));
        assert_eq!(kv.get(late + Duration::from_secs(1), &k("a")), None);
        assert!(matches!(
            kv.take_events().last(),
            Some(WatchEvent::Delete { cause: DeleteCause::Expired, revision, .. }) if *revision > r2
        ));
    }

    #[test]
    fn execute_runs_every_request_of_the_core() {
        let mut kv = MemoryKv::new();
        let t0 = Timestamp::ZERO;
        let put = |value: &str| Bytes::copy_from_slice(value.as_bytes());
        let Ok(StoreReply::Written(r)) =
            kv.execute(t0, StoreRequest::Create { key: k("x.a"), value: put("1"), ttl: None })
        else {
            panic!("create")
        };
        let cas = StoreRequest::CompareAndSwap { key: k("x.a"), expected: r, value: put("2"), ttl: None };
        let Ok(StoreReply::Written(r2)) = kv.execute(t0, cas.clone()) else { panic!("cas") };
        assert_eq!(kv.execute(t0, cas), Err(StoreError::RevisionMismatch(k("x.a"))));
        let listed = kv.execute(t0, StoreRequest::List { prefix: Prefix::new("x.").unwrap() });
        assert!(matches!(listed, Ok(StoreReply::Entries(ref e)) if e.len() == 1 && e[0].revision == r2));
        assert_eq!(
            kv.execute(t0, StoreRequest::Delete { key: k("x.a"), expected: r2 }),
            Ok(StoreReply::Deleted)
        );
        assert_eq!(kv.execute(t0, StoreRequest::Get { key: k("x.a") }), Ok(StoreReply::Value(None)));
    }
}
