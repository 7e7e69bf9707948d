#!/usr/bin/env bash
# Installs LiteLLM's proxy (bench/requirements-litellm.txt) into .bench-venv-litellm, for the peer
# figure of the live benchmark. Never fails the benchmark: on any error it says why and exits 1,
# and bench/live_overhead.py prints "peer skipped" with the reason.
set -uo pipefail
cd "$(dirname "$0")/.."
req=bench/requirements-litellm.txt
venv=${BENCH_LITELLM_VENV:-.bench-venv-litellm}
stamp="$venv/.installed-$(sha256sum "$req" | cut -c1-16)"
[ -f "$stamp" ] && exit 0
py=$(command -v python3.11 || command -v python3) || { echo "no python3 for the LiteLLM venv" >&2; exit 1; }
if [ ! -x "$venv/bin/python" ]; then
  "$py" -m venv "$venv" || exit 1
  "$venv/bin/python" -m pip install -q --upgrade pip >/dev/null 2>&1
fi
echo "installing LiteLLM's proxy into $venv (once; a few minutes)" >&2
if "$venv/bin/python" -m pip install -q -r "$req" >"$venv/pip.log" 2>&1; then
  touch "$stamp"
else
  echo "pip install -r $req failed (see $venv/pip.log): $(tail -1 "$venv/pip.log")" >&2
  exit 1
fi
