//! `etl-coord status`: a job's plan, leader, live workers and every split.

use std::process::ExitCode;
use std::time::Duration;

use etl_coord::ops;

use etl_coordination_runner::RunError;

use super::{StoreArgs, Usage, nats_config, open_job, parse_duration};

#[derive(clap::Args, Debug)]
pub(crate) struct StatusArgs {
    #[command(flatten)]
    pub(crate) store: StoreArgs,
    /// `table`, `wide` (every column in full, and who holds each split's live lease) or `json`
    /// (for tooling). Records and leases are read one listing after the other: on a running
    /// job a split that changed hands in between can show the lease of a moment before.
    #[arg(short, long, default_value = "table", value_parser = ["table", "wide", "json"])]
    pub(crate) output: String,
    /// Same as `-o json`.
    #[arg(long)]
    pub(crate) json: bool,
    /// Show only splits in these states (comma-separated: done, owned, unleased, quarantined,
    /// undecodable, missing); the summary still counts every split.
    #[arg(long, value_delimiter = ',', value_parser = ["done", "owned", "unleased", "quarantined", "undecodable", "missing"], ignore_case = true)]
    pub(crate) state: Vec<String>,
    /// Print the status again every --interval until interrupted.
    #[arg(short, long)]
    pub(crate) watch: bool,
    /// The workers' --claim-backoff: status shows how long each failed split waits before it
    /// is claimed again.
    #[arg(long, default_value = "15s", value_parser = parse_duration, env = "ETL_COORD_CLAIM_BACKOFF")]
    pub(crate) claim_backoff: Duration,
    /// How often --watch prints.
    #[arg(long, default_value = "2s", value_parser = parse_duration)]
    pub(crate) interval: Duration,
}

impl StatusArgs {
    /// What one flag's parser cannot check.
    pub(crate) fn validate(&self) -> Result<(), Usage> {
        super::positive("--interval", self.interval)?;
        self.store.validate()
    }
}

/// Prints the status once, or every `--interval` with `--watch`. A job that does not exist is
/// an error (exit 1, nothing created); with `--watch` on NATS, it is waited for (an operator
/// may start watching before the first worker starts).
pub(crate) async fn run(a: StatusArgs) -> anyhow::Result<ExitCode> {
    let stores = loop {
        match open_job(&a.store).await {
            Ok(stores) => break stores,
            // The in-memory store of this process will never hold it: no point waiting.
            Err(e @ RunError::NoSuchJob { .. }) if a.watch && nats_config(&a.store.connection)?.is_some() => {
                // On standard error: standard output is the status (JSON with -o json).
                eprintln!("{e}; waiting for it (every {:?})", a.interval);
                tokio::time::sleep(a.interval).await;
            }
            Err(e) => return Err(e.into()),
        }
    };
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
        ops::with_claim_backoff(&mut s, a.claim_backoff);
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
