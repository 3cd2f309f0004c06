//! The three watches and the periodic resync that feed the view (P7), and the fencing
//! triggers they carry: our lease, our presence or the leader key moving to someone else.
//! The view only triggers attempts and revocations; ownership is decided by CAS (S6).

use std::collections::BTreeSet;

use crate::ids::{Revision, SplitId};
use crate::io::{Action, StopReason, WatchId};
use crate::records::{
    self, LeaderRecord, LeaseRecord, PlanHead, PresenceRecord, SplitRecord, StealRequest, keys,
};
use crate::store::{Bucket, DeleteCause, Entry, Key, WatchEvent};
use crate::time::Timestamp;

use super::tenancy::Stage;
use super::{Phase, Worker};

/// One watch: whether its snapshot is complete, and what the snapshot in progress has shown.
#[derive(Debug, Default)]
pub(super) struct WatchState {
    pub(super) ready: bool,
    /// The keys a snapshot in progress has shown so far (its entries go into the view as they
    /// come); at `SnapshotComplete` whatever it did not show leaves the view.
    pub(super) snapshot: Option<Seen>,
}

/// The keys a snapshot (of a watch opened, reopened or resynced) has shown: split ids apart, since a snapshot of
/// a large plan shows a million of them and an id is shared, not copied (issue 32: a snapshot is
/// never held whole; its entries go into the view one by one).
#[derive(Debug, Default)]
pub(super) struct Seen {
    splits: BTreeSet<SplitId>,
    others: BTreeSet<Key>,
}

impl Seen {
    /// `key` was shown; a split's id is kept as `view` holds it (shared, not a copy).
    fn see(&mut self, key: &Key, view: &crate::view::View) {
        match keys::parse_split(key) {
            Some(id) => {
                let id = view.splits.get_key_value(&id).map_or(id, |(k, _)| k.clone());
                self.splits.insert(id)
            }
            None => self.others.insert(key.clone()),
        };
    }

    /// A delete during the snapshot: the key is absent at its end, as if never shown.
    fn unsee(&mut self, key: &Key) {
        match keys::parse_split(key) {
            Some(id) => self.splits.remove(&id),
            None => self.others.remove(key),
        };
    }

    fn split(&self, id: &SplitId) -> bool {
        self.splits.contains(id)
    }

    fn contains(&self, key: &Key) -> bool {
        match keys::parse_split(key) {
            Some(id) => self.splits.contains(&id),
            None => self.others.contains(key),
        }
    }
}

impl Worker {
    /// A failed watch is reopened; its new snapshot resyncs the view.
    pub(super) fn on_watch_failed(&mut self, watch: WatchId) {
        if let Some(w) = self.watches.get_mut(&watch) {
            w.ready = false;
            w.snapshot = Some(Seen::default());
            self.outbox.push(Action::Watch { watch });
        }
    }

    pub(super) fn on_watch(&mut self, now: Timestamp, watch: WatchId, event: WatchEvent) {
        let Some(ws) = self.watches.get_mut(&watch) else { return };
        if ws.snapshot.is_some() {
            match event {
                WatchEvent::Put(e) => {
                    let key = e.key.clone();
                    self.apply_entry(watch, e);
                    if let Some(seen) = self.watches.get_mut(&watch).and_then(|w| w.snapshot.as_mut()) {
                        seen.see(&key, &self.view);
                    }
                }
                WatchEvent::Delete { key, revision, .. } => {
                    self.deleted_in_snapshot(watch, &key, revision);
                    if let Some(seen) = self.watches.get_mut(&watch).and_then(|w| w.snapshot.as_mut()) {
                        seen.unsee(&key);
                    }
                }
                WatchEvent::SnapshotComplete => {
                    let Some(ws) = self.watches.get_mut(&watch) else { return };
                    let seen = ws.snapshot.take().expect("snapshot");
                    ws.ready = true;
                    self.end_snapshot(watch, seen);
                }
            }
            return;
        }
        match event {
            WatchEvent::Put(entry) => self.apply_put(now, watch, entry),
            WatchEvent::Delete { key, revision, cause } => self.apply_delete(watch, key, revision, cause),
            WatchEvent::SnapshotComplete => {}
        }
    }

    /// Every watch has delivered its snapshot: the view is worth deciding on.
    pub(super) fn ready(&self) -> bool {
        WatchId::ALL.iter().all(|w| self.watches.get(w).is_some_and(|s| s.ready))
    }

