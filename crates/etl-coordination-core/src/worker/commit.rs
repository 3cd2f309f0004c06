//! Fenced progress commits (P8): a CAS on the split record against the revision of this
//! worker's own last write to it. A lost or in-doubt commit is resolved by re-reading before
//! anything else is decided; progress can replay, never regress.

use bytes::Bytes;

use crate::ids::{Epoch, OpId, Revision, SplitId};
use crate::io::{Action, CommitOutcome, Event, StopReason};
use crate::records::{self, keys};
use crate::store::{Bucket, StoreRequest, StoreResult};

use super::Worker;
use super::outbox::{Pending, Written};
use super::resolve::{RecordRead, still_ours};
use super::tenancy::{CommitInFlight, Stage};

impl Worker {
    /// P8: a lane's commit (or terminal commit). One commit per tenancy is in flight at a time;
    /// a commit of a stopped (starved) lane or an older epoch is answered `Lost`.
    pub(super) fn on_commit(&mut self, id: SplitId, epoch: Epoch, progress: Bytes, terminal: bool) {
        let reply =
            |w: &mut Self, outcome| w.outbox.push(Action::CommitDone { split: id.clone(), epoch, outcome });
        let Some(h) = self.tenancies.get(&id) else { return reply(self, CommitOutcome::Lost) };
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
        let record = h.written.record.committed(&h.base.progress, &progress, terminal);
        let request = StoreRequest::CompareAndSwap {
            key: keys::split(&id),
            expected: h.written.rev,
            value: records::encode(&record),
            ttl: None,
        };
        let op = self.outbox.send(Bucket::State, request, Pending::RecordCommit { split: id.clone() });
        self.tenancies[&id].commit = Some(CommitInFlight { op, progress, terminal });
    }

    pub(super) fn on_record_commit(&mut self, op: OpId, id: SplitId, result: StoreResult) {
        let Some(h) = self.tenancies.get(&id) else { return };
        let Some(c) = h.commit.clone().filter(|c| c.op == op) else { return };
        let answer = self.record_answer(&id, result);
        match answer {
            Written::Applied(rev) => self.commit_applied(&id, rev),
            // P8: the fence said no and none of our writes to the record is in doubt: someone
            // else wrote it, the split is lost (no read needed, a lagging replica cannot delay it).
            Written::Conflict if !self.tenancies[&id].written.in_doubt => self.commit_lost(&id),
            // P8: otherwise the outcome is decided by re-reading, never assumed.
            Written::Conflict | Written::InDoubt => {
                let op = self.outbox.send(
                    Bucket::State,
                    StoreRequest::Get { key: keys::split(&id) },
                    Pending::RecordCommitRead { split: id.clone() },
                );
                self.tenancies[&id].commit = Some(CommitInFlight { op, ..c });
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
        let Some(h) = self.tenancies.get(&id) else { return };
        let Some(c) = h.commit.clone().filter(|c| c.op == op) else { return };
        let ours = h.written.record.committed(&h.base.progress, &c.progress, c.terminal);
        let (rev, rec) = match RecordRead::of(result, h.written.rev, Some(&ours)) {
            RecordRead::Landed(rev) => {
                self.tenancies[&id].written.in_doubt = false;
                return self.commit_applied(&id, rev);
            }
            RecordRead::Other(rev, rec) => (rev, rec),
            RecordRead::Gone => return self.commit_lost(&id),
            // Decides nothing (the lane commits again later).
            RecordRead::Lagging | RecordRead::Unavailable => {
                return self.finish_commit(&id, CommitOutcome::Retryable);
            }
        };
        // Still ours: our earlier in-doubt write moved the revision, or (the revision we know)
        // it has not landed yet. Not landed yet is not never: a write past its timeout can still
        // land, and a stream leader refuses a CAS against the old revision while it holds our
        // earlier write unreplicated. So it stays in doubt, and a conflict on the retry is read
        // again instead of taken as a loss.
        if still_ours(&rec, &self.me, h.epoch) {
            let h = &mut self.tenancies[&id];
            if rev > h.written.rev {
                h.written.rev = rev;
                h.written.record = rec;
                h.written.in_doubt = false;
            }
            return self.finish_commit(&id, CommitOutcome::Retryable);
        }
        self.commit_lost(&id);
    }

    fn commit_applied(&mut self, id: &SplitId, rev: Revision) {
        let h = &mut self.tenancies[id];
        let c = h.commit.clone().expect("commit in flight");
        let record = h.written.record.committed(&h.base.progress, &c.progress, c.terminal);
        h.written.record = record.clone();
        h.written.rev = rev;
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
        let Some(h) = self.tenancies.get_mut(id) else { return };
        h.commit = None;
        let epoch = h.epoch;
        self.outbox.push(Action::CommitDone { split: id.clone(), epoch, outcome });
        if let Some(end) = self.tenancies.get_mut(id).and_then(|h| h.ending.how.take()) {
            self.begin_end(id, end);
        }
    }
}
