//! A JSON Lines sink: one line per emitted record with the split, a record key unique within
//! the whole input, the lane's epoch (fencing token) and the instance that emitted it.

use std::fs::{File, OpenOptions};
use std::io::{BufWriter, Write};
use std::path::Path;
use std::sync::{Arc, Mutex};

use etl_coordination_driver::{BadRecord, BoxFuture, DeadLetters, LaneInfo, Sink, SinkError};
use etl_coordination_sources::Line;
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

/// The write buffer: a line shorter than this is buffered whole or not at all.
const BUFFER: usize = 1 << 20;

/// Appends records to a file; shared by every lane of a process.
#[derive(Clone, Debug)]
pub struct JsonlSink {
    out: Arc<Mutex<Option<BufWriter<File>>>>,
    /// Whether the file can be synced (a regular file; `/dev/null` or a pipe cannot).
    syncable: bool,
}

impl JsonlSink {
    /// Appends to `path` (created if missing). A line a crash cut short (no newline at the end
    /// of the file) is cut off first: its record was never committed, so it is emitted again.
    pub fn open(path: &Path) -> std::io::Result<Self> {
        let file = OpenOptions::new().create(true).append(true).read(true).open(path)?;
        let bytes = std::fs::read(path)?;
        if bytes.last().is_some_and(|b| *b != b'\n') {
            let whole = bytes.iter().rposition(|b| *b == b'\n').map_or(0, |i| i + 1);
            file.set_len(whole as u64)?;
        }
        let syncable = file.metadata()?.is_file();
        Ok(JsonlSink { out: Arc::new(Mutex::new(Some(BufWriter::with_capacity(BUFFER, file)))), syncable })
    }

    /// A sink that drops everything (when no `--sink` is given).
    pub fn discard() -> Self {
        JsonlSink { out: Arc::new(Mutex::new(None)), syncable: false }
    }

    /// Buffers one record, whole or not at all: the line is made first and handed to the
    /// buffer in one write, so a write that fails (the buffer had to go to a full disk) leaves
    /// no part of it behind, and writing it again later does not corrupt the file.
    pub fn write_line(&self, line: &SinkLine) -> std::io::Result<()> {
        self.write_bytes(&Self::line_bytes(line)?)
    }

    fn line_bytes(line: &SinkLine) -> std::io::Result<Vec<u8>> {
        let mut bytes = serde_json::to_vec(line)?;
        bytes.push(b'\n');
        Ok(bytes)
    }

    fn write_bytes(&self, bytes: &[u8]) -> std::io::Result<()> {
        let mut g = self.out.lock().expect("sink lock");
        if let Some(w) = g.as_mut() {
            w.write_all(bytes)?;
        }
        Ok(())
    }

    /// [`JsonlSink::sync`] for the pipeline: what the buffer could not write is kept and
    /// tried again (a full disk: transient); a failed `fsync` is not retried (permanent): the
    /// kernel may have dropped the pages it could not write, and a second `fsync` would then
    /// report success for data that is not on disk.
    fn sync_for_commit(&self) -> Result<(), SinkError> {
        let mut g = self.out.lock().expect("sink lock");
        if let Some(w) = g.as_mut() {
            w.flush().map_err(SinkError::from)?;
            if self.syncable {
                w.get_ref().sync_data().map_err(|e| {
                    SinkError::new(format!("fsync failed, not retried (the data may be lost): {e}"))
                })?;
            }
        }
        Ok(())
    }

    /// Makes everything written so far durable in the file (blocking: `fsync`). Called before
    /// every progress commit: a committed position must never be ahead of the sink (no loss on
    /// a crash).
    pub fn sync(&self) -> std::io::Result<()> {
        let mut g = self.out.lock().expect("sink lock");
        if let Some(w) = g.as_mut() {
            // What does not reach the file stays in the buffer (a full disk): a later sync
            // writes it, after what did.
            w.flush()?;
            if self.syncable {
                w.get_ref().sync_data()?;
            }
        }
        Ok(())
    }

    /// Reads a sink file back (for checks). A last line without its newline is a write in
    /// progress, or one a crash cut short (never committed): it is not read.
    pub fn read(path: &Path) -> std::io::Result<Vec<SinkLine>> {
        Self::read_lines(path)
    }

