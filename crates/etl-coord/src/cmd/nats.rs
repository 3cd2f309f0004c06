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
    /// The environment variable the server reads the workers' user's password from (`<JOB>`:
    /// the job's name in capitals, `-` as `_`: each job's users their own passwords).
    #[arg(long, default_value = "ETL_<JOB>_NATS_PASSWORD")]
    pub(crate) password_var: String,
    /// The set-up user, which creates the buckets (`etl-coord nats-buckets`).
    #[arg(long, default_value = "setup-JOB")]
    pub(crate) setup_user: String,
    /// The environment variable the server reads the set-up user's password from (`<JOB>` as
    /// above).
    #[arg(long, default_value = "ETL_<JOB>_SETUP_NATS_PASSWORD")]
    pub(crate) setup_password_var: String,
    /// The job's JetStream file storage (e.g. 4GiB), counted over every replica: at least the
    /// buckets' bounds times their replicas. The account requires every stream to be bounded
    /// (`max_bytes_required`), so the set-up step must give both bounds (`nats-buckets
    /// --nats-max-bytes --nats-lease-max-bytes`) and the server refuses bounds adding up past it.
    #[arg(long, value_parser = etl_coordination_runner::parse_bytes)]
    pub(crate) max_file: i64,
    /// Consumers each of the job's buckets may have at once: a worker holds two on the state
    /// bucket and one on the lease bucket, a listing one while it runs; 1024 serves some 500
    /// workers (a crashed worker's consumers count for 30 s more).
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
    if a.max_consumers < 3 {
        bail!(
            "--max-consumers {}: must be at least 3 (a worker holds two watches on the state bucket)",
            a.max_consumers
        );
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
    let var = |v: &str| v.replace("<JOB>", &job.as_str().replace('-', "_").to_uppercase());
    let (password_var, setup_password_var) = (var(&a.password_var), var(&a.setup_password_var));
    for (flag, v) in [("--password-var", &password_var), ("--setup-password-var", &setup_password_var)] {
        let mut chars = v.chars();
        let valid = chars.next().is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
            && chars.all(|c| c.is_ascii_alphanumeric() || c == '_');
        if !valid {
            bail!(
                "{flag} {v:?}: not an environment variable name (letters, digits and _, not starting with a digit)"
            );
        }
    }
    if password_var == setup_password_var {
        bail!(
            "--password-var and --setup-password-var are both {password_var}: the workers would know the \
             password of the user that creates and updates the buckets"
        );
    }
    let users = vec![
        AccountUser::new(user, password_var, Access::Use),
        AccountUser::new(setup, setup_password_var, Access::Create),
    ];
    println!(
        "# The account of etl-coordination job {job}: its workers' user and its set-up user, its two\n\
         # buckets and nothing else; no other job's client can reach it. Paste into\n\
         # accounts {{ ... }} of the NATS server configuration (with a jetstream block at the top).\n\
         # Every stream of it must be bounded: create the buckets with `etl-coord nats-buckets --job {job}\n\
         # --nats-max-bytes BYTES --nats-lease-max-bytes BYTES`, both bounds times the replicas within max_file."
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
    // (lowering one could leave the bucket full at once).
    let asked = [(cfg.state_max_bytes, "--nats-max-bytes"), (cfg.lease_max_bytes, "--nats-lease-max-bytes")];
    let mut unmet = Vec::new();
    for (store, (want, flag)) in [&mut stores.state, &mut stores.lease].into_iter().zip(asked) {
        let Some(want) = want else { continue };
        // At least the bound asked for: nothing to do (a bound is never lowered).
        if store.max_bytes().is_some_and(|n| n >= want) {
            continue;
        }
        let now = store.max_bytes().map_or("unbounded".to_owned(), |n| format!("at most {n} bytes"));
        if a.check {
            unmet.push(format!("{} is {now}, not {flag} {want}", store.bucket()));
            continue;
        }
        // Not raising it is no reason to fail the deployment this runs in (the job works as
        // before): said on stderr, with why.
        match store.raise_max_bytes(want).await {
            Ok(true) => println!("{}: bound raised to {want} bytes (was {now})", store.bucket()),
            Ok(false) => eprintln!(
                "warning: {} stays {now} ({flag} {want}): it holds more than that already",
                store.bucket()
            ),
            Err(e) => eprintln!("warning: {} stays {now} ({flag} {want}): {e}", store.bucket()),
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
