//! The command's sources: the files, Parquet, SQLite and PostgreSQL sources of `etl-coordination-sources`, chosen by
//! `--source`, and the test faults the command's own tests inject (a record that crashes the
//! process, one the source calls unprocessable, a read that never answers, a delay per record).

use std::time::Duration;

use anyhow::bail;
use etl_coordination_driver::{
    LaneInfo, NextBatch, NextRecord, Plan, PlanError, Planner, Source, SourceError, SplitId, SplitReader,
};
use etl_coordination_sources::Line;
use etl_coordination_sources::files::{FileProgress, FilesReader, FilesSource};
use etl_coordination_sources::parquet::{ParquetProgress, ParquetReader, ParquetSource};
use etl_coordination_sources::postgres::{PostgresReader, PostgresSource};
use etl_coordination_sources::sqlite::{SqliteReader, SqliteSource};
use serde::{Deserialize, Serialize};

pub use etl_coordination_sources::files::DEFAULT_SPLIT_BYTES;
pub use etl_coordination_sources::sqlite::DEFAULT_SPLIT_ROWS;

/// One of the shipped sources, chosen by `--source`.
#[derive(Clone, Debug)]
pub enum AnySource {
    /// `files:DIR` (or an object-store URL).
    Files(FilesSource),
    /// `sqlite:PATH:TABLE`.
    Sqlite(SqliteSource),
    /// `parquet:DIR` (or an object-store URL).
    Parquet(ParquetSource),
    /// `postgres://...` with `--table` (made by [`AnySource::connect`]).
    Postgres(PostgresSource),
}

/// A database source's options: the table (PostgreSQL) and the key column.
#[derive(Clone, Debug, Default)]
pub struct TableArgs {
    /// `--table`: `name` or `schema.name` (PostgreSQL).
    pub table: Option<String>,
    /// `--key-column`: the integer key ranges are cut by (`id` when not given).
    pub key_column: Option<String>,
}

/// `spec` with the password of a URL's user information (`scheme://user:password@host`)
/// replaced, for messages.
pub fn redact(spec: &str) -> String {
    let Some((scheme, rest)) = spec.split_once("://") else { return spec.to_owned() };
    let authority_end = rest.find('/').unwrap_or(rest.len());
    match rest[..authority_end].rfind('@') {
        Some(at) => match rest[..at].split_once(':') {
            Some((user, _)) => format!("{scheme}://{user}:***{}", &rest[at..]),
            None => spec.to_owned(),
        },
        None => spec.to_owned(),
    }
}

/// Whether `--source` names a PostgreSQL database.
pub fn is_postgres(spec: &str) -> bool {
    spec.starts_with("postgres://") || spec.starts_with("postgresql://")
}

impl AnySource {
    /// Parses `--source`; `follow` keeps the plan open (new objects, new rows).
    /// A `postgres://` source is refused here (see [`AnySource::connect`]).
    pub fn open(spec: &str, split_bytes: u64, split_rows: u64, follow: bool) -> anyhow::Result<Self> {
        let source = if let Some(dir) = spec.strip_prefix("files:") {
            if split_bytes == 0 {
                bail!("--split-size must be at least 1 byte");
            }
            AnySource::Files(FilesSource::open(dir, split_bytes)?)
        } else if let Some(rest) = spec.strip_prefix("sqlite:") {
            if split_rows == 0 {
                bail!("--split-rows must be at least 1");
            }
            AnySource::Sqlite(SqliteSource::open(rest, split_rows)?)
        } else if is_postgres(spec) {
            bail!("--source {spec:?}: a PostgreSQL source is opened with AnySource::connect")
        } else if let Some(dir) = spec.strip_prefix("parquet:") {
            if split_bytes == 0 {
                bail!("--split-size must be at least 1 byte");
            }
            if follow {
                bail!("--follow does not apply to parquet: sources (a Parquet job is a bounded backfill)");
            }
            AnySource::Parquet(ParquetSource::open(dir, split_bytes)?)
        } else {
            bail!(
                "--source {:?}: expected files:DIR, parquet:DIR, sqlite:PATH:TABLE or postgres://USER@HOST/DB",
                redact(spec)
            )
        };
        Ok(match source {
            AnySource::Files(f) if follow => AnySource::Files(f.follow()),
            AnySource::Sqlite(s) if follow => AnySource::Sqlite(s.follow()),
            other => other,
        })
    }
}

