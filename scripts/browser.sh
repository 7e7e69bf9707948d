#!/usr/bin/env bash
# Chromium (Debian's package) for tests/test_pages_browser.py. Idempotent: does nothing when a
# chromium binary is already on PATH. Called by the test command before pytest; on a machine where
# it cannot install (not root, not Debian), it says so and the browser test skips outside CI.
set -euo pipefail
for bin in chromium chromium-browser; do
  if command -v "$bin" >/dev/null 2>&1; then exit 0; fi
done
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
  echo "scripts/browser.sh: chromium is not installed; install Debian's 'chromium' package (as root: apt-get install -y chromium)" >&2
  exit 0
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends chromium fonts-dejavu-core >/dev/null
command -v chromium >/dev/null
