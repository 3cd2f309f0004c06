//! Real `etl-coord worker` processes coordinating through a real NATS server.
//!
//! Needs `NATS_URL` (`cargo xtask ci` starts a server and sets it).

mod common;

use std::collections::BTreeSet;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::{dataset, job, records_in, wait_for_records};
use etl_coord::demo::input_keys;
use etl_coord::sink::JsonlSink;
use etl_coordination_testkit::{NatsCluster, NatsServer};

fn nats_url() -> String {
    std::env::var("NATS_URL")
        .expect("NATS_URL is not set: run `cargo xtask ci` (it starts a NATS server) or set NATS_URL")
}

fn worker(job: &str, id: &str, data: &std::path::Path, sink: &std::path::Path, extra: &[&str]) -> Child {
    common::worker(job, &nats_url(), id, data, sink, extra)
}

/// For every split `from` was emitting at `t_ms`, how long until `to` emitted it (ms).
fn handover_ms(from: &std::path::Path, to: &std::path::Path, t_ms: u64) -> Vec<u64> {
    let a = JsonlSink::read(from).unwrap_or_default();
    let b = JsonlSink::read(to).unwrap_or_default();
    let splits: BTreeSet<String> =
        a.iter().filter(|l| l.at_ms + 500 >= t_ms).map(|l| l.split.clone()).collect();
    let mut out: Vec<u64> = splits
        .iter()
        .filter_map(|s| b.iter().filter(|l| &l.split == s && l.at_ms >= t_ms).map(|l| l.at_ms - t_ms).min())
        .collect();
    out.sort_unstable();
    out
}

