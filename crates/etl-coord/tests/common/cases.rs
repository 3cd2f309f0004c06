//! The real-process failure suite, run by `nats_workers` on an open server and by `nats_auth`
//! with a job's generated permissions over TLS.

use std::collections::BTreeSet;
use std::process::{Child, Command};
use std::time::{Duration, Instant};

use etl_coord::demo::input_keys;
use etl_coord::sink::JsonlSink;

use etl_coordination_testkit::NatsServer;

use super::{Nats, dataset, records_in, wait_for_records};

/// For every split `from` was emitting at `t_ms`, how long until `to` emitted it (ms).
pub fn handover_ms(from: &std::path::Path, to: &std::path::Path, t_ms: u64) -> Vec<u64> {
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

pub fn signal(child: &Child, sig: &str) {
    let ok = Command::new("kill").args([sig, &child.id().to_string()]).status().unwrap().success();
    assert!(ok, "kill {sig}");
}

/// Two workers; one is killed (SIGKILL); the survivor takes its splits over within a lease
/// and a renewal interval, with no loss.
pub fn kill9_takeover(nats: &Nats, job: &str) {
    let job = job.to_owned();
    let (tmp, data) = dataset(8, 400);
    let expected = input_keys(&data).unwrap();
    let (sa, sb) = (tmp.path().join("a.jsonl"), tmp.path().join("b.jsonl"));
    let mut a = nats.worker(&job, "wa", &data, &sa, &["--record-delay-ms", "5", "--split-size", "20000"]);
    let b = nats.worker(&job, "wb", &data, &sb, &["--record-delay-ms", "5", "--split-size", "20000"]);
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
    let status = nats.command().args(["status", "--job", &job, "--store", &nats.url]).output().unwrap();
    let text = String::from_utf8_lossy(&status.stdout);
    assert!(status.status.success(), "{}", String::from_utf8_lossy(&status.stderr));
    assert!(text.contains("0 owned, 0 unleased, 0 quarantined"), "{text}");
}

/// Two workers with long leases; one drains on SIGTERM; the other picks its splits up at once,
/// and no attempt is consumed.
pub fn drain_handover(nats: &Nats, job: &str) {
    let job = job.to_owned();
    let (tmp, data) = dataset(6, 300);
    let expected = input_keys(&data).unwrap();
    let (sa, sb) = (tmp.path().join("a.jsonl"), tmp.path().join("b.jsonl"));
    // Long leases: a pickup that waited for one would take 20 s.
    let args =
        ["--record-delay-ms", "3", "--split-size", "15000", "--lease-duration", "20s", "--max-attempts", "1"];
    let mut a = nats.worker(&job, "wa", &data, &sa, &args);
    let b = nats.worker(&job, "wb", &data, &sb, &args);
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
    let st = nats.status_json(&job);
    let splits = st["splits"].as_array().unwrap();
    assert!(splits.iter().all(|s| s["state"] == "Done" && s["attempts"] == 0), "{st}");
}

/// Three workers; the leader is killed; another takes over with a new term and the job
/// completes without re-planning.
pub fn leader_kill(nats: &Nats, job: &str) {
    let job = job.to_owned();
    let (tmp, data) = dataset(6, 400);
    let expected = input_keys(&data).unwrap();
    let args = ["--record-delay-ms", "5", "--split-size", "15000"];
    let sinks: Vec<_> = ["la", "lb", "lc"].iter().map(|id| tmp.path().join(format!("{id}.jsonl"))).collect();
    let mut workers: Vec<(String, Child)> = ["la", "lb", "lc"]
        .iter()
        .zip(&sinks)
        .map(|(id, s)| (id.to_string(), nats.worker(&job, id, &data, s, &args)))
        .collect();
    wait_for_records(&sinks[0], 50, &mut workers[0].1);
    let leader = nats.status_json(&job)["leader"].as_str().expect("a leader").to_owned();
    let term_before = nats.status_json(&job)["plan"]["term"].as_u64().unwrap();
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
    let st = nats.status_json(&job);
    assert!(st["plan"]["term"].as_u64().unwrap() > term_before, "a new leader bumped the term: {st}");
    assert_eq!(st["plan"]["version"], 1, "a published Final plan is not re-planned: {st}");
}

/// Two workers; one is stopped (SIGSTOP) past its lease and continued; it is fenced, the
/// other finishes, nothing is lost.
pub fn zombie_fenced(nats: &Nats, job: &str) {
    let job = job.to_owned();
    let (tmp, data) = dataset(4, 400);
    let expected = input_keys(&data).unwrap();
    let (sa, sb) = (tmp.path().join("a.jsonl"), tmp.path().join("b.jsonl"));
    let args = ["--record-delay-ms", "4", "--split-size", "15000"];
    let mut a = nats.worker(&job, "wa", &data, &sa, &args);
    let b = nats.worker(&job, "wb", &data, &sb, &args);
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
    let st = nats.status_json(&job);
    assert!(st["splits"].as_array().unwrap().iter().all(|s| s["state"] == "Done"), "{st}");
}

/// A split whose record crashes every owner is quarantined after max-attempts tenancies and
/// every worker exits 3.
pub fn poison_quarantined(nats: &Nats, job: &str) {
    let job = job.to_owned();
    let (tmp, data) = dataset(3, 100);
    std::fs::write(data.join("poison.txt"), "ok\nPOISON\n").unwrap();
    let args = ["--split-size", "6000", "--max-attempts", "2", "--poison-marker", "POISON"];
    // A supervisor, as Kubernetes would be: restart crashed workers under the same id.
    let ids = ["pa", "pb"];
    let mut exits = std::collections::BTreeMap::new();
    let mut running: Vec<(usize, Child)> = ids
        .iter()
        .enumerate()
        .map(|(i, id)| (i, nats.worker(&job, id, &data, &tmp.path().join(format!("{id}.jsonl")), &args)))
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
                    next.push((i, nats.worker(&job, ids[i], &data, &sink, &args)));
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
    let st = nats.status_json(&job);
    let q: Vec<_> = st["splits"].as_array().unwrap().iter().filter(|s| s["state"] == "Quarantined").collect();
    assert_eq!(q.len(), 1, "{st}");
    assert_eq!(q[0]["attempts"], 2);
}

/// The store goes away for longer than a lease and comes back with its data: workers
/// self-fence, then finish with no loss. `server` is the one `nats` reaches.
pub fn outage_self_fence(nats: &Nats, server: &mut NatsServer, job: &str) {
    let job = job.to_owned();
    let (tmp, data) = dataset(4, 500);
    let expected = input_keys(&data).unwrap();
    let spawn = |id: &str, sink: &std::path::Path| {
        let extra = ["--split-size", "15000", "--record-delay-ms", "4", "--nats-op-timeout", "1s"];
        nats.worker(&job, id, &data, sink, &extra)
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
    assert_eq!(a_out.status.code(), Some(0), "{}", String::from_utf8_lossy(&a_out.stderr));
    assert_eq!(b_out.status.code(), Some(0), "{}", String::from_utf8_lossy(&b_out.stderr));
    let logs =
        format!("{}{}", String::from_utf8_lossy(&a_out.stderr), String::from_utf8_lossy(&b_out.stderr));
    assert!(logs.contains("Starved"), "lanes self-fenced during the outage: {logs}");
    assert!(expected.is_subset(&records_in(&[&sa, &sb])), "no loss");
}
