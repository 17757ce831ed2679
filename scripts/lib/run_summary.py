#!/usr/bin/env python3
"""The main job's balancer summary (scripts/run.sh): from the bench's JSON (the servers' epochs
from `mbal load`, with the balancer's moves) and the cluster file (for `stats balancer`).

usage: run_summary.py RUN.json CLUSTER.toml
"""
import json
import re
import socket
import sys

r = json.load(open(sys.argv[1]))
load = r.get("server_load") or {}
epochs, events = load.get("epochs", []), load.get("events", [])
phases, t0 = [], 0.0
for p in r["phases"]:
    phases.append((p["workload"], t0, t0 + p["secs"]))
    t0 += p["secs"]


def spread(eps):
    """Per-worker mean req/s over the epochs: cluster-wide max/avg, and the worst server's own."""
    per = {}
    for e in eps:
        for w in e["workers"]:
            per.setdefault((w["server"], w["worker"]), []).append(w["ops_per_sec"])
    means = {k: sum(v) / len(v) for k, v in per.items()}
    if not means:
        return "-"
    avg = sum(means.values()) / len(means)
    by_server = {}
    for (s, _), m in means.items():
        by_server.setdefault(s, []).append(m)
    local = max(max(v) / (sum(v) / len(v)) for v in by_server.values() if sum(v) > 0)
    hot = max(means, key=means.get)
    return f"max/avg {max(means.values()) / avg:.2f} (hottest s{hot[0]}/w{hot[1]} {means[hot]:.0f} req/s; within a server at most {local:.2f})"


print("\nper-worker load (the servers' epochs), per phase:")
for name, a, b in phases:
    inside = [e for e in epochs if e["t_end"] - e["secs"] >= a - 0.05 and e["t_end"] <= b + 0.05]
    moves = [e for e in events if e["kind"] == "move" and a <= e["t"] < b]
    print(f"  {name:8} {a:4.0f}-{b:3.0f} s: {spread(inside)}; balancer moves {len(moves)}")
    if name == "hotpart":
        third = (b - a) / 3
        first = [e for e in inside if e["t_end"] <= a + third + 0.05]
        last = [e for e in inside if e["t_end"] - e["secs"] >= b - third - 0.05]
        print(f"    first {third:.0f} s: {spread(first)}")
        print(f"    last  {third:.0f} s: {spread(last)}")
for e in events:
    if e["kind"] == "move":
        print(f"  t={e['t']:5.1f} s  server {e['server']}: cachelet {e['cachelet']} w{e['from_worker']} -> w{e['to_worker']} ({e['why']})")
    elif e["kind"] == "escalate":
        print(f"  t={e['t']:5.1f} s  server {e['server']}: Phase 3 wanted ({e['why']})")

print("\nstats balancer:")
keys = ["state", "plans", "moves", "moves_home", "moves_failed", "escalations", "leases", "planner_us_max"]
for i, addr in enumerate(re.findall(r'addr\s*=\s*"([^"]+)"', open(sys.argv[2]).read())):
    host, port = addr.rsplit(":", 1)
    s = socket.create_connection((host, int(port)), timeout=5)
    s.sendall(b"stats balancer\r\n")
    buf = b""
    while not buf.endswith(b"END\r\n"):
        chunk = s.recv(65536)
        if not chunk:
            break
        buf += chunk
    s.close()
    st = {l.split()[1]: l.split()[2] for l in buf.decode().splitlines() if l.startswith("STAT ")}
    print(f"  server {i}: " + ", ".join(f"{k} {st.get(k, '-')}" for k in keys))
