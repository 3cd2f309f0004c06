//! Where a lane's records go: its sink writer, and under [`OnBadRecord::Skip`] its dead-letter
//! writer (opened at the first bad record) that keeps the bad records skipped. Flushing
//! flushes both, so a commit (which flushes first) never moves progress past a skipped record
//! that is not yet kept.

use std::marker::PhantomData;
use std::sync::Arc;

use crate::config::OnBadRecord;
use crate::contract::{BadRecord, DeadLetterWriter, DeadLetters, LaneInfo, SinkError, SinkWriter};

/// The sink and the dead letters of a pipeline, shared by its lanes.
pub(crate) struct Outputs<Si> {
    pub(crate) sink: Arc<Si>,
    pub(crate) dead: Option<Arc<dyn DeadLetters>>,
    pub(crate) on_bad: OnBadRecord,
}

/// One lane's writers, of records `R`.
pub(crate) struct LaneOutputs<R, W> {
    pub(crate) writer: W,
    dead: Option<Box<dyn DeadLetterWriter>>,
    records: PhantomData<fn(R)>,
}

impl<R: Send + 'static, W: SinkWriter<R>> LaneOutputs<R, W> {
    pub(crate) fn new(writer: W) -> Self {
        LaneOutputs { writer, dead: None, records: PhantomData }
    }

    /// Keeps one bad record in the lane's dead-letter writer, opening it first if needed.
    pub(crate) async fn dead_letter(
        &mut self,
        letters: &dyn DeadLetters,
        lane: &LaneInfo,
        record: &BadRecord,
    ) -> Result<(), SinkError> {
        if self.dead.is_none() {
            self.dead = Some(letters.open(lane).await?);
        }
        self.dead.as_mut().expect("opened").write(record).await
    }

    /// Flushes the dead letters, then the records.
    pub(crate) async fn flush(&mut self) -> Result<(), SinkError> {
        if let Some(dead) = &mut self.dead {
            dead.flush().await?;
        }
        self.writer.flush().await
    }
}
