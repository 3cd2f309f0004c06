//! Heartbeats (P7) and self-fencing (P11): renewing presence, the leader lease and every held
//! lease every third of a lease; a renewal that finds the lease gone revokes the lane; a lease
//! whose trust lapses stops its lane (starved) until a renewal shows it is still ours.

use crate::ids::{OpId, Revision, SplitId};
use crate::io::{Action, CommitOutcome, Event, StopReason};
use crate::records::{self, LeaseRecord, keys};
use crate::store::{Bucket, StoreReply, StoreRequest, StoreResult};
use crate::time::Timestamp;

use super::outbox::{Pending, Written};
use super::resolve::LeaseRead;
use super::tenancy::{End, Stage};
use super::{Phase, Worker};

impl Worker {
    /// P7: every heartbeat interval, renew everything this worker holds.
    pub(super) fn heartbeat(&mut self, now: Timestamp) {
        // Blocked claims and failed manifest loads get another chance every cycle.
        self.tenancies.unblock_all();
        if self.manifest_load.as_ref().is_some_and(|l| l.failed) {
            self.manifest_load = None;
        }
        if self.phase == Phase::Running || self.phase == Phase::Leaving {
            self.renew_presence();
        }
        self.renew_leader(now);
        let ids: Vec<SplitId> = self.tenancies.ids().cloned().collect();
        for id in ids {
            self.renew_lease(now, &id);
        }
    }

    /// P7: renew one held lease by CAS with the TTL.
    pub(super) fn renew_lease(&mut self, now: Timestamp, id: &SplitId) {
        let Some(h) = self.tenancies.get(id) else { return };
        let Some(rev) = h.lease.rev else { return };
        if h.lease.renewing.is_some() || matches!(h.stage, Stage::DeletingLease | Stage::AcquiringLease) {
            return;
        }
        let value = records::encode(&LeaseRecord {
            owner: self.me.clone(),
            epoch: h.epoch,
            write: self.outbox.next_op_id().0,
        });
        let request =
            StoreRequest::CompareAndSwap { key: keys::split(id), expected: rev, value, ttl: self.ttl() };
        let op =
            self.outbox.send(Bucket::Lease, request, Pending::LeaseRenew { split: id.clone(), sent: now });
        self.tenancies[id].lease.renewing = Some(op);
    }

    /// Reads a held lease whose presence is in question (a listing did not show it); the read
    /// decides like a renewal's (absent: fenced).
    pub(super) fn check_lease(&mut self, id: &SplitId) {
        let Some(h) = self.tenancies.get(id) else { return };
        if h.lease.renewing.is_some()
            || h.lease.rev.is_none()
            || matches!(h.stage, Stage::DeletingLease | Stage::AcquiringLease)
        {
            return;
        }
        let op = self.outbox.send(
            Bucket::Lease,
            StoreRequest::Get { key: keys::split(id) },
            Pending::LeaseRenewResolve { split: id.clone(), write: None },
        );
        self.tenancies[id].lease.renewing = Some(op);
    }

    /// P7: a renewal that lost its swap or its answer is resolved by reading the lease.
    pub(super) fn on_lease_renew(
        &mut self,
        now: Timestamp,
        op: OpId,
        id: SplitId,
        sent: Timestamp,
        result: StoreResult,
    ) {
        let Some(h) = self.tenancies.get_mut(&id) else {
            // A late success for a tenancy that is over: give the lease back.
            if let Ok(StoreReply::Written(rev)) = result {
                self.retire(keys::split(&id), rev);
            }
            return;
        };
        if h.lease.renewing != Some(op) {
            return;
        }
        h.lease.renewing = None;
        match Written::of(result) {
            Written::Applied(rev) => self.lease_renewed(now, &id, rev, sent),
            Written::Conflict | Written::InDoubt => {
                let op = self.outbox.send(
                    Bucket::Lease,
                    StoreRequest::Get { key: keys::split(&id) },
                    Pending::LeaseRenewResolve { split: id.clone(), write: Some((op, sent)) },
                );
                self.tenancies[&id].lease.renewing = Some(op);
            }
            Written::Fatal(e) => self.fatal_store(e),
            Written::Unavailable => self.after_renewal(&id),
        }
    }

