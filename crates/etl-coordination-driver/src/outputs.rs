//! Where a lane's records go: the sink, and under [`OnBadRecord::Skip`] the dead-letter sink
//! that keeps the bad records skipped. Flushing flushes both, so a commit (which flushes
//! first) never moves progress past a skipped record that is not yet kept.

use std::sync::Arc;

use crate::config::OnBadRecord;
use crate::contract::{DeadLetters, LaneInfo, Sink, SinkError};

/// The sink and the dead letters of a pipeline's lanes.
pub(crate) struct Outputs<Si> {
    pub(crate) sink: Arc<Si>,
    pub(crate) dead: Option<Arc<dyn DeadLetters>>,
    pub(crate) on_bad: OnBadRecord,
}

impl<R, Si: Sink<R>> Sink<R> for Outputs<Si> {
    fn write(&self, lane: &LaneInfo, record: R) -> impl Future<Output = Result<(), SinkError>> + Send {
        self.sink.write(lane, record)
    }

    async fn flush(&self) -> Result<(), SinkError> {
        if let Some(dead) = &self.dead {
            dead.flush().await?;
        }
        self.sink.flush().await
    }
}
