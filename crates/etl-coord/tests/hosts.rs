//! Partitions between hosts: a 3-node NATS cluster (buckets of 3 replicas) and the workers, each
//! in a container of its own on a Docker engine, so a fault cuts real network paths (no proxy in
//! between): the lease stream leader's node cut off from the other two while workers on both
//! sides keep running; a worker container cut off from every node; a node paused past a lease
//! and resumed. Each job must end complete with no record lost.
//!
//! Each test prints its timings on a line starting `hosts timing:` (the takeover latency, and
//! the longest time without a successful write seen by a prober on the majority side).
//!
//! Ignored by `cargo test`: it needs a Docker engine and two images, which the container path
//! of `cargo xtask itest` provides (`HOSTS_NATS_IMAGE`, `HOSTS_WORKER_IMAGE`) before it runs
//! this suite with `--ignored`.

mod common;

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::{dataset, job, reading_at, records_in, status_json};
use etl_coord::demo::input_keys;
use etl_coord::sink::{JsonlSink, unix_ms};
use etl_coordination_testkit::Leaders;
use etl_coordination_testkit::docker::{Container, DockerCluster, image, unique};

/// The lease: as on the process cluster (docs/NATS.md: a stream leader election takes seconds).
const LEASE_SECS: u64 = 6;

/// One test at a time: a cluster and its workers at once is what this machine holds, and the
/// faults are timed against the lease.
fn one_at_a_time() -> std::sync::MutexGuard<'static, ()> {
    static ONE: std::sync::Mutex<()> = std::sync::Mutex::new(());
    ONE.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// The input (world-readable: the image runs as an unprivileged user) and a directory the
/// workers' sinks write to.
struct Files {
    _tmp: tempfile::TempDir,
    data: PathBuf,
    out: PathBuf,
}

