//! The files source on S3 (`files:s3://BUCKET/PREFIX/`, feature `cloud`), configured the way the
//! Kubernetes Deployment configures it: endpoint, region and credentials from `AWS_*`
//! environment variables. Runs against a moto S3 server.
//!
//! Needs `--features cloud` and `S3_ENDPOINT` (`cargo xtask ci` starts moto and runs this file
//! with the feature).
#![cfg(feature = "cloud")]

use std::collections::BTreeSet;
use std::io::{Read, Write};

use etl_coord::sink::JsonlSink;

/// One plain HTTP/1.0 request to the S3 endpoint (moto does not check signatures); the status.
fn http(endpoint: &str, method: &str, path: &str, body: &[u8]) -> u16 {
    let addr = endpoint.strip_prefix("http://").expect("an http:// endpoint");
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    let head = format!("{method} {path} HTTP/1.0\r\nHost: {addr}\r\nContent-Length: {}\r\n\r\n", body.len());
    s.write_all(head.as_bytes()).unwrap();
    s.write_all(body).unwrap();
    let mut reply = String::new();
    s.read_to_string(&mut reply).unwrap();
    reply.split_whitespace().nth(1).and_then(|c| c.parse().ok()).unwrap_or(0)
}

/// `etl-coord worker` reading `s3://BUCKET/input/` through `endpoint` into `sink`, configured
/// from `AWS_*` variables as the Kubernetes Deployment configures it, in splits of 1000 bytes.
fn s3_worker(endpoint: &str, bucket: &str, sink: &std::path::Path) -> std::process::Command {
    let mut c = s3_command(endpoint, "files", bucket, sink);
    c.args(["--split-size", "1000"]);
    c
}

/// `etl-coord worker` reading `KIND:s3://BUCKET/input/` through `endpoint` into `sink`.
fn s3_command(endpoint: &str, kind: &str, bucket: &str, sink: &std::path::Path) -> std::process::Command {
    let mut c = std::process::Command::new(env!("CARGO_BIN_EXE_etl-coord"));
    c.arg("worker")
        .arg("--source")
        .arg(format!("{kind}:s3://{bucket}/input/"))
        .arg("--sink")
        .arg(sink)
        .env("AWS_ENDPOINT_URL", endpoint)
        .env("AWS_ALLOW_HTTP", "true")
        .env("AWS_REGION", "us-east-1")
        .env("AWS_ACCESS_KEY_ID", "test")
        .env("AWS_SECRET_ACCESS_KEY", "test");
    c
}

#[test]
fn a_worker_reads_an_s3_prefix_with_credentials_and_endpoint_from_the_environment() {
    let endpoint = std::env::var("S3_ENDPOINT")
        .expect("S3_ENDPOINT is not set: run `cargo xtask ci`, which starts a moto S3 server");
    let bucket = format!("etl-{}", std::process::id());
    assert_eq!(http(&endpoint, "PUT", &format!("/{bucket}"), b""), 200, "bucket created");
    let mut expected = BTreeSet::new();
    for i in 0..5 {
        let body: String = (1..=40).map(|l| format!("object {i} line {l}\n")).collect();
        assert_eq!(http(&endpoint, "PUT", &format!("/{bucket}/input/part-{i}.txt"), body.as_bytes()), 200);
        expected.extend((1..=40).map(|l| format!("input/part-{i}.txt:{l}")));
    }
    // Outside the prefix: never read.
    assert_eq!(http(&endpoint, "PUT", &format!("/{bucket}/other/skip.txt"), b"not me\n"), 200);

    let tmp = tempfile::tempdir().unwrap();
    let sink = tmp.path().join("out.jsonl");
    let out = s3_worker(&endpoint, &bucket, &sink)
        .args(["--job", "s3"])
        // Unprefixed look-alikes must not reach the store's configuration.
        .env("REGION", "nowhere-1")
        .env("ENDPOINT", "http://127.0.0.1:1")
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let lines = JsonlSink::read(&sink).unwrap();
    let seen: BTreeSet<String> = lines.iter().map(|l| l.record.clone()).collect();
    assert_eq!(seen, expected, "every line of the prefix, nothing outside it");
    let splits: BTreeSet<&str> = lines.iter().map(|l| l.split.as_str()).collect();
    assert!(splits.len() > 1, "bin-packed into several splits: {splits:?}");
}

