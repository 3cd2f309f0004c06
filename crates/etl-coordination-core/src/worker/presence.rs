//! Presence and duplicate instance ids (P3): joining under our id, taking over a dead
//! predecessor's key, renewing it (P7), and stopping when a live twin shows up.

use std::time::Duration;

use crate::ids::{OpId, Revision};
use crate::io::FatalError;
use crate::records::{self, PresenceRecord, keys};
use crate::store::{Bucket, StoreRequest, StoreResult};
use crate::time::Timestamp;

use super::outbox::{Pending, Read, Written};
use super::resolve::LeaseRead;
use super::{Phase, Worker};

/// This worker's presence key.
#[derive(Debug, Default)]
pub(super) struct Presence {
    /// The revision of our last write to it.
    pub(super) rev: Option<Revision>,
    /// A renewal (or its resolving read, or a re-create) in flight.
    pub(super) renewing: Option<OpId>,
    pub(super) join: Join,
    /// Leaving: the key is being deleted; no more writes to it.
    pub(super) retired: bool,
}

/// The most that the first presence observation waits beyond one heartbeat for a live holder's
/// renewal (P3; see `observe`).
const FIRST_WINDOW_MARGIN: Duration = Duration::from_millis(250);

/// How far joining under our instance id got (P3).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub(super) enum Join {
    #[default]
    NotStarted,
    /// Create in flight.
    Creating,
    /// Another incarnation holds our id; waiting to see whether it renews (P3). `renewed`: one
    /// renewal was seen already (a second proves a live twin).
    Observing { rev: Revision, incarnation: u64, deadline: Timestamp, renewed: bool },
    /// Re-reading the key at the end of the observation window.
    Rechecking { rev: Revision, incarnation: u64, renewed: bool },
    /// CAS over the dead predecessor's key in flight.
    TakingOver,
    /// The key is ours.
    Joined,
}

