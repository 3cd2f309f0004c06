//! The `etl-coord` command end to end: demo (with and without chaos), a standalone worker with
//! a sink, fault options, exit codes and error messages.

mod common;

use std::collections::BTreeSet;
use std::path::Path;
use std::process::Command;

use common::{free_addr, http_get, wait_for_metric};
use etl_coord::demo::{generate, input_keys};
use etl_coord::sink::JsonlSink;

fn etl_coord() -> Command {
    Command::new(env!("CARGO_BIN_EXE_etl-coord"))
}

fn run(cmd: &mut Command) -> (i32, String, String) {
    let out = cmd.output().expect("etl-coord runs");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into(),
        String::from_utf8_lossy(&out.stderr).into(),
    )
}

#[test]
fn the_demo_completes_and_reports_no_loss() {
    let (code, out, err) = run(etl_coord().args([
        "demo",
        "--workers",
        "3",
        "--files",
        "12",
        "--lines",
        "500",
        "--split-size",
        "20000",
    ]));
    assert_eq!(code, 0, "{out}\n{err}");
    assert!(out.contains("no loss: every one of the 6000 input records was emitted at least once"), "{out}");
    assert!(out.contains("acquisitions:") && out.contains("create"), "{out}");
}

#[test]
fn the_demo_survives_chaos_without_loss() {
    let (code, out, err) = run(etl_coord().args([
        "demo",
        "--chaos",
        "--workers",
        "3",
        "--files",
        "16",
        "--lines",
        "600",
        "--split-size",
        "20000",
        "--seed",
        "7",
    ]));
    assert_eq!(code, 0, "{out}\n{err}");
    assert!(out.contains("no loss"), "{out}");
    assert!(out.contains("kills"), "chaos happened: {out}");
}

/// A temporary directory with an empty `data/` in it.
fn data_dir() -> (tempfile::TempDir, std::path::PathBuf) {
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("data");
    std::fs::create_dir(&data).unwrap();
    (tmp, data)
}

fn input(dir: &Path, files: usize, lines: usize) -> BTreeSet<String> {
    generate(dir, files, lines).unwrap();
    input_keys(dir).unwrap()
}

#[test]
fn a_standalone_worker_processes_everything_into_its_sink() {
    let (tmp, data) = data_dir();
    let expected = input(&data, 5, 200);
    let sink = tmp.path().join("out.jsonl");
    let (code, out, err) = run(etl_coord().args([
        "worker",
        "--job",
        "t1",
        "--store",
        "memory",
        "--source",
        &format!("files:{}", data.display()),
        "--sink",
        sink.to_str().unwrap(),
        "--instance-id",
        "solo",
        "--split-size",
        "4000",
        "--lease-duration",
        "3s",
    ]));
    assert_eq!(code, 0, "{out}\n{err}");
    let lines = JsonlSink::read(&sink).unwrap();
    let seen: BTreeSet<String> = lines.iter().map(|l| l.record.clone()).collect();
    assert_eq!(seen, expected, "every input record in the sink");
    assert!(lines.iter().all(|l| l.instance == "solo" && l.epoch >= 1));
    // The default handover timeout (10 s) is above a third of this 3 s lease: said at start.
    assert!(err.contains("handover timeout capped") && err.contains("effective=1s"), "{err}");
}

/// Issue 27's first report: 30,000 small objects of a Spark-shaped prefix (with its commit
/// markers) under the default split size made one split whose descriptor passed the store's
/// value limit, and no leader could publish a plan.
#[test]
fn a_prefix_of_30000_small_objects_runs_under_the_default_split_size() {
    let (tmp, data) = data_dir();
    let mut expected = BTreeSet::new();
    for d in 0..30 {
        let dir = data.join(format!("date=2026-01-{:02}", d + 1));
        std::fs::create_dir(&dir).unwrap();
        std::fs::write(dir.join("_SUCCESS"), "").unwrap();
        std::fs::write(dir.join("._SUCCESS.crc"), "crc").unwrap();
        for i in 0..1_000 {
            let name = format!("part-{i:06}-c000.json");
            std::fs::write(dir.join(&name), format!("{{\"n\":{i}}}\n")).unwrap();
            expected.insert(format!("date=2026-01-{:02}/{name}:1", d + 1));
        }
    }
    let sink = tmp.path().join("out.jsonl");
    let (code, out, err) = run(etl_coord().args([
        "worker",
        "--job",
        "small-objects",
        "--store",
        "memory",
        "--source",
        &format!("files:{}", data.display()),
        "--sink",
        sink.to_str().unwrap(),
        "--lease-duration",
        "3s",
    ]));
    assert_eq!(code, 0, "{out}\n{err}");
    let lines = JsonlSink::read(&sink).unwrap();
    let seen: BTreeSet<String> = lines.iter().map(|l| l.record.clone()).collect();
    assert_eq!(seen.len(), 30_000, "no marker read, no object lost");
    assert_eq!(seen, expected);
    let splits: BTreeSet<&str> = lines.iter().map(|l| l.split.as_str()).collect();
    assert!(splits.len() > 1, "cut by descriptor size: {} splits", splits.len());
}

