//! Connecting: the client options, the server checks (P1), the account's JetStream, and the
//! retries of a server that is starting or electing.

use std::sync::Arc;

use async_nats::jetstream;
use etl_coordination_core::{JobName, StoreError};
use tokio::sync::watch;

use crate::buckets::bucket;
use crate::config::{MIN_SERVER_VERSION, NatsAuth, NatsConfig};
use crate::permissions::{bucket_names, inbox_prefix};
use crate::refusals::{Refusal, Refusals};
use crate::setup::{SETUP_WINDOW, SetupRetry, setup};
use crate::store::NatsStore;

/// Parses `v2.11.3` / `2.10.26-beta` into (major, minor).
fn parse_version(v: &str) -> Option<(u64, u64)> {
    let v = v.trim_start_matches('v');
    let mut parts = v.split(['.', '-']);
    Some((parts.next()?.parse().ok()?, parts.next()?.parse().ok()?))
}

/// The two stores of a job.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct NatsJob {
    /// `etl_coordination_{job}_state`.
    pub state: NatsStore,
    /// `etl_coordination_{job}_lease`.
    pub lease: NatsStore,
    /// The buckets this call created (empty when both existed).
    pub created: Vec<String>,
}

/// Connects, checks the server (P1) and creates or validates the job's buckets.
pub async fn connect(config: &NatsConfig, job: &JobName) -> Result<NatsJob, StoreError> {
    match open(config, job).await? {
        Ok(opened) => Ok(opened),
        Err(bucket) => Err(crate::buckets::missing(&bucket, job)),
    }
}

/// Connects, checks the server (P1) and validates the job's buckets, creating nothing (whatever
/// `config.create_buckets` says): what tools that read or repair a job use, so that a mistyped
/// job name never leaves buckets behind. `Err(name)` inside: the bucket of the job that does
/// not exist.
pub async fn open_existing(
    config: &NatsConfig,
    job: &JobName,
) -> Result<Result<NatsJob, String>, StoreError> {
    let config = NatsConfig { create_buckets: false, ..config.clone() };
    open(&config, job).await
}

/// [`connect`], with a missing bucket (that `config` does not let it create) as `Err(name)`.
async fn open(config: &NatsConfig, job: &JobName) -> Result<Result<NatsJob, String>, StoreError> {
    let (refusals, refused) = Refusals::new(config, Some(job));
    let client = open_connection(config, Some(inbox_prefix(job)), &refusals, Arc::new(refused)).await?;
    let version = client.server_info().version;
    match parse_version(&version) {
        Some(v) if v >= MIN_SERVER_VERSION => {}
        _ => {
            return Err(setup(format!(
                "NATS server {version} at {} is too old: etl-coordination needs per-message TTLs and KV limit markers, which shipped in NATS 2.11; upgrade the server to 2.11 or later (e.g. the nats:2.11-alpine image)",
                config.url
            )));
        }
    }
    // The context's own wait for publish acknowledgements is 5 s unless set: without this, an
    // op timeout above 5 s would be cut short at 5 s on every write (and its answer lost).
    let mut js = jetstream::new(client.clone());
    js.set_timeout(config.op_timeout);
    let account = refusals.guard(query_account(&js, config)).await?;
    if account.requests.level < 1 {
        return Err(setup(format!(
            "JetStream API level {} at {} is too old (need 1, NATS 2.11); upgrade the server",
            account.requests.level, config.url
        )));
    }
    let [state_name, lease_name] = bucket_names(job);
    let mut created = Vec::new();
    let Some(state) = bucket(&client, &js, config, &refusals, &state_name, false, &mut created).await? else {
        return Ok(Err(state_name));
    };
    let Some(lease) = bucket(&client, &js, config, &refusals, &lease_name, true, &mut created).await? else {
        return Ok(Err(lease_name));
    };
    for store in [&state, &lease] {
        store.probe().await?;
    }
    Ok(Ok(NatsJob { state, lease, created }))
}

