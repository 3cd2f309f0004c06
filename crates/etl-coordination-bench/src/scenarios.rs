//! One function per target: each runs its own jobs and returns what it measured.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use anyhow::{Context, Result};
use etl_coordination_driver::{AcquisitionReason, JobOutcome};
use tokio::time::Instant;

use crate::peers::{PgJob, Static};
use crate::world::{Job, OpCounts, Work, Worker, until, until_balanced, until_quiet};

/// Where a scenario runs: a NATS URL (one server or a cluster) and the stream replicas.
#[derive(Clone, Debug)]
pub struct Target {
    pub name: &'static str,
    pub url: String,
    pub replicas: usize,
}

/// Splits every lane of which runs for ever (records are never exhausted in a run).
fn endless(splits: usize) -> Work {
    Work::new(splits, 1 << 40, Duration::from_millis(2))
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

fn ids(n: usize) -> Vec<String> {
    (0..n).map(|i| format!("w{i}")).collect()
}

fn balanced(workers: &[String], splits: usize) -> BTreeMap<String, usize> {
    let (each, extra) = (splits / workers.len(), splits % workers.len());
    // Which worker gets the extra splits is not known in advance; only used when none do.
    assert_eq!(extra, 0, "balanced() wants splits divisible by workers");
    workers.iter().map(|w| (w.clone(), each)).collect()
}

async fn stop_all(workers: &[Worker]) {
    for w in workers {
        w.handle.kill();
    }
    for w in workers {
        let _ = w.handle.outcome().await;
    }
}

/// T1: two workers hold 4 splits each; one drains. Per released split: from the drainer's
/// lease delete acknowledged to the peer's claim acknowledged, and to the peer's lane open (its
/// first record is read right then). Both ends are store answers as the workers saw them, the
/// same start point as the PostgreSQL peer's (its release committed).
pub async fn release_pickup(t: &Target, reps: usize) -> Result<(Vec<f64>, Vec<f64>)> {
    let (mut claim, mut open) = (Vec::new(), Vec::new());
    for _ in 0..reps {
        let job = Job::new(&t.url, t.replicas, "t1", endless(8));
        let a = job.start("a").await?;
        let b = job.start("b").await?;
        let want = balanced(&["a".into(), "b".into()], 8);
        until_balanced(&job.work.log, &want, Duration::from_millis(500)).await?;
        let mine: BTreeSet<String> =
            job.work.log.holders().into_iter().filter(|(_, w)| w == "a").map(|(s, _)| s).collect();
        let t0 = Instant::now();
        a.handle.drain();
        let log = job.work.log.clone();
        until("b to pick the released splits up", Duration::from_secs(30), || {
            let taken: BTreeSet<String> =
                log.all().into_iter().filter(|o| o.at > t0 && o.worker == "b").map(|o| o.split).collect();
            mine.is_subset(&taken)
        })
        .await?;
        let _ = a.handle.outcome().await;
        let (released, claimed) = (a.acks.lock().unwrap().clone(), b.acks.lock().unwrap().clone());
        // Signed: on a busy machine the peer's claim can be answered before the drainer reads
        // the answer to its delete.
        let signed = |x: Instant, y: Instant| match x.checked_duration_since(y) {
            Some(d) => ms(d),
            None => -ms(y - x),
        };
        for s in &mine {
            let deleted = released
                .iter()
                .find(|e| e.0 > t0 && &e.1 == s && !e.2)
                .map(|e| e.0)
                .with_context(|| format!("the drainer's delete of {s} was not acknowledged"))?;
            let opened = log
                .all()
                .into_iter()
                .find(|o| o.at > t0 && o.worker == "b" && &o.split == s)
                .context("the peer never opened a released split")?
                .at;
            // The peer's claim: its first acknowledged write of the lease after the drain
            // began (a lease it already held is not among the drainer's).
            let put = claimed
                .iter()
                .find(|e| e.0 > t0 && &e.1 == s && e.2)
                .with_context(|| format!("the peer's claim of {s} was not acknowledged"))?;
            claim.push(signed(put.0, deleted));
            open.push(signed(opened, deleted));
        }
        stop_all(&[b]).await;
    }
    Ok((claim, open))
}

/// T2: two workers hold 4 splits each; one is killed (nothing released). Per kill, per
/// orphaned split: from the kill to the survivor's lane open, in milliseconds.
pub async fn takeover(t: &Target, lease: Duration, reps: usize) -> Result<Vec<Vec<f64>>> {
    let mut out = Vec::new();
    for rep in 0..reps {
        let mut job = Job::new(&t.url, t.replicas, "t2", endless(8));
        job.lease = lease;
        let a = job.start("a").await?;
        let b = job.start("b").await?;
        until_balanced(&job.work.log, &balanced(&["a".into(), "b".into()], 8), Duration::from_millis(500))
            .await?;
        let mine: Vec<String> =
            job.work.log.holders().into_iter().filter(|(_, w)| w == "a").map(|(s, _)| s).collect();
        // Kills land at different points of the renewal interval (rep i: (7i mod 10)/10 of it),
        // so the samples cover a lease renewed just before the kill as well as long before.
        tokio::time::sleep(lease / 3 * ((rep as u32 * 7) % 10) / 10).await;
        let t0 = Instant::now();
        a.handle.kill();
        let log = job.work.log.clone();
        until("the survivor to take the splits over", lease * 4, || {
            let taken: BTreeSet<String> =
                log.all().into_iter().filter(|o| o.at > t0 && o.worker == "b").map(|o| o.split).collect();
            mine.iter().all(|s| taken.contains(s))
        })
        .await?;
        let mut kill = Vec::new();
        for s in &mine {
            if let Some(o) = log.all().iter().find(|o| o.at > t0 && o.worker == "b" && &o.split == s) {
                kill.push(ms(o.at - t0));
            }
        }
        out.push(kill);
        stop_all(&[b]).await;
    }
    Ok(out)
}

/// T3: one worker holds 8 splits and is killed; a new process under the same instance id
/// starts at once. Per kill, per split: from the kill to the restarted worker's lane open.
pub async fn reclaim(t: &Target, lease: Duration, reps: usize) -> Result<Vec<Vec<f64>>> {
    let mut out = Vec::new();
    for _ in 0..reps {
        let mut job = Job::new(&t.url, t.replicas, "t3", endless(8));
        job.lease = lease;
        let a = job.start("a").await?;
        until_balanced(&job.work.log, &balanced(&["a".into()], 8), Duration::from_millis(300)).await?;
        let t0 = Instant::now();
        a.handle.kill();
        let _ = a.handle.outcome().await;
        let again = job.start("a").await?;
        let log = job.work.log.clone();
        until("the restarted worker to reclaim its splits", lease * 4, || {
            log.all().iter().filter(|o| o.at > t0).map(|o| &o.split).collect::<BTreeSet<_>>().len() == 8
        })
        .await?;
        out.push(log.all().iter().filter(|o| o.at > t0).map(|o| ms(o.at - t0)).collect());
        stop_all(&[again]).await;
    }
    Ok(out)
}

/// T4: one worker holds 24 splits; 3 join, then 4 more. Per step: seconds until every worker
/// holds its fair share, the acquisitions it took (and how many were steals), and the fewest
/// moves that balance needs.
pub async fn balance(t: &Target, handover: Duration) -> Result<Vec<Step>> {
    let splits = 24;
    let mut job = Job::new(&t.url, t.replicas, "t4", endless(splits).tracked());
    job.max_in_flight = splits as u32;
    job.handover = handover;
    let mut workers = vec![job.start("w0").await?];
    until_balanced(&job.work.log, &balanced(&ids(1), splits), Duration::from_millis(300)).await?;
    let mut out = Vec::new();
    for n in [4, 8] {
        let before = workers.len();
        let dup0 = job.work.repeats();
        let t0 = Instant::now();
        for id in &ids(n)[before..] {
            workers.push(job.start(id).await?);
        }
        until_balanced(&job.work.log, &balanced(&ids(n), splits), Duration::from_millis(300)).await?;
        let log = job.work.log.all();
        let opened: Vec<_> = log.iter().filter(|o| o.at > t0).collect();
        let done = opened.iter().map(|o| o.at).max().unwrap_or(t0);
        let steals = opened.iter().filter(|o| o.reason == Some(AcquisitionReason::Stolen)).count();
        let moves = splits - splits / n * before;
        let counts = job.work.log.load();
        let imbalance = counts.values().max().unwrap_or(&0) - counts.values().min().unwrap_or(&0);
        // A lane that took a split over re-reads at most one commit interval from where the
        // previous owner last committed, at the records' own pace: counted once that has had
        // time to happen.
        tokio::time::sleep(job.cadence.interval + Duration::from_millis(500)).await;
        let emitted_twice = job.work.repeats() - dup0;
        out.push(Step {
            step: format!("{before} -> {n}"),
            secs: (done - t0).as_secs_f64(),
            acquired: opened.len(),
            steals,
            moves,
            emitted_twice,
            imbalance,
        });
    }
    stop_all(&workers).await;
    Ok(out)
}

/// T4, skewed: 24 endless splits whose weights span two orders of magnitude (1 to 100,
/// geometric); one worker holds them all, three join, every steal asks first. Balanced by the
/// weights the plan reports (`by_weight`), or by count (the plan reports none): the true weight
/// each worker holds once steals have stopped.
pub async fn skewed(t: &Target, by_weight: bool) -> Result<Skewed> {
    let splits = 24;
    let weights: Vec<u64> =
        (0..splits).map(|i| 100f64.powf(i as f64 / (splits - 1) as f64).round() as u64).collect();
    let heaviest = weights.iter().copied().max().unwrap_or(0);
    let total = weights.iter().sum();
    let mut job = Job::new(&t.url, t.replicas, "t4w", endless(splits).weighted(weights, by_weight));
    job.max_in_flight = splits as u32;
    job.handover = Duration::from_secs(10);
    let mut workers = vec![job.start("w0").await?];
    until_quiet(&job.work.log, splits, Duration::from_millis(300)).await?;
    let t0 = Instant::now();
    for id in &ids(4)[1..] {
        workers.push(job.start(id).await?);
    }
    // P9 moves at most one split per worker per heartbeat (1 s here) and a handover takes up to
    // its wait (1 s: a third of the lease) and a heartbeat: 5 s without a lane opened is done.
    until_quiet(&job.work.log, splits, Duration::from_secs(5)).await?;
    let weight = job.work.weight_of();
    let mut loads: BTreeMap<String, u64> = ids(4).into_iter().map(|id| (id, 0)).collect();
    for (split, worker) in job.work.log.holders() {
        *loads.entry(worker).or_default() += weight[&split];
    }
    let opened: Vec<_> = job.work.log.all().into_iter().filter(|o| o.at > t0).collect();
    let secs = opened.iter().map(|o| o.at).max().map_or(0.0, |at| (at - t0).as_secs_f64());
    stop_all(&workers).await;
    Ok(Skewed { loads, heaviest, total, moves: opened.len(), secs })
}

/// What T4's skewed plan measured.
pub struct Skewed {
    /// The true weight each worker held after the last move.
    pub loads: BTreeMap<String, u64>,
    /// The heaviest split's weight.
    pub heaviest: u64,
    /// Every split's weight together.
    pub total: u64,
    /// Lanes opened after the three joined.
    pub moves: usize,
    /// Seconds from the first join to the last lane opened.
    pub secs: f64,
}

/// One scale-out step of T4.
pub struct Step {
    pub step: String,
    /// Seconds from the first new worker's start to the last lane opened.
    pub secs: f64,
    /// Lanes opened in the step.
    pub acquired: usize,
    /// Of which by a steal.
    pub steals: usize,
    /// The fewest moves that balance the step.
    pub moves: usize,
    /// Records emitted twice in the step.
    pub emitted_twice: u64,
    /// Most splits held less fewest, after balance (equal weights: the weight imbalance).
    pub imbalance: usize,
}

/// T5: three workers hold 4 splits each, committing every second. Per worker and second, over
/// `window` of steady state: writes, reads and watch opens, and the writes expected from
/// renewals (leases + presence, every lease/3) and commits.
pub async fn traffic(t: &Target, window: Duration) -> Result<Vec<(String, f64, f64, f64, f64)>> {
    let mut job = Job::new(&t.url, t.replicas, "t5", endless(12));
    job.lease = Duration::from_secs(15);
    let mut workers = Vec::new();
    for id in ids(3) {
        workers.push(job.start(&id).await?);
    }
    until_balanced(&job.work.log, &balanced(&ids(3), 12), Duration::from_secs(2)).await?;
    let before: Vec<OpCounts> = workers.iter().map(|w| OpCounts::of(&w.ops)).collect();
    tokio::time::sleep(window).await;
    let secs = window.as_secs_f64();
    let mut out = Vec::new();
    for (i, w) in workers.iter().enumerate() {
        let d = OpCounts::of(&w.ops) - before[i];
        let renew = (4.0 + 1.0) / (job.lease.as_secs_f64() / 3.0);
        let commits = 4.0 * (1.0 / job.cadence.interval.as_secs_f64());
        out.push((
            format!("w{i}"),
            d.writes as f64 / secs,
            d.reads as f64 / secs,
            d.watches as f64 / secs,
            renew + commits,
        ));
    }
    stop_all(&workers).await;
    Ok(out)
}

/// What T6 measured.
pub struct LargePlan {
    pub splits: usize,
    pub first_lane: f64,
    pub all_claimed: f64,
    pub complete: f64,
    pub ops_per_split: f64,
    /// The peak resident set of each worker's process (one worker each), in MB.
    pub worker_rss_mb: Vec<f64>,
    /// Seconds `etl-coord status` takes to read and summarise the finished job (best of 3).
    pub status_s: f64,
}

/// What one T6 worker process reports on its last line of output.
#[derive(Debug)]
struct ChildReport {
    openings: u64,
    first_ms: u64,
    creates: u64,
    last_create_ms: u64,
    ops: u64,
    rss_mb: f64,
}

/// T6: a Final plan of `splits` splits with no records, four workers, each in a process of its
/// own (this program, run as [`t6_worker`]) so that each one's memory is its own: seconds to
/// the first lane (plan published), to every split claimed once, to the job complete; store
/// operations per split; each worker process's peak RSS; `status` on the finished job.
pub async fn large_plan(t: &Target, splits: usize) -> Result<LargePlan> {
    let workers_n = 4;
    let job = Job::new(&t.url, t.replicas, "t6", Work::new(splits, 0, Duration::ZERO));
    let exe = std::env::current_exe().context("finding this program to run its workers")?;
    let t0 = crate::world::unix_ms();
    let mut children = Children(Vec::new());
    for id in ids(workers_n) {
        let child = std::process::Command::new(&exe)
            .args(["t6-worker", &t.url, &t.replicas.to_string(), job.name.as_str(), &id, &splits.to_string()])
            .stdout(std::process::Stdio::piped())
            .spawn()
            .context("starting a T6 worker process")?;
        children.0.push(child);
    }
    let mut reports = Vec::new();
    for child in &mut children.0 {
        let mut stdout = child.stdout.take().expect("piped");
        let text = tokio::task::spawn_blocking(move || {
            let mut text = String::new();
            std::io::Read::read_to_string(&mut stdout, &mut text).map(|_| text)
        })
        .await?
        .context("reading a T6 worker process's report")?;
        // Its output ended; it exits right after. Waited for without blocking, so that the
        // measurement's time limit still applies.
        let status = loop {
            if let Some(status) = child.try_wait()? {
                break status;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        };
        anyhow::ensure!(status.success(), "a T6 worker process failed ({status}): {text}");
        reports.push(parse_child(&text)?);
    }
    let complete = (crate::world::unix_ms() - t0) as f64 / 1e3;
    let since = |ms: u64| ms.saturating_sub(t0) as f64 / 1e3;
    let created: u64 = reports.iter().map(|r| r.creates).sum();
    // At most one lane per split opens for its first tenancy (`Create`), and none when that
    // tenancy ends before its lane opens (given up to a peer under a leader change, say): the
    // job's completeness is checked on the store below, not from these.
    anyhow::ensure!(created <= splits as u64, "{created} first claims for {splits} splits");
    let ops: u64 = reports.iter().map(|r| r.ops).sum();
    let stores = etl_coordination_driver::JobStores::nats(&job.nats, &job.name).await?;
    let mut status_s = f64::INFINITY;
    for _ in 0..3 {
        let t = Instant::now();
        let status = etl_coord::ops::status(&stores).await?;
        status_s = status_s.min(t.elapsed().as_secs_f64());
        anyhow::ensure!(status.splits.len() == splits, "status saw {} splits", status.splits.len());
        anyhow::ensure!(
            status.summary.done == splits,
            "the job ended with {} of {splits} splits done",
            status.summary.done
        );
    }
    Ok(LargePlan {
        status_s,
        splits,
        first_lane: since(reports.iter().filter(|r| r.openings > 0).map(|r| r.first_ms).min().unwrap_or(t0)),
        all_claimed: since(reports.iter().map(|r| r.last_create_ms).max().unwrap_or(t0)),
        complete,
        ops_per_split: ops as f64 / splits as f64,
        worker_rss_mb: reports.iter().map(|r| r.rss_mb).collect(),
    })
}

/// Worker processes, killed if the measurement ends before they do (a time limit, an error).
struct Children(Vec<std::process::Child>);

impl Drop for Children {
    fn drop(&mut self) {
        for c in &mut self.0 {
            if c.try_wait().ok().flatten().is_none() {
                let _ = c.kill();
                let _ = c.wait();
            }
        }
    }
}

fn parse_child(text: &str) -> Result<ChildReport> {
    let line = text.lines().last().context("a T6 worker process printed nothing")?;
    let f: Vec<&str> = line.split_whitespace().collect();
    let bad = || {
        format!(
            "a T6 worker process's report {line:?} is not `openings first_ms creates last_create_ms ops rss_mb`"
        )
    };
    anyhow::ensure!(f.len() == 6, bad());
    Ok(ChildReport {
        openings: f[0].parse().with_context(bad)?,
        first_ms: f[1].parse().with_context(bad)?,
        creates: f[2].parse().with_context(bad)?,
        last_create_ms: f[3].parse().with_context(bad)?,
        ops: f[4].parse().with_context(bad)?,
        rss_mb: f[5].parse().with_context(bad)?,
    })
}

/// `etl-coordination-bench t6-worker URL REPLICAS JOB ID SPLITS`: one worker of T6's job, the
/// only one in this process; prints `openings first_ms creates last_create_ms ops rss_mb` once
/// the job is complete (lane openings and the wall clock of the first, first claims and the wall
/// clock of the last, store operations, and this process's peak RSS).
pub async fn t6_worker(args: &[String]) -> Result<()> {
    let [url, replicas, job, id, splits] = args else {
        anyhow::bail!("t6-worker wants URL REPLICAS JOB ID SPLITS, got {args:?}");
    };
    let work = Work::new(splits.parse()?, 0, Duration::ZERO).light();
    let openings = work.openings.clone().expect("light work counts openings");
    let job = Job::named(url, replicas.parse()?, etl_coordination_driver::JobName::new(job.as_str())?, work);
    let w = job.start(id).await?;
    let outcome = w.handle.outcome().await?;
    anyhow::ensure!(outcome == JobOutcome::Complete, "worker {id} ended {outcome:?}");
    let o = *openings.lock().unwrap();
    let ops = OpCounts::of(&w.ops);
    println!(
        "{} {} {} {} {} {:.1}",
        o.count,
        o.first_ms,
        o.creates,
        o.last_create_ms,
        ops.writes + ops.reads,
        peak_rss_mb()
    );
    Ok(())
}

/// The process's peak resident set (VmHWM), in MB.
pub fn peak_rss_mb() -> f64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmHWM:"))
                .and_then(|l| l.split_whitespace().nth(1).and_then(|kb| kb.parse::<f64>().ok()))
        })
        .map_or(f64::NAN, |kb| kb / 1e3)
}

