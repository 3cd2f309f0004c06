//! A PostgreSQL server for the benchmark's SKIP LOCKED peer: `BENCH_POSTGRES` (a libpq
//! connection string) if set, else Debian's PostgreSQL (installed with apt-get when missing)
//! started on a free loopback port with its own data directory under `target/`, stopped when
//! dropped. As root, the server runs as the `postgres` user (it refuses root).

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

use anyhow::{Context, Result, bail};

use etl_coordination_testkit::postgres::{as_server_user, bindir, is_root};

use crate::util::{free_port, target_dir, wait_for_port};

/// A running server.
pub struct Postgres {
    child: Option<Child>,
    data: PathBuf,
    /// `host=127.0.0.1 port=P user=bench dbname=postgres`.
    pub conninfo: String,
}

impl Drop for Postgres {
    fn drop(&mut self) {
        if let Some(c) = &mut self.child {
            // SIGINT to the postmaster (not to runuser, which does not pass it on): fast
            // shutdown, backends end, no recovery needed.
            let pid = std::fs::read_to_string(self.data.join("postmaster.pid"))
                .ok()
                .and_then(|s| s.lines().next().map(str::to_owned))
                .unwrap_or_else(|| c.id().to_string());
            let _ = Command::new("kill").args(["-INT", &pid]).status();
            let _ = c.wait();
        }
    }
}

/// Installs Debian's PostgreSQL when it is missing: the database source's tests start servers
/// of their own from it (`etl_coordination_testkit::PgServer`).
pub fn ensure_installed() -> Result<()> {
    if bindir().is_none() {
        install()?;
    }
    Ok(())
}

/// `BENCH_POSTGRES`, or a server started here.
pub fn start() -> Result<Postgres> {
    if let Ok(conninfo) = std::env::var("BENCH_POSTGRES") {
        return Ok(Postgres { child: None, data: PathBuf::new(), conninfo });
    }
    let bin = match bindir() {
        Some(b) => b,
        None => install()?,
    };
    let root = is_root();
    let data = fresh_data_dir(root)?;
    let out = as_server_user(&bin.join("initdb"), root)
        .args(["-A", "trust", "-U", "bench", "-E", "UTF8", "--no-sync", "-D"])
        .arg(&data)
        .output()
        .context("running initdb")?;
    if !out.status.success() {
        bail!("initdb failed: {}", String::from_utf8_lossy(&out.stderr));
    }
    let port = free_port()?;
    // The server's own messages, for when it does not come up.
    let log = target_dir().join("postgres-bench.log");
    let child = as_server_user(&bin.join("postgres"), root)
        .arg("-D")
        .arg(&data)
        .args([
            "-p",
            &port.to_string(),
            "-c",
            "listen_addresses=127.0.0.1",
            "-c",
            "max_connections=200",
            "-k",
        ])
        .arg(&data)
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log).with_context(|| format!("creating {}", log.display()))?)
        .spawn()
        .context("starting postgres")?;
    let pg = Postgres {
        child: Some(child),
        data: data.clone(),
        conninfo: format!("host=127.0.0.1 port={port} user=bench dbname=postgres"),
    };
    wait_for_port(port, "PostgreSQL")?;
    wait_ready(&bin, port, &log)?;
    let version =
        Command::new(bin.join("postgres")).arg("--version").output().map(|o| o.stdout).unwrap_or_default();
    println!("{} listening on 127.0.0.1:{port}", String::from_utf8_lossy(&version).trim());
    Ok(pg)
}

/// Installs Debian's `postgresql` package (updating the index if the first try fails) and
/// stops the cluster the package starts; the binaries' directory.
fn install() -> Result<PathBuf> {
    println!("$ apt-get install -y postgresql (the benchmark's SKIP LOCKED peer needs a server)");
    let ok = Command::new("apt-get")
        .args(["install", "-y", "-q", "--no-install-recommends", "postgresql"])
        .env("DEBIAN_FRONTEND", "noninteractive")
        .status()
        .is_ok_and(|s| s.success())
        || (Command::new("apt-get").args(["update", "-q"]).status().is_ok_and(|s| s.success())
            && Command::new("apt-get")
                .args(["install", "-y", "-q", "--no-install-recommends", "postgresql"])
                .env("DEBIAN_FRONTEND", "noninteractive")
                .status()
                .is_ok_and(|s| s.success()));
    Ok(match bindir() {
        Some(b) if ok => {
            // Debian's package starts a `main` cluster on 5432 where it can; we installed
            // it only for our own server, so stop that one (errors: there was none).
            let major = b.parent().and_then(|v| v.file_name()).map(|v| v.to_string_lossy().into_owned());
            if let Some(major) = major {
                let _ = Command::new("pg_ctlcluster")
                    .args([major.as_str(), "main", "stop"])
                    .stdout(Stdio::null())
                    .stderr(Stdio::null())
                    .status();
            }
            b
        }
        _ => bail!(
            "PostgreSQL is not installed and apt-get could not install it: install Debian's \
             `postgresql` package, or set BENCH_POSTGRES to a connection string"
        ),
    })
}

/// A fresh, empty data directory (an earlier run's server, maybe still up, is stopped first),
/// owned by the server's user when we are root.
fn fresh_data_dir(root: bool) -> Result<PathBuf> {
    let data = target_dir().join("postgres-bench");
    // A fresh cluster every run: no state from an earlier (maybe killed) run, whose server may
    // still be up: stop it before its directory goes.
    if let Some(pid) = std::fs::read_to_string(data.join("postmaster.pid"))
        .ok()
        .and_then(|s| s.lines().next().map(str::to_owned))
    {
        let _ = Command::new("kill").args(["-INT", &pid]).stderr(Stdio::null()).status();
        for _ in 0..100 {
            if !Path::new(&format!("/proc/{pid}")).exists() {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(100));
        }
    }
    if data.exists() {
        std::fs::remove_dir_all(&data).with_context(|| format!("removing {}", data.display()))?;
    }
    std::fs::create_dir_all(&data)?;
    if root {
        let ok = Command::new("chown").args(["-R", "postgres:postgres"]).arg(&data).status()?.success();
        if !ok {
            bail!("could not hand {} to the postgres user", data.display());
        }
    }
    Ok(data)
}

/// Waits until the server accepts queries (listening comes first: recovery, start-up).
fn wait_ready(bin: &Path, port: u16, log: &Path) -> Result<()> {
    let ready = (0..100).any(|_| {
        let ok = Command::new(bin.join("pg_isready"))
            .args(["-q", "-h", "127.0.0.1", "-p", &port.to_string()])
            .status()
            .is_ok_and(|s| s.success());
        if !ok {
            std::thread::sleep(std::time::Duration::from_millis(100));
        }
        ok
    });
    if !ready {
        bail!("PostgreSQL on port {port} did not become ready within 10 s (its log: {})", log.display());
    }
    Ok(())
}
