# Shared by the loopback benchmark scripts (source it; bash only).
# Starts mbal or stock memcached on a random loopback port, optionally pinned,
# and reads a server's CPU time. Kills only the server it started (by pid).
#
#   start_server SYSTEM THREADS CPUS   SYSTEM = memcached|mbal, or memcached-tls|mbal-tls (-Z with
#                                      $TLS_DIR/server.pem and server.key); CPUS = taskset list or "-" (not pinned)
#                                      sets PID and PORT; retries on a busy port
#   stop_server                        stops the server started last
#   cpu_ticks                          utime+stime of $PID in clock ticks
#   pin CPUS CMD...                    CMD under taskset, or as it is for CPUS "-"

cargo build --release --bin mbal >/dev/null 2>&1 || cargo build --release --bin mbal
BIN=${CARGO_TARGET_DIR:-$PWD/target}/release/mbal
command -v memcached >/dev/null || { echo "memcached is not installed (apt-get install memcached)" >&2; exit 1; }
MC_USER=(); [ "$(id -u)" = 0 ] && MC_USER=(-u nobody)
HZ=$(getconf CLK_TCK)
MEM=${MEM:-1024}
PID=""
PORT=""
stop_server() { [ -n "$PID" ] && kill "$PID" 2>/dev/null && wait "$PID" 2>/dev/null; PID=""; return 0; }
trap stop_server EXIT

pin() { local cpus=$1; shift; if [ "$cpus" = "-" ]; then "$@"; else taskset -c "$cpus" "$@"; fi; }

start_server() {
  local sys=$1 threads=$2 cpus=$3 pre=()
  # No function or subshell between us and the server: $! must be its pid.
  [ "$cpus" != "-" ] && pre=(taskset -c "$cpus")
  for _try in 1 2 3 4 5; do
    PORT=$((21000 + RANDOM % 20000))
    case $sys in
      memcached) "${pre[@]}" memcached "${MC_USER[@]}" -l 127.0.0.1 -p "$PORT" -U 0 -t "$threads" -m "$MEM" 2>/dev/null & ;;
      mbal) "${pre[@]}" "$BIN" server -l 127.0.0.1 -p "$PORT" -t "$threads" -m "$MEM" 2>/dev/null & ;;
      mbal-base) "${pre[@]}" "$MBAL_BASE" server -l 127.0.0.1 -p "$PORT" -t "$threads" -m "$MEM" 2>/dev/null & ;;
      memcached-tls) "${pre[@]}" memcached "${MC_USER[@]}" -l 127.0.0.1 -p "$PORT" -U 0 -t "$threads" -m "$MEM" \
        -Z -o "ssl_chain_cert=$TLS_DIR/server.pem,ssl_key=$TLS_DIR/server.key" 2>/dev/null & ;;
      mbal-tls) "${pre[@]}" "$BIN" server -l 127.0.0.1 -p "$PORT" -t "$threads" -m "$MEM" \
        -Z -o "ssl_chain_cert=$TLS_DIR/server.pem,ssl_key=$TLS_DIR/server.key" 2>/dev/null & ;;
    esac
    PID=$!
    for _ in $(seq 100); do
      kill -0 "$PID" 2>/dev/null || break
      (exec 3<>/dev/tcp/127.0.0.1/"$PORT") 2>/dev/null && return 0
      sleep 0.05
    done
    stop_server
  done
  echo "$sys did not start" >&2
  exit 1
}

cpu_ticks() { awk '{print $14+$15}' "/proc/$PID/stat"; }
