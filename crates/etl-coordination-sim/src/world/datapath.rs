//! The data path (issue 26): sink and source outages, one worker's or every worker's, and
//! transient read errors of single lanes; bad records. A lane waits a transient failure out in
//! place (keeping its lease) within the budget, as the driver's lanes do; past the budget its
//! failure goes to the worker's breaker (the core's `Breaker`, the code the driver runs), which
//! charges it (`Input::Fail`) or releases the split without blame (`Input::Release`) and pauses
//! intake (`Input::Intake`), probing with one split more after its wait. The checkers are told
//! the cause of every end, so that they judge charges by cause, not by what a record says.
//!
//! The world keeps outages within what the product promises to absorb without quarantining a
//! healthy split: each outage is shorter than two retry budgets (so one outage charges a split
//! at most once: a charge needs one side failing for a whole budget), and a run has fewer
//! outages than `max_attempts`.

use std::time::Duration;

use etl_coordination_core::{BreakerVerdict, DataSide, Epoch, Input, Outage, SplitId, Timestamp};

use super::{Ev, Status, World, ms};
use crate::check::Observation;
use crate::fault::Fault;

/// Which side of a lane fails.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Side {
    Source = 0,
    Sink = 1,
}

/// What a lane about to read or flush meets.
pub(crate) enum Path {
    /// It works.
    Up,
    /// It fails transiently: the lane waits (a step is scheduled) or has given up.
    Down,
}

/// The error each side reports during an outage (one cause for every split, as a real outage).
fn outage_error(side: Side, split: &SplitId) -> String {
    match side {
        Side::Sink => format!("writing {split} to the sink: No space left on device (os error 28)"),
        Side::Source => format!("reading {split}: connection reset by peer (os error 104)"),
    }
}

impl World {
    /// A data-path fault of the safety phase, drawn from the data-path generator.
    pub(super) fn inject_data_fault(&mut self) {
        let live = self.live_slots();
        let side = if self.dp_rng.chance(0.6) { Side::Sink } else { Side::Source };
        // One outage of each side at a time (the two may overlap: a source outage that opened
        // a breaker, then the sink's); fewer in a run than `max_attempts`.
        let i = side as usize;
        let outage_over = self.now >= self.data_outage_until[i];
        let allowed = self.data_outages + 1 < self.opts.max_attempts;
        if live.is_empty() || !outage_over || !allowed {
            return;
        }
        let budget = self.opts.transient_budget.as_millis() as u64;
        // From a tenth of the budget (waited out in place) to just under two (past it once).
        let until = self.now + ms(self.dp_rng.range(budget / 10, budget * 2 - 1));
        let all = self.dp_rng.chance(0.4);
        let slots = if all { live } else { vec![live[self.dp_rng.range(0, live.len() as u64 - 1) as usize]] };
        self.fault(match (side, all) {
            (Side::Sink, true) => Fault::SinkOutageForAll,
            (Side::Sink, false) => Fault::SinkOutageForOne,
            (Side::Source, true) => Fault::SourceOutageForAll,
            (Side::Source, false) => Fault::SourceOutageForOne,
        });
        self.data_outages += 1;
        self.data_outage_until[i] = until;
        for slot in slots {
            let s = &mut self.slots[slot];
            match side {
                Side::Sink => s.sink_down_until = until,
                Side::Source => s.source_down_until = until,
            }
        }
    }

    /// The safety phase is over: every outage ends.
    pub(super) fn heal_data_path(&mut self) {
        for s in &mut self.slots {
            s.sink_down_until = self.now;
            s.source_down_until = self.now;
        }
        for (_, lane) in self.slots.iter_mut().flat_map(|s| s.lanes.iter_mut()) {
            lane.read_error_until = None;
        }
    }

    /// Whether `side` of the lane works now; if not, the lane waits it out (a step scheduled
    /// within the budget) or, past the budget, has failed (reported to the breaker and the core).
    pub(super) fn data_path(&mut self, slot: usize, split: &SplitId, epoch: Epoch, side: Side) -> Path {
        let s = &self.slots[slot];
        let Some(lane) = s.lanes.get(&(split.clone(), epoch)) else { return Path::Down };
        let down = match side {
            Side::Sink => self.now < s.sink_down_until,
            Side::Source => {
                self.now < s.source_down_until || lane.read_error_until.is_some_and(|t| self.now < t)
            }
        };
        let draining = lane.draining;
        let lane = self.slots[slot].lanes.get_mut(&(split.clone(), epoch)).expect("lane");
        if !down {
            if lane.failing.is_some_and(|(s, _)| s == side) {
                lane.failing = None;
            }
            if side == Side::Source {
                lane.read_ok = Some(self.now);
            }
            return Path::Up;
        }
        if draining {
            // A draining lane does not wait: it commits what it can and stops.
            self.drain_now(slot, split.clone(), epoch);
            return Path::Down;
        }
        let since = match lane.failing {
            Some((s, t)) if s == side => t,
            _ => self.now,
        };
        lane.failing = Some((side, since));
        let local = self.slots[slot].clock.local(self.now);
        let local_since = self.slots[slot].clock.local(since);
        let spent = local.saturating_since(local_since);
        let budget = self.opts.transient_budget;
        if spent < budget {
            // Waits in place: 100 to 400 ms, within what is left of the budget (on the worker's
            // own clock, as the driver measures it).
            let wait = ms(self.dp_rng.range(100, 400)).min(budget - spent).max(Duration::from_micros(1));
            let life = self.slots[slot].life;
            let at = self.slots[slot].clock.global(local + wait).max(self.now + Duration::from_micros(1));
            self.schedule_at(at, Ev::LaneStep { slot, life, split: split.clone(), epoch });
            return Path::Down;
        }
        self.outage_spent(slot, split.clone(), epoch, side, since);
        Path::Down
    }

