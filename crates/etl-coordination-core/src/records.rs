//! The storage format: the records the protocol keeps in the store (docs/PROTOCOL.md, records and keys) and their
//! keys.
//!
//! This is the on-store layout, versioned by [`FORMAT_VERSION`] (every stored value starts with
//! that byte, followed by the bincode 2 (serde) encoding of the record) and by
//! [`PROTOCOL_VERSION`] in `meta`. It is public for tools that inspect or repair a job's store
//! (`etl-coord status` and `requeue`, the simulator's checkers); it is not an API for casual
//! use: a record written by hand that breaks an invariant (an epoch that does not grow, an owner
//! without a lease) breaks the protocol's guarantees. Readers refuse a format they do not know
//! instead of misreading it.

use bytes::Bytes;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use crate::ids::{Epoch, Incarnation, InstanceId, Owner, Revision, SplitId};
use crate::plan::PlanKind;
use crate::store::{Key, Prefix};

/// The format-version byte in front of every stored record. Version 2 added
/// [`SplitRecord::progressed`].
pub const FORMAT_VERSION: u8 = 2;

/// The protocol version recorded in `meta`; workers of another protocol version are refused (P2).
/// Version 2: attempts count only failing tenancies that committed no progress (P12), and a
/// starved tenancy resumes under a new epoch (P11).
pub const PROTOCOL_VERSION: u32 = 2;

/// The largest planner descriptor a plan may carry (a split's `desc.{id}` record holds it with
/// a few bytes of framing; every store accepts values of twice this size). A plan with a larger
/// one is refused as a planning error naming the split, before anything is written.
pub const MAX_DESCRIPTOR_LEN: usize = 256 * 1024;

/// How many split ids one manifest chunk holds. Keeps each chunk far below NATS's default
/// 1 MiB message limit even with 128-character ids.
pub const MANIFEST_CHUNK_LEN: usize = 1024;

/// A stored value could not be decoded.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum RecordError {
    /// The value is empty.
    #[error("empty record")]
    Empty,
    /// The value was written by a newer (or unknown) format.
    #[error(
        "record format {0} is not supported by this version (expected {FORMAT_VERSION}); upgrade every worker to the same release"
    )]
    UnknownFormat(u8),
    /// The bytes do not decode as the expected record.
    #[error("malformed record: {0}")]
    Malformed(String),
}

fn config() -> bincode::config::Configuration {
    bincode::config::standard()
}

/// Encodes a record with its format-version byte.
pub fn encode<T: Serialize>(record: &T) -> Bytes {
    let mut out = vec![FORMAT_VERSION];
    // Encoding plain serde data into a Vec cannot fail.
    bincode::serde::encode_into_std_write(record, &mut out, config()).expect("records always encode");
    Bytes::from(out)
}

/// Decodes a record written by [`encode`].
pub fn decode<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, RecordError> {
    let (&format, body) = bytes.split_first().ok_or(RecordError::Empty)?;
    if format != FORMAT_VERSION {
        return Err(RecordError::UnknownFormat(format));
    }
    decode_body(body)
}

/// Decodes the body of a record (after its format byte) as `T`, refusing trailing bytes.
fn decode_body<T: DeserializeOwned>(body: &[u8]) -> Result<T, RecordError> {
    let (value, used) = bincode::serde::decode_from_slice(body, config())
        .map_err(|e| RecordError::Malformed(e.to_string()))?;
    if used != body.len() {
        return Err(RecordError::Malformed(format!("{} trailing bytes", body.len() - used)));
    }
    Ok(value)
}

/// The protocol versions whose jobs this release can move to [`PROTOCOL_VERSION`] (`etl-coord
/// job migrate`, once no worker runs on the job).
pub const MIGRATES_FROM: &[u32] = &[1];

/// A split record as protocol 1 (format 1) wrote it: the same fields as [`SplitRecord`] but
/// `progressed`.
#[derive(Deserialize)]
struct SplitRecordV1 {
    epoch: Epoch,
    owner: Option<Owner>,
    state: SplitState,
    progress: Option<Bytes>,
    attempts: u32,
    last_end: Option<EndReason>,
    last_error: Option<String>,
}

