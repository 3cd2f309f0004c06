//! `etl-coord worker`: one replica of a coordinated pipeline (multi-process and Kubernetes use).

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use anyhow::Context;
use etl_coord::sink::{DeadLetterFile, JsonlSink};
use etl_coord::sources::{AnySource, DEFAULT_SPLIT_BYTES, DEFAULT_SPLIT_ROWS, Faults, Faulty};
use etl_coordination_driver::{
    DriverConfig, DriverError, DriverHandle, InstanceId, JobOutcome, OnBadRecord, OnLaneStall, OnStall,
    Pipeline, Tuning,
};

use super::admin::admin_server;
use super::signals::ShutdownSignals;
use super::{StoreArgs, Usage, open_stores, parse_duration, parse_instance, tuning_error};

#[derive(clap::Args, Debug)]
pub(crate) struct WorkerArgs {
    #[command(flatten)]
    pub(crate) store: StoreArgs,
    /// `files:DIR` or `sqlite:PATH:TABLE`.
    #[arg(long, env = "ETL_COORD_SOURCE")]
    pub(crate) source: String,
    /// Keep the plan open: the leader re-plans every --replan-interval and new input becomes
    /// new splits (files: every object is a split, new objects are picked up; sqlite: rows past
    /// the last planned id). The job never completes; SIGTERM ends a worker (a drain).
    #[arg(long, env = "ETL_COORD_FOLLOW")]
    pub(crate) follow: bool,
    /// JSON Lines output, one line per emitted record.
    #[arg(long, env = "ETL_COORD_SINK")]
    pub(crate) sink: Option<PathBuf>,
    /// Stable instance id (default: env POD_NAME with dots replaced, else random).
    #[arg(long, env = "ETL_COORD_INSTANCE_ID", value_parser = parse_instance)]
    pub(crate) instance_id: Option<String>,
    /// Lease duration (whole seconds).
    #[arg(long, default_value = "30s", value_parser = parse_duration, env = "ETL_COORD_LEASE_DURATION")]
    pub(crate) lease_duration: Duration,
    /// Splits held (and lanes run) at once.
    #[arg(long, default_value_t = 8, env = "ETL_COORD_MAX_IN_FLIGHT")]
    pub(crate) max_in_flight: u32,
    /// Failing tenancies before a split is quarantined.
    #[arg(long, default_value_t = 4, env = "ETL_COORD_MAX_ATTEMPTS")]
    pub(crate) max_attempts: u32,
    /// How long a split whose tenancy failed waits before it is claimed again; it doubles
    /// with each failure (at most 10m), so max-attempts failures span minutes. 0s: at once.
    #[arg(long, default_value = "15s", value_parser = parse_duration, env = "ETL_COORD_CLAIM_BACKOFF")]
    pub(crate) claim_backoff: Duration,
    /// How often the leader re-runs an open plan.
    #[arg(long, default_value = "60s", value_parser = parse_duration, env = "ETL_COORD_REPLAN_INTERVAL")]
    pub(crate) replan_interval: Duration,
    /// How long lanes get to commit on SIGTERM before their splits are released.
    #[arg(long, default_value = "30s", value_parser = parse_duration, env = "ETL_COORD_DRAIN_TIMEOUT")]
    pub(crate) drain_timeout: Duration,
    /// How long the leader waits for the planner (listing the input) before counting the call
    /// as failed and retrying it after a backoff.
    #[arg(long, default_value = "10m", value_parser = parse_duration, env = "ETL_COORD_PLAN_TIMEOUT")]
    pub(crate) plan_timeout: Duration,
    /// What a stalled job (quarantined splits) means: fatal (exit 3) or warn (exit 0).
    #[arg(long, default_value = "fatal", value_parser = ["fatal", "warn"], env = "ETL_COORD_ON_STALL")]
    pub(crate) on_stall: String,
    /// After the job ends (complete, or stalled with on-stall warn): exit 0, or `wait`: stay
    /// until SIGTERM, serving the admin endpoints and taking up splits that `requeue` puts
    /// back (for a Kubernetes Deployment, which restarts exited pods).
    #[arg(long, default_value = "exit", value_parser = ["exit", "wait"], env = "ETL_COORD_ON_COMPLETE")]
    pub(crate) on_complete: String,
    /// A lane that holds its lease but commits no progress for this long is stalled (a source
    /// stuck on a hung connection): a warning, the etl_coordination_lanes_stalled gauge, and
    /// with --on-lane-stall release the split is handed on. 0s turns the check off.
    #[arg(long, default_value = "10m", value_parser = parse_duration, env = "ETL_COORD_LANE_STALL_TIMEOUT")]
    pub(crate) lane_stall_timeout: Duration,
    /// What a stalled lane gets: `warn` (report it only) or `release` (stop the lane and end
    /// its tenancy as failed, so a peer retries the split from its committed progress; one
    /// attempt is consumed if the tenancy committed nothing).
    #[arg(long, default_value = "warn", value_parser = ["warn", "release"], env = "ETL_COORD_ON_LANE_STALL")]
    pub(crate) on_lane_stall: String,
    /// How long a lane waits out an outage of its source or sink (a full disk, a throttled or
    /// restarting service: errors that say so) in place, with backoff, before it counts as a
    /// failure of the split (one attempt). 0s: no waiting.
    #[arg(long, default_value = "5m", value_parser = parse_duration, env = "ETL_COORD_TRANSIENT_RETRY_BUDGET")]
    pub(crate) transient_retry_budget: Duration,
    /// What a bad record (a line that is not UTF-8) does: `quarantine` its split (one attempt
    /// per tenancy that meets it), or `skip` it into the --dead-letter file and go on.
    #[arg(long, default_value = "quarantine", value_parser = ["quarantine", "skip"], env = "ETL_COORD_ON_BAD_RECORD")]
    pub(crate) on_bad_record: String,
    /// With --on-bad-record skip: the JSON Lines file that keeps each skipped record (split,
    /// position, error, its bytes), made durable before the progress past it is committed.
    #[arg(long, env = "ETL_COORD_DEAD_LETTER")]
    pub(crate) dead_letter: Option<PathBuf>,
    /// With --on-bad-record skip: a lane that meets more bad records than this in one split
    /// gives the split up (quarantined at once, with its progress) for a person to look at.
    #[arg(long, default_value_t = etl_coordination_driver::DEFAULT_MAX_BAD_RECORDS_PER_SPLIT, env = "ETL_COORD_MAX_BAD_RECORDS")]
    pub(crate) max_bad_records: u32,
    /// The breaker: this many distinct splits failing with the same cause within
    /// --breaker-window mean the sink (or the worker) is at fault: their failures are not
    /// charged, intake pauses, and one split is tried again after 10s (doubling to 5m) until a
    /// lane commits. 0 turns it off.
    #[arg(long, default_value_t = etl_coordination_driver::DEFAULT_BREAKER_THRESHOLD, env = "ETL_COORD_BREAKER_THRESHOLD")]
    pub(crate) breaker_threshold: u32,
    /// See --breaker-threshold.
    #[arg(long, default_value = "60s", value_parser = parse_duration, env = "ETL_COORD_BREAKER_WINDOW")]
    pub(crate) breaker_window: Duration,
    /// Files source: target bytes per split.
    #[arg(long, default_value_t = DEFAULT_SPLIT_BYTES, env = "ETL_COORD_SPLIT_SIZE")]
    pub(crate) split_size: u64,
    /// SQLite source: rows per split.
    #[arg(long, default_value_t = DEFAULT_SPLIT_ROWS, env = "ETL_COORD_SPLIT_ROWS")]
    pub(crate) split_rows: u64,
    /// The exit code of a worker that drained (SIGTERM) before the job ended. 0 suits a
    /// Deployment; a Kubernetes Job needs non-zero (e.g. 143), or one drained pod would make
    /// the Job stop replacing pods and end complete with splits left.
    #[arg(long, default_value_t = 0, env = "ETL_COORD_EXIT_CODE_WHEN_DRAINED")]
    pub(crate) exit_code_when_drained: u8,
    /// Serve /metrics, /healthz and /readyz on this address.
    #[arg(long, env = "ETL_COORD_ADMIN_ADDR")]
    pub(crate) admin_addr: Option<SocketAddr>,
    /// Test fault: sleep per record, in milliseconds.
    #[arg(long, hide = true, default_value_t = 0)]
    pub(crate) record_delay_ms: u64,
    /// Test fault: reaching an input line containing this text aborts the process.
    #[arg(long, hide = true)]
    pub(crate) poison_marker: Option<String>,
    /// Test fault: reaching an input line containing this text reports the split unprocessable.
    #[arg(long, hide = true)]
    pub(crate) unprocessable_marker: Option<String>,
    /// Test fault: reaching an input line containing this text hangs the lane's reader, like a
    /// read on a connection that never answers (only a stop signal ends it).
    #[arg(long, hide = true)]
    pub(crate) hang_marker: Option<String>,
}

