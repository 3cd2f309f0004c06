//! Leadership (P4): the leader lease (won by create, kept by renewals, P7), the term bump on the
//! plan head that fences a deposed leader's writes (I9), and stepping down.

use crate::ids::{OpId, Revision};
use crate::io::Event;
use crate::plan::PlanKind;
use crate::records::{self, LeaderRecord, ManifestRef, PlanHead, PlanStatus, keys};
use crate::store::{Bucket, StoreRequest, StoreResult};
use crate::time::Timestamp;

use super::outbox::{Pending, Read, Written};
use super::plan::PlanStage;
use super::resolve::LeaseRead;
use super::{Phase, Worker};

/// This worker's leadership.
#[derive(Debug)]
pub(super) struct Leading {
    /// The revision of our last write to the leader lease.
    pub(super) rev: Revision,
    /// A renewal (or its resolving read) in flight.
    pub(super) renewing: Option<OpId>,
    /// P11 for the leader lease: past this, the worker steps down.
    pub(super) trusted_until: Timestamp,
    /// Send time of the oldest renewal since the last acknowledged one.
    pub(super) unacked_since: Option<Timestamp>,
    /// The plan head as this leader last wrote it, with its revision.
    pub(super) head: Option<(Revision, PlanHead)>,
    /// The revision of the head write that started this leader's term: state written before
    /// it is from earlier terms (P4's garbage collection deletes nothing newer).
    pub(super) term_rev: Option<Revision>,
    pub(super) stage: PlanStage,
    /// When an Open plan is re-planned next.
    pub(super) replan_at: Option<Timestamp>,
    /// A manifest just published whose predecessors are to be garbage-collected once loaded.
    pub(super) gc_for: Option<ManifestRef>,
    /// The last manifest version this leader wrote (published or not).
    pub(super) last_version: u64,
    /// Which leadership stint of this worker this is (results of older stints are ignored).
    pub(super) stint: u64,
    /// Consecutive planner failures (backoff).
    pub(super) plan_failures: u32,
}

impl Worker {
    /// P4: lead (drive the plan), or try to become the leader when nobody is.
    pub(super) fn leadership(&mut self, now: Timestamp) {
        if self.leader.is_some() {
            return self.drive_plan(now);
        }
        if self.leader_attempt.is_some() || self.leader_retry_at.is_some_and(|at| now < at) {
            return;
        }
        self.leader_retry_at = None;
        if let Some((rev, l)) = &self.view.leader {
            // The leader key still names this process (we stepped down on a lapse of trust, or
            // a renewal's answer was lost): renew it by CAS rather than wait for it to expire.
            if l.owner == self.me {
                let value = records::encode(&LeaderRecord { owner: self.me.clone(), term: 0 });
                let request = StoreRequest::CompareAndSwap {
                    key: keys::leader(),
                    expected: *rev,
                    value,
                    ttl: self.ttl(),
                };
                let op = self.outbox.send(Bucket::Lease, request, Pending::LeaderCreate { sent: now });
                self.leader_attempt = Some(op);
            }
            return;
        }
        let value = records::encode(&LeaderRecord { owner: self.me.clone(), term: 0 });
        let op = self.outbox.send(
            Bucket::Lease,
            StoreRequest::Create { key: keys::leader(), value, ttl: self.ttl() },
            Pending::LeaderCreate { sent: now },
        );
        self.leader_attempt = Some(op);
    }

    /// P4: the leader lease is ours, in doubt (read it), or someone else's.
    pub(super) fn on_leader_create(
        &mut self,
        now: Timestamp,
        op: OpId,
        sent: Timestamp,
        result: StoreResult,
    ) {
        if self.leader_attempt != Some(op) {
            return;
        }
        self.leader_attempt = None;
        match Written::of(result) {
            Written::Applied(rev) => self.become_leader(now, rev, sent),
            Written::InDoubt => {
                let op = self.outbox.send(
                    Bucket::Lease,
                    StoreRequest::Get { key: keys::leader() },
                    Pending::LeaderResolve { sent },
                );
                self.leader_attempt = Some(op);
            }
            // Someone else leads (the watch will show it), or a write to the key is in process
            // at the stream leader, or the store is unavailable: try again after the backoff.
            Written::Conflict | Written::Unavailable => {
                self.leader_retry_at = Some(now + self.outbox.retry_backoff());
            }
            // A refusal no retry can change (a full bucket): stop, saying why.
            Written::Fatal(e) => self.fatal_store(e),
        }
    }

