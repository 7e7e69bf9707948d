#!/usr/bin/env bash
# A throwaway PgBouncer for the tests and local runs (docs/pooler.md): transaction mode, on 127.0.0.1,
# in front of the machine's PostgreSQL (127.0.0.1:5432), trust authentication as that PostgreSQL uses.
#
#   scripts/pgbouncer.sh [start]   start it unless it runs; prints PGBOUNCER_PORT=<port>
#   scripts/pgbouncer.sh stop      stop the one this script started
#   scripts/pgbouncer.sh status    PGBOUNCER_PORT=<port> and exit 0 when it runs, exit 1 when not
#
# Knobs: PGBOUNCER_PORT (6432; when another program holds it, the next free port from 6433 on),
# PGBOUNCER_DIR (/tmp/relay-pgbouncer: config, pid, log), PGBOUNCER_UPSTREAM_HOST / _PORT (127.0.0.1 / 5432),
# PGBOUNCER_USERS (postgres relay: the roles allowed in), PGBOUNCER_POOL_SIZE (20 server connections per
# database and role). Installs Debian's package (1.18) when pgbouncer is missing and this runs as root.
# PgBouncer refuses to run as root: as root it drops to the `postgres` user (else `nobody`).
set -euo pipefail

ACTION=${1:-start}
DIR=${PGBOUNCER_DIR:-/tmp/relay-pgbouncer}
UPSTREAM_HOST=${PGBOUNCER_UPSTREAM_HOST:-127.0.0.1}
UPSTREAM_PORT=${PGBOUNCER_UPSTREAM_PORT:-5432}
USERS=${PGBOUNCER_USERS:-postgres relay}
POOL_SIZE=${PGBOUNCER_POOL_SIZE:-20}

say() { echo "pgbouncer.sh: $*" >&2; }

listening() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

running_pid() {
  # The pid of the PgBouncer this script started, if it still runs (never another program's).
  local pid
  [ -f "$DIR/pgbouncer.pid" ] || return 1
  pid=$(cat "$DIR/pgbouncer.pid" 2>/dev/null) || return 1
  [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null || return 1
  [ "$(cat "/proc/$pid/comm" 2>/dev/null)" = pgbouncer ] || return 1
  echo "$pid"
}

status() {
  local port
  running_pid >/dev/null || return 1
  port=$(cat "$DIR/port" 2>/dev/null) || return 1
  listening "$port" || return 1
  echo "PGBOUNCER_PORT=$port"
}

case "$ACTION" in
  status) status; exit $? ;;
  stop)
    if pid=$(running_pid); then
      kill "$pid"
      for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
      say "stopped ($pid)"
    fi
    exit 0
    ;;
  start) ;;
  *) say "usage: $0 [start|stop|status]"; exit 2 ;;
esac

if status; then exit 0; fi  # already running: idempotent

BIN=$(command -v pgbouncer || true)
[ -z "$BIN" ] && [ -x /usr/sbin/pgbouncer ] && BIN=/usr/sbin/pgbouncer
if [ -z "$BIN" ]; then
  if [ "$(id -u)" != 0 ]; then
    say "pgbouncer is not installed and this is not root: apt-get install pgbouncer"
    exit 3
  fi
  say "installing pgbouncer (apt-get)"
  export DEBIAN_FRONTEND=noninteractive
  apt-get install -y -q pgbouncer >/dev/null 2>&1 || { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q pgbouncer >/dev/null; }
  BIN=/usr/sbin/pgbouncer
  [ -x "$BIN" ] || { say "could not install pgbouncer"; exit 3; }
fi

PORT=${PGBOUNCER_PORT:-6432}
if listening "$PORT"; then
  if [ -n "${PGBOUNCER_PORT:-}" ]; then
    say "port $PORT is taken by another program (PGBOUNCER_PORT)"
    exit 4
  fi
  for candidate in $(seq 6433 6532); do
    if ! listening "$candidate"; then PORT=$candidate; break; fi
  done
  listening "$PORT" && { say "no free port in 6432-6532"; exit 4; }
fi

mkdir -p "$DIR"
RUN_AS=""
if [ "$(id -u)" = 0 ]; then
  RUN_AS=postgres
  id postgres >/dev/null 2>&1 || RUN_AS=nobody
  chown "$RUN_AS" "$DIR"
fi

: >"$DIR/userlist.txt"
for user in $USERS; do echo "\"$user\" \"\"" >>"$DIR/userlist.txt"; done

cat >"$DIR/pgbouncer.ini" <<EOF
; Written by scripts/pgbouncer.sh: a throwaway PgBouncer for tests (docs/pooler.md).
[databases]
; Every database name, as the same database of the machine's PostgreSQL.
* = host=$UPSTREAM_HOST port=$UPSTREAM_PORT

[pgbouncer]
listen_addr = 127.0.0.1
listen_port = $PORT
unix_socket_dir =
pool_mode = transaction
; The local PostgreSQL trusts loopback; the names allowed in are listed in the auth file.
auth_type = trust
auth_file = $DIR/userlist.txt
admin_users = postgres
stats_users = postgres
max_client_conn = 1000
default_pool_size = $POOL_SIZE
server_login_retry = 2
; No ignore_startup_parameters: a client that sends connect-time \`options\` is refused, as in production.
server_idle_timeout = 60
logfile = $DIR/pgbouncer.log
pidfile = $DIR/pgbouncer.pid
${RUN_AS:+user = $RUN_AS}
EOF
chmod 644 "$DIR/pgbouncer.ini" "$DIR/userlist.txt"
[ -n "$RUN_AS" ] && chown "$RUN_AS" "$DIR/pgbouncer.ini" "$DIR/userlist.txt"
rm -f "$DIR/pgbouncer.pid"
echo "$PORT" >"$DIR/port"

"$BIN" -d -q "$DIR/pgbouncer.ini"
for _ in $(seq 100); do
  if status; then exit 0; fi
  sleep 0.1
done
say "pgbouncer did not start; its log:"
tail -n 20 "$DIR/pgbouncer.log" >&2 || true
exit 1
