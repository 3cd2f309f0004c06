//! The store as NATS behaves (docs/NATS.md), on the memory store's semantics:
//!
//! - each worker talks to the store over its own link: requests are applied in the order it
//!   sent them; a stalled link holds them (and the answers and watch events) and delivers them
//!   late; a cut link refuses them; a link can also fail only its writes, or one bucket;
//! - an answer that does not come within the worker's op timeout becomes in doubt (write) or
//!   unavailable (read), while the request may still land later;
//! - reads (gets and listings) may be answered by a replica that lags (history lookups);
//! - TTL expiry runs on a 250 ms timer and fires up to `expiry_late_max` late; until it fires
//!   an overdue key is live and CAS-able; a renewal that lands just before the old revision's
//!   expiry can be acknowledged and then erased by it;
//! - a stream's leader can lose its quorum: writes wait (refusing others to the same key) and
//!   land late or never (`Stuck`);
//! - watches deliver events in order with small delays and rare lag spikes.

use std::collections::{BTreeMap, VecDeque};
use std::time::Duration;

use etl_coordination_core::records::{self, LeaseRecord, PlanHead, SplitRecord, keys};
use etl_coordination_core::{
    Bucket, Entry, Epoch, Key, OpId, Owner, Prefix, Revision, SplitId, StoreError, StoreReply, StoreRequest,
    StoreResult, Timestamp, WatchEvent, WatchId,
};
use etl_coordination_memory::MemoryKv;

use super::{Answer, Ev, World, ms, us};
use crate::check::LeaseOrigin;

/// Every version of every key, with the time it was applied, back to the longest replica lag.
pub(crate) type History = BTreeMap<Key, VecDeque<(Timestamp, Option<Entry>)>>;

/// One worker's connection to the store.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Link {
    /// Stalled: requests, answers and watch events are held until then, then delivered in order.
    pub hold_until: Timestamp,
    /// When the last request of this link is applied (requests land in the order they were sent).
    pub last_apply: Timestamp,
    /// Cut: connections are refused or reset; nothing goes through.
    pub cut_until: Timestamp,
    /// Writes fail (nothing applied), reads succeed.
    pub writes_fail_until: Timestamp,
    /// One bucket is unreachable (state, lease).
    pub bucket_down: [Timestamp; 2],
}

impl Link {
    /// Ends every link fault (the liveness phase).
    pub(crate) fn heal(&mut self, now: Timestamp) {
        self.cut_until = now;
        self.writes_fail_until = now;
        self.bucket_down = [now, now];
        self.hold_until = self.hold_until.min(now);
    }

    fn refuses(&self, now: Timestamp, bucket: Bucket, write: bool) -> bool {
        now < self.cut_until || now < self.bucket_down[bi(bucket)] || (write && now < self.writes_fail_until)
    }
}

/// A request on its way to the store, as the sender sent it.
#[derive(Debug)]
pub(crate) struct Sent {
    pub slot: usize,
    pub life: u32,
    pub op: OpId,
    pub bucket: Bucket,
    pub request: StoreRequest,
    pub writer: Owner,
    pub answer: Answer,
    /// When the sender's op timeout runs out: an answer after it is never delivered.
    pub deadline: Timestamp,
    /// For a split record write waiting at a stuck leader: the lease origin of the acquisition
    /// it was made for, when the leader took it (what the checker judges it by).
    pub accepted_origin: Option<(SplitId, Epoch, Option<LeaseOrigin>)>,
}

