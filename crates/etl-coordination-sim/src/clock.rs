//! A worker's own monotonic clock: an origin of its own, a rate that drifts from the store's
//! by some parts per million, and forward jumps (a VM resumed, a clock slewed). The core is
//! fed this clock; the store (and every checker) runs on the simulation's global time.

use etl_coordination_core::Timestamp;

/// Maps global (store) time to one worker's local time and back.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Clock {
    /// Local time at global time zero (a process's monotonic clock starts anywhere).
    offset_us: u64,
    /// Rate difference in parts per million: positive runs fast, negative runs slow.
    drift_ppm: i64,
}

impl Clock {
    pub(crate) fn new(offset_us: u64, drift_ppm: i64) -> Self {
        Clock { offset_us, drift_ppm }
    }

    /// The worker's reading at global time `t`.
    pub(crate) fn local(&self, t: Timestamp) -> Timestamp {
        let scaled = t.0 as i128 + t.0 as i128 * self.drift_ppm as i128 / 1_000_000;
        Timestamp(self.offset_us + scaled.max(0) as u64)
    }

    /// The first global time at which the worker's clock reads at least `local`.
    pub(crate) fn global(&self, local: Timestamp) -> Timestamp {
        let since = local.0.saturating_sub(self.offset_us) as i128;
        let t = since * 1_000_000 / (1_000_000 + self.drift_ppm as i128);
        let mut g = Timestamp(t.max(0) as u64);
        // Integer rounding (a slow clock reads the same microsecond at two global times): step
        // back while an earlier time reads it too, forward until the clock really reads `local`.
        while g.0 > 0 && self.local(Timestamp(g.0 - 1)) >= local {
            g = Timestamp(g.0 - 1);
        }
        while self.local(g) < local {
            g = Timestamp(g.0 + 1);
        }
        g
    }

    /// The clock jumps forward by `us` microseconds (monotonic clocks never jump back).
    pub(crate) fn jump(&mut self, us: u64) {
        self.offset_us += us;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn local_and_global_are_inverse_and_monotonic() {
        for drift in [-10_000, -100, 0, 100, 10_000] {
            let c = Clock::new(5_000_000, drift);
            let mut last = Timestamp::ZERO;
            for t in [0u64, 1, 999, 1_000_000, 123_456_789] {
                let l = c.local(Timestamp(t));
                assert!(l >= last);
                last = l;
                let g = c.global(l);
                assert!(g.0 <= t && c.local(g) >= l, "drift {drift}: {t} -> {l:?} -> {g:?}");
            }
        }
    }
}
