#!/usr/bin/env python3
"""The balancer-off/on table of scripts/bench-balance.sh, from the JSON it wrote.

usage: balance_report.py OUT TOPO WORKLOAD RUNS "MODES" SETTLED_AT P99_TARGET_US

For each mode and run it reads OUT/TOPO.WORKLOAD.MODE.RUN.json (the fixed-rate run, with the
servers' epochs from `mbal load`), .sweep.json (the rate sweep, if any) and .stats.json (every
server's `stats balancer` at the end), prints one line per run and a markdown table of the
medians, and the on/off ratios. The `proxy` mode's runs (scripts/lib/ycsb_driver.py's JSON, in
the same shape) add .proxystats.json (`mbal proxy`'s `stats` at the end) and a table of what the
client saw through the proxy.
"""
import json
import os
import statistics
import sys

out, topo, wl, runs, modes, settled_at, p99_target = sys.argv[1:8]
runs, modes, settled_at, p99_target = int(runs), modes.split(), float(settled_at), float(p99_target)
ONSET_END = 3.5  # seconds: epochs ending by then are the hotspot's onset (before any move can act)
KNOB = os.environ.get("KNOB", "balancer")  # the server flag the modes toggle
SHIFT_AT = float(os.environ["SHIFT_AT"]) if os.environ.get("SHIFT_AT") else None  # the hot set changes
REACTED_AT = 1.2  # max/avg back under this after the shift: the reaction time
REACTION_WINDOW_S = 1.0  # ... over windows of at least this long, whatever the epoch length


def spread(epochs):
    """Per-worker mean req/s over the epochs: (max/avg, max, avg)."""
    per = {}
    for e in epochs:
        for w in e["workers"]:
            per.setdefault((w["server"], w["worker"]), []).append(w["ops_per_sec"])
    means = [sum(v) / len(v) for v in per.values()]
    if not means:
        return (float("nan"), 0.0, 0.0)
    avg = sum(means) / len(means)
    return (max(means) / avg if avg else float("nan"), max(means), avg)


def stays_from(values, limit):
    """Index of the first value from which every value is <= limit (None: the last is above)."""
    k = len(values)
    while k > 0 and values[k - 1] <= limit:
        k -= 1
    return k if k < len(values) else None


def settle_time(epochs, secs):
    """Start of the first window (as `windows`: at least REACTION_WINDOW_S, so 500 ms epochs
    are taken in pairs) from which max/avg stays <= settled_at (None: never)."""
    rs = [r for r in windows(epochs, 0.0) if r[1] <= secs + 0.5]
    k = stays_from([r[2] for r in rs], settled_at)
    return None if k is None else max(rs[k][0], 0.0)


def windows(epochs, after, secs=REACTION_WINDOW_S):
    """Rounds (the k-th epoch of every server together) ending after `after`, merged in order
    into windows of at least `secs` seconds (per-worker loads averaged over the window's epochs,
    by their length): [(start, end, max/avg over all workers)]. With 1 s epochs each window is
    one round."""
    by = {}
    for e in epochs:
        by.setdefault(e["server"], []).append(e)
    n = min(len(v) for v in by.values()) if by else 0
    out, acc, length, start = [], {}, 0.0, None
    for k in range(n):
        es = [v[k] for v in by.values()]
        if max(e["t_end"] for e in es) <= after:
            continue
        sec = max(e["secs"] for e in es)
        start = min(e["t_end"] - e["secs"] for e in es) if start is None else start
        for e in es:
            for w in e["workers"]:
                acc[(e["server"], w["worker"])] = acc.get((e["server"], w["worker"]), 0.0) + w["ops_per_sec"] * e["secs"]
        length += sec
        if length >= secs - 0.05:
            avg = sum(acc.values()) / len(acc)
            out.append((start, max(e["t_end"] for e in es), max(acc.values()) / avg if avg else 0))
            acc, length, start = {}, 0.0, None
    return out


def reaction(epochs):
    """Seconds from the hot-set shift to the end of the first window from which max/avg stays
    <= REACTED_AT, over windows of REACTION_WINDOW_S (1 s: with shorter epochs, a single
    epoch's sampling noise past 1.2 would otherwise decide it)."""
    if SHIFT_AT is None:
        return None
    rs = windows(epochs, SHIFT_AT + 0.05)
    k = stays_from([r[2] for r in rs], REACTED_AT)
    return None if k is None else max(rs[k][1] - SHIFT_AT, 0.0)


def recovered(timeline):
    """Start of the first whole second from which every second's p99 stays within the target."""
    secs = timeline[:-1] if len(timeline) > 1 else timeline  # the last one holds the drain
    k = stays_from([s["p99_us"] for s in secs], p99_target)
    return None if k is None else float(secs[k]["t"])


