//! The pipeline of `pipeline.rs`, coordinated through NATS: the only statement that differs is
//! the one that makes the stores. Start a NATS server (`nats-server -js`), then several copies:
//!
//! `NATS_URL=nats://127.0.0.1:4222 cargo run -p etl-coordination-examples --example pipeline_nats -- deploy/input`

use etl_coordination_driver::{JobName, JobStores, LaneInfo, Pipeline, Sink, SinkError, SinkWriter, SplitId};
use etl_coordination_sources::Line;
use etl_coordination_sources::files::FilesSource;

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let dir = std::env::args().nth(1).unwrap_or_else(|| "deploy/input".into());
    let job = JobName::new("example-pipeline")?;
    let stores =
        JobStores::nats(&etl_coordination_nats::NatsConfig::new(std::env::var("NATS_URL")?), &job).await?;
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
