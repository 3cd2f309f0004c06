//! A range scan over a SQLite table: the table's rows in balanced ranges of an integer key
//! column (`id` by default; the rowid alias `id INTEGER
//! PRIMARY KEY` is the usual one, [`SqliteSource::open_keyed`] names another); records are rows as JSON objects ([`Line`]: `table:key`,
//! `{"id":7,"item":"a","photo":"iVBORw=="}`: integers and reals as numbers, text as strings,
//! blobs in base64, NULL as `null`); progress is the last key read. Reads run on tokio's
//! blocking pool.
//!
//! - **Backfill** ([`SqliteSource::open`]): ranges of `split_rows` rows each over the rows there
//!   are at planning time (balanced by rows, [`crate::keyrange`]; the planning queries read one
//!   snapshot); a [`PlanKind::Final`] plan.
//! - **Follow** ([`SqliteSource::follow`]): a [`PlanKind::Open`] plan. Each re-plan adds ranges
//!   for the rows past the last planned key (read from the published splits' ids, which carry
//!   their ranges), so rows inserted with growing keys are picked up and none is planned twice.
//!   Rows inserted later with keys below a planned range's end are not picked up.

use std::path::PathBuf;

use base64::Engine as _;
use etl_coordination_driver::{
    LaneInfo, NextRecord, Plan, PlanError, PlanKind, PlannedSplit, Planner, Source, SourceError, SplitId,
    SplitReader, error_chain,
};
use rusqlite::types::ValueRef;

use crate::Line;
pub use crate::keyrange::IdRange;
use crate::keyrange::{KeyIndex, next_start, plan_ranges, run_ready};

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
    /// A table or column name with characters other than `[A-Za-z0-9_]`.
    #[error("name {0:?}: only [A-Za-z0-9_] is accepted")]
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
    key: String,
    split_rows: u64,
    follow: bool,
}

fn check_name(name: &str) -> Result<(), SqliteError> {
    if name.is_empty() || !name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_') {
        return Err(SqliteError::TableName(name.to_owned()));
    }
    Ok(())
}

impl SqliteSource {
    /// A backfill of `PATH:TABLE` keyed by its integer `id` column (see
    /// [`SqliteSource::open_keyed`] for another).
    pub fn open(spec: &str, split_rows: u64) -> Result<Self, SqliteError> {
        Self::open_keyed(spec, "id", split_rows)
    }

    /// A backfill of `PATH:TABLE` keyed by the integer column `key`: unique, and best indexed
    /// (the rowid alias `INTEGER PRIMARY KEY` is). The table must exist and have the column.
    pub fn open_keyed(spec: &str, key: &str, split_rows: u64) -> Result<Self, SqliteError> {
        let Some((path, table)) = spec.rsplit_once(':') else {
            return Err(SqliteError::Spec(spec.to_owned()));
        };
        check_name(table)?;
        check_name(key)?;
        if split_rows == 0 {
            return Err(SqliteError::ZeroSplitRows);
        }
        let source = SqliteSource {
            path: PathBuf::from(path),
            table: table.to_owned(),
            key: key.to_owned(),
            split_rows,
            follow: false,
        };
        source.check()?;
        Ok(source)
    }

    /// The table exists and has the key column (looked up by name: SQLite reads a quoted name
    /// that is no column as a string literal, so a query alone would not tell).
    fn check(&self) -> Result<(), SqliteError> {
        let conn = self.connect()?;
        let (t, k) = (&self.table, &self.key);
        let columns: Vec<(String, String, bool, i64)> = conn
            .prepare("SELECT name, type, \"notnull\", pk FROM pragma_table_info(?1)")
            .and_then(|mut stmt| {
                stmt.query_map([t], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?)))?.collect()
            })
            .map_err(|e| {
                SqliteError::Database(format!("reading the columns of {t:?} in {}: {e}", self.path.display()))
            })?;
        if columns.is_empty() {
            return Err(SqliteError::Database(format!(
                "table {t:?} does not exist in {}",
                self.path.display()
            )));
        }
        let Some(&(_, ref ty, notnull, pk)) = columns.iter().find(|c| &c.0 == k) else {
            let names: Vec<&str> = columns.iter().map(|c| c.0.as_str()).collect();
            return Err(SqliteError::Database(format!(
                "table {t:?} in {} has no {k:?} column to cut ranges by (its columns: {}); name the integer key column",
                self.path.display(),
                names.join(", ")
            )));
        };
        // The rowid alias is unique and never NULL; any other key needs a unique index of its
        // own and NOT NULL (a NULL key is in no range, a repeated one breaks paging).
        let rowid =
            pk == 1 && columns.iter().filter(|c| c.3 > 0).count() == 1 && ty.eq_ignore_ascii_case("INTEGER");
        let unique = rowid
            || conn
                .query_row(
                    "SELECT EXISTS (SELECT 1 FROM pragma_index_list(?1) il WHERE il.\"unique\" = 1 AND il.partial = 0
                       AND (SELECT count(*) FROM pragma_index_info(il.name)) = 1
                       AND (SELECT name FROM pragma_index_info(il.name)) = ?2)",
                    (t, k),
                    |r| r.get::<_, bool>(0),
                )
                .map_err(db)?;
        if !unique || !(rowid || notnull) {
            return Err(SqliteError::Database(format!(
                "column {k:?} of {t:?} in {} must be unique and never NULL to cut ranges by: \
                 INTEGER PRIMARY KEY, or NOT NULL with a UNIQUE index of its own",
                self.path.display()
            )));
        }
        Ok(())
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

    /// Balanced key ranges of `split_rows` rows each, over the rows with keys at least `from`,
    /// read in one transaction. Ids are the range bounds, so that a later planning round can
    /// tell where the earlier ones ended.
    pub fn plan_splits(&self, from: i64) -> Result<Vec<PlannedSplit>, SqliteError> {
        let mut conn = self.connect()?;
        let tx = conn.transaction().map_err(db)?;
        let mut index = Keys { tx: &tx, table: &self.table, key: &self.key };
        let splits = run_ready(plan_ranges(&mut index, &self.table, from, i64::MAX, self.split_rows))?;
        Ok(splits)
    }
}

