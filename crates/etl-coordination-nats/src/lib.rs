//! NATS JetStream KV backend of etl-coordination (server >= 2.11).
//!
//! A job uses two KV buckets: `etl_coordination_{job}_state` (durable records) and
//! `etl_coordination_{job}_lease` (per-message TTLs and limit markers). [`connect`] checks the
//! server (version, JetStream), creates or validates both buckets, and returns one
//! [`NatsStore`] per bucket. Every primitive is written against the traps measured in
//! `docs/NATS.md`:
//!
//! - create-if-absent is a publish expecting subject sequence 0; on a conflict over a delete or
//!   expiry marker it publishes against the marker's sequence, so a re-created lease keeps its
//!   TTL (`kv.create_with_ttl` silently drops it there);
//! - a CAS is a publish with `expected_last_subject_sequence` and the TTL, so a heartbeat
//!   replaces the TTL (`kv.update` would make the key permanent);
//! - conflicts are classified by the JetStream API error code (10071 and 10164), never by the
//!   client's error kind alone (clustered servers answer 10164, which the client maps to
//!   `Other`);
//! - a request without an answer is `Indeterminate`, never a failure;
//! - a get reads through the stream leader (the JetStream message-get API), never a direct
//!   get: async-nats creates buckets with direct get allowed, and then any replica answers, a
//!   lagging one with an older revision (measured: 180 of 3,000 reads right after an
//!   acknowledged write). A read after an acknowledged write returns it;
//! - watches and listings use ordered consumers with `LastPerSubject` delivery and report the
//!   end of the initial snapshot; a watch that fails is finished (never polled again).
//!
//! - every connection of a job uses the reply prefix [`inbox_prefix`], so a per-job user needs
//!   only the subjects [`permissions`] lists; a subject the server refuses (credentials or a
//!   permission) makes every operation of the connection fail with [`StoreError::Setup`]
//!   naming the refused subject and the missing permission, at once (a refused request is
//!   otherwise only a timeout).
//!
//! What it does not do: retry. The protocol core decides what to do with every outcome.
//!
//! Most users never call this crate directly: `JobStores::nats` of `etl-coordination-driver`
//! (feature `nats`) does. Tools that read a job's records use it like this:
//!
//! ```no_run
//! use etl_coordination_nats::{JobName, NatsConfig, Store, connect};
//! use std::time::Duration;
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let mut config = NatsConfig::new("nats://127.0.0.1:4222");
//! config.replicas = 3; // a production cluster
//! config.op_timeout = Duration::from_secs(2);
//! config.create_buckets = false; // the buckets are provisioned (`etl-coord nats-buckets`)
//! let job = connect(&config, &JobName::new("orders-backfill")?).await?;
//! let leases = job.lease.list(&etl_coordination_nats::Prefix::new("split.")?).await?;
//! println!("{} splits are leased", leases.len());
//! # Ok(()) }
//! ```

mod permissions;

use std::future::Future;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream::{self, consumer, kv, message::PublishMessage};
use bytes::Bytes;
use etl_coordination_core::{DeleteCause, Entry, Key, Revision, StoreError, WatchEvent};
use etl_coordination_store::{WatchStream, validate_ttl, validate_value};
use futures_util::StreamExt;
use tokio::sync::{mpsc, watch};

pub use etl_coordination_core::{JobName, Prefix};
pub use etl_coordination_store::Store;
pub use permissions::{Access, Permissions, bucket_names, inbox_prefix, permissions};

/// Conflict: wrong last sequence.
const WRONG_LAST_SEQUENCE: u64 = 10071;
/// Conflict as reported by clustered streams.
const CLUSTERED_CONFLICT: u64 = 10164;
/// Invalid per-message TTL.
const INVALID_TTL: u64 = 10165;
/// Per-message TTL on a stream that does not allow it.
const TTL_NOT_ALLOWED: u64 = 10166;

/// How to reach NATS and how to lay out a job's buckets. New fields may be added in minor
/// releases: start from [`NatsConfig::new`] and set the fields you need.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct NatsConfig {
    /// `nats://HOST:PORT` (several may be given, comma-separated).
    pub url: String,
    /// Bucket replicas: 1 for a single server, 3 for a production cluster.
    pub replicas: usize,
    /// Timeout of one request; an unanswered write is `Indeterminate`.
    pub op_timeout: Duration,
    /// How long delete and expiry markers live in the lease bucket. Keep it well above 15 s:
    /// in a cluster a watch can be blind for ~10 s when the node holding its consumer dies.
    pub limit_marker_ttl: Duration,
    /// Authentication.
    pub auth: NatsAuth,
    /// Require TLS.
    pub tls_required: bool,
    /// Extra root certificate (PEM) for TLS.
    pub tls_root_certificate: Option<PathBuf>,
    /// Create the job's buckets when they do not exist (needs [`Access::Create`]). Off, a
    /// missing bucket is a setup error saying how to create it.
    pub create_buckets: bool,
}