#[test]
fn an_unprocessable_split_is_quarantined_and_the_worker_exits_3() {
    let (_tmp, data) = data_dir();
    input(&data, 3, 50);
    std::fs::write(data.join("bad.txt"), "fine\nBROKEN record\n").unwrap();
    let (code, out, err) = run(etl_coord().args([
        "worker",
        "--store",
        "memory",
        "--job",
        "t2",
        "--source",
        &format!("files:{}", data.display()),
        "--split-size",
        "100",
        "--max-attempts",
        "2",
        "--lease-duration",
        "3s",
        "--unprocessable-marker",
        "BROKEN",
        "--claim-backoff",
        "1s",
    ]));
    assert_eq!(code, 3, "{out}\n{err}");
    assert!(err.contains("quarantined") && err.contains("requeue"), "{err}");
    // With --on-stall warn the same job exits 0.
    let (code, _, err) = run(etl_coord().args([
        "worker",
        "--store",
        "memory",
        "--job",
        "t2",
        "--source",
        &format!("files:{}", data.display()),
        "--split-size",
        "100",
        "--max-attempts",
        "2",
        "--lease-duration",
        "3s",
        "--unprocessable-marker",
        "BROKEN",
        "--claim-backoff",
        "1s",
        "--on-stall",
        "warn",
    ]));
    assert_eq!(code, 0, "{err}");
}

