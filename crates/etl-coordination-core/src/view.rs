//! The worker's cached picture of the store, fed by watches, listings and its own writes.
//!
//! The view only ever *triggers* attempts: every ownership decision is taken by a CAS (S6), so a
//! stale view costs a failed attempt, never safety. It keeps incremental indices so that a
//! claim decision is O(log n) even for plans of 100,000 splits (T6).

use std::cmp::Reverse;
use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use crate::ids::{Incarnation, InstanceId, Revision, SplitId};
use crate::io::SplitCounts;
use crate::records::{
    LeaderRecord, LeaseRecord, ManifestRef, PlanHead, PresenceRecord, SplitRecord, SplitState, StealRequest,
};
use crate::store::{Bucket, Key};

/// What the view knows of one split: what the protocol decides on, kept small (issue 32: a
/// worker holds one of these per split of the plan, a million of them for a large plan).
/// Records are shared ([`RecordCache`]): every fresh record, and every Done record of one
/// epoch, is one allocation; a Done record keeps no progress or error, which nothing reads
/// once the split is terminal. A lease (live tenancies only) is boxed.
#[derive(Clone, Debug, Default)]
pub(crate) struct SplitView {
    pub record: Option<Arc<SplitRecord>>,
    /// Latest revision seen for the record key (put or delete).
    pub record_rev: Revision,
    pub lease: Option<Box<LeaseRecord>>,
    /// Latest revision seen for the lease key (put or delete).
    pub lease_rev: Revision,
    /// `Some(weight)` iff the split is in the loaded manifest.
    pub weight: Option<u64>,
    /// The planned weight it adds to `weight_planned` (in the manifest), and to `weight_done`
    /// when Done; the key it has in `claimable` when claimable.
    planned: u64,
    /// The holder this split's lease adds `effective_weight(planned)` to `loads` and `held_by`
    /// for.
    counted_lease: Option<Box<InstanceId>>,
    /// The value at `record_rev` could not be decoded (`record` is `None`): the split can be
    /// neither claimed nor completed until someone rewrites it (`etl-coord requeue --reset`).
    pub record_undecodable: bool,
    // Contributions to the counters and indices, so they can be withdrawn on change.
    counted: Counted,
}

impl SplitView {
    /// Whether the split is in the claimable index.
    pub fn claim_key_set(&self) -> bool {
        self.counted.claimable
    }
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct Counted {
    done: bool,
    quarantined: bool,
    owned: bool,
    undecodable: bool,
    missing: bool,
    old_incarnation: bool,
    claimable: bool,
}

/// Shares the records many splits hold alike: a fresh record, and a Done record (stripped of
/// what a terminal split no longer needs) per epoch and outcome. Other records (owned, released
/// with progress) are few at a time and kept as they come.
#[derive(Debug, Default)]
pub(crate) struct RecordCache {
    shared: BTreeSet<Arc<SplitRecord>>,
}

impl RecordCache {
    /// How many distinct shared records may be kept: beyond it a record is kept unshared (a
    /// plan whose splits end at many different epochs costs a record each, as before).
    const MAX: usize = 4096;

