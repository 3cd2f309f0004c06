//! The jobs an account holds: every pair of buckets named after a job, found by listing the
//! account's streams (what `etl-coord jobs` prints). It reads, never creates.

use std::collections::BTreeMap;
use std::sync::Arc;

use async_nats::jetstream;
use async_nats::jetstream::stream::LastRawMessageErrorKind;
use etl_coordination_core::{JobName, StoreError};
use futures_util::TryStreamExt;

use crate::config::NatsConfig;
use crate::connect::{open_connection, query_account};
use crate::refusals::Refusals;

/// The prefix of every stream behind a job's bucket (`KV_` and the bucket's name).
const STREAM_PREFIX: &str = "KV_etl_coordination_";

/// One job an account holds.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct JobListing {
    /// The job's name.
    pub job: JobName,
    /// Whether its state bucket exists.
    pub state_bucket: bool,
    /// Whether its lease bucket exists.
    pub lease_bucket: bool,
    /// Whether a worker has started it (its `meta` record exists).
    pub started: bool,
    /// Records in the state bucket (plan, manifests, descriptors, split records).
    pub records: u64,
    /// Bytes the state bucket holds on the server.
    pub bytes: u64,
}

/// Which job and bucket a stream belongs to, if it is one of a job's buckets.
fn parse_stream(name: &str) -> Option<(JobName, bool)> {
    let rest = name.strip_prefix(STREAM_PREFIX)?;
    let (job, state) = match (rest.strip_suffix("_state"), rest.strip_suffix("_lease")) {
        (Some(job), _) => (job, true),
        (None, Some(job)) => (job, false),
        (None, None) => return None,
    };
    Some((JobName::new(job.to_owned()).ok()?, state))
}

/// Lists the jobs whose buckets the account at `config.url` holds, by name. Needs the
/// permission to list and inspect the account's streams (an administrator's; a job's own user
/// is refused, with an error that says so).
pub async fn list_jobs(config: &NatsConfig) -> Result<Vec<JobListing>, StoreError> {
    let (refusals, refused) = Refusals::new(config, None);
    let client = open_connection(config, None, &refusals, Arc::new(refused)).await?;
    let mut js = jetstream::new(client);
    js.set_timeout(config.op_timeout);
    refusals.guard(query_account(&js, config)).await?;
    refusals.guard(list(&js, config)).await
}

async fn list(js: &jetstream::Context, config: &NatsConfig) -> Result<Vec<JobListing>, StoreError> {
    let unavailable = |what: &str, e: &dyn std::fmt::Display| {
        StoreError::Unavailable(format!("{what} at {}: {e}", config.url))
    };
    let names: Vec<String> =
        js.stream_names().try_collect().await.map_err(|e| unavailable("listing the streams", &e))?;
    let mut jobs: BTreeMap<JobName, JobListing> = BTreeMap::new();
    for name in names {
        let Some((job, state)) = parse_stream(&name) else { continue };
        let entry = jobs.entry(job.clone()).or_insert(JobListing {
            job,
            state_bucket: false,
            lease_bucket: false,
            started: false,
            records: 0,
            bytes: 0,
        });
        if !state {
            entry.lease_bucket = true;
            continue;
        }
        entry.state_bucket = true;
        let stream = js.get_stream(&name).await.map_err(|e| unavailable(&format!("reading {name}"), &e))?;
        let state = &stream.cached_info().state;
        (entry.records, entry.bytes) = (state.messages, state.bytes);
        let bucket = &name["KV_".len()..];
        entry.started = match stream.get_last_raw_message_by_subject(&format!("$KV.{bucket}.meta")).await {
            // A delete or purge leaves a marker (the KV-Operation header): no meta.
            Ok(m) => m.headers.get("KV-Operation").is_none(),
            Err(e) if e.kind() == LastRawMessageErrorKind::NoMessageFound => false,
            Err(e) => return Err(unavailable(&format!("reading {bucket}'s meta"), &e)),
        };
    }
    Ok(jobs.into_values().collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stream_names_its_job_and_bucket_even_when_the_job_ends_in_a_bucket_suffix() {
        let job = |s: &str| JobName::new(s.to_owned()).unwrap();
        assert_eq!(parse_stream("KV_etl_coordination_orders_state"), Some((job("orders"), true)));
        assert_eq!(parse_stream("KV_etl_coordination_orders_lease"), Some((job("orders"), false)));
        assert_eq!(parse_stream("KV_etl_coordination_a_lease_state"), Some((job("a_lease"), true)));
        assert_eq!(parse_stream("KV_etl_coordination_a_state_lease"), Some((job("a_state"), false)));
        assert_eq!(parse_stream("KV_other_state"), None);
        assert_eq!(parse_stream("KV_etl_coordination_orders"), None);
        assert_eq!(parse_stream("ORDERS"), None);
    }
}
