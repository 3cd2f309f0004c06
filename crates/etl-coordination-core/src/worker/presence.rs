//! Presence and duplicate instance ids (P3): joining under our id, taking over a dead
//! predecessor's key, renewing it (P7), and stopping when a live twin shows up.

use crate::ids::{OpId, Revision};
use crate::io::FatalError;
use crate::records::{self, PresenceRecord, keys};
use crate::store::{Bucket, StoreRequest, StoreResult};
use crate::time::Timestamp;

use super::outbox::{Pending, Read, Written};
use super::{Phase, Worker};

/// This worker's presence key.
#[derive(Debug, Default)]
pub(super) struct Presence {
    /// The revision of our last write to it.
    pub(super) rev: Option<Revision>,
    /// A renewal (or its resolving read, or a re-create) in flight.
    pub(super) renewing: Option<OpId>,
    pub(super) trusted_until: Timestamp,
    pub(super) join: Join,
}

/// How far joining under our instance id got (P3).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub(super) enum Join {
    #[default]
    NotStarted,
    /// Create in flight.
    Creating,
    /// Another incarnation holds our id; waiting to see whether it renews (P3).
    Observing { rev: Revision, incarnation: u64, deadline: Timestamp },
    /// Re-reading the key at the end of the observation window.
    Rechecking { rev: Revision, incarnation: u64 },
    /// CAS over the dead predecessor's key in flight.
    TakingOver,
    /// The key is ours.
    Joined,
}

impl Worker {
    fn presence_record(&self) -> PresenceRecord {
        PresenceRecord {
            incarnation: self.me.incarnation,
            held: self.held.len() as u32,
            capacity: self.cfg.tuning.max_in_flight,
        }
    }

    fn presence_create(&self) -> StoreRequest {
        let value = records::encode(&self.presence_record());
        StoreRequest::Create { key: keys::worker(&self.me.instance), value, ttl: self.ttl() }
    }

    fn presence_cas(&self, expected: Revision) -> StoreRequest {
        let value = records::encode(&self.presence_record());
        StoreRequest::CompareAndSwap {
            key: keys::worker(&self.me.instance),
            expected,
            value,
            ttl: self.ttl(),
        }
    }

    fn duplicate(&mut self, other: u64) {
        self.fatal(FatalError::DuplicateInstance { instance: self.me.instance.to_string(), other });
    }

    /// P3: announce presence under our instance id.
    pub(super) fn create_presence(&mut self, now: Timestamp) {
        self.presence.join = Join::Creating;
        let request = self.presence_create();
        self.send(Bucket::Lease, request, Pending::PresenceCreate { sent: now });
    }

    fn presence_get(&mut self) {
        let key = keys::worker(&self.me.instance);
        self.send(Bucket::Lease, StoreRequest::Get { key }, Pending::PresenceGet);
    }

    fn presence_joined(&mut self, now: Timestamp, rev: Revision, sent: Timestamp) {
        self.presence.rev = Some(rev);
        self.presence.trusted_until = sent + self.cfg.tuning.lease_trust();
        if self.presence.join != Join::Joined {
            self.presence.join = Join::Joined;
            if self.phase == Phase::Joining {
                self.phase = Phase::Running;
                self.heartbeat_at = Some(now + self.cfg.tuning.heartbeat_interval());
                self.resync_at = Some(now + self.cfg.tuning.resync_interval());
            }
        }
    }

    /// P3: our key was created (joined), or it exists (read whose it is).
    pub(super) fn on_presence_create(&mut self, now: Timestamp, sent: Timestamp, result: StoreResult) {
        match Written::of(result) {
            Written::Applied(rev) => self.presence_joined(now, rev, sent),
            Written::Conflict | Written::InDoubt => self.presence_get(),
            Written::Fatal(e) => self.fatal_store(e),
            Written::Unavailable => {
                let request = self.presence_create();
                let sent = now + self.retry_backoff();
                self.retry_later(now, Bucket::Lease, request, Pending::PresenceCreate { sent });
            }
        }
    }

    /// P3: whose is the key that holds our id?
    pub(super) fn on_presence_get(&mut self, now: Timestamp, result: StoreResult) {
        let entry = match Read::of(result) {
            Read::Found(entry) => entry,
            // The predecessor's key expired meanwhile: create ours.
            Read::Absent => return self.create_presence(now),
            Read::Failed(e) if e.is_fatal() => return self.fatal_store(e),
            Read::Failed(_) => {
                let key = keys::worker(&self.me.instance);
                return self.retry_later(now, Bucket::Lease, StoreRequest::Get { key }, Pending::PresenceGet);
            }
        };
        let Ok(rec) = records::decode::<PresenceRecord>(&entry.value) else {
            // Unreadable presence of our own id: treat as a dead predecessor.
            return self.takeover_presence(now, entry.revision);
        };
        if rec.incarnation == self.me.incarnation {
            // Our own create landed despite the error.
            return self.presence_joined(now, entry.revision, now - self.cfg.tuning.heartbeat_interval());
        }
        match self.presence.join {
            Join::Rechecking { rev, incarnation } => {
                if entry.revision == rev {
                    self.takeover_presence(now, rev);
                } else {
                    self.duplicate(if rec.incarnation.0 != incarnation {
                        rec.incarnation.0
                    } else {
                        incarnation
                    });
                }
            }
            _ => {
                // P3: wait a heartbeat interval (and a half, for scheduling jitter) to see whether
                // the holder is alive.
                let wait = self.cfg.tuning.heartbeat_interval() + self.cfg.tuning.heartbeat_interval() / 2;
                self.presence.join = Join::Observing {
                    rev: entry.revision,
                    incarnation: rec.incarnation.0,
                    deadline: now + wait,
                };
            }
        }
    }

