//! `etl-coord job`: the settings a job keeps in its `meta` record, changed while it runs
//! (`max_attempts`) or across releases (the protocol version, `migrate`).
//!
//! Both write `meta` by a compare-and-swap on the revision they read, so two operators (or an
//! operator and a worker creating the job) never overwrite each other's change unseen.

use anyhow::{Context, bail};
use etl_coordination_core::records::{self, Meta, RecordError, keys};
use etl_coordination_core::{MAX_ATTEMPTS_LIMIT, Prefix, Revision};
use etl_coordination_driver::JobStores;
use etl_coordination_store::Store;

/// Reads `meta`, which exists once any worker has started the job.
async fn meta_entry<S: Store>(stores: &JobStores<S>) -> anyhow::Result<(Revision, bytes::Bytes)> {
    let Some(e) = stores.state.get(&keys::meta()).await? else {
        bail!(
            "job {} has no meta record: no worker has started it in this store (check --job and \
             the store flags; `etl-coord status` shows what a job holds)",
            stores.job
        )
    };
    Ok((e.revision, e.value))
}

/// What [`set_max_attempts`] changed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MaxAttemptsChange {
    /// The job's value before.
    pub before: u32,
    /// The job's value now.
    pub after: u32,
}

/// Sets the job's `max_attempts` (P12: consecutive failing tenancies before a split is
/// quarantined). Workers starting from now use it; running workers take it up at their next
/// resync (within ten lease durations). Splits already quarantined stay so (requeue them);
/// a split whose attempts already reach a lowered value is quarantined at its next failure.
pub async fn set_max_attempts<S: Store>(
    stores: &JobStores<S>,
    value: u32,
) -> anyhow::Result<MaxAttemptsChange> {
    if value == 0 || value > MAX_ATTEMPTS_LIMIT {
        bail!("max_attempts {value} is out of range: it must be between 1 and {MAX_ATTEMPTS_LIMIT}");
    }
    let (revision, bytes) = meta_entry(stores).await?;
    let meta = records::decode_meta(&bytes).map_err(|e| unreadable_meta(stores, &e))?;
    if meta.protocol_version != records::PROTOCOL_VERSION {
        bail!(
            "job {} runs protocol {}, this release protocol {}: change its max_attempts with the \
             release that runs it (or migrate it first: `etl-coord job migrate`)",
            stores.job,
            meta.protocol_version,
            records::PROTOCOL_VERSION
        );
    }
    let before = meta.max_attempts;
    if before != value {
        let changed = Meta { max_attempts: value, ..meta };
        stores
            .state
            .compare_and_swap(&keys::meta(), revision, records::encode(&changed), None)
            .await
            .with_context(|| {
                format!("the meta of job {} changed meanwhile; run the command again", stores.job)
            })?;
    }
    Ok(MaxAttemptsChange { before, after: value })
}

fn unreadable_meta<S>(stores: &JobStores<S>, e: &RecordError) -> anyhow::Error {
    anyhow::anyhow!(
        "the meta record of job {} cannot be decoded ({e}): it was written by a newer release \
         (run that release's command) or by another program",
        stores.job
    )
}

/// What [`migrate`] did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Migration {
    /// The job already runs this release's protocol: nothing was written.
    AlreadyCurrent,
    /// The job was moved.
    Moved {
        /// The protocol it ran.
        from: u32,
        /// This release's.
        to: u32,
        /// Records rewritten in this release's format (meta included).
        rewritten: usize,
        /// Records already in this release's format (a migration run before and stopped).
        kept: usize,
    },
}

