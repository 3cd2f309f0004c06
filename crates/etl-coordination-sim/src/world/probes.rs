//! Phases and probes: the end of the safety phase, balance and scenario checkpoints, the
//! report.

use std::time::Duration;

use etl_coordination_core::{Bucket, Input, Timestamp, Worker};

use super::{Ev, Status, World};
use crate::check::{Observation, WorkerLoad};
use crate::options::{Report, Scenario};

impl World {
    pub(super) fn end_safety(&mut self) {
        self.safety_over = true;
        self.faults_on = false;
        self.outage_until = self.now;
        self.heal_data_path();
        for bucket in [Bucket::State, Bucket::Lease] {
            self.recover_stream(bucket);
        }
        for slot in 0..self.slots.len() {
            self.slots[slot].link.heal(self.now);
            if self.slots[slot].status == Status::Paused {
                self.resume(slot);
            }
        }
        let alive = self.slots.iter().any(|s| {
            matches!(s.status, Status::Running | Status::Paused | Status::Crashed { restart: true })
        });
        if !alive {
            let id = self.new_instance_id();
            self.add_worker(id);
        }
        if self.opts.scenario == Scenario::Random {
            // Requests held by stalled links during the safety phase land up to two op
            // timeouts later; balance is judged once they have.
            let at = self.settled_at();
            self.schedule_at(at, Ev::BalanceProbe);
        }
        self.operator_after_end();
    }

    /// When the faults of the safety phase no longer act: held requests have landed (two op
    /// timeouts) and a worker that began leaving under them has finished (drain deadline and a
    /// lease).
    pub(super) fn settled_at(&self) -> Timestamp {
        let lease = Duration::from_secs(self.opts.lease_secs);
        Timestamp::ZERO + self.opts.safety + self.opts.op_timeout * 2 + lease * 2 + Duration::from_secs(2)
    }

    /// I7 in random runs: once faults stop, a move that would lower the imbalance by weight
    /// must stop being possible within a few heartbeats (steals converge, P9).
    pub(super) fn balance_probe(&mut self) {
        let hb = Duration::from_secs(self.opts.lease_secs) / 3;
        let mut loads = Vec::new();
        for s in &self.slots {
            if s.status != Status::Running || s.draining {
                continue;
            }
            if let Some(c) = &s.core
                && !c.is_stopped()
            {
                // A worker whose breaker is open takes nothing new (until its probe closes it).
                let held = self.held_weights(c);
                let open = !matches!(s.breaker.state(), etl_coordination_core::BreakerState::Closed);
                let cap = if open { held.len() as u32 } else { s.max_in_flight };
                let returning =
                    c.returning().map(|id| self.splits[self.split_index[id]].weight.max(1)).collect();
                loads.push(WorkerLoad { held, cap, returning });
            }
        }
        self.checker.observe(self.now, Observation::Loads { workers: &loads }, &mut self.state);
        if !self.all_done() {
            self.schedule(hb, Ev::BalanceProbe);
        }
    }

    /// The weights of the splits a worker holds.
    fn held_weights(&self, core: &Worker) -> Vec<u64> {
        core.held().map(|(id, _)| self.splits[self.split_index[id]].weight.max(1)).collect()
    }

    /// Scenario checkpoints.
    pub(super) fn probe(&mut self) {
        match self.opts.scenario {
            Scenario::DuplicateId => {
                // A twin of the first worker, alive at the same time.
                let twin = self.slots[0].instance.clone();
                self.add_worker(twin);
            }
            Scenario::DrainPickup if self.now.0 == 3_000_000 => {
                self.deliver(0, Input::Drain);
            }
            Scenario::Balance | Scenario::BalanceWeighted => {
                if self.now.0 == 3_000_000 {
                    for _ in 0..2 {
                        let id = self.new_instance_id();
                        self.add_worker(id);
                    }
                    // Measure after convergence, then watch for further steals.
                    self.schedule(Duration::from_secs(20), Ev::Probe);
                } else if self.report.owned_after_convergence.is_empty() {
                    let loads: Vec<WorkerLoad> = self
                        .slots
                        .iter()
                        .map(|s| WorkerLoad {
                            held: s.core.as_ref().map_or_else(Vec::new, |c| self.held_weights(c)),
                            cap: s.max_in_flight,
                            returning: Vec::new(),
                        })
                        .collect();
                    self.checker.observe(
                        self.now,
                        Observation::Converged { workers: &loads },
                        &mut self.state,
                    );
                    self.report.owned_after_convergence = loads.iter().map(|l| l.held.len() as u32).collect();
                    self.report.loads_after_convergence = loads.iter().map(|l| l.held.iter().sum()).collect();
                    // Splits moved: handed over, or taken (a forced handover is a stolen acquisition).
                    self.report.steals_to_converge =
                        self.report.acquisitions.get("stolen").copied().unwrap_or(0)
                            + self.report.handovers.get("handed_over").copied().unwrap_or(0);
                    self.report.steals_after_faults = 0;
                    self.schedule(Duration::from_secs(15), Ev::Probe);
                } else if !self.balance_window_closed {
                    self.balance_window_closed = true;
                    let steals = self.report.steals_after_faults;
                    self.checker.observe(
                        self.now,
                        Observation::BalanceWindowClosed { steals },
                        &mut self.state,
                    );
                }
            }
            _ => {}
        }
    }

    pub(super) fn finish(mut self) -> Report {
        let states: Vec<String> =
            self.slots.iter().map(|s| format!("{}: {:?} {:?}", s.instance, s.status, s.outcome)).collect();
        let obs = Observation::RunEnded {
            steals_after_faults: self.report.steals_after_faults,
            splits: self.splits.len() as u64,
            finished: self.report.finished_after_faults,
            no_outcome: self.report.outcome == "none",
            states: &states,
        };
        self.checker.observe(self.now, obs, &mut self.state);
        self.report.healthy_quarantined =
            self.checker.innocent().iter().map(|(id, charges)| format!("{id} {charges:?}")).collect();
        self.report.collateral_quarantined =
            self.checker.collateral().iter().map(|(id, charges)| format!("{id} {charges:?}")).collect();
        (self.report.violation, self.report.checks) = self.checker.verdict();
        self.report.virtual_time = self.now.since_origin();
        self.report.trace_hash = self.hash;
        self.report
    }
}
