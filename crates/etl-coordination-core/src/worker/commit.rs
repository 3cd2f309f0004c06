//! Fenced progress commits (P8): a CAS on the split record against the revision of this
//! worker's own last write to it. A lost or in-doubt commit is resolved by re-reading before
//! anything else is decided; progress can replay, never regress.

use bytes::Bytes;

use crate::ids::{Epoch, OpId, Revision, SplitId};
use crate::io::{Action, CommitOutcome, Event, StopReason};
use crate::records::{self, EndReason, SplitRecord, SplitState, keys};
use crate::store::{Bucket, StoreRequest, StoreResult};

use super::Worker;
use super::outbox::{Pending, Read, Written};
use super::tenancy::{CommitInFlight, Stage};

/// The record a commit writes: `current` with the new progress; a terminal commit marks it
/// Done and clears the owner at the same epoch (P8). Progress beyond `base` (where the tenancy
/// started) resets the attempt count (P12): a tenancy that advances is no evidence of poison.
fn committed(current: &SplitRecord, base: &Option<Bytes>, progress: &Bytes, terminal: bool) -> SplitRecord {
    let mut record = current.clone();
    record.progress = Some(progress.clone());
    if base.as_ref() != Some(progress) {
        record.progressed = true;
        record.attempts = 0;
    }
    if terminal {
        record.state = SplitState::Done;
        record.owner = None;
        record.last_end = Some(EndReason::Finished);
    }
    record
}

impl Worker {
    /// P8: a lane's commit (or terminal commit). One commit per tenancy is in flight at a time;
    /// a commit of a stopped (starved) lane or an older epoch is answered `Lost`.
    pub(super) fn on_commit(&mut self, id: SplitId, epoch: Epoch, progress: Bytes, terminal: bool) {
        let reply =
            |w: &mut Self, outcome| w.outbox.push(Action::CommitDone { split: id.clone(), epoch, outcome });
        let Some(h) = self.held.get(&id) else { return reply(self, CommitOutcome::Lost) };
        if h.epoch != epoch {
            return reply(self, CommitOutcome::Lost);
        }
        if h.stage == Stage::Starved {
            // This lane was stopped (P11); a resumed lane is a new lane.
            return reply(self, CommitOutcome::Lost);
        }
        if !matches!(h.stage, Stage::Running | Stage::Stopping { .. }) || h.commit.is_some() {
            return reply(self, CommitOutcome::Retryable);
        }
        let record = committed(&h.record, &h.base.progress, &progress, terminal);
        let request = StoreRequest::CompareAndSwap {
            key: keys::split(&id),
            expected: h.record_rev,
            value: records::encode(&record),
            ttl: None,
        };
        let op = self.outbox.send(Bucket::State, request, Pending::RecordCommit { split: id.clone() });
        self.held.get_mut(&id).expect("held").commit = Some(CommitInFlight { op, progress, terminal });
    }

    pub(super) fn on_record_commit(&mut self, op: OpId, id: SplitId, result: StoreResult) {
        let Some(h) = self.held.get(&id) else { return };
        let Some(c) = h.commit.clone().filter(|c| c.op == op) else { return };
        let answer = self.record_answer(&id, result);
        match answer {
            Written::Applied(rev) => self.commit_applied(&id, rev),
            // P8: the fence said no and none of our writes to the record is in doubt: someone
            // else wrote it, the split is lost (no read needed, a lagging replica cannot delay it).
            Written::Conflict if !self.held[&id].record_in_doubt => self.commit_lost(&id),
            // P8: otherwise the outcome is decided by re-reading, never assumed.
            Written::Conflict | Written::InDoubt => {
                let op = self.outbox.send(
                    Bucket::State,
                    StoreRequest::Get { key: keys::split(&id) },
                    Pending::RecordCommitRead { split: id.clone() },
                );
                self.held.get_mut(&id).expect("held").commit = Some(CommitInFlight { op, ..c });
            }
            Written::Unavailable => self.finish_commit(&id, CommitOutcome::Retryable),
            Written::Fatal(e) => {
                self.finish_commit(&id, CommitOutcome::Retryable);
                self.fatal_store(e);
            }
        }
    }