/// Authentication options async-nats supports.
#[derive(Clone, Debug, Default)]
#[non_exhaustive]
pub enum NatsAuth {
    /// None.
    #[default]
    None,
    /// A token.
    Token(String),
    /// User and password.
    UserPassword(String, String),
    /// A `.creds` file (JWT + NKey).
    CredentialsFile(PathBuf),
}

impl NatsConfig {
    /// Defaults for `url`: one replica, 5 s op timeout, 60 s limit markers, no auth.
    pub fn new(url: impl Into<String>) -> Self {
        NatsConfig {
            url: url.into(),
            replicas: 1,
            op_timeout: Duration::from_secs(5),
            limit_marker_ttl: Duration::from_secs(60),
            auth: NatsAuth::None,
            tls_required: false,
            tls_root_certificate: None,
            create_buckets: true,
        }
    }
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

/// One KV bucket.
#[derive(Clone)]
pub struct NatsStore {
    client: async_nats::Client,
    js: jetstream::Context,
    kv: kv::Store,
    bucket: String,
    stream: String,
    /// The bucket's stream, for reads through its leader.
    leader: jetstream::stream::Stream,
    op_timeout: Duration,
    /// Lease bucket: deletes leave a marker with this TTL instead of a permanent tombstone.
    marker_ttl: Option<Duration>,
    /// What the server refused this connection.
    refusals: Refusals,
    /// The bucket's stream replicas, as the server reported them at connect.
    replicas: usize,
}

impl std::fmt::Debug for NatsStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NatsStore").field("bucket", &self.bucket).finish_non_exhaustive()
    }
}

/// The minimum server version: per-message TTLs and KV limit markers shipped in 2.11.
pub const MIN_SERVER_VERSION: (u64, u64) = (2, 11);

fn setup(msg: String) -> StoreError {
    StoreError::Setup(msg)
}

/// Parses `v2.11.3` / `2.10.26-beta` into (major, minor).
fn parse_version(v: &str) -> Option<(u64, u64)> {
    let v = v.trim_start_matches('v');
    let mut parts = v.split(['.', '-']);
    Some((parts.next()?.parse().ok()?, parts.next()?.parse().ok()?))
}

/// What the server refused a connection (an `-ERR` line), as the client's event callback saw it.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Refusal {
    /// The credentials, or their absence.
    Credentials,
    /// A missing permission: `publish` to or `subscribe` to `subject`.
    Permission { verb: &'static str, subject: String },
}

impl Refusal {
    /// `Permissions Violation for Publish to "S"` / `... for Subscription to "S"`.
    fn parse(e: &async_nats::ServerError) -> Option<Refusal> {
        let text = match e {
            async_nats::ServerError::AuthorizationViolation => return Some(Refusal::Credentials),
            async_nats::ServerError::Other(t) => t,
            async_nats::ServerError::SlowConsumer(_) => return None,
        };
        let lower = text.to_lowercase();
        if lower.contains("authorization violation") || lower.contains("authentication") {
            return Some(Refusal::Credentials);
        }
        if !lower.contains("permissions violation") {
            return None;
        }
        let verb = if lower.contains("for subscription") { "subscribe" } else { "publish" };
        let subject = text.split('"').nth(1).unwrap_or(text).to_owned();
        Some(Refusal::Permission { verb, subject })
    }
}

/// What a connection of a job was refused, and how to say what to do about it.
#[derive(Clone)]
struct Refusals {
    rx: watch::Receiver<Option<Refusal>>,
    url: String,
    job: JobName,
    credentials: String,
}

impl Refusals {
    fn new(config: &NatsConfig, job: &JobName) -> (Refusals, watch::Sender<Option<Refusal>>) {
        let (tx, rx) = watch::channel(None);
        let credentials = match &config.auth {
            NatsAuth::None => "no credentials given".to_owned(),
            NatsAuth::Token(_) => "a token".to_owned(),
            NatsAuth::UserPassword(u, _) => format!("user {u:?}"),
            NatsAuth::CredentialsFile(p) => format!("credentials file {}", p.display()),
        };
        (Refusals { rx, url: config.url.clone(), job: job.clone(), credentials }, tx)
    }

