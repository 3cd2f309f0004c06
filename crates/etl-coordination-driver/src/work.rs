//! The work this worker's lanes did, by weight and by records: for the work metrics and the
//! worker's report (`report.{instance}`, read by `etl-coord status` for progress by work, the
//! rates and the ETA). Informational only: nothing of the protocol depends on it.

use std::collections::{BTreeMap, VecDeque};
use std::time::Duration;

use etl_coordination_core::records::WorkReport;
use etl_coordination_core::{Epoch, Incarnation, SplitId};
use tokio::time::Instant;

/// How far back the rates look.
pub(crate) const RATE_WINDOW: Duration = Duration::from_secs(60);

/// One lane's part: its split's planned weight and where it stands.
struct LaneWork {
    epoch: Epoch,
    weight: u64,
    /// The last position credited, in the weight's unit; `None` until known (a lane resumed
    /// from committed progress starts where the previous tenancy left off, which this worker
    /// does not know before the lane's first report).
    position: Option<u64>,
}

/// This worker's work since it started, and samples of it for the rates.
#[derive(Default)]
pub(crate) struct Work {
    lanes: BTreeMap<SplitId, LaneWork>,
    records: u64,
    weight: u64,
    /// `(when, records, weight)`, oldest first, spanning at most [`RATE_WINDOW`] (plus the one
    /// sample before it, the base of the rates).
    samples: VecDeque<(Instant, u64, u64)>,
}

impl Work {
    /// A lane started on `split` (planned `weight`); `fresh`: from the split's start (nothing
    /// committed before), so its work counts from position 0.
    pub(crate) fn started(&mut self, split: SplitId, epoch: Epoch, weight: u64, fresh: bool) {
        let position = fresh.then_some(0);
        self.lanes.insert(split, LaneWork { epoch, weight, position });
    }

    /// The lane of `split` at `epoch` reported `records` more written and committed, its
    /// split at `position`. What it adds: `(weight, records)`.
    pub(crate) fn worked(
        &mut self,
        split: &SplitId,
        epoch: Epoch,
        records: u64,
        position: Option<u64>,
    ) -> (u64, u64) {
        self.records += records;
        let mut weight = 0;
        if let Some(lane) = self.lanes.get_mut(split).filter(|l| l.epoch == epoch)
            && let Some(at) = position.map(|p| p.min(lane.weight))
        {
            weight = lane.position.map_or(0, |before| at.saturating_sub(before));
            lane.position = Some(at.max(lane.position.unwrap_or(0)));
        }
        self.weight += weight;
        (weight, records)
    }

    /// The lane of `split` at `epoch` finished its split: the rest of its weight is done.
    /// What it adds.
    pub(crate) fn finished(&mut self, split: &SplitId, epoch: Epoch) -> u64 {
        let Some(lane) = self.lanes.get(split).filter(|l| l.epoch == epoch) else { return 0 };
        let rest = lane.weight.saturating_sub(lane.position.unwrap_or(0));
        self.lanes.remove(split);
        self.weight += rest;
        rest
    }

    /// The lane of `split` at `epoch` ended otherwise (released, stolen, failed, fenced).
    pub(crate) fn ended(&mut self, split: &SplitId, epoch: Epoch) {
        if self.lanes.get(split).is_some_and(|l| l.epoch == epoch) {
            self.lanes.remove(split);
        }
    }

