//! Lanes as a source runs them: each split is a range of records; a lane emits them one per
//! step, commits progress every `commit_every` records (the number of records done), and
//! finishes. Poison splits crash the owner or are reported unprocessable; bad records are
//! skipped to the dead-letter sink or quarantine their split (`datapath` has the outages that
//! reads and flushes meet). With `slow_stop`, a lane told to stop (fenced, starved) finishes
//! the record in hand and commits late.

use bytes::Bytes;
use etl_coordination_core::records::{self, SplitRecord, keys};
use etl_coordination_core::{CommitOutcome, Epoch, Input, SplitId, StopReason, Timestamp};

use super::datapath::{Path, Side};
use super::{Ev, Poison, Status, World, ms};
use crate::check::{Observation, progress_of};
use crate::fault::Fault;
use crate::options::Scenario;

pub(crate) struct Lane {
    pub epoch: Epoch,
    pub next: u64,
    pub total: u64,
    pub since_commit: u64,
    pub committing: bool,
    pub draining: bool,
    /// Told to stop (fenced or starved) but still finishing the record in hand.
    pub stopping: bool,
    /// Draining, but emitting until then before the last commit (a slow drain).
    pub drain_until: Option<Timestamp>,
    /// The side failing transiently, since when (a success of that side ends it).
    pub failing: Option<(Side, Timestamp)>,
    /// A transient read error of this lane alone, until then.
    pub read_error_until: Option<Timestamp>,
    /// Its last successful read (the breaker hears of it at the next commit).
    pub read_ok: Option<Timestamp>,
    /// Bad records skipped by this tenancy.
    pub bad_met: u32,
}

fn le(n: u64) -> Bytes {
    Bytes::copy_from_slice(&n.to_le_bytes())
}

impl World {
    /// The lane ended on its side (finished, failed, acknowledged a stop, told it lost the
    /// split): the core no longer runs it.
    /// A draining lane acknowledges its stop (`clean`: with everything it emitted committed).
    fn lane_acked(&mut self, split: &SplitId, epoch: Epoch, clean: bool) {
        let obs = Observation::LaneAcked { id: split, epoch, clean };
        self.checker.observe(self.now, obs, &mut self.state);
    }

    pub(super) fn lane_ended(&mut self, slot: usize, split: &SplitId, epoch: Epoch) {
        if self.slots[slot].core_lanes.get(split) == Some(&epoch) {
            self.slots[slot].core_lanes.remove(split);
        }
    }

    pub(crate) fn current_record(&mut self, id: &SplitId) -> Option<SplitRecord> {
        let now = self.now;
        self.state.get(now, &keys::split(id)).and_then(|e| records::decode::<SplitRecord>(&e.value).ok())
    }

    pub(crate) fn start_lane(
        &mut self,
        slot: usize,
        split: SplitId,
        epoch: Epoch,
        descriptor: Bytes,
        progress: Option<Bytes>,
    ) {
        let total = u64::from_le_bytes(descriptor[..8].try_into().expect("sim descriptor"));
        let others: Vec<Epoch> = self
            .slots
            .iter()
            .filter(|s| matches!(s.status, Status::Running | Status::Paused))
            .flat_map(|s| {
                s.lanes.iter().filter(|((id, _), l)| *id == split && !l.stopping).map(|(_, l)| l.epoch)
            })
            .collect();
        let current = self.current_record(&split);
        let obs = Observation::LaneStarted { id: &split, epoch, others: &others, current: current.as_ref() };
        self.checker.observe(self.now, obs, &mut self.state);
        let next = progress_of(&progress);
        let lane = Lane {
            epoch,
            next,
            total,
            since_commit: 0,
            committing: false,
            draining: false,
            stopping: false,
            drain_until: None,
            failing: None,
            read_error_until: None,
            read_ok: None,
            bad_met: 0,
        };
        self.slots[slot].lanes.insert((split.clone(), epoch), lane);
        let life = self.slots[slot].life;
        let step = ms(self.opts.step_ms);
        self.schedule(step, Ev::LaneStep { slot, life, split, epoch });
    }