    /// The setup error of the first refusal, if there was one.
    fn error(&self) -> Option<StoreError> {
        self.rx.borrow().as_ref().map(|r| setup(self.describe(r)))
    }

    fn describe(&self, refusal: &Refusal) -> String {
        let (url, job, who) = (&self.url, &self.job, &self.credentials);
        let Refusal::Permission { verb, subject } = refusal else {
            return format!(
                "NATS at {url} refused the connection's credentials ({who}): authorization violation; \
                 give job {job}'s credentials (a user and password, a token or a creds file) and check them \
                 against the server's authorization block"
            );
        };
        if let Some(stream) = subject.strip_prefix("$JS.API.STREAM.CREATE.") {
            let bucket = stream.strip_prefix("KV_").unwrap_or(stream);
            return format!(
                "bucket {bucket} does not exist and NATS at {url} does not allow {who} to create it (publish to \
                 {subject:?} denied): create job {job}'s buckets first as a user allowed to, with `etl-coord \
                 nats-buckets --job {job}` (its permissions: `etl-coord nats-permissions --job {job} --create`), \
                 or grant this user publish on {subject:?}"
            );
        }
        let needed = permissions(job, Access::Use);
        let list = if *verb == "subscribe" { &needed.subscribe } else { &needed.publish };
        match Permissions::covering(list, subject) {
            Some(entry) => format!(
                "NATS at {url} denied {who} permission to {verb} to {subject:?}: a client of job {job} needs \
                 every permission `etl-coord nats-permissions --job {job}` prints; this one is missing: \
                 {verb} allow {entry:?}"
            ),
            None => format!(
                "NATS at {url} denied {who} permission to {verb} to {subject:?}, which is not among job {job}'s \
                 permissions (`etl-coord nats-permissions --job {job}`): please report this as a bug"
            ),
        }
    }

    /// Runs `fut` unless the connection has been refused, and ends it with the refusal's error
    /// as soon as one arrives (a refused request would otherwise only time out).
    async fn guard<T>(&self, fut: impl Future<Output = Result<T, StoreError>>) -> Result<T, StoreError> {
        if let Some(e) = self.error() {
            return Err(e);
        }
        tokio::select! {
            r = fut => match (r, self.error()) {
                (Err(_), Some(refused)) => Err(refused),
                (r, _) => r,
            },
            refused = self.refused() => Err(match refused {
                // The request was cut short: a write may still have applied. The fence keeps that
                // safe (the worker stops on a setup error); the message keeps it honest.
                StoreError::Setup(msg) => setup(format!("{msg} (a request in flight when the refusal came may have applied)")),
                other => other,
            }),
        }
    }

    /// Resolves when the connection has been refused; never if it is not (also once the
    /// connection is closed and nothing can be refused any more).
    async fn refused(&self) -> StoreError {
        let mut rx = self.rx.clone();
        if rx.wait_for(Option::is_some).await.is_err() {
            std::future::pending::<()>().await;
        }
        self.error().expect("a refusal was recorded")
    }
}

/// Connects, checks the server (P1) and creates or validates the job's buckets.
pub async fn connect(config: &NatsConfig, job: &JobName) -> Result<NatsJob, StoreError> {
    let (refusals, refused) = Refusals::new(config, job);
    let client = open_connection(config, job, &refusals, Arc::new(refused)).await?;
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
    let state = bucket(&client, &js, config, &refusals, &state_name, false, &mut created).await?;
    let lease = bucket(&client, &js, config, &refusals, &lease_name, true, &mut created).await?;
    for store in [&state, &lease] {
        store.probe().await?;
    }
    Ok(NatsJob { state, lease, created })
}

