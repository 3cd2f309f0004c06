//! [`Worker`]: the whole protocol (P2-P14) for one worker, as a pure state machine.
//!
//! `handle(now, input)` returns the actions to execute; `next_deadline()` says when to call
//! again with [`Input::Tick`]. No IO, no clock, no randomness: a run is a replayable list of
//! inputs.
//!
//! This module only orchestrates: it owns the state, routes inputs and store answers to the
//! module of the rule they belong to, and decides what to attempt next ([`Worker::evaluate`]).
//! Each rule lives in one file (the map is in docs/ARCHITECTURE.md): `startup` (P2),
//! `presence` (P3), `leader` and `plan` (P4), `claim` (P5, P6), `watches` and `heartbeat`
//! (P7, P11), `commit` (P8), `steal` (P9), `end` and `drain` (P10, P12), `manifest` (P13);
//! `tenancy` holds the per-split state they share, `outbox` the requests in flight and
//! `timers` every deadline.

use std::collections::BTreeMap;

use crate::config::Config;
use crate::ids::{Epoch, OpId, Owner, Revision, SplitId};
use crate::io::{self, Action, Event, Input, Outcome, WatchId};
use crate::store::StoreResult;
use crate::time::Timestamp;
use crate::view::View;

mod acquire;
mod claim;
mod commit;
mod drain;
mod end;
mod heartbeat;
mod leader;
mod lease;
mod manifest;
mod outbox;
mod plan;
mod presence;
mod resolve;
mod retries;
mod startup;
mod steal;
mod tenancy;
mod timers;
mod watches;

use acquire::ClaimBackoffs;
use drain::Leaving;
use leader::Leading;
use manifest::ManifestLoad;
use outbox::{Gauges, Outbox, Pending};
use presence::{Join, Presence};
use tenancy::Tenancies;
use watches::WatchState;

/// The protocol state machine of one worker.
#[derive(Debug)]
pub struct Worker {
    cfg: Config,
    me: Owner,
    phase: Phase,
    /// The next planner request id (also numbers leadership stints).
    next_plan_request: u64,
    /// Requests in flight, delayed retries and the actions of the current input.
    outbox: Outbox,
    /// The cached store (S6: it triggers attempts, never decides them).
    view: View,
    watches: BTreeMap<WatchId, WatchState>,
    presence: Presence,
    /// Present while this worker leads (P4).
    leader: Option<Box<Leading>>,
    /// A leader lease create or re-take in flight.
    leader_attempt: Option<OpId>,
    /// After an attempt that was refused or found the store unavailable: no new attempt before
    /// then (a stream leader holding someone's write refuses every attempt until its fate is
    /// decided; every input would otherwise send another).
    leader_retry_at: Option<Timestamp>,
    /// Splits this worker holds or is acquiring or ending, and splits not to attempt for now.
    tenancies: Tenancies,
    heartbeat_at: Option<Timestamp>,
    resync_at: Option<Timestamp>,
    last_steal_at: Option<Timestamp>,
    /// P9: the cooperative steal this worker asked for, if any.
    steal: Option<steal::PendingSteal>,
    /// P9: the revision of the last steal request to this worker it answered.
    answered_steal: Option<Revision>,
    /// P9: splits this worker's lanes reported failed, with their weights: while one waits to
    /// be claimed again it still counts in this worker's load (it will likely come back), so a
    /// failing split leaving and returning does not make healthy ones move back and forth.
    failed_here: BTreeMap<SplitId, u64>,
    /// P12: failed splits waiting out their claim backoff, by the record revision that
    /// showed the failure.
    backoffs: ClaimBackoffs,
    /// The embedding layer's cap on splits held ([`Input::Intake`]).
    intake_limit: Option<u32>,
    manifest_load: Option<ManifestLoad>,
    leaving: Option<Leaving>,
    /// The gauges last reported (none yet: the first report always goes out).
    gauges: Option<Gauges>,
    /// The job's end as last reported while staying after it (`Config::stay_after_end`).
    ended: Option<Outcome>,
    /// The revision of `meta` whose settings are in effect (`cfg.tuning.max_attempts` is the
    /// job's, P2).
    meta_revision: Revision,
    /// `max_attempts` as configured, which only seeds a new job's `meta`.
    configured_max_attempts: u32,
}

/// Where a worker is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// Not started.
    Idle,
    /// P2: creating or comparing `meta`.
    Meta,
    /// P3: watches opening, presence being established.
    Joining,
    /// Claiming, working, leading.
    Running,
    /// Draining or finished: releasing everything before the last action.
    Leaving,
    /// Finished or fatal: no further actions.
    Stopped,
}

