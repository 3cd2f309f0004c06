//! [`DriverConfig`]: the protocol's knobs ([`Tuning`]) plus what only the driver needs.

use std::time::Duration;

use etl_coordination_core::{Config, ConfigError, Incarnation, InstanceId, Tuning};

/// What a stalled job (quarantined splits, P13) means for the process.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum OnStall {
    /// [`DriverHandle::outcome`](crate::DriverHandle::outcome) returns
    /// [`DriverError::Stalled`](crate::DriverError::Stalled) (the default).
    #[default]
    Fatal,
    /// The outcome is [`JobOutcome::Stalled`](crate::JobOutcome::Stalled), logged as a warning.
    Warn,
}

/// What the driver does about a lane that holds its lease but commits no progress for
/// [`DriverConfig::lane_stall_timeout`] (a source stuck on a hung connection: heartbeats alone
/// would keep it owned forever).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum OnLaneStall {
    /// Report it (a warning, the `lanes_stalled` gauge, `lane_stalls_total`) and let it be
    /// (the default).
    #[default]
    Warn,
    /// Report it, stop the lane and end its tenancy as failed, so a peer (or this worker)
    /// retries the split from its committed progress. Like any failure, it consumes one
    /// attempt if the tenancy committed no progress (P12).
    Release,
}

/// Driver settings. New fields may be added in minor releases: start from
/// [`DriverConfig::default`] and set the fields you need.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct DriverConfig {
    /// Stable identity (e.g. the pod name with dots substituted); `None`: random.
    pub instance_id: Option<InstanceId>,
    /// The protocol's knobs (lease duration, capacity, attempts, re-plan interval, drain timeout).
    pub tuning: Tuning,
    /// Stalled jobs: fatal or warn.
    pub on_stall: OnStall,
    /// Timeout of one store request; a timed-out write is treated as in doubt. `None` (the
    /// default): the store's own budget ([`Store::op_timeout`](etl_coordination_store::Store::op_timeout),
    /// for NATS `NatsConfig::op_timeout`) when it is above [`DEFAULT_OP_TIMEOUT`], else that
    /// default (a store that bounds each of its round trips may need several for one request).
    pub op_timeout: Option<Duration>,
    /// After the job ends (complete, or stalled with [`OnStall::Warn`]), stay: keep the
    /// worker's presence and watches, report the end through
    /// [`DriverHandle::job_state`](crate::DriverHandle::job_state), and take up splits that
    /// come back (an operator's requeue). [`DriverHandle::outcome`](crate::DriverHandle::outcome)
    /// then resolves only when the worker is drained (with the job's end as the outcome) or
    /// stops on a fatal condition. Default: leave at the end.
    pub stay_after_end: bool,
    /// A lane holding its lease with no committed progress for this long is stalled (see
    /// [`OnLaneStall`]); `None` turns the check off. Measured from the lane's start or its last
    /// successful commit. Default: 10 minutes.
    pub lane_stall_timeout: Option<Duration>,
    /// What to do about a stalled lane.
    pub on_lane_stall: OnLaneStall,
    /// How long a lane waits out a transient failure of its source or sink (a full disk, a
    /// restarting warehouse, a throttled object store) in place, with backoff, before it ends
    /// the tenancy as failing (the breaker then says whether the split is charged one attempt:
    /// see [`DriverConfig::breaker_threshold`]). A success renews it. `Duration::ZERO`: no
    /// waiting (every transient failure fails the tenancy at once, and opens the breaker unless
    /// another lane got through at that very moment). Default: 5 minutes (below
    /// the lane stall timeout, so a lane waiting out an outage is not reported stalled).
    pub transient_retry_budget: Duration,
    /// What a bad record ([`SourceError::BadRecord`](crate::SourceError::BadRecord)) does to
    /// its split. Default: [`OnBadRecord::Quarantine`].
    pub on_bad_record: OnBadRecord,
    /// The breaker: this many distinct splits failing with the same cause within
    /// [`DriverConfig::breaker_window`] say the cause is the worker's (its sink is down), not
    /// the splits': their tenancies are released without charge, intake pauses, and after a
    /// backoff (10 s doubling to 5 min) the worker probes with one split. It also opens on one
    /// failure past the transient retry budget that no other lane of the worker got through
    /// since it began (none read from the source, or flushed to the sink, since): the worker
    /// cannot tell that split from the path. Failures the source calls unprocessable never
    /// count. 0 turns it off (every failure is charged). Default: 3.
    pub breaker_threshold: u32,
    /// See [`DriverConfig::breaker_threshold`]. Default: 1 minute.
    pub breaker_window: Duration,
}

