#!/usr/bin/env python3
"""The control plane at scale: one `mbal coordinator`, 100 servers x 16 workers (issue 33).

Usage (a load run: hold the bench lock):
    cargo build --release --bin mbal
    flock /tmp/bench.lock python3 scripts/coord-scale.py [--servers 100] [--workers 16]
        [--cachelets-per-worker 16] [--vn-count 65536] [--seconds 20] [--beat-ms 100] [--keep DIR]

Starts `mbal coordinator` (default flags: beat 100 ms, lease 400, failure timeout 600) on a
cluster file of --servers servers (127.0.0.1, distinct ports nobody listens on) x --workers
workers. A driver (this script, one thread, one connection per fake server, speaking
docs/protocol.md "Coordinator") registers every server (`mbal register <id> <addr> <workers> -
<memory>`) and fetches the map once, then beats each every --beat-ms (`mbal beat <id> <epoch>`,
the servers' beats spread evenly over the interval) for --seconds, counting the bytes it sends
and receives (TCP payload; headers not counted). The coordinator's CPU is utime+stime from
/proc/<pid>/stat over that window, its RSS from /proc/<pid>/status.

Then one fake server stops beating (its connection stays open, silent, as a paused or cut-off
server's would). Every other server, on the first `BEAT` that shows a newer epoch, fetches
`mbal map` once (as a real server does). Measured: the last beat of the silent server -> the
first answer showing the new epoch; -> the last of the others holding the new map; the epoch;
the map's size; the bytes and the coordinator's CPU of that epoch change.

Prints: the setup, the steady state (beats/s, CPU % of one core, RSS, bytes/s each way, bytes
per beat round, beat round trips), the registration phase, the reassignment (time, epoch, map
size and bytes, each server's map fetch time, beat round trips, and the leases that would have
lapsed: the driver keeps each fake server's lease as a real one does, the answered beat's send
time + 4 beat intervals, and sends no beat while it fetches the map), the coordinator's stats
and a goal line (far below one core: < 10% of one core in steady state).
"""

import argparse
import collections
import json
import os
import selectors
import socket
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "lib"))
from mcstats import stats as mc_stats  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MBAL = os.environ.get("MBAL_BIN", os.path.join(ROOT, "target", "release", "mbal"))
TICK = os.sysconf("SC_CLK_TCK")


def cpu_s(pid):
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK  # utime, stime (fields 14, 15)


def rss_kib(pid):
    with open(f"/proc/{pid}/status") as f:
        for l in f:
            if l.startswith("VmRSS:"):
                return int(l.split()[1])
    return 0


def threads(pid):
    with open(f"/proc/{pid}/status") as f:
        for l in f:
            if l.startswith("Threads:"):
                return int(l.split()[1])
    return 0