    /// P4, P7: the leader key decides an in-doubt create or renewal.
    pub(super) fn on_leader_resolve(&mut self, op: OpId, sent: Timestamp, result: StoreResult) {
        let is_attempt = self.leader_attempt == Some(op);
        let is_renewal = self.leader.as_ref().is_some_and(|l| l.renewing == Some(op));
        if !is_attempt && !is_renewal {
            return;
        }
        // A revision older than the watch showed (or, for a renewal, than ours) comes from a
        // lagging replica: it decides nothing, as a failed read.
        let ours = self.leader.as_ref().filter(|_| is_renewal).map_or(Revision(0), |l| l.rev);
        let known = self.view.leader_seen.max(ours);
        let (mine, undecided) = match LeaseRead::<LeaderRecord>::of(result, Some(known)) {
            LeaseRead::Found(rev, Some(l)) if l.owner == self.me => (Some((rev, l)), false),
            LeaseRead::Found(..) | LeaseRead::Gone => (None, false),
            LeaseRead::Lagging | LeaseRead::Unavailable => (None, true),
        };
        if is_attempt {
            // The key names us, but which write put it there cannot be told: this attempt, an
            // earlier one landing late (sent earlier), or none since the revision this CAS
            // expected (not landed yet). Trust counted from this attempt's send time could
            // outlive the key (P11). Leadership waits for a write whose answer is known: the
            // next round re-takes the key by CAS at the revision read.
            self.leader_attempt = None;
            if let Some((rev, l)) = mine {
                self.view.leader_seen = self.view.leader_seen.max(rev);
                if self.view.leader.as_ref().is_none_or(|(r, _)| *r <= rev) {
                    self.view.leader = Some((rev, l));
                }
            }
            return;
        }
        let mine = mine.map(|(rev, _)| rev);
        let trust = self.cfg.tuning.lease_trust();
        let l = self.leader.as_mut().expect("leader");
        l.renewing = None;
        match mine {
            _ if undecided => {}
            Some(rev) => {
                if rev != l.rev {
                    // Any renewal since the last acknowledged one may have written it (P11).
                    l.rev = rev;
                    l.trusted_until = l.unacked_since.take().unwrap_or(sent) + trust;
                }
            }
            None => self.step_down(),
        }
    }

    /// P4: a new leader first bumps the term. A worker that is leaving gives the lease back.
    /// One whose answer came too late to trust the lease (P11: trust counts from the send
    /// time; a stalled link delivered it after the trust it would give had lapsed) does not
    /// lead on it: it takes the key again after the backoff rather than write the plan unled.
    fn become_leader(&mut self, now: Timestamp, rev: Revision, sent: Timestamp) {
        if self.phase == Phase::Leaving {
            return self.retire(keys::leader(), rev);
        }
        if sent + self.cfg.tuning.lease_trust() <= now {
            // Not given back by a delete: a retry of that delete could remove the key after we
            // take it again. The key names us, so after the backoff `leadership` takes it back
            // by CAS (a fresh TTL, and trust from that send), unless it expired meanwhile.
            let backoff = self.outbox.retry_backoff();
            self.leader_retry_at = Some(now + backoff);
            return;
        }
        self.leader = Some(Box::new(Leading {
            rev,
            renewing: None,
            unacked_since: None,
            trusted_until: sent + self.cfg.tuning.lease_trust(),
            head: None,
            term_rev: None,
            stage: PlanStage::Bumping,
            replan_at: None,
            gc_for: None,
            last_version: 0,
            stint: self.next_plan_request,
            plan_failures: 0,
        }));
        self.next_plan_request += 1;
        self.bump_term(self.view.plan_head.clone());
    }

