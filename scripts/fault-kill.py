#!/usr/bin/env python3
"""kill -9 of a server under load, N seeded runs (issue 33, "What it must show").

Usage (a load run: hold the bench lock):
    cargo build --release --bin mbal
    cargo build --release -p mbal-client --example routed_load
    flock /tmp/bench.lock python3 scripts/fault-kill.py [--runs 20] [--seed 1] [--rate 2000]
        [--routed-rate 500] [--routed-threads 4] [--settle 3] [--dead 5] [--after 3]
        [--proxy-threads 2] [--server-arg=ARG ...] [--keep DIR]

Each run starts, as processes of its own on loopback: `mbal coordinator` (default flags: beat
100 ms, lease 400, failure timeout 600), 4 x `mbal server --cluster F --id i --coordinator C`
(2 workers each, default flags) and `mbal proxy --cluster F -t 2`. 10,000 keys are preloaded
through the proxy; then pymemcache clients (4 processes x 4 threads, one connection each) run
an open loop at --rate ops/s through the proxy, and --routed-threads routing clients (the Rust
`mbal-client`, one thread each) at --routed-rate ops/s straight to the servers (90% get / 10%
set, keys uniform, over the same keys), every operation
recorded (intended send time, send time, end, key, op, outcome: hit / miss / stored / error +
message). After --settle s one server (chosen by the seed) gets SIGKILL; --dead s later it is
started again with the same command (it registers again and gets cachelets back, empty), and
the load goes on --after s more. Nothing is pinned to a core (2 cores shared by everything).

Latency is measured from the intended send time (open loop: a late send counts).

Prints one row per run and medians / maxima:
  reassign   kill -> the coordinator shows the dead server down with no cachelets (`mbal members`,
             polled every 10 ms)
  installed  kill -> every live server serves the new map (its epoch from `mbal hello 0` on each,
             polled every 5 ms: a fetch of the whole map would load the servers in this window)
  last_err   kill -> the end of the last client error in the dead window
  served     kill -> the first stored set of a dead server's key after that last error (from
             then every key is served: its reads miss, its writes store)
  hit_again  kill -> the first get hit on a dead server's key (re-set after the kill)
  err, err/s client errors in the dead window, per second of [kill, last error]
  miss_d     misses on the dead server's keys in the dead window; miss_o, err_o: misses and errors
             on the other servers' keys (should be 0: nothing else disturbed)
  fenced     the servers' `fenced_keys` at the end (requests refused because a lease ran out)
  beat_age   the largest `ms_since_beat` of a surviving server in `mbal members` (polled every
             50 ms): above lease - beat interval (300 ms) its lease may lapse and it fences
  p99 before/after, ratio: ops on the other servers' keys, 2 s before vs 2 s after the kill
  ratio_aa   the control: the same ratio, 2 s before the kill vs [2, 4) s after it (nothing happens
             in between: the map has settled and the restart is later): the ratio's noise floor
  owns       restart -> the coordinator gives the restarted server cachelets
  serves     restart -> the restarted server has answered a get with a hit (its `stats`)
  err2, miss2 errors and misses after the restart; miss2_o: on keys the dead server never had (the
             rejoin takes cachelets, empty, from the others)
  rate, load ops/s done; the 1-minute load average at the run's start (the machine is shared)
One row for the proxy's clients, one for the routing clients (crates/client/examples/
routed_load.rs, --routed-rate; `mbal bench --routed` stops at the first closed connection, so it
cannot be used here). Then medians / maxima and the goal lines: kill -> served <= 1 s (the last
error, and the first stored write of a dead server's key after it) in every run; the other
servers' p99 within 1.5x; the runs where other servers' keys were disturbed.

--keep DIR keeps each run's logs (coordinator, servers, proxy) and its operations (ops.csv).
Needs pymemcache and xxhash (pip install pymemcache xxhash); the binaries are $MBAL_BIN or
target/release/mbal, and $ROUTED_LOAD_BIN or target/release/examples/routed_load
(cargo build --release -p mbal-client --example routed_load).
"""

