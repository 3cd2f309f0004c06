//! `etl-coordination-bench`: the targets of docs/BENCHMARKS.md measured on real NATS, written
//! as that document. Run it through `cargo xtask bench` (which provisions the servers);
//! `--quick` is the smoke run `cargo xtask ci` makes so the harness cannot rot (it asserts
//! nothing about speed).
//!
//! ```text
//! etl-coordination-bench --nats URL [--cluster URLS] [--postgres CONNINFO] [--quick]
//!     [--only T1,...,T7,COST,PEERS,OBJECTS,TABLES] [--out FILE [--splice NAME]] [--plots DIR]
//!     [--t6-splits N,...]
//!     [--command TEXT]
//! ```
//!
//! `--splice objects` rewrites only the region of `--out` between `<!-- objects -->` and
//! `<!-- /objects -->` (appended when it has none), with a line saying when it was measured.
//!
//! The peers (static partitioning, PostgreSQL `SKIP LOCKED`) run beside the first target (the
//! single node) on the same work; the PostgreSQL ones need `--postgres`.

mod measure;
mod objects;
mod peers;
mod plots;
mod report;
mod scenarios;
mod tables;
mod world;

use std::fmt::Write as _;
use std::time::Duration;

use anyhow::{Context, Result, bail};

use report::Run;
use scenarios::Target;

struct Args {
    nats: String,
    cluster: Option<String>,
    postgres: Option<String>,
    plots: Option<std::path::PathBuf>,
    quick: bool,
    out: Option<String>,
    command: String,
    /// Only these targets (`T1`..`T7`); all when empty.
    only: Vec<String>,
    /// Replace only the region between `<!-- NAME -->` and `<!-- /NAME -->` of `--out`.
    splice: Option<String>,
    /// T6's plan sizes instead of its own (one size measured by hand).
    t6_splits: Vec<usize>,
}

fn args() -> Result<Args> {
    let mut a = Args {
        nats: String::new(),
        cluster: None,
        postgres: None,
        plots: None,
        quick: false,
        out: None,
        command: String::new(),
        only: Vec::new(),
        splice: None,
        t6_splits: Vec::new(),
    };
    let mut it = std::env::args().skip(1);
    while let Some(arg) = it.next() {
        let mut value = |name: &str| it.next().with_context(|| format!("{name} needs a value"));
        match arg.as_str() {
            "--nats" => a.nats = value("--nats")?,
            "--cluster" => a.cluster = Some(value("--cluster")?),
            "--postgres" => a.postgres = Some(value("--postgres")?),
            "--plots" => a.plots = Some(value("--plots")?.into()),
            "--quick" => a.quick = true,
            "--out" => a.out = Some(value("--out")?),
            "--command" => a.command = value("--command")?,
            "--splice" => a.splice = Some(value("--splice")?),
            "--only" => a.only = value("--only")?.split(',').map(|t| t.trim().to_uppercase()).collect(),
            "--t6-splits" => {
                a.t6_splits = value("--t6-splits")?
                    .split(',')
                    .map(|n| {
                        n.trim()
                            .replace('_', "")
                            .parse()
                            .with_context(|| format!("--t6-splits: {n:?} is not a number of splits"))
                    })
                    .collect::<Result<_>>()?
            }
            other => bail!("unknown argument {other:?} (see the crate documentation)"),
        }
    }
    if a.nats.is_empty() {
        bail!("--nats URL is required (cargo xtask bench provisions a server and passes it)");
    }
    Ok(a)
}

/// Runs one measurement, failing it (instead of hanging) past `limit`.
async fn bounded<T>(
    what: &str,
    limit: Duration,
    f: impl std::future::Future<Output = Result<T>>,
) -> Result<T> {
    tokio::time::timeout(limit, f).await.with_context(|| format!("{what} did not finish within {limit:?}"))?
}

/// What the per-target measurements are, in report order.
const PER_TARGET: [(&str, &str); 7] = [
    ("T1", "release pickup"),
    ("T2", "takeover"),
    ("T3", "reclaim"),
    ("T4", "balance"),
    ("T5", "traffic"),
    ("T6", "large plan"),
    ("T7", "scale-out"),
];

/// Runs one measurement of the table on `t`, writing its section.
async fn measure(id: &str, run: &mut Run, a: &Args, t: &Target, first: bool) -> Result<()> {
    match id {
        "T1" => measure::t1_release_pickup(run, t, first).await,
        "T2" => measure::t2_takeover(run, t, first).await,
        "T3" => measure::t3_reclaim(run, t).await,
        "T4" => measure::t4_balance(run, t).await,
        "T5" => measure::t5_traffic(run, a, t).await,
        "T6" => measure::t6_large_plan(run, a, t).await,
        "T7" => measure::t7_scale_out(run, a, t, first).await,
        other => bail!("no measurement {other}"),
    }
}

#[tokio::main]
async fn main() -> Result<()> {
    let raw: Vec<String> = std::env::args().skip(1).collect();
    if raw.first().map(String::as_str) == Some("t6-worker") {
        // A worker process's warnings (a failed watch, a slow consumer) reach the bench's
        // standard error; its report goes to standard output.
        tracing_subscriber::fmt()
            .with_env_filter(
                tracing_subscriber::EnvFilter::try_from_default_env()
                    .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
            )
            .with_writer(std::io::stderr)
            .init();
        return scenarios::t6_worker(&raw[1..]).await;
    }
    let a = args()?;
    let mut targets = vec![Target { name: "NATS single node", url: a.nats.clone(), replicas: 1 }];
    if let Some(c) = &a.cluster {
        targets.push(Target { name: "NATS 3-node cluster, replicas 3", url: c.clone(), replicas: 3 });
    }
    let want = |t: &str| a.only.is_empty() || a.only.iter().any(|o| o == t);
    let mut run = Run::new(&a)?;
    for (ti, t) in targets.iter().enumerate() {
        let started = std::time::Instant::now();
        // No heading for a target nothing is measured on (a `--splice` run of one section).
        if !PER_TARGET.iter().any(|(id, _)| want(id)) {
            continue;
        }
        eprintln!("== {}", t.name);
        writeln!(run.doc, "## {}\n", t.name)?;
        for (id, _) in PER_TARGET.iter().filter(|(id, _)| want(id)) {
            measure(id, &mut run, &a, t, ti == 0).await?;
        }
        eprintln!("{} done in {:.0} s", t.name, started.elapsed().as_secs_f64());
    }
    let t = &targets[0];
    if want("PEERS") {
        measure::peers(&mut run, &a, t).await?;
    }
    if want("COST") {
        measure::cost_curve(&mut run, &a, t).await?;
    }
    if want("OBJECTS") {
        measure::objects(&mut run, &a, t).await?;
    }
    if want("TABLES") && (a.postgres.is_some() || !a.only.is_empty()) {
        measure::tables(&mut run, &a, t).await?;
    }
    match (&a.out, &a.splice) {
        (Some(path), Some(name)) => {
            let old = std::fs::read_to_string(path).with_context(|| format!("reading {path}"))?;
            std::fs::write(path, report::splice(&old, name, &run.section(&a)?))
                .with_context(|| format!("writing {path}"))?;
        }
        (Some(path), None) => {
            std::fs::write(path, run.page(&a)?).with_context(|| format!("writing {path}"))?
        }
        (None, _) => print!("{}", run.page(&a)?),
    }
    Ok(())
}