    fn intern(&mut self, mut record: SplitRecord) -> Arc<SplitRecord> {
        let shareable = match record.state {
            SplitState::Done => {
                record.progress = None;
                record.last_error = None;
                true
            }
            // Fresh or released without progress or failures: alike but for the epoch.
            SplitState::Unleased => {
                record.progress.is_none()
                    && record.owner.is_none()
                    && record.attempts == 0
                    && record.last_error.is_none()
            }
            SplitState::Owned | SplitState::Quarantined => false,
        };
        if !shareable {
            return Arc::new(record);
        }
        if let Some(r) = self.shared.get(&record) {
            return r.clone();
        }
        if self.shared.len() >= Self::MAX {
            // Records no split holds any more make room first.
            self.shared.retain(|r| Arc::strong_count(r) > 1);
        }
        let r = Arc::new(record);
        if self.shared.len() < Self::MAX {
            self.shared.insert(r.clone());
        }
        r
    }
}

/// The cached store.
#[derive(Debug)]
pub(crate) struct View {
    me: InstanceId,
    incarnation: Incarnation,
    pub splits: BTreeMap<SplitId, SplitView>,
    /// Claimable manifest splits, largest weight first (P5).
    pub claimable: BTreeSet<(Reverse<u64>, SplitId)>,
    /// Per holder instance, the effective weight (P9: [`effective_weight`]) of the manifest
    /// splits whose leases it holds: its load, for stealing.
    pub loads: BTreeMap<InstanceId, u128>,
    /// Per holder instance, the manifest splits whose leases it holds, by effective weight: a
    /// thief finds the split that helps most in O(log n).
    pub held_by: BTreeMap<InstanceId, BTreeSet<(u64, SplitId)>>,
    /// Manifest splits recorded as Owned by this instance id under another incarnation (P3).
    pub old_incarnation: BTreeSet<SplitId>,
    pub manifest: Option<ManifestRef>,
    pub manifest_len: usize,
    /// The planned weight of the manifest splits, and of those Done (progress by work).
    pub weight_planned: u128,
    pub weight_done: u128,
    pub done: usize,
    pub quarantined: usize,
    /// Manifest splits whose record says Owned.
    pub owned: usize,
    /// Manifest splits whose record cannot be decoded.
    pub undecodable_splits: usize,
    /// Manifest splits without a record.
    pub missing: usize,
    /// Every key (of either bucket) whose latest value seen could not be decoded, with that
    /// value's revision: it is reported once per value, and counted while it stays.
    pub undecodable: BTreeMap<(Bucket, Key), Revision>,
    pub workers: BTreeMap<InstanceId, (Revision, PresenceRecord)>,
    /// Cooperative steal requests (P9), by victim.
    pub steal_requests: BTreeMap<InstanceId, (Revision, StealRequest)>,
    pub leader: Option<(Revision, LeaderRecord)>,
    /// The newest revision of the leader key seen (put or delete): a read of it at an older
    /// revision comes from a lagging replica and decides nothing.
    pub leader_seen: Revision,
    pub plan_head: Option<(Revision, PlanHead)>,
    /// The newest revision of the plan head seen (put, own write, or delete), and whether it
    /// was a delete: a read older than it, or absent while the head was last seen present,
    /// comes from a lagging replica. Never lowered (a listing that lacks the head may lag too).
    pub plan_head_seen: (Revision, bool),
    records: RecordCache,
}

impl View {
    /// The plan head was seen at `rev`, present (`deleted`: false) or deleted.
    pub fn saw_plan_head(&mut self, rev: Revision, deleted: bool) {
        if rev > self.plan_head_seen.0 || (rev == self.plan_head_seen.0 && !deleted) {
            self.plan_head_seen = (rev, deleted);
        }
    }

    pub fn new(me: InstanceId, incarnation: Incarnation) -> Self {
        View {
            me,
            incarnation,
            splits: BTreeMap::new(),
            claimable: BTreeSet::new(),
            loads: BTreeMap::new(),
            held_by: BTreeMap::new(),
            old_incarnation: BTreeSet::new(),
            manifest: None,
            manifest_len: 0,
            weight_planned: 0,
            weight_done: 0,
            done: 0,
            quarantined: 0,
            owned: 0,
            undecodable_splits: 0,
            missing: 0,
            undecodable: BTreeMap::new(),
            workers: BTreeMap::new(),
            steal_requests: BTreeMap::new(),
            leader: None,
            leader_seen: Revision(0),
            plan_head: None,
            plan_head_seen: (Revision(0), false),
            records: RecordCache::default(),
        }
    }

    /// Live workers in the fleet view (at least this one).
    pub fn live_workers(&self) -> usize {
        let me_listed = self.workers.contains_key(&self.me);
        self.workers.len() + usize::from(!me_listed)
    }

    /// Splits a live peer asked for by a cooperative steal (P9): once released they are its to
    /// claim, not anyone else's, while the request lives (one lease at most) and its thief's
    /// presence shows the incarnation that asked (the presence key is in the same bucket and
    /// written before any request, so it is seen first).
    pub fn reserved_for_others(&self) -> BTreeSet<SplitId> {
        self.steal_requests
            .values()
            .filter(|(_, r)| r.thief.instance != self.me || r.thief.incarnation != self.incarnation)
            .filter(|(_, r)| {
                self.workers.get(&r.thief.instance).is_some_and(|(_, p)| p.incarnation == r.thief.incarnation)
            })
            .map(|(_, r)| r.split.clone())
            .collect()
    }

    /// Manifest splits that are neither Done nor Quarantined.
    pub fn active(&self) -> usize {
        self.manifest_len.saturating_sub(self.done + self.quarantined)
    }

