//! The flags of a coordinated worker, with their `ETL_COORD_*` environment variables: the
//! store ([`StoreFlags`], shared with the operator's commands), the worker's knobs
//! ([`WorkerFlags`]) and the logs ([`LogFlags`]); and their value parsers.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use etl_coordination_driver::{
    AnyStore, DriverConfig, InstanceId, JobName, JobStores, OnBadRecord, OnLaneStall, OnStall, SplitId,
    Tuning,
};

use crate::RunError;

/// What `--help` ends with: exit codes and the environment.
pub(crate) const AFTER_HELP: &str = "\
Exit codes: 0 job complete (or drained, or stalled with --on-stall warn), 3 job stalled on
quarantined splits, 1 a fatal error (the message says what to do), 2 a usage error (a flag or
value is wrong; nothing was started), 130 a second termination signal cut a drain short;
--exit-code-when-drained sets the code of a drained worker (0 by default).

Environment: every flag can also be given as ETL_COORD_<FLAG> (upper case, dashes as
underscores: --lease-duration is ETL_COORD_LEASE_DURATION; booleans take true or false); a flag
on the command line wins. The NATS CLI's variables are honoured when the ETL_COORD_ one is
unset: NATS_URL (--store), NATS_USER, NATS_PASSWORD, NATS_CREDS, NATS_TOKEN, NATS_CA
(--nats-tls-ca). POD_NAME gives the instance id when --instance-id is not set. RUST_LOG, if
set, overrides -v/-q.";

/// A usage error (exit 2): the flag and what is wrong with its value.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{flag} {msg}")]
pub struct Usage {
    /// The flag (`--lease-duration`).
    pub flag: String,
    /// What is wrong with its value.
    pub msg: String,
}

impl Usage {
    /// A usage error of `flag`.
    pub fn new(flag: impl Into<String>, msg: impl Into<String>) -> Usage {
        Usage { flag: flag.into(), msg: msg.into() }
    }
}

/// A duration flag that must not be zero.
pub fn positive(flag: &str, d: Duration) -> Result<(), Usage> {
    if d.is_zero() {
        return Err(Usage::new(flag, "must be more than 0s"));
    }
    Ok(())
}

/// A knob the core refused, as a usage error naming its flag.
pub fn tuning_error(e: etl_coordination_core::ConfigError) -> Usage {
    Usage::new(format!("--{}", e.field.replace('_', "-")), format!("{}: {}", e.value, e.rule))
}

/// Where a job's coordination lives: its name and its store (NATS, or `memory` for a single
/// standalone instance), with the NATS connection's credentials and TLS.
#[derive(clap::Args, Clone, Debug)]
#[non_exhaustive]
pub struct StoreFlags {
    /// Job name: [A-Za-z0-9_-]; suffixes the store's bucket names.
    #[arg(long, env = "ETL_COORD_JOB", value_parser = parse_job)]
    pub job: String,
    /// The store and how to connect to it.
    #[command(flatten)]
    pub connection: ConnectFlags,
}