/// T7: the same backfill (`splits` x `records` records at `cost` each) on `n` workers of 4
/// lanes: makespan (workers started to every worker complete), records/s, store operations per
/// split, measured cost per record.
pub async fn scale_out(t: &Target, n: usize, work: Work) -> Result<Run> {
    let mut job = Job::new(&t.url, t.replicas, "t7", work.clone());
    job.max_in_flight = 4;
    let t0 = Instant::now();
    let mut workers = Vec::new();
    for id in ids(n) {
        workers.push(job.start(&id).await?);
    }
    for w in &workers {
        let outcome = w.handle.outcome().await?;
        anyhow::ensure!(outcome == JobOutcome::Complete, "a worker ended {outcome:?}");
    }
    let complete = t0.elapsed().as_secs_f64();
    let makespan = work.makespan_since(t0);
    let emitted: u64 = workers.iter().map(|w| w.records.0.load(std::sync::atomic::Ordering::Relaxed)).sum();
    anyhow::ensure!(emitted >= work.splits as u64 * work.records, "records lost: {emitted}");
    let ops: u64 = workers.iter().map(|w| OpCounts::of(&w.ops)).map(|c| c.writes + c.reads).sum();
    Ok(Run {
        complete,
        makespan,
        rate: emitted as f64 / makespan,
        per_split: ops as f64 / work.splits as f64,
        cost_ms: work.measured_cost_ms(),
        breakdown: work.breakdown(t0, 4),
    })
}

