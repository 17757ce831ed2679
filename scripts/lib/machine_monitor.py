#!/usr/bin/env python3
"""Record what the machine does while a benchmark runs, timestamped, so that a bad second of
the benchmark can be told apart from a busy machine (docs/benchmarks-journal.md §15, round 6).

    machine_monitor.py OUT.jsonl [--interval 0.1] [--procs-every 5] [--mine PID,...]

Every interval (default 100 ms) one JSON line:
  {"t": unix seconds, "cpu": [user, nice, system, idle, iowait, irq, softirq, steal] (jiffies
   since the last line, all CPUs), "psi_cpu": µs of CPU pressure ("some") since the last line,
   "psi_io": the same for I/O, "run": runnable tasks now (/proc/stat procs_running)}
and every `procs_every` lines also "others": {"pid comm": CPU jiffies since the last such
line} for every process that used CPU and is neither this monitor, nor a process whose comm
is "mbal", nor a descendant of a --mine pid; "mine": the same total for those, "mine_by" the
same by `mbal` subcommand ("bench", "server", ...; "other" for the run's scripts), and
"mine_wait_ms" / "wait_by_ms": the run-queue wait (schedstat) of all the `mbal` processes'
threads since the last such line, in total and by subcommand.

Stops on SIGINT/SIGTERM, or when every --mine pid is gone. Costs about 1% of one core at the
defaults.
"""
import json
import os
import signal
import sys
import time

HZ = os.sysconf("SC_CLK_TCK")


def read(path):
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError:
        return b""


def cpu_line():
    b = read("/proc/stat")
    first, rest = b.split(b"\n", 1)
    vals = [int(x) for x in first.split()[1:9]]
    run = 0
    for line in rest.split(b"\n"):
        if line.startswith(b"procs_running"):
            run = int(line.split()[1])
            break
    return vals, run


def psi_total(kind):
    b = read(f"/proc/pressure/{kind}")
    for line in b.split(b"\n"):
        if line.startswith(b"some"):
            return int(line.rsplit(b"total=", 1)[1])
    return 0


def processes():
    """pid -> (ppid, comm, utime+stime jiffies)."""
    out = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        b = read(f"/proc/{d}/stat")
        if not b:
            continue
        r = b.rfind(b")")
        comm = b[b.find(b"(") + 1 : r].decode(errors="replace")
        f = b[r + 2 :].split()
        out[int(d)] = (int(f[1]), comm, int(f[11]) + int(f[12]))
    return out


ROLES = {}


def role(pid):
    """`mbal`'s subcommand (bench, server, cluster, ...) of a pid, cached."""
    if pid not in ROLES:
        parts = read(f"/proc/{pid}/cmdline").split(b"\0")
        ROLES[pid] = parts[1].decode(errors="replace") if len(parts) > 1 and parts[0].endswith(b"mbal") else "other"
    return ROLES[pid]


def wait_ns(pid):
    total = 0
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return 0
    for t in tids:
        b = read(f"/proc/{pid}/task/{t}/schedstat")
        if b:
            total += int(b.split()[1])
    return total


def main():
    out = sys.argv[1]
    interval = 0.1
    every = 5
    mine_roots = set()
    args = sys.argv[2:]
    while args:
        a = args.pop(0)
        if a == "--interval":
            interval = float(args.pop(0))
        elif a == "--procs-every":
            every = int(args.pop(0))
        elif a == "--mine":
            mine_roots = {int(p) for p in args.pop(0).split(",") if p}
    stop = []
    signal.signal(signal.SIGINT, lambda *_: stop.append(1))
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    me = os.getpid()
    prev_cpu, _ = cpu_line()
    prev_psi = (psi_total("cpu"), psi_total("io"))
    prev_procs = processes()
    prev_wait = {}
    n = 0
    nxt = time.monotonic()
    with open(out, "w") as f:
        while not stop:
            # the run that started it is gone (killed without its EXIT trap): stop too
            if mine_roots and not any(os.path.exists(f"/proc/{p}") for p in mine_roots):
                break
            nxt += interval
            d = nxt - time.monotonic()
            if d > 0:
                time.sleep(d)
            cpu, run = cpu_line()
            psi = (psi_total("cpu"), psi_total("io"))
            rec = {
                "t": round(time.time(), 3),
                "cpu": [a - b for a, b in zip(cpu, prev_cpu)],
                "psi_cpu": psi[0] - prev_psi[0],
                "psi_io": psi[1] - prev_psi[1],
                "run": run,
            }
            prev_cpu, prev_psi = cpu, psi
            n += 1
            if n % every == 0:
                procs = processes()
                mine = set()
                for pid, (ppid, comm, _) in procs.items():
                    if comm == "mbal" or pid in mine_roots or pid == me:
                        mine.add(pid)
                changed = True
                while changed:
                    changed = False
                    for pid, (ppid, _, _) in procs.items():
                        if pid not in mine and ppid in mine:
                            mine.add(pid)
                            changed = True
                others = {}
                mine_j = 0
                by_role = {}
                for pid, (ppid, comm, j) in procs.items():
                    dj = j - prev_procs.get(pid, (0, "", j if pid in prev_procs else 0))[2]
                    if dj <= 0:
                        continue
                    if pid in mine and pid != me:
                        mine_j += dj
                        r = role(pid) if comm == "mbal" else "other"
                        by_role[r] = by_role.get(r, 0) + dj
                    elif pid != me:
                        others[f"{pid} {comm}"] = dj
                waits = {pid: wait_ns(pid) for pid in mine if procs[pid][1] == "mbal"}
                wait_by = {}
                for pid, w in waits.items():
                    r = role(pid)
                    wait_by[r] = wait_by.get(r, 0.0) + (w - prev_wait.get(pid, w)) / 1e6
                rec["others"] = others
                rec["mine"] = mine_j
                rec["mine_by"] = by_role
                rec["mine_wait_ms"] = round(sum(wait_by.values()), 1)
                rec["wait_by_ms"] = {k: round(v, 1) for k, v in wait_by.items()}
                prev_wait = waits
                prev_procs = procs
            f.write(json.dumps(rec, separators=(",", ":")) + "\n")
            f.flush()


if __name__ == "__main__":
    main()
