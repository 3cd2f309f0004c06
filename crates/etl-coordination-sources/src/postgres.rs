//! A range scan over a PostgreSQL table: the rows in ranges of an integer key balanced by rows
//! ([`crate::keyrange`]: the key's index is walked, so gaps and dense clusters of ids still give
//! ranges of `split_rows` rows), read with keyset pagination in batches; records are rows as
//! JSON objects ([`Line`]: `table:key`); progress is the last key read.
//!
//! Values as JSON: integers, floats and booleans as JSON numbers and booleans, `numeric` as a
//! string (its exact digits), text as strings, `timestamptz` in RFC 3339 in UTC
//! (`2024-05-01T12:00:00+00:00`), `timestamp` and `date` in ISO 8601, `json`/`jsonb` as the
//! value itself, `bytea` in base64, arrays as JSON arrays, NULL as `null`. The conversion runs
//! in the server (`row_to_json` over a select list that casts `numeric` and encodes `bytea`).
//! [`PostgresSource::typed`] decodes each row into a type of the embedder's own.
//!
//! - **Backfill**: ranges over the rows there are at planning time (read in one snapshot); a
//!   [`PlanKind::Final`] plan.
//! - **Follow** ([`PostgresSource::follow`]): an open plan; each re-plan adds ranges for the rows
//!   past the last planned key (from the published splits' ids, which carry their ranges), up
//!   to the largest key an earlier round saw, once every transaction in progress at that round
//!   has ended: with a sequence, a transaction may commit key 100 after another committed 101,
//!   and a range planned up to 101 at once would never read 100. So a row is planned one
//!   `--replan-interval` (or more, behind a long transaction) after it is visible; a new leader
//!   starts with one round that only looks. Rows inserted later with keys below a planned
//!   range's end are still not picked up (keys taken from a sequence with `CACHE` above 1, or
//!   written by the application out of order): follow mode fits keys that grow.
//!
//! The key must be an integer column (`smallint`, `integer`, `bigint`) with a unique index of
//! its own (a primary key is one): planning walks that index and every batch is an index range
//! scan. Connections are plain TCP (`sslmode` other than `disable`/`prefer` is refused).

use std::marker::PhantomData;
use std::sync::Arc;

use etl_coordination_driver::{
    LaneInfo, NextRecord, Plan, PlanError, PlanKind, Planner, Source, SourceError, SplitId, SplitReader,
    error_chain,
};
use tokio_postgres::config::SslMode;
use tokio_postgres::{Client, Config, NoTls};

use crate::Line;
use crate::keyrange::{IdRange, KeyIndex, next_start, plan_ranges};

/// Default rows per split.
pub const DEFAULT_SPLIT_ROWS: u64 = 100_000;

/// Default rows fetched per query while reading a split.
pub const DEFAULT_BATCH_ROWS: u32 = 1_000;

/// The table cannot be read as asked; each says what to change.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum PostgresError {
    /// The connection string does not parse.
    #[error("PostgreSQL connection string: {0} (expected postgres://USER@HOST:PORT/DATABASE)")]
    Url(String),
    /// `sslmode=require` or stricter: TLS is not built in.
    #[error(
        "PostgreSQL connection string asks for TLS (sslmode=require): this build connects in plain TCP; \
         use sslmode=disable or prefer on a trusted network"
    )]
    Tls,
    /// The server cannot be reached, or refused the session.
    #[error("cannot connect to PostgreSQL at {server}: {reason}")]
    Connect {
        /// `host:port/database`.
        server: String,
        /// What the client said.
        reason: String,
        /// Whether it is an outage (unreachable, restarting, out of connections) rather than a
        /// refusal (no such database, no CONNECT privilege).
        transient: bool,
    },
    /// The server refused the credentials.
    #[error(
        "PostgreSQL at {server} refused user {user:?}: {reason} (check the password in the URL or in PGPASSWORD)"
    )]
    Auth {
        /// `host:port/database`.
        server: String,
        /// The user.
        user: String,
        /// What the server said.
        reason: String,
    },
    /// No such table (or view) in the search path.
    #[error(
        "table {0:?} does not exist (or is not visible to this user: name it as schema.table; a name with \
         capitals is written in double quotes, \"Orders\")"
    )]
    NoTable(String),
    /// The user may not read the table.
    #[error("user {user:?} may not SELECT from {table}: GRANT SELECT ON {table} TO {user}")]
    Permission {
        /// The table.
        table: String,
        /// The user.
        user: String,
    },
    /// The key column is missing, not an integer, or has no unique index.
    #[error("key column {key:?} of {table}: {reason}")]
    Key {
        /// The table.
        table: String,
        /// The column.
        key: String,
        /// What is wrong and what to do.
        reason: String,
    },
    /// A split or batch size of 0.
    #[error("{0} must be at least 1")]
    Zero(&'static str),
    /// Any other database error.
    #[error("{0}")]
    Database(String),
}

