#!/usr/bin/env python3
"""kill -9 during a cross-server move of a cachelet, N seeded runs (issue 34, "Faults").

Usage (a load run: hold the bench lock):
    cargo build --bin mbal            (or --release; the binary is $MBAL_BIN, else
                                       target/release/mbal if it exists, else target/debug/mbal)
    flock /tmp/bench.lock python3 scripts/fault-migrate.py [--runs 20] [--seed 301]
        [--routed 4] [--proxy 2] [--fill-mb 4] [--retry-window 8] [--keep DIR]

Each run starts, as processes of its own on loopback (not `mbal cluster up`: it stops the whole
cluster when its coordinator exits, and the coordinator is one of the victims here):
`mbal coordinator --data-dir D` (default flags), 3 x `mbal server --cluster F --id i
--coordinator C -m 64 --hot-keys=off --balancer=off` (2 workers each) and `mbal proxy --cluster F`.
A cachelet C of server 0 (chosen by the seed) is filled with --fill-mb MB of 10 KB values.
Concurrent clients then write and read their own keys (2/3 of them in C, the others anywhere),
every operation recorded and checked as it is answered: --routed routed clients (`mbal hello`
on a worker, following `RD <epoch> <server> <worker>`; after an I/O error they start again at
another server) and --proxy plain memcached clients through the proxy. Each operation retries
(a new connection each time) until it succeeds or --retry-window s passed.

Then `mbal migrate C 1 <worker>` goes to server 0, and at a seeded point of the move (when the
destination's `stats` `migrated_in_bytes` passes a seeded fraction of C's bytes; a fraction
above 1 kills right after `mbal migrate` answered) one of the source, the destination or the
coordinator (seeded) gets SIGKILL. A killed coordinator is started again after a seeded pause
(0.2-1.5 s) with the same data dir. The script waits for the failure detection (a killed
server shown down with no cachelets at the coordinator), then checks, polling with a deadline:

  converge   every cachelet is owned by a live, Up server in the coordinator's map; each live
             server's `mbal map` has the same owners; every cachelet is served by exactly one
             worker of the live servers (a routed `get` of one of its keys on every live worker:
             all but the owner the coordinator names answer RD); the coordinator has no move in
             flight; C takes a write and reads it back.
  lost       at the end every key is read at its owner: a key whose last acknowledged write went
             to a home that lived (C's holder at the kill is the destination if the move
             committed, else the source; the other keys' holder is their first owner) must
             read back that version or newer, never a value of another key or a torn one.
  backwards  no read returned a version older than one the same client had acknowledged or
             read (a miss counts as older), unless the key's home was the killed server and the
             newer version was seen before the coordinator shows it down; never a version the
             client did not write.
  window     no operation failed for longer than --retry-window s (the longest error window,
             first failed attempt -> success, is printed).

One line per run, then a summary; exits 1 on any violation (each is printed with its seed).
Each run is bounded (< 60 s). Needs xxhash (pip install xxhash), to route keys to cachelets.
"""

import argparse
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SERVERS = 3
WORKERS = 2
CACHELETS_PER_WORKER = 16
VN_COUNT = 16384
FILL_VALUE = 10 * 1024
CLIENT_VALUE = 2000
KEYS_PER_CLIENT = 30
RUN_BUDGET = 55.0


def mbal_bin():
    if os.environ.get("MBAL_BIN"):
        return os.environ["MBAL_BIN"]
    rel = os.path.join(ROOT, "target", "release", "mbal")
    return rel if os.access(rel, os.X_OK) else os.path.join(ROOT, "target", "debug", "mbal")


MBAL = mbal_bin()


# ---------------------------------------------------------------- connections


