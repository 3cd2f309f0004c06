//! Worker configuration (docs/SCALING.md, tuning). Invalid values are rejected at construction with an
//! error that names the field and the rule.

use std::time::Duration;

use crate::ids::{Incarnation, InstanceId};

/// A configuration value was rejected.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid configuration: {field} = {value}: {rule}")]
pub struct ConfigError {
    /// The offending field.
    pub field: &'static str,
    /// Its value, rendered.
    pub value: String,
    /// The rule it broke.
    pub rule: &'static str,
}

/// Identity and tuning of one worker. New fields may be added in minor releases: start from
/// [`Config::new`] and set the fields you need.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct Config {
    /// This replica's stable id (default: random, chosen by the embedding layer).
    pub instance_id: InstanceId,
    /// This process lifetime (random at process start, chosen by the embedding layer).
    pub incarnation: Incarnation,
    /// The planner's fingerprint, compared with `meta` at startup (P2).
    pub fingerprint: String,
    /// The knobs.
    pub tuning: Tuning,
    /// After the job ends (P13: complete, or stalled), stay instead of leaving: keep the
    /// presence, the watches and any leadership, report the end as
    /// [`Event::JobEnded`](crate::Event::JobEnded), and take up splits that come back (an
    /// operator's requeue) as usual. The worker leaves only when drained. Default: leave
    /// ([`Action::Finished`](crate::Action::Finished) with the outcome).
    pub stay_after_end: bool,
}

/// The knobs of the product documents' tuning table (docs/SCALING.md, tuning). Embedding layers (the
/// driver, the command) take this struct as it is rather than copying its fields. New knobs may
/// be added in minor releases: start from [`Tuning::default`] and set the fields you need.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct Tuning {
    /// Lease TTL: takeover latency after an ungraceful death. Heartbeats run at a third of it.
    /// Lower means faster failover, more store traffic, more sensitivity to pauses. Whole
    /// seconds, at least 1 s.
    pub lease_duration: Duration,
    /// The working set: splits held (and lanes run) at once. Size it like a thread pool.
    pub max_in_flight: u32,
    /// Consecutive failing tenancies before a split is quarantined (P12). A setting of the
    /// job: the first worker records it in `meta`; every later worker uses the job's value
    /// (reporting [`crate::Event::JobMaxAttempts`] when its own differs).
    pub max_attempts: u32,
    /// How often the leader re-runs an open plan (growing inputs); final plans stop re-planning.
    pub replan_interval: Duration,
    /// How long lanes get to commit when draining before their splits are released anyway.
    pub drain_timeout: Duration,
    /// How long the owner of a split a peer asks for (a cooperative steal, P9) has to stop
    /// its lane, commit and release the split before the thief takes it over anyway (then the
    /// owner's uncommitted tail is read twice, as in a takeover). Zero: steals take over at
    /// once, without asking. Capped at a third of the lease, since a request lives one lease.
    pub handover_timeout: Duration,
    /// How long the leader waits for the planner before giving up on that call (an error is
    /// recorded and the planner is called again after a backoff). A planner that hangs must not
    /// wedge the job.
    pub plan_timeout: Duration,
    /// How long a split whose tenancies failed waits before it is claimed again (P12): the
    /// backoff after `n` charged failures is `claim_backoff * 2^(n-1)`, at most
    /// [`defaults::CLAIM_BACKOFF_CAP`], so `max_attempts` failures span minutes, not
    /// milliseconds. Each worker measures it from when it sees the failure (no clock is
    /// compared between workers). Zero re-offers a failed split at once. Liveness only: the
    /// fencing of claims does not depend on it.
    pub claim_backoff: Duration,
    /// The most splits one manifest chunk lists (one store value each). The default
    /// ([`records::MANIFEST_CHUNK_LEN`](crate::records::MANIFEST_CHUNK_LEN), also the most)
    /// keeps each chunk far below the store's value limit; smaller chunks suit a store
    /// configured with a smaller limit (and let tests load manifests of several chunks from
    /// small plans).
    /// Only the leader's matters: readers follow the chunk count the plan head names.
    pub manifest_chunk_len: usize,
}

/// The largest `max_attempts` accepted (by the configuration and by `etl-coord job
/// set-max-attempts`).
pub const MAX_ATTEMPTS_LIMIT: u32 = 1000;

