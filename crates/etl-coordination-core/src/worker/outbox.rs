//! The outbox: store requests in flight (op ids and the pending table that says what each
//! answer is for), delayed retries, events, fatal stops, and the classification of store
//! answers that every handler shares.

use std::collections::BTreeMap;
use std::time::Duration;

use crate::ids::{InstanceId, OpId, Revision, SplitId};
use crate::io::{Action, Event, FatalError, SplitCounts};
use crate::records::{self, ManifestRef, PlanHead, SplitRecord};
use crate::store::{Bucket, Entry, Key, StoreError, StoreReply, StoreRequest, StoreResult};
use crate::time::Timestamp;

use bytes::Bytes;

use super::{Phase, Worker};

/// What an in-flight store request is for: the table [`Worker::on_store_result`] dispatches
/// on. `sent` is the request's send time, from which a renewal's trust is measured (P11).
#[derive(Debug, Clone)]
pub(super) enum Pending {
    /// P2: create `meta`.
    MetaCreate,
    /// P2: read `meta` back to compare it.
    MetaGet,
    /// P2: read `meta` again while running (its `max_attempts` may have changed).
    MetaRefresh,
    /// P3: create our presence key (or re-create it after it expired).
    PresenceCreate,
    /// P3: read our presence key (a predecessor's, or our own after an in-doubt write).
    PresenceGet,
    /// P3: CAS over a dead predecessor's presence key.
    PresenceTakeover,
    /// P7: renew our presence.
    PresenceRenew,
    /// P7: read our presence after a renewal lost its swap or its answer.
    PresenceResolve,
    /// P4: create (or re-take by CAS) the leader lease.
    LeaderCreate { sent: Timestamp },
    /// P7: renew the leader lease.
    LeaderRenew { sent: Timestamp },
    /// P4, P7: read the leader lease after an in-doubt create or renewal (`sent`: the create's
    /// send time; a renewal's trust counts from the oldest unacknowledged renewal).
    LeaderResolve { sent: Timestamp },
    /// P4: a plan head write (term bump or publication) of leadership stint `stint`.
    HeadWrite { stint: u64, head: PlanHead },
    /// P4: read the head after `attempted` failed or was in doubt.
    HeadRead { stint: u64, attempted: PlanHead },
    /// P4: create one descriptor, split record or manifest chunk of planning round `round` (or
    /// touch an existing split record: the same value by CAS).
    PlanWrite { round: u64, key: Key, value: Bytes },
    /// P4: read a split record a planning round found existing, to decide whether to touch it.
    PlanTouchRead { round: u64, key: Key, value: Bytes },
    /// P13: read one chunk of the published manifest for load `load` (answers of a load that
    /// was dropped meanwhile count for no other).
    ManifestChunk { manifest: ManifestRef, chunk: u32, load: OpId },
    /// P4: list manifest chunks for garbage collection.
    GcList,
    /// A best-effort delete (garbage collection); its answer changes nothing.
    Cleanup,
    /// A best-effort release of a record whose tenancy is over (a CAS against our last write);
    /// its answer changes nothing, but a leaving worker waits for it.
    Release,
    /// Delete one of our lease-bucket keys (presence, leader, a lease we cannot use).
    Retire { key: Key },
    /// Read a key being retired after its delete lost its swap or its answer.
    RetireRead { key: Key },
    /// P9: create a cooperative steal request to `victim`.
    StealAsk { victim: InstanceId },
    /// P9: delete a steal request to us at `rev` (a refusal).
    StealRefuse { rev: Revision },
    /// P5, P6, P9: create (or CAS over a displaced one) the lease of a split being acquired.
    LeaseAcquire { split: SplitId, sent: Timestamp },
    /// Read the lease after an in-doubt acquisition `write` sent at `sent`.
    LeaseAcquireResolve { split: SplitId, sent: Timestamp, write: OpId },
    /// P7: renew a held lease.
    LeaseRenew { split: SplitId, sent: Timestamp },
    /// P7: read a held lease after its renewal `write` (sent at the time given) lost its swap
    /// or its answer; `None`: a check of a lease a listing did not show.
    LeaseRenewResolve { split: SplitId, write: Option<(OpId, Timestamp)> },
    /// P10, P12: delete the lease at the end of a tenancy.
    LeaseDelete { split: SplitId },
    /// P5: the fenced record CAS that completes an acquisition.
    RecordClaim { split: SplitId },
    /// P5: read the record after the claim CAS lost or was in doubt.
    RecordClaimRead { split: SplitId },
    /// P5, P12: a claim CAS still in flight when its tenancy was revoked: if it lands, the
    /// record is released.
    OrphanClaim(ClaimOrphan),
    /// P5, P12: read the record after an orphaned claim was in doubt (or while the read
    /// resolving it was in flight): released if the claim landed.
    OrphanClaimRead(ClaimOrphan),
    /// Read the descriptor before starting a lane.
    DescRead { split: SplitId },
    /// P8: a progress (or terminal) commit.
    RecordCommit { split: SplitId },
    /// P8: read the record after a commit lost its swap or its answer.
    RecordCommitRead { split: SplitId },
    /// P10, P12: the record write that ends a tenancy.
    RecordEnd { split: SplitId },
    /// P10, P12: read the record after the end write lost its swap or its answer.
    RecordEndRead { split: SplitId },
}

