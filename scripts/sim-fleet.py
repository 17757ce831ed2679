#!/usr/bin/env python3
"""The balancer at fleet size, in the simulator (issue 35; docs/benchmarks.md §20).

For each fleet size S x W, runs `mbal sim` with the balancer off, Phase 1 alone and every
phase, on Zipf 0.99 over 3,125 keys per worker (50,000 at 8 x 2), and prints one table
row per size and run: the settled max/avg over workers and over servers (NetKV's Fig. 17
figure), the most keys with copies against Fan et al.'s 2·n·ln n, the most copies, the
share of reads the copies served, and the simulator's wall time.

    flock /tmp/bench.lock python3 scripts/sim-fleet.py --sizes 8x2,32x4,64x8 --seeds 1,2
"""
import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mbal", default="target/release/mbal")
    ap.add_argument("--sizes", default="8x2,16x4,32x4,64x8")
    ap.add_argument("--seeds", default="1")
    ap.add_argument("--runs", default="off,phase1,all")
    ap.add_argument("--epochs", type=int, default=40)
    ap.add_argument("--settle", type=float, default=10.0)
    ap.add_argument("--keys-per-worker", type=int, default=3125)
    ap.add_argument("extra", nargs="*", help="more `mbal sim` flags, after --")
    a = ap.parse_args()
    print(
        "| servers x workers | seed | run | max/avg (workers) | max/avg (servers) | keys with copies (most) | 2·n·ln n "
        "| copies (most) | reads served by copies | sim wall s |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for size in a.sizes.split(","):
        s, w = (int(x) for x in size.split("x"))
        n = s * w
        bound = math.floor(2 * n * math.log(n))
        for seed in a.seeds.split(","):
            with tempfile.TemporaryDirectory() as d:
                out = os.path.join(d, "sim.jsonl")
                cmd = [
                    a.mbal, "sim", "--servers", str(s), "--workers", str(w), "--workload", "zipf", "--zipf", "0.99",
                    "--keys", str(a.keys_per_worker * n), "--runs", a.runs, "--epochs", str(a.epochs),
                    "--settle", str(a.settle), "--seed", seed, "--json", out,
                ] + a.extra
                t0 = time.monotonic()
                subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                wall = time.monotonic() - t0
                for line in open(out):
                    r = json.loads(line)
                    if "summary" not in r:
                        continue
                    m = r["summary"]
                    print(
                        f"| {s} x {w} | {seed} | {m['run']} | {m['max_over_avg']:.2f} | {m['servers_max_over_avg']:.2f} "
                        f"| {m['hot_keys_max']} | {bound} | {m['copies_max']} | {100 * m['copy_share']:.0f}% | {wall:.1f} |"
                    )
            sys.stdout.flush()


if __name__ == "__main__":
    main()