fn files() -> Files {
    use std::os::unix::fs::PermissionsExt;
    // Six splits of one file each, 15 s of work apiece: every split outlasts the fault.
    let (tmp, data) = dataset(6, 600);
    let out = tmp.path().join("out");
    std::fs::create_dir(&out).unwrap();
    std::fs::set_permissions(tmp.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    std::fs::set_permissions(&out, std::fs::Permissions::from_mode(0o777)).unwrap();
    Files { _tmp: tmp, data, out }
}

/// An `etl-coord worker` container of `job` on the cluster's client network, reaching the
/// nodes in `store`; its sink is `out/ID.jsonl`.
fn worker(cluster: &DockerCluster, files: &Files, job: &str, id: &str, store: &str) -> Container {
    let input = format!("{}:/input:ro", files.data.display());
    let out = format!("{}:/out", files.out.display());
    let sink = format!("/out/{id}.jsonl");
    let lease = format!("{LEASE_SECS}s");
    Container::run(
        &unique(id),
        &[
            "--network",
            &cluster.clients.name,
            "-v",
            &input,
            "-v",
            &out,
            &image("HOSTS_WORKER_IMAGE"),
            "worker",
            "--job",
            job,
            "--store",
            store,
            "--instance-id",
            id,
            "--source",
            "files:/input",
            "--sink",
            &sink,
            "--lease-duration",
            &lease,
            "--nats-replicas",
            "3",
            "--nats-op-timeout",
            "1s",
            "--record-delay-ms",
            "25",
            "--split-size",
            "30000",
        ],
    )
}

/// How many records `sink` holds (a line being written is read again).
fn held(sink: &Path) -> usize {
    for _ in 0..100 {
        match JsonlSink::read(sink) {
            Ok(lines) => return lines.len(),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return 0,
            Err(_) => std::thread::sleep(Duration::from_millis(10)),
        }
    }
    panic!("{} cannot be read", sink.display())
}

/// Waits until `sink` holds `n` records; fails with the container's logs if it exits first or
/// the records are not there within 90 s.
fn wait_for_records(sink: &Path, n: usize, writer: &Container) {
    let t = Instant::now();
    while held(sink) < n {
        if let Some(code) = writer.wait(Duration::ZERO) {
            panic!("{} exited ({code}) before {n} records: {}", writer.name, writer.logs());
        }
        assert!(
            t.elapsed() < Duration::from_secs(90),
            "{} holds fewer than {n} records: {}",
            sink.display(),
            writer.logs()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Writes to a replicated bucket of its own every 100 ms from the host, through the nodes it is
/// given (the majority side), so a test can say how long the cluster took no writes there; the
/// test moves the bucket's stream leader to the node it cuts off, as it does the job's lease
/// stream. Stopped when dropped.
struct Prober {
    stop: Arc<AtomicBool>,
    ok: Arc<Mutex<Vec<Instant>>>,
    thread: Option<std::thread::JoinHandle<()>>,
    /// The stream the prober writes to.
    stream: String,
}

impl Prober {
    fn start(store: String) -> Prober {
        let (stop, ok) = (Arc::new(AtomicBool::new(false)), Arc::new(Mutex::new(Vec::new())));
        let (s, o) = (stop.clone(), ok.clone());
        let job = job("probe");
        let stream = format!("KV_etl_coordination_{job}_state");
        let (ready, started) = std::sync::mpsc::channel();
        let thread = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
            rt.block_on(async move {
                use etl_coordination_store::Store;
                let mut cfg = etl_coordination_nats::NatsConfig::new(store);
                cfg.replicas = 3;
                cfg.op_timeout = Duration::from_secs(1);
                let name = etl_coordination_core::JobName::new(job).unwrap();
                let stores = etl_coordination_nats::connect(&cfg, &name).await.expect("the prober connects");
                let key = etl_coordination_core::Key::new("probe").unwrap();
                let mut rev = stores
                    .state
                    .create(&key, bytes::Bytes::from_static(b"0"), None)
                    .await
                    .expect("first write");
                ready.send(()).unwrap();
                while !s.load(Ordering::Relaxed) {
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    let value = bytes::Bytes::from_static(b"1");
                    match stores.state.compare_and_swap(&key, rev, value, None).await {
                        Ok(r) => {
                            rev = r;
                            o.lock().unwrap().push(Instant::now());
                        }
                        // A write that landed after its timeout moved the revision on: read it.
                        Err(_) => {
                            if let Ok(Some(e)) = stores.state.get(&key).await {
                                rev = e.revision;
                            }
                        }
                    }
                }
            });
        });
        started.recv_timeout(Duration::from_secs(60)).expect("the prober's first write");
        Prober { stop, ok, thread: Some(thread), stream }
    }

    /// The longest time without a successful write from `from` on: between two successes,
    /// or from the last success before `until` to `until` when none came after it.
    fn longest_gap(&self, from: Instant, until: Instant) -> Duration {
        let ok = self.ok.lock().unwrap();
        let mut last = from;
        let mut gap = Duration::ZERO;
        for t in ok.iter().filter(|t| **t >= from) {
            gap = gap.max(*t - last);
            last = *t;
        }
        if last < until { gap.max(until - last) } else { gap }
    }
}

impl Drop for Prober {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// The fault of a run and its end (see `partitioned`).
struct Faults<C, H> {
    partition: C,
    heal: H,
}

/// Job `name`: worker `pa` reaches the nodes in `a_nodes`, `pb` those in `b_nodes`. Once both
/// work, the job's lease stream and the prober's stream are moved to node `leader` (if given);
/// once `pa` works again, `partition`; after two leases and a second, `heal` (both given `pa`'s
/// container). Both must end cleanly with every record emitted, every split Done, and `pb`
/// must have resumed every split `pa` was reading when the fault began. Prints the timings.
fn partitioned(
    name: &str,
    what: &str,
    cluster: &DockerCluster,
    (a_nodes, b_nodes, leader): (&[usize], &[usize], Option<usize>),
    faults: Faults<impl FnOnce(&Container), impl FnOnce(&Container)>,
) {
    let f = files();
    let expected = input_keys(&f.data).unwrap();
    let a = worker(cluster, &f, name, "pa", &cluster.urls(a_nodes));
    let b = worker(cluster, &f, name, "pb", &cluster.urls(b_nodes));
    let (sa, sb) = (f.out.join("pa.jsonl"), f.out.join("pb.jsonl"));
    wait_for_records(&sa, 100, &a);
    wait_for_records(&sb, 100, &b);
    let prober =
        Prober::start(b_nodes.iter().map(|k| cluster.nodes[*k].host_url()).collect::<Vec<_>>().join(","));
    if let Some(k) = leader {
        cluster.make_leader(&lease_stream(name), k);
        cluster.make_leader(&prober.stream, k);
    }
    wait_for_records(&sa, held(&sa) + 20, &a);
    let (cut_ms, cut) = (unix_ms(), Instant::now());
    (faults.partition)(&a);
    // The fault's duration, not a wait for a race: past it `pa` must have self-fenced (trust
    // lapses within a lease of its last acknowledged renewal) and its leases expired.
    std::thread::sleep(Duration::from_secs(LEASE_SECS * 2 + 1));
    let healed = Instant::now();
    (faults.heal)(&a);
    let outage = prober.longest_gap(cut, healed);
    drop(prober);
    let limit = Duration::from_secs(180);
    let (ca, cb) = (a.wait(limit), b.wait(limit));
    let (la, lb) = (a.logs(), b.logs());
    assert_eq!(ca, Some(0), "pa ends cleanly: {la}");
    assert_eq!(cb, Some(0), "pb ends cleanly: {lb}");
    let seen = records_in(&[&sa, &sb]);
    let missing: Vec<_> = expected.difference(&seen).take(5).collect();
    assert!(missing.is_empty(), "records never emitted: {missing:?}");
    let st = status_json(name, &cluster.host_urls());
    let splits = st["splits"].as_array().unwrap();
    assert!(splits.iter().all(|s| s["state"] == "Done"), "{st}");
    assert!(la.contains("Starved"), "pa self-fenced: {la}");
    // `pb` resumed the splits `pa` was reading when the fault began; the takeover latency is
    // from the fault to `pb`'s first record of the last of them.
    let (a_lines, b_lines) = (JsonlSink::read(&sa).unwrap(), JsonlSink::read(&sb).unwrap());
    let held = reading_at(&a_lines, cut_ms);
    assert!(!held.is_empty(), "pa was reading no split when the fault began");
    // A split `pa` finished just before the fault is not resumed by anyone: only some need be.
    let resumed =
        |s: &&str| b_lines.iter().find(|l| l.split == *s && l.at_ms > cut_ms).map(|l| l.at_ms - cut_ms);
    let takeovers: Vec<u64> = held.iter().filter_map(resumed).collect();
    assert!(!takeovers.is_empty(), "pb resumed none of {held:?}");
    let replayed = a_lines.len() + b_lines.len() - seen.len();
    println!(
        "hosts timing: {what}: {} of {} splits being read resumed by the peer within {:.1} s of the fault \
         (lease {LEASE_SECS} s); majority side without a successful write for at most {:.1} s; {replayed} \
         records emitted twice, 0 lost",
        takeovers.len(),
        held.len(),
        *takeovers.iter().max().unwrap_or(&0) as f64 / 1e3,
        outage.as_secs_f64()
    );
}

/// The job's lease stream (the bucket `etl_coordination_JOB_lease`).
fn lease_stream(job: &str) -> String {
    format!("KV_etl_coordination_{job}_lease")
}

#[test]
#[ignore = "needs a Docker engine and images: run by the container path of `cargo xtask itest`"]
fn the_lease_leaders_node_cut_off_from_the_other_two_the_worker_on_it_self_fences_and_the_job_completes() {
    let _one = one_at_a_time();
    let cluster = DockerCluster::start(&image("HOSTS_NATS_IMAGE"), 3);
    // `pa` knows node 0 only, `pb` the other two. Node 0 is made the leader of the lease
    // stream, then disconnected from the routes network: it loses its quorum while `pa` still
    // reaches it, and the other two elect a new leader.
    let name = job("leader");
    let faults =
        Faults { partition: |_: &Container| cluster.cut_node(0), heal: |_: &Container| cluster.heal_node(0) };
    let nodes = (&[0][..], &[1, 2][..], Some(0));
    partitioned(&name, "lease leader's node cut off from the other two", &cluster, nodes, faults);
}

#[test]
#[ignore = "needs a Docker engine and images: run by the container path of `cargo xtask itest`"]
fn a_worker_container_cut_off_from_every_node_self_fences_and_the_job_completes() {
    let _one = one_at_a_time();
    let cluster = DockerCluster::start(&image("HOSTS_NATS_IMAGE"), 3);
    let name = job("wcut");
    let faults = Faults {
        partition: |a: &Container| a.disconnect(&cluster.clients),
        heal: |a: &Container| a.connect(&cluster.clients, "pa"),
    };
    let nodes = (&[0, 1, 2][..], &[0, 1, 2][..], None);
    partitioned(&name, "worker cut off from every node", &cluster, nodes, faults);
}

#[test]
#[ignore = "needs a Docker engine and images: run by the container path of `cargo xtask itest`"]
fn the_lease_leaders_node_paused_past_a_lease_and_resumed_the_job_completes() {
    let _one = one_at_a_time();
    let cluster = DockerCluster::start(&image("HOSTS_NATS_IMAGE"), 3);
    // As in the cut: `pa` knows node 0 only, which leads the lease stream; it is frozen
    // (`docker pause`) for two leases and a second, then thawed with its old view of the world.
    let name = job("pause");
    let faults = Faults {
        partition: |_: &Container| cluster.nodes[0].container.pause(),
        heal: |_: &Container| cluster.nodes[0].container.unpause(),
    };
    let nodes = (&[0][..], &[1, 2][..], Some(0));
    partitioned(&name, "lease leader's node paused past a lease", &cluster, nodes, faults);
}