def one(mode, run):
    base = os.path.join(out, f"{topo}.{wl}.{mode}.{run}")
    if not os.path.exists(base + ".json"):
        return None
    r = json.load(open(base + ".json"))
    secs = r["settings"]["duration"] or 0
    settle = r["settings"].get("settle") or 0
    eps = (r.get("server_load") or {}).get("epochs", [])
    events = (r.get("server_load") or {}).get("events", [])
    st = r.get("settled") or {}
    row = {
        "onset": spread([e for e in eps if e["t_end"] > 0.5 and e["t_end"] <= ONSET_END])[0],
        "settled": spread([e for e in eps if e["t_end"] - e["secs"] >= settle - 0.05])[0],
        "hottest": spread([e for e in eps if e["t_end"] - e["secs"] >= settle - 0.05])[1],
        "settle_s": settle_time(eps, secs),
        "recovered_s": recovered(r["timeline"]),
        "offered": r["totals"].get("target_rate") or 0,
        "ops": st.get("ops_per_sec", 0.0),
        "p99": (st.get("latency") or {}).get("p99_us", 0.0),
        "p99_all": r["latency"].get("all", {}).get("p99_us", 0.0),
        # the median second's p99 after the settle period: robust to a stall of the machine
        "p99_sec": statistics.median([s["p99_us"] for s in r["timeline"][:-1] if s["t"] >= settle] or [0.0]),
        "moves_run": sum(1 for e in events if e["kind"] == "move"),
        "escalations_run": sum(1 for e in events if e["kind"] == "escalate"),
        "why": sorted({e["why"] for e in events if e["kind"] == "escalate"}),
        "max_at_target": None,
        "moves_total": None,
        "reaction_s": reaction(eps),
        "replicated": None,
        "copies": None,
        "replica_kib": None,
        "replica_reads": None,
        "state": "",
        "proxy": None,
    }
    if os.path.exists(base + ".proxystats.json"):
        ps = json.load(open(base + ".proxystats.json"))
        tot = r["totals"]
        reads = (r["latency"].get("read") or {}).get("count", 0)
        row["proxy"] = {
            "replica_reads": int(ps.get("proxy_replica_reads", 0)),
            "replica_fallbacks": int(ps.get("proxy_replica_fallbacks", 0)),
            "replica_share": int(ps.get("proxy_replica_reads", 0)) / reads if reads else 0.0,
            "upstream_errors": int(ps.get("proxy_upstream_errors", 0)),
            "upstream_timeouts": int(ps.get("proxy_upstream_timeouts", 0)),
            "redirects": int(ps.get("proxy_redirects", 0)),
            "client_errors": tot.get("errors", 0),
            "unfinished": tot.get("unfinished", 0),
            "misses": tot.get("misses", 0),
            "p99_read": (st.get("latency_read") or {}).get("p99_us"),
            "p99_update": (st.get("latency_update") or {}).get("p99_us"),
        }
    if os.path.exists(base + ".sweep.json"):
        sw = json.load(open(base + ".sweep.json")).get("sweep") or {}
        row["max_at_target"] = sw.get("max_ops_per_sec_at_target") or 0.0
        row["p99_target"] = sw.get("p99_target_us")
    if os.path.exists(base + ".stats.json"):
        stats = json.load(open(base + ".stats.json"))
        row["moves_total"] = sum(int(s.get("moves", 0)) for s in stats)
        row["escalations_total"] = sum(int(s.get("escalations", 0)) for s in stats)
        row["state"] = "/".join(sorted({s.get("state", "?") for s in stats}))
        if any("hk_replicated" in s for s in stats):
            row["replicated"] = sum(int(s.get("hk_replicated", 0)) for s in stats)
            row["copies"] = sum(int(s.get("hk_copies_made", 0)) for s in stats)
            row["replica_kib"] = sum(int(s.get("replica_bytes", 0)) for s in stats) / 1024
            row["replica_reads"] = sum(int(s.get("replica_reads", 0)) for s in stats)
    return row


def med(rows, key):
    v = [x[key] for x in rows if x.get(key) is not None]
    return statistics.median(v) if v else None


def f(v, fmt="{:.2f}"):
    return "-" if v is None else fmt.format(v)


results = {m: [x for x in (one(m, i) for i in range(1, runs + 1)) if x] for m in modes}
print(f"### {topo}, {wl}: {KNOB} {' vs '.join(modes)}, {runs} run(s) each; medians")
print()
for m in modes:
    for i, x in enumerate(results[m], 1):
        print(
            f"<!-- {m} run {i}: onset {f(x['onset'])} settled {f(x['settled'])} settle_s {f(x['settle_s'], '{:.1f}')} "
            f"p99_ok_from {f(x['recovered_s'], '{:.0f}')} ops {x['ops']:.0f} p99 {x['p99']:.0f} p99_all {x['p99_all']:.0f} max_at_target {f(x['max_at_target'], '{:.0f}')} "
            f"moves {x['moves_run']}/{f(x['moves_total'], '{:.0f}')} escalations {x['escalations_run']} {x['why']} state {x['state']} "
            f"reaction_s {f(x['reaction_s'], '{:.1f}')} replicated {x['replicated']} copies {x['copies']} replica_kib {f(x['replica_kib'], '{:.0f}')} replica_reads {x['replica_reads']} -->"
        )
