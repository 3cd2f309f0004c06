//! `etl-coord job`: the settings a job keeps in its `meta` (`set-max-attempts`) and moving a
//! job to this release's protocol (`migrate`).

use std::process::ExitCode;

use etl_coord::job::{self, Migration};
use etl_coordination_core::MAX_ATTEMPTS_LIMIT;

use super::{StoreArgs, Usage, open_job};

#[derive(clap::Args, Debug)]
pub(crate) struct JobArgs {
    #[command(subcommand)]
    pub(crate) command: JobCommand,
}

#[derive(clap::Subcommand, Debug)]
pub(crate) enum JobCommand {
    /// Change the job's max_attempts (failing tenancies before a split is quarantined):
    /// workers started from now use it, running ones within ten lease durations. The workers'
    /// --max-attempts only sets it for a new job.
    SetMaxAttempts(SetMaxAttemptsArgs),
    /// Move a job started by the previous release to this release's protocol, keeping its
    /// plan and progress. Stop every worker of the previous release first (the command
    /// refuses while any lease is live).
    Migrate(MigrateArgs),
}

#[derive(clap::Args, Debug)]
pub(crate) struct SetMaxAttemptsArgs {
    #[command(flatten)]
    pub(crate) store: StoreArgs,
    /// The new value (1 to 1000).
    #[arg(value_parser = clap::value_parser!(u32).range(1..=MAX_ATTEMPTS_LIMIT as i64))]
    pub(crate) max_attempts: u32,
}

#[derive(clap::Args, Debug)]
pub(crate) struct MigrateArgs {
    #[command(flatten)]
    pub(crate) store: StoreArgs,
}

impl JobArgs {
    /// What one flag's parser cannot check.
    pub(crate) fn validate(&self) -> Result<(), Usage> {
        match &self.command {
            JobCommand::SetMaxAttempts(a) => a.store.validate(),
            JobCommand::Migrate(a) => a.store.validate(),
        }
    }
}

pub(crate) async fn run(a: JobArgs) -> anyhow::Result<ExitCode> {
    match a.command {
        JobCommand::SetMaxAttempts(a) => {
            let stores = open_job(&a.store).await?;
            let change = job::set_max_attempts(&stores, a.max_attempts).await?;
            if change.before == change.after {
                println!("job {}: max_attempts is {} already; nothing changed", stores.job, change.after);
            } else {
                println!(
                    "job {}: max_attempts {} -> {}; workers started from now use it, running workers \
                     within ten lease durations (their next resync); quarantined splits stay so \
                     (`etl-coord requeue --state quarantined`)",
                    stores.job, change.before, change.after
                );
            }
        }
        JobCommand::Migrate(a) => {
            let stores = open_job(&a.store).await?;
            match job::migrate(&stores).await? {
                Migration::AlreadyCurrent => {
                    println!("job {} runs this release's protocol already; nothing changed", stores.job)
                }
                Migration::Moved { from, to, rewritten, kept } if from == to => println!(
                    "job {}: {rewritten} records of an earlier format rewritten ({kept} already current)",
                    stores.job
                ),
                Migration::Moved { from, to, rewritten, kept } => println!(
                    "job {}: moved from protocol {from} to {to} ({rewritten} records rewritten, {kept} \
                     already current); start this release's workers",
                    stores.job
                ),
            }
        }
    }
    Ok(ExitCode::SUCCESS)
}
