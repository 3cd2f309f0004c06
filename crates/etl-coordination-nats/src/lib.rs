//! NATS JetStream KV backend of etl-coordination (server >= 2.11).
//!
//! A job uses two KV buckets: `etl_coordination_{job}_state` (durable records) and
//! `etl_coordination_{job}_lease` (per-message TTLs and limit markers). [`connect()`] checks the
//! server (version, JetStream), creates or validates both buckets, and returns one
//! [`NatsStore`] per bucket. Every primitive is written against the traps measured in
//! `docs/NATS.md`:
//!
//! - create-if-absent is a publish expecting subject sequence 0; on a conflict over a delete or
//!   expiry marker it publishes against the marker's sequence, so a re-created lease keeps its
//!   TTL (`kv.create_with_ttl` silently drops it there);
//! - a CAS is a publish with `expected_last_subject_sequence` and the TTL, so a heartbeat
//!   replaces the TTL (`kv.update` would make the key permanent);
//! - conflicts are classified by the JetStream API error code (10071 and 10164), never by the
//!   client's error kind alone (clustered servers answer 10164, which the client maps to
//!   `Other`);
//! - a request without an answer is `Indeterminate`, never a failure;
//! - a get reads through the stream leader (the JetStream message-get API), never a direct
//!   get: async-nats creates buckets with direct get allowed, and then any replica answers, a
//!   lagging one with an older revision (measured: 180 of 3,000 reads right after an
//!   acknowledged write). A read after an acknowledged write returns it;
//! - watches and listings use ordered consumers with `LastPerSubject` delivery and report the
//!   end of the initial snapshot; a watch that fails is finished (never polled again).
//!
//! - every connection of a job uses the reply prefix [`inbox_prefix`], so a per-job user needs
//!   only the subjects [`permissions()`] lists; a subject the server refuses (credentials or a
//!   permission) makes every operation of the connection fail with [`StoreError::Setup`](etl_coordination_core::StoreError::Setup)
//!   naming the refused subject and the missing permission, at once (a refused request is
//!   otherwise only a timeout).
//!
//! What it does not do: retry. The protocol core decides what to do with every outcome.
//!
//! Most users never call this crate directly: `JobStores::nats` of `etl-coordination-driver`
//! (feature `nats`) does. Tools that read a job's records use it like this:
//!
//! ```no_run
//! use etl_coordination_nats::{JobName, NatsConfig, Store, connect};
//! use std::time::Duration;
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let mut config = NatsConfig::new("nats://127.0.0.1:4222");
//! config.replicas = 3; // a production cluster
//! config.op_timeout = Duration::from_secs(2);
//! config.create_buckets = false; // the buckets are provisioned (`etl-coord nats-buckets`)
//! let job = connect(&config, &JobName::new("orders-backfill")?).await?;
//! let leases = job.lease.list(&etl_coordination_nats::Prefix::new("split.")?).await?;
//! println!("{} splits are leased", leases.len());
//! # Ok(()) }
//! ```

mod buckets;
mod classify;
mod config;
mod connect;
mod jobs;
mod permissions;
mod refusals;
mod setup;
mod store;
mod watch;

pub use config::{MIN_SERVER_VERSION, NatsAuth, NatsConfig};
pub use connect::{NatsJob, connect, open_existing};
pub use etl_coordination_core::{JobName, Prefix};
pub use etl_coordination_store::Store;
pub use jobs::{JobListing, list_jobs};
pub use permissions::{
    Access, Account, AccountLimits, AccountUser, Permissions, account_name, bucket_names, inbox_prefix,
    permissions,
};
pub use store::NatsStore;
