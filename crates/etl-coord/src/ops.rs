//! Operator commands over any store: `status` (plan, leader, workers, every split) and
//! `requeue` (return a quarantined split to the queue).

use std::collections::HashMap;
use std::time::Duration;

use anyhow::{Context, bail};
use etl_coordination_core::records::{
    self, Descriptor, LeaderRecord, LeaseRecord, ManifestChunk, ManifestRef, PlanHead, PresenceRecord,
    SplitRecord, SplitState, WorkReport, keys,
};
use etl_coordination_core::{Entry, Incarnation, Key, Prefix, Revision, SplitId, StoreError};
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
    /// In the manifest but without a record (never written, or deleted by hand).
    pub missing: usize,
    /// Done as a share of all, in percent.
    pub percent_complete: f64,
    /// Progress by work: the planned weight done, the rates, the time left.
    pub work: WorkSummary,
}

/// Progress by work, in the unit of the planner's weights (bytes for files, rows for tables),
/// from the Done splits, the positions the owners report within the splits they read, and the
/// rates the live workers report (each over its last minute).
#[derive(Clone, Debug, Default, Serialize)]
pub struct WorkSummary {
    /// The manifest's total weight.
    pub planned: u64,
    /// Done: the Done splits' weight and the owned splits' reported positions.
    pub done: u64,
    /// `done` as a share of `planned`, in percent.
    pub percent_done: f64,
    /// Records per second, summed over the live workers' reports.
    pub records_per_sec: f64,
    /// Weight per second, summed likewise.
    pub weight_per_sec: f64,
    /// The weight left (`planned - done`).
    pub remaining: u64,
    /// Seconds left at the current pace: `remaining / weight_per_sec` (`None` while nothing
    /// moves, `0` once nothing remains).
    pub eta_secs: Option<u64>,
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
    /// Unleased, Owned, Done, Quarantined, Undecodable (its record could not be read) or
    /// Missing (the manifest lists it, the store has no record of it).
    pub state: String,
    /// Owner (instance id) if owned.
    pub owner: Option<String>,
    /// Whether a live lease exists.
    pub leased: bool,
    /// Who holds the live lease (instance id), if it can be read.
    pub lease_holder: Option<String>,
    /// Epoch.
    pub epoch: u64,
    /// Failing tenancies.
    pub attempts: u32,
    /// Committed progress, in the source's terms (`object=2 line=340`), never raw bytes.
    pub progress: Option<String>,
    /// The split's planned weight.
    pub weight: u64,
    /// Where an owned split's reading stands, in its weight's unit, as its owner last reported
    /// (its last commit); `None` where the owner's source cannot say, or for other states.
    pub position: Option<u64>,
    /// Last error.
    pub last_error: Option<String>,
    /// An unleased split that failed: how long workers wait, from when they see its failure,
    /// before claiming it again (P12; set by [`with_claim_backoff`]).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub claim_backoff_secs: Option<u64>,
}