import argparse
import json
import multiprocessing as mp
import os
import pickle
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MBAL = os.environ.get("MBAL_BIN", os.path.join(ROOT, "target", "release", "mbal"))
ROUTED = os.environ.get("ROUTED_LOAD_BIN", os.path.join(ROOT, "target", "release", "examples", "routed_load"))
SERVERS = 4
WORKERS = 2
KEYS = 10_000
PROCS = 4
THREADS = 4
VALUE_PAD = b"x" * 64

GET, SET = 0, 1
HIT, MISS, STORED, NOT_STORED, ERROR, CORRUPT = range(6)
OUTCOME = ["hit", "miss", "stored", "not_stored", "error", "corrupt"]


def key(i):
    return f"fk:{i}"


def value(i, tag):
    return b"%d:%s:" % (i, tag.encode()) + VALUE_PAD


# ---------------------------------------------------------------- the map and small clients


def key_owner_fn(map_json):
    import xxhash

    lay = map_json["layout"]
    vn_count, vn_to_c, owners = lay["vn_count"], lay["vn_to_cachelet"], lay["cachelet_owner"]

    def owner(k):
        h = xxhash.xxh3_64_intdigest(k.encode())
        return owners[vn_to_c[(h >> 32) % vn_count]][0]

    return owner


class Line:
    """A text connection (coordinator or server) with a deadline on every read."""

    def __init__(self, addr, timeout=2.0):
        host, port = addr.rsplit(":", 1)
        self.s = socket.create_connection((host, int(port)), timeout=timeout)
        self.s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.buf = b""

    def close(self):
        self.s.close()

    def _fill(self):
        d = self.s.recv(1 << 16)
        if not d:
            raise ConnectionError("closed")
        self.buf += d

    def line(self):
        while b"\r\n" not in self.buf:
            self._fill()
        l, self.buf = self.buf.split(b"\r\n", 1)
        return l.decode()

    def until_end(self, req):
        self.s.sendall(req.encode() + b"\r\n")
        out = []
        for _ in range(100_000):
            l = self.line()
            if l == "END":
                return out
            if "ERROR" in l:
                raise RuntimeError(l)
            out.append(l)
        raise RuntimeError("no END")

    def map(self):
        self.s.sendall(b"mbal map\r\n")
        head = self.line().split()
        n = int(head[2])
        while len(self.buf) < n + 2:
            self._fill()
        blob, self.buf = self.buf[:n], self.buf[n + 2:]
        return len(blob), json.loads(blob)

    def epoch(self):
        """The server's map epoch, from `mbal hello 0` (one short line, answered by the worker
        from an atomic: polling it does not load the server as fetching the map would)."""
        self.s.sendall(b"mbal hello 0\r\n")
        f = self.line().split()
        if f[0] != "MBAL":
            raise RuntimeError(" ".join(f))
        return int(f[3])

    def stats(self):
        return {l.split()[1]: l.split()[2] for l in self.until_end("stats") if l.startswith("STAT ")}

    def members(self):
        """id -> (state, cachelets)."""
        out = {}
        for l in self.until_end("mbal members"):
            f = l.split()
            out[int(f[1])] = (f[3], int(f[5]))
        return out


def probe(addr, f):
    """f(a fresh connection to addr), the connection closed after."""
    x = Line(addr)
    try:
        return f(x)
    finally:
        x.close()


def free_ports(n):
    socks = []
    for _ in range(n):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        socks.append(s)
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def wait_for(what, pred, timeout=20.0, every=0.01):
    until = time.monotonic() + timeout
    while True:
        try:
            v = pred()
            if v:
                return v
        except (OSError, RuntimeError, ValueError, KeyError, IndexError):
            pass
        if time.monotonic() > until:
            raise RuntimeError(f"timed out waiting for {what}")
        time.sleep(every)


# ---------------------------------------------------------------- the load


