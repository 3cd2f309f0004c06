//! One test per protocol rule (docs/PROTOCOL.md, P2-P13), asserting exact action sequences where the rule
//! is about what the worker sends, and resulting store state where it is about an outcome.

mod rig;

use std::time::Duration;

use bytes::Bytes;
use etl_coordination_core::records::{
    self, LeaderRecord, Meta, PresenceRecord, SplitRecord, SplitState, keys,
};
use etl_coordination_core::*;
use rig::*;

fn store_requests(actions: &[Action]) -> Vec<(Bucket, StoreRequest)> {
    actions
        .iter()
        .filter_map(|a| match a {
            Action::Store { bucket, request, .. } => Some((*bucket, request.clone())),
            _ => None,
        })
        .collect()
}

fn op_of(actions: &[Action], n: usize) -> OpId {
    actions
        .iter()
        .filter_map(|a| match a {
            Action::Store { op, .. } => Some(*op),
            _ => None,
        })
        .nth(n)
        .expect("store action")
}

/// A single worker with a plan of `n` splits, started, whose requests a test answers by hand.
fn starting_by_hand(n: usize) -> Rig {
    let mut r = Rig::new(cfg("w1", 1));
    r.plan = Some(plan(n, PlanKind::Final));
    r.auto = false;
    r.feed(Input::Start);
    r
}

/// A single worker that planned `n` splits and runs them.
fn running(n: usize) -> Rig {
    let mut r = Rig::new(cfg("w1", 1));
    r.plan = Some(plan(n, PlanKind::Final));
    r.feed(Input::Start);
    r
}

#[test]
fn p2_startup_creates_meta_before_anything_else() {
    let mut w = Worker::new(cfg("w1", 1));
    let actions = w.handle(Timestamp::ZERO, Input::Start);
    let meta =
        Meta { protocol_version: records::PROTOCOL_VERSION, fingerprint: "fp-1".into(), max_attempts: 2 };
    assert_eq!(
        actions,
        vec![Action::Store {
            op: OpId(1),
            bucket: Bucket::State,
            request: StoreRequest::Create { key: keys::meta(), value: records::encode(&meta), ttl: None },
        }]
    );
}

#[test]
fn p2_a_diverging_meta_is_fatal_and_names_both_fingerprints() {
    let mut w = Worker::new(cfg("w1", 1));
    w.handle(Timestamp::ZERO, Input::Start);
    let a = w.handle(
        Timestamp::ZERO,
        Input::StoreResult { op: OpId(1), result: Err(StoreError::AlreadyExists(keys::meta())) },
    );
    assert_eq!(store_requests(&a), vec![(Bucket::State, StoreRequest::Get { key: keys::meta() })]);
    let other =
        Meta { protocol_version: records::PROTOCOL_VERSION, fingerprint: "fp-2".into(), max_attempts: 2 };
    let entry = Entry { key: keys::meta(), value: records::encode(&other), revision: Revision(1) };
    let a = w.handle(
        Timestamp::ZERO,
        Input::StoreResult { op: OpId(2), result: Ok(StoreReply::Value(Some(entry))) },
    );
    let [Action::Fatal(e @ FatalError::ConfigDivergence { .. })] = a.as_slice() else { panic!("{a:?}") };
    let msg = e.to_string();
    assert!(msg.contains("\"fp-1\"") && msg.contains("\"fp-2\""), "{msg}");
    assert!(w.is_stopped());
    assert!(w.handle(Timestamp::ZERO, Input::Tick).is_empty(), "nothing follows a fatal error");
}

#[test]
fn p2_another_protocol_is_fatal_and_says_how_to_move_the_job() {
    for (stored, advice) in
        [(1, "etl-coord job migrate"), (records::PROTOCOL_VERSION + 1, "run the release that moved it")]
    {
        let mut r = Rig::new(cfg("w1", 1));
        let meta = Meta { protocol_version: stored, fingerprint: "fp-1".into(), max_attempts: 2 };
        r.kv.put(Bucket::State, &keys::meta(), &meta);
        r.feed(Input::Start);
        let fatal = r.log.iter().find_map(|a| match a {
            Action::Fatal(e @ FatalError::ProtocolMismatch { .. }) => Some(e.to_string()),
            _ => None,
        });
        let msg = fatal.unwrap_or_else(|| panic!("no protocol refusal: {:?}", r.log));
        assert!(msg.contains(&format!("protocol {stored}")) && msg.contains(advice), "{msg}");
        assert!(r.kv.watches.is_empty(), "a refused worker opens nothing");
    }
}

/// P2, P12: `max_attempts` is the job's: a worker configured otherwise joins and charges by
/// the job's value, and an operator's change reaches a running worker at its next resync (a
/// lagging answer with an older meta does not undo it).
#[test]
fn p2_the_jobs_max_attempts_governs_charges_and_a_change_reaches_running_workers() {
    let mut r = Rig::new(cfg("w1", 1)); // configured: 2
    let meta =
        |n| Meta { protocol_version: records::PROTOCOL_VERSION, fingerprint: "fp-1".into(), max_attempts: n };
    r.kv.put(Bucket::State, &keys::meta(), &meta(1));
    r.plan = Some(plan(3, PlanKind::Final)); // s2 runs throughout: the job does not end
    r.feed(Input::Start);
    assert!(r.events().contains(&Event::JobMaxAttempts { job: 1, configured: 2 }), "{:?}", r.events());
    assert_eq!(r.started().len(), 3, "joined and running every split");
    r.feed(Input::Fail { split: sid("s0"), epoch: Epoch(1), error: "bad row".into(), unprocessable: false });
    let rec = r.kv.record("s0");
    assert_eq!((rec.state, rec.attempts), (SplitState::Quarantined, 1), "quarantined at the job's 1, not 2");

    // An operator raises it to 3 (`etl-coord job set-max-attempts 3`).
    r.kv.put(Bucket::State, &keys::meta(), &meta(3));
    let resync = r.w.config().tuning.resync_interval();
    r.advance(resync);
    assert!(r.events().contains(&Event::JobMaxAttempts { job: 3, configured: 2 }), "{:?}", r.events());
    assert_eq!(r.w.config().tuning.max_attempts, 3);
    for attempt in 1..=2 {
        let epoch = r.started().iter().rev().find(|(s, _)| s.as_str() == "s1").unwrap().1;
        r.feed(Input::Fail { split: sid("s1"), epoch, error: "bad row".into(), unprocessable: false });
        let rec = r.kv.record("s1");
        assert_eq!((rec.state, rec.attempts), (SplitState::Unleased, attempt), "not quarantined before 3");
        r.advance(Duration::from_secs(60));
    }
    let epoch = r.started().iter().rev().find(|(s, _)| s.as_str() == "s1").unwrap().1;
    r.feed(Input::Fail { split: sid("s1"), epoch, error: "bad row".into(), unprocessable: false });
    assert_eq!(r.kv.record("s1").state, SplitState::Quarantined);

    // A lagging replica answers the next refresh with the meta of before the change.
    r.auto = false;
    r.advance(resync);
    let op = r
        .pending
        .iter()
        .find(|(_, _, req)| *req == StoreRequest::Get { key: keys::meta() })
        .map(|(op, _, _)| *op)
        .expect("every resync reads meta again");
    let stale = Entry { key: keys::meta(), value: records::encode(&meta(1)), revision: Revision(1) };
    r.answer(op, Ok(StoreReply::Value(Some(stale))));
    assert_eq!(r.w.config().tuning.max_attempts, 3, "an older meta does not undo a change");
}

#[test]
fn p2_a_job_moved_to_another_protocol_under_a_running_worker_stops_it_at_the_next_resync() {
    let mut r = running(1);
    let moved =
        Meta { protocol_version: records::PROTOCOL_VERSION + 1, fingerprint: "fp-1".into(), max_attempts: 2 };
    r.kv.put(Bucket::State, &keys::meta(), &moved);
    let resync = r.w.config().tuning.resync_interval();
    r.advance(resync);
    assert!(
        r.log.iter().any(|a| matches!(a, Action::Fatal(FatalError::ProtocolMismatch { .. }))),
        "{:?}",
        r.log
    );
    assert!(r.w.is_stopped());
}

/// P2: a refreshed `meta` of another protocol is no reason to stop when it is a lagging
/// replica's answer (older than the meta in effect), nor while draining (the drain finishes
/// under what it started with).
#[test]
fn p2_a_lagging_answer_or_a_drain_is_not_stopped_by_a_refreshed_meta() {
    let mut c = cfg("w1", 1);
    c.tuning.drain_timeout = Duration::from_secs(600);
    let mut r = Rig::new(c);
    r.plan = Some(plan(1, PlanKind::Final));
    r.feed(Input::Start);
    let current =
        Meta { protocol_version: records::PROTOCOL_VERSION, fingerprint: "fp-1".into(), max_attempts: 2 };
    let newer = r.kv.put(Bucket::State, &keys::meta(), &current);
    let resync = r.w.config().tuning.resync_interval();
    for _ in 0..resync.as_secs() {
        r.advance(Duration::from_secs(1)); // renewing all along; adopts the meta at `newer`
    }
    let moved = Meta { protocol_version: records::PROTOCOL_VERSION + 1, ..current.clone() };
    let is_meta_read = |req: &StoreRequest| *req == StoreRequest::Get { key: keys::meta() };
    r.auto = false;
    let mut meta_read = None;
    for _ in 0..=resync.as_secs() {
        r.advance(Duration::from_secs(1));
        while let Some((op, _, req)) = r.pending.iter().find(|p| meta_read != Some(p.0)).cloned() {
            if is_meta_read(&req) {
                meta_read = Some(op);
            } else {
                r.apply(op);
            }
        }
        if meta_read.is_some() {
            break;
        }
    }
    let op = meta_read.expect("every resync reads meta again");
    let stale = Entry { key: keys::meta(), value: records::encode(&moved), revision: Revision(newer.0 - 1) };
    r.answer(op, Ok(StoreReply::Value(Some(stale))));
    assert!(!r.w.is_stopped(), "an answer older than the meta in effect stops nothing: {:?}", r.log);
    while let Some((op, _, _)) = r.pending.first().cloned() {
        r.apply(op);
    }
    r.auto = true;

    // Draining (the lane has not stopped yet), the job is moved: the drain goes on.
    r.feed(Input::Drain);
    assert!(
        r.log.iter().any(|a| matches!(a, Action::StopLane { reason: StopReason::Draining, .. })),
        "a lane to wait for: {:?}",
        r.log
    );
    r.kv.put(Bucket::State, &keys::meta(), &moved);
    let reads_before =
        r.kv.history.iter().filter(|(_, q)| *q == StoreRequest::Get { key: keys::meta() }).count();
    for _ in 0..resync.as_secs() {
        r.advance(Duration::from_secs(1));
    }
    let reads = r.kv.history.iter().filter(|(_, q)| *q == StoreRequest::Get { key: keys::meta() }).count();
    assert!(reads > reads_before, "meta was read again while draining");
    assert!(!r.log.iter().any(|a| matches!(a, Action::Fatal(_))), "{:?}", r.log);
    assert!(!r.w.is_stopped(), "still draining: {:#?}", r.take_log());
}

#[test]
fn p2_a_matching_meta_opens_the_watches_and_announces_presence() {
    let mut w = Worker::new(cfg("w1", 1));
    w.handle(Timestamp::ZERO, Input::Start);
    let a = w.handle(
        Timestamp::ZERO,
        Input::StoreResult { op: OpId(1), result: Ok(StoreReply::Written(Revision(1))) },
    );
    let presence = PresenceRecord { incarnation: Incarnation(1), held: 0, capacity: 4 };
    assert_eq!(
        a,
        vec![
            Action::Watch { watch: WatchId::Leases },
            Action::Watch { watch: WatchId::Plan },
            Action::Watch { watch: WatchId::Splits },
            Action::Store {
                op: OpId(2),
                bucket: Bucket::Lease,
                request: StoreRequest::Create {
                    key: presence_key("w1"),
                    value: records::encode(&presence),
                    ttl: Some(Duration::from_secs(3)),
                },
            },
        ]
    );
}

/// Drives a worker whose presence key is held by incarnation 9 at revision 5 to the point
/// where it has observed the key for a heartbeat (plus the bounded jitter margin) and re-reads it.
fn observe_predecessor() -> (Worker, OpId) {
    let mut w = Worker::new(cfg("w1", 1));
    w.handle(Timestamp::ZERO, Input::Start);
    w.handle(
        Timestamp::ZERO,
        Input::StoreResult { op: OpId(1), result: Ok(StoreReply::Written(Revision(1))) },
    );
    let a = w.handle(
        Timestamp::ZERO,
        Input::StoreResult { op: OpId(2), result: Err(StoreError::AlreadyExists(presence_key("w1"))) },
    );
    assert_eq!(store_requests(&a), vec![(Bucket::Lease, StoreRequest::Get { key: presence_key("w1") })]);
    let other = PresenceRecord { incarnation: Incarnation(9), held: 2, capacity: 4 };
    let entry = Entry { key: presence_key("w1"), value: records::encode(&other), revision: Revision(5) };
    let a = w.handle(
        Timestamp::ZERO,
        Input::StoreResult { op: OpId(3), result: Ok(StoreReply::Value(Some(entry))) },
    );
    assert!(a.is_empty(), "the worker waits before deciding: {a:?}");
    let deadline = w.next_deadline().expect("observation deadline");
    // One heartbeat (1 s with a 3 s lease) and a margin of a quarter second: a restart under the
    // same id reclaims within L/3 + 0.5 s (T3).
    assert_eq!(deadline, Timestamp::ZERO + Duration::from_millis(1250), "a heartbeat and the margin");
    let a = w.handle(deadline, Input::Tick);
    assert_eq!(store_requests(&a), vec![(Bucket::Lease, StoreRequest::Get { key: presence_key("w1") })]);
    (w, op_of(&a, 0))
}

#[test]
fn p3_a_dead_predecessor_is_taken_over_after_one_heartbeat_without_renewal() {
    let (mut w, op) = observe_predecessor();
    let other = PresenceRecord { incarnation: Incarnation(9), held: 2, capacity: 4 };
    let entry = Entry { key: presence_key("w1"), value: records::encode(&other), revision: Revision(5) };
    let t = Timestamp::ZERO + Duration::from_millis(1500);
    let a = w.handle(t, Input::StoreResult { op, result: Ok(StoreReply::Value(Some(entry))) });
    let mine = PresenceRecord { incarnation: Incarnation(1), held: 0, capacity: 4 };
    assert_eq!(
        store_requests(&a),
        vec![(
            Bucket::Lease,
            StoreRequest::CompareAndSwap {
                key: presence_key("w1"),
                expected: Revision(5),
                value: records::encode(&mine),
                ttl: Some(Duration::from_secs(3)),
            }
        )]
    );
}

/// Whether `req` is about `worker.w1`.
fn presence_of_w1(req: &StoreRequest) -> bool {
    match req {
        StoreRequest::Create { key, .. }
        | StoreRequest::CompareAndSwap { key, .. }
        | StoreRequest::Get { key }
        | StoreRequest::Delete { key, .. } => key.as_str() == "worker.w1",
        _ => false,
    }
}

#[test]
fn p7_a_presence_announced_again_without_an_answer_is_announced_again_at_the_next_heartbeat() {
    // Found by seed 4,922,940: the presence expired, the create announcing it again got no
    // answer, the read to resolve it failed too, and the worker never renewed again: it ran on
    // for minutes unseen by its peers (who then never balanced against it).
    let mut r = running(1);
    r.auto = false;
    let heartbeat = cfg("w1", 1).tuning.heartbeat_interval();
    let presence_op =
        |r: &Rig| r.pending.iter().position(|(_, _, req)| presence_of_w1(req)).expect("a presence request");
    r.advance(heartbeat);
    // The renewal finds the key gone (expired meanwhile): resolved by a read, then created again.
    let entry = r.kv.get(Bucket::Lease, "worker.w1").unwrap();
    r.kv.apply(Bucket::Lease, &StoreRequest::Delete { key: presence_key("w1"), expected: entry.revision })
        .0
        .unwrap();
    let i = presence_op(&r);
    r.apply_and_answer(i, None);
    let i = presence_op(&r);
    assert!(matches!(r.pending[i].2, StoreRequest::Get { .. }), "{:?}", r.pending[i]);
    r.apply_and_answer(i, None);
    let i = presence_op(&r);
    assert!(matches!(r.pending[i].2, StoreRequest::Create { .. }), "{:?}", r.pending[i]);
    // No answer to the create (it did not land), and the read that would resolve it fails.
    let (op, _, _) = r.pending.remove(i);
    r.answer(op, Err(StoreError::Indeterminate("no answer".into())));
    let i = presence_op(&r);
    let (op, _, req) = r.pending.remove(i);
    assert!(matches!(req, StoreRequest::Get { .. }), "{req:?}");
    r.answer(op, Err(StoreError::Unavailable("no answer".into())));
    assert!(r.pending.iter().all(|(_, _, req)| !presence_of_w1(req)), "{:?}", r.pending);
    // The next heartbeat announces it again.
    r.advance(heartbeat);
    let i = presence_op(&r);
    assert!(matches!(r.pending[i].2, StoreRequest::Create { .. }), "{:?}", r.pending[i]);
    r.apply_and_answer(i, None);
    assert!(r.kv.get(Bucket::Lease, "worker.w1").is_some(), "present again");
}

#[test]
fn p3_a_renewing_twin_is_fatal_and_says_what_to_do() {
    let (mut w, op) = observe_predecessor();
    let other = PresenceRecord { incarnation: Incarnation(9), held: 2, capacity: 4 };
    // One renewal could be a stale read or a dead process's write landing late: watch again.
    let entry = Entry { key: presence_key("w1"), value: records::encode(&other), revision: Revision(6) };
    let t = Timestamp::ZERO + Duration::from_millis(1500);
    let a = w.handle(t, Input::StoreResult { op, result: Ok(StoreReply::Value(Some(entry))) });
    assert!(a.is_empty(), "one renewal is not proof of a twin: {a:?}");
    let t2 = w.next_deadline().expect("a second observation");
    // The second renewal is told from a late write by one and a half heartbeats.
    assert_eq!(t2, t + Duration::from_millis(1500), "one and a half heartbeats after the first renewal");
    let t = t2;
    let a = w.handle(t, Input::Tick);
    assert_eq!(store_requests(&a), vec![(Bucket::Lease, StoreRequest::Get { key: presence_key("w1") })]);
    // A second renewal is.
    let entry = Entry { key: presence_key("w1"), value: records::encode(&other), revision: Revision(7) };
    let a = w.handle(t, Input::StoreResult { op: op_of(&a, 0), result: Ok(StoreReply::Value(Some(entry))) });
    let [Action::Fatal(e @ FatalError::DuplicateInstance { .. })] = a.as_slice() else { panic!("{a:?}") };
    assert!(e.to_string().contains("unique instance id"), "{e}");
}

#[test]
fn p3_a_restarted_instance_reclaims_its_splits_at_once_consuming_an_attempt() {
    // The first incarnation claims everything, commits progress on s1 and s2, then dies
    // without releasing.
    let mut r = running(3);
    assert_eq!(r.started().len(), 3);
    for s in ["s1", "s2"] {
        r.feed(Input::Commit { split: sid(s), epoch: Epoch(1), progress: Bytes::from_static(b"p1") });
    }
    let old_kv = std::mem::take(&mut r.kv);
    // The new incarnation finds the old presence, waits, takes it over, and reclaims.
    let mut r2 = Rig::new(cfg("w1", 2));
    r2.kv = old_kv;
    r2.kv.watches.clear();
    r2.feed(Input::Start);
    assert!(r2.started().is_empty(), "nothing before the observation window ends");
    r2.advance(Duration::from_millis(1500));
    let started = r2.started();
    assert_eq!(started.len(), 3, "all reclaimed well before the 3 s lease ran out: {:?}", r2.log);
    assert!(started.iter().all(|(_, e)| *e == Epoch(2)));
    let reasons: Vec<_> = r2
        .log
        .iter()
        .filter_map(|a| match a {
            Action::Event(Event::Acquired { reason, .. }) => Some(*reason),
            _ => None,
        })
        .collect();
    assert_eq!(reasons, vec![AcquisitionReason::Reclaimed; 3]);
    assert_eq!(r2.kv.record("s0").attempts, 1, "a crash consumes an attempt (P12)");
    assert_eq!(r2.kv.record("s1").attempts, 0, "unless the tenancy progressed");
}

#[test]
fn p12_a_restarted_instance_tries_its_suspects_one_at_a_time() {
    // The first incarnation claims three splits and dies before any commit: each reclaim
    // charges an attempt, so each would start a suspect's trial. One trial at a time: if one of
    // them crashes the process again, the others are not charged beside it.
    let mut r = running(3);
    assert_eq!(r.started().len(), 3);
    let old_kv = std::mem::take(&mut r.kv);
    let mut r2 = Rig::new(cfg("w1", 2));
    r2.kv = old_kv;
    r2.kv.watches.clear();
    r2.feed(Input::Start);
    r2.advance(Duration::from_millis(1500));
    let started = r2.started();
    assert_eq!(started.len(), 1, "one trial: {started:?}");
    let first = started[0].0.clone();
    assert_eq!(r2.kv.record(first.as_str()).attempts, 1);
    // It progresses: the trial is over, the next suspect is tried.
    r2.feed(Input::Commit { split: first.clone(), epoch: Epoch(2), progress: Bytes::from_static(b"p1") });
    r2.advance(Duration::from_millis(100));
    let started = r2.started();
    assert_eq!(started.len(), 2, "{started:?}");
    // The second never progresses: after a lease it counts as tried, and the last one starts.
    let tried = |r: &Rig| r.started().into_iter().map(|(s, _)| s).collect::<std::collections::BTreeSet<_>>();
    r2.advance(Duration::from_millis(1500));
    assert_eq!(tried(&r2).len(), 2, "still on trial");
    r2.advance(cfg("w1", 2).tuning.lease_duration);
    assert_eq!(tried(&r2).len(), 3, "{:?}", r2.started());
    // None was charged twice.
    for s in ["s0", "s1", "s2"] {
        assert!(r2.kv.record(s).attempts <= 1, "{s}: {:?}", r2.kv.record(s));
    }
}

