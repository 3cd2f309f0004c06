//! `etl-coord nats-permissions` and `etl-coord nats-buckets`: an operator's set-up of a job on
//! a shared NATS.

use std::process::ExitCode;

use anyhow::bail;
use etl_coordination_driver::JobName;

use super::{StoreArgs, Usage, nats_config};

#[derive(clap::Args, Debug)]
pub(crate) struct NatsPermissionsArgs {
    /// Job name.
    #[arg(long, env = "ETL_COORD_JOB")]
    pub(crate) job: String,
    /// Include creating the job's buckets (for `nats-buckets`, or workers that create them).
    #[arg(long)]
    pub(crate) create: bool,
    /// `conf`: a user entry for the server's `authorization { users: [...] }`; `json`: the
    /// permissions alone, as JSON (e.g. for `nsc` or a templating tool).
    #[arg(long, default_value = "conf", value_parser = ["conf", "json"])]
    pub(crate) format: String,
    /// The user name in the `conf` entry.
    #[arg(long, default_value = "etl-JOB")]
    pub(crate) user: String,
    /// The environment variable the server reads the user's password from (`conf`).
    #[arg(long, default_value = "ETL_JOB_NATS_PASSWORD")]
    pub(crate) password_var: String,
}

#[derive(clap::Args, Debug)]
pub(crate) struct NatsBucketsArgs {
    #[command(flatten)]
    pub(crate) store: StoreArgs,
    /// Only check that both buckets exist with a valid configuration; create nothing.
    #[arg(long)]
    pub(crate) check: bool,
}

impl NatsBucketsArgs {
    /// What one flag's parser cannot check.
    pub(crate) fn validate(&self) -> Result<(), Usage> {
        self.store.validate()
    }
}

/// Prints the permissions a job's clients need (a server configuration entry, or JSON).
pub(crate) fn permissions(a: NatsPermissionsArgs) -> anyhow::Result<ExitCode> {
    let job = JobName::new(a.job.clone())?;
    let access =
        if a.create { etl_coordination_nats::Access::Create } else { etl_coordination_nats::Access::Use };
    let p = etl_coordination_nats::permissions(&job, access);
    if a.format == "json" {
        let v = serde_json::json!({
            "publish": { "allow": p.publish },
            "subscribe": { "allow": p.subscribe },
        });
        println!("{}", serde_json::to_string_pretty(&v)?);
    } else {
        let user = a.user.replace("JOB", job.as_str());
        println!(
            "# {} of etl-coordination job {job}: its two buckets, nothing else. Paste into\n\
             # authorization {{ users: [ ... ] }} of the NATS server configuration.",
            if a.create { "Creates and uses the buckets" } else { "A client" }
        );
        print!("{}", p.server_config_user(&user, &a.password_var));
    }
    Ok(ExitCode::SUCCESS)
}

/// Creates the job's buckets if missing (unless `--check`), makes a state bucket of an earlier
/// release refuse rollup headers (`--check`: reports it), and checks their configuration.
pub(crate) async fn buckets(a: NatsBucketsArgs) -> anyhow::Result<ExitCode> {
    let Some(mut cfg) = nats_config(&a.store.connection)? else {
        bail!("--store memory: nats-buckets needs a nats:// URL");
    };
    cfg.create_buckets = !a.check;
    let job = JobName::new(a.store.job.clone())?;
    let mut stores = etl_coordination_nats::connect(&cfg, &job).await?;
    // A state bucket of an earlier release accepts rollup headers (one message could replace
    // every record): closed here, reported by --check.
    let open = stores.state.accepts_rollups();
    if open && a.check {
        bail!(
            "{} accepts rollup headers: one message with `Nats-Rollup: all` would replace every \
             record of job {job}; run `etl-coord nats-buckets --job {job}` (without --check) as its \
             set-up user to make it refuse them",
            stores.state.bucket()
        );
    }
    // Not closing it is no reason to fail the deployment it runs in (the job works as before):
    // said on stderr, with what to do (a refusal also ends this connection; what follows reports
    // what was read at connect).
    if open {
        match stores.state.refuse_rollups().await {
            Ok(()) => println!("{}: now refuses rollup headers", stores.state.bucket()),
            Err(e) => eprintln!("warning: {} still accepts rollup headers: {e}", stores.state.bucket()),
        }
    }
    let mut differ = false;
    for b in [&stores.state, &stores.lease] {
        let how = if stores.created.iter().any(|c| c == b.bucket()) { "created" } else { "exists" };
        let bound = b.max_bytes().map_or("unbounded".to_owned(), |n| format!("at most {n} bytes"));
        println!("{}: {how}, configuration valid, replicas {}, {bound}", b.bucket(), b.replicas());
        differ |= b.replicas() != cfg.replicas;
    }
    if differ && a.check {
        bail!(
            "the buckets' replicas differ from --nats-replicas {} (replicas are set when a bucket \
             is created: change them with `nats stream edit`, or recreate the job)",
            cfg.replicas
        );
    }
    Ok(ExitCode::SUCCESS)
}
