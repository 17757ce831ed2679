#!/usr/bin/env python3
"""Phase 3 off vs on on a live cluster, and scale-out 4 -> 6 -> 4 (issue 34's figures).

usage: scripts/bench-phase3.py phase3|scale|all [--out DIR] [--runs N] ...   (--help for all)

phase3  Phase 3 (the coordinator's cross-server migrations) off vs on, same script run: for each
        workload, RUNS times each of off (`--coordinator-arg=--phase3-epoch-ms=0`) and on (the
        default, 1000 ms) on a fresh `mbal cluster up --coordinator` of 8 servers x 2 workers,
        every worker capped (`--worker-capacity CAP`), Phase 1 off (`--server-arg=--hot-keys=off`),
        Phase 2 on (the default) in both modes. Keys loaded first (uniform SETs), then the workload
        at a fixed open-loop rate (LOAD x the cluster's capacity) from t = 0 for SECS, settled from
        SETTLE (`mbal bench --routed`, the servers' per-worker load from `mbal load`). Workloads:
          hot  half the requests on all cachelets of server 0 (both workers), 50/50 read/write,
               uniform within the hot and the cold keys (`--workload custom --dist hotpart
               --hot-cachelet-ids <server 0's> --hot-ops 0.5 --read-ratio 0.5`; `--workload
               hotpart` ignores --read-ratio: it is always 95% reads)
          c    MBal's workload C: 50/50, Zipf 0.8 (`--workload c --zipf 0.8`)
        Reports (scripts/lib/balance_report.py, SETTLED_AT 1.10): per-worker max/avg settled, the
        settle time (every >= 1 s window's max/avg <= 1.10 from then on), p99 and ops/s at the
        fixed rate, the max ops/s at the p99 target (--sweep: a rate sweep on the same cluster
        after the fixed run), then the moves: the coordinator's `phase3_migrations` and
        `migrations_committed`, the servers' `migrations_out` and `migrated_out_bytes`, and the
        bench's errors and misses.
scale   Scale-out 4 -> 6 -> 4 under an open-loop load: `mbal cluster up --coordinator` of 4 servers
        x 2 workers (capacity CAP each), KEYS loaded, then a uniform 90% read load at SCALE_LOAD x
        the 4 servers' capacity for SCALE_SECS; at JOIN_AT s two servers join (`mbal server
        --cluster F --coordinator C -p 0`, warm: their share moves with its items); at REMOVE_AT s
        both are removed (`mbal cluster remove-server`, one after the other; --remove-together 1:
        at once), then stopped. The coordinator's
        members table is polled every 0.25 s. Per step: seconds until the cachelet spread is even
        (every Up server within one cachelet of the others, for good), the bench's per-second hit
        ratio before and after, errors; a timeline (markdown) of both. Clients (`--clients`):
        client: 16 mbal_client routing clients (crates/client/examples/routed_load.rs, built with
        `cargo build --release -p mbal-client --example routed_load`; they refetch the map on a
        redirect to a newer epoch), their keys loaded through a proxy first; proxy: `mbal bench`
        (plain text) through `mbal proxy --cluster`; routed: `mbal bench --routed`, which does not
        refetch the map and counts a redirect to a worker its map lacks as an error (so it cannot
        follow a scale-out: shown only as that).
report  The tables again from the files in --out.

Every process is started here and stopped by its pid (SIGINT, then SIGKILL after a bounded
wait); every wait is bounded. Wrap it in `flock /tmp/bench.lock`.
"""
import argparse
import json
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def log(*a):
    print(*a, flush=True)


def ask(addr, cmd, timeout=5.0):
    """A text command to a server or the coordinator; the lines up to END (or the MAP payload)."""
    host, port = addr.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=timeout) as s:
        s.sendall(cmd.encode() + b"\r\n")
        buf = b""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if cmd == "mbal map":
                head, sep, rest = buf.partition(b"\r\n")
                if sep:
                    f = head.split()
                    if f[0] != b"MAP":
                        raise RuntimeError(f"{addr}: {head!r}")
                    n = int(f[2])
                    if len(rest) >= n:
                        return json.loads(rest[:n])
            elif buf.endswith(b"END\r\n") or buf.startswith((b"ERROR", b"CLIENT_ERROR", b"SERVER_ERROR")) and buf.endswith(b"\r\n"):
                return [l for l in buf.decode(errors="replace").split("\r\n") if l and l != "END"]
            chunk = s.recv(1 << 20)
            if not chunk:
                break
            buf += chunk
        raise RuntimeError(f"{addr}: no full answer to {cmd!r}")


