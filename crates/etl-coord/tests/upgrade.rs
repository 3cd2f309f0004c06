//! Rolling upgrades (docs/UPGRADES.md): the previous release's `etl-coord worker` and this
//! tree's on one NATS job, killed, drained and restarted across versions as a Kubernetes
//! rolling update (and a rollback) would: no loss, no quarantine.
//!
//! Needs `NATS_URL` and `ETL_COORD_PREVIOUS_BIN` (`cargo xtask ci` builds the previous release
//! from its commit; `cargo xtask previous` builds it and prints the path).

mod common;

use std::path::Path;
use std::process::{Child, Command, Stdio};

use common::cases::signal;
use common::{Nats, dataset, job, records_in, wait_for_records};
use etl_coord::demo::input_keys;

fn nats() -> Nats {
    Nats::open(
        std::env::var("NATS_URL").expect("NATS_URL is not set: run `cargo xtask ci`, which starts a server"),
    )
}

/// The previous release's `etl-coord`.
fn previous_bin() -> String {
    std::env::var("ETL_COORD_PREVIOUS_BIN").expect(
        "ETL_COORD_PREVIOUS_BIN is not set: run `cargo xtask ci`, which builds the previous release (or `cargo \
         xtask previous`, which prints its path)",
    )
}

/// Both releases take the same worker flags (a release may add flags, never remove or rename
/// one: docs/UPGRADES.md).
const ARGS: [&str; 6] = ["--record-delay-ms", "4", "--split-size", "15000", "--lease-duration", "3s"];

/// A worker of the previous release.
fn old_worker(nats: &Nats, job: &str, id: &str, data: &Path, sink: &Path) -> Child {
    Command::new(previous_bin())
        .args(["worker", "--job", job, "--store", &nats.url, "--instance-id", id])
        .args(["--source", &format!("files:{}", data.display()), "--sink", sink.to_str().unwrap()])
        .args(ARGS)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("the previous release's etl-coord starts")
}

/// A worker of this release.
fn new_worker(nats: &Nats, job: &str, id: &str, data: &Path, sink: &Path) -> Child {
    nats.worker(job, id, data, sink, &ARGS)
}

fn exits_0(id: &str, child: Child) {
    let out = child.wait_with_output().unwrap();
    assert_eq!(out.status.code(), Some(0), "{id}: {}", String::from_utf8_lossy(&out.stderr));
}

#[test]
fn a_rolling_upgrade_and_a_rollback_across_kills_lose_nothing_and_quarantine_nothing() {
    let nats = nats();
    let job = job("upgrade");
    let (tmp, data) = dataset(12, 400);
    let expected = input_keys(&data).unwrap();
    let sink = |id: &str| tmp.path().join(format!("{id}.jsonl"));
    // The previous release runs the job: it made `meta`, the plan and the first commits.
    let mut old_a = old_worker(&nats, &job, "old-a", &data, &sink("old-a"));
    let old_b = old_worker(&nats, &job, "old-b", &data, &sink("old-b"));
    wait_for_records(&sink("old-a"), 300, &mut old_a);
    // The rolling update: one old pod dies mid-flight (its splits are taken over after the
    // lease, from what it committed), a new one starts beside the other old one.
    old_a.kill().unwrap();
    let _ = old_a.wait();
    let mut new_c = new_worker(&nats, &job, "new-c", &data, &sink("new-c"));
    wait_for_records(&sink("new-c"), 200, &mut new_c);
    // The next old pod is drained (SIGTERM, as the update does) and replaced by a new one.
    signal(&old_b, "-TERM");
    exits_0("old-b (drained)", old_b);
    let new_d = new_worker(&nats, &job, "new-d", &data, &sink("new-d"));
    // A rollback in the middle: a new pod dies and an old one comes back.
    std::thread::sleep(std::time::Duration::from_millis(500));
    new_c.kill().unwrap();
    let _ = new_c.wait();
    let old_e = old_worker(&nats, &job, "old-e", &data, &sink("old-e"));
    exits_0("new-d", new_d);
    exits_0("old-e", old_e);
    let sinks = ["old-a", "old-b", "new-c", "new-d", "old-e"].map(sink);
    let refs: Vec<&Path> = sinks.iter().map(|p| p.as_path()).collect();
    let seen = records_in(&refs);
    let missing: Vec<_> = expected.difference(&seen).take(5).collect();
    assert!(missing.is_empty(), "records never emitted: {missing:?}");
    let st = nats.status_json(&job);
    let splits = st["splits"].as_array().unwrap();
    assert!(!splits.is_empty());
    assert!(splits.iter().all(|s| s["state"] == "Done"), "every split done, none quarantined: {st}");
    let new_sinks = records_in(&[&sink("new-c"), &sink("new-d")]);
    let old_sinks = records_in(&[&sink("old-a"), &sink("old-b"), &sink("old-e")]);
    assert!(!new_sinks.is_empty() && !old_sinks.is_empty(), "both releases did part of the job");
}
