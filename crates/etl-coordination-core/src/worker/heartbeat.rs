//! Heartbeats (P7) and self-fencing (P11): renewing presence, the leader lease and every held
//! lease every third of a lease; a renewal that finds the lease gone revokes the lane; a lease
//! whose trust lapses stops its lane (starved) until a renewal shows it is still ours.

use crate::ids::{OpId, Revision, SplitId};
use crate::io::{Action, Event, StopReason};
use crate::records::{self, LeaseRecord, SplitRecord, SplitState, keys};
use crate::store::{Bucket, StoreReply, StoreRequest, StoreResult};
use crate::time::Timestamp;

use super::outbox::{Pending, Read, Written};
use super::tenancy::Stage;
use super::{Phase, Worker};

impl Worker {
    /// P7: every heartbeat interval, renew everything this worker holds.
    pub(super) fn heartbeat(&mut self, now: Timestamp) {
        // Blocked claims and failed manifest loads get another chance every cycle.
        self.blocked.clear();
        if self.manifest_load.as_ref().is_some_and(|l| l.failed) {
            self.manifest_load = None;
        }
        if self.phase == Phase::Running || self.phase == Phase::Leaving {
            self.renew_presence(now);
        }
        self.renew_leader(now);
        let ids: Vec<SplitId> = self.held.keys().cloned().collect();
        for id in ids {
            self.renew_lease(now, &id);
        }
    }

    /// P7: renew one held lease by CAS with the TTL.
    fn renew_lease(&mut self, now: Timestamp, id: &SplitId) {
        let Some(h) = self.held.get(id) else { return };
        let Some(rev) = h.lease_rev else { return };
        if h.renewing.is_some() || matches!(h.stage, Stage::DeletingLease | Stage::AcquiringLease) {
            return;
        }
        let value = records::encode(&LeaseRecord { owner: self.me.clone(), epoch: h.epoch });
        let request =
            StoreRequest::CompareAndSwap { key: keys::split(id), expected: rev, value, ttl: self.ttl() };
        let op = self.send(Bucket::Lease, request, Pending::LeaseRenew { split: id.clone(), sent: now });
        self.held.get_mut(id).expect("held").renewing = Some(op);
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
        let Some(h) = self.held.get_mut(&id) else {
            // A late success for a tenancy that is over: give the lease back.
            if let Ok(StoreReply::Written(rev)) = result {
                self.send(
                    Bucket::Lease,
                    StoreRequest::Delete { key: keys::split(&id), expected: rev },
                    Pending::Cleanup,
                );
            }
            return;
        };
        if h.renewing != Some(op) {
            return;
        }
        h.renewing = None;
        match Written::of(result) {
            Written::Applied(rev) => self.lease_renewed(now, &id, rev, sent),
            Written::Conflict | Written::InDoubt => {
                let op = self.send(
                    Bucket::Lease,
                    StoreRequest::Get { key: keys::split(&id) },
                    Pending::LeaseRenewResolve { split: id.clone(), sent },
                );
                self.held.get_mut(&id).expect("held").renewing = Some(op);
            }
            Written::Fatal(e) => self.fatal_store(e),
            Written::Unavailable => self.after_renewal(&id),
        }
    }

    /// P7: the lease still names us at our epoch (renewed, or not), or it is gone: fenced.
    pub(super) fn on_lease_renew_resolve(
        &mut self,
        now: Timestamp,
        op: OpId,
        id: SplitId,
        sent: Timestamp,
        result: StoreResult,
    ) {
        let Some(h) = self.held.get_mut(&id) else { return };
        if h.renewing != Some(op) {
            return;
        }
        h.renewing = None;
        let epoch = h.epoch;
        let known = h.lease_rev;
        match Read::of(result) {
            Read::Found(e) => match records::decode::<LeaseRecord>(&e.value) {
                Ok(l) if l.owner == self.me && l.epoch == epoch => {
                    if Some(e.revision) != known {
                        self.lease_renewed(now, &id, e.revision, sent);
                    } else {
                        self.after_renewal(&id);
                    }
                }
                _ => self.revoke(&id, StopReason::Fenced),
            },
            Read::Absent => self.revoke(&id, StopReason::Fenced),
            Read::Failed(_) => self.after_renewal(&id),
        }
    }

