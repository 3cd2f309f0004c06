//! `etl-coord requeue`: a quarantined split back in the queue, or any split started over.

use std::process::ExitCode;

use etl_coord::ops;
use etl_coordination_driver::SplitId;

use super::{StoreArgs, Usage, open_stores, parse_split};

#[derive(clap::Args, Debug)]
pub(crate) struct RequeueArgs {
    #[command(flatten)]
    pub(crate) store: StoreArgs,
    /// The split's id (quarantined, unless --reset).
    #[arg(long, value_parser = parse_split)]
    pub(crate) split: String,
    /// Rewrite the split's record from its descriptor, whatever it holds (an undecodable
    /// value, a Done split to run again, a stuck owner, which is fenced): progress from the
    /// start, attempts 0, back in the queue. Every record of the split is emitted again
    /// (at-least-once). Asks for confirmation unless --yes; any answer but y leaves the split
    /// as it is and exits 1.
    #[arg(long)]
    pub(crate) reset: bool,
    /// Do not ask for confirmation (--reset).
    #[arg(short, long, requires = "reset")]
    pub(crate) yes: bool,
}

impl RequeueArgs {
    /// What one flag's parser cannot check.
    pub(crate) fn validate(&self) -> Result<(), Usage> {
        self.store.validate()
    }
}

/// Requeues the split, or resets it after confirmation.
pub(crate) async fn run(a: RequeueArgs) -> anyhow::Result<ExitCode> {
    let split = SplitId::new(a.split.clone())?;
    let stores = open_stores(&a.store).await?;
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

/// Asks on the terminal before a reset; without a terminal to ask on, a usage error (exit 2)
/// that names --yes.
fn confirm(plan: &ops::ResetPlan) -> anyhow::Result<bool> {
    use std::io::{BufRead, IsTerminal, Write};
    let what = format!(
        "split {} is now: {}. A reset starts it over from the beginning: every record of it is \
         emitted again, and a worker holding it is fenced.",
        plan.split, plan.current
    );
    if !std::io::stdin().is_terminal() {
        crate::exit_usage(
            clap::error::ErrorKind::MissingRequiredArgument,
            format!("--reset needs confirmation and stdin is not a terminal: {what} Add --yes to go ahead."),
        );
    }
    eprint!("{what}\nReset it? [y/N] ");
    std::io::stderr().flush()?;
    let mut answer = String::new();
    std::io::stdin().lock().read_line(&mut answer)?;
    Ok(matches!(answer.trim(), "y" | "Y" | "yes" | "YES" | "Yes"))
}
