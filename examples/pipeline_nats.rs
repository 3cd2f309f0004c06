//! The pipeline of `pipeline.rs`, coordinated through NATS: the only statement that differs is
//! the one that makes the stores. Start a NATS server (`nats-server -js`), then several copies:
//!
//! `NATS_URL=nats://127.0.0.1:4222 cargo run -p etl-coordination-examples --example pipeline_nats -- deploy/input`

use etl_coordination_driver::{JobName, JobStores, LaneInfo, Pipeline, Sink, SinkError};
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

/// Prints every line with the split it came from; nothing to flush.
struct Stdout;

impl Sink<Line> for Stdout {
    async fn write(&self, lane: &LaneInfo, line: Line) -> Result<(), SinkError> {
        println!("{} {}: {}", lane.split(), line.key, line.content);
        Ok(())
    }

    async fn flush(&self) -> Result<(), SinkError> {
        Ok(())
    }
}
