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
pub(crate) struct NatsAccountArgs {
    /// Job name.
    #[arg(long, env = "ETL_COORD_JOB")]
    pub(crate) job: String,
    /// The workers' user (also what `status` and `requeue` connect as).
    #[arg(long, default_value = "etl-JOB")]
    pub(crate) user: String,
    /// The environment variable the server reads the workers' user's password from.
    #[arg(long, default_value = "ETL_JOB_NATS_PASSWORD")]
    pub(crate) password_var: String,
    /// The set-up user, which creates the buckets (`etl-coord nats-buckets`).
    #[arg(long, default_value = "setup-JOB")]
    pub(crate) setup_user: String,
    /// The environment variable the server reads the set-up user's password from.
    #[arg(long, default_value = "ETL_SETUP_NATS_PASSWORD")]
    pub(crate) setup_password_var: String,
    /// The job's JetStream file storage, both buckets together (e.g. 1GiB): a job that fills
    /// it stops with an error naming it; the server reserves it from its own store.
    #[arg(long, value_parser = etl_coordination_runner::parse_bytes)]
    pub(crate) max_file: i64,
    /// Consumers the job may hold at once (three watches per worker, one per listing in flight).
    #[arg(long, default_value_t = etl_coordination_nats::AccountLimits::DEFAULT_MAX_CONSUMERS)]
    pub(crate) max_consumers: i64,
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

/// Prints a job's account entry for the server's `accounts { ... }` block.
pub(crate) fn account(a: NatsAccountArgs) -> anyhow::Result<ExitCode> {
    use etl_coordination_nats::{Access, Account, AccountLimits, AccountUser};
    let job = JobName::new(a.job.clone())?;
    if a.max_consumers < 1 {
        bail!("--max-consumers {}: must be at least 1 (a worker holds three)", a.max_consumers);
    }
    let name = |u: &str| u.replace("JOB", job.as_str());
    let (user, setup) = (name(&a.user), name(&a.setup_user));
    if user == setup {
        bail!(
            "--user and --setup-user are both {user:?}: the workers' user must not be the one that creates buckets"
        );
    }
    let mut limits = AccountLimits::new(a.max_file);
    limits.max_consumers = a.max_consumers;
    let users = vec![
        AccountUser::new(user, a.password_var, Access::Use),
        AccountUser::new(setup, a.setup_password_var, Access::Create),
    ];
    println!(
        "# The account of etl-coordination job {job}: its workers' user and its set-up user, its two\n\
         # buckets and nothing else; no other job's client can reach it. Paste into\n\
         # accounts {{ ... }} of the NATS server configuration (with a jetstream block at the top)."
    );
    print!("{}", Account::new(&job, users, limits).server_config(&job));
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
    // Bounds: a bucket created now got them; an existing one is raised to them, never lowered
    // (a bound below what a bucket holds would make the server drop records).
    let asked = [(cfg.state_max_bytes, "--nats-max-bytes"), (cfg.lease_max_bytes, "--nats-lease-max-bytes")];
    let mut unmet = Vec::new();
    for (store, (want, flag)) in [&mut stores.state, &mut stores.lease].into_iter().zip(asked) {
        let Some(want) = want else { continue };
        if store.max_bytes() == Some(want) {
            continue;
        }
        let now = store.max_bytes().map_or("unbounded".to_owned(), |n| format!("at most {n} bytes"));
        if a.check {
            unmet.push(format!("{} is {now}, not {flag} {want}", store.bucket()));
        } else if store.raise_max_bytes(want).await? {
            println!("{}: bound raised to {want} bytes (was {now})", store.bucket());
        } else {
            eprintln!(
                "warning: {} stays {now} ({flag} {want}): a bound is only raised, and never below \
                 what the bucket holds",
                store.bucket()
            );
        }
    }
    if !unmet.is_empty() {
        bail!(
            "{}; run nats-buckets without --check as the job's set-up user to raise them",
            unmet.join("; ")
        );
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
