//! The previous release, built from its commit, for the mixed-version test
//! (`crates/etl-coord/tests/upgrade.rs`): its `etl-coord` runs beside this tree's on one job.

use std::path::PathBuf;
use std::process::{Command, Stdio};

use anyhow::{Context, Result, bail};

use crate::util::{repo_root, target_dir};

/// The commit of the previous release: the last one landed before the current release's
/// changes. Move it forward at each release (docs/UPGRADES.md).
pub const PREVIOUS_RELEASE: &str = "36f1f8a0709d3c1144c35a807fedbf6e07f74059";

/// The previous release's `etl-coord` binary: `ETL_COORD_PREVIOUS_BIN` if set, else built from
/// [`PREVIOUS_RELEASE`] (its tree taken from this clone's history with `git archive`) into a
/// target directory of its own under `target/`, kept for the next run.
pub fn etl_coord() -> Result<PathBuf> {
    if let Some(bin) = std::env::var_os("ETL_COORD_PREVIOUS_BIN") {
        return Ok(bin.into());
    }
    let dir = target_dir().join("previous-release").join(&PREVIOUS_RELEASE[..12]);
    let src = dir.join("src");
    if !src.join("Cargo.toml").is_file() {
        let root = repo_root();
        let known = Command::new("git")
            .current_dir(&root)
            .args(["cat-file", "-e", &format!("{PREVIOUS_RELEASE}^{{commit}}")])
            .stderr(Stdio::null())
            .status()
            .context("running git (the previous release is built from this clone's history)")?;
        if !known.success() {
            bail!(
                "the previous release {PREVIOUS_RELEASE} is not in this clone's history (a shallow clone?): \
                 `git fetch --unshallow`, or set ETL_COORD_PREVIOUS_BIN to that release's etl-coord"
            );
        }
        let _ = std::fs::remove_dir_all(&src);
        std::fs::create_dir_all(&src)?;
        println!("$ git archive {PREVIOUS_RELEASE} | tar -x -C {}", src.display());
        let archive = Command::new("git")
            .current_dir(&root)
            .args(["archive", "--format=tar", PREVIOUS_RELEASE])
            .stdout(Stdio::piped())
            .spawn()
            .context("running git archive")?;
        let untar = Command::new("tar")
            .arg("-x")
            .arg("-C")
            .arg(&src)
            .stdin(archive.stdout.context("git archive's output")?)
            .status()
            .context("running tar")?;
        if !untar.success() {
            bail!("could not unpack the previous release {PREVIOUS_RELEASE}");
        }
    }
    let target = dir.join("target");
    println!("$ cargo build -p etl-coord (the previous release, {})", &PREVIOUS_RELEASE[..12]);
    let status = Command::new(env!("CARGO"))
        .current_dir(&src)
        .args(["build", "--quiet", "-p", "etl-coord", "--target-dir"])
        .arg(&target)
        // Built for one test: no debug information (a faster build and link).
        .env("CARGO_PROFILE_DEV_DEBUG", "0")
        .status()
        .context("running cargo")?;
    if !status.success() {
        bail!("building the previous release {PREVIOUS_RELEASE} failed");
    }
    Ok(target.join("debug").join("etl-coord"))
}
