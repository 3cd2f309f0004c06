//! A stream leader that lost its quorum (`Stuck`): writes wait at it and land late or never,
//! reads through a cut-off node see its old state.

use etl_coordination_core::records::{self, SplitRecord, keys};
use etl_coordination_core::{
    Bucket, Key, Owner, SplitId, StoreError, StoreReply, StoreRequest, StoreResult, Timestamp,
};
use etl_coordination_memory::MemoryKv;

use super::net::{Sent, bi, no_answer, written_key, written_value};
use super::{Answer, World};
use crate::fault::Fault;

/// A stream leader cut off from its followers (what the real-process test that cuts the lease
/// stream leader's node off showed): it takes writes but cannot commit them. They wait, in
/// order, until it regains its quorum (they land late) or steps down (the next leader never saw
/// some or all of them). Meanwhile reads through it show the state it had when it was cut off,
/// expiries wait too, and a write to a key with one already waiting is refused: JetStream
/// rejects an expected-sequence publish while another for the same subject is in process, so a
/// retry against the revision a read shows conflicts although nobody else wrote.
///
/// Two shapes: the leader lost its followers and every worker talks to it (no election, the
/// quorum comes back); or its node is cut off with the workers connected to it (`isolated`)
/// while the other nodes elect a new leader (`elected_at`) that serves the rest of the fleet:
/// from then on the two sides diverge, the isolated workers read an ever older state, their
/// watches go quiet, and their waiting writes are dropped when the old leader rejoins.
pub(crate) struct Stuck {
    pub until: Timestamp,
    pub pending: Vec<Sent>,
    /// Every worker talks to the stuck leader (the quorum-loss shape).
    pub everyone: bool,
    /// The workers connected to the cut-off node (the split shape).
    pub isolated: Vec<usize>,
    /// When the other nodes have a new leader (the split shape), if within the window.
    pub elected_at: Option<Timestamp>,
    /// The stuck leader's state when it was cut off (what reads through it show).
    pub snapshot: MemoryKv,
}

impl Stuck {
    pub(super) fn isolates(&self, slot: usize) -> bool {
        self.everyone || self.isolated.contains(&slot)
    }

    pub(super) fn elected(&self, now: Timestamp) -> bool {
        self.elected_at.is_some_and(|t| t <= now)
    }
}

impl World {
    /// A read through the cut-off node: its leader answers from the state it had when it was
    /// cut off (the other side may have moved on since).
    pub(super) fn read_through_stuck_leader(&mut self, sent: Sent) {
        let now = self.now;
        let Sent { slot, life, op, bucket, request, answer, .. } = sent;
        let current = self.kv(bucket).execute(now, request.clone());
        let stuck = self.stuck[bi(bucket)].as_mut().expect("stuck");
        let result = stuck.snapshot.execute(now, request);
        let keys_of = |r: &StoreResult| -> Vec<Key> {
            match r {
                Ok(StoreReply::Value(Some(e))) => vec![e.key.clone()],
                Ok(StoreReply::Entries(es)) => es.iter().map(|e| e.key.clone()).collect(),
                _ => Vec::new(),
            }
        };
        if result != current {
            self.fault(Fault::ReadFromCutOffLeaderBehind);
            let answered = keys_of(&result);
            let missing: Vec<Key> = keys_of(&current).into_iter().filter(|k| !answered.contains(k)).collect();
            if !missing.is_empty() && answer != Answer::Dropped {
                self.stale_answers.insert((slot, life, op), missing);
            }
        }
        if let Answer::After(d) = answer {
            self.respond(slot, life, op, result, d);
        }
    }