/// A PostgreSQL table to scan (see the module documentation).
#[derive(Clone, Debug)]
pub struct PostgresSource {
    config: Config,
    /// `host:port/database`, for messages and the fingerprint (no credentials).
    server: String,
    user: String,
    /// The table as resolved by the server (`schema.table`, quoted where needed).
    table: String,
    /// The table's name in split ids.
    name: String,
    key: String,
    split_rows: u64,
    batch_rows: u32,
    follow: bool,
    /// `SELECT` of one batch: `$1` first key, `$2` last key, `$3` limit.
    query: Arc<str>,
    /// Follow mode: what the last round saw (shared by the clones a pipeline makes).
    seen: Arc<std::sync::Mutex<Option<Seen>>>,
}

/// Quotes an identifier for SQL.
fn ident(s: &str) -> String {
    format!("\"{}\"", s.replace('"', "\"\""))
}

fn db(e: &tokio_postgres::Error) -> PostgresError {
    PostgresError::Database(error_chain(e))
}

impl PostgresSource {
    /// Connects to `url` (`postgres://USER[:PASSWORD]@HOST[:PORT]/DATABASE`, or libpq's
    /// `key=value` form; the password may come from `PGPASSWORD` instead), checks that `table`
    /// (`name` or `schema.name`) exists, can be read, and has the integer key column `key` with
    /// a unique index, and builds the row query from its columns. A backfill of `split_rows`
    /// rows a split; see [`PostgresSource::follow`].
    pub async fn connect(url: &str, table: &str, key: &str, split_rows: u64) -> Result<Self, PostgresError> {
        if split_rows == 0 {
            return Err(PostgresError::Zero("split_rows"));
        }
        let mut config = parse_url(url)?;
        if config.get_password().is_none()
            && let Ok(password) = std::env::var("PGPASSWORD")
        {
            config.password(password);
        }
        // A dead server or a half-open connection ends in an error, not a lane that waits.
        if config.get_connect_timeout().is_none() {
            config.connect_timeout(std::time::Duration::from_secs(10));
        }
        config.keepalives_idle(std::time::Duration::from_secs(30));
        if config.get_tcp_user_timeout().is_none() {
            config.tcp_user_timeout(std::time::Duration::from_secs(60));
        }
        let server = describe(&config);
        let user = config.get_user().unwrap_or("the connecting user").to_owned();
        let client = connect(&config, &server, &user).await?;
        let (table, columns) = resolve(&client, table, key, &user).await?;
        let name: String = table
            .chars()
            .map(|c| if c.is_ascii_alphanumeric() || c == '_' { c } else { '_' })
            .take(60)
            .collect();
        let query = row_query(&table, key, &columns);
        Ok(PostgresSource {
            config,
            server,
            user,
            table,
            name,
            key: key.to_owned(),
            split_rows,
            batch_rows: DEFAULT_BATCH_ROWS,
            follow: false,
            query: query.into(),
            seen: Arc::default(),
        })
    }

    /// Follow mode: an open plan that adds ranges for new rows (see the module documentation).
    pub fn follow(mut self) -> Self {
        self.follow = true;
        self
    }

    /// Rows fetched per query while reading (1,000 by default): the memory a lane holds and the
    /// rows read again after a failed query.
    pub fn batch_rows(mut self, rows: u32) -> Result<Self, PostgresError> {
        if rows == 0 {
            return Err(PostgresError::Zero("batch_rows"));
        }
        self.batch_rows = rows;
        Ok(self)
    }

    /// The table as the server names it (`schema.table`).
    pub fn table(&self) -> &str {
        &self.table
    }

    /// The same table read as rows of `T`, decoded from each row's JSON object (column names as
    /// keys, values as the module documentation says). A row that does not decode is a bad
    /// record (`--on-bad-record` decides: quarantine the split, or skip it to the dead letters).
    pub fn typed<T>(self) -> Typed<T> {
        Typed { source: self, row: PhantomData }
    }
}

