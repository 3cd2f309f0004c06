//! Pairwise stealing (P9): a worker below its fair share with nothing left to claim takes one
//! split per heartbeat cycle from the most-loaded owner, only while that owner holds at least
//! two more, so ownership converges to +-1 and never oscillates.

use crate::io::AcquisitionReason;
use crate::records::SplitState;
use crate::time::Timestamp;

use super::Worker;
use super::tenancy::Stage;

/// A victim must hold at least this many more splits than the thief (P9).
const STEAL_MARGIN: u32 = 2;

impl Worker {
    /// P9: one steal per cycle from the most-loaded owner, only if it holds >= 2 more. Only a
    /// steal on a consistent view is attempted (see `claim::start_acquire`).
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
        let mine = self.tenancies.len() as u32;
        let victim = self
            .view
            .lease_counts
            .iter()
            .filter(|(inst, _)| **inst != self.me.instance)
            // Most loaded first; ties broken by the smaller instance id (deterministic).
            .max_by(|a, b| a.1.cmp(b.1).then_with(|| b.0.cmp(a.0)))
            .map(|(inst, n)| (inst.clone(), *n));
        let Some((victim, count)) = victim else { return };
        if count < mine + STEAL_MARGIN {
            return;
        }
        let pick = self
            .view
            .splits
            .iter()
            .filter(|(id, sv)| {
                sv.weight.is_some()
                    && !self.tenancies.is_blocked(id)
                    && sv.lease.as_ref().is_some_and(|l| l.owner.instance == victim)
                    && sv.record.as_ref().is_some_and(|r| r.state == SplitState::Owned)
            })
            .map(|(id, _)| id.clone())
            .next();
        if let Some(id) = pick {
            self.last_steal_at = Some(now);
            self.start_acquire(now, &id, AcquisitionReason::Stolen);
        }
    }
}