def load_thread(proxy, t_start, t_end, period, phase, seed, out):
    from pymemcache.client.base import Client

    rng = random.Random(seed)
    c = Client(proxy, connect_timeout=2, timeout=2, no_delay=True, default_noreply=False)
    tag = f"{seed}"
    i = 0
    while True:
        intended = t_start + phase + i * period
        i += 1
        if intended >= t_end:
            break
        now = time.monotonic()
        if now < intended:
            time.sleep(intended - now)
        k = rng.randrange(KEYS)
        op = SET if rng.random() < 0.10 else GET
        msg = None
        sent = time.monotonic()
        try:
            if op == GET:
                v = c.get(key(k))
                if v is None:
                    res = MISS
                elif v.startswith(b"%d:" % k):
                    res = HIT
                else:
                    res, msg = CORRUPT, repr(v[:40])
            else:
                res = STORED if c.set(key(k), value(k, f"{tag}.{i}")) else NOT_STORED
        except Exception as e:  # noqa: BLE001 - every failure is an outcome to record
            res, msg = ERROR, f"{type(e).__name__}: {str(e)[:100]}"
        out.append((intended, sent, time.monotonic(), k, op, res, msg))
    c.close()


def load_proc(idx, proxy, t_start, t_end, rate, seed, path):
    per_thread = rate / (PROCS * THREADS)
    period = 1.0 / per_thread
    outs, ts = [], []
    for j in range(THREADS):
        out = []
        outs.append(out)
        n = idx * THREADS + j
        phase = period * n / (PROCS * THREADS)
        t = threading.Thread(target=load_thread, args=(proxy, t_start, t_end, period, phase, seed * 1000 + n, out))
        t.start()
        ts.append(t)
    for t in ts:
        t.join()
    with open(path, "wb") as f:
        pickle.dump([r for o in outs for r in o], f)


# ---------------------------------------------------------------- one run


class Cluster:
    def __init__(self, d):
        self.dir = d
        ports = free_ports(SERVERS + 2)
        self.addrs = [f"127.0.0.1:{p}" for p in ports[:SERVERS]]
        self.coord = f"127.0.0.1:{ports[SERVERS]}"
        self.proxy_port = ports[SERVERS + 1]
        self.file = os.path.join(d, "cluster.toml")
        with open(self.file, "w") as f:
            f.write(f"vn_count = 16384\ncachelets_per_worker = 16\nworkers = {WORKERS}\n")
            for a in self.addrs:
                f.write(f'\n[[servers]]\naddr = "{a}"\n')
        self.procs = {}
        self.logs = []
        self.start("coordinator", [MBAL, "coordinator", "--cluster", self.file, "--listen", self.coord,
                                   "--data-dir", os.path.join(d, "coord-data")])
        wait_for("the coordinator", lambda: probe(self.coord, lambda x: x.members() is not None))
        for i in range(SERVERS):
            self.start_server(i)
        for a in self.addrs:
            wait_for(f"server {a}", lambda a=a: probe(a, lambda x: x.stats()))
        wait_for("every server up at the coordinator",
                 lambda: probe(self.coord, lambda x: all(s == "up" and n > 0 for s, n in x.members().values())))
        self.start("proxy", [MBAL, "proxy", "--cluster", self.file, "-l", "127.0.0.1", "-p",
                             str(self.proxy_port), "-t", str(ARGS.proxy_threads)])
        wait_for("the proxy", lambda: socket.create_connection(("127.0.0.1", self.proxy_port), timeout=1).close() or True)

    def server_cmd(self, i):
        return [MBAL, "server", "--cluster", self.file, "--id", str(i), "--coordinator", self.coord] + ARGS.server_arg

    def start_server(self, i):
        self.start(f"server{i}", self.server_cmd(i))

    def start(self, name, cmd):
        log = open(os.path.join(self.dir, f"{name}.log"), "ab")
        self.logs.append(log)
        self.procs[name] = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=log)

    def stop(self):
        for p in self.procs.values():
            if p.poll() is None:
                p.terminate()
        for p in self.procs.values():
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        for l in self.logs:
            l.close()


def preload(proxy):
    from pymemcache.client.base import Client

    c = Client(proxy, connect_timeout=2, timeout=5, default_noreply=False)
    for b in range(0, KEYS, 200):
        failed = c.set_many({key(i): value(i, "pre") for i in range(b, min(KEYS, b + 200))})
        if failed:
            raise RuntimeError(f"preload: {len(failed)} keys not stored")
    c.close()


