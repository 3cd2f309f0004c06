//! A range scan over a SQLite table: the table's rows in balanced ranges of its integer `id`
//! column (e.g. the rowid alias `id INTEGER PRIMARY KEY`); records are rows rendered as text
//! ([`Line`]: `table:id`, the columns separated by tabs); progress is the last id read. Reads run
//! on tokio's blocking pool.
//!
//! - **Backfill** ([`SqliteSource::open`]): ranges of `split_rows` rows each over the rows there
//!   are at planning time; a [`PlanKind::Final`] plan.
//! - **Follow** ([`SqliteSource::follow`]): a [`PlanKind::Open`] plan. Each re-plan adds ranges
//!   for the rows past the last planned id (read from the published splits' ids, which carry
//!   their ranges), so rows inserted with growing ids are picked up and none is planned twice.
//!   Rows inserted later with ids below a planned range's end are not picked up.

use std::path::PathBuf;

use bytes::Bytes;
use etl_coordination_driver::{
    LaneInfo, NextRecord, Plan, PlanError, PlanKind, PlannedSplit, Planner, Source, SourceError, SplitId,
    SplitReader, error_chain,
};
use rusqlite::types::ValueRef;
use serde::{Deserialize, Serialize};

use crate::Line;

/// Default rows per split.
pub const DEFAULT_SPLIT_ROWS: u64 = 100_000;

/// Rows fetched per query while reading a split.
const BATCH: i64 = 500;

/// The table cannot be opened.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SqliteError {
    /// Not `PATH:TABLE`.
    #[error("{0:?}: expected PATH:TABLE")]
    Spec(String),
    /// A table name with characters other than `[A-Za-z0-9_]`.
    #[error("table name {0:?}: only [A-Za-z0-9_] is accepted")]
    TableName(String),
    /// A split size of 0.
    #[error("split_rows must be at least 1")]
    ZeroSplitRows,
    /// The database or table cannot be read.
    #[error("{0}")]
    Database(String),
}

/// A SQLite table to scan.
#[derive(Clone, Debug)]
pub struct SqliteSource {
    path: PathBuf,
    table: String,
    split_rows: u64,
    follow: bool,
}

/// A split's descriptor: the id range `[lo, hi)`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct IdRange {
    /// First id (inclusive).
    pub lo: i64,
    /// End (exclusive).
    pub hi: i64,
}

impl SqliteSource {
    /// A backfill of `PATH:TABLE` (the table must exist and have an integer `id` column).
    pub fn open(spec: &str, split_rows: u64) -> Result<Self, SqliteError> {
        let Some((path, table)) = spec.rsplit_once(':') else {
            return Err(SqliteError::Spec(spec.to_owned()));
        };
        if table.is_empty() || !table.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_') {
            return Err(SqliteError::TableName(table.to_owned()));
        }
        if split_rows == 0 {
            return Err(SqliteError::ZeroSplitRows);
        }
        let source =
            SqliteSource { path: PathBuf::from(path), table: table.to_owned(), split_rows, follow: false };
        let conn = source.connect()?;
        conn.query_row(&format!("SELECT COUNT(id) FROM \"{}\"", source.table), [], |r| r.get::<_, i64>(0))
            .map_err(|e| {
                SqliteError::Database(format!(
                    "table {table:?} in {path} must exist and have an integer id column: {e}"
                ))
            })?;
        Ok(source)
    }

    /// Follow mode: an open plan that adds ranges for new rows (see the module documentation).
    pub fn follow(mut self) -> Self {
        self.follow = true;
        self
    }

    fn connect(&self) -> Result<rusqlite::Connection, SqliteError> {
        rusqlite::Connection::open_with_flags(&self.path, rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY).map_err(
            |e| SqliteError::Database(format!("opening SQLite database {}: {e}", self.path.display())),
        )
    }

    /// Balanced id ranges of `split_rows` rows each, over the rows with ids at least `from`.
    /// Ids are the range bounds, so that a later planning round can tell where the earlier
    /// ones ended.
    pub fn plan_splits(&self, from: i64) -> Result<Vec<PlannedSplit>, SqliteError> {
        let db = |e: rusqlite::Error| SqliteError::Database(error_chain(&e));
        let conn = self.connect()?;
        let t = &self.table;
        let (count, max): (i64, Option<i64>) = conn
            .query_row(&format!("SELECT COUNT(*), MAX(id) FROM \"{t}\" WHERE id >= ?1"), [from], |r| {
                Ok((r.get(0)?, r.get(1)?))
            })
            .map_err(db)?;
        let Some(max) = max else { return Ok(Vec::new()) };
        let mut bounds = vec![from];
        let mut offset = self.split_rows as i64;
        while offset < count {
            let id: i64 = conn
                .query_row(
                    &format!("SELECT id FROM \"{t}\" WHERE id >= ?1 ORDER BY id LIMIT 1 OFFSET ?2"),
                    [from, offset],
                    |r| r.get(0),
                )
                .map_err(db)?;
            bounds.push(id);
            offset += self.split_rows as i64;
        }
        bounds.push(max.saturating_add(1));
        let full = bounds.len() - 2;
        Ok(bounds
            .windows(2)
            .enumerate()
            .map(|(i, w)| {
                let range = IdRange { lo: w[0], hi: w[1] };
                let rows = if i < full { self.split_rows } else { (count as u64 - 1) % self.split_rows + 1 };
                PlannedSplit::new(
                    range_id(t, range),
                    Bytes::from(serde_json::to_vec(&range).expect("serializable")),
                    rows,
                )
            })
            .collect())
    }
}

