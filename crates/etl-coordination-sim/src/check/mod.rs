//! Invariant checkers (docs/PROTOCOL.md, invariants). The world reports what it saw as
//! [`Observation`]s and judges nothing; the checkers, one file per concern (`records`, `leases`,
//! `plan`, `outcome`), judge them. Each check counts its executions and reports a violation with
//! a message that names the rule it broke.

mod datapath;
mod leases;
mod outcome;
mod plan;
mod records;

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use bytes::Bytes;
use etl_coordination_core::records::{LeaseRecord, PlanHead, SplitRecord};
use etl_coordination_core::{
    AcquisitionReason, Entry, Epoch, FatalError, HandoverOutcome, Outcome, Owner, PlanKind, SplitId,
    Timestamp, WatchEvent,
};
use etl_coordination_memory::MemoryKv;

use crate::options::{Options, Scenario, Violation};
pub(crate) use plan::manifest_ids;

/// Decodes the simulator's progress encoding (records done, u64 LE).
pub fn progress_of(p: &Option<Bytes>) -> u64 {
    match p {
        Some(b) if b.len() == 8 => u64::from_le_bytes(b[..].try_into().expect("8 bytes")),
        _ => 0,
    }
}

#[derive(Debug)]
pub(crate) struct Checker {
    checks: BTreeMap<&'static str, u64>,
    violation: Option<Violation>,
    pub(super) max_attempts: u32,
    /// Per split: which records were emitted at least once.
    pub(super) emitted: BTreeMap<SplitId, Vec<bool>>,
    pub(super) lease_mirror: BTreeMap<SplitId, LeaseRecord>,
    /// Tenancies whose lane reported failure.
    pub(super) failed: BTreeSet<(SplitId, Epoch)>,
    /// Records emitted by lanes that no longer own their split (per lane), for the I4 bound.
    pub(super) stale_emits: BTreeMap<(SplitId, Epoch, Owner), u64>,
    pub(super) stale_bound: u64,
    /// P11: per tenancy (split, epoch, holder), when its lease dies in the store's time: the TTL
    /// deadline of the latest lease write of that holder at that epoch that landed, or the
    /// holder's own delete.
    pub(super) lease_deadline: BTreeMap<SplitId, Vec<(Epoch, Owner, Timestamp)>>,
    /// How the lease of (split, epoch, holder) came to be: created over nothing, or written
    /// over a live lease (displaced holder), or a renewal of the holder's own lease at the epoch
    /// before. Keyed by holder too: two workers can hold a lease at the same epoch one after
    /// the other (an expiry that erases a write that just landed, then a create).
    pub(super) lease_origin: BTreeMap<(SplitId, Epoch, Owner), LeaseOrigin>,
    /// The tenancy each split record currently describes (P12: did it advance progress?).
    pub(super) tenancy: BTreeMap<SplitId, Tenancy>,
    /// Claims by (split, new epoch): the acquisition reason the store's state implies.
    pub(super) claims: BTreeMap<(SplitId, Epoch), Option<AcquisitionReason>>,
    /// Every split of every manifest ever published.
    pub(super) published: BTreeSet<SplitId>,
    /// The highest epoch each split's record ever had (an overwrite by another program hides
    /// the current one).
    pub(super) max_epoch: BTreeMap<SplitId, Epoch>,
    /// Process lifetimes that finished cleanly, and when.
    pub(super) finished: BTreeMap<Owner, Timestamp>,
    /// Options the judgements depend on.
    pub(super) stay_after_end: bool,
    pub(super) duplicate_id_scenario: bool,
    pub(super) random_scenario: bool,
    pub(super) poison: bool,
    /// The outcome declared so far (I6: one outcome across workers).
    pub(super) declared: Option<&'static str>,
    /// Final plans listed per term (P4: one listing per Final plan per term).
    pub(super) final_listings: BTreeMap<u64, u64>,
    /// I7 in random runs: (probes in a row with a move that would help, the best gain).
    pub(super) imbalance: (u32, u128),
    /// P9: per worker, when (its clock) it last started a steal.
    pub(super) last_steal: BTreeMap<Owner, Timestamp>,
    /// P9: a heartbeat interval (one steal per cycle).
    pub(super) heartbeat: Duration,
    /// Per tenancy (split, epoch): how many records of the split its lane emitted, at most.
    pub(super) emitted_upto: BTreeMap<(SplitId, Epoch), u64>,
    /// Tenancies whose draining lane acknowledged with everything it emitted committed.
    pub(super) clean_stops: BTreeSet<(SplitId, Epoch)>,
    /// P9: tenancies (split, thief's epoch) that came from a cooperative handover, with the
    /// victim's epoch.
    pub(super) handed_over: BTreeMap<(SplitId, Epoch), Epoch>,
    /// Knob: how long a drain gives its lanes.
    pub(super) drain_timeout: Duration,
    /// Knobs of the data path.
    pub(super) transient_budget: Duration,
    pub(super) breaker_threshold: u32,
    pub(super) breaker_window: Duration,
    /// Per worker, its failures past the budget since its last flush (the breaker's oracle).
    pub(super) streaks: BTreeMap<Owner, datapath::Streak>,
    pub(super) got_through: BTreeMap<Owner, datapath::GotThrough>,
    /// Tenancies charged for an outage past the budget.
    pub(super) outage_failed: BTreeSet<(SplitId, Epoch)>,
    /// Tenancies whose lane gave the split up (bad records past the cap).
    pub(super) gave_up: BTreeSet<(SplitId, Epoch)>,
    /// Per split, the causes of the attempts charged since its count was last reset.
    pub(super) charges: datapath::Charges,
    /// Splits planted to fail (poison, bad records not skipped or above the cap).
    pub(super) may_quarantine: BTreeSet<SplitId>,
    /// Healthy splits quarantined, with the causes of their charges.
    pub(super) innocent: Vec<(SplitId, Vec<datapath::Charge>)>,
    /// Healthy splits quarantined with charges for crashes a poison neighbour caused.
    pub(super) collateral: Vec<(SplitId, Vec<datapath::Charge>)>,
    /// Processes a poison split crashed.
    pub(super) poison_crashed: BTreeSet<Owner>,
    /// Per leader, when the last write of its leadership lease dies in the store's time.
    pub(super) leader_deadline: BTreeMap<Owner, Timestamp>,
}