def stats(addr, group=""):
    out = {}
    for l in ask(addr, ("stats " + group).strip()):
        t = l.split(None, 2)
        if len(t) == 3 and t[0] == "STAT":
            out[t[1]] = t[2]
    return out


def owners(m):
    """[(server, worker)] by cachelet id, from `mbal map`'s JSON."""
    lay = m.get("layout") or m
    return [tuple(o) for o in lay["cachelet_owner"]]


def members(coord):
    """{id: (state, cachelets)} and the epoch, from the coordinator."""
    ms = {}
    for l in ask(coord, "mbal members"):
        f = l.split()
        if len(f) == 7 and f[0] == "MEMBER":
            ms[int(f[1])] = (f[3], int(f[5]))
    return ms


def running(p):
    return p.poll() is None


def stop(p, what, wait_s=15.0):
    """SIGINT every 0.1 s while it runs, up to wait_s, then SIGKILL (this pid only)."""
    if p is None or not running(p):
        return
    deadline = time.monotonic() + wait_s
    while running(p) and time.monotonic() < deadline:
        try:
            p.send_signal(signal.SIGINT)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    if running(p):
        log(f"  {what} (pid {p.pid}) did not stop in {wait_s:.0f} s: SIGKILL")
        p.kill()
    p.wait(timeout=10)


