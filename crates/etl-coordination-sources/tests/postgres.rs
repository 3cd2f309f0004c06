//! The PostgreSQL source against a real server each test starts (Debian's PostgreSQL, as the
//! benchmark's peer; `cargo xtask ci` installs it when missing).
#![cfg(feature = "postgres")]

use std::collections::BTreeSet;

use etl_coordination_driver::{
    Epoch, InstanceId, LaneInfo, PlanKind, PlannedSplit, Planner, Source, SplitId, SplitReader,
};
use etl_coordination_sources::keyrange::IdRange;
use etl_coordination_sources::postgres::{PostgresError, PostgresSource};
use etl_coordination_testkit::PgServer;

fn lane(split: &PlannedSplit) -> LaneInfo {
    LaneInfo::new(split.id.clone(), Epoch(1), InstanceId::new("t").unwrap(), split.descriptor.clone(), 1)
}

/// Every row of `split` from `from` on: (key, content).
async fn read<S>(src: &S, split: &PlannedSplit, from: Option<i64>) -> Vec<(i64, String)>
where
    S: Source<Progress = i64, Record = etl_coordination_sources::Line>,
{
    let mut r = src.open(&lane(split), from).await.unwrap();
    let mut out = Vec::new();
    while let Some((line, key)) = r.next().await.unwrap() {
        assert_eq!(line.key.rsplit_once(':').unwrap().1, key.to_string());
        out.push((key, line.content));
    }
    out
}

#[tokio::test]
async fn a_million_rows_of_skewed_ids_plan_into_ranges_of_equal_rows() {
    let pg = PgServer::start();
    // A dense run, a sparse run a billion further, and quadratic gaps up to ~10^18: min..max
    // arithmetic would put nearly every row in the first range.
    pg.psql(
        "CREATE TABLE skew (id bigint PRIMARY KEY, v text);
         INSERT INTO skew SELECT CASE WHEN g <= 600000 THEN g
                                      WHEN g <= 900000 THEN 1000000000 + g * 1000
                                      ELSE g * g * 100000 END, 'r' || g
         FROM generate_series(1::bigint, 1000000) g;",
    );
    let src = PostgresSource::connect(&pg.url(), "skew", "id", 100_000).await.unwrap();
    let plan = src.plan().await.unwrap();
    assert_eq!(plan.kind, PlanKind::Final);
    let ranges: Vec<IdRange> =
        plan.splits.iter().map(|s| serde_json::from_slice(&s.descriptor).unwrap()).collect();
    let counts: Vec<i64> = ranges
        .iter()
        .map(|r| {
            pg.psql(&format!("SELECT count(*) FROM skew WHERE id >= {} AND id <= {}", r.lo, r.last_key()))
                .parse()
                .unwrap()
        })
        .collect();
    assert_eq!(counts.iter().sum::<i64>(), 1_000_000, "every row in a range: {counts:?}");
    assert!(ranges.windows(2).all(|w| w[0].hi <= w[1].lo), "disjoint, in order: {ranges:?}");
    let mean = 1_000_000.0 / counts.len() as f64;
    for (c, s) in counts.iter().zip(&plan.splits) {
        assert!((*c as f64 - mean).abs() <= mean * 0.1, "{c} rows against a mean of {mean}: {counts:?}");
        assert_eq!(s.weight, *c as u64, "the weight is the row count");
    }
}