/// Rewrites one value of a job's state bucket (`key` names what it is) from a format a
/// previous protocol wrote to this release's: `Ok(None)` when it is in this format already.
/// Format 1 (protocol 1) differs only in split records, which gain `progressed` (false: a
/// migration runs with no tenancy live). `meta` keeps its fields (the caller stamps the
/// protocol last). Every rewritten value is decoded back as its record before it is returned,
/// so a value that does not decode as what its key says is refused, never half-converted.
pub fn migrate_state_value(key: &Key, value: &[u8]) -> Result<Option<Bytes>, RecordError> {
    let (&format, body) = value.split_first().ok_or(RecordError::Empty)?;
    if format == FORMAT_VERSION {
        return Ok(None);
    }
    if format != 1 {
        return Err(RecordError::UnknownFormat(format));
    }
    let name = key.as_str();
    let converted = if keys::parse_split(key).is_some() {
        let v1: SplitRecordV1 = decode_body(body)?;
        encode(&SplitRecord {
            epoch: v1.epoch,
            owner: v1.owner,
            state: v1.state,
            progress: v1.progress,
            attempts: v1.attempts,
            last_end: v1.last_end,
            last_error: v1.last_error,
            progressed: false,
        })
    } else {
        let mut same = value.to_vec();
        same[0] = FORMAT_VERSION;
        let same = Bytes::from(same);
        if name == keys::meta().as_str() {
            decode::<Meta>(&same)?;
        } else if name == keys::plan_head().as_str() {
            decode::<PlanHead>(&same)?;
        } else if keys::parse_manifest(key).is_some() {
            decode::<ManifestChunk>(&same)?;
        } else if name.starts_with(keys::desc_prefix().as_str()) {
            decode::<Descriptor>(&same)?;
        } else {
            return Err(RecordError::Malformed(format!("{name} is not a key of a job's state bucket")));
        }
        same
    };
    Ok(Some(converted))
}

/// Decodes `meta` whatever format of [`MIGRATES_FROM`] wrote it (its fields are the same in
/// every format so far), so that a worker meeting a job of a previous protocol can say which
/// protocol and what to do, instead of failing on the format.
pub fn decode_meta(bytes: &[u8]) -> Result<Meta, RecordError> {
    match migrate_state_value(&keys::meta(), bytes)? {
        None => decode(bytes),
        Some(current) => decode(&current),
    }
}

/// `meta`: created by the first worker; every later worker compares its protocol and planner
/// and adopts its `max_attempts` (P2). Rewritten only by an operator's command (`etl-coord
/// job set-max-attempts`, `etl-coord job migrate`).
#[derive(Clone, PartialEq, Eq, Debug, Serialize, Deserialize)]
pub struct Meta {
    /// [`PROTOCOL_VERSION`] of the writer.
    pub protocol_version: u32,
    /// The planner's fingerprint.
    pub fingerprint: String,
    /// Protocol-relevant knob: attempts before quarantine.
    pub max_attempts: u32,
}

impl Meta {
    /// A one-line rendering used in the divergence error: what must match (`max_attempts` is
    /// the job's and is not compared).
    pub fn describe(&self) -> String {
        format!("protocol {} / planner fingerprint {:?}", self.protocol_version, self.fingerprint)
    }
}

/// Whether the head's term has published its manifest yet.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Serialize, Deserialize)]
pub enum PlanStatus {
    /// A leader bumped the term and is planning; `manifest` (if any) is the previous term's.
    Planning,
    /// `manifest` is this term's published plan.
    Published,
}

/// Where a published manifest lives.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Serialize, Deserialize)]
pub struct ManifestRef {
    /// Term that wrote it.
    pub term: u64,
    /// Plan version (monotonic across terms).
    pub version: u64,
    /// Number of chunks (`manifest.{term}.{version}.{0..chunks}`).
    pub chunks: u32,
    /// Number of splits in total.
    pub split_count: u64,
    /// Final or Open.
    pub kind: PlanKind,
}

/// `plan.head`: the fence for plan writes (P4, I9).
#[derive(Clone, PartialEq, Eq, Debug, Serialize, Deserialize)]
pub struct PlanHead {
    /// Leadership term; bumped by each new leader before planning.
    pub term: u64,
    /// The leader of `term`.
    pub leader: Owner,
    /// Planning or Published.
    pub status: PlanStatus,
    /// The latest published manifest, if any.
    pub manifest: Option<ManifestRef>,
}

