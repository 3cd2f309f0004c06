//! Ending a tenancy: graceful release (P10) and reported failure, attempts and quarantine
//! (P12). The end is written to the record by CAS, then the lease is deleted.

use crate::ids::{Epoch, OpId, Revision, SplitId};
use crate::io::{Action, Event, StopReason};
use crate::records::{self, SplitState, keys};
use crate::store::{Bucket, StoreRequest, StoreResult};
use crate::time::Timestamp;

use super::Worker;
use super::outbox::{Pending, Written};
use super::resolve::{RecordRead, still_ours};
use super::tenancy::{End, Stage};

impl Worker {
    /// P12: the source reports the split failed or unprocessable.
    pub(super) fn on_fail(&mut self, id: SplitId, epoch: Epoch, error: String, unprocessable: bool) {
        if let Some(h) = self.tenancies.get(&id).filter(|h| h.epoch == epoch) {
            // P9: its weight still counts as ours while it waits to be claimed again.
            self.failed_here.insert(id.clone(), h.weight);
            self.begin_end(&id, End::Fail { error, unprocessable });
        }
    }

    /// P12: the lane gives up on the split: quarantine it now.
    pub(super) fn on_give_up(&mut self, id: SplitId, epoch: Epoch, error: String) {
        if self.tenancies.get(&id).is_some_and(|h| h.epoch == epoch) {
            self.begin_end(&id, End::GiveUp { error });
        }
    }

    /// P10: the embedding layer ends a tenancy without blame: release it, as a drain does.
    pub(super) fn on_release(&mut self, id: SplitId, epoch: Epoch) {
        if self.tenancies.get(&id).is_some_and(|h| h.epoch == epoch) {
            self.begin_end(&id, End::Release);
        }
    }

    /// P10: a stopping lane acknowledged (after its last commit): release the split.
    pub(super) fn on_lane_stopped(&mut self, id: SplitId, epoch: Epoch) {
        if self
            .tenancies
            .get(&id)
            .is_some_and(|h| h.epoch == epoch && matches!(h.stage, Stage::Stopping { .. }))
        {
            self.begin_end(&id, End::Release);
        }
    }

    /// Writes the end of a tenancy to the record, then deletes the lease.
    pub(super) fn begin_end(&mut self, id: &SplitId, end: End) {
        let Some(h) = self.tenancies.get_mut(id) else { return };
        if h.commit.is_some() {
            h.ending.how = Some(end);
            return;
        }
        if matches!(h.stage, Stage::Ending | Stage::DeletingLease) {
            return;
        }
        let record = h.written.record.ended(&end, self.cfg.tuning.max_attempts);
        let h = &mut self.tenancies[id];
        let was_running = h.stage == Stage::Running;
        let epoch = h.epoch;
        h.stage = Stage::Ending;
        h.ending.how = Some(end.clone());
        h.ending.record = Some(record);
        if was_running && matches!(end, End::Release) {
            self.outbox.push(Action::StopLane {
                split: id.clone(),
                epoch,
                reason: StopReason::Draining,
                deadline: None,
            });
        }
        self.write_end(id);
    }

    /// The end record CAS, against the revision of our last write (P8's fence).
    fn write_end(&mut self, id: &SplitId) {
        let h = &self.tenancies[id];
        let request = StoreRequest::CompareAndSwap {
            key: keys::split(id),
            expected: h.written.rev,
            value: records::encode(h.ending.record.as_ref().expect("an end record")),
            ttl: None,
        };
        self.send_step(id, Bucket::State, request, Pending::RecordEnd { split: id.clone() });
    }

    pub(super) fn on_record_end(&mut self, now: Timestamp, op: OpId, id: SplitId, result: StoreResult) {
        if !self.is_current(&id, op) {
            return;
        }
        let answer = self.record_answer(&id, result);
        match answer {
            Written::Applied(rev) => self.end_written(&id, rev),
            // No write of ours is in doubt: someone else wrote the record; the tenancy is over.
            Written::Conflict if !self.tenancies[&id].written.in_doubt => self.delete_lease(&id),
            Written::Conflict | Written::InDoubt => {
                self.send_step(
                    &id,
                    Bucket::State,
                    StoreRequest::Get { key: keys::split(&id) },
                    Pending::RecordEndRead { split: id.clone() },
                );
            }
            Written::Fatal(e) => self.fatal_store(e),
            Written::Unavailable => {
                // Nothing applied: try again shortly (the lease keeps being renewed meanwhile).
                let at = now + self.outbox.retry_backoff();
                let h = &mut self.tenancies[&id];
                h.stage = Stage::EndRetry { at };
                h.op = None;
            }
        }
    }

    /// The record decides a lost or in-doubt end write: ours landed; still ours (end again
    /// from the durable record); or someone else's (the tenancy is over).
    pub(super) fn on_record_end_read(&mut self, now: Timestamp, op: OpId, id: SplitId, result: StoreResult) {
        if !self.is_current(&id, op) {
            return;
        }
        let h = &self.tenancies[&id];
        let (rev, rec) = match RecordRead::of(result, h.written.rev, h.ending.record.as_ref()) {
            RecordRead::Landed(rev) => return self.end_written(&id, rev),
            RecordRead::Other(rev, rec) => (rev, rec),
            RecordRead::Gone => return self.delete_lease(&id),
            // Decides nothing: try again shortly.
            RecordRead::Lagging | RecordRead::Unavailable => {
                let at = now + self.outbox.retry_backoff();
                let h = &mut self.tenancies[&id];
                h.stage = Stage::EndRetry { at };
                h.op = None;
                return;
            }
        };
        let backoff = self.outbox.retry_backoff();
        let h = &mut self.tenancies[&id];
        if still_ours(&rec, &self.me, h.epoch) {
            // Still ours: only this tenancy wrote since (an earlier in-doubt commit landed). End
            // from what is durable now, never from our older copy: progress must not regress (I1).
            // Our earlier write stays in doubt while the revision has not moved (it may land yet).
            let end = h.ending.how.clone().expect("ending has an end");
            let unmoved = rev == h.written.rev;
            h.ending.record = Some(rec.ended(&end, self.cfg.tuning.max_attempts));
            h.written.in_doubt &= unmoved;
            h.written.record = rec;
            h.written.rev = rev;
            if unmoved {
                // Refused although nothing moved: our earlier write is still in process at the
                // stream leader. End again after the backoff, not in a loop against it.
                h.stage = Stage::EndRetry { at: now + backoff };
                h.op = None;
                return;
            }
            return self.write_end(&id);
        }
        // Someone else owns it now: this tenancy is over.
        self.view.put_record(&id, rev, rec);
        self.delete_lease(&id);
    }

    fn end_written(&mut self, id: &SplitId, rev: Revision) {
        let h = &mut self.tenancies[id];
        h.written.rev = rev;
        let record = h.ending.record.take().expect("an end record");
        h.written.record = record.clone();
        self.view.put_record(id, rev, record.clone());
        match record.state {
            SplitState::Quarantined => self.outbox.event(Event::Quarantined {
                split: id.clone(),
                attempts: record.attempts,
                last_error: record.last_error,
            }),
            _ if record.last_end.is_some_and(|e| e.consumes_attempt()) => self.outbox.event(Event::Failed {
                split: id.clone(),
                attempts: record.attempts,
                retry_in: self.cfg.tuning.claim_backoff_after(record.attempts),
                error: record.last_error,
            }),
            _ => self.outbox.event(Event::Released { split: id.clone() }),
        }
        self.delete_lease(id);
    }
}
