//! `cargo xtask itest`: provisions NATS and runs every integration suite, then prints a table;
//! and the container suites `ci` runs where a Docker engine answers.

use std::process::Command;
use std::time::Instant;

use anyhow::{Context, Result, bail};

use crate::servers::Servers;
use crate::{images, nats};

/// The S3 test needs the `cloud` feature, which `cargo test --workspace` does not enable.
pub(crate) const S3_TEST: &[&str] = &["-p", "etl-coord", "--features", "cloud", "--test", "s3"];

/// `cargo xtask itest`: provisions NATS and runs every integration suite, then prints a table.
pub(crate) fn run() -> Result<()> {
    let servers = Servers::provision()?;
    // (name, cargo test arguments, the provisioned servers it uses: current, 2.10, cluster;
    // whether it also starts nats-server processes of its own to kill, restart or cut off)
    let (cur, old, cluster) = ([true, false, false], [true, true, false], [false, false, true]);
    let none = [false; 3];
    let suites: [(&str, &[&str], [bool; 3], bool); 9] = [
        (
            "nats conformance (single server)",
            &["-p", "etl-coordination-nats", "--test", "conformance"],
            cur,
            false,
        ),
        (
            "nats conformance (3 nodes, R3)",
            &["-p", "etl-coordination-nats", "--test", "conformance_cluster"],
            cluster,
            false,
        ),
        (
            "nats reads after writes (R3, follower down or lagging)",
            &["-p", "etl-coordination-nats", "--test", "cluster_reads"],
            none,
            true,
        ),
        ("nats startup checks", &["-p", "etl-coordination-nats", "--test", "setup"], old, true),
        ("failure modes (real processes)", &["-p", "etl-coord", "--test", "nats_workers"], old, true),
        (
            "partitions (real processes, cut and stalled links)",
            &["-p", "etl-coord", "--test", "partitions"],
            none,
            true,
        ),
        ("deployment files", &["-p", "etl-coord", "--test", "deploy"], cur, true),
        ("documented commands", &["-p", "etl-coord", "--test", "docs"], cur, true),
        ("object-store input (S3 on moto)", S3_TEST, none, false),
    ];
    // Which path served each suite: the provisioned servers it uses, and its own processes.
    let path = |uses: [bool; 3], own: bool| -> String {
        let mut kinds: Vec<&str> = Vec::new();
        for (p, used) in servers.nats().iter().zip(uses) {
            let kind = p.how.split_whitespace().next().unwrap_or("?");
            if used && !kinds.contains(&kind) {
                kinds.push(kind);
            }
        }
        if own {
            kinds.push("own processes");
        }
        if kinds.is_empty() { "-".into() } else { kinds.join(" + ") }
    };
    let mut rows = Vec::new();
    for (name, args, uses, own) in suites {
        rows.push(run_suite(name, args, &servers.env(), path(uses, own))?);
    }
    rows.extend(container_rows(false)?);
    for p in servers.nats() {
        println!("NATS {}: {}", p.what, p.how);
    }
    print_rows(&rows)
}

/// What one suite did.
struct Row {
    name: &'static str,
    passed: u32,
    failed: u32,
    ok: bool,
    secs: f64,
    path: String,
}

/// Runs `cargo test ARGS` with `env`; prints its output when it fails, and the timing lines
/// (`hosts timing:`) it printed either way.
fn run_suite(name: &'static str, args: &[&str], env: &[(&str, &str)], path: String) -> Result<Row> {
    let t0 = Instant::now();
    let mut cmd = Command::new(env!("CARGO"));
    cmd.arg("test").args(args);
    for (k, v) in env {
        cmd.env(k, v);
    }
    let out = cmd.output().context("running cargo test")?;
    let text = String::from_utf8_lossy(&out.stdout);
    let (passed, failed) = text
        .lines()
        .filter_map(|l| l.strip_prefix("test result: "))
        .map(|l| {
            let n = |w: &str| {
                l.split(';')
                    .find(|p| p.contains(w))
                    .and_then(|p| p.split_whitespace().rev().nth(1)?.parse::<u32>().ok())
                    .unwrap_or(0)
            };
            (n("passed"), n("failed"))
        })
        .fold((0, 0), |a, b| (a.0 + b.0, a.1 + b.1));
    if !out.status.success() {
        print!("{text}");
        eprint!("{}", String::from_utf8_lossy(&out.stderr));
    }
    for l in text.lines().filter(|l| l.contains("hosts timing:")) {
        println!("{l}");
    }
    Ok(Row { name, passed, failed, ok: out.status.success(), secs: t0.elapsed().as_secs_f64(), path })
}