impl Worker {
    /// A worker for `cfg`, which must have passed [`Config::validate`].
    pub fn new(cfg: Config) -> Self {
        debug_assert!(cfg.validate().is_ok(), "config must be validated first");
        let me = Owner { instance: cfg.instance_id.clone(), incarnation: cfg.incarnation };
        let view = View::new(cfg.instance_id.clone(), cfg.incarnation);
        let outbox = Outbox::new(cfg.tuning.heartbeat_interval(), cfg.incarnation.0);
        let configured_max_attempts = cfg.tuning.max_attempts;
        Worker {
            cfg,
            me,
            phase: Phase::Idle,
            next_plan_request: 1,
            outbox,
            view,
            watches: BTreeMap::new(),
            presence: Presence::default(),
            leader: None,
            leader_attempt: None,
            leader_retry_at: None,
            tenancies: Tenancies::default(),
            heartbeat_at: None,
            resync_at: None,
            last_steal_at: None,
            steal: None,
            answered_steal: None,
            failed_here: BTreeMap::new(),
            backoffs: ClaimBackoffs::default(),
            intake_limit: None,
            manifest_load: None,
            leaving: None,
            gauges: None,
            ended: None,
            meta_revision: Revision(0),
            configured_max_attempts,
        }
    }

    /// This worker's configuration as in effect: `tuning.max_attempts` is the job's once it
    /// has joined (P2), whatever was configured.
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

    /// The splits of the published plan as this worker's view has it (the leader's is current
    /// when it asks for a plan: what a re-plan adds to).
    pub fn published(&self) -> impl Iterator<Item = &SplitId> {
        self.view.splits.iter().filter(|(_, sv)| sv.weight.is_some()).map(|(id, _)| id)
    }

    /// The splits this worker holds (including ones being acquired or released), with epochs.
    pub fn held(&self) -> impl Iterator<Item = (&SplitId, Epoch)> {
        self.tenancies.iter().map(|(id, h)| (id, h.epoch))
    }

    /// The splits this worker's lanes failed that wait to be claimed again: P9 counts them in
    /// its load (they usually come back to it).
    pub fn returning(&self) -> impl Iterator<Item = &SplitId> {
        self.failed_here.keys().filter(|id| !self.tenancies.contains(id))
    }

    /// Feeds one input at time `now`; returns the actions to execute, in order.
    pub fn handle(&mut self, now: Timestamp, input: Input) -> Vec<Action> {
        if self.phase == Phase::Stopped {
            return Vec::new();
        }
        // Timers that are due fire before the input is handled, whether or not their tick was
        // delivered yet: after a pause, a lapse of trust (P11) is acted on before anything
        // that arrived meanwhile, so no stale lease or leadership drives a decision.
        if input != Input::Start {
            self.on_tick(now);
        }
        match input {
            Input::Start => self.on_start(),
            Input::Tick => {}
            Input::StoreResult { op, result } => self.on_store_result(now, op, result),
            Input::Watch { watch, event } => self.on_watch(now, watch, event),
            Input::WatchFailed { watch } => self.on_watch_failed(watch),
            Input::PlanReady { request, result } => self.on_plan_ready(now, request, result),
            Input::Commit { split, epoch, progress } => self.on_commit(split, epoch, progress, false),
            Input::Finish { split, epoch, progress } => self.on_commit(split, epoch, progress, true),
            Input::Fail { split, epoch, error, unprocessable } => {
                self.on_fail(split, epoch, error, unprocessable)
            }
            Input::Quarantine { split, epoch, error } => self.on_give_up(split, epoch, error),
            Input::LaneStopped { split, epoch } => self.on_lane_stopped(split, epoch),
            Input::Release { split, epoch } => self.on_release(split, epoch),
            Input::Intake { limit } => self.intake_limit = limit,
            Input::Drain => self.on_drain(now),
        }
        if matches!(self.phase, Phase::Running | Phase::Leaving) {
            self.evaluate(now);
        }
        self.emit_gauges();
        self.outbox.take_actions()
    }

    /// The earliest time at which [`Input::Tick`] must be delivered, if any (the earliest
    /// armed timer; see `timers`).
    pub fn next_deadline(&self) -> Option<Timestamp> {
        let mut next: Option<Timestamp> = None;
        self.for_each_timer(|_, at| next = Some(next.map_or(at, |n| n.min(at))));
        next
    }

