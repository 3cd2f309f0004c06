//! Held splits: the state of one tenancy (acquiring, running, starved, stopping, ending), the
//! lane start, revocation, and the lease delete that ends every tenancy.

use std::collections::{BTreeMap, BTreeSet};

use bytes::Bytes;

use crate::ids::{Epoch, OpId, Revision, SplitId};
use crate::io::{AcquisitionReason, Action, CommitOutcome, Event, StopReason};
use crate::records::{self, SplitRecord, SplitState, keys};
use crate::store::{Bucket, StoreRequest, StoreResult};
use crate::time::Timestamp;

use super::Worker;
use super::outbox::{ClaimOrphan, Pending, Written};
use super::resolve::RecordRead;

/// One split this worker holds, is acquiring, or is ending. What belongs to one concern is
/// grouped: how the tenancy was (re)acquired, our last write to the record, our lease, how it
/// ends.
#[derive(Debug, Clone)]
pub(super) struct Held {
    /// The epoch of this tenancy (the record's epoch once the claim landed).
    pub(super) epoch: Epoch,
    pub(super) weight: u64,
    /// The record this tenancy was acquired from (its progress is where the tenancy started).
    pub(super) base: SplitRecord,
    pub(super) acquisition: Acquisition,
    pub(super) written: OurRecord,
    pub(super) lease: OurLease,
    pub(super) stage: Stage,
    /// The op of the current stage (acquisition steps, end write, lease delete).
    pub(super) op: Option<OpId>,
    pub(super) commit: Option<CommitInFlight>,
    pub(super) ending: Ending,
}

/// How a tenancy was acquired, and what its acquisition (or a resume, P11) still needs.
#[derive(Debug, Clone)]
pub(super) struct Acquisition {
    pub(super) reason: AcquisitionReason,
    /// Whether the claim charges an attempt for the previous tenancy (P12).
    pub(super) consumes_attempt: bool,
    /// P12: the split has unexplained failures behind it (its attempts after this claim are
    /// not 0): this tenancy is its trial (see `Worker::on_trial`).
    pub(super) suspect: bool,
    /// When the trial ends if the tenancy has not progressed by then: a lease after its lane
    /// first started (`None` until it starts).
    pub(super) trial_until: Option<Timestamp>,
    /// A starved tenancy resuming under a new epoch (P11): no attempt, no acquisition event.
    pub(super) resuming: bool,
    /// Reads that found no descriptor (possibly from a lagging replica), and when the first
    /// of them was answered.
    pub(super) desc_misses: u32,
    pub(super) desc_first_miss: Option<Timestamp>,
    /// The split's descriptor, read before the claim.
    pub(super) descriptor: Option<Bytes>,
}

/// The record as this worker last wrote it (P8).
#[derive(Debug, Clone)]
pub(super) struct OurRecord {
    pub(super) record: SplitRecord,
    /// That write's revision: the fence of our next write.
    pub(super) rev: Revision,
    /// A write of ours to the record may still land (its answer was in doubt): a conflict may
    /// then be our own doing, and only a read can tell (P8).
    pub(super) in_doubt: bool,
}

/// Our lease of the split (P7, P11).
#[derive(Debug, Clone)]
pub(super) struct OurLease {
    /// The revision of our last write to the lease (none until the acquisition landed).
    pub(super) rev: Option<Revision>,
    /// P11: until when the lease is trusted (send time of the last acknowledged renewal).
    pub(super) trusted_until: Timestamp,
    /// A renewal (or its resolving read) in flight.
    pub(super) renewing: Option<OpId>,
}

/// How the tenancy ends, once it does.
#[derive(Debug, Clone, Default)]
pub(super) struct Ending {
    /// What to do once the in-flight commit resolves, or what is being done (P10, P12).
    pub(super) how: Option<End>,
    /// The record that ends the tenancy, being written (stages Ending and EndRetry).
    pub(super) record: Option<SplitRecord>,
}

/// Every tenancy of this worker (held, being acquired or ending), by split, and the splits
/// not to attempt again until the next heartbeat or a watch event about them. Indexing by a
/// split id panics when the split has no tenancy: the rules index only splits they know they
/// hold (the answer's dispatch checked it), so a miss is a bug in the core.
#[derive(Debug, Default)]
pub(super) struct Tenancies {
    held: BTreeMap<SplitId, Held>,
    blocked: BTreeSet<SplitId>,
    /// Splits with an orphaned claim of ours still in flight (or its read): not attempted until
    /// it resolves, or a new claim of ours could write the very record the orphan's release
    /// is based on.
    orphaned: BTreeSet<SplitId>,
}