#[tokio::test]
async fn the_common_types_become_faithful_json_and_typed_rows() {
    let pg = PgServer::start();
    pg.psql(
        r#"CREATE TABLE typed (id int PRIMARY KEY, i2 smallint, i8 bigint, n numeric(30,10), f float8,
             t text, b bool, ts timestamptz, tsn timestamp, d date, j json, jb jsonb, by bytea,
             ai int[], at text[], an numeric[], nul text, "Odd ""Name""" text);
           INSERT INTO typed VALUES (1, -3, 9007199254740993, 12345678901234567890.0123456789, 1.5,
             'héllo "q"', true, '2024-05-01 14:00:00+02', '2024-05-01 12:00:00', '2024-05-01',
             '{"a":[1,2]}', '{"b":null}', '\x00ff10', '{1,NULL,3}', '{"x","y z"}', '{1.50,2}', NULL,
             'null');
           INSERT INTO typed (id, by) VALUES (2, decode(repeat('ab', 100), 'hex'));"#,
    );
    let src = PostgresSource::connect(&pg.url(), "public.typed", "id", 10).await.unwrap();
    assert_eq!(src.table(), "typed");
    let split = src.plan().await.unwrap().splits.remove(0);
    let rows = read(&src, &split, None).await;
    let first: serde_json::Value = serde_json::from_str(&rows[0].1).unwrap();
    assert_eq!(
        first,
        serde_json::json!({
            "id": 1, "i2": -3, "i8": 9007199254740993i64, "n": "12345678901234567890.0123456789",
            "f": 1.5, "t": "héllo \"q\"", "b": true, "ts": "2024-05-01T12:00:00+00:00",
            "tsn": "2024-05-01T12:00:00", "d": "2024-05-01", "j": {"a": [1, 2]}, "jb": {"b": null},
            "by": "AP8Q", "ai": [1, null, 3], "at": ["x", "y z"], "an": ["1.50", "2"], "nul": null,
            "Odd \"Name\"": "null"
        })
    );
    let second: serde_json::Value = serde_json::from_str(&rows[1].1).unwrap();
    let long = second["by"].as_str().unwrap();
    assert!(!long.contains('\n') && long.len() == 136, "base64 without line breaks: {long}");

    #[derive(serde::Deserialize, Debug, PartialEq)]
    struct Row {
        id: i32,
        t: Option<String>,
        n: Option<String>,
    }
    let typed = src.clone().typed::<Row>();
    let mut r = typed.open(&lane(&split), None).await.unwrap();
    let (row, key) = r.next().await.unwrap().unwrap();
    assert_eq!(
        (row, key),
        (Row { id: 1, t: Some("héllo \"q\"".into()), n: Some("12345678901234567890.0123456789".into()) }, 1)
    );
    #[derive(serde::Deserialize, Debug)]
    #[allow(dead_code)]
    struct Wrong {
        id: String,
    }
    let mut r = src.typed::<Wrong>().open(&lane(&split), None).await.unwrap();
    let err = r.next().await.unwrap_err();
    assert!(err.to_string().contains("typed:1"), "a bad record names its row: {err}");
}

#[tokio::test]
async fn a_reader_resumes_after_its_last_key_and_follow_mode_adds_new_rows_once() {
    let pg = PgServer::start();
    pg.psql(
        "CREATE TABLE ev (seq bigint NOT NULL, body text); CREATE UNIQUE INDEX ON ev (seq);
             INSERT INTO ev SELECT g * 7 - 500, 'e' || g FROM generate_series(1, 250) g;",
    );
    let src =
        PostgresSource::connect(&pg.url(), "ev", "seq", 100).await.unwrap().follow().batch_rows(30).unwrap();
    // A new leader's first round only looks (see the out-of-order test below).
    let look = src.replan(&[]).await.unwrap();
    assert_eq!(look.kind, PlanKind::Open);
    assert!(look.splits.is_empty(), "the first round plans nothing");
    let first = src.replan(&[]).await.unwrap();
    assert_eq!(first.splits.iter().map(|s| s.weight).collect::<Vec<_>>(), vec![100, 100, 50]);
    let all = read(&src, &first.splits[0], None).await;
    assert_eq!(all.len(), 100);
    let rest = read(&src, &first.splits[0], Some(all[41].0)).await;
    assert_eq!(rest, all[42..].to_vec(), "a resume starts after the committed key, across batches");
    pg.psql("INSERT INTO ev SELECT g * 7 - 500, 'e' || g FROM generate_series(251, 420) g;");
    let published: Vec<SplitId> = first.splits.iter().map(|s| s.id.clone()).collect();
    assert!(src.replan(&published).await.unwrap().splits.is_empty(), "seen, not planned yet");
    let second = src.replan(&published).await.unwrap();
    assert!(second.splits.iter().all(|s| !published.contains(&s.id)));
    let mut keys = Vec::new();
    for s in first.splits.iter().chain(&second.splits) {
        keys.extend(read(&src, s, None).await.into_iter().map(|(k, _)| k));
    }
    let unique: BTreeSet<i64> = keys.iter().copied().collect();
    assert_eq!((keys.len(), unique.len()), (420, 420), "every row once");
    let all_ids: Vec<SplitId> =
        published.into_iter().chain(second.splits.iter().map(|s| s.id.clone())).collect();
    assert!(src.replan(&all_ids).await.unwrap().splits.is_empty(), "nothing new, nothing planned");
}

