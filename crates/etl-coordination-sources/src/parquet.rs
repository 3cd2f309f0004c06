//! The rows of the Parquet files under a location: a local directory, or (feature `cloud`) an
//! `s3://`, `gs://` or `az://` URL, read through the `parquet` crate's async object-store
//! reader.
//!
//! - **Planning** reads every file's footer (a bounded number at a time) and packs row groups,
//!   in path order, into splits of about `split_bytes` compressed bytes: small row groups (of
//!   one file or of several) share a split, and a row group is never cut (it is Parquet's unit
//!   of independent reading). A [`PlanKind::Final`] plan; split ids are a hash of what each split
//!   reads, so re-planning the same input is a no-op. Which objects are input is chosen as for
//!   the files source (hidden keys skipped, include and exclude globs); an object that is not
//!   Parquet fails planning, naming it.
//! - **Records**: each row as a JSON object ([`ParquetSource`], records are [`Line`]s keyed
//!   `path:row`, the row number within the file counted from 1), or (for embedders who want
//!   columns) Arrow record batches ([`ParquetSource::batches`]).
//! - **Progress** ([`ParquetProgress`]) is the part of the split, the row group and the rows of
//!   it read: a new owner resumes at that row (the rows before it in the row group are decoded
//!   and skipped; no row is emitted twice by one owner, none lost).
//!
//! Not supported: follow mode (every re-plan would read every footer again), and the brotli
//! codec (a file using it is unprocessable, naming the codec).

use std::collections::VecDeque;
use std::sync::Arc;

use ::parquet::arrow::async_reader::{
    AsyncFileReader, ParquetObjectReader, ParquetRecordBatchStream, ParquetRecordBatchStreamBuilder,
};
use ::parquet::errors::ParquetError;
use arrow_array::RecordBatch;
use bytes::Bytes;
use etl_coordination_driver::{
    LaneInfo, NextBatch, NextRecord, Plan, PlanError, PlanKind, PlannedSplit, Planner, Source, SourceError,
    SplitId, SplitReader,
};
use futures_util::{StreamExt, TryStreamExt};
use object_store::ObjectStore;
use object_store::path::Path as ObjectPath;
use serde::{Deserialize, Serialize};

use crate::Line;
use crate::files::{DESCRIPTOR_BUDGET, FilesError, FilesSource, fnv, store_error};

/// Rows per Arrow batch (and per batch handed to the sink) unless set.
pub const DEFAULT_BATCH_ROWS: usize = 1024;

/// The first request for a footer asks for this many bytes at the end of the file (most
/// footers fit, so one request reads a footer).
const FOOTER_HINT: usize = 64 * 1024;

/// Footers read at once while planning.
const PLANNING_READS: usize = 16;

/// The row groups of the Parquet files under a location, read as JSON objects.
#[derive(Clone, Debug)]
pub struct ParquetSource {
    files: FilesSource,
    batch_rows: usize,
}

/// A split's descriptor: runs of row groups, in read order.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ParquetSplit {
    /// The runs (a file's consecutive row groups each).
    pub parts: Vec<RowGroups>,
}

/// Consecutive row groups of one file.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RowGroups {
    /// The object.
    pub path: String,
    /// Its size when planned (a file that changed since is refused, not misread).
    pub size: u64,
    /// Its first row group in this split.
    pub first: usize,
    /// How many row groups from `first`.
    pub count: usize,
}

/// Progress within a Parquet split: the next row to read.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ParquetProgress {
    /// Index of the part ([`RowGroups`]) being read.
    pub part: usize,
    /// Row group of that part, counted from the part's first.
    pub group: usize,
    /// Rows of that row group read.
    pub row: u64,
}

/// The rows of a Parquet file from one row on, for the Arrow batch source.
#[derive(Clone, Debug)]
pub struct ParquetBatch {
    /// The object.
    pub path: String,
    /// The number of the batch's first row within the file, counted from 1.
    pub first_row: u64,
    /// The rows.
    pub batch: RecordBatch,
}

