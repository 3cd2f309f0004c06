//! Deterministic simulation of etl-coordination.
//!
//! Drives N [`Worker`](etl_coordination_core::Worker) state machines against the memory
//! store's semantics ([`MemoryKv`](etl_coordination_memory::MemoryKv)) on virtual time, from a
//! seed, in a world as hostile as NATS (see `net`): every worker has its own link to the store
//! (requests land in the order sent; a stalled link delivers them late, after their timeouts; a
//! cut link refuses them; writes or one bucket can fail alone), reads may come from a lagging
//! replica, TTL expiry fires late and overdue keys stay CAS-able, an acknowledged renewal can
//! be erased by the previous revision's expiry, a stream's leader can lose its quorum (writes
//! wait and land late or never, a write to a key with one waiting is refused, expiries wait),
//! and every worker runs on its own drifting, jumping clock. Faults are mixed at random per seed: crashes and restarts (same and new
//! instance ids), pauses longer than a lease, store outages, partitions of one worker, poison
//! splits, scale up and down, leader death mid-plan, planner errors, hangs and panics, lanes
//! slow to stop, open plans that grow, plans of more than one manifest chunk. Some runs add
//! what no worker writes (`operator`): another program overwriting split records with bytes
//! nobody can decode, reset later by an operator; and workers that stay after the job's end,
//! whose quarantined splits the operator fixes and requeues before draining them.
//!
//! A run has a safety phase with faults, then a liveness phase without them that must reach
//! Complete or Stalled in bounded time. The invariants I1-I9 and the rules P4, P6, P7, P10,
//! P11, P12 are checked continuously by the checkers (`check/`), including a record-level oracle: every
//! split is a range of records, lanes emit them and commit progress, so loss and regression are
//! checked on data.

mod check;
mod clock;
mod fault;
mod options;
pub mod rng;
mod world;

pub use check::progress_of;
pub use fault::Fault;
pub use options::{Options, Report, Scenario, Violation};
pub use world::run;
