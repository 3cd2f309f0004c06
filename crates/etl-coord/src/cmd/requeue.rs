//! `etl-coord requeue`: a quarantined split back in the queue (or every one, or those whose
//! last error matches), or any split started over.

use std::process::ExitCode;

use etl_coord::ops;
use etl_coordination_driver::SplitId;

use super::{StoreArgs, Usage, open_job, parse_split};

#[derive(clap::Args, Debug)]
pub(crate) struct RequeueArgs {
    #[command(flatten)]
    pub(crate) store: StoreArgs,
    /// The split's id (quarantined, unless --reset).
    #[arg(long, value_parser = parse_split, required_unless_present = "state", conflicts_with = "state")]
    pub(crate) split: Option<String>,
    /// Requeue every split in this state (only `quarantined`), after listing them and asking
    /// (unless --yes): attempts reset, progress kept, offered to workers again.
    #[arg(long, value_parser = ["quarantined"], ignore_case = true, conflicts_with = "reset")]
    pub(crate) state: Option<String>,
    /// With --state: only splits whose last error contains this text (case-sensitive), e.g.
    /// the message of a sink outage that has been fixed.
    #[arg(long, requires = "state")]
    pub(crate) error_contains: Option<String>,
    /// With --state: list what would be requeued, change nothing.
    #[arg(long, requires = "state")]
    pub(crate) dry_run: bool,
    /// Rewrite the split's record from its descriptor, whatever it holds (an undecodable
    /// value, a Done split to run again, a stuck owner, which is fenced): progress from the
    /// start, attempts 0, back in the queue. Every record of the split is emitted again
    /// (at-least-once). Asks for confirmation unless --yes; any answer but y leaves the split
    /// as it is and exits 1.
    #[arg(long)]
    pub(crate) reset: bool,
    /// Do not ask for confirmation (--reset, --state).
    #[arg(short, long)]
    pub(crate) yes: bool,
}

impl RequeueArgs {
    /// What one flag's parser cannot check.
    pub(crate) fn validate(&self) -> Result<(), Usage> {
        if self.yes && !self.reset && self.state.is_none() {
            return Err(Usage::new("--yes", "only --reset and --state ask for confirmation"));
        }
        if self.error_contains.as_deref() == Some("") {
            return Err(Usage::new(
                "--error-contains",
                "must not be empty (leave it out to requeue every split)",
            ));
        }
        self.store.validate()
    }
}

/// Requeues the split, or resets it after confirmation.
pub(crate) async fn run(a: RequeueArgs) -> anyhow::Result<ExitCode> {
    let stores = open_job(&a.store).await?;
    let Some(split) = a.split.clone() else { return run_bulk(&a, &stores).await };
    let split = SplitId::new(split)?;
    if !a.reset {
        ops::requeue(&stores, &split).await?;
        println!("split {split} requeued: attempts reset, offered to workers again");
        return Ok(ExitCode::SUCCESS);
    }
    let plan = ops::plan_reset(&stores, &split).await?;
    if !a.yes && !confirm(&plan)? {
        println!("split {split} left as it is");
        return Ok(ExitCode::from(1));
    }
    ops::apply_reset(&stores, &plan).await?;
    println!("split {split} reset: it starts over from the beginning, offered to workers again");
    Ok(ExitCode::SUCCESS)
}

/// `--state quarantined`: lists the splits, asks, requeues each by a CAS.
async fn run_bulk<S: etl_coordination_store::Store>(
    a: &RequeueArgs,
    stores: &etl_coordination_driver::JobStores<S>,
) -> anyhow::Result<ExitCode> {
    let plan = ops::plan_requeue(stores, a.error_contains.as_deref()).await?;
    let filter =
        a.error_contains.as_ref().map_or(String::new(), |t| format!(" whose last error contains {t:?}"));
    let skipped = if plan.not_matching > 0 {
        format!(" ({} other quarantined splits do not match)", plan.not_matching)
    } else {
        String::new()
    };
    if plan.splits.is_empty() {
        println!("no quarantined split{filter}{skipped}: nothing to requeue");
        return Ok(ExitCode::SUCCESS);
    }
    println!("{} quarantined splits{filter}{skipped}:", plan.splits.len());
    for (id, _, rec) in &plan.splits {
        println!("  {id}  attempts {}  {}", rec.attempts, rec.last_error.as_deref().unwrap_or(""));
    }
    if a.dry_run {
        println!("dry run: nothing changed");
        return Ok(ExitCode::SUCCESS);
    }
    let what = format!(
        "Requeueing returns these {} splits to the queue with their attempts reset and their \
         progress kept.",
        plan.splits.len()
    );
    if !a.yes && !ask(&what, "Requeue them?", "--state")? {
        println!("nothing requeued");
        return Ok(ExitCode::from(1));
    }
    let report = ops::apply_requeue(stores, &plan).await?;
    println!("{} splits requeued: attempts reset, offered to workers again", report.requeued.len());
    if !report.changed.is_empty() {
        let ids: Vec<String> = report.changed.iter().map(|s| s.to_string()).collect();
        println!(
            "{} splits changed since they were listed and were left as they are: {}",
            ids.len(),
            ids.join(", ")
        );
    }
    Ok(ExitCode::SUCCESS)
}

/// Asks on the terminal before a reset; without a terminal to ask on, a usage error (exit 2)
/// that names --yes.
fn confirm(plan: &ops::ResetPlan) -> anyhow::Result<bool> {
    let what = format!(
        "split {} is now: {}. A reset starts it over from the beginning: every record of it is \
         emitted again, and a worker holding it is fenced.",
        plan.split, plan.current
    );
    ask(&what, "Reset it?", "--reset")
}

/// Prints `what` and asks `question` on the terminal; without a terminal to ask on, a usage
/// error (exit 2) that names --yes.
fn ask(what: &str, question: &str, flag: &str) -> anyhow::Result<bool> {
    use std::io::{BufRead, IsTerminal, Write};
    if !std::io::stdin().is_terminal() {
        crate::exit_usage(
            clap::error::ErrorKind::MissingRequiredArgument,
            format!("{flag} needs confirmation and stdin is not a terminal: {what} Add --yes to go ahead."),
        );
    }
    eprint!("{what}\n{question} [y/N] ");
    std::io::stderr().flush()?;
    let mut answer = String::new();
    std::io::stdin().lock().read_line(&mut answer)?;
    Ok(matches!(answer.trim(), "y" | "Y" | "yes" | "YES" | "Yes"))
}
