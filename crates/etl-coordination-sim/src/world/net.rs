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
    Bucket, Entry, Key, OpId, Owner, Prefix, StoreError, StoreReply, StoreRequest, StoreResult, Timestamp,
};
use etl_coordination_memory::MemoryKv;

use super::{Answer, Ev, World, ms, us};
use crate::check::{HeldWrite, Observation};
use crate::fault::Fault;

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

    pub(super) fn refuses(&self, now: Timestamp, bucket: Bucket, write: bool) -> bool {
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
    /// For a split record write waiting at a stuck leader: what the checker judges it by when
    /// it lands (the acquisition it was made for, when the leader took it).
    pub held: Option<HeldWrite>,
}

pub(crate) fn bi(b: Bucket) -> usize {
    match b {
        Bucket::State => 0,
        Bucket::Lease => 1,
    }
}

pub(super) fn no_answer(write: bool, timeout: Duration) -> StoreResult {
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

    pub(super) fn respond(&mut self, slot: usize, life: u32, op: OpId, result: StoreResult, after: Duration) {
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
        if bucket == Bucket::State
            && write
            && let key = written_key(&request)
            && (*key == keys::plan_head() || keys::parse_manifest(key).is_some())
        {
            // Only a leader writes the plan, and only while its leadership lease lives.
            self.checker.observe(now, Observation::LeaderWrites { who: &writer, key }, &mut self.state);
        }
        let roll = if self.faults_on { self.rng.range(0, 999) } else { 999 };
        if roll < 10 {
            // The request is lost on the way: never applied.
            self.fault(Fault::RequestLost);
            return self.respond(slot, life, op, no_answer(write, timeout), timeout);
        }
        let mut lost_response = roll < 20;
        if (20..30).contains(&roll) {
            // The link stalls: this request and everything after it lands late, in order.
            self.fault(Fault::LinkStalledBriefly);
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
                self.fault(Fault::ResponseLost);
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
                self.fault(Fault::RequestWithoutStreamLeader);
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

    pub(super) fn apply_and_answer(&mut self, sent: Sent) {
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

    /// A read, possibly answered by a replica that lags behind (history as of an earlier time).
    /// Also gives the keys the answer calls absent although the store has them (a lagging
    /// replica's "absent" the core cannot tell from an expiry).
    pub(super) fn read(&mut self, bucket: Bucket, request: StoreRequest) -> (StoreResult, Vec<Key>) {
        let now = self.now;
        if !(self.faults_on && self.opts.stale_reads > 0.0 && self.rng.chance(self.opts.stale_reads)) {
            return (self.kv(bucket).execute(now, request), Vec::new());
        }
        let lag = ms(self.rng.range(0, self.opts.max_lag.as_millis() as u64));
        let as_of = Timestamp(now.0.saturating_sub(lag.as_micros() as u64));
        self.fault(Fault::StaleRead);
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

    pub(super) fn apply_write(
        &mut self,
        writer: &Owner,
        bucket: Bucket,
        request: StoreRequest,
    ) -> StoreResult {
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
                        self.checker.observe(now, Observation::RecordDeleted { id, writer }, &mut self.state);
                    }
                    return result;
                }
                let new = self.state.get(now, &key).expect("just written");
                if let Some(id) = &split {
                    let old_undecodable =
                        old.as_ref().is_some_and(|e| records::decode::<SplitRecord>(&e.value).is_err());
                    let old = old.as_ref().and_then(|e| records::decode::<SplitRecord>(&e.value).ok());
                    let new = records::decode::<SplitRecord>(&new.value)
                        .expect("protocol writes decodable records");
                    let obs = Observation::SplitWritten {
                        writer,
                        id,
                        old: old.as_ref(),
                        new: &new,
                        old_undecodable,
                    };
                    self.checker.observe(now, obs, &mut self.state);
                } else if key == keys::plan_head() {
                    let old = old.as_ref().and_then(|e| records::decode::<PlanHead>(&e.value).ok());
                    let new = records::decode::<PlanHead>(&new.value).expect("decodable head");
                    let obs = Observation::HeadWritten { writer, old: old.as_ref(), new: &new };
                    self.checker.observe(now, obs, &mut self.state);
                }
            }
            Bucket::Lease => {
                if key == keys::leader() {
                    // The leadership lease: when it dies in the store's time (the leader's trust).
                    let holder = old.as_ref().and_then(|e| {
                        records::decode::<etl_coordination_core::records::LeaderRecord>(&e.value).ok()
                    });
                    let written = match reply {
                        StoreReply::Written(_) if !is_delete => self.lease.get(now, &key).and_then(|e| {
                            records::decode::<etl_coordination_core::records::LeaderRecord>(&e.value).ok()
                        }),
                        _ => None,
                    };
                    let deadline = self.lease.expires_at(&key).unwrap_or(now);
                    let obs = match (&written, &holder) {
                        (Some(l), _) => Observation::LeaderLease { owner: &l.owner, deadline },
                        (None, Some(l)) if is_delete => {
                            Observation::LeaderLease { owner: &l.owner, deadline: now }
                        }
                        _ => return result,
                    };
                    self.checker.observe(now, obs, &mut self.state);
                    return result;
                }
                let Some(id) = split else { return result };
                if is_delete {
                    self.checker.observe(now, Observation::LeaseDeleted { id: &id }, &mut self.state);
                    return result;
                }
                let StoreReply::Written(rev) = reply else { return result };
                let new = self.lease.get(now, &key).expect("just written");
                let lease = records::decode::<LeaseRecord>(&new.value).expect("decodable lease");
                let prev = old.as_ref().and_then(|e| records::decode::<LeaseRecord>(&e.value).ok());
                let deadline = self.lease.expires_at(&key).unwrap_or(now);
                let obs = Observation::LeaseWritten { id: &id, prev: prev.as_ref(), new: &lease, deadline };
                self.checker.observe(now, obs, &mut self.state);
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
}

pub(super) fn written_value(request: &StoreRequest) -> Option<&bytes::Bytes> {
    match request {
        StoreRequest::Create { value, .. } | StoreRequest::CompareAndSwap { value, .. } => Some(value),
        _ => None,
    }
}

pub(super) fn written_key(request: &StoreRequest) -> &Key {
    match request {
        StoreRequest::Create { key, .. }
        | StoreRequest::CompareAndSwap { key, .. }
        | StoreRequest::Delete { key, .. } => key,
        other => unreachable!("not a write: {other:?}"),
    }
}

pub(super) fn as_of_entry(h: &History, key: &Key, t: Timestamp) -> Option<Entry> {
    h.get(key)?.iter().rev().find(|(at, _)| *at <= t).and_then(|(_, e)| e.clone())
}

pub(super) fn as_of_list(h: &History, prefix: &Prefix, t: Timestamp) -> Vec<Entry> {
    h.iter().filter(|(k, _)| prefix.matches(k)).filter_map(|(k, _)| as_of_entry(h, k, t)).collect()
}
