//! Ending a tenancy: graceful release (P10) and reported failure, attempts and quarantine
//! (P12). The end is written to the record by CAS, then the lease is deleted.

use crate::config::Config;
use crate::ids::{Epoch, OpId, Revision, SplitId};
use crate::io::{Action, Event, StopReason};
use crate::records::{self, EndReason, SplitRecord, SplitState, keys};
use crate::store::{Bucket, StoreRequest, StoreResult};
use crate::time::Timestamp;

use super::Worker;
use super::outbox::{Pending, Read, Written};
use super::tenancy::{End, Stage};

impl Worker {
    /// P12: the source reports the split failed or unprocessable.
    pub(super) fn on_fail(&mut self, id: SplitId, epoch: Epoch, error: String, unprocessable: bool) {
        if self.held.get(&id).is_some_and(|h| h.epoch == epoch) {
            self.begin_end(&id, End::Fail { error, unprocessable });
        }
    }

    /// P10: a stopping lane acknowledged (after its last commit): release the split.
    pub(super) fn on_lane_stopped(&mut self, id: SplitId, epoch: Epoch) {
        if self.held.get(&id).is_some_and(|h| h.epoch == epoch && matches!(h.stage, Stage::Stopping { .. })) {
            self.begin_end(&id, End::Release);
        }
    }

    /// Writes the end of a tenancy to the record, then deletes the lease.
    pub(super) fn begin_end(&mut self, id: &SplitId, end: End) {
        let Some(h) = self.held.get_mut(id) else { return };
        if h.commit.is_some() {
            h.end = Some(end);
            return;
        }
        if matches!(h.stage, Stage::Ending | Stage::DeletingLease) {
            return;
        }
        let record = end_record(&self.cfg, &h.record, &end);
        let h = self.held.get_mut(id).expect("held");
        let was_running = h.stage == Stage::Running;
        let epoch = h.epoch;
        h.stage = Stage::Ending;
        h.end = Some(end.clone());
        h.end_write = Some(record);
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
        let h = &self.held[id];
        let request = StoreRequest::CompareAndSwap {
            key: keys::split(id),
            expected: h.record_rev,
            value: records::encode(h.end_write.as_ref().expect("an end record")),
            ttl: None,
        };
        let op = self.outbox.send(Bucket::State, request, Pending::RecordEnd { split: id.clone() });
        self.held.get_mut(id).expect("held").op = Some(op);
    }

    pub(super) fn on_record_end(&mut self, now: Timestamp, op: OpId, id: SplitId, result: StoreResult) {
        if !self.is_current(&id, op) {
            return;
        }
        let answer = self.record_answer(&id, result);
        match answer {
            Written::Applied(rev) => self.end_written(&id, rev),
            // No write of ours is in doubt: someone else wrote the record; the tenancy is over.
            Written::Conflict if !self.held[&id].record_in_doubt => self.delete_lease(&id),
            Written::Conflict | Written::InDoubt => {
                let op = self.outbox.send(
                    Bucket::State,
                    StoreRequest::Get { key: keys::split(&id) },
                    Pending::RecordEndRead { split: id.clone() },
                );
                self.held.get_mut(&id).expect("held").op = Some(op);
            }
            Written::Fatal(e) => self.fatal_store(e),
            Written::Unavailable => {
                // Nothing applied: try again shortly (the lease keeps being renewed meanwhile).
                let at = now + self.outbox.retry_backoff();
                let h = self.held.get_mut(&id).expect("held");
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
        let entry = match Read::of(result) {
            Read::Found(e) => e,
            Read::Absent => return self.delete_lease(&id),
            Read::Failed(_) => {
                let at = now + self.outbox.retry_backoff();
                let h = self.held.get_mut(&id).expect("held");
                h.stage = Stage::EndRetry { at };
                h.op = None;
                return;
            }
        };
        if entry.revision < self.held[&id].record_rev {
            // A lagging replica: never adopt a record older than one we know; try again shortly.
            let at = now + self.outbox.retry_backoff();
            let h = self.held.get_mut(&id).expect("held");
            h.stage = Stage::EndRetry { at };
            h.op = None;
            return;
        }
        let Ok(rec) = records::decode::<SplitRecord>(&entry.value) else { return self.delete_lease(&id) };
        let backoff = self.outbox.retry_backoff();
        let h = self.held.get_mut(&id).expect("held");
        if Some(&rec) == h.end_write.as_ref() {
            return self.end_written(&id, entry.revision);
        }
        if rec.epoch == h.epoch && rec.owner.as_ref() == Some(&self.me) && rec.state == SplitState::Owned {
            // Still ours: only this tenancy wrote since (an earlier in-doubt commit landed). End
            // from what is durable now, never from our older copy: progress must not regress (I1).
            // Our earlier write stays in doubt while the revision has not moved (it may land yet).
            let end = h.end.clone().expect("ending has an end");
            let unmoved = entry.revision == h.record_rev;
            h.end_write = Some(end_record(&self.cfg, &rec, &end));
            h.record_in_doubt &= unmoved;
            h.record = rec;
            h.record_rev = entry.revision;
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
        self.view.put_record(&id, entry.revision, rec);
        self.delete_lease(&id);
    }

    fn end_written(&mut self, id: &SplitId, rev: Revision) {
        let h = self.held.get_mut(id).expect("held");
        h.record_rev = rev;
        let record = h.end_write.take().expect("an end record");
        h.record = record.clone();
        self.view.put_record(id, rev, record.clone());
        match record.state {
            SplitState::Quarantined => self.outbox.event(Event::Quarantined {
                split: id.clone(),
                attempts: record.attempts,
                last_error: record.last_error,
            }),
            _ => self.outbox.event(Event::Released { split: id.clone() }),
        }
        self.delete_lease(id);
    }
}

impl Worker {
    /// The record a graceful release writes (P10).
    pub(super) fn release_record(&self, current: &SplitRecord) -> SplitRecord {
        end_record(&self.cfg, current, &End::Release)
    }
}

/// The record that ends a tenancy (P10 release, P12 failure and quarantine).
fn end_record(cfg: &Config, current: &SplitRecord, end: &End) -> SplitRecord {
    let mut record = current.clone();
    record.owner = None;
    match end {
        End::Release => {
            record.state = SplitState::Unleased;
            record.last_end = Some(EndReason::Released);
        }
        End::Fail { error, unprocessable } => {
            // P12: a failing tenancy counts only if it committed no progress.
            record.attempts += u32::from(!current.progressed);
            record.last_error = Some(error.clone());
            record.last_end = Some(if *unprocessable { EndReason::Unprocessable } else { EndReason::Failed });
            record.state = if record.attempts >= cfg.tuning.max_attempts {
                SplitState::Quarantined
            } else {
                SplitState::Unleased
            };
        }
    }
    record
}