    /// Manifest splits by the state of their records.
    pub fn split_counts(&self) -> SplitCounts {
        let known = self.done + self.quarantined + self.owned + self.undecodable_splits + self.missing;
        SplitCounts {
            unleased: self.manifest_len.saturating_sub(known) as u32,
            owned: self.owned as u32,
            done: self.done as u32,
            quarantined: self.quarantined as u32,
            undecodable: self.undecodable_splits as u32,
            missing: self.missing as u32,
            weight_planned: u64::try_from(self.weight_planned).unwrap_or(u64::MAX),
            weight_done: u64::try_from(self.weight_done).unwrap_or(u64::MAX),
        }
    }

    /// Every manifest split has a terminal record, and the view holds as many manifest splits
    /// as the manifest's head says it has (a partial manifest never completes, I6).
    pub fn all_terminal(&self) -> bool {
        self.manifest.is_some_and(|m| m.split_count == self.manifest_len as u64)
            && self.done + self.quarantined == self.manifest_len
    }

    pub fn put_record(&mut self, id: &SplitId, rev: Revision, record: SplitRecord) {
        let sv = self.splits.entry(id.clone()).or_default();
        if rev < sv.record_rev {
            return;
        }
        sv.record_rev = rev;
        sv.record = Some(self.records.intern(record));
        sv.record_undecodable = false;
        self.refresh(id);
    }

    /// The record's value at `rev` cannot be decoded: whatever the view knew of it is gone.
    /// Returns whether `rev` was news (not older than what the view knows).
    pub fn put_undecodable_record(&mut self, id: &SplitId, rev: Revision) -> bool {
        let sv = self.splits.entry(id.clone()).or_default();
        if rev < sv.record_rev {
            return false;
        }
        sv.record_rev = rev;
        sv.record = None;
        sv.record_undecodable = true;
        self.refresh(id);
        true
    }

    pub fn delete_record(&mut self, id: &SplitId, rev: Revision) {
        let Some(sv) = self.splits.get_mut(id) else { return };
        if rev < sv.record_rev {
            return;
        }
        sv.record_rev = rev;
        sv.record = None;
        sv.record_undecodable = false;
        self.refresh(id);
    }

    pub fn put_lease(&mut self, id: &SplitId, rev: Revision, lease: LeaseRecord) {
        let sv = self.splits.entry(id.clone()).or_default();
        if rev < sv.lease_rev {
            return;
        }
        sv.lease_rev = rev;
        sv.lease = Some(Box::new(lease));
        self.refresh(id);
    }

    pub fn delete_lease(&mut self, id: &SplitId, rev: Revision) {
        let Some(sv) = self.splits.get_mut(id) else { return };
        if rev < sv.lease_rev {
            return;
        }
        sv.lease_rev = rev;
        sv.lease = None;
        self.refresh(id);
    }

    /// Drops the lease entry whatever its revision (a resync found it absent).
    pub fn forget_lease(&mut self, id: &SplitId) {
        if let Some(sv) = self.splits.get_mut(id) {
            sv.lease = None;
            self.refresh(id);
        }
    }

    /// Drops the record entry whatever its revision (a resync found it absent).
    pub fn forget_record(&mut self, id: &SplitId) {
        if let Some(sv) = self.splits.get_mut(id) {
            sv.record = None;
            sv.record_undecodable = false;
            self.refresh(id);
        }
    }

    /// Installs a newly loaded manifest.
    pub fn set_manifest(&mut self, manifest: ManifestRef, entries: Vec<(SplitId, u64)>) {
        let ids: Vec<SplitId> =
            self.splits.iter().filter(|(_, sv)| sv.weight.is_some()).map(|(id, _)| id.clone()).collect();
        for id in &ids {
            self.splits.get_mut(id).expect("listed").weight = None;
        }
        self.manifest = Some(manifest);
        self.manifest_len = entries.len();
        let mut touched = ids;
        for (id, weight) in entries {
            self.splits.entry(id.clone()).or_default().weight = Some(weight);
            touched.push(id);
        }
        for id in touched {
            self.refresh(&id);
        }
    }

