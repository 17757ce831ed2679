#!/usr/bin/env python3
"""Cross-server migration under load (docs/benchmarks.md, "Cross-server migration"; issue 34).

Per case (a cachelet of 64 MB or 1 GB of small or 100 KB values), on a fresh local cluster
(`mbal cluster up --coordinator`, 2 servers x 2 workers, every worker capped at --cap req/s):

1. the routed load's keys are loaded (`mbal bench --load-only`); one cachelet C of server 0's
   worker W is filled with the case's items (keys found with scripts/migbench-keys, the map's
   route: xxh3 of the key, VN = (hash >> 32) % vn_count, `layout.vn_to_cachelet`), sent
   pipelined on a connection opted in to W (`mbal hello 0 W`), every STORED counted; `stats
   cachelets` gives C's items and bytes;
2. --runs times: a steady run (`mbal bench --routed`, open loop at --load x --cap on the other
   cachelets of W, --secs seconds, no move); a move run (the same load; at --move-at s
   `mbal cluster move C 1:0`); then C goes back to 0:W (`mbal cluster move C 0:W`, no load).

Per move: items, frame bytes and ms from the MIGRATED answer; the rate over C's item bytes
(`stats cachelets` before the move) and over the frame bytes; wire bytes per item byte; the
load's p99 in the seconds the move overlaps (max of the per-second p99s) against the steady
run's median per-second p99, and the runs' whole p99s. Medians over the runs; JSON per run
and a summary in --out. Bounded: every wait has a deadline; only the processes this script
starts are stopped, by pid.

    cargo build --release --bin mbal
    flock /tmp/bench.lock python3 scripts/bench-migrate.py --runs 3
"""

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MIB = 1 << 20

# name: (value bytes, total value bytes)
CASES = {
    "small-64M": (100, 64 * MIB),
    "big-64M": (100 * 1024, 64 * MIB),
    "big-1G": (100 * 1024, 1024 * MIB),
    "small-1G": (100, 1024 * MIB),
    "tiny": (1000, 1 * MIB),  # a check of the script itself
}


def log(*a):
    print(time.strftime("%H:%M:%S"), *a, flush=True)


class Cluster:
    """`mbal cluster up` as a child; stopped with SIGINT (its Ctrl-C), then by pid."""

    def __init__(self, mbal, out, cap, mem, extra):
        self.file = os.path.join(out, "cluster.toml")
        cmd = [mbal, "cluster", "up", "--coordinator", "--servers", "2", "--workers", "2",
               "-m", str(mem), "--worker-capacity", str(cap), "--file", self.file] + extra
        self.log = open(os.path.join(out, "cluster.log"), "w")
        self.p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=self.log, text=True)
        self.pids, self.servers, self.coordinator = [], [], None
        deadline = time.time() + 60
        for line in self.p.stdout:
            self.log.write(line)
            w = line.split()
            if line.strip().startswith("server ") and "(pid" in line:
                self.servers.append(w[2].rstrip(","))
                self.pids.append(int(w[4].rstrip("),")))
            if line.strip().startswith("coordinator:"):
                self.coordinator = w[1]
                self.pids.append(int(w[3].rstrip("),")))
            if "Ctrl-C stops" in line or time.time() > deadline:
                break
        self.log.flush()
        if len(self.servers) != 2 or not self.coordinator:
            self.stop()
            raise SystemExit("mbal cluster up did not start (see %s)" % self.log.name)
        # Drain its stdout so that it never blocks on a full pipe.
        threading.Thread(target=lambda: [self.log.write(l) for l in self.p.stdout], daemon=True).start()

    def stop(self):
        if self.p.poll() is None:
            self.p.send_signal(signal.SIGINT)
            try:
                self.p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.p.kill()
                self.p.wait(timeout=5)
        for pid in self.pids:  # what it started, should it have left any
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


