//! Example sources: real connectors that are also the templates for custom ones.

pub mod files;
pub mod sqlite;

use bytes::Bytes;
use etl_coordination_driver::{Plan, PlanError, Planner};

use crate::runner::{Record, SplitReader};

/// One of the example sources, chosen by `--source`.
#[derive(Clone, Debug)]
pub enum AnySource {
    /// `files:DIR` (or an object-store URL).
    Files(files::FilesSource),
    /// `sqlite:PATH:TABLE`.
    Sqlite(sqlite::SqliteSource),
}

impl AnySource {
    /// Parses `--source`.
    pub fn open(spec: &str, split_bytes: u64, split_rows: u64) -> anyhow::Result<Self> {
        if let Some(dir) = spec.strip_prefix("files:") {
            Ok(AnySource::Files(files::FilesSource::open(dir, split_bytes)?))
        } else if let Some(rest) = spec.strip_prefix("sqlite:") {
            Ok(AnySource::Sqlite(sqlite::SqliteSource::open(rest, split_rows)?))
        } else {
            anyhow::bail!("--source {spec:?}: expected files:DIR or sqlite:PATH:TABLE")
        }
    }

    /// A reader for one split.
    pub fn reader(&self, descriptor: &Bytes, progress: Option<&Bytes>) -> anyhow::Result<AnyReader> {
        Ok(match self {
            AnySource::Files(s) => AnyReader::Files(s.reader(descriptor, progress)?),
            AnySource::Sqlite(s) => AnyReader::Sqlite(s.reader(descriptor, progress)?),
        })
    }
}

impl Planner for AnySource {
    fn fingerprint(&self) -> String {
        match self {
            AnySource::Files(s) => files::FilesPlanner(s.clone()).fingerprint(),
            AnySource::Sqlite(s) => sqlite::SqlitePlanner(s.clone()).fingerprint(),
        }
    }

    async fn plan(&self) -> Result<Plan, PlanError> {
        match self {
            AnySource::Files(s) => files::FilesPlanner(s.clone()).plan().await,
            AnySource::Sqlite(s) => sqlite::SqlitePlanner(s.clone()).plan().await,
        }
    }
}

/// A reader of [`AnySource`].
pub enum AnyReader {
    /// Files.
    Files(files::FilesReader),
    /// SQLite.
    Sqlite(sqlite::SqliteReader),
}

impl SplitReader for AnyReader {
    async fn next(&mut self) -> anyhow::Result<Option<Record>> {
        match self {
            AnyReader::Files(r) => r.next().await,
            AnyReader::Sqlite(r) => r.next().await,
        }
    }

    fn final_progress(&self) -> Bytes {
        match self {
            AnyReader::Files(r) => r.final_progress(),
            AnyReader::Sqlite(r) => r.final_progress(),
        }
    }
}
