//! `NatsStore`: one bucket, and the six primitives written around the traps of docs/NATS.md.

use std::time::Duration;

use async_nats::jetstream::{self, kv, message::PublishMessage};
use bytes::Bytes;
use etl_coordination_core::{Entry, Key, Prefix, Revision, StoreError};
use etl_coordination_store::{Store, WatchStream, validate_ttl, validate_value};

use crate::classify::{
    ACCOUNT_RESOURCES, CLUSTERED_CONFLICT, INVALID_TTL, Latest, MessageKind, STORE_FAILED, TTL_NOT_ALLOWED,
    WRONG_LAST_SEQUENCE, api_code,
};
use crate::refusals::Refusals;
use crate::setup::setup;

/// One KV bucket.
#[derive(Clone)]
pub struct NatsStore {
    pub(crate) client: async_nats::Client,
    pub(crate) js: jetstream::Context,
    pub(crate) kv: kv::Store,
    pub(crate) bucket: String,
    pub(crate) stream: String,
    /// The bucket's stream, for reads through its leader.
    pub(crate) leader: jetstream::stream::Stream,
    pub(crate) op_timeout: Duration,
    /// Lease bucket: deletes leave a marker with this TTL instead of a permanent tombstone.
    pub(crate) marker_ttl: Option<Duration>,
    /// What the server refused this connection.
    pub(crate) refusals: Refusals,
    /// The bucket's stream replicas, as the server reported them at connect.
    pub(crate) replicas: usize,
    /// Whether the bucket's stream accepts `Nats-Rollup` headers, as read at connect.
    pub(crate) accepts_rollups: bool,
    /// The bucket's bound in bytes (-1: none), as read at connect.
    pub(crate) max_bytes: i64,
}