/// Moves a job from a previous protocol version to this release's, keeping its plan, its
/// progress and its splits' states: every record of the state bucket is converted to this
/// release's format in memory first (one that cannot be is refused before anything is
/// written), then each is written by a compare-and-swap on the revision read, the lease bucket
/// is checked again, and `meta` is stamped with the new protocol last. A migration cut short
/// leaves `meta` at the old protocol (this release's workers still refuse the job) and part of
/// the records converted: run this command again, which finishes it. On a job already at this
/// protocol it still converts any record of an older format it finds (one written by an old
/// worker started during a migration).
///
/// It refuses while the lease bucket holds anything: a live worker's presence or lease (or a
/// dead one's, until it expires within a lease duration). Stop every worker of the release
/// that runs the job first; workers of this release then run it.
pub async fn migrate<S: Store>(stores: &JobStores<S>) -> anyhow::Result<Migration> {
    let job = &stores.job;
    let (meta_rev, meta_bytes) = meta_entry(stores).await?;
    let meta = records::decode_meta(&meta_bytes).map_err(|e| unreadable_meta(stores, &e))?;
    let from = meta.protocol_version;
    let to = records::PROTOCOL_VERSION;
    if from > to {
        bail!("job {job} runs protocol {from}, newer than this release's {to}: use a newer release");
    }
    if from != to && !records::MIGRATES_FROM.contains(&from) {
        bail!(
            "job {job} runs protocol {from}; this release (protocol {to}) moves jobs from protocol {} \
             only: migrate it with the releases in between, one at a time",
            records::MIGRATES_FROM.iter().map(u32::to_string).collect::<Vec<_>>().join(", ")
        );
    }
    // Every conversion is computed before anything is written.
    let mut converted = Vec::new();
    let mut kept = 0;
    for e in stores.state.list(&Prefix::all()).await? {
        if e.key == keys::meta() {
            continue;
        }
        match records::migrate_state_value(&e.key, &e.value) {
            Ok(Some(value)) => converted.push((e.key, e.revision, value)),
            Ok(None) => kept += 1,
            Err(err) => bail!(
                "{} of job {job} cannot be migrated ({err}); nothing was changed: repair or remove \
                 that record (`etl-coord requeue --reset` rewrites a split's) and run this again",
                e.key
            ),
        }
    }
    let stamp = from != to || meta_bytes.first() != Some(&records::FORMAT_VERSION);
    if !stamp && converted.is_empty() {
        return Ok(Migration::AlreadyCurrent);
    }
    refuse_if_live(stores, "nothing was changed").await?;
    let rewritten = converted.len() + usize::from(stamp);
    for (key, revision, value) in converted {
        stores.state.compare_and_swap(&key, revision, value, None).await.with_context(|| {
            format!(
                "{key} of job {job} changed while migrating: a worker is running on the job; stop \
                 it and run this again (meta still names protocol {from})"
            )
        })?;
    }
    // A worker started meanwhile may have written records this listing did not see.
    refuse_if_live(stores, &format!("meta still names protocol {from}")).await?;
    if stamp {
        let stamped = Meta { protocol_version: to, ..meta };
        stores
            .state
            .compare_and_swap(&keys::meta(), meta_rev, records::encode(&stamped), None)
            .await
            .with_context(|| format!("the meta of job {job} changed while migrating; run this again"))?;
    }
    Ok(Migration::Moved { from, to, rewritten, kept })
}

/// Refuses while the job's lease bucket holds anything (a worker's presence or lease), saying
/// what to do and `state` (what the refusal leaves).
async fn refuse_if_live<S: Store>(stores: &JobStores<S>, state: &str) -> anyhow::Result<()> {
    let live = stores.lease.list(&Prefix::all()).await?;
    if live.is_empty() {
        return Ok(());
    }
    let mut names: Vec<String> = live.iter().map(|e| e.key.to_string()).collect();
    names.sort();
    let shown = names.iter().take(10).cloned().collect::<Vec<_>>().join(", ");
    let more = if names.len() > 10 { format!(" and {} more", names.len() - 10) } else { String::new() };
    bail!(
        "job {} has live workers or leases ({shown}{more}): stop every worker on the job (scale \
         its deployments to 0), wait one lease duration for their leases to expire, and run this \
         again; {state}",
        stores.job
    )
}
