#!/usr/bin/env python3
"""memcached `stats` over a plain text connection, for the scripts: one reader of the
`STAT name value ... END` answer instead of one per script.

    ask(sock, line)            send one command line, return the answer up to END (text)
    stats(addr, group="")      {name: value} of `stats [group]` at HOST:PORT
    cluster_addrs(file)        the servers' main addresses in a cluster file, in order

As a command: `mcstats.py HOST:PORT [GROUP] [OUT.json]` prints (or writes) the stats as JSON.
"""
import json
import re
import socket
import sys


def ask(sock, line):
    """Send `line` (no CRLF) and read until the answer ends with END."""
    sock.sendall(line.encode() + b"\r\n")
    buf = b""
    while not buf.endswith(b"END\r\n"):
        chunk = sock.recv(65536)
        if not chunk:
            break
        buf += chunk
    return buf.decode(errors="replace")


def parse(answer):
    """{name: value} of the STAT lines of an answer (the value is the rest of its line)."""
    out = {}
    for l in answer.splitlines():
        t = l.split(None, 2)
        if len(t) == 3 and t[0] == "STAT":
            out.setdefault(t[1], t[2])
    return out


def stats(addr, group="", timeout=5):
    host, port = addr.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=timeout) as s:
        return parse(ask(s, ("stats " + group).strip()))


def cluster_addrs(path):
    return re.findall(r'addr\s*=\s*"([^"]+)"', open(path).read())


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    st = stats(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "")
    if len(sys.argv) > 3:
        json.dump(st, open(sys.argv[3], "w"))
    else:
        print(json.dumps(st, indent=1))
