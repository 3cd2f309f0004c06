//! `etl-coord`: run, inspect and operate coordinated pipelines.
//!
//! Exit codes: 0 job complete (or drained), 3 job stalled on quarantined splits
//! (0 with `--on-stall warn`), 1 fatal error, 2 usage error.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use anyhow::{Context, bail};
use clap::{Parser, Subcommand};
use etl_coord::demo::{DemoOptions, run_demo};
use etl_coord::ops;
use etl_coord::sink::JsonlSink;
use etl_coord::sources::{AnySource, DEFAULT_SPLIT_BYTES, DEFAULT_SPLIT_ROWS, Faults, Faulty};
use etl_coordination_driver::{
    AnyStore, DriverConfig, DriverError, InstanceId, JobName, JobOutcome, JobStores, OnLaneStall, OnStall,
    Pipeline, SplitId, Tuning,
};

/// What `--help` ends with: exit codes and the environment.
const AFTER_HELP: &str = "\
Exit codes: 0 job complete (or drained, or stalled with --on-stall warn), 3 job stalled on
quarantined splits, 1 a fatal error (the message says what to do), 2 a usage error (a flag or
value is wrong; nothing was started), 130 a second termination signal cut a drain short;
--exit-code-when-drained sets the code of a drained worker (0 by default).

Environment: every worker and store flag can also be given as ETL_COORD_<FLAG> (upper case,
dashes as underscores: --lease-duration is ETL_COORD_LEASE_DURATION; booleans take true or
false); a flag on the command line wins. One-shot flags (requeue --split, status --state,
--watch, ...) and the demo's are read from the command line only.
The NATS CLI's variables are honoured when the ETL_COORD_ one is unset: NATS_URL (--store),
NATS_USER, NATS_PASSWORD, NATS_CREDS, NATS_TOKEN, NATS_CA (--nats-tls-ca). POD_NAME gives the
instance id when --instance-id is not set. RUST_LOG, if set, overrides -v/-q.";

#[derive(Parser, Debug)]
#[command(name = "etl-coord", version, about = "Coordinated scale-out for broker-less sources", after_help = AFTER_HELP)]
struct Cli {
    #[command(subcommand)]
    command: Command,
    /// More log output: -v debug, -vv trace (default: info; the demo's default is error).
    #[arg(short, long, action = clap::ArgAction::Count, global = true)]
    verbose: u8,
    /// Less log output: -q warnings and errors, -qq errors only.
    #[arg(short, long, action = clap::ArgAction::Count, global = true, conflicts_with = "verbose")]
    quiet: u8,
    /// Log format on stderr: `text` (human) or `json` (one object per line, for log pipelines).
    #[arg(long, global = true, env = "ETL_COORD_LOG_FORMAT", default_value = "text", value_parser = ["text", "json"])]
    log_format: String,
    /// Colour in text logs: `auto` (only when stderr is a terminal), `always`, `never`.
    #[arg(long, global = true, env = "ETL_COORD_COLOR", default_value = "auto", value_parser = ["auto", "always", "never"])]
    color: String,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Run a coordinated backfill with several in-process workers on the in-memory store, then
    /// check the output for loss.
    Demo(DemoArgs),
    /// Run one replica of a coordinated pipeline (multi-process and Kubernetes use).
    #[command(after_help = AFTER_HELP)]
    Worker(Box<WorkerArgs>),
    /// Show a job's plan, leader, live workers and every split.
    #[command(after_help = AFTER_HELP)]
    Status(StatusArgs),
    /// Return a quarantined split to the queue (attempts reset) after fixing its cause; with
    /// --reset, start any split over from the beginning (the repair for a record nobody can
    /// decode).
    #[command(after_help = AFTER_HELP)]
    Requeue(RequeueArgs),
    /// Print the NATS permissions a job's clients need, to paste into the server's
    /// authorization block (or JSON).
    NatsPermissions(NatsPermissionsArgs),
    /// Create a job's NATS buckets if missing and check their configuration (an operator's
    /// set-up step, so that workers need no permission to create them).
    #[command(after_help = AFTER_HELP)]
    NatsBuckets(NatsBucketsArgs),
}

#[derive(clap::Args, Debug)]
struct NatsPermissionsArgs {
    /// Job name.
    #[arg(long, env = "ETL_COORD_JOB")]
    job: String,
    /// Include creating the job's buckets (for `nats-buckets`, or workers that create them).
    #[arg(long)]
    create: bool,
    /// `conf`: a user entry for the server's `authorization { users: [...] }`; `json`: the
    /// permissions alone, as JSON (e.g. for `nsc` or a templating tool).
    #[arg(long, default_value = "conf", value_parser = ["conf", "json"])]
    format: String,
    /// The user name in the `conf` entry.
    #[arg(long, default_value = "etl-JOB")]
    user: String,
    /// The environment variable the server reads the user's password from (`conf`).
    #[arg(long, default_value = "ETL_JOB_NATS_PASSWORD")]
    password_var: String,
}

