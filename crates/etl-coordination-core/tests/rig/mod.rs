//! A tiny synchronous test rig: a worker plus the memory store's semantics ([`MemoryKv`]),
//! answering its requests automatically (for setting up a situation) or letting a test answer
//! by hand (to assert exact action sequences).

#![allow(dead_code)]

use std::time::Duration;

use bytes::Bytes;
use etl_coordination_core::records::{self, keys};
use etl_coordination_core::*;
use etl_coordination_memory::MemoryKv;

pub fn id(s: &str) -> InstanceId {
    InstanceId::new(s).unwrap()
}

pub fn sid(s: &str) -> SplitId {
    SplitId::new(s).unwrap()
}

pub fn cfg(name: &str, incarnation: u64) -> Config {
    let mut c = Config::new(id(name), Incarnation(incarnation), "fp-1");
    c.tuning.lease_duration = Duration::from_secs(3);
    c.tuning.max_in_flight = 4;
    c.tuning.max_attempts = 2;
    c
}

/// The store of a rig: the two buckets as [`MemoryKv`]s (the executable specification), with
/// expiry only when the rig advances time (so peers frozen in the store can stay live), and the
/// worker's watches to route events to.
pub struct Kv {
    pub state: MemoryKv,
    pub lease: MemoryKv,
    pub now: Timestamp,
    /// The watches the worker opened.
    pub watches: Vec<WatchId>,
    /// Every request applied, in order (to assert what was written before what).
    pub history: Vec<(Bucket, StoreRequest)>,
}

impl Default for Kv {
    fn default() -> Self {
        Kv {
            state: MemoryKv::with_explicit_expiry(),
            lease: MemoryKv::with_explicit_expiry(),
            now: Timestamp::ZERO,
            watches: Vec::new(),
            history: Vec::new(),
        }
    }
}

impl Kv {
    fn bucket(&mut self, bucket: Bucket) -> &mut MemoryKv {
        match bucket {
            Bucket::State => &mut self.state,
            Bucket::Lease => &mut self.lease,
        }
    }

    /// Executes one request; returns its result and the watch events it caused, per watch.
    pub fn apply(&mut self, bucket: Bucket, req: &StoreRequest) -> (StoreResult, Vec<(WatchId, WatchEvent)>) {
        let now = self.now;
        self.history.push((bucket, req.clone()));
        let result = self.bucket(bucket).execute(now, req.clone());
        (result, self.route(bucket))
    }

    fn route(&mut self, bucket: Bucket) -> Vec<(WatchId, WatchEvent)> {
        let events = self.bucket(bucket).take_events();
        events
            .into_iter()
            .flat_map(|e| {
                let key = e.key().expect("stores emit keyed events").clone();
                self.watches
                    .iter()
                    .filter(|w| w.bucket() == bucket && w.prefix().matches(&key))
                    .map(|w| (*w, e.clone()))
                    .collect::<Vec<_>>()
            })
            .collect()
    }

    /// Expires lease keys whose TTL ran out by `now`; returns the watch events.
    pub fn expire(&mut self, now: Timestamp) -> Vec<(WatchId, WatchEvent)> {
        self.now = now;
        self.lease.expire(now);
        self.route(Bucket::Lease)
    }

    pub fn get(&mut self, bucket: Bucket, key: &str) -> Option<Entry> {
        let now = self.now;
        self.bucket(bucket).get(now, &Key::new(key).unwrap())
    }

    pub fn list(&mut self, bucket: Bucket, prefix: &Prefix) -> Vec<Entry> {
        let now = self.now;
        self.bucket(bucket).list(now, prefix)
    }

    /// Writes `value` whatever is there (a peer's write the worker does not see coming; no
    /// watch event is delivered).
    pub fn put<T: serde::Serialize>(&mut self, bucket: Bucket, key: &Key, value: &T) -> Revision {
        let now = self.now;
        let kv = self.bucket(bucket);
        let value = records::encode(value);
        let rev = match kv.get(now, key) {
            Some(e) => kv.compare_and_swap(now, key, e.revision, value, None),
            None => kv.create(now, key, value, None),
        }
        .expect("rig write");
        kv.take_events();
        rev
    }

