//! The workers: a real core each, on its own clock; adding and starting them, delivering
//! their inputs and carrying out their actions, and what they report.

use std::collections::BTreeMap;
use std::time::Duration;

use etl_coordination_core::records::{self, keys};
use etl_coordination_core::{
    AcquisitionReason, Action, Breaker, Config, Epoch, Event, HandoverOutcome, Incarnation, Input,
    InstanceId, Outcome, Owner, SplitId, StopReason, Timestamp, WatchId, Worker,
};

use super::lanes::Lane;
use super::net::Link;
use super::{Ev, World, us};
use crate::check::Observation;
use crate::clock::Clock;
use crate::fault::Fault;
use crate::options::Scenario;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Status {
    Running,
    Paused,
    Crashed { restart: bool },
    Finished,
}

pub(crate) struct Slot {
    pub instance: InstanceId,
    pub life: u32,
    pub owner: Owner,
    pub core: Option<Worker>,
    pub status: Status,
    pub inbox: Vec<Ev>,
    pub tick_at: Option<Timestamp>,
    /// The source's lanes, by split and epoch (a stopped lane may still finish its record).
    pub lanes: BTreeMap<(SplitId, Epoch), Lane>,
    /// Lanes the core considers running (started and not stopped), with their epochs.
    pub core_lanes: BTreeMap<SplitId, Epoch>,
    /// The id to restart with (a crash may switch to a new id).
    pub restart_as: Option<InstanceId>,
    /// Asked to drain (scale-down): no longer counts as a live worker for fault decisions.
    pub draining: bool,
    pub outcome: Option<Outcome>,
    /// The job's end as this (staying) worker last reported it; the operator clears it when
    /// it requeues (and waits for a new report).
    pub ended: Option<Outcome>,
    /// The end this worker last declared (checked then): leaving with it later, after a drain,
    /// is the same declaration, not a new one.
    pub declared: Option<Outcome>,
    pub clock: Clock,
    pub link: Link,
    pub max_in_flight: u32,
    /// The worker's breaker (a new one per process, as in the driver).
    pub breaker: Breaker,
    /// Its sink fails every flush until then.
    pub sink_down_until: Timestamp,
    /// Its source fails every read until then.
    pub source_down_until: Timestamp,
    /// Draining lanes and the deadline (the worker's clock) each was given.
    pub drain_deadlines: BTreeMap<(SplitId, Epoch), Timestamp>,
    /// When the worker was told to drain (its clock).
    pub drain_started: Option<Timestamp>,
    /// The generation of each watch's current subscription: the events and failure of one it
    /// replaced are dropped, as the driver drops a reopened watch's earlier generation.
    pub watch_gen: BTreeMap<WatchId, u64>,
}

impl World {
    pub(crate) fn add_worker(&mut self, instance: InstanceId) -> usize {
        let max_in_flight = if self.opts.mixed_capacity {
            self.rng.range(1, self.opts.max_in_flight as u64) as u32
        } else {
            self.opts.max_in_flight
        };
        self.slots.push(Slot {
            instance: instance.clone(),
            life: 0,
            owner: Owner { instance, incarnation: Incarnation(0) },
            core: None,
            status: Status::Crashed { restart: true },
            inbox: Vec::new(),
            tick_at: None,
            lanes: BTreeMap::new(),
            core_lanes: BTreeMap::new(),
            restart_as: None,
            outcome: None,
            ended: None,
            declared: None,
            draining: false,
            clock: Clock::new(0, 0),
            link: Link::default(),
            max_in_flight,
            breaker: Breaker::new(0, Duration::ZERO),
            sink_down_until: Timestamp::ZERO,
            source_down_until: Timestamp::ZERO,
            drain_deadlines: BTreeMap::new(),
            drain_started: None,
            watch_gen: BTreeMap::new(),
        });
        let slot = self.slots.len() - 1;
        self.start_worker(slot);
        slot
    }

