//! [`Worker`]: the whole protocol (P2-P14) for one worker, as a pure state machine.
//!
//! `handle(now, input)` returns the actions to execute; `next_deadline()` says when to call
//! again with [`Input::Tick`]. No IO, no clock, no randomness: a run is a replayable list of
//! inputs.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::time::Duration;

use bytes::Bytes;

use crate::config::Config;
use crate::ids::{Epoch, OpId, Owner, Revision, SplitId};
use crate::io::{
    AcquisitionReason, Action, CommitOutcome, Event, FatalError, Input, Outcome, Plan, StopReason, WatchId,
};
use crate::kv::{
    Bucket, DeleteCause, Entry, Key, StoreError, StoreReply, StoreRequest, StoreResult, WatchEvent,
};
use crate::records::{
    self, Descriptor, EndReason, LeaderRecord, LeaseRecord, ManifestChunk, ManifestRef, Meta, PlanHead,
    PlanKind, PlanStatus, PresenceRecord, SplitRecord, SplitState, keys,
};
use crate::time::Timestamp;
use crate::view::View;

/// How many plan writes (descriptors, records, manifest chunks) the leader keeps in flight.
const PLAN_WRITE_WINDOW: usize = 64;

/// The protocol state machine of one worker.
#[derive(Debug)]
pub struct Worker {
    cfg: Config,
    me: Owner,
    phase: Phase,
    next_op: u64,
    next_plan_request: u64,
    pending: BTreeMap<OpId, Pending>,
    out: Vec<Action>,
    view: View,
    watches: BTreeMap<WatchId, WatchState>,
    presence: Presence,
    leader: Option<Box<Leading>>,
    leader_attempt: Option<OpId>,
    held: BTreeMap<SplitId, Held>,
    blocked: BTreeSet<SplitId>,
    retries: Vec<Retry>,
    heartbeat_at: Option<Timestamp>,
    resync_at: Option<Timestamp>,
    last_steal_at: Option<Timestamp>,
    manifest_load: Option<ManifestLoad>,
    leaving: Option<Leaving>,
    gauges: (u32, u32, u32),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    Idle,
    Meta,
    Joining,
    Running,
    Leaving,
    Stopped,
}

#[derive(Debug, Default)]
struct WatchState {
    ready: bool,
    /// Entries of a snapshot in progress, applied as a whole at `SnapshotComplete`.
    snapshot: Option<Vec<Entry>>,
}

#[derive(Debug, Default)]
struct Presence {
    rev: Option<Revision>,
    renewing: Option<OpId>,
    trusted_until: Timestamp,
    join: Join,
}

#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
enum Join {
    #[default]
    NotStarted,
    /// Create in flight.
    Creating,
    /// Another incarnation holds our id; waiting to see whether it renews (P3).
    Observing {
        rev: Revision,
        incarnation: u64,
        deadline: Timestamp,
    },
    /// Re-reading the key at the end of the observation window.
    Rechecking {
        rev: Revision,
        incarnation: u64,
    },
    /// CAS over the dead predecessor's key in flight.
    TakingOver,
    Joined,
}

#[derive(Debug)]
struct Leading {
    rev: Revision,
    renewing: Option<OpId>,
    trusted_until: Timestamp,
    /// The plan head as this leader last wrote it, with its revision.
    head: Option<(Revision, PlanHead)>,
    stage: PlanStage,
    replan_at: Option<Timestamp>,
    gc_for: Option<ManifestRef>,
    /// The last manifest version this leader wrote (published or not).
    last_version: u64,
    /// Which leadership stint of this worker this is (results of older stints are ignored).
    stint: u64,
}

#[derive(Debug)]
enum PlanStage {
    /// Bumping the term (P4); the op is in flight.
    Bumping,
    /// Waiting for the current manifest to load before asking the planner.
    WaitManifest,
    /// Nothing to do until `replan_at` (Open) or ever (Final).
    Idle,
    Requested(u64),
    Writing(Box<PlanWrite>),
    Publishing,
    RetryAt(Timestamp),
}

#[derive(Debug)]
struct PlanWrite {
    /// Descriptors and records (create-if-absent), then manifest chunks.
    first: VecDeque<(Key, Bytes)>,
    second: VecDeque<(Key, Bytes)>,
    first_in_flight: usize,
    second_in_flight: usize,
    manifest: ManifestRef,
    resume_at: Option<Timestamp>,
    /// The planner request this write belongs to; results of older rounds are ignored.
    round: u64,
}

#[derive(Debug)]
struct ManifestLoad {
    manifest: ManifestRef,
    chunks: BTreeMap<u32, Vec<(SplitId, u64)>>,
    outstanding: usize,
    failed: bool,
}

#[derive(Debug)]
struct Leaving {
    outcome: Outcome,
    deadline: Timestamp,
    cleanup_sent: bool,
    cleanup_outstanding: usize,
    deadline_passed: bool,
}

#[derive(Debug)]
struct Retry {
    at: Timestamp,
    bucket: Bucket,
    request: StoreRequest,
    pending: Pending,
}

#[derive(Debug, Clone)]
struct Held {
    epoch: Epoch,
    weight: u64,
    reason: AcquisitionReason,
    consumes_attempt: bool,
    /// The record this tenancy was acquired from (acquisition only).
    base: SplitRecord,
    /// The record as this worker last wrote it, and that write's revision (P8).
    record: SplitRecord,
    record_rev: Revision,
    lease_rev: Option<Revision>,
    trusted_until: Timestamp,
    renewing: Option<OpId>,
    stage: Stage,
    /// The op of the current stage (acquisition steps, end write, lease delete).
    op: Option<OpId>,
    commit: Option<CommitInFlight>,
    /// What to do once the in-flight commit resolves.
    end: Option<End>,
    /// The end record being written (stage Ending).
    target: Option<SplitRecord>,
    /// The lane is being restarted after starvation (no new acquisition).
    resumed: bool,
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Stage {
    AcquiringLease,
    WritingRecord,
    ReadingDesc,
    Running,
    Starved,
    Stopping { deadline: Timestamp },
    Ending,
    DeletingLease,
}

#[derive(Debug, Clone)]
struct CommitInFlight {
    op: OpId,
    progress: Bytes,
    terminal: bool,
    /// Only with the `unfenced_commit` mutation: the read that precedes the blind CAS.
    #[cfg(feature = "mutations")]
    unfenced_read: bool,
}

#[derive(Debug, Clone)]
enum End {
    Release,
    Fail { error: String, unprocessable: bool },
}

#[derive(Debug, Clone)]
enum Pending {
    MetaCreate,
    MetaGet,
    PresenceCreate { sent: Timestamp },
    PresenceGet,
    PresenceTakeover { sent: Timestamp },
    PresenceRenew { sent: Timestamp },
    PresenceResolve { sent: Timestamp },
    LeaderCreate { sent: Timestamp },
    LeaderRenew { sent: Timestamp },
    LeaderResolve { sent: Timestamp },
    HeadWrite { stint: u64, head: PlanHead },
    HeadRead { stint: u64, attempted: PlanHead },
    PlanWrite { round: u64, key: Key, value: Bytes },
    ManifestChunk { manifest: ManifestRef, chunk: u32 },
    GcList,
    Cleanup,
    LeaseAcquire { split: SplitId, sent: Timestamp },
    LeaseAcquireResolve { split: SplitId, sent: Timestamp },
    LeaseRenew { split: SplitId, sent: Timestamp },
    LeaseRenewResolve { split: SplitId, sent: Timestamp },
    LeaseDelete { split: SplitId },
    RecordClaim { split: SplitId },
    RecordClaimRead { split: SplitId },
    DescRead { split: SplitId },
    RecordCommit { split: SplitId },
    RecordCommitRead { split: SplitId },
    RecordEnd { split: SplitId },
    RecordEndRead { split: SplitId },
    ResumeRead { split: SplitId },
    Resync { watch: WatchId },
}

impl Worker {
    /// A worker for `cfg`, which must have passed [`Config::validate`].
    pub fn new(cfg: Config) -> Self {
        debug_assert!(cfg.validate().is_ok(), "config must be validated first");
        let me = Owner { instance: cfg.instance_id.clone(), incarnation: cfg.incarnation };
        let view = View::new(cfg.instance_id.clone(), cfg.incarnation);
        Worker {
            cfg,
            me,
            phase: Phase::Idle,
            next_op: 1,
            next_plan_request: 1,
            pending: BTreeMap::new(),
            out: Vec::new(),
            view,
            watches: BTreeMap::new(),
            presence: Presence::default(),
            leader: None,
            leader_attempt: None,
            held: BTreeMap::new(),
            blocked: BTreeSet::new(),
            retries: Vec::new(),
            heartbeat_at: None,
            resync_at: None,
            last_steal_at: None,
            manifest_load: None,
            leaving: None,
            gauges: (u32::MAX, u32::MAX, u32::MAX),
        }
    }

    /// This worker's configuration.
    pub fn config(&self) -> &Config {
        &self.cfg
    }

    /// Whether the worker has stopped (finished or fatal). No further actions follow.
    pub fn is_stopped(&self) -> bool {
        self.phase == Phase::Stopped
    }

    /// Whether this worker currently believes it leads.
    pub fn is_leader(&self) -> bool {
        self.leader.is_some()
    }

    /// The splits this worker holds (including ones being acquired or released), with epochs.
    pub fn held(&self) -> impl Iterator<Item = (&SplitId, Epoch)> {
        self.held.iter().map(|(id, h)| (id, h.epoch))
    }

    /// Feeds one input at time `now`; returns the actions to execute, in order.
    pub fn handle(&mut self, now: Timestamp, input: Input) -> Vec<Action> {
        if self.phase == Phase::Stopped {
            return Vec::new();
        }
        match input {
            Input::Start => self.on_start(now),
            Input::Tick => self.on_tick(now),
            Input::StoreResult { op, result } => self.on_store_result(now, op, result),
            Input::Watch { watch, event } => self.on_watch(now, watch, event),
            Input::WatchFailed { watch } => self.on_watch_failed(watch),
            Input::PlanReady { request, result } => self.on_plan_ready(now, request, result),
            Input::Commit { split, epoch, progress } => self.on_commit(now, split, epoch, progress, false),
            Input::Finish { split, epoch, progress } => self.on_commit(now, split, epoch, progress, true),
            Input::Fail { split, epoch, error, unprocessable } => {
                self.on_fail(now, split, epoch, error, unprocessable)
            }
            Input::LaneStopped { split, epoch } => self.on_lane_stopped(now, split, epoch),
            Input::Drain => self.on_drain(now),
        }
        if matches!(self.phase, Phase::Running | Phase::Leaving) {
            self.evaluate(now);
        }
        self.emit_gauges();
        std::mem::take(&mut self.out)
    }

    /// The earliest time at which [`Input::Tick`] must be delivered, if any.
    pub fn next_deadline(&self) -> Option<Timestamp> {
        if self.phase == Phase::Stopped {
            return None;
        }
        let mut d: Option<Timestamp> = None;
        let mut add = |t: Option<Timestamp>| {
            if let Some(t) = t {
                d = Some(d.map_or(t, |d| d.min(t)));
            }
        };
        add(self.heartbeat_at);
        add(self.resync_at);
        for r in &self.retries {
            add(Some(r.at));
        }
        if let Join::Observing { deadline, .. } = self.presence.join {
            add(Some(deadline));
        }
        for h in self.held.values() {
            match h.stage {
                Stage::Running => add(Some(h.trusted_until)),
                // With a commit in flight the commit's result drives the end, not the deadline.
                Stage::Stopping { deadline } if h.commit.is_none() => add(Some(deadline)),
                _ => {}
            }
        }
        if let Some(l) = &self.leader {
            add(Some(l.trusted_until));
            add(l.replan_at);
            if let PlanStage::RetryAt(t) = l.stage {
                add(Some(t));
            }
        }
        if let Some(l) = &self.leaving {
            add(Some(if l.deadline_passed { l.deadline + self.cfg.lease_duration } else { l.deadline }));
        }
        d
    }

    // ----- plumbing -----

    fn send(&mut self, bucket: Bucket, request: StoreRequest, pending: Pending) -> OpId {
        let op = OpId(self.next_op);
        self.next_op += 1;
        self.pending.insert(op, pending);
        self.out.push(Action::Store { op, bucket, request });
        op
    }

    fn retry_later(&mut self, now: Timestamp, bucket: Bucket, request: StoreRequest, pending: Pending) {
        let at = now + self.retry_backoff();
        self.retries.push(Retry { at, bucket, request, pending });
    }

