//! The acquisition cycle (P3, P5, P9): reclaim what our previous incarnation held, claim up to
//! the fair share in claim order, and steal when nothing is left to claim.

use crate::ids::{Epoch, SplitId};
use crate::io::AcquisitionReason;
use crate::records::SplitState;
use crate::time::Timestamp;

use super::Worker;

impl Worker {
    /// P3 reclaim, then P5 claims up to the fair share, then (nothing left to claim) P9.
    pub(super) fn acquire(&mut self, now: Timestamp) {
        if self.view.manifest.is_none() {
            return;
        }
        let max = self.cfg.tuning.max_in_flight as usize;
        // P3: reclaim what our previous incarnation held, at once, up to capacity.
        let reclaim: Vec<SplitId> = self
            .view
            .old_incarnation
            .iter()
            .filter(|id| !self.tenancies.contains(id) && !self.tenancies.is_blocked(id))
            .take(max.saturating_sub(self.tenancies.len()))
            .cloned()
            .collect();
        for id in reclaim {
            self.start_acquire(now, &id, AcquisitionReason::Reclaimed);
        }
        let target = self.fair_target();
        if self.tenancies.len() >= target {
            return;
        }
        let mut want = target - self.tenancies.len();
        let mut picks = Vec::new();
        for (_, id) in &self.view.claimable {
            if want == 0 {
                break;
            }
            if self.tenancies.contains(id) || self.tenancies.is_blocked(id) {
                continue;
            }
            picks.push(id.clone());
            want -= 1;
        }
        let claimed_any = !picks.is_empty();
        for id in picks {
            let reason = self.claim_reason(&id);
            self.start_acquire(now, &id, reason);
        }
        let nothing_unclaimed = self.view.claimable.iter().all(|(_, id)| self.tenancies.contains(id));
        if !claimed_any && want > 0 && nothing_unclaimed {
            self.maybe_steal(now);
        }
    }

    /// The number of splits this worker aims to hold (P5).
    pub(super) fn fair_target(&self) -> usize {
        let live = self.view.live_workers().max(1);
        let fair = self.view.active().div_ceil(live);
        fair.min(self.cfg.tuning.max_in_flight as usize)
    }

    /// P6: why a claimable split is being acquired, from its record.
    fn claim_reason(&self, id: &SplitId) -> AcquisitionReason {
        let rec = self.view.splits.get(id).and_then(|sv| sv.record.as_ref()).expect("claimable has a record");
        match (&rec.state, &rec.owner) {
            (SplitState::Owned, Some(o))
                if o.instance == self.me.instance && o.incarnation != self.me.incarnation =>
            {
                AcquisitionReason::Reclaimed
            }
            (SplitState::Owned, _) => AcquisitionReason::Expired,
            (_, _) if rec.epoch == Epoch(0) => AcquisitionReason::Create,
            _ => AcquisitionReason::Released,
        }
    }
}