    pub(crate) fn start_worker(&mut self, slot: usize) {
        let incarnation = Incarnation(self.rng.next_u64());
        let drift = self.opts.clock_drift_ppm as i64;
        let drift_ppm = if drift == 0 { 0 } else { self.rng.range(0, 2 * drift as u64) as i64 - drift };
        let offset = self.rng.range(0, 1_000_000_000);
        let s = &mut self.slots[slot];
        if let Some(id) = s.restart_as.take() {
            s.instance = id;
        }
        s.life += 1;
        s.owner = Owner { instance: s.instance.clone(), incarnation };
        // A new process: a monotonic clock with an origin and a rate of its own.
        s.clock = Clock::new(offset, drift_ppm);
        if drift_ppm != 0 {
            *self.report.faults.entry(Fault::ClockDrifting.label()).or_default() += 1; // (self.fault: `s` is borrowed)
        }
        s.link = Link::default();
        s.breaker = Breaker::new(self.opts.breaker_threshold, self.opts.breaker_window);
        let mut cfg = Config::new(s.instance.clone(), incarnation, "sim-planner-v1");
        let t = &mut cfg.tuning;
        t.lease_duration = Duration::from_secs(self.opts.lease_secs);
        t.max_in_flight = s.max_in_flight;
        t.max_attempts = self.opts.max_attempts;
        t.replan_interval = Duration::from_secs(2);
        t.drain_timeout = self.opts.drain_timeout;
        t.handover_timeout = self.opts.handover_timeout;
        t.plan_timeout = Duration::from_secs(5);
        t.claim_backoff = self.opts.claim_backoff;
        t.manifest_chunk_len = self.opts.manifest_chunk_len;
        cfg.stay_after_end = self.opts.stay_after_end;
        cfg.validate().expect("sim config is valid");
        s.core = Some(Worker::new(cfg));
        s.status = Status::Running;
        s.draining = false;
        s.ended = None;
        s.declared = None;
        s.tick_at = None;
        s.inbox.clear();
        s.lanes.clear();
        s.core_lanes.clear();
        s.drain_deadlines.clear();
        s.drain_started = None;
        self.deliver(slot, Input::Start);
    }

    pub(crate) fn deliver(&mut self, slot: usize, input: Input) {
        let now = self.slots[slot].clock.local(self.now);
        let Some(core) = self.slots[slot].core.as_mut() else { return };
        if core.is_stopped() {
            return;
        }
        let life = self.slots[slot].life;
        self.stale_absent = match &input {
            Input::StoreResult { op, .. } => {
                self.stale_answers.remove(&(slot, life, *op)).unwrap_or_default()
            }
            _ => Vec::new(),
        };
        if matches!(input, Input::Drain) && self.slots[slot].drain_started.is_none() {
            self.slots[slot].drain_started = Some(now);
        }
        let core = self.slots[slot].core.as_mut().expect("checked above");
        let actions = core.handle(now, input);
        let deadline = core.next_deadline();
        self.mix(actions.len() as u64);
        self.delivering += 1;
        for a in actions {
            self.act(slot, a);
            if self.slots[slot].core.is_none() {
                self.delivering -= 1;
                return; // crashed while acting (poison)
            }
        }
        self.delivering -= 1;
        self.check_running_lanes(slot);
        if self.delivering == 0 {
            // (An input delivered while the actions of another are carried out is judged
            // once they all are: a lane the outer actions stop still runs in between.)
            self.check_capacity_and_drains(slot, now);
        }
        let s = &mut self.slots[slot];
        if let Some(d) = deadline {
            let at = s.clock.global(d).max(self.now);
            if s.tick_at.is_none_or(|t| t != at) {
                s.tick_at = Some(at);
                let life = s.life;
                self.schedule_at(at, Ev::Tick { slot, life });
            }
        }
    }

    /// P11: after every input, no lane the core keeps running may be past the TTL of the lease
    /// writes that landed for it (the store's time).
    pub(super) fn check_running_lanes(&mut self, slot: usize) {
        let s = &self.slots[slot];
        for (split, epoch) in &s.core_lanes {
            let obs = Observation::LaneRunning { id: split, epoch: *epoch, owner: &s.owner };
            self.checker.observe(self.now, obs, &mut self.state);
        }
    }

    /// After every input: the worker holds no more than its `max_in_flight` (P9), and a
    /// draining lane with no commit in flight runs only until its deadline (P10).
    fn check_capacity_and_drains(&mut self, slot: usize, local: Timestamp) {
        let s = &mut self.slots[slot];
        let Some(core) = s.core.as_ref() else { return };
        let (who, held, cap) = (s.owner.clone(), core.held().count() as u32, s.max_in_flight);
        // A deadline that came due while the input was handled (a commit in flight at the drain
        // deadline resolved) is acted on at the tick that follows at once.
        let overdue = core.next_deadline().is_some_and(|d| d <= local);
        let core_lanes = &s.core_lanes;
        s.drain_deadlines.retain(|(id, e), _| core_lanes.get(id) == Some(e));
        let running: Vec<(SplitId, Timestamp)> = s
            .drain_deadlines
            .iter()
            .filter(|(k, _)| !overdue && s.lanes.get(k).is_none_or(|l| !l.committing))
            .map(|((id, _), d)| (id.clone(), *d))
            .collect();
        self.checker.observe(self.now, Observation::Held { who: &who, held, cap }, &mut self.state);
        for (id, deadline) in running {
            let obs = Observation::DrainRunning { id: &id, who: &who, local, deadline };
            self.checker.observe(self.now, obs, &mut self.state);
        }
    }