/// `manifest.{term}.{version}.{n}`: one chunk of a published split list, with weights so that
/// workers can claim largest-first without reading every descriptor.
#[derive(Clone, PartialEq, Eq, Debug, Serialize, Deserialize)]
pub struct ManifestChunk {
    /// `(id, weight)` pairs.
    pub splits: Vec<(SplitId, u64)>,
}

/// `desc.{id}`: immutable, written once by the planner.
#[derive(Clone, PartialEq, Eq, Debug, Serialize, Deserialize)]
pub struct Descriptor {
    /// Opaque bytes the source needs to process the split.
    pub descriptor: Bytes,
    /// The planner's cost estimate.
    pub weight: u64,
}

/// The lifecycle state of a split record.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Serialize, Deserialize, PartialOrd, Ord)]
pub enum SplitState {
    /// In the queue.
    Unleased,
    /// Held by `owner`.
    Owned,
    /// Terminal progress committed.
    Done,
    /// Parked after `max_attempts` failed tenancies (P12); never re-offered.
    Quarantined,
}

/// How the last tenancy of a split ended.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Serialize, Deserialize, PartialOrd, Ord)]
pub enum EndReason {
    /// Graceful release (drain, plan shrink).
    Released,
    /// Taken by a peer below its fair share (P9).
    Stolen,
    /// The owner's lease expired (consumes an attempt).
    Expired,
    /// The owner's id restarted with a new incarnation (consumes an attempt).
    Reclaimed,
    /// The source reported the split failed (consumes an attempt).
    Failed,
    /// The source reported the split unprocessable (consumes an attempt).
    Unprocessable,
    /// Terminal progress committed.
    Finished,
    /// An operator returned the split from quarantine.
    Requeued,
}

impl EndReason {
    /// Whether this end consumes a delivery attempt (P12).
    pub fn consumes_attempt(self) -> bool {
        matches!(self, Self::Expired | Self::Reclaimed | Self::Failed | Self::Unprocessable)
    }
}

/// `split.{id}` in the state bucket: the small mutable record every commit rewrites.
#[derive(Clone, PartialEq, Eq, Debug, Serialize, Deserialize, PartialOrd, Ord)]
pub struct SplitRecord {
    /// Bumped on every ownership change.
    pub epoch: Epoch,
    /// The current owner (Owned) or none.
    pub owner: Option<Owner>,
    /// Lifecycle state.
    pub state: SplitState,
    /// Committed progress (opaque to the core), `None` before the first commit.
    pub progress: Option<Bytes>,
    /// Consecutive failing tenancies that committed no progress (P12).
    pub attempts: u32,
    /// How the previous tenancy ended.
    pub last_end: Option<EndReason>,
    /// The last error recorded for a failed tenancy.
    pub last_error: Option<String>,
    /// Whether the current tenancy committed progress beyond what it started from (P12: such a
    /// tenancy is not evidence against the data, whatever its end).
    pub progressed: bool,
}

impl SplitRecord {
    /// A fresh record, as the planner creates it.
    pub fn new() -> Self {
        SplitRecord {
            epoch: Epoch(0),
            owner: None,
            state: SplitState::Unleased,
            progress: None,
            attempts: 0,
            last_end: None,
            last_error: None,
            progressed: false,
        }
    }

    /// Whether the record is terminal (Done or Quarantined).
    pub fn is_terminal(&self) -> bool {
        matches!(self.state, SplitState::Done | SplitState::Quarantined)
    }

    /// The record an operator's requeue writes over a quarantined one (after fixing the
    /// cause): back in the queue with its attempts reset and its progress kept, under the next
    /// epoch (a new ownership, as every claim makes).
    pub fn requeued(&self) -> SplitRecord {
        SplitRecord {
            epoch: self.epoch.next(),
            owner: None,
            state: SplitState::Unleased,
            attempts: 0,
            last_end: Some(EndReason::Requeued),
            progressed: false,
            ..self.clone()
        }
    }