/// A range's split id: `r-TABLE-LO-HI`, a negative bound written with `m` for its minus sign
/// (`-5` is `m5`, so `-` only separates; `i64::MIN` is `min`).
fn range_id(table: &str, r: IdRange) -> SplitId {
    let n = |v: i64| match v {
        i64::MIN => "min".to_owned(),
        v if v < 0 => format!("m{}", v.unsigned_abs()),
        v => v.to_string(),
    };
    SplitId::new(format!("r-{table}-{}-{}", n(r.lo), n(r.hi))).expect("valid id")
}

/// The end of the range a split id of this table names.
fn range_end(table: &str, id: &SplitId) -> Option<i64> {
    let hi = id.as_str().strip_prefix(&format!("r-{table}-"))?.rsplit_once('-')?.1;
    match hi.strip_prefix('m') {
        Some("in") => Some(i64::MIN),
        Some(abs) => abs.parse::<i64>().ok().map(|v| -v),
        None => hi.parse().ok(),
    }
}

impl Planner for SqliteSource {
    fn fingerprint(&self) -> String {
        let mode = if self.follow { " follow" } else { "" };
        format!(
            "sqlite/v3 db={} table={} split_rows={}{mode}",
            self.path.display(),
            self.table,
            self.split_rows
        )
    }

    async fn plan(&self) -> Result<Plan, PlanError> {
        self.replan(&[]).await
    }

    async fn replan(&self, published: &[SplitId]) -> Result<Plan, PlanError> {
        // A follow round starts where the published ranges end; a backfill plans everything.
        let from = if self.follow {
            published.iter().filter_map(|id| range_end(&self.table, id)).max().unwrap_or(i64::MIN)
        } else {
            i64::MIN
        };
        let source = self.clone();
        let splits = tokio::task::spawn_blocking(move || source.plan_splits(from))
            .await
            .map_err(|e| PlanError::from_error(&e))?
            .map_err(|e| PlanError::from_error(&e))?;
        Ok(Plan::new(if self.follow { PlanKind::Open } else { PlanKind::Final }, splits))
    }
}

impl Source for SqliteSource {
    type Record = Line;
    type Progress = i64;
    type Reader = SqliteReader;

    async fn open(&self, lane: &LaneInfo, from: Option<i64>) -> Result<SqliteReader, SourceError> {
        let range: IdRange = serde_json::from_slice(lane.descriptor())
            .map_err(|e| SourceError::unprocessable(format!("undecodable sqlite descriptor: {e}")))?;
        Ok(SqliteReader { source: self.clone(), range, after: from, buffer: Vec::new(), done: false })
    }
}

/// Reads an id range in batches.
pub struct SqliteReader {
    source: SqliteSource,
    range: IdRange,
    after: Option<i64>,
    buffer: Vec<(i64, String)>,
    done: bool,
}