    pub(super) fn act(&mut self, slot: usize, action: Action) {
        let life = self.slots[slot].life;
        if self.trace {
            eprintln!("{:>12}   {} -> {:?}", self.now.0, self.slots[slot].owner, action);
        }
        match action {
            Action::Store { op, bucket, request } => self.send_request(slot, op, bucket, request),
            Action::Watch { watch } => {
                // The watch it replaces is dropped at once, with its late events (as the driver
                // bumps its generation when it is asked, not when the new one opens).
                self.subs.retain(|s| !(s.slot == slot && s.watch == watch));
                let generation = {
                    let g = self.slots[slot].watch_gen.entry(watch).or_default();
                    *g += 1;
                    *g
                };
                let lat = us(self.rng.range(100, 1500));
                self.schedule(lat, Ev::OpenWatch { slot, life, watch, generation });
            }
            Action::Plan { request } => self.run_planner(slot, request),
            Action::StartLane { split, epoch, descriptor, progress, .. } => {
                self.slots[slot].core_lanes.insert(split.clone(), epoch);
                self.start_lane(slot, split, epoch, descriptor, progress)
            }
            Action::StopLane { split, epoch, reason, deadline } => {
                // A draining lane with a deadline still runs (and is checked) until it
                // acknowledges the stop; any other stop is at once.
                let at_once = reason != StopReason::Draining || deadline.is_none();
                let s = &mut self.slots[slot];
                let local = s.clock.local(self.now);
                match (reason, deadline) {
                    (StopReason::Draining, Some(d)) => {
                        s.drain_deadlines.insert((split.clone(), epoch), d);
                        if let Some(t0) = s.drain_started {
                            // P10: a drain gives its lanes `drain_timeout` from the request.
                            let who = s.owner.clone();
                            let given = d.saturating_since(t0);
                            let obs = Observation::DrainGiven { id: &split, who: &who, given };
                            self.checker.observe(self.now, obs, &mut self.state);
                        }
                    }
                    (StopReason::Draining, None) => {
                        if let Some(d) = s.drain_deadlines.remove(&(split.clone(), epoch)) {
                            let who = s.owner.clone();
                            let obs = Observation::DrainStopped { id: &split, who: &who, local, deadline: d };
                            self.checker.observe(self.now, obs, &mut self.state);
                        }
                    }
                    _ => {}
                }
                if at_once && self.slots[slot].core_lanes.get(&split) == Some(&epoch) {
                    self.slots[slot].core_lanes.remove(&split);
                }
                self.stop_lane(slot, split, epoch, reason, at_once)
            }
            Action::CommitDone { split, epoch, outcome } => self.commit_done(slot, split, epoch, outcome),
            Action::Event(e) => self.on_event(slot, e),
            Action::Finished(outcome) => {
                let who = self.slots[slot].owner.clone();
                // Cleanup is checked for workers that left with the store reachable (faults over,
                // held requests landed): one cut off from it gives up after its drain deadline
                // and a lease, and its keys expire instead.
                let reachable = self.safety_over && self.now >= self.settled_at();
                let draining = self.slots[slot].draining;
                let obs = Observation::Left { who: &who, outcome: &outcome, draining, reachable };
                self.checker.observe(self.now, obs, &mut self.state);
                self.declared(slot, &outcome);
                let s = &mut self.slots[slot];
                s.status = Status::Finished;
                s.outcome = Some(outcome);
                s.lanes.clear();
                s.core_lanes.clear();
                self.operator_after_end();
            }
            Action::Fatal(e) => {
                let who = self.slots[slot].owner.clone();
                self.checker.observe(self.now, Observation::Fatal { who: &who, error: &e }, &mut self.state);
                self.report.fatal.push(e.to_string());
                let s = &mut self.slots[slot];
                s.status = Status::Finished;
                s.lanes.clear();
                s.core_lanes.clear();
                self.subs.retain(|x| x.slot != slot);
            }
        }
    }

