//! Database range scan over a SQLite table: the table is split into balanced ranges of its
//! integer `id` column by row count; records are rows; progress is the last id read.
//!
//! The table must have an `INTEGER` column named `id` (e.g. the rowid alias
//! `id INTEGER PRIMARY KEY`). Reads run on tokio's blocking pool.

use std::path::PathBuf;

use anyhow::{Context, bail};
use bytes::Bytes;
use etl_coordination_driver::{Plan, PlanError, PlanKind, PlannedSplit, Planner, SplitId};
use rusqlite::types::ValueRef;
use serde::{Deserialize, Serialize};

use crate::runner::{Record, SplitReader};

/// Default rows per split.
pub const DEFAULT_SPLIT_ROWS: u64 = 100_000;

/// Rows fetched per query while reading a split.
const BATCH: i64 = 500;

/// A SQLite table to scan.
#[derive(Clone, Debug)]
pub struct SqliteSource {
    path: PathBuf,
    table: String,
    split_rows: u64,
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
    /// Parses `PATH:TABLE` (the text after `sqlite:`) and checks the table.
    pub fn open(spec: &str, split_rows: u64) -> anyhow::Result<Self> {
        let Some((path, table)) = spec.rsplit_once(':') else {
            bail!("--source sqlite:{spec}: expected sqlite:PATH:TABLE");
        };
        if table.is_empty() || !table.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_') {
            bail!("table name {table:?}: only [A-Za-z0-9_] is accepted");
        }
        if split_rows == 0 {
            bail!("--split-rows must be at least 1");
        }
        let source = SqliteSource { path: PathBuf::from(path), table: table.to_owned(), split_rows };
        let conn = source.connect()?;
        conn.query_row(&format!("SELECT COUNT(id) FROM \"{}\"", source.table), [], |r| r.get::<_, i64>(0))
            .with_context(|| format!("table {table:?} in {path} must exist and have an integer id column"))?;
        Ok(source)
    }

    fn connect(&self) -> anyhow::Result<rusqlite::Connection> {
        rusqlite::Connection::open_with_flags(&self.path, rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY)
            .with_context(|| format!("opening SQLite database {}", self.path.display()))
    }

    /// Balanced id ranges of `split_rows` rows each.
    pub fn plan_splits(&self) -> anyhow::Result<Vec<PlannedSplit>> {
        let conn = self.connect()?;
        let t = &self.table;
        let (count, max): (i64, Option<i64>) =
            conn.query_row(&format!("SELECT COUNT(*), MAX(id) FROM \"{t}\""), [], |r| {
                Ok((r.get(0)?, r.get(1)?))
            })?;
        let Some(max) = max else { return Ok(Vec::new()) };
        let mut bounds = vec![i64::MIN];
        let mut offset = self.split_rows as i64;
        while offset < count {
            let id: i64 = conn.query_row(
                &format!("SELECT id FROM \"{t}\" ORDER BY id LIMIT 1 OFFSET ?1"),
                [offset],
                |r| r.get(0),
            )?;
            bounds.push(id);
            offset += self.split_rows as i64;
        }
        bounds.push(max.saturating_add(1));
        Ok(bounds
            .windows(2)
            .enumerate()
            .map(|(i, w)| {
                let range = IdRange { lo: w[0], hi: w[1] };
                let rows = if i + 2 < bounds.len() {
                    self.split_rows
                } else {
                    (count as u64) % self.split_rows.max(1)
                };
                PlannedSplit {
                    id: SplitId::new(format!("r-{t}-{i:06}")).expect("valid id"),
                    descriptor: Bytes::from(serde_json::to_vec(&range).expect("serializable")),
                    weight: if rows == 0 { self.split_rows } else { rows },
                }
            })
            .collect())
    }

    /// A reader for one split from its committed progress (the last id read).
    pub fn reader(&self, descriptor: &Bytes, progress: Option<&Bytes>) -> anyhow::Result<SqliteReader> {
        let range: IdRange = serde_json::from_slice(descriptor).context("undecodable sqlite descriptor")?;
        let after = match progress {
            Some(p) => Some(i64::from_le_bytes(p[..].try_into().context("undecodable sqlite progress")?)),
            None => None,
        };
        Ok(SqliteReader { source: self.clone(), range, after, buffer: Vec::new(), done: false })
    }
}

/// The planner of a SQLite source.
#[derive(Clone, Debug)]
pub struct SqlitePlanner(pub SqliteSource);