#[tokio::test]
async fn a_connection_lost_mid_split_is_an_outage_and_the_read_goes_on_where_it_was() {
    let pg = PgServer::start();
    pg.psql("CREATE TABLE t (id int PRIMARY KEY); INSERT INTO t SELECT generate_series(1, 100);");
    let src = PostgresSource::connect(&pg.url(), "t", "id", 1000).await.unwrap().batch_rows(10).unwrap();
    let split = src.plan().await.unwrap().splits.remove(0);
    let mut r = src.open(&lane(&split), None).await.unwrap();
    let mut keys = Vec::new();
    for _ in 0..15 {
        keys.push(r.next().await.unwrap().unwrap().1);
    }
    // The server ends every other backend: the reader's connection is gone.
    pg.psql("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE pid <> pg_backend_pid() AND backend_type = 'client backend'");
    let mut outages = 0;
    loop {
        match r.next().await {
            Ok(Some((_, k))) => keys.push(k),
            Ok(None) => break,
            Err(e) => {
                assert!(e.is_transient(), "a lost connection is an outage, retried in place: {e}");
                outages += 1;
            }
        }
    }
    assert!(outages >= 1, "the next batch met the lost connection");
    assert_eq!(keys, (1..=100).collect::<Vec<i64>>(), "nothing lost or read twice");
}

#[tokio::test]
async fn what_cannot_work_is_refused_saying_what_to_do() {
    let pg = PgServer::start();
    pg.psql(
        "CREATE TABLE texty (code text PRIMARY KEY);
         CREATE TABLE loose (id int NOT NULL);
         CREATE TABLE secret (id int PRIMARY KEY);
         CREATE ROLE reader LOGIN PASSWORD 'r';",
    );
    let err = |e: PostgresError| e.to_string();
    let url = pg.url();
    let e = err(PostgresSource::connect(&url, "nope", "id", 10).await.unwrap_err());
    assert!(e.contains("\"nope\" does not exist"), "{e}");
    let e = err(PostgresSource::connect(&url, "texty", "code", 10).await.unwrap_err());
    assert!(e.contains("is of type text") && e.contains("--key-column"), "{e}");
    let e = err(PostgresSource::connect(&url, "texty", "id", 10).await.unwrap_err());
    assert!(e.contains("no such column"), "{e}");
    let e = err(PostgresSource::connect(&url, "loose", "id", 10).await.unwrap_err());
    assert!(e.contains("unique index") && e.contains("CREATE UNIQUE INDEX"), "{e}");
    let e = err(PostgresSource::connect(&pg.url_as("reader", "r"), "secret", "id", 10).await.unwrap_err());
    assert!(e.contains("may not SELECT") && e.contains("GRANT SELECT ON secret TO reader"), "{e}");
    let e =
        err(PostgresSource::connect(&pg.url_as("reader", "wrong"), "secret", "id", 10).await.unwrap_err());
    assert!(e.contains("refused user \"reader\"") && e.contains("password"), "{e}");
    assert!(!e.contains("wrong"), "the password is not echoed: {e}");
    let e = err(PostgresSource::connect("postgres://x@127.0.0.1:1/db?sslmode=require", "t", "id", 10)
        .await
        .unwrap_err());
    assert!(e.contains("TLS"), "{e}");
    let e = err(PostgresSource::connect("postgres://x@127.0.0.1:1/db", "t", "id", 10).await.unwrap_err());
    assert!(e.contains("cannot connect") && e.contains("127.0.0.1:1/db"), "{e}");
}

