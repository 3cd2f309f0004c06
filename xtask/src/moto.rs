//! An S3 endpoint for the object-store test (`crates/etl-coord/tests/s3.rs`): `S3_ENDPOINT` if
//! set, else a moto server (PyPI `moto[server]`, installed into `target/moto/`) on a free
//! loopback port, stopped when dropped.

use std::process::{Child, Command, Stdio};

use anyhow::{Context, Result};

use crate::util::{free_port, pip_install, target_dir, wait_for_port};

/// The moto release the tests run against.
const MOTO_VERSION: &str = "5.2.5";

/// A running S3 endpoint.
pub struct S3 {
    child: Option<Child>,
    /// `http://127.0.0.1:PORT`.
    pub endpoint: String,
}

impl Drop for S3 {
    fn drop(&mut self) {
        if let Some(c) = &mut self.child {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// `S3_ENDPOINT`, or a moto server started here.
pub fn start() -> Result<S3> {
    if let Ok(endpoint) = std::env::var("S3_ENDPOINT") {
        return Ok(S3 { child: None, endpoint });
    }
    let dir = target_dir().join("moto").join(MOTO_VERSION);
    if !dir.join("moto").is_dir() {
        pip_install(&dir, &format!("moto[server]=={MOTO_VERSION}"), "set S3_ENDPOINT to an S3 endpoint")?;
    }
    let port = free_port()?;
    let child = Command::new("python3")
        .args(["-m", "moto.server", "-H", "127.0.0.1", "-p", &port.to_string()])
        .env("PYTHONPATH", &dir)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .context("starting the moto server")?;
    let s3 = S3 { child: Some(child), endpoint: format!("http://127.0.0.1:{port}") };
    wait_for_port(port, "the moto server")?;
    println!("moto {MOTO_VERSION} (S3) listening on {}", s3.endpoint);
    Ok(s3)
}
