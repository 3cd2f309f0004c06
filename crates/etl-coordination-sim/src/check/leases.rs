//! The leases: how each tenancy's lease was taken, when it dies in the store's time (P11), no
//! spurious fence (P7), and the lanes (I4: one lane per tenancy, a bounded overlap).

use etl_coordination_core::records::{self, LeaseRecord, SplitRecord, SplitState, keys};
use etl_coordination_core::{Epoch, Owner, SplitId, Timestamp, WatchEvent};

use super::{Checker, HeldWrite, Landing, LeaseOrigin};

impl Checker {
    /// Lease-bucket events: the current lease of every split.
    pub(super) fn on_lease_event(&mut self, ev: &WatchEvent) {
        match ev {
            WatchEvent::Put(e) => {
                if let Some(id) = keys::parse_split(&e.key)
                    && let Ok(l) = records::decode::<LeaseRecord>(&e.value)
                {
                    self.lease_mirror.insert(id, l);
                }
            }
            WatchEvent::Delete { key, .. } => {
                if let Some(id) = keys::parse_split(key) {
                    self.lease_mirror.remove(&id);
                }
            }
            WatchEvent::SnapshotComplete => {}
        }
    }

    /// A split record write was taken by a stuck stream leader: it will be judged by the lease
    /// origin of the acquisition it was made for, as it is now.
    pub(crate) fn held_write(&self, id: &SplitId, epoch: Epoch, owner: &Owner) -> HeldWrite {
        let key = (id.clone(), epoch, owner.clone());
        HeldWrite { origin: self.lease_origin.get(&key).cloned(), key }
    }

    /// The held write lands: the origin it was taken with stands in while it is judged (a later
    /// acquisition of the same epoch may have replaced it meanwhile: the lease is another stream
    /// and went on).
    pub(crate) fn held_write_lands(&mut self, held: HeldWrite) -> Landing {
        let replaced = self.replace_lease_origin(&held.key, held.origin);
        Landing { key: held.key, replaced }
    }

    /// The held write was judged: the origin it stood in for is back.
    pub(crate) fn held_write_landed(&mut self, landing: Landing) {
        self.replace_lease_origin(&landing.key, landing.replaced);
    }

    fn replace_lease_origin(
        &mut self,
        key: &(SplitId, Epoch, Owner),
        origin: Option<LeaseOrigin>,
    ) -> Option<LeaseOrigin> {
        match origin {
            Some(o) => self.lease_origin.insert(key.clone(), o),
            None => self.lease_origin.remove(key),
        }
    }

    /// A lease write landed (P11 deadlines; how each tenancy's lease was taken).
    pub(super) fn on_lease_write(
        &mut self,
        at: Timestamp,
        id: &SplitId,
        prev: Option<&LeaseRecord>,
        new: &LeaseRecord,
        deadline: Timestamp,
    ) {
        match self.lease_deadline_mut(id, new.epoch, &new.owner) {
            Some(d) => *d = (*d).max(deadline),
            None => {
                let tenancies = self.lease_deadline.entry(id.clone()).or_default();
                tenancies.push((new.epoch, new.owner.clone(), deadline));
            }
        }
        let origin = match prev {
            None => LeaseOrigin::Created,
            Some(p) if p.owner == new.owner && p.epoch == new.epoch => return,
            Some(p) if p.owner == new.owner => LeaseOrigin::Resumed,
            Some(p) => LeaseOrigin::Displaced(p.owner.clone()),
        };
        self.lease_origin.insert((id.clone(), new.epoch, new.owner.clone()), origin);
        let _ = at;
    }

    /// The holder deleted its lease: the tenancy's lease is dead from now on.
    pub(super) fn on_lease_deleted(&mut self, at: Timestamp, id: &SplitId) {
        if let Some(l) = self.lease_mirror.get(id).cloned()
            && let Some(d) = self.lease_deadline_mut(id, l.epoch, &l.owner)
        {
            *d = (*d).min(at);
        }
    }