/// An HTTP proxy in front of the S3 endpoint, one request per connection: it forwards requests
/// until the `after`-th GET of an object, then answers `503 SlowDown` (S3's throttling reply)
/// to everything for `outage`, then forwards again. Counts the 503s it sent.
struct ThrottlingProxy {
    endpoint: String,
    throttled: std::sync::Arc<std::sync::atomic::AtomicU64>,
}

impl ThrottlingProxy {
    fn start(upstream: &str, after: u64, outage: std::time::Duration) -> Self {
        use std::sync::Arc;
        use std::sync::atomic::{AtomicU64, Ordering};
        let upstream = upstream.strip_prefix("http://").expect("an http:// endpoint").to_owned();
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let endpoint = format!("http://{}", listener.local_addr().unwrap());
        let throttled = Arc::new(AtomicU64::new(0));
        let gets = Arc::new(AtomicU64::new(0));
        let until = Arc::new(std::sync::Mutex::new(None::<std::time::Instant>));
        let count = throttled.clone();
        std::thread::spawn(move || {
            for client in listener.incoming() {
                let Ok(client) = client else { return };
                let (upstream, count, gets, until) =
                    (upstream.clone(), count.clone(), gets.clone(), until.clone());
                std::thread::spawn(move || {
                    let Some((head, body)) = read_request(&client) else { return };
                    let object_get = head.starts_with("GET ") && head.contains("/input/");
                    let now = std::time::Instant::now();
                    let down = {
                        let mut u = until.lock().unwrap();
                        if object_get && gets.fetch_add(1, Ordering::SeqCst) + 1 == after {
                            *u = Some(now + outage);
                        }
                        u.is_some_and(|t| now < t)
                    };
                    let mut client = client;
                    if down {
                        count.fetch_add(1, Ordering::SeqCst);
                        let xml = "<?xml version=\"1.0\"?><Error><Code>SlowDown</Code><Message>Please reduce your request rate.</Message></Error>";
                        let reply = format!(
                            "HTTP/1.1 503 Slow Down\r\nContent-Type: application/xml\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{xml}",
                            xml.len()
                        );
                        let _ = client.write_all(reply.as_bytes());
                        return;
                    }
                    let Ok(mut up) = std::net::TcpStream::connect(&upstream) else { return };
                    let _ = up.write_all(close_connection(&head).as_bytes());
                    let _ = up.write_all(&body);
                    let mut reply = Vec::new();
                    let _ = up.read_to_end(&mut reply);
                    let split =
                        reply.windows(4).position(|w| w == b"\r\n\r\n").map_or(reply.len(), |i| i + 4);
                    let head = String::from_utf8_lossy(&reply[..split]).into_owned();
                    let _ = client.write_all(close_connection(&head).as_bytes());
                    let _ = client.write_all(&reply[split..]);
                });
            }
        });
        ThrottlingProxy { endpoint, throttled }
    }
}

/// A request's head (through the blank line) and body (`Content-Length` bytes).
fn read_request(client: &std::net::TcpStream) -> Option<(String, Vec<u8>)> {
    use std::io::BufRead;
    let mut r = std::io::BufReader::new(client);
    let mut head = String::new();
    loop {
        let mut line = String::new();
        if r.read_line(&mut line).ok()? == 0 {
            return None;
        }
        head.push_str(&line);
        if line == "\r\n" {
            break;
        }
    }
    let len = head
        .lines()
        .find_map(|l| l.split_once(':').filter(|(k, _)| k.eq_ignore_ascii_case("content-length")))
        .and_then(|(_, v)| v.trim().parse::<usize>().ok())
        .unwrap_or(0);
    let mut body = vec![0; len];
    r.read_exact(&mut body).ok()?;
    Some((head, body))
}

/// `head` (a request's or a response's, through the blank line) with `Connection: close`.
fn close_connection(head: &str) -> String {
    let mut out: String = head
        .trim_end_matches("\r\n")
        .split("\r\n")
        .filter(|l| {
            !l.to_ascii_lowercase().starts_with("connection:")
                && !l.to_ascii_lowercase().starts_with("keep-alive:")
        })
        .map(|l| format!("{l}\r\n"))
        .collect();
    out.push_str("Connection: close\r\n\r\n");
    out
}

