//! Transient failures of a lane's source or sink (an outage, not the split's fault), retried
//! in place: waits with backoff and jitter, raced against the lane's stop, within a budget that
//! a success renews. Past the budget the tenancy ends as failing, with the side and the start of
//! the outage, and the worker's breaker says whether the split is charged (P12).

use std::time::Duration;

use tokio::time::Instant;
use tracing::{debug, info, warn};

use crate::lane::{Lane, Stop};

/// The longest wait between two tries.
const MAX_DELAY: Duration = Duration::from_secs(30);

/// What waiting out one transient failure came to.
pub(crate) enum Wait {
    /// Try again.
    Again,
    /// The lane was told to stop meanwhile.
    Stop(Stop),
    /// The budget is spent: the failure is reported, with this message.
    Spent(String),
}

/// Which side of the lane failed: a success of the same side ends the outage (a read that
/// works says nothing about a sink that is down).
pub(crate) use etl_coordination_core::DataSide as Side;

/// One lane's transient failures in a row.
pub(crate) struct Transient {
    budget: Duration,
    /// The side that is failing, when its run of failures began, and how many tries failed.
    since: Option<(Side, Instant, u32)>,
    delays: Box<dyn Iterator<Item = Duration> + Send>,
}

impl Transient {
    pub(crate) fn new(budget: Duration) -> Self {
        Transient { budget, since: None, delays: Box::new(delays()) }
    }

    /// A transient failure of `what`: waits (200 ms doubling up to 30 s, each plus a random
    /// extra of up to itself, within what is left of the budget) unless the lane stops first.
    pub(crate) async fn wait_out(&mut self, lane: &mut Lane, side: Side, what: &str, error: String) -> Wait {
        let now = Instant::now();
        if self.since.is_some_and(|(s, ..)| s != side) {
            // The other side fails now: its outage is the one that counts from here.
            self.since = None;
        }
        let (_, since, tries) = self.since.get_or_insert((side, now, 0));
        *tries += 1;
        let (since, tries) = (*since, *tries);
        let spent = now.saturating_duration_since(since);
        if spent >= self.budget {
            // The breaker weighs it with when it began (did other lanes get through since?).
            lane.outage = Some((side, since));
            return Wait::Spent(format!(
                "{error} ({what} kept failing for {:.0?}, past the transient retry budget of {:?})",
                spent, self.budget
            ));
        }
        let wait = self.delays.next().unwrap_or(MAX_DELAY).min(self.budget - spent);
        if tries == 1 {
            warn!(%error, what, budget = ?self.budget, "transient failure: retrying in place (not charged to the split)");
        } else {
            debug!(%error, what, tries, ?wait, "transient failure again");
        }
        tokio::select! {
            biased;
            stop = lane.revoked() => Wait::Stop(stop),
            () = tokio::time::sleep(wait) => Wait::Again,
        }
    }

    /// A try of `side` succeeded: if that side was failing, the next failure starts a new run
    /// with the whole budget.
    pub(crate) fn recovered(&mut self, side: Side) {
        if let Some((s, since, tries)) = self.since
            && s == side
        {
            self.since = None;
            info!(tries, after = ?since.elapsed(), "recovered from a transient failure");
            self.delays = Box::new(delays());
        }
    }
}

fn delays() -> impl Iterator<Item = Duration> + Send {
    use backon::BackoffBuilder;
    backon::ExponentialBuilder::default()
        .with_min_delay(Duration::from_millis(200))
        .with_factor(2.0)
        .with_max_delay(MAX_DELAY)
        .with_jitter()
        .without_max_times()
        .build()
}
