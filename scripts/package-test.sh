#!/usr/bin/env bash
# The Debian package's test (docs/operations.md "Package and service"): builds it with
# scripts/package.sh (or takes MBAL_DEB=path), checks it with dpkg-deb --info/--contents,
# verifies the systemd units with systemd-analyze (skipped with a message when it is not
# installed), extracts it into a throw-away root (dpkg -x) and runs the installed binary with
# the installed /etc/mbal/mbal.toml on a loopback port as systemd would (NOTIFY_SOCKET set):
# it must report READY=1, answer `version` and its metrics endpoint, and stop on SIGTERM with
# STOPPING=1 and status 0.
#   MBAL_DEB_PROFILE=dev   package a debug build (faster; the default is release)
set -euo pipefail
cd "$(dirname "$0")/.."
fail() { echo "package-test: FAIL: $*" >&2; exit 1; }

deb="${MBAL_DEB:-}"
if [ -z "$deb" ]; then
  scripts/package.sh
  deb=$(tail -n 1 target/mbal-deb/deb-path)
fi
[ -f "$deb" ] || fail "no package at $deb"
echo "package-test: $deb"

info=$(dpkg-deb --info "$deb")
for want in "Package: mbal" "Depends: libc6" "postinst" "prerm" "postrm" "conffiles"; do
  grep -q "$want" <<<"$info" || fail "dpkg-deb --info lacks '$want'"
done
contents=$(dpkg-deb --contents "$deb")
for path in ./usr/bin/mbal ./etc/mbal/mbal.toml ./etc/mbal/coordinator.env \
  ./lib/systemd/system/mbal.service ./lib/systemd/system/mbal-coordinator.service \
  ./usr/lib/sysusers.d/mbal.conf ./usr/share/doc/mbal/copyright; do
  grep -q " $path\$" <<<"$contents" || fail "dpkg-deb --contents lacks $path"
done
grep -Eq '^-rwxr-xr-x (root/root|0/0) .* ./usr/bin/mbal$' <<<"$contents" || fail "/usr/bin/mbal is not root-owned 0755"
echo "package-test: dpkg-deb --info/--contents ok"

root=$(mktemp -d)
trap 'rm -rf "$root"' EXIT
dpkg -x "$deb" "$root"
dpkg-deb --ctrl-tarfile "$deb" | tar -xO ./conffiles | grep -qx /etc/mbal/mbal.toml || fail "mbal.toml is not a conffile"

# The maintainer scripts parse; the sysusers snippet makes the mbal user (in the throw-away root).
ctrl="$root/DEBIAN"
dpkg-deb --control "$deb" "$ctrl"
for s in postinst prerm postrm; do sh -n "$ctrl/$s" || fail "$s does not parse"; done
if command -v systemd-sysusers >/dev/null; then
  mkdir -p "$root/etc" && touch "$root/etc/passwd" "$root/etc/group"
  systemd-sysusers --root="$root" "$root/usr/lib/sysusers.d/mbal.conf" >/dev/null 2>&1 || fail "systemd-sysusers"
  grep -q '^mbal:x:[0-9]*:[0-9]*:.*:/usr/sbin/nologin$' "$root/etc/passwd" || fail "no mbal user from the sysusers snippet"
  echo "package-test: maintainer scripts parse; the sysusers snippet creates the mbal user"
else
  echo "package-test: maintainer scripts parse; SKIP systemd-sysusers (not installed)"
fi

if command -v systemd-analyze >/dev/null; then
  # The units as installed, their ExecStart pointed at the extracted binary (verify checks it
  # exists); any warning fails the test (verify itself exits 0 on unknown keys).
  mkdir "$root/units"
  for u in mbal.service mbal-coordinator.service; do
    sed "s|/usr/bin/mbal|$root/usr/bin/mbal|g" "$root/lib/systemd/system/$u" >"$root/units/$u"
    out=$(systemd-analyze verify "$root/units/$u" 2>&1) || fail "systemd-analyze verify $u: $out"
    [ -z "$out" ] || fail "systemd-analyze verify $u: $out"
  done
  echo "package-test: systemd-analyze verify ok ($(systemd-analyze security --offline=yes "$root/units/mbal.service" 2>/dev/null | grep -o 'Overall exposure level.*' || echo 'no security report'))"
else
  echo "package-test: SKIP systemd-analyze verify (systemd-analyze is not installed)"
fi

python3 - "$root" <<'PY'
import json, os, signal, socket, subprocess, sys, time, urllib.request
root = sys.argv[1]
exe, conf = f"{root}/usr/bin/mbal", f"{root}/etc/mbal/mbal.toml"
deadline = lambda s: time.monotonic() + s
notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
path = f"{root}/notify.sock"
notify.bind(path)
notify.settimeout(10)
env = dict(os.environ, NOTIFY_SOCKET=path)
# The installed config, on a free loopback port (the command line wins over the file).
p = subprocess.Popen([exe, "server", "--config", conf, "-p", "0", "-l", "127.0.0.1", "-t", "2",
                      "--metrics-listen", "127.0.0.1:0", "--print-ports"], stdout=subprocess.PIPE, env=env)
try:
    msg = notify.recv(4096).decode()
    assert "READY=1" in msg, msg
    ports = json.loads(p.stdout.readline())
    host, port = ports["main"].rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=5) as c:
        c.sendall(b"version\r\n")
        reply = c.recv(100)
    assert reply.startswith(b"VERSION "), reply
    print("package-test: installed mbal with the installed config:", reply.decode().strip())
    text = urllib.request.urlopen(f"http://{ports['metrics']}/metrics", timeout=5).read().decode()
    assert "\nmbal_up 1\n" in text, text[:500]
    print("package-test: its /metrics answers (mbal_up 1)")
    p.send_signal(signal.SIGTERM)
    msg = notify.recv(4096).decode()
    assert "STOPPING=1" in msg, msg
    rc = p.wait(timeout=5)
    assert rc == 0, f"exit status {rc}"
    print("package-test: READY=1 once listening, STOPPING=1 and status 0 on SIGTERM")
finally:
    if p.poll() is None:
        p.kill()
        p.wait()
PY
echo "package-test: all passed"