    /// P7: the lease still names us at our epoch (renewed, or not), or it is gone: fenced.
    /// A revision older than the one we know comes from a lagging replica and decides nothing.
    /// A newer revision of ours is adopted; trust is credited from a renewal's send time only
    /// if the value is the one that renewal carried (P11).
    pub(super) fn on_lease_renew_resolve(
        &mut self,
        now: Timestamp,
        op: OpId,
        id: SplitId,
        write: Option<(OpId, Timestamp)>,
        result: StoreResult,
    ) {
        let Some(h) = self.tenancies.get_mut(&id) else { return };
        if h.lease.renewing != Some(op) {
            return;
        }
        h.lease.renewing = None;
        let epoch = h.epoch;
        let known = h.lease.rev;
        match LeaseRead::<LeaseRecord>::of(result, known) {
            LeaseRead::Found(rev, Some(l)) if l.owner == self.me && l.epoch == epoch => {
                if Some(rev) != known {
                    let sent = write.filter(|(w, _)| w.0 == l.write).map_or(Timestamp::ZERO, |(_, s)| s);
                    self.lease_renewed(now, &id, rev, sent);
                } else {
                    self.after_renewal(&id);
                }
            }
            LeaseRead::Found(..) | LeaseRead::Gone => self.revoke(&id, StopReason::Fenced),
            LeaseRead::Lagging | LeaseRead::Unavailable => self.after_renewal(&id),
        }
    }

    /// P11: trust is measured from the renewal's send time; a starved lane may resume.
    fn lease_renewed(&mut self, now: Timestamp, id: &SplitId, rev: Revision, sent: Timestamp) {
        let me = self.me.clone();
        let h = &mut self.tenancies[id];
        h.lease.rev = Some(rev);
        h.lease.trusted_until = h.lease.trusted_until.max(sent + self.cfg.tuning.lease_trust());
        let epoch = h.epoch;
        self.view.put_lease(id, rev, LeaseRecord { owner: me, epoch, write: 0 });
        let h = &mut self.tenancies[id];
        // A starved tenancy resumes, unless it is on its way out (its end waits for a commit).
        if h.stage == Stage::Starved
            && h.lease.trusted_until > now
            && h.op.is_none()
            && h.ending.how.is_none()
        {
            return self.resume(now, id);
        }
        self.after_renewal(id);
    }

    /// Work that waited for an in-flight renewal.
    fn after_renewal(&mut self, id: &SplitId) {
        if self.tenancies.get(id).is_some_and(|h| h.stage == Stage::DeletingLease && h.op.is_none()) {
            self.delete_lease(id);
        }
    }

    /// P11: a lease not renewed for a lease duration stops its lane (starved). A draining
    /// lane is stopped too (it would otherwise run until the drain deadline on a lease that
    /// may be gone) and its split released at once: the release is fenced like any end.
    pub(super) fn starve(&mut self, now: Timestamp, id: &SplitId) {
        let Some(h) = self.tenancies.get_mut(id) else { return };
        let draining = matches!(h.stage, Stage::Stopping { .. });
        if !(h.stage == Stage::Running || draining) || h.lease.trusted_until > now || h.lease.rev.is_none() {
            return;
        }
        h.stage = Stage::Starved;
        let epoch = h.epoch;
        self.outbox.push(Action::StopLane {
            split: id.clone(),
            epoch,
            reason: StopReason::Starved,
            deadline: None,
        });
        self.outbox.event(Event::Revoked { split: id.clone(), reason: StopReason::Starved });
        if draining || self.phase == Phase::Leaving {
            let end = self.tenancies.get_mut(id).and_then(|h| h.ending.how.take()).unwrap_or(End::Release);
            self.begin_end(id, end);
        }
    }

    /// P11: the store came back and the lease is still ours: the starved tenancy resumes as a
    /// new lane under a new epoch. Our lease moves to the next epoch by CAS, then the record
    /// (the claim path, against the revision of our last write to it), so neither the stopped
    /// lane nor a commit of it still in flight can act on the new lane's record: the new lane
    /// starts from what is durable. A stale read cannot mislead it, because nothing is read. No
    /// attempt is consumed and no acquisition is announced.
    fn resume(&mut self, now: Timestamp, id: &SplitId) {
        let h = &mut self.tenancies[id];
        let (Some(lease_rev), old_epoch) = (h.lease.rev, h.epoch) else { return };
        if let Some(c) = h.commit.take() {
            self.outbox.forget(c.op);
            let reply =
                Action::CommitDone { split: id.clone(), epoch: old_epoch, outcome: CommitOutcome::Lost };
            self.outbox.push(reply);
        }
        let h = &mut self.tenancies[id];
        h.epoch = old_epoch.next();
        h.base = h.written.record.clone();
        h.acquisition.consumes_attempt = false;
        h.acquisition.resuming = true;
        h.ending.how = None;
        h.stage = Stage::AcquiringLease;
        let epoch = h.epoch;
        let value = records::encode(&LeaseRecord {
            owner: self.me.clone(),
            epoch,
            write: self.outbox.next_op_id().0,
        });
        let request = StoreRequest::CompareAndSwap {
            key: keys::split(id),
            expected: lease_rev,
            value,
            ttl: self.ttl(),
        };
        self.send_step(id, Bucket::Lease, request, Pending::LeaseAcquire { split: id.clone(), sent: now });
    }
}