fn db(e: rusqlite::Error) -> SqliteError {
    SqliteError::Database(error_chain(&e))
}

/// The key column of a table, read in one transaction.
struct Keys<'a> {
    tx: &'a rusqlite::Transaction<'a>,
    table: &'a str,
    key: &'a str,
}

// Blocking calls in async functions: only ever run by `run_ready` on a blocking thread.
impl KeyIndex for Keys<'_> {
    type Error = SqliteError;

    #[allow(clippy::manual_async_fn)]
    fn key_at(
        &mut self,
        lo: i64,
        upto: i64,
        offset: u64,
    ) -> impl Future<Output = Result<Option<i64>, SqliteError>> + Send {
        let (t, k) = (self.table, self.key);
        let found = self
            .tx
            .query_row(
                &format!(
                    "SELECT \"{k}\" FROM \"{t}\" WHERE \"{k}\" >= ?1 AND \"{k}\" <= ?2 ORDER BY \"{k}\" LIMIT 1 OFFSET ?3"
                ),
                (lo, upto, offset as i64),
                |r| r.get::<_, i64>(0),
            )
            .map(Some)
            .or_else(|e| if e == rusqlite::Error::QueryReturnedNoRows { Ok(None) } else { Err(db(e)) });
        std::future::ready(found)
    }

    #[allow(clippy::manual_async_fn)]
    fn tail(
        &mut self,
        lo: i64,
        upto: i64,
    ) -> impl Future<Output = Result<(u64, Option<i64>), SqliteError>> + Send {
        let (t, k) = (self.table, self.key);
        let found = self
            .tx
            .query_row(
                &format!("SELECT COUNT(*), MAX(\"{k}\") FROM \"{t}\" WHERE \"{k}\" >= ?1 AND \"{k}\" <= ?2"),
                [lo, upto],
                |r| Ok((r.get::<_, i64>(0)? as u64, r.get(1)?)),
            )
            .map_err(db);
        std::future::ready(found)
    }

    fn repeated(key: i64) -> SqliteError {
        SqliteError::Database(format!("the key {key} repeats: the key column must be unique"))
    }
}

impl Planner for SqliteSource {
    fn fingerprint(&self) -> String {
        let mode = if self.follow { " follow" } else { "" };
        format!(
            "sqlite/v4 db={} table={} key={} split_rows={}{mode}",
            self.path.display(),
            self.table,
            self.key,
            self.split_rows
        )
    }

    async fn plan(&self) -> Result<Plan, PlanError> {
        self.replan(&[]).await
    }

    async fn replan(&self, published: &[SplitId]) -> Result<Plan, PlanError> {
        let kind = if self.follow { PlanKind::Open } else { PlanKind::Final };
        // A follow round starts where the published ranges end; a backfill plans everything.
        let from = if self.follow { next_start(&self.table, published) } else { Some(i64::MIN) };
        let Some(from) = from else { return Ok(Plan::new(kind, Vec::new())) };
        let source = self.clone();
        let splits = tokio::task::spawn_blocking(move || source.plan_splits(from))
            .await
            .map_err(|e| PlanError::from_error(&e))?
            .map_err(|e| PlanError::from_error(&e))?;
        Ok(Plan::new(kind, splits))
    }
}

impl Source for SqliteSource {
    type Record = Line;
    type Progress = i64;
    type Reader = SqliteReader;