/// Defaults from the product document.
pub mod defaults {
    use std::time::Duration;
    /// 30 s.
    pub const LEASE_DURATION: Duration = Duration::from_secs(30);
    /// 8.
    pub const MAX_IN_FLIGHT: u32 = 8;
    /// 4.
    pub const MAX_ATTEMPTS: u32 = 4;
    /// 60 s.
    pub const REPLAN_INTERVAL: Duration = Duration::from_secs(60);
    /// 30 s.
    pub const DRAIN_TIMEOUT: Duration = Duration::from_secs(30);
    /// 10 s: a steal asks first (0 takes over at once); at most a third of the lease takes
    /// effect.
    pub const HANDOVER_TIMEOUT: Duration = Duration::from_secs(10);
    /// 10 min.
    pub const PLAN_TIMEOUT: Duration = Duration::from_secs(600);
    /// 15 s (then 30 s, 60 s, ...: three failures of a split with 4 attempts span 105 s).
    pub const CLAIM_BACKOFF: Duration = Duration::from_secs(15);
    /// 10 min: the longest a failed split waits, whatever its attempts.
    pub const CLAIM_BACKOFF_CAP: Duration = Duration::from_secs(600);
}

impl Default for Tuning {
    fn default() -> Self {
        Tuning {
            lease_duration: defaults::LEASE_DURATION,
            max_in_flight: defaults::MAX_IN_FLIGHT,
            max_attempts: defaults::MAX_ATTEMPTS,
            replan_interval: defaults::REPLAN_INTERVAL,
            drain_timeout: defaults::DRAIN_TIMEOUT,
            handover_timeout: defaults::HANDOVER_TIMEOUT,
            plan_timeout: defaults::PLAN_TIMEOUT,
            claim_backoff: defaults::CLAIM_BACKOFF,
            manifest_chunk_len: crate::records::MANIFEST_CHUNK_LEN,
        }
    }
}

impl Tuning {
    /// Checks every knob; the error names the first offending one.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let err = |field, value: String, rule| Err(ConfigError { field, value, rule });
        let lease = self.lease_duration;
        if lease < Duration::from_secs(1) || lease.subsec_nanos() != 0 {
            return err(
                "lease_duration",
                format!("{lease:?}"),
                "must be a whole number of seconds, at least 1s (store TTLs are whole seconds)",
            );
        }
        if lease > Duration::from_secs(3600) {
            return err("lease_duration", format!("{lease:?}"), "must be at most 1h");
        }
        if self.max_in_flight == 0 || self.max_in_flight > 10_000 {
            return err("max_in_flight", self.max_in_flight.to_string(), "must be between 1 and 10000");
        }
        if self.max_attempts == 0 || self.max_attempts > MAX_ATTEMPTS_LIMIT {
            return err("max_attempts", self.max_attempts.to_string(), "must be between 1 and 1000");
        }
        if self.replan_interval < Duration::from_secs(1) {
            return err("replan_interval", format!("{:?}", self.replan_interval), "must be at least 1s");
        }
        if self.drain_timeout > Duration::from_secs(24 * 3600) {
            return err("drain_timeout", format!("{:?}", self.drain_timeout), "must be at most 24h");
        }
        if self.handover_timeout > Duration::from_secs(3600) {
            return err("handover_timeout", format!("{:?}", self.handover_timeout), "must be at most 1h");
        }
        if self.plan_timeout < Duration::from_secs(1) || self.plan_timeout > Duration::from_secs(24 * 3600) {
            return err("plan_timeout", format!("{:?}", self.plan_timeout), "must be between 1s and 24h");
        }
        if self.claim_backoff > defaults::CLAIM_BACKOFF_CAP {
            return err("claim_backoff", format!("{:?}", self.claim_backoff), "must be at most 10m");
        }
        if self.manifest_chunk_len == 0 || self.manifest_chunk_len > crate::records::MANIFEST_CHUNK_LEN {
            return err(
                "manifest_chunk_len",
                self.manifest_chunk_len.to_string(),
                "must be between 1 and 1024",
            );
        }
        Ok(())
    }

    /// P12: how long a split with `attempts` charged failures waits before it is claimed again
    /// (zero for a split that has not failed).
    pub fn claim_backoff_after(&self, attempts: u32) -> Duration {
        if attempts == 0 {
            return Duration::ZERO;
        }
        let doubled = self.claim_backoff.saturating_mul(1u32 << (attempts - 1).min(20));
        doubled.min(defaults::CLAIM_BACKOFF_CAP)
    }

    /// How long the owner of a split asked for gets to release it (P9): `handover_timeout`, at
    /// most a third of the lease. The thief takes the split over a heartbeat after it, still a
    /// heartbeat before its request's TTL runs out (an expiry is never taken for an answer).
    /// `None`: steals take over at once.
    pub fn handover_wait(&self) -> Option<Duration> {
        let cap = self.lease_duration - self.heartbeat_interval() * 2;
        (!self.handover_timeout.is_zero()).then(|| self.handover_timeout.min(cap))
    }

    /// Heartbeat interval: a third of the lease (P7).
    pub fn heartbeat_interval(&self) -> Duration {
        self.lease_duration / 3
    }

    /// How long after the send time of its last acknowledged renewal a lease is trusted (P11).
    /// A small margin keeps the worker's judgement ahead of the store's expiry even if the two
    /// clocks run at slightly different rates.
    pub fn lease_trust(&self) -> Duration {
        self.lease_duration - self.lease_duration / 20
    }

    /// Interval of the resync that guards against missed watch events (P7: every watch reopened,
    /// its snapshot read again) for a plan of under 10,000 splits; a larger plan adds a lease per
    /// 10,000 splits. Deliberately rare: steady-state traffic must be renewals and commits only
    /// (T5).
    pub fn resync_interval(&self) -> Duration {
        self.lease_duration * 10
    }

    /// The resync interval for a plan of `splits`: [`Self::resync_interval`] and one lease more
    /// per 10,000 splits, so that a resync (every split's record sent again to every worker)
    /// stays a bounded share of a large plan's traffic (issue 32: at a million splits every ten
    /// leases, a worker would spend most of its time reading the plan again).
    pub fn resync_interval_for(&self, splits: usize) -> Duration {
        let extra = u32::try_from(splits / 10_000).unwrap_or(u32::MAX);
        self.resync_interval().saturating_add(self.lease_duration.saturating_mul(extra))
    }
}

