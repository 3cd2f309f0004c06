//! The outcome: what a worker declares matches the store (I6, I2), one outcome across workers,
//! no Complete over a poison split, leaving (P13) and its cleanup (P10), fatal errors,
//! balance (I7) and liveness (I8).

use etl_coordination_core::records::{
    self, LeaderRecord, LeaseRecord, PlanHead, PresenceRecord, SplitRecord, SplitState, StealRequest, keys,
};
use etl_coordination_core::{Entry, Epoch, FatalError, Outcome, Owner, PlanKind, SplitId, Timestamp};
use etl_coordination_memory::MemoryKv;

use super::{Checker, WorkerLoad, manifest_ids};

impl Checker {
    /// After every worker finished: a key left by a cleanly finished process (written before
    /// it finished) is a leak.
    pub(super) fn on_leftover_key(&mut self, at: Timestamp, entry: &Entry, written_at: Timestamp) {
        let owner = if let Some(_id) = keys::parse_split(&entry.key) {
            records::decode::<LeaseRecord>(&entry.value).ok().map(|l| l.owner)
        } else if keys::parse_steal(&entry.key).is_some() {
            records::decode::<StealRequest>(&entry.value).ok().map(|r| r.thief)
        } else if let Some(inst) = keys::parse_worker(&entry.key) {
            records::decode::<PresenceRecord>(&entry.value)
                .ok()
                .map(|p| Owner { instance: inst, incarnation: p.incarnation })
        } else if entry.key == keys::leader() {
            records::decode::<LeaderRecord>(&entry.value).ok().map(|l| l.owner)
        } else {
            None
        };
        let Some(owner) = owner else { return };
        let leaked = self.finished.get(&owner).is_some_and(|f| written_at < *f);
        self.ensure(at, "P10", !leaked, || {
            format!("key {} of {owner} is left although that worker finished cleanly", entry.key)
        });
    }

    /// A worker declared the job's outcome (I6, I2).
    pub(super) fn on_outcome(
        &mut self,
        at: Timestamp,
        who: &Owner,
        complete: bool,
        stalled: bool,
        state: &mut MemoryKv,
    ) {
        let head = state.get(at, &keys::plan_head()).and_then(|e| records::decode::<PlanHead>(&e.value).ok());
        let Some(m) = head.and_then(|h| h.manifest) else {
            return self.fail(at, "I6", format!("{who} declared an outcome without a published plan"));
        };
        self.ensure(at, "I6", m.kind == PlanKind::Final, || {
            format!("{who} declared an outcome of an open plan")
        });
        let ids = manifest_ids(state, at, m.term, m.version, m.chunks);
        let mut done = 0;
        let mut quarantined = 0;
        for id in &ids {
            let rec =
                state.get(at, &keys::split(id)).and_then(|e| records::decode::<SplitRecord>(&e.value).ok());
            match rec.map(|r| r.state) {
                Some(SplitState::Done) => done += 1,
                Some(SplitState::Quarantined) => quarantined += 1,
                _ => {}
            }
        }
        if complete {
            self.ensure(at, "I6", done == ids.len(), || {
                format!(
                    "{who} declared Complete with {} of {} splits Done ({quarantined} quarantined)",
                    done,
                    ids.len()
                )
            });
        }
        if stalled {
            self.ensure(at, "I6", quarantined > 0 && done + quarantined == ids.len(), || {
                format!(
                    "{who} declared Stalled with {done} Done and {quarantined} Quarantined of {}",
                    ids.len()
                )
            });
        }
        // I2: every record of every Done split was emitted at least once.
        for id in &ids {
            let done = state
                .get(at, &keys::split(id))
                .and_then(|e| records::decode::<SplitRecord>(&e.value).ok())
                .is_some_and(|r| r.state == SplitState::Done);
            if !done {
                continue;
            }
            let gap = self.emitted.get(id).and_then(|e| e.iter().position(|x| !x));
            self.ensure(at, "I2", gap.is_none(), || {
                format!("split {id} is Done but record {} was never emitted", gap.unwrap_or(0))
            });
        }
    }

