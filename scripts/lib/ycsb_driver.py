#!/usr/bin/env python3
"""YCSB workload A from an unmodified pymemcache client, open loop (issue 11).

    ycsb_driver.py selftest
    ycsb_driver.py load --server HOST:PORT --records N [--value-size B] [--conns C]
    ycsb_driver.py run  --server HOST:PORT --records N --rate R --duration S --max-ops M
                        [--settle S] [--drain S] [--conns C] [--procs P] [--read-proportion 0.5]
                        [--distribution scrambled|zipfian]
                        [--value-size B] [--seed N] [--cluster FILE] --json OUT

The client is plain `pymemcache.client.base.Client` (one per thread, `default_noreply=False` so
that an update waits for its `STORED`, as YCSB's does): nothing mbal-specific, so pointed at
`mbal proxy` it is what an unmodified application sees.

Keys and their popularity are YCSB's (core workload, `requestdistribution=zipfian`): key number
k is named `user<fnvhash64(k)>`; a request's key number is drawn by YCSB's
`ScrambledZipfianGenerator` (a `ZipfianGenerator` over 10^10 items with theta 0.99 and the
precomputed zeta(10^10, 0.99) = 26.46902820178302, then `fnvhash64(v) % itemcount`), redrawn
while it is past the last record, as `CoreWorkload.nextKeynum` does. `--distribution zipfian`
draws the key number from YCSB's `ZipfianGenerator` over the records instead (Zipf's skew over
the records themselves: a steeper head, see `KeyChooser`). `selftest` checks the port against
the expected Zipfian frequencies.

Open loop: op i is due at t0 + i / rate (rate split over the processes, interleaved), whether or
not earlier ones have been answered; a free thread takes the next op due, waits for its time and
sends it; its latency is from the time it was due to its reply (no coordinated omission: an op
that waited for a free thread is charged the wait). Bounded: ops due in [0, duration) and at
most --max-ops; ops not answered by duration + drain are counted `unfinished`. Latencies (µs)
go into HdrHistograms (pip `hdrhistogram`): whole run, per op type, after the settle period
(ops due at or after --settle), and per second of completion (the last timeline entry holds the
drain). With --cluster, one side thread per server reads its per-worker load epochs (`mbal load
<after>`, docs/protocol.md) onto the run's time axis. The JSON has the fields of `mbal bench
--json` that scripts/lib/balance_report.py reads (settings, totals, latency, settled, timeline,
server_load).
"""
import argparse
import functools
import json
import math
import multiprocessing as mp
import os
import random
import re
import socket
import sys
import threading
import time

# ---------------------------------------------------------------- YCSB's generators (a port)

FNV_OFFSET_BASIS_64 = 0xCBF29CE484222325
FNV_PRIME_64 = 1099511628211
MASK64 = (1 << 64) - 1


def fnvhash64(val):
    """YCSB `Utils.fnvhash64`: FNV-1a over the 8 low-first bytes of a Java long, then Math.abs."""
    val &= MASK64
    h = FNV_OFFSET_BASIS_64
    for _ in range(8):
        h ^= val & 0xFF
        val >>= 8
        h = (h * FNV_PRIME_64) & MASK64
    if h >= 1 << 63:  # a negative Java long
        h -= 1 << 64
    return abs(h) if h != -(1 << 63) else h  # Math.abs(Long.MIN_VALUE) stays negative


def java_rem(a, b):
    """Java's % on longs (the sign of the dividend)."""
    r = abs(a) % abs(b)
    return -r if a < 0 else r


@functools.lru_cache(maxsize=8)
def zeta(n, theta):
    return sum(1.0 / (i + 1) ** theta for i in range(n))


class ZipfianGenerator:
    """YCSB `ZipfianGenerator` (Gray et al., SIGMOD 1994): values base..base+items-1, value base
    the most popular. `zetan` may be given (it is expensive for large item counts)."""

    ZIPFIAN_CONSTANT = 0.99

    def __init__(self, lo, hi, theta=ZIPFIAN_CONSTANT, zetan=None, rng=None):
        self.items = hi - lo + 1
        self.base = lo
        self.theta = theta
        self.zeta2theta = zeta(2, theta)
        self.alpha = 1.0 / (1.0 - theta)
        self.zetan = zeta(self.items, theta) if zetan is None else zetan
        self.eta = (1 - (2.0 / self.items) ** (1 - theta)) / (1 - self.zeta2theta / self.zetan)
        self.half_pow_theta = 1.0 + 0.5**theta
        self.rng = rng or random.Random()

    def next_value(self):
        u = self.rng.random()
        uz = u * self.zetan
        if uz < 1.0:
            return self.base
        if uz < self.half_pow_theta:
            return self.base + 1
        return self.base + int(self.items * (self.eta * u - self.eta + 1) ** self.alpha)


