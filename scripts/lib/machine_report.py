#!/usr/bin/env python3
"""Line up each second of the bench runs in OUT with what the machine did in it
(scripts/lib/machine_monitor.py's OUT/machine.jsonl), and say which bad seconds had the machine
busy with something else.

    machine_report.py OUT [P99_BAD_US (default 10000)] [--all]

For every run's JSON in OUT (the fixed-rate run and the sweep), each second of its timeline is
matched to the monitor's records inside it (the bench's `run_started_unix_ms`, and each sweep
step's `from_s`): the CPU used (of the machine's total), the CPU pressure (ms in the second that
some runnable task waited for a CPU), the run's own threads' run-queue wait, and the CPU used by
every process outside the run ("others", % of one core, with the top ones named). A second is
"bad" when its p99 is above P99_BAD_US; it is "machine-busy" when others used more than
OTHERS_BUSY (default 20% of one core, env) in it. Prints the bad seconds and a summary.
"""
import datetime
import glob
import json
import os
import re
import statistics
import sys

HZ = os.sysconf("SC_CLK_TCK")
NCPU = os.cpu_count() or 1
OTHERS_BUSY = float(os.environ.get("OTHERS_BUSY", "20"))


def load_monitor(path):
    recs = []
    for line in open(path):
        try:
            recs.append(json.loads(line))
        except ValueError:
            pass
    return recs


ANSI = re.compile(r"\x1b\[[0-9;]*m")


def server_events(log_path):
    """(unix time, kind) of the servers' debug lines (`RUST_LOG=mbal_server::control=debug`) in
    a `cluster up` log: "copies" (copies made or dropped), "alarm" (an alarm that replicated),
    "epoch" (an epoch's line)."""
    out = []
    try:
        lines = open(log_path, errors="replace")
    except OSError:
        return out
    for line in lines:
        line = ANSI.sub("", line)
        if " DEBUG " not in line:
            continue
        ts = line.split(" ", 1)[0]
        try:
            t = datetime.datetime.strptime(ts[:26], "%Y-%m-%dT%H:%M:%S.%f").replace(tzinfo=datetime.timezone.utc).timestamp()
        except ValueError:
            continue
        if "hot copies" in line:
            out.append((t, "copies"))
        elif "hot alarm" in line and "replicate=[]" not in line:
            out.append((t, "alarm"))
    return out


def seconds_of(report):
    """(unix start, unix end, phase, second stats) for each second of the report's timeline."""
    base = report.get("run_started_unix_ms", 0) / 1000.0
    if not base:
        # an older bench: the run began after the load phase (to within the wait for the
        # servers' load history, about an epoch)
        base = report.get("started_unix_ms", 0) / 1000.0 + ((report.get("load") or {}).get("elapsed_s") or 0.0)
    sweep = report.get("sweep") or {}
    steps = sweep.get("steps") or []
    out = []
    if steps:
        by_rate = {}
        for s in report["timeline"]:
            by_rate.setdefault(s["phase"].rsplit("@", 1)[-1], []).append(s)
        for st in steps:
            secs = by_rate.get(f"{st['offered_ops_per_sec']:.0f}", [])
            if not secs:
                continue
            t0 = secs[0]["t"]
            for s in secs:
                # the step's seconds count from its own start (its first second is t0)
                start = base + st.get("from_s", float(t0)) + (s["t"] - t0)
                out.append((start, start + 1.0, s["phase"], s))
    else:
        for s in report["timeline"]:
            start = base + s["t"]
            out.append((start, start + 1.0, s["phase"], s))
    return out


def machine_in(recs, a, b):
    """What the monitor saw in [a, b) (records end at their time stamp)."""
    inside = [r for r in recs if a < r["t"] <= b]
    if not inside:
        return None
    cpu = [sum(col) for col in zip(*(r["cpu"] for r in inside))]
    total = sum(cpu) or 1
    busy = 1.0 - (cpu[3] + cpu[4]) / total
    psi_ms = sum(r["psi_cpu"] for r in inside) / 1000.0
    others = {}
    wait = 0.0
    mine = 0
    by = {}
    proc_recs = [r for r in inside if "others" in r]
    for r in proc_recs:
        for k, v in r["others"].items():
            others[k] = others.get(k, 0) + v
        wait += r.get("mine_wait_ms", 0.0)
        mine += r.get("mine", 0)
        for k, v in r.get("mine_by", {}).items():
            by[k] = by.get(k, 0) + v
    span = len(inside) * (inside[-1]["t"] - inside[0]["t"]) / max(len(inside) - 1, 1) if len(inside) > 1 else 0.1
    span = max(span, 0.1)
    # procs records cover about every 5th record's interval x5; scale to % of one core per second
    proc_span = span if proc_recs else 1.0
    others_pct = 100.0 * sum(others.values()) / HZ / proc_span
    top = sorted(others.items(), key=lambda kv: -kv[1])[:3]
    return {
        "busy": 100.0 * busy,
        "softirq": 100.0 * cpu[6] / total,
        "steal": 100.0 * cpu[7] / total,
        "psi_ms": psi_ms / span,
        "others_pct": others_pct,
        "mine_pct": 100.0 * mine / HZ / proc_span,
        "bench_pct": 100.0 * by.get("bench", 0) / HZ / proc_span,
        "server_pct": 100.0 * by.get("server", 0) / HZ / proc_span,
        "wait_ms": wait / proc_span,
        "top": ", ".join(f"{k} {100.0 * v / HZ / proc_span:.0f}%" for k, v in top),
    }


