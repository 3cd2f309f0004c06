//! Real `etl-coord worker` processes coordinating through a real NATS server.
//!
//! Needs `NATS_URL` (`cargo xtask ci` starts a server and sets it).

use std::collections::BTreeSet;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use etl_coord::demo::{generate, input_keys};
use etl_coord::sink::JsonlSink;

fn nats_url() -> String {
    std::env::var("NATS_URL")
        .expect("NATS_URL is not set: run `cargo xtask ci` (it starts a NATS server) or set NATS_URL")
}

fn job(name: &str) -> String {
    format!(
        "{name}{}x{}",
        std::process::id(),
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_millis() % 1_000_000
    )
}

fn worker(job: &str, id: &str, data: &std::path::Path, sink: &std::path::Path, extra: &[&str]) -> Child {
    Command::new(env!("CARGO_BIN_EXE_etl-coord"))
        .args([
            "worker",
            "--job",
            job,
            "--store",
            &nats_url(),
            "--source",
            &format!("files:{}", data.display()),
        ])
        .args(["--sink", sink.to_str().unwrap(), "--instance-id", id, "--lease-duration", "3s"])
        .args(extra)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("etl-coord starts")
}

fn records_in(sinks: &[&std::path::Path]) -> BTreeSet<String> {
    sinks.iter().flat_map(|p| JsonlSink::read(p).unwrap_or_default()).map(|l| l.record).collect()
}

#[test]
fn a_killed_worker_is_taken_over_through_nats_with_no_loss() {
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("data");
    std::fs::create_dir(&data).unwrap();
    generate(&data, 8, 400).unwrap();
    let expected = input_keys(&data).unwrap();
    let job = job("kill");
    let (sa, sb) = (tmp.path().join("a.jsonl"), tmp.path().join("b.jsonl"));
    let mut a = worker(&job, "wa", &data, &sa, &["--record-delay-ms", "5", "--split-size", "20000"]);
    let b = worker(&job, "wb", &data, &sb, &["--record-delay-ms", "5", "--split-size", "20000"]);
    // Let both work for a while (bounded): until a has flushed some records.
    let t = Instant::now();
    while JsonlSink::read(&sa).map(|l| l.len()).unwrap_or(0) < 200 && t.elapsed() < Duration::from_secs(20) {
        std::thread::sleep(Duration::from_millis(50));
    }
    a.kill().unwrap(); // SIGKILL: no drain, no release
    let _ = a.wait();
    let killed_at = Instant::now();
    let out = b.wait_with_output().unwrap();
    let took = killed_at.elapsed();
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    let seen = records_in(&[&sa, &sb]);
    let missing: Vec<_> = expected.difference(&seen).take(5).collect();
    assert!(missing.is_empty(), "records never emitted: {missing:?}");
    eprintln!("survivor finished {took:?} after the kill (lease 3s)");
    // The job's state is visible to an operator.
    let status = Command::new(env!("CARGO_BIN_EXE_etl-coord"))
        .args(["status", "--job", &job, "--store", &nats_url()])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&status.stdout);
    assert!(status.status.success(), "{}", String::from_utf8_lossy(&status.stderr));
    assert!(text.contains("0 owned, 0 unleased, 0 quarantined"), "{text}");
}

#[test]
fn two_workers_with_different_planners_are_refused_naming_both_fingerprints() {
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("data");
    std::fs::create_dir(&data).unwrap();
    generate(&data, 2, 50).unwrap();
    let job = job("diverge");
    let sink = tmp.path().join("s.jsonl");
    let a = worker(&job, "wa", &data, &sink, &["--split-size", "20000"]);
    assert_eq!(a.wait_with_output().unwrap().status.code(), Some(0));
    let b = worker(&job, "wb", &data, &sink, &["--split-size", "999"]);
    let out = b.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("split_bytes=20000") && err.contains("split_bytes=999"), "{err}");
}