impl ParquetSource {
    /// The Parquet files under `location` (a local directory or, with feature `cloud`, an
    /// object-store URL, as [`FilesSource::open`]), row groups packed into splits of about
    /// `split_bytes` compressed bytes.
    pub fn open(location: &str, split_bytes: u64) -> Result<Self, FilesError> {
        Ok(ParquetSource { files: FilesSource::open(location, split_bytes)?, batch_rows: DEFAULT_BATCH_ROWS })
    }

    /// Only keys matching one of these globs are input (as [`FilesSource::include`]).
    pub fn include(mut self, globs: &[String]) -> Result<Self, FilesError> {
        self.files = self.files.include(globs)?;
        Ok(self)
    }

    /// Keys matching one of these globs are not input (as [`FilesSource::exclude`]).
    pub fn exclude(mut self, globs: &[String]) -> Result<Self, FilesError> {
        self.files = self.files.exclude(globs)?;
        Ok(self)
    }

    /// Read hidden objects too (as [`FilesSource::include_hidden`]).
    pub fn include_hidden(mut self, yes: bool) -> Self {
        self.files = self.files.include_hidden(yes);
        self
    }

    /// Rows per Arrow batch: a batch is decoded at once and handed to the sink in one
    /// `write_batch` (at least 1).
    pub fn batch_rows(mut self, rows: usize) -> Self {
        self.batch_rows = rows.max(1);
        self
    }

    /// The same splits read as Arrow record batches.
    pub fn batches(self) -> ParquetBatches {
        ParquetBatches(self)
    }

    /// Lists the input, reads every footer and packs row groups into splits (see the module
    /// documentation).
    pub async fn plan_splits(&self) -> Result<Vec<PlannedSplit>, FilesError> {
        let objects = self.files.list().await?;
        let store = self.files.store();
        let files: Vec<(String, u64, Vec<u64>)> = futures_util::stream::iter(objects)
            .map(|(path, size)| {
                let store = store.clone();
                async move {
                    let groups = footer(store, &path, size).await?;
                    Ok::<_, FilesError>((path, size, groups))
                }
            })
            .buffered(PLANNING_READS)
            .try_collect()
            .await?;
        Ok(pack(files, self.files.split_bytes()))
    }

    fn open_reader(
        &self,
        lane: &LaneInfo,
        from: Option<ParquetProgress>,
    ) -> Result<GroupsReader, SourceError> {
        let split: ParquetSplit = serde_json::from_slice(lane.descriptor())
            .map_err(|e| SourceError::unprocessable(format!("undecodable parquet descriptor: {e}")))?;
        Ok(GroupsReader {
            store: self.files.store(),
            split,
            at: from.unwrap_or_default(),
            batch_rows: self.batch_rows,
            current: None,
        })
    }
}

/// The compressed size of each row group of `path` (of `size` bytes), from its footer.
async fn footer(store: Arc<dyn ObjectStore>, path: &str, size: u64) -> Result<Vec<u64>, FilesError> {
    let mut reader = ParquetObjectReader::new(store, ObjectPath::from(path))
        .with_file_size(size)
        .with_footer_size_hint(FOOTER_HINT);
    let meta = reader.get_metadata(None).await.map_err(|e| {
        let (path, reason) = (path.to_owned(), etl_coordination_driver::error_chain(&e));
        // The object store's failure (throttled, denied, gone) is not the file's: no hint to
        // exclude it.
        match e {
            parquet::errors::ParquetError::External(_) => FilesError::FooterRead { path, reason },
            _ => FilesError::Footer { path, reason },
        }
    })?;
    Ok(meta.row_groups().iter().map(|g| u64::try_from(g.compressed_size()).unwrap_or(0)).collect())
}

