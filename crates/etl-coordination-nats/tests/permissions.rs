//! A job's generated permissions ([`permissions`]) against a server that grants its users
//! nothing else: every kind of request the backend makes works with them (flow control and a
//! server restart included), each entry a run uses is needed, another job's buckets stay out of
//! reach, and refused credentials or permissions fail at once naming what to fix. (Two entries
//! no test here could force are granted from reading the client: an ordered consumer that
//! recreates itself, after a reconnect it notices or a gap, deletes its consumer and creates a
//! named one. Neither a server restart nor a cut client link made it do so here: the first
//! ended the watch with a missed heartbeat, the second resubscribed to the same consumer.)
//!
//! Needs `NATS_SERVER_BIN` (`cargo xtask ci` provisions it); each test starts its own server.

use std::time::Duration;

use bytes::Bytes;
use etl_coordination_core::{JobName, Key, Prefix, StoreError, WatchEvent};
use etl_coordination_nats::{
    Access, NatsAuth, NatsConfig, NatsJob, Permissions, bucket_names, connect, permissions,
};
use etl_coordination_store::Store;
use etl_coordination_testkit::NatsServer;
use futures_util::StreamExt;

fn job(name: &str) -> JobName {
    JobName::new(name.to_owned()).unwrap()
}

/// A user entry of a server's `authorization.users`; `None` permissions: allowed everything.
fn user(name: &str, perms: Option<&Permissions>) -> String {
    let list = |l: &[String]| l.iter().map(|s| format!("{s:?}")).collect::<Vec<_>>().join(", ");
    match perms {
        None => format!("{{ user: {name:?}, password: \"pw\" }}"),
        Some(p) => format!(
            "{{ user: {name:?}, password: \"pw\", permissions: {{ publish: {{ allow: [{}] }}, subscribe: {{ allow: [{}] }} }} }}",
            list(&p.publish),
            list(&p.subscribe)
        ),
    }
}

/// A server whose users are `admin` (everything) and `users`.
fn server(users: &[String]) -> NatsServer {
    let all: Vec<String> = std::iter::once(user("admin", None)).chain(users.iter().cloned()).collect();
    NatsServer::start_with(&format!("authorization {{ users: [ {} ] }}", all.join(", ")))
}

fn config(server: &NatsServer, name: &str) -> NatsConfig {
    let mut c = NatsConfig::new(server.url());
    // Long: a refusal must end a request at once, not by timing out (the tests tell the two
    // apart by a bound well under this).
    c.op_timeout = Duration::from_secs(20);
    c.auth = NatsAuth::UserPassword(name.to_owned(), "pw".to_owned());
    c
}

/// The job's buckets, created by `admin`.
async fn create_buckets(server: &NatsServer, j: &JobName) -> NatsJob {
    let job = connect(&config(server, "admin"), j).await.expect("admin creates the buckets");
    assert_eq!(job.created, bucket_names(j).to_vec());
    job
}

/// `p` without the entries containing `needle`.
fn without(p: &Permissions, needle: &str) -> Permissions {
    let keep = |l: &[String]| l.iter().filter(|s| !s.contains(needle)).cloned().collect();
    Permissions { publish: keep(&p.publish), subscribe: keep(&p.subscribe) }
}

fn setup_error(r: Result<impl std::fmt::Debug, StoreError>) -> String {
    match r {
        Err(StoreError::Setup(msg)) => msg,
        other => panic!("expected a setup error, got {other:?}"),
    }
}

/// Writes `n` state records of 2 KiB (enough that a listing needs flow control).
async fn fill(job: &NatsJob, n: usize) {
    let value = Bytes::from(vec![b'x'; 2048]);
    for i in 0..n {
        job.state.create(&Key::new(format!("split.{i:05}")).unwrap(), value.clone(), None).await.unwrap();
    }
}