/// What a bad record does to its split.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum OnBadRecord {
    /// The split ends as unprocessable (one attempt; quarantined at `max_attempts`, with the
    /// record's position in its last error). Nothing is skipped silently.
    #[default]
    Quarantine,
    /// The record goes to the dead-letter sink
    /// ([`Pipeline::dead_letters`](crate::Pipeline::dead_letters)) and reading goes on;
    /// `etl_coordination_records_skipped_total` counts it. A lane that meets more than
    /// `max_per_split` bad records gives the split up: it is quarantined at once, with its
    /// progress, for a person to look at the input.
    Skip {
        /// The most bad records one tenancy of a split skips.
        max_per_split: u32,
    },
}

/// Default of [`DriverConfig::breaker_threshold`].
pub const DEFAULT_BREAKER_THRESHOLD: u32 = 3;

/// Default of [`DriverConfig::breaker_window`].
pub const DEFAULT_BREAKER_WINDOW: Duration = Duration::from_secs(60);

/// The default cap of [`OnBadRecord::Skip`].
pub const DEFAULT_MAX_BAD_RECORDS_PER_SPLIT: u32 = 100;

/// The request timeout for a store that has no budget of its own (see
/// [`DriverConfig::op_timeout`]).
pub const DEFAULT_OP_TIMEOUT: Duration = Duration::from_secs(5);

/// Default of [`DriverConfig::lane_stall_timeout`].
pub const DEFAULT_LANE_STALL_TIMEOUT: Duration = Duration::from_secs(600);

/// Default of [`DriverConfig::transient_retry_budget`].
pub const DEFAULT_TRANSIENT_RETRY_BUDGET: Duration = Duration::from_secs(300);

impl Default for DriverConfig {
    fn default() -> Self {
        DriverConfig {
            instance_id: None,
            tuning: Tuning::default(),
            on_stall: OnStall::Fatal,
            op_timeout: None,
            stay_after_end: false,
            lane_stall_timeout: Some(DEFAULT_LANE_STALL_TIMEOUT),
            on_lane_stall: OnLaneStall::Warn,
            transient_retry_budget: DEFAULT_TRANSIENT_RETRY_BUDGET,
            on_bad_record: OnBadRecord::Quarantine,
            breaker_threshold: DEFAULT_BREAKER_THRESHOLD,
            breaker_window: DEFAULT_BREAKER_WINDOW,
        }
    }
}

impl DriverConfig {
    /// The core's configuration for this worker; the error names the offending field.
    pub(crate) fn core(
        &self,
        instance_id: InstanceId,
        incarnation: Incarnation,
        fingerprint: String,
    ) -> Result<Config, ConfigError> {
        let mut cfg = Config::new(instance_id, incarnation, fingerprint);
        cfg.tuning = self.tuning.clone();
        cfg.stay_after_end = self.stay_after_end;
        cfg.validate()?;
        self.validate()?;
        Ok(cfg)
    }

    /// Checks the driver's own settings (the core's, [`Tuning`], are checked by
    /// [`Tuning::validate`]); the error names the first offending field.
    pub fn validate(&self) -> Result<(), ConfigError> {
        self.tuning.validate()?;
        if self.op_timeout.is_some_and(|t| t.is_zero()) {
            return Err(ConfigError { field: "op_timeout", value: "0s".into(), rule: "must be positive" });
        }
        if self.breaker_threshold == 1 {
            return Err(ConfigError {
                field: "breaker_threshold",
                value: "1".into(),
                rule: "must be 0 (off) or at least 2: one split failing while others work is that split's failure, and with 1 no split would ever be charged",
            });
        }
        if self.breaker_threshold > 0 && self.breaker_window.is_zero() {
            return Err(ConfigError {
                field: "breaker_window",
                value: "0s".into(),
                rule: "must be positive (set breaker_threshold to 0 to turn the breaker off)",
            });
        }
        if let Some(t) = self.lane_stall_timeout
            && t < Duration::from_secs(1)
        {
            return Err(ConfigError {
                field: "lane_stall_timeout",
                value: format!("{t:?}"),
                rule: "must be at least 1s, and above the longest a healthy lane goes without committing (None turns the check off)",
            });
        }
        Ok(())
    }
}
