"""Standard client libraries authenticating against `mbal server -Y FILE`:
pymemcache with memcached's ASCII auth (its first request is a `set` whose
value is "user password") and pylibmc (libmemcached) with SASL PLAIN over
the binary protocol. docs/operations.md, "Authentication".

The server binary comes from $MBAL_BIN (set by .ci/run / scripts/test.sh).
"""

import glob
import json
import os
import subprocess
import sys

import pytest

MBAL = os.environ.get("MBAL_BIN", "target/release/mbal")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    d = tmp_path_factory.mktemp("auth")
    users = d / "users"
    users.write_text("foo:bar\nsecond:pa55word\n")
    proc = subprocess.Popen(
        [MBAL, "server", "-p", "0", "-t", "2", "-m", "64", "-Y", str(users), "-S", "--print-ports"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        line = proc.stdout.readline()
        assert line, "server did not print its ports: " + proc.stderr.read()
        host, port = json.loads(line)["main"].rsplit(":", 1)
        yield host, int(port)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_pymemcache_ascii_auth(server):
    from pymemcache.client.base import Client
    from pymemcache.exceptions import MemcacheClientError

    c = Client(server, connect_timeout=5, timeout=5, default_noreply=False)
    # No password: refused, the connection stays.
    with pytest.raises(MemcacheClientError, match="unauthenticated"):
        c.get("k")
    # Wrong password.
    with pytest.raises(MemcacheClientError, match="authentication failure"):
        c.set("auth", b"foo wrong")
    # The right one: memcached's ASCII auth is a set of "user password".
    assert c.set("auth", b"foo bar") is True
    assert c.set("k", b"v") is True
    assert c.get("k") == b"v"
    assert c.get_many(["k", "absent"]) == {"k": b"v"}
    assert c.incr("n", 1) is None
    stats = c.stats()
    assert stats[b"auth_cmds"] >= 2 and stats[b"auth_errors"] >= 1
    c.close()


PYLIBMC_SASL = r"""
import sys, pylibmc
addr = sys.argv[1]
assert pylibmc.support_sasl, "this pylibmc has no SASL"
c = pylibmc.Client([addr], binary=True, username="second", password="pa55word")
assert c.set("sasl-k", b"sasl-v")
assert c.get("sasl-k") == b"sasl-v"
c.set_multi({f"m{i}": str(i).encode() for i in range(50)})
assert c.get_multi([f"m{i}" for i in range(50)])["m7"] == b"7"
for bad in [pylibmc.Client([addr], binary=True, username="second", password="wrong"),
            pylibmc.Client([addr], binary=True)]:
    try:
        bad.set("sasl-k", b"x")
    except pylibmc.Error:
        pass
    else:
        raise AssertionError("served without the right password")
print("ok")
"""


def test_pylibmc_sasl_plain(server):
    """libmemcached's SASL client picks PLAIN from SASL_LIST_MECHS and
    sends it with SASL_AUTH. pylibmc's wheel carries its own libsasl2, which
    looks for plugins where its build put them: point it at the system's
    (SASL_PATH is read once, at import, so this runs in a process of its own)."""
    plugins = sorted(glob.glob("/usr/lib/*/sasl2/libplain.so*"))
    if not plugins:
        pytest.skip("Cyrus SASL's PLAIN plugin is not installed (libsasl2-modules)")
    env = dict(os.environ, SASL_PATH=os.path.dirname(plugins[0]))
    host, port = server
    r = subprocess.run(
        [sys.executable, "-c", PYLIBMC_SASL, f"{host}:{port}"], env=env, capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stdout + r.stderr