/// With a sequence, a transaction may commit key 101 while the one holding 100 is still open: a
/// follow round must not plan past 100 until it has ended, or 100 would never be read.
#[tokio::test]
async fn follow_mode_waits_for_a_transaction_holding_a_lower_key() {
    let pg = PgServer::start();
    pg.psql(
        "CREATE TABLE seq (id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY, v text);
             INSERT INTO seq (v) SELECT 'a' FROM generate_series(1, 10);",
    );
    let src = PostgresSource::connect(&pg.url(), "seq", "id", 1000).await.unwrap().follow();
    assert!(src.replan(&[]).await.unwrap().splits.is_empty());
    let first = src.replan(&[]).await.unwrap();
    assert_eq!(first.splits.iter().map(|s| s.weight).sum::<u64>(), 10);
    let mut published: Vec<SplitId> = first.splits.iter().map(|s| s.id.clone()).collect();
    // A transaction takes key 11 and stays open; another commits key 12.
    let (mut open, conn) = tokio_postgres::connect(&pg.url(), tokio_postgres::NoTls).await.unwrap();
    tokio::spawn(conn);
    let slow = open.transaction().await.unwrap();
    slow.execute("INSERT INTO seq (v) VALUES ('slow')", &[]).await.unwrap();
    pg.psql("INSERT INTO seq (v) VALUES ('fast')");
    for round in 0..3 {
        let plan = src.replan(&published).await.unwrap();
        assert!(plan.splits.is_empty(), "round {round}: planned past an open transaction: {:?}", plan.splits);
    }
    slow.commit().await.unwrap();
    let mut keys = Vec::new();
    for _ in 0..3 {
        let plan = src.replan(&published).await.unwrap();
        for s in &plan.splits {
            keys.extend(read(&src, s, None).await.into_iter().map(|(k, _)| k));
            published.push(s.id.clone());
        }
    }
    keys.sort();
    assert_eq!(keys, vec![11, 12], "both rows, once the slow one committed");
}

#[tokio::test]
async fn keys_at_the_ends_of_bigint_and_domains_are_read_faithfully() {
    let pg = PgServer::start();
    pg.psql(
        "CREATE DOMAIN money_exact AS numeric(20,4);
         CREATE TABLE ends (id bigint PRIMARY KEY, amount money_exact);
         INSERT INTO ends VALUES (-9223372036854775808, 1.5), (0, 2), (9223372036854775807, 3.25);",
    );
    let src = PostgresSource::connect(&pg.url(), "ends", "id", 2).await.unwrap();
    let mut rows = Vec::new();
    for s in src.plan().await.unwrap().splits {
        rows.extend(read(&src, &s, None).await);
    }
    let keys: Vec<i64> = rows.iter().map(|r| r.0).collect();
    assert_eq!(keys, vec![i64::MIN, 0, i64::MAX], "the smallest and largest keys are read");
    let first: serde_json::Value = serde_json::from_str(&rows[0].1).unwrap();
    assert_eq!(first["amount"], "1.5000", "a numeric domain is a string too");
}

#[tokio::test]
async fn a_key_that_may_be_null_is_refused() {
    let pg = PgServer::start();
    pg.psql("CREATE TABLE n (k bigint UNIQUE);");
    let e = PostgresSource::connect(&pg.url(), "n", "k", 10).await.unwrap_err().to_string();
    assert!(e.contains("NULL") && e.contains("SET NOT NULL"), "{e}");
}
