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
use etl_coord::runner::{RunOptions, run_lane};
use etl_coord::sink::JsonlSink;
use etl_coord::sources::AnySource;
use etl_coord::sources::files::DEFAULT_SPLIT_BYTES;
use etl_coord::sources::sqlite::DEFAULT_SPLIT_ROWS;
use etl_coordination_driver::{
    CoordinationDriver, DriverConfig, DriverError, InstanceId, JobOutcome, JobStores, OnStall, SplitId,
    Tuning,
};
use etl_coordination_memory::MemoryStore;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

#[derive(Parser, Debug)]
#[command(name = "etl-coord", version, about = "Coordinated scale-out for broker-less sources")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Run a coordinated backfill with several in-process workers on the in-memory store, then
    /// check the output for loss.
    Demo(DemoArgs),
    /// Run one replica of a coordinated pipeline (multi-process and Kubernetes use).
    Worker(Box<WorkerArgs>),
    /// Show a job's plan, leader, live workers and every split.
    Status(StatusArgs),
    /// Return a quarantined split to the queue (attempts reset) after fixing its cause.
    Requeue(RequeueArgs),
    /// Print the NATS permissions a job's clients need, to paste into the server's
    /// authorization block (or JSON).
    NatsPermissions(NatsPermissionsArgs),
    /// Create a job's NATS buckets if missing and check their configuration (an operator's
    /// set-up step, so that workers need no permission to create them).
    NatsBuckets(NatsBucketsArgs),
}

#[derive(clap::Args, Debug)]
struct NatsPermissionsArgs {
    /// Job name.
    #[arg(long)]
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
    #[arg(long, default_value = "ETL_COORD_NATS_PASSWORD")]
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
    #[arg(long)]
    job: String,
    /// `memory` (a single standalone instance) or `nats://HOST:PORT` (comma-separate several).
    #[arg(long, default_value = "memory")]
    store: String,
    /// NATS: bucket replicas (3 on a production cluster).
    #[arg(long, default_value_t = 1)]
    nats_replicas: usize,
    /// NATS: a credentials (.creds) file.
    #[arg(long, env = "NATS_CREDS", conflicts_with_all = ["nats_token", "nats_user"])]
    nats_creds: Option<PathBuf>,
    /// NATS: an authentication token.
    #[arg(long, env = "NATS_TOKEN", hide_env_values = true, conflicts_with = "nats_user")]
    nats_token: Option<String>,
    /// NATS: a user name (with --nats-password).
    #[arg(long, env = "NATS_USER", requires = "nats_password")]
    nats_user: Option<String>,
    /// NATS: the user's password (better given by the environment than on the command line).
    #[arg(long, env = "NATS_PASSWORD", hide_env_values = true, requires = "nats_user")]
    nats_password: Option<String>,
    /// NATS: require TLS.
    #[arg(long)]
    nats_tls: bool,
    /// NATS: a PEM file of the certificate authority that signed the servers' certificates
    /// (implies --nats-tls).
    #[arg(long, env = "NATS_TLS_CA")]
    nats_tls_ca: Option<PathBuf>,
    /// NATS: timeout of one request.
    #[arg(long, default_value = "5s", value_parser = parse_duration)]
    nats_op_timeout: Duration,
}

#[derive(clap::Args, Debug)]
struct WorkerArgs {
    #[command(flatten)]
    store: StoreArgs,
    /// `files:DIR` or `sqlite:PATH:TABLE`.
    #[arg(long)]
    source: String,
    /// JSON Lines output, one line per emitted record.
    #[arg(long)]
    sink: Option<PathBuf>,
    /// Stable instance id (default: env POD_NAME with dots replaced, else random).
    #[arg(long, env = "ETL_COORD_INSTANCE_ID")]
    instance_id: Option<String>,
    /// Lease duration (whole seconds).
    #[arg(long, default_value = "30s", value_parser = parse_duration)]
    lease_duration: Duration,
    /// Splits held (and lanes run) at once.
    #[arg(long, default_value_t = 8)]
    max_in_flight: u32,
    /// Failing tenancies before a split is quarantined.
    #[arg(long, default_value_t = 4)]
    max_attempts: u32,
    /// How often the leader re-runs an open plan.
    #[arg(long, default_value = "60s", value_parser = parse_duration)]
    replan_interval: Duration,
    /// How long lanes get to commit on SIGTERM before their splits are released.
    #[arg(long, default_value = "30s", value_parser = parse_duration)]
    drain_timeout: Duration,
    /// How long the leader waits for the planner (listing the input) before counting the call
    /// as failed and retrying it after a backoff.
    #[arg(long, default_value = "10m", value_parser = parse_duration)]
    plan_timeout: Duration,
    /// What a stalled job (quarantined splits) means: fatal (exit 3) or warn (exit 0).
    #[arg(long, default_value = "fatal", value_parser = ["fatal", "warn"])]
    on_stall: String,
    /// After the job ends (complete, or stalled with on-stall warn): exit 0, or keep serving the
    /// admin endpoints until SIGTERM (for a Kubernetes Deployment, which restarts exited pods).
    #[arg(long, default_value = "exit", value_parser = ["exit", "wait"])]
    on_complete: String,
    /// Files source: target bytes per split.
    #[arg(long, default_value_t = DEFAULT_SPLIT_BYTES)]
    split_size: u64,
    /// SQLite source: rows per split.
    #[arg(long, default_value_t = DEFAULT_SPLIT_ROWS)]
    split_rows: u64,
    /// Serve /metrics, /healthz and /readyz on this address.
    #[arg(long)]
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
}