    async fn open(&self, lane: &LaneInfo, from: Option<i64>) -> Result<SqliteReader, SourceError> {
        let range: IdRange = serde_json::from_slice(lane.descriptor())
            .map_err(|e| SourceError::unprocessable(format!("undecodable sqlite descriptor: {e}")))?;
        Ok(SqliteReader {
            source: self.clone(),
            range,
            rows: lane.weight(),
            after: from,
            buffer: Vec::new(),
            done: false,
        })
    }
}

/// Reads a key range in batches.
pub struct SqliteReader {
    source: SqliteSource,
    range: IdRange,
    /// The range's rows as planned (its weight).
    rows: u64,
    after: Option<i64>,
    buffer: Vec<(i64, String)>,
    done: bool,
}

/// A SQLite value as JSON.
fn json_of(v: ValueRef<'_>) -> serde_json::Value {
    match v {
        ValueRef::Null => serde_json::Value::Null,
        ValueRef::Integer(v) => v.into(),
        ValueRef::Real(v) => v.into(),
        ValueRef::Text(t) => String::from_utf8_lossy(t).into_owned().into(),
        ValueRef::Blob(b) => base64::engine::general_purpose::STANDARD.encode(b).into(),
    }
}

impl SqliteReader {
    /// The next batch of rows after `after`, rendered.
    fn batch(
        source: &SqliteSource,
        range: IdRange,
        after: Option<i64>,
    ) -> Result<Vec<(i64, String)>, SqliteError> {
        let conn = source.connect()?;
        let (t, k) = (&source.table, &source.key);
        let Some(from) = range.resume_at(after) else { return Ok(Vec::new()) };
        let sql =
            format!("SELECT * FROM \"{t}\" WHERE \"{k}\" >= ?1 AND \"{k}\" <= ?2 ORDER BY \"{k}\" LIMIT ?3");
        let mut stmt = conn.prepare(&sql).map_err(db)?;
        let idx = stmt.column_index(k).map_err(db)?;
        let names: Vec<String> = stmt.column_names().into_iter().map(str::to_owned).collect();
        let rows = stmt
            .query_map((from, range.last_key(), BATCH), |row| {
                let key: i64 = row.get(idx)?;
                let mut object = serde_json::Map::with_capacity(names.len());
                for (i, name) in names.iter().enumerate() {
                    object.insert(name.clone(), json_of(row.get_ref(i)?));
                }
                Ok((key, serde_json::Value::Object(object).to_string()))
            })
            .map_err(db)?;
        rows.collect::<Result<Vec<_>, _>>().map_err(db)
    }
}

impl SplitReader for SqliteReader {
    type Record = Line;
    type Progress = i64;

    /// The rows of the range up to the key `last`, estimated from its place in the range.
    fn position(&self, last: &i64) -> Option<u64> {
        Some(self.range.position(self.rows, *last))
    }

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

    #[tokio::test]
    async fn rows_are_json_objects_with_null_distinct_from_text_and_blobs_in_base64() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.db");
        let conn = rusqlite::Connection::open(&path).unwrap();
        conn.execute_batch(
            "CREATE TABLE events (seq INTEGER NOT NULL UNIQUE, note TEXT, score REAL, photo BLOB);
             INSERT INTO events VALUES (-4, NULL, 1.5, x'00ff10');
             INSERT INTO events VALUES (9, 'null', NULL, NULL);",
        )
        .unwrap();
        let spec = format!("{}:events", path.display());
        assert!(
            SqliteSource::open(&spec, 10).unwrap_err().to_string().contains("\"id\""),
            "no id column: the error names the key it looked for"
        );
        conn.execute_batch(
            "CREATE TABLE dup (k INTEGER NOT NULL); CREATE TABLE nullable (k INTEGER UNIQUE);",
        )
        .unwrap();
        for (table, why) in [("dup", "no unique index"), ("nullable", "may be NULL")] {
            let e = SqliteSource::open_keyed(&format!("{}:{table}", path.display()), "k", 10)
                .unwrap_err()
                .to_string();
            assert!(e.contains("must be unique and never NULL"), "{why}: {e}");
        }
        let src = SqliteSource::open_keyed(&spec, "seq", 10).unwrap();
        assert!(src.fingerprint().contains("key=seq"));
        let split = src.plan().await.unwrap().splits.remove(0);
        let rows: Vec<serde_json::Value> = {
            let lane = LaneInfo::new(
                split.id.clone(),
                Epoch(1),
                InstanceId::new("t").unwrap(),
                split.descriptor.clone(),
                1,
            );
            let mut r = src.open(&lane, None).await.unwrap();
            let mut out = Vec::new();
            while let Some((line, _)) = r.next().await.unwrap() {
                assert!(line.key.starts_with("events:"));
                out.push(serde_json::from_str(&line.content).unwrap());
            }
            out
        };
        assert_eq!(
            rows,
            vec![
                serde_json::json!({"seq": -4, "note": null, "score": 1.5, "photo": "AP8Q"}),
                serde_json::json!({"seq": 9, "note": "null", "score": null, "photo": null}),
            ]
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