/// A files source's options: which objects are input (`--include`, `--exclude`,
/// `--include-hidden`) and whether big ones are cut in byte ranges (`--split-large-objects`).
#[derive(Clone, Debug, Default)]
pub struct Filters {
    /// Only keys matching one of these globs.
    pub include: Vec<String>,
    /// Not keys matching one of these globs.
    pub exclude: Vec<String>,
    /// Keys with a component starting with `_` or `.` too.
    pub include_hidden: bool,
    /// Cut uncompressed objects above the split size into byte ranges.
    pub split_large_objects: bool,
}

impl Filters {
    /// The first option set, by its flag.
    pub fn first_set(&self) -> Option<&'static str> {
        [
            ("--include", !self.include.is_empty()),
            ("--exclude", !self.exclude.is_empty()),
            ("--include-hidden", self.include_hidden),
            ("--split-large-objects", self.split_large_objects),
        ]
        .into_iter()
        .find_map(|(flag, set)| set.then_some(flag))
    }
}

impl AnySource {
    /// Applies `filters` to a files source; any filter on another source is refused, naming it.
    pub fn with_filters(self, filters: &Filters, follow: bool) -> anyhow::Result<Self> {
        match self {
            AnySource::Files(_) if filters.split_large_objects && follow => {
                bail!(
                    "--split-large-objects does not apply with --follow (every object is a split of its own)"
                )
            }
            AnySource::Files(f) => {
                let f = f.include(&filters.include).map_err(|e| anyhow::anyhow!("--include {e}"))?;
                let f = f.exclude(&filters.exclude).map_err(|e| anyhow::anyhow!("--exclude {e}"))?;
                Ok(AnySource::Files(
                    f.include_hidden(filters.include_hidden).split_large_objects(filters.split_large_objects),
                ))
            }
            AnySource::Parquet(_) if filters.split_large_objects => {
                bail!(
                    "--split-large-objects applies to files: sources only (a parquet: source is split by row groups)"
                )
            }
            AnySource::Parquet(p) => {
                let p = p.include(&filters.include).map_err(|e| anyhow::anyhow!("--include {e}"))?;
                let p = p.exclude(&filters.exclude).map_err(|e| anyhow::anyhow!("--exclude {e}"))?;
                Ok(AnySource::Parquet(p.include_hidden(filters.include_hidden)))
            }
            other
                if filters.include.is_empty()
                    && filters.exclude.is_empty()
                    && !filters.include_hidden
                    && !filters.split_large_objects =>
            {
                Ok(other)
            }
            _ => {
                let flag = filters.first_set().expect("a filter is set");
                bail!("{flag} applies to files: and parquet: sources only")
            }
        }
    }
}

impl AnySource {
    /// [`AnySource::open`] with the table options (`--key-column` for SQLite); a
    /// `postgres://` source is refused here (it connects: [`AnySource::connect`]).
    pub fn open_with(
        spec: &str,
        table: &TableArgs,
        split_bytes: u64,
        split_rows: u64,
        follow: bool,
    ) -> anyhow::Result<Self> {
        if let Some(problem) = table_args_problem(spec, table, split_rows) {
            bail!("{problem}");
        }
        match (spec.strip_prefix("sqlite:"), &table.key_column) {
            (Some(rest), Some(key)) => {
                if split_rows == 0 {
                    bail!("--split-rows must be at least 1");
                }
                let source = SqliteSource::open_keyed(rest, key, split_rows)?;
                Ok(AnySource::Sqlite(if follow { source.follow() } else { source }))
            }
            _ => AnySource::open(spec, split_bytes, split_rows, follow),
        }
    }

    /// `--source` with its table options: connects to a PostgreSQL database (checking the
    /// table, its key and the permission), or opens any other source as
    /// [`AnySource::open_with`] does.
    pub async fn connect(
        spec: &str,
        table: &TableArgs,
        split_bytes: u64,
        split_rows: u64,
        follow: bool,
    ) -> anyhow::Result<Self> {
        if !is_postgres(spec) {
            return AnySource::open_with(spec, table, split_bytes, split_rows, follow);
        }
        if let Some(problem) = table_args_problem(spec, table, split_rows) {
            bail!("{problem}");
        }
        let name = table.table.as_deref().expect("checked above");
        let key = table.key_column.as_deref().unwrap_or("id");
        let source = PostgresSource::connect(spec, name, key, split_rows).await?;
        Ok(AnySource::Postgres(if follow { source.follow() } else { source }))
    }
}