fn print_rows(rows: &[Row]) -> Result<()> {
    println!("{:<54} {:>6} {:>6} {:>8}  NATS from", "suite", "passed", "failed", "seconds");
    for r in rows {
        let flag = if r.ok { "" } else { "  FAILED" };
        println!("{:<54} {:>6} {:>6} {:>8.1}  {}{flag}", r.name, r.passed, r.failed, r.secs, r.path);
    }
    if rows.iter().any(|r| !r.ok) {
        bail!("integration suites failed");
    }
    Ok(())
}

/// The suites only a Docker engine can run (ignored by a plain `cargo test`).
const CONTAINER_SUITES: [(&str, &[&str]); 2] = [
    (
        "partitions between hosts (containers)",
        &["-p", "etl-coord", "--test", "hosts", "--", "--ignored", "--nocapture"],
    ),
    ("the image and docker compose", &["-p", "etl-coord", "--test", "compose", "--", "--ignored"]),
];

/// The environment of [`CONTAINER_SUITES`] (the NATS image and the worker image, built here if
/// needed), or `None` without an engine.
pub(crate) fn container_env(from_host: bool) -> Result<Option<Vec<(&'static str, String)>>> {
    if nats::engine().is_none() {
        return Ok(None);
    }
    let explicit = std::env::var("NATS_IMAGE").ok();
    let nats = images::nats(
        explicit.as_deref().unwrap_or(nats::NATS_IMAGE),
        nats::NATS_VERSION,
        explicit.is_some(),
    )?;
    println!("NATS image of the container suites: {} ({})", nats.tag, nats.how);
    let tag = "etl-coordination/etl-coord:itest";
    let worker = if from_host { images::worker_from_host(tag)? } else { images::worker(tag)? };
    println!("worker image: {} ({})", worker.tag, worker.how);
    Ok(Some(vec![("HOSTS_NATS_IMAGE", nats.tag), ("HOSTS_WORKER_IMAGE", worker.tag)]))
}

/// The rows of [`CONTAINER_SUITES`] where an engine answers: the images made first; if that
/// fails, the suites are FAILED rows (with the reason printed), so the rest of the table stands.
fn container_rows(from_host: bool) -> Result<Vec<Row>> {
    let env = match container_env(from_host) {
        Ok(Some(env)) => env,
        Ok(None) => {
            println!(
                "no Docker engine (or NATS_NO_CONTAINERS): the suites of separate hosts, the image and compose do not run"
            );
            return Ok(Vec::new());
        }
        Err(e) => {
            println!("the images of the container suites could not be made: {e:#}");
            let failed = |(name, _): (&'static str, &[&str])| Row {
                name,
                passed: 0,
                failed: 0,
                ok: false,
                secs: 0.0,
                path: "containers: no image".into(),
            };
            return Ok(CONTAINER_SUITES.into_iter().map(failed).collect());
        }
    };
    let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
    CONTAINER_SUITES
        .into_iter()
        .map(|(name, args)| run_suite(name, args, &env, "containers (cluster, workers, compose)".into()))
        .collect()
}

/// Runs [`CONTAINER_SUITES`] where an engine answers (part of `ci`), on a worker image made
/// from this machine's binary ([`images::worker_from_host`]).
pub(crate) fn container_suites() -> Result<()> {
    let rows = container_rows(true)?;
    if rows.is_empty() { Ok(()) } else { print_rows(&rows) }
}
