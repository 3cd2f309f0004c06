//! The data path (P12, issue 26): an outage is waited out for the whole retry budget before it
//! fails a tenancy; a worker whose splits fail alike stops charging them (the breaker); no
//! healthy split is quarantined by outages; skipped bad records count as delivered (to the
//! dead-letter sink). Also what a worker holds (never above its `max_in_flight`) and its drain
//! deadlines (kept, and not cut short).

use std::collections::BTreeMap;

use etl_coordination_core::{Epoch, Owner, SplitId, Timestamp};

use super::Checker;

/// Why an attempt was charged.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Charge {
    /// The lane failed past the retry budget of an outage.
    Outage,
    /// The source reported the split unprocessable (poison, a bad record).
    Data,
    /// The tenancy's lease expired with the record still owned (a crash, or a worker cut off
    /// from the store for a lease: the store cannot tell them apart).
    Expiry,
    /// As `Expiry`, but the owner's process was killed by another split it ran (a poison
    /// split that crashes its owner takes the tenancies of its neighbours down with it).
    Collateral,
}

/// One worker's failures past the budget, for the breaker's oracle.
#[derive(Debug, Default)]
pub(crate) struct Streak {
    /// (when on the worker's clock, split, side, charged) of each failure since its last flush.
    failures: Vec<(Timestamp, SplitId, &'static str, bool)>,
}

/// What got through on one worker, for the evidence an outage charge needs: (when on the
/// worker's clock, the split, the side) of each read and flush its lanes reported at commits.
#[derive(Debug, Default)]
pub(crate) struct GotThrough {
    ok: std::collections::VecDeque<(Timestamp, SplitId, &'static str)>,
}

/// How far back successes are kept: well beyond any outage's start (outages are shorter than
/// two retry budgets, and a lane's run of failures cannot be much longer).
fn horizon(budget: std::time::Duration) -> std::time::Duration {
    budget * 10 + std::time::Duration::from_secs(60)
}

impl Checker {
    /// Record `record` of `id` went to the dead-letter sink: delivered, as far as I2 goes.
    pub(super) fn on_dead_lettered(&mut self, id: &SplitId, record: u64) {
        if let Some(e) = self.emitted.get_mut(id).and_then(|v| v.get_mut(record as usize)) {
            *e = true;
        }
    }

    /// A lane's outage outlived the budget (P12): it must have failed for the whole budget,
    /// and a worker whose breaker must have opened does not charge a split failing for the
    /// first time in the streak.
    /// `(since, local)`: when the outage began for the lane and now, on the worker's clock.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn on_outage_failed(
        &mut self,
        at: Timestamp,
        id: &SplitId,
        epoch: Epoch,
        who: &Owner,
        side: &'static str,
        (since, local): (Timestamp, Timestamp),
        charged: bool,
    ) {
        let waited = local.saturating_since(since);
        let budget = self.transient_budget;
        self.ensure(at, "P12", waited >= budget, || {
            format!(
                "split {id}: {who}'s lane failed after {waited:?} of {side} outage, before the transient retry budget of {budget:?} (an outage is waited out in place)"
            )
        });
        if charged {
            self.failed.insert((id.clone(), epoch));
            self.outage_failed.insert((id.clone(), epoch));
        }
        let window = self.breaker_window;
        let threshold = self.breaker_threshold as usize;
        let streak = self.streaks.entry(who.clone()).or_default();
        // Failed and was released before (the breaker excuses a split once per opening).
        let again = streak.failures.iter().any(|(_, s, c, charged)| s == id && *c == side && !charged);
        let mut others: Vec<SplitId> = streak
            .failures
            .iter()
            .filter(|(t, s, c, _)| *c == side && s != id && local.saturating_since(*t) <= window)
            .map(|(_, s, ..)| s.clone())
            .collect();
        others.sort();
        others.dedup();
        let tripped = threshold > 0 && others.len() + 1 >= threshold;
        streak.failures.push((local, id.clone(), side, charged));
        // With nothing else on the worker through on that side since the outage began, the
        // worker cannot tell the split from the path: a charge could quarantine a healthy split.
        let evidence = self
            .got_through
            .get(who)
            .is_some_and(|g| g.ok.iter().any(|(t, s, c)| *c == side && s != id && *t >= since));
        if charged && threshold > 0 && !again && !evidence {
            self.fail(
                at,
                "P12",
                format!(
                    "split {id}: {who} charged an attempt for a {side} outage (since {since:?}) although no other split of it got through on the {side} since: the outage may be the worker's, so the breaker releases it without blame"
                ),
            );
        }
        if charged && tripped && !again {
            let n = others.len();
            self.fail(
                at,
                "P12",
                format!(
                    "split {id}: {who} charged an attempt for a {side} outage that {n} other splits of it failed with within the breaker window (threshold {threshold}): the breaker releases it without blame"
                ),
            );
        }
    }