impl SplitView {
    /// A split whose record cannot be read (`Missing`, `Undecodable`), with why as its error.
    fn unreadable(
        id: &SplitId,
        weight: u64,
        state: &str,
        leased: bool,
        lease_holder: Option<String>,
        why: String,
    ) -> Self {
        SplitView {
            id: id.to_string(),
            state: state.into(),
            owner: None,
            leased,
            lease_holder,
            epoch: 0,
            attempts: 0,
            progress: None,
            weight,
            position: None,
            last_error: Some(why),
            claim_backoff_secs: None,
        }
    }
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
/// the plan head, then at once the leader key and one listing each of manifests, split
/// records, leases, workers and their reports (concurrent: at a million splits the records'
/// listing is most of the time, and the others add nothing to it). An undecodable record is
/// reported, never fatal.
pub async fn status<S: Store>(stores: &JobStores<S>) -> anyhow::Result<Status> {
    let mut r = Reading::default();
    let mut out = Status::default();
    let head = r.head(stores.state.get(&keys::plan_head()).await?);
    let manifest = head.as_ref().and_then(|h| h.manifest);
    out.plan = head.as_ref().map(|h| PlanView {
        term: h.term,
        status: format!("{:?}", h.status),
        version: h.manifest.map(|m| m.version),
        kind: h.manifest.map(|m| format!("{:?}", m.kind)),
        split_count: h.manifest.map_or(0, |m| m.split_count),
    });
    let if_planned = |prefix: Prefix| async move {
        match manifest {
            Some(_) => stores.state.list(&prefix).await,
            None => Ok(Vec::new()),
        }
    };
    let (leader_key, worker_prefix) = (keys::leader(), Prefix::new("worker.").expect("valid"));
    let (split_prefix, report_prefix) = (keys::split_prefix(), keys::report_prefix());
    let (leader, workers, leases, reports, chunks, records) = tokio::try_join!(
        stores.lease.get(&leader_key),
        stores.lease.list(&worker_prefix),
        stores.lease.list(&split_prefix),
        stores.lease.list(&report_prefix),
        if_planned(keys::manifest_prefix()),
        if_planned(keys::split_prefix()),
    )?;
    out.leader = r.leader(leader);
    let (workers, incarnations) = r.workers(workers);
    out.workers = workers;
    let leases = r.leases(leases);
    // Reports of live workers only, each of the process its presence names (an earlier
    // process's report lingers until its TTL).
    let reports: Vec<(String, WorkReport)> = Reading::reports(reports)
        .into_iter()
        .filter(|(id, rep)| incarnations.get(id) == Some(&rep.incarnation))
        .collect();
    if let Some(m) = manifest {
        let ids = r.manifest_ids(chunks, &m)?;
        out.splits = r.splits(records, ids, &leases);
    }
    place(&mut out.splits, &reports);
    out.summary = Summary::of(&out.splits, &reports);
    out.undecodable = r.undecodable;
    Ok(out)
}

/// Sets each owned split's position from its owner's report, for the tenancy it names.
fn place(splits: &mut [SplitView], reports: &[(String, WorkReport)]) {
    let positions: HashMap<(&str, &str, u64), u64> = reports
        .iter()
        .flat_map(|(id, rep)| {
            rep.positions.iter().map(move |(split, epoch, at)| ((id.as_str(), split.as_str(), epoch.0), *at))
        })
        .collect();
    for x in splits.iter_mut().filter(|x| x.state == "Owned") {
        let Some(owner) = x.owner.as_deref() else { continue };
        x.position = positions.get(&(owner, x.id.as_str(), x.epoch)).map(|at| (*at).min(x.weight));
    }
}

/// What one `status` read found undecodable so far.
#[derive(Default)]
struct Reading {
    undecodable: Vec<Undecodable>,
}

impl Reading {
    fn bad(&mut self, bucket: &str, key: &str, e: &records::RecordError) {
        let error = undecodable_advice(key, e);
        self.undecodable.push(Undecodable { key: key.to_owned(), bucket: bucket.to_owned(), error });
    }

    fn head(&mut self, entry: Option<Entry>) -> Option<PlanHead> {
        let e = entry?;
        match records::decode::<PlanHead>(&e.value) {
            Ok(h) => Some(h),
            Err(err) => {
                self.bad("state", e.key.as_str(), &err);
                None
            }
        }
    }

    fn leader(&mut self, entry: Option<Entry>) -> Option<String> {
        let e = entry?;
        match records::decode::<LeaderRecord>(&e.value) {
            Ok(l) => Some(l.owner.instance.to_string()),
            Err(err) => {
                self.bad("lease", e.key.as_str(), &err);
                None
            }
        }
    }