/// A stream leader cut off from its followers (what the real-process test that cuts the lease
/// stream leader's node off showed): it takes writes but cannot commit them. They wait, in
/// order, until it regains its quorum (they land late) or steps down (the next leader never saw
/// some or all of them). Meanwhile reads through it show the state it had when it was cut off,
/// expiries wait too, and a write to a key with one already waiting is refused: JetStream
/// rejects an expected-sequence publish while another for the same subject is in process, so a
/// retry against the revision a read shows conflicts although nobody else wrote.
///
/// Two shapes: the leader lost its followers and every worker talks to it (no election, the
/// quorum comes back); or its node is cut off with the workers connected to it (`isolated`)
/// while the other nodes elect a new leader (`elected_at`) that serves the rest of the fleet:
/// from then on the two sides diverge, the isolated workers read an ever older state, their
/// watches go quiet, and their waiting writes are dropped when the old leader rejoins.
pub(crate) struct Stuck {
    pub until: Timestamp,
    pub pending: Vec<Sent>,
    /// Every worker talks to the stuck leader (the quorum-loss shape).
    pub everyone: bool,
    /// The workers connected to the cut-off node (the split shape).
    pub isolated: Vec<usize>,
    /// When the other nodes have a new leader (the split shape), if within the window.
    pub elected_at: Option<Timestamp>,
    /// The stuck leader's state when it was cut off (what reads through it show).
    pub snapshot: MemoryKv,
}

impl Stuck {
    fn isolates(&self, slot: usize) -> bool {
        self.everyone || self.isolated.contains(&slot)
    }

    fn elected(&self, now: Timestamp) -> bool {
        self.elected_at.is_some_and(|t| t <= now)
    }
}

/// A watch subscription of one worker.
pub(crate) struct Sub {
    pub slot: usize,
    pub life: u32,
    pub watch: WatchId,
    pub last_at: Timestamp,
}

pub(crate) fn bi(b: Bucket) -> usize {
    match b {
        Bucket::State => 0,
        Bucket::Lease => 1,
    }
}

fn no_answer(write: bool, timeout: Duration) -> StoreResult {
    let msg = format!("no answer within {timeout:?}");
    if write { Err(StoreError::Indeterminate(msg)) } else { Err(StoreError::Unavailable(msg)) }
}

impl World {
    pub(crate) fn kv(&mut self, bucket: Bucket) -> &mut MemoryKv {
        match bucket {
            Bucket::State => &mut self.state,
            Bucket::Lease => &mut self.lease,
        }
    }

    fn respond(&mut self, slot: usize, life: u32, op: OpId, result: StoreResult, after: Duration) {
        self.schedule(
            after,
            Ev::ToWorker { slot, life, input: etl_coordination_core::Input::StoreResult { op, result } },
        );
    }

    /// A worker sends a request: decide now whether it is refused, lost, late or normal.
    pub(crate) fn send_request(&mut self, slot: usize, op: OpId, bucket: Bucket, request: StoreRequest) {
        let now = self.now;
        let life = self.slots[slot].life;
        let writer = self.slots[slot].owner.clone();
        let timeout = self.opts.op_timeout;
        let write = request.is_write();
        let link = self.slots[slot].link;
        if now < self.outage_until || link.refuses(now, bucket, write) {
            // Nothing is applied: refused at once, or the connection died mid-request.
            let (result, after) = if self.rng.chance(0.5) {
                (Err(StoreError::Unavailable("connection refused".into())), us(self.rng.range(100, 1000)))
            } else {
                (no_answer(write, timeout), timeout)
            };
            return self.respond(slot, life, op, result, after);
        }
        let roll = if self.faults_on { self.rng.range(0, 999) } else { 999 };
        if roll < 10 {
            // The request is lost on the way: never applied.
            self.fault("request_lost");
            return self.respond(slot, life, op, no_answer(write, timeout), timeout);
        }
        let mut lost_response = roll < 20;
        if (20..30).contains(&roll) {
            // The link stalls: this request and everything after it lands late, in order.
            self.fault("link_stalled_briefly");
            let hold = now
                + ms(self.rng.range(timeout.as_millis() as u64 / 2, timeout.as_millis() as u64 * 3 + 500));
            let l = &mut self.slots[slot].link;
            l.hold_until = l.hold_until.max(hold);
        }
        let latency = us(self.rng.range(100, 1500));
        let answer_after = us(self.rng.range(100, 1500));
        let link = &mut self.slots[slot].link;
        let apply_at = (now + latency).max(link.hold_until).max(link.last_apply + us(1));
        link.last_apply = apply_at;
        let answered_at = (apply_at + answer_after).max(self.slots[slot].link.hold_until);
        if lost_response || answered_at > now + timeout {
            if lost_response {
                self.fault("response_lost");
            }
            lost_response = true;
            self.respond(slot, life, op, no_answer(write, timeout), timeout);
        }
        let answer = if lost_response {
            Answer::Dropped
        } else {
            Answer::After(answered_at.saturating_since(apply_at))
        };
        let deadline = now + timeout;
        self.schedule_at(
            apply_at,
            Ev::StoreApply { slot, life, op, bucket, request, writer, answer, deadline },
        );
    }

