//! `etl-coord worker`: one replica of a coordinated pipeline (multi-process and Kubernetes use):
//! the runner's worker (flags, signals, admin server, exit codes) over the files, Parquet, SQLite
//! and PostgreSQL sources into a JSON Lines sink.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context;
use etl_coord::sink::{DeadLetterFile, JsonlSink};
use etl_coord::sources::{
    AnySource, DEFAULT_SPLIT_BYTES, DEFAULT_SPLIT_ROWS, Faults, Faulty, Filters, TableArgs, is_postgres,
    table_args_problem,
};
use etl_coordination_driver::Pipeline;
use etl_coordination_runner::WorkerFlags;

use super::Usage;

#[derive(clap::Args, Debug)]
pub(crate) struct WorkerArgs {
    /// The runner's flags: the job, its store, the worker's knobs, the admin server.
    #[command(flatten)]
    pub(crate) worker: WorkerFlags,
    /// `files:DIR`, `parquet:DIR` (a directory, or an s3://, gs://, az:// URL with the `cloud`
    /// feature), `sqlite:PATH:TABLE` or `postgres://USER@HOST:PORT/DATABASE` (with --table; the
    /// password from PGPASSWORD rather than the URL, which shows in process lists).
    #[arg(long, env = "ETL_COORD_SOURCE")]
    pub(crate) source: String,
    /// Keep the plan open: the leader re-plans every --replan-interval and new input becomes
    /// new splits (files: every object is a split, new objects are picked up; sqlite: rows past
    /// the last planned id). The job never completes; SIGTERM ends a worker (a drain).
    #[arg(long, env = "ETL_COORD_FOLLOW")]
    pub(crate) follow: bool,
    /// JSON Lines output, one line per emitted record.
    #[arg(long, env = "ETL_COORD_SINK")]
    pub(crate) sink: Option<PathBuf>,
    /// With --on-bad-record skip: the JSON Lines file that keeps each skipped record (split,
    /// position, error, its bytes), made durable before the progress past it is committed.
    #[arg(long, env = "ETL_COORD_DEAD_LETTER")]
    pub(crate) dead_letter: Option<PathBuf>,
    /// Files and Parquet sources: target bytes per split (compressed bytes of row groups for
    /// Parquet; a row group is never cut).
    #[arg(long, default_value_t = DEFAULT_SPLIT_BYTES, env = "ETL_COORD_SPLIT_SIZE")]
    pub(crate) split_size: u64,
    /// Files and Parquet sources: read only objects whose key (relative to the location) matches one of
    /// these globs (repeat the flag for more; `*` stays within a path component, `**` crosses
    /// them, `{a,b}` is either: `**/*.{json,csv}`). ETL_COORD_INCLUDE holds one glob.
    #[arg(long, env = "ETL_COORD_INCLUDE")]
    pub(crate) include: Vec<String>,
    /// Files and Parquet sources: skip objects whose key matches one of these globs (after --include; repeat
    /// the flag for more). ETL_COORD_EXCLUDE holds one glob.
    #[arg(long, env = "ETL_COORD_EXCLUDE")]
    pub(crate) exclude: Vec<String>,
    /// Files and Parquet sources: read hidden objects too. By default a key with a component that starts
    /// with `_` or `.` is skipped, as Hadoop and Spark do (`_SUCCESS`, `_committed_*`,
    /// `_temporary/`, `.part-0000.crc`).
    #[arg(long, env = "ETL_COORD_INCLUDE_HIDDEN")]
    pub(crate) include_hidden: bool,
    /// Files source: cut uncompressed objects larger than --split-size into byte ranges of
    /// about that size, so that one big object is read by several workers (each range reads
    /// the lines that start inside it; records are keyed path@offset). Part of the planner
    /// fingerprint: set it on every worker of a job.
    #[arg(long, env = "ETL_COORD_SPLIT_LARGE_OBJECTS")]
    pub(crate) split_large_objects: bool,
    /// PostgreSQL source: the table, `name` or `schema.name`.
    #[arg(long, env = "ETL_COORD_TABLE")]
    pub(crate) table: Option<String>,
    /// SQLite and PostgreSQL sources: the integer key column ranges are cut by (unique, with an
    /// index of its own on PostgreSQL; a primary key is one). `id` by default.
    #[arg(long, env = "ETL_COORD_KEY_COLUMN")]
    pub(crate) key_column: Option<String>,
    /// SQLite and PostgreSQL sources: rows per split.
    #[arg(long, default_value_t = DEFAULT_SPLIT_ROWS, env = "ETL_COORD_SPLIT_ROWS")]
    pub(crate) split_rows: u64,
    /// Test fault: sleep per record, in milliseconds.
    #[arg(long, hide = true, default_value_t = 0)]
    pub(crate) record_delay_ms: u64,
    /// Test fault: reaching an input line containing this text aborts the process.
    #[arg(long, hide = true)]
    pub(crate) poison_marker: Option<String>,
    /// Test fault: reaching an input line containing this text reports the split unprocessable.
    #[arg(long, hide = true)]
    pub(crate) unprocessable_marker: Option<String>,
    /// Test fault: reaching an input line containing this text hangs the lane's reader, like a
    /// read on a connection that never answers (only a stop signal ends it).
    #[arg(long, hide = true)]
    pub(crate) hang_marker: Option<String>,
}