/// Checks a connection string without connecting: it parses and asks for no TLS.
pub fn check_url(url: &str) -> Result<(), PostgresError> {
    parse_url(url).map(drop)
}

fn parse_url(url: &str) -> Result<Config, PostgresError> {
    let config: Config = url.parse().map_err(|e: tokio_postgres::Error| PostgresError::Url(e.to_string()))?;
    if !matches!(config.get_ssl_mode(), SslMode::Disable | SslMode::Prefer) {
        return Err(PostgresError::Tls);
    }
    Ok(config)
}

/// `host:port/database` of a configuration.
fn describe(config: &Config) -> String {
    use tokio_postgres::config::Host;
    let host = match config.get_hosts().first() {
        Some(Host::Tcp(h)) => h.clone(),
        Some(Host::Unix(p)) => p.display().to_string(),
        None => "localhost".to_owned(),
    };
    let port = config.get_ports().first().copied().unwrap_or(5432);
    format!("{host}:{port}/{}", config.get_dbname().unwrap_or_default())
}

/// A connection, its driving task spawned; errors say which server and why.
async fn connect(config: &Config, server: &str, user: &str) -> Result<Client, PostgresError> {
    let (client, connection) = config.connect(NoTls).await.map_err(|e| match e.code() {
        Some(code) if code.code().starts_with("28") => PostgresError::Auth {
            server: server.to_owned(),
            user: user.to_owned(),
            reason: e.as_db_error().map_or_else(|| error_chain(&e), |d| d.message().to_owned()),
        },
        _ => PostgresError::Connect {
            server: server.to_owned(),
            reason: error_chain(&e),
            transient: is_outage(&e),
        },
    })?;
    // The connection's end (with an error or not) is seen by the next query on the client.
    tokio::spawn(async move {
        let _ = connection.await;
    });
    client.batch_execute("SET TimeZone = 'UTC'; SET DateStyle = 'ISO'").await.map_err(|e| {
        PostgresError::Connect {
            server: server.to_owned(),
            reason: error_chain(&e),
            transient: is_outage(&e),
        }
    })?;
    Ok(client)
}

/// A column: its name, and the category of its type.
struct Column {
    name: String,
    /// `numeric`, `numeric[]`, `bytea` or anything else.
    kind: String,
}

/// Resolves the table, checks the key and the permission; the table's qualified name and
/// columns.
async fn resolve(
    client: &Client,
    table: &str,
    key: &str,
    user: &str,
) -> Result<(String, Vec<Column>), PostgresError> {
    let row = client
        .query_opt("SELECT to_regclass($1)::oid::int8, to_regclass($1)::text", &[&table])
        .await
        .map_err(|e| db(&e))?;
    let (oid, qualified) = match row.map(|r| (r.get::<_, Option<i64>>(0), r.get::<_, Option<String>>(1))) {
        Some((Some(oid), Some(name))) => (oid, name),
        _ => return Err(PostgresError::NoTable(table.to_owned())),
    };
    let readable: bool = client
        .query_one("SELECT has_table_privilege($1::int8::oid, 'SELECT')", &[&oid])
        .await
        .map_err(|e| db(&e))?
        .get(0);
    if !readable {
        return Err(PostgresError::Permission { table: qualified, user: user.to_owned() });
    }
    let rows = client
        .query(
            "SELECT a.attname::text, a.attnum::int4, t.oid::regtype::text,
                    t.typcategory::text, coalesce(e.typname::text, ''), a.attnotnull
             FROM pg_attribute a
             JOIN pg_type d ON d.oid = a.atttypid
             JOIN pg_type t ON t.oid = CASE WHEN d.typtype = 'd' THEN d.typbasetype ELSE d.oid END
             LEFT JOIN pg_type e ON e.oid = t.typelem AND t.typcategory = 'A'
             WHERE a.attrelid = $1::int8::oid AND a.attnum > 0 AND NOT a.attisdropped
             ORDER BY a.attnum",
            &[&oid],
        )
        .await
        .map_err(|e| db(&e))?;
    let key_err = |reason: &str| PostgresError::Key {
        table: qualified.clone(),
        key: key.to_owned(),
        reason: reason.to_owned(),
    };
    let mut columns = Vec::new();
    let mut key_attnum = None;
    for r in &rows {
        let name: String = r.get(0);
        let ty: String = r.get(2);
        let category: String = r.get(3);
        let element: String = r.get(4);
        if name == key {
            if !matches!(ty.as_str(), "smallint" | "integer" | "bigint") {
                return Err(key_err(&format!(
                    "is of type {ty}: ranges need an integer key (smallint, integer or bigint); name another with --key-column"
                )));
            }
            if !r.get::<_, bool>(5) {
                return Err(key_err(&format!(
                    "may hold NULL, and a row whose key is NULL is in no range: ALTER TABLE {qualified} ALTER COLUMN {} SET NOT NULL, \
                     or name another key with --key-column",
                    ident(key)
                )));
            }
            key_attnum = Some(r.get::<_, i32>(1));
        }
        let kind = match (ty.as_str(), category.as_str(), element.as_str()) {
            ("numeric", _, _) => "numeric",
            (_, "A", "numeric") => "numeric[]",
            ("bytea", _, _) => "bytea",
            _ => "",
        };
        columns.push(Column { name, kind: kind.to_owned() });
    }
    let Some(attnum) = key_attnum else {
        let names: Vec<&str> = columns.iter().map(|c| c.name.as_str()).collect();
        return Err(key_err(&format!(
            "no such column (its columns: {}; names are case-sensitive); name the key with --key-column",
            names.join(", ")
        )));
    };
    let indexed: bool = client
        .query_one(
            "SELECT EXISTS (SELECT 1 FROM pg_index WHERE indrelid = $1::int8::oid AND indisunique
                 AND indisvalid AND indnkeyatts = 1 AND indkey[0] = $2 AND indpred IS NULL)",
            &[&oid, &(attnum as i16)],
        )
        .await
        .map_err(|e| db(&e))?
        .get(0);
    if !indexed {
        return Err(key_err(&format!(
            "has no unique index of its own: planning walks it and reads are index range scans \
             (CREATE UNIQUE INDEX ON {qualified} ({}), or name another key with --key-column)",
            ident(key)
        )));
    }
    Ok((qualified, columns))
}

