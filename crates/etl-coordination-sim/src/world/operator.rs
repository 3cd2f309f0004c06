//! Writes no worker makes: another program overwriting a split record with bytes nobody can
//! decode, and the operator with `etl-coord` (a reset of such a record, a requeue of quarantined
//! splits after fixing their cause, the drain of workers that stay after the job's end). Both
//! write through the store like anyone else; the checker takes each as a new baseline for the
//! split, not as a worker's write.

use bytes::Bytes;
use etl_coordination_core::records::{self, LeaseRecord, SplitRecord, SplitState, keys};
use etl_coordination_core::{Bucket, Input, Outcome, SplitId};

use crate::check::Observation;
use crate::fault::Fault;

use super::net::bi;
use super::{Ev, Poison, Status, World, ms};

impl World {
    /// Whether an operator's write to the state bucket would land now (not during an outage,
    /// nor at a stream leader that lost its quorum): if not, it is tried again shortly.
    fn state_writable(&self) -> bool {
        self.now >= self.outage_until && self.stuck[bi(Bucket::State)].is_none()
    }

    /// Another program overwrites the record of a split still in work (published, not
    /// terminal) with bytes no release writes; an operator resets it a while later.
    pub(crate) fn overwrite_record(&mut self) {
        if !self.state_writable() {
            return;
        }
        let now = self.now;
        let candidates: Vec<(SplitId, etl_coordination_core::Revision)> = self
            .checker
            .published()
            .iter()
            .filter(|id| !self.corrupted.contains(*id))
            .filter_map(|id| {
                let e = self.state.get(now, &keys::split(id))?;
                let r = records::decode::<SplitRecord>(&e.value).ok()?;
                (!r.is_terminal()).then(|| (id.clone(), e.revision))
            })
            .collect();
        if candidates.is_empty() {
            return;
        }
        let (id, rev) = candidates[self.rng.range(0, candidates.len() as u64 - 1) as usize].clone();
        let garbage = Bytes::from_static(b"\xffwritten by another program");
        self.state
            .compare_and_swap(now, &keys::split(&id), rev, garbage, None)
            .expect("the revision just read");
        self.fault(Fault::RecordOverwrittenByAnotherProgram);
        self.checker.observe(now, Observation::ForeignWrite { id: &id, new: None }, &mut self.state);
        self.distribute(Bucket::State);
        self.corrupted.insert(id.clone());
        let after = ms(self.rng.range(200, self.opts.lease_secs * 3000));
        self.schedule(after, Ev::OperatorReset { split: id });
    }

    /// `etl-coord requeue --reset`: the split starts over, under an epoch above any it had.
    pub(crate) fn operator_reset(&mut self, id: SplitId) {
        if !self.state_writable() {
            return self.schedule(ms(500), Ev::OperatorReset { split: id });
        }
        let now = self.now;
        let key = keys::split(&id);
        let current = self.state.get(now, &key).expect("records are never deleted from under a reset");
        let decoded = records::decode::<SplitRecord>(&current.value).ok();
        let lease = self.lease.get(now, &key).and_then(|e| records::decode::<LeaseRecord>(&e.value).ok());
        let reset = SplitRecord::reset(Some((current.revision, decoded.as_ref())), lease.map(|l| l.epoch));
        self.state
            .compare_and_swap(now, &key, current.revision, records::encode(&reset), None)
            .expect("the revision just read");
        self.fault(Fault::OperatorReset);
        self.checker.observe(now, Observation::ForeignWrite { id: &id, new: Some(&reset) }, &mut self.state);
        self.distribute(Bucket::State);
        self.corrupted.remove(&id);
    }

    /// Workers that stay after the end: once every live one reported the end (and no reset is
    /// pending), the operator fixes and requeues the quarantined splits (once), or, with the
    /// job complete (or stalled again), drains them.
    pub(crate) fn operator_after_end(&mut self) {
        if !self.opts.stay_after_end || !self.safety_over || !self.corrupted.is_empty() {
            return;
        }
        // (A draining worker leaves on its own.)
        let waiting = self.slots.iter().any(|s| {
            matches!(s.status, Status::Paused | Status::Crashed { restart: true })
                || (s.status == Status::Running && !s.draining && s.ended.is_none())
        });
        let staying: Vec<usize> = (0..self.slots.len())
            .filter(|&i| self.slots[i].status == Status::Running && !self.slots[i].draining)
            .collect();
        if waiting || staying.is_empty() {
            return;
        }
        let stalled = staying.iter().any(|&i| matches!(self.slots[i].ended, Some(Outcome::Stalled { .. })));
        // Without a poison split a stall means healthy splits were quarantined (P12): left as
        // it is, so the sweep reports it.
        let poison = self.report.poison_splits > 0;
        if stalled && poison && !self.requeued && self.state_writable() {
            self.requeued = true;
            self.operator_requeue();
            return;
        }
        for slot in staying {
            self.slots[slot].draining = true;
            self.deliver(slot, Input::Drain);
        }
    }

    /// The operator fixes what made splits fail (the poison is gone) and requeues every
    /// quarantined split.
    fn operator_requeue(&mut self) {
        for s in &mut self.splits {
            s.poison = Poison::None;
            s.bad.clear();
        }
        self.healed = true;
        let now = self.now;
        let quarantined: Vec<(SplitId, etl_coordination_core::Revision, SplitRecord)> = self
            .checker
            .published()
            .iter()
            .filter_map(|id| {
                let e = self.state.get(now, &keys::split(id))?;
                let r = records::decode::<SplitRecord>(&e.value).ok()?;
                (r.state == SplitState::Quarantined).then(|| (id.clone(), e.revision, r))
            })
            .collect();
        for (id, rev, rec) in quarantined {
            let requeued = rec.requeued();
            self.state
                .compare_and_swap(now, &keys::split(&id), rev, records::encode(&requeued), None)
                .expect("the revision just read");
            self.fault(Fault::OperatorRequeue);
            let obs = Observation::ForeignWrite { id: &id, new: Some(&requeued) };
            self.checker.observe(now, obs, &mut self.state);
        }
        // The job's outcome is decided again: every staying worker must report it anew (until
        // it sees the requeue, its view still says stalled) before anyone is drained.
        self.report.outcome = "none";
        self.checker.observe(now, Observation::JobRequeued, &mut self.state);
        for s in &mut self.slots {
            s.ended = None;
        }
        self.distribute(Bucket::State);
    }
}