    /// P7: renew the leader lease (part of every heartbeat).
    pub(super) fn renew_leader(&mut self, now: Timestamp) {
        let Some(l) = &self.leader else { return };
        if l.renewing.is_some() {
            return;
        }
        let value = records::encode(&LeaderRecord {
            owner: self.me.clone(),
            term: l.head.as_ref().map_or(0, |(_, h)| h.term),
        });
        let request =
            StoreRequest::CompareAndSwap { key: keys::leader(), expected: l.rev, value, ttl: self.ttl() };
        let op = self.outbox.send(Bucket::Lease, request, Pending::LeaderRenew { sent: now });
        let l = self.leader.as_mut().expect("leader");
        l.renewing = Some(op);
        l.unacked_since.get_or_insert(now);
    }

    pub(super) fn on_leader_renew(&mut self, op: OpId, sent: Timestamp, result: StoreResult) {
        let Some(l) = self.leader.as_mut() else { return };
        if l.renewing != Some(op) {
            return;
        }
        l.renewing = None;
        match Written::of(result) {
            Written::Applied(rev) => {
                l.rev = rev;
                l.trusted_until = sent + self.cfg.tuning.lease_trust();
                l.unacked_since = None;
            }
            Written::Conflict | Written::InDoubt => {
                let op = self.outbox.send(
                    Bucket::Lease,
                    StoreRequest::Get { key: keys::leader() },
                    Pending::LeaderResolve { sent },
                );
                self.leader.as_mut().expect("leader").renewing = Some(op);
            }
            Written::Unavailable => {}
            Written::Fatal(e) => self.fatal_store(e),
        }
    }

    /// P11 for the leader lease: not renewed in time, so step down.
    pub(super) fn leader_trust_lapsed(&mut self, now: Timestamp) {
        if self.leader.as_ref().is_some_and(|l| l.trusted_until <= now) {
            self.step_down();
        }
    }

    /// Stops leading (the lease expires, or someone else took it).
    pub(super) fn step_down(&mut self) {
        if let Some(l) = self.leader.take() {
            let term = l.head.as_ref().map_or(0, |(_, h)| h.term);
            self.outbox.event(Event::Leadership { leader: false, term });
        }
    }

    /// P4: a head write (term bump or publication) landed, or the read decides what happened.
    pub(super) fn on_head_write(&mut self, now: Timestamp, head: PlanHead, result: StoreResult) {
        if self.leader.is_none() {
            return;
        }
        match Written::of(result) {
            Written::Applied(rev) => self.head_written(now, rev, head),
            Written::Fatal(e) => self.fatal_store(e),
            // Mismatch, in doubt or unavailable: the read decides what happened (P8-style).
            Written::Conflict | Written::InDoubt | Written::Unavailable => {
                self.outbox.send(
                    Bucket::State,
                    StoreRequest::Get { key: keys::plan_head() },
                    Pending::HeadRead { stint: self.stint(), attempted: head },
                );
            }
        }
    }

    pub(super) fn head_written(&mut self, now: Timestamp, rev: Revision, head: PlanHead) {
        let Some(l) = self.leader.as_mut() else { return };
        let first = l.head.as_ref().is_none_or(|(_, h)| h.term != head.term);
        let publishing = matches!(l.stage, PlanStage::Publishing);
        l.head = Some((rev, head.clone()));
        self.view.saw_plan_head(rev, false);
        if self.view.plan_head.as_ref().is_none_or(|(r, _)| *r <= rev) {
            self.view.plan_head = Some((rev, head.clone()));
        }
        if first {
            l.term_rev = Some(rev);
            self.outbox.event(Event::Leadership { leader: true, term: head.term });
        }
        let l = self.leader.as_mut().expect("leader");
        if publishing {
            let m = head.manifest.expect("published head has a manifest");
            l.stage = PlanStage::Idle;
            l.gc_for = Some(m);
            if m.kind == PlanKind::Open {
                l.replan_at = Some(now + self.cfg.tuning.replan_interval);
            }
            self.outbox.event(Event::PlanPublished {
                term: m.term,
                version: m.version,
                splits: m.split_count,
            });
        } else {
            l.stage =
                if head.status == PlanStatus::Planning { PlanStage::WaitManifest } else { PlanStage::Idle };
        }
    }