    /// P3: the observation window ended without a renewal seen on the watch: re-read the key.
    pub(super) fn observation_ended(&mut self, now: Timestamp) {
        if let Join::Observing { rev, incarnation, deadline } = self.presence.join
            && now >= deadline
        {
            self.presence.join = Join::Rechecking { rev, incarnation };
            self.presence_get();
        }
    }

    /// P3: the predecessor is dead: take its key over by CAS.
    fn takeover_presence(&mut self, now: Timestamp, rev: Revision) {
        self.presence.join = Join::TakingOver;
        let request = self.presence_cas(rev);
        self.send(Bucket::Lease, request, Pending::PresenceTakeover { sent: now });
    }

    pub(super) fn on_presence_takeover(&mut self, now: Timestamp, sent: Timestamp, result: StoreResult) {
        match Written::of(result) {
            Written::Applied(rev) => self.presence_joined(now, rev, sent),
            // Renewed by a twin, or our own write landed: the read decides.
            Written::Conflict | Written::InDoubt => {
                self.presence.join = Join::Creating;
                self.presence_get();
            }
            Written::Fatal(e) => self.fatal_store(e),
            Written::Unavailable => {
                self.presence.join = Join::Creating;
                let key = keys::worker(&self.me.instance);
                self.retry_later(now, Bucket::Lease, StoreRequest::Get { key }, Pending::PresenceGet);
            }
        }
    }

    /// P7: renew our presence (part of every heartbeat).
    pub(super) fn renew_presence(&mut self, now: Timestamp) {
        let Some(rev) = self.presence.rev else { return };
        if self.presence.renewing.is_some() {
            return;
        }
        let request = self.presence_cas(rev);
        let op = self.send(Bucket::Lease, request, Pending::PresenceRenew { sent: now });
        self.presence.renewing = Some(op);
    }

    pub(super) fn on_presence_renew(&mut self, sent: Timestamp, result: StoreResult) {
        self.presence.renewing = None;
        match Written::of(result) {
            Written::Applied(rev) => {
                self.presence.rev = Some(rev);
                self.presence.trusted_until = sent + self.cfg.tuning.lease_trust();
            }
            Written::Conflict | Written::InDoubt => {
                let key = keys::worker(&self.me.instance);
                let op =
                    self.send(Bucket::Lease, StoreRequest::Get { key }, Pending::PresenceResolve { sent });
                self.presence.renewing = Some(op);
            }
            Written::Fatal(e) => self.fatal_store(e),
            Written::Unavailable => {}
        }
    }

    /// P3, P7: after a lost or in-doubt renewal, the key decides: still ours (renewed or not),
    /// another incarnation's (a live twin: fatal), or gone (announce again).
    pub(super) fn on_presence_resolve(&mut self, now: Timestamp, sent: Timestamp, result: StoreResult) {
        self.presence.renewing = None;
        match Read::of(result) {
            Read::Found(entry) => match records::decode::<PresenceRecord>(&entry.value) {
                Ok(rec) if rec.incarnation == self.me.incarnation => {
                    let applied = Some(entry.revision) != self.presence.rev;
                    self.presence.rev = Some(entry.revision);
                    if applied {
                        self.presence.trusted_until = sent + self.cfg.tuning.lease_trust();
                    }
                }
                Ok(rec) => self.duplicate(rec.incarnation.0),
                Err(_) => self.duplicate(0),
            },
            // Our presence expired (store outage, long pause): announce again.
            Read::Absent => {
                self.presence.rev = None;
                let request = self.presence_create();
                let op = self.send(Bucket::Lease, request, Pending::PresenceCreate { sent: now });
                self.presence.renewing = Some(op);
            }
            Read::Failed(_) => {}
        }
    }

    /// A presence create while already running (after our key expired).
    pub(super) fn on_presence_recreate(&mut self, now: Timestamp, sent: Timestamp, result: StoreResult) {
        self.presence.renewing = None;
        match Written::of(result) {
            Written::Applied(rev) => self.presence_joined(now, rev, sent),
            Written::Conflict | Written::InDoubt => {
                let key = keys::worker(&self.me.instance);
                let op =
                    self.send(Bucket::Lease, StoreRequest::Get { key }, Pending::PresenceResolve { sent });
                self.presence.renewing = Some(op);
            }
            Written::Fatal(_) | Written::Unavailable => {}
        }
    }

    /// P3: a watch event on our presence key at `rev` naming another incarnation: a live twin
    /// renewed it.
    pub(super) fn check_own_presence(&mut self, rev: Revision) {
        let Some((_, rec)) = self.view.workers.get(&self.me.instance) else { return };
        if rec.incarnation == self.me.incarnation {
            return;
        }
        let other = rec.incarnation.0;
        match self.presence.join {
            // While observing, a renewal by the holder proves a live twin.
            Join::Observing { rev: seen, .. } | Join::Rechecking { rev: seen, .. } if rev > seen => {
                self.duplicate(other)
            }
            Join::Joined if self.presence.rev.is_some_and(|r| r < rev) => self.duplicate(other),
            _ => {}
        }
    }
}