/// A store (NATS, or `memory`) and the NATS connection's credentials and TLS: the store flags
/// without a job (`etl-coord jobs` lists the jobs a store holds).
#[derive(clap::Args, Clone, Debug)]
#[non_exhaustive]
pub struct ConnectFlags {
    /// Required: `nats://HOST:PORT` (comma-separate several; `tls://` requires TLS), or `memory`
    /// for a single standalone instance (nothing is shared). Also ETL_COORD_STORE, else NATS_URL.
    #[arg(long, env = "ETL_COORD_STORE")]
    pub store: Option<String>,
    /// NATS: bucket replicas (3 on a production cluster).
    #[arg(long, default_value_t = 1, env = "ETL_COORD_NATS_REPLICAS", value_parser = clap::value_parser!(u8).range(1..=5))]
    pub nats_replicas: u8,
    /// NATS: a credentials (.creds) file (else NATS_CREDS).
    #[arg(long, env = "ETL_COORD_NATS_CREDS")]
    pub nats_creds: Option<PathBuf>,
    /// NATS: an authentication token (else NATS_TOKEN).
    #[arg(long, env = "ETL_COORD_NATS_TOKEN", hide_env_values = true)]
    pub nats_token: Option<String>,
    /// NATS: a user name, with --nats-password (else NATS_USER).
    #[arg(long, env = "ETL_COORD_NATS_USER")]
    pub nats_user: Option<String>,
    /// NATS: the user's password; better given by the environment than on the command line
    /// (else NATS_PASSWORD).
    #[arg(long, env = "ETL_COORD_NATS_PASSWORD", hide_env_values = true)]
    pub nats_password: Option<String>,
    /// NATS: require TLS (with the system's root certificates unless --nats-tls-ca is given).
    #[arg(long, env = "ETL_COORD_NATS_TLS")]
    pub nats_tls: bool,
    /// NATS: a PEM file of the certificate authority that signed the servers' certificates;
    /// implies --nats-tls (else NATS_CA).
    #[arg(long, env = "ETL_COORD_NATS_TLS_CA")]
    pub nats_tls_ca: Option<PathBuf>,
    /// NATS: timeout of one request of the NATS client (a write without an answer within it
    /// is in doubt and resolved by reading); the worker waits this long for an answer too, and
    /// at least 5s (a listing or a create can take several requests).
    #[arg(long, default_value = "5s", value_parser = parse_duration, env = "ETL_COORD_NATS_OP_TIMEOUT")]
    pub nats_op_timeout: Duration,
    /// NATS: the bound of the job's state bucket when this command creates it (e.g. 512MiB;
    /// default unbounded). On a shared server it keeps one job from filling the store of all;
    /// the server reserves it from its JetStream storage. A full bucket stops the job with an
    /// error naming the bound. Existing buckets keep theirs.
    #[arg(long, value_parser = parse_bytes, env = "ETL_COORD_NATS_MAX_BYTES")]
    pub nats_max_bytes: Option<i64>,
    /// NATS: the same for the lease bucket (one small record per owned split and per worker:
    /// 16MiB holds tens of thousands).
    #[arg(long, value_parser = parse_bytes, env = "ETL_COORD_NATS_LEASE_MAX_BYTES")]
    pub nats_lease_max_bytes: Option<i64>,
}

/// The NATS CLI's variable for a flag left unset (its own ETL_COORD_ variable included).
fn or_nats_env<T: From<String> + Clone>(value: &Option<T>, var: &str) -> Option<T> {
    value.clone().or_else(|| std::env::var(var).ok().filter(|v| !v.is_empty()).map(T::from))
}

/// The store arguments with the NATS CLI's variables filled in, checked as a whole.
struct Resolved {
    store: String,
    creds: Option<PathBuf>,
    token: Option<String>,
    user: Option<(String, String)>,
    tls_ca: Option<PathBuf>,
}

impl ConnectFlags {
    /// Fills in the NATS CLI's variables and checks what clap cannot see across them; the
    /// error names the flag, for a usage error (exit 2).
    fn resolve(&self) -> Result<Resolved, (&'static str, String)> {
        let store = or_nats_env(&self.store, "NATS_URL").ok_or((
            "--store",
            "is required: `memory` for a standalone run, or nats://HOST:PORT for workers that share a job \
             (also ETL_COORD_STORE, or the NATS CLI's NATS_URL)"
                .to_owned(),
        ))?;
        if store != "memory" && !["nats://", "tls://"].iter().any(|p| store.starts_with(p)) {
            return Err(("--store", format!("{store:?}: expected `memory` or nats://HOST:PORT")));
        }
        // The NATS CLI's credentials only when none were given here (flag or ETL_COORD_): an
        // ambient NATS_USER must not clash with an explicit --nats-creds.
        let ours = self.nats_creds.is_some()
            || self.nats_token.is_some()
            || self.nats_user.is_some()
            || self.nats_password.is_some();
        let fallback =
            |value: &Option<String>, var: &str| if ours { value.clone() } else { or_nats_env(value, var) };
        let creds = fallback(&self.nats_creds.as_ref().map(|p| p.display().to_string()), "NATS_CREDS")
            .map(PathBuf::from);
        let token = fallback(&self.nats_token, "NATS_TOKEN");
        let user = fallback(&self.nats_user, "NATS_USER");
        let password = fallback(&self.nats_password, "NATS_PASSWORD");
        let tls_ca = or_nats_env(&self.nats_tls_ca.as_ref().map(|p| p.display().to_string()), "NATS_CA")
            .map(PathBuf::from);
        let user = match (user, password) {
            (Some(u), Some(p)) => Some((u, p)),
            (None, None) => None,
            (Some(_), None) => {
                return Err(("--nats-user", "needs --nats-password (or ETL_COORD_NATS_PASSWORD)".into()));
            }
            (None, Some(_)) => {
                return Err(("--nats-password", "needs --nats-user (or ETL_COORD_NATS_USER)".into()));
            }
        };
        let given = [creds.is_some(), token.is_some(), user.is_some()].iter().filter(|g| **g).count();
        if given > 1 {
            let flag = if creds.is_some() { "--nats-creds" } else { "--nats-token" };
            return Err((
                flag,
                "give one of --nats-creds, --nats-token, --nats-user/--nats-password (set here or by the environment)"
                    .into(),
            ));
        }
        for (flag, file) in [("--nats-creds", &creds), ("--nats-tls-ca", &tls_ca)] {
            if let Some(f) = file.as_ref().filter(|f| !f.is_file()) {
                return Err((flag, format!("{} is not a file", f.display())));
            }
        }
        Ok(Resolved { store, creds, token, user, tls_ca })
    }
}