    /// A worker declared the job's end (leaving with it, or staying after it): I6 against the
    /// store, one outcome across workers, and no Complete while a poison split is unfixed.
    pub(super) fn on_declared(
        &mut self,
        at: Timestamp,
        who: &Owner,
        outcome: &Outcome,
        healed: bool,
        state: &mut MemoryKv,
    ) {
        let (complete, stalled) = (*outcome == Outcome::Complete, matches!(outcome, Outcome::Stalled { .. }));
        self.on_outcome(at, who, complete, stalled, state);
        let name = if complete { "complete" } else { "stalled" };
        if let Some(other) = self.declared
            && other != name
        {
            self.fail(at, "I6", format!("{who} declared {name} but another worker declared {other}"));
        }
        self.declared = Some(name);
        if self.poison && complete && !healed {
            self.fail(at, "P12", format!("{who} declared Complete although a poison split exists"));
        }
    }

    /// P13: a worker that stays after the end leaves only once drained; one that left with the
    /// store reachable is checked for leftovers (P10).
    pub(super) fn on_left(
        &mut self,
        at: Timestamp,
        who: &Owner,
        outcome: &Outcome,
        draining: bool,
        reachable: bool,
    ) {
        if self.stay_after_end && !draining {
            self.fail(
                at,
                "P13",
                format!("{who} left with {outcome:?} although it stays after the end until drained"),
            );
        }
        if reachable {
            self.finished.insert(who.clone(), at);
        }
    }

    /// No fatal error but the one a duplicate-id scenario provokes.
    pub(super) fn on_fatal(&mut self, at: Timestamp, who: &Owner, error: &FatalError) {
        let expected = self.duplicate_id_scenario && matches!(error, FatalError::DuplicateInstance { .. });
        if !expected {
            self.fail(at, "fatal", format!("{who} stopped with an unexpected fatal error: {error}"));
        }
    }

    /// P9: a cooperative handover replays nothing: a tenancy that got its split from an owner
    /// whose lane stopped with everything committed emits no record that lane emitted.
    pub(super) fn on_emit_after_handover(&mut self, at: Timestamp, id: &SplitId, record: u64, epoch: Epoch) {
        let upto = self.emitted_upto.entry((id.clone(), epoch)).or_default();
        *upto = (*upto).max(record + 1);
        let Some(&from) = self.handed_over.get(&(id.clone(), epoch)) else { return };
        if !self.clean_stops.contains(&(id.clone(), from)) {
            return;
        }
        let before = self.emitted_upto.get(&(id.clone(), from)).copied().unwrap_or(0);
        self.ensure(at, "P9", record >= before, || {
            format!(
                "split {id}: record {record} emitted again at epoch {epoch}, after a cooperative handover from epoch {from} whose lane committed the first {before} records"
            )
        });
    }

    /// P9: at most one steal per worker per heartbeat cycle (on the worker's own clock).
    pub(super) fn on_steal(&mut self, at: Timestamp, who: &Owner, id: &SplitId, local: Timestamp) {
        let previous = self.last_steal.insert(who.clone(), local);
        let hb = self.heartbeat;
        self.ensure(at, "P9", previous.is_none_or(|t| local >= t + hb), || {
            let since = local.saturating_since(previous.expect("a previous steal"));
            format!(
                "{who} started a steal of {id} {since:?} after its previous one, within a heartbeat ({hb:?})"
            )
        });
    }