    /// When the lease of the tenancy (`id`, `epoch`, `owner`) dies in the store's time.
    fn lease_deadline_mut(&mut self, id: &SplitId, epoch: Epoch, owner: &Owner) -> Option<&mut Timestamp> {
        let tenancies = self.lease_deadline.get_mut(id)?;
        tenancies.iter_mut().find(|(e, o, _)| *e == epoch && o == owner).map(|(_, _, d)| d)
    }

    /// P11: a lane the core keeps running must not outlive its lease in the store's time.
    pub(super) fn lane_running(&mut self, at: Timestamp, id: &SplitId, epoch: Epoch, owner: &Owner) {
        let deadline = self
            .lease_deadline
            .get(id)
            .and_then(|t| t.iter().find(|(e, o, _)| *e == epoch && o == owner))
            .map(|(_, _, d)| *d);
        self.ensure(at, "P11", deadline.is_some_and(|d| at <= d), || match deadline {
            None => format!("split {id}: {owner} runs a lane at epoch {epoch} without ever having written its lease"),
            Some(d) => format!(
                "split {id}: {owner} still runs its lane at epoch {epoch} {:.3}s after the lease died in the store (trust outlived the TTL)",
                at.saturating_since(d).as_secs_f64()
            ),
        });
    }

    /// P7: a tenancy is fenced only when somebody else moved its record or lease. A fence
    /// while both still name the holder (and no other owner's write to them is waiting at a
    /// stuck stream leader) is spurious: safe, but its work since the last commit is redone
    /// elsewhere (e.g. a conflict on a retry that our own earlier write, still waiting at the
    /// leader, caused).
    pub(super) fn on_fenced(
        &mut self,
        at: Timestamp,
        id: &SplitId,
        owner: &Owner,
        record: Option<&SplitRecord>,
        lease: Option<&LeaseRecord>,
        foreign_write_waiting: bool,
    ) {
        let ours = record.is_some_and(|r| r.state == SplitState::Owned && r.owner.as_ref() == Some(owner))
            && lease.is_some_and(|l| l.owner == *owner);
        self.ensure(at, "P7", !ours || foreign_write_waiting, || {
            format!(
                "split {id}: {owner} fenced itself although its record and lease in the store still name it"
            )
        });
    }

    /// A lane emitted one record (I4's overlap bound, and the oracle for I2).
    pub(super) fn on_emit(
        &mut self,
        at: Timestamp,
        id: &SplitId,
        record: u64,
        epoch: Epoch,
        owner: &Owner,
        current: Option<&SplitRecord>,
    ) {
        if let Some(e) = self.emitted.get_mut(id)
            && let Some(slot) = e.get_mut(record as usize)
        {
            *slot = true;
        }
        let stale = current.is_none_or(|r| {
            r.epoch > epoch
                || (r.epoch == epoch && r.owner.as_ref() != Some(owner) && r.state != SplitState::Done)
        });
        if stale {
            let n = self.stale_emits.entry((id.clone(), epoch, owner.clone())).or_default();
            *n += 1;
            let n = *n;
            let bound = self.stale_bound;
            self.ensure(at, "I4", n <= bound, || {
                format!("split {id}: lane of {owner} at epoch {epoch} emitted {n} records after losing ownership (bound {bound})")
            });
        } else {
            self.count("I4");
        }
    }

    /// A lane starts: no other lane may run the same tenancy, and terminal splits never start.
    pub(super) fn on_lane_start(
        &mut self,
        at: Timestamp,
        id: &SplitId,
        epoch: Epoch,
        others: &[Epoch],
        current: Option<&SplitRecord>,
    ) {
        self.ensure(at, "I4", !others.contains(&epoch), || format!("split {id}: two lanes at epoch {epoch}"));
        // A lane may start just as its split changes hands (an expiry erasing an acknowledged
        // renewal races the start); such a lane is a zombie bounded by I4's emission bound and
        // fenced by I3. What must never happen is a lane for an epoch the record never had.
        let had = self.max_epoch.get(id).copied();
        self.ensure(at, "I4", had.is_some_and(|e| e >= epoch), || {
            format!(
                "split {id}: lane started at epoch {epoch} ahead of the record (now {:?}, at most {had:?} so far)",
                current.map(|r| r.epoch)
            )
        });
    }
}