#[test]
fn p12_a_suspects_trial_lasts_a_lease_from_its_lanes_start_not_from_its_claim() {
    // As above, three suspects reclaimed one at a time. The second one's claim is slow: its
    // writes wait 2 s for answers. Its trial runs a lease from when its lane starts, so a claim
    // that took long does not eat into the time the split gets to show it is healthy.
    let mut r = running(3);
    let old_kv = std::mem::take(&mut r.kv);
    let mut r2 = Rig::new(cfg("w1", 2));
    // The old incarnation's leases stay until reclaimed, however slow the reclaim.
    r2.expire = false;
    r2.kv = old_kv;
    r2.kv.watches.clear();
    r2.feed(Input::Start);
    r2.advance(Duration::from_millis(1500));
    let first = r2.started()[0].0.clone();
    r2.auto = false;
    r2.feed(Input::Commit { split: first, epoch: Epoch(2), progress: Bytes::from_static(b"p1") });
    assert_eq!(r2.pending.len(), 1, "the commit: {:?}", r2.pending);
    // The commit lands (the first trial is over) and the next reclaim begins.
    r2.apply_and_answer(0, None);
    assert!(!r2.pending.is_empty(), "the second reclaim's lease write");
    r2.advance(Duration::from_millis(1000));
    let tried = |r: &Rig| r.started().into_iter().map(|(s, _)| s).collect::<std::collections::BTreeSet<_>>();
    assert_eq!(tried(&r2).len(), 1, "the second claim waits for its answers");
    r2.auto = true;
    while !r2.pending.is_empty() {
        r2.apply_and_answer(0, None);
    }
    assert_eq!(tried(&r2).len(), 2, "{:?}", r2.started());
    let lane_start = r2.now;
    let lease = cfg("w1", 2).tuning.lease_duration;
    // A lease after the claim began (1 s before the lane started) the trial still runs; a lease
    // after the lane's start it is over, and the last suspect starts. (Time moves in steps of
    // a tenth of a heartbeat, so renewals go out as they would.)
    let step = |r: &mut Rig, d: Duration| {
        let until = r.now + d;
        while r.now < until {
            r.advance(Duration::from_millis(100));
        }
    };
    step(&mut r2, lease - Duration::from_millis(500));
    let since = r2.now.saturating_since(lane_start);
    assert_eq!(tried(&r2).len(), 2, "still on trial {since:?} after the lane started: {:?}", r2.started());
    step(&mut r2, Duration::from_millis(600));
    assert_eq!(tried(&r2).len(), 3, "{:?}", r2.started());
    assert_eq!(r2.started().len(), 3, "no lane stopped or resumed: {:?}", r2.started());
}

/// w2 started alone on splits of `weights`, running `budget` lanes (then frozen in the store).
fn frozen_holder(budget: u32, weights: &[u64]) -> Rig {
    let mut c2 = cfg("w2", 2);
    c2.tuning.max_in_flight = budget;
    let mut first = Rig::new(c2);
    first.plan = Some(weighted_plan(weights));
    first.feed(Input::Start);
    first
}

/// w1, asking first and with no claim backoff (a failed split is claimable at once), joins
/// `first`'s store while `first` stays frozen in it: its rig after its start.
fn join_asking_without_backoff(first: &mut Rig) -> Rig {
    let mut c1 = asker("w1", 1);
    c1.tuning.claim_backoff = Duration::ZERO;
    join_store(first, c1)
}

#[test]
fn p12_a_pending_steal_of_a_suspect_counts_as_its_trial() {
    // w2 (frozen) holds s0 and s1 (weight 10 each) and s2 (1); s1 is a suspect (attempts 1, no
    // progress since). w1 (asking first) claims s3 and asks for s1 (gap 20: the split of weight
    // nearest 10 from below, the highest id first). While it waits, w2's lane fails s2: a suspect free to claim. One trial
    // at a time: w1 does not claim s2 beside the steal of a suspect.
    let mut first = frozen_holder(3, &[10, 10, 1, 1]);
    let held: Vec<String> = first.started().into_iter().map(|(s, _)| s.to_string()).collect();
    assert_eq!(held, ["s0", "s1", "s2"]);
    let mut suspect = first.kv.record("s1");
    suspect.attempts = 1;
    first.kv.put(Bucket::State, &keys::split(&sid("s1")), &suspect);
    let mut r = join_asking_without_backoff(&mut first);
    assert_eq!(acquisitions(&r), vec![("s3".into(), AcquisitionReason::Create)]);
    let asked: records::StealRequest = request_to(&mut r, "w2", "asked first");
    assert_eq!(asked.split, sid("s1"));
    // w2 fails s2 (its record first, then its lease).
    let failed = SplitRecord {
        owner: None,
        state: SplitState::Unleased,
        attempts: 1,
        last_end: Some(records::EndReason::Failed),
        ..r.kv.record("s2")
    };
    peer_put(&mut r, Bucket::State, &keys::split(&sid("s2")), &failed);
    peer_delete(&mut r, Bucket::Lease, &keys::split(&sid("s2")));
    r.advance(Duration::from_millis(100));
    assert_eq!(acquisitions(&r).len(), 1, "no second suspect beside the steal: {:?}", acquisitions(&r));
    assert!(r.kv.get(Bucket::Lease, "steal.w2").is_some(), "the steal still waits");
    // The steal ends (w2 refuses: it deletes the request): s2 may be tried now.
    peer_delete(&mut r, Bucket::Lease, &keys::steal(&id("w2")));
    r.advance(Duration::from_millis(100));
    assert_eq!(
        acquisitions(&r),
        vec![("s3".into(), AcquisitionReason::Create), ("s2".into(), AcquisitionReason::Released)]
    );
}

#[test]
fn p12_a_thief_withdraws_when_the_split_it_waits_for_turns_out_a_suspect_while_a_trial_runs() {
    // w1 asks w2 for one of its splits, no suspect as far as it sees, and meanwhile tries the
    // suspect s2 it claimed. Then the asked split's record shows attempts behind it (w1's view of it was behind): taking
    // it would be a second trial beside the first, so w1 withdraws.
    let mut first = frozen_holder(2, &[10, 10, 1]);
    let held: Vec<String> = first.started().into_iter().map(|(s, _)| s.to_string()).collect();
    assert_eq!(held, ["s0", "s1"]);
    let mut tried = first.kv.record("s2");
    tried.attempts = 1;
    tried.last_end = Some(records::EndReason::Failed);
    first.kv.put(Bucket::State, &keys::split(&sid("s2")), &tried);
    let mut r = join_asking_without_backoff(&mut first);
    assert_eq!(acquisitions(&r), vec![("s2".into(), AcquisitionReason::Create)]);
    let asked: records::StealRequest = request_to(&mut r, "w2", "asked");
    assert_eq!(r.kv.record(asked.split.as_str()).attempts, 0, "asked for a split that is no suspect");
    assert!(!r.events().iter().any(|e| matches!(e, Event::Handover { .. })));
    let mut seen_late = r.kv.record(asked.split.as_str());
    seen_late.attempts = 1;
    peer_put(&mut r, Bucket::State, &keys::split(&asked.split), &seen_late);
    r.advance(Duration::from_millis(10));
    assert_withdrawn_from(&mut r, "w2");
}

#[test]
fn p4_the_first_leader_bumps_the_term_then_plans_and_publishes() {
    let mut r = running(2);
    let head: records::PlanHead =
        records::decode(&r.kv.get(Bucket::State, "plan.head").unwrap().value).unwrap();
    assert_eq!(head.term, 1);
    assert_eq!(head.status, records::PlanStatus::Published);
    let m = head.manifest.unwrap();
    assert_eq!((m.version, m.split_count, m.kind), (1, 2, PlanKind::Final));
    assert!(r.log.iter().any(|a| matches!(a, Action::Event(Event::Leadership { leader: true, term: 1 }))));
    assert!(r.log.iter().any(|a| matches!(a, Action::Plan { .. })));
}

#[test]
fn p4_a_deposed_leaders_publication_loses_its_swap() {
    // w1 becomes leader of term 1 and asks its planner; the answer is slow.
    let mut r = Rig::new(cfg("w1", 1));
    r.feed(Input::Start);
    let request = r
        .log
        .iter()
        .find_map(|a| match a {
            Action::Plan { request } => Some(*request),
            _ => None,
        })
        .expect("the leader asked for a plan");
    // Meanwhile w2 takes over and bumps the term (w1 was paused past its lease).
    let mut head: records::PlanHead =
        records::decode(&r.kv.get(Bucket::State, "plan.head").unwrap().value).unwrap();
    assert_eq!(head.term, 1);
    head.term = 2;
    head.leader = Owner { instance: id("w2"), incarnation: Incarnation(2) };
    r.kv.put(Bucket::State, &keys::plan_head(), &head);
    r.take_log();
    r.feed(Input::PlanReady { request, result: Ok(plan(2, PlanKind::Final)) });
    let stored: records::PlanHead =
        records::decode(&r.kv.get(Bucket::State, "plan.head").unwrap().value).unwrap();
    assert_eq!(
        (stored.status, stored.manifest),
        (records::PlanStatus::Planning, None),
        "I9: nothing published"
    );
    assert!(stored.term >= 2);
    assert!(r.log.contains(&Action::Event(Event::Leadership { leader: false, term: 1 })), "{:?}", r.log);
    assert!(r.started().is_empty());
}

/// P4: a plan whose descriptor would not fit in a stored value is a planning error naming the
/// split, its size and what to change, before anything of it is written (it used to fail every
/// leader on the store's value limit, naming nothing).
#[test]
fn p4_a_descriptor_above_the_limit_fails_the_plan_naming_the_split_and_writes_nothing() {
    let mut r = Rig::new(cfg("w1", 1));
    r.feed(Input::Start);
    let request = r
        .log
        .iter()
        .find_map(|a| match a {
            Action::Plan { request } => Some(*request),
            _ => None,
        })
        .expect("the leader asked for a plan");
    let mut big = plan(3, PlanKind::Final);
    big.splits[1].descriptor = Bytes::from(vec![b'x'; records::MAX_DESCRIPTOR_LEN + 1]);
    let before = r.kv.list(Bucket::State, &Prefix::all()).len();
    r.feed(Input::PlanReady { request, result: Ok(big) });
    let error = r
        .events()
        .into_iter()
        .find_map(|e| match e {
            Event::PlanFailed { error } => Some(error),
            _ => None,
        })
        .expect("a planning error");
    let size = (records::MAX_DESCRIPTOR_LEN + 1).to_string();
    assert!(
        error.contains("split s1") && error.contains(&size) && error.contains("smaller splits"),
        "{error}"
    );
    assert_eq!(r.kv.list(Bucket::State, &Prefix::all()).len(), before, "no descriptor, no record written");
    // At the limit it is stored and run.
    let mut at = plan(3, PlanKind::Final);
    at.splits[1].descriptor = Bytes::from(vec![b'x'; records::MAX_DESCRIPTOR_LEN]);
    let mut r = Rig::new(cfg("w1", 1));
    r.plan = Some(at);
    r.feed(Input::Start);
    assert_eq!(r.started().len(), 3, "a descriptor at the limit is stored and run");
}

/// w1 leads, then its renewals go unanswered: it steps down with the key still naming it, tries
/// to take it back by CAS, and that CAS's answer is lost. Returns the rig, the read resolving
/// the CAS (unanswered), and the key's revision (the one the CAS expects).
fn deposed_leader_resolving() -> (Rig, OpId, Revision) {
    // w1 leads, then its renewals go unanswered: it steps down with the key still naming it.
    let mut r = running(1);
    r.auto = false;
    r.expire = false;
    let leader_rev = r.kv.get(Bucket::Lease, "leader").unwrap().revision;
    let is_leader_write = |q: &StoreRequest| matches!(q, StoreRequest::CompareAndSwap { key, .. } | StoreRequest::Create { key, .. } if key.as_str() == "leader");
    let mut stepped_down = false;
    for _ in 0..8 {
        r.advance(Duration::from_millis(500));
        stepped_down |=
            r.log.iter().any(|a| matches!(a, Action::Event(Event::Leadership { leader: false, .. })));
        if stepped_down {
            break;
        }
        for (op, _, _) in std::mem::take(&mut r.pending) {
            r.answer(op, Err(StoreError::Unavailable("down".into())));
        }
    }
    assert!(stepped_down, "{:?}", r.log);
    for (op, _, _) in std::mem::take(&mut r.pending) {
        r.answer(op, Err(StoreError::Unavailable("down".into())));
    }
    // It tries to take the key back by CAS; the answer is lost, so it reads the key.
    let mut attempt = None;
    for _ in 0..4 {
        attempt = r
            .pending
            .iter()
            .find(|(_, b, q)| *b == Bucket::Lease && is_leader_write(q))
            .map(|(op, _, _)| *op);
        if attempt.is_some() {
            break;
        }
        r.advance(Duration::from_millis(500));
    }
    let op = attempt.expect("a new attempt at the leader key");
    let a = r.answer(op, Err(StoreError::Indeterminate("no answer".into())));
    let read = op_of(&a, 0);
    (r, read, leader_rev)
}

/// The lease watch shows the leader key expire at `revision`.
fn leader_key_expires(r: &mut Rig, revision: Revision) {
    let event = WatchEvent::Delete { key: keys::leader(), revision, cause: DeleteCause::Expired };
    r.feed(Input::Watch { watch: WatchId::Leases, event });
}

#[test]
fn p4_a_read_of_the_leader_key_older_than_one_seen_makes_nobody_leader() {
    let (mut r, read, leader_rev) = deposed_leader_resolving();
    // Meanwhile its watch shows the key expire and a peer take it.
    let w2 = LeaderRecord { owner: Owner { instance: id("w2"), incarnation: Incarnation(2) }, term: 0 };
    leader_key_expires(&mut r, Revision(leader_rev.0 + 100));
    r.feed(Input::Watch {
        watch: WatchId::Leases,
        event: WatchEvent::Put(Entry {
            key: keys::leader(),
            value: records::encode(&w2),
            revision: Revision(leader_rev.0 + 101),
        }),
    });
    r.take_log();
    // A lagging replica answers the read with the old key, still naming w1: that decides nothing.
    let mine = LeaderRecord { owner: Owner { instance: id("w1"), incarnation: Incarnation(1) }, term: 0 };
    let stale = Entry { key: keys::leader(), value: records::encode(&mine), revision: leader_rev };
    r.answer(read, Ok(StoreReply::Value(Some(stale))));
    r.advance(Duration::from_millis(100));
    let bumps =
        r.pending.iter().filter(|(_, _, q)| matches!(q, StoreRequest::CompareAndSwap { key, .. } | StoreRequest::Create { key, .. } if key.as_str() == "plan.head")).count();
    assert_eq!(bumps, 0, "no term bump: {:?}", r.pending);
    assert!(
        !r.log.iter().any(|a| matches!(a, Action::Event(Event::Leadership { leader: true, .. }))),
        "{:?}",
        r.log
    );
}

#[test]
fn p4_a_read_of_our_expired_leader_key_from_a_lagging_replica_does_not_hide_the_expiry() {
    let (mut r, read, leader_rev) = deposed_leader_resolving();
    // Meanwhile its watch shows the key expire; nobody has taken it yet.
    leader_key_expires(&mut r, Revision(leader_rev.0 + 100));
    // A lagging replica answers the read with the expired key, still naming w1.
    let mine = LeaderRecord { owner: Owner { instance: id("w1"), incarnation: Incarnation(1) }, term: 0 };
    let stale = Entry { key: keys::leader(), value: records::encode(&mine), revision: leader_rev };
    r.answer(read, Ok(StoreReply::Value(Some(stale))));
    // The next attempt creates the key (it is gone), rather than re-taking a revision that no
    // longer exists (a CAS that can only be refused, round after round).
    let mut attempt = None;
    for _ in 0..4 {
        r.advance(Duration::from_millis(500));
        for (op, bucket, req) in std::mem::take(&mut r.pending) {
            match &req {
                StoreRequest::Create { key, .. } | StoreRequest::CompareAndSwap { key, .. }
                    if bucket == Bucket::Lease && key.as_str() == "leader" =>
                {
                    attempt.get_or_insert(req.clone());
                }
                _ => {
                    r.answer_applied(op, bucket, &req);
                }
            }
        }
        if attempt.is_some() {
            break;
        }
    }
    assert!(matches!(attempt, Some(StoreRequest::Create { .. })), "{attempt:?}");
}

fn plan_request(r: &Rig) -> u64 {
    r.log
        .iter()
        .find_map(|a| match a {
            Action::Plan { request } => Some(*request),
            _ => None,
        })
        .expect("the leader asked for a plan")
}

#[test]
fn p4_garbage_collection_deletes_only_orphans_from_before_the_leaders_term() {
    let mut r = Rig::new(cfg("w1", 1));
    // An orphan of an earlier term: never published, never owned.
    r.kv.put(Bucket::State, &keys::split(&sid("old")), &SplitRecord::new());
    r.feed(Input::Start);
    let request = plan_request(&r);
    // A never-owned record that appeared after our term began: only a newer leader writes
    // one, and it may be about to publish it (our view of the manifest may be old).
    r.kv.put(Bucket::State, &keys::split(&sid("new")), &SplitRecord::new());
    let entry = r.kv.get(Bucket::State, "split.new").unwrap();
    r.feed(Input::Watch { watch: WatchId::Splits, event: WatchEvent::Put(entry) });
    r.feed(Input::PlanReady { request, result: Ok(plan(1, PlanKind::Final)) });
    assert!(r.kv.get(Bucket::State, "split.s0").is_some());
    assert!(r.kv.get(Bucket::State, "split.old").is_none(), "the old orphan is collected");
    assert!(r.kv.get(Bucket::State, "split.new").is_some(), "a record of a newer term is not");
}

#[test]
fn p4_a_round_touches_an_existing_never_owned_record_before_publishing_it() {
    let mut r = Rig::new(cfg("w1", 1));
    // s0 exists already: an orphan of an earlier round, which a deposed leader's collection
    // could delete (by its revision) while we publish a manifest naming it.
    let before = r.kv.put(Bucket::State, &keys::split(&sid("s0")), &SplitRecord::new());
    r.plan = Some(plan(1, PlanKind::Final));
    r.feed(Input::Start);
    let history = &r.kv.history;
    let touch = history.iter().position(|(_, q)| {
        matches!(q, StoreRequest::CompareAndSwap { key, expected, value, .. }
            if key.as_str() == "split.s0" && *expected == before && *value == records::encode(&SplitRecord::new()))
    });
    let publish = history.iter().position(|(_, q)| {
        matches!(q, StoreRequest::CompareAndSwap { key, value, .. }
            if *key == keys::plan_head()
                && records::decode::<records::PlanHead>(value).unwrap().manifest.is_some())
    });
    let (touch, publish) = (touch.expect("the record was touched"), publish.expect("published"));
    assert!(touch < publish, "touched before the publication");
    // A deposed leader's guarded delete of the old revision now does nothing.
    let stale_delete = StoreRequest::Delete { key: keys::split(&sid("s0")), expected: before };
    assert!(r.kv.apply(Bucket::State, &stale_delete).0.is_err());
    assert!(r.kv.get(Bucket::State, "split.s0").is_some());
}

#[test]
fn p5_claims_up_to_the_fair_share_largest_weight_first() {
    let mut r = Rig::new(cfg("w1", 1));
    r.plan = Some(plan(6, PlanKind::Final));
    // A second live worker halves the fair share: ceil(6 / 2) = 3 (max_in_flight is 4).
    let other = PresenceRecord { incarnation: Incarnation(7), held: 0, capacity: 4 };
    r.kv.put(Bucket::Lease, &presence_key("w2"), &other);
    r.feed(Input::Start);
    let started: Vec<String> = r.started().iter().map(|(s, _)| s.to_string()).collect();
    assert_eq!(started, vec!["s5", "s4", "s3"]);
}

#[test]
fn p5_claim_is_lease_create_then_record_cas_with_epoch_plus_one() {
    let mut r = running(1);
    let rec = r.kv.record("s0");
    assert_eq!((rec.epoch, rec.state, rec.attempts), (Epoch(1), SplitState::Owned, 0));
    assert_eq!(rec.owner.unwrap().instance, id("w1"));
    let lease = lease_of(&mut r.kv, "s0").unwrap();
    assert_eq!(
        (lease.owner, lease.epoch),
        (Owner { instance: id("w1"), incarnation: Incarnation(1) }, Epoch(1))
    );
}

#[test]
fn p7_heartbeats_renew_every_held_lease_presence_and_leadership_at_a_third_of_the_lease() {
    let mut r = running(2);
    r.auto = false;
    let a = r.advance(Duration::from_secs(1));
    let renewed: Vec<String> = store_requests(&a)
        .into_iter()
        .filter_map(|(b, req)| match req {
            StoreRequest::CompareAndSwap { key, ttl, .. } if b == Bucket::Lease => {
                assert_eq!(ttl, Some(Duration::from_secs(3)));
                Some(key.to_string())
            }
            _ => None,
        })
        .collect();
    assert_eq!(renewed, vec!["worker.w1", "leader", "split.s0", "split.s1"]);
}

#[test]
fn p7_a_lease_deleted_at_a_newer_revision_revokes_the_lane() {
    let mut r = running(1);
    let lease_rev = r.kv.get(Bucket::Lease, "split.s0").unwrap().revision;
    r.take_log();
    let a = r.feed(Input::Watch {
        watch: WatchId::Leases,
        event: WatchEvent::Delete {
            key: keys::split(&sid("s0")),
            revision: Revision(lease_rev.0 + 100),
            cause: DeleteCause::Expired,
        },
    });
    assert!(
        a.contains(&Action::StopLane {
            split: sid("s0"),
            epoch: Epoch(1),
            reason: StopReason::Fenced,
            deadline: None
        }),
        "{a:?}"
    );
}

/// The expected revision of the split record CAS among `actions`.
fn record_cas_expected(actions: &[Action]) -> Revision {
    store_requests(actions)
        .into_iter()
        .find_map(|(b, q)| match q {
            StoreRequest::CompareAndSwap { key, expected, .. }
                if b == Bucket::State && key.as_str() == "split.s0" =>
            {
                Some(expected)
            }
            _ => None,
        })
        .expect("a record CAS")
}

