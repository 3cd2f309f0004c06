//! A program of your own with the operational behaviour of `etl-coord worker`: its flags and
//! `ETL_COORD_*` environment (`--job`, `--store`, `--lease-duration`, `--admin-addr`, ...),
//! drain on SIGTERM, exit codes, JSON logs. Only `--input` is this program's.
//!
//! `cargo run -p etl-coordination-examples --example runner -- --job lines --store memory --input deploy/input`
//! runs it alone; `--store nats://127.0.0.1:4222` (or `NATS_URL`) shares the job between copies.

use etl_coordination::prelude::*;
use etl_coordination::sources::{Line, files::FilesSource};

// The embedding: the program's flags and its main.
/// The program's own flags, beside the runner's.
#[derive(clap::Args, Debug)]
struct Input {
    /// The directory whose files' lines are printed.
    #[arg(long, env = "INPUT_DIR", default_value = "deploy/input")]
    input: String,
}

fn main() -> std::process::ExitCode {
    etl_coordination::runner::main(|args: Input| async move {
        Ok((FilesSource::open(&args.input, 4096)?, Stdout))
    })
}
// The embedding ends here.

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
