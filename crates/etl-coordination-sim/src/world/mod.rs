//! The simulated world: workers (each a real core on its own clock), the event loop, the
//! planner, scenario probes and the report. The store model is in `net`, the fault injector in
//! `faults`, the lanes in `lanes`, the checkers in `check`.

mod datapath;
mod events;
mod faults;
mod lanes;
mod net;
mod operator;
mod planner;
mod probes;
mod stuck;
mod watch;
mod workers;

use std::cmp::Reverse;
use std::collections::{BTreeMap, BTreeSet, BinaryHeap};
use std::time::Duration;

use etl_coordination_core::{Input, InstanceId, OpId, SplitId, Timestamp};
use etl_coordination_memory::MemoryKv;

use crate::check::{Checker, Observation};
use crate::fault::Fault;
use crate::options::{Options, Report, Scenario};
use crate::rng::Rng;
use events::Scheduled;
pub(crate) use events::{Answer, Ev};
use net::{History, Sent};
use stuck::Stuck;
use watch::Sub;
pub(crate) use workers::{Slot, Status};

/// A run that needs more events than this is livelocked.
const MAX_EVENTS: u64 = 6_000_000;

pub(crate) fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

pub(crate) fn us(n: u64) -> Duration {
    Duration::from_micros(n)
}