class Conn:
    """One fake server's connection: non-blocking, a parser for its answers."""

    def __init__(self, sid, addr, coord):
        self.id = sid
        self.addr = addr
        host, port = coord.rsplit(":", 1)
        self.s = socket.create_connection((host, int(port)), timeout=5)
        self.s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.buf = bytearray()
        self.sent = 0
        self.recv = 0
        self.epoch = 0
        self.registered = False
        self.map_left = None  # bytes of the MAP blob (+ CR LF) still to read
        self.map_epoch = 0
        self.map_bytes = 0
        self.map_size = 0
        self.first_map = None  # the first blob, kept by connection 0 only
        self.fetching = False
        self.beats_out = 0
        self.beats_in = 0
        self.gone = 0
        self.last_beat = None
        self.pending = collections.deque()  # send times of the beats not answered yet
        self.rtts = []  # beat round trips (s)
        self.lease = None  # seconds; set by the caller
        self.lease_until = None  # as a real server keeps it: the answered beat's send time + lease
        self.lapses = 0
        self.lapsed_s = 0.0

    def send(self, line):
        data = line.encode() + b"\r\n"
        self.s.sendall(data)
        self.sent += len(data)

    def on_readable(self, now, events):
        d = self.s.recv(1 << 20)
        if not d:
            raise ConnectionError(f"server {self.id}: the coordinator closed the connection")
        self.recv += len(d)
        self.buf += d
        while True:
            if self.map_left is not None:
                take = min(self.map_left, len(self.buf))
                if self.first_map is not None:
                    self.first_map += self.buf[:take]
                del self.buf[:take]
                self.map_left -= take
                if self.map_left > 0:
                    return
                self.map_left = None
                self.map_bytes += self.map_size
                self.fetching = False
                events.append(("map", self.id, now, self.map_epoch))
                continue
            i = self.buf.find(b"\r\n")
            if i < 0:
                return
            f = self.buf[:i].decode().split()
            del self.buf[:i + 2]
            if f[0] in ("BEAT", "GONE") and self.pending:
                sent = self.pending.popleft()
                self.rtts.append(now - sent)
                if f[0] == "BEAT" and self.lease is not None:
                    if self.lease_until is not None and now > self.lease_until:
                        self.lapses += 1
                        self.lapsed_s += now - self.lease_until
                    self.lease_until = max(self.lease_until or 0.0, sent + self.lease)
            if f[0] == "BEAT":
                self.beats_in += 1
                e = int(f[1])
                if e > self.epoch:
                    events.append(("epoch", self.id, now, e))
                    self.epoch = e
                if not self.fetching and e > self.map_epoch:
                    self.fetching = True
                    self.send("mbal map")
            elif f[0] == "MAP":
                self.map_epoch = int(f[1])
                self.map_size = int(f[2])
                self.map_left = self.map_size + 2
            elif f[0] == "REGISTERED" and int(f[1]) == self.id:
                self.registered = True
                self.epoch = max(self.epoch, int(f[2]))
                events.append(("registered", self.id, now, int(f[2])))
            elif f[0] == "GONE":
                self.gone += 1
            else:
                raise RuntimeError(f"server {self.id}: unexpected answer {' '.join(f)!r}")


def rtt_summary(conns):
    xs = sorted(x for c in conns for x in c.rtts)
    for c in conns:
        c.rtts.clear()
    if not xs:
        return "no beats answered"
    q = lambda p: 1e3 * xs[min(len(xs) - 1, int(p * len(xs)))]  # noqa: E731
    return f"beat round trip p50 {q(0.5):.2f} ms, p99 {q(0.99):.2f} ms, max {1e3 * xs[-1]:.1f} ms"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--servers", type=int, default=100)
    ap.add_argument("--workers", type=int, default=16)
    ap.add_argument("--cachelets-per-worker", type=int, default=16)
    ap.add_argument("--vn-count", type=int, default=65536,
                    help="VNs (>= cachelets; 100 x 16 x 16 = 25,600 cachelets do not fit the default 16,384)")
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--beat-ms", type=int, default=100)
    ap.add_argument("--memory-mb", type=int, default=1024)
    ap.add_argument("--keep", help="keep the coordinator's log and data here")
    a = ap.parse_args()
    if not (1 <= a.servers <= 1000 and 1 <= a.workers <= 64 and 1 <= a.seconds <= 120):
        sys.exit("--servers 1..1000, --workers 1..64, --seconds 1..120")
    if not os.access(MBAL, os.X_OK):
        sys.exit(f"no {MBAL}: cargo build --release --bin mbal (or set MBAL_BIN)")
    work = a.keep or tempfile.mkdtemp(prefix="mbal-coord-scale-")
    os.makedirs(work, exist_ok=True)
    # Ports for the fake servers: nothing listens there; the coordinator never dials them.
    base = 40000
    addrs = [f"127.0.0.1:{base + i}" for i in range(a.servers)]
    cfile = os.path.join(work, "cluster.toml")
    with open(cfile, "w") as f:
        f.write(f"vn_count = {a.vn_count}\ncachelets_per_worker = {a.cachelets_per_worker}\nworkers = {a.workers}\n")
        for ad in addrs:
            f.write(f'\n[[servers]]\naddr = "{ad}"\n')
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    coord = f"127.0.0.1:{s.getsockname()[1]}"
    s.close()
    log = open(os.path.join(work, "coordinator.log"), "ab")
    data = os.path.join(work, "coord-data")
    shutil_rm(data)
    p = subprocess.Popen([MBAL, "coordinator", "--cluster", cfile, "--listen", coord, "--data-dir", data,
                          "--beat-ms", str(a.beat_ms), "--lease-ms", str(a.beat_ms * 4),
                          "--failure-timeout-ms", str(a.beat_ms * 6)],
                         stdin=subprocess.DEVNULL, stdout=log, stderr=log)
    try:
        run(a, p, coord, addrs)
    finally:
        if p.poll() is None:
            p.terminate()
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        log.close()
        if not a.keep:
            shutil_rm(work)


