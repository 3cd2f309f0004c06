//! Planning rounds (P4): asking the planner, writing descriptors and split records
//! (create-if-absent), then the manifest chunks, then publishing by CAS on the plan head;
//! re-planning Open plans; garbage-collecting what older rounds left behind.

use std::collections::{BTreeMap, BTreeSet, VecDeque};

use bytes::Bytes;

use crate::ids::{Epoch, Owner, Revision, SplitId};
use crate::io::{Action, Event};
use crate::plan::{Plan, PlanKind, PlannedSplit};
use crate::records::{self, Descriptor, ManifestChunk, ManifestRef, PlanHead, PlanStatus, SplitRecord, keys};
use crate::store::{Bucket, Key, StoreReply, StoreRequest, StoreResult};
use crate::time::Timestamp;

use super::Worker;
use super::outbox::{Pending, Read, Written};

/// How many plan writes (descriptors, records, manifest chunks) the leader keeps in flight.
const PLAN_WRITE_WINDOW: usize = 64;

/// Where the leader's planning is.
#[derive(Debug)]
pub(super) enum PlanStage {
    /// Bumping the term (P4); the op is in flight.
    Bumping,
    /// Waiting for the current manifest to load before asking the planner.
    WaitManifest,
    /// Nothing to do until `replan_at` (Open) or ever (Final).
    Idle,
    /// The planner was asked (request id); its answer is awaited until `deadline`.
    Requested { request: u64, deadline: Timestamp },
    /// The round's records and manifest are being written.
    Writing(Box<RoundWrites>),
    /// The publishing head CAS is in flight.
    Publishing,
    /// A step failed; try again at this time.
    RetryAt(Timestamp),
}

/// The writes of one planning round, all create-if-absent: descriptors and split records
/// first, then (once every one exists) the manifest chunks, then the publication. Each write
/// is encoded when it is sent, not before: a million-split round held two million encoded
/// writes at once (issue 32: the leader's planning peak).
#[derive(Debug)]
pub(super) struct RoundWrites {
    /// The round's new splits: each is two writes, its descriptor then its record.
    new: Vec<PlannedSplit>,
    /// The next of the `2 * new.len()` split writes to send.
    next_split: usize,
    /// The manifest's entries, written as chunks of `chunk_len`.
    entries: Vec<(SplitId, u64)>,
    chunk_len: usize,
    /// The next chunk to send.
    next_chunk: u32,
    /// Split writes to send again (a failed one, or a record gone), before any new one.
    splits_again: VecDeque<(Key, Bytes)>,
    /// Manifest chunks to send again.
    chunks_again: VecDeque<(Key, Bytes)>,
    splits_in_flight: usize,
    chunks_in_flight: usize,
    /// The manifest this round publishes.
    manifest: ManifestRef,
    /// After a failed write, pause sending until then.
    resume_at: Option<Timestamp>,
    /// The planner request this write belongs to; results of older rounds are ignored.
    round: u64,
}

impl RoundWrites {
    /// The next descriptor or split record to write, if any is left.
    fn next_split_write(&mut self) -> Option<(Key, Bytes)> {
        if let Some(w) = self.splits_again.pop_front() {
            return Some(w);
        }
        let s = self.new.get(self.next_split / 2)?;
        let write = if self.next_split.is_multiple_of(2) {
            (
                keys::desc(&s.id),
                records::encode(&Descriptor { descriptor: s.descriptor.clone(), weight: s.weight }),
            )
        } else {
            (keys::split(&s.id), records::encode(&SplitRecord::new()))
        };
        self.next_split += 1;
        Some(write)
    }

    /// The next manifest chunk to write, if any is left.
    fn next_chunk_write(&mut self) -> Option<(Key, Bytes)> {
        if let Some(w) = self.chunks_again.pop_front() {
            return Some(w);
        }
        let i = self.next_chunk;
        let part = self.entries.chunks(self.chunk_len).nth(i as usize)?;
        let write = (
            keys::manifest(self.manifest.term, self.manifest.version, i),
            records::encode(&ManifestChunk { splits: part.to_vec() }),
        );
        self.next_chunk += 1;
        Some(write)
    }

