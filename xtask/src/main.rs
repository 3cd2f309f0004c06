//! `cargo xtask`: the project's automation.
//!
//! - `cargo xtask ci`: the README's test command: fmt check, clippy (warnings denied), every test
//!   (the NATS ones against servers it provisions), and a simulation sweep.
//! - `cargo xtask itest`: provisions NATS and runs the integration suites, with a summary table.
//! - `cargo xtask sim --seeds N [--start S]`: a sweep of N seeds with a summary.
//! - `cargo xtask sim --seed S`: one seed, reproduced exactly.
//! - `cargo xtask mutants [--seeds N] [--only NAME[,NAME...]]`: the mutation catalogue (`xtask/mutants.txt`),
//!   each mutant applied to a copy of the workspace and swept; every one must be caught.

use std::collections::BTreeMap;
use std::process::Command;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use anyhow::{Context, Result, bail};
use etl_coordination_sim::{Options, Report, run};

mod moto;
mod mutants;
mod nats;
mod postgres;
mod promtool;
mod servers;
mod util;

use servers::Servers;

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args.first().map(String::as_str) {
        Some("ci" | "itest") if wants_containers() => rerun_with_containers(&args),
        Some("ci") => ci(),
        Some("sim") => sim(&args[1..]),
        Some("itest") => itest(),
        Some("mutants") => mutants::run(&args[1..]),
        Some("bench") => bench(&args[1..]),
        _ => {
            eprintln!(
                "usage: cargo xtask <ci | itest | sim --seeds N [--start S] [--stop-on-violation] | sim --seed S \
                 | mutants [--seeds N] [--only NAME[,NAME...]] | bench [--quick]>"
            );
            std::process::exit(2);
        }
    }
}

/// Whether this run should start NATS containers but was built without the client for them.
fn wants_containers() -> bool {
    !cfg!(feature = "containers")
        && (std::env::var_os("NATS_URL").is_none() || std::env::var_os("NATS_OLD_URL").is_none())
        && nats::containers_for(&nats::nats_image())
}

/// Re-runs this xtask command with the `containers` feature (the testcontainers client), which
/// is only compiled on machines where a Docker engine answers.
fn rerun_with_containers(args: &[String]) -> Result<()> {
    println!("a Docker engine answers: re-running with `--features containers` to start NATS containers");
    let status = Command::new(env!("CARGO"))
        .args(["run", "--quiet", "--package", "xtask", "--features", "containers", "--"])
        .args(args)
        .status()
        .context("running cargo")?;
    std::process::exit(status.code().unwrap_or(1));
}

fn flag(args: &[String], name: &str) -> Result<Option<u64>> {
    match args.iter().position(|a| a == name) {
        None => Ok(None),
        Some(i) => {
            let v = args.get(i + 1).with_context(|| format!("{name} needs a value"))?;
            Ok(Some(v.parse().with_context(|| format!("{name} expects a number, got {v:?}"))?))
        }
    }
}

fn sim(args: &[String]) -> Result<()> {
    let stop_early = args.iter().any(|a| a == "--stop-on-violation");
    let args: Vec<String> = args.iter().filter(|a| *a != "--stop-on-violation").cloned().collect();
    let args = args.as_slice();
    for pair in args.chunks(2) {
        if !["--seed", "--seeds", "--start"].contains(&pair[0].as_str()) || pair.len() < 2 {
            bail!(
                "usage: cargo xtask sim --seeds N [--start S] [--stop-on-violation] | --seed S (got {args:?})"
            );
        }
    }
    if let Some(seed) = flag(args, "--seed")? {
        let report = run(seed, &Options::for_seed(seed));
        print_one(&report);
        if let Some(v) = &report.violation {
            bail!("seed {seed}: {v}");
        }
        return Ok(());
    }
    let seeds = flag(args, "--seeds")?.unwrap_or(200);
    let start = flag(args, "--start")?.unwrap_or(0);
    sweep(start, seeds, stop_early).map(|_| ())
}

