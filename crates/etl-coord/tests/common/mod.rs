//! What the real-process suites share: unique job names, generated input, `etl-coord worker`
//! processes and what their sinks hold.
#![allow(dead_code)] // each suite uses its own part

pub mod cases;

use std::collections::BTreeSet;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use etl_coord::demo::generate;
use etl_coord::sink::JsonlSink;

/// A job name unique to this process and moment (suites share one NATS server).
pub fn job(name: &str) -> String {
    format!(
        "{name}{}x{}",
        std::process::id(),
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_millis() % 1_000_000
    )
}

/// A temporary directory holding `files` generated input files of `lines` lines in `data/`.
pub fn dataset(files: usize, lines: usize) -> (tempfile::TempDir, std::path::PathBuf) {
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("data");
    std::fs::create_dir(&data).unwrap();
    generate(&data, files, lines).unwrap();
    (tmp, data)
}

/// How the real-process suites reach a NATS server: its URL, and the environment a pod would
/// carry for it (`ETL_COORD_NATS_USER`, `ETL_COORD_NATS_PASSWORD`, `ETL_COORD_NATS_TLS_CA`), given to every process.
#[derive(Clone, Debug)]
pub struct Nats {
    pub url: String,
    pub env: Vec<(String, String)>,
}

impl Nats {
    /// A server that asks for no credentials.
    pub fn open(url: String) -> Nats {
        Nats { url, env: Vec::new() }
    }

    /// `etl-coord` with this server's environment.
    pub fn command(&self) -> Command {
        let mut c = Command::new(env!("CARGO_BIN_EXE_etl-coord"));
        c.envs(self.env.iter().map(|(k, v)| (k, v)));
        c
    }

    /// An `etl-coord worker` of `job` reading `data` into `sink`, with a 3 s lease unless
    /// `extra` sets one; its output is captured.
    pub fn worker(&self, job: &str, id: &str, data: &Path, sink: &Path, extra: &[&str]) -> Child {
        self.command()
            .args(["worker", "--job", job, "--store", &self.url])
            .args(["--source", &format!("files:{}", data.display())])
            .args(["--sink", sink.to_str().unwrap(), "--instance-id", id])
            .args(if extra.contains(&"--lease-duration") { &[][..] } else { &["--lease-duration", "3s"][..] })
            .args(extra)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("etl-coord starts")
    }

    /// `etl-coord status --json` of `job`. A store that does not answer in time (a cluster
    /// still electing leaders after a partition healed) is asked again, for up to 30 s, and so
    /// is a job whose workers, spawned just before, have not created it yet ("no job").
    pub fn status_json(&self, job: &str) -> serde_json::Value {
        let t = Instant::now();
        loop {
            let out = self
                .command()
                .args(["status", "--json", "--job", job, "--store", &self.url])
                .output()
                .unwrap();
            let err = String::from_utf8_lossy(&out.stderr);
            if out.status.success() {
                return serde_json::from_slice(&out.stdout).unwrap();
            }
            let not_yet = err.contains("unavailable") || err.contains(&format!("no job {job} at "));
            assert!(t.elapsed() < Duration::from_secs(30) && not_yet, "{err}");
            std::thread::sleep(Duration::from_secs(1));
        }
    }
}

/// An `etl-coord worker` of `job` on `store` (no credentials); see [`Nats::worker`].
pub fn worker(job: &str, store: &str, id: &str, data: &Path, sink: &Path, extra: &[&str]) -> Child {
    Nats::open(store.to_owned()).worker(job, id, data, sink, extra)
}

/// Every record the sinks hold.
pub fn records_in(sinks: &[&Path]) -> BTreeSet<String> {
    sinks.iter().flat_map(|p| JsonlSink::read(p).unwrap_or_default()).map(|l| l.record).collect()
}

/// The splits `lines` (a sink's) were being read in the half second up to `at_ms`: what a
/// worker held when a fault began at `at_ms`.
pub fn reading_at(lines: &[etl_coord::sink::SinkLine], at_ms: u64) -> BTreeSet<&str> {
    lines.iter().filter(|l| l.at_ms + 500 >= at_ms && l.at_ms <= at_ms).map(|l| l.split.as_str()).collect()
}

