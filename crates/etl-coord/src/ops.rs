//! Operator commands over any store: `status` (plan, leader, workers, every split) and
//! `requeue` (return a quarantined split to the queue).

use anyhow::{Context, bail};
use etl_coordination_core::records::{
    self, EndReason, LeaderRecord, LeaseRecord, ManifestChunk, PlanHead, PresenceRecord, SplitRecord,
    SplitState, keys,
};
use etl_coordination_core::{Prefix, SplitId};
use etl_coordination_driver::JobStores;
use etl_coordination_store::Store;
use serde::Serialize;

/// A job's state as `etl-coord status` shows it.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Status {
    /// Plan head, if any.
    pub plan: Option<PlanView>,
    /// Current leader.
    pub leader: Option<String>,
    /// Live workers with held count and capacity.
    pub workers: Vec<WorkerView>,
    /// Every split of the published manifest.
    pub splits: Vec<SplitView>,
}

/// The plan head.
#[derive(Clone, Debug, Serialize)]
pub struct PlanView {
    /// Term.
    pub term: u64,
    /// Planning or Published.
    pub status: String,
    /// Version of the published manifest.
    pub version: Option<u64>,
    /// Final or Open.
    pub kind: Option<String>,
    /// Splits in the manifest.
    pub split_count: u64,
}

/// One live worker.
#[derive(Clone, Debug, Serialize)]
pub struct WorkerView {
    /// Instance id.
    pub instance: String,
    /// Splits held at its last renewal.
    pub held: u32,
    /// Its max_in_flight.
    pub capacity: u32,
}

/// One split.
#[derive(Clone, Debug, Serialize)]
pub struct SplitView {
    /// Id.
    pub id: String,
    /// Unleased, Owned, Done or Quarantined.
    pub state: String,
    /// Owner (instance id) if owned.
    pub owner: Option<String>,
    /// Whether a live lease exists.
    pub leased: bool,
    /// Epoch.
    pub epoch: u64,
    /// Failing tenancies.
    pub attempts: u32,
    /// Committed progress (rendered as text when printable).
    pub progress: Option<String>,
    /// Last error.
    pub last_error: Option<String>,
}

/// Reads the whole job state.
pub async fn status<S: Store>(stores: &JobStores<S>) -> anyhow::Result<Status> {
    let mut out = Status::default();
    let head = stores
        .state
        .get(&keys::plan_head())
        .await?
        .map(|e| records::decode::<PlanHead>(&e.value))
        .transpose()?;
    if let Some(h) = &head {
        out.plan = Some(PlanView {
            term: h.term,
            status: format!("{:?}", h.status),
            version: h.manifest.map(|m| m.version),
            kind: h.manifest.map(|m| format!("{:?}", m.kind)),
            split_count: h.manifest.map_or(0, |m| m.split_count),
        });
    }
    if let Some(e) = stores.lease.get(&keys::leader()).await? {
        out.leader = Some(records::decode::<LeaderRecord>(&e.value)?.owner.instance.to_string());
    }
    for e in stores.lease.list(&Prefix::new("worker.").expect("valid")).await? {
        if let (Some(id), Ok(p)) = (keys::parse_worker(&e.key), records::decode::<PresenceRecord>(&e.value)) {
            out.workers.push(WorkerView { instance: id.to_string(), held: p.held, capacity: p.capacity });
        }
    }
    let leases: std::collections::BTreeMap<SplitId, LeaseRecord> = stores
        .lease
        .list(&keys::split_prefix())
        .await?
        .into_iter()
        .filter_map(|e| Some((keys::parse_split(&e.key)?, records::decode::<LeaseRecord>(&e.value).ok()?)))
        .collect();
    let Some(m) = head.and_then(|h| h.manifest) else { return Ok(out) };
    for c in 0..m.chunks {
        let e = stores
            .state
            .get(&keys::manifest(m.term, m.version, c))
            .await?
            .context("manifest chunk missing")?;
        for (id, _) in records::decode::<ManifestChunk>(&e.value)?.splits {
            let rec = stores
                .state
                .get(&keys::split(&id))
                .await?
                .map(|e| records::decode::<SplitRecord>(&e.value))
                .transpose()?;
            let Some(r) = rec else { continue };
            out.splits.push(SplitView {
                id: id.to_string(),
                state: format!("{:?}", r.state),
                owner: r.owner.map(|o| o.instance.to_string()),
                leased: leases.contains_key(&id),
                epoch: r.epoch.0,
                attempts: r.attempts,
                progress: r
                    .progress
                    .map(|p| String::from_utf8(p.to_vec()).unwrap_or_else(|_| format!("{} bytes", p.len()))),
                last_error: r.last_error,
            });
        }
    }
    Ok(out)
}

/// Renders a status as a table.
pub fn render(s: &Status) -> String {
    let mut out = String::new();
    match &s.plan {
        Some(p) => out.push_str(&format!(
            "plan: term {} {} version {} ({}), {} splits\n",
            p.term,
            p.status,
            p.version.map_or("-".into(), |v| v.to_string()),
            p.kind.as_deref().unwrap_or("-"),
            p.split_count
        )),
        None => out.push_str("plan: none yet (no leader has planned this job)\n"),
    }
    out.push_str(&format!("leader: {}\n", s.leader.as_deref().unwrap_or("none")));
    out.push_str(&format!("live workers: {}\n", s.workers.len()));
    for w in &s.workers {
        out.push_str(&format!("  {}  holds {}/{}\n", w.instance, w.held, w.capacity));
    }
    let count = |st: &str| s.splits.iter().filter(|x| x.state == st).count();
    out.push_str(&format!(
        "splits: {} done, {} owned, {} unleased, {} quarantined\n",
        count("Done"),
        count("Owned"),
        count("Unleased"),
        count("Quarantined")
    ));
    out.push_str(&format!(
        "{:<24} {:<12} {:<20} {:>5} {:>8}  {:<24} {}\n",
        "SPLIT", "STATE", "OWNER", "EPOCH", "ATTEMPTS", "PROGRESS", "LAST ERROR"
    ));
    for x in &s.splits {
        out.push_str(&format!(
            "{:<24} {:<12} {:<20} {:>5} {:>8}  {:<24} {}\n",
            x.id,
            x.state,
            x.owner.as_deref().unwrap_or("-"),
            x.epoch,
            x.attempts,
            x.progress.as_deref().map(|p| p.chars().take(24).collect::<String>()).unwrap_or("-".into()),
            x.last_error.as_deref().unwrap_or("")
        ));
    }
    out
}

/// Returns a quarantined split to the queue with its attempts reset; refuses anything else.
pub async fn requeue<S: Store>(stores: &JobStores<S>, split: &SplitId) -> anyhow::Result<()> {
    let key = keys::split(split);
    let Some(e) = stores.state.get(&key).await? else { bail!("split {split} does not exist in this job") };
    let mut rec: SplitRecord = records::decode(&e.value)?;
    if rec.state != SplitState::Quarantined {
        bail!("split {split} is {:?}, not Quarantined; only quarantined splits can be requeued", rec.state);
    }
    rec.state = SplitState::Unleased;
    rec.owner = None;
    rec.attempts = 0;
    rec.epoch = rec.epoch.next();
    rec.last_end = Some(EndReason::Requeued);
    stores
        .state
        .compare_and_swap(&key, e.revision, records::encode(&rec), None)
        .await
        .with_context(|| format!("split {split} changed while requeueing; run the command again"))?;
    Ok(())
}
