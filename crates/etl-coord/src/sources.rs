//! The command's sources: the files and SQLite sources of `etl-coordination-sources`, chosen by
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
}

impl AnySource {
    /// Parses `--source`; `follow` keeps the plan open (new objects, new rows).
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
        } else if let Some(dir) = spec.strip_prefix("parquet:") {
            if split_bytes == 0 {
                bail!("--split-size must be at least 1 byte");
            }
            if follow {
                bail!("--follow does not apply to parquet: sources (a Parquet job is a bounded backfill)");
            }
            AnySource::Parquet(ParquetSource::open(dir, split_bytes)?)
        } else {
            bail!("--source {spec:?}: expected files:DIR, parquet:DIR or sqlite:PATH:TABLE")
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
                let flag = [
                    ("--include", !filters.include.is_empty()),
                    ("--exclude", !filters.exclude.is_empty()),
                    ("--include-hidden", filters.include_hidden),
                    ("--split-large-objects", filters.split_large_objects),
                ]
                .into_iter()
                .find_map(|(flag, set)| set.then_some(flag))
                .expect("a filter is set");
                bail!("{flag} applies to files: and parquet: sources only")
            }
        }
    }
}

impl Planner for AnySource {
    fn fingerprint(&self) -> String {
        match self {
            AnySource::Files(s) => s.fingerprint(),
            AnySource::Sqlite(s) => s.fingerprint(),
            AnySource::Parquet(s) => s.fingerprint(),
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
        }
    }
}

/// The progress of either source (stored as the source's own JSON: an object for files, a
/// number for SQLite).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum AnyProgress {
    /// [`FileProgress`].
    Files(FileProgress),
    /// The last id read.
    Sqlite(i64),
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
            (AnySource::Sqlite(s), Some(AnyProgress::Sqlite(p))) => {
                AnyReader::Sqlite(s.open(lane, Some(p)).await?)
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
}

impl SplitReader for AnyReader {
    type Record = Line;
    type Progress = AnyProgress;

    async fn next(&mut self) -> NextRecord<Line, AnyProgress> {
        Ok(match self {
            AnyReader::Files(r) => r.next().await?.map(|(l, p)| (l, AnyProgress::Files(p))),
            AnyReader::Sqlite(r) => r.next().await?.map(|(l, p)| (l, AnyProgress::Sqlite(p))),
            AnyReader::Parquet(r) => r.next().await?.map(|(l, p)| (l, AnyProgress::Parquet(p))),
        })
    }

    async fn next_batch(&mut self) -> NextBatch<Line, AnyProgress> {
        match self {
            // Parquet hands over a decoded batch of rows at once.
            AnyReader::Parquet(r) => Ok(r.next_batch().await?.map(|(b, p)| (b, AnyProgress::Parquet(p)))),
            _ => Ok(self.next().await?.map(|(record, progress)| (vec![record], progress))),
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
}