#[tokio::test]
async fn a_job_s_user_runs_every_request_kind_and_needs_no_create_permission() {
    let j = job("perm");
    let server = server(&[user("worker", Some(&permissions(&j, Access::Use)))]);
    let admin = create_buckets(&server, &j).await;
    fill(&admin, 3000).await;
    let mut cfg = config(&server, "worker");
    cfg.create_buckets = false;
    let w = connect(&cfg, &j).await.expect("the worker opens the existing buckets");
    assert!(w.created.is_empty());
    let listed = w.state.list(&Prefix::new("split.").unwrap()).await.unwrap();
    assert_eq!(listed.len(), 3000, "a listing that needs flow-control replies");
    let k = Key::new("lease.a").unwrap();
    let rev = w.lease.create(&k, Bytes::from_static(b"v"), Some(Duration::from_secs(30))).await.unwrap();
    let rev = w
        .lease
        .compare_and_swap(&k, rev, Bytes::from_static(b"w"), Some(Duration::from_secs(30)))
        .await
        .unwrap();
    assert_eq!(w.lease.get(&k).await.unwrap().unwrap().value, Bytes::from_static(b"w"));
    w.lease.delete(&k, rev).await.unwrap();
    assert!(!server.log().contains("Violation"), "nothing refused:\n{}", server.log());
}

