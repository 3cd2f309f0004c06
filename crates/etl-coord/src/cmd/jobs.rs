//! `etl-coord jobs`: the jobs a NATS account holds (every pair of buckets named after a job),
//! whether a worker has started each, and what its state bucket holds. It reads, never creates.

use std::process::ExitCode;

use anyhow::bail;
use serde::Serialize;

use super::{ConnectFlags, Usage, nats_config};

#[derive(clap::Args, Debug)]
pub(crate) struct JobsArgs {
    #[command(flatten)]
    pub(crate) store: ConnectFlags,
    /// `table` or `json` (for tooling).
    #[arg(short, long, default_value = "table", value_parser = ["table", "json"])]
    pub(crate) output: String,
}

impl JobsArgs {
    /// What one flag's parser cannot check.
    pub(crate) fn validate(&self) -> Result<(), Usage> {
        self.store.validate()
    }
}

/// One job, as listed.
#[derive(Debug, Serialize)]
struct Row {
    job: String,
    /// Whether a worker has started it (its `meta` record exists).
    started: bool,
    /// Whether each bucket exists (a job whose buckets were half deleted shows it).
    state_bucket: bool,
    lease_bucket: bool,
    /// What its state bucket holds.
    records: u64,
    bytes: u64,
}

pub(crate) async fn run(a: JobsArgs) -> anyhow::Result<ExitCode> {
    let Some(cfg) = nats_config(&a.store)? else {
        bail!(
            "--store memory holds only the jobs of the process that runs them: list the jobs of a NATS account \
             with --store nats://HOST:PORT"
        );
    };
    let rows: Vec<Row> = etl_coordination_nats::list_jobs(&cfg)
        .await?
        .into_iter()
        .map(|j| Row {
            job: j.job.to_string(),
            started: j.started,
            state_bucket: j.state_bucket,
            lease_bucket: j.lease_bucket,
            records: j.records,
            bytes: j.bytes,
        })
        .collect();
    if a.output == "json" {
        println!("{}", serde_json::to_string_pretty(&rows)?);
        return Ok(ExitCode::SUCCESS);
    }
    if rows.is_empty() {
        println!("no jobs at {}", cfg.url);
        return Ok(ExitCode::SUCCESS);
    }
    let width = rows.iter().map(|r| r.job.len()).max().unwrap_or(0).max(3);
    println!("{:width$}  {:11}  {:>8}  {:>10}", "JOB", "STATE", "RECORDS", "BYTES");
    for r in &rows {
        let state = match (r.state_bucket, r.lease_bucket, r.started) {
            (true, true, true) => "started",
            (true, true, false) => "not started",
            _ => "incomplete",
        };
        println!("{:width$}  {state:11}  {:>8}  {:>10}", r.job, r.records, r.bytes);
    }
    if rows.iter().any(|r| !(r.state_bucket && r.lease_bucket)) {
        println!(
            "incomplete: one of the job's two buckets is missing; its next worker (or `etl-coord nats-buckets`) creates it"
        );
    }
    Ok(ExitCode::SUCCESS)
}
