//! `cargo xtask ci`: the README's test command.

use std::time::Instant;

use anyhow::{Context, Result, bail};

use crate::bench::bench_quick;
use crate::itest::{S3_TEST, container_suites};
use crate::servers::Servers;
use crate::sim::sweep;
use crate::{cargo, cargo_env, postgres};

pub(crate) fn run() -> Result<()> {
    let t0 = Instant::now();
    let mut times = Phases::default();
    times.run("format and lints", || {
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
        Ok(())
    })?;
    times.run("cargo package", package)?;
    let previous = times.run("previous release", crate::previous::etl_coord)?;
    let servers = times.run("servers", || {
        postgres::ensure_installed()?;
        Servers::provision()
    })?;
    times.run("cargo test --workspace", || {
        let previous = previous.to_string_lossy();
        let mut env = servers.env().to_vec();
        env.push(("ETL_COORD_PREVIOUS_BIN", &previous));
        cargo_env(&["test", "--workspace"], &env)
    })?;
    times.run("s3 test", || {
        let mut s3 = vec!["test"];
        s3.extend(S3_TEST);
        cargo_env(&s3, &servers.env())
    })?;
    times.run("examples", || examples(&servers))?;
    times.run("container suites", container_suites)?;
    times.run("quick bench", || {
        let pg = postgres::start()?;
        bench_quick(servers.nats_url(), &pg.conninfo)
    })?;
    drop(servers);
    let seeds: u64 = std::env::var("SIM_SEEDS").ok().and_then(|s| s.parse().ok()).unwrap_or(5000);
    let innocent = times.run("sweep", || sweep(0, seeds, false))?;
    if !innocent.is_empty() {
        // P12's purpose: kills, freezes and outages are no evidence against the data.
        bail!(
            "healthy splits were quarantined in {} seeds (first: {:?})",
            innocent.len(),
            &innocent[..innocent.len().min(10)]
        );
    }
    times.run("documented sim commands", documented_sim_commands)?;
    times.print();
    println!("ci passed in {:.0}s", t0.elapsed().as_secs_f64());
    Ok(())
}

/// How long each phase of the run took, printed at the end (where a slow CI run went).
#[derive(Default)]
struct Phases(Vec<(&'static str, f64)>);

impl Phases {
    fn run<T>(&mut self, name: &'static str, f: impl FnOnce() -> Result<T>) -> Result<T> {
        let t = Instant::now();
        let out = f();
        self.0.push((name, t.elapsed().as_secs_f64()));
        out
    }

    fn print(&self) {
        for (name, secs) in &self.0 {
            println!("{secs:>7.0}s  {name}");
        }
    }
}

/// The crates meant for publication: everything but these.
const UNPUBLISHED: [&str; 6] = [
    "etl-coordination-sim",
    "etl-coordination-testkit",
    "etl-coordination-bench",
    "etl-coordination-examples",
    "etl-coordination-tests",
    "xtask",
];

/// `cargo package` of every crate meant for publication, each built from its package as a
/// user's build would (a file left out of a package, or a dependency without a version, fails
/// here rather than at release).
fn package() -> Result<()> {
    // Cargo takes registry crates for immutable, and `cargo package` verifies each crate
    // against the others as registry crates of the same version: on a machine that packaged
    // before, it reused the extracted sources (CARGO_HOME/registry/src/<overlay>/NAME-VERSION)
    // and the compiled libraries of an earlier run (a driver was built against the core of a
    // run before). So packaging builds in a target directory of its own, from which every
    // artifact of this workspace's crates is removed first (third-party ones stay cached), and
    // the extracted sources of our crates are removed. On a fresh machine none exists.
    let verify = crate::util::target_dir().join("package-verify");
    let mut stale = vec![verify.join("package")];
    for sub in ["debug/deps", "debug/.fingerprint", "debug/build", "debug/incremental"] {
        for entry in std::fs::read_dir(verify.join(sub)).into_iter().flatten().flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            if ["etl_coord", "etl-coord", "libetl_coord"].iter().any(|p| name.starts_with(p)) {
                stale.push(entry.path());
            }
        }
    }
    let home = std::env::var_os("CARGO_HOME")
        .map(std::path::PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| std::path::PathBuf::from(h).join(".cargo")));
    if let Some(src) = home.map(|h| h.join("registry/src"))
        && let Ok(overlays) = std::fs::read_dir(&src)
    {
        for overlay in overlays.flatten().filter(|o| !o.file_name().to_string_lossy().starts_with("index.")) {
            for entry in std::fs::read_dir(overlay.path()).into_iter().flatten().flatten() {
                if entry.file_name().to_string_lossy().starts_with("etl-coord") {
                    stale.push(entry.path());
                }
            }
        }
    }
    for path in stale.iter().filter(|p| p.exists()) {
        let removed = if path.is_dir() { std::fs::remove_dir_all(path) } else { std::fs::remove_file(path) };
        removed.with_context(|| format!("removing {}", path.display()))?;
    }
    let mut args = vec!["package", "--workspace", "--allow-dirty", "--quiet"];
    for c in UNPUBLISHED {
        args.extend(["--exclude", c]);
    }
    let dir = verify.to_string_lossy().into_owned();
    cargo_env(&args, &[("CARGO_TARGET_DIR", &dir)])
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
        ("runner", &["--", "--job", "example-runner", "--store", "memory", "--input", "deploy/input"][..]),
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
                crate::sim::run(&args)
                    .with_context(|| format!("documented command `{line}` in {}", file.display()))?;
                ran += 1;
            }
        }
    }
    if ran == 0 {
        bail!("no documented `cargo xtask sim` command found (README.md shows some)");
    }
    Ok(())
}
