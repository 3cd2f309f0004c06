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
    /// still electing leaders after a partition healed) is asked again, for up to 30 s.
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
            assert!(t.elapsed() < Duration::from_secs(30) && err.contains("unavailable"), "{err}");
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

/// Waits until `sink` holds `n` records, written by `writer`. Fails, with the writer's output,
/// if the writer exits first or the records are not there within 60 s (a slow machine takes
/// seconds; a worker that never started takes forever).
pub fn wait_for_records(sink: &Path, n: usize, writer: &mut Child) {
    let t = Instant::now();
    loop {
        let held = JsonlSink::read(sink).map(|l| l.len()).unwrap_or(0);
        if held >= n {
            return;
        }
        if let Some(status) = writer.try_wait().unwrap() {
            let mut err = String::new();
            if let Some(mut e) = writer.stderr.take() {
                let _ = std::io::Read::read_to_string(&mut e, &mut err);
            }
            panic!(
                "the worker writing {} exited ({status}) with {held} of {n} records: {err}",
                sink.display()
            );
        }
        assert!(
            t.elapsed() < Duration::from_secs(60),
            "{} holds {held} of {n} records after 60 s",
            sink.display()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// `etl-coord status --json` of `job` on `store` (no credentials); see [`Nats::status_json`].
pub fn status_json(job: &str, store: &str) -> serde_json::Value {
    Nats::open(store.to_owned()).status_json(job)
}