class Line:
    """A text connection with a deadline on every read."""

    def __init__(self, addr, timeout=2.0):
        host, port = addr.rsplit(":", 1)
        self.s = socket.create_connection((host, int(port)), timeout=timeout)
        self.s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.buf = b""

    def close(self):
        try:
            self.s.close()
        except OSError:
            pass

    def _fill(self):
        d = self.s.recv(1 << 16)
        if not d:
            raise ConnectionError("closed")
        self.buf += d

    def line(self):
        while b"\r\n" not in self.buf:
            self._fill()
        l, self.buf = self.buf.split(b"\r\n", 1)
        return l.decode(errors="replace")

    def exact(self, n):
        while len(self.buf) < n + 2:
            self._fill()
        d, self.buf = self.buf[:n], self.buf[n + 2:]
        return d

    def send(self, b):
        self.s.sendall(b)

    def until_end(self, req):
        self.send(req.encode() + b"\r\n")
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
        self.send(b"mbal map\r\n")
        head = self.line().split()
        if len(head) < 3:
            raise RuntimeError(f"mbal map: {' '.join(head)}")
        return json.loads(self.exact(int(head[2])))

    def stats(self):
        return {l.split()[1]: l.split()[2] for l in self.until_end("stats") if l.startswith("STAT ")}

    def members(self):
        """id -> (state, cachelets)."""
        return {int(f[1]): (f[3], int(f[5])) for f in (l.split() for l in self.until_end("mbal members"))}

    def migrations(self):
        return [l.split() for l in self.until_end("mbal migrations")]

    def hello(self, worker):
        self.send(b"mbal hello 0 %d\r\n" % worker)
        l = self.line()
        if not l.startswith("MBAL "):
            raise RuntimeError(f"hello: {l}")

    def get(self, k):
        """('hit', bytes) | ('miss', None) | ('rd', (server, worker)) | ('err', line)."""
        self.send(b"get %s\r\n" % k.encode())
        l = self.line()
        if l == "END":
            return "miss", None
        if l.startswith("RD "):
            f = l.split()
            return "rd", (int(f[2]), int(f[3]))
        if l.startswith("VALUE "):
            f = l.split()
            if f[1] != k:
                raise RuntimeError(f"asked {k}, got {l}")
            d = self.exact(int(f[3]))
            end = self.line()
            if end != "END":
                raise RuntimeError(f"after the value of {k}: {end}")
            return "hit", d
        return "err", l

    def set(self, k, v):
        """'stored' | ('rd', ...) | ('err', line)."""
        self.send(b"set %s 0 0 %d\r\n%s\r\n" % (k.encode(), len(v), v))
        l = self.line()
        if l == "STORED":
            return "stored", None
        if l.startswith("RD "):
            f = l.split()
            return "rd", (int(f[2]), int(f[3]))
        return "err", l


def probe(addr, f, timeout=2.0):
    x = Line(addr, timeout)
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
    last = None
    while True:
        try:
            v = pred()
            if v:
                return v
        except (OSError, RuntimeError, ValueError, KeyError, IndexError) as e:
            last = e
        if time.monotonic() > until:
            raise RuntimeError(f"timed out waiting for {what}" + (f" (last: {last})" if last else ""))
        time.sleep(every)


# ---------------------------------------------------------------- keys and values


class Router:
    def __init__(self, m):
        import xxhash

        self.h = xxhash.xxh3_64_intdigest
        lay = m["layout"]
        self.vn_count, self.vn_to_c = lay["vn_count"], lay["vn_to_cachelet"]
        self.owners = [tuple(o) for o in lay["cachelet_owner"]]

    def cachelet(self, k):
        return self.vn_to_c[(self.h(k.encode()) >> 32) % self.vn_count]


def value(cid, k, ver, size):
    head = b"%s:%s:%d:" % (cid.encode(), k.encode(), ver)
    return head + bytes([97 + ver % 26]) * (size - len(head))


def parse_value(cid, k, d):
    """The version in `d`, a value of key k by client cid; None if it is not one (torn, another key's)."""
    head = b"%s:%s:" % (cid.encode(), k.encode())
    if not d.startswith(head):
        return None
    try:
        ver, pad = d[len(head):].split(b":", 1)
        ver = int(ver)
    except ValueError:
        return None
    if not pad or pad != bytes([97 + ver % 26]) * len(pad):
        return None
    return ver


# ---------------------------------------------------------------- clients


