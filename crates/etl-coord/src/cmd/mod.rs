//! The commands, one file each (its flags, what clap cannot check of them, and its run), and
//! what they share: the store flags and the value parsers.

pub(crate) mod admin;
pub(crate) mod demo;
pub(crate) mod nats;
pub(crate) mod requeue;
pub(crate) mod signals;
pub(crate) mod status;
pub(crate) mod worker;

use std::path::PathBuf;
use std::time::Duration;

use etl_coordination_driver::{AnyStore, InstanceId, JobName, JobStores, SplitId};

/// A usage error (exit 2): the flag and what is wrong with its value.
pub(crate) struct Usage {
    pub(crate) flag: String,
    pub(crate) msg: String,
}

impl Usage {
    pub(crate) fn new(flag: impl Into<String>, msg: impl Into<String>) -> Usage {
        Usage { flag: flag.into(), msg: msg.into() }
    }
}

/// A duration flag that must not be zero.
pub(crate) fn positive(flag: &str, d: Duration) -> Result<(), Usage> {
    if d.is_zero() {
        return Err(Usage::new(flag, "must be more than 0s"));
    }
    Ok(())
}

/// A knob the core refused, as a usage error naming its flag.
pub(crate) fn tuning_error(e: etl_coordination_core::ConfigError) -> Usage {
    Usage::new(format!("--{}", e.field.replace('_', "-")), format!("{}: {}", e.value, e.rule))
}

#[derive(clap::Args, Debug)]
pub(crate) struct StoreArgs {
    /// Job name: [A-Za-z0-9_-]; suffixes the store's bucket names.
    #[arg(long, env = "ETL_COORD_JOB", value_parser = parse_job)]
    pub(crate) job: String,
    /// Required: `nats://HOST:PORT` (comma-separate several; `tls://` requires TLS), or `memory`
    /// for a single standalone instance (nothing is shared). Also ETL_COORD_STORE, else NATS_URL.
    #[arg(long, env = "ETL_COORD_STORE")]
    pub(crate) store: Option<String>,
    /// NATS: bucket replicas (3 on a production cluster).
    #[arg(long, default_value_t = 1, env = "ETL_COORD_NATS_REPLICAS", value_parser = clap::value_parser!(u8).range(1..=5))]
    pub(crate) nats_replicas: u8,
    /// NATS: a credentials (.creds) file (else NATS_CREDS).
    #[arg(long, env = "ETL_COORD_NATS_CREDS")]
    pub(crate) nats_creds: Option<PathBuf>,
    /// NATS: an authentication token (else NATS_TOKEN).
    #[arg(long, env = "ETL_COORD_NATS_TOKEN", hide_env_values = true)]
    pub(crate) nats_token: Option<String>,
    /// NATS: a user name, with --nats-password (else NATS_USER).
    #[arg(long, env = "ETL_COORD_NATS_USER")]
    pub(crate) nats_user: Option<String>,
    /// NATS: the user's password; better given by the environment than on the command line
    /// (else NATS_PASSWORD).
    #[arg(long, env = "ETL_COORD_NATS_PASSWORD", hide_env_values = true)]
    pub(crate) nats_password: Option<String>,
    /// NATS: require TLS (with the system's root certificates unless --nats-tls-ca is given).
    #[arg(long, env = "ETL_COORD_NATS_TLS")]
    pub(crate) nats_tls: bool,
    /// NATS: a PEM file of the certificate authority that signed the servers' certificates;
    /// implies --nats-tls (else NATS_CA).
    #[arg(long, env = "ETL_COORD_NATS_TLS_CA")]
    pub(crate) nats_tls_ca: Option<PathBuf>,
    /// NATS: timeout of one request of the NATS client (a write without an answer within it
    /// is in doubt and resolved by reading); the worker waits this long for an answer too, and
    /// at least 5s (a listing or a create can take several requests).
    #[arg(long, default_value = "5s", value_parser = parse_duration, env = "ETL_COORD_NATS_OP_TIMEOUT")]
    pub(crate) nats_op_timeout: Duration,
}

/// The NATS CLI's variable for a flag left unset (its own ETL_COORD_ variable included).
fn or_nats_env<T: From<String> + Clone>(value: &Option<T>, var: &str) -> Option<T> {
    value.clone().or_else(|| std::env::var(var).ok().filter(|v| !v.is_empty()).map(T::from))
}

/// The store arguments with the NATS CLI's variables filled in, checked as a whole.
struct Resolved {
    store: String,
    creds: Option<PathBuf>,
    token: Option<String>,
    user: Option<(String, String)>,
    tls_ca: Option<PathBuf>,
}

