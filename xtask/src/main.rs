//! `cargo xtask`: the project's automation.
//!
//! - `cargo xtask ci`: the README's test command: fmt check, clippy (warnings denied), every test
//!   (the NATS ones against servers it provisions), and a simulation sweep.
//! - `cargo xtask itest`: provisions NATS and runs the integration suites, with a summary table.
//! - `cargo xtask sim --seeds N [--start S]`: a sweep of N seeds with a summary.
//! - `cargo xtask sim --seed S`: one seed, reproduced exactly.
//! - `cargo xtask mutants [--seeds N] [--only NAME[,NAME...]]`: the mutation catalogue (`xtask/mutants.txt`),
//!   each mutant applied to a copy of the workspace and swept; every one must be caught.
//! - `cargo xtask previous`: builds the previous release's `etl-coord` (for the mixed-version
//!   test, `ETL_COORD_PREVIOUS_BIN`) and prints its path.
//! - `cargo xtask images`: makes (or finds) the images of the container suites and prints them.

use std::process::Command;

use anyhow::{Context, Result, bail};

mod bench;
mod ci;
mod images;
mod itest;
mod moto;
mod mutants;
mod nats;
mod nats_bin;
mod postgres;
mod previous;
mod promtool;
mod servers;
mod sim;
mod util;

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args.first().map(String::as_str) {
        Some("ci" | "itest") if wants_containers() => rerun_with_containers(&args),
        Some("ci") => ci::run(),
        Some("sim") => sim::run(&args[1..]),
        Some("itest") => itest::run(),
        Some("mutants") => mutants::run(&args[1..]),
        Some("bench") => bench::run(&args[1..]),
        Some("previous") => previous::etl_coord().map(|bin| println!("{}", bin.display())),
        Some("images") => {
            itest::container_env(args.get(1).is_some_and(|a| a == "--from-host")).map(|env| match env {
                Some(env) => env.iter().for_each(|(k, v)| println!("{k}={v}")),
                None => {
                    println!("no Docker engine answers (or NATS_NO_CONTAINERS is set): no images to make")
                }
            })
        }
        _ => {
            eprintln!(
                "usage: cargo xtask <ci | itest | sim --seeds N [--start S] [--stop-on-violation] | sim --seed S \
                 | mutants [--seeds N] [--only NAME[,NAME...]] | bench [--quick | --objects] | images [--from-host] | previous>"
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

/// The number after `name` in `args`, if given.
pub(crate) fn flag(args: &[String], name: &str) -> Result<Option<u64>> {
    match args.iter().position(|a| a == name) {
        None => Ok(None),
        Some(i) => {
            let v = args.get(i + 1).with_context(|| format!("{name} needs a value"))?;
            Ok(Some(v.parse().with_context(|| format!("{name} expects a number, got {v:?}"))?))
        }
    }
}

/// Runs `cargo ARGS`; fails if it fails.
pub(crate) fn cargo(args: &[&str]) -> Result<()> {
    cargo_env(args, &[])
}

/// Runs `cargo ARGS` with `env` added; fails if it fails.
pub(crate) fn cargo_env(args: &[&str], env: &[(&str, &str)]) -> Result<()> {
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