/// The worker's knobs as the driver will check them, so a bad value is a usage error (exit 2,
/// naming the flag) before anything connects.
fn tuning(a: &WorkerArgs) -> Tuning {
    let mut t = Tuning::default();
    t.lease_duration = a.lease_duration;
    t.max_in_flight = a.max_in_flight;
    t.max_attempts = a.max_attempts;
    t.replan_interval = a.replan_interval;
    t.drain_timeout = a.drain_timeout;
    t.plan_timeout = a.plan_timeout;
    t.claim_backoff = a.claim_backoff;
    t
}

impl WorkerArgs {
    /// Checks what one flag's parser cannot: values against each other, the input and the
    /// local files, the environment's fallbacks.
    pub(crate) fn validate(&self) -> Result<(), Usage> {
        let a = self;
        super::positive("--nats-op-timeout", a.store.nats_op_timeout)?;
        tuning(a).validate().map_err(tuning_error)?;
        if let Ok(config) = driver_config(a) {
            config.validate().map_err(tuning_error)?;
        }
        if !a.lane_stall_timeout.is_zero() && a.lane_stall_timeout < Duration::from_secs(1) {
            return Err(Usage::new(
                "--lane-stall-timeout",
                format!("{:?}: must be 0s (off) or at least 1s", a.lane_stall_timeout),
            ));
        }
        // What the input and the local files can tell is told now, not after connecting.
        if let Err(e) = AnySource::open(&a.source, a.split_size, a.split_rows, a.follow) {
            let msg = format!("{e:#}");
            return Err(match msg.strip_prefix("--").and_then(|m| m.split_once(' ')) {
                Some((flag, rest)) => Usage::new(format!("--{flag}"), rest),
                None => Usage::new("--source", format!("{}: {msg}", a.source)),
            });
        }
        for (flag, file) in [("--sink", &a.sink), ("--dead-letter", &a.dead_letter)] {
            if let Some(file) = file {
                output_file(flag, file)?;
            }
        }
        match (a.on_bad_record.as_str(), &a.dead_letter) {
            ("skip", None) => {
                return Err(Usage::new(
                    "--on-bad-record",
                    "skip needs --dead-letter FILE, where the skipped records are kept",
                ));
            }
            ("quarantine", Some(_)) => {
                return Err(Usage::new(
                    "--dead-letter",
                    "is only written with --on-bad-record skip (the default, quarantine, skips nothing)",
                ));
            }
            _ => {}
        }
        if a.sink.is_some() && a.sink == a.dead_letter {
            return Err(Usage::new("--dead-letter", "must be another file than --sink"));
        }
        if let Err(e) = default_instance_id(a.instance_id.clone()) {
            return Err(Usage::new(
                "--instance-id",
                format!("{e:#} (set --instance-id, or a POD_NAME that is a valid id)"),
            ));
        }
        a.store.validate()
    }
}