    /// A request reaches the store.
    /// `life` is the sender's incarnation: a dead process's answer never reaches its successor,
    /// whose operation ids start again.
    pub(crate) fn store_apply(&mut self, sent: Sent) {
        let write = sent.request.is_write();
        let link = self.slots[sent.slot].link;
        if self.now < self.outage_until || self.now < link.cut_until {
            // The server went down, or the connection was reset, with the request in flight.
            if let Answer::After(_) = sent.answer {
                let timeout = self.opts.op_timeout;
                self.respond(sent.slot, sent.life, sent.op, no_answer(write, timeout), timeout);
            }
            return;
        }
        if let Some(stuck) = &self.stuck[bi(sent.bucket)] {
            let now = self.now;
            if stuck.isolates(sent.slot) {
                if write {
                    return self.hold_at_stuck_leader(sent);
                }
                return self.read_through_stuck_leader(sent);
            }
            if !stuck.elected(now) {
                // The other nodes have no stream leader yet: nothing is applied.
                self.fault("request_without_stream_leader");
                if let Answer::After(_) = sent.answer {
                    let (result, after) = if self.rng.chance(0.5) {
                        (
                            Err(StoreError::Unavailable("no responders: the stream has no leader".into())),
                            us(500),
                        )
                    } else {
                        (no_answer(write, self.opts.op_timeout), sent.deadline.saturating_since(now))
                    };
                    self.respond(sent.slot, sent.life, sent.op, result, after);
                }
                return;
            }
        }
        self.apply_and_answer(sent);
    }

    /// A read through the cut-off node: its leader answers from the state it had when it was
    /// cut off (the other side may have moved on since).
    fn read_through_stuck_leader(&mut self, sent: Sent) {
        let now = self.now;
        let Sent { slot, life, op, bucket, request, answer, .. } = sent;
        let current = self.kv(bucket).execute(now, request.clone());
        let stuck = self.stuck[bi(bucket)].as_mut().expect("stuck");
        let result = stuck.snapshot.execute(now, request);
        let keys_of = |r: &StoreResult| -> Vec<Key> {
            match r {
                Ok(StoreReply::Value(Some(e))) => vec![e.key.clone()],
                Ok(StoreReply::Entries(es)) => es.iter().map(|e| e.key.clone()).collect(),
                _ => Vec::new(),
            }
        };
        if result != current {
            self.fault("read_from_cut_off_leader_behind");
            let answered = keys_of(&result);
            let missing: Vec<Key> = keys_of(&current).into_iter().filter(|k| !answered.contains(k)).collect();
            if !missing.is_empty() && answer != Answer::Dropped {
                self.stale_answers.insert((slot, life, op), missing);
            }
        }
        if let Answer::After(d) = answer {
            self.respond(slot, life, op, result, d);
        }
    }

    fn apply_and_answer(&mut self, sent: Sent) {
        let Sent { slot, life, op, bucket, request, writer, answer, .. } = sent;
        let write = request.is_write();
        let result = if write {
            self.apply_write(&writer, bucket, request)
        } else {
            let (result, missing) = self.read(bucket, request);
            if !missing.is_empty() && answer != Answer::Dropped {
                self.stale_answers.insert((slot, life, op), missing);
            }
            result
        };
        if let (Ok(StoreReply::Written(rev)), Answer::Dropped, Bucket::Lease) = (&result, answer, bucket) {
            // The writer never learns this write landed (its answer is in doubt).
            self.unacked_lease_writes.insert(*rev);
        }
        self.distribute(Bucket::State);
        self.distribute(Bucket::Lease);
        if let Answer::After(d) = answer {
            self.respond(slot, life, op, result, d);
        }
    }

