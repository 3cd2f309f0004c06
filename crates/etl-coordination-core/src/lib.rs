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
//!
//! A worker is driven by a loop of yours: feed it an input at a time `now`, carry out what it
//! asks, feed back the results. Its first step is to create the job's `meta` record (or find
//! that another worker has, and compare it with its own configuration):
//!
//! ```
//! use etl_coordination_core::{Action, Config, Incarnation, Input, InstanceId, StoreRequest, Timestamp, Worker};
//!
//! let config = Config::new(InstanceId::new("w1")?, Incarnation(7), "my-planner/v1");
//! config.validate()?; // a bad knob is named here, before anything runs
//! let mut worker = Worker::new(config);
//! let actions = worker.handle(Timestamp::ZERO, Input::Start);
//! let Some(Action::Store { request: StoreRequest::Create { key, .. }, .. }) = actions.first() else {
//!     panic!("startup begins with a create: {actions:?}");
//! };
//! assert_eq!(key.as_str(), "meta");
//! // Execute it against your store, then `worker.handle(now, Input::StoreResult { op, result })`,
//! // and so on; `worker.next_deadline()` says when to call `Input::Tick`. The whole loop against
//! // an in-memory store is `examples/core_loop.rs` in the repository (80 lines).
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! [`Action`] and [`StoreRequest`] are deliberately exhaustive: a new variant is a side effect
//! your loop must carry out, so it breaks your build rather than being dropped by a wildcard.
//! Informational enums ([`Event`], reasons, errors) and the configuration structs are
//! `#[non_exhaustive]`: start from [`Config::new`] or [`Tuning::default`] and set fields.

mod breaker;
mod config;
mod ids;
mod io;
mod lifecycle;
mod plan;
pub mod records;
mod store;
mod time;
mod view;
mod worker;

pub use breaker::{Breaker, BreakerState, BreakerVerdict, DataSide, Outage, failure_cause};
pub use config::{Config, ConfigError, MAX_ATTEMPTS_LIMIT, Tuning, defaults};
pub use ids::{
    Epoch, Incarnation, InstanceId, JobName, MAX_NAME_LEN, NameError, OpId, Owner, Revision, SplitId,
};
pub use io::{
    AcquisitionReason, Action, CommitOutcome, Event, FatalError, HandoverOutcome, Input, Outcome,
    SplitCounts, StopReason, WatchId,
};
pub use plan::{Plan, PlanKind, PlannedSplit};
pub use store::{
    Bucket, DeleteCause, Entry, Key, KeyError, MAX_KEY_LEN, Prefix, StoreError, StoreReply, StoreRequest,
    StoreResult, WatchEvent,
};
pub use time::Timestamp;
pub use worker::Worker;
