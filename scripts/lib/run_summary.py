#!/usr/bin/env python3
"""The main job's summary (scripts/run.sh).

usage: run_summary.py RUN.json [RUN.json ...]   the runs side by side, per phase
       run_summary.py --stats CLUSTER.toml      each server's `stats balancer` (a running cluster)

Per phase of the bench's timeline and per run (its JSON's file name, e.g. run-off, run-on):
the per-worker load spread from the servers' own epochs (`mbal load`: the cluster's max/avg of
the workers' mean requests/s over the phase), the p99 latency (the median and the worst of the
phase's per-second p99, counted from the intended send time: open loop), the mean throughput,
and the balancer's moves; for the hot partition also its first and last third (how far the
balancer got). Then every move and escalation of each run, with its time.
"""
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from mcstats import cluster_addrs, stats as mc_stats  # noqa: E402


def spread(eps):
    """Per-worker mean req/s over the epochs: (cluster-wide max/avg, the hottest worker)."""
    per = {}
    for e in eps:
        for w in e["workers"]:
            per.setdefault((w["server"], w["worker"]), []).append(w["ops_per_sec"])
    means = {k: sum(v) / len(v) for k, v in per.items()}
    avg = sum(means.values()) / len(means) if means else 0
    if not avg:
        return None, None
    hot = max(means, key=means.get)
    return max(means.values()) / avg, hot


def median(xs):
    xs = sorted(xs)
    return xs[len(xs) // 2] if xs else float("nan")


def phase_rows(r):
    load = r.get("server_load") or {}
    epochs, events = load.get("epochs", []), load.get("events", [])
    rows, t0 = [], 0.0
    for p in r["phases"]:
        parts = [(p["workload"], t0, t0 + p["secs"])]
        if p["workload"] == "hotpart":
            third = p["secs"] / 3
            parts += [("  first 3rd", t0, t0 + third), ("  last 3rd", t0 + p["secs"] - third, t0 + p["secs"])]
        for name, a, b in parts:
            inside = [e for e in epochs if e["t_end"] - e["secs"] >= a - 0.05 and e["t_end"] <= b + 0.05]
            secs = [s for s in r["timeline"] if a <= s["t"] < b]
            # The first second of a phase carries the one before's backlog: left out of p99.
            steady = secs[1:] if len(secs) > 2 else secs
            rows.append({
                "name": name,
                "span": f"{a:.0f}-{b:.0f} s",
                "spread": spread(inside)[0],
                "p99": median([s["p99_us"] for s in steady]) / 1e3,
                "p99_max": max((s["p99_us"] for s in steady), default=float("nan")) / 1e3,
                "ops": sum(s["ops_per_sec"] for s in secs) / len(secs) if secs else float("nan"),
                "moves": sum(1 for e in events if e["kind"] == "move" and a <= e["t"] < b),
            })
        t0 += p["secs"]
    return rows, events


def summary(paths):
    runs = []
    for p in paths:
        r = json.load(open(p))
        rows, events = phase_rows(r)
        runs.append((os.path.splitext(os.path.basename(p))[0], rows, events))
    print("\nper phase: per-worker max/avg (servers' epochs) | p99 ms, median second [worst] | ops/s | moves")
    head = f"  {'phase':12} {'time':>9}"
    for label, _, _ in runs:
        head += f" | {label:^38}"
    print(head)
    for i, row in enumerate(runs[0][1]):
        line = f"  {row['name']:12} {row['span']:>9}"
        for _, rows, _ in runs:
            x = rows[i]
            sp = f"{x['spread']:.2f}" if x["spread"] else "-"
            line += f" | {sp:>5} {x['p99']:8.1f} [{x['p99_max']:8.1f}] {x['ops']:6.0f} {x['moves']:3d}"
        print(line)
    for label, _, events in runs:
        shown = [e for e in events if e["kind"] in ("move", "escalate")]
        print(f"\n{label}: {sum(1 for e in shown if e['kind'] == 'move')} moves")
        for e in shown:
            if e["kind"] == "move":
                print(f"  t={e['t']:5.1f} s  server {e['server']}: cachelet {e['cachelet']} "
                      f"w{e['from_worker']} -> w{e['to_worker']} ({e['why']})")
            else:
                print(f"  t={e['t']:5.1f} s  server {e['server']}: Phase 3 wanted ({e['why']})")


def stats(cluster_file):
    print("\nstats balancer (the balancer's run):")
    keys = ["state", "plans", "moves", "moves_home", "moves_failed", "escalations", "leases", "planner_us_max"]
    for i, addr in enumerate(cluster_addrs(cluster_file)):
        st = mc_stats(addr, "balancer")
        print(f"  server {i}: " + ", ".join(f"{k} {st.get(k, '-')}" for k in keys))


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--stats":
        stats(sys.argv[2])
    elif len(sys.argv) >= 2:
        summary(sys.argv[1:])
    else:
        sys.exit(__doc__)