fn print_one(r: &Report) {
    println!(
        "seed {}: outcome {}, {} events, {:.1}s virtual",
        r.seed,
        r.outcome,
        r.events,
        r.virtual_time.as_secs_f64()
    );
    println!("  faults: {:?}", r.faults);
    println!("  acquisitions: {:?}", r.acquisitions);
    println!("  checks: {:?}", r.checks);
    println!(
        "  records: {} in input, {} emitted ({} replayed)",
        r.records_total,
        r.records_emitted,
        r.records_emitted.saturating_sub(r.records_total)
    );
    println!("  trace hash: {:016x}", r.trace_hash);
    if let Some(v) = &r.violation {
        println!("  VIOLATION: {v}");
    }
}

/// Runs `count` seeds on every core and prints one summary; returns the seeds that stalled
/// without a poison split (healthy splits quarantined). With `stop_early`, the sweep ends at
/// the first violation (the mutation runs only need to know whether one is caught).
pub fn sweep(start: u64, count: u64, stop_early: bool) -> Result<Vec<u64>> {
    let t0 = Instant::now();
    let next = AtomicU64::new(start);
    let stop = std::sync::atomic::AtomicBool::new(false);
    let end = start + count;
    let agg: Mutex<Agg> = Mutex::new(Agg::default());
    let threads = std::thread::available_parallelism().map_or(2, |n| n.get());
    std::thread::scope(|s| {
        for _ in 0..threads {
            s.spawn(|| {
                loop {
                    let seed = next.fetch_add(1, Ordering::Relaxed);
                    if seed >= end || stop.load(Ordering::Relaxed) {
                        return;
                    }
                    // A panic in the core is a bug like any violation: report it with its seed.
                    let r = std::panic::catch_unwind(|| run(seed, &Options::for_seed(seed)));
                    let mut agg = agg.lock().unwrap_or_else(|e| e.into_inner());
                    match r {
                        Ok(r) => {
                            agg.add(&r);
                            if stop_early && r.violation.is_some() {
                                stop.store(true, Ordering::Relaxed);
                            }
                        }
                        Err(panic) => {
                            if stop_early {
                                stop.store(true, Ordering::Relaxed);
                            }
                            let msg = panic
                                .downcast_ref::<String>()
                                .cloned()
                                .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
                                .unwrap_or_default();
                            agg.failures.push((seed, format!("panic: {msg}")));
                            agg.failures.sort();
                        }
                    }
                }
            });
        }
    });
    let agg = agg.into_inner().unwrap_or_else(|e| e.into_inner());
    println!("simulation sweep: seeds {start}..{end} in {:.1}s", t0.elapsed().as_secs_f64());
    println!("  events: {}", agg.events);
    println!("  faults injected: {:?}", agg.faults);
    println!("  invariant checks: {:?}", agg.checks);
    println!("  outcomes: {:?}", agg.outcomes);
    println!("  acquisitions: {:?}", agg.acquisitions);
    println!("  data: {:?}", agg.stats);
    if !agg.innocent.is_empty() {
        let shown: Vec<u64> = agg.innocent.iter().take(20).copied().collect();
        println!("  stalled without poison (healthy splits quarantined), first seeds: {shown:?}");
    }
    if agg.failures.is_empty() {
        println!("  violations: none");
        return Ok(agg.innocent);
    }
    for (seed, v) in &agg.failures {
        println!("  VIOLATION seed {seed}: {v}");
        println!("    reproduce: cargo xtask sim --seed {seed}");
    }
    bail!("{} of {count} seeds violated an invariant", agg.failures.len())
}

#[derive(Default)]
struct Agg {
    events: u64,
    faults: BTreeMap<&'static str, u64>,
    checks: BTreeMap<&'static str, u64>,
    outcomes: BTreeMap<&'static str, u64>,
    acquisitions: BTreeMap<&'static str, u64>,
    stats: BTreeMap<&'static str, u64>,
    failures: Vec<(u64, String)>,
    /// Seeds that stalled without a poison split (healthy splits quarantined).
    innocent: Vec<u64>,
}

