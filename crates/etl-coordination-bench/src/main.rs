//! `etl-coordination-bench`: the targets of docs/BENCHMARKS.md measured on real NATS, written
//! as that document. Run it through `cargo xtask bench` (which provisions the servers);
//! `--quick` is the smoke run `cargo xtask ci` makes so the harness cannot rot (it asserts
//! nothing about speed).
//!
//! ```text
//! etl-coordination-bench --nats URL [--cluster URLS] [--postgres CONNINFO] [--quick]
//!     [--only T1,...,T7,COST,PEERS] [--out FILE] [--plots DIR] [--command TEXT]
//! ```
//!
//! The peers (static partitioning, PostgreSQL `SKIP LOCKED`) run beside the first target (the
//! single node) on the same work; the PostgreSQL ones need `--postgres`.

mod peers;
mod plots;
mod scenarios;
mod world;

use std::fmt::Write as _;
use std::time::Duration;

use anyhow::{Context, Result, bail};

use plots::Series;
use scenarios::Target;

struct Args {
    nats: String,
    cluster: Option<String>,
    postgres: Option<String>,
    plots: Option<std::path::PathBuf>,
    quick: bool,
    out: Option<String>,
    command: String,
    /// Only these targets (`T1`..`T7`); all when empty.
    only: Vec<String>,
}

fn args() -> Result<Args> {
    let mut a = Args {
        nats: String::new(),
        cluster: None,
        postgres: None,
        plots: None,
        quick: false,
        out: None,
        command: String::new(),
        only: Vec::new(),
    };
    let mut it = std::env::args().skip(1);
    while let Some(arg) = it.next() {
        let mut value = |name: &str| it.next().with_context(|| format!("{name} needs a value"));
        match arg.as_str() {
            "--nats" => a.nats = value("--nats")?,
            "--cluster" => a.cluster = Some(value("--cluster")?),
            "--postgres" => a.postgres = Some(value("--postgres")?),
            "--plots" => a.plots = Some(value("--plots")?.into()),
            "--quick" => a.quick = true,
            "--out" => a.out = Some(value("--out")?),
            "--command" => a.command = value("--command")?,
            "--only" => a.only = value("--only")?.split(',').map(|t| t.trim().to_uppercase()).collect(),
            other => bail!("unknown argument {other:?} (see the crate documentation)"),
        }
    }
    if a.nats.is_empty() {
        bail!("--nats URL is required (cargo xtask bench provisions a server and passes it)");
    }
    Ok(a)
}

/// The `p`-th percentile (nearest rank) of `v`.
fn pct(v: &[f64], p: f64) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    let rank = ((p / 100.0) * s.len() as f64).ceil().max(1.0) as usize;
    s[rank.min(s.len()) - 1]
}

/// A table row of a latency distribution in milliseconds against a target.
fn dist_row(what: &str, v: &[f64], target_ms: Option<f64>) -> String {
    let verdict = match target_ms {
        Some(t) if pct(v, 99.0) <= t => format!("met (p99 <= {t:.0} ms)"),
        Some(t) => format!("**missed** (p99 > {t:.0} ms)"),
        None => String::new(),
    };
    format!(
        "| {what} | {} | {:.1} | {:.1} | {:.1} | {verdict} |\n",
        v.len(),
        pct(v, 50.0),
        pct(v, 99.0),
        pct(v, 100.0)
    )
}

/// Per trial, its slowest sample (the time until the whole handover was done).
fn last_of(trials: &[Vec<f64>]) -> Vec<f64> {
    trials.iter().filter_map(|t| t.iter().copied().reduce(f64::max)).collect()
}

const DIST_HEAD: &str =
    "| measured | samples | p50 ms | p99 ms | max ms | target |\n|---|---|---|---|---|---|\n";