#[test]
fn an_object_store_answering_503_for_30_seconds_mid_run_is_waited_out_and_the_job_completes() {
    let endpoint = std::env::var("S3_ENDPOINT")
        .expect("S3_ENDPOINT is not set: run `cargo xtask ci`, which starts a moto S3 server");
    let bucket = format!("etl-throttled-{}", std::process::id());
    assert_eq!(http(&endpoint, "PUT", &format!("/{bucket}"), b""), 200, "bucket created");
    let mut expected = BTreeSet::new();
    for i in 0..12 {
        let body: String = (1..=100).map(|l| format!("object {i} line {l}\n")).collect();
        assert_eq!(http(&endpoint, "PUT", &format!("/{bucket}/input/part-{i:02}.txt"), body.as_bytes()), 200);
        expected.extend((1..=100).map(|l| format!("input/part-{i:02}.txt:{l}")));
    }
    // The third object read starts 30 s of 503 SlowDown for every request, listings included.
    let proxy = ThrottlingProxy::start(&endpoint, 3, std::time::Duration::from_secs(30));
    let tmp = tempfile::tempdir().unwrap();
    let sink = tmp.path().join("out.jsonl");
    let t0 = std::time::Instant::now();
    let out = s3_worker(&proxy.endpoint, &bucket, &sink)
        .args(["--store", "memory", "--job", "s3-throttled", "--max-in-flight", "2"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    // Exit 0 is Complete: no split quarantined (exit 3 is Stalled).
    assert!(out.status.success(), "{stderr}");
    let throttled = proxy.throttled.load(std::sync::atomic::Ordering::SeqCst);
    assert!(throttled > 0, "the outage happened: {throttled} requests answered 503");
    assert!(
        t0.elapsed() >= std::time::Duration::from_secs(25),
        "the run waited the outage out: {:?}",
        t0.elapsed()
    );
    let lines = JsonlSink::read(&sink).unwrap();
    let seen: BTreeSet<String> = lines.iter().map(|l| l.record.clone()).collect();
    assert_eq!(seen, expected, "every line once at least, nothing lost");
    assert!(!stderr.contains("quarantined"), "{stderr}");
}

/// The S3 endpoint `cargo xtask ci` provides.
fn endpoint() -> String {
    std::env::var("S3_ENDPOINT")
        .expect("S3_ENDPOINT is not set: run `cargo xtask ci`, which starts a moto S3 server")
}

/// Uploads `objects` (key, body) into `bucket`, eight at a time.
fn put_all(endpoint: &str, bucket: &str, objects: Vec<(String, Vec<u8>)>) {
    let chunks: Vec<Vec<(String, Vec<u8>)>> =
        objects.chunks(objects.len().div_ceil(8).max(1)).map(<[_]>::to_vec).collect();
    std::thread::scope(|s| {
        for chunk in chunks {
            s.spawn(move || {
                for (key, body) in chunk {
                    assert_eq!(http(endpoint, "PUT", &format!("/{bucket}/{key}"), &body), 200, "{key}");
                }
            });
        }
    });
}

/// The shape of a Spark output prefix on S3: thousands of objects of a few dozen bytes beside
/// commit markers, under the default split size. The plan is cut by descriptor size (one split
/// would be a descriptor far above the store's value limit), the markers are skipped, and every
/// line is emitted exactly once by one worker that is not disturbed.
#[test]
fn a_spark_prefix_of_small_objects_on_s3_plans_in_several_splits_and_reads_every_line_once() {
    let endpoint = endpoint();
    let bucket = format!("etl-small-{}", std::process::id());
    assert_eq!(http(&endpoint, "PUT", &format!("/{bucket}"), b""), 200, "bucket created");
    let mut objects = Vec::new();
    let mut expected = Vec::new();
    for i in 0..2_500 {
        let key = format!("input/date=2024-01-01/part-{i:05}-c000.json");
        objects.push((key.clone(), format!("{{\"n\":{i}}}\n{{\"n\":{i},\"second\":true}}\n").into_bytes()));
        expected.extend([format!("{key}:1"), format!("{key}:2")]);
    }
    for marker in
        ["input/_SUCCESS", "input/date=2024-01-01/.part-00000-c000.json.crc", "input/_committed_123"]
    {
        objects.push((marker.to_owned(), b"not data\n".to_vec()));
    }
    put_all(&endpoint, &bucket, objects);
    let tmp = tempfile::tempdir().unwrap();
    let sink = tmp.path().join("out.jsonl");
    let out = s3_command(&endpoint, "files", &bucket, &sink)
        .args(["--store", "memory", "--job", "s3-small", "--max-in-flight", "4"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let lines = JsonlSink::read(&sink).unwrap();
    let mut seen: Vec<String> = lines.iter().map(|l| l.record.clone()).collect();
    seen.sort();
    expected.sort();
    assert_eq!(seen.len(), expected.len(), "no line twice, none missing");
    assert_eq!(seen, expected, "every data line once, no marker read");
    let splits: BTreeSet<&str> = lines.iter().map(|l| l.split.as_str()).collect();
    assert!(splits.len() >= 2, "cut by descriptor size under the 64 MiB default: {splits:?}");
}

/// A Parquet file of `rows` rows (`id`, `name`) from `first_id`, in row groups of `group_rows`,
/// written by the parquet crate.
fn parquet_file(first_id: i64, rows: i64, group_rows: usize) -> Vec<u8> {
    use std::sync::Arc;
    let ids: Vec<i64> = (first_id..first_id + rows).collect();
    let names: Vec<String> = ids.iter().map(|i| format!("row {i}")).collect();
    let batch = arrow_array::RecordBatch::try_from_iter([
        ("id", Arc::new(arrow_array::Int64Array::from(ids)) as arrow_array::ArrayRef),
        ("name", Arc::new(arrow_array::StringArray::from(names)) as arrow_array::ArrayRef),
    ])
    .unwrap();
    let props =
        parquet::file::properties::WriterProperties::builder().set_max_row_group_size(group_rows).build();
    let mut buf = Vec::new();
    let mut w = parquet::arrow::ArrowWriter::try_new(&mut buf, batch.schema(), Some(props)).unwrap();
    w.write(&batch).unwrap();
    w.close().unwrap();
    buf
}

/// A Parquet prefix on S3 read by two workers on NATS, row group by row group, one of them
/// killed (SIGKILL) in the middle: the survivor takes its splits over from their committed
/// progress and every row is emitted.
#[test]
fn a_parquet_prefix_on_s3_is_read_by_row_groups_with_no_loss_across_a_kill() {
    let endpoint = endpoint();
    let nats =
        std::env::var("NATS_URL").expect("NATS_URL is not set: run `cargo xtask ci`, which starts NATS");
    let bucket = format!("etl-parquet-{}", std::process::id());
    assert_eq!(http(&endpoint, "PUT", &format!("/{bucket}"), b""), 200, "bucket created");
    let mut objects = Vec::new();
    let mut expected = BTreeSet::new();
    for f in 0..6 {
        let key = format!("input/part-{f}.parquet");
        objects.push((key.clone(), parquet_file(f * 10_000, 1_000, 125)));
        expected.extend((1..=1_000).map(|r| format!("{key}:{r}")));
    }
    objects.push(("input/_SUCCESS".to_owned(), Vec::new()));
    put_all(&endpoint, &bucket, objects);
    let job = format!("s3-parquet-{}", std::process::id());
    let tmp = tempfile::tempdir().unwrap();
    let (sa, sb) = (tmp.path().join("a.jsonl"), tmp.path().join("b.jsonl"));
    let start = |id: &str, sink: &std::path::Path| {
        s3_command(&endpoint, "parquet", &bucket, sink)
            .args(["--store", &nats, "--job", &job, "--instance-id", id])
            // Row groups of 125 rows are about 1.5 KB: a few of them a split.
            .args(["--split-size", "4000", "--record-delay-ms", "3", "--lease-duration", "3s"])
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap()
    };
    let mut a = start("pa", &sa);
    let b = start("pb", &sb);
    let t = std::time::Instant::now();
    while JsonlSink::read(&sa).map(|l| l.len()).unwrap_or(0) < 300 {
        assert!(
            t.elapsed() < std::time::Duration::from_secs(60),
            "the first worker wrote too little in 60 s"
        );
        assert!(a.try_wait().unwrap().is_none(), "the first worker exited early");
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    a.kill().unwrap();
    let _ = a.wait();
    let out = b.wait_with_output().unwrap();
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    let lines: Vec<_> = [&sa, &sb].iter().flat_map(|p| JsonlSink::read(p).unwrap_or_default()).collect();
    let seen: BTreeSet<String> = lines.iter().map(|l| l.record.clone()).collect();
    let missing: Vec<_> = expected.difference(&seen).take(5).collect();
    assert!(missing.is_empty(), "rows never emitted: {missing:?}");
    assert_eq!(seen.len(), expected.len(), "nothing outside the input");
    let splits: BTreeSet<&str> = lines.iter().map(|l| l.split.as_str()).collect();
    assert!(splits.len() >= 6, "row groups packed into several splits: {splits:?}");
}
