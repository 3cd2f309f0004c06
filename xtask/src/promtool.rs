//! `promtool` for the deployment tests (alert-rule unit tests and PromQL checks): `PROMTOOL` if
//! set, else `promtool` on `PATH`, else extracted from Debian's `prometheus` package into
//! `target/promtool/` (downloaded with `apt-get download`, never installed).

use std::path::PathBuf;
use std::process::Command;

use anyhow::{Context, Result, bail};

use crate::util::target_dir;

/// The path of a working `promtool`.
pub fn promtool() -> Result<PathBuf> {
    if let Some(p) = std::env::var_os("PROMTOOL") {
        return Ok(p.into());
    }
    if Command::new("promtool").arg("--version").output().is_ok_and(|o| o.status.success()) {
        return Ok("promtool".into());
    }
    let dir = target_dir().join("promtool");
    let bin = dir.join("usr/bin/promtool");
    if bin.exists() {
        return Ok(bin);
    }
    std::fs::create_dir_all(&dir)?;
    println!("$ apt-get download prometheus && dpkg-deb -x prometheus_*.deb {}", dir.display());
    let download = || Command::new("apt-get").args(["download", "prometheus"]).current_dir(&dir).status();
    let mut ok = download().context("running apt-get (Debian's package tools provide promtool)")?.success();
    if !ok {
        // A fresh machine may have no package lists yet.
        let _ = Command::new("apt-get").args(["update", "-qq"]).status();
        ok = download()?.success();
    }
    if !ok {
        bail!(
            "could not download Debian's prometheus package for promtool; install promtool or set PROMTOOL"
        );
    }
    let deb = std::fs::read_dir(&dir)?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .find(|p| p.extension().is_some_and(|x| x == "deb"))
        .context("apt-get download left no .deb")?;
    let status =
        Command::new("dpkg-deb").arg("-x").arg(&deb).arg(&dir).status().context("running dpkg-deb")?;
    if !status.success() || !bin.exists() {
        bail!("could not extract promtool from {}", deb.display());
    }
    let _ = std::fs::remove_file(&deb);
    Ok(bin)
}
