//! Draining and leaving (P10, P13): lanes get a deadline to commit, every split is released,
//! then presence (and leadership) are deleted and the worker finishes with its outcome. No
//! attempts are consumed.

use crate::ids::SplitId;
use crate::io::{Action, Event, Outcome, StopReason};
use crate::records::keys;
use crate::time::Timestamp;

use super::outbox::Pending;
use super::tenancy::{End, Stage};
use super::{Phase, Worker};

/// A worker on its way out.
#[derive(Debug)]
pub(super) struct Leaving {
    /// What [`Action::Finished`] will report.
    pub(super) outcome: Outcome,
    /// Lanes commit by then; a lease later, what could not be released is given up.
    pub(super) deadline: Timestamp,
    /// The presence and leader deletes were sent.
    pub(super) cleanup_sent: bool,
    pub(super) deadline_passed: bool,
}

impl Worker {
    /// P10: graceful shutdown on request. A worker that stayed after the job ended leaves
    /// with that end as its outcome.
    pub(super) fn on_drain(&mut self, now: Timestamp) {
        match self.phase {
            Phase::Running => {
                let outcome = self.ended.take().unwrap_or(Outcome::Drained);
                self.leave(now, outcome)
            }
            Phase::Idle | Phase::Meta | Phase::Joining => {
                self.phase = Phase::Leaving;
                self.leaving = Some(Leaving {
                    outcome: Outcome::Drained,
                    deadline: now,
                    cleanup_sent: false,
                    deadline_passed: false,
                });
            }
            _ => {}
        }
    }

    /// Starts leaving with `outcome`: running lanes get the drain deadline, starved splits are
    /// released at once.
    pub(super) fn leave(&mut self, now: Timestamp, outcome: Outcome) {
        self.phase = Phase::Leaving;
        let deadline = now + self.cfg.tuning.drain_timeout;
        self.leaving = Some(Leaving { outcome, deadline, cleanup_sent: false, deadline_passed: false });
        let ids: Vec<SplitId> = self.tenancies.ids().cloned().collect();
        for id in ids {
            let h = &mut self.tenancies[&id];
            match h.stage {
                Stage::Running => {
                    h.stage = Stage::Stopping { deadline };
                    let epoch = h.epoch;
                    self.outbox.push(Action::StopLane {
                        split: id,
                        epoch,
                        reason: StopReason::Draining,
                        deadline: Some(deadline),
                    });
                }
                Stage::Starved => self.begin_end(&id, End::Release),
                _ => {}
            }
        }
    }

    /// Once nothing is held: delete presence and leadership, then finish once every delete and
    /// every lease-bucket write, release or orphaned claim still in flight is settled (or a
    /// lease after the deadline).
    pub(super) fn progress_leaving(&mut self, now: Timestamp) {
        let Some(l) = &self.leaving else { return };
        if !self.tenancies.is_empty() {
            return;
        }
        let give_up = now >= l.deadline + self.cfg.tuning.lease_duration;
        if !l.cleanup_sent {
            if self.presence.renewing.is_some() && !give_up {
                return; // the delete needs the revision this renewal may write
            }
            self.presence.retired = true;
            if let Some(rev) = self.presence.rev {
                self.retire(keys::worker(&self.me.instance), rev);
            }
            if let Some(lead) = self.leader.take() {
                self.retire(keys::leader(), lead.rev);
                let term = lead.head.as_ref().map_or(0, |(_, h)| h.term);
                self.outbox.event(Event::Leadership { leader: false, term });
            } else if let Some((rev, l)) = &self.view.leader
                && l.owner == self.me
            {
                // We stepped down (trust lapsed) but the key may still name us.
                self.retire(keys::leader(), *rev);
            }
            self.leaving.as_mut().expect("leaving").cleanup_sent = true;
            return;
        }
        let settling = self.outbox.in_flight().any(|p| {
            matches!(
                p,
                Pending::Retire { .. }
                    | Pending::RetireRead { .. }
                    | Pending::LeaseAcquire { .. }
                    | Pending::LeaseAcquireResolve { .. }
                    | Pending::LeaderCreate { .. }
                    | Pending::LeaderResolve { .. }
                    | Pending::PresenceCreate
                    | Pending::PresenceRenew
                    | Pending::PresenceResolve
                    | Pending::StealAsk { .. }
                    | Pending::OrphanClaim(_)
                    | Pending::OrphanClaimRead(_)
                    | Pending::Release
            )
        });
        if !settling || give_up {
            let outcome = self.leaving.take().expect("leaving").outcome;
            self.outbox.push(Action::Finished(outcome));
            self.phase = Phase::Stopped;
            self.outbox.clear();
        }
    }

    /// P10: a stopping lane did not acknowledge by its deadline (or an end write is due for
    /// another try): end the tenancy as planned, by default a release.
    pub(super) fn stop_deadline_passed(&mut self, now: Timestamp, id: &SplitId) {
        let due = self.tenancies.get(id).is_some_and(|h| {
            h.commit.is_none() && matches!(h.stage, Stage::Stopping { deadline } if deadline <= now)
        });
        if due {
            // The lane had its time: it stops now (a later commit of it is not written).
            let epoch = self.tenancies[id].epoch;
            self.outbox.push(Action::StopLane {
                split: id.clone(),
                epoch,
                reason: StopReason::Draining,
                deadline: None,
            });
            let end = self.tenancies.get_mut(id).and_then(|h| h.ending.how.take()).unwrap_or(End::Release);
            self.begin_end(id, end);
        }
    }

    /// P10, P12: write the end record again after a failed attempt.
    pub(super) fn end_retry_due(&mut self, now: Timestamp, id: &SplitId) {
        let due =
            self.tenancies.get(id).is_some_and(|h| matches!(h.stage, Stage::EndRetry { at } if at <= now));
        if due {
            let end = self.tenancies.get_mut(id).and_then(|h| h.ending.how.take()).unwrap_or(End::Release);
            self.begin_end(id, end);
        }
    }

    /// P10: past the drain deadline; a lease later, give up on what could not be released (the
    /// leases expire by themselves).
    pub(super) fn drain_deadline_passed(&mut self, now: Timestamp) {
        if let Some(l) = &mut self.leaving
            && now >= l.deadline
        {
            l.deadline_passed = true;
            if now >= l.deadline + self.cfg.tuning.lease_duration {
                for (id, h) in self.tenancies.take_all() {
                    if matches!(h.stage, Stage::Running | Stage::Stopping { .. }) {
                        let stop = StopReason::Draining;
                        self.outbox.push(Action::StopLane {
                            split: id,
                            epoch: h.epoch,
                            reason: stop,
                            deadline: None,
                        });
                    }
                }
            }
        }
    }
}
