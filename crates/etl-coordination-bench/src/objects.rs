//! T8 and T9: the files source on object-store input as users have it, read from a local
//! directory (the object store the files source opens for a path) by in-process workers on NATS.
//!
//! - T8: a prefix of many small objects (the shape of a Spark output): the leader's planning
//!   time (listing and packing), the time until the plan is published and the first lane reads,
//!   the time until the job is complete, and the process's peak RSS, with a single worker so
//!   that the peak is the leader's.
//! - T9: one big line-delimited object cut into byte ranges, read by 1, 2, 4, 8 workers of four
//!   lanes into a sink that takes a fixed time per byte (a downstream of bounded bandwidth, as
//!   T7's waiting per record): makespan and efficiency against one worker.

use std::collections::HashSet;
use std::io::Write as _;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use etl_coordination_driver::prelude::*;
use etl_coordination_driver::{DriverConfig, InstanceId, JobStores, Planner};
use etl_coordination_sources::Line;
use etl_coordination_sources::files::FilesSource;

use crate::scenarios::{Target, peak_rss_mb};
use crate::world::{Job, Work};

/// A directory of `n` objects of one short line each, 1,000 to a subdirectory
/// (`date=NNNN/part-NNNNNNN-c000.json`), plus a `_SUCCESS` marker; made once and kept under the
/// system's temporary directory (generating a million files takes a while).
pub fn small_objects(n: usize) -> Result<PathBuf> {
    let dir = std::env::temp_dir().join(format!("etl-bench-objects-{n}"));
    let done = dir.join("_SUCCESS");
    if done.exists() {
        return Ok(dir);
    }
    eprintln!("generating {n} objects under {}", dir.display());
    for i in 0..n {
        let sub = dir.join(format!("date={:04}", i / 1000));
        if i % 1000 == 0 {
            std::fs::create_dir_all(&sub).with_context(|| format!("creating {}", sub.display()))?;
        }
        std::fs::write(sub.join(format!("part-{i:07}-c000.json")), format!("{{\"n\":{i}}}\n"))?;
    }
    std::fs::write(&done, "")?;
    Ok(dir)
}

/// A directory holding one object of `lines` lines of `width` bytes (newline included).
pub fn big_object(lines: u64, width: usize) -> Result<PathBuf> {
    let dir = std::env::temp_dir().join(format!("etl-bench-big-{lines}x{width}"));
    let path = dir.join("big.log");
    let size = lines * width as u64;
    if std::fs::metadata(&path).is_ok_and(|m| m.len() == size) {
        return Ok(dir);
    }
    eprintln!("generating {} MiB under {}", size >> 20, dir.display());
    std::fs::create_dir_all(&dir)?;
    let mut w = std::io::BufWriter::with_capacity(1 << 20, std::fs::File::create(&path)?);
    let mut line = vec![b'x'; width];
    line[width - 1] = b'\n';
    for i in 0..lines {
        let head = format!("{i:012} ");
        line[..head.len()].copy_from_slice(head.as_bytes());
        w.write_all(&line)?;
    }
    w.flush()?;
    Ok(dir)
}

/// A sink that counts records and distinct keys, and (when `per_mib` is set) takes that long
/// per MiB written, paced per lane from the lane's opening (as T7's reader: time spent
/// elsewhere is made up, not added).
#[derive(Clone, Default)]
pub struct Paced {
    per_mib: Duration,
    records: Arc<AtomicU64>,
    keys: Arc<Mutex<HashSet<u64>>>,
    last_record: Arc<Mutex<Option<Instant>>>,
}

impl Paced {
    pub(crate) fn new(per_mib: Duration) -> Paced {
        Paced { per_mib, ..Paced::default() }
    }
}

/// One lane's writer of [`Paced`].
pub struct PacedWriter {
    sink: Paced,
    opened: Instant,
    bytes: u64,
}

impl Sink<Line> for Paced {
    type Writer = PacedWriter;

    async fn open(&self, _: &LaneInfo) -> Result<PacedWriter, SinkError> {
        Ok(PacedWriter { sink: self.clone(), opened: Instant::now(), bytes: 0 })
    }
}

impl SinkWriter<Line> for PacedWriter {
    async fn write(&mut self, line: Line) -> Result<(), SinkError> {
        self.bytes += line.content.len() as u64 + 1;
        let due = self.opened + self.sink.per_mib.mul_f64(self.bytes as f64 / (1 << 20) as f64);
        if let Some(wait) = due.checked_duration_since(Instant::now()) {
            tokio::time::sleep(wait).await;
        }
        self.sink.records.fetch_add(1, Ordering::Relaxed);
        let key = {
            use std::hash::{Hash, Hasher};
            let mut h = std::collections::hash_map::DefaultHasher::new();
            line.key.hash(&mut h);
            h.finish()
        };
        self.sink.keys.lock().expect("not poisoned").insert(key);
        *self.sink.last_record.lock().expect("not poisoned") = Some(Instant::now());
        Ok(())
    }