impl SqliteReader {
    /// The next batch of rows after `after`, rendered.
    fn batch(
        source: &SqliteSource,
        range: IdRange,
        after: Option<i64>,
    ) -> Result<Vec<(i64, String)>, SqliteError> {
        let db = |e: rusqlite::Error| SqliteError::Database(error_chain(&e));
        let conn = source.connect()?;
        let sql = format!(
            "SELECT * FROM \"{}\" WHERE id >= ?1 AND id > ?2 AND id < ?3 ORDER BY id LIMIT ?4",
            source.table
        );
        let mut stmt = conn.prepare(&sql).map_err(db)?;
        let idx = stmt.column_index("id").map_err(db)?;
        let n = stmt.column_count();
        let rows = stmt
            .query_map((range.lo, after.unwrap_or(i64::MIN), range.hi, BATCH), |row| {
                let id: i64 = row.get(idx)?;
                let mut text = Vec::with_capacity(n);
                for i in 0..n {
                    text.push(match row.get_ref(i)? {
                        ValueRef::Null => "null".to_owned(),
                        ValueRef::Integer(v) => v.to_string(),
                        ValueRef::Real(v) => v.to_string(),
                        ValueRef::Text(t) => String::from_utf8_lossy(t).into_owned(),
                        ValueRef::Blob(b) => format!("<{} bytes>", b.len()),
                    });
                }
                Ok((id, text.join("\t")))
            })
            .map_err(db)?;
        rows.collect::<Result<Vec<_>, _>>().map_err(db)
    }
}

impl SplitReader for SqliteReader {
    type Record = Line;
    type Progress = i64;

    async fn next(&mut self) -> NextRecord<Line, i64> {
        if self.buffer.is_empty() && !self.done {
            let (source, range, after) = (self.source.clone(), self.range, self.after);
            let rows = tokio::task::spawn_blocking(move || Self::batch(&source, range, after))
                .await
                .map_err(SourceError::failed)?
                .map_err(SourceError::failed)?;
            if (rows.len() as i64) < BATCH {
                self.done = true;
            }
            self.buffer = rows;
            self.buffer.reverse();
        }
        let Some((id, content)) = self.buffer.pop() else { return Ok(None) };
        self.after = Some(id);
        Ok(Some((Line { key: format!("{}:{id}", self.source.table), content }, id)))
    }
}

#[cfg(test)]
mod tests {
    use etl_coordination_driver::{Epoch, InstanceId};

    use super::*;