impl ConnectFlags {
    /// The connection flags' own checks, as a usage error.
    pub fn validate(&self) -> Result<(), Usage> {
        positive("--nats-op-timeout", self.nats_op_timeout)?;
        self.resolve().map(drop).map_err(|(flag, msg)| Usage::new(flag, msg))
    }
}

impl StoreFlags {
    /// The store flags' own checks, as a usage error.
    pub fn validate(&self) -> Result<(), Usage> {
        self.connection.validate()
    }
}

/// A job name, checked as the store checks it.
pub fn parse_job(s: &str) -> Result<String, String> {
    JobName::new(s.to_owned()).map(|_| s.to_owned()).map_err(|e| e.to_string())
}

/// An instance id, checked as the protocol checks it.
pub fn parse_instance(s: &str) -> Result<String, String> {
    InstanceId::new(s.to_owned()).map(|_| s.to_owned()).map_err(|e| e.to_string())
}

/// A split id, checked as the protocol checks it.
pub fn parse_split(s: &str) -> Result<String, String> {
    SplitId::new(s.to_owned()).map(|_| s.to_owned()).map_err(|e| e.to_string())
}

/// Parses a size: a number of bytes, or one with a unit `KiB`, `MiB`, `GiB` or `TiB` (powers of
/// 1024; `KB`, `MB`, `GB`, `TB` powers of 1000), e.g. `512MiB`.
pub fn parse_bytes(s: &str) -> Result<i64, String> {
    let t = s.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let n: i64 = num.parse().map_err(|_| format!("invalid size {s:?}: a number of bytes, e.g. 512MiB"))?;
    let scale: i64 = match unit.trim() {
        "" | "B" => 1,
        "KiB" => 1 << 10,
        "MiB" => 1 << 20,
        "GiB" => 1 << 30,
        "TiB" => 1 << 40,
        "KB" => 1_000,
        "MB" => 1_000_000,
        "GB" => 1_000_000_000,
        "TB" => 1_000_000_000_000,
        other => return Err(format!("invalid size unit {other:?} in {s:?}: use B, KiB, MiB, GiB or TiB")),
    };
    match n.checked_mul(scale) {
        Some(b) if b > 0 => Ok(b),
        Some(_) => Err(format!("size {s:?} must be positive")),
        None => Err(format!("size {s:?} out of range")),
    }
}

/// Parses `30s`, `500ms`, `2m`, `1h` or a plain number of seconds.
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let s = s.trim();
    let (num, unit) =
        s.find(|c: char| !c.is_ascii_digit() && c != '.').map_or((s, "s"), |i| (&s[..i], &s[i..]));
    let n: f64 = num.parse().map_err(|_| format!("invalid duration {s:?}: expected e.g. 30s, 500ms, 2m"))?;
    let secs = match unit {
        "ms" => n / 1000.0,
        "s" | "" => n,
        "m" => n * 60.0,
        "h" => n * 3600.0,
        other => return Err(format!("invalid duration unit {other:?} in {s:?}: use ms, s, m or h")),
    };
    if !(0.0..=1e9).contains(&secs) {
        return Err(format!("duration {s:?} out of range"));
    }
    Ok(Duration::from_secs_f64(secs))
}

