//! Expiry (late, and erasing a renewal that lands just before it) and watches: the store's
//! events to the history, the checker and each worker's subscriptions.

use std::time::Duration;

use etl_coordination_core::{Bucket, Key, Revision, Timestamp, WatchEvent, WatchId};

use super::net::bi;
use super::{Ev, World, ms, us};
use crate::check::Observation;
use crate::fault::Fault;

/// A watch subscription of one worker.
pub(crate) struct Sub {
    pub slot: usize,
    pub life: u32,
    pub watch: WatchId,
    /// Which of the slot's subscriptions of this watch it is (`Slot::watch_gen`).
    pub generation: u64,
    pub last_at: Timestamp,
}

impl World {
    /// An acknowledged renewal erased by the expiry decided for the revision before it.
    pub(crate) fn erase(&mut self, key: Key, revision: Revision) {
        let now = self.now;
        if self.lease.get(now, &key).is_some_and(|e| e.revision == revision) {
            self.fault(Fault::RenewalErasedByExpiry);
            self.lease.erase_as_expired(&key);
            self.distribute(Bucket::Lease);
        }
    }

    /// How late the expiry of `key` due at `deadline` fires, beyond the 250 ms timer:
    /// deterministic per key and deadline, up to `expiry_late_max`.
    pub(crate) fn expiry_lateness(&self, key: &Key, deadline: Timestamp) -> Duration {
        let max = self.opts.expiry_late_max.as_millis() as u64;
        if max == 0 {
            return Duration::ZERO;
        }
        let mut h: u64 = 0xcbf2_9ce4_8422_2325 ^ deadline.0 ^ self.report.seed;
        for b in key.as_str().bytes() {
            h = (h ^ b as u64).wrapping_mul(0x0100_0000_01b3);
        }
        h ^= h >> 29;
        ms(h % (max + 1))
    }

    /// The expiry timer: overdue keys expire once their lateness has passed (and not while the
    /// lease stream's leader cannot commit: expiry markers are writes of the leader's too).
    pub(crate) fn expiry_tick(&mut self) {
        let now = self.now;
        if self.stuck[bi(Bucket::Lease)].as_ref().is_some_and(|s| !s.elected(now)) {
            return;
        }
        let due: Vec<(Key, bool)> = self
            .lease
            .overdue(now)
            .into_iter()
            .filter_map(|(k, d)| {
                let late = self.expiry_lateness(&k, d);
                (d + late <= now).then_some((k, late > Duration::ZERO))
            })
            .collect();
        for (key, late) in due {
            if late {
                self.fault(Fault::ExpiryLate);
            }
            self.lease.erase_as_expired(&key);
        }
        self.distribute(Bucket::State);
        self.distribute(Bucket::Lease);
    }

    /// Feeds the store's new events to the history, the checker and the watches.
    pub(crate) fn distribute(&mut self, bucket: Bucket) {
        let now = self.now;
        let events = self.kv(bucket).take_events();
        let horizon = Timestamp(now.0.saturating_sub(self.opts.max_lag.as_micros() as u64));
        for ev in events {
            if bucket == Bucket::Lease {
                self.checker.observe(now, Observation::LeaseEvent(&ev), &mut self.state);
            }
            let Some(key) = ev.key().cloned() else { continue };
            let versions = self.history[bi(bucket)].entry(key.clone()).or_default();
            versions.push_back((now, if let WatchEvent::Put(e) = &ev { Some(e.clone()) } else { None }));
            while versions.len() > 1 && versions[1].0 <= horizon {
                versions.pop_front();
            }
            for i in 0..self.subs.len() {
                let sub = &self.subs[i];
                if sub.watch.bucket() != bucket || !sub.watch.prefix().matches(&key) {
                    continue;
                }
                let mut delay = us(self.rng.range(200, 3000));
                if self.faults_on && self.rng.chance(0.01) {
                    delay += ms(self.rng.range(50, 500));
                }
                let mut held = self.slots[self.subs[i].slot].link.hold_until;
                if let Some(stuck) = &self.stuck[bi(bucket)]
                    && !stuck.everyone
                    && stuck.isolates(self.subs[i].slot)
                {
                    // The cut-off node's consumers see the other side's writes when it rejoins.
                    held = held.max(stuck.until);
                }
                let at = (self.now + delay).max(held).max(Timestamp(self.subs[i].last_at.0 + 1));
                self.subs[i].last_at = at;
                let Sub { slot, life, watch, generation, .. } = self.subs[i];
                let input = etl_coordination_core::Input::Watch { watch, event: ev.clone() };
                self.schedule_at(at, Ev::ToWatch { slot, life, generation, input });
            }
        }
    }

    pub(crate) fn open_watch(&mut self, slot: usize, life: u32, watch: WatchId, generation: u64) {
        if self.slots[slot].life != life || self.slots[slot].watch_gen.get(&watch) != Some(&generation) {
            return;
        }
        let link = self.slots[slot].link;
        let stuck_here =
            self.stuck[bi(watch.bucket())].as_ref().is_some_and(|s| s.isolates(slot) && !s.everyone);
        if self.now < self.outage_until || link.refuses(self.now, watch.bucket(), false) || stuck_here {
            // (A consumer cannot be created on a node cut off from the others.)
            let input = etl_coordination_core::Input::WatchFailed { watch };
            return self.schedule(ms(300), Ev::ToWatch { slot, life, generation, input });
        }
        let now = self.now;
        let entries = self.kv(watch.bucket()).list(now, &watch.prefix());
        let mut at = self.now.max(link.hold_until);
        for e in entries {
            at = at + us(self.rng.range(1, 50));
            let input = etl_coordination_core::Input::Watch { watch, event: WatchEvent::Put(e) };
            self.schedule_at(at, Ev::ToWatch { slot, life, generation, input });
        }
        at = at + us(1);
        let input = etl_coordination_core::Input::Watch { watch, event: WatchEvent::SnapshotComplete };
        self.schedule_at(at, Ev::ToWatch { slot, life, generation, input });
        self.subs.push(Sub { slot, life, watch, generation, last_at: at });
    }

    /// Breaks the watches of `slot` (all, or one bucket's) as a broken connection does.
    pub(crate) fn break_watches(&mut self, slot: usize, bucket: Option<Bucket>) {
        let (gone, keep): (Vec<Sub>, Vec<Sub>) = std::mem::take(&mut self.subs)
            .into_iter()
            .partition(|s| s.slot == slot && bucket.is_none_or(|b| s.watch.bucket() == b));
        self.subs = keep;
        for s in gone {
            let d = ms(self.rng.range(1, 100));
            let input = etl_coordination_core::Input::WatchFailed { watch: s.watch };
            self.schedule(d, Ev::ToWatch { slot: s.slot, life: s.life, generation: s.generation, input });
        }
    }
}