    /// A write reaches a stream leader that cannot commit: it waits with the others, in order;
    /// one to a key that already has a write waiting is refused at once.
    fn hold_at_stuck_leader(&mut self, mut sent: Sent) {
        let now = self.now;
        let key = written_key(&sent.request).clone();
        let stuck = self.stuck[bi(sent.bucket)].as_ref().expect("stuck");
        let until = stuck.until;
        if stuck.pending.iter().any(|p| written_key(&p.request) == &key) {
            self.fault("write_refused_while_one_is_pending");
            let live = self.stuck[bi(sent.bucket)].as_mut().expect("stuck").snapshot.get(now, &key).is_some();
            let result = match sent.request {
                // The backend reads the key after the refusal: a live value is reported as such;
                // none means nothing it could write over, and nothing was applied.
                StoreRequest::Create { .. } if live => Err(StoreError::AlreadyExists(key)),
                StoreRequest::Create { .. } => Err(StoreError::Unavailable(format!(
                    "creating {key}: another write to it is pending at the stream leader"
                ))),
                _ => Err(StoreError::RevisionMismatch(key)),
            };
            if let Answer::After(d) = sent.answer {
                self.respond(sent.slot, sent.life, sent.op, result, d);
            }
            return;
        }
        if let Some(refused) = self.refused_by_stuck_leader(sent.bucket, &sent.request) {
            // The leader checks the expected revision on arrival, against its own state: a write
            // that cannot apply is refused at once, as a healthy leader would.
            if let Answer::After(d) = sent.answer {
                self.respond(sent.slot, sent.life, sent.op, Err(refused), d);
            }
            return;
        }
        if let Answer::After(d) = sent.answer
            && until + d > sent.deadline
        {
            // The sender times out before the leader can answer.
            let timeout = self.opts.op_timeout;
            let wait = sent.deadline.saturating_since(now);
            self.respond(sent.slot, sent.life, sent.op, no_answer(true, timeout), wait);
            sent.answer = Answer::Dropped;
        }
        if sent.bucket == Bucket::State
            && let Some(id) = keys::parse_split(&key)
            && let Some(value) = written_value(&sent.request)
            && let Ok(record) = records::decode::<SplitRecord>(value)
        {
            let origin = self.checker.lease_origin(&id, record.epoch, &sent.writer);
            sent.accepted_origin = Some((id, record.epoch, origin));
        }
        self.stuck[bi(sent.bucket)].as_mut().expect("stuck").pending.push(sent);
    }

    /// Whether another owner's write to the record or lease of `split` waits at a stuck leader.
    pub(crate) fn foreign_write_waiting(&self, split: &SplitId, me: &Owner) -> bool {
        let key = keys::split(split);
        self.stuck
            .iter()
            .flatten()
            .flat_map(|s| &s.pending)
            .any(|p| *written_key(&p.request) == key && p.writer != *me)
    }

    /// The error a write gets if its condition fails against the stuck leader's state.
    fn refused_by_stuck_leader(&mut self, bucket: Bucket, request: &StoreRequest) -> Option<StoreError> {
        let now = self.now;
        let key = written_key(request).clone();
        let stuck = self.stuck[bi(bucket)].as_mut().expect("stuck");
        let current = stuck.snapshot.get(now, &key).map(|e| e.revision);
        match request {
            StoreRequest::Create { .. } => current.map(|_| StoreError::AlreadyExists(key)),
            StoreRequest::CompareAndSwap { expected, .. } | StoreRequest::Delete { expected, .. } => {
                (current != Some(*expected)).then_some(StoreError::RevisionMismatch(key))
            }
            other => unreachable!("not a write: {other:?}"),
        }
    }