impl Planner for SqlitePlanner {
    fn fingerprint(&self) -> String {
        format!(
            "sqlite/v1 db={} table={} split_rows={}",
            self.0.path.display(),
            self.0.table,
            self.0.split_rows
        )
    }

    async fn plan(&self) -> Result<Plan, PlanError> {
        let source = self.0.clone();
        let splits = tokio::task::spawn_blocking(move || source.plan_splits())
            .await
            .map_err(|e| PlanError(e.to_string()))?
            .map_err(|e| PlanError(format!("{e:#}")))?;
        Ok(Plan { kind: PlanKind::Final, splits })
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

impl SplitReader for SqliteReader {
    async fn next(&mut self) -> anyhow::Result<Option<Record>> {
        if self.buffer.is_empty() && !self.done {
            let (source, range, after) = (self.source.clone(), self.range, self.after);
            let rows = tokio::task::spawn_blocking(move || -> anyhow::Result<Vec<(i64, String)>> {
                let conn = source.connect()?;
                let sql = format!(
                    "SELECT * FROM \"{}\" WHERE id >= ?1 AND id > ?2 AND id < ?3 ORDER BY id LIMIT ?4",
                    source.table
                );
                let mut stmt = conn.prepare(&sql)?;
                let idx = stmt.column_index("id")?;
                let n = stmt.column_count();
                let rows = stmt.query_map((range.lo, after.unwrap_or(i64::MIN), range.hi, BATCH), |row| {
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
                })?;
                Ok(rows.collect::<Result<Vec<_>, _>>()?)
            })
            .await??;
            if (rows.len() as i64) < BATCH {
                self.done = true;
            }
            self.buffer = rows;
            self.buffer.reverse();
        }
        let Some((id, content)) = self.buffer.pop() else { return Ok(None) };
        self.after = Some(id);
        Ok(Some(Record {
            key: format!("{}:{id}", self.source.table),
            content,
            progress: Bytes::copy_from_slice(&id.to_le_bytes()),
        }))
    }

    fn final_progress(&self) -> Bytes {
        Bytes::copy_from_slice(&(self.range.hi - 1).to_le_bytes())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn db(rows: i64) -> (tempfile::TempDir, String) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.db");
        let conn = rusqlite::Connection::open(&path).unwrap();
        conn.execute_batch("CREATE TABLE orders (id INTEGER PRIMARY KEY, item TEXT)").unwrap();
        for i in 0..rows {
            // Gaps in the ids: ranges must balance by rows, not by id arithmetic.
            conn.execute("INSERT INTO orders (id, item) VALUES (?1, ?2)", (i * 3 + 7, format!("item {i}")))
                .unwrap();
        }
        let spec = format!("{}:orders", path.display());
        (dir, spec)
    }

    #[tokio::test]
    async fn ranges_are_balanced_by_rows_and_cover_every_row_once() {
        let (_dir, spec) = db(1050);
        let src = SqliteSource::open(&spec, 200).unwrap();
        let splits = src.plan_splits().unwrap();
        assert_eq!(splits.len(), 6, "5 full splits of 200 rows and one of 50");
        let mut ids = Vec::new();
        for s in &splits {
            let mut r = src.reader(&s.descriptor, None).unwrap();
            let mut n = 0;
            while let Some(rec) = r.next().await.unwrap() {
                ids.push(rec.key);
                n += 1;
            }
            assert!(n == 200 || n == 50, "{n} rows in {}", s.id);
        }
        let unique: std::collections::BTreeSet<_> = ids.iter().collect();
        assert_eq!((ids.len(), unique.len()), (1050, 1050));
    }

    #[tokio::test]
    async fn a_reader_resumes_after_the_last_id_committed() {
        let (_dir, spec) = db(10);
        let src = SqliteSource::open(&spec, 100).unwrap();
        let split = src.plan_splits().unwrap().remove(0);
        let mut r = src.reader(&split.descriptor, None).unwrap();
        let _ = r.next().await.unwrap();
        let second = r.next().await.unwrap().unwrap();
        let mut r2 = src.reader(&split.descriptor, Some(&second.progress)).unwrap();
        let next = r2.next().await.unwrap().unwrap();
        assert_eq!(next.key, "orders:13", "id after 7 and 10");
    }

    #[test]
    fn bad_specs_are_clear_errors() {
        assert!(SqliteSource::open("nope", 1).unwrap_err().to_string().contains("sqlite:PATH:TABLE"));
        assert!(
            SqliteSource::open("/tmp/x.db:drop table", 1).unwrap_err().to_string().contains("[A-Za-z0-9_]")
        );
    }
}