/// The query of one batch: each row's key and its JSON object.
fn row_query(table: &str, key: &str, columns: &[Column]) -> String {
    let list: Vec<String> = columns
        .iter()
        .map(|c| {
            let col = format!("t.{}", ident(&c.name));
            let value = match c.kind.as_str() {
                "numeric" => format!("{col}::text"),
                "numeric[]" => format!("{col}::text[]"),
                "bytea" => format!("translate(encode({col}, 'base64'), E'\\n', '')"),
                _ => col,
            };
            format!("{value} AS {}", ident(&c.name))
        })
        .collect();
    let k = format!("t.{}", ident(key));
    format!(
        "SELECT {k}::int8, (SELECT row_to_json(r) FROM (SELECT {}) r)::text FROM {table} t \
         WHERE {k} >= $1::int8 AND {k} <= $2::int8 ORDER BY {k} LIMIT $3::int8",
        list.join(", ")
    )
}

/// The key column of a table, read in one repeatable-read snapshot.
struct Keys<'a> {
    tx: &'a tokio_postgres::Transaction<'a>,
    table: &'a str,
    key: &'a str,
}

impl KeyIndex for Keys<'_> {
    type Error = PostgresError;

    async fn key_at(&mut self, lo: i64, upto: i64, offset: u64) -> Result<Option<i64>, PostgresError> {
        let k = ident(self.key);
        let sql = format!(
            "SELECT {k}::int8 FROM {} WHERE {k} >= $1::int8 AND {k} <= $2::int8 ORDER BY {k} OFFSET $3::int8 LIMIT 1",
            self.table
        );
        let row = self.tx.query_opt(&sql, &[&lo, &upto, &(offset as i64)]).await.map_err(|e| db(&e))?;
        Ok(row.map(|r| r.get(0)))
    }

    async fn tail(&mut self, lo: i64, upto: i64) -> Result<(u64, Option<i64>), PostgresError> {
        let k = ident(self.key);
        let sql = format!(
            "SELECT count(*)::int8, max({k})::int8 FROM {} WHERE {k} >= $1::int8 AND {k} <= $2::int8",
            self.table
        );
        let row = self.tx.query_one(&sql, &[&lo, &upto]).await.map_err(|e| db(&e))?;
        Ok((row.get::<_, i64>(0) as u64, row.get(1)))
    }

    fn repeated(key: i64) -> PostgresError {
        PostgresError::Database(format!("the key {key} repeats: the key column must be unique"))
    }
}

