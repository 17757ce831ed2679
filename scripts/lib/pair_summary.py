"""Medians of a two-sided proxy A/B (bench-proxy-ab.sh: before/after, bench-proxy-tls.sh: plain/tls).

    python3 scripts/lib/pair_summary.py OUT RUNS HZ SIDE_A SIDE_B

Reads OUT/<scenario>.<side>.<run>.json (mbal bench --json) and .cpu (proxy clock ticks over the run)
and prints, per scenario, throughput, proxy CPU per request, p50 and p99 for both sides, and B/A ratios;
with .periods files (a CPU quota: quota periods, throttled ones), also the median share of periods throttled.
"""
import json
import os
import statistics
import sys

out, runs, hz, side_a, side_b = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]
med = statistics.median


def rows(n, side):
    r = []
    for i in range(1, runs + 1):
        d = json.load(open(f"{out}/{n}.{side}.{i}.json"))
        t = int(open(f"{out}/{n}.{side}.{i}.cpu").read())
        r.append((d["totals"]["ops_per_sec"], t / hz / max(d["totals"]["requests"], 1) * 1e6,
                  d["latency"]["all"]["p50_us"], d["latency"]["all"]["p99_us"]))
    return r


a_, b_ = side_a[0], side_b[0]
print(f"medians of {runs} alternated runs")
print(f"{'scenario':8} {'ops/s ' + side_a:>12} {side_b:>10} {'ratio':>6} {'cpu us/req ' + side_a:>17} {side_b:>6} {'ratio':>6}"
      f" {f'p50 us {a_}/{b_}':>12} {f'p99 us {a_}/{b_}':>13}")


def throttled(n, side):
    r = []
    for i in range(1, runs + 1):
        p = f"{out}/{n}.{side}.{i}.periods"
        if os.path.exists(p):
            periods, thr = (int(x) for x in open(p).read().split())
            if periods:
                r.append(100 * thr / periods)
    return med(r) if r else None


for n in ("get", "set", "lat_get"):
    if not os.path.exists(f"{out}/{n}.{side_a}.1.json"):
        continue
    a, b = rows(n, side_a), rows(n, side_b)
    col = lambda r, k: med([x[k] for x in r])
    print(f"{n:8} {col(a,0):12.0f} {col(b,0):10.0f} {col(b,0)/col(a,0):6.3f} {col(a,1):17.2f} {col(b,1):6.2f} "
          f"{col(b,1)/col(a,1):6.3f} {col(a,2):6.1f}/{col(b,2):<5.1f} {col(a,3):6.1f}/{col(b,3):<6.1f}"
          + (f" throttled {ta:.0f}%/{tb:.0f}%" if (ta := throttled(n, side_a)) is not None
             and (tb := throttled(n, side_b)) is not None else ""))
