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
    {
        let paths: Vec<&std::path::Path> = sinks.iter().map(|p| p.as_path()).collect();
        let mut children: Vec<&mut Child> = workers.iter_mut().map(|(_, c)| c).collect();
        super::wait_for_records_in_any(&paths, 50, &mut children);
    }
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
    let args =
        ["--split-size", "6000", "--max-attempts", "2", "--poison-marker", "POISON", "--claim-backoff", "2s"];
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

/// A record overwritten with bytes nobody can decode (another program, a newer release, a bad
/// restore) blocks the job, visibly: `status` flags the key, the workers report the job blocked
/// and count the record; `requeue --reset` asks for confirmation, then rewrites the split, and
/// the workers process it again from the start and complete. The workers stay after the end
/// (`--on-complete wait`), so the case holds whether or not the rest of the job finished first.
pub fn undecodable_record_reset(nats: &Nats, job: &str) {
    let (tmp, data) = dataset(4, 300);
    let expected = input_keys(&data).unwrap();
    let (aa, ab) = (super::free_addr(), super::free_addr());
    let (sa, sb) = (tmp.path().join("a.jsonl"), tmp.path().join("b.jsonl"));
    let args = |admin: &str| {
        ["--split-size", "8000", "--record-delay-ms", "2", "--on-complete", "wait", "--admin-addr"]
            .into_iter()
            .map(str::to_owned)
            .chain([admin.to_owned()])
            .collect::<Vec<_>>()
    };
    let a_args = args(&aa);
    let b_args = args(&ab);
    let a_args: Vec<&str> = a_args.iter().map(String::as_str).collect();
    let b_args: Vec<&str> = b_args.iter().map(String::as_str).collect();
    let a = nats.worker(job, "ua", &data, &sa, &a_args);
    let b = nats.worker(job, "ub", &data, &sb, &b_args);
    // Once a split is done, overwrite its record.
    let t = Instant::now();
    let victim = loop {
        let st = nats.status_json(job);
        let done = st["splits"].as_array().and_then(|s| s.iter().find(|x| x["state"] == "Done").cloned());
        if let Some(d) = done {
            break d["id"].as_str().unwrap().to_owned();
        }
        assert!(t.elapsed() < Duration::from_secs(60), "no split done within 60 s: {st}");
        std::thread::sleep(Duration::from_millis(100));
    };
    nats.overwrite_state_key(job, &format!("split.{victim}"), b"\xffwritten by something else");
    // Both workers see it: the job is blocked, one record cannot be decoded.
    super::wait_for_metric(&[&aa, &ab], "etl_coordination_job_state", r#"state="blocked"}"#, 1.0);
    super::wait_for_metric(&[&aa, &ab], "etl_coordination_records_undecodable", r#"bucket="state"}"#, 1.0);
    let st = nats.status_json(job);
    let flagged = &st["undecodable"][0];
    assert_eq!(flagged["key"], format!("split.{victim}"), "{st}");
    assert!(flagged["error"].as_str().unwrap().contains("format 255"), "{st}");
    // The reset asks first; with no terminal to ask on it needs --yes.
    let requeue = |extra: &[&str]| {
        nats.command()
            .args(["requeue", "--job", job, "--store", &nats.url, "--split", &victim, "--reset"])
            .args(extra)
            .stdin(std::process::Stdio::null())
            .output()
            .unwrap()
    };
    let out = requeue(&[]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains("--yes") && err.contains("undecodable"), "{err}");
    // On a terminal it asks; "n" leaves the split as it is (exit 1).
    let line = format!(
        "{} requeue --job {job} --store {} --split {victim} --reset",
        env!("CARGO_BIN_EXE_etl-coord"),
        nats.url
    );
    let (code, shown) = on_a_terminal(nats, &line, "n\n");
    assert_eq!(code, Some(1), "{shown}");
    assert!(shown.contains("Reset it? [y/N]") && shown.contains("left as it is"), "{shown}");
    assert_eq!(nats.status_json(job)["undecodable"][0]["key"], format!("split.{victim}"), "unchanged");
    let out = requeue(&["--yes"]);
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    // The job completes, the victim's records emitted again from the start.
    super::wait_for_metric(&[&aa, &ab], "etl_coordination_job_state", r#"state="complete"}"#, 1.0);
    super::wait_for_metric(&[&aa, &ab], "etl_coordination_records_undecodable", r#"bucket="state"}"#, 0.0);
    for child in [&a, &b] {
        signal(child, "-TERM");
    }
    for (name, child) in [("ua", a), ("ub", b)] {
        let out = child.wait_with_output().unwrap();
        assert_eq!(out.status.code(), Some(0), "{name}: {}", String::from_utf8_lossy(&out.stderr));
    }
    assert!(expected.is_subset(&records_in(&[&sa, &sb])), "no loss");
    let lines: Vec<_> = [&sa, &sb].iter().flat_map(|p| JsonlSink::read(p).unwrap_or_default()).collect();
    let of_victim: Vec<_> = lines.iter().filter(|l| l.split == victim).collect();
    let distinct: BTreeSet<&str> = of_victim.iter().map(|l| l.record.as_str()).collect();
    assert!(of_victim.len() >= 2 * distinct.len(), "the reset split was emitted again from its start");
}

/// Workers that stay after a stall (`--on-stall warn --on-complete wait`) take up a split the
/// operator requeues after fixing its cause, and the job completes without a restart.
pub fn requeue_resumes_waiting_workers(nats: &Nats, job: &str) {
    let (tmp, data) = dataset(2, 100);
    // Each broken file larger than a split, so each is a split of its own.
    let broken = |line: &str| format!("one\n{line}\n{}", "three\n".repeat(600));
    std::fs::write(data.join("broken.txt"), broken("BROKEN!")).unwrap();
    std::fs::write(data.join("other.txt"), broken("BROKEN!")).unwrap();
    let (aa, ab) = (super::free_addr(), super::free_addr());
    let (sa, sb) = (tmp.path().join("a.jsonl"), tmp.path().join("b.jsonl"));
    let args = |admin: &str| {
        let fixed = ["--split-size", "3000", "--max-attempts", "1", "--unprocessable-marker", "BROKEN!"];
        let stay = ["--on-stall", "warn", "--on-complete", "wait", "--admin-addr", admin];
        fixed.iter().chain(stay.iter()).map(|s| s.to_string()).collect::<Vec<_>>()
    };
    let (a_args, b_args) = (args(&aa), args(&ab));
    let a = nats.worker(job, "ra", &data, &sa, &a_args.iter().map(String::as_str).collect::<Vec<_>>());
    let b = nats.worker(job, "rb", &data, &sb, &b_args.iter().map(String::as_str).collect::<Vec<_>>());
    super::wait_for_metric(&[&aa, &ab], "etl_coordination_job_state", r#"state="stalled"}"#, 1.0);
    let st = nats.status_json(job);
    let q: Vec<_> = st["splits"].as_array().unwrap().iter().filter(|s| s["state"] == "Quarantined").collect();
    assert_eq!(q.len(), 2, "{st}");
    let requeue = |extra: &[&str]| {
        let out = nats
            .command()
            .args(["requeue", "--job", job, "--store", &nats.url])
            .args(extra)
            .output()
            .unwrap();
        let text =
            format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        (out.status.code(), text)
    };
    // The listing first: only the split whose error matches, and nothing changes.
    let (code, text) = requeue(&["--state", "quarantined", "--error-contains", "other.txt", "--dry-run"]);
    assert_eq!(code, Some(0), "{text}");
    assert!(text.contains("1 quarantined splits whose last error contains \"other.txt\""), "{text}");
    assert!(text.contains("1 other quarantined splits do not match") && text.contains("dry run"), "{text}");
    assert!(!text.contains("broken.txt"), "{text}");
    // Without a terminal to confirm on: refused, naming --yes.
    let (code, text) = requeue(&["--state", "quarantined"]);
    assert_eq!(code, Some(2), "{text}");
    assert!(text.contains("--yes"), "{text}");
    let st = nats.status_json(job);
    assert_eq!(st["summary"]["quarantined"], 2, "nothing requeued yet: {st}");
    // Fix the cause (same length: the split's descriptor names the file's size), then requeue
    // every quarantined split at once.
    std::fs::write(data.join("broken.txt"), broken("fixed!!")).unwrap();
    std::fs::write(data.join("other.txt"), broken("fixed!!")).unwrap();
    let (code, text) = requeue(&["--state", "quarantined", "--yes"]);
    assert_eq!(code, Some(0), "{text}");
    assert!(text.contains("2 splits requeued"), "{text}");
    super::wait_for_metric(&[&aa, &ab], "etl_coordination_job_state", r#"state="complete"}"#, 1.0);
    let seen = records_in(&[&sa, &sb]);
    assert!(seen.contains("broken.txt:2") && seen.contains("other.txt:3"), "{seen:?}");
    assert!(input_keys(&data).unwrap().is_subset(&seen), "no loss");
    for child in [&a, &b] {
        signal(child, "-TERM");
    }
    for child in [a, b] {
        let out = child.wait_with_output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(0), "{err}");
        assert!(err.contains("staying after the end"), "{err}");
    }
}

/// Runs `line` on a pseudo-terminal (util-linux `script`) with `nats`' environment, typing
/// `input`; its exit code and everything it showed.
fn on_a_terminal(nats: &Nats, line: &str, input: &str) -> (Option<i32>, String) {
    use std::io::Write;
    let mut child = Command::new("script")
        .args(["-qec", line, "/dev/null"])
        .envs(nats.env.iter().map(|(k, v)| (k, v)))
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("util-linux `script` runs");
    child.stdin.take().unwrap().write_all(input.as_bytes()).unwrap();
    let out = child.wait_with_output().unwrap();
    let shown = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    (out.status.code(), shown)
}
