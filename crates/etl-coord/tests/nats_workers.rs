//! Real `etl-coord worker` processes coordinating through a real NATS server.
//!
//! Needs `NATS_URL` (`cargo xtask ci` starts a server and sets it).

mod common;

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::cases;
use common::{Nats, dataset, job, records_in, wait_for_records};
use etl_coord::demo::input_keys;
use etl_coordination_testkit::{NatsCluster, NatsServer};

fn nats_url() -> String {
    std::env::var("NATS_URL")
        .expect("NATS_URL is not set: run `cargo xtask ci` (it starts a NATS server) or set NATS_URL")
}

fn nats() -> Nats {
    Nats::open(nats_url())
}

fn worker(job: &str, id: &str, data: &std::path::Path, sink: &std::path::Path, extra: &[&str]) -> Child {
    common::worker(job, &nats_url(), id, data, sink, extra)
}

#[test]
fn a_killed_worker_is_taken_over_through_nats_with_no_loss() {
    cases::kill9_takeover(&nats(), &job("kill"));
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

fn status_json(job: &str) -> serde_json::Value {
    common::status_json(job, &nats_url())
}

#[test]
fn a_drained_worker_hands_over_at_once_without_consuming_attempts() {
    cases::drain_handover(&nats(), &job("drain"));
}

#[test]
fn a_stopped_zombie_is_fenced_after_a_takeover_and_nothing_is_lost() {
    cases::zombie_fenced(&nats(), &job("zombie"));
}

#[test]
fn a_poison_split_that_crashes_every_owner_is_quarantined_and_every_worker_exits_3() {
    cases::poison_quarantined(&nats(), &job("poison"));
}

#[test]
fn workers_self_fence_through_a_nats_outage_and_finish_when_it_returns() {
    let mut server = NatsServer::start();
    cases::outage_self_fence(&Nats::open(server.url()), &mut server, &job("outage"));
}

#[test]
fn when_the_leader_is_killed_another_worker_takes_over_with_a_new_term() {
    cases::leader_kill(&nats(), &job("leader"));
}

#[test]
fn scale_up_from_one_to_three_workers_converges_to_plus_minus_one_and_reads_no_record_twice() {
    let (tmp, data) = dataset(13, 300);
    let expected = input_keys(&data).unwrap();
    let job = job("scale");
    // 13 splits of one file each (equal weights), slow enough not to finish during the
    // rebalance: 300 records of 40 ms, 12 s a split.
    let args = [
        "--record-delay-ms",
        "40",
        "--split-size",
        "1000",
        "--max-in-flight",
        "8",
        "--handover-timeout",
        "10s",
    ];
    let sinks = ["sa", "sb", "sc"].map(|id| tmp.path().join(format!("{id}.jsonl")));
    let mut a = worker(&job, "sa", &data, &sinks[0], &args);
    wait_for_records(&sinks[0], 8, &mut a);
    let b = worker(&job, "sb", &data, &sinks[1], &args);
    let c = worker(&job, "sc", &data, &sinks[2], &args);
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
    assert_eq!(counts.len(), 3, "{counts:?}");
    assert!(counts.iter().max().unwrap() - counts.iter().min().unwrap() <= 1, "converged to +-1: {counts:?}");
    // The job runs to its end: every record once. The steals asked first and the owners,
    // all live, committed and handed their splits over: nothing was read twice.
    let mut stderr = String::new();
    for w in [a, b, c] {
        let out = w.wait_with_output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr).into_owned();
        assert_eq!(out.status.code(), Some(0), "{err}");
        stderr.push_str(&err);
    }
    let lines: usize = sinks.iter().map(|p| etl_coord::sink::JsonlSink::read(p).unwrap().len()).sum();
    let seen = records_in(&sinks.iter().map(|p| p.as_path()).collect::<Vec<_>>());
    assert_eq!(seen, expected, "no record lost");
    assert_eq!(lines, expected.len(), "no record emitted twice ({} duplicates)", lines - expected.len());
    assert!(stderr.contains("outcome=\"handed_over\""), "the rebalance went through handovers:\n{stderr}");
    assert!(!stderr.contains("outcome=\"forced\""), "no steal had to take a split over:\n{stderr}");
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
            // docs/NATS.md: replicated buckets want leases of 15 s or more.
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

#[test]
fn a_second_termination_signal_exits_at_once_without_waiting_for_the_drain() {
    use std::io::BufRead;
    let (tmp, data) = dataset(2, 400);
    let server = NatsServer::start();
    let proxy = etl_coordination_testkit::Proxy::start(server.addr());
    let job = job("twosig");
    // Long leases and drain timeout: once the link stalls, the drain's final commits wait for a
    // minute.
    let args = ["--record-delay-ms", "5", "--lease-duration", "60s", "--drain-timeout", "60s"];
    let mut child = Nats::open(proxy.url()).worker(&job, "s1", &data, &tmp.path().join("s.jsonl"), &args);
    let (tx, rx) = std::sync::mpsc::channel();
    let stderr = child.stderr.take().unwrap();
    std::thread::spawn(move || {
        for line in std::io::BufReader::new(stderr).lines().map_while(Result::ok) {
            let _ = tx.send(line);
        }
    });
    let wait_for = |text: &str| loop {
        match rx.recv_timeout(Duration::from_secs(30)) {
            Ok(l) if l.contains(text) => return,
            Ok(_) => {}
            Err(e) => panic!("no line containing {text:?}: {e}"),
        }
    };
    let term = || {
        assert!(Command::new("kill").args(["-TERM", &child.id().to_string()]).status().unwrap().success());
    };
    wait_for("split acquired");
    proxy.stall();
    term();
    wait_for("draining");
    let t = Instant::now();
    term();
    let status = child.wait().unwrap();
    assert_eq!(status.code(), Some(130), "the second signal exits with 130");
    assert!(t.elapsed() < Duration::from_secs(20), "at once, not after the drain: {:?}", t.elapsed());
}

#[test]
fn an_undecodable_record_blocks_the_job_visibly_until_requeue_reset() {
    cases::undecodable_record_reset(&nats(), &job("undec"));
}

#[test]
fn workers_waiting_after_a_stall_take_up_a_requeued_split() {
    cases::requeue_resumes_waiting_workers(&nats(), &job("requeue"));
}

#[test]
fn a_follow_job_picks_up_files_added_while_three_workers_run_each_line_once_per_tenancy() {
    let (tmp, data) = dataset(3, 100);
    let job = job("follow");
    let args = ["--follow", "--replan-interval", "1s", "--record-delay-ms", "1"];
    let ids = ["fa", "fb", "fc"];
    let sinks: Vec<std::path::PathBuf> =
        ids.iter().map(|id| tmp.path().join(format!("{id}.jsonl"))).collect();
    let mut workers: Vec<Child> =
        ids.iter().zip(&sinks).map(|(id, sink)| worker(&job, id, &data, sink, &args)).collect();
    let sink_refs: Vec<&std::path::Path> = sinks.iter().map(|p| p.as_path()).collect();
    let wait_for = |expected: &std::collections::BTreeSet<String>, workers: &mut Vec<Child>| {
        let t = Instant::now();
        while !expected.is_subset(&records_in(&sink_refs)) {
            for w in workers.iter_mut() {
                assert!(w.try_wait().unwrap().is_none(), "a worker exited before the job was drained");
            }
            assert!(t.elapsed() < Duration::from_secs(90), "not every record emitted within 90 s");
            std::thread::sleep(Duration::from_millis(100));
        }
    };
    wait_for(&input_keys(&data).unwrap(), &mut workers);
    // New files land while the workers run (written elsewhere, then renamed in: whole).
    let more = tmp.path().join("more");
    std::fs::create_dir(&more).unwrap();
    etl_coord::demo::generate(&more, 4, 80).unwrap();
    for e in std::fs::read_dir(&more).unwrap() {
        let p = e.unwrap().path();
        let name = format!("late-{}", p.file_name().unwrap().to_string_lossy());
        std::fs::rename(&p, data.join(name)).unwrap();
        std::thread::sleep(Duration::from_millis(300));
    }
    let expected = input_keys(&data).unwrap();
    assert_eq!(expected.len(), 3 * 100 + 4 * 80);
    wait_for(&expected, &mut workers);
    // Each line once per tenancy: a line emitted twice was replayed by a later owner of its
    // split (the uncommitted tail of a split handed over while the workers balanced out), never
    // by the same tenancy, and no added file was planned twice.
    let lines: Vec<_> =
        sinks.iter().flat_map(|p| etl_coord::sink::JsonlSink::read(p).unwrap_or_default()).collect();
    let mut tenancies: std::collections::BTreeMap<String, Vec<(String, u64)>> = Default::default();
    for l in &lines {
        tenancies.entry(l.record.clone()).or_default().push((l.split.clone(), l.epoch));
    }
    for (record, seen) in &tenancies {
        let distinct: std::collections::BTreeSet<_> = seen.iter().collect();
        assert_eq!(distinct.len(), seen.len(), "{record} emitted twice by one tenancy: {seen:?}");
        let splits: std::collections::BTreeSet<_> = seen.iter().map(|(s, _)| s).collect();
        assert_eq!(splits.len(), 1, "{record} planned in two splits: {seen:?}");
    }
    let replayed = tenancies.values().filter(|v| v.len() > 1).count();
    eprintln!("{} lines, {replayed} replayed after a handover", tenancies.len());
    let st = status_json(&job);
    assert_eq!(st["plan"]["kind"], "Open", "{}", st["plan"]);
    // A follow job never completes: a drain ends each worker.
    for w in &workers {
        cases::signal(w, "-TERM");
    }
    for w in workers {
        let out = w.wait_with_output().unwrap();
        assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    }
}

/// `etl-coord` with `args` against the suite's server: (exit code, stdout, stderr).
fn etl_coord(args: &[&str]) -> (i32, String, String) {
    let out = nats().command().args(args).output().unwrap();
    let text = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
    (out.status.code().unwrap_or(-1), text(&out.stdout), text(&out.stderr))
}

/// The jobs `etl-coord jobs -o json` lists, by name.
fn jobs_listed() -> std::collections::BTreeMap<String, serde_json::Value> {
    let (code, out, err) = etl_coord(&["jobs", "--store", &nats_url(), "-o", "json"]);
    assert_eq!(code, 0, "{err}");
    let rows: Vec<serde_json::Value> = serde_json::from_str(&out).unwrap();
    rows.into_iter().map(|r| (r["job"].as_str().unwrap().to_owned(), r)).collect()
}

#[test]
fn reading_or_repairing_a_job_that_does_not_exist_says_so_and_creates_nothing() {
    let typo = job("typo");
    let url = nats_url();
    for args in [
        vec!["status", "--job", &typo, "--store", &url],
        vec!["requeue", "--job", &typo, "--store", &url, "--split", "s1"],
        vec!["requeue", "--job", &typo, "--store", &url, "--state", "quarantined", "--yes"],
        vec!["job", "set-max-attempts", "--job", &typo, "--store", &url, "3"],
    ] {
        let (code, _, err) = etl_coord(&args);
        assert_eq!(code, 1, "{args:?}: {err}");
        assert!(
            err.contains(&format!("no job {typo} at {url}"))
                && err.contains("does not exist")
                && err.contains("etl-coord jobs"),
            "{args:?}: {err}"
        );
    }
    assert!(!jobs_listed().contains_key(&typo), "a command created the buckets of {typo}");
    // Buckets made ready for a job no worker has started: it does not exist yet either.
    let (code, _, err) = etl_coord(&["nats-buckets", "--job", &typo, "--store", &url]);
    assert_eq!(code, 0, "{err}");
    let (code, _, err) = etl_coord(&["status", "--job", &typo, "--store", &url]);
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("no worker has started it yet"), "{err}");
    let listed = &jobs_listed()[&typo];
    assert_eq!(
        (listed["started"].as_bool(), listed["state_bucket"].as_bool()),
        (Some(false), Some(true)),
        "{listed}"
    );
}