    /// Takes a sample at `now` and makes the report of `incarnation`.
    pub(crate) fn report(&mut self, now: Instant, incarnation: Incarnation) -> WorkReport {
        self.samples.push_back((now, self.records, self.weight));
        while self.samples.len() > 2
            && self.samples.get(1).is_some_and(|(t, ..)| now.duration_since(*t) >= RATE_WINDOW)
        {
            self.samples.pop_front();
        }
        let (records_per_sec, weight_per_sec) = match self.samples.front() {
            Some((t, records, weight)) if now > *t => {
                let secs = now.duration_since(*t).as_secs_f64();
                ((self.records - records) as f64 / secs, (self.weight - weight) as f64 / secs)
            }
            _ => (0.0, 0.0),
        };
        let positions = self
            .lanes
            .iter()
            .filter_map(|(split, l)| l.position.map(|p| (split.clone(), l.epoch, p)))
            .collect();
        WorkReport {
            incarnation,
            records: self.records,
            weight: self.weight,
            records_per_sec,
            weight_per_sec,
            positions,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn split(s: &str) -> SplitId {
        SplitId::new(s).unwrap()
    }

    #[test]
    fn positions_count_once_and_a_finished_split_counts_its_rest() {
        let mut w = Work::default();
        w.started(split("a"), Epoch(1), 1000, true);
        assert_eq!(w.worked(&split("a"), Epoch(1), 10, Some(300)), (300, 10));
        // A position reported again, or a lower one, adds nothing; one past the weight counts
        // as the weight.
        assert_eq!(w.worked(&split("a"), Epoch(1), 0, Some(300)), (0, 0));
        assert_eq!(w.worked(&split("a"), Epoch(1), 0, Some(200)), (0, 0));
        assert_eq!(w.worked(&split("a"), Epoch(1), 5, Some(5000)), (700, 5));
        assert_eq!(w.finished(&split("a"), Epoch(1)), 0);
        // Resumed from another tenancy's progress: its first position is the base.
        w.started(split("b"), Epoch(4), 1000, false);
        assert_eq!(w.worked(&split("b"), Epoch(4), 7, Some(600)), (0, 7));
        assert_eq!(w.worked(&split("b"), Epoch(4), 7, Some(650)), (50, 7));
        // Another tenancy's report (a lane of an earlier epoch) moves nothing.
        assert_eq!(w.worked(&split("b"), Epoch(3), 2, Some(900)), (0, 2));
        assert_eq!(w.finished(&split("b"), Epoch(4)), 350);
        // A source that never says where it stands: the whole weight at the end.
        w.started(split("c"), Epoch(1), 40, true);
        assert_eq!(w.worked(&split("c"), Epoch(1), 3, None), (0, 3));
        assert_eq!(w.finished(&split("c"), Epoch(1)), 40);
        // A lane that ended otherwise counts nothing more.
        w.started(split("d"), Epoch(1), 40, true);
        w.ended(&split("d"), Epoch(1));
        assert_eq!(w.finished(&split("d"), Epoch(1)), 0);
        let r = w.report(Instant::now(), Incarnation(1));
        assert_eq!((r.records, r.weight), (34, 1000 + 400 + 40));
    }

    #[test]
    fn rates_are_over_the_last_minute_and_positions_are_reported() {
        let mut w = Work::default();
        let t0 = Instant::now();
        w.started(split("a"), Epoch(2), 10_000, true);
        let r = w.report(t0, Incarnation(1));
        assert_eq!((r.records_per_sec, r.weight_per_sec), (0.0, 0.0), "no rate from one sample");
        w.worked(&split("a"), Epoch(2), 100, Some(1000));
        let r = w.report(t0 + Duration::from_secs(10), Incarnation(1));
        assert_eq!((r.records_per_sec, r.weight_per_sec), (10.0, 100.0));
        assert_eq!(r.positions, vec![(split("a"), Epoch(2), 1000)]);
        // Ten minutes on at a slower pace: the rate is the last minute's, not the average.
        for s in 1..=60u64 {
            w.worked(&split("a"), Epoch(2), 1, Some(1000 + s));
            let _ = w.report(t0 + Duration::from_secs(600 + s), Incarnation(1));
        }
        let r = w.report(t0 + Duration::from_secs(661), Incarnation(1));
        assert!((0.9..=1.1).contains(&r.records_per_sec), "{}", r.records_per_sec);
        assert!((0.9..=1.1).contains(&r.weight_per_sec), "{}", r.weight_per_sec);
    }
}
