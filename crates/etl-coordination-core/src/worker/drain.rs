//! Draining and leaving (P10, P13): lanes get a deadline to commit, every split is released,
//! then presence (and leadership) are deleted and the worker finishes with its outcome. No
//! attempts are consumed.

use crate::ids::SplitId;
use crate::io::{Action, Event, Outcome, StopReason};
use crate::records::keys;
use crate::store::{Bucket, StoreRequest};
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
    /// Best-effort deletes not answered yet.
    pub(super) cleanup_outstanding: usize,
    pub(super) deadline_passed: bool,
}

impl Worker {
    /// P10: graceful shutdown on request.
    pub(super) fn on_drain(&mut self, now: Timestamp) {
        match self.phase {
            Phase::Running => self.leave(now, Outcome::Drained),
            Phase::Idle | Phase::Meta | Phase::Joining => {
                self.phase = Phase::Leaving;
                self.leaving = Some(Leaving {
                    outcome: Outcome::Drained,
                    deadline: now,
                    cleanup_sent: false,
                    cleanup_outstanding: 0,
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
        self.leaving = Some(Leaving {
            outcome,
            deadline,
            cleanup_sent: false,
            cleanup_outstanding: 0,
            deadline_passed: false,
        });
        let ids: Vec<SplitId> = self.held.keys().cloned().collect();
        for id in ids {
            let h = self.held.get_mut(&id).expect("held");
            match h.stage {
                Stage::Running => {
                    h.stage = Stage::Stopping { deadline };
                    let epoch = h.epoch;
                    self.out.push(Action::StopLane {
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

    /// Once nothing is held: delete presence and leadership, then finish.
    pub(super) fn progress_leaving(&mut self, now: Timestamp) {
        let Some(l) = &self.leaving else { return };
        if !self.held.is_empty() {
            return;
        }
        if !l.cleanup_sent {
            let mut n = 0;
            if let Some(rev) = self.presence.rev {
                self.send(
                    Bucket::Lease,
                    StoreRequest::Delete { key: keys::worker(&self.me.instance), expected: rev },
                    Pending::Cleanup,
                );
                n += 1;
            }
            if let Some(lead) = self.leader.take() {
                self.send(
                    Bucket::Lease,
                    StoreRequest::Delete { key: keys::leader(), expected: lead.rev },
                    Pending::Cleanup,
                );
                n += 1;
                let term = lead.head.as_ref().map_or(0, |(_, h)| h.term);
                self.event(Event::Leadership { leader: false, term });
            }
            let l = self.leaving.as_mut().expect("leaving");
            l.cleanup_sent = true;
            l.cleanup_outstanding += n;
            return;
        }
        if l.cleanup_outstanding == 0 || now >= l.deadline + self.cfg.tuning.lease_duration {
            let outcome = self.leaving.take().expect("leaving").outcome;
            self.out.push(Action::Finished(outcome));
            self.phase = Phase::Stopped;
            self.pending.clear();
            self.retries.clear();
        }
    }

    /// A best-effort delete was answered.
    pub(super) fn on_cleanup(&mut self) {
        if let Some(l) = &mut self.leaving {
            l.cleanup_outstanding = l.cleanup_outstanding.saturating_sub(1);
        }
    }

    /// P10: a stopping lane did not acknowledge by its deadline (or an end write is due for
    /// another try): end the tenancy as planned, by default a release.
    pub(super) fn stop_deadline_passed(&mut self, now: Timestamp, id: &SplitId) {
        let due = self.held.get(id).is_some_and(|h| {
            h.commit.is_none() && matches!(h.stage, Stage::Stopping { deadline } if deadline <= now)
        });
        if due {
            let end = self.held.get_mut(id).and_then(|h| h.end.take()).unwrap_or(End::Release);
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
                self.held.clear();
            }
        }
    }
}
