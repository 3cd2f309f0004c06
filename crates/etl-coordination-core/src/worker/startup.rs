//! Startup: the meta check (P2), then joining the fleet (watches, presence).

use crate::ids::Revision;
use crate::io::{Action, Event, FatalError, WatchId};
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
            Written::Applied(revision) => {
                self.meta_revision = revision;
                self.join()
            }
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

    /// P2: another protocol or planner fingerprint is fatal and names both sides; the job's
    /// `max_attempts` is adopted (a setting of the job, not of each worker).
    pub(super) fn on_meta_get(&mut self, now: Timestamp, result: StoreResult) {
        match Read::of(result) {
            Read::Found(entry) => match records::decode_meta(&entry.value) {
                Ok(stored)
                    if stored.protocol_version != records::PROTOCOL_VERSION
                        || stored.fingerprint != self.cfg.fingerprint =>
                {
                    self.refuse(&stored)
                }
                Ok(stored) => {
                    self.adopt_meta(entry.revision, &stored);
                    self.join()
                }
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

    /// The job's `max_attempts` governs every charge this worker writes (P12), whatever its
    /// own configuration says; the value in effect is reported whenever it changes (at join:
    /// when it differs from the configured one). A value out of the valid range (written
    /// by hand) is clamped into it rather than trusted. An older revision (a lagging replica's
    /// answer to a refresh) is ignored.
    fn adopt_meta(&mut self, revision: Revision, stored: &Meta) {
        if revision < self.meta_revision {
            return;
        }
        self.meta_revision = revision;
        let job = stored.max_attempts.clamp(1, crate::MAX_ATTEMPTS_LIMIT);
        let previous = std::mem::replace(&mut self.cfg.tuning.max_attempts, job);
        if job != previous {
            self.outbox.event(Event::JobMaxAttempts { job, configured: self.configured_max_attempts });
        }
    }

    /// Reads `meta` again (with every periodic resync): a `max_attempts` changed by an operator takes
    /// effect in running workers, and a job moved to another protocol or planner under a
    /// running worker stops it.
    pub(super) fn refresh_meta(&mut self) {
        self.outbox.send(Bucket::State, StoreRequest::Get { key: keys::meta() }, Pending::MetaRefresh);
    }

    /// The answer to [`Worker::refresh_meta`]: anything but a readable `meta` at least as new as
    /// the one in effect is left to the next resync (the job goes on under the settings it
    /// has; a lagging replica's older answer is not evidence of anything). Another protocol or
    /// planner stops the worker, unless it is leaving: a drain finishes under what it started.
    pub(super) fn on_meta_refresh(&mut self, result: StoreResult) {
        let Read::Found(entry) = Read::of(result) else { return };
        if entry.revision < self.meta_revision {
            return;
        }
        let stored = match records::decode_meta(&entry.value) {
            Ok(stored) => stored,
            Err(e) => return self.note_undecodable(Bucket::State, &entry, &e),
        };
        self.note_decodable(Bucket::State, &entry.key, entry.revision);
        if stored.protocol_version != records::PROTOCOL_VERSION || stored.fingerprint != self.cfg.fingerprint
        {
            if self.leaving.is_none() {
                self.refuse(&stored);
            }
            return;
        }
        self.adopt_meta(entry.revision, &stored);
    }

    /// P2: the fatal error for a `meta` of another protocol or planner.
    fn refuse(&mut self, stored: &Meta) {
        if stored.protocol_version != records::PROTOCOL_VERSION {
            self.fatal(FatalError::ProtocolMismatch {
                stored: stored.protocol_version,
                local: records::PROTOCOL_VERSION,
            })
        } else {
            self.fatal(FatalError::ConfigDivergence {
                stored: stored.describe(),
                local: self.meta().describe(),
            })
        }
    }

    /// P2 passed: open the watches and announce presence (P3).
    fn join(&mut self) {
        if self.phase != Phase::Meta {
            return;
        }
        self.phase = Phase::Joining;
        for w in WatchId::ALL {
            self.watches.insert(w, WatchState { ready: false, snapshot: Some(Default::default()) });
            self.outbox.push(Action::Watch { watch: w });
        }
        self.create_presence();
    }
}