    /// The stuck leader of `bucket` regains its quorum or steps down: the next leader's log has
    /// every waiting write, a prefix of them (the ones replicated in time), or none.
    /// With a new leader elected meanwhile, the cut-off one's waiting writes are dropped (its
    /// uncommitted log is truncated when it rejoins).
    pub(crate) fn recover_stream(&mut self, bucket: Bucket) {
        let Some(stuck) = self.stuck[bi(bucket)].take() else { return };
        let n = stuck.pending.len() as u64;
        let keep = match self.rng.range(0, 3) {
            _ if stuck.elected(self.now) => 0,
            0 | 1 => n,
            2 => self.rng.range(0, n),
            _ => 0,
        };
        for (i, mut sent) in stuck.pending.into_iter().enumerate() {
            if (i as u64) < keep {
                let Some((id, epoch, origin)) = sent.accepted_origin.take() else {
                    self.apply_and_answer(sent);
                    continue;
                };
                let writer = sent.writer.clone();
                let now_origin = self.checker.replace_lease_origin(&id, epoch, &writer, origin);
                self.apply_and_answer(sent);
                self.checker.replace_lease_origin(&id, epoch, &writer, now_origin);
                continue;
            }
            self.fault("pending_write_dropped");
            if let Answer::After(_) = sent.answer {
                let (timeout, wait) = (self.opts.op_timeout, sent.deadline.saturating_since(self.now));
                self.respond(sent.slot, sent.life, sent.op, no_answer(true, timeout), wait);
            }
        }
    }

    /// A read, possibly answered by a replica that lags behind (history as of an earlier time).
    /// Also gives the keys the answer calls absent although the store has them (a lagging
    /// replica's "absent" the core cannot tell from an expiry).
    fn read(&mut self, bucket: Bucket, request: StoreRequest) -> (StoreResult, Vec<Key>) {
        let now = self.now;
        if !(self.faults_on && self.opts.stale_reads > 0.0 && self.rng.chance(self.opts.stale_reads)) {
            return (self.kv(bucket).execute(now, request), Vec::new());
        }
        let lag = ms(self.rng.range(0, self.opts.max_lag.as_millis() as u64));
        let as_of = Timestamp(now.0.saturating_sub(lag.as_micros() as u64));
        self.fault("stale_read");
        let current = self.kv(bucket).execute(now, request.clone());
        let h = &self.history[bi(bucket)];
        let answer = match request {
            StoreRequest::Get { key } => Ok(StoreReply::Value(as_of_entry(h, &key, as_of))),
            StoreRequest::List { prefix } => Ok(StoreReply::Entries(as_of_list(h, &prefix, as_of))),
            other => unreachable!("not a read: {other:?}"),
        };
        let present = |r: &StoreResult| -> Vec<Key> {
            match r {
                Ok(StoreReply::Value(Some(e))) => vec![e.key.clone()],
                Ok(StoreReply::Entries(es)) => es.iter().map(|e| e.key.clone()).collect(),
                _ => Vec::new(),
            }
        };
        let answered = present(&answer);
        let missing = present(&current).into_iter().filter(|k| !answered.contains(k)).collect();
        (answer, missing)
    }

    fn apply_write(&mut self, writer: &Owner, bucket: Bucket, request: StoreRequest) -> StoreResult {
        let now = self.now;
        let key = written_key(&request).clone();
        let old = self.kv(bucket).get(now, &key);
        let old_deadline = self.kv(bucket).expires_at(&key);
        let is_cas = matches!(request, StoreRequest::CompareAndSwap { .. });
        let is_delete = matches!(request, StoreRequest::Delete { .. });
        let result = self.kv(bucket).execute(now, request);
        let Ok(reply) = &result else { return result };
        let split = keys::parse_split(&key);
        match bucket {
            Bucket::State => {
                if is_delete {
                    if let Some(id) = &split {
                        self.checker.on_record_deleted(now, id, writer);
                    }
                    return result;
                }
                let new = self.state.get(now, &key).expect("just written");
                if let Some(id) = &split {
                    if let Some(e) = &old
                        && records::decode::<SplitRecord>(&e.value).is_err()
                    {
                        self.checker.fail(
                            now,
                            "I3",
                            format!("split {id}: {writer} wrote over a record it cannot have decoded"),
                        );
                    }
                    let old = old.as_ref().and_then(|e| records::decode::<SplitRecord>(&e.value).ok());
                    let new = records::decode::<SplitRecord>(&new.value)
                        .expect("protocol writes decodable records");
                    self.checker.on_split_write(now, writer, id, old.as_ref(), &new);
                } else if key == keys::plan_head() {
                    let old = old.as_ref().and_then(|e| records::decode::<PlanHead>(&e.value).ok());
                    let new = records::decode::<PlanHead>(&new.value).expect("decodable head");
                    self.checker.on_head_write(now, writer, old.as_ref(), &new, &mut self.state);
                }
            }
            Bucket::Lease => {
                let Some(id) = split else { return result };
                if is_delete {
                    self.checker.on_lease_deleted(now, &id);
                    return result;
                }
                let StoreReply::Written(rev) = reply else { return result };
                let new = self.lease.get(now, &key).expect("just written");
                let lease = records::decode::<LeaseRecord>(&new.value).expect("decodable lease");
                let prev = old.as_ref().and_then(|e| records::decode::<LeaseRecord>(&e.value).ok());
                let deadline = self.lease.expires_at(&key).unwrap_or(now);
                self.checker.on_lease_write(now, &id, prev.as_ref(), &lease, deadline);
                // NATS trap: a renewal that lands within ~10 ms of the previous revision's expiry
                // can be acknowledged and then erased by that expiry.
                if is_cas
                    && self.faults_on
                    && let Some(d) = old_deadline
                    && now + ms(10) >= d
                    && self.rng.chance(0.5)
                {
                    let fires = (d + self.expiry_lateness(&key, d)).max(now);
                    self.schedule_at(fires, Ev::Erase { key, revision: *rev });
                }
            }
        }
        result
    }