/// The NATS configuration the connection flags give; `None` for `--store memory`.
pub fn nats_config(args: &ConnectFlags) -> Result<Option<etl_coordination_nats::NatsConfig>, Usage> {
    let r = args.resolve().map_err(|(flag, msg)| Usage::new(flag, msg))?;
    if r.store == "memory" {
        return Ok(None);
    }
    let mut cfg = etl_coordination_nats::NatsConfig::new(r.store.clone());
    cfg.replicas = usize::from(args.nats_replicas);
    cfg.op_timeout = args.nats_op_timeout;
    cfg.state_max_bytes = args.nats_max_bytes;
    cfg.lease_max_bytes = args.nats_lease_max_bytes;
    cfg.tls_required = args.nats_tls || r.tls_ca.is_some() || r.store.starts_with("tls://");
    cfg.tls_root_certificate = r.tls_ca;
    if let Some(t) = r.token {
        cfg.auth = etl_coordination_nats::NatsAuth::Token(t);
    }
    if let Some((u, p)) = r.user {
        cfg.auth = etl_coordination_nats::NatsAuth::UserPassword(u, p);
    }
    if let Some(c) = r.creds {
        cfg.auth = etl_coordination_nats::NatsAuth::CredentialsFile(c);
    }
    Ok(Some(cfg))
}

/// The stores of a job that exists, for the commands that read or repair one (`status`,
/// `requeue`, `job`): nothing is created, so a mistyped name leaves nothing behind. A job
/// exists once a worker has started it (its `meta` record is written); anything short of that
/// is [`RunError::NoSuchJob`], saying what was found and how to list the jobs.
pub async fn open_job(args: &StoreFlags) -> Result<JobStores<AnyStore>, RunError> {
    use etl_coordination_nats::Store;
    let job = JobName::new(args.job.clone()).map_err(|e| Usage::new("--job", e.to_string()))?;
    let no_such_job = |store: String, why: String| RunError::NoSuchJob { job: job.clone(), store, why };
    let (stores, store) = match nats_config(&args.connection)? {
        None => {
            return Err(no_such_job(
                "the in-memory store".into(),
                "it holds only the jobs of the process that runs them; to read a job that workers share, give \
                 --store nats://HOST:PORT"
                    .into(),
            ));
        }
        Some(cfg) => match etl_coordination_nats::open_existing(&cfg, &job).await.map_err(RunError::Store)? {
            Ok(buckets) => (JobStores::new(job.clone(), buckets.state, buckets.lease).into_any(), cfg.url),
            Err(bucket) => {
                let why = format!(
                    "its bucket {bucket} does not exist (nothing was created); `etl-coord jobs --store {}` lists \
                     the jobs there (with an account administrator's credentials)",
                    cfg.url
                );
                return Err(no_such_job(cfg.url, why));
            }
        },
    };
    match stores.state.get(&etl_coordination_core::records::keys::meta()).await {
        Ok(Some(_)) => Ok(stores),
        Ok(None) => {
            let why = format!(
                "its buckets exist but no worker has started it yet (no meta record): start its workers, or \
                 check the name with `etl-coord jobs --store {store}` (with an account administrator's \
                 credentials)"
            );
            Err(no_such_job(store, why))
        }
        Err(e) => Err(RunError::Store(e)),
    }
}

/// The job's stores, on the backend `--store` names, created if missing (what a worker does).
pub async fn open_stores(args: &StoreFlags) -> Result<JobStores<AnyStore>, RunError> {
    let job = JobName::new(args.job.clone()).map_err(|e| Usage::new("--job", e.to_string()))?;
    Ok(match nats_config(&args.connection)? {
        None => JobStores::memory(job).into_any(),
        Some(cfg) => JobStores::nats(&cfg, &job).await.map_err(RunError::Store)?.into_any(),
    })
}