/// The client options of a job's connection: credentials, TLS, the job's reply prefix, and an
/// event callback that records what the server refuses.
async fn options(
    config: &NatsConfig,
    job: &JobName,
    refused: Arc<watch::Sender<Option<Refusal>>>,
) -> Result<async_nats::ConnectOptions, StoreError> {
    let mut opts = async_nats::ConnectOptions::new()
        .connection_timeout(config.op_timeout)
        .request_timeout(Some(config.op_timeout))
        .max_reconnects(None)
        .custom_inbox_prefix(inbox_prefix(job))
        .event_callback(move |event| {
            let refused = refused.clone();
            async move {
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
async fn open_connection(
    config: &NatsConfig,
    job: &JobName,
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
        let opts = options(config, job, refused.clone()).await?;
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

/// How long setup retries what a server that is starting, electing or loaded answers (late,
/// "temporarily unavailable", a bucket not yet visible on every node) before giving up.
const SETUP_WINDOW: Duration = Duration::from_secs(15);

/// Pauses between setup attempts: 50 ms doubling up to 500 ms, each with a random extra of up
/// to itself (jitter: workers that start together do not retry in lockstep), within
/// [`SETUP_WINDOW`].
struct SetupRetry {
    deadline: tokio::time::Instant,
    delays: backon::ExponentialBackoff,
}

impl SetupRetry {
    fn new() -> Self {
        use backon::BackoffBuilder;
        let delays = backon::ExponentialBuilder::default()
            .with_min_delay(Duration::from_millis(50))
            .with_max_delay(Duration::from_millis(500))
            .with_jitter()
            .without_max_times()
            .build();
        SetupRetry { deadline: tokio::time::Instant::now() + SETUP_WINDOW, delays }
    }

    /// Waits before the next attempt; false (without waiting) once the window is used up.
    async fn pause(&mut self) -> bool {
        let pause = self.delays.next().unwrap_or(Duration::from_millis(500));
        if tokio::time::Instant::now() + pause > self.deadline {
            return false;
        }
        tokio::time::sleep(pause).await;
        true
    }
}

/// The account's JetStream information (P1). A cluster still electing its meta leader answers
/// "temporarily unavailable" and a loaded server answers late: both are retried for
/// [`SETUP_WINDOW`] and then reported as unavailable. No responders (JetStream is not enabled)
/// and any other API error are final, with what to do about them.
async fn query_account(
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

async fn bucket(
    client: &async_nats::Client,
    js: &jetstream::Context,
    config: &NatsConfig,
    refusals: &Refusals,
    name: &str,
    ttl: bool,
    created: &mut Vec<String>,
) -> Result<NatsStore, StoreError> {
    let cfg = kv::Config {
        bucket: name.to_owned(),
        history: 1,
        num_replicas: config.replicas,
        limit_markers: ttl.then_some(config.limit_marker_ttl),
        ..Default::default()
    };
    let stream = format!("KV_{name}");
    let (kv, leader, stream_config, new) =
        refusals.guard(open_or_create(js, cfg, &stream, config.create_buckets, refusals)).await?;
    if new {
        created.push(name.to_owned());
    }
    if ttl && (!stream_config.allow_message_ttl || stream_config.subject_delete_marker_ttl.is_none()) {
        return Err(setup(format!(
            "bucket {name} exists without per-message TTLs and limit markers, so leases would never expire; delete it (`nats kv del {name}`) or use another job name"
        )));
    }
    if stream_config.max_messages_per_subject != 1 {
        return Err(setup(format!(
            "bucket {name} keeps history {} (must be 1: with history the server raises every TTL to the marker TTL); delete it or use another job name",
            stream_config.max_messages_per_subject
        )));
    }
    Ok(NatsStore {
        client: client.clone(),
        js: js.clone(),
        kv,
        bucket: name.to_owned(),
        stream,
        leader,
        op_timeout: config.op_timeout,
        marker_ttl: ttl.then_some(config.limit_marker_ttl),
        refusals: refusals.clone(),
        replicas: stream_config.num_replicas,
    })
}

/// Opens the bucket, or creates it if it does not exist (and `create` allows), and reads back
/// its stream's configuration; true if this call created it. Workers of a new job start
/// together, so creation races are normal: a create fails because another worker's create is
/// in flight, and on a cluster a new stream becomes visible to every server (and gets a leader
/// that answers for it) a moment later, so opening it or reading its configuration meanwhile
/// says "stream not found". All of it is retried for [`SETUP_WINDOW`]; a bucket that still
/// cannot be opened or created is reported as unavailable with the last errors.
async fn open_or_create(
    js: &jetstream::Context,
    cfg: kv::Config,
    stream: &str,
    create: bool,
    refusals: &Refusals,
) -> Result<(kv::Store, jetstream::stream::Stream, jetstream::stream::Config, bool), StoreError> {
    let mut retry = SetupRetry::new();
    loop {
        let mut new = false;
        // Create only what the server says does not exist: a late answer or an election
        // ("temporarily unavailable", a stream not yet visible here) is asked again, never
        // answered with a create (which a user without the create permission is refused).
        let kv = match js.get_key_value(&cfg.bucket).await {
            Ok(kv) => Ok(kv),
            Err(opening) => match stream_missing(js, stream).await {
                false => Err(format!("opening it: {opening}")),
                true if !create => {
                    let job = &refusals.job;
                    return Err(setup(format!(
                        "bucket {} does not exist: create job {job}'s buckets first, with `etl-coord nats-buckets \
                         --job {job}` as a user allowed to (`etl-coord nats-permissions --job {job} --create`)",
                        cfg.bucket
                    )));
                }
                true => match js.create_key_value(cfg.clone()).await {
                    Ok(kv) => {
                        new = true;
                        Ok(kv)
                    }
                    Err(e) if e.to_string().contains("replicas > 1 not supported") => {
                        return Err(setup(format!(
                            "cannot create bucket {} with {} replicas: the server is not clustered ({e}); \
                             use --nats-replicas 1 on a single server",
                            cfg.bucket, cfg.num_replicas
                        )));
                    }
                    Err(e) => Err(format!("opening it: {opening}; creating it: {e}")),
                },
            },
        };
        let last = match kv {
            Ok(kv) => match read_config(js, stream).await {
                Ok((handle, config)) => return Ok((kv, handle, config, new)),
                Err(e) => format!("reading its configuration: {e}"),
            },
            Err(e) => e,
        };
        if !retry.pause().await {
            return Err(StoreError::Unavailable(format!(
                "cannot create or open bucket {} ({last})",
                cfg.bucket
            )));
        }
    }
}

/// Whether the server says `stream` does not exist (not merely that it did not answer).
async fn stream_missing(js: &jetstream::Context, stream: &str) -> bool {
    use jetstream::context::GetStreamErrorKind as G;
    matches!(
        js.get_stream(stream).await,
        Err(e) if matches!(e.kind(), G::JetStream(j) if j.error_code() == jetstream::ErrorCode::STREAM_NOT_FOUND)
    )
}

async fn read_config(
    js: &jetstream::Context,
    stream: &str,
) -> Result<(jetstream::stream::Stream, jetstream::stream::Config), String> {
    let mut s = js.get_stream(stream).await.map_err(|e| e.to_string())?;
    let config = s.info().await.map_err(|e| e.to_string())?.config.clone();
    Ok((s, config))
}

/// The latest message of a key: its value, revision, and whether it is a live value (not a
/// delete, purge or expiry marker).
struct Latest {
    value: Bytes,
    revision: u64,
    live: bool,
}

/// The JetStream API error code anywhere in an error's source chain.
fn api_code(err: &(dyn std::error::Error + 'static)) -> Option<u64> {
    let mut cur = Some(err);
    while let Some(e) = cur {
        if let Some(js) = e.downcast_ref::<jetstream::Error>() {
            return Some(js.error_code().0);
        }
        cur = e.source();
    }
    None
}

impl NatsStore {
    /// The bucket's name.
    pub fn bucket(&self) -> &str {
        &self.bucket
    }

    /// The bucket's replicas (set when it was created; `NatsConfig::replicas` only applies then).
    pub fn replicas(&self) -> usize {
        self.replicas
    }

    fn subject(&self, key: &Key) -> String {
        format!("$KV.{}.{}", self.bucket, key)
    }

    fn classify_publish(&self, key: &Key, e: &jetstream::context::PublishError) -> StoreError {
        use jetstream::context::PublishErrorKind as K;
        match (e.kind(), api_code(e)) {
            (K::WrongLastSequence, _) | (_, Some(WRONG_LAST_SEQUENCE | CLUSTERED_CONFLICT)) => {
                StoreError::RevisionMismatch(key.clone())
            }
            (_, Some(INVALID_TTL)) => StoreError::InvalidValue(format!("TTL rejected by the server: {e}")),
            (_, Some(TTL_NOT_ALLOWED)) => {
                setup(format!("bucket {} does not allow per-message TTLs: {e}", self.bucket))
            }
            (K::MaxPayloadExceeded, _) => {
                StoreError::InvalidValue(format!("value too large for the server: {e}"))
            }
            // No responders: nobody stored it. Whether the bucket is gone is decided by the
            // caller (`no_responders`), which asks the server.
            (K::StreamNotFound, _) => StoreError::Unavailable(format!("publish to {key}: {e}")),
            // Sent or maybe sent: the write may have applied.
            _ => StoreError::Indeterminate(format!("publish to {key}: {e}")),
        }
    }

    async fn publish(
        &self,
        key: &Key,
        value: Bytes,
        expected: u64,
        ttl: Option<Duration>,
    ) -> Result<Revision, StoreError> {
        let mut msg = PublishMessage::build().payload(value).expected_last_subject_sequence(expected);
        if let Some(t) = ttl {
            msg = msg.ttl(t);
        }
        let fut = async {
            let ack = self.js.send_publish(self.subject(key), msg).await?;
            ack.await
        };
        self.refusals
            .guard(async {
                match tokio::time::timeout(self.op_timeout, fut).await {
                    Err(_) => Err(StoreError::Indeterminate(format!(
                        "no acknowledgement for {key} within {:?}",
                        self.op_timeout
                    ))),
                    Ok(Ok(ack)) => Ok(Revision(ack.sequence)),
                    Ok(Err(e)) if e.kind() == jetstream::context::PublishErrorKind::StreamNotFound => {
                        Err(self.no_responders(key).await)
                    }
                    Ok(Err(e)) => Err(self.classify_publish(key, &e)),
                }
            })
            .await
    }

    /// A publish found no responder for the bucket's subject. Nothing was stored. That is
    /// transient on a cluster right after another worker created the bucket (the stream's
    /// subject interest has not reached this server yet) and during stream leader changes;
    /// it is fatal only if the bucket's stream really no longer exists.
    async fn no_responders(&self, key: &Key) -> StoreError {
        use jetstream::context::GetStreamErrorKind as G;
        match tokio::time::timeout(self.op_timeout, self.js.get_stream(&self.stream)).await {
            Ok(Err(e)) if matches!(e.kind(), G::JetStream(j) if j.error_code() == jetstream::ErrorCode::STREAM_NOT_FOUND) => {
                setup(format!(
                    "bucket {} is gone (its stream {} was deleted, and with it the job's plan and progress); restarting the workers recreates it and runs the job again from the start",
                    self.bucket, self.stream
                ))
            }
            _ => StoreError::Unavailable(format!(
                "no JetStream responder for {key} in bucket {} (stream not ready on this server yet, or electing a leader)",
                self.bucket
            )),
        }
    }

    /// The latest message of `key`, read through the stream leader (never a direct get, which
    /// a lagging replica may answer).
    async fn latest(&self, key: &Key) -> Result<Option<Latest>, StoreError> {
        let subject = self.subject(key);
        let read =
            tokio::time::timeout(self.op_timeout, self.leader.get_last_raw_message_by_subject(&subject));
        self.refusals.guard(async { Self::classify_read(key, read.await, self.op_timeout) }).await
    }

    fn classify_read(
        key: &Key,
        read: Result<
            Result<async_nats::jetstream::message::StreamMessage, jetstream::stream::LastRawMessageError>,
            tokio::time::error::Elapsed,
        >,
        op_timeout: Duration,
    ) -> Result<Option<Latest>, StoreError> {
        use jetstream::stream::LastRawMessageErrorKind as L;
        match read {
            Err(_) => Err(StoreError::Unavailable(format!("no answer reading {key} within {op_timeout:?}"))),
            Ok(Ok(m)) => {
                let op = m.headers.get("KV-Operation").map(|v| v.as_str().to_owned());
                let marker = m.headers.get("Nats-Marker-Reason").is_some();
                let live = !marker && !matches!(op.as_deref(), Some("DEL") | Some("PURGE"));
                Ok(Some(Latest { value: m.payload, revision: m.sequence, live }))
            }
            Ok(Err(e)) if e.kind() == L::NoMessageFound => Ok(None),
            Ok(Err(e)) => Err(StoreError::Unavailable(format!("reading {key}: {e}"))),
        }
    }

    /// An ordered consumer over the latest message of every subject under `prefix`, and the
    /// number of messages it will deliver before it is caught up.
    async fn snapshot_consumer(&self, prefix: &Prefix) -> Result<(consumer::push::Ordered, u64), StoreError> {
        self.refusals.guard(self.open_snapshot(prefix)).await
    }

    async fn open_snapshot(&self, prefix: &Prefix) -> Result<(consumer::push::Ordered, u64), StoreError> {
        let filter = format!("$KV.{}.{}>", self.bucket, prefix.as_str());
        let unavailable = |e: String| StoreError::Unavailable(e);
        let consumer = tokio::time::timeout(
            self.op_timeout,
            self.leader.create_consumer(consumer::push::OrderedConfig {
                deliver_subject: self.client.new_inbox(),
                description: Some("etl-coordination watch".into()),
                filter_subject: filter,
                deliver_policy: consumer::DeliverPolicy::LastPerSubject,
                replay_policy: consumer::ReplayPolicy::Instant,
                ..Default::default()
            }),
        )
        .await
        .map_err(|_| unavailable("timed out creating a watch consumer".into()))?
        .map_err(|e| unavailable(format!("creating a watch consumer: {e}")))?;
        let pending = consumer.cached_info().num_pending;
        let messages =
            consumer.messages().await.map_err(|e| unavailable(format!("starting a watch: {e}")))?;
        Ok((messages, pending))
    }

    /// Uses each kind of request a job makes (a read through the leader, a watch consumer, a
    /// write that cannot apply: it expects a revision no key has) so that a missing permission
    /// is reported at start, naming the subject, rather than when a lane first needs it.
    /// Other outcomes are left to the protocol.
    async fn probe(&self) -> Result<(), StoreError> {
        let key = Key::new("etl-coordination-permission-probe").expect("a valid key");
        let prefix = Prefix::new("etl-coordination-permission-probe.").expect("a valid prefix");
        let fatal = |r: Result<(), StoreError>| match r {
            Err(e @ StoreError::Setup(_)) => Err(e),
            _ => Ok(()),
        };
        fatal(self.latest(&key).await.map(drop))?;
        fatal(self.list(&prefix).await.map(drop))?;
        fatal(self.publish(&key, Bytes::new(), u64::MAX, None).await.map(drop))
    }

    fn event(&self, msg: &jetstream::Message) -> Option<(WatchEvent, u64)> {
        let info = msg.info().ok()?;
        let key =
            Key::new(msg.subject.as_str().strip_prefix(&format!("$KV.{}.", self.bucket))?.to_owned()).ok()?;
        let revision = Revision(info.stream_sequence);
        let headers = msg.headers.as_ref();
        let op = headers.and_then(|h| h.get("KV-Operation")).map(|v| v.as_str().to_owned());
        let marker = headers.and_then(|h| h.get("Nats-Marker-Reason")).is_some();
        let ev = match op.as_deref() {
            Some("DEL") | Some("PURGE") => WatchEvent::Delete { key, revision, cause: DeleteCause::Deleted },
            _ if marker => WatchEvent::Delete { key, revision, cause: DeleteCause::Expired },
            _ => WatchEvent::Put(Entry { key, value: msg.payload.clone(), revision }),
        };
        Some((ev, info.pending))
    }
}

impl Store for NatsStore {
    async fn create(&self, key: &Key, value: Bytes, ttl: Option<Duration>) -> Result<Revision, StoreError> {
        validate_ttl(ttl)?;
        validate_value(&value)?;
        let mut expected = 0;
        for _ in 0..5 {
            match self.publish(key, value.clone(), expected, ttl).await {
                Err(StoreError::RevisionMismatch(_)) => {}
                other => return other,
            }
            // Conflict: a live value, or a delete/expiry marker to write over (docs/NATS.md: a
            // plain re-create over a marker would drop the TTL).
            match self.latest(key).await? {
                Some(e) if e.live => return Err(StoreError::AlreadyExists(key.clone())),
                Some(e) => expected = e.revision,
                None => expected = 0,
            }
        }
        // Refused every time, yet no live value to report: another write to the key is in
        // process at the stream leader (it refuses expected-sequence publishes for a subject
        // while one is uncommitted, e.g. cut off from its followers). That write may land or
        // not; this create applied nothing.
        Err(StoreError::Unavailable(format!(
            "creating {key}: refused 5 times with no live value to report (another write to it is \
             pending at the stream leader); nothing was written"
        )))
    }

    async fn compare_and_swap(
        &self,
        key: &Key,
        expected: Revision,
        value: Bytes,
        ttl: Option<Duration>,
    ) -> Result<Revision, StoreError> {
        validate_ttl(ttl)?;
        validate_value(&value)?;
        if expected.0 == 0 {
            return Err(StoreError::RevisionMismatch(key.clone()));
        }
        self.publish(key, value, expected.0, ttl).await
    }

    async fn delete(&self, key: &Key, expected: Revision) -> Result<(), StoreError> {
        let fut = async {
            match self.marker_ttl {
                // A purge marker that disappears after its TTL (a DEL tombstone would stay forever).
                Some(ttl) => self
                    .kv
                    .purge_expect_revision_with_ttl(key.as_str(), expected.0, ttl)
                    .await
                    .map_err(|e| (api_code(&e), e.to_string())),
                None => self
                    .kv
                    .delete_expect_revision(key.as_str(), Some(expected.0))
                    .await
                    .map_err(|e| (api_code(&e), e.to_string())),
            }
        };
        let done =
            self.refusals.guard(async { Ok(tokio::time::timeout(self.op_timeout, fut).await) }).await?;
        match done {
            Err(_) => Err(StoreError::Indeterminate(format!("no acknowledgement deleting {key}"))),
            Ok(Ok(())) => Ok(()),
            Ok(Err((Some(WRONG_LAST_SEQUENCE | CLUSTERED_CONFLICT), _))) => {
                Err(StoreError::RevisionMismatch(key.clone()))
            }
            Ok(Err((_, msg))) if msg.contains("wrong last sequence") => {
                Err(StoreError::RevisionMismatch(key.clone()))
            }
            Ok(Err((_, msg))) => Err(StoreError::Indeterminate(format!("deleting {key}: {msg}"))),
        }
    }

    async fn get(&self, key: &Key) -> Result<Option<Entry>, StoreError> {
        Ok(self.latest(key).await?.filter(|e| e.live).map(|e| Entry {
            key: key.clone(),
            value: e.value,
            revision: Revision(e.revision),
        }))
    }

    async fn watch(&self, prefix: &Prefix) -> Result<WatchStream, StoreError> {
        let (mut messages, pending) = self.snapshot_consumer(prefix).await?;
        let (tx, rx) = mpsc::unbounded_channel();
        let this = self.clone();
        tokio::spawn(async move {
            let mut in_snapshot = true;
            if pending == 0 {
                in_snapshot = false;
                let _ = tx.send(Ok(WatchEvent::SnapshotComplete));
            }
            loop {
                let next = tokio::select! {
                    m = messages.next() => m,
                    () = tx.closed() => return,
                    e = this.refusals.refused() => {
                        let _ = tx.send(Err(e));
                        return;
                    }
                };
                let msg = match next {
                    Some(Ok(m)) => m,
                    Some(Err(e)) => {
                        // Never poll a failed watch again (docs/NATS.md): end it; the caller resyncs.
                        let _ = tx.send(Err(StoreError::Unavailable(format!("watch failed: {e}"))));
                        return;
                    }
                    None => {
                        let _ = tx.send(Err(StoreError::Unavailable("watch ended".into())));
                        return;
                    }
                };
                let Some((ev, left)) = this.event(&msg) else { continue };
                let skip = in_snapshot && matches!(ev, WatchEvent::Delete { .. });
                if !skip && tx.send(Ok(ev)).is_err() {
                    return;
                }
                if in_snapshot && left == 0 {
                    in_snapshot = false;
                    if tx.send(Ok(WatchEvent::SnapshotComplete)).is_err() {
                        return;
                    }
                }
            }
        });
        Ok(etl_coordination_store::channel_watch(rx))
    }

    async fn list(&self, prefix: &Prefix) -> Result<Vec<Entry>, StoreError> {
        self.refusals.guard(self.list_all(prefix)).await
    }

    fn op_timeout(&self) -> Option<Duration> {
        Some(self.op_timeout)
    }
}

impl NatsStore {
    async fn list_all(&self, prefix: &Prefix) -> Result<Vec<Entry>, StoreError> {
        let (mut messages, pending) = self.open_snapshot(prefix).await?;
        let mut out = Vec::new();
        if pending == 0 {
            return Ok(out);
        }
        loop {
            let msg = match tokio::time::timeout(self.op_timeout, messages.next()).await {
                Ok(Some(Ok(m))) => m,
                Ok(Some(Err(e))) => return Err(StoreError::Unavailable(format!("listing: {e}"))),
                Ok(None) | Err(_) => return Err(StoreError::Unavailable("listing did not complete".into())),
            };
            let Some((ev, left)) = self.event(&msg) else { continue };
            if let WatchEvent::Put(e) = ev {
                out.push(e);
            }
            if left == 0 {
                break;
            }
        }
        out.sort_by(|a, b| a.key.cmp(&b.key));
        Ok(out)
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
