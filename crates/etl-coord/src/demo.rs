//! `etl-coord demo`: several in-process workers on the memory store run a coordinated
//! backfill over a generated dataset (or a directory), optionally under chaos, and check the
//! output for loss.

use std::collections::{BTreeMap, BTreeSet};
use std::io::IsTerminal;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use etl_coordination_driver::{
    CommitCadence, DriverConfig, DriverHandle, InstanceId, JobName, JobOutcome, JobStores, LaneInfo,
    Pipeline, Sink, SinkError, SinkWriter,
};
use etl_coordination_memory::MemoryStore;
use etl_coordination_sources::Line;
use etl_coordination_sources::files::FilesSource;
use tokio::sync::Mutex;

use crate::sink::{JsonlSink, JsonlWriter};
use crate::sources::{Faults, Faulty};

/// Demo settings.
#[derive(Clone, Debug)]
pub struct DemoOptions {
    /// In-process workers.
    pub workers: usize,
    /// Read this directory instead of generating a dataset.
    pub input: Option<PathBuf>,
    /// Generated dataset: number of files.
    pub files: usize,
    /// Generated dataset: lines per file.
    pub lines: usize,
    /// Target bytes per split.
    pub split_bytes: u64,
    /// Kill and freeze workers at random while the job runs.
    pub chaos: bool,
    /// Lease duration (whole seconds).
    pub lease_duration: Duration,
    /// Splits per worker.
    pub max_in_flight: u32,
    /// Sleep per record, so that faults land mid-job.
    pub record_delay: Duration,
    /// Seed of the chaos schedule.
    pub seed: u64,
    /// Draw a progress bar on stderr.
    pub progress: bool,
}

/// What the demo did.
#[derive(Clone, Debug, Default)]
pub struct DemoSummary {
    /// Splits planned.
    pub splits: usize,
    /// Records in the input.
    pub records: u64,
    /// Records emitted (replays included).
    pub emitted: u64,
    /// Distinct records emitted.
    pub distinct: u64,
    /// Records of the input never emitted (must be empty).
    pub missing: Vec<String>,
    /// Acquisitions by reason.
    pub acquisitions: BTreeMap<String, u64>,
    /// Quarantined splits.
    pub quarantined: u64,
    /// Chaos actions taken.
    pub kills: u64,
    /// Chaos freezes.
    pub freezes: u64,
    /// Wall time.
    pub wall: Duration,
}

/// Writes `files` files of `lines` lines into `dir`.
pub fn generate(dir: &Path, files: usize, lines: usize) -> std::io::Result<()> {
    for f in 0..files {
        let mut text = String::with_capacity(lines * 48);
        for l in 0..lines {
            text.push_str(&format!(
                "file {f:04} line {l:06} payload {:016x}\n",
                (f * 1_000_003 + l) as u64 * 0x9e37_79b9
            ));
        }
        std::fs::write(dir.join(format!("part-{f:04}.txt")), text)?;
    }
    Ok(())
}

/// Every record key of the input (`path:line`), for the no-loss check.
pub fn input_keys(dir: &Path) -> std::io::Result<BTreeSet<String>> {
    let mut keys = BTreeSet::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for entry in std::fs::read_dir(&d)? {
            let path = entry?.path();
            if path.is_dir() {
                stack.push(path);
                continue;
            }
            let rel = path.strip_prefix(dir).expect("under dir").to_string_lossy().replace('\\', "/");
            let text = std::fs::read(&path)?;
            // The files source reads every newline-terminated line, plus a final unterminated one.
            let newlines = text.iter().filter(|b| **b == b'\n').count();
            let lines = newlines + usize::from(text.last().is_some_and(|b| *b != b'\n'));
            for l in 1..=lines {
                keys.insert(format!("{rel}:{l}"));
            }
        }
    }
    Ok(keys)
}

struct Fleet {
    stores: JobStores<MemoryStore>,
    source: FilesSource,
    sink: JsonlSink,
    opts: DemoOptions,
    emitted: Arc<AtomicU64>,
    handles: Mutex<BTreeMap<String, DriverHandle>>,
}

impl Fleet {
    fn config(&self, id: &str) -> DriverConfig {
        let mut config = DriverConfig::default();
        config.instance_id = Some(InstanceId::new(id).expect("demo ids are valid"));
        config.tuning.lease_duration = self.opts.lease_duration;
        config.tuning.max_in_flight = self.opts.max_in_flight;
        config.tuning.drain_timeout = Duration::from_secs(5);
        // A demo is minutes long: a split whose owner was killed waits a few seconds, not 15.
        config.tuning.claim_backoff = Duration::from_secs(2);
        config
    }