/// The knobs of a coordinated worker: its instance id, the job's tuning, what stalls, outages,
/// bad records and the end of the job mean, the drained exit code and the admin server. Each
/// flag can also be given by its `ETL_COORD_*` variable (a flag on the command line wins).
#[derive(clap::Args, Clone, Debug)]
#[non_exhaustive]
pub struct WorkerFlags {
    /// The job and its store.
    #[command(flatten)]
    pub store: StoreFlags,
    /// Stable instance id (default: env POD_NAME with dots replaced, else random).
    #[arg(long, env = "ETL_COORD_INSTANCE_ID", value_parser = parse_instance)]
    pub instance_id: Option<String>,
    /// Lease duration (whole seconds).
    #[arg(long, default_value = "30s", value_parser = parse_duration, env = "ETL_COORD_LEASE_DURATION")]
    pub lease_duration: Duration,
    /// Splits held (and lanes run) at once.
    #[arg(long, default_value_t = 8, env = "ETL_COORD_MAX_IN_FLIGHT")]
    pub max_in_flight: u32,
    /// Failing tenancies before a split is quarantined, for a new job: a job keeps the value
    /// it was started with (change it with `etl-coord job set-max-attempts`).
    #[arg(long, default_value_t = 4, env = "ETL_COORD_MAX_ATTEMPTS")]
    pub max_attempts: u32,
    /// How long a split whose tenancy failed waits before it is claimed again; it doubles
    /// with each failure (at most 10m), so max-attempts failures span minutes. 0s: at once.
    #[arg(long, default_value = "15s", value_parser = parse_duration, env = "ETL_COORD_CLAIM_BACKOFF")]
    pub claim_backoff: Duration,
    /// How often the leader re-runs an open plan.
    #[arg(long, default_value = "60s", value_parser = parse_duration, env = "ETL_COORD_REPLAN_INTERVAL")]
    pub replan_interval: Duration,
    /// How long lanes get to commit on SIGTERM before their splits are released.
    #[arg(long, default_value = "30s", value_parser = parse_duration, env = "ETL_COORD_DRAIN_TIMEOUT")]
    pub drain_timeout: Duration,
    /// How long the owner of a split a peer asks for (a rebalancing steal) has to commit and
    /// release it before the peer takes it over anyway (re-reading what the owner had not
    /// committed). At most a third of the lease takes effect; use one value on every worker.
    /// 0s: steals take over at once.
    #[arg(long, default_value = "10s", value_parser = parse_duration, env = "ETL_COORD_HANDOVER_TIMEOUT")]
    pub handover_timeout: Duration,
    /// How long the leader waits for the planner (listing the input) before counting the call
    /// as failed and retrying it after a backoff.
    #[arg(long, default_value = "10m", value_parser = parse_duration, env = "ETL_COORD_PLAN_TIMEOUT")]
    pub plan_timeout: Duration,
    /// What a stalled job (quarantined splits) means: fatal (exit 3) or warn (exit 0).
    #[arg(long, default_value = "fatal", value_parser = ["fatal", "warn"], env = "ETL_COORD_ON_STALL")]
    pub on_stall: String,
    /// After the job ends (complete, or stalled with on-stall warn): exit 0, or `wait`: stay
    /// until SIGTERM, serving the admin endpoints and taking up splits that `requeue` puts
    /// back (for a Kubernetes Deployment, which restarts exited pods).
    #[arg(long, default_value = "exit", value_parser = ["exit", "wait"], env = "ETL_COORD_ON_COMPLETE")]
    pub on_complete: String,
    /// A lane that holds its lease but commits no progress for this long is stalled (a source
    /// stuck on a hung connection): a warning, the etl_coordination_lanes_stalled gauge, and
    /// with --on-lane-stall release the split is handed on. 0s turns the check off.
    #[arg(long, default_value = "10m", value_parser = parse_duration, env = "ETL_COORD_LANE_STALL_TIMEOUT")]
    pub lane_stall_timeout: Duration,
    /// What a stalled lane gets: `warn` (report it only) or `release` (stop the lane and end
    /// its tenancy as failed, so a peer retries the split from its committed progress; one
    /// attempt is consumed if the tenancy committed nothing).
    #[arg(long, default_value = "warn", value_parser = ["warn", "release"], env = "ETL_COORD_ON_LANE_STALL")]
    pub on_lane_stall: String,
    /// How long a lane waits out an outage of its source or sink (a full disk, a throttled or
    /// restarting service: errors that say so) in place, with backoff, before it counts as a
    /// failure of the split (one attempt). 0s: no waiting.
    #[arg(long, default_value = "5m", value_parser = parse_duration, env = "ETL_COORD_TRANSIENT_RETRY_BUDGET")]
    pub transient_retry_budget: Duration,
    /// What a bad record does: `quarantine` its split (one attempt per tenancy that meets it),
    /// or `skip` it into the dead-letter sink and go on.
    #[arg(long, default_value = "quarantine", value_parser = ["quarantine", "skip"], env = "ETL_COORD_ON_BAD_RECORD")]
    pub on_bad_record: String,
    /// With --on-bad-record skip: a lane that meets more bad records than this in one split
    /// gives the split up (quarantined at once, with its progress) for a person to look at.
    #[arg(long, default_value_t = etl_coordination_driver::DEFAULT_MAX_BAD_RECORDS_PER_SPLIT, env = "ETL_COORD_MAX_BAD_RECORDS")]
    pub max_bad_records: u32,
    /// The breaker: this many distinct splits failing with the same cause within
    /// --breaker-window mean the sink (or the worker) is at fault: their failures are not
    /// charged, intake pauses, and one split is tried again after 10s (doubling to 5m) until a
    /// lane commits. 0 turns it off.
    #[arg(long, default_value_t = etl_coordination_driver::DEFAULT_BREAKER_THRESHOLD, env = "ETL_COORD_BREAKER_THRESHOLD")]
    pub breaker_threshold: u32,
    /// See --breaker-threshold.
    #[arg(long, default_value = "60s", value_parser = parse_duration, env = "ETL_COORD_BREAKER_WINDOW")]
    pub breaker_window: Duration,
    /// The exit code of a worker that drained (SIGTERM) before the job ended. 0 suits a
    /// Deployment; a Kubernetes Job needs non-zero (e.g. 143), or one drained pod would make
    /// the Job stop replacing pods and end complete with splits left.
    #[arg(long, default_value_t = 0, env = "ETL_COORD_EXIT_CODE_WHEN_DRAINED")]
    pub exit_code_when_drained: u8,
    /// Serve /metrics, /healthz and /readyz on this address.
    #[arg(long, env = "ETL_COORD_ADMIN_ADDR")]
    pub admin_addr: Option<SocketAddr>,
}