#[tokio::test]
async fn after_a_server_restart_the_job_s_watches_resume_without_a_refusal() {
    let j = job("restart");
    let mut server = server(&[user("worker", Some(&permissions(&j, Access::Use)))]);
    let admin = create_buckets(&server, &j).await;
    let prefix = Prefix::new("split.").unwrap();
    let store = connect(&config(&server, "worker"), &j).await.unwrap().state;
    let mut w = store.watch(&prefix).await.unwrap();
    assert!(matches!(w.next().await, Some(Ok(WatchEvent::SnapshotComplete))));
    // Every client reconnects. The ordered consumer either recreates itself (deleting the old
    // consumer, creating a named one) or ends with a missed heartbeat; the driver then opens a
    // new watch. Neither may be refused.
    server.kill();
    server.restart();
    let k = Key::new("split.late").unwrap();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while admin.state.create(&k, Bytes::from_static(b"v"), None).await.is_err() {
        assert!(tokio::time::Instant::now() < deadline, "the admin could not write after the restart");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    match tokio::time::timeout(Duration::from_secs(30), w.next()).await {
        Ok(Some(Ok(WatchEvent::Put(e)))) => assert_eq!(e.key, k),
        Ok(Some(Err(StoreError::Unavailable(_)))) => {
            let mut again = store.watch(&prefix).await.unwrap();
            assert!(matches!(again.next().await, Some(Ok(WatchEvent::Put(e))) if e.key == k));
        }
        other => panic!("{other:?}\n{}", server.log()),
    }
    assert!(!server.log().contains("Violation"), "nothing refused:\n{}", server.log());
}

#[tokio::test]
async fn each_permission_is_needed_and_its_absence_is_named() {
    let j = job("narrow");
    let full = permissions(&j, Access::Use);
    // Entries every connection uses at start; the request that needs each fails naming it.
    let probes = [
        "$JS.API.INFO",
        "$JS.API.STREAM.INFO.KV_etl_coordination_narrow_lease",
        "$JS.API.STREAM.MSG.GET.KV_etl_coordination_narrow_state",
        "$JS.API.CONSUMER.CREATE.KV_etl_coordination_narrow_lease",
        "$KV.etl_coordination_narrow_state.>",
    ];
    let users: Vec<String> = probes
        .iter()
        .enumerate()
        .map(|(i, entry)| user(&format!("u{i}"), Some(&without(&full, entry))))
        .chain([
            user("nofc", Some(&without(&full, "$JS.FC.KV_etl_coordination_narrow_state"))),
            user("noinbox", Some(&Permissions { subscribe: vec!["_INBOX.>".into()], ..full.clone() })),
        ])
        .collect();
    let server = server(&users);
    let admin = create_buckets(&server, &j).await;
    for (i, entry) in probes.iter().enumerate() {
        let t = std::time::Instant::now();
        let msg = setup_error(connect(&config(&server, &format!("u{i}")), &j).await);
        assert!(
            msg.contains(&format!("allow {entry:?}")) && msg.contains("nats-permissions --job narrow"),
            "{msg}"
        );
        assert!(
            t.elapsed() < Duration::from_secs(2),
            "refused at once, not after a timeout: {:?}",
            t.elapsed()
        );
    }
    let msg = setup_error(connect(&config(&server, "noinbox"), &j).await);
    assert!(msg.contains("subscribe") && msg.contains("_INBOX_etl_coordination_narrow.>"), "{msg}");
    // Flow control only shows in a listing large enough to need it: the listing fails naming it.
    fill(&admin, 3000).await;
    let w = connect(&config(&server, "nofc"), &j).await.expect("start needs no flow control");
    let msg = setup_error(w.state.list(&Prefix::new("split.").unwrap()).await);
    assert!(msg.contains("allow \"$JS.FC.KV_etl_coordination_narrow_state.>\""), "{msg}");
}

#[tokio::test]
async fn a_job_s_user_cannot_reach_another_job_and_a_missing_bucket_says_how_to_create_it() {
    let (a, b) = (job("joba"), job("jobb"));
    let server = server(&[user("a", Some(&permissions(&a, Access::Use)))]);
    let b_admin = create_buckets(&server, &b).await;
    let k = Key::new("split.x").unwrap();
    let rev = b_admin.state.create(&k, Bytes::from_static(b"b's record"), None).await.unwrap();
    // a's buckets do not exist yet, and a may not create them.
    let msg = setup_error(connect(&config(&server, "a"), &a).await);
    assert!(msg.contains("does not exist") && msg.contains("nats-buckets --job joba"), "{msg}");
    // With create_buckets off the answer is the same without asking the server to create.
    let mut cfg = config(&server, "a");
    cfg.create_buckets = false;
    let msg = setup_error(connect(&cfg, &a).await);
    assert!(msg.contains("does not exist") && msg.contains("nats-buckets --job joba"), "{msg}");
    // Opening b's buckets with a's credentials is refused, naming the subject.
    let msg = setup_error(connect(&config(&server, "a"), &b).await);
    assert!(msg.contains("denied user \"a\"") && msg.contains("etl_coordination_jobb"), "{msg}");
    // A raw client with a's credentials can neither write b's keys nor read b's replies.
    let client = async_nats::ConnectOptions::with_user_and_password("a".into(), "pw".into())
        .connect(server.url())
        .await
        .unwrap();
    client.publish("$KV.etl_coordination_jobb_state.split.x", "overwritten".into()).await.unwrap();
    let sub = client.subscribe("$KV.etl_coordination_jobb_state.>").await;
    let inbox = client.subscribe("_INBOX_etl_coordination_jobb.>").await;
    client.flush().await.unwrap();
    let refused = [
        "Publish Violation - User \"a\", Subject \"$KV.etl_coordination_jobb_state.split.x\"",
        "Subscription Violation - User \"a\", Subject \"$KV.etl_coordination_jobb_state.>\"",
        "Subscription Violation - User \"a\", Subject \"_INBOX_etl_coordination_jobb.>\"",
    ];
    let t = std::time::Instant::now();
    while !refused.iter().all(|r| server.log().contains(r)) {
        assert!(t.elapsed() < Duration::from_secs(10), "{sub:?} {inbox:?} refused:\n{}", server.log());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let e = b_admin.state.get(&k).await.unwrap().unwrap();
    assert_eq!((e.value, e.revision), (Bytes::from_static(b"b's record"), rev), "b untouched");
}

#[tokio::test]
async fn missing_or_wrong_credentials_are_refused_at_once_saying_what_to_give() {
    let j = job("creds");
    let server = server(&[user("w", Some(&permissions(&j, Access::Use)))]);
    let mut none = config(&server, "w");
    none.auth = NatsAuth::None;
    let t = std::time::Instant::now();
    let msg = setup_error(connect(&none, &j).await);
    assert!(msg.contains("refused the connection's credentials (no credentials given)"), "{msg}");
    let mut wrong = config(&server, "w");
    wrong.auth = NatsAuth::UserPassword("w".into(), "not-the-password".into());
    let msg = setup_error(connect(&wrong, &j).await);
    assert!(msg.contains("(user \"w\")") && msg.contains("job creds's credentials"), "{msg}");
    assert!(t.elapsed() < Duration::from_secs(10), "final at once, not after retries: {:?}", t.elapsed());
}

/// Publishes a value to `key` of `bucket` with `Nats-Rollup: all` as `user` (a raw client with
/// the job's reply prefix, as an attacker holding that user's credentials would): the server's
/// answer, or its refusal.
async fn rollup(server: &NatsServer, user: &str, j: &JobName, bucket: &str, key: &str) -> Result<(), String> {
    let client = async_nats::ConnectOptions::with_user_and_password(user.to_owned(), "pw".to_owned())
        .custom_inbox_prefix(etl_coordination_nats::inbox_prefix(j))
        .connect(server.url())
        .await
        .unwrap();
    let js = async_nats::jetstream::new(client);
    let mut headers = async_nats::HeaderMap::new();
    headers.insert("Nats-Rollup", "all");
    let sent = js
        .publish_with_headers(format!("$KV.{bucket}.{key}"), headers, Bytes::from_static(b"all yours"))
        .await
        .map_err(|e| e.to_string())?;
    sent.await.map(|_| ()).map_err(|e| e.to_string())
}

#[tokio::test]
async fn a_rollup_on_the_state_bucket_is_refused_and_an_earlier_release_s_bucket_is_closed_by_its_set_up_user()
 {
    let (j, old) = (job("rollup"), job("rollupold"));
    let server = server(&[
        user("worker", Some(&permissions(&j, Access::Use))),
        user("oldworker", Some(&permissions(&old, Access::Use))),
        user("oldsetup", Some(&permissions(&old, Access::Create))),
    ]);
    // A bucket of this release: the worker's credentials may write its keys, but a rollup (which
    // would replace every record with one message) is refused by the stream itself.
    let admin = create_buckets(&server, &j).await;
    assert!(!admin.state.accepts_rollups() && admin.lease.accepts_rollups());
    fill(&admin, 3).await;
    let [state, _] = bucket_names(&j);
    let err = rollup(&server, "worker", &j, &state, "split.00001").await.expect_err("refused");
    assert!(err.to_lowercase().contains("rollup"), "{err}");
    let listed = admin.state.list(&Prefix::new("split.").unwrap()).await.unwrap();
    assert_eq!(listed.len(), 3, "nothing replaced");
    // A state bucket as an earlier release created it (create_key_value allows rollups): the
    // same message erases the job's records, until its set-up user closes it.
    let [old_state, _] = bucket_names(&old);
    let raw = async_nats::ConnectOptions::with_user_and_password("admin".into(), "pw".into())
        .connect(server.url())
        .await
        .unwrap();
    let kv =
        async_nats::jetstream::kv::Config { bucket: old_state.clone(), history: 1, ..Default::default() };
    async_nats::jetstream::new(raw).create_key_value(kv).await.unwrap();
    let admin = connect(&config(&server, "admin"), &old).await.unwrap();
    assert!(admin.state.accepts_rollups(), "an earlier release's bucket is reported open");
    fill(&admin, 3).await;
    rollup(&server, "oldworker", &old, &old_state, "split.00001").await.expect("accepted: the hole");
    let listed = admin.state.list(&Prefix::new("split.").unwrap()).await.unwrap();
    assert_eq!(listed.len(), 1, "one message replaced every record");
    // A worker cannot change the stream; the set-up user can.
    let mut cfg = config(&server, "oldworker");
    cfg.create_buckets = false;
    let mut w = connect(&cfg, &old).await.unwrap();
    let err =
        format!("{:?}", w.state.refuse_rollups().await.expect_err("a worker may not update the stream"));
    assert!(
        err.contains("STREAM.UPDATE") && err.contains("nats-permissions --job rollupold --create"),
        "{err}"
    );
    let mut setup = connect(&config(&server, "oldsetup"), &old).await.unwrap();
    setup.state.refuse_rollups().await.expect("the set-up user closes it");
    assert!(!setup.state.accepts_rollups());
    for k in ["split.x0", "split.x1"] {
        admin.state.create(&Key::new(k).unwrap(), Bytes::from_static(b"v"), None).await.unwrap();
    }
    let err = rollup(&server, "oldworker", &old, &old_state, "split.00002").await.expect_err("refused now");
    assert!(err.to_lowercase().contains("rollup"), "{err}");
    assert_eq!(admin.state.list(&Prefix::new("split.").unwrap()).await.unwrap().len(), 3);
    // Reopened, it says so.
    assert!(!connect(&cfg, &old).await.unwrap().state.accepts_rollups());
    // The lease bucket's expiry markers are rollups: it is never closed.
    assert!(setup.lease.refuse_rollups().await.is_err());
}