#[test]
fn p8_a_commit_read_answered_by_a_lagging_replica_is_never_adopted() {
    let mut r = running(1);
    r.auto = false;
    let current = r.kv.get(Bucket::State, "split.s0").unwrap();
    let a = r.feed(Input::Commit { split: sid("s0"), epoch: Epoch(1), progress: Bytes::from_static(b"10") });
    assert_eq!(record_cas_expected(&a), current.revision);
    // The commit's answer is lost: the worker reads the record to decide...
    let a = r.answer(op_of(&a, 0), Err(StoreError::Indeterminate("no answer".into())));
    let read = op_of(&a, 0);
    r.pending.clear();
    // ... and a lagging replica answers with an older revision of a record that still names it.
    let mut older = r.kv.record("s0");
    older.progress = None;
    let stale = Entry {
        key: keys::split(&sid("s0")),
        value: records::encode(&older),
        revision: Revision(current.revision.0 - 1),
    };
    let a = r.answer(read, Ok(StoreReply::Value(Some(stale))));
    assert!(
        a.contains(&Action::CommitDone {
            split: sid("s0"),
            epoch: Epoch(1),
            outcome: CommitOutcome::Retryable
        }),
        "{a:?}"
    );
    // Nothing was adopted: the next commit is still fenced by our own last write.
    let a = r.feed(Input::Commit { split: sid("s0"), epoch: Epoch(1), progress: Bytes::from_static(b"10") });
    assert_eq!(record_cas_expected(&a), current.revision);
}

#[test]
fn p7_a_renewal_read_answered_by_a_lagging_replica_is_never_adopted() {
    let mut r = running(1);
    r.auto = false;
    let current = r.kv.get(Bucket::Lease, "split.s0").unwrap();
    let lease_cas = |a: &[Action]| {
        a.iter().find_map(|x| match x {
            Action::Store {
                op,
                bucket: Bucket::Lease,
                request: StoreRequest::CompareAndSwap { key, expected, .. },
            } if key.as_str() == "split.s0" => Some((*op, *expected)),
            _ => None,
        })
    };
    let a = r.advance(Duration::from_secs(1));
    let (op, expected) = lease_cas(&a).expect("the lease is renewed");
    assert_eq!(expected, current.revision);
    r.pending.clear();
    // The renewal's answer is lost; the resolving read comes from a replica that lags behind.
    let a = r.answer(op, Err(StoreError::Indeterminate("no answer".into())));
    let read = a
        .iter()
        .find_map(|x| match x {
            Action::Store { op, bucket: Bucket::Lease, request: StoreRequest::Get { key } }
                if key.as_str() == "split.s0" =>
            {
                Some(*op)
            }
            _ => None,
        })
        .expect("the lease is read");
    let stale = Entry { revision: Revision(current.revision.0 - 1), ..current.clone() };
    r.answer(read, Ok(StoreReply::Value(Some(stale))));
    // Nothing adopted: the next renewal is still against the revision the worker knows.
    let a = r.advance(Duration::from_secs(1));
    let (_, expected) = lease_cas(&a).expect("the lease is renewed again");
    assert_eq!(expected, current.revision);
}

#[test]
fn p10_an_end_read_answered_by_a_lagging_replica_is_never_adopted() {
    let mut r = running(1);
    r.auto = false;
    let current = r.kv.get(Bucket::State, "split.s0").unwrap();
    r.feed(Input::Drain);
    r.pending.clear();
    let a = r.feed(Input::LaneStopped { split: sid("s0"), epoch: Epoch(1) });
    assert_eq!(record_cas_expected(&a), current.revision, "the release is fenced by our last write");
    let a = r.answer(op_of(&a, 0), Err(StoreError::Indeterminate("no answer".into())));
    let read = op_of(&a, 0);
    r.pending.clear();
    let stale = Entry { revision: Revision(current.revision.0 - 1), ..current.clone() };
    r.answer(read, Ok(StoreReply::Value(Some(stale))));
    // The end is written again later, still against the revision the worker knows.
    let a = r.advance(Duration::from_secs(1));
    assert_eq!(record_cas_expected(&a), current.revision);
}

#[test]
fn p5_a_claim_read_answered_by_a_lagging_replica_is_never_adopted() {
    let mut r = starting_by_hand(1);
    // Answer everything in order (with watch events) until the claim's record CAS is sent.
    let (op, req) = until_request(&mut r, is_claim);
    let StoreRequest::CompareAndSwap { expected: base, .. } = req else { unreachable!() };
    // Its answer is lost; the resolving read comes from a replica that lags behind the base.
    let a = r.answer(op, Err(StoreError::Indeterminate("no answer".into())));
    let read = op_of(&a, 0);
    r.pending.clear();
    let older = Entry {
        key: keys::split(&sid("s0")),
        value: records::encode(&SplitRecord::new()),
        revision: Revision(base.0 - 1),
    };
    r.answer(read, Ok(StoreReply::Value(Some(older))));
    // The worker reads again rather than re-basing its claim on the older record.
    let a = r.advance(Duration::from_secs(1));
    let again = store_requests(&a).into_iter().any(|(b, q)| {
        b == Bucket::State && matches!(q, StoreRequest::Get { ref key } if key.as_str() == "split.s0")
    });
    let rebased = store_requests(&a).into_iter().any(|(b, q)| {
        b == Bucket::State && matches!(q, StoreRequest::CompareAndSwap { ref key, expected, .. } if key.as_str() == "split.s0" && expected < base)
    });
    assert!(again && !rebased, "{a:?}");
}

#[test]
fn p8_a_conflict_while_an_earlier_commit_of_ours_may_land_is_resolved_by_reading() {
    let mut r = running(1);
    r.auto = false;
    // A commit lands but its answer is lost, and so is the read that would have told.
    let a = r.feed(Input::Commit { split: sid("s0"), epoch: Epoch(1), progress: Bytes::from_static(b"10") });
    let (op, bucket, req) = r.pending.remove(0);
    assert_eq!(op, op_of(&a, 0));
    r.kv.apply(bucket, &req).0.expect("the commit lands");
    let a = r.answer(op, Err(StoreError::Indeterminate("no answer".into())));
    let a = r.answer(op_of(&a, 0), Err(StoreError::Unavailable("down".into())));
    assert!(a.contains(&Action::CommitDone {
        split: sid("s0"),
        epoch: Epoch(1),
        outcome: CommitOutcome::Retryable
    }));
    // The next commit conflicts with our own landed write: that is no loss; a read decides.
    let a = r.feed(Input::Commit { split: sid("s0"), epoch: Epoch(1), progress: Bytes::from_static(b"20") });
    let a = r.apply(op_of(&a, 0));
    assert!(
        !a.iter().any(|x| matches!(
            x,
            Action::StopLane { .. } | Action::CommitDone { outcome: CommitOutcome::Lost, .. }
        )),
        "{a:?}"
    );
    let a = r.apply(op_of(&a, 0));
    assert!(
        a.contains(&Action::CommitDone {
            split: sid("s0"),
            epoch: Epoch(1),
            outcome: CommitOutcome::Retryable
        }),
        "{a:?}"
    );
    // The worker adopted its own landed write: the retried commit is fenced by it and lands.
    let a = r.feed(Input::Commit { split: sid("s0"), epoch: Epoch(1), progress: Bytes::from_static(b"20") });
    let a = r.apply(op_of(&a, 0));
    assert!(
        a.contains(&Action::CommitDone { split: sid("s0"), epoch: Epoch(1), outcome: CommitOutcome::Ok }),
        "{a:?}"
    );
    assert_eq!(r.kv.record("s0").progress.as_deref(), Some(&b"20"[..]));
}

#[test]
fn p8_a_commit_not_landed_yet_stays_in_doubt_so_a_conflict_on_its_retry_is_no_loss() {
    let mut r = running(1);
    r.auto = false;
    // A commit's answer times out; the write is still pending (a stream leader cut off from its
    // followers holds it) and the read shows the record unchanged.
    let a = r.feed(Input::Commit { split: sid("s0"), epoch: Epoch(1), progress: Bytes::from_static(b"10") });
    let (op, bucket, first) = r.pending.remove(0);
    assert_eq!(op, op_of(&a, 0));
    let a = r.answer(op, Err(StoreError::Indeterminate("no acknowledgement".into())));
    let a = r.apply(op_of(&a, 0));
    assert!(
        a.contains(&Action::CommitDone {
            split: sid("s0"),
            epoch: Epoch(1),
            outcome: CommitOutcome::Retryable
        }),
        "{a:?}"
    );
    // The retry is refused because of the pending write (docs/NATS.md: the leader checks the
    // expected revision against what it holds), and the record still reads unchanged: no loss.
    let a = r.feed(Input::Commit { split: sid("s0"), epoch: Epoch(1), progress: Bytes::from_static(b"20") });
    let retry = op_of(&a, 0);
    r.pending.retain(|(o, _, _)| *o != retry);
    let a = r.answer(retry, Err(StoreError::RevisionMismatch(keys::split(&sid("s0")))));
    let lost = |a: &[Action]| {
        a.iter().any(|x| {
            matches!(x, Action::StopLane { .. } | Action::CommitDone { outcome: CommitOutcome::Lost, .. })
        })
    };
    assert!(!lost(&a), "{a:?}");
    let a = r.apply(op_of(&a, 0));
    assert!(!lost(&a), "{a:?}");
    assert!(
        a.contains(&Action::CommitDone {
            split: sid("s0"),
            epoch: Epoch(1),
            outcome: CommitOutcome::Retryable
        }),
        "{a:?}"
    );
    // Then the first write lands after all: the next commit conflicts with it, a read adopts it,
    // and the commit after that lands on top of it.
    r.kv.apply(bucket, &first).0.expect("the first commit lands late");
    let a = r.feed(Input::Commit { split: sid("s0"), epoch: Epoch(1), progress: Bytes::from_static(b"20") });
    let a = r.apply(op_of(&a, 0));
    assert!(!lost(&a), "{a:?}");
    let a = r.apply(op_of(&a, 0));
    assert!(
        a.contains(&Action::CommitDone {
            split: sid("s0"),
            epoch: Epoch(1),
            outcome: CommitOutcome::Retryable
        }),
        "{a:?}"
    );
    let a = r.feed(Input::Commit { split: sid("s0"), epoch: Epoch(1), progress: Bytes::from_static(b"20") });
    let a = r.apply(op_of(&a, 0));
    assert!(
        a.contains(&Action::CommitDone { split: sid("s0"), epoch: Epoch(1), outcome: CommitOutcome::Ok }),
        "{a:?}"
    );
    assert_eq!(r.kv.record("s0").progress.as_deref(), Some(&b"20"[..]));
}

#[test]
fn p8_commits_cas_against_our_own_last_write_and_a_lost_swap_stops_the_lane_at_once() {
    let mut r = running(1);
    r.auto = false;
    let rev = r.kv.get(Bucket::State, "split.s0").unwrap().revision;
    let a = r.feed(Input::Commit { split: sid("s0"), epoch: Epoch(1), progress: Bytes::from_static(b"10") });
    let reqs = store_requests(&a);
    let [(Bucket::State, StoreRequest::CompareAndSwap { expected, .. })] = reqs.as_slice() else {
        panic!("{a:?}")
    };
    assert_eq!(*expected, rev);
    let a = r.apply(op_of(&a, 0));
    assert_eq!(a, vec![Action::CommitDone { split: sid("s0"), epoch: Epoch(1), outcome: CommitOutcome::Ok }]);
    // Someone else takes the split over (epoch 2): our next commit loses and nothing is written.
    let mut stolen = r.kv.record("s0");
    stolen.epoch = Epoch(2);
    stolen.owner = Some(Owner { instance: id("w9"), incarnation: Incarnation(9) });
    r.kv.put(Bucket::State, &keys::split(&sid("s0")), &stolen);
    let a = r.feed(Input::Commit { split: sid("s0"), epoch: Epoch(1), progress: Bytes::from_static(b"20") });
    // None of our writes is in doubt, so the mismatch is final: no read (which a lagging replica
    // could answer with our own old record) decides it.
    let a = r.apply(op_of(&a, 0));
    assert!(
        a.contains(&Action::CommitDone { split: sid("s0"), epoch: Epoch(1), outcome: CommitOutcome::Lost }),
        "{a:?}"
    );
    assert!(a.contains(&Action::StopLane {
        split: sid("s0"),
        epoch: Epoch(1),
        reason: StopReason::Fenced,
        deadline: None
    }));
    assert_eq!(
        r.kv.record("s0").progress.as_deref(),
        Some(&b"10"[..]),
        "the new owner's record is untouched"
    );
}

#[test]
fn p8_an_in_doubt_commit_is_resolved_by_reading_before_anything_else() {
    let mut r = running(1);
    r.auto = false;
    let a = r.feed(Input::Commit { split: sid("s0"), epoch: Epoch(1), progress: Bytes::from_static(b"10") });
    let op = op_of(&a, 0);
    // The write lands, but the answer is lost.
    let (bucket, req) = store_requests(&a).remove(0);
    r.pending.clear();
    let _ = r.kv.apply(bucket, &req);
    let a = r.answer(op, Err(StoreError::Indeterminate("timeout".into())));
    assert_eq!(store_requests(&a), vec![(Bucket::State, StoreRequest::Get { key: keys::split(&sid("s0")) })]);
    let a = r.apply(op_of(&a, 0));
    assert_eq!(a, vec![Action::CommitDone { split: sid("s0"), epoch: Epoch(1), outcome: CommitOutcome::Ok }]);
    // And the next commit is fenced on the revision of that landed write.
    let rev = r.kv.get(Bucket::State, "split.s0").unwrap().revision;
    let a = r.feed(Input::Commit { split: sid("s0"), epoch: Epoch(1), progress: Bytes::from_static(b"20") });
    let reqs = store_requests(&a);
    let [(_, StoreRequest::CompareAndSwap { expected, .. })] = reqs.as_slice() else { panic!("{a:?}") };
    assert_eq!(*expected, rev);
}

#[test]
fn p10_drain_stops_lanes_releases_without_attempts_and_leaves() {
    let mut r = running(2);
    r.take_log();
    r.feed(Input::Drain);
    let stops = r
        .log
        .iter()
        .filter(|a| matches!(a, Action::StopLane { reason: StopReason::Draining, deadline: Some(_), .. }))
        .count();
    assert_eq!(stops, 2);
    for s in ["s0", "s1"] {
        r.feed(Input::LaneStopped { split: sid(s), epoch: Epoch(1) });
    }
    for s in ["s0", "s1"] {
        let rec = r.kv.record(s);
        assert_eq!((rec.state, rec.attempts, rec.owner.clone()), (SplitState::Unleased, 0, None), "{s}");
        assert!(lease_of(&mut r.kv, s).is_none(), "lease of {s} deleted so peers claim at once");
    }
    assert!(r.kv.get(Bucket::Lease, "worker.w1").is_none(), "presence removed");
    assert!(r.kv.get(Bucket::Lease, "leader").is_none(), "leadership handed back");
    assert!(r.log.contains(&Action::Finished(Outcome::Drained)));
}

#[test]
fn p11_a_lease_without_a_successful_renewal_for_a_lease_duration_starves_its_lane() {
    let mut r = running(1);
    r.auto = false;
    r.expire = false;
    // The store stops answering: every renewal fails (and no watch event arrives either).
    let mut stopped = None;
    for _ in 0..6 {
        let a = r.advance(Duration::from_millis(500));
        for (op, _, _) in std::mem::take(&mut r.pending) {
            r.answer(op, Err(StoreError::Unavailable("down".into())));
        }
        if let Some(Action::StopLane { reason, .. }) = a.iter().find(|x| matches!(x, Action::StopLane { .. }))
        {
            stopped = Some((*reason, r.now));
            break;
        }
    }
    let (reason, at) = stopped.expect("the lane was stopped");
    assert_eq!(reason, StopReason::Starved);
    assert!(at >= Timestamp::ZERO + Duration::from_millis(2850) - Duration::from_millis(500), "{at:?}");
    assert!(at <= Timestamp::ZERO + Duration::from_secs(3), "{at:?}");
}

#[test]
fn p11_a_draining_lane_whose_lease_is_not_renewed_is_starved_and_its_split_released() {
    let mut c = cfg("w1", 1);
    c.tuning.drain_timeout = Duration::from_secs(30);
    let mut r = Rig::new(c);
    r.plan = Some(plan(1, PlanKind::Final));
    r.feed(Input::Start);
    r.auto = false;
    r.expire = false;
    let a = r.feed(Input::Drain);
    assert!(
        a.iter()
            .any(|x| matches!(x, Action::StopLane { reason: StopReason::Draining, deadline: Some(_), .. }))
    );
    // The store stops answering renewals; the lane keeps draining (a long batch, say).
    let mut starved = None;
    let mut release = None;
    for _ in 0..12 {
        let a = r.advance(Duration::from_millis(500));
        if a.iter().any(|x| matches!(x, Action::StopLane { reason: StopReason::Starved, deadline: None, .. }))
        {
            starved = Some(r.now);
            release = store_requests(&a).into_iter().find_map(|(b, q)| match q {
                StoreRequest::CompareAndSwap { key, value, .. }
                    if b == Bucket::State && key.as_str() == "split.s0" =>
                {
                    Some(records::decode::<SplitRecord>(&value).unwrap())
                }
                _ => None,
            });
            break;
        }
        for (op, _, _) in std::mem::take(&mut r.pending) {
            r.answer(op, Err(StoreError::Unavailable("down".into())));
        }
    }
    let at = starved.expect("the draining lane was starved");
    assert!(
        at <= Timestamp::ZERO + Duration::from_secs(3),
        "within a lease, not at the drain deadline: {at:?}"
    );
    let release = release.expect("the split is released at once");
    assert_eq!((release.state, release.owner, release.attempts), (SplitState::Unleased, None, 0));
}

#[test]
fn p10_a_lane_past_its_drain_deadline_is_told_to_stop_at_once_and_its_split_released() {
    let mut c = cfg("w1", 1);
    c.tuning.drain_timeout = Duration::from_secs(1);
    let mut r = Rig::new(c);
    r.plan = Some(plan(1, PlanKind::Final));
    r.feed(Input::Start);
    r.take_log();
    r.feed(Input::Drain);
    // The lane never acknowledges the stop.
    r.advance(Duration::from_millis(1100));
    assert!(
        r.log
            .iter()
            .any(|x| matches!(x, Action::StopLane { reason: StopReason::Draining, deadline: None, .. })),
        "{:?}",
        r.log
    );
    let rec = r.kv.record("s0");
    assert_eq!((rec.state, rec.owner, rec.attempts), (SplitState::Unleased, None, 0));
    assert!(lease_of(&mut r.kv, "s0").is_none());
}

/// A single worker runs s0; the store stops answering until the lane starves, then comes back:
/// the next renewal lands and the tenancy tries to resume by moving its lease to epoch 2 by CAS.
/// Returns the rig and that CAS, taken out of `pending` unanswered.
fn starved_then_resuming() -> (Rig, OpId, StoreRequest) {
    let mut r = running(1);
    r.auto = false;
    r.expire = false;
    // The store stops answering until the lane starves.
    let mut starved = false;
    for _ in 0..12 {
        let a = r.advance(Duration::from_millis(500));
        starved |= a.iter().any(|x| matches!(x, Action::StopLane { reason: StopReason::Starved, .. }));
        if starved {
            break;
        }
        for (op, _, _) in std::mem::take(&mut r.pending) {
            r.answer(op, Err(StoreError::Unavailable("down".into())));
        }
    }
    assert!(starved, "the lane starved");
    let mut resume_cas = None;
    for _ in 0..8 {
        r.advance(Duration::from_millis(500));
        for (op, bucket, req) in std::mem::take(&mut r.pending) {
            let a = r.answer_applied(op, bucket, &req);
            resume_cas = resume_cas.or_else(|| {
                a.iter().find_map(|x| match x {
                    Action::Store {
                        op,
                        bucket: Bucket::Lease,
                        request: StoreRequest::CompareAndSwap { key, value, .. },
                    } if key.as_str() == "split.s0"
                        && records::decode::<records::LeaseRecord>(value).unwrap().epoch == Epoch(2) =>
                    {
                        Some(*op)
                    }
                    _ => None,
                })
            });
        }
        if resume_cas.is_some() {
            break;
        }
    }
    let op = resume_cas.expect("the tenancy tried to resume under epoch 2");
    let i = r.pending.iter().position(|(o, _, _)| *o == op).expect("pending");
    let (op, _, req) = r.pending.remove(i);
    (r, op, req)
}

#[test]
fn p11_a_starved_tenancy_that_cannot_resume_releases_its_record_instead_of_leaving_it_owned() {
    // The resume's lease CAS loses (someone else wrote the lease meanwhile).
    let (mut r, op, _) = starved_then_resuming();
    let a =
        r.feed(Input::StoreResult { op, result: Err(StoreError::RevisionMismatch(keys::split(&sid("s0")))) });
    let release = store_requests(&a).into_iter().find_map(|(b, q)| match q {
        StoreRequest::CompareAndSwap { key, value, .. }
            if b == Bucket::State && key.as_str() == "split.s0" =>
        {
            Some(records::decode::<SplitRecord>(&value).unwrap())
        }
        _ => None,
    });
    let release = release.expect("the record is released, not left owned without a lease");
    assert_eq!(
        (release.state, release.owner, release.epoch, release.attempts),
        (SplitState::Unleased, None, Epoch(1), 0)
    );
}

#[test]
fn p12_failures_consume_attempts_and_quarantine_exactly_at_the_cap() {
    let mut r = running(1);
    r.feed(Input::Fail { split: sid("s0"), epoch: Epoch(1), error: "bad row".into(), unprocessable: false });
    let rec = r.kv.record("s0");
    assert_eq!(rec.attempts, 1);
    assert_eq!(rec.last_error.as_deref(), Some("bad row"));
    assert!(r.events().iter().any(|e| matches!(
        e,
        Event::Failed { attempts: 1, retry_in, .. } if *retry_in == Duration::from_secs(15)
    )));
    // It went back to the queue and is offered again after its backoff (to this worker, the
    // only one): it fails again, and max_attempts is 2.
    r.advance(Duration::from_secs(15));
    let (split, epoch) = r.started().last().cloned().unwrap();
    assert_eq!((split.as_str(), epoch), ("s0", Epoch(2)));
    r.feed(Input::Fail { split: sid("s0"), epoch: Epoch(2), error: "still bad".into(), unprocessable: true });
    let rec = r.kv.record("s0");
    assert_eq!((rec.state, rec.attempts), (SplitState::Quarantined, 2));
    assert_eq!(r.started().len(), 2, "never re-offered");
    // P13: a bounded job with a quarantined split ends Stalled, naming it and its error.
    let outcome = r.log.iter().find_map(|a| match a {
        Action::Finished(o) => Some(o.clone()),
        _ => None,
    });
    assert_eq!(outcome, Some(Outcome::Stalled { quarantined: vec![(sid("s0"), Some("still bad".into()))] }));
}