    /// A lane's outage outlived the budget: the breaker decides whether the split is charged.
    fn outage_spent(&mut self, slot: usize, split: SplitId, epoch: Epoch, side: Side, since: Timestamp) {
        self.slots[slot].lanes.remove(&(split.clone(), epoch));
        self.lane_ended(slot, &split, epoch);
        let error = outage_error(side, &split);
        let local = self.slots[slot].clock.local(self.now);
        let outage = Outage {
            side: match side {
                Side::Sink => DataSide::Sink,
                Side::Source => DataSide::Source,
            },
            since: self.slots[slot].clock.local(since),
        };
        let verdict = self.slots[slot].breaker.on_failure(local, &split, &error, Some(outage));
        let (charged, tripped) = match verdict {
            BreakerVerdict::Charge { tripped } => (true, tripped),
            BreakerVerdict::Release { tripped } => (false, tripped),
        };
        let who = self.slots[slot].owner.clone();
        if self.trace {
            let state = self.slots[slot].breaker.state();
            eprintln!(
                "{:>12}   {who} lane {split}@{epoch} {side:?} outage past the budget: {verdict:?}, breaker {state:?}",
                self.now.0
            );
        }
        let side = match side {
            Side::Sink => "sink",
            Side::Source => "source",
        };
        let since = self.slots[slot].clock.local(since);
        let obs = Observation::OutageFailed { id: &split, epoch, who: &who, side, since, local, charged };
        self.checker.observe(self.now, obs, &mut self.state);
        if charged {
            self.deliver(slot, Input::Fail { split, epoch, error, unprocessable: false });
        } else {
            self.deliver(slot, Input::Release { split, epoch });
        }
        if tripped && self.slots[slot].core.is_some() {
            self.fault(Fault::BreakerOpened);
            self.deliver(slot, Input::Intake { limit: Some(0) });
            self.schedule_breaker_probe(slot);
        }
    }

    fn schedule_breaker_probe(&mut self, slot: usize) {
        if let Some(at) = self.slots[slot].breaker.probe_at() {
            let life = self.slots[slot].life;
            let at = self.slots[slot].clock.global(at).max(self.now);
            self.schedule_at(at, Ev::BreakerProbe { slot, life });
        }
    }

    /// An open breaker's wait is over: one split more than the worker holds, to probe.
    pub(super) fn breaker_probe(&mut self, slot: usize, life: u32) {
        let s = &mut self.slots[slot];
        if s.life != life {
            return;
        }
        if s.status == Status::Paused {
            return s.inbox.push(Ev::BreakerProbe { slot, life });
        }
        if s.status != Status::Running {
            return;
        }
        let local = s.clock.local(self.now);
        if self.trace {
            eprintln!(
                "{:>12}   {} breaker probe due at {:?} (now {local:?}): {:?}",
                self.now.0,
                s.owner,
                s.breaker.probe_at(),
                s.breaker.state()
            );
        }
        match s.breaker.probe_at() {
            None => return, // probing already, or closed
            Some(t) if t > local => {
                // Not due on the worker's clock yet (the conversion rounds, or it reopened
                // with a later probe): come back then.
                let at = s.clock.global(t).max(self.now + Duration::from_micros(1));
                return self.schedule_at(at, Ev::BreakerProbe { slot, life });
            }
            Some(_) => {}
        }
        s.breaker.probe();
        let held = s.core.as_ref().map_or(0, |c| c.held().count() as u32);
        self.deliver(slot, Input::Intake { limit: Some(held + 1) });
    }

    /// A lane flushed its sink and commits (or finishes), having last read its source at
    /// `read_ok`: a probing breaker closes, and the breaker has evidence that both work.
    pub(super) fn flushed(&mut self, slot: usize, split: &SplitId, read_ok: Option<Timestamp>) {
        let who = self.slots[slot].owner.clone();
        let clock = &self.slots[slot].clock;
        let (local, read_at) = (clock.local(self.now), read_ok.map(|t| clock.local(t)));
        let obs = Observation::Flushed { who: &who, id: split, local, read_at };
        self.checker.observe(self.now, obs, &mut self.state);
        if self.slots[slot].breaker.on_commit(split, local, read_at) {
            self.deliver(slot, Input::Intake { limit: None });
        }
    }

    /// A read error of one lane: mostly shorter than half the budget, at times past it.
    pub(super) fn maybe_read_error(&mut self, slot: usize, split: &SplitId, epoch: Epoch) {
        if !(self.faults_on && self.opts.data_faults && self.dp_rng.chance(0.005)) {
            return;
        }
        let lane = self.slots[slot].lanes.get(&(split.clone(), epoch));
        if lane.is_some_and(|l| l.read_error_until.is_some_and(|t| self.now < t)) {
            return; // (one at a time: chained errors would outlive the budget uncounted)
        }
        let budget = self.opts.transient_budget.as_millis() as u64;
        // Most are short; some outlive the budget (the part of the input this lane reads is
        // unreachable: one host down), counted as outages, so that a breaker opens on a few
        // lanes while the others go on (and may meet a second cause).
        let long = self.data_outages + 1 < self.opts.max_attempts && self.dp_rng.chance(0.2);
        let until = if long {
            self.data_outages += 1;
            self.fault(Fault::SourceReadErrorPastTheBudget);
            self.now + ms(self.dp_rng.range(budget + 1, budget * 2 - 1))
        } else {
            self.fault(Fault::SourceReadErrorTransient);
            self.now + ms(self.dp_rng.range(1, (budget / 2).max(2) - 1))
        };
        if let Some(lane) = self.slots[slot].lanes.get_mut(&(split.clone(), epoch)) {
            lane.read_error_until = Some(until);
        }
    }
}