def pct(xs, p):
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p / 100.0 * len(xs)))]


def run_once(n, seed, rate, workdir):
    rng = random.Random(seed)
    dead = rng.randrange(SERVERS)
    d = os.path.join(workdir, f"run{n:02d}-seed{seed}")
    os.makedirs(d)
    c = Cluster(d)
    res = {"run": n, "seed": seed, "dead": dead, "load": os.getloadavg()[0]}
    try:
        proxy = ("127.0.0.1", c.proxy_port)
        preload(proxy)
        coord = Line(c.coord)
        _, m0 = coord.map()
        epoch0 = m0["epoch"]
        owner0 = key_owner_fn(m0)
        owners = [owner0(key(i)) for i in range(KEYS)]
        # Check the hash against the cluster: a server refuses a key it does not own.
        pc = Line(c.addrs[dead])
        for i in [j for j in range(KEYS) if owners[j] == dead][:3] + [j for j in range(KEYS) if owners[j] != dead][:3]:
            v = value(i, "probe")
            pc.s.sendall(b"set %s 0 0 %d\r\n%s\r\n" % (key(i).encode(), len(v), v))
            ans = pc.line()
            if (ans == "STORED") != (owners[i] == dead):
                raise RuntimeError(f"key owner computed wrong: {key(i)} -> {owners[i]}, server {dead} says {ans}")
        pc.close()

        t_start = time.monotonic() + 0.3
        t_kill_plan = t_start + ARGS.settle + rng.uniform(0, 0.1)
        t_end = t_start + ARGS.settle + ARGS.dead + ARGS.after
        paths = [os.path.join(d, f"ops{j}.pkl") for j in range(PROCS)]
        ctx = mp.get_context("fork")
        loaders = [ctx.Process(target=load_proc, args=(j, proxy, t_start, t_end, rate, seed * 10 + j, paths[j]))
                   for j in range(PROCS)]
        for p in loaders:
            p.start()
        routed = None
        routed_csv = os.path.join(d, "routed.csv")
        if ARGS.routed_rate > 0:
            off = time.time() - time.monotonic()
            routed = subprocess.Popen([ROUTED, c.addrs[(dead + 1) % SERVERS], str(ARGS.routed_rate),
                                       str(ARGS.routed_threads), f"{t_start + off:.6f}", f"{t_end + off:.6f}",
                                       str(KEYS), str(seed), routed_csv],
                                      stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                      stderr=open(os.path.join(d, "routed.log"), "wb"))

        # The coordinator's view of the survivors' heartbeats: the largest `ms_since_beat` seen.
        beat_age = {}
        stop_mon = threading.Event()

        def monitor():
            x = Line(c.coord)
            while not stop_mon.is_set() and time.monotonic() < t_end:
                for l in x.until_end("mbal members"):
                    f = l.split()
                    if int(f[1]) != dead and f[6] != "-":
                        beat_age[int(f[1])] = max(beat_age.get(int(f[1]), 0), int(f[6]))
                time.sleep(0.05)
            x.close()

        mon = threading.Thread(target=monitor, daemon=True)
        mon.start()
        time.sleep(max(0, t_kill_plan - time.monotonic()))
        victim = c.procs[f"server{dead}"]
        os.kill(victim.pid, signal.SIGKILL)
        t_kill = time.monotonic()
        victim.wait()
        live = [a for i, a in enumerate(c.addrs) if i != dead]
        # kill -> reassigned at the coordinator
        t_restart_plan = t_kill + ARGS.dead

        def reassigned():
            st, cl = coord.members()[dead]
            return st == "down" and cl == 0

        wait_for("the reassignment", reassigned, timeout=ARGS.dead - 0.5, every=0.01)
        res["reassign"] = time.monotonic() - t_kill
        # (the epoch from `stats`: fetching and parsing the whole map here, in the harness, is
        # a CPU burst on the two cores the cluster runs on, just when the survivors take over)
        epoch1 = int(coord.stats()["epoch"])
        res["epoch"] = f"{epoch0}->{epoch1}"
        conns = {a: Line(a) for a in live}
        for a in live:
            wait_for("a live server to install the map", lambda a=a: conns[a].epoch() >= epoch1,
                     timeout=max(0.1, t_restart_plan - time.monotonic()), every=0.005)
        res["installed"] = time.monotonic() - t_kill
        for x in conns.values():
            x.close()

        time.sleep(max(0, t_restart_plan - time.monotonic()))
        c.start_server(dead)
        t_restart = time.monotonic()
        wait_for("the restarted server to own cachelets",
                 lambda: coord.members()[dead][0] == "up" and coord.members()[dead][1] > 0,
                 timeout=max(0.1, t_end - time.monotonic()), every=0.01)
        res["owns"] = time.monotonic() - t_restart
        try:
            sconn = wait_for("its port", lambda: Line(c.addrs[dead]), timeout=max(0.1, t_end - time.monotonic()))
            wait_for("the restarted server to serve a hit", lambda: int(sconn.stats().get("get_hits", 0)) > 0,
                     timeout=max(0.1, t_end - time.monotonic()), every=0.01)
            res["serves"] = time.monotonic() - t_restart
            sconn.close()
        except RuntimeError:
            res["serves"] = float("nan")
        coord.close()
        stop_mon.set()
        mon.join(timeout=5)
        res["beat_age"] = max(beat_age.values(), default=-1)
        for p in loaders:
            p.join(timeout=ARGS.after + 30)
            if p.is_alive():
                p.kill()
                raise RuntimeError("a load process did not finish")
        rops = []
        if routed is not None:
            try:
                routed.wait(timeout=ARGS.after + 30)
            except subprocess.TimeoutExpired:
                routed.kill()
                raise RuntimeError("the routed load did not finish")
            if routed.returncode != 0:
                raise RuntimeError(f"the routed load failed ({routed.returncode}), see routed.log")
            off = time.time() - time.monotonic()
            names = {"get": GET, "set": SET}
            with open(routed_csv) as f:
                for line in f:
                    it, se, dn, k, op, res_, msg = line.rstrip("\n").split(",", 6)
                    msg = json.loads(msg) if msg != '""' else None
                    rops.append((float(it) - off, float(se) - off, float(dn) - off, int(k), names[op],
                                 OUTCOME.index(res_), msg))
            rops.sort()
        ops = []
        for path in paths:
            with open(path, "rb") as f:
                ops += pickle.load(f)
            os.remove(path)
        ops.sort()
        fenced = declared = beat_fail = 0
        for i, a in enumerate(c.addrs):
            st = probe(a, lambda x: x.stats())
            fenced += int(st.get("fenced_keys", 0))
            if i != dead:
                declared += int(st.get("coordinator_declared_dead", 0))
                beat_fail += int(st.get("coordinator_beat_failures", 0))
        with open(os.path.join(d, "coordinator.log"), "rb") as f:
            downs = f.read().count(b"server down")
        res["others"] = (f"fenced_keys={fenced} (all servers) coordinator_declared_dead={declared} "
                         f"coordinator_beat_failures={beat_fail} (survivors); coordinator 'server down' lines={downs}")
        res["false_down"] = declared + max(0, downs - 1)
        res["fenced"] = fenced
        ps = probe(f"127.0.0.1:{c.proxy_port}", lambda x: x.stats())
        res["proxy"] = {k[6:]: int(ps[k]) for k in ["proxy_unreachable", "proxy_unreachable_misses",
                                                   "proxy_unreachable_errors", "proxy_map_refreshes",
                                                   "proxy_maps_installed", "proxy_redirects", "proxy_map_fetches"]}
        analyse(res, ops, owners, dead, t_start, t_kill, t_restart, t_end)
        if rops:
            res["routed"] = {k: res[k] for k in ["run", "seed", "dead", "epoch", "reassign", "installed", "owns",
                                                  "serves", "fenced", "beat_age", "load"]}
            analyse(res["routed"], rops, owners, dead, t_start, t_kill, t_restart, t_end)
        if ARGS.keep:
            with open(os.path.join(d, "ops.csv"), "w") as f:
                f.write("intended,sent,done,key,owner0,op,outcome,message\n")
                for (it, s, e, k, op, r, msg) in ops:
                    f.write(f"{it - t_kill:.6f},{s - t_kill:.6f},{e - t_kill:.6f},{k},{owners[k]},"
                            f"{'get' if op == GET else 'set'},{OUTCOME[r]},{json.dumps(msg) if msg else ''}\n")
                for (it, s_, e, k, op, r, msg) in rops:
                    f.write(f"{it - t_kill:.6f},{s_ - t_kill:.6f},{e - t_kill:.6f},{k},{owners[k]},"
                            f"{'get' if op == GET else 'set'},{OUTCOME[r]},{json.dumps(msg) if msg else ''},routed\n")
                f.write(f"# times are seconds from the kill (CLOCK_MONOTONIC {t_kill:.6f}); restart at {t_restart - t_kill:.6f}; "
                        f"rows ending ',routed' are the routing clients'\n")
    finally:
        c.stop()
        if ARGS.keep:
            shutil.copytree(d, os.path.join(ARGS.keep, os.path.basename(d)), dirs_exist_ok=True)
    return res


