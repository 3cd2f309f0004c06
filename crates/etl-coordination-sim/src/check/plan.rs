//! The plan: the head's term and version (I9), published manifests with every record (P4), one
//! listing per Final plan per term, no planner run over a published Final plan.

use etl_coordination_core::records::{self, ManifestChunk, PlanHead, PlanStatus, keys};
use etl_coordination_core::{Key, Owner, PlanKind, SplitId, Timestamp};
use etl_coordination_memory::MemoryKv;

use super::Checker;

impl Checker {
    /// A successful write to the plan head (I9).
    pub(super) fn on_head_write(
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

    /// P4: no planner runs while a Final plan is published (one listing per plan).
    pub(super) fn on_planner_started(&mut self, at: Timestamp, who: &Owner, head: Option<&PlanHead>) {
        if let Some(h) = head
            && h.status == PlanStatus::Published
            && h.manifest.is_some_and(|m| m.kind == PlanKind::Final)
        {
            self.fail(
                at,
                "P4",
                format!("{who} ran the planner although a Final plan is published (one listing per plan)"),
            );
        }
    }

    /// P4: a Final plan is listed once per term.
    pub(super) fn on_plan_listed(&mut self, at: Timestamp, kind: PlanKind, head: Option<&PlanHead>) {
        if kind == PlanKind::Final
            && let Some(h) = head
        {
            let n = self.final_listings.entry(h.term).or_default();
            *n += 1;
            if *n > 1 {
                let msg = format!(
                    "a Final plan was listed {n} times in term {} (one listing per Final plan per term)",
                    h.term
                );
                self.fail(at, "P4", msg);
            }
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