    /// An acknowledged renewal erased by the expiry decided for the revision before it.
    pub(crate) fn erase(&mut self, key: Key, revision: Revision) {
        let now = self.now;
        if self.lease.get(now, &key).is_some_and(|e| e.revision == revision) {
            self.fault("renewal_erased_by_expiry");
            self.lease.erase_as_expired(&key);
            self.distribute(Bucket::Lease);
        }
    }

    /// How late the expiry of `key` due at `deadline` fires, beyond the 250 ms timer:
    /// deterministic per key and deadline, up to `expiry_late_max`.
    pub(crate) fn expiry_lateness(&self, key: &Key, deadline: Timestamp) -> Duration {
        let max = self.opts.expiry_late_max.as_millis() as u64;
        if max == 0 {
            return Duration::ZERO;
        }
        let mut h: u64 = 0xcbf2_9ce4_8422_2325 ^ deadline.0 ^ self.report.seed;
        for b in key.as_str().bytes() {
            h = (h ^ b as u64).wrapping_mul(0x0100_0000_01b3);
        }
        h ^= h >> 29;
        ms(h % (max + 1))
    }

    /// The expiry timer: overdue keys expire once their lateness has passed (and not while the
    /// lease stream's leader cannot commit: expiry markers are writes of the leader's too).
    pub(crate) fn expiry_tick(&mut self) {
        let now = self.now;
        if self.stuck[bi(Bucket::Lease)].as_ref().is_some_and(|s| !s.elected(now)) {
            return;
        }
        let due: Vec<(Key, bool)> = self
            .lease
            .overdue(now)
            .into_iter()
            .filter_map(|(k, d)| {
                let late = self.expiry_lateness(&k, d);
                (d + late <= now).then_some((k, late > Duration::ZERO))
            })
            .collect();
        for (key, late) in due {
            if late {
                self.fault("expiry_late");
            }
            self.lease.erase_as_expired(&key);
        }
        self.distribute(Bucket::State);
        self.distribute(Bucket::Lease);
    }

