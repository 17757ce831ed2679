"""A standard client over TLS: pymemcache with an `ssl.SSLContext` against a
real `mbal server -Z` on loopback, with certificates made here by the
`cryptography` package (a CA, a server certificate for 127.0.0.1, a client
certificate): get/set, a wrong CA, a required client certificate, and a
certificate reload on SIGHUP.

The server binary comes from $MBAL_BIN (set by .ci/run / scripts/test.sh).
"""

import datetime
import ipaddress
import json
import os
import select
import signal
import ssl
import subprocess

import pytest

cryptography = pytest.importorskip("cryptography")

from cryptography import x509  # noqa: E402
from cryptography.hazmat.primitives import hashes, serialization  # noqa: E402
from cryptography.hazmat.primitives.asymmetric import ec  # noqa: E402
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID  # noqa: E402

MBAL = os.environ.get("MBAL_BIN", "target/release/mbal")


def _name(cn):
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _write(path, cert, key):
    path.with_suffix(".pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    path.with_suffix(".key").write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return str(path.with_suffix(".pem")), str(path.with_suffix(".key"))


class Pki:
    """A test CA writing its certificate and the ones it signs into `dir`."""

    def __init__(self, dir, tag):
        self.dir = dir
        self.key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.timezone.utc)
        self.name = _name(f"mbal pytest CA {tag}")
        self.cert = (
            x509.CertificateBuilder()
            .subject_name(self.name)
            .issuer_name(self.name)
            .public_key(self.key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(days=1))
            .not_valid_after(now + datetime.timedelta(days=30))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(self.key, hashes.SHA256())
        )
        self.ca, _ = _write(dir / f"ca-{tag}", self.cert, self.key)

    def issue(self, file, server):
        key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.timezone.utc)
        if server:
            san = [x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")]
            eku = ExtendedKeyUsageOID.SERVER_AUTH
        else:
            san = [x509.DNSName("client.test")]
            eku = ExtendedKeyUsageOID.CLIENT_AUTH
        cert = (
            x509.CertificateBuilder()
            .subject_name(_name(file))
            .issuer_name(self.name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(days=1))
            .not_valid_after(now + datetime.timedelta(days=30))
            .add_extension(x509.SubjectAlternativeName(san), critical=False)
            .add_extension(x509.ExtendedKeyUsage([eku]), critical=False)
            .sign(self.key, hashes.SHA256())
        )
        return _write(self.dir / file, cert, key)


def start(*extra):
    proc = subprocess.Popen(
        [MBAL, "server", "-p", "0", "-t", "2", "-m", "64", "--print-ports", *extra],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    line = proc.stdout.readline()
    if not line:
        proc.wait(timeout=10)
        raise AssertionError("server did not print its ports: " + proc.stderr.read())
    host, port = json.loads(line)["main"].rsplit(":", 1)
    return proc, (host, int(port))


def stop(proc):
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def context(ca, cert=None):
    ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=ca)
    if cert:
        ctx.load_cert_chain(*cert)
    return ctx


def client(addr, ctx):
    from pymemcache.client.base import Client

    return Client(addr, connect_timeout=5, timeout=5, tls_context=ctx)


@pytest.fixture
def pki(tmp_path):
    return Pki(tmp_path, "main")


def test_pymemcache_over_tls(pki, tmp_path):
    cert, key = pki.issue("server", True)
    proc, addr = start("-Z", "-o", f"ssl_chain_cert={cert},ssl_key={key}")
    try:
        c = client(addr, context(pki.ca))
        assert c.set("k", b"v", noreply=False)
        assert c.get("k") == b"v"
        keys = {f"key{i}": (f"value{i}" * 50).encode() for i in range(300)}
        assert c.set_many(keys, noreply=False) == []
        assert c.get_many(list(keys)) == keys
        assert c.incr("n", 1) is None
        assert c.stats(b"settings")[b"ssl_enabled"] == b"yes"
        # A client trusting another CA fails its handshake; the server goes on.
        other = Pki(tmp_path, "other")
        with pytest.raises(ssl.SSLError):
            client(addr, context(other.ca)).get("k")
        assert c.get("k") == b"v"
        assert client(addr, context(pki.ca)).get("k") == b"v"
        c.close()
    finally:
        stop(proc)


def test_pymemcache_with_a_required_client_certificate(pki):
    cert, key = pki.issue("server", True)
    me = pki.issue("me", False)
    proc, addr = start("-Z", "-o", f"ssl_chain_cert={cert},ssl_key={key},ssl_ca_cert={pki.ca},ssl_verify_mode=2")
    try:
        c = client(addr, context(pki.ca, me))
        assert c.set("m", b"tls", noreply=False)
        assert c.get("m") == b"tls"
        # Without a certificate: refused (TLS 1.3 reports it at the first read).
        from pymemcache.exceptions import MemcacheUnexpectedCloseError

        with pytest.raises((ssl.SSLError, ConnectionError, MemcacheUnexpectedCloseError)):
            client(addr, context(pki.ca)).get("m")
        assert c.get("m") == b"tls"
    finally:
        stop(proc)


def wait_for_log(proc, text, timeout=10):
    """Read the server's stderr until a line containing `text` (bounded)."""
    fd = proc.stderr
    seen = []
    while True:
        ready, _, _ = select.select([fd], [], [], timeout)
        assert ready, f"no log line {text!r} within {timeout}s; saw {seen}"
        line = fd.readline()
        assert line, f"server stderr closed; saw {seen}"
        seen.append(line)
        if text in line:
            return line


def test_sighup_reloads_the_certificate(pki, tmp_path):
    cert, key = pki.issue("server", True)
    proc, addr = start("-Z", "-o", f"ssl_chain_cert={cert},ssl_key={key}")
    try:
        before = client(addr, context(pki.ca))
        assert before.set("a", b"1", noreply=False)
        new = Pki(tmp_path, "new")
        new_cert, new_key = new.issue("fresh", True)
        os.replace(new_cert, cert)
        os.replace(new_key, key)
        proc.send_signal(signal.SIGHUP)
        wait_for_log(proc, "TLS certificates reloaded")
        assert proc.poll() is None, "SIGHUP must not stop a TLS server"
        assert client(addr, context(new.ca)).get("a") == b"1"
        with pytest.raises(ssl.SSLError):
            client(addr, context(pki.ca)).get("a")
        # The connection opened before the reload keeps its session.
        assert before.get("a") == b"1"
    finally:
        stop(proc)


def test_pymemcache_through_the_proxy_over_tls_both_sides(pki, tmp_path):
    """pymemcache -> TLS -> mbal proxy -> TLS (client certificate) -> mbal server."""
    cert, key = pki.issue("server", True)
    me = pki.issue("proxy-client", False)
    srv, saddr = start("-Z", "-o", f"ssl_chain_cert={cert},ssl_key={key},ssl_ca_cert={pki.ca},ssl_verify_mode=2")
    proxy = subprocess.Popen(
        [MBAL, "proxy", "--server", f"{saddr[0]}:{saddr[1]}", "--tls-ca", pki.ca, "--tls-cert", me[0],
         "--tls-key", me[1], "-l", "127.0.0.1", "-p", "0", "-t", "1", "--print-ports",
         "-Z", "-o", f"ssl_chain_cert={cert},ssl_key={key}"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        line = proxy.stdout.readline()
        assert line, "proxy did not print its port: " + proxy.stderr.read()
        host, port = json.loads(line)["main"].rsplit(":", 1)
        c = client((host, int(port)), context(pki.ca))
        keys = {f"p{i}": (f"v{i}" * 20).encode() for i in range(200)}
        assert c.set_many(keys, noreply=False) == []
        assert c.get_many(list(keys)) == keys
        assert c.stats(b"settings")[b"ssl_enabled"] == b"yes"
        # The data reached the server (through the proxy's TLS upstream).
        direct = client(saddr, context(pki.ca, me))
        assert direct.get("p7") == keys["p7"]
        # SIGHUP reloads the proxy's listener certificate; its upstreams go on.
        new = Pki(tmp_path, "proxy-new")
        new_cert, new_key = new.issue("proxy-fresh", True)
        os.replace(new_cert, cert)
        os.replace(new_key, key)
        proxy.send_signal(signal.SIGHUP)
        wait_for_log(proxy, "TLS certificates reloaded")
        assert client((host, int(port)), context(new.ca)).get("p7") == keys["p7"]
        assert proxy.poll() is None, "the proxy runs on"
        c.close()
    finally:
        stop(proxy)
        stop(srv)