    /// The record an operator's reset writes (`etl-coord requeue --reset`): the split starts
    /// over (no progress, no attempts, in the queue), whatever the record held, even a value
    /// nobody can decode. Its records are emitted again: at-least-once allows that, and it is
    /// the only repair for a record that is lost.
    ///
    /// The epoch is above every epoch the split has had, so every tenancy is fenced: a record's
    /// epoch grows by at most one per write of the key and starts at 0, while revisions grow by
    /// at least one per write and start at 1, so every epoch written so far is below the
    /// revision `replaced` of the value being replaced; a lease's epoch is at most one above
    /// the record's, and `lease` raises the floor when it is known.
    pub fn reset(replaced: Option<(Revision, Option<&SplitRecord>)>, lease: Option<Epoch>) -> SplitRecord {
        let mut epoch = Epoch(0);
        if let Some((rev, current)) = replaced {
            epoch = epoch.max(Epoch(rev.0));
            if let Some(r) = current {
                epoch = epoch.max(r.epoch.next());
            }
        }
        if let Some(e) = lease {
            epoch = epoch.max(e.next());
        }
        SplitRecord {
            epoch,
            last_end: Some(EndReason::Requeued),
            last_error: Some("reset by an operator: processed again from the start".into()),
            ..SplitRecord::new()
        }
    }
}

impl Default for SplitRecord {
    fn default() -> Self {
        Self::new()
    }
}

/// `split.{id}` in the lease bucket.
#[derive(Clone, PartialEq, Eq, Debug, Serialize, Deserialize)]
pub struct LeaseRecord {
    /// The holder.
    pub owner: Owner,
    /// The epoch of the holder's tenancy.
    pub epoch: Epoch,
    /// Which of the holder's requests wrote this value (its op id): a read back tells exactly
    /// which write landed, so trust is never credited from the wrong send time (P11).
    pub write: u64,
}

/// `steal.{victim}` in the lease bucket: a cooperative steal request (P9). At most one per
/// victim at a time (it is created, never overwritten), so steals from one worker are
/// serialised. It lives one lease (TTL) unless its thief deletes it first; a worker that does
/// not know the key ignores it, and the thief then takes the split over at its deadline.
#[derive(Clone, PartialEq, Eq, Debug, Serialize, Deserialize)]
pub struct StealRequest {
    /// The worker asking.
    pub thief: Owner,
    /// The split it asks for.
    pub split: SplitId,
    /// The victim's tenancy it asks to end (the lease's epoch the thief saw).
    pub epoch: Epoch,
    /// The split's planned weight.
    pub weight: u64,
    /// The thief's load when it asked: the victim honours the request only if its own load
    /// exceeds this by more than the split's effective weight (the move lowers the imbalance).
    pub thief_load: u128,
    /// How long the victim's lane gets to commit, in milliseconds: the thief's wait, so the
    /// thief's deadline (a heartbeat later) never cuts a last commit short.
    pub wait_ms: u64,
    /// Which of the thief's requests wrote this value (its op id).
    pub write: u64,
}

/// `worker.{instance_id}`: presence, the fleet view and duplicate-id detection (P3).
#[derive(Clone, PartialEq, Eq, Debug, Serialize, Deserialize)]
pub struct PresenceRecord {
    /// The process lifetime holding this id.
    pub incarnation: Incarnation,
    /// Splits held at the last renewal.
    pub held: u32,
    /// `max_in_flight`.
    pub capacity: u32,
}

/// `report.{instance_id}` (lease): what a worker says of its work, for `etl-coord status`
/// (progress by work, rates, the ETA). Never read by the protocol: the driver writes it every
/// heartbeat interval with the lease's TTL, so a dead worker's report expires with its presence.
/// A reader that cannot decode one (another release's) ignores it.
#[derive(Clone, PartialEq, Debug, Serialize, Deserialize)]
pub struct WorkReport {
    /// The worker's incarnation (a report of an earlier process of the same id is stale).
    pub incarnation: Incarnation,
    /// Records its lanes wrote since it started.
    pub records: u64,
    /// Weight its lanes processed since it started (the planner's unit).
    pub weight: u64,
    /// Records per second, over the last minute or so.
    pub records_per_sec: f64,
    /// Weight per second, over the same window.
    pub weight_per_sec: f64,
    /// The splits it reads whose source says where they stand: `(split, epoch, position)`,
    /// the position in the split's weight unit as of its last commit.
    pub positions: Vec<(SplitId, Epoch, u64)>,
}

