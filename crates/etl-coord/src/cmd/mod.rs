//! The commands, one file each (its flags, what clap cannot check of them, and its run), and
//! what they share: the store flags and the value parsers.

pub(crate) mod demo;
pub(crate) mod job;
pub(crate) mod jobs;
pub(crate) mod nats;
pub(crate) mod requeue;
pub(crate) mod status;
pub(crate) mod worker;

/// The store flags (`StoreArgs` here, as every command names them), the usage errors and the
/// value parsers are the runner's: `etl-coord worker` runs on it, and the operator's commands
/// take the same flags.
pub(crate) use etl_coordination_runner::{
    ConnectFlags, StoreFlags as StoreArgs, Usage, nats_config, open_job, parse_duration, parse_split,
    positive, tuning_error,
};