class Conn:
    def __init__(self, addr, timeout=30):
        h, p = addr.rsplit(":", 1)
        self.s = socket.create_connection((h, int(p)), timeout=timeout)
        self.buf = b""

    def line(self):
        while b"\r\n" not in self.buf:
            d = self.s.recv(1 << 16)
            if not d:
                raise IOError("connection closed")
            self.buf += d
        l, self.buf = self.buf.split(b"\r\n", 1)
        return l.decode()

    def exact(self, n):
        while len(self.buf) < n:
            d = self.s.recv(1 << 20)
            if not d:
                raise IOError("connection closed")
            self.buf += d
        b, self.buf = self.buf[:n], self.buf[n:]
        return b

    def call(self, req):
        self.s.sendall(req.encode() + b"\r\n")
        return self.line()

    def stats(self, what=""):
        self.s.sendall(("stats %s\r\n" % what).encode())
        out = {}
        while True:
            l = self.line()
            if l == "END":
                return out
            if not l.startswith("STAT "):
                raise IOError("stats: " + l)
            _, k, v = l.split(" ", 2)
            out[k] = v

    def map(self):
        head = self.call("mbal map").split()
        if head[0] != "MAP":
            raise IOError("mbal map: %s" % head)
        m = json.loads(self.exact(int(head[2]) + 2)[:-2])
        return m

    def close(self):
        self.s.close()


def cachelet_stats(addr, c):
    k = Conn(addr)
    s = k.stats("cachelets")
    k.close()
    return int(s["cachelet:%d:items" % c]), int(s["cachelet:%d:bytes" % c])


