#!/usr/bin/env bash
# Create .venv and install the pinned requirements (again only when they change).
# Usage: scripts/venv.sh requirements.txt|requirements-dev.txt
set -euo pipefail
cd "$(dirname "$0")/.."
req=${1:-requirements.txt}
py=${PYTHON:-}
if [ -z "$py" ]; then
  for cand in python3.11 python3; do
    if command -v "$cand" >/dev/null 2>&1; then py=$cand; break; fi
  done
fi
[ -n "$py" ] || { echo "Python 3.11 is needed (python3.11 or python3 on PATH)" >&2; exit 1; }
"$py" -c 'import sys; sys.exit(0 if sys.version_info[:2] >= (3, 11) else 1)' \
  || { echo "Python 3.11+ is needed; $py is $("$py" --version)" >&2; exit 1; }
if [ ! -x .venv/bin/python ]; then
  "$py" -m venv .venv
  .venv/bin/python -m pip install -q --upgrade pip
fi
stamp=".venv/.installed-$(cat "$req" requirements.txt | sha256sum | cut -c1-16)-$(basename "$req")"
if [ ! -f "$stamp" ]; then
  .venv/bin/python -m pip install -q -r "$req"
  touch "$stamp"
fi