def analyse(res, ops, owners, dead, t_start, t_kill, t_restart, t_end):
    res["ops"] = len(ops)
    res["late"] = sum(1 for o in ops if o[1] - o[0] > 0.010) / max(1, len(ops))
    before = [o for o in ops if o[2] < t_kill]
    res["err0"] = sum(1 for o in before if o[5] == ERROR)
    res["miss0"] = sum(1 for o in before if o[5] == MISS)
    window = [o for o in ops if t_kill <= o[2] < t_restart]
    errs = [o for o in window if o[5] == ERROR]
    res["err"] = len(errs)
    res["err_msgs"] = sorted({o[6].split(" unreachable")[0] + (" unreachable" if "unreachable" in o[6] else "")
                              for o in errs})[:3]
    res["corrupt"] = sum(1 for o in ops if o[5] == CORRUPT)
    last_err = max((o[2] for o in errs), default=t_kill)
    res["last_err"] = last_err - t_kill if errs else 0.0
    res["err_s"] = len(errs) / (last_err - t_kill) if errs and last_err > t_kill else 0.0
    stored_dead = [o[2] for o in window if owners[o[3]] == dead and o[5] == STORED and o[1] >= last_err]
    res["served"] = (min(stored_dead) - t_kill) if stored_dead else float("nan")
    hits_dead = [o[2] for o in window if owners[o[3]] == dead and o[5] == HIT and o[1] >= t_kill]
    res["hit_again"] = (min(hits_dead) - t_kill) if hits_dead else float("nan")
    res["miss_d"] = sum(1 for o in window if owners[o[3]] == dead and o[5] == MISS)
    res["miss_o"] = sum(1 for o in window if owners[o[3]] != dead and o[5] == MISS)
    res["err_o"] = sum(1 for o in window if owners[o[3]] != dead and o[5] == ERROR)
    other = [o for o in ops if owners[o[3]] != dead]
    lb = [(o[2] - o[0]) * 1e3 for o in other if t_kill - 2 <= o[1] < t_kill]
    la = [(o[2] - o[0]) * 1e3 for o in other if t_kill <= o[1] < t_kill + 2]
    res["p99_before"], res["p99_after"] = pct(lb, 99), pct(la, 99)
    res["ratio"] = res["p99_after"] / res["p99_before"]
    # The control: the same ratio with no event in between, [2, 4) s after the kill (the map
    # settled, the restart not yet) against the same 2 s before: the noise floor of the ratio.
    lq = [(o[2] - o[0]) * 1e3 for o in other if t_kill + 2 <= o[1] < min(t_kill + 4, t_restart)]
    res["ratio_aa"] = pct(lq, 99) / res["p99_before"]
    after = [o for o in ops if o[2] >= t_restart]
    res["err2"] = sum(1 for o in after if o[5] == ERROR)
    res["miss2"] = sum(1 for o in after if o[5] == MISS)
    res["miss2_o"] = sum(1 for o in after if o[5] == MISS and owners[o[3]] != dead)
    res["rate"] = len(ops) / (t_end - t_start)


