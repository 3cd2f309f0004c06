//! Deterministic simulation of etl-coordination.
//!
//! Drives N [`Worker`](etl_coordination_core::Worker) state machines against the memory
//! store's semantics ([`MemoryKv`](etl_coordination_memory::MemoryKv)) on virtual time, from a
//! seed. The store is modelled as NATS behaves (NATS-NOTES): TTL expiry on a 250 ms timer (so
//! 0-250 ms late, never early), watch events delayed but ordered per watch, in-doubt outcomes
//! that were sometimes applied, outage windows, dropped watches, and the rare acknowledged
//! renewal erased by an expiry. Faults are mixed at random per seed: crashes and restarts (same
//! and new instance ids), pauses longer than a lease (zombies), store outages, poison splits,
//! scale up and down, leader death mid-plan, open plans that grow.
//!
//! A run has a safety phase with faults, then a liveness phase without them that must reach
//! Complete or Stalled in bounded time. The invariants I1-I9 are checked continuously by
//! [`check`]'s checkers, including a record-level oracle: every split is a range of records,
//! lanes emit them and commit progress, so loss and regression are checked on data.

mod check;
pub mod rng;
mod world;

pub use check::{Violation, progress_of};
pub use world::{Options, Report, Scenario, run};
