//! Time as an input. The core never reads a clock (P14): every call carries `now`.

use std::ops::{Add, Sub};
use std::time::Duration;

use serde::{Deserialize, Serialize};

/// A point on the caller's monotonic clock, in microseconds since an origin the caller picks
/// (process start in the driver, zero in the simulator).
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Debug, Default, Serialize, Deserialize)]
pub struct Timestamp(pub u64);

impl Timestamp {
    /// The origin.
    pub const ZERO: Timestamp = Timestamp(0);

    /// Microseconds since the origin.
    pub fn from_micros(micros: u64) -> Self {
        Timestamp(micros)
    }

    /// Milliseconds since the origin.
    pub fn from_millis(millis: u64) -> Self {
        Timestamp(millis * 1000)
    }

    /// Time since the origin.
    pub fn since_origin(self) -> Duration {
        Duration::from_micros(self.0)
    }

    /// `self - earlier`, or zero if `earlier` is later.
    pub fn saturating_since(self, earlier: Timestamp) -> Duration {
        Duration::from_micros(self.0.saturating_sub(earlier.0))
    }
}

impl Add<Duration> for Timestamp {
    type Output = Timestamp;
    fn add(self, rhs: Duration) -> Timestamp {
        Timestamp(self.0.saturating_add(u64::try_from(rhs.as_micros()).unwrap_or(u64::MAX)))
    }
}

impl Sub<Duration> for Timestamp {
    type Output = Timestamp;
    fn sub(self, rhs: Duration) -> Timestamp {
        Timestamp(self.0.saturating_sub(u64::try_from(rhs.as_micros()).unwrap_or(u64::MAX)))
    }
}
