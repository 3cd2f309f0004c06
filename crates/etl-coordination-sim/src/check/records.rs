//! The split records: fencing by epoch (I3), progress that never regresses (I1) and was
//! emitted (I2), terminal records (I5), attempt counting (P12), acquisition reasons (P6), and
//! no claim or deletion outside a published manifest (P4).

use etl_coordination_core::records::{EndReason, SplitRecord, SplitState};
use etl_coordination_core::{AcquisitionReason, Epoch, Owner, SplitId, Timestamp};

use super::datapath::Charge;
use super::{Checker, LeaseOrigin, Tenancy, progress_of};

impl Checker {
    /// A successful write to a split record (I1, I2 on data, I3, I5).
    pub(super) fn on_split_write(
        &mut self,
        at: Timestamp,
        writer: &Owner,
        id: &SplitId,
        old: Option<&SplitRecord>,
        new: &SplitRecord,
    ) {
        self.saw_epoch(id, new.epoch);
        let Some(old) = old else {
            self.ensure(at, "I3", new.epoch == Epoch(0) && new.owner.is_none(), || {
                format!("split {id}: record created in a non-initial state by {writer}")
            });
            return;
        };
        if new == old && old.epoch == Epoch(0) && old.owner.is_none() {
            // P4: a leader touching a never-owned record it publishes changes nothing.
            return;
        }
        // Terminal records never change: Done stays done; Quarantined is never re-offered (I5).
        self.ensure(at, "I5", !old.is_terminal(), || {
            format!(
                "split {id}: {:?} record rewritten by {writer} (terminal splits are never re-offered)",
                old.state
            )
        });
        // I3: fencing by epoch.
        self.ensure(at, "I3", new.epoch >= old.epoch, || {
            format!("split {id}: epoch regressed {} -> {} in a write by {writer}", old.epoch, new.epoch)
        });
        self.ensure(at, "I3", new.epoch.0 <= old.epoch.0 + 1, || {
            format!("split {id}: epoch jumped {} -> {}", old.epoch, new.epoch)
        });
        if new.epoch == old.epoch {
            self.ensure(at, "I3", old.owner.as_ref() == Some(writer), || {
                format!(
                    "split {id}: write at epoch {} by {writer}, but the record's owner is {:?} (stale writer not fenced)",
                    new.epoch, old.owner
                )
            });
        }
        // I1: progress never regresses.
        let (p_old, p_new) = (progress_of(&old.progress), progress_of(&new.progress));
        self.ensure(at, "I1", p_new >= p_old, || {
            format!("split {id}: committed progress regressed {p_old} -> {p_new} in a write by {writer} (epoch {})", new.epoch)
        });
        // I2 on data: committed progress implies those records were emitted.
        if let Some(emitted) = self.emitted.get(id) {
            let upto = (p_new as usize).min(emitted.len());
            let gap = emitted[..upto].iter().position(|e| !e);
            self.ensure(at, "I2", gap.is_none(), || {
                format!(
                    "split {id}: progress {p_new} committed but record {} was never emitted",
                    gap.unwrap_or(0)
                )
            });
        }
        self.check_attempts(at, writer, id, old, new);
    }

    /// A write to `id`'s record by another program or an operator (an overwrite, a reset, a
    /// requeue): the next worker write is judged against what it wrote, as a new tenancy.
    pub(super) fn on_foreign_write(&mut self, id: &SplitId, new: Option<&SplitRecord>) {
        self.tenancy.remove(id);
        self.charges.remove(id);
        if let Some(r) = new {
            self.saw_epoch(id, r.epoch);
        }
    }

    fn saw_epoch(&mut self, id: &SplitId, epoch: Epoch) {
        let e = self.max_epoch.entry(id.clone()).or_insert(epoch);
        *e = (*e).max(epoch);
    }