    fn retry_backoff(&self) -> Duration {
        (self.cfg.heartbeat_interval() / 3).clamp(Duration::from_millis(50), Duration::from_secs(2))
    }

    fn event(&mut self, e: Event) {
        self.out.push(Action::Event(e));
    }

    fn fatal(&mut self, e: FatalError) {
        self.out.push(Action::Fatal(e));
        self.phase = Phase::Stopped;
        self.pending.clear();
        self.retries.clear();
    }

    fn ttl(&self) -> Option<Duration> {
        Some(self.cfg.lease_duration)
    }

    fn emit_gauges(&mut self) {
        if !matches!(self.phase, Phase::Running | Phase::Leaving) {
            return;
        }
        let g = (self.held.len() as u32, self.view.live_workers() as u32, self.view.quarantined as u32);
        if g != self.gauges {
            self.gauges = g;
            self.event(Event::Gauges { owned: g.0, live_workers: g.1, quarantined: g.2 });
        }
    }

    fn meta(&self) -> Meta {
        Meta {
            protocol_version: records::PROTOCOL_VERSION,
            fingerprint: self.cfg.fingerprint.clone(),
            max_attempts: self.cfg.max_attempts,
        }
    }

    fn presence_record(&self) -> PresenceRecord {
        PresenceRecord {
            incarnation: self.me.incarnation,
            held: self.held.len() as u32,
            capacity: self.cfg.max_in_flight,
        }
    }

    // ----- startup: P2 meta, P3 presence -----

    fn on_start(&mut self, _now: Timestamp) {
        if self.phase != Phase::Idle {
            return;
        }
        self.phase = Phase::Meta;
        let value = records::encode(&self.meta());
        self.send(
            Bucket::State,
            StoreRequest::Create { key: keys::meta(), value, ttl: None },
            Pending::MetaCreate,
        );
    }

    fn on_meta(&mut self, now: Timestamp, get: bool, result: StoreResult) {
        match result {
            Ok(StoreReply::Written(_)) => self.join(now),
            Ok(StoreReply::Value(Some(entry))) => match records::decode::<Meta>(&entry.value) {
                Ok(stored) if stored == self.meta() => self.join(now),
                Ok(stored) => self.fatal(FatalError::ConfigDivergence {
                    stored: stored.describe(),
                    local: self.meta().describe(),
                }),
                Err(e) => self.fatal(FatalError::CorruptMeta(e.to_string())),
            },
            // Absent after AlreadyExists/Indeterminate: create again.
            Ok(StoreReply::Value(None)) => self.on_start_retry(now),
            Err(StoreError::AlreadyExists(_)) | Err(StoreError::Indeterminate(_)) => {
                self.send(Bucket::State, StoreRequest::Get { key: keys::meta() }, Pending::MetaGet);
            }
            Err(e) if e.is_fatal() => self.fatal(FatalError::Store(e.to_string())),
            Err(_) => {
                let (request, pending) = if get {
                    (StoreRequest::Get { key: keys::meta() }, Pending::MetaGet)
                } else {
                    let value = records::encode(&self.meta());
                    (StoreRequest::Create { key: keys::meta(), value, ttl: None }, Pending::MetaCreate)
                };
                self.retry_later(now, Bucket::State, request, pending);
            }
            Ok(other) => unreachable!("unexpected reply to meta op: {other:?}"),
        }
    }

    fn on_start_retry(&mut self, now: Timestamp) {
        let value = records::encode(&self.meta());
        self.retry_later(
            now,
            Bucket::State,
            StoreRequest::Create { key: keys::meta(), value, ttl: None },
            Pending::MetaCreate,
        );
    }

    /// P2 passed: open the watches and announce presence.
    fn join(&mut self, now: Timestamp) {
        if self.phase != Phase::Meta {
            return;
        }
        self.phase = Phase::Joining;
        for w in WatchId::ALL {
            self.watches.insert(w, WatchState { ready: false, snapshot: Some(Vec::new()) });
            self.out.push(Action::Watch { watch: w });
        }
        self.create_presence(now);
    }

    fn create_presence(&mut self, now: Timestamp) {
        self.presence.join = Join::Creating;
        let value = records::encode(&self.presence_record());
        let request = StoreRequest::Create { key: keys::worker(&self.me.instance), value, ttl: self.ttl() };
        self.send(Bucket::Lease, request, Pending::PresenceCreate { sent: now });
    }

    fn presence_get(&mut self) {
        let key = keys::worker(&self.me.instance);
        self.send(Bucket::Lease, StoreRequest::Get { key }, Pending::PresenceGet);
    }

    fn presence_joined(&mut self, now: Timestamp, rev: Revision, sent: Timestamp) {
        self.presence.rev = Some(rev);
        self.presence.trusted_until = sent + self.cfg.lease_trust();
        if self.presence.join != Join::Joined {
            self.presence.join = Join::Joined;
            if self.phase == Phase::Joining {
                self.phase = Phase::Running;
                self.heartbeat_at = Some(now + self.cfg.heartbeat_interval());
                self.resync_at = Some(now + self.cfg.resync_interval());
            }
        }
    }

    fn on_presence_create(&mut self, now: Timestamp, sent: Timestamp, result: StoreResult) {
        match result {
            Ok(StoreReply::Written(rev)) => self.presence_joined(now, rev, sent),
            Err(StoreError::AlreadyExists(_)) | Err(StoreError::Indeterminate(_)) => self.presence_get(),
            Err(e) if e.is_fatal() => self.fatal(FatalError::Store(e.to_string())),
            Err(_) => {
                let value = records::encode(&self.presence_record());
                let request =
                    StoreRequest::Create { key: keys::worker(&self.me.instance), value, ttl: self.ttl() };
                self.retry_later(
                    now,
                    Bucket::Lease,
                    request,
                    Pending::PresenceCreate { sent: now + self.retry_backoff() },
                );
            }
            Ok(other) => unreachable!("unexpected reply to presence create: {other:?}"),
        }
    }

    fn on_presence_get(&mut self, now: Timestamp, result: StoreResult) {
        let entry = match result {
            Ok(StoreReply::Value(v)) => v,
            Err(e) if e.is_fatal() => return self.fatal(FatalError::Store(e.to_string())),
            Err(_) => {
                let key = keys::worker(&self.me.instance);
                return self.retry_later(now, Bucket::Lease, StoreRequest::Get { key }, Pending::PresenceGet);
            }
            Ok(other) => unreachable!("unexpected reply to presence get: {other:?}"),
        };
        let Some(entry) = entry else {
            // The predecessor's key expired meanwhile: create ours.
            return self.create_presence(now);
        };
        let Ok(rec) = records::decode::<PresenceRecord>(&entry.value) else {
            // Unreadable presence of our own id: treat as a dead predecessor.
            return self.takeover_presence(now, entry.revision);
        };
        if rec.incarnation == self.me.incarnation {
            // Our own create landed despite the error.
            return self.presence_joined(now, entry.revision, now - self.cfg.heartbeat_interval());
        }
        match self.presence.join {
            Join::Rechecking { rev, incarnation } => {
                if entry.revision == rev {
                    self.takeover_presence(now, rev);
                } else {
                    self.fatal(FatalError::DuplicateInstance {
                        instance: self.me.instance.to_string(),
                        other: if rec.incarnation.0 != incarnation { rec.incarnation.0 } else { incarnation },
                    });
                }
            }
            _ => {
                // P3: wait a heartbeat interval (and a half, for scheduling jitter) to see whether
                // the holder is alive.
                let wait = self.cfg.heartbeat_interval() + self.cfg.heartbeat_interval() / 2;
                self.presence.join = Join::Observing {
                    rev: entry.revision,
                    incarnation: rec.incarnation.0,
                    deadline: now + wait,
                };
            }
        }
    }

    fn takeover_presence(&mut self, now: Timestamp, rev: Revision) {
        self.presence.join = Join::TakingOver;
        let value = records::encode(&self.presence_record());
        let request = StoreRequest::CompareAndSwap {
            key: keys::worker(&self.me.instance),
            expected: rev,
            value,
            ttl: self.ttl(),
        };
        self.send(Bucket::Lease, request, Pending::PresenceTakeover { sent: now });
    }

    fn on_presence_takeover(&mut self, now: Timestamp, sent: Timestamp, result: StoreResult) {
        match result {
            Ok(StoreReply::Written(rev)) => self.presence_joined(now, rev, sent),
            // Renewed by a twin, or our own write landed: the read decides.
            Err(StoreError::RevisionMismatch(_)) | Err(StoreError::Indeterminate(_)) => {
                self.presence.join = Join::Creating;
                self.presence_get();
            }
            Err(e) if e.is_fatal() => self.fatal(FatalError::Store(e.to_string())),
            Err(_) => {
                self.presence.join = Join::Creating;
                let key = keys::worker(&self.me.instance);
                self.retry_later(now, Bucket::Lease, StoreRequest::Get { key }, Pending::PresenceGet);
            }
            Ok(other) => unreachable!("unexpected reply to presence takeover: {other:?}"),
        }
    }

    fn renew_presence(&mut self, now: Timestamp) {
        let Some(rev) = self.presence.rev else { return };
        if self.presence.renewing.is_some() {
            return;
        }
        let value = records::encode(&self.presence_record());
        let request = StoreRequest::CompareAndSwap {
            key: keys::worker(&self.me.instance),
            expected: rev,
            value,
            ttl: self.ttl(),
        };
        let op = self.send(Bucket::Lease, request, Pending::PresenceRenew { sent: now });
        self.presence.renewing = Some(op);
    }

    fn on_presence_renew(&mut self, now: Timestamp, sent: Timestamp, result: StoreResult) {
        self.presence.renewing = None;
        match result {
            Ok(StoreReply::Written(rev)) => {
                self.presence.rev = Some(rev);
                self.presence.trusted_until = sent + self.cfg.lease_trust();
            }
            Err(StoreError::RevisionMismatch(_)) | Err(StoreError::Indeterminate(_)) => {
                let key = keys::worker(&self.me.instance);
                let op =
                    self.send(Bucket::Lease, StoreRequest::Get { key }, Pending::PresenceResolve { sent });
                self.presence.renewing = Some(op);
            }
            Err(e) if e.is_fatal() => self.fatal(FatalError::Store(e.to_string())),
            Err(_) => {}
            Ok(other) => unreachable!("unexpected reply to presence renew: {other:?}"),
        }
        let _ = now;
    }

    fn on_presence_resolve(&mut self, now: Timestamp, sent: Timestamp, result: StoreResult) {
        self.presence.renewing = None;
        match result {
            Ok(StoreReply::Value(Some(entry))) => match records::decode::<PresenceRecord>(&entry.value) {
                Ok(rec) if rec.incarnation == self.me.incarnation => {
                    let applied = Some(entry.revision) != self.presence.rev;
                    self.presence.rev = Some(entry.revision);
                    if applied {
                        self.presence.trusted_until = sent + self.cfg.lease_trust();
                    }
                }
                Ok(rec) => self.fatal(FatalError::DuplicateInstance {
                    instance: self.me.instance.to_string(),
                    other: rec.incarnation.0,
                }),
                Err(_) => self.fatal(FatalError::DuplicateInstance {
                    instance: self.me.instance.to_string(),
                    other: 0,
                }),
            },
            // Our presence expired (store outage, long pause): announce again.
            Ok(StoreReply::Value(None)) => {
                self.presence.rev = None;
                let value = records::encode(&self.presence_record());
                let request =
                    StoreRequest::Create { key: keys::worker(&self.me.instance), value, ttl: self.ttl() };
                let op = self.send(Bucket::Lease, request, Pending::PresenceCreate { sent: now });
                self.presence.renewing = Some(op);
            }
            _ => {}
        }
    }

    /// A presence create while already running (after our key expired).
    fn on_presence_recreate(&mut self, now: Timestamp, sent: Timestamp, result: StoreResult) {
        self.presence.renewing = None;
        match result {
            Ok(StoreReply::Written(rev)) => self.presence_joined(now, rev, sent),
            Err(StoreError::AlreadyExists(_)) | Err(StoreError::Indeterminate(_)) => {
                let key = keys::worker(&self.me.instance);
                let op =
                    self.send(Bucket::Lease, StoreRequest::Get { key }, Pending::PresenceResolve { sent });
                self.presence.renewing = Some(op);
            }
            _ => {}
        }
    }

    // ----- ticks -----

