//! What an embedder implements for a [`Pipeline`](crate::Pipeline): a [`Source`] (its
//! [`Planner`], and reading one split as records with their progress) and a [`Sink`] (a
//! [`SinkWriter`] per lane); the errors they report; what a lane is ([`LaneInfo`]) and when it
//! commits ([`CommitCadence`]).

use std::future::Future;
use std::time::Duration;

use bytes::Bytes;
use etl_coordination_core::{AcquisitionReason, Epoch, InstanceId, SplitId};
use serde::Serialize;
use serde::de::DeserializeOwned;
use tokio_util::sync::CancellationToken;

use crate::planner::{Planner, error_chain};

/// A source the pipeline reads: its [`Planner`] (run on the leader only), and how to read one
/// split.
pub trait Source: Planner {
    /// One record, as the source reads it and the sink writes it.
    type Record: Send + 'static;
    /// Where a split's reading stands: what a new owner resumes from. Stored with every commit
    /// (as JSON), so keep it small: an offset, a key, a line number.
    type Progress: Serialize + DeserializeOwned + Send + 'static;
    /// Reads one split.
    type Reader: SplitReader<Record = Self::Record, Progress = Self::Progress>;

    /// Opens the split of `lane` at `from` (`None`: its start). The split's descriptor is
    /// [`LaneInfo::descriptor`], as the planner wrote it.
    fn open(
        &self,
        lane: &LaneInfo,
        from: Option<Self::Progress>,
    ) -> impl Future<Output = Result<Self::Reader, SourceError>> + Send;
}

/// Reads one split, record by record (or batch by batch: [`SplitReader::next_batch`]).
pub trait SplitReader: Send + 'static {
    /// One record.
    type Record: Send + 'static;
    /// The split's progress.
    type Progress: Send + 'static;

    /// The next record and the split's progress once it is written (resuming from that
    /// progress reads the records after it); `None` at the end of the split. The pipeline drops
    /// the future when the split is lost: a read must not hold anything a drop cannot release.
    fn next(&mut self) -> impl Future<Output = NextRecord<Self::Record, Self::Progress>> + Send;

    /// The next records and the split's progress once all of them are written; `None` at the
    /// end of the split. What the pipeline calls: the default reads one record with
    /// [`SplitReader::next`]. A columnar or bulk reader overrides it to hand over what it has
    /// (a row group, a page of rows) in one call, and the sink gets the batch in one
    /// [`SinkWriter::write_batch`]. A batch holds no bad record and no error: a reader that
    /// meets one returns the records before it, then the error on the next call. An empty batch
    /// moves the progress on without records (rows filtered out). A batch counts as its length
    /// towards [`CommitCadence::records`]; a commit never falls inside a batch.
    fn next_batch(&mut self) -> impl Future<Output = NextBatch<Self::Record, Self::Progress>> + Send {
        async { Ok(self.next().await?.map(|(record, progress)| (vec![record], progress))) }
    }

    /// How much of the split lies before `progress`, in the unit of the planner's weight for
    /// it ([`LaneInfo::weight`]: bytes, rows): what `etl-coord status` and the work metrics
    /// count as done within a split that is still being read. `None` (the default): the
    /// reader cannot say, and the split counts as done only once it is finished. An estimate
    /// is fine (a key's place in its range); a value past the weight counts as the weight. The
    /// pipeline asks after every batch it reads (every record, for a reader without batches):
    /// keep it cheap (arithmetic on the progress, no I/O).
    fn position(&self, progress: &Self::Progress) -> Option<u64> {
        let _ = progress;
        None
    }
}

/// What [`SplitReader::next`] gives: a record and the progress after it, the end of the split
/// (`None`), or an error.
pub type NextRecord<R, P> = Result<Option<(R, P)>, SourceError>;

/// What [`SplitReader::next_batch`] gives: records and the progress after the last of them, the
/// end of the split (`None`), or an error.
pub type NextBatch<R, P> = Result<Option<(Vec<R>, P)>, SourceError>;