impl WorkerFlags {
    /// The job's tuning as the flags give it.
    pub fn tuning(&self) -> Tuning {
        let mut t = Tuning::default();
        t.lease_duration = self.lease_duration;
        t.max_in_flight = self.max_in_flight;
        t.max_attempts = self.max_attempts;
        t.replan_interval = self.replan_interval;
        t.drain_timeout = self.drain_timeout;
        t.handover_timeout = self.handover_timeout;
        t.plan_timeout = self.plan_timeout;
        t.claim_backoff = self.claim_backoff;
        t
    }

    /// The driver's configuration as the flags give it (the instance id from `POD_NAME` when
    /// `--instance-id` is not set).
    pub fn driver_config(&self) -> Result<DriverConfig, Usage> {
        let mut config = DriverConfig::default();
        config.instance_id = default_instance_id(self.instance_id.clone())?;
        config.tuning = self.tuning();
        config.on_stall = if self.on_stall == "warn" { OnStall::Warn } else { OnStall::Fatal };
        config.stay_after_end = self.on_complete == "wait";
        config.lane_stall_timeout = Some(self.lane_stall_timeout).filter(|t| !t.is_zero());
        config.on_lane_stall =
            if self.on_lane_stall == "release" { OnLaneStall::Release } else { OnLaneStall::Warn };
        config.transient_retry_budget = self.transient_retry_budget;
        config.breaker_threshold = self.breaker_threshold;
        config.breaker_window = self.breaker_window;
        if self.on_bad_record == "skip" {
            config.on_bad_record = OnBadRecord::Skip { max_per_split: self.max_bad_records };
        }
        Ok(config)
    }

    /// Checks what one flag's parser cannot: values against each other and the environment's
    /// fallbacks. The error names the flag (a usage error: exit 2, before anything connects).
    pub fn validate(&self) -> Result<(), Usage> {
        self.tuning().validate().map_err(tuning_error)?;
        self.driver_config()?.validate().map_err(tuning_error)?;
        if !self.lane_stall_timeout.is_zero() && self.lane_stall_timeout < Duration::from_secs(1) {
            return Err(Usage::new(
                "--lane-stall-timeout",
                format!("{:?}: must be 0s (off) or at least 1s", self.lane_stall_timeout),
            ));
        }
        self.store.validate()
    }
}

