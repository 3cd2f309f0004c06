//! The protocol core alone, driven by a loop of your own: no async runtime, no store client.
//! A [`Worker`] is a state machine: inputs in (`now`, store results, watch events, the plan,
//! lane reports), actions out. Here the store is `MemoryKv` (the memory backend's semantics
//! as plain synchronous code) and time is whatever the loop says it is: this is how you would
//! embed the core in another runtime, or explore it in a model checker.
//!
//! `cargo run -p etl-coordination-examples --example core_loop`

use std::collections::VecDeque;

use bytes::Bytes;
use etl_coordination_core::{
    Action, Bucket, Config, Incarnation, Input, InstanceId, Plan, PlanKind, PlannedSplit, SplitId, Timestamp,
    WatchEvent, WatchId, Worker,
};
use etl_coordination_memory::MemoryKv;

fn main() {
    let config = Config::new(InstanceId::new("solo").unwrap(), Incarnation(1), "example-planner/v1");
    let mut worker = Worker::new(config);
    let (mut state, mut lease) = (MemoryKv::new(), MemoryKv::new());
    let mut watches: Vec<WatchId> = Vec::new();
    let splits = (0..3).map(|i| PlannedSplit::new(SplitId::new(format!("s{i}")).unwrap(), Bytes::new(), 1));
    let plan = Plan::new(PlanKind::Final, splits.collect());
    let mut now = Timestamp::ZERO;
    let mut inputs = VecDeque::from([Input::Start]);
    loop {
        // Nothing left to feed: let time pass until the worker's next deadline (a heartbeat).
        let input = inputs.pop_front().unwrap_or_else(|| {
            now = worker.next_deadline().expect("a running worker always has a timer");
            Input::Tick
        });
        for action in worker.handle(now, input) {
            match action {
                // Execute the request, answer it, and deliver the watch events it caused.
                Action::Store { op, bucket, request } => {
                    let kv = if bucket == Bucket::State { &mut state } else { &mut lease };
                    let result = kv.execute(now, request);
                    inputs.push_back(Input::StoreResult { op, result });
                    for event in kv.take_events() {
                        let key = event.key().expect("writes are keyed").clone();
                        for &watch in
                            watches.iter().filter(|w| w.bucket() == bucket && w.prefix().matches(&key))
                        {
                            inputs.push_back(Input::Watch { watch, event: event.clone() });
                        }
                    }
                }
                // A watch starts with a snapshot of its prefix.
                Action::Watch { watch } => {
                    let kv = if watch.bucket() == Bucket::State { &mut state } else { &mut lease };
                    for entry in kv.list(now, &watch.prefix()) {
                        inputs.push_back(Input::Watch { watch, event: WatchEvent::Put(entry) });
                    }
                    inputs.push_back(Input::Watch { watch, event: WatchEvent::SnapshotComplete });
                    watches.push(watch);
                }
                Action::Plan { request } => {
                    inputs.push_back(Input::PlanReady { request, result: Ok(plan.clone()) })
                }
                // A lane: process the split (here: at once) and finish it with its final progress.
                Action::StartLane { split, epoch, .. } => {
                    println!("processing {split} at epoch {epoch}");
                    inputs.push_back(Input::Finish { split, epoch, progress: Bytes::from_static(b"end") });
                }
                Action::StopLane { .. } | Action::CommitDone { .. } | Action::Event(_) => {}
                Action::Finished(outcome) => {
                    println!("finished: {outcome:?}");
                    return;
                }
                Action::Fatal(e) => panic!("{e}"),
            }
        }
    }
}