    pub(crate) fn lane_step(&mut self, slot: usize, split: SplitId, epoch: Epoch) {
        let Some(lane) = self.slots[slot].lanes.get(&(split.clone(), epoch)) else { return };
        if lane.committing {
            return;
        }
        if lane.draining {
            match lane.drain_until {
                Some(t) if self.now >= t => {
                    // The slow drain is over: the last commit, then the acknowledgement.
                    self.slots[slot].lanes.get_mut(&(split.clone(), epoch)).expect("lane").drain_until = None;
                    return self.drain_now(slot, split, epoch);
                }
                Some(_) => {}
                None => return,
            }
        }
        let (next, total, stopping) = (lane.next, lane.total, lane.stopping);
        if lane.since_commit >= self.opts.commit_every && !stopping && next < total {
            // A commit came back retryable (or its flush met an outage): a lane does not run
            // more than one commit interval ahead of its durable progress, so it commits again
            // before emitting more.
            return self.flush(slot, Input::Commit { split, epoch, progress: le(next) });
        }
        if next >= total {
            return self.flush(slot, Input::Finish { split, epoch, progress: le(total) });
        }
        if !stopping {
            // (A lane told to stop only finishes the record in hand.)
            self.maybe_read_error(slot, &split, epoch);
            if let Path::Down = self.data_path(slot, &split, epoch, Side::Source) {
                return;
            }
        }
        let spec = &self.splits[self.split_index[&split]];
        if spec.bad.contains(&next) && !stopping {
            return self.bad_record(slot, split, epoch, next);
        }
        match spec.poison {
            Poison::Crash(at) if at == next => {
                self.fault(Fault::PoisonCrash);
                let who = self.slots[slot].owner.clone();
                self.checker.observe(self.now, Observation::PoisonCrashed { who: &who }, &mut self.state);
                // A crash is a fault: steals that rebalance after it are not oscillation (I7).
                if self.opts.scenario == Scenario::Random {
                    self.report.steals_after_faults = 0;
                }
                return self.crash(slot, true);
            }
            Poison::Unprocessable(at) if at == next && !stopping => {
                self.slots[slot].lanes.remove(&(split.clone(), epoch));
                self.checker.observe(
                    self.now,
                    Observation::LaneFailed { id: &split, epoch },
                    &mut self.state,
                );
                self.lane_ended(slot, &split, epoch);
                let error = format!("record {next} of {split} cannot be parsed");
                return self.deliver(slot, Input::Fail { split, epoch, error, unprocessable: true });
            }
            _ => {}
        }
        let owner = self.slots[slot].owner.clone();
        if self.slots[slot].core_lanes.get(&split) == Some(&epoch) {
            // P11 at every emission, not only after the core's inputs: between the lease's death
            // in the store and the worker's own lapse of trust, nothing reaches the core.
            let obs = Observation::LaneRunning { id: &split, epoch, owner: &owner };
            self.checker.observe(self.now, obs, &mut self.state);
        }
        let current = self.current_record(&split);
        let obs = Observation::Emitted {
            id: &split,
            record: next,
            epoch,
            owner: &owner,
            current: current.as_ref(),
        };
        self.checker.observe(self.now, obs, &mut self.state);
        self.report.records_emitted += 1;
        self.record_done(slot, split, epoch, stopping);
    }