/// An output file whose directory exists and that is not a directory.
fn output_file(flag: &str, file: &std::path::Path) -> Result<(), Usage> {
    let dir = file.parent().filter(|d| !d.as_os_str().is_empty()).unwrap_or(std::path::Path::new("."));
    if !dir.is_dir() {
        return Err(Usage::new(
            flag,
            format!("{}: the directory {} does not exist", file.display(), dir.display()),
        ));
    }
    if file.is_dir() {
        return Err(Usage::new(flag, format!("{} is a directory; give a file", file.display())));
    }
    Ok(())
}

fn default_instance_id(flag: Option<String>) -> anyhow::Result<Option<InstanceId>> {
    if let Some(id) = flag {
        return Ok(Some(InstanceId::new(id)?));
    }
    match std::env::var("POD_NAME") {
        Ok(pod) if !pod.is_empty() => Ok(Some(InstanceId::new(pod.replace('.', "-")).context("POD_NAME")?)),
        _ => Ok(None),
    }
}

pub(crate) async fn run(a: WorkerArgs) -> anyhow::Result<ExitCode> {
    let stores = open_stores(&a.store).await?;
    let source = AnySource::open(&a.source, a.split_size, a.split_rows, a.follow)?;
    let faults = Faults {
        record_delay: Duration::from_millis(a.record_delay_ms),
        poison_marker: a.poison_marker.clone(),
        unprocessable_marker: a.unprocessable_marker.clone(),
        hang_marker: a.hang_marker.clone(),
    };
    let sink = match &a.sink {
        Some(p) => JsonlSink::open(p).with_context(|| format!("opening the sink {}", p.display()))?,
        None => JsonlSink::discard(),
    };
    let config = driver_config(&a)?;
    let metrics = etl_coordination_metrics::install_prometheus()?;
    let mut pipeline = Pipeline::new(stores, Faulty { source, faults }, sink).config(config);
    if let Some(p) = &a.dead_letter {
        let file =
            JsonlSink::open(p).with_context(|| format!("opening the dead-letter file {}", p.display()))?;
        pipeline = pipeline.dead_letters(DeadLetterFile(file));
    }
    let handle = pipeline.start()?;
    let ready = Arc::new(AtomicBool::new(true));
    if let Some(addr) = a.admin_addr {
        let listener = tokio::net::TcpListener::bind(addr)
            .await
            .with_context(|| format!("binding the admin server to {addr}"))?;
        tokio::spawn(admin_server(listener, metrics, ready.clone()));
    }
    drain_on_signals(handle.clone(), ready)?;
    exit_code(handle.outcome().await, a.exit_code_when_drained)
}

