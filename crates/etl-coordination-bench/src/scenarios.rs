//! One function per target: each runs its own jobs and returns what it measured.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use anyhow::{Context, Result};
use etl_coordination_driver::{AcquisitionReason, JobOutcome};
use tokio::time::Instant;

use crate::world::{Job, OpCounts, Work, Worker, until, until_balanced};

/// Where a scenario runs: a NATS URL (one server or a cluster) and the stream replicas.
#[derive(Clone, Debug)]
pub struct Target {
    pub name: &'static str,
    pub url: String,
    pub replicas: usize,
}

/// Splits every lane of which runs for ever (records are never exhausted).
fn endless(splits: usize) -> Work {
    Work::new(splits, u64::MAX, Duration::from_millis(2))
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

/// T1: two workers hold 4 splits each; one drains. Per released split: from the lease delete
/// to the peer's claim (its lease written) and to the peer's lane open (its first record is
/// read right then).
pub async fn release_pickup(t: &Target, reps: usize) -> Result<(Vec<f64>, Vec<f64>)> {
    let (mut claim, mut open) = (Vec::new(), Vec::new());
    for _ in 0..reps {
        let job = Job::new(&t.url, t.replicas, "t1", endless(8));
        let leases = job.watch_leases().await?;
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
        let events = leases.lock().unwrap().clone();
        // Signed: the peer's lane may open before this process's watch delivers the delete.
        let signed = |x: Instant, y: Instant| match x.checked_duration_since(y) {
            Some(d) => ms(d),
            None => -ms(y - x),
        };
        for s in &mine {
            let deleted = events
                .iter()
                .find(|e| e.0 > t0 && &e.1 == s && !e.2)
                .map(|e| e.0)
                .with_context(|| format!("no lease delete of {s} seen after the drain"))?;
            let put = events
                .iter()
                .find(|e| e.0 >= deleted && &e.1 == s && e.2)
                .with_context(|| format!("no new lease of {s} seen after its delete"))?;
            claim.push(signed(put.0, deleted));
            let opened =
                job.work.log.all().into_iter().find(|o| o.at > t0 && o.worker == "b" && &o.split == s);
            open.push(signed(opened.context("the peer never opened a released split")?.at, deleted));
        }
        let _ = a.handle.outcome().await;
        stop_all(&[b]).await;
    }
    Ok((claim, open))
}

/// T2: two workers hold 4 splits each; one is killed (nothing released). Per orphaned split:
/// from the kill to the survivor's lane open, in milliseconds.
pub async fn takeover(t: &Target, lease: Duration, reps: usize) -> Result<Vec<f64>> {
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
        for s in &mine {
            if let Some(o) = log.all().iter().find(|o| o.at > t0 && o.worker == "b" && &o.split == s) {
                out.push(ms(o.at - t0));
            }
        }
        stop_all(&[b]).await;
    }
    Ok(out)
}

/// T3: one worker holds 8 splits and is killed; a new process under the same instance id
/// starts at once. Per split: from the kill to the restarted worker's lane open.
pub async fn reclaim(t: &Target, lease: Duration, reps: usize) -> Result<Vec<f64>> {
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
        out.extend(log.all().iter().filter(|o| o.at > t0).map(|o| ms(o.at - t0)));
        stop_all(&[again]).await;
    }
    Ok(out)
}