    /// A record was emitted (or skipped to the dead-letter sink): progress moves past it.
    fn record_done(&mut self, slot: usize, split: SplitId, epoch: Epoch, stopping: bool) {
        let lane = self.slots[slot].lanes.get_mut(&(split.clone(), epoch)).expect("lane");
        lane.next += 1;
        lane.since_commit += 1;
        if stopping {
            // The record in hand is out; the lane tries to commit it, late (it will be told
            // Lost), unless its sink is down.
            let p = lane.next;
            if self.now < self.slots[slot].sink_down_until {
                self.slots[slot].lanes.remove(&(split, epoch));
                return;
            }
            self.slots[slot].lanes.get_mut(&(split.clone(), epoch)).expect("lane").committing = true;
            return self.deliver(slot, Input::Commit { split, epoch, progress: le(p) });
        }
        if lane.next >= lane.total {
            let total = lane.total;
            return self.flush(slot, Input::Finish { split, epoch, progress: le(total) });
        }
        if lane.since_commit >= self.opts.commit_every {
            let p = lane.next;
            return self.flush(slot, Input::Commit { split, epoch, progress: le(p) });
        }
        let life = self.slots[slot].life;
        self.schedule(ms(self.opts.step_ms), Ev::LaneStep { slot, life, split, epoch });
    }

    /// The lane flushes its sink, then commits (or finishes) with `input`; a sink outage is
    /// waited out in place (the step comes again) or, past the budget, fails the tenancy.
    fn flush(&mut self, slot: usize, input: Input) {
        let (Input::Commit { split, epoch, .. } | Input::Finish { split, epoch, .. }) = &input else {
            unreachable!("flush before a commit or a finish")
        };
        let (split, epoch) = (split.clone(), *epoch);
        if let Path::Down = self.data_path(slot, &split, epoch, Side::Sink) {
            return;
        }
        let lane = self.slots[slot].lanes.get_mut(&(split.clone(), epoch)).expect("lane");
        lane.committing = true;
        let read_ok = lane.read_ok;
        self.deliver(slot, input);
        self.flushed(slot, &split, read_ok);
    }

    /// Record `at` of the split is bad: quarantined with its split (the default policy) or
    /// skipped to the dead-letter sink, up to the cap per tenancy.
    fn bad_record(&mut self, slot: usize, split: SplitId, epoch: Epoch, at: u64) {
        let error = format!("record {at} of {split} is not valid UTF-8");
        let Some(cap) = self.opts.skip_bad_records else {
            self.slots[slot].lanes.remove(&(split.clone(), epoch));
            self.checker.observe(self.now, Observation::LaneFailed { id: &split, epoch }, &mut self.state);
            self.lane_ended(slot, &split, epoch);
            return self.deliver(slot, Input::Fail { split, epoch, error, unprocessable: true });
        };
        let lane = self.slots[slot].lanes.get_mut(&(split.clone(), epoch)).expect("lane");
        lane.bad_met += 1;
        if lane.bad_met > cap {
            self.slots[slot].lanes.remove(&(split.clone(), epoch));
            self.lane_ended(slot, &split, epoch);
            self.checker.observe(self.now, Observation::LaneGaveUp { id: &split, epoch }, &mut self.state);
            return self.deliver(slot, Input::Quarantine { split, epoch, error });
        }
        self.fault(crate::fault::Fault::BadRecordSkipped);
        self.checker.observe(self.now, Observation::DeadLettered { id: &split, record: at }, &mut self.state);
        self.record_done(slot, split, epoch, false);
    }

    /// `at_once`: no deadline (the core no longer counts the lane as running).
    pub(crate) fn stop_lane(
        &mut self,
        slot: usize,
        split: SplitId,
        epoch: Epoch,
        reason: StopReason,
        at_once: bool,
    ) {
        let slow = self.faults_on && self.opts.slow_stop && self.rng.chance(0.5);
        let life = self.slots[slot].life;
        let step = ms(self.opts.step_ms.min(30));
        let Some(lane) = self.slots[slot].lanes.get_mut(&(split.clone(), epoch)) else { return };
        match reason {
            StopReason::Draining => {
                if at_once {
                    // The drain deadline passed, or the split is released now: stop emitting.
                    lane.draining = true;
                    lane.drain_until = None;
                    return self.drain_now(slot, split, epoch);
                }
                if lane.draining {
                    return;
                }
                lane.draining = true;
                if slow && lane.next < lane.total {
                    // A slow drain: the lane goes on emitting for a while (within the drain
                    // deadline) before its last commit, as a source finishing a batch does.
                    let max = self.opts.drain_timeout.as_millis() as u64 * 9 / 10;
                    let until = self.now + ms(self.rng.range(0, max));
                    self.fault(Fault::LaneSlowToDrain);
                    let lane = self.slots[slot].lanes.get_mut(&(split.clone(), epoch)).expect("lane");
                    lane.drain_until = Some(until);
                    if !lane.committing {
                        self.schedule(step, Ev::LaneStep { slot, life, split, epoch });
                    }
                    return;
                }
                self.drain_now(slot, split, epoch);
            }
            StopReason::Fenced | StopReason::Starved => {
                if slow && !lane.committing && !lane.draining && lane.next < lane.total {
                    // Slow to stop: the record in hand is finished and committed late.
                    lane.stopping = true;
                    self.fault(Fault::LaneSlowToStop);
                    self.schedule(step, Ev::LaneStep { slot, life, split, epoch });
                } else {
                    self.slots[slot].lanes.remove(&(split.clone(), epoch));
                }
            }
        }
    }

