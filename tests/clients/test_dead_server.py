"""A dead server costs misses, not errors or hangs, through `mbal proxy` (issue 33 item 3):
two `mbal server` processes of one cluster behind the proxy, pymemcache as the application;
one server is killed with SIGKILL; `get` of its keys answers None, at once, `set` of its keys
fails with `SERVER_ERROR mbal server <addr> unreachable`, the other server's keys work.

The binary comes from $MBAL_BIN (set by scripts/test.sh).
"""

import json
import os
import socket
import subprocess
import time

import pytest

MBAL = os.environ.get("MBAL_BIN", "target/release/mbal")
TIMEOUT_MS = 3000


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stop(proc):
    if proc.poll() is None:
        proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _ports_line(proc, what):
    line = proc.stdout.readline()
    assert line, f"{what} did not start: " + proc.stderr.read()
    return json.loads(line)


@pytest.fixture()
def two_servers_and_a_proxy(tmp_path):
    addrs = [f"127.0.0.1:{_free_port()}" for _ in range(2)]
    cluster_file = tmp_path / "cluster.toml"
    servers = "".join(f'\n[[servers]]\naddr = "{a}"\n' for a in addrs)
    cluster_file.write_text(f"vn_count = 1024\ncachelets_per_worker = 4\nworkers = 2\n{servers}")
    procs = []
    try:
        for i in range(2):
            p = subprocess.Popen(
                [MBAL, "server", "--cluster", str(cluster_file), "--id", str(i), "-m", "16", "--print-ports"],
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            procs.append(p)
            _ports_line(p, f"server {i}")
        proxy = subprocess.Popen(
            [MBAL, "proxy", "--cluster", str(cluster_file), "-l", "127.0.0.1", "-p", "0", "-t", "1",
             "--upstream-timeout-ms", str(TIMEOUT_MS), "--print-ports"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        procs.append(proxy)
        host, port = _ports_line(proxy, "proxy")["main"].rsplit(":", 1)
        yield (host, int(port)), addrs, procs
    finally:
        for p in procs:
            _stop(p)


def _keys_of(addr, n, prefix):
    """n keys that the server at `addr` holds: a server refuses to store another's keys."""
    from pymemcache.client.base import Client
    from pymemcache.exceptions import MemcacheServerError

    host, port = addr.rsplit(":", 1)
    c = Client((host, int(port)), connect_timeout=5, timeout=5)
    keys = []
    for i in range(10_000):
        k = f"{prefix}{i}"
        try:
            c.set(k, b"direct", noreply=False)
            keys.append(k)
        except MemcacheServerError:
            pass
        if len(keys) == n:
            c.close()
            return keys
    raise AssertionError("no keys found")


def test_pymemcache_gets_misses_and_write_errors_for_a_killed_server(two_servers_and_a_proxy):
    from pymemcache.client.base import Client
    from pymemcache.exceptions import MemcacheServerError

    proxy_addr, addrs, procs = two_servers_and_a_proxy
    k0, k1 = _keys_of(addrs[0], 4, "a"), _keys_of(addrs[1], 4, "b")
    c = Client(proxy_addr, connect_timeout=5, timeout=10)
    for k in k0 + k1:
        assert c.set(k, b"v", noreply=False)
    assert c.get(k1[0]) == b"v"

    procs[1].kill()  # SIGKILL: server 1 is gone, its sockets closed by the kernel
    procs[1].wait()

    for k in k1:
        t0 = time.monotonic()
        assert c.get(k) is None, k
        assert time.monotonic() - t0 < TIMEOUT_MS / 1000, "answered within the upstream timeout"
    assert c.get_many(k0 + k1) == {k: b"v" for k in k0}
    with pytest.raises(MemcacheServerError, match=f"mbal server {addrs[1]} unreachable"):
        c.set(k1[0], b"w", noreply=False)
    for k in k0:
        assert c.set(k, b"w", noreply=False)
        assert c.get(k) == b"w"
    stats = c.stats()
    assert stats[b"proxy_unreachable_misses"] >= len(k1)
    assert stats[b"proxy_unreachable_errors"] >= 1
    c.close()