    /// A delete during a snapshot (made while it was being sent, or an older tombstone): into
    /// the view with its revision (so that a later read older than it decides nothing), without
    /// the triggers a live delete fires: the snapshot's end checks every held split (a lease of
    /// ours the view lacks is read again).
    fn deleted_in_snapshot(&mut self, watch: WatchId, key: &Key, rev: Revision) {
        match watch {
            WatchId::Leases => {
                if let Some(id) = keys::parse_split(key) {
                    self.view.delete_lease(&id, rev);
                } else if *key == keys::leader() {
                    self.view.leader_seen = self.view.leader_seen.max(rev);
                    if self.view.leader.as_ref().is_some_and(|(r, _)| *r < rev) {
                        self.view.leader = None;
                    }
                }
            }
            WatchId::Splits => {
                if let Some(id) = keys::parse_split(key) {
                    self.view.delete_record(&id, rev);
                }
            }
            WatchId::Plan => {
                if *key == keys::plan_head() {
                    self.view.saw_plan_head(rev, true);
                    if self.view.plan_head.as_ref().is_some_and(|(r, _)| *r < rev) {
                        self.view.plan_head = None;
                    }
                }
            }
        }
        self.note_decodable(watch.bucket(), key, rev);
    }

    /// The end of a snapshot whose entries are in the view: what it did not show is gone from
    /// `watch`'s scope (deleted or expired while the watch was away), then the fencing triggers
    /// a missed event would have fired.
    fn end_snapshot(&mut self, watch: WatchId, seen: Seen) {
        match watch {
            WatchId::Leases => {
                let gone: Vec<SplitId> = self
                    .view
                    .splits
                    .iter()
                    .filter(|(id, sv)| sv.lease.is_some() && !seen.split(id))
                    .map(|(id, _)| id.clone())
                    .collect();
                for id in gone {
                    self.view.forget_lease(&id);
                }
                self.view.workers.retain(|id, _| seen.contains(&keys::worker(id)));
                self.view.steal_requests.retain(|victim, _| seen.contains(&keys::steal(victim)));
                if !seen.contains(&keys::leader()) {
                    self.view.leader = None;
                }
            }
            WatchId::Splits => {
                let gone: Vec<SplitId> = self
                    .view
                    .splits
                    .iter()
                    .filter(|(id, sv)| (sv.record.is_some() || sv.record_undecodable) && !seen.split(id))
                    .map(|(id, _)| id.clone())
                    .collect();
                for id in gone {
                    self.view.forget_record(&id);
                }
            }
            WatchId::Plan => {
                if !seen.contains(&keys::plan_head()) {
                    self.view.plan_head = None;
                }
            }
        }
        // Undecodable values this snapshot no longer shows are gone (deleted or expired).
        let (bucket, prefix) = (watch.bucket(), watch.prefix());
        self.view.undecodable.retain(|(b, k), _| *b != bucket || !prefix.matches(k) || seen.contains(k));
        self.fence_after_snapshot(watch);
    }

    /// The key holds a value that decodes at `rev`, or none: no longer undecodable.
    pub(super) fn note_decodable(&mut self, bucket: Bucket, key: &Key, rev: Revision) {
        let slot = (bucket, key.clone());
        if self.view.undecodable.get(&slot).is_some_and(|r| *r <= rev) {
            self.view.undecodable.remove(&slot);
        }
    }

