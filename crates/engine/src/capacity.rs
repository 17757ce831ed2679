//! Emulated per-worker capacity (`--worker-capacity OPS_PER_SEC`): a token
//! bucket that caps how many requests a worker executes per second, so that
//! on a machine with fewer cores than workers a hot worker still queues the
//! way a saturated core would (DESIGN.md §8, "a cluster on one machine").
//!
//! The bucket is refilled from the worker's clock at the start of each
//! round of its loop. A request costs one token whether it came from one of
//! the worker's connections or from another worker; the worker takes work
//! only while it has credit (a peer's batch is cut where the credit ends and
//! resumed later), so over any window the worker serves at most the cap
//! times the window plus the bucket. Out of credit, the worker leaves its
//! connections' input in their socket buffers and peers' batches in its
//! inbox, and sleeps in `poll` until the bucket has credit again
//! ([`Capacity::wait`]).
//!
//! Unlimited (the default, 0), the bucket holds `i64::MAX` and a request
//! costs 0: the data path's check is one branch that is never taken.

use std::time::Duration;

/// Units of credit per token: a token is `ONE` units, and a second of the
/// clock adds `per_sec × 10⁹` units, so credit is kept exactly in integers.
const ONE: i64 = 1_000_000_000;

/// The bucket holds this much time's worth of tokens: long enough that a
/// sleep overshooting by a millisecond or two (`poll` has millisecond
/// granularity) loses nothing, short enough that the cap holds over any
/// window of more than a few milliseconds.
pub const BURST_NS: u64 = 5_000_000;

/// Caps above this are taken as this (a trillion requests a second is
/// unlimited in practice), so the bucket's size fits its integer.
const MAX_PER_SEC: u64 = 1_000_000_000_000;

#[derive(Debug)]
pub struct Capacity {
    /// Credit in units (`ONE` per token); may go negative (debt).
    credit: i64,
    /// What one request costs: `ONE`, or 0 when unlimited.
    cost: i64,
    /// Tokens per second; 0: unlimited.
    per_sec: u64,
    /// The bucket's size in units.
    burst: i64,
    /// The clock reading (ns) the credit is current to.
    last_ns: u64,
}

impl Capacity {
    /// A bucket of `per_sec` requests per second (0: unlimited), full at `now_ns`.
    pub fn new(per_sec: u64, now_ns: u64) -> Capacity {
        if per_sec == 0 {
            return Capacity { credit: i64::MAX, cost: 0, per_sec: 0, burst: i64::MAX, last_ns: now_ns };
        }
        let per_sec = per_sec.min(MAX_PER_SEC);
        // At least one token, else a tiny cap could never serve anything.
        let burst = ((per_sec * BURST_NS) as i64).max(ONE);
        Capacity { credit: burst, cost: ONE, per_sec, burst, last_ns: now_ns }
    }

    /// Is there a cap at all? (Branch on this before any work that only a
    /// capped worker does.)
    #[inline]
    pub fn limited(&self) -> bool {
        self.per_sec != 0
    }

    /// May the worker take one more request? Always true when unlimited.
    #[inline]
    pub fn has_credit(&self) -> bool {
        self.credit > 0
    }

    /// How many requests the credit pays for now: every whole token, and
    /// one more on a sliver (0 when out of credit).
    pub fn available(&self) -> usize {
        if self.credit <= 0 {
            return 0;
        }
        usize::try_from((self.credit as u64).div_ceil(ONE as u64)).unwrap_or(usize::MAX)
    }

    /// Pay for `n` requests executed (nothing when unlimited).
    #[inline]
    pub fn spend(&mut self, n: u64) {
        self.credit = self.credit.saturating_sub(self.cost.saturating_mul(n as i64));
    }

    /// Add the credit earned since the last refill, up to the bucket's size.
    pub fn refill(&mut self, now_ns: u64) {
        if !self.limited() || now_ns <= self.last_ns {
            return;
        }
        let earned = (now_ns - self.last_ns) as u128 * self.per_sec as u128;
        self.last_ns = now_ns;
        let earned = i64::try_from(earned).unwrap_or(i64::MAX);
        self.credit = self.credit.saturating_add(earned).min(self.burst);
    }

    /// How long until there is credit again (zero if there is some now).
    pub fn wait(&self) -> Duration {
        if self.credit > 0 || self.per_sec == 0 {
            return Duration::ZERO;
        }
        // Units needed to get above zero, earned at per_sec units per ns.
        let need = (1 - self.credit) as u64;
        Duration::from_nanos(need.div_ceil(self.per_sec))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unlimited_never_runs_out() {
        let mut c = Capacity::new(0, 0);
        assert!(!c.limited());
        for _ in 0..1000 {
            assert!(c.has_credit());
            c.spend(1_000_000);
        }
        assert!(c.has_credit());
        assert_eq!(c.wait(), Duration::ZERO);
    }

    #[test]
    fn starts_with_a_full_bucket_and_refills_at_the_rate() {
        // 10,000/s: 50 tokens in 5 ms.
        let mut c = Capacity::new(10_000, 0);
        assert_eq!(c.available(), 50);
        let mut served = 0;
        while c.has_credit() {
            c.spend(1);
            served += 1;
        }
        assert_eq!(served, 50);
        assert_eq!(c.available(), 0);
        // Empty: any credit at all (one nanosecond's) lets the next one start.
        assert_eq!(c.wait(), Duration::from_nanos(1));
        c.spend(1);
        // One token of debt: 100 µs to pay it back, and a nanosecond more.
        assert_eq!(c.wait(), Duration::from_nanos(100_001));
        c.refill(100_000);
        assert!(!c.has_credit());
        c.refill(100_001);
        assert!(c.has_credit());
        // A long pause refills only up to the bucket.
        c.refill(10_000_000_000);
        let mut served = 0;
        while c.has_credit() {
            c.spend(1);
            served += 1;
        }
        assert_eq!(served, 50);
    }

    #[test]
    fn the_rate_holds_over_a_long_run_of_small_refills() {
        // Refill every 37 µs for one simulated second, serving whenever
        // there is credit: the total is the rate plus at most the bucket.
        let rate = 7_000u64;
        let mut c = Capacity::new(rate, 0);
        let (mut t, mut served) = (0u64, 0u64);
        while t <= 1_000_000_000 {
            c.refill(t);
            while c.has_credit() {
                c.spend(1);
                served += 1;
            }
            t += 37_000;
        }
        let burst = rate * BURST_NS / 1_000_000_000;
        assert!(served <= rate + burst + 1, "served {served}");
        assert!(served >= rate - 1, "served {served}");
    }

    #[test]
    fn debt_is_paid_back_before_more_work() {
        let mut c = Capacity::new(1_000, 0); // 5 tokens in the bucket
        c.spend(25); // a forwarded batch taken whole: 20 tokens of debt
        assert!(!c.has_credit());
        // 20 tokens of debt plus one to get above zero: 21 ms.
        assert_eq!(c.wait(), Duration::from_nanos(20_000_001));
        c.refill(20_000_000);
        assert!(!c.has_credit());
        c.refill(20_000_001);
        assert!(c.has_credit());
    }

    #[test]
    fn a_tiny_cap_still_serves() {
        let mut c = Capacity::new(1, 0);
        assert!(c.has_credit());
        c.spend(2);
        assert!(!c.has_credit());
        assert_eq!(c.wait(), Duration::from_nanos(1_000_000_001));
        c.refill(1_000_000_001);
        assert!(c.has_credit());
    }
}
