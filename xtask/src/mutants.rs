//! `cargo xtask mutants`: the checkers have teeth. Every entry of the catalogue
//! (`xtask/mutants.txt`) is a one-line protocol bug kept as a source patch: a string that must
//! occur exactly once in a file, and what replaces it. Each mutant is applied on its own to a
//! copy of the workspace (under `target/mutants/`, built with a target directory of its own so
//! the main build is untouched and mutants share what did not change) and the simulation sweep
//! runs against it, stopping at the first violation; if the sweep passed, the simulator's own
//! suite (`tests/simulation.rs`: the named scenarios, such as a live twin with the same
//! instance id), then the core's rule tests (`worker_rules.rs`: interleavings too rare for a
//! sweep, such as a deposed leader's garbage collection, or harmless to safety, such as a
//! stale read adopted and then fenced by a CAS), then the core's unit tests (the breaker's
//! rarer paths). A sweep that passes but quarantined a healthy split catches the mutant too
//! (an attempt-accounting bug the checkers agree with). A mutant is caught by the first net
//! that fails, and the table says which; it survives when all pass. Every mutant must be caught.
//!
//! Too slow for every CI run (a release build per mutant); run it before resolving anything
//! that touches the core or the simulator (README, "Run the tests").

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};

use crate::util::target_dir;

/// One catalogued bug.
#[derive(Debug, Clone, Default)]
struct Mutant {
    name: String,
    rule: String,
    what: String,
    file: String,
    find: String,
    replace: String,
}

/// How one mutant's sweep ended.
enum Verdict {
    Caught(String),
    Survived,
    TimedOut,
}

/// The workspace root (the parent of `xtask/`).
fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// Parses the catalogue: `[name]` sections of `key = value` lines; `#` starts a comment line.
fn parse(text: &str) -> Result<Vec<Mutant>> {
    let mut out: Vec<Mutant> = Vec::new();
    for (n, line) in text.lines().enumerate() {
        let line_no = n + 1;
        let trimmed = line.trim();
        if trimmed.is_empty() || trimmed.starts_with('#') {
            continue;
        }
        if let Some(name) = trimmed.strip_prefix('[').and_then(|l| l.strip_suffix(']')) {
            out.push(Mutant { name: name.to_owned(), ..Mutant::default() });
            continue;
        }
        let Some(m) = out.last_mut() else {
            bail!("mutants.txt line {line_no}: a `key = value` line before the first [name]");
        };
        let Some((key, value)) = line.split_once(" = ") else {
            bail!("mutants.txt line {line_no}: expected `key = value`, got {line:?}");
        };
        let value = value.to_owned();
        match key.trim() {
            "rule" => m.rule = value,
            "what" => m.what = value,
            "file" => m.file = value,
            "find" => m.find = value,
            "replace" => m.replace = value,
            other => bail!("mutants.txt line {line_no}: unknown key {other:?} in [{}]", m.name),
        }
    }
    let mut names = BTreeSet::new();
    for m in &out {
        if !names.insert(m.name.clone()) {
            bail!("mutants.txt: [{}] appears twice", m.name);
        }
        if m.file.is_empty() || m.find.is_empty() || m.rule.is_empty() || m.what.is_empty() {
            bail!("mutants.txt: [{}] needs rule, what, file, find and replace", m.name);
        }
        if m.find == m.replace {
            bail!("mutants.txt: [{}] replaces {:?} with itself", m.name, m.find);
        }
    }
    Ok(out)
}

/// The patched text of `m.file`, or why the patch no longer applies.
fn apply(m: &Mutant, original: &str) -> Result<String> {
    match original.matches(&m.find).count() {
        1 => Ok(original.replacen(&m.find, &m.replace, 1)),
        0 => bail!("[{}]: {:?} no longer occurs in {} (update the catalogue)", m.name, m.find, m.file),
        n => bail!("[{}]: {:?} occurs {n} times in {}; make it unique", m.name, m.find, m.file),
    }
}

