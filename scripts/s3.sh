#!/usr/bin/env bash
# An S3-compatible server on loopback for the s3 payload store's tests: moto's server mode (moto[server],
# requirements-dev.txt), in memory, answering on 127.0.0.1 only. Idempotent: when something already
# answers S3 on the port, nothing is started. Prints the endpoint to use as RELAY_S3_ENDPOINT_URL
# (or RELAY_TEST_S3_ENDPOINT, which makes tests/test_storage_s3.py use it instead of starting its own).
#   scripts/s3.sh [PORT]        # default: $RELAY_TEST_S3_PORT or 9390
#   scripts/s3.sh stop [PORT]   # stops the server this script started (by its pid file)
set -euo pipefail
cd "$(dirname "$0")/.."

action=start
if [ "${1:-}" = stop ]; then action=stop; shift; fi
port="${1:-${RELAY_TEST_S3_PORT:-9390}}"
pidfile="/tmp/relay-s3-moto-$port.pid"
logfile="/tmp/relay-s3-moto-$port.log"
endpoint="http://127.0.0.1:$port"

answers() {  # an S3 answer (ListBuckets XML), not just an open port
  .venv/bin/python - "$endpoint" <<'PY' 2>/dev/null
import sys, urllib.request
try:
    body = urllib.request.urlopen(sys.argv[1] + "/", timeout=2).read()
except Exception:
    sys.exit(1)
sys.exit(0 if b"ListAllMyBucketsResult" in body else 1)
PY
}

if [ "$action" = stop ]; then
  if [ -f "$pidfile" ]; then
    kill "$(cat "$pidfile")" 2>/dev/null || true
    rm -f "$pidfile"
    echo "s3: stopped the server on $endpoint"
  fi
  exit 0
fi

if answers; then
  echo "s3: already answering at $endpoint"
  exit 0
fi
if [ ! -x .venv/bin/moto_server ]; then
  echo "s3: .venv/bin/moto_server is missing: .venv/bin/pip install -r requirements-dev.txt (moto[server])" >&2
  exit 1
fi
setsid .venv/bin/moto_server -H 127.0.0.1 -p "$port" >"$logfile" 2>&1 < /dev/null &
echo $! > "$pidfile"
for _ in $(seq 1 60); do
  if answers; then
    echo "s3: moto answering at $endpoint (pid $(cat "$pidfile"), log $logfile)"
    exit 0
  fi
  sleep 0.5
done
echo "s3: moto did not answer at $endpoint within 30 s; see $logfile" >&2
exit 1