    /// Every write sent (some may still be in flight).
    fn all_sent(&self) -> bool {
        self.splits_again.is_empty()
            && self.chunks_again.is_empty()
            && self.next_split >= 2 * self.new.len()
            && self.next_chunk >= self.manifest.chunks
    }
}

impl Worker {
    /// P4: the leader's next planning step, run on every evaluation.
    pub(super) fn drive_plan(&mut self, now: Timestamp) {
        let Some(l) = self.leader.as_mut() else { return };
        // Our own head write may have landed while its answer was lost: a newer head of our
        // term, by us, is ours (only a term's leader writes it), so adopt it.
        if let (Some((vrev, vh)), Some((rev, h))) = (&self.view.plan_head, &l.head)
            && vh.term == h.term
            && vh.leader == self.me
            && vrev > rev
        {
            let (vrev, vh) = (*vrev, vh.clone());
            l.head = Some((vrev, vh));
        }
        match &mut l.stage {
            PlanStage::WaitManifest => {
                let Some((_, head)) = &l.head else { return };
                if head.manifest.is_some() && self.view.manifest != head.manifest {
                    return; // the manifest is loading
                }
                let request = self.next_plan_request;
                self.next_plan_request += 1;
                l.stage = PlanStage::Requested { request, deadline: now + self.cfg.tuning.plan_timeout };
                self.outbox.push(Action::Plan { request });
            }
            PlanStage::Writing(_) => self.pump_plan_writes(now),
            PlanStage::Idle => {
                if let Some(m) = l.gc_for
                    && self.view.manifest == Some(m)
                {
                    l.gc_for = None;
                    let term_rev = l.term_rev.unwrap_or(Revision(0));
                    self.outbox.send(
                        Bucket::State,
                        StoreRequest::List { prefix: keys::manifest_prefix() },
                        Pending::GcList,
                    );
                    // Orphan split records (written by a deposed leader, never published) are
                    // deleted if nobody ever owned them and they predate our term. The guarded
                    // delete is the fence against a newer leader: it touches every record it
                    // publishes within its own term, so a deposed leader's collection (which
                    // may still run, from an old view) deletes nothing a newer manifest names.
                    let orphans: Vec<(SplitId, Revision)> = self
                        .view
                        .splits
                        .iter()
                        .filter(|(_, sv)| sv.weight.is_none() && sv.record_rev < term_rev)
                        .filter(|(_, sv)| sv.record.as_ref().is_some_and(|r| r.epoch == Epoch(0)))
                        .map(|(id, sv)| (id.clone(), sv.record_rev))
                        .collect();
                    for (id, rev) in orphans {
                        self.outbox.send(
                            Bucket::State,
                            StoreRequest::Delete { key: keys::split(&id), expected: rev },
                            Pending::Cleanup,
                        );
                    }
                }
            }
            _ => {}
        }
    }

    /// The planner failed (an error, a panic the embedding layer caught, or no answer within
    /// `plan_timeout`): record it and call the planner again after a backoff that doubles with
    /// each consecutive failure (a heartbeat interval, up to 32 of them).
    fn plan_failed(&mut self, now: Timestamp, error: String) {
        let hb = self.cfg.tuning.heartbeat_interval();
        let Some(l) = self.leader.as_mut() else { return };
        let backoff = hb * 2u32.pow(l.plan_failures.min(5));
        l.plan_failures += 1;
        l.stage = PlanStage::RetryAt(now + backoff);
        self.outbox.event(Event::PlanFailed { error });
    }

    /// P4: the planner did not answer in time; its late answer will be ignored.
    pub(super) fn plan_timed_out(&mut self, now: Timestamp) {
        let timeout = self.cfg.tuning.plan_timeout;
        if let Some(l) = &self.leader
            && let PlanStage::Requested { deadline, .. } = l.stage
            && now >= deadline
        {
            self.plan_failed(now, format!("the planner did not answer within {timeout:?}"));
        }
    }

