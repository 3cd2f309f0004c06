//! The acquisition cycle (P3, P5, P9): reclaim what our previous incarnation held, claim up to
//! the fair share in claim order, and steal when nothing is left to claim.

use std::collections::{BTreeMap, BTreeSet};

use crate::config::Tuning;
use crate::ids::{InstanceId, Revision, SplitId};
use crate::io::AcquisitionReason;
use crate::time::Timestamp;
use crate::view::SplitView;

use super::Worker;

/// P12: splits that failed and wait before they are claimed again, with the record revision
/// that showed the failure and when the wait ends. Each worker measures the wait from when it
/// first saw that revision claimable, on its own clock: nothing is compared between clocks.
#[derive(Debug, Default)]
pub(super) struct ClaimBackoffs {
    waits: BTreeMap<SplitId, (Revision, Option<Timestamp>)>,
}

impl ClaimBackoffs {
    /// Whether a claimable split that failed before is still waiting out its backoff. The wait
    /// for the record at its current revision starts when this worker first sees it claimable
    /// and lasts [`Tuning::claim_backoff_after`] its attempts. A record naming this instance
    /// (a starved tenancy of ours, our previous incarnation) is not waited on: the resume and
    /// the reclaim are not new attempts at a failing split.
    fn waiting(
        &mut self,
        now: Timestamp,
        id: &SplitId,
        sv: &SplitView,
        tuning: &Tuning,
        me: &InstanceId,
    ) -> bool {
        let Some(rec) = sv.record.as_ref() else { return false };
        if rec.attempts == 0 || rec.owner.as_ref().is_some_and(|o| &o.instance == me) {
            return false;
        }
        let fresh = (sv.record_rev, Some(now + tuning.claim_backoff_after(rec.attempts)));
        let wait = self.waits.entry(id.clone()).or_insert(fresh);
        if wait.0 != sv.record_rev {
            *wait = fresh;
        }
        match wait.1 {
            Some(due) if now < due => true,
            // Waited out: kept (without a deadline) so that it is not waited for again.
            _ => {
                wait.1 = None;
                false
            }
        }
    }

    /// Marks the waits that ended by `now` as waited out, so their deadline fires once (the
    /// acquisition after the tick may not look at them: a worker at its fair share or leaving).
    pub(super) fn elapse(&mut self, now: Timestamp) {
        for (_, due) in self.waits.values_mut() {
            if due.is_some_and(|d| d <= now) {
                *due = None;
            }
        }
    }

    /// Whether `id` was found waiting by the last look at it.
    fn is_waiting(&self, id: &SplitId) -> bool {
        self.waits.get(id).is_some_and(|(_, due)| due.is_some())
    }

    /// The earliest end of a wait still running, if any.
    pub(super) fn next_due(&self) -> Option<Timestamp> {
        self.waits.values().filter_map(|&(_, due)| due).min()
    }
}