COLS = [("via", "{:>6}"), ("run", "{:>3}"), ("seed", "{:>5}"), ("dead", "{:>4}"), ("epoch", "{:>6}"), ("reassign", "{:>8.3f}"),
        ("installed", "{:>9.3f}"), ("last_err", "{:>8.3f}"), ("served", "{:>6.3f}"), ("hit_again", "{:>9.3f}"),
        ("err", "{:>4}"), ("err_s", "{:>6.0f}"), ("miss_d", "{:>6}"), ("miss_o", "{:>6}"), ("err_o", "{:>5}"),
        ("p99_before", "{:>10.2f}"), ("p99_after", "{:>9.2f}"), ("ratio", "{:>5.2f}"), ("ratio_aa", "{:>8.2f}"),
        ("owns", "{:>6.3f}"),
        ("serves", "{:>6.3f}"), ("err2", "{:>4}"), ("miss2", "{:>5}"), ("miss2_o", "{:>7}"),
        ("fenced", "{:>6}"), ("beat_age", "{:>8}"), ("rate", "{:>6.0f}"), ("load", "{:>5.1f}")]
SUMMARY = ["reassign", "installed", "last_err", "served", "hit_again", "err", "err_s", "miss_d", "miss_o", "err_o",
           "fenced", "beat_age", "p99_before",
           "p99_after", "ratio", "ratio_aa", "owns", "serves", "err2", "miss2", "miss2_o", "rate", "load"]


