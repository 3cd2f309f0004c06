//! Watches and listings: ordered consumers over the latest message of every key under a
//! prefix, with the end of the initial snapshot reported.

use async_nats::jetstream::{self, consumer};
use etl_coordination_core::{DeleteCause, Entry, Key, Prefix, Revision, StoreError, WatchEvent};
use etl_coordination_store::WatchStream;
use futures_util::StreamExt;
use tokio::sync::mpsc;

use crate::classify::{MAX_CONSUMERS, MessageKind, api_code};
use crate::store::NatsStore;

impl NatsStore {
    /// An ordered consumer over the latest message of every subject under `prefix`, and the
    /// number of messages it will deliver before it is caught up.
    pub(crate) async fn snapshot_consumer(
        &self,
        prefix: &Prefix,
    ) -> Result<(consumer::push::Ordered, u64), StoreError> {
        self.refusals.guard(self.open_snapshot(prefix)).await
    }

    pub(crate) async fn open_snapshot(
        &self,
        prefix: &Prefix,
    ) -> Result<(consumer::push::Ordered, u64), StoreError> {
        let filter = format!("$KV.{}.{}>", self.bucket, prefix.as_str());
        let unavailable = |e: String| StoreError::Unavailable(e);
        let consumer = tokio::time::timeout(
            self.op_timeout,
            self.leader.create_consumer(consumer::push::OrderedConfig {
                deliver_subject: self.client.new_inbox(),
                description: Some("etl-coordination watch".into()),
                filter_subject: filter,
                deliver_policy: consumer::DeliverPolicy::LastPerSubject,
                replay_policy: consumer::ReplayPolicy::Instant,
                ..Default::default()
            }),
        )
        .await
        .map_err(|_| unavailable("timed out creating a watch consumer".into()))?
        .map_err(|e| match api_code(&e) {
            Some(MAX_CONSUMERS) => unavailable(format!(
                "creating a watch consumer on bucket {}: {e}: bucket {} holds its account's \
                 maximum number of consumers per stream (a worker holds two on the state bucket, \
                 one on the lease bucket, and a listing one while it runs); raise \
                 `max_consumers` in its jetstream block (`etl-coord nats-account --max-consumers`) \
                 and reload the server",
                self.bucket, self.bucket
            )),
            _ => unavailable(format!("creating a watch consumer: {e}")),
        })?;
        let pending = consumer.cached_info().num_pending;
        let messages =
            consumer.messages().await.map_err(|e| unavailable(format!("starting a watch: {e}")))?;
        Ok((messages, pending))
    }

    pub(crate) fn event(&self, msg: &jetstream::Message) -> Option<(WatchEvent, u64)> {
        let info = msg.info().ok()?;
        // (No prefix built per message: a listing of a million splits is a million of these.)
        let key = msg
            .subject
            .as_str()
            .strip_prefix("$KV.")?
            .strip_prefix(self.bucket.as_str())?
            .strip_prefix('.')?;
        let key = Key::new(key.to_owned()).ok()?;
        let revision = Revision(info.stream_sequence);
        let ev = match MessageKind::of(msg.headers.as_ref()) {
            MessageKind::Deleted => WatchEvent::Delete { key, revision, cause: DeleteCause::Deleted },
            MessageKind::Expired => WatchEvent::Delete { key, revision, cause: DeleteCause::Expired },
            // A copy, not the client's slice of its read buffer: a slice keeps the whole buffer
            // it was cut from alive, and a snapshot holds every entry until it ends (issue 32:
            // 22 MB of read buffers pinned by a 100,000-split snapshot, measured).
            MessageKind::Value => {
                WatchEvent::Put(Entry { key, value: bytes::Bytes::copy_from_slice(&msg.payload), revision })
            }
        };
        Some((ev, info.pending))
    }

    pub(crate) async fn list_all(&self, prefix: &Prefix) -> Result<Vec<Entry>, StoreError> {
        let (mut messages, pending) = self.open_snapshot(prefix).await?;
        let mut out = Vec::new();
        if pending == 0 {
            return Ok(out);
        }
        loop {
            let msg = match tokio::time::timeout(self.op_timeout, messages.next()).await {
                Ok(Some(Ok(m))) => m,
                Ok(Some(Err(e))) => return Err(StoreError::Unavailable(format!("listing: {e}"))),
                Ok(None) | Err(_) => return Err(StoreError::Unavailable("listing did not complete".into())),
            };
            let Some((ev, left)) = self.event(&msg) else { continue };
            if let WatchEvent::Put(e) = ev {
                out.push(e);
            }
            if left == 0 {
                break;
            }
        }
        out.sort_by(|a, b| a.key.cmp(&b.key));
        Ok(out)
    }

    /// A watch of every key under `prefix`: the snapshot, its end, then every change; a
    /// refusal or a failed consumer ends it with an error.
    pub(crate) async fn watch_prefix(&self, prefix: &Prefix) -> Result<WatchStream, StoreError> {
        let (mut messages, pending) = self.snapshot_consumer(prefix).await?;
        let (tx, rx) = mpsc::unbounded_channel();
        let this = self.clone();
        tokio::spawn(async move {
            let mut in_snapshot = true;
            if pending == 0 {
                in_snapshot = false;
                let _ = tx.send(Ok(WatchEvent::SnapshotComplete));
            }
            loop {
                let next = tokio::select! {
                    m = messages.next() => m,
                    () = tx.closed() => return,
                    e = this.refusals.refused() => {
                        let _ = tx.send(Err(e));
                        return;
                    }
                };
                let msg = match next {
                    Some(Ok(m)) => m,
                    Some(Err(e)) => {
                        // Never poll a failed watch again (docs/NATS.md): end it; the caller resyncs.
                        let _ = tx.send(Err(StoreError::Unavailable(format!("watch failed: {e}"))));
                        return;
                    }
                    None => {
                        let _ = tx.send(Err(StoreError::Unavailable("watch ended".into())));
                        return;
                    }
                };
                let Some((ev, left)) = this.event(&msg) else { continue };
                // Deletes are passed on during the snapshot too: the consumer's snapshot and the
                // changes after its cut are one stream, and a key shown early in it and deleted
                // before it ends must not outlive the snapshot in the caller's view (each reopen
                // and every resync goes through this window). A tombstone older than the cut
                // comes too; applied by revision it changes nothing.
                if tx.send(Ok(ev)).is_err() {
                    return;
                }
                if in_snapshot && left == 0 {
                    in_snapshot = false;
                    if tx.send(Ok(WatchEvent::SnapshotComplete)).is_err() {
                        return;
                    }
                }
            }
        });
        Ok(etl_coordination_store::channel_watch(rx))
    }
}
