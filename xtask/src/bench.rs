//! `cargo xtask bench [--quick | --objects | --tables]`: the benchmark, with the servers it needs.

use anyhow::{Result, bail};

use crate::util;
use crate::{cargo, nats, postgres};

/// `cargo xtask bench [--quick]`: the targets measured on a NATS server and a 3-node cluster
/// (replicas 3) this command starts (or `NATS_URL` / `NATS_CLUSTER_URL`), written to
/// `docs/BENCHMARKS.md`. `--quick` is the smoke run of `ci`: one server, few samples, written
/// under `target/` (it asserts nothing about speed). `--objects` measures only the object-store
/// input (T8, T9) and rewrites that section of `docs/BENCHMARKS.md`, leaving the rest as it was;
/// `--tables` the same for the PostgreSQL source (T10).
pub(crate) fn run(args: &[String]) -> Result<()> {
    let quick = args.iter().any(|a| a == "--quick");
    let objects = args.iter().any(|a| a == "--objects");
    let tables = args.iter().any(|a| a == "--tables");
    if let Some(other) = args.iter().find(|a| !["--quick", "--objects", "--tables"].contains(&a.as_str())) {
        bail!("unknown argument {other:?}: cargo xtask bench [--quick | --objects | --tables]");
    }
    let mut guards: Vec<nats::NatsProcess> = Vec::new();
    let url = match std::env::var("NATS_URL") {
        Ok(url) => url,
        Err(_) => {
            let p = nats::start_node(nats::NATS_VERSION, util::free_port()?, &[])?;
            let url = p.url.clone();
            guards.push(p);
            url
        }
    };
    if objects {
        cargo(&[
            "run",
            "--release",
            "--quiet",
            "-p",
            "etl-coordination-bench",
            "--",
            "--nats",
            &url,
            "--only",
            "OBJECTS",
            "--out",
            "docs/BENCHMARKS.md",
            "--splice",
            "objects",
            "--command",
            &format!("cargo xtask bench --objects (NATS {})", nats::NATS_VERSION),
        ])?;
        println!("rewrote the object-store section of docs/BENCHMARKS.md");
        return Ok(());
    }
    let pg = postgres::start()?;
    if tables {
        cargo(&[
            "run",
            "--release",
            "--quiet",
            "-p",
            "etl-coordination-bench",
            "--",
            "--nats",
            &url,
            "--postgres",
            &pg.conninfo,
            "--only",
            "TABLES",
            "--out",
            "docs/BENCHMARKS.md",
            "--splice",
            "tables",
            "--command",
            &format!("cargo xtask bench --tables (NATS {})", nats::NATS_VERSION),
        ])?;
        println!("rewrote the PostgreSQL table section of docs/BENCHMARKS.md");
        return Ok(());
    }
    if quick {
        return bench_quick(&url, &pg.conninfo);
    }
    let cluster = match std::env::var("NATS_CLUSTER_URL") {
        Ok(url) => url,
        Err(_) => {
            let nodes = nats::start_cluster(nats::NATS_VERSION)?;
            let url = nodes.iter().map(|n| n.url.clone()).collect::<Vec<_>>().join(",");
            guards.extend(nodes);
            url
        }
    };
    cargo(&[
        "run",
        "--release",
        "--quiet",
        "-p",
        "etl-coordination-bench",
        "--",
        "--nats",
        &url,
        "--cluster",
        &cluster,
        "--postgres",
        &pg.conninfo,
        "--out",
        "docs/BENCHMARKS.md",
        "--plots",
        "docs/bench",
        "--command",
        &format!("cargo xtask bench (NATS {})", nats::NATS_VERSION),
    ])?;
    println!("wrote docs/BENCHMARKS.md");
    Ok(())
}

/// The benchmark's smoke run against `url` (a debug build: it shares the test build).
pub(crate) fn bench_quick(url: &str, postgres: &str) -> Result<()> {
    let out = util::target_dir().join("bench-quick.md");
    let out = out.to_string_lossy();
    cargo(&[
        "run",
        "--quiet",
        "-p",
        "etl-coordination-bench",
        "--",
        "--nats",
        url,
        "--postgres",
        postgres,
        "--quick",
        "--out",
        &out,
        "--command",
        "cargo xtask bench --quick",
    ])?;
    println!("bench --quick: wrote {out}");
    Ok(())
}
