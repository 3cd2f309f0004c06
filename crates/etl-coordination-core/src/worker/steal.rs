//! Pairwise stealing by weight (P9): a worker with a free lane and nothing left to claim takes
//! one split per heartbeat cycle from a peer, only when the move strictly lowers the imbalance:
//! a split of weight `w` moves from `a` to `b` only if `load(a) > load(b) + w`. Every such move
//! lowers the sum of squared loads by `2w(load(a) - load(b) - w) > 0`, so moves stop (converge)
//! and a split never comes back (no oscillation). With equal weights this is "at least two more
//! splits": the +-1 balance of counts.

use std::cmp::Ordering;

use crate::ids::{InstanceId, SplitId};
use crate::io::{AcquisitionReason, Event};
use crate::records::SplitState;
use crate::time::Timestamp;
use crate::view::effective_weight;

use super::Worker;
use super::tenancy::Stage;

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
    /// The load this worker holds (P9): the effective weight of every tenancy it has.
    pub(super) fn own_load(&self) -> u128 {
        self.tenancies.values().map(|h| u128::from(effective_weight(h.weight))).sum()
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
        let Some(best) = self.best_move() else { return };
        self.last_steal_at = Some(now);
        let weight = self.view.splits.get(&best.split).and_then(|sv| sv.weight).unwrap_or(0);
        let loads = (self.view.loads.get(&best.victim).copied().unwrap_or(0), self.own_load());
        self.outbox.event(Event::Steal { split: best.split.clone(), victim: best.victim, weight, loads });
        self.start_acquire(now, &best.split, AcquisitionReason::Stolen);
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
            // The larger gain; on a tie the smaller split id.
            .max_by(|a, b| a.0.cmp(&b.0).then_with(|| b.1.cmp(&a.1)))
    }
}