/// Advances `r` a second at a time until `split` is started again (at most `limit`); returns
/// how long that took.
fn seconds_until_restarted(r: &mut Rig, split: &str, limit: u64) -> Option<u64> {
    let before = r.started().iter().filter(|(s, _)| s.as_str() == split).count();
    for t in 1..=limit {
        r.advance(Duration::from_secs(1));
        if r.started().iter().filter(|(s, _)| s.as_str() == split).count() > before {
            return Some(t);
        }
    }
    None
}

#[test]
fn p12_a_failed_split_is_claimed_again_only_after_a_backoff_that_doubles_with_its_attempts() {
    let mut c = cfg("w1", 1);
    c.tuning.max_attempts = 4;
    c.tuning.claim_backoff = Duration::from_secs(5);
    let mut r = Rig::new(c);
    r.plan = Some(plan(2, PlanKind::Final));
    r.feed(Input::Start);
    assert_eq!(r.started().len(), 2);
    // A failure of s0 does not hold up s1, nor is s0 offered again at once (it used to be, and
    // four attempts were spent in milliseconds).
    r.feed(Input::Fail { split: sid("s0"), epoch: Epoch(1), error: "disk".into(), unprocessable: false });
    assert_eq!(r.started().len(), 2, "not offered again at once");
    assert_eq!(seconds_until_restarted(&mut r, "s0", 60), Some(5), "the first backoff is claim_backoff");
    let (_, epoch) = r.started().last().cloned().unwrap();
    r.feed(Input::Fail { split: sid("s0"), epoch, error: "disk".into(), unprocessable: false });
    assert_eq!(seconds_until_restarted(&mut r, "s0", 60), Some(10), "the second is twice as long");
    let (_, epoch) = r.started().last().cloned().unwrap();
    r.feed(Input::Fail { split: sid("s0"), epoch, error: "disk".into(), unprocessable: false });
    assert_eq!(seconds_until_restarted(&mut r, "s0", 60), Some(20));
    // A tenancy that committed progress clears the attempts: no backoff after its failure.
    let (_, epoch) = r.started().last().cloned().unwrap();
    r.feed(Input::Commit { split: sid("s0"), epoch, progress: Bytes::from_static(b"p1") });
    r.feed(Input::Fail { split: sid("s0"), epoch, error: "disk".into(), unprocessable: false });
    assert_eq!(r.kv.record("s0").attempts, 0);
    assert_eq!(r.started().last().map(|(s, _)| s.as_str().to_owned()), Some("s0".into()), "offered at once");
}

#[test]
fn p12_a_lane_that_gives_up_quarantines_its_split_at_once_and_keeps_its_progress() {
    let mut r = running(2);
    r.feed(Input::Commit { split: sid("s0"), epoch: Epoch(1), progress: Bytes::from_static(b"p1") });
    // A stale lane of an older epoch is ignored.
    r.feed(Input::Quarantine { split: sid("s0"), epoch: Epoch(0), error: "stale".into() });
    assert_eq!(r.kv.record("s0").state, SplitState::Owned);
    r.feed(Input::Quarantine { split: sid("s0"), epoch: Epoch(1), error: "too many bad records".into() });
    let rec = r.kv.record("s0");
    assert_eq!((rec.state, rec.attempts, rec.owner), (SplitState::Quarantined, 2, None));
    assert_eq!(rec.progress.as_deref(), Some(&b"p1"[..]));
    assert_eq!(rec.last_error.as_deref(), Some("too many bad records"));
    assert!(lease_of(&mut r.kv, "s0").is_none(), "the lease is given back");
    assert!(r.events().iter().any(|e| matches!(e, Event::Quarantined { attempts: 2, .. })));
    r.advance(Duration::from_secs(60));
    assert_eq!(r.started().iter().filter(|(s, _)| s.as_str() == "s0").count(), 1, "never offered again");
}

#[test]
fn p10_a_release_without_blame_charges_nothing_and_an_intake_cap_holds_claims_back() {
    let mut r = running(4);
    assert_eq!(r.started().len(), 4);
    // The embedding layer's breaker: intake paused, then a failed lane released without blame.
    r.feed(Input::Intake { limit: Some(0) });
    r.feed(Input::Release { split: sid("s0"), epoch: Epoch(1) });
    let rec = r.kv.record("s0");
    assert_eq!((rec.state, rec.attempts, rec.owner), (SplitState::Unleased, 0, None));
    assert_eq!(rec.last_end, Some(records::EndReason::Released));
    for _ in 0..30 {
        r.advance(Duration::from_secs(1));
    }
    assert_eq!(r.started().len(), 4, "not taken back while intake is paused");
    assert_eq!(r.w.held().count(), 3, "what it held is kept");
    // A cap at what it holds takes nothing; one more than it holds takes one (a probe).
    r.feed(Input::Intake { limit: Some(3) });
    r.advance(Duration::from_secs(1));
    assert_eq!(r.started().len(), 4);
    r.feed(Input::Intake { limit: Some(4) });
    assert_eq!(r.started().last().map(|(s, e)| (s.as_str().to_owned(), *e)), Some(("s0".into(), Epoch(2))));
    r.feed(Input::Intake { limit: None });
    assert_eq!(r.w.held().count(), 4);
}

#[test]
fn p12_the_end_of_a_claim_backoff_is_a_deadline_of_the_worker() {
    // Heartbeats every 20 s: only the backoff can wake the worker after 5 s.
    let mut c = cfg("w1", 1);
    c.tuning.lease_duration = Duration::from_secs(60);
    c.tuning.claim_backoff = Duration::from_secs(5);
    let mut r = Rig::new(c);
    r.plan = Some(plan(1, PlanKind::Final));
    r.feed(Input::Start);
    r.feed(Input::Fail { split: sid("s0"), epoch: Epoch(1), error: "disk".into(), unprocessable: false });
    assert_eq!(r.w.next_deadline(), Some(r.now + Duration::from_secs(5)));
    r.advance(Duration::from_secs(5));
    assert_eq!(r.started().len(), 2, "claimed when the backoff ended");
    assert!(r.w.next_deadline() > Some(r.now + Duration::from_secs(5)), "and the backoff's deadline is gone");
}

#[test]
fn p13_completion_is_observed_by_an_idle_standby() {
    // The standby joins a job whose every split is already Done.
    let mut r = running(2);
    for (s, e) in r.started() {
        r.feed(Input::Finish { split: s, epoch: e, progress: Bytes::from_static(b"end") });
    }
    assert!(r.log.contains(&Action::Finished(Outcome::Complete)));
    let kv = std::mem::take(&mut r.kv);
    let mut standby = Rig::new(cfg("w2", 5));
    standby.kv = kv;
    standby.kv.watches.clear();
    standby.feed(Input::Start);
    assert!(standby.started().is_empty());
    assert!(standby.log.contains(&Action::Finished(Outcome::Complete)), "{:?}", standby.log);
}

/// Acquisitions in `r`'s log, in order.
fn acquisitions(r: &Rig) -> Vec<(String, AcquisitionReason)> {
    r.log
        .iter()
        .filter_map(|a| match a {
            Action::Event(Event::Acquired { split, reason, .. }) => Some((split.to_string(), *reason)),
            _ => None,
        })
        .collect()
}

/// Steals started in `r`'s log: (split, victim, weight, (victim's load, thief's load)).
fn steals(r: &Rig) -> Vec<(String, String, u64, (u128, u128))> {
    r.log
        .iter()
        .filter_map(|a| match a {
            Action::Event(Event::Steal { split, victim, weight, loads }) => {
                Some((split.to_string(), victim.to_string(), *weight, *loads))
            }
            _ => None,
        })
        .collect()
}

/// A plan of splits `s0, s1, ...` weighing `weights`.
fn weighted_plan(weights: &[u64]) -> Plan {
    let splits = weights
        .iter()
        .enumerate()
        .map(|(i, w)| PlannedSplit::new(sid(&format!("s{i}")), format!("d{i}"), *w));
    Plan::new(PlanKind::Final, splits.collect())
}

/// A worker whose steals take over at once (`handover_timeout` 0): the rules of choosing what
/// to steal, apart from asking.
fn taker(name: &str, incarnation: u64) -> Config {
    let mut c = cfg(name, incarnation);
    c.tuning.handover_timeout = Duration::ZERO;
    c
}

/// A worker whose steals ask first (`handover_timeout` 10 s).
fn asker(name: &str, incarnation: u64) -> Config {
    let mut c = cfg(name, incarnation);
    c.tuning.handover_timeout = Duration::from_secs(10);
    c
}

/// `first` starts alone on `plan` and claims what it may; `second` then joins the same store
/// while `first` stays frozen in it (its leases live): returns `second`'s rig after its start.
fn join_frozen(mut first: Rig, second: Config, plan: Plan) -> (Rig, Rig) {
    first.plan = Some(plan);
    first.feed(Input::Start);
    let r = join_store(&mut first, second);
    (first, r)
}

/// A worker of `cfg` starts on `first`'s store (taken from it), where `first`'s peers stay
/// frozen (nothing expires): its rig after its start.
fn join_store(first: &mut Rig, cfg: Config) -> Rig {
    let mut r = Rig::new(cfg);
    r.expire = false;
    r.kv = std::mem::take(&mut first.kv);
    r.kv.watches.clear();
    r.feed(Input::Start);
    r
}

#[test]
fn p9_steals_the_split_whose_move_lowers_the_imbalance_most_and_then_stops() {
    // w2 planned splits of weights 1, 2, 3, 4 and holds the 3 heaviest (its max_in_flight is
    // 3): load 9. w1 joins: fair share ceil(4 / 2) = 2; it claims s0 (load 1), then steals.
    let mut c2 = cfg("w2", 2);
    c2.tuning.max_in_flight = 3;
    let (w2, mut r) = join_frozen(Rig::new(c2), taker("w1", 1), plan(4, PlanKind::Final));
    assert_eq!(w2.started().len(), 3);
    // Gap 8: moving weight w gains w * (8 - w): s3 (4) gives 16, s2 (3) 15, s1 (2) 12. s3 it is,
    // and the loads end 5 and 5.
    assert_eq!(
        acquisitions(&r),
        vec![("s0".into(), AcquisitionReason::Create), ("s3".into(), AcquisitionReason::Stolen)]
    );
    assert_eq!(steals(&r), vec![("s3".into(), "w2".into(), 4, (9, 1))]);
    let rec = r.kv.record("s3");
    assert_eq!((rec.epoch, rec.attempts), (Epoch(2), 0), "a steal bumps the epoch and consumes no attempt");
    // 5 against 5: no further steal, however many cycles pass.
    r.take_log();
    for _ in 0..5 {
        r.advance(Duration::from_secs(1));
    }
    assert!(r.started().is_empty(), "{:?}", r.log);
}

#[test]
fn p9_of_a_victims_splits_the_one_nearest_half_the_gap_is_stolen() {
    // w2 holds 6 + 3 + 2 (max_in_flight 3); w1 holds 1: gap 10. Moving 6 gains 6 * (10 - 6) =
    // 24, moving 3 gains 3 * (10 - 3) = 21 (both take enough of the gap to be worth it): w1
    // takes the 6 (loads 5 and 7), then no move helps enough.
    let mut c2 = cfg("w2", 2);
    c2.tuning.max_in_flight = 3;
    let (_w2, mut r) = join_frozen(Rig::new(c2), taker("w1", 1), weighted_plan(&[6, 3, 2, 1]));
    for _ in 0..5 {
        r.advance(Duration::from_secs(1));
    }
    assert_eq!(steals(&r), vec![("s0".into(), "w2".into(), 6, (11, 1))]);
}

#[test]
fn p9_a_worker_at_its_share_of_the_count_steals_when_it_holds_less_weight() {
    // w2 holds the two heavy splits (10 + 10); w1 claims the two light ones (1 + 1): two
    // splits each, the count rule's balance, but loads 20 and 2. Moving 10 lowers the
    // imbalance (20 > 2 + 10): w1 steals one, and the loads end 10 and 12.
    let mut c2 = cfg("w2", 2);
    c2.tuning.max_in_flight = 2;
    let (_w2, mut r) = join_frozen(Rig::new(c2), taker("w1", 1), weighted_plan(&[10, 10, 1, 1]));
    let stolen: Vec<_> =
        acquisitions(&r).into_iter().filter(|(_, why)| *why == AcquisitionReason::Stolen).collect();
    assert_eq!(stolen, vec![("s0".into(), AcquisitionReason::Stolen)]);
    assert_eq!(steals(&r), vec![("s0".into(), "w2".into(), 10, (20, 2))]);
    r.take_log();
    for _ in 0..5 {
        r.advance(Duration::from_secs(1));
    }
    // 12 against 10: moving 10 back would not lower it (12 > 10 + 10 is false).
    assert!(steals(&r).is_empty(), "{:?}", r.log);
}

#[test]
fn p9_no_steal_when_every_move_would_only_shift_the_imbalance() {
    // w2 holds one split of weight 9; w1 holds one of weight 1 and has free lanes. Moving the 9
    // would leave 10 against 0: no move lowers the imbalance, so nothing is stolen.
    let mut c2 = cfg("w2", 2);
    c2.tuning.max_in_flight = 1;
    let (_w2, mut r) = join_frozen(Rig::new(c2), taker("w1", 1), weighted_plan(&[9, 1]));
    for _ in 0..5 {
        r.advance(Duration::from_secs(1));
    }
    assert!(steals(&r).is_empty(), "{:?}", r.log);
    assert_eq!(acquisitions(&r), vec![("s1".into(), AcquisitionReason::Create)]);
}

#[test]
fn p9_no_steal_when_a_move_would_only_swap_the_two_loads() {
    // w2 holds two splits of weight 1, w1 the third: 2 against 1. Moving one would leave 1
    // against 2, the same imbalance the other way round (`from > to + w` is false at equality):
    // such a move would be undone by the next one, for ever.
    let mut c2 = cfg("w2", 2);
    c2.tuning.max_in_flight = 2;
    let (_w2, mut r) = join_frozen(Rig::new(c2), taker("w1", 1), weighted_plan(&[1, 1, 1]));
    for _ in 0..5 {
        r.advance(Duration::from_secs(1));
    }
    assert!(steals(&r).is_empty(), "{:?}", steals(&r));
    assert_eq!(r.w.held().count(), 1);
}

#[test]
fn p9_an_idle_worker_takes_from_a_peer_holding_many_light_splits() {
    // w2 holds eight splits of weight 1; w1 holds nothing: gap 8, and each split is an eighth
    // of it. Every move with `load(a) > load(b) + w` is made, however small a part of the gap
    // it takes: w1 steals one per heartbeat until 4 against 4. (A threshold on the part of the
    // gap a move takes once left such an idle worker idle for good.)
    let mut c2 = cfg("w2", 2);
    c2.tuning.max_in_flight = 8;
    let (_w2, mut r) = join_frozen(Rig::new(c2), taker("w1", 1), weighted_plan(&[1; 8]));
    for _ in 0..12 {
        r.advance(Duration::from_secs(1));
    }
    assert_eq!(steals(&r).len(), 4, "{:?}", r.log);
    assert_eq!(r.w.held().count(), 4);
}

#[test]
fn p9_a_worker_without_a_free_lane_does_not_steal() {
    // w1 may run one lane and holds the light split; w2 holds 3 + 3.
    let mut c2 = cfg("w2", 2);
    c2.tuning.max_in_flight = 2;
    let mut c1 = taker("w1", 1);
    c1.tuning.max_in_flight = 1;
    let (_w2, mut r) = join_frozen(Rig::new(c2), c1, weighted_plan(&[3, 3, 1]));
    for _ in 0..5 {
        r.advance(Duration::from_secs(1));
    }
    assert!(steals(&r).is_empty(), "{:?}", r.log);
}

#[test]
fn p9_at_most_one_steal_per_heartbeat_cycle() {
    // w2 holds six splits of weight 1 (max_in_flight 6); w1 claims nothing (all held) and must
    // steal three to balance 3 against 3: one per heartbeat (1 s with a 3 s lease), however
    // many inputs arrive in between.
    let mut c2 = cfg("w2", 2);
    c2.tuning.max_in_flight = 6;
    let (_w2, mut r) = join_frozen(Rig::new(c2), taker("w1", 1), weighted_plan(&[1; 6]));
    let heartbeat = cfg("w1", 1).tuning.heartbeat_interval();
    let mut at = vec![];
    for _ in 0..40 {
        let before = steals(&r).len();
        r.advance(heartbeat / 10);
        if steals(&r).len() > before {
            at.push(r.now);
        }
    }
    let first = steals(&r);
    assert_eq!(first.len(), 3, "{first:?}");
    for pair in at.windows(2) {
        assert!(pair[1].saturating_since(pair[0]) >= heartbeat, "steals at {at:?}");
    }
    assert_eq!(r.w.held().count(), 3);
}

/// w3 (frozen, `budget3` lanes) and w2 (frozen, `budget2` lanes) share `splits` splits of
/// weight 1; w9 (live, holding nothing) has a request pending at `victim`; then w1, taking over
/// at once, joins: its rig after its start.
fn join_beside_a_request(budget3: u32, budget2: u32, splits: usize, victim: &str) -> Rig {
    let mut c3 = cfg("w3", 3);
    c3.tuning.max_in_flight = budget3;
    let mut c2 = taker("w2", 2);
    c2.tuning.max_in_flight = budget2;
    let (_w3, mut w2) = join_frozen(Rig::new(c3), c2, weighted_plan(&vec![1; splits]));
    assert_eq!(w2.w.held().count(), budget2 as usize);
    // (Which split it names does not matter to w1: the victim's key is taken.)
    let request = records::StealRequest {
        thief: Owner { instance: id("w9"), incarnation: Incarnation(9) },
        split: sid("s0"),
        epoch: Epoch(1),
        weight: 1,
        thief_load: 0,
        wait_ms: 2_000,
        write: 1,
    };
    w2.kv.put(
        Bucket::Lease,
        &presence_key("w9"),
        &PresenceRecord { incarnation: Incarnation(9), held: 0, capacity: 4 },
    );
    w2.kv.put(Bucket::Lease, &keys::steal(&id(victim)), &request);
    join_store(&mut w2, taker("w1", 1))
}

#[test]
fn p9_a_thief_waits_for_the_best_victim_busy_with_another_request_rather_than_take_less() {
    // w3 holds eight splits of weight 1, w2 three (its budget), w1 the last one. w1's best move
    // is from w3 (gap 7), but w9's request to w3 is pending: w1 waits for it to end rather than
    // take from w2 (gap 2), which is below its share itself and would steal the split back.
    let mut r = join_beside_a_request(8, 3, 12, "w3");
    assert_eq!(r.w.held().count(), 1, "{:?}", acquisitions(&r));
    let heartbeat = cfg("w1", 1).tuning.heartbeat_interval();
    r.advance(heartbeat * 3);
    assert!(steals(&r).is_empty(), "nothing taken from w2 while w3 is busy: {:?}", steals(&r));
    // The request ends: w1 takes its best move at once.
    peer_delete(&mut r, Bucket::Lease, &keys::steal(&id("w3")));
    r.advance(Duration::from_millis(10));
    let stolen = steals(&r);
    assert_eq!(stolen.len(), 1, "{stolen:?}");
    assert_eq!((stolen[0].1.as_str(), stolen[0].3), ("w3", (8, 1)));
}

#[test]
fn p9_of_two_equally_good_victims_a_thief_asks_the_one_no_other_thief_is_asking() {
    // w2 and w3 hold four splits of weight 1 each; w1 holds none: the same move from either.
    // w9 is asking w2 already (w2 wins the tie otherwise: the smaller id). w1 does not wait
    // for that request: it takes the equally good move from w3.
    let r = join_beside_a_request(4, 4, 8, "w2");
    let stolen = steals(&r);
    assert_eq!(stolen.len(), 1, "{stolen:?}");
    assert_eq!((stolen[0].1.as_str(), stolen[0].3), ("w3", (4, 0)));
}

#[test]
fn p5_a_small_pods_unused_share_goes_to_the_others() {
    // w2 may run one lane; w1 eight. Six splits: ceil(6 / 2) = 3 would leave two unclaimed
    // while w1 has free lanes; filled by capacity, w1's share is 5.
    let mut c2 = cfg("w2", 2);
    c2.tuning.max_in_flight = 1;
    let mut c1 = cfg("w1", 1);
    c1.tuning.max_in_flight = 8;
    let (_w2, r) = join_frozen(Rig::new(c2), c1, weighted_plan(&[1; 6]));
    assert_eq!(r.w.held().count(), 5, "{:?}", acquisitions(&r));
}

/// Deletes `key` from `r`'s store as a peer (or the store) would, at its current revision, and
/// delivers the delete on the worker's watches.
fn peer_delete(r: &mut Rig, bucket: Bucket, key: &Key) {
    let entry = r.kv.get(bucket, key.as_str()).unwrap_or_else(|| panic!("{key} is in the store"));
    let (result, events) =
        r.kv.apply(bucket, &StoreRequest::Delete { key: key.clone(), expected: entry.revision });
    result.unwrap();
    for (watch, event) in events {
        r.feed(Input::Watch { watch, event });
    }
}

/// Writes a peer's value into `r`'s store and delivers it on the lease watch, as a peer's write
/// arrives.
fn peer_put<T: serde::Serialize>(r: &mut Rig, bucket: Bucket, key: &Key, value: &T) -> Revision {
    let revision = r.kv.put(bucket, key, value);
    let watch = if bucket == Bucket::Lease { WatchId::Leases } else { WatchId::Splits };
    let entry = Entry { key: key.clone(), value: records::encode(value), revision };
    r.feed(Input::Watch { watch, event: WatchEvent::Put(entry) });
    revision
}

/// `thief` (incarnation 9) asks `r`'s worker for `split` at `epoch`, holding `thief_load`.
fn ask_for(r: &mut Rig, thief: &str, split: &str, epoch: Epoch, weight: u64, thief_load: u128) -> Revision {
    let request = records::StealRequest {
        thief: Owner { instance: id(thief), incarnation: Incarnation(9) },
        split: sid(split),
        epoch,
        weight,
        thief_load,
        wait_ms: 2_000,
        write: 1,
    };
    let victim = r.w.config().instance_id.clone();
    // The thief is live (its presence comes before its request, in the same bucket).
    peer_put(
        r,
        Bucket::Lease,
        &presence_key(thief),
        &PresenceRecord { incarnation: Incarnation(9), held: 0, capacity: 4 },
    );
    peer_put(r, Bucket::Lease, &keys::steal(&victim), &request)
}