/// Makespan, records/s and store round trips per split of one fleet size.
pub struct Run {
    /// Seconds from the start to every worker knowing the job complete (ours only; the
    /// makespan itself ends at the last record read, the same for every system).
    pub complete: f64,
    pub makespan: f64,
    pub rate: f64,
    pub per_split: f64,
    /// Measured time per record inside the lanes, ms.
    pub cost_ms: f64,
    /// Where the makespan went.
    pub breakdown: crate::world::Breakdown,
}

/// T7 on the static-partitioning peer: the same work on `n` replicas of 4 lanes.
pub async fn static_run(n: usize, work: Work) -> Run {
    let t0 = Instant::now();
    let mut fleet = Static::start(&work, n, 4);
    fleet.finished().await;
    let complete = t0.elapsed().as_secs_f64();
    let makespan = work.makespan_since(t0);
    let emitted = fleet.emitted.load(std::sync::atomic::Ordering::Relaxed);
    Run {
        complete,
        makespan,
        rate: emitted as f64 / makespan,
        per_split: 0.0,
        cost_ms: work.measured_cost_ms(),
        breakdown: work.breakdown(t0, 4),
    }
}

/// T7 on the PostgreSQL peer: the same work on `n` replicas of 4 lanes, polling every `poll`.
pub async fn pg_run(pg: &str, n: usize, work: Work, poll: Duration) -> Result<Run> {
    // Both clocks start before any set-up: ours includes connecting, creating the buckets,
    // electing a leader and publishing the plan; this one connecting, creating and filling the
    // table.
    let t0 = Instant::now();
    let job = PgJob::create(pg, work.clone(), Duration::from_secs(3), poll).await?;
    let mut replicas = Vec::new();
    for id in ids(n) {
        replicas.push(job.start(&id, 4).await?);
    }
    let mut emitted = 0;
    for r in &mut replicas {
        r.finished().await?;
        emitted += r.emitted.load(std::sync::atomic::Ordering::Relaxed);
    }
    let complete = t0.elapsed().as_secs_f64();
    let makespan = work.makespan_since(t0);
    anyhow::ensure!(emitted >= work.splits as u64 * work.records, "records lost: {emitted}");
    let queries = job.queries.load(std::sync::atomic::Ordering::Relaxed);
    job.drop_table().await?;
    Ok(Run {
        complete,
        makespan,
        rate: emitted as f64 / makespan,
        per_split: queries as f64 / work.splits as f64,
        cost_ms: work.measured_cost_ms(),
        breakdown: work.breakdown(t0, 4),
    })
}