    /// Feeds the store's new events to the history, the checker and the watches.
    pub(crate) fn distribute(&mut self, bucket: Bucket) {
        let now = self.now;
        let events = self.kv(bucket).take_events();
        let horizon = Timestamp(now.0.saturating_sub(self.opts.max_lag.as_micros() as u64));
        for ev in events {
            if bucket == Bucket::Lease {
                self.checker.on_lease_event(&ev);
            }
            let Some(key) = ev.key().cloned() else { continue };
            let versions = self.history[bi(bucket)].entry(key.clone()).or_default();
            versions.push_back((now, if let WatchEvent::Put(e) = &ev { Some(e.clone()) } else { None }));
            while versions.len() > 1 && versions[1].0 <= horizon {
                versions.pop_front();
            }
            for i in 0..self.subs.len() {
                let sub = &self.subs[i];
                if sub.watch.bucket() != bucket || !sub.watch.prefix().matches(&key) {
                    continue;
                }
                let mut delay = us(self.rng.range(200, 3000));
                if self.faults_on && self.rng.chance(0.01) {
                    delay += ms(self.rng.range(50, 500));
                }
                let mut held = self.slots[self.subs[i].slot].link.hold_until;
                if let Some(stuck) = &self.stuck[bi(bucket)]
                    && !stuck.everyone
                    && stuck.isolates(self.subs[i].slot)
                {
                    // The cut-off node's consumers see the other side's writes when it rejoins.
                    held = held.max(stuck.until);
                }
                let at = (self.now + delay).max(held).max(Timestamp(self.subs[i].last_at.0 + 1));
                self.subs[i].last_at = at;
                let (slot, life, watch) = (self.subs[i].slot, self.subs[i].life, self.subs[i].watch);
                let input = etl_coordination_core::Input::Watch { watch, event: ev.clone() };
                self.schedule_at(at, Ev::ToWorker { slot, life, input });
            }
        }
    }

    pub(crate) fn open_watch(&mut self, slot: usize, life: u32, watch: WatchId) {
        if self.slots[slot].life != life {
            return;
        }
        self.subs.retain(|s| !(s.slot == slot && s.watch == watch));
        let link = self.slots[slot].link;
        let stuck_here =
            self.stuck[bi(watch.bucket())].as_ref().is_some_and(|s| s.isolates(slot) && !s.everyone);
        if self.now < self.outage_until || link.refuses(self.now, watch.bucket(), false) || stuck_here {
            // (A consumer cannot be created on a node cut off from the others.)
            let input = etl_coordination_core::Input::WatchFailed { watch };
            return self.schedule(ms(300), Ev::ToWorker { slot, life, input });
        }
        let now = self.now;
        let entries = self.kv(watch.bucket()).list(now, &watch.prefix());
        let mut at = self.now.max(link.hold_until);
        for e in entries {
            at = at + us(self.rng.range(1, 50));
            let input = etl_coordination_core::Input::Watch { watch, event: WatchEvent::Put(e) };
            self.schedule_at(at, Ev::ToWorker { slot, life, input });
        }
        at = at + us(1);
        let input = etl_coordination_core::Input::Watch { watch, event: WatchEvent::SnapshotComplete };
        self.schedule_at(at, Ev::ToWorker { slot, life, input });
        self.subs.push(Sub { slot, life, watch, last_at: at });
    }

    /// Breaks the watches of `slot` (all, or one bucket's) as a broken connection does.
    pub(crate) fn break_watches(&mut self, slot: usize, bucket: Option<Bucket>) {
        let (gone, keep): (Vec<Sub>, Vec<Sub>) = std::mem::take(&mut self.subs)
            .into_iter()
            .partition(|s| s.slot == slot && bucket.is_none_or(|b| s.watch.bucket() == b));
        self.subs = keep;
        for s in gone {
            let d = ms(self.rng.range(1, 100));
            let input = etl_coordination_core::Input::WatchFailed { watch: s.watch };
            self.schedule(d, Ev::ToWorker { slot: s.slot, life: s.life, input });
        }
    }
}

fn written_value(request: &StoreRequest) -> Option<&bytes::Bytes> {
    match request {
        StoreRequest::Create { value, .. } | StoreRequest::CompareAndSwap { value, .. } => Some(value),
        _ => None,
    }
}

fn written_key(request: &StoreRequest) -> &Key {
    match request {
        StoreRequest::Create { key, .. }
        | StoreRequest::CompareAndSwap { key, .. }
        | StoreRequest::Delete { key, .. } => key,
        other => unreachable!("not a write: {other:?}"),
    }
}

fn as_of_entry(h: &History, key: &Key, t: Timestamp) -> Option<Entry> {
    h.get(key)?.iter().rev().find(|(at, _)| *at <= t).and_then(|(_, e)| e.clone())
}

fn as_of_list(h: &History, prefix: &Prefix, t: Timestamp) -> Vec<Entry> {
    h.iter().filter(|(k, _)| prefix.matches(k)).filter_map(|(k, _)| as_of_entry(h, k, t)).collect()
}