class Client:
    """One connection at a time; every operation retried until it succeeds or the window ends."""

    def __init__(self, cid, kind, keys, servers, proxy, seed, retry_window):
        self.cid, self.kind, self.keys = cid, kind, keys
        self.servers, self.proxy = servers, proxy
        self.rng = random.Random(seed)
        self.retry_window = retry_window
        self.conn, self.at = None, None  # at: (server, worker) of a routed connection
        self.start_server = self.rng.randrange(SERVERS)
        self.written = {k: 0 for k in keys}  # newest version sent
        self.floor = {k: (0, 0.0) for k in keys}  # (newest version acknowledged or read, when)
        self.acked = {k: (0, 0.0, None) for k in keys}  # (last acknowledged version, when, server)
        self.events = []  # (t, kind, key, detail): reads that went backwards, bad values, ...
        self.ops = self.errors = self.redirects = self.gave_up = 0
        self.windows = []  # (length, first failure, message)
        self.max_latency = 0.0
        self.stop = threading.Event()

    def _connect(self, target=None):
        self._drop()
        if self.kind == "proxy":
            self.conn = Line(self.proxy)
            return
        if target is None:
            s = self.start_server
            self.start_server = (self.start_server + 1) % SERVERS
            target = (s, 0)
        self.conn = Line(self.servers[target[0]])
        self.conn.hello(target[1])
        self.at = target

    def _drop(self):
        if self.conn is not None:
            self.conn.close()
        self.conn = None

    def _once(self, op, k, v):
        """One attempt: ('ok', answer) or ('fail', message); follows up to 8 redirects."""
        for _ in range(8):
            if self.conn is None:
                self._connect()
            if op == "get":
                r, x = self.conn.get(k)
            else:
                r, x = self.conn.set(k, v)
            if r == "rd":
                self.redirects += 1
                self._connect(x)
                continue
            if r == "err":
                return "fail", x
            return "ok", (r, x, self.at[0] if self.at else None)
        return "fail", "redirect loop"

    def op(self, op, k, v=None):
        t0 = time.monotonic()
        first_fail = None
        msg = None
        while True:
            try:
                r, x = self._once(op, k, v)
            except (OSError, RuntimeError, ValueError, ConnectionError) as e:
                r, x = "fail", f"{type(e).__name__}: {str(e)[:80]}"
                self._drop()
            now = time.monotonic()
            if r == "ok":
                if first_fail is not None:
                    self.windows.append((now - first_fail, first_fail, msg))
                self.max_latency = max(self.max_latency, now - t0)
                return x, now
            self.errors += 1
            if first_fail is None:
                first_fail, msg = now, x
            self._drop()
            if now - first_fail > self.retry_window:
                self.gave_up += 1
                self.windows.append((now - first_fail, first_fail, msg))
                return None, now
            time.sleep(0.02)

    def run(self, t_end):
        while not self.stop.is_set() and time.monotonic() < t_end:
            k = self.keys[self.rng.randrange(len(self.keys))]
            self.ops += 1
            if self.rng.random() < 1 / 3:
                ver = self.written[k] + 1
                self.written[k] = ver
                a, t = self.op("set", k, value(self.cid, k, ver, CLIENT_VALUE))
                if a is not None:
                    self.acked[k] = (ver, t, a[2])
                    if ver > self.floor[k][0]:
                        self.floor[k] = (ver, t)
            else:
                t_sent = time.monotonic()
                a, t = self.op("get", k)
                if a is not None:
                    self.check_read(k, a, t_sent, t)
        self._drop()

    def check_read(self, k, a, t_sent, t):
        r, d, server = a
        if r == "miss":
            ver = 0
        else:
            ver = parse_value(self.cid, k, d)
            if ver is None:
                self.events.append((t, "bad-value", k, repr(d[:60]), None))
                return
        fv, ft = self.floor[k]
        if ver > self.written[k]:
            self.events.append((t, "unwritten", k, f"read {ver}, wrote up to {self.written[k]}", None))
        elif ver < fv:
            self.events.append((t, "backwards", k, f"read {ver if ver else 'a miss'}, had {fv} "
                                                   f"(via {self.kind} {self.cid})", ft))
        if ver >= fv:
            self.floor[k] = (ver, t)


# ---------------------------------------------------------------- the cluster


