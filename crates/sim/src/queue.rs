//! Each worker's queue, as a fluid backlog with an M/M/1 delay on top.
//!
//! Over a stretch of `secs` a worker with capacity `mu` (requests/s) that
//! gets `a` new requests and had `b` waiting serves `min(a + b, mu x secs)`;
//! the rest waits into the next stretch (the emulated `--worker-capacity`
//! does the same: a request beyond the worker's budget waits for the next
//! one). The delay of a request served in the stretch is taken as
//! `d + Exp(r)`: `d` the mean backlog over the stretch / `mu` (time spent
//! behind the requests already queued), and `r = mu - lambda` (M/M/1's
//! sojourn time, `lambda = a / secs`) while nothing is queued, `mu` (one
//! service time) once a backlog exists; `r` is at least `mu / 100`.
//! The percentiles are those of the mixture of every worker's stretch,
//! weighted by the requests it served.

/// One worker's stretch: the requests it served and their delay law.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Part {
    pub served: f64,
    /// Fixed delay (seconds) and the rate (1/s) of the exponential on top.
    pub shift: f64,
    pub rate: f64,
}

/// A worker's queue over one stretch: `(served, backlog after, delay law)`.
pub fn serve(backlog: f64, arrivals: f64, mu: f64, secs: f64) -> (f64, f64, Part) {
    let budget = mu * secs;
    let served = (backlog + arrivals).min(budget);
    let after = backlog + arrivals - served;
    let shift = (backlog + after) / 2.0 / mu;
    let lambda = if secs > 0.0 { arrivals / secs } else { 0.0 };
    let rate = if backlog > 0.0 || after > 0.0 { mu } else { (mu - lambda).max(mu / 100.0) };
    (served, after, Part { served, shift, rate })
}

/// The `q`-quantiles (0..1) of the delay over `parts` (seconds), by
/// bisection on the mixture's distribution function.
pub fn quantiles(parts: &[Part], qs: &[f64]) -> Vec<f64> {
    let total: f64 = parts.iter().map(|p| p.served).sum();
    if total <= 0.0 {
        return vec![0.0; qs.len()];
    }
    let cdf = |t: f64| -> f64 {
        parts
            .iter()
            .filter(|p| p.served > 0.0 && t > p.shift)
            .map(|p| p.served * (1.0 - (-(t - p.shift) * p.rate).exp()))
            .sum::<f64>()
            / total
    };
    let hi0 = parts.iter().filter(|p| p.served > 0.0).map(|p| p.shift + 40.0 / p.rate).fold(0.0, f64::max);
    qs.iter()
        .map(|&q| {
            let (mut lo, mut hi) = (0.0, hi0);
            for _ in 0..48 {
                let mid = (lo + hi) / 2.0;
                if cdf(mid) < q {
                    lo = mid;
                } else {
                    hi = mid;
                }
            }
            hi
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_idle_queue_is_m_m_1() {
        let (served, after, p) = serve(0.0, 1_000.0, 2_000.0, 1.0);
        assert_eq!((served, after), (1_000.0, 0.0));
        // M/M/1 sojourn: Exp(mu - lambda); its median ln 2 / 1000 s.
        let q = quantiles(&[p], &[0.5, 0.99]);
        assert!((q[0] - 2f64.ln() / 1_000.0).abs() < 1e-9, "{q:?}");
        assert!((q[1] - 100f64.ln() / 1_000.0).abs() < 1e-9, "{q:?}");
    }

    #[test]
    fn an_overloaded_worker_builds_a_backlog_and_its_delay_grows() {
        let (s1, b1, p1) = serve(0.0, 3_000.0, 2_000.0, 1.0);
        assert_eq!((s1, b1), (2_000.0, 1_000.0));
        let (s2, b2, p2) = serve(b1, 3_000.0, 2_000.0, 1.0);
        assert_eq!((s2, b2), (2_000.0, 2_000.0));
        assert!(p2.shift > p1.shift && p1.shift > 0.2);
        // The backlog drains once the load falls.
        let (s3, b3, _) = serve(b2, 500.0, 2_000.0, 1.0);
        assert_eq!((s3, b3), (2_000.0, 500.0));
    }

    #[test]
    fn the_mixtures_quantiles_weigh_by_requests_served() {
        let fast = Part { served: 99.0, shift: 0.0, rate: 1e6 };
        let slow = Part { served: 1.0, shift: 1.0, rate: 1e6 };
        let q = quantiles(&[fast, slow], &[0.5, 0.98, 0.999]);
        assert!(q[0] < 1e-5 && q[1] < 1e-5, "{q:?}");
        assert!(q[2] > 1.0, "{q:?}");
    }
}