    /// Puts one entry into the view (newer revisions win). A value that cannot be decoded is
    /// noted; a split record so read leaves the view as unknown (neither claimable nor done).
    fn apply_entry(&mut self, watch: WatchId, entry: Entry) {
        let bucket = watch.bucket();
        let decoded = match watch {
            WatchId::Leases => {
                if let Some(id) = keys::parse_split(&entry.key) {
                    records::decode::<LeaseRecord>(&entry.value)
                        .map(|l| self.view.put_lease(&id, entry.revision, l))
                } else if let Some(inst) = keys::parse_worker(&entry.key) {
                    records::decode::<PresenceRecord>(&entry.value).map(|p| {
                        let newer = self.view.workers.get(&inst).is_none_or(|(r, _)| *r <= entry.revision);
                        if newer {
                            self.view.workers.insert(inst, (entry.revision, p));
                        }
                    })
                } else if let Some(victim) = keys::parse_steal(&entry.key) {
                    records::decode::<StealRequest>(&entry.value).map(|r| {
                        let newer = self
                            .view
                            .steal_requests
                            .get(&victim)
                            .is_none_or(|(rev, _)| *rev <= entry.revision);
                        if newer {
                            self.view.steal_requests.insert(victim, (entry.revision, r));
                        }
                    })
                } else if entry.key == keys::leader() {
                    self.view.leader_seen = self.view.leader_seen.max(entry.revision);
                    records::decode::<LeaderRecord>(&entry.value).map(|l| {
                        if self.view.leader.as_ref().is_none_or(|(r, _)| *r <= entry.revision) {
                            self.view.leader = Some((entry.revision, l));
                        }
                    })
                } else {
                    Ok(())
                }
            }
            WatchId::Splits => match keys::parse_split(&entry.key) {
                Some(id) => match records::decode::<SplitRecord>(&entry.value) {
                    Ok(r) => {
                        self.view.put_record(&id, entry.revision, r);
                        Ok(())
                    }
                    // Older than what the view knows (a lagging replica): it says nothing.
                    Err(_) if !self.view.put_undecodable_record(&id, entry.revision) => Ok(()),
                    Err(e) => Err(e),
                },
                None => Ok(()),
            },
            WatchId::Plan => {
                if entry.key == keys::plan_head() {
                    self.view.saw_plan_head(entry.revision, false);
                    records::decode::<PlanHead>(&entry.value).map(|h| {
                        if self.view.plan_head.as_ref().is_none_or(|(r, _)| *r <= entry.revision) {
                            self.view.plan_head = Some((entry.revision, h));
                        }
                    })
                } else {
                    Ok(())
                }
            }
        };
        match decoded {
            Ok(()) => self.note_decodable(bucket, &entry.key, entry.revision),
            Err(e) => self.note_undecodable(bucket, &entry, &e),
        }
    }

    /// A put seen on a watch: into the view, then the fencing triggers (P7, P3, P4).
    fn apply_put(&mut self, now: Timestamp, watch: WatchId, entry: Entry) {
        let key = entry.key.clone();
        let rev = entry.revision;
        let ours = watch == WatchId::Leases && self.names_me(&key, &entry.value);
        self.apply_entry(watch, entry);
        match watch {
            WatchId::Leases => {
                if let Some(id) = keys::parse_split(&key) {
                    self.tenancies.unblock(&id);
                    // A lease of ours for a split we do not hold: an acquisition we gave up whose
                    // write landed late. Give it back rather than make peers wait for its TTL.
                    if ours && !self.tenancies.contains(&id) && self.phase != Phase::Stopped {
                        self.retire(key.clone(), rev);
                    }
                    self.fence_on_lease(&id);
                } else if keys::parse_worker(&key).as_ref() == Some(&self.me.instance) {
                    self.check_own_presence(now, rev);
                } else if let Some(victim) = keys::parse_steal(&key) {
                    self.steal_request_seen(&victim, rev);
                } else if key == keys::leader()
                    && self.leader.as_ref().is_some_and(|l| l.rev < rev)
                    && self.view.leader.as_ref().is_some_and(|(_, l)| l.owner != self.me)
                {
                    self.step_down();
                }
            }
            WatchId::Splits => {
                if let Some(id) = keys::parse_split(&key) {
                    self.tenancies.unblock(&id);
                    self.fence_on_record(&id);
                }
            }
            WatchId::Plan => {}
        }
    }

    /// P7: the view shows our lease naming someone else at a revision newer than our last
    /// write to it: fenced.
    fn fence_on_lease(&mut self, id: &SplitId) {
        let Some(sv) = self.view.splits.get(id) else { return };
        let foreign = sv.lease.as_ref().is_some_and(|l| l.owner != self.me);
        if foreign && self.tenancies.get(id).is_some_and(|h| h.lease.rev.is_some_and(|r| r < sv.lease_rev)) {
            self.revoke(id, StopReason::Fenced);
        }
    }

    /// P7: the view shows our record moved to another tenancy at a revision newer than our
    /// last write to it: fenced. Only once our claim is written (before that, the claim's CAS
    /// is the fence: it fails, or it rebases on a write at the epoch it replaces). Only an ownership change bumps the epoch or names another
    /// owner; our own terminal commit clears the owner at the same epoch.
    fn fence_on_record(&mut self, id: &SplitId) {
        let Some(sv) = self.view.splits.get(id) else { return };
        let Some(h) = self.tenancies.get(id) else { return };
        let written = matches!(
            h.stage,
            Stage::Running | Stage::Starved | Stage::Stopping { .. } | Stage::EndRetry { .. }
        );
        // A value nobody can read replaced ours: our next write cannot match it either.
        let moved = match &sv.record {
            Some(r) => r.epoch != h.epoch || r.owner.as_ref().is_some_and(|o| *o != self.me),
            None => sv.record_undecodable,
        };
        if written && moved && sv.record_rev > h.written.rev {
            self.revoke(id, StopReason::Fenced);
        }
    }

