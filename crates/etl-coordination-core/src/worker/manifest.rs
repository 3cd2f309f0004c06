//! The published manifest (P4, P13): loading its chunks into the view, and completion as every
//! worker (standbys included) sees it.

use std::collections::{BTreeMap, BTreeSet};

use crate::ids::{OpId, Revision, SplitId};
use crate::io::Outcome;
use crate::plan::PlanKind;
use crate::records::{self, ManifestChunk, ManifestRef, PlanStatus, SplitState, keys};
use crate::store::{Bucket, StoreRequest, StoreResult};
use crate::time::Timestamp;

use super::Worker;
use super::outbox::{Pending, Read};

/// A manifest whose chunks are being read.
#[derive(Debug)]
pub(super) struct ManifestLoad {
    /// This load's identity (the op id of its first read): a failed load is dropped and the
    /// same manifest loaded again, and answers sent for the dropped one must not count.
    pub(super) id: OpId,
    pub(super) manifest: ManifestRef,
    pub(super) chunks: BTreeMap<u32, Vec<(SplitId, u64)>>,
    /// The newest revision among the chunks read (a partial manifest is reported under chunk
    /// 0's key at this revision: once per content, whichever chunk answers last).
    pub(super) newest: Revision,
    pub(super) outstanding: usize,
    pub(super) failed: bool,
}

impl Worker {
    /// Starts loading the manifest the plan head names, unless loaded or loading.
    pub(super) fn load_manifest(&mut self) {
        let Some((_, head)) = &self.view.plan_head else { return };
        let Some(m) = head.manifest else { return };
        if self.view.manifest == Some(m) {
            return;
        }
        if let Some(load) = &self.manifest_load
            && load.manifest == m
        {
            return;
        }
        let id = self.outbox.next_op_id();
        self.manifest_load = Some(ManifestLoad {
            id,
            manifest: m,
            chunks: BTreeMap::new(),
            newest: Revision(0),
            outstanding: m.chunks as usize,
            failed: false,
        });
        if m.chunks == 0 {
            if m.split_count == 0 {
                self.view.set_manifest(m, Vec::new());
                self.manifest_load = None;
            } else if let Some((rev, _)) = &self.view.plan_head {
                // A head naming splits in no chunk: never installed, reported, read again.
                let (rev, error) = (*rev, partial(&m, 0));
                self.manifest_load.as_mut().expect("just set").failed = true;
                self.note_bad_value(Bucket::State, &keys::plan_head(), rev, error);
            }
            return;
        }
        for chunk in 0..m.chunks {
            let key = keys::manifest(m.term, m.version, chunk);
            self.outbox.send(
                Bucket::State,
                StoreRequest::Get { key },
                Pending::ManifestChunk { manifest: m, chunk, load: id },
            );
        }
    }

    pub(super) fn on_manifest_chunk(
        &mut self,
        now: Timestamp,
        manifest: ManifestRef,
        chunk: u32,
        load_id: OpId,
        result: StoreResult,
    ) {
        let Some(load) = &mut self.manifest_load else { return };
        if load.id != load_id || load.manifest != manifest || load.failed {
            return;
        }
        match Read::of(result) {
            Read::Found(entry) => match records::decode::<ManifestChunk>(&entry.value) {
                Ok(c) => {
                    // A chunk counts once, whatever answers it twice.
                    if load.chunks.insert(chunk, c.splits).is_none() {
                        load.outstanding -= 1;
                    }
                    load.newest = load.newest.max(entry.revision);
                }
                Err(e) => {
                    // Read again at the next resync (someone may repair it); counted meanwhile.
                    load.failed = true;
                    self.note_undecodable(Bucket::State, &entry, &e);
                }
            },
            // Garbage-collected under us: a newer manifest replaced it; the head will tell.
            Read::Absent => load.failed = true,
            Read::Failed(_) => {
                let key = keys::manifest(manifest.term, manifest.version, chunk);
                self.outbox.retry_later(
                    now,
                    Bucket::State,
                    StoreRequest::Get { key },
                    Pending::ManifestChunk { manifest, chunk, load: load_id },
                );
            }
        }
        let Some(load) = &mut self.manifest_load else { return };
        if load.outstanding == 0 && !load.failed {
            let entries: Vec<(SplitId, u64)> =
                std::mem::take(&mut load.chunks).into_values().flatten().collect();
            // Distinct ids: a chunk repeating a split would otherwise pass a count of entries.
            let distinct = entries.iter().map(|(id, _)| id).collect::<BTreeSet<_>>().len();
            if entries.len() as u64 != manifest.split_count || distinct != entries.len() {
                // A manifest whose chunks list another number of splits than its head says is
                // never installed (a partial view must never complete, I6): read again at the
                // next heartbeat or resync, reported once per content meanwhile.
                load.failed = true;
                let (rev, error) = (load.newest, partial(&manifest, distinct));
                self.note_bad_value(
                    Bucket::State,
                    &keys::manifest(manifest.term, manifest.version, 0),
                    rev,
                    error,
                );
                return;
            }
            self.manifest_load = None;
            self.view.set_manifest(manifest, entries);
            let prefix = keys::manifest_prefix();
            self.view.undecodable.retain(|(b, k), _| *b != Bucket::State || !prefix.matches(k));
        }
    }

    /// P13: completion as seen by every worker, including idle standbys.
    pub(super) fn completion(&self) -> Option<Outcome> {
        let (_, head) = self.view.plan_head.as_ref()?;
        let manifest = head.manifest?;
        if head.status != PlanStatus::Published || manifest.kind != PlanKind::Final {
            return None;
        }
        if self.view.manifest != Some(manifest) || !self.view.all_terminal() {
            return None;
        }
        if self.view.quarantined == 0 {
            return Some(Outcome::Complete);
        }
        let quarantined = self
            .view
            .splits
            .iter()
            .filter(|(_, sv)| sv.weight.is_some())
            .filter_map(|(id, sv)| {
                let r = sv.record.as_ref()?;
                (r.state == SplitState::Quarantined).then(|| (id.clone(), r.last_error.clone()))
            })
            .collect();
        Some(Outcome::Stalled { quarantined })
    }
}

/// What is wrong with a manifest whose chunks list `listed` distinct splits.
fn partial(m: &ManifestRef, listed: usize) -> String {
    format!(
        "manifest {}.{} lists {listed} distinct splits in {} chunks, its plan head says {}",
        m.term, m.version, m.chunks, m.split_count
    )
}
