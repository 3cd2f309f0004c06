//! Pairwise stealing by weight (P9): a worker with a free lane and nothing left to claim takes
//! one split per heartbeat cycle from a peer, only when the move strictly lowers the imbalance:
//! a split of weight `w` moves from `a` to `b` only if `load(a) > load(b) + w`. Every such move
//! lowers the sum of squared loads by `2w(load(a) - load(b) - w) > 0`, so moves stop (converge)
//! and a split never comes back (no oscillation). With equal weights this is "at least two more
//! splits": the +-1 balance of counts.
//!
//! A steal asks before it takes (when `handover_timeout` is set): the thief creates
//! `steal.{victim}` naming the split and the victim's tenancy. The victim, if that tenancy is
//! still running and the move still lowers the imbalance by its own exact load, stops the lane
//! at a safe point, commits and releases the split (the drain path); the request reserves the
//! released split for the thief, who claims it with the usual CAS. Nothing is read twice. If
//! the owner does not release by the deadline, the thief takes the split over as a plain steal
//! (the owner is fenced; its uncommitted tail replays). One request per victim at a time (the
//! key is created, never overwritten): steals from one worker are serialised, so two thieves
//! never both move load off one victim on the same stale view.

use std::cmp::Ordering;

use crate::ids::{Epoch, InstanceId, Revision, SplitId};
use crate::io::{AcquisitionReason, Action, Event, HandoverOutcome, StopReason};
use crate::records::{self, SplitState, StealRequest, keys};
use crate::store::{Bucket, StoreRequest, StoreResult};
use crate::time::Timestamp;
use crate::view::effective_weight;

use super::outbox::{Pending, Written};
use super::tenancy::Stage;
use super::{Phase, Worker};

/// A cooperative steal this worker asked for (P9).
#[derive(Debug, Clone)]
pub(super) struct PendingSteal {
    pub(super) victim: InstanceId,
    pub(super) split: SplitId,
    /// The victim's tenancy asked to end.
    pub(super) epoch: Epoch,
    /// The request's revision once its create is known to have landed.
    pub(super) rev: Option<Revision>,
    /// When the thief takes the split over if it was not released.
    pub(super) force_at: Timestamp,
    pub(super) stage: StealStage,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum StealStage {
    /// The request's create is in flight.
    Asking,
    /// Waiting for the owner to release the split (or for the deadline).
    Waiting,
    /// The owner refused (deleted the request).
    Refused,
    /// Claiming the split: released by its owner, or taken over (`forced`).
    Claiming { forced: bool },
}

/// How many splits next to the ideal weight a thief looks at in each direction, skipping ones
/// it cannot take (blocked, record not Owned): a bound, so a pick stays O(log n).
const PICK_PROBES: usize = 8;

/// A move the thief could make: the split, its victim and how much it lowers the sum of squared
/// loads (half of it: `w * (gap - w)`).
#[derive(Debug)]
struct Move {
    gain: u128,
    victim: InstanceId,
    split: SplitId,
}

impl Worker {
    /// The load this worker holds (P9): the effective weight of every tenancy it has, and of
    /// the splits its lanes failed that wait to be claimed again.
    pub(super) fn own_load(&self) -> u128 {
        let held: u128 = self.tenancies.values().map(|h| u128::from(effective_weight(h.weight))).sum();
        let returning: u128 = self
            .failed_here
            .iter()
            .filter(|(id, _)| !self.tenancies.contains(id))
            .map(|(_, w)| u128::from(effective_weight(*w)))
            .sum();
        held + returning
    }

    /// Forgets the failed splits that no longer wait to be claimed again: another worker holds
    /// its lease, or it ended (done, quarantined, or gone from the plan).
    pub(super) fn forget_returned(&mut self) {
        let (view, me) = (&self.view, &self.me);
        self.failed_here.retain(|id, _| {
            view.splits.get(id).is_some_and(|sv| {
                sv.weight.is_some()
                    && sv.record.as_ref().is_some_and(|r| !r.is_terminal())
                    && sv.lease.as_ref().is_none_or(|l| l.owner == *me)
            })
        });
    }

    /// How many lanes this worker may run: `max_in_flight`, within the embedding layer's cap.
    pub(super) fn lane_budget(&self) -> usize {
        let cap = self.intake_limit.map_or(usize::MAX, |l| l as usize);
        (self.cfg.tuning.max_in_flight as usize).min(cap)
    }

