//! `cargo xtask`: the project's automation.
//!
//! - `cargo xtask ci`: the README's test command: fmt check, clippy (warnings denied), every test
//!   (the NATS ones against servers it provisions), and a simulation sweep.
//! - `cargo xtask itest`: provisions NATS and runs the integration suites, with a summary table.
//! - `cargo xtask sim --seeds N [--start S]`: a sweep of N seeds with a summary.
//! - `cargo xtask sim --seed S`: one seed, reproduced exactly.
//! - `cargo xtask mutants [--seeds N] [--only NAME[,NAME...]]`: the mutation catalogue (`xtask/mutants.txt`),
//!   each mutant applied to a copy of the workspace and swept; every one must be caught.
//! - `cargo xtask images`: makes (or finds) the images of the container suites and prints them.

use std::collections::BTreeMap;
use std::process::Command;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use anyhow::{Context, Result, bail};
use etl_coordination_sim::{Options, Report, run};

mod images;
mod moto;
mod mutants;
mod nats;
mod nats_bin;
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
        Some("images") => container_env().map(|env| match env {
            Some(env) => env.iter().for_each(|(k, v)| println!("{k}={v}")),
            None => println!("no Docker engine answers (or NATS_NO_CONTAINERS is set): no images to make"),
        }),
        _ => {
            eprintln!(
                "usage: cargo xtask <ci | itest | sim --seeds N [--start S] [--stop-on-violation] | sim --seed S \
                 | mutants [--seeds N] [--only NAME[,NAME...]] | bench [--quick] | images>"
            );
            std::process::exit(2);
        }
    }
}

/// Whether this run should start NATS containers but was built without the client for them.
fn wants_containers() -> bool {
    !cfg!(feature = "containers")
        && ["NATS_URL", "NATS_OLD_URL", "NATS_CLUSTER_URL"].iter().any(|v| std::env::var_os(v).is_none())
        && nats::engine().is_some()
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
        if !["--seed", "--seeds", "--start", "--hashes"].contains(&pair[0].as_str()) || pair.len() < 2 {
            bail!(
                "usage: cargo xtask sim --seeds N [--start S] [--stop-on-violation] [--hashes FILE] | --seed S (got {args:?})"
            );
        }
    }
    let hashes = args.chunks(2).find(|p| p[0] == "--hashes").map(|p| std::path::PathBuf::from(&p[1]));
    if let Some(seed) = flag(args, "--seed")? {
        // The options the seed drew come first: what a failing seed exercised is read, not
        // guessed (they are a pure function of the seed).
        let options = Options::for_seed(seed);
        println!("seed {seed} drew {options:#?}");
        let report = run(seed, &options);
        print_one(&report);
        if let Some(v) = &report.violation {
            bail!("seed {seed}: {v}");
        }
        return Ok(());
    }
    let seeds = flag(args, "--seeds")?.unwrap_or(200);
    let start = flag(args, "--start")?.unwrap_or(0);
    let agg = sweep_all(start, seeds, stop_early)?;
    if let Some(path) = hashes {
        // One line per seed, in seed order: two files from runs of the same seeds compare with
        // `cmp` (a restructure that must not change behaviour keeps every hash).
        let text: String = agg.hashes.iter().map(|(seed, h)| format!("{seed} {h:016x}\n")).collect();
        std::fs::write(&path, text).with_context(|| format!("writing {}", path.display()))?;
        println!("  trace hashes of {} seeds written to {}", agg.hashes.len(), path.display());
    }
    agg.verdict().map(|_| ())
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
/// Runs seeds `start..start + count` on every core, prints the summary and fails on the first
/// violation; returns the seeds that stalled without a poison split.
pub fn sweep(start: u64, count: u64, stop_early: bool) -> Result<Vec<u64>> {
    sweep_all(start, count, stop_early)?.verdict()
}

/// [`sweep`], returning the aggregate (with every seed's trace hash) instead of the verdict.
fn sweep_all(start: u64, count: u64, stop_early: bool) -> Result<Agg> {
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
    let mut agg = agg;
    agg.hashes.sort();
    agg.count = count;
    Ok(agg)
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
    /// Every seed run and its trace hash (in seed order once the sweep is over).
    hashes: Vec<(u64, u64)>,
    /// How many seeds were asked for.
    count: u64,
}

impl Agg {
    /// Prints the violations; the seeds that stalled without poison when there are none.
    fn verdict(self) -> Result<Vec<u64>> {
        if self.failures.is_empty() {
            println!("  violations: none");
            return Ok(self.innocent);
        }
        for (seed, v) in &self.failures {
            println!("  VIOLATION seed {seed}: {v}");
            println!("    reproduce: cargo xtask sim --seed {seed}");
        }
        bail!("{} of {} seeds violated an invariant", self.failures.len(), self.count)
    }
}

impl Agg {
    fn add(&mut self, r: &Report) {
        self.hashes.push((r.seed, r.trace_hash));
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
    rows.extend(container_rows()?);
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
fn container_env() -> Result<Option<Vec<(&'static str, String)>>> {
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
    let worker = images::worker("etl-coordination/etl-coord:itest")?;
    println!("worker image: {} ({})", worker.tag, worker.how);
    Ok(Some(vec![("HOSTS_NATS_IMAGE", nats.tag), ("HOSTS_WORKER_IMAGE", worker.tag)]))
}

/// The rows of [`CONTAINER_SUITES`] where an engine answers: the images made first; if that
/// fails, the suites are FAILED rows (with the reason printed), so the rest of the table stands.
fn container_rows() -> Result<Vec<Row>> {
    let env = match container_env() {
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

/// Runs [`CONTAINER_SUITES`] where an engine answers (part of `ci`).
fn container_suites() -> Result<()> {
    let rows = container_rows()?;
    if rows.is_empty() { Ok(()) } else { print_rows(&rows) }
}

fn ci() -> Result<()> {
    let t0 = Instant::now();
    cargo(&["fmt", "--all", "--", "--check"])?;
    cargo(&["clippy", "--workspace", "--all-targets", "--", "-D", "warnings"])?;
    if cfg!(feature = "containers") {
        // The container code of xtask, compiled only where an engine answers.
        cargo(&[
            "clippy",
            "-p",
            "xtask",
            "--features",
            "containers",
            "--all-targets",
            "--",
            "-D",
            "warnings",
        ])?;
    }
    let servers = Servers::provision()?;
    cargo_env(&["test", "--workspace"], &servers.env())?;
    let mut s3 = vec!["test"];
    s3.extend(S3_TEST);
    cargo_env(&s3, &servers.env())?;
    examples(&servers)?;
    container_suites()?;
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
