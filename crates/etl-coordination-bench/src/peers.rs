//! What users would build instead, run on the same [`Work`] (same splits, same paced reader,
//! same lane openings log, same commit cadence):
//!
//! - static partitioning: replica `r` of `n` takes the splits whose id hashes to `r` mod `n`;
//! - a table of splits in PostgreSQL claimed with `FOR UPDATE SKIP LOCKED` and a lease-expiry
//!   column, written as a careful user would (see [`PgJob`]).

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use anyhow::{Context, Result};
use tokio::sync::watch;
use tokio::task::JoinSet;
use tokio::time::Instant;
use tokio_postgres::{Client, NoTls};

use crate::world::Work;

/// FNV-1a, as a user would hash object names.
fn fnv(s: &str) -> u64 {
    s.bytes().fold(0xcbf2_9ce4_8422_2325_u64, |h, b| (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3))
}

/// A running static-partitioning fleet.
pub struct Static {
    replicas: Vec<JoinSet<()>>,
    pub emitted: Arc<AtomicU64>,
}

impl Static {
    /// Starts `n` replicas of `lanes` lanes each on `work`, with no coordination at all.
    pub fn start(work: &Work, n: usize, lanes: usize) -> Static {
        let emitted = Arc::new(AtomicU64::new(0));
        let mut replicas = Vec::new();
        for r in 0..n {
            let mine: Vec<String> =
                work.ids().into_iter().filter(|id| fnv(id) % n as u64 == r as u64).collect();
            let mut set = JoinSet::new();
            let (work, emitted) = (work.clone(), emitted.clone());
            set.spawn(async move {
                let slots = Arc::new(tokio::sync::Semaphore::new(lanes));
                let mut running = JoinSet::new();
                for split in mine {
                    let permit = slots.clone().acquire_owned().await.expect("never closed");
                    let (work, emitted) = (work.clone(), emitted.clone());
                    running.spawn(async move {
                        let mut reader = work.reader(&format!("r{r}"), &split, None, 0);
                        while let Some(record) = reader.read().await {
                            emitted.fetch_add(1, Ordering::Relaxed);
                            work.emitted(&split, record);
                        }
                        drop(permit);
                    });
                }
                while running.join_next().await.is_some() {}
            });
            replicas.push(set);
        }
        Static { replicas, emitted }
    }

    /// Kills replica `r` (its share is never finished: nothing else knows about it).
    pub fn kill(&mut self, r: usize) {
        self.replicas[r].abort_all();
    }

    /// Waits for every replica still running.
    pub async fn finished(&mut self) {
        for set in &mut self.replicas {
            while set.join_next().await.is_some() {}
        }
    }
}

/// A job of the PostgreSQL peer: one table of splits, claimed by replicas with
/// `FOR UPDATE SKIP LOCKED`.
///
/// What it needed to be written carefully: the table is created (and filled) once, by a
/// migration step before any replica starts (replicas racing on `CREATE TABLE IF NOT EXISTS`
/// fail with a unique violation on the catalog); the owner column carries a per-process
/// incarnation so a restarted replica never mistakes an old claim for its own, and a claim
/// token per claim so two lanes of one replica never both pass the guard after an expiry;
/// every progress write is guarded by owner and token, so a lane whose claim expired and was
/// taken cannot overwrite the new owner's progress; the expiry is renewed by a heartbeat separate from the
/// lanes, so a slow record does not lose the claim. What it does not have: no fencing beyond
/// the owner guard (an expired owner's in-flight write that lands first still counts), no
/// fair share (a replica claims as many splits as it has lanes), and pickup waits for a poll.
#[derive(Clone)]
pub struct PgJob {
    conn: String,
    table: String,
    pub work: Work,
    pub lease: Duration,
    pub poll: Duration,
    /// Statements sent by every replica of this job (claims, polls, commits, heartbeats).
    pub queries: Arc<AtomicU64>,
    /// Releases acknowledged by a draining replica: (when, split).
    pub released: Arc<std::sync::Mutex<Vec<(Instant, String)>>>,
}

static TABLES: AtomicU64 = AtomicU64::new(0);
static OWNERS: AtomicU64 = AtomicU64::new(0);

/// The server's version string (`SHOW server_version`), for the report.
pub async fn server_version(conn: &str) -> Result<String> {
    let client = connect(conn, None).await?;
    let row = client.query_one("SHOW server_version", &[]).await.context("asking the server its version")?;
    Ok(row.get(0))
}

