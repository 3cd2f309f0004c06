//! T10: a PostgreSQL table read by the PostgreSQL source on 1, 2, 4 in-process workers (four
//! lanes each) on NATS, beside one plain `SELECT` of the whole table (no coordination, one
//! connection, the same JSON per row): what the source's ranges, keyset pagination and
//! coordination cost against the plainest read, and how the read scales out.
//!
//! Two measurements: unpaced (how fast rows come out of the database on this machine: the
//! plain reader against one worker), and with a sink that takes a fixed time per byte a lane
//! (a downstream of bounded bandwidth, as T9's), so that on two cores it is coordination, not
//! the CPU the database shares with the workers, that the efficiency measures.

use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use etl_coordination_sources::postgres::PostgresSource;
use futures_util::StreamExt as _;

use crate::objects::{FilesRun, Paced, run_files};
use crate::scenarios::Target;

/// T10's figures.
pub struct Scan {
    pub rows: u64,
    pub bytes: u64,
    /// Seconds of the plain `SELECT`.
    pub plain_s: f64,
    /// One worker, unpaced.
    pub unpaced: FilesRun,
    /// Each fleet size, paced.
    pub paced: Vec<(usize, FilesRun)>,
}

/// The table `bench_scan` of `rows` rows with ids of three densities (a dense run, a sparse one,
/// quadratic gaps), made anew.
async fn table(client: &tokio_postgres::Client, rows: u64) -> Result<u64> {
    client
        .batch_execute(&format!(
            "DROP TABLE IF EXISTS bench_scan;
             CREATE TABLE bench_scan (id bigint PRIMARY KEY, item text, price numeric(12,2), at timestamptz);
             INSERT INTO bench_scan
             SELECT CASE WHEN g <= {dense} THEN g WHEN g <= {sparse} THEN 10000000 + g * 1000 ELSE g * g * 100 END,
                    'item ' || g || ' ' || repeat('x', 40), g / 100.0, '2026-01-01'::timestamptz + g * interval '1 s'
             FROM generate_series(1::bigint, {rows}) g;",
            dense = rows * 6 / 10,
            sparse = rows * 9 / 10
        ))
        .await
        .context("creating bench_scan")?;
    // On its own: VACUUM cannot run in the implicit transaction of a multi-statement batch.
    client.batch_execute("VACUUM ANALYZE bench_scan").await.context("vacuuming bench_scan")?;
    let row = client.query_one("SELECT pg_relation_size('bench_scan')::int8", &[]).await?;
    Ok(row.get::<_, i64>(0) as u64)
}

/// The plain reader: one `SELECT` of every row as JSON, streamed; the rows read.
async fn plain(client: &tokio_postgres::Client) -> Result<u64> {
    let stream = client
        .query_raw(
            "SELECT t.id, row_to_json(t)::text FROM (SELECT id, item, price::text AS price, at FROM bench_scan) t",
            std::iter::empty::<i64>(),
        )
        .await?;
    let mut stream = std::pin::pin!(stream);
    let mut n = 0u64;
    let mut bytes = 0usize;
    while let Some(row) = stream.next().await {
        let row = row?;
        let json: &str = row.get(1);
        bytes += json.len();
        n += 1;
    }
    std::hint::black_box(bytes);
    Ok(n)
}

/// T10 on `t`, the database at `conninfo`: `rows` rows in ranges of `split_rows`, fleets of
/// `counts` workers with a sink taking `per_mib` a MiB a lane.
pub async fn scan(
    t: &Target,
    conninfo: &str,
    rows: u64,
    split_rows: u64,
    counts: &[usize],
    per_mib: Duration,
) -> Result<Scan> {
    let (client, connection) =
        tokio_postgres::connect(conninfo, tokio_postgres::NoTls).await.context("connecting to PostgreSQL")?;
    tokio::spawn(connection);
    let bytes = table(&client, rows).await?;
    let t0 = Instant::now();
    let read = plain(&client).await?;
    let plain_s = t0.elapsed().as_secs_f64();
    anyhow::ensure!(read == rows, "the plain reader read {read} of {rows} rows");
    let source = PostgresSource::connect(conninfo, "bench_scan", "id", split_rows).await?;
    let unpaced = run_files(t, "t10-unpaced", source.clone(), Paced::new(Duration::ZERO), 1, 4).await?;
    anyhow::ensure!(unpaced.distinct == rows, "{} of {rows} rows emitted", unpaced.distinct);
    let mut paced = Vec::new();
    for &n in counts {
        let run = run_files(t, &format!("t10-{n}"), source.clone(), Paced::new(per_mib), n, 4).await?;
        anyhow::ensure!(run.distinct == rows, "{} of {rows} rows emitted at {n} workers", run.distinct);
        eprintln!("T10 {n} workers: makespan {:.1} s, {} records", run.makespan, run.records);
        paced.push((n, run));
    }
    Ok(Scan { rows, bytes, plain_s, unpaced, paced })
}
