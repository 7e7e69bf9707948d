#!/usr/bin/env bash
# `make drill`: the relay on three hosts — Linux network namespaces on this machine — disturbed while
# OpenAI, Anthropic and native batches run across them (docs/many-hosts.md).
#
#   db host  (netns …-db, 10.231.0.1, a bridge): its own PostgreSQL (initdb into a temporary directory),
#            its own Redis (AOF on), the fake provider, and the drill's orchestrator (scripts/drill/run.py)
#   app hosts (netns …-a1 10.231.0.11, …-a2 10.231.0.12, a veth each to the bridge): web + item worker +
#            control worker each, beat on a1; payloads in PostgreSQL (the `db` store: no shared disk)
#
# Prints one line per scenario — `scenario NAME: items N, final N, usage events N, lost N, duplicated N,
# recovered in S s` — and exits 1 when any is lost or duplicated. Where network namespaces can't be made,
# prints `drill: skipped: <reason>` and exits 0. Addresses exist only inside the namespaces made here;
# the machine's own PostgreSQL and Redis are never touched. On any exit (success, failure, Ctrl-C,
# SIGTERM) every process in those namespaces is killed, the namespaces (with their veths and bridge)
# deleted and the temporary directory removed.
#
# Knobs: DRILL_RECORDS (records per batch, 60), DRILL_DELAY_MS (provider delay, 500),
# DRILL_PARTITION_SECONDS (30), DRILL_LEASE_SECONDS (10), DRILL_SCENARIOS (comma list, all four),
# DRILL_LOGS=<dir> (copy the processes' logs there when the drill fails), DRILL_POOLER=pgbouncer (the app
# hosts reach PostgreSQL through PgBouncer in transaction mode on the database host; default: directly).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD

skip() { echo "drill: skipped: $*"; exit 0; }
fail() { echo "drill: $*" >&2; exit 2; }

[ "$(uname -s)" = Linux ] || skip "network namespaces are Linux only"
[ "$(id -u)" = 0 ] || skip "not root (creating network namespaces needs root)"
command -v ip >/dev/null 2>&1 || skip "no 'ip' command (install iproute2)"
command -v unshare >/dev/null 2>&1 || skip "no 'unshare' command (install util-linux)"

PGBIN=$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -n1 || true)
[ -n "$PGBIN" ] && [ -x "$PGBIN/initdb" ] || fail "no PostgreSQL server binaries under /usr/lib/postgresql/*/bin (apt-get install postgresql)"
command -v redis-server >/dev/null 2>&1 || fail "no redis-server (apt-get install redis-server)"
if [ -n "${DRILL_POOLER:-}" ]; then
  command -v pgbouncer >/dev/null 2>&1 || fail "DRILL_POOLER=${DRILL_POOLER} but no pgbouncer (apt-get install pgbouncer)"
fi
id postgres >/dev/null 2>&1 || fail "no 'postgres' user to run PostgreSQL as (it refuses root; apt-get install postgresql makes one)"
bash scripts/venv.sh requirements.txt

# What a drill killed outright (SIGKILL: no trap runs) left behind: its namespaces and temporary directory,
# named after its process id. Removed once that process is gone; a drill still running keeps its own.
for ns in $(ip netns list 2>/dev/null | awk '{print $1}' | grep -E '^rdrill[0-9]+-(db|a1|a2)$' || true); do
  owner=${ns#rdrill}
  owner=${owner%%-*}
  [ -d "/proc/$owner" ] && continue  # still running (or its id reused: then left for a later run)
  echo "drill: removing $ns, left by drill $owner (no longer running)" >&2
  pids=$(ip netns pids "$ns" 2>/dev/null || true)
  [ -n "$pids" ] && kill -9 $pids 2>/dev/null || true
  sleep 0.5
  ip netns del "$ns" 2>/dev/null || true
  rm -rf "${TMPDIR:-/tmp}/relay-drill-$owner".*
done

TAG="rdrill$$"
NS_DB="$TAG-db" NS_A1="$TAG-a1" NS_A2="$TAG-a2"
MADE=()
TMP=""

cleanup() {
  local rc=$?
  trap - EXIT INT TERM
  if [ -n "$TMP" ] && [ -f "$TMP/db/pg/data/postmaster.pid" ]; then  # its own shared memory goes with it
    setpriv --reuid=postgres --regid=postgres --init-groups -- "$PGBIN/pg_ctl" -D "$TMP/db/pg/data" stop -m immediate >/dev/null 2>&1 || true
  fi
  for ns in "${MADE[@]}"; do  # only the processes inside namespaces this run made: all of them ours
    pids=$(ip netns pids "$ns" 2>/dev/null || true)
    [ -n "$pids" ] && kill -9 $pids 2>/dev/null || true
  done
  for ns in "${MADE[@]}"; do
    for _ in 1 2 3 4 5 6 7 8 9 10; do
      [ -z "$(ip netns pids "$ns" 2>/dev/null || true)" ] && break
      sleep 0.2
    done
    ip netns del "$ns" 2>/dev/null || true  # its veth ends and bridge go with it
  done
  [ -n "$TMP" ] && rm -rf "$TMP"
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# The first namespace doubles as the probe: where it can't be made (a container without CAP_SYS_ADMIN,
# no /run/netns), the drill can't run here.
if ! err=$(ip netns add "$NS_DB" 2>&1); then
  skip "cannot create a network namespace: ${err:-ip netns add failed}"
fi
MADE+=("$NS_DB")
for ns in "$NS_A1" "$NS_A2"; do
  ip netns add "$ns"
  MADE+=("$ns")
done

TMP=$(mktemp -d "${TMPDIR:-/tmp}/relay-drill-$$.XXXXXX")
chmod 755 "$TMP"  # PostgreSQL runs as `postgres` below it
mkdir -p "$TMP/db" "$TMP/a1" "$TMP/a2"

# Wiring: a bridge in the database host; each app host's eth0 is one end of a veth whose other end
# (to-a1, to-a2) is a port of that bridge. Both ends are created inside their namespaces.
ip -n "$NS_DB" link add br0 type bridge
ip -n "$NS_DB" addr add 10.231.0.1/24 dev br0
for n in 1 2; do
  ns_var="NS_A$n"
  ip -n "$NS_DB" link add "to-a$n" type veth peer name eth0 netns "${!ns_var}"
  ip -n "$NS_DB" link set "to-a$n" master br0 up
  ip -n "${!ns_var}" addr add "10.231.0.1$n/24" dev eth0
  ip -n "${!ns_var}" link set eth0 up
  ip -n "${!ns_var}" link set lo up
done
ip -n "$NS_DB" link set br0 up
ip -n "$NS_DB" link set lo up

export DRILL_TMP="$TMP" DRILL_NS_DB="$NS_DB" DRILL_NS_A1="$NS_A1" DRILL_NS_A2="$NS_A2" DRILL_PGBIN="$PGBIN"
export PYTHONPATH="$ROOT/scripts:$ROOT"
set +e
ip netns exec "$NS_DB" "$ROOT/.venv/bin/python" -m drill.run
rc=$?
set -e
exit "$rc"
