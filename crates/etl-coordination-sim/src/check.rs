//! Invariant checkers (SPEC section 6). Each check counts its executions and reports a
//! violation with a message that names the rule it broke.

use std::collections::{BTreeMap, BTreeSet};

use bytes::Bytes;
use etl_coordination_core::records::{
    self, LeaseRecord, ManifestChunk, PlanHead, PlanStatus, SplitRecord, SplitState, keys,
};
use etl_coordination_core::{Epoch, Key, Owner, PlanKind, SplitId, Timestamp, WatchEvent};
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
    /// Tenancies whose lease expired (TTL), from the lease bucket's events.
    expired: BTreeSet<(SplitId, Epoch)>,
    lease_mirror: BTreeMap<SplitId, LeaseRecord>,
    /// Who held the lease of each (split, epoch).
    lease_holders: BTreeMap<(SplitId, Epoch), Owner>,
    /// Process lifetimes that crashed.
    pub crashed: BTreeSet<Owner>,
    /// Tenancies whose lane reported failure.
    pub failed: BTreeSet<(SplitId, Epoch)>,
    /// Records emitted by lanes that no longer own their split (per lane), for the I4 bound.
    pub stale_emits: BTreeMap<(SplitId, Epoch, Owner), u64>,
    pub stale_bound: u64,
}

impl Checker {
    pub fn new(max_attempts: u32, totals: &BTreeMap<SplitId, u64>, stale_bound: u64) -> Self {
        Checker {
            checks: BTreeMap::new(),
            violation: None,
            max_attempts,
            emitted: totals.iter().map(|(id, n)| (id.clone(), vec![false; *n as usize])).collect(),
            expired: BTreeSet::new(),
            lease_mirror: BTreeMap::new(),
            lease_holders: BTreeMap::new(),
            crashed: BTreeSet::new(),
            failed: BTreeSet::new(),
            stale_emits: BTreeMap::new(),
            stale_bound,
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

    /// Lease-bucket events: remembers which tenancies ended by expiry.
    pub fn on_lease_event(&mut self, ev: &WatchEvent) {
        match ev {
            WatchEvent::Put(e) => {
                if let Some(id) = keys::parse_split(&e.key)
                    && let Ok(l) = records::decode::<LeaseRecord>(&e.value)
                {
                    self.lease_holders.insert((id.clone(), l.epoch), l.owner.clone());
                    self.lease_mirror.insert(id, l);
                }
            }
            WatchEvent::Delete { key, cause, .. } => {
                if let Some(id) = keys::parse_split(key)
                    && let Some(l) = self.lease_mirror.remove(&id)
                    && *cause == etl_coordination_core::DeleteCause::Expired
                {
                    self.expired.insert((id, l.epoch));
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
        let Some(old) = old else {
            self.ensure(at, "I3", new.epoch == Epoch(0) && new.owner.is_none(), || {
                format!("split {id}: record created in a non-initial state by {writer}")
            });
            return;
        };
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
        // I5: attempts grow by one, and only on a non-graceful end.
        let grew = new.attempts > old.attempts;
        self.ensure(at, "I5", new.attempts <= old.attempts + 1, || {
            format!("split {id}: attempts jumped {} -> {}", old.attempts, new.attempts)
        });
        if grew {
            let justified = if new.epoch == old.epoch {
                // The owner ended its own tenancy: only a reported failure counts.
                self.failed.contains(&(id.clone(), old.epoch))
            } else {
                // A new tenancy: the previous one must have ended without a release. That
                // includes a half-started tenancy (lease of the next epoch taken, record not yet
                // written) whose holder died.
                let next = Epoch(old.epoch.0 + 1);
                let crashed = |o: Option<&Owner>| o.is_some_and(|o| self.crashed.contains(o));
                self.expired.contains(&(id.clone(), old.epoch))
                    || self.expired.contains(&(id.clone(), next))
                    || crashed(old.owner.as_ref())
                    || crashed(self.lease_holders.get(&(id.clone(), next)))
            };
            self.ensure(at, "I5", justified, || {
                format!(
                    "split {id}: attempt consumed ({} -> {}) by {writer} although tenancy {} of {:?} ended gracefully",
                    old.attempts, new.attempts, old.epoch, old.owner
                )
            });
        }
        let max = self.max_attempts;
        self.ensure(at, "I5", (new.state == SplitState::Quarantined) == (new.attempts >= max), || {
            format!(
                "split {id}: state {:?} with {} attempts (max_attempts {max}): quarantine must happen exactly at the cap",
                new.state, new.attempts
            )
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
        self.ensure(at, "I4", current.is_some_and(|r| r.epoch >= epoch), || {
            format!(
                "split {id}: lane started at epoch {epoch} ahead of the record ({:?})",
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
