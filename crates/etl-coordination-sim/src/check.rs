//! Invariant checkers (docs/PROTOCOL.md, invariants). Each check counts its executions and reports a
//! violation with a message that names the rule it broke.

use std::collections::{BTreeMap, BTreeSet};

use bytes::Bytes;
use etl_coordination_core::records::{
    self, EndReason, LeaderRecord, LeaseRecord, ManifestChunk, PlanHead, PlanStatus, PresenceRecord,
    SplitRecord, SplitState, keys,
};
use etl_coordination_core::{
    AcquisitionReason, Entry, Epoch, Key, Owner, PlanKind, SplitId, Timestamp, WatchEvent,
};
use etl_coordination_memory::MemoryKv;

/// A broken invariant.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Violation {
    /// The rule, e.g. `I1`.
    pub rule: &'static str,
    /// What happened, with the split/worker involved.
    pub message: String,
    /// Virtual time of the violation.
    pub at: Timestamp,
}

impl std::fmt::Display for Violation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} violated at t={:.3}s: {}", self.rule, self.at.0 as f64 / 1e6, self.message)
    }
}

/// Decodes the simulator's progress encoding (records done, u64 LE).
pub fn progress_of(p: &Option<Bytes>) -> u64 {
    match p {
        Some(b) if b.len() == 8 => u64::from_le_bytes(b[..].try_into().expect("8 bytes")),
        _ => 0,
    }
}

#[derive(Debug)]
pub(crate) struct Checker {
    pub checks: BTreeMap<&'static str, u64>,
    pub violation: Option<Violation>,
    max_attempts: u32,
    /// Per split: which records were emitted at least once.
    pub emitted: BTreeMap<SplitId, Vec<bool>>,
    lease_mirror: BTreeMap<SplitId, LeaseRecord>,
    /// Tenancies whose lane reported failure.
    pub failed: BTreeSet<(SplitId, Epoch)>,
    /// Records emitted by lanes that no longer own their split (per lane), for the I4 bound.
    pub stale_emits: BTreeMap<(SplitId, Epoch, Owner), u64>,
    pub stale_bound: u64,
    /// P11: per tenancy (split, epoch, holder), when its lease dies in the store's time: the TTL
    /// deadline of the latest lease write of that holder at that epoch that landed, or the
    /// holder's own delete.
    lease_deadline: BTreeMap<(SplitId, Epoch, Owner), Timestamp>,
    /// How the lease of (split, epoch, holder) came to be: created over nothing, or written
    /// over a live lease (displaced holder), or a renewal of the holder's own lease at the epoch
    /// before. Keyed by holder too: two workers can hold a lease at the same epoch one after
    /// the other (an expiry that erases a write that just landed, then a create).
    lease_origin: BTreeMap<(SplitId, Epoch, Owner), LeaseOrigin>,
    /// The tenancy each split record currently describes (P12: did it advance progress?).
    tenancy: BTreeMap<SplitId, Tenancy>,
    /// Claims by (split, new epoch): the acquisition reason the store's state implies.
    claims: BTreeMap<(SplitId, Epoch), Option<AcquisitionReason>>,
    /// Every split of every manifest ever published.
    pub published: BTreeSet<SplitId>,
    /// The highest epoch each split's record ever had (an overwrite by another program hides
    /// the current one).
    max_epoch: BTreeMap<SplitId, Epoch>,
    /// Process lifetimes that finished cleanly, and when.
    pub finished: BTreeMap<Owner, Timestamp>,
}

/// How the lease of a tenancy was taken.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum LeaseOrigin {
    /// Created: no live lease was there (it expired or was deleted).
    Created,
    /// Written by CAS over a live lease held by someone else (steal, reclaim).
    Displaced(Owner),
    /// The holder moved its own lease to the next epoch (a starved tenancy resumed).
    Resumed,
}

/// What the checker knows of the tenancy a split record describes.
#[derive(Clone, Debug)]
struct Tenancy {
    epoch: Epoch,
    /// Progress when the tenancy began.
    base: u64,
    /// Whether it committed progress beyond `base` (P12: resets the attempt count).
    progressed: bool,
}

impl Checker {
    pub fn new(max_attempts: u32, totals: &BTreeMap<SplitId, u64>, stale_bound: u64) -> Self {
        Checker {
            checks: BTreeMap::new(),
            violation: None,
            max_attempts,
            emitted: totals.iter().map(|(id, n)| (id.clone(), vec![false; *n as usize])).collect(),
            lease_mirror: BTreeMap::new(),
            failed: BTreeSet::new(),
            stale_emits: BTreeMap::new(),
            stale_bound,
            lease_deadline: BTreeMap::new(),
            lease_origin: BTreeMap::new(),
            tenancy: BTreeMap::new(),
            claims: BTreeMap::new(),
            published: BTreeSet::new(),
            max_epoch: BTreeMap::new(),
            finished: BTreeMap::new(),
        }
    }

