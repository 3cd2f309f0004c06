//! Delayed retries: sent when due, only while the step they belong to still wants them, and
//! then the current op of whatever they belong to.

use crate::ids::OpId;
use crate::store::StoreRequest;
use crate::time::Timestamp;

use super::Worker;
use super::outbox::Pending;
use super::tenancy::Stage;

impl Worker {
    /// Sends the delayed retries that are due and still wanted.
    pub(super) fn send_due_retries(&mut self, now: Timestamp) {
        for r in self.outbox.take_due(now) {
            if !self.retry_wanted(&r.pending, &r.request) {
                continue;
            }
            let op = self.outbox.send(r.bucket, r.request, r.pending.clone());
            self.rebind_retry(op, &r.pending);
        }
    }

    /// Whether a delayed retry still belongs to a live step: the split may have been lost and
    /// re-acquired meanwhile (a new tenancy runs its own reads), or already moved on.
    /// A delayed write must also be the very write its step would send now: a claim CAS of an
    /// earlier tenancy of the split (given up meanwhile) never goes out for a later one, and a
    /// head write only for the leadership stint that queued it.
    pub(super) fn retry_wanted(&self, pending: &Pending, request: &StoreRequest) -> bool {
        match pending {
            Pending::DescRead { split } => {
                self.tenancies.get(split).is_some_and(|h| h.op.is_none() && h.stage == Stage::ReadingDesc)
            }
            Pending::RecordClaimRead { split } => {
                self.tenancies.get(split).is_some_and(|h| h.op.is_none() && h.stage == Stage::WritingRecord)
            }
            Pending::RecordClaim { split } => {
                self.tenancies.get(split).is_some_and(|h| h.op.is_none() && h.stage == Stage::WritingRecord)
                    && self.claim_request(split).0 == *request
            }
            Pending::LeaseAcquireResolve { split, .. } => {
                self.tenancies.get(split).is_some_and(|h| h.op.is_none() && h.stage == Stage::AcquiringLease)
            }
            Pending::HeadWrite { stint, .. } => self.leader.as_ref().is_some_and(|l| l.stint == *stint),
            // A chunk read of a load that was dropped meanwhile would be answered for nothing.
            Pending::ManifestChunk { load, .. } => {
                self.manifest_load.as_ref().is_some_and(|l| l.id == *load && !l.failed)
            }
            _ => true,
        }
    }

    /// A retried op is the new current op of whatever it belongs to.
    pub(super) fn rebind_retry(&mut self, op: OpId, pending: &Pending) {
        match pending {
            Pending::DescRead { split }
            | Pending::RecordClaimRead { split }
            | Pending::RecordClaim { split }
            | Pending::LeaseAcquireResolve { split, .. } => {
                if let Some(h) = self.tenancies.get_mut(split) {
                    h.op = Some(op);
                }
            }
            _ => {}
        }
    }
}
