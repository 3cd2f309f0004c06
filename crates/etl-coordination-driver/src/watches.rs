//! The watches a worker keeps open: each in a task of its own, reopened with backoff after a
//! failure, its events tagged with a generation so a replaced watch's late events are dropped.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use etl_coordination_core::{WatchEvent, WatchId};
use etl_coordination_store::Store;
use futures_util::StreamExt;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tracing::warn;

use crate::msg::Msg;

struct WatchTask {
    generation: u64,
    failures: u32,
    handle: Option<JoinHandle<()>>,
}

/// The open watches, by id.
#[derive(Default)]
pub(crate) struct Watches {
    tasks: BTreeMap<WatchId, WatchTask>,
}

impl Watches {
    /// Opens (or reopens) a watch in a task of its own, after a backoff when it failed before.
    pub(crate) fn open<S: Store>(&mut self, watch: WatchId, store: Arc<S>, tx: mpsc::UnboundedSender<Msg>) {
        let entry = self.tasks.entry(watch).or_insert(WatchTask { generation: 0, failures: 0, handle: None });
        entry.generation += 1;
        if let Some(h) = entry.handle.take() {
            h.abort();
        }
        let generation = entry.generation;
        // Back off after consecutive failures so a store outage is not hammered, with jitter so a
        // fleet that lost the store together does not come back in lockstep.
        let backoff = match entry.failures {
            0 => Duration::ZERO,
            n => watch_backoff().nth(n as usize - 1).unwrap_or(Duration::from_secs(5)),
        };
        entry.handle = Some(tokio::spawn(async move {
            if !backoff.is_zero() {
                tokio::time::sleep(backoff).await;
            }
            let mut stream = match store.watch(&watch.prefix()).await {
                Ok(s) => s,
                Err(e) => {
                    let _ = tx.send(Msg::WatchFailed { watch, generation, error: e.to_string() });
                    return;
                }
            };
            loop {
                match stream.next().await {
                    Some(Ok(event)) => {
                        if tx.send(Msg::Watch { watch, generation, event }).is_err() {
                            return;
                        }
                    }
                    Some(Err(e)) => {
                        let _ = tx.send(Msg::WatchFailed { watch, generation, error: e.to_string() });
                        return;
                    }
                    None => {
                        let _ = tx.send(Msg::WatchFailed { watch, generation, error: "watch ended".into() });
                        return;
                    }
                }
            }
        }));
    }

    /// An event of the current generation of `watch` (`None`: a replaced watch's, dropped).
    pub(crate) fn event(&mut self, watch: WatchId, generation: u64, event: &WatchEvent) -> Option<()> {
        let w = self.tasks.get_mut(&watch).filter(|w| w.generation == generation)?;
        if *event == WatchEvent::SnapshotComplete {
            w.failures = 0;
        }
        Some(())
    }

    /// The current generation of `watch` failed (`None`: a replaced watch's, dropped).
    pub(crate) fn failed(&mut self, watch: WatchId, generation: u64, error: &str) -> Option<()> {
        let w = self.tasks.get_mut(&watch).filter(|w| w.generation == generation)?;
        w.failures += 1;
        warn!(?watch, %error, failures = w.failures, "watch failed; reopening and resyncing");
        Some(())
    }

    /// Ends every watch task (the worker stopped).
    pub(crate) fn abort_all(&mut self) {
        for w in self.tasks.values_mut() {
            if let Some(h) = w.handle.take() {
                h.abort();
            }
        }
    }
}

/// Delays between attempts to reopen a failed watch: 200 ms doubling up to 5 s, each with a
/// random extra of up to itself (jitter).
fn watch_backoff() -> impl Iterator<Item = Duration> {
    use backon::BackoffBuilder;
    backon::ExponentialBuilder::default()
        .with_min_delay(Duration::from_millis(200))
        .with_factor(2.0)
        .with_max_delay(Duration::from_secs(5))
        .with_jitter()
        .without_max_times()
        .build()
}