    /// Routes a store answer to the rule that sent the request.
    fn on_store_result(&mut self, now: Timestamp, op: OpId, result: StoreResult) {
        let Some(pending) = self.outbox.answered(op) else { return };
        match pending {
            Pending::MetaCreate => self.on_meta_create(now, result),
            Pending::MetaGet => self.on_meta_get(now, result),
            Pending::MetaRefresh => self.on_meta_refresh(result),
            Pending::PresenceCreate => {
                if self.presence.join == Join::Joined {
                    self.on_presence_recreate(now, result)
                } else {
                    self.on_presence_create(now, result)
                }
            }
            Pending::PresenceGet => self.on_presence_get(now, result),
            Pending::PresenceTakeover => self.on_presence_takeover(now, result),
            Pending::PresenceRenew => self.on_presence_renew(result),
            Pending::PresenceResolve => self.on_presence_resolve(now, result),
            Pending::LeaderCreate { sent } => self.on_leader_create(now, op, sent, result),
            Pending::LeaderRenew { sent } => self.on_leader_renew(op, sent, result),
            Pending::LeaderResolve { sent } => self.on_leader_resolve(op, sent, result),
            // Results of an earlier leadership stint are stale: that stint is over.
            Pending::HeadWrite { stint, .. } | Pending::HeadRead { stint, .. }
                if Some(stint) != self.leader.as_ref().map(|l| l.stint) => {}
            Pending::HeadWrite { head, .. } => self.on_head_write(now, head, result),
            Pending::HeadRead { attempted, .. } => self.on_head_read(now, attempted, result),
            Pending::PlanWrite { round, key, value } => self.on_plan_write(now, round, key, value, result),
            Pending::PlanTouchRead { round, key, value } => {
                self.on_plan_touch_read(now, round, key, value, result)
            }
            Pending::ManifestChunk { manifest, chunk, load } => {
                self.on_manifest_chunk(now, manifest, chunk, load, result)
            }
            Pending::GcList => self.on_gc_list(result),
            Pending::Cleanup | Pending::Release => {}
            Pending::Retire { key } => self.on_retire(now, key, result),
            Pending::StealAsk { victim } => self.on_steal_ask(victim, result),
            Pending::StealRefuse { rev } => self.on_steal_refuse(rev, result),
            Pending::RetireRead { key } => self.on_retire_read(now, key, result),
            Pending::LeaseAcquire { split, sent } => self.on_lease_acquire(op, split, sent, result),
            Pending::LeaseAcquireResolve { split, sent, write } => {
                self.on_lease_acquire_resolve(now, op, split, sent, write, result)
            }
            Pending::LeaseRenew { split, sent } => self.on_lease_renew(now, op, split, sent, result),
            Pending::LeaseRenewResolve { split, write } => {
                self.on_lease_renew_resolve(now, op, split, write, result)
            }
            Pending::LeaseDelete { split } => self.on_lease_delete(now, op, split, result),
            Pending::RecordClaim { split } => self.on_record_claim(now, op, split, result),
            Pending::RecordClaimRead { split } => self.on_record_claim_read(now, op, split, result),
            Pending::OrphanClaim(orphan) => self.on_orphan_claim(orphan, result),
            Pending::OrphanClaimRead(orphan) => self.on_orphan_claim_read(now, orphan, result),
            Pending::DescRead { split } => self.on_desc_read(now, op, split, result),
            Pending::RecordCommit { split } => self.on_record_commit(op, split, result),
            Pending::RecordCommitRead { split } => self.on_record_commit_read(op, split, result),
            Pending::RecordEnd { split } => self.on_record_end(now, op, split, result),
            Pending::RecordEndRead { split } => self.on_record_end_read(now, op, split, result),
        }
    }

    /// After every input: leave when leaving, else (once the view is ready) check completion
    /// (P13), lead (P4) and acquire (P5, P9).
    fn evaluate(&mut self, now: Timestamp) {
        if self.phase == Phase::Leaving {
            // A leaving worker takes nothing: a steal it asked for is withdrawn.
            if self.steal.is_some() {
                self.end_steal(None, io::HandoverOutcome::Withdrawn);
            }
            self.progress_leaving(now);
            return;
        }
        if !self.ready() || self.presence.join != Join::Joined {
            return;
        }
        self.load_manifest();
        match self.completion() {
            Some(outcome) if !self.cfg.stay_after_end => return self.leave(now, outcome),
            // Staying: report the end (again if it changed), and go on taking what comes back.
            Some(outcome) => {
                if self.ended.as_ref() != Some(&outcome) {
                    self.ended = Some(outcome.clone());
                    self.outbox.event(Event::JobEnded { outcome });
                }
            }
            None => {
                if self.ended.take().is_some() {
                    self.outbox.event(Event::JobReopened);
                }
            }
        }
        self.leadership(now);
        self.acquire(now);
    }
}