/// A state bucket as an earlier release created it (`create_key_value`: rollups allowed): one
/// message with `Nats-Rollup: all` could replace every record. `--check` fails naming it, every
/// opener warns naming the job, `nats-buckets` closes it, and the stream then refuses rollups.
#[test]
fn nats_buckets_closes_an_earlier_release_s_state_bucket_to_rollups_and_check_reports_it() {
    let old = job("oldrollup");
    let url = nats_url();
    let stream = format!("KV_etl_coordination_{old}_state");
    let rt = tokio::runtime::Runtime::new().unwrap();
    let js = rt.block_on(async { async_nats::jetstream::new(async_nats::connect(&url).await.unwrap()) });
    let allows_rollups = || {
        rt.block_on(async { js.get_stream(&stream).await.unwrap().info().await.unwrap().config.allow_rollup })
    };
    let kv = async_nats::jetstream::kv::Config {
        bucket: format!("etl_coordination_{old}_state"),
        history: 1,
        ..Default::default()
    };
    rt.block_on(js.create_key_value(kv)).unwrap();
    assert!(allows_rollups());
    let (code, _, err) = etl_coord(&["nats-buckets", "--job", &old, "--store", &url, "--check"]);
    assert_eq!(code, 1, "{err}");
    assert!(
        err.contains("accepts rollup headers") && err.contains(&format!("nats-buckets --job {old}")),
        "{err}"
    );
    let (_, _, err) = etl_coord(&["status", "--job", &old, "--store", &url]);
    assert!(err.contains("accepts rollup headers") && err.contains(&format!("job {old};")), "{err}");
    let (code, out, err) = etl_coord(&["nats-buckets", "--job", &old, "--store", &url]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains(&format!("etl_coordination_{old}_state: now refuses rollup headers")), "{out}");
    assert!(!allows_rollups(), "the stream refuses rollups now");
    let (code, out, err) = etl_coord(&["nats-buckets", "--job", &old, "--store", &url, "--check"]);
    assert_eq!(code, 0, "{err}");
    assert!(!out.contains("now refuses") && !err.contains("accepts rollup headers"), "{out}{err}");
}