    /// The live workers, and the incarnation of each.
    fn workers(&mut self, entries: Vec<Entry>) -> (Vec<WorkerView>, HashMap<String, Incarnation>) {
        let mut out = Vec::new();
        let mut incarnations = HashMap::new();
        for e in entries {
            let Some(id) = keys::parse_worker(&e.key) else { continue };
            match records::decode::<PresenceRecord>(&e.value) {
                Ok(p) => {
                    incarnations.insert(id.to_string(), p.incarnation);
                    out.push(WorkerView { instance: id.to_string(), held: p.held, capacity: p.capacity })
                }
                Err(err) => self.bad("lease", e.key.as_str(), &err),
            }
        }
        (out, incarnations)
    }

    /// The workers' reports of their work. One that cannot be decoded (another release's)
    /// is left out, not reported: nothing depends on it.
    fn reports(entries: Vec<Entry>) -> Vec<(String, WorkReport)> {
        entries
            .into_iter()
            .filter_map(|e| Some((keys::parse_report(&e.key)?.to_string(), records::decode(&e.value).ok()?)))
            .collect()
    }

    /// Every live lease, with its holder when the value can be read.
    fn leases(&mut self, entries: Vec<Entry>) -> HashMap<SplitId, Option<String>> {
        let mut leases = HashMap::new();
        for e in entries {
            let Some(id) = keys::parse_split(&e.key) else { continue };
            let holder = match records::decode::<LeaseRecord>(&e.value) {
                Ok(l) => Some(l.owner.instance.to_string()),
                Err(err) => {
                    self.bad("lease", e.key.as_str(), &err);
                    None
                }
            };
            leases.insert(id, holder);
        }
        leases
    }

