//! One worker partitioned from NATS while its peer is not, with real processes: its link cut
//! (connections closed, new ones refused) or stalled (bytes held, then delivered late and in
//! order), on a single server and on a 3-node cluster with buckets of 3 replicas, and the
//! stream leader's node cut off from the other two nodes. Each job must end complete with no
//! loss, the partitioned worker must self-fence (its lanes stop as starved), and its peer must
//! take its splits over.
//!
//! Needs `NATS_SERVER_BIN` (`cargo xtask ci` provisions it); every test starts its own servers
//! and puts a [`Proxy`] between the partitioned worker and NATS.

mod common;

use std::process::Child;
use std::time::Duration;

use common::{dataset, job, reading_at, records_in, status_json, wait_for_records, worker};
use etl_coord::demo::input_keys;
use etl_coord::sink::JsonlSink;
use etl_coordination_testkit::{Leaders, NatsCluster, NatsServer, Proxy};

/// One test at a time: several clusters and their workers at once on a small machine stretch
/// answers past the op timeout, and the faults are timed against the lease.
fn one_at_a_time() -> std::sync::MutexGuard<'static, ()> {
    static ONE: std::sync::Mutex<()> = std::sync::Mutex::new(());
    ONE.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// How the partitioned worker's link breaks.
#[derive(Clone, Copy, Debug)]
enum Break {
    Cut,
    Stall,
}

impl Break {
    fn apply(self, proxy: &Proxy) {
        match self {
            Break::Cut => proxy.cut(),
            Break::Stall => proxy.stall(),
        }
    }
}

/// The knobs of a run: the lease, and the extra worker flags (replicas on a cluster).
struct Run<'a> {
    lease_secs: u64,
    extra: &'a [&'a str],
}

/// The faults of a run: `prepare` (once both workers work), `partition` (once `pa` works again
/// after `prepare`), `heal` (after the partition lasted two leases and a second, so `pa`'s trust
/// lapsed and its leases expired).
struct Faults<P, C, H> {
    prepare: P,
    partition: C,
    heal: H,
}

/// Worker `pa` reaches NATS at `a_store`, worker `pb` at `b_store`; `partition` and `heal`
/// break and mend `pa`'s link. Checks the outcome and returns both stderr logs.
fn partitioned_run(
    name: &str,
    a_store: &str,
    b_store: &str,
    run: Run<'_>,
    partition: impl FnOnce(),
    heal: impl FnOnce(),
) -> (String, String) {
    partitioned_job(&job(name), a_store, b_store, run, Faults { prepare: || {}, partition, heal })
}

/// [`partitioned_run`] of the job named `job`, with a step before the partition.
fn partitioned_job(
    job: &str,
    a_store: &str,
    b_store: &str,
    run: Run<'_>,
    faults: Faults<impl FnOnce(), impl FnOnce(), impl FnOnce()>,
) -> (String, String) {
    // Six splits of one file each, 15 s of work apiece: every split outlasts the partition, so
    // the partitioned worker's lanes are still running when its trust lapses.
    let (tmp, data) = dataset(6, 600);
    let expected = input_keys(&data).unwrap();
    let lease = format!("{}s", run.lease_secs);
    let mut args = vec!["--record-delay-ms", "25", "--split-size", "30000", "--nats-op-timeout", "1s"];
    args.extend(["--lease-duration", &lease]);
    args.extend(run.extra);
    let (sa, sb) = (tmp.path().join("a.jsonl"), tmp.path().join("b.jsonl"));
    let mut a = worker(job, a_store, "pa", &data, &sa, &args);
    let b = worker(job, b_store, "pb", &data, &sb, &args);
    wait_for_records(&sa, 100, &mut a);
    (faults.prepare)();
    // `pa` still holds splits when its link breaks: it writes records after `prepare`.
    let written = records_written(&sa);
    wait_for_records(&sa, written + 20, &mut a);
    let cut_ms = etl_coord::sink::unix_ms();
    (faults.partition)();
    // The fault's duration, not a wait for a race: past it the partitioned worker must have
    // self-fenced (trust lapses within a lease of its last acknowledged renewal).
    std::thread::sleep(Duration::from_secs(run.lease_secs * 2 + 1));
    (faults.heal)();
    let (a_out, b_out) = (finish(a), finish(b));
    assert_eq!(a_out.0, Some(0), "the partitioned worker ends cleanly: {}", a_out.1);
    assert_eq!(b_out.0, Some(0), "its peer ends cleanly: {}", b_out.1);
    let seen = records_in(&[&sa, &sb]);
    let missing: Vec<_> = expected.difference(&seen).take(5).collect();
    assert!(missing.is_empty(), "records never emitted: {missing:?}");
    let st = status_json(job, b_store);
    let splits = st["splits"].as_array().unwrap();
    assert!(splits.iter().all(|s| s["state"] == "Done"), "{st}");
    assert!(a_out.1.contains("Starved"), "the partitioned worker self-fenced: {}", a_out.1);
    // The peer took over splits the partitioned worker was processing when the link broke.
    let (a_lines, b_lines) = (JsonlSink::read(&sa).unwrap(), JsonlSink::read(&sb).unwrap());
    let held = reading_at(&a_lines, cut_ms);
    let taken = held.iter().filter(|s| b_lines.iter().any(|l| l.split == **s && l.at_ms > cut_ms)).count();
    assert!(taken > 0, "the peer took none of {held:?} over");
    (a_out.1, b_out.1)
}

/// How many records `sink` holds (a line being written is read again).
fn records_written(sink: &std::path::Path) -> usize {
    loop {
        match JsonlSink::read(sink) {
            Ok(lines) => return lines.len(),
            Err(_) => std::thread::sleep(Duration::from_millis(10)),
        }
    }
}