/// The PostgreSQL peer's pickup (a replica drains; its peer, with free lanes, polls the
/// released splits up) or takeover (a replica is killed; its claims expire after `lease`),
/// over `reps` repetitions: per split, ms from the release acknowledged (or the kill) to the
/// peer's lane open.
pub async fn pg_handover(pg: &str, poll: Duration, kill: bool, reps: usize) -> Result<Vec<f64>> {
    let lease = Duration::from_secs(3);
    let mut out = Vec::new();
    for rep in 0..reps {
        let job = PgJob::create(pg, endless(8), lease, poll).await?;
        let log = job.work.log.clone();
        let mut a = job.start("a", 4).await?;
        until("a to claim 4 splits", Duration::from_secs(30), || log.load().get("a") == Some(&4)).await?;
        let mut b = job.start("b", 8).await?;
        until("b to claim the other 4", Duration::from_secs(30), || log.load().get("b") == Some(&4)).await?;
        let mine: Vec<String> = log.holders().into_iter().filter(|(_, w)| w == "a").map(|(s, _)| s).collect();
        let t0 = if kill {
            // Kills land at different points of the heartbeat interval, as in T2.
            tokio::time::sleep(lease / 3 * ((rep as u32 * 7) % 10) / 10).await;
            let t0 = Instant::now();
            a.kill();
            t0
        } else {
            let t0 = Instant::now();
            a.drain();
            a.finished().await?;
            t0
        };
        until("b to take a's splits", lease * 4, || {
            let taken: BTreeSet<String> =
                log.all().into_iter().filter(|o| o.at > t0 && o.worker == "b").map(|o| o.split).collect();
            mine.iter().all(|s| taken.contains(s))
        })
        .await?;
        let released = job.released.lock().unwrap().clone();
        for s in &mine {
            let from = if kill {
                t0
            } else {
                released.iter().find(|(_, r)| r == s).map(|(at, _)| *at).context("a release not logged")?
            };
            let opened = log.all().into_iter().find(|o| o.at > t0 && o.worker == "b" && &o.split == s);
            let at = opened.context("a split never reopened")?.at;
            out.push(if at >= from { ms(at - from) } else { -ms(from - at) });
        }
        b.kill();
        a.kill();
        job.drop_table().await?;
    }
    Ok(out)
}

