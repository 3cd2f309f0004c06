//! Opening or creating a job's buckets and checking their configuration.

use async_nats::jetstream::{self, kv};
use etl_coordination_core::StoreError;

use crate::config::NatsConfig;
use crate::refusals::Refusals;
use crate::setup::{SetupRetry, setup};
use crate::store::NatsStore;

pub(crate) async fn bucket(
    client: &async_nats::Client,
    js: &jetstream::Context,
    config: &NatsConfig,
    refusals: &Refusals,
    name: &str,
    ttl: bool,
    created: &mut Vec<String>,
) -> Result<Option<NatsStore>, StoreError> {
    let cfg = kv::Config {
        bucket: name.to_owned(),
        history: 1,
        num_replicas: config.replicas,
        limit_markers: ttl.then_some(config.limit_marker_ttl),
        max_bytes: if ttl { config.lease_max_bytes } else { config.state_max_bytes }.unwrap_or(-1),
        ..Default::default()
    };
    let stream = format!("KV_{name}");
    let opened = refusals.guard(open_or_create(js, cfg, &stream, config.create_buckets)).await?;
    let Some((kv, leader, stream_config, new)) = opened else { return Ok(None) };
    if new {
        created.push(name.to_owned());
    }
    if ttl && (!stream_config.allow_message_ttl || stream_config.subject_delete_marker_ttl.is_none()) {
        return Err(setup(format!(
            "bucket {name} exists without per-message TTLs and limit markers, so leases would never expire; delete it (`nats kv del {name}`) or use another job name"
        )));
    }
    if !ttl && stream_config.allow_rollup {
        let job = job_of(name);
        tracing::warn!(
            bucket = name,
            "the state bucket accepts rollup headers (an earlier release created it): one message with \
             `Nats-Rollup: all` from any client allowed to write it would replace every record of job \
             {job}; run `etl-coord nats-buckets --job {job}` once as its set-up user, with the \
             permissions `etl-coord nats-permissions --job {job} --create` prints now, to close it"
        );
    }
    if stream_config.max_messages_per_subject != 1 {
        return Err(setup(format!(
            "bucket {name} keeps history {} (must be 1: with history the server raises every TTL to the marker TTL); delete it or use another job name",
            stream_config.max_messages_per_subject
        )));
    }
    Ok(Some(NatsStore {
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
        accepts_rollups: stream_config.allow_rollup,
        max_bytes: stream_config.max_bytes,
    }))
}

/// The job whose bucket `bucket` is (`etl_coordination_JOB_state` or `_lease`), for messages.
fn job_of(bucket: &str) -> &str {
    let job = bucket.strip_prefix("etl_coordination_");
    job.and_then(|j| j.strip_suffix("_state").or_else(|| j.strip_suffix("_lease"))).unwrap_or(bucket)
}

/// The error of a bucket that does not exist where workers may not create it.
pub(crate) fn missing(bucket: &str, job: &etl_coordination_core::JobName) -> StoreError {
    setup(format!(
        "bucket {bucket} does not exist: create job {job}'s buckets first, with `etl-coord nats-buckets \
         --job {job}` as a user allowed to (`etl-coord nats-permissions --job {job} --create`)"
    ))
}

/// Opens the bucket, or creates it if it does not exist (and `create` allows), and reads back
/// its stream's configuration; true if this call created it. `None`: it does not exist and
/// `create` is off. Workers of a new job start
/// together, so creation races are normal: a create fails because another worker's create is
/// in flight, and on a cluster a new stream becomes visible to every server (and gets a leader
/// that answers for it) a moment later, so opening it or reading its configuration meanwhile
/// says "stream not found". All of it is retried for [`SETUP_WINDOW`](crate::setup::SETUP_WINDOW); a bucket that still
/// cannot be opened or created is reported as unavailable with the last errors.
async fn open_or_create(
    js: &jetstream::Context,
    cfg: kv::Config,
    stream: &str,
    create: bool,
) -> Result<Option<(kv::Store, jetstream::stream::Stream, jetstream::stream::Config, bool)>, StoreError> {
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
                true if !create => return Ok(None),
                true => match create_bucket(js, &cfg).await {
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
                    Err(e) if e.contains("requires a stream config to have max bytes") => {
                        return Err(setup(format!(
                            "cannot create bucket {} unbounded: its NATS account requires every stream to \
                             be bounded (max_bytes_required, as `etl-coord nats-account` prints it) ({e}); \
                             create the job's buckets with bounds: `etl-coord nats-buckets --job {} \
                             --nats-max-bytes BYTES --nats-lease-max-bytes BYTES` as its set-up user, the \
                             two bounds times --nats-replicas within the account's max_file",
                            cfg.bucket,
                            job_of(&cfg.bucket)
                        )));
                    }
                    Err(e)
                        if e.contains("insufficient storage resources")
                            || e.contains("resource limits exceeded") =>
                    {
                        return Err(setup(format!(
                            "cannot create bucket {} bounded at {} bytes: the server cannot reserve that much \
                             storage ({e}); a bound is reserved from the server's max_file_store and the \
                             account's max_file when the bucket is created: lower --nats-max-bytes / \
                             --nats-lease-max-bytes, or raise those limits",
                            cfg.bucket, cfg.max_bytes
                        )));
                    }
                    Err(e) => Err(format!("opening it: {opening}; creating it: {e}")),
                },
            },
        };
        let last = match kv {
            Ok(kv) => match read_config(js, stream).await {
                Ok((handle, config)) => return Ok(Some((kv, handle, config, new))),
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

/// Creates the bucket. The state bucket's stream (no limit markers) is created here rather than
/// by `create_key_value`, which always allows `Nats-Rollup` headers: one message with
/// `Nats-Rollup: all` would replace every record of the job, and nothing of ours sends one
/// there (deletes are tombstones, not purges). Otherwise it is the stream `create_key_value`
/// makes. The lease bucket keeps rollups: its limit markers are rollups.
async fn create_bucket(js: &jetstream::Context, cfg: &kv::Config) -> Result<kv::Store, String> {
    if cfg.limit_markers.is_some() {
        return js.create_key_value(cfg.clone()).await.map_err(|e| e.to_string());
    }
    let stream = jetstream::stream::Config {
        name: format!("KV_{}", cfg.bucket),
        subjects: vec![format!("$KV.{}.>", cfg.bucket)],
        max_messages_per_subject: cfg.history.max(1),
        num_replicas: cfg.num_replicas.max(1),
        allow_rollup: false,
        deny_delete: true,
        deny_purge: false,
        allow_direct: true,
        discard: jetstream::stream::DiscardPolicy::New,
        max_bytes: cfg.max_bytes,
        ..Default::default()
    };
    js.create_stream(stream).await.map_err(|e| e.to_string())?;
    js.get_key_value(&cfg.bucket).await.map_err(|e| e.to_string())
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