#[derive(clap::Args, Debug)]
struct StatusArgs {
    #[command(flatten)]
    store: StoreArgs,
    /// Print JSON instead of a table.
    #[arg(long)]
    json: bool,
}

#[derive(clap::Args, Debug)]
struct RequeueArgs {
    #[command(flatten)]
    store: StoreArgs,
    /// The quarantined split's id.
    #[arg(long)]
    split: String,
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
    // The demo's takeovers and revocations are expected; show only errors there by default.
    let default_filter = if matches!(cli.command, Command::Demo(_)) { "error" } else { "warn" };
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| default_filter.into()),
        )
        .init();
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build().expect("tokio runtime");
    match rt.block_on(run(cli)) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::from(1)
        }
    }
}

async fn run(cli: Cli) -> anyhow::Result<ExitCode> {
    match cli.command {
        Command::Demo(a) => demo(a).await,
        Command::Worker(a) => worker(*a).await,
        Command::Status(a) => {
            let s = match open_stores(&a.store).await? {
                Stores::Memory(st) => ops::status(&st).await?,
                Stores::Nats(st) => ops::status(&*st).await?,
            };
            if a.json {
                println!("{}", serde_json::to_string_pretty(&s)?);
            } else {
                print!("{}", ops::render(&s));
            }
            Ok(ExitCode::SUCCESS)
        }
        Command::NatsPermissions(a) => {
            let job = etl_coordination_core::JobName::new(a.job.clone())?;
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
                bail!("--store {:?}: nats-buckets needs a nats:// URL", a.store.store);
            };
            cfg.create_buckets = !a.check;
            let job = etl_coordination_core::JobName::new(a.store.job.clone())?;
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
            match open_stores(&a.store).await? {
                Stores::Memory(st) => ops::requeue(&st, &split).await?,
                Stores::Nats(st) => ops::requeue(&*st, &split).await?,
            }
            println!("split {split} requeued: attempts reset, offered to workers again");
            Ok(ExitCode::SUCCESS)
        }
    }
}

/// The job's stores, on the backend `--store` names.
enum Stores {
    Memory(JobStores<MemoryStore>),
    Nats(Box<JobStores<etl_coordination_nats::NatsStore>>),
}

/// The NATS configuration `--store` and the `--nats-*` flags describe; `None` for `memory`.
fn nats_config(args: &StoreArgs) -> anyhow::Result<Option<etl_coordination_nats::NatsConfig>> {
    let url = args.store.as_str();
    if url == "memory" {
        return Ok(None);
    }
    if !(url.starts_with("nats://") || url.starts_with("tls://")) {
        bail!("--store {url:?}: expected `memory` or nats://HOST:PORT");
    }
    let mut cfg = etl_coordination_nats::NatsConfig::new(url);
    cfg.replicas = args.nats_replicas;
    cfg.op_timeout = args.nats_op_timeout;
    cfg.tls_required = args.nats_tls || args.nats_tls_ca.is_some() || url.starts_with("tls://");
    cfg.tls_root_certificate = args.nats_tls_ca.clone();
    if let Some(t) = &args.nats_token {
        cfg.auth = etl_coordination_nats::NatsAuth::Token(t.clone());
    }
    if let (Some(u), Some(p)) = (&args.nats_user, &args.nats_password) {
        cfg.auth = etl_coordination_nats::NatsAuth::UserPassword(u.clone(), p.clone());
    }
    if let Some(c) = &args.nats_creds {
        cfg.auth = etl_coordination_nats::NatsAuth::CredentialsFile(c.clone());
    }
    Ok(Some(cfg))
}

async fn open_stores(args: &StoreArgs) -> anyhow::Result<Stores> {
    let job = etl_coordination_core::JobName::new(args.job.clone())?;
    match nats_config(args)? {
        None => Ok(Stores::Memory(JobStores { state: MemoryStore::new(), lease: MemoryStore::new() })),
        Some(cfg) => {
            let job = etl_coordination_nats::connect(&cfg, &job).await?;
            Ok(Stores::Nats(Box::new(JobStores { state: job.state, lease: job.lease })))
        }
    }
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
    match open_stores(&a.store).await? {
        Stores::Memory(st) => worker_on(st, a).await,
        Stores::Nats(st) => worker_on(*st, a).await,
    }
}