def shutil_rm(path):
    import shutil

    shutil.rmtree(path, ignore_errors=True)


def run(a, p, coord, addrs):
    cachelets = a.servers * a.workers * a.cachelets_per_worker
    print(f"# coordinator at {coord} (pid {p.pid}, default flags: beat {a.beat_ms} ms, lease {4 * a.beat_ms}, "
          f"failure timeout {6 * a.beat_ms}); {a.servers} servers x {a.workers} workers, {cachelets} cachelets, "
          f"{a.vn_count} VNs; driver: 1 Python thread, {a.servers} connections")
    until = time.monotonic() + 20
    while True:
        try:
            socket.create_connection(tuple([coord.rsplit(":", 1)[0], int(coord.rsplit(":", 1)[1])]), timeout=1).close()
            break
        except OSError:
            if time.monotonic() > until or p.poll() is not None:
                raise RuntimeError("the coordinator did not start (see its log)")
            time.sleep(0.02)
    rss0 = rss_kib(p.pid)
    # Registration, as a real server starts: `mbal register`, then `mbal map`, then beats every
    # interval (here pipelined on one connection; the beats start at once, in the loop below).
    cpu_a, t_a = cpu_s(p.pid), time.monotonic()
    conns = []
    for i, ad in enumerate(addrs):
        c = Conn(i, ad, coord)
        if i == 0:
            c.first_map = bytearray()
        c.send(f"mbal register {i} {ad} {a.workers} - {a.memory_mb << 20}")
        c.send("mbal map")
        c.fetching = True
        conns.append(c)
    sel = selectors.DefaultSelector()
    for c in conns:
        c.s.setblocking(False)
        sel.register(c.s, selectors.EVENT_READ, c)
    period = a.beat_ms / 1000.0
    n = len(conns)
    events = []
    late = [0, 0.0]  # beats sent > 20 ms after due, the worst lateness

    def loop(t_from, t_to, silent=None):
        """Beat every conn (but `silent`) every period, spread; serve answers; until t_to."""
        k = 0
        last = {}
        while True:
            due = t_from + (k // n) * period + (k % n) * period / n
            if due >= t_to:
                break
            while True:
                now = time.monotonic()
                if now >= due:
                    break
                for key, _ in sel.select(timeout=due - now):
                    key.data.on_readable(time.monotonic(), events)
            c = conns[k % n]
            lag = time.monotonic() - due
            if lag > 0.020:
                late[0] += 1
            late[1] = max(late[1], lag)
            # As a real server's beat thread: no beat while the map is being fetched.
            if c.id != silent and not c.fetching:
                c.send(f"mbal beat {c.id} {c.epoch}")
                c.pending.append(time.monotonic())
                c.beats_out += 1
                c.last_beat = last[c.id] = time.monotonic()
            k += 1
        # Drain the answers still on the way.
        end = time.monotonic() + 0.5
        while time.monotonic() < end and any(c.beats_in < c.beats_out or c.fetching for c in conns):
            for key, _ in sel.select(timeout=0.05):
                key.data.on_readable(time.monotonic(), events)
        return last

    # Registration and the first maps, with the beats running; then a warm-up.
    loop(t_a, t_a + 2.0)
    t_b = time.monotonic()
    cpu_b = cpu_s(p.pid)
    regs = [e for e in events if e[0] == "registered"]
    maps = [e for e in events if e[0] == "map"]
    if len(regs) != len(conns) or len({e[1] for e in maps}) != len(conns):
        raise RuntimeError(f"{len(regs)} registered, {len({e[1] for e in maps})} maps in 2 s")
    m = json.loads(bytes(conns[0].first_map[:conns[0].map_size]))
    map_size = (conns[0].map_size, len(m["layout"]["vn_to_cachelet"]), len(m["layout"]["cachelet_owner"]))
    gone = sum(c.gone for c in conns)
    print(f"registration: {len(regs)} registered in {max(e[2] for e in regs) - t_a:.3f} s, each map fetched "
          f"(last {max(e[2] for e in maps) - t_a:.3f} s after the first register); epochs seen "
          f"{sorted({e[3] for e in regs})[:3]}...{max(c.epoch for c in conns)}; coordinator CPU over those 2 s "
          f"(registration, {len(maps)} maps, beats) {cpu_b - cpu_a:.3f} s; {sum(c.sent for c in conns)} B sent, "
          f"{sum(c.recv for c in conns)} B received; GONE answers {gone}")
    print(f"  the map: {map_size[0]} B of JSON ({map_size[1]} VNs, {map_size[2]} cachelet owners, "
          f"{len(m['servers'])} servers)")
    events.clear()
    t0 = time.monotonic()
    for c in conns:
        c.lease = 4 * period
    loop(t0, t0 + 1.0)
    rtt_summary(conns)
    for c in conns:
        c.lapses, c.lapsed_s = 0, 0.0
    for c in conns:
        c.sent = c.recv = 0
    beats0 = sum(c.beats_in for c in conns)
    gone0 = sum(c.gone for c in conns)
    late[:] = [0, 0.0]
    me0 = os.times()
    cpu0, w0 = cpu_s(p.pid), time.monotonic()
    loop(w0, w0 + a.seconds)
    w1 = time.monotonic()
    cpu1 = cpu_s(p.pid)
    secs = w1 - w0
    sent, recv = sum(c.sent for c in conns), sum(c.recv for c in conns)
    beats = sum(c.beats_in for c in conns) - beats0
    rounds = secs / period
    cpu_pct = 100 * (cpu1 - cpu0) / secs
    epochs = {c.epoch for c in conns}
    me1 = os.times()
    print(f"steady state: {secs:.2f} s, {beats} beats answered ({beats / secs:.0f}/s, {rounds:.0f} rounds), "
          f"epochs {sorted(epochs)}, GONE answers {sum(c.gone for c in conns) - gone0}; the driver sent "
          f"{late[0]} beats > 20 ms late (worst {1e3 * late[1]:.0f} ms), its own CPU "
          f"{100 * (me1.user + me1.system - me0.user - me0.system) / secs:.0f}% of one core")
    print(f"  coordinator CPU {cpu1 - cpu0:.3f} s = {cpu_pct:.2f}% of one core; RSS {rss0} KiB at start -> "
          f"{rss_kib(p.pid)} KiB; {threads(p.pid)} threads")
    print(f"  {rtt_summary(conns)}; leases that would have lapsed (a real server fences): "
          f"{sum(c.lapses for c in conns)} ({1e3 * sum(c.lapsed_s for c in conns):.0f} ms in all)")
    for c in conns:
        c.lapses, c.lapsed_s = 0, 0.0
    print(f"  bytes: to the coordinator {sent / secs:.0f} B/s, from it {recv / secs:.0f} B/s "
          f"({(sent + recv) / secs / 1024:.1f} KiB/s both ways); per beat round {sent / rounds:.0f} B + "
          f"{recv / rounds:.0f} B; per beat {sent / max(1, beats):.1f} B + {recv / max(1, beats):.1f} B")

    # One server stops beating: the reassignment.
    dead = a.servers // 2
    for c in conns:
        c.sent = c.recv = 0
        c.map_bytes = 0
    epoch_before = max(c.epoch for c in conns)
    events.clear()
    cpu2, r0 = cpu_s(p.pid), time.monotonic()
    last = loop(r0, r0 + 3.0, silent=dead)
    # The silent server's last beat was sent just before r0 (the previous loop's).
    r1 = time.monotonic()
    cpu3 = cpu_s(p.pid)
    ep = [e for e in events if e[0] == "epoch"]
    maps = [e for e in events if e[0] == "map" and e[1] != dead]
    new_epoch = max((e[3] for e in ep), default=epoch_before)
    live = [c for c in conns if c.id != dead]
    fetched = sum(1 for c in live if c.map_epoch >= new_epoch)
    total_map_bytes = sum(c.map_bytes for c in live)
    sent2, recv2 = sum(c.sent for c in conns), sum(c.recv for c in conns)
    t_last = conns[dead].last_beat
    print(f"reassignment: server {dead} stops beating (its last beat sent {r0 - t_last:.3f} s before the phase)")
    if ep:
        first = min(e[2] for e in ep) - t_last
        last_map = max((e[2] for e in maps), default=float("nan")) - t_last
        print(f"  first answer with the new epoch {epoch_before} -> {new_epoch}: {first:.3f} s after its last beat "
              f"(failure timeout {6 * a.beat_ms} ms + check every {a.beat_ms // 2} ms + up to one beat interval)")
        print(f"  {fetched}/{len(live)} others fetched the new map, each once ({total_map_bytes} B in all, "
              f"{total_map_bytes / max(1, fetched):.0f} B each); the last had it {last_map:.3f} s after")
        saw = {e[1]: e[2] for e in ep if e[3] == new_epoch}
        waits = sorted(e[2] - saw[e[1]] for e in maps if e[1] in saw and e[3] == new_epoch)
        if waits:
            print(f"  a server's map fetch (its BEAT with the new epoch -> the whole map read): median "
                  f"{1e3 * waits[len(waits) // 2]:.0f} ms, max {1e3 * waits[-1]:.0f} ms (a real server sends its next "
                  f"beat only after it; its lease is {4 * a.beat_ms} ms from its last beat's send)")
    else:
        print("  NO new epoch seen within 3 s")
    print(f"  {rtt_summary(conns)} (over the 3 s; the map fetches share the coordinator's lock with the beats)")
    lapsed = [c for c in live if c.lapses]
    print(f"  leases that would have lapsed (a real server fences until its next answered beat): {len(lapsed)} "
          f"servers, {sum(c.lapses for c in lapsed)} lapses, {1e3 * sum(c.lapsed_s for c in lapsed):.0f} ms in all, "
          f"longest {1e3 * max((c.lapsed_s for c in lapsed), default=0):.0f} ms")
    print(f"  the 3 s with the change: coordinator CPU {cpu3 - cpu2:.3f} s = {100 * (cpu3 - cpu2) / (r1 - r0):.2f}% "
          f"of one core; to it {sent2} B, from it {recv2} B; RSS {rss_kib(p.pid)} KiB")
    per_epoch = recv2 - (recv / rounds) * ((r1 - r0) / period) * (len(live) / len(conns))
    print(f"  bytes of that epoch change beyond the beats: ~{per_epoch:.0f} B from the coordinator")
    print(f"\ngoal: far below one core: steady state {cpu_pct:.2f}% of one core at {a.servers} servers x "
          f"{a.workers} workers -> {'MET' if cpu_pct < 10 else 'NOT MET'} (< 10%)")
    del last
    st = mc_stats(coord)
    print("coordinator stats: " + " ".join(f"{k}={st.get(k)}" for k in
                                            ["epoch", "servers_up", "servers_down", "registrations", "beats",
                                             "failures_detected", "state_writes", "bad_commands"]))
    for c in conns:
        c.s.close()


if __name__ == "__main__":
    main()