print()
print(
    f"| {KNOB} | max/avg at onset (0–3.5 s) | max/avg settled | hottest worker req/s settled | settle time s "
    "(runs) | p99 within target from s (runs) | ops/s settled (offered) | p99 µs settled | median second's p99 µs settled | p99 µs whole run | max ops/s at p99 target "
    "| moves in the run (all, with the sweep) | Phase 3 wanted |"
)
print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
for m in modes:
    rs = results[m]
    if not rs:
        continue
    settles = ", ".join(f(x["settle_s"], "{:.1f}") if x["settle_s"] is not None else "never" for x in rs)
    recovers = ", ".join(f(x["recovered_s"], "{:.0f}") if x["recovered_s"] is not None else "never" for x in rs)
    why = sorted({w for x in rs for w in x["why"]})
    print(
        f"| {m} | {f(med(rs, 'onset'))} | {f(med(rs, 'settled'))} | {f(med(rs, 'hottest'), '{:,.0f}')} | "
        f"{f(med(rs, 'settle_s'), '{:.1f}') if all(x['settle_s'] is not None for x in rs) else 'never'} ({settles}) | "
        f"{f(med(rs, 'recovered_s'), '{:.0f}') if all(x['recovered_s'] is not None for x in rs) else 'never'} ({recovers}) | "
        f"{f(med(rs, 'ops'), '{:,.0f}')} ({f(med(rs, 'offered'), '{:,.0f}')}) | {f(med(rs, 'p99'), '{:,.0f}')} | {f(med(rs, 'p99_sec'), '{:,.0f}')} | "
        f"{f(med(rs, 'p99_all'), '{:,.0f}')} | {f(med(rs, 'max_at_target'), '{:,.0f}')} | "
        f"{f(med(rs, 'moves_run'), '{:.0f}')} ({f(med(rs, 'moves_total'), '{:.0f}')}) | "
        f"{f(med(rs, 'escalations_run'), '{:.0f}')}{' ' + ','.join(why) if why else ''} |"
    )
if KNOB == "hot-keys" or any(x["replicated"] is not None for m in modes for x in results[m]):
    print()
    print("| hot-keys | keys replicated at the end | copies made (with the sweep) | copy memory KiB | reads served by copies | reaction to the shift, s (runs) |")
    print("|---|---|---|---|---|---|")
    for m in modes:
        rs = results[m]
        if not rs:
            continue
        reacts = ", ".join(f(x["reaction_s"], "{:.1f}") if x["reaction_s"] is not None else "never" for x in rs)
        print(
            f"| {m} | {f(med(rs, 'replicated'), '{:.0f}')} | {f(med(rs, 'copies'), '{:.0f}')} | {f(med(rs, 'replica_kib'), '{:,.0f}')} | "
            f"{f(med(rs, 'replica_reads'), '{:,.0f}')} | {f(med(rs, 'reaction_s'), '{:.1f}') if SHIFT_AT is not None else '-'} ({reacts if SHIFT_AT is not None else ''}) |"
        )
if any(x["proxy"] for m in modes for x in results[m]):
    print()
    print(
        f"| {KNOB} | reads served by copies via the proxy (share of reads) | proxy: replica fallbacks | redirects followed "
        "| upstream errors / timeouts | client errors / unfinished / misses | p99 µs settled, read / update |"
    )
    print("|---|---|---|---|---|---|---|")
    for m in modes:
        rs = [x for x in results[m] if x["proxy"]]
        if not rs:
            continue

        def pm(key, fmt="{:,.0f}"):
            v = [x["proxy"][key] for x in rs if x["proxy"].get(key) is not None]
            return f(statistics.median(v) if v else None, fmt)

        print(
            f"| {m} | {pm('replica_reads')} ({pm('replica_share', '{:.1%}')}) | {pm('replica_fallbacks')} | {pm('redirects')} | "
            f"{pm('upstream_errors')} / {pm('upstream_timeouts')} | {pm('client_errors')} / {pm('unfinished')} / {pm('misses')} | "
            f"{pm('p99_read')} / {pm('p99_update')} |"
        )
if "off" in results and "on" in results and results["off"] and results["on"]:
    def ratio(key):
        a, b = med(results["on"], key), med(results["off"], key)
        return f"{a / b:.2f}" if a is not None and b else "-"

    print()
    print(
        f"on / off (medians): max ops/s at the p99 target {ratio('max_at_target')}, p99 at the fixed rate "
        f"{ratio('p99')} (median second's: {ratio('p99_sec')}), ops/s at the fixed rate {ratio('ops')}, settled max/avg {ratio('settled')}"
    )