/// What a fleet of two did when one replica was killed part way through a finite backfill.
pub struct Failure {
    /// Seconds from start to the last record read, or `None` when it never completes.
    pub makespan: Option<f64>,
    /// Records emitted more than once (re-read after the kill).
    pub duplicates: u64,
    /// Records never emitted.
    pub missing: u64,
}

/// When a failure run kills its replica: 45% of the records out, so the kill does not fall on
/// split boundaries (at exactly half, with splits of equal length started together, every lane
/// has just finished and committed a split, and nothing would be read twice).
fn kill_point(total: u64) -> u64 {
    total * 9 / 20
}

impl Failure {
    fn of(work: &Work, t0: Instant, emitted: u64, completes: bool) -> Failure {
        let total = work.splits as u64 * work.records;
        let distinct = work.distinct_emitted();
        Failure {
            makespan: completes.then(|| work.makespan_since(t0)),
            duplicates: emitted - distinct,
            missing: total - distinct,
        }
    }
}

/// Kills replica 1 of 2 part way (see `kill_point`); waits for the survivor. `work` must be
/// [`Work::tracked`].
pub async fn failure_ours(t: &Target, work: Work) -> Result<Failure> {
    let total = work.splits as u64 * work.records;
    let mut job = Job::new(&t.url, t.replicas, "fail", work);
    job.max_in_flight = 4;
    let t0 = Instant::now();
    let a = job.start("w0").await?;
    let b = job.start("w1").await?;
    let count = |w: &Worker| w.records.0.load(std::sync::atomic::Ordering::Relaxed);
    until("the kill point", Duration::from_secs(600), || count(&a) + count(&b) >= kill_point(total)).await?;
    b.handle.kill();
    let outcome = a.handle.outcome().await?;
    anyhow::ensure!(outcome == JobOutcome::Complete, "the survivor ended {outcome:?}");
    Ok(Failure::of(&job.work, t0, count(&a) + count(&b), true))
}