async fn worker_on<S: etl_coordination_store::Store>(
    stores: JobStores<S>,
    a: WorkerArgs,
) -> anyhow::Result<ExitCode> {
    let source = AnySource::open(&a.source, a.split_size, a.split_rows)?;
    let sink = match &a.sink {
        Some(p) => JsonlSink::open(p).with_context(|| format!("opening the sink {}", p.display()))?,
        None => JsonlSink::discard(),
    };
    let config = DriverConfig {
        job: a.store.job.clone(),
        instance_id: default_instance_id(a.instance_id)?,
        tuning: Tuning {
            lease_duration: a.lease_duration,
            max_in_flight: a.max_in_flight,
            max_attempts: a.max_attempts,
            replan_interval: a.replan_interval,
            drain_timeout: a.drain_timeout,
            plan_timeout: a.plan_timeout,
        },
        on_stall: if a.on_stall == "warn" { OnStall::Warn } else { OnStall::Fatal },
        ..DriverConfig::default()
    };
    let metrics = etl_coordination_metrics::install_prometheus()?;
    let (handle, mut lanes) = CoordinationDriver::start(stores, source.clone(), config)?;
    let instance = handle.instance_id().to_string();
    let ready = Arc::new(AtomicBool::new(true));
    if let Some(addr) = a.admin_addr {
        let listener = tokio::net::TcpListener::bind(addr)
            .await
            .with_context(|| format!("binding the admin server to {addr}"))?;
        tokio::spawn(admin_server(listener, metrics, ready.clone()));
    }
    let drain = handle.clone();
    let ready_flag = ready.clone();
    let (terminated_tx, mut terminated) = tokio::sync::watch::channel(false);
    tokio::spawn(async move {
        shutdown_signal().await;
        ready_flag.store(false, Ordering::Relaxed);
        eprintln!("termination signal: draining");
        drain.drain();
        let _ = terminated_tx.send(true);
    });
    let opts = RunOptions {
        instance: instance.clone(),
        record_delay: Duration::from_millis(a.record_delay_ms),
        poison_marker: a.poison_marker,
        unprocessable_marker: a.unprocessable_marker,
        ..RunOptions::default()
    };
    tokio::spawn(async move {
        while let Some(lane) = lanes.next().await {
            match source.reader(lane.descriptor(), lane.resume_from()) {
                Ok(reader) => {
                    tokio::spawn(run_lane(lane, reader, sink.clone(), opts.clone()));
                }
                Err(e) => lane.unprocessable(format!("{e:#}")),
            }
        }
    });
    let ended = match handle.outcome().await {
        Ok(JobOutcome::Complete) => {
            eprintln!("job complete");
            true
        }
        Ok(JobOutcome::Drained) => false,
        Ok(JobOutcome::Stalled { quarantined }) => {
            eprintln!("job stalled (on-stall warn): {} quarantined split(s)", quarantined.len());
            true
        }
        Err(e @ DriverError::Stalled { .. }) => {
            eprintln!("error: {e}");
            return Ok(ExitCode::from(3));
        }
        Err(e) => return Err(e.into()),
    };
    if ended && a.on_complete == "wait" {
        eprintln!("job ended; serving the admin endpoints until a termination signal (--on-complete wait)");
        let _ = terminated.wait_for(|t| *t).await;
    }
    Ok(ExitCode::SUCCESS)
}

async fn shutdown_signal() {
    #[cfg(unix)]
    {
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
            .expect("signal handler");
        tokio::select! {
            _ = term.recv() => {}
            _ = tokio::signal::ctrl_c() => {}
        }
    }
    #[cfg(not(unix))]
    let _ = tokio::signal::ctrl_c().await;
}

/// A minimal HTTP/1.1 server for /metrics, /healthz and /readyz.
async fn admin_server(
    listener: tokio::net::TcpListener,
    metrics: etl_coordination_metrics::PrometheusHandle,
    ready: Arc<AtomicBool>,
) {
    loop {
        let Ok((mut sock, _)) = listener.accept().await else { continue };
        let metrics = metrics.clone();
        let ready = ready.clone();
        tokio::spawn(async move {
            // Read the whole request head (closing with unread bytes would reset the connection).
            let mut buf = Vec::with_capacity(1024);
            let mut chunk = [0u8; 1024];
            while !buf.windows(4).any(|w| w == b"\r\n\r\n") && buf.len() < 16 * 1024 {
                match tokio::time::timeout(Duration::from_secs(5), sock.read(&mut chunk)).await {
                    Ok(Ok(n)) if n > 0 => buf.extend_from_slice(&chunk[..n]),
                    _ => break,
                }
            }
            let req = String::from_utf8_lossy(&buf);
            let path = req.split_whitespace().nth(1).unwrap_or("/");
            let (status, ctype, body) = match path {
                "/metrics" => ("200 OK", "text/plain; version=0.0.4", metrics.render()),
                "/healthz" => ("200 OK", "text/plain", "ok\n".to_owned()),
                "/readyz" if ready.load(Ordering::Relaxed) => ("200 OK", "text/plain", "ready\n".to_owned()),
                "/readyz" => ("503 Service Unavailable", "text/plain", "draining\n".to_owned()),
                _ => ("404 Not Found", "text/plain", "not found\n".to_owned()),
            };
            let resp = format!(
                "HTTP/1.1 {status}\r\nContent-Type: {ctype}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                body.len()
            );
            let _ = sock.write_all(resp.as_bytes()).await;
            let _ = sock.shutdown().await;
        });
    }
}
