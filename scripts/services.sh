#!/usr/bin/env bash
# Make sure the machine's PostgreSQL and Redis answer on localhost, for the tests.
# Starts them when stopped; installs them with apt-get when missing and we are
# root on Debian; otherwise says exactly what to install.
set -euo pipefail

port_open() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }
wait_port() { for _ in $(seq 1 60); do port_open "$1" && return 0; sleep 0.5; done; return 1; }
can_apt() { [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; }

if ! port_open 5432; then
  if ! ls /etc/postgresql/*/main >/dev/null 2>&1; then
    if can_apt; then
      echo "installing PostgreSQL (apt-get)…"
      apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql >/dev/null
    else
      echo "PostgreSQL is not running on 127.0.0.1:5432 and cannot be installed here: install postgresql and start it" >&2
      exit 1
    fi
  fi
  ver=$(ls /etc/postgresql | sort -V | tail -n1)
  echo "starting PostgreSQL $ver…"
  pg_ctlcluster --skip-systemctl-redirect "$ver" main start || true
  wait_port 5432 || { echo "PostgreSQL did not come up on 127.0.0.1:5432" >&2; exit 1; }
fi
# Tests connect as postgres/postgres over TCP; make that work whatever the auth method.
if command -v psql >/dev/null 2>&1 && ! PGPASSWORD=postgres psql -h 127.0.0.1 -U postgres -c 'select 1' -tA >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ]; then
    su postgres -c "psql -qc \"ALTER USER postgres PASSWORD 'postgres'\"" >/dev/null
  fi
fi

if ! port_open 6379; then
  if ! command -v redis-server >/dev/null 2>&1; then
    if can_apt; then
      echo "installing Redis (apt-get)…"
      apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null
    else
      echo "Redis is not running on 127.0.0.1:6379 and cannot be installed here: install redis-server and start it" >&2
      exit 1
    fi
  fi
  echo "starting Redis…"
  mkdir -p /var/lib/redis /var/log/redis 2>/dev/null || true
  redis-server --daemonize yes --bind 127.0.0.1 -::1 --port 6379 --save "" --appendonly no \
    --dir /var/lib/redis --logfile /var/log/redis/ci.log
  wait_port 6379 || { echo "Redis did not come up on 127.0.0.1:6379" >&2; exit 1; }
fi