/// The same failure on the PostgreSQL peer.
pub async fn failure_pg(pg: &str, work: Work, poll: Duration) -> Result<Failure> {
    let total = work.splits as u64 * work.records;
    let t0 = Instant::now(); // before the set-up, as in pg_run
    let job = PgJob::create(pg, work, Duration::from_secs(3), poll).await?;
    let mut a = job.start("w0", 4).await?;
    let mut b = job.start("w1", 4).await?;
    let count = |r: &crate::peers::PgReplica| r.emitted.load(std::sync::atomic::Ordering::Relaxed);
    until("the kill point", Duration::from_secs(600), || count(&a) + count(&b) >= kill_point(total)).await?;
    b.kill();
    a.finished().await?;
    let failure = Failure::of(&job.work, t0, count(&a) + count(&b), true);
    job.drop_table().await?;
    Ok(failure)
}

/// The same failure under static partitioning: the killed replica's share is never finished.
pub async fn failure_static(work: Work) -> Failure {
    let total = work.splits as u64 * work.records;
    let t0 = Instant::now();
    let mut fleet = Static::start(&work, 2, 4);
    let emitted = fleet.emitted.clone();
    let count = || emitted.load(std::sync::atomic::Ordering::Relaxed);
    let _ = until("the kill point", Duration::from_secs(600), || count() >= kill_point(total)).await;
    fleet.kill(1);
    fleet.finished().await;
    Failure::of(&work, t0, count(), false)
}