    pub fn record(&mut self, split: &str) -> records::SplitRecord {
        records::decode(&self.get(Bucket::State, &format!("split.{split}")).unwrap().value).unwrap()
    }
}

/// A worker wired to a [`Kv`].
pub struct Rig {
    pub w: Worker,
    pub now: Timestamp,
    pub kv: Kv,
    /// Store actions not yet answered (manual mode).
    pub pending: Vec<(OpId, Bucket, StoreRequest)>,
    /// Every non-store action emitted, in order.
    pub log: Vec<Action>,
    pub auto: bool,
    pub plan: Option<Plan>,
    /// Whether TTL'd keys expire as time advances (off: peers frozen in the store stay live).
    pub expire: bool,
    /// Whether a watch the worker opens is only subscribed (its live events routed) and its
    /// snapshot left to the test to feed, event by event.
    pub hold_snapshots: bool,
}

impl Rig {
    pub fn new(cfg: Config) -> Self {
        Rig {
            w: Worker::new(cfg),
            now: Timestamp::ZERO,
            kv: Kv::default(),
            pending: Vec::new(),
            log: Vec::new(),
            auto: true,
            plan: None,
            expire: true,
            hold_snapshots: false,
        }
    }

    /// Feeds an input; in auto mode answers store requests, opens watches and runs the planner
    /// until the worker is quiet.
    pub fn feed(&mut self, input: Input) -> Vec<Action> {
        let actions = self.w.handle(self.now, input);
        self.absorb(actions.clone());
        actions
    }

    /// Handles actions breadth-first through one FIFO queue, as a real store would answer in
    /// order: a result never overtakes the watch events of writes sent before it.
    fn absorb(&mut self, actions: Vec<Action>) {
        let mut queue: std::collections::VecDeque<Input> = Default::default();
        self.enqueue(actions, &mut queue);
        while let Some(input) = queue.pop_front() {
            let actions = self.w.handle(self.now, input);
            self.enqueue(actions, &mut queue);
        }
    }

    fn enqueue(&mut self, actions: Vec<Action>, queue: &mut std::collections::VecDeque<Input>) {
        for a in actions {
            match a {
                Action::Store { op, bucket, request } => {
                    if self.auto {
                        let (result, events) = self.kv.apply(bucket, &request);
                        if std::env::var_os("RIG_TRACE").is_some() {
                            println!("{op:?} {bucket:?} {request:?} => {result:?}");
                        }
                        queue.push_back(Input::StoreResult { op, result });
                        for (watch, event) in events {
                            queue.push_back(Input::Watch { watch, event });
                        }
                    } else {
                        self.pending.push((op, bucket, request));
                    }
                }
                Action::Watch { watch } => {
                    self.kv.watches.retain(|w| *w != watch);
                    self.kv.watches.push(watch);
                    if self.hold_snapshots {
                        self.log.push(Action::Watch { watch });
                        continue;
                    }
                    for e in self.kv.list(watch.bucket(), &watch.prefix()) {
                        queue.push_back(Input::Watch { watch, event: WatchEvent::Put(e) });
                    }
                    queue.push_back(Input::Watch { watch, event: WatchEvent::SnapshotComplete });
                    self.log.push(Action::Watch { watch });
                }
                Action::Plan { request } if self.plan.is_some() => {
                    let plan = self.plan.clone().expect("rig has a plan");
                    queue.push_back(Input::PlanReady { request, result: Ok(plan) });
                    self.log.push(Action::Plan { request });
                }
                other => self.log.push(other),
            }
        }
    }

    /// Answers one pending store request (manual mode) with `result`.
    pub fn answer(&mut self, op: OpId, result: StoreResult) -> Vec<Action> {
        self.pending.retain(|(o, _, _)| *o != op);
        self.feed(Input::StoreResult { op, result })
    }