    fn count(&mut self, rule: &'static str) {
        *self.checks.entry(rule).or_default() += 1;
    }

    pub fn fail(&mut self, at: Timestamp, rule: &'static str, message: String) {
        if self.violation.is_none() {
            self.violation = Some(Violation { rule, message, at });
        }
    }

    fn ensure(&mut self, at: Timestamp, rule: &'static str, ok: bool, message: impl FnOnce() -> String) {
        self.count(rule);
        if !ok {
            self.fail(at, rule, message());
        }
    }

    /// Lease-bucket events: the current lease of every split.
    pub fn on_lease_event(&mut self, ev: &WatchEvent) {
        match ev {
            WatchEvent::Put(e) => {
                if let Some(id) = keys::parse_split(&e.key)
                    && let Ok(l) = records::decode::<LeaseRecord>(&e.value)
                {
                    self.lease_mirror.insert(id, l);
                }
            }
            WatchEvent::Delete { key, .. } => {
                if let Some(id) = keys::parse_split(key) {
                    self.lease_mirror.remove(&id);
                }
            }
            WatchEvent::SnapshotComplete => {}
        }
    }

    /// A successful write to a split record (I1, I2 on data, I3, I5).
    pub fn on_split_write(
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
    pub fn on_foreign_write(&mut self, id: &SplitId, new: Option<&SplitRecord>) {
        self.tenancy.remove(id);
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
            let expected = old.attempts + u32::from(failing && !prev_progressed);
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
            if let Some(t) = self.tenancy.get_mut(id).filter(|t| t.epoch == new.epoch) {
                t.progressed = progressed;
            }
            if progressed {
                0
            } else if failed {
                old.attempts + 1
            } else {
                old.attempts
            }
        };
        self.ensure(at, "I5", new.attempts == expected, || {
            format!(
                "split {id}: attempts {} -> {} in a write by {writer}, expected {expected} (P12: failing tenancies without progress count, progress resets)",
                old.attempts, new.attempts
            )
        });
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
    pub fn on_acquired(
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

    /// How the lease of `id` at `epoch` held by `owner` was taken, as far as the checker knows.
    pub(crate) fn lease_origin(&self, id: &SplitId, epoch: Epoch, owner: &Owner) -> Option<LeaseOrigin> {
        self.lease_origin.get(&(id.clone(), epoch, owner.clone())).cloned()
    }

    /// Replaces that origin (or removes it), returning the one it replaced: a record write that
    /// waited at a stuck stream leader is judged by the acquisition it was made for, which a
    /// later acquisition of the same epoch may have replaced meanwhile (the lease is another
    /// stream and went on).
    pub(crate) fn replace_lease_origin(
        &mut self,
        id: &SplitId,
        epoch: Epoch,
        owner: &Owner,
        origin: Option<LeaseOrigin>,
    ) -> Option<LeaseOrigin> {
        let key = (id.clone(), epoch, owner.clone());
        match origin {
            Some(o) => self.lease_origin.insert(key, o),
            None => self.lease_origin.remove(&key),
        }
    }

    /// A lease write landed (P11 deadlines; how each tenancy's lease was taken).
    pub fn on_lease_write(
        &mut self,
        at: Timestamp,
        id: &SplitId,
        prev: Option<&LeaseRecord>,
        new: &LeaseRecord,
        deadline: Timestamp,
    ) {
        let key = (id.clone(), new.epoch, new.owner.clone());
        let d = self.lease_deadline.entry(key).or_insert(deadline);
        *d = (*d).max(deadline);
        let origin = match prev {
            None => LeaseOrigin::Created,
            Some(p) if p.owner == new.owner && p.epoch == new.epoch => return,
            Some(p) if p.owner == new.owner => LeaseOrigin::Resumed,
            Some(p) => LeaseOrigin::Displaced(p.owner.clone()),
        };
        self.lease_origin.insert((id.clone(), new.epoch, new.owner.clone()), origin);
        let _ = at;
    }

    /// The holder deleted its lease: the tenancy's lease is dead from now on.
    pub fn on_lease_deleted(&mut self, at: Timestamp, id: &SplitId) {
        if let Some(l) = self.lease_mirror.get(id)
            && let Some(d) = self.lease_deadline.get_mut(&(id.clone(), l.epoch, l.owner.clone()))
        {
            *d = (*d).min(at);
        }
    }

    /// P11: a lane the core keeps running must not outlive its lease in the store's time.
    pub fn lane_running(&mut self, at: Timestamp, id: &SplitId, epoch: Epoch, owner: &Owner) {
        let deadline = self.lease_deadline.get(&(id.clone(), epoch, owner.clone())).copied();
        self.ensure(at, "P11", deadline.is_some_and(|d| at <= d), || match deadline {
            None => format!("split {id}: {owner} runs a lane at epoch {epoch} without ever having written its lease"),
            Some(d) => format!(
                "split {id}: {owner} still runs its lane at epoch {epoch} {:.3}s after the lease died in the store (trust outlived the TTL)",
                at.saturating_since(d).as_secs_f64()
            ),
        });
    }

    /// P7: a tenancy is fenced only when somebody else moved its record or lease. A fence
    /// while both still name the holder (and no other owner's write to them is waiting at a
    /// stuck stream leader) is spurious: safe, but its work since the last commit is redone
    /// elsewhere (e.g. a conflict on a retry that our own earlier write, still waiting at the
    /// leader, caused).
    pub fn on_fenced(
        &mut self,
        at: Timestamp,
        id: &SplitId,
        owner: &Owner,
        record: Option<&SplitRecord>,
        lease: Option<&LeaseRecord>,
        foreign_write_waiting: bool,
    ) {
        let ours = record.is_some_and(|r| r.state == SplitState::Owned && r.owner.as_ref() == Some(owner))
            && lease.is_some_and(|l| l.owner == *owner);
        self.ensure(at, "P7", !ours || foreign_write_waiting, || {
            format!(
                "split {id}: {owner} fenced itself although its record and lease in the store still name it"
            )
        });
    }

    /// P4: a split record deleted (garbage collection) must not belong to a published manifest.
    pub fn on_record_deleted(&mut self, at: Timestamp, id: &SplitId, writer: &Owner) {
        self.ensure(at, "P4", !self.published.contains(id), || {
            format!("split {id}: record deleted by {writer} although a published manifest lists it")
        });
    }

    /// After every worker finished: a key left by a cleanly finished process (written before
    /// it finished) is a leak.
    pub fn on_leftover_key(&mut self, at: Timestamp, entry: &Entry, written_at: Timestamp) {
        let owner = if let Some(_id) = keys::parse_split(&entry.key) {
            records::decode::<LeaseRecord>(&entry.value).ok().map(|l| l.owner)
        } else if let Some(inst) = keys::parse_worker(&entry.key) {
            records::decode::<PresenceRecord>(&entry.value)
                .ok()
                .map(|p| Owner { instance: inst, incarnation: p.incarnation })
        } else if entry.key == keys::leader() {
            records::decode::<LeaderRecord>(&entry.value).ok().map(|l| l.owner)
        } else {
            None
        };
        let Some(owner) = owner else { return };
        let leaked = self.finished.get(&owner).is_some_and(|f| written_at < *f);
        self.ensure(at, "P10", !leaked, || {
            format!("key {} of {owner} is left although that worker finished cleanly", entry.key)
        });
    }

    /// A successful write to the plan head (I9).
    pub fn on_head_write(
        &mut self,
        at: Timestamp,
        writer: &Owner,
        old: Option<&PlanHead>,
        new: &PlanHead,
        state: &mut MemoryKv,
    ) {
        self.ensure(at, "I9", new.leader == *writer, || {
            format!("plan head written by {writer} naming leader {}", new.leader)
        });
        if let Some(old) = old {
            self.ensure(at, "I9", new.term >= old.term, || {
                format!("plan term regressed {} -> {}", old.term, new.term)
            });
            if new.term == old.term {
                self.ensure(at, "I9", old.leader == *writer, || {
                    format!(
                        "plan head of term {} rewritten by {writer}, not its leader {}",
                        new.term, old.leader
                    )
                });
            }
            if new.manifest != old.manifest {
                let (o, n) = (old.manifest.map_or(0, |m| m.version), new.manifest.map_or(0, |m| m.version));
                self.ensure(at, "I9", n > o, || format!("plan version did not increase: {o} -> {n}"));
            }
        }
        if let Some(m) = new.manifest
            && new.status == PlanStatus::Published
            && old.is_none_or(|o| o.manifest != new.manifest)
        {
            self.ensure(at, "I9", m.term == new.term, || {
                format!("published a manifest of term {} under term {}", m.term, new.term)
            });
            // Every split of a published manifest has its descriptor and record (P4).
            let ids = manifest_ids(state, at, m.term, m.version, m.chunks);
            self.published.extend(ids.iter().cloned());
            let missing = ids.iter().find(|id| {
                state.get(at, &keys::split(id)).is_none() || state.get(at, &keys::desc(id)).is_none()
            });
            self.ensure(at, "P4", missing.is_none() && ids.len() as u64 == m.split_count, || {
                format!(
                    "published manifest v{} names split {:?} without records (or has the wrong count)",
                    m.version, missing
                )
            });
        }
    }

    /// A lane emitted one record (I4's overlap bound, and the oracle for I2).
    pub fn on_emit(
        &mut self,
        at: Timestamp,
        id: &SplitId,
        record: u64,
        epoch: Epoch,
        owner: &Owner,
        current: Option<&SplitRecord>,
    ) {
        if let Some(e) = self.emitted.get_mut(id)
            && let Some(slot) = e.get_mut(record as usize)
        {
            *slot = true;
        }
        let stale = current.is_none_or(|r| {
            r.epoch > epoch
                || (r.epoch == epoch && r.owner.as_ref() != Some(owner) && r.state != SplitState::Done)
        });
        if stale {
            let n = self.stale_emits.entry((id.clone(), epoch, owner.clone())).or_default();
            *n += 1;
            let n = *n;
            let bound = self.stale_bound;
            self.ensure(at, "I4", n <= bound, || {
                format!("split {id}: lane of {owner} at epoch {epoch} emitted {n} records after losing ownership (bound {bound})")
            });
        } else {
            self.count("I4");
        }
    }

    /// A lane starts: no other lane may run the same tenancy, and terminal splits never start.
    pub fn on_lane_start(
        &mut self,
        at: Timestamp,
        id: &SplitId,
        epoch: Epoch,
        others: &[Epoch],
        current: Option<&SplitRecord>,
    ) {
        self.ensure(at, "I4", !others.contains(&epoch), || format!("split {id}: two lanes at epoch {epoch}"));
        // A lane may start just as its split changes hands (an expiry erasing an acknowledged
        // renewal races the start); such a lane is a zombie bounded by I4's emission bound and
        // fenced by I3. What must never happen is a lane for an epoch the record never had.
        let had = self.max_epoch.get(id).copied();
        self.ensure(at, "I4", had.is_some_and(|e| e >= epoch), || {
            format!(
                "split {id}: lane started at epoch {epoch} ahead of the record (now {:?}, at most {had:?} so far)",
                current.map(|r| r.epoch)
            )
        });
    }

    /// A worker declared the job's outcome (I6, I2).
    pub fn on_outcome(
        &mut self,
        at: Timestamp,
        who: &Owner,
        complete: bool,
        stalled: bool,
        state: &mut MemoryKv,
    ) {
        let head = state.get(at, &keys::plan_head()).and_then(|e| records::decode::<PlanHead>(&e.value).ok());
        let Some(m) = head.and_then(|h| h.manifest) else {
            return self.fail(at, "I6", format!("{who} declared an outcome without a published plan"));
        };
        self.ensure(at, "I6", m.kind == PlanKind::Final, || {
            format!("{who} declared an outcome of an open plan")
        });
        let ids = manifest_ids(state, at, m.term, m.version, m.chunks);
        let mut done = 0;
        let mut quarantined = 0;
        for id in &ids {
            let rec =
                state.get(at, &keys::split(id)).and_then(|e| records::decode::<SplitRecord>(&e.value).ok());
            match rec.map(|r| r.state) {
                Some(SplitState::Done) => done += 1,
                Some(SplitState::Quarantined) => quarantined += 1,
                _ => {}
            }
        }
        if complete {
            self.ensure(at, "I6", done == ids.len(), || {
                format!(
                    "{who} declared Complete with {} of {} splits Done ({quarantined} quarantined)",
                    done,
                    ids.len()
                )
            });
        }
        if stalled {
            self.ensure(at, "I6", quarantined > 0 && done + quarantined == ids.len(), || {
                format!(
                    "{who} declared Stalled with {done} Done and {quarantined} Quarantined of {}",
                    ids.len()
                )
            });
        }
        // I2: every record of every Done split was emitted at least once.
        for id in &ids {
            let done = state
                .get(at, &keys::split(id))
                .and_then(|e| records::decode::<SplitRecord>(&e.value).ok())
                .is_some_and(|r| r.state == SplitState::Done);
            if !done {
                continue;
            }
            let gap = self.emitted.get(id).and_then(|e| e.iter().position(|x| !x));
            self.ensure(at, "I2", gap.is_none(), || {
                format!("split {id} is Done but record {} was never emitted", gap.unwrap_or(0))
            });
        }
    }
}

/// The split ids of a manifest, read from the store.
pub(crate) fn manifest_ids(
    state: &mut MemoryKv,
    at: Timestamp,
    term: u64,
    version: u64,
    chunks: u32,
) -> Vec<SplitId> {
    let mut out = Vec::new();
    for c in 0..chunks {
        let key: Key = keys::manifest(term, version, c);
        if let Some(e) = state.get(at, &key)
            && let Ok(chunk) = records::decode::<ManifestChunk>(&e.value)
        {
            out.extend(chunk.splits.into_iter().map(|(id, _)| id));
        }
    }
    out
}