async fn connect(conn: &str, tasks: Option<&mut JoinSet<()>>) -> Result<Client> {
    let (client, connection) = tokio_postgres::connect(conn, NoTls)
        .await
        .with_context(|| format!("connecting to PostgreSQL ({conn})"))?;
    let drive = async move {
        let _ = connection.await;
    };
    match tasks {
        Some(set) => {
            set.spawn(drive);
        }
        None => {
            tokio::spawn(drive);
        }
    }
    Ok(client)
}

impl PgJob {
    /// Creates and fills the job's table (the migration step).
    pub async fn create(conn: &str, work: Work, lease: Duration, poll: Duration) -> Result<PgJob> {
        let n = TABLES.fetch_add(1, Ordering::Relaxed);
        let table = format!("bench_splits_{}_{n}", std::process::id());
        let client = connect(conn, None).await?;
        client
            .batch_execute(&format!(
                "CREATE TABLE {table} (
                    id text PRIMARY KEY,
                    records bigint NOT NULL,
                    progress bigint NOT NULL DEFAULT 0,
                    done boolean NOT NULL DEFAULT false,
                    owner text,
                    claim bigint,
                    expires_at timestamptz
                 )"
            ))
            .await
            .context("creating the splits table")?;
        let total = i64::try_from(work.records).context("records must fit a bigint")?;
        client
            .execute(
                &format!(
                    "INSERT INTO {table} (id, records) \
                     SELECT 's' || lpad(g::text, 6, '0'), $2::bigint FROM generate_series(0, $1::bigint - 1) g"
                ),
                &[&(work.splits as i64), &total],
            )
            .await
            .context("filling the splits table")?;
        Ok(PgJob {
            conn: conn.to_owned(),
            table,
            work,
            lease,
            poll,
            queries: Arc::default(),
            released: Arc::default(),
        })
    }

    /// Drops the job's table (a job's last step, so a shared server keeps nothing).
    pub async fn drop_table(&self) -> Result<()> {
        let client = connect(&self.conn, None).await?;
        client
            .batch_execute(&format!("DROP TABLE {}", self.table))
            .await
            .context("dropping the splits table")?;
        Ok(())
    }

    /// Starts a replica named `id` with `lanes` lanes.
    pub async fn start(&self, id: &str, lanes: usize) -> Result<PgReplica> {
        let owner = format!("{id}/{}", OWNERS.fetch_add(1, Ordering::Relaxed));
        let (drain_tx, drain) = watch::channel(false);
        let emitted = Arc::new(AtomicU64::new(0));
        let mut tasks = JoinSet::new();
        let heartbeat = connect(&self.conn, Some(&mut tasks)).await?;
        let mut lanes_set = JoinSet::new();
        for _ in 0..lanes {
            let client = connect(&self.conn, Some(&mut tasks)).await?;
            let lane = Lane {
                job: self.clone(),
                client,
                worker: id.to_owned(),
                owner: owner.clone(),
                drain: drain.clone(),
                emitted: emitted.clone(),
            };
            lanes_set.spawn(async move { lane.run().await });
        }
        let (job, who) = (self.clone(), owner.clone());
        tasks.spawn(async move {
            let sql = format!(
                "UPDATE {} SET expires_at = now() + make_interval(secs => $2) WHERE owner = $1 AND NOT done",
                job.table
            );
            loop {
                tokio::time::sleep(job.lease / 3).await;
                job.queries.fetch_add(1, Ordering::Relaxed);
                let _ = heartbeat.execute(&sql, &[&who, &job.lease.as_secs_f64()]).await;
            }
        });
        Ok(PgReplica { tasks, lanes: lanes_set, drain: drain_tx, emitted })
    }
}

/// A running replica of the PostgreSQL peer.
pub struct PgReplica {
    tasks: JoinSet<()>,
    lanes: JoinSet<Result<()>>,
    drain: watch::Sender<bool>,
    pub emitted: Arc<AtomicU64>,
}

impl PgReplica {
    /// Graceful stop: every lane commits its progress and releases its split.
    pub fn drain(&self) {
        let _ = self.drain.send(true);
    }

    /// `kill -9`: every connection dropped (first, so nothing already queued reaches the
    /// server after the kill), then every task; nothing released.
    pub fn kill(&mut self) {
        self.tasks.abort_all();
        self.lanes.abort_all();
    }

    /// Waits until every lane ended (the job done, or drained); then stops the heartbeat.
    pub async fn finished(&mut self) -> Result<()> {
        while let Some(r) = self.lanes.join_next().await {
            match r {
                Ok(r) => r?,
                Err(e) if e.is_cancelled() => {}
                Err(e) => return Err(e.into()),
            }
        }
        self.tasks.abort_all();
        Ok(())
    }
}