/// A claim whose tenancy was revoked while it was in flight (see `Worker::orphan_claim`).
#[derive(Debug, Clone)]
pub(super) struct ClaimOrphan {
    pub(super) split: SplitId,
    /// The revision the claim CAS expected (a read older than it lags).
    pub(super) base: Revision,
    /// The record the claim wrote.
    pub(super) record: SplitRecord,
}

/// A request sent again after a backoff.
#[derive(Debug)]
pub(super) struct Retry {
    pub(super) at: Timestamp,
    pub(super) bucket: Bucket,
    pub(super) request: StoreRequest,
    pub(super) pending: Pending,
}

/// The answer to a write (create, CAS), classified the way the rules read it (S2).
#[derive(Debug)]
pub(super) enum Written {
    /// Applied at this revision.
    Applied(Revision),
    /// The fence said no (`AlreadyExists`, `RevisionMismatch`).
    Conflict,
    /// The write may or may not have applied: resolve by re-reading, never assume.
    InDoubt,
    /// Nothing was applied; retry later.
    Unavailable,
    /// Needs operator action.
    Fatal(StoreError),
}

impl Written {
    pub(super) fn of(result: StoreResult) -> Self {
        match result {
            Ok(StoreReply::Written(rev)) => Written::Applied(rev),
            Err(StoreError::AlreadyExists(_) | StoreError::RevisionMismatch(_)) => Written::Conflict,
            Err(StoreError::Indeterminate(_)) => Written::InDoubt,
            Err(e) if e.is_fatal() => Written::Fatal(e),
            Err(_) => Written::Unavailable,
            Ok(other) => unreachable!("a write was answered with {other:?}"),
        }
    }
}

/// The answer to a point read.
#[derive(Debug)]
pub(super) enum Read {
    /// The live entry.
    Found(Entry),
    /// No live value.
    Absent,
    /// The read failed (unavailable, or a fatal setup error).
    Failed(StoreError),
}

impl Read {
    pub(super) fn of(result: StoreResult) -> Self {
        match result {
            Ok(StoreReply::Value(Some(e))) => Read::Found(e),
            Ok(StoreReply::Value(None)) => Read::Absent,
            Err(e) => Read::Failed(e),
            Ok(other) => unreachable!("a read was answered with {other:?}"),
        }
    }
}

/// Everything the worker sends, grouped: op ids, the table of requests in flight (what each
/// answer is for), delayed retries, and the actions produced by the current input. Rules send
/// through it; [`Worker::handle`] takes its actions at the end of each input.
#[derive(Debug)]
pub(super) struct Outbox {
    /// The next [`OpId`].
    next_op: u64,
    /// What each store request in flight is for.
    pending: BTreeMap<OpId, Pending>,
    /// Actions produced by the current input.
    out: Vec<Action>,
    /// Requests to send again once due.
    retries: Vec<Retry>,
    /// The retry backoff before jitter (a third of a heartbeat, 50 ms to 2 s).
    backoff_base: Duration,
    /// The jitter's seed (this process's incarnation).
    jitter_seed: u64,
}

impl Outbox {
    pub(super) fn new(heartbeat_interval: Duration, jitter_seed: u64) -> Self {
        Outbox {
            next_op: 1,
            pending: BTreeMap::new(),
            out: Vec::new(),
            retries: Vec::new(),
            backoff_base: (heartbeat_interval / 3).clamp(Duration::from_millis(50), Duration::from_secs(2)),
            jitter_seed,
        }
    }

    /// The op id the next request will get (to tag a value with the write that carries it).
    pub(super) fn next_op_id(&self) -> OpId {
        OpId(self.next_op)
    }

    /// Sends one store request; its answer is dispatched by `pending`.
    pub(super) fn send(&mut self, bucket: Bucket, request: StoreRequest, pending: Pending) -> OpId {
        let op = OpId(self.next_op);
        self.next_op += 1;
        self.pending.insert(op, pending);
        self.out.push(Action::Store { op, bucket, request });
        op
    }

    /// Sends a request after [`Outbox::retry_backoff`].
    pub(super) fn retry_later(
        &mut self,
        now: Timestamp,
        bucket: Bucket,
        request: StoreRequest,
        pending: Pending,
    ) {
        let at = now + self.retry_backoff();
        self.retries.push(Retry { at, bucket, request, pending });
    }

