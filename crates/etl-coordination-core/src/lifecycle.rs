//! The split record's lifecycle: every transition a worker writes (claimed, resumed, committed,
//! ended) as a pure method on [`SplitRecord`], beside the operator's (`requeued`, `reset`, in
//! `records`). The attempt arithmetic of P12 lives here and nowhere else: rules decide *which*
//! transition to write, never how attempts move.

use bytes::Bytes;

use crate::ids::{Epoch, Owner};
use crate::io::AcquisitionReason;
use crate::records::{EndReason, SplitRecord, SplitState};

/// How a tenancy ends.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum End {
    /// P10: gracefully; no attempt consumed.
    Release,
    /// P12: the source reported a failure; one attempt consumed unless the tenancy progressed.
    Fail { error: String, unprocessable: bool },
    /// P12: the lane gives up on the split: quarantined now, every attempt spent.
    GiveUp { error: String },
}

impl SplitRecord {
    /// The record a claim writes over `self` (the record the acquisition was based on): owned by
    /// `owner` at `epoch`, or (P12) quarantined when the attempt it charges reaches
    /// `max_attempts`. `previous_unreleased` says the previous tenancy ended without a release
    /// (an expiry of another process's lease, a reclaimed incarnation): it is charged an attempt
    /// unless it progressed.
    pub(crate) fn claimed(
        &self,
        owner: &Owner,
        epoch: Epoch,
        reason: AcquisitionReason,
        previous_unreleased: bool,
        max_attempts: u32,
    ) -> SplitRecord {
        let charged = previous_unreleased && !self.progressed;
        let attempts = self.attempts + u32::from(charged);
        let last_end = match reason {
            AcquisitionReason::Expired if previous_unreleased => Some(EndReason::Expired),
            AcquisitionReason::Reclaimed => Some(EndReason::Reclaimed),
            AcquisitionReason::Stolen => Some(EndReason::Stolen),
            _ => self.last_end,
        };
        let last_error = if charged {
            let who = self.owner.as_ref().map_or_else(|| "unknown owner".to_owned(), |o| o.to_string());
            Some(format!("tenancy of {who} ended without a release ({})", reason.label()))
        } else {
            self.last_error.clone()
        };
        let quarantine = charged && attempts >= max_attempts;
        SplitRecord {
            epoch,
            // P12: quarantine instead of claiming.
            owner: (!quarantine).then(|| owner.clone()),
            state: if quarantine { SplitState::Quarantined } else { SplitState::Owned },
            progress: self.progress.clone(),
            attempts,
            last_end,
            last_error,
            progressed: false,
        }
    }

    /// P11: the same tenancy goes on under a new epoch after its trust lapsed; nothing ended.
    pub(crate) fn resumed(&self, owner: &Owner, epoch: Epoch) -> SplitRecord {
        SplitRecord { epoch, owner: Some(owner.clone()), progressed: false, ..self.clone() }
    }

    /// P8: the record a commit of `progress` writes over `self` (our last write), for a tenancy
    /// that started from `started_from`. Progress beyond the start marks the tenancy as having
    /// progressed and clears the attempts (P12); a terminal commit marks the split Done.
    pub(crate) fn committed(
        &self,
        started_from: &Option<Bytes>,
        progress: &Bytes,
        terminal: bool,
    ) -> SplitRecord {
        let mut record = self.clone();
        record.progress = Some(progress.clone());
        if started_from.as_ref() != Some(progress) {
            record.progressed = true;
            record.attempts = 0;
        }
        if terminal {
            record.state = SplitState::Done;
            record.owner = None;
            record.last_end = Some(EndReason::Finished);
        }
        record
    }

    /// P10, P12: the record that ends the tenancy whose last write is `self`: a release puts the
    /// split back in the queue; a failure is charged an attempt unless the tenancy progressed,
    /// and the attempt that reaches `max_attempts` quarantines it with the error.
    pub(crate) fn ended(&self, end: &End, max_attempts: u32) -> SplitRecord {
        let mut record = SplitRecord { owner: None, ..self.clone() };
        match end {
            End::Release => {
                record.state = SplitState::Unleased;
                record.last_end = Some(EndReason::Released);
            }
            End::Fail { error, unprocessable } => {
                record.attempts += u32::from(!self.progressed);
                record.last_error = Some(error.clone());
                record.last_end =
                    Some(if *unprocessable { EndReason::Unprocessable } else { EndReason::Failed });
                record.state = if record.attempts >= max_attempts {
                    SplitState::Quarantined
                } else {
                    SplitState::Unleased
                };
            }
            End::GiveUp { error } => {
                // Quarantined exactly at the cap, as every quarantine is: the attempts left are
                // spent at once.
                record.attempts = record.attempts.max(max_attempts);
                record.last_error = Some(error.clone());
                record.last_end = Some(EndReason::Unprocessable);
                record.state = SplitState::Quarantined;
            }
        }
        record
    }
}