def width(f):
    return int(f.split(">")[1].split(".")[0].rstrip("}df"))


def fmt_row(r):
    out = []
    for name, f in COLS:
        v = r.get(name, float("nan"))
        try:
            out.append(f.format(v))
        except (ValueError, TypeError):
            out.append(str(v).rjust(width(f)))
    return " ".join(out)


def main():
    global ARGS
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--rate", type=float, default=2000, help="ops/s offered through the proxy")
    ap.add_argument("--settle", type=float, default=3.0)
    ap.add_argument("--dead", type=float, default=5.0)
    ap.add_argument("--after", type=float, default=3.0)
    ap.add_argument("--proxy-threads", type=int, default=2)
    ap.add_argument("--routed-rate", type=float, default=500,
                    help="ops/s of routing clients (crates/client, examples/routed_load) besides the proxy's; 0: none")
    ap.add_argument("--routed-threads", type=int, default=4)
    ap.add_argument("--server-arg", action="append", default=[],
                    help="one more `mbal server` argument (repeatable), e.g. --server-arg=--balancer=off")
    ap.add_argument("--keep", help="keep each run's logs and ops.csv under this directory")
    ARGS = ap.parse_args()
    if not (1 <= ARGS.runs <= 100 and 100 <= ARGS.rate <= 20000 and ARGS.dead >= 2 and ARGS.settle >= 2.5):
        sys.exit("--runs 1..100, --rate 100..20000, --dead >= 2, --settle >= 2.5")
    if not os.access(MBAL, os.X_OK):
        sys.exit(f"no {MBAL}: cargo build --release --bin mbal (or set MBAL_BIN)")
    if ARGS.routed_rate > 0 and not os.access(ROUTED, os.X_OK):
        sys.exit(f"no {ROUTED}: cargo build --release -p mbal-client --example routed_load (or --routed-rate 0)")
    if ARGS.keep:
        os.makedirs(ARGS.keep, exist_ok=True)
    print(f"# {ARGS.runs} runs, seed {ARGS.seed}, {ARGS.rate:.0f} ops/s offered (90% get / 10% set, {KEYS} keys) by "
          f"{PROCS}x{THREADS} pymemcache connections -> mbal proxy -t {ARGS.proxy_threads}, and "
          f"{ARGS.routed_rate:.0f} ops/s by {ARGS.routed_threads} routing clients -> "
          f"{SERVERS} servers x {WORKERS} workers + coordinator (default flags); kill at {ARGS.settle:.0f} s, "
          f"restart {ARGS.dead:.0f} s later, {ARGS.after:.0f} s more; times in s, p99 in ms", flush=True)
    header = [name.rjust(width(f)) for name, f in COLS]
    print(" ".join(header), flush=True)
    results = []
    with tempfile.TemporaryDirectory(prefix="mbal-fault-") as work:
        for n in range(ARGS.runs):
            seed = ARGS.seed + n
            try:
                r = run_once(n, seed, ARGS.rate, work)
            except Exception as e:  # noqa: BLE001 - a run that fails is reported, the others go on
                print(f"{n:>3} {seed:>5} FAILED: {type(e).__name__}: {e}", flush=True)
                results.append({"run": n, "seed": seed, "failed": str(e)})
                continue
            r["via"] = "proxy"
            results.append(r)
            print(fmt_row(r), flush=True)
            print(f"           proxy stats: {' '.join(f'{k}={v}' for k, v in r['proxy'].items())}", flush=True)
            print(f"           servers: {r['others']}", flush=True)
            for row in [r] + ([r["routed"]] if "routed" in r else []):
                if row is not r:
                    row["via"] = "routed"
                    print(fmt_row(row), flush=True)
                if row["err_msgs"]:
                    print(f"           {row['via']} errors: {'; '.join(row['err_msgs'])}", flush=True)
                if row["err0"] or row["miss0"] or row["corrupt"] or row["late"] > 0.01:
                    print(f"           {row['via']}: before the kill {row['err0']} errors, {row['miss0']} misses; "
                          f"{row['corrupt']} corrupt values; {100 * row['late']:.1f}% of sends > 10 ms late",
                          flush=True)
    ok = [r for r in results if "failed" not in r]
    if not ok:
        sys.exit("no run finished")
    goals = []
    for via, rows in [("proxy", ok), ("routed", [r["routed"] for r in ok if "routed" in r])]:
        if not rows:
            continue
        print(f"\n{via} ({len(rows)} runs):")
        for name in SUMMARY:
            xs = [r[name] for r in rows if r[name] == r[name]]
            if xs:
                print(f"{name:>10}: median {statistics.median(xs):9.3f}  max {max(xs):9.3f}  min {min(xs):9.3f}"
                      f"  ({len(xs)} runs)")
        served = [r["served"] for r in rows]
        last = [r["last_err"] for r in rows]
        worst = max(x if x == x else float("inf") for x in served)
        within = sum(1 for x in served if x == x and x <= 1.0)
        within_last = sum(1 for x in last if x <= 1.0)
        disturbed = [r["run"] for r in rows if r["err_o"] or r["miss_o"] or r["fenced"]]
        ratio_ok = sum(1 for r in rows if r["ratio"] <= 1.5)
        aa = [r["ratio_aa"] for r in rows if r["ratio_aa"] == r["ratio_aa"]]
        goals.append(f"goal kill->served <= 1 s (default flags), {via}: last error <= 1 s in {within_last}/{len(results)} "
                     f"runs, first stored write of a dead key after it <= 1 s in {within}/{len(results)} (median "
                     f"{statistics.median(x if x == x else float('inf') for x in served):.3f} s, worst {worst:.3f} s) "
                     f"-> {'MET' if within == len(results) else 'NOT MET'}")
        goals.append(f"goal other servers' p99 within 1.5x, {via}: {ratio_ok}/{len(results)} runs (median ratio "
                     f"{statistics.median(r['ratio'] for r in rows):.2f}); runs where other servers' keys failed, "
                     f"missed or were fenced: {disturbed or 'none'}; the control with no event ([2, 4) s after "
                     f"the kill against the same 2 s before): {sum(1 for x in aa if x <= 1.5)}/{len(aa)} within 1.5x"
                     + (f" (median {statistics.median(aa):.2f})" if aa else ""))
    print()
    for g in goals:
        print(g)

if __name__ == "__main__":
    main()
