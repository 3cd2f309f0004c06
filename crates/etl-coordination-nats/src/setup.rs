//! The vocabulary of setup: its error, and the retries of a server that is starting, electing
//! or loaded.

use std::time::Duration;

use etl_coordination_core::StoreError;

pub(crate) fn setup(msg: String) -> StoreError {
    StoreError::Setup(msg)
}
/// How long setup retries what a server that is starting, electing or loaded answers (late,
/// "temporarily unavailable", a bucket not yet visible on every node) before giving up.
pub(crate) const SETUP_WINDOW: Duration = Duration::from_secs(15);

/// Pauses between setup attempts: 50 ms doubling up to 500 ms, each with a random extra of up
/// to itself (jitter: workers that start together do not retry in lockstep), within
/// [`SETUP_WINDOW`].
pub(crate) struct SetupRetry {
    deadline: tokio::time::Instant,
    delays: backon::ExponentialBackoff,
}

impl SetupRetry {
    pub(crate) fn new() -> Self {
        use backon::BackoffBuilder;
        let delays = backon::ExponentialBuilder::default()
            .with_min_delay(Duration::from_millis(50))
            .with_max_delay(Duration::from_millis(500))
            .with_jitter()
            .without_max_times()
            .build();
        SetupRetry { deadline: tokio::time::Instant::now() + SETUP_WINDOW, delays }
    }

    /// Waits before the next attempt; false (without waiting) once the window is used up.
    pub(crate) async fn pause(&mut self) -> bool {
        let pause = self.delays.next().unwrap_or(Duration::from_millis(500));
        if tokio::time::Instant::now() + pause > self.deadline {
            return false;
        }
        tokio::time::sleep(pause).await;
        true
    }
}
