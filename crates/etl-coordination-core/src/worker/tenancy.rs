//! Held splits: the state of one tenancy (acquiring, running, starved, stopping, ending), the
//! lane start, revocation, and the lease delete that ends every tenancy.

use bytes::Bytes;

use crate::ids::{Epoch, OpId, Revision, SplitId};
use crate::io::{AcquisitionReason, Action, CommitOutcome, Event, StopReason};
use crate::records::{self, SplitRecord, keys};
use crate::store::{Bucket, StoreRequest, StoreResult};
use crate::time::Timestamp;

use super::Worker;
use super::outbox::{Pending, Written};

/// One split this worker holds, is acquiring, or is ending.
#[derive(Debug, Clone)]
pub(super) struct Held {
    /// The epoch of this tenancy (the record's epoch once the claim landed).
    pub(super) epoch: Epoch,
    pub(super) weight: u64,
    pub(super) reason: AcquisitionReason,
    /// Whether the claim charges an attempt for the previous tenancy (P12).
    pub(super) consumes_attempt: bool,
    /// The record this tenancy was acquired from (acquisition only).
    pub(super) base: SplitRecord,
    /// The record as this worker last wrote it, and that write's revision (P8).
    pub(super) record: SplitRecord,
    pub(super) record_rev: Revision,
    /// The revision of our last write to the lease (none until the acquisition landed).
    pub(super) lease_rev: Option<Revision>,
    /// P11: until when the lease is trusted (send time of the last acknowledged renewal).
    pub(super) trusted_until: Timestamp,
    /// A renewal (or its resolving read) in flight.
    pub(super) renewing: Option<OpId>,
    pub(super) stage: Stage,
    /// The op of the current stage (acquisition steps, end write, lease delete).
    pub(super) op: Option<OpId>,
    pub(super) commit: Option<CommitInFlight>,
    /// What to do once the in-flight commit resolves.
    pub(super) end: Option<End>,
    /// The record that ends the tenancy, being written (stage Ending).
    pub(super) end_write: Option<SplitRecord>,
    /// A starved tenancy resuming under a new epoch (P11): no attempt, no acquisition event.
    pub(super) resuming: bool,
    /// Reads that found no descriptor (possibly from a lagging replica), and when the first
    /// of them was answered.
    pub(super) desc_misses: u32,
    pub(super) desc_first_miss: Option<Timestamp>,
    /// The split's descriptor, read before the claim.
    pub(super) descriptor: Option<Bytes>,
    /// A write of ours to the record may still land (its answer was in doubt): a conflict may
    /// then be our own doing, and only a read can tell (P8).
    pub(super) record_in_doubt: bool,
}

/// Where a tenancy is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Stage {
    /// P5: the lease create (or CAS over a displaced lease) is in flight.
    AcquiringLease,
    /// P5: the fenced record CAS is in flight.
    WritingRecord,
    /// Reading the descriptor before the lane starts.
    ReadingDesc,
    /// The lane runs.
    Running,
    /// P11: the lane was stopped because trust lapsed; renewals decide whether it resumes.
    Starved,
    /// P10: the lane was asked to commit and stop by `deadline`; it still runs.
    Stopping { deadline: Timestamp },
    /// P10, P12: the lane has stopped; the end record write failed and is retried at `at`.
    EndRetry { at: Timestamp },
    /// P10, P12: the end record is being written.
    Ending,
    /// The lease is being deleted; then the tenancy is over.
    DeletingLease,
}

/// A lane's commit in flight (P8).
#[derive(Debug, Clone)]
pub(super) struct CommitInFlight {
    /// The CAS, or the read resolving it.
    pub(super) op: OpId,
    pub(super) progress: Bytes,
    /// A terminal commit marks the split Done.
    pub(super) terminal: bool,
}

impl Worker {
    /// Classifies the answer to a write of ours to the record of `id` and keeps track of
    /// whether one of our writes to it may still land (P8: only then can a conflict be our own
    /// doing).
    pub(super) fn record_answer(&mut self, id: &SplitId, result: StoreResult) -> Written {
        let answer = Written::of(result);
        let h = self.held.get_mut(id).expect("held");
        match answer {
            Written::Applied(_) => h.record_in_doubt = false,
            Written::InDoubt => h.record_in_doubt = true,
            _ => {}
        }
        answer
    }
}

