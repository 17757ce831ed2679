#!/usr/bin/env python3
"""A small, deterministic multi-get driver for profiling a server (not a benchmark).

    scripts/multiget-profile.py --port P load [--keys N]
    scripts/multiget-profile.py --port P get  [--keys N] [--lines L] [--conns C] [--depth D]

`load` stores N keys (10-24 B, length chosen per key index; values 20-64 B) with pipelined
`set ... noreply` lines, then checks one key. `get` sends L lines of `get` with 100 keys each
(--multiget), drawn uniformly with a fixed seed, over C connections with D lines in flight
each (the issue 37 fan-out client: 4 x 2), reads every reply to its END and prints keys,
hits and lines. The same seed gives the same key sequence, so a profiler (callgrind,
`strace -c`) sees the same work on every server: docs/benchmarks-journal.md "Multi-get
profile" uses it. Loopback only.
"""
import argparse
import random
import socket
import selectors
import sys


def key(i):
    n = 10 + (i * 2654435761 & 0xFFFFFFFF) % 15  # 10..24 bytes
    return b"k" + str(i).zfill(n - 1).encode()


def value(i):
    n = 20 + (i * 40503 & 0xFFFF) % 45  # 20..64 bytes
    return (b"v%d-" % i).ljust(n, b"x")[:n]


def connect(port):
    s = socket.create_connection(("127.0.0.1", port))
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return s


def load(a):
    s = connect(a.port)
    batch = []
    for i in range(a.keys):
        v = value(i)
        batch.append(b"set %s 0 0 %d noreply\r\n%s\r\n" % (key(i), len(v), v))
        if len(batch) == 2000 or i == a.keys - 1:
            s.sendall(b"".join(batch))
            batch = []
    s.sendall(b"get " + key(0) + b"\r\n")
    buf = b""
    while not buf.endswith(b"END\r\n"):
        chunk = s.recv(65536)
        if not chunk:
            sys.exit("server closed")
        buf += chunk
    if value(0) not in buf:
        sys.exit("load: key 0 missing")
    print(f"loaded {a.keys} keys")


def get(a):
    rng = random.Random(a.seed)
    sel = selectors.DefaultSelector()
    conns = []
    for c in range(a.conns):
        s = connect(a.port)
        s.setblocking(False)
        st = {"sock": s, "out": b"", "inflight": 0, "tail": b"", "hits": 0}
        conns.append(st)
        sel.register(s, selectors.EVENT_READ, st)
    sent = done = keys = hits = 0

    def refill(st):
        nonlocal sent, keys
        while st["inflight"] < a.depth and sent < a.lines:
            ks = [key(rng.randrange(a.keys)) for _ in range(a.multiget)]
            st["out"] += b"get " + b" ".join(ks) + b"\r\n"
            st["inflight"] += 1
            sent += 1
            keys += len(ks)
        if st["out"]:
            st["sock"].setblocking(True)
            st["sock"].sendall(st["out"])
            st["sock"].setblocking(False)
            st["out"] = b""

    for st in conns:
        refill(st)
    while done < a.lines:
        for ev, _ in sel.select(timeout=10):
            st = ev.data
            chunk = st["sock"].recv(1 << 20)
            if not chunk:
                sys.exit("server closed")
            buf = st["tail"] + chunk
            at = 0
            while True:
                if buf.startswith(b"END\r\n", at):
                    at += 5
                    st["inflight"] -= 1
                    done += 1
                    continue
                nl = buf.find(b"\r\n", at)
                if nl < 0:
                    break
                head = buf[at:nl].split()
                if head[0] != b"VALUE":
                    sys.exit(f"unexpected reply {buf[at:nl]!r}")
                stop = nl + 2 + int(head[3]) + 2
                if stop > len(buf):
                    break
                hits += 1
                at = stop
            st["tail"] = buf[at:]
            refill(st)
    print(f"lines {done} keys {keys} hits {hits}")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--keys", type=int, default=1_000_000)
    p.add_argument("--lines", type=int, default=2000)
    p.add_argument("--multiget", type=int, default=100)
    p.add_argument("--conns", type=int, default=4)
    p.add_argument("--depth", type=int, default=2)
    p.add_argument("--seed", type=int, default=37)
    p.add_argument("cmd", choices=["load", "get"])
    a = p.parse_args()
    load(a) if a.cmd == "load" else get(a)


if __name__ == "__main__":
    main()