impl Config {
    /// A configuration with the documented defaults.
    pub fn new(instance_id: InstanceId, incarnation: Incarnation, fingerprint: impl Into<String>) -> Self {
        Config {
            instance_id,
            incarnation,
            fingerprint: fingerprint.into(),
            tuning: Tuning::default(),
            stay_after_end: false,
        }
    }

    /// Checks every field; the error names the first offending one.
    pub fn validate(&self) -> Result<(), ConfigError> {
        self.tuning.validate()?;
        if self.fingerprint.is_empty() || self.fingerprint.len() > 1024 {
            return Err(ConfigError {
                field: "fingerprint",
                value: format!("{:?}", self.fingerprint),
                rule: "must be 1 to 1024 bytes",
            });
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg() -> Config {
        Config::new(InstanceId::new("w").unwrap(), Incarnation(1), "fp")
    }

    #[test]
    fn defaults_are_valid_and_match_the_seed() {
        let c = cfg();
        c.validate().unwrap();
        assert_eq!(c.tuning.lease_duration, Duration::from_secs(30));
        assert_eq!((c.tuning.max_in_flight, c.tuning.max_attempts), (8, 4));
        assert_eq!(c.tuning.replan_interval, Duration::from_secs(60));
        assert_eq!(c.tuning.heartbeat_interval(), Duration::from_secs(10));
    }

    #[test]
    fn the_resync_interval_grows_by_a_lease_per_ten_thousand_splits() {
        let c = cfg();
        let lease = c.tuning.lease_duration;
        assert_eq!(c.tuning.resync_interval_for(0), lease * 10);
        assert_eq!(c.tuning.resync_interval_for(9_999), lease * 10);
        assert_eq!(c.tuning.resync_interval_for(100_000), lease * 20);
        assert_eq!(c.tuning.resync_interval_for(1_000_000), lease * 110);
        assert!(c.tuning.resync_interval_for(usize::MAX) > lease * 110, "no overflow");
    }

    #[test]
    fn steals_ask_first_by_default_within_a_third_of_the_lease() {
        // Cooperative steals are the default (issue 29): 10 s, all of it on the default 30 s
        // lease; on a 3 s lease the owner gets a third of it (1 s), and 0 turns asking off.
        let mut c = cfg();
        assert_eq!(c.tuning.handover_timeout, Duration::from_secs(10));
        assert_eq!(c.tuning.handover_wait(), Some(Duration::from_secs(10)));
        c.tuning.lease_duration = Duration::from_secs(3);
        assert_eq!(c.tuning.handover_wait(), Some(Duration::from_secs(1)));
        c.tuning.handover_timeout = Duration::ZERO;
        assert_eq!(c.tuning.handover_wait(), None);
    }

    #[test]
    fn sub_second_leases_are_rejected_naming_the_field() {
        let mut c = cfg();
        c.tuning.lease_duration = Duration::from_millis(1500);
        let e = c.validate().unwrap_err();
        assert_eq!(e.field, "lease_duration");
        assert!(e.to_string().contains("whole number of seconds"), "{e}");
    }

    #[test]
    fn zero_capacity_and_attempts_are_rejected() {
        let mut c = cfg();
        c.tuning.max_in_flight = 0;
        assert_eq!(c.validate().unwrap_err().field, "max_in_flight");
        let mut c = cfg();
        c.tuning.max_attempts = 0;
        assert_eq!(c.validate().unwrap_err().field, "max_attempts");
    }
}
