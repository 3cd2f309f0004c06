//! The planner: lists the splits discovered so far (Open until every split is discovered,
//! then Final), with its faults.

use bytes::Bytes;
use etl_coordination_core::records::{self, PlanHead, keys};
use etl_coordination_core::{Input, Plan, PlanKind, PlannedSplit};

use super::{Ev, World, ms};
use crate::check::Observation;
use crate::fault::Fault;

impl World {
    /// The planner: lists the splits discovered so far (Open until every split is discovered,
    /// then Final). With planner faults it errs, hangs or panics (the driver reports a panic
    /// as an error).
    pub(super) fn run_planner(&mut self, slot: usize, request: u64) {
        let life = self.slots[slot].life;
        let head = self.current_head();
        let who = self.slots[slot].owner.clone();
        let obs = Observation::PlannerStarted { who: &who, head: head.as_ref() };
        self.checker.observe(self.now, obs, &mut self.state);
        if self.faults_on && self.opts.planner_faults {
            match self.rng.range(0, 99) {
                0..=9 => {
                    self.fault(Fault::PlannerError);
                    let input =
                        Input::PlanReady { request, result: Err("listing failed: connection reset".into()) };
                    let delay = ms(self.rng.range(1, 300));
                    return self.schedule(delay, Ev::ToWorker { slot, life, input });
                }
                10..=14 => {
                    self.fault(Fault::PlannerHang);
                    return;
                }
                15..=19 => {
                    self.fault(Fault::PlannerPanic);
                    let input = Input::PlanReady {
                        request,
                        result: Err("the planner panicked: index out of bounds".into()),
                    };
                    let delay = ms(self.rng.range(1, 50));
                    return self.schedule(delay, Ev::ToWorker { slot, life, input });
                }
                _ => {}
            }
        }
        let plan = self.plan();
        let obs = Observation::PlanListed { kind: plan.kind, head: head.as_ref() };
        self.checker.observe(self.now, obs, &mut self.state);
        let delay = ms(self.rng.range(1, 40));
        self.schedule(
            delay,
            Ev::ToWorker { slot, life, input: Input::PlanReady { request, result: Ok(plan) } },
        );
        if self.faults_on && self.rng.chance(0.1) {
            // Leader death mid-plan.
            let when = ms(self.rng.range(0, 60));
            self.fault(Fault::LeaderKilledMidPlan);
            self.schedule(when, Ev::Crash { slot, life });
        }
    }

    pub(super) fn current_head(&mut self) -> Option<PlanHead> {
        let now = self.now;
        self.state.get(now, &keys::plan_head()).and_then(|e| records::decode::<PlanHead>(&e.value).ok())
    }

    pub(super) fn plan(&self) -> Plan {
        let open = self.now < self.open_until;
        let splits = self
            .splits
            .iter()
            .filter(|s| !open || s.discovered_at <= self.now)
            .map(|s| {
                PlannedSplit::new(s.id.clone(), Bytes::copy_from_slice(&s.total.to_le_bytes()), s.weight)
            })
            .collect();
        Plan::new(if open { PlanKind::Open } else { PlanKind::Final }, splits)
    }
}