fn running_weighted(weights: &[u64]) -> Rig {
    let mut r = Rig::new(cfg("w1", 1));
    r.plan = Some(weighted_plan(weights));
    r.feed(Input::Start);
    r
}

#[test]
fn p9_an_owner_asked_for_a_split_commits_it_and_releases_it_without_an_attempt() {
    // w1 holds 10 + 10; w3 holds nothing: moving 10 lowers the imbalance (20 > 0 + 10).
    let mut r = running_weighted(&[10, 10]);
    r.take_log();
    ask_for(&mut r, "w3", "s0", Epoch(1), 10, 0);
    let deadline = r.now + Duration::from_millis(1_000); // the thief's 2 s, within a third of the lease
    assert!(
        r.log.contains(&Action::StopLane {
            split: sid("s0"),
            epoch: Epoch(1),
            reason: StopReason::Draining,
            deadline: Some(deadline),
        }),
        "the lane stops at a safe point with the handover deadline: {:?}",
        r.log
    );
    assert!(r.events().contains(&Event::StealAsked { split: sid("s0"), thief: id("w3"), honoured: true }));
    // The lane commits its last progress and acknowledges: the split is released as drained.
    r.feed(Input::Commit { split: sid("s0"), epoch: Epoch(1), progress: Bytes::from_static(b"p7") });
    r.feed(Input::LaneStopped { split: sid("s0"), epoch: Epoch(1) });
    let rec = r.kv.record("s0");
    assert_eq!(rec.state, SplitState::Unleased);
    assert_eq!(
        (rec.attempts, rec.progress.as_deref()),
        (0, Some(&b"p7"[..])),
        "no attempt, final progress kept"
    );
    assert!(lease_of(&mut r.kv, "s0").is_none(), "the lease is deleted, so the thief can claim");
    // Reserved for w3 while its request lives: w1 does not take it back.
    r.advance(Duration::from_secs(1));
    assert!(!acquisitions(&r).iter().any(|(id, _)| id == "s0"), "{:?}", acquisitions(&r));
}

#[test]
fn p9_an_owner_refuses_a_request_that_would_not_lower_the_imbalance_or_names_an_old_tenancy() {
    let mut r = running_weighted(&[10, 10]);
    r.take_log();
    // 20 against 10 + 10: by the owner's own load the move would only swap the two loads (20
    // and 10 become 10 and 20: `from > to + w` is false at equality), so it would not help.
    let rev = ask_for(&mut r, "w3", "s0", Epoch(1), 10, 10);
    assert!(r.events().contains(&Event::StealAsked { split: sid("s0"), thief: id("w3"), honoured: false }));
    assert!(
        store_requests(&r.log).is_empty() || r.kv.get(Bucket::Lease, "steal.w1").is_none(),
        "the request is deleted"
    );
    assert!(r.kv.get(Bucket::Lease, "steal.w1").is_none(), "refused: deleted at revision {rev:?}");
    assert!(!r.log.iter().any(|a| matches!(a, Action::StopLane { .. })), "{:?}", r.log);
    // A request for a tenancy that is over (epoch 5 never was ours) is refused too.
    r.take_log();
    ask_for(&mut r, "w3", "s1", Epoch(5), 10, 0);
    assert!(r.kv.get(Bucket::Lease, "steal.w1").is_none());
    assert!(!r.log.iter().any(|a| matches!(a, Action::StopLane { .. })), "{:?}", r.log);
}

/// w2 (frozen, two lanes) holds two splits of weight 10; w1, asking first, joins and claims
/// the split of weight 1: its rig after its start (it has asked w2 for one of the tens).
fn asking_beside_two_tens() -> Rig {
    let mut c2 = cfg("w2", 2);
    c2.tuning.max_in_flight = 2;
    let (_w2, r) = join_frozen(Rig::new(c2), asker("w1", 1), weighted_plan(&[10, 10, 1]));
    r
}

/// The thief reported its steal from `victim` withdrawn and deleted its request.
fn assert_withdrawn_from(r: &mut Rig, victim: &str) {
    let events = r.events();
    let withdrawn = |e: &Event| matches!(e, Event::Handover { outcome: HandoverOutcome::Withdrawn, .. });
    assert!(events.iter().any(withdrawn), "{events:?}");
    assert!(r.kv.get(Bucket::Lease, &format!("steal.{victim}")).is_none(), "withdrawn: deleted");
}

/// The steal request pending at `victim` (`what` says why it must be there).
fn request_to(r: &mut Rig, victim: &str, what: &str) -> records::StealRequest {
    let entry = r.kv.get(Bucket::Lease, &format!("steal.{victim}")).expect(what);
    records::decode(&entry.value).unwrap()
}

#[test]
fn p9_a_thief_asks_first_and_takes_over_only_at_the_deadline() {
    // w2 (frozen) holds 10 + 10; w1 holds 1 and asks for one of the tens.
    let mut r = asking_beside_two_tens();
    let request: records::StealRequest = request_to(&mut r, "w2", "a request to w2");
    assert_eq!((request.split.as_str(), request.epoch, request.thief_load), ("s0", Epoch(1), 1));
    assert!(!acquisitions(&r).iter().any(|(_, why)| *why == AcquisitionReason::Stolen), "nothing taken yet");
    // The owner never answers: at the deadline (the wait and a heartbeat) the thief takes over.
    let tuning = asker("w1", 1).tuning;
    let wait = tuning.handover_wait().unwrap() + tuning.heartbeat_interval();
    r.advance(wait - Duration::from_millis(100));
    assert!(!acquisitions(&r).iter().any(|(_, why)| *why == AcquisitionReason::Stolen));
    r.advance(Duration::from_millis(100));
    assert!(acquisitions(&r).contains(&("s0".into(), AcquisitionReason::Stolen)), "{:?}", acquisitions(&r));
    assert!(r.events().iter().any(|e| matches!(
        e,
        Event::Handover { outcome: HandoverOutcome::Forced, from: Epoch(1), to: Some(Epoch(2)), .. }
    )));
    assert!(r.kv.get(Bucket::Lease, "steal.w2").is_none(), "the request is deleted once the steal ends");
}

#[test]
fn p12_no_steal_takes_a_split_from_an_owner_whose_process_is_gone() {
    // w2 holds three splits (load 9) and restarted: its presence names another incarnation,
    // its old leases live on until the new one reclaims them (charged, P12). w1 (load 1, taking
    // over at once) would steal s3 from a live w2; from a dead incarnation it takes nothing.
    let mut c2 = cfg("w2", 2);
    c2.tuning.max_in_flight = 3;
    let mut first = Rig::new(c2);
    first.plan = Some(plan(4, PlanKind::Final));
    first.feed(Input::Start);
    assert_eq!(first.started().len(), 3);
    let restarted = PresenceRecord { incarnation: Incarnation(77), held: 0, capacity: 3 };
    first.kv.put(Bucket::Lease, &presence_key("w2"), &restarted);
    let mut r = Rig::new(taker("w1", 1));
    r.expire = false;
    r.kv = std::mem::take(&mut first.kv);
    r.kv.watches.clear();
    r.feed(Input::Start);
    r.advance(cfg("w1", 1).tuning.heartbeat_interval() * 3);
    assert_eq!(acquisitions(&r), vec![("s0".into(), AcquisitionReason::Create)], "nothing stolen");
}

#[test]
fn p9_a_thief_withdraws_at_once_when_the_owner_asked_has_restarted_or_is_gone() {
    // w2 (frozen) holds 10 + 10; w1 asks for s0. w2 crashes and restarts (its presence names
    // another incarnation): nobody will answer. The thief does not wait for its deadline, and
    // does not take the split over uncharged either: the restarted w2's reclaim (or the lease's
    // expiry) charges the crash an attempt (P12).
    let mut r = asking_beside_two_tens();
    assert!(r.kv.get(Bucket::Lease, "steal.w2").is_some(), "asked first");
    r.advance(Duration::from_millis(100));
    assert!(!r.events().iter().any(|e| matches!(e, Event::Handover { .. })), "the owner is live");
    let restarted = PresenceRecord { incarnation: Incarnation(77), held: 0, capacity: 2 };
    peer_put(&mut r, Bucket::Lease, &presence_key("w2"), &restarted);
    r.advance(Duration::from_millis(10));
    assert_withdrawn_from(&mut r, "w2");
    // Nor is any other split of the dead incarnation stolen: its leases are left to the reclaim.
    r.advance(asker("w1", 1).tuning.heartbeat_interval() * 2);
    assert!(
        !acquisitions(&r).iter().any(|(_, why)| *why == AcquisitionReason::Stolen),
        "{:?}",
        acquisitions(&r)
    );
    assert!(r.kv.get(Bucket::Lease, "steal.w2").is_none(), "nothing asked of a dead process");

    // Same with the owner's presence gone (expired, deleted), not replaced.
    let mut r = asking_beside_two_tens();
    assert!(r.kv.get(Bucket::Lease, "steal.w2").is_some(), "asked first");
    let presence = r.kv.get(Bucket::Lease, "worker.w2").expect("w2 is present");
    let (result, events) = r
        .kv
        .apply(Bucket::Lease, &StoreRequest::Delete { key: presence_key("w2"), expected: presence.revision });
    result.unwrap();
    for (watch, event) in events {
        r.feed(Input::Watch { watch, event });
    }
    r.advance(Duration::from_millis(10));
    assert!(
        r.events().iter().any(|e| matches!(e, Event::Handover { outcome: HandoverOutcome::Withdrawn, .. })),
        "{:?}",
        r.events()
    );
    assert!(
        !acquisitions(&r).iter().any(|(_, why)| *why == AcquisitionReason::Stolen),
        "{:?}",
        acquisitions(&r)
    );
}

#[test]
fn p9_a_thief_withdraws_when_the_move_stops_helping_before_the_owner_answers() {
    // w2 (frozen: it never answers) holds 10 + 10; w1 holds 1 and asks for one of the 10s
    // (20 > 1 + 10). The other 10 finishes meanwhile: w2 holds 10, and moving it would leave
    // 0 against 11. w1 withdraws at once rather than take the split over at its deadline.
    let mut r = asking_beside_two_tens();
    let asked: records::StealRequest = request_to(&mut r, "w2", "asked first");
    let other = if asked.split.as_str() == "s0" { "s1" } else { "s0" };
    let mut done = r.kv.record(other);
    done.state = SplitState::Done;
    done.owner = None;
    peer_put(&mut r, Bucket::State, &keys::split(&sid(other)), &done);
    peer_delete(&mut r, Bucket::Lease, &keys::split(&sid(other)));
    r.advance(Duration::from_millis(10));
    assert_withdrawn_from(&mut r, "w2");
    // Past the deadline, nothing is taken over.
    r.advance(asker("w1", 1).tuning.heartbeat_interval() * 3);
    assert!(!acquisitions(&r).iter().any(|(s, _)| *s == asked.split.as_str()), "{:?}", acquisitions(&r));
}

#[test]
fn p9_a_thief_withdraws_when_the_split_is_gone_and_claims_it_when_released() {
    let mut r = asking_beside_two_tens();
    assert!(r.kv.get(Bucket::Lease, "steal.w2").is_some());
    // The owner finishes s0 meanwhile: the request no longer has a point.
    let mut done = r.kv.record("s0");
    done.state = SplitState::Done;
    done.owner = None;
    peer_put(&mut r, Bucket::State, &keys::split(&sid("s0")), &done);
    assert!(
        r.events().iter().any(|e| matches!(e, Event::Handover { outcome: HandoverOutcome::Withdrawn, .. }))
    );
    assert!(r.kv.get(Bucket::Lease, "steal.w2").is_none(), "withdrawn: deleted");
    // A heartbeat later w1 asks again (s1); the owner releases it: w1 claims it, no attempt.
    r.take_log();
    r.advance(cfg("w1", 1).tuning.heartbeat_interval());
    let request: records::StealRequest = request_to(&mut r, "w2", "asked again");
    assert_eq!(request.split.as_str(), "s1");
    let mut released = r.kv.record("s1");
    released.state = SplitState::Unleased;
    released.owner = None;
    released.last_end = Some(records::EndReason::Released);
    peer_put(&mut r, Bucket::State, &keys::split(&sid("s1")), &released);
    // (Record first, then the lease, as a release writes them: the thief waits in between.)
    assert!(!r.events().iter().any(|e| matches!(e, Event::Handover { .. })), "{:?}", r.events());
    let expected = r.kv.get(Bucket::Lease, "split.s1").unwrap().revision;
    let (result, events) =
        r.kv.apply(Bucket::Lease, &StoreRequest::Delete { key: keys::split(&sid("s1")), expected });
    result.unwrap();
    for (watch, event) in events {
        r.feed(Input::Watch { watch, event });
    }
    assert!(acquisitions(&r).contains(&("s1".into(), AcquisitionReason::Released)), "{:?}", acquisitions(&r));
    assert_eq!(r.kv.record("s1").attempts, 0);
    assert!(r.events().iter().any(|e| matches!(
        e,
        Event::Handover { outcome: HandoverOutcome::HandedOver, from: Epoch(1), to: Some(Epoch(2)), .. }
    )));
    assert!(r.kv.get(Bucket::Lease, "steal.w2").is_none());
}

#[test]
fn records_never_name_a_split_the_manifest_does_not_list() {
    let mut r = running(3);
    let head: records::PlanHead =
        records::decode(&r.kv.get(Bucket::State, "plan.head").unwrap().value).unwrap();
    let m = head.manifest.unwrap();
    let chunk: records::ManifestChunk = records::decode(
        &r.kv.get(Bucket::State, &keys::manifest(m.term, m.version, 0).to_string()).unwrap().value,
    )
    .unwrap();
    assert_eq!(chunk.splits.len(), 3);
    for (id, _) in chunk.splits {
        assert!(r.kv.get(Bucket::State, &format!("desc.{id}")).is_some());
        assert!(r.kv.get(Bucket::State, &format!("split.{id}")).is_some());
    }
    let _ = SplitRecord::new();
}

/// Answers every pending request in order (applied, with its watch events), except reads of
/// `split`'s descriptor, answered absent (as a replica lagging behind its write would), until
/// `until`; returns how many reads were answered absent.
fn answer_descriptor_absent(r: &mut Rig, split: &str, until: Timestamp) -> usize {
    let desc = format!("desc.{split}");
    let mut misses = 0;
    while r.now < until {
        while !r.pending.is_empty() {
            let is_desc = matches!(&r.pending[0].2, StoreRequest::Get { key } if key.as_str() == desc);
            if is_desc {
                let op = r.pending[0].0;
                r.answer(op, Ok(StoreReply::Value(None)));
                misses += 1;
            } else {
                r.apply_and_answer(0, None);
            }
        }
        r.advance(Duration::from_millis(100));
    }
    misses
}

fn record_writes(r: &Rig, split: &str) -> usize {
    let key = format!("split.{split}");
    r.kv.history
        .iter()
        .filter(|(b, q)| {
            *b == Bucket::State
                && matches!(q, StoreRequest::CompareAndSwap { key: k, .. } if k.as_str() == key)
        })
        .count()
}

#[test]
fn p12_a_missing_descriptor_is_read_again_for_a_lease_duration_before_it_counts() {
    // A lease long enough for more absent reads than the count that decides (5) to fit inside
    // it: the count alone must not decide (mutant descriptor-gone-by-count-alone survived a
    // window of 2 s of a 3 s lease, where the paced re-reads never reached the count).
    let mut c = cfg("w1", 1);
    c.tuning.lease_duration = Duration::from_secs(20);
    let mut r = Rig::new(c);
    r.plan = Some(plan(1, PlanKind::Final));
    r.auto = false;
    r.feed(Input::Start);
    // Seeds 104120 and 201380: a replica lagging behind the descriptor's write answered every
    // re-read absent. Well inside a lease duration, many absent reads decide nothing.
    let misses = answer_descriptor_absent(&mut r, "s0", Timestamp::from_millis(15_000));
    assert!(misses >= 5, "re-read {misses} times: as many as the count that decides");
    assert_eq!(record_writes(&r, "s0"), 0, "no claim, no failure while the descriptor may be lagging");
    // The replica catches up: the claim is written and the lane starts, no attempt charged.
    r.auto = true;
    let pending: Vec<_> = std::mem::take(&mut r.pending);
    for (op, bucket, req) in pending {
        r.answer_applied(op, bucket, &req);
    }
    // (The next re-read is due after the backoff the misses grew to.)
    for _ in 0..20 {
        if !r.started().is_empty() {
            break;
        }
        r.advance(Duration::from_millis(500));
    }
    assert_eq!(r.started(), vec![(sid("s0"), Epoch(1))]);
    assert_eq!(r.kv.record("s0").attempts, 0);
}

#[test]
fn p12_a_descriptor_absent_for_a_lease_duration_makes_the_split_unprocessable() {
    let mut r = starting_by_hand(1);
    answer_descriptor_absent(&mut r, "s0", Timestamp::from_millis(6_000));
    let rec = r.kv.record("s0");
    assert_eq!(rec.last_error.as_deref(), Some("descriptor missing from the store"));
    assert_eq!((rec.attempts, rec.owner), (1, None));
    assert!(r.started().is_empty(), "no lane runs without its descriptor");
}

/// Answers pending requests in order (applied, with watch events) until one matches `want`,
/// which is taken out unanswered.
fn until_pending(r: &mut Rig, want: impl Fn(Bucket, &StoreRequest) -> bool) -> (OpId, Bucket, StoreRequest) {
    for _ in 0..500 {
        if let Some(i) = r.pending.iter().position(|(_, b, q)| want(*b, q)) {
            return r.pending.remove(i);
        }
        assert!(!r.pending.is_empty(), "the worker went quiet before sending the request");
        r.apply_and_answer(0, None);
    }
    panic!("the request was never sent")
}

#[test]
fn p6_an_earlier_acquisition_found_landed_by_a_later_ones_read_is_given_back() {
    let mut r = starting_by_hand(1);
    let lease_create = |b: Bucket, q: &StoreRequest| {
        b == Bucket::Lease && matches!(q, StoreRequest::Create { key, .. } if key.as_str() == "split.s0")
    };
    let lease_read = |b: Bucket, q: &StoreRequest| {
        b == Bucket::Lease && matches!(q, StoreRequest::Get { key } if key.as_str() == "split.s0")
    };
    // The first acquisition's lease write times out, and so does the read that would decide it:
    // the acquisition is given up.
    let (first, _, first_req) = until_pending(&mut r, lease_create);
    r.answer(first, Err(StoreError::Indeterminate("no answer".into())));
    let (read, _, _) = until_pending(&mut r, lease_read);
    r.answer(read, Err(StoreError::Unavailable("no answer".into())));
    // The next round tries again; its write is in doubt too, and meanwhile the first one
    // lands (late, no watch event yet).
    r.advance(Duration::from_secs(1));
    let (second, _, _) = until_pending(&mut r, lease_create);
    let (landed, _) = r.kv.apply(Bucket::Lease, &first_req);
    assert!(landed.is_ok(), "{landed:?}");
    let rev = r.kv.get(Bucket::Lease, "split.s0").expect("the first write landed").revision;
    r.answer(second, Err(StoreError::Indeterminate("no answer".into())));
    // The second acquisition's read finds a lease naming us, written by the first. How that
    // write took the lease decides the acquisition reason and the attempt (P6, P12), and the
    // second cannot know it (seed 56664): it gives the lease back and claims nothing.
    let (read, bucket, req) = until_pending(&mut r, lease_read);
    let a = r.answer_applied(read, bucket, &req);
    let sent = store_requests(&a);
    assert!(
        sent.iter().any(|(b, q)| *b == Bucket::Lease
            && matches!(q, StoreRequest::Delete { key, expected } if key.as_str() == "split.s0" && *expected == rev)),
        "{sent:?}"
    );
    assert!(
        !sent.iter().any(|(b, q)| *b == Bucket::State
            && matches!(q, StoreRequest::Get { key } if key.as_str() == "desc.s0")),
        "the acquisition went on with a lease it cannot account for: {sent:?}"
    );
    // Once given back, the split is claimed afresh (by a create, as what it is).
    r.auto = true;
    let pending: Vec<_> = std::mem::take(&mut r.pending);
    for (op, bucket, req) in pending {
        r.answer_applied(op, bucket, &req);
    }
    r.advance(Duration::from_secs(1));
    assert_eq!(r.started(), vec![(sid("s0"), Epoch(1))]);
    let reasons: Vec<_> = r
        .log
        .iter()
        .filter_map(|a| match a {
            Action::Event(Event::Acquired { reason, .. }) => Some(*reason),
            _ => None,
        })
        .collect();
    assert_eq!(reasons, vec![AcquisitionReason::Create]);
}

#[test]
fn p11_a_resume_whose_resolving_read_lags_reads_again_and_resumes() {
    let (mut r, op, req) = starved_then_resuming();
    // The resume's CAS lands, but its answer is lost; the read that resolves it is answered by
    // a replica lagging behind the lease's last renewal.
    let known = match &req {
        StoreRequest::CompareAndSwap { expected, .. } => *expected,
        other => panic!("{other:?}"),
    };
    let (landed, _) = r.kv.apply(Bucket::Lease, &req);
    assert!(landed.is_ok(), "{landed:?}");
    let a = r.answer(op, Err(StoreError::Indeterminate("no answer".into())));
    let read = op_of(&a, 0);
    r.pending.retain(|(o, _, _)| *o != read);
    let lease = records::LeaseRecord {
        owner: Owner { instance: id("w1"), incarnation: Incarnation(1) },
        epoch: Epoch(1),
        write: 0,
    };
    let stale = Entry {
        key: keys::split(&sid("s0")),
        value: records::encode(&lease),
        revision: Revision(known.0 - 1),
    };
    r.answer(read, Ok(StoreReply::Value(Some(stale))));
    // It reads again, and the answer of that read decides: the tenancy resumes under epoch 2.
    for _ in 0..6 {
        r.advance(Duration::from_millis(500));
        for (op, bucket, req) in std::mem::take(&mut r.pending) {
            r.answer_applied(op, bucket, &req);
        }
    }
    assert_eq!(r.started().last(), Some(&(sid("s0"), Epoch(2))), "{:?}", r.log);
    assert_eq!(r.kv.record("s0").epoch, Epoch(2));
}

