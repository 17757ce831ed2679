//! Phase 1's arithmetic: the sampling rate, NetKV's estimate of the max/avg worker load
//! given each hot key's rate and copies, the copies for a rate at a threshold, and the
//! adaptive threshold that meets a target imbalance.

/// The sampling rate that gives `target` samples per worker and epoch at
/// `per_worker` requests per worker and epoch, within `min..=max`; `max`
/// when nothing was counted.
pub fn sample_rate_for(target: f64, per_worker: f64, min: f64, max: f64) -> f64 {
    let (min, max) = (min.clamp(1e-9, 1.0), max.clamp(1e-9, 1.0));
    if per_worker <= 0.0 {
        return max;
    }
    (target / per_worker).clamp(min.min(max), max)
}

/// The estimated max/avg worker load (NetKV §IV-D, in its "many balls"
/// form generalised to unequal balls): each key of rate f with r copies on
/// distinct workers puts f/r on r of the n workers, so it adds
/// (f²/n)(1/r − 1/n) to a worker's load variance; the most loaded of n
/// workers is estimated at avg + max(E[max of n standard normals] · σ,
/// the largest single copy f/r − f/n). (NetKV's Eq. 1 uses √(2 ln n) for
/// the first factor, an upper bound that is 33% high at n = 16; the
/// expected maximum is what a settled max/avg measures.) Keys the tracker does not hold are NetKV's cold keys,
/// spread evenly. `spread` multiplies the variance: this server sees
/// 1/`spread` of the cluster's keys, and the others' are taken to look
/// like its own.
pub fn estimate_max_over_avg(rates: &[(f64, u32)], avg: f64, n: usize, spread: f64) -> f64 {
    estimate_with(rates, avg, n, spread, expected_max_normal(n))
}

fn estimate_with(rates: &[(f64, u32)], avg: f64, n: usize, spread: f64, emax: f64) -> f64 {
    if avg <= 0.0 || n < 2 {
        return 1.0;
    }
    let nf = n as f64;
    let mut var = 0.0;
    let mut piece: f64 = 0.0;
    for &(f, r) in rates {
        let r = f64::from(r.max(1)).min(nf);
        var += f * f / nf * (1.0 / r - 1.0 / nf);
        piece = piece.max(f / r - f / nf);
    }
    let spread_dev = emax * (var * spread.max(1.0)).sqrt();
    1.0 + spread_dev.max(piece) / avg
}

/// Φ, the standard normal distribution function (Abramowitz and Stegun
/// 7.1.26, error under 1.5e-7).
fn normal_cdf(x: f64) -> f64 {
    let z = x.abs() / std::f64::consts::SQRT_2;
    let t = 1.0 / (1.0 + 0.327_591_1 * z);
    let poly =
        t * (0.254_829_592 + t * (-0.284_496_736 + t * (1.421_413_741 + t * (-1.453_152_027 + t * 1.061_405_429))));
    let erf = 1.0 - poly * (-z * z).exp();
    0.5 * (1.0 + if x >= 0.0 { erf } else { -erf })
}

/// E[max of n independent standard normals], by numeric integration of
/// x · n φ(x) Φ(x)^(n−1) (0 for n ≤ 1).
pub fn expected_max_normal(n: usize) -> f64 {
    if n <= 1 {
        return 0.0;
    }
    let steps = 2000;
    let (lo, hi) = (-8.0, 8.0);
    let h = (hi - lo) / f64::from(steps);
    let nf = n as f64;
    (0..steps)
        .map(|i| {
            let x = lo + (f64::from(i) + 0.5) * h;
            let pdf = (-x * x / 2.0).exp() / (2.0 * std::f64::consts::PI).sqrt();
            x * nf * pdf * normal_cdf(x).powf(nf - 1.0) * h
        })
        .sum()
}

/// Copies for a key of rate `f` at threshold `t`: ceil(f/t), at least 1,
/// at most `max_copies`.
pub fn copies(f: f64, t: f64, max_copies: u32) -> u32 {
    if t <= 0.0 || f <= t {
        return 1;
    }
    ((f / t).ceil() as u32).clamp(1, max_copies.max(1))
}

/// NetKV §IV-E's adaptive threshold: sweeping T down from the hottest
/// rate by 10% steps, the largest T whose estimate meets `target`
/// (replicable keys at ceil(f/T) copies, others at 1). Returns (T, the
/// estimate at T); when no T meets it, the smallest tried (every key at
/// its most copies).
pub fn choose_threshold(
    keys: &[(f64, bool)],
    avg: f64,
    n: usize,
    spread: f64,
    max_copies: u32,
    target: f64,
) -> (f64, f64) {
    let fmax = keys.iter().filter(|k| k.1).map(|k| k.0).fold(0.0, f64::max);
    let emax = expected_max_normal(n);
    let at = |t: f64| {
        let rates: Vec<(f64, u32)> =
            keys.iter().map(|&(f, ok)| (f, if ok { copies(f, t, max_copies) } else { 1 })).collect();
        estimate_with(&rates, avg, n, spread, emax)
    };
    if fmax <= 0.0 {
        return (f64::INFINITY, at(f64::INFINITY));
    }
    let fmin = keys.iter().filter(|k| k.1 && k.0 > 0.0).map(|k| k.0).fold(fmax, f64::min);
    let mut t = fmax;
    let mut est = at(t);
    // Below fmin / max_copies nothing changes any more.
    let floor = fmin / f64::from(max_copies.max(1)) * 0.9;
    while est > target && t > floor {
        t *= 0.9;
        est = at(t);
    }
    (t, est)
}