/// The client options of a connection: credentials, TLS, the reply prefix (a job's, so that its
/// user needs no other), and an event callback that records what the server refuses.
async fn options(
    config: &NatsConfig,
    inbox: Option<String>,
    refused: Arc<watch::Sender<Option<Refusal>>>,
) -> Result<async_nats::ConnectOptions, StoreError> {
    let mut opts = async_nats::ConnectOptions::new()
        .connection_timeout(config.op_timeout)
        .request_timeout(Some(config.op_timeout))
        .max_reconnects(None);
    if let Some(inbox) = inbox {
        opts = opts.custom_inbox_prefix(inbox);
    }
    // Messages the client dropped because a subscription's queue was full: an ordered consumer
    // (every watch and listing) notices the gap and recreates itself, so nothing is lost, but a
    // burst of them means a worker cannot keep up with what the store sends it.
    let dropped = Arc::new(std::sync::atomic::AtomicU64::new(0));
    opts = opts.event_callback(move |event| {
        let refused = refused.clone();
        let dropped = dropped.clone();
        async move {
            if let async_nats::Event::SlowConsumer(sid) = &event {
                let n = dropped.fetch_add(1, std::sync::atomic::Ordering::Relaxed) + 1;
                if n == 1 {
                    tracing::warn!(
                        subscription = sid,
                        "NATS client dropped a message: a subscription's queue was full (the \
                         watch or listing recreates its consumer from the gap, so nothing is \
                         lost; if this repeats, this process cannot keep up with what it \
                         watches: give it more CPU); further drops are logged at debug"
                    );
                } else {
                    tracing::debug!(subscription = sid, dropped_so_far = n, "NATS client dropped a message");
                }
                return;
            }
            let refusal = match &event {
                async_nats::Event::ServerError(e) => Refusal::parse(e),
                // A reconnect turned away (e.g. a rotated password) is reported by the client.
                async_nats::Event::ClientError(async_nats::ClientError::Other(e))
                    if e.to_lowercase().contains("authorization violation") =>
                {
                    Some(Refusal::Credentials)
                }
                _ => None,
            };
            match refusal {
                Some(r) => {
                    tracing::error!(%event, "NATS refused a request of this client");
                    refused.send_if_modified(|first| first.is_none() && first.replace(r).is_none());
                }
                None => tracing::debug!(%event, "NATS connection event"),
            }
        }
    });
    opts = match &config.auth {
        NatsAuth::None => opts,
        NatsAuth::Token(t) => opts.token(t.clone()),
        NatsAuth::UserPassword(u, p) => opts.user_and_password(u.clone(), p.clone()),
        NatsAuth::CredentialsFile(path) => opts
            .credentials_file(path)
            .await
            .map_err(|e| setup(format!("cannot read NATS credentials {}: {e}", path.display())))?,
    };
    if config.tls_required {
        opts = opts.require_tls(true);
    }
    if let Some(ca) = &config.tls_root_certificate {
        if !ca.is_file() {
            return Err(setup(format!("the TLS CA file {} does not exist", ca.display())));
        }
        opts = opts.add_root_certificates(ca.clone());
    }
    Ok(opts)
}