    /// A worker declared the job's end (leaving with it, or staying after it): I6 against the
    /// store, one outcome across workers, and no Complete while a poison split is unfixed.
    pub(super) fn declared(&mut self, slot: usize, outcome: &Outcome) {
        let who = self.slots[slot].owner.clone();
        let (complete, stalled) = (*outcome == Outcome::Complete, matches!(outcome, Outcome::Stalled { .. }));
        if !(complete || stalled) || self.slots[slot].declared.as_ref() == Some(outcome) {
            return;
        }
        self.slots[slot].declared = Some(outcome.clone());
        let obs = Observation::Declared { who: &who, outcome, healed: self.healed };
        self.checker.observe(self.now, obs, &mut self.state);
        self.report.outcome = if complete { "complete" } else { "stalled" };
    }

    /// Whether a steal now counts as one after the faults (random runs) or after convergence
    /// (the balance scenarios): steals there mean ownership oscillates (I7).
    fn in_balance_window(&self) -> bool {
        let balance_window = !self.report.owned_after_convergence.is_empty() && !self.balance_window_closed;
        (self.opts.scenario == Scenario::Random && self.safety_over) || balance_window
    }

    pub(super) fn on_event(&mut self, slot: usize, e: Event) {
        if self.trace && !matches!(e, Event::Gauges { .. }) {
            eprintln!("{:>12} slot {slot} ({}) {e:?}", self.now.0, self.slots[slot].instance);
        }
        if matches!(e, Event::Finished { .. }) && self.safety_over {
            self.report.finished_after_faults += 1;
        }
        match e {
            Event::JobEnded { outcome } => {
                self.declared(slot, &outcome);
                self.slots[slot].ended = Some(outcome);
                self.operator_after_end();
            }
            Event::JobReopened => {
                self.slots[slot].ended = None;
                self.slots[slot].declared = None;
            }
            Event::Steal { split, .. } => {
                self.report.steals += 1;
                let (who, local) = (self.slots[slot].owner.clone(), self.slots[slot].clock.local(self.now));
                self.checker.observe(
                    self.now,
                    Observation::Steal { who: &who, id: &split, local },
                    &mut self.state,
                );
            }
            Event::Handover { split, from, to, outcome, .. } => {
                *self.report.handovers.entry(outcome.label()).or_default() += 1;
                // A forced one is counted by its acquisition (stolen).
                if outcome == HandoverOutcome::HandedOver && self.in_balance_window() {
                    self.report.steals_after_faults += 1;
                }
                let obs = Observation::Handover { id: &split, from, to, outcome };
                self.checker.observe(self.now, obs, &mut self.state);
            }
            Event::Acquired { split, reason, epoch } => {
                *self.report.acquisitions.entry(reason.label()).or_default() += 1;
                let who = self.slots[slot].owner.clone();
                let obs = Observation::Acquired { id: &split, epoch, reason, who: &who };
                self.checker.observe(self.now, obs, &mut self.state);
                if reason == AcquisitionReason::Stolen && self.in_balance_window() {
                    self.report.steals_after_faults += 1;
                }
                if let Some(t) = self.released_at.remove(&split) {
                    let ms = self.now.saturating_since(t).as_secs_f64() * 1000.0;
                    let m = self.report.max_pickup_ms.get_or_insert(0.0);
                    *m = m.max(ms);
                }
            }
            Event::Revoked { split, reason: StopReason::Fenced } => {
                let (now, who) = (self.now, self.slots[slot].owner.clone());
                let record =
                    self.state.get(now, &keys::split(&split)).and_then(|e| records::decode(&e.value).ok());
                let lease =
                    self.lease.get(now, &keys::split(&split)).and_then(|e| records::decode(&e.value).ok());
                // Excused: another owner's write waits at a stuck leader (it may land), or the
                // answer being handled is a lagging replica's "absent" for this split's record
                // or lease (it looks like an expiry; only reads through the leader tell).
                let waiting = self.foreign_write_waiting(&split, &who)
                    || self.stale_absent.contains(&keys::split(&split));
                let obs = Observation::Fenced {
                    id: &split,
                    owner: &who,
                    record: record.as_ref(),
                    lease: lease.as_ref(),
                    foreign_write_waiting: waiting,
                };
                self.checker.observe(now, obs, &mut self.state);
            }
            Event::Quarantined { .. } => self.report.quarantined += 1,
            Event::Released { split } if self.opts.scenario == Scenario::DrainPickup => {
                self.released_at.insert(split, self.now);
            }
            _ => {}
        }
    }
}