    /// The splits of the published manifest with their weights, in chunk order.
    fn manifest_ids(&mut self, entries: Vec<Entry>, m: &ManifestRef) -> anyhow::Result<Vec<(SplitId, u64)>> {
        let mut chunks: Vec<(u32, Vec<(SplitId, u64)>)> = Vec::new();
        for e in entries {
            match keys::parse_manifest(&e.key) {
                Some((t, v, c)) if t == m.term && v == m.version => {
                    match records::decode::<ManifestChunk>(&e.value) {
                        Ok(chunk) => chunks.push((c, chunk.splits)),
                        // Found, but its splits are unknown: flagged, and counted as found.
                        Err(err) => {
                            self.bad("state", e.key.as_str(), &err);
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
        Ok(chunks.into_iter().flat_map(|(_, ids)| ids).collect())
    }

    /// One view per split of the manifest, from one listing of the split records.
    fn splits(
        &mut self,
        entries: Vec<Entry>,
        ids: Vec<(SplitId, u64)>,
        leases: &HashMap<SplitId, Option<String>>,
    ) -> Vec<SplitView> {
        let mut records: HashMap<SplitId, (Key, Result<SplitRecord, records::RecordError>)> = entries
            .into_iter()
            .filter_map(|e| Some((keys::parse_split(&e.key)?, (e.key, records::decode(&e.value)))))
            .collect();
        let mut out = Vec::with_capacity(ids.len());
        for (id, weight) in ids {
            let (leased, lease_holder) = (leases.contains_key(&id), leases.get(&id).cloned().flatten());
            let Some((key, rec)) = records.remove(&id) else {
                // Listed, but no record: a plan whose records were deleted by hand, or a listing
                // from a replica that lags behind the plan (status again will tell).
                let why = "the plan lists it but the store has no record of it; `etl-coord requeue --reset` \
                           recreates it";
                out.push(SplitView::unreadable(&id, weight, "Missing", leased, lease_holder, why.into()));
                continue;
            };
            out.push(match rec {
                Ok(r) => SplitView {
                    id: id.to_string(),
                    state: format!("{:?}", r.state),
                    owner: r.owner.map(|o| o.instance.to_string()),
                    leased,
                    lease_holder,
                    epoch: r.epoch.0,
                    attempts: r.attempts,
                    progress: r.progress.map(|p| render_progress(&p)),
                    weight,
                    position: None,
                    last_error: r.last_error,
                    claim_backoff_secs: None,
                },
                Err(err) => {
                    let advice = undecodable_advice(key.as_str(), &err);
                    self.undecodable.push(Undecodable {
                        key: key.to_string(),
                        bucket: "state".into(),
                        error: advice.clone(),
                    });
                    SplitView::unreadable(&id, weight, "Undecodable", leased, lease_holder, advice)
                }
            });
        }
        out
    }
}

impl Summary {
    /// The counts of `splits` by state, and the work done and its pace by `reports`.
    fn of(splits: &[SplitView], reports: &[(String, WorkReport)]) -> Summary {
        let count = |st: &str| splits.iter().filter(|x| x.state == st).count();
        let total = splits.len();
        Summary {
            work: WorkSummary::of(splits, reports),
            total,
            done: count("Done"),
            owned: count("Owned"),
            unleased: count("Unleased"),
            quarantined: count("Quarantined"),
            undecodable: count("Undecodable"),
            missing: count("Missing"),
            percent_complete: if total == 0 { 0.0 } else { 100.0 * count("Done") as f64 / total as f64 },
        }
    }
}

impl WorkSummary {
    fn of(splits: &[SplitView], reports: &[(String, WorkReport)]) -> WorkSummary {
        let planned: u64 = splits.iter().map(|x| x.weight).sum();
        let done: u64 = splits
            .iter()
            .map(|x| if x.state == "Done" { x.weight } else { x.position.unwrap_or(0) })
            .sum::<u64>()
            .min(planned);
        // From +0.0 (a float `sum` starts from -0.0, which JSON would show as such).
        let records_per_sec = reports.iter().fold(0.0, |sum, (_, r)| sum + r.records_per_sec);
        let weight_per_sec: f64 = reports.iter().fold(0.0, |sum, (_, r)| sum + r.weight_per_sec);
        let remaining = planned - done;
        let eta_secs = match remaining {
            0 => Some(0),
            _ if weight_per_sec > 0.0 => Some((remaining as f64 / weight_per_sec).ceil() as u64),
            _ => None,
        };
        WorkSummary {
            planned,
            done,
            percent_done: if planned == 0 { 0.0 } else { 100.0 * done as f64 / planned as f64 },
            records_per_sec,
            weight_per_sec,
            remaining,
            eta_secs,
        }
    }
}

/// How `status` prints.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Output {
    /// A table; long progress and errors cut short.
    Table,
    /// A table with every column in full, and whether each split has a live lease.
    Wide,
}

/// Says, for every unleased split that failed, how long the workers wait before claiming it
/// again, given their `--claim-backoff` (the store keeps no clock time, so the wait runs from
/// when each worker sees the failure: the worker's log line `split failed` says when).
pub fn with_claim_backoff(s: &mut Status, claim_backoff: Duration) {
    let mut tuning = etl_coordination_core::Tuning::default();
    tuning.claim_backoff = claim_backoff;
    for x in &mut s.splits {
        if x.state == "Unleased" && x.attempts > 0 {
            x.claim_backoff_secs = Some(tuning.claim_backoff_after(x.attempts).as_secs());
        }
    }
}

/// Keeps only the splits whose state is one of `states` (case-insensitive); all if empty.
pub fn filter(s: &mut Status, states: &[String]) {
    if !states.is_empty() {
        s.splits.retain(|x| states.iter().any(|st| st.eq_ignore_ascii_case(&x.state)));
    }
}

/// Renders a status: the job's summary, then one table row per split.
pub fn render(s: &Status, output: Output) -> String {
    let mut out = render_summary(s);
    if !s.splits.is_empty() {
        out.push_str(&render_splits(&s.splits, output));
        out.push('\n');
    }
    out
}

/// The lines above the table: plan, leader, workers, counts, undecodable values.
fn render_summary(s: &Status) -> String {
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
        "splits: {} done, {} owned, {} unleased, {} quarantined{}{} ({:.1}% complete)\n",
        m.done,
        m.owned,
        m.unleased,
        m.quarantined,
        if m.undecodable > 0 { format!(", {} undecodable", m.undecodable) } else { String::new() },
        if m.missing > 0 { format!(", {} missing", m.missing) } else { String::new() },
        m.percent_complete
    ));
    let w = &m.work;
    if w.planned > 0 {
        out.push_str(&format!(
            "work: {} of {} done ({:.1}%), {} left; {:.0} records/s, {:.0} weight/s; {}\n",
            w.done,
            w.planned,
            w.percent_done,
            w.remaining,
            w.records_per_sec,
            w.weight_per_sec,
            match w.eta_secs {
                Some(0) => "nothing left".to_owned(),
                Some(secs) => format!("about {} left", human_secs(secs)),
                None => "no estimate (nothing moved in the last minute)".to_owned(),
            }
        ));
    }
    for u in &s.undecodable {
        out.push_str(&format!("UNDECODABLE {} ({} bucket): {}\n", u.key, u.bucket, u.error));
    }
    out
}

/// `secs` as `1h02m`, `4m05s` or `17s`.
fn human_secs(secs: u64) -> String {
    match secs {
        0..60 => format!("{secs}s"),
        60..3600 => format!("{}m{:02}s", secs / 60, secs % 60),
        _ => format!("{}h{:02}m", secs / 3600, secs % 3600 / 60),
    }
}

/// The table of splits (every column in full with `Output::Wide`).
fn render_splits(splits: &[SplitView], output: Output) -> String {
    let cut = |t: &str, n: usize| match output {
        Output::Wide => t.to_owned(),
        Output::Table if t.chars().count() > n => format!("{}…", t.chars().take(n - 1).collect::<String>()),
        Output::Table => t.to_owned(),
    };
    let mut table = comfy_table::Table::new();
    table.load_preset(comfy_table::presets::NOTHING);
    let mut header = vec!["SPLIT", "STATE", "OWNER", "EPOCH", "ATTEMPTS", "DONE", "PROGRESS", "LAST ERROR"];
    if output == Output::Wide {
        header.insert(3, "LEASED");
    }
    let backoffs = splits.iter().any(|x| x.claim_backoff_secs.is_some());
    if backoffs {
        header.push("RETRY");
    }
    table.set_header(header);
    for x in splits {
        let mut row = vec![
            x.id.clone(),
            x.state.clone(),
            x.owner.clone().unwrap_or_else(|| "-".into()),
            x.epoch.to_string(),
            x.attempts.to_string(),
            match (x.state.as_str(), x.position) {
                ("Done", _) => "100%".to_owned(),
                (_, Some(at)) if x.weight > 0 => format!("{}%", at * 100 / x.weight),
                _ => "-".to_owned(),
            },
            cut(x.progress.as_deref().unwrap_or("-"), 32),
            cut(x.last_error.as_deref().unwrap_or(""), 60),
        ];
        if output == Output::Wide {
            let leased = match (&x.lease_holder, x.leased) {
                (Some(holder), _) => holder.clone(),
                (None, true) => "yes (unreadable)".to_owned(),
                (None, false) => "-".to_owned(),
            };
            row.insert(3, leased);
        }
        if backoffs {
            row.push(x.claim_backoff_secs.map_or_else(|| "-".into(), |b| format!("{b}s after failure")));
        }
        table.add_row(row);
    }
    table.trim_fmt()
}

/// Returns a quarantined split to the queue with its attempts reset; refuses anything else.
pub async fn requeue<S: Store>(stores: &JobStores<S>, split: &SplitId) -> anyhow::Result<()> {
    let key = keys::split(split);
    let Some(e) = stores.state.get(&key).await? else { bail!("split {split} does not exist in this job") };
    let rec: SplitRecord = records::decode(&e.value).with_context(|| {
        format!(
            "the record of split {split} cannot be decoded; `requeue --reset --split {split}` rewrites it"
        )
    })?;
    if rec.state != SplitState::Quarantined {
        bail!(
            "split {split} is {:?}, not Quarantined; only quarantined splits can be requeued \
             (`requeue --reset` starts any split over from the beginning)",
            rec.state
        );
    }
    stores
        .state
        .compare_and_swap(&key, e.revision, records::encode(&rec.requeued()), None)
        .await
        .with_context(|| format!("split {split} changed while requeueing; run the command again"))?;
    Ok(())
}

/// The quarantined splits a bulk requeue (`requeue --state quarantined`) would return to the
/// queue, read and ready to write: list them to the operator, then [`apply_requeue`].
#[derive(Clone, Debug, Default)]
pub struct RequeuePlan {
    /// Each split with the revision its requeue expects and its record as read.
    pub splits: Vec<(SplitId, Revision, SplitRecord)>,
    /// Quarantined splits left out because their last error does not contain the filter.
    pub not_matching: usize,
}

/// What [`apply_requeue`] did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RequeueReport {
    /// Requeued.
    pub requeued: Vec<SplitId>,
    /// Changed since the plan was read (requeued by someone else, reset): left as they are.
    pub changed: Vec<SplitId>,
}

/// Reads every quarantined split of the job (one listing of the split records), keeping only
/// those whose last error contains `error_contains` (case-sensitive) when it is given.
pub async fn plan_requeue<S: Store>(
    stores: &JobStores<S>,
    error_contains: Option<&str>,
) -> anyhow::Result<RequeuePlan> {
    let mut plan = RequeuePlan::default();
    for e in stores.state.list(&keys::split_prefix()).await? {
        let Some(id) = keys::parse_split(&e.key) else { continue };
        // An undecodable record is not known to be quarantined: `status` flags it.
        let Ok(rec) = records::decode::<SplitRecord>(&e.value) else { continue };
        if rec.state != SplitState::Quarantined {
            continue;
        }
        let matches =
            error_contains.is_none_or(|text| rec.last_error.as_deref().is_some_and(|err| err.contains(text)));
        if matches {
            plan.splits.push((id, e.revision, rec));
        } else {
            plan.not_matching += 1;
        }
    }
    plan.splits.sort_by(|a, b| a.0.cmp(&b.0));
    Ok(plan)
}

/// Requeues every split of `plan` (each by a CAS at the revision read: a split that changed
/// meanwhile is left as it is and reported), attempts reset, progress kept.
pub async fn apply_requeue<S: Store>(
    stores: &JobStores<S>,
    plan: &RequeuePlan,
) -> anyhow::Result<RequeueReport> {
    let mut report = RequeueReport::default();
    for (id, rev, rec) in &plan.splits {
        match stores
            .state
            .compare_and_swap(&keys::split(id), *rev, records::encode(&rec.requeued()), None)
            .await
        {
            Ok(_) => report.requeued.push(id.clone()),
            Err(StoreError::RevisionMismatch(_)) => report.changed.push(id.clone()),
            Err(e) => {
                return Err(anyhow::Error::new(e).context(format!(
                    "requeueing split {id} failed after {} of {} were requeued; run the command again \
                     (those already requeued are no longer quarantined)",
                    report.requeued.len(),
                    plan.splits.len()
                )));
            }
        }
    }
    Ok(report)
}

/// A reset of one split (`requeue --reset`), read and ready to write.
#[derive(Clone, Debug)]
pub struct ResetPlan {
    /// The split.
    pub split: SplitId,
    /// What its record (and lease) hold now, in words (for the confirmation).
    pub current: String,
    /// The revision the write expects (`None`: the record is missing and is created).
    expected: Option<Revision>,
    record: SplitRecord,
    /// A value nobody can decode at the split's lease key, deleted with the reset (it would
    /// keep every claim out; a worker writes every lease with a TTL, but another program may
    /// not have).
    garbage_lease: Option<Revision>,
}

/// Reads what a reset of `split` would replace: the split must have a descriptor a worker can
/// read (the split is real and can be processed); its record may be anything, even missing or
/// undecodable.
pub async fn plan_reset<S: Store>(stores: &JobStores<S>, split: &SplitId) -> anyhow::Result<ResetPlan> {
    match stores.state.get(&keys::desc(split)).await? {
        None => bail!(
            "split {split} has no descriptor in this job: no planner planned it (check the id: \
             `etl-coord status` lists the splits)"
        ),
        Some(d) => {
            records::decode::<Descriptor>(&d.value).map_err(|e| {
                anyhow::anyhow!(
                    "the descriptor of split {split} cannot be decoded ({e}); a reset needs it to \
                     rebuild the split: restore the state bucket from a backup, or run the job again \
                     under a new job name"
                )
            })?;
        }
    }
    let (lease_epoch, lease_text, garbage_lease) = match stores.lease.get(&keys::split(split)).await? {
        None => (None, String::new(), None),
        Some(e) => match records::decode::<LeaseRecord>(&e.value) {
            Ok(l) => (Some(l.epoch), format!(", its lease held by {}", l.owner.instance), None),
            Err(err) => {
                (None, format!(", its lease undecodable ({err}), deleted with the reset"), Some(e.revision))
            }
        },
    };
    let (current, expected, record) = match stores.state.get(&keys::split(split)).await? {
        None => ("missing".to_owned(), None, SplitRecord::reset(None, lease_epoch)),
        Some(e) => match records::decode::<SplitRecord>(&e.value) {
            Ok(r) => {
                let progress = r.progress.as_deref().map_or("none".to_owned(), render_progress);
                let text = format!(
                    "{:?} at epoch {}{}, progress {progress}, attempts {}",
                    r.state,
                    r.epoch,
                    r.owner.as_ref().map_or(String::new(), |o| format!(", owned by {}", o.instance)),
                    r.attempts
                );
                (text, Some(e.revision), SplitRecord::reset(Some((e.revision, Some(&r))), lease_epoch))
            }
            Err(err) => (
                format!("undecodable ({err})"),
                Some(e.revision),
                SplitRecord::reset(Some((e.revision, None)), lease_epoch),
            ),
        },
    };
    Ok(ResetPlan {
        split: split.clone(),
        current: format!("{current}{lease_text}"),
        expected,
        record,
        garbage_lease,
    })
}

/// Writes a planned reset, fenced on what was read: if the record changed since, nothing is
/// written and the error says to run the command again.
///
/// A missing record's history is unknown, so it is created first (the create's revision is
/// above every revision the key ever had) and then raised to that epoch; a worker that claims
/// it in between starts it over all the same.
pub async fn apply_reset<S: Store>(stores: &JobStores<S>, plan: &ResetPlan) -> anyhow::Result<()> {
    let key = keys::split(&plan.split);
    let changed = || format!("split {} changed while resetting it; run the command again", plan.split);
    match plan.expected {
        Some(rev) => {
            stores
                .state
                .compare_and_swap(&key, rev, records::encode(&plan.record), None)
                .await
                .with_context(changed)?;
        }
        None => {
            let rev =
                stores.state.create(&key, records::encode(&plan.record), None).await.with_context(changed)?;
            let raised = SplitRecord::reset(Some((rev, Some(&plan.record))), None);
            match stores.state.compare_and_swap(&key, rev, records::encode(&raised), None).await {
                Ok(_) | Err(StoreError::RevisionMismatch(_)) => {}
                Err(e) => return Err(e).with_context(changed),
            }
        }
    }
    if let Some(rev) = plan.garbage_lease {
        match stores.lease.delete(&key, rev).await {
            // Gone or replaced meanwhile: nothing of ours to delete.
            Ok(()) | Err(StoreError::RevisionMismatch(_)) => {}
            Err(e) => return Err(e).context("deleting the split's undecodable lease value"),
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn split(id: &str, state: &str, attempts: u32) -> SplitView {
        SplitView {
            id: id.into(),
            state: state.into(),
            owner: None,
            leased: false,
            lease_holder: None,
            epoch: 3,
            attempts,
            progress: None,
            weight: 100,
            position: None,
            last_error: Some("disk full".into()),
            claim_backoff_secs: None,
        }
    }

    fn report(positions: &[(&str, u64, u64)], records_per_sec: f64, weight_per_sec: f64) -> WorkReport {
        WorkReport {
            incarnation: Incarnation(7),
            records: 0,
            weight: 0,
            records_per_sec,
            weight_per_sec,
            positions: positions
                .iter()
                .map(|(s, e, at)| (SplitId::new(*s).unwrap(), etl_coordination_core::Epoch(*e), *at))
                .collect(),
        }
    }

    #[test]
    fn status_counts_work_by_weight_with_the_owners_positions_and_estimates_the_time_left() {
        let owned = |id: &str, owner: &str| SplitView { owner: Some(owner.into()), ..split(id, "Owned", 0) };
        let mut splits = vec![
            SplitView { weight: 400, ..split("done", "Done", 0) },
            SplitView { weight: 300, ..owned("a", "w1") },
            owned("b", "w2"),
            owned("c", "w2"),
            SplitView { weight: 100, ..split("q", "Unleased", 0) },
        ];
        let reports = vec![
            // w1 is half way through a.
            ("w1".to_owned(), report(&[("a", 3, 150)], 30.0, 12.5)),
            // w2 reads b (a position past its weight counts as the weight), and reports c at an
            // earlier tenancy's epoch: not c's position now.
            ("w2".to_owned(), report(&[("b", 3, 500), ("c", 2, 60)], 20.0, 12.5)),
        ];
        place(&mut splits, &reports);
        let positions: Vec<Option<u64>> = splits.iter().map(|x| x.position).collect();
        assert_eq!(positions, [None, Some(150), Some(100), None, None]);
        let w = WorkSummary::of(&splits, &reports);
        assert_eq!((w.planned, w.done, w.remaining), (1000, 650, 350));
        assert_eq!((w.records_per_sec, w.weight_per_sec), (50.0, 25.0));
        assert_eq!(w.eta_secs, Some(14), "350 left at 25 a second");
        assert!((w.percent_done - 65.0).abs() < 1e-9);
        let s = Status {
            summary: Summary { work: w.clone(), ..Summary::default() },
            splits,
            ..Status::default()
        };
        let table = render(&s, Output::Table);
        assert!(
            table.contains(
                "work: 650 of 1000 done (65.0%), 350 left; 50 records/s, 25 weight/s; about 14s left"
            ),
            "{table}"
        );
        assert!(table.contains("DONE") && table.contains("50%") && table.contains("100%"), "{table}");
        // Nothing moving: no estimate; nothing left: none needed.
        let still = WorkSummary::of(&s.splits, &[]);
        assert_eq!(still.eta_secs, None);
        assert!(serde_json::to_string(&still).unwrap().contains("\"records_per_sec\":0.0,"), "not -0.0");
        let all_done = [SplitView { weight: 5, ..split("x", "Done", 0) }];
        assert_eq!(WorkSummary::of(&all_done, &[]).eta_secs, Some(0));
        assert_eq!(human_secs(3725), "1h02m");
        assert_eq!(human_secs(245), "4m05s");
    }

    #[test]
    fn status_says_how_long_a_failed_split_waits_before_it_is_claimed_again() {
        let mut s = Status {
            splits: vec![split("a", "Unleased", 2), split("b", "Unleased", 0), split("c", "Quarantined", 4)],
            ..Status::default()
        };
        with_claim_backoff(&mut s, Duration::from_secs(15));
        let waits: Vec<Option<u64>> = s.splits.iter().map(|x| x.claim_backoff_secs).collect();
        assert_eq!(
            waits,
            vec![Some(30), None, None],
            "only a failed split in the queue waits: 15s doubled once"
        );
        let table = render(&s, Output::Table);
        assert!(table.contains("RETRY") && table.contains("30s after failure"), "{table}");
        assert!(serde_json::to_string(&s).unwrap().contains("\"claim_backoff_secs\":30"));
        // No failed split in the queue: no column.
        s.splits.remove(0);
        assert!(!render(&s, Output::Table).contains("RETRY"));
    }
}
