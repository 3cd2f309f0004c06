//! A JSON Lines sink: one line per emitted record with the split, a record key unique within
//! the whole input, the lane's epoch (fencing token) and the instance that emitted it.

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::Path;
use std::sync::{Arc, Mutex};

use etl_coordination_driver::{
    BadRecord, BoxFuture, DeadLetterWriter, DeadLetters, LaneInfo, Sink, SinkError, SinkWriter,
};
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

/// A lane's writer sends its lines to the file once it holds this much, without waiting for its
/// flush.
const BUFFER: usize = 1 << 20;

/// Appends records to a file shared by every lane of a process; each lane buffers its own lines
/// ([`JsonlWriter`]) and appends them at its flush, whole or not at all.
#[derive(Clone, Debug)]
pub struct JsonlSink {
    file: Arc<Mutex<SinkFile>>,
}

/// The file, and why it can no longer be trusted, if it cannot.
#[derive(Debug)]
struct SinkFile {
    /// `None`: the sink discards everything.
    file: Option<File>,
    /// Whether the file can be synced and cut back (a regular file; `/dev/null` or a pipe
    /// cannot).
    regular: bool,
    /// Set by a failed `fsync` or a write that could not be cut back: every later flush fails.
    poisoned: Option<String>,
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
        let regular = file.metadata()?.is_file();
        Ok(Self::with(SinkFile { file: Some(file), regular, poisoned: None }))
    }

    /// A sink that drops everything (when no `--sink` is given).
    pub fn discard() -> Self {
        Self::with(SinkFile { file: None, regular: false, poisoned: None })
    }

    fn with(file: SinkFile) -> Self {
        JsonlSink { file: Arc::new(Mutex::new(file)) }
    }

    /// A buffer of lines for one lane, appended to this file at its flush.
    fn lines(&self) -> Lines {
        Lines { sink: self.clone(), buf: Vec::new() }
    }

    /// Appends whole lines, all of them or none: a write cut short (a full disk) is cut off
    /// again, so writing them again later does not corrupt the file. A full disk or quota is
    /// an outage (transient); a write to a pipe cut short cannot be taken back (permanent).
    fn append(&self, bytes: &[u8]) -> Result<(), SinkError> {
        let mut g = self.file.lock().expect("sink lock");
        let SinkFile { file, regular, poisoned } = &mut *g;
        if let Some(why) = poisoned {
            return Err(SinkError::new(why.clone()));
        }
        let Some(file) = file.as_mut() else { return Ok(()) };
        if !*regular {
            return file.write_all(bytes).map_err(SinkError::new);
        }
        let len = file.metadata().map_err(SinkError::new)?.len();
        let Err(e) = file.write_all(bytes) else { return Ok(()) };
        if let Err(cut) = file.set_len(len) {
            let why = format!(
                "a write failed ({e}) and could not be cut back ({cut}): the file may hold part of a line"
            );
            *poisoned = Some(why.clone());
            return Err(SinkError::new(why));
        }
        Err(SinkError::from(e))
    }

    /// Makes everything appended durable (blocking: `fsync`). A failed `fsync` is not retried,
    /// by this lane or any other: the kernel may have dropped the pages it could not write (any
    /// lane's), and a second `fsync` would report success for data that is not on disk. The
    /// process must restart (its uncommitted records replay).
    fn sync(&self) -> Result<(), SinkError> {
        let mut g = self.file.lock().expect("sink lock");
        let SinkFile { file, regular, poisoned } = &mut *g;
        if let Some(why) = poisoned {
            return Err(SinkError::new(why.clone()));
        }
        match file.as_ref() {
            Some(f) if *regular => f.sync_data().map_err(|e| {
                let why = format!("fsync failed, not retried (the data may be lost): {e}");
                *poisoned = Some(why.clone());
                SinkError::new(why)
            }),
            _ => Ok(()),
        }
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
}

/// One lane's lines, buffered until its flush (or until they fill [`BUFFER`]).
#[derive(Debug)]
struct Lines {
    sink: JsonlSink,
    buf: Vec<u8>,
}

impl Lines {
    /// Buffers `value` as one line. A line that fills the buffer sends it to the file; if that
    /// fails, the line is not taken (the pipeline writes it again) and what was buffered before
    /// it is kept.
    fn push<T: Serialize>(&mut self, value: &T) -> Result<(), SinkError> {
        let start = self.buf.len();
        serde_json::to_writer(&mut self.buf, value).map_err(SinkError::new)?;
        self.buf.push(b'\n');
        if self.buf.len() >= BUFFER {
            if let Err(e) = self.sink.append(&self.buf) {
                self.buf.truncate(start);
                return Err(e);
            }
            self.buf.clear();
        }
        Ok(())
    }

    /// Appends the buffered lines and syncs the file, off the async threads. Lines the file did
    /// not take stay buffered for the next flush.
    async fn flush(&mut self) -> Result<(), SinkError> {
        let (sink, buf) = (self.sink.clone(), std::mem::take(&mut self.buf));
        let (buf, result) = tokio::task::spawn_blocking(move || match sink.append(&buf) {
            Ok(()) => (Vec::new(), sink.sync()),
            Err(e) => (buf, Err(e)),
        })
        .await
        .map_err(SinkError::new)?;
        self.buf = buf;
        result
    }
}