/// Copies the workspace sources (everything but `target/` and `.git/`) into `to`, only files
/// whose content differs, so cargo rebuilds only what a mutant changed.
fn sync(from: &Path, to: &Path) -> Result<()> {
    std::fs::create_dir_all(to)?;
    for entry in std::fs::read_dir(from)? {
        let entry = entry?;
        let name = entry.file_name();
        if name == "target" || name == ".git" {
            continue;
        }
        let (src, dst) = (entry.path(), to.join(&name));
        if entry.file_type()?.is_dir() {
            sync(&src, &dst)?;
        } else {
            let data = std::fs::read(&src)?;
            if std::fs::read(&dst).ok().as_deref() != Some(data.as_slice()) {
                std::fs::write(&dst, data).with_context(|| format!("writing {}", dst.display()))?;
            }
        }
    }
    Ok(())
}

/// Runs `cargo args..` in the copy at `ws` (its own target directory), its output going to a
/// file (a pipe could fill up and stall it); `None` when it did not finish within `limit`,
/// else whether it succeeded and what it printed.
fn cargo_in(ws: &Path, target: &Path, args: &[&str], limit: Duration) -> Result<Option<(bool, String)>> {
    let log = target.join("mutants-last-run.log");
    std::fs::create_dir_all(target)?;
    let file = std::fs::File::create(&log)?;
    let mut child = Command::new(env!("CARGO"))
        .args(args)
        .current_dir(ws)
        .env("CARGO_TARGET_DIR", target)
        .env("RUST_BACKTRACE", "0")
        .stdout(Stdio::from(file.try_clone()?))
        .stderr(Stdio::from(file))
        .spawn()
        .context("running cargo")?;
    let t0 = Instant::now();
    loop {
        if let Some(status) = child.try_wait()? {
            return Ok(Some((status.success(), std::fs::read_to_string(&log)?)));
        }
        if t0.elapsed() > limit {
            let _ = child.kill();
            let _ = child.wait();
            return Ok(None);
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// Builds and sweeps the copy at `ws`, stopping at the first violation.
fn sweep(ws: &Path, target: &Path, seeds: u64, limit: Duration) -> Result<Option<(bool, String)>> {
    let seeds = seeds.to_string();
    let args = [
        "run",
        "--release",
        "--quiet",
        "--package",
        "xtask",
        "--",
        "sim",
        "--seeds",
        &seeds,
        "--stop-on-violation",
    ];
    cargo_in(ws, target, &args, limit)
}

/// What caught the mutant: the first violation line of the sweep's summary.
fn first_violation(output: &str) -> Option<String> {
    output.lines().find_map(|l| l.trim().strip_prefix("VIOLATION ").map(str::to_owned))
}

/// A healthy split quarantined in a sweep that passed: caught too (an attempt-accounting bug
/// the checkers agree with, e.g. an outage charged as if the split had crashed its owner).
fn healthy_quarantined(output: &str) -> Option<String> {
    output.lines().find_map(|l| {
        l.trim().strip_prefix("HEALTHY QUARANTINED ").map(|s| format!("healthy split quarantined, {s}"))
    })
}

/// The test suites run after the sweep, in order: (label, package, test target; `None`: the
/// package's unit tests, e.g. the breaker's, whose rarer paths random schedules seldom reach).
const SUITES: [(&str, &str, Option<&str>); 3] = [
    ("scenario test", "etl-coordination-tests", Some("simulation")),
    ("rule test", "etl-coordination-core", Some("worker_rules")),
    ("unit test", "etl-coordination-core", None),
];

/// Runs every suite of [`SUITES`] in the copy; `None` on a timeout, else the first failing test
/// with its message.
fn suites(ws: &Path, target: &Path, limit: Duration) -> Result<Option<Option<String>>> {
    for (label, package, test) in SUITES {
        match suite(ws, target, label, package, test, limit)? {
            Some(None) => {}
            other => return Ok(other),
        }
    }
    Ok(Some(None))
}

/// Runs one test target in the copy; `None` on a timeout, else the first failing test with its
/// message.
fn suite(
    ws: &Path,
    target: &Path,
    label: &str,
    package: &str,
    test: Option<&str>,
    limit: Duration,
) -> Result<Option<Option<String>>> {
    let which = match test {
        Some(t) => ["--test", t],
        None => ["--lib", "--"],
    };
    let args = ["test", "--release", "--quiet", "--package", package, which[0], which[1]];
    let Some((passed, text)) = cargo_in(ws, target, &args, limit)? else { return Ok(None) };
    if passed {
        return Ok(Some(None));
    }
    let failed = text
        .lines()
        .find_map(|l| l.strip_prefix("thread '").and_then(|r| r.split_once('\'')).map(|(t, _)| t.to_owned()))
        .zip(text.lines().skip_while(|l| !l.contains("panicked at")).nth(1))
        .map(|(name, msg)| format!("{label} {name}: {}", msg.trim()))
        .unwrap_or_else(|| format!("{label}s failed:\n{text}"));
    Ok(Some(Some(failed)))
}

pub fn run(args: &[String]) -> Result<()> {
    let (seeds, only) = parse_args(args)?;
    let root = root();
    let mutants = select(&root, only.as_deref())?;
    let base = target_dir().join("mutants");
    let (ws, target) = (base.join("ws"), base.join("target"));
    sync(&root, &ws)?;
    let limit = Duration::from_secs(20 * 60);
    baseline(&ws, &target, seeds, limit)?;
    let mut rows = Vec::new();
    for m in &mutants {
        let t0 = Instant::now();
        let verdict = judge(m, &ws, &target, seeds, limit)?;
        let secs = t0.elapsed().as_secs_f64();
        let shown = match &verdict {
            Verdict::Caught(v) => format!("caught   {v}"),
            Verdict::Survived => "SURVIVED".to_owned(),
            Verdict::TimedOut => format!("caught   (the sweep did not finish within {limit:?}: livelock)"),
        };
        println!("{:<40} {:<4} {secs:>5.0}s  {}", m.name, m.rule, truncate(&shown, 150));
        rows.push((m, verdict));
    }
    print_table(&rows);
    let survived: Vec<&str> =
        rows.iter().filter(|(_, v)| matches!(v, Verdict::Survived)).map(|(m, _)| m.name.as_str()).collect();
    println!();
    println!("{} mutants, {} caught, {} survived", rows.len(), rows.len() - survived.len(), survived.len());
    if !survived.is_empty() {
        bail!("mutants survived the sweep ({seeds} seeds): {survived:?}; the checkers miss these bugs");
    }
    Ok(())
}

/// `--seeds N` (default 2,000) and `--only NAME[,NAME...]`.
fn parse_args(args: &[String]) -> Result<(u64, Option<String>)> {
    let mut seeds = 2_000;
    let mut only: Option<String> = None;
    let mut it = args.iter();
    while let Some(a) = it.next() {
        match a.as_str() {
            "--seeds" => {
                let v = it.next().context("--seeds needs a value")?;
                seeds = v.parse().with_context(|| format!("--seeds expects a number, got {v:?}"))?;
            }
            "--only" => only = Some(it.next().context("--only needs a mutant name")?.clone()),
            other => bail!("usage: cargo xtask mutants [--seeds N] [--only NAME[,NAME...]] (got {other:?})"),
        }
    }
    Ok((seeds, only))
}

/// The catalogue's mutants (those named by `only`), each checked to apply before anything is
/// built.
fn select(root: &Path, only: Option<&str>) -> Result<Vec<Mutant>> {
    let catalogue =
        std::fs::read_to_string(root.join("xtask/mutants.txt")).context("reading xtask/mutants.txt")?;
    let mut mutants = parse(&catalogue)?;
    if let Some(names) = only {
        let names: Vec<&str> = names.split(',').collect();
        if let Some(unknown) = names.iter().find(|n| !mutants.iter().any(|m| m.name == **n)) {
            bail!("no mutant named {unknown:?} in xtask/mutants.txt");
        }
        mutants.retain(|m| names.contains(&m.name.as_str()));
    }
    for m in &mutants {
        let original = std::fs::read_to_string(root.join(&m.file))
            .with_context(|| format!("[{}]: reading {}", m.name, m.file))?;
        apply(m, &original)?;
    }
    Ok(mutants)
}

/// A sweep of the unmutated copy must pass, or nothing below means anything.
fn baseline(ws: &Path, target: &Path, seeds: u64, limit: Duration) -> Result<()> {
    println!("baseline: {seeds} seeds, the simulator's suite and the rule tests on the unmutated workspace");
    let t0 = Instant::now();
    match sweep(ws, target, seeds, limit)? {
        Some((true, out)) if healthy_quarantined(&out).is_some() => {
            bail!("the unmutated workspace's sweep quarantines healthy splits:\n{out}")
        }
        Some((true, _)) => match suites(ws, target, limit)? {
            Some(None) => println!("baseline passed in {:.0}s", t0.elapsed().as_secs_f64()),
            Some(Some(failed)) => bail!("the unmutated workspace fails a suite: {failed}"),
            None => bail!("the unmutated workspace's suites did not finish within {limit:?}"),
        },
        Some((false, out)) => bail!("the unmutated workspace fails its sweep:\n{out}"),
        None => bail!("the unmutated workspace's sweep did not finish within {limit:?}"),
    }
    Ok(())
}

/// Applies `m` to the copy, runs the nets in order (the sweep, then the suites), and puts the
/// file back as it was.
fn judge(m: &Mutant, ws: &Path, target: &Path, seeds: u64, limit: Duration) -> Result<Verdict> {
    // The original is the copy's (synced once at the start), never the live tree's: edits made
    // while a run is under way must not leak into it.
    let path = ws.join(&m.file);
    let original = std::fs::read_to_string(&path)?;
    std::fs::write(&path, apply(m, &original)?)?;
    let result = sweep(ws, target, seeds, limit).and_then(|r| match r {
        Some((true, out)) if healthy_quarantined(&out).is_some() => Ok((Some((true, out)), Some(None))),
        Some((true, _)) => Ok((Some((true, String::new())), suites(ws, target, limit)?)),
        other => Ok((other, Some(None))),
    });
    std::fs::write(&path, &original)?;
    Ok(match result? {
        (Some((true, out)), _) if healthy_quarantined(&out).is_some() => {
            Verdict::Caught(healthy_quarantined(&out).unwrap_or_default())
        }
        (None, _) | (_, None) => Verdict::TimedOut,
        (Some((true, _)), Some(None)) => Verdict::Survived,
        (Some((true, _)), Some(Some(failed))) => Verdict::Caught(failed),
        (Some((false, out)), _) => match first_violation(&out) {
            Some(v) => Verdict::Caught(v),
            None => bail!("[{}]: the mutant does not build or the sweep failed to run:\n{out}", m.name),
        },
    })
}

/// The table of every mutant and its verdict (for docs/DESIGN.md and the closing notes).
fn print_table(rows: &[(&Mutant, Verdict)]) {
    println!();
    println!("| mutant | rule | bug | verdict |");
    println!("|---|---|---|---|");
    for (m, v) in rows {
        let verdict = match v {
            Verdict::Caught(s) => format!("caught: {}", truncate(s, 110)),
            Verdict::Survived => "**survived**".to_owned(),
            Verdict::TimedOut => "caught: livelock (sweep timed out)".to_owned(),
        };
        println!("| {} | {} | {} | {} |", m.name, m.rule, m.what, verdict.replace('|', "/"));
    }
}

fn truncate(s: &str, max: usize) -> String {
    if s.chars().count() <= max {
        s.to_owned()
    } else {
        format!("{}...", s.chars().take(max).collect::<String>())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_catalogue_parses_and_every_patch_applies_exactly_once() {
        let text = std::fs::read_to_string(root().join("xtask/mutants.txt")).unwrap();
        let mutants = parse(&text).unwrap();
        assert!(mutants.len() >= 30, "{} mutants", mutants.len());
        for m in &mutants {
            let original = std::fs::read_to_string(root().join(&m.file)).unwrap();
            apply(m, &original).unwrap();
        }
    }

    #[test]
    fn a_patch_that_matches_twice_or_never_is_refused() {
        let m = Mutant {
            name: "x".into(),
            find: "a".into(),
            replace: "b".into(),
            file: "f".into(),
            ..Mutant::default()
        };
        assert!(apply(&m, "a a").unwrap_err().to_string().contains("2 times"));
        assert!(apply(&m, "c").unwrap_err().to_string().contains("no longer occurs"));
        assert_eq!(apply(&m, "xay").unwrap(), "xby");
    }
}