class Cluster:
    """`mbal cluster up --coordinator`, stopped with SIGINT (it stops its children); the children's
    pids (from its log) are killed by pid only if it had to be killed itself."""

    def __init__(self, a, tag, servers, workers, coord_args, server_args):
        self.log_path = os.path.join(a.out, f"{tag}.cluster.log")
        self.file = os.path.join(a.out, f"{tag}.cluster.toml")
        cmd = [a.bin, "cluster", "up", "--servers", str(servers), "--workers", str(workers),
               "--worker-capacity", str(a.cap), "-m", str(a.memory), "--file", self.file, "--coordinator"]
        cmd += [f"--coordinator-arg={x}" for x in coord_args]
        cmd += [f"--server-arg={x}" for x in server_args]
        self.cmd = cmd
        self.p = subprocess.Popen(cmd, stdout=open(self.log_path, "w"), stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + a.wait_up
        text = ""
        while time.monotonic() < deadline:
            text = open(self.log_path).read()
            if "Ctrl-C stops" in text:
                break
            if not running(self.p):
                raise RuntimeError(f"cluster up exited:\n{text}")
            time.sleep(0.1)
        else:
            self.stop()
            raise RuntimeError(f"cluster did not come up in {a.wait_up} s:\n{text}")
        self.servers = dict((int(i), ad) for i, ad in re.findall(r"^  server (\d+): ([0-9.:]+) ", text, re.M))
        self.child_pids = [int(x) for x in re.findall(r"\(pid (\d+)\)", text)]
        self.coord = re.search(r"^  coordinator: ([0-9.:]+) ", text, re.M).group(1)

    def stop(self):
        if running(self.p):
            stop(self.p, "cluster up", 20.0)
            if self.p.returncode == -signal.SIGKILL:
                for pid in getattr(self, "child_pids", []):
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass


def bench(a, args, timeout):
    """`mbal bench` with a bounded run time; raises on failure."""
    r = subprocess.run([a.bin, "bench"] + args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=timeout, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"bench failed ({r.returncode}): {r.stderr[-2000:]}")
    return r


def uptime():
    return open("/proc/loadavg").read().split()[:3]


def past_stop(a, tag):
    """--stop-at: no run starts after this time (Unix seconds)."""
    if a.stop_at and time.time() > a.stop_at:
        log(f"== {tag}: skipped (past --stop-at)")
        return True
    return False


# ---------------------------------------------------------------- phase3

def server_stats(c):
    """Per server: `stats balancer` (for balance_report.py: moves, escalations, state) and the
    migration counters of `stats`."""
    out = []
    for sid in sorted(c.servers):
        addr = c.servers[sid]
        one = {"server": sid}
        try:
            one.update(stats(addr, "balancer"))
            s = stats(addr)
            for k in ("migrations_out", "migrations_failed", "migrated_out_bytes", "migration_last_ms",
                      "migrations_in", "migrations_refused", "migrated_in_bytes", "curr_items"):
                if k in s:
                    one["mig_" + k] = s[k]
        except (OSError, RuntimeError) as e:
            one["error"] = str(e)
        out.append(one)
    return out


def phase3(a):
    total = 8 * 2 * a.cap
    rate = int(total * a.load)
    step = total // 16
    for wl in a.workloads:
        for run in a.run_ids:
            for mode in a.modes:
                tag = f"8x2.{wl}.{mode}.{run}"
                if past_stop(a, tag):
                    continue
                try:
                    phase3_one(a, wl, run, mode, tag, total, rate, step)
                except Exception as e:  # noqa: BLE001 -- one failed run must not stop the others
                    log(f"  {tag} failed: {e}")
        phase3_report(a, wl)


def phase3_report(a, wl):
    rep = subprocess.run([sys.executable, os.path.join(ROOT, "scripts/lib/balance_report.py"), a.out, "8x2", wl,
                          str(a.runs), " ".join(a.modes), str(a.settled_at), str(a.p99_target_us)],
                         env=dict(os.environ, KNOB="phase3"), stdout=subprocess.PIPE, text=True, timeout=60).stdout
    rep += "\n" + migration_table(a, wl)
    open(os.path.join(a.out, f"8x2.{wl}.report.md"), "w").write(rep)
    log(rep)


def phase3_one(a, wl, run, mode, tag, total, rate, step):
    coord_args = ["--phase3-epoch-ms=0"] if mode == "off" else [f"--phase3-epoch-ms={a.phase3_epoch_ms}"] if a.phase3_epoch_ms else []
    log(f"== {tag}: 8 x 2 at {a.cap} req/s each, {wl} at {rate} ops/s, Phase 3 {mode}; load {' '.join(uptime())}")
    t0 = time.time()
    c = Cluster(a, tag, 8, 2, coord_args, ["--hot-keys=off"] + a.server_args)
    try:
        m0 = ask(c.coord, "mbal map")
        own = owners(m0)
        if wl == "hot":
            hot = [i for i, (s, _) in enumerate(own) if s == 0]
            wargs = ["--workload", "custom", "--dist", "hotpart", "--hot-cachelet-ids", ",".join(map(str, hot)),
                     "--hot-ops", str(a.hot_ops), "--read-ratio", "0.5"]
        elif wl == "c":
            wargs = ["--workload", "c", "--zipf", str(a.zipf)]
        else:
            raise SystemExit(f"unknown workload {wl}")
        common = ["--routed", "--server", c.servers[0], "--keys", str(a.keys)] + wargs + [
            "--conns", str(a.conns), "--pipeline", str(a.pipeline), "--drain", "10", "--quiet"]
        bench(a, common + ["--load", "--load-timeout", "120", "--rate", str(rate), "--duration", str(a.secs),
                           "--settle", str(a.settle), "--max-ops", str(rate * a.secs * 2),
                           "--json", os.path.join(a.out, f"{tag}.json"), "--plot", os.path.join(a.out, f"{tag}.svg")],
              timeout=a.secs + 200)
        moved_fixed = sum(1 for x, y in zip(own, owners(ask(c.coord, "mbal map"))) if x[0] != y[0])
        coord_fixed = stats(c.coord)
        if a.sweep:
            bench(a, common + ["--rate-sweep", f"{step * 4}:{total}:{step}", "--p99-target-us", str(a.p99_target_us),
                               "--duration", str(a.sweep_secs), "--max-ops", str(total * a.sweep_secs * 2),
                               "--json", os.path.join(a.out, f"{tag}.sweep.json")],
                  timeout=a.sweep_secs * 20 + 200)
        json.dump(server_stats(c), open(os.path.join(a.out, f"{tag}.stats.json"), "w"))
        co = stats(c.coord)
        m1 = ask(c.coord, "mbal map")
        moved_all = sum(1 for x, y in zip(own, owners(m1)) if x[0] != y[0])
        mv = subprocess.run([a.bin, "cluster", "moves", "--coordinator", c.coord, "--cluster", c.file],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=30).stdout
        open(os.path.join(a.out, f"{tag}.moves.txt"), "w").write(mv)
        json.dump({"coordinator_after_fixed_run": coord_fixed, "coordinator": co,
                   "cachelets_on_another_server_after_fixed_run": moved_fixed,
                   "cachelets_on_another_server_at_end": moved_all, "epoch_start": m0.get("epoch"),
                   "epoch_end": m1.get("epoch"), "loadavg_end": uptime(), "wall_s": time.time() - t0},
                  open(os.path.join(a.out, f"{tag}.coord.json"), "w"), indent=1)
    finally:
        c.stop()


def migration_table(a, wl):
    lines = ["| phase3 | run | phase3_migrations (fixed run / with the sweep) | migrations committed | failed | "
             "cachelets on another server at the end of the fixed run | bytes moved (servers' migrated_out_bytes) | "
             "bench errors / unfinished | misses | hit ratio |", "|---|---|---|---|---|---|---|---|---|---|"]
    for mode in a.modes:
        for run in range(1, a.runs + 1):
            base = os.path.join(a.out, f"8x2.{wl}.{mode}.{run}")
            if not os.path.exists(base + ".coord.json"):
                continue
            cj = json.load(open(base + ".coord.json"))
            cf, co = cj["coordinator_after_fixed_run"], cj["coordinator"]
            ss = json.load(open(base + ".stats.json"))
            tot = json.load(open(base + ".json"))["totals"]
            byts = sum(int(s.get("mig_migrated_out_bytes", 0)) for s in ss)
            failed = sum(int(s.get("mig_migrations_failed", 0)) for s in ss)
            lines.append(f"| {mode} | {run} | {cf.get('phase3_migrations', '?')} / {co.get('phase3_migrations', '?')} | "
                         f"{co.get('migrations_committed', '?')} | {failed} | {cj['cachelets_on_another_server_after_fixed_run']} | "
                         f"{byts / 1e3:,.0f} kB | {tot.get('errors', 0)} / {tot.get('unfinished', 0)} | {tot.get('misses', 0)} | "
                         f"{tot.get('hit_ratio', 0):.4f} |")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------- scale

class Poller(threading.Thread):
    """The coordinator's members table every 0.25 s: [(unix_s, epoch, {id: (state, cachelets)})]."""

    def __init__(self, coord):
        super().__init__(daemon=True)
        self.coord, self.rows, self.halt = coord, [], threading.Event()

    def run(self):
        while not self.halt.is_set():
            try:
                ep = stats(self.coord).get("epoch")
                self.rows.append((time.time(), ep, members(self.coord)))
            except (OSError, RuntimeError):
                pass
            self.halt.wait(0.25)


def even(ms):
    up = [n for st, n in ms.values() if st == "up"]
    return len(up), (max(up) - min(up) <= 1 if up else False)


def scale(a):
    for client in a.clients:
        for run in a.run_ids:
            if past_stop(a, f"scale.{client}.{run}"):
                continue
            try:
                scale_one(a, client, run)
            except Exception as e:  # noqa: BLE001 -- one failed run must not stop the others
                log(f"  scale.{client}.{run} failed: {e}")


def scale_one(a, client, run):
    tag = f"scale.{client}.{run}"
    rate = int(4 * 2 * a.cap * a.scale_load)
    log(f"== {tag}: 4 x 2 at {a.cap} req/s each, uniform 90% read at {rate} ops/s, join 2 at {a.join_at} s, "
        f"remove them at {a.remove_at} s, {a.scale_secs} s; load {' '.join(uptime())}")
    c = Cluster(a, tag, 4, 2, [], a.server_args)
    extra, proxy, poller, bp = [], None, None, None
    events = {}
    try:
        target = c.servers[0]
        if client == "proxy":
            ports = os.path.join(a.out, f"{tag}.proxy.ports")
            proxy = subprocess.Popen([a.bin, "proxy", "--cluster", c.file, "-l", "127.0.0.1", "-p", "0", "-t", "2", "--print-ports"],
                                     stdout=open(ports, "w"), stderr=open(os.path.join(a.out, f"{tag}.proxy.log"), "w"))
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and not os.path.getsize(ports) and running(proxy):
                time.sleep(0.05)
            target = json.load(open(ports))["main"]
        out_json = os.path.join(a.out, f"{tag}.json")
        if client == "client":
            # mbal_client routing clients (crates/client/examples/routed_load.rs), which refetch
            # the map on a redirect to a newer epoch; their keys (fk:<i>, value "<i>:...") are
            # loaded first through a proxy.
            preload(a, c, tag)
            start = time.time() + 2.0
            csv = os.path.join(a.out, f"{tag}.ops.csv")
            bp = subprocess.Popen([a.routed_load, c.servers[0], str(rate), str(a.client_threads), f"{start:.3f}",
                                   f"{start + a.scale_secs:.3f}", str(a.keys), "1", csv],
                                  stdout=subprocess.DEVNULL, stderr=open(os.path.join(a.out, f"{tag}.bench.err"), "w"))
            poller = Poller(c.coord)
            poller.start()
            t0 = start
        else:
            mode = ["--routed"] if client == "routed" else []
            common = mode + ["--server", target, "--keys", str(a.keys), "--workload", "uniform", "--read-ratio", "0.9",
                             "--conns", str(a.conns), "--pipeline", str(a.pipeline), "--quiet"]
            bench(a, common + ["--load-only", "--load-timeout", "120"], timeout=200)
            poller = Poller(c.coord)
            poller.start()
            bp = subprocess.Popen([a.bin, "bench"] + common + ["--rate", str(rate), "--duration", str(a.scale_secs), "--drain", "10",
                                                              "--max-ops", str(rate * a.scale_secs * 2), "--json", out_json,
                                                              "--plot", os.path.join(a.out, f"{tag}.svg")],
                                  stdout=subprocess.DEVNULL, stderr=open(os.path.join(a.out, f"{tag}.bench.err"), "w"))
            t0 = time.time()
        while time.time() < t0 + a.join_at and bp.poll() is None:
            time.sleep(0.05)
        events["join"] = time.time()
        for i in range(2):
            pp = os.path.join(a.out, f"{tag}.new{i}.ports")
            extra.append(subprocess.Popen(
                [a.bin, "server", "--cluster", c.file, "--coordinator", c.coord, "-l", "127.0.0.1", "-p", "0", "-t", "2",
                 "-m", str(a.memory), "--worker-capacity", str(a.cap), "--print-ports"] + a.server_args,
                stdout=open(pp, "w"), stderr=open(os.path.join(a.out, f"{tag}.new{i}.log"), "w")))
        while time.time() < t0 + a.remove_at and bp.poll() is None:
            time.sleep(0.05)
        ms = members(c.coord)
        new_ids = sorted(i for i in ms if i >= 4)
        events["remove"] = time.time()
        # One after the other by default: removed together, the first one's cachelets may be
        # given to the second (docs/benchmarks-journal.md §20).
        rms = []
        for i in new_ids:
            rms.append(subprocess.Popen([a.bin, "cluster", "remove-server", "--id", str(i), "--coordinator", c.coord,
                                         "--cluster", c.file, "--wait", "120"],
                                        stdout=open(os.path.join(a.out, f"{tag}.remove{i}.log"), "w"), stderr=subprocess.STDOUT))
            if not a.remove_together:
                rms[-1].wait(timeout=150)
        for r in rms:
            r.wait(timeout=150)
        events["removed"] = time.time()
        events["remove_rc"] = [r.returncode for r in rms]
        for p in extra:
            stop(p, "joined server")
        bp.wait(timeout=a.scale_secs + 120)
        if client == "client":
            json.dump(csv_report(csv, t0, rate), open(out_json, "w"))
        poller.halt.set()
        poller.join(5)
        co = stats(c.coord)
        mv = subprocess.run([a.bin, "cluster", "moves", "--coordinator", c.coord, "--cluster", c.file],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=30).stdout
        open(os.path.join(a.out, f"{tag}.moves.txt"), "w").write(mv)
        pst = stats(target) if client == "proxy" else {}
        json.dump({"events": events, "members": poller.rows, "coordinator": co, "proxy": pst, "new_ids": new_ids,
                   "rate": rate}, open(os.path.join(a.out, f"{tag}.scale.json"), "w"))
    finally:
        if poller:
            poller.halt.set()
        if bp is not None and running(bp):
            stop(bp, "bench")
        for p in extra:
            stop(p, "joined server")
        stop(proxy, "proxy")
        c.stop()
    rep = scale_report(a, tag)
    open(os.path.join(a.out, f"{tag}.report.md"), "w").write(rep)
    log(rep)


def preload(a, c, tag):
    """SET fk:<i> = "<i>:pre:" + padding for every key, through a temporary `mbal proxy`."""
    ports = os.path.join(a.out, f"{tag}.preload.ports")
    p = subprocess.Popen([a.bin, "proxy", "--cluster", c.file, "-l", "127.0.0.1", "-p", "0", "-t", "1", "--print-ports"],
                         stdout=open(ports, "w"), stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not os.path.getsize(ports) and running(p):
            time.sleep(0.05)
        host, port = json.load(open(ports))["main"].rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=30) as s:
            for lo in range(0, a.keys, 500):
                req = b""
                hi = min(a.keys, lo + 500)
                for i in range(lo, hi):
                    v = f"{i}:pre:".encode() + b"x" * 64
                    req += b"set fk:%d 0 0 %d\r\n%s\r\n" % (i, len(v), v)
                s.sendall(req)
                buf = b""
                while buf.count(b"\r\n") < hi - lo:
                    chunk = s.recv(1 << 16)
                    if not chunk:
                        raise RuntimeError("preload: the proxy closed the connection")
                    buf += chunk
                if buf.count(b"STORED\r\n") != hi - lo:
                    bad = sorted({l for l in buf.split(b"\r\n") if l and l != b"STORED"})
                    n = buf.count(b"STORED\r\n")
                    raise RuntimeError(f"preload: {hi - lo} sets, {n} STORED, other replies {bad[:5]!r}")
    finally:
        stop(p, "preload proxy")


def csv_report(csv, t0, rate):
    """routed_load's per-operation CSV as the parts of a bench report scale_report reads."""
    secs = {}
    lat = []
    tot = {"ops": 0, "gets": 0, "hits": 0, "errors": 0, "corrupt": 0}
    for line in open(csv):
        f = line.rstrip("\n").split(",", 6)
        intended, done, op, outcome = float(f[0]), float(f[2]), f[4], f[5]
        t = int(intended - t0)
        x = secs.setdefault(t, {"t": t, "ops": 0, "gets": 0, "hits": 0, "errors": 0, "lat": []})
        x["ops"] += 1
        x["lat"].append(done - intended)
        lat.append(done - intended)
        tot["ops"] += 1
        if op == "get":
            x["gets"] += 1
            tot["gets"] += 1
        if outcome == "hit":
            x["hits"] += 1
            tot["hits"] += 1
        if outcome in ("error", "corrupt", "not_stored"):
            x["errors"] += 1
            tot["errors"] += 1
        tot["corrupt"] += outcome == "corrupt"

    def p99(v):
        v = sorted(v)
        return v[min(len(v) - 1, int(len(v) * 0.99))] * 1e6 if v else 0.0

    tl = []
    for t in sorted(secs):
        x = secs[t]
        x["p99_us"] = p99(x.pop("lat"))
        tl.append(x)
    tl.append({"t": len(tl), "ops": 0, "gets": 0, "hits": 0, "errors": 0, "p99_us": 0.0})  # the report drops the last
    n = max(1, len(tl) - 1)
    return {"run_started_unix_ms": t0 * 1000.0, "timeline": tl, "latency": {"all": {"p99_us": p99(lat)}},
            "totals": {"ops": tot["ops"], "ops_per_sec": tot["ops"] / n, "hit_ratio": tot["hits"] / tot["gets"] if tot["gets"] else 0.0,
                       "misses": tot["gets"] - tot["hits"], "errors": tot["errors"], "unfinished": 0, "redirects": "-",
                       "corrupt": tot["corrupt"], "target_rate": rate}}


def scale_report(a, tag):
    r = json.load(open(os.path.join(a.out, f"{tag}.json")))
    s = json.load(open(os.path.join(a.out, f"{tag}.scale.json")))
    t0 = r["run_started_unix_ms"] / 1000.0
    ev = {k: v - t0 for k, v in s["events"].items() if isinstance(v, float)}
    rows = [(t - t0, ep, ms) for t, ep, ms in s["members"]]

    def settled_even(after, until, want):
        """Seconds from `after` to the first poll from which the Up servers are `want` and even
        until `until` (None: never)."""
        k = None
        for i, (t, _, ms) in enumerate(rows):
            if t < after or t >= until:
                continue
            n, ev_ = even(ms)
            if n == want and ev_:
                k = i if k is None else k
            else:
                k = None
        return None if k is None else rows[k][0] - after

    tl = [x for x in r["timeline"][:-1]]

    def hit(lo, hi):
        g = sum(x["gets"] for x in tl if lo <= x["t"] < hi)
        h = sum(x["hits"] for x in tl if lo <= x["t"] < hi)
        e = sum(x["errors"] for x in tl if lo <= x["t"] < hi)
        return (h / g if g else float("nan")), e, g

    end = float(len(r["timeline"]))
    j, rm, rmd = ev.get("join", 0), ev.get("remove", end), ev.get("removed", end)
    out = [f"### {tag}: 4 -> 6 -> 4, {s['rate']} ops/s offered; join at {j:.1f} s, remove-server at {rm:.1f} s "
           f"(both done at {rmd:.1f} s, exit {s['events'].get('remove_rc')})", ""]
    out.append("| step | cachelet spread even after, s | hit ratio before (errors) | hit ratio 0-10 s after (errors) | hit ratio from 10 s after (errors) |")
    out.append("|---|---|---|---|---|")
    b = hit(1, int(j))
    a1 = hit(int(j), int(j) + 10)
    a2 = hit(int(j) + 10, int(rm))
    e1 = settled_even(j, rm, 6)
    out.append(f"| join 2 (4 -> 6) | {'never' if e1 is None else f'{e1:.1f}'} | {b[0]:.4f} ({b[1]}) | {a1[0]:.4f} ({a1[1]}) | {a2[0]:.4f} ({a2[1]}) |")
    c1 = hit(int(rm), int(rm) + 10)
    c2 = hit(int(rm) + 10, int(end))
    e2 = settled_even(rm, 1e9, 4)
    out.append(f"| remove 2 (6 -> 4) | {'never' if e2 is None else f'{e2:.1f}'} | {a2[0]:.4f} ({a2[1]}) | {c1[0]:.4f} ({c1[1]}) | {c2[0]:.4f} ({c2[1]}) |")
    tot = r["totals"]
    co = s["coordinator"]
    out.append("")
    out.append(f"totals: ops {tot['ops']}, ops/s {tot['ops_per_sec']:.0f}, hit ratio {tot['hit_ratio']:.4f}, misses {tot['misses']}, "
               f"errors {tot['errors']}, unfinished {tot['unfinished']}, redirects {tot['redirects']}, p99 {r['latency']['all']['p99_us']:.0f} us; "
               f"coordinator: migrations_committed {co.get('migrations_committed')}, phase3_migrations {co.get('phase3_migrations')}, epoch {co.get('epoch')}"
               + (f"; proxy: redirects {s['proxy'].get('proxy_redirects')}, map fetches {s['proxy'].get('proxy_map_fetches')}, "
                  f"maps installed {s['proxy'].get('proxy_maps_installed')}" if s.get("proxy") else ""))
    out.append("")
    out.append("timeline (each second: ops, hit ratio, errors, p99 µs; the Up servers' cachelet counts at its end):")
    out.append("")
    out.append("| t s | ops | hit ratio | errors | p99 µs | cachelets per Up server | epoch |")
    out.append("|---|---|---|---|---|---|---|")
    for x in tl:
        last = [row for row in rows if row[0] <= x["t"] + 1]
        ms = last[-1][2] if last else {}
        counts = " ".join(f"{i}:{n}" for i, (st, n) in sorted(ms.items()) if st == "up")
        hr = x["hits"] / x["gets"] if x["gets"] else float("nan")
        out.append(f"| {x['t']} | {x['ops']} | {hr:.4f} | {x['errors']} | {x['p99_us']:.0f} | {counts} | {last[-1][1] if last else ''} |")
    return "\n".join(out) + "\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("mode", choices=["phase3", "scale", "all", "report"])
    ap.add_argument("--bin", default=os.environ.get("BIN") or os.path.join(ROOT, "target/release/mbal"))
    ap.add_argument("--out", default="results/phase3")
    ap.add_argument("--runs", type=int, default=3, help="runs per mode (the report's medians are over runs 1..RUNS)")
    ap.add_argument("--run-ids", default="", help="only these run numbers (e.g. \"2 3\"; default 1..RUNS)")
    ap.add_argument("--cap", type=int, default=1000, help="per-worker capacity, req/s")
    ap.add_argument("--load", type=float, default=0.6, help="phase3: offered load, fraction of the cluster's capacity")
    ap.add_argument("--secs", type=int, default=30)
    ap.add_argument("--settle", type=int, default=15)
    ap.add_argument("--keys", type=int, default=50000)
    ap.add_argument("--memory", type=int, default=128, help="-m per server, MB")
    ap.add_argument("--hot-ops", type=float, default=0.5)
    ap.add_argument("--zipf", type=float, default=0.8)
    ap.add_argument("--conns", type=int, default=8)
    ap.add_argument("--pipeline", type=int, default=64)
    ap.add_argument("--workloads", default="hot c")
    ap.add_argument("--modes", default="off on")
    ap.add_argument("--sweep", type=int, default=0, help="1: a rate sweep after the fixed run")
    ap.add_argument("--sweep-secs", type=int, default=4)
    ap.add_argument("--p99-target-us", type=int, default=20000)
    ap.add_argument("--phase3-epoch-ms", type=int, default=0, help="on mode: the coordinator's --phase3-epoch-ms (default: its own)")
    ap.add_argument("--settled-at", type=float, default=1.10)
    ap.add_argument("--server-args", default="", help="more server arguments (space separated)")
    ap.add_argument("--stop-at", type=float, default=0, help="start no run after this Unix time")
    ap.add_argument("--wait-up", type=int, default=90)
    ap.add_argument("--clients", default="client proxy routed",
                    help="scale: client = mbal_client routing clients (routed_load), proxy = mbal bench through mbal proxy, "
                         "routed = mbal bench --routed (cannot follow new servers: a redirect to a worker its map lacks is an error)")
    ap.add_argument("--routed-load", default=os.environ.get("ROUTED_LOAD_BIN") or os.path.join(ROOT, "target/release/examples/routed_load"))
    ap.add_argument("--client-threads", type=int, default=16)
    ap.add_argument("--scale-load", type=float, default=0.5, help="scale: offered load, fraction of 4 servers' capacity")
    ap.add_argument("--scale-secs", type=int, default=60)
    ap.add_argument("--join-at", type=float, default=10)
    ap.add_argument("--remove-at", type=float, default=35)
    ap.add_argument("--remove-together", type=int, default=0, help="1: both remove-server commands at once")
    a = ap.parse_args()
    a.workloads, a.modes, a.clients = a.workloads.split(), a.modes.split(), a.clients.split()
    a.server_args = a.server_args.split()
    a.run_ids = [int(x) for x in a.run_ids.split()] or list(range(1, a.runs + 1))
    os.makedirs(a.out, exist_ok=True)
    if not os.path.exists(a.bin):
        subprocess.run(["cargo", "build", "--release", "--bin", "mbal"], cwd=ROOT, check=True)
    if a.mode in ("phase3", "all"):
        phase3(a)
    if a.mode in ("scale", "all"):
        scale(a)
    if a.mode == "report":
        for wl in a.workloads:
            phase3_report(a, wl)
        for client in a.clients:
            for run in a.run_ids:
                if os.path.exists(os.path.join(a.out, f"scale.{client}.{run}.scale.json")):
                    log(scale_report(a, f"scale.{client}.{run}"))


if __name__ == "__main__":
    main()