#[test]
fn usage_errors_exit_2_naming_the_flag_before_anything_starts() {
    let (code, _, _) = run(etl_coord().args(["worker", "--store", "memory", "--job", "x"]));
    assert_eq!(code, 2, "missing --source is a usage error");
    let tmp = tempfile::tempdir().unwrap();
    let source = format!("files:{}", tmp.path().display());
    // No --store: two workers would each process everything; refused, saying what to give.
    let (code, _, err) = run(etl_coord()
        .args(["worker", "--job", "x", "--source", &source])
        .env_remove("NATS_URL")
        .env_remove("ETL_COORD_STORE"));
    assert_eq!(code, 2, "{err}");
    assert!(
        err.contains("--store is required") && err.contains("memory") && err.contains("NATS_URL"),
        "{err}"
    );
    // Bad values name the flag and exit 2, before any connection (the store is unreachable).
    let unreachable = "nats://127.0.0.1:9";
    for (args, expect) in [
        (vec!["--lease-duration", "1500ms"], "--lease-duration"),
        (vec!["--lease-duration", "2h"], "--lease-duration"),
        (vec!["--max-in-flight", "0"], "--max-in-flight"),
        (vec!["--max-attempts", "0"], "--max-attempts"),
        (vec!["--replan-interval", "0s"], "--replan-interval"),
        (vec!["--plan-timeout", "0s"], "--plan-timeout"),
        (vec!["--nats-replicas", "0"], "--nats-replicas"),
        (vec!["--nats-user", "u"], "--nats-user"),
        (vec!["--nats-creds", "/no/such.creds"], "--nats-creds"),
        (vec!["--nats-tls-ca", "/no/such.pem"], "--nats-tls-ca"),
        (vec!["--instance-id", "a.b"], "--instance-id"),
        (vec!["--on-stall", "sometimes"], "--on-stall"),
        (vec!["--nats-op-timeout", "0s"], "--nats-op-timeout"),
        (vec!["--on-lane-stall", "sometimes"], "--on-lane-stall"),
        (vec!["--lane-stall-timeout", "soon"], "--lane-stall-timeout"),
        (vec!["--lane-stall-timeout", "500ms"], "--lane-stall-timeout"),
        (vec!["--split-size", "0"], "--split-size"),
        (vec!["--claim-backoff", "11m"], "--claim-backoff"),
        (vec!["--breaker-threshold", "1"], "--breaker-threshold"),
        (vec!["--breaker-window", "0s"], "--breaker-window"),
        (vec!["--on-bad-record", "ignore"], "--on-bad-record"),
        (vec!["--sink", "/no/such/dir/out.jsonl"], "--sink"),
        (vec!["--source", "files:/no/such/dir"], "--source"),
        (vec!["--source", "kafka:topic"], "--source"),
        (vec!["--source", "sqlite:/no/such.db:t"], "--source"),
        (vec!["--include", "[oops"], "--include"),
        (vec!["--exclude", "a{b"], "--exclude"),
        (vec!["--split-large-objects", "--follow"], "--split-large-objects"),
    ] {
        let t = std::time::Instant::now();
        let (code, _, err) = run(etl_coord()
            .args(["worker", "--job", "x", "--store", unreachable, "--source", &source])
            .args(&args)
            .env_remove("NATS_USER")
            .env_remove("NATS_PASSWORD"));
        assert_eq!(code, 2, "{args:?}: {err}");
        assert!(err.contains(expect), "{args:?} names {expect}: {err}");
        assert!(t.elapsed() < std::time::Duration::from_secs(5), "{args:?}: no connection attempt");
    }
    // Options that do not apply to a Parquet source are refused by name.
    let parquet = format!("parquet:{}", std::env::temp_dir().display());
    for (flag, expect) in [("--follow", "--follow"), ("--split-large-objects", "--split-large-objects")] {
        let (code, _, err) = run(etl_coord().args([
            "worker",
            "--job",
            "x",
            "--store",
            unreachable,
            "--source",
            &parquet,
            flag,
        ]));
        assert_eq!(code, 2, "{flag}: {err}");
        assert!(err.contains(expect) && err.contains("parquet"), "{flag}: {err}");
    }
    // The environment is read with one prefix, and checked the same way.
    let (code, _, err) = run(etl_coord()
        .args(["worker", "--job", "x", "--store", "memory", "--source", &source])
        .env("ETL_COORD_LEASE_DURATION", "1500ms"));
    assert_eq!(code, 2);
    assert!(err.contains("--lease-duration") && err.contains("whole number of seconds"), "{err}");
    let (code, _, err) =
        run(etl_coord().args(["worker", "--job", "bad.name", "--store", "memory", "--source", "files:/tmp"]));
    assert_eq!(code, 2);
    assert!(err.contains("--job") && err.contains("[A-Za-z0-9_-]"), "{err}");
    // The instance id from the pod name is checked as --instance-id is.
    let (code, _, err) = run(etl_coord()
        .args(["worker", "--job", "x", "--store", unreachable, "--source", &source])
        .env("POD_NAME", "pod/1"));
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("--instance-id") && err.contains("POD_NAME"), "{err}");
    // A missing input directory says so.
    let (code, _, err) = run(etl_coord().args([
        "worker",
        "--job",
        "x",
        "--store",
        unreachable,
        "--source",
        "files:/no/such/dir",
    ]));
    assert_eq!(code, 2);
    assert!(err.contains("--source") && err.contains("does not exist"), "{err}");
    // A job's max_attempts out of range is refused before any connection.
    let (code, _, err) =
        run(etl_coord().args(["job", "set-max-attempts", "--job", "x", "--store", unreachable, "1001"]));
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("1001") && err.contains("1..=1000"), "{err}");
    // A reset asks before it rewrites; with nobody to ask (no terminal), it needs --yes.
    let (code, _, err) =
        run(etl_coord().args(["requeue", "--job", "x", "--store", "memory", "--split", "s1", "--yes"]));
    assert_eq!(code, 2, "--yes without --reset: {err}");
    assert!(err.contains("--reset"), "{err}");
}

#[test]
fn help_lists_the_exit_codes_and_the_environment() {
    let (code, out, _) = run(etl_coord().args(["worker", "--help"]));
    assert_eq!(code, 0);
    for text in [
        "Exit codes: 0",
        "3 job stalled",
        "2 a usage error",
        "ETL_COORD_LEASE_DURATION",
        "NATS_URL",
        "[env: ETL_COORD_STORE",
    ] {
        assert!(out.contains(text), "{text} in:\n{out}");
    }
}

#[test]
fn the_store_comes_from_nats_url_when_not_given() {
    // NATS_URL, the NATS CLI's variable, is honoured: here it names an unreachable server, so
    // the worker gets as far as connecting (exit 1 naming the URL), not a usage error.
    let tmp = tempfile::tempdir().unwrap();
    let (code, _, err) = run(etl_coord()
        .args(["status", "--job", "x", "--nats-op-timeout", "1s"])
        .env_remove("ETL_COORD_STORE")
        .env("NATS_URL", "nats://127.0.0.1:9"));
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("nats://127.0.0.1:9"), "{err}");
    let _ = tmp;
}