    /// P11: trust is measured from the renewal's send time; a starved lane may resume.
    fn lease_renewed(&mut self, now: Timestamp, id: &SplitId, rev: Revision, sent: Timestamp) {
        let me = self.me.clone();
        let h = self.held.get_mut(id).expect("held");
        h.lease_rev = Some(rev);
        h.trusted_until = h.trusted_until.max(sent + self.cfg.tuning.lease_trust());
        let epoch = h.epoch;
        self.view.put_lease(id, rev, LeaseRecord { owner: me, epoch });
        let h = self.held.get_mut(id).expect("held");
        if h.stage == Stage::Starved && h.trusted_until > now && h.op.is_none() {
            // P11: the store came back and the lease is still ours. Re-read the record first: a
            // commit whose outcome was in doubt may have landed, and the lane must resume from
            // what is durable (resuming from an older copy would let it regress progress, I1).
            let op = self.send(
                Bucket::State,
                StoreRequest::Get { key: keys::split(id) },
                Pending::ResumeRead { split: id.clone() },
            );
            self.held.get_mut(id).expect("held").op = Some(op);
        }
        self.after_renewal(id);
    }

    /// Work that waited for an in-flight renewal.
    fn after_renewal(&mut self, id: &SplitId) {
        if self.held.get(id).is_some_and(|h| h.stage == Stage::DeletingLease && h.op.is_none()) {
            self.delete_lease(id);
        }
    }

    /// P11: a lease not renewed for a lease duration stops its lane (starved).
    pub(super) fn starve(&mut self, now: Timestamp, id: &SplitId) {
        let Some(h) = self.held.get_mut(id) else { return };
        if h.stage != Stage::Running || h.trusted_until > now || h.lease_rev.is_none() {
            return;
        }
        h.stage = Stage::Starved;
        let epoch = h.epoch;
        self.out.push(Action::StopLane {
            split: id.clone(),
            epoch,
            reason: StopReason::Starved,
            deadline: None,
        });
        self.event(Event::Revoked { split: id.clone(), reason: StopReason::Starved });
    }

    /// P11: a starved lane resumes only from the durable record, and only if it still names us
    /// at our epoch.
    pub(super) fn on_resume_read(&mut self, op: OpId, id: SplitId, result: StoreResult) {
        if !self.is_current(&id, op) {
            return;
        }
        self.held.get_mut(&id).expect("held").op = None;
        let entry = match Read::of(result) {
            Read::Found(e) => e,
            Read::Absent => return self.revoke(&id, StopReason::Fenced),
            // Still unreachable: stay starved; the next renewal tries again.
            Read::Failed(_) => return,
        };
        let Ok(rec) = records::decode::<SplitRecord>(&entry.value) else {
            return self.revoke(&id, StopReason::Fenced);
        };
        let h = self.held.get_mut(&id).expect("held");
        if rec.epoch != h.epoch || rec.owner.as_ref() != Some(&self.me) || rec.state != SplitState::Owned {
            self.view.put_record(&id, entry.revision, rec);
            return self.revoke(&id, StopReason::Fenced);
        }
        h.record = rec;
        h.record_rev = entry.revision;
        h.resumed = true;
        let op = self.send(
            Bucket::State,
            StoreRequest::Get { key: keys::desc(&id) },
            Pending::DescRead { split: id.clone() },
        );
        let h = self.held.get_mut(&id).expect("held");
        h.stage = Stage::ReadingDesc;
        h.op = Some(op);
    }
}
