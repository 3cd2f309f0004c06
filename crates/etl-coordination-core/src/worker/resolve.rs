//! One resolver for writes of ours whose answer was lost, in doubt or a conflict: the read of
//! the key decides, and what it can decide is the same for every rule. A value older than a
//! revision we know comes from a lagging replica and decides nothing (decided here, once); our
//! own value means the write landed; anything else is for the rule to read. Records
//! ([`RecordRead`]) and the keys of the lease bucket ([`LeaseRead`]: a split's lease, our
//! presence, the leader key) each have their verdict.

use serde::de::DeserializeOwned;

use crate::ids::{Epoch, Owner, Revision};
use crate::records::{self, SplitRecord, SplitState};
use crate::store::StoreResult;

use super::outbox::Read;

/// What a read of a split record says after a write of ours to it was refused or in doubt.
#[derive(Debug)]
pub(super) enum RecordRead {
    /// The record holds exactly the value we wrote, at this revision: the write landed.
    Landed(Revision),
    /// Another value, at a revision not older than the one we know.
    Other(Revision, SplitRecord),
    /// No record, or a value nobody can decode: whatever it was, it is not ours.
    Gone,
    /// Answered by a replica behind a revision we know: decides nothing, read again later.
    Lagging,
    /// The read failed: decides nothing.
    Unavailable,
}

impl RecordRead {
    /// Judges the answer to a read of a record whose latest revision we know is `known`, after a
    /// write of `ours` (if any value of ours is expected).
    pub(super) fn of(result: StoreResult, known: Revision, ours: Option<&SplitRecord>) -> Self {
        let entry = match Read::of(result) {
            Read::Found(e) => e,
            Read::Absent => return RecordRead::Gone,
            Read::Failed(_) => return RecordRead::Unavailable,
        };
        if entry.revision < known {
            return RecordRead::Lagging;
        }
        let Ok(rec) = records::decode::<SplitRecord>(&entry.value) else { return RecordRead::Gone };
        if ours == Some(&rec) {
            return RecordRead::Landed(entry.revision);
        }
        RecordRead::Other(entry.revision, rec)
    }
}

/// Whether `rec` is still the tenancy of `owner` at `epoch`: only that owner writes the record
/// without bumping the epoch, so nobody else wrote since.
pub(super) fn still_ours(rec: &SplitRecord, owner: &Owner, epoch: Epoch) -> bool {
    rec.epoch == epoch && rec.owner.as_ref() == Some(owner) && rec.state == SplitState::Owned
}

/// What a read of a key of the lease bucket (a split's lease, a presence key, the leader key)
/// says after a write of ours to it was lost or in doubt. Which value is ours differs by key
/// (an owner and epoch, an incarnation, a write id), so the rule reads the value.
#[derive(Debug)]
pub(super) enum LeaseRead<R> {
    /// The value at a revision not older than the one we know (`None`: nobody can decode it).
    Found(Revision, Option<R>),
    /// No value: deleted or expired.
    Gone,
    /// Answered by a replica behind a revision we know: decides nothing.
    Lagging,
    /// The read failed: decides nothing.
    Unavailable,
}

impl<R: DeserializeOwned> LeaseRead<R> {
    /// Judges the answer to a read of a key whose latest revision we know is `known` (if any).
    pub(super) fn of(result: StoreResult, known: Option<Revision>) -> Self {
        match Read::of(result) {
            Read::Found(e) if known.is_some_and(|k| e.revision < k) => LeaseRead::Lagging,
            Read::Found(e) => LeaseRead::Found(e.revision, records::decode::<R>(&e.value).ok()),
            Read::Absent => LeaseRead::Gone,
            Read::Failed(_) => LeaseRead::Unavailable,
        }
    }
}
