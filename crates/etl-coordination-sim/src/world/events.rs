//! The event queue: what happens next in the world, in time order (ties in scheduling order).

use std::time::Duration;

use etl_coordination_core::{Bucket, Epoch, Input, OpId, Owner, SplitId, StoreRequest, Timestamp, WatchId};

/// How the answer to a store request is delivered.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Answer {
    /// The result, this long after the request is applied.
    After(Duration),
    /// The worker already got (or will get) an in-doubt or unavailable answer at its timeout.
    Dropped,
}

#[derive(Debug)]
pub(crate) enum Ev {
    ToWorker {
        slot: usize,
        life: u32,
        input: Input,
    },
    /// An event or failure of one generation of a worker's watch: dropped if the watch was
    /// reopened since.
    ToWatch {
        slot: usize,
        life: u32,
        generation: u64,
        input: Input,
    },
    Tick {
        slot: usize,
        life: u32,
    },
    StoreApply {
        slot: usize,
        life: u32,
        op: OpId,
        bucket: Bucket,
        request: StoreRequest,
        writer: Owner,
        answer: Answer,
        /// When the sender's op timeout runs out (an answer after it is never delivered).
        deadline: Timestamp,
    },
    /// A stuck stream leader regains its quorum or steps down (see `net::Stuck`).
    StreamRecovered {
        bucket: Bucket,
    },
    OpenWatch {
        slot: usize,
        life: u32,
        watch: WatchId,
        /// The subscription's generation (`Slot::watch_gen`): a newer ask supersedes it.
        generation: u64,
    },
    LaneStep {
        slot: usize,
        life: u32,
        split: SplitId,
        epoch: Epoch,
    },
    ExpiryTick,
    Erase {
        key: etl_coordination_core::Key,
        revision: etl_coordination_core::Revision,
    },
    FaultTick,
    /// A data-path fault is due (`datapath`).
    DataFaultTick,
    /// An open breaker's wait is over (`datapath`).
    BreakerProbe {
        slot: usize,
        life: u32,
    },
    Restart {
        slot: usize,
    },
    Crash {
        slot: usize,
        life: u32,
    },
    Resume {
        slot: usize,
    },
    EndSafety,
    Probe,
    BalanceProbe,
    /// The operator resets a split whose record another program overwrote.
    OperatorReset {
        split: SplitId,
    },
}

pub(super) struct Scheduled {
    pub(super) at: Timestamp,
    pub(super) seq: u64,
    pub(super) ev: Ev,
}

impl PartialEq for Scheduled {
    fn eq(&self, o: &Self) -> bool {
        (self.at, self.seq) == (o.at, o.seq)
    }
}
impl Eq for Scheduled {}
impl PartialOrd for Scheduled {
    fn partial_cmp(&self, o: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(o))
    }
}
impl Ord for Scheduled {
    fn cmp(&self, o: &Self) -> std::cmp::Ordering {
        (self.at, self.seq).cmp(&(o.at, o.seq))
    }
}