impl Worker {
    /// P3 reclaim, then P5 claims up to the fair share, then (nothing left to claim) P9.
    pub(super) fn acquire(&mut self, now: Timestamp) {
        // P9: a request to us is answered, and a steal we asked for goes on (its claim first:
        // the split it waits for is reserved for it).
        self.forget_returned();
        self.answer_steal_request(now);
        self.progress_steal(now);
        if self.view.manifest.is_none() {
            return;
        }
        self.forget_stale_backoffs();
        let max = self.cfg.tuning.max_in_flight as usize;
        // P12: one suspect's trial at a time (see `on_trial`); a suspect this worker may not try
        // now is not there for it to take, as a split waiting out its backoff.
        // A steal waiting for its split counts as a trial when that split is a suspect.
        let stealing_suspect = self.steal.as_ref().is_some_and(|p| {
            self.view.splits.get(&p.split).and_then(|sv| sv.record.as_ref()).is_some_and(|r| r.attempts > 0)
        });
        let mut trying = stealing_suspect || self.on_trial(now);
        let mut deferred = BTreeSet::new();
        // P3: reclaim what our previous incarnation held, at once, up to capacity.
        let reclaim: Vec<(SplitId, bool)> = self
            .view
            .old_incarnation
            .iter()
            .filter(|id| !self.tenancies.contains(id) && !self.tenancies.is_blocked(id))
            .map(|id| (id.clone(), self.would_try(id, AcquisitionReason::Reclaimed)))
            .collect();
        for (id, suspect) in reclaim {
            if self.tenancies.len() >= max {
                break;
            }
            if suspect && trying {
                deferred.insert(id);
                continue;
            }
            self.start_acquire(now, &id, AcquisitionReason::Reclaimed);
            // (A reclaim that could not start is no trial.)
            trying |= suspect && self.tenancies.contains(&id);
        }
        let reserved = self.view.reserved_for_others();
        let target = self.fair_target();
        let mut want = target.saturating_sub(self.tenancies.len());
        let mut picks = Vec::new();
        for (_, id) in &self.view.claimable {
            if want == 0 {
                break;
            }
            if self.tenancies.contains(id) || self.tenancies.is_blocked(id) || reserved.contains(id) {
                continue;
            }
            if self.backoffs.waiting(now, id, &self.view.splits[id], &self.cfg.tuning, &self.me.instance) {
                continue;
            }
            if self.would_try(id, self.claim_reason(id)) {
                if trying {
                    deferred.insert(id.clone());
                    continue;
                }
                trying = true;
            }
            picks.push(id.clone());
            want -= 1;
        }
        if !picks.is_empty() {
            for id in picks {
                let reason = self.claim_reason(&id);
                self.start_acquire(now, &id, reason);
            }
            return;
        }
        // A split waiting out its backoff is not there to claim: an idle worker steals meanwhile
        // rather than wait beside a loaded one. A worker at its share of the count steals too:
        // balance is by weight (P9).
        let nothing_unclaimed = self.view.claimable.iter().all(|(_, id)| {
            self.tenancies.contains(id)
                || self.backoffs.is_waiting(id)
                || reserved.contains(id)
                || deferred.contains(id)
        });
        if nothing_unclaimed {
            self.maybe_steal(now);
        }
    }

    /// Drops the waits of splits that are no longer claimable at the revision waited on (taken,
    /// finished, requeued), so they neither wake the worker nor outlive the failure.
    fn forget_stale_backoffs(&mut self) {
        let view = &self.view;
        self.backoffs.waits.retain(|id, (rev, _)| {
            view.splits.get(id).is_some_and(|sv| sv.record_rev == *rev && sv.claim_key_set())
        });
    }

    /// The number of splits this worker aims to hold (P5): its share of the active splits,
    /// within its lane budget. Shares are filled like water over the live workers' capacities
    /// (their `max_in_flight`, from presence): the level is the smallest `t` with
    /// `sum(min(capacity, t)) >= active`, so a small pod's unused share goes to the others instead
    /// of waiting unclaimed. With equal capacities the level is `ceil(active / live)`.
    pub(super) fn fair_target(&self) -> usize {
        let active = self.view.active();
        let budget = self.lane_budget();
        let mut caps: Vec<usize> = self
            .view
            .workers
            .iter()
            .filter(|(inst, _)| **inst != self.me.instance)
            .map(|(_, (_, p))| p.capacity.max(1) as usize)
            .collect();
        caps.push((self.cfg.tuning.max_in_flight as usize).max(1));
        caps.sort_unstable();
        let fair = water_level(&caps, active);
        fair.min(budget)
    }
}

/// The smallest level `t` with `sum(min(cap, t)) >= total` over the sorted capacities `caps`, or
/// `total` itself when even every capacity in full does not reach it (a worker then claims as
/// many as its own budget allows).
fn water_level(caps: &[usize], total: usize) -> usize {
    let mut left = total;
    for (i, &cap) in caps.iter().enumerate() {
        let rest = caps.len() - i;
        // The remaining workers all get `t`; `t` fits below this capacity?
        let t = left.div_ceil(rest);
        if t <= cap {
            return t;
        }
        left -= cap;
    }
    total
}