/// Where records go: a [`SinkWriter`] for each lane.
///
/// Each lane writes through a writer of its own and commits only what its own writer flushed,
/// so a flush that fails fails that lane alone, and never drops (or commits) another lane's
/// records. Share the destination (a connection pool, a file) in the sink; keep what one lane
/// buffers in its writer.
pub trait Sink<R: Send + 'static>: Send + Sync + 'static {
    /// Writes one lane's records.
    type Writer: SinkWriter<R>;

    /// A writer for `lane` (a new tenancy of a split: its epoch is [`LaneInfo::epoch`]),
    /// opened before the lane reads anything. A transient error is waited out like a failed
    /// flush; another one fails the lane.
    fn open(&self, lane: &LaneInfo) -> impl Future<Output = Result<Self::Writer, SinkError>> + Send;
}

/// Writes the records of one lane: made by [`Sink::open`], used by that lane alone.
///
/// The pipeline calls [`SinkWriter::flush`] before every commit of the lane's progress, and
/// commits the progress of the records written before it only once it has returned `Ok`. A
/// writer ends with [`SinkWriter::close`] when its lane has committed its last progress (the
/// split finished, or was released on a drain); when the lane ends otherwise (its split lost,
/// a failure) the writer is dropped, and what it did not flush replays elsewhere.
pub trait SinkWriter<R: Send + 'static>: Send + 'static {
    /// Writes one record (buffering is fine: [`SinkWriter::flush`] makes it durable).
    fn write(&mut self, record: R) -> impl Future<Output = Result<(), SinkError>> + Send;

    /// Writes records in order (what a batch of [`SplitReader::next_batch`] becomes). The
    /// default writes them one by one. After an error, what the writer took of the batch may
    /// be written again (at-least-once), never lost.
    fn write_batch(&mut self, records: Vec<R>) -> impl Future<Output = Result<(), SinkError>> + Send {
        async move {
            for record in records {
                self.write(record).await?;
            }
            Ok(())
        }
    }

    /// Makes everything this writer wrote so far durable: once it returns `Ok`, a crash must
    /// not lose it.
    fn flush(&mut self) -> impl Future<Output = Result<(), SinkError>> + Send;

    /// Ends the writer after its lane's last commit (everything it wrote was flushed). The
    /// default does nothing; an error is logged.
    fn close(self) -> impl Future<Output = Result<(), SinkError>> + Send
    where
        Self: Sized,
    {
        async { Ok(()) }
    }
}

/// A source could not read a split.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum SourceError {
    /// Reading failed (an I/O error, a timeout): the tenancy ends as failed and consumes one
    /// attempt if it committed no progress (P12); a peer (or this worker) tries again.
    #[error("{0}")]
    Failed(String),
    /// The split can never be processed (malformed data): it consumes one attempt all the
    /// same, and is quarantined at `max_attempts`.
    #[error("unprocessable: {0}")]
    Unprocessable(String),
    /// The input is unavailable for a while (a connection reset, a throttled or failing
    /// server, a timeout): says nothing about the split. The lane waits and reads again from
    /// the record after the last one written, with backoff, within
    /// [`DriverConfig::transient_retry_budget`](crate::DriverConfig::transient_retry_budget);
    /// past the budget it ends as [`SourceError::Failed`].
    #[error("transient: {0}")]
    Transient(String),
    /// One record cannot be made into a record (a malformed row, bytes that are not UTF-8);
    /// the reader has read past it, and its next [`SplitReader::next`] goes on with the record
    /// after it. What happens is the worker's [`OnBadRecord`](crate::OnBadRecord) policy: by
    /// default the split ends as unprocessable (one attempt); with `Skip` the record goes to the
    /// dead-letter sink and reading goes on.
    #[error("bad record at {}: {}", .0.position, .0.error)]
    BadRecord(BadRecord),
}

/// A record a source read but could not make a record of: what a dead-letter sink keeps.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct BadRecord {
    /// Where it is, in the source's terms (`logs/a.json:17`): enough to find it again.
    pub position: String,
    /// Why it is bad.
    pub error: String,
    /// Its bytes as read.
    pub raw: Bytes,
}

impl BadRecord {
    /// A bad record at `position`, with why and its bytes.
    pub fn new(position: impl Into<String>, error: impl std::fmt::Display, raw: impl Into<Bytes>) -> Self {
        BadRecord { position: position.into(), error: error.to_string(), raw: raw.into() }
    }
}