impl Agg {
    fn add(&mut self, r: &Report) {
        self.events += r.events;
        for (k, v) in &r.faults {
            *self.faults.entry(k).or_default() += v;
        }
        for (k, v) in &r.checks {
            *self.checks.entry(k).or_default() += v;
        }
        for (k, v) in &r.acquisitions {
            *self.acquisitions.entry(k).or_default() += v;
        }
        *self.outcomes.entry(r.outcome).or_default() += 1;
        if r.poison_splits == 0 && r.outcome == "stalled" {
            *self.outcomes.entry("stalled_without_poison").or_default() += 1;
            self.innocent.push(r.seed);
            self.innocent.sort();
        }
        *self.stats.entry("splits_quarantined").or_default() += r.quarantined as u64;
        *self.stats.entry("records_in_input").or_default() += r.records_total;
        *self.stats.entry("records_replayed").or_default() +=
            r.records_emitted.saturating_sub(r.records_total);
        *self.stats.entry("steals_after_faults").or_default() += r.steals_after_faults;
        let e = self.stats.entry("max_steals_after_faults_in_one_run").or_default();
        *e = (*e).max(r.steals_after_faults);
        if let Some(v) = &r.violation {
            self.failures.push((r.seed, v.to_string()));
            self.failures.sort();
        }
    }
}

fn cargo(args: &[&str]) -> Result<()> {
    cargo_env(args, &[])
}

fn cargo_env(args: &[&str], env: &[(&str, &str)]) -> Result<()> {
    println!("$ cargo {}", args.join(" "));
    let mut cmd = Command::new(env!("CARGO"));
    cmd.args(args);
    for (k, v) in env {
        cmd.env(k, v);
    }
    let status = cmd.status().context("running cargo")?;
    if !status.success() {
        bail!("cargo {} failed", args.join(" "));
    }
    Ok(())
}

/// The S3 test needs the `cloud` feature, which `cargo test --workspace` does not enable.
const S3_TEST: &[&str] = &["-p", "etl-coord", "--features", "cloud", "--test", "s3"];

/// `cargo xtask itest`: provisions NATS and runs every integration suite, then prints a table.
fn itest() -> Result<()> {
    let servers = Servers::provision()?;
    let suites: [(&str, &[&str]); 9] = [
        ("nats conformance (single server)", &["-p", "etl-coordination-nats", "--test", "conformance"]),
        ("nats conformance (3 nodes, R3)", &["-p", "etl-coordination-nats", "--test", "conformance_cluster"]),
        (
            "nats reads after writes (R3, follower down or lagging)",
            &["-p", "etl-coordination-nats", "--test", "cluster_reads"],
        ),
        ("nats startup checks", &["-p", "etl-coordination-nats", "--test", "setup"]),
        ("failure modes (real processes)", &["-p", "etl-coord", "--test", "nats_workers"]),
        ("partitions (real processes, cut and stalled links)", &["-p", "etl-coord", "--test", "partitions"]),
        ("deployment files", &["-p", "etl-coord", "--test", "deploy"]),
        ("documented commands", &["-p", "etl-coord", "--test", "docs"]),
        ("object-store input (S3 on moto)", S3_TEST),
    ];
    let mut rows = Vec::new();
    let mut failed = false;
    for (name, args) in suites {
        let t0 = Instant::now();
        let mut cmd = Command::new(env!("CARGO"));
        cmd.arg("test").args(args);
        for (k, v) in servers.env() {
            cmd.env(k, v);
        }
        let out = cmd.output().context("running cargo test")?;
        let text = String::from_utf8_lossy(&out.stdout);
        let (passed, fails) = text
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
            failed = true;
            print!("{text}");
            eprint!("{}", String::from_utf8_lossy(&out.stderr));
        }
        rows.push((name, passed, fails, out.status.success(), t0.elapsed().as_secs_f64()));
    }
    println!("{:<36} {:>7} {:>7} {:>8}", "suite", "passed", "failed", "seconds");
    for (name, p, f, ok, secs) in &rows {
        println!("{name:<36} {p:>7} {f:>7} {secs:>8.1}{}", if *ok { "" } else { "  FAILED" });
    }
    if failed {
        bail!("integration suites failed");
    }
    Ok(())
}