class Cluster:
    def __init__(self, d, proxy_threads=1):
        self.dir = d
        ports = free_ports(SERVERS + 2)
        self.addrs = [f"127.0.0.1:{p}" for p in ports[:SERVERS]]
        self.coord = f"127.0.0.1:{ports[SERVERS]}"
        self.proxy = f"127.0.0.1:{ports[SERVERS + 1]}"
        self.file = os.path.join(d, "cluster.toml")
        self.data = os.path.join(d, "coord-data")
        with open(self.file, "w") as f:
            f.write(f"vn_count = {VN_COUNT}\ncachelets_per_worker = {CACHELETS_PER_WORKER}\nworkers = {WORKERS}\n")
            for a in self.addrs:
                f.write(f'\n[[servers]]\naddr = "{a}"\n')
        self.procs = {}
        self.logs = []
        self.start_coordinator()
        for i in range(SERVERS):
            self.start(f"server{i}", [MBAL, "server", "--cluster", self.file, "--id", str(i), "--coordinator",
                                      self.coord, "-m", "64", "--hot-keys=off", "--balancer=off"])
        for a in self.addrs:
            wait_for(f"server {a}", lambda a=a: probe(a, lambda x: x.stats()))
        wait_for("every server up at the coordinator",
                 lambda: probe(self.coord, lambda x: len(x.members()) == SERVERS and
                               all(s == "up" and n > 0 for s, n in x.members().values())))
        host, port = self.proxy.rsplit(":", 1)
        self.start("proxy", [MBAL, "proxy", "--cluster", self.file, "-l", host, "-p", port, "-t", str(proxy_threads)])
        wait_for("the proxy", lambda: socket.create_connection((host, int(port)), timeout=1).close() or True)

    def start_coordinator(self):
        self.start("coordinator", [MBAL, "coordinator", "--cluster", self.file, "--listen", self.coord,
                                   "--data-dir", self.data])
        wait_for("the coordinator", lambda: probe(self.coord, lambda x: x.members() is not None))

    def start(self, name, cmd):
        log = open(os.path.join(self.dir, f"{name}.log"), "ab")
        self.logs.append(log)
        self.procs[name] = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=log)

    def kill(self, name):
        p = self.procs[name]
        os.kill(p.pid, signal.SIGKILL)
        p.wait()

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


# ---------------------------------------------------------------- one run


def keys_in(router, pred, n, prefix):
    out, i = [], 0
    while len(out) < n:
        k = f"{prefix}{i}"
        if pred(router.cachelet(k)):
            out.append(k)
        i += 1
        if i > 10_000_000:
            raise RuntimeError("no keys for a cachelet")
    return out


def converge(c, live, victim, cl, router, deadline):
    """The checks of convergence (polled until `deadline`); returns the coordinator's map."""
    cachelets = len(router.owners)
    probe_key = {}
    i = 0
    while len(probe_key) < cachelets:
        k = f"probe:{i}"
        probe_key.setdefault(router.cachelet(k), k)
        i += 1
    live_ids = [i for i in range(SERVERS) if f"server{i}" != victim]

    def agreed():
        cm = probe(c.coord, lambda x: x.map())
        owners = [tuple(o) for o in cm["layout"]["cachelet_owner"]]
        bad = [j for j, o in enumerate(owners) if o[0] not in live_ids]
        if bad:
            raise RuntimeError(f"cachelets {bad[:5]} owned by a dead server")
        mem = probe(c.coord, lambda x: x.members())
        for s in range(SERVERS):
            want = "up" if s in live_ids else "down"
            if mem[s][0] != want:
                raise RuntimeError(f"server {s} is {mem[s][0]} at the coordinator")
        for s in live_ids:
            sm = probe(c.addrs[s], lambda x: x.map())
            if [tuple(o) for o in sm["layout"]["cachelet_owner"]] != owners:
                raise RuntimeError(f"server {s}'s map (epoch {sm['epoch']}) differs from the coordinator's "
                                   f"(epoch {cm['epoch']})")
        inflight = [m for m in probe(c.coord, lambda x: x.migrations()) if m[5] == "in-flight"]
        if inflight:
            raise RuntimeError(f"moves in flight: {inflight}")
        # Every cachelet served by exactly one live worker, the owner the coordinator names.
        for s in live_ids:
            for w in range(WORKERS):
                x = Line(c.addrs[s])
                try:
                    x.hello(w)
                    for j in range(cachelets):
                        r, _ = x.get(probe_key[j])
                        if (r != "rd") != (owners[j] == (s, w)):
                            raise RuntimeError(f"cachelet {j}: worker {s}:{w} answers {r}, the owner is {owners[j]}")
                finally:
                    x.close()
        return cm, owners

    cm, owners = wait_for("convergence", agreed, timeout=max(0.5, deadline - time.monotonic()), every=0.05)
    # The moved cachelet takes a write and reads it back at its owner.
    s, w = owners[cl]
    k = keys_in(router, lambda x: x == cl, 1, "served:")[0]
    v = b"served-%d" % int(time.time() * 1000)

    def served():
        x = Line(c.addrs[s])
        try:
            x.hello(w)
            return x.set(k, v)[0] == "stored" and x.get(k) == ("hit", v)
        finally:
            x.close()

    wait_for(f"cachelet {cl} to be served by {s}:{w}", served, timeout=max(0.5, deadline - time.monotonic()))
    return cm