/// A boxed future, for the object-safe [`DeadLetters`] trait.
pub type BoxFuture<'a, T> = std::pin::Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// Where the records skipped under [`OnBadRecord::Skip`](crate::OnBadRecord::Skip) go, with
/// their split and lane ([`Pipeline::dead_letters`](crate::Pipeline::dead_letters)). Like a
/// [`Sink`]: one [`DeadLetterWriter`] per lane (opened at the lane's first bad record), whose
/// `write` may buffer and whose `flush` makes what it wrote durable (called before every
/// commit of the lane's progress, so a skipped record is kept before the progress past it is);
/// a transient error is waited out like the sink's. A record may be written again when its
/// split is read again after a failure (at-least-once, as the sink's records).
pub trait DeadLetters: Send + Sync + 'static {
    /// A writer for the bad records of `lane`.
    fn open<'a>(&'a self, lane: &'a LaneInfo) -> BoxFuture<'a, Result<Box<dyn DeadLetterWriter>, SinkError>>;
}

/// Keeps the bad records of one lane: made by [`DeadLetters::open`].
pub trait DeadLetterWriter: Send + 'static {
    /// Keeps one bad record.
    fn write<'a>(&'a mut self, record: &'a BadRecord) -> BoxFuture<'a, Result<(), SinkError>>;

    /// Makes everything this writer wrote so far durable.
    fn flush(&mut self) -> BoxFuture<'_, Result<(), SinkError>>;
}

impl SourceError {
    /// A failure worth retrying elsewhere (the tenancy ends as failed).
    pub fn failed(e: impl std::fmt::Display) -> Self {
        SourceError::Failed(e.to_string())
    }

    /// A split that can never be processed.
    pub fn unprocessable(e: impl std::fmt::Display) -> Self {
        SourceError::Unprocessable(e.to_string())
    }

    /// An outage of the input, retried in place.
    pub fn transient(e: impl std::fmt::Display) -> Self {
        SourceError::Transient(e.to_string())
    }

    /// Whether the lane retries it in place.
    pub fn is_transient(&self) -> bool {
        matches!(self, SourceError::Transient(_))
    }

    /// One bad record: see [`SourceError::BadRecord`].
    pub fn bad_record(
        position: impl Into<String>,
        error: impl std::fmt::Display,
        raw: impl Into<Bytes>,
    ) -> Self {
        SourceError::BadRecord(BadRecord::new(position, error, raw))
    }
}

/// An I/O error as a source reports it: [`SourceError::Transient`] when [`is_transient_io`]
/// says so, else [`SourceError::Failed`] (with the message chain of its sources).
impl From<std::io::Error> for SourceError {
    fn from(e: std::io::Error) -> Self {
        if is_transient_io(e.kind()) {
            SourceError::transient(error_chain(&e))
        } else {
            SourceError::failed(error_chain(&e))
        }
    }
}

/// A sink could not write or flush. A permanent error ends the lane as failed (one attempt if it
/// committed nothing) and its uncommitted records replay elsewhere; a transient one (the disk
/// is full, the warehouse restarts, a throttled or unreachable service) is retried in place
/// within [`DriverConfig::transient_retry_budget`](crate::DriverConfig::transient_retry_budget).
///
/// What a transient error promises about the sink's state: after a failed `write`, the record
/// was not taken (the pipeline reads it again and writes it again); after a failed `flush`,
/// what was written before is still held and a later `flush` makes it durable. A sink that
/// cannot promise this reports a permanent error.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("sink: {message}")]
pub struct SinkError {
    message: String,
    transient: bool,
}

impl SinkError {
    /// A permanent failure, from any error (the lane ends as failed).
    pub fn new(e: impl std::fmt::Display) -> Self {
        SinkError { message: e.to_string(), transient: false }
    }

    /// An outage of the sink, retried in place.
    pub fn transient(e: impl std::fmt::Display) -> Self {
        SinkError { message: e.to_string(), transient: true }
    }

    /// Whether the lane retries it in place.
    pub fn is_transient(&self) -> bool {
        self.transient
    }

    /// What went wrong.
    pub fn message(&self) -> &str {
        &self.message
    }
}

