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
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_etl-coord"))
        .args(["worker", "--job", "s3", "--split-size", "1000"])
        .arg("--source")
        .arg(format!("files:s3://{bucket}/input/"))
        .arg("--sink")
        .arg(&sink)
        .env("AWS_ENDPOINT_URL", &endpoint)
        .env("AWS_ALLOW_HTTP", "true")
        .env("AWS_REGION", "us-east-1")
        .env("AWS_ACCESS_KEY_ID", "test")
        .env("AWS_SECRET_ACCESS_KEY", "test")
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
