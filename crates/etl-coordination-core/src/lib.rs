//! The etl-coordination protocol as a pure, deterministic state machine.
//!
//! [`Worker`] implements the whole protocol of one worker (docs/PROTOCOL.md, P2-P14): startup checks,
//! presence and duplicate-id detection, leader election and fenced plan publication, fair-share
//! claiming, heartbeats, fenced commits, release and drain, pairwise stealing, self-fencing,
//! attempts and quarantine, and completion. It does no IO, reads no clock and uses no
//! randomness: `now` and store results come in as [`Input`]s, store requests, lane instructions
//! and events go out as [`Action`]s, and [`Worker::next_deadline`] says when to call again.
//!
//! What it does not do: talk to a store, run a planner, move records, or keep time. The
//! `etl-coordination-driver` crate does those with tokio; the simulator does them on virtual
//! time. Users who bring their own runtime can depend on this crate alone.
//!
//! Every item is exported once, at the root, except the storage format ([`records`]), which is
//! a module of its own because it is for tools, not for casual use.

mod config;
mod ids;
mod io;
pub mod records;
mod store;
mod time;
mod view;
mod worker;

pub use config::{Config, ConfigError, Tuning, defaults};
pub use ids::{
    Epoch, Incarnation, InstanceId, JobName, MAX_NAME_LEN, NameError, OpId, Owner, Revision, SplitId,
};
pub use io::{
    AcquisitionReason, Action, CommitOutcome, Event, FatalError, Input, Outcome, Plan, PlanKind,
    PlannedSplit, SplitCounts, StopReason, WatchId,
};
pub use store::{
    Bucket, DeleteCause, Entry, Key, KeyError, MAX_KEY_LEN, Prefix, StoreError, StoreReply, StoreRequest,
    StoreResult, WatchEvent,
};
pub use time::Timestamp;
pub use worker::Worker;