    /// A draining lane commits what it has and acknowledges the stop once that resolves.
    pub(super) fn drain_now(&mut self, slot: usize, split: SplitId, epoch: Epoch) {
        let Some(lane) = self.slots[slot].lanes.get_mut(&(split.clone(), epoch)) else { return };
        if lane.committing {
            return; // acknowledged when the commit resolves
        }
        let clean = lane.since_commit == 0;
        if lane.since_commit > 0 && self.now >= self.slots[slot].sink_down_until {
            let lane = self.slots[slot].lanes.get_mut(&(split.clone(), epoch)).expect("lane");
            lane.committing = true;
            let (p, read_ok) = (lane.next, lane.read_ok);
            self.deliver(slot, Input::Commit { split: split.clone(), epoch, progress: le(p) });
            self.flushed(slot, &split, read_ok);
        } else {
            // Nothing to commit, or the sink is down: the lane stops without its last commit
            // (what it emitted since is read again by the next owner: at-least-once).
            self.slots[slot].lanes.remove(&(split.clone(), epoch));
            self.lane_ended(slot, &split, epoch);
            self.lane_acked(&split, epoch, clean);
            self.deliver(slot, Input::LaneStopped { split, epoch });
        }
    }

    pub(crate) fn commit_done(&mut self, slot: usize, split: SplitId, epoch: Epoch, outcome: CommitOutcome) {
        let life = self.slots[slot].life;
        let Some(lane) = self.slots[slot].lanes.get_mut(&(split.clone(), epoch)) else { return };
        lane.committing = false;
        if lane.stopping {
            self.slots[slot].lanes.remove(&(split.clone(), epoch));
            return;
        }
        // A slow drain commits as it goes; its last commit comes when it is over.
        let last = lane.draining && lane.drain_until.is_none();
        match outcome {
            CommitOutcome::Ok => {
                lane.since_commit = 0;
                if lane.next >= lane.total && !lane.draining {
                    self.slots[slot].lanes.remove(&(split.clone(), epoch));
                    self.lane_ended(slot, &split, epoch);
                } else if last || lane.next >= lane.total {
                    self.slots[slot].lanes.remove(&(split.clone(), epoch));
                    self.lane_ended(slot, &split, epoch);
                    self.lane_acked(&split, epoch, true);
                    self.deliver(slot, Input::LaneStopped { split, epoch });
                } else {
                    self.schedule(ms(self.opts.step_ms), Ev::LaneStep { slot, life, split, epoch });
                }
            }
            CommitOutcome::Lost => {
                self.slots[slot].lanes.remove(&(split.clone(), epoch));
                self.lane_ended(slot, &split, epoch);
            }
            CommitOutcome::Retryable => {
                if last {
                    self.slots[slot].lanes.remove(&(split.clone(), epoch));
                    self.lane_ended(slot, &split, epoch);
                    self.deliver(slot, Input::LaneStopped { split, epoch });
                } else {
                    self.schedule(ms(self.opts.step_ms.max(50)), Ev::LaneStep { slot, life, split, epoch });
                }
            }
        }
    }
}