    fn on_tick(&mut self, now: Timestamp) {
        // Delayed retries.
        let due: Vec<Retry> = {
            let (due, keep): (Vec<_>, Vec<_>) =
                std::mem::take(&mut self.retries).into_iter().partition(|r| r.at <= now);
            self.retries = keep;
            due
        };
        for r in due {
            if !self.retry_wanted(&r.pending) {
                continue;
            }
            let op = self.send(r.bucket, r.request, r.pending.clone());
            self.rebind_retry(op, &r.pending);
        }
        if let Join::Observing { rev, incarnation, deadline } = self.presence.join
            && now >= deadline
        {
            self.presence.join = Join::Rechecking { rev, incarnation };
            self.presence_get();
        }
        if self.heartbeat_at.is_some_and(|t| now >= t) {
            self.heartbeat_at = Some(now + self.cfg.heartbeat_interval());
            self.heartbeat(now);
        }
        if self.resync_at.is_some_and(|t| now >= t) {
            self.resync_at = Some(now + self.cfg.resync_interval());
            self.resync();
        }
        self.check_trust(now);
        self.check_stopping_deadlines(now);
        if let Some(l) = &mut self.leader {
            if l.replan_at.is_some_and(|t| now >= t) {
                l.replan_at = None;
                if matches!(l.stage, PlanStage::Idle) {
                    l.stage = PlanStage::WaitManifest;
                }
            }
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
    }

    /// Whether a delayed retry still belongs to a live step: the split may have been lost and
    /// re-acquired meanwhile (a new tenancy runs its own reads), or already moved on.
    fn retry_wanted(&self, pending: &Pending) -> bool {
        match pending {
            Pending::DescRead { split } => {
                self.held.get(split).is_some_and(|h| h.op.is_none() && h.stage == Stage::ReadingDesc)
            }
            Pending::RecordClaimRead { split } => {
                self.held.get(split).is_some_and(|h| h.op.is_none() && h.stage == Stage::WritingRecord)
            }
            _ => true,
        }
    }

    /// A retried op is the new current op of whatever it belongs to.
    fn rebind_retry(&mut self, op: OpId, pending: &Pending) {
        match pending {
            Pending::DescRead { split } | Pending::RecordClaimRead { split } => {
                if let Some(h) = self.held.get_mut(split) {
                    h.op = Some(op);
                }
            }
            _ => {}
        }
    }

    fn heartbeat(&mut self, now: Timestamp) {
        // Blocked claims and failed manifest loads get another chance every cycle.
        self.blocked.clear();
        if self.manifest_load.as_ref().is_some_and(|l| l.failed) {
            self.manifest_load = None;
        }
        if self.phase == Phase::Running || self.phase == Phase::Leaving {
            self.renew_presence(now);
        }
        if let Some(l) = &self.leader
            && l.renewing.is_none()
        {
            let value = records::encode(&LeaderRecord {
                owner: self.me.clone(),
                term: l.head.as_ref().map_or(0, |(_, h)| h.term),
            });
            let request =
                StoreRequest::CompareAndSwap { key: keys::leader(), expected: l.rev, value, ttl: self.ttl() };
            let op = self.send(Bucket::Lease, request, Pending::LeaderRenew { sent: now });
            self.leader.as_mut().expect("leader").renewing = Some(op);
        }
        let ids: Vec<SplitId> = self.held.keys().cloned().collect();
        for id in ids {
            self.renew_lease(now, &id);
        }
    }

    fn renew_lease(&mut self, now: Timestamp, id: &SplitId) {
        let Some(h) = self.held.get(id) else { return };
        let Some(rev) = h.lease_rev else { return };
        if h.renewing.is_some() || matches!(h.stage, Stage::DeletingLease | Stage::AcquiringLease) {
            return;
        }
        let value = records::encode(&LeaseRecord { owner: self.me.clone(), epoch: h.epoch });
        let request =
            StoreRequest::CompareAndSwap { key: keys::split(id), expected: rev, value, ttl: self.ttl() };
        let op = self.send(Bucket::Lease, request, Pending::LeaseRenew { split: id.clone(), sent: now });
        self.held.get_mut(id).expect("held").renewing = Some(op);
    }

    /// P11: a lease not renewed for a lease duration stops its lane (starved).
    fn check_trust(&mut self, now: Timestamp) {
        let starved: Vec<SplitId> = self
            .held
            .iter()
            .filter(|(_, h)| h.trusted_until <= now && h.lease_rev.is_some())
            .filter(|(_, h)| h.stage == Stage::Running)
            .map(|(id, _)| id.clone())
            .collect();
        for id in starved {
            let h = self.held.get_mut(&id).expect("held");
            h.stage = Stage::Starved;
            let epoch = h.epoch;
            self.out.push(Action::StopLane {
                split: id.clone(),
                epoch,
                reason: StopReason::Starved,
                deadline: None,
            });
            self.event(Event::Revoked { split: id, reason: StopReason::Starved });
        }
        if let Some(l) = &self.leader
            && l.trusted_until <= now
        {
            self.step_down();
        }
    }

    fn check_stopping_deadlines(&mut self, now: Timestamp) {
        let due: Vec<SplitId> = self
            .held
            .iter()
            .filter(|(_, h)| {
                h.commit.is_none() && matches!(h.stage, Stage::Stopping { deadline } if deadline <= now)
            })
            .map(|(id, _)| id.clone())
            .collect();
        for id in due {
            let end = self.held.get_mut(&id).and_then(|h| h.end.take()).unwrap_or(End::Release);
            self.begin_end(now, &id, end);
        }
        if let Some(l) = &mut self.leaving
            && now >= l.deadline
        {
            l.deadline_passed = true;
            // Past the drain deadline plus a lease: give up on what could not be released; the
            // leases expire by themselves.
            if now >= l.deadline + self.cfg.lease_duration {
                self.held.clear();
            }
        }
    }

    fn resync(&mut self) {
        for w in WatchId::ALL {
            let request = StoreRequest::List { prefix: w.prefix() };
            self.send(w.bucket(), request, Pending::Resync { watch: w });
        }
    }

    // ----- results -----

    fn on_store_result(&mut self, now: Timestamp, op: OpId, result: StoreResult) {
        let Some(pending) = self.pending.remove(&op) else { return };
        match pending {
            Pending::MetaCreate => self.on_meta(now, false, result),
            Pending::MetaGet => self.on_meta(now, true, result),
            Pending::PresenceCreate { sent } => {
                if self.presence.join == Join::Joined {
                    self.on_presence_recreate(now, sent, result)
                } else {
                    self.on_presence_create(now, sent, result)
                }
            }
            Pending::PresenceGet => self.on_presence_get(now, result),
            Pending::PresenceTakeover { sent } => self.on_presence_takeover(now, sent, result),
            Pending::PresenceRenew { sent } => self.on_presence_renew(now, sent, result),
            Pending::PresenceResolve { sent } => self.on_presence_resolve(now, sent, result),
            Pending::LeaderCreate { sent } => self.on_leader_create(now, op, sent, result),
            Pending::LeaderRenew { sent } => self.on_leader_renew(op, sent, result),
            Pending::LeaderResolve { sent } => self.on_leader_resolve(op, sent, result),
            // Results of an earlier leadership stint are stale: that stint is over.
            Pending::HeadWrite { stint, .. } | Pending::HeadRead { stint, .. }
                if Some(stint) != self.leader.as_ref().map(|l| l.stint) => {}
            Pending::HeadWrite { head, .. } => self.on_head_write(now, head, result),
            Pending::HeadRead { attempted, .. } => self.on_head_read(now, attempted, result),
            Pending::PlanWrite { round, key, value } => self.on_plan_write(now, round, key, value, result),
            Pending::ManifestChunk { manifest, chunk } => {
                self.on_manifest_chunk(now, manifest, chunk, result)
            }
            Pending::GcList => self.on_gc_list(result),
            Pending::Cleanup => {
                if let Some(l) = &mut self.leaving {
                    l.cleanup_outstanding = l.cleanup_outstanding.saturating_sub(1);
                }
            }
            Pending::LeaseAcquire { split, sent } => self.on_lease_acquire(now, op, split, sent, result),
            Pending::LeaseAcquireResolve { split, sent } => {
                self.on_lease_acquire_resolve(now, op, split, sent, result)
            }
            Pending::LeaseRenew { split, sent } => self.on_lease_renew(now, op, split, sent, result),
            Pending::LeaseRenewResolve { split, sent } => {
                self.on_lease_renew_resolve(now, op, split, sent, result)
            }
            Pending::LeaseDelete { split } => self.on_lease_delete(now, op, split, result),
            Pending::RecordClaim { split } => self.on_record_claim(now, op, split, result),
            Pending::RecordClaimRead { split } => self.on_record_claim_read(now, op, split, result),
            Pending::DescRead { split } => self.on_desc_read(now, op, split, result),
            Pending::RecordCommit { split } => self.on_record_commit(now, op, split, result),
            Pending::RecordCommitRead { split } => self.on_record_commit_read(now, op, split, result),
            Pending::RecordEnd { split } => self.on_record_end(now, op, split, result),
            Pending::RecordEndRead { split } => self.on_record_end_read(now, op, split, result),
            Pending::ResumeRead { split } => self.on_resume_read(now, op, split, result),
            Pending::Resync { watch } => {
                if let Ok(StoreReply::Entries(entries)) = result {
                    self.apply_snapshot(watch, entries);
                }
            }
        }
    }

    // ----- watches and the view -----

    fn on_watch_failed(&mut self, watch: WatchId) {
        if let Some(w) = self.watches.get_mut(&watch) {
            w.ready = false;
            w.snapshot = Some(Vec::new());
            self.out.push(Action::Watch { watch });
        }
    }

    fn on_watch(&mut self, now: Timestamp, watch: WatchId, event: WatchEvent) {
        let Some(ws) = self.watches.get_mut(&watch) else { return };
        if let Some(buf) = &mut ws.snapshot {
            match event {
                WatchEvent::Put(e) => buf.push(e),
                WatchEvent::Delete { key, .. } => buf.retain(|e| e.key != key),
                WatchEvent::SnapshotComplete => {
                    let entries = ws.snapshot.take().expect("snapshot");
                    ws.ready = true;
                    self.apply_snapshot(watch, entries);
                }
            }
            return;
        }
        match event {
            WatchEvent::Put(entry) => self.apply_put(now, watch, entry),
            WatchEvent::Delete { key, revision, cause } => {
                self.apply_delete(now, watch, key, revision, cause)
            }
            WatchEvent::SnapshotComplete => {}
        }
    }

    fn ready(&self) -> bool {
        WatchId::ALL.iter().all(|w| self.watches.get(w).is_some_and(|s| s.ready))
    }

    /// Replaces everything the view holds under `watch`'s scope with `entries`.
    fn apply_snapshot(&mut self, watch: WatchId, entries: Vec<Entry>) {
        let present: BTreeSet<Key> = entries.iter().map(|e| e.key.clone()).collect();
        match watch {
            WatchId::Leases => {
                let gone: Vec<SplitId> = self
                    .view
                    .splits
                    .iter()
                    .filter(|(id, sv)| sv.lease.is_some() && !present.contains(&keys::split(id)))
                    .map(|(id, _)| id.clone())
                    .collect();
                for id in gone {
                    self.view.forget_lease(&id);
                }
                self.view.workers.retain(|id, _| present.contains(&keys::worker(id)));
                if !present.contains(&keys::leader()) {
                    self.view.leader = None;
                }
            }
            WatchId::Splits => {
                let gone: Vec<SplitId> = self
                    .view
                    .splits
                    .iter()
                    .filter(|(id, sv)| sv.record.is_some() && !present.contains(&keys::split(id)))
                    .map(|(id, _)| id.clone())
                    .collect();
                for id in gone {
                    self.view.forget_record(&id);
                }
            }
            WatchId::Plan => {
                if !present.contains(&keys::plan_head()) {
                    self.view.plan_head = None;
                }
            }
        }
        for e in entries {
            self.apply_entry(watch, e);
        }
    }

    fn apply_entry(&mut self, watch: WatchId, entry: Entry) {
        let key = entry.key.clone();
        let undecodable = |w: &mut Self, err: records::RecordError| {
            w.event(Event::Undecodable { key: key.to_string(), error: err.to_string() })
        };
        match watch {
            WatchId::Leases => {
                if let Some(id) = keys::parse_split(&entry.key) {
                    match records::decode::<LeaseRecord>(&entry.value) {
                        Ok(l) => self.view.put_lease(&id, entry.revision, l),
                        Err(e) => undecodable(self, e),
                    }
                } else if let Some(inst) = keys::parse_worker(&entry.key) {
                    match records::decode::<PresenceRecord>(&entry.value) {
                        Ok(p) => {
                            let newer =
                                self.view.workers.get(&inst).is_none_or(|(r, _)| *r <= entry.revision);
                            if newer {
                                self.view.workers.insert(inst, (entry.revision, p));
                            }
                        }
                        Err(e) => undecodable(self, e),
                    }
                } else if entry.key == keys::leader() {
                    match records::decode::<LeaderRecord>(&entry.value) {
                        Ok(l) => {
                            if self.view.leader.as_ref().is_none_or(|(r, _)| *r <= entry.revision) {
                                self.view.leader = Some((entry.revision, l));
                            }
                        }
                        Err(e) => undecodable(self, e),
                    }
                }
            }
            WatchId::Splits => {
                if let Some(id) = keys::parse_split(&entry.key) {
                    match records::decode::<SplitRecord>(&entry.value) {
                        Ok(r) => self.view.put_record(&id, entry.revision, r),
                        Err(e) => undecodable(self, e),
                    }
                }
            }
            WatchId::Plan => {
                if entry.key == keys::plan_head() {
                    match records::decode::<PlanHead>(&entry.value) {
                        Ok(h) => {
                            if self.view.plan_head.as_ref().is_none_or(|(r, _)| *r <= entry.revision) {
                                self.view.plan_head = Some((entry.revision, h));
                            }
                        }
                        Err(e) => undecodable(self, e),
                    }
                }
            }
        }
    }

    fn apply_put(&mut self, _now: Timestamp, watch: WatchId, entry: Entry) {
        let key = entry.key.clone();
        let rev = entry.revision;
        self.apply_entry(watch, entry);
        match watch {
            WatchId::Leases => {
                if let Some(id) = keys::parse_split(&key) {
                    self.blocked.remove(&id);
                    // P7: our lease now names someone else at a newer revision: fenced.
                    let foreign = self
                        .view
                        .splits
                        .get(&id)
                        .and_then(|sv| sv.lease.as_ref())
                        .is_some_and(|l| l.owner != self.me);
                    if foreign && self.held.get(&id).is_some_and(|h| h.lease_rev.is_some_and(|r| r < rev)) {
                        self.revoke(&id, StopReason::Fenced);
                    }
                } else if keys::parse_worker(&key).as_ref() == Some(&self.me.instance) {
                    self.check_own_presence(rev);
                } else if key == keys::leader()
                    && self.leader.as_ref().is_some_and(|l| l.rev < rev)
                    && self.view.leader.as_ref().is_some_and(|(_, l)| l.owner != self.me)
                {
                    self.step_down();
                }
            }
            WatchId::Splits => {
                if let Some(id) = keys::parse_split(&key) {
                    self.blocked.remove(&id);
                    let record = self.view.splits.get(&id).and_then(|sv| sv.record.clone());
                    if let (Some(h), Some(r)) = (self.held.get(&id), record) {
                        let written = matches!(
                            h.stage,
                            Stage::Running | Stage::ReadingDesc | Stage::Starved | Stage::Stopping { .. }
                        );
                        // Only an ownership change bumps the epoch or names another owner; our
                        // own terminal commit clears the owner at the same epoch.
                        let moved = r.epoch != h.epoch || r.owner.as_ref().is_some_and(|o| *o != self.me);
                        if written && moved && rev > h.record_rev {
                            self.revoke(&id, StopReason::Fenced);
                        }
                    }
                }
            }
            WatchId::Plan => {}
        }
    }

    fn check_own_presence(&mut self, rev: Revision) {
        let Some((_, rec)) = self.view.workers.get(&self.me.instance) else { return };
        if rec.incarnation == self.me.incarnation {
            return;
        }
        let other = rec.incarnation.0;
        match self.presence.join {
            // While observing, a renewal by the holder proves a live twin.
            Join::Observing { rev: seen, .. } | Join::Rechecking { rev: seen, .. } if rev > seen => {
                self.fatal(FatalError::DuplicateInstance { instance: self.me.instance.to_string(), other });
            }
            Join::Joined if self.presence.rev.is_some_and(|r| r < rev) => {
                self.fatal(FatalError::DuplicateInstance { instance: self.me.instance.to_string(), other });
            }
            _ => {}
        }
    }

    fn apply_delete(
        &mut self,
        _now: Timestamp,
        watch: WatchId,
        key: Key,
        rev: Revision,
        _cause: DeleteCause,
    ) {
        match watch {
            WatchId::Leases => {
                if let Some(id) = keys::parse_split(&key) {
                    self.view.delete_lease(&id, rev);
                    self.blocked.remove(&id);
                    // P7 (NATS-NOTES): an expiry can erase an acknowledged renewal. A delete of our
                    // own lease at a revision newer than our last write means the lease is gone.
                    if self.held.get(&id).is_some_and(|h| {
                        h.lease_rev.is_some_and(|r| r < rev) && h.stage != Stage::DeletingLease
                    }) {
                        self.revoke(&id, StopReason::Fenced);
                    }
                } else if let Some(inst) = keys::parse_worker(&key) {
                    if self.view.workers.get(&inst).is_some_and(|(r, _)| *r < rev) {
                        self.view.workers.remove(&inst);
                    }
                } else if key == keys::leader() && self.view.leader.as_ref().is_some_and(|(r, _)| *r < rev) {
                    self.view.leader = None;
                    if self.leader.as_ref().is_some_and(|l| l.rev < rev) {
                        self.step_down();
                    }
                }
            }
            WatchId::Splits => {
                if let Some(id) = keys::parse_split(&key) {
                    self.view.delete_record(&id, rev);
                }
            }
            WatchId::Plan => {
                if key == keys::plan_head() && self.view.plan_head.as_ref().is_some_and(|(r, _)| *r < rev) {
                    self.view.plan_head = None;
                }
            }
        }
    }

    /// Stops a lane whose ownership is gone and forgets the split.
    fn revoke(&mut self, id: &SplitId, reason: StopReason) {
        let Some(h) = self.held.remove(id) else { return };
        let lane_running = matches!(h.stage, Stage::Running | Stage::Stopping { .. });
        if lane_running {
            self.out.push(Action::StopLane { split: id.clone(), epoch: h.epoch, reason, deadline: None });
        }
        if let Some(c) = h.commit {
            self.pending.remove(&c.op);
            self.out.push(Action::CommitDone {
                split: id.clone(),
                epoch: h.epoch,
                outcome: CommitOutcome::Lost,
            });
        }
        if lane_running || h.stage == Stage::Starved {
            self.event(Event::Revoked { split: id.clone(), reason });
        }
        self.blocked.insert(id.clone());
    }

    // ----- evaluation: completion, leadership, claims, steals -----

    fn evaluate(&mut self, now: Timestamp) {
        if self.phase == Phase::Leaving {
            self.progress_leaving(now);
            return;
        }
        if !self.ready() || self.presence.join != Join::Joined {
            return;
        }
        self.load_manifest();
        if let Some(outcome) = self.completion() {
            self.leave(now, outcome);
            return;
        }
        self.leadership(now);
        self.acquire(now);
    }

    /// P13: completion as seen by every worker, including idle standbys.
    fn completion(&self) -> Option<Outcome> {
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
        #[cfg(feature = "mutations")]
        if self.cfg.mutations.complete_with_quarantined {
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

    fn load_manifest(&mut self) {
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

    fn on_manifest_chunk(&mut self, now: Timestamp, manifest: ManifestRef, chunk: u32, result: StoreResult) {
        let Some(load) = &mut self.manifest_load else { return };
        if load.manifest != manifest || load.failed {
            return;
        }
        match result {
            Ok(StoreReply::Value(Some(entry))) => match records::decode::<ManifestChunk>(&entry.value) {
                Ok(c) => {
                    load.chunks.insert(chunk, c.splits);
                    load.outstanding -= 1;
                }
                Err(e) => {
                    load.failed = true;
                    self.event(Event::Undecodable { key: entry.key.to_string(), error: e.to_string() });
                }
            },
            // Garbage-collected under us: a newer manifest replaced it; the head will tell.
            Ok(StoreReply::Value(None)) => load.failed = true,
            Err(_) => {
                let key = keys::manifest(manifest.term, manifest.version, chunk);
                self.retry_later(
                    now,
                    Bucket::State,
                    StoreRequest::Get { key },
                    Pending::ManifestChunk { manifest, chunk },
                );
            }
            Ok(other) => unreachable!("unexpected reply to manifest get: {other:?}"),
        }
        let Some(load) = &self.manifest_load else { return };
        if load.outstanding == 0 && !load.failed {
            let load = self.manifest_load.take().expect("load");
            let entries: Vec<(SplitId, u64)> = load.chunks.into_values().flatten().collect();
            self.view.set_manifest(load.manifest, entries);
        }
    }

    /// The number of splits this worker aims to hold (P5).
    fn target(&self) -> usize {
        let live = self.view.live_workers().max(1);
        let fair = self.view.active().div_ceil(live);
        fair.min(self.cfg.max_in_flight as usize)
    }

    fn acquire(&mut self, now: Timestamp) {
        if self.view.manifest.is_none() {
            return;
        }
        let max = self.cfg.max_in_flight as usize;
        // P3: reclaim what our previous incarnation held, at once, up to capacity.
        let reclaim: Vec<SplitId> = self
            .view
            .old_incarnation
            .iter()
            .filter(|id| !self.held.contains_key(*id) && !self.blocked.contains(*id))
            .take(max.saturating_sub(self.held.len()))
            .cloned()
            .collect();
        for id in reclaim {
            self.start_acquire(now, &id, AcquisitionReason::Reclaimed);
        }
        let target = self.target();
        if self.held.len() >= target {
            return;
        }
        let mut want = target - self.held.len();
        let mut picks = Vec::new();
        for (_, id) in &self.view.claimable {
            if want == 0 {
                break;
            }
            if self.held.contains_key(id) || self.blocked.contains(id) {
                continue;
            }
            picks.push(id.clone());
            want -= 1;
        }
        let claimed_any = !picks.is_empty();
        for id in picks {
            let reason = self.claim_reason(&id);
            self.start_acquire(now, &id, reason);
        }
        let nothing_unclaimed = self.view.claimable.iter().all(|(_, id)| self.held.contains_key(id));
        if !claimed_any && want > 0 && nothing_unclaimed {
            self.maybe_steal(now);
        }
    }

    fn claim_reason(&self, id: &SplitId) -> AcquisitionReason {
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

    /// P9: one steal per cycle from the most-loaded owner, only if it holds >= 2 more.
    fn maybe_steal(&mut self, now: Timestamp) {
        if self.held.values().any(|h| {
            h.reason == AcquisitionReason::Stolen && h.stage != Stage::Running && h.stage != Stage::Starved
        }) {
            return;
        }
        if self.last_steal_at.is_some_and(|t| now < t + self.cfg.heartbeat_interval()) {
            return;
        }
        let mine = self.held.len() as u32;
        let victim = self
            .view
            .lease_counts
            .iter()
            .filter(|(inst, _)| **inst != self.me.instance)
            // Most loaded first; ties broken by the smaller instance id (deterministic).
            .max_by(|a, b| a.1.cmp(b.1).then_with(|| b.0.cmp(a.0)))
            .map(|(inst, n)| (inst.clone(), *n));
        let Some((victim, count)) = victim else { return };
        #[cfg(feature = "mutations")]
        let margin = if self.cfg.mutations.steal_without_margin { 1 } else { 2 };
        #[cfg(not(feature = "mutations"))]
        let margin = 2;
        if count < mine + margin {
            return;
        }
        let pick = self
            .view
            .splits
            .iter()
            .filter(|(id, sv)| {
                sv.weight.is_some()
                    && !self.blocked.contains(*id)
                    && sv.lease.as_ref().is_some_and(|l| l.owner.instance == victim)
                    && sv.record.as_ref().is_some_and(|r| r.state == SplitState::Owned)
            })
            .map(|(id, _)| id.clone())
            .next();
        if let Some(id) = pick {
            self.last_steal_at = Some(now);
            self.start_acquire(now, &id, AcquisitionReason::Stolen);
        }
    }

    /// Starts an acquisition (P5, P6, P9): the lease first (create; or CAS over the dead
    /// incarnation's lease for a reclaim, over the victim's for a steal), then the fenced record
    /// CAS. A steal is only planned on a consistent view (lease and record name the same owner
    /// and epoch); its lease CAS at the viewed revision then proves the record is still at that
    /// epoch, because every epoch bump needs the lease first.
    fn start_acquire(&mut self, now: Timestamp, id: &SplitId, reason: AcquisitionReason) {
        let Some(sv) = self.view.splits.get(id) else { return };
        let Some(base) = sv.record.clone() else { return };
        let Some(weight) = sv.weight else { return };
        if base.is_terminal() {
            return;
        }
        let base_rev = sv.record_rev;
        let epoch = base.epoch.next();
        let value = records::encode(&LeaseRecord { owner: self.me.clone(), epoch });
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
        // The previous tenancy ended without a release: poison evidence (P12), unless it was this
        // very process (a starved lease of our own).
        let consumes_attempt = match reason {
            AcquisitionReason::Expired => base.owner.as_ref() != Some(&self.me),
            AcquisitionReason::Reclaimed => true,
            _ => false,
        };
        self.held.insert(
            id.clone(),
            Held {
                epoch,
                weight,
                reason,
                consumes_attempt,
                base: base.clone(),
                record: base,
                record_rev: base_rev,
                lease_rev: None,
                trusted_until: now + self.cfg.lease_trust(),
                renewing: None,
                stage: Stage::AcquiringLease,
                op: None,
                commit: None,
                end: None,
                target: None,
                resumed: false,
            },
        );
        let op = self.send(Bucket::Lease, request, Pending::LeaseAcquire { split: id.clone(), sent: now });
        self.held.get_mut(id).expect("held").op = Some(op);
    }

    fn abandon(&mut self, id: &SplitId) {
        // Give back a lease we hold but cannot use; best effort (it expires anyway).
        if let Some(h) = self.held.remove(id)
            && let Some(rev) = h.lease_rev
        {
            self.send(
                Bucket::Lease,
                StoreRequest::Delete { key: keys::split(id), expected: rev },
                Pending::Cleanup,
            );
            if let Some(l) = &mut self.leaving {
                l.cleanup_outstanding += 1;
            }
        }
        self.blocked.insert(id.clone());
    }

    fn is_current(&self, id: &SplitId, op: OpId) -> bool {
        self.held.get(id).is_some_and(|h| h.op == Some(op))
    }

    fn on_lease_acquire(
        &mut self,
        now: Timestamp,
        op: OpId,
        id: SplitId,
        sent: Timestamp,
        result: StoreResult,
    ) {
        if !self.is_current(&id, op) {
            // A late success for something we gave up: release it.
            if let Ok(StoreReply::Written(rev)) = result {
                self.send(
                    Bucket::Lease,
                    StoreRequest::Delete { key: keys::split(&id), expected: rev },
                    Pending::Cleanup,
                );
            }
            return;
        }
        match result {
            Ok(StoreReply::Written(rev)) => self.lease_acquired(now, &id, rev, sent),
            Err(e) if e.is_fatal() => self.fatal(FatalError::Store(e.to_string())),
            // In doubt: the read decides.
            Err(StoreError::Indeterminate(_)) => {
                let request = StoreRequest::Get { key: keys::split(&id) };
                let op = self.send(
                    Bucket::Lease,
                    request,
                    Pending::LeaseAcquireResolve { split: id.clone(), sent },
                );
                self.held.get_mut(&id).expect("held").op = Some(op);
            }
            // Lost the race (AlreadyExists / RevisionMismatch) or the store is down: not an error.
            Err(_) => self.give_up_acquire(&id),
            Ok(other) => unreachable!("unexpected reply to lease acquire: {other:?}"),
        }
    }

    fn on_lease_acquire_resolve(
        &mut self,
        now: Timestamp,
        op: OpId,
        id: SplitId,
        sent: Timestamp,
        result: StoreResult,
    ) {
        if !self.is_current(&id, op) {
            return;
        }
        let epoch = self.held[&id].epoch;
        let mine = match &result {
            Ok(StoreReply::Value(Some(e))) => records::decode::<LeaseRecord>(&e.value)
                .ok()
                .filter(|l| l.owner == self.me && l.epoch == epoch)
                .map(|_| e.revision),
            _ => None,
        };
        match mine {
            Some(rev) => self.lease_acquired(now, &id, rev, sent),
            None => self.give_up_acquire(&id),
        }
    }

    fn give_up_acquire(&mut self, id: &SplitId) {
        self.held.remove(id);
        self.blocked.insert(id.clone());
    }

    fn lease_acquired(&mut self, now: Timestamp, id: &SplitId, rev: Revision, sent: Timestamp) {
        let me = self.me.clone();
        let h = self.held.get_mut(id).expect("held");
        h.lease_rev = Some(rev);
        h.trusted_until = sent + self.cfg.lease_trust();
        let epoch = h.epoch;
        self.view.put_lease(id, rev, LeaseRecord { owner: me, epoch });
        let displaced = matches!(
            h_reason(&self.held, id),
            Some(AcquisitionReason::Stolen | AcquisitionReason::Reclaimed)
        );
        if self.phase == Phase::Leaving && !displaced {
            // Draining meanwhile: nobody held this lease, so give it back untouched.
            return self.abandon(id);
        }
        // A steal or reclaim displaced a live lease: finish the takeover so the record never
        // names an owner without a lease (a peer would charge an attempt for it); a drain then
        // releases it gracefully.
        self.write_claim(now, id);
    }

    fn claim_record(&self, h: &Held) -> SplitRecord {
        let base = &h.base;
        let attempts = base.attempts + u32::from(h.consumes_attempt);
        let last_end = match h.reason {
            AcquisitionReason::Expired if h.consumes_attempt => Some(EndReason::Expired),
            AcquisitionReason::Reclaimed => Some(EndReason::Reclaimed),
            AcquisitionReason::Stolen => Some(EndReason::Stolen),
            _ => base.last_end,
        };
        let last_error = if h.consumes_attempt {
            let who = base.owner.as_ref().map_or_else(|| "unknown owner".to_owned(), |o| o.to_string());
            Some(format!("tenancy of {who} ended without a release ({})", h.reason.label()))
        } else {
            base.last_error.clone()
        };
        if attempts >= self.cfg.max_attempts && h.consumes_attempt {
            // P12: quarantine instead of claiming.
            return SplitRecord {
                epoch: h.epoch,
                owner: None,
                state: SplitState::Quarantined,
                progress: base.progress.clone(),
                attempts,
                last_end,
                last_error,
            };
        }
        SplitRecord {
            epoch: h.epoch,
            owner: Some(self.me.clone()),
            state: SplitState::Owned,
            progress: base.progress.clone(),
            attempts,
            last_end,
            last_error,
        }
    }

    fn write_claim(&mut self, _now: Timestamp, id: &SplitId) {
        let h = &self.held[id];
        let record = self.claim_record(h);
        let request = StoreRequest::CompareAndSwap {
            key: keys::split(id),
            expected: h.record_rev,
            value: records::encode(&record),
            ttl: None,
        };
        let op = self.send(Bucket::State, request, Pending::RecordClaim { split: id.clone() });
        let h = self.held.get_mut(id).expect("held");
        h.record = record;
        h.stage = Stage::WritingRecord;
        h.op = Some(op);
    }

    fn on_record_claim(&mut self, now: Timestamp, op: OpId, id: SplitId, result: StoreResult) {
        if !self.is_current(&id, op) {
            return;
        }
        match result {
            Ok(StoreReply::Written(rev)) => self.claim_written(now, &id, rev),
            Err(StoreError::RevisionMismatch(_)) | Err(StoreError::Indeterminate(_)) => {
                let op = self.send(
                    Bucket::State,
                    StoreRequest::Get { key: keys::split(&id) },
                    Pending::RecordClaimRead { split: id.clone() },
                );
                self.held.get_mut(&id).expect("held").op = Some(op);
            }
            Err(e) if e.is_fatal() => self.fatal(FatalError::Store(e.to_string())),
            Err(_) => {
                let op_req = StoreRequest::Get { key: keys::split(&id) };
                self.held.get_mut(&id).expect("held").op = None;
                self.retry_later(now, Bucket::State, op_req, Pending::RecordClaimRead { split: id });
            }
            Ok(other) => unreachable!("unexpected reply to record claim: {other:?}"),
        }
    }

    fn on_record_claim_read(&mut self, now: Timestamp, op: OpId, id: SplitId, result: StoreResult) {
        if !self.is_current(&id, op) {
            return;
        }
        let entry = match result {
            Ok(StoreReply::Value(Some(e))) => e,
            Ok(StoreReply::Value(None)) => return self.abandon(&id),
            Err(_) => {
                self.held.get_mut(&id).expect("held").op = None;
                return self.retry_later(
                    now,
                    Bucket::State,
                    StoreRequest::Get { key: keys::split(&id) },
                    Pending::RecordClaimRead { split: id },
                );
            }
            Ok(other) => unreachable!("unexpected reply to record read: {other:?}"),
        };
        let Ok(rec) = records::decode::<SplitRecord>(&entry.value) else { return self.abandon(&id) };
        let h = self.held.get_mut(&id).expect("held");
        if rec == h.record {
            // Our own write landed.
            return self.claim_written(now, &id, entry.revision);
        }
        // Still at the epoch we set out to replace: the previous owner committed (or ended its
        // tenancy) meanwhile, which moves the revision but not the epoch. We hold the lease, so
        // nobody else can bump the epoch: retry against the fresh revision, from the fresh record
        // (its progress is the latest durable one). The CAS still fences.
        if rec.epoch == h.base.epoch && !rec.is_terminal() {
            if rec.state == SplitState::Unleased {
                // The previous owner released (or failed) it gracefully after all.
                h.consumes_attempt = false;
                if h.reason != AcquisitionReason::Stolen {
                    h.reason = AcquisitionReason::Released;
                }
            }
            h.base = rec;
            h.record_rev = entry.revision;
            return self.write_claim(now, &id);
        }
        self.view.put_record(&id, entry.revision, rec);
        self.abandon(&id);
    }

    fn claim_written(&mut self, now: Timestamp, id: &SplitId, rev: Revision) {
        let h = self.held.get_mut(id).expect("held");
        h.record_rev = rev;
        let record = h.record.clone();
        self.view.put_record(id, rev, record.clone());
        if record.state == SplitState::Quarantined {
            self.event(Event::Quarantined {
                split: id.clone(),
                attempts: record.attempts,
                last_error: record.last_error,
            });
            return self.delete_lease(id);
        }
        self.start_lane_setup(now, id);
    }

    /// Both the lease and the record are ours: announce the acquisition and fetch the
    /// descriptor for the lane.
    fn start_lane_setup(&mut self, now: Timestamp, id: &SplitId) {
        let h = &self.held[id];
        let (reason, epoch) = (h.reason, h.epoch);
        self.event(Event::Acquired { split: id.clone(), reason, epoch });
        if self.phase == Phase::Leaving {
            return self.begin_end(now, id, End::Release);
        }
        let op = self.send(
            Bucket::State,
            StoreRequest::Get { key: keys::desc(id) },
            Pending::DescRead { split: id.clone() },
        );
        let h = self.held.get_mut(id).expect("held");
        h.stage = Stage::ReadingDesc;
        h.op = Some(op);
    }

    fn on_desc_read(&mut self, now: Timestamp, op: OpId, id: SplitId, result: StoreResult) {
        if !self.is_current(&id, op) {
            return;
        }
        match result {
            Ok(StoreReply::Value(Some(e))) => match records::decode::<Descriptor>(&e.value) {
                Ok(d) => {
                    if self.phase == Phase::Leaving {
                        return self.begin_end(now, &id, End::Release);
                    }
                    let h = self.held.get_mut(&id).expect("held");
                    if h.trusted_until <= now {
                        // P11: the lease may be gone (we were paused or cut off): never start a
                        // lane unfenced. Renewals decide whether it resumes.
                        h.stage = Stage::Starved;
                        h.op = None;
                        h.resumed = true;
                        return;
                    }
                    h.stage = Stage::Running;
                    h.op = None;
                    let action = Action::StartLane {
                        split: id.clone(),
                        epoch: h.epoch,
                        descriptor: d.descriptor,
                        weight: h.weight,
                        progress: h.record.progress.clone(),
                        reason: (!h.resumed).then_some(h.reason),
                    };
                    h.resumed = false;
                    self.out.push(action);
                }
                Err(err) => {
                    self.event(Event::Undecodable { key: e.key.to_string(), error: err.to_string() });
                    self.begin_end(
                        now,
                        &id,
                        End::Fail { error: format!("undecodable descriptor: {err}"), unprocessable: true },
                    );
                }
            },
            Ok(StoreReply::Value(None)) => {
                self.begin_end(
                    now,
                    &id,
                    End::Fail { error: "descriptor missing from the store".into(), unprocessable: true },
                );
            }
            Err(_) => {
                self.held.get_mut(&id).expect("held").op = None;
                self.retry_later(
                    now,
                    Bucket::State,
                    StoreRequest::Get { key: keys::desc(&id) },
                    Pending::DescRead { split: id },
                );
            }
            Ok(other) => unreachable!("unexpected reply to desc read: {other:?}"),
        }
    }

    // ----- heartbeats of held leases (P7, P11) -----

    fn on_lease_renew(
        &mut self,
        now: Timestamp,
        op: OpId,
        id: SplitId,
        sent: Timestamp,
        result: StoreResult,
    ) {
        let Some(h) = self.held.get_mut(&id) else {
            if let Ok(StoreReply::Written(rev)) = result {
                self.send(
                    Bucket::Lease,
                    StoreRequest::Delete { key: keys::split(&id), expected: rev },
                    Pending::Cleanup,
                );
            }
            return;
        };
        if h.renewing != Some(op) {
            return;
        }
        h.renewing = None;
        match result {
            Ok(StoreReply::Written(rev)) => self.lease_renewed(now, &id, rev, sent),
            Err(StoreError::RevisionMismatch(_)) | Err(StoreError::Indeterminate(_)) => {
                let op = self.send(
                    Bucket::Lease,
                    StoreRequest::Get { key: keys::split(&id) },
                    Pending::LeaseRenewResolve { split: id.clone(), sent },
                );
                self.held.get_mut(&id).expect("held").renewing = Some(op);
            }
            Err(e) if e.is_fatal() => self.fatal(FatalError::Store(e.to_string())),
            Err(_) => self.after_renewal(now, &id),
            Ok(other) => unreachable!("unexpected reply to lease renew: {other:?}"),
        }
    }

    fn on_lease_renew_resolve(
        &mut self,
        now: Timestamp,
        op: OpId,
        id: SplitId,
        sent: Timestamp,
        result: StoreResult,
    ) {
        let Some(h) = self.held.get_mut(&id) else { return };
        if h.renewing != Some(op) {
            return;
        }
        h.renewing = None;
        let epoch = h.epoch;
        let known = h.lease_rev;
        match result {
            Ok(StoreReply::Value(Some(e))) => match records::decode::<LeaseRecord>(&e.value) {
                Ok(l) if l.owner == self.me && l.epoch == epoch => {
                    if Some(e.revision) != known {
                        self.lease_renewed(now, &id, e.revision, sent);
                    } else {
                        self.after_renewal(now, &id);
                    }
                }
                _ => self.revoke(&id, StopReason::Fenced),
            },
            Ok(StoreReply::Value(None)) => self.revoke(&id, StopReason::Fenced),
            _ => self.after_renewal(now, &id),
        }
    }

    fn lease_renewed(&mut self, now: Timestamp, id: &SplitId, rev: Revision, sent: Timestamp) {
        let me = self.me.clone();
        let h = self.held.get_mut(id).expect("held");
        h.lease_rev = Some(rev);
        h.trusted_until = h.trusted_until.max(sent + self.cfg.lease_trust());
        let epoch = h.epoch;
        self.view.put_lease(id, rev, LeaseRecord { owner: me, epoch });
        let h = self.held.get_mut(id).expect("held");
        if h.stage == Stage::Starved && h.trusted_until > now && h.op.is_none() {
            // P11: the store came back and the lease is still ours. Re-read the record first: a
            // commit whose outcome was in doubt may have landed, and the lane must resume from
            // what is durable (resuming from an older copy would let it regress progress, I1).
            let op = self.send(
                Bucket::State,
                StoreRequest::Get { key: keys::split(id) },
                Pending::ResumeRead { split: id.clone() },
            );
            self.held.get_mut(id).expect("held").op = Some(op);
        }
        self.after_renewal(now, id);
    }

    /// Work that waited for an in-flight renewal.
    fn after_renewal(&mut self, now: Timestamp, id: &SplitId) {
        if self.held.get(id).is_some_and(|h| h.stage == Stage::DeletingLease && h.op.is_none()) {
            self.delete_lease(id);
        }
        let _ = now;
    }

    // ----- commits (P8) -----

    fn on_commit(&mut self, now: Timestamp, id: SplitId, epoch: Epoch, progress: Bytes, terminal: bool) {
        let reply =
            |w: &mut Self, outcome| w.out.push(Action::CommitDone { split: id.clone(), epoch, outcome });
        let Some(h) = self.held.get(&id) else { return reply(self, CommitOutcome::Lost) };
        if h.epoch != epoch {
            return reply(self, CommitOutcome::Lost);
        }
        if h.stage == Stage::Starved {
            // This lane was stopped (P11); a resumed lane is a new lane.
            return reply(self, CommitOutcome::Lost);
        }
        if !matches!(h.stage, Stage::Running | Stage::Stopping { .. }) || h.commit.is_some() {
            return reply(self, CommitOutcome::Retryable);
        }
        let mut record = h.record.clone();
        record.progress = Some(progress.clone());
        if terminal {
            record.state = SplitState::Done;
            record.owner = None;
            record.last_end = Some(EndReason::Finished);
        }
        #[cfg(feature = "mutations")]
        if self.cfg.mutations.unfenced_commit {
            // The tempting variant: read the record, then CAS against what was read.
            let op = self.send(
                Bucket::State,
                StoreRequest::Get { key: keys::split(&id) },
                Pending::RecordCommitRead { split: id.clone() },
            );
            self.held.get_mut(&id).expect("held").commit =
                Some(CommitInFlight { op, progress, terminal, unfenced_read: true });
            return;
        }
        let request = StoreRequest::CompareAndSwap {
            key: keys::split(&id),
            expected: h.record_rev,
            value: records::encode(&record),
            ttl: None,
        };
        let op = self.send(Bucket::State, request, Pending::RecordCommit { split: id.clone() });
        self.held.get_mut(&id).expect("held").commit = Some(CommitInFlight {
            op,
            progress,
            terminal,
            #[cfg(feature = "mutations")]
            unfenced_read: false,
        });
        let _ = now;
    }

    fn commit_record(&self, h: &Held, c: &CommitInFlight) -> SplitRecord {
        let mut record = h.record.clone();
        record.progress = Some(c.progress.clone());
        if c.terminal {
            record.state = SplitState::Done;
            record.owner = None;
            record.last_end = Some(EndReason::Finished);
        }
        record
    }

    fn on_record_commit(&mut self, now: Timestamp, op: OpId, id: SplitId, result: StoreResult) {
        let Some(h) = self.held.get(&id) else { return };
        let Some(c) = h.commit.clone().filter(|c| c.op == op) else { return };
        match result {
            Ok(StoreReply::Written(rev)) => self.commit_applied(now, &id, rev),
            // P8: the outcome is decided by re-reading, never assumed.
            Err(StoreError::RevisionMismatch(_)) | Err(StoreError::Indeterminate(_)) => {
                let op = self.send(
                    Bucket::State,
                    StoreRequest::Get { key: keys::split(&id) },
                    Pending::RecordCommitRead { split: id.clone() },
                );
                self.held.get_mut(&id).expect("held").commit = Some(CommitInFlight { op, ..c });
            }
            Err(e) => {
                self.finish_commit(now, &id, CommitOutcome::Retryable);
                if e.is_fatal() {
                    self.fatal(FatalError::Store(e.to_string()));
                }
            }
            Ok(other) => unreachable!("unexpected reply to commit: {other:?}"),
        }
    }

    fn on_record_commit_read(&mut self, now: Timestamp, op: OpId, id: SplitId, result: StoreResult) {
        let Some(h) = self.held.get(&id) else { return };
        let Some(c) = h.commit.clone().filter(|c| c.op == op) else { return };
        let entry = match result {
            Ok(StoreReply::Value(Some(e))) => e,
            Ok(StoreReply::Value(None)) => return self.commit_lost(&id),
            Err(_) => return self.finish_commit(now, &id, CommitOutcome::Retryable),
            Ok(other) => unreachable!("unexpected reply to commit read: {other:?}"),
        };
        let Ok(rec) = records::decode::<SplitRecord>(&entry.value) else { return self.commit_lost(&id) };
        #[cfg(feature = "mutations")]
        if c.unfenced_read {
            // The broken variant: trust the read revision after checking only our own epoch.
            let h = self.held.get_mut(&id).expect("held");
            h.record_rev = entry.revision;
            let record = self.commit_record(&self.held[&id], &c);
            let request = StoreRequest::CompareAndSwap {
                key: keys::split(&id),
                expected: entry.revision,
                value: records::encode(&record),
                ttl: None,
            };
            let op = self.send(Bucket::State, request, Pending::RecordCommit { split: id.clone() });
            self.held.get_mut(&id).expect("held").commit =
                Some(CommitInFlight { op, unfenced_read: false, ..c });
            return;
        }
        let h = &self.held[&id];
        let target = self.commit_record(h, &c);
        if rec == target {
            // Our write landed.
            return self.commit_applied(now, &id, entry.revision);
        }
        // Only the owner of this epoch writes a record without bumping the epoch, so an unchanged
        // owner and epoch prove nobody else wrote: our earlier in-doubt write moved the revision.
        if rec.epoch == h.epoch && rec.owner.as_ref() == Some(&self.me) && rec.state == SplitState::Owned {
            self.held.get_mut(&id).expect("held").record_rev = entry.revision;
            self.held.get_mut(&id).expect("held").record = rec;
            return self.finish_commit(now, &id, CommitOutcome::Retryable);
        }
        self.commit_lost(&id);
    }

    fn commit_applied(&mut self, now: Timestamp, id: &SplitId, rev: Revision) {
        let h = self.held.get_mut(id).expect("held");
        let c = h.commit.clone().expect("commit in flight");
        let record = {
            let mut r = h.record.clone();
            r.progress = Some(c.progress.clone());
            if c.terminal {
                r.state = SplitState::Done;
                r.owner = None;
                r.last_end = Some(EndReason::Finished);
            }
            r
        };
        h.record = record.clone();
        h.record_rev = rev;
        self.view.put_record(id, rev, record);
        if c.terminal {
            let epoch = h.epoch;
            h.commit = None;
            self.out.push(Action::CommitDone { split: id.clone(), epoch, outcome: CommitOutcome::Ok });
            self.event(Event::Finished { split: id.clone() });
            return self.delete_lease(id);
        }
        self.finish_commit(now, id, CommitOutcome::Ok);
    }

    fn commit_lost(&mut self, id: &SplitId) {
        // P8: nothing was written; the lane stops and is told the split is lost.
        self.revoke(id, StopReason::Fenced);
    }

    fn finish_commit(&mut self, now: Timestamp, id: &SplitId, outcome: CommitOutcome) {
        let Some(h) = self.held.get_mut(id) else { return };
        h.commit = None;
        let epoch = h.epoch;
        self.out.push(Action::CommitDone { split: id.clone(), epoch, outcome });
        if let Some(end) = self.held.get_mut(id).and_then(|h| h.end.take()) {
            self.begin_end(now, id, end);
        }
    }

    // ----- ends: release (P10), failure and quarantine (P12) -----

    fn on_fail(&mut self, now: Timestamp, id: SplitId, epoch: Epoch, error: String, unprocessable: bool) {
        if self.held.get(&id).is_some_and(|h| h.epoch == epoch) {
            self.begin_end(now, &id, End::Fail { error, unprocessable });
        }
    }

    fn on_lane_stopped(&mut self, now: Timestamp, id: SplitId, epoch: Epoch) {
        if self.held.get(&id).is_some_and(|h| h.epoch == epoch && matches!(h.stage, Stage::Stopping { .. })) {
            self.begin_end(now, &id, End::Release);
        }
    }

    /// Writes the end of a tenancy to the record, then deletes the lease.
    fn begin_end(&mut self, now: Timestamp, id: &SplitId, end: End) {
        let Some(h) = self.held.get_mut(id) else { return };
        if h.commit.is_some() {
            h.end = Some(end);
            return;
        }
        if matches!(h.stage, Stage::Ending | Stage::DeletingLease) {
            return;
        }
        let record = end_record(&self.cfg, &h.record, &end);
        let h = self.held.get_mut(id).expect("held");
        let was_running = h.stage == Stage::Running;
        let epoch = h.epoch;
        h.stage = Stage::Ending;
        h.end = Some(end.clone());
        h.target = Some(record);
        if was_running && matches!(end, End::Release) {
            self.out.push(Action::StopLane {
                split: id.clone(),
                epoch,
                reason: StopReason::Draining,
                deadline: None,
            });
        }
        self.write_end(now, id);
    }

    fn write_end(&mut self, _now: Timestamp, id: &SplitId) {
        let h = &self.held[id];
        let request = StoreRequest::CompareAndSwap {
            key: keys::split(id),
            expected: h.record_rev,
            value: records::encode(h.target.as_ref().expect("end target")),
            ttl: None,
        };
        let op = self.send(Bucket::State, request, Pending::RecordEnd { split: id.clone() });
        self.held.get_mut(id).expect("held").op = Some(op);
    }

    fn on_record_end(&mut self, now: Timestamp, op: OpId, id: SplitId, result: StoreResult) {
        if !self.is_current(&id, op) {
            return;
        }
        match result {
            Ok(StoreReply::Written(rev)) => self.end_written(&id, rev),
            Err(StoreError::RevisionMismatch(_)) | Err(StoreError::Indeterminate(_)) => {
                let op = self.send(
                    Bucket::State,
                    StoreRequest::Get { key: keys::split(&id) },
                    Pending::RecordEndRead { split: id.clone() },
                );
                self.held.get_mut(&id).expect("held").op = Some(op);
            }
            Err(e) if e.is_fatal() => self.fatal(FatalError::Store(e.to_string())),
            Err(_) => {
                // Nothing applied: try again shortly (the lease keeps being renewed meanwhile).
                let deadline = now + self.retry_backoff();
                let h = self.held.get_mut(&id).expect("held");
                h.stage = Stage::Stopping { deadline };
                h.op = None;
            }
            Ok(other) => unreachable!("unexpected reply to end write: {other:?}"),
        }
    }

    fn on_record_end_read(&mut self, now: Timestamp, op: OpId, id: SplitId, result: StoreResult) {
        if !self.is_current(&id, op) {
            return;
        }
        let entry = match result {
            Ok(StoreReply::Value(Some(e))) => e,
            Ok(StoreReply::Value(None)) => return self.delete_lease(&id),
            Err(_) => {
                let deadline = now + self.retry_backoff();
                let h = self.held.get_mut(&id).expect("held");
                h.stage = Stage::Stopping { deadline };
                h.op = None;
                return;
            }
            Ok(other) => unreachable!("unexpected reply to end read: {other:?}"),
        };
        let Ok(rec) = records::decode::<SplitRecord>(&entry.value) else { return self.delete_lease(&id) };
        let h = self.held.get_mut(&id).expect("held");
        if Some(&rec) == h.target.as_ref() {
            return self.end_written(&id, entry.revision);
        }
        if rec.epoch == h.epoch && rec.owner.as_ref() == Some(&self.me) && rec.state == SplitState::Owned {
            // Still ours: only this tenancy wrote since (an earlier in-doubt commit landed). End
            // from what is durable now, never from our older copy: progress must not regress (I1).
            let end = h.end.clone().expect("ending has an end");
            h.target = Some(end_record(&self.cfg, &rec, &end));
            h.record = rec;
            h.record_rev = entry.revision;
            return self.write_end(now, &id);
        }
        // Someone else owns it now: this tenancy is over.
        self.view.put_record(&id, entry.revision, rec);
        self.delete_lease(&id);
    }

    fn on_resume_read(&mut self, now: Timestamp, op: OpId, id: SplitId, result: StoreResult) {
        if !self.is_current(&id, op) {
            return;
        }
        self.held.get_mut(&id).expect("held").op = None;
        let entry = match result {
            Ok(StoreReply::Value(Some(e))) => e,
            Ok(StoreReply::Value(None)) => return self.revoke(&id, StopReason::Fenced),
            // Still unreachable: stay starved; the next renewal tries again.
            Err(_) => return,
            Ok(other) => unreachable!("unexpected reply to resume read: {other:?}"),
        };
        let Ok(rec) = records::decode::<SplitRecord>(&entry.value) else {
            return self.revoke(&id, StopReason::Fenced);
        };
        let h = self.held.get_mut(&id).expect("held");
        if rec.epoch != h.epoch || rec.owner.as_ref() != Some(&self.me) || rec.state != SplitState::Owned {
            self.view.put_record(&id, entry.revision, rec);
            return self.revoke(&id, StopReason::Fenced);
        }
        h.record = rec;
        h.record_rev = entry.revision;
        h.resumed = true;
        let _ = now;
        let op = self.send(
            Bucket::State,
            StoreRequest::Get { key: keys::desc(&id) },
            Pending::DescRead { split: id.clone() },
        );
        let h = self.held.get_mut(&id).expect("held");
        h.stage = Stage::ReadingDesc;
        h.op = Some(op);
    }

    fn end_written(&mut self, id: &SplitId, rev: Revision) {
        let h = self.held.get_mut(id).expect("held");
        h.record_rev = rev;
        let record = h.target.take().expect("end target");
        h.record = record.clone();
        self.view.put_record(id, rev, record.clone());
        match record.state {
            SplitState::Quarantined => self.event(Event::Quarantined {
                split: id.clone(),
                attempts: record.attempts,
                last_error: record.last_error,
            }),
            _ => self.event(Event::Released { split: id.clone() }),
        }
        self.delete_lease(id);
    }

    fn delete_lease(&mut self, id: &SplitId) {
        let Some(h) = self.held.get_mut(id) else { return };
        h.stage = Stage::DeletingLease;
        h.op = None;
        if h.renewing.is_some() {
            // Wait for the renewal so the delete's expected revision is current.
            return;
        }
        let Some(rev) = h.lease_rev else {
            self.held.remove(id);
            return;
        };
        let op = self.send(
            Bucket::Lease,
            StoreRequest::Delete { key: keys::split(id), expected: rev },
            Pending::LeaseDelete { split: id.clone() },
        );
        self.held.get_mut(id).expect("held").op = Some(op);
    }

    fn on_lease_delete(&mut self, _now: Timestamp, op: OpId, id: SplitId, _result: StoreResult) {
        if self.is_current(&id, op) {
            // Deleted, or it already moved on; either way the tenancy is over.
            self.held.remove(&id);
        }
    }

    // ----- drain and leaving -----

    fn on_drain(&mut self, now: Timestamp) {
        match self.phase {
            Phase::Running => self.leave(now, Outcome::Drained),
            Phase::Idle | Phase::Meta | Phase::Joining => {
                self.phase = Phase::Leaving;
                self.leaving = Some(Leaving {
                    outcome: Outcome::Drained,
                    deadline: now,
                    cleanup_sent: false,
                    cleanup_outstanding: 0,
                    deadline_passed: false,
                });
            }
            _ => {}
        }
    }

    fn leave(&mut self, now: Timestamp, outcome: Outcome) {
        self.phase = Phase::Leaving;
        let deadline = now + self.cfg.drain_timeout;
        self.leaving = Some(Leaving {
            outcome,
            deadline,
            cleanup_sent: false,
            cleanup_outstanding: 0,
            deadline_passed: false,
        });
        let ids: Vec<SplitId> = self.held.keys().cloned().collect();
        for id in ids {
            let h = self.held.get_mut(&id).expect("held");
            match h.stage {
                Stage::Running => {
                    h.stage = Stage::Stopping { deadline };
                    let epoch = h.epoch;
                    self.out.push(Action::StopLane {
                        split: id,
                        epoch,
                        reason: StopReason::Draining,
                        deadline: Some(deadline),
                    });
                }
                Stage::Starved => self.begin_end(now, &id, End::Release),
                _ => {}
            }
        }
    }

    fn progress_leaving(&mut self, now: Timestamp) {
        let Some(l) = &self.leaving else { return };
        if !self.held.is_empty() {
            return;
        }
        if !l.cleanup_sent {
            let mut n = 0;
            if let Some(rev) = self.presence.rev {
                self.send(
                    Bucket::Lease,
                    StoreRequest::Delete { key: keys::worker(&self.me.instance), expected: rev },
                    Pending::Cleanup,
                );
                n += 1;
            }
            if let Some(lead) = self.leader.take() {
                self.send(
                    Bucket::Lease,
                    StoreRequest::Delete { key: keys::leader(), expected: lead.rev },
                    Pending::Cleanup,
                );
                n += 1;
                let term = lead.head.as_ref().map_or(0, |(_, h)| h.term);
                self.event(Event::Leadership { leader: false, term });
            }
            let l = self.leaving.as_mut().expect("leaving");
            l.cleanup_sent = true;
            l.cleanup_outstanding += n;
            return;
        }
        if l.cleanup_outstanding == 0 || now >= l.deadline + self.cfg.lease_duration {
            let outcome = self.leaving.take().expect("leaving").outcome;
            self.out.push(Action::Finished(outcome));
            self.phase = Phase::Stopped;
            self.pending.clear();
            self.retries.clear();
        }
    }

    // ----- leadership and planning (P4) -----

    fn leadership(&mut self, now: Timestamp) {
        if self.leader.is_some() {
            return self.drive_plan(now);
        }
        if self.leader_attempt.is_some() {
            return;
        }
        if let Some((rev, l)) = &self.view.leader {
            // The leader key still names this process (we stepped down on a lapse of trust, or
            // a renewal's answer was lost): renew it by CAS rather than wait for it to expire.
            if l.owner == self.me {
                let value = records::encode(&LeaderRecord { owner: self.me.clone(), term: 0 });
                let request = StoreRequest::CompareAndSwap {
                    key: keys::leader(),
                    expected: *rev,
                    value,
                    ttl: self.ttl(),
                };
                let op = self.send(Bucket::Lease, request, Pending::LeaderCreate { sent: now });
                self.leader_attempt = Some(op);
            }
            return;
        }
        let value = records::encode(&LeaderRecord { owner: self.me.clone(), term: 0 });
        let op = self.send(
            Bucket::Lease,
            StoreRequest::Create { key: keys::leader(), value, ttl: self.ttl() },
            Pending::LeaderCreate { sent: now },
        );
        self.leader_attempt = Some(op);
    }

    fn on_leader_create(&mut self, now: Timestamp, op: OpId, sent: Timestamp, result: StoreResult) {
        if self.leader_attempt != Some(op) {
            return;
        }
        self.leader_attempt = None;
        match result {
            Ok(StoreReply::Written(rev)) => self.become_leader(now, rev, sent),
            Err(StoreError::Indeterminate(_)) => {
                let op = self.send(
                    Bucket::Lease,
                    StoreRequest::Get { key: keys::leader() },
                    Pending::LeaderResolve { sent },
                );
                self.leader_attempt = Some(op);
            }
            // Someone else leads; the watch will show it.
            _ => {}
        }
    }

    fn on_leader_resolve(&mut self, op: OpId, sent: Timestamp, result: StoreResult) {
        let is_attempt = self.leader_attempt == Some(op);
        let is_renewal = self.leader.as_ref().is_some_and(|l| l.renewing == Some(op));
        if !is_attempt && !is_renewal {
            return;
        }
        let mine = match &result {
            Ok(StoreReply::Value(Some(e))) => records::decode::<LeaderRecord>(&e.value)
                .ok()
                .filter(|l| l.owner == self.me)
                .map(|_| e.revision),
            _ => None,
        };
        if is_attempt {
            self.leader_attempt = None;
            if let Some(rev) = mine {
                self.become_leader(sent, rev, sent);
            }
            return;
        }
        let l = self.leader.as_mut().expect("leader");
        l.renewing = None;
        match (mine, result) {
            (Some(rev), _) => {
                if rev != l.rev {
                    l.rev = rev;
                    l.trusted_until = sent + self.cfg.lease_trust();
                }
            }
            (None, Err(_)) => {}
            (None, _) => self.step_down(),
        }
    }

    fn become_leader(&mut self, now: Timestamp, rev: Revision, sent: Timestamp) {
        let _ = now;
        self.leader = Some(Box::new(Leading {
            rev,
            renewing: None,
            trusted_until: sent + self.cfg.lease_trust(),
            head: None,
            stage: PlanStage::Bumping,
            replan_at: None,
            gc_for: None,
            last_version: 0,
            stint: self.next_plan_request,
        }));
        self.next_plan_request += 1;
        self.bump_term(self.view.plan_head.clone());
    }

    /// P4: bump the term before planning, so a deposed leader's in-flight plan write loses its
    /// swap.
    fn bump_term(&mut self, current: Option<(Revision, PlanHead)>) {
        let (request, head) = match current {
            None => {
                let head = PlanHead {
                    term: 1,
                    leader: self.me.clone(),
                    status: PlanStatus::Planning,
                    manifest: None,
                };
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
                    leader: self.me.clone(),
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
        };
        self.send(Bucket::State, request, Pending::HeadWrite { stint: self.stint(), head });
    }

    fn on_leader_renew(&mut self, op: OpId, sent: Timestamp, result: StoreResult) {
        let Some(l) = self.leader.as_mut() else { return };
        if l.renewing != Some(op) {
            return;
        }
        l.renewing = None;
        match result {
            Ok(StoreReply::Written(rev)) => {
                l.rev = rev;
                l.trusted_until = sent + self.cfg.lease_trust();
            }
            Err(StoreError::RevisionMismatch(_)) | Err(StoreError::Indeterminate(_)) => {
                let op = self.send(
                    Bucket::Lease,
                    StoreRequest::Get { key: keys::leader() },
                    Pending::LeaderResolve { sent },
                );
                self.leader.as_mut().expect("leader").renewing = Some(op);
            }
            Err(_) => {}
            Ok(other) => unreachable!("unexpected reply to leader renew: {other:?}"),
        }
    }

    fn stint(&self) -> u64 {
        self.leader.as_ref().map_or(0, |l| l.stint)
    }

    fn step_down(&mut self) {
        if let Some(l) = self.leader.take() {
            let term = l.head.as_ref().map_or(0, |(_, h)| h.term);
            self.event(Event::Leadership { leader: false, term });
        }
    }

    fn on_head_write(&mut self, now: Timestamp, head: PlanHead, result: StoreResult) {
        if self.leader.is_none() {
            return;
        }
        match result {
            Ok(StoreReply::Written(rev)) => self.head_written(now, rev, head),
            Err(e) if e.is_fatal() => self.fatal(FatalError::Store(e.to_string())),
            // Mismatch, in doubt or unavailable: the read decides what happened (P8-style).
            Err(_) => {
                self.send(
                    Bucket::State,
                    StoreRequest::Get { key: keys::plan_head() },
                    Pending::HeadRead { stint: self.stint(), attempted: head },
                );
            }
            Ok(other) => unreachable!("unexpected reply to head write: {other:?}"),
        }
    }

    fn head_written(&mut self, now: Timestamp, rev: Revision, head: PlanHead) {
        let Some(l) = self.leader.as_mut() else { return };
        let first = l.head.as_ref().is_none_or(|(_, h)| h.term != head.term);
        let publishing = matches!(l.stage, PlanStage::Publishing);
        l.head = Some((rev, head.clone()));
        if self.view.plan_head.as_ref().is_none_or(|(r, _)| *r <= rev) {
            self.view.plan_head = Some((rev, head.clone()));
        }
        if first {
            self.event(Event::Leadership { leader: true, term: head.term });
        }
        let l = self.leader.as_mut().expect("leader");
        if publishing {
            let m = head.manifest.expect("published head has a manifest");
            l.stage = PlanStage::Idle;
            l.gc_for = Some(m);
            if m.kind == PlanKind::Open {
                l.replan_at = Some(now + self.cfg.replan_interval);
            }
            self.event(Event::PlanPublished { term: m.term, version: m.version, splits: m.split_count });
        } else {
            l.stage =
                if head.status == PlanStatus::Planning { PlanStage::WaitManifest } else { PlanStage::Idle };
        }
    }

    fn on_head_read(&mut self, now: Timestamp, attempted: PlanHead, result: StoreResult) {
        let Some(l) = self.leader.as_mut() else { return };
        let current = match result {
            Ok(StoreReply::Value(Some(e))) => match records::decode::<PlanHead>(&e.value) {
                Ok(h) => Some((e.revision, h)),
                Err(err) => {
                    self.event(Event::Undecodable { key: e.key.to_string(), error: err.to_string() });
                    return self.step_down();
                }
            },
            Ok(StoreReply::Value(None)) => None,
            Err(_) => {
                let at = now + self.retry_backoff();
                self.leader.as_mut().expect("leader").stage = PlanStage::RetryAt(at);
                return;
            }
            Ok(other) => unreachable!("unexpected reply to head read: {other:?}"),
        };
        let my_term = l.head.as_ref().map(|(_, h)| h.term);
        match current {
            // Our in-doubt write landed.
            Some((rev, h)) if h == attempted => self.head_written(now, rev, h),
            // Still our term and nobody else wrote (only the term's leader writes the head):
            // send the same write against the fresh revision.
            Some((rev, h)) if my_term == Some(h.term) && h.leader == self.me && attempted.term == h.term => {
                let request = StoreRequest::CompareAndSwap {
                    key: keys::plan_head(),
                    expected: rev,
                    value: records::encode(&attempted),
                    ttl: None,
                };
                self.send(
                    Bucket::State,
                    request,
                    Pending::HeadWrite { stint: self.stint(), head: attempted },
                );
            }
            // No term established yet: bump against what is there now.
            current if my_term.is_none() => self.bump_term(current),
            // Someone else bumped the term: we are deposed (I9).
            _ => self.step_down(),
        }
    }

    fn drive_plan(&mut self, now: Timestamp) {
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
                l.stage = PlanStage::Requested(request);
                self.out.push(Action::Plan { request });
            }
            PlanStage::Writing(_) => self.pump_plan_writes(now),
            PlanStage::Idle => {
                if let Some(m) = l.gc_for
                    && self.view.manifest == Some(m)
                {
                    l.gc_for = None;
                    self.send(
                        Bucket::State,
                        StoreRequest::List { prefix: keys::manifest_prefix() },
                        Pending::GcList,
                    );
                    // Orphan split records (written by a deposed leader, never published) are
                    // deleted if nobody ever owned them.
                    let orphans: Vec<(SplitId, Revision)> = self
                        .view
                        .splits
                        .iter()
                        .filter(|(_, sv)| sv.weight.is_none())
                        .filter(|(_, sv)| sv.record.as_ref().is_some_and(|r| r.epoch == Epoch(0)))
                        .map(|(id, sv)| (id.clone(), sv.record_rev))
                        .collect();
                    for (id, rev) in orphans {
                        self.send(
                            Bucket::State,
                            StoreRequest::Delete { key: keys::split(&id), expected: rev },
                            Pending::Cleanup,
                        );
                    }
                }
            }
            _ => {}
        }
        let _ = now;
    }

    fn on_plan_ready(&mut self, now: Timestamp, request: u64, result: Result<Plan, String>) {
        let Some(l) = self.leader.as_mut() else { return };
        if !matches!(l.stage, PlanStage::Requested(r) if r == request) {
            return;
        }
        let plan = match result.and_then(|p| validate_plan(&p).map(|()| p)) {
            Ok(p) => p,
            Err(error) => {
                l.stage = PlanStage::RetryAt(now + self.cfg.heartbeat_interval());
                return self.event(Event::PlanFailed { error });
            }
        };
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
        let mut first = VecDeque::new();
        for s in &plan.splits {
            if entries.contains_key(&s.id) {
                continue;
            }
            entries.insert(s.id.clone(), s.weight);
            first.push_back((
                keys::desc(&s.id),
                records::encode(&Descriptor { descriptor: s.descriptor.clone(), weight: s.weight }),
            ));
            first.push_back((keys::split(&s.id), records::encode(&SplitRecord::new())));
        }
        let unchanged =
            head.manifest.is_some_and(|m| m.kind == plan.kind && m.term == head.term) && first.is_empty();
        if unchanged {
            l.stage = PlanStage::Idle;
            if plan.kind == PlanKind::Open {
                l.replan_at = Some(now + self.cfg.replan_interval);
            }
            return;
        }
        // Every planning round writes a fresh version: a round that failed to publish may have
        // left chunks behind, and create-if-absent would silently keep their old content.
        let version = head.manifest.map_or(1, |m| m.version + 1).max(l.last_version + 1);
        l.last_version = version;
        let list: Vec<(SplitId, u64)> = entries.into_iter().collect();
        let chunks: Vec<&[(SplitId, u64)]> = list.chunks(records::MANIFEST_CHUNK_LEN).collect();
        let manifest = ManifestRef {
            term: head.term,
            version,
            chunks: chunks.len() as u32,
            split_count: list.len() as u64,
            kind: plan.kind,
        };
        let second = chunks
            .iter()
            .enumerate()
            .map(|(i, c)| {
                (
                    keys::manifest(head.term, version, i as u32),
                    records::encode(&ManifestChunk { splits: c.to_vec() }),
                )
            })
            .collect();
        l.stage = PlanStage::Writing(Box::new(PlanWrite {
            first,
            second,
            first_in_flight: 0,
            second_in_flight: 0,
            manifest,
            resume_at: None,
            round: request,
        }));
        self.pump_plan_writes(now);
    }

    fn pump_plan_writes(&mut self, now: Timestamp) {
        let Some(l) = self.leader.as_mut() else { return };
        let PlanStage::Writing(w) = &mut l.stage else { return };
        if w.resume_at.is_some_and(|t| now < t) {
            return;
        }
        w.resume_at = None;
        let mut sends = Vec::new();
        while w.first_in_flight + w.second_in_flight < PLAN_WRITE_WINDOW {
            // Manifest chunks only after every descriptor and record exists: a published
            // manifest never names a split without its records.
            let next = if let Some(x) = w.first.pop_front() {
                w.first_in_flight += 1;
                x
            } else if w.first_in_flight == 0
                && let Some(x) = w.second.pop_front()
            {
                w.second_in_flight += 1;
                x
            } else {
                break;
            };
            sends.push(next);
        }
        let publish =
            w.first.is_empty() && w.second.is_empty() && w.first_in_flight + w.second_in_flight == 0;
        let manifest = w.manifest;
        let round = w.round;
        for (key, value) in sends {
            let request = StoreRequest::Create { key: key.clone(), value: value.clone(), ttl: None };
            self.send(Bucket::State, request, Pending::PlanWrite { round, key, value });
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
            self.send(Bucket::State, request, Pending::HeadWrite { stint: self.stint(), head: new });
        }
    }

    fn on_plan_write(&mut self, now: Timestamp, round: u64, key: Key, value: Bytes, result: StoreResult) {
        let backoff = self.retry_backoff();
        let Some(l) = self.leader.as_mut() else { return };
        let PlanStage::Writing(w) = &mut l.stage else { return };
        if w.round != round {
            return;
        }
        let is_manifest = keys::parse_manifest(&key).is_some();
        if is_manifest {
            w.second_in_flight -= 1;
        } else {
            w.first_in_flight -= 1;
        }
        match result {
            // Existing keys are expected: deterministic ids make re-planning a no-op for them.
            Ok(_) | Err(StoreError::AlreadyExists(_)) => {}
            Err(e) if e.is_fatal() => return self.fatal(FatalError::Store(e.to_string())),
            Err(_) => {
                // In doubt or unavailable: create-if-absent is safe to repeat.
                if is_manifest {
                    w.second.push_front((key, value));
                } else {
                    w.first.push_front((key, value));
                }
                w.resume_at = Some(now + backoff);
            }
        }
        self.pump_plan_writes(now);
    }

    fn on_gc_list(&mut self, result: StoreResult) {
        let Ok(StoreReply::Entries(entries)) = result else { return };
        let Some(current) = self.view.plan_head.as_ref().and_then(|(_, h)| h.manifest) else { return };
        for e in entries {
            if let Some((term, version, _)) = keys::parse_manifest(&e.key)
                && (term, version) != (current.term, current.version)
                && version <= current.version
            {
                self.send(
                    Bucket::State,
                    StoreRequest::Delete { key: e.key, expected: e.revision },
                    Pending::Cleanup,
                );
            }
        }
    }
}

fn h_reason(held: &BTreeMap<SplitId, Held>, id: &SplitId) -> Option<AcquisitionReason> {
    held.get(id).map(|h| h.reason)
}

/// The record that ends a tenancy (P10 release, P12 failure and quarantine).
fn end_record(cfg: &Config, current: &SplitRecord, end: &End) -> SplitRecord {
    let mut record = current.clone();
    record.owner = None;
    match end {
        End::Release => {
            record.state = SplitState::Unleased;
            record.last_end = Some(EndReason::Released);
            #[cfg(feature = "mutations")]
            if cfg.mutations.attempts_on_release {
                record.attempts += 1;
            }
        }
        End::Fail { error, unprocessable } => {
            record.attempts += 1;
            record.last_error = Some(error.clone());
            record.last_end = Some(if *unprocessable { EndReason::Unprocessable } else { EndReason::Failed });
            record.state = if record.attempts >= cfg.max_attempts {
                SplitState::Quarantined
            } else {
                SplitState::Unleased
            };
        }
    }
    record
}

fn validate_plan(plan: &Plan) -> Result<(), String> {
    let mut seen = BTreeSet::new();
    for s in &plan.splits {
        if !seen.insert(&s.id) {
            return Err(format!("planner returned split id {} twice; split ids must be unique", s.id));
        }
    }
    Ok(())
}