/// The driver's configuration from the flags.
fn driver_config(a: &WorkerArgs) -> anyhow::Result<DriverConfig> {
    let mut config = DriverConfig::default();
    config.instance_id = default_instance_id(a.instance_id.clone())?;
    config.tuning = tuning(a);
    config.on_stall = if a.on_stall == "warn" { OnStall::Warn } else { OnStall::Fatal };
    config.stay_after_end = a.on_complete == "wait";
    config.lane_stall_timeout = Some(a.lane_stall_timeout).filter(|t| !t.is_zero());
    config.on_lane_stall =
        if a.on_lane_stall == "release" { OnLaneStall::Release } else { OnLaneStall::Warn };
    config.transient_retry_budget = a.transient_retry_budget;
    config.breaker_threshold = a.breaker_threshold;
    config.breaker_window = a.breaker_window;
    if a.on_bad_record == "skip" {
        config.on_bad_record = OnBadRecord::Skip { max_per_split: a.max_bad_records };
    }
    Ok(config)
}

/// The first termination signal drains the worker (and makes `/readyz` say so); the second
/// exits at once with 130.
fn drain_on_signals(handle: DriverHandle, ready: Arc<AtomicBool>) -> anyhow::Result<()> {
    // The listeners are installed once, before the first signal, so a second signal that comes
    // while the first is handled is not lost.
    let mut signals = ShutdownSignals::new()?;
    tokio::spawn(async move {
        signals.recv().await;
        ready.store(false, Ordering::Relaxed);
        tracing::info!("termination signal: draining (a second one exits at once)");
        handle.drain();
        signals.recv().await;
        tracing::warn!(
            "second termination signal: exiting without finishing the drain (leases left behind expire \
             after --lease-duration; peers take the splits over then)"
        );
        std::process::exit(130);
    });
    Ok(())
}

/// The process's exit code for the job's outcome.
fn exit_code(outcome: Result<JobOutcome, DriverError>, when_drained: u8) -> anyhow::Result<ExitCode> {
    match outcome {
        Ok(JobOutcome::Complete) => {
            tracing::info!("job complete");
            Ok(ExitCode::SUCCESS)
        }
        Ok(JobOutcome::Drained) => Ok(ExitCode::from(when_drained)),
        Ok(JobOutcome::Stalled { quarantined }) => {
            tracing::warn!("job stalled (on-stall warn): {} quarantined split(s)", quarantined.len());
            Ok(ExitCode::SUCCESS)
        }
        Err(e @ DriverError::Stalled { .. }) => {
            tracing::error!("{e}");
            Ok(ExitCode::from(3))
        }
        // An outcome this release does not know (the driver is newer): not a success to claim.
        Ok(other) => {
            Err(anyhow::anyhow!("the job ended with an outcome this command does not know: {other:?}"))
        }
        Err(e) => Err(e.into()),
    }
}
