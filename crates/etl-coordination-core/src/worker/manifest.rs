//! The published manifest (P4, P13): loading its chunks into the view, and completion as every
//! worker (standbys included) sees it.

use std::collections::BTreeMap;

use crate::ids::SplitId;
use crate::io::{Outcome, PlanKind};
use crate::records::{self, ManifestChunk, ManifestRef, PlanStatus, SplitState, keys};
use crate::store::{Bucket, StoreRequest, StoreResult};
use crate::time::Timestamp;

use super::Worker;
use super::outbox::{Pending, Read};

/// A manifest whose chunks are being read.
#[derive(Debug)]
pub(super) struct ManifestLoad {
    pub(super) manifest: ManifestRef,
    pub(super) chunks: BTreeMap<u32, Vec<(SplitId, u64)>>,
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
        self.manifest_load = Some(ManifestLoad {
            manifest: m,
            chunks: BTreeMap::new(),
            outstanding: m.chunks as usize,
            failed: false,
        });
        if m.chunks == 0 {
            self.view.set_manifest(m, Vec::new());
            self.manifest_load = None;
            return;
        }
        for chunk in 0..m.chunks {
            let key = keys::manifest(m.term, m.version, chunk);
            self.send(
                Bucket::State,
                StoreRequest::Get { key },
                Pending::ManifestChunk { manifest: m, chunk },
            );
        }
    }

    pub(super) fn on_manifest_chunk(
        &mut self,
        now: Timestamp,
        manifest: ManifestRef,
        chunk: u32,
        result: StoreResult,
    ) {
        let Some(load) = &mut self.manifest_load else { return };
        if load.manifest != manifest || load.failed {
            return;
        }
        match Read::of(result) {
            Read::Found(entry) => match records::decode::<ManifestChunk>(&entry.value) {
                Ok(c) => {
                    load.chunks.insert(chunk, c.splits);
                    load.outstanding -= 1;
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
                self.retry_later(
                    now,
                    Bucket::State,
                    StoreRequest::Get { key },
                    Pending::ManifestChunk { manifest, chunk },
                );
            }
        }
        let Some(load) = &self.manifest_load else { return };
        if load.outstanding == 0 && !load.failed {
            let load = self.manifest_load.take().expect("load");
            let entries: Vec<(SplitId, u64)> = load.chunks.into_values().flatten().collect();
            self.view.set_manifest(load.manifest, entries);
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