    /// P4, I9: after a failed or in-doubt head write: ours landed; still our term (write again
    /// against the fresh revision); no term yet (bump again); or deposed.
    pub(super) fn on_head_read(&mut self, now: Timestamp, attempted: PlanHead, result: StoreResult) {
        let Some(l) = self.leader.as_mut() else { return };
        let current = match Read::of(result) {
            Read::Found(e) => match records::decode::<PlanHead>(&e.value) {
                Ok(h) => Some((e.revision, h)),
                Err(err) => {
                    self.note_undecodable(Bucket::State, &e, &err);
                    return self.step_down();
                }
            },
            Read::Absent => None,
            // Read again later; the write in question (a term bump or a publication) is still
            // the step in progress: re-planning here would list a plan twice.
            Read::Failed(_) => return self.read_head_again(now, attempted),
        };
        // A lagging replica: read again. Behind what this stint wrote, or behind what the worker
        // has seen of the head (its watch, its earlier stints): a read that misses a head seen,
        // or answers an older one, decides nothing. Acting on it, a worker that stepped down
        // and led again bumped a term over an absent head, and adopted an old head equal to its
        // bump as its own write: it planned again over a Final plan (sweep seed 4496670). An
        // operator's deletion of the head reaches the view through the watch and clears it.
        // (The floor survives resyncs: a listing that lacks the head may lag as well.)
        let (seen, deleted) = self.view.plan_head_seen;
        let known = l.head.as_ref().map_or(seen, |(r, _)| (*r).max(seen));
        let lagging = match &current {
            Some((rev, _)) => *rev < known,
            None => known > Revision(0) && !(deleted && seen == known),
        };
        if lagging {
            return self.read_head_again(now, attempted);
        }
        let my_term = l.head.as_ref().map(|(_, h)| h.term);
        let known_rev = l.head.as_ref().map(|(r, _)| *r);
        match current {
            // Our in-doubt write landed.
            Some((rev, h)) if h == attempted => self.head_written(now, rev, h),
            // Still our term and nobody else wrote (only the term's leader writes the head):
            // send the same write against the fresh revision. If the head has not moved since
            // our last write, the refusal came from a write still in process at the stream
            // leader (ours in doubt): wait the retry backoff rather than hammer it.
            Some((rev, h)) if my_term == Some(h.term) && h.leader == self.me && attempted.term == h.term => {
                let request = StoreRequest::CompareAndSwap {
                    key: keys::plan_head(),
                    expected: rev,
                    value: records::encode(&attempted),
                    ttl: None,
                };
                self.send_head_write(now, request, attempted, known_rev == Some(rev));
            }
            // No term established yet: bump against what is there now (after the backoff if it
            // is still the head our bump set out to replace: the refusal was not someone's bump).
            current if my_term.is_none() => {
                let unmoved =
                    current.as_ref().map_or(attempted.term == 1, |(_, h)| attempted.term == h.term + 1);
                let (request, head) = Self::term_bump(&self.me, current);
                self.send_head_write(now, request, head, unmoved);
            }
            // Someone else bumped the term: we are deposed (I9).
            _ => self.step_down(),
        }
    }

    /// Sends a head write now, or after the retry backoff.
    fn send_head_write(&mut self, now: Timestamp, request: StoreRequest, head: PlanHead, later: bool) {
        let pending = Pending::HeadWrite { stint: self.stint(), head };
        if later {
            self.outbox.retry_later(now, Bucket::State, request, pending);
        } else {
            self.outbox.send(Bucket::State, request, pending);
        }
    }

    /// P4: reads the plan head again after a while (its last read decided nothing).
    fn read_head_again(&mut self, now: Timestamp, attempted: PlanHead) {
        let pending = Pending::HeadRead { stint: self.stint(), attempted };
        self.outbox.retry_later(now, Bucket::State, StoreRequest::Get { key: keys::plan_head() }, pending);
    }
}