impl std::fmt::Debug for NatsStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NatsStore").field("bucket", &self.bucket).finish_non_exhaustive()
    }
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

    /// Whether the bucket's stream accepts `Nats-Rollup` headers (as read at connect). The
    /// lease bucket must (its limit markers are rollups); a state bucket that does lets one
    /// message with `Nats-Rollup: all` replace every record of the job. A state bucket created
    /// by this release refuses them; one created before is closed by
    /// [`NatsStore::refuse_rollups`] (`etl-coord nats-buckets`).
    pub fn accepts_rollups(&self) -> bool {
        self.accepts_rollups
    }

    /// The bucket's bound in bytes, as read at connect (`None`: unbounded).
    pub fn max_bytes(&self) -> Option<i64> {
        (self.max_bytes > 0).then_some(self.max_bytes)
    }

    /// Makes the bucket's stream refuse `Nats-Rollup` headers (a stream update: the user needs
    /// `$JS.API.STREAM.UPDATE.KV_<bucket>`, which [`Access::Create`](crate::Access::Create)
    /// grants for the state bucket). Refused for the lease bucket, whose limit markers are
    /// rollups. Nothing this crate sends to the state bucket is a rollup.
    pub async fn refuse_rollups(&mut self) -> Result<(), StoreError> {
        if self.marker_ttl.is_some() {
            return Err(StoreError::Setup(format!(
                "bucket {} keeps leases: its expiry markers are rollups, so it must accept them",
                self.bucket
            )));
        }
        let update = async {
            let mut info = self.js.get_stream(&self.stream).await.map_err(|e| e.to_string())?;
            let mut config = info.info().await.map_err(|e| e.to_string())?.config.clone();
            config.allow_rollup = false;
            self.js.update_stream(config).await.map_err(|e| e.to_string())
        };
        match self.refusals.guard(async { Ok(tokio::time::timeout(self.op_timeout, update).await) }).await? {
            Ok(Ok(info)) if !info.config.allow_rollup => {
                self.accepts_rollups = false;
                Ok(())
            }
            Ok(Ok(_)) => Err(StoreError::Setup(format!(
                "the server kept rollups allowed on bucket {} after the update",
                self.bucket
            ))),
            Ok(Err(e)) => Err(StoreError::Setup(format!(
                "making bucket {} refuse rollup headers: {e} (the user needs $JS.API.STREAM.UPDATE.{})",
                self.bucket, self.stream
            ))),
            Err(_) => Err(StoreError::Unavailable(format!(
                "no answer updating bucket {} within {:?}",
                self.bucket, self.op_timeout
            ))),
        }
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
            (_, Some(STORE_FAILED)) if e.to_string().contains("maximum bytes exceeded") => self.full(&e),
            (_, Some(ACCOUNT_RESOURCES)) => self.account_full(&e),
            // No responders: nobody stored it. Whether the bucket is gone is decided by the
            // caller (`no_responders`), which asks the server.
            (K::StreamNotFound, _) => StoreError::Unavailable(format!("publish to {key}: {e}")),
            // Sent or maybe sent: the write may have applied.
            _ => StoreError::Indeterminate(format!("publish to {key}: {e}")),
        }
    }

    pub(crate) async fn publish(
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

    /// The bucket is at its bound: nothing was stored, and nothing of the job will be until an
    /// operator raises the bound (or the bucket shrinks, which a running job's writes do not).
    fn full(&self, e: &dyn std::fmt::Display) -> StoreError {
        let bound = if self.max_bytes > 0 {
            format!("it holds at most {} bytes", self.max_bytes)
        } else {
            "it was bounded after this process connected".to_owned()
        };
        let flag = if self.marker_ttl.is_some() { "--nats-lease-max-bytes" } else { "--nats-max-bytes" };
        setup(format!(
            "bucket {} is full: {bound}, and the server refused a write ({e}); raise its bound with \
             `etl-coord nats-buckets --job {} {flag} BYTES` as the job's set-up user, then restart \
             the workers",
            self.bucket,
            self.job()
        ))
    }

    /// The job this bucket belongs to, from its name.
    fn job(&self) -> &str {
        let name = self.bucket.strip_prefix("etl_coordination_").unwrap_or(&self.bucket);
        name.strip_suffix("_state").or_else(|| name.strip_suffix("_lease")).unwrap_or(name)
    }

    /// Raises the bucket's bound to `bytes` (a stream update: the user needs
    /// `$JS.API.STREAM.UPDATE.KV_<bucket>`, which [`Access::Create`](crate::Access::Create)
    /// grants). Never lowers it: a bound below what the bucket holds leaves it full (a KV
    /// bucket discards new writes, not old records). `Ok(false)`: the bound is already at least
    /// `bytes`, or the bucket holds more than `bytes`; nothing changed.
    pub async fn raise_max_bytes(&mut self, bytes: i64) -> Result<bool, StoreError> {
        let update = async {
            let mut stream = self.js.get_stream(&self.stream).await.map_err(|e| e.to_string())?;
            let info = stream.info().await.map_err(|e| e.to_string())?.clone();
            let held = i64::try_from(info.state.bytes).unwrap_or(i64::MAX);
            let current = info.config.max_bytes;
            if (current > 0 && current >= bytes) || held >= bytes {
                return Ok(None);
            }
            let mut config = info.config.clone();
            config.max_bytes = bytes;
            self.js.update_stream(config).await.map(Some).map_err(|e| e.to_string())
        };
        match self.refusals.guard(async { Ok(tokio::time::timeout(self.op_timeout, update).await) }).await? {
            Ok(Ok(None)) => Ok(false),
            Ok(Ok(Some(info))) => {
                self.max_bytes = info.config.max_bytes;
                Ok(true)
            }
            Ok(Err(e)) => Err(StoreError::Setup(format!(
                "raising the bound of bucket {} to {bytes} bytes: {e} (the user needs \
                 $JS.API.STREAM.UPDATE.{}; the server reserves the bound from its storage)",
                self.bucket, self.stream
            ))),
            Err(_) => Err(StoreError::Unavailable(format!(
                "no answer updating bucket {} within {:?}",
                self.bucket, self.op_timeout
            ))),
        }
    }

    /// The job's account is at its storage limit: nothing was stored, and nothing of the job
    /// will be until an operator raises the account's `max_file`.
    fn account_full(&self, e: &dyn std::fmt::Display) -> StoreError {
        setup(format!(
            "the NATS account of bucket {} is at its JetStream storage limit and the server \
             refused a write ({e}); raise `max_file` in the account's jetstream block (`etl-coord \
             nats-account --max-file` prints it), reload the server, then restart the workers",
            self.bucket
        ))
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
    pub(crate) async fn latest(&self, key: &Key) -> Result<Option<Latest>, StoreError> {
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
                let live = MessageKind::of(Some(&m.headers)) == MessageKind::Value;
                Ok(Some(Latest { value: m.payload, revision: m.sequence, live }))
            }
            Ok(Err(e)) if e.kind() == L::NoMessageFound => Ok(None),
            Ok(Err(e)) => Err(StoreError::Unavailable(format!("reading {key}: {e}"))),
        }
    }

    /// Uses each kind of request a job makes (a read through the leader, a watch consumer, a
    /// write that cannot apply: it expects a revision no key has) so that a missing permission
    /// is reported at start, naming the subject, rather than when a lane first needs it.
    /// Other outcomes are left to the protocol.
    pub(crate) async fn probe(&self) -> Result<(), StoreError> {
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
            Ok(Err((_, msg))) if msg.contains("maximum bytes exceeded") => Err(self.full(&msg)),
            Ok(Err((code, msg)))
                if code == Some(ACCOUNT_RESOURCES) || msg.contains("resource limits exceeded") =>
            {
                Err(self.account_full(&msg))
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
        self.watch_prefix(prefix).await
    }

    async fn list(&self, prefix: &Prefix) -> Result<Vec<Entry>, StoreError> {
        self.refusals.guard(self.list_all(prefix)).await
    }

    fn op_timeout(&self) -> Option<Duration> {
        Some(self.op_timeout)
    }
}