    /// P4: an Open plan is due for re-planning.
    pub(super) fn replan_due(&mut self, now: Timestamp) {
        let Some(l) = &mut self.leader else { return };
        if l.replan_at.is_some_and(|t| now >= t) {
            l.replan_at = None;
            if matches!(l.stage, PlanStage::Idle) {
                l.stage = PlanStage::WaitManifest;
            }
        }
    }

    /// P4: retry a failed planning step: the term bump if it never landed, else the planner.
    pub(super) fn plan_retry_due(&mut self, now: Timestamp) {
        let Some(l) = &mut self.leader else { return };
        if let PlanStage::RetryAt(t) = l.stage
            && now >= t
        {
            if l.head.is_none() {
                // The term bump never landed: start over from the current head.
                l.stage = PlanStage::Bumping;
                let current = self.view.plan_head.clone();
                self.bump_term(current);
            } else {
                l.stage = PlanStage::WaitManifest;
            }
        }
    }

    /// P4: the planner answered: write what is new (the published manifest is the union of the
    /// current one and the new enumeration), or retry after a planner error.
    pub(super) fn on_plan_ready(&mut self, now: Timestamp, request: u64, result: Result<Plan, String>) {
        let Some(l) = self.leader.as_mut() else { return };
        if !matches!(l.stage, PlanStage::Requested { request: r, .. } if r == request) {
            return;
        }
        let plan = match result.and_then(|p| validate_plan(&p).map(|()| p)) {
            Ok(p) => p,
            Err(error) => return self.plan_failed(now, error),
        };
        self.leader.as_mut().expect("leader").plan_failures = 0;
        let Some(l) = self.leader.as_mut() else { return };
        let Some((_, head)) = l.head.clone() else { return };
        // The published manifest is the union of the current one and the new enumeration.
        let mut entries: BTreeMap<SplitId, u64> = BTreeMap::new();
        if head.manifest.is_some() {
            for (id, sv) in &self.view.splits {
                if let Some(w) = sv.weight {
                    entries.insert(id.clone(), w);
                }
            }
        }
        let mut new = Vec::new();
        for s in plan.splits {
            if entries.contains_key(&s.id) {
                continue;
            }
            entries.insert(s.id.clone(), s.weight);
            new.push(s);
        }
        let unchanged =
            head.manifest.is_some_and(|m| m.kind == plan.kind && m.term == head.term) && new.is_empty();
        if unchanged {
            l.stage = PlanStage::Idle;
            if plan.kind == PlanKind::Open {
                l.replan_at = Some(now + self.cfg.tuning.replan_interval);
            }
            return;
        }
        // Every planning round writes a fresh version: a round that failed to publish may have
        // left chunks behind, and create-if-absent would silently keep their old content.
        let version = head.manifest.map_or(1, |m| m.version + 1).max(l.last_version + 1);
        l.last_version = version;
        let entries: Vec<(SplitId, u64)> = entries.into_iter().collect();
        let chunk_len = self.cfg.tuning.manifest_chunk_len;
        let manifest = ManifestRef {
            term: head.term,
            version,
            chunks: u32::try_from(entries.len().div_ceil(chunk_len)).unwrap_or(u32::MAX),
            split_count: entries.len() as u64,
            kind: plan.kind,
        };
        l.stage = PlanStage::Writing(Box::new(RoundWrites {
            new,
            next_split: 0,
            entries,
            chunk_len,
            next_chunk: 0,
            splits_again: VecDeque::new(),
            chunks_again: VecDeque::new(),
            splits_in_flight: 0,
            chunks_in_flight: 0,
            manifest,
            resume_at: None,
            round: request,
        }));
        self.pump_plan_writes(now);
    }

