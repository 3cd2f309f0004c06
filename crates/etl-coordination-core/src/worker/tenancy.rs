//! Held splits: the state of one tenancy (acquiring, running, starved, stopping, ending), the
//! lane start, revocation, and the lease delete that ends every tenancy.

use bytes::Bytes;

use crate::ids::{Epoch, OpId, Revision, SplitId};
use crate::io::{AcquisitionReason, Action, CommitOutcome, Event, StopReason};
use crate::records::{self, Descriptor, SplitRecord, keys};
use crate::store::{Bucket, StoreRequest, StoreResult};
use crate::time::Timestamp;

use super::outbox::{Pending, Read};
use super::{Phase, Worker};

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
    /// Send time of the oldest lease write since the last acknowledged one (P11: a revision
    /// found by a read may have been written by any of them).
    pub(super) unacked_since: Option<Timestamp>,
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
    /// Reads that found no descriptor (possibly from a lagging replica).
    pub(super) desc_misses: u32,
    /// A write of ours to the record may still land (its answer was in doubt): a conflict may
    /// then be our own doing, and only a read can tell (P8).
    pub(super) record_in_doubt: bool,
}

/// Reads of an absent descriptor before the split is called unprocessable.
const DESC_MISSES_MAX: u32 = 5;

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
    /// P10: the lane was asked to commit and stop by `deadline`.
    Stopping { deadline: Timestamp },
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
            self.out.push(Action::StopLane { split: id.clone(), epoch: h.epoch, reason, deadline: None });
        }
        if let Some(c) = h.commit {
            self.pending.remove(&c.op);
            self.out.push(Action::CommitDone {
                split: id.clone(),
                epoch: h.epoch,
                outcome: CommitOutcome::Lost,
            });
        }
        if lane_running || h.stage == Stage::Starved {
            self.event(Event::Revoked { split: id.clone(), reason });
        }
        self.blocked.insert(id.clone());
    }

    /// Whether a delayed retry still belongs to a live step: the split may have been lost and
    /// re-acquired meanwhile (a new tenancy runs its own reads), or already moved on.
    pub(super) fn retry_wanted(&self, pending: &Pending) -> bool {
        match pending {
            Pending::DescRead { split } => {
                self.held.get(split).is_some_and(|h| h.op.is_none() && h.stage == Stage::ReadingDesc)
            }
            Pending::RecordClaimRead { split } => {
                self.held.get(split).is_some_and(|h| h.op.is_none() && h.stage == Stage::WritingRecord)
            }
            _ => true,
        }
    }

    /// A retried op is the new current op of whatever it belongs to.
    pub(super) fn rebind_retry(&mut self, op: OpId, pending: &Pending) {
        match pending {
            Pending::DescRead { split } | Pending::RecordClaimRead { split } => {
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
        if let Some(h) = self.held.remove(id)
            && let Some(rev) = h.lease_rev
        {
            self.retire(keys::split(id), rev);
        }
        self.blocked.insert(id.clone());
    }

    /// An acquisition lost its race (not an error, P5): forget it until something changes.
    pub(super) fn give_up_acquire(&mut self, id: &SplitId) {
        self.held.remove(id);
        self.blocked.insert(id.clone());
    }

    /// Both the lease and the record are ours: announce the acquisition and fetch the
    /// descriptor for the lane.
    pub(super) fn start_lane_setup(&mut self, id: &SplitId) {
        let h = &self.held[id];
        let (reason, epoch) = (h.reason, h.epoch);
        if !h.resuming {
            self.event(Event::Acquired { split: id.clone(), reason, epoch });
        }
        if self.phase == Phase::Leaving {
            return self.begin_end(id, End::Release);
        }
        let op = self.send(
            Bucket::State,
            StoreRequest::Get { key: keys::desc(id) },
            Pending::DescRead { split: id.clone() },
        );
        let h = self.held.get_mut(id).expect("held");
        h.stage = Stage::ReadingDesc;
        h.op = Some(op);
    }

    /// Starts the lane once the descriptor is read, unless trust lapsed meanwhile (P11).
    pub(super) fn on_desc_read(&mut self, now: Timestamp, op: OpId, id: SplitId, result: StoreResult) {
        if !self.is_current(&id, op) {
            return;
        }
        let read = Read::of(result);
        match read {
            Read::Found(ref e) => match records::decode::<Descriptor>(&e.value) {
                Ok(d) => {
                    if self.phase == Phase::Leaving {
                        return self.begin_end(&id, End::Release);
                    }
                    let h = self.held.get_mut(&id).expect("held");
                    if h.trusted_until <= now {
                        // P11: the lease may be gone (we were paused or cut off): never start a
                        // lane unfenced. Renewals decide whether it resumes.
                        h.stage = Stage::Starved;
                        h.op = None;

                        return;
                    }
                    h.stage = Stage::Running;
                    h.op = None;
                    let action = Action::StartLane {
                        split: id.clone(),
                        epoch: h.epoch,
                        descriptor: d.descriptor,
                        weight: h.weight,
                        progress: h.record.progress.clone(),
                        reason: (!h.resuming).then_some(h.reason),
                    };
                    h.resuming = false;
                    self.out.push(action);
                }
                Err(err) => {
                    self.event(Event::Undecodable { key: e.key.to_string(), error: err.to_string() });
                    self.begin_end(
                        &id,
                        End::Fail { error: format!("undecodable descriptor: {err}"), unprocessable: true },
                    );
                }
            },
            // Descriptors are written before the manifest that lists them and never deleted, so
            // an absent one is most likely a read from a lagging replica: read again a few
            // times before calling the split unprocessable (P12: a stale read is no poison).
            Read::Absent if self.held[&id].desc_misses + 1 >= DESC_MISSES_MAX => {
                self.begin_end(
                    &id,
                    End::Fail { error: "descriptor missing from the store".into(), unprocessable: true },
                );
            }
            Read::Absent | Read::Failed(_) => {
                let h = self.held.get_mut(&id).expect("held");
                h.desc_misses += u32::from(matches!(read, Read::Absent));
                self.held.get_mut(&id).expect("held").op = None;
                self.retry_later(
                    now,
                    Bucket::State,
                    StoreRequest::Get { key: keys::desc(&id) },
                    Pending::DescRead { split: id },
                );
            }
        }
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
        let op = self.send(
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