    /// P8: the record decides a lost or in-doubt commit: our write landed; or the record still
    /// names us at our epoch (our earlier in-doubt write moved the revision: adopt it whole and
    /// answer `Retryable`); or the split is lost.
    pub(super) fn on_record_commit_read(&mut self, op: OpId, id: SplitId, result: StoreResult) {
        let Some(h) = self.held.get(&id) else { return };
        let Some(c) = h.commit.clone().filter(|c| c.op == op) else { return };
        let entry = match Read::of(result) {
            Read::Found(e) => e,
            Read::Absent => return self.commit_lost(&id),
            Read::Failed(_) => return self.finish_commit(&id, CommitOutcome::Retryable),
        };
        if entry.revision < self.held[&id].record_rev {
            // A lagging replica: decides nothing (the lane commits again later).
            return self.finish_commit(&id, CommitOutcome::Retryable);
        }
        let Ok(rec) = records::decode::<SplitRecord>(&entry.value) else { return self.commit_lost(&id) };
        let h = &self.held[&id];
        if rec == committed(&h.record, &h.base.progress, &c.progress, c.terminal) {
            // Our write landed.
            self.held.get_mut(&id).expect("held").record_in_doubt = false;
            return self.commit_applied(&id, entry.revision);
        }
        // Only the owner of this epoch writes a record without bumping the epoch, so an unchanged
        // owner and epoch prove nobody else wrote: our earlier in-doubt write moved the revision,
        // or (the revision we know) it has not landed yet. Not landed yet is not never: a write
        // past its timeout can still land, and a stream leader refuses a CAS against the old
        // revision while it holds our earlier write unreplicated. So it stays in doubt, and a
        // conflict on the retry is read again instead of taken as a loss.
        if rec.epoch == h.epoch && rec.owner.as_ref() == Some(&self.me) && rec.state == SplitState::Owned {
            let h = self.held.get_mut(&id).expect("held");
            if entry.revision > h.record_rev {
                h.record_rev = entry.revision;
                h.record = rec;
                h.record_in_doubt = false;
            }
            return self.finish_commit(&id, CommitOutcome::Retryable);
        }
        self.commit_lost(&id);
    }

    fn commit_applied(&mut self, id: &SplitId, rev: Revision) {
        let h = self.held.get_mut(id).expect("held");
        let c = h.commit.clone().expect("commit in flight");
        let record = committed(&h.record, &h.base.progress, &c.progress, c.terminal);
        h.record = record.clone();
        h.record_rev = rev;
        self.view.put_record(id, rev, record);
        if c.terminal {
            let epoch = h.epoch;
            h.commit = None;
            self.outbox.push(Action::CommitDone { split: id.clone(), epoch, outcome: CommitOutcome::Ok });
            self.outbox.event(Event::Finished { split: id.clone() });
            return self.delete_lease(id);
        }
        self.finish_commit(id, CommitOutcome::Ok);
    }

    /// P8: nothing was written; the lane stops and is told the split is lost.
    fn commit_lost(&mut self, id: &SplitId) {
        self.revoke(id, StopReason::Fenced);
    }

    /// Answers the lane, then runs an end that waited for the commit.
    fn finish_commit(&mut self, id: &SplitId, outcome: CommitOutcome) {
        let Some(h) = self.held.get_mut(id) else { return };
        h.commit = None;
        let epoch = h.epoch;
        self.outbox.push(Action::CommitDone { split: id.clone(), epoch, outcome });
        if let Some(end) = self.held.get_mut(id).and_then(|h| h.end.take()) {
            self.begin_end(id, end);
        }
    }
}