class ScrambledZipfianGenerator:
    """YCSB `ScrambledZipfianGenerator`: Zipfian popularity, the popular items spread over
    lo..hi by FNV. With theta 0.99 it draws from 10^10 items with YCSB's precomputed zetan."""

    ZETAN = 26.46902820178302
    USED_ZIPFIAN_CONSTANT = 0.99
    ITEM_COUNT = 10000000000

    def __init__(self, lo, hi, theta=USED_ZIPFIAN_CONSTANT, rng=None):
        self.lo = lo
        self.itemcount = hi - lo + 1
        zetan = self.ZETAN if theta == self.USED_ZIPFIAN_CONSTANT else None
        self.gen = ZipfianGenerator(0, self.ITEM_COUNT, theta, zetan, rng)

    def next_value(self):
        return self.lo + java_rem(fnvhash64(self.gen.next_value()), self.itemcount)


class KeyChooser:
    """`scrambled`: `CoreWorkload` with requestdistribution=zipfian and no inserts (YCSB's
    workload A): a ScrambledZipfianGenerator spanning recordcount + 1 values
    (insertstart..insertstart+insertcount+expectednewkeys, inclusive); a key number past the
    last record is redrawn. `zipfian`: a ZipfianGenerator over the records themselves (key
    number 0 the most popular, Zipf's skew over n = records: the top key gets 1/zeta(n, 0.99) of
    the requests, 10.3% for 10,000 records against 3.8% scrambled)."""

    def __init__(self, records, rng, dist="scrambled"):
        self.records = records
        if dist == "scrambled":
            self.gen = ScrambledZipfianGenerator(0, records, rng=rng)
        elif dist == "zipfian":
            self.gen = ZipfianGenerator(0, records - 1, rng=rng)
        else:
            raise ValueError(f"unknown distribution {dist!r}")

    def next_keynum(self):
        while True:
            k = self.gen.next_value()
            if 0 <= k < self.records:
                return k


def key_name(keynum):
    """`CoreWorkload.buildKeyName` with orderedinserts=false: "user" + fnvhash64(keynum)."""
    return "user%d" % fnvhash64(keynum)


def gray_probability(g, v):
    """P(ZipfianGenerator g draws base + v), exactly, from its inverse: values 0 and 1 take
    u*zetan < 1 and < 1 + 0.5^theta; value v >= 2 takes the u where
    floor(items * (eta*u - eta + 1)^alpha) = v, i.e. u in [U(v), U(v+1)) with
    U(x) = ((x/items)^(1-theta) - 1 + eta) / eta, above the first two values' range."""
    if v == 0:
        return 1.0 / g.zetan
    lo2 = g.half_pow_theta / g.zetan
    if v == 1:
        return lo2 - 1.0 / g.zetan

    def u_at(x):
        return min(max(((x / g.items) ** (1 - g.theta) - 1 + g.eta) / g.eta, lo2), 1.0)

    return u_at(v + 1) - u_at(v)


