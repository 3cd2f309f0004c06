//! A coordinated pipeline: the lines of the files under a directory, printed with the split
//! they came from.
//!
//! `cargo run -p etl-coordination-examples --example pipeline -- deploy/input` runs it on the
//! in-memory store: one process, alone. `pipeline_nats.rs` is the same program coordinated
//! through NATS, where copies share the files (kill one and the others take its splits over):
//! the two differ by one statement.

use etl_coordination_driver::{JobName, JobStores, LaneInfo, Pipeline, Sink, SinkError, SinkWriter, SplitId};
use etl_coordination_sources::Line;
use etl_coordination_sources::files::FilesSource;

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let dir = std::env::args().nth(1).unwrap_or_else(|| "deploy/input".into());
    let job = JobName::new("example-pipeline")?;
    let stores = JobStores::memory(job);
    let source = FilesSource::open(&dir, 4096)?;
    let drain_on_ctrl_c = async { tokio::signal::ctrl_c().await.unwrap_or(()) };
    let outcome = Pipeline::new(stores, source, Stdout).run_until(drain_on_ctrl_c).await?;
    println!("{outcome:?}");
    Ok(())
}

/// Prints every line with the split it came from: each lane through a writer of its own.
struct Stdout;

impl Sink<Line> for Stdout {
    type Writer = Printer;

    async fn open(&self, lane: &LaneInfo) -> Result<Printer, SinkError> {
        Ok(Printer(lane.split().clone()))
    }
}

/// One lane's writer: it buffers nothing, so there is nothing to flush.
struct Printer(SplitId);

impl SinkWriter<Line> for Printer {
    async fn write(&mut self, line: Line) -> Result<(), SinkError> {
        println!("{} {}: {}", self.0, line.key, line.content);
        Ok(())
    }

    async fn flush(&mut self) -> Result<(), SinkError> {
        Ok(())
    }
}