/// What is wrong with `--table` and `--key-column` for `spec`, before any connection.
pub fn table_args_problem(spec: &str, table: &TableArgs, split_rows: u64) -> Option<String> {
    if is_postgres(spec) {
        if table.table.is_none() {
            return Some("--table is required with a postgres:// source (name or schema.name)".into());
        }
        if split_rows == 0 {
            return Some("--split-rows must be at least 1".into());
        }
        if let Err(e) = etl_coordination_sources::postgres::check_url(spec) {
            return Some(format!("--source {e}"));
        }
        return None;
    }
    if table.table.is_some() {
        return Some(
            "--table applies to postgres:// sources only (sqlite: names its table in the source)".into(),
        );
    }
    if table.key_column.is_some() && !spec.starts_with("sqlite:") {
        return Some("--key-column applies to sqlite: and postgres:// sources only".into());
    }
    None
}

impl Planner for AnySource {
    fn fingerprint(&self) -> String {
        match self {
            AnySource::Files(s) => s.fingerprint(),
            AnySource::Sqlite(s) => s.fingerprint(),
            AnySource::Parquet(s) => s.fingerprint(),
            AnySource::Postgres(s) => s.fingerprint(),
        }
    }

    async fn plan(&self) -> Result<Plan, PlanError> {
        self.replan(&[]).await
    }

    async fn replan(&self, published: &[SplitId]) -> Result<Plan, PlanError> {
        match self {
            AnySource::Files(s) => s.replan(published).await,
            AnySource::Sqlite(s) => s.replan(published).await,
            AnySource::Parquet(s) => s.replan(published).await,
            AnySource::Postgres(s) => s.replan(published).await,
        }
    }
}

/// The progress of any source (stored as the source's own JSON: an object for files and
/// Parquet, a number for the database sources).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum AnyProgress {
    /// [`FileProgress`].
    Files(FileProgress),
    /// The last key read (SQLite, PostgreSQL).
    Key(i64),
    /// [`ParquetProgress`].
    Parquet(ParquetProgress),
}

impl Source for AnySource {
    type Record = Line;
    type Progress = AnyProgress;
    type Reader = AnyReader;

    async fn open(&self, lane: &LaneInfo, from: Option<AnyProgress>) -> Result<AnyReader, SourceError> {
        let mismatch =
            || SourceError::unprocessable("the committed progress belongs to another kind of source");
        Ok(match (self, from) {
            (AnySource::Files(s), None) => AnyReader::Files(s.open(lane, None).await?),
            (AnySource::Files(s), Some(AnyProgress::Files(p))) => {
                AnyReader::Files(s.open(lane, Some(p)).await?)
            }
            (AnySource::Sqlite(s), None) => AnyReader::Sqlite(s.open(lane, None).await?),
            (AnySource::Sqlite(s), Some(AnyProgress::Key(p))) => {
                AnyReader::Sqlite(s.open(lane, Some(p)).await?)
            }
            (AnySource::Postgres(s), None) => AnyReader::Postgres(Box::new(s.open(lane, None).await?)),
            (AnySource::Postgres(s), Some(AnyProgress::Key(p))) => {
                AnyReader::Postgres(Box::new(s.open(lane, Some(p)).await?))
            }
            (AnySource::Parquet(s), None) => AnyReader::Parquet(s.open(lane, None).await?),
            (AnySource::Parquet(s), Some(AnyProgress::Parquet(p))) => {
                AnyReader::Parquet(s.open(lane, Some(p)).await?)
            }
            _ => return Err(mismatch()),
        })
    }
}

/// A reader of [`AnySource`].
pub enum AnyReader {
    /// Files.
    Files(FilesReader),
    /// SQLite.
    Sqlite(SqliteReader),
    /// Parquet.
    Parquet(ParquetReader),
    /// PostgreSQL (boxed: its client and buffer make it the largest).
    Postgres(Box<PostgresReader>),
}

impl SplitReader for AnyReader {
    type Record = Line;
    type Progress = AnyProgress;

    async fn next(&mut self) -> NextRecord<Line, AnyProgress> {
        Ok(match self {
            AnyReader::Files(r) => r.next().await?.map(|(l, p)| (l, AnyProgress::Files(p))),
            AnyReader::Sqlite(r) => r.next().await?.map(|(l, p)| (l, AnyProgress::Key(p))),
            AnyReader::Parquet(r) => r.next().await?.map(|(l, p)| (l, AnyProgress::Parquet(p))),
            AnyReader::Postgres(r) => r.next().await?.map(|(l, p)| (l, AnyProgress::Key(p))),
        })
    }