    async fn flush(&mut self) -> Result<(), SinkError> {
        Ok(())
    }
}

/// What one run of the files source on NATS gave.
pub struct FilesRun {
    /// Seconds from the workers' start to the first record written (the plan published).
    pub first_record: f64,
    /// Seconds from the start to the last record written.
    pub makespan: f64,
    /// Seconds from the start to every worker complete.
    pub complete: f64,
    pub records: u64,
    pub distinct: u64,
}

/// `workers` in-process workers of `lanes` lanes each reading `source` on `t` into `sink`.
pub(crate) async fn run_files<S: Source<Record = Line> + Clone>(
    t: &Target,
    what: &str,
    source: S,
    sink: Paced,
    workers: usize,
    lanes: u32,
) -> Result<FilesRun> {
    let names = Job::new(&t.url, t.replicas, what, Work::new(0, 0, Duration::ZERO));
    let t0 = Instant::now();
    let mut handles = Vec::new();
    for i in 0..workers {
        let stores = JobStores::nats(&names.nats, &names.name).await.context("connecting to NATS")?;
        let mut config = DriverConfig::default();
        config.instance_id = Some(InstanceId::new(format!("w{i}"))?);
        config.tuning.max_in_flight = lanes;
        config.tuning.lease_duration = Duration::from_secs(10);
        handles.push(Pipeline::new(stores, source.clone(), sink.clone()).config(config).start()?);
    }
    let first = {
        let records = sink.records.clone();
        crate::world::until("the first record", Duration::from_secs(3600), || {
            records.load(Ordering::Relaxed) > 0
        })
        .await?;
        t0.elapsed().as_secs_f64()
    };
    for h in handles {
        let outcome = h.outcome().await?;
        anyhow::ensure!(outcome == JobOutcome::Complete, "a worker ended {outcome:?}");
    }
    let complete = t0.elapsed().as_secs_f64();
    let last = sink.last_record.lock().expect("not poisoned").unwrap_or(t0);
    let distinct = sink.keys.lock().expect("not poisoned").len() as u64;
    Ok(FilesRun {
        first_record: first,
        makespan: last.duration_since(t0).as_secs_f64(),
        complete,
        records: sink.records.load(Ordering::Relaxed),
        distinct,
    })
}

/// T8's figures.
pub struct Prefix {
    pub objects: usize,
    pub list_s: f64,
    pub splits: usize,
    pub descriptor_kib_max: f64,
    pub plan_rss_mb: f64,
    pub run: FilesRun,
    pub peak_rss_mb: f64,
}

/// T8: a prefix of `n` small objects, one worker of 8 lanes.
pub async fn prefix(t: &Target, n: usize) -> Result<Prefix> {
    let dir = small_objects(n)?;
    let location = dir.to_str().context("a UTF-8 temporary directory")?;
    let source = FilesSource::open(location, etl_coordination_sources::files::DEFAULT_SPLIT_BYTES)?;
    // The leader's planning alone first (listing and packing), then the job.
    let t0 = Instant::now();
    let plan = source.plan().await.map_err(|e| anyhow::anyhow!("planning: {e}"))?;
    let list_s = t0.elapsed().as_secs_f64();
    let splits = plan.splits.len();
    let descriptor_kib_max =
        plan.splits.iter().map(|s| s.descriptor.len()).max().unwrap_or(0) as f64 / 1024.0;
    let plan_rss_mb = peak_rss_mb();
    drop(plan);
    let run = run_files(t, "t8", source, Paced::new(Duration::ZERO), 1, 8).await?;
    anyhow::ensure!(run.distinct == n as u64, "{} of {n} objects' lines emitted", run.distinct);
    Ok(Prefix {
        objects: n,
        list_s,
        splits,
        descriptor_kib_max,
        plan_rss_mb,
        run,
        peak_rss_mb: peak_rss_mb(),
    })
}

/// T9's figures for one fleet size.
pub struct Ranged {
    pub workers: usize,
    pub run: FilesRun,
}

/// T9: one object of `lines` lines of `width` bytes in ranges of `split` bytes, read by each
/// fleet size of `counts` (4 lanes a worker) into a sink that takes `per_mib` a MiB a lane.
pub async fn big(
    t: &Target,
    lines: u64,
    width: usize,
    split: u64,
    counts: &[usize],
    per_mib: Duration,
) -> Result<Vec<Ranged>> {
    let dir = big_object(lines, width)?;
    let location = dir.to_str().context("a UTF-8 temporary directory")?;
    let mut out = Vec::new();
    for &n in counts {
        let source = FilesSource::open(location, split)?.split_large_objects(true);
        let run = run_files(t, &format!("t9-{n}"), source, Paced::new(per_mib), n, 4).await?;
        anyhow::ensure!(run.distinct == lines, "{} of {lines} lines emitted at {n} workers", run.distinct);
        eprintln!("T9 {n} workers: makespan {:.1} s, {} records", run.makespan, run.records);
        out.push(Ranged { workers: n, run });
    }
    Ok(out)
}
