//! A source of your own: pages of a (simulated) paginated API, split by page ranges, read page
//! by page, with the page number as progress. Two workers share the job in one process (the
//! in-memory store); the sink counts what it receives.
//!
//! `cargo run -p etl-coordination-examples --example custom_source`

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use etl_coordination_driver::{
    DriverConfig, InstanceId, JobName, JobOutcome, JobStores, LaneInfo, NextRecord, Pipeline, Plan,
    PlanError, PlanKind, PlannedSplit, Planner, Sink, SinkError, SinkWriter, Source, SourceError, SplitId,
    SplitReader,
};
use serde::{Deserialize, Serialize};

/// The API: 40 pages of 25 items, split into ranges of 10 pages.
#[derive(Clone)]
struct PagedApi {
    pages: u32,
    pages_per_split: u32,
}

/// A split's descriptor: the pages it covers.
#[derive(Serialize, Deserialize)]
struct Pages {
    first: u32,
    end: u32,
}

impl Planner for PagedApi {
    // Every replica must report the same fingerprint: put in it everything that changes the plan.
    fn fingerprint(&self) -> String {
        format!("paged-api/v1 pages={} per_split={}", self.pages, self.pages_per_split)
    }

    // Runs on the leader only. Ids are deterministic: planning again yields the same splits.
    async fn plan(&self) -> Result<Plan, PlanError> {
        let splits = (0..self.pages)
            .step_by(self.pages_per_split as usize)
            .map(|first| {
                let end = (first + self.pages_per_split).min(self.pages);
                let descriptor = serde_json::to_vec(&Pages { first, end }).expect("serializable");
                let id = SplitId::new(format!("pages-{first:04}-{end:04}")).expect("valid id");
                PlannedSplit::new(id, descriptor, u64::from(end - first))
            })
            .collect();
        Ok(Plan::new(PlanKind::Final, splits))
    }
}

impl Source for PagedApi {
    type Record = String;
    /// The next page to read.
    type Progress = u32;
    type Reader = PageReader;

    async fn open(&self, lane: &LaneInfo, from: Option<u32>) -> Result<PageReader, SourceError> {
        let pages: Pages = serde_json::from_slice(lane.descriptor()).map_err(SourceError::unprocessable)?;
        Ok(PageReader { page: from.unwrap_or(pages.first), end: pages.end, item: 0 })
    }
}

/// Reads a page range item by item; progress moves on a page at a time (a page is the unit the
/// API can resume from).
struct PageReader {
    page: u32,
    end: u32,
    item: u32,
}

impl SplitReader for PageReader {
    type Record = String;
    type Progress = u32;

    async fn next(&mut self) -> NextRecord<String, u32> {
        if self.page == self.end {
            return Ok(None);
        }
        let record = format!("page {} item {}", self.page, self.item);
        self.item += 1;
        if self.item == 25 {
            (self.page, self.item) = (self.page + 1, 0);
        }
        // Resuming at `self.page` replays the items already read of a page: at-least-once.
        Ok(Some((record, self.page)))
    }
}

/// Counts the records, each lane through a clone of it; a real sink's writer would buffer its
/// lane's records and make them durable in `flush`, which runs before every commit.
#[derive(Clone, Default)]
struct Count(Arc<AtomicU64>);

impl Sink<String> for Count {
    type Writer = Count;

    async fn open(&self, _: &LaneInfo) -> Result<Count, SinkError> {
        Ok(self.clone())
    }
}

impl SinkWriter<String> for Count {
    async fn write(&mut self, _: String) -> Result<(), SinkError> {
        self.0.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    async fn flush(&mut self) -> Result<(), SinkError> {
        Ok(())
    }
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let stores = JobStores::memory(JobName::new("paged")?);
    let api = PagedApi { pages: 40, pages_per_split: 10 };
    let count = Count::default();
    let mut workers = Vec::new();
    for id in ["w1", "w2"] {
        let mut config = DriverConfig::default();
        config.instance_id = Some(InstanceId::new(id)?);
        workers.push(Pipeline::new(stores.clone(), api.clone(), count.clone()).config(config).start()?);
    }
    for w in workers {
        assert_eq!(w.outcome().await?, JobOutcome::Complete);
    }
    let n = count.0.load(Ordering::Relaxed);
    println!("job complete: {n} records");
    assert!(n >= 40 * 25, "every item read at least once");
    Ok(())
}