#[test]
fn a_killed_worker_is_taken_over_through_nats_with_no_loss() {
    let (tmp, data) = dataset(8, 400);
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
    let killed_ms = etl_coord::sink::unix_ms();
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
    // T2: takeover after kill -9 within lease_duration + 0.5 s, plus one renewal interval of
    // slack (the victim's last renewal may be up to a third of a lease old when it dies).
    let takeover = handover_ms(&sa, &sb, killed_ms);
    println!("takeover after kill -9 (lease 3 s), ms per split: {takeover:?}");
    assert!(!takeover.is_empty(), "a held splits when it was killed");
    assert!(takeover.iter().all(|ms| *ms <= 3500 + 1000), "{takeover:?}");
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
    let (tmp, data) = dataset(2, 50);
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

fn signal(child: &Child, sig: &str) {
    let ok = Command::new("kill").args([sig, &child.id().to_string()]).status().unwrap().success();
    assert!(ok, "kill {sig}");
}

fn status_json(job: &str) -> serde_json::Value {
    common::status_json(job, &nats_url())
}

#[test]
fn a_drained_worker_hands_over_at_once_without_consuming_attempts() {
    let (tmp, data) = dataset(6, 300);
    let expected = input_keys(&data).unwrap();
    let job = job("drain");
    let (sa, sb) = (tmp.path().join("a.jsonl"), tmp.path().join("b.jsonl"));
    // Long leases: a pickup that waited for one would take 20 s.
    let args =
        ["--record-delay-ms", "3", "--split-size", "15000", "--lease-duration", "20s", "--max-attempts", "1"];
    let mut a = worker(&job, "wa", &data, &sa, &args);
    let b = worker(&job, "wb", &data, &sb, &args);
    wait_for_records(&sa, 100, &mut a);
    let term_ms = etl_coord::sink::unix_ms();
    signal(&a, "-TERM");
    let a_out = a.wait_with_output().unwrap();
    assert_eq!(a_out.status.code(), Some(0), "a drained cleanly: {}", String::from_utf8_lossy(&a_out.stderr));
    let drained = Instant::now();
    let b_out = b.wait_with_output().unwrap();
    assert_eq!(b_out.status.code(), Some(0), "{}", String::from_utf8_lossy(&b_out.stderr));
    assert!(
        drained.elapsed() < Duration::from_secs(15),
        "b finished {:?} after the drain: no lease wait",
        drained.elapsed()
    );
    let seen = records_in(&[&sa, &sb]);
    assert!(expected.is_subset(&seen), "no loss");
    // Release pickup, end to end (lane restart included; T1 measures only the store hop).
    let pickup = handover_ms(&sa, &sb, term_ms);
    println!("pickup after SIGTERM drain (lease 20 s), ms per split: {pickup:?}");
    assert!(pickup.iter().all(|ms| *ms < 2000), "{pickup:?}");
    let st = status_json(&job);
    let splits = st["splits"].as_array().unwrap();
    assert!(splits.iter().all(|s| s["state"] == "Done" && s["attempts"] == 0), "{st}");
}

#[test]
fn a_stopped_zombie_is_fenced_after_a_takeover_and_nothing_is_lost() {
    let (tmp, data) = dataset(4, 400);
    let expected = input_keys(&data).unwrap();
    let job = job("zombie");
    let (sa, sb) = (tmp.path().join("a.jsonl"), tmp.path().join("b.jsonl"));
    let args = ["--record-delay-ms", "4", "--split-size", "15000"];
    let mut a = worker(&job, "wa", &data, &sa, &args);
    let b = worker(&job, "wb", &data, &sb, &args);
    wait_for_records(&sa, 100, &mut a);
    signal(&a, "-STOP"); // longer than the 3 s lease
    std::thread::sleep(Duration::from_secs(6));
    signal(&a, "-CONT");
    let a_out = a.wait_with_output().unwrap();
    let b_out = b.wait_with_output().unwrap();
    assert_eq!(b_out.status.code(), Some(0), "{}", String::from_utf8_lossy(&b_out.stderr));
    assert_eq!(a_out.status.code(), Some(0), "{}", String::from_utf8_lossy(&a_out.stderr));
    let a_err = String::from_utf8_lossy(&a_out.stderr);
    assert!(
        a_err.contains("lane revoked") || a_err.contains("starved"),
        "the zombie was told it lost its splits: {a_err}"
    );
    assert!(expected.is_subset(&records_in(&[&sa, &sb])), "no loss");
    let st = status_json(&job);
    assert!(st["splits"].as_array().unwrap().iter().all(|s| s["state"] == "Done"), "{st}");
}

#[test]
fn a_poison_split_that_crashes_every_owner_is_quarantined_and_every_worker_exits_3() {
    let (tmp, data) = dataset(3, 100);
    std::fs::write(data.join("poison.txt"), "ok\nPOISON\n").unwrap();
    let job = job("poison");
    let args = ["--split-size", "6000", "--max-attempts", "2", "--poison-marker", "POISON"];
    // A supervisor, as Kubernetes would be: restart crashed workers under the same id.
    let ids = ["pa", "pb"];
    let mut exits = std::collections::BTreeMap::new();
    let mut running: Vec<(usize, Child)> = ids
        .iter()
        .enumerate()
        .map(|(i, id)| (i, worker(&job, id, &data, &tmp.path().join(format!("{id}.jsonl")), &args)))
        .collect();
    let t0 = Instant::now();
    let mut crashes = 0;
    while !running.is_empty() && t0.elapsed() < Duration::from_secs(90) {
        let mut next = Vec::new();
        for (i, mut c) in running {
            match c.try_wait().unwrap() {
                None => next.push((i, c)),
                Some(st) if st.code().is_none() => {
                    crashes += 1;
                    let sink = tmp.path().join(format!("{}.jsonl", ids[i]));
                    next.push((i, worker(&job, ids[i], &data, &sink, &args)));
                }
                Some(st) => {
                    exits.insert(ids[i], st.code());
                }
            }
        }
        running = next;
        std::thread::sleep(Duration::from_millis(100));
    }
    for (_, mut c) in running {
        let _ = c.kill();
    }
    assert!(crashes >= 2, "the poison split crashed its owners ({crashes} crashes)");
    assert_eq!(exits.get("pa"), Some(&Some(3)), "{exits:?}");
    assert_eq!(exits.get("pb"), Some(&Some(3)), "{exits:?}");
    let st = status_json(&job);
    let q: Vec<_> = st["splits"].as_array().unwrap().iter().filter(|s| s["state"] == "Quarantined").collect();
    assert_eq!(q.len(), 1, "{st}");
    assert_eq!(q[0]["attempts"], 2);
}

#[test]
fn workers_self_fence_through_a_nats_outage_and_finish_when_it_returns() {
    let (tmp, data) = dataset(4, 500);
    let expected = input_keys(&data).unwrap();
    let mut server = NatsServer::start();
    let url = server.url();
    let job = job("outage");
    let spawn = |id: &str, sink: &std::path::Path| {
        Command::new(env!("CARGO_BIN_EXE_etl-coord"))
            .args([
                "worker",
                "--job",
                &job,
                "--store",
                &url,
                "--source",
                &format!("files:{}", data.display()),
            ])
            .args(["--sink", sink.to_str().unwrap(), "--instance-id", id, "--lease-duration", "3s"])
            .args(["--split-size", "15000", "--record-delay-ms", "4", "--nats-op-timeout", "1s"])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap()
    };
    let (sa, sb) = (tmp.path().join("a.jsonl"), tmp.path().join("b.jsonl"));
    let mut a = spawn("oa", &sa);
    let b = spawn("ob", &sb);
    wait_for_records(&sa, 100, &mut a);
    // The store disappears for longer than a lease, then comes back with its data.
    server.kill();
    std::thread::sleep(Duration::from_secs(5));
    server.restart();
    let a_out = a.wait_with_output().unwrap();
    let b_out = b.wait_with_output().unwrap();
    drop(server);
    assert_eq!(a_out.status.code(), Some(0), "{}", String::from_utf8_lossy(&a_out.stderr));
    assert_eq!(b_out.status.code(), Some(0), "{}", String::from_utf8_lossy(&b_out.stderr));
    let logs =
        format!("{}{}", String::from_utf8_lossy(&a_out.stderr), String::from_utf8_lossy(&b_out.stderr));
    assert!(logs.contains("Starved"), "lanes self-fenced during the outage: {logs}");
    assert!(expected.is_subset(&records_in(&[&sa, &sb])), "no loss");
}

#[test]
fn when_the_leader_is_killed_another_worker_takes_over_with_a_new_term() {
    let (tmp, data) = dataset(6, 400);
    let expected = input_keys(&data).unwrap();
    let job = job("leader");
    let args = ["--record-delay-ms", "5", "--split-size", "15000"];
    let sinks: Vec<_> = ["la", "lb", "lc"].iter().map(|id| tmp.path().join(format!("{id}.jsonl"))).collect();
    let mut workers: Vec<(String, Child)> = ["la", "lb", "lc"]
        .iter()
        .zip(&sinks)
        .map(|(id, s)| (id.to_string(), worker(&job, id, &data, s, &args)))
        .collect();
    wait_for_records(&sinks[0], 50, &mut workers[0].1);
    let leader = status_json(&job)["leader"].as_str().expect("a leader").to_owned();
    let term_before = status_json(&job)["plan"]["term"].as_u64().unwrap();
    let i = workers.iter().position(|(id, _)| *id == leader).expect("the leader is one of ours");
    let (_, mut dead) = workers.remove(i);
    dead.kill().unwrap();
    let _ = dead.wait();
    for (id, c) in workers {
        let out = c.wait_with_output().unwrap();
        assert_eq!(out.status.code(), Some(0), "{id}: {}", String::from_utf8_lossy(&out.stderr));
    }
    let refs: Vec<&std::path::Path> = sinks.iter().map(|p| p.as_path()).collect();
    let seen = records_in(&refs);
    let missing: Vec<_> = expected.difference(&seen).take(5).collect();
    assert!(missing.is_empty(), "records never emitted: {missing:?}");
    let st = status_json(&job);
    assert!(st["plan"]["term"].as_u64().unwrap() > term_before, "a new leader bumped the term: {st}");
    assert_eq!(st["plan"]["version"], 1, "a published Final plan is not re-planned: {st}");
}

#[test]
fn scale_up_from_one_to_three_workers_converges_to_plus_minus_one() {
    let (tmp, data) = dataset(13, 300);
    let job = job("scale");
    // 13 splits of one file each, slow enough not to finish during the test.
    let args = ["--record-delay-ms", "40", "--split-size", "1000", "--max-in-flight", "8"];
    let mut a = worker(&job, "sa", &data, &tmp.path().join("sa.jsonl"), &args);
    wait_for_records(&tmp.path().join("sa.jsonl"), 8, &mut a);
    let b = worker(&job, "sb", &data, &tmp.path().join("sb.jsonl"), &args);
    let c = worker(&job, "sc", &data, &tmp.path().join("sc.jsonl"), &args);
    // Bounded wait for convergence: fair share ceil(13/3) = 5, so 5/4/4.
    let t = Instant::now();
    let mut counts = Vec::new();
    while t.elapsed() < Duration::from_secs(30) {
        let st = status_json(&job);
        let mut by: std::collections::BTreeMap<String, usize> = std::collections::BTreeMap::new();
        for s in st["splits"].as_array().unwrap() {
            if let Some(o) = s["owner"].as_str() {
                *by.entry(o.to_owned()).or_default() += 1;
            }
        }
        counts = by.values().copied().collect::<Vec<_>>();
        if by.len() == 3
            && counts.iter().sum::<usize>() == 13
            && counts.iter().max().unwrap() - counts.iter().min().unwrap() <= 1
        {
            break;
        }
        std::thread::sleep(Duration::from_millis(250));
    }
    for mut w in [a, b, c] {
        let _ = w.kill();
        let _ = w.wait();
    }
    assert_eq!(counts.len(), 3, "{counts:?}");
    assert!(counts.iter().max().unwrap() - counts.iter().min().unwrap() <= 1, "converged to +-1: {counts:?}");
}

#[test]
fn a_second_process_with_a_live_instance_id_exits_with_an_actionable_error() {
    let (tmp, data) = dataset(3, 300);
    let job = job("twin");
    // Slow enough that the job is still running when the twin has watched the id for 1.5 s.
    let args = ["--record-delay-ms", "20", "--split-size", "15000"];
    let mut a = worker(&job, "same", &data, &tmp.path().join("a.jsonl"), &args);
    wait_for_records(&tmp.path().join("a.jsonl"), 20, &mut a);
    let twin = worker(&job, "same", &data, &tmp.path().join("b.jsonl"), &args);
    let out = twin.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("duplicate instance id same") && err.contains("unique instance id"), "{err}");
    let a_out = a.wait_with_output().unwrap();
    assert_eq!(
        a_out.status.code(),
        Some(0),
        "the original keeps going: {}",
        String::from_utf8_lossy(&a_out.stderr)
    );
}