    /// A write reaches a stream leader that cannot commit: it waits with the others, in order;
    /// one to a key that already has a write waiting is refused at once.
    pub(super) fn hold_at_stuck_leader(&mut self, mut sent: Sent) {
        let now = self.now;
        let key = written_key(&sent.request).clone();
        let stuck = self.stuck[bi(sent.bucket)].as_ref().expect("stuck");
        let until = stuck.until;
        if stuck.pending.iter().any(|p| written_key(&p.request) == &key) {
            self.fault(Fault::WriteRefusedWhileOneIsPending);
            let live = self.stuck[bi(sent.bucket)].as_mut().expect("stuck").snapshot.get(now, &key).is_some();
            let result = match sent.request {
                // The backend reads the key after the refusal: a live value is reported as such;
                // none means nothing it could write over, and nothing was applied.
                StoreRequest::Create { .. } if live => Err(StoreError::AlreadyExists(key)),
                StoreRequest::Create { .. } => Err(StoreError::Unavailable(format!(
                    "creating {key}: another write to it is pending at the stream leader"
                ))),
                _ => Err(StoreError::RevisionMismatch(key)),
            };
            if let Answer::After(d) = sent.answer {
                self.respond(sent.slot, sent.life, sent.op, result, d);
            }
            return;
        }
        if let Some(refused) = self.refused_by_stuck_leader(sent.bucket, &sent.request) {
            // The leader checks the expected revision on arrival, against its own state: a write
            // that cannot apply is refused at once, as a healthy leader would.
            if let Answer::After(d) = sent.answer {
                self.respond(sent.slot, sent.life, sent.op, Err(refused), d);
            }
            return;
        }
        if let Answer::After(d) = sent.answer
            && until + d > sent.deadline
        {
            // The sender times out before the leader can answer.
            let timeout = self.opts.op_timeout;
            let wait = sent.deadline.saturating_since(now);
            self.respond(sent.slot, sent.life, sent.op, no_answer(true, timeout), wait);
            sent.answer = Answer::Dropped;
        }
        if sent.bucket == Bucket::State
            && let Some(id) = keys::parse_split(&key)
            && let Some(value) = written_value(&sent.request)
            && let Ok(record) = records::decode::<SplitRecord>(value)
        {
            sent.held = Some(self.checker.held_write(&id, record.epoch, &sent.writer));
        }
        self.stuck[bi(sent.bucket)].as_mut().expect("stuck").pending.push(sent);
    }

    /// Whether another owner's write to the record or lease of `split` waits at a stuck leader.
    pub(crate) fn foreign_write_waiting(&self, split: &SplitId, me: &Owner) -> bool {
        let key = keys::split(split);
        self.stuck
            .iter()
            .flatten()
            .flat_map(|s| &s.pending)
            .any(|p| *written_key(&p.request) == key && p.writer != *me)
    }

    /// The error a write gets if its condition fails against the stuck leader's state.
    pub(super) fn refused_by_stuck_leader(
        &mut self,
        bucket: Bucket,
        request: &StoreRequest,
    ) -> Option<StoreError> {
        let now = self.now;
        let key = written_key(request).clone();
        let stuck = self.stuck[bi(bucket)].as_mut().expect("stuck");
        let current = stuck.snapshot.get(now, &key).map(|e| e.revision);
        match request {
            StoreRequest::Create { .. } => current.map(|_| StoreError::AlreadyExists(key)),
            StoreRequest::CompareAndSwap { expected, .. } | StoreRequest::Delete { expected, .. } => {
                (current != Some(*expected)).then_some(StoreError::RevisionMismatch(key))
            }
            other => unreachable!("not a write: {other:?}"),
        }
    }

    /// The stuck leader of `bucket` regains its quorum or steps down: the next leader's log has
    /// every waiting write, a prefix of them (the ones replicated in time), or none.
    /// With a new leader elected meanwhile, the cut-off one's waiting writes are dropped (its
    /// uncommitted log is truncated when it rejoins).
    pub(crate) fn recover_stream(&mut self, bucket: Bucket) {
        let Some(stuck) = self.stuck[bi(bucket)].take() else { return };
        let n = stuck.pending.len() as u64;
        let keep = match self.rng.range(0, 3) {
            _ if stuck.elected(self.now) => 0,
            0 | 1 => n,
            2 => self.rng.range(0, n),
            _ => 0,
        };
        for (i, mut sent) in stuck.pending.into_iter().enumerate() {
            if (i as u64) < keep {
                let Some(held) = sent.held.take() else {
                    self.apply_and_answer(sent);
                    continue;
                };
                let landing = self.checker.held_write_lands(held);
                self.apply_and_answer(sent);
                self.checker.held_write_landed(landing);
                continue;
            }
            self.fault(Fault::PendingWriteDropped);
            if let Answer::After(_) = sent.answer {
                let (timeout, wait) = (self.opts.op_timeout, sent.deadline.saturating_since(self.now));
                self.respond(sent.slot, sent.life, sent.op, no_answer(true, timeout), wait);
            }
        }
    }
}
