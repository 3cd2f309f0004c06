//! A tiny synchronous test rig: a worker plus an in-test key-value store that can answer its
//! requests automatically (for setting up a situation) or let a test answer by hand (to assert
//! exact action sequences).

#![allow(dead_code)]

use std::collections::BTreeMap;
use std::time::Duration;

use bytes::Bytes;
use etl_coordination_core::records::{self, keys};
use etl_coordination_core::*;

pub fn id(s: &str) -> InstanceId {
    InstanceId::new(s).unwrap()
}

pub fn sid(s: &str) -> SplitId {
    SplitId::new(s).unwrap()
}

pub fn cfg(name: &str, incarnation: u64) -> Config {
    let mut c = Config::new(id(name), Incarnation(incarnation), "fp-1");
    c.lease_duration = Duration::from_secs(3);
    c.max_in_flight = 4;
    c.max_attempts = 2;
    c
}

#[derive(Default)]
pub struct Kv {
    pub data: [BTreeMap<String, (Bytes, u64)>; 2],
    /// TTL deadlines of lease-bucket keys.
    pub expiry: BTreeMap<String, Timestamp>,
    pub now: Timestamp,
    pub rev: u64,
    /// Watch subscribers: (bucket index, prefix).
    pub watches: Vec<WatchId>,
}

fn bi(b: Bucket) -> usize {
    match b {
        Bucket::State => 0,
        Bucket::Lease => 1,
    }
}

impl Kv {
    pub fn apply(&mut self, bucket: Bucket, req: &StoreRequest) -> (StoreResult, Vec<(WatchId, WatchEvent)>) {
        let b = bi(bucket);
        let mut events = Vec::new();
        let result = match req {
            StoreRequest::Create { key, value, ttl } => {
                if self.data[b].contains_key(key.as_str()) {
                    Err(StoreError::AlreadyExists(key.clone()))
                } else {
                    self.rev += 1;
                    self.set_ttl(bucket, key, *ttl);
                    self.data[b].insert(key.to_string(), (value.clone(), self.rev));
                    events.push(WatchEvent::Put(Entry {
                        key: key.clone(),
                        value: value.clone(),
                        revision: Revision(self.rev),
                    }));
                    Ok(StoreReply::Written(Revision(self.rev)))
                }
            }
            StoreRequest::CompareAndSwap { key, expected, value, ttl } => {
                match self.data[b].get(key.as_str()) {
                    Some((_, r)) if *r == expected.0 => {
                        self.rev += 1;
                        self.set_ttl(bucket, key, *ttl);
                        self.data[b].insert(key.to_string(), (value.clone(), self.rev));
                        events.push(WatchEvent::Put(Entry {
                            key: key.clone(),
                            value: value.clone(),
                            revision: Revision(self.rev),
                        }));
                        Ok(StoreReply::Written(Revision(self.rev)))
                    }
                    _ => Err(StoreError::RevisionMismatch(key.clone())),
                }
            }
            StoreRequest::Delete { key, expected } => match self.data[b].get(key.as_str()) {
                Some((_, r)) if *r == expected.0 => {
                    self.data[b].remove(key.as_str());
                    self.rev += 1;
                    events.push(WatchEvent::Delete {
                        key: key.clone(),
                        revision: Revision(self.rev),
                        cause: DeleteCause::Deleted,
                    });
                    Ok(StoreReply::Deleted)
                }
                _ => Err(StoreError::RevisionMismatch(key.clone())),
            },
            StoreRequest::Get { key } => Ok(StoreReply::Value(self.get(bucket, key.as_str()))),
            StoreRequest::List { prefix } => Ok(StoreReply::Entries(self.list(bucket, prefix))),
        };
        let routed = events
            .into_iter()
            .flat_map(|e| {
                let key = match &e {
                    WatchEvent::Put(en) => en.key.clone(),
                    WatchEvent::Delete { key, .. } => key.clone(),
                    WatchEvent::SnapshotComplete => unreachable!(),
                };
                self.watches
                    .iter()
                    .filter(|w| w.bucket() == bucket && w.prefix().matches(&key))
                    .map(|w| (*w, e.clone()))
                    .collect::<Vec<_>>()
            })
            .collect();
        (result, routed)
    }

    fn set_ttl(&mut self, bucket: Bucket, key: &Key, ttl: Option<Duration>) {
        if bucket == Bucket::Lease {
            match ttl {
                Some(t) => {
                    self.expiry.insert(key.to_string(), self.now + t);
                }
                None => {
                    self.expiry.remove(key.as_str());
                }
            }
        }
    }

    /// Expires lease keys whose TTL ran out by `now`; returns the watch events.
    pub fn expire(&mut self, now: Timestamp) -> Vec<(WatchId, WatchEvent)> {
        self.now = now;
        let due: Vec<String> =
            self.expiry.iter().filter(|(_, t)| **t <= now).map(|(k, _)| k.clone()).collect();
        let mut out = Vec::new();
        for k in due {
            self.expiry.remove(&k);
            if self.data[1].remove(&k).is_some() {
                self.rev += 1;
                let key = Key::new(k).unwrap();
                for w in &self.watches {
                    if w.bucket() == Bucket::Lease && w.prefix().matches(&key) {
                        out.push((
                            *w,
                            WatchEvent::Delete {
                                key: key.clone(),
                                revision: Revision(self.rev),
                                cause: DeleteCause::Expired,
                            },
                        ));
                    }
                }
            }
        }
        out
    }

    pub fn get(&self, bucket: Bucket, key: &str) -> Option<Entry> {
        self.data[bi(bucket)].get(key).map(|(v, r)| Entry {
            key: Key::new(key).unwrap(),
            value: v.clone(),
            revision: Revision(*r),
        })
    }

    pub fn list(&self, bucket: Bucket, prefix: &Prefix) -> Vec<Entry> {
        self.data[bi(bucket)]
            .iter()
            .filter(|(k, _)| k.starts_with(prefix.as_str()))
            .map(|(k, (v, r))| Entry {
                key: Key::new(k.clone()).unwrap(),
                value: v.clone(),
                revision: Revision(*r),
            })
            .collect()
    }

    pub fn put<T: serde::Serialize>(&mut self, bucket: Bucket, key: &Key, value: &T) -> Revision {
        self.rev += 1;
        self.data[bi(bucket)].insert(key.to_string(), (records::encode(value), self.rev));
        Revision(self.rev)
    }

    pub fn record(&self, split: &str) -> records::SplitRecord {
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

    /// Moves time forward: TTL'd keys expire (their watch events are delivered), then a tick.
    pub fn advance(&mut self, d: Duration) -> Vec<Action> {
        self.now = self.now + d;
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
    Plan {
        kind,
        splits: (0..n)
            .map(|i| PlannedSplit {
                id: sid(&format!("s{i}")),
                descriptor: Bytes::from(format!("d{i}")),
                weight: i as u64 + 1,
            })
            .collect(),
    }
}

pub fn lease_of(kv: &Kv, split: &str) -> Option<records::LeaseRecord> {
    kv.get(Bucket::Lease, &format!("split.{split}")).map(|e| records::decode(&e.value).unwrap())
}

pub fn presence_key(name: &str) -> Key {
    keys::worker(&id(name))
}
