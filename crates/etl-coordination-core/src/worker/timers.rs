//! Every deadline of a worker as one [`Timer`] table. The same table answers
//! [`Worker::next_deadline`] and drives the tick handler, so what is scheduled and what fires
//! cannot drift apart (quinn-proto's `TimerTable` is the model).

use crate::ids::SplitId;
use crate::time::Timestamp;

use super::plan::PlanStage;
use super::presence::Join;
use super::steal::StealStage;
use super::tenancy::Stage;
use super::{Phase, Worker};

/// One deadline. Timers due at the same tick fire in declaration order (and, per split, in
/// split id order): the lapses of trust first, then retries, the presence check, heartbeats
/// and resyncs, then the deadlines that end tenancies, then planning.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(super) enum Timer {
    // Lapses of trust come first: after a pause, a leader whose trust lapsed steps down before
    // a delayed retry of its plan write goes out (the simulator's check of the leader's own
    // trust caught the retry first; the write was fenced by its CAS, but sent unled).
    /// P11: trust in a running (or draining) lane's lease lapses; the lane stops (starved).
    LeaseTrust(SplitId),
    /// P11: trust in the leader lease lapses; the worker steps down.
    LeaderTrust,
    /// A delayed retry of a store request is due (the earliest of the retry queue).
    Retry,
    /// P3: the observation window over a predecessor's presence key ends.
    PresenceObservation,
    /// P7: renew presence, the leader lease and every held lease.
    Heartbeat,
    /// P7: the full listing that guards against missed watch events.
    Resync,
    /// P4: a refused leader attempt may be made again.
    LeaderRetry,
    /// P10: a stopping lane's commit deadline passed; its split is released anyway.
    StopDeadline(SplitId),
    /// P10, P12: a failed end record write is retried.
    EndRetry(SplitId),
    /// P10: the drain deadline passed; a lease later, what could not be released is given up.
    DrainDeadline,
    /// P4: an open plan is due for re-planning.
    Replan,
    /// P4: a failed planning step is retried.
    PlanRetry,
    /// P12: a failed split's claim backoff ends (acquisition runs after every input).
    ClaimBackoff,
    /// P4: the planner did not answer within `plan_timeout`.
    PlanTimeout,
    /// P9: the owner of a split asked for did not release it in time: take it over.
    StealDeadline,
}

impl Worker {
    /// Calls `f` with every armed timer and its deadline.
    pub(super) fn for_each_timer(&self, mut f: impl FnMut(Timer, Timestamp)) {
        if self.phase == Phase::Stopped {
            return;
        }
        if let Some(at) = self.outbox.next_retry_at() {
            f(Timer::Retry, at);
        }
        if let Join::Observing { deadline, .. } = self.presence.join {
            f(Timer::PresenceObservation, deadline);
        }
        if let Some(at) = self.heartbeat_at {
            f(Timer::Heartbeat, at);
        }
        if let Some(at) = self.resync_at {
            f(Timer::Resync, at);
        }
        for (id, h) in self.tenancies.iter() {
            match h.stage {
                Stage::Running => f(Timer::LeaseTrust(id.clone()), h.lease.trusted_until),
                Stage::Stopping { deadline } => {
                    // A draining lane still runs: it is starved like a running one (P11).
                    f(Timer::LeaseTrust(id.clone()), h.lease.trusted_until);
                    // With a commit in flight the commit's result drives the end, not the deadline.
                    if h.commit.is_none() {
                        f(Timer::StopDeadline(id.clone()), deadline);
                    }
                }
                Stage::EndRetry { at } => f(Timer::EndRetry(id.clone()), at),
                _ => {}
            }
        }
        if let Some(at) = self.leader_retry_at {
            f(Timer::LeaderRetry, at);
        }
        if let Some(l) = &self.leader {
            f(Timer::LeaderTrust, l.trusted_until);
            if let Some(at) = l.replan_at {
                f(Timer::Replan, at);
            }
            match l.stage {
                PlanStage::RetryAt(at) => f(Timer::PlanRetry, at),
                PlanStage::Requested { deadline, .. } => f(Timer::PlanTimeout, deadline),
                _ => {}
            }
        }
        if let Some(at) = self.backoffs.next_due() {
            f(Timer::ClaimBackoff, at);
        }
        if let Some(p) = &self.steal
            && p.stage == StealStage::Waiting
        {
            f(Timer::StealDeadline, p.force_at);
        }
        if let Some(l) = &self.leaving {
            let at = if l.deadline_passed { l.deadline + self.cfg.tuning.lease_duration } else { l.deadline };
            f(Timer::DrainDeadline, at);
        }
    }

    /// Fires every timer due at `now`.
    pub(super) fn on_tick(&mut self, now: Timestamp) {
        let mut due = Vec::new();
        self.for_each_timer(|timer, at| {
            if at <= now {
                due.push(timer);
            }
        });
        due.sort();
        for timer in due {
            self.fire(now, timer);
        }
    }

    fn fire(&mut self, now: Timestamp, timer: Timer) {
        match timer {
            Timer::Retry => self.send_due_retries(now),
            Timer::PresenceObservation => self.observation_ended(now),
            Timer::Heartbeat => {
                self.heartbeat_at = Some(now + self.cfg.tuning.heartbeat_interval());
                self.heartbeat(now);
            }
            Timer::Resync => {
                self.resync_at = Some(now + self.cfg.tuning.resync_interval_for(self.view.splits.len()));
                self.resync();
                self.refresh_meta();
            }
            Timer::LeaseTrust(id) => self.starve(now, &id),
            Timer::LeaderTrust => self.leader_trust_lapsed(now),
            // Leadership is evaluated after every input, this tick included.
            Timer::LeaderRetry => self.leader_retry_at = None,
            Timer::StopDeadline(id) => self.stop_deadline_passed(now, &id),
            Timer::EndRetry(id) => self.end_retry_due(now, &id),
            Timer::DrainDeadline => self.drain_deadline_passed(now),
            Timer::Replan => self.replan_due(now),
            Timer::PlanRetry => self.plan_retry_due(now),
            // The acquisition after this input claims what is due.
            Timer::ClaimBackoff => self.backoffs.elapse(now),
            Timer::PlanTimeout => self.plan_timed_out(now),
            // Taken over (or withdrawn) now, whether or not an acquisition follows this input.
            Timer::StealDeadline => {
                if self.phase == Phase::Running && self.presence.join == Join::Joined {
                    self.progress_steal(now)
                } else {
                    self.end_steal(None, crate::io::HandoverOutcome::Withdrawn)
                }
            }
        }
    }
}