/// An I/O error as a sink reports it: transient when [`is_transient_io`] says so (a full
/// disk among them), else permanent; the message keeps the chain of its sources.
impl From<std::io::Error> for SinkError {
    fn from(e: std::io::Error) -> Self {
        if is_transient_io(e.kind()) {
            SinkError::transient(error_chain(&e))
        } else {
            SinkError::new(error_chain(&e))
        }
    }
}

/// Whether an I/O error of this kind is an outage that passes (retry in place) rather than a
/// fault of the split or of the configuration: a full disk or quota, a timeout, an interrupted
/// call or one that would block, a connection refused, reset, aborted or not made, a busy
/// resource, an unreachable host or network. Not found, permission denied, invalid input or
/// data, a truncated input (unexpected end), a closed pipe and the rest are not.
pub fn is_transient_io(kind: std::io::ErrorKind) -> bool {
    use std::io::ErrorKind as K;
    matches!(
        kind,
        K::StorageFull
            | K::QuotaExceeded
            | K::TimedOut
            | K::Interrupted
            | K::WouldBlock
            | K::ConnectionRefused
            | K::ConnectionReset
            | K::ConnectionAborted
            | K::NotConnected
            | K::HostUnreachable
            | K::NetworkUnreachable
            | K::NetworkDown
            | K::ResourceBusy
    )
}

/// What a lane is: the split, this tenancy's epoch, the worker, the planner's descriptor, and a
/// token cancelled when the lane must stop (for readers with work of their own to abandon).
#[derive(Clone, Debug)]
pub struct LaneInfo {
    pub(crate) split: SplitId,
    pub(crate) epoch: Epoch,
    pub(crate) instance: InstanceId,
    pub(crate) descriptor: Bytes,
    pub(crate) weight: u64,
    pub(crate) reason: Option<AcquisitionReason>,
    pub(crate) cancelled: CancellationToken,
}

impl LaneInfo {
    /// A lane's description, as the pipeline makes it (for tests of a source, and for lane
    /// loops of your own over [`Lanes`](crate::Lanes)); no acquisition reason, a fresh token.
    pub fn new(split: SplitId, epoch: Epoch, instance: InstanceId, descriptor: Bytes, weight: u64) -> Self {
        LaneInfo {
            split,
            epoch,
            instance,
            descriptor,
            weight,
            reason: None,
            cancelled: CancellationToken::new(),
        }
    }

    /// The split.
    pub fn split(&self) -> &SplitId {
        &self.split
    }

    /// The fencing token of this tenancy: hand it to sinks that can fence writes too.
    pub fn epoch(&self) -> Epoch {
        self.epoch
    }

    /// The worker running the lane.
    pub fn instance(&self) -> &InstanceId {
        &self.instance
    }

    /// The planner's descriptor of the split.
    pub fn descriptor(&self) -> &Bytes {
        &self.descriptor
    }

    /// The planner's weight of the split.
    pub fn weight(&self) -> u64 {
        self.weight
    }

    /// Why this worker acquired the split; `None` when a starved lane resumes.
    pub fn reason(&self) -> Option<AcquisitionReason> {
        self.reason
    }

    /// Cancelled as soon as the lane must stop (its split lost, the worker draining or gone),
    /// whatever the lane is doing at that moment, and when the lane has ended (also by a panic).
    pub fn cancelled(&self) -> &CancellationToken {
        &self.cancelled
    }
}

/// When a lane commits its progress: after this many records, or once this long has passed
/// since its last commit while records are written and not committed (also while the reader
/// waits for the next record), whichever comes first. More often means less replay after a
/// failure and more store writes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct CommitCadence {
    /// Records between two commits.
    pub records: u64,
    /// Time between two commits.
    pub interval: Duration,
}

impl CommitCadence {
    /// Commit after `records` records or once `interval` has passed, whichever comes first.
    pub fn new(records: u64, interval: Duration) -> Self {
        CommitCadence { records, interval }
    }
}

impl Default for CommitCadence {
    /// Every 500 records or every second.
    fn default() -> Self {
        CommitCadence { records: 500, interval: Duration::from_secs(1) }
    }
}