#[test]
fn p4_a_read_finding_our_leader_key_unmoved_makes_nobody_leader_until_a_write_is_acknowledged() {
    let (mut r, read, leader_rev) = deposed_leader_resolving();
    // The read finds the key still naming w1 at the revision the CAS expected: the CAS has not
    // landed (yet). Trust counted from the CAS's send time could outlive the key (P11).
    r.take_log();
    let mine = LeaderRecord { owner: Owner { instance: id("w1"), incarnation: Incarnation(1) }, term: 0 };
    let unmoved = Entry { key: keys::leader(), value: records::encode(&mine), revision: leader_rev };
    r.answer(read, Ok(StoreReply::Value(Some(unmoved))));
    let leads =
        |r: &Rig| r.log.iter().any(|a| matches!(a, Action::Event(Event::Leadership { leader: true, .. })));
    assert!(!leads(&r) && !r.w.is_leader(), "{:?}", r.log);
    // The next round takes the key back by a CAS whose answer is known: then it leads.
    let mut retaken = false;
    for _ in 0..4 {
        r.advance(Duration::from_millis(500));
        for (op, bucket, req) in std::mem::take(&mut r.pending) {
            retaken |= matches!(&req, StoreRequest::CompareAndSwap { key, expected, .. } if key.as_str() == "leader" && *expected == leader_rev);
            r.answer_applied(op, bucket, &req);
        }
        if leads(&r) {
            break;
        }
    }
    assert!(retaken && leads(&r), "{:?}", r.log);
}

/// The write to `key` waits the retry backoff (a third of a heartbeat): nothing 10 ms later,
/// one write once the backoff has passed.
fn sent_again_only_after_the_backoff(r: &mut Rig, bucket: Bucket, key: &str) {
    let a = r.advance(Duration::from_millis(10));
    assert_eq!(writes_to(&a, bucket, key), 0, "{a:?}");
    let a = r.advance(Duration::from_secs(1));
    assert_eq!(writes_to(&a, bucket, key), 1, "{a:?}");
}

/// How many writes (CAS or create) to `key` in `bucket` are among `actions`.
fn writes_to(actions: &[Action], bucket: Bucket, key: &str) -> usize {
    store_requests(actions)
        .into_iter()
        .filter(|(b, q)| {
            *b == bucket
                && matches!(q, StoreRequest::CompareAndSwap { key: k, .. } | StoreRequest::Create { key: k, .. } if k.as_str() == key)
        })
        .count()
}

#[test]
fn p5_a_claim_refused_while_the_record_has_not_moved_is_sent_again_only_after_the_backoff() {
    let mut r = starting_by_hand(1);
    let (op, req) = until_request(&mut r, is_claim);
    // A stream leader holding another write to the record refuses the claim, and the read shows
    // the record as the claim found it: nothing moved.
    let a = r.answer(op, Err(StoreError::RevisionMismatch(keys::split(&sid("s0")))));
    let read = op_of(&a, 0);
    let a = r.apply(read);
    assert_eq!(writes_to(&a, Bucket::State, "split.s0"), 0, "re-sent at once: {a:?}");
    // A moment later (less than the backoff, a third of a heartbeat): still nothing.
    let a = r.advance(Duration::from_millis(10));
    assert_eq!(writes_to(&a, Bucket::State, "split.s0"), 0, "{a:?}");
    // After the backoff the same claim goes again.
    let a = r.advance(Duration::from_secs(1));
    let again: Vec<_> = store_requests(&a).into_iter().filter(|(b, q)| is_claim(*b, q)).collect();
    assert_eq!(again, vec![(Bucket::State, req)], "{a:?}");
}

#[test]
fn p10_an_end_write_refused_while_the_record_has_not_moved_is_retried_only_after_the_backoff() {
    let mut r = running(1);
    r.auto = false;
    // The lane fails: the end write's answer is lost while the write waits at the stream
    // leader, and the read shows the record unchanged (not landed yet, maybe never).
    let a =
        r.feed(Input::Fail { split: sid("s0"), epoch: Epoch(1), error: "boom".into(), unprocessable: false });
    let end = op_of(&a, 0);
    r.pending.retain(|(o, _, _)| *o != end);
    let a = r.answer(end, Err(StoreError::Indeterminate("no answer".into())));
    let a = r.apply(op_of(&a, 0));
    // A retry now would be refused by that leader for as long as it holds the first write.
    assert_eq!(writes_to(&a, Bucket::State, "split.s0"), 0, "re-sent at once: {a:?}");
    sent_again_only_after_the_backoff(&mut r, Bucket::State, "split.s0");
}

#[test]
fn p11_a_leader_create_answered_after_the_trust_it_gives_lapsed_is_not_led_on() {
    let mut r = Rig::new(cfg("w1", 1));
    r.auto = false;
    r.expire = false;
    r.feed(Input::Start);
    let (op, req) =
        until_request(&mut r, |_, q| matches!(q, StoreRequest::Create { key, .. } if *key == keys::leader()));
    // The create lands, but its answer comes a whole lease later (a stalled link): trust,
    // counted from the send time, has lapsed before the worker learns it won.
    r.now = r.now + Duration::from_secs(3);
    r.kv.now = r.now;
    let a = r.answer_applied(op, Bucket::Lease, &req);
    assert!(!r.w.is_leader(), "{a:?}");
    assert_eq!(writes_to(&a, Bucket::State, "plan.head"), 0, "no plan write unled: {a:?}");
    let deleted = store_requests(&a).into_iter().any(|(b, q)| {
        b == Bucket::Lease && matches!(q, StoreRequest::Delete { key, .. } if key == keys::leader())
    });
    assert!(!deleted, "not deleted (a retried delete could remove it once retaken): {a:?}");
    // The key names us: after the backoff it is taken again by CAS, with trust from that send.
    let entry = r.kv.get(Bucket::Lease, "leader").expect("the create landed");
    r.feed(Input::Watch { watch: WatchId::Leases, event: WatchEvent::Put(entry) });
    let a = r.advance(Duration::from_secs(1));
    let (op, req) = r
        .pending
        .iter()
        .find(|(_, b, q)| {
            *b == Bucket::Lease
                && matches!(q, StoreRequest::CompareAndSwap { key, .. } if *key == keys::leader())
        })
        .map(|(op, _, q)| (*op, q.clone()))
        .unwrap_or_else(|| panic!("the key is taken again by CAS: {a:?} {:?}", r.pending));
    r.pending.retain(|(o, _, _)| *o != op);
    r.answer_applied(op, Bucket::Lease, &req);
    assert!(r.w.is_leader());
}

#[test]
fn p4_a_worker_that_stepped_down_while_its_garbage_listing_was_in_flight_deletes_nothing() {
    let mut r = starting_by_hand(1);
    r.expire = false;
    // The leader publishes, then lists the manifests to collect the older ones.
    let (op, _) = until_request(&mut r, |b, q| {
        b == Bucket::State && matches!(q, StoreRequest::List { prefix } if *prefix == keys::manifest_prefix())
    });
    assert!(r.w.is_leader());
    // Its renewals go unanswered for a lease: trust lapses and it steps down.
    r.advance(Duration::from_secs(3));
    assert!(!r.w.is_leader());
    // The listing answers now, with a chunk of an older version.
    let old = Entry { key: keys::manifest(1, 0, 0), value: Bytes::from_static(b"x"), revision: Revision(2) };
    let a = r.answer(op, Ok(StoreReply::Entries(vec![old])));
    let deletes = store_requests(&a)
        .into_iter()
        .filter(|(b, q)| *b == Bucket::State && matches!(q, StoreRequest::Delete { .. }))
        .count();
    assert_eq!(deletes, 0, "garbage is left to the next leader: {a:?}");
}

/// A single worker answered by hand until it sends the leader key's create, left unanswered.
fn until_the_leader_create() -> (Rig, OpId) {
    let mut r = Rig::new(cfg("w1", 1));
    r.auto = false;
    r.feed(Input::Start);
    let (op, _) =
        until_request(&mut r, |_, q| matches!(q, StoreRequest::Create { key, .. } if *key == keys::leader()));
    (r, op)
}

#[test]
fn p4_a_refused_leader_attempt_is_not_repeated_on_every_input() {
    let (mut r, op) = until_the_leader_create();
    // Refused with nothing to report (another worker's create waits at the stream leader).
    let a = r.answer(op, Err(StoreError::Unavailable("creating leader: another write is pending".into())));
    assert_eq!(writes_to(&a, Bucket::Lease, "leader"), 0, "{a:?}");
    // Inputs keep coming (here: watch events); no new attempt until the backoff has passed.
    let mut attempts = 0;
    for _ in 0..5 {
        let a = r.feed(Input::Watch { watch: WatchId::Plan, event: WatchEvent::SnapshotComplete });
        attempts += writes_to(&a, Bucket::Lease, "leader");
    }
    assert_eq!(attempts, 0);
    let a = r.advance(Duration::from_secs(1));
    assert_eq!(writes_to(&a, Bucket::Lease, "leader"), 1, "{a:?}");
}

/// A refusal no retry can change (here: the lease bucket is full) is fatal wherever it comes.
fn full() -> StoreError {
    StoreError::Setup("bucket etl_coordination_j_lease is full: it holds at most 600 bytes".into())
}

fn stopped_for_a_full_bucket(log: &[Action]) -> bool {
    log.iter().any(|a| matches!(a, Action::Fatal(FatalError::Store(m)) if m.contains("is full")))
}

#[test]
fn p4_a_leader_create_refused_for_good_stops_the_worker_saying_why() {
    let (mut r, op) = until_the_leader_create();
    r.answer(op, Err(full()));
    assert!(stopped_for_a_full_bucket(&r.log), "{:?}", r.log);
    // Stopped: nothing more is sent, however much time passes.
    r.pending.clear();
    r.advance(Duration::from_secs(5));
    assert!(r.pending.is_empty(), "{:?}", r.pending);
}

#[test]
fn p4_a_leader_renewal_refused_for_good_stops_the_worker_saying_why() {
    let mut r = running(1);
    assert!(r.log.iter().any(|a| matches!(a, Action::Event(Event::Leadership { leader: true, .. }))));
    r.auto = false;
    let mut renewal = None;
    for _ in 0..40 {
        r.advance(Duration::from_millis(250));
        renewal = r
            .pending
            .iter()
            .find(|(_, b, q)| {
                *b == Bucket::Lease
                    && matches!(q, StoreRequest::CompareAndSwap { key, .. } if *key == keys::leader())
            })
            .map(|(op, _, _)| *op);
        if renewal.is_some() {
            break;
        }
    }
    r.answer(renewal.expect("the leader lease is renewed"), Err(full()));
    assert!(stopped_for_a_full_bucket(&r.log), "{:?}", r.log);
}

#[test]
fn p3_a_presence_recreate_refused_for_good_stops_the_worker_saying_why() {
    let mut r = running(1);
    r.auto = false;
    let is_presence = |q: &StoreRequest| match q {
        StoreRequest::CompareAndSwap { key, .. }
        | StoreRequest::Create { key, .. }
        | StoreRequest::Get { key } => *key == presence_key("w1"),
        _ => false,
    };
    let mut renewal = None;
    for _ in 0..40 {
        r.advance(Duration::from_millis(250));
        renewal = r
            .pending
            .iter()
            .find(|(_, b, q)| {
                *b == Bucket::Lease && matches!(q, StoreRequest::CompareAndSwap { .. }) && is_presence(q)
            })
            .map(|(op, _, _)| *op);
        if renewal.is_some() {
            break;
        }
    }
    // The renewal is refused (our key moved), the read finds it gone: the worker announces
    // itself again, and that create is refused for good.
    let a = r.answer(
        renewal.expect("the presence is renewed"),
        Err(StoreError::RevisionMismatch(presence_key("w1"))),
    );
    let nth = |a: &[Action], what: fn(&StoreRequest) -> bool| {
        let i = store_requests(a).iter().position(|(_, q)| what(q) && is_presence(q));
        op_of(a, i.unwrap_or_else(|| panic!("no such request: {a:?}")))
    };
    let read = nth(&a, |q| matches!(q, StoreRequest::Get { .. }));
    let a = r.answer(read, Ok(StoreReply::Value(None)));
    let create = nth(&a, |q| matches!(q, StoreRequest::Create { .. }));
    r.answer(create, Err(full()));
    assert!(stopped_for_a_full_bucket(&r.log), "{:?}", r.log);
}

#[test]
fn p4_a_term_bump_refused_while_the_head_has_not_moved_is_sent_again_only_after_the_backoff() {
    let mut r = starting_by_hand(1);
    let (op, _) = until_request(&mut r, is_head_create);
    // Refused with nothing there (another write to the head waits at the stream leader); the
    // read finds no head: the term is still to be established, against the same state.
    let a = r.answer(op, Err(StoreError::Unavailable("creating plan.head: another write is pending".into())));
    let a = r.apply(op_of(&a, 0));
    assert_eq!(writes_to(&a, Bucket::State, "plan.head"), 0, "re-sent at once: {a:?}");
    sent_again_only_after_the_backoff(&mut r, Bucket::State, "plan.head");
}

/// Answers everything in order (with watch events) until a request `wanted` matches; returns
/// it unanswered.
fn until_request(r: &mut Rig, wanted: impl Fn(Bucket, &StoreRequest) -> bool) -> (OpId, StoreRequest) {
    for _ in 0..200 {
        let Some(i) = (!r.pending.is_empty()).then_some(0) else { break };
        if wanted(r.pending[i].1, &r.pending[i].2) {
            let (op, _, req) = r.pending.remove(i);
            return (op, req);
        }
        r.apply_and_answer(i, None);
    }
    panic!("the request never came: {:?}", r.pending)
}

/// The claim's record CAS (epoch 1) of `split.s0`.
fn is_claim(bucket: Bucket, q: &StoreRequest) -> bool {
    bucket == Bucket::State
        && matches!(q, StoreRequest::CompareAndSwap { key, value, .. }
            if key.as_str() == "split.s0" && records::decode::<SplitRecord>(value).is_ok_and(|v| v.epoch == Epoch(1)))
}

/// The first term bump (the head's create).
fn is_head_create(_: Bucket, q: &StoreRequest) -> bool {
    matches!(q, StoreRequest::Create { key, .. } if *key == keys::plan_head())
}

#[test]
fn p12_a_late_claim_of_an_earlier_acquisition_of_ours_is_released_not_adopted() {
    let mut r = starting_by_hand(1);
    let (op, _) = until_request(&mut r, is_claim);
    // Meanwhile a claim an earlier acquisition of ours sent (and gave up while it waited at a
    // stuck stream leader) lands: epoch 1, us, but decided as a steal of someone's tenancy.
    let mut late = r.kv.record("s0");
    late.epoch = Epoch(1);
    late.owner = Some(Owner { instance: id("w1"), incarnation: Incarnation(1) });
    late.state = SplitState::Owned;
    late.last_end = Some(records::EndReason::Stolen);
    let landed = r.kv.put(Bucket::State, &keys::split(&sid("s0")), &late);
    let a = r.answer(op, Err(StoreError::RevisionMismatch(keys::split(&sid("s0")))));
    let a = r.apply(op_of(&a, 0));
    // That tenancy never ran: it is released against the revision read (no attempt), and this
    // acquisition gives its lease back; no lane starts.
    let reqs = store_requests(&a);
    let released = reqs.iter().any(|(b, q)| {
        *b == Bucket::State
            && matches!(q, StoreRequest::CompareAndSwap { key, expected, value, .. }
                if key.as_str() == "split.s0" && *expected == landed
                    && records::decode::<SplitRecord>(value).is_ok_and(|v| v.state == SplitState::Unleased && v.owner.is_none() && v.attempts == 0))
    });
    let lease_back = reqs.iter().any(|(b, q)| {
        *b == Bucket::Lease && matches!(q, StoreRequest::Delete { key, .. } if key.as_str() == "split.s0")
    });
    assert!(released && lease_back, "{a:?}");
    assert!(r.started().is_empty(), "{:?}", r.log);
}

/// Until the claim CAS of `split.s0` is sent (held back), then the lease erased by expiry as
/// NATS can do it after an acknowledged create (P7): the tenancy is revoked with the claim in
/// flight. Returns the claim.
fn claim_in_flight_when_the_lease_expires() -> (Rig, OpId, StoreRequest) {
    let mut r = starting_by_hand(1);
    let (op, req) = until_request(&mut r, is_claim);
    lease_of_s0_expires(&mut r);
    (r, op, req)
}

/// The lease of `split.s0` is erased by expiry, and the worker sees it.
fn lease_of_s0_expires(r: &mut Rig) {
    let lease = r.kv.get(Bucket::Lease, "split.s0").expect("our lease");
    let delete = StoreRequest::Delete { key: lease.key.clone(), expected: lease.revision };
    r.kv.apply(Bucket::Lease, &delete).0.unwrap();
    let revision = Revision(lease.revision.0 + 1);
    let event = WatchEvent::Delete { key: lease.key, revision, cause: DeleteCause::Expired };
    r.feed(Input::Watch { watch: WatchId::Leases, event });
}

/// Whether `actions` release the record of `s0` by a CAS against `landed`, the revision our
/// orphaned claim wrote: owner cleared, no attempt charged (its next claimer, whoever it is,
/// re-bases on a release and charges nothing).
fn releases_orphan(actions: &[Action], landed: Revision) -> bool {
    store_requests(actions).iter().any(|(b, q)| {
        *b == Bucket::State
            && matches!(q, StoreRequest::CompareAndSwap { key, expected, value, .. }
                if key.as_str() == "split.s0" && *expected == landed
                    && records::decode::<SplitRecord>(value).is_ok_and(|v| v.state == SplitState::Unleased && v.owner.is_none() && v.attempts == 0 && v.epoch == Epoch(1)))
    })
}

/// The revision of the record of `s0` in the store.
fn record_rev(r: &mut Rig) -> Revision {
    r.kv.get(Bucket::State, "split.s0").expect("a record").revision
}

#[test]
fn p12_a_claim_that_lands_after_its_lease_expired_is_released_so_its_next_claimer_charges_nothing() {
    let (mut r, op, req) = claim_in_flight_when_the_lease_expires();
    // The claim lands after all: the record names us at epoch 1, with no lease behind it.
    let a = r.answer_applied(op, Bucket::State, &req);
    let landed = record_rev(&mut r);
    assert!(releases_orphan(&a, landed), "the orphaned claim was not released: {a:?}");
    assert!(r.started().is_empty(), "a lane started without a lease: {:?}", r.log);
}

#[test]
fn p12_an_orphaned_claim_in_doubt_is_read_and_released_if_it_landed() {
    let (mut r, op, req) = claim_in_flight_when_the_lease_expires();
    // It lands, but its answer is lost: the worker reads the record to find out.
    r.kv.apply(Bucket::State, &req).0.unwrap();
    let landed = record_rev(&mut r);
    let a = r.answer(op, Err(StoreError::Indeterminate("no answer".into())));
    let a = r.apply(op_of(&a, 0));
    assert!(releases_orphan(&a, landed), "{a:?}");
}

/// A single worker's claim of `s0` lands but its answer is lost: the rig, the revision it
/// landed at, and the read the worker sent to resolve it (not answered yet).
fn claim_landed_answer_lost() -> (Rig, Revision, OpId) {
    let mut r = starting_by_hand(1);
    let (op, req) = until_request(&mut r, is_claim);
    r.kv.apply(Bucket::State, &req).0.unwrap();
    let landed = record_rev(&mut r);
    let a = r.answer(op, Err(StoreError::Indeterminate("no answer".into())));
    (r, landed, op_of(&a, 0))
}

#[test]
fn p12_a_claim_in_doubt_whose_read_comes_back_after_its_lease_expired_is_released() {
    let (mut r, landed, read) = claim_landed_answer_lost();
    // The lease expires while the read resolving the claim is in flight.
    lease_of_s0_expires(&mut r);
    let a = r.apply(read);
    assert!(releases_orphan(&a, landed), "{a:?}");
}

#[test]
fn p12_a_claim_that_quarantines_is_final_even_when_its_lease_expired_while_it_was_in_flight() {
    // w2 held s0 and died without committing, after an earlier failing tenancy (attempts 1 of
    // 2): its lease is gone. w1's claim charges the attempt that quarantines the split.
    let mut w2 = Rig::new(cfg("w2", 2));
    w2.plan = Some(plan(1, PlanKind::Final));
    w2.feed(Input::Start);
    let mut rec = w2.kv.record("s0");
    rec.attempts = 1;
    w2.kv.put(Bucket::State, &keys::split(&sid("s0")), &rec);
    let lease = w2.kv.get(Bucket::Lease, "split.s0").expect("w2's lease");
    w2.kv.apply(Bucket::Lease, &StoreRequest::Delete { key: lease.key, expected: lease.revision }).0.unwrap();
    let mut c1 = cfg("w1", 1);
    c1.tuning.claim_backoff = Duration::ZERO;
    let mut r = Rig::new(c1);
    r.expire = false;
    r.auto = false;
    r.kv = std::mem::take(&mut w2.kv);
    r.feed(Input::Start);
    let (op, req) = until_request(&mut r, |b, q| {
        b == Bucket::State
            && matches!(q, StoreRequest::CompareAndSwap { key, value, .. }
                if key.as_str() == "split.s0" && records::decode::<SplitRecord>(value).is_ok_and(|v| v.state == SplitState::Quarantined))
    });
    // The lease w1 took for it expires while the claim is in flight; then the claim lands.
    lease_of_s0_expires(&mut r);
    let a = r.answer_applied(op, Bucket::State, &req);
    settle(&mut r);
    assert!(!releases_any(&a) && !releases_any(&r.take_log()), "a quarantined record was rewritten: {a:?}");
    assert_eq!((r.kv.record("s0").state, r.kv.record("s0").attempts), (SplitState::Quarantined, 2));
}