    /// P12 in both directions: every failing tenancy that committed no progress consumes one
    /// attempt, a tenancy that advanced progress resets the count, no graceful end consumes
    /// one, and quarantine happens exactly at `max_attempts`. Also P6: the acquisition reason
    /// the store's state implies, and P4: no claim outside a published manifest.
    fn check_attempts(
        &mut self,
        at: Timestamp,
        writer: &Owner,
        id: &SplitId,
        old: &SplitRecord,
        new: &SplitRecord,
    ) {
        let p_new = progress_of(&new.progress);
        let mut cause = None;
        let t = self.tenancy.get(id).filter(|t| t.epoch == old.epoch).cloned();
        let progressed =
            t.as_ref().is_some_and(|t| t.progressed || p_new != t.base && new.epoch == old.epoch);
        let expected = if new.epoch == old.epoch.next() {
            // A new tenancy replaces the one `old` describes.
            let origin = self.lease_origin.get(&(id.clone(), new.epoch, writer.clone())).cloned();
            let continuation = old.owner.as_ref() == Some(writer);
            let stolen = matches!(&origin, Some(LeaseOrigin::Displaced(v))
                if old.owner.as_ref() == Some(v) && v.instance != writer.instance);
            let failing = old.state == SplitState::Owned && !continuation && !stolen;
            let prev_progressed = t.as_ref().is_some_and(|t| t.progressed);
            let charged = failing && !prev_progressed;
            let expected = old.attempts + u32::from(charged);
            let collateral = old.owner.as_ref().is_some_and(|o| self.poison_crashed.contains(o));
            cause = charged.then_some(if collateral { Charge::Collateral } else { Charge::Expiry });
            if new.owner.as_ref() == Some(writer) || new.state == SplitState::Quarantined {
                self.ensure(at, "P4", self.published.contains(id), || {
                    format!("split {id}: claimed by {writer} but not in any published manifest")
                });
                let reason = if continuation
                    && old.state == SplitState::Owned
                    && origin == Some(LeaseOrigin::Resumed)
                {
                    None
                } else if stolen {
                    Some(AcquisitionReason::Stolen)
                } else if matches!(&origin, Some(LeaseOrigin::Displaced(v)) if v.instance == writer.instance)
                    && old.state == SplitState::Owned
                {
                    // (If the old incarnation's own end landed first, the record is Unleased:
                    // the split was released, whatever the lease was taken over.)
                    Some(AcquisitionReason::Reclaimed)
                } else if old.epoch == Epoch(0) {
                    Some(AcquisitionReason::Create)
                } else if old.state == SplitState::Unleased {
                    Some(AcquisitionReason::Released)
                } else if old
                    .owner
                    .as_ref()
                    .is_some_and(|o| o.instance == writer.instance && o.incarnation != writer.incarnation)
                {
                    Some(AcquisitionReason::Reclaimed)
                } else {
                    Some(AcquisitionReason::Expired)
                };
                self.claims.insert((id.clone(), new.epoch), reason);
            }
            self.tenancy.insert(id.clone(), Tenancy { epoch: new.epoch, base: p_new, progressed: false });
            expected
        } else {
            // The owner writes its own tenancy: a commit, a release, a failure, the end.
            let failed = self.failed.contains(&(id.clone(), old.epoch))
                && matches!(new.last_end, Some(EndReason::Failed | EndReason::Unprocessable))
                && new.owner.is_none();
            // A lane that gave its split up (bad records past the cap): quarantined at once.
            let gave_up = self.gave_up.contains(&(id.clone(), old.epoch))
                && new.state == SplitState::Quarantined
                && new.owner.is_none();
            if let Some(t) = self.tenancy.get_mut(id).filter(|t| t.epoch == new.epoch) {
                t.progressed = progressed;
            }
            if gave_up {
                cause = Some(Charge::Data);
                self.max_attempts.max(old.attempts)
            } else if progressed {
                0
            } else if failed {
                let outage = self.outage_failed.contains(&(id.clone(), old.epoch));
                cause = Some(if outage { Charge::Outage } else { Charge::Data });
                old.attempts + 1
            } else {
                old.attempts
            }
        };
        if expected == 0 {
            self.charges.remove(id);
        }
        self.ensure(at, "I5", new.attempts == expected, || {
            format!(
                "split {id}: attempts {} -> {} in a write by {writer}, expected {expected} (P12: failing tenancies without progress count, progress resets)",
                old.attempts, new.attempts
            )
        });
        if let Some(cause) = cause.filter(|_| new.attempts == expected) {
            self.on_charge(at, id, cause, new.state == SplitState::Quarantined);
        }
        let max = self.max_attempts;
        self.ensure(at, "I5", (new.state == SplitState::Quarantined) == (new.attempts >= max), || {
            format!(
                "split {id}: state {:?} with {} attempts (max_attempts {max}): quarantine must happen exactly at the cap",
                new.state, new.attempts
            )
        });
    }

    /// A worker announced an acquisition (P6): its reason must be what the store's state
    /// implied when its claim landed.
    pub(super) fn on_acquired(
        &mut self,
        at: Timestamp,
        id: &SplitId,
        epoch: Epoch,
        reason: AcquisitionReason,
        who: &Owner,
    ) {
        let expected = self.claims.get(&(id.clone(), epoch)).cloned();
        // A resumed tenancy and a re-claim of our own lapsed lease write the same record: the
        // worker may take the one for the other (both are continuations, neither charges).
        let continuation = expected == Some(None) && reason == AcquisitionReason::Expired;
        self.ensure(at, "P6", expected == Some(Some(reason)) || continuation, || {
            format!(
                "split {id}: {who} announced acquisition {} at epoch {epoch}, the claim implies {expected:?}",
                reason.label()
            )
        });
    }

    /// P4: a split record deleted (garbage collection) must not belong to a published manifest.
    pub(super) fn on_record_deleted(&mut self, at: Timestamp, id: &SplitId, writer: &Owner) {
        self.ensure(at, "P4", !self.published.contains(id), || {
            format!("split {id}: record deleted by {writer} although a published manifest lists it")
        });
    }
}
