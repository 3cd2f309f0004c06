//! What a planner returns: a plan of splits (ids, descriptors, weights) and its kind. Both
//! the worker's inputs ([`crate::Input::PlanReady`]) and the published records (the manifest's
//! kind) use these types, so they sit below both.

use bytes::Bytes;
use serde::{Deserialize, Serialize};

use crate::ids::SplitId;

/// Whether a plan is a bounded enumeration or is re-planned on an interval.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Serialize, Deserialize)]
#[non_exhaustive]
pub enum PlanKind {
    /// A bounded backfill: completes when every split is Done (P13).
    Final,
    /// A discovery job: the leader re-plans every `replan_interval` (P4).
    Open,
}

/// One split as the planner returns it.
#[derive(Clone, PartialEq, Eq, Debug)]
#[non_exhaustive]
pub struct PlannedSplit {
    /// Deterministic id.
    pub id: SplitId,
    /// Opaque bytes a worker needs to process it.
    pub descriptor: Bytes,
    /// Cost estimate (bytes, rows); larger splits are claimed first.
    pub weight: u64,
}

/// A planner's answer.
#[derive(Clone, PartialEq, Eq, Debug)]
#[non_exhaustive]
pub struct Plan {
    /// Final (bounded) or Open (re-planned on an interval).
    pub kind: PlanKind,
    /// The enumeration. For an Open plan the published manifest is the union of every
    /// enumeration so far: a split never leaves a plan once published.
    pub splits: Vec<PlannedSplit>,
}

impl PlannedSplit {
    /// A split: its deterministic id, the bytes a worker needs to process it, and its cost
    /// estimate.
    pub fn new(id: SplitId, descriptor: impl Into<Bytes>, weight: u64) -> Self {
        PlannedSplit { id, descriptor: descriptor.into(), weight }
    }
}

impl Plan {
    /// A plan of the given kind.
    pub fn new(kind: PlanKind, splits: Vec<PlannedSplit>) -> Self {
        Plan { kind, splits }
    }
}