impl Held {
    /// Whether this acquisition took over a live lease (steal, reclaim): it must be completed,
    /// never abandoned, or the record would name the displaced owner without a lease.
    pub(super) fn displaced(&self) -> bool {
        matches!(self.reason, AcquisitionReason::Stolen | AcquisitionReason::Reclaimed)
    }
}

/// How a tenancy ends.
#[derive(Debug, Clone)]
pub(super) enum End {
    /// P10: gracefully; no attempt consumed.
    Release,
    /// P12: the source reported a failure; one attempt consumed.
    Fail { error: String, unprocessable: bool },
}

impl Worker {
    /// Stops a lane whose ownership is gone and forgets the split.
    pub(super) fn revoke(&mut self, id: &SplitId, reason: StopReason) {
        let Some(h) = self.held.remove(id) else { return };
        let lane_running = matches!(h.stage, Stage::Running | Stage::Stopping { .. });
        if lane_running {
            self.outbox.push(Action::StopLane { split: id.clone(), epoch: h.epoch, reason, deadline: None });
        }
        if let Some(c) = h.commit {
            self.outbox.forget(c.op);
            self.outbox.push(Action::CommitDone {
                split: id.clone(),
                epoch: h.epoch,
                outcome: CommitOutcome::Lost,
            });
        }
        if lane_running || h.stage == Stage::Starved {
            self.outbox.event(Event::Revoked { split: id.clone(), reason });
            // Our tenancy is over, but we are alive: end it gracefully if the record still
            // says it is ours (a store outage outlived our lease, say). The CAS against our last
            // write does nothing if someone else moved the record; a claimer racing it re-bases
            // on the release and charges no attempt (P12: an outage is no evidence of poison).
            self.release_if_unmoved(id, h.record_rev, &h.record);
        }
        self.blocked.insert(id.clone());
        // If the lease still names us after all (a renewal landed just before the fence), give
        // it back; the guarded delete does nothing if someone else holds it.
        if let Some(rev) = h.lease_rev {
            self.retire(keys::split(id), rev);
        }
    }

    /// Whether a delayed retry still belongs to a live step: the split may have been lost and
    /// re-acquired meanwhile (a new tenancy runs its own reads), or already moved on.
    /// A delayed write must also be the very write its step would send now: a claim CAS of an
    /// earlier tenancy of the split (given up meanwhile) never goes out for a later one, and a
    /// head write only for the leadership stint that queued it.
    pub(super) fn retry_wanted(&self, pending: &Pending, request: &StoreRequest) -> bool {
        match pending {
            Pending::DescRead { split } => {
                self.held.get(split).is_some_and(|h| h.op.is_none() && h.stage == Stage::ReadingDesc)
            }
            Pending::RecordClaimRead { split } => {
                self.held.get(split).is_some_and(|h| h.op.is_none() && h.stage == Stage::WritingRecord)
            }
            Pending::RecordClaim { split } => {
                self.held.get(split).is_some_and(|h| h.op.is_none() && h.stage == Stage::WritingRecord)
                    && self.claim_request(split).0 == *request
            }
            Pending::LeaseAcquireResolve { split, .. } => {
                self.held.get(split).is_some_and(|h| h.op.is_none() && h.stage == Stage::AcquiringLease)
            }
            Pending::HeadWrite { stint, .. } => self.leader.as_ref().is_some_and(|l| l.stint == *stint),
            _ => true,
        }
    }

    /// A retried op is the new current op of whatever it belongs to.
    pub(super) fn rebind_retry(&mut self, op: OpId, pending: &Pending) {
        match pending {
            Pending::DescRead { split }
            | Pending::RecordClaimRead { split }
            | Pending::RecordClaim { split }
            | Pending::LeaseAcquireResolve { split, .. } => {
                if let Some(h) = self.held.get_mut(split) {
                    h.op = Some(op);
                }
            }
            _ => {}
        }
    }

