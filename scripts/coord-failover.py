#!/usr/bin/env python3
"""Coordinator fail-over on etcd, as real processes: a real etcd (loopback ports, a temp dir),
`mbal cluster up --coordinator --coordinators 2 --store etcd://...` (2 coordinators, 1 server),
then `kill -9` of the leading coordinator; the time from the kill until the standby answers a
heartbeat (`mbal beat 0 <epoch>`) with `BEAT` as the new leader. RUNS runs (default 10), each
with a fresh cluster; prints each and the median and max.

    scripts/coord-failover.py            # RUNS=N, MBAL_BIN=path (default: target/release/mbal)

Runs under `flock /tmp/bench.lock` (it takes the lock itself).
"""
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time

if os.environ.get("MBAL_BENCH_LOCKED") != "1":
    os.environ["MBAL_BENCH_LOCKED"] = "1"
    os.execvp("flock", ["flock", "/tmp/bench.lock", sys.executable] + sys.argv)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MBAL = os.environ.get("MBAL_BIN", os.path.join(ROOT, "target", "release", "mbal"))
RUNS = int(os.environ.get("RUNS", "10"))


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    p = s.getsockname()[1]
    s.close()
    return p


def ask(addr, req, timeout=1.0):
    """One request; the first answer line (or every STAT line of `stats`)."""
    with socket.create_connection(addr, timeout=timeout) as s:
        s.settimeout(timeout)
        s.sendall(req.encode() + b"\r\n")
        buf = b""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            chunk = s.recv(65536)
            if not chunk:
                break
            buf += chunk
            if req == "stats" and buf.endswith(b"END\r\n"):
                break
            if req != "stats" and b"\r\n" in buf:
                break
        return buf.decode(errors="replace")


def stat(addr, name):
    try:
        for l in ask(addr, "stats").split("\r\n"):
            if l.startswith(f"STAT {name} "):
                return int(l.split()[2])
    except OSError:
        return None
    return None


def wait(what, f, limit=20.0):
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        v = f()
        if v:
            return v
        time.sleep(0.01)
    raise SystemExit(f"timed out waiting for {what}")


def one_run(tmp, etcd_addr, i):
    file = os.path.join(tmp, f"cluster-{i}.toml")
    up = subprocess.Popen(
        [MBAL, "cluster", "up", "--coordinator", "--coordinators", "2", "--servers", "1", "--workers", "2",
         "-m", "16", "--store", f"etcd://{etcd_addr[0]}:{etcd_addr[1]}", "--file", file,
         "--coordinator-arg=--etcd-prefix=/mbal-failover/%d" % i],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    coords = []
    try:
        for line in up.stdout:
            t = line.strip()
            if t.startswith("coordinator: "):
                addr, pid = t.split()[1], int(t.split("(pid ")[1].split(")")[0])
                host, port = addr.rsplit(":", 1)
                coords.append(((host, int(port)), pid))
            if line.startswith("Ctrl-C"):
                break
        assert len(coords) == 2, coords
        leader = wait("a leader", lambda: next((c for c in coords if stat(c[0], "leader") == 1), None))
        standby = next(c for c in coords if c != leader)
        wait("the server's beats at the leader", lambda: (stat(leader[0], "beats") or 0) >= 3)
        epoch = stat(leader[0], "epoch")
        t0 = time.monotonic()
        os.kill(leader[1], signal.SIGKILL)

        def answered():
            try:
                return ask(standby[0], f"mbal beat 0 {epoch}", timeout=0.5).startswith("BEAT ")
            except OSError:
                return False

        wait("the standby to answer a beat as leader", answered)
        took = time.monotonic() - t0
        assert stat(standby[0], "epoch") == epoch, "the epoch changed"
        return took
    finally:
        up.send_signal(signal.SIGTERM)
        try:
            up.wait(timeout=20)
        except subprocess.TimeoutExpired:
            up.kill()
            up.wait()


def main():
    if not os.path.exists(MBAL):
        subprocess.check_call(["cargo", "build", "--release", "--bin", "mbal"], cwd=ROOT)
    with tempfile.TemporaryDirectory() as tmp:
        p, q = free_port(), free_port()
        client, peer = f"http://127.0.0.1:{p}", f"http://127.0.0.1:{q}"
        etcd = subprocess.Popen(
            ["etcd", "--data-dir", os.path.join(tmp, "etcd"), "--listen-client-urls", client,
             "--advertise-client-urls", client, "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
             "--initial-cluster", f"default={peer}", "--heartbeat-interval", "50", "--election-timeout", "500"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            wait("etcd", lambda: _can(p))
            times = []
            for i in range(RUNS):
                t = one_run(tmp, ("127.0.0.1", p), i)
                times.append(t)
                print(f"run {i + 1}: {t * 1000:.0f} ms", flush=True)
            print(f"fail-over (kill -9 of the leader -> the standby answers BEAT), {RUNS} runs, etcd lease TTL 1 s: "
                  f"median {statistics.median(times) * 1000:.0f} ms, max {max(times) * 1000:.0f} ms")
        finally:
            etcd.kill()
            etcd.wait()


def _can(port):
    try:
        socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
        return True
    except OSError:
        return False


if __name__ == "__main__":
    main()