struct Lane {
    job: PgJob,
    client: Client,
    worker: String,
    owner: String,
    drain: watch::Receiver<bool>,
    emitted: Arc<AtomicU64>,
}

/// The same commit cadence as the pipelines: every 1,000 records or every second.
const COMMIT_RECORDS: u64 = 1_000;
const COMMIT_EVERY: Duration = Duration::from_secs(1);

impl Lane {
    async fn query(&self, sql: &str, params: &[&(dyn tokio_postgres::types::ToSql + Sync)]) -> Result<u64> {
        self.job.queries.fetch_add(1, Ordering::Relaxed);
        Ok(self.client.execute(sql, params).await?)
    }

    async fn run(mut self) -> Result<()> {
        let sql = Sql::new(&self.job.table);
        let lease = self.job.lease.as_secs_f64();
        loop {
            if *self.drain.borrow() {
                return Ok(());
            }
            self.job.queries.fetch_add(1, Ordering::Relaxed);
            let token = OWNERS.fetch_add(1, Ordering::Relaxed) as i64;
            let row = self
                .client
                .query_opt(&sql.claim, &[&self.owner, &lease, &token])
                .await
                .context("claiming")?;
            let Some(row) = row else {
                self.job.queries.fetch_add(1, Ordering::Relaxed);
                let left: i64 = self.client.query_one(&sql.remaining, &[]).await?.get(0);
                if left == 0 {
                    return Ok(());
                }
                tokio::select! {
                    _ = tokio::time::sleep(self.job.poll) => {}
                    _ = self.drain.changed() => {}
                }
                continue;
            };
            let (split, from): (String, i64) = (row.get(0), row.get(1));
            if self.read_split(&sql, split, from, token).await? {
                return Ok(());
            }
        }
    }

    /// Reads a claimed split from `from`, committing as it goes; true if the lane drained (it
    /// committed and released the split).
    async fn read_split(&mut self, sql: &Sql, split: String, from: i64, token: i64) -> Result<bool> {
        let mut reader = self.job.work.reader(&self.worker, &split, None, from as u64);
        let (mut since, mut last) = (0, Instant::now());
        loop {
            let read = tokio::select! {
                biased;
                _ = self.drain.changed() => None,
                r = reader.read() => Some(r),
            };
            let at = reader.position() as i64;
            match read {
                // Draining: commit and release.
                None => {
                    self.query(&sql.release, &[&split, &self.owner, &at, &token]).await?;
                    self.job.released.lock().unwrap().push((Instant::now(), split.clone()));
                    return Ok(true);
                }
                Some(None) => {
                    self.query(&sql.finish, &[&split, &self.owner, &at, &token]).await?;
                    return Ok(false);
                }
                Some(Some(record)) => {
                    self.emitted.fetch_add(1, Ordering::Relaxed);
                    self.job.work.emitted(&split, record);
                    since += 1;
                    if since >= COMMIT_RECORDS || last.elapsed() >= COMMIT_EVERY {
                        (since, last) = (0, Instant::now());
                        if self.query(&sql.commit, &[&split, &self.owner, &at, &token]).await? == 0 {
                            // Taken by another replica after our claim expired.
                            return Ok(false);
                        }
                    }
                }
            }
        }
    }
}

/// The statements of a PostgreSQL replica: claim the largest remaining split (unclaimed or
/// expired), count what is left, and commit, finish or release guarded by the owner.
struct Sql {
    claim: String,
    remaining: String,
    commit: String,
    finish: String,
    release: String,
}

impl Sql {
    fn new(t: &str) -> Sql {
        let claim = format!(
            "UPDATE {t} SET owner = $1, claim = $3, expires_at = now() + make_interval(secs => $2) \
             WHERE id = (SELECT id FROM {t} WHERE NOT done AND (owner IS NULL OR expires_at < now()) \
                         ORDER BY records - progress DESC, id LIMIT 1 FOR UPDATE SKIP LOCKED) \
             RETURNING id, progress"
        );
        let remaining = format!("SELECT count(*) FROM {t} WHERE NOT done");
        let guard = "WHERE id = $1 AND owner = $2 AND claim = $4";
        let commit = format!("UPDATE {t} SET progress = $3 {guard}");
        let finish = format!("UPDATE {t} SET progress = $3, done = true, owner = NULL {guard}");
        let release = format!("UPDATE {t} SET progress = $3, owner = NULL, expires_at = NULL {guard}");
        Sql { claim, remaining, commit, finish, release }
    }
}
