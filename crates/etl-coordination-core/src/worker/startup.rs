//! Startup: the meta check (P2), then joining the fleet (watches, presence).

use crate::io::{Action, FatalError, WatchId};
use crate::records::{self, Meta, keys};
use crate::store::{Bucket, StoreError, StoreRequest, StoreResult};
use crate::time::Timestamp;

use super::outbox::{Pending, Read, Written};
use super::watches::WatchState;
use super::{Phase, Worker};

impl Worker {
    /// What `meta` must hold for this worker to join (P2).
    fn meta(&self) -> Meta {
        Meta {
            protocol_version: records::PROTOCOL_VERSION,
            fingerprint: self.cfg.fingerprint.clone(),
            max_attempts: self.cfg.tuning.max_attempts,
        }
    }

    fn meta_create(&self) -> StoreRequest {
        StoreRequest::Create { key: keys::meta(), value: records::encode(&self.meta()), ttl: None }
    }

    /// P2: the first worker creates `meta`; every later one compares it before touching
    /// anything else.
    pub(super) fn on_start(&mut self) {
        if self.phase != Phase::Idle {
            return;
        }
        self.phase = Phase::Meta;
        let request = self.meta_create();
        self.outbox.send(Bucket::State, request, Pending::MetaCreate);
    }

    /// P2: `meta` created (join), or it exists (read it and compare).
    pub(super) fn on_meta_create(&mut self, now: Timestamp, result: StoreResult) {
        match Written::of(result) {
            Written::Applied(_) => self.join(),
            Written::Conflict | Written::InDoubt => {
                self.outbox.send(Bucket::State, StoreRequest::Get { key: keys::meta() }, Pending::MetaGet);
            }
            Written::Fatal(e) => self.fatal_store(e),
            Written::Unavailable => {
                let request = self.meta_create();
                self.outbox.retry_later(now, Bucket::State, request, Pending::MetaCreate);
            }
        }
    }

    /// P2: a mismatch is fatal and names both sides.
    pub(super) fn on_meta_get(&mut self, now: Timestamp, result: StoreResult) {
        match Read::of(result) {
            Read::Found(entry) => match records::decode::<Meta>(&entry.value) {
                Ok(stored) if stored == self.meta() => self.join(),
                Ok(stored) => self.fatal(FatalError::ConfigDivergence {
                    stored: stored.describe(),
                    local: self.meta().describe(),
                }),
                Err(e) => self.fatal(FatalError::CorruptMeta(e.to_string())),
            },
            // Gone again after a conflicting or in-doubt create: create again.
            Read::Absent => {
                let request = self.meta_create();
                self.outbox.retry_later(now, Bucket::State, request, Pending::MetaCreate);
            }
            Read::Failed(StoreError::Indeterminate(_)) => {
                self.outbox.send(Bucket::State, StoreRequest::Get { key: keys::meta() }, Pending::MetaGet);
            }
            Read::Failed(e) if e.is_fatal() => self.fatal_store(e),
            Read::Failed(_) => {
                let request = StoreRequest::Get { key: keys::meta() };
                self.outbox.retry_later(now, Bucket::State, request, Pending::MetaGet);
            }
        }
    }

    /// P2 passed: open the watches and announce presence (P3).
    fn join(&mut self) {
        if self.phase != Phase::Meta {
            return;
        }
        self.phase = Phase::Joining;
        for w in WatchId::ALL {
            self.watches.insert(w, WatchState { ready: false, snapshot: Some(Vec::new()) });
            self.outbox.push(Action::Watch { watch: w });
        }
        self.create_presence();
    }
}