impl Tenancies {
    pub(super) fn get(&self, id: &SplitId) -> Option<&Held> {
        self.held.get(id)
    }

    pub(super) fn get_mut(&mut self, id: &SplitId) -> Option<&mut Held> {
        self.held.get_mut(id)
    }

    pub(super) fn contains(&self, id: &SplitId) -> bool {
        self.held.contains_key(id)
    }

    pub(super) fn insert(&mut self, id: SplitId, h: Held) {
        self.held.insert(id, h);
    }

    pub(super) fn remove(&mut self, id: &SplitId) -> Option<Held> {
        self.held.remove(id)
    }

    /// Every tenancy, taken (the worker keeps none).
    pub(super) fn take_all(&mut self) -> BTreeMap<SplitId, Held> {
        std::mem::take(&mut self.held)
    }

    pub(super) fn len(&self) -> usize {
        self.held.len()
    }

    pub(super) fn is_empty(&self) -> bool {
        self.held.is_empty()
    }

    pub(super) fn ids(&self) -> impl Iterator<Item = &SplitId> {
        self.held.keys()
    }

    pub(super) fn values(&self) -> impl Iterator<Item = &Held> {
        self.held.values()
    }

    pub(super) fn iter(&self) -> impl Iterator<Item = (&SplitId, &Held)> {
        self.held.iter()
    }

    /// Not to attempt again until the next heartbeat or a watch event about it.
    pub(super) fn block(&mut self, id: SplitId) -> bool {
        self.blocked.insert(id)
    }

    pub(super) fn unblock(&mut self, id: &SplitId) -> bool {
        self.blocked.remove(id)
    }

    pub(super) fn is_blocked(&self, id: &SplitId) -> bool {
        self.blocked.contains(id) || self.orphaned.contains(id)
    }

    /// Every blocked split gets another chance.
    pub(super) fn unblock_all(&mut self) {
        self.blocked.clear();
    }
}

impl std::ops::Index<&SplitId> for Tenancies {
    type Output = Held;

    fn index(&self, id: &SplitId) -> &Held {
        self.held.get(id).unwrap_or_else(|| panic!("no tenancy of {id}"))
    }
}

impl std::ops::IndexMut<&SplitId> for Tenancies {
    fn index_mut(&mut self, id: &SplitId) -> &mut Held {
        self.held.get_mut(id).unwrap_or_else(|| panic!("no tenancy of {id}"))
    }
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
        let h = &mut self.tenancies[id];
        match answer {
            Written::Applied(_) => h.written.in_doubt = false,
            Written::InDoubt => h.written.in_doubt = true,
            _ => {}
        }
        answer
    }
}

impl Held {
    /// Whether this acquisition took over a live lease (steal, reclaim): it must be completed,
    /// never abandoned, or the record would name the displaced owner without a lease.
    pub(super) fn displaced(&self) -> bool {
        matches!(self.acquisition.reason, AcquisitionReason::Stolen | AcquisitionReason::Reclaimed)
    }
}

pub(super) use crate::lifecycle::End;

impl Worker {
    /// Stops a lane whose ownership is gone and forgets the split.
    pub(super) fn revoke(&mut self, id: &SplitId, reason: StopReason) {
        let Some(h) = self.tenancies.remove(id) else { return };
        let lane_running = matches!(h.stage, Stage::Running | Stage::Stopping { .. });
        if lane_running {
            self.outbox.push(Action::StopLane { split: id.clone(), epoch: h.epoch, reason, deadline: None });
        }
        if let Some(c) = &h.commit {
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
            self.release_if_unmoved(id, h.written.rev, &h.written.record);
        }
        if h.stage == Stage::WritingRecord {
            self.orphan_claim(id, &h);
        }
        // A resume moving a starved tenancy to a new epoch, revoked before its claim landed: the
        // record still names us at the old one. Released against the revision the resume's
        // claim expects, so at most one of the two lands (once the claim has landed, the
        // record is at the new epoch and this would write an older one over it).
        if matches!(h.stage, Stage::AcquiringLease | Stage::WritingRecord) {
            self.release_unresumed(id, &h);
        }
        self.tenancies.block(id.clone());
        // If the lease still names us after all (a renewal landed just before the fence), give
        // it back; the guarded delete does nothing if someone else holds it.
        if let Some(rev) = h.lease.rev {
            self.retire(keys::split(id), rev);
        }
    }