impl WorkerArgs {
    fn filters(&self) -> Filters {
        Filters {
            include: self.include.clone(),
            exclude: self.exclude.clone(),
            include_hidden: self.include_hidden,
            split_large_objects: self.split_large_objects,
        }
    }

    fn table_args(&self) -> TableArgs {
        TableArgs { table: self.table.clone(), key_column: self.key_column.clone() }
    }

    /// Checks the `--source` with its options without connecting anywhere: a local source is
    /// opened (and dropped), a database's options are checked.
    fn check_source(&self) -> anyhow::Result<()> {
        if is_postgres(&self.source) {
            if let Some(problem) = table_args_problem(&self.source, &self.table_args(), self.split_rows) {
                anyhow::bail!("{problem}");
            }
            if let Some(flag) = self.filters().first_set() {
                anyhow::bail!("{flag} applies to files: and parquet: sources only");
            }
            return Ok(());
        }
        let source = AnySource::open_with(
            &self.source,
            &self.table_args(),
            self.split_size,
            self.split_rows,
            self.follow,
        )?;
        source.with_filters(&self.filters(), self.follow).map(drop)
    }

    /// The `--source` with its options (a database source connects).
    async fn open_source(&self) -> anyhow::Result<AnySource> {
        AnySource::connect(&self.source, &self.table_args(), self.split_size, self.split_rows, self.follow)
            .await?
            .with_filters(&self.filters(), self.follow)
    }

    /// Checks what one flag's parser cannot: the runner's flags, then the input and the local
    /// files.
    pub(crate) fn validate(&self) -> Result<(), Usage> {
        let a = self;
        a.worker.validate()?;
        // What the input and the local files can tell is told now, not after connecting.
        if let Err(e) = a.check_source() {
            let msg = format!("{e:#}");
            return Err(match msg.strip_prefix("--").and_then(|m| m.split_once(' ')) {
                Some((flag, rest)) => Usage::new(format!("--{flag}"), rest),
                None => Usage::new("--source", format!("{}: {msg}", etl_coord::sources::redact(&a.source))),
            });
        }
        for (flag, file) in [("--sink", &a.sink), ("--dead-letter", &a.dead_letter)] {
            if let Some(file) = file {
                output_file(flag, file)?;
            }
        }
        match (a.worker.on_bad_record.as_str(), &a.dead_letter) {
            ("skip", None) => {
                return Err(Usage::new(
                    "--on-bad-record",
                    "skip needs --dead-letter FILE, where the skipped records are kept",
                ));
            }
            ("quarantine", Some(_)) => {
                return Err(Usage::new(
                    "--dead-letter",
                    "is only written with --on-bad-record skip (the default, quarantine, skips nothing)",
                ));
            }
            _ => {}
        }
        if a.sink.is_some() && a.sink == a.dead_letter {
            return Err(Usage::new("--dead-letter", "must be another file than --sink"));
        }
        Ok(())
    }
}

/// An output file whose directory exists and that is not a directory.
fn output_file(flag: &str, file: &std::path::Path) -> Result<(), Usage> {
    let dir = file.parent().filter(|d| !d.as_os_str().is_empty()).unwrap_or(std::path::Path::new("."));
    if !dir.is_dir() {
        return Err(Usage::new(
            flag,
            format!("{}: the directory {} does not exist", file.display(), dir.display()),
        ));
    }
    if file.is_dir() {
        return Err(Usage::new(flag, format!("{} is a directory; give a file", file.display())));
    }
    Ok(())
}

pub(crate) async fn run(a: WorkerArgs) -> anyhow::Result<ExitCode> {
    let source = a.open_source().await?;
    let faults = Faults {
        record_delay: Duration::from_millis(a.record_delay_ms),
        poison_marker: a.poison_marker.clone(),
        unprocessable_marker: a.unprocessable_marker.clone(),
        hang_marker: a.hang_marker.clone(),
    };
    let sink = match &a.sink {
        Some(p) => JsonlSink::open(p).with_context(|| format!("opening the sink {}", p.display()))?,
        None => JsonlSink::discard(),
    };
    let dead_letters = match &a.dead_letter {
        Some(p) => Some(DeadLetterFile(
            JsonlSink::open(p).with_context(|| format!("opening the dead-letter file {}", p.display()))?,
        )),
        None => None,
    };
    let code = a
        .worker
        .run(|stores, config| {
            let pipeline = Pipeline::new(stores, Faulty { source, faults }, sink).config(config);
            match dead_letters {
                Some(d) => pipeline.dead_letters(d),
                None => pipeline,
            }
        })
        .await?;
    Ok(code)
}