/// Connects, trying again for twice the op timeout while no server answers (a worker may start
/// before NATS does). Refused credentials and a failed TLS handshake are final: trying again
/// cannot fix them.
pub(crate) async fn open_connection(
    config: &NatsConfig,
    inbox: Option<String>,
    refusals: &Refusals,
    refused: Arc<watch::Sender<Option<Refusal>>>,
) -> Result<async_nats::Client, StoreError> {
    use async_nats::ConnectErrorKind as C;
    let servers = config
        .url
        .split(',')
        .map(|u| u.trim().parse::<async_nats::ServerAddr>())
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| setup(format!("invalid NATS URL {:?}: {e}", config.url)))?;
    // One attempt tries every server (each within the op timeout, in a shuffled order), so a
    // node that drops packets costs one op timeout, not the attempt.
    let attempt = config.op_timeout * servers.len() as u32;
    let deadline = tokio::time::Instant::now() + attempt * 2;
    let mut retry = SetupRetry::new();
    let client = loop {
        let opts = options(config, inbox.clone(), refused.clone()).await?;
        let last = match tokio::time::timeout(attempt, opts.connect(servers.clone())).await {
            Ok(Ok(client)) => break client,
            Ok(Err(e)) if matches!(e.kind(), C::AuthorizationViolation | C::Authentication) => {
                return Err(setup(refusals.describe(&Refusal::Credentials)));
            }
            // rustls' verdicts (an untrusted certificate, a server that does not speak TLS) come
            // as I/O errors.
            Ok(Err(e)) if e.kind() == C::Tls || is_tls_failure(&e.to_string()) => {
                return Err(setup(format!(
                    "TLS with NATS at {} failed ({e}): check that the server has TLS on (a tls block), that \
                     this client trusts the certificate authority that signed its certificate (etl-coord: \
                     --nats-tls-ca), and that the URL's host is one the certificate names",
                    config.url
                )));
            }
            Ok(Err(e)) => e.to_string(),
            Err(_) => "timed out".to_owned(),
        };
        if !retry.pause().await || tokio::time::Instant::now() > deadline {
            return Err(StoreError::Unavailable(format!(
                "no NATS server answered at {} within {:?} ({last}); check the URL and that the server runs",
                config.url,
                attempt * 2
            )));
        }
    };
    // Wait for the connection (and the server's INFO) before judging its version.
    let connected = refusals.guard(async {
        match tokio::time::timeout(config.op_timeout, client.flush()).await {
            Ok(Ok(())) => Ok(()),
            _ => Err(StoreError::Unavailable(format!(
                "no NATS server answered at {} within {:?}; check the URL and that the server runs",
                config.url, config.op_timeout
            ))),
        }
    });
    connected.await?;
    Ok(client)
}

/// Whether a connection error is a TLS handshake's verdict (retrying cannot change it).
fn is_tls_failure(error: &str) -> bool {
    ["invalid peer certificate", "corrupt message", "tls required", "tls not available"]
        .iter()
        .any(|w| error.to_lowercase().contains(w))
}

/// The account's JetStream information (P1). A cluster still electing its meta leader answers
/// "temporarily unavailable" and a loaded server answers late: both are retried for
/// [`SETUP_WINDOW`] and then reported as unavailable. No responders (JetStream is not enabled)
/// and any other API error are final, with what to do about them.
pub(crate) async fn query_account(
    js: &jetstream::Context,
    config: &NatsConfig,
) -> Result<jetstream::account::Account, StoreError> {
    use jetstream::context::AccountErrorKind as K;
    let not_enabled = |e: &dyn std::fmt::Display| {
        setup(format!(
            "JetStream is not available at {} ({e}); start nats-server with -js (or a jetstream block in its config)",
            config.url
        ))
    };
    let mut retry = SetupRetry::new();
    loop {
        let last = match tokio::time::timeout(config.op_timeout, js.query_account()).await {
            Ok(Ok(account)) => return Ok(account),
            Err(_) => "timed out".to_owned(),
            Ok(Err(e)) => match e.kind() {
                K::TimedOut | K::Other => e.to_string(),
                K::JetStream(j) if j.error_code() == jetstream::ErrorCode::CLUSTER_NOT_AVAILABLE => {
                    e.to_string()
                }
                K::JetStream(_) | K::JetStreamUnavailable => return Err(not_enabled(&e)),
            },
        };
        if !retry.pause().await {
            return Err(StoreError::Unavailable(format!(
                "JetStream at {} did not answer within {SETUP_WINDOW:?} ({last}); check that the server (or a quorum of the cluster) runs",
                config.url
            )));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn versions_parse_and_compare() {
        assert_eq!(parse_version("2.11.11"), Some((2, 11)));
        assert_eq!(parse_version("v2.10.26-beta"), Some((2, 10)));
        assert!(parse_version("2.10.26").unwrap() < MIN_SERVER_VERSION);
        assert!(parse_version("2.15.1").unwrap() >= MIN_SERVER_VERSION);
        assert_eq!(parse_version("garbage"), None);
    }
}