    /// Keeps up to [`PLAN_WRITE_WINDOW`] writes in flight; publishes once all have landed.
    fn pump_plan_writes(&mut self, now: Timestamp) {
        let Some(l) = self.leader.as_mut() else { return };
        let PlanStage::Writing(w) = &mut l.stage else { return };
        if w.resume_at.is_some_and(|t| now < t) {
            return;
        }
        w.resume_at = None;
        let mut sends = Vec::new();
        while w.splits_in_flight + w.chunks_in_flight < PLAN_WRITE_WINDOW {
            // Manifest chunks only after every descriptor and record exists: a published
            // manifest never names a split without its records.
            let next = if let Some(x) = w.next_split_write() {
                w.splits_in_flight += 1;
                x
            } else if w.splits_in_flight == 0
                && let Some(x) = w.next_chunk_write()
            {
                w.chunks_in_flight += 1;
                x
            } else {
                break;
            };
            sends.push(next);
        }
        let publish = w.all_sent() && w.splits_in_flight + w.chunks_in_flight == 0;
        let manifest = w.manifest;
        let round = w.round;
        for (key, value) in sends {
            let request = StoreRequest::Create { key: key.clone(), value: value.clone(), ttl: None };
            self.outbox.send(Bucket::State, request, Pending::PlanWrite { round, key, value });
        }
        if publish {
            let l = self.leader.as_mut().expect("leader");
            let Some((rev, head)) = l.head.clone() else { return };
            l.stage = PlanStage::Publishing;
            let new = PlanHead {
                term: head.term,
                leader: self.me.clone(),
                status: PlanStatus::Published,
                manifest: Some(manifest),
            };
            let request = StoreRequest::CompareAndSwap {
                key: keys::plan_head(),
                expected: rev,
                value: records::encode(&new),
                ttl: None,
            };
            self.outbox.send(Bucket::State, request, Pending::HeadWrite { stint: self.stint(), head: new });
        }
    }

    /// One plan write answered: existing keys are fine (deterministic ids); anything else is
    /// repeated after a backoff (create-if-absent is safe to repeat).
    pub(super) fn on_plan_write(
        &mut self,
        now: Timestamp,
        round: u64,
        key: Key,
        value: Bytes,
        result: StoreResult,
    ) {
        let backoff = self.outbox.retry_backoff();
        let Some(l) = self.leader.as_mut() else { return };
        let PlanStage::Writing(w) = &mut l.stage else { return };
        if w.round != round {
            return;
        }
        let is_manifest = keys::parse_manifest(&key).is_some();
        if is_manifest {
            w.chunks_in_flight -= 1;
        } else {
            w.splits_in_flight -= 1;
        }
        match Written::of(result) {
            Written::Applied(_) => {}
            // An existing split record (re-planning, or an orphan of an earlier round) must
            // carry a revision of our term before we publish it: read it to decide (P4).
            Written::Conflict if keys::parse_split(&key).is_some() => {
                w.splits_in_flight += 1;
                self.outbox.send(
                    Bucket::State,
                    StoreRequest::Get { key: key.clone() },
                    Pending::PlanTouchRead { round, key, value },
                );
            }
            // Other existing keys are expected: deterministic ids make re-planning a no-op.
            Written::Conflict => {}
            Written::Fatal(e) => return self.fatal_store(e),
            Written::InDoubt | Written::Unavailable => {
                if is_manifest {
                    w.chunks_again.push_front((key, value));
                } else {
                    w.splits_again.push_front((key, value));
                }
                w.resume_at = Some(now + backoff);
            }
        }
        self.pump_plan_writes(now);
    }

    /// P4: an existing split record this round publishes. Never owned and written before our
    /// term: a deposed leader's garbage collection may be deleting it from an old view, so
    /// touch it (the same value by CAS) to give it a revision of our term; a conflict reads
    /// again, a record gone is created again. Owned records are never collected.
    pub(super) fn on_plan_touch_read(
        &mut self,
        now: Timestamp,
        round: u64,
        key: Key,
        value: Bytes,
        result: StoreResult,
    ) {
        let backoff = self.outbox.retry_backoff();
        let Some(l) = self.leader.as_mut() else { return };
        let term_rev = l.term_rev.unwrap_or(Revision(0));
        let PlanStage::Writing(w) = &mut l.stage else { return };
        if w.round != round {
            return;
        }
        w.splits_in_flight -= 1;
        match Read::of(result) {
            Read::Found(e) => {
                let never_owned = records::decode::<SplitRecord>(&e.value).is_ok_and(|r| r.epoch == Epoch(0));
                if never_owned && e.revision < term_rev {
                    w.splits_in_flight += 1;
                    let request = StoreRequest::CompareAndSwap {
                        key: key.clone(),
                        expected: e.revision,
                        value: e.value,
                        ttl: None,
                    };
                    self.outbox.send(Bucket::State, request, Pending::PlanWrite { round, key, value });
                }
            }
            Read::Absent => w.splits_again.push_front((key, value)),
            Read::Failed(_) => {
                w.splits_again.push_front((key, value));
                w.resume_at = Some(now + backoff);
            }
        }
        self.pump_plan_writes(now);
    }