    /// A worker's lane of `id` flushed its sink at `local` (having read at `read_at`): its
    /// failures so far no longer add up (the breaker closes), and both paths got through.
    pub(super) fn on_flushed(
        &mut self,
        who: &Owner,
        id: &SplitId,
        local: Timestamp,
        read_at: Option<Timestamp>,
    ) {
        self.streaks.remove(who);
        let horizon = horizon(self.transient_budget);
        let g = self.got_through.entry(who.clone()).or_default();
        // (In the order reported: a read is older than its flush, so the front is only about
        // the oldest; it is a horizon, not a bound the check relies on.)
        while g.ok.front().is_some_and(|(t, ..)| local.saturating_since(*t) > horizon) {
            g.ok.pop_front();
        }
        if let Some(t) = read_at {
            g.ok.push_back((t, id.clone(), "source"));
        }
        g.ok.push_back((local, id.clone(), "sink"));
    }

    /// An attempt of `id` was charged, for `cause`; a healthy split is never quarantined by
    /// outages alone (each outage charges it at most once, and a run has fewer outages than
    /// attempts).
    pub(super) fn on_charge(&mut self, at: Timestamp, id: &SplitId, cause: Charge, quarantined: bool) {
        let charges = self.charges.entry(id.clone()).or_default();
        charges.push(cause);
        if quarantined && !self.may_quarantine.contains(id) {
            let charges = charges.clone();
            if charges.contains(&Charge::Collateral) {
                self.collateral.push((id.clone(), charges));
                return;
            }
            self.innocent.push((id.clone(), charges.clone()));
            let outages_alone = charges.iter().all(|c| *c == Charge::Outage);
            self.ensure(at, "P12", !outages_alone, || {
                format!(
                    "split {id}: a healthy split quarantined by data-path outages alone (charges {charges:?})"
                )
            });
        }
    }

    /// What a worker holds after an input: never more than its `max_in_flight`.
    pub(super) fn on_held(&mut self, at: Timestamp, who: &Owner, held: u32, cap: u32) {
        self.ensure(at, "P9", held <= cap, || {
            format!("{who} holds {held} splits, above its max_in_flight of {cap}")
        });
    }

    /// A draining lane was stopped at once (`local`: the worker's clock) before the deadline it
    /// was given (`deadline`).
    pub(super) fn on_drain_stopped(
        &mut self,
        at: Timestamp,
        id: &SplitId,
        who: &Owner,
        local: Timestamp,
        deadline: Timestamp,
    ) {
        self.ensure(at, "P10", local >= deadline, || {
            format!(
                "split {id}: {who} stopped its draining lane {:?} before the drain deadline it gave it",
                deadline.saturating_since(local)
            )
        });
    }

    /// After an input at `local` (the worker's clock): a draining lane still running with no
    /// commit in flight must be before its deadline (the core stops it when it passes).
    pub(super) fn on_drain_running(
        &mut self,
        at: Timestamp,
        id: &SplitId,
        who: &Owner,
        local: Timestamp,
        deadline: Timestamp,
    ) {
        self.ensure(at, "P10", local < deadline, || {
            let late = local.saturating_since(deadline);
            format!("split {id}: {who}'s draining lane still runs {late:?} after its drain deadline")
        });
    }
}

/// The tenancies charged for an outage and the charges of each split since its count was
/// reset, as the checker keeps them.
pub(crate) type Charges = BTreeMap<SplitId, Vec<Charge>>;
