//! The fault injector of the safety phase: every fault the world can do to a worker, its link
//! or the store, drawn at random and counted in the report.

use std::time::Duration;

use etl_coordination_core::{Bucket, Input};

use crate::fault::Fault;

use super::net::bi;
use super::stuck::Stuck;
use super::{Ev, Status, World, ms};

impl World {
    pub(crate) fn live_slots(&self) -> Vec<usize> {
        (0..self.slots.len())
            .filter(|&i| self.slots[i].status == Status::Running && !self.slots[i].draining)
            .collect()
    }

    pub(crate) fn crash(&mut self, slot: usize, restart: bool) {
        let s = &mut self.slots[slot];
        if !matches!(s.status, Status::Running | Status::Paused) {
            return;
        }
        s.core = None;
        s.lanes.clear();
        s.core_lanes.clear();
        s.inbox.clear();
        s.tick_at = None;
        s.status = Status::Crashed { restart };
        s.life += 1;
        self.subs.retain(|x| x.slot != slot);
        if restart {
            let delay = ms(self.rng.range(200, self.opts.lease_secs * 2000));
            self.schedule(delay, Ev::Restart { slot });
        }
    }

    fn pick(&mut self, live: &[usize]) -> usize {
        live[self.rng.range(0, live.len() as u64 - 1) as usize]
    }

