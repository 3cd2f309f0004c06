//! Operator commands over any store: `status` (plan, leader, workers, every split) and
//! `requeue` (return a quarantined split to the queue).

use anyhow::{Context, bail};
use etl_coordination_core::records::{
    self, EndReason, LeaderRecord, ManifestChunk, PlanHead, PresenceRecord, SplitRecord, SplitState, keys,
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
    /// Split counts by state (all splits, whatever `--state` shows).
    pub summary: Summary,
    /// Records no state could be read from (another program, a newer release, a bad restore).
    pub undecodable: Vec<Undecodable>,
}

/// Split counts by state.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Summary {
    /// Splits in the manifest.
    pub total: usize,
    /// Done.
    pub done: usize,
    /// Owned.
    pub owned: usize,
    /// Unleased.
    pub unleased: usize,
    /// Quarantined.
    pub quarantined: usize,
    /// Whose record cannot be decoded.
    pub undecodable: usize,
    /// Done as a share of all, in percent.
    pub percent_complete: f64,
}

/// A record that cannot be decoded.
#[derive(Clone, Debug, Serialize)]
pub struct Undecodable {
    /// Its key.
    pub key: String,
    /// The bucket: `state` or `lease`.
    pub bucket: String,
    /// Why, and what to do.
    pub error: String,
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
    /// Unleased, Owned, Done, Quarantined, or Undecodable (its record could not be read).
    pub state: String,
    /// Owner (instance id) if owned.
    pub owner: Option<String>,
    /// Whether a live lease exists.
    pub leased: bool,
    /// Epoch.
    pub epoch: u64,
    /// Failing tenancies.
    pub attempts: u32,
    /// Committed progress, in the source's terms (`object=2 line=340`), never raw bytes.
    pub progress: Option<String>,
    /// Last error.
    pub last_error: Option<String>,
}

/// What to do about an undecodable record.
fn undecodable_advice(key: &str, e: &records::RecordError) -> String {
    format!(
        "{e}: written by another program, a newer etl-coordination release or a bad restore; workers \
         skip it and the job cannot complete while it stays. See docs/SCALING.md, runbook: an \
         undecodable record [key {key}]"
    )
}

/// Committed progress as text a person can read: a source's JSON progress as `key=value`
/// pairs, printable text as is, anything else as a short hex prefix and its length.
pub fn render_progress(p: &[u8]) -> String {
    if let Ok(serde_json::Value::Object(m)) = serde_json::from_slice::<serde_json::Value>(p) {
        return m.iter().map(|(k, v)| format!("{k}={v}")).collect::<Vec<_>>().join(" ");
    }
    match std::str::from_utf8(p) {
        Ok(t) if !t.chars().any(char::is_control) => t.to_owned(),
        _ => {
            let hex: String = p.iter().take(12).map(|b| format!("{b:02x}")).collect();
            format!("0x{hex}{} ({} bytes)", if p.len() > 12 { "…" } else { "" }, p.len())
        }
    }
}