/// One test per row of P12 (docs/PROTOCOL.md): who is charged an attempt, when, and what the
/// attempt that reaches `max_attempts` writes.
#[cfg(test)]
mod tests {
    use super::*;
    use crate::ids::{Incarnation, InstanceId};

    const MAX: u32 = 3;

    fn owner(name: &str, incarnation: u64) -> Owner {
        Owner { instance: InstanceId::new(name).unwrap(), incarnation: Incarnation(incarnation) }
    }

    /// A record owned by `a#1` at epoch 4 with `attempts` charged so far, its tenancy having
    /// `progressed` or not.
    fn owned(attempts: u32, progressed: bool) -> SplitRecord {
        SplitRecord {
            epoch: Epoch(4),
            owner: Some(owner("a", 1)),
            state: SplitState::Owned,
            progress: Some(Bytes::from_static(b"p1")),
            attempts,
            last_end: None,
            last_error: None,
            progressed,
        }
    }

    fn claim(base: &SplitRecord, reason: AcquisitionReason, unreleased: bool) -> SplitRecord {
        base.claimed(&owner("b", 7), Epoch(5), reason, unreleased, MAX)
    }

    #[test]
    fn an_expired_tenancy_without_progress_is_charged_by_the_claimer() {
        let r = claim(&owned(1, false), AcquisitionReason::Expired, true);
        assert_eq!((r.state, r.attempts, r.last_end), (SplitState::Owned, 2, Some(EndReason::Expired)));
        assert_eq!((r.epoch, r.owner, r.progressed), (Epoch(5), Some(owner("b", 7)), false));
        assert_eq!(r.last_error.as_deref(), Some("tenancy of a#1 ended without a release (expired)"));
        assert_eq!(r.progress.as_deref(), Some(&b"p1"[..]), "progress is kept");
    }

    #[test]
    fn an_expired_tenancy_that_progressed_is_not_charged() {
        // Its first progressing commit already cleared the attempts.
        let r = claim(&owned(0, true), AcquisitionReason::Expired, true);
        assert_eq!((r.state, r.attempts, r.last_end), (SplitState::Owned, 0, Some(EndReason::Expired)));
        assert_eq!(r.last_error, None);
    }

    #[test]
    fn a_reclaimed_incarnation_is_charged_like_an_expiry() {
        let r = claim(&owned(0, false), AcquisitionReason::Reclaimed, true);
        assert_eq!((r.attempts, r.last_end), (1, Some(EndReason::Reclaimed)));
        assert_eq!(r.last_error.as_deref(), Some("tenancy of a#1 ended without a release (reclaimed)"));
    }

    #[test]
    fn a_lease_of_the_claimers_own_incarnation_is_not_charged() {
        // The claimer's caller says the previous tenancy was its own (a starved lease of this
        // process): nothing ended without a release.
        let r = claim(&owned(1, false), AcquisitionReason::Expired, false);
        assert_eq!((r.attempts, r.last_end, r.last_error), (1, None, None));
    }

    #[test]
    fn the_charge_that_reaches_max_attempts_quarantines_instead_of_claiming() {
        let r = claim(&owned(MAX - 1, false), AcquisitionReason::Expired, true);
        assert_eq!((r.state, r.attempts, r.owner), (SplitState::Quarantined, MAX, None));
        assert_eq!(r.epoch, Epoch(5));
    }

    #[test]
    fn creates_releases_and_steals_charge_nothing() {
        for reason in [AcquisitionReason::Create, AcquisitionReason::Released, AcquisitionReason::Stolen] {
            let r = claim(&owned(2, false), reason, false);
            assert_eq!((r.state, r.attempts), (SplitState::Owned, 2), "{reason:?}");
        }
        assert_eq!(
            claim(&owned(2, false), AcquisitionReason::Stolen, false).last_end,
            Some(EndReason::Stolen)
        );
        let released = owned(2, false).ended(&End::Release, MAX);
        assert_eq!((released.state, released.attempts, released.owner), (SplitState::Unleased, 2, None));
        assert_eq!(released.last_end, Some(EndReason::Released));
    }

