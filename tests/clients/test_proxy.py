"""Real memcached client libraries against `mbal proxy` in front of a
4-server x 2-worker mbal cluster (`mbal cluster up`) on loopback: pymemcache,
pylibmc (text and binary) and libmemcached's `memccapable` conformance
checker, also while cachelets move between workers.

The binary comes from $MBAL_BIN (set by scripts/test.sh).
"""

import json
import os
import shutil
import socket
import subprocess
import threading

import pytest

MBAL = os.environ.get("MBAL_BIN", "target/release/mbal")
SERVERS, WORKERS, CPW = 4, 2, 4


def _stop(proc):
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@pytest.fixture(scope="module")
def proxied(tmp_path_factory):
    cluster_file = tmp_path_factory.mktemp("proxy") / "cluster.toml"
    cluster = subprocess.Popen(
        [MBAL, "cluster", "up", "--servers", str(SERVERS), "--workers", str(WORKERS),
         "--cachelets-per-worker", str(CPW), "--vn-count", "1024", "-m", "32", "--file", str(cluster_file)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    proxy = None
    try:
        addrs = []
        for line in cluster.stdout:
            if line.strip().startswith("server "):
                addrs.append(line.split()[2])
            if line.startswith("Ctrl-C"):
                break
        assert len(addrs) == SERVERS, "cluster did not start: " + cluster.stderr.read()
        proxy = subprocess.Popen(
            [MBAL, "proxy", "--cluster", str(cluster_file), "-l", "127.0.0.1", "-p", "0", "-t", "2",
             "--print-ports"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        line = proxy.stdout.readline()
        assert line, "proxy did not print its port: " + proxy.stderr.read()
        host, port = json.loads(line)["main"].rsplit(":", 1)
        yield host, int(port), addrs
    finally:
        if proxy is not None:
            _stop(proxy)
        _stop(cluster)


def test_pymemcache_every_operation_through_the_proxy(proxied):
    from pymemcache.client.base import Client

    host, port, _ = proxied
    c = Client((host, port), connect_timeout=5, timeout=5)
    c.flush_all()
    assert c.set("k1", b"v1", expire=0, noreply=False)
    assert c.get("k1") == b"v1"
    assert c.add("k1", b"x", noreply=False) is False
    assert c.add("k2", b"v2", noreply=False) is True
    assert c.replace("k2", b"v2b", noreply=False) is True
    assert c.replace("nope", b"x", noreply=False) is False
    assert c.append("k2", b"!", noreply=False)
    assert c.prepend("k2", b"<", noreply=False)
    assert c.get("k2") == b"<v2b!"
    value, cas = c.gets("k2")
    assert value == b"<v2b!"
    assert c.cas("k2", b"new", cas, noreply=False) is True
    assert c.cas("k2", b"stale", cas, noreply=False) is False
    assert c.set("n", b"10", noreply=False)
    assert c.incr("n", 5) == 15
    assert c.decr("n", 20) == 0
    assert c.incr("missing", 1) is None
    assert c.touch("k1", 100, noreply=False) is True
    assert c.delete("k1", noreply=False) is True
    assert c.delete("k1", noreply=False) is False
    keys = {f"key{i}": f"value{i}".encode() for i in range(500)}
    assert c.set_many(keys, noreply=True) == []  # noreply: pipelined, no answers
    got = c.get_many(list(keys) + ["absent"])
    assert got == keys
    stats = c.stats()
    assert stats[b"cmd_get"] > 0
    proxy_stats = c.stats("proxy")
    requests = [v for k, v in proxy_stats.items() if k.endswith(b":requests")]
    assert len(requests) == SERVERS * WORKERS, proxy_stats
    assert c.version().startswith(b"1.6")
    c.close()


@pytest.mark.parametrize("binary", [False, True], ids=["text", "binary"])
def test_pylibmc_through_the_proxy(proxied, binary):
    import pylibmc

    host, port, _ = proxied
    c = pylibmc.Client([f"{host}:{port}"], binary=binary)
    data = {f"lib{i}": f"v{i}" * 10 for i in range(300)}
    assert c.set_multi(data) == []
    assert c.get_multi(list(data)) == data
    assert c.set("ctr", "1")
    assert c.incr("ctr") == 2
    assert c.decr("ctr", 2) == 0
    assert c.add("ctr", "x") is False
    c.set("blob", b"\x00\x01" * 1000)
    assert c.get("blob") == b"\x00\x01" * 1000
    assert c.delete_multi(list(data)[:100])
    assert c.get_multi(list(data)[:100]) == {}
    c.disconnect_all()


@pytest.mark.skipif(shutil.which("memccapable") is None, reason="libmemcached-tools not installed")
def test_memccapable_through_the_proxy(proxied):
    host, port, _ = proxied
    for flag in ("-a", "-b"):
        r = subprocess.run(
            ["memccapable", "-h", host, "-p", str(port), flag],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert r.returncode == 0, r.stdout + r.stderr
        assert "fail" not in r.stdout.lower(), r.stdout


def test_clients_during_cachelet_moves(proxied):
    """pymemcache reads its own writes through the proxy while every
    cachelet of every server moves to its other worker and back."""
    from pymemcache.client.base import Client

    host, port, addrs = proxied
    stop = threading.Event()
    moved = []
    errors = []

    def mover():
        socks = []
        try:
            for a in addrs:
                h, p = a.rsplit(":", 1)
                socks.append(socket.create_connection((h, int(p)), timeout=10))
            n = SERVERS * WORKERS * CPW
            rounds = 0
            while not stop.is_set() and rounds < 20:
                for cl in range(n):
                    server = cl % SERVERS
                    home = (cl // SERVERS) % WORKERS
                    to = 1 - home if rounds % 2 == 0 else home
                    s = socks[server]
                    s.sendall(f"mbal move {cl} {to}\r\n".encode())
                    reply = b""
                    while not reply.endswith(b"\r\n"):
                        chunk = s.recv(100)
                        assert chunk, "server closed"
                        reply += chunk
                    assert reply.startswith(b"MOVED "), reply
                    moved.append(cl)
                rounds += 1
        except Exception as e:  # reported by the main thread
            errors.append(e)
        finally:
            for s in socks:
                s.close()

    t = threading.Thread(target=mover)
    t.start()
    c = Client((host, port), connect_timeout=5, timeout=5)
    try:
        for i in range(3000):
            k = f"mv{i % 200}"
            v = f"{i}".encode()
            assert c.set(k, v, noreply=False)
            assert c.get(k) == v
            if i % 100 == 0:
                batch = {f"mb{i}-{j}": b"x" * j for j in range(1, 40)}
                assert c.set_many(batch, noreply=False) == []
                assert c.get_many(list(batch)) == batch
            if not t.is_alive():
                break
    finally:
        stop.set()
        t.join()
        c.close()
    assert not errors, errors
    assert moved, "no cachelet moved while the client ran"