def selftest():
    """The port against the frequencies its method must give, and against Zipf's law; exits
    non-zero on a mismatch. Gray's method is exact for the two most popular values and
    approximates the rest (value 2 is drawn about 18-27% more often than Zipf's law says:
    YCSB's generator does that too, and the test expects it)."""
    ok = True
    draws = 400_000

    def check(label, got, want, tol):
        nonlocal ok
        good = abs(got - want) <= tol * want
        ok &= good
        return f"{label}: {got:.4f} expected {want:.4f} (+-{tol:.0%}) {'ok' if good else 'MISMATCH'}"

    # 1. ZipfianGenerator over n items: each value's frequency against the method's exact
    # probability; beside it Zipf's law, r^-theta / zeta(n, theta).
    n = 1000
    g = ZipfianGenerator(0, n - 1, 0.99, rng=random.Random(7))
    counts = [0] * n
    for _ in range(draws):
        counts[g.next_value()] += 1
    zn = zeta(n, 0.99)
    for r in range(1, 6):
        line = check(f"zipfian n={n} rank {r}", counts[r - 1] / draws, gray_probability(g, r - 1), 0.05)
        print(f"{line}; Zipf's law {r**-0.99 / zn:.4f}")

    # 2. YCSB's precomputed zetan for 10^10 items: the first 10^5 terms exactly, the rest by the
    # midpoint integral (error far below 1e-6 here).
    m, big, th = 100_000, ScrambledZipfianGenerator.ITEM_COUNT, 0.99
    approx = zeta(m, th) + ((big + 0.5) ** (1 - th) - (m + 0.5) ** (1 - th)) / (1 - th)
    good = abs(approx - ScrambledZipfianGenerator.ZETAN) < 1e-3
    ok &= good
    print(f"zeta(10^10, 0.99): {approx:.6f} YCSB's {ScrambledZipfianGenerator.ZETAN:.6f} {'ok' if good else 'MISMATCH'}")

    # 3. The key chooser over 10,000 records: its hottest keys are fnvhash64(v) % 10001 of the
    # underlying generator's values v = 0, 1, 2, ... (plus the tail's share, about 1/records each).
    records = 10_000
    kc = KeyChooser(records, random.Random(11))
    counts = {}
    for _ in range(draws):
        k = kc.next_keynum()
        counts[k] = counts.get(k, 0) + 1
    zg = kc.gen.gen
    for r in range(1, 5):
        key = java_rem(fnvhash64(r - 1), records + 1)
        line = check(f"scrambled records={records} rank {r} (key {key})", counts.get(key, 0) / draws,
                     gray_probability(zg, r - 1), 0.08)
        print(f"{line}; Zipf's law {r**-0.99 / zg.zetan:.4f}")
    top = sorted(counts.values(), reverse=True)
    want10 = sum(gray_probability(zg, v) for v in range(10))
    print(check("scrambled top-10 share", sum(top[:10]) / draws, want10, 0.05))

    # 4. The `zipfian` key chooser over 10,000 records: key number 0 at 1/zeta(10^4, 0.99).
    kz = KeyChooser(records, random.Random(13), "zipfian")
    hits = sum(kz.next_keynum() == 0 for _ in range(draws // 4))
    print(check("zipfian records=10000 key 0", hits / (draws // 4), 1.0 / zeta(records, 0.99), 0.05))

    # 5. fnvhash64 against YCSB's Java `Utils.fnvhash64` (its code compiled and run by javac/java;
    # user6284781860667377211 is the first key a YCSB load inserts).
    for v, want in ((0, 6284781860667377211), (1, 8517097267634966620), (12345, 1792800413050876852),
                    (9999999999, 3605131173811637474)):
        got = fnvhash64(v)
        good = got == want
        ok &= good
        print(f"fnvhash64({v}) = {got} {'ok' if good else 'MISMATCH (want %d)' % want}")
    print("selftest", "passed" if ok else "FAILED")
    return 0 if ok else 1


# ---------------------------------------------------------------- the client side


def parse_addr(s):
    host, port = s.rsplit(":", 1)
    return host, int(port)


def make_client(addr, timeout):
    from pymemcache.client.base import Client

    return Client(addr, connect_timeout=5, timeout=timeout, default_noreply=False, no_delay=True)


def load(args):
    """Insert every record (set, waiting for STORED), `conns` threads; bounded by --timeout."""
    addr = parse_addr(args.server)
    value = b"v" * args.value_size
    deadline = time.monotonic() + args.timeout
    next_k = iter(range(args.records))
    lock = threading.Lock()
    errors = [0]

    def worker():
        c = make_client(addr, 5)
        while time.monotonic() < deadline:
            with lock:
                k = next(next_k, None)
            if k is None:
                break
            for _ in range(5):
                try:
                    c.set(key_name(k), value)
                    break
                except Exception:  # noqa: BLE001 - retry a failed set a few times, count it
                    c.close()
                    with lock:
                        errors[0] += 1
        c.close()

    t0 = time.monotonic()
    ts = [threading.Thread(target=worker) for _ in range(args.conns)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    left = next(next_k, None)
    secs = time.monotonic() - t0
    print(f"loaded {args.records if left is None else left} records in {secs:.1f} s ({errors[0]} errors retried)")
    return 0 if left is None else 1


def proc_main(args, proc, t0, out_q):
    """One process: `conns` threads sharing this process's share of the schedule (ops i with
    i % procs == proc). Sends back raw records (due_s, done_s, latency_us, kind, outcome)."""
    addr = parse_addr(args.server)
    rate, procs = args.rate, args.procs
    end_due = args.duration
    hard_end = t0 + args.duration + args.drain
    value = b"u" * args.value_size
    lock = threading.Lock()
    state = {"next": proc}
    per_thread = []

    def take():
        with lock:
            i = state["next"]
            due = i / rate
            if due >= end_due or i >= args.max_ops:
                return None
            state["next"] = i + procs
            return due

    def worker(tid):
        rng = random.Random((args.seed * 1_000_003 + proc) * 10_007 + tid)
        keys = KeyChooser(args.records, rng, args.distribution)
        recs = []
        per_thread.append(recs)
        c = make_client(addr, args.duration + args.drain + 1)
        while True:
            due = take()
            if due is None:
                break
            wait = t0 + due - time.monotonic()
            if wait > 0:
                time.sleep(wait)
            if time.monotonic() >= hard_end:
                recs.append((due, None, 0, "-", "unfinished"))
                continue
            key = key_name(keys.next_keynum())
            read = rng.random() < args.read_proportion
            outcome = "ok"
            try:
                if read:
                    if c.get(key) is None:
                        outcome = "miss"
                elif not c.set(key, value):
                    outcome = "error"
            except Exception:  # noqa: BLE001 - SERVER_ERROR, a timeout or a closed socket: counted
                outcome = "error"
                c.close()
            done = time.monotonic()
            recs.append((due, done - t0, int((done - t0 - due) * 1e6), "read" if read else "update", outcome))
        c.close()

    ts = [threading.Thread(target=worker, args=(i,)) for i in range(args.conns)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    out_q.put([r for recs in per_thread for r in recs])


def hist():
    from hdrh.histogram import HdrHistogram

    return HdrHistogram(1, 600_000_000, 3)  # 1 µs .. 10 min


def summary(h):
    if h.get_total_count() == 0:
        return {"count": 0, "p50_us": 0.0, "p90_us": 0.0, "p99_us": 0.0, "p999_us": 0.0, "max_us": 0.0, "mean_us": 0.0}
    return {
        "count": h.get_total_count(),
        "mean_us": round(h.get_mean_value(), 1),
        "p50_us": float(h.get_value_at_percentile(50)),
        "p90_us": float(h.get_value_at_percentile(90)),
        "p99_us": float(h.get_value_at_percentile(99)),
        "p999_us": float(h.get_value_at_percentile(99.9)),
        "max_us": float(h.get_max_value()),
    }


# ---------------------------------------------------------------- the servers' own load


class LoadPoller(threading.Thread):
    """`mbal load <after>` of one server in a loop: every epoch snapshot as it ends, with its
    arrival time (the server's clock is placed on ours by the least-delayed answer)."""

    def __init__(self, server_id, addr):
        super().__init__(daemon=True)
        self.server_id, self.addr = server_id, addr
        self.got = []  # (arrival monotonic, record)
        self.stop = threading.Event()
        self.error = None

    def run(self):
        try:
            s = socket.create_connection(self.addr, timeout=5)
            s.settimeout(0.2)
            buf, after = b"", 0
            while not self.stop.is_set():
                s.sendall(b"mbal load %d\r\n" % after)
                while True:
                    m = re.match(rb"LOAD (\d+) (\d+)\r\n", buf)
                    if m and len(buf) >= m.end() + int(m.group(2)) + 2:
                        body = buf[m.end() : m.end() + int(m.group(2))]
                        buf = buf[m.end() + int(m.group(2)) + 2 :]
                        rec = json.loads(body)
                        self.got.append((time.monotonic(), rec))
                        after = rec["seq"]
                        break
                    if buf and not buf.startswith(b"LOAD") and b"\r\n" in buf:
                        raise RuntimeError(buf.split(b"\r\n")[0].decode(errors="replace"))
                    if self.stop.is_set():
                        return
                    try:
                        chunk = s.recv(1 << 20)
                    except socket.timeout:
                        continue
                    if not chunk:
                        raise RuntimeError("connection closed")
                    buf += chunk
        except Exception as e:  # noqa: BLE001 - reported in the JSON, the run goes on
            self.error = f"{e}"

    def epochs(self, t0, run_end_s):
        """(epochs, events) in `mbal bench`'s ServerLoad shape, epochs ending in (0, run_end_s]."""
        if not self.got:
            return [], []
        offset = min((at - t0) - rec["end_ns"] / 1e9 for at, rec in self.got)
        eps, events = [], []
        for _, rec in self.got:
            t_end = rec["end_ns"] / 1e9 + offset
            if t_end <= 0 or t_end > run_end_s:
                continue
            ws = rec.get("workers", [])
            secs = max((w.get("secs", 0.0) for w in ws), default=0.0)
            d = rec.get("balancer")
            eps.append({
                "server": self.server_id,
                "seq": rec["seq"],
                "t_end": t_end,
                "secs": secs,
                "workers": [{
                    "server": self.server_id,
                    "worker": w["worker"],
                    "ops_per_sec": (w.get("reads", 0) + w.get("writes", 0) + w.get("replica_reads", 0)) / w["secs"] if w.get("secs") else 0.0,
                    "busy": w.get("busy", 0.0),
                    "cachelets": len(w.get("cachelets", [])),
                } for w in ws],
                "balancer_state": (d or {}).get("state"),
            })
            if d:
                for mv in d.get("moves", []):
                    events.append({"t": t_end, "server": self.server_id, "kind": "move", "cachelet": mv["cachelet"],
                                   "from_worker": mv["from"], "to_worker": mv["to"], "source": "balancer", "why": str(mv.get("why"))})
                if d.get("escalate"):
                    events.append({"t": t_end, "server": self.server_id, "kind": "escalate", "cachelet": 0, "from_worker": 0,
                                   "to_worker": 0, "source": "balancer", "why": str(d["escalate"].get("why"))})
        return eps, events


def cluster_servers(path):
    return [parse_addr(a) for a in re.findall(r'addr\s*=\s*"([^"]+)"', open(path).read())]


def run(args):
    pollers = []
    if args.cluster:
        pollers = [LoadPoller(i, a) for i, a in enumerate(cluster_servers(args.cluster))]
        for p in pollers:
            p.start()
        # Let every poller read the history kept (up to 64 epochs) before the run starts.
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline and not all(p.got or p.error for p in pollers):
            time.sleep(0.05)
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    t0 = time.monotonic() + 0.5  # the processes' common start (CLOCK_MONOTONIC is system-wide)
    ps = [ctx.Process(target=proc_main, args=(args, i, t0, q)) for i in range(args.procs)]
    for p in ps:
        p.start()
    recs = []
    for _ in ps:
        recs.extend(q.get(timeout=args.duration + args.drain + 60))
    for p in ps:
        p.join()
    if pollers:
        # Until every server has reported an epoch that ended after the run (bounded).
        deadline = time.monotonic() + 5
        for p in pollers:
            while time.monotonic() < deadline and not p.error:
                eps, _ = p.epochs(t0, 1e9)
                if eps and eps[-1]["t_end"] > args.duration:
                    break
                time.sleep(0.1)
            p.stop.set()
        for p in pollers:
            p.join(timeout=2)

    secs = int(math.ceil(args.duration))
    h_all, h_read, h_update, h_settled = hist(), hist(), hist(), hist()
    h_settled_kind = {"read": hist(), "update": hist()}
    per_sec = [{"h": hist(), "ops": 0, "errors": 0} for _ in range(secs + 1)]
    counts = {"ok": 0, "miss": 0, "error": 0, "unfinished": 0}
    settled_done = 0
    for due, done, lat, kind, outcome in recs:
        counts[outcome] += 1
        if outcome == "unfinished":
            continue
        lat = max(lat, 1)
        h_all.record_value(lat)
        (h_read if kind == "read" else h_update).record_value(lat)
        if due >= args.settle:
            h_settled.record_value(lat)
            h_settled_kind[kind].record_value(lat)
        b = min(int(done), secs) if done < args.duration else secs
        per_sec[b]["h"].record_value(lat)
        per_sec[b]["ops"] += 1
        per_sec[b]["errors"] += outcome == "error"
        if args.settle <= done < args.duration:
            settled_done += 1
    timeline = []
    for t, s in enumerate(per_sec):
        sm = summary(s["h"])
        timeline.append({"t": t, "ops": s["ops"], "ops_per_sec": float(s["ops"]), "errors": s["errors"],
                         "p50_us": sm["p50_us"], "p99_us": sm["p99_us"], "max_us": sm["max_us"]})
    load = {"servers": [], "epochs": [], "events": [], "errors": []}
    for p in pollers:
        if p.error and not p.got:
            load["errors"].append(f"server {p.server_id}: {p.error}")
            continue
        eps, evs = p.epochs(t0, args.duration + 0.5)
        load["servers"].append("%s:%d" % p.addr)
        load["epochs"].extend(eps)
        load["events"].extend(evs)
    load["events"].sort(key=lambda e: e["t"])
    done_ops = len(recs) - counts["unfinished"]
    report = {
        "client": "pymemcache %s (pymemcache.client.base.Client, default_noreply=False)" % __import__("pymemcache").__version__,
        "workload": "YCSB A: %.0f%% read / %.0f%% update, %s over %d records" % (
            args.read_proportion * 100, (1 - args.read_proportion) * 100,
            {"scrambled": "ScrambledZipfianGenerator(0.99)", "zipfian": "ZipfianGenerator(0.99)"}[args.distribution], args.records),
        "settings": {"server": args.server, "records": args.records, "rate": args.rate, "duration": args.duration,
                     "settle": args.settle, "drain": args.drain, "max_ops": args.max_ops, "conns": args.conns,
                     "procs": args.procs, "distribution": args.distribution, "read_proportion": args.read_proportion, "value_size": args.value_size,
                     "seed": args.seed},
        "totals": {"target_rate": args.rate, "requests": len(recs), "ops": done_ops, "ok": counts["ok"],
                   "misses": counts["miss"], "errors": counts["error"], "unfinished": counts["unfinished"],
                   "ops_per_sec": sum(s["ops"] for s in per_sec[:secs]) / args.duration},
        "latency": {"all": summary(h_all), "read": summary(h_read), "update": summary(h_update)},
        "settled": {"from_s": args.settle, "ops_per_sec": settled_done / max(args.duration - args.settle, 1e-9),
                    "latency": summary(h_settled), "latency_read": summary(h_settled_kind["read"]),
                    "latency_update": summary(h_settled_kind["update"])},
        "timeline": timeline,
        "server_load": load if pollers else None,
    }
    with open(args.json, "w") as f:
        json.dump(report, f, indent=1)
    lat = report["latency"]["all"]
    print(f"{done_ops} ops ({counts['error']} errors, {counts['miss']} misses, {counts['unfinished']} unfinished), "
          f"{report['totals']['ops_per_sec']:.0f} ops/s of {args.rate:.0f} offered; p50 {lat['p50_us']:.0f} µs, "
          f"p99 {lat['p99_us']:.0f} µs; settled: {report['settled']['ops_per_sec']:.0f} ops/s, "
          f"p99 {report['settled']['latency']['p99_us']:.0f} µs")
    return 0


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("selftest")
    lp = sub.add_parser("load")
    rp = sub.add_parser("run")
    for p in (lp, rp):
        p.add_argument("--server", required=True, help="HOST:PORT (the proxy)")
        p.add_argument("--records", type=int, default=10_000)
        p.add_argument("--value-size", type=int, default=100)
        p.add_argument("--conns", type=int, default=8, help="threads, one pymemcache Client each (per process)")
    lp.add_argument("--timeout", type=float, default=120)
    rp.add_argument("--rate", type=float, required=True, help="offered ops/s, all processes together")
    rp.add_argument("--duration", type=float, required=True)
    rp.add_argument("--max-ops", type=int, required=True)
    rp.add_argument("--settle", type=float, default=0.0)
    rp.add_argument("--drain", type=float, default=10.0)
    rp.add_argument("--procs", type=int, default=1)
    rp.add_argument("--read-proportion", type=float, default=0.5)
    rp.add_argument("--distribution", choices=["scrambled", "zipfian"], default="scrambled",
                    help="scrambled: YCSB workload A's key choice; zipfian: YCSB's ZipfianGenerator over the records")
    rp.add_argument("--seed", type=int, default=1)
    rp.add_argument("--cluster", help="cluster file: record the servers' per-worker load (mbal load)")
    rp.add_argument("--json", required=True)
    a = ap.parse_args()
    if a.cmd == "selftest":
        return selftest()
    if a.cmd == "load":
        return load(a)
    if not (a.rate > 0 and a.duration > 0 and a.max_ops > 0 and a.conns > 0 and a.procs > 0):
        ap.error("--rate, --duration, --max-ops, --conns and --procs must be positive")
    return run(a)


if __name__ == "__main__":
    sys.exit(main())
