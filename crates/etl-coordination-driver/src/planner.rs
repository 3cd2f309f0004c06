//! [`Planner`]: the source's enumeration of its work, run only on the leader (P4).

use std::future::Future;

use etl_coordination_core::{Plan, SplitId};

/// Enumerates a source's work as splits. Runs only on the fleet's leader (P4).
pub trait Planner: Send + Sync + 'static {
    /// Identifies the planner and its configuration (source kind, input location, split
    /// sizing): every replica of a job must report the same value, or it is refused at startup
    /// with both fingerprints in the error (P2).
    fn fingerprint(&self) -> String;

    /// Lists the work. Split ids must be deterministic (re-planning the same input yields the
    /// same ids) and unique.
    fn plan(&self) -> impl Future<Output = Result<Plan, PlanError>> + Send;

    /// Lists the work knowing which splits the published plan already has (an open plan's
    /// earlier rounds; empty for the first). What the driver calls; by default [`Planner::plan`].
    /// A planner of a growing input can start where the published splits end (their ids can
    /// carry what it needs, e.g. a range's bounds), instead of enumerating everything again.
    fn replan(&self, published: &[SplitId]) -> impl Future<Output = Result<Plan, PlanError>> + Send {
        let _ = published;
        self.plan()
    }
}

/// A planner failure; the leader retries after a heartbeat interval. It is a message (it is
/// logged, counted and kept as the leader's last planning error, across tasks), built with
/// [`PlanError::from_error`] to keep an error's whole chain of sources.
#[derive(Debug, Clone, thiserror::Error)]
#[error("{0}")]
pub struct PlanError(pub String);

impl PlanError {
    /// The error and every source under it, `outer: inner: ...`.
    pub fn from_error(e: &(dyn std::error::Error + 'static)) -> Self {
        PlanError(error_chain(e))
    }
}

/// An error and every source under it, `outer: inner: ...`: the text to put in a
/// [`SourceError`](crate::SourceError), a [`SinkError`](crate::SinkError) or a [`PlanError`], which are messages
/// (they cross tasks and are kept in the split's record as its last error).
pub fn error_chain(e: &dyn std::error::Error) -> String {
    let mut out = e.to_string();
    let mut cur = e.source();
    while let Some(s) = cur {
        out.push_str(": ");
        out.push_str(&s.to_string());
        cur = s.source();
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, thiserror::Error)]
    #[error("listing s3://bucket/prefix")]
    struct Listing(#[source] std::io::Error);

    #[test]
    fn a_plan_error_from_an_error_keeps_every_source_in_its_message() {
        let e = Listing(std::io::Error::other("503 Slow Down"));
        assert_eq!(PlanError::from_error(&e).to_string(), "listing s3://bucket/prefix: 503 Slow Down");
    }
}