    fn db(rows: i64) -> (tempfile::TempDir, PathBuf, String) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.db");
        let conn = rusqlite::Connection::open(&path).unwrap();
        conn.execute_batch("CREATE TABLE orders (id INTEGER PRIMARY KEY, item TEXT)").unwrap();
        insert(&path, 0..rows);
        let spec = format!("{}:orders", path.display());
        (dir, path, spec)
    }

    /// Rows `i` of `range` with ids `i * 3 + 7` (gaps: ranges must balance by rows).
    fn insert(path: &std::path::Path, range: std::ops::Range<i64>) {
        let conn = rusqlite::Connection::open(path).unwrap();
        for i in range {
            conn.execute("INSERT INTO orders (id, item) VALUES (?1, ?2)", (i * 3 + 7, format!("item {i}")))
                .unwrap();
        }
    }

    async fn keys(src: &SqliteSource, split: &PlannedSplit, from: Option<i64>) -> Vec<(String, i64)> {
        let lane = LaneInfo::new(
            split.id.clone(),
            Epoch(1),
            InstanceId::new("t").unwrap(),
            split.descriptor.clone(),
            1,
        );
        let mut r = src.open(&lane, from).await.unwrap();
        let mut out = Vec::new();
        while let Some((line, p)) = r.next().await.unwrap() {
            out.push((line.key, p));
        }
        out
    }

    /// Rows read from every split of two planning rounds, and how many distinct ones.
    async fn read_rounds(src: &SqliteSource, first: &Plan, second: &Plan) -> (usize, usize) {
        let mut rows = Vec::new();
        for s in first.splits.iter().chain(&second.splits) {
            rows.extend(keys(src, s, None).await);
        }
        let unique: std::collections::BTreeSet<_> = rows.iter().map(|r| &r.0).collect();
        (rows.len(), unique.len())
    }

    #[tokio::test]
    async fn ranges_are_balanced_by_rows_and_cover_every_row_once() {
        let (_dir, _, spec) = db(1050);
        let src = SqliteSource::open(&spec, 200).unwrap();
        let splits = src.plan().await.unwrap().splits;
        assert_eq!(splits.len(), 6, "5 full splits of 200 rows and one of 50");
        let mut ids = Vec::new();
        for s in &splits {
            let rows = keys(&src, s, None).await;
            assert!(rows.len() == 200 || rows.len() == 50, "{} rows in {}", rows.len(), s.id);
            assert_eq!(s.weight, rows.len() as u64);
            ids.extend(rows);
        }
        let unique: std::collections::BTreeSet<_> = ids.iter().collect();
        assert_eq!((ids.len(), unique.len()), (1050, 1050));
    }

    #[tokio::test]
    async fn a_reader_resumes_after_the_last_id_committed() {
        let (_dir, _, spec) = db(10);
        let src = SqliteSource::open(&spec, 100).unwrap();
        let split = src.plan().await.unwrap().splits.remove(0);
        let all = keys(&src, &split, None).await;
        let rest = keys(&src, &split, Some(all[1].1)).await;
        assert_eq!(rest[0].0, "orders:13", "the id after 7 and 10");
    }

    #[tokio::test]
    async fn follow_mode_plans_new_rows_past_the_last_planned_id_and_nothing_twice() {
        let (_dir, path, spec) = db(250);
        let src = SqliteSource::open(&spec, 100).unwrap().follow();
        let first = src.replan(&[]).await.unwrap();
        assert_eq!(first.kind, PlanKind::Open);
        assert_eq!(first.splits.len(), 3);
        insert(&path, 250..420);
        let published: Vec<SplitId> = first.splits.iter().map(|s| s.id.clone()).collect();
        let second = src.replan(&published).await.unwrap();
        assert_eq!(read_rounds(&src, &first, &second).await, (420, 420), "every row once");
        assert!(second.splits.iter().all(|s| !published.contains(&s.id)));
        // Nothing new: nothing planned.
        let all: Vec<SplitId> =
            published.into_iter().chain(second.splits.iter().map(|s| s.id.clone())).collect();
        assert!(src.replan(&all).await.unwrap().splits.is_empty());
    }

    #[test]
    fn a_split_id_gives_back_the_end_of_its_range_whatever_its_sign() {
        for (lo, hi) in
            [(i64::MIN, -5), (-9, -1), (-3, 4), (0, 7), (i64::MIN, i64::MAX), (i64::MIN, i64::MIN)]
        {
            let id = range_id("orders", IdRange { lo, hi });
            assert_eq!(range_end("orders", &id), Some(hi), "{id}");
        }
    }

    #[tokio::test]
    async fn follow_mode_reads_rows_of_negative_ids_added_later() {
        let (_dir, path, spec) = db(0);
        let conn = rusqlite::Connection::open(&path).unwrap();
        let add = |ids: std::ops::Range<i64>| {
            for id in ids {
                conn.execute("INSERT INTO orders (id, item) VALUES (?1, 'x')", [id]).unwrap();
            }
        };
        add(-300..-100);
        let src = SqliteSource::open(&spec, 100).unwrap().follow();
        let first = src.replan(&[]).await.unwrap();
        add(-100..0);
        let published: Vec<SplitId> = first.splits.iter().map(|s| s.id.clone()).collect();
        let second = src.replan(&published).await.unwrap();
        assert_eq!(
            read_rounds(&src, &first, &second).await,
            (300, 300),
            "every row once: {:?}",
            second.splits
        );
    }

    #[test]
    fn bad_specs_are_clear_errors() {
        assert!(SqliteSource::open("nope", 1).unwrap_err().to_string().contains("PATH:TABLE"));
        assert!(
            SqliteSource::open("/tmp/x.db:drop table", 1).unwrap_err().to_string().contains("[A-Za-z0-9_]")
        );
    }
}