/// `leader`: the leadership lease (P4).
#[derive(Clone, PartialEq, Eq, Debug, Serialize, Deserialize)]
pub struct LeaderRecord {
    /// The leader.
    pub owner: Owner,
    /// The term it established (0 until its bump has landed).
    pub term: u64,
}

/// Key layout (docs/PROTOCOL.md, records and keys).
pub mod keys {
    use super::*;

    fn key(s: String) -> Key {
        Key::new(s).expect("keys built from validated names are valid")
    }

    /// `meta` (state).
    pub fn meta() -> Key {
        key("meta".into())
    }
    /// `plan.head` (state).
    pub fn plan_head() -> Key {
        key("plan.head".into())
    }
    /// `manifest.{term}.{version}.{chunk}` (state).
    pub fn manifest(term: u64, version: u64, chunk: u32) -> Key {
        key(format!("manifest.{term}.{version}.{chunk}"))
    }
    /// `desc.{id}` (state).
    pub fn desc(id: &SplitId) -> Key {
        key(format!("desc.{id}"))
    }
    /// `split.{id}` (state: record; lease: lease).
    pub fn split(id: &SplitId) -> Key {
        key(format!("split.{id}"))
    }
    /// `leader` (lease).
    pub fn leader() -> Key {
        key("leader".into())
    }
    /// `worker.{id}` (lease).
    pub fn worker(id: &InstanceId) -> Key {
        key(format!("worker.{id}"))
    }
    /// `report.{id}` (lease): a worker's [`WorkReport`](super::WorkReport).
    pub fn report(id: &InstanceId) -> Key {
        key(format!("report.{id}"))
    }
    /// `report.` (lease).
    pub fn report_prefix() -> Prefix {
        Prefix::new("report.").expect("valid prefix")
    }
    /// The instance id of a `report.{id}` key.
    pub fn parse_report(key: &Key) -> Option<InstanceId> {
        key.as_str().strip_prefix("report.").and_then(|s| InstanceId::new(s).ok())
    }
    /// `steal.{victim}` (lease): a cooperative steal request to `victim` (P9).
    pub fn steal(victim: &InstanceId) -> Key {
        key(format!("steal.{victim}"))
    }
    /// `plan.` (state): the head lives here.
    pub fn plan_prefix() -> Prefix {
        Prefix::new("plan.").expect("valid prefix")
    }
    /// `split.`: split records (state) and leases (lease).
    pub fn split_prefix() -> Prefix {
        Prefix::new("split.").expect("valid prefix")
    }
    /// `manifest.` (state).
    pub fn manifest_prefix() -> Prefix {
        Prefix::new("manifest.").expect("valid prefix")
    }
    /// `desc.` (state).
    pub fn desc_prefix() -> Prefix {
        Prefix::new("desc.").expect("valid prefix")
    }

