//! What a job's connection is configured with.

use std::path::PathBuf;
use std::time::Duration;

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
    /// Create the job's buckets when they do not exist (needs [`Access::Create`](crate::Access::Create)). Off, a
    /// missing bucket is a setup error saying how to create it.
    pub create_buckets: bool,
    /// The bound, in bytes, of a state bucket this connection creates (`None`: unbounded). On a
    /// shared server it keeps one job from filling the store every job writes to; the server
    /// reserves it from its JetStream storage when the bucket is created. A full bucket refuses
    /// every write of the job with [`StoreError::Setup`](etl_coordination_core::StoreError)
    /// naming the bound. Existing buckets keep theirs.
    pub state_max_bytes: Option<i64>,
    /// The same for the lease bucket (one small record per owned split and per worker).
    pub lease_max_bytes: Option<i64>,
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
    /// Defaults for `url`: one replica, 5 s op timeout, 60 s limit markers, no auth, unbounded
    /// buckets.
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
            state_max_bytes: None,
            lease_max_bytes: None,
        }
    }
}

/// The minimum server version: per-message TTLs and KV limit markers shipped in 2.11.
pub const MIN_SERVER_VERSION: (u64, u64) = (2, 11);