/// One point of the cost curve.
pub struct Cost {
    pub splits: usize,
    pub workers: usize,
    /// Store operations (writes + reads) per worker and second, in steady state.
    pub ops: f64,
    /// Of which writes.
    pub writes: f64,
    /// CPU seconds per worker and second (the process's CPU over the window, shared out).
    pub cpu: f64,
}

/// The process's CPU time (user + system) so far.
fn cpu_time() -> Duration {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    // Fields after the command name (which may hold spaces): utime is the 14th field, stime
    // the 15th, in clock ticks (100 per second on Linux).
    let rest = stat.rsplit(')').next().unwrap_or("");
    let f: Vec<u64> = rest.split_whitespace().map(|x| x.parse().unwrap_or(0)).collect();
    let ticks = f.get(11).copied().unwrap_or(0) + f.get(12).copied().unwrap_or(0);
    Duration::from_millis(ticks * 10)
}

/// The cost curve: `workers` in-process workers on a plan of `splits` endless splits (lease
/// 3 s, 8 lanes each, a commit per lane and second): store operations and CPU per worker and
/// second over `window` once every worker holds its lanes (a resync, every 10 leases, reopens the watches
/// within a 30 s window).
pub async fn cost(t: &Target, splits: usize, workers: usize, window: Duration) -> Result<Cost> {
    // A record every 100 ms per lane: the source's own wake-ups stay small next to the
    // coordination's CPU even with 64 workers of 8 lanes.
    let job = Job::new(&t.url, t.replicas, "cost", Work::new(splits, 1 << 40, Duration::from_millis(100)));
    let mut fleet = Vec::new();
    for id in ids(workers) {
        fleet.push(job.start(&id).await?);
    }
    let lanes = splits.min(workers * job.max_in_flight as usize);
    let log = job.work.log.clone();
    until("every lane open", Duration::from_secs(600), || log.load().values().sum::<usize>() >= lanes)
        .await?;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let before: Vec<OpCounts> = fleet.iter().map(|w| OpCounts::of(&w.ops)).collect();
    let cpu0 = cpu_time();
    tokio::time::sleep(window).await;
    let cpu = (cpu_time() - cpu0).as_secs_f64();
    let (mut ops, mut writes) = (0, 0);
    for (w, b) in fleet.iter().zip(before) {
        let d = OpCounts::of(&w.ops) - b;
        ops += d.writes + d.reads;
        writes += d.writes;
    }
    stop_all(&fleet).await;
    let per = |x: u64| x as f64 / window.as_secs_f64() / workers as f64;
    Ok(Cost {
        splits,
        workers,
        ops: per(ops),
        writes: per(writes),
        cpu: cpu / window.as_secs_f64() / workers as f64,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_t6_worker_report_is_read_from_its_last_line_and_a_bad_one_is_named() {
        let r = parse_child("some log line\n12 1000 10 2000 345 48.5\n").unwrap();
        assert_eq!((r.openings, r.first_ms, r.creates, r.last_create_ms, r.ops), (12, 1000, 10, 2000, 345));
        assert!((r.rss_mb - 48.5).abs() < 1e-9);
        let e = parse_child("12 1000 2000 345 48.5").unwrap_err().to_string();
        assert!(e.contains("is not `openings first_ms creates last_create_ms ops rss_mb`"), "{e}");
        assert!(parse_child("").is_err());
    }
}