    /// Whether `op` is the current step of the tenancy of `id` (older answers are stale).
    pub(super) fn is_current(&self, id: &SplitId, op: OpId) -> bool {
        self.tenancies.get(id).is_some_and(|h| h.op == Some(op))
    }

    /// Gives back a lease we hold but cannot use; best effort (it expires anyway).
    pub(super) fn abandon(&mut self, id: &SplitId) {
        if let Some(h) = self.tenancies.remove(id) {
            if let Some(rev) = h.lease.rev {
                self.retire(keys::split(id), rev);
            }
            self.release_unresumed(id, &h);
        }
        self.tenancies.block(id.clone());
    }

    /// An acquisition lost its race (not an error, P5): forget it until something changes.
    pub(super) fn give_up_acquire(&mut self, id: &SplitId) {
        if let Some(h) = self.tenancies.remove(id) {
            self.release_unresumed(id, &h);
        }
        self.tenancies.block(id.clone());
    }

    /// P11, P12: a starved tenancy that could not move to its new epoch (its lease CAS lost, or
    /// the worker started leaving) still owns the record at the old epoch: release it, by a CAS
    /// against our last write that does nothing if the record moved, rather than leave it owned
    /// without a lease (its next claimer would charge an attempt for a graceful end).
    fn release_unresumed(&mut self, id: &SplitId, h: &Held) {
        if !h.acquisition.resuming {
            return;
        }
        self.release_if_unmoved(id, h.written.rev, &h.base);
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
        self.outbox.send(Bucket::State, request, Pending::Release);
    }

    /// Starts the lane of a tenancy whose lease and record are ours, unless trust lapsed
    /// meanwhile (P11: never a lane unfenced; renewals decide whether it resumes).
    pub(super) fn start_lane(&mut self, now: Timestamp, id: &SplitId) {
        let h = &mut self.tenancies[id];
        h.op = None;
        if h.lease.trusted_until <= now {
            h.stage = Stage::Starved;
            return;
        }
        h.stage = Stage::Running;
        if h.acquisition.suspect && h.acquisition.trial_until.is_none() {
            h.acquisition.trial_until = Some(now + self.cfg.tuning.lease_duration);
        }
        let action = Action::StartLane {
            split: id.clone(),
            epoch: h.epoch,
            descriptor: h.acquisition.descriptor.clone().expect("descriptor read before the claim"),
            weight: h.weight,
            progress: h.written.record.progress.clone(),
            reason: (!h.acquisition.resuming).then_some(h.acquisition.reason),
        };
        h.acquisition.resuming = false;
        self.outbox.push(action);
    }

    /// Ends the tenancy by deleting its lease (after a renewal in flight, so the expected
    /// revision is current).
    pub(super) fn delete_lease(&mut self, id: &SplitId) {
        let Some(h) = self.tenancies.get_mut(id) else { return };
        h.stage = Stage::DeletingLease;
        h.op = None;
        if h.lease.renewing.is_some() {
            // Wait for the renewal so the delete's expected revision is current.
            return;
        }
        let Some(rev) = h.lease.rev else {
            self.tenancies.remove(id);
            return;
        };
        self.send_step(
            id,
            Bucket::Lease,
            StoreRequest::Delete { key: keys::split(id), expected: rev },
            Pending::LeaseDelete { split: id.clone() },
        );
    }

    /// The tenancy is over either way; a delete that did not land is retried by `retire` (the
    /// lease must not outlive a finished worker only because one delete failed).
    pub(super) fn on_lease_delete(&mut self, now: Timestamp, op: OpId, id: SplitId, result: StoreResult) {
        if self.is_current(&id, op) {
            self.tenancies.remove(&id);
            if result.is_err() {
                self.on_retire(now, keys::split(&id), result);
            }
        }
    }

    /// The record a graceful release writes (P10).
    pub(super) fn release_record(&self, current: &SplitRecord) -> SplitRecord {
        current.ended(&End::Release, self.cfg.tuning.max_attempts)
    }
}

impl Worker {
    /// Sends a step of the tenancy of `id`: its answer is the tenancy's current op (older
    /// answers are stale).
    pub(super) fn send_step(
        &mut self,
        id: &SplitId,
        bucket: Bucket,
        request: StoreRequest,
        pending: Pending,
    ) {
        let op = self.outbox.send(bucket, request, pending);
        self.tenancies[id].op = Some(op);
    }