    pub(crate) fn inject_fault(&mut self) {
        // (Drawn only in runs with foreign writes, so other runs keep their fault sequence.)
        if self.opts.foreign_writes && self.rng.chance(0.08) {
            return self.overwrite_record();
        }
        let live = self.live_slots();
        let roll = self.rng.range(0, 129);
        let lease = self.opts.lease_secs * 1000;
        match roll {
            0..=19 if !live.is_empty() => {
                let slot = self.pick(&live);
                let r = self.rng.range(0, 9);
                if r < 7 {
                    self.fault(Fault::CrashRestartSameId);
                    self.crash(slot, true);
                } else if r < 9 || live.len() == 1 {
                    self.fault(Fault::CrashRestartNewId);
                    let id = self.new_instance_id();
                    self.slots[slot].restart_as = Some(id);
                    self.crash(slot, true);
                } else {
                    self.fault(Fault::CrashForGood);
                    self.crash(slot, false);
                }
            }
            20..=34 if !live.is_empty() => {
                let slot = self.pick(&live);
                let (kind, dur) = if self.rng.chance(0.6) {
                    (Fault::PauseLongerThanLease, ms(self.rng.range(lease * 12 / 10, lease * 3)))
                } else {
                    (Fault::PauseShort, ms(self.rng.range(50, lease / 2)))
                };
                self.fault(kind);
                self.slots[slot].status = Status::Paused;
                self.schedule(dur, Ev::Resume { slot });
            }
            35..=44 if self.now >= self.outage_until => {
                let (kind, dur) = if self.rng.chance(0.5) {
                    (Fault::StoreOutageShort, ms(self.rng.range(100, lease / 2)))
                } else {
                    (Fault::StoreOutageLong, ms(self.rng.range(lease * 12 / 10, lease * 5 / 2)))
                };
                self.fault(kind);
                self.outage_until = self.now + dur;
                // Every watch breaks with the connection.
                for slot in 0..self.slots.len() {
                    self.break_watches(slot, None);
                }
            }
            45..=59 if !self.subs.is_empty() => {
                self.fault(Fault::WatchDropped);
                let i = self.rng.range(0, self.subs.len() as u64 - 1) as usize;
                let s = self.subs.remove(i);
                let d = ms(self.rng.range(1, 50));
                let input = Input::WatchFailed { watch: s.watch };
                self.schedule(d, Ev::ToWatch { slot: s.slot, life: s.life, generation: s.generation, input });
            }
            60..=72
                if self.slots.iter().filter(|s| s.status != Status::Finished).count()
                    < self.opts.max_workers =>
            {
                self.fault(Fault::ScaleUp);
                let id = self.new_instance_id();
                self.add_worker(id);
            }
            73..=82 if live.len() > 1 => {
                self.fault(Fault::ScaleDownDrain);
                let slot = self.pick(&live);
                self.slots[slot].draining = true;
                self.deliver(slot, Input::Drain);
            }
            83..=92 => {
                let leader = live
                    .iter()
                    .copied()
                    .find(|&i| self.slots[i].core.as_ref().is_some_and(|c| c.is_leader()));
                if let Some(slot) = leader {
                    self.fault(Fault::LeaderKilled);
                    self.crash(slot, true);
                }
            }
            93..=100 if !live.is_empty() => {
                // One worker cut off from the store while the others go on.
                let slot = self.pick(&live);
                let dur = if self.rng.chance(0.5) {
                    ms(self.rng.range(100, lease / 2))
                } else {
                    ms(self.rng.range(lease, lease * 3))
                };
                self.fault(Fault::PartitionOneWorker);
                self.slots[slot].link.cut_until = self.now + dur;
                self.break_watches(slot, None);
            }
            101..=107 if !live.is_empty() => {
                // One worker's link stalls: its requests, answers and watch events are held and
                // then delivered late, in order (writes land after their timeout).
                let slot = self.pick(&live);
                let dur = ms(self.rng.range(200, lease * 2));
                self.fault(Fault::LinkStalled);
                let l = &mut self.slots[slot].link;
                l.hold_until = l.hold_until.max(self.now + dur);
            }
            108..=112 if !live.is_empty() => {
                let slot = self.pick(&live);
                let dur = ms(self.rng.range(100, lease * 2));
                self.fault(Fault::WritesFailReadsSucceed);
                self.slots[slot].link.writes_fail_until = self.now + dur;
            }
            113..=117 if !live.is_empty() => {
                // One bucket unreachable, for one worker or for all.
                let bucket = if self.rng.chance(0.5) { Bucket::State } else { Bucket::Lease };
                let dur = ms(self.rng.range(100, lease * 2));
                let all = self.rng.chance(0.3);
                self.fault(if all { Fault::BucketUnreachableForAll } else { Fault::BucketUnreachableForOne });
                let slots = if all { live.clone() } else { vec![self.pick(&live)] };
                for slot in slots {
                    self.slots[slot].link.bucket_down[bi(bucket)] = self.now + dur;
                    self.break_watches(slot, Some(bucket));
                }
            }
            118..=123 if !live.is_empty() => {
                // A worker's monotonic clock jumps forward (a VM resumed, a slewed clock).
                let slot = self.pick(&live);
                let jump = self.rng.range(50_000, lease * 1500);
                self.fault(Fault::ClockJumpForward);
                if self.slots[slot].lanes.values().any(|l| l.failing.is_some()) {
                    // A lane waiting out an outage sees its budget run out sooner: the same
                    // outage may charge its split once more (one more outage, for the bound).
                    self.data_outages += 1;
                }
                self.slots[slot].clock.jump(jump);
                let life = self.slots[slot].life;
                self.slots[slot].tick_at = Some(self.now);
                self.schedule(Duration::ZERO, Ev::Tick { slot, life });
            }
            124..=128 => {
                // A stream's leader loses its quorum: writes wait and land late or never.
                let bucket = if self.rng.chance(0.5) { Bucket::State } else { Bucket::Lease };
                if self.stuck[bi(bucket)].is_none() {
                    let t = self.opts.op_timeout.as_millis() as u64;
                    let dur = ms(self.rng.range(t / 2, (t * 2).max(lease * 2)));
                    self.fault(match bucket {
                        Bucket::State => Fault::StreamLeaderStuckState,
                        Bucket::Lease => Fault::StreamLeaderStuckLease,
                    });
                    let snapshot = self.kv(bucket).clone();
                    let until = self.now + dur;
                    let stuck = if self.rng.chance(0.4) {
                        // The leader lost its followers; every worker talks to it.
                        Stuck {
                            until,
                            pending: Vec::new(),
                            everyone: true,
                            isolated: Vec::new(),
                            elected_at: None,
                            snapshot,
                        }
                    } else {
                        // Its node is cut off with the workers connected to it (one node in three);
                        // the others elect a new leader, maybe within the window.
                        self.fault(Fault::StreamLeaderNodeCutOff);
                        let isolated: Vec<usize> =
                            live.iter().copied().filter(|_| self.rng.chance(1.0 / 3.0)).collect();
                        let elected = self.now + ms(self.rng.range(500, lease * 2));
                        let elected_at = (elected < until).then_some(elected);
                        Stuck { until, pending: Vec::new(), everyone: false, isolated, elected_at, snapshot }
                    };
                    self.stuck[bi(bucket)] = Some(stuck);
                    self.schedule(dur, Ev::StreamRecovered { bucket });
                }
            }
            _ => {}
        }
    }

    pub(crate) fn resume(&mut self, slot: usize) {
        if self.slots[slot].status != Status::Paused {
            return;
        }
        self.slots[slot].status = Status::Running;
        // The process runs again: its timers are overdue, so the coordinator's tick comes first
        // (the inputs that queued up follow in order).
        self.slots[slot].tick_at = None;
        self.deliver(slot, Input::Tick);
        let inbox = std::mem::take(&mut self.slots[slot].inbox);
        for ev in inbox {
            if self.slots[slot].status != Status::Running {
                break;
            }
            match ev {
                Ev::Tick { slot, life } => {
                    if self.slots[slot].life == life {
                        self.slots[slot].tick_at = None;
                        self.deliver(slot, Input::Tick);
                    }
                }
                other => self.dispatch(other),
            }
        }
        // Make sure the worker gets a tick for whatever is overdue.
        let life = self.slots[slot].life;
        self.slots[slot].tick_at = Some(self.now);
        self.schedule(Duration::ZERO, Ev::Tick { slot, life });
    }
}