/// Greedy packing of row groups in path order: groups join the current split until it would
/// exceed `target` compressed bytes or its descriptor [`DESCRIPTOR_BUDGET`]; a row group larger
/// than the target is a split of its own; a file without row groups has nothing to read.
pub fn pack(files: Vec<(String, u64, Vec<u64>)>, target: u64) -> Vec<PlannedSplit> {
    let mut splits = Vec::new();
    let mut parts: Vec<RowGroups> = Vec::new();
    let (mut bytes, mut described) = (0u64, 0usize);
    let flush = |parts: &mut Vec<RowGroups>, splits: &mut Vec<PlannedSplit>, bytes: u64| {
        if parts.is_empty() {
            return;
        }
        let parts = std::mem::take(parts);
        let identity: Vec<String> =
            parts.iter().map(|p| format!("{}\0{}\0{}\0{}", p.path, p.size, p.first, p.count)).collect();
        let id = fnv(identity.iter().map(String::as_str));
        let descriptor = Bytes::from(serde_json::to_vec(&ParquetSplit { parts }).expect("serializable"));
        splits.push(PlannedSplit::new(
            SplitId::new(format!("p-{id:016x}")).expect("hex ids are valid"),
            descriptor,
            bytes.max(1),
        ));
    };
    for (path, size, groups) in files {
        // A new part's entry: `{"path":"...","size":N,"first":N,"count":N},`.
        let entry = serde_json::to_string(&path).map_or(path.len() * 6 + 2, |q| q.len()) + 80;
        for (i, group_bytes) in groups.into_iter().enumerate() {
            let same_file = parts.last().is_some_and(|p| p.path == path && p.first + p.count == i);
            let grows = if same_file { 0 } else { entry };
            if !parts.is_empty() && (bytes + group_bytes > target || described + grows > DESCRIPTOR_BUDGET) {
                flush(&mut parts, &mut splits, bytes);
                (bytes, described) = (0, 0);
            }
            match parts.last_mut() {
                Some(p) if p.path == path && p.first + p.count == i => p.count += 1,
                _ => {
                    parts.push(RowGroups { path: path.clone(), size, first: i, count: 1 });
                    described += entry;
                }
            }
            bytes += group_bytes;
        }
    }
    flush(&mut parts, &mut splits, bytes);
    splits
}

impl Planner for ParquetSource {
    fn fingerprint(&self) -> String {
        // The files source's options (location, split size, filters) under another format name.
        let files = self.files.fingerprint();
        format!("parquet/v1 {}", files.strip_prefix("files/v1 ").unwrap_or(&files))
    }

    async fn plan(&self) -> Result<Plan, PlanError> {
        let splits = self.plan_splits().await.map_err(|e| PlanError::from_error(&e))?;
        Ok(Plan::new(PlanKind::Final, splits))
    }
}

impl Source for ParquetSource {
    type Record = Line;
    type Progress = ParquetProgress;
    type Reader = ParquetReader;

    async fn open(
        &self,
        lane: &LaneInfo,
        from: Option<ParquetProgress>,
    ) -> Result<ParquetReader, SourceError> {
        Ok(ParquetReader { groups: self.open_reader(lane, from)?, pending: VecDeque::new() })
    }
}

/// The same splits as [`ParquetSource`], read as Arrow record batches.
#[derive(Clone, Debug)]
pub struct ParquetBatches(ParquetSource);

impl Planner for ParquetBatches {
    fn fingerprint(&self) -> String {
        self.0.fingerprint()
    }

    async fn plan(&self) -> Result<Plan, PlanError> {
        self.0.plan().await
    }
}

impl Source for ParquetBatches {
    type Record = ParquetBatch;
    type Progress = ParquetProgress;
    type Reader = ParquetBatchReader;

    async fn open(
        &self,
        lane: &LaneInfo,
        from: Option<ParquetProgress>,
    ) -> Result<ParquetBatchReader, SourceError> {
        Ok(ParquetBatchReader(self.0.open_reader(lane, from)?))
    }
}