/// `--instance-id`, else `POD_NAME` with its dots replaced, else none (a random one).
fn default_instance_id(flag: Option<String>) -> Result<Option<InstanceId>, Usage> {
    if let Some(id) = flag {
        return InstanceId::new(id).map(Some).map_err(|e| Usage::new("--instance-id", e.to_string()));
    }
    match std::env::var("POD_NAME") {
        Ok(pod) if !pod.is_empty() => InstanceId::new(pod.replace('.', "-")).map(Some).map_err(|e| {
            Usage::new(
                "--instance-id",
                format!("POD_NAME: {e} (set --instance-id, or a POD_NAME that is a valid id)"),
            )
        }),
        _ => Ok(None),
    }
}

/// How the worker logs: to stderr, at a level from `-v`/`-q` (`RUST_LOG` overrides), as text
/// or JSON lines.
#[derive(clap::Args, Clone, Debug, Default)]
#[non_exhaustive]
pub struct LogFlags {
    /// More log output: -v debug, -vv trace (default: info).
    #[arg(short, long, action = clap::ArgAction::Count, global = true)]
    pub verbose: u8,
    /// Less log output: -q warnings and errors, -qq errors only.
    #[arg(short, long, action = clap::ArgAction::Count, global = true, conflicts_with = "verbose")]
    pub quiet: u8,
    /// Log format on stderr: `text` (human) or `json` (one object per line, for log pipelines).
    #[arg(long, global = true, env = "ETL_COORD_LOG_FORMAT", default_value = "text", value_parser = ["text", "json"])]
    pub log_format: String,
    /// Colour in text logs: `auto` (only when stderr is a terminal), `always`, `never`.
    #[arg(long, global = true, env = "ETL_COORD_COLOR", default_value = "auto", value_parser = ["auto", "always", "never"])]
    pub color: String,
}

impl LogFlags {
    /// Whether logs are JSON lines.
    pub fn json(&self) -> bool {
        self.log_format == "json"
    }

    /// Installs the global tracing subscriber: stderr, the level from `-v`/`-q` counted from
    /// `base` (0 error, 1 warn, 2 info, 3 debug, 4 trace; `RUST_LOG` overrides), text (colour
    /// only on a terminal unless `--color` says otherwise) or JSON lines. The NATS client's own
    /// info lines (every connect) stay out unless tracing.
    pub fn init(&self, base: u8) {
        use std::io::IsTerminal;
        let levels = ["error", "warn", "info", "debug", "trace"];
        let level = (i32::from(base) + i32::from(self.verbose) - i32::from(self.quiet)).clamp(0, 4) as usize;
        let client = if level >= 4 { "debug" } else { levels[level.min(1)] };
        let filter = tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| {
            tracing_subscriber::EnvFilter::new(format!("{},async_nats={client}", levels[level]))
        });
        let builder = tracing_subscriber::fmt().with_writer(std::io::stderr).with_env_filter(filter);
        if self.json() {
            builder.json().with_current_span(true).with_span_list(false).init();
        } else {
            let ansi = match self.color.as_str() {
                "always" => true,
                "never" => false,
                _ => std::io::stderr().is_terminal(),
            };
            builder.with_ansi(ansi).init();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::parse_bytes;

    #[test]
    fn sizes_parse_with_binary_and_decimal_units_and_bad_ones_say_what_is_wrong() {
        assert_eq!(parse_bytes("4096"), Ok(4096));
        assert_eq!(parse_bytes("512MiB"), Ok(512 << 20));
        assert_eq!(parse_bytes("2GiB"), Ok(2 << 30));
        assert_eq!(parse_bytes("3 KB"), Ok(3_000));
        assert_eq!(parse_bytes("1TB"), Ok(1_000_000_000_000));
        assert!(parse_bytes("12mb").unwrap_err().contains("unit \"mb\""));
        assert!(parse_bytes("0").unwrap_err().contains("positive"));
        assert!(parse_bytes("MiB").unwrap_err().contains("a number of bytes"));
        assert!(parse_bytes("99999999999TiB").unwrap_err().contains("out of range"));
    }
}