/// A job whose state bucket (bounded by --nats-max-bytes) fills stops every worker with exit 1
/// and the error naming the bucket, its bound and how to raise it; raised, the job resumes and
/// completes with nothing lost.
#[test]
fn a_worker_whose_bounded_state_bucket_fills_exits_naming_the_bound_and_resumes_once_raised() {
    let (tmp, data) = dataset(12, 30);
    let full = job("full");
    let sink = tmp.path().join("s.jsonl");
    let out = worker(&full, "w1", &data, &sink, &["--nats-max-bytes", "600"]).wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    let raise = format!("etl-coord nats-buckets --job {full} --nats-max-bytes BYTES");
    for what in ["is full", "it holds at most 600 bytes", &raise] {
        assert!(err.contains(what), "{what:?} in:\n{err}");
    }
    // Raised as the message says; a lower bound asked later is not applied (it would leave the
    // bucket full at once), nor is a check for it a failure; a check for a higher one is.
    let url = nats_url();
    let (code, out, err) =
        etl_coord(&["nats-buckets", "--job", &full, "--store", &url, "--nats-max-bytes", "1MiB"]);
    assert_eq!(code, 0, "{err}");
    assert!(
        out.contains(&format!(
            "etl_coordination_{full}_state: bound raised to 1048576 bytes (was at most 600 bytes)"
        )),
        "{out}"
    );
    let (code, out, err) =
        etl_coord(&["nats-buckets", "--job", &full, "--store", &url, "--nats-max-bytes", "600"]);
    assert_eq!(code, 0, "{err}");
    assert!(
        !out.contains("raised")
            && out.contains("_state: exists, configuration valid, replicas 1, at most 1048576 bytes"),
        "{out}"
    );
    let check = |bound: &str| {
        etl_coord(&["nats-buckets", "--job", &full, "--store", &url, "--nats-max-bytes", bound, "--check"])
    };
    assert_eq!(check("600").0, 0, "a bound above the one asked is no failure");
    let (code, _, err) = check("2MiB");
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("is at most 1048576 bytes, not --nats-max-bytes 2097152"), "{err}");
    let out = worker(&full, "w1", &data, &sink, &[]).wait_with_output().unwrap();
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(common::records_in(&[&sink]).len(), 12 * 30, "every record, once the bound was raised");
}

