//! The worker's breaker (P12): when different splits on this worker fail with the same
//! cause within a window, the cause is the worker's or its sink's (a sink that is down, a
//! bucket that cannot be reached, credentials that expired), not the splits'. The breaker then
//! stops charging attempts for that cause (the failed tenancies are released without blame),
//! pauses intake (the worker claims nothing new; what it holds it keeps), and after a backoff
//! probes by taking one split more than it holds: a commit of any lane (its sink flushed)
//! closes it; the same failure again reopens it for twice as long.
//!
//! Only failures a split could be blamed for by mistake count: a split the source reports
//! unprocessable (bad data) is charged as always, so a poison split is still quarantined. One
//! split failing again and again never trips it (it needs distinct splits).
//!
//! An outage (a transient failure waited out past the retry budget) is charged only with
//! evidence that it is the split's: another split on this worker got through on the same side
//! (read from the source, or flushed to the sink) after the outage began. Without it (the
//! worker ran no other lane then, or all of them were stuck too) the worker cannot tell a
//! poison split from a sink that is down, and a charge could quarantine a healthy split
//! (sweep seed 4091659: a worker with one lane met a sink outage and a source outage, two
//! charges, then two crashes): it trips the breaker as if the threshold were met. A split that
//! really fails alone is charged once other lanes show the path works, or on its second
//! failure while the breaker is still open (each split is excused once per cause).
//!
//! Pure, like the rest of the core (time comes in as `now`): the driver runs it beside the
//! worker, and the simulator runs the same code against its sink outages.

use std::collections::{BTreeSet, VecDeque};
use std::time::Duration;

use crate::{SplitId, Timestamp};

/// The first wait before a probe; it doubles on every failed probe up to [`MAX_PROBE_WAIT`].
const FIRST_PROBE_WAIT: Duration = Duration::from_secs(10);
/// The longest wait before a probe.
const MAX_PROBE_WAIT: Duration = Duration::from_secs(300);

/// Which side of a lane failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DataSide {
    /// Reading the split from the source.
    Source = 0,
    /// Writing to the sink (or flushing it).
    Sink = 1,
}

/// A transient failure the lane waited out in place until its retry budget was spent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Outage {
    /// The side that kept failing.
    pub side: DataSide,
    /// When its run of failures began (the lane's first failure of that side in a row).
    pub since: Timestamp,
}

/// The latest success of one side on this worker, and the latest of a split other than that
/// one: enough to answer "did a split other than X succeed at or after t?".
#[derive(Debug, Default)]
struct Latest {
    last: Option<(Timestamp, SplitId)>,
    other: Option<(Timestamp, SplitId)>,
}

impl Latest {
    fn record(&mut self, at: Timestamp, split: &SplitId) {
        match &mut self.last {
            None => self.last = Some((at, split.clone())),
            Some((t, s)) if s == split => *t = (*t).max(at),
            Some((t, _)) if at >= *t => self.other = self.last.replace((at, split.clone())),
            Some(_) => {
                if self.other.as_ref().is_none_or(|(t, _)| at > *t) {
                    self.other = Some((at, split.clone()));
                }
            }
        }
    }

    /// Whether a split other than `split` succeeded at or after `since`.
    fn other_since(&self, split: &SplitId, since: Timestamp) -> bool {
        let latest = match &self.last {
            Some((_, s)) if s == split => &self.other,
            last => last,
        };
        latest.as_ref().is_some_and(|(t, _)| *t >= since)
    }
}

/// What the breaker says about one failure of a lane.
#[derive(Debug, PartialEq, Eq)]
pub enum BreakerVerdict {
    /// The split's failure: charge it (P12). `tripped`: this failure (a failed probe of a
    /// split already excused once) opened the breaker again (pause intake).
    Charge {
        /// This failure opened the breaker again.
        tripped: bool,
    },
    /// The worker's: release the split without blame. `tripped`: this failure opened the
    /// breaker (pause intake).
    Release {
        /// This failure opened the breaker.
        tripped: bool,
    },
}

