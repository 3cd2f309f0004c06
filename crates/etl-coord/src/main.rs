//! `etl-coord`: run, inspect and operate coordinated pipelines.
//!
//! Exit codes: 0 job complete (or drained), 3 job stalled on quarantined splits
//! (0 with `--on-stall warn`), 1 fatal error, 2 usage error.

mod cmd;

use std::process::ExitCode;

use clap::{Parser, Subcommand};

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
    /// The logs (-v, -q, --log-format, --color; the demo's default level is error).
    #[command(flatten)]
    logs: etl_coordination_runner::LogFlags,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Run a coordinated backfill with several in-process workers on the in-memory store, then
    /// check the output for loss.
    Demo(cmd::demo::DemoArgs),
    /// Run one replica of a coordinated pipeline (multi-process and Kubernetes use).
    #[command(after_help = AFTER_HELP)]
    Worker(Box<cmd::worker::WorkerArgs>),
    /// Show a job's plan, leader, live workers and every split.
    #[command(after_help = AFTER_HELP)]
    Status(cmd::status::StatusArgs),
    /// Return a quarantined split to the queue (attempts reset) after fixing its cause; with
    /// --reset, start any split over from the beginning (the repair for a record nobody can
    /// decode).
    #[command(after_help = AFTER_HELP)]
    Requeue(cmd::requeue::RequeueArgs),
    /// A job's settings: change its max_attempts while it runs, or move it to this release's
    /// protocol after an upgrade (docs/UPGRADES.md).
    #[command(after_help = AFTER_HELP)]
    Job(cmd::job::JobArgs),
    /// List the jobs a NATS account holds: each job's buckets, whether a worker has started
    /// it, and what its state bucket holds. Reads only.
    #[command(after_help = AFTER_HELP)]
    Jobs(cmd::jobs::JobsArgs),
    /// Print the NATS permissions a job's clients need, to paste into the server's
    /// authorization block (or JSON).
    NatsPermissions(cmd::nats::NatsPermissionsArgs),
    /// Print a job's NATS account (its users, their permissions, JetStream limits), to paste
    /// into the server's accounts block: the boundary that isolates jobs from each other.
    NatsAccount(cmd::nats::NatsAccountArgs),
    /// Create a job's NATS buckets if missing and check their configuration (an operator's
    /// set-up step, so that workers need no permission to create them).
    #[command(after_help = AFTER_HELP)]
    NatsBuckets(cmd::nats::NatsBucketsArgs),
}

/// Checks what one flag's parser cannot: values against each other and the environment's
/// fallbacks. Exits 2 (a usage error naming the flag) on the first problem.
fn validate(cli: &Cli) {
    let checked = match &cli.command {
        Command::Worker(a) => a.validate(),
        Command::Demo(a) => a.validate(),
        Command::Status(a) => a.validate(),
        Command::Requeue(a) => a.validate(),
        Command::Job(a) => a.validate(),
        Command::Jobs(a) => a.validate(),
        Command::NatsBuckets(a) => a.validate(),
        Command::NatsPermissions(_) | Command::NatsAccount(_) => Ok(()),
    };
    if let Err(u) = checked {
        exit_usage(clap::error::ErrorKind::ValueValidation, format!("{} {}", u.flag, u.msg));
    }
}

/// Exits 2 with clap's usage error.
pub(crate) fn exit_usage(kind: clap::error::ErrorKind, msg: String) -> ! {
    use clap::CommandFactory;
    Cli::command().error(kind, msg).exit()
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
    let json = cli.logs.json();
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

/// Logs go through tracing only, to stderr (the runner's [`LogFlags`](etl_coordination_runner::LogFlags)):
/// info by default, error for the demo, whose takeovers and revocations are expected.
fn init_logging(cli: &Cli) {
    cli.logs.init(if matches!(cli.command, Command::Demo(_)) { 0 } else { 2 });
}

async fn run(cli: Cli) -> anyhow::Result<ExitCode> {
    match cli.command {
        Command::Demo(a) => cmd::demo::run(a).await,
        Command::Worker(a) => cmd::worker::run(*a).await,
        Command::Status(a) => cmd::status::run(a).await,
        Command::NatsPermissions(a) => cmd::nats::permissions(a),
        Command::NatsAccount(a) => cmd::nats::account(a),
        Command::NatsBuckets(a) => cmd::nats::buckets(a).await,
        Command::Requeue(a) => cmd::requeue::run(a).await,
        Command::Job(a) => cmd::job::run(a).await,
        Command::Jobs(a) => cmd::jobs::run(a).await,
    }
}

#[cfg(test)]
mod tests {
    use clap::CommandFactory;

    use super::Cli;

    /// Flags an operator gives for one run of a command: never read from the environment, so an
    /// ambient variable cannot pick the split a requeue rewrites.
    const ONE_SHOT: [&str; 12] = [
        "split",
        "reset",
        "yes",
        "state",
        "error-contains",
        "dry-run",
        "watch",
        "interval",
        "output",
        "json",
        "check",
        "create",
    ];

    #[test]
    fn every_worker_and_store_flag_reads_etl_coord_and_its_name_and_one_shot_flags_read_nothing() {
        let cli = Cli::command();
        let mut checked = 0;
        for sub in ["worker", "status", "requeue", "nats-buckets", "jobs"] {
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