    /// P9: at most one steal per heartbeat cycle and one in flight, with a free lane, of the
    /// split whose move lowers the imbalance most. Only a steal on a consistent view is
    /// attempted (see `claim::start_acquire`).
    pub(super) fn maybe_steal(&mut self, now: Timestamp) {
        if self.tenancies.values().any(|h| {
            h.acquisition.reason == AcquisitionReason::Stolen
                && h.stage != Stage::Running
                && h.stage != Stage::Starved
        }) {
            return;
        }
        if self.last_steal_at.is_some_and(|t| now < t + self.cfg.tuning.heartbeat_interval()) {
            return;
        }
        if self.tenancies.len() >= self.lane_budget() {
            return;
        }
        if self.steal.is_some() {
            return;
        }
        let Some(best) = self.best_move() else { return };
        self.last_steal_at = Some(now);
        let weight = self.view.splits.get(&best.split).and_then(|sv| sv.weight).unwrap_or(0);
        let loads = (self.view.loads.get(&best.victim).copied().unwrap_or(0), self.own_load());
        self.outbox.event(Event::Steal {
            split: best.split.clone(),
            victim: best.victim.clone(),
            weight,
            loads,
        });
        match self.cfg.tuning.handover_wait() {
            Some(wait) => self.ask(now, best, weight, wait),
            None => self.start_acquire(now, &best.split, AcquisitionReason::Stolen),
        }
    }

    /// Creates the request for `best` (P9). The thief takes the split over at
    /// `now + wait + heartbeat` if it is not released by then: the owner's lane has `wait` from
    /// when it sees the request, so its last commit is not cut short by a takeover racing it.
    fn ask(&mut self, now: Timestamp, best: Move, weight: u64, wait: std::time::Duration) {
        let Some(epoch) = self.view.splits.get(&best.split).and_then(|sv| sv.lease.as_ref()).map(|l| l.epoch)
        else {
            return;
        };
        let request = StealRequest {
            thief: self.me.clone(),
            split: best.split.clone(),
            epoch,
            weight,
            thief_load: self.own_load(),
            write: self.outbox.next_op_id().0,
        };
        let key = keys::steal(&best.victim);
        let create = StoreRequest::Create { key, value: records::encode(&request), ttl: self.ttl() };
        self.outbox.send(Bucket::Lease, create, Pending::StealAsk { victim: best.victim.clone() });
        self.steal = Some(PendingSteal {
            victim: best.victim,
            split: best.split,
            epoch,
            rev: None,
            force_at: now + wait + self.cfg.tuning.heartbeat_interval(),
            stage: StealStage::Asking,
        });
    }

    /// The answer to a request's create: it waits for the owner; another thief's request to
    /// the same victim (or a store that is down) ends this steal; in doubt, the watch or the
    /// withdrawal's read back tells.
    pub(super) fn on_steal_ask(&mut self, victim: InstanceId, result: StoreResult) {
        let current =
            self.steal.as_ref().is_some_and(|p| p.victim == victim && p.stage == StealStage::Asking);
        let written = Written::of(result);
        if !current {
            // An abandoned request that landed after all: take it back.
            if let Written::Applied(rev) = written {
                self.retire(keys::steal(&victim), rev);
            }
            return;
        }
        let p = self.steal.as_mut().expect("current");
        match written {
            Written::Applied(rev) => {
                p.rev = Some(rev);
                p.stage = StealStage::Waiting;
            }
            Written::InDoubt => p.stage = StealStage::Waiting,
            Written::Conflict | Written::Unavailable => self.steal = None,
            Written::Fatal(e) => self.fatal_store(e),
        }
    }

    /// The request to `victim` was deleted at `rev`: if it was ours (the owner refused it), the
    /// steal is over.
    pub(super) fn steal_request_deleted(&mut self, victim: &InstanceId, rev: Revision) {
        if let Some(p) = self.steal.as_mut()
            && p.victim == *victim
            && p.stage == StealStage::Waiting
            && p.rev.is_some_and(|r| r < rev)
        {
            p.stage = StealStage::Refused;
        }
    }