#[test]
fn logs_are_json_lines_on_request_and_plain_text_without_a_terminal() {
    let (tmp, data) = data_dir();
    input(&data, 1, 20);
    let source = format!("files:{}", data.display());
    let (code, _, err) = run(etl_coord().args([
        "worker",
        "--job",
        "j",
        "--store",
        "memory",
        "--source",
        &source,
        "--log-format",
        "json",
    ]));
    assert_eq!(code, 0, "{err}");
    let lines: Vec<serde_json::Value> = err
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{l:?} is not JSON: {e}")))
        .collect();
    let messages: Vec<&str> = lines.iter().filter_map(|l| l["fields"]["message"].as_str()).collect();
    for m in ["coordination worker starting", "split acquired", "lane ended", "job complete"] {
        assert!(messages.contains(&m), "{m} in {messages:?}");
    }
    let lane = lines.iter().find(|l| l["fields"]["message"] == "lane ended").unwrap();
    assert!(lane["span"]["split"].is_string() && lane["span"]["epoch"] == 1, "the lane span: {lane}");
    // Text, stderr not a terminal: no escape codes; -q keeps only warnings and errors.
    let (code, _, err) =
        run(etl_coord().args(["worker", "--job", "j", "--store", "memory", "--source", &source]));
    assert_eq!(code, 0);
    assert!(err.contains("INFO") && err.contains("job complete") && !err.contains('\u{1b}'), "{err}");
    let (code, _, err) =
        run(etl_coord().args(["-q", "worker", "--job", "j", "--store", "memory", "--source", &source]));
    assert_eq!(code, 0);
    assert!(!err.contains("INFO"), "{err}");
    let (_, _, err) = run(etl_coord()
        .args(["--color", "always", "worker", "--job", "j", "--store", "memory", "--source", &source]));
    assert!(err.contains('\u{1b}'), "--color always: {err}");
    let _ = tmp;
}

#[test]
fn a_worker_scans_a_sqlite_table_into_its_sink() {
    let tmp = tempfile::tempdir().unwrap();
    let db = tmp.path().join("shop.db");
    let conn = rusqlite::Connection::open(&db).unwrap();
    conn.execute_batch("CREATE TABLE orders (id INTEGER PRIMARY KEY, item TEXT)").unwrap();
    for i in 1..=700 {
        conn.execute("INSERT INTO orders (id, item) VALUES (?1, ?2)", (i, format!("item {i}"))).unwrap();
    }
    drop(conn);
    let sink = tmp.path().join("out.jsonl");
    let (code, out, err) = run(etl_coord().args([
        "worker",
        "--store",
        "memory",
        "--job",
        "t3",
        "--source",
        &format!("sqlite:{}:orders", db.display()),
        "--split-rows",
        "100",
        "--sink",
        sink.to_str().unwrap(),
        "--lease-duration",
        "3s",
    ]));
    assert_eq!(code, 0, "{out}\n{err}");
    let seen: BTreeSet<String> = JsonlSink::read(&sink).unwrap().into_iter().map(|l| l.record).collect();
    let expected: BTreeSet<String> = (1..=700).map(|i| format!("orders:{i}")).collect();
    assert_eq!(seen, expected);
}