/// T4: one worker holds 24 splits; 3 join, then 4 more. Per step: seconds until every worker
/// holds its fair share, the acquisitions it took (and how many were steals), and the fewest
/// moves that balance needs.
pub async fn balance(t: &Target) -> Result<Vec<(String, f64, usize, usize, usize)>> {
    let splits = 24;
    let mut job = Job::new(&t.url, t.replicas, "t4", endless(splits));
    job.max_in_flight = splits as u32;
    let mut workers = vec![job.start("w0").await?];
    until_balanced(&job.work.log, &balanced(&ids(1), splits), Duration::from_millis(300)).await?;
    let mut out = Vec::new();
    for n in [4, 8] {
        let before = workers.len();
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
        out.push((format!("{before} -> {n}"), (done - t0).as_secs_f64(), opened.len(), steals, moves));
    }
    stop_all(&workers).await;
    Ok(out)
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
    let before: Vec<OpCounts> = workers.iter().map(|w| w.ops.counts()).collect();
    tokio::time::sleep(window).await;
    let secs = window.as_secs_f64();
    let mut out = Vec::new();
    for (i, w) in workers.iter().enumerate() {
        let d = w.ops.counts() - before[i];
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
    pub workers: usize,
    pub first_lane: f64,
    pub all_claimed: f64,
    pub complete: f64,
    pub ops_per_split: f64,
    pub peak_rss_mb: f64,
}

/// T6: a Final plan of `splits` splits with no records, four workers: seconds to the first lane
/// (plan published), to every split claimed once, to the job complete; store operations per
/// split; the process's peak RSS (all workers share this process).
pub async fn large_plan(t: &Target, splits: usize) -> Result<LargePlan> {
    let workers_n = 4;
    let job = Job::new(&t.url, t.replicas, "t6", Work::new(splits, 0, Duration::ZERO));
    let t0 = Instant::now();
    let mut workers = Vec::new();
    for id in ids(workers_n) {
        workers.push(job.start(&id).await?);
    }
    let log = job.work.log.clone();
    let limit = Duration::from_secs(1800);
    until("the first lane", limit, || log.len() > 0).await?;
    let first_lane = t0.elapsed().as_secs_f64();
    until("every split claimed", limit, || log.distinct() >= splits).await?;
    let all_claimed = t0.elapsed().as_secs_f64();
    for w in &workers {
        let outcome = w.handle.outcome().await?;
        anyhow::ensure!(outcome == JobOutcome::Complete, "a worker ended {outcome:?}");
    }
    let complete = t0.elapsed().as_secs_f64();
    let ops: u64 = workers.iter().map(|w| w.ops.counts()).map(|c| c.writes + c.reads).sum();
    Ok(LargePlan {
        splits,
        workers: workers_n,
        first_lane,
        all_claimed,
        complete,
        ops_per_split: ops as f64 / splits as f64,
        peak_rss_mb: peak_rss_mb(),
    })
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

/// T7: the same backfill (`splits` x `records` records at `cost` each) with each worker count:
/// makespan (workers started to every worker complete), records/s, efficiency against one
/// worker.
pub async fn scale_out(
    t: &Target,
    counts: &[usize],
    splits: usize,
    records: u64,
    cost: Duration,
) -> Result<Vec<(usize, f64, f64)>> {
    let mut out = Vec::new();
    for &n in counts {
        let mut job = Job::new(&t.url, t.replicas, "t7", Work::new(splits, records, cost));
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
        let makespan = t0.elapsed().as_secs_f64();
        let emitted: u64 =
            workers.iter().map(|w| w.records.0.load(std::sync::atomic::Ordering::Relaxed)).sum();
        anyhow::ensure!(emitted >= splits as u64 * records, "records lost: {emitted}");
        out.push((n, makespan, emitted as f64 / makespan));
    }
    Ok(out)
}

/// The static-partitioning peer of T7: replica `r` of `n` processes the splits whose id hashes
/// to `r` mod `n` (FNV-1a, as a user would hash object names), with no coordination at all,
/// the same 4 lanes per replica and the same wait per record. Returns the makespan and
/// records/s: the no-coordination ideal that overhead is measured against. What it cannot do
/// is not measured here: a killed replica's share is never finished.
pub async fn static_partitioning(n: usize, splits: usize, records: u64, cost: Duration) -> (f64, f64) {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicU64, Ordering};
    let fnv = |s: &str| {
        s.bytes().fold(0xcbf2_9ce4_8422_2325_u64, |h, b| (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3))
    };
    let emitted = Arc::new(AtomicU64::new(0));
    let t0 = Instant::now();
    let mut replicas = tokio::task::JoinSet::new();
    for r in 0..n {
        let mine: Vec<String> =
            (0..splits).map(|i| format!("s{i:06}")).filter(|id| fnv(id) % n as u64 == r as u64).collect();
        let emitted = emitted.clone();
        replicas.spawn(async move {
            let lanes = Arc::new(tokio::sync::Semaphore::new(4));
            let mut running = tokio::task::JoinSet::new();
            for _split in mine {
                let permit = lanes.clone().acquire_owned().await.expect("never closed");
                let emitted = emitted.clone();
                running.spawn(async move {
                    for _ in 0..records {
                        tokio::time::sleep(cost).await;
                        emitted.fetch_add(1, Ordering::Relaxed);
                    }
                    drop(permit);
                });
            }
            while running.join_next().await.is_some() {}
        });
    }
    while replicas.join_next().await.is_some() {}
    let makespan = t0.elapsed().as_secs_f64();
    (makespan, emitted.load(Ordering::Relaxed) as f64 / makespan)
}