/// Where the breaker is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BreakerState {
    /// Failures are the splits'.
    Closed,
    /// Intake paused until `until`, then a probe.
    Open {
        /// The cause that tripped it (see [`failure_cause`]).
        cause: String,
        /// When it probes.
        until: Timestamp,
        /// How long it waited this time (doubles on a failed probe).
        wait: Duration,
    },
    /// Probing: one split more than held; a commit closes, the same failure reopens.
    HalfOpen {
        /// The cause that tripped it.
        cause: String,
        /// The last wait.
        wait: Duration,
    },
}

/// The breaker of one worker.
#[derive(Debug)]
pub struct Breaker {
    /// Distinct splits failing with one cause within `window` that trip it; 0: never.
    threshold: usize,
    window: Duration,
    recent: VecDeque<(Timestamp, SplitId, String)>,
    state: BreakerState,
    /// Other causes found to be the worker's while it was open (the source went down, then
    /// the sink too): treated like the one that tripped it until it closes.
    also: BTreeSet<String>,
    /// Splits released without charge since the breaker opened, with the cause: each is
    /// excused once per cause, so that
    /// splits failing for their own reasons (with one message) still reach quarantine while
    /// it stays open.
    excused: BTreeSet<(SplitId, String)>,
    /// The latest successes of each side (source, sink), for the evidence an outage needs.
    ok: [Latest; 2],
    /// When it last opened: only a flush after that closes it.
    opened_at: Timestamp,
}

/// The cause of a failure, as compared between splits: the innermost message of the error
/// chain (after the last `": "`), digits masked, so that `reading a.txt: connection refused`
/// and `reading b.txt: connection refused` (or two OS error numbers of one kind) are one cause.
pub fn failure_cause(error: &str) -> String {
    // A transient failure past its budget ends with `(writing to the sink kept failing for
    // 5.2s, past ...)`: the step and the time are not the cause.
    let error = match error.find(" kept failing for ") {
        Some(i) => error[..i].rfind(" (").map_or(error, |j| &error[..j]),
        None => error,
    };
    let inner = error.rsplit(": ").next().unwrap_or(error);
    let mut out = String::with_capacity(inner.len());
    for c in inner.chars() {
        if c.is_ascii_digit() {
            if !out.ends_with('N') {
                out.push('N');
            }
        } else {
            out.push(c);
        }
    }
    out
}

impl Breaker {
    /// A closed breaker: `threshold` distinct splits failing alike within `window` trip it
    /// (0: never).
    pub fn new(threshold: u32, window: Duration) -> Self {
        Breaker {
            threshold: threshold as usize,
            window,
            recent: VecDeque::new(),
            state: BreakerState::Closed,
            also: BTreeSet::new(),
            excused: BTreeSet::new(),
            ok: Default::default(),
            opened_at: Timestamp::from_micros(0),
        }
    }

    /// Where it is.
    pub fn state(&self) -> &BreakerState {
        &self.state
    }