#[derive(clap::Args, Debug)]
struct NatsBucketsArgs {
    #[command(flatten)]
    store: StoreArgs,
    /// Only check that both buckets exist with a valid configuration; create nothing.
    #[arg(long)]
    check: bool,
}

#[derive(clap::Args, Debug)]
struct DemoArgs {
    /// In-process workers.
    #[arg(long, default_value_t = 3)]
    workers: usize,
    /// Read this directory instead of generating a dataset.
    #[arg(long)]
    input: Option<PathBuf>,
    /// Generated dataset: files.
    #[arg(long, default_value_t = 48)]
    files: usize,
    /// Generated dataset: lines per file.
    #[arg(long, default_value_t = 2000)]
    lines: usize,
    /// Target bytes per split (small by default so the demo dataset spreads over the workers).
    #[arg(long, default_value_t = 256 * 1024)]
    split_size: u64,
    /// Kill and freeze workers at random while the job runs; it must still complete with no loss.
    #[arg(long)]
    chaos: bool,
    /// Lease duration (whole seconds), e.g. 3s.
    #[arg(long, default_value = "3s", value_parser = parse_duration)]
    lease_duration: Duration,
    /// Splits per worker.
    #[arg(long, default_value_t = 4)]
    max_in_flight: u32,
    /// Sleep per record in milliseconds (default: 0, or 1 with --chaos so faults land mid-job).
    #[arg(long)]
    record_delay_ms: Option<u64>,
    /// Seed of the chaos schedule.
    #[arg(long, default_value_t = 1)]
    seed: u64,
}