#[test]
fn p12_a_split_whose_orphaned_claim_is_in_flight_is_not_claimed_again_until_it_resolves() {
    let (mut r, op, req) = claim_in_flight_when_the_lease_expires();
    // Heartbeats pass (they unblock every split) while the orphaned claim waits at the store:
    // a new claim of ours could write the very record its release is based on.
    for _ in 0..4 {
        let a = r.advance(Duration::from_secs(1));
        let retaken = store_requests(&a).iter().any(|(b, q)| {
            *b == Bucket::Lease && matches!(q, StoreRequest::Create { key, .. } if key.as_str() == "split.s0")
        });
        assert!(!retaken, "s0 taken again while its orphaned claim was in flight: {a:?}");
        for (o, _, _) in std::mem::take(&mut r.pending).into_iter().filter(|(o, _, _)| *o != op) {
            r.answer(o, Err(StoreError::Unavailable("busy".into())));
        }
    }
    // It lands and is released; then s0 is the worker's to take again.
    r.answer_applied(op, Bucket::State, &req);
    settle(&mut r);
    r.advance(Duration::from_secs(1));
    settle(&mut r);
    assert_eq!(r.started().last().map(|(s, _)| s.as_str()), Some("s0"), "{:?}", r.log);
}

#[test]
fn p12_a_claim_in_doubt_between_its_read_and_the_reads_retry_is_read_and_released_when_its_lease_expires() {
    let (mut r, landed, read) = claim_landed_answer_lost();
    // The read that would decide it fails; its retry waits out the backoff.
    let a = r.answer(read, Err(StoreError::Unavailable("down".into())));
    assert!(store_requests(&a).is_empty(), "{a:?}");
    r.pending.clear();
    lease_of_s0_expires(&mut r);
    let (read, _) = until_request(&mut r, |b, q| {
        b == Bucket::State && matches!(q, StoreRequest::Get { key } if key.as_str() == "split.s0")
    });
    let (result, _) = r.kv.apply(Bucket::State, &StoreRequest::Get { key: keys::split(&sid("s0")) });
    let a = r.answer(read, result);
    assert!(releases_orphan(&a, landed), "{a:?}");
}

#[test]
fn p11_a_resume_revoked_before_its_claim_landed_releases_the_record_it_resumed_from() {
    let (mut r, op, req) = starved_then_resuming();
    // The resume's lease lands; its claim (epoch 2) goes out; then the lease is erased by
    // expiry, and the claim is refused.
    let a = r.answer_applied(op, Bucket::Lease, &req);
    let claim = op_of(&a, 0);
    lease_of_s0_expires(&mut r);
    r.answer(claim, Err(StoreError::Unavailable("down".into())));
    let released = r.pending.iter().any(|(_, b, q)| {
        *b == Bucket::State
            && matches!(q, StoreRequest::CompareAndSwap { key, value, .. } if key.as_str() == "split.s0"
                && records::decode::<SplitRecord>(value).is_ok_and(|v| v.state == SplitState::Unleased && v.epoch == Epoch(1) && v.attempts == 0))
    });
    assert!(released, "the record at epoch 1 stays owned: {:?}", r.pending);
}

/// Whether `actions` write an Unleased record of `s0`.
fn releases_any(actions: &[Action]) -> bool {
    store_requests(actions).iter().any(|(b, q)| {
        *b == Bucket::State
            && matches!(q, StoreRequest::CompareAndSwap { key, value, .. }
                if key.as_str() == "split.s0" && records::decode::<SplitRecord>(value).is_ok_and(|v| v.state == SplitState::Unleased))
    })
}

/// Answers everything pending in order until the worker is quiet.
fn settle(r: &mut Rig) {
    for _ in 0..200 {
        if r.pending.is_empty() {
            return;
        }
        r.apply_and_answer(0, None);
    }
    panic!("the worker never settled: {:?}", r.pending)
}

#[test]
fn p4_a_delayed_head_write_is_not_sent_after_the_worker_stepped_down() {
    let mut r = starting_by_hand(1);
    let (op, _) = until_request(&mut r, is_head_create);
    let a = r.answer(op, Err(StoreError::Unavailable("creating plan.head: another write is pending".into())));
    r.apply(op_of(&a, 0));
    // The bump waits its backoff; meanwhile the leader key is gone and another worker leads.
    let leader_rev = r.kv.get(Bucket::Lease, "leader").expect("our leader key").revision;
    let other = LeaderRecord { owner: Owner { instance: id("w9"), incarnation: Incarnation(9) }, term: 0 };
    let entry =
        Entry { key: keys::leader(), value: records::encode(&other), revision: Revision(leader_rev.0 + 100) };
    r.feed(Input::Watch { watch: WatchId::Leases, event: WatchEvent::Put(entry) });
    r.pending.clear();
    let a = r.advance(Duration::from_secs(1));
    assert_eq!(writes_to(&a, Bucket::State, "plan.head"), 0, "a deposed worker wrote the head: {a:?}");
}

/// Bytes no release of this project writes (format byte 255).
fn garbage() -> Bytes {
    Bytes::from_static(b"\xffnot a record")
}

fn undecodable_events(r: &Rig) -> usize {
    r.events().iter().filter(|e| matches!(e, Event::Undecodable { .. })).count()
}

#[test]
fn an_undecodable_split_record_is_never_claimed_blocks_completion_and_is_reported_once() {
    let mut r = Rig::new(cfg("w1", 1));
    r.plan = Some(plan(2, PlanKind::Final));
    r.feed(Input::Start);
    // Both lanes run; s1's record is overwritten by another program while it runs.
    assert_eq!(r.started().len(), 2);
    let corrupt_rev = r.write_raw(Bucket::State, "split.s1", garbage());
    // The holder is fenced at once (its next write could never match that value) ...
    assert!(
        r.log.contains(&Action::StopLane {
            split: sid("s1"),
            epoch: Epoch(1),
            reason: StopReason::Fenced,
            deadline: None
        }),
        "{:?}",
        r.log
    );
    r.feed(Input::Finish { split: sid("s0"), epoch: Epoch(1), progress: Bytes::from_static(b"end") });
    // ... and nothing completes while s1 cannot be read, nor is it claimed again.
    assert!(!r.log.iter().any(|a| matches!(a, Action::Finished(_))), "{:?}", r.log);
    assert_eq!(r.started().len(), 2);
    let Some(Event::Gauges { splits, undecodable_state, .. }) = r.last_gauges() else { panic!("gauges") };
    assert_eq!((splits.done, splits.undecodable, splits.unleased, undecodable_state), (1, 1, 0, 1));
    // Reported once per value, not at every resync.
    let reported = undecodable_events(&r);
    assert_eq!(reported, 1);
    r.advance(Duration::from_secs(31));
    assert_eq!(undecodable_events(&r), reported, "a resync does not report the same value again");
    // The operator's reset (`requeue --reset`): the split starts over and the job completes.
    let reset = SplitRecord::reset(Some((corrupt_rev, None)), None);
    assert!(reset.epoch.0 >= corrupt_rev.0, "the reset's epoch is above every epoch of the split");
    r.write_raw(Bucket::State, "split.s1", records::encode(&reset));
    let (split, epoch) = r.started().last().cloned().unwrap();
    assert_eq!(split, sid("s1"));
    assert_eq!(epoch, reset.epoch.next());
    let Some(Action::StartLane { progress, .. }) =
        r.log.iter().rev().find(|a| matches!(a, Action::StartLane { .. })).cloned()
    else {
        panic!("a lane")
    };
    assert_eq!(progress, None, "from the start");
    r.feed(Input::Finish { split, epoch, progress: Bytes::from_static(b"end") });
    assert!(r.log.contains(&Action::Finished(Outcome::Complete)), "{:?}", r.log);
    let Some(Event::Gauges { undecodable_state, .. }) = r.last_gauges() else { panic!("gauges") };
    assert_eq!(undecodable_state, 0);
}

#[test]
fn gauges_count_the_plans_splits_by_state() {
    let mut c = cfg("w1", 1);
    c.tuning.max_in_flight = 2;
    let mut r = Rig::new(c);
    r.plan = Some(plan(4, PlanKind::Final));
    r.feed(Input::Start);
    let Some(Event::Gauges { owned, splits, .. }) = r.last_gauges() else { panic!("gauges") };
    assert_eq!(owned, 2);
    // (unleased, owned, done, quarantined, undecodable, missing)
    assert_eq!(counts(splits), (2, 2, 0, 0, 0, 0));
    let (s, e) = r.started()[0].clone();
    r.feed(Input::Finish { split: s, epoch: e, progress: Bytes::from_static(b"end") });
    let Some(Event::Gauges { splits, .. }) = r.last_gauges() else { panic!("gauges") };
    // One done, and the freed lane took the next unleased one.
    assert_eq!(counts(splits), (1, 2, 1, 0, 0, 0));
}

fn counts(s: SplitCounts) -> (u32, u32, u32, u32, u32, u32) {
    (s.unleased, s.owned, s.done, s.quarantined, s.undecodable, s.missing)
}

#[test]
fn a_worker_that_stays_after_the_end_takes_up_a_requeued_split_and_leaves_when_drained() {
    let mut c = cfg("w1", 1);
    c.tuning.max_attempts = 1;
    c.stay_after_end = true;
    let mut r = Rig::new(c);
    r.plan = Some(plan(2, PlanKind::Final));
    r.feed(Input::Start);
    r.feed(Input::Finish { split: sid("s0"), epoch: Epoch(1), progress: Bytes::from_static(b"end") });
    r.feed(Input::Fail { split: sid("s1"), epoch: Epoch(1), error: "bad row".into(), unprocessable: true });
    let stalled = Outcome::Stalled { quarantined: vec![(sid("s1"), Some("bad row".into()))] };
    assert!(r.events().contains(&Event::JobEnded { outcome: stalled.clone() }), "{:?}", r.log);
    assert!(!r.log.iter().any(|a| matches!(a, Action::Finished(_))), "it stays");
    // It keeps its presence: heartbeats go on.
    r.take_log();
    r.advance(Duration::from_secs(2));
    assert!(r.kv.get(Bucket::Lease, "worker.w1").is_some());
    // The operator requeues the split after fixing its cause: the job runs again.
    let rec = r.kv.record("s1");
    r.write_raw(Bucket::State, "split.s1", records::encode(&rec.requeued()));
    assert!(r.events().contains(&Event::JobReopened), "{:?}", r.log);
    let (split, epoch) = r.started().last().cloned().expect("the requeued split is taken up");
    assert_eq!(split, sid("s1"));
    r.feed(Input::Finish { split, epoch, progress: Bytes::from_static(b"end") });
    assert!(r.events().contains(&Event::JobEnded { outcome: Outcome::Complete }), "{:?}", r.log);
    // Drained, it leaves with the job's end as its outcome.
    r.feed(Input::Drain);
    assert!(r.log.contains(&Action::Finished(Outcome::Complete)), "{:?}", r.log);
    assert!(r.kv.get(Bucket::Lease, "worker.w1").is_none(), "presence deleted on the way out");
}

#[test]
fn an_undecodable_plan_head_is_reported_and_forgotten_once_repaired() {
    let mut r = running(1);
    let head = r.kv.get(Bucket::State, "plan.head").unwrap();
    r.write_raw(Bucket::State, "plan.head", garbage());
    let Some(Event::Gauges { undecodable_state, .. }) = r.last_gauges() else { panic!("gauges") };
    assert_eq!(undecodable_state, 1);
    r.write_raw(Bucket::State, "plan.head", head.value);
    let Some(Event::Gauges { undecodable_state, .. }) = r.last_gauges() else { panic!("gauges") };
    assert_eq!(undecodable_state, 0);
}

#[test]
fn a_deleted_record_is_counted_missing_and_so_is_an_undecodable_one_whose_delete_a_resync_finds() {
    let mut r = running(2);
    r.write_raw(Bucket::State, "split.s0", garbage());
    // The delete is not seen by the watch (the rig writes without events); the next resync's
    // listing no longer has the key: the split is missing, not undecodable any more.
    let key = Key::new("split.s0").unwrap();
    let rev = r.kv.get(Bucket::State, "split.s0").unwrap().revision;
    r.kv.state.delete(r.now, &key, rev).unwrap();
    r.kv.state.take_events();
    r.advance(Duration::from_secs(31));
    let Some(Event::Gauges { splits, undecodable_state, .. }) = r.last_gauges() else { panic!("gauges") };
    assert_eq!((splits.undecodable, splits.missing, undecodable_state), (0, 1, 0), "{splits:?}");
    assert!(!r.log.iter().any(|a| matches!(a, Action::Finished(_))), "a missing record blocks completion");
}

#[test]
fn retries_wait_a_third_of_a_heartbeat_plus_a_jitter_that_differs_between_processes() {
    // Two processes whose claims are refused at the same moment retry at different times.
    let mut sent_at = Vec::new();
    for incarnation in [1, 2, 3] {
        let mut r = Rig::new(cfg("w1", incarnation));
        r.plan = Some(plan(1, PlanKind::Final));
        r.auto = false;
        r.feed(Input::Start);
        let (op, _) = until_request(&mut r, is_claim);
        let a = r.answer(op, Err(StoreError::RevisionMismatch(keys::split(&sid("s0")))));
        let a = r.apply(op_of(&a, 0));
        assert_eq!(writes_to(&a, Bucket::State, "split.s0"), 0, "re-sent at once: {a:?}");
        let t0 = r.now;
        let again = (0..200)
            .find(|_| {
                let a = r.advance(Duration::from_millis(10));
                writes_to(&a, Bucket::State, "split.s0") > 0
            })
            .map(|_| r.now.saturating_since(t0))
            .expect("the claim is sent again within 2 s");
        // Heartbeat 1 s: a base of 333 ms and a jitter of up to as much again.
        assert!(again >= Duration::from_millis(333) && again < Duration::from_millis(680), "{again:?}");
        sent_at.push(again);
    }
    sent_at.dedup();
    assert!(sent_at.len() > 1, "the same retry delay for every process: {sent_at:?}");
}

#[test]
fn p3_a_running_twin_that_the_newcomers_window_missed_stops_on_the_newcomers_renewals() {
    // The newcomer (incarnation 9) missed this worker's renewal (it came more than the margin
    // late) and took the key over by CAS; no watch event reaches this worker.
    let mut r = running(3);
    let twin = PresenceRecord { incarnation: Incarnation(9), held: 0, capacity: 4 };
    r.kv.put(Bucket::Lease, &presence_key("w1"), &twin);
    r.take_log();
    // Our next renewal loses its CAS; the read shows the other incarnation. One write could be
    // a dead process's landing late: not fatal yet, and no ping-pong (we do not take it back).
    r.advance(Duration::from_secs(1));
    r.advance(Duration::from_millis(1400));
    assert!(!r.log.iter().any(|a| matches!(a, Action::Fatal(_))), "one write is not proof: {:?}", r.log);
    let holder = r.kv.get(Bucket::Lease, "worker.w1").expect("the key is there");
    let holder = records::decode::<PresenceRecord>(&holder.value).unwrap();
    assert_eq!(holder.incarnation, Incarnation(9), "the key was not taken back");
    // The newcomer renews: a second write proves a live twin, and this worker stops.
    r.kv.put(Bucket::Lease, &presence_key("w1"), &twin);
    r.advance(Duration::from_millis(200));
    let fatal = r.log.iter().find_map(|a| match a {
        Action::Fatal(e @ FatalError::DuplicateInstance { .. }) => Some(e.clone()),
        _ => None,
    });
    assert!(fatal.is_some(), "the running twin stops: {:?}", r.log);
}

fn is_manifest_read(_: Bucket, q: &StoreRequest) -> bool {
    matches!(q, StoreRequest::Get { key } if key.as_str().starts_with("manifest."))
}

/// Applies every pending request that `hold` does not select (with its watch events), until
/// only held ones are left; returns those, in the order they were sent.
fn apply_all_but(r: &mut Rig, hold: impl Fn(Bucket, &StoreRequest) -> bool) -> Vec<(OpId, StoreRequest)> {
    loop {
        let Some(i) = r.pending.iter().position(|(_, b, q)| !hold(*b, q)) else {
            return r.pending.iter().map(|(op, _, q)| (*op, q.clone())).collect();
        };
        r.apply_and_answer(i, None);
    }
}

fn chunk_of(q: &StoreRequest) -> u32 {
    match q {
        StoreRequest::Get { key } => key.as_str().rsplit('.').next().unwrap().parse().unwrap(),
        other => panic!("not a manifest read: {other:?}"),
    }
}

/// A store holding a published Final plan of `n` splits (w1 its leader), every split Done but
/// the ones `keep` selects; returns it with the manifest's chunks (split ids per chunk).
fn all_done_but(n: usize, keep: impl Fn(&SplitId) -> bool) -> (Kv, Vec<Vec<SplitId>>) {
    let mut r = running(n);
    let head: records::PlanHead =
        records::decode(&r.kv.get(Bucket::State, "plan.head").unwrap().value).unwrap();
    let m = head.manifest.unwrap();
    let mut chunks = Vec::new();
    for c in 0..m.chunks {
        let key = keys::manifest(m.term, m.version, c);
        let chunk: records::ManifestChunk =
            records::decode(&r.kv.get(Bucket::State, key.as_str()).unwrap().value).unwrap();
        chunks.push(chunk.splits.into_iter().map(|(id, _)| id).collect::<Vec<_>>());
    }
    for id in chunks.iter().flatten().filter(|id| !keep(id)) {
        let mut done = SplitRecord::new();
        done.epoch = Epoch(1);
        done.state = SplitState::Done;
        r.kv.put(Bucket::State, &keys::split(id), &done);
    }
    let mut kv = std::mem::take(&mut r.kv);
    kv.watches.clear();
    (kv, chunks)
}

fn ended(r: &Rig) -> Vec<Action> {
    r.log
        .iter()
        .filter(|a| matches!(a, Action::Finished(_)) || matches!(a, Action::Event(Event::JobEnded { .. })))
        .cloned()
        .collect()
}

/// A standby (answered by hand) loading a two-chunk manifest (1,025 splits, all Done but the one
/// in the second chunk): its first load fails on chunk 1 (answered absent, as by a lagging
/// replica) while chunk 0's read is still in flight, and the heartbeat starts a second load.
/// Returns the rig, the first load's chunk-0 read, the second load's reads (op, chunk), and the
/// split of chunk 1.
fn second_manifest_load() -> (Rig, OpId, Vec<(OpId, u32)>, SplitId) {
    let n = records::MANIFEST_CHUNK_LEN + 1;
    let (mut kv, chunks) = all_done_but(n, |_| false);
    assert_eq!(chunks.len(), 2);
    let last = chunks[1][0].clone();
    let mut open = SplitRecord::new();
    open.epoch = Epoch(1);
    open.state = SplitState::Unleased;
    kv.put(Bucket::State, &keys::split(&last), &open);

    let mut r = Rig::new(cfg("w2", 1));
    r.kv = kv;
    r.auto = false;
    r.expire = false;
    r.feed(Input::Start);
    let reads = apply_all_but(&mut r, is_manifest_read);
    assert_eq!(reads.iter().map(|(_, q)| chunk_of(q)).collect::<Vec<_>>(), vec![0, 1]);
    let (first_load_chunk0, _) = reads[0].clone();
    let (first_load_chunk1, _) = reads[1].clone();
    r.answer(first_load_chunk1, Ok(StoreReply::Value(None)));
    r.advance(Duration::from_secs(1));
    let reads = apply_all_but(&mut r, is_manifest_read);
    let second: Vec<(OpId, u32)> =
        reads.iter().filter(|(op, _)| *op != first_load_chunk0).map(|(op, q)| (*op, chunk_of(q))).collect();
    assert_eq!(second.iter().map(|(_, c)| *c).collect::<Vec<_>>(), vec![0, 1], "a second load");
    (r, first_load_chunk0, second, last)
}

fn done_in_view(r: &Rig) -> Option<u32> {
    r.last_gauges().map(|g| match g {
        Event::Gauges { splits, .. } => splits.done,
        _ => unreachable!(),
    })
}

#[test]
fn p13_a_chunk_answer_of_a_dropped_manifest_load_does_not_count_for_the_next() {
    let (mut r, first_load_chunk0, second, last) = second_manifest_load();
    // The first load's chunk-0 answer arrives, then the second load's own chunk 0.
    r.apply(first_load_chunk0);
    r.apply(second[0].0);
    apply_all_but(&mut r, is_manifest_read);
    assert_eq!(ended(&r), vec![], "chunk 1 was never read: the job must not end");
    assert_eq!(undecodable_events(&r), 0, "the second load counted chunk 0 once and waits for chunk 1");
    assert_eq!(done_in_view(&r), Some(0), "no manifest installed yet");
    // Chunk 1 arrives: the whole manifest is in view, and its one open split is taken.
    r.apply(second[1].0);
    apply_all_but(&mut r, |_, _| false);
    assert_eq!(ended(&r), vec![]);
    assert_eq!(r.started().iter().map(|(s, _)| s.clone()).collect::<Vec<_>>(), vec![last]);
}

#[test]
fn p13_an_absent_answer_of_a_dropped_manifest_load_does_not_fail_the_next() {
    let (mut r, first_load_chunk0, second, last) = second_manifest_load();
    // The first load's chunk-0 read comes back absent (a lagging replica, late): it belonged to
    // the dropped load, so the second one installs the manifest as soon as its own reads land,
    // without waiting for another heartbeat.
    r.answer(first_load_chunk0, Ok(StoreReply::Value(None)));
    r.apply(second[0].0);
    r.apply(second[1].0);
    apply_all_but(&mut r, |_, _| false);
    assert_eq!(done_in_view(&r), Some(records::MANIFEST_CHUNK_LEN as u32));
    assert_eq!(r.started().iter().map(|(s, _)| s.clone()).collect::<Vec<_>>(), vec![last]);
    assert_eq!(ended(&r), vec![]);
}

#[test]
fn p13_a_manifest_holding_fewer_splits_than_its_head_says_never_completes() {
    // The head names a manifest of 3 splits; its only chunk is rewritten to list 2 (a partial
    // manifest), and those 2 are Done.
    let (mut kv, chunks) = all_done_but(3, |_| false);
    let head_entry = kv.get(Bucket::State, "plan.head").unwrap();
    let head: records::PlanHead = records::decode(&head_entry.value).unwrap();
    let m = head.manifest.unwrap();
    let partial =
        records::ManifestChunk { splits: chunks[0].iter().take(2).map(|id| (id.clone(), 1)).collect() };
    kv.put(Bucket::State, &keys::manifest(m.term, m.version, 0), &partial);
    let mut r = Rig::new(cfg("w2", 1));
    r.kv = kv;
    r.expire = false;
    r.feed(Input::Start);
    for _ in 0..3 {
        r.advance(Duration::from_secs(1));
    }
    assert_eq!(ended(&r), vec![], "{:?}", r.log);
    // It is reported (once per value, however often it is read again), naming both counts.
    let reported: Vec<String> = r
        .events()
        .into_iter()
        .filter_map(|e| match e {
            Event::Undecodable { key, error } => Some(format!("{key}: {error}")),
            _ => None,
        })
        .collect();
    assert_eq!(
        reported,
        vec![format!(
            "manifest.{}.{}.0: manifest {}.{} lists 2 distinct splits in 1 chunks, its plan head says 3",
            m.term, m.version, m.term, m.version
        )]
    );
}