/// A database error as a source reports it: an outage (connection lost, server restarting, out
/// of resources, a serialization conflict) is waited out in place; the rest (a dropped table,
/// a revoked permission) fails the tenancy.
fn source_error(what: &str, e: &tokio_postgres::Error) -> SourceError {
    let msg = format!("{what}: {}", error_chain(e));
    if is_outage(e) { SourceError::transient(msg) } else { SourceError::failed(msg) }
}

/// Whether an error is an outage of the database (`DATA-PATH-NOTES.md`): no SQLSTATE (the
/// connection failed or was lost), class 08, class 53, a server shutting down or starting,
/// a serialization failure or a deadlock.
fn is_outage(e: &tokio_postgres::Error) -> bool {
    match e.code().map(|c| c.code()) {
        None => true,
        Some(c) if c.starts_with("08") || c.starts_with("53") => true,
        Some(c) => matches!(c, "57P01" | "57P02" | "57P03" | "40001" | "40P01"),
    }
}

/// What a follow round saw: the largest key, and the transactions in progress then.
#[derive(Clone, Debug, Default)]
struct Seen {
    max: Option<i64>,
    /// `pg_snapshot_xip` of the round's snapshot, as text.
    in_progress: Vec<String>,
}

impl PostgresSource {
    /// Plans the ranges from `from` on, in one read-only snapshot. In follow mode only up to
    /// the largest key an earlier round saw once every transaction in progress then has ended
    /// (see the module documentation).
    async fn plan_from(&self, from: i64) -> Result<Vec<etl_coordination_driver::PlannedSplit>, PlanError> {
        let plan_err = |e: PostgresError| PlanError::from_error(&e);
        let mut client = connect(&self.config, &self.server, &self.user).await.map_err(plan_err)?;
        let tx = client
            .build_transaction()
            .isolation_level(tokio_postgres::IsolationLevel::RepeatableRead)
            .read_only(true)
            .start()
            .await
            .map_err(|e| plan_err(db(&e)))?;
        let upto = if self.follow {
            let k = ident(&self.key);
            let max: Option<i64> = tx
                .query_one(&format!("SELECT max({k})::int8 FROM {}", self.table), &[])
                .await
                .map_err(|e| plan_err(db(&e)))?
                .get(0);
            let in_progress: Vec<String> = tx
                .query_one(
                    "SELECT coalesce(array_agg(x::text), '{}') FROM pg_snapshot_xip(pg_current_snapshot()) x",
                    &[],
                )
                .await
                .map_err(|e| plan_err(db(&e)))?
                .get(0);
            let now = Seen { max, in_progress };
            let earlier = self.seen.lock().expect("not poisoned").clone();
            match earlier {
                None => {
                    *self.seen.lock().expect("not poisoned") = Some(now);
                    None
                }
                Some(earlier) => {
                    let ended: bool = tx
                        .query_one(
                            "SELECT coalesce(bool_and(pg_xact_status(x::xid8) IS DISTINCT FROM 'in progress'), true) \
                             FROM unnest($1::text[]) x",
                            &[&earlier.in_progress],
                        )
                        .await
                        .map_err(|e| plan_err(db(&e)))?
                        .get(0);
                    if ended {
                        *self.seen.lock().expect("not poisoned") = Some(now);
                        earlier.max
                    } else {
                        // A transaction of that round is still open: it may commit a key below
                        // that round's largest. Wait for it.
                        None
                    }
                }
            }
        } else {
            Some(i64::MAX)
        };
        let splits = match upto {
            Some(upto) => {
                let mut keys = Keys { tx: &tx, table: &self.table, key: &self.key };
                plan_ranges(&mut keys, &self.name, from, upto, self.split_rows).await.map_err(plan_err)?
            }
            None => Vec::new(),
        };
        tx.commit().await.map_err(|e| plan_err(db(&e)))?;
        Ok(splits)
    }
}

impl Planner for PostgresSource {
    fn fingerprint(&self) -> String {
        let mode = if self.follow { " follow" } else { "" };
        format!(
            "postgres/v1 server={} table={} key={} split_rows={}{mode}",
            self.server, self.table, self.key, self.split_rows
        )
    }

    async fn plan(&self) -> Result<Plan, PlanError> {
        self.replan(&[]).await
    }

    async fn replan(&self, published: &[SplitId]) -> Result<Plan, PlanError> {
        let kind = if self.follow { PlanKind::Open } else { PlanKind::Final };
        let from = if self.follow { next_start(&self.name, published) } else { Some(i64::MIN) };
        let Some(from) = from else { return Ok(Plan::new(kind, Vec::new())) };
        Ok(Plan::new(kind, self.plan_from(from).await?))
    }
}