/// How the lease of a tenancy was taken.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum LeaseOrigin {
    /// Created: no live lease was there (it expired or was deleted).
    Created,
    /// Written by CAS over a live lease held by someone else (steal, reclaim).
    Displaced(Owner),
    /// The holder moved its own lease to the next epoch (a starved tenancy resumed).
    Resumed,
}

/// What the checker knows of the tenancy a split record describes.
#[derive(Clone, Debug)]
pub(super) struct Tenancy {
    pub(super) epoch: Epoch,
    /// Progress when the tenancy began.
    pub(super) base: u64,
    /// Whether it committed progress beyond `base` (P12: resets the attempt count).
    pub(super) progressed: bool,
}

/// What the world saw happen, reported to the checkers (the world judges nothing itself).
#[derive(Debug)]
pub(crate) enum Observation<'a> {
    // ----- split records (`records.rs`)
    /// A worker's write to a split record landed; `old_undecodable`: what it replaced was not a
    /// record (it cannot have been read).
    SplitWritten {
        writer: &'a Owner,
        id: &'a SplitId,
        old: Option<&'a SplitRecord>,
        new: &'a SplitRecord,
        old_undecodable: bool,
    },
    /// Another program or an operator wrote `id`'s record (`None`: bytes that are no record).
    ForeignWrite { id: &'a SplitId, new: Option<&'a SplitRecord> },
    /// A split record was deleted (garbage collection).
    RecordDeleted { id: &'a SplitId, writer: &'a Owner },
    /// A worker started a steal at `local` (its clock).
    Steal { who: &'a Owner, id: &'a SplitId, local: Timestamp },
    /// A steal a worker asked for ended: the victim's tenancy `from`, the thief's `to`.
    Handover { id: &'a SplitId, from: Epoch, to: Option<Epoch>, outcome: HandoverOutcome },
    /// A draining lane acknowledged its stop; `clean`: everything it emitted was committed
    /// first (no sink outage, no failed last commit).
    LaneAcked { id: &'a SplitId, epoch: Epoch, clean: bool },
    /// A worker announced an acquisition.
    Acquired { id: &'a SplitId, epoch: Epoch, reason: AcquisitionReason, who: &'a Owner },
    // ----- leases and lanes (`leases.rs`)
    /// An event of the lease bucket.
    LeaseEvent(&'a WatchEvent),
    /// A lease write landed; `deadline`: when its TTL runs out in the store.
    LeaseWritten { id: &'a SplitId, prev: Option<&'a LeaseRecord>, new: &'a LeaseRecord, deadline: Timestamp },
    /// A lease was deleted by its holder.
    LeaseDeleted { id: &'a SplitId },
    /// The core keeps this lane running.
    LaneRunning { id: &'a SplitId, epoch: Epoch, owner: &'a Owner },
    /// A lane starts while `others` (epochs) run the same split.
    LaneStarted { id: &'a SplitId, epoch: Epoch, others: &'a [Epoch], current: Option<&'a SplitRecord> },
    /// A lane emitted record number `record`.
    Emitted { id: &'a SplitId, record: u64, epoch: Epoch, owner: &'a Owner, current: Option<&'a SplitRecord> },
    /// A lane reported that its split cannot be processed.
    LaneFailed { id: &'a SplitId, epoch: Epoch },
    // ----- the data path (`datapath.rs`)
    /// A lane skipped a bad record to the dead-letter sink.
    DeadLettered { id: &'a SplitId, record: u64 },
    /// A lane gave its split up (more bad records than the cap).
    LaneGaveUp { id: &'a SplitId, epoch: Epoch },
    /// A lane's outage of `side` (since `since`) outlived the budget at `local`, both on the
    /// worker's clock (a clock that jumps shortens waits, as it would in a real process);
    /// `charged`: the breaker let it be charged (else the split is released without blame).
    OutageFailed {
        id: &'a SplitId,
        epoch: Epoch,
        who: &'a Owner,
        side: &'static str,
        since: Timestamp,
        local: Timestamp,
        charged: bool,
    },
    /// A worker's lane flushed its sink and commits at `local`, having last read its source at
    /// `read_at` (both on the worker's clock).
    Flushed { who: &'a Owner, id: &'a SplitId, local: Timestamp, read_at: Option<Timestamp> },
    /// A write of the leadership lease landed (or its holder deleted it: `deadline` now).
    LeaderLease { owner: &'a Owner, deadline: Timestamp },
    /// A worker sends a write of the plan (its head or a manifest chunk).
    LeaderWrites { who: &'a Owner, key: &'a etl_coordination_core::Key },
    /// A poison split crashed this worker's process.
    PoisonCrashed { who: &'a Owner },
    /// What a worker holds after an input, and its `max_in_flight`.
    Held { who: &'a Owner, held: u32, cap: u32 },
    /// A draining lane was stopped at once at `local` (the worker's clock), its deadline being
    /// `deadline`.
    DrainStopped { id: &'a SplitId, who: &'a Owner, local: Timestamp, deadline: Timestamp },
    /// A draining lane was given `given` from the drain request to its deadline.
    DrainGiven { id: &'a SplitId, who: &'a Owner, given: Duration },
    /// A draining lane still runs, no commit in flight, after an input at `local`.
    DrainRunning { id: &'a SplitId, who: &'a Owner, local: Timestamp, deadline: Timestamp },
    /// A worker fenced its tenancy; the store's record and lease now, and whether another
    /// owner's write to them waits at a stuck stream leader (or the answer being handled is a
    /// lagging replica's "absent").
    Fenced {
        id: &'a SplitId,
        owner: &'a Owner,
        record: Option<&'a SplitRecord>,
        lease: Option<&'a LeaseRecord>,
        foreign_write_waiting: bool,
    },
    // ----- the plan (`plan.rs`)
    /// A write to the plan head landed.
    HeadWritten { writer: &'a Owner, old: Option<&'a PlanHead>, new: &'a PlanHead },
    /// A worker asked its planner for a plan, with this head in the store.
    PlannerStarted { who: &'a Owner, head: Option<&'a PlanHead> },
    /// The planner listed a plan of `kind`, with this head in the store.
    PlanListed { kind: PlanKind, head: Option<&'a PlanHead> },
    // ----- the outcome (`outcome.rs`)
    /// A worker declared the job's end; `healed`: the operator removed the poison meanwhile.
    Declared { who: &'a Owner, outcome: &'a Outcome, healed: bool },
    /// The operator requeued the quarantined splits: the job's outcome is decided anew.
    JobRequeued,
    /// A worker left; `draining`: it was told to drain; `reachable`: it left with the store
    /// reachable (its cleanup is checked).
    Left { who: &'a Owner, outcome: &'a Outcome, draining: bool, reachable: bool },
    /// A worker stopped with a fatal error.
    Fatal { who: &'a Owner, error: &'a FatalError },
    /// After every worker finished: a key left in the lease bucket, written at `written_at`.
    LeftoverKey { entry: &'a Entry, written_at: Timestamp },
    /// The liveness bound passed with these workers still running.
    NoOutcomeWithinBound { open: &'a [String] },
    /// More than `limit` events.
    EventStorm { limit: u64 },
    /// What each live worker holds and may hold, once faults stopped.
    Loads { workers: &'a [WorkerLoad] },
    /// What each worker holds after convergence (the balance scenarios).
    Converged { workers: &'a [WorkerLoad] },
    /// Steals after convergence (the balance scenario).
    BalanceWindowClosed { steals: u64 },
    /// The run ended: steals after the faults, the number of splits, how many finished after
    /// the faults, whether no outcome was declared, and each worker's state.
    RunEnded { steals_after_faults: u64, splits: u64, finished: u64, no_outcome: bool, states: &'a [String] },
}

/// What one worker holds (the weights of its splits) and how many splits it may hold (its
/// lanes, or what it holds while its breaker keeps it from taking more): for balance (I7, P9).
#[derive(Clone, Debug)]
pub(crate) struct WorkerLoad {
    pub(crate) held: Vec<u64>,
    pub(crate) cap: u32,
    /// The weights of splits its lanes failed that wait to be claimed again: in its load (P9),
    /// not in its lanes.
    pub(crate) returning: Vec<u64>,
}

/// The lease origin a split record write waiting at a stuck stream leader is judged by (the
/// acquisition it was made for, which a later acquisition of the same epoch may replace
/// meanwhile): opaque to the world, which carries it with the write.
#[derive(Debug)]
pub(crate) struct HeldWrite {
    key: (SplitId, Epoch, Owner),
    origin: Option<LeaseOrigin>,
}

/// A held write landing: the origin it replaced, put back once the write is judged.
pub(crate) struct Landing {
    key: (SplitId, Epoch, Owner),
    replaced: Option<LeaseOrigin>,
}

impl Checker {
    /// `may_quarantine`: the splits planted to fail; `poison`: Complete is wrong while they
    /// are not fixed.
    pub(crate) fn new(
        opts: &Options,
        totals: &BTreeMap<SplitId, u64>,
        may_quarantine: BTreeSet<SplitId>,
        poison: bool,
    ) -> Self {
        Checker {
            checks: BTreeMap::new(),
            violation: None,
            max_attempts: opts.max_attempts,
            emitted: totals.iter().map(|(id, n)| (id.clone(), vec![false; *n as usize])).collect(),
            lease_mirror: BTreeMap::new(),
            failed: BTreeSet::new(),
            stale_emits: BTreeMap::new(),
            stale_bound: opts.commit_every * 2 + 2,
            lease_deadline: BTreeMap::new(),
            lease_origin: BTreeMap::new(),
            tenancy: BTreeMap::new(),
            claims: BTreeMap::new(),
            published: BTreeSet::new(),
            max_epoch: BTreeMap::new(),
            finished: BTreeMap::new(),
            stay_after_end: opts.stay_after_end,
            duplicate_id_scenario: opts.scenario == Scenario::DuplicateId,
            random_scenario: opts.scenario == Scenario::Random,
            poison,
            declared: None,
            final_listings: BTreeMap::new(),
            imbalance: (0, 0),
            last_steal: BTreeMap::new(),
            emitted_upto: BTreeMap::new(),
            clean_stops: BTreeSet::new(),
            handed_over: BTreeMap::new(),
            heartbeat: Duration::from_secs(opts.lease_secs) / 3,
            drain_timeout: opts.drain_timeout,
            transient_budget: opts.transient_budget,
            breaker_threshold: opts.breaker_threshold,
            breaker_window: opts.breaker_window,
            streaks: BTreeMap::new(),
            got_through: BTreeMap::new(),
            outage_failed: BTreeSet::new(),
            gave_up: BTreeSet::new(),
            charges: BTreeMap::new(),
            may_quarantine,
            innocent: Vec::new(),
            collateral: Vec::new(),
            poison_crashed: BTreeSet::new(),
            leader_deadline: BTreeMap::new(),
        }
    }

    pub(super) fn count(&mut self, rule: &'static str) {
        *self.checks.entry(rule).or_default() += 1;
    }

    pub(super) fn fail(&mut self, at: Timestamp, rule: &'static str, message: String) {
        if self.violation.is_none() {
            self.violation = Some(Violation { rule, message, at });
        }
    }

    pub(super) fn ensure(
        &mut self,
        at: Timestamp,
        rule: &'static str,
        ok: bool,
        message: impl FnOnce() -> String,
    ) {
        self.count(rule);
        if !ok {
            self.fail(at, rule, message());
        }
    }

    /// Judges what the world saw (`state`: the state bucket, for checks that read the plan).
    pub(crate) fn observe(&mut self, at: Timestamp, obs: Observation<'_>, state: &mut MemoryKv) {
        use Observation as O;
        match obs {
            O::SplitWritten { writer, id, old, new, old_undecodable } => {
                if old_undecodable {
                    self.fail(
                        at,
                        "I3",
                        format!("split {id}: {writer} wrote over a record it cannot have decoded"),
                    );
                }
                self.on_split_write(at, writer, id, old, new)
            }
            O::ForeignWrite { id, new } => self.on_foreign_write(id, new),
            O::RecordDeleted { id, writer } => self.on_record_deleted(at, id, writer),
            O::Acquired { id, epoch, reason, who } => self.on_acquired(at, id, epoch, reason, who),
            O::LeaseEvent(ev) => self.on_lease_event(ev),
            O::LeaseWritten { id, prev, new, deadline } => self.on_lease_write(at, id, prev, new, deadline),
            O::LeaseDeleted { id } => self.on_lease_deleted(at, id),
            O::LaneRunning { id, epoch, owner } => self.lane_running(at, id, epoch, owner),
            O::LaneStarted { id, epoch, others, current } => {
                self.on_lane_start(at, id, epoch, others, current)
            }
            O::Emitted { id, record, epoch, owner, current } => {
                self.on_emit(at, id, record, epoch, owner, current);
                self.on_emit_after_handover(at, id, record, epoch);
            }
            O::LaneFailed { id, epoch } => {
                self.failed.insert((id.clone(), epoch));
            }
            O::DeadLettered { id, record } => self.on_dead_lettered(id, record),
            O::LaneGaveUp { id, epoch } => {
                self.gave_up.insert((id.clone(), epoch));
            }
            O::OutageFailed { id, epoch, who, side, since, local, charged } => {
                self.on_outage_failed(at, id, epoch, who, side, (since, local), charged)
            }
            O::Flushed { who, id, local, read_at } => self.on_flushed(who, id, local, read_at),
            O::LeaderLease { owner, deadline } => {
                self.leader_deadline.insert(owner.clone(), deadline);
            }
            O::LeaderWrites { who, key } => {
                let deadline = self.leader_deadline.get(who).copied();
                self.ensure(at, "P11", deadline.is_some_and(|d| at <= d), || match deadline {
                    None => format!("{who} writes {key} without ever having held the leadership lease"),
                    Some(d) => format!(
                        "{who} writes {key} {:.3}s after its leadership lease died in the store (the leader's trust outlived the TTL)",
                        at.saturating_since(d).as_secs_f64()
                    ),
                });
            }
            O::PoisonCrashed { who } => {
                self.poison_crashed.insert(who.clone());
            }
            O::Held { who, held, cap } => self.on_held(at, who, held, cap),
            O::DrainStopped { id, who, local, deadline } => {
                self.on_drain_stopped(at, id, who, local, deadline)
            }
            O::DrainRunning { id, who, local, deadline } => {
                self.on_drain_running(at, id, who, local, deadline)
            }
            O::DrainGiven { id, who, given } => {
                let timeout = self.drain_timeout;
                self.ensure(at, "P10", given >= timeout, || {
                    format!("split {id}: {who} gave its draining lane {given:?}, less than the drain timeout of {timeout:?}")
                });
            }
            O::Fenced { id, owner, record, lease, foreign_write_waiting } => {
                self.on_fenced(at, id, owner, record, lease, foreign_write_waiting)
            }
            O::HeadWritten { writer, old, new } => self.on_head_write(at, writer, old, new, state),
            O::PlannerStarted { who, head } => self.on_planner_started(at, who, head),
            O::PlanListed { kind, head } => self.on_plan_listed(at, kind, head),
            O::Declared { who, outcome, healed } => self.on_declared(at, who, outcome, healed, state),
            O::JobRequeued => self.declared = None,
            O::Left { who, outcome, draining, reachable } => {
                self.on_left(at, who, outcome, draining, reachable)
            }
            O::Fatal { who, error } => self.on_fatal(at, who, error),
            O::LeftoverKey { entry, written_at } => self.on_leftover_key(at, entry, written_at),
            O::NoOutcomeWithinBound { open } => {
                self.fail(at, "I8", format!("no outcome within the liveness bound; still running: {open:?}"))
            }
            O::EventStorm { limit } => {
                self.fail(at, "I8", format!("event storm: more than {limit} events (a livelock)"))
            }
            O::Steal { who, id, local } => self.on_steal(at, who, id, local),
            O::Handover { id, from, to, outcome } => {
                if let (HandoverOutcome::HandedOver, Some(to)) = (outcome, to) {
                    self.handed_over.insert((id.clone(), to), from);
                }
            }
            O::LaneAcked { id, epoch, clean } => {
                if clean {
                    self.clean_stops.insert((id.clone(), epoch));
                }
            }
            O::Loads { workers } => self.on_loads(at, workers),
            O::Converged { workers } => self.on_converged(at, workers),
            O::BalanceWindowClosed { steals } => {
                if steals > 0 {
                    self.fail(at, "I7", format!("{steals} steals after convergence: ownership oscillates"));
                }
            }
            O::RunEnded { steals_after_faults, splits, finished, no_outcome, states } => {
                self.on_run_ended(at, steals_after_faults, splits + finished, no_outcome, states)
            }
        }
    }

    /// Whether a rule was broken (the run stops at the first violation).
    pub(crate) fn violated(&self) -> bool {
        self.violation.is_some()
    }

    /// The splits of every manifest published so far (what the operator acts on).
    pub(crate) fn published(&self) -> &BTreeSet<SplitId> {
        &self.published
    }

    /// Healthy splits quarantined, with the causes of their charges.
    pub(crate) fn innocent(&self) -> &[(SplitId, Vec<datapath::Charge>)] {
        &self.innocent
    }

    /// Healthy splits quarantined with charges for crashes a poison neighbour caused.
    pub(crate) fn collateral(&self) -> &[(SplitId, Vec<datapath::Charge>)] {
        &self.collateral
    }

    /// The verdict and the count of every check, once the run is over.
    pub(crate) fn verdict(&mut self) -> (Option<Violation>, BTreeMap<&'static str, u64>) {
        (self.violation.take(), std::mem::take(&mut self.checks))
    }
}
