//! A JSON Lines sink: one line per emitted record with the split, a record key unique within
//! the whole input, the lane's epoch (fencing token) and the instance that emitted it.

use std::fs::{File, OpenOptions};
use std::io::{BufWriter, Write};
use std::path::Path;
use std::sync::{Arc, Mutex};

use serde::{Deserialize, Serialize};

/// One emitted record.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SinkLine {
    /// The split it came from.
    pub split: String,
    /// A key unique within the whole input (object path + line number, table + id).
    pub record: String,
    /// The epoch of the lane that emitted it.
    pub epoch: u64,
    /// The instance that emitted it.
    pub instance: String,
    /// When it was emitted (Unix milliseconds), for latency measurements.
    #[serde(default)]
    pub at_ms: u64,
}

/// Now, in Unix milliseconds.
pub fn unix_ms() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64)
}

/// Appends records to a file; shared by every lane of a process.
#[derive(Clone, Debug)]
pub struct JsonlSink {
    out: Arc<Mutex<Option<BufWriter<File>>>>,
}

impl JsonlSink {
    /// Appends to `path` (created if missing).
    pub fn open(path: &Path) -> std::io::Result<Self> {
        let file = OpenOptions::new().create(true).append(true).open(path)?;
        Ok(JsonlSink { out: Arc::new(Mutex::new(Some(BufWriter::new(file)))) })
    }

    /// A sink that drops everything (when no `--sink` is given).
    pub fn discard() -> Self {
        JsonlSink { out: Arc::new(Mutex::new(None)) }
    }

    /// Buffers one record.
    pub fn write(&self, line: &SinkLine) -> std::io::Result<()> {
        let mut g = self.out.lock().expect("sink lock");
        if let Some(w) = g.as_mut() {
            serde_json::to_writer(&mut *w, line)?;
            w.write_all(b"\n")?;
        }
        Ok(())
    }

    /// Makes everything written so far durable in the file. Called before every progress
    /// commit: a committed position must never be ahead of the sink (no loss on a crash).
    pub fn flush(&self) -> std::io::Result<()> {
        let mut g = self.out.lock().expect("sink lock");
        if let Some(w) = g.as_mut() {
            w.flush()?;
            w.get_ref().sync_data()?;
        }
        Ok(())
    }

    /// Reads a sink file back (for checks).
    pub fn read(path: &Path) -> std::io::Result<Vec<SinkLine>> {
        let text = std::fs::read_to_string(path)?;
        text.lines()
            .filter(|l| !l.trim().is_empty())
            .map(|l| {
                serde_json::from_str(l).map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e))
            })
            .collect()
    }
}