/// Waits for a worker; its exit code and stderr.
fn finish(c: Child) -> (Option<i32>, String) {
    let out = c.wait_with_output().unwrap();
    (out.status.code(), String::from_utf8_lossy(&out.stderr).into_owned())
}

fn single_server(name: &str, how: Break) {
    let _one = one_at_a_time();
    let server = NatsServer::start();
    let proxy = Proxy::start(server.addr());
    let run = Run { lease_secs: 3, extra: &[] };
    partitioned_run(name, &proxy.url(), &server.url(), run, || how.apply(&proxy), || proxy.heal());
}

/// Replicated buckets on a 3-node cluster (docs/NATS.md: a stream leader election takes
/// seconds, so a longer lease than on one server).
const CLUSTER: Run<'static> = Run { lease_secs: 6, extra: &["--nats-replicas", "3"] };

fn cluster_worker_partition(name: &str, how: Break) {
    let _one = one_at_a_time();
    let cluster = NatsCluster::start(3);
    // The partitioned worker knows one node, through the proxy; its peer knows the others.
    let proxy = Proxy::start(cluster.nodes[0].addr());
    let others = format!("{},{}", cluster.nodes[1].url(), cluster.nodes[2].url());
    partitioned_run(name, &proxy.url(), &others, CLUSTER, || how.apply(&proxy), || proxy.heal());
}

#[test]
fn a_worker_whose_link_to_the_server_is_cut_self_fences_and_the_job_completes() {
    single_server("cut", Break::Cut);
}

#[test]
fn a_worker_whose_link_to_the_server_stalls_self_fences_and_the_job_completes() {
    single_server("stall", Break::Stall);
}

#[test]
fn a_worker_cut_off_from_a_cluster_self_fences_and_the_job_completes() {
    cluster_worker_partition("ccut", Break::Cut);
}

#[test]
fn a_worker_whose_link_to_a_cluster_stalls_self_fences_and_the_job_completes() {
    cluster_worker_partition("cstall", Break::Stall);
}

#[test]
fn when_the_lease_streams_leader_node_is_cut_off_a_worker_on_it_self_fences_and_the_job_completes() {
    let _one = one_at_a_time();
    let cluster = NatsCluster::start(3);
    // The partitioned worker knows node 0 only, its peer the other two. Once they work, node 0
    // is made the leader of the job's lease stream and cut off from the other nodes: it loses
    // its quorum, the other two elect a new leader, and the worker on node 0 reaches nobody who
    // can answer.
    let others = format!("{},{}", cluster.nodes[1].url(), cluster.nodes[2].url());
    let name = job("lcut");
    let lease_stream = format!("KV_etl_coordination_{name}_lease");
    let faults = Faults {
        prepare: || cluster.make_leader(&lease_stream, 0),
        partition: || cluster.cut_node(0),
        heal: || cluster.heal_node(0),
    };
    partitioned_job(&name, &cluster.nodes[0].url(), &others, CLUSTER, faults);
}

/// How many store writes (creates and CASes) took longer than `secs` (a bucket boundary of the
/// histogram), from the admin server at `addr`.
fn requests_slower_than(addr: &str, secs: &str) -> f64 {
    let text = common::http_get(addr, "/metrics").expect("the admin server answers");
    let family = "etl_coordination_store_op_duration_seconds";
    let sum = |suffix: &str, le: Option<&str>| -> f64 {
        text.lines()
            .filter(|l| l.starts_with(&format!("{family}{suffix}{{")))
            .filter(|l| l.contains(r#"op="cas""#) || l.contains(r#"op="create""#))
            .filter(|l| le.is_none_or(|b| l.contains(&format!(r#"le="{b}""#))))
            .filter_map(|l| l.rsplit_once(' ').and_then(|(_, v)| v.parse::<f64>().ok()))
            .sum()
    };
    sum("_count", None) - sum("_bucket", Some(secs))
}

#[test]
fn a_request_budget_above_five_seconds_is_honoured_by_the_worker() {
    let _one = one_at_a_time();
    let server = NatsServer::start();
    let proxy = Proxy::start(server.addr());
    let (tmp, data) = dataset(2, 400);
    let expected = input_keys(&data).unwrap();
    let sink = tmp.path().join("a.jsonl");
    let admin = common::free_addr();
    let args = [
        "--record-delay-ms",
        "25",
        "--nats-op-timeout",
        "30s",
        "--lease-duration",
        "60s",
        "--on-complete",
        "wait",
        "--admin-addr",
        &admin,
    ];
    let mut a = worker(&job("budget"), &proxy.url(), "pa", &data, &sink, &args);
    wait_for_records(&sink, 50, &mut a);
    // Every answer is held for 12 s: a worker that waits up to its 30 s budget gets them all
    // (a 5 s cap, the driver's or the JetStream context's wait for publish acknowledgements,
    // would have timed each write out and never seen one take more than 10 s).
    proxy.stall();
    std::thread::sleep(Duration::from_secs(12));
    proxy.heal();
    common::wait_for_metric(&[&admin], "etl_coordination_job_state", r#"state="complete"}"#, 1.0);
    let slow = requests_slower_than(&admin, "10");
    let _ = std::process::Command::new("kill").args(["-TERM", &a.id().to_string()]).status();
    let (code, err) = finish(a);
    assert!(slow >= 1.0, "no write was waited for beyond 10 s: {err}");
    assert_eq!(code, Some(0), "{err}");
    let missing: Vec<_> = expected.difference(&records_in(&[&sink])).take(5).cloned().collect();
    assert!(missing.is_empty(), "records never emitted: {missing:?}");
}
