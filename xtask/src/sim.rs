//! `cargo xtask sim`: a sweep of seeds on every core with a summary (and trace hashes), or one
//! seed reproduced exactly with the options it drew.

use std::collections::BTreeMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use anyhow::{Context, Result, bail};
use etl_coordination_sim::{Options, Report};

use crate::flag;

pub(crate) fn run(args: &[String]) -> Result<()> {
    let stop_early = args.iter().any(|a| a == "--stop-on-violation");
    let args: Vec<String> = args.iter().filter(|a| *a != "--stop-on-violation").cloned().collect();
    let args = args.as_slice();
    for pair in args.chunks(2) {
        if !["--seed", "--seeds", "--start", "--hashes"].contains(&pair[0].as_str()) || pair.len() < 2 {
            bail!(
                "usage: cargo xtask sim --seeds N [--start S] [--stop-on-violation] [--hashes FILE] | --seed S (got {args:?})"
            );
        }
    }
    let hashes = args.chunks(2).find(|p| p[0] == "--hashes").map(|p| std::path::PathBuf::from(&p[1]));
    if let Some(seed) = flag(args, "--seed")? {
        // The options the seed drew come first: what a failing seed exercised is read, not
        // guessed (they are a pure function of the seed).
        let options = Options::for_seed(seed);
        println!("seed {seed} drew {options:#?}");
        let report = etl_coordination_sim::run(seed, &options);
        print_one(&report);
        if let Some(v) = &report.violation {
            bail!("seed {seed}: {v}");
        }
        return Ok(());
    }
    let seeds = flag(args, "--seeds")?.unwrap_or(200);
    let start = flag(args, "--start")?.unwrap_or(0);
    let agg = sweep_all(start, seeds, stop_early)?;
    if let Some(path) = hashes {
        // One line per seed, in seed order: two files from runs of the same seeds compare with
        // `cmp` (a restructure that must not change behaviour keeps every hash).
        let text: String = agg.hashes.iter().map(|(seed, h)| format!("{seed} {h:016x}\n")).collect();
        std::fs::write(&path, text).with_context(|| format!("writing {}", path.display()))?;
        println!("  trace hashes of {} seeds written to {}", agg.hashes.len(), path.display());
    }
    agg.verdict().map(|_| ())
}

fn print_one(r: &Report) {
    println!(
        "seed {}: outcome {}, {} events, {:.1}s virtual",
        r.seed,
        r.outcome,
        r.events,
        r.virtual_time.as_secs_f64()
    );
    println!("  faults: {:?}", r.faults);
    println!("  acquisitions: {:?}", r.acquisitions);
    println!("  steals: {} started, {:?}", r.steals, r.handovers);
    println!("  checks: {:?}", r.checks);
    println!(
        "  records: {} in input, {} emitted ({} replayed)",
        r.records_total,
        r.records_emitted,
        r.records_emitted.saturating_sub(r.records_total)
    );
    println!("  trace hash: {:016x}", r.trace_hash);
    for h in &r.healthy_quarantined {
        println!("  healthy split quarantined: {h}");
    }
    for h in &r.collateral_quarantined {
        println!("  healthy split quarantined beside a poison split that crashes its owner: {h}");
    }
    if let Some(v) = &r.violation {
        println!("  VIOLATION: {v}");
    }
}

/// Runs `count` seeds on every core and prints one summary; returns the seeds that stalled
/// without a poison split (healthy splits quarantined). With `stop_early`, the sweep ends at
/// the first violation (the mutation runs only need to know whether one is caught).
/// Runs seeds `start..start + count` on every core, prints the summary and fails on the first
/// violation; returns the seeds that stalled without a poison split.
pub(crate) fn sweep(start: u64, count: u64, stop_early: bool) -> Result<Vec<u64>> {
    sweep_all(start, count, stop_early)?.verdict()
}