    /// Answers one pending request by applying it to the kv (manual mode).
    pub fn apply(&mut self, op: OpId) -> Vec<Action> {
        let i = self.pending.iter().position(|(o, _, _)| *o == op).expect("pending op");
        let (op, bucket, req) = self.pending.remove(i);
        let (result, _) = self.kv.apply(bucket, &req);
        self.feed(Input::StoreResult { op, result })
    }

    /// Answers a request taken from `pending` by applying it to the kv (no watch events).
    pub fn answer_applied(&mut self, op: OpId, bucket: Bucket, req: &StoreRequest) -> Vec<Action> {
        let (result, _) = self.kv.apply(bucket, req);
        self.feed(Input::StoreResult { op, result })
    }

    /// Applies a pending request to the kv, delivers its watch events, and answers with
    /// `result` instead of the real result (to model lost answers), or the real one.
    pub fn apply_and_answer(&mut self, index: usize, answer: Option<StoreResult>) -> Vec<Action> {
        let (op, bucket, req) = self.pending.remove(index);
        let (result, events) = self.kv.apply(bucket, &req);
        let mut out = Vec::new();
        for (watch, event) in events {
            out.extend(self.feed(Input::Watch { watch, event }));
        }
        out.extend(self.feed(Input::StoreResult { op, result: answer.unwrap_or(result) }));
        out
    }

    /// Writes raw bytes over whatever `key` holds (another program, an operator's repair) and
    /// delivers the watch events; returns the revision written.
    pub fn write_raw(&mut self, bucket: Bucket, key: &str, value: Bytes) -> Revision {
        let key = Key::new(key).unwrap();
        let request = match self.kv.get(bucket, key.as_str()) {
            Some(e) => StoreRequest::CompareAndSwap { key, expected: e.revision, value, ttl: None },
            None => StoreRequest::Create { key, value, ttl: None },
        };
        let (result, events) = self.kv.apply(bucket, &request);
        for (watch, event) in events {
            self.feed(Input::Watch { watch, event });
        }
        match result.expect("raw write") {
            StoreReply::Written(rev) => rev,
            other => panic!("unexpected reply {other:?}"),
        }
    }

    /// The events emitted so far (from the log).
    pub fn events(&self) -> Vec<Event> {
        self.log
            .iter()
            .filter_map(|a| match a {
                Action::Event(e) => Some(e.clone()),
                _ => None,
            })
            .collect()
    }

    /// The last gauges reported.
    pub fn last_gauges(&self) -> Option<Event> {
        self.events().into_iter().rev().find(|e| matches!(e, Event::Gauges { .. }))
    }

    /// Moves time forward: TTL'd keys expire (their watch events are delivered), then a tick.
    pub fn advance(&mut self, d: Duration) -> Vec<Action> {
        self.now = self.now + d;
        self.kv.now = self.now;
        let mut out = Vec::new();
        let events = if self.expire { self.kv.expire(self.now) } else { Vec::new() };
        for (watch, event) in events {
            out.extend(self.feed(Input::Watch { watch, event }));
        }
        out.extend(self.feed(Input::Tick));
        out
    }

    /// Splits with lanes started (from the log), in order.
    pub fn started(&self) -> Vec<(SplitId, Epoch)> {
        self.log
            .iter()
            .filter_map(|a| match a {
                Action::StartLane { split, epoch, .. } => Some((split.clone(), *epoch)),
                _ => None,
            })
            .collect()
    }

    pub fn take_log(&mut self) -> Vec<Action> {
        std::mem::take(&mut self.log)
    }
}

/// A plan of `n` splits `s0..s{n-1}` with weights `1..=n` (s{n-1} is the largest).
pub fn plan(n: usize, kind: PlanKind) -> Plan {
    let splits = (0..n).map(|i| PlannedSplit::new(sid(&format!("s{i}")), format!("d{i}"), i as u64 + 1));
    Plan::new(kind, splits.collect())
}

pub fn lease_of(kv: &mut Kv, split: &str) -> Option<records::LeaseRecord> {
    kv.get(Bucket::Lease, &format!("split.{split}")).map(|e| records::decode(&e.value).unwrap())
}

pub fn presence_key(name: &str) -> Key {
    keys::worker(&id(name))
}
