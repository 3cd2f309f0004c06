//! A PostgreSQL server a test owns: Debian's PostgreSQL (`/usr/lib/postgresql/*/bin`, or
//! `initdb` and `postgres` on the `PATH`) with a fresh data directory, on a free loopback port,
//! passwords checked on TCP, stopped when dropped. As root, the server runs as the
//! `postgres` user (it refuses root). `cargo xtask ci` installs the package when it is missing.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::free_port;

/// The password of the superuser `bench` (connections over TCP must give one).
pub const PASSWORD: &str = "bench";

/// A running server.
pub struct PgServer {
    child: Child,
    data: tempfile::TempDir,
    port: u16,
}

impl Drop for PgServer {
    fn drop(&mut self) {
        // SIGINT to the postmaster itself (not to `runuser`, which does not pass it on): a fast
        // shutdown.
        let pid = std::fs::read_to_string(self.data.path().join("pgdata/postmaster.pid"))
            .ok()
            .and_then(|s| s.lines().next().map(str::to_owned))
            .unwrap_or_else(|| self.child.id().to_string());
        let _ = Command::new("kill").args(["-INT", &pid]).status();
        let _ = self.child.wait();
    }
}

/// The directory holding `initdb`, `postgres` and `pg_isready`.
pub fn bindir() -> Option<PathBuf> {
    let mut found: Vec<PathBuf> = std::fs::read_dir("/usr/lib/postgresql")
        .into_iter()
        .flatten()
        .filter_map(|e| e.ok().map(|e| e.path().join("bin")))
        .filter(|b| b.join("initdb").is_file() && b.join("postgres").is_file())
        .collect();
    found.sort();
    found.pop().or_else(|| {
        std::env::var_os("PATH")?
            .to_str()?
            .split(':')
            .map(PathBuf::from)
            .find(|d| d.join("initdb").is_file() && d.join("postgres").is_file())
    })
}

/// Whether this process runs as root (PostgreSQL then runs as the `postgres` user).
pub fn is_root() -> bool {
    Command::new("id").arg("-u").output().is_ok_and(|o| String::from_utf8_lossy(&o.stdout).trim() == "0")
}

/// `program` run as the `postgres` user when we are root.
pub fn as_server_user(program: &Path, root: bool) -> Command {
    if root {
        let mut c = Command::new("runuser");
        c.args(["-u", "postgres", "--"]).arg(program);
        c
    } else {
        Command::new(program)
    }
}

/// Waits until the server on `port` accepts queries, or exits.
fn wait_ready(child: &mut Child, bin: &Path, port: u16) -> bool {
    let t = Instant::now();
    while t.elapsed() < Duration::from_secs(30) {
        if child.try_wait().ok().flatten().is_some() {
            return false;
        }
        let ok = Command::new(bin.join("pg_isready"))
            .args(["-q", "-h", "127.0.0.1", "-p", &port.to_string()])
            .status()
            .is_ok_and(|s| s.success());
        if ok {
            return true;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    false
}

impl PgServer {
    /// Starts a server with a superuser `bench` (password [`PASSWORD`]) and the database
    /// `postgres`. Panics, saying
    /// what to install, when PostgreSQL is not there.
    pub fn start() -> PgServer {
        let bin = bindir().expect(
            "PostgreSQL is not installed: `apt-get install postgresql` (Debian), or run `cargo xtask ci`, \
             which installs it",
        );
        let root = is_root();
        let data = tempfile::Builder::new().prefix("etl-pg-").tempdir().expect("temp dir");
        let pgdata = data.path().join("pgdata");
        std::fs::create_dir(&pgdata).expect("data dir");
        let pwfile = data.path().join("password");
        std::fs::write(&pwfile, PASSWORD).expect("password file");
        if root {
            let ok = Command::new("chown").args(["-R", "postgres:postgres"]).arg(data.path()).status();
            assert!(
                ok.is_ok_and(|s| s.success()),
                "could not hand {} to the postgres user",
                data.path().display()
            );
        }
        let out = as_server_user(&bin.join("initdb"), root)
            .args([
                "--auth-local=trust",
                "--auth-host=scram-sha-256",
                "-U",
                "bench",
                "-E",
                "UTF8",
                "--no-sync",
            ])
            .arg(format!("--pwfile={}", pwfile.display()))
            .arg("-D")
            .arg(&pgdata)
            .output()
            .expect("initdb runs");
        assert!(out.status.success(), "initdb failed: {}", String::from_utf8_lossy(&out.stderr));
        let log = data.path().join("server.log");
        // A port another process took between our choice and the server's bind: try another.
        for _ in 0..5 {
            let port = free_port();
            let child = as_server_user(&bin.join("postgres"), root)
                .arg("-D")
                .arg(&pgdata)
                .args(["-p", &port.to_string(), "-c", "listen_addresses=127.0.0.1", "-c", "fsync=off", "-k"])
                .arg(data.path())
                .stdout(Stdio::null())
                .stderr(std::fs::File::create(&log).expect("log file"))
                .spawn()
                .expect("postgres starts");
            let mut child = child;
            if wait_ready(&mut child, &bin, port) {
                return PgServer { child, data, port };
            }
            let _ = child.kill();
            let _ = child.wait();
            let text = std::fs::read_to_string(&log).unwrap_or_default();
            assert!(text.contains("Address already in use"), "PostgreSQL did not start: {text}");
        }
        panic!("PostgreSQL found no free port in 5 tries");
    }

    /// The port.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// `postgres://bench:PASSWORD@127.0.0.1:PORT/postgres`.
    pub fn url(&self) -> String {
        self.url_as("bench", PASSWORD)
    }

    /// The URL with another user and password.
    pub fn url_as(&self, user: &str, password: &str) -> String {
        format!("postgres://{user}:{password}@127.0.0.1:{}/postgres", self.port)
    }

    /// Runs `sql` with `psql` (from the same installation), panicking with its error.
    pub fn psql(&self, sql: &str) -> String {
        let bin = bindir().expect("PostgreSQL is installed");
        let out = Command::new(bin.join("psql"))
            .args(["-X", "-q", "-A", "-t", "-v", "ON_ERROR_STOP=1", "-d", &self.url(), "-c", sql])
            .output()
            .expect("psql runs");
        assert!(out.status.success(), "psql: {sql}: {}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8_lossy(&out.stdout).trim().to_owned()
    }
}
