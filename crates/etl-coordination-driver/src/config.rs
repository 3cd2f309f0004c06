//! [`DriverConfig`]: the protocol's knobs ([`Tuning`]) plus what only the driver needs.

use std::time::Duration;

use etl_coordination_core::{Config, ConfigError, Incarnation, InstanceId, Tuning};

/// What a stalled job (quarantined splits, P13) means for the process.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum OnStall {
    /// [`DriverHandle::outcome`](crate::DriverHandle::outcome) returns
    /// [`DriverError::Stalled`](crate::DriverError::Stalled) (the default).
    #[default]
    Fatal,
    /// The outcome is [`JobOutcome::Stalled`](crate::JobOutcome::Stalled), logged as a warning.
    Warn,
}

/// Driver settings.
#[derive(Clone, Debug)]
pub struct DriverConfig {
    /// The job's name, used as the `coordination_job` metric label.
    pub job: String,
    /// Stable identity (e.g. the pod name with dots substituted); `None`: random.
    pub instance_id: Option<InstanceId>,
    /// The protocol's knobs (lease duration, capacity, attempts, re-plan interval, drain timeout).
    pub tuning: Tuning,
    /// Stalled jobs: fatal or warn.
    pub on_stall: OnStall,
    /// Timeout of one store request; a timed-out write is treated as in doubt.
    pub op_timeout: Duration,
}

impl Default for DriverConfig {
    fn default() -> Self {
        DriverConfig {
            job: "default".into(),
            instance_id: None,
            tuning: Tuning::default(),
            on_stall: OnStall::Fatal,
            op_timeout: Duration::from_secs(5),
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
        let cfg = Config { instance_id, incarnation, fingerprint, tuning: self.tuning.clone() };
        cfg.validate()?;
        if self.op_timeout.is_zero() {
            return Err(ConfigError { field: "op_timeout", value: "0s".into(), rule: "must be positive" });
        }
        Ok(cfg)
    }
}

/// The two key spaces of a job (NATS: two buckets).
#[derive(Clone, Debug)]
pub struct JobStores<S> {
    /// Durable records.
    pub state: S,
    /// TTL'd leases.
    pub lease: S,
}