    /// The thief's side of a cooperative steal, after every input (P9): claim the split once
    /// released; take it over at the deadline; withdraw when the move no longer helps or the
    /// split is gone; report the end and delete the request.
    pub(super) fn progress_steal(&mut self, now: Timestamp) {
        let Some(p) = self.steal.clone() else { return };
        match p.stage {
            StealStage::Asking => {}
            StealStage::Refused => self.end_steal(None, HandoverOutcome::Refused),
            StealStage::Waiting => {
                let Some(sv) = self.view.splits.get(&p.split) else {
                    return self.end_steal(None, HandoverOutcome::Withdrawn);
                };
                let record = sv.record.as_ref();
                let released = sv.claim_key_set()
                    && record.is_some_and(|r| r.state == SplitState::Unleased && r.epoch == p.epoch);
                // The victim's tenancy, still running or being released (the record is written
                // Unleased before the lease is deleted).
                let in_play = record.is_some_and(|r| {
                    r.epoch == p.epoch && matches!(r.state, SplitState::Owned | SplitState::Unleased)
                }) && sv
                    .lease
                    .as_ref()
                    .is_none_or(|l| l.owner.instance == p.victim && l.epoch == p.epoch);
                if released && self.tenancies.len() < self.lane_budget() {
                    let reason = self.claim_reason(&p.split);
                    self.steal.as_mut().expect("pending").stage = StealStage::Claiming { forced: false };
                    self.start_acquire(now, &p.split, reason);
                } else if released || !in_play || !self.still_helps(&p) {
                    self.end_steal(None, HandoverOutcome::Withdrawn);
                } else if now >= p.force_at {
                    self.steal.as_mut().expect("pending").stage = StealStage::Claiming { forced: true };
                    self.start_acquire(now, &p.split, AcquisitionReason::Stolen);
                }
            }
            StealStage::Claiming { forced } => match self.tenancies.get(&p.split) {
                Some(h) if h.epoch > p.epoch && matches!(h.stage, Stage::Running | Stage::Starved) => {
                    let outcome = if forced { HandoverOutcome::Forced } else { HandoverOutcome::HandedOver };
                    self.end_steal(Some(h.epoch), outcome);
                }
                Some(_) => {}
                // The claim did not happen (lost its race, the store was down).
                None => self.end_steal(None, HandoverOutcome::Withdrawn),
            },
        }
    }

    /// Whether moving the split asked for still lowers the imbalance, by the view (P9).
    fn still_helps(&self, p: &PendingSteal) -> bool {
        let w = self.view.splits.get(&p.split).and_then(|sv| sv.weight).unwrap_or(1);
        let theirs = self.view.loads.get(&p.victim).copied().unwrap_or(0);
        self.tenancies.len() < self.lane_budget() && move_helps(w, theirs, self.own_load())
    }

    /// Ends the pending steal: reports it and deletes the request (read back first when its
    /// create's answer was in doubt).
    pub(super) fn end_steal(&mut self, to: Option<Epoch>, outcome: HandoverOutcome) {
        let Some(p) = self.steal.take() else { return };
        self.outbox.event(Event::Handover {
            split: p.split.clone(),
            victim: p.victim.clone(),
            from: p.epoch,
            to,
            outcome,
        });
        let key = keys::steal(&p.victim);
        match (p.rev, p.stage) {
            // The owner deleted it already.
            (_, StealStage::Refused) => {}
            (Some(rev), _) => self.retire(key, rev),
            (None, _) => {
                let request = StoreRequest::Get { key: key.clone() };
                self.outbox.send(Bucket::Lease, request, Pending::RetireRead { key });
            }
        }
    }

    /// The owner's side (P9): a request naming this worker is honoured once per revision: if
    /// the tenancy asked for still runs and the move still lowers the imbalance by this worker's
    /// own load, the lane is told to stop at a safe point (commit, then acknowledge) and the split
    /// is released (a drain of one lane); otherwise the request is deleted, so the thief does not
    /// take the split over at its deadline.
    pub(super) fn answer_steal_request(&mut self, now: Timestamp) {
        let Some((rev, req)) = self.view.steal_requests.get(&self.me.instance).cloned() else { return };
        if self.answered_steal.is_some_and(|r| r >= rev) || self.phase != Phase::Running {
            return;
        }
        self.answered_steal = Some(rev);
        let honour = match self.tenancies.get(&req.split) {
            Some(h) if h.epoch == req.epoch && matches!(h.stage, Stage::Stopping { .. }) => return,
            Some(h) if h.epoch == req.epoch && h.stage == Stage::Running => {
                move_helps(req.weight, self.own_load(), req.thief_load)
            }
            _ => false,
        };
        self.outbox.event(Event::StealAsked {
            split: req.split.clone(),
            thief: req.thief.instance.clone(),
            honoured: honour,
        });
        if !honour {
            let request = StoreRequest::Delete { key: keys::steal(&self.me.instance), expected: rev };
            self.outbox.send(Bucket::Lease, request, Pending::Cleanup);
            return;
        }
        let wait = self.cfg.tuning.handover_wait().unwrap_or_else(|| self.cfg.tuning.heartbeat_interval());
        let deadline = now + wait;
        let h = self.tenancies.get_mut(&req.split).expect("held");
        h.stage = Stage::Stopping { deadline };
        let epoch = h.epoch;
        self.outbox.push(Action::StopLane {
            split: req.split,
            epoch,
            reason: StopReason::Draining,
            deadline: Some(deadline),
        });
    }