    /// P4: delete manifest chunks of older versions than the published one. Only a leader
    /// does: one that stepped down (or left) while the listing was in flight leaves the
    /// garbage to the next (the deletes are fenced by revision anyway, but sent unled).
    pub(super) fn on_gc_list(&mut self, result: StoreResult) {
        if self.leader.is_none() {
            return;
        }
        let Ok(StoreReply::Entries(entries)) = result else { return };
        let Some(current) = self.view.plan_head.as_ref().and_then(|(_, h)| h.manifest) else { return };
        for e in entries {
            if let Some((term, version, _)) = keys::parse_manifest(&e.key)
                && (term, version) != (current.term, current.version)
                && version <= current.version
            {
                self.outbox.send(
                    Bucket::State,
                    StoreRequest::Delete { key: e.key, expected: e.revision },
                    Pending::Cleanup,
                );
            }
        }
    }
}

/// Split ids must be unique within a plan.
fn validate_plan(plan: &Plan) -> Result<(), String> {
    let mut seen = BTreeSet::new();
    for s in &plan.splits {
        if !seen.insert(&s.id) {
            return Err(format!("planner returned split id {} twice; split ids must be unique", s.id));
        }
        if s.descriptor.len() > records::MAX_DESCRIPTOR_LEN {
            return Err(format!(
                "planner returned split {} with a descriptor of {} bytes, above the {}-byte limit of \
                 a stored descriptor; plan smaller splits (a smaller split size, fewer objects or rows \
                 per split) or describe a split more compactly",
                s.id,
                s.descriptor.len(),
                records::MAX_DESCRIPTOR_LEN
            ));
        }
    }
    Ok(())
}

impl Worker {
    /// Which leadership stint this is (0: none).
    pub(super) fn stint(&self) -> u64 {
        self.leader.as_ref().map_or(0, |l| l.stint)
    }

    /// P4: bump the term before planning, so a deposed leader's in-flight plan write loses its
    /// swap.
    pub(super) fn bump_term(&mut self, current: Option<(Revision, PlanHead)>) {
        let (request, head) = Self::term_bump(&self.me, current);
        self.outbox.send(Bucket::State, request, Pending::HeadWrite { stint: self.stint(), head });
    }

    /// The head write that bumps the term over `current`.
    pub(super) fn term_bump(me: &Owner, current: Option<(Revision, PlanHead)>) -> (StoreRequest, PlanHead) {
        match current {
            None => {
                let head =
                    PlanHead { term: 1, leader: me.clone(), status: PlanStatus::Planning, manifest: None };
                (
                    StoreRequest::Create { key: keys::plan_head(), value: records::encode(&head), ttl: None },
                    head,
                )
            }
            Some((rev, old)) => {
                // A published Final plan needs no re-planning: keep it published.
                let needs_plan = old.manifest.is_none_or(|m| m.kind == PlanKind::Open);
                let head = PlanHead {
                    term: old.term + 1,
                    leader: me.clone(),
                    status: if needs_plan { PlanStatus::Planning } else { PlanStatus::Published },
                    manifest: old.manifest,
                };
                (
                    StoreRequest::CompareAndSwap {
                        key: keys::plan_head(),
                        expected: rev,
                        value: records::encode(&head),
                        ttl: None,
                    },
                    head,
                )
            }
        }
    }
}