/// The part being read: its batches, and the rows of each of its row groups.
struct Part {
    /// Its index in the split.
    index: usize,
    batches: ParquetRecordBatchStream<ParquetObjectReader>,
    /// Rows of each row group of the part.
    rows: Vec<u64>,
    /// The file's row number of the part's first row group's first row, less one.
    base: u64,
}

/// Reads a split's row groups as Arrow batches, tracking the next row.
struct GroupsReader {
    store: Arc<dyn ObjectStore>,
    split: ParquetSplit,
    /// The next row.
    at: ParquetProgress,
    batch_rows: usize,
    current: Option<Part>,
}

impl GroupsReader {
    /// The next batch and the progress before it (the part it belongs to stays open until the
    /// next call; the progress after it is `self.at`).
    async fn next_batch(&mut self) -> Result<Option<(ParquetBatch, ParquetProgress)>, SourceError> {
        loop {
            // A part whose rows are all read is done (its stream would only end now).
            if self.current.as_ref().is_some_and(|c| c.index != self.at.part) {
                self.current = None;
            }
            let Some(part) = self.split.parts.get(self.at.part).cloned() else {
                return Ok(None);
            };
            if self.current.is_none() {
                if self.at.group >= part.count {
                    self.at = ParquetProgress { part: self.at.part + 1, group: 0, row: 0 };
                    continue;
                }
                let opened = open_part(self.store.clone(), &part, self.at, self.batch_rows).await?;
                self.current = Some(Part { index: self.at.part, ..opened });
            }
            let current = self.current.as_mut().expect("opened above");
            let batch = match current.batches.try_next().await {
                Ok(Some(batch)) => batch,
                Ok(None) => {
                    // The stream ended where the footer promised more rows: never skip them.
                    let left = current.rows[self.at.group..].iter().sum::<u64>().saturating_sub(self.at.row);
                    self.current = None;
                    if left > 0 {
                        return Err(SourceError::unprocessable(format!(
                            "{}: the reader ended {left} rows short of what its footer says",
                            part.path
                        )));
                    }
                    self.at = ParquetProgress { part: self.at.part + 1, group: 0, row: 0 };
                    continue;
                }
                Err(e) => {
                    // A failed stream is done: the next call opens the part again at `at`.
                    self.current = None;
                    return Err(parquet_error(&part.path, e));
                }
            };
            if batch.num_rows() == 0 {
                continue;
            }
            let before: u64 = current.rows[..self.at.group].iter().sum();
            let first_row = current.base + before + self.at.row + 1;
            let start = self.at;
            self.at = advance(&current.rows, start, batch.num_rows() as u64);
            return Ok(Some((ParquetBatch { path: part.path, first_row, batch }, start)));
        }
    }
}

/// Opens `part` at `at` (its row group, then its row). A free function: the reader's state is
/// not `Sync`, so no reference to it may live across an await.
async fn open_part(
    store: Arc<dyn ObjectStore>,
    part: &RowGroups,
    at: ParquetProgress,
    batch_rows: usize,
) -> Result<Part, SourceError> {
    // A file that changed size since it was planned is refused, not misread (a remote store
    // would answer a range past a shrunk file's end with an error that reads as an outage).
    let path = ObjectPath::from(part.path.as_str());
    let head = store.head(&path).await.map_err(|e| store_error(&part.path, e))?;
    if head.size != part.size {
        return Err(SourceError::unprocessable(format!(
            "{}: {} bytes, the plan read {} (the file changed after it was planned)",
            part.path, head.size, part.size
        )));
    }
    let reader =
        ParquetObjectReader::new(store, path).with_file_size(part.size).with_footer_size_hint(FOOTER_HINT);
    let builder =
        ParquetRecordBatchStreamBuilder::new(reader).await.map_err(|e| parquet_error(&part.path, e))?;
    let groups = builder.metadata().row_groups();
    if part.first + part.count > groups.len() {
        return Err(SourceError::unprocessable(format!(
            "{}: has {} row groups, the plan reads {}..{} (the file changed after it was planned)",
            part.path,
            groups.len(),
            part.first,
            part.first + part.count
        )));
    }
    let rows: Vec<u64> = groups[part.first..part.first + part.count]
        .iter()
        .map(|g| u64::try_from(g.num_rows()).unwrap_or(0))
        .collect();
    let base = groups[..part.first].iter().map(|g| u64::try_from(g.num_rows()).unwrap_or(0)).sum();
    let from = part.first + at.group;
    let offset = usize::try_from(at.row).map_err(|_| SourceError::unprocessable("row offset too large"))?;
    let batches = builder
        .with_row_groups((from..part.first + part.count).collect())
        .with_offset(offset)
        .with_batch_size(batch_rows)
        .build()
        .map_err(|e| parquet_error(&part.path, e))?;
    Ok(Part { index: 0, batches, rows, base })
}