    /// After a snapshot (a watch reopened, or the periodic resync): the same fencing triggers
    /// for every held split, since the snapshot may carry the change that a missed event
    /// would have. A lease of ours missing from the snapshot is checked by a point read (it
    /// may have been written after the snapshot's cut, its event still on its way).
    fn fence_after_snapshot(&mut self, watch: WatchId) {
        let ids: Vec<SplitId> = self.tenancies.ids().cloned().collect();
        for id in ids {
            match watch {
                WatchId::Leases => {
                    self.fence_on_lease(&id);
                    let missing = self.view.splits.get(&id).is_none_or(|sv| sv.lease.is_none());
                    if missing {
                        self.check_lease(&id);
                    }
                }
                WatchId::Splits => self.fence_on_record(&id),
                WatchId::Plan => {}
            }
        }
    }

    /// A delete or expiry seen on a watch: out of the view, then the fencing triggers (P7).
    fn apply_delete(&mut self, watch: WatchId, key: Key, rev: Revision, cause: DeleteCause) {
        match watch {
            WatchId::Leases => {
                if let Some(id) = keys::parse_split(&key) {
                    self.view.delete_lease(&id, rev);
                    self.tenancies.unblock(&id);
                    // P7 (docs/NATS.md): an expiry can erase an acknowledged renewal. A delete of our
                    // own lease at a revision newer than our last write means the lease is gone.
                    if self.tenancies.get(&id).is_some_and(|h| {
                        h.lease.rev.is_some_and(|r| r < rev) && h.stage != Stage::DeletingLease
                    }) {
                        self.revoke(&id, StopReason::Fenced);
                    }
                } else if let Some(inst) = keys::parse_worker(&key) {
                    if self.view.workers.get(&inst).is_some_and(|(r, _)| *r < rev) {
                        self.view.workers.remove(&inst);
                    }
                } else if let Some(victim) = keys::parse_steal(&key) {
                    if self.view.steal_requests.get(&victim).is_some_and(|(r, _)| *r < rev) {
                        self.view.steal_requests.remove(&victim);
                    }
                    self.steal_request_deleted(&victim, rev, cause == DeleteCause::Expired);
                } else if key == keys::leader() {
                    self.view.leader_seen = self.view.leader_seen.max(rev);
                    if self.view.leader.as_ref().is_some_and(|(r, _)| *r < rev) {
                        self.view.leader = None;
                        if self.leader.as_ref().is_some_and(|l| l.rev < rev) {
                            self.step_down();
                        }
                    }
                }
            }
            WatchId::Splits => {
                if let Some(id) = keys::parse_split(&key) {
                    self.view.delete_record(&id, rev);
                }
            }
            WatchId::Plan => {
                if key == keys::plan_head() {
                    self.view.saw_plan_head(rev, true);
                    if self.view.plan_head.as_ref().is_some_and(|(r, _)| *r < rev) {
                        self.view.plan_head = None;
                    }
                }
            }
        }
        self.note_decodable(watch.bucket(), &key, rev);
    }

    /// P7: the periodic resync that guards against missed watch events: every watch not
    /// already reopening is reopened, and its new snapshot streams into the view and forgets at
    /// its end what it did not show, as after a failure. Unlike after a failure the view stays
    /// ready meanwhile: nothing was known to be missed, and each entry the snapshot shows is at
    /// least as new as the one it replaces.
    ///
    /// Not a listing beside the running watch (before issue 32): a listing is cut at one
    /// revision while the watch goes on, so what the watch delivered after the cut (records the
    /// leader created meanwhile) was forgotten with no later event to restore it; and a listing
    /// is one reply of every entry, which a million-split plan could not give within one
    /// operation's budget. A reopened watch's snapshot and the events after it are one stream in
    /// revision order, and it has no total budget.
    ///
    /// A manifest that could not be read (an undecodable chunk) is read again after it.
    pub(super) fn resync(&mut self) {
        if self.manifest_load.as_ref().is_some_and(|l| l.failed) {
            self.manifest_load = None;
        }
        for w in WatchId::ALL {
            let Some(ws) = self.watches.get_mut(&w) else { continue };
            if ws.snapshot.is_some() {
                continue;
            }
            ws.snapshot = Some(Seen::default());
            self.outbox.push(Action::Watch { watch: w });
        }
    }
}