fn ci() -> Result<()> {
    let t0 = Instant::now();
    cargo(&["fmt", "--all", "--", "--check"])?;
    cargo(&["clippy", "--workspace", "--all-targets", "--", "-D", "warnings"])?;
    let servers = Servers::provision()?;
    cargo_env(&["test", "--workspace"], &servers.env())?;
    let mut s3 = vec!["test"];
    s3.extend(S3_TEST);
    cargo_env(&s3, &servers.env())?;
    examples(&servers)?;
    let pg = postgres::start()?;
    bench_quick(servers.nats_url(), &pg.conninfo)?;
    drop(servers);
    let seeds: u64 = std::env::var("SIM_SEEDS").ok().and_then(|s| s.parse().ok()).unwrap_or(5000);
    let innocent = sweep(0, seeds, false)?;
    if !innocent.is_empty() {
        // P12's purpose: kills, freezes and outages are no evidence against the data.
        bail!(
            "healthy splits were quarantined in {} seeds (first: {:?})",
            innocent.len(),
            &innocent[..innocent.len().min(10)]
        );
    }
    documented_sim_commands()?;
    println!("ci passed in {:.0}s", t0.elapsed().as_secs_f64());
    Ok(())
}

/// `cargo xtask bench [--quick]`: the targets measured on a NATS server and a 3-node cluster
/// (replicas 3) this command starts (or `NATS_URL` / `NATS_CLUSTER_URL`), written to
/// `docs/BENCHMARKS.md`. `--quick` is the smoke run of `ci`: one server, few samples, written
/// under `target/` (it asserts nothing about speed).
fn bench(args: &[String]) -> Result<()> {
    let quick = args.iter().any(|a| a == "--quick");
    if let Some(other) = args.iter().find(|a| *a != "--quick") {
        bail!("unknown argument {other:?}: cargo xtask bench [--quick]");
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
    let pg = postgres::start()?;
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
fn bench_quick(url: &str, postgres: &str) -> Result<()> {
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

/// Runs the compiled examples (`examples/`), the NATS one against the provisioned server, so
/// that what the README and the docs show keeps working.
fn examples(servers: &Servers) -> Result<()> {
    let run = ["run", "--quiet", "-p", "etl-coordination-examples", "--example"];
    for (example, args) in [
        ("core_loop", &[][..]),
        ("custom_source", &[][..]),
        ("pipeline", &["--", "deploy/input"][..]),
        ("pipeline_nats", &["--", "deploy/input"][..]),
    ] {
        let mut cmd: Vec<&str> = run.to_vec();
        cmd.push(example);
        cmd.extend(args);
        cargo_env(&cmd, &servers.env())?;
    }
    Ok(())
}

/// Runs every `cargo xtask sim ...` line of the documentation's `sh` blocks, so they cannot rot
/// (the other documented commands are run by `crates/etl-coord/tests/docs.rs`).
fn documented_sim_commands() -> Result<()> {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let mut files = vec![root.join("README.md"), root.join("deploy/README.md")];
    for e in std::fs::read_dir(root.join("docs"))? {
        files.push(e?.path());
    }
    let mut ran = 0;
    for file in files.iter().filter(|f| f.extension().is_some_and(|x| x == "md")) {
        let text = std::fs::read_to_string(file)?;
        let mut in_sh = false;
        for line in text.lines().map(str::trim) {
            if let Some(info) = line.strip_prefix("```") {
                in_sh = !in_sh && info == "sh";
            } else if in_sh && let Some(args) = line.strip_prefix("cargo xtask sim ") {
                println!("$ {line}    (documented in {})", file.display());
                let args: Vec<String> = args.split_whitespace().map(str::to_owned).collect();
                sim(&args).with_context(|| format!("documented command `{line}` in {}", file.display()))?;
                ran += 1;
            }
        }
    }
    if ran == 0 {
        bail!("no documented `cargo xtask sim` command found (README.md shows some)");
    }
    Ok(())
}