def run_once(n, seed, args, workdir):
    rng = random.Random(seed)
    victim = rng.choice(["source", "destination", "coordinator"])
    frac = rng.uniform(0.0, 1.15)
    dst_worker = rng.randrange(WORKERS)
    d = os.path.join(workdir, f"run{n:02d}-seed{seed}")
    os.makedirs(d)
    t_run = time.monotonic()
    deadline = t_run + RUN_BUDGET
    res = {"run": n, "seed": seed, "victim": victim, "at": frac, "violations": []}
    viol = res["violations"]
    c = Cluster(d)
    clients, threads = [], []
    try:
        m0 = probe(c.coord, lambda x: x.map())
        router = Router(m0)
        src_cl = [j for j, o in enumerate(router.owners) if o[0] == 0]
        cl = src_cl[rng.randrange(len(src_cl))]
        res["cachelet"] = cl
        name_of = {"source": "server0", "destination": "server1", "coordinator": "coordinator"}
        vname = name_of[victim]
        vid = {"source": 0, "destination": 1}.get(victim)

        # Fill C at its owner (a routed connection on the owning worker).
        fill_n = max(1, int(args.fill_mb * (1 << 20) / FILL_VALUE))
        fill = keys_in(router, lambda x: x == cl, fill_n, f"fill{seed}:")
        x = Line(c.addrs[0], timeout=5)
        x.hello(router.owners[cl][1])
        for b in range(0, len(fill), 50):
            req = b"".join(b"set %s 0 0 %d noreply\r\n%s\r\n" % (k.encode(), FILL_VALUE, value("fill", k, 1, FILL_VALUE))
                           for k in fill[b:b + 50])
            x.send(req)
        if x.get(fill[-1])[0] != "hit":
            raise RuntimeError("the fill did not land")
        x.close()
        src_bytes = sum(int(v) for k, v in probe(c.addrs[0], lambda x: x.stats()).items() if k == "bytes")

        # Clients.
        t_stop = time.monotonic() + 40
        for i in range(args.routed + args.proxy):
            kind = "routed" if i < args.routed else "proxy"
            cid = f"{kind[0]}{i}"
            mine = keys_in(router, lambda x: x == cl, KEYS_PER_CLIENT * 2 // 3, f"{cid}:c:")
            mine += keys_in(router, lambda x: x != cl, KEYS_PER_CLIENT // 3, f"{cid}:o:")
            cli = Client(cid, kind, mine, c.addrs, c.proxy, seed * 100 + i, args.retry_window)
            clients.append(cli)
            t = threading.Thread(target=cli.run, args=(t_stop,), daemon=True)
            threads.append(t)
        for t in threads:
            t.start()
        wait_for("the clients to work", lambda: sum(x.ops for x in clients) >= 50 * len(clients), timeout=10)

        # The move, and the kill at a seeded point of it.
        answer = {}

        def mover():
            try:
                answer["line"] = probe(c.addrs[0], lambda x: (x.send(b"mbal migrate %d 1 %d\r\n" % (cl, dst_worker)),
                                                              x.line())[1], timeout=30)
            except (OSError, RuntimeError, ConnectionError) as e:
                answer["line"] = f"(no answer: {type(e).__name__}: {e})"
            answer["t"] = time.monotonic()

        t_move = time.monotonic()
        mt = threading.Thread(target=mover, daemon=True)
        mt.start()
        dst = Line(c.addrs[1])
        threshold = frac * src_bytes
        moved = 0
        while "line" not in answer and time.monotonic() < t_move + 20:
            moved = int(dst.stats().get("migrated_in_bytes", 0))
            if frac <= 1.0 and moved >= threshold:
                break
            time.sleep(0.002)
        dst.close()
        if frac > 1.0:
            mt.join(timeout=max(0.1, t_move + 25 - time.monotonic()))
        c.kill(vname)
        t_kill = time.monotonic()
        res["kill_ms"] = (t_kill - t_move) * 1e3
        res["moved_at_kill"] = moved
        res["answered_before_kill"] = "line" in answer
        if victim == "coordinator":
            time.sleep(rng.uniform(0.2, 1.5))
            c.start_coordinator()
            res["coord_down_ms"] = (time.monotonic() - t_kill) * 1e3
        mt.join(timeout=max(0.1, t_move + 40 - time.monotonic()))
        res["migrate"] = answer.get("line", "(still waiting)")
        res["move_ms"] = (answer["t"] - t_move) * 1e3 if "t" in answer else float("nan")
        live = [i for i in range(SERVERS) if f"server{i}" != vname]
        if vid is not None:
            wait_for("the coordinator to show the killed server down",
                     lambda: probe(c.coord, lambda x: x.members()[vid] == ("down", 0)),
                     timeout=max(0.5, deadline - 20 - time.monotonic()), every=0.01)
        t_detect = time.monotonic()
        res["detect_ms"] = (t_detect - t_kill) * 1e3
        # Where C was when the victim died: the destination if the move committed.
        rows = probe(c.coord, lambda x: x.migrations())
        committed = any(r[2] == str(cl) and r[5] == "committed" for r in rows)
        if victim == "coordinator":
            committed = router.owners[cl][0] != probe(c.coord, lambda x: x.map())["layout"]["cachelet_owner"][cl][0]
        res["committed"] = committed
        holder_c = 1 if committed else 0
        if victim == "destination" and not committed and not res["migrate"].startswith("SERVER_ERROR migration failed"):
            viol.append(f"the destination died, the move did not commit, `mbal migrate` answered {res['migrate']!r}")
        if victim == "source" and committed and res["migrate"].startswith("SERVER_ERROR"):
            viol.append(f"the move committed but `mbal migrate` answered {res['migrate']!r}")

        try:
            cm = converge(c, live, vname, cl, router, min(deadline - 10, time.monotonic() + 15))
            res["epoch"] = f"{m0['epoch']}->{cm['epoch']}"
            res["converged_ms"] = (time.monotonic() - t_kill) * 1e3
        except RuntimeError as e:
            viol.append(f"no convergence: {e}")
            cm = probe(c.coord, lambda x: x.map())
            res["epoch"] = f"{m0['epoch']}->{cm['epoch']}"
            res["converged_ms"] = float("nan")

        # Load after convergence, then stop the clients.
        ops0 = sum(x.ops for x in clients)
        wait_for("load after convergence", lambda: sum(x.ops for x in clients) >= ops0 + 30 * len(clients),
                 timeout=10)
        for x in clients:
            x.stop.set()
        for t in threads:
            t.join(timeout=max(1.0, args.retry_window + 5))
            if t.is_alive():
                viol.append("a client did not stop")

        def may_lose(cachelet, t_known):
            """Could the value known at t_known have died with the victim?"""
            if vid is None or t_known >= t_detect:
                return False
            holder = holder_c if cachelet == cl else router.owners[cachelet][0]
            return holder == vid

        # The clients' own checks.
        for cli in clients:
            for (t, kind, k, det, ft) in cli.events:
                # A miss after the killed home's value: that value died with it.
                if kind == "backwards" and "a miss" in det and may_lose(router.cachelet(k), ft):
                    continue
                viol.append(f"{kind}: {k}: {det}, at {t - t_kill:+.3f} s from the kill")
            if cli.gave_up:
                w = max(cli.windows)
                viol.append(f"client {cli.cid}: {cli.gave_up} operations failed for over {args.retry_window} s "
                            f"(from {w[1] - t_kill:+.3f} s after the kill: {w[2]})")

        # Every key read at its owner now.
        final = Router(cm)
        conns = {}

        def read_final(k):
            s, w = final.owners[final.cachelet(k)]
            if (s, w) not in conns:
                x = Line(c.addrs[s], timeout=5)
                x.hello(w)
                conns[(s, w)] = x
            return conns[(s, w)].get(k)

        lost = allowed = 0
        for cli in clients:
            for k in cli.keys:
                ver, t_ack, _ = cli.acked[k]
                if ver == 0:
                    continue
                r, dd = read_final(k)
                got = parse_value(cli.cid, k, dd) if r == "hit" else 0
                if r == "hit" and got is None:
                    viol.append(f"{k}: a torn or foreign value at the end: {dd[:60]!r}")
                elif r not in ("hit", "miss"):
                    viol.append(f"{k}: at the end answered {r} {dd}")
                elif got > cli.written[k]:
                    viol.append(f"{k}: at the end version {got}, never written (up to {cli.written[k]})")
                elif got < ver:
                    if may_lose(router.cachelet(k), t_ack):
                        allowed += 1
                    else:
                        lost += 1
                        viol.append(f"lost: {k}: acknowledged version {ver} at {t_ack - t_kill:+.3f} s from the "
                                    f"kill, reads {got if got else 'a miss'} at the end")
        fill_lost = 0
        for k in fill:
            r, dd = read_final(k)
            if r == "hit" and parse_value("fill", k, dd) == 1:
                continue
            if r == "miss" and may_lose(cl, 0.0):
                continue
            fill_lost += 1
        if fill_lost:
            viol.append(f"lost: {fill_lost} of {len(fill)} fill items of cachelet {cl}")
        for x in conns.values():
            x.close()
        res["lost_allowed"] = allowed
        res["ops"] = sum(x.ops for x in clients)
        res["errors"] = sum(x.errors for x in clients)
        res["redirects"] = sum(x.redirects for x in clients)
        ws = [w for x in clients for w in x.windows]
        res["window_ms"] = max((w[0] for w in ws), default=0.0) * 1e3
        res["window_msg"] = max(ws)[2] if ws else ""
        res["max_op_ms"] = max(x.max_latency for x in clients) * 1e3
        ps = probe(c.proxy, lambda x: x.stats())
        res["proxy_stats"] = " ".join(f"{k[6:]}={ps.get(k, '?')}" for k in
                                      ["proxy_unreachable", "proxy_unreachable_misses", "proxy_unreachable_errors",
                                       "proxy_redirects", "proxy_maps_installed"])
        if time.monotonic() - t_run > 60:
            viol.append(f"the run took {time.monotonic() - t_run:.1f} s")
        res["secs"] = time.monotonic() - t_run
    finally:
        for x in clients:
            x.stop.set()
        c.stop()
        if args.keep:
            shutil.copytree(d, os.path.join(args.keep, os.path.basename(d)), dirs_exist_ok=True)
    return res


COLS = [("run", "{:>3}"), ("seed", "{:>5}"), ("victim", "{:>11}"), ("at", "{:>5.2f}"), ("cachelet", "{:>8}"),
        ("kill_ms", "{:>7.0f}"), ("moved_at_kill", "{:>13}"), ("move_ms", "{:>7.0f}"), ("committed", "{:>9}"),
        ("detect_ms", "{:>9.0f}"), ("converged_ms", "{:>12.0f}"), ("epoch", "{:>6}"), ("ops", "{:>6}"),
        ("errors", "{:>6}"), ("window_ms", "{:>9.0f}"), ("max_op_ms", "{:>9.0f}"), ("lost_allowed", "{:>12}"),
        ("secs", "{:>5.1f}")]


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
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--seed", type=int, default=301)
    ap.add_argument("--routed", type=int, default=4, help="routed clients")
    ap.add_argument("--proxy", type=int, default=2, help="plain clients through mbal proxy")
    ap.add_argument("--fill-mb", type=float, default=4.0, help="MB of 10 KB values in the moving cachelet")
    ap.add_argument("--retry-window", type=float, default=8.0,
                    help="an operation failing for longer than this (s) is a violation")
    ap.add_argument("--keep", help="keep each run's logs under this directory")
    args = ap.parse_args()
    if not (1 <= args.runs <= 200 and 0 < args.fill_mb <= 32 and args.routed + args.proxy >= 1):
        sys.exit("--runs 1..200, --fill-mb up to 32, at least one client")
    if not os.access(MBAL, os.X_OK):
        sys.exit(f"no {MBAL}: cargo build --bin mbal (or set MBAL_BIN)")
    if args.keep:
        os.makedirs(args.keep, exist_ok=True)
    print(f"# {args.runs} runs from seed {args.seed}, {MBAL}; {SERVERS} servers x {WORKERS} workers + coordinator "
          f"+ proxy (default flags); {args.fill_mb:g} MB of {FILL_VALUE // 1024} KB values in the moving cachelet; "
          f"{args.routed} routed + {args.proxy} proxy clients (1/3 sets of {CLIENT_VALUE} B); times in ms",
          flush=True)
    print(" ".join(name.rjust(width(f)) for name, f in COLS), flush=True)
    results = []
    with tempfile.TemporaryDirectory(prefix="mbal-migfault-") as work:
        for n in range(args.runs):
            seed = args.seed + n
            try:
                r = run_once(n, seed, args, work)
            except Exception as e:  # noqa: BLE001 - a run that breaks is a violation, the others go on
                r = {"run": n, "seed": seed, "violations": [f"the run broke: {type(e).__name__}: {e}"]}
            results.append(r)
            print(fmt_row(r), flush=True)
            print(f"      migrate: {r.get('migrate', '-')}", flush=True)
            if r["violations"] and r.get("proxy_stats"):
                print(f"      proxy: {r['proxy_stats']}", flush=True)
            if r.get("window_msg"):
                print(f"      longest error window: {r['window_ms']:.0f} ms ({r['window_msg']})", flush=True)
            for v in r["violations"][:10]:
                print(f"      VIOLATION (seed {seed}): {v}", flush=True)
            if len(r["violations"]) > 10:
                print(f"      ... and {len(r['violations']) - 10} more", flush=True)
    bad = [r for r in results if r["violations"]]
    ok = [r for r in results if "ops" in r]
    print()
    by = {}
    for r in ok:
        by.setdefault(r["victim"], []).append(r)
    for v, rows in sorted(by.items()):
        com = sum(1 for r in rows if r["committed"])
        print(f"{v:>11}: {len(rows)} runs ({com} committed before/while it died, {len(rows) - com} aborted); "
              f"{'restarted' if v == 'coordinator' else 'found dead'} max {max(r['detect_ms'] for r in rows):.0f} ms; "
              f"converged max "
              f"{max(r['converged_ms'] for r in rows):.0f} ms; longest error window "
              f"{max(r['window_ms'] for r in rows):.0f} ms; slowest op {max(r['max_op_ms'] for r in rows):.0f} ms")
    if ok:
        print(f"ops {sum(r['ops'] for r in ok)}, errors (failed attempts, retried) {sum(r['errors'] for r in ok)}, "
              f"redirects {sum(r['redirects'] for r in ok)}, acknowledged writes lost with their home (allowed) "
              f"{sum(r['lost_allowed'] for r in ok)}")
    kinds = {}
    for r in bad:
        for v in r["violations"]:
            kinds.setdefault(v.split(":")[0], set()).add(r["seed"])
    for k, seeds in sorted(kinds.items()):
        print(f"violations '{k}': seeds {', '.join(str(x) for x in sorted(seeds))}")
    print(f"runs with violations: {len(bad)}/{len(results)}" +
          (f" (seeds {', '.join(str(r['seed']) for r in bad)})" if bad else ""))
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