/// The pipeline's sink: one line per record, with the lane's split, epoch and worker.
impl Sink<Line> for JsonlSink {
    type Writer = JsonlWriter;

    async fn open(&self, lane: &LaneInfo) -> Result<JsonlWriter, SinkError> {
        Ok(JsonlWriter { lines: self.lines(), lane: lane.clone() })
    }
}

/// The records of one lane, appended to the [`JsonlSink`]'s file at each flush.
#[derive(Debug)]
pub struct JsonlWriter {
    lines: Lines,
    lane: LaneInfo,
}

impl SinkWriter<Line> for JsonlWriter {
    async fn write(&mut self, record: Line) -> Result<(), SinkError> {
        let lane = &self.lane;
        self.lines.push(&SinkLine {
            split: lane.split().to_string(),
            record: record.key,
            epoch: lane.epoch().0,
            instance: lane.instance().to_string(),
            at_ms: unix_ms(),
        })
    }

    async fn flush(&mut self) -> Result<(), SinkError> {
        self.lines.flush().await
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
    fn open<'a>(&'a self, lane: &'a LaneInfo) -> BoxFuture<'a, Result<Box<dyn DeadLetterWriter>, SinkError>> {
        let writer = DeadWriter { lines: self.0.lines(), lane: lane.clone() };
        Box::pin(async move { Ok(Box::new(writer) as Box<dyn DeadLetterWriter>) })
    }
}

/// The bad records of one lane, appended to the dead-letter file at each flush.
struct DeadWriter {
    lines: Lines,
    lane: LaneInfo,
}

impl DeadLetterWriter for DeadWriter {
    fn write<'a>(&'a mut self, record: &'a BadRecord) -> BoxFuture<'a, Result<(), SinkError>> {
        let text = std::str::from_utf8(&record.raw);
        let line = DeadLine {
            split: self.lane.split().to_string(),
            position: record.position.clone(),
            error: record.error.clone(),
            raw: String::from_utf8_lossy(&record.raw).into_owned(),
            raw_hex: text.is_err().then(|| record.raw.iter().map(|b| format!("{b:02x}")).collect()),
            epoch: self.lane.epoch().0,
            instance: self.lane.instance().to_string(),
        };
        let pushed = self.lines.push(&line);
        Box::pin(async move { pushed })
    }

    fn flush(&mut self) -> BoxFuture<'_, Result<(), SinkError>> {
        Box::pin(self.lines.flush())
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
    use etl_coordination_driver::{Epoch, InstanceId, SplitId};

    use super::*;

    fn writer(sink: &JsonlSink, split: &str) -> JsonlWriter {
        let id = SplitId::new(split).unwrap();
        let lane = LaneInfo::new(id, Epoch(1), InstanceId::new("w").unwrap(), bytes::Bytes::new(), 1);
        futures_util::FutureExt::now_or_never(sink.open(&lane)).unwrap().unwrap()
    }

    fn line(key: &str) -> Line {
        Line { key: key.into(), content: String::new() }
    }

    fn records(p: &Path) -> Vec<String> {
        JsonlSink::read(p).unwrap().into_iter().map(|l| l.record).collect()
    }

    #[tokio::test]
    async fn each_lane_appends_its_own_lines_at_its_own_flush() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("out.jsonl");
        let sink = JsonlSink::open(&path).unwrap();
        let (mut a, mut b) = (writer(&sink, "a"), writer(&sink, "b"));
        a.write(line("a1")).await.unwrap();
        b.write(line("b1")).await.unwrap();
        a.write(line("a2")).await.unwrap();
        a.flush().await.unwrap();
        assert_eq!(records(&path), ["a1", "a2"], "b's line waits for b's flush");
        drop(b);
        a.write(line("a3")).await.unwrap();
        a.flush().await.unwrap();
        assert_eq!(records(&path), ["a1", "a2", "a3"], "a lane dropped unflushed wrote nothing");
    }

    #[tokio::test]
    async fn a_line_cut_short_by_a_crash_is_not_read_and_is_cut_off_when_the_sink_reopens() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("out.jsonl");
        let sink = JsonlSink::open(&path).unwrap();
        let mut w = writer(&sink, "s");
        w.write(line("a")).await.unwrap();
        w.write(line("b")).await.unwrap();
        w.flush().await.unwrap();
        drop((w, sink));
        // A SIGKILL while the lines were being appended: half a line, no newline.
        let mut f = OpenOptions::new().append(true).open(&path).unwrap();
        f.write_all(br#"{"split":"s","rec"#).unwrap();
        drop(f);
        assert_eq!(records(&path), ["a", "b"]);
        // The restarted process appends after the last whole line.
        let sink = JsonlSink::open(&path).unwrap();
        let mut w = writer(&sink, "s");
        w.write(line("c")).await.unwrap();
        w.flush().await.unwrap();
        assert_eq!(records(&path), ["a", "b", "c"]);
    }
}