    /// Whether `op` is the current step of the tenancy of `id` (older answers are stale).
    pub(super) fn is_current(&self, id: &SplitId, op: OpId) -> bool {
        self.held.get(id).is_some_and(|h| h.op == Some(op))
    }

    /// Gives back a lease we hold but cannot use; best effort (it expires anyway).
    pub(super) fn abandon(&mut self, id: &SplitId) {
        if let Some(h) = self.held.remove(id) {
            if let Some(rev) = h.lease_rev {
                self.retire(keys::split(id), rev);
            }
            self.release_unresumed(id, &h);
        }
        self.blocked.insert(id.clone());
    }

    /// An acquisition lost its race (not an error, P5): forget it until something changes.
    pub(super) fn give_up_acquire(&mut self, id: &SplitId) {
        if let Some(h) = self.held.remove(id) {
            self.release_unresumed(id, &h);
        }
        self.blocked.insert(id.clone());
    }

    /// P11, P12: a starved tenancy that could not move to its new epoch (its lease CAS lost, or
    /// the worker started leaving) still owns the record at the old epoch: release it, by a CAS
    /// against our last write that does nothing if the record moved, rather than leave it owned
    /// without a lease (its next claimer would charge an attempt for a graceful end).
    fn release_unresumed(&mut self, id: &SplitId, h: &Held) {
        if !h.resuming {
            return;
        }
        self.release_if_unmoved(id, h.record_rev, &h.base);
    }

    /// A best-effort release of `record` (the tenancy is over): a CAS against our last write,
    /// `expected`, which does nothing if someone else moved the record meanwhile.
    pub(super) fn release_if_unmoved(&mut self, id: &SplitId, expected: Revision, record: &SplitRecord) {
        let request = StoreRequest::CompareAndSwap {
            key: keys::split(id),
            expected,
            value: records::encode(&self.release_record(record)),
            ttl: None,
        };
        self.outbox.send(Bucket::State, request, Pending::Cleanup);
    }

    /// Starts the lane of a tenancy whose lease and record are ours, unless trust lapsed
    /// meanwhile (P11: never a lane unfenced; renewals decide whether it resumes).
    pub(super) fn start_lane(&mut self, now: Timestamp, id: &SplitId) {
        let h = self.held.get_mut(id).expect("held");
        h.op = None;
        if h.trusted_until <= now {
            h.stage = Stage::Starved;
            return;
        }
        h.stage = Stage::Running;
        let action = Action::StartLane {
            split: id.clone(),
            epoch: h.epoch,
            descriptor: h.descriptor.clone().expect("descriptor read before the claim"),
            weight: h.weight,
            progress: h.record.progress.clone(),
            reason: (!h.resuming).then_some(h.reason),
        };
        h.resuming = false;
        self.outbox.push(action);
    }

    /// Ends the tenancy by deleting its lease (after a renewal in flight, so the expected
    /// revision is current).
    pub(super) fn delete_lease(&mut self, id: &SplitId) {
        let Some(h) = self.held.get_mut(id) else { return };
        h.stage = Stage::DeletingLease;
        h.op = None;
        if h.renewing.is_some() {
            // Wait for the renewal so the delete's expected revision is current.
            return;
        }
        let Some(rev) = h.lease_rev else {
            self.held.remove(id);
            return;
        };
        let op = self.outbox.send(
            Bucket::Lease,
            StoreRequest::Delete { key: keys::split(id), expected: rev },
            Pending::LeaseDelete { split: id.clone() },
        );
        self.held.get_mut(id).expect("held").op = Some(op);
    }

    /// The tenancy is over either way; a delete that did not land is retried by `retire` (the
    /// lease must not outlive a finished worker only because one delete failed).
    pub(super) fn on_lease_delete(&mut self, now: Timestamp, op: OpId, id: SplitId, result: StoreResult) {
        if self.is_current(&id, op) {
            self.held.remove(&id);
            if result.is_err() {
                self.on_retire(now, keys::split(&id), result);
            }
        }
    }
}