/// Reads the whole job state in a fixed number of requests, whatever the number of splits:
/// the plan head and the leader key, then one listing each of manifests, split records,
/// leases and workers. An undecodable record is reported, never fatal.
pub async fn status<S: Store>(stores: &JobStores<S>) -> anyhow::Result<Status> {
    let mut out = Status::default();
    let bad = |bucket: &str, key: &str, e: &records::RecordError| Undecodable {
        key: key.to_owned(),
        bucket: bucket.to_owned(),
        error: undecodable_advice(key, e),
    };
    let mut undecodable = Vec::new();
    let head = match stores.state.get(&keys::plan_head()).await? {
        Some(e) => match records::decode::<PlanHead>(&e.value) {
            Ok(h) => Some(h),
            Err(err) => {
                undecodable.push(bad("state", e.key.as_str(), &err));
                None
            }
        },
        None => None,
    };
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
        match records::decode::<LeaderRecord>(&e.value) {
            Ok(l) => out.leader = Some(l.owner.instance.to_string()),
            Err(err) => undecodable.push(bad("lease", e.key.as_str(), &err)),
        }
    }
    for e in stores.lease.list(&Prefix::new("worker.").expect("valid")).await? {
        let Some(id) = keys::parse_worker(&e.key) else { continue };
        match records::decode::<PresenceRecord>(&e.value) {
            Ok(p) => {
                out.workers.push(WorkerView { instance: id.to_string(), held: p.held, capacity: p.capacity })
            }
            Err(err) => undecodable.push(bad("lease", e.key.as_str(), &err)),
        }
    }
    let leases: std::collections::BTreeSet<SplitId> = stores
        .lease
        .list(&keys::split_prefix())
        .await?
        .iter()
        .filter_map(|e| keys::parse_split(&e.key))
        .collect();
    let Some(m) = head.and_then(|h| h.manifest) else {
        out.undecodable = undecodable;
        return Ok(out);
    };
    let mut chunks: Vec<(u32, Vec<SplitId>)> = Vec::new();
    for e in stores.state.list(&keys::manifest_prefix()).await? {
        match keys::parse_manifest(&e.key) {
            Some((t, v, c)) if t == m.term && v == m.version => {
                match records::decode::<ManifestChunk>(&e.value) {
                    Ok(chunk) => chunks.push((c, chunk.splits.into_iter().map(|(id, _)| id).collect())),
                    // Found, but its splits are unknown: flagged, and counted as found.
                    Err(err) => {
                        undecodable.push(bad("state", e.key.as_str(), &err));
                        chunks.push((c, Vec::new()));
                    }
                }
            }
            _ => {}
        }
    }
    if chunks.len() != m.chunks as usize {
        bail!(
            "the published manifest has {} chunks but {} were found; run status again",
            m.chunks,
            chunks.len()
        );
    }
    chunks.sort_by_key(|(c, _)| *c);
    let mut split_records: std::collections::HashMap<
        SplitId,
        (String, Result<SplitRecord, records::RecordError>),
    > = stores
        .state
        .list(&keys::split_prefix())
        .await?
        .into_iter()
        .filter_map(|e| Some((keys::parse_split(&e.key)?, (e.key.to_string(), records::decode(&e.value)))))
        .collect();
    for id in chunks.into_iter().flat_map(|(_, ids)| ids) {
        let Some((key, rec)) = split_records.remove(&id) else { continue };
        let view = match rec {
            Ok(r) => SplitView {
                id: id.to_string(),
                state: format!("{:?}", r.state),
                owner: r.owner.map(|o| o.instance.to_string()),
                leased: leases.contains(&id),
                epoch: r.epoch.0,
                attempts: r.attempts,
                progress: r.progress.map(|p| render_progress(&p)),
                last_error: r.last_error,
            },
            Err(err) => {
                let advice = undecodable_advice(&key, &err);
                undecodable.push(Undecodable { key, bucket: "state".into(), error: advice.clone() });
                SplitView {
                    id: id.to_string(),
                    state: "Undecodable".into(),
                    owner: None,
                    leased: leases.contains(&id),
                    epoch: 0,
                    attempts: 0,
                    progress: None,
                    last_error: Some(advice),
                }
            }
        };
        out.splits.push(view);
    }
    let count = |st: &str| out.splits.iter().filter(|x| x.state == st).count();
    let total = out.splits.len();
    out.summary = Summary {
        total,
        done: count("Done"),
        owned: count("Owned"),
        unleased: count("Unleased"),
        quarantined: count("Quarantined"),
        undecodable: count("Undecodable"),
        percent_complete: if total == 0 { 0.0 } else { 100.0 * count("Done") as f64 / total as f64 },
    };
    out.undecodable = undecodable;
    Ok(out)
}

/// How `status` prints.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Output {
    /// A table; long progress and errors cut short.
    Table,
    /// A table with every column in full, and whether each split has a live lease.
    Wide,
}

/// Keeps only the splits whose state is one of `states` (case-insensitive); all if empty.
pub fn filter(s: &mut Status, states: &[String]) {
    if !states.is_empty() {
        s.splits.retain(|x| states.iter().any(|st| st.eq_ignore_ascii_case(&x.state)));
    }
}

/// Renders a status: the job's summary, then one table row per split.
pub fn render(s: &Status, output: Output) -> String {
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
    let workers: Vec<String> =
        s.workers.iter().map(|w| format!("{} ({}/{})", w.instance, w.held, w.capacity)).collect();
    out.push_str(&format!(
        "live workers: {}{}{}\n",
        s.workers.len(),
        if workers.is_empty() { "" } else { ": " },
        workers.join(", ")
    ));
    let m = &s.summary;
    out.push_str(&format!(
        "splits: {} done, {} owned, {} unleased, {} quarantined{} ({:.1}% complete)\n",
        m.done,
        m.owned,
        m.unleased,
        m.quarantined,
        if m.undecodable > 0 { format!(", {} undecodable", m.undecodable) } else { String::new() },
        m.percent_complete
    ));
    for u in &s.undecodable {
        out.push_str(&format!("UNDECODABLE {} ({} bucket): {}\n", u.key, u.bucket, u.error));
    }
    let cut = |t: &str, n: usize| match output {
        Output::Wide => t.to_owned(),
        Output::Table if t.chars().count() > n => format!("{}…", t.chars().take(n - 1).collect::<String>()),
        Output::Table => t.to_owned(),
    };
    let mut table = comfy_table::Table::new();
    table.load_preset(comfy_table::presets::NOTHING);
    let mut header = vec!["SPLIT", "STATE", "OWNER", "EPOCH", "ATTEMPTS", "PROGRESS", "LAST ERROR"];
    if output == Output::Wide {
        header.insert(3, "LEASED");
    }
    table.set_header(header);
    for x in &s.splits {
        let mut row = vec![
            x.id.clone(),
            x.state.clone(),
            x.owner.clone().unwrap_or_else(|| "-".into()),
            x.epoch.to_string(),
            x.attempts.to_string(),
            cut(x.progress.as_deref().unwrap_or("-"), 32),
            cut(x.last_error.as_deref().unwrap_or(""), 60),
        ];
        if output == Output::Wide {
            row.insert(3, if x.leased { "yes" } else { "no" }.to_owned());
        }
        table.add_row(row);
    }
    if !s.splits.is_empty() {
        out.push_str(&table.trim_fmt());
        out.push('\n');
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