def main():
    out = sys.argv[1]
    bad_us = float(sys.argv[2]) if len(sys.argv) > 2 and not sys.argv[2].startswith("-") else 10000.0
    show_all = "--all" in sys.argv
    recs = load_monitor(os.path.join(out, "machine.jsonl"))
    if not recs:
        print("no machine.jsonl records")
        return
    rows = []
    for path in sorted(glob.glob(os.path.join(out, "*.json"))):
        if path.endswith(".stats.json"):
            continue
        try:
            rep = json.load(open(path))
        except (ValueError, OSError):
            continue
        if "timeline" not in rep:
            continue
        name = os.path.basename(path)[: -len(".json")]
        events = server_events(os.path.join(out, name.replace(".sweep", "") + ".cluster.log"))
        for a, b, phase, s in seconds_of(rep):
            m = machine_in(recs, a, b)
            if m is None or s.get("ops", 0) == 0:
                continue
            m["copies"] = sum(1 for t, k in events if a <= t < b and k == "copies")
            m["alarms"] = sum(1 for t, k in events if a <= t < b and k == "alarm")
            rows.append((name, phase, s, m))
    if not rows:
        print("no seconds line up (binary without run_started_unix_ms?)")
        return
    print(f"{'run':<24} {'phase':<10} {'ops':>6} {'late':>6} {'p99 ms':>8} {'busy%':>6} {'sirq%':>6} "
          f"{'psi ms':>7} {'wait ms':>8} {'bench%':>7} {'srv%':>5} {'copies':>6} {'alarms':>6} {'others%':>8}  top others")
    for name, phase, s, m in rows:
        if show_all or s["p99_us"] > bad_us:
            print(f"{name:<24} {phase:<10} {s['ops']:>6} {s.get('late_ops', 0):>6} {s['p99_us'] / 1000:>8.1f} "
                  f"{m['busy']:>6.0f} {m['softirq']:>6.0f} {m['psi_ms']:>7.0f} {m['wait_ms']:>8.0f} "
                  f"{m['bench_pct']:>7.0f} {m['server_pct']:>5.0f} {m['copies']:>6} {m['alarms']:>6} {m['others_pct']:>8.1f}  {m['top']}")
    # by mode (the runs' names carry it: 8x2.zipf.on.1, ...), then all together
    modes = sorted({r[0].split(".")[2] for r in rows if r[0].count(".") >= 3})
    for mode in modes + [None]:
        summary(rows if mode is None else [r for r in rows if r[0].split(".")[2] == mode], bad_us, mode or "all")


def summary(rows, bad_us, label):
    bad = [r for r in rows if r[2]["p99_us"] > bad_us]
    good = [r for r in rows if r[2]["p99_us"] <= bad_us]

    def med(rs, key):
        return statistics.median([r[3][key] for r in rs]) if rs else float("nan")

    print()
    print(f"{label}: seconds: {len(rows)}; bad (p99 > {bad_us / 1000:.0f} ms): {len(bad)}; "
          f"of those with others > {OTHERS_BUSY:.0f}% of a core: "
          f"{sum(1 for r in bad if r[3]['others_pct'] > OTHERS_BUSY)}; "
          f"good seconds with others > {OTHERS_BUSY:.0f}%: {sum(1 for r in good if r[3]['others_pct'] > OTHERS_BUSY)}")
    for label, rs in (("bad", bad), ("good", good)):
        print(f"  {label:<5} median: busy {med(rs, 'busy'):.0f}%, psi {med(rs, 'psi_ms'):.0f} ms/s, "
              f"run-queue wait {med(rs, 'wait_ms'):.0f} ms/s, others {med(rs, 'others_pct'):.1f}% of a core, "
              f"run's own {med(rs, 'mine_pct'):.0f}% of a core (bench {med(rs, 'bench_pct'):.0f}%, "
              f"servers {med(rs, 'server_pct'):.0f}%); server copy events per second "
              f"{statistics.mean([r[3]['copies'] for r in rs]) if rs else float('nan'):.1f} (mean)")


if __name__ == "__main__":
    main()