#[test]
fn the_admin_server_serves_metrics_and_health_and_sigterm_drains() {
    let (_tmp, data) = data_dir();
    input(&data, 2, 400);
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let addr = format!("127.0.0.1:{port}");
    let child = etl_coord()
        .args([
            "worker",
            "--store",
            "memory",
            "--job",
            "t4",
            "--source",
            &format!("files:{}", data.display()),
            "--split-size",
            "1000",
            "--lease-duration",
            "3s",
            "--record-delay-ms",
            "20",
            "--admin-addr",
            &addr,
        ])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    // Wait (bounded) for the admin server and the first acquisition.
    let mut metrics = String::new();
    for _ in 0..100 {
        if let Some(body) = http_get(&addr, "/metrics")
            && body.contains(r#"reason="create"}"#)
            && !body.contains(r#"reason="create"} 0"#)
        {
            metrics = body;
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    for family in etl_coordination_metrics::names::ALL {
        assert!(metrics.contains(family), "{family} missing from /metrics:\n{metrics}");
    }
    assert!(metrics.contains(r#"coordination_job="t4""#), "{metrics}");
    assert!(http_get(&addr, "/healthz").unwrap().starts_with("HTTP/1.1 200"));
    assert!(http_get(&addr, "/readyz").unwrap().starts_with("HTTP/1.1 200"));
    // A real HTTP server: methods are checked, unknown paths are 404, and a connection is kept
    // alive across requests.
    let raw = |request: &str| {
        use std::io::{Read, Write};
        let mut s = std::net::TcpStream::connect(&addr).unwrap();
        s.set_read_timeout(Some(std::time::Duration::from_secs(5))).unwrap();
        s.write_all(request.as_bytes()).unwrap();
        let mut out = String::new();
        let _ = s.read_to_string(&mut out);
        out
    };
    assert!(
        raw("POST /metrics HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
            .starts_with("HTTP/1.1 405")
    );
    assert!(raw("GET /nope HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").starts_with("HTTP/1.1 404"));
    let two = raw(
        "GET /healthz HTTP/1.1\r\nHost: x\r\n\r\nGET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
    );
    assert_eq!(two.matches("HTTP/1.1 200").count(), 2, "two answers on one connection: {two}");
    // SIGTERM drains: the process commits, releases and exits 0 well before the job is done.
    let status =
        std::process::Command::new("kill").args(["-TERM", &child.id().to_string()]).status().unwrap();
    assert!(status.success());
    let out = child.wait_with_output().unwrap();
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(String::from_utf8_lossy(&out.stderr).contains("draining"));
}

#[test]
fn a_poison_marker_aborts_the_process_like_a_crash() {
    let (tmp, data) = data_dir();
    std::fs::write(data.join("a.txt"), "fine\nPOISON here\nnever reached\n").unwrap();
    let sink = tmp.path().join("out.jsonl");
    let (code, _, err) = run(etl_coord().args([
        "worker",
        "--store",
        "memory",
        "--job",
        "t5",
        "--source",
        &format!("files:{}", data.display()),
        "--sink",
        sink.to_str().unwrap(),
        "--lease-duration",
        "3s",
        "--poison-marker",
        "POISON",
    ]));
    assert_eq!(code, -1, "killed by a signal (abort), not a clean exit: {err}");
    assert!(err.contains("poison record a.txt:2"), "{err}");
    let lines = JsonlSink::read(&sink).unwrap_or_default();
    assert!(lines.iter().all(|l| l.record != "a.txt:3"), "nothing after the poison record");
}

#[test]
fn with_on_complete_wait_a_finished_worker_stays_up_until_sigterm() {
    let (_tmp, data) = data_dir();
    input(&data, 2, 50);
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let addr = format!("127.0.0.1:{port}");
    let mut child = etl_coord()
        .args([
            "worker",
            "--store",
            "memory",
            "--job",
            "t-wait",
            "--on-complete",
            "wait",
            "--admin-addr",
            &addr,
        ])
        .arg("--source")
        .arg(format!("files:{}", data.display()))
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let rx = follow_stderr(&mut child);
    let seen = lines_until(&rx, "staying after the end");
    assert!(seen.iter().any(|l| l.contains("job complete")), "{seen:#?}");
    // Still alive and healthy after completion, so a Deployment does not restart it.
    assert!(child.try_wait().unwrap().is_none(), "the worker exited after completion");
    assert!(http_get(&addr, "/healthz").unwrap().starts_with("HTTP/1.1 200"));
    let metrics = http_get(&addr, "/metrics").unwrap();
    for (state, v) in [("complete", 1), ("running", 0), ("stalled", 0)] {
        let series = r#"etl_coordination_job_state{coordination_job="t-wait",coordination_instance="#;
        assert!(
            metrics
                .lines()
                .any(|l| l.starts_with(series) && l.ends_with(&format!(r#"state="{state}"}} {v}"#))),
            "job_state {state} = {v} expected in:\n{metrics}"
        );
    }
    std::process::Command::new("kill").args(["-TERM", &child.id().to_string()]).status().unwrap();
    assert_eq!(child.wait().unwrap().code(), Some(0));
}

#[test]
fn status_of_the_in_memory_store_says_it_holds_no_job_even_when_watching() {
    // A memory store lives inside the process that runs the job: a new process finds nothing,
    // and waiting cannot change that.
    for extra in [&[][..], &["--watch", "--interval", "100ms"][..]] {
        let (code, _, err) = run(etl_coord().args(["status", "--job", "w", "--store", "memory"]).args(extra));
        assert_eq!(code, 1, "{err}");
        assert!(err.contains("no job w at the in-memory store") && err.contains("--store nats://"), "{err}");
    }
}

#[test]
fn a_drained_worker_exits_with_the_code_it_was_given() {
    use std::io::BufRead;
    let (_tmp, data) = data_dir();
    input(&data, 1, 400);
    let mut child = etl_coord()
        .args([
            "worker",
            "--store",
            "memory",
            "--job",
            "t-drained",
            "--source",
            &format!("files:{}", data.display()),
        ])
        .args(["--record-delay-ms", "20", "--exit-code-when-drained", "143"])
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let stderr = std::io::BufReader::new(child.stderr.take().unwrap());
    let mut lines = stderr.lines().map_while(Result::ok);
    assert!(lines.any(|l| l.contains("split acquired")), "the worker started");
    std::process::Command::new("kill").args(["-TERM", &child.id().to_string()]).status().unwrap();
    std::thread::spawn(move || lines.for_each(drop));
    assert_eq!(child.wait().unwrap().code(), Some(143), "drained before the job ended");
}

/// A worker whose lanes hang on a record (a read that never answers), with a short stall
/// timeout; its stderr is followed on a thread.
fn hanging_worker(
    job: &str,
    extra: &[&str],
) -> (tempfile::TempDir, std::process::Child, std::sync::mpsc::Receiver<String>) {
    let (tmp, data) = data_dir();
    // The hang comes first: a record written before it would be committed by the time cadence
    // while the read hangs, which counts as progress (and a second stall after it).
    std::fs::write(data.join("a.txt"), "HANG here\none\ntwo\n").unwrap();
    let mut child = etl_coord()
        .args(["worker", "--store", "memory", "--job", job, "--source", &format!("files:{}", data.display())])
        .args(["--hang-marker", "HANG", "--lane-stall-timeout", "1s"])
        .args(extra)
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let rx = follow_stderr(&mut child);
    (tmp, child, rx)
}

/// The lines `child` writes to its (piped) stderr, followed on a thread so that waits for a
/// line can be bounded.
fn follow_stderr(child: &mut std::process::Child) -> std::sync::mpsc::Receiver<String> {
    use std::io::BufRead;
    let (tx, rx) = std::sync::mpsc::channel();
    let stderr = child.stderr.take().expect("stderr piped");
    std::thread::spawn(move || {
        for line in std::io::BufReader::new(stderr).lines().map_while(Result::ok) {
            let _ = tx.send(line);
        }
    });
    rx
}

/// Lines from `rx` until one contains `text` (60 s at most).
fn lines_until(rx: &std::sync::mpsc::Receiver<String>, text: &str) -> Vec<String> {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    let mut seen = Vec::new();
    while !seen.iter().any(|l: &String| l.contains(text)) {
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        match rx.recv_timeout(left) {
            Ok(line) => seen.push(line),
            Err(e) => panic!("no line with {text:?} ({e}); stderr so far: {seen:#?}"),
        }
    }
    seen
}

#[test]
fn a_lane_that_makes_no_progress_is_reported_stalled() {
    let admin = free_addr();
    let (_tmp, mut child, rx) =
        hanging_worker("t-stall", &["--admin-addr", &admin, "--drain-timeout", "60s"]);
    let seen = lines_until(&rx, "lane stalled");
    let line = seen.last().unwrap();
    assert!(line.contains("committed no progress for 1s"), "{line}");
    assert!(line.contains("split="), "the line names the split: {line}");
    wait_for_metric(&[&admin], "etl_coordination_lanes_stalled", "\"}", 1.0);
    wait_for_metric(&[&admin], "etl_coordination_lane_stalls_total", "\"}", 1.0);
    // Warn only: the lane keeps its split. A drain stops it at once although its read never
    // returns (the read is raced against the stop signal), well before the drain timeout.
    assert!(child.try_wait().unwrap().is_none());
    let t = std::time::Instant::now();
    std::process::Command::new("kill").args(["-TERM", &child.id().to_string()]).status().unwrap();
    assert_eq!(child.wait().unwrap().code(), Some(0));
    assert!(t.elapsed() < std::time::Duration::from_secs(20), "drained in {:?}", t.elapsed());
}

#[test]
fn with_on_lane_stall_release_a_split_that_always_hangs_ends_quarantined() {
    let (_tmp, mut child, rx) = hanging_worker(
        "t-stall-release",
        &["--on-lane-stall", "release", "--max-attempts", "2", "--on-stall", "warn", "--claim-backoff", "1s"],
    );
    let seen = lines_until(&rx, "split quarantined");
    assert_eq!(seen.iter().filter(|l| l.contains("releasing the split as failed")).count(), 2, "{seen:#?}");
    let q = seen.last().unwrap();
    assert!(q.contains("lane stalled: no progress committed for 1s"), "the last error says why: {q}");
    assert_eq!(child.wait().unwrap().code(), Some(0), "stalled with --on-stall warn");
}

/// A tmpfs mounted for one test, unmounted when it ends.
struct Tmpfs(std::path::PathBuf);

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(&self.0).status();
    }
}

/// The sink's disk fills up: every lane waits the outage out in place (nothing is charged to a
/// split, nothing quarantined), and once space is freed the job completes with every record in
/// the sink once. Needs root (it mounts a 2 MiB tmpfs); skipped, saying so, for anyone else.
#[test]
fn a_full_disk_under_the_sink_is_waited_out_and_the_job_completes() {
    let uid =
        Command::new("id").arg("-u").output().map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned());
    if uid.ok().as_deref() != Some("0") {
        eprintln!("skipped: mounting a tmpfs needs root");
        return;
    }
    let (tmp, data) = data_dir();
    let expected = input(&data, 6, 1000);
    let disk = tmp.path().join("disk");
    std::fs::create_dir(&disk).unwrap();
    let status =
        Command::new("mount").args(["-t", "tmpfs", "-o", "size=2m", "tmpfs"]).arg(&disk).status().unwrap();
    assert!(status.success(), "mounting a tmpfs at {} failed (root without mount rights?)", disk.display());
    let _mounted = Tmpfs(disk.clone());
    // Leave about 64 KiB: the sink fills it within the first split.
    let filler = disk.join("filler");
    std::fs::write(&filler, vec![0u8; 2 * 1024 * 1024 - 64 * 1024]).unwrap();
    let sink = disk.join("out.jsonl");
    let mut child = etl_coord()
        .args([
            "worker",
            "--job",
            "full",
            "--store",
            "memory",
            "--instance-id",
            "solo",
            "--lease-duration",
            "3s",
        ])
        .args(["--source", &format!("files:{}", data.display()), "--split-size", "20000", "--sink"])
        .arg(&sink)
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let rx = follow_stderr(&mut child);
    let full = lines_until(&rx, "No space left on device");
    std::fs::remove_file(&filler).unwrap();
    let after = lines_until(&rx, "recovered from a transient failure");
    let status = child.wait().unwrap();
    let rest: Vec<String> = rx.try_iter().collect();
    assert_eq!(status.code(), Some(0), "{after:#?}\n{rest:#?}");
    let logged: Vec<&String> = full.iter().chain(&after).chain(&rest).collect();
    assert!(!logged.iter().any(|l| l.contains("quarantined")), "nothing quarantined");
    assert!(
        !logged.iter().any(|l| l.contains("the sink failed")),
        "no tenancy ended as failed (the outage was waited out): {logged:#?}"
    );
    // A write the full disk cut short was cut back: no torn line anywhere (reading is strict
    // but for a last line), and none at the end.
    assert!(std::fs::read(&sink).unwrap().ends_with(b"\n"), "the file ends with a whole line");
    let lines = JsonlSink::read(&sink).unwrap();
    let seen: BTreeSet<String> = lines.iter().map(|l| l.record.clone()).collect();
    assert_eq!(seen, expected, "every input record in the sink");
    assert_eq!(lines.len(), expected.len(), "each once: a failed write was read again, not written twice");
}

/// Input with two lines that are not UTF-8 (`mixed.txt:2` and `:4`) among good ones.
fn input_with_bad_lines(data: &Path) -> BTreeSet<String> {
    let mut expected = input(data, 3, 200);
    std::fs::write(data.join("mixed.txt"), b"ok 1\nbad\xff\nok 3\n\xfe\xfe\nok 5\n").unwrap();
    expected.extend(["mixed.txt:1", "mixed.txt:3", "mixed.txt:5"].map(String::from));
    expected
}

#[test]
fn by_default_a_line_that_is_not_utf8_quarantines_its_split_naming_it() {
    let (_tmp, data) = data_dir();
    input_with_bad_lines(&data);
    let (code, out, err) = run(etl_coord().args([
        "worker",
        "--store",
        "memory",
        "--job",
        "tbad",
        "--source",
        &format!("files:{}", data.display()),
        "--max-attempts",
        "2",
        "--claim-backoff",
        "1s",
    ]));
    assert_eq!(code, 3, "{out}\n{err}");
    assert!(err.contains("bad record at mixed.txt:2: not UTF-8"), "{err}");
    // One failure, a backoff, the second failure quarantines.
    assert_eq!(
        err.matches("split failed; it is claimed again once its backoff has passed").count(),
        1,
        "{err}"
    );
    assert!(err.contains("retry_in=1s"), "{err}");
}

#[test]
fn with_on_bad_record_skip_the_job_completes_and_the_dead_letter_file_holds_exactly_the_bad_records() {
    let (tmp, data) = data_dir();
    let expected = input_with_bad_lines(&data);
    let (sink, dead) = (tmp.path().join("out.jsonl"), tmp.path().join("dead.jsonl"));
    let admin = free_addr();
    let child = etl_coord()
        .args([
            "worker",
            "--store",
            "memory",
            "--job",
            "tskip",
            "--source",
            &format!("files:{}", data.display()),
            "--sink",
            sink.to_str().unwrap(),
            "--on-bad-record",
            "skip",
            "--dead-letter",
            dead.to_str().unwrap(),
            "--on-complete",
            "wait",
            "--admin-addr",
            &admin,
        ])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    // Killed if the test fails before it ends the worker.
    struct Reap(std::process::Child);
    impl Drop for Reap {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
    let mut child = Reap(child);
    wait_for_metric(&[&admin], "etl_coordination_job_state", r#"state="complete"}"#, 1.0);
    wait_for_metric(&[&admin], "etl_coordination_records_skipped_total", "}", 2.0);
    std::process::Command::new("kill").args(["-TERM", &child.0.id().to_string()]).status().unwrap();
    assert_eq!(child.0.wait().unwrap().code(), Some(0));
    let written: Vec<String> = JsonlSink::read(&sink).unwrap().into_iter().map(|l| l.record).collect();
    assert_eq!(written.len(), expected.len(), "each good record once");
    assert_eq!(written.into_iter().collect::<BTreeSet<_>>(), expected);
    let kept = etl_coord::sink::DeadLetterFile::read(&dead).unwrap();
    let got: Vec<(&str, &str, Option<&str>)> =
        kept.iter().map(|d| (d.position.as_str(), d.raw.as_str(), d.raw_hex.as_deref())).collect();
    assert_eq!(
        got,
        vec![
            ("mixed.txt:2", "bad\u{fffd}", Some("626164ff")),
            ("mixed.txt:4", "\u{fffd}\u{fffd}", Some("fefe"))
        ]
    );
    assert!(kept.iter().all(|d| d.error.contains("not UTF-8") && d.epoch == 1), "{kept:?}");
}

#[test]
fn skipping_bad_records_needs_a_dead_letter_file_and_only_then_takes_one() {
    let (tmp, data) = data_dir();
    input(&data, 1, 10);
    let dead = tmp.path().join("dead.jsonl");
    let source = format!("files:{}", data.display());
    let base = ["worker", "--store", "memory", "--job", "tdl", "--source", source.as_str()];
    let (code, _, err) = run(etl_coord().args(base).args(["--on-bad-record", "skip"]));
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("--on-bad-record") && err.contains("--dead-letter"), "{err}");
    let (code, _, err) = run(etl_coord().args(base).args(["--dead-letter", dead.to_str().unwrap()]));
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("--dead-letter") && err.contains("only written with --on-bad-record skip"), "{err}");
    let (code, _, err) = run(etl_coord().args(base).args([
        "--on-bad-record",
        "skip",
        "--dead-letter",
        "/nonexistent/d.jsonl",
    ]));
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("--dead-letter") && err.contains("does not exist"), "{err}");
}

#[test]
fn nats_account_gives_each_job_its_own_password_variables_and_refuses_what_would_share_them() {
    let (code, out, err) = run(etl_coord().args(["nats-account", "--job", "my-job", "--max-file", "1GiB"]));
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("\"etl_coordination_my-job\": {"), "{out}");
    for line in [
        "user: \"etl-my-job\"",
        "password: $ETL_MY_JOB_NATS_PASSWORD",
        "user: \"setup-my-job\"",
        "password: $ETL_MY_JOB_SETUP_NATS_PASSWORD",
        "max_file: 1073741824, max_mem: 0, max_streams: 2, max_consumers: 1024, max_bytes_required: true",
    ] {
        assert!(out.contains(line), "{line:?} in:\n{out}");
    }
    let refused = |args: &[&str], says: &str| {
        let (code, _, err) =
            run(etl_coord().args(["nats-account", "--job", "my-job", "--max-file", "1GiB"]).args(args));
        assert_eq!(code, 1, "{args:?}: {err}");
        assert!(err.contains(says), "{args:?}: {says:?} in {err}");
    };
    refused(&["--password-var", "SAME", "--setup-password-var", "SAME"], "are both SAME");
    refused(&["--password-var", "9LIVES"], "not an environment variable name");
    refused(&["--max-consumers", "2"], "at least 3");
    refused(&["--setup-user", "etl-JOB"], "are both \"etl-my-job\"");
    let (code, _, err) = run(etl_coord().args(["nats-account", "--job", "my-job", "--max-file", "lots"]));
    assert_eq!(code, 2, "{err}");
}

/// A worker told to stop while it is still connecting (a rollout, a scale down) exits as
/// drained, having held nothing, instead of dying of the signal.
#[test]
fn a_termination_signal_while_the_worker_connects_exits_as_drained() {
    // A "server" that accepts the connection and never answers: the worker stays in its connect.
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("nats://{}", listener.local_addr().unwrap());
    let (_tmp, data) = data_dir();
    let child = etl_coord()
        .args(["worker", "--job", "connecting", "--store", &url, "--nats-op-timeout", "60s"])
        .args(["--source", &format!("files:{}", data.display()), "--sink", "/dev/null"])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let (_held, _) = listener.accept().unwrap();
    let t = std::time::Instant::now();
    assert!(Command::new("kill").args(["-TERM", &child.id().to_string()]).status().unwrap().success());
    let out = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{err}");
    assert!(err.contains("termination signal while starting"), "{err}");
    assert!(t.elapsed() < std::time::Duration::from_secs(10), "exited at once: {:?}", t.elapsed());
}