    #[test]
    fn a_reported_failure_without_progress_is_charged_by_the_owner() {
        let fail = End::Fail { error: "bad row".into(), unprocessable: false };
        let r = owned(0, false).ended(&fail, MAX);
        assert_eq!((r.state, r.attempts, r.owner), (SplitState::Unleased, 1, None));
        assert_eq!((r.last_end, r.last_error.as_deref()), (Some(EndReason::Failed), Some("bad row")));
        let unprocessable = End::Fail { error: "undecodable".into(), unprocessable: true };
        assert_eq!(owned(0, false).ended(&unprocessable, MAX).last_end, Some(EndReason::Unprocessable));
    }

    #[test]
    fn a_reported_failure_after_progress_is_not_charged() {
        let fail = End::Fail { error: "sink down".into(), unprocessable: false };
        let r = owned(0, true).ended(&fail, MAX);
        assert_eq!((r.state, r.attempts), (SplitState::Unleased, 0));
        assert_eq!(r.last_error.as_deref(), Some("sink down"));
    }

    #[test]
    fn the_failure_that_reaches_max_attempts_quarantines_with_its_error() {
        let fail = End::Fail { error: "poison".into(), unprocessable: true };
        let r = owned(MAX - 1, false).ended(&fail, MAX);
        assert_eq!((r.state, r.attempts, r.owner), (SplitState::Quarantined, MAX, None));
        assert_eq!(r.last_error.as_deref(), Some("poison"));
    }

    #[test]
    fn a_lane_that_gives_up_quarantines_at_once_whatever_it_committed() {
        let give_up = End::GiveUp { error: "101 bad records skipped".into() };
        for (attempts, progressed) in [(0, true), (0, false), (MAX - 1, false)] {
            let r = owned(attempts, progressed).ended(&give_up, MAX);
            assert_eq!((r.state, r.attempts, r.owner), (SplitState::Quarantined, MAX, None));
            assert_eq!(r.last_end, Some(EndReason::Unprocessable));
            assert_eq!(r.last_error.as_deref(), Some("101 bad records skipped"));
            assert_eq!(r.progress.as_deref(), Some(&b"p1"[..]), "progress kept for a requeue");
        }
    }

    #[test]
    fn a_commit_that_moves_progress_clears_the_attempts_and_marks_progress() {
        let start = Some(Bytes::from_static(b"p1"));
        let r = owned(2, false).committed(&start, &Bytes::from_static(b"p2"), false);
        assert_eq!((r.state, r.attempts, r.progressed), (SplitState::Owned, 0, true));
        assert_eq!(r.progress.as_deref(), Some(&b"p2"[..]));
        // Committing where the tenancy started moves nothing.
        let same = owned(2, false).committed(&start, &Bytes::from_static(b"p1"), false);
        assert_eq!((same.attempts, same.progressed), (2, false));
    }

    #[test]
    fn a_terminal_commit_marks_the_split_done_and_ownerless() {
        let r = owned(1, false).committed(&None, &Bytes::from_static(b"end"), true);
        assert_eq!((r.state, r.owner, r.last_end), (SplitState::Done, None, Some(EndReason::Finished)));
        assert_eq!(r.attempts, 0);
    }

    #[test]
    fn a_resume_keeps_everything_but_the_epoch_owner_and_progressed_flag() {
        let mut base = owned(2, true);
        base.last_end = Some(EndReason::Stolen);
        let r = base.resumed(&owner("a", 2), Epoch(5));
        assert_eq!((r.epoch, r.owner), (Epoch(5), Some(owner("a", 2))));
        assert_eq!((r.attempts, r.progressed, r.state), (2, false, SplitState::Owned));
        assert_eq!((r.last_end, r.progress), (Some(EndReason::Stolen), base.progress), "nothing ended");
    }

    #[test]
    fn an_operators_requeue_clears_the_attempts_and_keeps_progress() {
        let quarantined =
            owned(MAX - 1, false).ended(&End::Fail { error: "x".into(), unprocessable: true }, MAX);
        let r = quarantined.requeued();
        assert_eq!((r.state, r.attempts, r.owner), (SplitState::Unleased, 0, None));
        assert_eq!((r.epoch, r.last_end), (Epoch(5), Some(EndReason::Requeued)));
        assert_eq!(r.progress.as_deref(), Some(&b"p1"[..]));
    }
}
