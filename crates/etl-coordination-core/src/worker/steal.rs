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
use crate::store::{Bucket, StoreError, StoreRequest, StoreResult};
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
    /// The op id the request carries (`write`): a put of it seen on the watch is ours.
    pub(super) write: u64,
    /// A delete of the victim's request key seen while this one's revision was unknown.
    pub(super) deleted_at: Option<Revision>,
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
        let Some(best) = self.best_move(self.on_trial(now)) else { return };
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
        let write = self.outbox.next_op_id().0;
        let request = StealRequest {
            thief: self.me.clone(),
            split: best.split.clone(),
            epoch,
            weight,
            thief_load: self.own_load(),
            wait_ms: u64::try_from(wait.as_millis()).unwrap_or(u64::MAX),
            write,
        };
        let key = keys::steal(&best.victim);
        let create = StoreRequest::Create { key, value: records::encode(&request), ttl: self.ttl() };
        self.outbox.send(Bucket::Lease, create, Pending::StealAsk { victim: best.victim.clone() });
        self.steal = Some(PendingSteal {
            victim: best.victim,
            split: best.split,
            epoch,
            rev: None,
            write,
            deleted_at: None,
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
            // An abandoned request that landed after all (or may have): take it back.
            let key = keys::steal(&victim);
            match written {
                Written::Applied(rev) => self.retire(key, rev),
                Written::InDoubt => {
                    let request = StoreRequest::Get { key: key.clone() };
                    self.outbox.send(Bucket::Lease, request, Pending::RetireRead { key });
                }
                _ => {}
            }
            return;
        }
        let p = self.steal.as_mut().expect("current");
        match written {
            // The owner refused it before this answer arrived.
            Written::Applied(rev) if p.deleted_at.is_some_and(|d| d > rev) => {
                p.rev = Some(rev);
                p.stage = StealStage::Refused;
            }
            Written::Applied(rev) => {
                p.rev = Some(rev);
                p.stage = StealStage::Waiting;
            }
            Written::InDoubt => p.stage = StealStage::Waiting,
            Written::Conflict | Written::Unavailable => self.steal = None,
            Written::Fatal(e) => self.fatal_store(e),
        }
    }

    /// The request to `victim` was deleted at `rev` (`expired`: by its TTL): if it was ours and
    /// the owner deleted it, the owner refused and the steal is over. An expiry is no answer:
    /// the deadline, a heartbeat before the TTL, decides.
    pub(super) fn steal_request_deleted(&mut self, victim: &InstanceId, rev: Revision, expired: bool) {
        let Some(p) = self.steal.as_mut().filter(|p| p.victim == *victim) else { return };
        if expired {
            return;
        }
        match (p.stage, p.rev) {
            (StealStage::Waiting, Some(r)) if r < rev => p.stage = StealStage::Refused,
            // Ours or not, no request of ours is left to wait on.
            (StealStage::Waiting, None) => p.stage = StealStage::Refused,
            (StealStage::Asking, _) => p.deleted_at = p.deleted_at.max(Some(rev)),
            _ => {}
        }
    }

    /// A put of the victim's request key at `rev`: if it is our request, its revision is known
    /// now (a create whose answer was in doubt, or is still on its way).
    pub(super) fn steal_request_seen(&mut self, victim: &InstanceId, rev: Revision) {
        let Some((seen, req)) = self.view.steal_requests.get(victim) else { return };
        let ours = req.thief == self.me && *seen == rev;
        if let Some(p) = self.steal.as_mut()
            && p.victim == *victim
            && ours
            && req.write == p.write
            && p.rev.is_none()
        {
            p.rev = Some(rev);
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
                let record = sv.record.as_ref().filter(|r| r.epoch == p.epoch);
                let victims_lease =
                    sv.lease.as_ref().is_some_and(|l| l.owner.instance == p.victim && l.epoch == p.epoch);
                let w = sv.weight.unwrap_or(1);
                // Released to us: the owner ended the tenancy asked for gracefully and deleted its
                // lease (its load no longer holds the split).
                let released = sv.claim_key_set()
                    && record.is_some_and(|r| {
                        r.state == SplitState::Unleased && r.last_end == Some(records::EndReason::Released)
                    });
                // Being released: the record is written Unleased before the lease is deleted
                // (and the two buckets' watches may deliver them in either order).
                let releasing = victims_lease && record.is_some_and(|r| r.state == SplitState::Unleased);
                let running = victims_lease && record.is_some_and(|r| r.state == SplitState::Owned);
                // The process asked is gone (its presence expired, or a restart wrote another
                // incarnation's): nobody will answer. Its split is left to the reclaim or the
                // expiry, which charge the crash an attempt and are tried apart (P12); a steal
                // would move it uncharged.
                let owner_gone = sv.lease.as_ref().is_some_and(|l| !self.owner_live(&l.owner));
                // A trial runs here meanwhile: a suspect is not taken beside it (P12).
                let trial_clash = w_attempts(sv) > 0 && self.on_trial(now);
                let theirs = self.view.loads.get(&p.victim).copied().unwrap_or(0);
                let free = self.tenancies.len() < self.lane_budget();
                if owner_gone || trial_clash {
                    self.end_steal(None, HandoverOutcome::Withdrawn);
                } else if released
                    && p.rev.is_some()
                    && free
                    && move_helps(w, theirs + u128::from(effective_weight(w)), self.own_load())
                {
                    let reason = self.claim_reason(&p.split);
                    self.steal.as_mut().expect("pending").stage = StealStage::Claiming { forced: false };
                    self.start_acquire(now, &p.split, reason);
                } else if releasing {
                    // Wait for the lease delete (its deadline moves on: it is not taken over
                    // while its owner is releasing it).
                    if now >= p.force_at {
                        let hb = self.cfg.tuning.heartbeat_interval();
                        self.steal.as_mut().expect("pending").force_at = now + hb;
                    }
                } else if !running || !free || !move_helps(w, theirs, self.own_load()) {
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
        let thief_live = self
            .view
            .workers
            .get(&req.thief.instance)
            .is_some_and(|(_, p)| p.incarnation == req.thief.incarnation);
        // A split already on its way out (another handover, a stall release) no longer counts.
        let running_load: u128 = self
            .tenancies
            .values()
            .filter(|h| !matches!(h.stage, Stage::Stopping { .. }))
            .map(|h| u128::from(effective_weight(h.weight)))
            .sum();
        let honour = match self.tenancies.get(&req.split) {
            Some(h) if h.epoch == req.epoch && matches!(h.stage, Stage::Stopping { .. }) => return,
            Some(h) if h.epoch == req.epoch && h.stage == Stage::Running => {
                thief_live && move_helps(req.weight, running_load, req.thief_load)
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
            self.outbox.send(Bucket::Lease, request, Pending::StealRefuse { rev });
            return;
        }
        // The thief's wait (so its deadline never cuts the last commit short), within a third
        // of our lease.
        let cap = self.cfg.tuning.lease_duration - self.cfg.tuning.heartbeat_interval() * 2;
        let deadline = now + std::time::Duration::from_millis(req.wait_ms).min(cap);
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

    /// The answer to a refusal's delete: one that did not go through is answered again (else the
    /// thief would take the split over at its deadline).
    pub(super) fn on_steal_refuse(&mut self, rev: Revision, result: StoreResult) {
        match result {
            Err(StoreError::Indeterminate(_) | StoreError::Unavailable(_))
                if self.answered_steal == Some(rev) =>
            {
                self.answered_steal = None;
            }
            Err(e) if e.is_fatal() => self.fatal_store(e),
            // Deleted, or the key moved on (expired, the thief withdrew): answered.
            _ => {}
        }
    }

    /// Whether `owner`'s process is live as far as this worker sees: its presence names that
    /// incarnation (a crashed process's presence expires; a restart writes another's).
    fn owner_live(&self, owner: &crate::ids::Owner) -> bool {
        self.view.workers.get(&owner.instance).is_some_and(|(_, p)| p.incarnation == owner.incarnation)
    }

    /// The move that lowers the sum of squared loads most, if any lowers it at all. Ties between
    /// victims: one no other thief is asking, then the more loaded one, then the smaller
    /// instance id; within a victim, see `best_split_of` (deterministic).
    ///
    /// None while that move's victim answers another thief's request (steals from one victim go
    /// one at a time): the thief waits for it rather than take a lesser move from another peer.
    /// Taking it would move a split off a peer that is itself still below the share it ends at
    /// (three workers joining one: the one that missed a turn at the loaded worker took from a
    /// fellow joiner, which then stole once more), so the split moves twice. The request ends
    /// within its deadline, and then the best move is taken.
    fn best_move(&self, on_trial: bool) -> Option<Move> {
        let mine = self.own_load();
        let mut best: Option<(Move, u128, bool)> = None;
        for (victim, &load) in &self.view.loads {
            if *victim == self.me.instance || load <= mine + 1 {
                continue;
            }
            let busy = self.view.steal_requests.get(victim).is_some_and(|(_, r)| r.thief != self.me);
            let gap = load - mine;
            let Some((gain, split)) = self.best_split_of(victim, gap, on_trial) else { continue };
            let better = match &best {
                None => true,
                // On a tie, a victim free to ask first: an equally good move is not waited for.
                Some((b, b_load, b_busy)) => match gain.cmp(&b.gain).then(b_busy.cmp(&busy)) {
                    Ordering::Greater => true,
                    Ordering::Less => false,
                    Ordering::Equal => load > *b_load || (load == *b_load && *victim < b.victim),
                },
            };
            if better {
                best = Some((Move { gain, victim: victim.clone(), split }, load, busy));
            }
        }
        best.filter(|(_, _, busy)| !busy).map(|(m, _, _)| m)
    }

    /// Among the splits `victim` holds, the one whose move helps most when the victim's load
    /// exceeds ours by `gap`: the gain `w * (gap - w)` peaks at `w = gap / 2`, so the best
    /// candidates are the nearest weights on either side of it; weights of `gap` or more would
    /// not lower the imbalance. Among splits of one weight, the probe nearest that point is
    /// taken: below it the highest split id, above it the lowest.
    fn best_split_of(&self, victim: &InstanceId, gap: u128, on_trial: bool) -> Option<(u128, SplitId)> {
        let held = self.view.held_by.get(victim)?;
        let half = u64::try_from(gap / 2).unwrap_or(u64::MAX);
        let takeable = |(w, id): &&(u64, SplitId)| {
            u128::from(*w) < gap
                && !self.tenancies.contains(id)
                && !self.tenancies.is_blocked(id)
                && self.view.splits.get(id).is_some_and(|sv| {
                    // Lease and record name the same owner and epoch (a consistent view); a
                    // suspect only when no trial runs here, and never from a dead owner (its
                    // reclaim or expiry charges the crash, P12).
                    sv.lease.as_ref().is_some_and(|l| {
                        &l.owner.instance == victim
                            && self.owner_live(&l.owner)
                            && sv.record.as_ref().is_some_and(|r| {
                                r.state == SplitState::Owned
                                    && r.epoch == l.epoch
                                    && r.owner.as_ref() == Some(&l.owner)
                                    && !(on_trial && r.attempts > 0)
                            })
                    })
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
            // The larger gain; on a tie the smaller split id.
            .max_by(|a, b| a.0.cmp(&b.0).then_with(|| b.1.cmp(&a.1)))
    }
}

/// The record's attempts (0 without a record).
fn w_attempts(sv: &crate::view::SplitView) -> u32 {
    sv.record.as_ref().map_or(0, |r| r.attempts)
}

/// P9 in one place: moving a split of weight `weight` from a worker holding `from` to one
/// holding `to` lowers the imbalance: `from > to + w`, so both loads end strictly between the
/// two they were (the sum of squared loads drops by `2w(from - to - w)`). No threshold on the
/// gain: a worker holding many light splits beside an idle peer must share them, however
/// small a part of the gap each one is.
pub(crate) fn move_helps(weight: u64, from: u128, to: u128) -> bool {
    from > to + u128::from(effective_weight(weight))
}