    async fn next_batch(&mut self) -> NextBatch<Line, AnyProgress> {
        match self {
            // Parquet hands over a decoded batch of rows at once.
            AnyReader::Parquet(r) => Ok(r.next_batch().await?.map(|(b, p)| (b, AnyProgress::Parquet(p)))),
            _ => Ok(self.next().await?.map(|(record, progress)| (vec![record], progress))),
        }
    }

    fn position(&self, progress: &AnyProgress) -> Option<u64> {
        match (self, progress) {
            (AnyReader::Files(r), AnyProgress::Files(p)) => r.position(p),
            (AnyReader::Sqlite(r), AnyProgress::Key(p)) => r.position(p),
            (AnyReader::Parquet(r), AnyProgress::Parquet(p)) => r.position(p),
            (AnyReader::Postgres(r), AnyProgress::Key(p)) => r.position(p),
            _ => None,
        }
    }
}

/// Faults for tests, injected into any source's records.
#[derive(Clone, Debug, Default)]
pub struct Faults {
    /// Sleep per record.
    pub record_delay: Duration,
    /// Reaching a record containing this text aborts the process, like a crash.
    pub poison_marker: Option<String>,
    /// Reaching a record containing this text reports the split unprocessable.
    pub unprocessable_marker: Option<String>,
    /// Reading a record containing this text never returns, like a read on a connection that
    /// never answers: only a stop signal ends the lane.
    pub hang_marker: Option<String>,
}

impl Faults {
    /// Whether no fault is set.
    pub fn is_none(&self) -> bool {
        self.record_delay.is_zero()
            && self.poison_marker.is_none()
            && self.unprocessable_marker.is_none()
            && self.hang_marker.is_none()
    }
}

/// A source with [`Faults`].
#[derive(Clone, Debug)]
pub struct Faulty<S> {
    /// The source.
    pub source: S,
    /// Its faults.
    pub faults: Faults,
}

impl<S: Planner> Planner for Faulty<S> {
    fn fingerprint(&self) -> String {
        self.source.fingerprint()
    }

    async fn plan(&self) -> Result<Plan, PlanError> {
        self.source.plan().await
    }

    async fn replan(&self, published: &[SplitId]) -> Result<Plan, PlanError> {
        self.source.replan(published).await
    }
}

impl<S: Source<Record = Line>> Source for Faulty<S> {
    type Record = Line;
    type Progress = S::Progress;
    type Reader = FaultyReader<S::Reader>;

    async fn open(&self, lane: &LaneInfo, from: Option<S::Progress>) -> Result<Self::Reader, SourceError> {
        Ok(FaultyReader { inner: self.source.open(lane, from).await?, faults: self.faults.clone() })
    }
}

/// A reader with [`Faults`].
pub struct FaultyReader<R> {
    inner: R,
    faults: Faults,
}

impl<R: SplitReader<Record = Line>> SplitReader for FaultyReader<R> {
    type Record = Line;
    type Progress = R::Progress;

    async fn next(&mut self) -> NextRecord<Line, R::Progress> {
        let next = self.inner.next().await?;
        let Some((line, progress)) = next else { return Ok(None) };
        let has = |m: &Option<String>| m.as_deref().is_some_and(|m| line.content.contains(m));
        if has(&self.faults.poison_marker) {
            // Like a crash: no commit, no release. The lease expires and a peer retries.
            eprintln!("poison record {} reached: aborting the process", line.key);
            std::process::abort();
        }
        if has(&self.faults.unprocessable_marker) {
            return Err(SourceError::unprocessable(format!("record {} cannot be processed", line.key)));
        }
        if has(&self.faults.hang_marker) {
            tracing::debug!(record = %line.key, "the read hangs on this record (test fault)");
            std::future::pending::<()>().await;
        }
        if !self.faults.record_delay.is_zero() {
            tokio::time::sleep(self.faults.record_delay).await;
        }
        Ok(Some((line, progress)))
    }

    async fn next_batch(&mut self) -> NextBatch<Line, R::Progress> {
        if self.faults.is_none() {
            // Without faults, a batch reader's batches pass through whole.
            return self.inner.next_batch().await;
        }
        Ok(self.next().await?.map(|(record, progress)| (vec![record], progress)))
    }

    fn position(&self, progress: &R::Progress) -> Option<u64> {
        self.inner.position(progress)
    }
}