    /// Recomputes one split's contribution to every index.
    fn refresh(&mut self, id: &SplitId) {
        // The map's own id goes into the indices (a clone shares it): the caller's may be a
        // copy parsed from a key or decoded from a manifest.
        let Some((id, _)) = self.splits.get_key_value(id) else { return };
        let id = &id.clone();
        let Some(sv) = self.splits.get_mut(id) else { return };
        let old = sv.counted;
        let old_planned = sv.planned;
        // Withdraw the old claimable entry.
        if old.claimable {
            self.claimable.remove(&(Reverse(old_planned), id.clone()));
        }
        let in_manifest = sv.weight.is_some();
        let state = sv.record.as_ref().map(|r| r.state);
        let planned = sv.weight.unwrap_or(0);
        let new = Counted {
            done: in_manifest && state == Some(SplitState::Done),
            quarantined: in_manifest && state == Some(SplitState::Quarantined),
            owned: in_manifest && state == Some(SplitState::Owned),
            undecodable: in_manifest && sv.record_undecodable,
            missing: in_manifest && sv.record.is_none() && !sv.record_undecodable,
            old_incarnation: in_manifest
                && state == Some(SplitState::Owned)
                && sv
                    .record
                    .as_ref()
                    .and_then(|r| r.owner.as_ref())
                    .is_some_and(|o| o.instance == self.me && o.incarnation != self.incarnation),
            claimable: in_manifest
                && matches!(state, Some(SplitState::Unleased | SplitState::Owned))
                && sv.lease.is_none(),
        };
        sv.counted = new;
        sv.planned = planned;
        if new.claimable {
            self.claimable.insert((Reverse(planned), id.clone()));
        }
        // The lease's load is counted at the effective weight of the planned weight it was
        // counted with: withdrawn with the old, added with the new.
        let holder = match (&sv.lease, sv.weight) {
            (Some(l), Some(_)) => Some(&l.owner.instance),
            _ => None,
        };
        let moved = sv.counted_lease.as_deref() != holder || (holder.is_some() && old_planned != planned);
        if moved {
            let holder = holder.cloned();
            if let Some(prev) = std::mem::replace(&mut sv.counted_lease, holder.clone().map(Box::new)) {
                let w = effective_weight(old_planned);
                if let Some(load) = self.loads.get_mut(&*prev) {
                    *load -= u128::from(w);
                }
                if let Some(set) = self.held_by.get_mut(&*prev) {
                    set.remove(&(w, id.clone()));
                    if set.is_empty() {
                        self.held_by.remove(&*prev);
                        self.loads.remove(&*prev);
                    }
                }
            }
            if let Some(holder) = holder {
                let w = effective_weight(planned);
                *self.loads.entry(holder.clone()).or_default() += u128::from(w);
                self.held_by.entry(holder).or_default().insert((w, id.clone()));
            }
        }
        let done_weight = |c: Counted, p: u64| u128::from(if c.done { p } else { 0 });
        self.weight_planned = self.weight_planned - u128::from(old_planned) + u128::from(planned);
        self.weight_done = self.weight_done - done_weight(old, old_planned) + done_weight(new, planned);
        adjust(&mut self.done, old.done, new.done);
        adjust(&mut self.quarantined, old.quarantined, new.quarantined);
        adjust(&mut self.owned, old.owned, new.owned);
        adjust(&mut self.undecodable_splits, old.undecodable, new.undecodable);
        adjust(&mut self.missing, old.missing, new.missing);
        if old.old_incarnation != new.old_incarnation {
            if new.old_incarnation {
                self.old_incarnation.insert(id.clone());
            } else {
                self.old_incarnation.remove(id);
            }
        }
    }
}

/// The weight a split counts for in balance (P9): its planned weight, at least 1, so that splits
/// a planner weighs 0 still count and every move changes the loads.
pub(crate) fn effective_weight(weight: u64) -> u64 {
    weight.max(1)
}

fn adjust(counter: &mut usize, old: bool, new: bool) {
    match (old, new) {
        (false, true) => *counter += 1,
        (true, false) => *counter -= 1,
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ids::{Epoch, Owner};
    use crate::records::EndReason;

    fn id(s: &str) -> SplitId {
        SplitId::new(s).unwrap()
    }

    fn owner(name: &str) -> Owner {
        Owner { instance: InstanceId::new(name).unwrap(), incarnation: Incarnation(7) }
    }

    fn done(epoch: u64, progress: &'static [u8]) -> SplitRecord {
        SplitRecord {
            epoch: Epoch(epoch),
            state: SplitState::Done,
            progress: Some(bytes::Bytes::from_static(progress)),
            last_end: Some(EndReason::Finished),
            last_error: Some("an earlier failure".into()),
            progressed: true,
            ..SplitRecord::new()
        }
    }

    fn view_of(n: usize) -> View {
        let mut v = View::new(InstanceId::new("w1").unwrap(), Incarnation(1));
        let m = ManifestRef {
            term: 1,
            version: 1,
            chunks: 1,
            split_count: n as u64,
            kind: crate::plan::PlanKind::Final,
        };
        v.set_manifest(m, (0..n).map(|i| (id(&format!("s{i}")), 10)).collect());
        v
    }

    #[test]
    fn a_split_costs_the_view_a_small_fixed_size() {
        // What a worker holds per split of a plan of a million (issue 32): the record and the
        // lease are a pointer each, not inline.
        let size = std::mem::size_of::<SplitView>();
        assert!(size <= 80, "SplitView is {size} bytes");
    }

    #[test]
    fn done_records_of_one_epoch_are_one_allocation_without_progress_and_others_are_kept_whole() {
        let mut v = view_of(3);
        v.put_record(&id("s0"), Revision(5), done(1, b"offset 10"));
        v.put_record(&id("s1"), Revision(6), done(1, b"offset 99"));
        let (a, b) =
            (v.splits[&id("s0")].record.clone().unwrap(), v.splits[&id("s1")].record.clone().unwrap());
        assert!(Arc::ptr_eq(&a, &b), "two Done records of epoch 1 share one allocation");
        assert_eq!(
            (a.progress.clone(), a.last_error.clone()),
            (None, None),
            "a Done record keeps no progress"
        );
        assert_eq!((a.epoch, a.state, a.last_end), (Epoch(1), SplitState::Done, Some(EndReason::Finished)));
        // An owned record, and a quarantined one's error, are kept as read.
        let owned = SplitRecord {
            epoch: Epoch(2),
            owner: Some(owner("w2")),
            state: SplitState::Owned,
            progress: Some(bytes::Bytes::from_static(b"p")),
            ..SplitRecord::new()
        };
        v.put_record(&id("s2"), Revision(7), owned.clone());
        assert_eq!(*v.splits[&id("s2")].record.clone().unwrap(), owned);
        let quarantined =
            SplitRecord { state: SplitState::Quarantined, last_error: Some("bad".into()), ..owned };
        v.put_record(&id("s2"), Revision(8), quarantined.clone());
        assert_eq!(*v.splits[&id("s2")].record.clone().unwrap(), quarantined);
        assert_eq!((v.done, v.quarantined, v.weight_done), (2, 1, 20));
    }

    #[test]
    fn a_full_record_cache_makes_room_from_records_no_split_holds() {
        let mut cache = RecordCache::default();
        let held: Vec<_> = (0..RecordCache::MAX as u64).map(|e| cache.intern(done(e, b""))).collect();
        assert_eq!(cache.shared.len(), RecordCache::MAX);
        drop(held);
        // Full, but nothing holds what it keeps: a new Done record is shared again.
        let (a, b) = (cache.intern(done(99_999, b"")), cache.intern(done(99_999, b"x")));
        assert!(Arc::ptr_eq(&a, &b), "a full cache stopped sharing");
        assert!(cache.shared.len() <= 1, "{} records kept that no split holds", cache.shared.len());
    }

    #[test]
    fn a_leased_split_whose_planned_weight_changes_moves_its_load_with_it() {
        let mut v = view_of(2);
        let lease = LeaseRecord { owner: owner("w2"), epoch: Epoch(1), write: 1 };
        v.put_lease(&id("s0"), Revision(3), lease.clone());
        let w2 = InstanceId::new("w2").unwrap();
        assert_eq!(v.loads[&w2], 10);
        assert!(v.held_by[&w2].contains(&(10, id("s0"))));
        // A new manifest weighs s0 at 40: the load follows, nothing of the old weight stays.
        let m = ManifestRef {
            term: 1,
            version: 2,
            chunks: 1,
            split_count: 2,
            kind: crate::plan::PlanKind::Final,
        };
        v.set_manifest(m, vec![(id("s0"), 40), (id("s1"), 10)]);
        assert_eq!(v.loads[&w2], 40);
        assert_eq!(v.held_by[&w2].iter().collect::<Vec<_>>(), vec![&(40, id("s0"))]);
        assert_eq!(v.weight_planned, 50);
        // The lease moves to another holder, then goes: no load is left behind.
        v.put_lease(&id("s0"), Revision(4), LeaseRecord { owner: owner("w3"), ..lease });
        let w3 = InstanceId::new("w3").unwrap();
        assert!(!v.loads.contains_key(&w2) && !v.held_by.contains_key(&w2));
        assert_eq!(v.loads[&w3], 40);
        v.delete_lease(&id("s0"), Revision(5));
        assert!(v.loads.is_empty() && v.held_by.is_empty(), "{:?}", v.loads);
        // Claimable again at its new weight, largest first.
        v.put_record(&id("s0"), Revision(6), SplitRecord::new());
        v.put_record(&id("s1"), Revision(7), SplitRecord::new());
        assert_eq!(v.claimable.iter().next(), Some(&(Reverse(40), id("s0"))));
    }
}
