//! Property tests: random interleavings of store answers (applied, lost after applying, never
//! applied, refused), time, lane commits, failures and drains against one worker.

mod rig;

use std::collections::BTreeMap;
use std::time::Duration;

use bytes::Bytes;
use etl_coordination_core::records::{self, SplitRecord};
use etl_coordination_core::*;
use proptest::prelude::*;
use rig::*;

#[derive(Clone, Debug)]
enum Step {
    Advance(u64),
    /// Answer the pending request at (index mod len): applied (7 in 10), applied with the answer
    /// lost, not applied and in doubt, or refused.
    Answer(usize, u8),
    Commit(usize),
    Finish(usize),
    Fail(usize),
    Drain,
}

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        2 => (1u64..400).prop_map(Step::Advance),
        14 => (any::<usize>(), 0u8..10).prop_map(|(i, k)| Step::Answer(i, k)),
        3 => any::<usize>().prop_map(Step::Commit),
        1 => any::<usize>().prop_map(Step::Finish),
        1 => any::<usize>().prop_map(Step::Fail),
    ]
}

fn progress_of(r: &SplitRecord) -> u64 {
    r.progress.as_ref().map_or(0, |b| u64::from_be_bytes(b[..8].try_into().unwrap()))
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, .. ProptestConfig::default() })]

    #[test]
    fn random_schedules_keep_the_workers_promises(
        mut steps in prop::collection::vec(step(), 1..300),
        drain_at in prop::option::of(any::<prop::sample::Index>()),
    ) {
        if let Some(at) = drain_at {
            let i = at.index(steps.len());
            steps.insert(i, Step::Drain);
        }
        let mut r = Rig::new(cfg("w1", 1));
        r.plan = Some(plan(4, PlanKind::Final));
        r.auto = false;
        r.feed(Input::Start);
        let mut lane_progress: BTreeMap<SplitId, u64> = BTreeMap::new();
        let mut durable: BTreeMap<String, u64> = BTreeMap::new();
        let mut stopped = false;
        for s in steps {
            let before = r.log.len();
            match s {
                Step::Advance(ms) => {
                    r.advance(Duration::from_millis(ms));
                    // A tick never leaves a deadline in the past (no tick storms).
                    if let Some(d) = r.w.next_deadline() {
                        prop_assert!(d > r.now, "deadline {d:?} not after now {:?}", r.now);
                    }
                }
                Step::Answer(i, kind) if !r.pending.is_empty() => {
                    let i = i % r.pending.len();
                    match kind {
                        0..=6 => { r.apply_and_answer(i, None); }
                        7 => { r.apply_and_answer(i, Some(Err(StoreError::Indeterminate("lost answer".into())))); }
                        8 => { let (op, _, _) = r.pending[i].clone(); r.answer(op, Err(StoreError::Indeterminate("timeout".into()))); }
                        _ => { let (op, _, _) = r.pending[i].clone(); r.answer(op, Err(StoreError::Unavailable("down".into()))); }
                    }
                }
                Step::Answer(..) => {}
                Step::Commit(i) | Step::Finish(i) | Step::Fail(i) => {
                    let held: Vec<(SplitId, Epoch)> = r.w.held().map(|(s, e)| (s.clone(), e)).collect();
                    if held.is_empty() { continue; }
                    let (split, epoch) = held[i % held.len()].clone();
                    let p = lane_progress.entry(split.clone()).or_default();
                    *p += 1;
                    let progress = Bytes::copy_from_slice(&p.to_be_bytes());
                    let input = match s {
                        Step::Commit(_) => Input::Commit { split, epoch, progress },
                        Step::Finish(_) => Input::Finish { split, epoch, progress },
                        _ => Input::Fail { split, epoch, error: "boom".into(), unprocessable: false },
                    };
                    r.feed(input);
                }
                Step::Drain => { r.feed(Input::Drain); }
            }
            let new = &r.log[before..];
            if stopped {
                prop_assert!(new.is_empty(), "actions after the worker stopped: {new:?}");
            }
            if new.iter().any(|a| matches!(a, Action::Finished(_) | Action::Fatal(_))) {
                stopped = true;
                prop_assert!(r.w.is_stopped());
            }
            prop_assert!(!new.iter().any(|a| matches!(a, Action::Fatal(_))), "no fatal error in a healthy fleet: {new:?}");
            // I1: durable progress never regresses.
            for i in 0..4 {
                let key = format!("split.s{i}");
                if let Some(e) = r.kv.get(Bucket::State, &key) {
                    let rec: SplitRecord = records::decode(&e.value).unwrap();
                    let p = progress_of(&rec);
                    let prev = durable.insert(key.clone(), p).unwrap_or(0);
                    prop_assert!(p >= prev, "{key}: progress regressed {prev} -> {p}");
                }
            }
        }
        // Started lanes carry strictly increasing epochs per split.
        let mut last: BTreeMap<SplitId, Epoch> = BTreeMap::new();
        for (split, epoch) in r.started() {
            if let Some(prev) = last.insert(split.clone(), epoch) {
                prop_assert!(epoch >= prev, "{split}: lane epoch went back {prev} -> {epoch}");
            }
        }
    }
}
