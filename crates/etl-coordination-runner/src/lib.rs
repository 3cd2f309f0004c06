//! Runs an embedded pipeline the way `etl-coord worker` runs: one call gives a program of your
//! own the command's operational behaviour, so that the deployment files, alert rules and
//! runbooks written for the command fit it too.
//!
//! - **Configuration** from flags and the environment, with the command's names:
//!   [`WorkerFlags`] (`--job`, `--store`, `--lease-duration`, ..., each also
//!   `ETL_COORD_<FLAG>`; the NATS CLI's `NATS_URL`, `NATS_CREDS`, ... when unset; `POD_NAME`
//!   for the instance id), checked before anything connects: a bad value exits 2 naming the
//!   flag.
//! - **Signals**: the first SIGTERM or SIGINT drains (lanes commit, splits are released, no
//!   attempt is consumed) and makes `/readyz` answer 503; a second one exits at once with 130.
//! - **The admin server** (`--admin-addr`): `/metrics` (Prometheus), `/healthz`, `/readyz`.
//! - **Exit codes**: 0 complete (or drained, or stalled with `--on-stall warn`), 3 stalled on
//!   quarantined splits, 1 a fatal error (the message says what to do), 2 a usage error, 130 a
//!   second signal; `--exit-code-when-drained` for a drained worker.
//! - **Logs** ([`LogFlags`]): stderr, `-v`/`-q`, `RUST_LOG`, `--log-format json`.
//!
//! [`main`] is the whole program's `main`; [`WorkerFlags::run`] is the part after parsing, for
//! a program with commands of its own (`etl-coord` is one). A program of its own flags and a
//! source and sink (from `examples/runner.rs` in the repository):
//!
//! ```no_run
//! # use etl_coordination_driver::prelude::*;
//! # #[derive(Clone)] struct Numbers;
//! # impl Planner for Numbers {
//! #     fn fingerprint(&self) -> String { "numbers/v1".into() }
//! #     async fn plan(&self) -> Result<Plan, PlanError> { Ok(Plan::new(PlanKind::Final, Vec::new())) }
//! # }
//! # struct Reader;
//! # impl SplitReader for Reader {
//! #     type Record = u64; type Progress = u64;
//! #     async fn next(&mut self) -> NextRecord<u64, u64> { Ok(None) }
//! # }
//! # impl Source for Numbers {
//! #     type Record = u64; type Progress = u64; type Reader = Reader;
//! #     async fn open(&self, _: &LaneInfo, _: Option<u64>) -> Result<Reader, SourceError> { Ok(Reader) }
//! # }
//! # impl Numbers { fn up_to(_: u64) -> Self { Numbers } }
//! # struct Discard;
//! # impl Sink<u64> for Discard {
//! #     type Writer = Discard;
//! #     async fn open(&self, _: &LaneInfo) -> Result<Discard, SinkError> { Ok(Discard) }
//! # }
//! # impl SinkWriter<u64> for Discard {
//! #     async fn write(&mut self, _: u64) -> Result<(), SinkError> { Ok(()) }
//! #     async fn flush(&mut self) -> Result<(), SinkError> { Ok(()) }
//! # }
//! /// The program's own flags, beside the runner's.
//! #[derive(clap::Args, Debug)]
//! struct Input {
//!     /// How many numbers to read.
//!     #[arg(long, env = "NUMBERS", default_value_t = 1000)]
//!     numbers: u64,
//! }
//!
//! fn main() -> std::process::ExitCode {
//!     etl_coordination_runner::main(|input: Input| async move { Ok((Numbers::up_to(input.numbers), Discard)) })
//! }
//! ```

mod admin;
mod flags;
mod signals;

use std::future::Future;
use std::net::SocketAddr;
use std::process::ExitCode;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use etl_coordination_driver::{
    AnyStore, DriverConfig, DriverError, DriverHandle, JobOutcome, JobStores, Pipeline, Sink, Source,
};