#[test]
fn coordination_continues_when_a_cluster_node_is_lost() {
    let mut cluster = NatsCluster::start(3);
    let url = cluster.urls();
    // Splits of 10 s: the job outlasts a steal (if one worker took every split first) and the loss.
    let (tmp, data) = dataset(6, 1000);
    let expected = input_keys(&data).unwrap();
    let job = job("clusterloss");
    let spawn = |id: &str| {
        Command::new(env!("CARGO_BIN_EXE_etl-coord"))
            .args([
                "worker",
                "--job",
                &job,
                "--store",
                &url,
                "--nats-replicas",
                "3",
                "--source",
                &format!("files:{}", data.display()),
            ])
            .args(["--sink", tmp.path().join(format!("{id}.jsonl")).to_str().unwrap(), "--instance-id", id])
            // NATS-NOTES: replicated buckets want leases of 15 s or more.
            .args([
                "--lease-duration",
                "15s",
                "--split-size",
                "50000",
                "--record-delay-ms",
                "10",
                "--nats-op-timeout",
                "2s",
            ])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap()
    };
    // Both work when the node is lost (setup waits out a cluster still electing).
    let (mut a, mut b) = (spawn("ca"), spawn("cb"));
    wait_for_records(&tmp.path().join("ca.jsonl"), 20, &mut a);
    wait_for_records(&tmp.path().join("cb.jsonl"), 20, &mut b);
    // Lose one node for good.
    cluster.nodes[2].kill();
    let a_out = a.wait_with_output().unwrap();
    let b_out = b.wait_with_output().unwrap();
    assert_eq!(a_out.status.code(), Some(0), "{}", String::from_utf8_lossy(&a_out.stderr));
    assert_eq!(b_out.status.code(), Some(0), "{}", String::from_utf8_lossy(&b_out.stderr));
    let seen = records_in(&[&tmp.path().join("ca.jsonl"), &tmp.path().join("cb.jsonl")]);
    assert!(expected.is_subset(&seen), "no loss");
}

#[test]
fn a_worker_against_a_nats_server_older_than_2_11_exits_1_saying_to_upgrade() {
    let old = std::env::var("NATS_OLD_URL")
        .expect("NATS_OLD_URL is not set: run `cargo xtask ci`, which starts a 2.10 server");
    let tmp = tempfile::tempdir().unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_etl-coord"))
        .args([
            "worker",
            "--job",
            "old",
            "--store",
            &old,
            "--source",
            &format!("files:{}", tmp.path().display()),
        ])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("2.10.") && err.contains("upgrade"), "{err}");
}