    /// I7 in random runs: once faults stop, a move that lowers the imbalance (P9: a split of
    /// weight `w` from `a` to `b`, with a free lane, while `load(a) > load(b) + w`) must stop
    /// being possible within a few heartbeats (steals converge). A gain that keeps shrinking
    /// is convergence under way.
    pub(super) fn on_loads(&mut self, at: Timestamp, workers: &[WorkerLoad]) {
        match improving_move(workers) {
            Some(m) => {
                let (n, last) = self.imbalance;
                self.imbalance = if m.gain >= last { (n + 1, m.gain) } else { (1, m.gain) };
                self.count("I7");
                if self.imbalance.0 >= 12 {
                    let msg = format!(
                        "{m} was possible for 12 heartbeats after the faults stopped (held weights and lanes: {workers:?})"
                    );
                    self.fail(at, "I7", msg);
                }
            }
            None => self.imbalance = (0, 0),
        }
    }

    /// I7 in the balance scenarios: after convergence no move lowers the imbalance (with equal
    /// weights: owned counts differ by at most one).
    pub(super) fn on_converged(&mut self, at: Timestamp, workers: &[WorkerLoad]) {
        if let Some(m) = improving_move(workers) {
            self.fail(at, "I7", format!("{m} is still possible after convergence: {workers:?}"));
        }
    }

    /// The end of a run: I7 (steals after the faults bounded by twice the splits and the splits
    /// finished since: more means
    /// ownership oscillates) and I8 (a random run ends with an outcome).
    pub(super) fn on_run_ended(
        &mut self,
        at: Timestamp,
        steals_after_faults: u64,
        budget: u64,
        no_outcome: bool,
        states: &[String],
    ) {
        self.count("I7");
        self.count("I8");
        // `budget`: the splits, and the splits that finished after the faults. Moves by weight go
        // on while splits finish (a finish lowers a load, and an idle worker steals), so a run
        // may move more splits than it has; a swap loop is unbounded. Twice the budget.
        if self.random_scenario && steals_after_faults > 2 * budget {
            let msg = format!(
                "{steals_after_faults} steals after the faults stopped, for a budget of {budget} (splits, and splits finished since): ownership oscillates"
            );
            self.fail(at, "I7", msg);
        }
        if self.violation.is_none() && no_outcome && self.random_scenario {
            self.fail(at, "I8", format!("the run ended without a job outcome: {states:?}"));
        }
    }
}

/// A move P9 makes: a split of weight `w` from worker `from` to worker `to`, which has a free
/// lane, while `load(from) > load(to) + w` (it lowers the sum of squared loads).
#[derive(Debug)]
pub(super) struct Move {
    from: usize,
    to: usize,
    weight: u64,
    /// `w * (load(from) - load(to) - w)`: half of what the move lowers the sum of squares by.
    gain: u128,
}

impl std::fmt::Display for Move {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let Move { from, to, weight, gain } = self;
        write!(f, "moving a split of weight {weight} from worker #{from} to #{to} (gain {gain})")
    }
}

/// The move that helps most, if any helps (P9's rule, judged on what workers hold).
pub(super) fn improving_move(workers: &[WorkerLoad]) -> Option<Move> {
    // P9: a thief counts in its own load the splits its lanes failed that wait to be claimed
    // again; a peer's load, as any thief sees it (its leases), does not hold them.
    let held = |w: &WorkerLoad| w.held.iter().map(|&x| u128::from(x.max(1))).sum::<u128>();
    let own = |w: &WorkerLoad| held(w) + w.returning.iter().map(|&x| u128::from(x.max(1))).sum::<u128>();
    let mut best: Option<Move> = None;
    for (from, a) in workers.iter().enumerate() {
        for (to, b) in workers.iter().enumerate() {
            if from == to || b.held.len() as u32 >= b.cap {
                continue;
            }
            let (la, lb) = (held(a), own(b));
            for &w in &a.held {
                let w128 = u128::from(w.max(1));
                // P9: the move lowers the imbalance.
                if la > lb + w128 {
                    let gain = w128 * (la - lb - w128);
                    if best.as_ref().is_none_or(|m| gain > m.gain) {
                        best = Some(Move { from, to, weight: w, gain });
                    }
                }
            }
        }
    }
    best
}