    /// The move that lowers the sum of squared loads most, if any lowers it at all. Ties: the
    /// more loaded victim, then the smaller instance id, then the smaller split id
    /// (deterministic).
    fn best_move(&self) -> Option<Move> {
        let mine = self.own_load();
        let mut best: Option<(Move, u128)> = None;
        for (victim, &load) in &self.view.loads {
            if *victim == self.me.instance || load <= mine + 1 {
                continue;
            }
            let gap = load - mine;
            let Some((gain, split)) = self.best_split_of(victim, gap) else { continue };
            let better = match &best {
                None => true,
                Some((b, b_load)) => match gain.cmp(&b.gain) {
                    Ordering::Greater => true,
                    Ordering::Less => false,
                    Ordering::Equal => load > *b_load || (load == *b_load && *victim < b.victim),
                },
            };
            if better {
                best = Some((Move { gain, victim: victim.clone(), split }, load));
            }
        }
        best.map(|(m, _)| m)
    }

    /// Among the splits `victim` holds, the one whose move helps most when the victim's load
    /// exceeds ours by `gap`: the gain `w * (gap - w)` peaks at `w = gap / 2`, so the best
    /// candidates are the nearest weights on either side of it; weights of `gap` or more would
    /// not lower the imbalance.
    fn best_split_of(&self, victim: &InstanceId, gap: u128) -> Option<(u128, SplitId)> {
        let held = self.view.held_by.get(victim)?;
        let half = u64::try_from(gap / 2).unwrap_or(u64::MAX);
        let takeable = |(w, id): &&(u64, SplitId)| {
            u128::from(*w) < gap
                && !self.tenancies.contains(id)
                && !self.tenancies.is_blocked(id)
                && self.view.splits.get(id).is_some_and(|sv| {
                    sv.lease.as_ref().is_some_and(|l| &l.owner.instance == victim)
                        && sv.record.as_ref().is_some_and(|r| r.state == SplitState::Owned)
                })
        };
        let split_at = (half.saturating_add(1), SplitId::floor());
        let below = held.range(..split_at.clone()).rev().take(PICK_PROBES).find(takeable);
        let above = held.range(split_at..).take(PICK_PROBES).find(takeable);
        let gain = |w: u64| u128::from(w) * (gap - u128::from(w));
        [below, above]
            .into_iter()
            .flatten()
            .map(|(w, id)| (gain(*w), id.clone()))
            .filter(|(gain, _)| worth_moving(*gain, gap))
            // The larger gain; on a tie the smaller split id.
            .max_by(|a, b| a.0.cmp(&b.0).then_with(|| b.1.cmp(&a.1)))
    }
}

/// Whether a move of gain `w * (gap - w)` is worth its cost (P9): it must take at least about
/// a seventh of the gap between the two loads (and leave at least as much), that is
/// `8 w (gap - w) >= gap^2`. Every move allowed still lowers the sum of squared loads (so
/// convergence holds), but fine-tuning a large gap with a tiny split, which a failing or
/// finishing split undoes a moment later, is not done. With equal weights a gap of two splits
/// still moves one (+-1 balance).
pub(crate) fn worth_moving(gain: u128, gap: u128) -> bool {
    gain.saturating_mul(8) >= gap.saturating_mul(gap)
}

/// P9 in one place: moving a split of weight `weight` from a worker holding `from` to one
/// holding `to` lowers the imbalance (`from > to + w`) and is worth it ([`worth_moving`]).
pub(crate) fn move_helps(weight: u64, from: u128, to: u128) -> bool {
    let w = u128::from(effective_weight(weight));
    from > to + w && worth_moving(w * (from - to - w), from - to)
}
