"""Real memcached client libraries (that mbal did not write) against a real
`mbal server` on loopback: pymemcache (pure Python, text protocol), pylibmc
(libmemcached, text and binary), and libmemcached's command-line tools,
including `memccapable`, libmemcached's protocol conformance checker.

The server binary comes from $MBAL_BIN (set by .ci/run / scripts/test.sh).
"""

import json
import os
import shutil
import subprocess

import pytest

MBAL = os.environ.get("MBAL_BIN", "target/release/mbal")


@pytest.fixture(scope="module", params=[1, 2], ids=["t1", "t2"])
def server(request):
    proc = subprocess.Popen(
        [MBAL, "server", "-p", "0", "-t", str(request.param), "-m", "64", "--print-ports"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        line = proc.stdout.readline()
        assert line, "server did not print its ports: " + proc.stderr.read()
        ports = json.loads(line)
        host, port = ports["main"].rsplit(":", 1)
        yield host, int(port), ports
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_pymemcache_every_operation(server):
    from pymemcache.client.base import Client

    host, port, _ = server
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
    keys = {f"key{i}": f"value{i}".encode() for i in range(200)}
    assert c.set_many(keys, noreply=False) == []
    got = c.get_many(list(keys) + ["absent"])
    assert got == keys
    stats = c.stats()
    assert stats[b"curr_items"] >= 200
    assert c.version().startswith(b"1.6")
    c.close()


def test_pylibmc_text_and_binary(server):
    import pylibmc

    host, port, _ = server
    for binary in (False, True):
        mc = pylibmc.Client([f"{host}:{port}"], binary=binary)
        mc.flush_all()
        mc.set("a", "1")
        assert mc.get("a") == "1"
        mc.set("blob", b"\x00\x01" * 1000)
        assert mc.get("blob") == b"\x00\x01" * 1000
        assert mc.add("a", "2") is False
        assert mc.replace("a", "3") is True
        assert mc.get("a") == "3"
        mc.set("c", 41)
        assert mc.incr("c") == 42
        assert mc.decr("c", 2) == 40
        data = {f"m{i}": i for i in range(100)}
        mc.set_multi(data)
        assert mc.get_multi(list(data)) == data
        assert mc.delete("a") is True
        assert mc.get("a") is None
        mc.disconnect_all()


@pytest.mark.skipif(shutil.which("memccapable") is None, reason="libmemcached-tools not installed")
def test_memccapable_ascii_and_binary(server):
    host, port, _ = server
    for flag in ("-a", "-b"):
        r = subprocess.run(
            ["memccapable", "-h", host, "-p", str(port), flag],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert r.returncode == 0, r.stdout + r.stderr
        assert "fail" not in r.stdout.lower(), r.stdout


@pytest.mark.skipif(shutil.which("memccp") is None, reason="libmemcached-tools not installed")
def test_libmemcached_cli_tools(server, tmp_path):
    host, port, _ = server
    srv = f"--servers={host}:{port}"
    f = tmp_path / "file.txt"
    f.write_text("hello from memccp\n")
    subprocess.run(["memccp", srv, str(f)], check=True, timeout=30)
    out = subprocess.run(["memccat", srv, "file.txt"], check=True, capture_output=True, text=True, timeout=30)
    # memccat prints the value followed by a newline of its own.
    assert out.stdout == "hello from memccp\n\n"
    subprocess.run(["memcexist", srv, "file.txt"], check=True, timeout=30)
    subprocess.run(["memcrm", srv, "file.txt"], check=True, timeout=30)
    assert subprocess.run(["memcexist", srv, "file.txt"], timeout=30).returncode != 0
    st = subprocess.run(["memcstat", srv], check=True, capture_output=True, text=True, timeout=30)
    assert "curr_items" in st.stdout
    subprocess.run(["memcflush", srv], check=True, timeout=30)
    subprocess.run(["memcping", srv], check=True, timeout=30)


# Multi-gets on one line longer than mbal's 64 KiB line limit (issue 7 §1):
# answered key by key as the line arrives, every key counted in get_hits.

LONG_LINE = 64 * 1024


def _stats(host, port):
    from pymemcache.client.base import Client

    c = Client((host, port), connect_timeout=5, timeout=5)
    try:
        return {k.decode(): v for k, v in c.stats().items()}
    finally:
        c.close()


def _long_keys(prefix, n):
    keys = [f"{prefix}:long-line-key:{i:05}" for i in range(n)]
    assert sum(len(k) + 1 for k in keys) > LONG_LINE, "the get line must exceed the line limit"
    return keys


def test_pymemcache_get_many_5000_keys(server):
    from pymemcache.client.base import Client

    host, port, _ = server
    c = Client((host, port), connect_timeout=5, timeout=30)
    keys = _long_keys("pm", 5000)
    data = {k: f"v{i}".encode() for i, k in enumerate(keys)}
    assert c.set_many(data, noreply=False) == []
    before = _stats(host, port)
    assert c.get_many(keys + ["pm:absent"]) == data
    got = c.gets_many(keys)
    assert {k: v for k, (v, _) in got.items()} == data
    after = _stats(host, port)
    assert after["get_hits"] - before["get_hits"] == 2 * len(keys)
    assert after["get_misses"] - before["get_misses"] == 1
    c.close()


def test_pylibmc_get_multi_5000_keys_text_and_binary(server):
    import pylibmc

    host, port, _ = server
    for binary in (False, True):
        mc = pylibmc.Client([f"{host}:{port}"], binary=binary)
        keys = _long_keys(f"pl{int(binary)}", 5000)
        data = {k: i for i, k in enumerate(keys)}
        assert mc.set_multi(data) == []
        before = _stats(host, port)
        assert mc.get_multi(keys + ["pl:absent"]) == data
        after = _stats(host, port)
        assert after["get_hits"] - before["get_hits"] == len(keys)
        assert after["get_misses"] - before["get_misses"] == 1
        mc.disconnect_all()


@pytest.mark.skipif(shutil.which("memcslap") is None, reason="libmemcached-tools not installed")
def test_memcslap_mget_text_and_binary(server):
    host, port, _ = server
    n = 10000
    for flags in ([], ["--binary"]):
        before = _stats(host, port)
        r = subprocess.run(
            ["memcslap", f"--servers={host}:{port}", "--test=mget", f"--execute-number={n}", "--verbose"] + flags,
            capture_output=True,
            text=True,
            timeout=120,
        )
        out = r.stdout + r.stderr
        assert r.returncode == 0, out
        assert "error" not in out.lower() and "fail" not in out.lower(), out
        after = _stats(host, port)
        # memcslap loads n keys, then fetches all n in one multi-get.
        assert after["cmd_set"] - before["cmd_set"] == n, out
        assert after["get_hits"] - before["get_hits"] == n, out
        assert after["get_misses"] - before["get_misses"] == 0, out