#[test]
fn p13_a_manifest_repeating_a_split_is_not_installed() {
    // The head names 3 splits; the chunk lists 3 entries, one of them twice, and the two it
    // names are Done: a count of entries would pass it, and the view would wait forever for a
    // third split it does not have. Distinct ids are counted.
    let (mut kv, chunks) = all_done_but(3, |_| false);
    let head: records::PlanHead =
        records::decode(&kv.get(Bucket::State, "plan.head").unwrap().value).unwrap();
    let m = head.manifest.unwrap();
    let (a, b) = (chunks[0][0].clone(), chunks[0][1].clone());
    let repeated = records::ManifestChunk { splits: vec![(a.clone(), 1), (a, 1), (b, 1)] };
    kv.put(Bucket::State, &keys::manifest(m.term, m.version, 0), &repeated);
    let mut r = Rig::new(cfg("w2", 1));
    r.kv = kv;
    r.expire = false;
    r.feed(Input::Start);
    r.advance(Duration::from_secs(1));
    assert_eq!(ended(&r), vec![]);
    assert_eq!(undecodable_events(&r), 1, "reported once: {:?}", r.events());
    assert_eq!(done_in_view(&r), Some(0), "not installed");
}

#[test]
fn p13_a_head_naming_splits_in_no_chunk_is_reported_and_never_completes() {
    // The head says 2 splits in 0 chunks (a corrupt or hand-written head).
    let (mut kv, _) = all_done_but(2, |_| false);
    let mut head: records::PlanHead =
        records::decode(&kv.get(Bucket::State, "plan.head").unwrap().value).unwrap();
    let mut m = head.manifest.unwrap();
    m.chunks = 0;
    head.manifest = Some(m);
    kv.put(Bucket::State, &keys::plan_head(), &head);
    let mut r = Rig::new(cfg("w2", 1));
    r.kv = kv;
    r.expire = false;
    r.feed(Input::Start);
    for _ in 0..3 {
        r.advance(Duration::from_secs(1));
    }
    assert_eq!(ended(&r), vec![], "{:?}", r.log);
    let reported: Vec<String> = r
        .events()
        .into_iter()
        .filter_map(|e| match e {
            Event::Undecodable { key, error } => Some(format!("{key}: {error}")),
            _ => None,
        })
        .collect();
    assert_eq!(
        reported,
        vec![format!(
            "plan.head: manifest {}.{} lists 0 distinct splits in 0 chunks, its plan head says 2",
            m.term, m.version
        )]
    );
}

#[test]
fn p13_a_chunk_read_of_a_failed_manifest_load_is_not_sent_again() {
    let (kv, _) = all_done_but(records::MANIFEST_CHUNK_LEN + 1, |_| false);
    let mut r = Rig::new(cfg("w2", 1));
    r.kv = kv;
    r.auto = false;
    r.expire = false;
    r.feed(Input::Start);
    let reads = apply_all_but(&mut r, is_manifest_read);
    assert_eq!(reads.len(), 2);
    // Chunk 0's read fails (a retry is queued, due before the next heartbeat), then chunk 1 is
    // answered absent: the load has failed, and the queued retry would be answered for nothing.
    r.answer(reads[0].0, Err(StoreError::Unavailable("no leader".into())));
    r.answer(reads[1].0, Ok(StoreReply::Value(None)));
    r.advance(Duration::from_millis(900));
    let again = apply_all_but(&mut r, is_manifest_read);
    assert_eq!(again, vec![], "no chunk read before the heartbeat drops the failed load");
}

/// Applies pending requests in order (and moves time on when none is pending) until one
/// `wanted` comes; it is taken out of `pending`, unanswered.
fn until_request_in_time(
    r: &mut Rig,
    wanted: impl Fn(Bucket, &StoreRequest) -> bool,
) -> (OpId, StoreRequest) {
    for _ in 0..400 {
        if let Some(i) = r.pending.iter().position(|(_, b, q)| wanted(*b, q)) {
            let (op, _, req) = r.pending.remove(i);
            return (op, req);
        }
        if r.pending.is_empty() {
            r.advance(Duration::from_millis(250));
        } else {
            r.apply_and_answer(0, None);
        }
    }
    panic!("the request never came: {:?}", r.pending)
}

fn is_head_write(_: Bucket, q: &StoreRequest) -> bool {
    matches!(q, StoreRequest::CompareAndSwap { key, .. } | StoreRequest::Create { key, .. } if *key == keys::plan_head())
}

fn is_head_read(_: Bucket, q: &StoreRequest) -> bool {
    matches!(q, StoreRequest::Get { key } if *key == keys::plan_head())
}

#[test]
fn p4_a_head_read_that_misses_the_head_seen_is_a_lagging_replica_and_decides_nothing() {
    // w1 planned and published a Final plan (term 1), then died; w2 finds it, takes the
    // leadership when w1's key expires, and bumps the term over the head it has seen.
    let mut r = running(2);
    let published = r.kv.get(Bucket::State, "plan.head").unwrap();
    let mut r2 = Rig::new(cfg("w2", 2));
    r2.kv = std::mem::take(&mut r.kv);
    r2.kv.watches.clear();
    r2.auto = false;
    r2.feed(Input::Start);
    let (bump, req) = until_request_in_time(&mut r2, is_head_write);
    assert!(
        matches!(&req, StoreRequest::CompareAndSwap { expected, .. } if *expected == published.revision),
        "{req:?}"
    );
    // Its answer is lost; the read that resolves it is slow. Meanwhile the plan watch is
    // reopened and its snapshot comes from a replica from before the head existed (the view
    // forgets the head; the revision seen must not be forgotten with it).
    r2.answer(bump, Err(StoreError::Indeterminate("no answer".into())));
    let (read, _) = until_request_in_time(&mut r2, is_head_read);
    r2.w.handle(r2.now, Input::WatchFailed { watch: WatchId::Plan });
    r2.w.handle(r2.now, Input::Watch { watch: WatchId::Plan, event: WatchEvent::SnapshotComplete });
    // Then the read is answered by a replica that has not got the head at all (sweep seed
    // 4496670).
    r2.answer(read, Ok(StoreReply::Value(None)));
    // Nothing is decided on it: no bump over an absent head (a create of term 1), no step down.
    assert!(!r2.pending.iter().any(|(_, b, q)| is_head_write(*b, q)), "{:?}", r2.pending);
    assert!(!r2.events().iter().any(|e| matches!(e, Event::Leadership { .. })), "{:?}", r2.events());
    // It reads again later; this replica is behind too, with an older head naming w2 as the
    // leader of term 1 (what a bump over an absent head would have written): not adopted.
    let (read, _) = until_request_in_time(&mut r2, is_head_read);
    let mut old: records::PlanHead = records::decode(&published.value).unwrap();
    old.leader = Owner { instance: id("w2"), incarnation: Incarnation(2) };
    old.status = records::PlanStatus::Planning;
    old.manifest = None;
    let stale = Entry { key: keys::plan_head(), value: records::encode(&old), revision: Revision(1) };
    r2.answer(read, Ok(StoreReply::Value(Some(stale))));
    assert!(!r2.pending.iter().any(|(_, b, q)| is_head_write(*b, q)), "{:?}", r2.pending);
    // The store answers truly from then on: w2 bumps the term over the published head, leads
    // term 2, and never lists the Final plan again.
    for _ in 0..40 {
        if r2.events().iter().any(|e| matches!(e, Event::Leadership { leader: true, .. })) {
            break;
        }
        if r2.pending.is_empty() {
            r2.advance(Duration::from_millis(250));
        } else {
            r2.apply_and_answer(0, None);
        }
    }
    assert!(r2.events().contains(&Event::Leadership { leader: true, term: 2 }), "{:?}", r2.events());
    assert!(!r2.log.iter().any(|a| matches!(a, Action::Plan { .. })), "P4: one listing per Final plan");
    let head: records::PlanHead =
        records::decode(&r2.kv.get(Bucket::State, "plan.head").unwrap().value).unwrap();
    assert_eq!((head.term, head.status), (2, records::PlanStatus::Published));
}

/// The splits counted missing in the gauges among `actions`, if they report any.
fn missing_in(actions: &[Action]) -> Option<u32> {
    actions.iter().rev().find_map(|a| match a {
        Action::Event(Event::Gauges { splits, .. }) => Some(splits.missing),
        _ => None,
    })
}

#[test]
fn p7_a_reopened_watch_streams_its_snapshot_into_the_view_and_forgets_at_its_end_what_it_did_not_show() {
    let mut r = running(3);
    let Some(Event::Gauges { splits, .. }) = r.last_gauges() else { panic!("gauges") };
    assert_eq!((splits.owned, splits.missing), (3, 0), "{splits:?}");
    // The splits watch fails; its new snapshot (fed by hand, event by event) shows s0, shows s1
    // and then its delete, and never shows s2.
    r.w.handle(r.now, Input::WatchFailed { watch: WatchId::Splits });
    let watch = WatchId::Splits;
    let s0 = r.kv.get(Bucket::State, "split.s0").expect("in the store");
    let s1 = r.kv.get(Bucket::State, "split.s1").expect("in the store");
    let s1_deleted = Revision(s1.revision.0 + 1000);
    let mut missing = Vec::new();
    for event in [
        WatchEvent::Put(s0),
        WatchEvent::Put(s1),
        WatchEvent::Delete {
            key: Key::new("split.s1").unwrap(),
            revision: s1_deleted,
            cause: DeleteCause::Deleted,
        },
    ] {
        let a = r.w.handle(r.now, Input::Watch { watch, event });
        missing.extend(missing_in(&a));
    }
    // During the snapshot the view takes what it shows (s1's delete, at its revision) and
    // keeps what it has not shown yet (s2).
    assert_eq!(missing.last(), Some(&1), "{missing:?}");
    let a = r.w.handle(r.now, Input::Watch { watch, event: WatchEvent::SnapshotComplete });
    // At its end, s1 (deleted during it) and s2 (never shown) are gone; s0 stays.
    assert_eq!(missing_in(&a), Some(2), "{a:?}");
    // s1's record as it was before the delete, from a lagging replica: older than the delete
    // the view noted, it decides nothing.
    let stale = r.kv.get(Bucket::State, "split.s1").expect("in the store");
    let a = r.w.handle(r.now, Input::Watch { watch, event: WatchEvent::Put(stale) });
    assert_eq!(missing_in(&a), None, "the stale record changed the view: {a:?}");
}

/// P7: the periodic resync reopens every watch (no listing beside the running watch), and the
/// worker goes on deciding while the new snapshots stream in. A listing cut at one revision
/// while the old watch went on forgot, at its end, the records the watch had delivered after
/// the cut: at a million splits the leader was still creating records during a resync, and the
/// 503 it forgot were never claimed (issue 32, the T6 stall).
#[test]
fn p7_a_resync_reopens_the_watches_keeps_what_they_deliver_meanwhile_and_decides_throughout() {
    let mut r = running(6); // max_in_flight 4: s5..s2 run, s0 and s1 wait
    assert_eq!(r.started().len(), 4, "{:?}", r.started());
    let since = r.kv.history.len();
    let running = r.started();
    assert_eq!(until_resync(&mut r), WatchId::ALL.to_vec(), "every watch is reopened");
    assert!(
        !r.kv.history[since..].iter().any(|(_, q)| matches!(q, StoreRequest::List { .. })),
        "no listing beside the watches: {:?}",
        &r.kv.history[since..]
    );
    // The leases and plan snapshots arrive whole; the splits snapshot, cut now, only begins.
    for watch in [WatchId::Leases, WatchId::Plan] {
        feed_snapshot(&mut r, watch);
    }
    let cut = r.kv.list(Bucket::State, &WatchId::Splits.prefix());
    let (first, rest) = cut.split_at(2);
    for e in first {
        r.feed(Input::Watch { watch: WatchId::Splits, event: WatchEvent::Put(e.clone()) });
    }
    // A lane finishes meanwhile: its end is written (the new watch delivers it live, after the
    // cut) and the worker claims a waiting split at once, without waiting for the snapshot.
    let (split, epoch) = running[0].clone();
    r.feed(Input::Finish { split: split.clone(), epoch, progress: Bytes::from_static(b"end") });
    assert_eq!(r.kv.record(split.as_str()).state, SplitState::Done);
    assert_eq!(r.started().len(), 1, "a claim during the snapshot: {:?}", r.log);
    // The rest of the snapshot as cut (older than what the live events brought), then its end:
    // what the live events delivered stays.
    for e in rest {
        r.feed(Input::Watch { watch: WatchId::Splits, event: WatchEvent::Put(e.clone()) });
    }
    let a = r.feed(Input::Watch { watch: WatchId::Splits, event: WatchEvent::SnapshotComplete });
    let Some(Event::Gauges { splits, .. }) = r.last_gauges() else { panic!("gauges: {a:?}") };
    assert_eq!((splits.missing, splits.done, splits.owned), (0, 1, 4), "{splits:?}");
    // Every split runs to its end and the job completes on the view the resync left.
    r.hold_snapshots = false;
    for _ in 0..6 {
        let Some((split, epoch)) = running
            .iter()
            .cloned()
            .chain(r.started())
            .find(|(s, _)| r.kv.record(s.as_str()).state != SplitState::Done)
        else {
            break;
        };
        r.feed(Input::Finish { split, epoch, progress: Bytes::from_static(b"end") });
    }
    assert!(r.log.iter().any(|a| matches!(a, Action::Finished(Outcome::Complete))), "{:?}", r.events());
}

/// Feeds a held snapshot of `watch` whole, as the store holds it now, and its end.
fn feed_snapshot(r: &mut Rig, watch: WatchId) {
    for e in r.kv.list(watch.bucket(), &watch.prefix()) {
        r.feed(Input::Watch { watch, event: WatchEvent::Put(e) });
    }
    r.feed(Input::Watch { watch, event: WatchEvent::SnapshotComplete });
}

/// Runs `r` (auto mode, snapshots held) until its periodic resync asks for the watches again;
/// returns the watches it reopened.
fn until_resync(r: &mut Rig) -> Vec<WatchId> {
    r.hold_snapshots = true;
    r.take_log();
    let resync = r.w.config().tuning.resync_interval();
    let mut waited = Duration::ZERO;
    while !r.log.iter().any(|a| matches!(a, Action::Watch { .. })) {
        assert!(waited <= resync, "no resync within {resync:?}");
        r.advance(Duration::from_secs(1));
        waited += Duration::from_secs(1);
    }
    r.log.iter().filter_map(|a| if let Action::Watch { watch } = a { Some(*watch) } else { None }).collect()
}

/// P7: a resync does not reopen a watch whose snapshot is still streaming (the next one
/// reopens it once that snapshot ended), and a watch failing during a resync snapshot makes the
/// view unready until its new snapshot ends.
#[test]
fn p7_a_resync_skips_a_watch_still_streaming_and_a_failure_during_it_pauses_decisions() {
    let mut r = running(6);
    let (split, epoch) = r.started()[0].clone();
    assert_eq!(until_resync(&mut r), WatchId::ALL.to_vec());
    // The leases and plan snapshots end; the splits snapshot is still streaming at the next
    // resync, which reopens the other two only.
    for watch in [WatchId::Leases, WatchId::Plan] {
        feed_snapshot(&mut r, watch);
    }
    assert_eq!(until_resync(&mut r), vec![WatchId::Leases, WatchId::Plan], "{:?}", r.log);
    // The splits watch fails meanwhile: reopened at once, and nothing is claimed until its
    // new snapshot ends, even when a lane finishes and a split waits.
    r.take_log();
    r.feed(Input::WatchFailed { watch: WatchId::Splits });
    assert!(r.log.contains(&Action::Watch { watch: WatchId::Splits }), "{:?}", r.log);
    r.feed(Input::Finish { split, epoch, progress: Bytes::from_static(b"end") });
    assert_eq!(r.started().len(), 0, "decided on an unready view: {:?}", r.log);
    feed_snapshot(&mut r, WatchId::Splits);
    assert_eq!(r.started().len(), 1, "a claim once the snapshot ended: {:?}", r.log);
}

/// P7: a record deleted while a resync's snapshot streams (the store passes the delete on
/// before `SnapshotComplete`) is gone from the view at its end, although the snapshot showed it.
#[test]
fn p7_a_record_deleted_during_a_resync_snapshot_is_gone_at_its_end() {
    let mut r = running(6);
    until_resync(&mut r);
    for watch in [WatchId::Leases, WatchId::Plan] {
        feed_snapshot(&mut r, watch);
    }
    let cut = r.kv.list(Bucket::State, &WatchId::Splits.prefix());
    for e in &cut {
        r.feed(Input::Watch { watch: WatchId::Splits, event: WatchEvent::Put(e.clone()) });
    }
    // An operator deletes a waiting split's record (s0 waits: max_in_flight 4 of 6).
    let s0 = cut.iter().find(|e| e.key.as_str() == "split.s0").expect("s0 listed").clone();
    let deleted = Revision(s0.revision.0 + 10_000);
    r.feed(Input::Watch {
        watch: WatchId::Splits,
        event: WatchEvent::Delete { key: s0.key.clone(), revision: deleted, cause: DeleteCause::Deleted },
    });
    r.feed(Input::Watch { watch: WatchId::Splits, event: WatchEvent::SnapshotComplete });
    let Some(Event::Gauges { splits, .. }) = r.last_gauges() else { panic!("gauges") };
    assert_eq!(splits.missing, 1, "{splits:?}");
    // The snapshot's own (older) value of s0, from a lagging replica, does not bring it back.
    r.feed(Input::Watch { watch: WatchId::Splits, event: WatchEvent::Put(s0) });
    let Some(Event::Gauges { splits, .. }) = r.last_gauges() else { panic!("gauges") };
    assert_eq!(splits.missing, 1, "{splits:?}");
}

/// P4: a round of more writes than its window (two per split, then the chunks), with some
/// writes failing on the way, writes every descriptor and record before any chunk, keeps at
/// most 64 writes in flight, and publishes a manifest of every split in whole chunks and a
/// last partial one (the writes are encoded as they are sent, not before: issue 32).
#[test]
fn p4_a_round_larger_than_its_window_with_failed_writes_publishes_every_split_once() {
    let mut c = cfg("w1", 1);
    c.tuning.manifest_chunk_len = 3; // 77 chunks: more than the window too
    let mut r = Rig::new(c);
    r.plan = Some(plan(230, PlanKind::Final));
    r.auto = false;
    r.feed(Input::Start);
    let is_plan_write = |q: &StoreRequest| {
        matches!(q, StoreRequest::Create { key, .. }
            if ["desc.", "split.", "manifest."].iter().any(|p| key.as_str().starts_with(p)))
    };
    let (mut failed, mut answered, mut max_in_flight) = (std::collections::BTreeSet::new(), 0, 0);
    let mut chunk_before_every_record = false;
    for _ in 0..20_000 {
        if r.kv.get(Bucket::State, "plan.head").is_some_and(|e| {
            records::decode::<records::PlanHead>(&e.value).unwrap().status == records::PlanStatus::Published
        }) {
            break;
        }
        max_in_flight = max_in_flight.max(r.pending.iter().filter(|(_, _, q)| is_plan_write(q)).count());
        let Some((op, _, req)) = r.pending.first().cloned() else {
            r.advance(Duration::from_millis(100));
            continue;
        };
        if let StoreRequest::Create { key, .. } = &req
            && is_plan_write(&req)
        {
            answered += 1;
            if key.as_str().starts_with("manifest.")
                && (0..230).any(|i| r.kv.get(Bucket::State, &format!("split.s{i}")).is_none())
            {
                chunk_before_every_record = true;
            }
            if answered % 10 == 0 && failed.insert(key.clone()) {
                r.answer(op, Err(StoreError::Unavailable("no stream leader".into())));
                continue;
            }
        }
        r.apply(op);
    }
    let head: records::PlanHead =
        records::decode(&r.kv.get(Bucket::State, "plan.head").expect("published").value).unwrap();
    let m = head.manifest.expect("a manifest");
    assert_eq!((head.status, m.split_count, m.chunks), (records::PlanStatus::Published, 230, 77));
    assert!(!failed.is_empty() && !chunk_before_every_record, "failed {failed:?}");
    assert!(max_in_flight <= 64 && max_in_flight > 3, "{max_in_flight} plan writes in flight");
    let mut listed = Vec::new();
    for chunk in 0..m.chunks {
        let e = r.kv.get(Bucket::State, keys::manifest(m.term, m.version, chunk).as_str()).expect("chunk");
        let c: records::ManifestChunk = records::decode(&e.value).unwrap();
        assert!(c.splits.len() == 3 || chunk == m.chunks - 1, "chunk {chunk}: {}", c.splits.len());
        listed.extend(c.splits.into_iter().map(|(id, _)| id));
    }
    listed.sort();
    listed.dedup();
    assert_eq!(listed.len(), 230);
    for i in 0..230 {
        assert!(r.kv.get(Bucket::State, &format!("desc.s{i}")).is_some(), "descriptor of s{i}");
        assert!(r.kv.get(Bucket::State, &format!("split.s{i}")).is_some(), "record of s{i}");
    }
}

/// P4, P13: a planner that finds nothing publishes an empty Final manifest (no chunk is
/// written) and the worker sees the job complete.
#[test]
fn p4_an_empty_final_plan_publishes_no_chunk_and_completes() {
    let mut r = running(0);
    let head: records::PlanHead =
        records::decode(&r.kv.get(Bucket::State, "plan.head").expect("published").value).unwrap();
    let m = head.manifest.expect("a manifest");
    assert_eq!((head.status, m.split_count, m.chunks), (records::PlanStatus::Published, 0, 0));
    assert!(r.kv.list(Bucket::State, &keys::manifest_prefix()).is_empty(), "no chunk for no split");
    assert!(r.log.contains(&Action::Finished(Outcome::Complete)), "{:?}", r.log);
}