/// Runs one simulation.
pub fn run(seed: u64, opts: &Options) -> Report {
    let mut w = World::new(seed, opts.clone());
    w.run();
    w.finish()
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Poison {
    None,
    Crash(u64),
    Unprocessable(u64),
}

pub(crate) struct SplitSpec {
    pub id: SplitId,
    pub weight: u64,
    pub total: u64,
    pub poison: Poison,
    /// Offsets of bad records.
    pub bad: Vec<u64>,
    pub discovered_at: Timestamp,
}

pub(crate) struct World {
    pub opts: Options,
    pub rng: Rng,
    pub now: Timestamp,
    seq: u64,
    queue: BinaryHeap<Reverse<Scheduled>>,
    pub state: MemoryKv,
    pub lease: MemoryKv,
    pub history: [History; 2],
    pub subs: Vec<Sub>,
    pub slots: Vec<Slot>,
    pub splits: Vec<SplitSpec>,
    pub split_index: BTreeMap<SplitId, usize>,
    pub checker: Checker,
    pub report: Report,
    pub faults_on: bool,
    pub outage_until: Timestamp,
    open_until: Timestamp,
    next_instance: u32,
    pub safety_over: bool,
    released_at: BTreeMap<SplitId, Timestamp>,
    hash: u64,
    pub trace: bool,
    balance_window_closed: bool,
    /// Lease-bucket revisions written by requests whose writer got no answer (in doubt).
    pub unacked_lease_writes: std::collections::BTreeSet<etl_coordination_core::Revision>,
    /// Per bucket: a stream leader that lost its quorum, with the writes it holds.
    pub stuck: [Option<Stuck>; 2],
    /// Reads a lagging replica answered (by slot, life and op, not delivered yet), with the
    /// keys it called absent although the store has them.
    pub stale_answers: BTreeMap<(usize, u32, OpId), Vec<etl_coordination_core::Key>>,
    /// The keys the answer being delivered calls absent wrongly: a fence of their split decided
    /// on it is one the core cannot avoid (it cannot tell that "absent" from an expiry).
    stale_absent: Vec<etl_coordination_core::Key>,
    /// Splits whose record another program overwrote, not reset yet.
    pub corrupted: BTreeSet<SplitId>,
    /// The operator requeued the quarantined splits (once per run).
    pub requeued: bool,
    /// The operator fixed the cause of the poison splits.
    pub healed: bool,
    /// The data path's faults draw from a generator of their own.
    pub dp_rng: Rng,
    /// When the current data-path outage of each side (source, sink) ends.
    pub data_outage_until: [Timestamp; 2],
    /// Data-path outages so far.
    pub data_outages: u32,
    /// Inputs being delivered (one delivered while the actions of another are carried out).
    delivering: u32,
}

impl World {
    fn new(seed: u64, opts: Options) -> Self {
        let mut rng = Rng::new(seed);
        let mut splits = Vec::new();
        let open_until = if opts.open_plan {
            Timestamp::ZERO + Duration::from_secs(rng.range(3, 15))
        } else {
            Timestamp::ZERO
        };
        for i in 0..opts.splits {
            let total = if opts.uniform_records {
                opts.max_records.max(1)
            } else {
                rng.range(1, opts.max_records.max(1))
            };
            let poison = if i < opts.poison_crash {
                Poison::Crash(rng.range(0, total - 1))
            } else if i < opts.poison_crash + opts.poison_unprocessable {
                Poison::Unprocessable(rng.range(0, total - 1))
            } else {
                Poison::None
            };
            let discovered_at =
                if opts.open_plan && i > 0 { Timestamp(rng.range(0, open_until.0)) } else { Timestamp::ZERO };
            splits.push(SplitSpec {
                id: SplitId::new(format!("s{i:04}")).expect("valid id"),
                weight: Some(rng.range(1, 1000)).filter(|_| !opts.uniform_weights).unwrap_or(1),
                total,
                poison,
                bad: Vec::new(),
                discovered_at,
            });
        }
        // Bad records in the first split after the poison ones (from the data path's generator,
        // so that the rest of the world is what it was before they existed).
        let mut dp_rng = Rng::new(seed ^ 0xda7a_0001);
        let planted = opts.poison_crash + opts.poison_unprocessable;
        if let Some(s) = splits.get_mut(planted).filter(|_| opts.bad_records > 0) {
            let mut bad: Vec<u64> = (0..opts.bad_records).map(|_| dp_rng.range(0, s.total - 1)).collect();
            bad.sort_unstable();
            bad.dedup();
            s.bad = bad;
        }
        // Splits that may end quarantined: the poison ones, and one whose bad records the
        // lanes do not skip (or skip more of than the cap, which one tenancy may meet).
        let bad_split = splits.iter().find(|s| !s.bad.is_empty());
        let bad_poison =
            bad_split.is_some_and(|s| opts.skip_bad_records.is_none_or(|cap| s.bad.len() as u32 > cap));
        let mut may_quarantine: BTreeSet<SplitId> =
            splits.iter().filter(|s| s.poison != Poison::None).map(|s| s.id.clone()).collect();
        if bad_poison {
            may_quarantine.extend(bad_split.map(|s| s.id.clone()));
        }
        let totals = splits.iter().map(|s| (s.id.clone(), s.total)).collect();
        let split_index = splits.iter().enumerate().map(|(i, s)| (s.id.clone(), i)).collect();
        // Complete is wrong while a split quarantines every tenancy (poison, or bad records
        // under the quarantine policy); bad records above the cap may or may not be met by one
        // tenancy (a tenancy starts after the committed ones).
        let certain_poison = planted > 0 || (bad_poison && opts.skip_bad_records.is_none());
        let checker = Checker::new(&opts, &totals, may_quarantine.clone(), certain_poison);
        let report = Report {
            seed,
            records_total: splits.iter().map(|s| s.total).sum(),
            outcome: "none",
            poison_splits: may_quarantine.len(),
            ..Report::default()
        };
        World {
            faults_on: opts.faults,
            opts,
            rng,
            now: Timestamp::ZERO,
            seq: 0,
            queue: BinaryHeap::new(),
            state: MemoryKv::with_explicit_expiry(),
            lease: MemoryKv::with_explicit_expiry(),
            history: Default::default(),
            subs: Vec::new(),
            slots: Vec::new(),
            splits,
            split_index,
            checker,
            report,
            outage_until: Timestamp::ZERO,
            open_until,
            next_instance: 0,
            safety_over: false,
            released_at: BTreeMap::new(),
            hash: 0xcbf2_9ce4_8422_2325,
            trace: std::env::var_os("SIM_TRACE").is_some(),
            balance_window_closed: false,
            unacked_lease_writes: Default::default(),
            stuck: Default::default(),
            stale_answers: Default::default(),
            stale_absent: Vec::new(),
            corrupted: BTreeSet::new(),
            requeued: false,
            healed: false,
            dp_rng,
            data_outage_until: [Timestamp::ZERO; 2],
            data_outages: 0,
            delivering: 0,
        }
    }

    pub(crate) fn schedule(&mut self, after: Duration, ev: Ev) {
        self.schedule_at(self.now + after, ev);
    }

    pub(crate) fn schedule_at(&mut self, at: Timestamp, ev: Ev) {
        self.seq += 1;
        self.queue.push(Reverse(Scheduled { at: at.max(self.now), seq: self.seq, ev }));
    }

    fn mix(&mut self, x: u64) {
        self.hash ^= x;
        self.hash = self.hash.wrapping_mul(0x0100_0000_01b3);
    }

    pub(crate) fn fault(&mut self, kind: Fault) {
        *self.report.faults.entry(kind.label()).or_default() += 1;
    }

    pub(crate) fn new_instance_id(&mut self) -> InstanceId {
        self.next_instance += 1;
        InstanceId::new(format!("w{}", self.next_instance)).expect("valid id")
    }

    fn run(&mut self) {
        match self.opts.scenario {
            Scenario::DuplicateId => {
                let id = self.new_instance_id();
                self.add_worker(id.clone());
                let other = self.new_instance_id();
                self.add_worker(other);
                // The twin starts once the first one is established.
                self.schedule(Duration::from_secs(2), Ev::Probe);
            }
            _ => {
                for _ in 0..self.opts.initial_workers {
                    let id = self.new_instance_id();
                    self.add_worker(id);
                }
            }
        }
        self.schedule(ms(250), Ev::ExpiryTick);
        if self.opts.faults {
            // What this run's world is like (counted once per run).
            if self.opts.splits > self.opts.manifest_chunk_len {
                self.fault(Fault::PlanOfSeveralManifestChunks);
            }
            if self.opts.mixed_capacity {
                self.fault(Fault::MixedMaxInFlight);
            }
            if self.opts.op_timeout > Duration::from_secs(self.opts.lease_secs) {
                self.fault(Fault::OpTimeoutBeyondLease);
            }
            if self.opts.stay_after_end {
                self.fault(Fault::WorkersStayAfterEnd);
            }
            let first = ms(self.rng.range(300, 2000));
            self.schedule(first, Ev::FaultTick);
            if self.opts.data_faults {
                let first = ms(self.dp_rng.range(500, 5_000));
                self.schedule(first, Ev::DataFaultTick);
            }
        }
        self.schedule_at(Timestamp::ZERO + self.opts.safety, Ev::EndSafety);
        if matches!(self.opts.scenario, Scenario::Balance | Scenario::BalanceWeighted | Scenario::DrainPickup)
        {
            self.schedule(Duration::from_secs(3), Ev::Probe);
        }
        let limit = Timestamp::ZERO + self.opts.safety + self.opts.liveness_limit;
        while let Some(Reverse(s)) = self.queue.pop() {
            if self.checker.violated() {
                break;
            }
            if s.at > limit {
                let open: Vec<String> = self
                    .slots
                    .iter()
                    .filter(|s| {
                        matches!(
                            s.status,
                            Status::Running | Status::Paused | Status::Crashed { restart: true }
                        )
                    })
                    .map(|s| s.instance.to_string())
                    .collect();
                self.checker.observe(
                    self.now,
                    Observation::NoOutcomeWithinBound { open: &open },
                    &mut self.state,
                );
                break;
            }
            self.now = s.at;
            self.report.events += 1;
            if self.report.events > MAX_EVENTS {
                self.checker.observe(
                    self.now,
                    Observation::EventStorm { limit: MAX_EVENTS },
                    &mut self.state,
                );
                break;
            }
            if self.trace {
                eprintln!("{:>12} {:?}", self.now.0, s.ev);
            }
            self.mix(s.at.0);
            self.mix(s.seq);
            self.dispatch(s.ev);
            if self.safety_over && self.all_done() {
                break;
            }
        }
        if !self.checker.violated() && self.safety_over && self.all_done() {
            self.settle();
        }
    }

    fn all_done(&self) -> bool {
        self.slots.iter().all(|s| matches!(s.status, Status::Finished | Status::Crashed { restart: false }))
    }

    /// After every worker finished: let what is still in flight land, then check that finished
    /// workers left no lease, presence or leader key behind.
    fn settle(&mut self) {
        while let Some(Reverse(s)) = self.queue.pop() {
            if let Ev::StoreApply { .. } | Ev::Erase { .. } = s.ev {
                self.now = s.at;
                self.dispatch(s.ev);
            }
        }
        let now = self.now;
        let left = self.lease.list(now, &etl_coordination_core::Prefix::all());
        for e in left {
            if self.unacked_lease_writes.contains(&e.revision) {
                // Its writer never learned it landed (the answer was in doubt and a read may
                // have come from a lagging replica): the TTL removes it.
                continue;
            }
            let written_at = self.history[1].get(&e.key).and_then(|v| v.back()).map_or(now, |(t, _)| *t);
            self.checker.observe(now, Observation::LeftoverKey { entry: &e, written_at }, &mut self.state);
        }
    }

    pub(crate) fn dispatch(&mut self, ev: Ev) {
        match ev {
            Ev::ToWorker { slot, life, input } => {
                if self.slots[slot].life != life {
                    return;
                }
                if self.slots[slot].status == Status::Paused {
                    return self.slots[slot].inbox.push(Ev::ToWorker { slot, life, input });
                }
                self.deliver(slot, input);
            }
            Ev::ToWatch { slot, life, generation, input } => {
                let watch = match &input {
                    etl_coordination_core::Input::Watch { watch, .. }
                    | etl_coordination_core::Input::WatchFailed { watch } => *watch,
                    _ => unreachable!("only watch inputs are sent as ToWatch"),
                };
                let s = &self.slots[slot];
                if s.life != life || s.watch_gen.get(&watch) != Some(&generation) {
                    return;
                }
                if s.status == Status::Paused {
                    return self.slots[slot].inbox.push(Ev::ToWatch { slot, life, generation, input });
                }
                self.deliver(slot, input);
            }
            Ev::Tick { slot, life } => {
                let s = &self.slots[slot];
                if s.life != life || s.tick_at != Some(self.now) {
                    return;
                }
                if s.status == Status::Paused {
                    return self.slots[slot].inbox.push(Ev::Tick { slot, life });
                }
                self.slots[slot].tick_at = None;
                self.deliver(slot, Input::Tick);
            }
            Ev::StoreApply { slot, life, op, bucket, request, writer, answer, deadline } => self
                .store_apply(Sent { slot, life, op, bucket, request, writer, answer, deadline, held: None }),
            Ev::StreamRecovered { bucket } => self.recover_stream(bucket),
            Ev::OpenWatch { slot, life, watch, generation } => self.open_watch(slot, life, watch, generation),
            Ev::LaneStep { slot, life, split, epoch } => {
                if self.slots[slot].life != life {
                    return;
                }
                if self.slots[slot].status == Status::Paused {
                    return self.slots[slot].inbox.push(Ev::LaneStep { slot, life, split, epoch });
                }
                self.lane_step(slot, split, epoch);
            }
            Ev::ExpiryTick => {
                self.expiry_tick();
                self.schedule(ms(250), Ev::ExpiryTick);
            }
            Ev::Erase { key, revision } => self.erase(key, revision),
            Ev::FaultTick => {
                if self.faults_on {
                    self.inject_fault();
                    let next = ms(self.rng.range(300, 3000));
                    self.schedule(next, Ev::FaultTick);
                }
            }
            Ev::DataFaultTick => {
                if self.faults_on {
                    self.inject_data_fault();
                    let next = ms(self.dp_rng.range(500, 4_000));
                    self.schedule(next, Ev::DataFaultTick);
                }
            }
            Ev::BreakerProbe { slot, life } => self.breaker_probe(slot, life),
            Ev::Restart { slot } => {
                if matches!(self.slots[slot].status, Status::Crashed { restart: true }) {
                    self.start_worker(slot);
                }
            }
            Ev::Resume { slot } => self.resume(slot),
            Ev::Crash { slot, life } => {
                if self.slots[slot].life == life && self.faults_on {
                    self.crash(slot, true);
                }
            }
            Ev::EndSafety => self.end_safety(),
            Ev::Probe => self.probe(),
            Ev::BalanceProbe => self.balance_probe(),
            Ev::OperatorReset { split } => self.operator_reset(split),
        }
    }
}
