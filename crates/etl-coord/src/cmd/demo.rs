//! `etl-coord demo`: several in-process workers on the in-memory store, then a check for loss.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use etl_coord::demo::{DemoOptions, run_demo};
use etl_coordination_driver::Tuning;

use super::{Usage, parse_duration, tuning_error};

#[derive(clap::Args, Debug)]
pub(crate) struct DemoArgs {
    /// In-process workers.
    #[arg(long, default_value_t = 3)]
    pub(crate) workers: usize,
    /// Read this directory instead of generating a dataset.
    #[arg(long)]
    pub(crate) input: Option<PathBuf>,
    /// Generated dataset: files.
    #[arg(long, default_value_t = 48)]
    pub(crate) files: usize,
    /// Generated dataset: lines per file.
    #[arg(long, default_value_t = 2000)]
    pub(crate) lines: usize,
    /// Target bytes per split (small by default so the demo dataset spreads over the workers).
    #[arg(long, default_value_t = 256 * 1024)]
    pub(crate) split_size: u64,
    /// Kill and freeze workers at random while the job runs; it must still complete with no loss.
    #[arg(long)]
    pub(crate) chaos: bool,
    /// Lease duration (whole seconds), e.g. 3s.
    #[arg(long, default_value = "3s", value_parser = parse_duration)]
    pub(crate) lease_duration: Duration,
    /// Splits per worker.
    #[arg(long, default_value_t = 4)]
    pub(crate) max_in_flight: u32,
    /// Sleep per record in milliseconds (default: 0, or 1 with --chaos so faults land mid-job).
    #[arg(long)]
    pub(crate) record_delay_ms: Option<u64>,
    /// Seed of the chaos schedule.
    #[arg(long, default_value_t = 1)]
    pub(crate) seed: u64,
}

impl DemoArgs {
    /// What one flag's parser cannot check.
    pub(crate) fn validate(&self) -> Result<(), Usage> {
        let mut t = Tuning::default();
        t.lease_duration = self.lease_duration;
        t.max_in_flight = self.max_in_flight;
        t.validate().map_err(tuning_error)
    }
}

pub(crate) async fn run(a: DemoArgs) -> anyhow::Result<ExitCode> {
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