    /// A lane of `split` failed with `error` (not unprocessable); `outage`: it was a transient
    /// failure waited out past the retry budget (`None`: the split's own failure, as the source
    /// or the sink said).
    pub fn on_failure(
        &mut self,
        now: Timestamp,
        split: &SplitId,
        error: &str,
        outage: Option<Outage>,
    ) -> BreakerVerdict {
        if self.threshold == 0 {
            return BreakerVerdict::Charge { tripped: false };
        }
        let cause = failure_cause(error);
        let open_cause = match &self.state {
            BreakerState::Open { cause, .. } | BreakerState::HalfOpen { cause, .. } => Some(cause.clone()),
            BreakerState::Closed => None,
        };
        if open_cause.as_ref() == Some(&cause) || self.also.contains(&cause) {
            let excuse = (split.clone(), cause.clone());
            // A failed probe: open again, for twice as long.
            let tripped = if let BreakerState::HalfOpen { wait, .. } = self.state {
                let wait = (wait * 2).min(MAX_PROBE_WAIT);
                let cause = open_cause.unwrap_or(cause);
                self.state = BreakerState::Open { cause, until: now + wait, wait };
                self.opened_at = now;
                true
            } else {
                false
            };
            return if self.excused.insert(excuse) {
                BreakerVerdict::Release { tripped }
            } else {
                BreakerVerdict::Charge { tripped }
            };
        }
        while self.recent.front().is_some_and(|(t, ..)| now.saturating_since(*t) > self.window) {
            self.recent.pop_front();
        }
        self.recent.push_back((now, split.clone(), cause.clone()));
        let mut splits: Vec<&SplitId> =
            self.recent.iter().filter(|(_, _, c)| *c == cause).map(|(_, s, _)| s).collect();
        splits.sort();
        splits.dedup();
        // An outage that nothing else on this worker got through since it began: the worker's,
        // as far as it can tell.
        let unproven = outage.is_some_and(|o| !self.ok[o.side as usize].other_since(split, o.since));
        if splits.len() < self.threshold && !unproven {
            return BreakerVerdict::Charge { tripped: false };
        }
        if let Some(open_cause) = open_cause {
            // Open for another cause, and this one is the worker's too: its failures are excused
            // like the first cause's. Intake is paused already, unless it was probing: then the
            // probe failed (open again, for twice as long).
            self.recent.retain(|(_, _, c)| *c != cause);
            self.excused.insert((split.clone(), cause.clone()));
            self.also.insert(cause);
            let tripped = if let BreakerState::HalfOpen { wait, .. } = self.state {
                let wait = (wait * 2).min(MAX_PROBE_WAIT);
                self.state = BreakerState::Open { cause: open_cause, until: now + wait, wait };
                self.opened_at = now;
                true
            } else {
                false
            };
            return BreakerVerdict::Release { tripped };
        }
        // (Failures of other causes still count: the sink may be failing too.)
        self.recent.retain(|(_, _, other)| *other != cause);
        self.excused.clear();
        self.excused.insert((split.clone(), cause.clone()));
        self.state = BreakerState::Open { cause, until: now + FIRST_PROBE_WAIT, wait: FIRST_PROBE_WAIT };
        self.opened_at = now;
        BreakerVerdict::Release { tripped: true }
    }

    /// When an open breaker probes.
    pub fn probe_at(&self) -> Option<Timestamp> {
        match self.state {
            BreakerState::Open { until, .. } => Some(until),
            _ => None,
        }
    }

    /// The wait is over: probe (half-open).
    pub fn probe(&mut self) {
        if let BreakerState::Open { cause, wait, .. } = &self.state {
            self.state = BreakerState::HalfOpen { cause: cause.clone(), wait: *wait };
        }
    }

