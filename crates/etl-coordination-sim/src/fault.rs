//! The faults the world injects, by kind: each counted in the report under its label.

/// A kind of fault the simulator injects (the report counts each under [`Fault::label`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Fault {
    /// `source_read_error_past_the_budget`
    SourceReadErrorPastTheBudget,
    /// `source_read_error_transient`
    SourceReadErrorTransient,
    /// `source_outage_for_one`
    SourceOutageForOne,
    /// `source_outage_for_all`
    SourceOutageForAll,
    /// `sink_outage_for_one`
    SinkOutageForOne,
    /// `sink_outage_for_all`
    SinkOutageForAll,
    /// `breaker_opened`
    BreakerOpened,
    /// `bad_record_skipped`
    BadRecordSkipped,
    /// `bucket_unreachable_for_all`
    BucketUnreachableForAll,
    /// `bucket_unreachable_for_one`
    BucketUnreachableForOne,
    /// `clock_drifting`
    ClockDrifting,
    /// `clock_jump_forward`
    ClockJumpForward,
    /// `crash_for_good`
    CrashForGood,
    /// `crash_restart_new_id`
    CrashRestartNewId,
    /// `crash_restart_same_id`
    CrashRestartSameId,
    /// `expiry_late`
    ExpiryLate,
    /// `lane_slow_to_drain`
    LaneSlowToDrain,
    /// `lane_slow_to_stop`
    LaneSlowToStop,
    /// `leader_killed`
    LeaderKilled,
    /// `leader_killed_mid_plan`
    LeaderKilledMidPlan,
    /// `link_stalled`
    LinkStalled,
    /// `link_stalled_briefly`
    LinkStalledBriefly,
    /// `mixed_max_in_flight`
    MixedMaxInFlight,
    /// `op_timeout_beyond_lease`
    OpTimeoutBeyondLease,
    /// `operator_requeue`
    OperatorRequeue,
    /// `operator_reset`
    OperatorReset,
    /// `partition_one_worker`
    PartitionOneWorker,
    /// `pause_longer_than_lease`
    PauseLongerThanLease,
    /// `pause_short`
    PauseShort,
    /// `pending_write_dropped`
    PendingWriteDropped,
    /// `plan_of_several_manifest_chunks`
    PlanOfSeveralManifestChunks,
    /// `planner_error`
    PlannerError,
    /// `planner_hang`
    PlannerHang,
    /// `planner_panic`
    PlannerPanic,
    /// `poison_crash`
    PoisonCrash,
    /// `read_from_cut_off_leader_behind`
    ReadFromCutOffLeaderBehind,
    /// `record_overwritten_by_another_program`
    RecordOverwrittenByAnotherProgram,
    /// `renewal_erased_by_expiry`
    RenewalErasedByExpiry,
    /// `request_lost`
    RequestLost,
    /// `request_without_stream_leader`
    RequestWithoutStreamLeader,
    /// `response_lost`
    ResponseLost,
    /// `scale_down_drain`
    ScaleDownDrain,
    /// `scale_up`
    ScaleUp,
    /// `stale_read`
    StaleRead,
    /// `store_outage_long`
    StoreOutageLong,
    /// `store_outage_short`
    StoreOutageShort,
    /// `stream_leader_node_cut_off`
    StreamLeaderNodeCutOff,
    /// `stream_leader_stuck_lease`
    StreamLeaderStuckLease,
    /// `stream_leader_stuck_state`
    StreamLeaderStuckState,
    /// `watch_dropped`
    WatchDropped,
    /// `workers_stay_after_end`
    WorkersStayAfterEnd,
    /// `write_refused_while_one_is_pending`
    WriteRefusedWhileOneIsPending,
    /// `writes_fail_reads_succeed`
    WritesFailReadsSucceed,
}

impl Fault {
    /// The fault's name in reports and sweep summaries.
    pub fn label(self) -> &'static str {
        match self {
            Fault::SourceReadErrorPastTheBudget => "source_read_error_past_the_budget",
            Fault::SourceReadErrorTransient => "source_read_error_transient",
            Fault::SourceOutageForOne => "source_outage_for_one",
            Fault::SourceOutageForAll => "source_outage_for_all",
            Fault::SinkOutageForOne => "sink_outage_for_one",
            Fault::SinkOutageForAll => "sink_outage_for_all",
            Fault::BreakerOpened => "breaker_opened",
            Fault::BadRecordSkipped => "bad_record_skipped",
            Fault::BucketUnreachableForAll => "bucket_unreachable_for_all",
            Fault::BucketUnreachableForOne => "bucket_unreachable_for_one",
            Fault::ClockDrifting => "clock_drifting",
            Fault::ClockJumpForward => "clock_jump_forward",
            Fault::CrashForGood => "crash_for_good",
            Fault::CrashRestartNewId => "crash_restart_new_id",
            Fault::CrashRestartSameId => "crash_restart_same_id",
            Fault::ExpiryLate => "expiry_late",
            Fault::LaneSlowToDrain => "lane_slow_to_drain",
            Fault::LaneSlowToStop => "lane_slow_to_stop",
            Fault::LeaderKilled => "leader_killed",
            Fault::LeaderKilledMidPlan => "leader_killed_mid_plan",
            Fault::LinkStalled => "link_stalled",
            Fault::LinkStalledBriefly => "link_stalled_briefly",
            Fault::MixedMaxInFlight => "mixed_max_in_flight",
            Fault::OpTimeoutBeyondLease => "op_timeout_beyond_lease",
            Fault::OperatorRequeue => "operator_requeue",
            Fault::OperatorReset => "operator_reset",
            Fault::PartitionOneWorker => "partition_one_worker",
            Fault::PauseLongerThanLease => "pause_longer_than_lease",
            Fault::PauseShort => "pause_short",
            Fault::PendingWriteDropped => "pending_write_dropped",
            Fault::PlanOfSeveralManifestChunks => "plan_of_several_manifest_chunks",
            Fault::PlannerError => "planner_error",
            Fault::PlannerHang => "planner_hang",
            Fault::PlannerPanic => "planner_panic",
            Fault::PoisonCrash => "poison_crash",
            Fault::ReadFromCutOffLeaderBehind => "read_from_cut_off_leader_behind",
            Fault::RecordOverwrittenByAnotherProgram => "record_overwritten_by_another_program",
            Fault::RenewalErasedByExpiry => "renewal_erased_by_expiry",
            Fault::RequestLost => "request_lost",
            Fault::RequestWithoutStreamLeader => "request_without_stream_leader",
            Fault::ResponseLost => "response_lost",
            Fault::ScaleDownDrain => "scale_down_drain",
            Fault::ScaleUp => "scale_up",
            Fault::StaleRead => "stale_read",
            Fault::StoreOutageLong => "store_outage_long",
            Fault::StoreOutageShort => "store_outage_short",
            Fault::StreamLeaderNodeCutOff => "stream_leader_node_cut_off",
            Fault::StreamLeaderStuckLease => "stream_leader_stuck_lease",
            Fault::StreamLeaderStuckState => "stream_leader_stuck_state",
            Fault::WatchDropped => "watch_dropped",
            Fault::WorkersStayAfterEnd => "workers_stay_after_end",
            Fault::WriteRefusedWhileOneIsPending => "write_refused_while_one_is_pending",
            Fault::WritesFailReadsSucceed => "writes_fail_reads_succeed",
        }
    }
}
