//! The lanes the driver handed out and that have not ended: one entry per tenancy, with what
//! the lane stall check needs.

use std::collections::BTreeMap;
use std::time::Duration;

use etl_coordination_core::{Epoch, SplitId};
use tokio::sync::watch;
use tokio::time::Instant;

use crate::lane::Stop;

/// A lane the source runs: how to stop it, and when it last made progress.
pub(crate) struct LaneEntry {
    pub(crate) epoch: Epoch,
    pub(crate) stop: watch::Sender<Option<Stop>>,
    /// The lane's start or its last successful commit.
    pub(crate) progress_at: Instant,
    /// Reported stalled (no progress for the lane stall timeout), until its next commit.
    pub(crate) stalled: bool,
    /// Told to drain: it commits and stops on its own deadline; no stall check.
    pub(crate) draining: bool,
    /// Its finish (terminal commit) is in flight.
    pub(crate) finishing: bool,
}

impl LaneEntry {
    /// A lane starting now at `epoch`.
    pub(crate) fn new(epoch: Epoch, stop: watch::Sender<Option<Stop>>) -> Self {
        LaneEntry {
            epoch,
            stop,
            progress_at: Instant::now(),
            stalled: false,
            draining: false,
            finishing: false,
        }
    }

    /// Whether the stall check watches it: not reported yet, not draining, not finishing.
    pub(crate) fn watched(&self) -> bool {
        !self.stalled && !self.draining && !self.finishing
    }
}

/// The running lanes, by split (a worker runs at most one lane per split).
#[derive(Default)]
pub(crate) struct LaneTable {
    running: BTreeMap<SplitId, LaneEntry>,
}

impl LaneTable {
    /// The running lane of `split` if it is at `epoch`.
    pub(crate) fn get(&mut self, split: &SplitId, epoch: Epoch) -> Option<&mut LaneEntry> {
        self.running.get_mut(split).filter(|l| l.epoch == epoch)
    }

    /// A lane started; the one it replaces, if any.
    pub(crate) fn insert(&mut self, split: SplitId, entry: LaneEntry) -> Option<LaneEntry> {
        self.running.insert(split, entry)
    }

    /// The lane of `split` at `epoch` ended: forgotten, and returned.
    pub(crate) fn end(&mut self, split: &SplitId, epoch: Epoch) -> Option<LaneEntry> {
        self.get(split, epoch)?;
        self.running.remove(split)
    }

    /// How many lanes are reported stalled.
    pub(crate) fn stalled(&self) -> u32 {
        self.running.values().filter(|l| l.stalled).count() as u32
    }

    /// When the next lane becomes stalled, if it makes no progress meanwhile.
    pub(crate) fn next_stall_check(&self, timeout: Duration) -> Option<Instant> {
        self.running.values().filter(|l| l.watched()).map(|l| l.progress_at + timeout).min()
    }

    /// The watched lanes without progress for `timeout` at `now`.
    pub(crate) fn stalled_by(&self, timeout: Duration, now: Instant) -> Vec<(SplitId, Epoch)> {
        self.running
            .iter()
            .filter(|(_, l)| l.watched() && l.progress_at + timeout <= now)
            .map(|(id, l)| (id.clone(), l.epoch))
            .collect()
    }

    /// Every lane, removed (the worker stops).
    pub(crate) fn take_all(&mut self) -> BTreeMap<SplitId, LaneEntry> {
        std::mem::take(&mut self.running)
    }
}