    /// A lane of `split` flushed its outputs at `flushed_at` and asks to commit (or to finish
    /// its split), having last read from the source at `read_at` (`None`: not known): evidence
    /// that both paths worked then, for other splits' outages (a commit tried again while the
    /// store could not take it passes the time of its flush, not its own: the sink may have
    /// gone down since). A flush after the breaker opened says the cause is gone: it closes an
    /// open or probing breaker (a lane that kept running while it was open counts); `true` if
    /// it did. Without this, a breaker opened by one outage charged the splits it had excused
    /// then when a second outage came, although the sink had worked in between (sweep seeds
    /// 3048588, 3077272).
    pub fn on_commit(&mut self, split: &SplitId, flushed_at: Timestamp, read_at: Option<Timestamp>) -> bool {
        self.ok[DataSide::Sink as usize].record(flushed_at, split);
        if let Some(at) = read_at {
            self.ok[DataSide::Source as usize].record(at, split);
        }
        if !matches!(self.state, BreakerState::Closed) && flushed_at >= self.opened_at {
            self.state = BreakerState::Closed;
            self.excused.clear();
            self.also.clear();
            return true;
        }
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const CHARGE: BreakerVerdict = BreakerVerdict::Charge { tripped: false };

    fn s(id: &str) -> SplitId {
        SplitId::new(id).unwrap()
    }

    #[test]
    fn causes_compare_the_innermost_message_with_digits_masked() {
        assert_eq!(
            failure_cause("sink: No space left on device (os error 28)"),
            "No space left on device (os error N)"
        );
        assert_eq!(
            failure_cause("reading a/1.txt: connection refused"),
            failure_cause("reading b/22.txt: connection refused")
        );
        assert_ne!(failure_cause("sink: disk full"), failure_cause("sink: permission denied"));
    }

    #[test]
    fn distinct_splits_failing_alike_trip_it_and_one_split_failing_again_never_does() {
        let t0 = Timestamp::from_millis(1_000);
        let mut b = Breaker::new(3, Duration::from_secs(60));
        for _ in 0..10 {
            assert_eq!(b.on_failure(t0, &s("poison"), "sink: boom", None), CHARGE);
        }
        assert_eq!(b.on_failure(t0, &s("a"), "sink: boom", None), CHARGE);
        assert_eq!(b.on_failure(t0, &s("b"), "sink: other", None), CHARGE, "another cause");
        assert_eq!(b.on_failure(t0, &s("b"), "sink: boom", None), BreakerVerdict::Release { tripped: true });
        assert!(matches!(b.state(), BreakerState::Open { .. }));
        assert_eq!(b.on_failure(t0, &s("c"), "sink: boom", None), BreakerVerdict::Release { tripped: false });
        assert_eq!(b.on_failure(t0, &s("c"), "sink: other", None), CHARGE, "another cause is the split's");
        assert_eq!(b.on_failure(t0, &s("c"), "sink: boom", None), CHARGE, "each split is excused once");
    }

    #[test]
    fn failures_outside_the_window_do_not_add_up() {
        let t0 = Timestamp::from_millis(1_000);
        let mut b = Breaker::new(2, Duration::from_secs(60));
        assert_eq!(b.on_failure(t0, &s("a"), "x: down", None), CHARGE);
        assert_eq!(b.on_failure(t0 + Duration::from_secs(61), &s("b"), "x: down", None), CHARGE);
        let zero = &mut Breaker::new(0, Duration::from_secs(60));
        assert_eq!(zero.on_failure(t0, &s("a"), "x: down", None), CHARGE);
        assert_eq!(zero.on_failure(t0, &s("b"), "x: down", None), CHARGE, "0 turns it off");
    }

    #[test]
    fn a_failed_probe_reopens_for_twice_as_long_and_a_commit_closes_it() {
        let t0 = Timestamp::from_millis(1_000);
        let mut b = Breaker::new(2, Duration::from_secs(60));
        b.on_failure(t0, &s("a"), "x: down", None);
        assert_eq!(b.on_failure(t0, &s("b"), "x: down", None), BreakerVerdict::Release { tripped: true });
        assert_eq!(b.probe_at(), Some(t0 + FIRST_PROBE_WAIT));
        b.probe();
        let t1 = t0 + FIRST_PROBE_WAIT;
        assert_eq!(b.on_failure(t1, &s("c"), "x: down", None), BreakerVerdict::Release { tripped: true });
        assert_eq!(b.probe_at(), Some(t1 + FIRST_PROBE_WAIT * 2));
        b.probe();
        b.probe();
        // The probe's split was excused once already: a split failing for its own reasons
        // with the same message is charged, and reaches quarantine while the breaker is open.
        assert_eq!(b.on_failure(t1, &s("c"), "x: down", None), BreakerVerdict::Charge { tripped: true });
        b.probe();
        assert!(b.on_commit(&s("z"), t1, None));
        assert_eq!(b.state(), &BreakerState::Closed);
        assert_eq!(b.on_failure(t1, &s("d"), "x: down", None), CHARGE, "closed: counting again from zero");
    }

    #[test]
    fn a_commit_while_open_closes_it_and_the_count_starts_again() {
        let t0 = Timestamp::from_millis(1_000);
        let mut b = Breaker::new(2, Duration::from_secs(60));
        b.on_failure(t0, &s("a"), "x: down", None);
        assert_eq!(b.on_failure(t0, &s("b"), "x: down", None), BreakerVerdict::Release { tripped: true });
        // A lane that kept running flushed its sink: the outage is over.
        assert!(b.on_commit(&s("z"), t0, None));
        assert_eq!(b.state(), &BreakerState::Closed);
        assert_eq!(b.probe_at(), None);
        // A second outage: `b`, excused in the first opening, is one split failing again,
        // then a second split says the worker's again.
        assert_eq!(b.on_failure(t0, &s("b"), "x: down", None), CHARGE);
        assert_eq!(b.on_failure(t0, &s("c"), "x: down", None), BreakerVerdict::Release { tripped: true });
        assert!(
            !Breaker::new(2, Duration::from_secs(60)).on_commit(&s("z"), t0, None),
            "closed: nothing to close"
        );
    }

    #[test]
    fn a_second_cause_meeting_the_threshold_while_open_is_excused_too() {
        let t0 = Timestamp::from_millis(1_000);
        let mut b = Breaker::new(2, Duration::from_secs(60));
        b.on_failure(t0, &s("a"), "source: connection reset", None);
        assert_eq!(
            b.on_failure(t0, &s("b"), "source: connection reset", None),
            BreakerVerdict::Release { tripped: true }
        );
        // The sink goes down too: its first failure is one split's, the second says the
        // worker's, and from then on it is treated like the source's.
        assert_eq!(b.on_failure(t0, &s("c"), "sink: disk full", None), CHARGE);
        assert_eq!(
            b.on_failure(t0, &s("d"), "sink: disk full", None),
            BreakerVerdict::Release { tripped: false }
        );
        assert_eq!(
            b.on_failure(t0, &s("e"), "sink: disk full", None),
            BreakerVerdict::Release { tripped: false }
        );
        assert_eq!(b.on_failure(t0, &s("e"), "sink: disk full", None), CHARGE, "each split is excused once");
        b.probe();
        assert!(b.on_commit(&s("z"), t0, None));
        assert_eq!(
            b.on_failure(t0, &s("f"), "sink: disk full", None),
            CHARGE,
            "closed: both causes forgotten"
        );
    }

    #[test]
    fn tripping_for_one_cause_keeps_the_count_of_another() {
        let t0 = Timestamp::from_millis(1_000);
        let mut b = Breaker::new(2, Duration::from_secs(60));
        assert_eq!(b.on_failure(t0, &s("a"), "sink: disk full", None), CHARGE);
        assert_eq!(b.on_failure(t0, &s("b"), "source: connection reset", None), CHARGE);
        assert_eq!(
            b.on_failure(t0, &s("c"), "source: connection reset", None),
            BreakerVerdict::Release { tripped: true }
        );
        // The sink's failure of `a` still counts: a second split failing on the sink is the
        // worker's (sweep seed 2406493 charged it: the trip forgot every other cause).
        assert_eq!(
            b.on_failure(t0, &s("d"), "sink: disk full", None),
            BreakerVerdict::Release { tripped: false }
        );
    }

    fn outage(side: DataSide, since: Timestamp) -> Option<Outage> {
        Some(Outage { side, since })
    }

    #[test]
    fn an_outage_nothing_else_got_through_is_the_workers_and_one_others_got_through_is_the_splits() {
        let t0 = Timestamp::from_millis(1_000);
        let t1 = t0 + Duration::from_secs(60);
        let down = "sink: No space left on device (os error 28)";
        // The worker's only lane: nothing tells its outage from a poison split, so it is the
        // worker's (released, intake paused) although one split is below the threshold of 3.
        let mut b = Breaker::new(3, Duration::from_secs(60));
        assert_eq!(
            b.on_failure(t1, &s("a"), down, outage(DataSide::Sink, t0)),
            BreakerVerdict::Release { tripped: true }
        );
        // While it is open, the same split failing again is charged (excused once per cause).
        assert_eq!(
            b.on_failure(t1, &s("a"), down, outage(DataSide::Sink, t0)),
            BreakerVerdict::Charge { tripped: false }
        );

        // Another lane flushed after the outage began: the sink works, the failure is the split's.
        let mut b = Breaker::new(3, Duration::from_secs(60));
        b.on_commit(&s("b"), t0 + Duration::from_secs(1), Some(t0 - Duration::from_secs(1)));
        assert_eq!(b.on_failure(t1, &s("a"), down, outage(DataSide::Sink, t0)), CHARGE);
        // ... but its reads were before a source outage began: no evidence for the source.
        let reset = "reading a: connection reset by peer (os error 104)";
        assert_eq!(
            b.on_failure(t1, &s("c"), reset, outage(DataSide::Source, t0)),
            BreakerVerdict::Release { tripped: true }
        );

        // The failing split's own commits are no evidence, nor others' from before the outage.
        let mut b = Breaker::new(3, Duration::from_secs(60));
        b.on_commit(&s("b"), t0 - Duration::from_secs(1), Some(t0 - Duration::from_secs(1)));
        b.on_commit(&s("a"), t0 + Duration::from_secs(2), Some(t0 + Duration::from_secs(2)));
        assert_eq!(
            b.on_failure(t1, &s("a"), down, outage(DataSide::Sink, t0)),
            BreakerVerdict::Release { tripped: true }
        );

        // A failure that is not an outage (the sink rejected the split's data) needs none.
        let mut b = Breaker::new(3, Duration::from_secs(60));
        assert_eq!(b.on_failure(t1, &s("a"), "sink: schema mismatch", None), CHARGE);
        // And a breaker turned off charges everything.
        let mut off = Breaker::new(0, Duration::from_secs(60));
        assert_eq!(off.on_failure(t1, &s("a"), down, outage(DataSide::Sink, t0)), CHARGE);
    }

    #[test]
    fn a_commit_of_a_flush_from_before_it_opened_does_not_close_it_nor_vouch_for_later() {
        let t0 = Timestamp::from_millis(1_000);
        let secs = |n| t0 + Duration::from_secs(n);
        let down = "sink: No space left on device (os error 28)";
        let mut b = Breaker::new(3, Duration::from_secs(60));
        b.on_commit(&s("b"), secs(1), None);
        assert_eq!(
            b.on_failure(secs(30), &s("a"), down, outage(DataSide::Sink, secs(5))),
            BreakerVerdict::Release { tripped: true }
        );
        // `b`'s commit is tried again (the store could not take it): its flush was at 1 s,
        // before the outage began and before the breaker opened.
        assert!(!b.on_commit(&s("b"), secs(1), None), "a stale flush does not close it");
        assert!(matches!(b.state(), BreakerState::Open { .. }));
        assert_eq!(
            b.on_failure(secs(31), &s("c"), down, outage(DataSide::Sink, secs(6))),
            BreakerVerdict::Release { tripped: false }
        );
        assert!(b.on_commit(&s("b"), secs(32), None), "a new flush does");
    }

    #[test]
    fn a_probe_failing_with_a_second_cause_reopens_it_for_twice_as_long() {
        let t0 = Timestamp::from_millis(1_000);
        let mut b = Breaker::new(3, Duration::from_secs(60));
        let sink = outage(DataSide::Sink, t0);
        assert_eq!(
            b.on_failure(t0, &s("a"), "sink: disk full", sink),
            BreakerVerdict::Release { tripped: true }
        );
        b.probe();
        let t1 = t0 + FIRST_PROBE_WAIT;
        let source = outage(DataSide::Source, t0);
        assert_eq!(
            b.on_failure(t1, &s("b"), "source: connection reset", source),
            BreakerVerdict::Release { tripped: true }
        );
        assert_eq!(b.probe_at(), Some(t1 + FIRST_PROBE_WAIT * 2), "a failed probe, whatever its cause");
    }

    #[test]
    fn the_latest_success_of_another_split_is_kept_whatever_the_order_of_the_reports() {
        let t = |ms| Timestamp::from_millis(ms);
        let mut l = Latest::default();
        assert!(!l.other_since(&s("a"), t(0)), "nothing yet");
        l.record(t(10), &s("a"));
        assert!(!l.other_since(&s("a"), t(0)), "a's own");
        assert!(l.other_since(&s("b"), t(10)));
        l.record(t(5), &s("b")); // reported late
        assert!(l.other_since(&s("a"), t(5)));
        assert!(!l.other_since(&s("a"), t(6)));
        l.record(t(20), &s("a"));
        assert!(l.other_since(&s("a"), t(5)), "b's stays the latest other than a");
        l.record(t(30), &s("b"));
        assert!(l.other_since(&s("b"), t(20)), "a's is now the latest other than b");
        assert!(!l.other_since(&s("b"), t(21)));
        assert!(l.other_since(&s("c"), t(30)));
    }

    #[test]
    fn an_outage_past_the_retry_budget_is_one_cause_whatever_the_step_and_the_time() {
        let a = "sink: storage full (writing to the sink kept failing for 0ns, past the transient retry budget of 0ns)";
        let b = "sink: storage full (flushing the sink kept failing for 5.3µs, past the transient retry budget of 0ns)";
        assert_eq!(failure_cause(a), failure_cause(b));
        assert_eq!(failure_cause(a), "storage full");
    }
}