def fill(addr, worker, prefix, indices, value_size, timeout):
    """SET every key on a connection opted in to `worker`; every answer must be STORED."""
    k = Conn(addr, timeout=timeout)
    hello = k.call("mbal hello 0 %d" % worker)
    if not hello.startswith("MBAL"):
        raise SystemExit("mbal hello: " + hello)
    value = (b"v" * value_size)
    n = len(indices)
    result = {}

    def reader():
        got, stored, tail = 0, 0, b""
        try:
            while got < n:
                d = k.s.recv(1 << 20)
                if not d:
                    break
                d = tail + d
                cut = d.rfind(b"\r\n") + 2
                done, tail = d[:cut], d[cut:]
                got += done.count(b"\r\n")
                ok = done.count(b"STORED\r\n")
                stored += ok
                if ok < done.count(b"\r\n") and "other" not in result:
                    result["other"] = [l for l in done.split(b"\r\n") if l and l != b"STORED"][0].decode(errors="replace")
        except OSError as e:
            result["error"] = str(e)
        result["got"], result["stored"] = got, stored

    t = threading.Thread(target=reader)
    t.start()
    t0 = time.time()
    head = b"set %s%%d 0 0 %d\r\n" % (prefix.encode(), value_size)
    chunk = max(1, (4 * MIB) // (value_size + 40))
    for i in range(0, n, chunk):
        part = b"".join(head % j + value + b"\r\n" for j in indices[i:i + chunk])
        k.s.sendall(part)
        if time.time() - t0 > timeout:
            break
    t.join(timeout=max(1.0, timeout - (time.time() - t0)))
    secs = time.time() - t0
    k.close()
    if result.get("stored") != n:
        raise SystemExit("fill: %s of %d stored (%s; first other answer: %s)"
                         % (result.get("stored"), n, result.get("error", ""), result.get("other")))
    return secs


def p99_second_window(report, t0_ms, t1_ms):
    """Max per-second p99 (µs) over the seconds of the run that [t0_ms, t1_ms] overlaps."""
    start = report["run_started_unix_ms"]
    a, b = int((t0_ms - start) // 1000), int((t1_ms - start) // 1000)
    secs = [s for s in report["timeline"] if a <= s["t"] <= b]
    return max((s["p99_us"] for s in secs), default=None), [s["t"] for s in secs]


def steady_second_p99(report):
    """Median per-second p99 (µs), leaving out the first and the last second."""
    tl = report["timeline"]
    inner = [s["p99_us"] for s in tl[1:-1] if s["ops"] > 0] or [s["p99_us"] for s in tl]
    return statistics.median(inner)


def whole_p99(report):
    lat = report["latency"]
    return max(v["p99_us"] for v in lat.values()) if lat else None


def bench_cmd(a, mbal, server, hot, secs, out_json, plot=None):
    cmd = [mbal, "bench", "--routed", "--server", server, "--workload", "hotpart", "--hot-ops", "1",
           "--hot-cachelet-ids", ",".join(map(str, hot)), "--keys", str(a.keys),
           "--rate", str(int(a.cap * a.load)), "--duration", str(secs), "--server-load", "off",
           "--json", out_json, "--quiet"]
    if plot:
        cmd += ["--plot", plot]
    return cmd


def move(mbal, cluster, c, to, timeout):
    t0 = time.time()
    for attempt in range(50):
        r = subprocess.run([mbal, "cluster", "move", str(c), to, "--coordinator", cluster.coordinator,
                            "--cluster", cluster.file], capture_output=True, text=True, timeout=timeout)
        # Right after a move, its destination may not have installed the new map yet (it does at
        # its next heartbeat) and refuses to move the cachelet on: ask again.
        if "is not on this server" not in r.stderr + r.stdout:
            break
        time.sleep(0.1)
    t1 = time.time()
    # cachelet C moved from server S to S:W: N items, B bytes, T ms
    w = r.stdout.replace(",", "").replace(":", " ").split()
    if r.returncode != 0 or "moved" not in w:
        raise SystemExit("mbal cluster move %d %s: %s %s" % (c, to, r.stdout, r.stderr))
    i = w.index("items")
    return {"attempts": attempt + 1, "items": int(w[i - 1]), "frame_bytes": int(w[i + 1]), "ms": int(w[i + 3]),
            "wall_ms": round((t1 - t0) * 1000, 1), "t0_ms": t0 * 1000, "t1_ms": t1 * 1000,
            "line": r.stdout.strip()}


def run_case(a, mbal, name, out):
    value_size, total = CASES[name]
    count = total // value_size
    os.makedirs(out, exist_ok=True)
    mem = a.memory or max(1024, 4 * total // MIB)
    cl = Cluster(mbal, out, a.cap, mem, a.server_args)
    runs = []
    try:
        src = cl.servers[0]
        m = Conn(cl.coordinator).map()
        owner = m["layout"]["cachelet_owner"] if "cachelet_owner" in m["layout"] else m["cachelet_owner"]
        mine = [c for c, (s, w) in enumerate(owner) if s == 0 and w == 0]
        c, hot = mine[0], mine[1:]
        log(name, "cluster up:", cl.servers, "coordinator", cl.coordinator, "cachelet", c, "load on", hot)
        # The load's keys first (all of them, every cachelet: a few hundred land in C).
        r = subprocess.run(bench_cmd(a, mbal, src, hot, 1, os.path.join(out, "load.json"))
                           + ["--load-only"], capture_output=True, text=True, timeout=300)
        if r.returncode != 0:
            raise SystemExit("mbal bench --load-only: " + r.stderr)
        table = os.path.join(out, "vn_to_cachelet.txt")
        with open(table, "w") as f:
            f.write("\n".join(map(str, m["layout"]["vn_to_cachelet"])))
        t0 = time.time()
        keys = subprocess.run([a.keys_bin, table, str(c), str(count), "mig:"], capture_output=True,
                              text=True, timeout=600, check=True).stdout.split()
        find_s = time.time() - t0
        fill_s = fill(src, 0, "mig:", [int(x) for x in keys], value_size, timeout=a.fill_timeout)
        del keys
        items, nbytes = cachelet_stats(src, c)
        log(name, "filled: %d keys (found in %.1f s), stored in %.1f s; cachelet %d: %d items, %d bytes"
            % (count, find_s, fill_s, c, items, nbytes))
        for run in range(a.runs):
            rec = {"case": name, "run": run, "cachelet": c, "keys_filled": count, "fill_s": fill_s,
                   "uptime_before": open("/proc/loadavg").read().split()[:3]}
            # Steady state: the same load, no move.
            sj = os.path.join(out, "steady-%d.json" % run)
            subprocess.run(bench_cmd(a, mbal, src, hot, a.secs, sj), check=True, timeout=a.secs + 60)
            steady = json.load(open(sj))
            # The move under the same load.
            items, nbytes = cachelet_stats(src, c)
            mj = os.path.join(out, "move-%d.json" % run)
            plot = os.path.join(out, "move-%d.svg" % run) if a.plot else None
            b = subprocess.Popen(bench_cmd(a, mbal, src, hot, a.secs, mj, plot))
            time.sleep(a.move_at)
            mv = move(mbal, cl, c, "1:0", timeout=a.secs + 120)
            b.wait(timeout=a.secs + 60)
            if b.returncode != 0:
                raise SystemExit("mbal bench (move run) failed")
            moving = json.load(open(mj))
            dst_items, dst_bytes = cachelet_stats(cl.servers[1], c)
            back = move(mbal, cl, c, "0:0", timeout=300)
            win, secs = p99_second_window(moving, mv["t0_ms"], mv["t1_ms"])
            base = steady_second_p99(steady)
            rec.update({
                "item_bytes_before": nbytes, "items_before": items,
                "dest_items": dst_items, "dest_bytes": dst_bytes,
                "move": mv, "move_back": back,
                "move_end_before_run_end": mv["t1_ms"] <= moving["run_started_unix_ms"] + a.secs * 1000,
                "rate_item_MBps": nbytes / mv["ms"] / 1000 if mv["ms"] else None,
                "rate_frame_MBps": mv["frame_bytes"] / mv["ms"] / 1000 if mv["ms"] else None,
                "wire_per_item_byte": mv["frame_bytes"] / nbytes if nbytes else None,
                "p99_move_window_us": win, "move_window_seconds": secs,
                "p99_steady_second_median_us": base,
                "p99_ratio_window": win / base if win and base else None,
                "p99_whole_move_us": whole_p99(moving), "p99_whole_steady_us": whole_p99(steady),
                "ops_move": moving["totals"]["ops_per_sec"], "ops_steady": steady["totals"]["ops_per_sec"],
                "errors_move": moving["totals"]["errors"], "late_move": moving["totals"]["late_ops"],
                "late_steady": steady["totals"]["late_ops"],
                "uptime_after": open("/proc/loadavg").read().split()[:3],
            })
            rec["p99_ratio_whole"] = rec["p99_whole_move_us"] / rec["p99_whole_steady_us"]
            json.dump(rec, open(os.path.join(out, "run-%d.json" % run), "w"), indent=1)
            log(name, "run %d: %d items, %d item bytes, %d frame bytes in %d ms (%.0f MB/s); back in %d ms; "
                "p99 in the move's seconds %s %.0f us vs steady %.0f us (x%.2f); whole run %.0f vs %.0f us"
                % (run, mv["items"], nbytes, mv["frame_bytes"], mv["ms"], rec["rate_item_MBps"] or 0,
                   back["ms"], secs, win or 0, base, rec["p99_ratio_window"] or 0,
                   rec["p99_whole_move_us"], rec["p99_whole_steady_us"]))
            runs.append(rec)
    finally:
        cl.stop()
    return runs


def summary(all_runs):
    med = lambda xs: statistics.median([x for x in xs if x is not None]) if any(x is not None for x in xs) else None
    rows = []
    for name in CASES:
        rs = [r for r in all_runs if r["case"] == name]
        if not rs:
            continue
        rows.append({
            "case": name, "runs": len(rs), "items": med([r["move"]["items"] for r in rs]),
            "item_bytes": med([r["item_bytes_before"] for r in rs]),
            "frame_bytes": med([r["move"]["frame_bytes"] for r in rs]),
            "ms": med([r["move"]["ms"] for r in rs]), "ms_all": [r["move"]["ms"] for r in rs],
            "MBps_item": med([r["rate_item_MBps"] for r in rs]),
            "MBps_item_all": [round(r["rate_item_MBps"]) for r in rs],
            "MBps_frame": med([r["rate_frame_MBps"] for r in rs]),
            "wire_per_byte": med([r["wire_per_item_byte"] for r in rs]),
            "back_ms": med([r["move_back"]["ms"] for r in rs]),
            "p99_win_us": med([r["p99_move_window_us"] for r in rs]),
            "p99_steady_us": med([r["p99_steady_second_median_us"] for r in rs]),
            "ratio_win": med([r["p99_ratio_window"] for r in rs]),
            "ratio_win_all": [round(r["p99_ratio_window"], 2) for r in rs if r["p99_ratio_window"]],
            "ratio_whole": med([r["p99_ratio_whole"] for r in rs]),
            "errors": sum(r["errors_move"] for r in rs),
        })
    print("\n| case | runs | items | item bytes | frame bytes | ms (each) | MB/s item (each) | GB/s | wire/item byte "
          "| back ms (no load) | p99 move s / steady, µs | ratio (each) | whole-run p99 ratio | errors |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print("| %s | %d | %d | %d | %d | %d (%s) | %.0f (%s) | %.2f | %.3f | %d | %.0f / %.0f | %.2f (%s) | %.2f | %d |" % (
            r["case"], r["runs"], r["items"], r["item_bytes"], r["frame_bytes"], r["ms"],
            ", ".join(map(str, r["ms_all"])), r["MBps_item"], ", ".join(map(str, r["MBps_item_all"])),
            r["MBps_item"] / 1000, r["wire_per_byte"], r["back_ms"], r["p99_win_us"], r["p99_steady_us"],
            r["ratio_win"], ", ".join(map(str, r["ratio_win_all"])), r["ratio_whole"], r["errors"]))
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--cases", default="small-64M,big-64M,big-1G", help="of " + ",".join(CASES))
    ap.add_argument("--cap", type=int, default=100000, help="--worker-capacity, req/s per worker")
    ap.add_argument("--load", type=float, default=0.8, help="offered rate as a fraction of --cap")
    ap.add_argument("--keys", type=int, default=50000, help="the load's keys (all cachelets)")
    ap.add_argument("--secs", type=float, default=8, help="each load run")
    ap.add_argument("--move-at", type=float, default=3, help="the move starts this long into the run")
    ap.add_argument("--memory", type=int, default=0, help="-m per server, MB [4x the case, at least 1024]")
    ap.add_argument("--fill-timeout", type=float, default=300)
    ap.add_argument("--server-arg", action="append", default=[], help="passed to mbal cluster up --server-arg=")
    ap.add_argument("--balancer", default="off", help="the servers' Phase 2 balancer (on|off)")
    ap.add_argument("--plot", action="store_true", help="mbal bench --plot of each move run")
    ap.add_argument("--bin", default=os.path.join(ROOT, "target/release/mbal"))
    ap.add_argument("--no-build", action="store_true")
    ap.add_argument("--table", nargs="+", metavar="DIR", help="do not run: the table of the runs under these --out dirs")
    ap.add_argument("--out", default=os.path.join(ROOT, "results", "migrate-" + time.strftime("%Y%m%d-%H%M%S")))
    a = ap.parse_args()
    if a.table:
        import glob
        runs = [json.load(open(f)) for d in a.table for f in sorted(glob.glob(os.path.join(d, "*", "run-*.json")))]
        summary(runs)
        return
    # Phase 2 off: the local balancer would move the loaded cachelets (and C) between server
    # 0's workers during the runs.
    a.server_args = ["--server-arg=" + s for s in ["--balancer", a.balancer] + a.server_arg]
    env = dict(os.environ, CARGO_INCREMENTAL="0")
    kdir = os.path.join(ROOT, "scripts", "migbench-keys")
    if not a.no_build:
        subprocess.run(["cargo", "build", "--release", "--bin", "mbal"], cwd=ROOT, check=True, env=env)
    subprocess.run(["cargo", "build", "--release", "-q"], cwd=kdir, check=True, env=env)
    a.keys_bin = os.path.join(kdir, "target", "release", "migbench-keys")
    os.makedirs(a.out, exist_ok=True)
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    log("bench-migrate: commit", head, "uptime:", open("/proc/loadavg").read().strip(), "out:", a.out)
    all_runs = []
    for name in a.cases.split(","):
        all_runs += run_case(a, a.bin, name, os.path.join(a.out, name))
    rows = summary(all_runs)
    json.dump({"commit": head, "args": {k: v for k, v in vars(a).items()}, "rows": rows, "runs": all_runs},
              open(os.path.join(a.out, "summary.json"), "w"), indent=1)
    log("uptime:", open("/proc/loadavg").read().strip())


if __name__ == "__main__":
    main()