#[test]
fn jobs_lists_a_started_job_with_what_its_state_holds() {
    let (tmp, data) = dataset(2, 20);
    let ran = job("listed");
    let sink = tmp.path().join("s.jsonl");
    let out = worker(&ran, "w1", &data, &sink, &[]).wait_with_output().unwrap();
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    let listed = &jobs_listed()[&ran];
    assert_eq!(listed["started"].as_bool(), Some(true), "{listed}");
    // meta, the plan head, a manifest chunk, and a descriptor and a record per split.
    assert!(listed["records"].as_u64().unwrap() >= 5 && listed["bytes"].as_u64().unwrap() > 0, "{listed}");
    let (code, table, err) = etl_coord(&["jobs", "--store", &nats_url()]);
    assert_eq!(code, 0, "{err}");
    let line = table.lines().find(|l| l.starts_with(&format!("{ran} "))).unwrap_or_else(|| panic!("{table}"));
    assert!(line.contains("started"), "{table}");
}

#[test]
fn status_watch_waits_for_a_job_that_does_not_exist_yet_then_shows_it() {
    use std::io::BufRead;
    let (tmp, data) = dataset(1, 20);
    let later = job("later");
    let mut watch = nats()
        .command()
        .args([
            "status",
            "--job",
            &later,
            "--store",
            &nats_url(),
            "--watch",
            "--interval",
            "200ms",
            "-o",
            "json",
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let lines = std::io::BufReader::new(watch.stdout.take().unwrap()).lines().map_while(Result::ok);
    let mut said = std::io::BufReader::new(watch.stderr.take().unwrap()).lines().map_while(Result::ok);
    // It says the job is missing, again at each interval, and keeps waiting (on standard error:
    // standard output stays the status, JSON here).
    let waiting = said.by_ref().take(2).collect::<Vec<_>>();
    assert!(
        waiting.iter().all(|l| l.contains(&format!("no job {later}")) && l.contains("waiting")),
        "{waiting:?}"
    );
    let sink = tmp.path().join("s.jsonl");
    let out = worker(&later, "w1", &data, &sink, &[]).wait_with_output().unwrap();
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    // Once a worker started it, the watch shows it, every interval.
    std::thread::spawn(move || said.for_each(drop));
    let shown = lines.filter(|l| l.starts_with("  \"plan\": {")).take(2).count();
    let _ = watch.kill();
    let _ = watch.wait();
    assert_eq!(shown, 2, "the watch never showed the job once it existed");
}
