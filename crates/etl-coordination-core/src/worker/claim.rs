//! Fair share and claiming (P5), acquisition reasons (P6), and the reclaim of a previous
//! incarnation's splits (P3). An acquisition takes the lease first, then the fenced record CAS.

use crate::ids::{Epoch, OpId, Revision, SplitId};
use crate::io::{AcquisitionReason, Event};
use crate::records::{self, Descriptor, LeaseRecord, SplitRecord, SplitState, keys};
use crate::store::{Bucket, StoreReply, StoreRequest, StoreResult};
use crate::time::Timestamp;

use super::outbox::{Pending, Read, Written};
use super::resolve::{LeaseRead, RecordRead, still_ours};
use super::tenancy::{Acquisition, End, Ending, Held, OurLease, OurRecord, Stage};
use super::{Phase, Worker};

/// Reads of an absent descriptor before the split is called unprocessable; they must also span
/// at least a lease duration (see [`Worker::descriptor_gone`]).
const DESC_MISSES_MAX: u32 = 5;

impl Worker {
    /// P6: why a claimable split is being acquired, from its record.
    pub(super) fn claim_reason(&self, id: &SplitId) -> AcquisitionReason {
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

    /// P12: whether taking a split whose record is `base` for `reason` charges the previous
    /// tenancy an attempt: it ended without a release (poison evidence), unless it was this very
    /// process (a starved lease of our own).
    fn charges(&self, base: &SplitRecord, reason: AcquisitionReason) -> bool {
        match reason {
            AcquisitionReason::Expired => base.owner.as_ref() != Some(&self.me),
            AcquisitionReason::Reclaimed => true,
            _ => false,
        }
    }

    /// P12: whether the split would be a suspect once taken for `reason`: failures no progress
    /// explained are behind it (its attempts after the claim are not 0).
    fn is_suspect(&self, base: &SplitRecord, reason: AcquisitionReason) -> bool {
        base.attempts > 0 || (self.charges(base, reason) && !base.progressed)
    }

    /// P12: whether taking `id` for `reason` would start a suspect's trial.
    pub(super) fn would_try(&self, id: &SplitId, reason: AcquisitionReason) -> bool {
        self.view
            .splits
            .get(id)
            .and_then(|sv| sv.record.as_ref())
            .is_some_and(|base| self.is_suspect(base, reason))
    }

    /// P12: whether a suspect's trial runs here: a tenancy of a split with failures behind it,
    /// from its acquisition until it progresses or its lane has run for a lease. One at a time per
    /// worker, so that when a split crashes its process, the other tenancies the crash charges
    /// are ones that had no failure behind them: a crash loop quarantines the split that causes
    /// it, not the healthy ones that happened to be claimed beside it on every restart.
    pub(super) fn on_trial(&self, now: Timestamp) -> bool {
        self.tenancies.values().any(|h| {
            let a = &h.acquisition;
            a.suspect && !h.written.record.progressed && a.trial_until.is_none_or(|t| now < t)
        })
    }

    /// Starts an acquisition (P5, P6, P9): the lease first (create; or CAS over the dead
    /// incarnation's lease for a reclaim, over the victim's for a steal), then the fenced record
    /// CAS. A steal is only planned on a consistent view (lease and record name the same owner
    /// and epoch); its lease CAS at the viewed revision then proves the record is still at that
    /// epoch, because every epoch bump needs the lease first.
    pub(super) fn start_acquire(&mut self, now: Timestamp, id: &SplitId, reason: AcquisitionReason) {
        let Some(sv) = self.view.splits.get(id) else { return };
        let Some(base) = sv.record.as_deref().cloned() else { return };
        let Some(weight) = sv.weight else { return };
        if base.is_terminal() {
            return;
        }
        let base_rev = sv.record_rev;
        let epoch = base.epoch.next();
        let value = records::encode(&LeaseRecord {
            owner: self.me.clone(),
            epoch,
            write: self.outbox.next_op_id().0,
        });
        let key = keys::split(id);
        let request = match (&sv.lease, reason) {
            (Some(l), AcquisitionReason::Stolen) => {
                if base.state != SplitState::Owned
                    || base.owner.as_ref() != Some(&l.owner)
                    || l.epoch != base.epoch
                {
                    return;
                }
                StoreRequest::CompareAndSwap { key, expected: sv.lease_rev, value, ttl: self.ttl() }
            }
            (Some(l), AcquisitionReason::Reclaimed) => {
                if l.owner.instance != self.me.instance || l.owner.incarnation == self.me.incarnation {
                    return;
                }
                StoreRequest::CompareAndSwap { key, expected: sv.lease_rev, value, ttl: self.ttl() }
            }
            (Some(_), _) | (None, AcquisitionReason::Stolen) => return,
            (None, _) => StoreRequest::Create { key, value, ttl: self.ttl() },
        };
        let consumes_attempt = self.charges(&base, reason);
        let trial = self.is_suspect(&base, reason);
        self.tenancies.insert(
            id.clone(),
            Held {
                epoch,
                weight,
                base: base.clone(),
                acquisition: Acquisition {
                    reason,
                    consumes_attempt,
                    suspect: trial,
                    trial_until: None,
                    resuming: false,
                    desc_misses: 0,
                    desc_first_miss: None,
                    descriptor: None,
                },
                written: OurRecord { record: base, rev: base_rev, in_doubt: false },
                lease: OurLease {
                    rev: None,
                    trusted_until: now + self.cfg.tuning.lease_trust(),
                    renewing: None,
                },
                stage: Stage::AcquiringLease,
                op: None,
                commit: None,
                ending: Ending::default(),
            },
        );
        self.send_step(id, Bucket::Lease, request, Pending::LeaseAcquire { split: id.clone(), sent: now });
    }

    /// P5: the lease is ours (go on to the record), in doubt (read it), or lost (not an error).
    pub(super) fn on_lease_acquire(&mut self, op: OpId, id: SplitId, sent: Timestamp, result: StoreResult) {
        if !self.is_current(&id, op) {
            // A late success for something we gave up: release it.
            if let Ok(StoreReply::Written(rev)) = result {
                self.retire(keys::split(&id), rev);
            }
            return;
        }
        match Written::of(result) {
            Written::Applied(rev) => self.lease_acquired(&id, rev, sent),
            Written::Fatal(e) => self.fatal_store(e),
            // In doubt: the read decides.
            Written::InDoubt => {
                let request = StoreRequest::Get { key: keys::split(&id) };
                self.send_step(
                    &id,
                    Bucket::Lease,
                    request,
                    Pending::LeaseAcquireResolve { split: id.clone(), sent, write: op },
                );
            }
            // Lost the race or the store is down: not an error.
            Written::Conflict | Written::Unavailable => self.give_up_acquire(&id),
        }
    }

    /// The read decides an in-doubt acquisition. The lease counts as ours if it names us at
    /// the epoch we set out to take and carries this very write (trust is then credited from
    /// its send time, P11). One written by an earlier attempt of ours is kept only by a resume
    /// (renewed at once to earn trust); any other acquisition gives it back.
    pub(super) fn on_lease_acquire_resolve(
        &mut self,
        now: Timestamp,
        op: OpId,
        id: SplitId,
        sent: Timestamp,
        write: OpId,
        result: StoreResult,
    ) {
        if !self.is_current(&id, op) {
            // The acquisition was given up meanwhile; if its write landed after all, give the
            // lease back.
            if let Ok(StoreReply::Value(Some(e))) = &result
                && self.names_me(&e.key, &e.value)
                && !self.tenancies.contains(&id)
            {
                self.retire(e.key.clone(), e.revision);
            }
            return;
        }
        let h = &self.tenancies[&id];
        let epoch = h.epoch;
        let mine = match LeaseRead::<LeaseRecord>::of(result, h.lease.rev) {
            // A lagging replica (a resume knows the lease's revision): read again.
            LeaseRead::Lagging => {
                let pending = Pending::LeaseAcquireResolve { split: id.clone(), sent, write };
                return self.retry_step(
                    now,
                    &id,
                    Bucket::Lease,
                    StoreRequest::Get { key: keys::split(&id) },
                    pending,
                );
            }
            LeaseRead::Found(rev, Some(l)) if l.owner == self.me && l.epoch == epoch => {
                Some((rev, l.write == write.0))
            }
            LeaseRead::Found(..) | LeaseRead::Gone | LeaseRead::Unavailable => None,
        };
        match mine {
            Some((rev, true)) => self.lease_acquired(&id, rev, sent),
            // An earlier attempt of the same resume: the same tenancy, so keep it, but earn
            // trust by a renewal.
            Some((rev, false)) if self.tenancies[&id].acquisition.resuming => {
                self.lease_acquired(&id, rev, Timestamp::ZERO);
                self.renew_lease(now, &id);
            }
            // A given-up acquisition of ours landed late. How it took the lease (created after
            // an expiry, or over a live owner's) decides the reason and whether the previous
            // tenancy is charged an attempt (P6, P12), and this one cannot tell: give the lease
            // back, and let the next acquisition decide from the store as it is then (seed 56664:
            // a late create adopted by a steal called an expired tenancy stolen).
            Some((rev, false)) => {
                self.give_up_acquire(&id);
                self.retire(keys::split(&id), rev);
            }
            None => self.give_up_acquire(&id),
        }
    }

    fn lease_acquired(&mut self, id: &SplitId, rev: Revision, sent: Timestamp) {
        let me = self.me.clone();
        let h = &mut self.tenancies[id];
        h.lease.rev = Some(rev);
        h.lease.trusted_until = sent + self.cfg.tuning.lease_trust();
        let epoch = h.epoch;
        self.view.put_lease(id, rev, LeaseRecord { owner: me, epoch, write: 0 });
        if self.phase == Phase::Leaving && !self.tenancies[id].displaced() {
            // Draining meanwhile: nobody held this lease, so give it back untouched.
            return self.abandon(id);
        }
        if self.tenancies[id].acquisition.resuming && self.tenancies[id].acquisition.descriptor.is_some() {
            // A resume moves the same tenancy to a new epoch: nothing to read (P11).
            return self.write_claim(id);
        }
        // The descriptor comes before the record: a tenancy is recorded only once its lane can
        // start at once, so one that never ran (its owner cut off or paused right after taking
        // the lease) is never charged an attempt (P12).
        self.read_descriptor(id);
    }

    /// The record a claim writes: owned by us at the next epoch, or (P12) quarantined when the
    /// attempt it charges reaches `max_attempts`. The previous tenancy is charged an attempt if
    /// it ended without a release (expired, reclaimed) and committed no progress.
    fn claim_record(&self, h: &Held) -> SplitRecord {
        let a = &h.acquisition;
        if a.resuming {
            return h.base.resumed(&self.me, h.epoch);
        }
        h.base.claimed(&self.me, h.epoch, a.reason, a.consumes_attempt, self.cfg.tuning.max_attempts)
    }

    /// P5: the fenced record CAS against the revision the acquisition was based on.
    fn write_claim(&mut self, id: &SplitId) {
        let (request, record) = self.claim_request(id);
        let op = self.outbox.send(Bucket::State, request, Pending::RecordClaim { split: id.clone() });
        let h = &mut self.tenancies[id];
        h.written.record = record;
        h.stage = Stage::WritingRecord;
        h.op = Some(op);
    }

    /// The claim CAS again, after the retry backoff: it was refused although the record had not
    /// moved, so a write to it is still in process at the stream leader (one of ours in doubt,
    /// or another's). Retrying at once would hammer that leader until the write's fate is
    /// decided.
    fn write_claim_later(&mut self, now: Timestamp, id: &SplitId) {
        let (request, record) = self.claim_request(id);
        let h = &mut self.tenancies[id];
        h.written.record = record;
        h.stage = Stage::WritingRecord;
        h.op = None;
        self.outbox.retry_later(now, Bucket::State, request, Pending::RecordClaim { split: id.clone() });
    }

    pub(super) fn claim_request(&self, id: &SplitId) -> (StoreRequest, SplitRecord) {
        let h = &self.tenancies[id];
        let record = self.claim_record(h);
        let request = StoreRequest::CompareAndSwap {
            key: keys::split(id),
            expected: h.written.rev,
            value: records::encode(&record),
            ttl: None,
        };
        (request, record)
    }

    pub(super) fn on_record_claim(&mut self, now: Timestamp, op: OpId, id: SplitId, result: StoreResult) {
        if !self.is_current(&id, op) {
            return;
        }
        let answer = self.record_answer(&id, result);
        match answer {
            Written::Applied(rev) => self.claim_written(now, &id, rev),
            Written::Conflict | Written::InDoubt => {
                self.send_step(
                    &id,
                    Bucket::State,
                    StoreRequest::Get { key: keys::split(&id) },
                    Pending::RecordClaimRead { split: id.clone() },
                );
            }
            Written::Fatal(e) => self.fatal_store(e),
            Written::Unavailable => {
                let request = StoreRequest::Get { key: keys::split(&id) };
                self.retry_step(
                    now,
                    &id,
                    Bucket::State,
                    request,
                    Pending::RecordClaimRead { split: id.clone() },
                );
            }
        }
    }

    /// P5: after a lost or in-doubt claim CAS, the record decides: ours (landed), still at the
    /// epoch we replace (retry from it), or moved on (give up).
    pub(super) fn on_record_claim_read(
        &mut self,
        now: Timestamp,
        op: OpId,
        id: SplitId,
        result: StoreResult,
    ) {
        if !self.is_current(&id, op) {
            return;
        }
        let h = &self.tenancies[&id];
        let (rev, rec) = match RecordRead::of(result, h.written.rev, Some(&h.written.record)) {
            RecordRead::Landed(rev) => {
                self.tenancies[&id].written.in_doubt = false;
                return self.claim_written(now, &id, rev);
            }
            RecordRead::Other(rev, rec) => (rev, rec),
            RecordRead::Gone => return self.abandon(&id),
            // Decides nothing: read again.
            RecordRead::Lagging | RecordRead::Unavailable => {
                return self.retry_step(
                    now,
                    &id,
                    Bucket::State,
                    StoreRequest::Get { key: keys::split(&id) },
                    Pending::RecordClaimRead { split: id.clone() },
                );
            }
        };
        let h = &mut self.tenancies[&id];
        // Still at the epoch we set out to replace: the previous owner committed (or ended its
        // tenancy) meanwhile, which moves the revision but not the epoch. We hold the lease, so
        // nobody else can bump the epoch: retry against the fresh revision, from the fresh record
        // (its progress is the latest durable one). The CAS still fences.
        if rec.epoch == h.base.epoch && !rec.is_terminal() {
            let unmoved = rev == h.written.rev;
            if rec.state == SplitState::Unleased {
                // The previous owner released (or failed) it gracefully after all (also when we
                // set out to steal it: the victim let go first).
                h.acquisition.consumes_attempt = false;
                if rec.epoch != Epoch(0) {
                    h.acquisition.reason = AcquisitionReason::Released;
                }
            }
            h.base = rec;
            h.written.rev = rev;
            if unmoved {
                return self.write_claim_later(now, &id);
            }
            return self.write_claim(&id);
        }
        if still_ours(&rec, &self.me, h.epoch) {
            // A claim of an earlier acquisition of ours (given up while its write was in doubt)
            // landed late: that tenancy never ran. It is released (no attempt: nothing ran, no
            // evidence against the data), not adopted (its reason and attempts were decided for
            // a lease we no longer hold), and this acquisition gives its lease back.
            let record = rec.clone();
            self.view.put_record(&id, rev, rec);
            self.release_if_unmoved(&id, rev, &record);
            return self.abandon(&id);
        }
        self.view.put_record(&id, rev, rec);
        self.abandon(&id);
    }

    /// Reads the descriptor of a split whose lease was just acquired (before the record).
    pub(super) fn read_descriptor(&mut self, id: &SplitId) {
        let op = self.outbox.send(
            Bucket::State,
            StoreRequest::Get { key: keys::desc(id) },
            Pending::DescRead { split: id.clone() },
        );
        let h = &mut self.tenancies[id];
        h.stage = Stage::ReadingDesc;
        h.op = Some(op);
    }

    /// The descriptor is in hand: write the claim. If trust already lapsed (we were paused or
    /// cut off), a plain claim gives the lease back instead (no tenancy was recorded); one that
    /// displaced a live lease is completed so the record never names an owner without a lease.
    pub(super) fn on_desc_read(&mut self, now: Timestamp, op: OpId, id: SplitId, result: StoreResult) {
        if !self.is_current(&id, op) {
            return;
        }
        let unusable = |error: String| End::Fail { error, unprocessable: true };
        // Whether trust lapsed meanwhile (we were paused or cut off) on a plain claim: it gives
        // the lease back rather than record a tenancy (see above).
        let lapsed = |h: &Held| h.lease.trusted_until <= now && !h.displaced();
        let read = Read::of(result);
        match read {
            Read::Found(ref e) => match records::decode::<Descriptor>(&e.value) {
                Ok(d) => {
                    let h = &mut self.tenancies[&id];
                    h.acquisition.descriptor = Some(d.descriptor);
                    h.op = None;
                    if lapsed(h) {
                        return self.abandon(&id);
                    }
                    self.write_claim(&id);
                }
                Err(err) => {
                    self.outbox.event(Event::Undecodable { key: e.key.to_string(), error: err.to_string() });
                    if lapsed(&self.tenancies[&id]) {
                        return self.abandon(&id);
                    }
                    self.tenancies[&id].ending.how = Some(unusable(format!("undecodable descriptor: {err}")));
                    self.write_claim(&id);
                }
            },
            // Descriptors are written before the manifest that lists them and never deleted, so
            // an absent one is most likely a read from a lagging replica: read again, for at
            // least a lease duration, before calling the split unprocessable (P12: a stale read
            // is no poison).
            Read::Absent if self.descriptor_gone(now, &id) => {
                if lapsed(&self.tenancies[&id]) {
                    return self.abandon(&id);
                }
                self.tenancies[&id].ending.how = Some(unusable("descriptor missing from the store".into()));
                self.write_claim(&id);
            }
            Read::Absent | Read::Failed(_) => {
                let h = &mut self.tenancies[&id];
                if matches!(read, Read::Absent) {
                    h.acquisition.desc_misses += 1;
                    h.acquisition.desc_first_miss.get_or_insert(now);
                }
                h.op = None;
                self.outbox.retry_later(
                    now,
                    Bucket::State,
                    StoreRequest::Get { key: keys::desc(&id) },
                    Pending::DescRead { split: id },
                );
            }
        }
    }

    /// Whether one more absent read makes the descriptor missing for good: [`DESC_MISSES_MAX`]
    /// absent reads, the first a lease duration ago or more. A count alone is not enough: the
    /// re-reads are paced by the short retry backoff, and all of them could be answered by a
    /// replica lagging behind the descriptor's write (seeds 104120 and 201380).
    fn descriptor_gone(&self, now: Timestamp, id: &SplitId) -> bool {
        let h = &self.tenancies[id];
        let since = h.acquisition.desc_first_miss.unwrap_or(now);
        h.acquisition.desc_misses + 1 >= DESC_MISSES_MAX
            && now.saturating_since(since) >= self.cfg.tuning.lease_duration
    }

    /// Lease and record are ours: start the lane, or (quarantined by this claim, or the
    /// descriptor unusable, or leaving) end at once.
    fn claim_written(&mut self, now: Timestamp, id: &SplitId, rev: Revision) {
        let h = &mut self.tenancies[id];
        h.written.rev = rev;
        let record = h.written.record.clone();
        self.view.put_record(id, rev, record.clone());
        if record.state == SplitState::Quarantined {
            self.outbox.event(Event::Quarantined {
                split: id.clone(),
                attempts: record.attempts,
                last_error: record.last_error,
            });
            return self.delete_lease(id);
        }
        let h = &self.tenancies[id];
        let (reason, epoch) = (h.acquisition.reason, h.epoch);
        if !h.acquisition.resuming {
            self.outbox.event(Event::Acquired { split: id.clone(), reason, epoch });
        }
        if let Some(end) = self.tenancies[id].ending.how.take() {
            return self.begin_end(id, end);
        }
        if self.phase == Phase::Leaving {
            return self.begin_end(id, End::Release);
        }
        self.start_lane(now, id);
    }
}