#[derive(clap::Args, Debug)]
struct StoreArgs {
    /// Job name: [A-Za-z0-9_-]; suffixes the store's bucket names.
    #[arg(long, env = "ETL_COORD_JOB", value_parser = parse_job)]
    job: String,
    /// Required: `nats://HOST:PORT` (comma-separate several; `tls://` requires TLS), or `memory`
    /// for a single standalone instance (nothing is shared). Also ETL_COORD_STORE, else NATS_URL.
    #[arg(long, env = "ETL_COORD_STORE")]
    store: Option<String>,
    /// NATS: bucket replicas (3 on a production cluster).
    #[arg(long, default_value_t = 1, env = "ETL_COORD_NATS_REPLICAS", value_parser = clap::value_parser!(u8).range(1..=5))]
    nats_replicas: u8,
    /// NATS: a credentials (.creds) file (else NATS_CREDS).
    #[arg(long, env = "ETL_COORD_NATS_CREDS")]
    nats_creds: Option<PathBuf>,
    /// NATS: an authentication token (else NATS_TOKEN).
    #[arg(long, env = "ETL_COORD_NATS_TOKEN", hide_env_values = true)]
    nats_token: Option<String>,
    /// NATS: a user name, with --nats-password (else NATS_USER).
    #[arg(long, env = "ETL_COORD_NATS_USER")]
    nats_user: Option<String>,
    /// NATS: the user's password; better given by the environment than on the command line
    /// (else NATS_PASSWORD).
    #[arg(long, env = "ETL_COORD_NATS_PASSWORD", hide_env_values = true)]
    nats_password: Option<String>,
    /// NATS: require TLS (with the system's root certificates unless --nats-tls-ca is given).
    #[arg(long, env = "ETL_COORD_NATS_TLS")]
    nats_tls: bool,
    /// NATS: a PEM file of the certificate authority that signed the servers' certificates;
    /// implies --nats-tls (else NATS_CA).
    #[arg(long, env = "ETL_COORD_NATS_TLS_CA")]
    nats_tls_ca: Option<PathBuf>,
    /// NATS: timeout of one request, for the NATS client and the worker alike (a write without
    /// an answer within it is in doubt and resolved by reading).
    #[arg(long, default_value = "5s", value_parser = parse_duration, env = "ETL_COORD_NATS_OP_TIMEOUT")]
    nats_op_timeout: Duration,
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

impl StoreArgs {
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

#[derive(clap::Args, Debug)]
struct WorkerArgs {
    #[command(flatten)]
    store: StoreArgs,
    /// `files:DIR` or `sqlite:PATH:TABLE`.
    #[arg(long, env = "ETL_COORD_SOURCE")]
    source: String,
    /// Keep the plan open: the leader re-plans every --replan-interval and new input becomes
    /// new splits (files: every object is a split, new objects are picked up; sqlite: rows past
    /// the last planned id). The job never completes; SIGTERM ends a worker (a drain).
    #[arg(long, env = "ETL_COORD_FOLLOW")]
    follow: bool,
    /// JSON Lines output, one line per emitted record.
    #[arg(long, env = "ETL_COORD_SINK")]
    sink: Option<PathBuf>,
    /// Stable instance id (default: env POD_NAME with dots replaced, else random).
    #[arg(long, env = "ETL_COORD_INSTANCE_ID", value_parser = parse_instance)]
    instance_id: Option<String>,
    /// Lease duration (whole seconds).
    #[arg(long, default_value = "30s", value_parser = parse_duration, env = "ETL_COORD_LEASE_DURATION")]
    lease_duration: Duration,
    /// Splits held (and lanes run) at once.
    #[arg(long, default_value_t = 8, env = "ETL_COORD_MAX_IN_FLIGHT")]
    max_in_flight: u32,
    /// Failing tenancies before a split is quarantined.
    #[arg(long, default_value_t = 4, env = "ETL_COORD_MAX_ATTEMPTS")]
    max_attempts: u32,
    /// How often the leader re-runs an open plan.
    #[arg(long, default_value = "60s", value_parser = parse_duration, env = "ETL_COORD_REPLAN_INTERVAL")]
    replan_interval: Duration,
    /// How long lanes get to commit on SIGTERM before their splits are released.
    #[arg(long, default_value = "30s", value_parser = parse_duration, env = "ETL_COORD_DRAIN_TIMEOUT")]
    drain_timeout: Duration,
    /// How long the leader waits for the planner (listing the input) before counting the call
    /// as failed and retrying it after a backoff.
    #[arg(long, default_value = "10m", value_parser = parse_duration, env = "ETL_COORD_PLAN_TIMEOUT")]
    plan_timeout: Duration,
    /// What a stalled job (quarantined splits) means: fatal (exit 3) or warn (exit 0).
    #[arg(long, default_value = "fatal", value_parser = ["fatal", "warn"], env = "ETL_COORD_ON_STALL")]
    on_stall: String,
    /// After the job ends (complete, or stalled with on-stall warn): exit 0, or `wait`: stay
    /// until SIGTERM, serving the admin endpoints and taking up splits that `requeue` puts
    /// back (for a Kubernetes Deployment, which restarts exited pods).
    #[arg(long, default_value = "exit", value_parser = ["exit", "wait"], env = "ETL_COORD_ON_COMPLETE")]
    on_complete: String,
    /// A lane that holds its lease but commits no progress for this long is stalled (a source
    /// stuck on a hung connection): a warning, the etl_coordination_lanes_stalled gauge, and
    /// with --on-lane-stall release the split is handed on. 0s turns the check off.
    #[arg(long, default_value = "10m", value_parser = parse_duration, env = "ETL_COORD_LANE_STALL_TIMEOUT")]
    lane_stall_timeout: Duration,
    /// What a stalled lane gets: `warn` (report it only) or `release` (stop the lane and end
    /// its tenancy as failed, so a peer retries the split from its committed progress; one
    /// attempt is consumed if the tenancy committed nothing).
    #[arg(long, default_value = "warn", value_parser = ["warn", "release"], env = "ETL_COORD_ON_LANE_STALL")]
    on_lane_stall: String,
    /// Files source: target bytes per split.
    #[arg(long, default_value_t = DEFAULT_SPLIT_BYTES, env = "ETL_COORD_SPLIT_SIZE")]
    split_size: u64,
    /// SQLite source: rows per split.
    #[arg(long, default_value_t = DEFAULT_SPLIT_ROWS, env = "ETL_COORD_SPLIT_ROWS")]
    split_rows: u64,
    /// The exit code of a worker that drained (SIGTERM) before the job ended. 0 suits a
    /// Deployment; a Kubernetes Job needs non-zero (e.g. 143), or one drained pod would make
    /// the Job stop replacing pods and end complete with splits left.
    #[arg(long, default_value_t = 0, env = "ETL_COORD_EXIT_CODE_WHEN_DRAINED")]
    exit_code_when_drained: u8,
    /// Serve /metrics, /healthz and /readyz on this address.
    #[arg(long, env = "ETL_COORD_ADMIN_ADDR")]
    admin_addr: Option<SocketAddr>,
    /// Test fault: sleep per record, in milliseconds.
    #[arg(long, hide = true, default_value_t = 0)]
    record_delay_ms: u64,
    /// Test fault: reaching an input line containing this text aborts the process.
    #[arg(long, hide = true)]
    poison_marker: Option<String>,
    /// Test fault: reaching an input line containing this text reports the split unprocessable.
    #[arg(long, hide = true)]
    unprocessable_marker: Option<String>,
    /// Test fault: reaching an input line containing this text hangs the lane's reader, like a
    /// read on a connection that never answers (only a stop signal ends it).
    #[arg(long, hide = true)]
    hang_marker: Option<String>,
}

#[derive(clap::Args, Debug)]
struct StatusArgs {
    #[command(flatten)]
    store: StoreArgs,
    /// `table`, `wide` (every column in full, and who holds each split's live lease) or `json`
    /// (for tooling). Records and leases are read one listing after the other: on a running
    /// job a split that changed hands in between can show the lease of a moment before.
    #[arg(short, long, default_value = "table", value_parser = ["table", "wide", "json"])]
    output: String,
    /// Same as `-o json`.
    #[arg(long)]
    json: bool,
    /// Show only splits in these states (comma-separated: done, owned, unleased, quarantined,
    /// undecodable, missing); the summary still counts every split.
    #[arg(long, value_delimiter = ',', value_parser = ["done", "owned", "unleased", "quarantined", "undecodable", "missing"], ignore_case = true)]
    state: Vec<String>,
    /// Print the status again every --interval until interrupted.
    #[arg(short, long)]
    watch: bool,
    /// How often --watch prints.
    #[arg(long, default_value = "2s", value_parser = parse_duration)]
    interval: Duration,
}

#[derive(clap::Args, Debug)]
struct RequeueArgs {
    #[command(flatten)]
    store: StoreArgs,
    /// The split's id (quarantined, unless --reset).
    #[arg(long, value_parser = parse_split)]
    split: String,
    /// Rewrite the split's record from its descriptor, whatever it holds (an undecodable
    /// value, a Done split to run again, a stuck owner, which is fenced): progress from the
    /// start, attempts 0, back in the queue. Every record of the split is emitted again
    /// (at-least-once). Asks for confirmation unless --yes; any answer but y leaves the split
    /// as it is and exits 1.
    #[arg(long)]
    reset: bool,
    /// Do not ask for confirmation (--reset).
    #[arg(short, long, requires = "reset")]
    yes: bool,
}

/// A job name, checked as the store checks it.
fn parse_job(s: &str) -> Result<String, String> {
    JobName::new(s.to_owned()).map(|_| s.to_owned()).map_err(|e| e.to_string())
}

/// An instance id, checked as the protocol checks it.
fn parse_instance(s: &str) -> Result<String, String> {
    InstanceId::new(s.to_owned()).map(|_| s.to_owned()).map_err(|e| e.to_string())
}

/// A split id, checked as the protocol checks it.
fn parse_split(s: &str) -> Result<String, String> {
    SplitId::new(s.to_owned()).map(|_| s.to_owned()).map_err(|e| e.to_string())
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
    t
}

/// Checks what one flag's parser cannot: values against each other and the environment's
/// fallbacks. Exits 2 (a usage error naming the flag) on the first problem.
fn validate(cli: &Cli) {
    let fail = |flag: &str, msg: String| -> ! {
        use clap::CommandFactory;
        Cli::command().error(clap::error::ErrorKind::ValueValidation, format!("{flag} {msg}")).exit()
    };
    let positive = |flag: &str, d: Duration| {
        if d.is_zero() {
            fail(flag, "must be more than 0s".into());
        }
    };
    match &cli.command {
        Command::Worker(a) => positive("--nats-op-timeout", a.store.nats_op_timeout),
        Command::Status(a) => {
            positive("--nats-op-timeout", a.store.nats_op_timeout);
            positive("--interval", a.interval);
        }
        Command::Requeue(a) => positive("--nats-op-timeout", a.store.nats_op_timeout),
        Command::NatsBuckets(a) => positive("--nats-op-timeout", a.store.nats_op_timeout),
        Command::Demo(_) | Command::NatsPermissions(_) => {}
    }
    let store = match &cli.command {
        Command::Worker(a) => {
            if let Err(e) = tuning(a).validate() {
                let flag = format!("--{}", e.field.replace('_', "-"));
                fail(&flag, format!("{}: {}", e.value, e.rule));
            }
            if !a.lane_stall_timeout.is_zero() && a.lane_stall_timeout < Duration::from_secs(1) {
                fail(
                    "--lane-stall-timeout",
                    format!("{:?}: must be 0s (off) or at least 1s", a.lane_stall_timeout),
                );
            }
            // What the input and the local files can tell is told now, not after connecting.
            if let Err(e) = AnySource::open(&a.source, a.split_size, a.split_rows, a.follow) {
                let msg = format!("{e:#}");
                match msg.strip_prefix("--").and_then(|m| m.split_once(' ')) {
                    Some((flag, rest)) => fail(&format!("--{flag}"), rest.to_owned()),
                    None => fail("--source", format!("{}: {msg}", a.source)),
                }
            }
            if let Some(sink) = &a.sink {
                let dir =
                    sink.parent().filter(|d| !d.as_os_str().is_empty()).unwrap_or(std::path::Path::new("."));
                if !dir.is_dir() {
                    fail(
                        "--sink",
                        format!("{}: the directory {} does not exist", sink.display(), dir.display()),
                    );
                }
                if sink.is_dir() {
                    fail("--sink", format!("{} is a directory; give a file", sink.display()));
                }
            }
            if let Err(e) = default_instance_id(a.instance_id.clone()) {
                fail("--instance-id", format!("{e:#} (set --instance-id, or a POD_NAME that is a valid id)"));
            }
            Some(&a.store)
        }
        Command::Demo(a) => {
            let mut t = Tuning::default();
            t.lease_duration = a.lease_duration;
            t.max_in_flight = a.max_in_flight;
            if let Err(e) = t.validate() {
                fail(&format!("--{}", e.field.replace('_', "-")), format!("{}: {}", e.value, e.rule));
            }
            None
        }
        Command::Status(a) => Some(&a.store),
        Command::Requeue(a) => Some(&a.store),
        Command::NatsBuckets(a) => Some(&a.store),
        Command::NatsPermissions(_) => None,
    };
    if let Some(Err((flag, msg))) = store.map(StoreArgs::resolve) {
        fail(flag, msg);
    }
}

/// Parses `30s`, `500ms`, `2m`, `1h` or a plain number of seconds.
fn parse_duration(s: &str) -> Result<Duration, String> {
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

fn main() -> ExitCode {
    let cli = match Cli::try_parse() {
        Ok(c) => c,
        Err(e) => {
            let _ = e.print();
            return ExitCode::from(if e.use_stderr() { 2 } else { 0 });
        }
    };
    validate(&cli);
    init_logging(&cli);
    let json = cli.log_format == "json";
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build().expect("tokio runtime");
    match rt.block_on(run(cli)) {
        Ok(code) => code,
        Err(e) if json => {
            tracing::error!(error = %format!("{e:#}"), "fatal");
            ExitCode::from(1)
        }
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::from(1)
        }
    }
}

/// Logs go through tracing only, to stderr: the level from -v/-q (RUST_LOG overrides), text
/// (colour only on a terminal, unless --color says otherwise) or JSON lines.
fn init_logging(cli: &Cli) {
    use std::io::IsTerminal;
    // The demo's takeovers and revocations are expected; it shows only errors by default.
    let levels = ["error", "warn", "info", "debug", "trace"];
    let base: i32 = if matches!(cli.command, Command::Demo(_)) { 0 } else { 2 };
    let level = (base + i32::from(cli.verbose) - i32::from(cli.quiet)).clamp(0, 4) as usize;
    // The NATS client's own info lines (every connect) stay out of a healthy worker's log.
    let client = if level >= 4 { "debug" } else { levels[level.min(1)] };
    let filter = tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| {
        tracing_subscriber::EnvFilter::new(format!("{},async_nats={client}", levels[level]))
    });
    let builder = tracing_subscriber::fmt().with_writer(std::io::stderr).with_env_filter(filter);
    if cli.log_format == "json" {
        builder.json().with_current_span(true).with_span_list(false).init();
    } else {
        let ansi = match cli.color.as_str() {
            "always" => true,
            "never" => false,
            _ => std::io::stderr().is_terminal(),
        };
        builder.with_ansi(ansi).init();
    }
}

async fn run(cli: Cli) -> anyhow::Result<ExitCode> {
    match cli.command {
        Command::Demo(a) => demo(a).await,
        Command::Worker(a) => worker(*a).await,
        Command::Status(a) => {
            let stores = open_stores(&a.store).await?;
            let mut first = true;
            loop {
                let read = ops::status(&stores).await;
                let mut s = match read {
                    Ok(s) => s,
                    // Watching carries on through a store that is briefly unavailable.
                    Err(e) if a.watch => {
                        tracing::warn!("reading the job failed: {e:#}; trying again in {:?}", a.interval);
                        tokio::time::sleep(a.interval).await;
                        continue;
                    }
                    Err(e) => return Err(e),
                };
                ops::filter(&mut s, &a.state);
                let text = if a.json || a.output == "json" {
                    format!("{}\n", serde_json::to_string_pretty(&s)?)
                } else {
                    let output = if a.output == "wide" { ops::Output::Wide } else { ops::Output::Table };
                    ops::render(&s, output)
                };
                let text = if first { text } else { format!("\n{text}") };
                // A reader that stops early (`| head`) ends the command quietly.
                use std::io::Write;
                let mut stdout = std::io::stdout().lock();
                match stdout.write_all(text.as_bytes()).and_then(|()| stdout.flush()) {
                    Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => return Ok(ExitCode::SUCCESS),
                    other => other?,
                }
                drop(stdout);
                if !a.watch {
                    break;
                }
                tokio::time::sleep(a.interval).await;
                first = false;
            }
            Ok(ExitCode::SUCCESS)
        }
        Command::NatsPermissions(a) => {
            let job = JobName::new(a.job.clone())?;
            let access = if a.create {
                etl_coordination_nats::Access::Create
            } else {
                etl_coordination_nats::Access::Use
            };
            let p = etl_coordination_nats::permissions(&job, access);
            if a.format == "json" {
                let v = serde_json::json!({
                    "publish": { "allow": p.publish },
                    "subscribe": { "allow": p.subscribe },
                });
                println!("{}", serde_json::to_string_pretty(&v)?);
            } else {
                let user = a.user.replace("JOB", job.as_str());
                println!(
                    "# {} of etl-coordination job {job}: its two buckets, nothing else. Paste into\n\
                     # authorization {{ users: [ ... ] }} of the NATS server configuration.",
                    if a.create { "Creates and uses the buckets" } else { "A client" }
                );
                print!("{}", p.server_config_user(&user, &a.password_var));
            }
            Ok(ExitCode::SUCCESS)
        }
        Command::NatsBuckets(a) => {
            let Some(mut cfg) = nats_config(&a.store)? else {
                bail!("--store memory: nats-buckets needs a nats:// URL");
            };
            cfg.create_buckets = !a.check;
            let job = JobName::new(a.store.job.clone())?;
            let stores = etl_coordination_nats::connect(&cfg, &job).await?;
            let mut differ = false;
            for b in [&stores.state, &stores.lease] {
                let how = if stores.created.iter().any(|c| c == b.bucket()) { "created" } else { "exists" };
                println!("{}: {how}, configuration valid, replicas {}", b.bucket(), b.replicas());
                differ |= b.replicas() != cfg.replicas;
            }
            if differ && a.check {
                bail!(
                    "the buckets' replicas differ from --nats-replicas {} (replicas are set when a bucket \
                     is created: change them with `nats stream edit`, or recreate the job)",
                    cfg.replicas
                );
            }
            Ok(ExitCode::SUCCESS)
        }
        Command::Requeue(a) => {
            let split = SplitId::new(a.split.clone())?;
            let stores = open_stores(&a.store).await?;
            if !a.reset {
                ops::requeue(&stores, &split).await?;
                println!("split {split} requeued: attempts reset, offered to workers again");
                return Ok(ExitCode::SUCCESS);
            }
            let plan = ops::plan_reset(&stores, &split).await?;
            if !a.yes && !confirm(&plan)? {
                println!("split {split} left as it is");
                return Ok(ExitCode::from(1));
            }
            ops::apply_reset(&stores, &plan).await?;
            println!("split {split} reset: it starts over from the beginning, offered to workers again");
            Ok(ExitCode::SUCCESS)
        }
    }
}

/// Asks on the terminal before a reset; without a terminal to ask on, a usage error (exit 2)
/// that names --yes.
fn confirm(plan: &ops::ResetPlan) -> anyhow::Result<bool> {
    use std::io::{BufRead, IsTerminal, Write};
    let what = format!(
        "split {} is now: {}. A reset starts it over from the beginning: every record of it is \
         emitted again, and a worker holding it is fenced.",
        plan.split, plan.current
    );
    if !std::io::stdin().is_terminal() {
        use clap::CommandFactory;
        Cli::command()
            .error(
                clap::error::ErrorKind::MissingRequiredArgument,
                format!(
                    "--reset needs confirmation and stdin is not a terminal: {what} Add --yes to go ahead."
                ),
            )
            .exit();
    }
    eprint!("{what}\nReset it? [y/N] ");
    std::io::stderr().flush()?;
    let mut answer = String::new();
    std::io::stdin().lock().read_line(&mut answer)?;
    Ok(matches!(answer.trim(), "y" | "Y" | "yes" | "YES" | "Yes"))
}

/// The NATS configuration `--store` and the `--nats-*` flags describe; `None` for `memory`.
fn nats_config(args: &StoreArgs) -> anyhow::Result<Option<etl_coordination_nats::NatsConfig>> {
    let r = args.resolve().map_err(|(flag, msg)| anyhow::anyhow!("{flag} {msg}"))?;
    if r.store == "memory" {
        return Ok(None);
    }
    let mut cfg = etl_coordination_nats::NatsConfig::new(r.store.clone());
    cfg.replicas = usize::from(args.nats_replicas);
    cfg.op_timeout = args.nats_op_timeout;
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

/// The job's stores, on the backend `--store` names.
async fn open_stores(args: &StoreArgs) -> anyhow::Result<JobStores<AnyStore>> {
    let job = JobName::new(args.job.clone())?;
    Ok(match nats_config(args)? {
        None => JobStores::memory(job).into_any(),
        Some(cfg) => JobStores::nats(&cfg, &job).await?.into_any(),
    })
}

async fn demo(a: DemoArgs) -> anyhow::Result<ExitCode> {
    let metrics = etl_coordination_metrics::install_prometheus().ok();
    let opts = DemoOptions {
        workers: a.workers,
        input: a.input,
        files: a.files,
        lines: a.lines,
        split_bytes: a.split_size,
        chaos: a.chaos,
        lease_duration: a.lease_duration,
        max_in_flight: a.max_in_flight,
        record_delay: Duration::from_millis(a.record_delay_ms.unwrap_or(if a.chaos { 1 } else { 0 })),
        seed: a.seed,
        progress: true,
    };
    println!(
        "etl-coord demo: {} workers on the in-memory store{}",
        opts.workers,
        if opts.chaos { ", with chaos (random kills and freezes)" } else { "" }
    );
    let s = run_demo(opts, metrics).await?;
    println!("splits:            {}", s.splits);
    println!("records in input:  {}", s.records);
    println!(
        "records emitted:   {} ({} replayed after takeovers)",
        s.emitted,
        s.emitted.saturating_sub(s.distinct)
    );
    println!(
        "acquisitions:      {}",
        s.acquisitions.iter().map(|(k, v)| format!("{k} {v}")).collect::<Vec<_>>().join(", ")
    );
    if s.kills + s.freezes > 0 {
        println!("chaos:             {} kills, {} freezes", s.kills, s.freezes);
    }
    println!("quarantined:       {}", s.quarantined);
    println!("wall time:         {:.2}s", s.wall.as_secs_f64());
    if s.missing.is_empty() {
        println!("no loss: every one of the {} input records was emitted at least once", s.records);
        Ok(ExitCode::SUCCESS)
    } else {
        println!("LOSS: records never emitted, e.g. {:?}", s.missing);
        Ok(ExitCode::from(1))
    }
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

async fn worker(a: WorkerArgs) -> anyhow::Result<ExitCode> {
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
    let mut config = DriverConfig::default();
    config.instance_id = default_instance_id(a.instance_id.clone())?;
    config.tuning = tuning(&a);
    config.on_stall = if a.on_stall == "warn" { OnStall::Warn } else { OnStall::Fatal };
    config.stay_after_end = a.on_complete == "wait";
    config.lane_stall_timeout = Some(a.lane_stall_timeout).filter(|t| !t.is_zero());
    config.on_lane_stall =
        if a.on_lane_stall == "release" { OnLaneStall::Release } else { OnLaneStall::Warn };
    let metrics = etl_coordination_metrics::install_prometheus()?;
    let handle = Pipeline::new(stores, Faulty { source, faults }, sink).config(config).start()?;
    let ready = Arc::new(AtomicBool::new(true));
    if let Some(addr) = a.admin_addr {
        let listener = tokio::net::TcpListener::bind(addr)
            .await
            .with_context(|| format!("binding the admin server to {addr}"))?;
        tokio::spawn(admin_server(listener, metrics, ready.clone()));
    }
    let drain = handle.clone();
    let ready_flag = ready.clone();
    // The listeners are installed once, before the first signal, so a second signal that comes
    // while the first is handled is not lost.
    let mut signals = ShutdownSignals::new()?;
    tokio::spawn(async move {
        signals.recv().await;
        ready_flag.store(false, Ordering::Relaxed);
        tracing::info!("termination signal: draining (a second one exits at once)");
        drain.drain();
        signals.recv().await;
        tracing::warn!(
            "second termination signal: exiting without finishing the drain (leases left behind expire \
             after --lease-duration; peers take the splits over then)"
        );
        std::process::exit(130);
    });
    match handle.outcome().await {
        Ok(JobOutcome::Complete) => {
            tracing::info!("job complete");
            Ok(ExitCode::SUCCESS)
        }
        Ok(JobOutcome::Drained) => Ok(ExitCode::from(a.exit_code_when_drained)),
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

/// SIGTERM and Ctrl-C (SIGINT), listened to from creation on.
struct ShutdownSignals {
    #[cfg(unix)]
    term: tokio::signal::unix::Signal,
    #[cfg(unix)]
    int: tokio::signal::unix::Signal,
}

impl ShutdownSignals {
    fn new() -> anyhow::Result<Self> {
        #[cfg(unix)]
        {
            use tokio::signal::unix::{SignalKind, signal};
            Ok(ShutdownSignals {
                term: signal(SignalKind::terminate()).context("listening for SIGTERM")?,
                int: signal(SignalKind::interrupt()).context("listening for SIGINT")?,
            })
        }
        #[cfg(not(unix))]
        Ok(ShutdownSignals {})
    }

    /// The next termination signal.
    async fn recv(&mut self) {
        #[cfg(unix)]
        tokio::select! {
            _ = self.term.recv() => {}
            _ = self.int.recv() => {}
        }
        #[cfg(not(unix))]
        let _ = tokio::signal::ctrl_c().await;
    }
}

/// The admin endpoints (axum on hyper: keep-alive, methods, and an accept loop that backs off
/// on errors such as running out of file descriptors): `GET /metrics` (Prometheus text),
/// `/healthz` (the process is alive), `/readyz` (503 once a drain has begun).
async fn admin_server(
    listener: tokio::net::TcpListener,
    metrics: etl_coordination_metrics::PrometheusHandle,
    ready: Arc<AtomicBool>,
) {
    use axum::http::{StatusCode, header};
    use axum::routing::get;
    let app = axum::Router::new()
        .route(
            "/metrics",
            get(move || {
                let metrics = metrics.clone();
                async move { ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], metrics.render()) }
            }),
        )
        .route("/healthz", get(|| async { "ok\n" }))
        .route(
            "/readyz",
            get(move || {
                let ready = ready.load(Ordering::Relaxed);
                async move {
                    if ready {
                        (StatusCode::OK, "ready\n")
                    } else {
                        (StatusCode::SERVICE_UNAVAILABLE, "draining\n")
                    }
                }
            }),
        );
    if let Err(e) = axum::serve(listener, app).await {
        tracing::error!(error = %e, "the admin server stopped");
    }
}

#[cfg(test)]
mod tests {
    use clap::CommandFactory;

    use super::Cli;

    /// Flags an operator gives for one run of a command: never read from the environment, so an
    /// ambient variable cannot pick the split a requeue rewrites.
    const ONE_SHOT: [&str; 10] =
        ["split", "reset", "yes", "state", "watch", "interval", "output", "json", "check", "create"];

    #[test]
    fn every_worker_and_store_flag_reads_etl_coord_and_its_name_and_one_shot_flags_read_nothing() {
        let cli = Cli::command();
        let mut checked = 0;
        for sub in ["worker", "status", "requeue", "nats-buckets"] {
            let cmd = cli.find_subcommand(sub).expect("subcommand");
            for arg in cmd.get_arguments() {
                let Some(long) = arg.get_long() else { continue };
                if ["help", "version", "verbose", "quiet"].contains(&long) || arg.is_hide_set() {
                    continue;
                }
                let env = arg.get_env().map(|e| e.to_string_lossy().into_owned());
                if ONE_SHOT.contains(&long) {
                    assert_eq!(env, None, "{sub} --{long} is one-shot: no environment variable");
                } else {
                    let expected = format!("ETL_COORD_{}", long.to_uppercase().replace('-', "_"));
                    assert_eq!(env.as_deref(), Some(expected.as_str()), "{sub} --{long}");
                }
                checked += 1;
            }
        }
        assert!(checked > 40, "only {checked} flags seen");
        // The demo reads nothing from the environment; nats-permissions only the job's name.
        for sub in ["demo", "nats-permissions"] {
            for arg in cli.find_subcommand(sub).expect("subcommand").get_arguments() {
                let long = arg.get_long().unwrap_or_default();
                if ["log-format", "color"].contains(&long) {
                    continue; // global flags, read by every subcommand
                }
                let env = arg.get_env().map(|e| e.to_string_lossy().into_owned());
                let expected =
                    (sub == "nats-permissions" && long == "job").then(|| "ETL_COORD_JOB".to_owned());
                assert_eq!(env, expected, "{sub} --{long}");
            }
        }
    }
}