/// The position `n` rows past `at` among row groups of `rows` rows: always a row group's row
/// before its end, or the next part's start once the part is read (so that a resume never
/// opens a part that is done).
fn advance(rows: &[u64], at: ParquetProgress, n: u64) -> ParquetProgress {
    let (mut group, mut row) = (at.group, at.row + n);
    while group < rows.len() && row >= rows[group] {
        row -= rows[group];
        group += 1;
    }
    if group >= rows.len() {
        ParquetProgress { part: at.part + 1, group: 0, row: 0 }
    } else {
        ParquetProgress { part: at.part, group, row }
    }
}

/// A Parquet reader's error as a source reports it: the object store's errors as the files
/// source judges them (a missing object fails, throttling is an outage), anything else (not
/// Parquet, corrupt, a codec not built in) makes the split unprocessable.
fn parquet_error(path: &str, e: ParquetError) -> SourceError {
    if let ParquetError::External(inner) = e {
        return match inner.downcast::<object_store::Error>() {
            Ok(store) => store_error(path, *store),
            Err(other) => SourceError::unprocessable(format!("reading {path}: {other}")),
        };
    }
    SourceError::unprocessable(format!("reading {path}: {}", etl_coordination_driver::error_chain(&e)))
}

/// Reads a Parquet split row by row as JSON objects (batches of rows at a time).
pub struct ParquetReader {
    groups: GroupsReader,
    pending: VecDeque<(Line, ParquetProgress)>,
}

impl ParquetReader {
    /// The next batch's rows as lines, each with the progress after it.
    async fn fill(&mut self) -> Result<bool, SourceError> {
        let Some((batch, before)) = self.groups.next_batch().await? else {
            return Ok(false);
        };
        let rows = &self.groups.current.as_ref().expect("the batch's part is open").rows;
        let json = json_rows(&batch)?;
        if json.len() != batch.batch.num_rows() {
            return Err(SourceError::unprocessable(format!(
                "{}: {} rows came out as {} JSON objects",
                batch.path,
                batch.batch.num_rows(),
                json.len()
            )));
        }
        for (i, content) in json.into_iter().enumerate() {
            let progress = advance(rows, before, i as u64 + 1);
            let key = format!("{}:{}", batch.path, batch.first_row + i as u64);
            self.pending.push_back((Line { key, content }, progress));
        }
        Ok(true)
    }
}

/// Each row of `batch` as a JSON object's text (nulls written as `null`).
fn json_rows(batch: &ParquetBatch) -> Result<Vec<String>, SourceError> {
    let mut buf = Vec::new();
    let mut writer = arrow_json::WriterBuilder::new()
        .with_explicit_nulls(true)
        .build::<_, arrow_json::writer::LineDelimited>(&mut buf);
    writer.write(&batch.batch).and_then(|()| writer.finish()).map_err(|e| {
        SourceError::unprocessable(format!("{}: a row cannot be written as JSON: {e}", batch.path))
    })?;
    drop(writer);
    let text =
        String::from_utf8(buf).map_err(|e| SourceError::unprocessable(format!("{}: {e}", batch.path)))?;
    Ok(text.lines().map(str::to_owned).collect())
}

