//! Helpers every provisioning module uses (they live below them, so the modules never import
//! each other).

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use anyhow::{Context, Result, bail};

/// The cargo target directory, where provisioned tools are cached.
pub fn target_dir() -> PathBuf {
    std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../target"))
}

/// A loopback port nobody listens on right now, never handed out twice by this process.
pub fn free_port() -> Result<u16> {
    Ok(etl_coordination_testkit::free_port())
}

/// Waits (at most 20 s) until something accepts connections on the loopback `port`.
pub fn wait_for_port(port: u16, what: &str) -> Result<()> {
    for _ in 0..400 {
        if std::net::TcpStream::connect(("127.0.0.1", port)).is_ok() {
            return Ok(());
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    bail!("{what} did not start listening on port {port}")
}

/// Installs the PyPI requirement `spec` into `dir` with Python's pip (never into the system);
/// `instead` says what the user can do when that fails.
pub fn pip_install(dir: &Path, spec: &str, instead: &str) -> Result<()> {
    println!("$ python3 -m pip install --target {} {spec}", dir.display());
    let status = Command::new("python3")
        .args(["-m", "pip", "install", "--quiet", "--disable-pip-version-check", "--target"])
        .arg(dir)
        .arg(spec)
        .status()
        .with_context(|| format!("running pip (python3 is needed to provision {spec})"))?;
    if !status.success() {
        bail!("could not install {spec} from PyPI; {instead}");
    }
    Ok(())
}

/// The repository's root (the workspace).
pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("..")
        .canonicalize()
        .unwrap_or_else(|_| Path::new(env!("CARGO_MANIFEST_DIR")).join(".."))
}