    /// Retries a step of the tenancy of `id` after the backoff; no op is current meanwhile (the
    /// retry becomes current when it is sent).
    pub(super) fn retry_step(
        &mut self,
        now: Timestamp,
        id: &SplitId,
        bucket: Bucket,
        request: StoreRequest,
        pending: Pending,
    ) {
        self.tenancies[id].op = None;
        self.outbox.retry_later(now, bucket, request, pending);
    }
}

impl Worker {
    /// P5, P12: the tenancy of `id` was revoked (its lease expired or was taken) while its claim
    /// CAS, or the read resolving it, was in flight as `op`. The claim may still land, leaving the
    /// record owned by us at an epoch whose lease is gone; its next claimer would then charge an
    /// attempt for a tenancy that never ran (seed 5,284,442 quarantined a healthy split so). The
    /// request's answer now goes to [`Worker::on_orphan_claim`], which releases what landed.
    pub(super) fn orphan_claim(&mut self, id: &SplitId, h: &Held) {
        if h.written.record.state != SplitState::Owned {
            // A claim that quarantines the split is final whoever's lease expired: it never
            // names an owner, and a terminal record is never rewritten (I5).
            return;
        }
        let orphan = ClaimOrphan { split: id.clone(), base: h.written.rev, record: h.written.record.clone() };
        match h.op {
            Some(op) => {
                let mut repurposed = false;
                self.outbox.repurpose(op, |p| {
                    let new = match p {
                        Pending::RecordClaim { .. } => Pending::OrphanClaim(orphan.clone()),
                        Pending::RecordClaimRead { .. } => Pending::OrphanClaimRead(orphan.clone()),
                        _ => return None,
                    };
                    repurposed = true;
                    Some(new)
                });
                if repurposed {
                    self.tenancies.orphaned.insert(id.clone());
                }
            }
            // Between a read that decided nothing and its retry: the claim may still land.
            None if h.written.in_doubt => self.read_orphan(orphan),
            None => {}
        }
    }

    /// An orphaned claim was answered: if it landed, release the record by a CAS against the
    /// claim's revision (which does nothing if someone moved it since); if in doubt, read.
    /// Nothing landed otherwise.
    pub(super) fn on_orphan_claim(&mut self, orphan: ClaimOrphan, result: StoreResult) {
        match Written::of(result) {
            Written::Applied(rev) => self.release_orphan(orphan, rev),
            Written::InDoubt => self.read_orphan(orphan),
            Written::Conflict | Written::Unavailable | Written::Fatal(_) => {
                self.tenancies.orphaned.remove(&orphan.split);
            }
        }
    }

    fn read_orphan(&mut self, orphan: ClaimOrphan) {
        self.tenancies.orphaned.insert(orphan.split.clone());
        let request = StoreRequest::Get { key: keys::split(&orphan.split) };
        self.outbox.send(Bucket::State, request, Pending::OrphanClaimRead(orphan));
    }

    /// The orphaned claim landed at `rev`: release it; the split may be attempted again.
    fn release_orphan(&mut self, orphan: ClaimOrphan, rev: Revision) {
        self.tenancies.orphaned.remove(&orphan.split);
        self.release_if_unmoved(&orphan.split, rev, &orphan.record);
    }

    /// The record after an orphaned claim in doubt: released if it holds the claim. A read
    /// that decides nothing is repeated after the backoff. Best effort: a claim that lands after
    /// a read showed it absent stays (its next claimer charges an attempt, as for any tenancy
    /// that ended without a release).
    pub(super) fn on_orphan_claim_read(&mut self, now: Timestamp, orphan: ClaimOrphan, result: StoreResult) {
        match RecordRead::of(result, orphan.base, Some(&orphan.record)) {
            RecordRead::Landed(rev) => self.release_orphan(orphan, rev),
            RecordRead::Lagging | RecordRead::Unavailable => {
                let request = StoreRequest::Get { key: keys::split(&orphan.split) };
                self.outbox.retry_later(now, Bucket::State, request, Pending::OrphanClaimRead(orphan));
            }
            RecordRead::Other(..) | RecordRead::Gone => {
                self.tenancies.orphaned.remove(&orphan.split);
            }
        }
    }
}