impl StoreArgs {
    /// Fills in the NATS CLI's variables and checks what clap cannot see across them; the
    /// error names the flag, for a usage error (exit 2).
    fn resolve(&self) -> Result<Resolved, (&'static str, String)> {
        let store = or_nats_env(&self.store, "NATS_URL").ok_or((
            "--store",
            "is required: `memory` for a standalone run, or nats://HOST:PORT for workers that share a job \
             (also ETL_COORD_STORE, or the NATS CLI's NATS_URL)"
                .to_owned(),
        ))?;
        if store != "memory" && !["nats://", "tls://"].iter().any(|p| store.starts_with(p)) {
            return Err(("--store", format!("{store:?}: expected `memory` or nats://HOST:PORT")));
        }
        // The NATS CLI's credentials only when none were given here (flag or ETL_COORD_): an
        // ambient NATS_USER must not clash with an explicit --nats-creds.
        let ours = self.nats_creds.is_some()
            || self.nats_token.is_some()
            || self.nats_user.is_some()
            || self.nats_password.is_some();
        let fallback =
            |value: &Option<String>, var: &str| if ours { value.clone() } else { or_nats_env(value, var) };
        let creds = fallback(&self.nats_creds.as_ref().map(|p| p.display().to_string()), "NATS_CREDS")
            .map(PathBuf::from);
        let token = fallback(&self.nats_token, "NATS_TOKEN");
        let user = fallback(&self.nats_user, "NATS_USER");
        let password = fallback(&self.nats_password, "NATS_PASSWORD");
        let tls_ca = or_nats_env(&self.nats_tls_ca.as_ref().map(|p| p.display().to_string()), "NATS_CA")
            .map(PathBuf::from);
        let user = match (user, password) {
            (Some(u), Some(p)) => Some((u, p)),
            (None, None) => None,
            (Some(_), None) => {
                return Err(("--nats-user", "needs --nats-password (or ETL_COORD_NATS_PASSWORD)".into()));
            }
            (None, Some(_)) => {
                return Err(("--nats-password", "needs --nats-user (or ETL_COORD_NATS_USER)".into()));
            }
        };
        let given = [creds.is_some(), token.is_some(), user.is_some()].iter().filter(|g| **g).count();
        if given > 1 {
            let flag = if creds.is_some() { "--nats-creds" } else { "--nats-token" };
            return Err((
                flag,
                "give one of --nats-creds, --nats-token, --nats-user/--nats-password (set here or by the environment)"
                    .into(),
            ));
        }
        for (flag, file) in [("--nats-creds", &creds), ("--nats-tls-ca", &tls_ca)] {
            if let Some(f) = file.as_ref().filter(|f| !f.is_file()) {
                return Err((flag, format!("{} is not a file", f.display())));
            }
        }
        Ok(Resolved { store, creds, token, user, tls_ca })
    }
}

impl StoreArgs {
    /// The store flags' own checks, as a usage error.
    pub(crate) fn validate(&self) -> Result<(), Usage> {
        positive("--nats-op-timeout", self.nats_op_timeout)?;
        self.resolve().map(drop).map_err(|(flag, msg)| Usage::new(flag, msg))
    }
}

/// A job name, checked as the store checks it.
pub(crate) fn parse_job(s: &str) -> Result<String, String> {
    JobName::new(s.to_owned()).map(|_| s.to_owned()).map_err(|e| e.to_string())
}

/// An instance id, checked as the protocol checks it.
pub(crate) fn parse_instance(s: &str) -> Result<String, String> {
    InstanceId::new(s.to_owned()).map(|_| s.to_owned()).map_err(|e| e.to_string())
}

/// A split id, checked as the protocol checks it.
pub(crate) fn parse_split(s: &str) -> Result<String, String> {
    SplitId::new(s.to_owned()).map(|_| s.to_owned()).map_err(|e| e.to_string())
}

/// Parses `30s`, `500ms`, `2m`, `1h` or a plain number of seconds.
pub(crate) fn parse_duration(s: &str) -> Result<Duration, String> {
    let s = s.trim();
    let (num, unit) =
        s.find(|c: char| !c.is_ascii_digit() && c != '.').map_or((s, "s"), |i| (&s[..i], &s[i..]));
    let n: f64 = num.parse().map_err(|_| format!("invalid duration {s:?}: expected e.g. 30s, 500ms, 2m"))?;
    let secs = match unit {
        "ms" => n / 1000.0,
        "s" | "" => n,
        "m" => n * 60.0,
        "h" => n * 3600.0,
        other => return Err(format!("invalid duration unit {other:?} in {s:?}: use ms, s, m or h")),
    };
    if !(0.0..=1e9).contains(&secs) {
        return Err(format!("duration {s:?} out of range"));
    }
    Ok(Duration::from_secs_f64(secs))
}

fn nats_config(args: &StoreArgs) -> anyhow::Result<Option<etl_coordination_nats::NatsConfig>> {
    let r = args.resolve().map_err(|(flag, msg)| anyhow::anyhow!("{flag} {msg}"))?;
    if r.store == "memory" {
        return Ok(None);
    }
    let mut cfg = etl_coordination_nats::NatsConfig::new(r.store.clone());
    cfg.replicas = usize::from(args.nats_replicas);
    cfg.op_timeout = args.nats_op_timeout;
    cfg.tls_required = args.nats_tls || r.tls_ca.is_some() || r.store.starts_with("tls://");
    cfg.tls_root_certificate = r.tls_ca;
    if let Some(t) = r.token {
        cfg.auth = etl_coordination_nats::NatsAuth::Token(t);
    }
    if let Some((u, p)) = r.user {
        cfg.auth = etl_coordination_nats::NatsAuth::UserPassword(u, p);
    }
    if let Some(c) = r.creds {
        cfg.auth = etl_coordination_nats::NatsAuth::CredentialsFile(c);
    }
    Ok(Some(cfg))
}

/// The job's stores, on the backend `--store` names.
pub(crate) async fn open_stores(args: &StoreArgs) -> anyhow::Result<JobStores<AnyStore>> {
    let job = JobName::new(args.job.clone())?;
    Ok(match nats_config(args)? {
        None => JobStores::memory(job).into_any(),
        Some(cfg) => JobStores::nats(&cfg, &job).await?.into_any(),
    })
}