impl SplitReader for ParquetReader {
    type Record = Line;
    type Progress = ParquetProgress;

    async fn next(&mut self) -> NextRecord<Line, ParquetProgress> {
        if self.pending.is_empty() && !self.fill().await? {
            return Ok(None);
        }
        Ok(self.pending.pop_front())
    }

    async fn next_batch(&mut self) -> NextBatch<Line, ParquetProgress> {
        if self.pending.is_empty() && !self.fill().await? {
            return Ok(None);
        }
        let progress = self.pending.back().map(|(_, p)| *p).expect("filled");
        Ok(Some((self.pending.drain(..).map(|(line, _)| line).collect(), progress)))
    }
}

/// Reads a Parquet split as Arrow record batches.
pub struct ParquetBatchReader(GroupsReader);

impl SplitReader for ParquetBatchReader {
    type Record = ParquetBatch;
    type Progress = ParquetProgress;

    async fn next(&mut self) -> NextRecord<ParquetBatch, ParquetProgress> {
        Ok(self.0.next_batch().await?.map(|(batch, _)| (batch, self.0.at)))
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use arrow_array::{ArrayRef, BooleanArray, Int64Array, StringArray, TimestampMicrosecondArray};
    use etl_coordination_driver::{Epoch, InstanceId};

    use super::*;

    /// A Parquet file of `rows` rows (`id`, `name`, a nullable `score`, `ok`, `at` with a time
    /// zone) in row groups of `group_rows`, written by the parquet crate itself.
    fn write_parquet(path: &std::path::Path, first_id: i64, rows: usize, group_rows: usize) {
        let ids: Vec<i64> = (first_id..first_id + rows as i64).collect();
        let columns: Vec<(&str, ArrayRef)> = vec![
            ("id", Arc::new(Int64Array::from(ids.clone()))),
            ("name", Arc::new(StringArray::from(ids.iter().map(|i| format!("n\"{i}")).collect::<Vec<_>>()))),
            (
                "score",
                Arc::new(Int64Array::from(
                    ids.iter().map(|i| (i % 3 != 0).then_some(*i * 10)).collect::<Vec<_>>(),
                )),
            ),
            ("ok", Arc::new(BooleanArray::from(ids.iter().map(|i| i % 2 == 0).collect::<Vec<_>>()))),
            (
                "at",
                Arc::new(
                    TimestampMicrosecondArray::from(
                        ids.iter().map(|i| 1_700_000_000_000_000 + i).collect::<Vec<_>>(),
                    )
                    .with_timezone("+00:00"),
                ),
            ),
        ];
        let batch = RecordBatch::try_from_iter(columns).unwrap();
        let props = ::parquet::file::properties::WriterProperties::builder()
            .set_max_row_group_size(group_rows)
            .build();
        let file = std::fs::File::create(path).unwrap();
        let mut w = ::parquet::arrow::ArrowWriter::try_new(file, batch.schema(), Some(props)).unwrap();
        w.write(&batch).unwrap();
        w.close().unwrap();
    }

    fn lane(split: &PlannedSplit) -> LaneInfo {
        LaneInfo::new(split.id.clone(), Epoch(1), InstanceId::new("t").unwrap(), split.descriptor.clone(), 1)
    }

    /// Every row of `split` from `from`, with the progress after each (row by row).
    async fn read_all(
        src: &ParquetSource,
        split: &PlannedSplit,
        from: Option<ParquetProgress>,
    ) -> Vec<(Line, ParquetProgress)> {
        let mut r = src.open(&lane(split), from).await.unwrap();
        let mut out = Vec::new();
        while let Some(rec) = r.next().await.unwrap() {
            out.push(rec);
        }
        out
    }

    /// Three files of 25, 7 and 40 rows in row groups of 10, 3 and 40 rows.
    fn three_files() -> tempfile::TempDir {
        let dir = tempfile::tempdir().unwrap();
        write_parquet(&dir.path().join("a.parquet"), 0, 25, 10);
        std::fs::create_dir(dir.path().join("sub")).unwrap();
        write_parquet(&dir.path().join("sub/b.parquet"), 100, 7, 3);
        write_parquet(&dir.path().join("sub/c.parquet"), 200, 40, 40);
        std::fs::write(dir.path().join("_SUCCESS"), "").unwrap();
        dir
    }

    #[tokio::test]
    async fn row_groups_are_packed_into_splits_and_every_row_is_read_once_as_json() {
        let dir = three_files();
        let location = dir.path().to_str().unwrap();
        // One split for everything, then a target small enough to cut between row groups.
        for (target, at_least) in [(1 << 30, 1), (1, 7)] {
            let src = ParquetSource::open(location, target).unwrap().batch_rows(4);
            let splits = src.plan_splits().await.unwrap();
            assert!(splits.len() >= at_least, "{} splits at {target}", splits.len());
            let mut keys = Vec::new();
            let mut ids = Vec::new();
            for split in &splits {
                for (line, _) in read_all(&src, split, None).await {
                    let row: serde_json::Value = serde_json::from_str(&line.content).unwrap();
                    ids.push(row["id"].as_i64().unwrap());
                    keys.push(line.key);
                }
            }
            let mut expected: Vec<i64> = (0..25).chain(100..107).chain(200..240).collect();
            ids.sort_unstable();
            expected.sort_unstable();
            assert_eq!(ids, expected, "every row once at target {target}");
            assert!(
                keys.contains(&"a.parquet:1".to_owned()) && keys.contains(&"sub/c.parquet:40".to_owned())
            );
        }
        // Row groups of 10, 10, 5 (a), 3, 3, 1 (b), 40 (c): one split each at a 1-byte target.
        let src = ParquetSource::open(location, 1).unwrap();
        assert_eq!(src.plan_splits().await.unwrap().len(), 7, "a row group is never cut");
    }

    #[tokio::test]
    async fn columns_become_json_values_with_nulls_written() {
        let dir = tempfile::tempdir().unwrap();
        write_parquet(&dir.path().join("a.parquet"), 3, 2, 10);
        let src = ParquetSource::open(dir.path().to_str().unwrap(), 1 << 20).unwrap();
        let split = src.plan_splits().await.unwrap().remove(0);
        let rows = read_all(&src, &split, None).await;
        let first: serde_json::Value = serde_json::from_str(&rows[0].0.content).unwrap();
        assert_eq!(rows[0].0.key, "a.parquet:1");
        assert_eq!(first["id"], 3);
        assert_eq!(first["name"], "n\"3");
        assert_eq!(first["score"], serde_json::Value::Null, "a null is written, not left out");
        assert_eq!(first["ok"], false);
        let at = first["at"].as_str().unwrap();
        assert!(at.starts_with("2023-11-14T22:13:20.000003"), "{at}");
        let second: serde_json::Value = serde_json::from_str(&rows[1].0.content).unwrap();
        assert_eq!((second["score"].as_i64(), second["ok"].as_bool()), (Some(40), Some(true)));
    }

    /// A resume after any row (mid row group, at a row group's end, at a part's end) reads
    /// exactly the rest.
    #[tokio::test]
    async fn a_resume_after_any_row_reads_exactly_the_rest() {
        let dir = three_files();
        let src = ParquetSource::open(dir.path().to_str().unwrap(), 1 << 30).unwrap().batch_rows(4);
        let split = src.plan_splits().await.unwrap().remove(0);
        let all = read_all(&src, &split, None).await;
        assert_eq!(all.len(), 72);
        for k in 0..all.len() {
            let rest = read_all(&src, &split, Some(all[k].1)).await;
            let got: Vec<&str> = rest.iter().map(|(l, _)| l.key.as_str()).collect();
            let want: Vec<&str> = all[k + 1..].iter().map(|(l, _)| l.key.as_str()).collect();
            assert_eq!(got, want, "resumed after row {k} at {:?}", all[k].1);
        }
        // The batch path hands a batch with the progress after its last row.
        let mut r = src.open(&lane(&split), Some(all[12].1)).await.unwrap();
        let (batch, progress) = r.next_batch().await.unwrap().unwrap();
        assert_eq!(batch.first().unwrap().key, all[13].0.key);
        assert_eq!(progress, all[12 + batch.len()].1);
    }

    #[tokio::test]
    async fn arrow_batches_carry_the_rows_and_their_numbers() {
        let dir = three_files();
        let src = ParquetSource::open(dir.path().to_str().unwrap(), 1 << 30).unwrap().batch_rows(4).batches();
        let split = src.0.plan_splits().await.unwrap().remove(0);
        let mut r = src.open(&lane(&split), None).await.unwrap();
        let mut rows = 0;
        let mut firsts = Vec::new();
        while let Some((b, _)) = r.next().await.unwrap() {
            firsts.push((b.path.clone(), b.first_row));
            rows += b.batch.num_rows();
        }
        assert_eq!(rows, 72);
        assert_eq!(
            &firsts[..4],
            [
                ("a.parquet".into(), 1),
                ("a.parquet".into(), 5),
                ("a.parquet".into(), 9),
                ("a.parquet".into(), 11)
            ]
        );
    }

    #[tokio::test]
    async fn an_object_that_is_not_parquet_fails_planning_by_name_and_a_changed_file_is_unprocessable() {
        let dir = three_files();
        std::fs::write(dir.path().join("README.txt"), "not parquet\n").unwrap();
        let location = dir.path().to_str().unwrap();
        let err =
            ParquetSource::open(location, 1 << 20).unwrap().plan_splits().await.unwrap_err().to_string();
        assert!(err.contains("README.txt") && err.contains("--include"), "{err}");
        let src = ParquetSource::open(location, 1).unwrap().include(&["**/*.parquet".into()]).unwrap();
        let splits = src.plan_splits().await.unwrap();
        // The file is rewritten with fewer row groups after planning.
        write_parquet(&dir.path().join("a.parquet"), 0, 5, 10);
        let mut r = src.open(&lane(&splits[1]), None).await.unwrap();
        let err = loop {
            match r.next().await {
                Ok(Some(_)) => {}
                Ok(None) => panic!("read a changed file to its end"),
                Err(e) => break e,
            }
        };
        assert!(matches!(err, SourceError::Unprocessable(_)), "{err:?}");
        assert!(err.to_string().contains("a.parquet"), "{err}");
    }

    #[test]
    fn packing_keeps_descriptors_small_and_runs_whole() {
        let files: Vec<(String, u64, Vec<u64>)> =
            (0..5_000).map(|i| (format!("year=2024/part-{i:05}.parquet"), 100, vec![10, 10])).collect();
        let splits = pack(files, 1 << 30);
        assert!(splits.len() > 1, "cut by descriptor size");
        let mut groups = 0;
        for s in &splits {
            assert!(s.descriptor.len() <= DESCRIPTOR_BUDGET + 200, "{}", s.descriptor.len());
            let d: ParquetSplit = serde_json::from_slice(&s.descriptor).unwrap();
            groups += d.parts.iter().map(|p| p.count).sum::<usize>();
            assert!(d.parts.iter().all(|p| p.count == 2), "a file's two groups stay together here");
        }
        assert_eq!(groups, 10_000);
        let big = pack(vec![("a".into(), 1, vec![500, 5, 5, 500])], 100);
        let counts: Vec<u64> = big.iter().map(|s| s.weight).collect();
        assert_eq!(counts, [500, 10, 500], "small groups share, big ones stand alone");
        assert!(pack(vec![("empty".into(), 4, vec![])], 100).is_empty(), "no row groups, no split");
    }
}