    /// The split id of a `split.{id}` key.
    pub fn parse_split(key: &Key) -> Option<SplitId> {
        key.as_str().strip_prefix("split.").and_then(|s| SplitId::new(s).ok())
    }
    /// The instance id of a `worker.{id}` key.
    pub fn parse_worker(key: &Key) -> Option<InstanceId> {
        key.as_str().strip_prefix("worker.").and_then(|s| InstanceId::new(s).ok())
    }
    /// The victim's instance id of a `steal.{victim}` key.
    pub fn parse_steal(key: &Key) -> Option<InstanceId> {
        key.as_str().strip_prefix("steal.").and_then(|s| InstanceId::new(s).ok())
    }
    /// `(term, version)` of a manifest chunk key.
    pub fn parse_manifest(key: &Key) -> Option<(u64, u64, u32)> {
        let rest = key.as_str().strip_prefix("manifest.")?;
        let mut parts = rest.split('.');
        let term = parts.next()?.parse().ok()?;
        let version = parts.next()?.parse().ok()?;
        let chunk = parts.next()?.parse().ok()?;
        parts.next().is_none().then_some((term, version, chunk))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Protocol 1's split record, written the way a protocol-1 worker did.
    #[derive(Serialize)]
    struct V1Split {
        epoch: Epoch,
        owner: Option<Owner>,
        state: SplitState,
        progress: Option<Bytes>,
        attempts: u32,
        last_end: Option<EndReason>,
        last_error: Option<String>,
    }

    fn v1<T: Serialize>(record: &T) -> Vec<u8> {
        let mut out = vec![1u8];
        bincode::serde::encode_into_std_write(record, &mut out, config()).unwrap();
        out
    }

    #[test]
    fn a_protocol_1_split_record_migrates_with_every_field_kept_and_progressed_false() {
        let old = V1Split {
            epoch: Epoch(7),
            owner: None,
            state: SplitState::Unleased,
            progress: Some(Bytes::from_static(b"{\"line\":42}")),
            attempts: 2,
            last_end: Some(EndReason::Expired),
            last_error: Some("boom".into()),
        };
        let key = keys::split(&SplitId::new("s1").unwrap());
        let new = migrate_state_value(&key, &v1(&old)).unwrap().expect("format 1 is rewritten");
        let rec: SplitRecord = decode(&new).unwrap();
        assert_eq!(
            rec,
            SplitRecord {
                epoch: Epoch(7),
                owner: None,
                state: SplitState::Unleased,
                progress: Some(Bytes::from_static(b"{\"line\":42}")),
                attempts: 2,
                last_end: Some(EndReason::Expired),
                last_error: Some("boom".into()),
                progressed: false,
            }
        );
        // Already current: nothing to write.
        assert_eq!(migrate_state_value(&key, &new).unwrap(), None);
    }

    #[test]
    fn migrating_refuses_what_it_cannot_convert_whole() {
        let meta = Meta { protocol_version: 1, fingerprint: "files/v1".into(), max_attempts: 3 };
        let converted = migrate_state_value(&keys::meta(), &v1(&meta)).unwrap().unwrap();
        assert_eq!(decode::<Meta>(&converted).unwrap(), meta, "meta keeps its fields; the caller stamps it");
        assert_eq!(
            decode_meta(&v1(&meta)).unwrap(),
            meta,
            "a worker reads a protocol-1 meta to refuse it by name"
        );
        // A truncated split record, a meta under a split key, an unknown format, a foreign key.
        let split = keys::split(&SplitId::new("s1").unwrap());
        let mut cut = v1(&meta);
        cut.truncate(3);
        assert!(matches!(migrate_state_value(&split, &cut), Err(RecordError::Malformed(_))));
        assert!(matches!(
            migrate_state_value(&keys::plan_head(), &v1(&meta)),
            Err(RecordError::Malformed(_))
        ));
        assert_eq!(migrate_state_value(&keys::meta(), &[9, 0]), Err(RecordError::UnknownFormat(9)));
        let foreign = Key::new("other.thing").unwrap();
        let err = migrate_state_value(&foreign, &v1(&meta)).unwrap_err();
        assert!(err.to_string().contains("other.thing"), "{err}");
    }

    #[test]
    fn records_round_trip_with_a_format_byte() {
        let rec = SplitRecord {
            epoch: Epoch(3),
            owner: Some(Owner { instance: InstanceId::new("a").unwrap(), incarnation: Incarnation(9) }),
            state: SplitState::Owned,
            progress: Some(Bytes::from_static(b"42")),
            attempts: 1,
            last_end: Some(EndReason::Expired),
            last_error: Some("boom".into()),
            progressed: true,
        };
        let bytes = encode(&rec);
        assert_eq!(bytes[0], FORMAT_VERSION);
        assert_eq!(decode::<SplitRecord>(&bytes).unwrap(), rec);
    }

    #[test]
    fn unknown_formats_and_garbage_are_refused() {
        let mut bytes = encode(&SplitRecord::new()).to_vec();
        bytes[0] = 9;
        assert_eq!(decode::<SplitRecord>(&bytes), Err(RecordError::UnknownFormat(9)));
        assert_eq!(decode::<SplitRecord>(&[]), Err(RecordError::Empty));
        assert!(matches!(decode::<Meta>(&[FORMAT_VERSION, 0xff]), Err(RecordError::Malformed(_))));
    }

    #[test]
    fn keys_parse_back() {
        let id = SplitId::new("s-1").unwrap();
        assert_eq!(keys::parse_split(&keys::split(&id)), Some(id));
        assert_eq!(keys::parse_manifest(&keys::manifest(3, 7, 1)), Some((3, 7, 1)));
        assert_eq!(keys::parse_manifest(&keys::plan_head()), None);
    }
}