/// Waits until `sink` holds `n` records, written by `writer`. Fails, with the writer's output,
/// if the writer exits first or the records are not there within 60 s (a slow machine takes
/// seconds; a worker that never started takes forever).
/// Waits until one of `sinks` holds `n` records, each written by the worker beside it; panics
/// if a worker exits first. For a case that needs the job under way but not a given worker busy:
/// the first worker up may take every split before its peers have joined (fair share is counted
/// over the workers it sees), and the job can end before a steal moves one.
pub fn wait_for_records_in_any(sinks: &[&Path], n: usize, writers: &mut [&mut Child]) {
    let t = Instant::now();
    loop {
        let held: Vec<usize> =
            sinks.iter().map(|s| JsonlSink::read(s).map(|l| l.len()).unwrap_or(0)).collect();
        if held.iter().any(|h| *h >= n) {
            return;
        }
        for (sink, writer) in sinks.iter().zip(writers.iter_mut()) {
            if let Some(status) = writer.try_wait().unwrap() {
                let mut err = String::new();
                if let Some(mut e) = writer.stderr.take() {
                    let _ = std::io::Read::read_to_string(&mut e, &mut err);
                }
                panic!(
                    "the worker writing {} exited ({status}) before any sink held {n} records ({held:?}): {err}",
                    sink.display()
                );
            }
        }
        assert!(t.elapsed() < Duration::from_secs(60), "no sink holds {n} records after 60 s: {held:?}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Waits until `sink` holds `n` records, written by `writer`; panics if it exits first.
pub fn wait_for_records(sink: &Path, n: usize, writer: &mut Child) {
    wait_for_records_in_any(&[sink], n, &mut [writer]);
}

/// `etl-coord status --json` of `job` on `store` (no credentials); see [`Nats::status_json`].
pub fn status_json(job: &str, store: &str) -> serde_json::Value {
    Nats::open(store.to_owned()).status_json(job)
}

/// A free loopback address for an admin server.
pub fn free_addr() -> String {
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    format!("127.0.0.1:{port}")
}

/// `GET path` from an HTTP server; the whole response, or `None` if it does not answer.
pub fn http_get(addr: &str, path: &str) -> Option<String> {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(addr).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    s.write_all(format!("GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").as_bytes()).ok()?;
    let mut out = String::new();
    s.read_to_string(&mut out).ok()?;
    Some(out)
}

/// The value of the series of `family` whose labels end with `labels_end` (e.g.
/// `state="blocked"}`) on the admin server at `addr`, if it answers and has it.
pub fn metric(addr: &str, family: &str, labels_end: &str) -> Option<f64> {
    let text = http_get(addr, "/metrics")?;
    text.lines()
        .filter(|l| l.starts_with(&format!("{family}{{")))
        .find_map(|l| l.split_once(&format!("{labels_end} ")).map(|(_, v)| v))
        .and_then(|v| v.trim().parse().ok())
}

/// Waits (up to 60 s) until every admin server in `addrs` reports `value` for the series.
pub fn wait_for_metric(addrs: &[&str], family: &str, labels_end: &str, value: f64) {
    let t = Instant::now();
    loop {
        let seen: Vec<Option<f64>> = addrs.iter().map(|a| metric(a, family, labels_end)).collect();
        if seen.iter().all(|v| *v == Some(value)) {
            return;
        }
        assert!(t.elapsed() < Duration::from_secs(60), "{family}{{..{labels_end} is {seen:?}, not {value}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

impl Nats {
    /// Writes `value` over `key` of `job`'s state bucket as another program would, with the
    /// settings the workers get from the environment (user, password, CA).
    pub fn overwrite_state_key(&self, job: &str, key: &str, value: &[u8]) {
        let env = |k: &str| self.env.iter().find(|(n, _)| n == k).map(|(_, v)| v.clone());
        let mut cfg = etl_coordination_nats::NatsConfig::new(self.url.clone());
        cfg.create_buckets = false;
        if let (Some(u), Some(p)) = (env("ETL_COORD_NATS_USER"), env("ETL_COORD_NATS_PASSWORD")) {
            cfg.auth = etl_coordination_nats::NatsAuth::UserPassword(u, p);
        }
        if let Some(ca) = env("ETL_COORD_NATS_TLS_CA") {
            cfg.tls_required = true;
            cfg.tls_root_certificate = Some(ca.into());
        }
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        rt.block_on(async {
            use etl_coordination_store::Store;
            let name = etl_coordination_core::JobName::new(job.to_owned()).unwrap();
            let stores = etl_coordination_nats::connect(&cfg, &name).await.expect("connect");
            let key = etl_coordination_core::Key::new(key).unwrap();
            let current = stores.state.get(&key).await.unwrap().expect("the key exists");
            let value = bytes::Bytes::copy_from_slice(value);
            stores.state.compare_and_swap(&key, current.revision, value, None).await.expect("overwritten");
        });
    }
}
