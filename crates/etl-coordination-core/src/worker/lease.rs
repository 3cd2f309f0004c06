//! Our keys in the lease bucket, whatever they are for (a split's lease, our presence, the
//! leader key): the TTL they carry, giving one back (`retire`: a guarded delete, read back and
//! deleted again while still ours), and recognizing a value of ours.

use std::time::Duration;

use crate::ids::Revision;
use crate::records::{self, LeaderRecord, LeaseRecord, PresenceRecord, StealRequest, keys};
use crate::store::{Bucket, Key, StoreError, StoreRequest, StoreResult};
use crate::time::Timestamp;

use super::Worker;
use super::outbox::{Pending, Read};

impl Worker {
    /// The TTL every lease-bucket write carries.
    pub(super) fn ttl(&self) -> Option<Duration> {
        Some(self.cfg.tuning.lease_duration)
    }

    /// Deletes one of our lease-bucket keys (presence, leader, a lease we cannot use). If the
    /// revision moved (a write of ours landed late) or the answer is lost, the key is read back
    /// and deleted again while it is still ours.
    pub(super) fn retire(&mut self, key: Key, rev: Revision) {
        let request = StoreRequest::Delete { key: key.clone(), expected: rev };
        self.outbox.send(Bucket::Lease, request, Pending::Retire { key });
    }

    pub(super) fn on_retire(&mut self, now: Timestamp, key: Key, result: StoreResult) {
        match result {
            Ok(_) | Err(StoreError::InvalidKey(_) | StoreError::InvalidValue(_) | StoreError::Setup(_)) => {}
            Err(StoreError::Unavailable(_)) => {
                let request = StoreRequest::Get { key: key.clone() };
                self.outbox.retry_later(now, Bucket::Lease, request, Pending::RetireRead { key });
            }
            Err(_) => {
                self.outbox.send(
                    Bucket::Lease,
                    StoreRequest::Get { key: key.clone() },
                    Pending::RetireRead { key },
                );
            }
        }
    }

    pub(super) fn on_retire_read(&mut self, now: Timestamp, key: Key, result: StoreResult) {
        match Read::of(result) {
            Read::Found(e) if self.names_me(&e.key, &e.value) && !self.holds(&e.key) => {
                self.retire(key, e.revision)
            }
            Read::Found(_) | Read::Absent => {}
            Read::Failed(_) => {
                let request = StoreRequest::Get { key: key.clone() };
                self.outbox.retry_later(now, Bucket::Lease, request, Pending::RetireRead { key });
            }
        }
    }

    /// Whether `key` is the lease of a split this worker holds, or the leader key while it
    /// leads or tries to (a newer use of ours: never retire it).
    fn holds(&self, key: &Key) -> bool {
        if *key == keys::leader() {
            // Leading again (or trying to) since that value was written: never retire it.
            return self.leader.is_some() || self.leader_attempt.is_some();
        }
        if let Some(victim) = keys::parse_steal(key) {
            // A steal request still waited on.
            return self.steal.as_ref().is_some_and(|p| p.victim == victim);
        }
        keys::parse_split(key).is_some_and(|id| self.tenancies.contains(&id))
    }

    /// Whether a lease-bucket value was written by this process.
    pub(super) fn names_me(&self, key: &Key, value: &[u8]) -> bool {
        if keys::parse_split(key).is_some() {
            records::decode::<LeaseRecord>(value).is_ok_and(|l| l.owner == self.me)
        } else if keys::parse_worker(key).is_some() {
            records::decode::<PresenceRecord>(value).is_ok_and(|p| p.incarnation == self.me.incarnation)
        } else if *key == keys::leader() {
            records::decode::<LeaderRecord>(value).is_ok_and(|l| l.owner == self.me)
        } else if keys::parse_steal(key).is_some() {
            records::decode::<StealRequest>(value).is_ok_and(|r| r.thief == self.me)
        } else {
            false
        }
    }
}