impl Source for PostgresSource {
    type Record = Line;
    type Progress = i64;
    type Reader = PostgresReader;

    async fn open(&self, lane: &LaneInfo, from: Option<i64>) -> Result<PostgresReader, SourceError> {
        let range: IdRange = serde_json::from_slice(lane.descriptor())
            .map_err(|e| SourceError::unprocessable(format!("undecodable postgres descriptor: {e}")))?;
        Ok(PostgresReader {
            source: self.clone(),
            client: None,
            range,
            rows: lane.weight(),
            after: from,
            buffer: Vec::new(),
            done: false,
        })
    }
}

/// Reads a key range in batches (keyset pagination: each batch starts after the last key).
pub struct PostgresReader {
    source: PostgresSource,
    client: Option<Client>,
    range: IdRange,
    /// The range's rows as planned (its weight).
    rows: u64,
    after: Option<i64>,
    /// Rows fetched and not handed on yet, last first.
    buffer: Vec<(i64, String)>,
    done: bool,
}

impl PostgresReader {
    async fn fill(&mut self) -> Result<(), SourceError> {
        let s = &self.source;
        if self.client.as_ref().is_none_or(Client::is_closed) {
            let client = connect(&s.config, &s.server, &s.user).await.map_err(|e| match e {
                PostgresError::Connect { transient: true, .. } => SourceError::transient(e.to_string()),
                _ => SourceError::failed(e.to_string()),
            })?;
            self.client = Some(client);
        }
        let client = self.client.as_ref().expect("connected above");
        let Some(first) = self.range.resume_at(self.after) else {
            self.done = true;
            return Ok(());
        };
        let limit = i64::from(s.batch_rows);
        let rows = client
            .query(&*s.query, &[&first, &self.range.last_key(), &limit])
            .await
            .map_err(|e| source_error(&format!("reading {} from key {first}", s.table), &e))?;
        self.done = rows.len() < s.batch_rows as usize;
        self.buffer = rows.iter().rev().map(|r| (r.get(0), r.get(1))).collect();
        Ok(())
    }
}

impl SplitReader for PostgresReader {
    type Record = Line;
    type Progress = i64;

    /// The rows of the range up to the key `last`, estimated from its place in the range.
    fn position(&self, last: &i64) -> Option<u64> {
        Some(self.range.position(self.rows, *last))
    }

    async fn next(&mut self) -> NextRecord<Line, i64> {
        if self.buffer.is_empty() && !self.done {
            self.fill().await?;
        }
        let Some((key, content)) = self.buffer.pop() else { return Ok(None) };
        self.after = Some(key);
        Ok(Some((Line { key: format!("{}:{key}", self.source.table), content }, key)))
    }
}

/// A PostgreSQL table read as rows of `T` ([`PostgresSource::typed`]).
pub struct Typed<T> {
    source: PostgresSource,
    row: PhantomData<fn() -> T>,
}

impl<T> Clone for Typed<T> {
    fn clone(&self) -> Self {
        Typed { source: self.source.clone(), row: PhantomData }
    }
}

impl<T: Send + 'static> Planner for Typed<T> {
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

impl<T: serde::de::DeserializeOwned + Send + 'static> Source for Typed<T> {
    type Record = T;
    type Progress = i64;
    type Reader = TypedReader<T>;

    async fn open(&self, lane: &LaneInfo, from: Option<i64>) -> Result<TypedReader<T>, SourceError> {
        Ok(TypedReader { rows: self.source.open(lane, from).await?, row: PhantomData })
    }
}

/// Reads a key range as rows of `T`.
pub struct TypedReader<T> {
    rows: PostgresReader,
    row: PhantomData<fn() -> T>,
}

impl<T: serde::de::DeserializeOwned + Send + 'static> SplitReader for TypedReader<T> {
    type Record = T;
    type Progress = i64;

    fn position(&self, last: &i64) -> Option<u64> {
        self.rows.position(last)
    }

    async fn next(&mut self) -> NextRecord<T, i64> {
        let Some((line, key)) = self.rows.next().await? else { return Ok(None) };
        match serde_json::from_str(&line.content) {
            Ok(row) => Ok(Some((row, key))),
            Err(e) => Err(SourceError::bad_record(line.key, e, line.content.into_bytes())),
        }
    }
}
