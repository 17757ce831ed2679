#!/usr/bin/env python3
"""The per-epoch max/avg worker load that the lease draws alone give (docs/benchmarks-journal.md §15,
round 5): the testbed's Zipf 0.99 over 50,000 keys at 44,800 requests/s on 16 workers (8 servers
x 2), its TOP hottest keys each with COPIES copies (home + copies on random workers of other
servers), every other key on one random worker (its home; `--even`: spread evenly instead), and
CLIENTS logical clients each reading one copy of each key, drawn uniformly per lease
(docs/protocol.md), plus Poisson noise. No policy, no queueing: what per-epoch max/avg the
bench can show once the hottest keys are replicated as well as they can be.

    python3 scripts/lib/lease_draw_sim.py [--even] [CLIENTS ...]   # default 64 256 4096
"""
import math
import random
import sys

N, S, TOTAL, WORKERS, TOP, COPIES, TRIALS = 50_000, 0.99, 44_800.0, 16, 80, 15, 300


def trial(rng, rates, clients, even):
    if even:
        load = [sum(rates[TOP:]) / WORKERS] * WORKERS
    else:
        load = [0.0] * WORKERS
        for f in rates[TOP:]:
            load[rng.randrange(WORKERS)] += f
    for f in rates[:TOP]:
        home = rng.randrange(WORKERS)
        others = [w for w in range(WORKERS) if w // 2 != home // 2]
        locs = [home] + rng.sample(others, COPIES - 1)
        for _ in range(clients):
            load[locs[rng.randrange(COPIES)]] += f / clients
    load = [x + rng.gauss(0.0, math.sqrt(x)) for x in load]
    return max(load) / (sum(load) / WORKERS)


def main():
    h = sum(r ** -S for r in range(1, N + 1))
    rates = [TOTAL * r ** -S / h for r in range(1, N + 1)]
    even = "--even" in sys.argv[1:]
    for clients in [int(a) for a in sys.argv[1:] if a != "--even"] or [64, 256, 4096]:
        rng = random.Random(1)
        xs = sorted(trial(rng, rates, clients, even) for _ in range(TRIALS))
        above = sum(x > 1.2 for x in xs) / TRIALS
        print(f"clients {clients}: per-epoch max/avg mean {sum(xs) / TRIALS:.3f}, "
              f"90th percentile {xs[int(0.9 * TRIALS)]:.3f}, above 1.2 in {above:.1%} of epochs")


if __name__ == "__main__":
    main()