pub use flags::{
    ConnectFlags, LogFlags, StoreFlags, Usage, WorkerFlags, nats_config, open_job, open_stores, parse_bytes,
    parse_duration, parse_instance, parse_job, parse_split, positive, tuning_error,
};

/// An error of the program's own, from building its source or sink.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Why a worker could not run (each says what to do; exit 1, or 2 for a usage error).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RunError {
    /// A flag's value is wrong (exit 2).
    #[error(transparent)]
    Usage(#[from] Usage),
    /// The job's store could not be opened or checked (a server too old, a divergent
    /// configuration, missing permissions: the message says which).
    #[error(transparent)]
    Store(etl_coordination_core::StoreError),
    /// The worker stopped on a fatal condition.
    #[error(transparent)]
    Driver(#[from] DriverError),
    /// The admin server's address cannot be bound.
    #[error("binding the admin server to {addr}")]
    Admin {
        /// `--admin-addr`.
        addr: SocketAddr,
        /// Why not.
        #[source]
        source: std::io::Error,
    },
    /// The Prometheus recorder cannot be installed (another metrics recorder is).
    #[error(transparent)]
    Metrics(#[from] etl_coordination_metrics::InstallError),
    /// The termination signals cannot be listened for.
    #[error("listening for termination signals")]
    Signals(#[source] std::io::Error),
    /// The program's source or sink could not be made.
    #[error("building the pipeline")]
    Build(#[source] BoxError),
    /// A command that reads or repairs a job was given one that does not exist (nothing was
    /// created).
    #[error("no job {job} at {store}: {why}")]
    NoSuchJob {
        /// The job asked for.
        job: etl_coordination_core::JobName,
        /// Where it was looked for.
        store: String,
        /// What was found instead, and what to do.
        why: String,
    },
    /// The driver is newer than this runner and ended with an outcome it does not know: not
    /// a success to claim.
    #[error("the job ended with an outcome this runner does not know: {0:?}")]
    UnknownOutcome(JobOutcome),
}

impl WorkerFlags {
    /// Runs one worker to its end as `etl-coord worker` does: opens the job's stores, makes the
    /// pipeline with `pipeline(stores, config)` (set the dead-letter sink or the commit cadence
    /// there), installs the Prometheus recorder, serves the admin endpoints if
    /// `--admin-addr` is set, drains on the first termination signal and exits 130 on the
    /// second, and returns the exit code of the job's outcome. Call [`WorkerFlags::validate`]
    /// first, and set up logging ([`LogFlags::init`]).
    pub async fn run<So, Si>(
        &self,
        pipeline: impl FnOnce(JobStores<AnyStore>, DriverConfig) -> Pipeline<AnyStore, So, Si>,
    ) -> Result<ExitCode, RunError>
    where
        So: Source,
        Si: Sink<So::Record>,
    {
        // Listening from the start: a worker told to stop while it connects (a rollout, a scale
        // down) exits as drained, having held nothing, instead of dying of the signal.
        let mut signals = signals::ShutdownSignals::new().map_err(RunError::Signals)?;
        let stores = tokio::select! {
            stores = open_stores(&self.store) => stores?,
            () = signals.recv() => {
                tracing::info!("termination signal while starting: exiting before taking any split");
                return Ok(ExitCode::from(self.exit_code_when_drained));
            }
        };
        let config = self.driver_config()?;
        let t = &config.tuning;
        if let Some(wait) = t.handover_wait().filter(|w| *w < t.handover_timeout) {
            tracing::info!(
                handover_timeout = ?t.handover_timeout,
                effective = ?wait,
                lease_duration = ?t.lease_duration,
                "handover timeout capped at a third of the lease: an owner asked for a split gets this long to hand it over"
            );
        }
        let metrics = etl_coordination_metrics::install_prometheus()?;
        let handle = pipeline(stores, config).start()?;
        let ready = Arc::new(AtomicBool::new(true));
        if let Some(addr) = self.admin_addr {
            let listener = tokio::net::TcpListener::bind(addr)
                .await
                .map_err(|source| RunError::Admin { addr, source })?;
            tokio::spawn(admin::admin_server(listener, metrics, ready.clone()));
        }
        drain_on_signals(handle.clone(), ready, signals);
        exit_code(handle.outcome().await, self.exit_code_when_drained)
    }
}

/// The first termination signal drains the worker (and makes `/readyz` say so); the second
/// exits at once with 130.
fn drain_on_signals(handle: DriverHandle, ready: Arc<AtomicBool>, mut signals: signals::ShutdownSignals) {
    // The listeners were installed once, before the first signal, so a second signal that
    // comes while the first is handled is not lost.
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
}

/// The process's exit code for the job's outcome: 0 complete, `when_drained` drained, 0
/// stalled with `--on-stall warn`, 3 stalled; a fatal error is returned (exit 1).
pub fn exit_code(outcome: Result<JobOutcome, DriverError>, when_drained: u8) -> Result<ExitCode, RunError> {
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
        Ok(other) => Err(RunError::UnknownOutcome(other)),
        Err(e) => Err(e.into()),
    }
}

/// The command line of an embedded worker ([`main`]): the runner's flags and the program's own.
#[derive(clap::Parser, Debug)]
#[command(after_help = flags::AFTER_HELP)]
#[non_exhaustive]
pub struct Command<A: clap::Args> {
    /// The worker's flags.
    #[command(flatten)]
    pub worker: WorkerFlags,
    /// The logs' flags.
    #[command(flatten)]
    pub logs: LogFlags,
    /// The program's own flags.
    #[command(flatten)]
    pub app: A,
}

/// The whole `main` of an embedded worker: parses the command line (and the environment) into
/// the runner's flags and the program's own `A` (exit 2 naming the flag when one is wrong),
/// sets up logging, starts a multi-threaded tokio runtime, makes the source and sink with
/// `build`, and runs the worker ([`WorkerFlags::run`]). Returns the process's exit code; a
/// fatal error is printed first (a `fatal` log line with `--log-format json`).
pub fn main<A, F, Fut, So, Si>(build: F) -> ExitCode
where
    A: clap::Args,
    F: FnOnce(A) -> Fut,
    Fut: Future<Output = Result<(So, Si), BoxError>>,
    So: Source,
    Si: Sink<So::Record>,
{
    use clap::{CommandFactory, FromArgMatches};
    // Named after the program, not after this crate.
    let program = std::env::args_os()
        .next()
        .and_then(|a| std::path::Path::new(&a).file_stem().map(|s| s.to_string_lossy().into_owned()))
        .unwrap_or_else(|| "worker".into());
    let mut command = Command::<A>::command().bin_name(program);
    let parsed = command
        .try_get_matches_from_mut(std::env::args_os())
        .and_then(|m| Command::<A>::from_arg_matches(&m));
    let cmd = match parsed {
        Ok(c) => c,
        Err(e) => {
            let e = e.format(&mut command);
            let _ = e.print();
            return ExitCode::from(if e.use_stderr() { 2 } else { 0 });
        }
    };
    if let Err(u) = cmd.worker.validate() {
        command.error(clap::error::ErrorKind::ValueValidation, u.to_string()).exit();
    }
    cmd.logs.init(2);
    let json = cmd.logs.json();
    let rt = match tokio::runtime::Builder::new_multi_thread().enable_all().build() {
        Ok(rt) => rt,
        Err(e) => return report(Err(RunError::Signals(e)), json),
    };
    let Command { worker, app, .. } = cmd;
    let result = rt.block_on(async move {
        let (source, sink) = build(app).await.map_err(RunError::Build)?;
        worker.run(|stores, config| Pipeline::new(stores, source, sink).config(config)).await
    });
    report(result, json)
}

/// The exit code of a run, its error (if any) reported first with the chain of its causes: as
/// a `fatal` log line when logs are JSON, else as `error: ...` on stderr. A usage error exits
/// 2, any other error 1.
pub fn report(result: Result<ExitCode, RunError>, json: bool) -> ExitCode {
    let e = match result {
        Ok(code) => return code,
        Err(e) => e,
    };
    let mut message = e.to_string();
    let mut cause = std::error::Error::source(&e);
    while let Some(c) = cause {
        message.push_str(": ");
        message.push_str(&c.to_string());
        cause = c.source();
    }
    if json {
        tracing::error!(error = %message, "fatal");
    } else {
        eprintln!("error: {message}");
    }
    ExitCode::from(if matches!(e, RunError::Usage(_)) { 2 } else { 1 })
}

#[cfg(test)]
mod tests {
    use clap::Parser;
    use etl_coordination_driver::SplitId;

    use super::*;

    /// A program's own flags.
    #[derive(clap::Args, Debug)]
    struct Own {
        #[arg(long, default_value = "in")]
        input: String,
    }

    fn parse(args: &[&str]) -> Result<Command<Own>, clap::Error> {
        Command::<Own>::try_parse_from(["w", "--job", "orders", "--store", "memory"].iter().chain(args))
    }

    #[test]
    fn the_flags_are_the_commands_with_its_defaults_beside_the_programs_own() {
        let cmd =
            parse(&["--lease-duration", "5s", "--input", "dir", "--on-bad-record", "skip", "-v"]).unwrap();
        assert_eq!(cmd.app.input, "dir");
        assert_eq!(cmd.logs.verbose, 1);
        cmd.worker.validate().unwrap();
        let config = cmd.worker.driver_config().unwrap();
        assert_eq!(config.tuning.lease_duration, std::time::Duration::from_secs(5));
        assert_eq!(config.tuning.max_in_flight, 8, "the command's default");
        assert!(matches!(config.on_bad_record, etl_coordination_driver::OnBadRecord::Skip { .. }));
    }

    #[test]
    fn a_bad_value_is_a_usage_error_naming_its_flag() {
        let cmd = parse(&["--max-in-flight", "0"]).unwrap();
        assert_eq!(cmd.worker.validate().unwrap_err().flag, "--max-in-flight");
        let cmd = parse(&["--lane-stall-timeout", "500ms"]).unwrap();
        assert_eq!(cmd.worker.validate().unwrap_err().flag, "--lane-stall-timeout");
        let err = parse(&["--lease-duration", "soon"]).unwrap_err();
        assert!(err.to_string().contains("--lease-duration"), "{err}");
        let cmd = Command::<Own>::try_parse_from(["w", "--job", "orders", "--store", "redis://x"]).unwrap();
        assert_eq!(cmd.worker.validate().unwrap_err().flag, "--store");
    }

    #[test]
    fn outcomes_map_to_the_commands_exit_codes() {
        let quarantined = vec![(SplitId::new("s1").unwrap(), Some("bad".into()))];
        let code = |o, drained| exit_code(o, drained).unwrap();
        assert_eq!(code(Ok(JobOutcome::Complete), 7), ExitCode::SUCCESS);
        assert_eq!(code(Ok(JobOutcome::Drained), 143), ExitCode::from(143));
        assert_eq!(code(Ok(JobOutcome::Stalled { quarantined: quarantined.clone() }), 0), ExitCode::SUCCESS);
        assert_eq!(code(Err(DriverError::Stalled { quarantined }), 0), ExitCode::from(3));
        assert!(matches!(exit_code(Err(DriverError::Killed), 0), Err(RunError::Driver(_))));
    }

    #[test]
    fn an_error_exits_1_and_a_usage_error_2() {
        assert_eq!(report(Err(RunError::Driver(DriverError::Killed)), false), ExitCode::from(1));
        assert_eq!(report(Err(Usage::new("--job", "is wrong").into()), true), ExitCode::from(2));
        assert_eq!(report(Ok(ExitCode::from(3)), false), ExitCode::from(3));
    }
}
