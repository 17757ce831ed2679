# Shared by the proxy benchmark scripts (source it; bash only): hold a process
# to QUOTA percent of one core with a CFS bandwidth quota, in a cgroup of its
# own (cgroup v1 `cpu` hierarchy if mounted, else cgroup v2 `cpu.max`),
# created here and removed by quota_cleanup. Without QUOTA, every function
# does nothing.
#
#   QUOTA=P (percent of one core), QUOTA_PERIOD_US (default 20000; the quota, P% of it, must be >= 1 ms)
#   quota_setup            creates the cgroup (call once; exits if cgroups are not writable)
#   quota_add PID          moves the process (all its threads, and the ones it starts later) in
#   quota_periods          "nr_periods nr_throttled" of the cgroup so far ("0 0" without QUOTA)
#   quota_cleanup          removes the cgroup (its processes must have exited)

QUOTA=${QUOTA:-}
QUOTA_PERIOD_US=${QUOTA_PERIOD_US:-20000}
QUOTA_CG=""

quota_setup() {
  [ -n "$QUOTA" ] || return 0
  local q=$(( QUOTA * QUOTA_PERIOD_US / 100 ))
  if [ "$q" -lt 1000 ]; then
    echo "QUOTA=$QUOTA% of QUOTA_PERIOD_US=$QUOTA_PERIOD_US is under the kernel's 1 ms minimum quota: raise the period" >&2
    exit 1
  fi
  if [ -f /sys/fs/cgroup/cpu/cpu.cfs_quota_us ]; then
    QUOTA_CG=/sys/fs/cgroup/cpu/mbal-bench-proxy.$$
    mkdir "$QUOTA_CG"
    echo "$QUOTA_PERIOD_US" >"$QUOTA_CG/cpu.cfs_period_us"
    echo "$q" >"$QUOTA_CG/cpu.cfs_quota_us"
  elif grep -qw cpu /sys/fs/cgroup/cgroup.controllers 2>/dev/null; then
    grep -qw cpu /sys/fs/cgroup/cgroup.subtree_control || echo +cpu >/sys/fs/cgroup/cgroup.subtree_control
    QUOTA_CG=/sys/fs/cgroup/mbal-bench-proxy.$$
    mkdir "$QUOTA_CG"
    echo "$q $QUOTA_PERIOD_US" >"$QUOTA_CG/cpu.max"
  else
    echo "QUOTA needs a writable cgroup cpu controller (v1 /sys/fs/cgroup/cpu or v2 cpu.max)" >&2
    exit 1
  fi
}

quota_add() { [ -z "$QUOTA_CG" ] || echo "$1" >"$QUOTA_CG/cgroup.procs"; }

quota_periods() {
  if [ -n "$QUOTA_CG" ]; then
    awk '$1=="nr_periods"{p=$2} $1=="nr_throttled"{t=$2} END{print p+0, t+0}' "$QUOTA_CG/cpu.stat"
  else
    echo 0 0
  fi
}

quota_cleanup() {
  if [ -n "$QUOTA_CG" ]; then rmdir "$QUOTA_CG" 2>/dev/null || echo "could not remove cgroup $QUOTA_CG" >&2; fi
  QUOTA_CG=""
  return 0
}