    /// Reads a JSON Lines file this sink wrote (records or dead letters); a last line cut short
    /// is not read.
    pub fn read_lines<T: serde::de::DeserializeOwned>(path: &Path) -> std::io::Result<Vec<T>> {
        let mut text = std::fs::read_to_string(path)?;
        if !text.ends_with('\n') {
            text.truncate(text.rfind('\n').map_or(0, |i| i + 1));
        }
        text.lines()
            .filter(|l| !l.trim().is_empty())
            .map(|l| {
                serde_json::from_str(l).map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e))
            })
            .collect()
    }

    /// Buffers `value` as one line for the pipeline: a full disk or quota is an outage
    /// (transient), waited out in place, since the line is whole in the buffer or absent. A
    /// line as large as the buffer goes to the file directly and may be cut short by a full
    /// disk: not retried (it would be doubled).
    fn write_value<T: Serialize>(&self, value: &T) -> Result<(), SinkError> {
        let mut bytes = serde_json::to_vec(value).map_err(SinkError::new)?;
        bytes.push(b'\n');
        let whole = bytes.len() < BUFFER;
        self.write_bytes(&bytes).map_err(|e| if whole { SinkError::from(e) } else { SinkError::new(e) })
    }
}

/// The pipeline's sink: one line per record, with the lane's split, epoch and worker.
impl Sink<Line> for JsonlSink {
    async fn write(&self, lane: &LaneInfo, record: Line) -> Result<(), SinkError> {
        let line = SinkLine {
            split: lane.split().to_string(),
            record: record.key,
            epoch: lane.epoch().0,
            instance: lane.instance().to_string(),
            at_ms: unix_ms(),
        };
        self.write_value(&line)
    }

    async fn flush(&self) -> Result<(), SinkError> {
        let sink = self.clone();
        tokio::task::spawn_blocking(move || sink.sync_for_commit()).await.map_err(SinkError::new)?
    }
}

/// One bad record kept by the dead-letter file (`--dead-letter`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeadLine {
    /// The split it came from.
    pub split: String,
    /// Where it is in the input (`path:line`).
    pub position: String,
    /// Why it was skipped.
    pub error: String,
    /// Its bytes, as text (bytes that are not UTF-8 replaced by U+FFFD: see `raw_hex`).
    pub raw: String,
    /// Its exact bytes in hexadecimal, when they are not UTF-8.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub raw_hex: Option<String>,
    /// The epoch of the lane that skipped it.
    pub epoch: u64,
    /// The instance that skipped it.
    pub instance: String,
}

/// The dead-letter file of `--on-bad-record skip`: a JSON Lines file of [`DeadLine`]s,
/// buffered, written and made durable as the sink is (a commit past a skipped record waits
/// for it).
#[derive(Clone, Debug)]
pub struct DeadLetterFile(pub JsonlSink);

impl DeadLetters for DeadLetterFile {
    fn write<'a>(
        &'a self,
        lane: &'a LaneInfo,
        record: &'a BadRecord,
    ) -> BoxFuture<'a, Result<(), SinkError>> {
        Box::pin(async move {
            let text = std::str::from_utf8(&record.raw);
            let line = DeadLine {
                split: lane.split().to_string(),
                position: record.position.clone(),
                error: record.error.clone(),
                raw: String::from_utf8_lossy(&record.raw).into_owned(),
                raw_hex: text.is_err().then(|| record.raw.iter().map(|b| format!("{b:02x}")).collect()),
                epoch: lane.epoch().0,
                instance: lane.instance().to_string(),
            };
            self.0.write_value(&line)
        })
    }

    fn flush(&self) -> BoxFuture<'_, Result<(), SinkError>> {
        Box::pin(Sink::<Line>::flush(&self.0))
    }
}

impl DeadLetterFile {
    /// Reads a dead-letter file back (for checks); a last line cut short is not read.
    pub fn read(path: &Path) -> std::io::Result<Vec<DeadLine>> {
        JsonlSink::read_lines(path)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn line(record: &str) -> SinkLine {
        SinkLine { split: "s".into(), record: record.into(), epoch: 1, instance: "w".into(), at_ms: 0 }
    }

    #[test]
    fn a_line_cut_short_by_a_crash_is_not_read_and_is_cut_off_when_the_sink_reopens() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("out.jsonl");
        let sink = JsonlSink::open(&path).unwrap();
        sink.write_line(&line("a")).unwrap();
        sink.write_line(&line("b")).unwrap();
        sink.sync().unwrap();
        drop(sink);
        // A SIGKILL while the buffer was being written: half a line, no newline.
        let mut f = OpenOptions::new().append(true).open(&path).unwrap();
        f.write_all(br#"{"split":"s","rec"#).unwrap();
        drop(f);
        let records =
            |p: &Path| JsonlSink::read(p).unwrap().into_iter().map(|l| l.record).collect::<Vec<_>>();
        assert_eq!(records(&path), ["a", "b"]);
        // The restarted process appends after the last whole line.
        let sink = JsonlSink::open(&path).unwrap();
        sink.write_line(&line("c")).unwrap();
        sink.sync().unwrap();
        assert_eq!(records(&path), ["a", "b", "c"]);
    }
}