impl Worker {
    fn presence_record(&self) -> PresenceRecord {
        PresenceRecord {
            incarnation: self.me.incarnation,
            held: self.tenancies.len() as u32,
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

    fn presence_read(&mut self, pending: Pending) -> OpId {
        let key = keys::worker(&self.me.instance);
        self.outbox.send(Bucket::Lease, StoreRequest::Get { key }, pending)
    }

    fn duplicate(&mut self, other: u64) {
        self.fatal(FatalError::DuplicateInstance { instance: self.me.instance.to_string(), other });
    }

    /// P3: announce presence under our instance id.
    pub(super) fn create_presence(&mut self) {
        self.presence.join = Join::Creating;
        let request = self.presence_create();
        self.outbox.send(Bucket::Lease, request, Pending::PresenceCreate);
    }

    fn presence_joined(&mut self, now: Timestamp, rev: Revision) {
        self.presence.rev = Some(rev);
        if self.presence.join != Join::Joined {
            self.presence.join = Join::Joined;
            if self.phase == Phase::Joining {
                self.phase = Phase::Running;
                self.heartbeat_at = Some(now + self.cfg.tuning.heartbeat_interval());
                self.resync_at = Some(now + self.cfg.tuning.resync_interval_for(self.view.splits.len()));
            }
        }
    }

    /// P3: our key was created (joined), or it exists (read whose it is).
    pub(super) fn on_presence_create(&mut self, now: Timestamp, result: StoreResult) {
        match Written::of(result) {
            Written::Applied(rev) => self.presence_joined(now, rev),
            Written::Conflict | Written::InDoubt => {
                self.presence_read(Pending::PresenceGet);
            }
            Written::Fatal(e) => self.fatal_store(e),
            Written::Unavailable => {
                let request = self.presence_create();
                self.outbox.retry_later(now, Bucket::Lease, request, Pending::PresenceCreate);
            }
        }
    }

    /// P3: whose is the key that holds our id? A predecessor's key is observed for about a
    /// heartbeat (see `observe`): a live twin renews it. Reads can lag behind the watch, so the baseline
    /// is the newest revision seen either way.
    pub(super) fn on_presence_get(&mut self, now: Timestamp, result: StoreResult) {
        let entry = match Read::of(result) {
            Read::Found(entry) => entry,
            // The predecessor's key expired meanwhile: create ours.
            Read::Absent => return self.create_presence(),
            Read::Failed(e) if e.is_fatal() => return self.fatal_store(e),
            Read::Failed(_) => {
                let key = keys::worker(&self.me.instance);
                return self.outbox.retry_later(
                    now,
                    Bucket::Lease,
                    StoreRequest::Get { key },
                    Pending::PresenceGet,
                );
            }
        };
        let Ok(mut rec) = records::decode::<PresenceRecord>(&entry.value) else {
            // Unreadable presence of our own id: treat as a dead predecessor.
            return self.takeover_presence(entry.revision);
        };
        let mut rev = entry.revision;
        if let Some((seen, seen_rec)) = self.view.workers.get(&self.me.instance)
            && *seen > rev
        {
            (rev, rec) = (*seen, seen_rec.clone());
        }
        if rec.incarnation == self.me.incarnation {
            // Our own create landed despite the error.
            return self.presence_joined(now, rev);
        }
        match self.presence.join {
            Join::Rechecking { rev: baseline, incarnation, renewed } => {
                if rev == baseline && rec.incarnation.0 == incarnation {
                    self.takeover_presence(rev);
                } else if rev < baseline {
                    // A lagging replica: read again.
                    self.presence_read(Pending::PresenceGet);
                } else {
                    self.renewal_seen(now, rev, rec.incarnation.0, renewed);
                }
            }
            _ => self.observe(now, rev, rec.incarnation.0, false),
        }
    }

    /// P3: wait to see whether the holder is alive. A live holder's next renewal is due within
    /// one heartbeat of the write we read, so the first window is one heartbeat plus a margin
    /// for its scheduling jitter (capped at [`FIRST_WINDOW_MARGIN`], so a restart under the
    /// same id reclaims within L/3 + 0.5 s: T3). After one renewal seen, the second must be
    /// told from a late write of a dead process, and the window is one and a half heartbeats.
    /// A live twin that the first window misses (renewing later than the margin) is still
    /// caught: its next renewal fails its CAS and it stops with the same fatal error (its
    /// `contested` path); every claim stays fenced by the lease and record CAS either way.
    fn observe(&mut self, now: Timestamp, rev: Revision, incarnation: u64, renewed: bool) {
        let hb = self.cfg.tuning.heartbeat_interval();
        let margin = if !renewed { (hb / 2).min(FIRST_WINDOW_MARGIN) } else { hb / 2 };
        self.presence.join = Join::Observing { rev, incarnation, deadline: now + hb + margin, renewed };
    }

    /// P3: the holder of our id wrote its key. One write can be a dead predecessor's that landed
    /// late (its connection held it); a second proves a live twin.
    fn renewal_seen(&mut self, now: Timestamp, rev: Revision, incarnation: u64, renewed: bool) {
        if renewed {
            self.duplicate(incarnation);
        } else {
            self.observe(now, rev, incarnation, true);
        }
    }

    /// P3: the observation window ended without a renewal seen on the watch: re-read the key.
    pub(super) fn observation_ended(&mut self, now: Timestamp) {
        if let Join::Observing { rev, incarnation, deadline, renewed } = self.presence.join
            && now >= deadline
        {
            self.presence.join = Join::Rechecking { rev, incarnation, renewed };
            self.presence_read(Pending::PresenceGet);
        }
    }

    /// P3: the predecessor is dead: take its key over by CAS.
    fn takeover_presence(&mut self, rev: Revision) {
        self.presence.join = Join::TakingOver;
        let request = self.presence_cas(rev);
        self.outbox.send(Bucket::Lease, request, Pending::PresenceTakeover);
    }

    pub(super) fn on_presence_takeover(&mut self, now: Timestamp, result: StoreResult) {
        match Written::of(result) {
            Written::Applied(rev) => self.presence_joined(now, rev),
            // Renewed by a twin, or our own write landed: the read decides.
            Written::Conflict | Written::InDoubt => {
                self.presence.join = Join::Creating;
                self.presence_read(Pending::PresenceGet);
            }
            Written::Fatal(e) => self.fatal_store(e),
            Written::Unavailable => {
                self.presence.join = Join::Creating;
                let key = keys::worker(&self.me.instance);
                self.outbox.retry_later(now, Bucket::Lease, StoreRequest::Get { key }, Pending::PresenceGet);
            }
        }
    }

    /// P7: renew our presence (part of every heartbeat).
    pub(super) fn renew_presence(&mut self) {
        if self.presence.renewing.is_some() || self.presence.retired {
            return;
        }
        let Some(rev) = self.presence.rev else {
            // Our key was found gone and announcing it again got no answer (and no read since
            // told whether it landed): announce again. Without it the worker runs on unseen by
            // its peers (fair shares, and steals, which leave a dead owner's splits alone).
            if self.presence.join == Join::Joined {
                let op = self.outbox.send(Bucket::Lease, self.presence_create(), Pending::PresenceCreate);
                self.presence.renewing = Some(op);
            }
            return;
        };
        let request = self.presence_cas(rev);
        let op = self.outbox.send(Bucket::Lease, request, Pending::PresenceRenew);
        self.presence.renewing = Some(op);
    }

    pub(super) fn on_presence_renew(&mut self, result: StoreResult) {
        self.presence.renewing = None;
        match Written::of(result) {
            Written::Applied(rev) => self.presence.rev = Some(rev),
            Written::Conflict | Written::InDoubt => {
                let op = self.presence_read(Pending::PresenceResolve);
                self.presence.renewing = Some(op);
            }
            Written::Fatal(e) => self.fatal_store(e),
            Written::Unavailable => {}
        }
    }

    /// P3, P7: after a lost or in-doubt renewal, the key decides: still ours (renewed or not),
    /// another incarnation's (a live twin: fatal), or gone (announce again). An older revision
    /// than ours comes from a lagging replica and decides nothing.
    pub(super) fn on_presence_resolve(&mut self, now: Timestamp, result: StoreResult) {
        self.presence.renewing = None;
        match LeaseRead::<PresenceRecord>::of(result, self.presence.rev) {
            LeaseRead::Found(rev, Some(rec)) if rec.incarnation == self.me.incarnation => {
                self.presence.rev = Some(rev)
            }
            LeaseRead::Found(rev, Some(rec)) => self.contested(now, rev, rec.incarnation.0),
            LeaseRead::Found(rev, None) => self.contested(now, rev, 0),
            // Our presence expired (store outage, long pause): announce again, unless leaving.
            LeaseRead::Gone if self.presence.retired => {}
            LeaseRead::Gone => {
                self.presence.rev = None;
                let request = self.presence_create();
                let op = self.outbox.send(Bucket::Lease, request, Pending::PresenceCreate);
                self.presence.renewing = Some(op);
            }
            LeaseRead::Lagging | LeaseRead::Unavailable => {}
        }
    }

    /// A presence create while already running (after our key expired).
    pub(super) fn on_presence_recreate(&mut self, now: Timestamp, result: StoreResult) {
        self.presence.renewing = None;
        match Written::of(result) {
            Written::Applied(rev) => self.presence_joined(now, rev),
            Written::Conflict | Written::InDoubt => {
                let op = self.presence_read(Pending::PresenceResolve);
                self.presence.renewing = Some(op);
            }
            Written::Unavailable => {}
            Written::Fatal(e) => self.fatal_store(e),
        }
    }

    /// P3: a watch event on our presence key at `rev` naming another incarnation.
    pub(super) fn check_own_presence(&mut self, now: Timestamp, rev: Revision) {
        let Some((_, rec)) = self.view.workers.get(&self.me.instance) else { return };
        if rec.incarnation == self.me.incarnation {
            return;
        }
        let other = rec.incarnation.0;
        match self.presence.join {
            // While observing, a renewal by the holder is evidence of a live twin.
            Join::Observing { rev: seen, renewed, .. } | Join::Rechecking { rev: seen, renewed, .. }
                if rev > seen =>
            {
                self.renewal_seen(now, rev, other, renewed)
            }
            Join::Joined if self.presence.rev.is_some_and(|r| r < rev) => self.contested(now, rev, other),
            _ => {}
        }
    }

    /// P3: another incarnation wrote our key while we run. A live twin keeps renewing it; a dead
    /// predecessor's write that its connection held can land once, late. Stop using the key and
    /// observe it: one more write proves a twin (fatal); silence means the key is ours to take
    /// back. Claims and leadership wait meanwhile (the worker is not joined).
    fn contested(&mut self, now: Timestamp, rev: Revision, incarnation: u64) {
        self.presence.rev = None;
        self.observe(now, rev, incarnation, true);
    }
}