fn machine() -> String {
    let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
    let mem = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|m| m.lines().next().map(|l| l.split_whitespace().nth(1).unwrap_or("?").to_owned()))
        .and_then(|kb| kb.parse::<f64>().ok())
        .map_or("?".into(), |kb| format!("{:.1} GiB", kb / 1024.0 / 1024.0));
    let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    format!("{cores} cores, {mem} memory, Linux {}", kernel.trim())
}

fn today() -> String {
    std::process::Command::new("date")
        .args(["-u", "+%Y-%m-%d %H:%M UTC"])
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned())
        .unwrap_or_default()
}

/// Runs one measurement, failing it (instead of hanging) past `limit`.
async fn bounded<T>(
    what: &str,
    limit: Duration,
    f: impl std::future::Future<Output = Result<T>>,
) -> Result<T> {
    tokio::time::timeout(limit, f).await.with_context(|| format!("{what} did not finish within {limit:?}"))?
}

fn ratio(a: f64, b: f64) -> String {
    if b > 0.0 && a.is_finite() && b.is_finite() { format!("{:.2}", a / b) } else { "n/a".into() }
}

#[tokio::main]
async fn main() -> Result<()> {
    let a = args()?;
    let mut targets = vec![Target { name: "NATS single node", url: a.nats.clone(), replicas: 1 }];
    if let Some(c) = &a.cluster {
        targets.push(Target { name: "NATS 3-node cluster, replicas 3", url: c.clone(), replicas: 3 });
    }
    let (reps, long_reps) = if a.quick { (1, 0) } else { (25, 4) };
    let plots_dir = match (&a.plots, &a.out) {
        (Some(d), _) => d.clone(),
        (None, Some(out)) => std::path::Path::new(out).with_extension("").with_file_name("bench"),
        (None, None) => std::env::temp_dir().join("etl-coordination-bench"),
    };
    std::fs::create_dir_all(&plots_dir).with_context(|| format!("creating {}", plots_dir.display()))?;
    // Plots are referenced relative to the document.
    let rel = |file: &str| -> String {
        let out_dir = a.out.as_deref().map(std::path::Path::new).and_then(|p| p.parent());
        let path = plots_dir.join(file);
        match out_dir.and_then(|d| path.strip_prefix(d).ok()) {
            Some(r) => r.display().to_string(),
            None => path.display().to_string(),
        }
    };
    let mut doc = String::new();
    let mut headlines: Vec<String> = Vec::new();

    let want = |t: &str| a.only.is_empty() || a.only.iter().any(|o| o == t);
    // The smoke run in CI must end: every measurement gets a bound (the full run's are wide).
    let limit = Duration::from_secs(if a.quick { 120 } else { 3600 });
    // What the peers section compares with (the first target's figures).
    let (mut ours_pickup, mut ours_takeover) = (Vec::new(), Vec::new());
    let cost = Duration::from_millis(5);
    for (ti, t) in targets.iter().enumerate() {
        let first = ti == 0;
        let started = std::time::Instant::now();
        eprintln!("== {}", t.name);
        writeln!(doc, "## {}\n", t.name)?;

        if want("T1") {
            eprintln!("T1 release pickup");
            let (claim, open) = bounded("T1", limit, scenarios::release_pickup(t, reps.max(1))).await?;
            writeln!(doc, "### T1 release pickup (a worker drains; its peer takes the splits)\n")?;
            doc.push_str(DIST_HEAD);
            doc.push_str(&dist_row(
                "drainer's lease delete answered -> peer's claim answered",
                &claim,
                Some(10.0),
            ));
            doc.push_str(&dist_row(
                "drainer's lease delete answered -> peer's lane open (reading starts)",
                &open,
                None,
            ));
            writeln!(
                doc,
                "\nBoth ends are store answers as the two workers saw them (the peer learns of the delete from its \
                 watch, one delivery after the server applied it); a sample can come out slightly negative when \
                 the peer's claim is answered before the drainer reads the answer to its delete.\n"
            )?;
            if first {
                ours_pickup = open;
            }
        }
        if want("T2") {
            eprintln!("T2 takeover");
            writeln!(doc, "### T2 takeover after a kill (nothing released)\n")?;
            doc.push_str(DIST_HEAD);
            for (lease, n) in [(3, reps.clamp(1, 10)), (15, long_reps)] {
                if n == 0 {
                    continue;
                }
                let d = Duration::from_secs(lease);
                let kills = bounded("T2", limit, scenarios::takeover(t, d, n)).await?;
                let v: Vec<f64> = kills.concat();
                let target = Some(lease as f64 * 1e3 + 500.0);
                doc.push_str(&dist_row(
                    &format!("kill -> survivor's lane open, each orphaned split, lease {lease} s"),
                    &v,
                    target,
                ));
                doc.push_str(&dist_row(
                    &format!(
                        "kill -> last orphaned split open, each of {} kills, lease {lease} s",
                        kills.len()
                    ),
                    &last_of(&kills),
                    target,
                ));
                if first && lease == 3 {
                    ours_takeover = v;
                }
            }
            writeln!(
                doc,
                "\nKills land at ten phases of the renewal interval (L/3), so the samples span a lease renewed \
                 just before the kill (takeover near L) and long before it (near 2L/3).\n"
            )?;
        }
        if want("T3") {
            eprintln!("T3 reclaim");
            writeln!(doc, "### T3 reclaim after a restart under the same instance id\n")?;
            doc.push_str(DIST_HEAD);
            for (lease, n) in [(3, reps.clamp(1, 10)), (15, long_reps)] {
                if n == 0 {
                    continue;
                }
                let d = Duration::from_secs(lease);
                let kills = bounded("T3", limit, scenarios::reclaim(t, d, n)).await?;
                let target = Some(lease as f64 * 1e3 / 3.0 + 500.0);
                doc.push_str(&dist_row(
                    &format!("kill -> restarted worker's lane open, each split, lease {lease} s"),
                    &kills.concat(),
                    target,
                ));
                doc.push_str(&dist_row(
                    &format!("kill -> last split open, each of {} restarts, lease {lease} s", kills.len()),
                    &last_of(&kills),
                    target,
                ));
            }
            writeln!(
                doc,
                "\nThe restarted process watches its predecessor's presence key for one heartbeat (L/3) and a \
                 margin of at most 250 ms before it takes the key and reclaims (P3).\n"
            )?;
        }
        if want("T4") {
            eprintln!("T4 balance");
            writeln!(doc, "### T4 balance after scaling out (24 splits)\n")?;
            writeln!(
                doc,
                "| step | seconds to balance | acquisitions | of which steals | fewest moves | target |\n|---|---|---|---|---|---|"
            )?;
            for (step, secs, acquired, steals, moves) in bounded("T4", limit, scenarios::balance(t)).await? {
                let verdict = if acquired <= moves { "met" } else { "**missed**" };
                writeln!(
                    doc,
                    "| {step} workers | {secs:.2} | {acquired} | {steals} | {moves} | {verdict} (acquisitions <= moves) |"
                )?;
            }
            doc.push('\n');
        }
        if want("T5") {
            eprintln!("T5 traffic");
            let window = Duration::from_secs(if a.quick { 5 } else { 60 });
            writeln!(
                doc,
                "### T5 steady-state store traffic (3 workers x 4 splits, lease 15 s, a commit per lane per second, {} s window)\n",
                window.as_secs()
            )?;
            writeln!(
                doc,
                "| worker | writes/s | reads/s | watch opens/s | writes/s expected (renewals + commits) | target |\n|---|---|---|---|---|---|"
            )?;
            for (w, writes, reads, watches, expected) in
                bounded("T5", limit, scenarios::traffic(t, window)).await?
            {
                let verdict = if reads == 0.0 && watches == 0.0 && writes <= expected * 1.1 {
                    "met"
                } else {
                    "**missed**"
                };
                writeln!(
                    doc,
                    "| {w} | {writes:.2} | {reads:.2} | {watches:.2} | {expected:.2} | {verdict} (no reads, no watch reopened, writes <= expected + 10%) |"
                )?;
            }
            doc.push('\n');
        }
        if want("T6") {
            eprintln!("T6 large plan");
            let n = if a.quick { 500 } else { 100_000 };
            let l = bounded("T6", limit, scenarios::large_plan(t, n)).await?;
            writeln!(doc, "### T6 a Final plan of {} splits, {} workers, no records\n", l.splits, l.workers)?;
            writeln!(
                doc,
                "| first lane (plan published) s | every split claimed s | job complete s | splits/s | store ops per split | peak RSS of the process (all workers) MB | `status` s |\n|---|---|---|---|---|---|---|"
            )?;
            writeln!(
                doc,
                "| {:.2} | {:.2} | {:.2} | {:.0} | {:.1} | {:.0} | {:.2} |\n",
                l.first_lane,
                l.all_claimed,
                l.complete,
                l.splits as f64 / l.complete,
                l.ops_per_split,
                l.peak_rss_mb,
                l.status_s
            )?;
            writeln!(
                doc,
                "`status` is the read and summary behind `etl-coord status` (one listing per bucket), best of 3, \
                 in this process; printing the table adds to it.\n"
            )?;
        }
        if want("T7") {
            eprintln!("T7 scale-out");
            let (counts, splits, records): (&[usize], usize, u64) =
                if a.quick { (&[1, 2], 8, 20) } else { (&[1, 2, 4, 8], 128, 400) };
            let work = || world::Work::new(splits, records, cost);
            writeln!(
                doc,
                "### T7 scale-out ({splits} splits x {records} records, {} ms of waiting per record, 4 lanes per worker)\n",
                cost.as_millis()
            )?;
            let peers = first;
            writeln!(
                doc,
                "| workers | makespan s | all workers complete s | records/s | efficiency | target | store ops per split | ms per record |{}\n|---|---|---|---|---|---|---|---|{}",
                if peers {
                    " static makespan s | ours / static | PostgreSQL makespan s | ours / PostgreSQL | PostgreSQL statements per split | ms per record (static, PostgreSQL) |"
                } else {
                    ""
                },
                if peers { "---|---|---|---|---|---|" } else { "" }
            )?;
            let (mut ours_curve, mut static_curve, mut pg_curve) = (Vec::new(), Vec::new(), Vec::new());
            let mut one = f64::NAN;
            for &n in counts {
                let r = bounded("T7", limit, scenarios::scale_out(t, n, work())).await?;
                if n == 1 {
                    one = r.rate;
                }
                let eff = r.rate / (n as f64 * one);
                let verdict = if n == 1 {
                    String::new()
                } else if eff >= 0.9 {
                    "met (>= 0.9)".into()
                } else {
                    "**missed** (< 0.9)".into()
                };
                write!(
                    doc,
                    "| {n} | {:.2} | {:.2} | {:.0} | {eff:.2} | {verdict} | {:.1} | {:.2} |",
                    r.makespan, r.complete, r.rate, r.per_split, r.cost_ms
                )?;
                ours_curve.push((n as f64, r.rate));
                if peers {
                    let s = scenarios::static_run(n, work()).await;
                    static_curve.push((n as f64, s.rate));
                    let pg = match &a.postgres {
                        Some(pg) => Some(
                            bounded(
                                "T7 PostgreSQL",
                                limit,
                                scenarios::pg_run(pg, n, work(), Duration::from_secs(1)),
                            )
                            .await?,
                        ),
                        None => None,
                    };
                    let (pm, pr, pq, pc) =
                        pg.as_ref().map_or((f64::NAN, f64::NAN, f64::NAN, f64::NAN), |p| {
                            (p.makespan, p.rate, p.per_split, p.cost_ms)
                        });
                    if pg.is_some() {
                        pg_curve.push((n as f64, pr));
                    }
                    write!(
                        doc,
                        " {:.2} | {} | {pm:.2} | {} | {pq:.1} | {:.2}, {pc:.2} |",
                        s.makespan,
                        ratio(r.makespan, s.makespan),
                        ratio(r.makespan, pm),
                        s.cost_ms
                    )?;
                    if n == *counts.last().unwrap() {
                        headlines.push(format!(
                            "Backfill makespan at {n} workers: ours / static partitioning **{}**, ours / PostgreSQL \
                             SKIP LOCKED **{}** (T7).",
                            ratio(r.makespan, s.makespan),
                            ratio(r.makespan, pm)
                        ));
                    }
                }
                writeln!(doc)?;
            }
            writeln!(
                doc,
                "\nEvery system reads through the same paced reader (record k of a lane is due k x {} ms after \
                 the lane opened, so timer rounding does not add up). The makespan ends at the last record read, \
                 for every system; \"all workers complete\" adds the time until every worker of ours saw the \
                 job complete (P13) and stopped. \"ms per record\" is the lane time per \
                 record each system got (a lane held up catches up in a burst, so overhead shows in the \
                 makespan, not here). Static \
                 partitioning (replica r takes the splits whose id hashes to r mod N) is the no-coordination \
                 ideal; what it cannot do: a killed replica's share is never finished, and a replica added later \
                 changes every replica's share. On 2 cores, waiting (not CPU) is what each lane spends its time \
                 on, which is what lets 8 workers x 4 lanes scale here.\n",
                cost.as_millis()
            )?;
            if peers {
                let ideal: Vec<(f64, f64)> = counts.iter().map(|&n| (n as f64, one * n as f64)).collect();
                let mut series = vec![
                    Series { name: "etl-coordination".into(), points: ours_curve },
                    Series { name: "static partitioning".into(), points: static_curve },
                ];
                if !pg_curve.is_empty() {
                    series.push(Series { name: "PostgreSQL SKIP LOCKED".into(), points: pg_curve });
                }
                series.push(Series { name: "linear (N x one worker)".into(), points: ideal });
                plots::lines(
                    &plots_dir.join("t7-scale-out.svg"),
                    "T7 scale-out",
                    "workers",
                    "records/s",
                    &series,
                    false,
                )?;
                writeln!(doc, "![T7 records/s against workers]({})\n", rel("t7-scale-out.svg"))?;
            }
        }
        eprintln!("{} done in {:.0} s", t.name, started.elapsed().as_secs_f64());
    }

    let t = &targets[0];
    if want("PEERS") {
        eprintln!("== peers");
        writeln!(doc, "## Against what users would build instead ({})\n", t.name)?;
        let pg_version = match &a.postgres {
            Some(pg) => peers::server_version(pg).await?,
            None => "not run: no --postgres".to_owned(),
        };
        writeln!(
            doc,
            "Same work, same paced reader, same commit cadence (1,000 records or 1 s), lease 3 s. The PostgreSQL \
             peer (PostgreSQL {}) is a table of splits claimed with `UPDATE ... WHERE id = (SELECT ... FOR UPDATE \
             SKIP LOCKED)` (largest remaining split first, unclaimed or expired), an expiry renewed every L/3 by a \
             heartbeat, progress committed guarded by the owner, and lanes that poll for work when the claim \
             finds nothing; server settings are the defaults (synchronous commit on). It needed: the table \
             created by a migration step before any replica starts (replicas racing on `CREATE TABLE IF NOT \
             EXISTS` fail), an owner tag per process incarnation, the owner guard on every write. It does not \
             have: fair shares (a replica claims as many splits as it has lanes), fencing beyond the owner \
             guard, pickup without a poll.\n",
            pg_version
        )?;
        let mut pickups = vec![Series::cdf("etl-coordination", &ours_pickup)];
        let mut takeovers = vec![Series::cdf("etl-coordination", &ours_takeover)];
        doc.push_str("### Handover latency\n\n");
        doc.push_str(DIST_HEAD);
        // (what, ours, kill?, repetitions, the percentile the headline quotes, what static does)
        let rows = [
            (
                "release pickup",
                &ours_pickup,
                false,
                reps.clamp(1, 25),
                50.0,
                "a drained replica's share waits for it",
            ),
            (
                "takeover after a kill",
                &ours_takeover,
                true,
                reps.clamp(1, 10),
                99.0,
                "a killed replica's share is never finished",
            ),
        ];
        let mut pg_1s = [f64::NAN; 2];
        for (i, (what, ours, kill, n, p, never)) in rows.into_iter().enumerate() {
            let from = if kill { "kill" } else { "release committed" };
            doc.push_str(&dist_row(&format!("ours: {what} (T{}, lease 3 s)", i + 1), ours, None));
            if let Some(pg) = &a.postgres {
                for poll in [1000, 100] {
                    let v = bounded(
                        what,
                        limit,
                        scenarios::pg_handover(pg, Duration::from_millis(poll), kill, n),
                    )
                    .await?;
                    doc.push_str(&dist_row(
                        &format!("PostgreSQL, poll {poll} ms: {what} ({from} -> lane open)"),
                        &v,
                        None,
                    ));
                    if poll == 1000 {
                        pg_1s[i] = pct(&v, p);
                    }
                    let series = Series::cdf(&format!("PostgreSQL, poll {poll} ms"), &v);
                    if kill { takeovers.push(series) } else { pickups.push(series) }
                }
            }
            doc.push_str(&format!("| static partitioning: {what} | - | never | never | never | {never} |\n"));
        }
        doc.push('\n');
        let (pg_pick_1s, pg_take_1s) = (pg_1s[0], pg_1s[1]);
        headlines.push(format!(
            "Release pickup p50: PostgreSQL SKIP LOCKED (1 s poll) / ours **{}** ({:.1} ms for ours).",
            ratio(pg_pick_1s, pct(&ours_pickup, 50.0)),
            pct(&ours_pickup, 50.0)
        ));
        headlines.push(format!(
            "Takeover after `kill -9` p99, lease 3 s: PostgreSQL SKIP LOCKED (1 s poll) / ours **{}**; static \
             partitioning never takes over.",
            ratio(pg_take_1s, pct(&ours_takeover, 99.0))
        ));
        plots::lines(
            &plots_dir.join("pickup.svg"),
            "Release pickup (cumulative)",
            "ms (log)",
            "fraction of handovers",
            &pickups,
            true,
        )?;
        plots::lines(
            &plots_dir.join("takeover.svg"),
            "Takeover after a kill, lease 3 s (cumulative)",
            "ms",
            "fraction of handovers",
            &takeovers,
            false,
        )?;
        writeln!(
            doc,
            "![release pickup]({})\n\n![takeover after a kill]({})\n",
            rel("pickup.svg"),
            rel("takeover.svg")
        )?;

        let (splits, records) = if a.quick { (8, 40) } else { (32, 400) };
        let work = || world::Work::new(splits, records, cost).tracked();
        writeln!(
            doc,
            "### A replica killed part way ({splits} splits x {records} records, 2 replicas of 4 lanes, killed at 45% of the records)\n\n\
             | system | makespan s | records emitted twice | records never emitted |\n|---|---|---|---|"
        )?;
        let ours = bounded("failure (ours)", limit, scenarios::failure_ours(t, work())).await?;
        let row = |name: &str, f: &scenarios::Failure| {
            format!(
                "| {name} | {} | {} | {} |\n",
                f.makespan.map_or("never".into(), |m| format!("{m:.2}")),
                f.duplicates,
                f.missing
            )
        };
        doc.push_str(&row("etl-coordination", &ours));
        if let Some(pg) = &a.postgres {
            let f = bounded(
                "failure (PostgreSQL)",
                limit,
                scenarios::failure_pg(pg, work(), Duration::from_secs(1)),
            )
            .await?;
            doc.push_str(&row("PostgreSQL SKIP LOCKED, poll 1 s", &f));
        }
        let f = scenarios::failure_static(work()).await;
        doc.push_str(&row("static partitioning", &f));
        writeln!(
            doc,
            "\nRecords emitted twice are the killed replica's records after its last commit (at-least-once); \
             a commit every second bounds them.\n"
        )?;
    }

    if want("COST") {
        eprintln!("== cost curve");
        let window = Duration::from_secs(if a.quick { 3 } else { 30 });
        let (by_splits, by_workers): (&[usize], &[usize]) =
            if a.quick { (&[100, 500], &[2, 4]) } else { (&[1_000, 10_000, 100_000], &[2, 8, 32, 64]) };
        let small = by_splits[0];
        writeln!(
            doc,
            "## Cost curve ({})\n\nIn-process workers of 8 lanes on one server, lease 3 s, a record every 100 ms \
             per lane and a commit per lane and second; per worker and second over a {} s window in steady state \
             (it holds one resync listing, every 10 leases). CPU is the process's, shared out per worker.\n\n\
             | splits | workers | store ops/s per worker | of which writes | CPU per worker (fraction of a core) |\n|---|---|---|---|---|",
            t.name,
            window.as_secs()
        )?;
        let mut points = Vec::new();
        for &s in by_splits {
            points.push(bounded("cost", limit, scenarios::cost(t, s, 2, window)).await?);
        }
        for &w in &by_workers[1..] {
            points.push(bounded("cost", limit, scenarios::cost(t, small, w, window)).await?);
        }
        for c in &points {
            writeln!(
                doc,
                "| {} | {} | {:.1} | {:.1} | {:.3} |",
                c.splits, c.workers, c.ops, c.writes, c.cpu
            )?;
        }
        let split_pts = |f: fn(&scenarios::Cost) -> f64| -> Vec<(f64, f64)> {
            points.iter().filter(|c| c.workers == 2).map(|c| (c.splits as f64, f(c))).collect()
        };
        let worker_pts = |f: fn(&scenarios::Cost) -> f64| -> Vec<(f64, f64)> {
            points.iter().filter(|c| c.splits == small).map(|c| (c.workers as f64, f(c))).collect()
        };
        plots::lines(
            &plots_dir.join("cost-splits.svg"),
            "Cost per worker as splits grow (2 workers)",
            "splits (log)",
            "per worker and second",
            &[
                Series { name: "store ops/s".into(), points: split_pts(|c| c.ops) },
                Series { name: "CPU, % of a core".into(), points: split_pts(|c| c.cpu * 100.0) },
            ],
            true,
        )?;
        plots::lines(
            &plots_dir.join("cost-workers.svg"),
            &format!("Cost per worker as workers grow ({small} splits)"),
            "workers (log)",
            "per worker and second",
            &[
                Series { name: "store ops/s".into(), points: worker_pts(|c| c.ops) },
                Series { name: "CPU, % of a core".into(), points: worker_pts(|c| c.cpu * 100.0) },
            ],
            true,
        )?;
        writeln!(
            doc,
            "\n![cost as splits grow]({})\n\n![cost as workers grow]({})\n",
            rel("cost-splits.svg"),
            rel("cost-workers.svg")
        )?;
    }

    let mut out = String::new();
    writeln!(out, "# Benchmarks\n")?;
    writeln!(
        out,
        "Generated by `{}` on {} ({}). Every figure below comes from that run; \
         workers are in-process pipelines, each with a NATS connection of its own.{}\n",
        if a.command.is_empty() { "etl-coordination-bench" } else { &a.command },
        today(),
        machine(),
        if a.quick { " **Quick run: too few samples to mean anything.**" } else { "" }
    )?;
    if !headlines.is_empty() {
        writeln!(out, "## Headline\n")?;
        for h in &headlines {
            writeln!(out, "- {h}")?;
        }
        out.push('\n');
    }
    out.push_str(&doc);
    match &a.out {
        Some(path) => std::fs::write(path, &out).with_context(|| format!("writing {path}"))?,
        None => print!("{out}"),
    }
    Ok(())
}