    /// A third of a heartbeat (50 ms to 2 s), plus up to as much again of jitter, so that a
    /// fleet that lost the store together does not retry in lockstep. The jitter is a hash of
    /// this process's incarnation and its next op id: no clock, no randomness of its own, so a
    /// run stays a replayable function of its inputs.
    pub(super) fn retry_backoff(&self) -> Duration {
        let base = self.backoff_base;
        let mut h = self.jitter_seed ^ self.next_op.wrapping_mul(0x9e37_79b9_7f4a_7c15);
        // splitmix64's finalizer.
        h = (h ^ (h >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        h = (h ^ (h >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        h ^= h >> 31;
        base + base * (h % 1024) as u32 / 1024
    }

    /// The delayed retries that are due, taken out of the queue (in the order they were queued).
    pub(super) fn take_due(&mut self, now: Timestamp) -> Vec<Retry> {
        let (due, keep): (Vec<_>, Vec<_>) =
            std::mem::take(&mut self.retries).into_iter().partition(|r| r.at <= now);
        self.retries = keep;
        due
    }

    /// When the earliest delayed retry is due.
    pub(super) fn next_retry_at(&self) -> Option<Timestamp> {
        self.retries.iter().map(|r| r.at).min()
    }

    /// What the answer to `op` is for, taken out of the table (`None`: not ours, or forgotten).
    pub(super) fn answered(&mut self, op: OpId) -> Option<Pending> {
        self.pending.remove(&op)
    }

    /// Gives a request in flight another purpose: `f` maps what its answer was for to what it
    /// is for now (`None`: unchanged).
    pub(super) fn repurpose(&mut self, op: OpId, f: impl FnOnce(&Pending) -> Option<Pending>) {
        if let Some(p) = self.pending.get_mut(&op)
            && let Some(new) = f(p)
        {
            *p = new;
        }
    }

    /// Forgets a request in flight: its answer, when it comes, is ignored.
    pub(super) fn forget(&mut self, op: OpId) {
        self.pending.remove(&op);
    }

    /// Every request in flight or waiting to be sent again.
    pub(super) fn in_flight(&self) -> impl Iterator<Item = &Pending> {
        self.pending.values().chain(self.retries.iter().map(|r| &r.pending))
    }

    /// Forgets every request in flight and every retry (nothing follows).
    pub(super) fn clear(&mut self) {
        self.pending.clear();
        self.retries.clear();
    }

    /// Queues one action.
    pub(super) fn push(&mut self, action: Action) {
        self.out.push(action);
    }

    /// Queues one event.
    pub(super) fn event(&mut self, e: Event) {
        self.out.push(Action::Event(e));
    }

    /// The actions of the current input, taken.
    pub(super) fn take_actions(&mut self) -> Vec<Action> {
        std::mem::take(&mut self.out)
    }
}

impl Worker {
    /// Stops the worker on a condition it cannot continue from; nothing follows.
    pub(super) fn fatal(&mut self, e: FatalError) {
        self.outbox.push(Action::Fatal(e));
        self.phase = Phase::Stopped;
        self.outbox.clear();
    }

    /// A store error that needs operator action.
    pub(super) fn fatal_store(&mut self, e: StoreError) {
        self.fatal(FatalError::Store(e.to_string()));
    }

    /// Emits [`Event::Gauges`] when a gauge changed.
    pub(super) fn emit_gauges(&mut self) {
        if !matches!(self.phase, Phase::Running | Phase::Leaving) {
            return;
        }
        let undecodable = |bucket| self.view.undecodable.keys().filter(|(b, _)| *b == bucket).count() as u32;
        let g = Gauges {
            owned: self.tenancies.len() as u32,
            live_workers: self.view.live_workers() as u32,
            splits: self.view.split_counts(),
            undecodable_state: undecodable(Bucket::State),
            undecodable_lease: undecodable(Bucket::Lease),
        };
        if self.gauges != Some(g) {
            self.gauges = Some(g);
            self.outbox.event(Event::Gauges {
                owned: g.owned,
                live_workers: g.live_workers,
                splits: g.splits,
                undecodable_state: g.undecodable_state,
                undecodable_lease: g.undecodable_lease,
            });
        }
    }
}

/// The gauges last reported by [`Event::Gauges`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Gauges {
    owned: u32,
    live_workers: u32,
    splits: SplitCounts,
    undecodable_state: u32,
    undecodable_lease: u32,
}

impl Worker {
    /// A value that cannot be decoded: remembered until the key holds a value that decodes (or
    /// none), so that it is reported once per value and counted while it stays.
    pub(super) fn note_undecodable(&mut self, bucket: Bucket, entry: &Entry, err: &records::RecordError) {
        self.note_bad_value(bucket, &entry.key, entry.revision, err.to_string());
    }

    /// A value (of `key` at `rev`) that decodes but cannot be used (a manifest listing another
    /// number of splits than its head says): noted and reported like an undecodable one.
    pub(super) fn note_bad_value(&mut self, bucket: Bucket, key: &Key, rev: Revision, error: String) {
        let slot = (bucket, key.clone());
        if self.view.undecodable.get(&slot).is_some_and(|r| *r >= rev) {
            return;
        }
        self.view.undecodable.insert(slot, rev);
        self.outbox.event(Event::Undecodable { key: key.to_string(), error });
    }
}