    async fn start(self: &Arc<Self>, id: &str) -> anyhow::Result<()> {
        let source = Faulty {
            source: self.source.clone(),
            faults: Faults { record_delay: self.opts.record_delay, ..Faults::default() },
        };
        let sink = Counted { sink: self.sink.clone(), emitted: self.emitted.clone() };
        let handle = Pipeline::new(self.stores.clone(), source, sink)
            .config(self.config(id))
            .commit_every(CommitCadence::new(200, Duration::from_millis(500)))
            .start()?;
        self.handles.lock().await.insert(id.to_owned(), handle);
        Ok(())
    }
}

/// A sink that counts what it writes (for the progress bar).
struct Counted {
    sink: JsonlSink,
    emitted: Arc<AtomicU64>,
}

impl Sink<Line> for Counted {
    type Writer = CountedWriter;

    async fn open(&self, lane: &LaneInfo) -> Result<CountedWriter, SinkError> {
        Ok(CountedWriter { writer: self.sink.open(lane).await?, emitted: self.emitted.clone() })
    }
}

/// One lane's writer of a [`Counted`] sink.
struct CountedWriter {
    writer: JsonlWriter,
    emitted: Arc<AtomicU64>,
}

impl SinkWriter<Line> for CountedWriter {
    async fn write(&mut self, record: Line) -> Result<(), SinkError> {
        self.writer.write(record).await?;
        self.emitted.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    async fn flush(&mut self) -> Result<(), SinkError> {
        self.writer.flush().await
    }
}

/// Runs the demo and checks the output.
pub async fn run_demo(
    opts: DemoOptions,
    metrics: Option<etl_coordination_metrics::PrometheusHandle>,
) -> anyhow::Result<DemoSummary> {
    if opts.workers == 0 {
        bail!("--workers must be at least 1");
    }
    let t0 = Instant::now();
    let work = tempfile_dir()?;
    let input = prepare_input(&opts, &work)?;
    let sink_path = work.join("sink.jsonl");
    let source = FilesSource::open(input.to_str().context("input path is not UTF-8")?, opts.split_bytes)?;
    let splits = source.plan_splits().await?.len();
    let expected = input_keys(&input).context("reading the input for the no-loss check")?;
    let fleet = Arc::new(Fleet {
        stores: JobStores::memory(JobName::new("demo").expect("a valid name")),
        source,
        sink: JsonlSink::open(&sink_path)?,
        opts: opts.clone(),
        emitted: Arc::new(AtomicU64::new(0)),
        handles: Mutex::new(BTreeMap::new()),
    });
    let ids: Vec<String> = (0..opts.workers).map(|i| format!("demo-{i}")).collect();
    for id in &ids {
        fleet.start(id).await?;
    }
    let done = Arc::new(AtomicBool::new(false));
    let progress = opts.progress.then(|| {
        let (emitted, done, total) = (fleet.emitted.clone(), done.clone(), expected.len() as u64);
        tokio::spawn(async move { progress_bar(emitted, done, total).await })
    });
    let mut summary = DemoSummary { splits, records: expected.len() as u64, ..DemoSummary::default() };
    let chaos = opts.chaos.then(|| {
        let (fleet, done, ids) = (fleet.clone(), done.clone(), ids.clone());
        tokio::spawn(async move { chaos(fleet, done, ids).await })
    });
    let outcome = fleet.outcome().await?;
    done.store(true, Ordering::Relaxed);
    if let Some(c) = chaos {
        let (kills, freezes) = c.await.unwrap_or((0, 0));
        summary.kills = kills;
        summary.freezes = freezes;
    }
    if let Some(p) = progress {
        let _ = p.await;
    }
    if let Some(other) = outcome {
        bail!("the demo job did not complete: {other}");
    }
    summary.read_output(&sink_path, &expected)?;
    if let Some(m) = metrics {
        summary.read_metrics(&m.render());
    }
    summary.wall = t0.elapsed();
    let _ = std::fs::remove_dir_all(&work);
    Ok(summary)
}

impl Fleet {
    /// Waits until every current worker has an outcome (a killed worker is restarted by the
    /// chaos task under the same id, which replaces its handle): `None` if every one completed,
    /// else what another said.
    async fn outcome(&self) -> anyhow::Result<Option<String>> {
        loop {
            let handles: Vec<DriverHandle> = self.handles.lock().await.values().cloned().collect();
            let mut all_done = true;
            let mut stalled = None;
            for h in &handles {
                match h.outcome().await {
                    Ok(JobOutcome::Complete) => {}
                    Ok(other) => stalled = Some(format!("{other:?}")),
                    Err(etl_coordination_driver::DriverError::Killed) => all_done = false,
                    Err(e) => return Err(e.into()),
                }
            }
            if all_done {
                return Ok(stalled);
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

/// The input directory: the one given, or a generated dataset under `work`.
fn prepare_input(opts: &DemoOptions, work: &std::path::Path) -> anyhow::Result<PathBuf> {
    if let Some(dir) = &opts.input {
        return Ok(dir.clone());
    }
    let dir = work.join("input");
    std::fs::create_dir_all(&dir)?;
    generate(&dir, opts.files, opts.lines).context("generating the demo dataset")?;
    Ok(dir)
}

impl DemoSummary {
    /// What the sink holds against what the input had: emitted, distinct, missing records.
    fn read_output(&mut self, sink: &std::path::Path, expected: &BTreeSet<String>) -> anyhow::Result<()> {
        let lines = JsonlSink::read(sink)?;
        let seen: BTreeSet<String> = lines.iter().map(|l| l.record.clone()).collect();
        self.emitted = lines.len() as u64;
        self.distinct = seen.len() as u64;
        self.missing = expected.difference(&seen).take(10).cloned().collect();
        Ok(())
    }

    /// Quarantined splits and acquisitions by reason, from the metrics the workers recorded.
    fn read_metrics(&mut self, text: &str) {
        let value = |line: &str| line.rsplit(' ').next().and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0);
        for line in text.lines().filter(|l| l.starts_with("etl_coordination_splits_quarantined{")) {
            self.quarantined = self.quarantined.max(value(line) as u64);
        }
        for line in text.lines().filter(|l| l.starts_with("etl_coordination_acquisitions_total{")) {
            let reason = line.split("reason=\"").nth(1).and_then(|r| r.split('"').next()).unwrap_or("?");
            *self.acquisitions.entry(reason.to_owned()).or_default() += value(line) as u64;
        }
    }
}

fn tempfile_dir() -> anyhow::Result<PathBuf> {
    let dir = std::env::temp_dir().join(format!(
        "etl-coord-demo-{}-{}",
        std::process::id(),
        Instant::now().elapsed().as_nanos()
    ));
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    Ok(dir)
}

async fn progress_bar(emitted: Arc<AtomicU64>, done: Arc<AtomicBool>, total: u64) {
    let tty = std::io::stderr().is_terminal();
    let mut last_quarter = u64::MAX;
    loop {
        let finished = done.load(Ordering::Relaxed);
        let n = emitted.load(Ordering::Relaxed).min(total);
        let pct = (n * 100).checked_div(total).unwrap_or(100);
        let bar: String = (0..30).map(|i| if i * 100 / 30 < pct { '#' } else { '.' }).collect();
        if tty {
            eprint!("\r[{bar}] {pct:>3}%  {n}/{total} records");
        } else if pct / 25 != last_quarter {
            last_quarter = pct / 25;
            eprintln!("[{bar}] {pct:>3}%  {n}/{total} records");
        }
        if finished {
            if tty {
                eprintln!();
            }
            return;
        }
        tokio::time::sleep(Duration::from_millis(if tty { 200 } else { 1000 })).await;
    }
}

/// Kills (then restarts with the same id, exercising instant reclaim) or freezes a random
/// worker every second or two until the job is done.
async fn chaos(fleet: Arc<Fleet>, done: Arc<AtomicBool>, ids: Vec<String>) -> (u64, u64) {
    let mut rng = fleet.opts.seed ^ 0x9e37_79b9_7f4a_7c15;
    let mut next = move || {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng
    };
    let (mut kills, mut freezes) = (0, 0);
    tokio::time::sleep(Duration::from_millis(500)).await;
    while !done.load(Ordering::Relaxed) {
        let id = &ids[(next() % ids.len() as u64) as usize];
        let handle = fleet.handles.lock().await.get(id).cloned();
        if let Some(h) = handle {
            if next() % 2 == 0 {
                h.kill();
                kills += 1;
                tracing::info!(worker = %id, "chaos: killed");
                tokio::time::sleep(Duration::from_millis(200 + next() % 800)).await;
                if let Err(e) = fleet.start(id).await {
                    tracing::error!(worker = %id, error = %e, "chaos: restart failed");
                }
            } else {
                let d = fleet.opts.lease_duration + Duration::from_millis(next() % 2000);
                h.freeze(d);
                freezes += 1;
                tracing::info!(worker = %id, ?d, "chaos: frozen");
            }
        }
        tokio::time::sleep(Duration::from_millis(1000 + next() % 1500)).await;
    }
    (kills, freezes)
}