/// [`sweep`], returning the aggregate (with every seed's trace hash) instead of the verdict.
fn sweep_all(start: u64, count: u64, stop_early: bool) -> Result<Agg> {
    let t0 = Instant::now();
    let next = AtomicU64::new(start);
    let stop = std::sync::atomic::AtomicBool::new(false);
    let end = start + count;
    let agg: Mutex<Agg> = Mutex::new(Agg::default());
    let threads = std::thread::available_parallelism().map_or(2, |n| n.get());
    std::thread::scope(|s| {
        for _ in 0..threads {
            s.spawn(|| {
                loop {
                    let seed = next.fetch_add(1, Ordering::Relaxed);
                    if seed >= end || stop.load(Ordering::Relaxed) {
                        return;
                    }
                    // A panic in the core is a bug like any violation: report it with its seed.
                    let r = std::panic::catch_unwind(|| {
                        etl_coordination_sim::run(seed, &Options::for_seed(seed))
                    });
                    let mut agg = agg.lock().unwrap_or_else(|e| e.into_inner());
                    match r {
                        Ok(r) => {
                            agg.add(&r);
                            if stop_early && r.violation.is_some() {
                                stop.store(true, Ordering::Relaxed);
                            }
                        }
                        Err(panic) => {
                            if stop_early {
                                stop.store(true, Ordering::Relaxed);
                            }
                            let msg = panic
                                .downcast_ref::<String>()
                                .cloned()
                                .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
                                .unwrap_or_default();
                            agg.failures.push((seed, format!("panic: {msg}")));
                            agg.failures.sort();
                        }
                    }
                }
            });
        }
    });
    let mut agg = agg.into_inner().unwrap_or_else(|e| e.into_inner());
    println!("simulation sweep: seeds {start}..{end} in {:.1}s", t0.elapsed().as_secs_f64());
    println!("  events: {}", agg.events);
    println!("  faults injected: {:?}", agg.faults);
    println!("  invariant checks: {:?}", agg.checks);
    println!("  outcomes: {:?}", agg.outcomes);
    println!("  acquisitions: {:?}", agg.acquisitions);
    println!("  steals: {} started, {:?}", agg.steals, agg.handovers);
    println!("  data: {:?}", agg.stats);
    if !agg.innocent.is_empty() {
        let shown: Vec<u64> = agg.innocent.iter().take(20).copied().collect();
        println!("  stalled without poison (healthy splits quarantined), first seeds: {shown:?}");
    }
    // Each healthy split quarantined, with the causes of its charges: not a violation (a
    // crash loop of four tenancies without progress quarantines by design), but the mutation
    // runs count it as caught (an attempt-accounting bug the checkers agree with shows here).
    agg.healthy.sort();
    for (seed, what) in agg.healthy.iter().take(20) {
        println!("  HEALTHY QUARANTINED seed {seed}: {what}");
    }
    if !agg.healthy.is_empty() {
        println!("  healthy splits quarantined: {} (in {} seeds)", agg.healthy.len(), {
            let mut seeds: Vec<u64> = agg.healthy.iter().map(|(s, _)| *s).collect();
            seeds.dedup();
            seeds.len()
        });
    }

    agg.hashes.sort();
    agg.count = count;
    Ok(agg)
}

#[derive(Default)]
struct Agg {
    events: u64,
    faults: BTreeMap<&'static str, u64>,
    checks: BTreeMap<&'static str, u64>,
    outcomes: BTreeMap<&'static str, u64>,
    acquisitions: BTreeMap<&'static str, u64>,
    steals: u64,
    handovers: BTreeMap<&'static str, u64>,
    stats: BTreeMap<&'static str, u64>,
    failures: Vec<(u64, String)>,
    /// Seeds that stalled without a poison split (healthy splits quarantined).
    innocent: Vec<u64>,
    /// Healthy splits quarantined: (seed, split and the causes of its charges).
    healthy: Vec<(u64, String)>,
    /// Every seed run and its trace hash (in seed order once the sweep is over).
    hashes: Vec<(u64, u64)>,
    /// How many seeds were asked for.
    count: u64,
}

impl Agg {
    /// Prints the violations; the seeds that stalled without poison when there are none.
    fn verdict(self) -> Result<Vec<u64>> {
        if self.failures.is_empty() {
            println!("  violations: none");
            return Ok(self.innocent);
        }
        for (seed, v) in &self.failures {
            println!("  VIOLATION seed {seed}: {v}");
            println!("    reproduce: cargo xtask sim --seed {seed}");
        }
        bail!("{} of {} seeds violated an invariant", self.failures.len(), self.count)
    }
}

impl Agg {
    fn add(&mut self, r: &Report) {
        self.hashes.push((r.seed, r.trace_hash));
        self.events += r.events;
        for (k, v) in &r.faults {
            *self.faults.entry(k).or_default() += v;
        }
        for (k, v) in &r.checks {
            *self.checks.entry(k).or_default() += v;
        }
        self.steals += r.steals;
        for (k, v) in &r.handovers {
            *self.handovers.entry(k).or_default() += v;
        }
        for (k, v) in &r.acquisitions {
            *self.acquisitions.entry(k).or_default() += v;
        }
        *self.outcomes.entry(r.outcome).or_default() += 1;
        if r.poison_splits == 0 && r.outcome == "stalled" {
            *self.outcomes.entry("stalled_without_poison").or_default() += 1;
            self.innocent.push(r.seed);
            self.innocent.sort();
        }
        *self.stats.entry("splits_quarantined").or_default() += r.quarantined as u64;
        self.healthy.extend(r.healthy_quarantined.iter().map(|h| (r.seed, h.clone())));
        *self.stats.entry("healthy_splits_quarantined_beside_a_crashing_poison_split").or_default() +=
            r.collateral_quarantined.len() as u64;
        *self.stats.entry("records_in_input").or_default() += r.records_total;
        *self.stats.entry("records_replayed").or_default() +=
            r.records_emitted.saturating_sub(r.records_total);
        *self.stats.entry("steals_after_faults").or_default() += r.steals_after_faults;
        let e = self.stats.entry("max_steals_after_faults_in_one_run").or_default();
        *e = (*e).max(r.steals_after_faults);
        if let Some(v) = &r.violation {
            self.failures.push((r.seed, v.to_string()));
            self.failures.sort();
        }
    }
}
